// router_topk.wgsl: the routing decision from router logits, one invocation per row: the k
// largest logits in descending order (ties: lower expert first), then their weights by the
// recipe's rule (`routing_code` in src/backend/gpu/backend.rs), as model::math::route:
// RULE_TOPK_SOFTMAX takes the softmax over just those k (GPT-OSS, route_top_k);
// RULE_SOFTMAX_TOPK takes the softmax over all experts at the chosen ones, and
// RULE_SOFTMAX_TOPK_RENORM also divides them by their sum (Qwen3-MoE with norm_topk_prob).
// A row of the routes buffer holds k expert indices followed by k weights (f32 bits).

// `Params` is RouterTopkParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> routes: array<u32>;

const MAX_K: u32 = 16u;
const RULE_TOPK_SOFTMAX: u32 = 0u;
const RULE_SOFTMAX_TOPK: u32 = 1u;
const RULE_SOFTMAX_TOPK_RENORM: u32 = 2u;

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
    let base = r * 2u * k;
    if p.rule == RULE_TOPK_SOFTMAX {
        var mx = vals[0];
        for (var i = 1u; i < k; i++) {
            mx = max(mx, vals[i]);
        }
        var denom = 0.0;
        for (var i = 0u; i < k; i++) {
            vals[i] = exp(vals[i] - mx);
            denom += vals[i];
        }
        for (var i = 0u; i < k; i++) {
            routes[base + i] = idx[i];
            routes[base + k + i] = bitcast<u32>(vals[i] / denom);
        }
        return;
    }
    // Softmax over every expert, evaluated at the k chosen: the largest logit is vals[0].
    let mx = vals[0];
    var denom = 0.0;
    for (var e = 0u; e < p.experts; e++) {
        denom += exp(logits[r * p.experts + e] - mx);
    }
    var sum = 0.0;
    for (var i = 0u; i < k; i++) {
        vals[i] = exp(vals[i] - mx) / denom;
        sum += vals[i];
    }
    if p.rule != RULE_SOFTMAX_TOPK_RENORM {
        sum = 1.0;
    }
    for (var i = 0u; i < k; i++) {
        routes[base + i] = idx[i];
        routes[base + k + i] = bitcast<u32>(vals[i] / sum);
    }
}
