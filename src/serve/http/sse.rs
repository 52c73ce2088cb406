//! The one loop that turns a job's worker messages into server-sent events, shared by the
//! chat, completions and Responses streams: each stream only says how a message becomes
//! events ([`WorkerEvents::on_message`]) and what the client hears when the engine drops the
//! job without an outcome ([`WorkerEvents::on_engine_gone`]), into its [`EventQueue`].

use std::collections::VecDeque;
use std::convert::Infallible;
use std::task::{Context, Poll};

use axum::response::sse::Event;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::worker::WorkerMsg;

/// The events of one stream waiting to be sent, oldest first, and whether its last event is
/// queued (then no more messages are read).
#[derive(Default)]
pub(crate) struct EventQueue {
    pending: VecDeque<Event>,
    done: bool,
}

impl EventQueue {
    /// Queues one event.
    pub fn push(&mut self, event: Event) {
        self.pending.push_back(event);
    }

    /// Queues `value` as the JSON data of one event; a value that cannot be serialized is
    /// logged and left out (the stream goes on).
    pub fn push_json<T: Serialize>(&mut self, value: &T) {
        match serde_json::to_string(value) {
            Ok(json) => self.push(Event::default().data(json)),
            Err(e) => tracing::error!("could not serialize a chunk: {e}"),
        }
    }

    /// Marks the end: nothing follows the events queued so far.
    pub fn end(&mut self) {
        self.done = true;
    }

    /// Ends a chat or completions stream: `data: [DONE]`, its last event.
    pub fn finish(&mut self) {
        self.push(Event::default().data("[DONE]"));
        self.end();
    }

    /// Ends a chat or completions stream that failed: the error's body, then `[DONE]`. The
    /// failure is logged with the stream's `id`.
    pub fn fail(&mut self, id: &str, error: ApiError) {
        tracing::warn!("stream {id} failed: {}", error.message);
        self.push(Event::default().data(error.body()));
        self.finish();
    }
}

/// A stream of events translated from one job's worker messages.
pub(crate) trait WorkerEvents {
    /// The stream's events waiting to be sent.
    fn queue(&mut self) -> &mut EventQueue;
    /// The job's messages.
    fn rx(&mut self) -> &mut UnboundedReceiver<WorkerMsg>;
    /// Translates one message into pending events (and marks the end when it is one).
    fn on_message(&mut self, msg: WorkerMsg);
    /// The engine dropped the job without an outcome (it stopped): queue the error events
    /// and mark the end.
    fn on_engine_gone(&mut self);
}

/// [`futures_core::Stream::poll_next`] of a [`WorkerEvents`] stream: pending events first,
/// then messages as they arrive, until the end is marked.
pub(crate) fn poll_events<S: WorkerEvents>(
    s: &mut S,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Event, Infallible>>> {
    loop {
        let queue = s.queue();
        if let Some(event) = queue.pending.pop_front() {
            return Poll::Ready(Some(Ok(event)));
        }
        if queue.done {
            return Poll::Ready(None);
        }
        match s.rx().poll_recv(cx) {
            Poll::Ready(Some(msg)) => s.on_message(msg),
            Poll::Ready(None) => s.on_engine_gone(),
            Poll::Pending => return Poll::Pending,
        }
    }
}

/// The message a client gets when the engine stops before its answer is complete.
pub(crate) const ENGINE_GONE: &str = "the engine stopped before the answer was complete";

/// Test helpers for the streams built on [`poll_events`].
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Every event `s` yields until its end, as their `Debug` text (`Event` has no other view
    /// of what it will send); fails if the stream waits for a message (all must be sent and
    /// the sender dropped or the end reached).
    pub(crate) fn drain<S: WorkerEvents>(s: &mut S) -> Vec<String> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        loop {
            match poll_events(s, &mut cx) {
                Poll::Ready(Some(Ok(event))) => out.push(format!("{event:?}")),
                Poll::Ready(None) => return out,
                Poll::Pending => panic!("the stream waits for a message after {} events", out.len()),
            }
        }
    }

    /// The `Debug` text of a data event holding `data`, as [`drain`] gives it.
    pub(crate) fn data(data: &str) -> String {
        format!("{:?}", Event::default().data(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_chat_stream_ends_with_the_error_then_done_and_nothing_after() {
        let mut q = EventQueue::default();
        q.push_json(&serde_json::json!({ "n": 1 }));
        q.fail("chatcmpl-1", ApiError::unavailable("gone"));
        assert!(q.done);
        let got: Vec<String> = q.pending.iter().map(|e| format!("{e:?}")).collect();
        assert_eq!(
            got,
            [r#"{"n":1}"#.to_string(), ApiError::unavailable("gone").body(), "[DONE]".to_string()]
                .map(|d| testing::data(&d))
        );
    }
}
