//! aarch64 NEON kernels: float kernels for every format, and an integer kernel for MXFP4.
//!
//! Every kernel is a safe `#[target_feature(enable = "neon")]` function: calling one is
//! `unsafe` outside such functions, and the caller must have checked that the CPU has NEON
//! (see [`super::KernelPath::available`]; it is part of the aarch64 baseline).
//!
//! Every load stays inside the slices it is given (whole chunks via `as_chunks`, scalar
//! tails), so slices of disagreeing lengths give a product over the shorter one. The sums are
//! the scalar references' in another order: four vector accumulators, one horizontal sum.
//!
//! As on x86 (see that module), every kernel takes `rows` whole rows and `T` inputs of equal
//! length, loads and widens each weight once for all inputs, and cuts the contraction into
//! blocks for `R > 1` rows (storing and reloading each pair's accumulators, which is exact):
//! each (row, input) pair gets exactly the operations of the `T = 1`, `R = 1` product (the
//! matrix-vector kernel), so every output is bit-identical to it. A kernel does nothing unless
//! its slices hold the `rows` rows.

use std::arch::aarch64::*;

use super::q8::{Mxfp4Group, QuantizedX};
use super::{holds_rows, k_step, mxfp4_q8_inputs, store};
use crate::quant::int4::{self, GROUP, GROUP_BYTES};
use crate::quant::mxfp4::{self, BLOCK, BLOCK_BYTES};
use crate::quant::reference::bf16_to_f32;

/// 4 floats.
#[inline]
#[target_feature(enable = "neon")]
fn load4(a: &[f32; 4]) -> float32x4_t {
    // SAFETY: `a` is 4 readable f32s; NEON loads have no alignment requirement.
    unsafe { vld1q_f32(a.as_ptr()) }
}

/// 4 bfloat16 bit patterns widened exactly to f32.
#[inline]
#[target_feature(enable = "neon")]
fn load4_bf16(a: &[u16; 4]) -> float32x4_t {
    // SAFETY: `a` is 4 readable u16s.
    let v = unsafe { vld1_u16(a.as_ptr()) };
    vreinterpretq_f32_u32(vshll_n_u16::<16>(v))
}

/// 16 signed bytes converted to four vectors of f32, in element order.
#[inline]
#[target_feature(enable = "neon")]
fn widen16_i8(v: int8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_s8(vget_low_s8(v));
    let hi = vmovl_high_s8(v);
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// Sum of four accumulators' lanes.
#[inline]
#[target_feature(enable = "neon")]
fn hsum(acc: [float32x4_t; 4]) -> f32 {
    vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])))
}

/// The length every input and the weights have in common.
#[inline(always)]
fn common<const T: usize>(len: usize, xs: &[&[f32]; T]) -> usize {
    xs.iter().fold(len, |n, x| n.min(x.len()))
}

