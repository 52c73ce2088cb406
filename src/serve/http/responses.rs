//! The Responses API (`POST /v1/responses`): requests to Harmony conversations, and what
//! the model generates to output items, the same way for a JSON answer and a stream.
//!
//! Every check a request can fail happens in [`plan`], before the engine sees it. The
//! output is built by [`OutputBuilder`] from the engine's pieces of text: a new item starts
//! whenever the kind of text changes (reasoning, text for the user, a call of another
//! recipient), and the steps it reports ([`Step`]) are what a stream sends as events.

use std::collections::HashMap;

use serde_json::Value;

use super::convert::{self, FUNCTIONS, SamplingFields, check_function_name, function_name};
use super::error::ApiError;
use super::logprobs::TokenLogprob;
use super::responses_api::{
    ContentPart, IncompleteDetails, InputTokensDetails, OutputItem, OutputTokensDetails, ReasoningEcho,
    ResponseError, ResponseObject, ResponseTool, ResponseUsage, ResponsesRequest,
};
use super::store::{History, Stored};
use super::structured::{self, DeclaredTool, FormatSpelling, Structured, ToolChoice};
use super::worker::{Finished, Piece};
use crate::chat::{
    ChatFormat, Conversation, Message, ParserState, ReasoningEffort, Role, SystemContent, ToolDescription,
};
use crate::sample::SamplingParams;
use crate::session::StopReason;

/// A checked `POST /v1/responses` request, ready for the engine.
#[derive(Debug, Clone)]
pub(crate) struct ResponsePlan {
    /// The Harmony conversation to complete (the stored history, then the new input).
    pub conversation: Conversation,
    /// Sampling settings (validated).
    pub sampling: SamplingParams,
    /// `max_output_tokens`, if given (at least 1).
    pub max_tokens: Option<usize>,
    /// Answer as server-sent events.
    pub stream: bool,
    /// The functions the model may call (the request's tools, none with `tool_choice:
    /// "none"`); a message addressed to anything else is text.
    pub declared_functions: Vec<String>,
    /// What `text.format` and `tool_choice` constrain the turn to, if anything.
    pub structured: Option<Structured>,
    /// What this request adds to the conversation, to store with its output.
    pub added: Added,
    /// What the response object repeats of the request.
    pub echo: Echo,
}

/// What one request adds to a conversation: kept in the store with the response's output.
#[derive(Debug, Clone, Default)]
pub(crate) struct Added {
    /// Instructions from `system`/`developer` input items.
    pub instructions: Vec<String>,
    /// The new input items, in Harmony form.
    pub messages: Vec<Message>,
    /// Call ID -> recipient of the `function_call` input items.
    pub calls: Vec<(String, String)>,
    /// The input items as `GET /v1/responses/{id}/input_items` lists them, in order.
    pub items: Vec<Value>,
}

/// The request fields a response object repeats.
#[derive(Debug, Clone)]
pub(crate) struct Echo {
    /// `instructions`.
    pub instructions: Option<String>,
    /// `max_output_tokens`.
    pub max_output_tokens: Option<u64>,
    /// `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// The reasoning effort used.
    pub effort: ReasoningEffort,
    /// Whether the response is stored.
    pub store: bool,
    /// The temperature used.
    pub temperature: f32,
    /// The nucleus mass used.
    pub top_p: f32,
    /// `tool_choice` (`auto` when absent).
    pub tool_choice: Value,
    /// `tools`.
    pub tools: Vec<ResponseTool>,
    /// `metadata` (`{}` when absent).
    pub metadata: Value,
}

