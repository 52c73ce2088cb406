//! The rule that draws a token from a ranking of the most likely tokens and a few
//! statistics of the whole distribution. The host applies it to the full logits and a
//! device to the candidates it reduced on its side ([`crate::backend::Backend::reduce_logits`]),
//! so a GPU that reads back a few kilobytes picks exactly the token the host would pick
//! from the whole vocabulary, or says it cannot (the draw landed beyond its candidates) and
//! the full logits are read instead.

use crate::error::{Error, Result};

/// The settings that act on the (adjusted) logits when a token is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawRule {
    /// Softmax temperature; 0: the most likely token.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest prefix of the ranking whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0: off).
    pub min_p: f32,
}

impl DrawRule {
    /// Whether the rule takes the most likely token (no draw, no random number).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// What the draw and the log probabilities need to know of the whole vocabulary besides the
/// ranked candidates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitStats {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The largest logit.
    pub max: f32,
    /// `sum exp((l - max) / T)` over the vocabulary at the rule's temperature; `None` where
    /// it was not computed (greedy, or a top-k rule, which normalizes over its k tokens).
    pub sum_at_temperature: Option<f64>,
    /// `ln sum exp(l)` over the vocabulary (the log-softmax's normalizer at temperature 1);
    /// `None` where no log probabilities were asked for.
    pub log_partition: Option<f64>,
}

impl LogitStats {
    /// The statistics of `logits` (finite, non-empty) that `rule` needs, and the log
    /// partition function when `log_partition` asks. Sums run in f64 in token order.
    pub fn of(logits: &[f32], rule: &DrawRule, log_partition: bool) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m = f64::from(max);
        let sum_at_temperature = needs_sum(rule).then(|| {
            let t = f64::from(rule.temperature);
            logits.iter().map(|&l| ((f64::from(l) - m) / t).exp()).sum::<f64>()
        });
        let log_partition =
            log_partition.then(|| m + logits.iter().map(|&l| (f64::from(l) - m).exp()).sum::<f64>().ln());
        LogitStats { vocab: logits.len(), max, sum_at_temperature, log_partition }
    }

    /// Combines the statistics of consecutive parts of a vocabulary, each given as (its
    /// largest logit, its `sum exp((l - part max) / T)`, its `sum exp(l - part max)`), as a
    /// device reports them per workgroup. `temperature` is the rule's (any positive value
    /// where the rule is greedy: that sum is then not kept).
    pub fn merge(vocab: usize, rule: &DrawRule, log_partition: bool, parts: &[(f32, f32, f32)]) -> Self {
        let max = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
        let m = f64::from(max);
        let t = if rule.is_greedy() { 1.0 } else { f64::from(rule.temperature) };
        let sum_at_temperature = needs_sum(rule)
            .then(|| parts.iter().map(|p| f64::from(p.1) * ((f64::from(p.0) - m) / t).exp()).sum::<f64>());
        let log_partition = log_partition
            .then(|| m + parts.iter().map(|p| f64::from(p.2) * (f64::from(p.0) - m).exp()).sum::<f64>().ln());
        LogitStats { vocab, max, sum_at_temperature, log_partition }
    }
}

/// Whether `rule` normalizes over the whole vocabulary (a temperature draw without top-k).
fn needs_sum(rule: &DrawRule) -> bool {
    !rule.is_greedy() && rule.top_k == 0
}

/// The ranking key of a logit: its value, with -0 counted as +0 (as the argmax compares).
fn rank_value(v: f32) -> f32 {
    if v == 0.0 { 0.0 } else { v }
}

/// Whether candidate `a` ranks before `b`: the larger logit, or the lower token ID among
/// equal ones. Devices rank with the same order (`shaders/logits_topk.wgsl`).
pub fn ranks_before(a: (u32, f32), b: (u32, f32)) -> std::cmp::Ordering {
    rank_value(b.1).total_cmp(&rank_value(a.1)).then(a.0.cmp(&b.0))
}

/// Fills `out` with the `n` most likely tokens of `logits` (all of them where `n` is at
/// least the vocabulary), ranked by [`ranks_before`].
pub fn rank(logits: &[f32], n: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    out.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
    let n = n.min(out.len());
    if n == 0 {
        out.clear();
        return;
    }
    if n < out.len() {
        out.select_nth_unstable_by(n - 1, |a, b| ranks_before(*a, *b));
        out.truncate(n);
    }
    out.sort_unstable_by(|a, b| ranks_before(*a, *b));
}

