//! INT4 with one scale per group of 64 inputs (symmetric, like ggml's Q4_0 but grouped by
//! 64): the format of converted experts.
//!
//! A row of `cols` inputs is `ceil(cols / 64)` groups. Each group stores 32 bytes of codes
//! and one f16 scale `d`. Byte `j` of a group holds element `j` in its low nibble and
//! element `j + 32` in its high nibble, as `q + 8` with `q` in `-8..=7`; the value is
//! `q * d`. Elements past `cols` in the last group are zero (code 8).

use half::f16;

/// Inputs per group.
pub const GROUP: usize = 64;
/// Code bytes per group.
pub const GROUP_BYTES: usize = 32;

/// Groups in a row of `cols` inputs.
pub fn groups(cols: usize) -> usize {
    cols.div_ceil(GROUP)
}

/// Code bytes of a row of `cols` inputs.
pub fn row_bytes(cols: usize) -> usize {
    groups(cols) * GROUP_BYTES
}

/// Quantizes one row: `codes` gets `row_bytes(x.len())` bytes, `scales` `groups(x.len())`
/// f16 bit patterns. The scale is the signed element of largest magnitude divided by -8
/// (so that element is exactly `-8 d`), rounded to f16; codes round to nearest against the
/// rounded scale.
pub fn quantize_row(x: &[f32], codes: &mut [u8], scales: &mut [u16]) {
    let g_count = groups(x.len());
    debug_assert_eq!(codes.len(), g_count * GROUP_BYTES);
    debug_assert_eq!(scales.len(), g_count);
    let mut vals = [0.0f32; GROUP];
    for g in 0..g_count {
        let start = g * GROUP;
        let end = (start + GROUP).min(x.len());
        vals.fill(0.0);
        vals[..end - start].copy_from_slice(&x[start..end]);
        let mut max = 0.0f32;
        for &v in &vals {
            if v.abs() > max.abs() {
                max = v;
            }
        }
        let d = f16::from_f32(max / -8.0);
        scales[g] = d.to_bits();
        let d = d.to_f32();
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let code = |v: f32| -> u8 { ((v * inv).round().clamp(-8.0, 7.0) as i32 + 8) as u8 };
        let dst = &mut codes[g * GROUP_BYTES..(g + 1) * GROUP_BYTES];
        for j in 0..GROUP_BYTES {
            dst[j] = code(vals[j]) | (code(vals[j + GROUP_BYTES]) << 4);
        }
    }
}

/// Decodes one row of `out.len()` inputs.
pub fn dequantize_row(codes: &[u8], scales: &[u16], out: &mut [f32]) {
    for (g, &s) in scales.iter().enumerate() {
        let d = f16::from_bits(s).to_f32();
        let src = &codes[g * GROUP_BYTES..(g + 1) * GROUP_BYTES];
        for (j, &b) in src.iter().enumerate() {
            let lo = (b & 0x0f) as i32 - 8;
            let hi = (b >> 4) as i32 - 8;
            for (idx, q) in [(g * GROUP + j, lo), (g * GROUP + GROUP_BYTES + j, hi)] {
                if idx < out.len() {
                    out[idx] = q as f32 * d;
                }
            }
        }
    }
}

/// The reference dot product of one row with `x` (`groups * 64` long, zero-padded):
/// `sum_g d_g * (sum_{i in g} q_i * x_i)`, each group summed in element order in f32.
pub fn dot_reference(codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(x.len(), scales.len() * GROUP);
    let mut acc = 0.0f32;
    for (g, &s) in scales.iter().enumerate() {
        let src = &codes[g * GROUP_BYTES..(g + 1) * GROUP_BYTES];
        let xs = &x[g * GROUP..(g + 1) * GROUP];
        let mut sum = 0.0f32;
        for j in 0..GROUP_BYTES {
            sum += ((src[j] & 0x0f) as i32 - 8) as f32 * xs[j];
        }
        for j in 0..GROUP_BYTES {
            sum += ((src[j] >> 4) as i32 - 8) as f32 * xs[GROUP_BYTES + j];
        }
        acc += f16::from_bits(s).to_f32() * sum;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_error_is_within_half_a_step_unless_saturated() {
        let x: Vec<f32> = (0..150).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let mut codes = vec![0u8; row_bytes(x.len())];
        let mut scales = vec![0u16; groups(x.len())];
        quantize_row(&x, &mut codes, &mut scales);
        let mut back = vec![0.0f32; x.len()];
        dequantize_row(&codes, &scales, &mut back);
        for (g, &s) in scales.iter().enumerate() {
            let d = f16::from_bits(s).to_f32().abs();
            for i in g * GROUP..((g + 1) * GROUP).min(x.len()) {
                // Values on the side opposite the largest magnitude saturate at 7 steps.
                let bound = (0.5 * d).max(x[i].abs() - 7.0 * d);
                assert!((x[i] - back[i]).abs() <= bound * 1.001 + 1e-7, "element {i}");
            }
        }
    }

    #[test]
    fn largest_magnitude_is_exact_and_layout_is_j_and_j_plus_32() {
        let mut x = vec![0.0f32; 64];
        x[3] = -2.0; // largest magnitude: d = 0.25, code -8
        x[35] = 1.0; // element 3 + 32: high nibble of byte 3, code 4
        let mut codes = vec![0u8; 32];
        let mut scales = vec![0u16; 1];
        quantize_row(&x, &mut codes, &mut scales);
        assert_eq!(f16::from_bits(scales[0]).to_f32(), 0.25);
        assert_eq!(codes[3], (-8i32 + 8) as u8 | (((4 + 8) as u8) << 4));
        assert_eq!(codes[0], 8 | (8 << 4));
        let mut back = vec![0.0f32; 64];
        dequantize_row(&codes, &scales, &mut back);
        assert_eq!((back[3], back[35]), (-2.0, 1.0));
    }

    #[test]
    fn partial_last_group_is_zero_padded() {
        let x: Vec<f32> = (0..96).map(|i| i as f32 - 40.0).collect();
        let mut codes = vec![0u8; row_bytes(96)];
        let mut scales = vec![0u16; 2];
        quantize_row(&x, &mut codes, &mut scales);
        // Elements 96..128 of the padded row decode to zero.
        let mut padded = vec![1.0f32; 128];
        dequantize_row(&codes, &scales, &mut padded);
        assert!(padded[96..].iter().all(|&v| v == 0.0));
        let mut xp = vec![0.0f32; 128];
        xp[..96].copy_from_slice(&x);
        let dot = dot_reference(&codes, &scales, &xp);
        let want: f32 = padded[..96].iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!((dot - want).abs() <= 1e-3 * want.abs());
    }

    #[test]
    fn zero_row_has_zero_scale() {
        let mut codes = vec![0u8; 32];
        let mut scales = vec![7u16; 1];
        quantize_row(&[0.0; 64], &mut codes, &mut scales);
        assert_eq!(f16::from_bits(scales[0]).to_f32(), 0.0);
        assert_eq!(dot_reference(&codes, &scales, &[1.0; 64]), 0.0);
    }
}
