// logits_topk.wgsl: the `k` most likely tokens of one row of logits, ranked, and the
// statistics of the whole row, so a sampled token reads back kilobytes instead of the
// vocabulary (sample::choose on the host decides the draw from them).
//
// A tournament over rounds (`stage`). Each workgroup sorts CHUNK entries in shared memory
// (a bitonic sort) and writes its first `k` to `dst` at `wid.x * k`; the next round ranks
// those, until one workgroup remains, whose `k` entries are the answer. Stage 0 reads the
// row at `row_offset` of `logits` (n = the vocabulary) and also writes, per workgroup, (its largest
// logit m, sum exp((l - m) / temperature), sum exp(l - m), count of non-finite logits) to
// `stats`, which the host merges (sample::LogitStats::merge). Later stages read (key,
// token) pairs from `src`; n is then the previous round's entry count.
//
// An entry is (key, token): the key orders logits as f32 values with -0 counted as +0
// (order_key), so "ranks before" is the larger key, or the lower token among equal keys
// (sample::ranks_before). Slots past n hold (0, NONE), after every real entry; the host
// drops NONE tokens (a vocabulary smaller than k). k <= CHUNK / 2, so every round at least
// halves the entries. One row per dispatch (the row being decoded).

// `Params` is LogitsTopkParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> src: array<u32>;
@group(0) @binding(3) var<storage, read_write> dst: array<u32>;
@group(0) @binding(4) var<storage, read_write> stats: array<u32>;

const CHUNK: u32 = 1024u;
const NONE: u32 = 0xffffffffu;

var<workgroup> keys: array<u32, CHUNK>;
var<workgroup> toks: array<u32, CHUNK>;

// Orders f32 values as unsigned integers (larger value, larger key); -0 as +0.
fn order_key(v: f32) -> u32 {
    let b = select(bitcast<u32>(v), 0u, v == 0.0);
    return select(b ^ 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// The value of a key (the inverse of order_key).
fn key_value(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k ^ 0x80000000u, (k & 0x80000000u) != 0u));
}

fn ranks_before(ka: u32, ta: u32, kb: u32, tb: u32) -> bool {
    return ka > kb || (ka == kb && ta < tb);
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let base = ids.wid.x * CHUNK;
    var bad = 0.0;
    for (var j = 0u; j < CHUNK / WG; j++) {
        let s = ids.lid + j * WG;
        let e = base + s;
        var key = 0u;
        var tok = NONE;
        if e < p.n {
            if p.stage == 0u {
                let v = logits[p.row_offset + e];
                if (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u {
                    bad += 1.0;
                }
                key = order_key(v);
                tok = e;
            } else {
                key = src[e * 2u];
                tok = src[e * 2u + 1u];
            }
        }
        keys[s] = key;
        toks[s] = tok;
    }
    workgroupBarrier();
    // Bitonic sort, "ranks before" first: blocks of `size` alternate direction until the
    // last, which is the whole chunk.
    for (var size = 2u; size <= CHUNK; size <<= 1u) {
        for (var stride = size / 2u; stride > 0u; stride >>= 1u) {
            for (var j = 0u; j < CHUNK / 2u / WG; j++) {
                let t = ids.lid + j * WG;
                let lo = (t / stride) * 2u * stride + t % stride;
                let hi = lo + stride;
                let forward = (lo & size) == 0u;
                let ka = keys[lo];
                let ta = toks[lo];
                let kb = keys[hi];
                let tb = toks[hi];
                if ranks_before(ka, ta, kb, tb) != forward {
                    keys[lo] = kb;
                    toks[lo] = tb;
                    keys[hi] = ka;
                    toks[hi] = ta;
                }
            }
            workgroupBarrier();
        }
    }
    for (var t = ids.lid; t < p.k; t += WG) {
        let at = (ids.wid.x * p.k + t) * 2u;
        dst[at] = keys[t];
        dst[at + 1u] = toks[t];
    }
    if p.stage != 0u {
        return;
    }
    // The chunk's statistics (stage 0 only, uniform across the workgroup).
    let m = key_value(keys[0]);
    var sums = vec4<f32>(0.0, 0.0, bad, 0.0);
    for (var j = 0u; j < CHUNK / WG; j++) {
        let s = ids.lid + j * WG;
        if toks[s] != NONE {
            let v = key_value(keys[s]);
            sums.x += exp((v - m) / p.temperature);
            sums.y += exp(v - m);
        }
    }
    let total = wg_sum(sums, ids);
    if ids.lid == 0u {
        let at = ids.wid.x * 4u;
        stats[at] = bitcast<u32>(m);
        stats[at + 1u] = bitcast<u32>(total.x);
        stats[at + 2u] = bitcast<u32>(total.y);
        stats[at + 3u] = u32(total.z);
    }
}
