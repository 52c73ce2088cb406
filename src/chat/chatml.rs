//! ChatML as Qwen3 renders it, over a Hugging Face tokenizer: token-exact with Transformers'
//! `apply_chat_template` on Qwen3's hybrid-thinking template (the `chat_template` of
//! Qwen/Qwen3-30B-A3B's `tokenizer_config.json`, kept in `fixtures/gen_qwen3_tokenizer.py`
//! and checked against its renderings in `fixtures/chatml/`).
//!
//! A turn is `<|im_start|>ROLE\n...<|im_end|>\n`. The format-neutral [`Conversation`] maps
//! onto it as follows:
//!
//! - the first system or developer text (instructions) is the system message; the function
//!   tools of any developer message are listed in it inside `<tools></tools>` with the
//!   template's instructions; Harmony's structured system content (identity, dates,
//!   reasoning effort, channels) has no ChatML form and is left out;
//! - consecutive assistant messages are one assistant turn: `analysis` messages are its
//!   reasoning (`<think>\n...\n</think>\n\n`, kept only after the last user query, as the
//!   template does), messages with a recipient `functions.NAME` its tool calls
//!   (`<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`), the rest its content;
//! - tool results are one user turn of `<tool_response>\n...\n</tool_response>` blocks;
//! - the prompt ends with `<|im_start|>assistant\n`, plus the empty `<think>\n\n</think>\n\n`
//!   when thinking is off (`enable_thinking=false`).
//!
//! Text between control tokens is tokenized as a whole, as Transformers does; text from the
//! conversation never becomes a control token (Transformers would turn a `<think>` typed by
//! a user into the token: here it stays text).

use std::path::Path;
use std::sync::Arc;

use super::hf_tokenizer::HfTokenizer;
use super::json::JsonValue;
use super::message::{Content, Conversation, Message, Role, ToolDescription};
use crate::error::{Error, Result};

/// The namespace of function tools in recipients (`functions.get_weather`).
const FUNCTIONS_PREFIX: &str = "functions.";

/// The control tokens ChatML needs, by text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatMlTokens {
    /// `<|im_start|>`
    pub im_start: u32,
    /// `<|im_end|>`
    pub im_end: u32,
    /// `<think>`
    pub think: u32,
    /// `</think>`
    pub think_end: u32,
    /// `<tool_call>`
    pub tool_call: u32,
    /// `</tool_call>`
    pub tool_call_end: u32,
    /// `<tool_response>`
    pub tool_response: u32,
    /// `</tool_response>`
    pub tool_response_end: u32,
}

/// The ChatML format of Qwen3 over its tokenizer.
#[derive(Debug)]
pub struct ChatMl {
    tokenizer: Arc<HfTokenizer>,
    tokens: ChatMlTokens,
    stop_tokens: Vec<u32>,
    thinking: bool,
}

/// One piece of a rendering: a control token, or text tokenized as a whole.
enum Piece {
    Token(u32),
    Text(String),
}

/// A rendering under construction.
#[derive(Default)]
struct Pieces(Vec<Piece>);

impl Pieces {
    fn token(&mut self, id: u32) {
        self.0.push(Piece::Token(id));
    }

    fn text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some(Piece::Text(t)) => t.push_str(text),
            _ => self.0.push(Piece::Text(text.to_string())),
        }
    }
}

/// A conversation in the template's terms.
#[derive(Debug, PartialEq)]
enum Turn {
    System(String),
    User(String),
    Assistant { reasoning: Option<String>, content: String, calls: Vec<(String, String)> },
    Tool(String),
}

/// Python's `str.strip('\n')`, `lstrip`, `rstrip` for newlines only.
fn trim_newlines(s: &str) -> &str {
    s.trim_matches('\n')
}

