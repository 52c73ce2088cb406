// expert_gate_up.wgsl: the first half of every selected expert of a layer, in one dispatch
// for all (row, slot) pairs: gate/up rows of the fused projection, plus bias, through the
// recipe's gated activation (gate = row 2i, up = row 2i + 1; `gated_activation` in
// common.wgsl: GPT-OSS's clipped SwiGLU or the plain silu(gate) * up), written to
// act[pair][i].
//
// The pair's expert comes from the routes on the GPU and its VRAM slot from the slot
// table (layer * experts + expert), so no CPU round trip is needed when every expert is
// resident. Slots live in up to POOLS storage buffers ("pools", declared by the loader
// with `pool_load`); a dispatch serves the pools pool_first .. pool_first + POOLS and skips
// pairs whose expert is elsewhere or not resident. INT4 variant: records in the INT4-gs64
// layout of src/quant/int4.rs; MXFP4 variant: E2M1 codes (a word is 8 elements, low nibble
// first) and E8M0 scale bytes (4 a word, `groups` = blocks of 32 a row), each word's 8
// products summed and scaled by its block's power of two (`mx_scaled`, common.wgsl);
// otherwise F32 rows. Slot offsets follow the container record (src/backend/gpu/vram.rs).
// One workgroup per (i, pair).
//
// NORM variant: `x` is the raw residual and the pair's input row is RMS-normalized inside
// each workgroup (`norm_w`, declared by the loader after the pools, and `eps`), as
// matvec_common.wgsl describes: the input equals rmsnorm.wgsl's output bit for bit.

struct Params {
    layer: u32,
    k: u32,
    experts: u32,
    hidden: u32,
    inter: u32,
    pool_first: u32,
    slots_per_pool: u32,
    stride: u32,
    w_off: u32,
    s_off: u32,
    b_off: u32,
    row_words: u32,
    groups: u32,
    nx: u32,
    pair_first: u32,
    limit: f32,
    alpha: f32,
    activation: u32,
    eps: f32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> routes: array<u32>;
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> act: array<f32>;

const NO_SLOT: u32 = 0xffffffffu;

var<workgroup> wg_slot: u32;

// NORM: 1 / rms of the pair's input row, set before the product.
var<private> inv_rms: f32;

// Input `c` (< hidden) of the row at `base`: normalized in NORM variants,
// `norm_w[c] * (x[c] * inv)` as rmsnorm.wgsl writes it.
fn xin(base: u32, c: u32) -> f32 {
//#if NORM
    return norm_w[c] * (x[base + c] * inv_rms);
//#else
    return x[base + c];
//#endif
}

// Input `c` of the row, 0 past `hidden` (INT4 padding), never read out of bounds.
fn xv(base: u32, c: u32) -> f32 {
    return select(0.0, xin(base, min(c, p.hidden - 1u)), c < p.hidden);
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i = flat_wid(ids, p.nx);
    let pair = p.pair_first + ids.wid.z;
    let r = pair / p.k;
    if ids.lid == 0u {
        let e = routes[r * 2u * p.k + pair % p.k];
        wg_slot = slots[p.layer * p.experts + e];
    }
    let slot = workgroupUniformLoad(&wg_slot);
    if i >= p.inter || slot == NO_SLOT {
        return;
    }
    let pool = slot / p.slots_per_pool;
    if pool < p.pool_first || pool >= p.pool_first + POOLS {
        return;
    }
    let lp = pool - p.pool_first;
    let base = (slot % p.slots_per_pool) * p.stride;
    let xb = r * p.hidden;
//#if NORM
    // The sum of squares reduced exactly as rmsnorm.wgsl reduces it, so the normalized
    // input equals its output bit for bit.
    var ss = 0.0;
    for (var c = ids.lid; c < p.hidden; c += WG) {
        let v = x[xb + c];
        ss += v * v;
    }
    let total_ss = wg_sum(vec4<f32>(ss, 0.0, 0.0, 0.0), ids).x;
    inv_rms = 1.0 / sqrt(total_ss / f32(p.hidden) + p.eps);
//#endif
    let g_row = base + p.w_off + (2u * i) * p.row_words;
    let u_row = g_row + p.row_words;
    var acc = vec4<f32>(0.0);
//#if INT4
    let g_sc = (2u * i) * p.groups;
    let u_sc = g_sc + p.groups;
    for (var wi = ids.lid; wi < p.row_words; wi += WG) {
        let g = wi >> 3u;
        let c0 = g * 64u + (wi & 7u) * 4u;
        let wg = pool_load(lp, g_row + wi);
        let wu = pool_load(lp, u_row + wi);
        var sg = 0.0;
        var su = 0.0;
        for (var b = 0u; b < 4u; b++) {
            let xl = xv(xb, c0 + b);
            let xh = xv(xb, c0 + 32u + b);
            sg += (f32((wg >> (8u * b)) & 15u) - 8.0) * xl + (f32((wg >> (8u * b + 4u)) & 15u) - 8.0) * xh;
            su += (f32((wu >> (8u * b)) & 15u) - 8.0) * xl + (f32((wu >> (8u * b + 4u)) & 15u) - 8.0) * xh;
        }
        let dg = g_sc + g;
        let du = u_sc + g;
        acc.x += half_of(pool_load(lp, base + p.s_off + (dg >> 1u)), (dg & 1u) == 1u) * sg;
        acc.y += half_of(pool_load(lp, base + p.s_off + (du >> 1u)), (du & 1u) == 1u) * su;
    }
//#endif
//#if MXFP4
    let g_sc = (2u * i) * p.groups;
    let u_sc = g_sc + p.groups;
    let sc = base + p.s_off;
    for (var wi = ids.lid; wi < p.row_words; wi += WG) {
        let c0 = wi * 8u;
        let wg = pool_load(lp, g_row + wi);
        let wu = pool_load(lp, u_row + wi);
        var sg = 0.0;
        var su = 0.0;
        for (var j = 0u; j < 8u; j++) {
            let xc = xin(xb, c0 + j);
            sg += fp4_x2(wg >> (4u * j)) * xc;
            su += fp4_x2(wu >> (4u * j)) * xc;
        }
        let dg = g_sc + (wi >> 2u);
        let du = u_sc + (wi >> 2u);
        acc.x += mx_scaled(sg, (pool_load(lp, sc + (dg >> 2u)) >> (8u * (dg & 3u))) & 255u);
        acc.y += mx_scaled(su, (pool_load(lp, sc + (du >> 2u)) >> (8u * (du & 3u))) & 255u);
    }
//#endif
//#if !INT4
//#if !MXFP4
    for (var c = ids.lid; c < p.hidden; c += WG) {
        let xc = xin(xb, c);
        acc.x += bitcast<f32>(pool_load(lp, g_row + c)) * xc;
        acc.y += bitcast<f32>(pool_load(lp, u_row + c)) * xc;
    }
//#endif
//#endif
    let total = wg_sum(acc, ids);
    if ids.lid == 0u {
        let gate = total.x + bitcast<f32>(pool_load(lp, base + p.b_off + 2u * i));
        let up = total.y + bitcast<f32>(pool_load(lp, base + p.b_off + 2u * i + 1u));
        act[pair * p.inter + i] = gated_activation(gate, up, p.activation, p.limit, p.alpha);
    }
}
