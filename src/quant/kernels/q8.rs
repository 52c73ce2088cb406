//! Activations quantized to INT8 in groups of 64, for the integer (AVX-512 VNNI) kernels.
//!
//! The float kernels multiply the weights' codes by the f32 activations. The integer kernels
//! instead quantize the activations once per matrix-vector product and do the inner products
//! in exact integer arithmetic, which changes the numerics. This module defines that math:
//! [`QuantizedX::new`] is the (only) quantizer, and [`int4_dot_reference`] and
//! [`int8_dot_reference`] are the plain-loop definitions every integer kernel is tested against.
//!
//! # Quantization
//! Group `g` (inputs `64 g .. 64 g + 64`, zero-padded past the end) gets the scale
//! `s_g = a_g / 127` with `a_g = max |x_i|`, and codes `p_i = round(x_i * (127 / a_g))` in
//! `-127..=127` (all zero, with `s_g = 0`, when the group is zero). A group holding a NaN gets
//! `s_g = NaN`, so the products it enters are NaN, as they would be in f32; an infinite
//! input gives an infinite scale and zero codes, so NaN as well.
//!
//! # Error against the float references
//! Each input is represented to within half a step: `|x_i - p_i s_g| <= s_g / 2` (up to a few
//! float roundings, `s_g (1/2 + 2^-14)` bounds it). So for one INT4-gs64 row with group scales
//! `d_g` and codes `q_i`,
//!
//! `|int4_dot_reference - int4::dot_reference| <= sum_g |d_g| a_g / 254 * sum_{i in g} |q_i|`
//!
//! plus f32 rounding (about `(64 + groups) * 2^-24 * sum |terms|`), and the same with the one
//! row scale for INT8. Relative to the magnitude of the dot product the bound is `1/254`
//! of `sum |d q| a / |dot|`; on random data the error is about `0.3 %` of `|dot|` (a random
//! walk of half-step errors), an order of magnitude below the error of the INT4 weights.

use std::sync::OnceLock;

use crate::quant::{int4, mxfp4};

/// Inputs per activation group (the same as INT4's weight groups).
pub const GROUP: usize = int4::GROUP;

/// The 64 codes of one group, on their own cache line (so that the kernels' vector loads of
/// them never straddle two lines).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct CodeGroup([i8; GROUP]);

// SAFETY: `CodeGroup` is `repr(C)`, 64 bytes with alignment 64: no padding, and every bit
// pattern is valid.
unsafe impl bytemuck::Zeroable for CodeGroup {}
// SAFETY: as above; it is `Copy` and `'static`.
unsafe impl bytemuck::Pod for CodeGroup {}

/// One activation group as the integer MXFP4 kernel reads it, on two cache lines: its codes
/// reordered, and the bias that cancels the kernel's weight offset.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct Mxfp4Group {
    /// The group's 64 codes, code `i` at [`mxfp4_position`]`(i)`.
    pub codes: [i8; GROUP],
    /// Per 32-bit lane `l` of `codes` (bytes `4l .. 4l + 4`), `-MXFP4_WEIGHT_OFFSET` times
    /// their sum: where the kernel starts lane `l`'s sum, so that its weights' offset
    /// ([`MXFP4_WEIGHT_OFFSET`]) cancels exactly.
    pub bias: [i32; 16],
}

/// What the integer MXFP4 kernel adds to every doubled E2M1 weight (`-12..=12`) so that it is
/// an unsigned byte (`0..=24`, `vpdpbusd` takes one unsigned operand); the activations stay
/// signed, and [`Mxfp4Group::bias`] takes the offset's products back out, exactly.
pub const MXFP4_WEIGHT_OFFSET: i32 = 12;

/// Where code `i` of a group goes in its [`Mxfp4Group::codes`]: the group covers
/// two MXFP4 blocks (`b = i / 32`), and within each half of 32 the even elements of block 0,
/// then of block 1, come first (`16 b + j` for element `2 j`), the odd ones second
/// (`32 + 16 b + j` for element `2 j + 1`), which is the order in which the integer MXFP4
/// kernel decodes the low and the high nibbles of a block pair's 32 code bytes.
pub const fn mxfp4_position(i: usize) -> usize {
    let (b, e) = (i / mxfp4::BLOCK, i % mxfp4::BLOCK);
    (e % 2) * 32 + b * 16 + e / 2
}

