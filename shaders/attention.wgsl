// attention.wgsl: attention with or without sinks, GQA and the sliding window over the KV
// cache in VRAM, for a batch of query rows (decode: one row; prefill: many, each causal at
// its own position start_pos + r). The dispatch covers query and output rows row0 .. row0 +
// rows (a batched decode step attends each row over its own sequence's cache, one dispatch
// per row). One workgroup per (row, query head). Keys are visited in
// tiles of 64 with an online softmax. With sinks (has_sinks = 1) its running max starts at
// the head's sink logit and its running denominator at exp(sink - max) = 1: the same
// weights as model::math::softmax_with_sink (sink column included in the max and the sum,
// then dropped). Without sinks (families such as Qwen3-MoE) the max starts below every
// finite score and the denominator at 0, so the first tile's rescale factor is exactly 0:
// the plain softmax of model::math::softmax (the sinks binding is not read). Query head h
// reads KV head h / (heads / kv_heads); rows are q_stride = heads * head_dim wide, which
// need not be the hidden size. A sliding layer (window > 0) sees positions
// pos - window + 1 ..= pos. KV_F16: the cache holds binary16 pairs (kv_store.wgsl), rows of
// kv_row words, widened exactly to f32 as they are read; everything else is the same.

// `Params` is AttentionParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
//#if KV_F16
@group(0) @binding(2) var<storage, read> keys: array<u32>;
@group(0) @binding(3) var<storage, read> values: array<u32>;
//#else
@group(0) @binding(2) var<storage, read> keys: array<f32>;
@group(0) @binding(3) var<storage, read> values: array<f32>;
//#endif
@group(0) @binding(4) var<storage, read> sinks: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

// Up to 4 * WG = 256 head dimensions.
const MAX_DIM_STEPS: u32 = 4u;

var<workgroup> qs: array<f32, 256>;
var<workgroup> tile: array<f32, 64>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let idx = flat_wid(ids, p.nx);
    let r = idx / p.heads;
    if r >= p.rows {
        return;
    }
    let h = idx % p.heads;
    let d = p.head_dim;
    let pos = p.start_pos + r;
    var first = 0u;
    if p.window > 0u && pos + 1u > p.window {
        first = pos + 1u - p.window;
    }
    let kv_off = (h / p.group) * d;
    let q_off = (p.row0 + r) * p.q_stride + h * d;
    for (var i = ids.lid; i < d; i += WG) {
        qs[i] = q[q_off + i];
    }
    workgroupBarrier();

    // Without sinks: a max below every real score, so exp(m - tmax) underflows to exactly 0
    // at the first tile (no infinities: shader compilers may assume there are none).
    var m = -1.0e38;
    var l = 0.0;
    if p.has_sinks != 0u {
        m = sinks[h];
        l = 1.0;
    }
    var acc: array<f32, 4>;
    for (var t0 = first; t0 <= pos; t0 += WG) {
        let n = min(WG, pos + 1u - t0);
        let j = t0 + ids.lid;
        let live = ids.lid < n;
        var s = 0.0;
        if live {
//#if KV_F16
            // head_dim is even, so a head starts on a word: its keys are d / 2 words.
            let k_off = j * p.kv_row + kv_off / 2u;
            for (var i = 0u; i < d; i += 2u) {
                let kk = kv_unpack(keys[k_off + i / 2u]);
                s += qs[i] * kk.x;
                s += qs[i + 1u] * kk.y;
            }
//#else
            let k_off = j * p.kv_dim + kv_off;
            for (var i = 0u; i < d; i++) {
                s += qs[i] * keys[k_off + i];
            }
//#endif
            s *= p.scale;
            tile[ids.lid] = s;
        }
        workgroupBarrier();
        var tmax = m;
        for (var i = 0u; i < n; i++) {
            tmax = max(tmax, tile[i]);
        }
        workgroupBarrier();
        if live {
            tile[ids.lid] = exp(s - tmax);
        }
        workgroupBarrier();
        let corr = exp(m - tmax);
        var psum = 0.0;
        for (var i = 0u; i < n; i++) {
            psum += tile[i];
        }
        l = l * corr + psum;
        for (var c = 0u; c < MAX_DIM_STEPS; c++) {
            let dim = ids.lid + c * WG;
            if dim < d {
                var a = acc[c] * corr;
//#if KV_F16
                let col = kv_off + dim;
                for (var i = 0u; i < n; i++) {
                    a += tile[i] * kv_half(values[(t0 + i) * p.kv_row + col / 2u], col & 1u);
                }
//#else
                for (var i = 0u; i < n; i++) {
                    a += tile[i] * values[(t0 + i) * p.kv_dim + kv_off + dim];
                }
//#endif
                acc[c] = a;
            }
        }
        m = tmax;
        workgroupBarrier();
    }
    for (var c = 0u; c < MAX_DIM_STEPS; c++) {
        let dim = ids.lid + c * WG;
        if dim < d {
            out[q_off + dim] = acc[c] / l;
        }
    }
}
