//! Attention for one query position over the cached keys and values: GQA head mapping,
//! causal and sliding-window visibility, scaled scores, softmax with the head's sink (plain softmax in families without sinks).

use crate::model::math::{LANES, fold_lanes, softmax, softmax_with_sink};

/// Shape of the attention computation.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Positions visible to a query (itself included) on a sliding layer; `None`: all.
    pub window: Option<usize>,
}

/// First key position visible from a query at `pos`: `pos - window + 1` on a sliding
/// layer (the query itself plus `window - 1` earlier positions), else 0.
pub fn first_visible(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    }
}

/// One layer's cached keys and values (`[kv_heads, positions, head_dim]` each: a key/value
/// head's positions one after another) and its sinks.
#[derive(Clone, Copy)]
pub struct LayerCache<'a> {
    /// Positions each head's region holds (the cache's capacity).
    pub positions: usize,
    /// Keys by head, then position.
    pub keys: &'a [f32],
    /// Values by head, then position.
    pub values: &'a [f32],
    /// One sink logit per query head, in families with sinks.
    pub sinks: Option<&'a [f32]>,
}

impl<'a> LayerCache<'a> {
    /// Key/value head `kvh`'s keys at positions `first..=last` (`head_dim` values each), one
    /// after another.
    fn keys_of(&self, kvh: usize, d: usize, first: usize, last: usize) -> &'a [f32] {
        let at = kvh * self.positions;
        &self.keys[(at + first) * d..(at + last + 1) * d]
    }

    /// Key/value head `kvh`'s values at positions `first..=last`, as [`LayerCache::keys_of`].
    fn values_of(&self, kvh: usize, d: usize, first: usize, last: usize) -> &'a [f32] {
        let at = kvh * self.positions;
        &self.values[(at + first) * d..(at + last + 1) * d]
    }
}

/// Attends the query heads that share key/value head `kvh` (`shape.heads / shape.kv_heads`
/// of them, `q_group` holding their `head_dim` values each, in order) at position `pos` over
/// `cache`, writing their outputs into `out` (the same layout). Each head's result is bit for
/// bit what attending that head alone gives (the tests' `attend_head`): the same dot
/// products, softmax and sum over positions in the same order, only interleaved across the
/// heads, so that each cached key and value is read once
/// for the group instead of once per head (a 1,024-token cache of the 20B shape is 4 MiB a
/// layer, more than a core's L2, and the eight heads of a group each went through it).
/// `scores` is scratch; it is resized as needed.
///
/// The arithmetic is written out operation by operation (no sum the compiler may reorder), so
/// the copies compiled for wider vector units below give the same bits as the baseline one.
pub fn attend_group(
    shape: AttentionShape,
    cache: LayerCache<'_>,
    kvh: usize,
    q_group: &[f32],
    pos: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { attend_group_avx512(shape, cache, kvh, q_group, pos, scores, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { attend_group_avx2(shape, cache, kvh, q_group, pos, scores, out) };
        }
    }
    attend_group_body(shape, cache, kvh, q_group, pos, scores, out, dot)
}

/// A copy of [`attend_group_body`] compiled with the target features `$features`, its dot
/// products by `$dot` (the same bits as [`dot`]).
macro_rules! attend_group_for {
    ($name:ident, $features:literal, $dot:ident) => {
        #[doc = concat!("[`attend_group`] compiled for ", $features, ".")]
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $name(
            shape: AttentionShape,
            cache: LayerCache<'_>,
            kvh: usize,
            q_group: &[f32],
            pos: usize,
            scores: &mut Vec<f32>,
            out: &mut [f32],
        ) {
            // SAFETY (of `$dot`): this copy is compiled, and called, only with its features.
            attend_group_body(shape, cache, kvh, q_group, pos, scores, out, |a, b| unsafe { $dot(a, b) })
        }
    };
}
attend_group_for!(attend_group_avx512, "avx512f", dot_avx512);
attend_group_for!(attend_group_avx2, "avx2", dot_avx2);

