//! Rendering conversations into Harmony token IDs, token-exact with the official
//! `openai_harmony` library (`HarmonyGptOss` encoding, version 0.0.8).
//!
//! A message is `<|start|>{header}<|message|>{content}<|end|>`, where the header is the role
//! (or the tool's name), ` to={recipient}`, `<|channel|>{channel}` and ` {content_type}`; an
//! assistant message with a recipient (a tool call) ends with `<|call|>` instead. Every piece
//! of text is tokenized on its own, so the token boundaries match the official renderer.

use super::message::{Content, Conversation, DeveloperContent, Message, Role, SystemContent};
use super::parser::{ParseOptions, StreamParser};
use super::schema::tools_section;
use super::tokenizer::{Tokenizer, special};
use crate::error::{Error, Result};

/// Tokens that end generation: `<|return|>` (done) and `<|call|>` (a tool call to run).
/// `<|end|>` is not one of them: it closes one message (the analysis, say) and the final
/// answer follows.
pub const STOP_TOKENS: [u32; 2] = [special::RETURN, special::CALL];

/// Tokens that end a message: the stop tokens and `<|end|>` (the official `stop_tokens()`).
pub const MESSAGE_END_TOKENS: [u32; 3] = [special::RETURN, special::END, special::CALL];

const CONSTRAIN_MARKER: &str = "<|constrain|>";

/// Options of conversation rendering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderConfig {
    /// Drop chain-of-thought that the model has already turned into an answer: when the last
    /// assistant message is on the `final` channel, every `analysis` message before the first
    /// `final` message of the conversation is left out. Default true, as upstream.
    pub auto_drop_analysis: bool,
}

impl Default for RenderConfig {
    fn default() -> Self {
        RenderConfig { auto_drop_analysis: true }
    }
}

/// Options of single-message rendering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RenderOptions {
    /// The conversation declares function tools: the system message then says that calls to
    /// them go to the commentary channel.
    pub conversation_has_function_tools: bool,
}

/// The Harmony format over the o200k_harmony tokenizer. Cheap to copy.
#[derive(Debug, Clone, Copy, Default)]
pub struct HarmonyEncoding {
    tokenizer: Tokenizer,
}

impl HarmonyEncoding {
    /// The GPT-OSS Harmony encoding.
    pub fn new() -> Self {
        HarmonyEncoding { tokenizer: Tokenizer::new() }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Tokens that end generation, `<|return|>` and `<|call|>` (see `STOP_TOKENS`).
    pub fn stop_tokens(&self) -> &'static [u32] {
        &STOP_TOKENS
    }

    /// The prompt for the model's next turn: the conversation, then `<|start|>{next_role}`
    /// (`<|start|>assistant` for a reply).
    pub fn render_conversation_for_completion(
        &self,
        conversation: &Conversation,
        next_role: Role,
        config: &RenderConfig,
    ) -> Result<Vec<u32>> {
        let mut out = self.render_conversation(conversation, config)?;
        out.push(special::START);
        out.extend(self.tokenizer.encode(next_role.as_str()));
        Ok(out)
    }

    /// The conversation's messages, in order, with analysis dropped per `config`.
    pub fn render_conversation(
        &self,
        conversation: &Conversation,
        config: &RenderConfig,
    ) -> Result<Vec<u32>> {
        let messages = &conversation.messages;
        let opts = RenderOptions { conversation_has_function_tools: conversation.has_function_tools() };
        let last_assistant_is_final = messages
            .iter()
            .rev()
            .find(|m| m.role == Role::Assistant)
            .is_some_and(|m| m.channel.as_deref() == Some("final"));
        let drop_analysis = config.auto_drop_analysis && last_assistant_is_final;
        let first_final = messages.iter().position(|m| m.channel.as_deref() == Some("final"));
        let mut out = Vec::new();
        for (i, msg) in messages.iter().enumerate() {
            let dropped = drop_analysis
                && first_final.is_some_and(|f| i < f)
                && msg.channel.as_deref() == Some("analysis");
            if !dropped {
                self.render_message_into(msg, &opts, &mut out)?;
            }
        }
        Ok(out)
    }

    /// The conversation as a training target: as `render_conversation`, but when the last
    /// message is an assistant `final`, its closing `<|end|>` becomes `<|return|>`.
    pub fn render_conversation_for_training(
        &self,
        conversation: &Conversation,
        config: &RenderConfig,
    ) -> Result<Vec<u32>> {
        let mut out = self.render_conversation(conversation, config)?;
        if let Some(last) = conversation.messages.last()
            && last.role == Role::Assistant
            && last.channel.as_deref() == Some("final")
            && let Some(t) = out.last_mut()
        {
            *t = special::RETURN;
        }
        Ok(out)
    }

