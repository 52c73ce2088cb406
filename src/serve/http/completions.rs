//! `POST /v1/completions`, OpenAI's legacy completions: a raw prompt (text or token IDs)
//! continued with no chat format, over the same queue, cache and cancellation as chat.
//!
//! The request is checked by [`plan`] before anything is tokenized; the text prompt is
//! tokenized with special-token strings (`<|start|>`, ...) read as those tokens unless the
//! request says `"special_tokens": false`, so a client that renders Harmony itself can send
//! the rendered text. The answer is the generated text up to a turn's stop token
//! (`<|return|>`, `<|call|>`, `<|endoftext|>`), as one `text_completion` or a stream of
//! them ([`CompletionStream`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::sse::Event;
use futures_core::Stream;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::{StreamOptions, Usage};
use super::convert::{self, SamplingFields};
use super::error::ApiError;
use super::raw::RawText;
use super::routes::failure_error;
use super::sse::{ENGINE_GONE, EventQueue, WorkerEvents, poll_events};
use super::worker::{Finished, Piece, WorkerMsg};
use crate::chat::{TextTokenizer, VOCAB_SIZE};
use crate::sample::SamplingParams;

/// OpenAI's default `max_tokens` for completions.
pub(crate) const DEFAULT_MAX_TOKENS: usize = 16;

/// `POST /v1/completions`. Unknown fields are ignored, `model` and `user` among them.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct CompletionRequest {
    /// A string, a list of token IDs, or a list holding one of those.
    pub prompt: Option<Value>,
    /// Most tokens to generate; default 16.
    pub max_tokens: Option<u64>,
    /// Softmax temperature, 0..=2; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass, (0, 1].
    pub top_p: Option<f32>,
    /// Extension: keep the k most likely tokens (0 or -1: off).
    pub top_k: Option<i64>,
    /// Extension: drop tokens less likely than `min_p` times the best one.
    pub min_p: Option<f32>,
    /// Extension: multiplicative repetition penalty (1: off).
    pub repetition_penalty: Option<f32>,
    /// Seed of the sampler.
    pub seed: Option<serde_json::Number>,
    /// Stream the text as server-sent events.
    pub stream: Option<bool>,
    /// Stream settings.
    pub stream_options: Option<StreamOptions>,
    /// Put the prompt's text before the generated text.
    pub echo: Option<bool>,
    /// Text after the insertion point: refused (no fill-in-the-middle).
    pub suffix: Option<Value>,
    /// Number of choices; only 1.
    pub n: Option<u64>,
    /// Candidates to choose from; only 1.
    pub best_of: Option<u64>,
    /// Stop sequences; not supported yet.
    pub stop: Option<Value>,
    /// Log probabilities (a count here); not supported yet.
    pub logprobs: Option<Value>,
    /// Not supported yet (non-zero is refused).
    pub frequency_penalty: Option<f32>,
    /// Not supported yet (non-zero is refused).
    pub presence_penalty: Option<f32>,
    /// Not supported yet (a non-empty map is refused).
    pub logit_bias: Option<Value>,
    /// Extension: whether special-token strings in a text prompt are those tokens
    /// (default true); false reads them as plain text.
    pub special_tokens: Option<bool>,
    /// Extension (as vLLM): leave special tokens out of the generated text (default false).
    pub skip_special_tokens: Option<bool>,
    /// Extension (as vLLM): return the prompt and generated token IDs.
    pub return_token_ids: Option<bool>,
}

/// The prompt of a request, before tokenizing.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PromptInput {
    /// Text, to be tokenized.
    Text(String),
    /// Token IDs, checked against the vocabulary.
    Ids(Vec<u32>),
}

