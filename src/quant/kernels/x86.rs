//! x86-64 kernels: AVX2 + FMA + F16C, AVX-512 (F, BW, VL), and AVX-512 VNNI integer kernels.
//!
//! Every kernel is a safe `#[target_feature]` function: calling one from code without those
//! features enabled is `unsafe`, and the caller must have checked that the CPU has them (see
//! [`super::KernelPath::available`]). Every load stays inside the slices it is given (whole
//! chunks via `as_chunks`, masked or scalar tails), so slices of disagreeing lengths give a
//! product over the shorter one, never an out-of-bounds read.
//!
//! The [`KernelPath::Avx512`](super::KernelPath::Avx512) path runs the 512-bit kernels for
//! every format. The VNNI path, the default on such CPUs, runs the integer kernels for INT4
//! and INT8 and the 256-bit AVX2 kernels for f32 and bf16: on Zen 4 (double-pumped 512-bit
//! units) those stream weights from memory faster (one thread, 5760x2880, beyond the caches:
//! f32 24 against 22 GB/s, bf16 28 against 23; `docs/perf.md`), which is the decode case,
//! although the 512-bit f32 kernel wins on a matrix that stays in L3 (32 against 26).
//!
//! The float kernels compute the same sums as the scalar references in
//! [`crate::quant::reference`], [`crate::quant::int4`] and [`crate::quant::int8`], in a
//! different order (several vector accumulators, one horizontal sum at the end). The VNNI
//! kernels compute the quantized-activation sums defined in [`super::q8`].

use std::arch::x86_64::*;

use super::q8::QuantizedX;
use crate::quant::int4::{GROUP, GROUP_BYTES};

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C
// ---------------------------------------------------------------------------------------------

/// Sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load8(a: &[f32; 8]) -> __m256 {
    // SAFETY: `a` is 8 readable f32s; unaligned loads are allowed.
    unsafe { _mm256_loadu_ps(a.as_ptr()) }
}

/// 8 bfloat16 bit patterns widened exactly to f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load8_bf16(a: &[u16; 8]) -> __m256 {
    // SAFETY: `a` is 16 readable bytes; unaligned loads are allowed.
    let v = unsafe { _mm_loadu_si128(a.as_ptr().cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}

/// 8 signed bytes converted to f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load8_i8(a: &[i8; 8]) -> __m256 {
    // SAFETY: `a` is 8 readable bytes, exactly what `_mm_loadl_epi64` reads.
    let v = unsafe { _mm_loadl_epi64(a.as_ptr().cast()) };
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// An f16 bit pattern converted to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The 32 code bytes of an INT4 group as `q` (nibble minus 8) in i8 lanes: elements 0..32
/// (low nibbles) and elements 32..64 (high nibbles).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn int4_unpack(c: &[u8; GROUP_BYTES]) -> (__m256i, __m256i) {
    // SAFETY: `c` is 32 readable bytes; unaligned loads are allowed.
    let v = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
    let mask = _mm256_set1_epi8(0x0f);
    let eight = _mm256_set1_epi8(8);
    let lo = _mm256_sub_epi8(_mm256_and_si256(v, mask), eight);
    let hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16::<4>(v), mask), eight);
    (lo, hi)
}

/// The four 128-bit quarters (16 elements each, in element order) of an unpacked group.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn int4_quarters(c: &[u8; GROUP_BYTES]) -> [__m128i; 4] {
    let (lo, hi) = int4_unpack(c);
    [
        _mm256_castsi256_si128(lo),
        _mm256_extracti128_si256::<1>(lo),
        _mm256_castsi256_si128(hi),
        _mm256_extracti128_si256::<1>(hi),
    ]
}

/// `sum q_i x_i` over one INT4 group, as 8 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn int4_group_avx2(c: &[u8; GROUP_BYTES], x: &[f32; GROUP]) -> __m256 {
    let (xs, _) = x.as_chunks::<8>();
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for (k, q) in int4_quarters(c).into_iter().enumerate() {
        let q_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        let q_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
        s0 = _mm256_fmadd_ps(q_lo, load8(&xs[2 * k]), s0);
        s1 = _mm256_fmadd_ps(q_hi, load8(&xs[2 * k + 1]), s1);
    }
    _mm256_add_ps(s0, s1)
}

