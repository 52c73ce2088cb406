//! On-disk formats: Hugging Face safetensors checkpoints (with MXFP4 experts, decoded by
//! [`crate::quant::mxfp4`]), our container, and small writers for dumps.

pub mod container;
pub mod hf;
pub mod npy;
pub mod safetensors;
