//! The model: its weights, its math, and the forward pass written once over a backend.

pub mod forward;
pub mod math;
pub mod names;
pub mod rope;
pub mod weights;

pub use forward::{Forward, LogitRows, NoObserver, Observer};
