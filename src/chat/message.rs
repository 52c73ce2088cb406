//! Conversations in the Harmony format: roles, messages, and the structured contents of the
//! system and developer messages.
//!
//! The serde form is the official library's JSON (`Conversation.to_json()` in
//! `openai_harmony`): a message is `{"role", "name", "recipient", "channel", "content_type",
//! "content"}` where `content` is a string or a list of `{"type": "text" | "system_content" |
//! "developer_content", ...}`. Absent optional fields are `None`, not the defaults.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use super::json::JsonValue;
use crate::error::{Error, Result};

/// Who wrote a message.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The end user.
    User,
    /// The model.
    Assistant,
    /// The system message: identity, dates, reasoning effort, channels, builtin tools.
    System,
    /// The developer message: instructions and function tools.
    Developer,
    /// A tool's reply; the message's `name` is the tool (`functions.get_weather`).
    Tool,
}

impl Role {
    /// The role as written in a header: `user`, `assistant`, ...
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::System => "system",
            Role::Developer => "developer",
            Role::Tool => "tool",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            "system" => Ok(Role::System),
            "developer" => Ok(Role::Developer),
            "tool" => Ok(Role::Tool),
            _ => Err(Error::invalid(format!("Unknown role: {s}"))),
        }
    }
}

/// How much the model reasons before answering (`Reasoning: low|medium|high`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReasoningEffort {
    /// `low`
    Low,
    /// `medium`, the default.
    Medium,
    /// `high`
    High,
}

impl ReasoningEffort {
    /// The word used in the system message.
    pub fn as_str(&self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

/// The channels the system message declares.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(default)]
pub struct ChannelConfig {
    /// Channels the model may write to; none means the line is not rendered.
    pub valid_channels: Vec<String>,
    /// Whether every assistant message must name its channel.
    pub channel_required: bool,
}

impl ChannelConfig {
    /// `channels`, each message required to name one.
    pub fn require_channels<I: IntoIterator<Item = T>, T: Into<String>>(channels: I) -> Self {
        ChannelConfig {
            valid_channels: channels.into_iter().map(Into::into).collect(),
            channel_required: true,
        }
    }
}

/// One tool: a name, a description, and its parameters as a JSON schema.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ToolDescription {
    /// The tool's name inside its namespace (`get_weather`).
    pub name: String,
    /// What the tool does; rendered as `//` comments, one per line.
    pub description: String,
    /// The JSON schema of the single argument, rendered as a TypeScript type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<JsonValue>,
}

impl ToolDescription {
    /// A tool; parse `parameters` from JSON text (`str::parse`) to keep its key order.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: Option<JsonValue>,
    ) -> Self {
        ToolDescription { name: name.into(), description: description.into(), parameters }
    }
}

/// A namespace of tools (`functions`, `browser`, `python`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ToolNamespace {
    /// The namespace; a call goes to `NAME.TOOL`.
    pub name: String,
    /// Text shown before the tools (as `//` comments when there are tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The tools; may be empty (then the namespace is just its description, like `python`).
    #[serde(default)]
    pub tools: Vec<ToolDescription>,
}

const BROWSER_DESCRIPTION: &str = "Tool for browsing.\nThe `cursor` appears in brackets before each browsing display: `[{cursor}]`.\nCite information from the tool using the following format:\n`【{cursor}†L{line_start}(-L{line_end})?】`, for example: `【6†L9-L11】` or `【8†L3】`.\nDo not quote more than 10 words directly from the tool output.\nsources=web (default: web)";

const PYTHON_DESCRIPTION: &str = "Use this tool to execute Python code in your chain of thought. The code will not be shown to the user. This tool should be used for internal reasoning, but not for code that is intended to be visible to the user (e.g. when creating plots, tables, or files).\n\nWhen you send a message containing Python code to python, it will be executed in a stateful Jupyter notebook environment. python will respond with the output of the execution or time out after 120.0 seconds. The drive at '/mnt/data' can be used to save and persist user files. Internet access for this session is UNKNOWN. Depends on the cluster.";

