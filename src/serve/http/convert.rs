//! OpenAI requests to Harmony conversations and sampling settings, and generated Harmony
//! messages back to OpenAI's message shape. Every check a request can fail happens here,
//! before the engine sees it.

use std::collections::HashMap;

use super::api::{ChatRequest, FunctionCall, RequestMessage, ResponseMessage, Tool, ToolCall};
use super::error::ApiError;
use super::structured::{self, DeclaredTool, FormatSpelling, Structured, ToolChoice};
use crate::chat::{
    Conversation, DeveloperContent, JsonValue, MAX_STOP_STRINGS, Message, ReasoningEffort, SystemContent,
    ToolDescription, VOCAB_SIZE,
};
use crate::sample::{MAX_LOGIT_BIAS, MAX_PRESENCE_FREQUENCY, MAX_TOP_LOGPROBS, SamplingParams};
use crate::session::StopReason;

/// A checked request, ready for the engine.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// The Harmony conversation to complete.
    pub conversation: Conversation,
    /// Sampling settings (validated).
    pub sampling: SamplingParams,
    /// `max_completion_tokens` / `max_tokens`, if given (at least 1).
    pub max_tokens: Option<usize>,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Add a usage chunk to the stream.
    pub include_usage: bool,
    /// Return token IDs (extension).
    pub return_token_ids: bool,
    /// The functions the model may call: the declared tools, none with `tool_choice: "none"`.
    /// A message addressed to anything else is text.
    pub declared_functions: Vec<String>,
    /// `reasoning.exclude`: leave the reasoning out of the answer and the stream.
    pub exclude_reasoning: bool,
    /// Stop strings (none empty, at most [`MAX_STOP_STRINGS`]).
    pub stop: Vec<String>,
    /// Return log probabilities (`logprobs: true`; how many alternatives is in `sampling`).
    pub logprobs: bool,
    /// What `response_format` and `tool_choice` constrain the turn to, if anything.
    pub structured: Option<Structured>,
}

/// The developer message carrying a request's instructions (joined by blank lines) and
/// function tools, if it has either: the same for Chat Completions and Responses.
pub(crate) fn developer_message<S: std::borrow::Borrow<str>>(
    instructions: &[S],
    tools: Vec<ToolDescription>,
) -> Option<Message> {
    if instructions.is_empty() && tools.is_empty() {
        return None;
    }
    let mut developer = DeveloperContent::new();
    if !instructions.is_empty() {
        developer = developer.with_instructions(instructions.join("\n\n"));
    }
    if !tools.is_empty() {
        developer = developer.with_function_tools(tools);
    }
    Some(Message::developer(developer))
}

/// The namespace of OpenAI function tools in Harmony.
pub(crate) const FUNCTIONS: &str = "functions";

/// Parses a `POST /v1/chat/completions` body, naming the field at fault on error.
pub(crate) fn parse_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    parse_json(body)
}

/// Parses a request body of any route, naming the field at fault on error.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // Valid JSON that is not an object (`[]`, `5`): say so, not what serde expected.
    if body.trim_ascii_start().first() != Some(&b'{')
        && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
    {
        return Err(ApiError::invalid(None, "the body must be a JSON object"));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    let request: T = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        // serde_path_to_error writes `.` for the root and `?` where it lost track.
        let known = !(inner.is_syntax() || inner.is_eof() || path == "." || path.contains('?'));
        let param = known.then_some(path);
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("the body is not valid JSON: {inner}")
        } else {
            match &param {
                Some(p) => format!("invalid value for `{p}`: {}", without_type_names(&inner.to_string())),
                None => format!("invalid request: {}", without_type_names(&inner.to_string())),
            }
        };
        ApiError::invalid(param.as_deref(), message)
    })?;
    // One JSON value, then only whitespace: `{...}garbage` or two objects are refused.
    de.end().map_err(|e| {
        ApiError::invalid(None, format!("the body is not valid JSON: characters after the JSON value ({e})"))
    })?;
    Ok(request)
}

/// Serde's message with our Rust type names (`expected struct RequestMessage`) said in
/// JSON's terms (`expected a JSON object`).
fn without_type_names(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(i) = rest.find("expected struct ") {
        out.push_str(&rest[..i]);
        out.push_str("expected a JSON object");
        rest = &rest[i + "expected struct ".len()..];
        rest = &rest[rest.find(|c: char| !c.is_alphanumeric() && c != '_').unwrap_or(rest.len())..];
    }
    out.push_str(rest);
    out
}

