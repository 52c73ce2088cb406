//! Choosing the next token from logits: greedy, or sampling with temperature, top-k,
//! top-p, min-p and a repetition penalty, from a seeded generator so the same seed and
//! settings give the same tokens. Before any of that the logits can be shifted by a
//! per-token bias and by OpenAI's presence and frequency penalties, and the log
//! probabilities of the distribution the model then gives can be reported with the token.
//!
//! Every pick follows one rule ([`choose`]): the tokens ranked by logit, the kept ones a
//! prefix of that ranking, the draw walking it in order. So a pick can be planned before
//! the forward pass ([`Sampler::plan`]) and decided where the logits are: a GPU applies the
//! plan's bias and penalties, ranks a few hundred candidates and reads back kilobytes
//! ([`crate::engine::Runner::forward_pick`]), and [`Sampler::finish`] picks the token the
//! full logits would have given.

mod choose;
mod plan;

use std::collections::{BTreeMap, HashMap};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::constrain::TokenConstraint;
use crate::error::{Error, Result};
use crate::model::math::argmax_with_margin;

pub use choose::{
    Candidates, DrawRule, LogitStats, PlannedLogits, check_ranking, choose, rank, ranks_before,
};
pub use plan::{DEFAULT_CANDIDATES, LogitAdjust, MAX_DEVICE_CANDIDATES, SamplePlan};

/// The most alternatives [`SamplingParams::logprobs`] may ask for (OpenAI's `top_logprobs`
/// limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The largest magnitude of a [`SamplingParams::logit_bias`] value (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// The largest magnitude of the presence and frequency penalties (OpenAI's range).
pub const MAX_PRESENCE_FREQUENCY: f32 = 2.0;

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
    /// Divide positive (multiply negative) logits of recently seen tokens (1: off). A
    /// positive logit is multiplied by `1 / penalty` (one rounding, the same on every
    /// backend; [`LogitAdjust`]).
    pub repetition_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repetition_window: usize,
    /// Seed of the random generator.
    pub seed: u64,
    /// Added to the logit of each listed token before the penalties (OpenAI's
    /// `logit_bias`: -100 all but forbids a token, +100 all but forces it). Each value is
    /// in `-100..=100`; a token listed twice gets both.
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted once from the logit of every token this sampler has already picked
    /// (OpenAI's `presence_penalty`, -2..=2; 0: off).
    pub presence_penalty: f32,
    /// Subtracted from the logit of every token this sampler has picked, once per time it
    /// was picked (OpenAI's `frequency_penalty`, -2..=2; 0: off).
    pub frequency_penalty: f32,
    /// Report the log probability of each picked token and of this many most likely
    /// alternatives (0..=[`MAX_TOP_LOGPROBS`]); `None`: report nothing (and compute
    /// nothing).
    pub logprobs: Option<usize>,
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
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Checks that every setting is in range; the error names the setting and value.
    /// Token IDs of `logit_bias` are checked against a vocabulary by
    /// [`SamplingParams::validate_for_vocab`].
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
        let penalty_range = -MAX_PRESENCE_FREQUENCY..=MAX_PRESENCE_FREQUENCY;
        if !penalty_range.contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "-2..=2");
        }
        if !penalty_range.contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "-2..=2");
        }
        if let Some(&(token, v)) =
            self.logit_bias.iter().find(|(_, v)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(v))
        {
            return bad(&format!("logit_bias of token {token}"), v, "-100..=100");
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(Error::invalid(format!(
                "logprobs asks for {n} alternatives, more than {MAX_TOP_LOGPROBS}"
            )));
        }
        Ok(())
    }

    /// [`SamplingParams::validate`], and that every token of `logit_bias` lies in a
    /// vocabulary of `vocab` tokens (the error names the first that does not).
    pub fn validate_for_vocab(&self, vocab: usize) -> Result<()> {
        self.validate()?;
        match self.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            Some((t, _)) => Err(Error::invalid(format!(
                "logit_bias names token {t}, outside the vocabulary (0..{vocab})"
            ))),
            None => Ok(()),
        }
    }

    /// Whether the presence or frequency penalty is on (so picked tokens must be counted).
    fn counts_tokens(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// A picked token, with its log probabilities when [`SamplingParams::logprobs`] asks.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Its log probability and the most likely alternatives; `None` unless asked for.
    pub logprobs: Option<TokenLogprobs>,
}