impl ChatMl {
    /// ChatML over `tokenizer`, ending generation at `stop_tokens`, thinking on.
    /// Fails, naming the tokenizer file, when one of the ChatML control tokens is missing.
    pub fn new(tokenizer: Arc<HfTokenizer>, stop_tokens: Vec<u32>) -> Result<Self> {
        let id = |name: &str| {
            tokenizer.special_id(name).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: the tokenizer has no `{name}` token, which the ChatML format of Qwen3 needs",
                    tokenizer.path().display()
                ))
            })
        };
        let tokens = ChatMlTokens {
            im_start: id("<|im_start|>")?,
            im_end: id("<|im_end|>")?,
            think: id("<think>")?,
            think_end: id("</think>")?,
            tool_call: id("<tool_call>")?,
            tool_call_end: id("</tool_call>")?,
            tool_response: id("<tool_response>")?,
            tool_response_end: id("</tool_response>")?,
        };
        Ok(ChatMl { tokenizer, tokens, stop_tokens, thinking: true })
    }

    /// Reads `tokenizer.json` and `generation_config.json` (for the stop tokens) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer = Arc::new(HfTokenizer::from_file(&dir.join("tokenizer.json"))?);
        let stops = stop_tokens(&tokenizer, &dir.join("generation_config.json"))?;
        ChatMl::new(tokenizer, stops)
    }

    /// The same format with thinking on or off (off: the prompt ends with the empty think
    /// block, as `enable_thinking=false` renders it).
    pub fn with_thinking(mut self, thinking: bool) -> Self {
        self.thinking = thinking;
        self
    }

    /// Whether the model is asked to think first.
    pub fn thinking(&self) -> bool {
        self.thinking
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<HfTokenizer> {
        &self.tokenizer
    }

    /// The control tokens.
    pub fn tokens(&self) -> &ChatMlTokens {
        &self.tokens
    }

    /// Tokens that end generation (`eos_token_id` of `generation_config.json`).
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    /// The prompt for the assistant's next turn.
    pub fn render_for_completion(&self, conversation: &Conversation) -> Result<Vec<u32>> {
        let mut p = self.render_pieces(conversation)?;
        p.token(self.tokens.im_start);
        p.text("assistant\n");
        if !self.thinking {
            p.token(self.tokens.think);
            p.text("\n\n");
            p.token(self.tokens.think_end);
            p.text("\n\n");
        }
        self.encode_pieces(&p)
    }

    fn encode_pieces(&self, pieces: &Pieces) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for piece in &pieces.0 {
            match piece {
                Piece::Token(id) => out.push(*id),
                Piece::Text(text) => out.extend(self.tokenizer.encode(text)?),
            }
        }
        Ok(out)
    }

    fn render_pieces(&self, conversation: &Conversation) -> Result<Pieces> {
        let t = &self.tokens;
        let turns = turns(conversation)?;
        let tools = function_tools(conversation);
        let mut p = Pieces::default();
        let leading_system = match turns.first() {
            Some(Turn::System(text)) => Some(text.as_str()),
            _ => None,
        };
        if !tools.is_empty() {
            p.token(t.im_start);
            p.text("system\n");
            if let Some(system) = leading_system {
                p.text(system);
                p.text("\n\n");
            }
            p.text(
                "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
                 You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
            );
            for tool in &tools {
                p.text("\n");
                p.text(&tool_json(tool));
            }
            // Transformers tokenizes the template's own `<tool_call>` text as the token.
            p.text(
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
                 within ",
            );
            p.token(t.tool_call);
            p.token(t.tool_call_end);
            p.text(" XML tags:\n");
            p.token(t.tool_call);
            p.text("\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n");
            p.token(t.tool_call_end);
            p.token(t.im_end);
            p.text("\n");
        } else if let Some(system) = leading_system {
            p.token(t.im_start);
            p.text("system\n");
            p.text(system);
            p.token(t.im_end);
            p.text("\n");
        }
        let last_query = turns.iter().rposition(|turn| match turn {
            Turn::User(text) => !(text.starts_with("<tool_response>") && text.ends_with("</tool_response>")),
            _ => false,
        });
        // The template's `last_query_index` starts at the last message when no user query is found.
        let last_query = last_query.unwrap_or(turns.len().saturating_sub(1));
        for (i, turn) in turns.iter().enumerate() {
            let last = i + 1 == turns.len();
            match turn {
                Turn::System(_) if i == 0 => {}
                Turn::System(text) | Turn::User(text) => {
                    let role = if matches!(turn, Turn::System(_)) { "system" } else { "user" };
                    p.token(t.im_start);
                    p.text(role);
                    p.text("\n");
                    p.text(text);
                    p.token(t.im_end);
                    p.text("\n");
                }
                Turn::Assistant { reasoning, content, calls } => {
                    let (reasoning, content) = split_think(reasoning.as_deref(), content);
                    p.token(t.im_start);
                    p.text("assistant\n");
                    let content = if i > last_query && (last || !reasoning.is_empty()) {
                        p.token(t.think);
                        p.text("\n");
                        p.text(trim_newlines(&reasoning));
                        p.text("\n");
                        p.token(t.think_end);
                        p.text("\n\n");
                        content.trim_start_matches('\n').to_string()
                    } else {
                        content
                    };
                    p.text(&content);
                    for (k, (name, arguments)) in calls.iter().enumerate() {
                        if k > 0 || !content.is_empty() {
                            p.text("\n");
                        }
                        p.token(t.tool_call);
                        p.text("\n{\"name\": \"");
                        p.text(name);
                        p.text("\", \"arguments\": ");
                        p.text(arguments);
                        p.text("}\n");
                        p.token(t.tool_call_end);
                    }
                    p.token(t.im_end);
                    p.text("\n");
                }
                Turn::Tool(text) => {
                    if i == 0 || !matches!(turns[i - 1], Turn::Tool(_)) {
                        p.token(t.im_start);
                        p.text("user");
                    }
                    p.text("\n");
                    p.token(t.tool_response);
                    p.text("\n");
                    p.text(text);
                    p.text("\n");
                    p.token(t.tool_response_end);
                    if last || !matches!(turns[i + 1], Turn::Tool(_)) {
                        p.token(t.im_end);
                        p.text("\n");
                    }
                }
            }
        }
        Ok(p)
    }
}