/// Checks a request and turns it into a Harmony conversation with sampling settings.
/// `date` goes into the system message (`YYYY-MM-DD`); `seed` is used when the request
/// has none.
pub(crate) fn plan(req: ChatRequest, date: &str, seed: u64) -> Result<Plan, ApiError> {
    if let Some(n) = req.n
        && n != 1
    {
        return Err(ApiError::unsupported(
            "n",
            format!(
                "n must be 1, got {n}: the server runs one sequence on one session, so more choices would \
                 mean computing the prompt again for each or parallel sessions (not built); send the \
                 request n times with different seeds instead"
            ),
        ));
    }
    let logprobs = req.logprobs == Some(true);
    let top_logprobs = match req.top_logprobs {
        Some(n) if n > MAX_TOP_LOGPROBS as u64 => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            ));
        }
        Some(n) if n > 0 && !logprobs => {
            return Err(ApiError::invalid(Some("top_logprobs"), "top_logprobs needs `logprobs: true`"));
        }
        Some(n) => n as usize,
        None => 0,
    };
    let stop = stop_strings(req.stop.as_ref())?;
    let format = structured::answer_format(req.response_format.as_ref(), FormatSpelling::ResponseFormat)?;
    let choice = structured::tool_choice(req.tool_choice.as_ref())?;
    let sampling = sampling(
        &SamplingFields {
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            min_p: req.min_p,
            repetition_penalty: req.repetition_penalty,
            seed: req.seed.as_ref(),
            presence_penalty: req.presence_penalty,
            frequency_penalty: req.frequency_penalty,
            logit_bias: req.logit_bias.as_ref(),
            logprobs: logprobs.then_some(top_logprobs),
        },
        seed,
    )?;
    let max_tokens = match req.max_completion_tokens.or(req.max_tokens) {
        Some(0) => {
            let param =
                if req.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
            return Err(ApiError::invalid(Some(param), format!("{param} must be at least 1")));
        }
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let (effort, exclude_reasoning) = reasoning_settings(&req)?;
    let tools = req.tools.unwrap_or_default();
    let strict: Vec<bool> =
        tools.iter().map(|t| t.function.as_ref().and_then(|f| f.strict).unwrap_or(false)).collect();
    let tools = function_tools(tools)?;
    let messages =
        req.messages.ok_or_else(|| ApiError::invalid(Some("messages"), "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "`messages` must not be empty"));
    }
    let (mut instructions, body) = convert_messages(messages)?;
    let declared: Vec<DeclaredTool<'_>> = tools
        .iter()
        .zip(&strict)
        .enumerate()
        .map(|(i, (tool, &strict))| DeclaredTool {
            tool,
            strict,
            parameters_param: format!("tools[{i}].function.parameters"),
        })
        .collect();
    let structured = structured::structure(&format, &choice, &declared, FormatSpelling::ResponseFormat)?;
    instructions.extend(structured::format_instructions(&format));

    let mut conversation = vec![Message::system(
        SystemContent::new().with_reasoning_effort(effort).with_conversation_start_date(date),
    )];
    let tools = if choice == ToolChoice::None { Vec::new() } else { tools };
    let declared_functions = tools.iter().map(|t| t.name.clone()).collect();
    conversation.extend(developer_message(&instructions, tools));
    conversation.extend(body);
    Ok(Plan {
        conversation: Conversation::from_messages(conversation),
        sampling,
        max_tokens,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        return_token_ids: req.return_token_ids.unwrap_or(false),
        declared_functions,
        exclude_reasoning,
        stop,
        logprobs,
        structured,
    })
}

/// The reasoning effort (from `reasoning_effort` or `reasoning.effort`, which must agree)
/// and whether `reasoning.exclude` leaves the reasoning out of the answer.
fn reasoning_settings(req: &ChatRequest) -> Result<(ReasoningEffort, bool), ApiError> {
    let nested = req.reasoning.as_ref();
    if nested.and_then(|r| r.enabled) == Some(false) {
        return Err(ApiError::unsupported(
            "reasoning.enabled",
            "GPT-OSS always reasons: reasoning cannot be disabled (use reasoning.effort \"low\", or \
             reasoning.exclude to leave it out of the answer)",
        ));
    }
    if nested.and_then(|r| r.max_tokens.as_ref()).is_some_and(|v| !v.is_null()) {
        return Err(ApiError::unsupported(
            "reasoning.max_tokens",
            "a token budget for the reasoning is not supported (use reasoning.effort)",
        ));
    }
    let flat = req.reasoning_effort.as_deref().map(|e| parse_effort(e, "reasoning_effort")).transpose()?;
    let inner =
        nested.and_then(|r| r.effort.as_deref()).map(|e| parse_effort(e, "reasoning.effort")).transpose()?;
    let effort = match (flat, inner) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::invalid(
                Some("reasoning.effort"),
                format!(
                    "reasoning.effort {:?} contradicts reasoning_effort {:?}; give one",
                    b.as_str(),
                    a.as_str()
                ),
            ));
        }
        (a, b) => a.or(b).unwrap_or(ReasoningEffort::Medium),
    };
    Ok((effort, nested.and_then(|r| r.exclude).unwrap_or(false)))
}