impl Sampled {
    /// A token without log probabilities.
    pub fn token(token: u32) -> Self {
        Sampled { token, logprobs: None }
    }
}

/// Log probabilities at one position: the log-softmax of the logits after the bias and the
/// penalties, before temperature, top-k, top-p and min-p (the model's distribution as the
/// settings shifted it, not the truncated one the token was drawn from).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The picked token's log probability.
    pub logprob: f32,
    /// The most likely tokens with their log probabilities, most likely first (ties by
    /// token ID); as many as [`SamplingParams::logprobs`] asked for (fewer only when the
    /// vocabulary is smaller).
    pub top: Vec<(u32, f32)>,
}

/// Picks tokens according to [`SamplingParams`], among those an optional
/// [`TokenConstraint`] allows.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch of [`Sampler::sample`], kept so that a token allocates nothing once these
    /// have grown to the vocabulary: the logits after the bias and the penalties,
    penalized: Vec<f32>,
    /// and the ranked candidate (token, logit) pairs.
    cand: Vec<(u32, f32)>,
    /// How often each token was picked, for the presence and frequency penalties (empty
    /// when both are off).
    picked: HashMap<u32, u32>,
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
            cand: Vec::new(),
            picked: HashMap::new(),
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

    /// True when this sampler picks the argmax of the model's logits as they are: greedy,
    /// no bias or penalty, no log probabilities, no constraint. A runner may then find the
    /// argmax where the logits are ([`crate::engine::Runner::forward_pick`]: on a GPU,
    /// only the token ID is read back) and the sampler is not asked.
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0
            && p.repetition_penalty == 1.0
            && p.logit_bias.is_empty()
            && !p.counts_tokens()
            && p.logprobs.is_none()
            && self.constraint.is_none()
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
        self.sample_with_logprobs(logits, history).map(|s| s.token)
    }

    /// [`Sampler::sample`], returning the token with its log probabilities when the
    /// settings ask for them ([`SamplingParams::logprobs`]; otherwise nothing is computed
    /// or allocated for them). The presence and frequency penalties count the tokens
    /// picked here: one sampler per turn penalizes that turn's tokens.
    pub fn sample_with_logprobs(&mut self, logits: &[f32], history: &[u32]) -> Result<Sampled> {
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
        let mut sampled = self.pick(&masked, history);
        let mask = self.constraint.as_mut().map(|c| c.mask()).transpose()?;
        if let Some(mask) = mask
            && !mask.allows(sampled.token)
        {
            let best = (0..logits.len() as u32)
                .filter(|&t| mask.allows(t))
                .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]).then(b.cmp(&a)));
            let token = best.ok_or_else(|| Error::Constraint("it allows no token of the model".into()))?;
            // The penalties count the token actually emitted; the log probabilities of the
            // rejected pick say nothing about it, so none are reported for this step.
            if let Some(c) = self.picked.get_mut(&sampled.token) {
                *c -= 1;
                if *c == 0 {
                    self.picked.remove(&sampled.token);
                }
                *self.picked.entry(token).or_insert(0) += 1;
            }
            sampled = Sampled { token, logprobs: None };
        }
        self.masked = masked;
        Ok(sampled)
    }

    /// [`Sampler::sample_with_logprobs`] on logits known to be finite and non-empty.
    fn pick(&mut self, logits: &[f32], history: &[u32]) -> Sampled {
        let plan = self.plan_unconstrained(history, &[]);
        let sampled = if plan.adjust.is_empty() {
            self.choose_full(&plan, logits)
        } else {
            let mut adjusted = std::mem::take(&mut self.penalized);
            adjusted.clear();
            adjusted.extend_from_slice(logits);
            plan.adjust_logits(&mut adjusted);
            let sampled = self.choose_full(&plan, &adjusted);
            self.penalized = adjusted;
            sampled
        };
        self.count(sampled.token);
        sampled
    }

    /// Plans the next pick before the forward pass that computes its logits: `history`
    /// followed by `then` is the token sequence those logits will follow (the repetition
    /// penalty's window). Draws the step's random number now, so a plan must be finished
    /// ([`Sampler::finish`]) for the picks to follow the seed. `None` with a constraint: a
    /// grammar's mask needs the full logits ([`Sampler::sample_with_logprobs`]).
    pub fn plan(&mut self, history: &[u32], then: &[u32]) -> Option<SamplePlan> {
        if self.constraint.is_some() {
            return None;
        }
        Some(self.plan_unconstrained(history, then))
    }

    /// [`Sampler::plan`] regardless of a constraint.
    fn plan_unconstrained(&mut self, history: &[u32], then: &[u32]) -> SamplePlan {
        let p = &self.params;
        let rule = DrawRule { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p };
        let u = if rule.is_greedy() { 0.0 } else { self.rng.random::<f64>() };
        // vLLM's order: the bias, then the penalties; one entry per distinct token.
        let mut adjust: BTreeMap<u32, LogitAdjust> = BTreeMap::new();
        for &(t, b) in &p.logit_bias {
            let a = adjust.entry(t).or_insert_with(|| LogitAdjust::identity(t));
            a.add += b;
        }
        if p.repetition_penalty != 1.0 {
            let total = history.len() + then.len();
            let recent = history.iter().chain(then).skip(total.saturating_sub(p.repetition_window));
            for &t in recent {
                let a = adjust.entry(t).or_insert_with(|| LogitAdjust::identity(t));
                a.scale_positive = 1.0 / p.repetition_penalty;
                a.scale_negative = p.repetition_penalty;
            }
        }
        for (&t, &c) in &self.picked {
            let a = adjust.entry(t).or_insert_with(|| LogitAdjust::identity(t));
            a.subtract_once = p.presence_penalty;
            a.subtract_counted = c as f32 * p.frequency_penalty;
        }
        let wanted = p.logprobs.unwrap_or(0).max(1);
        let candidates = if rule.is_greedy() {
            wanted
        } else if rule.top_k > 0 {
            rule.top_k.max(wanted)
        } else {
            DEFAULT_CANDIDATES.max(wanted)
        };
        SamplePlan {
            adjust: adjust.into_values().collect(),
            rule,
            u,
            logprobs: p.logprobs,
            candidates,
            position: (history.len() + then.len()).saturating_sub(1),
        }
    }

    /// Picks the token of a planned step from what the runner handed back
    /// ([`crate::engine::Runner::forward_pick`]): the token [`Sampler::sample_with_logprobs`]
    /// would pick from the same (adjusted) logits, with the same seed. Fails on non-finite
    /// logits as it does.
    pub fn finish(&mut self, plan: &SamplePlan, logits: &PlannedLogits) -> Result<Sampled> {
        let sampled = match logits {
            PlannedLogits::Full(values) => {
                check_finite(values, plan.position)?;
                self.choose_full(plan, values)
            }
            PlannedLogits::Candidates(c) => {
                check_ranking(&c.ranked, c.stats.vocab)?;
                let token = choose(&plan.rule, plan.u, &c.ranked, &c.stats)
                    .ok_or_else(|| Error::Backend("the device's candidates do not decide the draw".into()))?;
                let logit = c.ranked.iter().find(|r| r.0 == token).map_or(f32::NEG_INFINITY, |r| r.1);
                let logprobs = plan.logprobs.map(|n| report(logit, &c.ranked, n, c.stats.log_partition));
                Sampled { token, logprobs }
            }
        };
        self.count(sampled.token);
        Ok(sampled)
    }

    /// The pick of `plan` from the whole vocabulary's adjusted `logits` (finite, non-empty).
    fn choose_full(&mut self, plan: &SamplePlan, logits: &[f32]) -> Sampled {
        let rule = &plan.rule;
        if rule.is_greedy() && plan.logprobs.is_none() {
            return Sampled::token(argmax_with_margin(logits).0 as u32);
        }
        let stats = LogitStats::of(logits, rule, plan.logprobs.is_some());
        let ranked = &mut self.cand;
        // Rank as few tokens as decide the draw: the plan's candidates, then 16 times as
        // many while that is short of the vocabulary, then all of it (which always decides).
        let mut n = plan.candidates.max(1);
        let token = loop {
            rank(logits, n, ranked);
            if let Some(t) = choose(rule, plan.u, ranked, &stats) {
                break t;
            }
            if n >= logits.len() {
                break ranked[ranked.len() - 1].0;
            }
            n = n.saturating_mul(16).min(logits.len());
        };
        let logit = logits.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
        let logprobs = plan.logprobs.map(|n| report(logit, ranked, n, stats.log_partition));
        Sampled { token, logprobs }
    }

    /// Counts a picked token for the presence and frequency penalties.
    fn count(&mut self, token: u32) {
        if self.params.counts_tokens() {
            *self.picked.entry(token).or_insert(0) += 1;
        }
    }
}

