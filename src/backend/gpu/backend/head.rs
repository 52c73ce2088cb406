//! The greedy token on the device: argmax.wgsl over each row of logits, so a decoded
//! token reads back its ID (and a non-finite flag), not the vocabulary.

use crate::error::{Error, Result};

use super::super::buffers::{GpuAct, words};
use super::super::context::Bind;
use super::super::params::ArgmaxParams;
use super::super::shaders::Op;
use super::GpuBackend;

/// Logits one workgroup of the first stage scans, at least (more when the vocabulary would
/// need more than [`MAX_BLOCKS`] workgroups a row).
const SPAN: usize = 1024;
/// Most first-stage workgroups a row.
const MAX_BLOCKS: usize = 1024;

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
        let agree = self.agree.clone();
        let bytes = self.read_back(&[(result.buf(), 0, (rows * 8) as u64), (&agree, 0, 8)])?;
        let w = words(&bytes);
        self.stats.predicted_hits = w[rows * 2] as u64;
        self.stats.predicted_total = w[rows * 2 + 1] as u64;
        let mut out = Vec::with_capacity(rows);
        for r in 0..rows {
            let (token, bad) = (w[2 * r], w[2 * r + 1]);
            if bad != 0 || token as usize >= vocab {
                return Err(Error::tensor(
                    "logits",
                    format!(
                        "the model produced non-finite logits at position {}; its weights are likely corrupt or \
                         non-finite: run `picchio verify` on the model",
                        first_position + r
                    ),
                ));
            }
            out.push(token);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_vocabulary_within_the_grid_limit() {
        for vocab in [1, 1023, 1024, 1025, 201_088, 1 << 20, (1 << 20) + 1, 1 << 24] {
            let (span, blocks) = blocks_for(vocab);
            assert!(blocks <= MAX_BLOCKS && span * blocks >= vocab && span * (blocks - 1) < vocab, "{vocab}");
        }
    }
}
