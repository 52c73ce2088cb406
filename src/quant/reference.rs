//! Scalar reference kernels: the plain definition of each product, in one fixed summation
//! order. Every faster kernel is tested against these.

/// Widens a bfloat16 bit pattern to f32 (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `sum_i w[i] * x[i]`, accumulated left to right in f32.
#[inline]
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = 0.0f32;
    for (a, b) in w.iter().zip(x) {
        acc += a * b;
    }
    acc
}

/// `sum_i bf16(w[i]) * x[i]`, accumulated left to right in f32.
#[inline]
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = 0.0f32;
    for (&a, b) in w.iter().zip(x) {
        acc += bf16_to_f32(a) * b;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_widening_is_exact() {
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc000), -2.0);
        assert_eq!(bf16_to_f32(0x3fc0), 1.5);
        assert_eq!(bf16_to_f32(half::bf16::from_f32(0.3).to_bits()), half::bf16::from_f32(0.3).to_f32());
    }

    #[test]
    fn dots_agree_on_bf16_representable_values() {
        let w: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.25).collect();
        let wb: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let x: Vec<f32> = (0..37).map(|i| (i as f32).sin()).collect();
        assert_eq!(dot_f32(&w, &x), dot_bf16(&wb, &x));
    }
}