/// The token `rule` draws with the uniform number `u` (in `[0, 1)`) from a distribution
/// whose most likely tokens are `ranked` (by [`ranks_before`]) and whose whole is
/// described by `stats`. The kept tokens are always a prefix of the ranking (top-k, then
/// top-p over the probabilities normalized over what top-k kept, then min-p), walked in
/// ranking order with weights `exp((l - max) / T)` in f64. `None` when `ranked` is too short to
/// decide: the kept prefix or the draw reaches beyond it (never when `ranked` is the whole
/// vocabulary).
pub fn choose(rule: &DrawRule, u: f64, ranked: &[(u32, f32)], stats: &LogitStats) -> Option<u32> {
    let first = ranked.first()?;
    if rule.is_greedy() {
        return Some(first.0);
    }
    let complete = ranked.len() >= stats.vocab;
    let t = f64::from(rule.temperature);
    let max = f64::from(stats.max);
    let weight = |l: f32| ((f64::from(l) - max) / t).exp();
    // `kept` is a prefix of the ranking; `bounded` once its end is known to lie in `ranked`.
    let (mut kept, total, mut bounded) = if rule.top_k > 0 {
        let kept = ranked.get(..rule.top_k.min(stats.vocab))?;
        (kept, kept.iter().map(|c| weight(c.1)).sum::<f64>(), true)
    } else {
        (ranked, stats.sum_at_temperature?, complete)
    };
    if rule.top_p < 1.0 {
        let (mut cum, top_p) = (0.0f64, f64::from(rule.top_p));
        match kept.iter().position(|c| {
            cum += weight(c.1) / total;
            cum >= top_p
        }) {
            Some(i) => {
                kept = &kept[..=i];
                bounded = true;
            }
            None if bounded => {}
            None => return None,
        }
    }
    if rule.min_p > 0.0 {
        let floor = f64::from(rule.min_p) * weight(kept[0].1);
        match kept.iter().position(|c| weight(c.1) < floor) {
            Some(i) => {
                kept = &kept[..i.max(1)];
                bounded = true;
            }
            None if bounded => {}
            None => return None,
        }
    }
    let mass = if bounded { kept.iter().map(|c| weight(c.1)).sum::<f64>() } else { total };
    let mut r = u * mass;
    for c in kept {
        r -= weight(c.1);
        if r <= 0.0 {
            return Some(c.0);
        }
    }
    // Rounding left a sliver past the last kept token: it is the draw, where the kept set
    // is known; otherwise the draw lies beyond the candidates.
    if bounded { kept.last().map(|c| c.0) } else { None }
}

/// Candidates a device reduced: the most likely tokens, ranked, with the statistics of the
/// whole vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    /// The most likely tokens and their (adjusted) logits, ranked by [`ranks_before`].
    pub ranked: Vec<(u32, f32)>,
    /// The statistics of the whole vocabulary.
    pub stats: LogitStats,
}

/// The last position's logits as a runner hands them to the sampler after a planned step:
/// adjusted by the plan's bias and penalties, then either reduced to candidates that decide
/// the token, or in full.
#[derive(Clone, Debug, PartialEq)]
pub enum PlannedLogits {
    /// Candidates that decide the draw ([`crate::sample::SamplePlan::decides`]).
    Candidates(Candidates),
    /// The whole vocabulary's adjusted logits.
    Full(Vec<f32>),
}