/// Checks a request and turns it into a Harmony conversation. `history` gives the stored
/// conversation of a `previous_response_id` (or the ID of the missing link); `date` goes
/// into the system message; `seed` is used when the request has none.
pub(crate) fn plan(
    req: ResponsesRequest,
    history: &dyn Fn(&str) -> Result<History, String>,
    date: &str,
    seed: u64,
) -> Result<ResponsePlan, ApiError> {
    refuse_unsupported(&req)?;
    let choice = structured::tool_choice(req.tool_choice.as_ref())?;
    let format = structured::answer_format(
        req.text.as_ref().and_then(|t| t.get("format")),
        FormatSpelling::TextFormat,
    )?;
    let sampling = convert::sampling(
        &SamplingFields {
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            min_p: req.min_p,
            repetition_penalty: req.repetition_penalty,
            seed: req.seed.as_ref(),
            presence_penalty: None,
            frequency_penalty: None,
            logit_bias: None,
            logprobs: logprobs(&req)?,
        },
        seed,
    )?;
    let max_tokens = match req.max_output_tokens {
        Some(0) => {
            return Err(ApiError::invalid(Some("max_output_tokens"), "max_output_tokens must be at least 1"));
        }
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let effort = match req.reasoning.as_ref().and_then(|r| r.effort.as_deref()) {
        None => ReasoningEffort::Medium,
        Some(e) => convert::parse_effort(e, "reasoning.effort")?,
    };
    let request_tools = req.tools.as_deref().unwrap_or_default();
    let declared = function_tools(request_tools)?;
    let declared_tools: Vec<DeclaredTool<'_>> = declared
        .iter()
        .zip(request_tools)
        .enumerate()
        .map(|(i, (tool, t))| DeclaredTool {
            tool,
            strict: t.strict.unwrap_or(false),
            parameters_param: format!("tools[{i}].parameters"),
        })
        .collect();
    let structured = structured::structure(&format, &choice, &declared_tools, FormatSpelling::TextFormat)?;
    drop(declared_tools);
    let format_instructions = structured::format_instructions(&format);
    let earlier = match &req.previous_response_id {
        None => History::default(),
        Some(id) => history(id).map_err(|missing| {
            let why = if missing == *id {
                format!(
                    "no stored response has the ID {id:?} (it was not stored, was deleted, or was dropped)"
                )
            } else {
                format!(
                    "response {id:?} continues {missing:?}, which is no longer stored, so its conversation \
                     cannot be rebuilt"
                )
            };
            ApiError::invalid(Some("previous_response_id"), why)
        })?,
    };
    let items = match req.input {
        None | Some(Value::Null) => return Err(ApiError::invalid(Some("input"), "`input` is required")),
        Some(Value::String(text)) => vec![serde_json::json!({"role": "user", "content": text})],
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::invalid(Some("input"), "input must be a string or a list of input items"));
        }
    };
    if items.is_empty() && req.previous_response_id.is_none() {
        return Err(ApiError::invalid(Some("input"), "`input` must not be empty"));
    }
    let mut calls: HashMap<String, String> = earlier.calls.iter().cloned().collect();
    let added = convert_input(&items, &mut calls)?;

    let mut conversation = vec![Message::system(
        SystemContent::new().with_reasoning_effort(effort).with_conversation_start_date(date),
    )];
    let instructions: Vec<&str> = req
        .instructions
        .as_deref()
        .filter(|i| !i.is_empty())
        .into_iter()
        .chain(earlier.instructions.iter().map(String::as_str))
        .chain(added.instructions.iter().map(String::as_str))
        .chain(format_instructions.as_deref())
        .collect();
    let tools = if choice == ToolChoice::None { Vec::new() } else { declared };
    let declared_functions = tools.iter().map(|t| t.name.clone()).collect();
    conversation.extend(convert::developer_message(&instructions, tools));
    conversation.extend(earlier.messages);
    conversation.extend(added.messages.iter().cloned());
    let store = req.store.unwrap_or(true);
    Ok(ResponsePlan {
        conversation: Conversation::from_messages(conversation),
        sampling: sampling.clone(),
        max_tokens,
        stream: req.stream.unwrap_or(false),
        declared_functions,
        structured,
        added,
        echo: Echo {
            instructions: req.instructions,
            max_output_tokens: req.max_output_tokens,
            previous_response_id: req.previous_response_id,
            effort,
            store,
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            tool_choice: req.tool_choice.filter(|c| !c.is_null()).unwrap_or_else(|| Value::from("auto")),
            tools: req.tools.unwrap_or_default(),
            metadata: req.metadata.filter(|m| !m.is_null()).unwrap_or_else(|| serde_json::json!({})),
        },
    })
}

