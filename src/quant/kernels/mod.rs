//! Run-time selection of the row-dot kernels: the scalar reference everywhere, and SIMD
//! variants where the CPU has them. `PICCHIO_KERNELS=scalar` (or `avx2`, `avx512`, ...)
//! forces a path, e.g. to compare against the reference.
//!
//! Each product has a dispatching function using [`selected`] (`f32_dot`, ...) and a
//! `*_with` twin taking the path explicitly, for tests and benchmarks. A `*_with` call for a
//! path this CPU cannot run uses the scalar reference instead, so no call is unsafe.
//!
//! The float kernels compute the reference sums in another order (so results differ from the
//! reference by rounding only). The integer kernels (`*_q8_*`, AVX-512 VNNI) first quantize
//! the activations, which changes the result more; their exact definition is in [`q8`].
//!
//! Each product also has a multi-input form (`*_multi_with`): one weight row against several
//! inputs, loading and unpacking each weight once for up to [`max_inputs`] of them. Its
//! outputs are bit-identical to the single-input product of each input on the same path
//! (the SIMD kernels apply exactly the same operations to each input; see the `x86` module),
//! which is what lets a batched prefill equal token-by-token decoding bit for bit.

pub mod q8;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use crate::quant::{int4, int8, mxfp4, reference};
use q8::QuantizedX;

/// A family of kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelPath {
    /// Plain Rust loops (the reference definitions).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL): 512-bit float kernels for every format.
    Avx512,
    /// x86-64 AVX-512 with VNNI: integer kernels on quantized activations for INT4 and INT8
    /// matrix-vector products (see [`KernelPath::quantizes_activations`]), and the 512-bit
    /// float kernels of [`KernelPath::Avx512`] otherwise. They beat the 256-bit f32 and bf16
    /// kernels on every AVX-512 machine measured (Zen 4, Zen 5, and a Sapphire Rapids class
    /// Xeon, where decode's BF16 attention took 64-82 instead of 74-91 ms a token on 2 threads
    /// and prefill's 0.57-0.70 instead of 0.83-0.95 s: docs/perf.md, 2026-12-07).
    Avx512Vnni,
    /// x86-64 AVX-512 VNNI with Intel AMX (tile) integer products: the kernels of
    /// [`KernelPath::Avx512Vnni`], except that MXFP4 rows on quantized activations run the AMX
    /// kernel, which equals the scalar definition bit for bit (see the `amx` module).
    Amx,
    /// aarch64 NEON.
    Neon,
}

/// Whether `Matrix::matvec` on the [`KernelPath::Avx512Vnni`] path quantizes the activations
/// and runs the integer kernels for INT4 and INT8 matrices (otherwise it runs the AVX-512
/// float kernels). On Zen 4 the integer kernels are about 2.3x (INT4) and 1.7x to 2.4x
/// (INT8) faster per matrix-vector product (`docs/perf.md`), for an activation error about
/// a twentieth of the INT4 weights' own (see [`q8`]). Off by default, because that error is
/// not a reordering of sums: with it the runtime is no longer implementation-exact against
/// the F32 forward pass on the same weights (level L1; a top-1 flips on the tiny fixture).
/// Opt in with `PICCHIO_INT8_ACTIVATIONS=1` or [`set_int8_activations`] before first use.
static INT8_ACTIVATIONS: OnceLock<bool> = OnceLock::new();

/// Whether activations are quantized for the VNNI integer kernels (see above).
pub fn int8_activations() -> bool {
    *INT8_ACTIVATIONS.get_or_init(|| std::env::var("PICCHIO_INT8_ACTIVATIONS").is_ok_and(|v| v == "1"))
}

/// Turns the VNNI integer kernels (with int8-quantized activations) on or off for this
/// process; returns false if kernels were already in use with the other setting.
pub fn set_int8_activations(on: bool) -> bool {
    INT8_ACTIVATIONS.set(on).is_ok() || int8_activations() == on
}

impl KernelPath {
    /// Every path, whether or not this CPU or build has it.
    pub const ALL: [KernelPath; 6] = [
        KernelPath::Scalar,
        KernelPath::Avx2,
        KernelPath::Avx512,
        KernelPath::Avx512Vnni,
        KernelPath::Amx,
        KernelPath::Neon,
    ];

