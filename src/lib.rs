//! Picchio: a GPT-OSS mixture-of-experts inference engine.
//!
//! The CPU F32 path is the numeric oracle; every faster path (quantized kernels, streamed
//! experts, the GPU) is checked against it. See `ARCHITECTURE.md` for the shape of the code.

#![warn(missing_docs)]

pub mod backend;
pub mod bench;
pub mod chat;
pub mod config;
pub mod constrain;
pub mod engine;
pub mod error;
pub mod experts;
pub mod fallback;
pub mod format;
pub mod gpu_bench;
pub mod io;
pub mod lockstep;
pub mod model;
pub mod quant;
pub mod sample;
pub mod serve;
pub mod session;
pub mod slots;
pub mod synth;
pub mod system;

pub use config::ModelConfig;
pub use error::{Error, Result};

/// The tiny model bundled in the source tree, used when no `-m` is given.
pub fn default_model_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("tiny-f32")
}