/// Refuses the options this server does not implement, with code `unsupported_parameter`.
fn refuse_unsupported(req: &ResponsesRequest) -> Result<(), ApiError> {
    if req.background == Some(true) {
        return Err(ApiError::unsupported("background", "background responses are not supported"));
    }
    if req.reasoning.as_ref().and_then(|r| r.exclude) == Some(true) {
        return Err(ApiError::unsupported(
            "reasoning.exclude",
            "reasoning.exclude is not supported by the Responses API: the reasoning is its own output \
             item, which the client may drop",
        ));
    }
    if req.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(ApiError::unsupported(
            "conversation",
            "the Conversations API is not served; continue with previous_response_id",
        ));
    }
    if req.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(ApiError::unsupported("prompt", "stored prompt templates are not served"));
    }
    if let Some(t) = req.truncation.as_deref()
        && t != "disabled"
    {
        return Err(ApiError::unsupported(
            "truncation",
            format!(
                "truncation must be \"disabled\" (a conversation that does not fit is refused), got {t:?}"
            ),
        ));
    }
    Ok(())
}

/// How many alternatives to report with each output text token's log probability: asked
/// for by `include: ["message.output_text.logprobs"]` (OpenAI's way) or by `top_logprobs`
/// alone (0..=20); `None` when neither is given.
fn logprobs(req: &ResponsesRequest) -> Result<Option<usize>, ApiError> {
    const INCLUDE: &str = "message.output_text.logprobs";
    let included = match &req.include {
        None | Some(Value::Null) => false,
        Some(Value::Array(items)) => items.iter().any(|i| i.as_str() == Some(INCLUDE)),
        Some(_) => return Err(ApiError::invalid(Some("include"), "include must be a list of strings")),
    };
    match req.top_logprobs {
        Some(n) if n > crate::sample::MAX_TOP_LOGPROBS as u64 => Err(ApiError::invalid(
            Some("top_logprobs"),
            format!("top_logprobs must be between 0 and {}, got {n}", crate::sample::MAX_TOP_LOGPROBS),
        )),
        Some(n) => Ok(Some(n as usize)),
        None => Ok(included.then_some(0)),
    }
}

/// The function tools of a request, checked.
fn function_tools(tools: &[ResponseTool]) -> Result<Vec<ToolDescription>, ApiError> {
    let mut out: Vec<ToolDescription> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        if tool.kind != "function" {
            return Err(ApiError::unsupported(
                &format!("{param}.type"),
                format!("only function tools are supported, got type {:?}", tool.kind),
            ));
        }
        let name = tool.name.as_deref().ok_or_else(|| {
            ApiError::invalid(Some(&format!("{param}.name")), "a function tool needs `name`")
        })?;
        check_function_name(name, &format!("{param}.name"))?;
        if out.iter().any(|t| t.name == name) {
            return Err(ApiError::invalid(Some(&param), format!("tool {name:?} is declared twice")));
        }
        let parameters = match &tool.parameters {
            None | Some(crate::chat::JsonValue::Null) => None,
            Some(p @ crate::chat::JsonValue::Object(_)) => Some(p.clone()),
            Some(_) => {
                return Err(ApiError::invalid(
                    Some(&format!("{param}.parameters")),
                    "parameters must be a JSON schema object",
                ));
            }
        };
        out.push(ToolDescription::new(name, tool.description.clone().unwrap_or_default(), parameters));
    }
    Ok(out)
}

/// The text of a content: a string, or the text parts (`input_text`, `output_text`,
/// `text`, and `reasoning_text`/`summary_text` where `reasoning` is set) joined by newlines.
fn content_text(content: Option<&Value>, param: &str, reasoning: bool) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                let accepted = if reasoning {
                    matches!(kind, "reasoning_text" | "summary_text" | "text")
                } else {
                    matches!(kind, "input_text" | "output_text" | "text")
                };
                if !accepted {
                    return Err(ApiError::unsupported(
                        &format!("{param}[{j}].type"),
                        format!("only text content parts are supported, got type {kind:?}"),
                    ));
                }
                match part.get("text") {
                    Some(Value::String(t)) => texts.push(t.as_str()),
                    _ => {
                        return Err(ApiError::invalid(
                            Some(&format!("{param}[{j}].text")),
                            "a text part needs a string `text`",
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        None | Some(Value::Null) => Err(ApiError::invalid(Some(param), "the item needs content")),
        Some(_) => Err(ApiError::invalid(Some(param), "content must be a string or a list of text parts")),
    }
}

/// A required string field of an input item.
fn string_field<'a>(item: &'a Value, field: &str, param: &str) -> Result<&'a str, ApiError> {
    item.get(field).and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(Some(&format!("{param}.{field}")), format!("the item needs a string `{field}`"))
    })
}