    /// Lower-case name, as `PICCHIO_KERNELS` takes it.
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Scalar => "scalar",
            KernelPath::Avx2 => "avx2",
            KernelPath::Avx512 => "avx512",
            KernelPath::Avx512Vnni => "avx512-vnni",
            KernelPath::Amx => "amx",
            KernelPath::Neon => "neon",
        }
    }

    /// Every path this CPU can run and this build has kernels for, best last.
    pub fn available() -> Vec<KernelPath> {
        KernelPath::ALL.into_iter().filter(|p| p.is_available()).collect()
    }

    /// Whether this CPU can run this path and this build has kernels for it (cached).
    pub fn is_available(self) -> bool {
        static AVAILABLE: OnceLock<[bool; 6]> = OnceLock::new();
        AVAILABLE.get_or_init(|| KernelPath::ALL.map(|p| p.implemented() && cpu_has(p)))[self as usize]
    }

    /// Whether this build has kernels for this path.
    pub fn implemented(self) -> bool {
        match self {
            KernelPath::Scalar => true,
            KernelPath::Avx2 | KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => {
                cfg!(target_arch = "x86_64")
            }
            KernelPath::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// Whether products on this path quantize the activations ([`q8`]) and use the integer
    /// kernels, rather than the float kernels, for some weight format: int8 activations are on
    /// and the path has an integer kernel ([`KernelPath::has_integer_kernel`]). Formats it has
    /// none for keep the float kernels.
    pub fn quantizes_activations(self) -> bool {
        int8_activations()
            && [Product::Int8Q8, Product::Int4Q8, Product::Mxfp4Q8]
                .into_iter()
                .any(|p| self.has_integer_kernel(p))
    }

    /// Whether this path has an integer kernel for `product` (one of the `*Q8` products):
    /// AVX-512 VNNI for INT8, INT4 and MXFP4 rows; AVX2, AVX-512 and NEON for MXFP4 rows (its
    /// doubled weights are bytes in `-12..=12`, so `vpmaddubsw` pair sums cannot saturate and
    /// NEON's widening multiplies are exact). With int8 activations on, a matrix whose format
    /// has one here runs it; the others keep the float kernels. The `*_q8_with` functions
    /// run the scalar definition where there is none.
    pub fn has_integer_kernel(self, product: Product) -> bool {
        use KernelPath as P;
        match product {
            Product::F32 | Product::Bf16 | Product::Int8 | Product::Int4 | Product::Mxfp4 => false,
            Product::Int8Q8 | Product::Int4Q8 => matches!(self, P::Avx512Vnni | P::Amx),
            Product::Mxfp4Q8 => match self {
                P::Avx2 | P::Avx512 | P::Avx512Vnni | P::Amx | P::Neon => true,
                P::Scalar => false,
            },
        }
    }
}

/// Whether the CPU has the instructions `path` needs.
fn cpu_has(path: KernelPath) -> bool {
    match path {
        KernelPath::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 => {
            cpu_has(KernelPath::Avx2)
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
        }
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni => cpu_has(KernelPath::Avx512) && is_x86_feature_detected!("avx512vnni"),
        #[cfg(target_arch = "x86_64")]
        KernelPath::Amx => cpu_has(KernelPath::Avx512Vnni) && amx::available(),
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => std::arch::is_aarch64_feature_detected!("neon"),
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// `path` if this CPU can run it, else the scalar path.
#[inline]
fn usable(path: KernelPath) -> KernelPath {
    if path.is_available() { path } else { KernelPath::Scalar }
}

static SELECTED: OnceLock<KernelPath> = OnceLock::new();

/// The path in use: `PICCHIO_KERNELS` if set and available, else the best available.
pub fn selected() -> KernelPath {
    *SELECTED.get_or_init(|| {
        let available = KernelPath::available();
        // The last is the best. ([`KernelPath::Amx`] was opt-in until its single-input twin
        // caught up with the VNNI kernel: docs/perf.md, 2026-12-07 afternoon.)
        let best = available.last().copied().unwrap_or(KernelPath::Scalar);
        match std::env::var("PICCHIO_KERNELS") {
            Ok(name) => match available.iter().find(|p| p.name() == name) {
                Some(p) => *p,
                None => {
                    tracing::warn!(
                        "PICCHIO_KERNELS={name} is not available here (have: {}); using {}",
                        available.iter().map(|p| p.name()).collect::<Vec<_>>().join(", "),
                        best.name()
                    );
                    best
                }
            },
            Err(_) => best,
        }
    })
}

/// `sum_i w[i] x[i]`.
#[inline]
pub fn f32_dot(w: &[f32], x: &[f32]) -> f32 {
    f32_dot_with(selected(), w, x)
}

/// `sum_i bf16(w[i]) x[i]`.
#[inline]
pub fn bf16_dot(w: &[u16], x: &[f32]) -> f32 {
    bf16_dot_with(selected(), w, x)
}

/// One INT4-gs64 row with `x` (zero-padded to whole groups).
#[inline]
pub fn int4_dot(codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    int4_dot_with(selected(), codes, scales, x)
}

/// One MXFP4 row with `x` (32 inputs a block).
#[inline]
pub fn mxfp4_dot(codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    mxfp4_dot_with(selected(), codes, scales, x)
}

/// One INT8 row (with its scale) with `x`.
#[inline]
pub fn int8_dot(codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    int8_dot_with(selected(), codes, scale, x)
}

/// Rows whose accumulators the multi-row kernels keep together while a block of the inputs
/// passes over them.
pub(crate) const ROW_BLOCK: usize = 8;

/// Rows of a matrix that one task of the thread pool takes a multiple of (but for the last):
/// whole [`ROW_BLOCK`]s, and whole 16-row tiles of the AMX kernels, whose products of a last
/// shorter tile cost a full one.
pub(crate) const TASK_ROWS: usize = 16;

/// How far past its read position in a weight stream a one-input (matrix-vector) kernel asks
/// for cache lines to come into L2, and [`crate::bench::read_bandwidth`]'s read with it, so
/// that the floor reads the way the kernels do. Without it the hardware prefetcher alone kept
/// too few lines in flight on the Intel Xeon of docs/perf.md (2026-12-07, `cargo bench --bench
/// kernels -- stream_5760x2880/bf16`, 512 MiB of matrices): the BF16 product streamed at 12.6
/// GiB/s on one thread and 23.1 on two, 4 KiB ahead at 16.5 and 30.8, 8 KiB at 17.3 and 30.6,
/// 16 KiB at 16.3 and 29.8.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const STREAM_AHEAD_BYTES: usize = 8 << 10;

/// Whether a buffer of `len` elements holds `rows` rows of `per_row` elements, the product
/// checked (the sizes come from files): the test every kernel makes of its weights before it
/// reads them, returning without writing when it fails.
#[inline(always)]
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
fn holds_rows(len: usize, rows: usize, per_row: usize) -> bool {
    rows.checked_mul(per_row).is_some_and(|n| n <= len)
}

/// Bytes of inputs (all of a pass's inputs together) per block of the contraction in the
/// multi-row kernels: the block stays in L1 while [`ROW_BLOCK`] rows pass over it.
const X_TILE_BYTES: usize = 16 << 10;

/// Units per block of the contraction in a kernel that handles `R` rows at a time, where a
/// unit (a chunk or group of every input) is `unit_bytes` of inputs: all `units` for one row
/// (nothing to share), else about [`X_TILE_BYTES`] of inputs, a positive multiple of
/// `multiple` (so that accumulators alternating by unit keep their pattern).
#[inline(always)]
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
fn k_step<const R: usize>(units: usize, unit_bytes: usize, multiple: usize) -> usize {
    if R == 1 { units.max(1) } else { (X_TILE_BYTES / unit_bytes.max(1)).max(multiple) / multiple * multiple }
}

/// What an integer MXFP4 kernel reads of `T` quantized inputs against rows of `blocks` blocks:
/// the blocks all have in common (block `b` meets activation group `b / 2`, two blocks a group
/// of 64), and per input its groups ([`q8::Mxfp4Group`]) and scales over those blocks.
#[inline(always)]
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
fn mxfp4_q8_inputs<'a, const T: usize>(
    xs: &[&'a QuantizedX; T],
    blocks: usize,
) -> (usize, [&'a [q8::Mxfp4Group]; T], [&'a [f32]; T]) {
    let n = xs.iter().fold(blocks, |n, x| n.min(2 * x.mxfp4_groups().len()).min(2 * x.scales().len()));
    let mut groups: [&[q8::Mxfp4Group]; T] = [&[]; T];
    let mut scales: [&[f32]; T] = [&[]; T];
    for t in 0..T {
        groups[t] = &xs[t].mxfp4_groups()[..n.div_ceil(2)];
        scales[t] = &xs[t].scales()[..n.div_ceil(2)];
    }
    (n, groups, scales)
}

/// `out[at + t] = s[t]` for the `t` that `out` has room for.
#[inline(always)]
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
fn store<const T: usize>(out: &mut [f32], at: usize, s: &[f32; T]) {
    if let Some(o) = out.get_mut(at..at + T) {
        o.copy_from_slice(s);
    }
}

/// [`f32_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels read `min(w.len(), x.len())` elements.
pub fn f32_dot_with(path: KernelPath, w: &[f32], x: &[f32]) -> f32 {
    let mut o = [0.0f32];
    match usable(path) {
        _ if w.is_empty() => return reference::dot_f32(w, &x[..0]),
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { x86::f32_dot_avx2::<1, 1>(w, 1, w.len(), &[x], &mut o, 1) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => unsafe {
            x86::f32_dot_avx512::<1, 1>(w, 1, w.len(), &[x], &mut o, 1)
        },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::f32_dot_neon::<1, 1>(w, 1, w.len(), &[x], &mut o, 1) },
        _ => return reference::dot_f32(w, x),
    }
    o[0]
}

/// [`bf16_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels read `min(w.len(), x.len())` elements.
pub fn bf16_dot_with(path: KernelPath, w: &[u16], x: &[f32]) -> f32 {
    let x = &x[..x.len().min(w.len())];
    match bf16_input_order(path) {
        Some(order) => bf16_dot_arranged_with(path, w, &arranged_copy(order, x)),
        None => bf16_dot_arranged_with(path, w, x),
    }
}

/// [`bf16_dot_with`] with `x` already in the order the kernels of `path` read
/// ([`bf16_input_order`]).
pub fn bf16_dot_arranged_with(path: KernelPath, w: &[u16], x: &[f32]) -> f32 {
    let mut o = [0.0f32];
    match usable(path) {
        _ if w.is_empty() => return reference::dot_bf16(w, &x[..0]),
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { x86::bf16_dot_avx2::<1, 1>(w, 1, w.len(), &[x], &mut o, 1) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => unsafe {
            x86::bf16_dot_avx512::<1, 1>(w, 1, w.len(), &[x], &mut o, 1)
        },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::bf16_dot_neon::<1, 1>(w, 1, w.len(), &[x], &mut o, 1) },
        _ => return reference::dot_bf16(w, x),
    }
    o[0]
}

/// The order in which the BF16 kernels of `path` read each block of 32 inputs, where it is
/// not element order (as [`mxfp4_input_order`]): the 512-bit kernel takes a block's 32
/// weights in one load and splits them into even and odd elements without moving any
/// ([`x86::bf16_dot_avx512`]), so its inputs come split the same way.
pub fn bf16_input_order(path: KernelPath) -> Option<&'static [u8; ARRANGED_BLOCK]> {
    match usable(path) {
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => Some(&x86::SPLIT_ORDER),
        _ => None,
    }
}

/// [`int4_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels use the groups that `codes`, `scales` and `x` all hold in full.
pub fn int4_dot_with(path: KernelPath, codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    let g = scales.len().min(codes.len() / int4::GROUP_BYTES);
    let (codes, scales, cols) = (&codes[..g * int4::GROUP_BYTES], &scales[..g], g * int4::GROUP);
    let mut o = [0.0f32];
    match usable(path) {
        _ if g == 0 => return 0.0,
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { x86::int4_dot_avx2::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => unsafe {
            x86::int4_dot_avx512::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1)
        },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::int4_dot_neon::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1) },
        _ => return int4::dot_reference(codes, scales, x),
    }
    o[0]
}

