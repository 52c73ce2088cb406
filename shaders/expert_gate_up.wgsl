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
// NORM variant: `x` is the raw residual and the pair's input row is RMS-normalized inside
// each workgroup (`norm_w`, declared by the loader after the pools, and `eps`), as
// matvec_common.wgsl describes: the input equals rmsnorm.wgsl's output bit for bit.

// `Params` is ExpertGateUpParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> routes: array<u32>;
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

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i0 = flat_wid(ids, p.nx) * 2u;
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
    let t = wg_sum(partial(lp, slot, 2u * i0, xb, ids.lid), ids);
    let i = i0 + ids.lid;
    if ids.lid < 2u && i < p.inter {
        let b = (slot % p.slots_per_pool) * p.stride + p.b_off + 2u * i;
        let gate = select(t.x, t.z, ids.lid == 1u) + bitcast<f32>(pool_load(lp, b));
        let up = select(t.y, t.w, ids.lid == 1u) + bitcast<f32>(pool_load(lp, b + 1u));
        act[pair * p.inter + i] = gated_activation(gate, up, p.activation, p.limit, p.alpha);
    }
}