/// The input items in Harmony form. `calls` maps call IDs to recipients: those of the
/// stored history on entry, and the new `function_call` items are added to it.
fn convert_input(items: &[Value], calls: &mut HashMap<String, String>) -> Result<Added, ApiError> {
    let mut added = Added::default();
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        if !item.is_object() {
            return Err(ApiError::invalid(Some(&param), "an input item must be an object"));
        }
        let kind = match item.get("type") {
            None | Some(Value::Null) => "message",
            Some(Value::String(k)) => k.as_str(),
            Some(_) => {
                return Err(ApiError::invalid(Some(&format!("{param}.type")), "type must be a string"));
            }
        };
        added.items.push(listed_item(item, kind));
        match kind {
            "message" => {
                let role = string_field(item, "role", &param)?;
                let text = content_text(item.get("content"), &format!("{param}.content"), false)?;
                match role {
                    "system" | "developer" => added.instructions.push(text),
                    "user" => added.messages.push(Message::user(text)),
                    "assistant" => {
                        // Text right before a call is its preamble: the commentary channel.
                        let next = items.get(i + 1).and_then(|n| n.get("type")).and_then(Value::as_str);
                        let channel = if next == Some("function_call") { "commentary" } else { "final" };
                        added.messages.push(Message::assistant(channel, text));
                    }
                    other => {
                        return Err(ApiError::invalid(
                            Some(&format!("{param}.role")),
                            format!("unknown role {other:?} (expected user, assistant, system or developer)"),
                        ));
                    }
                }
            }
            "reasoning" => {
                // The reasoning text; a client that kept only the summary sends that.
                let content = item.get("content").filter(|c| c.as_array().is_some_and(|a| !a.is_empty()));
                let text = match content {
                    Some(c) => content_text(Some(c), &format!("{param}.content"), true)?,
                    None => match item.get("summary") {
                        None | Some(Value::Null) => String::new(),
                        Some(s) => content_text(Some(s), &format!("{param}.summary"), true)?,
                    },
                };
                if !text.is_empty() {
                    added.messages.push(Message::assistant("analysis", text));
                }
            }
            "function_call" => {
                let call_id = string_field(item, "call_id", &param)?;
                let name = string_field(item, "name", &param)?;
                check_function_name(name, &format!("{param}.name"))?;
                let arguments = string_field(item, "arguments", &param)?;
                let recipient = format!("{FUNCTIONS}.{name}");
                added.messages.push(Message::tool_call(recipient.clone(), arguments));
                calls.insert(call_id.to_string(), recipient.clone());
                added.calls.push((call_id.to_string(), recipient));
            }
            "function_call_output" => {
                let call_id = string_field(item, "call_id", &param)?;
                let recipient = calls.get(call_id).ok_or_else(|| {
                    ApiError::invalid(
                        Some(&format!("{param}.call_id")),
                        format!(
                            "call_id {call_id:?} matches no function_call in the input or the previous response"
                        ),
                    )
                })?;
                let output = content_text(item.get("output"), &format!("{param}.output"), false)?;
                added.messages.push(Message::tool_result(recipient.clone(), output));
            }
            other => {
                return Err(ApiError::unsupported(
                    &format!("{param}.type"),
                    format!(
                        "input items of type {other:?} are not supported (message, reasoning, function_call, \
                         function_call_output are)"
                    ),
                ));
            }
        }
    }
    Ok(added)
}

/// An input item as `GET /v1/responses/{id}/input_items` lists it: with its `type`, an
/// `id` (the client's, else a new one), and a message's string content as one text part
/// (`input_text`, or `output_text` for an assistant's), as OpenAI lists them.
fn listed_item(item: &Value, kind: &str) -> Value {
    let mut out = item.as_object().cloned().unwrap_or_default();
    out.insert("type".into(), Value::from(kind));
    if !out.get("id").is_some_and(Value::is_string) {
        let prefix = match kind {
            "message" => "msg_",
            "reasoning" => "rs_",
            "function_call" => "fc_",
            _ => "item_",
        };
        out.insert("id".into(), Value::from(super::routes::new_id(prefix)));
    }
    if kind == "message"
        && let Some(Value::String(text)) = out.get("content")
    {
        let part = if out.get("role").and_then(Value::as_str) == Some("assistant") {
            "output_text"
        } else {
            "input_text"
        };
        let content = serde_json::json!([{"type": part, "text": text}]);
        out.insert("content".into(), content);
    }
    Value::Object(out)
}

