// rmsnorm.wgsl: y = w * (x / sqrt(mean(x^2) + eps)), row by row, in f32 (as
// model::math::rms_norm). One workgroup per row; the sum of squares meets in wg_sum.

// `Params` is RmsNormParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let row = flat_wid(ids, p.nx);
    if row >= p.rows {
        return;
    }
    let base = row * p.width;
    var ss = 0.0;
    for (var c = ids.lid; c < p.width; c += WG) {
        let v = x[base + c];
        ss += v * v;
    }
    let total = wg_sum(vec4<f32>(ss, 0.0, 0.0, 0.0), ids).x;
    let inv = 1.0 / sqrt(total / f32(p.width) + p.eps);
    for (var c = ids.lid; c < p.width; c += WG) {
        y[base + c] = w[c] * (x[base + c] * inv);
    }
}
