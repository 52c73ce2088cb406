//! Every SIMD kernel path this CPU has, against the scalar references, on seeded random data.
//!
//! # Error bounds
//! A float kernel computes the same terms `t_i` as the reference and sums them in another
//! order. With unit roundoff `u = 2^-24`, a sum in which every term passes through at most
//! `d` roundings (its product, the additions along its path in the summation tree, a final
//! scaling) is within `gamma(d) * sum |t_i|` of the exact sum, `gamma(d) = d u / (1 - d u)`
//! (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1 and §4.2). The
//! reference is sequential, so its depth `d` is the largest; each kernel's is smaller (a lane
//! chain of `n / lanes` fused multiply-adds, a few accumulator combinations, a log2(lanes)
//! horizontal sum). So `|kernel - reference| <= 2 gamma(d) sum |t_i|` (+8 roundings of slack).
//!
//! That worst case needs every rounding to go the same way; it passes 1e-5 relative once
//! `d` exceeds about 80. Rounding errors of round-to-nearest behave like independent
//! zero-mean variables, giving an error of order `sqrt(d) u sum|t|` even for all-positive
//! terms (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019): at the largest size here
//! (`d` = 2880, about `3e-6` with all-positive terms) that is still 3x under 1e-5. So the
//! asserted bound is `min(2 gamma(d) + 8u, 1e-5) * sum |t_i|`: rigorous for short rows,
//! 1e-5 (the engine's kernel tolerance) for long ones.

use picchio::quant::kernels::{self, KernelPath, q8, q8::QuantizedX};
use picchio::quant::{Matrix, MatrixData, WeightBuf, int4, int8, mxfp4, reference};

const U: f64 = 1.0 / (1u64 << 24) as f64;
const SIZES: [usize; 15] = [1, 2, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 96, 127, 2880];

/// Xorshift64*: small, seeded, good enough to scatter test data.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1).
    fn signed(&mut self) -> f32 {
        2.0 * self.unit() - 1.0
    }

    /// `10^e` with `e` uniform in `[lo, hi)`, random sign.
    fn log_uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let v = 10f32.powf(lo + (hi - lo) * self.unit());
        if self.next_u64() & 1 == 0 { v } else { -v }
    }

    fn vec(&mut self, n: usize, positive: bool) -> Vec<f32> {
        (0..n).map(|_| if positive { self.unit() + 0.01 } else { self.signed() }).collect()
    }
}

fn gamma(d: usize) -> f64 {
    let du = d as f64 * U;
    du / (1.0 - du)
}

/// Allowed `|kernel - reference|` for two orderings of a sum of depth at most `depth`.
fn float_tolerance(depth: usize, sum_abs: f64) -> f64 {
    (2.0 * gamma(depth) + 8.0 * U).min(1e-5) * sum_abs
}

/// The SIMD paths this CPU has; every one it lacks is reported loudly.
fn simd_paths() -> Vec<KernelPath> {
    let mut paths = Vec::new();
    for p in KernelPath::ALL.into_iter().filter(|&p| p != KernelPath::Scalar) {
        if p.is_available() {
            paths.push(p);
        } else {
            eprintln!("SKIPPED: {} not available on this CPU", p.name());
        }
    }
    if paths.is_empty() {
        eprintln!("SKIPPED: no SIMD kernel path available on this CPU; only the scalar path was tested");
    }
    paths
}

fn check(what: &str, path: KernelPath, n: usize, got: f32, want: f32, tol: f64) {
    let err = (got as f64 - want as f64).abs();
    assert!(
        err <= tol,
        "{what} on {} n={n}: got {got}, reference {want}, |diff| {err:e} > {tol:e}",
        path.name()
    );
}

#[test]
fn f32_and_bf16_kernels_match_the_references() {
    let mut rng = Rng::new(1);
    for path in simd_paths() {
        for &n in &SIZES {
            for trial in 0..6 {
                let positive = trial % 3 == 2;
                let scale = rng.log_uniform(-20.0, 20.0).abs();
                let w: Vec<f32> = rng.vec(n, positive).iter().map(|v| v * scale).collect();
                let x = rng.vec(n, positive);
                let sum_abs: f64 = w.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                let got = kernels::f32_dot_with(path, &w, &x);
                check("f32", path, n, got, reference::dot_f32(&w, &x), float_tolerance(n, sum_abs));

                let wb: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                let sum_abs: f64 = wb
                    .iter()
                    .zip(&x)
                    .map(|(&a, b)| (reference::bf16_to_f32(a) as f64 * *b as f64).abs())
                    .sum();
                let got = kernels::bf16_dot_with(path, &wb, &x);
                check("bf16", path, n, got, reference::dot_bf16(&wb, &x), float_tolerance(n, sum_abs));
            }
        }
    }
}

#[test]
fn int8_kernels_match_the_reference() {
    let mut rng = Rng::new(2);
    for path in simd_paths() {
        for &n in &SIZES {
            for trial in 0..6 {
                // All 256 codes, including -128, which the quantizer never writes.
                let codes: Vec<i8> = (0..n).map(|_| rng.next_u64() as i8).collect();
                let x = rng.vec(n, trial % 3 == 2);
                let scale = rng.log_uniform(-12.0, 2.0).abs();
                let sum_abs: f64 =
                    codes.iter().zip(&x).map(|(&c, &v)| (scale as f64 * c as f64 * v as f64).abs()).sum();
                let got = kernels::int8_dot_with(path, &codes, scale, &x);
                let want = int8::dot_reference(&codes, scale, &x);
                check("int8", path, n, got, want, float_tolerance(n + 1, sum_abs));
            }
        }
    }
}

/// A random INT4-gs64 row of `cols` inputs and an input padded to whole groups.
fn int4_case(rng: &mut Rng, cols: usize, positive: bool) -> (Vec<u8>, Vec<u16>, Vec<f32>) {
    let g = int4::groups(cols);
    let codes: Vec<u8> = (0..g * int4::GROUP_BYTES).map(|_| rng.next_u64() as u8).collect();
    // Scales down to f16 subnormals (6e-8) and up to 10.
    let scales: Vec<u16> =
        (0..g).map(|_| half::f16::from_f32(rng.log_uniform(-7.0, 1.0)).to_bits()).collect();
    let mut x = rng.vec(g * int4::GROUP, positive);
    x[cols..].fill(0.0);
    (codes, scales, x)
}