/// What kind of text an output item holds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ItemKind {
    /// Reasoning (the analysis channel).
    Reasoning,
    /// Text for the user (final answer, preamble, or text outside Harmony).
    Text,
    /// A call of `recipient` (`functions.get_weather`), answered by `call_id`.
    Call {
        /// Who is called.
        recipient: String,
        /// `call_...`
        call_id: String,
    },
}

/// One output item as it is built.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BuiltItem {
    /// `rs_...`, `msg_...` or `fc_...`.
    pub id: String,
    /// What it holds.
    pub kind: ItemKind,
    /// The text so far.
    pub text: String,
    /// The log probabilities of its tokens, when asked for (text items only).
    pub logprobs: Vec<TokenLogprob>,
}

/// What happened to the output, in order: what a stream sends as events.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// Item `index` began.
    Opened(usize),
    /// Item `index` got more text, made of tokens with these log probabilities (empty
    /// unless asked for).
    Delta(usize, String, Vec<TokenLogprob>),
    /// Item `index` ended with this status.
    Closed(usize, &'static str),
}

/// Builds the output items from the engine's pieces.
pub(crate) struct OutputBuilder {
    items: Vec<BuiltItem>,
    open: bool,
    new_id: fn(&str) -> String,
    /// Log probabilities for the next text piece.
    pending_logprobs: Vec<TokenLogprob>,
}

impl OutputBuilder {
    /// An empty output; `new_id(prefix)` names the items and calls.
    pub fn new(new_id: fn(&str) -> String) -> Self {
        OutputBuilder { items: Vec::new(), open: false, new_id, pending_logprobs: Vec::new() }
    }

    /// Log probabilities of the tokens of the text piece that comes next.
    pub fn push_logprobs(&mut self, logprobs: Vec<TokenLogprob>) {
        self.pending_logprobs = logprobs;
    }

    /// Adds a piece of text, starting a new item if its kind differs from the open one or
    /// the piece opens a new call (the empty first piece of each, see `ChatEvent::ToolCall`).
    pub fn push(&mut self, piece: Piece, steps: &mut Vec<Step>) {
        let opens_call = matches!(&piece, Piece::ToolCall { text, .. } if text.is_empty());
        let (kind, text) = match piece {
            Piece::Reasoning(t) => (ItemKind::Reasoning, t),
            Piece::Content(t) => (ItemKind::Text, t),
            Piece::ToolCall { recipient, text } => {
                (ItemKind::Call { recipient, call_id: String::new() }, text)
            }
        };
        let same = self.open
            && !opens_call
            && self.items.last().is_some_and(|last| match (&last.kind, &kind) {
                (ItemKind::Call { recipient: a, .. }, ItemKind::Call { recipient: b, .. }) => a == b,
                (a, b) => a == b,
            });
        if !same {
            self.close("completed", steps);
            let (prefix, kind) = match kind {
                ItemKind::Reasoning => ("rs_", ItemKind::Reasoning),
                ItemKind::Text => ("msg_", ItemKind::Text),
                ItemKind::Call { recipient, .. } => {
                    ("fc_", ItemKind::Call { recipient, call_id: (self.new_id)("call_") })
                }
            };
            self.items.push(BuiltItem {
                id: (self.new_id)(prefix),
                kind,
                text: String::new(),
                logprobs: Vec::new(),
            });
            self.open = true;
            steps.push(Step::Opened(self.items.len() - 1));
        }
        let index = self.items.len() - 1;
        let logprobs = std::mem::take(&mut self.pending_logprobs);
        let logprobs = match self.items.last_mut() {
            Some(item) => {
                item.text.push_str(&text);
                if item.kind == ItemKind::Text {
                    item.logprobs.extend(logprobs.iter().cloned());
                    logprobs
                } else {
                    Vec::new()
                }
            }
            None => Vec::new(),
        };
        steps.push(Step::Delta(index, text, logprobs));
    }

