// matmul_common.wgsl: the tiled matrix-matrix product of prompt blocks, the TILED variants
// of the four dense product kernels (matvec_{f32,bf16,int8,int4}.wgsl). The loader prepends
// it after common.wgsl and decode.wgsl in place of matvec_common.wgsl: the same parameters
// (MatvecParams), the same bindings (0..3 here, the weights from 4 in the format's file),
// the same NORM and ACCUMULATE variants. `matmul` is the whole kernel; the format's file
// supplies `w4(row, c)` (four decoded weights of a row) and `row_scale(row)`, and its TILED
// entry point calls `matmul`.
//
// Why: the matrix-vector kernels load each weight once per 4 tokens, so a 64-token prompt
// block reads every dense matrix 16 times. Here a workgroup computes a TN x TM tile: TN = 32
// consecutive rows of the block (the row tile, `flat_wid`) for TM = 32 consecutive tokens
// (the token tile, the z of the grid). It walks the columns KC = 32 at a time: its 64
// invocations decode the tile's TN x KC weights (`w4`, four columns at a time, to f32) and
// load the TM x KC inputs (normalized in NORM variants) into workgroup memory, then each
// invocation accumulates a 4 x 4 block of (row, token) sums from there: rows tx, tx + 8,
// tx + 16, tx + 24 and tokens ty, ty + 8, ty + 16, ty + 24 of the tile (tx = lid % 8,
// ty = lid / 8). Each weight is read from memory once per 32 tokens. Token groups past the
// block's last token skip the arithmetic (a partial tile costs what its tokens need).
//
// Numerics: each (row, token) sum is one invocation's, over the columns in order, four at a
// time (`dot` of vec4s): a token's result does not depend on the other tokens of the block
// or on its place in a tile (tests/gpu_kernels.rs checks it bit for bit). It is not
// bit-identical to the matrix-vector kernels (whose 64 invocations split the columns and
// then reduce): equal within f32 rounding, and held to the same tolerance against the CPU.
// INT4's f16 group scale is folded into the decoded weights (q * scale is exact in f32);
// INT8's row scale multiplies the sum, as in the matrix-vector kernel and the CPU reference.
// Decode steps (one row) and batched steps never use these variants (the host's rule:
// `dense.rs`, `TILED_MIN_TOKENS`), so their numbers are the matrix-vector kernels'.
//
// Bounds hold by construction (the kernels are built without runtime bounds checks): rows
// are clamped to the block's last row and tokens to the last token (their results are never
// stored), weight columns to the last group of four holding a real column (within every
// format's padded row), input columns to the last column; columns past `cols` count as 0 in
// both the weights and the inputs.
//
// Variants:
// * NORM: `x` is the raw residual; token t's input is `norm_w[c] * (x[t][c] * inv_t)` with
//   `inv_t = 1 / sqrt(sum_c x[t][c]^2 / cols + eps)`, the sum of squares reduced exactly as
//   rmsnorm.wgsl reduces it (64 invocations striding the columns, then wg_sum, four tokens
//   per call), so the input equals rmsnorm.wgsl's output bit for bit and NORM equals
//   rms_norm then the product. The loader declares `norm_w`.
// * ACCUMULATE: `y[t][row] += W x + b` (the residual add fused into the product).

// `Params` is MatvecParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;

// Tokens per tile (the host's TILE_TOKENS).
const TM: u32 = 32u;
// Rows per tile (the host's TILE_ROWS).
const TN: u32 = 32u;
// Columns per step, and in groups of four.
const KC: u32 = 32u;
const K4: u32 = 8u;
// Stride in vec4s between the rows (tokens) of the tiles: K4 + 1, so that the 8 rows (or
// tokens) read together fall in different banks.
const KP: u32 = 9u;

// The step's decoded weights (row r's four-column groups at r * KP) and inputs (token t's
// at t * KP).
var<workgroup> ws: array<vec4<f32>, 288>;
var<workgroup> xs: array<vec4<f32>, 288>;

