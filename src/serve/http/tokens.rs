//! `POST /tokenize` and `POST /detokenize` (as vLLM names them): what text or a chat
//! conversation becomes in o200k_harmony token IDs, and back. No engine is involved.

use serde::{Deserialize, Serialize};

use super::api::ChatRequest;
use super::convert;
use super::error::ApiError;
use crate::chat::ChatFormat;

/// `POST /tokenize`: `prompt` (text, in which special-token strings such as `<|start|>`
/// stand for those tokens, so a raw Harmony prompt can be checked) or `messages` (a chat
/// completions conversation, with its `tools` and `reasoning_effort`, rendered as
/// `/v1/chat/completions` renders it).
#[derive(Deserialize, Debug)]
pub(crate) struct TokenizeRequest {
    /// Text to encode.
    pub prompt: Option<String>,
    /// A conversation to render (the rest of the chat completions fields apply to it).
    #[serde(flatten)]
    pub chat: ChatRequest,
}

/// The answer of `POST /tokenize`.
#[derive(Serialize, Debug, PartialEq)]
pub(crate) struct TokenizeResponse {
    /// How many tokens.
    pub count: usize,
    /// The context capacity, as vLLM reports it.
    pub max_model_len: usize,
    /// The token IDs.
    pub tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(Deserialize, Debug)]
pub(crate) struct DetokenizeRequest {
    /// Token IDs.
    pub tokens: Option<Vec<u64>>,
}

/// The answer of `POST /detokenize`.
#[derive(Serialize, Debug, PartialEq)]
pub(crate) struct DetokenizeResponse {
    /// The text; bytes that are not valid UTF-8 become U+FFFD.
    pub prompt: String,
}

/// The token IDs of a `/tokenize` body.
pub(crate) fn tokenize(format: &ChatFormat, body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let request: TokenizeRequest = convert::parse_json(body)?;
    match (request.prompt, request.chat.messages.is_some()) {
        (Some(_), true) => Err(ApiError::invalid(Some("prompt"), "give `prompt` or `messages`, not both")),
        (Some(text), false) => format
            .tokenizer()
            .encode_with_special(&text)
            .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string())),
        (None, true) => {
            let plan = convert::plan(request.chat, &crate::chat::today_utc(), 0)?;
            format.render_prompt(&plan.conversation).map_err(|e| {
                ApiError::invalid(Some("messages"), format!("the conversation cannot be rendered: {e}"))
            })
        }
        (None, false) => Err(ApiError::invalid(Some("prompt"), "`prompt` or `messages` is required")),
    }
}

/// The text of a `/detokenize` body.
pub(crate) fn detokenize(format: &ChatFormat, body: &[u8]) -> Result<String, ApiError> {
    let request: DetokenizeRequest = convert::parse_json(body)?;
    let ids = request.tokens.ok_or_else(|| ApiError::invalid(Some("tokens"), "`tokens` is required"))?;
    let tokenizer = format.tokenizer();
    let vocab = tokenizer.vocab_size();
    let mut checked = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        match u32::try_from(id) {
            Ok(t) if (t as usize) < vocab => checked.push(t),
            _ => {
                return Err(ApiError::invalid(
                    Some(&format!("tokens[{i}]")),
                    format!("token ID {id} is outside the vocabulary (0..{vocab})"),
                ));
            }
        }
    }
    tokenizer.decode(&checked).map_err(|e| ApiError::invalid(Some("tokens"), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_conversations_round_trip() {
        let h = ChatFormat::Harmony(crate::chat::HarmonyEncoding::new());
        let ids = tokenize(&h, br#"{"prompt": "<|start|>user<|message|>Hi"}"#).unwrap();
        assert_eq!(ids[0], h.tokenizer().special_id("<|start|>").unwrap(), "special strings are tokens");
        let body = serde_json::json!({ "tokens": ids }).to_string();
        assert_eq!(detokenize(&h, body.as_bytes()).unwrap(), "<|start|>user<|message|>Hi");
        let chat = tokenize(&h, br#"{"messages": [{"role": "user", "content": "Hi"}]}"#).unwrap();
        let text = h.tokenizer().decode(&chat).unwrap();
        assert!(
            text.starts_with("<|start|>system<|message|>") && text.ends_with("<|start|>assistant"),
            "{text}"
        );
        let e = tokenize(&h, b"{}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = detokenize(&h, br#"{"tokens": [1, 999999999]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tokens[1]"));
        let e = tokenize(&h, br#"{"messages": []}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }
}
