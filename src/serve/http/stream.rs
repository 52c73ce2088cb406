//! The streaming answer: the engine's pieces as `chat.completion.chunk` server-sent events,
//! ending with the finish chunk, the usage chunk when asked for, and `data: [DONE]`.
//!
//! Dropping the stream (the client disconnected) drops the receiver, which the engine
//! notices at its next piece of text and stops generating.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::response::sse::Event;
use futures_core::Stream;
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::{ChatCompletionChunk, ChunkChoice, Delta, FunctionDelta, ToolCallDelta, Usage};
use super::convert::{finish_reason, function_name};
use super::error::ApiError;
use super::logprobs::{ChoiceLogprobs, TokenLogprob};
use super::routes::failure_error;
use super::sse::{ENGINE_GONE, EventQueue, WorkerEvents, poll_events};
use super::worker::{Piece, WorkerMsg};

/// What every chunk of one completion shares.
pub(crate) struct ChunkMeta {
    /// `chatcmpl-...`
    pub id: String,
    /// Unix time of the request.
    pub created: u64,
    /// The model ID.
    pub model: String,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Leave the reasoning out (`reasoning.exclude`).
    pub exclude_reasoning: bool,
    /// Send the log probabilities of the content with it.
    pub logprobs: bool,
}

/// The stream of events of one completion.
pub(crate) struct ChunkStream {
    rx: UnboundedReceiver<WorkerMsg>,
    meta: ChunkMeta,
    events: EventQueue,
    /// Recipient and index of the tool call being streamed.
    tool: Option<(String, usize)>,
    tool_calls: usize,
    /// Log probabilities for the next content piece.
    pending_logprobs: Vec<TokenLogprob>,
    new_call_id: Box<dyn FnMut() -> String + Send>,
    started: Instant,
}

impl ChunkStream {
    /// A stream of the messages on `rx`; it starts with the role chunk.
    pub fn new(
        rx: UnboundedReceiver<WorkerMsg>,
        meta: ChunkMeta,
        new_call_id: Box<dyn FnMut() -> String + Send>,
    ) -> Self {
        let mut s = ChunkStream {
            rx,
            meta,
            events: EventQueue::default(),
            tool: None,
            tool_calls: 0,
            pending_logprobs: Vec::new(),
            new_call_id,
            started: Instant::now(),
        };
        s.push_delta(
            Delta { role: Some("assistant"), content: Some(String::new()), ..Delta::default() },
            None,
        );
        s
    }

    fn push_chunk(&mut self, choices: Vec<ChunkChoice>, usage: Option<Usage>) {
        let chunk = ChatCompletionChunk {
            id: &self.meta.id,
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: &self.meta.model,
            choices,
            usage,
        };
        self.events.push_json(&chunk);
    }

    fn push_delta(&mut self, delta: Delta, finish_reason: Option<&'static str>) {
        self.push_chunk(vec![ChunkChoice { index: 0, delta, logprobs: None, finish_reason }], None);
    }

    /// A content chunk, with the log probabilities of its tokens when they were asked for.
    fn push_content(&mut self, text: String) {
        let logprobs = std::mem::take(&mut self.pending_logprobs);
        let logprobs = self.meta.logprobs.then_some(ChoiceLogprobs { content: logprobs, refusal: None });
        let delta = Delta { content: Some(text), ..Delta::default() };
        self.push_chunk(vec![ChunkChoice { index: 0, delta, logprobs, finish_reason: None }], None);
    }

    fn push_tool_delta(&mut self, call: ToolCallDelta) {
        self.push_delta(Delta { tool_calls: Some(vec![call]), ..Delta::default() }, None);
    }

