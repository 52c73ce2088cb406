// kv_store.wgsl: stores a batch's keys and values in a layer's KV cache in VRAM, row r at
// position start_pos + r (cache layout [capacity, kv_dim]): n values from word src of the
// batch to word offset of the cache (a batched decode step stores each row in its own
// sequence's cache, one dispatch per row). A kernel rather than a buffer
// copy, so that the write-after-compute ordering is a storage barrier on every backend
// (wgpu's GL backend fences copies after compute writes more weakly). One invocation per
// value.

// `Params` is KvStoreParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read_write> keys: array<f32>;
@group(0) @binding(4) var<storage, read_write> values: array<f32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i = flat_wid(ids, p.nx) * WG + ids.lid;
    if i < p.n {
        keys[p.offset + i] = k[p.src + i];
        values[p.offset + i] = v[p.src + i];
    }
}
