//! The o200k_harmony tokenizer of GPT-OSS: the o200k_base byte-level BPE plus the Harmony
//! special tokens, 201088 IDs in all.
//!
//! The BPE ranks and the pre-tokenization pattern come from the `tiktoken-rs` crate, which
//! embeds `o200k_base.tiktoken` in the binary: nothing is read from disk or the network.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use tiktoken_rs::CoreBPE;

use crate::error::{Error, Result};

/// Number of token IDs (`0..VOCAB_SIZE`), the size of the model's embedding and unembedding.
pub const VOCAB_SIZE: usize = 201_088;

/// IDs of the Harmony special tokens that have a name.
pub mod special {
    /// `<|startoftext|>`
    pub const STARTOFTEXT: u32 = 199_998;
    /// `<|endoftext|>`
    pub const ENDOFTEXT: u32 = 199_999;
    /// `<|return|>`: the assistant is done (ends generation).
    pub const RETURN: u32 = 200_002;
    /// `<|constrain|>`: introduces a constrained content type such as `json`.
    pub const CONSTRAIN: u32 = 200_003;
    /// `<|channel|>`: introduces the channel of a message.
    pub const CHANNEL: u32 = 200_005;
    /// `<|start|>`: begins a message header.
    pub const START: u32 = 200_006;
    /// `<|end|>`: ends one message (not generation).
    pub const END: u32 = 200_007;
    /// `<|message|>`: ends a header, begins the content.
    pub const MESSAGE: u32 = 200_008;
    /// `<|call|>`: ends an assistant tool call (ends generation).
    pub const CALL: u32 = 200_012;
    /// The first special token ID; every ID from here to the end of the vocabulary is special.
    pub const FIRST: u32 = STARTOFTEXT;
}

/// The named special tokens; every other ID in `special::FIRST..VOCAB_SIZE` is
/// `<|reserved_ID|>`.
const NAMED_SPECIALS: [(&str, u32); 9] = [
    ("<|startoftext|>", special::STARTOFTEXT),
    ("<|endoftext|>", special::ENDOFTEXT),
    ("<|return|>", special::RETURN),
    ("<|constrain|>", special::CONSTRAIN),
    ("<|channel|>", special::CHANNEL),
    ("<|start|>", special::START),
    ("<|end|>", special::END),
    ("<|message|>", special::MESSAGE),
    ("<|call|>", special::CALL),
];

/// The text of special token `id` (which must be in `special::FIRST..VOCAB_SIZE`).
fn special_name(id: u32) -> String {
    match NAMED_SPECIALS.iter().find(|(_, i)| *i == id) {
        Some((name, _)) => (*name).to_string(),
        None => format!("<|reserved_{id}|>"),
    }
}

struct Tables {
    /// Every special token's text, as `CoreBPE::encode` wants the allowed set.
    allowed: HashSet<&'static str>,
    /// No special token allowed.
    none: HashSet<&'static str>,
    /// Special token text to ID.
    by_name: HashMap<String, u32>,
}

static TABLES: LazyLock<Tables> = LazyLock::new(|| {
    let by_name: HashMap<String, u32> =
        (special::FIRST..VOCAB_SIZE as u32).map(|id| (special_name(id), id)).collect();
    let allowed = tiktoken_rs::o200k_harmony_singleton().special_tokens();
    Tables { allowed, none: HashSet::new(), by_name }
});

/// Longest whitespace run handed to the pre-tokenizer in one piece by the fallback path.
const MAX_WHITESPACE_RUN: usize = 65_536;

/// `text` cut inside whitespace runs so that no piece holds more than `MAX_WHITESPACE_RUN`
/// consecutive whitespace characters.
fn split_long_whitespace(text: &str) -> impl Iterator<Item = &str> {
    let mut cuts = vec![0];
    let mut run = 0;
    for (i, c) in text.char_indices() {
        run = if c.is_whitespace() { run + 1 } else { 0 };
        if run > MAX_WHITESPACE_RUN {
            cuts.push(i);
            run = 1;
        }
    }
    cuts.push(text.len());
    (0..cuts.len() - 1).map(move |k| &text[cuts[k]..cuts[k + 1]])
}