/// A checked completions request.
#[derive(Debug, Clone)]
pub(crate) struct CompletionPlan {
    /// The prompt.
    pub prompt: PromptInput,
    /// Read special-token strings in a text prompt as those tokens.
    pub special_tokens: bool,
    /// Sampling settings (validated).
    pub sampling: SamplingParams,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Add a usage chunk to the stream.
    pub include_usage: bool,
    /// Put the prompt's text before the generated text.
    pub echo: bool,
    /// Return token IDs (extension).
    pub return_token_ids: bool,
    /// How generated tokens become text.
    pub text: RawText,
}

/// Checks a request; `seed` is used when it has none.
pub(crate) fn plan(req: CompletionRequest, seed: u64) -> Result<CompletionPlan, ApiError> {
    refuse_unsupported(&req)?;
    let sampling = convert::sampling(
        &SamplingFields {
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            min_p: req.min_p,
            repetition_penalty: req.repetition_penalty,
            seed: req.seed.as_ref(),
            // Refused above until raw completions carry them (see `refuse_unsupported`).
            presence_penalty: None,
            frequency_penalty: None,
            logit_bias: None,
            logprobs: None,
        },
        seed,
    )?;
    let max_tokens = match req.max_tokens {
        None => DEFAULT_MAX_TOKENS,
        Some(0) => return Err(ApiError::invalid(Some("max_tokens"), "max_tokens must be at least 1")),
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
    };
    let prompt = prompt_input(req.prompt)?;
    Ok(CompletionPlan {
        prompt,
        special_tokens: req.special_tokens.unwrap_or(true),
        sampling,
        max_tokens,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        echo: req.echo.unwrap_or(false),
        return_token_ids: req.return_token_ids.unwrap_or(false),
        text: RawText { skip_special_tokens: req.skip_special_tokens.unwrap_or(false) },
    })
}

/// Refuses what this endpoint does not do, with code `unsupported_parameter`.
fn refuse_unsupported(req: &CompletionRequest) -> Result<(), ApiError> {
    for (name, value) in [("n", req.n), ("best_of", req.best_of)] {
        if let Some(v) = value
            && v != 1
        {
            return Err(ApiError::unsupported(
                name,
                format!("{name} must be 1 (one choice per request), got {v}"),
            ));
        }
    }
    let empty_text = |v: &Option<Value>| match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(_) => false,
    };
    if !empty_text(&req.suffix) {
        return Err(ApiError::unsupported("suffix", "suffix (fill-in-the-middle) is not supported"));
    }
    convert::check_stop(req.stop.as_ref())?;
    match &req.logprobs {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) if n.as_u64() == Some(0) => {}
        Some(_) => return Err(ApiError::unsupported("logprobs", "log probabilities are not supported")),
    }
    for (name, value) in
        [("frequency_penalty", req.frequency_penalty), ("presence_penalty", req.presence_penalty)]
    {
        if value.is_some_and(|v| v != 0.0) {
            return Err(ApiError::unsupported(
                name,
                format!("{name} is not supported (only 0); see `repetition_penalty`"),
            ));
        }
    }
    match &req.logit_bias {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) if map.is_empty() => {}
        Some(_) => return Err(ApiError::unsupported("logit_bias", "logit_bias is not supported")),
    }
    Ok(())
}

/// The prompt of a request: a string, a list of token IDs, or a list holding one of those.
fn prompt_input(prompt: Option<Value>) -> Result<PromptInput, ApiError> {
    let one = match prompt {
        None | Some(Value::Null) => return Err(ApiError::invalid(Some("prompt"), "`prompt` is required")),
        Some(Value::Array(mut items)) if items.first().is_some_and(|v| v.is_string() || v.is_array()) => {
            if items.len() > 1 {
                return Err(ApiError::unsupported(
                    "prompt",
                    format!(
                        "one prompt per request: got a list of {} prompts (send them as separate requests)",
                        items.len()
                    ),
                ));
            }
            items.remove(0)
        }
        Some(v) => v,
    };
    let input = match one {
        Value::String(text) => PromptInput::Text(text),
        Value::Array(ids) => PromptInput::Ids(token_ids(&ids)?),
        _ => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "prompt must be a string, a list of token IDs, or a list holding one of those",
            ));
        }
    };
    let empty = match &input {
        PromptInput::Text(t) => t.is_empty(),
        PromptInput::Ids(ids) => ids.is_empty(),
    };
    if empty {
        return Err(ApiError::invalid(Some("prompt"), "prompt must not be empty"));
    }
    Ok(input)
}

