//! Where expert weights come from. The forward pass asks an [`ExpertSource`] for
//! `(layer, expert)`; whether the answer is already in memory, in a cache, or read from
//! disk is the source's business and changes speed only, never the numbers.

pub mod resident;

use std::sync::Arc;

use crate::error::Result;
use crate::model::weights::ExpertWeights;

pub use resident::ResidentExperts;

/// Supplies expert weights by `(layer, expert)`.
pub trait ExpertSource: Send + Sync {
    /// The weights of `expert` in `layer`.
    fn expert(&self, layer: usize, expert: usize) -> Result<Arc<ExpertWeights>>;

    /// The weights of several experts of one layer (e.g. the union a prefill block routes
    /// to). Sources that can read in parallel override this.
    fn experts(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<ExpertWeights>>> {
        experts.iter().map(|&e| self.expert(layer, e)).collect()
    }

    /// One line describing the source (for logs).
    fn describe(&self) -> String;
}
