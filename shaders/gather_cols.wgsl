// gather_cols.wgsl: out[r][c] = src[r][col0 + c] for `rows` rows of `width` columns from a
// source of `src_width` columns: a column range of a row-major activation (the Q, K or V
// part of the fused Q/K/V projection) as an activation of its own.

// `Params` is GatherColsParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i = flat_wid(ids, p.nx) * WG + ids.lid;
    if i < p.rows * p.width {
        let r = i / p.width;
        out[i] = src[r * p.src_width + p.col0 + i % p.width];
    }
}
