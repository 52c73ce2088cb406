// attention_merge.wgsl: the second half of one decoded token's attention: for each query
// head, combines the splits attention_decode.wgsl wrote (running max m_s, denominator l_s,
// unnormalized weighted sum a_s of each split) with the head's sink: with M the max of
// every m_s and the sink logit, out = sum_s exp(m_s - M) a_s / (exp(sink - M) +
// sum_s exp(m_s - M) l_s), the sink's share dropped as in model::math::softmax_with_sink.
// Without sinks (has_sinks = 0) the sink term is absent: a plain softmax. One workgroup per
// query head, writing row `row` of `out`; head h reads the entry (h / group, split, h % group) of `partial`.

// `Params` is AttentionMergeParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> partial: array<f32>;
@group(0) @binding(2) var<storage, read> sinks: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const LOW: f32 = -1.0e38;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let h = flat_wid(ids, p.nx);
    if h >= p.heads {
        return;
    }
    let d = p.head_dim;
    let stride = d + 2u;
    let kvh = h / p.group;
    let first = (kvh * p.splits * p.group + h % p.group) * stride;
    let step = p.group * stride;
    var mx = LOW;
    var sink = 0.0;
    if p.has_sinks != 0u {
        sink = sinks[h];
        mx = sink;
    }
    for (var s = 0u; s < p.splits; s++) {
        mx = max(mx, partial[first + s * step + d]);
    }
    var l = 0.0;
    if p.has_sinks != 0u {
        l = exp(sink - mx);
    }
    for (var s = 0u; s < p.splits; s++) {
        let b = first + s * step;
        l += exp(partial[b + d] - mx) * partial[b + d + 1u];
    }
    for (var c = ids.lid; c < d; c += WG) {
        var a = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            let b = first + s * step;
            a += exp(partial[b + d] - mx) * partial[b + c];
        }
        out[p.row * p.heads * d + h * d + c] = a / l;
    }
}