/// The o200k_harmony tokenizer. Cheap to copy: the tables are built on first use and shared
/// by the whole process.
#[derive(Clone, Copy)]
pub struct Tokenizer {
    bpe: &'static CoreBPE,
    tables: &'static Tables,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("name", &"o200k_harmony").field("vocab_size", &VOCAB_SIZE).finish()
    }
}

impl Default for Tokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Tokenizer {
    /// The o200k_harmony tokenizer (the first call builds the shared tables).
    pub fn new() -> Self {
        Tokenizer { bpe: tiktoken_rs::o200k_harmony_singleton(), tables: &TABLES }
    }

    /// Number of token IDs, 201088.
    pub fn vocab_size(&self) -> usize {
        VOCAB_SIZE
    }

    /// Encodes ordinary text. Special-token strings such as `"<|end|>"` are encoded as the
    /// plain characters they consist of, never as special tokens, so user text cannot inject
    /// message boundaries.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_allowing(text, &self.tables.none)
    }

    /// Encodes text in which the strings of special tokens (`<|start|>`, `<|reserved_200013|>`,
    /// ...) stand for those tokens. Only for trusted text such as templates and tests.
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        self.encode_allowing(text, &self.tables.allowed)
    }

    fn encode_allowing(&self, text: &str, allowed: &HashSet<&str>) -> Vec<u32> {
        match self.bpe.encode(text, allowed) {
            Ok((ids, _)) => ids,
            // The pre-tokenizer's backtracking stack overflows on a whitespace run of about a
            // million characters (the official library panics there). Cut such runs into
            // bounded pieces and encode those: the same IDs except at the cuts.
            Err(_) => split_long_whitespace(text)
                .flat_map(|piece| match self.bpe.encode(piece, allowed) {
                    Ok((ids, _)) => ids,
                    Err(_) => piece
                        .chars()
                        .flat_map(|c| self.bpe.encode_ordinary(c.encode_utf8(&mut [0; 4])))
                        .collect(),
                })
                .collect(),
        }
    }

    /// An error unless `id` is a token ID.
    pub fn check(&self, id: u32) -> Result<()> {
        if (id as usize) < VOCAB_SIZE {
            Ok(())
        } else {
            Err(Error::invalid(format!("token ID {id} out of range: the vocabulary has {VOCAB_SIZE} IDs")))
        }
    }

    /// The bytes of token `id`; for a special token, the bytes of its text.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        self.decode_bytes(&[id])
    }

    /// The text of token `id`. A token holding part of a multi-byte character shows U+FFFD.
    pub fn token_str(&self, id: u32) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.token_bytes(id)?).into_owned())
    }

    /// The ID of the special token with text `name` (`"<|end|>"`, `"<|reserved_200013|>"`).
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.tables.by_name.get(name).copied()
    }

    /// Whether `id` is a special token (`special::FIRST` to the end of the vocabulary).
    pub fn is_special(&self, id: u32) -> bool {
        (special::FIRST..VOCAB_SIZE as u32).contains(&id)
    }

    /// The concatenated bytes of `ids`, which need not be valid UTF-8.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= VOCAB_SIZE) {
            self.check(bad)?;
        }
        self.bpe
            .decode_bytes(ids)
            .map_err(|e| Error::invalid(format!("token ID {} has no bytes in o200k_harmony", e.token)))
    }

    /// Decodes `ids` to text; bytes that are not valid UTF-8 become U+FFFD (like the official
    /// `decode`, which uses `errors="replace"`).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// Decodes `ids` to text, failing if the bytes are not valid UTF-8.
    pub fn decode_utf8(&self, ids: &[u32]) -> Result<String> {
        String::from_utf8(self.decode_bytes(ids)?)
            .map_err(|e| Error::invalid(format!("tokens do not decode to valid UTF-8: {e}")))
    }

    /// A streaming decoder over this tokenizer.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::new(*self)
    }
}

