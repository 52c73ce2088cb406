//! Attention for one query position over the cached keys and values: GQA head mapping,
//! causal and sliding-window visibility, scaled scores, softmax with the head's sink (plain softmax in families without sinks).

use crate::model::math::{softmax, softmax_with_sink};

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
    attend_group_body(shape, cache, kvh, q_group, pos, scores, out)
}

/// A copy of [`attend_group_body`] compiled with the target features `$features`.
macro_rules! attend_group_for {
    ($name:ident, $features:literal) => {
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
            attend_group_body(shape, cache, kvh, q_group, pos, scores, out)
        }
    };
}
attend_group_for!(attend_group_avx512, "avx512f");
attend_group_for!(attend_group_avx2, "avx2");

/// The computation of [`attend_group`], inlined into each compiled copy.
#[inline(always)]
fn attend_group_body(
    shape: AttentionShape,
    cache: LayerCache<'_>,
    kvh: usize,
    q_group: &[f32],
    pos: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
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
    for (j, v) in cache.values_of(kvh, d, first, pos).chunks_exact(d).enumerate() {
        for (g, o) in out.chunks_exact_mut(d).enumerate() {
            let w = scores[g * n + j];
            for (o, &vv) in o.iter_mut().zip(v) {
                *o += w * vv;
            }
        }
    }
}

/// Independent partial sums of [`dot`]: a 512-bit register of f32, or four 128-bit ones.
const DOT_LANES: usize = 16;

/// `sum a[i] * b[i]`: element `i` into partial sum `i % DOT_LANES` (whole lanes' worth of
/// elements), the partial sums added in halves (8 + 8, then 4 + 4, ...), then the elements
/// past the last whole `DOT_LANES` in order. One fixed order whatever the caller, so a query
/// gives the same bits alone or in a batch. The lanes are independent, so the compiler keeps
/// them in vector registers on every target; a single running sum (one add waiting for the
/// previous, a few cycles an element) made a query's scores over a 1,024-token cache take
/// longer than the token's weights.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a_lanes, a_rest) = a.as_chunks::<DOT_LANES>();
    let (b_lanes, b_rest) = b.as_chunks::<DOT_LANES>();
    let mut sums = [0.0f32; DOT_LANES];
    for (x, y) in a_lanes.iter().zip(b_lanes) {
        for l in 0..DOT_LANES {
            sums[l] += x[l] * y[l];
        }
    }
    let mut width = DOT_LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            sums[l] += sums[l + width];
        }
    }
    let mut sum = sums[0];
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
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
        for (heads, kv_heads, window) in [(8, 2, None), (8, 2, Some(3)), (4, 4, None), (6, 1, None)] {
            let d = 20;
            let shape = AttentionShape { heads, kv_heads, head_dim: d, window };
            let positions = 9;
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
