// matvec_int4.wgsl: y = W x (+ b) for one row block of an INT4-gs64 matrix, R = 4 rows and
// up to 4 tokens per workgroup (matvec_common.wgsl). Layout (src/quant/int4.rs): per row,
// groups of 64 inputs, 32 code bytes each (byte j: element j in the low nibble, element
// j + 32 in the high nibble, as q + 8) and one f16 scale. A 16-byte chunk is half a group
// (bytes 16h .. 16h + 15: elements 16h .. 16h + 15 and 16h + 32 .. 16h + 47), loaded as one
// vec4<u32>; a word's 8 codes are decoded with two masks (`int4_lo`, `int4_hi`,
// decode.wgsl: exact, no conversions) once for all the tile's tokens, and the chunk's sum is
// multiplied by its group's scale once (one scale load per chunk). Rows are whole chunks
// (32-byte groups); inputs past `cols` count as zero.
// TILED: the tiled product of prompt blocks (matmul_common.wgsl), which reads the weights
// through `w4`.

@group(0) @binding(4) var<storage, read> codes: array<vec4<u32>>;
//#if F16
@group(0) @binding(5) var<storage, read> scales: array<f16>;
//#else
@group(0) @binding(5) var<storage, read> scales: array<u32>;
//#endif

fn row_scale(row: u32) -> f32 {
    return 1.0;
}

// The f16 scale `i` of the block, widened exactly (SHADER_F16: loaded as f16).
fn scale(i: u32) -> f32 {
//#if F16
    return f32(scales[i]);
//#else
    return f16_at(scales[i >> 1u], (i & 1u) == 1u);
//#endif
}

//#if TILED
// TILED (matmul_common.wgsl): weights `c .. c + 3` of row `row` of the block (c a multiple
// of 4 within the padded row, whole groups): group g = c / 64, code bytes b .. b + 3 with
// b = c % 32, the low nibbles for the group's first 32 elements and the high ones for the
// rest; times the group's scale (exact: a 4-bit integer times an f16 fits an f32).
fn w4(row: u32, c: u32) -> vec4<f32> {
    let g = c / 64u;
    let b = c % 32u;
    let word = codes[row * p.row_chunks + 2u * g + b / 16u][(b % 16u) / 4u];
    let q = select(int4_lo(word), int4_hi(word), (c % 64u) >= 32u);
    return scale(row * (p.row_chunks / 2u) + g) * q;
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
    let groups = p.row_chunks / 2u;
    var rows: array<u32, 4>;
    for (var r = 0u; r < R; r++) {
        rows[r] = row_at(row0, r);
    }
    var acc: array<vec4<f32>, 4>;
    for (var q = ids.lid; q < p.row_chunks; q += WG) {
        let g = q >> 1u;
        let c = g * 64u + (q & 1u) * 16u;
        var wv: array<vec4<u32>, 4>;
        var sc: array<f32, 4>;
        for (var r = 0u; r < R; r++) {
            wv[r] = codes[rows[r] * p.row_chunks + q];
            sc[r] = scale(rows[r] * groups + g);
        }
        var s: array<vec4<f32>, 4>;
        for (var i = 0u; i < 4u; i++) {
            var lo: array<vec4<f32>, 4>;
            var hi: array<vec4<f32>, 4>;
            for (var r = 0u; r < R; r++) {
                lo[r] = int4_lo(wv[r][i]);
                hi[r] = int4_hi(wv[r][i]);
            }
            for (var t = 0u; t < 4u; t++) {
                if t < nt {
                    let xl = x4(t0, t, c + 4u * i);
                    let xh = x4(t0, t, c + 4u * i + 32u);
                    for (var r = 0u; r < R; r++) {
                        s[r][t] += dot(lo[r], xl) + dot(hi[r], xh);
                    }
                }
            }
        }
        for (var r = 0u; r < R; r++) {
            acc[r] += sc[r] * s[r];
        }
    }
    finish(acc, row0, t0, ids);
}
//#endif
