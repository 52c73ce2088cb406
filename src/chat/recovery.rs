//! The parser every front-end uses for what the model generates in one assistant turn:
//! streaming (one token at a time, each text delta returned as it is known) and recovering
//! what the model meant when its Harmony is malformed, so it never fails.
//!
//! The strict [`StreamParser`](super::StreamParser) mirrors the official library, which
//! raises an error on the first malformed header; real gpt-oss output has such headers in a
//! few percent of turns at temperature 1 (llama.cpp #27720, openai/harmony #38 and #60,
//! vLLM #23567, #43408, #52055). The rules here, each covered by a file of
//! `fixtures/harmony/malformed/`:
//!
//! - **Headers are read leniently**: the role word, `to=RECIPIENT`, `<|channel|>CHANNEL` and
//!   `<|constrain|>TYPE` in any order; anything else in a header closed by `<|message|>` is
//!   ignored. A channel is recognised by its name after stray punctuation (`commentary?`,
//!   `––commentary`, `analysis2` are commentary, commentary and analysis); a header with no
//!   recognisable channel (`??`, garbage, none at all) is the `final` channel.
//! - **A header abandoned by `<|end|>`** is dropped when it has a channel marker (the model
//!   starts the message over after it: `<|channel|>commentary?<|end|><|start|>assistant
//!   <|channel|>final<|message|>...`); without one, its text is final text. A `<|start|>`
//!   inside a header drops the header and starts a new one.
//! - **Missing structure is supplied**: text with no header (`Hello world!<|return|>`) is
//!   final text; a header with no `<|message|>` that the turn ends in, or that runs past
//!   [`MAX_HEADER_TOKENS`], ends at its first word that is not a header item and the rest
//!   is content; a message or header without its `<|start|>` (after `<|end|>`, or a
//!   `<|channel|>` or `<|start|>` inside content, which also ends the message that was
//!   missing its `<|end|>`) is read as if it were there. Stray special tokens in content
//!   (`<|message|>`, `<|constrain|>`, reserved ones) are dropped.
//! - **Only declared functions are called**: a message is a tool call only when its header
//!   says `to=functions.NAME` and NAME is one of the turn's declared functions (none with
//!   `tool_choice: "none"`, none in `chat` and `generate -p`). Any other recipient
//!   (an undeclared function, a builtin tool nobody offered, `to=assistant`) is dropped
//!   and the message's text stays on its channel: commentary (shown as content over HTTP),
//!   analysis (reasoning), or final.
//! - **Messages by other authors are dropped**: a header that starts with `user`, `system`,
//!   `developer` or a tool's name is the model writing someone else's turn.
//!
//! Streaming and one-shot parsing are the same code ([`parse_turn`] feeds the tokens one by
//! one), so the deltas always add up to the messages.

use super::harmony::HarmonyEncoding;
use super::message::{Message, Role};
use super::tokenizer::special;

/// Longest message header (`assistant to=functions.NAME<|channel|>commentary <|constrain|>json`
/// is about 15 tokens) read before the header is taken to be text with a missing `<|message|>`.
pub const MAX_HEADER_TOKENS: usize = 48;

/// The three assistant channels of gpt-oss.
const CHANNELS: [&str; 3] = ["analysis", "commentary", "final"];

/// The namespace of function tools in Harmony recipients.
const FUNCTIONS_PREFIX: &str = "functions.";

const CHANNEL_MARKER: &str = "<|channel|>";
const CONSTRAIN_MARKER: &str = "<|constrain|>";

/// What kind of text a delta adds to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeltaKind {
    /// Reasoning (the `analysis` channel).
    Reasoning,
    /// The answer (the `final` channel, or text with no usable header).
    Answer,
    /// Commentary without a declared recipient (a preamble, or an undeclared call's text).
    Commentary,
    /// Arguments of a call of a declared function (`functions.get_weather`).
    ToolCall(String),
}

