//! MXFP4 (OCP microscaling FP4) as stored in the released GPT-OSS checkpoints.
//!
//! Each block of 32 values is 16 bytes of E2M1 codes plus one E8M0 scale byte. In every
//! byte the low nibble is the even element and the high nibble the odd one; code bit 3 is
//! the sign. `value = FP4_VALUES[code] * 2^(scale - 127)`.

/// The 16 E2M1 values, indexed by code.
pub const FP4_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

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
