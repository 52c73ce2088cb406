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

pub mod q8;

#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;

use crate::quant::{int4, int8, reference};
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
    /// matrix-vector products (see [`KernelPath::quantizes_activations`]), 512-bit float
    /// kernels for single INT4 and INT8 dots, and the AVX2 kernels for f32 and bf16 (faster
    /// on Zen 4 when the weights come from memory).
    Avx512Vnni,
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
    pub const ALL: [KernelPath; 5] =
        [KernelPath::Scalar, KernelPath::Avx2, KernelPath::Avx512, KernelPath::Avx512Vnni, KernelPath::Neon];

    /// Lower-case name, as `PICCHIO_KERNELS` takes it.
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Scalar => "scalar",
            KernelPath::Avx2 => "avx2",
            KernelPath::Avx512 => "avx512",
            KernelPath::Avx512Vnni => "avx512-vnni",
            KernelPath::Neon => "neon",
        }
    }

    /// Every path this CPU can run and this build has kernels for, best last.
    pub fn available() -> Vec<KernelPath> {
        KernelPath::ALL.into_iter().filter(|p| p.is_available()).collect()
    }

    /// Whether this CPU can run this path and this build has kernels for it (cached).
    pub fn is_available(self) -> bool {
        static AVAILABLE: OnceLock<[bool; 5]> = OnceLock::new();
        AVAILABLE.get_or_init(|| KernelPath::ALL.map(|p| p.implemented() && cpu_has(p)))[self as usize]
    }

    /// Whether this build has kernels for this path.
    pub fn implemented(self) -> bool {
        match self {
            KernelPath::Scalar => true,
            KernelPath::Avx2 | KernelPath::Avx512 | KernelPath::Avx512Vnni => cfg!(target_arch = "x86_64"),
            KernelPath::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// Whether a matrix-vector product of an INT4 or INT8 matrix on this path quantizes the
    /// activations ([`q8`]) and uses the integer kernels, rather than the float kernels.
    pub fn quantizes_activations(self) -> bool {
        self == KernelPath::Avx512Vnni && int8_activations()
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
        let best = *available.last().unwrap_or(&KernelPath::Scalar);
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

/// One INT8 row (with its scale) with `x`.
#[inline]
pub fn int8_dot(codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    int8_dot_with(selected(), codes, scale, x)
}

/// [`f32_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels read `min(w.len(), x.len())` elements.
pub fn f32_dot_with(path: KernelPath, w: &[f32], x: &[f32]) -> f32 {
    match usable(path) {
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        // The VNNI path streams f32 faster with 256-bit vectors (see the `x86` module).
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx512Vnni => unsafe { x86::f32_dot_avx2(w, x) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 => unsafe { x86::f32_dot_avx512(w, x) },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::f32_dot_neon(w, x) },
        _ => reference::dot_f32(w, x),
    }
}

/// [`bf16_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels read `min(w.len(), x.len())` elements.
pub fn bf16_dot_with(path: KernelPath, w: &[u16], x: &[f32]) -> f32 {
    match usable(path) {
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        // The VNNI path streams bf16 faster with 256-bit vectors (see the `x86` module).
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx512Vnni => unsafe { x86::bf16_dot_avx2(w, x) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 => unsafe { x86::bf16_dot_avx512(w, x) },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::bf16_dot_neon(w, x) },
        _ => reference::dot_bf16(w, x),
    }
}

/// [`int4_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels use the groups that `codes`, `scales` and `x` all hold in full.
pub fn int4_dot_with(path: KernelPath, codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    match usable(path) {
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { x86::int4_dot_avx2(codes, scales, x) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { x86::int4_dot_avx512(codes, scales, x) },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::int4_dot_neon(codes, scales, x) },
        _ => int4::dot_reference(codes, scales, x),
    }
}

/// [`int8_dot`] on `path` (the scalar reference if this CPU cannot run `path`). The SIMD
/// kernels read `min(codes.len(), x.len())` elements.
pub fn int8_dot_with(path: KernelPath, codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    match usable(path) {
        // SAFETY (all arms): `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 => unsafe { x86::int8_dot_avx2(codes, scale, x) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { x86::int8_dot_avx512(codes, scale, x) },
        #[cfg(target_arch = "aarch64")]
        KernelPath::Neon => unsafe { neon::int8_dot_neon(codes, scale, x) },
        _ => int8::dot_reference(codes, scale, x),
    }
}

/// One INT4-gs64 row with quantized activations ([`q8::int4_dot_reference`]): the VNNI kernel
/// on [`KernelPath::Avx512Vnni`] (when this CPU has it), the scalar definition on every other
/// path.
pub fn int4_dot_q8_with(path: KernelPath, codes: &[u8], scales: &[u16], x: &QuantizedX) -> f32 {
    match usable(path) {
        // SAFETY: `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni => unsafe { x86::int4_dot_q8_vnni(codes, scales, x) },
        _ => q8::int4_dot_reference(codes, scales, x),
    }
}

/// One INT8 row with quantized activations ([`q8::int8_dot_reference`]): the VNNI kernel on
/// [`KernelPath::Avx512Vnni`] (when this CPU has it), the scalar definition on every other
/// path.
pub fn int8_dot_q8_with(path: KernelPath, codes: &[i8], scale: f32, x: &QuantizedX) -> f32 {
    match usable(path) {
        // SAFETY: `usable` returned the path only if the CPU has its features.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512Vnni => unsafe { x86::int8_dot_q8_vnni(codes, scale, x) },
        _ => q8::int8_dot_reference(codes, scale, x),
    }
}