/// [`mxfp4_dot`] on `path` (the scalar reference if this CPU cannot run `path`), over the
/// blocks that `codes`, `scales` and `x` all hold in full.
pub fn mxfp4_dot_with(path: KernelPath, codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let b = scales.len().min(codes.len() / mxfp4::BLOCK_BYTES).min(x.len() / mxfp4::BLOCK);
    let x = &x[..b * mxfp4::BLOCK];
    match mxfp4_input_order(path) {
        Some(order) => mxfp4_dot_arranged_with(path, codes, scales, &arranged_copy(order, x)),
        None => mxfp4_dot_arranged_with(path, codes, scales, x),
    }
}

/// The order in which the MXFP4 float kernels of `path` read each block's 32 inputs, where it
/// is not element order: position `p` of an arranged block holds element `order[p]`. Each
/// kernel reads its inputs in the order its decode leaves the weights in, so that no nibble
/// or weight is moved per row; the callers of the `*_arranged_*` forms arrange each input once
/// per product ([`arrange_inputs`]).
pub fn mxfp4_input_order(path: KernelPath) -> Option<&'static [u8; ARRANGED_BLOCK]> {
    match usable(path) {
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => Some(&x86::MXFP4_AVX2_ORDER),
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => Some(&x86::SPLIT_ORDER),
        _ => None,
    }
}