    /// Ends the open item, if any, with `status`.
    pub fn close(&mut self, status: &'static str, steps: &mut Vec<Step>) {
        if self.open {
            self.open = false;
            steps.push(Step::Closed(self.items.len() - 1, status));
        }
    }

    /// The items so far.
    pub fn items(&self) -> &[BuiltItem] {
        &self.items
    }

    /// Item `index` as the API shows it: whole with `status`, or (for the `added` event)
    /// with no content and status `in_progress` when `whole` is false.
    pub fn item(&self, index: usize, status: &'static str, whole: bool) -> Option<OutputItem> {
        let item = self.items.get(index)?;
        let text = if whole { Some(item.text.clone()) } else { None };
        Some(match &item.kind {
            ItemKind::Reasoning => OutputItem::Reasoning {
                id: item.id.clone(),
                summary: Vec::new(),
                content: text.map(|text| ContentPart::ReasoningText { text }).into_iter().collect(),
                status,
            },
            ItemKind::Text => OutputItem::Message {
                id: item.id.clone(),
                status,
                role: "assistant",
                content: text.map(|t| output_text(t, item.logprobs.clone())).into_iter().collect(),
            },
            ItemKind::Call { recipient, call_id } => OutputItem::FunctionCall {
                id: item.id.clone(),
                call_id: call_id.clone(),
                name: function_name(recipient).to_string(),
                arguments: text.unwrap_or_default(),
                status,
            },
        })
    }

    /// Every item, whole: the last one with `last_status`, the others completed.
    pub fn output(&self, last_status: &'static str) -> Vec<OutputItem> {
        let n = self.items.len();
        (0..n)
            .filter_map(|i| self.item(i, if i + 1 == n { last_status } else { "completed" }, true))
            .collect()
    }

    /// The output in Harmony form, to continue the conversation from: reasoning on
    /// analysis, text on final (commentary when a call follows), calls as tool calls.
    pub fn messages(&self) -> Vec<Message> {
        let mut out = Vec::with_capacity(self.items.len());
        for (i, item) in self.items.iter().enumerate() {
            out.push(match &item.kind {
                ItemKind::Reasoning => Message::assistant("analysis", item.text.clone()),
                ItemKind::Text => {
                    let before_call =
                        self.items.get(i + 1).is_some_and(|n| matches!(n.kind, ItemKind::Call { .. }));
                    Message::assistant(if before_call { "commentary" } else { "final" }, item.text.clone())
                }
                ItemKind::Call { recipient, .. } => Message::tool_call(recipient.clone(), item.text.clone()),
            });
        }
        out
    }

    /// Call ID -> recipient of the calls in the output.
    pub fn calls(&self) -> Vec<(String, String)> {
        self.items
            .iter()
            .filter_map(|i| match &i.kind {
                ItemKind::Call { recipient, call_id } => Some((call_id.clone(), recipient.clone())),
                _ => None,
            })
            .collect()
    }
}

/// An `output_text` part.
pub(crate) fn output_text(text: String, logprobs: Vec<TokenLogprob>) -> ContentPart {
    ContentPart::OutputText { text, annotations: Vec::new(), logprobs }
}

/// What every form of one response shares: its ID, time, model and the request's echo.
pub(crate) struct ResponseMeta {
    /// `resp_...`
    pub id: String,
    /// Unix time of the request.
    pub created_at: u64,
    /// The model ID.
    pub model: String,
    /// What the response repeats of the request.
    pub echo: Echo,
}

/// How a response ended.
pub(crate) enum Ending<'a> {
    /// Not yet.
    InProgress,
    /// The turn ended: completed or, at the token limit or full context, incomplete.
    Finished(&'a Finished, ResponseUsage),
    /// The engine failed.
    Failed(String),
}

