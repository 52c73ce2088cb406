// matvec_common.wgsl: what the four matrix-vector kernels (matvec_{f32,bf16,int8,int4}.wgsl)
// share, prepended to them by the loader after common.wgsl and decode.wgsl: the
// parameter binding, the input, output and bias bindings (1..3), the NORM prologue, the
// input loads, the reduction and the ACCUMULATE store.
//
// A dispatch computes `y = W x + b` for one row block [row_offset, row_offset + rows) of the
// matrix. A workgroup computes R = 4 consecutive rows for up to 4 tokens (t0 .. t0 + 4,
// the z of the grid): its 64 invocations stride over the rows' 16-byte chunks together
// (invocation i takes chunks i, i + 64, ...; neighbours read neighbouring 16 bytes), so
// each step issues R independent 16-byte weight loads per invocation and shares the input
// columns across the R rows. Rows are stored padded to whole 16-byte chunks (`row_chunks`,
// zero padding; src/backend/gpu/weights.rs), so every chunk load is aligned. Each chunk is
// decoded once and applied to each token of the tile by the same code (a loop over the
// tile's tokens), so a token's result is bit-identical whatever tile it is in: a row of a
// batched decode step equals the same row decoded alone. The partial
// sums of the R rows meet in one reduction (subgroup sums then one shared-memory pass; or a
// shared-memory tree), after the loop.
//
// Bounds hold by construction (the kernels are built without runtime bounds checks): row
// indices are clamped to the block's last row (their results are never stored), tokens
// stay below `tokens` (the NORM prologue clamps them to the last), input columns are
// clamped to the last column (and count as 0 past it), chunk indices stay below
// `row_chunks`.
//
// Variants:
// * NORM: `x` is the raw residual; token t's input is `norm_w[c] * (x[t][c] * inv_t)` with
//   `inv_t = 1 / sqrt(sum_c x[t][c]^2 / cols + eps)`: the expression of
//   model::math::rms_norm_in_place, with the sum of squares reduced exactly as
//   rmsnorm.wgsl reduces it (64 invocations striding the columns, then wg_sum), so the
//   input equals rmsnorm.wgsl's output bit for bit. The loader declares `norm_w`.
// * ACCUMULATE: `y[t][row] += W x + b` (the residual add fused into the product).

// `Params` is MatvecParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;

// Rows per workgroup.
const R: u32 = 4u;

// The R rows' partial sums: R per subgroup (SUBGROUP) or R x WG (the tree).
var<workgroup> part: array<vec4<f32>, 256>;

// NORM: the tile's 1 / rms per token (1 otherwise), set by `begin_tile`.
var<private> inv_rms: vec4<f32>;

// The raw input column `c` (< cols) of the tile's tokens; tokens past the last read the last
// one's column (in bounds; their results are never stored).
fn x_raw(t0: u32, c: u32) -> vec4<f32> {
    let last = p.tokens - 1u;
    return vec4<f32>(
        x[min(t0, last) * p.cols + c],
        x[min(t0 + 1u, last) * p.cols + c],
        x[min(t0 + 2u, last) * p.cols + c],
        x[min(t0 + 3u, last) * p.cols + c],
    );
}

// Input column `c` of token t0 + tt as the product sees it (normalized with the token's
// factor in NORM variants); 0 for columns past `cols` (padding), without reading past the
// input.
fn x1(t0: u32, tt: u32, c: u32) -> f32 {
    let cc = min(c, p.cols - 1u);
//#if NORM
    let v = norm_w[cc] * (x[(t0 + tt) * p.cols + cc] * inv_rms[tt]);
//#else
    let v = x[(t0 + tt) * p.cols + cc];
//#endif
    return select(0.0, v, c < p.cols);
}

// Input columns c .. c + 3 of token t0 + tt.
fn x4(t0: u32, tt: u32, c: u32) -> vec4<f32> {
    return vec4<f32>(x1(t0, tt, c), x1(t0, tt, c + 1u), x1(t0, tt, c + 2u), x1(t0, tt, c + 3u));
}

// Tokens of the tile (1 to 4).
fn tile_tokens(t0: u32) -> u32 {
    return min(4u, p.tokens - t0);
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

// Row `r` of the workgroup's R, clamped into the block (loads stay in bounds).
fn row_at(row0: u32, r: u32) -> u32 {
    return min(row0 + r, p.rows - 1u);
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

// Reduces the R rows' partial sums (vec4 over tokens) over the workgroup and stores the
// valid (row, token) results, times `row_scale(row)` (the INT8 row scale; 1 otherwise).
// Call from uniform control flow.
fn finish(acc: array<vec4<f32>, 4>, row0: u32, t0: u32, ids: Ids) {
//#if SUBGROUP
    for (var r = 0u; r < R; r++) {
        let s = subgroupAdd(acc[r]);
        if ids.sg_lane == 0u {
            part[ids.sg_id * R + r] = s;
        }
    }
    workgroupBarrier();
    if ids.lid < R * 4u {
        let r = ids.lid / 4u;
        let t = ids.lid % 4u;
        var v = 0.0;
        for (var i = 0u; i < ids.sg_count; i++) {
            v += part[i * R + r][t];
        }
        if row0 + r < p.rows && t0 + t < p.tokens {
            store(t0 + t, row0 + r, row_scale(row0 + r) * v);
        }
    }
//#else
    for (var r = 0u; r < R; r++) {
        part[r * WG + ids.lid] = acc[r];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if ids.lid < s {
            for (var r = 0u; r < R; r++) {
                part[r * WG + ids.lid] += part[r * WG + ids.lid + s];
            }
        }
        workgroupBarrier();
    }
    if ids.lid < R * 4u {
        let r = ids.lid / 4u;
        let t = ids.lid % 4u;
        if row0 + r < p.rows && t0 + t < p.tokens {
            store(t0 + t, row0 + r, row_scale(row0 + r) * part[r * WG][t]);
        }
    }
//#endif
}
