//! x86-64 kernels: AVX2 + FMA + F16C, AVX-512 (F, BW, VL), and integer kernels (AVX-512 VNNI,
//! and for MXFP4 also AVX2).
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
//!
//! # Several rows and inputs at once
//! Every kernel takes whole rows of `cols` weights and `T` inputs (`xs: &[&[f32]; T]`), and
//! writes the dot product of row `r` with input `t` to `out[r * stride + t]`. Each weight
//! vector is loaded and unpacked or widened once, then multiplied into every input's own
//! accumulators. Rows go in groups of `R`, and for `R > 1` the contraction is cut into blocks
//! (of about [`super::X_TILE_BYTES`] of inputs, so they stay in L1 while the `R` rows pass):
//! each (row, input) pair's accumulators are stored after one block and reloaded for the next,
//! which is exact. So the operations applied to one row and one input (which lanes, which
//! accumulator each product enters and in what order, the horizontal sum, the scaling) do not
//! depend on `T`, `R`, the blocks or the other rows and inputs, and every output is
//! bit-identical to the `T = 1`, `R = 1` product of that row and input alone, which is the
//! matrix-vector kernel. The inputs must have equal lengths for that to hold (the products
//! run over the shortest); the dispatcher in [`super`] checks it. The AVX2 kernels come
//! twice: for AVX2 CPUs (16 vector registers, few inputs per pass) and, compiled with AVX-512
//! VL (`*_vl`, 32 registers), for the VNNI path. The two compile the same operations.

use std::arch::x86_64::*;

use super::q8::{MXFP4_WEIGHT_OFFSET, Mxfp4Group, QuantizedX};
use super::{STREAM_AHEAD_BYTES, holds_rows, k_step, mxfp4_q8_inputs, store};
use crate::quant::int4::{self, GROUP, GROUP_BYTES};
use crate::quant::mxfp4::{self, BLOCK, BLOCK_BYTES};
use crate::quant::reference::bf16_to_f32;

/// The length every input and the weights have in common.
#[inline(always)]
fn common<const T: usize>(len: usize, xs: &[&[f32]; T]) -> usize {
    xs.iter().fold(len, |n, x| n.min(x.len()))
}

/// Asks for the cache lines of `s` to be brought into L2 (a hint: it never faults).
#[inline(always)]
fn prefetch<T>(s: &[T]) {
    let (p, bytes) = (s.as_ptr().cast::<i8>(), size_of_val(s));
    let mut o = 0;
    while o < bytes {
        // SAFETY: `p + o` is inside `s` (and a prefetch does not access memory anyway).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.add(o)) };
        o += 64;
    }
}

/// Asks for the cache line [`STREAM_AHEAD_BYTES`] past `at` to be brought into L2: called
/// once per 64 bytes a one-input kernel consumes of a weight stream it reads in memory order,
/// so the lines it will reach are in flight well before it does. A hint: the address may lie
/// past the end of the weights (another row's, another thread's, or none), it is never
/// dereferenced and a prefetch does not fault.
#[inline(always)]
fn prefetch_stream_ahead<U>(at: &U) {
    let p = std::ptr::from_ref(at).cast::<i8>().wrapping_add(STREAM_AHEAD_BYTES);
    // SAFETY: a prefetch reads no memory and never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p) };
}

