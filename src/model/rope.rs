//! Rotary position embeddings: the YaRN inverse-frequency table and the rotate-half
//! application (NeoX style: the two contiguous halves of a head form the pairs).
//!
//! The table is computed in f32 in the same order of operations as Transformers'
//! `_compute_yarn_parameters`, so the frequencies match it to the last bit or two.

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{Error, Result};
use crate::system::{available_memory, gib};

/// Inverse frequencies (`head_dim / 2` of them) and the factor applied to cos and sin.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFrequencies {
    /// `inv_freq[i]` rotates pair `i` by `pos * inv_freq[i]` radians.
    pub inv_freq: Vec<f32>,
    /// Multiplies both cos and sin (YaRN's `attention_factor`; 1 for plain RoPE).
    pub attention_factor: f32,
}

/// YaRN's correction range: the (fractional) dimension indices where interpolation starts
/// and ends. Exposed for tests and diagnostics.
pub fn yarn_correction_range(
    dim: usize,
    base: f64,
    beta_fast: f64,
    beta_slow: f64,
    original_max: f64,
    truncate: bool,
) -> (f64, f64) {
    let correction_dim = |rotations: f64| {
        dim as f64 * (original_max / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let mut low = correction_dim(beta_fast);
    let mut high = correction_dim(beta_slow);
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

impl RopeFrequencies {
    /// The frequencies a model's config describes.
    pub fn from_config(cfg: &ModelConfig) -> Self {
        let dim = cfg.head_dim;
        let half = dim / 2;
        let base = cfg.rope_theta;
        // pos_freqs[i] = base^(2i/dim), as f32.
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = (2 * i) as f32 / dim as f32;
                (base.powf(exponent as f64)) as f32
            })
            .collect();
        match &cfg.rope_scaling {
            RopeScaling::None => RopeFrequencies {
                inv_freq: pos_freqs.iter().map(|&p| 1.0f32 / p).collect(),
                attention_factor: 1.0,
            },
            RopeScaling::Yarn(y) => {
                let factor = y.factor as f32;
                let (low, mut high) = yarn_correction_range(
                    dim,
                    base,
                    y.beta_fast,
                    y.beta_slow,
                    y.original_max_position_embeddings,
                    y.truncate,
                );
                if low == high {
                    high += 0.001; // as Transformers does, to avoid dividing by zero
                }
                let low32 = low as f32;
                let span32 = (high - low) as f32;
                let inv_freq = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let extrapolation = 1.0f32 / p;
                        let interpolation = 1.0f32 / (factor * p);
                        let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
                        let extrapolation_share = 1.0f32 - ramp;
                        interpolation * (1.0 - extrapolation_share) + extrapolation * extrapolation_share
                    })
                    .collect();
                let attention_factor = match y.attention_factor {
                    Some(a) => a as f32,
                    None if y.factor <= 1.0 => 1.0,
                    None => (0.1 * y.factor.ln() + 1.0) as f32,
                };
                RopeFrequencies { inv_freq, attention_factor }
            }
        }
    }

    /// Writes `cos` and `sin` (each `head_dim / 2`) for position `pos`, both already
    /// multiplied by the attention factor.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = f * p;
            *c = angle.cos() * self.attention_factor;
            *s = angle.sin() * self.attention_factor;
        }
    }

    /// The cos and sin of every position below `capacity`, each `[capacity, head_dim / 2]`
    /// row-major: row `p` is what [`RopeFrequencies::cos_sin`] writes for position `p`.
    /// Backends build it once, so that no token recomputes (or allocates) its rotation.
    /// The caller has checked that the tables fit in memory (see `engine`'s run checks);
    /// [`RopeFrequencies::try_table`] is the fallible form.
    pub fn table(&self, capacity: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = vec![0.0f32; capacity * half];
        let mut sin = vec![0.0f32; capacity * half];
        self.fill(&mut cos, &mut sin);
        (cos, sin)
    }

    /// [`RopeFrequencies::table`], allocated fallibly: a size that overflows or an
    /// allocation the machine refuses is an error naming `--ctx` and the bytes needed.
    pub fn try_table(&self, capacity: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let half = self.inv_freq.len();
        let too_big = || {
            let bytes = capacity
                .checked_mul(half)
                .and_then(|n| n.checked_mul(2 * std::mem::size_of::<f32>()))
                .map_or_else(|| "more than 2^64 bytes".to_string(), |b| gib(b as u64));
            Error::invalid(format!(
                "RoPE tables for --ctx {capacity} need {bytes}; this machine has {} available",
                available_memory().map_or_else(|| "an unknown amount of memory".to_string(), gib)
            ))
        };
        let n = capacity.checked_mul(half).ok_or_else(too_big)?;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        cos.try_reserve_exact(n).map_err(|_| too_big())?;
        sin.try_reserve_exact(n).map_err(|_| too_big())?;
        cos.resize(n, 0.0);
        sin.resize(n, 0.0);
        self.fill(&mut cos, &mut sin);
        Ok((cos, sin))
    }

    /// Writes row `p` of the tables for every row of `cos` and `sin`.
    fn fill(&self, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.inv_freq.len();
        if half > 0 {
            for (p, (c, s)) in cos.chunks_exact_mut(half).zip(sin.chunks_exact_mut(half)).enumerate() {
                self.cos_sin(p, c, s);
            }
        }
    }
}