/// Text the last token added to the turn. The first delta of every tool call has empty
/// text, so a call with no arguments is still seen and two calls of one function are told
/// apart; other deltas are never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    /// Where the text goes.
    pub kind: DeltaKind,
    /// The new text (complete characters only).
    pub text: String,
}

/// An opened message header.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    /// `analysis`, `commentary` or `final`.
    channel: &'static str,
    /// A declared function (`functions.NAME`), or none.
    recipient: Option<String>,
    content_type: Option<String>,
    /// Another author's message, to be dropped.
    foreign: bool,
}

impl Header {
    fn kind(&self) -> DeltaKind {
        match (&self.recipient, self.channel) {
            (Some(r), _) => DeltaKind::ToolCall(r.clone()),
            (None, "analysis") => DeltaKind::Reasoning,
            (None, "commentary") => DeltaKind::Commentary,
            (None, _) => DeltaKind::Answer,
        }
    }
}

#[derive(Debug, Clone)]
enum State {
    /// Between messages.
    Between,
    /// Reading a header (`explicit`: opened by `<|start|>`, so it may begin with a role).
    Header { tokens: Vec<u32>, explicit: bool },
    /// Reading content.
    Content { header: Header, text: String },
}

/// The recovering parser of one assistant turn. Start it right after the prompt's
/// `<|start|>assistant`; [`push`](Self::push) every generated token (the stop token too)
/// and call [`finish`](Self::finish) at the end.
#[derive(Debug, Clone)]
pub struct TurnParser {
    encoding: HarmonyEncoding,
    declared: Vec<String>,
    state: State,
    messages: Vec<Message>,
    /// Content bytes waiting for the rest of a UTF-8 character.
    undecoded: Vec<u8>,
}

impl TurnParser {
    /// A parser for a turn whose callable functions are `declared` (bare names, such as
    /// `get_weather`; empty when the model may call nothing).
    pub fn new(encoding: HarmonyEncoding, declared: &[String]) -> Self {
        TurnParser {
            encoding,
            declared: declared.to_vec(),
            state: State::Header { tokens: Vec::new(), explicit: false },
            messages: Vec::new(),
            undecoded: Vec::new(),
        }
    }

    /// Consumes one token; returns the text it adds (usually one delta or none; a call
    /// whose header ends without `<|message|>` gives its opening delta and its text). Never
    /// fails: a token outside the vocabulary is ignored (the session refuses those first).
    pub fn push(&mut self, token: u32) -> Vec<Delta> {
        if self.encoding.tokenizer().check(token).is_err() {
            return Vec::new();
        }
        let ends_message =
            matches!(token, special::END | special::RETURN | special::CALL | special::ENDOFTEXT);
        match &mut self.state {
            State::Between => {
                match token {
                    special::START => self.state = State::Header { tokens: Vec::new(), explicit: true },
                    special::CHANNEL => self.state = State::Header { tokens: vec![token], explicit: false },
                    special::MESSAGE => return self.open(&[], false),
                    _ if self.encoding.tokenizer().is_special(token) => {}
                    _ => self.state = State::Header { tokens: vec![token], explicit: false },
                }
                Vec::new()
            }
            State::Header { tokens, explicit } => {
                let (tokens, explicit) = (std::mem::take(tokens), *explicit);
                match token {
                    special::MESSAGE => self.open(&tokens, explicit),
                    special::START => {
                        tracing::debug!("a message header was restarted by <|start|>; dropping it");
                        self.state = State::Header { tokens: Vec::new(), explicit: true };
                        Vec::new()
                    }
                    special::END => {
                        self.state = State::Between;
                        if tokens.contains(&special::CHANNEL) {
                            tracing::debug!("a message header was abandoned by <|end|>; dropping it");
                            Vec::new()
                        } else {
                            self.close_unopened(&tokens, explicit)
                        }
                    }
                    _ if ends_message => {
                        self.state = State::Between;
                        self.close_unopened(&tokens, explicit)
                    }
                    _ => {
                        let mut tokens = tokens;
                        tokens.push(token);
                        if tokens.len() > MAX_HEADER_TOKENS {
                            let (header, rest) = self.read_header(&tokens, explicit, false);
                            let mut deltas = self.open_content(header);
                            deltas.extend(self.add_text(&rest));
                            deltas
                        } else {
                            self.state = State::Header { tokens, explicit };
                            Vec::new()
                        }
                    }
                }
            }
            State::Content { .. } if ends_message => {
                let delta = self.end_message();
                self.state = State::Between;
                delta.into_iter().collect()
            }
            State::Content { .. } if token == special::START => {
                let delta = self.end_message();
                self.state = State::Header { tokens: Vec::new(), explicit: true };
                delta.into_iter().collect()
            }
            State::Content { .. } if token == special::CHANNEL => {
                let delta = self.end_message();
                self.state = State::Header { tokens: vec![token], explicit: false };
                delta.into_iter().collect()
            }
            State::Content { .. } if self.encoding.tokenizer().is_special(token) => Vec::new(),
            State::Content { .. } => {
                let bytes = self.encoding.tokenizer().token_bytes(token).unwrap_or_default();
                self.undecoded.extend_from_slice(&bytes);
                let text = take_valid_utf8(&mut self.undecoded);
                self.add_text(&text).into_iter().collect()
            }
        }
    }

