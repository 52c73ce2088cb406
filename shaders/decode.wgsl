// decode.wgsl: exact weight decodes shared by the product kernels (matvec_*.wgsl and the
// expert kernels), prepended by the loader after common.wgsl.
//
// Integers become floats without an int-to-float conversion: a byte `b` OR-ed into the
// mantissa of 2^23 (bits 0x4b000000) is the float 2^23 + b exactly, so subtracting
// 2^23 + bias gives `b - bias` exactly (all values are small integers). Four bytes of a
// word are decoded at once as a vec4.

// The four bytes of `u` (byte 0 first) minus `bias`, as floats. `bias` is 2^23 plus the
// code offset: 8388608.0 for unsigned bytes, 8388616.0 (8) for INT4 nibbles (q + 8),
// 8388736.0 (128) for INT8 codes with their sign bits flipped.
fn bytes_minus(u: u32, bias: f32) -> vec4<f32> {
    let b = vec4<u32>(u & 0xffu, (u >> 8u) & 0xffu, (u >> 16u) & 0xffu, u >> 24u);
    return bitcast<vec4<f32>>(b | vec4<u32>(0x4b000000u)) - vec4<f32>(bias);
}

// INT4-gs64 (src/quant/int4.rs): the low nibbles of the 4 code bytes in `w` (elements j ..
// j + 3 of a group) as q = code - 8.
fn int4_lo(w: u32) -> vec4<f32> {
    return bytes_minus(w & 0x0f0f0f0fu, 8388616.0);
}

// The high nibbles of the 4 code bytes in `w` (elements j + 32 .. j + 35 of a group).
fn int4_hi(w: u32) -> vec4<f32> {
    return bytes_minus((w >> 4u) & 0x0f0f0f0fu, 8388616.0);
}

// Four signed INT8 codes (two's complement bytes, byte 0 first) as floats: flipping each
// sign bit maps -128..127 to 0..255, then `bytes_minus` removes the 128.
fn int8x4(w: u32) -> vec4<f32> {
    return bytes_minus(w ^ 0x80808080u, 8388736.0);
}

// BF16 pairs: the even elements (low halves) and odd elements (high halves) of four words.
fn bf16_even(v: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(v << vec4<u32>(16u));
}

fn bf16_odd(v: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(v & vec4<u32>(0xffff0000u));
}

// The f16 in the low (`high` false) or high half of `word`, widened exactly with integer
// operations and selects (no branches, no f16 types: `unpack2x16float` needs a capability
// some backends lack). Normal halves: the exponent and mantissa moved into f32 position
// (a normal f32 of value h * 2^-112) times 2^112; subnormal halves (which a device might
// flush if built as f32 subnormals) as m * 2^-24; infinities and NaN kept.
fn f16_at(word: u32, high: bool) -> f32 {
    let bits = select(word & 0xffffu, word >> 16u, high);
    let e = bits & 0x7c00u;
    let m = bits & 0x3ffu;
    let normal = bitcast<f32>((bits & 0x7fffu) << 13u) * bitcast<f32>(0x77800000u);
    let sub = f32(m) * bitcast<f32>(0x33800000u);
    let special = bitcast<f32>(0x7f800000u | (m << 13u));
    let mag = select(select(normal, sub, e == 0u), special, e == 0x7c00u);
    return bitcast<f32>(bitcast<u32>(mag) | ((bits & 0x8000u) << 16u));
}

// MXFP4 (src/quant/mxfp4.rs): twice the E2M1 values of the four codes in the low nibbles
// of the bytes of `u` (mask a word with 0x0f0f0f0f first, or shift it right by 4), built as
// f32 bits: a code s e1 e0 m with exponent e > 0 is 2^e * (1 + m/2) (biased exponent
// 127 + e, top mantissa bit m), with e = 0 it is m (1.0 or 0), bit 3 the sign. Exact (the
// doubled magnitudes 0, 1, 2, 3, 4, 6, 8, 12); no subnormal is built. The factor 2 is
// taken back in `mx_scaled` (common.wgsl).
fn fp4x4_x2(u: u32) -> vec4<f32> {
    let c = vec4<u32>(u & 0xfu, (u >> 8u) & 0xfu, (u >> 16u) & 0xfu, (u >> 24u) & 0xfu);
    let e = (c >> vec4<u32>(1u)) & vec4<u32>(3u);
    let m = c & vec4<u32>(1u);
    let normal = ((e + vec4<u32>(127u)) << vec4<u32>(23u)) | (m << vec4<u32>(22u));
    let mag = select(m * 0x3f800000u, normal, e != vec4<u32>(0u));
    return bitcast<vec4<f32>>(mag | ((c & vec4<u32>(8u)) << vec4<u32>(28u)));
}
