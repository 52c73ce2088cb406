// router_topk.wgsl: the routing decision from router logits, one invocation per row: the k
// largest logits in descending order (ties: lower expert first), then the softmax over
// just those k (as model::math::route_top_k). A row of the routes buffer holds k expert
// indices followed by k weights (f32 bits).

struct Params {
    rows: u32,
    experts: u32,
    k: u32,
    nx: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> routes: array<u32>;

const MAX_K: u32 = 16u;

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let r = flat_wid(ids, p.nx) * WG + ids.lid;
    if r >= p.rows {
        return;
    }
    var vals: array<f32, MAX_K>;
    var idx: array<u32, MAX_K>;
    var n = 0u;
    let k = p.k;
    for (var e = 0u; e < p.experts; e++) {
        let v = logits[r * p.experts + e];
        // Position after every kept value >= v (the earlier expert wins a tie).
        var pos = n;
        while pos > 0u && vals[pos - 1u] < v {
            pos -= 1u;
        }
        if pos >= k {
            continue;
        }
        var j = select(k - 1u, n, n < k);
        while j > pos {
            vals[j] = vals[j - 1u];
            idx[j] = idx[j - 1u];
            j -= 1u;
        }
        vals[pos] = v;
        idx[pos] = e;
        if n < k {
            n += 1u;
        }
    }
    var mx = vals[0];
    for (var i = 1u; i < k; i++) {
        mx = max(mx, vals[i]);
    }
    var denom = 0.0;
    for (var i = 0u; i < k; i++) {
        vals[i] = exp(vals[i] - mx);
        denom += vals[i];
    }
    let base = r * 2u * k;
    for (var i = 0u; i < k; i++) {
        routes[base + i] = idx[i];
        routes[base + k + i] = bitcast<u32>(vals[i] / denom);
    }
}