/// Harmony's reasoning effort of `low`, `medium` or `high`; `param` names the field.
pub(crate) fn parse_effort(value: &str, param: &str) -> Result<ReasoningEffort, ApiError> {
    match value {
        "low" => Ok(ReasoningEffort::Low),
        "medium" => Ok(ReasoningEffort::Medium),
        "high" => Ok(ReasoningEffort::High),
        other => Err(ApiError::invalid(
            Some(param),
            format!("{param} must be \"low\", \"medium\" or \"high\", got {other:?}"),
        )),
    }
}

/// Refuses a non-empty `stop` (stop sequences are not supported yet).
pub(crate) fn check_stop(stop: Option<&serde_json::Value>) -> Result<(), ApiError> {
    let empty = match stop {
        None | Some(serde_json::Value::Null) => true,
        Some(serde_json::Value::String(s)) => s.is_empty(),
        Some(serde_json::Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    };
    if empty {
        Ok(())
    } else {
        Err(ApiError::unsupported(
            "stop",
            "stop sequences are not supported; a turn ends at the model's own end of turn",
        ))
    }
}

/// The stop strings of `stop`: a string or a list of at most [`MAX_STOP_STRINGS`] strings.
/// Empty strings stand for no stop string (they would match everywhere).
fn stop_strings(stop: Option<&serde_json::Value>) -> Result<Vec<String>, ApiError> {
    use serde_json::Value;
    let list = match stop {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => return Ok(if s.is_empty() { Vec::new() } else { vec![s.clone()] }),
        Some(Value::Array(list)) => list,
        Some(_) => {
            return Err(ApiError::invalid(Some("stop"), "stop must be a string or a list of strings"));
        }
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            Some("stop"),
            format!("stop holds {} strings; at most {MAX_STOP_STRINGS} are allowed", list.len()),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, s) in list.iter().enumerate() {
        match s {
            Value::String(s) if s.is_empty() => {}
            Value::String(s) => out.push(s.clone()),
            _ => {
                return Err(ApiError::invalid(Some(&format!("stop[{i}]")), "a stop string must be a string"));
            }
        }
    }
    Ok(out)
}

/// The `logit_bias` map: token IDs (decimal strings) in the vocabulary, biases in
/// -100..=100. The error names the key at fault.
fn logit_bias(bias: Option<&serde_json::Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match bias {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::invalid(
                Some("logit_bias"),
                "logit_bias must be an object mapping token IDs to biases",
            ));
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let bad =
            |why: String| ApiError::invalid(Some("logit_bias"), format!("logit_bias key {key:?}: {why}"));
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|_| !key.starts_with('+'))
            .ok_or_else(|| bad("is not a token ID (a decimal number)".into()))?;
        if token as usize >= VOCAB_SIZE {
            return Err(bad(format!("token {token} is outside the vocabulary (0..{VOCAB_SIZE})")));
        }
        let v = value
            .as_f64()
            .filter(|v| (-f64::from(MAX_LOGIT_BIAS)..=f64::from(MAX_LOGIT_BIAS)).contains(v))
            .ok_or_else(|| bad(format!("the bias must be a number from -100 to 100, got {value}")))?;
        out.push((token, v as f32));
    }
    Ok(out)
}

/// The sampling fields of a request, as the chat and the responses APIs both name them.
pub(crate) struct SamplingFields<'a> {
    /// Softmax temperature, 0..=2.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass, (0, 1].
    pub top_p: Option<f32>,
    /// Extension: keep the k most likely tokens (0 or -1: off).
    pub top_k: Option<i64>,
    /// Extension: drop tokens less likely than `min_p` times the best one.
    pub min_p: Option<f32>,
    /// Extension: multiplicative repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Seed of the sampler.
    pub seed: Option<&'a serde_json::Number>,
    /// OpenAI's presence penalty, -2..=2.
    pub presence_penalty: Option<f32>,
    /// OpenAI's frequency penalty, -2..=2.
    pub frequency_penalty: Option<f32>,
    /// OpenAI's `logit_bias` map.
    pub logit_bias: Option<&'a serde_json::Value>,
    /// Log probabilities with this many alternatives; `None`: none.
    pub logprobs: Option<usize>,
}