/// Turns a stream of token IDs into text pieces that never split a UTF-8 character: the
/// bytes of an incomplete character wait for the tokens that complete it. Invalid bytes
/// come out as U+FFFD, so concatenating every piece (and `finish`) gives `decode` of all IDs.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder with nothing pending.
    pub fn new(tokenizer: Tokenizer) -> Self {
        StreamDecoder { tokenizer, pending: Vec::new() }
    }

    /// Adds one token; returns the text that is now complete, if any. An out-of-range ID is
    /// an error and changes nothing.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let bytes = self.tokenizer.token_bytes(id)?;
        Ok(push_utf8(&mut self.pending, &bytes))
    }

    /// Number of bytes held back waiting for the rest of a character.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Ends the stream: the held-back bytes of an unfinished character, as U+FFFD.
    pub fn finish(&mut self) -> Option<String> {
        finish_utf8(&mut self.pending)
    }
}

/// Appends a token's `bytes` to `pending` and takes out the text now complete: every whole
/// character, invalid bytes as U+FFFD; an unfinished character at the end stays pending.
/// `None` when nothing is complete. Shared by every streaming decoder.
pub(crate) fn push_utf8(pending: &mut Vec<u8>, bytes: &[u8]) -> Option<String> {
    pending.extend_from_slice(bytes);
    let mut out = String::new();
    loop {
        match std::str::from_utf8(pending) {
            Ok(s) => {
                out.push_str(s);
                pending.clear();
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(std::str::from_utf8(&pending[..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push('\u{FFFD}');
                        pending.drain(..valid + bad);
                    }
                    None => {
                        // An incomplete character at the end: wait for more bytes.
                        pending.drain(..valid);
                        break;
                    }
                }
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

/// Ends a stream: the held-back bytes of an unfinished character, as U+FFFD.
pub(crate) fn finish_utf8(pending: &mut Vec<u8>) -> Option<String> {
    let rest = std::mem::take(pending);
    (!rest.is_empty()).then(|| String::from_utf8_lossy(&rest).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_table_matches_tiktoken() {
        let t = Tokenizer::new();
        for id in special::FIRST..VOCAB_SIZE as u32 {
            let name = special_name(id);
            assert_eq!(t.encode_with_special(&name), vec![id], "{name}");
            assert_eq!(t.token_str(id).unwrap(), name);
            assert_eq!(t.special_id(&name), Some(id));
        }
        assert_eq!(t.tables.allowed.len(), VOCAB_SIZE - special::FIRST as usize);
        assert_eq!(t.special_id("<|reserved_201088|>"), None);
        assert_eq!(t.special_id("<|refusal|>"), None);
    }

    #[test]
    fn every_ordinary_id_decodes() {
        let t = Tokenizer::new();
        for id in 0..special::FIRST {
            assert!(!t.token_bytes(id).unwrap().is_empty(), "{id}");
        }
    }

    #[test]
    fn huge_whitespace_run_does_not_panic() {
        let t = Tokenizer::new();
        let text = format!("a{}b\n{}", " ".repeat(1_500_000), "\t".repeat(1_200_000));
        let ids = t.encode(&text);
        assert_eq!(t.decode(&ids).unwrap(), text);
        let pieces: Vec<&str> = split_long_whitespace(&text).collect();
        assert_eq!(pieces.concat(), text);
        assert!(pieces.len() > 30);
    }

    #[test]
    fn out_of_range_is_an_error() {
        let t = Tokenizer::new();
        assert!(t.decode(&[1, VOCAB_SIZE as u32]).is_err());
        assert!(t.token_str(u32::MAX).is_err());
        let mut d = t.stream_decoder();
        assert!(d.push(VOCAB_SIZE as u32).is_err());
        assert_eq!(d.pending_len(), 0);
    }
}