/// `sum_g |d_g| sum_{i in g} |q_i x_i|`.
fn int4_sum_abs(codes: &[u8], scales: &[u16], x: &[f32]) -> f64 {
    let mut w = vec![0.0f32; x.len()];
    int4::dequantize_row(codes, scales, &mut w);
    w.iter().zip(x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum()
}

#[test]
fn int4_kernels_match_the_reference() {
    let mut rng = Rng::new(3);
    for path in simd_paths() {
        for &cols in &SIZES {
            for trial in 0..6 {
                let (codes, scales, x) = int4_case(&mut rng, cols, trial % 3 == 2);
                // Per term: product, 64 in-group additions, the scale, `groups` outer additions.
                let depth = int4::GROUP + 2 + scales.len();
                let tol = float_tolerance(depth, int4_sum_abs(&codes, &scales, &x));
                let got = kernels::int4_dot_with(path, &codes, &scales, &x);
                check("int4", path, cols, got, int4::dot_reference(&codes, &scales, &x), tol);
            }
        }
    }
}

#[test]
fn int4_kernels_decode_every_code_in_both_nibbles_exactly() {
    // Two groups holding every code in the low and the high nibble (and every pair of
    // them); a one-hot input reads back each decoded weight, and small integer inputs give
    // sums exact in f32, so every path must match the reference bit for bit.
    for path in all_paths() {
        for shift in 0..16u8 {
            let codes: Vec<u8> =
                (0..64u8).map(|j| ((j + shift) % 16) | (((j / 2 + 5 * shift) % 16) << 4)).collect();
            let scales = [half::f16::from_f32(0.5).to_bits(), half::f16::from_f32(-2.0).to_bits()];
            let x: Vec<f32> = (0..128).map(|i| ((i * 7 + shift as usize) % 9) as f32 - 4.0).collect();
            let want = int4::dot_reference(&codes, &scales, &x);
            let got = kernels::int4_dot_with(path, &codes, &scales, &x);
            assert_eq!(got.to_bits(), want.to_bits(), "{} shift {shift}", path.name());
            let mut w = vec![0.0f32; 128];
            int4::dequantize_row(&codes, &scales, &mut w);
            for i in 0..128 {
                let mut e = vec![0.0f32; 128];
                e[i] = 1.0;
                let got = kernels::int4_dot_with(path, &codes, &scales, &e);
                // (`==`: a decoded -0 reads back as +0 from a sum started at +0.)
                assert_eq!(got, w[i], "{} shift {shift} element {i}", path.name());
            }
        }
    }
}

/// Block counts for the MXFP4 tests: one block, odd counts (a leftover block for the
/// alternating accumulators), and GPT-OSS's 2880 inputs (90 blocks).
const MXFP4_BLOCKS: [usize; 8] = [1, 2, 3, 5, 8, 17, 33, 90];

/// A random MXFP4 row of `blocks` blocks: random codes (every code in both nibbles over a
/// long enough row) and scales from `scale`.
fn mxfp4_row(rng: &mut Rng, blocks: usize, scale: &mut dyn FnMut(&mut Rng) -> u8) -> (Vec<u8>, Vec<u8>) {
    let codes = (0..blocks * mxfp4::BLOCK_BYTES).map(|_| rng.next_u64() as u8).collect();
    let scales = (0..blocks).map(|_| scale(rng)).collect();
    (codes, scales)
}

/// `sum |w_i x_i|` over the decoded row.
fn mxfp4_sum_abs(codes: &[u8], scales: &[u8], x: &[f32]) -> f64 {
    let mut w = vec![0.0f32; x.len()];
    mxfp4::dequantize_row(codes, scales, &mut w);
    w.iter().zip(x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum()
}

#[test]
fn mxfp4_kernels_match_the_reference() {
    let mut rng = Rng::new(11);
    // Scales near 1, and at the extremes: 0 (the subnormal 2^-127), 1, 252 (the largest at
    // which every code is finite), and 253/254 with codes of magnitude at most 1.5 (finite).
    type Case = (&'static str, fn(&mut Rng) -> u8, bool);
    let cases: [Case; 5] = [
        ("scales 120..134", |r| 120 + (r.next_u64() % 14) as u8, false),
        ("scales 0 and 1", |r| (r.next_u64() % 2) as u8, false),
        ("scale 252", |_| 252, false),
        ("scales 253 and 254, small codes", |r| 253 + (r.next_u64() % 2) as u8, true),
        ("any finite scale", |r| (r.next_u64() % 253) as u8, false),
    ];
    for path in simd_paths() {
        for &blocks in &MXFP4_BLOCKS {
            for (what, mut scale, small) in cases {
                for trial in 0..4 {
                    let (mut codes, scales) = mxfp4_row(&mut rng, blocks, &mut scale);
                    if small {
                        // Codes 0..=3 and 8..=11 (|value| <= 1.5) in both nibbles.
                        codes.iter_mut().for_each(|c| *c &= 0xbb);
                    }
                    let cols = blocks * mxfp4::BLOCK;
                    // Small inputs at the largest scales keep every partial sum finite in any
                    // order: `sum |w x| <= 90 * 32 * 6 * 2^127 * 2^-16 < 2^126` (and `< 2^118` below 230).
                    let x: Vec<f32> = rng
                        .vec(cols, trial % 2 == 1)
                        .iter()
                        .map(|v| if scales.iter().any(|&e| e >= 230) { v / 65536.0 } else { *v })
                        .collect();
                    let want = mxfp4::dot_reference(&codes, &scales, &x);
                    assert!(want.is_finite(), "{what}: the reference is finite");
                    let got = kernels::mxfp4_dot_with(path, &codes, &scales, &x);
                    // Per term: product, 32 in-block additions, the scale, the outer additions;
                    // plus absolute slack for sums that round in the subnormal range.
                    let depth = mxfp4::BLOCK + 2 + blocks;
                    let tol = float_tolerance(depth, mxfp4_sum_abs(&codes, &scales, &x))
                        + 2.0 * depth as f64 * f32::from_bits(1) as f64;
                    check(&format!("mxfp4 {what}"), path, cols, got, want, tol);
                }
            }
        }
    }
}

#[test]
fn mxfp4_kernels_decode_every_code_in_both_nibbles_exactly() {
    // Every code in the low and the high nibble, against small integer inputs: every partial
    // sum is exact in f32, so every path must give the reference's value bit for bit.
    for path in all_paths() {
        for scale in [0u8, 1, 120, 127, 134, 200] {
            for shift in 0..16u8 {
                let codes: Vec<u8> =
                    (0..64u8).map(|j| ((j + shift) % 16) | (((j / 2 + 3 * shift) % 16) << 4)).collect();
                let scales = [scale, scale.wrapping_add(1), 127, 126];
                let x: Vec<f32> = (0..128).map(|i| ((i * 7 + shift as usize) % 9) as f32 - 4.0).collect();
                let want = mxfp4::dot_reference(&codes, &scales, &x);
                let got = kernels::mxfp4_dot_with(path, &codes, &scales, &x);
                assert_eq!(got.to_bits(), want.to_bits(), "{} scale {scale} shift {shift}", path.name());
                // And each element alone: a one-hot input reads back the decoded weight.
                let mut w = vec![0.0f32; 128];
                mxfp4::dequantize_row(&codes, &scales, &mut w);
                for i in (shift as usize..128).step_by(16) {
                    let mut e = vec![0.0f32; 128];
                    e[i] = 1.0;
                    let got = kernels::mxfp4_dot_with(path, &codes, &scales, &e);
                    // (`==`: a decoded -0 reads back as +0 from a sum started at +0.)
                    assert_eq!(got, w[i], "{} element {i}", path.name());
                }
            }
        }
    }
}

#[test]
fn mxfp4_input_orders_are_permutations_that_arranging_applies() {
    for path in KernelPath::ALL {
        let Some(order) = kernels::mxfp4_input_order(path) else { continue };
        let mut seen = [false; mxfp4::BLOCK];
        for &i in order {
            assert!(
                !std::mem::replace(&mut seen[usize::from(i)], true),
                "{}: element {i} twice",
                path.name()
            );
        }
        // Two whole blocks and a partial one, which is left as it is.
        let mut x: Vec<f32> = (0..2 * mxfp4::BLOCK + 5).map(|i| i as f32).collect();
        kernels::arrange_inputs(order, &mut x);
        for (p, &v) in x.iter().enumerate() {
            let want = match p / mxfp4::BLOCK {
                b @ 0..2 => b * mxfp4::BLOCK + usize::from(order[p % mxfp4::BLOCK]),
                _ => p,
            };
            assert_eq!(v, want as f32, "{} position {p}", path.name());
        }
    }
}

#[test]
fn mxfp4_multi_input_kernels_equal_single_input_kernels_for_1_to_17_inputs() {
    let mut rng = Rng::new(12);
    for path in all_paths() {
        for (i, &blocks) in MXFP4_BLOCKS.iter().enumerate() {
            let rows = [1, 7, 8, 9, 19][i % 5];
            let cols = blocks * mxfp4::BLOCK;
            let (codes, scales) =
                mxfp4_row(&mut rng, rows * blocks, &mut |r| 118 + (r.next_u64() % 18) as u8);
            let rb = mxfp4::row_bytes(cols);
            for n in 1..=17 {
                let xs: Vec<Vec<f32>> = (0..n).map(|_| rng.vec(cols, false)).collect();
                let xr: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
                let qs: Vec<QuantizedX> = xs.iter().map(|x| QuantizedX::new(x)).collect();
                let qr: Vec<&QuantizedX> = qs.iter().collect();
                let row = |r: usize| (&codes[r * rb..(r + 1) * rb], &scales[r * blocks..(r + 1) * blocks]);
                let mut out = vec![f32::NAN; rows * n];
                kernels::mxfp4_dot_multi_with(path, &codes, &scales, cols, &xr, &mut out);
                let want: Vec<f32> = (0..rows * n)
                    .map(|i| {
                        let (c, s) = row(i / n);
                        kernels::mxfp4_dot_with(path, c, s, xr[i % n])
                    })
                    .collect();
                assert_eq!(bits(&out), bits(&want), "mxfp4 {rows}x{cols}, {n} inputs, on {}", path.name());
                let mut out = vec![f32::NAN; rows * n];
                kernels::mxfp4_dot_q8_multi_with(path, &codes, &scales, cols, &qr, &mut out);
                let want: Vec<f32> = (0..rows * n)
                    .map(|i| {
                        let (c, s) = row(i / n);
                        kernels::mxfp4_dot_q8_with(path, c, s, qr[i % n])
                    })
                    .collect();
                assert_eq!(bits(&out), bits(&want), "mxfp4 q8 {rows}x{cols}, {n} inputs, on {}", path.name());
            }
        }
    }
}

/// The AMX MXFP4 kernel (int8 activations) is the scalar definition bit for bit, whatever the
/// number of rows (around its 16-row tile), blocks and inputs (a pass holds 16), scales
/// subnormal ones included. Says SKIPPED where the CPU or the OS offers no AMX.
#[test]
fn amx_mxfp4_kernel_equals_the_scalar_definition_bit_for_bit() {
    if !KernelPath::Amx.is_available() {
        eprintln!(
            "SKIPPED amx_mxfp4_kernel_equals_the_scalar_definition_bit_for_bit: no AMX on this CPU or OS \
             (the amx path is not available here)"
        );
        return;
    }
    let mut rng = Rng::new(19);
    for (i, &blocks) in MXFP4_BLOCKS.iter().enumerate() {
        let rows = [1, 15, 16, 17, 33][i % 5];
        let cols = blocks * mxfp4::BLOCK;
        let (codes, scales) = mxfp4_row(&mut rng, rows * blocks, &mut |r| match r.next_u64() % 8 {
            0 => (r.next_u64() % 2) as u8,
            1 => 254,
            _ => 110 + (r.next_u64() % 30) as u8,
        });
        let rb = mxfp4::row_bytes(cols);
        for n in [1, 2, 5, 16, 17] {
            let qs: Vec<QuantizedX> = (0..n).map(|_| QuantizedX::new(&rng.vec(cols, false))).collect();
            let qr: Vec<&QuantizedX> = qs.iter().collect();
            let mut out = vec![f32::NAN; rows * n];
            kernels::mxfp4_dot_q8_multi_with(KernelPath::Amx, &codes, &scales, cols, &qr, &mut out);
            let want: Vec<f32> = (0..rows * n)
                .map(|i| {
                    let r = i / n;
                    let (c, s) = (&codes[r * rb..(r + 1) * rb], &scales[r * blocks..(r + 1) * blocks]);
                    q8::mxfp4_dot_reference(c, s, qr[i % n])
                })
                .collect();
            assert_eq!(bits(&out), bits(&want), "amx mxfp4 {rows}x{cols}, {n} inputs");
        }
    }
    // The largest partial sums there are: every weight +-6 (doubled 12) and every input code
    // +-127, with the signs alike (all sums at their most positive) or mixed per row.
    for (even_rows, odd_rows, x) in [(0x77u8, 0x77u8, 1.0f32), (0x77, 0xff, -1.0)] {
        let (rows, blocks) = (33, 91);
        let (cols, rb) = (blocks * mxfp4::BLOCK, mxfp4::row_bytes(blocks * mxfp4::BLOCK));
        let codes: Vec<u8> =
            (0..rows * rb).map(|i| if i / rb % 2 == 0 { even_rows } else { odd_rows }).collect();
        let scales = vec![127u8; rows * blocks];
        let q = QuantizedX::new(&vec![x; cols]);
        assert!(q.codes()[..cols].iter().all(|&c| c.unsigned_abs() == 127));
        for n in [1, 3] {
            let qr = vec![&q; n];
            let mut out = vec![f32::NAN; rows * n];
            kernels::mxfp4_dot_q8_multi_with(KernelPath::Amx, &codes, &scales, cols, &qr, &mut out);
            let want: Vec<f32> = (0..rows * n)
                .map(|i| q8::mxfp4_dot_reference(&codes[i / n * rb..][..rb], &scales[..blocks], &q))
                .collect();
            assert_eq!(bits(&out), bits(&want), "amx mxfp4 at the largest sums, {n} inputs");
        }
    }
}

#[test]
fn mxfp4_sums_do_not_depend_on_how_a_block_is_scaled() {
    // The AVX-512 kernel scales a block's table by an add to its exponents when every scale of
    // the call lets it (2..=252) and by a multiply otherwise. A row outside that range, added
    // to the same rows, switches the whole call to the multiply: the other rows' sums must not
    // change (`==`: the two ways differ only in the sign of code 8's zero).
    let mut rng = Rng::new(13);
    // Scales near 1, and at each end of the range (a range each: over a wider one the largest
    // scales' blocks would swallow the rest, and a wrong block would not show), with inputs
    // small enough at the top for every sum to stay finite (as in the test above).
    let cases: [(u8, u8, f32); 3] = [(118, 136, 1.0), (2, 6, 1.0), (248, 252, 1.0 / 65536.0)];
    // 3 inputs: one pass of the AVX-512 kernel; 6: two passes over the same rows.
    for (path, inputs) in all_paths().into_iter().flat_map(|p| [(p, 3), (p, 6)]) {
        for (&blocks, (lo, hi, x_scale)) in MXFP4_BLOCKS.iter().flat_map(|b| cases.map(|c| (b, c))) {
            let (rows, cols, rb) = (9, blocks * mxfp4::BLOCK, mxfp4::row_bytes(blocks * mxfp4::BLOCK));
            let span = u64::from(hi - lo) + 1;
            let (codes, scales) =
                mxfp4_row(&mut rng, rows * blocks, &mut |r| lo + (r.next_u64() % span) as u8);
            let xs: Vec<Vec<f32>> =
                (0..inputs).map(|_| rng.vec(cols, false).iter().map(|v| v * x_scale).collect()).collect();
            let xr: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
            let mut in_range = vec![f32::NAN; rows * xr.len()];
            kernels::mxfp4_dot_multi_with(path, &codes, &scales, cols, &xr, &mut in_range);
            for outside in [0u8, 1, 253] {
                let mut codes = codes.clone();
                let mut scales = scales.clone();
                codes.extend(std::iter::repeat_n(0, rb));
                scales.extend(std::iter::repeat_n(outside, blocks));
                let mut out = vec![f32::NAN; (rows + 1) * xr.len()];
                kernels::mxfp4_dot_multi_with(path, &codes, &scales, cols, &xr, &mut out);
                assert_eq!(
                    out[..in_range.len()],
                    in_range[..],
                    "{} with a row at scale {outside}, {blocks} blocks",
                    path.name()
                );
                // (Its codes are all zero: at scale 253 others would overflow with these inputs.)
                assert!(out[in_range.len()..].iter().all(|&v| v == 0.0), "{}: the extra row", path.name());
            }
            // And one input alone through the single-row product, row by row.
            for r in 0..rows {
                let got = kernels::mxfp4_dot_with(
                    path,
                    &codes[r * rb..(r + 1) * rb],
                    &scales[r * blocks..(r + 1) * blocks],
                    xr[0],
                );
                assert_eq!(got, in_range[r * xr.len()], "{} row {r}, {blocks} blocks", path.name());
            }
        }
    }
}

#[test]
fn mismatched_lengths_never_read_out_of_bounds() {
    // The SIMD kernels take the common length instead of trusting either slice (the scalar
    // references assert equal lengths in debug builds instead).
    let x = vec![1.0f32; 20];
    for path in simd_paths() {
        assert_eq!(kernels::f32_dot_with(path, &[2.0; 3], &x[..5]), 6.0, "{}", path.name());
        assert_eq!(kernels::bf16_dot_with(path, &[0x3f80; 19], &x), 19.0, "{}", path.name());
        assert_eq!(kernels::int8_dot_with(path, &[1; 40], 0.5, &x), 10.0, "{}", path.name());
        // Two groups of scales and input, one of codes: one group is used.
        let zero = 8 | (8 << 4);
        let v = kernels::int4_dot_with(path, &[zero; 32], &[0x3c00, 0x3c00], &[1.0; 128]);
        assert_eq!(v, 0.0, "{}", path.name());
    }
}

// --- Quantized activations (integer kernels: AVX-512 VNNI; AVX2, AVX-512 and NEON for MXFP4) -

/// The available paths with an integer kernel for `product`, saying SKIPPED for the others.
fn integer_paths(product: kernels::Product) -> Vec<KernelPath> {
    let mut paths = Vec::new();
    for p in KernelPath::ALL.into_iter().filter(|p| p.has_integer_kernel(product)) {
        if p.is_available() {
            paths.push(p);
        } else {
            eprintln!("SKIPPED: the {} integer kernel for {product:?}: not available on this CPU", p.name());
        }
    }
    paths
}

/// The documented bound between the quantized-activation and the float results of one row:
/// half an activation step per input, times `|weight|`, plus the rounding of both sums.
fn q8_vs_float_tolerance(w: &[f32], qx: &QuantizedX, x: &[f32], depth: usize) -> f64 {
    let step: f64 = w
        .iter()
        .enumerate()
        .map(|(i, a)| (*a as f64).abs() * qx.scales()[i / q8::GROUP] as f64 * (0.5 + 1.0 / 16384.0))
        .sum();
    let sum_abs_float: f64 = w.iter().zip(x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
    let sum_abs_q8: f64 =
        w.iter().enumerate().map(|(i, a)| (*a as f64 * qx.dequantized(i) as f64).abs()).sum();
    step + 2.0 * gamma(depth + 8) * (sum_abs_float + sum_abs_q8)
}

#[test]
fn integer_kernels_match_the_quantized_references() {
    let paths = integer_paths(kernels::Product::Mxfp4Q8);
    let mut rng = Rng::new(4);
    for (path, &cols) in paths.iter().flat_map(|&p| SIZES.iter().map(move |c| (p, c))) {
        for trial in 0..6 {
            // INT4: the inner sums are exact integers, so only the outer float sums differ.
            let (codes, scales, x) = int4_case(&mut rng, cols, trial % 3 == 2);
            let integer_int4 = path.has_integer_kernel(kernels::Product::Int4Q8);
            let qx = QuantizedX::new(&x[..cols]);
            let mut w = vec![0.0f32; x.len()];
            int4::dequantize_row(&codes, &scales, &mut w);
            let sum_abs: f64 =
                w.iter().enumerate().map(|(i, a)| (*a as f64 * qx.dequantized(i) as f64).abs()).sum();
            let want = q8::int4_dot_reference(&codes, &scales, &qx);
            let got = kernels::int4_dot_q8_with(path, &codes, &scales, &qx);
            if integer_int4 {
                check("int4 q8", path, cols, got, want, 2.0 * gamma(scales.len() + 16) * sum_abs);
            } else {
                // No integer INT4 kernel on this path: the scalar definition itself.
                assert_eq!(got.to_bits(), want.to_bits(), "int4 q8 on {} is not the reference", path.name());
            }
            let tol = q8_vs_float_tolerance(&w, &qx, &x, int4::GROUP + 2 + scales.len());
            check("int4 q8 vs float", path, cols, got, int4::dot_reference(&codes, &scales, &x), tol);

            // MXFP4 (whole blocks): exact integer inner sums again.
            let blocks = cols.div_ceil(mxfp4::BLOCK);
            let (codes, scales) = mxfp4_row(&mut rng, blocks, &mut |r| 118 + (r.next_u64() % 18) as u8);
            let x = rng.vec(blocks * mxfp4::BLOCK, trial % 3 == 2);
            let qx = QuantizedX::new(&x);
            let mut w = vec![0.0f32; x.len()];
            mxfp4::dequantize_row(&codes, &scales, &mut w);
            let sum_abs: f64 =
                w.iter().enumerate().map(|(i, a)| (*a as f64 * qx.dequantized(i) as f64).abs()).sum();
            let want = q8::mxfp4_dot_reference(&codes, &scales, &qx);
            let got = kernels::mxfp4_dot_q8_with(path, &codes, &scales, &qx);
            check("mxfp4 q8", path, cols, got, want, 2.0 * gamma(blocks + 16) * sum_abs);
            let tol = q8_vs_float_tolerance(&w, &qx, &x, mxfp4::BLOCK + 2 + blocks);
            check("mxfp4 q8 vs float", path, cols, got, mxfp4::dot_reference(&codes, &scales, &x), tol);

            // INT8.
            let codes: Vec<i8> = (0..cols).map(|_| rng.next_u64() as i8).collect();
            let scale = rng.log_uniform(-12.0, 2.0).abs();
            let x = rng.vec(cols, trial % 3 == 2);
            let qx = QuantizedX::new(&x);
            let w: Vec<f32> = codes.iter().map(|&c| c as f32 * scale).collect();
            let sum_abs: f64 =
                w.iter().enumerate().map(|(i, a)| (*a as f64 * qx.dequantized(i) as f64).abs()).sum();
            let want = q8::int8_dot_reference(&codes, scale, &qx);
            let got = kernels::int8_dot_q8_with(path, &codes, scale, &qx);
            if path.has_integer_kernel(kernels::Product::Int8Q8) {
                check("int8 q8", path, cols, got, want, 2.0 * gamma(qx.groups() + 16) * sum_abs);
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "int8 q8 on {} is not the reference", path.name());
            }
            let tol = q8_vs_float_tolerance(&w, &qx, &x, cols + 1);
            check("int8 q8 vs float", path, cols, got, int8::dot_reference(&codes, scale, &x), tol);
        }
    }
}

#[test]
fn integer_mxfp4_kernels_decode_every_code_in_both_nibbles_exactly() {
    for path in integer_paths(kernels::Product::Mxfp4Q8) {
        integer_mxfp4_kernel_decodes_every_code_exactly(path);
    }
}

fn integer_mxfp4_kernel_decodes_every_code_exactly(path: KernelPath) {
    // Integer inputs whose every group holds a 127 quantize exactly (`s_g = 1`, `p = x`),
    // and with block scales `e` and `e + 1` every partial sum is a small multiple of
    // `2^(e - 128)`: exact in f32 in any order, so the kernel must give the reference's value
    // bit for bit. Four blocks (two pairs) and three (a last odd block).
    for blocks in [4usize, 3] {
        for scale in [0u8, 1, 120, 127, 134, 200] {
            for shift in 0..16u8 {
                let codes: Vec<u8> = (0..blocks as u8 * 16)
                    .map(|j| ((j + shift) % 16) | (((j / 2 + 3 * shift) % 16) << 4))
                    .collect();
                let scales: Vec<u8> = (0..blocks as u8).map(|b| scale + b % 2).collect();
                let cols = blocks * mxfp4::BLOCK;
                let mut x: Vec<f32> =
                    (0..cols).map(|i| ((i * 7 + shift as usize) % 9) as f32 - 4.0).collect();
                x.iter_mut().step_by(q8::GROUP).for_each(|v| *v = 127.0);
                let qx = QuantizedX::new(&x);
                assert!(qx.scales().iter().all(|&s| s == 1.0));
                let want = q8::mxfp4_dot_reference(&codes, &scales, &qx);
                let got = kernels::mxfp4_dot_q8_with(path, &codes, &scales, &qx);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{}: {blocks} blocks, scale {scale} shift {shift}",
                    path.name()
                );
                // Each element alone: a one-hot input reads back 127 times the decoded weight.
                let mut w = vec![0.0f32; cols];
                mxfp4::dequantize_row(&codes, &scales, &mut w);
                for i in (shift as usize..cols).step_by(16) {
                    let mut e = vec![0.0f32; cols];
                    e[i] = 127.0;
                    let got = kernels::mxfp4_dot_q8_with(path, &codes, &scales, &QuantizedX::new(&e));
                    assert_eq!(
                        got,
                        127.0 * w[i],
                        "{}: {blocks} blocks, scale {scale}, element {i}",
                        path.name()
                    );
                }
            }
        }
    }
}

#[test]
fn integer_kernels_propagate_non_finite_inputs() {
    for path in integer_paths(kernels::Product::Mxfp4Q8) {
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![0.5f32; 100];
            x[70] = bad;
            let q = QuantizedX::new(&x);
            let int4 = kernels::int4_dot_q8_with(path, &[0x99; 64], &[0x3c00; 2], &q);
            let int8 = kernels::int8_dot_q8_with(path, &[1; 100], 1.0, &q);
            assert!(!int4.is_finite() && !int8.is_finite(), "{}, {bad}: {int4} {int8}", path.name());
            // MXFP4, four blocks (the zero-padded 128 inputs): the bad input is in the second
            // pair.
            let mx = kernels::mxfp4_dot_q8_with(path, &[0x99; 64], &[127; 4], &q);
            assert!(!mx.is_finite(), "{}, {bad}: mxfp4 {mx}", path.name());
            // And in a last odd block (three blocks).
            let mx = kernels::mxfp4_dot_q8_with(path, &[0x99; 48], &[127; 3], &q);
            assert!(!mx.is_finite(), "{}, {bad}: mxfp4, three blocks, {mx}", path.name());
        }
    }
}

#[test]
fn activation_error_is_small_next_to_the_int4_weight_error() {
    // On random rows: the error quantizing the activations adds (integer kernels against
    // the float INT4 kernels) against the error of the INT4 weights themselves (float INT4
    // kernels against the unquantized f32 weights). Documented in `q8`: about 0.3 % of |y|,
    // an order of magnitude under the weights' error.
    let mut rng = Rng::new(5);
    let cols = 2880;
    let (mut act, mut weight, mut norm) = (0.0f64, 0.0f64, 0.0f64);
    for _ in 0..64 {
        let w = rng.vec(cols, false);
        let x = rng.vec(cols, false);
        let (mut codes, mut scales) = (vec![0u8; int4::row_bytes(cols)], vec![0u16; int4::groups(cols)]);
        int4::quantize_row(&w, &mut codes, &mut scales);
        let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let float = int4::dot_reference(&codes, &scales, &x) as f64;
        let q8 = q8::int4_dot_reference(&codes, &scales, &QuantizedX::new(&x)) as f64;
        act += (q8 - float).powi(2);
        weight += (float - exact).powi(2);
        norm += exact * exact;
    }
    let (act, weight) = ((act / norm).sqrt(), (weight / norm).sqrt());
    eprintln!("relative RMS error: activations {act:.4}, INT4 weights {weight:.4}");
    assert!(act < 0.006, "activation quantization error {act}");
    assert!(act < weight / 8.0, "activation error {act} vs weight error {weight}");
}

// --- Matrix::matvec --------------------------------------------------------------------------

/// A `rows x cols` matrix in `format` from random weights.
fn matrix(rng: &mut Rng, format: &str, rows: usize, cols: usize) -> Matrix {
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.signed() * 0.1).collect();
    let data = match format {
        "f32" => MatrixData::F32(WeightBuf::owned(w)),
        "bf16" => {
            MatrixData::Bf16(WeightBuf::owned(w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()))
        }
        "int8" => {
            let mut codes = vec![0i8; rows * cols];
            let scales =
                w.chunks(cols).zip(codes.chunks_mut(cols)).map(|(r, c)| int8::quantize_row(r, c)).collect();
            MatrixData::Int8Rows { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) }
        }
        _ => {
            let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
            let mut codes = vec![0u8; rows * rb];
            let mut scales = vec![0u16; rows * g];
            for (r, row) in w.chunks(cols).enumerate() {
                int4::quantize_row(row, &mut codes[r * rb..(r + 1) * rb], &mut scales[r * g..(r + 1) * g]);
            }
            MatrixData::Int4G64 { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) }
        }
    };
    Matrix::new("test", rows, cols, data).unwrap()
}

