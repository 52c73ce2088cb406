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

/// `2^(scale - 127)` for an E8M0 scale byte; `None` for 255, which encodes NaN.
pub fn scale_value(scale: u8) -> Option<f32> {
    if scale == 255 {
        return None;
    }
    Some((2.0f64).powi(scale as i32 - 127) as f32)
}

/// Decodes one row of `scales.len()` blocks into `out` (`32 * scales.len()` values).
/// Returns the index of the first block whose scale is the NaN code, if any.
pub fn decode_row(blocks: &[u8], scales: &[u8], out: &mut [f32]) -> Result<(), usize> {
    debug_assert_eq!(blocks.len(), scales.len() * BLOCK_BYTES);
    debug_assert_eq!(out.len(), scales.len() * BLOCK);
    for (g, &s) in scales.iter().enumerate() {
        let scale = scale_value(s).ok_or(g)?;
        let codes = &blocks[g * BLOCK_BYTES..(g + 1) * BLOCK_BYTES];
        let dst = &mut out[g * BLOCK..(g + 1) * BLOCK];
        for (j, &byte) in codes.iter().enumerate() {
            dst[2 * j] = FP4_VALUES[(byte & 0x0f) as usize] * scale;
            dst[2 * j + 1] = FP4_VALUES[(byte >> 4) as usize] * scale;
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
        assert_eq!(decode_row(&block, &[255], &mut out), Err(0));
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
}
