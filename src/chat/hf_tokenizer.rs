//! A Hugging Face `tokenizer.json` (Qwen3's byte-level BPE, and others the `tokenizers`
//! crate reads), with the same operations as the o200k [`Tokenizer`](super::Tokenizer):
//! encoding with and without the added (control) tokens, decoding to bytes, token lookup.
//!
//! Text between added tokens is encoded exactly as the library encodes it (its normalizer,
//! pre-tokenizer and model); [`HfTokenizer::encode`] runs that pipeline without matching
//! added tokens at all, so user text cannot inject `<|im_end|>` or `<tool_call>`.
//!
//! Every token's bytes are worked out once at load time: byte-level BPE maps each character
//! of a token back to its byte (GPT-2's table, as the ByteLevel decoder does); otherwise
//! `▁` is a space and `<0xNN>` the byte NN (SentencePiece with byte fallback). A streaming
//! decoder over those bytes never splits a UTF-8 character.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tokenizers::{DecoderWrapper, Model, Normalizer, OffsetType, PreTokenizedString, PreTokenizer};

use crate::error::{Error, Result};

/// A tokenizer read from a `tokenizer.json`.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was read from (for messages).
    path: PathBuf,
    /// Bytes of each ID (`0..vocab_size`); empty for an ID the file does not define.
    bytes: Vec<Vec<u8>>,
    /// Whether each ID is an added (control) token: `<|im_start|>`, `<think>`, ...
    added: Vec<bool>,
    /// Added-token text to ID.
    by_name: HashMap<String, u32>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.bytes.len())
            .finish()
    }
}

/// GPT-2's byte-to-character table of byte-level BPE, inverted: character to byte.
fn byte_level_chars() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (u32::from('!')..=u32::from('~')).collect();
    printable.extend(u32::from('¡')..=u32::from('¬'));
    printable.extend(u32::from('®')..=u32::from('ÿ'));
    let mut map = HashMap::new();
    let mut next = 0u32;
    for b in 0..=255u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            next += 1;
            255 + next
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b as u8);
        }
    }
    map
}

/// The bytes of a SentencePiece-style token: `<0xNN>` is byte NN, `▁` a space.
fn sentencepiece_bytes(token: &str) -> Vec<u8> {
    if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && hex.len() == 2
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    token.replace('\u{2581}', " ").into_bytes()
}

impl HfTokenizer {
    /// Reads `path` (a `tokenizer.json`). Errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::invalid(format!("{}: not a readable tokenizer.json: {e}", path.display())))?;
        Self::new(inner, path)
    }

    fn new(inner: tokenizers::Tokenizer, path: &Path) -> Result<Self> {
        let added_tokens = inner.get_added_tokens_decoder();
        let vocab = inner.get_vocab(true);
        let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        if size == 0 {
            return Err(Error::invalid(format!("{}: the vocabulary is empty", path.display())));
        }
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let table = byte_level_chars();
        let mut bytes = vec![Vec::new(); size];
        let mut added = vec![false; size];
        let mut by_name = HashMap::new();
        for (token, &id) in &vocab {
            let i = id as usize;
            if let Some(a) = added_tokens.get(&id) {
                bytes[i] = a.content.as_bytes().to_vec();
                added[i] = true;
                by_name.insert(a.content.clone(), id);
            } else if byte_level {
                bytes[i] = token
                    .chars()
                    .map(|c| table.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| token.as_bytes().to_vec());
            } else {
                bytes[i] = sentencepiece_bytes(token);
            }
        }
        Ok(HfTokenizer { inner, path: path.to_path_buf(), bytes, added, by_name })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of token IDs (one past the largest ID the file defines).
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// Encodes ordinary text: the strings of added tokens (`<|im_end|>`, `<think>`) are
    /// encoded as the characters they consist of, never as those tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let fail =
            |e: tokenizers::Error| Error::invalid(format!("{}: encoding failed: {e}", self.path.display()));
        let mut normalized = tokenizers::NormalizedString::from(text);
        if let Some(n) = self.inner.get_normalizer() {
            n.normalize(&mut normalized).map_err(fail)?;
        }
        let mut pre = PreTokenizedString::from(normalized);
        if let Some(p) = self.inner.get_pre_tokenizer() {
            p.pre_tokenize(&mut pre).map_err(fail)?;
        }
        let model = self.inner.get_model();
        pre.tokenize(|piece| model.tokenize(piece.get())).map_err(fail)?;
        let encoding = pre.into_encoding(None, 0, OffsetType::Byte).map_err(fail)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encodes text in which the strings of added tokens stand for those tokens, as
    /// Transformers tokenizes a rendered chat template. Only for trusted text.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::invalid(format!("{}: encoding failed: {e}", self.path.display())))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// An error unless `id` is a token ID of this tokenizer.
    pub fn check(&self, id: u32) -> Result<()> {
        if (id as usize) < self.bytes.len() {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "token ID {id} out of range: the tokenizer {} has {} IDs",
                self.path.display(),
                self.bytes.len()
            )))
        }
    }

    /// The bytes of token `id`; for an added token, the bytes of its text.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        self.check(id)?;
        Ok(&self.bytes[id as usize])
    }

    /// The ID of the added token with text `name` (`"<|im_end|>"`, `"<think>"`).
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// Whether `id` is an added (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.added.get(id as usize).copied().unwrap_or(false)
    }

    /// The concatenated bytes of `ids`, which need not be valid UTF-8.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// The text of `ids` (added tokens as their text); bytes that are not UTF-8 show U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_table_covers_every_byte_once() {
        let t = byte_level_chars();
        assert_eq!(t.len(), 256);
        let mut seen: Vec<u8> = t.values().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
    }

    #[test]
    fn sentencepiece_pieces_map_to_bytes() {
        assert_eq!(sentencepiece_bytes("<0x0A>"), b"\n");
        assert_eq!(sentencepiece_bytes("\u{2581}the"), b" the");
        assert_eq!(sentencepiece_bytes("<0xZZ>"), b"<0xZZ>");
    }
}
