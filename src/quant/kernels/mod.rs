//! Run-time selection of the row-dot kernels: the scalar reference everywhere, and SIMD
//! variants where the CPU has them. `PICCHIO_KERNELS=scalar` (or `avx2`, `avx512`, ...)
//! forces a path, e.g. to compare against the reference.

use std::sync::OnceLock;

use crate::quant::{int4, int8, reference};

/// A family of kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelPath {
    /// Plain Rust loops (the reference definitions).
    Scalar,
    /// x86-64 AVX2 + FMA.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL).
    Avx512,
    /// x86-64 AVX-512 with VNNI.
    Avx512Vnni,
    /// aarch64 NEON.
    Neon,
}

impl KernelPath {
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

    /// Every path this CPU can run, best last.
    pub fn available() -> Vec<KernelPath> {
        let mut v = vec![KernelPath::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(KernelPath::Avx2);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                v.push(KernelPath::Neon);
            }
        }
        v.retain(|p| implemented(*p));
        v
    }
}

/// Whether this build has kernels for `path`.
fn implemented(path: KernelPath) -> bool {
    matches!(path, KernelPath::Scalar)
}

static SELECTED: OnceLock<KernelPath> = OnceLock::new();

/// The path in use: `PICCHIO_KERNELS` if set and available, else the best available.
pub fn selected() -> KernelPath {
    *SELECTED.get_or_init(|| {
        let available = KernelPath::available();
        match std::env::var("PICCHIO_KERNELS") {
            Ok(name) => match available.iter().find(|p| p.name() == name) {
                Some(p) => *p,
                None => {
                    tracing::warn!(
                        "PICCHIO_KERNELS={name} is not available here (have: {}); using {}",
                        available.iter().map(|p| p.name()).collect::<Vec<_>>().join(", "),
                        available.last().map_or("scalar", |p| p.name())
                    );
                    *available.last().unwrap_or(&KernelPath::Scalar)
                }
            },
            Err(_) => *available.last().unwrap_or(&KernelPath::Scalar),
        }
    })
}

/// `sum_i w[i] x[i]`.
#[inline]
pub fn f32_dot(w: &[f32], x: &[f32]) -> f32 {
    reference::dot_f32(w, x)
}

/// `sum_i bf16(w[i]) x[i]`.
#[inline]
pub fn bf16_dot(w: &[u16], x: &[f32]) -> f32 {
    reference::dot_bf16(w, x)
}

/// One INT4-gs64 row with `x` (zero-padded to whole groups).
#[inline]
pub fn int4_dot(codes: &[u8], scales: &[u16], x: &[f32]) -> f32 {
    int4::dot_reference(codes, scales, x)
}

/// One INT8 row (with its scale) with `x`.
#[inline]
pub fn int8_dot(codes: &[i8], scale: f32, x: &[f32]) -> f32 {
    int8::dot_reference(codes, scale, x)
}
