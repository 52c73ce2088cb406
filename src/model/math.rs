//! The elementwise and small-vector math of the model families, as plain functions:
//! RMSNorm, the attention softmax with a sink, the routing rules, the clipped interleaved
//! SwiGLU (GPT-OSS) and the plain one (Qwen3-MoE). Backends that compute these elsewhere
//! (SIMD, GPU) are tested against these.

use crate::config::Routing;

/// `out[i] = weight[i] * (x[i] / sqrt(mean(x^2) + eps))`, in f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), out.len());
    out.copy_from_slice(x);
    rms_norm_in_place(out, weight, eps);
}

/// [`rms_norm`] in place (QK-norm over each head needs no scratch buffer).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    debug_assert_eq!(x.len(), weight.len());
    let mut sum_sq = 0.0f32;
    for v in x.iter() {
        sum_sq += v * v;
    }
    let inv = 1.0 / (sum_sq / x.len() as f32 + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = w * (*v * inv);
    }
}

/// Softmax of `scores` with one extra "sink" logit appended: the max is taken over the
/// scores and the sink, the sink's share is dropped, so the returned weights sum to less
/// than one. Writes the weights over `scores`.
///
/// Written for the vector units (it runs once per query head and cached position, and a
/// scalar `exp` with a running sum took a quarter of a long context's attention): the
/// exponentials by [`exp`], the denominator as [`sum_in_lanes`] of them plus the sink's
/// share. One fixed order of operations, so every caller and every compiled copy gets the
/// same bits.
#[inline(always)]
pub fn softmax_with_sink(scores: &mut [f32], sink: f32) {
    let max = max_in_lanes(scores).max(sink);
    let inv = 1.0 / (exp(sink - max) + exp_minus_max(scores, max));
    for s in scores.iter_mut() {
        *s *= inv;
    }
}

/// Plain softmax in place, in the manner of [`softmax_with_sink`].
#[inline(always)]
pub fn softmax(values: &mut [f32]) {
    let max = max_in_lanes(values);
    let denom = exp_minus_max(values, max);
    for v in values.iter_mut() {
        *v /= denom;
    }
}

/// Replaces each of `values` by `e^(v - max)` ([`exp`]) and returns their [`sum_in_lanes`]:
/// the unnormalized weights of a softmax and their sum.
#[inline(always)]
fn exp_minus_max(values: &mut [f32], max: f32) -> f32 {
    for v in values.iter_mut() {
        *v = exp(*v - max);
    }
    sum_in_lanes(values)
}

/// Independent partial results of [`sum_in_lanes`] and [`max_in_lanes`]: a 512-bit register
/// of f32 (or four 128-bit ones).
pub const LANES: usize = 16;

/// The largest of `values` (NaNs ignored, as `f32::max` does; `-inf` for none), taken in
/// [`LANES`] independent lanes. A maximum is exact, so this is the same value a running
/// maximum gives, without its chain of dependent operations.
#[inline(always)]
pub fn max_in_lanes(values: &[f32]) -> f32 {
    let (whole, rest) = values.as_chunks::<LANES>();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in whole {
        for l in 0..LANES {
            lanes[l] = lanes[l].max(c[l]);
        }
    }
    rest.iter().fold(lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)), |m, &v| m.max(v))
}

/// `sum values[i]`: element `i` into partial sum `i % LANES` (whole lanes' worth of
/// elements), the partial sums added by [`fold_lanes`], then the elements past the last
/// whole `LANES` in order. One fixed order, which the compiler keeps in vector registers.
#[inline(always)]
pub fn sum_in_lanes(values: &[f32]) -> f32 {
    let (whole, rest) = values.as_chunks::<LANES>();
    let mut lanes = [0.0f32; LANES];
    for c in whole {
        for l in 0..LANES {
            lanes[l] += c[l];
        }
    }
    rest.iter().fold(fold_lanes(lanes), |s, &v| s + v)
}

/// The sum of `LANES` partial sums, added in halves (8 + 8, then 4 + 4, ...): the order the
/// vector reductions of the CPU backend share.
#[inline(always)]
pub fn fold_lanes(mut lanes: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
    }
    lanes[0]
}

