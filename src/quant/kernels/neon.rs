//! aarch64 NEON float kernels.
//!
//! Every kernel is a safe `#[target_feature(enable = "neon")]` function: calling one is
//! `unsafe` outside such functions, and the caller must have checked that the CPU has NEON
//! (see [`super::KernelPath::available`]; it is part of the aarch64 baseline).
//!
//! Every load stays inside the slices it is given (whole chunks via `as_chunks`, scalar
//! tails), so slices of disagreeing lengths give a product over the shorter one. The sums are
//! the scalar references' in another order: four vector accumulators, one horizontal sum.

use std::arch::aarch64::*;

use crate::quant::int4::{GROUP, GROUP_BYTES};
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

/// `sum_i w[i] x[i]` with NEON.
#[target_feature(enable = "neon")]
pub fn f32_dot_neon(w: &[f32], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wv, wt) = w[..n].as_chunks::<4>();
    let (xv, xt) = x[..n].as_chunks::<4>();
    let mut acc = [vdupq_n_f32(0.0); 4];
    let (w4, wr) = wv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in w4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = vfmaq_f32(acc[k], load4(&a[k]), load4(&b[k]));
        }
    }
    for (k, (a, b)) in wr.iter().zip(xr).enumerate() {
        acc[k] = vfmaq_f32(acc[k], load4(a), load4(b));
    }
    let mut s = hsum(acc);
    for (a, b) in wt.iter().zip(xt) {
        s = a.mul_add(*b, s);
    }
    s
}

/// `sum_i bf16(w[i]) x[i]` with NEON.
#[target_feature(enable = "neon")]
pub fn bf16_dot_neon(w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wv, wt) = w[..n].as_chunks::<4>();
    let (xv, xt) = x[..n].as_chunks::<4>();
    let mut acc = [vdupq_n_f32(0.0); 4];
    let (w4, wr) = wv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in w4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = vfmaq_f32(acc[k], load4_bf16(&a[k]), load4(&b[k]));
        }
    }
    for (k, (a, b)) in wr.iter().zip(xr).enumerate() {
        acc[k] = vfmaq_f32(acc[k], load4_bf16(a), load4(b));
    }
    let mut s = hsum(acc);
    for (&a, b) in wt.iter().zip(xt) {
        s = bf16_to_f32(a).mul_add(*b, s);
    }
    s
}

/// `scale * sum_i q[i] x[i]` for one INT8 row, with NEON.
#[target_feature(enable = "neon")]
pub fn int8_dot_neon(codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    let n = codes.len().min(x.len());
    let (cv, ct) = codes[..n].as_chunks::<16>();
    let (xv, xt) = x[..n].as_chunks::<16>();
    let mut acc = [vdupq_n_f32(0.0); 4];
    for (c, xs) in cv.iter().zip(xv) {
        // SAFETY: `c` is 16 readable bytes.
        let q = widen16_i8(unsafe { vld1q_s8(c.as_ptr()) });
        let (x4, _) = xs.as_chunks::<4>();
        for k in 0..4 {
            acc[k] = vfmaq_f32(acc[k], q[k], load4(&x4[k]));
        }
    }
    let mut s = hsum(acc);
    for (&a, b) in ct.iter().zip(xt) {
        s = (a as f32).mul_add(*b, s);
    }
    scale * s
}

/// `sum q_i x_i` over one INT4 group, as 4 lanes.
#[inline]
#[target_feature(enable = "neon")]
fn int4_group_neon(c: &[u8; GROUP_BYTES], x: &[f32; GROUP]) -> float32x4_t {
    let (x4, _) = x.as_chunks::<4>();
    let (c16, _) = c.as_chunks::<16>();
    let (mask, eight) = (vdupq_n_u8(0x0f), vdupq_n_s8(8));
    let mut acc = [vdupq_n_f32(0.0); 4];
    for (h, half) in c16.iter().enumerate() {
        // SAFETY: `half` is 16 readable bytes.
        let v = unsafe { vld1q_u8(half.as_ptr()) };
        let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, mask)), eight);
        let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), eight);
        // Low nibbles are elements 16 h .. 16 h + 16, high nibbles 32 + 16 h ...
        for (base, q) in [(4 * h, widen16_i8(lo)), (8 + 4 * h, widen16_i8(hi))] {
            for k in 0..4 {
                acc[k] = vfmaq_f32(acc[k], q[k], load4(&x4[base + k]));
            }
        }
    }
    vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]))
}

/// One INT4-gs64 row with `x` (whole groups), with NEON: each group's sum in 4 lanes, scaled
/// by the group's scale into one of two vector accumulators.
#[target_feature(enable = "neon")]
pub fn int4_dot_neon(codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    let (cg, _) = codes.as_chunks::<GROUP_BYTES>();
    let (xg, _) = x.as_chunks::<GROUP>();
    let n = scales.len().min(cg.len()).min(xg.len());
    let (cg, xg, scales) = (&cg[..n], &xg[..n], &scales[..n]);
    let d = |g: usize| half::f16::from_bits(scales[g]).to_f32();
    let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    let mut g = 0;
    while g + 2 <= n {
        acc0 = vfmaq_n_f32(acc0, int4_group_neon(&cg[g], &xg[g]), d(g));
        acc1 = vfmaq_n_f32(acc1, int4_group_neon(&cg[g + 1], &xg[g + 1]), d(g + 1));
        g += 2;
    }
    if g < n {
        acc0 = vfmaq_n_f32(acc0, int4_group_neon(&cg[g], &xg[g]), d(g));
    }
    vaddvq_f32(vaddq_f32(acc0, acc1))
}
