// matvec_f32.wgsl: y = W x (+ b) for one row block of an F32 matrix, up to 4 tokens per
// workgroup (z). One workgroup per output row: the 64 invocations stride over the columns
// and their partial sums meet in wg_sum. The block's rows are [row_offset, row_offset +
// rows) of the whole matrix (matrices larger than a storage binding are split by rows).

@group(0) @binding(4) var<storage, read> w: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row = flat_wid(ids, p.nx);
    let t0 = ids.wid.z * 4u;
    begin_tile(t0, ids);
    var acc = vec4<f32>(0.0);
    if row < p.rows {
        let base = row * p.cols;
        for (var c = ids.lid; c < p.cols; c += WG) {
            acc += w[base + c] * xs(t0, c);
        }
    }
    let total = wg_sum(acc, ids);
    if row < p.rows && ids.lid < 4u && t0 + ids.lid < p.tokens {
        store(t0 + ids.lid, row, total[ids.lid]);
    }
}