/// Prefetches (into L2) the part that the next group of `R` rows will read, while the current
/// group works on the same columns: `part(r)` is that part of row `r`, for rows below `rows`.
#[inline(always)]
fn prefetch_next<'a, T: 'a, const R: usize>(r: usize, rows: usize, part: impl Fn(usize) -> [&'a [T]; 2]) {
    if R > 1 && r + R < rows {
        for s in part(r + R) {
            prefetch(s);
        }
    }
}

/// Prefetches unit `i` of each of `ahead` (the same units, `U`, of the rows that a
/// multi-row kernel reaches `R` rows further on) when `i` starts a cache line, so that those
/// rows come in a line at a time as the current ones are done: rows side by side are short
/// interleaved streams that the hardware prefetcher follows poorly, and a burst of all their
/// lines at once ([`prefetch_next`]) stalled on misses in flight.
#[inline(always)]
fn prefetch_line_ahead<U, const G: usize>(ahead: &[&[U]; G], i: usize) {
    if i.is_multiple_of((64 / size_of::<U>()).max(1)) {
        for a in ahead {
            if let Some(unit) = a.get(i) {
                prefetch(std::slice::from_ref(unit));
            }
        }
    }
}

/// Runs `$body!(G, r)` for the rows `r .. r + G` of `0..$rows`, in groups of `$together`
/// (1 to 4; the last group may be smaller), `G` a literal so that the body's arrays have a
/// constant length: how the kernels that put rows side by side walk a row block.
macro_rules! in_row_groups {
    ($rows:expr, $together:expr, $body:ident) => {{
        let (rows, together): (usize, usize) = ($rows, $together);
        let mut r = 0;
        while r < rows {
            let g = together.min(rows - r);
            match g {
                4.. => $body!(4, r),
                3 => $body!(3, r),
                2 => $body!(2, r),
                _ => $body!(1, r),
            }
            r += g.clamp(1, 4);
        }
    }};
}

// The kernels below avoid closures and `array::map` in their loops: a closure inherits the
// kernel's target features and is then not always inlined, which would move the accumulators
// to memory. Per-group bodies are local macros instead.

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C
// ---------------------------------------------------------------------------------------------

/// Sum of the 8 lanes: `(v0 + v4) + (v2 + v6)` plus `(v1 + v5) + (v3 + v7)`.
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

/// A float dot-product kernel over 8-lane vectors for the AVX2 path. Per row and input, four
/// accumulators take the 8-element chunks round-robin (`acc[k]` gets chunks `4 j + k`),
/// leftover whole chunks go to `acc[0]`, the accumulators are added as
/// `(acc0 + acc1) + (acc2 + acc3)` and summed horizontally, and the last `n % 8` elements are
/// added one by one with scalar fused multiply-adds.
macro_rules! avx2_dot {
    ($(#[$doc:meta])* $name:ident, $w:ty, $load:ident, $widen:expr) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c")]
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
            let mut xv: [(&[[f32; 8]], &[f32]); T] = [(&[], &[]); T];
            let mut x4: [(&[[[f32; 8]; 4]], &[[f32; 8]]); T] = [(&[], &[]); T];
            for t in 0..T {
                xv[t] = xs[t][..n].as_chunks::<8>();
                x4[t] = xv[t].0.as_chunks::<4>();
            }
            let blocks = n / 32;
            let step = k_step::<R>(blocks, 32 * 4 * T, 1);
            let mut r0 = 0;
            while r0 < rows {
                let rr = R.min(rows - r0);
                let mut state = [[[_mm256_setzero_ps(); 4]; T]; R];
                let mut b0 = 0;
                while b0 < blocks {
                    let b1 = blocks.min(b0 + step);
                    for (r, st) in state.iter_mut().enumerate().take(rr) {
                        // One input streams each row whole, in memory order, and prefetches
                        // a fixed distance ahead (`prefetch_stream_ahead`).
                        if T > 1 {
                            prefetch_next::<_, R>(r0 + r, rows, |r| [&w[r * cols + b0 * 32..r * cols + b1 * 32], &[]]);
                        }
                        let (w8, _) = w[(r0 + r) * cols..][..n].as_chunks::<8>();
                        let (w4, _) = w8.as_chunks::<4>();
                        let mut acc = *st;
                        for j in b0..b1 {
                            for k in 0..4 {
                                // One prefetch per cache line of weights (64 bytes).
                                if T == 1 && ((4 * j + k) * 8 * size_of::<$w>()).is_multiple_of(64) {
                                    prefetch_stream_ahead(&w4[j][k]);
                                }
                                let wk = $load(&w4[j][k]);
                                for t in 0..T {
                                    acc[t][k] = _mm256_fmadd_ps(wk, load8(&x4[t].0[j][k]), acc[t][k]);
                                }
                            }
                        }
                        *st = acc;
                    }
                    b0 = b1;
                }
                for (r, acc) in state.iter_mut().enumerate().take(rr) {
                    let (wv, wt) = w[(r0 + r) * cols..][..n].as_chunks::<8>();
                    let (_, wr) = wv.as_chunks::<4>();
                    for (j, a) in wr.iter().enumerate() {
                        let wk = $load(a);
                        for t in 0..T {
                            acc[t][0] = _mm256_fmadd_ps(wk, load8(&x4[t].1[j]), acc[t][0]);
                        }
                    }
                    let mut s = [0.0f32; T];
                    for t in 0..T {
                        let a = &acc[t];
                        s[t] = hsum256(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
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

avx2_dot!(
    /// `sum_i w[i] x_t[i]` for each row of `cols` weights in `w` and each input, with AVX2 +
    /// FMA, into `out[r * stride + t]`.
    f32_dot_avx2,
    f32,
    load8,
    |a: f32| a
);

avx2_dot!(
    /// `sum_i bf16(w[i]) x_t[i]` for each row of `cols` weights in `w` and each input, with
    /// AVX2 + FMA, into `out[r * stride + t]`.
    bf16_dot_avx2,
    u16,
    load8_bf16,
    bf16_to_f32
);

avx2_dot!(
    /// `sum_i q[i] x_t[i]` for each INT8 row of `cols` codes in `w` and each input, before the
    /// row's scale (the caller multiplies: `scale * sum`), with AVX2 + FMA, into
    /// `out[r * stride + t]`.
    int8_sum_avx2,
    i8,
    load8_i8,
    |a: i8| a as f32
);

/// INT4-gs64 rows of `cols` inputs (`codes`, `scales`: whole rows) with each input (whole
/// groups), with AVX2 + FMA + F16C, into `out[r * stride + t]`: per row and input, each
/// group's `sum q_i x_i` in 8 lanes (two partial sums, elements `16 k .. 16 k + 8` into the
/// first and `16 k + 8 .. 16 k + 16` into the second, added at the end), times the group's
/// scale into accumulator `g % 2`; one horizontal sum at the end.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn int4_dot_avx2<const T: usize, const R: usize>(
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
    let step = k_step::<R>(n, GROUP * 4 * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[_mm256_setzero_ps(); T]; 2]; R];
        let mut g0 = 0;
        while g0 < n {
            let g1 = n.min(g0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                // One input streams each row whole, in memory order, and prefetches a fixed
                // distance ahead (`prefetch_stream_ahead`, two groups' codes a cache line).
                if T > 1 {
                    prefetch_next::<_, R>(r0 + r, rows, |r| {
                        let c = &codes[r * rb + g0 * GROUP_BYTES..r * rb + g1 * GROUP_BYTES];
                        [c, bytemuck::cast_slice(&scales[r * gpr + g0..r * gpr + g1])]
                    });
                }
                let cg = &codes[(r0 + r) * rb..][..rb].as_chunks::<GROUP_BYTES>().0[..n];
                let sc = &scales[(r0 + r) * gpr..][..n];
                let mut acc = *st;
                macro_rules! group {
                    ($g:expr, $acc:expr) => {{
                        let g: usize = $g;
                        let d = _mm256_set1_ps(f16_to_f32(sc[g]));
                        let mut s = [[_mm256_setzero_ps(); 2]; T];
                        for (k, q) in int4_quarters(&cg[g]).into_iter().enumerate() {
                            let q_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                            let q_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
                            for t in 0..T {
                                let (x8, _) = xg[t][g].as_chunks::<8>();
                                s[t][0] = _mm256_fmadd_ps(q_lo, load8(&x8[2 * k]), s[t][0]);
                                s[t][1] = _mm256_fmadd_ps(q_hi, load8(&x8[2 * k + 1]), s[t][1]);
                            }
                        }
                        for t in 0..T {
                            $acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s[t][0], s[t][1]), d, $acc[t]);
                        }
                    }};
                }
                let mut g = g0;
                while g + 2 <= g1 {
                    if T == 1 {
                        prefetch_stream_ahead(&cg[g]);
                    }
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
                s[t] = hsum256(_mm256_add_ps(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// The order in which [`mxfp4_dot_avx2`] reads a block's 32 inputs: position `p` of an
/// arranged block holds element `MXFP4_AVX2_ORDER[p]` ([`super::mxfp4_input_order`]).
///
/// It is the order the decode below leaves the weights in: lane `l` of the four weight vectors
/// `v = 0..4` (slots `8 v + l`) holds element `16 (v / 2) + 2 (v % 2) + 4 (l % 4) + l / 4`.
/// The low nibbles (even elements) fill the low 128-bit half and the high nibbles the high
/// half, and the in-lane byte and word interleaves then spread each half over the vectors.
pub(crate) const MXFP4_AVX2_ORDER: [u8; BLOCK] = {
    let mut order = [0u8; BLOCK];
    let mut p = 0;
    while p < BLOCK {
        let (v, l) = (p / 8, p % 8);
        order[p] = (16 * (v / 2) + 2 * (v % 2) + 4 * (l % 4) + l / 4) as u8;
        p += 1;
    }
    order
};

/// Byte `i` of the bf16 form (the high 16 bits of the f32) of E2M1 code `i`, for `i` in 0..16:
/// `byte = 1` the high byte (sign and 7 exponent bits), `byte = 0` the low byte (the last
/// exponent bit and the mantissa). Every E2M1 value is exact in bf16.
const fn fp4_bf16_bytes(byte: u32) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        let bits = mxfp4::FP4_VALUES[i].to_bits();
        assert!(bits & 0xFFFF == 0, "an E2M1 value that is not exact in bf16");
        bytes[i] = (bits >> (16 + 8 * byte)) as u8;
        i += 1;
    }
    bytes
}

/// The high byte of every E2M1 value's bf16 form ([`fp4_bf16_bytes`]).
static FP4_BF16_HIGH: [u8; 16] = fp4_bf16_bytes(1);

/// The low byte of every E2M1 value's bf16 form ([`fp4_bf16_bytes`]).
static FP4_BF16_LOW: [u8; 16] = fp4_bf16_bytes(0);

/// MXFP4 rows of `cols` inputs (`codes`, `scales`: whole rows) with each input (whole
/// blocks) **in the order of [`MXFP4_AVX2_ORDER`]**, with AVX2 + FMA, into
/// `out[r * stride + t]`.
///
/// The 4-bit codes are decoded by byte lookups, ten vector operations a block: the block's 16
/// code bytes go into both 128-bit halves of a register (a broadcast load), the high half is
/// shifted right by 4 and the nibbles masked, so the low half holds the even elements' codes
/// and the high half the odd ones'; two `vpshufb` look up the high and the low byte of each
/// value's bf16 form; two in-lane byte interleaves pair them into 32 bf16 values; and each
/// of those two registers gives two weight vectors of 8 f32, its low words shifted up by 16
/// bits and its high words masked. The shifts and shuffles are half of what the widening,
/// shifting and `vpermps` of an 8-entry magnitude table with a sign bit cost. The element
/// order this leaves is [`MXFP4_AVX2_ORDER`], the order the callers arrange the inputs in
/// once per product.
///
/// Per row and input, each block's `sum FP4[c_i] x_i` in 8 lanes (`(w0 x0 + w2 x2) +
/// (w1 x1 + w3 x3)` over its four weight vectors), times the block's scale (broadcast from
/// [`mxfp4::SCALES_F32`] by a load) into accumulator `b % 2`; one horizontal sum at the end.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn mxfp4_dot_avx2<const T: usize, const R: usize>(
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
    // SAFETY (both): 16 readable bytes; unaligned loads are allowed.
    let high_bytes = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(FP4_BF16_HIGH.as_ptr().cast()) });
    let low_bytes = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(FP4_BF16_LOW.as_ptr().cast()) });
    let nibble_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    let low_nibble = _mm256_set1_epi8(0x0F);
    let high_words = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
    let step = k_step::<R>(n, BLOCK * 4 * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[_mm256_setzero_ps(); T]; 2]; R];
        let mut b0 = 0;
        while b0 < n {
            let b1 = n.min(b0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                // One input streams each row whole, in memory order, and prefetches a fixed
                // distance ahead (`prefetch_stream_ahead`, four blocks' codes a cache line).
                if T > 1 {
                    prefetch_next::<_, R>(r0 + r, rows, |r| {
                        [
                            &codes[r * rb + b0 * BLOCK_BYTES..r * rb + b1 * BLOCK_BYTES],
                            &scales[r * bpr + b0..r * bpr + b1],
                        ]
                    });
                }
                let cb = &codes[(r0 + r) * rb..][..rb].as_chunks::<BLOCK_BYTES>().0[..n];
                let sc = &scales[(r0 + r) * bpr..][..n];
                let mut acc = *st;
                macro_rules! block {
                    ($b:expr, $acc:expr) => {{
                        let b: usize = $b;
                        let e = _mm256_broadcast_ss(&mxfp4::SCALES_F32[sc[b] as usize]);
                        // SAFETY: `cb[b]` is 16 readable bytes; unaligned loads are allowed.
                        let c =
                            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(cb[b].as_ptr().cast()) });
                        let idx = _mm256_and_si256(_mm256_srlv_epi32(c, nibble_shift), low_nibble);
                        let hi = _mm256_shuffle_epi8(high_bytes, idx);
                        let lo = _mm256_shuffle_epi8(low_bytes, idx);
                        let (w01, w23) = (_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi));
                        let w0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w01));
                        let w1 = _mm256_castsi256_ps(_mm256_and_si256(w01, high_words));
                        let w2 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w23));
                        let w3 = _mm256_castsi256_ps(_mm256_and_si256(w23, high_words));
                        for t in 0..T {
                            let (x8, _) = xb[t][b].as_chunks::<8>();
                            let s0 = _mm256_mul_ps(w0, load8(&x8[0]));
                            let s1 = _mm256_mul_ps(w1, load8(&x8[1]));
                            let s0 = _mm256_fmadd_ps(w2, load8(&x8[2]), s0);
                            let s1 = _mm256_fmadd_ps(w3, load8(&x8[3]), s1);
                            $acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), e, $acc[t]);
                        }
                    }};
                }
                let mut b = b0;
                while b + 2 <= b1 {
                    if T == 1 && b % 4 == 0 {
                        prefetch_stream_ahead(&cb[b]);
                    }
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
                s[t] = hsum256(_mm256_add_ps(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL)
// ---------------------------------------------------------------------------------------------

/// Sum of the 16 lanes, as the 8-lane [`hsum256`] of `v[0..8] + v[8..16]` (the order of
/// `_mm512_reduce_add_ps`, written out so that it is fixed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn hsum512(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
}

/// 16 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16(a: &[f32; 16]) -> __m512 {
    // SAFETY: `a` is 16 readable f32s; unaligned loads are allowed.
    unsafe { _mm512_loadu_ps(a.as_ptr()) }
}