/// The template's reading of an assistant turn: reasoning given apart, or (when none is)
/// taken out of a content that holds `</think>`.
fn split_think(reasoning: Option<&str>, content: &str) -> (String, String) {
    if let Some(r) = reasoning {
        return (r.to_string(), content.to_string());
    }
    match content.find("</think>") {
        Some(_) => {
            let mut parts = content.split("</think>");
            let before = parts.next().unwrap_or("").trim_end_matches('\n');
            let reasoning = before.rsplit("<think>").next().unwrap_or("").trim_start_matches('\n');
            let after = content.rsplit("</think>").next().unwrap_or("").trim_start_matches('\n');
            (reasoning.to_string(), after.to_string())
        }
        None => (String::new(), content.to_string()),
    }
}

/// The messages of `conversation` as template turns.
fn turns(conversation: &Conversation) -> Result<Vec<Turn>> {
    let mut out: Vec<Turn> = Vec::new();
    for m in &conversation.messages {
        match m.role {
            Role::System | Role::Developer => {
                if let Some(text) = instructions(m) {
                    out.push(Turn::System(text));
                }
            }
            Role::User => out.push(Turn::User(m.text())),
            Role::Tool => out.push(Turn::Tool(m.text())),
            Role::Assistant => add_assistant(&mut out, m),
        }
    }
    Ok(out)
}

/// The system text of a system or developer message: its instructions or plain text;
/// `None` when it has neither (Harmony's structured system content, tools alone).
fn instructions(m: &Message) -> Option<String> {
    let mut text = String::new();
    for c in &m.content {
        match c {
            Content::Text { text: t } => text.push_str(t),
            Content::Developer(d) => {
                if let Some(i) = &d.instructions {
                    text.push_str(i);
                }
            }
            Content::System(_) => {}
        }
    }
    (!text.is_empty()).then_some(text)
}

/// Adds an assistant message to the turn it belongs to.
fn add_assistant(turns: &mut Vec<Turn>, m: &Message) {
    let call =
        m.recipient.as_deref().filter(|r| *r != "all").map(|r| r.strip_prefix(FUNCTIONS_PREFIX).unwrap_or(r));
    let open =
        matches!(turns.last(), Some(Turn::Assistant { calls, .. }) if call.is_some() || calls.is_empty());
    if !open {
        turns.push(Turn::Assistant { reasoning: None, content: String::new(), calls: Vec::new() });
    }
    let Some(Turn::Assistant { reasoning, content, calls }) = turns.last_mut() else { return };
    let text = m.text();
    match call {
        Some(name) => calls.push((name.to_string(), text)),
        None if m.channel.as_deref() == Some("analysis") => {
            reasoning.get_or_insert_with(String::new).push_str(&text)
        }
        None => content.push_str(&text),
    }
}

/// The function tools the conversation's developer messages declare, in order.
fn function_tools(conversation: &Conversation) -> Vec<&ToolDescription> {
    conversation
        .messages
        .iter()
        .flat_map(|m| &m.content)
        .filter_map(|c| match c {
            Content::Developer(d) => d.tools.as_ref().and_then(|t| t.get("functions")),
            _ => None,
        })
        .flat_map(|ns| &ns.tools)
        .collect()
}

