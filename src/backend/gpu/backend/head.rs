//! Picking tokens on the device, so a decoded token reads back bytes, not the vocabulary:
//! the greedy token (argmax.wgsl over each row of logits: its ID and a non-finite flag),
//! and a sampler's planned pick (logits_adjust.wgsl applies the bias and penalties,
//! logits_topk.wgsl ranks the candidates and sums the row's statistics: a few kilobytes).

use crate::error::{Error, Result};
use crate::sample::{Candidates, LogitStats, MAX_DEVICE_CANDIDATES, PlannedLogits, SamplePlan};

use super::super::buffers::{GpuAct, floats, words};
use super::super::context::Bind;
use super::super::params::{ArgmaxParams, LogitsAdjustParams, LogitsTopkParams};
use super::super::shaders::Op;
use super::GpuBackend;

/// Logits one workgroup of the first stage scans, at least (more when the vocabulary would
/// need more than [`MAX_BLOCKS`] workgroups a row).
const SPAN: usize = 1024;
/// Most first-stage workgroups a row.
const MAX_BLOCKS: usize = 1024;

/// Entries one workgroup of logits_topk.wgsl ranks (its `CHUNK`).
const TOPK_CHUNK: usize = 1024;

/// The error of a row of logits holding a NaN or an infinity, as the sampler words it.
fn non_finite(position: usize) -> Error {
    Error::tensor(
        "logits",
        format!(
            "the model produced non-finite logits at position {position}; its weights are likely corrupt or \
             non-finite: run `picchio verify` on the model"
        ),
    )
}

/// The f32 value of a logits_topk.wgsl ranking key (the inverse of its `order_key`).
fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 { key ^ 0x8000_0000 } else { !key })
}

/// Workgroup span and count per row for a vocabulary of `vocab`.
fn blocks_for(vocab: usize) -> (usize, usize) {
    let span = SPAN.max(vocab.div_ceil(MAX_BLOCKS));
    (span, vocab.div_ceil(span).max(1))
}

impl GpuBackend {
    /// The argmax of every row of `logits` in two dispatches and one readback of 8 bytes a
    /// row (plus the prediction counters that ride along with every readback).
    pub(super) fn run_argmax(&mut self, logits: &GpuAct, first_position: usize) -> Result<Vec<u32>> {
        let (rows, vocab) = (logits.rows(), logits.width());
        if rows == 0 || vocab == 0 {
            return Err(Error::tensor("logits", format!("no logits to pick from ([{rows}, {vocab}])")));
        }
        let (span, blocks) = blocks_for(vocab);
        if rows > self.gpu.max_groups as usize || blocks > self.gpu.max_groups as usize {
            return Err(Error::Backend(format!("argmax of [{rows}, {vocab}] exceeds the device's grid")));
        }
        let partial = self.scratch((rows * blocks * 3 * 4) as u64)?;
        let result = self.scratch((rows * 2 * 4) as u64)?;
        let v = self.variant(Op::Argmax);
        let binds = [logits.bind(), Bind::whole(partial.buf()), Bind::whole(result.buf())];
        for (stage, groups) in [(0u32, blocks as u32), (1, 1)] {
            let params = ArgmaxParams {
                stage,
                vocab: vocab as u32,
                rows: rows as u32,
                span: span as u32,
                blocks: blocks as u32,
                _pad: [0; 3],
            };
            self.gpu.dispatch(Op::Argmax, v, &params, &binds, (groups, rows as u32, 1))?;
        }
        let bytes = self.read_back_with_counters(&[(result.buf(), 0, (rows * 8) as u64)])?;
        let w = words(&bytes);
        let mut out = Vec::with_capacity(rows);
        for r in 0..rows {
            let (token, bad) = (w[2 * r], w[2 * r + 1]);
            if bad != 0 || token as usize >= vocab {
                return Err(non_finite(first_position + r));
            }
            out.push(token);
        }
        Ok(out)
    }
}