/// `sum_i w[i] x[i]` with AVX2 + FMA.
#[target_feature(enable = "avx2,fma")]
pub fn f32_dot_avx2(w: &[f32], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wv, wt) = w[..n].as_chunks::<8>();
    let (xv, xt) = x[..n].as_chunks::<8>();
    let mut acc = [_mm256_setzero_ps(); 4];
    let (w4, wr) = wv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in w4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = _mm256_fmadd_ps(load8(&a[k]), load8(&b[k]), acc[k]);
        }
    }
    for (a, b) in wr.iter().zip(xr) {
        acc[0] = _mm256_fmadd_ps(load8(a), load8(b), acc[0]);
    }
    let mut s = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (a, b) in wt.iter().zip(xt) {
        s = a.mul_add(*b, s);
    }
    s
}

/// `sum_i bf16(w[i]) x[i]` with AVX2 + FMA.
#[target_feature(enable = "avx2,fma")]
pub fn bf16_dot_avx2(w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wv, wt) = w[..n].as_chunks::<8>();
    let (xv, xt) = x[..n].as_chunks::<8>();
    let mut acc = [_mm256_setzero_ps(); 4];
    let (w4, wr) = wv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in w4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = _mm256_fmadd_ps(load8_bf16(&a[k]), load8(&b[k]), acc[k]);
        }
    }
    for (a, b) in wr.iter().zip(xr) {
        acc[0] = _mm256_fmadd_ps(load8_bf16(a), load8(b), acc[0]);
    }
    let mut s = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (&a, b) in wt.iter().zip(xt) {
        s = crate::quant::reference::bf16_to_f32(a).mul_add(*b, s);
    }
    s
}

/// `scale * sum_i q[i] x[i]` for one INT8 row, with AVX2 + FMA.
#[target_feature(enable = "avx2,fma")]
pub fn int8_dot_avx2(codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    let n = codes.len().min(x.len());
    let (cv, ct) = codes[..n].as_chunks::<8>();
    let (xv, xt) = x[..n].as_chunks::<8>();
    let mut acc = [_mm256_setzero_ps(); 4];
    let (c4, cr) = cv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in c4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = _mm256_fmadd_ps(load8_i8(&a[k]), load8(&b[k]), acc[k]);
        }
    }
    for (a, b) in cr.iter().zip(xr) {
        acc[0] = _mm256_fmadd_ps(load8_i8(a), load8(b), acc[0]);
    }
    let mut s = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (&a, b) in ct.iter().zip(xt) {
        s = (a as f32).mul_add(*b, s);
    }
    scale * s
}

/// One INT4-gs64 row with `x` (whole groups), with AVX2 + FMA + F16C: each group's sum in
/// 8 lanes, scaled by the group's scale into one of two vector accumulators.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn int4_dot_avx2(codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    let (cg, _) = codes.as_chunks::<GROUP_BYTES>();
    let (xg, _) = x.as_chunks::<GROUP>();
    let n = scales.len().min(cg.len()).min(xg.len());
    let (cg, xg, scales) = (&cg[..n], &xg[..n], &scales[..n]);
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut g = 0;
    while g + 2 <= n {
        let d0 = _mm256_set1_ps(f16_to_f32(scales[g]));
        let d1 = _mm256_set1_ps(f16_to_f32(scales[g + 1]));
        acc0 = _mm256_fmadd_ps(int4_group_avx2(&cg[g], &xg[g]), d0, acc0);
        acc1 = _mm256_fmadd_ps(int4_group_avx2(&cg[g + 1], &xg[g + 1]), d1, acc1);
        g += 2;
    }
    if g < n {
        let d = _mm256_set1_ps(f16_to_f32(scales[g]));
        acc0 = _mm256_fmadd_ps(int4_group_avx2(&cg[g], &xg[g]), d, acc0);
    }
    hsum256(_mm256_add_ps(acc0, acc1))
}

