//! INT8 with one f32 scale per row (symmetric): the format of the embedding and the output
//! head, which must not be INT4 (seed 0.10: INT4 flips the head's argmax about one token in
//! four; INT8 keeps it).

/// Quantizes one row into `codes`; returns the row's scale `max|x| / 127`.
pub fn quantize_row(x: &[f32], codes: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// Decodes one row.
pub fn dequantize_row(codes: &[i8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = c as f32 * scale;
    }
}

/// The reference dot product: `scale * sum_i q_i * x_i`, summed in element order in f32.
pub fn dot_reference(codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    for (&c, &v) in codes.iter().zip(x) {
        sum += c as f32 * v;
    }
    scale * sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..77).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1).collect();
        let mut q = vec![0i8; x.len()];
        let s = quantize_row(&x, &mut q);
        assert!((s - 1.4 / 127.0).abs() < 1e-7);
        let mut back = vec![0.0f32; x.len()];
        dequantize_row(&q, s, &mut back);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= 0.5 * s * 1.0001);
        }
        assert!(q.iter().all(|&c| c > -128));
    }
}
