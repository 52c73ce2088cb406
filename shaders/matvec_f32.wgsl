// matvec_f32.wgsl: y = W x (+ b) for one row block of an F32 matrix, R = 4 rows and up to 4
// tokens per workgroup (matvec_common.wgsl). A 16-byte chunk is 4 weights, loaded as one
// vec4<f32>; rows are padded to whole chunks.
// TILED: the tiled product of prompt blocks (matmul_common.wgsl), which reads the weights
// through `w4`.

@group(0) @binding(4) var<storage, read> w: array<vec4<f32>>;

fn row_scale(row: u32) -> f32 {
    return 1.0;
}

//#if TILED
// TILED (matmul_common.wgsl): weights `c .. c + 3` of row `row` of the block (c a multiple
// of 4 within the padded row): one aligned vec4 load.
fn w4(row: u32, c: u32) -> vec4<f32> {
    return w[row * p.row_chunks + c / 4u];
}
//#endif

//#if TILED
@compute @workgroup_size(WG)
fn main(ids: Ids) {
    matmul(ids);
}
//#else
@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row0 = flat_wid(ids, p.nx) * R;
    let t0 = ids.wid.z * 4u;
    begin_tile(t0, ids);
    let nt = tile_tokens(t0);
    var base: array<u32, 4>;
    for (var r = 0u; r < R; r++) {
        base[r] = row_at(row0, r) * p.row_chunks;
    }
    var acc: array<vec4<f32>, 4>;
    for (var q = ids.lid; q < p.row_chunks; q += WG) {
        var wv: array<vec4<f32>, 4>;
        for (var r = 0u; r < R; r++) {
            wv[r] = w[base[r] + q];
        }
        for (var t = 0u; t < 4u; t++) {
            if t < nt {
                let xv = x4(t0, t, q * 4u);
                for (var r = 0u; r < R; r++) {
                    acc[r][t] += dot(wv[r], xv);
                }
            }
        }
    }
    finish(acc, row0, t0, ids);
}
//#endif