/// Inputs per block of an input order ([`mxfp4_input_order`], [`bf16_input_order`]): an
/// MXFP4 block, and the bf16 weights of one 64-byte load.
pub const ARRANGED_BLOCK: usize = mxfp4::BLOCK;

/// Rearranges `x` (whole blocks of [`ARRANGED_BLOCK`]; a partial last block is left as it is)
/// into `order` ([`mxfp4_input_order`], [`bf16_input_order`]): position `p` of every block
/// gets the block's element `order[p]`.
pub fn arrange_inputs(order: &[u8; ARRANGED_BLOCK], x: &mut [f32]) {
    for block in x.as_chunks_mut::<ARRANGED_BLOCK>().0 {
        let v = *block;
        for (slot, &i) in block.iter_mut().zip(order) {
            *slot = v[usize::from(i)];
        }
    }
}

/// A copy of `x` arranged into `order` ([`arrange_inputs`]), for the products that arrange
/// their inputs per call.
fn arranged_copy(order: &[u8; ARRANGED_BLOCK], x: &[f32]) -> Vec<f32> {
    let mut arranged = x.to_vec();
    arrange_inputs(order, &mut arranged);
    arranged
}

/// [`mxfp4_dot_with`] with `x` already in the order the kernels of `path` read
/// ([`mxfp4_input_order`]).
pub fn mxfp4_dot_arranged_with(path: KernelPath, codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let b = scales.len().min(codes.len() / mxfp4::BLOCK_BYTES).min(x.len() / mxfp4::BLOCK);
    let (codes, scales, cols) = (&codes[..b * mxfp4::BLOCK_BYTES], &scales[..b], b * mxfp4::BLOCK);
    let mut o = [0.0f32];
    match usable(path) {
        _ if b == 0 => return 0.0,
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { x86::mxfp4_dot_avx2::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => unsafe {
            x86::mxfp4_dot_avx512::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1)
        },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::mxfp4_dot_neon::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1) },
        _ => return mxfp4::dot_reference(codes, scales, &x[..cols]),
    }
    o[0]
}

/// [`int8_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels read `min(codes.len(), x.len())` elements.
pub fn int8_dot_with(path: KernelPath, codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    let mut o = [0.0f32];
    match usable(path) {
        _ if codes.is_empty() => return int8::dot_reference(codes, scale, &x[..0]),
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { x86::int8_sum_avx2::<1, 1>(codes, 1, codes.len(), &[x], &mut o, 1) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => unsafe {
            x86::int8_sum_avx512::<1, 1>(codes, 1, codes.len(), &[x], &mut o, 1)
        },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::int8_sum_neon::<1, 1>(codes, 1, codes.len(), &[x], &mut o, 1) },
        _ => return int8::dot_reference(codes, scale, x),
    }
    scale * o[0]
}

/// One INT4-gs64 row with quantized activations ([`q8::int4_dot_reference`]): the VNNI kernel
/// on [`KernelPath::Avx512Vnni`] (when this CPU has it), the scalar definition on every other
/// path.
pub fn int4_dot_q8_with(path: KernelPath, codes: &[u8], scales: &[u16], x: &QuantizedX) -> f32 {
    let g = scales.len().min(codes.len() / int4::GROUP_BYTES);
    if g == 0 {
        return 0.0;
    }
    let (codes, scales) = (&codes[..g * int4::GROUP_BYTES], &scales[..g]);
    #[cfg(target_arch = "x86_64")]
    if matches!(usable(path), KernelPath::Avx512Vnni | KernelPath::Amx) {
        let mut o = [0.0f32];
        // SAFETY: `usable` returned the path only if the CPU has its features.
        unsafe { x86::int4_dot_q8_vnni::<1, 1>(codes, scales, 1, g * int4::GROUP, &[x], &mut o, 1) };
        return o[0];
    }
    let _ = path; // only x86 has an integer kernel
    q8::int4_dot_reference(codes, scales, x)
}

