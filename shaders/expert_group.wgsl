// expert_group.wgsl: the (row, slot) pairs of a block grouped by expert, for the GROUPED
// expert kernels (one workgroup per expert and output block, over that expert's pairs).
// `order[e] .. order[e + 1]` are expert e's entries of `order[experts + 1 ..]`, each a pair
// index (row * k + slot), so `order[experts]` is the number of pairs. A counting sort in
// one workgroup: count each expert's pairs, prefix sums (invocation 0), scatter. The order
// of the pairs within an expert's entries is not fixed (atomics), and need not be: each
// pair's products are computed alone (expert_common.wgsl). Also adds the experts that have
// pairs (the block's union: weight passes of the grouped kernels) to counters[2] and the
// pairs to counters[3], which ride along with the next readback. Routed expert indices are
// clamped to the layer's experts, as the expert kernels clamp them.

// `Params` is ExpertGroupParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> routes: array<u32>;
@group(0) @binding(2) var<storage, read_write> order: array<u32>;
@group(0) @binding(3) var<storage, read_write> counters: array<atomic<u32>>;

// The most experts a layer may have (the backend checks).
const MAX_EXPERTS: u32 = 1024u;

var<workgroup> count: array<atomic<u32>, MAX_EXPERTS>;
var<workgroup> first: array<u32, MAX_EXPERTS>;

fn expert_of(pair: u32) -> u32 {
    return min(routes[(pair / p.k) * 2u * p.k + pair % p.k], p.experts - 1u);
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    for (var e = ids.lid; e < p.experts; e += WG) {
        atomicStore(&count[e], 0u);
    }
    workgroupBarrier();
    for (var q = ids.lid; q < p.pairs; q += WG) {
        atomicAdd(&count[expert_of(q)], 1u);
    }
    workgroupBarrier();
    if ids.lid == 0u {
        var run = 0u;
        var used = 0u;
        for (var e = 0u; e < p.experts; e++) {
            let c = atomicLoad(&count[e]);
            first[e] = run;
            order[e] = run;
            run += c;
            used += select(0u, 1u, c > 0u);
        }
        order[p.experts] = run;
        atomicAdd(&counters[2], used);
        atomicAdd(&counters[3], p.pairs);
    }
    workgroupBarrier();
    for (var e = ids.lid; e < p.experts; e += WG) {
        atomicStore(&count[e], 0u);
    }
    workgroupBarrier();
    for (var q = ids.lid; q < p.pairs; q += WG) {
        let e = expert_of(q);
        order[p.experts + 1u + first[e] + atomicAdd(&count[e], 1u)] = q;
    }
}
