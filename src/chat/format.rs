//! The chat-format seam: Harmony (GPT-OSS) and ChatML (Qwen3-MoE) behind one type that the
//! turn code and every front end use. Each format renders the format-neutral
//! [`Conversation`] to prompt tokens, names the tokens that end a turn, and parses the
//! generated tokens into the same [`Delta`]s and [`Message`]s.
//!
//! The family decides the format in one place, [`ChatFormat::for_family`]; a new format
//! is a new variant, and every `match` below is then a compile error until it is handled.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::chatml::ChatMl;
use super::chatml_parser::ChatMlParser;
use super::harmony::{HarmonyEncoding, RenderConfig};
use super::message::{Conversation, Message, Role};
use super::recovery::{Delta, TurnParser};
use super::text_tokenizer::TextTokenizer;
use super::tokenizer::special;
use crate::config::ModelFamily;
use crate::error::{Error, Result};

/// The side files of a Hugging Face release that a ChatML model needs next to its
/// `config.json` (the converter copies them into the container).
pub const TOKENIZER_FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"];

/// A chat format over its tokenizer. Cheap to clone.
#[derive(Debug, Clone)]
pub enum ChatFormat {
    /// OpenAI's Harmony over o200k_harmony (GPT-OSS).
    Harmony(HarmonyEncoding),
    /// ChatML as Qwen3 renders it, over the model's `tokenizer.json`.
    ChatMl(Arc<ChatMl>),
}

// Only by reference, as the turn functions take it (`complete(&mut s, &harmony, ...)`).
impl From<&HarmonyEncoding> for ChatFormat {
    fn from(h: &HarmonyEncoding) -> Self {
        ChatFormat::Harmony(*h)
    }
}

impl From<&ChatFormat> for ChatFormat {
    fn from(f: &ChatFormat) -> Self {
        f.clone()
    }
}

impl ChatFormat {
    /// The format of `family`: Harmony for GPT-OSS (nothing to read: o200k is embedded),
    /// ChatML for Qwen3-MoE, read from the first of `dirs` that holds a `tokenizer.json`
    /// (with its `generation_config.json` for the stop tokens). `thinking: false` asks a
    /// ChatML model not to think (the empty think block); Harmony ignores it (its system
    /// message sets the reasoning effort).
    pub fn for_family(family: ModelFamily, dirs: &[PathBuf], thinking: bool) -> Result<Self> {
        match family {
            ModelFamily::GptOss => Ok(ChatFormat::Harmony(HarmonyEncoding::new())),
            ModelFamily::Qwen3Moe => {
                let dir = find_tokenizer_dir(dirs)?;
                Ok(ChatFormat::ChatMl(Arc::new(ChatMl::from_dir(dir)?.with_thinking(thinking))))
            }
        }
    }

    /// The format's name, for messages: `harmony` or `chatml`.
    pub fn name(&self) -> &'static str {
        match self {
            ChatFormat::Harmony(_) => "harmony",
            ChatFormat::ChatMl(_) => "chatml",
        }
    }

    /// The text tokenizer.
    pub fn tokenizer(&self) -> TextTokenizer {
        match self {
            ChatFormat::Harmony(h) => TextTokenizer::O200k(*h.tokenizer()),
            ChatFormat::ChatMl(c) => TextTokenizer::Hf(Arc::clone(c.tokenizer())),
        }
    }

    /// Harmony's encoding, when this is Harmony (for what only Harmony has: grammars over
    /// its channels, the strict parser).
    pub fn harmony(&self) -> Option<&HarmonyEncoding> {
        match self {
            ChatFormat::Harmony(h) => Some(h),
            ChatFormat::ChatMl(_) => None,
        }
    }

    /// The prompt for the assistant's next turn.
    pub fn render_prompt(&self, conversation: &Conversation) -> Result<Vec<u32>> {
        match self {
            ChatFormat::Harmony(h) => {
                h.render_conversation_for_completion(conversation, Role::Assistant, &RenderConfig::default())
            }
            ChatFormat::ChatMl(c) => c.render_for_completion(conversation),
        }
    }

    /// The tokens that end an assistant turn, those a model of `vocab` IDs can produce.
    /// Harmony: `<|return|>`, `<|call|>` and `<|endoftext|>`; ChatML: the
    /// `eos_token_id` of `generation_config.json`.
    pub fn stop_tokens(&self, vocab: usize) -> Vec<u32> {
        let mut stops = match self {
            ChatFormat::Harmony(_) => {
                let mut s = super::harmony::STOP_TOKENS.to_vec();
                s.push(special::ENDOFTEXT);
                s
            }
            ChatFormat::ChatMl(c) => c.stop_tokens().to_vec(),
        };
        stops.retain(|&t| (t as usize) < vocab);
        stops
    }

    /// The recovering parser of one assistant turn whose callable functions are
    /// `declared` (bare names).
    pub fn turn_parser(&self, declared: &[String]) -> FormatParser {
        match self {
            ChatFormat::Harmony(h) => FormatParser::Harmony(TurnParser::new(*h, declared)),
            ChatFormat::ChatMl(c) => {
                FormatParser::ChatMl(ChatMlParser::new(Arc::clone(c.tokenizer()), *c.tokens(), declared))
            }
        }
    }
}

/// The parser of one assistant turn in either format.
#[derive(Debug)]
pub enum FormatParser {
    /// Harmony's recovering parser.
    Harmony(TurnParser),
    /// ChatML's.
    ChatMl(ChatMlParser),
}

impl FormatParser {
    /// Consumes one generated token; returns the text it adds. Never fails.
    pub fn push(&mut self, token: u32) -> Vec<Delta> {
        match self {
            FormatParser::Harmony(p) => p.push(token),
            FormatParser::ChatMl(p) => p.push(token),
        }
    }

    /// Ends the turn; returns the text that completes.
    pub fn finish(&mut self) -> Vec<Delta> {
        match self {
            FormatParser::Harmony(p) => p.finish(),
            FormatParser::ChatMl(p) => p.finish(),
        }
    }

    /// The messages so far.
    pub fn messages(&self) -> &[Message] {
        match self {
            FormatParser::Harmony(p) => p.messages(),
            FormatParser::ChatMl(p) => p.messages(),
        }
    }

    /// The messages, consuming the parser.
    pub fn into_messages(self) -> Vec<Message> {
        match self {
            FormatParser::Harmony(p) => p.into_messages(),
            FormatParser::ChatMl(p) => p.into_messages(),
        }
    }
}

/// The first of `dirs` with a `tokenizer.json`; the error lists where it looked.
fn find_tokenizer_dir(dirs: &[PathBuf]) -> Result<&Path> {
    if let Some(dir) = dirs.iter().find(|d| d.join("tokenizer.json").is_file()) {
        return Ok(dir);
    }
    let looked: Vec<String> = dirs.iter().map(|d| d.join("tokenizer.json").display().to_string()).collect();
    Err(Error::invalid(format!(
        "no tokenizer for this Qwen3-MoE model: {} not found; a ChatML model needs the tokenizer.json \
         (and generation_config.json, for the stop tokens) of its Hugging Face release next to config.json, \
         or pass --tokenizer DIR with those files",
        if looked.is_empty() { "no directory given".to_string() } else { looked.join(", ") }
    )))
}