    /// Ends the turn (after the stop token, or where generation was cut): completes the
    /// message or header in progress; returns the text that adds, if any.
    pub fn finish(&mut self) -> Vec<Delta> {
        match std::mem::replace(&mut self.state, State::Between) {
            State::Between => Vec::new(),
            State::Header { tokens, explicit } => self.close_unopened(&tokens, explicit),
            state @ State::Content { .. } => {
                self.state = state;
                let delta = self.end_message();
                self.state = State::Between;
                delta.into_iter().collect()
            }
        }
    }

    /// The completed messages (all assistant messages; tool calls have a recipient).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The completed messages, consuming the parser.
    pub fn into_messages(self) -> Vec<Message> {
        self.messages
    }

    /// Opens content after a header closed by `<|message|>`; a tool call announces itself
    /// with an empty delta.
    fn open(&mut self, tokens: &[u32], explicit: bool) -> Vec<Delta> {
        let (header, _ignored) = self.read_header(tokens, explicit, true);
        self.open_content(header)
    }

    /// Starts the content of a message with `header`; a tool call's opening delta.
    fn open_content(&mut self, header: Header) -> Vec<Delta> {
        let announce = match (&header.recipient, header.foreign) {
            (Some(r), false) => vec![Delta { kind: DeltaKind::ToolCall(r.clone()), text: String::new() }],
            _ => Vec::new(),
        };
        self.state = State::Content { header, text: String::new() };
        announce
    }

    /// A header the turn (or `<|end|>`) closed before any `<|message|>`: what follows its
    /// header items is the content of a complete message.
    fn close_unopened(&mut self, tokens: &[u32], explicit: bool) -> Vec<Delta> {
        let (header, rest) = self.read_header(tokens, explicit, false);
        if rest.trim().is_empty() {
            self.state = State::Between;
            return Vec::new();
        }
        let mut deltas = self.open_content(header);
        deltas.extend(self.add_text(&rest));
        deltas.extend(self.end_message());
        self.state = State::Between;
        deltas
    }

    /// Adds content text to the open message; its delta unless the message is dropped.
    fn add_text(&mut self, new: &str) -> Option<Delta> {
        let State::Content { header, text } = &mut self.state else { return None };
        if new.is_empty() {
            return None;
        }
        text.push_str(new);
        (!header.foreign).then(|| Delta { kind: header.kind(), text: new.to_string() })
    }

