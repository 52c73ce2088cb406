// rope.wgsl: rotary embedding in place, NeoX style (the two contiguous halves of a head
// form the pairs): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. The dispatch covers rows
// row0 .. row0 + rows of x; row row0 + r is at position start_pos + r (a batched decode
// step rotates each row by its own position, one dispatch per row). cos/sin come from tables [capacity, head_dim / 2] computed on the CPU
// with the YaRN frequencies and attention factor (model::rope), so large angles are exact.
// One invocation per (row, head, pair).

// `Params` is RopeParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> cos_t: array<f32>;
@group(0) @binding(3) var<storage, read> sin_t: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let gid = flat_wid(ids, p.nx) * WG + ids.lid;
    if gid >= p.total {
        return;
    }
    let half = p.head_dim / 2u;
    let i = gid % half;
    let h = (gid / half) % p.heads;
    let r = gid / (half * p.heads);
    let base = (p.row0 + r) * p.width + h * p.head_dim;
    let t = (p.start_pos + r) * half + i;
    let c = cos_t[t];
    let s = sin_t[t];
    let a = x[base + i];
    let b = x[base + half + i];
    x[base + i] = a * c - b * s;
    x[base + half + i] = b * c + a * s;
}
