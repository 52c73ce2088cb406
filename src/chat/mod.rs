//! Tokens and chat format of GPT-OSS: the o200k_harmony tokenizer (the Harmony message
//! format follows).

pub mod tokenizer;

pub use tokenizer::{StreamDecoder, Tokenizer, VOCAB_SIZE};
