//! The streaming answer of `POST /v1/responses`: typed server-sent events (`event: TYPE`,
//! `data: {"type": TYPE, "sequence_number": N, ...}`), in OpenAI's order:
//!
//! `response.created`, `response.in_progress`; per output item `response.output_item.added`,
//! for text `response.content_part.added`, the deltas (`response.reasoning_text.delta`,
//! `response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`,
//! `response.content_part.done`, `response.output_item.done`; then `response.completed`,
//! whose response has status `incomplete` at the token limit (not OpenAI's separate
//! `response.incomplete` event, on which the SDKs' stream helpers do not finish), or
//! `response.failed` when the engine failed.
//! No `[DONE]`: the Responses API ends a stream by closing it.
//!
//! Dropping the stream (the client disconnected) drops the receiver, which the engine
//! notices and stops generating; a response cut so is not stored.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::response::sse::Event;
use futures_core::Stream;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::logprobs::TokenLogprob;
use super::responses::{
    Added, Ending, ItemKind, OutputBuilder, ResponseMeta, Step, last_item_status, output_text, stored, usage,
};
use super::responses_api::ContentPart;
use super::routes::failure_error;
use super::sse::{ENGINE_GONE, EventQueue, WorkerEvents, poll_events};
use super::store::Store;
use super::worker::{Finished, WorkerMsg};
use crate::chat::ChatFormat;

/// The stream of events of one response.
pub(crate) struct ResponseStream {
    rx: UnboundedReceiver<WorkerMsg>,
    meta: ResponseMeta,
    output: OutputBuilder,
    format: ChatFormat,
    /// Where to keep the finished response (with what the request added), if it is stored.
    store: Option<(Arc<Mutex<Store>>, Added)>,
    events: EventQueue,
    sequence: u64,
}

impl ResponseStream {
    /// A stream of the messages on `rx`; it starts with `response.created` and
    /// `response.in_progress`.
    pub fn new(
        rx: UnboundedReceiver<WorkerMsg>,
        meta: ResponseMeta,
        output: OutputBuilder,
        format: ChatFormat,
        store: Option<(Arc<Mutex<Store>>, Added)>,
    ) -> Self {
        let mut s =
            ResponseStream { rx, meta, output, format, store, events: EventQueue::default(), sequence: 0 };
        let response = s.meta.object(Vec::new(), Ending::InProgress);
        s.push("response.created", json!({ "response": response }));
        s.push("response.in_progress", json!({ "response": response }));
        s
    }

    /// Queues an event of `kind` with the fields of `body` (an object), numbered.
    fn push(&mut self, kind: &str, mut body: Value) {
        if let Some(fields) = body.as_object_mut() {
            fields.insert("type".into(), Value::from(kind));
            fields.insert("sequence_number".into(), Value::from(self.sequence));
        }
        self.sequence += 1;
        self.events.push(Event::default().event(kind).data(body.to_string()));
    }

    fn on_steps(&mut self, steps: Vec<Step>) {
        for step in steps {
            match step {
                Step::Opened(i) => self.on_opened(i),
                Step::Delta(i, delta, logprobs) => self.on_delta(i, delta, logprobs),
                Step::Closed(i, status) => self.on_closed(i, status),
            }
        }
    }

    fn kind_and_id(&self, index: usize) -> Option<(ItemKind, String)> {
        self.output.items().get(index).map(|item| (item.kind.clone(), item.id.clone()))
    }

    fn on_opened(&mut self, index: usize) {
        let Some((kind, id)) = self.kind_and_id(index) else { return };
        let item = self.output.item(index, "in_progress", false);
        self.push("response.output_item.added", json!({ "output_index": index, "item": item }));
        let part = match kind {
            ItemKind::Reasoning => ContentPart::ReasoningText { text: String::new() },
            ItemKind::Text => output_text(String::new(), Vec::new()),
            ItemKind::Call { .. } => return,
        };
        self.push(
            "response.content_part.added",
            json!({ "item_id": id, "output_index": index, "content_index": 0, "part": part }),
        );
    }

