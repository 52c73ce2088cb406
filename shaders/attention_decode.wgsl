// attention_decode.wgsl: the first half of one decoded token's attention, split over the
// keys (flash-decoding): workgroup (kv head, split) serves every query head of its KV head
// (the `group` = heads / kv_heads heads that share it, so each key and value is read once
// for all of them) over the keys of its split, and writes, per query head, the split's
// running max, denominator and unnormalized weighted sum of values to `partial`;
// attention_merge.wgsl combines the splits (and the sink).
//
// It also does what precedes attention for the new token, reading the fused Q/K/V
// projection `qkv` (`[q_dim | kv_dim | kv_dim]`, one row): QK-norm where the recipe has it
// (`qk_w` holds the query weight then the key weight, head_dim each), RoPE (NeoX halves,
// tables [capacity, head_dim / 2] as in rope.wgsl) on its queries, and, in the split that
// holds position `pos` (the last), RoPE on the new key and the store of the key and value
// into the cache at `pos`, before its own keys are read (no other split reads `pos`).
// `row` selects the token's row of `qkv` (a batched decode step dispatches once per row,
// each with its own sequence's cache and position). Keys are visited in tiles of 64 with an online softmax, as attention.wgsl; a sliding
// layer's window is the caller's `first`. Limits (checked by the backend): group <= 16,
// group * head_dim <= 2048, head_dim <= 256 (and even).
//
// KV_F16: the cache holds binary16 pairs (rows of kv_row words; a head's d values are d / 2
// words from word kvh * d / 2): the new key and value are packed as they are stored, keys
// are read a word (two dimensions) at a time, and each invocation accumulates pairs of
// dimensions, one word of a value row per key.

// `Params` is AttentionDecodeParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
//#if KV_F16
@group(0) @binding(2) var<storage, read_write> keys: array<u32>;
@group(0) @binding(3) var<storage, read_write> values: array<u32>;
//#else
@group(0) @binding(2) var<storage, read_write> keys: array<f32>;
@group(0) @binding(3) var<storage, read_write> values: array<f32>;
//#endif
@group(0) @binding(4) var<storage, read> cos_t: array<f32>;
@group(0) @binding(5) var<storage, read> sin_t: array<f32>;
@group(0) @binding(6) var<storage, read> qk_w: array<f32>;
@group(0) @binding(7) var<storage, read_write> partial: array<f32>;

// The group's queries (at most 2048 values), then the new key (at most 256).
var<workgroup> qs: array<f32, 2304>;
// Scores, then softmax numerators, of one tile: [group][WG].
var<workgroup> pt: array<f32, 1024>;
// Per query head of the group: running max, denominator, and the tile's rescale factor.
var<workgroup> m_w: array<f32, 16>;
var<workgroup> l_w: array<f32, 16>;
var<workgroup> corr_w: array<f32, 16>;

// Accumulators per invocation (2048 / WG); KV_F16: pairs of them.
const MAX_ACC: u32 = 32u;
const MAX_PAIRS: u32 = 16u;
const MAX_GROUP: u32 = 16u;
// Below every finite score: exp(LOW - max) is exactly 0, with no infinities.
const LOW: f32 = -1.0e38;

// RMSNorm of the head_dim values of `qs` from `base` with the weight at `w_off` of qk_w, in
// place (model::math::rms_norm_in_place). Called from uniform control flow.
fn norm_qs(base: u32, w_off: u32, ids: Ids) {
    let d = p.head_dim;
    var ss = 0.0;
    for (var c = ids.lid; c < d; c += WG) {
        let v = qs[base + c];
        ss += v * v;
    }
    let inv = 1.0 / sqrt(wg_sum(vec4<f32>(ss, 0.0, 0.0, 0.0), ids).x / f32(d) + p.eps);
    for (var c = ids.lid; c < d; c += WG) {
        qs[base + c] = qk_w[w_off + c] * (qs[base + c] * inv);
    }
    workgroupBarrier();
}

