// matvec_int8.wgsl: y = W x (+ b) for one row block of an INT8-per-row matrix (the output
// head and the embedding format), up to 4 tokens per workgroup. Codes are read four to a
// u32 and sign-extended; the row's f32 scale multiplies the reduced sum, as in the CPU
// reference (`scale * sum q x`). Otherwise as matvec_f32.wgsl.

@group(0) @binding(4) var<storage, read> codes: array<u32>;
@group(0) @binding(5) var<storage, read> scales: array<f32>;

// Code `e` of the block as a float (-127..=127).
fn code(e: u32) -> f32 {
    return f32(extractBits(bitcast<i32>(codes[e >> 2u]), (e & 3u) * 8u, 8u));
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row = flat_wid(ids, p.nx);
    let t0 = ids.wid.z * 4u;
    begin_tile(t0, ids);
    var acc = vec4<f32>(0.0);
    if row < p.rows {
        let base = row * p.cols;
        // Four consecutive columns per step, so neighbouring invocations read neighbouring words.
        for (var c0 = ids.lid * 4u; c0 < p.cols; c0 += WG * 4u) {
            for (var u = 0u; u < 4u; u++) {
                let c = c0 + u;
                if c < p.cols {
                    acc += code(base + c) * xs(t0, c);
                }
            }
        }
    }
    let total = wg_sum(acc, ids);
    if row < p.rows && ids.lid < 4u && t0 + ids.lid < p.tokens {
        store(t0 + ids.lid, row, scales[row] * total[ids.lid]);
    }
}
