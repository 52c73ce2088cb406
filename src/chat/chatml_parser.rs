//! The parser of one ChatML assistant turn (what Qwen3 generates after
//! `<|im_start|>assistant\n`), giving the same deltas and messages as Harmony's
//! [`TurnParser`](super::TurnParser): text inside `<think>...</think>` is reasoning (the
//! `analysis` channel), a `<tool_call>` holding `{"name": NAME, "arguments": ARGS}` with a
//! declared NAME is a call of `functions.NAME`, the rest is the answer (`final`).
//!
//! Newlines the template puts around the reasoning (`<think>\n...\n</think>\n\n`) are not
//! part of it or of the answer: leading ones are dropped, trailing ones held until other
//! text follows. A tool call is announced when it closes (its name is only known then).
//! A call that is not JSON, has no string `name`, names an undeclared function, or is cut
//! off by the end of the turn is kept as answer text, tags included, so nothing the model
//! wrote is lost and nothing fails. Other control tokens in the output are dropped.

use std::sync::Arc;

use super::chatml::ChatMlTokens;
use super::hf_tokenizer::HfTokenizer;
use super::json::JsonValue;
use super::message::Message;
use super::recovery::{Delta, DeltaKind};

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Answer,
    Reasoning,
    ToolCall,
}

/// The recovering, streaming parser of one ChatML assistant turn.
#[derive(Debug)]
pub struct ChatMlParser {
    tokenizer: Arc<HfTokenizer>,
    tokens: ChatMlTokens,
    declared: Vec<String>,
    section: Section,
    /// Text of the section so far is only newlines (dropped at the start of a section).
    at_start: bool,
    /// Newlines held at the end of the reasoning or answer.
    held_newlines: usize,
    /// Text of the open `<tool_call>`.
    call_text: String,
    messages: Vec<Message>,
    /// Bytes waiting for the rest of a UTF-8 character.
    undecoded: Vec<u8>,
}

impl ChatMlParser {
    /// A parser for a turn whose callable functions are `declared` (bare names).
    pub fn new(tokenizer: Arc<HfTokenizer>, tokens: ChatMlTokens, declared: &[String]) -> Self {
        ChatMlParser {
            tokenizer,
            tokens,
            declared: declared.to_vec(),
            section: Section::Answer,
            at_start: true,
            held_newlines: 0,
            call_text: String::new(),
            messages: Vec::new(),
            undecoded: Vec::new(),
        }
    }

    /// Consumes one token; returns the text it adds. Never fails.
    pub fn push(&mut self, token: u32) -> Vec<Delta> {
        let t = self.tokens;
        if token == t.think {
            let out = self.close_section();
            self.section = Section::Reasoning;
            self.at_start = true;
            return out;
        }
        if token == t.think_end {
            let out = self.close_section();
            self.section = Section::Answer;
            self.at_start = true;
            return out;
        }
        if token == t.tool_call {
            let out = self.close_section();
            self.section = Section::ToolCall;
            self.call_text.clear();
            return out;
        }
        if token == t.tool_call_end && self.section == Section::ToolCall {
            // Inside a call the bytes go to its text: no delta.
            self.flush_bytes();
            let out = self.end_call(true);
            self.section = Section::Answer;
            self.at_start = true;
            return out;
        }
        if self.tokenizer.is_special(token) || self.tokenizer.check(token).is_err() {
            return Vec::new();
        }
        let bytes = self.tokenizer.token_bytes(token).unwrap_or_default();
        self.undecoded.extend_from_slice(bytes);
        let text = take_valid_utf8(&mut self.undecoded);
        self.add_text(&text)
    }

