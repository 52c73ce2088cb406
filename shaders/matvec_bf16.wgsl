// matvec_bf16.wgsl: y = W x (+ b) for one row block of a BF16 matrix, up to 4 tokens per
// workgroup. The weights stay BF16 in VRAM: pairs are read as u32 and each half widened
// exactly to f32 (bf16 is the upper half of an f32). Otherwise as matvec_f32.wgsl.

@group(0) @binding(4) var<storage, read> w: array<u32>;

// Element `e` of the block (little-endian: even elements in the low half of a word).
fn weight(e: u32) -> f32 {
    let word = w[e >> 1u];
    return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (e & 1u) == 1u));
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row = flat_wid(ids, p.nx);
    let t0 = ids.wid.z * 4u;
    begin_tile(t0, ids);
    var acc = vec4<f32>(0.0);
    if row < p.rows {
        let base = row * p.cols;
        for (var c = ids.lid; c < p.cols; c += WG) {
            acc += weight(base + c) * xs(t0, c);
        }
    }
    let total = wg_sum(acc, ids);
    if row < p.rows && ids.lid < 4u && t0 + ids.lid < p.tokens {
        store(t0 + ids.lid, row, total[ids.lid]);
    }
}
