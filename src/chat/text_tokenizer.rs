//! The tokenizer seam: o200k_harmony (GPT-OSS, embedded in the binary) or a Hugging Face
//! `tokenizer.json` (Qwen3-MoE, read from the model directory), behind one type with the
//! operations the front ends use.

use std::sync::Arc;

use super::hf_tokenizer::HfTokenizer;
use super::tokenizer::Tokenizer;
use crate::error::Result;

/// A text tokenizer of either kind. Cheap to clone.
#[derive(Debug, Clone)]
pub enum TextTokenizer {
    /// GPT-OSS's o200k_harmony.
    O200k(Tokenizer),
    /// A `tokenizer.json`.
    Hf(Arc<HfTokenizer>),
}

impl TextTokenizer {
    /// Number of token IDs.
    pub fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::O200k(t) => t.vocab_size(),
            TextTokenizer::Hf(t) => t.vocab_size(),
        }
    }

    /// Encodes ordinary text; the strings of special tokens stay text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::O200k(t) => Ok(t.encode(text)),
            TextTokenizer::Hf(t) => t.encode(text),
        }
    }

    /// Encodes text in which the strings of special tokens stand for those tokens.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::O200k(t) => Ok(t.encode_with_special(text)),
            TextTokenizer::Hf(t) => t.encode_with_special(text),
        }
    }

    /// An error unless `id` is a token ID.
    pub fn check(&self, id: u32) -> Result<()> {
        match self {
            TextTokenizer::O200k(t) => t.check(id),
            TextTokenizer::Hf(t) => t.check(id),
        }
    }

    /// The bytes of token `id` (a special token's text for a special token).
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        match self {
            TextTokenizer::O200k(t) => t.token_bytes(id),
            TextTokenizer::Hf(t) => t.token_bytes(id).map(<[u8]>::to_vec),
        }
    }

    /// The text of token `id`; part of a multi-byte character shows U+FFFD.
    pub fn token_str(&self, id: u32) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.token_bytes(id)?).into_owned())
    }

    /// The ID of the special token with text `name`.
    pub fn special_id(&self, name: &str) -> Option<u32> {
        match self {
            TextTokenizer::O200k(t) => t.special_id(name),
            TextTokenizer::Hf(t) => t.special_id(name),
        }
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        match self {
            TextTokenizer::O200k(t) => t.is_special(id),
            TextTokenizer::Hf(t) => t.is_special(id),
        }
    }

    /// The concatenated bytes of `ids`.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        match self {
            TextTokenizer::O200k(t) => t.decode_bytes(ids),
            TextTokenizer::Hf(t) => t.decode_bytes(ids),
        }
    }

    /// The text of `ids`; bytes that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// A streaming decoder that never splits a UTF-8 character.
    pub fn stream_decoder(&self) -> TextStreamDecoder {
        TextStreamDecoder { tokenizer: self.clone(), pending: Vec::new() }
    }
}

/// Turns token IDs into text pieces that never split a UTF-8 character (as
/// [`StreamDecoder`](super::StreamDecoder) does for o200k): concatenating every piece and
/// `finish` gives `decode` of all the IDs.
#[derive(Debug, Clone)]
pub struct TextStreamDecoder {
    tokenizer: TextTokenizer,
    pending: Vec<u8>,
}

impl TextStreamDecoder {
    /// Adds one token; returns the text now complete, if any. An out-of-range ID is an
    /// error and changes nothing.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let bytes = self.tokenizer.token_bytes(id)?;
        Ok(super::tokenizer::push_utf8(&mut self.pending, &bytes))
    }

    /// Ends the stream: held-back bytes of an unfinished character, as U+FFFD.
    pub fn finish(&mut self) -> Option<String> {
        super::tokenizer::finish_utf8(&mut self.pending)
    }
}
