//! The wire types of OpenAI's Responses API (`POST /v1/responses`) that this server speaks:
//! the request as it is parsed (every field optional, so that the checks in `responses` can
//! name the field at fault), the response object and its output items as they are written.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::logprobs::TokenLogprob;
use crate::chat::JsonValue;

/// `POST /v1/responses`. Unknown fields are ignored: `model` (one model is served),
/// `parallel_tool_calls` (a Harmony turn holds at most one call), `user`, ...
#[derive(Deserialize, Debug, Default)]
pub(crate) struct ResponsesRequest {
    /// A string (one user message) or a list of input items.
    pub input: Option<Value>,
    /// Instructions for the model: the Harmony developer message. Not carried over from a
    /// previous response.
    pub instructions: Option<String>,
    /// Function tools (`{"type": "function", "name", "description", "parameters"}`).
    pub tools: Option<Vec<ResponseTool>>,
    /// `auto`, `none`; others are refused.
    pub tool_choice: Option<Value>,
    /// `{"effort": "low" | "medium" | "high", "summary": ...}`.
    pub reasoning: Option<ReasoningParam>,
    /// Most tokens to generate, reasoning included.
    pub max_output_tokens: Option<u64>,
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
    /// Extension: seed of the sampler.
    pub seed: Option<serde_json::Number>,
    /// Keep the response for `GET`, `DELETE` and `previous_response_id` (default true).
    pub store: Option<bool>,
    /// Stream the answer as typed server-sent events.
    pub stream: Option<bool>,
    /// Continue the conversation of a stored response.
    pub previous_response_id: Option<String>,
    /// `{"format": {"type": "text"}}` only.
    pub text: Option<Value>,
    /// Refused when true: every response runs in the request.
    pub background: Option<bool>,
    /// Echoed in the response.
    pub metadata: Option<Value>,
    /// Report log probabilities of the output text with this many alternatives (0..=20).
    pub top_logprobs: Option<u64>,
    /// Extra output: `message.output_text.logprobs` asks for log probabilities; other
    /// values are ignored.
    pub include: Option<Value>,
    /// `disabled` only: a conversation that does not fit is refused, not truncated.
    pub truncation: Option<String>,
    /// The Conversations API is not served: refused.
    pub conversation: Option<Value>,
    /// Stored prompt templates are not served: refused.
    pub prompt: Option<Value>,
}

/// A tool of a request (flat, unlike chat completions' `{"function": {...}}`).
#[derive(Deserialize, Serialize, Debug, Clone)]
pub(crate) struct ResponseTool {
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function's name (`[A-Za-z0-9_-]{1,64}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// What it does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON schema of its arguments, in the order written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<JsonValue>,
    /// With a forced call (`tool_choice`), refuse schema keywords its arguments cannot be
    /// held to; without it they are ignored. Echoed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `reasoning` of a request.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct ReasoningParam {
    /// `low`, `medium` (default) or `high`: the Harmony system message's `Reasoning:`.
    /// (`summary` is ignored: the reasoning is returned whole, as `reasoning_text`.)
    pub effort: Option<String>,
    /// Refused when true: the reasoning is its own output item, which a client may drop
    /// (and which a later `previous_response_id` turn needs after a tool call).
    pub exclude: Option<bool>,
}

/// The response object, as `POST /v1/responses` returns it, stream events carry it and
/// `GET /v1/responses/{id}` returns it again.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct ResponseObject {
    /// `resp_...`
    pub id: String,
    /// `response`.
    pub object: &'static str,
    /// Unix time of the request.
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: &'static str,
    /// Set when the response failed.
    pub error: Option<ResponseError>,
    /// Set when the response is incomplete.
    pub incomplete_details: Option<IncompleteDetails>,
    /// The request's `instructions`.
    pub instructions: Option<String>,
    /// The request's `max_output_tokens`.
    pub max_output_tokens: Option<u64>,
    /// The served model's ID.
    pub model: String,
    /// What the model generated, in order.
    pub output: Vec<OutputItem>,
    /// Always false.
    pub parallel_tool_calls: bool,
    /// The request's `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// The reasoning settings used.
    pub reasoning: ReasoningEcho,
    /// Whether the response is stored.
    pub store: bool,
    /// The temperature used.
    pub temperature: f32,
    /// The nucleus mass used.
    pub top_p: f32,
    /// `{"format": {"type": "text"}}`.
    pub text: Value,
    /// The request's `tool_choice` (`auto` when absent).
    pub tool_choice: Value,
    /// The request's tools.
    pub tools: Vec<ResponseTool>,
    /// `disabled`.
    pub truncation: &'static str,
    /// The request's `metadata` (an empty object when absent).
    pub metadata: Value,
    /// Token counts; null until the response ends.
    pub usage: Option<ResponseUsage>,
}

/// `error` of a failed response.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct ResponseError {
    /// `server_error`.
    pub code: &'static str,
    /// What went wrong.
    pub message: String,
}

/// `incomplete_details`.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct IncompleteDetails {
    /// `max_output_tokens`: the token limit or the end of the context was reached.
    pub reason: &'static str,
}

/// `reasoning` of a response.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct ReasoningEcho {
    /// `low`, `medium` or `high`.
    pub effort: &'static str,
    /// Always null: no summaries are made.
    pub summary: Option<()>,
}

/// `usage` of a response.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResponseUsage {
    /// Tokens of the rendered prompt.
    pub input_tokens: usize,
    /// Details of the prompt.
    pub input_tokens_details: InputTokensDetails,
    /// Tokens generated (the closing `<|return|>`/`<|call|>` included).
    pub output_tokens: usize,
    /// Details of the generated tokens.
    pub output_tokens_details: OutputTokensDetails,
    /// The sum.
    pub total_tokens: usize,
}

/// `usage.input_tokens_details`.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InputTokensDetails {
    /// Prompt positions reused from the cache of an earlier request.
    pub cached_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutputTokensDetails {
    /// Generated tokens of the reasoning (analysis channel) content.
    pub reasoning_tokens: usize,
}

/// One output item.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum OutputItem {
    /// The reasoning (the analysis channel), whole.
    Reasoning {
        /// `rs_...`
        id: String,
        /// Always empty: no summaries are made.
        summary: Vec<Value>,
        /// One `reasoning_text` part (none while the item is being streamed).
        content: Vec<ContentPart>,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
    },
    /// Text for the user: the answer, or a preamble before a tool call.
    Message {
        /// `msg_...`
        id: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
        /// `assistant`.
        role: &'static str,
        /// One `output_text` part (none while the item is being streamed).
        content: Vec<ContentPart>,
    },
    /// A call of a function tool.
    FunctionCall {
        /// `fc_...`
        id: String,
        /// `call_...`: what a `function_call_output` item answers.
        call_id: String,
        /// The function's name.
        name: String,
        /// The arguments as the model wrote them (JSON text).
        arguments: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
    },
}

/// A content part of an output item.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ContentPart {
    /// Reasoning text.
    ReasoningText {
        /// The text.
        text: String,
    },
    /// Text for the user.
    OutputText {
        /// The text.
        text: String,
        /// Always empty.
        annotations: Vec<Value>,
        /// The log probabilities of its tokens when asked for, else empty.
        logprobs: Vec<TokenLogprob>,
    },
}