// ---------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL)
// ---------------------------------------------------------------------------------------------

/// 16 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16(a: &[f32; 16]) -> __m512 {
    // SAFETY: `a` is 16 readable f32s; unaligned loads are allowed.
    unsafe { _mm512_loadu_ps(a.as_ptr()) }
}

/// The first `t.len()` (< 16) lanes from `t`, zero above.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16_tail(t: &[f32]) -> __m512 {
    let m = tail_mask(t.len());
    // SAFETY: the mask enables only the first `t.len()` lanes, which are readable; masked-off
    // lanes are not accessed.
    unsafe { _mm512_maskz_loadu_ps(m, t.as_ptr()) }
}

/// Mask of the first `len` (<= 16) lanes.
#[inline]
fn tail_mask(len: usize) -> __mmask16 {
    ((1u32 << len.min(16)) - 1) as __mmask16
}

/// 16 bfloat16 bit patterns (`v`, 256 bits) widened exactly to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn widen16_bf16(v: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

/// 16 bfloat16 bit patterns widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16_bf16(a: &[u16; 16]) -> __m512 {
    // SAFETY: `a` is 32 readable bytes; unaligned loads are allowed.
    widen16_bf16(unsafe { _mm256_loadu_si256(a.as_ptr().cast()) })
}

/// 16 signed bytes (`v`, 128 bits) converted to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn widen16_i8(v: __m128i) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
}

/// 16 signed bytes converted to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16_i8(a: &[i8; 16]) -> __m512 {
    // SAFETY: `a` is 16 readable bytes; unaligned loads are allowed.
    widen16_i8(unsafe { _mm_loadu_si128(a.as_ptr().cast()) })
}

/// `sum q_i x_i` over one INT4 group, as 16 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn int4_group_avx512(c: &[u8; GROUP_BYTES], x: &[f32; GROUP]) -> __m512 {
    let (xs, _) = x.as_chunks::<16>();
    let [q0, q1, q2, q3] = int4_quarters(c);
    let s0 = _mm512_mul_ps(widen16_i8(q0), load16(&xs[0]));
    let s1 = _mm512_mul_ps(widen16_i8(q1), load16(&xs[1]));
    let s0 = _mm512_fmadd_ps(widen16_i8(q2), load16(&xs[2]), s0);
    let s1 = _mm512_fmadd_ps(widen16_i8(q3), load16(&xs[3]), s1);
    _mm512_add_ps(s0, s1)
}

/// `sum_i w[i] x[i]` with AVX-512.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub fn f32_dot_avx512(w: &[f32], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wv, wt) = w[..n].as_chunks::<16>();
    let (xv, xt) = x[..n].as_chunks::<16>();
    let mut acc = [_mm512_setzero_ps(); 4];
    let (w4, wr) = wv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in w4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = _mm512_fmadd_ps(load16(&a[k]), load16(&b[k]), acc[k]);
        }
    }
    for (k, (a, b)) in wr.iter().zip(xr).enumerate() {
        acc[k] = _mm512_fmadd_ps(load16(a), load16(b), acc[k]);
    }
    if !wt.is_empty() {
        acc[3] = _mm512_fmadd_ps(load16_tail(wt), load16_tail(xt), acc[3]);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))
}

/// `sum_i bf16(w[i]) x[i]` with AVX-512.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub fn bf16_dot_avx512(w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wv, wt) = w[..n].as_chunks::<16>();
    let (xv, xt) = x[..n].as_chunks::<16>();
    let mut acc = [_mm512_setzero_ps(); 4];
    let (w4, wr) = wv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in w4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = _mm512_fmadd_ps(load16_bf16(&a[k]), load16(&b[k]), acc[k]);
        }
    }
    for (k, (a, b)) in wr.iter().zip(xr).enumerate() {
        acc[k] = _mm512_fmadd_ps(load16_bf16(a), load16(b), acc[k]);
    }
    if !wt.is_empty() {
        // SAFETY: the mask enables only the first `wt.len()` lanes, which are readable.
        let v = unsafe { _mm256_maskz_loadu_epi16(tail_mask(wt.len()), wt.as_ptr().cast()) };
        acc[3] = _mm512_fmadd_ps(widen16_bf16(v), load16_tail(xt), acc[3]);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))
}

