// argmax.wgsl: the greedy token of each row of logits, so a decoded token reads back 8
// bytes instead of the vocabulary. Two stages (`stage`): 0, workgroup (b, r) scans
// elements b * span .. of row r and writes its best (value bits, index, a non-finite flag)
// to `partial[r * blocks + b]`; 1, one workgroup per row reduces the row's blocks and
// writes (index, non-finite flag) to `result[r]`. The best is the largest value, the lower
// index among equal ones (model::math::argmax_with_margin); a NaN or an infinity anywhere
// in the row sets the flag, which the backend reports as the sampler does.

// `Params` is ArgmaxParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> partial: array<u32>;
@group(0) @binding(3) var<storage, read_write> result: array<u32>;

var<workgroup> best_v: array<f32, 64>;
var<workgroup> best_i: array<u32, 64>;
var<workgroup> bad: array<u32, 64>;

const NONE: u32 = 0xffffffffu;

fn non_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u;
}

// Whether (v, i) beats (w, j): larger, or equal with the lower index; no index beats none.
fn beats(v: f32, i: u32, w: f32, j: u32) -> bool {
    return i != NONE && (j == NONE || v > w || (v == w && i < j));
}

// Tree reduction of the workgroup's candidates into slot 0. Uniform control flow.
fn reduce(ids: Ids) {
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if ids.lid < s {
            let o = ids.lid + s;
            if beats(best_v[o], best_i[o], best_v[ids.lid], best_i[ids.lid]) {
                best_v[ids.lid] = best_v[o];
                best_i[ids.lid] = best_i[o];
            }
            bad[ids.lid] |= bad[o];
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let r = ids.wid.y;
    var v = 0.0;
    var i = NONE;
    var flag = 0u;
    if p.stage == 0u {
        let b = ids.wid.x;
        let start = b * p.span;
        let end = min(start + p.span, p.vocab);
        for (var e = start + ids.lid; e < end; e += WG) {
            let x = logits[r * p.vocab + e];
            if non_finite(x) {
                flag = 1u;
            } else if beats(x, e, v, i) {
                v = x;
                i = e;
            }
        }
    } else {
        for (var b = ids.lid; b < p.blocks; b += WG) {
            let at = (r * p.blocks + b) * 3u;
            let x = bitcast<f32>(partial[at]);
            let e = partial[at + 1u];
            flag |= partial[at + 2u];
            if beats(x, e, v, i) {
                v = x;
                i = e;
            }
        }
    }
    best_v[ids.lid] = v;
    best_i[ids.lid] = i;
    bad[ids.lid] = flag;
    reduce(ids);
    if ids.lid == 0u {
        if p.stage == 0u {
            let at = (r * p.blocks + ids.wid.x) * 3u;
            partial[at] = bitcast<u32>(best_v[0]);
            partial[at + 1u] = best_i[0];
            partial[at + 2u] = bad[0];
        } else {
            result[r * 2u] = best_i[0];
            result[r * 2u + 1u] = bad[0];
        }
    }
}
