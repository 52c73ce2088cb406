//! The wire types of the OpenAI chat completions API that this server speaks: requests as
//! they are parsed (every field optional, so that the checks in `convert` can name the field
//! at fault), responses and stream chunks as they are written.

use serde::{Deserialize, Serialize};

use super::logprobs::ChoiceLogprobs;
use crate::chat::JsonValue;

/// `POST /v1/chat/completions`. Unknown fields are ignored, `model` among them (one model
/// is served, whatever the name).
#[derive(Deserialize, Debug, Default)]
pub(crate) struct ChatRequest {
    /// The conversation.
    pub messages: Option<Vec<RequestMessage>>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Stream settings.
    pub stream_options: Option<StreamOptions>,
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
    /// Most tokens to generate (deprecated name).
    pub max_tokens: Option<u64>,
    /// Most tokens to generate.
    pub max_completion_tokens: Option<u64>,
    /// Number of choices; only 1.
    pub n: Option<u64>,
    /// A stop string or up to four: the answer ends before the first one that appears.
    pub stop: Option<serde_json::Value>,
    /// `low`, `medium` or `high`.
    pub reasoning_effort: Option<String>,
    /// `{"effort", "exclude", "enabled"}` (as OpenRouter and LiteLLM send it).
    pub reasoning: Option<ChatReasoning>,
    /// Function tools.
    pub tools: Option<Vec<Tool>>,
    /// `auto`, `none`; others are refused.
    pub tool_choice: Option<serde_json::Value>,
    /// Return the log probability of each content token.
    pub logprobs: Option<bool>,
    /// With `logprobs`, also the most likely alternatives at each position (0..=20).
    pub top_logprobs: Option<u64>,
    /// OpenAI's frequency penalty, -2..=2.
    pub frequency_penalty: Option<f32>,
    /// OpenAI's presence penalty, -2..=2.
    pub presence_penalty: Option<f32>,
    /// Token ID (a decimal string) -> bias added to its logit, -100..=100.
    pub logit_bias: Option<serde_json::Value>,
    /// Only `{"type": "text"}`.
    pub response_format: Option<serde_json::Value>,
    /// Extension (as vLLM): return the prompt and generated token IDs.
    pub return_token_ids: Option<bool>,
}

/// `stream_options`.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct StreamOptions {
    /// Send a last chunk with the usage counts.
    pub include_usage: Option<bool>,
}

/// `reasoning` of a chat completions request.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct ChatReasoning {
    /// `low`, `medium` or `high`, as `reasoning_effort` (which it must agree with).
    pub effort: Option<String>,
    /// Leave the reasoning out of the answer (it is still generated and counted).
    pub exclude: Option<bool>,
    /// `true` is accepted; `false` is refused: GPT-OSS always reasons.
    pub enabled: Option<bool>,
    /// A token budget for the reasoning: refused (Harmony has no such control).
    pub max_tokens: Option<serde_json::Value>,
}

/// One message of the request.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct RequestMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: Option<String>,
    /// A string or a list of `{"type": "text", "text"}` parts; null for tool calls.
    pub content: Option<serde_json::Value>,
    /// An assistant's tool calls.
    pub tool_calls: Option<Vec<RequestToolCall>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// An assistant's reasoning, as this server returns it.
    pub reasoning_content: Option<String>,
    /// An assistant's reasoning (the name some clients use).
    pub reasoning: Option<String>,
}

/// A tool call in an assistant message of the request.
#[derive(Deserialize, Debug)]
pub(crate) struct RequestToolCall {
    /// The call's ID, referred to by the tool's reply.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// What was called.
    pub function: RequestFunctionCall,
}

/// The function of a tool call.
#[derive(Deserialize, Debug)]
pub(crate) struct RequestFunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments: JSON text (an object is accepted and written compactly).
    pub arguments: JsonValue,
}

/// A tool the model may call.
#[derive(Deserialize, Debug)]
pub(crate) struct Tool {
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: Option<FunctionDefinition>,
}