    fn on_delta(&mut self, index: usize, delta: String, logprobs: Vec<TokenLogprob>) {
        let Some((kind, id)) = self.kind_and_id(index) else { return };
        match kind {
            ItemKind::Reasoning => self.push(
                "response.reasoning_text.delta",
                json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": delta }),
            ),
            ItemKind::Text => self.push(
                "response.output_text.delta",
                json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": delta,
                        "logprobs": logprobs }),
            ),
            ItemKind::Call { .. } => self.push(
                "response.function_call_arguments.delta",
                json!({ "item_id": id, "output_index": index, "delta": delta }),
            ),
        }
    }

    fn on_closed(&mut self, index: usize, status: &'static str) {
        let Some(item) = self.output.items().get(index) else { return };
        let (kind, id, text) = (item.kind.clone(), item.id.clone(), item.text.clone());
        let logprobs = item.logprobs.clone();
        let whole = self.output.item(index, status, true);
        let part = match &kind {
            ItemKind::Reasoning => {
                self.push(
                    "response.reasoning_text.done",
                    json!({ "item_id": id, "output_index": index, "content_index": 0, "text": text }),
                );
                Some(ContentPart::ReasoningText { text })
            }
            ItemKind::Text => {
                self.push(
                    "response.output_text.done",
                    json!({ "item_id": id, "output_index": index, "content_index": 0, "text": text,
                            "logprobs": logprobs }),
                );
                Some(output_text(text, logprobs))
            }
            ItemKind::Call { recipient, .. } => {
                let name = super::convert::function_name(recipient).to_string();
                self.push(
                    "response.function_call_arguments.done",
                    json!({ "item_id": id, "output_index": index, "name": name, "arguments": text }),
                );
                None
            }
        };
        if let Some(part) = part {
            self.push(
                "response.content_part.done",
                json!({ "item_id": id, "output_index": index, "content_index": 0, "part": part }),
            );
        }
        self.push("response.output_item.done", json!({ "output_index": index, "item": whole }));
    }

    /// The turn ended: the open items closed, the response stored if asked, and
    /// `response.completed`, the stream's last event.
    fn on_finished(&mut self, fin: &Finished) {
        let last = last_item_status(fin.stop);
        let mut steps = Vec::new();
        self.output.close(last, &mut steps);
        self.on_steps(steps);
        let usage = usage(&self.format, fin);
        let object = self.meta.object(self.output.output(last), Ending::Finished(fin, usage));
        if let Some((store, added)) = self.store.take() {
            let entry = stored(&object, added, &self.output);
            if let Ok(mut store) = store.lock() {
                store.insert(object.id.clone(), entry);
            }
        }
        tracing::info!(
            "stream {}: {} input tokens ({} cached) + {} generated, {}",
            object.id,
            usage.input_tokens,
            usage.input_tokens_details.cached_tokens,
            usage.output_tokens,
            object.status
        );
        // `response.completed` also for an incomplete response (its status says so), as the
        // gpt-oss reference server sends it: the SDKs' stream helpers wait for that event.
        self.push("response.completed", json!({ "response": object }));
        self.events.end();
    }

    /// The turn failed (or the engine stopped): the open items closed as incomplete and
    /// `response.failed`, the stream's last event.
    fn on_failed(&mut self, message: String) {
        tracing::warn!("stream {} failed: {message}", self.meta.id);
        let mut steps = Vec::new();
        self.output.close("incomplete", &mut steps);
        self.on_steps(steps);
        let object = self.meta.object(self.output.output("incomplete"), Ending::Failed(message));
        self.push("response.failed", json!({ "response": object }));
        self.events.end();
    }

    fn on_message(&mut self, msg: WorkerMsg) {
        match msg {
            WorkerMsg::Started => {}
            WorkerMsg::Logprobs(logprobs) => self.output.push_logprobs(logprobs),
            WorkerMsg::Piece(piece) => {
                let mut steps = Vec::new();
                self.output.push(piece, &mut steps);
                self.on_steps(steps);
            }
            WorkerMsg::Done(Ok(fin)) => self.on_finished(&fin),
            WorkerMsg::Done(Err(failure)) => self.on_failed(failure_error(failure).message),
        }
    }
}

impl WorkerEvents for ResponseStream {
    fn queue(&mut self) -> &mut EventQueue {
        &mut self.events
    }

    fn rx(&mut self) -> &mut UnboundedReceiver<WorkerMsg> {
        &mut self.rx
    }

    fn on_message(&mut self, msg: WorkerMsg) {
        ResponseStream::on_message(self, msg)
    }

    fn on_engine_gone(&mut self) {
        self.on_failed(ENGINE_GONE.into());
    }
}

impl Stream for ResponseStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        poll_events(&mut *self, cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::chat::{HarmonyEncoding, ReasoningEffort};
    use crate::serve::http::responses::Echo;
    use crate::serve::http::sse::testing::drain;
    use crate::serve::http::worker::Piece;

    #[test]
    fn an_engine_that_stops_mid_response_ends_it_with_response_failed_and_no_done() {
        let (tx, rx) = unbounded_channel();
        let echo = Echo {
            instructions: None,
            max_output_tokens: None,
            previous_response_id: None,
            effort: ReasoningEffort::Medium,
            store: false,
            temperature: 1.0,
            top_p: 1.0,
            tool_choice: json!("auto"),
            tools: Vec::new(),
            metadata: json!({}),
        };
        let meta = ResponseMeta { id: "resp_test".into(), created_at: 0, model: "m".into(), echo };
        let output = OutputBuilder::new(|prefix| format!("{prefix}_test"));
        let mut s = ResponseStream::new(rx, meta, output, ChatFormat::Harmony(HarmonyEncoding::new()), None);
        tx.send(WorkerMsg::Piece(Piece::Content("Hel".into()))).unwrap();
        drop(tx);
        let events = drain(&mut s);
        let kinds: Vec<&str> = events
            .iter()
            .map(|e| {
                ["response.failed", "response.output_text.delta", "response.created"]
                    .into_iter()
                    // `Debug` shows the event's bytes escaped: its first line is `event: KIND\n`.
                    .find(|k| e.contains(&format!("\"event: {k}\\n")))
                    .unwrap_or("")
            })
            .collect();
        assert_eq!(kinds.first(), Some(&"response.created"), "{events:?}");
        assert!(kinds.contains(&"response.output_text.delta"), "{events:?}");
        // The last event says why, and the Responses API has no `[DONE]`.
        assert_eq!(kinds.last(), Some(&"response.failed"), "{events:?}");
        assert!(events.last().is_some_and(|e| e.contains(ENGINE_GONE)), "{events:?}");
        assert!(!events.iter().any(|e| e.contains("[DONE]")), "{events:?}");
    }
}
