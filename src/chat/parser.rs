//! Incremental parsing of the model's Harmony output, one token at a time: a port of the
//! official `StreamableParser` (openai/harmony 0.0.8) with the same states, header rules,
//! content deltas and errors.

use super::harmony::{HarmonyEncoding, MESSAGE_END_TOKENS};
use super::message::{Content, Message, Role};
use super::tokenizer::special;
use crate::error::{Error, Result};

const CHANNEL_MARKER: &str = "<|channel|>";
const CONSTRAIN_MARKER: &str = "<|constrain|>";

/// Options of parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseOptions {
    /// Strict (the default): a header must end with `<|message|>`. Lenient: a message-ending
    /// token inside the first header turns what was read into a message (for models that
    /// skip the header and write text at once).
    pub strict: bool,
}

impl Default for ParseOptions {
    fn default() -> Self {
        ParseOptions { strict: true }
    }
}

/// Where the parser is in the message grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParserState {
    /// Between messages: waiting for `<|start|>`.
    ExpectStart,
    /// Reading a header, up to `<|message|>`.
    Header,
    /// Reading content, up to `<|end|>`, `<|return|>` or `<|call|>`.
    Content,
}

/// A parsed message header.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    role: Role,
    name: Option<String>,
    recipient: Option<String>,
    channel: Option<String>,
    content_type: Option<String>,
}

impl Header {
    fn into_message(self, text: String) -> Message {
        Message {
            role: self.role,
            name: self.name,
            recipient: self.recipient,
            channel: self.channel,
            content_type: self.content_type,
            content: vec![Content::Text { text }],
        }
    }
}

#[derive(Debug, Clone)]
enum State {
    ExpectStart,
    Header { tokens: Vec<u32> },
    Content { header: Header, text: String },
}

/// Parses generated tokens into messages as they arrive. Feed it with `push`; read the
/// current channel, recipient and the latest text delta to stream an answer; call `finish`
/// at the end of generation (a stop token alone already completes the message).
#[derive(Debug, Clone)]
pub struct StreamParser {
    encoding: HarmonyEncoding,
    options: ParseOptions,
    next_role: Option<Role>,
    state: State,
    tokens: Vec<u32>,
    messages: Vec<Message>,
    last_delta: Option<String>,
    /// Content bytes waiting for the rest of a UTF-8 character.
    undecoded: Vec<u8>,
}

impl StreamParser {
    /// A parser. With `role` (normally `Some(Role::Assistant)`, the prompt having ended with
    /// `<|start|>assistant`) it starts inside that message's header; with `None` it expects
    /// `<|start|>` first.
    pub fn new(encoding: HarmonyEncoding, role: Option<Role>) -> Self {
        Self::with_options(encoding, role, ParseOptions::default())
    }

    /// A parser with options.
    pub fn with_options(encoding: HarmonyEncoding, role: Option<Role>, options: ParseOptions) -> Self {
        let state = if role.is_some() { State::Header { tokens: Vec::new() } } else { State::ExpectStart };
        StreamParser {
            encoding,
            options,
            next_role: role,
            state,
            tokens: Vec::new(),
            messages: Vec::new(),
            last_delta: None,
            undecoded: Vec::new(),
        }
    }

    /// Consumes one token. Errors: an out-of-range ID (nothing changes), a token other than
    /// `<|start|>` between messages, a header that cannot be parsed. After an error other than
    /// the first, the parser's state is unspecified.
    pub fn push(&mut self, token: u32) -> Result<()> {
        self.encoding.tokenizer().check(token)?;
        self.tokens.push(token);
        match &mut self.state {
            State::ExpectStart => {
                if token != special::START {
                    return Err(Error::invalid(format!(
                        "Unexpected token {token} while expecting start token {}",
                        special::START
                    )));
                }
                self.state = State::Header { tokens: Vec::new() };
            }
            State::Header { tokens } if token == special::MESSAGE => {
                let tokens = std::mem::take(tokens);
                self.state = State::ExpectStart;
                let header = self.parse_header_tokens(&tokens, self.next_role)?;
                self.next_role = None;
                self.state = State::Content { header, text: String::new() };
            }
            State::Header { tokens } if !self.options.strict && MESSAGE_END_TOKENS.contains(&token) => {
                let tokens = std::mem::take(tokens);
                if let Some(role) = self.next_role
                    && !tokens.is_empty()
                {
                    let decoded = self.encoding.tokenizer().decode_utf8(&tokens)?;
                    let (header, rest) = parse_header(decoded, Some(role), false)?;
                    self.messages.push(header.into_message(rest.unwrap_or_default()));
                }
                self.state = State::ExpectStart;
                self.next_role = None;
            }
            State::Header { tokens } => tokens.push(token),
            State::Content { .. } if MESSAGE_END_TOKENS.contains(&token) => self.end_message(),
            State::Content { text, .. } => {
                let bytes = self.encoding.tokenizer().token_bytes(token)?;
                self.undecoded.extend_from_slice(&bytes);
                self.last_delta = take_valid_utf8(&mut self.undecoded);
                if let Some(delta) = &self.last_delta {
                    text.push_str(delta);
                }
            }
        }
        Ok(())
    }