/// `e^x` in f32, rounded from an f64 value within about 1e-13 of the true one, so it is the
/// correctly rounded result but where `e^x` lies within that distance of a halfway point
/// between two f32 (the tests hold it to libm's `exp` within one ulp, and to the correctly
/// rounded value almost everywhere); subnormal below -87.3, 0 for `-inf`, `+inf` above
/// about 88.7, NaN for NaN. In f64: `x = n ln 2 + r` with `|r| <= ln 2 / 2` (`ln 2` in two
/// parts, so that `n ln 2` loses nothing), `e^r` by its Taylor series to degree 10 (the first
/// term left out is below 3e-13 of the sum), times `2^n` made from exponent bits. Only
/// multiplies, adds, conversions and bit operations with no branch, so a loop of it runs in
/// vector registers (libm's `expf` is a call per element); no fused multiply-add, so every
/// target gives the same bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2_E: f64 = std::f64::consts::LOG2_E;
    // ln 2 = LN2_HI + LN2_LO, LN2_HI with 32 significant bits, so n * LN2_HI is exact.
    const LN2_HI: f64 = 0.693_147_180_369_123_8;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    // Adding 1.5 * 2^52 rounds to an integer, which the low bits of the sum then hold.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    // e^-150 is below f32's smallest subnormal, e^89 above its largest value.
    let clamped = f64::from(x).clamp(-150.0, 89.0);
    let t = clamped * LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let mut e_r = 1.0 / 3_628_800.0;
    for k in (1..10).rev() {
        e_r = e_r * r + INVERSE_FACTORIALS[k];
    }
    let e_r = e_r * r + 1.0;
    // t's bits are those of ROUND plus n: 2^n's exponent field is n + 1023.
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    let y = (e_r * f64::from_bits(n_bits.wrapping_add(1023) << 52)) as f32;
    if x.is_nan() { x } else { y }
}

/// `1 / k!` for `k` in `0..10`: the coefficients of [`exp`]'s series.
const INVERSE_FACTORIALS: [f64; 10] = [
    1.0,
    1.0,
    1.0 / 2.0,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5_040.0,
    1.0 / 40_320.0,
    1.0 / 362_880.0,
];

/// The `k` largest router logits, in descending order (ties: lower index first), and the
/// softmax over just those `k` logits. Writes `k` indices and `k` weights.
pub fn route_top_k(logits: &[f32], k: usize, indices: &mut [u32], weights: &mut [f32]) {
    top_k_logits(logits, k, indices, weights);
    softmax(weights);
}

/// The routing decision of `routing` for one row of router `logits`: the `k` best experts
/// in descending logit order (ties: lower index first) into `indices`, their weights into
/// `weights`. [`Routing::TopKThenSoftmax`] is [`route_top_k`];
/// [`Routing::SoftmaxThenTopK`] takes the softmax over all experts at the chosen ones,
/// divided by their sum when it renormalizes (as Transformers computes it for Qwen3-MoE).
pub fn route(logits: &[f32], k: usize, routing: Routing, indices: &mut [u32], weights: &mut [f32]) {
    match routing {
        Routing::TopKThenSoftmax => route_top_k(logits, k, indices, weights),
        Routing::SoftmaxThenTopK { renormalize } => {
            top_k_logits(logits, k, indices, weights);
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let denom: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
            for w in weights.iter_mut() {
                *w = (*w - max).exp() / denom;
            }
            if renormalize {
                let sum: f32 = weights.iter().sum();
                for w in weights.iter_mut() {
                    *w /= sum;
                }
            }
        }
    }
}

/// The `k` largest of `logits` in descending order (ties: lower index first): their
/// indices into `indices` and values into `values`.
fn top_k_logits(logits: &[f32], k: usize, indices: &mut [u32], weights: &mut [f32]) {
    debug_assert!(k <= logits.len());
    debug_assert_eq!(indices.len(), k);
    debug_assert_eq!(weights.len(), k);
    // Insertion into a sorted list of k: k is small (4) and E is at most a few hundred.
    let mut n = 0usize;
    for (e, &v) in logits.iter().enumerate() {
        // Position among the current best: after every value >= v (earlier index wins ties).
        let mut pos = n;
        while pos > 0 && weights[pos - 1] < v {
            pos -= 1;
        }
        if pos >= k {
            continue;
        }
        let end = if n < k { n } else { k - 1 };
        for j in (pos..end).rev() {
            weights[j + 1] = weights[j];
            indices[j + 1] = indices[j];
        }
        weights[pos] = v;
        indices[pos] = e as u32;
        if n < k {
            n += 1;
        }
    }
}

