//! Choosing the next token from logits: greedy, or sampling with temperature, top-k,
//! top-p, min-p and a repetition penalty, from a seeded generator so the same seed and
//! settings give the same tokens.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::constrain::TokenConstraint;
use crate::error::{Error, Result};
use crate::model::math::argmax_with_margin;

/// Sampling settings. The defaults are greedy decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1: no limit).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0: off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens (1: off).
    pub repetition_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repetition_window: usize,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_window: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks that every setting is in range; the error names the setting and value.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, v: f32, range: &str| {
            Err(Error::invalid(format!("{name} {v} is out of range ({range})")))
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", self.temperature, ">= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "0 < top_p <= 1");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "0..=1");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", self.repetition_penalty, "> 0");
        }
        Ok(())
    }
}

/// Picks tokens according to [`SamplingParams`], among those an optional
/// [`TokenConstraint`] allows.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch of [`Sampler::sample`], kept so that a token allocates nothing once these
    /// have grown to the vocabulary: the logits after the repetition penalty,
    penalized: Vec<f32>,
    /// the distinct tokens of the penalty window,
    seen: Vec<u32>,
    /// and the candidate (token, logit or probability) pairs.
    cand: Vec<(u32, f32)>,
    /// What restricts the tokens (a grammar), if anything,
    constraint: Option<Box<dyn TokenConstraint>>,
    /// and the logits with the tokens it forbids pushed to the lowest finite value.
    masked: Vec<f32>,
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler::greedy()
    }
}

