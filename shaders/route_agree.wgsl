// route_agree.wgsl: scores a routing prediction (router L+1 applied to layer L's
// normalized activation) against the exact routing of layer L+1, on the GPU so that full
// residency needs no readback for it: counters[0] += experts predicted and used,
// counters[1] += experts used. One invocation per row.

// `Params` is RouteAgreeParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> predicted: array<u32>;
@group(0) @binding(2) var<storage, read> actual: array<u32>;
@group(0) @binding(3) var<storage, read_write> counters: array<atomic<u32>>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let r = flat_wid(ids, p.nx) * WG + ids.lid;
    if r >= p.rows {
        return;
    }
    let base = r * 2u * p.k;
    var hits = 0u;
    for (var i = 0u; i < p.k; i++) {
        let e = predicted[base + i];
        for (var j = 0u; j < p.k; j++) {
            if actual[base + j] == e {
                hits += 1u;
            }
        }
    }
    atomicAdd(&counters[0], hits);
    atomicAdd(&counters[1], p.k);
}