/// GPT-OSS's SwiGLU over the interleaved gate/up vector (`gate_up[2i]` is gate `i`,
/// `gate_up[2i+1]` is up `i`): gate clamped above at `limit`, up clamped to
/// `[-limit, limit]`, `out[i] = (up + 1) * gate * sigmoid(alpha * gate)`.
pub fn swiglu_interleaved(gate_up: &[f32], limit: f32, alpha: f32, out: &mut [f32]) {
    debug_assert_eq!(gate_up.len(), 2 * out.len());
    for (o, pair) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
        let gate = pair[0].min(limit);
        let up = pair[1].clamp(-limit, limit);
        let glu = gate * sigmoid(gate * alpha);
        *o = (up + 1.0) * glu;
    }
}

/// Plain SwiGLU over the interleaved gate/up vector: `out[i] = silu(gate) * up` with
/// `silu(g) = g * sigmoid(g)`, no clamp (Qwen3-MoE, Mixtral).
pub fn silu_glu_interleaved(gate_up: &[f32], out: &mut [f32]) {
    debug_assert_eq!(gate_up.len(), 2 * out.len());
    for (o, pair) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
        let (gate, up) = (pair[0], pair[1]);
        *o = gate * sigmoid(gate) * up;
    }
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Index and value of the largest element (lowest index on ties), and the margin to the
/// runner-up (0 when there is only one element).
pub fn argmax_with_margin(values: &[f32]) -> (usize, f32, f32) {
    let mut best = 0usize;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    let mut second = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if i != best && v > second {
            second = v;
        }
    }
    let margin = if values.len() > 1 { values[best] - second } else { 0.0 };
    (best, values[best], margin)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32, tol: f32) -> bool {
        (a - b).abs() <= tol * (1.0 + b.abs())
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let mut out = [0.0f32; 4];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0;
        let r = 1.0 / (ms + 1e-5f64).sqrt();
        for i in 0..4 {
            assert!(close(out[i], (w[i] as f64 * x[i] as f64 * r) as f32, 1e-6), "{i}: {}", out[i]);
        }
        // eps matters for a zero vector: the output is zero, not NaN.
        let mut z = [1.0f32; 4];
        rms_norm(&[0.0; 4], &w, 1e-5, &mut z);
        assert_eq!(z, [0.0; 4]);
    }

    #[test]
    fn sink_takes_its_share_and_is_dropped() {
        let mut s = [1.0f32, 2.0, 3.0];
        softmax_with_sink(&mut s, 2.5);
        let e = [1.0f64, 2.0, 3.0, 2.5].map(|v: f64| v.exp());
        let total: f64 = e.iter().sum();
        for i in 0..3 {
            assert!(close(s[i], (e[i] / total) as f32, 1e-6));
        }
        let sum: f32 = s.iter().sum();
        assert!(close(sum, (1.0 - e[3] / total) as f32, 1e-6));
        assert!(sum < 1.0);
        // A sink far above every score swallows almost all the mass; no overflow.
        let mut s = [0.0f32, 1.0];
        softmax_with_sink(&mut s, 100.0);
        assert!(s.iter().all(|v| v.is_finite() && *v < 1e-40));
        // A very negative sink leaves a plain softmax.
        let mut s = [0.0f32, 1.0];
        softmax_with_sink(&mut s, -1e30);
        assert!(close(s[0] + s[1], 1.0, 1e-7));
    }

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn exp_is_correctly_rounded_almost_everywhere() {
        // Every 97th f32 from -104 (subnormal results) to 88.7, and the special values.
        let (mut checked, mut off) = (0u64, 0u64);
        let mut x = -104.0f32;
        loop {
            let got = exp(x);
            let want = f64::from(x).exp() as f32;
            if got.to_bits() != want.to_bits() {
                off += 1;
                assert!(ulps(got, want) <= 1, "exp({x}) = {got}, correctly rounded {want}");
            }
            assert!(ulps(got, x.exp()) <= 1, "exp({x}) = {got}, libm {}", x.exp());
            checked += 1;
            x = if x < 0.0 {
                f32::from_bits(x.to_bits().saturating_sub(97))
            } else {
                f32::from_bits(x.to_bits() + 97)
            };
            if x.abs() < 1e-30 {
                x = 1e-30;
            }
            if x > 88.7 {
                break;
            }
        }
        assert!(off * 100_000 <= checked, "{off} of {checked} not correctly rounded");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn lane_reductions_match_plain_ones() {
        let values: Vec<f32> = (0..40).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37).collect();
        for n in 0..values.len() {
            let v = &values[..n];
            assert_eq!(max_in_lanes(v), v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)), "max of {n}");
            let plain: f64 = v.iter().map(|&x| f64::from(x)).sum();
            assert!((f64::from(sum_in_lanes(v)) - plain).abs() <= 1e-5 * (1.0 + plain.abs()), "sum of {n}");
        }
        assert_eq!(max_in_lanes(&[f32::NAN, 1.0, f32::NAN]), 1.0);
    }

    #[test]
    fn softmax_over_a_long_row_matches_the_definition() {
        // 1,000 scores (whole lanes and a tail), spread as a long context's are.
        let scores: Vec<f32> = (0..1000).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 30.0).collect();
        let sink = 3.25f32;
        let e: Vec<f64> = scores.iter().chain([&sink]).map(|&v| f64::from(v).exp()).collect();
        let total: f64 = e.iter().sum();
        let mut s = scores.clone();
        softmax_with_sink(&mut s, sink);
        for (i, (&got, &want)) in s.iter().zip(&e).enumerate() {
            assert!(close(got, (want / total) as f32, 1e-6), "{i}: {got} against {}", want / total);
        }
        let mut p = scores.clone();
        softmax(&mut p);
        let total = total - e[1000];
        for (i, (&got, &want)) in p.iter().zip(&e).enumerate() {
            assert!(close(got, (want / total) as f32, 1e-6), "{i}: {got} against {}", want / total);
        }
    }

    #[test]
    fn top_k_sorted_descending_with_softmax_over_k() {
        let logits = [0.1f32, 3.0, -1.0, 2.0, 2.5, 0.0, 5.0, 1.0];
        let mut idx = [0u32; 4];
        let mut w = [0.0f32; 4];
        route_top_k(&logits, 4, &mut idx, &mut w);
        assert_eq!(idx, [6, 1, 4, 3]);
        let e = [5.0f64, 3.0, 2.5, 2.0].map(|v: f64| v.exp());
        let t: f64 = e.iter().sum();
        for i in 0..4 {
            assert!(close(w[i], (e[i] / t) as f32, 1e-6));
        }
        // Ties resolve to the lower index; k == E works.
        let mut idx = [0u32; 3];
        let mut w = [0.0f32; 3];
        route_top_k(&[1.0, 1.0, 1.0], 3, &mut idx, &mut w);
        assert_eq!(idx, [0, 1, 2]);
        assert!(w.iter().all(|&v| close(v, 1.0 / 3.0, 1e-6)));
        // k == 1 gives weight exactly 1.
        let mut idx = [0u32; 1];
        let mut w = [0.0f32; 1];
        route_top_k(&[-3.0, -1.0, -2.0], 1, &mut idx, &mut w);
        assert_eq!((idx[0], w[0]), (1, 1.0));
    }

    #[test]
    fn swiglu_is_interleaved_and_clipped() {
        let (limit, alpha) = (7.0f32, 1.702f32);
        // Pairs (gate, up): plain, gate above the limit, up below -limit, up above limit.
        let gu = [0.5f32, -0.25, 9.0, 1.0, -2.0, -8.0, 1.0, 10.0];
        let mut out = [0.0f32; 4];
        swiglu_interleaved(&gu, limit, alpha, &mut out);
        let f = |g: f64, u: f64| (u + 1.0) * g / (1.0 + (-(alpha as f64) * g).exp());
        let want = [f(0.5, -0.25), f(7.0, 1.0), f(-2.0, -7.0), f(1.0, 7.0)];
        for i in 0..4 {
            assert!(close(out[i], want[i] as f32, 1e-6), "{i}: {} vs {}", out[i], want[i]);
        }
        // Gate is clamped only from above: a very negative gate passes through (to ~0).
        let mut o = [0.0f32];
        swiglu_interleaved(&[-20.0, 0.0], limit, alpha, &mut o);
        assert!(o[0] < 0.0 && o[0] > -1e-12);
        // Swapping gate and up (the "split halves" bug) changes the answer.
        let mut swapped = [0.0f32; 1];
        swiglu_interleaved(&[-0.25, 0.5], limit, alpha, &mut swapped);
        assert!((swapped[0] - out[0]).abs() > 1e-3);
    }

    #[test]
    fn argmax_reports_margin() {
        assert_eq!(argmax_with_margin(&[1.0, 4.0, 3.5, 4.0]), (1, 4.0, 0.0));
        assert_eq!(argmax_with_margin(&[1.0, 4.0, 3.5]), (1, 4.0, 0.5));
    }
}
