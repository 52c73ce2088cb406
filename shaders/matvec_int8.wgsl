// matvec_int8.wgsl: y = W x (+ b) for one row block of an INT8-per-row matrix (the output
// head and the embedding format), R = 4 rows and up to 4 tokens per workgroup
// (matvec_common.wgsl). A 16-byte chunk is 16 codes, loaded as one vec4<u32>; each word's
// four codes are decoded at once (`int8x4`, decode.wgsl: exact, no conversions). The row's
// f32 scale multiplies the reduced sum, as in the CPU reference (`scale * sum q x`). Rows are
// padded to whole chunks.

@group(0) @binding(4) var<storage, read> codes: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> scales: array<f32>;

fn row_scale(row: u32) -> f32 {
    return scales[row];
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row0 = flat_wid(ids, p.nx) * R;
    let t0 = ids.wid.z * 4u;
    begin_tile(t0, ids);
    var base: array<u32, 4>;
    for (var r = 0u; r < R; r++) {
        base[r] = row_at(row0, r) * p.row_chunks;
    }
    var acc: array<vec4<f32>, 4>;
    if p.tokens - t0 == 1u {
        for (var q = ids.lid; q < p.row_chunks; q += WG) {
            var wv: array<vec4<u32>, 4>;
            for (var r = 0u; r < R; r++) {
                wv[r] = codes[base[r] + q];
            }
            let c = q * 16u;
            let xa = x4(t0, c);
            let xb = x4(t0, c + 4u);
            let xc = x4(t0, c + 8u);
            let xd = x4(t0, c + 12u);
            for (var r = 0u; r < R; r++) {
                acc[r].x += dot(int8x4(wv[r].x), xa) + dot(int8x4(wv[r].y), xb)
                    + dot(int8x4(wv[r].z), xc) + dot(int8x4(wv[r].w), xd);
            }
        }
    } else {
        for (var q = ids.lid; q < p.row_chunks; q += WG) {
            var wv: array<vec4<u32>, 4>;
            for (var r = 0u; r < R; r++) {
                wv[r] = codes[base[r] + q];
            }
            let c = q * 16u;
            for (var i = 0u; i < 4u; i++) {
                let xa = xs(t0, c + 4u * i);
                let xb = xs(t0, c + 4u * i + 1u);
                let xc = xs(t0, c + 4u * i + 2u);
                let xd = xs(t0, c + 4u * i + 3u);
                for (var r = 0u; r < R; r++) {
                    let q4 = int8x4(wv[r][i]);
                    acc[r] += q4.x * xa + q4.y * xb + q4.z * xc + q4.w * xd;
                }
            }
        }
    }
    finish(acc, row0, t0, ids);
}