    /// One message.
    pub fn render_message(&self, message: &Message, opts: &RenderOptions) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        self.render_message_into(message, opts, &mut out)?;
        Ok(out)
    }

    fn text(&self, text: &str, out: &mut Vec<u32>) {
        out.extend(self.tokenizer.encode(text));
    }

    fn render_message_into(&self, msg: &Message, opts: &RenderOptions, out: &mut Vec<u32>) -> Result<()> {
        out.push(special::START);
        if msg.role == Role::Tool {
            let name = msg.name.as_deref().ok_or_else(|| Error::invalid("Tools should have a name!"))?;
            self.text(name, out);
        } else {
            self.text(msg.role.as_str(), out);
            if let Some(name) = &msg.name {
                self.text(&format!(":{name}"), out);
            }
        }
        if let Some(recipient) = &msg.recipient
            && recipient != "all"
        {
            self.text(&format!(" to={recipient}"), out);
        }
        if let Some(channel) = &msg.channel {
            out.push(special::CHANNEL);
            self.text(channel, out);
        }
        if let Some(content_type) = &msg.content_type {
            match content_type.strip_prefix(CONSTRAIN_MARKER) {
                Some(rest) => {
                    self.text(" ", out);
                    out.push(special::CONSTRAIN);
                    if !rest.is_empty() {
                        self.text(rest, out);
                    }
                }
                None => self.text(&format!(" {content_type}"), out),
            }
        }
        out.push(special::MESSAGE);
        for content in &msg.content {
            match content {
                Content::Text { text } => self.text(text, out),
                Content::System(sys) => {
                    if msg.role != Role::System {
                        return Err(Error::invalid(format!(
                            "SystemContent may only appear in system messages, found in {}",
                            msg.role
                        )));
                    }
                    self.text(&system_text(sys, opts), out);
                }
                Content::Developer(dev) => {
                    if msg.role != Role::Developer {
                        return Err(Error::invalid(format!(
                            "DeveloperContent may only appear in developer messages, found in {}",
                            msg.role
                        )));
                    }
                    self.text(&developer_text(dev), out);
                }
            }
        }
        out.push(if msg.role == Role::Assistant && msg.recipient.is_some() {
            special::CALL
        } else {
            special::END
        });
        Ok(())
    }

    /// Parses a completion (the tokens after `<|start|>assistant`, pass `Some(Role::Assistant)`;
    /// or whole messages from `<|start|>`, pass `None`) into messages. Strict, as upstream.
    pub fn parse_messages_from_completion_tokens(
        &self,
        tokens: &[u32],
        role: Option<Role>,
    ) -> Result<Vec<Message>> {
        self.parse_messages_with_options(tokens, role, ParseOptions::default())
    }

    /// As `parse_messages_from_completion_tokens`, with options.
    pub fn parse_messages_with_options(
        &self,
        tokens: &[u32],
        role: Option<Role>,
        options: ParseOptions,
    ) -> Result<Vec<Message>> {
        let mut parser = StreamParser::with_options(*self, role, options);
        for &t in tokens {
            parser.push(t)?;
        }
        parser.finish()?;
        Ok(parser.into_messages())
    }

    /// An incremental parser for the model's output.
    pub fn stream_parser(&self, role: Option<Role>) -> StreamParser {
        StreamParser::new(*self, role)
    }
}

/// The text of a system message.
fn system_text(sys: &SystemContent, opts: &RenderOptions) -> String {
    let mut sections = Vec::new();
    let mut top = Vec::new();
    if let Some(id) = &sys.model_identity {
        top.push(id.clone());
    }
    if let Some(cutoff) = &sys.knowledge_cutoff {
        top.push(format!("Knowledge cutoff: {cutoff}"));
    }
    if let Some(date) = &sys.conversation_start_date {
        top.push(format!("Current date: {date}"));
    }
    if !top.is_empty() {
        sections.push(top.join("\n"));
    }
    if let Some(effort) = sys.reasoning_effort {
        sections.push(format!("Reasoning: {}", effort.as_str()));
    }
    if let Some(tools) = &sys.tools
        && !tools.is_empty()
    {
        sections.push(tools_section(tools));
    }
    if let Some(cc) = &sys.channel_config
        && !cc.valid_channels.is_empty()
    {
        let mut header = format!("# Valid channels: {}.", cc.valid_channels.join(", "));
        if cc.channel_required {
            header.push_str(" Channel must be included for every message.");
        }
        if opts.conversation_has_function_tools {
            header.push_str("\nCalls to these tools must go to the commentary channel: 'functions'.");
        }
        sections.push(header);
    }
    sections.join("\n\n")
}

/// The text of a developer message.
fn developer_text(dev: &DeveloperContent) -> String {
    let mut sections = Vec::new();
    if let Some(instructions) = &dev.instructions {
        sections.push("# Instructions".to_string());
        sections.push(instructions.clone());
    }
    if let Some(tools) = &dev.tools
        && !tools.is_empty()
    {
        sections.push(tools_section(tools));
    }
    sections.join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_without_name_and_misplaced_contents_are_errors() {
        let h = HarmonyEncoding::new();
        let opts = RenderOptions::default();
        assert!(h.render_message(&Message::new(Role::Tool, "x"), &opts).is_err());
        assert!(h.render_message(&Message::new(Role::User, SystemContent::new()), &opts).is_err());
        assert!(h.render_message(&Message::new(Role::System, DeveloperContent::new()), &opts).is_err());
    }

    #[test]
    fn tool_call_shape() {
        let h = HarmonyEncoding::new();
        let call = Message::tool_call("functions.get_weather", r#"{"city":"Rome"}"#);
        let ids = h.render_message(&call, &RenderOptions::default()).unwrap();
        assert_eq!(
            h.tokenizer().decode(&ids).unwrap(),
            "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json\
             <|message|>{\"city\":\"Rome\"}<|call|>"
        );
        let result = Message::tool_result("functions.get_weather", "sunny");
        let ids = h.render_message(&result, &RenderOptions::default()).unwrap();
        assert_eq!(
            h.tokenizer().decode(&ids).unwrap(),
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        );
    }
}
