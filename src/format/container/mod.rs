//! Picchio's own model container (see `docs/format.md`): `config.json`, `manifest.json`,
//! memory-mapped dense weights in `dense.bin`, and the expert store `experts.bin`.

pub mod convert;
pub mod layout;
pub mod manifest;
pub mod reader;
pub mod validate;
pub mod verify;

pub use convert::{ConvertOptions, ConvertReport, convert, source_identity};
pub use layout::{DenseFormat, ExpertFormat, Formats};
pub use manifest::Manifest;
pub use reader::{Container, is_container};
pub use validate::ValidatedLayout;