/// The computation of [`attend_group`], inlined into each compiled copy, with `dot` giving
/// [`dot`]'s bits.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_group_body(
    shape: AttentionShape,
    cache: LayerCache<'_>,
    kvh: usize,
    q_group: &[f32],
    pos: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let d = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let first = first_visible(pos, shape.window);
    let n = pos + 1 - first;
    scores.resize(group * n, 0.0);
    for (j, k) in cache.keys_of(kvh, d, first, pos).chunks_exact(d).enumerate() {
        for (g, qh) in q_group.chunks_exact(d).enumerate() {
            scores[g * n + j] = dot(qh, k) * scale;
        }
    }
    for (g, head_scores) in scores.chunks_exact_mut(n).enumerate() {
        match cache.sinks {
            Some(sinks) => softmax_with_sink(head_scores, sinks[kvh * group + g]),
            None => softmax(head_scores),
        }
    }
    out.fill(0.0);
    // `out[g][e] += w[g][j] * v[j][e]` over the positions `j` in order, for each head `g` and
    // element `e`: a block of positions at a time (its values stay in L1 while every head
    // goes through them), and a head's outputs [`LANES`] at a time in registers across the
    // block rather than loaded and stored at every position.
    let values = cache.values_of(kvh, d, first, pos);
    for j0 in (0..n).step_by(VALUE_BLOCK) {
        let block = &values[j0 * d..(j0 + VALUE_BLOCK).min(n) * d];
        for (g, o) in out.chunks_exact_mut(d).enumerate() {
            let w = &scores[g * n + j0..][..block.len() / d];
            let (o_lanes, o_rest) = o.as_chunks_mut::<LANES>();
            for (i, acc) in o_lanes.chunks_mut(CHAINS).enumerate() {
                let at = i * CHAINS * LANES;
                match acc.len() {
                    4 => add_weighted::<4>(acc, w, block, d, at),
                    3 => add_weighted::<3>(acc, w, block, d, at),
                    2 => add_weighted::<2>(acc, w, block, d, at),
                    _ => add_weighted::<1>(acc, w, block, d, at),
                }
            }
            let tail = o_lanes.len() * LANES;
            for (&w, v) in w.iter().zip(block.chunks_exact(d)) {
                for (o, &vv) in o_rest.iter_mut().zip(&v[tail..]) {
                    *o += w * vv;
                }
            }
        }
    }
}

/// Positions of values [`attend_group`] takes at a time: 64 of the 20B's 64-wide heads are 16
/// KiB, half a core's L1.
const VALUE_BLOCK: usize = 64;

/// Registers of a head's outputs that take the weighted values at once: independent chains
/// of additions, so that each waits on its own previous addition only every fourth step.
/// (`attend_group_body` has an arm for each count up to it.)
const CHAINS: usize = 4;
const _: () = assert!(CHAINS == 4);

/// `acc[k][l] += w[j] * values[j][at + k * LANES + l]` over the positions `j` in order (`K`
/// registers of [`LANES`] outputs, `values` rows of `d`), in registers until the end.
#[inline(always)]
fn add_weighted<const K: usize>(acc: &mut [[f32; LANES]], w: &[f32], values: &[f32], d: usize, at: usize) {
    let mut a: [[f32; LANES]; K] = std::array::from_fn(|k| acc[k]);
    for (&w, v) in w.iter().zip(values.chunks_exact(d)) {
        let v = &v[at..][..K * LANES];
        for k in 0..K {
            for l in 0..LANES {
                a[k][l] += w * v[k * LANES + l];
            }
        }
    }
    acc[..K].copy_from_slice(&a);
}

/// `sum a[i] * b[i]`: element `i` into partial sum `i % LANES` (whole lanes' worth of
/// elements), the partial sums added by [`fold_lanes`] (in halves), then the elements past
/// the last whole `LANES` in order. One fixed order whatever the caller, so a query
/// gives the same bits alone or in a batch. The lanes are independent (a single running sum,
/// one add waiting for the previous, made a query's scores over a 1,024-token cache take
/// longer than the token's weights); the x86 copies of [`attend_group`] use
/// [`dot_avx512`] and [`dot_avx2`], which give these bits with the lanes in whole registers.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a_lanes, a_rest) = a.as_chunks::<LANES>();
    let (b_lanes, b_rest) = b.as_chunks::<LANES>();
    let mut sums = [0.0f32; LANES];
    for (x, y) in a_lanes.iter().zip(b_lanes) {
        for l in 0..LANES {
            sums[l] += x[l] * y[l];
        }
    }
    add_products(fold_lanes(sums), a_rest, b_rest)
}

/// `sum + a[0] * b[0] + a[1] * b[1] + ...`, in order: the elements of a dot product past its
/// last whole [`LANES`].
#[inline(always)]
fn add_products(mut sum: f32, a: &[f32], b: &[f32]) -> f32 {
    for (x, y) in a.iter().zip(b) {
        sum += x * y;
    }
    sum
}