    fn on_piece(&mut self, piece: Piece) {
        match piece {
            Piece::Reasoning(_) if self.meta.exclude_reasoning => {}
            Piece::Reasoning(t) => {
                let delta =
                    Delta { reasoning_content: Some(t.clone()), reasoning: Some(t), ..Delta::default() };
                self.push_delta(delta, None);
            }
            Piece::Content(t) => self.push_content(t),
            Piece::ToolCall { recipient, text } => {
                // Each call opens with an empty piece (see `ChatEvent::ToolCall`).
                let index = match &self.tool {
                    Some((r, i)) if *r == recipient && !text.is_empty() => *i,
                    _ => {
                        // A new call: its ID and name first, as OpenAI streams them.
                        let index = self.tool_calls;
                        self.tool_calls += 1;
                        let id = (self.new_call_id)();
                        self.push_tool_delta(ToolCallDelta {
                            index,
                            id: Some(id),
                            kind: Some("function"),
                            function: FunctionDelta {
                                name: Some(function_name(&recipient).to_string()),
                                arguments: String::new(),
                            },
                        });
                        self.tool = Some((recipient, index));
                        index
                    }
                };
                if text.is_empty() {
                    return;
                }
                self.push_tool_delta(ToolCallDelta {
                    index,
                    id: None,
                    kind: None,
                    function: FunctionDelta { name: None, arguments: text },
                });
            }
        }
    }

    fn on_message(&mut self, msg: WorkerMsg) {
        match msg {
            WorkerMsg::Started => {}
            WorkerMsg::Logprobs(entries) => self.pending_logprobs = entries,
            WorkerMsg::Piece(piece) => self.on_piece(piece),
            WorkerMsg::Done(Ok(fin)) => {
                let reason = finish_reason(fin.stop, fin.called_tool());
                self.push_delta(Delta::default(), Some(reason));
                if self.meta.include_usage {
                    let usage = Usage::new(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens);
                    self.push_chunk(Vec::new(), Some(usage));
                }
                tracing::info!(
                    "stream {}: {} prompt tokens ({} cached) + {} generated, {reason}, in {:.2} s",
                    self.meta.id,
                    fin.prompt_tokens,
                    fin.cached_tokens,
                    fin.completion_tokens,
                    self.started.elapsed().as_secs_f64()
                );
                self.events.finish();
            }
            WorkerMsg::Done(Err(failure)) => self.events.fail(&self.meta.id, failure_error(failure)),
        }
    }
}

impl WorkerEvents for ChunkStream {
    fn queue(&mut self) -> &mut EventQueue {
        &mut self.events
    }

    fn rx(&mut self) -> &mut UnboundedReceiver<WorkerMsg> {
        &mut self.rx
    }

    fn on_message(&mut self, msg: WorkerMsg) {
        ChunkStream::on_message(self, msg)
    }

    fn on_engine_gone(&mut self) {
        self.events.fail(&self.meta.id, ApiError::unavailable(ENGINE_GONE));
    }
}

impl Stream for ChunkStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        poll_events(&mut *self, cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::serve::http::sse::testing::{data, drain};
    use crate::serve::http::worker::Failure;

    fn stream(rx: UnboundedReceiver<WorkerMsg>) -> ChunkStream {
        let meta = ChunkMeta {
            id: "chatcmpl-test".into(),
            created: 0,
            model: "m".into(),
            include_usage: false,
            exclude_reasoning: false,
            logprobs: false,
        };
        ChunkStream::new(rx, meta, Box::new(|| "call_test".into()))
    }

    #[test]
    fn an_engine_that_stops_mid_answer_ends_the_chunks_with_an_error_then_done() {
        let (tx, rx) = unbounded_channel();
        let mut s = stream(rx);
        tx.send(WorkerMsg::Piece(Piece::Content("Hel".into()))).unwrap();
        drop(tx);
        let events = drain(&mut s);
        // The role chunk, the content chunk, then the error and `[DONE]`.
        assert_eq!(events.len(), 4, "{events:?}");
        assert!(events[1].contains("Hel"), "{}", events[1]);
        assert_eq!(events[2..], [data(&ApiError::unavailable(ENGINE_GONE).body()), data("[DONE]")]);
    }

    #[test]
    fn a_failed_turn_ends_the_chunks_with_its_error_and_reads_no_further_message() {
        let (tx, rx) = unbounded_channel();
        let mut s = stream(rx);
        tx.send(WorkerMsg::Done(Err(Failure::Engine("boom".into())))).unwrap();
        // Sent after the end: never read, and the stream ends without waiting for the sender.
        tx.send(WorkerMsg::Piece(Piece::Content("late".into()))).unwrap();
        let events = drain(&mut s);
        assert_eq!(events.len(), 3, "{events:?}");
        assert_eq!(
            events[1..],
            [data(&failure_error(Failure::Engine("boom".into())).body()), data("[DONE]")]
        );
    }
}