/// One MXFP4 row with quantized activations ([`q8::mxfp4_dot_reference`]): the VNNI kernel
/// on [`KernelPath::Avx512Vnni`], the 16-row twin of the AMX kernel on [`KernelPath::Amx`]
/// (the scalar definition bit for bit), the AVX2 integer kernel on [`KernelPath::Avx2`] and
/// [`KernelPath::Avx512`], the NEON one on [`KernelPath::Neon`] (when this CPU has them), the
/// scalar definition otherwise.
pub fn mxfp4_dot_q8_with(path: KernelPath, codes: &[u8], scales: &[u8], x: &QuantizedX) -> f32 {
    let b = scales.len().min(codes.len() / mxfp4::BLOCK_BYTES);
    let (codes, scales) = (&codes[..b * mxfp4::BLOCK_BYTES], &scales[..b]);
    let cols = b * mxfp4::BLOCK;
    let mut o = [0.0f32];
    match usable(path) {
        _ if b == 0 => return 0.0,
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni => unsafe {
            x86::mxfp4_dot_q8_vnni::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1)
        },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Amx => unsafe { amx::mxfp4_dot_q8_amx::<1>(codes, scales, 1, cols, &[x], &mut o, 1) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx512 => unsafe {
            x86::mxfp4_dot_q8_avx2::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1)
        },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe {
            neon::mxfp4_dot_q8_neon::<1, 1>(codes, scales, 1, cols, &[x], &mut o, 1)
        },
        _ => return q8::mxfp4_dot_reference(codes, scales, x),
    }
    o[0]
}

/// One INT8 row with quantized activations ([`q8::int8_dot_reference`]): the VNNI kernel on
/// [`KernelPath::Avx512Vnni`] (when this CPU has it), the scalar definition on every other
/// path.
pub fn int8_dot_q8_with(path: KernelPath, codes: &[i8], scale: f32, x: &QuantizedX) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if !codes.is_empty() && matches!(usable(path), KernelPath::Avx512Vnni | KernelPath::Amx) {
        let mut o = [0.0f32];
        // SAFETY: `usable` returned the path only if the CPU has its features.
        unsafe { x86::int8_dot_q8_vnni::<1, 1>(codes, &[scale], 1, codes.len(), &[x], &mut o, 1) };
        return o[0];
    }
    let _ = path; // only x86 has an integer kernel
    q8::int8_dot_reference(codes, scale, x)
}

// --- Several rows and inputs at once ---------------------------------------------------------

/// Which dot product a kernel computes: the weight format, and for INT4 and INT8 whether the
/// activations are quantized ([`q8`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Product {
    /// [`f32_dot_with`].
    F32,
    /// [`bf16_dot_with`].
    Bf16,
    /// [`int8_dot_with`].
    Int8,
    /// [`int4_dot_with`].
    Int4,
    /// [`int8_dot_q8_with`].
    Int8Q8,
    /// [`int4_dot_q8_with`].
    Int4Q8,
    /// [`mxfp4_dot_with`].
    Mxfp4,
    /// [`mxfp4_dot_q8_with`].
    Mxfp4Q8,
}

/// Most inputs a multi-input kernel of `product` on `path` takes in one pass over the weights:
/// as many as keep every input's accumulators in vector registers. More inputs are split into
/// passes of at most this many (1 where the path has no multi-input kernel for `product`).
pub fn max_inputs(path: KernelPath, product: Product) -> usize {
    use {KernelPath as P, Product as D};
    match (usable(path), product) {
        // 16 registers: four accumulators per input for the float formats, four vectors per
        // input across an INT4 group.
        (P::Avx2, D::F32 | D::Bf16 | D::Int8 | D::Int4) => 3,
        // 32 registers: four accumulators per input (the 512-bit f32 and INT8 kernels), or two
        // per INT4 input plus the unpacked group. The 512-bit BF16
        // kernel: two per input and row, two rows side by side past 3 inputs; 8 inputs on one
        // row ran 17% slower than passes of 6 on two (Zen 5, docs/perf.md 2026-12-04).
        (P::Avx512 | P::Avx512Vnni | P::Amx, D::F32 | D::Bf16 | D::Int8) => 6,
        (P::Avx512 | P::Avx512Vnni | P::Amx, D::Int4) => 8,
        (P::Avx512Vnni | P::Amx, D::Int8Q8 | D::Int4Q8) => 8,
        (P::Neon, D::F32 | D::Bf16 | D::Int8) => 6,
        (P::Neon, D::Int4) => 4,
        // MXFP4: two accumulators per input plus the decoded block (4 vectors), the two
        // byte tables, the shift counts and the two masks on AVX2; two per input plus the
        // table, the scaled table, the indices, the two looked-up halves and the input's two
        // halves on AVX-512, where passes of 4 inputs (on three rows side by side) beat
        // passes of 5 (on two) by 9-11% (docs/perf.md, 2026-12-04); on VNNI one per input
        // and row, two rows side by side past 4 inputs, plus each row's weights and scales.
        (P::Avx2, D::Mxfp4) => 3,
        (P::Avx512 | P::Avx512Vnni | P::Amx, D::Mxfp4) => 4,
        (P::Avx512Vnni, D::Mxfp4Q8) => 8,
        // AMX: one tile of 16 inputs' codes.
        #[cfg(target_arch = "x86_64")]
        (P::Amx, D::Mxfp4Q8) => amx::MAX_INPUTS,
        // The AVX2 integer MXFP4 kernel: one accumulator per input and row plus the row's two
        // weight vectors and scales, and the input's two code vectors and bias; NEON: two
        // accumulators per input.
        (P::Avx2 | P::Avx512, D::Mxfp4Q8) => 3,
        (P::Neon, D::Mxfp4Q8) => 4,
        (P::Neon, D::Mxfp4) => 4,
        // Scalar references, one input at a time.
        _ => 1,
    }
}

/// Splits `n` inputs into the fewest passes of at most `max` (at least 1), as even as
/// possible: the sizes of the passes, largest first.
pub fn passes(n: usize, max: usize) -> impl Iterator<Item = usize> {
    let count = n.div_ceil(max.max(1));
    (0..count).map(move |i| n / count + usize::from(i < n % count))
}

