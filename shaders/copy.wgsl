// copy.wgsl: dst[dst_offset + i] = src[src_offset + i] for n words (row selection for the
// head, token groups of oversized products). A kernel rather than a buffer copy for the
// same reason as kv_store.wgsl. One invocation per word.

// `Params` is CopyParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i = flat_wid(ids, p.nx) * WG + ids.lid;
    if i < p.n {
        dst[p.dst_offset + i] = src[p.src_offset + i];
    }
}