/// Fails unless `ranked` is a valid ranking of distinct tokens of a `vocab`-token
/// vocabulary (what a device read back is checked before it is trusted).
pub fn check_ranking(ranked: &[(u32, f32)], vocab: usize) -> Result<()> {
    if let Some(&(t, _)) = ranked.iter().find(|c| c.0 as usize >= vocab) {
        return Err(Error::Backend(format!("a device candidate names token {t}, outside 0..{vocab}")));
    }
    if ranked.windows(2).any(|w| ranks_before(w[0], w[1]) != std::cmp::Ordering::Less) {
        return Err(Error::Backend("the device's candidates are not ranked".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> DrawRule {
        DrawRule { temperature, top_k, top_p, min_p }
    }

    fn logits(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 613) as f32 * 0.071).sin() * 3.0 + (i % 5) as f32 * 0.01).collect()
    }

    /// Every prefix of the ranking either decides the draw as the whole ranking does, or
    /// says it cannot.
    #[test]
    fn a_prefix_decides_as_the_whole_or_declines() {
        let l = logits(700);
        let mut all = Vec::new();
        rank(&l, l.len(), &mut all);
        let rules = [
            rule(0.0, 0, 1.0, 0.0),
            rule(1.0, 0, 1.0, 0.0),
            rule(0.7, 40, 1.0, 0.0),
            rule(1.3, 0, 0.9, 0.0),
            rule(1.0, 0, 1.0, 0.2),
            rule(0.8, 100, 0.5, 0.05),
        ];
        let (mut decided, mut declined) = (0, 0);
        for r in rules {
            let stats = LogitStats::of(&l, &r, false);
            for step in 0..50 {
                let u = (step as f64 * 0.618_033_988_75).fract();
                let want = choose(&r, u, &all, &stats).expect("the whole ranking decides");
                for n in [1, 5, 40, 100, 256, 699] {
                    match choose(&r, u, &all[..n], &stats) {
                        Some(got) => {
                            assert_eq!(got, want, "{r:?} u={u} n={n}");
                            decided += 1;
                        }
                        None => declined += 1,
                    }
                }
            }
        }
        assert!(decided > 0 && declined > 0, "{decided} {declined}");
    }

    #[test]
    fn the_draw_follows_the_distribution() {
        // Probabilities at T=1: about 0.64, 0.24, 0.09, 0.03.
        let l = [3.0f32, 2.0, 1.0, 0.0];
        let r = rule(1.0, 0, 1.0, 0.0);
        let stats = LogitStats::of(&l, &r, false);
        let mut ranked = Vec::new();
        rank(&l, 4, &mut ranked);
        let mut counts = [0usize; 4];
        for i in 0..10_000 {
            counts[choose(&r, (i as f64 + 0.5) / 10_000.0, &ranked, &stats).unwrap() as usize] += 1;
        }
        let z: f64 = l.iter().map(|&v| f64::from(v).exp()).sum();
        for (t, &c) in counts.iter().enumerate() {
            let p = f64::from(l[t]).exp() / z;
            assert!((c as f64 / 10_000.0 - p).abs() < 1e-3, "token {t}: {c}");
        }
    }

    #[test]
    fn merged_parts_equal_the_whole() {
        let l = logits(1000);
        let r = rule(0.6, 0, 1.0, 0.0);
        let whole = LogitStats::of(&l, &r, true);
        let parts: Vec<(f32, f32, f32)> = l
            .chunks(128)
            .map(|c| {
                let m = c.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let st: f32 = c.iter().map(|&v| ((v - m) / 0.6).exp()).sum();
                let s1: f32 = c.iter().map(|&v| (v - m).exp()).sum();
                (m, st, s1)
            })
            .collect();
        let merged = LogitStats::merge(l.len(), &r, true, &parts);
        assert_eq!(merged.max, whole.max);
        let rel = |a: f64, b: f64| ((a - b) / b).abs();
        assert!(rel(merged.sum_at_temperature.unwrap(), whole.sum_at_temperature.unwrap()) < 1e-5);
        assert!((merged.log_partition.unwrap() - whole.log_partition.unwrap()).abs() < 1e-5);
    }

    #[test]
    fn ranking_puts_ties_in_id_order_and_counts_minus_zero_as_zero() {
        let l = [1.0f32, 0.0, 2.0, -0.0, 2.0, 0.0];
        let mut out = Vec::new();
        rank(&l, 6, &mut out);
        assert_eq!(out.iter().map(|c| c.0).collect::<Vec<_>>(), [2, 4, 0, 1, 3, 5]);
        rank(&l, 3, &mut out);
        assert_eq!(out.iter().map(|c| c.0).collect::<Vec<_>>(), [2, 4, 0]);
        assert!(check_ranking(&out, 6).is_ok());
        assert!(check_ranking(&[(4, 2.0), (2, 2.0)], 6).is_err());
        assert!(check_ranking(&[(9, 2.0)], 6).is_err());
    }
}