/// The log probabilities of a pick: the picked token's (its logit `logit`) and the first `n` of
/// `ranked`, against the log partition function `log_z` (always there when log
/// probabilities were asked for).
fn report(logit: f32, ranked: &[(u32, f32)], n: usize, log_z: Option<f64>) -> TokenLogprobs {
    let log_z = log_z.unwrap_or(f64::INFINITY);
    let logprob = |l: f32| (f64::from(l) - log_z) as f32;
    TokenLogprobs {
        logprob: logprob(logit),
        top: ranked.iter().take(n).map(|&(t, l)| (t, logprob(l))).collect(),
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
            (SamplingParams { presence_penalty: 2.5, ..Default::default() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: f32::NAN, ..Default::default() }, "frequency_penalty"),
            (SamplingParams { logit_bias: vec![(3, 100.5)], ..Default::default() }, "logit_bias of token 3"),
            (SamplingParams { logprobs: Some(21), ..Default::default() }, "logprobs"),
        ] {
            assert!(Sampler::new(p).unwrap_err().to_string().contains(name), "{name}");
        }
        let p = SamplingParams { logit_bias: vec![(1, 5.0), (7, -5.0)], ..Default::default() };
        assert!(p.validate_for_vocab(8).is_ok());
        let e = p.validate_for_vocab(7).unwrap_err().to_string();
        assert!(e.contains("token 7") && e.contains("0..7"), "{e}");
    }

    /// The log-softmax of `logits`, computed the plain way.
    fn log_softmax(logits: &[f32]) -> Vec<f64> {
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        logits.iter().map(|&l| f64::from(l) - z.ln()).collect()
    }

    #[test]
    fn a_bias_of_100_forces_a_token_and_minus_100_forbids_it() {
        let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.61).cos() * 3.0).collect();
        for temperature in [0.0, 1.0, 2.0] {
            let forced = SamplingParams { logit_bias: vec![(17, 100.0)], ..params(temperature) };
            let mut s = Sampler::new(forced).unwrap();
            assert!((0..200).all(|_| s.sample(&logits, &[]).unwrap() == 17), "T={temperature}");
            // Forbid the most likely tokens: none of them is ever picked.
            let best: Vec<u32> = (0..40).filter(|&i| logits[i as usize] > 1.0).collect();
            assert!(!best.is_empty());
            let forbidden = SamplingParams {
                logit_bias: best.iter().map(|&t| (t, -100.0)).collect(),
                ..params(temperature)
            };
            let mut s = Sampler::new(forbidden).unwrap();
            assert!((0..500).all(|_| !best.contains(&s.sample(&logits, &[]).unwrap())), "T={temperature}");
        }
        // A small bias shifts the distribution by exactly its value.
        let logits = [0.5f32, 1.0, -0.25];
        let p = SamplingParams { logit_bias: vec![(2, 0.75), (0, -0.5)], logprobs: Some(3), ..params(0.0) };
        let got = Sampler::new(p).unwrap().sample_with_logprobs(&logits, &[]).unwrap();
        let want = log_softmax(&[0.0, 1.0, 0.5]);
        assert_eq!(got.token, 1);
        let lp = got.logprobs.unwrap();
        assert!((f64::from(lp.logprob) - want[1]).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 0]);
    }

    #[test]
    fn presence_and_frequency_penalties_follow_openai_s_definition() {
        // Equal logits: greedy picks token 0 first; then 0 has lost presence + 1 x frequency.
        let logits = [1.0f32, 1.0, 1.0];
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logprobs: Some(3),
            ..params(0.0)
        };
        let mut s = Sampler::new(p).unwrap();
        let first = s.sample_with_logprobs(&logits, &[]).unwrap();
        assert_eq!(first.token, 0);
        let second = s.sample_with_logprobs(&logits, &[]).unwrap();
        assert_eq!(second.token, 1);
        let want = log_softmax(&[1.0 - 0.75, 1.0, 1.0]);
        assert!((f64::from(second.logprobs.unwrap().logprob) - want[1]).abs() < 1e-6);
        // Third: 0 and 1 both picked once, so 2 wins; fourth: all three once, 0 first by ID.
        assert_eq!(s.sample(&logits, &[]).unwrap(), 2);
        assert_eq!(s.sample(&logits, &[]).unwrap(), 0);
        // Token 0 now picked twice: it lost 0.5 + 2 x 0.25.
        let fifth = s.sample_with_logprobs(&logits, &[]).unwrap();
        let want = log_softmax(&[0.0, 0.25, 0.25]);
        let top = fifth.logprobs.unwrap().top;
        assert_eq!(top[2].0, 0);
        assert!((f64::from(top[2].1) - want[0]).abs() < 1e-6, "{top:?}");
        // A negative penalty favours repeats.
        let p = SamplingParams { presence_penalty: -1.0, ..params(0.0) };
        let mut s = Sampler::new(p).unwrap();
        assert!((0..10).all(|_| s.sample(&[1.0, 1.5, 1.2], &[]).unwrap() == 1));
        let p = SamplingParams { frequency_penalty: -0.3, ..params(0.0) };
        let mut s = Sampler::new(p).unwrap();
        assert!((0..10).all(|_| s.sample(&[1.0, 0.9], &[]).unwrap() == 0));
        // The history (the prompt) is not counted: only what this sampler picked.
        let p = SamplingParams { presence_penalty: 2.0, ..params(0.0) };
        assert_eq!(Sampler::new(p).unwrap().sample(&[1.0, 0.0], &[0, 0, 0]).unwrap(), 0);
    }

    #[test]
    fn logprobs_are_the_log_softmax_with_a_sorted_top_list() {
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37 % 101) as f32 * 0.13).sin() * 4.0).collect();
        let want = log_softmax(&logits);
        for temperature in [0.0, 0.7, 1.5] {
            let p = SamplingParams { logprobs: Some(5), top_p: 0.9, ..params(temperature) };
            let mut s = Sampler::new(p).unwrap();
            for _ in 0..20 {
                let got = s.sample_with_logprobs(&logits, &[]).unwrap();
                let lp = got.logprobs.unwrap();
                let chosen = f64::from(lp.logprob);
                assert!((chosen - want[got.token as usize]).abs() < 1e-5, "{chosen}");
                assert_eq!(lp.top.len(), 5);
                let mut expect: Vec<usize> = (0..logits.len()).collect();
                expect.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
                for (k, &(t, l)) in lp.top.iter().enumerate() {
                    assert_eq!(t as usize, expect[k], "rank {k}");
                    assert!((f64::from(l) - want[t as usize]).abs() < 1e-5);
                }
                assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "sorted");
                if temperature == 0.0 {
                    assert_eq!((got.token, lp.logprob), lp.top[0], "greedy picks the top token");
                }
                if let Some(&(_, l)) = lp.top.iter().find(|t| t.0 == got.token) {
                    assert_eq!(l, lp.logprob);
                }
            }
        }
        // Zero alternatives: only the token's own; more than the vocabulary: all of it.
        let p = SamplingParams { logprobs: Some(0), ..params(1.0) };
        let lp = Sampler::new(p).unwrap().sample_with_logprobs(&[0.0, 1.0], &[]).unwrap().logprobs.unwrap();
        assert!(lp.top.is_empty() && lp.logprob < 0.0);
        let p = SamplingParams { logprobs: Some(20), ..params(0.0) };
        let lp = Sampler::new(p).unwrap().sample_with_logprobs(&[0.0, 1.0], &[]).unwrap().logprobs.unwrap();
        assert_eq!(lp.top.len(), 2);
        // Not asked for: none.
        assert_eq!(
            Sampler::new(params(1.0)).unwrap().sample_with_logprobs(&[0.0, 1.0], &[]).unwrap().logprobs,
            None
        );
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
        assert_eq!(s.sample(&[0.0, 50.0], &[]).unwrap(), 1);
    }

    /// A host stand-in for a device's reduction: the plan's candidates ranked, the
    /// statistics merged from parts of 100 tokens as a device's workgroups report them.
    fn reduce_like_a_device(plan: &SamplePlan, adjusted: &[f32]) -> Candidates {
        let mut ranked = Vec::new();
        rank(adjusted, plan.candidates, &mut ranked);
        let t = if plan.rule.is_greedy() { 1.0 } else { plan.rule.temperature };
        let parts: Vec<(f32, f32, f32)> = adjusted
            .chunks(100)
            .map(|c| {
                let m = c.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                (m, c.iter().map(|&v| ((v - m) / t).exp()).sum(), c.iter().map(|&v| (v - m).exp()).sum())
            })
            .collect();
        Candidates { ranked, stats: LogitStats::merge(adjusted.len(), &plan.rule, true, &parts) }
    }

    #[test]
    fn a_planned_pick_equals_the_pick_from_the_full_logits() {
        let vocab = 1500;
        let logits: Vec<f32> = (0..vocab).map(|i| ((i * 7919 % 997) as f32 * 0.031).sin() * 6.0).collect();
        let settings = [
            params(0.0),
            SamplingParams { logprobs: Some(4), repetition_penalty: 1.3, ..params(0.0) },
            params(1.0),
            SamplingParams { top_k: 20, ..params(0.8) },
            SamplingParams { top_p: 0.5, presence_penalty: 0.7, frequency_penalty: 0.3, ..params(1.2) },
            SamplingParams { min_p: 0.3, logit_bias: vec![(5, 3.0), (5, 1.5), (900, -100.0)], ..params(1.0) },
            SamplingParams { top_k: 600, logprobs: Some(20), repetition_penalty: 0.8, ..params(1.0) },
        ];
        let (mut by_candidates, mut by_full) = (0, 0);
        for p in settings {
            let mut reference = Sampler::new(p.clone()).unwrap();
            let mut planned = Sampler::new(p.clone()).unwrap();
            let mut history = vec![3u32, 77, 900];
            for step in 0..40 {
                // Shift the logits a little every step so the picks vary.
                let l: Vec<f32> = logits.iter().map(|&v| v + ((step * 31) % 7) as f32 * 0.01).collect();
                let (last, before) = history.split_last().unwrap();
                let plan = planned.plan(before, &[*last]).unwrap();
                let want = reference.sample_with_logprobs(&l, &history).unwrap();
                let mut adjusted = l.clone();
                plan.adjust_logits(&mut adjusted);
                let cands = reduce_like_a_device(&plan, &adjusted);
                let handed = if plan.reducible() && plan.decides(&cands) {
                    by_candidates += 1;
                    PlannedLogits::Candidates(cands)
                } else {
                    by_full += 1;
                    PlannedLogits::Full(adjusted)
                };
                let got = planned.finish(&plan, &handed).unwrap();
                assert_eq!(got.token, want.token, "{p:?} step {step}");
                match (&got.logprobs, &want.logprobs) {
                    (Some(g), Some(w)) => {
                        assert!((g.logprob - w.logprob).abs() < 1e-4, "{g:?} {w:?}");
                        assert_eq!(
                            g.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                            w.top.iter().map(|t| t.0).collect::<Vec<_>>()
                        );
                    }
                    (None, None) => {}
                    other => panic!("logprobs differ: {other:?}"),
                }
                history.push(got.token);
            }
        }
        assert!(by_candidates > 100 && by_full > 0, "{by_candidates} {by_full}");
    }
}