/// `scale * sum_i q[i] x[i]` for one INT8 row, with AVX-512.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub fn int8_dot_avx512(codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    let n = codes.len().min(x.len());
    let (cv, ct) = codes[..n].as_chunks::<16>();
    let (xv, xt) = x[..n].as_chunks::<16>();
    let mut acc = [_mm512_setzero_ps(); 4];
    let (c4, cr) = cv.as_chunks::<4>();
    let (x4, xr) = xv.as_chunks::<4>();
    for (a, b) in c4.iter().zip(x4) {
        for k in 0..4 {
            acc[k] = _mm512_fmadd_ps(load16_i8(&a[k]), load16(&b[k]), acc[k]);
        }
    }
    for (k, (a, b)) in cr.iter().zip(xr).enumerate() {
        acc[k] = _mm512_fmadd_ps(load16_i8(a), load16(b), acc[k]);
    }
    if !ct.is_empty() {
        // SAFETY: the mask enables only the first `ct.len()` lanes, which are readable.
        let v = unsafe { _mm_maskz_loadu_epi8(tail_mask(ct.len()), ct.as_ptr()) };
        acc[3] = _mm512_fmadd_ps(widen16_i8(v), load16_tail(xt), acc[3]);
    }
    scale * _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))
}

/// One INT4-gs64 row with `x` (whole groups), with AVX-512: each group's sum in 16 lanes,
/// scaled by the group's scale into one of two vector accumulators.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub fn int4_dot_avx512(codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    let (cg, _) = codes.as_chunks::<GROUP_BYTES>();
    let (xg, _) = x.as_chunks::<GROUP>();
    let n = scales.len().min(cg.len()).min(xg.len());
    let (cg, xg, scales) = (&cg[..n], &xg[..n], &scales[..n]);
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut g = 0;
    while g + 2 <= n {
        let d0 = _mm512_set1_ps(f16_to_f32(scales[g]));
        let d1 = _mm512_set1_ps(f16_to_f32(scales[g + 1]));
        acc0 = _mm512_fmadd_ps(int4_group_avx512(&cg[g], &xg[g]), d0, acc0);
        acc1 = _mm512_fmadd_ps(int4_group_avx512(&cg[g + 1], &xg[g + 1]), d1, acc1);
        g += 2;
    }
    if g < n {
        let d = _mm512_set1_ps(f16_to_f32(scales[g]));
        acc0 = _mm512_fmadd_ps(int4_group_avx512(&cg[g], &xg[g]), d, acc0);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: integer kernels over quantized activations (see `q8`)
// ---------------------------------------------------------------------------------------------

/// 32 signed bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn load32_i8(a: &[i8; 32]) -> __m256i {
    // SAFETY: `a` is 32 readable bytes; unaligned loads are allowed.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// `acc + (d * s) * (sum q p)` for one INT4 group, in 256-bit registers (on Zen 4 a 512-bit
/// operation costs two 256-bit ones, and the 256-bit form needs no cross-lane shuffles):
/// `vpdpbusd` of the unsigned codes `q + 8` (low nibbles, then high nibbles) with the
/// activation codes `p`, started from `bias = -8 * sum(p)` so each of the 8 i32 lanes holds
/// an exact partial `sum q p`; then converted to f32 and scaled.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn int4_q8_group(c: &[u8; GROUP_BYTES], p: &[i8; GROUP], d: u16, s: f32, bias: i32, acc: __m256) -> __m256 {
    // SAFETY: `c` is 32 readable bytes; unaligned loads are allowed.
    let v = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
    let mask = _mm256_set1_epi8(0x0f);
    let (lo, hi) = (_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
    let (ps, _) = p.as_chunks::<32>();
    let start = _mm256_zextsi128_si256(_mm_cvtsi32_si128(bias));
    let sum = _mm256_dpbusd_epi32(start, lo, load32_i8(&ps[0]));
    let sum = _mm256_dpbusd_epi32(sum, hi, load32_i8(&ps[1]));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(f16_to_f32(d) * s), acc)
}