/// The sampling settings of a request: OpenAI's defaults (temperature 1, top_p 1), and
/// `default_seed` when the request has none.
pub(crate) fn sampling(req: &SamplingFields<'_>, default_seed: u64) -> Result<SamplingParams, ApiError> {
    let temperature = req.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(ApiError::invalid(
            Some("temperature"),
            format!("temperature must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(Some("top_p"), format!("top_p must be in (0, 1], got {top_p}")));
    }
    let top_k = match req.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                Some("top_k"),
                format!("top_k must be -1, 0 or positive, got {k}"),
            ));
        }
    };
    let min_p = req.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid(Some("min_p"), format!("min_p must be in [0, 1], got {min_p}")));
    }
    let repetition_penalty = req.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty.is_finite() && repetition_penalty > 0.0) {
        return Err(ApiError::invalid(
            Some("repetition_penalty"),
            format!("repetition_penalty must be positive, got {repetition_penalty}"),
        ));
    }
    let seed = match req.seed {
        None => default_seed,
        Some(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(ApiError::invalid(Some("seed"), format!("seed must be an integer, got {n}"))),
        },
    };
    let mut penalties = [0.0f32; 2];
    for (slot, (name, value)) in penalties
        .iter_mut()
        .zip([("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)])
    {
        let v = value.unwrap_or(0.0);
        if !(-MAX_PRESENCE_FREQUENCY..=MAX_PRESENCE_FREQUENCY).contains(&v) {
            return Err(ApiError::invalid(Some(name), format!("{name} must be between -2 and 2, got {v}")));
        }
        *slot = v;
    }
    let params = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        seed,
        presence_penalty: penalties[0],
        frequency_penalty: penalties[1],
        logit_bias: logit_bias(req.logit_bias)?,
        logprobs: req.logprobs,
        ..SamplingParams::default()
    };
    params.validate().map_err(|e| ApiError::invalid(None, e.to_string()))?;
    Ok(params)
}

/// Whether `name` is a valid function name (OpenAI's rule: `[A-Za-z0-9_-]{1,64}`).
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Refuses a function name that breaks OpenAI's rule, naming `param`.
pub(crate) fn check_function_name(name: &str, param: &str) -> Result<(), ApiError> {
    if valid_function_name(name) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            Some(param),
            format!("function name {name:?} must be 1 to 64 letters, digits, `_` or `-`"),
        ))
    }
}

fn function_tools(tools: Vec<Tool>) -> Result<Vec<ToolDescription>, ApiError> {
    let mut out: Vec<ToolDescription> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.into_iter().enumerate() {
        if tool.kind != "function" {
            return Err(ApiError::unsupported(
                &format!("tools[{i}].type"),
                format!("only function tools are supported, got type {:?}", tool.kind),
            ));
        }
        let param = format!("tools[{i}].function");
        let f = tool
            .function
            .ok_or_else(|| ApiError::invalid(Some(&param), "a function tool needs `function`"))?;
        check_function_name(&f.name, &format!("{param}.name"))?;
        if out.iter().any(|t| t.name == f.name) {
            return Err(ApiError::invalid(Some(&param), format!("tool {:?} is declared twice", f.name)));
        }
        let parameters = match f.parameters {
            None | Some(JsonValue::Null) => None,
            Some(p @ JsonValue::Object(_)) => Some(p),
            Some(_) => {
                return Err(ApiError::invalid(
                    Some(&format!("{param}.parameters")),
                    "parameters must be a JSON schema object",
                ));
            }
        };
        out.push(ToolDescription::new(f.name, f.description.unwrap_or_default(), parameters));
    }
    Ok(out)
}

/// The text of a message's content: a string, or the text parts joined by newlines.
/// `None` for a missing or null content.
fn content_text(content: Option<serde_json::Value>, param: &str) -> Result<Option<String>, ApiError> {
    match content {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s)),
        Some(serde_json::Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.into_iter().enumerate() {
                let kind = part.get("type").and_then(|t| t.as_str()).unwrap_or("");
                if kind != "text" {
                    return Err(ApiError::unsupported(
                        &format!("{param}[{j}].type"),
                        format!("only text content parts are supported, got type {kind:?}"),
                    ));
                }
                match part.get("text") {
                    Some(serde_json::Value::String(t)) => texts.push(t.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            Some(&format!("{param}[{j}].text")),
                            "a text part needs a string `text`",
                        ));
                    }
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(ApiError::invalid(
            Some(param),
            "content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
        )),
    }
}

