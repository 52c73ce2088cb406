//! Where expert weights come from. The forward pass asks an [`ExpertSource`] for
//! `(layer, expert)`; whether the answer is already in memory, in a cache, or read from
//! disk is the source's business and changes speed only, never the numbers.

pub mod buffers;
pub mod cache;
pub mod policy;
pub mod prediction;
pub mod readers;
pub mod resident;
pub mod routing;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::model::weights::ExpertWeights;

pub use cache::{CacheOptions, CachedExperts};
pub use policy::CachePolicy;
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
    /// Records read from disk (demand and prefetch).
    pub reads: u64,
    /// Reads started by a prediction.
    pub prefetch_reads: u64,
    /// Prefetched experts that were then asked for.
    pub prefetch_useful: u64,
    /// Prefetched experts evicted before anyone asked for them.
    pub prefetch_wasted: u64,
    /// Predictions dropped for lack of room.
    pub prefetch_skipped: u64,
    /// Routed experts of layers that had a prediction.
    pub predicted: u64,
    /// Of those, how many the prediction contained.
    pub predicted_right: u64,
    /// Experts preloaded and protected as the learned hot set.
    pub hot_set: u64,
    /// Prefetched experts still in the cache that nobody has asked for yet.
    pub prefetch_pending: u64,
    /// Predicted reads dropped from the read queue before they started, because the
    /// layer's routing did not choose them (counted in `prefetch_reads`, never read).
    pub prefetch_cancelled: u64,
    /// Predicted reads the layer's routing did not choose, stopped part-way: the pieces not
    /// yet started were never read (the pieces read are in `bytes_read`, not in `reads`).
    pub prefetch_abandoned: u64,
    /// Background reads (predicted or ahead) still queued when a computation asked for
    /// them, moved to the front.
    pub promoted: u64,
    /// Predictions not acted on because prediction did not pay (see
    /// [`prediction::PredictionGate`]).
    pub prediction_gated: u64,
    /// Read time that right predictions had put behind them when they were asked for.
    pub prefetch_hidden: Duration,
    /// Read time spent on wrong predictions that could not be cancelled.
    pub prefetch_cost: Duration,
    /// Time with at least one read of the disk in flight: the bytes read over it are the
    /// bandwidth the reads got while the disk was in use, and the wall time outside it is
    /// time the disk sat idle.
    pub disk_busy: Duration,
    /// Times the disk went from idle to busy.
    pub busy_stretches: u64,
    /// Reader time spent checking pieces against their hash (not reading).
    pub check_time: Duration,
    /// Reader time spent in reads, summed over the readers: over `disk_busy`, the mean
    /// number of reads in flight while the disk was in use.
    pub read_time: Duration,
}

impl ExpertStats {
    /// Share of routed experts the prediction got right, 0..=1 (`None` without predictions).
    pub fn prediction_accuracy(&self) -> Option<f64> {
        (self.predicted > 0).then(|| self.predicted_right as f64 / self.predicted as f64)
    }

    /// Counters accumulated since `earlier`.
    pub fn since(&self, earlier: &ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            disk_wait: self.disk_wait.saturating_sub(earlier.disk_wait),
            evictions: self.evictions - earlier.evictions,
            reads: self.reads - earlier.reads,
            prefetch_reads: self.prefetch_reads - earlier.prefetch_reads,
            prefetch_useful: self.prefetch_useful - earlier.prefetch_useful,
            prefetch_wasted: self.prefetch_wasted - earlier.prefetch_wasted,
            prefetch_skipped: self.prefetch_skipped - earlier.prefetch_skipped,
            predicted: self.predicted - earlier.predicted,
            predicted_right: self.predicted_right - earlier.predicted_right,
            hot_set: self.hot_set,
            prefetch_pending: self.prefetch_pending,
            prefetch_cancelled: self.prefetch_cancelled - earlier.prefetch_cancelled,
            prefetch_abandoned: self.prefetch_abandoned - earlier.prefetch_abandoned,
            promoted: self.promoted - earlier.promoted,
            prediction_gated: self.prediction_gated - earlier.prediction_gated,
            prefetch_hidden: self.prefetch_hidden.saturating_sub(earlier.prefetch_hidden),
            prefetch_cost: self.prefetch_cost.saturating_sub(earlier.prefetch_cost),
            disk_busy: self.disk_busy.saturating_sub(earlier.disk_busy),
            busy_stretches: self.busy_stretches - earlier.busy_stretches,
            check_time: self.check_time.saturating_sub(earlier.check_time),
            read_time: self.read_time.saturating_sub(earlier.read_time),
        }
    }

    /// Reads whose expert was used: every read except prefetches that were evicted unused
    /// or are still waiting to be asked for.
    pub fn useful_reads(&self) -> u64 {
        self.reads.saturating_sub(self.prefetch_wasted + self.prefetch_pending)
    }

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

    /// The most bytes of expert weights this source holds in host memory at once: a cache's
    /// capacity, every expert for a resident source. The GPU backend counts them where the
    /// adapter's memory is the system's RAM (unified memory), since the experts it copies
    /// into VRAM are then held twice in the same memory.
    fn host_bytes(&self) -> u64;

    /// Hands each of `experts` of `layer` to `f` (with its index in `experts`) as soon as it
    /// is in memory, so callers compute on the first arrivals while the rest are read. The
    /// order varies; callers that need a canonical result reduce afterwards. Once these are
    /// secured, the experts in `ahead` (needed next) start loading in the background.
    fn for_each_loaded(
        &self,
        layer: usize,
        experts: &[usize],
        ahead: &[usize],
        f: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
    ) -> Result<()> {
        let _ = ahead;
        for (i, &e) in experts.iter().enumerate() {
            f(i, self.expert(layer, e)?)?;
        }
        Ok(())
    }

    /// A hint that `experts` of `layer` will probably be needed soon: sources that read
    /// from disk start loading them in the background, within their budget, never evicting
    /// what is in use. Must not change any result.
    fn prefetch(&self, _layer: usize, _experts: &[usize]) {}

    /// Like [`ExpertSource::prefetch`] for experts known to be needed next (the next group
    /// of a prefill block's union): loaded ahead, but not scored as a prediction.
    fn load_ahead(&self, _layer: usize, _experts: &[usize]) {}

    /// Most experts worth requesting at once (a cache cannot hold more without thrashing).
    fn batch_limit(&self) -> usize {
        usize::MAX
    }

    /// The weights of `experts` of `layer` fetched for something other than computing with
    /// them (a benchmark's preload, a format probe): like [`ExpertSource::experts`], but not
    /// counted as uses in the learned hot set, so they do not skew the next session's.
    fn preload(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<ExpertWeights>>> {
        self.experts(layer, experts)
    }

    /// The learned hot set: at most `n` experts `(layer, expert)` most used in earlier
    /// sessions, most used first (ties by index). Empty for a source that keeps no history.
    /// The GPU backend fills a VRAM cache that cannot hold every expert with them.
    fn hot_experts(&self, _n: usize) -> Vec<(usize, usize)> {
        Vec::new()
    }

    /// Waits until the memory the source prepares in the background after load (a cache's
    /// buffers, touched page by page) is ready, and says what was prepared; `None` for a
    /// source that prepares nothing. A benchmark calls it before timing, as a served
    /// session's first prompt would find the memory ready after a few idle seconds.
    fn wait_prepared(&self) -> Option<buffers::Preparation> {
        None
    }
}