const FORMATS: [&str; 4] = ["f32", "bf16", "int8", "int4"];
/// (rows, cols): serial and parallel products, rows a multiple of no chunk size.
const SHAPES: [(usize, usize); 4] = [(13, 33), (7, 2880), (67, 1000), (45, 2880)];

/// The products `Matrix` offers on `path`: (name, quantizes activations, product).
type Product = fn(&Matrix, KernelPath, &[f32], &mut [f32]);
fn products(path: KernelPath) -> [(&'static str, bool, Product); 2] {
    [
        ("matvec_with", path.quantizes_activations(), Matrix::matvec_with),
        ("matvec_q8_with", true, Matrix::matvec_q8_with),
    ]
}

#[test]
fn matvec_matches_a_double_precision_product_on_every_path() {
    simd_paths();
    let mut rng = Rng::new(6);
    for format in FORMATS {
        for (rows, cols) in SHAPES {
            let m = matrix(&mut rng, format, rows, cols);
            assert_eq!(m.format_name().split('-').next(), Some(format));
            let x = rng.vec(cols, false);
            let w = m.to_f32();
            for path in KernelPath::available() {
                for (name, quantized, product) in products(path) {
                    let mut y = vec![f32::NAN; rows];
                    product(&m, path, &x, &mut y);
                    let qx = (quantized && matches!(format, "int4" | "int8")).then(|| QuantizedX::new(&x));
                    for (r, &got) in y.iter().enumerate() {
                        let row = &w[r * cols..(r + 1) * cols];
                        let exact: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let sum_abs: f64 =
                            row.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                        // Depth of the reference sum, plus one rounding of the dequantized weights.
                        let depth =
                            if format == "int4" { int4::GROUP + 3 + int4::groups(cols) } else { cols + 2 };
                        let tol = match &qx {
                            Some(qx) => q8_vs_float_tolerance(row, qx, &x, depth),
                            None => (gamma(depth) + 8.0 * U).min(1e-5) * sum_abs,
                        };
                        let err = (got as f64 - exact).abs();
                        assert!(
                            err <= tol,
                            "{name} {format} {rows}x{cols} on {} row {r}: {got} vs {exact}, |diff| {err:e} > {tol:e}",
                            path.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matvec_is_bit_identical_with_one_and_two_threads() {
    let mut rng = Rng::new(7);
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    let (one, two) = (pool(1), pool(2));
    for format in FORMATS {
        for (rows, cols) in SHAPES {
            let m = matrix(&mut rng, format, rows, cols);
            let x = rng.vec(cols, false);
            let run = |p: &rayon::ThreadPool, product: &(dyn Fn(&mut [f32]) + Sync)| {
                let mut y = vec![0.0f32; rows];
                p.install(|| product(&mut y));
                y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            for path in KernelPath::available() {
                for (name, _, product) in products(path) {
                    let f = |y: &mut [f32]| product(&m, path, &x, y);
                    assert_eq!(
                        run(&one, &f),
                        run(&two, &f),
                        "{name} {format} {rows}x{cols} on {}",
                        path.name()
                    );
                }
            }
            // The default entry point too.
            let f = |y: &mut [f32]| m.matvec(&x, y);
            assert_eq!(run(&one, &f), run(&two, &f), "{format} {rows}x{cols} on the selected path");
        }
    }
}

#[test]
fn selected_path_is_available_and_named() {
    let s = kernels::selected();
    assert!(s.is_available() && s.implemented());
    assert!(KernelPath::available().contains(&s));
    assert_eq!(KernelPath::available()[0], KernelPath::Scalar);
    let names: Vec<&str> = KernelPath::ALL.iter().map(|p| p.name()).collect();
    assert_eq!(names, ["scalar", "avx2", "avx512", "avx512-vnni", "amx", "neon"]);
}

// --- Several rows and inputs at once (batched products) --------------------------------------

/// Every path this build has and this CPU can run, the scalar reference included.
fn all_paths() -> Vec<KernelPath> {
    simd_paths();
    KernelPath::available()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

/// Row lengths for the multi-input tests: short and odd ones, around every chunk and group
/// size, and GPT-OSS's hidden size.
const MULTI_SIZES: [usize; 18] = [1, 3, 7, 8, 9, 15, 17, 31, 32, 33, 63, 64, 65, 100, 127, 129, 200, 2880];

#[test]
fn multi_input_kernels_equal_single_input_kernels_bit_for_bit() {
    let mut rng = Rng::new(8);
    for path in all_paths() {
        for (i, &cols) in MULTI_SIZES.iter().enumerate() {
            // Up to 19 rows (more than one block of the kernels' rows) and 1 to 17 inputs.
            let rows = [1, 8, 9, 19][i % 4];
            let n = 1 + (rng.next_u64() % 17) as usize;
            let g = int4::groups(cols);
            // Inputs padded to whole groups (INT4 reads them all; the rest read `cols`).
            let xs: Vec<Vec<f32>> = (0..n).map(|_| rng.vec(g * int4::GROUP, false)).collect();
            let xr: Vec<&[f32]> = xs.iter().map(|x| &x[..cols]).collect();
            let xp: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
            let qs: Vec<QuantizedX> = xs.iter().map(|x| QuantizedX::new(&x[..cols])).collect();
            let qr: Vec<&QuantizedX> = qs.iter().collect();
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.signed()).collect();
            let wb: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let c8: Vec<i8> = (0..rows * cols).map(|_| rng.next_u64() as i8).collect();
            let s8: Vec<f32> = (0..rows).map(|_| rng.log_uniform(-6.0, 1.0).abs()).collect();
            let c4: Vec<u8> = (0..rows * g * int4::GROUP_BYTES).map(|_| rng.next_u64() as u8).collect();
            let s4: Vec<u16> =
                (0..rows * g).map(|_| half::f16::from_f32(rng.log_uniform(-7.0, 1.0)).to_bits()).collect();
            let rb = int4::row_bytes(cols);
            let (c4r, s4r) = (|r: usize| &c4[r * rb..(r + 1) * rb], |r: usize| &s4[r * g..(r + 1) * g]);
            let run = |f: &dyn Fn(&mut [f32]), single: &dyn Fn(usize, usize) -> f32, what: &str| {
                let mut out = vec![f32::NAN; rows * n];
                f(&mut out);
                let want: Vec<f32> = (0..rows * n).map(|i| single(i / n, i % n)).collect();
                assert_eq!(bits(&out), bits(&want), "{what} {rows}x{cols}, {n} inputs, on {}", path.name());
            };
            run(
                &|o| kernels::f32_dot_multi_with(path, &w, cols, &xr, o),
                &|r, t| kernels::f32_dot_with(path, &w[r * cols..][..cols], xr[t]),
                "f32",
            );
            run(
                &|o| kernels::bf16_dot_multi_with(path, &wb, cols, &xr, o),
                &|r, t| kernels::bf16_dot_with(path, &wb[r * cols..][..cols], xr[t]),
                "bf16",
            );
            run(
                &|o| kernels::int8_dot_multi_with(path, &c8, &s8, cols, &xr, o),
                &|r, t| kernels::int8_dot_with(path, &c8[r * cols..][..cols], s8[r], xr[t]),
                "int8",
            );
            run(
                &|o| kernels::int4_dot_multi_with(path, &c4, &s4, cols, &xp, o),
                &|r, t| kernels::int4_dot_with(path, c4r(r), s4r(r), xp[t]),
                "int4",
            );
            run(
                &|o| kernels::int8_dot_q8_multi_with(path, &c8, &s8, cols, &qr, o),
                &|r, t| kernels::int8_dot_q8_with(path, &c8[r * cols..][..cols], s8[r], qr[t]),
                "int8 q8",
            );
            run(
                &|o| kernels::int4_dot_q8_multi_with(path, &c4, &s4, cols, &qr, o),
                &|r, t| kernels::int4_dot_q8_with(path, c4r(r), s4r(r), qr[t]),
                "int4 q8",
            );
        }
    }
}

/// (rows, cols) for the batched products: serial and parallel, rows that fill no block of rows
/// evenly, columns that are multiples of no chunk or group size and long ones (several
/// blocks of the contraction).
const MATMUL_SHAPES: [(usize, usize); 8] =
    [(1, 1), (5, 7), (13, 33), (17, 65), (67, 100), (45, 2880), (130, 1000), (9, 4099)];

/// A batched product on a path, and the matrix-vector product it must equal per input.
type Batched = fn(&Matrix, KernelPath, &[f32], usize, &mut [f32]);

#[test]
fn matmul_equals_matvec_per_input_bit_for_bit_on_one_and_two_threads() {
    let mut rng = Rng::new(9);
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    let pools = [pool(1), pool(2)];
    let products: [(&str, Batched, Product); 2] = [
        ("matmul_with", Matrix::matmul_with, Matrix::matvec_with),
        ("matmul_q8_with", Matrix::matmul_q8_with, Matrix::matvec_q8_with),
    ];
    for format in FORMATS {
        for (rows, cols) in MATMUL_SHAPES {
            let m = matrix(&mut rng, format, rows, cols);
            for n in (0..=17).chain([31, 64]) {
                let x = rng.vec(n * cols, false);
                for path in all_paths() {
                    for (name, batched, single) in products {
                        let mut want = vec![0.0f32; n * rows];
                        for (xt, yt) in x.chunks(cols).zip(want.chunks_mut(rows)) {
                            single(&m, path, xt, yt);
                        }
                        for p in &pools {
                            let mut y = vec![f32::NAN; n * rows];
                            p.install(|| batched(&m, path, &x, n, &mut y));
                            assert_eq!(
                                bits(&y),
                                bits(&want),
                                "{name} {format} {rows}x{cols}, n={n}, on {} with {} threads",
                                path.name(),
                                p.current_num_threads()
                            );
                        }
                    }
                }
                // The default entry points.
                let mut want = vec![0.0f32; n * rows];
                for (xt, yt) in x.chunks(cols).zip(want.chunks_mut(rows)) {
                    m.matvec(xt, yt);
                }
                for p in &pools {
                    let mut y = vec![f32::NAN; n * rows];
                    p.install(|| m.matmul(&x, n, &mut y));
                    assert_eq!(bits(&y), bits(&want), "matmul {format} {rows}x{cols}, n={n}");
                }
            }
        }
    }
}

#[test]
fn passes_split_inputs_evenly() {
    for max in 1..=9 {
        for n in 0..=70 {
            let p: Vec<usize> = kernels::passes(n, max).collect();
            assert_eq!(p.iter().sum::<usize>(), n, "n={n} max={max}");
            assert_eq!(p.len(), n.div_ceil(max), "n={n} max={max}");
            assert!(p.iter().all(|&s| s >= 1 && s <= max), "n={n} max={max}: {p:?}");
            assert!(p.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1), "n={n} max={max}: {p:?}");
        }
    }
    for path in KernelPath::ALL {
        for product in [
            kernels::Product::F32,
            kernels::Product::Bf16,
            kernels::Product::Int8,
            kernels::Product::Int4,
            kernels::Product::Int8Q8,
            kernels::Product::Int4Q8,
        ] {
            assert!(kernels::max_inputs(path, product) >= 1);
        }
    }
}

#[test]
fn multi_input_kernels_handle_unequal_lengths_and_non_finite_inputs_like_single_ones() {
    let mut rng = Rng::new(10);
    let cols = 200;
    let w: Vec<f32> = (0..3 * cols).map(|_| rng.signed()).collect();
    let wb: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let c8: Vec<i8> = (0..3 * cols).map(|_| rng.next_u64() as i8).collect();
    let s8 = [0.5f32, -2.0, 1e-3];
    let mut xs: Vec<Vec<f32>> = (0..7).map(|_| rng.vec(cols, false)).collect();
    xs[1].truncate(150); // shorter: its products run over 150 elements, as single ones would
    xs[2][17] = f32::NAN;
    xs[3][100] = f32::INFINITY;
    xs[4][5] = f32::NEG_INFINITY;
    xs[4][6] = f32::INFINITY;
    let xr: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
    for path in all_paths() {
        let check = |f: &dyn Fn(&mut [f32]), single: &dyn Fn(usize, usize) -> f32, what: &str| {
            let mut out = vec![0.0f32; 3 * xr.len()];
            f(&mut out);
            let want: Vec<f32> = (0..out.len()).map(|i| single(i / xr.len(), i % xr.len())).collect();
            assert_eq!(bits(&out), bits(&want), "{what} on {}", path.name());
        };
        check(
            &|o| kernels::f32_dot_multi_with(path, &w, cols, &xr, o),
            &|r, t| kernels::f32_dot_with(path, &w[r * cols..][..cols], xr[t]),
            "f32",
        );
        check(
            &|o| kernels::bf16_dot_multi_with(path, &wb, cols, &xr, o),
            &|r, t| kernels::bf16_dot_with(path, &wb[r * cols..][..cols], xr[t]),
            "bf16",
        );
        check(
            &|o| kernels::int8_dot_multi_with(path, &c8, &s8, cols, &xr, o),
            &|r, t| kernels::int8_dot_with(path, &c8[r * cols..][..cols], s8[r], xr[t]),
            "int8",
        );
        // Equal lengths again, with the non-finite values: passes of several inputs.
        let xe: Vec<&[f32]> = xr.iter().filter(|x| x.len() == cols).copied().collect();
        let mut out = vec![0.0f32; 3 * xe.len()];
        kernels::f32_dot_multi_with(path, &w, cols, &xe, &mut out);
        let want: Vec<f32> = (0..out.len())
            .map(|i| kernels::f32_dot_with(path, &w[(i / xe.len()) * cols..][..cols], xe[i % xe.len()]))
            .collect();
        assert_eq!(bits(&out), bits(&want), "f32, equal lengths, on {}", path.name());
        assert!(out[1].is_nan() && !out[2].is_finite(), "{:?}", &out[..xe.len()]);
        // An output buffer too short for every row is filled as far as it goes.
        let mut short = vec![7.0f32; 2 * xe.len() + 1];
        kernels::f32_dot_multi_with(path, &w, cols, &xe, &mut short);
        assert_eq!(bits(&short[..2 * xe.len()]), bits(&want[..2 * xe.len()]), "on {}", path.name());
        assert_eq!(short[2 * xe.len()], 7.0);
    }
}