const BROWSER_TOOLS: [(&str, &str, &str); 3] = [
    (
        "search",
        "Searches for information related to `query` and displays `topn` results.",
        r#"{"type":"object","properties":{"query":{"type":"string"},"topn":{"type":"number","default":10},"source":{"type":"string"}},"required":["query"]}"#,
    ),
    (
        "open",
        "Opens the link `id` from the page indicated by `cursor` starting at line number `loc`, showing `num_lines` lines.\nValid link ids are displayed with the formatting: `【{id}†.*】`.\nIf `cursor` is not provided, the most recent page is implied.\nIf `id` is a string, it is treated as a fully qualified URL associated with `source`.\nIf `loc` is not provided, the viewport will be positioned at the beginning of the document or centered on the most relevant passage, if available.\nUse this function without `id` to scroll to a new location of an opened page.",
        r#"{"type":"object","properties":{"id":{"type":["number","string"],"default":-1},"cursor":{"type":"number","default":-1},"loc":{"type":"number","default":-1},"num_lines":{"type":"number","default":-1},"view_source":{"type":"boolean","default":false},"source":{"type":"string"}}}"#,
    ),
    (
        "find",
        "Finds exact matches of `pattern` in the current page, or the page given by `cursor`.",
        r#"{"type":"object","properties":{"pattern":{"type":"string"},"cursor":{"type":"number","default":-1}},"required":["pattern"]}"#,
    ),
];

impl ToolNamespace {
    /// A namespace of tools.
    pub fn new(name: impl Into<String>, description: Option<String>, tools: Vec<ToolDescription>) -> Self {
        ToolNamespace { name: name.into(), description, tools }
    }

    /// The builtin `browser` tool (search, open, find), as the official library defines it.
    pub fn browser() -> Self {
        let tools = BROWSER_TOOLS
            .iter()
            .map(|(name, desc, schema)| ToolDescription::new(*name, *desc, schema.parse().ok()))
            .collect();
        ToolNamespace::new("browser", Some(BROWSER_DESCRIPTION.to_string()), tools)
    }

    /// The builtin `python` tool (a stateful Jupyter notebook), as the official library
    /// defines it.
    pub fn python() -> Self {
        ToolNamespace::new("python", Some(PYTHON_DESCRIPTION.to_string()), Vec::new())
    }
}

/// The content of the system message.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SystemContent {
    /// First line: who the model is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_identity: Option<String>,
    /// `Reasoning: ...`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Builtin tool namespaces (`browser`, `python`), rendered sorted by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<BTreeMap<String, ToolNamespace>>,
    /// `Current date: ...` (ISO date).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_start_date: Option<String>,
    /// `Knowledge cutoff: ...`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knowledge_cutoff: Option<String>,
    /// `# Valid channels: ...`
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel_config: Option<ChannelConfig>,
}

/// The official defaults: ChatGPT identity, medium effort, cutoff 2024-06, channels analysis,
/// commentary and final required, no date, no tools.
impl Default for SystemContent {
    fn default() -> Self {
        SystemContent {
            model_identity: Some("You are ChatGPT, a large language model trained by OpenAI.".to_string()),
            reasoning_effort: Some(ReasoningEffort::Medium),
            tools: None,
            conversation_start_date: None,
            knowledge_cutoff: Some("2024-06".to_string()),
            channel_config: Some(ChannelConfig::require_channels(["analysis", "commentary", "final"])),
        }
    }
}

fn insert_namespace(map: &mut Option<BTreeMap<String, ToolNamespace>>, ns: ToolNamespace) {
    map.get_or_insert_with(BTreeMap::new).insert(ns.name.clone(), ns);
}

impl SystemContent {
    /// The defaults (see `Default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the model identity line.
    pub fn with_model_identity(mut self, identity: impl Into<String>) -> Self {
        self.model_identity = Some(identity.into());
        self
    }

    /// Sets the reasoning effort.
    pub fn with_reasoning_effort(mut self, effort: ReasoningEffort) -> Self {
        self.reasoning_effort = Some(effort);
        self
    }

    /// Sets the current date (`2025-06-28`).
    pub fn with_conversation_start_date(mut self, date: impl Into<String>) -> Self {
        self.conversation_start_date = Some(date.into());
        self
    }

    /// Sets the knowledge cutoff (`2024-06`).
    pub fn with_knowledge_cutoff(mut self, cutoff: impl Into<String>) -> Self {
        self.knowledge_cutoff = Some(cutoff.into());
        self
    }

