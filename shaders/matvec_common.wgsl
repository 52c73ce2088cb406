// matvec_common.wgsl: what the four matrix-vector kernels (matvec_{f32,bf16,int8,int4}.wgsl)
// share, prepended to them by the loader after common.wgsl: the parameters, the input,
// output and bias bindings (1..3), the NORM prologue, the input loads and the ACCUMULATE
// store.
//
// A dispatch computes `y = W x + b` for one row block [row_offset, row_offset + rows) of the
// matrix, tokens t0 .. t0 + 4 of the batch per workgroup (z). Variants:
// * NORM: `x` is the raw residual; token t's input is `norm_w[c] * (x[t][c] * inv_t)` with
//   `inv_t = 1 / sqrt(sum_c x[t][c]^2 / cols + eps)`: the expression of
//   model::math::rms_norm_in_place, with the sum of squares reduced exactly as
//   rmsnorm.wgsl reduces it (64 invocations striding the columns, then wg_sum), so the
//   input equals rmsnorm.wgsl's output bit for bit. The loader declares `norm_w`.
// * ACCUMULATE: `y[t][row] += W x + b` (the residual add fused into the product).

struct Params {
    rows: u32,
    cols: u32,
    row_offset: u32,
    out_stride: u32,
    tokens: u32,
    has_bias: u32,
    nx: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;

// NORM: the tile's 1 / rms per token (1 otherwise), set by `begin_tile`.
var<private> inv_rms: vec4<f32>;

// The raw input column `c` (< cols) of the tile's tokens; tokens past the last read the last
// one's column (in bounds; their results are never stored).
fn x_raw(t0: u32, c: u32) -> vec4<f32> {
    let last = p.tokens - 1u;
    let base0 = min(t0, last) * p.cols + c;
    let base1 = min(t0 + 1u, last) * p.cols + c;
    let base2 = min(t0 + 2u, last) * p.cols + c;
    let base3 = min(t0 + 3u, last) * p.cols + c;
    return vec4<f32>(x[base0], x[base1], x[base2], x[base3]);
}

// Input column `c` of the tile's tokens as the product sees it (normalized in NORM
// variants); 0 for columns past `cols` (padding), without reading past the input.
fn xs(t0: u32, c: u32) -> vec4<f32> {
    let v = x_raw(t0, min(c, p.cols - 1u));
//#if NORM
    let n = norm_w[min(c, p.cols - 1u)] * (v * inv_rms);
    return select(vec4<f32>(0.0), n, c < p.cols);
//#else
    return select(vec4<f32>(0.0), v, c < p.cols);
//#endif
}

// Call first, from uniform control flow: computes the NORM factors of the tile's tokens.
fn begin_tile(t0: u32, ids: Ids) {
//#if NORM
    var ss = vec4<f32>(0.0);
    for (var c = ids.lid; c < p.cols; c += WG) {
        let v = x_raw(t0, c);
        ss += v * v;
    }
    let total = wg_sum(ss, ids);
    inv_rms = 1.0 / sqrt(total / f32(p.cols) + p.eps);
//#else
    inv_rms = vec4<f32>(1.0);
//#endif
}

// Stores `v` (the product of row `row` of the block for token `t`) plus the bias: assigned,
// or added to the output in ACCUMULATE variants.
fn store(t: u32, row: u32, v: f32) {
    var s = v;
    if p.has_bias != 0u {
        s += bias[p.row_offset + row];
    }
    let i = t * p.out_stride + p.row_offset + row;
//#if ACCUMULATE
    y[i] = y[i] + s;
//#else
    y[i] = s;
//#endif
}