// NORM: the tile's 1 / rms per token, four tokens per vec4 (1 otherwise).
var<private> inv_rms: array<vec4<f32>, 8>;

// Call first, from uniform control flow: the NORM factors of the tile's tokens (tokens
// past the last read the last one's row).
fn begin_tiles(t0: u32, ids: Ids) {
    for (var j = 0u; j < TM / 4u; j++) {
//#if NORM
        let last = p.tokens - 1u;
        let t = t0 + 4u * j;
        var ss = vec4<f32>(0.0);
        for (var c = ids.lid; c < p.cols; c += WG) {
            let v = vec4<f32>(
                x[min(t, last) * p.cols + c],
                x[min(t + 1u, last) * p.cols + c],
                x[min(t + 2u, last) * p.cols + c],
                x[min(t + 3u, last) * p.cols + c],
            );
            ss += v * v;
        }
        let total = wg_sum(ss, ids);
        inv_rms[j] = 1.0 / sqrt(total / f32(p.cols) + p.eps);
//#else
        inv_rms[j] = vec4<f32>(1.0);
//#endif
    }
}

// Input column `c` of token `t` (< tokens), the tile's token `tt`, as the product sees it
// (normalized in NORM variants); 0 past `cols`.
fn x_in(t: u32, tt: u32, c: u32) -> f32 {
    let cc = min(c, p.cols - 1u);
//#if NORM
    let v = norm_w[cc] * (x[t * p.cols + cc] * inv_rms[tt / 4u][tt % 4u]);
//#else
    let v = x[t * p.cols + cc];
//#endif
    return select(0.0, v, c < p.cols);
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

// The kernel: the tile of rows `flat_wid * TN ..` and tokens `wid.z * TM ..`.
fn matmul(ids: Ids) {
    let row0 = flat_wid(ids, p.nx) * TN;
    let t0 = ids.wid.z * TM;
    begin_tiles(t0, ids);
    let tx = ids.lid % 8u;
    let ty = ids.lid / 8u;
    let last_row = p.rows - 1u;
    let last_token = p.tokens - 1u;
    // The last group of four columns holding a real column: inside every format's padded row.
    let last_c = ((p.cols - 1u) / 4u) * 4u;
    // acc[i][j]: row tx + 8 i, token ty + 8 j of the tile.
    var acc: array<vec4<f32>, 4>;
    let steps = (p.cols + KC - 1u) / KC;
    for (var s = 0u; s < steps; s++) {
        let k0 = s * KC;
        // TN == TM: element e is weight group (r, k) and input group (token r, k).
        for (var i = 0u; i < TN * K4 / WG; i++) {
            let e = ids.lid + i * WG;
            let r = e / K4;
            let k = e % K4;
            let c = k0 + 4u * k;
            let wv = w4(min(row0 + r, last_row), min(c, last_c));
            ws[r * KP + k] = select(vec4<f32>(0.0), wv, c < p.cols);
            let tt = r;
            let t = min(t0 + tt, last_token);
            xs[tt * KP + k] = vec4<f32>(x_in(t, tt, c), x_in(t, tt, c + 1u), x_in(t, tt, c + 2u), x_in(t, tt, c + 3u));
        }
        workgroupBarrier();
        for (var k = 0u; k < K4; k++) {
            var wv: array<vec4<f32>, 4>;
            for (var i = 0u; i < 4u; i++) {
                wv[i] = ws[(tx + 8u * i) * KP + k];
            }
            for (var j = 0u; j < 4u; j++) {
                if t0 + ty + 8u * j < p.tokens {
                    let xv = xs[(ty + 8u * j) * KP + k];
                    for (var i = 0u; i < 4u; i++) {
                        acc[i][j] += dot(wv[i], xv);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + tx + 8u * i;
        for (var j = 0u; j < 4u; j++) {
            let t = t0 + ty + 8u * j;
            if row < p.rows && t < p.tokens {
                store(t, row, row_scale(row) * acc[i][j]);
            }
        }
    }
}
