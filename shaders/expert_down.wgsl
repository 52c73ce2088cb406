// expert_down.wgsl: the second half of every selected expert of a layer, in one dispatch
// for all (row, slot) pairs: contrib[pair][h] = W_down[h] . act[pair] + b_down[h]
// (unweighted; moe_combine.wgsl applies the routing weights in routing order). Slot
// lookup, pools and variants (F32, INT4, MXFP4) as in expert_gate_up.wgsl. One workgroup
// per (h, pair).
//
// COMBINE variant: one workgroup per (h, token row r) computes, over the row's k experts in
// routing order, `out[r][h] += sum_j w[r][j] * (W_down_j[h] . act[r][j] + b_j[h])` (binding
// 4 is then the residual): expert_down, moe_combine.wgsl and add.wgsl in one dispatch, with
// each term and the sum computed exactly as those three compute them (the same dot
// product code, reduction and order), so the result is bit-identical to the unfused chain.
// Valid only when the dispatch binds every resident expert (the backend checks); a
// non-resident expert contributes nothing.

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
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> act: array<f32>;
@group(0) @binding(2) var<storage, read> routes: array<u32>;
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> contrib: array<f32>;

const NO_SLOT: u32 = 0xffffffffu;

var<workgroup> wg_slot: u32;

// The slot of pair `pair`'s expert (uniform across the workgroup).
fn pair_slot(pair: u32, lid: u32) -> u32 {
    if lid == 0u {
        let r = pair / p.k;
        let e = routes[r * 2u * p.k + pair % p.k];
        wg_slot = slots[p.layer * p.experts + e];
    }
    return workgroupUniformLoad(&wg_slot);
}

// The slot's pool among the bound ones, or POOLS when it is not bound here.
fn local_pool(slot: u32) -> u32 {
    if slot == NO_SLOT {
        return POOLS;
    }
    let pool = slot / p.slots_per_pool;
    if pool < p.pool_first || pool >= p.pool_first + POOLS {
        return POOLS;
    }
    return pool - p.pool_first;
}

fn av(base: u32, c: u32) -> f32 {
    return select(0.0, act[base + c], c < p.inter);
}

// This invocation's share of W_down[h] . act[pair] for the expert in `slot` of bound pool
// `lp`: the same code for the plain and the COMBINE variants.
fn partial_dot(lp: u32, slot: u32, pair: u32, h: u32, lid: u32) -> f32 {
    let base = (slot % p.slots_per_pool) * p.stride;
    let ab = pair * p.inter;
    let row = base + p.w_off + h * p.row_words;
    var acc = 0.0;
//#if INT4
    let sc = h * p.groups;
    for (var wi = lid; wi < p.row_words; wi += WG) {
        let g = wi >> 3u;
        let c0 = g * 64u + (wi & 7u) * 4u;
        let word = pool_load(lp, row + wi);
        var s = 0.0;
        for (var b = 0u; b < 4u; b++) {
            s += (f32((word >> (8u * b)) & 15u) - 8.0) * av(ab, c0 + b)
                + (f32((word >> (8u * b + 4u)) & 15u) - 8.0) * av(ab, c0 + 32u + b);
        }
        let d = sc + g;
        acc += half_of(pool_load(lp, base + p.s_off + (d >> 1u)), (d & 1u) == 1u) * s;
    }
//#endif
//#if MXFP4
    let sc = h * p.groups;
    for (var wi = lid; wi < p.row_words; wi += WG) {
        let c0 = ab + wi * 8u;
        let word = pool_load(lp, row + wi);
        var s = 0.0;
        for (var j = 0u; j < 8u; j++) {
            s += fp4_x2(word >> (4u * j)) * act[c0 + j];
        }
        let d = sc + (wi >> 2u);
        acc += mx_scaled(s, (pool_load(lp, base + p.s_off + (d >> 2u)) >> (8u * (d & 3u))) & 255u);
    }
//#endif
//#if !INT4
//#if !MXFP4
    for (var c = lid; c < p.inter; c += WG) {
        acc += bitcast<f32>(pool_load(lp, row + c)) * act[ab + c];
    }
//#endif
//#endif
    return acc;
}

// The down bias `h` of the expert in `slot`.
fn down_bias(lp: u32, slot: u32, h: u32) -> f32 {
    return bitcast<f32>(pool_load(lp, (slot % p.slots_per_pool) * p.stride + p.b_off + h));
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let h = flat_wid(ids, p.nx);
//#if COMBINE
    let r = ids.wid.z;
    var sum = 0.0;
    for (var j = 0u; j < p.k; j++) {
        let pair = r * p.k + j;
        let slot = pair_slot(pair, ids.lid);
        let lp = local_pool(slot);
        if h < p.hidden && lp < POOLS {
            let total = wg_sum(vec4<f32>(partial_dot(lp, slot, pair, h, ids.lid), 0.0, 0.0, 0.0), ids).x;
            let term = total + down_bias(lp, slot, h);
            sum += bitcast<f32>(routes[r * 2u * p.k + p.k + j]) * term;
        }
    }
    if h < p.hidden && ids.lid == 0u {
        let i = r * p.hidden + h;
        contrib[i] = contrib[i] + sum;
    }
//#else
    let pair = p.pair_first + ids.wid.z;
    let slot = pair_slot(pair, ids.lid);
    let lp = local_pool(slot);
    if h >= p.hidden || lp >= POOLS {
        return;
    }
    let total = wg_sum(vec4<f32>(partial_dot(lp, slot, pair, h, ids.lid), 0.0, 0.0, 0.0), ids).x;
    if ids.lid == 0u {
        contrib[pair * p.hidden + h] = total + down_bias(lp, slot, h);
    }
//#endif
}