impl GpuBackend {
    /// Row `row` of `logits` adjusted and reduced as `plan` asks
    /// ([`crate::backend::Backend::reduce_logits`]): the bias and penalties applied in
    /// place, then the plan's candidates ranked in rounds of logits_topk.wgsl, read back
    /// with the per-workgroup statistics in one readback (`8 k + 16 ceil(vocab / 1024)`
    /// bytes, and the device counters). When they do not decide the pick ([`SamplePlan::decides`]: the draw lands
    /// beyond them), the adjusted row is read in full.
    pub(super) fn run_reduce(
        &mut self,
        logits: &GpuAct,
        row: usize,
        plan: &SamplePlan,
    ) -> Result<PlannedLogits> {
        let (rows, vocab) = (logits.rows(), logits.width());
        if row >= rows || vocab == 0 {
            return Err(Error::tensor(
                "logits",
                format!("no row {row} of logits to pick from ([{rows}, {vocab}])"),
            ));
        }
        if !plan.adjust.is_empty() {
            self.adjust_logits(logits, row, plan)?;
        }
        if !plan.reducible() {
            return self.read_row(logits, row);
        }
        let k = plan.candidates.min(MAX_DEVICE_CANDIDATES);
        let chunks = vocab.div_ceil(TOPK_CHUNK);
        if chunks > self.gpu.max_groups as usize {
            return Err(Error::Backend(format!("ranking {vocab} logits exceeds the device's grid")));
        }
        let entries = (chunks * k * 8) as u64;
        let stats = self.scratch((chunks * 16) as u64)?;
        let pingpong = [self.scratch(entries)?, self.scratch(entries)?];
        let temperature = if plan.rule.is_greedy() { 1.0f32 } else { plan.rule.temperature };
        let v = self.variant(Op::LogitsTopk);
        let (mut n, mut stage) = (vocab, 0usize);
        loop {
            let groups = n.div_ceil(TOPK_CHUNK);
            let (src, dst) = (&pingpong[(stage + 1) % 2], &pingpong[stage % 2]);
            let params = LogitsTopkParams {
                stage: stage as u32,
                n: n as u32,
                k: k as u32,
                temperature,
                row_offset: (row * vocab) as u32,
                _pad: [0; 3],
            };
            let binds =
                [logits.bind(), Bind::whole(src.buf()), Bind::whole(dst.buf()), Bind::whole(stats.buf())];
            self.gpu.dispatch(Op::LogitsTopk, v, &params, &binds, (groups as u32, 1, 1))?;
            n = groups * k;
            stage += 1;
            if groups == 1 {
                break;
            }
        }
        let answer = &pingpong[(stage - 1) % 2];
        let bytes = self.read_back_with_counters(&[
            (answer.buf(), 0, (k * 8) as u64),
            (stats.buf(), 0, (chunks * 16) as u64),
        ])?;
        let w = words(&bytes);
        let (ranked_words, part_words) = w.split_at(k * 2);
        if part_words.chunks_exact(4).any(|p| p[3] != 0) {
            return Err(non_finite(plan.position));
        }
        let parts: Vec<(f32, f32, f32)> = part_words
            .chunks_exact(4)
            .map(|p| (f32::from_bits(p[0]), f32::from_bits(p[1]), f32::from_bits(p[2])))
            .collect();
        let ranked: Vec<(u32, f32)> = ranked_words
            .chunks_exact(2)
            .filter(|e| (e[1] as usize) < vocab)
            .map(|e| (e[1], key_value(e[0])))
            .collect();
        let stats = LogitStats::merge(vocab, &plan.rule, plan.logprobs.is_some(), &parts);
        let candidates = Candidates { ranked, stats };
        if plan.decides(&candidates) {
            self.stats.sampled_from_candidates += 1;
            return Ok(PlannedLogits::Candidates(candidates));
        }
        self.read_row(logits, row)
    }

    /// Applies `plan`'s bias and penalties to row `row` of `logits` in place.
    fn adjust_logits(&mut self, logits: &GpuAct, row: usize, plan: &SamplePlan) -> Result<()> {
        let table: Vec<u32> = plan.adjust.iter().flat_map(|a| a.words()).collect();
        let buf = self.scratch((table.len() * 4) as u64)?;
        self.gpu.stage(bytemuck::cast_slice(&table), buf.buf(), 0)?;
        let count = plan.adjust.len();
        let (nx, ny) = self.gpu.grid(count.div_ceil(64) as u64)?;
        let params = LogitsAdjustParams {
            count: count as u32,
            vocab: logits.width() as u32,
            row_offset: (row * logits.width()) as u32,
            nx,
        };
        let v = self.variant(Op::LogitsAdjust);
        self.gpu.dispatch(Op::LogitsAdjust, v, &params, &[logits.bind(), Bind::whole(buf.buf())], (nx, ny, 1))
    }

    /// Reads row `row` of `logits` (already adjusted) in full.
    fn read_row(&mut self, logits: &GpuAct, row: usize) -> Result<PlannedLogits> {
        let vocab = logits.width();
        let bytes = (vocab * 4) as u64;
        let read = self.read_back_with_counters(&[(logits.buf(), row as u64 * bytes, bytes)])?;
        self.stats.sampled_from_logits += 1;
        Ok(PlannedLogits::Full(floats(&read)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranking_keys_decode_to_their_values() {
        // The host twin of logits_topk.wgsl's order_key.
        let order_key = |v: f32| {
            let b = if v == 0.0 { 0 } else { v.to_bits() };
            if b & 0x8000_0000 != 0 { !b } else { b ^ 0x8000_0000 }
        };
        let values = [f32::MIN, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.25, f32::MAX];
        for w in values.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{w:?}");
        }
        for v in values {
            assert_eq!(key_value(order_key(v)), if v == 0.0 { 0.0 } else { v });
        }
    }

    #[test]
    fn blocks_cover_the_vocabulary_within_the_grid_limit() {
        for vocab in [1, 1023, 1024, 1025, 201_088, 1 << 20, (1 << 20) + 1, 1 << 24] {
            let (span, blocks) = blocks_for(vocab);
            assert!(blocks <= MAX_BLOCKS && span * blocks >= vocab && span * (blocks - 1) < vocab, "{vocab}");
        }
    }
}
