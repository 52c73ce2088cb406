// expert_down.wgsl: the second half of every selected expert of a layer, in one dispatch
// for all (row, slot) pairs: contrib[pair][h] = W_down[h] . act[pair] + b_down[h]
// (unweighted; moe_combine.wgsl applies the routing weights in routing order). Slot
// lookup, pools and slot formats as in expert_gate_up.wgsl (the product is
// expert_common.wgsl's). A workgroup computes four consecutive outputs h0 .. h0 + 3 of one
// pair (z); their partial sums meet in one wg_sum.
//
// GROUPED variant: workgroup (h0, e = wid.z) computes the same four outputs for every pair
// routed to expert e (expert_group.wgsl's order), in tiles of TOKENS pairs that share each
// weight chunk it loads; each pair's sums are computed as the per-pair kernel computes them.
//
// COMBINE variant: a workgroup computes outputs h0 .. h0 + 3 of one token row r (z) over
// its k experts in routing order, `out[r][h] += sum_j w[r][j] * (W_down_j[h] . act[r][j] +
// b_j[h])` (binding 4 is then the residual): expert_down, moe_combine.wgsl and add.wgsl in
// one dispatch, each term and the sum computed exactly as those three compute them (the
// same product code and reduction, the same order), so the result is bit-identical to the
// unfused chain. Valid only when the dispatch binds every resident expert (the backend
// checks); a non-resident expert would contribute nothing.

// `Params` is ExpertDownParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> act: array<f32>;
//#if GROUPED
@group(0) @binding(2) var<storage, read> order: array<u32>;
//#else
@group(0) @binding(2) var<storage, read> routes: array<u32>;
//#endif
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> contrib: array<f32>;

fn row_count() -> u32 {
    return p.hidden;
}

// Input `c` of the activation row at `base`, 0 past `inter` (INT4 padding).
fn in_at(base: u32, c: u32) -> f32 {
    return select(0.0, act[base + min(c, p.inter - 1u)], c < p.inter);
}

// The down bias `h` of the expert in `slot` of bound pool `lp`.
fn down_bias(lp: u32, slot: u32, h: u32) -> f32 {
    return bitcast<f32>(pool_load(lp, (slot % p.slots_per_pool) * p.stride + p.b_off + h));
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let h0 = flat_wid(ids, p.nx) * 4u;
    let h = h0 + ids.lid;
//#if GROUPED
    if h0 >= p.hidden {
        return;
    }
    let slot = expert_slot(p.pair_first + ids.wid.z, ids.lid);
    let range = expert_range();
    let lp = local_pool(slot);
    if lp >= POOLS {
        return;
    }
    for (var t0 = range.x; t0 < range.y; t0 += TOKENS) {
        var pairs: array<u32, TOKENS>;
        var ib: array<u32, TOKENS>;
        for (var t = 0u; t < TOKENS; t++) {
            pairs[t] = entry_pair(min(t0 + t, range.y - 1u));
            ib[t] = pairs[t] * p.inter;
        }
        let parts = partial(lp, slot, h0, ib, ids.lid);
        for (var t = 0u; t < TOKENS; t++) {
            let s = wg_sum(parts[t], ids);
            if ids.lid < 4u && h < p.hidden && t0 + t < range.y {
                contrib[pairs[t] * p.hidden + h] = s[ids.lid] + down_bias(lp, slot, h);
            }
        }
    }
//#else
//#if COMBINE
    let r = ids.wid.z;
    var sum = 0.0;
    for (var j = 0u; j < p.k; j++) {
        let pair = r * p.k + j;
        let slot = pair_slot(pair, ids.lid);
        let lp = local_pool(slot);
        if h0 < p.hidden && lp < POOLS {
            let t = wg_sum(partial(lp, slot, h0, array<u32, TOKENS>(pair * p.inter), ids.lid)[0], ids);
            if ids.lid < 4u && h < p.hidden {
                let term = t[ids.lid] + down_bias(lp, slot, h);
                sum += bitcast<f32>(routes[r * 2u * p.k + p.k + j]) * term;
            }
        }
    }
    if ids.lid < 4u && h < p.hidden {
        let i = r * p.hidden + h;
        contrib[i] = contrib[i] + sum;
    }
//#else
    let pair = p.pair_first + ids.wid.z;
    let slot = pair_slot(pair, ids.lid);
    let lp = local_pool(slot);
    if h0 >= p.hidden || lp >= POOLS {
        return;
    }
    let t = wg_sum(partial(lp, slot, h0, array<u32, TOKENS>(pair * p.inter), ids.lid)[0], ids);
    if ids.lid < 4u && h < p.hidden {
        contrib[pair * p.hidden + h] = t[ids.lid] + down_bias(lp, slot, h);
    }
//#endif
//#endif
}