impl ResponseMeta {
    /// The response object with `output` and the status of `ending`.
    pub fn object(&self, output: Vec<OutputItem>, ending: Ending<'_>) -> ResponseObject {
        let (status, error, incomplete_details, usage) = match ending {
            Ending::InProgress => ("in_progress", None, None, None),
            Ending::Finished(fin, usage) => match fin.stop {
                StopReason::MaxTokens | StopReason::ContextFull => {
                    ("incomplete", None, Some(IncompleteDetails { reason: "max_output_tokens" }), Some(usage))
                }
                StopReason::Stop(_) | StopReason::StopString | StopReason::Cancelled => {
                    ("completed", None, None, Some(usage))
                }
            },
            Ending::Failed(message) => {
                ("failed", Some(ResponseError { code: "server_error", message }), None, None)
            }
        };
        let echo = &self.echo;
        ResponseObject {
            id: self.id.clone(),
            object: "response",
            created_at: self.created_at,
            status,
            error,
            incomplete_details,
            instructions: echo.instructions.clone(),
            max_output_tokens: echo.max_output_tokens,
            model: self.model.clone(),
            output,
            parallel_tool_calls: false,
            previous_response_id: echo.previous_response_id.clone(),
            reasoning: ReasoningEcho { effort: echo.effort.as_str(), summary: None },
            store: echo.store,
            temperature: echo.temperature,
            top_p: echo.top_p,
            text: serde_json::json!({"format": {"type": "text"}}),
            tool_choice: echo.tool_choice.clone(),
            tools: echo.tools.clone(),
            truncation: "disabled",
            metadata: echo.metadata.clone(),
            usage,
        }
    }
}

/// The status of the last output item of a finished turn: `incomplete` when it was cut.
pub(crate) fn last_item_status(stop: StopReason) -> &'static str {
    match stop {
        StopReason::MaxTokens | StopReason::ContextFull => "incomplete",
        StopReason::Stop(_) | StopReason::StopString | StopReason::Cancelled => "completed",
    }
}

/// The usage of a finished turn; the reasoning tokens are counted by parsing its tokens.
pub(crate) fn usage(format: &ChatFormat, fin: &Finished) -> ResponseUsage {
    ResponseUsage {
        input_tokens: fin.prompt_tokens,
        input_tokens_details: InputTokensDetails { cached_tokens: fin.cached_tokens },
        output_tokens: fin.completion_tokens,
        output_tokens_details: OutputTokensDetails {
            reasoning_tokens: reasoning_tokens(format, &fin.tokens),
        },
        total_tokens: fin.prompt_tokens.saturating_add(fin.completion_tokens),
    }
}

/// How many of `tokens` are reasoning: content of the analysis channel (up to the first
/// token that is not valid Harmony); in ChatML, the tokens between `<think>` and `</think>`.
fn reasoning_tokens(format: &ChatFormat, tokens: &[u32]) -> usize {
    let harmony = match format {
        ChatFormat::Harmony(h) => h,
        ChatFormat::ChatMl(c) => {
            let (open, close) = (c.tokens().think, c.tokens().think_end);
            let mut inside = false;
            let mut n = 0;
            for &t in tokens {
                if t == open || t == close {
                    inside = t == open;
                } else if inside {
                    n += 1;
                }
            }
            return n;
        }
    };
    let mut parser = harmony.stream_parser(Some(Role::Assistant));
    let mut n = 0;
    for &t in tokens {
        if parser.push(t).is_err() {
            break;
        }
        if parser.state() == ParserState::Content
            && parser.current_channel() == Some("analysis")
            && !harmony.tokenizer().is_special(t)
        {
            n += 1;
        }
    }
    n
}

/// The store entry of a finished response: its object, the conversation it continued, and
/// what it added (the request's input, then its output).
pub(crate) fn stored(object: &ResponseObject, added: Added, output: &OutputBuilder) -> Stored {
    let mut messages = added.messages;
    messages.extend(output.messages());
    let mut calls = added.calls;
    calls.extend(output.calls());
    Stored {
        response: serde_json::to_value(object).unwrap_or(Value::Null),
        previous: object.previous_response_id.clone(),
        input_instructions: added.instructions,
        messages,
        calls,
        input_items: added.items,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(text: &str) -> Piece {
        Piece::ToolCall { recipient: "functions.f".to_string(), text: text.to_string() }
    }

    #[test]
    fn two_calls_of_one_function_are_two_items() {
        let mut out = OutputBuilder::new(|prefix| format!("{prefix}x"));
        let mut steps = Vec::new();
        for piece in [call(""), call("{\"a\":"), call("1}"), call(""), call("{}")] {
            out.push(piece, &mut steps);
        }
        out.close("completed", &mut steps);
        let texts: Vec<&str> = out.items().iter().map(|i| i.text.as_str()).collect();
        assert_eq!(texts, ["{\"a\":1}", "{}"]);
    }
}
