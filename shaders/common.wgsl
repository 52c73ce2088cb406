// common.wgsl: the prelude of every Picchio compute shader (prepended by the loader).
//
// It enables the optional features a variant was built with, defines the invocation IDs
// every kernel's entry point receives, and the workgroup sum the reducing kernels share:
// subgroup operations where the adapter has SUBGROUP, a shared-memory tree otherwise. Every
// kernel runs workgroups of WG = 64 invocations.
//
// Variant lines: the loader keeps or drops the lines between `//#if NAME`, `//#else` and
// `//#endif` (NAME: F16, SUBGROUP, INT4, MXFP4, KV_F16), so this file alone is not valid WGSL.
// F16 only enables f16 types for the kernels that load f16 data directly (matvec_int4.wgsl);
// KV_F16 (an F16 key/value cache) needs no f16 types.
//#if F16
enable f16;
//#endif

const WG: u32 = 64u;

// Invocation IDs, as every kernel's `main` sees them; in SUBGROUP variants also the
// subgroup lane, index and count. A plain struct, not the entry point's input: a kernel
// declares its entry point as the one line `fn main(ids: Ids) {` and the loader
// (`entry_point` in src/backend/gpu/shaders.rs) writes that line as an entry point taking
// each builtin as its own argument and building `ids` from them. Subgroup builtins inside an
// entry-point struct have no HLSL semantic (HLSL reads them with WaveGetLaneIndex() and the
// like), and DXC refuses an entry-point struct member without one; as separate arguments
// naga emulates them.
struct Ids {
    lid: u32,
    wid: vec3<u32>,
//#if SUBGROUP
    sg_lane: u32,
    sg_id: u32,
    sg_count: u32,
//#endif
}

var<workgroup> red: array<vec4<f32>, 64>;

// The sum of `v` over the workgroup, returned to every invocation. Call it from uniform
// control flow only. The order of additions is fixed for a variant, so results repeat.
fn wg_sum(v: vec4<f32>, ids: Ids) -> vec4<f32> {
//#if SUBGROUP
    let s = subgroupAdd(v);
    if ids.sg_lane == 0u {
        red[ids.sg_id] = s;
    }
    workgroupBarrier();
    var t = vec4<f32>(0.0);
    for (var i = 0u; i < ids.sg_count; i++) {
        t += red[i];
    }
    workgroupBarrier();
    return t;
//#else
    red[ids.lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if ids.lid < s {
            red[ids.lid] += red[ids.lid + s];
        }
        workgroupBarrier();
    }
    let t = red[0];
    workgroupBarrier();
    return t;
//#endif
}

// Index of a workgroup in a 2-D grid of `nx` columns (large grids are folded into y).
fn flat_wid(ids: Ids, nx: u32) -> u32 {
    return ids.wid.y * nx + ids.wid.x;
}

// An f16 bit pattern (low or high half of `word`) widened to f32, exactly, with integer
// operations only (no f16 types, no unpack2x16float), so it runs on every backend.
fn half_of(word: u32, high: bool) -> f32 {
    let bits = select(word & 0xffffu, word >> 16u, high);
    let sign = select(1.0, -1.0, (bits & 0x8000u) != 0u);
    let e = (bits >> 10u) & 0x1fu;
    let m = bits & 0x3ffu;
    if e == 0u {
        // Zero or subnormal: m * 2^-24 (exact).
        return sign * f32(m) * 5.9604645e-8;
    }
    if e == 31u {
        return bitcast<f32>(((bits & 0x8000u) << 16u) | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(((bits & 0x8000u) << 16u) | ((e + 112u) << 23u) | (m << 13u));
}

// MXFP4 (the released GPT-OSS expert format, src/quant/mxfp4.rs): twice the E2M1 value of
// the code in the low 4 bits of `c` (bit 3 the sign). The doubled magnitudes 0, 1, 2, 3, 4,
// 6, 8, 12 of codes 0..7 fit a nibble each, so the lookup is one shift of a packed constant;
// the factor 2 is taken back in `mx_scaled`. Exact: small integers in f32.
fn fp4_x2(c: u32) -> f32 {
    let m = f32((0xc8643210u >> ((c & 7u) * 4u)) & 15u);
    return select(m, -m, (c & 8u) != 0u);
}

// `sum2 / 2 * 2^(e - 127)` for a block sum `sum2` of doubled E2M1 values times activations
// and its E8M0 scale byte `e`, as the CPU reference computes `2^(e - 127) * sum`. No
// subnormal scale is ever built (GPUs may flush subnormals): for e = 0, 2^-127 is applied as
// 2^-2 then 2^-126 (the smallest normal power); otherwise as 1/2 then 2^(e - 127). Each
// multiply is by a power of two, so the result is exactly the CPU's whenever it is a normal
// f32 (results below 2^-126 may be flushed to zero by the device). e = 255 (NaN in E8M0,
// refused by the container checks) gives infinity, as on the CPU.
fn mx_scaled(sum2: f32, e: u32) -> f32 {
    return (sum2 * select(0.5, 0.25, e == 0u)) * bitcast<f32>(max(e, 1u) << 23u);
}

// The gated activation of the expert and dense MLP kernels, from one gate and one up value
// (rows 2i and 2i + 1 of the fused gate/up projection, biases added), chosen by the
// recipe's activation code (`activation_code` in src/backend/gpu/backend.rs):
// ACT_CLAMPED_SWIGLU is GPT-OSS's (gate <= limit, |up| <= limit,
// (up + 1) * gate * sigmoid(alpha * gate), as model::math::swiglu_interleaved);
// ACT_SILU_GLU is the plain one (silu(gate) * up, no clamp, as
// model::math::silu_glu_interleaved).
const ACT_CLAMPED_SWIGLU: u32 = 0u;
const ACT_SILU_GLU: u32 = 1u;

fn gated_activation(gate_in: f32, up_in: f32, activation: u32, limit: f32, alpha: f32) -> f32 {
    if activation == ACT_SILU_GLU {
        return gate_in * (1.0 / (1.0 + exp(-gate_in))) * up_in;
    }
    let gate = min(gate_in, limit);
    let up = clamp(up_in, -limit, limit);
    let glu = gate * (1.0 / (1.0 + exp(-(gate * alpha))));
    return (up + 1.0) * glu;
}

//#if KV_F16
// An F16 key/value cache (the KV_F16 variants of kv_store, attention, attention_decode): two
// values per u32 word as IEEE binary16, the even column in the low half, with the core WGSL
// conversions (f32 arithmetic, no `enable f16`). Rows are ceil(kv_dim / 2) words.
// Largest finite binary16: values beyond it are saturated to it, since WGSL leaves the
// conversion of an out-of-range value indeterminate.
const KV_F16_MAX: f32 = 65504.0;

// Two values as one word. WGSL lets the conversion round to either neighbour; IEEE devices
// (and lavapipe, tests/gpu_fused.rs) round to nearest, a relative error of at most 2^-11.
fn kv_pack(v: vec2<f32>) -> u32 {
    return pack2x16float(clamp(v, vec2<f32>(-KV_F16_MAX), vec2<f32>(KV_F16_MAX)));
}

// Both values of a word, exactly (every binary16 value is an f32 value).
fn kv_unpack(w: u32) -> vec2<f32> {
    return unpack2x16float(w);
}

// The value of column parity `odd` (0: the low half, 1: the high half) of a word.
fn kv_half(w: u32, odd: u32) -> f32 {
    return unpack2x16float(w >> (odd * 16u)).x;
}
//#endif