/// A float dot-product kernel over 4-lane vectors, for `rows` rows of `cols` weights in `w`
/// and each input, into `out[r * stride + t]`: per row and input, four accumulators take the
/// 4-element chunks round-robin (`acc[k]` gets chunks `4 j + k`, leftover whole chunk `k`
/// too), their lanes are summed as `vaddvq((acc0 + acc1) + (acc2 + acc3))`, and the last
/// `n % 4` elements are added one by one with scalar fused multiply-adds.
macro_rules! neon_dot {
    ($(#[$doc:meta])* $name:ident, $w:ty, $load:ident, $widen:expr) => {
        $(#[$doc])*
        #[target_feature(enable = "neon")]
        pub fn $name<const T: usize, const R: usize>(
            w: &[$w],
            rows: usize,
            cols: usize,
            xs: &[&[f32]; T],
            out: &mut [f32],
            stride: usize,
        ) {
            if !holds_rows(w.len(), rows, cols) {
                return;
            }
            let n = common(cols, xs);
            let mut xv: [(&[[f32; 4]], &[f32]); T] = [(&[], &[]); T];
            let mut x4: [(&[[[f32; 4]; 4]], &[[f32; 4]]); T] = [(&[], &[]); T];
            for t in 0..T {
                xv[t] = xs[t][..n].as_chunks::<4>();
                x4[t] = xv[t].0.as_chunks::<4>();
            }
            let blocks = n / 16;
            let step = k_step::<R>(blocks, 16 * 4 * T, 1);
            let mut r0 = 0;
            while r0 < rows {
                let rr = R.min(rows - r0);
                let mut state = [[[vdupq_n_f32(0.0); 4]; T]; R];
                let mut b0 = 0;
                while b0 < blocks {
                    let b1 = blocks.min(b0 + step);
                    for (r, st) in state.iter_mut().enumerate().take(rr) {
                        let (w4v, _) = w[(r0 + r) * cols..][..n].as_chunks::<4>();
                        let (w4, _) = w4v.as_chunks::<4>();
                        let mut acc = *st;
                        for j in b0..b1 {
                            for k in 0..4 {
                                let wk = $load(&w4[j][k]);
                                for t in 0..T {
                                    acc[t][k] = vfmaq_f32(acc[t][k], wk, load4(&x4[t].0[j][k]));
                                }
                            }
                        }
                        *st = acc;
                    }
                    b0 = b1;
                }
                for (r, acc) in state.iter_mut().enumerate().take(rr) {
                    let (wv, wt) = w[(r0 + r) * cols..][..n].as_chunks::<4>();
                    let (_, wr) = wv.as_chunks::<4>();
                    // At most three leftover chunks; a constant trip count keeps `k` static.
                    for k in 0..3 {
                        if let Some(a) = wr.get(k) {
                            let wk = $load(a);
                            for t in 0..T {
                                acc[t][k] = vfmaq_f32(acc[t][k], wk, load4(&x4[t].1[k]));
                            }
                        }
                    }
                    let mut s = [0.0f32; T];
                    for t in 0..T {
                        s[t] = hsum(acc[t]);
                    }
                    for (j, &a) in wt.iter().enumerate() {
                        let a: f32 = $widen(a);
                        for t in 0..T {
                            s[t] = a.mul_add(xv[t].1[j], s[t]);
                        }
                    }
                    store(out, (r0 + r) * stride, &s);
                }
                r0 += rr;
            }
        }
    };
}

neon_dot!(
    /// `sum_i w[i] x_t[i]` with NEON.
    f32_dot_neon,
    f32,
    load4,
    |a: f32| a
);

neon_dot!(
    /// `sum_i bf16(w[i]) x_t[i]` with NEON.
    bf16_dot_neon,
    u16,
    load4_bf16,
    bf16_to_f32
);

/// `sum_i q[i] x_t[i]` for `rows` INT8 rows of `cols` codes and each input, before the row's
/// scale (the caller multiplies: `scale * sum`), with NEON, into `out[r * stride + t]`: per 16
/// codes, widened once, four accumulators take one 4-element quarter each; the last `n % 16`
/// elements are added one by one with scalar fused multiply-adds after the horizontal sum.
#[target_feature(enable = "neon")]
pub fn int8_sum_neon<const T: usize, const R: usize>(
    codes: &[i8],
    rows: usize,
    cols: usize,
    xs: &[&[f32]; T],
    out: &mut [f32],
    stride: usize,
) {
    if !holds_rows(codes.len(), rows, cols) {
        return;
    }
    let n = common(cols, xs);
    let mut xv: [(&[[f32; 16]], &[f32]); T] = [(&[], &[]); T];
    for t in 0..T {
        xv[t] = xs[t][..n].as_chunks::<16>();
    }
    let blocks = n / 16;
    let step = k_step::<R>(blocks, 16 * 4 * T, 1);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[vdupq_n_f32(0.0); 4]; T]; R];
        let mut b0 = 0;
        while b0 < blocks {
            let b1 = blocks.min(b0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                let (cv, _) = codes[(r0 + r) * cols..][..n].as_chunks::<16>();
                let mut acc = *st;
                for (j, c) in cv.iter().enumerate().take(b1).skip(b0) {
                    // SAFETY: `c` is 16 readable bytes.
                    let q = widen16_i8(unsafe { vld1q_s8(c.as_ptr()) });
                    for t in 0..T {
                        let (x4, _) = xv[t].0[j].as_chunks::<4>();
                        for k in 0..4 {
                            acc[t][k] = vfmaq_f32(acc[t][k], q[k], load4(&x4[k]));
                        }
                    }
                }
                *st = acc;
            }
            b0 = b1;
        }
        for (r, acc) in state.iter().enumerate().take(rr) {
            let (_, ct) = codes[(r0 + r) * cols..][..n].as_chunks::<16>();
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = hsum(acc[t]);
            }
            for (j, &a) in ct.iter().enumerate() {
                for t in 0..T {
                    s[t] = (a as f32).mul_add(xv[t].1[j], s[t]);
                }
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// `rows` INT4-gs64 rows of `cols` inputs with each input (whole groups), with NEON, into
/// `out[r * stride + t]`: per row and input, each group's `sum q_i x_i` in four accumulators
/// of 4 lanes (accumulator `k` takes elements `4 m + k` of each 16-element block: low nibbles
/// of the first half, high nibbles of the first half, then the same of the second half),
/// added as `(acc0 + acc1) + (acc2 + acc3)`, times the group's scale into accumulator `g % 2`;
/// one horizontal sum at the end.
#[target_feature(enable = "neon")]
pub fn int4_dot_neon<const T: usize, const R: usize>(
    codes: &[u8],
    scales: &[u16],
    rows: usize,
    cols: usize,
    xs: &[&[f32]; T],
    out: &mut [f32],
    stride: usize,
) {
    let (rb, gpr) = (int4::row_bytes(cols), int4::groups(cols));
    if !holds_rows(codes.len(), rows, rb) || !holds_rows(scales.len(), rows, gpr) {
        return;
    }
    let n = xs.iter().fold(gpr, |n, x| n.min(x.len() / GROUP));
    let mut xg: [&[[f32; GROUP]]; T] = [&[]; T];
    for t in 0..T {
        xg[t] = &xs[t].as_chunks::<GROUP>().0[..n];
    }
    let (mask, eight) = (vdupq_n_u8(0x0f), vdupq_n_s8(8));
    let step = k_step::<R>(n, GROUP * 4 * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[vdupq_n_f32(0.0); T]; 2]; R];
        let mut g0 = 0;
        while g0 < n {
            let g1 = n.min(g0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                let cg = &codes[(r0 + r) * rb..][..rb].as_chunks::<GROUP_BYTES>().0[..n];
                let sc = &scales[(r0 + r) * gpr..][..n];
                let mut acc = *st;
                macro_rules! group {
                    ($g:expr, $acc:expr) => {{
                        let g: usize = $g;
                        let d = half::f16::from_bits(sc[g]).to_f32();
                        let (c16, _) = cg[g].as_chunks::<16>();
                        let mut ga = [[vdupq_n_f32(0.0); 4]; T];
                        for (h, half) in c16.iter().enumerate() {
                            // SAFETY: `half` is 16 readable bytes.
                            let v = unsafe { vld1q_u8(half.as_ptr()) };
                            let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, mask)), eight);
                            let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), eight);
                            // Low nibbles are elements 16 h .. 16 h + 16, high nibbles 32 + 16 h ...
                            for (base, q) in [(4 * h, lo), (8 + 4 * h, hi)] {
                                let q = widen16_i8(q);
                                for t in 0..T {
                                    let (x4, _) = xg[t][g].as_chunks::<4>();
                                    for k in 0..4 {
                                        ga[t][k] = vfmaq_f32(ga[t][k], q[k], load4(&x4[base + k]));
                                    }
                                }
                            }
                        }
                        for t in 0..T {
                            let [a0, a1, a2, a3] = ga[t];
                            $acc[t] =
                                vfmaq_n_f32($acc[t], vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)), d);
                        }
                    }};
                }
                let mut g = g0;
                while g + 2 <= g1 {
                    group!(g, acc[0]);
                    group!(g + 1, acc[1]);
                    g += 2;
                }
                if g < g1 {
                    group!(g, acc[0]);
                }
                *st = acc;
            }
            g0 = g1;
        }
        for (r, acc) in state.iter().enumerate().take(rr) {
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = vaddvq_f32(vaddq_f32(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// MXFP4 rows of `cols` inputs (`codes`, `scales`: whole rows) with each input (whole
/// blocks), with NEON, into `out[r * stride + t]`. The 4-bit codes are decoded by table
/// lookup (`tbl`) into the doubled E2M1 values [`mxfp4::FP4_DOUBLED`] (integers, exact in
/// f32), in element order (`zip` of the low and high nibbles). Per row and input, each
/// block's `sum 2 FP4[c_i] x_i` in four accumulators (`acc[k]` gets the 4-element chunks
/// `4 j + k`), added as `(a0 + a1) + (a2 + a3)`, times `2^(e - 127) / 2` (exact) into
/// accumulator `b % 2`; one horizontal sum at the end.
#[target_feature(enable = "neon")]
pub fn mxfp4_dot_neon<const T: usize, const R: usize>(
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xs: &[&[f32]; T],
    out: &mut [f32],
    stride: usize,
) {
    let (rb, bpr) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    if !holds_rows(codes.len(), rows, rb) || !holds_rows(scales.len(), rows, bpr) {
        return;
    }
    let n = xs.iter().fold(bpr, |n, x| n.min(x.len() / BLOCK));
    let mut xb: [&[[f32; BLOCK]]; T] = [&[]; T];
    for t in 0..T {
        xb[t] = &xs[t].as_chunks::<BLOCK>().0[..n];
    }
    // SAFETY: 16 readable bytes.
    let table = unsafe { vld1q_s8(mxfp4::FP4_DOUBLED.as_ptr()) };
    let mask = vdupq_n_u8(0x0f);
    let step = k_step::<R>(n, BLOCK * 4 * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[vdupq_n_f32(0.0); T]; 2]; R];
        let mut b0 = 0;
        while b0 < n {
            let b1 = n.min(b0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                let cb = &codes[(r0 + r) * rb..][..rb].as_chunks::<BLOCK_BYTES>().0[..n];
                let sc = &scales[(r0 + r) * bpr..][..n];
                let mut acc = *st;
                macro_rules! block {
                    ($b:expr, $acc:expr) => {{
                        let b: usize = $b;
                        let d = mxfp4::scale_f32(sc[b]) * 0.5;
                        // SAFETY: `cb[b]` is 16 readable bytes.
                        let v = unsafe { vld1q_u8(cb[b].as_ptr()) };
                        let (lo, hi) = (vandq_u8(v, mask), vshrq_n_u8::<4>(v));
                        let mut ba = [[vdupq_n_f32(0.0); 4]; T];
                        for (h, idx) in [vzip1q_u8(lo, hi), vzip2q_u8(lo, hi)].into_iter().enumerate() {
                            let w = widen16_i8(vqtbl1q_s8(table, idx));
                            for t in 0..T {
                                let (x4, _) = xb[t][b].as_chunks::<4>();
                                for k in 0..4 {
                                    ba[t][k] = vfmaq_f32(ba[t][k], w[k], load4(&x4[4 * h + k]));
                                }
                            }
                        }
                        for t in 0..T {
                            let [a0, a1, a2, a3] = ba[t];
                            $acc[t] =
                                vfmaq_n_f32($acc[t], vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)), d);
                        }
                    }};
                }
                let mut b = b0;
                while b + 2 <= b1 {
                    block!(b, acc[0]);
                    block!(b + 1, acc[1]);
                    b += 2;
                }
                if b < b1 {
                    block!(b, acc[0]);
                }
                *st = acc;
            }
            b0 = b1;
        }
        for (r, acc) in state.iter().enumerate().take(rr) {
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = vaddvq_f32(vaddq_f32(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// The integer-kernel dot products of MXFP4 rows of `cols` inputs (`codes`, `scales`: whole
/// rows) with each of `T` quantized inputs ([`super::q8::mxfp4_dot_reference`]), with NEON,
/// into `out[r * stride + t]`, one activation group (two blocks) a step.
///
/// Per row and block pair (shared by every input): each block's 16 code bytes, masked to the
/// low nibbles and shifted right by 4, are looked up (`tbl`) in [`mxfp4::FP4_DOUBLED`]: the
/// doubled E2M1 weights (signed bytes in `-12..=12`) of the block's even elements, then of its
/// odd ones, which is the order of [`Mxfp4Group::codes`]. Per row and input, widening
/// multiplies (`smull`, `smlal`) of the weights with the input's codes sum four products in
/// each i16 lane (at most `4 * 12 * 127`: exact), eight lanes a block; a pairwise add of the
/// two blocks' lanes (at most twice that) and a widening pairwise add give 4 exact i32
/// partial sums, two per block, converted to f32 and multiply-added by `(2^(e_b - 127) / 2) *
/// s_g` into accumulator `pair % 2` of the row and input. A last odd block goes alone after
/// the last pair; one horizontal sum at the end. The integer sums are the x86 kernels'; the
/// float sums are in another order.
#[target_feature(enable = "neon")]
pub fn mxfp4_dot_q8_neon<const T: usize, const R: usize>(
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xs: &[&QuantizedX; T],
    out: &mut [f32],
    stride: usize,
) {
    const PAIR_BYTES: usize = 2 * BLOCK_BYTES;
    let (rb, bpr) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    if !holds_rows(codes.len(), rows, rb) || !holds_rows(scales.len(), rows, bpr) {
        return;
    }
    let (n, xg, sx) = mxfp4_q8_inputs(xs, bpr);
    let (pairs, odd) = (n / 2, n % 2 == 1);
    // SAFETY: 16 readable bytes.
    let table = unsafe { vld1q_s8(mxfp4::FP4_DOUBLED.as_ptr()) };
    let mask = vdupq_n_u8(0x0f);
    // One block's weights (`v`: its 16 code bytes): even elements, odd elements.
    macro_rules! weights {
        ($v:expr) => {{
            let v: uint8x16_t = $v;
            [vqtbl1q_s8(table, vandq_u8(v, mask)), vqtbl1q_s8(table, vshrq_n_u8::<4>(v))]
        }};
    }
    // The exact i16 partial sums of one block: weights `$w` (even, odd) with the input's
    // codes for its even (`$pe`) and odd (`$po`) elements.
    macro_rules! block_sums {
        ($w:expr, $pe:expr, $po:expr) => {{
            let [we, wo]: [int8x16_t; 2] = $w;
            let (pe, po): (int8x16_t, int8x16_t) = ($pe, $po);
            let m = vmull_s8(vget_low_s8(we), vget_low_s8(pe));
            let m = vmlal_high_s8(m, we, pe);
            let m = vmlal_s8(m, vget_low_s8(wo), vget_low_s8(po));
            vmlal_high_s8(m, wo, po)
        }};
    }
    let step = k_step::<R>(pairs, (size_of::<Mxfp4Group>() + size_of::<f32>()) * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[vdupq_n_f32(0.0); T]; 2]; R];
        let mut g0 = 0;
        while g0 < pairs {
            let g1 = pairs.min(g0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                let row = r0 + r;
                let cp = &codes[row * rb..][..rb].as_chunks::<PAIR_BYTES>().0[..pairs];
                let sc = &scales[row * bpr..][..n];
                let mut acc = *st;
                for g in g0..g1 {
                    // SAFETY: `cp[g]` is 32 readable bytes.
                    let (c0, c1) = unsafe { (vld1q_u8(cp[g].as_ptr()), vld1q_u8(cp[g].as_ptr().add(16))) };
                    let (w0, w1) = (weights!(c0), weights!(c1));
                    let (e0, e1) =
                        (mxfp4::HALF_SCALES[sc[2 * g] as usize], mxfp4::HALF_SCALES[sc[2 * g + 1] as usize]);
                    // Lanes 0 and 1 hold block 0's partial sums, 2 and 3 block 1's.
                    let e = vcombine_f32(vdup_n_f32(e0), vdup_n_f32(e1));
                    for t in 0..T {
                        let p = xg[t][g].codes.as_ptr();
                        // SAFETY: `p` points at 64 readable bytes. (Four loads written out: a
                        // closure in a kernel's loop is not always inlined.)
                        let (p0, p1, p2, p3) = unsafe {
                            (vld1q_s8(p), vld1q_s8(p.add(16)), vld1q_s8(p.add(32)), vld1q_s8(p.add(48)))
                        };
                        let m = vpaddq_s16(block_sums!(w0, p0, p2), block_sums!(w1, p1, p3));
                        let sum = vcvtq_f32_s32(vpaddlq_s16(m));
                        let a = &mut acc[g % 2][t];
                        *a = vfmaq_f32(*a, sum, vmulq_n_f32(e, sx[t][g]));
                    }
                }
                *st = acc;
            }
            g0 = g1;
        }
        for (r, acc) in state.iter_mut().enumerate().take(rr) {
            let row = r0 + r;
            if odd {
                let b = n - 1;
                let tail = &codes[row * rb + b * BLOCK_BYTES..][..BLOCK_BYTES];
                // SAFETY: `tail` is 16 readable bytes.
                let w = weights!(unsafe { vld1q_u8(tail.as_ptr()) });
                let e = mxfp4::HALF_SCALES[scales[row * bpr + b] as usize];
                for t in 0..T {
                    let p = &xg[t][pairs].codes;
                    // SAFETY: `p` is 64 readable bytes.
                    let (pe, po) = unsafe { (vld1q_s8(p.as_ptr()), vld1q_s8(p.as_ptr().add(32))) };
                    let sum = vcvtq_f32_s32(vpaddlq_s16(block_sums!(w, pe, po)));
                    let a = &mut acc[pairs % 2][t];
                    *a = vfmaq_f32(*a, sum, vdupq_n_f32(e * sx[t][pairs]));
                }
            }
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = vaddvq_f32(vaddq_f32(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}
