//! On-disk formats: Hugging Face safetensors checkpoints (with MXFP4 experts) and small
//! writers for dumps.

pub mod container;
pub mod hf;
pub mod mxfp4;
pub mod npy;
pub mod safetensors;
