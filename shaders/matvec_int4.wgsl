// matvec_int4.wgsl: y = W x (+ b) for one row block of an INT4-gs64 matrix, up to 4 tokens
// per workgroup. Layout (src/quant/int4.rs): per row, groups of 64 inputs, 32 code bytes
// each (byte j: element j in the low nibble, element j + 32 in the high nibble, as q + 8)
// and one f16 scale. Each invocation takes one u32 of codes (8 values) per step; inputs
// past `cols` count as zero. Otherwise as matvec_f32.wgsl.

@group(0) @binding(4) var<storage, read> codes: array<u32>;
//#if F16
@group(0) @binding(5) var<storage, read> scales: array<f16>;
//#else
@group(0) @binding(5) var<storage, read> scales: array<u32>;
//#endif

// The f16 scale `i` of the block, widened (SHADER_F16: loaded as f16; else decoded from
// the u32 holding it).
fn scale(i: u32) -> f32 {
//#if F16
    return f32(scales[i]);
//#else
    return half_of(scales[i >> 1u], (i & 1u) == 1u);
//#endif
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row = flat_wid(ids, p.nx);
    let t0 = ids.wid.z * 4u;
    begin_tile(t0, ids);
    let groups = (p.cols + 63u) / 64u;
    let row_words = groups * 8u;
    var acc = vec4<f32>(0.0);
    if row < p.rows {
        for (var wi = ids.lid; wi < row_words; wi += WG) {
            let g = wi >> 3u;
            let c0 = g * 64u + (wi & 7u) * 4u;
            let word = codes[row * row_words + wi];
            var s = vec4<f32>(0.0);
            for (var b = 0u; b < 4u; b++) {
                let lo = f32((word >> (8u * b)) & 15u) - 8.0;
                let hi = f32((word >> (8u * b + 4u)) & 15u) - 8.0;
                s += lo * xs(t0, c0 + b) + hi * xs(t0, c0 + 32u + b);
            }
            acc += scale(row * groups + g) * s;
        }
    }
    let total = wg_sum(acc, ids);
    if row < p.rows && ids.lid < 4u && t0 + ids.lid < p.tokens {
        store(t0 + ids.lid, row, total[ids.lid]);
    }
}
