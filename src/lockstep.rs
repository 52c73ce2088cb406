//! `--verify`: a runner that runs the CPU oracle in lockstep with another runner (the GPU)
//! and stops at the first position whose top-1 token differs, reporting the position, both
//! tokens, both top-1/top-2 margins and the largest logit difference there.

use crate::ModelConfig;
use crate::engine::Runner;
use crate::error::{Error, Result};
use crate::experts::ExpertStats;
use crate::model::forward::PhaseTimes;
use crate::model::math::argmax_with_margin;
use crate::model::{LogitRows, NoObserver, Observer};

/// Runs `primary` and the CPU `oracle` on every position and compares their top-1.
pub struct LockstepRunner {
    primary: Box<dyn Runner>,
    oracle: Box<dyn Runner>,
    positions: u64,
    max_diff: f32,
    min_margin: f32,
}

impl LockstepRunner {
    /// Wraps `primary` with `oracle` (a fresh runner of the same model).
    pub fn new(primary: Box<dyn Runner>, oracle: Box<dyn Runner>) -> Self {
        LockstepRunner { primary, oracle, positions: 0, max_diff: 0.0, min_margin: f32::INFINITY }
    }

    /// Positions compared so far.
    pub fn positions(&self) -> u64 {
        self.positions
    }

    /// Largest |logit difference| seen so far.
    pub fn max_logit_diff(&self) -> f32 {
        self.max_diff
    }
}

impl Runner for LockstepRunner {
    fn config(&self) -> &ModelConfig {
        self.primary.config()
    }

    fn capacity(&self) -> usize {
        self.primary.capacity().min(self.oracle.capacity())
    }

    fn describe(&self) -> String {
        format!("{} (verified against the CPU oracle)", self.primary.describe())
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        // Every position is compared, including those whose logits the caller does not need.
        let a = self.primary.forward(ids, start_pos, LogitRows::All, observer)?;
        let b = self.oracle.forward(ids, start_pos, LogitRows::All, &mut NoObserver)?;
        let vocab = self.config().vocab_size;
        for (r, (ra, rb)) in a.chunks(vocab).zip(b.chunks(vocab)).enumerate() {
            let diff = ra.iter().zip(rb).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            self.max_diff = self.max_diff.max(diff);
            let (ta, _, ma) = argmax_with_margin(ra);
            let (tb, _, mb) = argmax_with_margin(rb);
            if ta != tb {
                return Err(Error::Backend(format!(
                    "--verify: top-1 differs at position {}: {} gives token {ta} (top-1/top-2 margin {ma:.3e}), the CPU oracle token {tb} (margin {mb:.3e}); max |logit difference| at that position {diff:.3e}",
                    start_pos + r,
                    self.primary.describe(),
                )));
            }
            self.min_margin = self.min_margin.min(mb);
        }
        self.positions += ids.len() as u64;
        Ok(match rows {
            LogitRows::All => a,
            LogitRows::Last => a[a.len() - vocab..].to_vec(),
            LogitRows::None => Vec::new(),
        })
    }

    fn prefill_block(&self) -> usize {
        self.primary.prefill_block().min(self.oracle.prefill_block())
    }

    fn times(&self) -> PhaseTimes {
        self.primary.times()
    }

    fn expert_stats(&self) -> ExpertStats {
        self.primary.expert_stats()
    }

    fn decode_counters(&self) -> Option<crate::backend::DecodeCounters> {
        self.primary.decode_counters()
    }

    fn report(&self) -> Vec<String> {
        let mut lines = self.primary.report();
        lines.push(format!(
            "verify: top-1 identical to the CPU oracle at all {} positions; max |logit difference| {:.3e}; smallest oracle top-1/top-2 margin {:.3e}",
            self.positions,
            self.max_diff,
            if self.min_margin.is_finite() { self.min_margin } else { 0.0 }
        ));
        lines
    }
}