/// Where code `i` of a group goes in [`QuantizedX::mxfp4_tile_codes`]: within each MXFP4 block
/// (`b = i / 32`), element `8 q + 2 j + h` (`q < 4`, `j < 4`, `h < 2`) at position `8 q + 4 h +
/// j`, which is the order in which the AMX MXFP4 kernel lays out a block's decoded weights:
/// the low nibbles of code bytes `4 q .. 4 q + 4` (elements `8 q + 2 j`), then their high
/// nibbles (elements `8 q + 2 j + 1`), four bytes of one row per 32-bit tile element.
pub const fn mxfp4_tile_position(i: usize) -> usize {
    let (b, e) = (i / mxfp4::BLOCK, i % mxfp4::BLOCK);
    let (q, j, h) = (e / 8, (e % 8) / 2, e % 2);
    b * mxfp4::BLOCK + 8 * q + 4 * h + j
}

/// `max |x_i|` over the inputs that are not NaN (0 for none), as `f32::max` folds it: on the
/// magnitudes' bits, which order as the magnitudes do, so the loop vectorizes.
fn largest_magnitude(xs: &[f32]) -> f32 {
    const INFINITY: u32 = 0x7f80_0000;
    let bits = xs.iter().map(|v| v.to_bits() & 0x7fff_ffff).map(|b| if b > INFINITY { 0 } else { b });
    f32::from_bits(bits.max().unwrap_or(0))
}

/// `y.round().clamp(-127.0, 127.0) as i8` (halves away from zero, NaN to 0) without the
/// library call `f32::round` is on x86-64, so the loop vectorizes: the truncation (clamped
/// well past the codes, so that nothing overflows) plus one where the remainder reaches a
/// half, which is exact for every `|y|` below `2^23`.
fn round_to_code(y: f32) -> i8 {
    let t = (y as i32).clamp(-256, 256);
    let rest = y - t as f32;
    (t + i32::from(rest >= 0.5) - i32::from(rest <= -0.5)).clamp(-127, 127) as i8
}

/// Activations quantized to INT8 with one f32 scale per 64 inputs.
#[derive(Clone, Debug)]
pub struct QuantizedX {
    /// `groups * 64` codes, group by group; zero past `len`.
    codes: Vec<CodeGroup>,
    /// The groups as the integer MXFP4 kernel reads them.
    mxfp4: Vec<Mxfp4Group>,
    /// The codes in the order of [`mxfp4_tile_position`], as the AMX MXFP4 kernel reads them:
    /// made on first use, since only that kernel reads them.
    tile_codes: OnceLock<Vec<CodeGroup>>,
    /// One scale per group.
    scales: Vec<f32>,
    /// Per group, `-8 * sum(codes)`: turns the unsigned INT4 codes `q + 8` into `q`.
    int4_bias: Vec<i32>,
    /// Number of real inputs.
    len: usize,
}

impl QuantizedX {
    /// Quantizes `x` (see the module documentation for the exact rule).
    pub fn new(x: &[f32]) -> Self {
        let groups = x.len().div_ceil(GROUP);
        let mut codes = vec![CodeGroup([0; GROUP]); groups];
        let mut scales = vec![0.0f32; groups];
        let mut int4_bias = vec![0i32; groups];
        let mut mxfp4 = vec![Mxfp4Group { codes: [0; GROUP], bias: [0; 16] }; groups];
        for (g, (xs, CodeGroup(qs))) in x.chunks(GROUP).zip(codes.iter_mut()).enumerate() {
            let amax = largest_magnitude(xs);
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(xs) {
                *q = round_to_code(v * inv);
            }
            // A NaN input makes its group's scale NaN, so it reaches the output as with floats.
            scales[g] = if xs.iter().any(|v| v.is_nan()) { f32::NAN } else { amax / 127.0 };
            int4_bias[g] = -8 * qs.iter().map(|&q| q as i32).sum::<i32>();
            let m = &mut mxfp4[g];
            for (i, &q) in qs.iter().enumerate() {
                m.codes[mxfp4_position(i)] = q;
            }
            for (bias, lane) in m.bias.iter_mut().zip(m.codes.as_chunks::<4>().0) {
                *bias = -MXFP4_WEIGHT_OFFSET * lane.iter().map(|&q| q as i32).sum::<i32>();
            }
        }
        QuantizedX { codes, mxfp4, tile_codes: OnceLock::new(), scales, int4_bias, len: x.len() }
    }

    /// Number of inputs quantized.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no inputs were quantized.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of 64-input groups.
    pub fn groups(&self) -> usize {
        self.scales.len()
    }

    /// The codes, `groups() * 64` of them, zero past `len()`.
    pub fn codes(&self) -> &[i8] {
        bytemuck::cast_slice(&self.codes)
    }

    /// The groups as the integer MXFP4 kernel reads them (codes in the order of
    /// [`mxfp4_position`], with their bias), one per group: what it
    /// multiplies with the decoded weights, with no shuffle per row.
    pub fn mxfp4_groups(&self) -> &[Mxfp4Group] {
        &self.mxfp4
    }