/// Rotates one head vector in place: with `x1 = x[..half]`, `x2 = x[half..]`,
/// `x1' = x1 cos - x2 sin` and `x2' = x2 cos + x1 sin`.
pub fn rotate_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    debug_assert_eq!(cos.len(), half);
    let (x1, x2) = x.split_at_mut(half);
    for i in 0..half {
        let a = x1[i];
        let b = x2[i];
        x1[i] = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_correction_range() {
        // d = 64, theta = 150000, original context 4096, betas 32 and 1, no truncation.
        let (low, high) = yarn_correction_range(64, 150000.0, 32.0, 1.0, 4096.0, false);
        assert!((low - 8.093).abs() < 1e-3, "low {low}");
        assert!((high - 17.398).abs() < 1e-3, "high {high}");
        let (lt, ht) = yarn_correction_range(64, 150000.0, 32.0, 1.0, 4096.0, true);
        assert_eq!((lt, ht), (8.0, 18.0));
    }

    #[test]
    fn rotate_half_pairs_the_two_halves() {
        // Head of 4: pairs are (x0, x2) and (x1, x3), not (x0, x1).
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        let (c, s) = (0.6f32, 0.8f32);
        rotate_half(&mut x, &[c, 1.0], &[s, 0.0]);
        assert_eq!(x, [1.0 * c - 3.0 * s, 2.0, 3.0 * c + 1.0 * s, 4.0]);
        // A rotation preserves the norm when the attention factor is 1.
        let mut y = [0.3f32, -1.2, 0.7, 2.0];
        let n0: f32 = y.iter().map(|v| v * v).sum();
        let a = 1.234f32;
        rotate_half(&mut y, &[a.cos(), (2.0 * a).cos()], &[a.sin(), (2.0 * a).sin()]);
        let n1: f32 = y.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-5);
    }

    #[test]
    fn table_rows_are_cos_sin_of_their_position() {
        let f = RopeFrequencies { inv_freq: vec![1.0, 0.1, 0.003], attention_factor: 1.25 };
        let (cos, sin) = f.table(5);
        assert_eq!((cos.len(), sin.len()), (15, 15));
        assert_eq!(f.try_table(5).unwrap(), (cos.clone(), sin.clone()));
        let e = f.try_table(usize::MAX / 2).unwrap_err().to_string();
        assert!(e.contains("--ctx") && e.contains("need"), "{e}");
        for p in 0..5 {
            let (mut c, mut s) = ([0.0; 3], [0.0; 3]);
            f.cos_sin(p, &mut c, &mut s);
            assert_eq!(&cos[p * 3..(p + 1) * 3], &c);
            assert_eq!(&sin[p * 3..(p + 1) * 3], &s);
        }
    }

    #[test]
    fn position_zero_is_identity_up_to_attention_factor() {
        let f = RopeFrequencies { inv_freq: vec![1.0, 0.1], attention_factor: 1.5 };
        let (mut c, mut s) = ([0.0; 2], [0.0; 2]);
        f.cos_sin(0, &mut c, &mut s);
        assert_eq!(c, [1.5, 1.5]);
        assert_eq!(s, [0.0, 0.0]);
    }
}
