// matvec_bf16.wgsl: y = W x (+ b) for one row block of a BF16 matrix, R = 4 rows and up to
// 4 tokens per workgroup (matvec_common.wgsl). The weights stay BF16 in VRAM: a 16-byte
// chunk is 8 weights, loaded as one vec4<u32> and widened exactly to f32 (a bf16 is the
// upper half of an f32): even elements by a shift, odd ones by a mask. Rows are padded to
// whole chunks.
// TILED: the tiled product of prompt blocks (matmul_common.wgsl), which reads the weights
// through `w4`.

@group(0) @binding(4) var<storage, read> w: array<vec4<u32>>;

fn row_scale(row: u32) -> f32 {
    return 1.0;
}

//#if TILED
// TILED (matmul_common.wgsl): weights `c .. c + 3` of row `row` of the block (c a multiple
// of 4 within the padded row): words (c % 8) / 2 and the next of the chunk, each an even
// element (low half) and an odd one (high half), widened exactly.
fn w4(row: u32, c: u32) -> vec4<f32> {
    let q = row * p.row_chunks + c / 8u;
    let k = (c % 8u) / 2u;
    let a = w[q][k];
    let b = w[q][k + 1u];
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xffff0000u, b << 16u, b & 0xffff0000u));
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
        var we: array<vec4<f32>, 4>;
        var wo: array<vec4<f32>, 4>;
        for (var r = 0u; r < R; r++) {
            let v = w[base[r] + q];
            we[r] = bf16_even(v);
            wo[r] = bf16_odd(v);
        }
        let c = q * 8u;
        for (var t = 0u; t < 4u; t++) {
            if t < nt {
                let xe = vec4<f32>(x1(t0, t, c), x1(t0, t, c + 2u), x1(t0, t, c + 4u), x1(t0, t, c + 6u));
                let xo = vec4<f32>(x1(t0, t, c + 1u), x1(t0, t, c + 3u), x1(t0, t, c + 5u), x1(t0, t, c + 7u));
                for (var r = 0u; r < R; r++) {
                    acc[r][t] += dot(we[r], xe) + dot(wo[r], xo);
                }
            }
        }
    }
    finish(acc, row0, t0, ids);
}
//#endif