    /// Sets the channel configuration.
    pub fn with_channel_config(mut self, config: ChannelConfig) -> Self {
        self.channel_config = Some(config);
        self
    }

    /// Requires one of `channels` on every message.
    pub fn with_required_channels<I: IntoIterator<Item = T>, T: Into<String>>(self, channels: I) -> Self {
        self.with_channel_config(ChannelConfig::require_channels(channels))
    }

    /// Adds (or replaces) a tool namespace.
    pub fn with_tools(mut self, ns: ToolNamespace) -> Self {
        insert_namespace(&mut self.tools, ns);
        self
    }

    /// Adds the builtin browser tool.
    pub fn with_browser_tool(self) -> Self {
        self.with_tools(ToolNamespace::browser())
    }

    /// Adds the builtin python tool.
    pub fn with_python_tool(self) -> Self {
        self.with_tools(ToolNamespace::python())
    }
}

/// The content of the developer message: instructions and function tools.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct DeveloperContent {
    /// Rendered under `# Instructions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Tool namespaces, rendered sorted by name; function tools live in `functions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<BTreeMap<String, ToolNamespace>>,
}

impl DeveloperContent {
    /// No instructions, no tools.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the instructions.
    pub fn with_instructions(mut self, instructions: impl Into<String>) -> Self {
        self.instructions = Some(instructions.into());
        self
    }

    /// Adds (or replaces) a tool namespace.
    pub fn with_tools(mut self, ns: ToolNamespace) -> Self {
        insert_namespace(&mut self.tools, ns);
        self
    }

    /// Sets the `functions` namespace: tools the model calls with `to=functions.NAME`.
    pub fn with_function_tools(self, tools: Vec<ToolDescription>) -> Self {
        self.with_tools(ToolNamespace::new("functions", None, tools))
    }

    /// Whether a non-empty `functions` namespace is declared.
    pub fn has_function_tools(&self) -> bool {
        self.tools.as_ref().and_then(|t| t.get("functions")).is_some_and(|ns| !ns.tools.is_empty())
    }
}

/// One piece of a message's content.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Content {
    /// Text, encoded as ordinary text.
    Text {
        /// The text.
        text: String,
    },
    /// The structured system message content (only in system messages).
    #[serde(rename = "system_content")]
    System(SystemContent),
    /// The structured developer message content (only in developer messages).
    #[serde(rename = "developer_content")]
    Developer(DeveloperContent),
}

impl<T: Into<String>> From<T> for Content {
    fn from(text: T) -> Self {
        Content::Text { text: text.into() }
    }
}

impl From<SystemContent> for Content {
    fn from(c: SystemContent) -> Self {
        Content::System(c)
    }
}

impl From<DeveloperContent> for Content {
    fn from(c: DeveloperContent) -> Self {
        Content::Developer(c)
    }
}

/// One message: a header (role or tool name, recipient, channel, content type) and contents.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// The author's name: for `Role::Tool` the tool (`functions.get_weather`, required);
    /// for other roles an optional name rendered as `role:name`.
    #[serde(default)]
    pub name: Option<String>,
    /// Whom it is addressed to: a tool (`functions.get_weather`) for an assistant tool call,
    /// `assistant` for a tool result. `all` or `None` is not rendered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipient: Option<String>,
    /// The channel (`analysis`, `commentary`, `final`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<String>,
    /// The content type (`<|constrain|>json`, `json`, `code`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// The contents, rendered one after another.
    #[serde(deserialize_with = "string_or_contents")]
    pub content: Vec<Content>,
}

impl Message {
    /// A message from `role` with one content.
    pub fn new(role: Role, content: impl Into<Content>) -> Self {
        Message {
            role,
            name: None,
            recipient: None,
            channel: None,
            content_type: None,
            content: vec![content.into()],
        }
    }

    /// A system message.
    pub fn system(content: SystemContent) -> Self {
        Self::new(Role::System, content)
    }

