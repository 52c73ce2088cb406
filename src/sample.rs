//! Choosing the next token from logits.

use crate::model::math::argmax_with_margin;

/// How the next token is chosen.
#[derive(Clone, Debug, Default)]
pub enum Sampler {
    /// The most likely token (lowest ID on ties).
    #[default]
    Greedy,
}

impl Sampler {
    /// Picks a token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self {
            Sampler::Greedy => argmax_with_margin(logits).0 as u32,
        }
    }
}