/// Mask of the first `len` (<= 16) lanes.
#[inline]
fn tail_mask(len: usize) -> __mmask16 {
    ((1u32 << len.min(16)) - 1) as __mmask16
}

/// The first `t.len()` (< 16) lanes from `t`, zero above.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16_tail(t: &[f32]) -> __m512 {
    // SAFETY: the mask enables only the first `min(t.len(), 16)` lanes, which are readable;
    // masked-off lanes are not accessed.
    unsafe { _mm512_maskz_loadu_ps(tail_mask(t.len()), t.as_ptr()) }
}

/// 16 bfloat16 bit patterns (`v`, 256 bits) widened exactly to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn widen16_bf16(v: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

/// The first `t.len()` (<= 16) bfloat16 bit patterns widened to f32, zero above.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16_bf16_tail(t: &[u16]) -> __m512 {
    // SAFETY: the mask enables only the first `min(t.len(), 16)` lanes, which are readable.
    widen16_bf16(unsafe { _mm256_maskz_loadu_epi16(tail_mask(t.len()), t.as_ptr().cast()) })
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

/// The first `t.len()` (< 16) signed bytes converted to f32, zero above.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn load16_i8_tail(t: &[i8]) -> __m512 {
    // SAFETY: the mask enables only the first `min(t.len(), 16)` lanes, which are readable.
    widen16_i8(unsafe { _mm_maskz_loadu_epi8(tail_mask(t.len()), t.as_ptr()) })
}