/// Rows that `codes` (`row_bytes` a row) and `scales` (`row_scales` a row) both hold in full;
/// a zero width does not limit the count.
fn whole_rows(codes: usize, row_bytes: usize, scales: usize, row_scales: usize) -> usize {
    let per = |len: usize, width: usize| len.checked_div(width).unwrap_or(usize::MAX);
    per(codes, row_bytes).min(per(scales, row_scales))
}

/// Something with a length: an input of a multi-input product.
trait Input {
    fn len(&self) -> usize;
}

impl Input for &[f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }
}

impl Input for &QuantizedX {
    fn len(&self) -> usize {
        QuantizedX::len(self)
    }
}

/// `out[r * n + t] = single(r, xs[t])` for `rows` rows (as many as `out` holds) and the
/// `n = xs.len()` inputs, with `kernel(pass, out, rows, n)` computing passes of at most `max`
/// inputs, writing `out[r * n + t]` for the pass's `t` (`out` starts at the pass's first
/// input). Inputs of different lengths go one per pass (a kernel runs over the inputs'
/// common length, so only then does it equal the single products). `kernel` returns false
/// for a pass it has no kernel for, which then runs product by product.
fn multi<X: Input + Copy>(
    xs: &[X],
    out: &mut [f32],
    rows: usize,
    max: usize,
    kernel: impl Fn(&[X], &mut [f32], usize, usize) -> bool,
    single: impl Fn(usize, X) -> f32,
) {
    let n = xs.len();
    let rows = rows.min(out.len().checked_div(n).unwrap_or(0));
    if rows == 0 {
        return;
    }
    let out = &mut out[..rows * n];
    let same = xs.windows(2).all(|p| p[0].len() == p[1].len());
    let mut start = 0;
    for size in passes(n, if same { max } else { 1 }) {
        let pass = &xs[start..start + size];
        if !kernel(pass, &mut out[start..], rows, n) {
            for (r, o) in out.chunks_exact_mut(n).enumerate() {
                for (o, &x) in o[start..start + size].iter_mut().zip(pass) {
                    *o = single(r, x);
                }
            }
        }
        start += size;
    }
}

/// Runs `$call` (which names `$a: &[X; T]`) for the `T` in `$t` that equals `$xs.len()`;
/// evaluates to whether there was one.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(unused_macros))]
macro_rules! by_count {
    ($xs:expr, [$($t:literal),*], |$a:ident| $call:expr) => {
        match $xs.len() {
            $($t => match <&[_; $t]>::try_from($xs) {
                Ok($a) => {
                    $call;
                    true
                }
                Err(_) => false,
            },)*
            _ => false,
        }
    };
}

/// `w` holds rows of `cols` weights, `out` is `[rows, n]` for the `n = xs.len()` inputs:
/// `out[r * n + t] = f32_dot_with(path, row r, xs[t])`, bit for bit, for every row `w` and
/// `out` both hold. Each weight is loaded once per pass of up to [`max_inputs`] inputs, and
/// rows go in blocks that keep their accumulators in L1 while the inputs pass (see the `x86`
/// module).
pub fn f32_dot_multi_with(path: KernelPath, w: &[f32], cols: usize, xs: &[&[f32]], out: &mut [f32]) {
    let path = usable(path);
    let rows = w.len().checked_div(cols).unwrap_or(usize::MAX);
    let kernel = |xs: &[&[f32]], out: &mut [f32], rows: usize, n: usize| match path {
        _ if cols == 0 => false,
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => {
            by_count!(xs, [1, 2, 3], |a| unsafe {
                x86::f32_dot_avx2::<_, ROW_BLOCK>(w, rows, cols, a, out, n)
            })
        }
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => {
            by_count!(xs, [1, 2, 3, 4, 5, 6], |a| unsafe {
                x86::f32_dot_avx512::<_, ROW_BLOCK>(w, rows, cols, a, out, n)
            })
        }
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => by_count!(xs, [1, 2, 3, 4, 5, 6], |a| unsafe {
            neon::f32_dot_neon::<_, ROW_BLOCK>(w, rows, cols, a, out, n)
        }),
        _ => false,
    };
    let single = |r: usize, x: &[f32]| f32_dot_with(path, &w[r * cols..(r + 1) * cols], x);
    multi(xs, out, rows, max_inputs(path, Product::F32), kernel, single);
}

/// [`f32_dot_multi_with`] for bf16 weights: `out[r * n + t] = bf16_dot_with(path, row r,
/// xs[t])`, bit for bit; each weight is widened once per pass of up to [`max_inputs`] inputs.
pub fn bf16_dot_multi_with(path: KernelPath, w: &[u16], cols: usize, xs: &[&[f32]], out: &mut [f32]) {
    match bf16_input_order(path) {
        Some(order) => {
            let arranged: Vec<Vec<f32>> =
                xs.iter().map(|x| arranged_copy(order, &x[..x.len().min(cols)])).collect();
            let arranged: Vec<&[f32]> = arranged.iter().map(Vec::as_slice).collect();
            bf16_dot_multi_arranged_with(path, w, cols, &arranged, out)
        }
        None => bf16_dot_multi_arranged_with(path, w, cols, xs, out),
    }
}