/// [`dot`] with AVX-512: the 16 partial sums in one register, added in halves by extracting
/// the upper half each time, as [`fold_lanes`] does. The compiler, left to [`dot`] alone,
/// split its 16 lanes into eight pairs with the reduction, and a query's scores took half of
/// a long context's attention.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let (a_lanes, a_rest) = a.as_chunks::<LANES>();
    let (b_lanes, b_rest) = b.as_chunks::<LANES>();
    let mut sums = _mm512_setzero_ps();
    for (x, y) in a_lanes.iter().zip(b_lanes) {
        // SAFETY: `x` and `y` are 16 readable f32 each; unaligned loads are allowed.
        let (x, y) = unsafe { (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(y.as_ptr())) };
        sums = _mm512_add_ps(sums, _mm512_mul_ps(x, y));
    }
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sums)));
    // SAFETY: AVX2 and SSE come with AVX-512F.
    let sum = unsafe { fold_eight(_mm256_add_ps(_mm512_castps512_ps256(sums), high)) };
    add_products(sum, a_rest, b_rest)
}

/// [`dot`] with AVX2: partial sums 0-7 and 8-15 in two registers, added together first, as
/// [`fold_lanes`] does.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let (a_lanes, a_rest) = a.as_chunks::<LANES>();
    let (b_lanes, b_rest) = b.as_chunks::<LANES>();
    let (mut low, mut high) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for (x, y) in a_lanes.iter().zip(b_lanes) {
        // SAFETY: `x` and `y` are 16 readable f32 each; unaligned loads are allowed.
        unsafe {
            let (x0, y0) = (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr()));
            let (x1, y1) = (_mm256_loadu_ps(x.as_ptr().add(8)), _mm256_loadu_ps(y.as_ptr().add(8)));
            low = _mm256_add_ps(low, _mm256_mul_ps(x0, y0));
            high = _mm256_add_ps(high, _mm256_mul_ps(x1, y1));
        }
    }
    // SAFETY: the CPU has AVX2.
    let sum = unsafe { fold_eight(_mm256_add_ps(low, high)) };
    add_products(sum, a_rest, b_rest)
}