fn required_text(content: Option<serde_json::Value>, param: &str, role: &str) -> Result<String, ApiError> {
    content_text(content, param)?
        .ok_or_else(|| ApiError::invalid(Some(param), format!("a {role} message needs `content`")))
}

/// The system/developer instructions (in order) and the other messages in Harmony form.
fn convert_messages(messages: Vec<RequestMessage>) -> Result<(Vec<String>, Vec<Message>), ApiError> {
    let mut instructions = Vec::new();
    let mut out = Vec::with_capacity(messages.len());
    // Tool call ID -> function name, from the assistant messages seen so far.
    let mut calls: HashMap<String, String> = HashMap::new();
    for (i, m) in messages.into_iter().enumerate() {
        let param = format!("messages[{i}]");
        let content_param = format!("{param}.content");
        let role =
            m.role.as_deref().ok_or_else(|| ApiError::invalid(Some(&param), "a message needs `role`"))?;
        match role {
            "system" | "developer" => instructions.push(required_text(m.content, &content_param, role)?),
            "user" => out.push(Message::user(required_text(m.content, &content_param, role)?)),
            "assistant" => {
                let reasoning = m.reasoning_content.or(m.reasoning).filter(|r| !r.is_empty());
                if let Some(r) = reasoning {
                    out.push(Message::assistant("analysis", r));
                }
                let text = content_text(m.content, &content_param)?;
                let tool_calls = m.tool_calls.unwrap_or_default();
                if tool_calls.is_empty() {
                    out.push(Message::assistant("final", text.unwrap_or_default()));
                    continue;
                }
                // Text beside tool calls is a preamble: the commentary channel.
                if let Some(t) = text.filter(|t| !t.is_empty()) {
                    out.push(Message::assistant("commentary", t));
                }
                for (j, call) in tool_calls.into_iter().enumerate() {
                    let call_param = format!("{param}.tool_calls[{j}]");
                    if call.kind.as_deref().is_some_and(|k| k != "function") {
                        return Err(ApiError::unsupported(
                            &format!("{call_param}.type"),
                            "only function tool calls are supported",
                        ));
                    }
                    let name = call.function.name;
                    check_function_name(&name, &format!("{call_param}.function.name"))?;
                    let arguments = match call.function.arguments {
                        JsonValue::String(s) => s,
                        other => other.to_string(),
                    };
                    out.push(Message::tool_call(format!("{FUNCTIONS}.{name}"), arguments));
                    calls.insert(call.id, name);
                }
            }
            "tool" => {
                let id_param = format!("{param}.tool_call_id");
                let id = m.tool_call_id.ok_or_else(|| {
                    ApiError::invalid(Some(&id_param), "a tool message needs `tool_call_id`")
                })?;
                let name = calls.get(&id).ok_or_else(|| {
                    ApiError::invalid(
                        Some(&id_param),
                        format!("tool_call_id {id:?} matches no tool call of an earlier assistant message"),
                    )
                })?;
                let text = required_text(m.content, &content_param, role)?;
                out.push(Message::tool_result(format!("{FUNCTIONS}.{name}"), text));
            }
            "function" => {
                return Err(ApiError::unsupported(
                    &format!("{param}.role"),
                    "the deprecated `function` role is not supported; use `tool`",
                ));
            }
            other => {
                return Err(ApiError::invalid(
                    Some(&format!("{param}.role")),
                    format!("unknown role {other:?} (expected system, developer, user, assistant or tool)"),
                ));
            }
        }
    }
    Ok((instructions, out))
}

/// OpenAI's name of a tool recipient: `functions.get_weather` -> `get_weather`; other
/// recipients (builtin tools) are kept whole.
pub(crate) fn function_name(recipient: &str) -> &str {
    recipient.strip_prefix("functions.").unwrap_or(recipient)
}

/// The assistant message of a response, from the messages the model generated: analysis is
/// the reasoning (as `reasoning_content` and as `reasoning`), messages addressed to a tool are tool calls (`new_id` names each), and
/// every other message (final answer, commentary preamble) is content.
pub(crate) fn response_message(messages: &[Message], new_id: &mut dyn FnMut() -> String) -> ResponseMessage {
    let mut content: Option<String> = None;
    let mut reasoning: Option<String> = None;
    let mut tool_calls = Vec::new();
    for m in messages {
        let text = m.text();
        if let Some(recipient) = &m.recipient {
            tool_calls.push(ToolCall {
                id: new_id(),
                kind: "function",
                function: FunctionCall { name: function_name(recipient).to_string(), arguments: text },
            });
        } else if m.channel.as_deref() == Some("analysis") {
            reasoning.get_or_insert_with(String::new).push_str(&text);
        } else {
            content.get_or_insert_with(String::new).push_str(&text);
        }
    }
    ResponseMessage {
        role: "assistant",
        content,
        reasoning_content: reasoning.clone(),
        reasoning,
        tool_calls,
    }
}

