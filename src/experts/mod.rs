//! Where expert weights come from. The forward pass asks an [`ExpertSource`] for
//! `(layer, expert)`; whether the answer is already in memory, in a cache, or read from
//! disk is the source's business and changes speed only, never the numbers.

pub mod cache;
pub mod resident;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::model::weights::ExpertWeights;

pub use cache::CachedExperts;
pub use resident::ResidentExperts;
pub use store::ExpertStore;

/// Counters of an expert source (zero for sources that never read).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Requests served from memory.
    pub hits: u64,
    /// Requests that read the disk.
    pub misses: u64,
    /// Bytes read from disk.
    pub bytes_read: u64,
    /// Time spent waiting for reads.
    pub disk_wait: Duration,
    /// Experts dropped from the cache to make room.
    pub evictions: u64,
}

impl ExpertStats {
    /// Share of requests served from memory, 0..=1 (1 when there were none).
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 { 1.0 } else { self.hits as f64 / total as f64 }
    }
}

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

    /// Counters so far.
    fn stats(&self) -> ExpertStats {
        ExpertStats::default()
    }

    /// Bytes one expert occupies in memory.
    fn expert_bytes(&self) -> u64;
}