/// Token IDs in o200k_harmony's vocabulary; the error names `prompt[i]`.
fn token_ids(values: &[Value]) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::with_capacity(values.len());
    for (i, v) in values.iter().enumerate() {
        match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(id) if (id as usize) < VOCAB_SIZE => ids.push(id),
            _ => {
                return Err(ApiError::invalid(
                    Some(&format!("prompt[{i}]")),
                    format!("{v} is not a token ID of the vocabulary (0..{VOCAB_SIZE})"),
                ));
            }
        }
    }
    Ok(ids)
}

/// The token IDs of a plan's prompt.
pub(crate) fn tokenize(
    tokenizer: &TextTokenizer,
    prompt: &PromptInput,
    special_tokens: bool,
) -> crate::error::Result<Vec<u32>> {
    match prompt {
        PromptInput::Ids(ids) => Ok(ids.clone()),
        PromptInput::Text(text) if special_tokens => tokenizer.encode_with_special(text),
        PromptInput::Text(text) => tokenizer.encode(text),
    }
}

/// The prompt's text for `echo`: as sent, or the IDs decoded (special tokens by name).
pub(crate) fn echo_text(tokenizer: &TextTokenizer, prompt: &PromptInput) -> String {
    match prompt {
        PromptInput::Text(text) => text.clone(),
        // The IDs were checked against the vocabulary, so they decode.
        PromptInput::Ids(ids) => tokenizer.decode(ids).unwrap_or_default(),
    }
}

/// One choice of a `text_completion`.
#[derive(Serialize, Debug)]
pub(crate) struct TextChoice {
    /// The text (or, in a stream, the text this chunk adds).
    pub text: String,
    /// Always 0.
    pub index: usize,
    /// Always null.
    pub logprobs: Option<()>,
    /// `stop` or `length`; null in a stream until the last chunk.
    pub finish_reason: Option<&'static str>,
    /// Extension: the generated token IDs (with `return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A `text_completion`: the answer, or one chunk of a stream.
#[derive(Serialize, Debug)]
pub(crate) struct TextCompletion<'a> {
    /// `cmpl-...`
    pub id: &'a str,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix time of the request.
    pub created: u64,
    /// The served model's ID.
    pub model: &'a str,
    /// One choice (none in a stream's usage chunk).
    pub choices: Vec<TextChoice>,
    /// Token counts (in a stream, only in the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Extension: the prompt's token IDs (with `return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// What every chunk of one completion shares.
pub(crate) struct CompletionMeta {
    /// `cmpl-...`
    pub id: String,
    /// Unix time of the request.
    pub created: u64,
    /// The model ID.
    pub model: String,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
}

impl CompletionMeta {
    /// A `text_completion` with these choices.
    pub fn completion(&self, choices: Vec<TextChoice>, usage: Option<Usage>) -> TextCompletion<'_> {
        TextCompletion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model,
            choices,
            usage,
            prompt_token_ids: None,
        }
    }
}

/// The finish reason and usage of a finished completion.
pub(crate) fn ending(fin: &Finished) -> (&'static str, Usage) {
    let usage = Usage::new(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens);
    (convert::finish_reason(fin.stop, false), usage)
}

/// The streaming answer: the text pieces as `text_completion` chunks (the prompt first with
/// `echo`), then a chunk with the finish reason, the usage chunk when asked for, and
/// `data: [DONE]`. Dropping it (the client went away) cancels the generation.
pub(crate) struct CompletionStream {
    rx: UnboundedReceiver<WorkerMsg>,
    meta: CompletionMeta,
    events: EventQueue,
}

