// add.wgsl: the residual add, y += x, one invocation per element.

// `Params` is AddParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i = flat_wid(ids, p.nx) * WG + ids.lid;
    if i < p.n {
        y[i] += x[i];
    }
}
