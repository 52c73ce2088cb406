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

/// One layer's cached keys and values (`[positions, kv_heads * head_dim]`) and its sinks.
#[derive(Clone, Copy)]
pub struct LayerCache<'a> {
    /// Keys by position.
    pub keys: &'a [f32],
    /// Values by position.
    pub values: &'a [f32],
    /// One sink logit per query head, in families with sinks.
    pub sinks: Option<&'a [f32]>,
}

/// Attends one query head `qh` (`head_dim` values) of head index `h` at position `pos` over
/// `cache` (valid through `pos`), writing `out` (`head_dim` values). `scores` is scratch; it
/// is resized as needed.
pub fn attend_head(
    shape: AttentionShape,
    cache: LayerCache<'_>,
    h: usize,
    qh: &[f32],
    pos: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let LayerCache { keys, values, sinks } = cache;
    let d = shape.head_dim;
    let kv_dim = shape.kv_heads * d;
    let kvh = h / (shape.heads / shape.kv_heads);
    let scale = 1.0 / (d as f32).sqrt();
    let first = first_visible(pos, shape.window);
    let n = pos + 1 - first;
    scores.resize(n, 0.0);
    for (j, sj) in scores.iter_mut().enumerate() {
        let p = first + j;
        let k = &keys[p * kv_dim + kvh * d..p * kv_dim + (kvh + 1) * d];
        let mut dot = 0.0f32;
        for (a, b) in qh.iter().zip(k) {
            dot += a * b;
        }
        *sj = dot * scale;
    }
    match sinks {
        Some(sinks) => softmax_with_sink(scores, sinks[h]),
        None => softmax(scores),
    }
    out.fill(0.0);
    for (j, &w) in scores.iter().enumerate() {
        let p = first + j;
        let v = &values[p * kv_dim + kvh * d..p * kv_dim + (kvh + 1) * d];
        for (o, &vv) in out.iter_mut().zip(v) {
            *o += w * vv;
        }
    }
}

/// Attends every head of the query row `q` (`heads * head_dim`) at position `pos`, writing
/// `out` (`heads * head_dim`).
pub fn attend_row(shape: AttentionShape, cache: LayerCache<'_>, q: &[f32], pos: usize, out: &mut [f32]) {
    let d = shape.head_dim;
    let mut scores = Vec::new();
    for (h, o) in out.chunks_mut(d).enumerate() {
        attend_head(shape, cache, h, &q[h * d..(h + 1) * d], pos, &mut scores, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        attend_row(shape, LayerCache { keys: &keys, values: &values, sinks: Some(&sinks) }, &q, 0, &mut out);
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
        let cache = LayerCache { keys: &keys, values: &values, sinks: Some(&sinks) };
        attend_row(shape, cache, &[1.0], 2, &mut out);
        assert_eq!(out[0], 2.0);
        let full = AttentionShape { window: None, ..shape };
        attend_row(full, cache, &[1.0], 2, &mut out);
        assert!((out[0] - 104.0 / 3.0).abs() < 1e-4);
    }
}