    /// A developer message.
    pub fn developer(content: DeveloperContent) -> Self {
        Self::new(Role::Developer, content)
    }

    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::new(Role::User, text.into())
    }

    /// An assistant message on `channel`.
    pub fn assistant(channel: impl Into<String>, text: impl Into<String>) -> Self {
        Self::new(Role::Assistant, text.into()).with_channel(channel)
    }

    /// An assistant call of tool `recipient` (`functions.get_weather`) with JSON arguments, as
    /// the model writes it: commentary channel, content type `<|constrain|>json`.
    pub fn tool_call(recipient: impl Into<String>, arguments: impl Into<String>) -> Self {
        Self::new(Role::Assistant, arguments.into())
            .with_channel("commentary")
            .with_recipient(recipient)
            .with_content_type("<|constrain|>json")
    }

    /// The reply of tool `name` (`functions.get_weather`) to the assistant, on commentary.
    pub fn tool_result(name: impl Into<String>, text: impl Into<String>) -> Self {
        Self::new(Role::Tool, text.into())
            .with_name(name)
            .with_recipient("assistant")
            .with_channel("commentary")
    }

    /// Sets the author name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Sets the channel.
    pub fn with_channel(mut self, channel: impl Into<String>) -> Self {
        self.channel = Some(channel.into());
        self
    }

    /// Sets the recipient.
    pub fn with_recipient(mut self, recipient: impl Into<String>) -> Self {
        self.recipient = Some(recipient.into());
        self
    }

    /// Sets the content type.
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Appends a content.
    pub fn adding_content(mut self, content: impl Into<Content>) -> Self {
        self.content.push(content.into());
        self
    }

    /// The text contents concatenated (structured contents are skipped).
    pub fn text(&self) -> String {
        self.content
            .iter()
            .filter_map(|c| match c {
                Content::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// `content` is either a plain string or a list of contents.
fn string_or_contents<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<Content>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<Content>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string or a list of contents")
        }

        fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Vec<Content>, E> {
            Ok(vec![Content::from(v)])
        }

        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> std::result::Result<Vec<Content>, A::Error> {
            Deserialize::deserialize(de::value::SeqAccessDeserializer::new(seq))
        }
    }
    d.deserialize_any(V)
}

/// A list of messages.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct Conversation {
    /// The messages, oldest first.
    pub messages: Vec<Message>,
}

impl Conversation {
    /// A conversation of `messages`.
    pub fn from_messages(messages: impl IntoIterator<Item = Message>) -> Self {
        Conversation { messages: messages.into_iter().collect() }
    }

    /// Parses the official JSON form (`{"messages": [...]}`).
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| Error::invalid(format!("invalid conversation JSON: {e}")))
    }

    /// Whether a developer message declares function tools (which adds a line to the system
    /// message).
    pub fn has_function_tools(&self) -> bool {
        self.messages.iter().flat_map(|m| &m.content).any(|c| match c {
            Content::Developer(d) => d.has_function_tools(),
            _ => false,
        })
    }
}

impl<'a> IntoIterator for &'a Conversation {
    type Item = &'a Message;
    type IntoIter = std::slice::Iter<'a, Message>;

    fn into_iter(self) -> Self::IntoIter {
        self.messages.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn official_json_round_trips() {
        let json = r#"{"messages": [
            {"role": "system", "name": null, "content": [{"type": "system_content",
              "reasoning_effort": "High", "channel_config": {"valid_channels": ["final"], "channel_required": true}}]},
            {"role": "tool", "name": "functions.f", "content": "42", "channel": "commentary", "recipient": "assistant"}
        ]}"#;
        let c = Conversation::from_json(json).unwrap();
        let Content::System(sys) = &c.messages[0].content[0] else { panic!("not system content") };
        assert_eq!(sys.reasoning_effort, Some(ReasoningEffort::High));
        assert_eq!(sys.model_identity, None, "absent fields are None, not the defaults");
        assert_eq!(c.messages[1], Message::tool_result("functions.f", "42"));
        let again = Conversation::from_json(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
        assert!(Conversation::from_json(r#"{"messages": [{"role": "robot", "content": "x"}]}"#).is_err());
    }

    #[test]
    fn builtin_tools_parse() {
        let b = ToolNamespace::browser();
        assert!(b.tools.iter().all(|t| t.parameters.is_some()));
        let keys: Vec<&str> = b.tools[1]
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
        assert_eq!(keys, ["id", "cursor", "loc", "num_lines", "view_source", "source"]);
    }
}