    /// Ends the input (end of generation): completes a message in progress. An error while a
    /// header is unfinished.
    pub fn finish(&mut self) -> Result<()> {
        match self.state {
            State::ExpectStart => Ok(()),
            State::Header { .. } => {
                Err(Error::invalid("Unexpected EOS while waiting for message header to complete"))
            }
            State::Content { .. } => {
                self.end_message();
                Ok(())
            }
        }
    }

    fn end_message(&mut self) {
        if let State::Content { header, mut text } = std::mem::replace(&mut self.state, State::ExpectStart) {
            text.push_str(&String::from_utf8_lossy(&self.undecoded));
            self.messages.push(header.into_message(text));
        }
        self.last_delta = None;
        self.undecoded.clear();
    }

    fn parse_header_tokens(&self, tokens: &[u32], role: Option<Role>) -> Result<Header> {
        let text = self
            .encoding
            .tokenizer()
            .decode_utf8(tokens)
            .map_err(|e| Error::invalid(format!("could not decode header: {e}")))?;
        let (header, rest) = parse_header(text, role, true)?;
        if let Some(rest) = rest {
            return Err(Error::invalid(format!(
                "unexpected tokens remaining in message header: Some({rest:?})"
            )));
        }
        Ok(header)
    }

    /// Where the parser is.
    pub fn state(&self) -> ParserState {
        match self.state {
            State::ExpectStart => ParserState::ExpectStart,
            State::Header { .. } => ParserState::Header,
            State::Content { .. } => ParserState::Content,
        }
    }

    fn header(&self) -> Option<&Header> {
        match &self.state {
            State::Content { header, .. } => Some(header),
            _ => None,
        }
    }

    /// The role of the message being read (known once its header is parsed, or given).
    pub fn current_role(&self) -> Option<Role> {
        self.header().map(|h| h.role).or(self.next_role)
    }

    /// The channel of the message whose content is being read.
    pub fn current_channel(&self) -> Option<&str> {
        self.header().and_then(|h| h.channel.as_deref())
    }

    /// The recipient of the message whose content is being read (a tool call's target).
    pub fn current_recipient(&self) -> Option<&str> {
        self.header().and_then(|h| h.recipient.as_deref())
    }

    /// The content type of the message whose content is being read.
    pub fn current_content_type(&self) -> Option<&str> {
        self.header().and_then(|h| h.content_type.as_deref())
    }

    /// The content read so far of the current message (complete characters only).
    pub fn current_content(&self) -> &str {
        match &self.state {
            State::Content { text, .. } => text,
            _ => "",
        }
    }

    /// The text the last token added to the current content, if any: never half a character.
    pub fn last_content_delta(&self) -> Option<&str> {
        self.last_delta.as_deref()
    }

    /// The completed messages.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The completed messages, consuming the parser.
    pub fn into_messages(self) -> Vec<Message> {
        self.messages
    }