/// A function tool's definition.
#[derive(Deserialize, Debug)]
pub(crate) struct FunctionDefinition {
    /// The name (`[A-Za-z0-9_-]{1,64}`).
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// The JSON schema of its arguments, in the order written.
    pub parameters: Option<JsonValue>,
    /// Refuse schema keywords a forced call's arguments cannot be held to (see
    /// `tool_choice`); without it they are ignored.
    pub strict: Option<bool>,
}

/// Token counts of a completion.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// The sum.
    pub total_tokens: usize,
    /// Details of the prompt.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PromptTokensDetails {
    /// Prompt positions reused from the cache of an earlier request.
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage from the counts of a turn.
    pub fn new(prompt_tokens: usize, cached_tokens: usize, completion_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// A tool call in a response.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct ToolCall {
    /// `call_...`
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What is called.
    pub function: FunctionCall,
}

/// The function of a response tool call.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments as the model wrote them (JSON text).
    pub arguments: String,
}

/// The assistant message of a response.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct ResponseMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The answer; null when the model wrote none (e.g. only a tool call).
    pub content: Option<String>,
    /// The reasoning (analysis channel), null when there is none or it is excluded
    /// (llama-server's and DeepSeek's name).
    pub reasoning_content: Option<String>,
    /// The same reasoning under the name vLLM (0.10 and later) and OpenAI's gpt-oss
    /// guidance use.
    pub reasoning: Option<String>,
    /// Tool calls, absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// One choice of a response.
#[derive(Serialize, Debug)]
pub(crate) struct Choice {
    /// Always 0.
    pub index: usize,
    /// The message.
    pub message: ResponseMessage,
    /// The content's log probabilities when asked for, else null.
    pub logprobs: Option<ChoiceLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
    /// Extension: the generated token IDs (with `return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A `chat.completion` response.
#[derive(Serialize, Debug)]
pub(crate) struct ChatCompletion {
    /// `chatcmpl-...`
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix time of the request.
    pub created: u64,
    /// The served model's ID.
    pub model: String,
    /// One choice.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: Usage,
    /// Extension: the rendered prompt's token IDs (with `return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// What a stream chunk adds.
#[derive(Serialize, Debug, Default, Clone, PartialEq)]
pub(crate) struct Delta {
    /// `assistant`, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// Answer text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Reasoning text (llama-server's and DeepSeek's name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The same reasoning text (vLLM's and OpenAI's gpt-oss name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Tool call pieces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A piece of a tool call in a stream: first its ID and name, then argument fragments.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct ToolCallDelta {
    /// Which call of the response (0 for the first).
    pub index: usize,
    /// The call's ID, in its first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, in its first piece.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The function's name and argument text.
    pub function: FunctionDelta,
}

/// The function part of a tool call piece.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct FunctionDelta {
    /// The name, in the first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// More argument text.
    pub arguments: String,
}

/// One choice of a stream chunk.
#[derive(Serialize, Debug)]
pub(crate) struct ChunkChoice {
    /// Always 0.
    pub index: usize,
    /// What this chunk adds.
    pub delta: Delta,
    /// The log probabilities of the content this chunk adds, when asked for, else null.
    pub logprobs: Option<ChoiceLogprobs>,
    /// Set in the last chunk of the choice.
    pub finish_reason: Option<&'static str>,
}

/// A `chat.completion.chunk`.
#[derive(Serialize, Debug)]
pub(crate) struct ChatCompletionChunk<'a> {
    /// The completion's ID (the same in every chunk).
    pub id: &'a str,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix time of the request.
    pub created: u64,
    /// The served model's ID.
    pub model: &'a str,
    /// Zero (usage chunk) or one choice.
    pub choices: Vec<ChunkChoice>,
    /// Token counts, in the usage chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// `GET /v1/models`.
#[derive(Serialize, Debug)]
pub(crate) struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// One model.
#[derive(Serialize, Debug, Clone)]
pub(crate) struct ModelCard {
    /// Its ID: the model directory's name or `--model-name`.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix time the server started.
    pub created: u64,
    /// `picchio`.
    pub owned_by: &'static str,
    /// Extension: the context capacity in tokens.
    pub context_length: usize,
}