    /// The codes in the order of [`mxfp4_tile_position`] (`groups() * 64` of them, zero past
    /// `len()`): what the AMX MXFP4 kernel multiplies block by block with no shuffle at all.
    pub fn mxfp4_tile_codes(&self) -> &[i8] {
        let groups = self.tile_codes.get_or_init(|| {
            let reorder = |CodeGroup(qs): &CodeGroup| {
                let mut t = [0; GROUP];
                for (i, &q) in qs.iter().enumerate() {
                    t[mxfp4_tile_position(i)] = q;
                }
                CodeGroup(t)
            };
            self.codes.iter().map(reorder).collect()
        });
        bytemuck::cast_slice(groups)
    }

    /// One scale per group.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Per group, `-8` times the sum of its codes.
    pub fn int4_bias(&self) -> &[i32] {
        &self.int4_bias
    }

    /// The value input `i` stands for: `p_i * s_g` (0 past the end).
    pub fn dequantized(&self, i: usize) -> f32 {
        match self.codes().get(i) {
            Some(&q) => q as f32 * self.scales[i / GROUP],
            None => 0.0,
        }
    }
}

/// The integer-kernel dot product of one INT4-gs64 row with quantized activations:
/// `sum_g (d_g * s_g) * (sum_{i in g} q_i p_i)`, the inner sums exact in i32, the outer
/// accumulated in group order in f32 (`d_g * s_g` rounded to f32 first).
pub fn int4_dot_reference(codes: &[u8], scales: &[u16], x: &QuantizedX) -> f32 {
    let mut acc = 0.0f32;
    let groups = codes.chunks_exact(int4::GROUP_BYTES).zip(scales).zip(x.codes().chunks_exact(GROUP));
    for (g, ((c, &d), p)) in groups.enumerate() {
        let mut sum = 0i32;
        for j in 0..int4::GROUP_BYTES {
            sum += ((c[j] & 0x0f) as i32 - 8) * p[j] as i32;
            sum += ((c[j] >> 4) as i32 - 8) * p[j + int4::GROUP_BYTES] as i32;
        }
        acc += (half::f16::from_bits(d).to_f32() * x.scales[g]) * sum as f32;
    }
    acc
}

/// The integer-kernel dot product of one MXFP4 row with quantized activations (each
/// 64-input activation group covers two blocks): `sum_b (2^(e_b - 128) * s_g) * (sum_{i in b}
/// 2 FP4[c_i] p_i)`, the inner sums exact in i32 ([`mxfp4::FP4_DOUBLED`]), the outer
/// accumulated in block order in f32 (`2^(e_b - 128) * s_g` rounded to f32 first).
pub fn mxfp4_dot_reference(codes: &[u8], scales: &[u8], x: &QuantizedX) -> f32 {
    let mut acc = 0.0f32;
    let blocks = codes.chunks_exact(mxfp4::BLOCK_BYTES).zip(scales).zip(x.codes().chunks_exact(mxfp4::BLOCK));
    for (b, ((c, &e), p)) in blocks.enumerate() {
        let mut sum = 0i32;
        for (j, &byte) in c.iter().enumerate() {
            sum += mxfp4::FP4_DOUBLED[(byte & 0x0f) as usize] as i32 * p[2 * j] as i32;
            sum += mxfp4::FP4_DOUBLED[(byte >> 4) as usize] as i32 * p[2 * j + 1] as i32;
        }
        let Some(&s) = x.scales.get(b * mxfp4::BLOCK / GROUP) else { break };
        acc += (mxfp4::scale_f32(e) * 0.5 * s) * sum as f32;
    }
    acc
}

