//! The token vocabulary a constraint works over: the bytes of every token ID the model
//! has, as llguidance's token trie wants them, and the grammar compiler built on it.
//!
//! The trie covers exactly the model's vocabulary (`0..model_vocab`), whatever the
//! tokenizer's size: an ID the tokenizer does not have gets no bytes (so no grammar can
//! allow it), and a tokenizer ID beyond the model's vocabulary is not in the trie at all.
//! Special tokens are written as llguidance expects them (a `0xFF` byte, then their text),
//! so a grammar names them by ID (`<[200006]>`) and ordinary text can never match one.
//!
//! Building the trie and the compiler's lexer slices takes a noticeable fraction of a
//! second for the 201088 tokens of o200k_harmony, so [`Vocabulary::shared`] builds one per
//! model vocabulary size and keeps it for the life of the process.

use std::sync::{Arc, Mutex};

use llguidance::ParserFactory;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::chat::Tokenizer;
use crate::chat::tokenizer::special;
use crate::error::{Error, Result};

/// A model's vocabulary with the grammar compiler for it. Cheap to clone.
#[derive(Clone)]
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    size: usize,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary").field("size", &self.size).finish()
    }
}

impl Vocabulary {
    /// The o200k_harmony vocabulary cut or padded to `model_vocab` IDs, with
    /// `<|endoftext|>` as the end of a finished grammar (or the last ID where the model's
    /// vocabulary is smaller). Built once per size and shared.
    pub fn shared(model_vocab: usize) -> Result<Vocabulary> {
        static CACHE: Mutex<Vec<(usize, Vocabulary)>> = Mutex::new(Vec::new());
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, v)) = cache.iter().find(|(size, _)| *size == model_vocab) {
            return Ok(v.clone());
        }
        let end = if (special::ENDOFTEXT as usize) < model_vocab {
            special::ENDOFTEXT
        } else {
            u32::try_from(model_vocab.saturating_sub(1)).unwrap_or(u32::MAX)
        };
        let v = Vocabulary::new(&Tokenizer::new(), model_vocab, end)?;
        cache.push((model_vocab, v.clone()));
        Ok(v)
    }

    /// The vocabulary of a model with `model_vocab` IDs whose text `tokenizer` gives;
    /// `end` is the token a grammar that has reached its end allows (it should be one of
    /// the caller's stop tokens).
    pub fn new(tokenizer: &Tokenizer, model_vocab: usize, end: u32) -> Result<Vocabulary> {
        let size = u32::try_from(model_vocab).ok().filter(|&n| n > 0).ok_or_else(|| {
            Error::invalid(format!("a vocabulary of {model_vocab} tokens cannot be constrained"))
        })?;
        if end >= size {
            return Err(Error::invalid(format!(
                "the end token {end} is outside the model's vocabulary (0..{model_vocab})"
            )));
        }
        let words: Vec<Vec<u8>> = (0..size).map(|id| token_word(tokenizer, id)).collect();
        let trie = TokTrie::from(&TokRxInfo::new(size, end), &words);
        // Tokenizing is only needed for llguidance's forced-token shortcuts, which the
        // sampler does not use; the trie's greedy tokenizer is enough for them.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::invalid(format!("cannot build the grammar compiler: {e}")))?;
        factory.quiet();
        Ok(Vocabulary { factory: Arc::new(factory), size: model_vocab })
    }

    /// Number of token IDs (the model's vocabulary).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The grammar compiler over this vocabulary.
    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.factory
    }
}

/// The trie bytes of token `id`: its text, `0xFF` then the name for a special token, and
/// nothing for an ID the tokenizer does not have.
fn token_word(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    match tokenizer.token_bytes(id) {
        Ok(bytes) if tokenizer.is_special(id) => {
            let mut word = Vec::with_capacity(bytes.len() + 1);
            word.push(TokTrie::SPECIAL_TOKEN_MARKER);
            word.extend_from_slice(&bytes);
            word
        }
        Ok(bytes) => bytes,
        Err(_) => Vec::new(),
    }
}
