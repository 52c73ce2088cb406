//! Tokens and chat formats: the o200k_harmony tokenizer and the Harmony message format of
//! GPT-OSS, token-exact with OpenAI's `openai-harmony` 0.0.8 (checked against its output in
//! `fixtures/harmony/`); a Hugging Face `tokenizer.json` and ChatML as Qwen3 renders it
//! (checked against Transformers in `fixtures/chatml/`); and the seam between them,
//! [`ChatFormat`], which the turn code and the front ends use.
//!
//! ```
//! use picchio::chat::{Conversation, HarmonyEncoding, Message, RenderConfig, Role, SystemContent};
//!
//! let harmony = HarmonyEncoding::new();
//! let convo = Conversation::from_messages([
//!     Message::system(SystemContent::new().with_conversation_start_date("2025-08-05")),
//!     Message::user("What is 2 + 2?"),
//! ]);
//! let prompt = harmony.render_conversation_for_completion(&convo, Role::Assistant, &RenderConfig::default())?;
//! // ... generate until one of `harmony.stop_tokens()`, pushing each token:
//! let mut parser = harmony.stream_parser(Some(Role::Assistant));
//! for &t in &harmony.tokenizer().encode_with_special("<|channel|>final<|message|>4<|return|>") {
//!     parser.push(t)?;
//! }
//! assert_eq!(parser.messages()[0].text(), "4");
//! # assert!(!prompt.is_empty());
//! # Ok::<(), picchio::Error>(())
//! ```

pub mod chatml;
pub mod chatml_parser;
pub mod format;
pub mod harmony;
pub mod hf_tokenizer;
pub mod json;
pub mod message;
pub mod parser;
pub mod recovery;
mod schema;
pub mod stop;
pub mod text_tokenizer;
pub mod tokenizer;
pub mod turn;

pub use chatml::ChatMl;
pub use chatml_parser::ChatMlParser;
pub use format::{ChatFormat, FormatParser, TOKENIZER_FILES};
pub use harmony::{HarmonyEncoding, MESSAGE_END_TOKENS, RenderConfig, RenderOptions, STOP_TOKENS};
pub use hf_tokenizer::HfTokenizer;
pub use json::JsonValue;
pub use message::{
    ChannelConfig, Content, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
    ToolDescription, ToolNamespace,
};
pub use parser::{ParseOptions, ParserState, StreamParser};
pub use recovery::{Delta, DeltaKind, TurnParser, parse_turn};
pub use stop::{MAX_STOP_STRINGS, Released, StopMatcher};
pub use text_tokenizer::{TextStreamDecoder, TextTokenizer};
pub use tokenizer::{StreamDecoder, Tokenizer, VOCAB_SIZE};
pub use turn::{
    ChatEvent, PromptFill, TurnOptions, TurnOutcome, complete, complete_prompt, prefill_prompt,
    render_prompt, today_utc, turn_stop_tokens,
};