/// The integer-kernel dot product of one INT8 row (with its scale) with quantized
/// activations: `scale * sum_g s_g * (sum_{i in g} q_i p_i)`, the inner sums exact in i32,
/// the outer accumulated in group order in f32.
pub fn int8_dot_reference(codes: &[i8], scale: f32, x: &QuantizedX) -> f32 {
    let mut acc = 0.0f32;
    for (g, (c, p)) in codes.chunks(GROUP).zip(x.codes().chunks_exact(GROUP)).enumerate() {
        let sum: i32 = c.iter().zip(p).map(|(&a, &b)| a as i32 * b as i32).sum();
        acc += x.scales[g] * sum as f32;
    }
    scale * acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_to_code_is_round_then_clamp() {
        let mut ys =
            vec![0.0f32, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5, 127.49, 127.5, 128.0, -300.0];
        ys.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.49999997, -0.49999997, 3e9, -3e9, 1e-40]);
        ys.extend((0..20000).map(|i| (i as f32 - 10000.0) * 0.01357));
        for y in ys {
            assert_eq!(round_to_code(y), y.round().clamp(-127.0, 127.0) as i8, "{y}");
        }
        let xs = [1.0f32, f32::NAN, -3.5, 2.0];
        assert_eq!(largest_magnitude(&xs), 3.5);
        assert_eq!(largest_magnitude(&[f32::NEG_INFINITY, 1.0]), f32::INFINITY);
        assert_eq!(largest_magnitude(&[]), 0.0);
    }

    #[test]
    fn quantization_is_within_half_a_step_and_padded() {
        let x: Vec<f32> = (0..100).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let q = QuantizedX::new(&x);
        assert_eq!((q.len(), q.groups(), q.codes().len()), (100, 2, 128));
        for (i, &v) in x.iter().enumerate() {
            let s = q.scales()[i / GROUP];
            assert!((v - q.dequantized(i)).abs() <= s * (0.5 + 1.0 / 16384.0), "input {i}");
        }
        assert!(q.codes()[100..].iter().all(|&c| c == 0));
        for (i, &c) in q.codes().iter().enumerate() {
            assert_eq!(q.mxfp4_groups()[i / GROUP].codes[mxfp4_position(i % GROUP)], c, "input {i}");
            assert_eq!(q.mxfp4_tile_codes()[mxfp4_tile_position(i)], c, "input {i}");
        }
        // Both orders are permutations of a group.
        let mut seen = [[false; GROUP]; 2];
        for i in 0..GROUP {
            seen[0][mxfp4_position(i)] = true;
            seen[1][mxfp4_tile_position(i)] = true;
        }
        assert!(seen.iter().flatten().all(|&s| s));
        for (g, m) in q.mxfp4_groups().iter().enumerate() {
            for (l, &bias) in m.bias.iter().enumerate() {
                let sum: i32 = m.codes[4 * l..4 * l + 4].iter().map(|&c| c as i32).sum();
                assert_eq!(bias, -MXFP4_WEIGHT_OFFSET * sum, "group {g} lane {l}");
            }
        }
        for g in 0..2 {
            let sum: i32 = q.codes()[g * GROUP..(g + 1) * GROUP].iter().map(|&c| c as i32).sum();
            assert_eq!(q.int4_bias()[g], -8 * sum);
        }
    }

    #[test]
    fn mxfp4_positions_are_a_permutation_in_nibble_order() {
        let mut seen = [false; GROUP];
        for i in 0..GROUP {
            let p = mxfp4_position(i);
            assert!(!seen[p], "position {p} twice");
            seen[p] = true;
        }
        // Block 0's element 2j (low nibble of its byte j) at j, element 2j + 1 (high nibble)
        // at 32 + j; block 1's at 16 + j and 48 + j.
        let cases = [(0, 0), (1, 32), (2, 1), (31, 47), (32, 16), (33, 48), (62, 31), (63, 63)];
        assert_eq!(cases.map(|(i, _)| mxfp4_position(i)), cases.map(|(_, p)| p));
    }

    #[test]
    fn largest_magnitude_maps_to_127_and_zero_group_to_zero() {
        let mut x = vec![0.0f32; 128];
        x[5] = -3.0;
        x[6] = 1.5;
        let q = QuantizedX::new(&x);
        assert_eq!((q.codes()[5], q.codes()[6]), (-127, 64));
        assert_eq!(q.scales()[1], 0.0);
        assert!(q.codes()[64..].iter().all(|&c| c == 0));
    }

    #[test]
    fn non_finite_inputs_give_non_finite_products() {
        let codes = vec![0x99u8; 64];
        let scales = [0x3c00u16; 2];
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![0.5f32; 128];
            x[70] = bad;
            let q = QuantizedX::new(&x);
            assert!(!int4_dot_reference(&codes, &scales, &q).is_finite());
            assert!(!int8_dot_reference(&[1i8; 128], 1.0, &q).is_finite());
        }
    }

    #[test]
    fn references_match_exact_integer_products() {
        // Activations that quantize exactly (a multiple of the step), so the quantized dot
        // equals the float one.
        let x: Vec<f32> = (0..64).map(|i| ((i * 7) % 255) as f32 - 127.0).collect();
        let q = QuantizedX::new(&x);
        assert_eq!(q.scales()[0], 1.0);
        let codes: Vec<u8> = (0..32).map(|j| ((j % 16) | ((15 - j % 16) << 4)) as u8).collect();
        let scales = [half::f16::from_f32(0.5).to_bits()];
        let xr: Vec<f32> = (0..64).map(|i| q.dequantized(i)).collect();
        assert_eq!(int4_dot_reference(&codes, &scales, &q), int4::dot_reference(&codes, &scales, &xr));
        let c8: Vec<i8> = (0..64).map(|i| (i * 5 % 255) as i8).collect();
        assert_eq!(int8_dot_reference(&c8, 0.25, &q), crate::quant::int8::dot_reference(&c8, 0.25, &xr));
    }
}