/// The integer-kernel dot product of one INT4-gs64 row with quantized activations
/// ([`super::q8::int4_dot_reference`]), with AVX-512 VNNI: see [`int4_q8_group`]; groups
/// alternate between two vector accumulators, summed horizontally once at the end.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub fn int4_dot_q8_vnni(codes: &[u8], scales: &[u16], x: &QuantizedX) -> f32 {
    let (cg, _) = codes.as_chunks::<GROUP_BYTES>();
    let (pg, _) = x.codes().as_chunks::<GROUP>();
    let (sx, bias) = (x.scales(), x.int4_bias());
    let n = scales.len().min(cg.len()).min(pg.len()).min(sx.len()).min(bias.len());
    let (cg, pg, scales, sx, bias) = (&cg[..n], &pg[..n], &scales[..n], &sx[..n], &bias[..n]);
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut g = 0;
    while g + 2 <= n {
        acc0 = int4_q8_group(&cg[g], &pg[g], scales[g], sx[g], bias[g], acc0);
        acc1 = int4_q8_group(&cg[g + 1], &pg[g + 1], scales[g + 1], sx[g + 1], bias[g + 1], acc1);
        g += 2;
    }
    if g < n {
        acc0 = int4_q8_group(&cg[g], &pg[g], scales[g], sx[g], bias[g], acc0);
    }
    hsum256(_mm256_add_ps(acc0, acc1))
}

/// `acc + s * (sum q p)` for one group of 64 INT8 codes `q` with activation codes `p`:
/// `vpdpbusd` of `|q|` (as unsigned: `|-128|` reads as 128) with `p` carrying the sign of
/// `q` (`vpsignb`; exact since `|p| <= 127`), in 256-bit halves, then converted and scaled.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn int8_q8_group(q: &[i8; GROUP], p: &[i8; GROUP], s: f32, acc: __m256) -> __m256 {
    let (qs, _) = q.as_chunks::<32>();
    let (ps, _) = p.as_chunks::<32>();
    let mut sum = _mm256_setzero_si256();
    for (q, p) in qs.iter().zip(ps) {
        let (q, p) = (load32_i8(q), load32_i8(p));
        sum = _mm256_dpbusd_epi32(sum, _mm256_abs_epi8(q), _mm256_sign_epi8(p, q));
    }
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(s), acc)
}

/// The integer-kernel dot product of one INT8 row with quantized activations
/// ([`super::q8::int8_dot_reference`]), with AVX-512 VNNI: see [`int8_q8_group`]; groups
/// alternate between two vector accumulators, summed horizontally once at the end. A
/// partial last group is copied into a zero-padded buffer.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub fn int8_dot_q8_vnni(codes: &[i8], scale: f32, x: &QuantizedX) -> f32 {
    let n = codes.len().min(x.len());
    let (cg, ct) = codes[..n].as_chunks::<GROUP>();
    let (pg, _) = x.codes().as_chunks::<GROUP>();
    let sx = x.scales();
    let full = cg.len().min(pg.len()).min(sx.len());
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut g = 0;
    while g + 2 <= full {
        acc0 = int8_q8_group(&cg[g], &pg[g], sx[g], acc0);
        acc1 = int8_q8_group(&cg[g + 1], &pg[g + 1], sx[g + 1], acc1);
        g += 2;
    }
    if g < full {
        acc0 = int8_q8_group(&cg[g], &pg[g], sx[g], acc0);
    }
    if let (false, Some(p), Some(&s)) = (ct.is_empty(), pg.get(cg.len()), sx.get(cg.len())) {
        let mut tail = [0i8; GROUP];
        tail[..ct.len()].copy_from_slice(ct);
        acc1 = int8_q8_group(&tail, p, s, acc1);
    }
    scale * hsum256(_mm256_add_ps(acc0, acc1))
}