/// [`bf16_dot_multi_with`] with the inputs already in the order the kernels of `path` read
/// ([`bf16_input_order`]): `out[r * n + t] = bf16_dot_arranged_with(path, row r, xs[t])`, bit
/// for bit. [`crate::quant::Matrix`] arranges its inputs once per product and calls this.
pub fn bf16_dot_multi_arranged_with(
    path: KernelPath,
    w: &[u16],
    cols: usize,
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let path = usable(path);
    let rows = w.len().checked_div(cols).unwrap_or(usize::MAX);
    let kernel = |xs: &[&[f32]], out: &mut [f32], rows: usize, n: usize| match path {
        _ if cols == 0 => false,
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => {
            by_count!(xs, [1, 2, 3], |a| unsafe {
                x86::bf16_dot_avx2::<_, ROW_BLOCK>(w, rows, cols, a, out, n)
            })
        }
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => {
            by_count!(xs, [1, 2, 3, 4, 5, 6], |a| unsafe {
                x86::bf16_dot_avx512::<_, ROW_BLOCK>(w, rows, cols, a, out, n)
            })
        }
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => by_count!(xs, [1, 2, 3, 4, 5, 6], |a| unsafe {
            neon::bf16_dot_neon::<_, ROW_BLOCK>(w, rows, cols, a, out, n)
        }),
        _ => false,
    };
    let single = |r: usize, x: &[f32]| bf16_dot_arranged_with(path, &w[r * cols..(r + 1) * cols], x);
    multi(xs, out, rows, max_inputs(path, Product::Bf16), kernel, single);
}

/// [`f32_dot_multi_with`] for INT8 rows (`codes`, one scale per row in `scales`):
/// `out[r * n + t] = int8_dot_with(path, row r, scales[r], xs[t])`, bit for bit; each code is
/// widened once per pass of up to [`max_inputs`] inputs.
pub fn int8_dot_multi_with(
    path: KernelPath,
    codes: &[i8],
    scales: &[f32],
    cols: usize,
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let path = usable(path);
    let rows = codes.len().checked_div(cols).unwrap_or(usize::MAX).min(scales.len());
    let codes = &codes[..(rows * cols).min(codes.len())];
    let kernel = |xs: &[&[f32]], out: &mut [f32], rows: usize, n: usize| {
        let done = match path {
            _ if cols == 0 => false,
            // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => by_count!(xs, [1, 2, 3], |a| unsafe {
                x86::int8_sum_avx2::<_, ROW_BLOCK>(codes, rows, cols, a, out, n)
            }),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => {
                by_count!(xs, [1, 2, 3, 4, 5, 6], |a| unsafe {
                    x86::int8_sum_avx512::<_, ROW_BLOCK>(codes, rows, cols, a, out, n)
                })
            }
            #[cfg(target_arch = "aarch64")]
            KernelPath::Neon => by_count!(xs, [1, 2, 3, 4, 5, 6], |a| unsafe {
                neon::int8_sum_neon::<_, ROW_BLOCK>(codes, rows, cols, a, out, n)
            }),
            _ => false,
        };
        // The kernels leave each row's sum unscaled; scale it as the single product does.
        if done {
            for (o, &scale) in out.chunks_mut(n).zip(scales) {
                let m = xs.len().min(o.len());
                for o in &mut o[..m] {
                    *o *= scale;
                }
            }
        }
        done
    };
    let single = |r: usize, x: &[f32]| int8_dot_with(path, &codes[r * cols..(r + 1) * cols], scales[r], x);
    multi(xs, out, rows, max_inputs(path, Product::Int8), kernel, single);
}

