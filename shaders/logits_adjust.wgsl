// logits_adjust.wgsl: a sampler's logit bias and penalties applied in place to one row of
// logits, before they are ranked (logits_topk.wgsl). One invocation per entry of `adjust`,
// six words each (sample::LogitAdjust::words): token, add, scale_positive, scale_negative,
// subtract_once, subtract_counted. The entries name distinct tokens, so no two invocations
// write the same logit. The steps are those of LogitAdjust::apply on the host, each one
// correctly rounded f32 operation saturating at the largest finite magnitude, so both give
// the same bits; a non-finite logit is left as it is (the ranking reports it). An entry
// naming a token outside the vocabulary is skipped.

// `Params` is LogitsAdjustParams (src/backend/gpu/params.rs), declared by the loader.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read> adjust: array<u32>;

const BIG: f32 = 3.40282347e38;

fn finite(x: f32) -> f32 {
    return clamp(x, -BIG, BIG);
}

@compute @workgroup_size(WG)
fn main(ids: Ids) {
    let e = (ids.wid.y * p.nx + ids.wid.x) * WG + ids.lid;
    if e >= p.count {
        return;
    }
    let token = adjust[e * 6u];
    if token >= p.vocab {
        return;
    }
    let at = p.row_offset + token;
    var v = logits[at];
    if (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u {
        return;
    }
    v = finite(v + bitcast<f32>(adjust[e * 6u + 1u]));
    v = finite(select(v * bitcast<f32>(adjust[e * 6u + 3u]), v * bitcast<f32>(adjust[e * 6u + 2u]), v > 0.0));
    v = finite(v - bitcast<f32>(adjust[e * 6u + 4u]));
    v = finite(v - bitcast<f32>(adjust[e * 6u + 5u]));
    logits[at] = v;
}