    /// Ends the turn: completes what is open; returns the text that adds.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = self.flush_bytes();
        if self.section == Section::ToolCall {
            out.extend(self.end_call(false));
            self.section = Section::Answer;
            return out;
        }
        // Held trailing newlines are not part of the text.
        self.held_newlines = 0;
        out
    }

    /// The messages so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The messages, consuming the parser.
    pub fn into_messages(self) -> Vec<Message> {
        self.messages
    }

    /// Ends an unfinished character (as U+FFFD); returns the text that adds.
    fn flush_bytes(&mut self) -> Vec<Delta> {
        if self.undecoded.is_empty() {
            return Vec::new();
        }
        let text = String::from_utf8_lossy(&std::mem::take(&mut self.undecoded)).into_owned();
        self.add_text(&text)
    }

    /// Leaves the reasoning or answer: held newlines are dropped.
    fn close_section(&mut self) -> Vec<Delta> {
        self.held_newlines = 0;
        Vec::new()
    }

    fn add_text(&mut self, text: &str) -> Vec<Delta> {
        if text.is_empty() {
            return Vec::new();
        }
        if self.section == Section::ToolCall {
            self.call_text.push_str(text);
            return Vec::new();
        }
        let mut text = text;
        if self.at_start {
            text = text.trim_start_matches('\n');
            if text.is_empty() {
                return Vec::new();
            }
            self.at_start = false;
        }
        let body = text.trim_end_matches('\n');
        let trailing = text.len() - body.len();
        if body.is_empty() {
            self.held_newlines += trailing;
            return Vec::new();
        }
        let mut out = "\n".repeat(self.held_newlines);
        out.push_str(body);
        self.held_newlines = trailing;
        let kind = if self.section == Section::Reasoning { DeltaKind::Reasoning } else { DeltaKind::Answer };
        self.append(kind.clone(), &out);
        vec![Delta { kind, text: out }]
    }

    /// Adds text to the last message when it is of `kind`, else opens one.
    fn append(&mut self, kind: DeltaKind, text: &str) {
        let channel = if kind == DeltaKind::Reasoning { "analysis" } else { "final" };
        if let Some(last) = self.messages.last_mut()
            && last.recipient.is_none()
            && last.channel.as_deref() == Some(channel)
        {
            let joined = last.text() + text;
            last.content = vec![joined.into()];
            return;
        }
        self.messages.push(Message::assistant(channel, text));
    }

    /// Closes the open call (`closed`: by `</tool_call>`): a call when its JSON names a
    /// declared function, else its text as answer.
    fn end_call(&mut self, closed: bool) -> Vec<Delta> {
        let raw = std::mem::take(&mut self.call_text);
        if let Some((name, arguments)) = read_call(&raw).filter(|(name, _)| self.declared.contains(name)) {
            let recipient = format!("functions.{name}");
            self.messages.push(Message::tool_call(recipient.clone(), arguments.clone()));
            return vec![
                Delta { kind: DeltaKind::ToolCall(recipient.clone()), text: String::new() },
                Delta { kind: DeltaKind::ToolCall(recipient), text: arguments },
            ];
        }
        tracing::debug!("a <tool_call> that is not a call of a declared function is kept as text");
        let mut text = format!("<tool_call>{raw}");
        if closed {
            text.push_str("</tool_call>");
        }
        self.section = Section::Answer;
        self.at_start = false;
        let text = "\n".repeat(std::mem::take(&mut self.held_newlines)) + &text;
        self.append(DeltaKind::Answer, &text);
        vec![Delta { kind: DeltaKind::Answer, text }]
    }
}

/// The name and arguments (compact JSON) of a tool call's text, if it is
/// `{"name": STRING, "arguments": VALUE}` (arguments absent: `{}`; a string: its text).
fn read_call(raw: &str) -> Option<(String, String)> {
    let v: JsonValue = raw.trim().parse().ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        None => "{}".to_string(),
        Some(JsonValue::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some((name, arguments))
}

/// Takes the longest valid UTF-8 prefix of `bytes` (invalid bytes that cannot start a
/// character become U+FFFD); leaves an incomplete character at the end.
fn take_valid_utf8(bytes: &mut Vec<u8>) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                bytes.clear();
                return out;
            }
            Err(e) => {
                let good = e.valid_up_to();
                out.push_str(std::str::from_utf8(&bytes[..good]).unwrap_or_default());
                match e.error_len() {
                    None => {
                        bytes.drain(..good);
                        return out;
                    }
                    Some(bad) => {
                        out.push('\u{FFFD}');
                        bytes.drain(..good + bad);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_read_from_json() {
        assert_eq!(
            read_call("\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n"),
            Some(("f".into(), "{\"a\":1}".into()))
        );
        assert_eq!(read_call("{\"name\": \"f\"}"), Some(("f".into(), "{}".into())));
        assert_eq!(read_call("{\"name\": 3}"), None);
        assert_eq!(read_call("{\"name\": \"f\", "), None);
    }

    #[test]
    fn utf8_is_never_split() {
        let mut b = "é".as_bytes()[..1].to_vec();
        assert_eq!(take_valid_utf8(&mut b), "");
        b.extend_from_slice(&"é".as_bytes()[1..]);
        assert_eq!(take_valid_utf8(&mut b), "é");
        let mut b = vec![0xff, b'a'];
        assert_eq!(take_valid_utf8(&mut b), "\u{FFFD}a");
    }
}