impl Sampler {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Sampler::new(SamplingParams::default()).expect("defaults are valid")
    }

    /// A sampler with validated settings.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Sampler {
            params,
            rng,
            penalized: Vec::new(),
            seen: Vec::new(),
            cand: Vec::new(),
            constraint: None,
            masked: Vec::new(),
        })
    }

    /// The same sampler picking only tokens `constraint` allows.
    pub fn with_constraint(mut self, constraint: Box<dyn TokenConstraint>) -> Self {
        self.constraint = Some(constraint);
        self
    }

    /// The constraint, if any.
    pub fn constraint(&self) -> Option<&dyn TokenConstraint> {
        self.constraint.as_deref()
    }

    /// Tells the constraint (if any) that `token` was emitted, so it starts on the next
    /// mask while the caller runs the model. Call it with every token [`Sampler::sample`]
    /// returned, before the forward pass that consumes it.
    pub fn advance(&mut self, token: u32) {
        if let Some(c) = &mut self.constraint {
            c.advance(token);
        }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks a token from `logits`; `history` is the token sequence so far (for the
    /// repetition penalty; its last token is the one whose logits these are). Fails when
    /// the logits are empty or hold a NaN or an infinity: that is a model fault (corrupt or
    /// non-finite weights), and no token picked from them would mean anything.
    /// With a constraint, only a token it allows is returned; it fails when the constraint
    /// does (it broke, or allows nothing).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        check_finite(logits, history.len().saturating_sub(1))?;
        let Some(constraint) = self.constraint.as_mut() else {
            return Ok(self.pick(logits, history));
        };
        // Forbidden tokens get the lowest finite logit (not -inf: the steps below expect
        // finite values), which no softmax gives any weight next to an allowed one; a pick
        // that still lands on one (every allowed token as unlikely) takes the best allowed.
        let mask = constraint.mask()?;
        let mut masked = std::mem::take(&mut self.masked);
        masked.clear();
        masked.extend(
            logits.iter().enumerate().map(|(i, &l)| if mask.allows(i as u32) { l } else { f32::MIN }),
        );
        let mut token = self.pick(&masked, history);
        let mask = self.constraint.as_mut().map(|c| c.mask()).transpose()?;
        if let Some(mask) = mask
            && !mask.allows(token)
        {
            let best = (0..logits.len() as u32)
                .filter(|&t| mask.allows(t))
                .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]).then(b.cmp(&a)));
            token = best.ok_or_else(|| Error::Constraint("it allows no token of the model".into()))?;
        }
        self.masked = masked;
        Ok(token)
    }

    /// [`Sampler::sample`] on logits known to be finite and non-empty.
    fn pick(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let Sampler { params: p, rng, penalized, seen, cand, .. } = self;
        let logits = if p.repetition_penalty != 1.0 && !history.is_empty() {
            penalized.clear();
            penalized.extend_from_slice(logits);
            let start = history.len().saturating_sub(p.repetition_window);
            seen.clear();
            seen.extend_from_slice(&history[start..]);
            seen.sort_unstable();
            seen.dedup();
            for &t in seen.iter() {
                if let Some(v) = penalized.get_mut(t as usize) {
                    let scaled = if *v > 0.0 { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
                    // An extreme penalty must not turn a finite logit into an infinity
                    // (which would make the softmax NaN): saturate instead.
                    *v = scaled.clamp(f32::MIN, f32::MAX);
                }
            }
            &penalized[..]
        } else {
            logits
        };
        if p.temperature == 0.0 {
            return argmax_with_margin(logits).0 as u32;
        }
        // Candidates, most likely first where an order is needed.
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            cand.truncate(p.top_k);
        }
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0f64;
        for c in cand.iter_mut() {
            c.1 = ((c.1 - max) / p.temperature).exp();
            total += c.1 as f64;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / total) as f32;
        }
        if p.top_p < 1.0 {
            cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let mut cum = 0.0f32;
            let keep = cand
                .iter()
                .position(|c| {
                    cum += c.1;
                    cum >= p.top_p
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let top = cand.iter().map(|c| c.1).fold(0.0f32, f32::max);
            cand.retain(|c| c.1 >= p.min_p * top);
        }
        let mass: f64 = cand.iter().map(|c| c.1 as f64).sum();
        let mut r = rng.random::<f64>() * mass;
        for c in cand.iter() {
            r -= c.1 as f64;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }
}

/// Fails, naming `position` and the first bad logit, unless `logits` is non-empty and
/// every value is finite. One pass over the vocabulary.
pub fn check_finite(logits: &[f32], position: usize) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::tensor("logits", format!("the model produced no logits at position {position}")));
    }
    match logits.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::tensor(
            "logits",
            format!(
                "the model produced non-finite logits at position {position} (token {i}: {}); its weights are \
                 likely corrupt or non-finite: run `picchio verify` on the model",
                logits[i]
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, seed: 42, ..Default::default() }
    }

    #[test]
    fn temperature_zero_is_argmax() {
        let mut s = Sampler::new(params(0.0)).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 2.9], &[]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_other_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params(1.0) }).unwrap();
            (0..40).map(|_| s.sample(&logits, &[]).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_k_limits_choices() {
        let logits = [1.0f32, 5.0, 4.0, 3.0, -2.0];
        let mut s = Sampler::new(SamplingParams { top_k: 1, ..params(2.0) }).unwrap();
        assert!((0..20).all(|_| s.sample(&logits, &[]).unwrap() == 1));
        let mut s = Sampler::new(SamplingParams { top_k: 2, ..params(5.0) }).unwrap();
        let seen: std::collections::HashSet<u32> =
            (0..200).map(|_| s.sample(&logits, &[]).unwrap()).collect();
        assert_eq!(seen, [1u32, 2].into_iter().collect());
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // Probabilities at T=1: about 0.64, 0.24, 0.09, 0.03.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams { top_p: 0.8, ..params(1.0) }).unwrap();
        let seen: std::collections::HashSet<u32> =
            (0..300).map(|_| s.sample(&logits, &[]).unwrap()).collect();
        assert_eq!(seen, [0u32, 1].into_iter().collect());
        let mut s = Sampler::new(SamplingParams { min_p: 0.3, ..params(1.0) }).unwrap();
        let seen: std::collections::HashSet<u32> =
            (0..300).map(|_| s.sample(&logits, &[]).unwrap()).collect();
        assert_eq!(seen, [0u32, 1].into_iter().collect());
    }

    #[test]
    fn repetition_penalty_demotes_recent_tokens() {
        let logits = [2.0f32, 1.9, -1.0];
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.5, ..params(0.0) }).unwrap();
        assert_eq!(s.sample(&logits, &[0]).unwrap(), 1);
        assert_eq!(s.sample(&logits, &[2]).unwrap(), 0);
        // Outside the window it no longer applies.
        let mut s =
            Sampler::new(SamplingParams { repetition_penalty: 1.5, repetition_window: 1, ..params(0.0) })
                .unwrap();
        assert_eq!(s.sample(&logits, &[0, 2]).unwrap(), 0);
    }

    #[test]
    fn out_of_range_settings_are_named() {
        for (p, name) in [
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: 2.0, ..Default::default() }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
        ] {
            assert!(Sampler::new(p).unwrap_err().to_string().contains(name));
        }
    }

    #[test]
    fn non_finite_logits_are_an_error_naming_the_position() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for temperature in [0.0, 1.0] {
                let mut s = Sampler::new(params(temperature)).unwrap();
                let e = s.sample(&[0.5, bad, 0.25], &[7, 8, 9]).unwrap_err().to_string();
                assert!(e.contains("non-finite logits at position 2"), "{e}");
                assert!(e.contains("token 1") && e.contains("picchio verify"), "{e}");
            }
        }
        let mut s = Sampler::greedy();
        assert!(s.sample(&[], &[]).unwrap_err().to_string().contains("no logits"));
        // An extreme penalty saturates instead of producing an infinity.
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1e-30, ..params(1.0) }).unwrap();
        assert_eq!(s.sample(&[1e30, -1.0], &[0]).unwrap(), 0);
        // The sampler still works afterwards.
        assert_eq!(s.sample(&[0.0, 1.0], &[]).unwrap(), 1);
    }
}
