// matvec_int8.wgsl: y = W x (+ b) for one row block of an INT8-per-row matrix (the output
// head and the embedding format), R = 4 rows and up to 4 tokens per workgroup
// (matvec_common.wgsl). A 16-byte chunk is 16 codes, loaded as one vec4<u32>; each word's
// four codes are decoded at once (`int8x4`, decode.wgsl: exact, no conversions). The row's
// f32 scale multiplies the reduced sum, as in the CPU reference (`scale * sum q x`). Rows are
// padded to whole chunks.
// TILED: the tiled product of prompt blocks (matmul_common.wgsl), which reads the weights
// through `w4`.

@group(0) @binding(4) var<storage, read> codes: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> scales: array<f32>;

fn row_scale(row: u32) -> f32 {
    return scales[row];
}

//#if TILED
// TILED (matmul_common.wgsl): codes `c .. c + 3` of row `row` of the block (c a multiple of
// 4 within the padded row): one word, decoded exactly; the row scale multiplies the sum.
fn w4(row: u32, c: u32) -> vec4<f32> {
    return int8x4(codes[row * p.row_chunks + c / 16u][(c % 16u) / 4u]);
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
        var wv: array<vec4<u32>, 4>;
        for (var r = 0u; r < R; r++) {
            wv[r] = codes[base[r] + q];
        }
        let c = q * 16u;
        for (var i = 0u; i < 4u; i++) {
            var q4: array<vec4<f32>, 4>;
            for (var r = 0u; r < R; r++) {
                q4[r] = int8x4(wv[r][i]);
            }
            for (var t = 0u; t < 4u; t++) {
                if t < nt {
                    let xv = x4(t0, t, c + 4u * i);
                    for (var r = 0u; r < R; r++) {
                        acc[r][t] += dot(q4[r], xv);
                    }
                }
            }
        }
    }
    finish(acc, row0, t0, ids);
}
//#endif
