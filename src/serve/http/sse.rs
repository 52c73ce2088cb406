//! The one loop that turns a job's worker messages into server-sent events, shared by the
//! chat, completions and Responses streams: each stream only says how a message becomes
//! events ([`WorkerEvents::on_message`]) and what the client hears when the engine drops the
//! job without an outcome ([`WorkerEvents::on_engine_gone`]).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::task::{Context, Poll};

use axum::response::sse::Event;
use tokio::sync::mpsc::UnboundedReceiver;

use super::worker::WorkerMsg;

/// A stream of events translated from one job's worker messages.
pub(crate) trait WorkerEvents {
    /// Events ready to be sent, oldest first.
    fn pending(&mut self) -> &mut VecDeque<Event>;
    /// Whether the stream has said everything (no more messages are read).
    fn done(&self) -> bool;
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
        if let Some(event) = s.pending().pop_front() {
            return Poll::Ready(Some(Ok(event)));
        }
        if s.done() {
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
