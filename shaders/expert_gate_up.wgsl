// expert_gate_up.wgsl: the first half of every selected expert of a layer, in one dispatch
// for all (row, slot) pairs: gate/up rows of the fused projection, plus bias, through the
// recipe's gated activation (gate = row 2i, up = row 2i + 1; `gated_activation` in
// common.wgsl: GPT-OSS's clipped SwiGLU or the plain silu(gate) * up), written to
// act[pair][i].
//
// The pair's expert comes from the routes on the GPU and its VRAM slot from the slot
// table (layer * experts + expert), so no CPU round trip is needed when every expert is
// resident. Slots live in up to POOLS storage buffers ("pools", declared by the loader);
// a dispatch serves the pools pool_first .. pool_first + POOLS and skips pairs whose expert
// is elsewhere or not resident. Variants by slot format (INT4-gs64, MXFP4, F32) and the
// product itself are in expert_common.wgsl; slot offsets follow the container record
// (src/backend/gpu/vram.rs).
//
// A workgroup computes two intermediate indices i0, i0 + 1 (the four consecutive rows
// 2 i0 .. 2 i0 + 3 of the projection) of one pair (z): its 64 invocations stride over the
// rows' 16-byte chunks, the four partial sums meet in one wg_sum, and invocations 0 and 1
// apply the biases and the activation.
//
// GROUPED variant: workgroup (i0, e = wid.z) computes the same two intermediate indices
// for every pair routed to expert e (expert_group.wgsl's order), in tiles of TOKENS pairs
// that share each weight chunk it loads, so a prompt block reads each expert of its union
// once. Each pair's sums are computed as the per-pair kernel computes them.
//
// NORM variant: `x` is the raw residual and the pair's input row is RMS-normalized inside
// each workgroup (`norm_w`, declared by the loader after the pools, and `eps`), as
// matvec_common.wgsl describes: the input equals rmsnorm.wgsl's output bit for bit.

// `Params` is ExpertGateUpParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
//#if GROUPED
@group(0) @binding(2) var<storage, read> order: array<u32>;
//#else
@group(0) @binding(2) var<storage, read> routes: array<u32>;
//#endif
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> act: array<f32>;

// NORM: 1 / rms of the pair's input row, set before the product.
var<private> inv_rms: f32;

fn row_count() -> u32 {
    return 2u * p.inter;
}

// Input `c` of the row at `base` (normalized in NORM variants: `norm_w[c] * (x[c] * inv)`
// as rmsnorm.wgsl writes it), 0 past `hidden` (INT4 padding), never read out of bounds.
fn in_at(base: u32, c: u32) -> f32 {
    let cc = min(c, p.hidden - 1u);
//#if NORM
    let v = norm_w[cc] * (x[base + cc] * inv_rms);
//#else
    let v = x[base + cc];
//#endif
    return select(0.0, v, c < p.hidden);
}

// The bias, gate and up of intermediate index `i` (< inter) for a pair whose product
// rows 2i and 2i + 1 summed to `gate_sum` and `up_sum`, through the activation.
fn activated(lp: u32, slot: u32, i: u32, gate_sum: f32, up_sum: f32) -> f32 {
    let b = (slot % p.slots_per_pool) * p.stride + p.b_off + 2u * i;
    let gate = gate_sum + bitcast<f32>(pool_load(lp, b));
    let up = up_sum + bitcast<f32>(pool_load(lp, b + 1u));
    return gated_activation(gate, up, p.activation, p.limit, p.alpha);
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i0 = flat_wid(ids, p.nx) * 2u;
//#if GROUPED
    if i0 >= p.inter {
        return;
    }
    let slot = expert_slot(p.pair_first + ids.wid.z, ids.lid);
    let range = expert_range();
    let lp = local_pool(slot);
    if lp >= POOLS {
        return;
    }
    let i = i0 + ids.lid;
    for (var t0 = range.x; t0 < range.y; t0 += TOKENS) {
        var pairs: array<u32, TOKENS>;
        var ib: array<u32, TOKENS>;
        for (var t = 0u; t < TOKENS; t++) {
            pairs[t] = entry_pair(min(t0 + t, range.y - 1u));
            ib[t] = (pairs[t] / p.k) * p.hidden;
        }
        let parts = partial(lp, slot, 2u * i0, ib, ids.lid);
        for (var t = 0u; t < TOKENS; t++) {
            let s = wg_sum(parts[t], ids);
            if ids.lid < 2u && i < p.inter && t0 + t < range.y {
                let g = select(s.x, s.z, ids.lid == 1u);
                let u = select(s.y, s.w, ids.lid == 1u);
                act[pairs[t] * p.inter + i] = activated(lp, slot, i, g, u);
            }
        }
    }
//#else
    let pair = p.pair_first + ids.wid.z;
    let r = pair / p.k;
    let slot = pair_slot(pair, ids.lid);
    let lp = local_pool(slot);
    if i0 >= p.inter || lp >= POOLS {
        return;
    }
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
    let t = wg_sum(partial(lp, slot, 2u * i0, array<u32, TOKENS>(xb), ids.lid)[0], ids);
    let i = i0 + ids.lid;
    if ids.lid < 2u && i < p.inter {
        act[pair * p.inter + i] =
            activated(lp, slot, i, select(t.x, t.z, ids.lid == 1u), select(t.y, t.w, ids.lid == 1u));
    }
//#endif
}
