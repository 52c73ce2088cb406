// glu.wgsl: the gated activation of a dense MLP layer, elementwise over a batch:
// act[n] = gated_activation(gate_up[2n], gate_up[2n + 1]) for n < rows * inter, where
// gate_up is the fused projection `[rows, 2 * inter]` with gate and up rows interleaved
// (the experts' layout, model::weights::ExpertWeights) and biases already added by the
// matrix-vector kernel; act is `[rows, inter]`. The activation (GPT-OSS's clipped SwiGLU
// or plain silu(gate) * up) is the recipe's, as in expert_gate_up.wgsl and the CPU's
// backend::cpu::moe::expert_forward.

// `Params` is GluParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> act: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let n = flat_wid(ids, p.nx) * WG + ids.lid;
    if n >= p.n {
        return;
    }
    act[n] = gated_activation(gate_up[2u * n], gate_up[2u * n + 1u], p.activation, p.limit, p.alpha);
}