/// [`f32_dot_multi_with`] for INT4-gs64 rows of `cols` inputs (`codes` and `scales` whole rows,
/// inputs padded to whole groups): `out[r * n + t] = int4_dot_with(path, row r, xs[t])`, bit
/// for bit; each group is unpacked once per pass of up to [`max_inputs`] inputs.
pub fn int4_dot_multi_with(
    path: KernelPath,
    codes: &[u8],
    scales: &[u16],
    cols: usize,
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let path = usable(path);
    let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
    let rows = whole_rows(codes.len(), rb, scales.len(), g);
    let kernel = |xs: &[&[f32]], out: &mut [f32], rows: usize, n: usize| match path {
        _ if cols == 0 => false,
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => by_count!(xs, [1, 2, 3], |a| unsafe {
            x86::int4_dot_avx2::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => {
            by_count!(xs, [1, 2, 3, 4, 5, 6, 7, 8], |a| unsafe {
                x86::int4_dot_avx512::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
            })
        }
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => by_count!(xs, [1, 2, 3, 4], |a| unsafe {
            neon::int4_dot_neon::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        _ => false,
    };
    let single = |r: usize, x: &[f32]| {
        int4_dot_with(path, &codes[r * rb..(r + 1) * rb], &scales[r * g..(r + 1) * g], x)
    };
    multi(xs, out, rows, max_inputs(path, Product::Int4), kernel, single);
}

/// [`int4_dot_multi_with`] on quantized activations: `out[r * n + t] =
/// int4_dot_q8_with(path, row r, xs[t])`, bit for bit; each group is unpacked once per pass of
/// up to [`max_inputs`] inputs.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn int4_dot_q8_multi_with(
    path: KernelPath,
    codes: &[u8],
    scales: &[u16],
    cols: usize,
    xs: &[&QuantizedX],
    out: &mut [f32],
) {
    let path = usable(path);
    let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
    let rows = whole_rows(codes.len(), rb, scales.len(), g);
    let kernel = |xs: &[&QuantizedX], out: &mut [f32], rows: usize, n: usize| match path {
        _ if cols == 0 => false,
        // SAFETY: `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni | KernelPath::Amx => by_count!(xs, [1, 2, 3, 4, 5, 6, 7, 8], |a| unsafe {
            x86::int4_dot_q8_vnni::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        _ => false,
    };
    let single = |r: usize, x: &QuantizedX| {
        int4_dot_q8_with(path, &codes[r * rb..(r + 1) * rb], &scales[r * g..(r + 1) * g], x)
    };
    multi(xs, out, rows, max_inputs(path, Product::Int4Q8), kernel, single);
}

/// [`int8_dot_multi_with`] on quantized activations: `out[r * n + t] =
/// int8_dot_q8_with(path, row r, scales[r], xs[t])`, bit for bit; each code is loaded once per
/// pass of up to [`max_inputs`] inputs.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn int8_dot_q8_multi_with(
    path: KernelPath,
    codes: &[i8],
    scales: &[f32],
    cols: usize,
    xs: &[&QuantizedX],
    out: &mut [f32],
) {
    let path = usable(path);
    let rows = codes.len().checked_div(cols).unwrap_or(usize::MAX).min(scales.len());
    let kernel = |xs: &[&QuantizedX], out: &mut [f32], rows: usize, n: usize| match path {
        _ if cols == 0 => false,
        // SAFETY: `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni | KernelPath::Amx => by_count!(xs, [1, 2, 3, 4, 5, 6, 7, 8], |a| unsafe {
            x86::int8_dot_q8_vnni::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        _ => false,
    };
    let single =
        |r: usize, x: &QuantizedX| int8_dot_q8_with(path, &codes[r * cols..(r + 1) * cols], scales[r], x);
    multi(xs, out, rows, max_inputs(path, Product::Int8Q8), kernel, single);
}

/// [`f32_dot_multi_with`] for MXFP4 rows of `cols` inputs (`codes` and `scales` whole rows):
/// `out[r * n + t] = mxfp4_dot_with(path, row r, xs[t])`, bit for bit.
pub fn mxfp4_dot_multi_with(
    path: KernelPath,
    codes: &[u8],
    scales: &[u8],
    cols: usize,
    xs: &[&[f32]],
    out: &mut [f32],
) {
    match mxfp4_input_order(path) {
        Some(order) => {
            let arranged: Vec<Vec<f32>> =
                xs.iter().map(|x| arranged_copy(order, &x[..x.len().min(cols)])).collect();
            let arranged: Vec<&[f32]> = arranged.iter().map(Vec::as_slice).collect();
            mxfp4_dot_multi_arranged_with(path, codes, scales, cols, &arranged, out)
        }
        None => mxfp4_dot_multi_arranged_with(path, codes, scales, cols, xs, out),
    }
}

/// [`mxfp4_dot_multi_with`] with the inputs already in the order the kernels of `path` read
/// ([`mxfp4_input_order`]): `out[r * n + t] = mxfp4_dot_arranged_with(path, row r, xs[t])`,
/// bit for bit. [`crate::quant::Matrix`] arranges its inputs once per product and calls this.
pub fn mxfp4_dot_multi_arranged_with(
    path: KernelPath,
    codes: &[u8],
    scales: &[u8],
    cols: usize,
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let path = usable(path);
    let (rb, b) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    let rows = whole_rows(codes.len(), rb, scales.len(), b);
    let kernel = |xs: &[&[f32]], out: &mut [f32], rows: usize, n: usize| match path {
        _ if cols == 0 => false,
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => by_count!(xs, [1, 2, 3], |a| unsafe {
            x86::mxfp4_dot_avx2::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni | KernelPath::Amx => {
            by_count!(xs, [1, 2, 3, 4, 5, 6, 7, 8], |a| unsafe {
                x86::mxfp4_dot_avx512::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
            })
        }
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => by_count!(xs, [1, 2, 3, 4], |a| unsafe {
            neon::mxfp4_dot_neon::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        _ => false,
    };
    let single = |r: usize, x: &[f32]| {
        mxfp4_dot_arranged_with(path, &codes[r * rb..(r + 1) * rb], &scales[r * b..(r + 1) * b], x)
    };
    multi(xs, out, rows, max_inputs(path, Product::Mxfp4), kernel, single);
}

/// [`mxfp4_dot_multi_with`] on quantized activations: `out[r * n + t] =
/// mxfp4_dot_q8_with(path, row r, xs[t])`, bit for bit.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(unused_variables))]
pub fn mxfp4_dot_q8_multi_with(
    path: KernelPath,
    codes: &[u8],
    scales: &[u8],
    cols: usize,
    xs: &[&QuantizedX],
    out: &mut [f32],
) {
    let path = usable(path);
    let (rb, b) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    let rows = whole_rows(codes.len(), rb, scales.len(), b);
    let kernel = |xs: &[&QuantizedX], out: &mut [f32], rows: usize, n: usize| match path {
        _ if cols == 0 => false,
        // SAFETY: `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni => by_count!(xs, [1, 2, 3, 4, 5, 6, 7, 8], |a| unsafe {
            x86::mxfp4_dot_q8_vnni::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        #[cfg(target_arch = "x86_64")]
        KernelPath::Amx => {
            by_count!(xs, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], |a| unsafe {
                amx::mxfp4_dot_q8_amx(codes, scales, rows, cols, a, out, n)
            })
        }
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx512 => by_count!(xs, [1, 2, 3], |a| unsafe {
            x86::mxfp4_dot_q8_avx2::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => by_count!(xs, [1, 2, 3, 4], |a| unsafe {
            neon::mxfp4_dot_q8_neon::<_, ROW_BLOCK>(codes, scales, rows, cols, a, out, n)
        }),
        _ => false,
    };
    let single = |r: usize, x: &QuantizedX| {
        mxfp4_dot_q8_with(path, &codes[r * rb..(r + 1) * rb], &scales[r * b..(r + 1) * b], x)
    };
    multi(xs, out, rows, max_inputs(path, Product::Mxfp4Q8), kernel, single);
}