// RoPE (NeoX halves) of the head_dim values of `qs` from `base` at position `p.pos`.
fn rope_qs(base: u32, lane: u32, half: u32) {
    let t = p.pos * half + lane;
    let c = cos_t[t];
    let s = sin_t[t];
    let a = qs[base + lane];
    let b = qs[base + half + lane];
    qs[base + lane] = a * c - b * s;
    qs[base + half + lane] = b * c + a * s;
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let idx = flat_wid(ids, p.nx);
    let kvh = idx % p.kv_heads;
    let split = idx / p.kv_heads;
    if split >= p.splits {
        return;
    }
    let d = p.head_dim;
    let half = d / 2u;
    let g_n = p.group;
    let nq = g_n * d;
    let qkv0 = p.row * (p.q_dim + 2u * p.kv_dim);

    // The group's queries: QK-norm, then RoPE at the new position.
    for (var e = ids.lid; e < nq; e += WG) {
        qs[e] = qkv[qkv0 + kvh * nq + e];
    }
    workgroupBarrier();
    if p.has_qk_norm != 0u {
        for (var g = 0u; g < g_n; g++) {
            norm_qs(g * d, 0u, ids);
        }
    }
    for (var e = ids.lid; e < g_n * half; e += WG) {
        rope_qs((e / half) * d, e % half, half);
    }

    let j0 = p.first + split * p.chunk;
    let j1 = min(j0 + p.chunk, p.pos + 1u);
    if j1 == p.pos + 1u {
        // This split holds the new position: its key (QK-norm, RoPE) and value into the
        // cache first, visible to this workgroup's reads below.
        let k0 = qkv0 + p.q_dim + kvh * d;
        for (var c = ids.lid; c < d; c += WG) {
            qs[nq + c] = qkv[k0 + c];
        }
        workgroupBarrier();
        if p.has_qk_norm != 0u {
            norm_qs(nq, d, ids);
        }
        for (var i = ids.lid; i < half; i += WG) {
            rope_qs(nq, i, half);
        }
        workgroupBarrier();
//#if KV_F16
        let dst = p.pos * p.kv_row + kvh * half;
        let v0 = k0 + p.kv_dim;
        for (var i = ids.lid; i < half; i += WG) {
            keys[dst + i] = kv_pack(vec2<f32>(qs[nq + 2u * i], qs[nq + 2u * i + 1u]));
            values[dst + i] = kv_pack(vec2<f32>(qkv[v0 + 2u * i], qkv[v0 + 2u * i + 1u]));
        }
//#else
        let dst = p.pos * p.kv_dim + kvh * d;
        for (var c = ids.lid; c < d; c += WG) {
            keys[dst + c] = qs[nq + c];
            values[dst + c] = qkv[k0 + p.kv_dim + c];
        }
//#endif
        storageBarrier();
    }
    if ids.lid < g_n {
        m_w[ids.lid] = LOW;
        l_w[ids.lid] = 0.0;
    }
    workgroupBarrier();

//#if KV_F16
    var acc2: array<vec2<f32>, MAX_PAIRS>;
//#else
    var acc: array<f32, MAX_ACC>;
//#endif
    for (var t0 = j0; t0 < j1; t0 += WG) {
        let n = min(WG, j1 - t0);
        // Scores: one key per invocation, against every query head of the group.
        if ids.lid < n {
            var s: array<f32, MAX_GROUP>;
//#if KV_F16
            let kb = (t0 + ids.lid) * p.kv_row + kvh * half;
            for (var c = 0u; c < d; c += 2u) {
                let kk = kv_unpack(keys[kb + c / 2u]);
                for (var g = 0u; g < g_n; g++) {
                    s[g] += qs[g * d + c] * kk.x;
                    s[g] += qs[g * d + c + 1u] * kk.y;
                }
            }
//#else
            let kb = (t0 + ids.lid) * p.kv_dim + kvh * d;
            for (var c = 0u; c < d; c++) {
                let kv = keys[kb + c];
                for (var g = 0u; g < g_n; g++) {
                    s[g] += qs[g * d + c] * kv;
                }
            }
//#endif
            for (var g = 0u; g < g_n; g++) {
                pt[g * WG + ids.lid] = s[g] * p.scale;
            }
        }
        workgroupBarrier();
        // Online softmax, one invocation per query head.
        if ids.lid < g_n {
            let g = ids.lid;
            var tmax = m_w[g];
            for (var i = 0u; i < n; i++) {
                tmax = max(tmax, pt[g * WG + i]);
            }
            let corr = exp(m_w[g] - tmax);
            var psum = 0.0;
            for (var i = 0u; i < n; i++) {
                let e = exp(pt[g * WG + i] - tmax);
                pt[g * WG + i] = e;
                psum += e;
            }
            l_w[g] = l_w[g] * corr + psum;
            m_w[g] = tmax;
            corr_w[g] = corr;
        }
        workgroupBarrier();
//#if KV_F16
        // Values: each invocation owns (head, pair of dimensions) accumulators; a pair is one
        // word of a value row.
        for (var a = 0u; a < MAX_PAIRS; a++) {
            let e = 2u * (ids.lid + a * WG);
            if e < nq {
                let g = e / d;
                let vb = t0 * p.kv_row + kvh * half + (e % d) / 2u;
                var v = acc2[a] * corr_w[g];
                for (var i = 0u; i < n; i++) {
                    v += pt[g * WG + i] * kv_unpack(values[vb + i * p.kv_row]);
                }
                acc2[a] = v;
            }
        }
//#else
        // Values: each invocation owns (head, dimension) accumulators.
        for (var a = 0u; a < MAX_ACC; a++) {
            let e = ids.lid + a * WG;
            if e < nq {
                let g = e / d;
                let vb = t0 * p.kv_dim + kvh * d + e % d;
                var v = acc[a] * corr_w[g];
                for (var i = 0u; i < n; i++) {
                    v += pt[g * WG + i] * values[vb + i * p.kv_dim];
                }
                acc[a] = v;
            }
        }
//#endif
        workgroupBarrier();
    }

    // The split's state per query head: d weighted sums, the max, the denominator.
    let stride = d + 2u;
    let base = (kvh * p.splits + split) * g_n * stride;
//#if KV_F16
    for (var a = 0u; a < MAX_PAIRS; a++) {
        let e = 2u * (ids.lid + a * WG);
        if e < nq {
            let o = base + (e / d) * stride + e % d;
            partial[o] = acc2[a].x;
            partial[o + 1u] = acc2[a].y;
        }
    }
//#else
    for (var a = 0u; a < MAX_ACC; a++) {
        let e = ids.lid + a * WG;
        if e < nq {
            partial[base + (e / d) * stride + e % d] = acc[a];
        }
    }
//#endif
    if ids.lid < g_n {
        partial[base + ids.lid * stride + d] = m_w[ids.lid];
        partial[base + ids.lid * stride + d + 1u] = l_w[ids.lid];
    }
}