impl CompletionStream {
    /// A stream of the messages on `rx`, opening with `echo` (the prompt's text) if given.
    pub fn new(rx: UnboundedReceiver<WorkerMsg>, meta: CompletionMeta, echo: Option<String>) -> Self {
        let mut s = CompletionStream { rx, meta, events: EventQueue::default() };
        if let Some(text) = echo {
            s.push_text(text, None);
        }
        s
    }

    fn push(&mut self, choices: Vec<TextChoice>, usage: Option<Usage>) {
        self.events.push_json(&self.meta.completion(choices, usage));
    }

    fn push_text(&mut self, text: String, finish_reason: Option<&'static str>) {
        let choice = TextChoice { text, index: 0, logprobs: None, finish_reason, token_ids: None };
        self.push(vec![choice], None);
    }

    fn on_message(&mut self, msg: WorkerMsg) {
        match msg {
            WorkerMsg::Started => {}
            WorkerMsg::Piece(Piece::Content(text)) => self.push_text(text, None),
            // A raw job sends only content (see `raw::complete_raw`).
            WorkerMsg::Piece(Piece::Reasoning(_) | Piece::ToolCall { .. }) => {}
            // Log probabilities are refused on this endpoint, so none are sent.
            WorkerMsg::Logprobs(_) => {}
            WorkerMsg::Done(Ok(fin)) => {
                let (reason, usage) = ending(&fin);
                self.push_text(String::new(), Some(reason));
                if self.meta.include_usage {
                    self.push(Vec::new(), Some(usage));
                }
                self.events.finish();
            }
            WorkerMsg::Done(Err(failure)) => self.events.fail(&self.meta.id, failure_error(failure)),
        }
    }
}

impl WorkerEvents for CompletionStream {
    fn queue(&mut self) -> &mut EventQueue {
        &mut self.events
    }

    fn rx(&mut self) -> &mut UnboundedReceiver<WorkerMsg> {
        &mut self.rx
    }

    fn on_message(&mut self, msg: WorkerMsg) {
        CompletionStream::on_message(self, msg)
    }

    fn on_engine_gone(&mut self) {
        self.events.fail(&self.meta.id, ApiError::unavailable(ENGINE_GONE));
    }
}