    /// Every token pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// Takes from the front of `bytes` what decodes now, as upstream does per token: valid UTF-8
/// up to the first problem, then one U+FFFD for one invalid sequence (the bytes after it wait
/// for the next token), or nothing more for an incomplete character at the end.
fn take_valid_utf8(bytes: &mut Vec<u8>) -> Option<String> {
    match std::str::from_utf8(bytes) {
        Ok(s) => {
            let s = s.to_string();
            bytes.clear();
            Some(s)
        }
        Err(e) => {
            let valid = e.valid_up_to();
            let mut delta = std::str::from_utf8(&bytes[..valid]).unwrap_or_default().to_string();
            bytes.drain(..valid);
            if let Some(bad) = e.error_len() {
                delta.push('\u{FFFD}');
                bytes.drain(..bad);
            }
            (!delta.is_empty()).then_some(delta)
        }
    }
}

/// Parses a header's text (`assistant to=functions.f<|channel|>commentary <|constrain|>json`)
/// with the official rules. With `parse_recipient_and_type` false, everything left after the
/// role and channel is returned as content. Returns the header and any text left over.
fn parse_header(
    mut text: String,
    role: Option<Role>,
    parse_recipient_and_type: bool,
) -> Result<(Header, Option<String>)> {
    let mut channel = None;
    if let Some(idx) = text.find(CHANNEL_MARKER) {
        let after = &text[idx + CHANNEL_MARKER.len()..];
        let end = after.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(after.len());
        let value = &after[..end];
        if value.is_empty() {
            return Err(Error::invalid("channel marker present but no channel value found in header"));
        }
        channel = Some(value.to_string());
        text = format!("{}{}", &text[..idx], &after[end..]);
    }
    let mut text = text.trim().to_string();
    if text.contains(CONSTRAIN_MARKER) {
        text = text.replace(CONSTRAIN_MARKER, &format!(" {CONSTRAIN_MARKER}")).trim().to_string();
    }
    let mut parts: Vec<&str> = text.split_ascii_whitespace().collect();

    let mut role_str = None;
    let role = match role {
        Some(r) => r,
        None => {
            let first =
                *parts.first().ok_or_else(|| Error::invalid("message header did not contain a role"))?;
            role_str = Some(first.to_string());
            match first.parse::<Role>() {
                Ok(r) => r,
                // An unknown author followed by more (or a recipient) is a tool's name.
                Err(_) if parts.len() > 1 || first.starts_with("to=") => {
                    parts.remove(0);
                    Role::Tool
                }
                Err(_) => return Err(Error::invalid(format!("Unknown role: {first}"))),
            }
        }
    };
    if parts.first() == Some(&role.as_str()) {
        parts.remove(0);
    }

    let mut recipient = None;
    let mut content_type = None;
    if parse_recipient_and_type && let Some(last) = parts.pop() {
        let n = parts.len() + 1;
        if let Some(r) = last.strip_prefix("to=") {
            recipient = Some(r.to_string());
        } else if n == 1 {
            recipient = Some(last.to_string());
        } else {
            content_type = Some(last.to_string());
            if let Some(raw) = parts.pop() {
                recipient = Some(raw.strip_prefix("to=").unwrap_or(raw).to_string());
            }
        }
    }
    let rest = (!parts.is_empty()).then(|| parts.join(" "));
    let name = if role == Role::Tool { role_str } else { None };
    Ok((Header { role, name, recipient, channel, content_type }, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(text: &str, role: Option<Role>) -> Header {
        parse_header(text.to_string(), role, true).unwrap().0
    }

    #[test]
    fn header_shapes() {
        let h = header("<|channel|>commentary to=functions.f <|constrain|>json", Some(Role::Assistant));
        assert_eq!(h.channel.as_deref(), Some("commentary"));
        assert_eq!(h.recipient.as_deref(), Some("functions.f"));
        assert_eq!(h.content_type.as_deref(), Some("<|constrain|>json"));
        let h = header("functions.f to=assistant<|channel|>commentary", None);
        assert_eq!(
            (h.role, h.name.as_deref(), h.recipient.as_deref()),
            (Role::Tool, Some("functions.f"), Some("assistant"))
        );
        let h = header("assistant to=python<|channel|>analysis code", None);
        assert_eq!((h.recipient.as_deref(), h.content_type.as_deref()), (Some("python"), Some("code")));
        assert!(parse_header("robot".into(), None, true).is_err());
        assert!(parse_header("".into(), None, true).is_err());
        assert!(parse_header("<|channel|> x".into(), Some(Role::User), true).is_err());
    }

    #[test]
    fn utf8_deltas() {
        let mut b = "é".as_bytes()[..1].to_vec();
        assert_eq!(take_valid_utf8(&mut b), None);
        b.push("é".as_bytes()[1]);
        assert_eq!(take_valid_utf8(&mut b).as_deref(), Some("é"));
        let mut b = b"a\xffb\xfec".to_vec();
        assert_eq!(take_valid_utf8(&mut b).as_deref(), Some("a\u{FFFD}"));
        assert_eq!(b, b"b\xfec");
    }
}