    /// Completes the open message (bytes of an unfinished character become U+FFFD).
    fn end_message(&mut self) -> Option<Delta> {
        let tail = String::from_utf8_lossy(&std::mem::take(&mut self.undecoded)).into_owned();
        let delta = self.add_text(&tail);
        if let State::Content { header, text } = std::mem::replace(&mut self.state, State::Between)
            && !header.foreign
        {
            let mut m = Message::assistant(header.channel, text);
            m.recipient = header.recipient;
            m.content_type = header.content_type;
            self.messages.push(m);
        }
        delta
    }

    /// Reads a header's tokens: the header, and the text after its last header item.
    fn read_header(&self, tokens: &[u32], explicit: bool, whole: bool) -> (Header, String) {
        let text = self.encoding.tokenizer().decode(tokens).unwrap_or_default();
        let items = scan_header(&text, explicit, whole);
        let recipient = items.recipient.filter(|r| {
            let declared =
                r.strip_prefix(FUNCTIONS_PREFIX).is_some_and(|name| self.declared.iter().any(|d| d == name));
            if !declared {
                tracing::warn!(
                    "the model addressed {r:?}, which is not a declared function; its message is kept as text"
                );
            }
            declared
        });
        let header = Header {
            channel: items.channel.unwrap_or("final"),
            recipient,
            content_type: items.content_type,
            foreign: items.foreign,
        };
        (header, text[items.rest..].to_string())
    }
}

/// Parses a whole turn at once: the messages [`TurnParser`] gives for `tokens`.
pub fn parse_turn(encoding: HarmonyEncoding, tokens: &[u32], declared: &[String]) -> Vec<Message> {
    let mut p = TurnParser::new(encoding, declared);
    for &t in tokens {
        p.push(t);
    }
    p.finish();
    p.into_messages()
}

/// The items of a header's text.
#[derive(Debug, Default, PartialEq)]
struct HeaderItems {
    channel: Option<&'static str>,
    recipient: Option<String>,
    content_type: Option<String>,
    foreign: bool,
    /// Byte offset where the header items end and other text begins.
    rest: usize,
}

/// Reads header items from the front of `text`. `explicit`: the header was opened by
/// `<|start|>`, so its first word may be the author. `whole`: the header was closed by
/// `<|message|>`, so words that are not header items are skipped (`assistantassistant`,
/// `2?`) and the items after them still count; otherwise reading stops at the first such
/// word, where the content begins.
fn scan_header(text: &str, explicit: bool, whole: bool) -> HeaderItems {
    let mut items = HeaderItems::default();
    let mut rest = None;
    let mut pos = 0;
    let mut first = true;
    loop {
        let start = pos + (text[pos..].len() - text[pos..].trim_start().len());
        let s = &text[start..];
        if s.is_empty() {
            items.rest = rest.unwrap_or(text.len());
            return items;
        }
        let consumed = if let Some(after) = s.strip_prefix(CHANNEL_MARKER) {
            let skipped = after.len() - after.trim_start_matches(is_stray).len();
            let word = word_len(&after[skipped..], is_name_char);
            let value = &after[skipped..skipped + word];
            if let Some(c) = CHANNELS.iter().find(|c| value.starts_with(*c)) {
                items.channel = Some(c);
            }
            // Stray punctuation after the value (`commentary?`) belongs to the marker.
            let tail =
                after[skipped + word..].len() - after[skipped + word..].trim_start_matches(is_stray).len();
            CHANNEL_MARKER.len() + skipped + word + tail
        } else if let Some(after) = s.strip_prefix(CONSTRAIN_MARKER) {
            let word = word_len(after, is_name_char);
            items.content_type = Some(format!("{CONSTRAIN_MARKER}{}", &after[..word]));
            CONSTRAIN_MARKER.len() + word
        } else if let Some(after) = s.strip_prefix("to=") {
            let word = word_len(after, is_recipient_char);
            items.recipient = Some(after[..word].to_string()).filter(|r| !r.is_empty());
            3 + word
        } else if first && explicit {
            let word = word_len(s, |c| !c.is_whitespace() && c != '<');
            let author = &s[..word];
            if author != Role::Assistant.as_str() {
                // `user`, `system`, `developer`, a tool's name (`functions.f`): not ours.
                items.foreign = ["user", "system", "developer"].contains(&author) || author.contains('.');
                if !items.foreign {
                    if !whole {
                        items.rest = start;
                        return items;
                    }
                    rest.get_or_insert(start);
                }
            }
            word.max(1)
        } else if whole {
            rest.get_or_insert(start);
            word_len(s, |c| !c.is_whitespace() && c != '<').max(s.chars().next().map_or(1, char::len_utf8))
        } else {
            items.rest = start;
            return items;
        };
        first = false;
        pos = start + consumed;
    }
}

