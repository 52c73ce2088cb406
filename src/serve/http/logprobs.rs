//! Log probabilities as OpenAI writes them (`token`, `logprob`, `bytes`, `top_logprobs`),
//! and which generated tokens they are reported for.
//!
//! They are reported for the tokens of the text sent as content (the answer, and a
//! commentary preamble): not for reasoning, tool-call arguments, message headers or
//! Harmony's control tokens. Text reaches the client a little after its tokens (a
//! character split over tokens, a header read to its end, an answer held back for a stop
//! string), so [`ContentLogprobs`] keeps the tokens since the last text and gives them to
//! the next content text; a control token (`<|message|>`, `<|end|>`, ...) ends what came
//! before it, so header words are dropped with it.

use serde::Serialize;

use crate::chat::TextTokenizer;
use crate::sample::Sampled;

/// One token's log probability, with the most likely alternatives at its position.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct TokenLogprob {
    /// The token's text (a token holding part of a character shows U+FFFD; `bytes` is exact).
    pub token: String,
    /// Its log probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its position, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative at a position.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log probability.
    pub logprob: f32,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// `choices[].logprobs` of chat completions (and of a stream chunk).
#[derive(Serialize, Debug, Clone, PartialEq, Default)]
pub(crate) struct ChoiceLogprobs {
    /// One entry per token of the content.
    pub content: Vec<TokenLogprob>,
    /// Always null: the model writes no refusals apart from its content.
    pub refusal: Option<Vec<TokenLogprob>>,
}

/// Text and bytes of token `id`.
fn token_text(tokenizer: &TextTokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The entry of a sampled token, if its log probabilities were computed.
pub(crate) fn entry(tokenizer: &TextTokenizer, sampled: &Sampled) -> Option<TokenLogprob> {
    let lp = sampled.logprobs.as_ref()?;
    let (token, bytes) = token_text(tokenizer, sampled.token);
    let top_logprobs = lp
        .top
        .iter()
        .map(|&(id, logprob)| {
            let (token, bytes) = token_text(tokenizer, id);
            TopLogprob { token, logprob, bytes }
        })
        .collect();
    Some(TokenLogprob { token, logprob: lp.logprob, bytes, top_logprobs })
}

/// Gives each content text the entries of the tokens that led to it; see the module
/// documentation.
#[derive(Debug, Default)]
pub(crate) struct ContentLogprobs {
    pending: Vec<TokenLogprob>,
    after_control: bool,
}

impl ContentLogprobs {
    /// A token was generated.
    pub fn on_token(&mut self, tokenizer: &TextTokenizer, sampled: &Sampled) {
        if self.after_control {
            self.pending.clear();
        }
        self.after_control = tokenizer.is_special(sampled.token);
        if !self.after_control
            && let Some(e) = entry(tokenizer, sampled)
        {
            self.pending.push(e);
        }
    }

    /// Content text was sent: the entries that belong to it.
    pub fn take_for_content(&mut self) -> Vec<TokenLogprob> {
        std::mem::take(&mut self.pending)
    }

    /// Other text (reasoning, tool-call arguments) was sent: its tokens are not reported.
    pub fn discard(&mut self) {
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::TokenLogprobs;

    fn sampled(id: u32) -> Sampled {
        Sampled {
            token: id,
            logprobs: Some(TokenLogprobs { logprob: -0.5, top: vec![(id, -0.5), (0, -2.0)] }),
        }
    }

    #[test]
    fn content_gets_its_own_tokens_and_not_headers_or_control_tokens() {
        let tok = TextTokenizer::O200k(crate::chat::Tokenizer::new());
        let mut c = ContentLogprobs::default();
        let ids = tok.encode_with_special("<|channel|>final<|message|>Hello").unwrap();
        let (&hello, header) = ids.split_last().unwrap();
        for &id in header {
            c.on_token(&tok, &sampled(id));
        }
        c.on_token(&tok, &sampled(hello));
        let got = c.take_for_content();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].token, "Hello");
        assert_eq!(got[0].bytes, b"Hello");
        assert_eq!(got[0].top_logprobs[0].token, "Hello");
        assert_eq!(got[0].top_logprobs[1].bytes, tok.token_bytes(0).unwrap());
        // Text released at a control token (no header) keeps the tokens before it.
        for &id in &tok.encode("Hi there").unwrap() {
            c.on_token(&tok, &sampled(id));
        }
        c.on_token(&tok, &sampled(crate::chat::tokenizer::special::RETURN));
        let got = c.take_for_content();
        assert_eq!(got.iter().map(|e| e.token.as_str()).collect::<String>(), "Hi there");
        // Reasoning is dropped.
        c.on_token(&tok, &sampled(hello));
        c.discard();
        assert!(c.take_for_content().is_empty());
        // Without log probabilities nothing is kept.
        c.on_token(&tok, &Sampled::token(hello));
        assert!(c.take_for_content().is_empty());
    }
}
