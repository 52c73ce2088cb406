// kv_store.wgsl: stores a batch's keys and values in a layer's KV cache in VRAM, row r at
// position start_pos + r (cache layout [capacity, kv_row] words): n words from value src of
// the batch to word offset of the cache (a batched decode step stores each row in its own
// sequence's cache, one dispatch per row). A kernel rather than a buffer
// copy, so that the write-after-compute ordering is a storage barrier on every backend
// (wgpu's GL backend fences copies after compute writes more weakly). One invocation per
// cache word: in F32 a word is a value (kv_row = kv_dim); in KV_F16 a word is two adjacent
// values of a row packed as binary16 (kv_row = ceil(kv_dim / 2), an odd row's last word
// padded with 0).

// `Params` is KvStoreParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
//#if KV_F16
@group(0) @binding(3) var<storage, read_write> keys: array<u32>;
@group(0) @binding(4) var<storage, read_write> values: array<u32>;
//#else
@group(0) @binding(3) var<storage, read_write> keys: array<f32>;
@group(0) @binding(4) var<storage, read_write> values: array<f32>;
//#endif

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let i = flat_wid(ids, p.nx) * WG + ids.lid;
    if i < p.n {
//#if KV_F16
        let r = i / p.kv_row;
        let c = 2u * (i % p.kv_row);
        let s = p.src + r * p.kv_dim + c;
        var k2 = vec2<f32>(k[s], 0.0);
        var v2 = vec2<f32>(v[s], 0.0);
        if c + 1u < p.kv_dim {
            k2.y = k[s + 1u];
            v2.y = v[s + 1u];
        }
        keys[p.offset + i] = kv_pack(k2);
        values[p.offset + i] = kv_pack(v2);
//#else
        keys[p.offset + i] = k[p.src + i];
        values[p.offset + i] = v[p.src + i];
//#endif
    }
}
