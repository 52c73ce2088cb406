// rmsnorm_heads.wgsl: QK-norm. RMSNorm of every head_dim-wide slice of a `[rows,
// heads * head_dim]` activation, in place, with one weight vector of head_dim shared by
// every head (x = w * (x / sqrt(mean(x^2) + eps)) per slice, in f32, as
// model::math::rms_norm_in_place over each head on the CPU). The slices are contiguous, so
// slice s starts at s * head_dim whatever heads * head_dim is relative to the hidden size.
// One workgroup per slice; the sum of squares meets in wg_sum.

// `Params` is RmsNormHeadsParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let s = flat_wid(ids, p.nx);
    if s >= p.slices {
        return;
    }
    let base = s * p.head_dim;
    var ss = 0.0;
    for (var c = ids.lid; c < p.head_dim; c += WG) {
        let v = x[base + c];
        ss += v * v;
    }
    let total = wg_sum(vec4<f32>(ss, 0.0, 0.0, 0.0), ids).x;
    let inv = 1.0 / sqrt(total / f32(p.head_dim) + p.eps);
    for (var c = ids.lid; c < p.head_dim; c += WG) {
        x[base + c] = w[c] * (x[base + c] * inv);
    }
}