/// The last three halvings of [`fold_lanes`] on its lanes 0-7: 0-3 plus 4-7, then 0-1 plus
/// 2-3, then 0 plus 1.
///
/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
unsafe fn fold_eight(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attends one query head `qh` (`head_dim` values) of head index `h` at position `pos` over
    /// `cache` (valid through `pos`), writing `out` (`head_dim` values). `scores` is scratch; it
    /// is resized as needed. The plain definition, one head at a time, that the tests hold
    /// [`attend_group`] to, bit for bit.
    fn attend_head(
        shape: AttentionShape,
        cache: LayerCache<'_>,
        h: usize,
        qh: &[f32],
        pos: usize,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let d = shape.head_dim;
        let kvh = h / (shape.heads / shape.kv_heads);
        let scale = 1.0 / (d as f32).sqrt();
        let first = first_visible(pos, shape.window);
        let n = pos + 1 - first;
        scores.resize(n, 0.0);
        for (sj, k) in scores.iter_mut().zip(cache.keys_of(kvh, d, first, pos).chunks_exact(d)) {
            *sj = dot(qh, k) * scale;
        }
        match cache.sinks {
            Some(sinks) => softmax_with_sink(scores, sinks[h]),
            None => softmax(scores),
        }
        out.fill(0.0);
        for (&w, v) in scores.iter().zip(cache.values_of(kvh, d, first, pos).chunks_exact(d)) {
            for (o, &vv) in out.iter_mut().zip(v) {
                *o += w * vv;
            }
        }
    }

    /// Attends every head of the query row `q` (`heads * head_dim`) at position `pos`, writing
    /// `out` (`heads * head_dim`).
    fn attend_row(shape: AttentionShape, cache: LayerCache<'_>, q: &[f32], pos: usize, out: &mut [f32]) {
        let d = shape.head_dim;
        let mut scores = Vec::new();
        for (h, o) in out.chunks_mut(d).enumerate() {
            attend_head(shape, cache, h, &q[h * d..(h + 1) * d], pos, &mut scores, o);
        }
    }

    #[test]
    fn a_group_of_heads_gives_each_head_s_own_result_bit_for_bit() {
        // Head widths with and without a tail past whole lanes; more positions than a block
        // of values (`VALUE_BLOCK`), and fewer.
        let cases = [
            (8, 2, None, 20, 9),
            (8, 2, Some(3), 20, 9),
            (4, 4, None, 20, 9),
            (6, 1, None, 20, 9),
            (8, 2, None, 64, 2 * VALUE_BLOCK + 5),
            (8, 2, Some(100), 36, VALUE_BLOCK + 1),
        ];
        for (heads, kv_heads, window, d, positions) in cases {
            let shape = AttentionShape { heads, kv_heads, head_dim: d, window };
            let kv_dim = kv_heads * d;
            let val = |i: usize, m: usize| ((i * m % 97) as f32 - 48.0) / 37.0;
            let keys: Vec<f32> = (0..positions * kv_dim).map(|i| val(i, 13)).collect();
            let values: Vec<f32> = (0..positions * kv_dim).map(|i| val(i, 29)).collect();
            let sinks: Vec<f32> = (0..heads).map(|h| val(h, 7)).collect();
            let q: Vec<f32> = (0..heads * d).map(|i| val(i, 41)).collect();
            for sinks in [Some(sinks.as_slice()), None] {
                let cache = LayerCache { positions, keys: &keys, values: &values, sinks };
                let pos = positions - 1;
                let mut want = vec![0.0f32; heads * d];
                attend_row(shape, cache, &q, pos, &mut want);
                let mut scores = Vec::new();
                let group = heads / kv_heads;
                let mut got = vec![f32::NAN; heads * d];
                for (kvh, o) in got.chunks_mut(group * d).enumerate() {
                    attend_group(
                        shape,
                        cache,
                        kvh,
                        &q[kvh * group * d..(kvh + 1) * group * d],
                        pos,
                        &mut scores,
                        o,
                    );
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{heads} heads, {kv_heads} kv heads, window {window:?}");
            }
        }
    }

    #[test]
    fn dot_sums_every_product_for_any_length() {
        for n in [0, 1, 15, 16, 17, 64, 100, 128, 131] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) / 8.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 11 % 19) as f32 - 9.0) / 4.0).collect();
            // Products and sums of these are exact in f32 (multiples of 1/32 below 2^20).
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert_eq!(dot(&a, &b) as f64, want, "length {n}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn compiled_dots_give_dot_s_bits() {
        for n in [0, 1, 15, 16, 17, 20, 64, 100, 131] {
            // Values whose products and sums round, so that another order would show.
            let a: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.731).sin() * 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i as f32) * 1.37).cos() * 1e3).collect();
            let want = dot(&a, &b).to_bits();
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (checked just above).
                assert_eq!(unsafe { dot_avx512(&a, &b) }.to_bits(), want, "AVX-512, length {n}");
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                assert_eq!(unsafe { dot_avx2(&a, &b) }.to_bits(), want, "AVX2, length {n}");
            }
        }
    }

    #[test]
    fn dot_is_within_rounding_of_the_exact_sum_on_wide_values() {
        let n = 64;
        let a: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.731).sin() * 3.0).collect();
        let b: Vec<f32> = (0..n).map(|i| ((i as f32) * 1.37).cos() * 1e3).collect();
        let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let bound: f64 =
            a.iter().zip(&b).map(|(&x, &y)| (x as f64 * y as f64).abs()).sum::<f64>() * n as f64 * 1.2e-7;
        assert!((dot(&a, &b) as f64 - exact).abs() <= bound, "{} vs {exact}", dot(&a, &b));
    }

    #[test]
    fn window_includes_the_query_and_w_minus_one_earlier() {
        assert_eq!(first_visible(0, Some(128)), 0);
        assert_eq!(first_visible(127, Some(128)), 0);
        assert_eq!(first_visible(128, Some(128)), 1);
        assert_eq!(first_visible(129, Some(128)), 2);
        assert_eq!(first_visible(500, None), 0);
    }

    #[test]
    fn gqa_maps_query_heads_to_their_kv_head() {
        // 4 query heads, 2 kv heads, head_dim 1, one position: every head sees exactly
        // its kv head's value scaled by the softmax weight of one score plus the sink.
        let shape = AttentionShape { heads: 4, kv_heads: 2, head_dim: 1, window: None };
        let q = [1.0f32, 1.0, 1.0, 1.0];
        let keys = [0.0f32, 0.0];
        let values = [10.0f32, 20.0];
        let sinks = [f32::NEG_INFINITY; 4];
        let mut out = [0.0f32; 4];
        attend_row(
            shape,
            LayerCache { positions: 1, keys: &keys, values: &values, sinks: Some(&sinks) },
            &q,
            0,
            &mut out,
        );
        assert_eq!(out, [10.0, 10.0, 20.0, 20.0]);
    }

    #[test]
    fn sliding_window_hides_old_positions() {
        // Window 2 at position 2: sees positions 1 and 2 only. Equal scores, no sink mass.
        let shape = AttentionShape { heads: 1, kv_heads: 1, head_dim: 1, window: Some(2) };
        let keys = [0.0f32; 3];
        let values = [100.0f32, 1.0, 3.0];
        let mut out = [0.0f32; 1];
        let sinks = [f32::NEG_INFINITY];
        let cache = LayerCache { positions: 3, keys: &keys, values: &values, sinks: Some(&sinks) };
        attend_row(shape, cache, &[1.0], 2, &mut out);
        assert_eq!(out[0], 2.0);
        let full = AttentionShape { window: None, ..shape };
        attend_row(full, cache, &[1.0], 2, &mut out);
        assert!((out[0] - 104.0 / 3.0).abs() < 1e-4);
    }
}
