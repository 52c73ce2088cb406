//! A sampling step planned before the forward pass that computes its logits: the sparse
//! adjustments (bias and penalties) the sampler will apply, the draw rule, the random
//! number the draw will use, and how many candidates decide it. A runner carries the plan
//! to where the logits are (a GPU adjusts and reduces them there, reading back kilobytes)
//! and hands back [`PlannedLogits`]; [`crate::sample::Sampler::finish`] picks the token.

use super::choose::{Candidates, DrawRule, LogitStats, choose};

/// Candidates a plan asks for by default when drawing at a temperature without top-k: the
/// draw needs the full logits only when it lands beyond these (their probability mass is
/// usually well above 90%).
pub const DEFAULT_CANDIDATES: usize = 256;

/// The largest candidate set a device reduces; a plan asking for more (a top-k above it)
/// takes the full logits.
pub const MAX_DEVICE_CANDIDATES: usize = 512;

/// The change of one token's logit: `l + add`, then multiplied by `scale_positive` or
/// `scale_negative` by its sign (the repetition penalty), then `- subtract_once` (the
/// presence penalty) and `- subtract_counted` (the frequency penalty times the count),
/// each step saturating at the largest finite magnitude. A non-finite logit is left as it
/// is (so it is still reported as a model fault). Devices apply the same steps
/// (`shaders/logits_adjust.wgsl`); every step is one correctly rounded f32 operation, so
/// both sides get the same bits.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct LogitAdjust {
    /// The token.
    pub token: u32,
    /// Its logit bias (several biases of one token summed in their order).
    pub add: f32,
    /// Factor of a positive logit (1 / the repetition penalty, or 1).
    pub scale_positive: f32,
    /// Factor of a negative logit (the repetition penalty, or 1).
    pub scale_negative: f32,
    /// The presence penalty where the token was picked before (else 0).
    pub subtract_once: f32,
    /// The frequency penalty times the times it was picked (else 0).
    pub subtract_counted: f32,
}

impl LogitAdjust {
    /// An adjustment of `token` that changes nothing yet.
    pub fn identity(token: u32) -> Self {
        LogitAdjust {
            token,
            add: 0.0,
            scale_positive: 1.0,
            scale_negative: 1.0,
            subtract_once: 0.0,
            subtract_counted: 0.0,
        }
    }

    /// The adjusted logit.
    pub fn apply(&self, v: f32) -> f32 {
        if !v.is_finite() {
            return v;
        }
        let finite = |x: f32| x.clamp(f32::MIN, f32::MAX);
        let v = finite(v + self.add);
        let v = finite(if v > 0.0 { v * self.scale_positive } else { v * self.scale_negative });
        let v = finite(v - self.subtract_once);
        finite(v - self.subtract_counted)
    }

    /// The six words a device reads (token, then the five factors' bits).
    pub fn words(&self) -> [u32; 6] {
        [
            self.token,
            self.add.to_bits(),
            self.scale_positive.to_bits(),
            self.scale_negative.to_bits(),
            self.subtract_once.to_bits(),
            self.subtract_counted.to_bits(),
        ]
    }
}

/// One planned sampling step ([`crate::sample::Sampler::plan`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplePlan {
    /// Per-token adjustments, one per distinct token, by token ID.
    pub adjust: Vec<LogitAdjust>,
    /// How the token is drawn.
    pub rule: DrawRule,
    /// The uniform number of the draw (unused when greedy).
    pub u: f64,
    /// Alternatives whose log probabilities are reported, if asked.
    pub logprobs: Option<usize>,
    /// The most likely tokens a reduction returns: enough for top-k, the log
    /// probabilities, and usually the draw.
    pub candidates: usize,
    /// The position whose logits these are (for error messages).
    pub position: usize,
}

impl SamplePlan {
    /// Applies the adjustments to a row of logits on the host.
    pub fn adjust_logits(&self, logits: &mut [f32]) {
        for a in &self.adjust {
            if let Some(v) = logits.get_mut(a.token as usize) {
                *v = a.apply(*v);
            }
        }
    }

    /// Whether a device should reduce the logits to candidates (it would read the whole
    /// vocabulary otherwise: a top-k above [`MAX_DEVICE_CANDIDATES`]).
    pub fn reducible(&self) -> bool {
        (1..=MAX_DEVICE_CANDIDATES).contains(&self.candidates)
    }

    /// Whether the statistics this plan needs are what `stats` holds (log partition
    /// function when log probabilities are asked).
    fn stats_suffice(&self, stats: &LogitStats) -> bool {
        self.logprobs.is_none() || stats.log_partition.is_some()
    }

    /// Whether `c` decides this step: the draw lands within its candidates, and they hold
    /// the alternatives the log probabilities report.
    pub fn decides(&self, c: &Candidates) -> bool {
        let enough = c.ranked.len() >= self.logprobs.unwrap_or(0).min(c.stats.vocab);
        enough && self.stats_suffice(&c.stats) && choose(&self.rule, self.u, &c.ranked, &c.stats).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_adjustment_changes_nothing_and_steps_saturate() {
        let id = LogitAdjust::identity(3);
        for v in [1.5f32, -2.25, 0.0, f32::MAX, f32::MIN, f32::NAN, f32::INFINITY] {
            let got = id.apply(v);
            assert!(got.to_bits() == v.to_bits() || (v == 0.0 && got == 0.0), "{v} -> {got}");
        }
        let big = LogitAdjust { add: 100.0, scale_positive: 1e30, ..LogitAdjust::identity(0) };
        assert_eq!(big.apply(1e30), f32::MAX);
        let pen = LogitAdjust { scale_positive: 0.5, scale_negative: 2.0, ..LogitAdjust::identity(0) };
        assert_eq!((pen.apply(3.0), pen.apply(-3.0)), (1.5, -6.0));
        let sub = LogitAdjust { subtract_once: 0.5, subtract_counted: 0.75, ..LogitAdjust::identity(0) };
        assert_eq!(sub.apply(2.0), 0.75);
    }
}
