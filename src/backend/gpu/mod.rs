//! The GPU backend on wgpu: the whole forward pass as WGSL compute kernels, with the
//! dense weights, every layer's router, the KV cache and an expert cache in VRAM.
//!
//! | module | job |
//! |---|---|
//! | [`device`] | adapters: choice, listing (`picchio devices`), opening, fault collection |
//! | [`shaders`] | the WGSL sources in `shaders/`, their variants, the preprocessor |
//! | [`params`] | each kernel's uniform parameters: one struct for Rust and WGSL |
//! | [`context`] | buffers, kernels, recording, the parameter ring, readbacks |
//! | [`buffers`] | pooled activations and routing buffers |
//! | [`kv`] | the key/value cache's precision (F32 or F16) and its sizes |
//! | [`weights`] | dense matrices in their container format, split by rows |
//! | [`vram`] | the VRAM expert cache: slot pools, slot table, what goes where |
//! | [`promote`] | the background thread that writes promoted experts into their slots |
//! | [`backend`] | [`GpuBackend`], the [`crate::backend::Backend`] ops as dispatches |
//!
//! See `docs/gpu.md` for the design and its limits.

pub mod backend;
pub mod buffers;
pub mod context;
pub mod device;
pub mod kv;
pub mod params;
pub mod promote;
pub mod shaders;
pub mod vram;
pub mod weights;

pub use backend::{Clock, GpuBackend, GpuStats, SplitStats, TILE_TOKENS, TILED_MIN_TOKENS, Timed};
pub use device::{AdapterReport, FeatureUse, GpuApi, list_adapters};
pub use kv::KvPrecision;
pub use vram::MissPolicy;

/// How to open and use the GPU.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// The graphics API (`--gpu-backend`); `None`: `WGPU_BACKEND`, else any.
    pub api: Option<GpuApi>,
    /// Accept software adapters (CPU type, e.g. lavapipe). `--device gpu` does; `auto`
    /// does not, since the CPU backend is faster than a software GPU.
    pub allow_software: bool,
    /// Optional features to use where present.
    pub features: FeatureUse,
    /// VRAM for the expert cache in bytes (`--vram-gb`); `None`: a default from the adapter.
    pub vram_bytes: Option<u64>,
    /// Lowers the storage binding limit (to exercise split matrices and pools in tests).
    pub max_binding_bytes: Option<u64>,
    /// Run the resident-router prediction; `None`: only when not every expert is resident.
    pub predict: Option<bool>,
    /// What happens to the experts a layer needs that are not in VRAM (`--expert-misses`):
    /// computed on the CPU (the default) or uploaded first.
    pub misses: MissPolicy,
    /// Testing: fail as a lost device would at this readback (exercises the CPU fallback).
    pub fail_at_readback: Option<u64>,
    /// Key/value caches (sequences, the slots of a server) the default expert budget and
    /// the parameter ring leave room for; 0 counts as 1. More can still be added while
    /// VRAM lasts ([`crate::backend::Backend::add_sequence`]).
    pub kv_caches: usize,
    /// VRAM all key/value caches together may take, in bytes; `None`: what the adapter's
    /// memory leaves after the weights, the expert cache and working space (no limit when
    /// the API reports no memory size). Tests use it to exercise the refusal.
    pub kv_vram_bytes: Option<u64>,
    /// How keys and values are stored (`--kv-cache`): F32 (the default) or F16, half the
    /// bytes. F16 needs the adapter's `pack2x16float` ([`AdapterReport::f16_in_f32`]).
    pub kv_precision: KvPrecision,
    /// Enable TIMESTAMP_QUERY where the adapter has it (`picchio bench-gpu` times kernels
    /// on the GPU with it).
    pub timestamps: bool,
    /// Extra dispatches the parameter ring holds before a submission (a benchmark records
    /// many calls into one submission).
    pub extra_dispatches: usize,
    /// Run every dense product with the matrix-vector kernels, prompt blocks too (no tiled
    /// products, the TILED kernel variants): to compare the two in tests and measurements.
    pub untiled_dense: bool,
}

/// Opens the adapter `opts` would use and describes it (no model needed): for tests and
/// for `--device auto` to decide early.
pub fn probe(opts: &GpuOptions) -> crate::error::Result<AdapterReport> {
    device::open(opts.api, opts.allow_software, opts.features).map(|d| d.report)
}
