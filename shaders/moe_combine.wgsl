// moe_combine.wgsl: the weighted accumulate of the MoE block: out[r] = sum_j w[r][j] *
// contrib[r][j], summed in routing order j = 0..k (as the CPU backend), where contrib holds
// each selected expert's output including its down bias. One invocation per (row, output).

// `Params` is MoeCombineParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> contrib: array<f32>;
@group(0) @binding(2) var<storage, read> routes: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i = flat_wid(ids, p.nx) * WG + ids.lid;
    if i >= p.rows * p.hidden {
        return;
    }
    let r = i / p.hidden;
    let c = i % p.hidden;
    var acc = 0.0;
    for (var j = 0u; j < p.k; j++) {
        let w = bitcast<f32>(routes[r * 2u * p.k + p.k + j]);
        acc += w * contrib[(r * p.k + j) * p.hidden + c];
    }
    out[i] = acc;
}