/// A tool as the template lists it: `{"type": "function", "function": {...}}` in Python's
/// `json.dumps` form (`", "` and `": "` separators, non-ASCII kept).
fn tool_json(tool: &ToolDescription) -> String {
    let mut function = vec![
        ("name".to_string(), JsonValue::String(tool.name.clone())),
        ("description".to_string(), JsonValue::String(tool.description.clone())),
    ];
    if let Some(parameters) = &tool.parameters {
        function.push(("parameters".to_string(), parameters.clone()));
    }
    let value = JsonValue::Object(vec![
        ("type".to_string(), JsonValue::String("function".into())),
        ("function".to_string(), JsonValue::Object(function)),
    ]);
    let mut out = String::new();
    python_json(&value, &mut out);
    out
}

/// `json.dumps(value, ensure_ascii=False)`.
fn python_json(value: &JsonValue, out: &mut String) {
    match value {
        JsonValue::Null => out.push_str("null"),
        JsonValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        JsonValue::Number(n) => out.push_str(&n.to_string()),
        JsonValue::String(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
        JsonValue::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_json(item, out);
            }
            out.push(']');
        }
        JsonValue::Object(members) => {
            out.push('{');
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                python_json(v, out);
            }
            out.push('}');
        }
    }
}

/// The stop tokens of `generation_config.json`'s `eos_token_id` (an ID or a list); when the
/// file or the key is absent, `<|im_end|>` and `<|endoftext|>` by name.
pub fn stop_tokens(tokenizer: &HfTokenizer, path: &Path) -> Result<Vec<u32>> {
    let from_config = match std::fs::read_to_string(path) {
        Ok(text) => {
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::invalid(format!("{}: not JSON: {e}", path.display())))?;
            let bad = || {
                Error::invalid(format!(
                    "{}: `eos_token_id` is not a token ID or a list of them",
                    path.display()
                ))
            };
            let id = |v: &serde_json::Value| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(bad);
            match v.get("eos_token_id") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::Array(items)) => {
                    Some(items.iter().map(id).collect::<Result<Vec<u32>>>()?)
                }
                Some(one) => Some(vec![id(one)?]),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::invalid(format!("reading {}: {e}", path.display()))),
    };
    let stops = match from_config {
        Some(ids) => ids,
        None => ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|n| tokenizer.special_id(n)).collect(),
    };
    if stops.is_empty() {
        return Err(Error::invalid(format!(
            "{}: no stop token: `eos_token_id` is empty or absent, and the tokenizer has neither <|im_end|> nor <|endoftext|>",
            path.display()
        )));
    }
    for &s in &stops {
        tokenizer.check(s).map_err(|e| Error::invalid(format!("{}: `eos_token_id`: {e}", path.display())))?;
    }
    Ok(stops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn think_blocks_in_content_are_split_as_the_template_does() {
        assert_eq!(split_think(None, "<think>\nhm\n</think>\n\nok"), ("hm".into(), "ok".into()));
        assert_eq!(split_think(None, "plain"), (String::new(), "plain".into()));
        assert_eq!(split_think(Some("r"), "a</think>b"), ("r".into(), "a</think>b".into()));
    }

    #[test]
    fn python_json_spacing() {
        let v: JsonValue = r#"{"a":[1,2,{"b":null}],"c":"é\n\"x\""}"#.parse().unwrap();
        let mut out = String::new();
        python_json(&v, &mut out);
        assert_eq!(out, r#"{"a": [1, 2, {"b": null}], "c": "é\n\"x\""}"#);
    }

    #[test]
    fn assistant_messages_group_into_turns() {
        let c = Conversation::from_messages([
            Message::user("q"),
            Message::assistant("analysis", "think"),
            Message::assistant("final", "a"),
            Message::tool_call("functions.f", "{}"),
            Message::tool_result("functions.f", "r"),
            Message::assistant("final", "done"),
        ]);
        let t = turns(&c).unwrap();
        assert_eq!(
            t,
            vec![
                Turn::User("q".into()),
                Turn::Assistant {
                    reasoning: Some("think".into()),
                    content: "a".into(),
                    calls: vec![("f".into(), "{}".into())]
                },
                Turn::Tool("r".into()),
                Turn::Assistant { reasoning: None, content: "done".into(), calls: vec![] },
            ]
        );
    }
}
