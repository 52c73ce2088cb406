//! MXFP4 (OCP microscaling FP4) as stored in the released GPT-OSS checkpoints: the one codec
//! of the format, used by the checkpoint loader, the converter and the kernels.
//!
//! Each block of 32 values is 16 bytes of E2M1 codes plus one E8M0 scale byte. In every
//! byte the low nibble is the even element and the high nibble the odd one; code bit 3 is
//! the sign. `value = FP4_VALUES[code] * 2^(scale - 127)`.
//!
//! A matrix row of `cols` inputs (a multiple of [`BLOCK`]) is [`row_bytes`] code bytes and
//! [`blocks`] scale bytes. Every E2M1 value times a power of two is exact in f32, so decoding
//! loses nothing and a product with f32 activations differs from the checkpoint's own
//! arithmetic by summation order only.

/// The 16 E2M1 values, indexed by code.
pub const FP4_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The 16 E2M1 values times two, indexed by code: integers in `-12..=12`, exact in int8 (what
/// the integer kernels multiply quantized activations by; the factor 2 goes into the scale).
pub const FP4_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^(e - 127) / 2` for each scale byte `e` (`scale_f32(e) * 0.5`): the block scale of the
/// doubled values [`FP4_DOUBLED`], which the integer kernels look up rather than rebuild per
/// block.
pub static HALF_SCALES: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut e = 0;
    while e < 256 {
        t[e] = scale_f32(e as u8) * 0.5;
        e += 1;
    }
    t
};

/// Elements per MXFP4 block.
pub const BLOCK: usize = 32;
/// Bytes of codes per block.
pub const BLOCK_BYTES: usize = 16;

/// The largest scale byte at which every E2M1 value decodes to a finite f32:
/// `6 * 2^(252 - 127) = 1.5 * 2^127` is below `f32::MAX`, while `6 * 2^(253 - 127)` and
/// `4 * 2^(253 - 127)` are `2^128` or more and overflow. Blocks with a larger scale are
/// checked element by element (and scale 255 is NaN).
pub const MAX_FINITE_SCALE: u8 = 252;

/// Why a block does not decode to finite values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadBlock {
    /// The scale byte is 255, which is NaN in E8M0.
    NanScale {
        /// Block index within the row.
        block: usize,
    },
    /// The scale times an E2M1 value overflows f32 (scales 253 and 254 with large codes).
    Overflow {
        /// Block index within the row.
        block: usize,
        /// The scale byte.
        scale: u8,
        /// Element index within the row.
        element: usize,
        /// The E2M1 code of that element.
        code: u8,
    },
}

impl BadBlock {
    /// The block index within the row.
    pub fn block(&self) -> usize {
        match *self {
            BadBlock::NanScale { block } | BadBlock::Overflow { block, .. } => block,
        }
    }
}

impl std::fmt::Display for BadBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            BadBlock::NanScale { block } => write!(f, "block {block}: scale byte 255 is NaN in E8M0"),
            BadBlock::Overflow { block, scale, element, code } => {
                let v = FP4_VALUES[code as usize];
                write!(
                    f,
                    "block {block}: scale byte {scale} (2^{}) times the FP4 value {v} at element {element} overflows f32 to {}",
                    scale as i32 - 127,
                    v * f32::INFINITY
                )
            }
        }
    }
}

/// `2^(scale - 127)` for an E8M0 scale byte; `None` for 255, which encodes NaN.
pub fn scale_value(scale: u8) -> Option<f32> {
    if scale == 255 {
        return None;
    }
    Some((2.0f64).powi(scale as i32 - 127) as f32)
}

/// Blocks in a row of `cols` inputs (`cols` is a multiple of [`BLOCK`] for every MXFP4
/// matrix; a partial last block would be counted whole).
pub fn blocks(cols: usize) -> usize {
    cols.div_ceil(BLOCK)
}

/// Code bytes in a row of `cols` inputs.
pub fn row_bytes(cols: usize) -> usize {
    blocks(cols) * BLOCK_BYTES
}

/// `2^(scale - 127)` as an f32, exactly (scale 0 is the subnormal `2^-127`), built from its
/// bits. Scale 255 (NaN in E8M0) gives infinity: containers and checkpoints are checked for
/// it before any product runs.
#[inline]
pub const fn scale_f32(scale: u8) -> f32 {
    match scale {
        0 => f32::from_bits(0x0040_0000),
        s => f32::from_bits((s as u32) << 23),
    }
}

/// [`scale_f32`] of every scale byte, for kernels that look a block's scale up in memory.
pub static SCALES_F32: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut s = 0;
    while s < 256 {
        t[s] = scale_f32(s as u8);
        s += 1;
    }
    t
};

/// The reference dot product of one row (`scales.len()` blocks) with `x` (`32` inputs a
/// block): `sum_b 2^(e_b - 127) * (sum_{i in b} FP4[c_i] * x_i)`, each block's sum taken in
/// element order in f32, then the blocks accumulated in order in f32. Every MXFP4 kernel is
/// tested against this.
pub fn dot_reference(codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(codes.len(), scales.len() * BLOCK_BYTES);
    debug_assert_eq!(x.len(), scales.len() * BLOCK);
    let mut acc = 0.0f32;
    for ((c, &e), xs) in codes.chunks_exact(BLOCK_BYTES).zip(scales).zip(x.chunks_exact(BLOCK)) {
        let mut sum = 0.0f32;
        for (j, &byte) in c.iter().enumerate() {
            sum += FP4_VALUES[(byte & 0x0f) as usize] * xs[2 * j];
            sum += FP4_VALUES[(byte >> 4) as usize] * xs[2 * j + 1];
        }
        acc += scale_f32(e) * sum;
    }
    acc
}

/// Decodes one row of `scales.len()` blocks into `out` without checking the values: for
/// matrices already checked finite (at conversion or load); a scale of 255 gives infinities.
pub fn dequantize_row(codes: &[u8], scales: &[u8], out: &mut [f32]) {
    for ((c, &e), dst) in codes.chunks_exact(BLOCK_BYTES).zip(scales).zip(out.chunks_mut(BLOCK)) {
        let scale = scale_f32(e);
        for (j, &byte) in c.iter().enumerate() {
            if let Some(d) = dst.get_mut(2 * j) {
                *d = FP4_VALUES[(byte & 0x0f) as usize] * scale;
            }
            if let Some(d) = dst.get_mut(2 * j + 1) {
                *d = FP4_VALUES[(byte >> 4) as usize] * scale;
            }
        }
    }
}

/// Decodes one row of `scales.len()` blocks into `out` (`32 * scales.len()` values).
/// Fails on the first block that does not decode to finite values: a NaN scale, or a
/// scale above [`MAX_FINITE_SCALE`] whose product with a code overflows.
pub fn decode_row(blocks: &[u8], scales: &[u8], out: &mut [f32]) -> Result<(), BadBlock> {
    debug_assert_eq!(blocks.len(), scales.len() * BLOCK_BYTES);
    debug_assert_eq!(out.len(), scales.len() * BLOCK);
    for (g, &s) in scales.iter().enumerate() {
        let scale = scale_value(s).ok_or(BadBlock::NanScale { block: g })?;
        let codes = &blocks[g * BLOCK_BYTES..(g + 1) * BLOCK_BYTES];
        let dst = &mut out[g * BLOCK..(g + 1) * BLOCK];
        for (j, &byte) in codes.iter().enumerate() {
            dst[2 * j] = FP4_VALUES[(byte & 0x0f) as usize] * scale;
            dst[2 * j + 1] = FP4_VALUES[(byte >> 4) as usize] * scale;
        }
        if s > MAX_FINITE_SCALE
            && let Some(j) = dst.iter().position(|v| !v.is_finite())
        {
            let code = if j % 2 == 0 { codes[j / 2] & 0x0f } else { codes[j / 2] >> 4 };
            return Err(BadBlock::Overflow { block: g, scale: s, element: g * BLOCK + j, code });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_sixteen_codes_in_both_nibbles() {
        for code in 0u8..16 {
            // Code in the low nibble lands in the even slot, the high nibble's in the odd.
            let mut block = [0u8; 16];
            block[0] = code;
            block[1] = code << 4;
            let mut out = [7.0f32; 32];
            decode_row(&block, &[127], &mut out).unwrap();
            assert_eq!(out[0].to_bits(), FP4_VALUES[code as usize].to_bits(), "code {code} low");
            assert_eq!(out[1], 0.0, "high nibble of byte 0 is zero");
            assert_eq!(out[2], 0.0, "low nibble of byte 1 is zero");
            assert_eq!(out[3].to_bits(), FP4_VALUES[code as usize].to_bits(), "code {code} high");
        }
        // The sign is bit 3: code 9 is -0.5, code 15 is -6.
        assert_eq!(FP4_VALUES[9], -0.5);
        assert_eq!(FP4_VALUES[15], -6.0);
    }

    #[test]
    fn scale_is_biased_by_127() {
        let block = [0x72u8; 16]; // low nibble 2 (1.0), high nibble 7 (6.0)
        let mut out = [0.0f32; 32];
        decode_row(&block, &[130], &mut out).unwrap();
        assert_eq!((out[0], out[1]), (8.0, 48.0));
        decode_row(&block, &[125], &mut out).unwrap();
        assert_eq!((out[0], out[1]), (0.25, 1.5));
        // The smallest scale still decodes exactly (subnormal f32).
        decode_row(&block, &[0], &mut out).unwrap();
        assert_eq!(out[0], 2f32.powi(-127));
        // Scale 255 is NaN in E8M0: reported, not silently decoded.
        assert_eq!(decode_row(&block, &[255], &mut out), Err(BadBlock::NanScale { block: 0 }));
    }

    #[test]
    fn scale_bits_are_exact_powers_of_two() {
        for e in 0u8..=254 {
            assert_eq!(scale_f32(e), scale_value(e).unwrap(), "scale {e}");
        }
        assert!(scale_f32(255).is_infinite());
    }

    #[test]
    fn reference_dot_equals_decoding_then_multiplying() {
        // Two blocks: every code in both nibbles, scales 126 (0.5) and 129 (4).
        let codes: Vec<u8> = (0u8..32).map(|i| (i % 16) | ((15 - i % 16) << 4)).collect();
        let scales = [126u8, 129];
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 8.0).collect();
        let mut w = vec![0.0f32; 64];
        decode_row(&codes, &scales, &mut w).unwrap();
        let want: f32 = w
            .chunks(32)
            .zip(x.chunks(32))
            .map(|(w, x)| w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>())
            .sum();
        let got = dot_reference(&codes, &scales, &x);
        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{got} vs {want}");
        assert_eq!(row_bytes(2880), 1440);
        assert_eq!(blocks(2880), 90);
    }

    /// A random MXFP4 matrix (finite scales near 127) as a [`crate::quant::Matrix`].
    fn random_matrix(rows: usize, cols: usize, seed: u64) -> crate::quant::Matrix {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let codes: Vec<u8> = (0..rows * row_bytes(cols)).map(|_| rng.random::<u8>()).collect();
        let scales: Vec<u8> = (0..rows * blocks(cols)).map(|_| rng.random_range(120..134)).collect();
        let data = crate::quant::MatrixData::Mxfp4 {
            codes: crate::quant::WeightBuf::owned(codes),
            scales: crate::quant::WeightBuf::owned(scales),
        };
        crate::quant::Matrix::new("test", rows, cols, data).unwrap()
    }

    #[test]
    fn matrix_products_match_the_decoded_matrix_and_each_other() {
        use rand::{Rng, SeedableRng};
        let (rows, cols, n) = (37, 96, 5);
        let m = random_matrix(rows, cols, 7);
        let f = m.dequantized();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut batched = vec![0.0f32; n * rows];
        m.matmul(&x, n, &mut batched);
        let w = f.to_f32();
        for (t, xt) in x.chunks(cols).enumerate() {
            let (mut y, mut want) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            m.matvec(xt, &mut y);
            f.matvec(xt, &mut want);
            for r in 0..rows {
                // The two sums differ by order only: bounded by a few ulps of the sum of
                // the terms' magnitudes, whatever cancellation leaves of the result.
                let magnitude: f32 =
                    w[r * cols..(r + 1) * cols].iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                assert!(
                    (y[r] - want[r]).abs() <= 4.0 * cols as f32 * f32::EPSILON * magnitude,
                    "row {r}: {} vs {} (terms' magnitude {magnitude})",
                    y[r],
                    want[r]
                );
                assert_eq!(batched[t * rows + r].to_bits(), y[r].to_bits(), "input {t} row {r}");
            }
        }
    }

    #[test]
    fn a_matrix_whose_inputs_are_not_whole_blocks_is_refused() {
        let data = crate::quant::MatrixData::Mxfp4 {
            codes: crate::quant::WeightBuf::owned(vec![0u8; 16]),
            scales: crate::quant::WeightBuf::owned(vec![127u8; 1]),
        };
        let e = crate::quant::Matrix::new("w", 1, 31, data).unwrap_err().to_string();
        assert!(e.contains("multiple of 32"), "{e}");
    }

    #[test]
    fn blocks_follow_each_other() {
        let mut blocks = [0u8; 32];
        blocks[16] = 0x01; // block 1, element 0 = 0.5
        let mut out = [0.0f32; 64];
        decode_row(&blocks, &[127, 128], &mut out).unwrap();
        assert_eq!(out[32], 1.0);
        assert!(out[..32].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn max_finite_scale_is_exact() {
        // Every (scale, code) pair: the product is finite exactly when the scale is at most
        // MAX_FINITE_SCALE, or the code's magnitude is small enough at 253 and 254.
        for s in 0u8..=254 {
            let all_finite = FP4_VALUES.iter().all(|v| (v * scale_value(s).unwrap()).is_finite());
            assert_eq!(all_finite, s <= MAX_FINITE_SCALE, "scale {s}");
        }
        assert!(scale_value(254).unwrap().is_finite(), "2^127 itself is finite");
    }

    #[test]
    fn overflowing_products_are_reported_with_their_element() {
        let mut blocks = [0u8; 32];
        blocks[16 + 3] = 0x50; // block 1, element 7: code 5 (3.0)
        let mut out = [0.0f32; 64];
        // 3 * 2^126 is finite, 3 * 2^127 is not.
        decode_row(&blocks, &[127, 253], &mut out).unwrap();
        assert_eq!(out[32 + 7], 3.0 * 2f32.powi(126));
        let e = decode_row(&blocks, &[127, 254], &mut out).unwrap_err();
        assert_eq!(e, BadBlock::Overflow { block: 1, scale: 254, element: 39, code: 5 });
        let text = e.to_string();
        assert!(text.contains("254") && text.contains("element 39") && text.contains("inf"), "{text}");
        // A large scale over small codes is fine: 1.5 * 2^127 < f32::MAX.
        blocks[16 + 3] = 0x30;
        decode_row(&blocks, &[127, 254], &mut out).unwrap();
        // Negative codes overflow to -inf.
        blocks[16 + 3] = 0xf0;
        let text = decode_row(&blocks, &[127, 253], &mut out).unwrap_err().to_string();
        assert!(text.contains("-inf"), "{text}");
    }
}