/// A float dot-product kernel over 16-lane vectors: per row and input, four accumulators
/// take the 16-element chunks round-robin (`acc[k]` gets chunks `4 j + k`, leftover whole
/// chunk `k` too), the last `n % 16` elements (masked loads, zero above) go to `acc[3]`, and
/// the accumulators are added as `(acc0 + acc1) + (acc2 + acc3)` and summed horizontally.
macro_rules! avx512_dot {
    ($(#[$doc:meta])* $name:ident, $w:ty, $load:ident, $load_tail:ident) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
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
            let mut xv: [(&[[f32; 16]], &[f32]); T] = [(&[], &[]); T];
            let mut x4: [(&[[[f32; 16]; 4]], &[[f32; 16]]); T] = [(&[], &[]); T];
            for t in 0..T {
                xv[t] = xs[t][..n].as_chunks::<16>();
                x4[t] = xv[t].0.as_chunks::<4>();
            }
            let blocks = n / 64;
            let step = k_step::<R>(blocks, 64 * 4 * T, 1);
            let mut r0 = 0;
            while r0 < rows {
                let rr = R.min(rows - r0);
                let mut state = [[[_mm512_setzero_ps(); 4]; T]; R];
                let mut b0 = 0;
                while b0 < blocks {
                    let b1 = blocks.min(b0 + step);
                    for (r, st) in state.iter_mut().enumerate().take(rr) {
                        // One input streams each row whole, in memory order, and prefetches
                        // a fixed distance ahead (`prefetch_stream_ahead`): a burst of the next
                        // rows' lines made it slower (`stream_*` bench).
                        if T > 1 {
                            prefetch_next::<_, R>(r0 + r, rows, |r| [&w[r * cols + b0 * 64..r * cols + b1 * 64], &[]]);
                        }
                        let (w16, _) = w[(r0 + r) * cols..][..n].as_chunks::<16>();
                        let (w4, _) = w16.as_chunks::<4>();
                        let mut acc = *st;
                        for j in b0..b1 {
                            for k in 0..4 {
                                // One prefetch per cache line of weights (64 bytes).
                                if T == 1 && ((4 * j + k) * 16 * size_of::<$w>()).is_multiple_of(64) {
                                    prefetch_stream_ahead(&w4[j][k]);
                                }
                                let wk = $load(&w4[j][k]);
                                for t in 0..T {
                                    acc[t][k] = _mm512_fmadd_ps(wk, load16(&x4[t].0[j][k]), acc[t][k]);
                                }
                            }
                        }
                        *st = acc;
                    }
                    b0 = b1;
                }
                for (r, acc) in state.iter_mut().enumerate().take(rr) {
                    let (wv, wt) = w[(r0 + r) * cols..][..n].as_chunks::<16>();
                    let (_, wr) = wv.as_chunks::<4>();
                    // At most three leftover chunks; a constant trip count keeps `k` static.
                    for k in 0..3 {
                        if let Some(a) = wr.get(k) {
                            let wk = $load(a);
                            for t in 0..T {
                                acc[t][k] = _mm512_fmadd_ps(wk, load16(&x4[t].1[k]), acc[t][k]);
                            }
                        }
                    }
                    if !wt.is_empty() {
                        let wk = $load_tail(wt);
                        for t in 0..T {
                            acc[t][3] = _mm512_fmadd_ps(wk, load16_tail(xv[t].1), acc[t][3]);
                        }
                    }
                    let mut s = [0.0f32; T];
                    for t in 0..T {
                        let a = &acc[t];
                        s[t] = hsum512(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
                    }
                    store(out, (r0 + r) * stride, &s);
                }
                r0 += rr;
            }
        }
    };
}

avx512_dot!(
    /// `sum_i w[i] x_t[i]` for each row of `cols` weights in `w` and each input, with
    /// AVX-512, into `out[r * stride + t]`.
    f32_dot_avx512,
    f32,
    load16,
    load16_tail
);

/// Rows of a BF16 matrix that [`bf16_dot_avx512`] puts side by side for `t` inputs: enough
/// accumulator chains in flight with few inputs (two per row and input), and with more inputs
/// each row's weights serve more multiply-adds while the accumulators, the weights and the
/// inputs' two halves still fit in the 32 vector registers. One input (decode) takes one row
/// at a time: rows side by side are interleaved streams that the hardware prefetcher follows
/// poorly, and from memory two rows ran at 17 GiB/s against 34-36 for one (Zen 5, 1 thread,
/// `stream_5760x2880`); one row's two chains still go faster than memory.
pub(crate) const fn bf16_rows_together(t: usize) -> usize {
    match t {
        1 => 1,
        2 => 4,
        3 => 3,
        4..=6 => 2,
        _ => 1,
    }
}

/// `sum_i bf16(w[i]) x_t[i]` for each row of `cols` weights in `w` and each input, with
/// AVX-512, into `out[r * stride + t]`, with each input's whole blocks of 32 **in split order**
/// ([`SPLIT_ORDER`]: a block's 16 even-indexed inputs, then its 16 odd-indexed ones; a
/// partial last block in element order).
///
/// One 512-bit load takes a block's 32 weights, and its dword `j` holds elements `2j` (low
/// half) and `2j + 1` (high half): a shift left by 16 gives the even weights as f32 and a mask
/// of the high halves the odd ones, exactly, with no shuffle (which would take one of the
/// units the multiply-adds use). Per row and input, two accumulators take the even and the odd
/// products of every block, in block order, by fused multiply-add; a partial last block's
/// first 16 elements go to the first, the rest to the second; they are added and summed
/// horizontally at the end. That order does not depend on the inputs, the rows side by side
/// ([`bf16_rows_together`]) or the blocks of the contraction, so a batched product equals the
/// single-input one bit for bit.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub fn bf16_dot_avx512<const T: usize, const R: usize>(
    w: &[u16],
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
    let blocks = n / BLOCK;
    let mut xb: [&[[[f32; 16]; 2]]; T] = [&[]; T];
    let mut xt: [&[f32]; T] = [&[]; T];
    for t in 0..T {
        xb[t] = &xs[t].as_chunks::<16>().0.as_chunks::<2>().0[..blocks];
        xt[t] = &xs[t][blocks * BLOCK..n];
    }
    let high_halves = _mm512_set1_epi32(0xFFFF_0000_u32 as i32);
    let step = k_step::<R>(blocks, BLOCK * 4 * T, 1);
    let together = bf16_rows_together(T);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[_mm512_setzero_ps(); 2]; T]; R];
        let mut b0 = 0;
        while b0 < blocks {
            let b1 = blocks.min(b0 + step);
            // Rows `r0 + r ..` (`$g` of them) over blocks `b0..b1`, accumulating into `state`.
            macro_rules! rows_over_blocks {
                ($g:literal, $r:expr) => {{
                    const G: usize = $g;
                    let r: usize = $r;
                    let mut wb: [&[[u16; BLOCK]]; G] = [&[]; G];
                    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; G];
                    // The same blocks of the rows `R` further on ([`prefetch_line_ahead`]).
                    let mut ahead: [&[[u16; BLOCK]]; G] = [&[]; G];
                    for i in 0..G {
                        let row = r0 + r + i;
                        // One input streams one row at a time, in memory order, and
                        // prefetches a fixed distance ahead instead (`prefetch_stream_ahead`).
                        if T > 1 && R > 1 && row + R < rows {
                            ahead[i] = &w[(row + R) * cols..][..n].as_chunks::<BLOCK>().0[b0..b1];
                        }
                        wb[i] = &w[row * cols..][..n].as_chunks::<BLOCK>().0[b0..b1];
                        acc[i] = state[r + i];
                    }
                    for b in 0..b1 - b0 {
                        prefetch_line_ahead(&ahead, b);
                        if T == 1 {
                            // One block is one cache line of the one row in flight.
                            prefetch_stream_ahead(&wb[0][b]);
                        }
                        let mut even = [_mm512_setzero_ps(); G];
                        let mut odd = [_mm512_setzero_ps(); G];
                        for i in 0..G {
                            // SAFETY: `wb[i][b]` is 64 readable bytes; unaligned loads are allowed.
                            let v = unsafe { _mm512_loadu_si512(wb[i][b].as_ptr().cast()) };
                            even[i] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                            odd[i] = _mm512_castsi512_ps(_mm512_and_si512(v, high_halves));
                        }
                        for t in 0..T {
                            let [xe, xo] = &xb[t][b0 + b];
                            let (xe, xo) = (load16(xe), load16(xo));
                            for i in 0..G {
                                acc[i][t][0] = _mm512_fmadd_ps(even[i], xe, acc[i][t][0]);
                                acc[i][t][1] = _mm512_fmadd_ps(odd[i], xo, acc[i][t][1]);
                            }
                        }
                    }
                    for i in 0..G {
                        state[r + i] = acc[i];
                    }
                }};
            }
            in_row_groups!(rr, together, rows_over_blocks);
            b0 = b1;
        }
        for (r, acc) in state.iter_mut().enumerate().take(rr) {
            let tail = &w[(r0 + r) * cols..][blocks * BLOCK..n];
            let (low, high) = tail.split_at(tail.len().min(16));
            let mut s = [0.0f32; T];
            for t in 0..T {
                let (x_low, x_high) = xt[t].split_at(low.len());
                if !low.is_empty() {
                    acc[t][0] = _mm512_fmadd_ps(load16_bf16_tail(low), load16_tail(x_low), acc[t][0]);
                }
                if !high.is_empty() {
                    acc[t][1] = _mm512_fmadd_ps(load16_bf16_tail(high), load16_tail(x_high), acc[t][1]);
                }
                s[t] = hsum512(_mm512_add_ps(acc[t][0], acc[t][1]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

avx512_dot!(
    /// `sum_i q[i] x_t[i]` for each INT8 row of `cols` codes in `w` and each input, before the
    /// row's scale (the caller multiplies: `scale * sum`), with AVX-512, into
    /// `out[r * stride + t]`.
    int8_sum_avx512,
    i8,
    load16_i8,
    load16_i8_tail
);

/// The INT4 values `q = nibble - 8` as f32, indexed by the nibble: the table of
/// [`int4_lookup16`].
const INT4_VALUES: [f32; 16] =
    [-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0];

/// The 64 values `q` of an INT4 group as f32, in its four 16-element quarters (elements
/// `0..16`, `16..32`, `32..48`, `48..64`), by table lookup: `table` holds [`INT4_VALUES`].
/// Code bytes `0..16` and `16..32` are zero-extended to 16 dwords each; `vpermps` reads only
/// the low 4 bits of an index lane, so the dwords index the low nibbles (elements `k`) as
/// they are and the high nibbles (elements `k + 32`) after a shift right by 4. Exact, with no
/// masking and no integer-to-float conversion.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn int4_lookup16(table: __m512, c: &[u8; GROUP_BYTES]) -> [__m512; 4] {
    let (halves, _) = c.as_chunks::<16>();
    // SAFETY: each half is 16 readable bytes; unaligned loads are allowed.
    let (i0, i1) = unsafe {
        (
            _mm512_cvtepu8_epi32(_mm_loadu_si128(halves[0].as_ptr().cast())),
            _mm512_cvtepu8_epi32(_mm_loadu_si128(halves[1].as_ptr().cast())),
        )
    };
    [
        _mm512_permutexvar_ps(i0, table),
        _mm512_permutexvar_ps(i1, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(i0), table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(i1), table),
    ]
}

/// INT4-gs64 rows of `cols` inputs (`codes`, `scales`: whole rows) with each input (whole
/// groups), with AVX-512, into `out[r * stride + t]`. The 4-bit codes are decoded by table
/// lookup ([`int4_lookup16`]). Per row and input, each group's `sum q_i x_i` in 16 lanes (`(q0 x0 + q2 x2) + (q1 x1 + q3 x3)` over its four 16-element
/// quarters), times the group's scale into accumulator `g % 2`; one horizontal sum at the end.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub fn int4_dot_avx512<const T: usize, const R: usize>(
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
    let table = load16(&INT4_VALUES);
    let step = k_step::<R>(n, GROUP * 4 * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[_mm512_setzero_ps(); T]; 2]; R];
        let mut g0 = 0;
        while g0 < n {
            let g1 = n.min(g0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                // One input streams each row whole, in memory order, and prefetches a fixed
                // distance ahead (`prefetch_stream_ahead`, two groups' codes a cache line).
                if T > 1 {
                    prefetch_next::<_, R>(r0 + r, rows, |r| {
                        let c = &codes[r * rb + g0 * GROUP_BYTES..r * rb + g1 * GROUP_BYTES];
                        [c, bytemuck::cast_slice(&scales[r * gpr + g0..r * gpr + g1])]
                    });
                }
                let cg = &codes[(r0 + r) * rb..][..rb].as_chunks::<GROUP_BYTES>().0[..n];
                let sc = &scales[(r0 + r) * gpr..][..n];
                let mut acc = *st;
                macro_rules! group {
                    ($g:expr, $acc:expr) => {{
                        let g: usize = $g;
                        let d = _mm512_set1_ps(f16_to_f32(sc[g]));
                        let [q0, q1, q2, q3] = int4_lookup16(table, &cg[g]);
                        for t in 0..T {
                            let (x16, _) = xg[t][g].as_chunks::<16>();
                            let s0 = _mm512_mul_ps(q0, load16(&x16[0]));
                            let s1 = _mm512_mul_ps(q1, load16(&x16[1]));
                            let s0 = _mm512_fmadd_ps(q2, load16(&x16[2]), s0);
                            let s1 = _mm512_fmadd_ps(q3, load16(&x16[3]), s1);
                            $acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s0, s1), d, $acc[t]);
                        }
                    }};
                }
                let mut g = g0;
                while g + 2 <= g1 {
                    if T == 1 {
                        prefetch_stream_ahead(&cg[g]);
                    }
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
                s[t] = hsum512(_mm512_add_ps(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// Split order: in every block, the 16 even-indexed inputs, then the 16 odd-indexed ones (the
/// order in which a block's code bytes hold their low and high nibbles), in which
/// [`mxfp4_dot_avx512`] reads its inputs ([`super::mxfp4_input_order`]).
pub(crate) const SPLIT_ORDER: [u8; BLOCK] = {
    let mut order = [0u8; BLOCK];
    let mut p = 0;
    while p < BLOCK {
        order[p] = if p < BLOCK / 2 { 2 * p } else { 2 * (p - BLOCK / 2) + 1 } as u8;
        p += 1;
    }
    order
};

/// `v * s` in every lane, with `s` broadcast from memory by the multiply itself
/// (`vmulps zmm, zmm, [s]{1to16}`). The broadcast then costs a load, not an operation: on
/// Zen 5 a broadcast from a register takes one of the two units every multiply-add and lookup
/// needs (docs/perf.md, `op_rate`), and the compiler, left to itself, loads the scale into a
/// register and broadcasts it from there in the four-row loop.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn mul_by_broadcast(v: __m512, s: &f32) -> __m512 {
    let out: __m512;
    // SAFETY: reads the 4 bytes of `s`, a valid `f32`; writes only the output register.
    unsafe {
        std::arch::asm!(
            "vmulps {out}, {v}, dword ptr [{s}]{{1to16}}",
            out = lateout(zmm_reg) out,
            v = in(zmm_reg) v,
            s = in(reg) s as *const f32,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    out
}

/// The scale bytes for which [`scale_by_exponent`] gives the same table as
/// [`mul_by_broadcast`]: every non-zero E2M1 value (0.5 to 6, exponents 126 to 129) times
/// `2^(e - 127)` is then a normal f32, so adding `e - 127` to its exponent field is the
/// product, bit for bit.
const EXPONENT_SCALES: std::ops::RangeInclusive<u8> = 2..=252;

/// Whether every scale byte is in [`EXPONENT_SCALES`], by lane-wise minimum and maximum over
/// 64-byte chunks (which the compiler vectorizes), started from the range's own ends.
fn all_in_exponent_range(scales: &[u8]) -> bool {
    let (chunks, rest) = scales.as_chunks::<64>();
    let (mut lo, mut hi) = ([*EXPONENT_SCALES.end(); 64], [*EXPONENT_SCALES.start(); 64]);
    for c in chunks {
        for j in 0..64 {
            lo[j] = lo[j].min(c[j]);
            hi[j] = hi[j].max(c[j]);
        }
    }
    lo.iter().chain(&hi).chain(rest).all(|e| EXPONENT_SCALES.contains(e))
}

/// `(e - 127) << 23` for every scale byte `e`: added to an f32's bits, it multiplies a normal
/// value by `2^(e - 127)` while the result stays normal ([`EXPONENT_SCALES`]).
static SCALE_EXPONENT_ADD: [i32; 256] = {
    let mut t = [0i32; 256];
    let mut e = 0;
    while e < 256 {
        t[e] = (e as i32 - 127) << 23;
        e += 1;
    }
    t
};

/// The lanes of the E2M1 table that hold a non-zero value: codes 0 and 8 are +0 and -0.
const FP4_NONZERO_LANES: u16 = !(1 | 1 << 8);

/// The E2M1 table times `2^(e - 127)` by an integer add to the exponent fields of its non-zero
/// lanes (`vpaddd zmm{k}{z}, zmm, [add]{1to16}`, `add` from [`SCALE_EXPONENT_ADD`], `k` =
/// [`FP4_NONZERO_LANES`], passed in so that a loop keeps it in a mask register), for
/// scales in [`EXPONENT_SCALES`]. It does what [`mul_by_broadcast`] does, off the two units
/// every multiply-add, lookup and widening needs on Zen 5 (docs/perf.md, `op_rate`: integer
/// adds go to two others). The zero lanes come out as +0 where the multiply keeps code 8's
/// -0; a multiply-add by either adds an exact zero, so sums differ at most in the sign of a
/// zero result.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn scale_by_exponent(table: __m512, add: &i32, nonzero: __mmask16) -> __m512 {
    let out: __m512;
    // SAFETY: reads the 4 bytes of `add`, a valid `i32`; writes only the output register.
    unsafe {
        std::arch::asm!(
            "vpaddd {out}{{{k}}}{{z}}, {table}, dword ptr [{add}]{{1to16}}",
            out = lateout(zmm_reg) out,
            table = in(zmm_reg) table,
            k = in(kreg) nonzero,
            add = in(reg) add as *const i32,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    out
}

/// Rows of an MXFP4 matrix that [`mxfp4_dot_avx512`] decodes side by side for `t` inputs.
///
/// Each row and input has two accumulator chains, and a multiply-add waits for the previous one
/// on its chain (4-5 cycles). With few inputs a row alone does not keep enough chains in flight,
/// so several rows go together; with many inputs one row has enough, and the 32 vector registers
/// go to inputs instead (each decoded block then serves more multiply-adds). Every row's
/// arithmetic is the same whatever the grouping. Measured on Zen 5 (docs/perf.md,
/// 2026-12-04): one input with 2, 6 or 8 rows ran 10-45% slower than with 4; four inputs on
/// three rows 11% faster than on two, five inputs on three rows slower than on two (spills).
pub(crate) const fn mxfp4_rows_together(t: usize) -> usize {
    match t {
        1 | 2 => 4,
        3 | 4 => 3,
        5 => 2,
        _ => 1,
    }
}

/// MXFP4 rows of `cols` inputs (`codes`, `scales`: whole rows) with each input (whole
/// blocks) **in split order** ([`SPLIT_ORDER`]: each block's 16 even-indexed inputs,
/// then its 16 odd-indexed ones), with AVX-512, into `out[r * stride + t]`.
///
/// A code byte holds an even element in its low nibble and the next odd one in its high
/// nibble, so with split inputs no nibble is moved: `vpmovzxbd` widens a block's 16 bytes to
/// dwords, and `vpermps` (which reads the low 4 bits of each index) looks up the even
/// weights from them and the odd ones from them shifted right by 4, in the block's 16 E2M1
/// values already multiplied by its scale (a power of two: exact for the finite scales a
/// loaded matrix has). When every scale of the call is in [`EXPONENT_SCALES`] (real
/// checkpoints) that product is an integer add to the exponents ([`scale_by_exponent`]),
/// else a multiply ([`mul_by_broadcast`]); both give the same table but for the sign of
/// code 8's zero, which no sum can see.
///
/// Per row and input, two accumulators take the even and the odd products of every block, in
/// block order, by fused multiply-add; they are added and summed horizontally at the end. That
/// order is the same for every input count, row grouping ([`mxfp4_rows_together`]) and block
/// of the contraction, so a batched product equals the single-input one bit for bit. The
/// decode (five or six vector operations a block) is paid once per row and pass, the multiply-adds
/// (two a block) once per input: passes of up to 4 inputs (`max_inputs`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub fn mxfp4_dot_avx512<const T: usize, const R: usize>(
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
    let mut xb: [&[[[f32; 16]; 2]]; T] = [&[]; T];
    for t in 0..T {
        xb[t] = &xs[t].as_chunks::<16>().0.as_chunks::<2>().0[..n];
    }
    let table = load16(&mxfp4::FP4_VALUES);
    // Opaque, so that the compiler keeps it in a mask register rather than making it again
    // (a move from a general register) for every block.
    let nonzero = std::hint::black_box(FP4_NONZERO_LANES);
    // Real checkpoints' scales are all in range; a matrix with one outside (products that
    // would be subnormal or overflow) takes the multiply everywhere. One pass over the scales
    // (a sixteenth of the codes' bytes): a test per block in the loop cost as much as the
    // block's decode.
    let by_exponent_ok = all_in_exponent_range(&scales[..rows * bpr]);
    let step = k_step::<R>(n, BLOCK * 4 * T, 1);
    let together = mxfp4_rows_together(T);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[_mm512_setzero_ps(); 2]; T]; R];
        let mut b0 = 0;
        while b0 < n {
            let b1 = n.min(b0 + step);
            // Rows `r0 + r ..` (`$g` of them) over blocks `b0..b1`, accumulating into `state`.
            macro_rules! rows_over_blocks {
                ($g:literal, $r:expr) => {{
                    const G: usize = $g;
                    let r: usize = $r;
                    let mut cb: [&[[u8; BLOCK_BYTES]]; G] = [&[]; G];
                    let mut sc: [&[u8]; G] = [&[]; G];
                    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; G];
                    // The same blocks of the rows `R` further on ([`prefetch_line_ahead`]).
                    let mut ahead: [&[[u8; BLOCK_BYTES]]; G] = [&[]; G];
                    for i in 0..G {
                        let row = r0 + r + i;
                        if R > 1 && row + R < rows {
                            let next = row + R;
                            ahead[i] = &codes[next * rb..][..rb].as_chunks::<BLOCK_BYTES>().0[b0..b1];
                            prefetch(&scales[next * bpr + b0..next * bpr + b1]);
                        }
                        cb[i] = &codes[row * rb..][..rb].as_chunks::<BLOCK_BYTES>().0[b0..b1];
                        sc[i] = &scales[row * bpr..][b0..b1];
                        acc[i] = state[r + i];
                    }
                    // The blocks, with each block's table scaled by `$scale(table, &$by[e])`.
                    macro_rules! blocks {
                        ($scale:ident, $by:expr) => {
                            for b in 0..b1 - b0 {
                                prefetch_line_ahead(&ahead, b);
                                let mut even = [_mm512_setzero_ps(); G];
                                let mut odd = [_mm512_setzero_ps(); G];
                                for i in 0..G {
                                    let scaled = $scale(table, &$by[sc[i][b] as usize]);
                                    // SAFETY: `cb[i][b]` is 16 readable bytes; unaligned loads
                                    // are allowed.
                                    let idx = _mm512_cvtepu8_epi32(unsafe {
                                        _mm_loadu_si128(cb[i][b].as_ptr().cast())
                                    });
                                    even[i] = _mm512_permutexvar_ps(idx, scaled);
                                    odd[i] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(idx), scaled);
                                }
                                for t in 0..T {
                                    let [xe, xo] = &xb[t][b0 + b];
                                    let (xe, xo) = (load16(xe), load16(xo));
                                    for i in 0..G {
                                        acc[i][t][0] = _mm512_fmadd_ps(even[i], xe, acc[i][t][0]);
                                        acc[i][t][1] = _mm512_fmadd_ps(odd[i], xo, acc[i][t][1]);
                                    }
                                }
                            }
                        };
                    }
                    if by_exponent_ok {
                        let by_exponent = |t, add| scale_by_exponent(t, add, nonzero);
                        blocks!(by_exponent, SCALE_EXPONENT_ADD);
                    } else {
                        blocks!(mul_by_broadcast, mxfp4::SCALES_F32);
                    }
                    for i in 0..G {
                        state[r + i] = acc[i];
                    }
                }};
            }
            in_row_groups!(rr, together, rows_over_blocks);
            b0 = b1;
        }
        for (r, acc) in state.iter().enumerate().take(rr) {
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = hsum512(_mm512_add_ps(acc[t][0], acc[t][1]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

// ---------------------------------------------------------------------------------------------
// Integer kernels over quantized activations (see `q8`): AVX-512 VNNI, and AVX2 for MXFP4
// ---------------------------------------------------------------------------------------------

/// 32 signed bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn load32_i8(a: &[i8; 32]) -> __m256i {
    // SAFETY: `a` is 32 readable bytes; unaligned loads are allowed.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// The integer-kernel dot products of INT4-gs64 rows of `cols` inputs (`codes`, `scales`:
/// whole rows) with each of `T` quantized inputs ([`super::q8::int4_dot_reference`]), with
/// AVX-512 VNNI, into `out[r * stride + t]`, in 256-bit registers (on Zen 4 a 512-bit
/// operation costs two 256-bit ones, and the 256-bit form needs no cross-lane shuffles). Per
/// group, `vpdpbusd` of the unsigned codes `q + 8` (low nibbles, then high nibbles) with the
/// activation codes `p`, started from `bias = -8 * sum(p)`, so each of the 8 i32 lanes holds
/// an exact partial `sum q p`; converted to f32 and multiplied by `d * s` into accumulator
/// `g % 2`; one horizontal sum at the end.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub fn int4_dot_q8_vnni<const T: usize, const R: usize>(
    codes: &[u8],
    scales: &[u16],
    rows: usize,
    cols: usize,
    xs: &[&QuantizedX; T],
    out: &mut [f32],
    stride: usize,
) {
    let (rb, gpr) = (int4::row_bytes(cols), int4::groups(cols));
    if !holds_rows(codes.len(), rows, rb) || !holds_rows(scales.len(), rows, gpr) {
        return;
    }
    let n = xs
        .iter()
        .fold(gpr, |n, x| n.min(x.codes().len() / GROUP).min(x.scales().len()).min(x.int4_bias().len()));
    let mut pg: [&[[i8; GROUP]]; T] = [&[]; T];
    let (mut sx, mut bias): ([&[f32]; T], [&[i32]; T]) = ([&[]; T], [&[]; T]);
    for t in 0..T {
        pg[t] = &xs[t].codes().as_chunks::<GROUP>().0[..n];
        sx[t] = &xs[t].scales()[..n];
        bias[t] = &xs[t].int4_bias()[..n];
    }
    let mask = _mm256_set1_epi8(0x0f);
    let step = k_step::<R>(n, GROUP * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[_mm256_setzero_ps(); T]; 2]; R];
        let mut g0 = 0;
        while g0 < n {
            let g1 = n.min(g0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                prefetch_next::<_, R>(r0 + r, rows, |r| {
                    let c = &codes[r * rb + g0 * GROUP_BYTES..r * rb + g1 * GROUP_BYTES];
                    [c, bytemuck::cast_slice(&scales[r * gpr + g0..r * gpr + g1])]
                });
                let cg = &codes[(r0 + r) * rb..][..rb].as_chunks::<GROUP_BYTES>().0[..n];
                let sc = &scales[(r0 + r) * gpr..][..n];
                let mut acc = *st;
                macro_rules! group {
                    ($g:expr, $acc:expr) => {{
                        let g: usize = $g;
                        // SAFETY: `cg[g]` is 32 readable bytes; unaligned loads are allowed.
                        let v = unsafe { _mm256_loadu_si256(cg[g].as_ptr().cast()) };
                        let lo = _mm256_and_si256(v, mask);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                        let d = _mm256_set1_ps(f16_to_f32(sc[g]));
                        for t in 0..T {
                            let (ps, _) = pg[t][g].as_chunks::<32>();
                            let start = _mm256_zextsi128_si256(_mm_cvtsi32_si128(bias[t][g]));
                            let sum = _mm256_dpbusd_epi32(start, lo, load32_i8(&ps[0]));
                            let sum = _mm256_dpbusd_epi32(sum, hi, load32_i8(&ps[1]));
                            // `d * s_g` in every lane (a broadcast operand, not a scalar product).
                            let ds = _mm256_mul_ps(d, _mm256_set1_ps(sx[t][g]));
                            $acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), ds, $acc[t]);
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
                s[t] = hsum256(_mm256_add_ps(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// The integer-kernel dot products of INT8 rows of `cols` codes (with their `scales`) with
/// each of `T` quantized inputs ([`super::q8::int8_dot_reference`]), with AVX-512 VNNI, into
/// `out[r * stride + t]`. Per group of 64, `vpdpbusd` of `|q|` (as unsigned: `|-128|` reads
/// as 128) with `p` carrying the sign of `q` (`vpsignb`; exact since `|p| <= 127`), in 256-bit
/// halves; converted and multiplied by the group's activation scale into accumulator
/// `g % 2`. A partial last group is copied into a zero-padded buffer and goes to the second
/// accumulator. One horizontal sum, then the row's scale.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub fn int8_dot_q8_vnni<const T: usize, const R: usize>(
    codes: &[i8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    xs: &[&QuantizedX; T],
    out: &mut [f32],
    stride: usize,
) {
    if !holds_rows(codes.len(), rows, cols) || rows > scales.len() {
        return;
    }
    let n = xs.iter().fold(cols, |n, x| n.min(x.len()));
    let (full_groups, tail) = (n / GROUP, n % GROUP);
    let mut pg: [&[[i8; GROUP]]; T] = [&[]; T];
    let mut sx: [&[f32]; T] = [&[]; T];
    for t in 0..T {
        pg[t] = xs[t].codes().as_chunks::<GROUP>().0;
        sx[t] = xs[t].scales();
    }
    let full = (0..T).fold(full_groups, |f, t| f.min(pg[t].len()).min(sx[t].len()));
    let has_tail = tail > 0 && (0..T).all(|t| full_groups < pg[t].len() && full_groups < sx[t].len());
    // `$g` is the group of the activations, `$q` the 64 codes it meets.
    macro_rules! group {
        ($g:expr, $q:expr, $acc:expr) => {{
            let (g, q): (usize, &[i8; GROUP]) = ($g, $q);
            let (qs, _) = q.as_chunks::<32>();
            let mut sum = [_mm256_setzero_si256(); T];
            for (h, q) in qs.iter().enumerate() {
                let q = load32_i8(q);
                let a = _mm256_abs_epi8(q);
                for t in 0..T {
                    let (ps, _) = pg[t][g].as_chunks::<32>();
                    sum[t] = _mm256_dpbusd_epi32(sum[t], a, _mm256_sign_epi8(load32_i8(&ps[h]), q));
                }
            }
            for t in 0..T {
                $acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_set1_ps(sx[t][g]), $acc[t]);
            }
        }};
    }
    let step = k_step::<R>(full, GROUP * T, 2);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[[_mm256_setzero_ps(); T]; 2]; R];
        let mut g0 = 0;
        while g0 < full {
            let g1 = full.min(g0 + step);
            for (r, st) in state.iter_mut().enumerate().take(rr) {
                // One input streams each row whole, in memory order, and prefetches a fixed
                // distance ahead (`prefetch_stream_ahead`, a group is a cache line).
                if T > 1 {
                    prefetch_next::<_, R>(r0 + r, rows, |r| {
                        [&codes[r * cols + g0 * GROUP..r * cols + g1 * GROUP], &[]]
                    });
                }
                let cg = &codes[(r0 + r) * cols..][..n].as_chunks::<GROUP>().0[..full];
                let mut acc = *st;
                let mut g = g0;
                while g + 2 <= g1 {
                    if T == 1 {
                        prefetch_stream_ahead(&cg[g]);
                        prefetch_stream_ahead(&cg[g + 1]);
                    }
                    group!(g, &cg[g], acc[0]);
                    group!(g + 1, &cg[g + 1], acc[1]);
                    g += 2;
                }
                if g < g1 {
                    group!(g, &cg[g], acc[0]);
                }
                *st = acc;
            }
            g0 = g1;
        }
        for (r, acc) in state.iter_mut().enumerate().take(rr) {
            if has_tail {
                let mut q = [0i8; GROUP];
                q[..tail].copy_from_slice(&codes[(r0 + r) * cols + full_groups * GROUP..][..tail]);
                group!(full_groups, &q, acc[1]);
            }
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = scales[r0 + r] * hsum256(_mm256_add_ps(acc[0][t], acc[1][t]));
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// [`mxfp4::FP4_DOUBLED`] plus [`MXFP4_WEIGHT_OFFSET`]: the doubled E2M1 values as unsigned
/// bytes (`0..=24`), the weights the integer MXFP4 kernel multiplies.
pub(super) static FP4_DOUBLED_OFFSET: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut c = 0;
    while c < 16 {
        t[c] = (mxfp4::FP4_DOUBLED[c] as i32 + MXFP4_WEIGHT_OFFSET) as u8;
        c += 1;
    }
    t
};

/// The 32-bit lanes that hold the second block of a pair in [`mxfp4_dot_q8_vnni`]: `4..8`
/// and `12..16`.
const SECOND_BLOCK_LANES: __mmask16 = 0xf0f0;

/// The integer-kernel dot products of MXFP4 rows of `cols` inputs (`codes`, `scales`: whole
/// rows) with each of `T` quantized inputs ([`super::q8::mxfp4_dot_reference`]), with AVX-512
/// VNNI, into `out[r * stride + t]`, one activation group (two blocks) a 512-bit step.
///
/// Per row and block pair (shared by every input): the pair's 32 code bytes, broadcast to
/// both halves of a register, the upper half shifted right by 4 ([`high_nibbles_up`]),
/// masked to nibbles and looked up (`vpshufb`) in [`FP4_DOUBLED_OFFSET`] give the weights
/// `w + 12` (unsigned, `w` the doubled E2M1 value) of the even elements of each block, then
/// the odd ones, which is the order of [`Mxfp4Group::codes`] (signed, reordered once per
/// input). So 32-bit lanes `0..4` and `8..12` hold products of the first block, the others of
/// the second. Each input and row costs one `vpdpbusd` started from the input's
/// [`Mxfp4Group::bias`] (which takes the offset's `12 p` back out), giving in each lane an
/// exact partial `sum 2 FP4[c_i] p_i` of one block; its conversion to f32 is multiply-added,
/// by `(2^(e_b - 127) / 2) * s_g` (the lane's block scale from [`mxfp4::HALF_SCALES`] times the
/// group's), into the row's and input's one 512-bit accumulator, pair after pair. A last odd
/// block is decoded with a zero second block (scale 0) after the last pair; one horizontal
/// sum at the end.
///
/// Rows go side by side ([`mxfp4_q8_rows_together`]): each input's codes and bias, loaded
/// once, serve every row of the group, and the rows' accumulators are independent chains. The
/// arithmetic of a row is the same whatever the grouping and input count, so a batched
/// product equals the single-input one bit for bit.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub fn mxfp4_dot_q8_vnni<const T: usize, const R: usize>(
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
    // SAFETY: 16 readable bytes; unaligned loads are allowed.
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(FP4_DOUBLED_OFFSET.as_ptr().cast()) });
    let mask = _mm512_set1_epi8(0x0f);
    // A block pair's weights (`v`: its 32 code bytes in both halves of a register).
    macro_rules! weights {
        ($v:expr) => {{
            let v: __m512i = $v;
            // The upper 256 bits (16-bit lanes 16..32) to their high nibbles.
            _mm512_shuffle_epi8(table, _mm512_and_si512(high_nibbles_up(v), mask))
        }};
    }
    // The blocks' scales (`2^(e - 127) / 2`) in the lanes that hold each block's products.
    macro_rules! lane_scales {
        ($e0:expr, $e1:expr) => {
            _mm512_mask_mov_ps(_mm512_set1_ps($e0), SECOND_BLOCK_LANES, _mm512_set1_ps($e1))
        };
    }
    // Rows `r0 + r ..` (`$g` of them, weights `$w[i]`, scales `$e[i]`) times pair `$pair` of
    // every input, into `$acc[i][t]`.
    macro_rules! products {
        ($g:expr, $w:expr, $e:expr, $pair:expr, $acc:expr) => {{
            let pair: usize = $pair;
            for t in 0..T {
                let x = &xg[t][pair];
                // SAFETY: `x.codes` and `x.bias` are 64 aligned bytes each.
                let (p, c) = unsafe {
                    (_mm512_load_si512(x.codes.as_ptr().cast()), _mm512_load_si512(x.bias.as_ptr().cast()))
                };
                let s = sx[t][pair];
                for i in 0..$g {
                    let sum = _mm512_dpbusd_epi32(c, $w[i], p);
                    let ds = _mm512_mul_ps($e[i], _mm512_set1_ps(s));
                    $acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, $acc[i][t]);
                }
            }
        }};
    }
    let step = k_step::<R>(pairs, (size_of::<Mxfp4Group>() + size_of::<f32>()) * T, 1);
    let together = mxfp4_q8_rows_together(T);
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[_mm512_setzero_ps(); T]; R];
        let mut g0 = 0;
        while g0 < pairs {
            let g1 = pairs.min(g0 + step);
            // Rows `r0 + r ..` (`$g` of them) over pairs `g0..g1`, accumulating into `state`.
            macro_rules! rows_over_pairs {
                ($g:literal, $r:expr) => {{
                    const G: usize = $g;
                    let r: usize = $r;
                    let mut cp: [&[[u8; PAIR_BYTES]]; G] = [&[]; G];
                    let mut sc: [&[u8]; G] = [&[]; G];
                    let mut acc = [[_mm512_setzero_ps(); T]; G];
                    // The same pairs of the rows `R` further on ([`prefetch_line_ahead`]).
                    let mut ahead: [&[[u8; PAIR_BYTES]]; G] = [&[]; G];
                    for i in 0..G {
                        let row = r0 + r + i;
                        if R > 1 && row + R < rows {
                            let next = row + R;
                            ahead[i] = &codes[next * rb..][..rb].as_chunks::<PAIR_BYTES>().0[g0..g1];
                            prefetch(&scales[next * bpr + 2 * g0..next * bpr + 2 * g1]);
                        }
                        cp[i] = &codes[row * rb..][..rb].as_chunks::<PAIR_BYTES>().0[..pairs];
                        sc[i] = &scales[row * bpr..][..n];
                        acc[i] = state[r + i];
                    }
                    for g in g0..g1 {
                        prefetch_line_ahead(&ahead, g - g0);
                        let mut w = [_mm512_setzero_si512(); G];
                        let mut e = [_mm512_setzero_ps(); G];
                        for i in 0..G {
                            // SAFETY: `cp[i][g]` is 32 readable bytes; unaligned loads are
                            // allowed.
                            w[i] = weights!(_mm512_broadcast_i64x4(unsafe {
                                _mm256_loadu_si256(cp[i][g].as_ptr().cast())
                            }));
                            e[i] = lane_scales!(
                                mxfp4::HALF_SCALES[sc[i][2 * g] as usize],
                                mxfp4::HALF_SCALES[sc[i][2 * g + 1] as usize]
                            );
                        }
                        products!(G, w, e, g, acc);
                    }
                    for i in 0..G {
                        state[r + i] = acc[i];
                    }
                }};
            }
            in_row_groups!(rr, together, rows_over_pairs);
            g0 = g1;
        }
        for (r, acc) in state.iter_mut().enumerate().take(rr) {
            if odd {
                let b = n - 1;
                let tail = &codes[(r0 + r) * rb + b * BLOCK_BYTES..][..BLOCK_BYTES];
                // SAFETY: `tail` is 16 readable bytes; the second block's codes are 0 (weight
                // 12 after the offset, which its lanes' bias cancels), its scale 0.
                let w = [weights!(_mm512_broadcast_i64x4(_mm256_zextsi128_si256(unsafe {
                    _mm_loadu_si128(tail.as_ptr().cast())
                })))];
                let e = [lane_scales!(mxfp4::HALF_SCALES[scales[(r0 + r) * bpr + b] as usize], 0.0)];
                let mut one = [*acc];
                products!(1, w, e, pairs, one);
                *acc = one[0];
            }
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = hsum512(acc[t]);
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// The integer-kernel dot products of MXFP4 rows of `cols` inputs (`codes`, `scales`: whole
/// rows) with each of `T` quantized inputs ([`super::q8::mxfp4_dot_reference`]), with AVX2
/// only (for CPUs without AVX-512 VNNI), into `out[r * stride + t]`, one activation group (two
/// blocks) a step.
///
/// Per row and block pair (shared by every input): the pair's 32 code bytes, masked to the
/// low nibbles, and shifted right by 4 and masked to the high ones, are looked up (`vpshufb`)
/// in [`FP4_DOUBLED_OFFSET`]: the weights `w + 12` (unsigned) of the even elements of both
/// blocks (block 0 in the low 128 bits, block 1 in the high), then of the odd ones, which is
/// the order of [`Mxfp4Group::codes`]. Per row and input, `vpmaddubsw` of each half with the
/// input's codes (pair sums of at most `2 * 24 * 127`, no saturation), the two added in i16
/// (at most `4 * 24 * 127`) and widened by `vpmaddwd` with ones into 8 exact i32 partial sums,
/// 4 per block, plus the input's bias for those bytes (from [`Mxfp4Group::bias`], which takes
/// the offset's `12 p` back out); converted to f32 and multiply-added, by `(2^(e_b - 127) /
/// 2) * s_g`, into the row's and input's one accumulator, pair after pair. A last odd block
/// is decoded with a zero second block (scale 0); one horizontal sum at the end. The integer
/// sums are those of [`mxfp4_dot_q8_vnni`]; the float sums are in another order.
///
/// With one input two rows go side by side; every row's arithmetic is the same whatever the
/// grouping and input count, so a batched product equals the single-input one bit for bit.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn mxfp4_dot_q8_avx2<const T: usize, const R: usize>(
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
    // SAFETY: 16 readable bytes; unaligned loads are allowed.
    let table = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(FP4_DOUBLED_OFFSET.as_ptr().cast()) });
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    // A block pair's weights (`v`: its 32 code bytes): even elements, odd elements.
    macro_rules! weights {
        ($v:expr) => {{
            let v: __m256i = $v;
            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, mask));
            let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
            [lo, hi]
        }};
    }
    // The blocks' scales (`2^(e - 127) / 2`), block 0's in the low 128 bits.
    macro_rules! lane_scales {
        ($e0:expr, $e1:expr) => {
            _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(_mm_set1_ps($e0)), _mm_set1_ps($e1))
        };
    }
    // Rows `$g` (weights `$w[i]`, scales `$e[i]`) times pair `$pair` of every input, into
    // `$acc[i][t]`.
    macro_rules! products {
        ($g:expr, $w:expr, $e:expr, $pair:expr, $acc:expr) => {{
            let pair: usize = $pair;
            for t in 0..T {
                let x = &xg[t][pair];
                // SAFETY: `x.codes` and `x.bias` are 64 bytes each, aligned to 64.
                let (p0, p1, c) = unsafe {
                    let (p, c) = (x.codes.as_ptr().cast::<__m256i>(), x.bias.as_ptr().cast::<__m256i>());
                    (
                        _mm256_load_si256(p),
                        _mm256_load_si256(p.add(1)),
                        _mm256_add_epi32(_mm256_load_si256(c), _mm256_load_si256(c.add(1))),
                    )
                };
                let s = _mm256_set1_ps(sx[t][pair]);
                for i in 0..$g {
                    let [w0, w1]: [__m256i; 2] = $w[i];
                    let pairs16 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, p0), _mm256_maddubs_epi16(w1, p1));
                    let sum = _mm256_add_epi32(_mm256_madd_epi16(pairs16, ones), c);
                    let ds = _mm256_mul_ps($e[i], s);
                    $acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), ds, $acc[i][t]);
                }
            }
        }};
    }
    let step = k_step::<R>(pairs, (size_of::<Mxfp4Group>() + size_of::<f32>()) * T, 1);
    let together = if T == 1 { 2 } else { 1 };
    let mut r0 = 0;
    while r0 < rows {
        let rr = R.min(rows - r0);
        let mut state = [[_mm256_setzero_ps(); T]; R];
        let mut g0 = 0;
        while g0 < pairs {
            let g1 = pairs.min(g0 + step);
            // Rows `r0 + r ..` (`$g` of them) over pairs `g0..g1`, accumulating into `state`.
            macro_rules! rows_over_pairs {
                ($g:literal, $r:expr) => {{
                    const G: usize = $g;
                    let r: usize = $r;
                    let mut cp: [&[[u8; PAIR_BYTES]]; G] = [&[]; G];
                    let mut sc: [&[u8]; G] = [&[]; G];
                    let mut acc = [[_mm256_setzero_ps(); T]; G];
                    // The same pairs of the rows `R` further on ([`prefetch_line_ahead`]).
                    let mut ahead: [&[[u8; PAIR_BYTES]]; G] = [&[]; G];
                    for i in 0..G {
                        let row = r0 + r + i;
                        if R > 1 && row + R < rows {
                            let next = row + R;
                            ahead[i] = &codes[next * rb..][..rb].as_chunks::<PAIR_BYTES>().0[g0..g1];
                            prefetch(&scales[next * bpr + 2 * g0..next * bpr + 2 * g1]);
                        }
                        cp[i] = &codes[row * rb..][..rb].as_chunks::<PAIR_BYTES>().0[..pairs];
                        sc[i] = &scales[row * bpr..][..n];
                        acc[i] = state[r + i];
                    }
                    for g in g0..g1 {
                        prefetch_line_ahead(&ahead, g - g0);
                        let mut w = [[_mm256_setzero_si256(); 2]; G];
                        let mut e = [_mm256_setzero_ps(); G];
                        for i in 0..G {
                            // SAFETY: `cp[i][g]` is 32 readable bytes; unaligned loads are
                            // allowed.
                            w[i] = weights!(unsafe { _mm256_loadu_si256(cp[i][g].as_ptr().cast()) });
                            e[i] = lane_scales!(
                                mxfp4::HALF_SCALES[sc[i][2 * g] as usize],
                                mxfp4::HALF_SCALES[sc[i][2 * g + 1] as usize]
                            );
                        }
                        products!(G, w, e, g, acc);
                    }
                    for i in 0..G {
                        state[r + i] = acc[i];
                    }
                }};
            }
            in_row_groups!(rr, together, rows_over_pairs);
            g0 = g1;
        }
        for (r, acc) in state.iter_mut().enumerate().take(rr) {
            if odd {
                let b = n - 1;
                let tail = &codes[(r0 + r) * rb + b * BLOCK_BYTES..][..BLOCK_BYTES];
                // SAFETY: `tail` is 16 readable bytes; the second block's codes are 0 (weight
                // 12 after the offset, which its lanes' bias cancels), its scale 0.
                let w = [weights!(_mm256_zextsi128_si256(unsafe { _mm_loadu_si128(tail.as_ptr().cast()) }))];
                let e = [lane_scales!(mxfp4::HALF_SCALES[scales[(r0 + r) * bpr + b] as usize], 0.0)];
                let mut one = [*acc];
                products!(1, w, e, pairs, one);
                *acc = one[0];
            }
            let mut s = [0.0f32; T];
            for t in 0..T {
                s[t] = hsum256(acc[t]);
            }
            store(out, (r0 + r) * stride, &s);
        }
        r0 += rr;
    }
}