fn is_name_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_' || c == '-'
}

fn is_recipient_char(c: char) -> bool {
    is_name_char(c) || c == '.' || c == ':' || c == '/'
}

/// Punctuation that is not part of a header: `?` after a channel, `––` before one.
fn is_stray(c: char) -> bool {
    !(c.is_alphanumeric() || c.is_whitespace() || c == '<')
}

/// Bytes of the leading run of `text` whose characters satisfy `keep`.
fn word_len(text: &str, keep: impl Fn(char) -> bool) -> usize {
    text.find(|c: char| !keep(c)).unwrap_or(text.len())
}

/// Takes from the front of `bytes` what decodes now: valid UTF-8 up to the first problem,
/// then one U+FFFD for one invalid sequence (the bytes after it wait for the next token),
/// or nothing more for an incomplete character at the end.
fn take_valid_utf8(bytes: &mut Vec<u8>) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => {
            let s = s.to_string();
            bytes.clear();
            s
        }
        Err(e) => {
            let valid = e.valid_up_to();
            let mut out = String::from_utf8_lossy(&bytes[..valid]).into_owned();
            bytes.drain(..valid);
            if let Some(bad) = e.error_len() {
                out.push('\u{FFFD}');
                bytes.drain(..bad);
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_items() {
        let h = scan_header("<|channel|>commentary to=functions.f <|constrain|>json", false, false);
        assert_eq!(h.channel, Some("commentary"));
        assert_eq!(h.recipient.as_deref(), Some("functions.f"));
        assert_eq!(h.content_type.as_deref(), Some("<|constrain|>json"));
        let s = "<|channel|>final Hello  world";
        let h = scan_header(s, false, false);
        assert_eq!((h.channel, &s[h.rest..]), (Some("final"), "Hello  world"));
        assert_eq!(scan_header("<|channel|>––commentary", false, false).channel, Some("commentary"));
        assert_eq!(scan_header("<|channel|>??", false, false).channel, None);
        let s = "assistant<|channel|>analysis";
        assert_eq!(scan_header(s, true, false).channel, Some("analysis"));
        assert_eq!(scan_header(s, false, false).rest, 0, "a role word only after <|start|>");
        assert!(scan_header("functions.f to=assistant<|channel|>commentary", true, false).foreign);
        assert!(scan_header("user", true, false).foreign);
        assert!(!scan_header("Hello", true, false).foreign);
        let h = scan_header("assistantassistant<|channel|>analysis 2?", true, true);
        assert_eq!((h.channel, h.rest), (Some("analysis"), 0));
        assert_eq!(scan_header("assistantassistant<|channel|>analysis", true, false).channel, None);
    }

    #[test]
    fn utf8_is_never_split() {
        let mut b = "é".as_bytes()[..1].to_vec();
        assert_eq!(take_valid_utf8(&mut b), "");
        b.push("é".as_bytes()[1]);
        assert_eq!(take_valid_utf8(&mut b), "é");
        let mut b = b"a\xffb".to_vec();
        assert_eq!(take_valid_utf8(&mut b), "a\u{FFFD}");
        assert_eq!(b, b"b");
    }
}