impl Stream for CompletionStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        poll_events(&mut *self, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_json(json: &str) -> Result<CompletionPlan, ApiError> {
        plan(convert::parse_json(json.as_bytes())?, 7)
    }

    fn param(json: &str) -> (Option<String>, Option<&'static str>) {
        let e = plan_json(json).unwrap_err();
        (e.param, e.code)
    }

    #[test]
    fn prompts_take_every_shape_openai_defines() {
        let p = plan_json(r#"{"prompt": "Once upon"}"#).unwrap();
        assert_eq!(p.prompt, PromptInput::Text("Once upon".into()));
        assert_eq!((p.max_tokens, p.sampling.temperature, p.sampling.seed), (DEFAULT_MAX_TOKENS, 1.0, 7));
        assert!(p.special_tokens && !p.echo && !p.stream && !p.text.skip_special_tokens);
        assert_eq!(plan_json(r#"{"prompt": ["Once"]}"#).unwrap().prompt, PromptInput::Text("Once".into()));
        assert_eq!(plan_json(r#"{"prompt": [1, 2, 3]}"#).unwrap().prompt, PromptInput::Ids(vec![1, 2, 3]));
        assert_eq!(plan_json(r#"{"prompt": [[4, 5]]}"#).unwrap().prompt, PromptInput::Ids(vec![4, 5]));
        let p = plan_json(r#"{"prompt": "x", "max_tokens": 3, "temperature": 0, "echo": true, "seed": 2}"#)
            .unwrap();
        assert_eq!((p.max_tokens, p.sampling.temperature, p.sampling.seed, p.echo), (3, 0.0, 2, true));
    }

    #[test]
    fn bad_requests_name_the_field() {
        assert_eq!(param("{}").0.as_deref(), Some("prompt"));
        assert_eq!(param(r#"{"prompt": ""}"#).0.as_deref(), Some("prompt"));
        assert_eq!(param(r#"{"prompt": []}"#).0.as_deref(), Some("prompt"));
        assert_eq!(param(r#"{"prompt": 5}"#).0.as_deref(), Some("prompt"));
        assert_eq!(
            param(r#"{"prompt": ["a", "b"]}"#),
            (Some("prompt".into()), Some("unsupported_parameter"))
        );
        assert_eq!(param(r#"{"prompt": [[1], [2]]}"#).1, Some("unsupported_parameter"));
        assert_eq!(param(r#"{"prompt": [1, -2]}"#).0.as_deref(), Some("prompt[1]"));
        assert_eq!(param(r#"{"prompt": [1, 201088]}"#).0.as_deref(), Some("prompt[1]"));
        assert_eq!(param(r#"{"prompt": [1, "x"]}"#).0.as_deref(), Some("prompt[1]"));
        assert_eq!(param(r#"{"prompt": "x", "max_tokens": 0}"#).0.as_deref(), Some("max_tokens"));
        assert_eq!(param(r#"{"prompt": "x", "temperature": 3}"#).0.as_deref(), Some("temperature"));
        for (field, value) in [
            ("suffix", r#""end""#),
            ("n", "2"),
            ("best_of", "3"),
            ("stop", r#"["\n"]"#),
            ("logprobs", "2"),
            ("presence_penalty", "0.5"),
            ("frequency_penalty", "1"),
            ("logit_bias", r#"{"50256": -100}"#),
        ] {
            let body = format!(r#"{{"prompt": "x", "{field}": {value}}}"#);
            assert_eq!(param(&body), (Some(field.into()), Some("unsupported_parameter")), "{body}");
        }
        let ok = r#"{"prompt": "x", "suffix": "", "n": 1, "best_of": 1, "stop": null, "logprobs": 0,
                     "presence_penalty": 0, "logit_bias": {}, "model": "any", "user": "u"}"#;
        assert!(plan_json(ok).is_ok());
    }

    #[test]
    fn special_token_strings_are_tokens_unless_asked_not() {
        let t = TextTokenizer::O200k(crate::chat::Tokenizer::new());
        let text = PromptInput::Text("<|start|>user".into());
        let start = t.special_id("<|start|>").unwrap();
        assert_eq!(tokenize(&t, &text, true).unwrap()[0], start);
        assert!(!tokenize(&t, &text, false).unwrap().contains(&start));
        let ids = PromptInput::Ids(vec![start, 1428]);
        assert_eq!(tokenize(&t, &ids, false).unwrap(), [start, 1428]);
        assert_eq!(echo_text(&t, &ids), t.decode(&[start, 1428]).unwrap());
    }

    #[test]
    fn an_engine_that_stops_mid_completion_ends_it_with_an_error_then_done() {
        use crate::serve::http::sse::testing::{data, drain};
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let meta =
            CompletionMeta { id: "cmpl-test".into(), created: 0, model: "m".into(), include_usage: true };
        let mut s = CompletionStream::new(rx, meta, Some("echo".into()));
        tx.send(WorkerMsg::Piece(Piece::Content("text".into()))).unwrap();
        drop(tx);
        let events = drain(&mut s);
        // The echoed prompt, the piece, then the error and `[DONE]` (no usage: no outcome).
        assert_eq!(events.len(), 4, "{events:?}");
        assert!(events[0].contains("echo") && events[1].contains("text"), "{events:?}");
        assert_eq!(events[2..], [data(&ApiError::unavailable(ENGINE_GONE).body()), data("[DONE]")]);
    }
}
