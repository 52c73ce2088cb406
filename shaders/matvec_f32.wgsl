// matvec_f32.wgsl: y = W x (+ b) for one row block of an F32 matrix, up to 4 tokens per
// workgroup (z). One workgroup per output row: the 64 invocations stride over the columns
// and their partial sums meet in wg_sum. The block's rows are [row_offset, row_offset +
// rows) of the whole matrix (matrices larger than a storage binding are split by rows).

struct Params {
    rows: u32,
    cols: u32,
    row_offset: u32,
    out_stride: u32,
    tokens: u32,
    has_bias: u32,
    nx: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read> w: array<f32>;

// Input column `c` of the tile's tokens (0 past the last token).
fn xs(t0: u32, c: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var t = 0u; t < 4u; t++) {
        if t0 + t < p.tokens {
            v[t] = x[(t0 + t) * p.cols + c];
        }
    }
    return v;
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row = flat_wid(ids, p.nx);
    let t0 = ids.wid.z * 4u;
    var acc = vec4<f32>(0.0);
    if row < p.rows {
        let base = row * p.cols;
        for (var c = ids.lid; c < p.cols; c += WG) {
            acc += w[base + c] * xs(t0, c);
        }
    }
    let total = wg_sum(acc, ids);
    if row < p.rows && ids.lid < 4u && t0 + ids.lid < p.tokens {
        var v = total[ids.lid];
        if p.has_bias != 0u {
            v += bias[p.row_offset + row];
        }
        y[(t0 + ids.lid) * p.out_stride + p.row_offset + row] = v;
    }
}