/// OpenAI's finish reason: `tool_calls` when the turn ended in a tool call, `length` when
/// it ran out of tokens or context, `stop` otherwise.
pub(crate) fn finish_reason(stop: StopReason, called_tool: bool) -> &'static str {
    match stop {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        _ if called_tool => "tool_calls",
        _ => "stop",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{Content, Role};

    fn plan_json(json: &str) -> Result<Plan, ApiError> {
        plan(parse_request(json.as_bytes())?, "2026-01-02", 7)
    }

    fn param(json: &str) -> Option<String> {
        plan_json(json).unwrap_err().param
    }

    #[test]
    fn messages_map_to_harmony() {
        let p = plan_json(
            r#"{"model": "m", "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use metric."}]},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": null, "reasoning_content": "Call it.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
                {"role": "assistant", "content": "It is 5 C."},
                {"role": "user", "content": "Thanks"}],
              "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                 "parameters": {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "number"}}}}}],
              "reasoning_effort": "high", "temperature": 0, "max_tokens": 9}"#,
        )
        .unwrap();
        let m = &p.conversation.messages;
        let Content::System(sys) = &m[0].content[0] else { panic!("no system content") };
        assert_eq!(sys.reasoning_effort, Some(ReasoningEffort::High));
        assert_eq!(sys.conversation_start_date.as_deref(), Some("2026-01-02"));
        let Content::Developer(dev) = &m[1].content[0] else { panic!("no developer content") };
        assert_eq!(dev.instructions.as_deref(), Some("Be brief.\n\nUse metric."));
        let tool = &dev.tools.as_ref().unwrap()["functions"].tools[0];
        let keys: Vec<&str> = tool
            .parameters
            .as_ref()
            .unwrap()
            .get("properties")
            .unwrap()
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys, ["z", "a"], "schema key order is kept");
        assert_eq!(m[2], Message::user("Weather?"));
        assert_eq!(m[3], Message::assistant("analysis", "Call it."));
        assert_eq!(m[4], Message::tool_call("functions.get_weather", r#"{"city":"Oslo"}"#));
        assert_eq!(m[5], Message::tool_result("functions.get_weather", "5 C"));
        assert_eq!(m[6], Message::assistant("final", "It is 5 C."));
        assert_eq!(m[7].role, Role::User);
        assert_eq!(m.len(), 8);
        assert_eq!((p.sampling.temperature, p.sampling.seed, p.max_tokens), (0.0, 7, Some(9)));
        assert!(!p.stream);
    }

    #[test]
    fn defaults_are_openai_s() {
        let p = plan_json(r#"{"messages": [{"role": "user", "content": "hi"}], "seed": -1}"#).unwrap();
        assert_eq!(p.conversation.messages.len(), 2, "no developer message without instructions or tools");
        assert_eq!((p.sampling.temperature, p.sampling.top_p, p.sampling.seed), (1.0, 1.0, u64::MAX));
        assert_eq!(p.max_tokens, None);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let user = r#""messages": [{"role": "user", "content": "hi"}]"#;
        assert_eq!(param(r#"{"messages": []}"#).as_deref(), Some("messages"));
        assert_eq!(param("{}").as_deref(), Some("messages"));
        assert_eq!(param(&format!(r#"{{{user}, "temperature": "hot"}}"#)).as_deref(), Some("temperature"));
        assert_eq!(param(&format!(r#"{{{user}, "temperature": 2.5}}"#)).as_deref(), Some("temperature"));
        assert_eq!(param(&format!(r#"{{{user}, "top_p": 0}}"#)).as_deref(), Some("top_p"));
        assert_eq!(param(&format!(r#"{{{user}, "n": 2}}"#)).as_deref(), Some("n"));
        assert_eq!(param(&format!(r#"{{{user}, "max_tokens": 0}}"#)).as_deref(), Some("max_tokens"));
        assert_eq!(param(&format!(r#"{{{user}, "max_tokens": -5}}"#)).as_deref(), Some("max_tokens"));
        for (extra, field) in [
            (r#""stop": ["a", "b", "c", "d", "e"]"#, "stop"),
            (r#""stop": 5"#, "stop"),
            (r#""stop": ["a", 5]"#, "stop[1]"),
            (r#""logit_bias": {"abc": 1}"#, "logit_bias"),
            (r#""logit_bias": {"201088": 1}"#, "logit_bias"),
            (r#""logit_bias": {"5": 101}"#, "logit_bias"),
            (r#""logit_bias": {"5": "up"}"#, "logit_bias"),
            (r#""logit_bias": [1]"#, "logit_bias"),
            (r#""presence_penalty": 2.5"#, "presence_penalty"),
            (r#""frequency_penalty": -3"#, "frequency_penalty"),
            (r#""logprobs": true, "top_logprobs": 21"#, "top_logprobs"),
            (r#""top_logprobs": 3"#, "top_logprobs"),
        ] {
            assert_eq!(param(&format!("{{{user}, {extra}}}")).as_deref(), Some(field), "{extra}");
        }
        let e = plan_json(&format!(r#"{{{user}, "logit_bias": {{"12": 1, "999999": 5}}}}"#)).unwrap_err();
        assert!(
            e.message.contains("\"999999\"") && e.message.contains("outside the vocabulary"),
            "{}",
            e.message
        );
        assert!(plan_json(&format!(r#"{{{user}, "stop": null}}"#)).is_ok());
        assert_eq!(
            param(&format!(r#"{{{user}, "reasoning_effort": "max"}}"#)).as_deref(),
            Some("reasoning_effort")
        );
        assert_eq!(
            param(&format!(r#"{{{user}, "tool_choice": "required"}}"#)).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            param(r#"{"messages": [{"role": "robot", "content": "x"}]}"#).as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(param(r#"{"messages": [{"content": "x"}]}"#).as_deref(), Some("messages[0]"));
        assert_eq!(param(r#"{"messages": [{"role": "user"}]}"#).as_deref(), Some("messages[0].content"));
        assert_eq!(
            param(r#"{"messages": [{"role": "user", "content": 5}]}"#).as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            param(r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#)
                .as_deref(),
            Some("messages[0].content[0].type")
        );
        assert_eq!(
            param(r#"{"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}"#).as_deref(),
            Some("messages[0].tool_call_id")
        );
        assert_eq!(
            param(&format!(
                r#"{{{user}, "tools": [{{"type": "function", "function": {{"name": "a.b"}}}}]}}"#
            ))
            .as_deref(),
            Some("tools[0].function.name")
        );
        let e = plan_json("{not json").unwrap_err();
        assert_eq!((e.status.as_u16(), e.param), (400, None));
        let e = plan_json("[1, 2]").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        for body in ["[]", " [1, 2]", "5", "\"hi\"", "null"] {
            let e = plan_json(body).unwrap_err();
            assert_eq!(e.message, "the body must be a JSON object", "{body}");
        }
        let e = plan_json(r#"{"messages": [5]}"#).unwrap_err();
        assert!(
            !e.message.contains("struct") && e.message.contains("expected a JSON object"),
            "{}",
            e.message
        );
        assert_eq!(e.param.as_deref(), Some("messages[0]"));
    }

    #[test]
    fn output_controls_map_to_the_plan() {
        let p = plan_json(
            r#"{"messages": [{"role": "user", "content": "hi"}], "stop": ["END", "", "\n\n"],
                "logprobs": true, "top_logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -1,
                "logit_bias": {"17": -100, "200002": 2.5}}"#,
        )
        .unwrap();
        assert_eq!(p.stop, ["END", "\n\n"], "empty stop strings stand for none");
        assert!(p.logprobs);
        assert_eq!(p.sampling.logprobs, Some(3));
        assert_eq!((p.sampling.presence_penalty, p.sampling.frequency_penalty), (0.5, -1.0));
        let mut bias = p.sampling.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, [(17, -100.0), (200002, 2.5)]);
        let p = plan_json(r#"{"messages": [{"role": "user", "content": "hi"}], "stop": "x"}"#).unwrap();
        assert_eq!((p.stop, p.logprobs, p.sampling.logprobs), (vec!["x".to_string()], false, None));
        let p = plan_json(r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}"#).unwrap();
        assert_eq!(p.sampling.logprobs, Some(0));
        let e = plan_json(r#"{"messages": [{"role": "user", "content": "hi"}], "n": 2}"#).unwrap_err();
        assert!(
            e.message.contains("one sequence") && e.code == Some("unsupported_parameter"),
            "{}",
            e.message
        );
    }

    #[test]
    fn reasoning_settings_agree_or_are_refused() {
        let user = r#""messages": [{"role": "user", "content": "hi"}]"#;
        let effort = |p: &Plan| match &p.conversation.messages[0].content[0] {
            Content::System(sys) => sys.reasoning_effort,
            _ => None,
        };
        let p =
            plan_json(&format!(r#"{{{user}, "reasoning": {{"effort": "high", "exclude": true}}}}"#)).unwrap();
        assert_eq!((effort(&p), p.exclude_reasoning), (Some(ReasoningEffort::High), true));
        let p =
            plan_json(&format!(r#"{{{user}, "reasoning_effort": "low", "reasoning": {{"effort": "low"}}}}"#))
                .unwrap();
        assert_eq!((effort(&p), p.exclude_reasoning), (Some(ReasoningEffort::Low), false));
        let p = plan_json(&format!(r#"{{{user}, "reasoning": {{"enabled": true}}}}"#)).unwrap();
        assert_eq!(effort(&p), Some(ReasoningEffort::Medium));
        let refused = |body: &str| {
            let e = plan_json(&format!("{{{user}, {body}}}")).unwrap_err();
            (e.param.unwrap_or_default(), e.code)
        };
        assert_eq!(
            refused(r#""reasoning_effort": "low", "reasoning": {"effort": "high"}"#),
            ("reasoning.effort".into(), None)
        );
        assert_eq!(refused(r#""reasoning": {"effort": "max"}"#), ("reasoning.effort".into(), None));
        assert_eq!(
            refused(r#""reasoning": {"enabled": false}"#),
            ("reasoning.enabled".into(), Some("unsupported_parameter"))
        );
        assert_eq!(
            refused(r#""reasoning": {"max_tokens": 100}"#),
            ("reasoning.max_tokens".into(), Some("unsupported_parameter"))
        );
    }

    #[test]
    fn formats_and_tool_choices_become_the_turn_grammar() {
        let p = plan_json(
            r#"{"messages": [{"role": "user", "content": "hi"}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "person",
                  "schema": {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "number"}}},
                  "strict": true}}}"#,
        )
        .unwrap();
        let s = p.structured.unwrap();
        let crate::constrain::AnswerFormat::JsonSchema { schema, strict } = &s.spec.answer else {
            panic!("not a schema: {:?}", s.spec.answer)
        };
        assert!(*strict);
        let keys: Vec<&String> = schema["properties"].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["z", "a"], "the schema's key order is kept");
        let Content::Developer(dev) = &p.conversation.messages[1].content[0] else {
            panic!("no developer message")
        };
        let instructions = dev.instructions.as_deref().unwrap();
        assert!(instructions.starts_with("# Response Formats\n\n## person\n\n{\"type\""), "{instructions}");

        let tools = r#""tools": [{"type": "function", "function": {"name": "f", "strict": true,
            "parameters": {"type": "object"}}}]"#;
        let with = |choice: &str| {
            plan_json(&format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}}], {tools}, "tool_choice": {choice}}}"#
            ))
            .unwrap()
        };
        let named = with(r#"{"type": "function", "function": {"name": "f"}}"#);
        let crate::constrain::ToolRule::Required(rules) = &named.structured.unwrap().spec.tools else {
            panic!("not required")
        };
        assert_eq!((rules[0].name.as_str(), rules[0].strict), ("f", true));
        assert_eq!(named.declared_functions, ["f"]);
        let none = with(r#""none""#);
        assert_eq!(none.structured.unwrap().spec.tools, crate::constrain::ToolRule::Forbidden);
        assert!(none.declared_functions.is_empty());
        // No tools and no format: no grammar.
        assert!(
            plan_json(r#"{"messages": [{"role": "user", "content": "hi"}]}"#).unwrap().structured.is_none()
        );
    }

    #[test]
    fn generated_messages_map_back() {
        let messages = [
            Message::assistant("analysis", "think"),
            Message::assistant("commentary", "Checking."),
            Message::tool_call("functions.get_weather", "{}"),
        ];
        let mut n = 0;
        let m = response_message(&messages, &mut || {
            n += 1;
            format!("call_{n}")
        });
        assert_eq!(m.reasoning_content.as_deref(), Some("think"));
        assert_eq!(m.reasoning, m.reasoning_content, "both names carry the reasoning");
        assert_eq!(m.content.as_deref(), Some("Checking."));
        assert_eq!(m.tool_calls[0].id, "call_1");
        assert_eq!(m.tool_calls[0].function.name, "get_weather");
        assert_eq!(finish_reason(StopReason::Stop(200012), true), "tool_calls");
        assert_eq!(finish_reason(StopReason::MaxTokens, true), "length");
        assert_eq!(finish_reason(StopReason::Stop(200002), false), "stop");
        let empty = response_message(&[], &mut String::new);
        assert_eq!((empty.content, empty.reasoning_content), (None, None));
    }
}