/// The 16-bit lanes of a register's upper 256 bits: the merge mask of [`high_nibbles_up`]
/// and [`load_pair_high_nibbles_up`].
const UPPER_HALF_WORDS: u32 = 0xffff_0000;

/// The upper 256 bits of `v` shifted right by 4 in each 16-bit lane, the lower 256 kept
/// (`vpsrlw zmm{k}, zmm, 4`): the high nibbles of a block pair's codes beside the low ones.
/// Written out because the compiler otherwise makes it a shift by a vector of counts, which
/// takes one of the two units the dot products and multiply-adds need on Zen 5 (docs/perf.md,
/// `op_rate`), where an immediate shift does not.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) fn high_nibbles_up(v: __m512i) -> __m512i {
    let mut out = v;
    // SAFETY: register-only; merge-masking keeps the lanes the mask leaves out.
    unsafe {
        std::arch::asm!(
            "vpsrlw {out}{{{k}}}, {v}, 4",
            out = inout(zmm_reg) out,
            v = in(zmm_reg) v,
            k = in(kreg) UPPER_HALF_WORDS,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    out
}

/// A block pair's 32 code bytes at `p` in both halves of a register with the upper half as
/// [`high_nibbles_up`] leaves it, in one broadcast load and one shift in place: written out so
/// that the compiler neither splits the broadcast into a load and an insert (a second
/// operation on the shuffle port) nor copies the register for the merge.
///
/// # Safety
/// `p` must point to 32 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn load_pair_high_nibbles_up(p: *const u8) -> __m512i {
    let out: __m512i;
    // SAFETY: the caller's contract: 32 readable bytes at `p`; the rest is register-only.
    unsafe {
        std::arch::asm!(
            "vbroadcasti64x4 {out}, ymmword ptr [{p}]",
            "vpsrlw {out}{{{k}}}, {out}, 4",
            out = out(zmm_reg) out,
            p = in(reg) p,
            k = in(kreg) UPPER_HALF_WORDS,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    out
}

/// Rows of an MXFP4 matrix that [`mxfp4_dot_q8_vnni`] multiplies side by side for `t`
/// inputs: each row and input has one accumulator chain, so with few inputs several rows keep
/// enough chains in flight, and each input's codes and bias, loaded once, serve every row.
/// Every row's arithmetic is the same whatever the grouping.
pub(crate) const fn mxfp4_q8_rows_together(t: usize) -> usize {
    match t {
        1..=4 => 4,
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hsum512_is_the_order_of_mm512_reduce_add_ps() {
        if !super::super::KernelPath::Avx512.is_available() {
            return;
        }
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
        fn both(v: &[f32; 16]) -> (u32, u32) {
            let v = load16(v);
            (hsum512(v).to_bits(), _mm512_reduce_add_ps(v).to_bits())
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..100_000 {
            let v: [f32; 16] = std::array::from_fn(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let e = (state >> 59) as i32 - 16;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi(e)
            });
            // SAFETY: the CPU has AVX-512 (checked above).
            let (a, b) = unsafe { both(&v) };
            assert_eq!(a, b, "{v:?}");
        }
    }
}
