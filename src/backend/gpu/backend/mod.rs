//! `GpuBackend`: the [`Backend`] ops as WGSL dispatches on one device.
//!
//! Everything a layer computes stays in VRAM: dense weights, every layer's router, a KV
//! cache per sequence, the RoPE tables, the expert cache. Ops only record work; `read` and
//! `read_routes` (and, in partial residency, the routing readback of each layer) are the
//! only waits. With every expert resident a token is one submission and one readback.

use std::sync::Arc;

use crate::backend::{
    Backend, LayerPoint, LinearId, NormId, RouteTable, RowKind, SeqPos, check_sequence, check_step_rows,
};
use crate::config::{Activation, ModelConfig, Routing};
use crate::error::{Error, Result};
use crate::experts::{ExpertSource, ExpertStats};
use crate::model::rope::RopeFrequencies;
use crate::model::weights::DenseWeights;
use crate::sample::{PlannedLogits, SamplePlan};

use super::buffers::{BufferPool, GpuAct, GpuRoutes, Pooled, decode_routes, floats, words};
use super::context::{Bind, DeviceCounters, GBuf, Gpu};
use super::device::{self, AdapterReport};
use super::params::{AddParams, RmsNormHeadsParams, RmsNormParams};
use super::shaders::{Op, Variant};
use super::vram::{MissPolicy, VramExperts};
use super::weights::{GpuMatrix, upload_matrix, upload_vector};
use super::{GpuOptions, KvPrecision};

/// Tokens one matrix-vector workgroup serves (the `vec4` accumulators of matvec_*.wgsl).
const TOKENS_PER_GROUP: usize = 4;
/// Largest `k` router_topk.wgsl handles.
const MAX_TOP_K: usize = 16;
/// Largest head width attention.wgsl handles.
const MAX_HEAD_DIM: usize = 256;
/// VRAM left for activations, scratch buffers and the driver when budgeting the expert
/// cache and the key/value caches.
const WORKING_BYTES: u64 = 512 << 20;

mod attention;
mod dense;
mod head;
mod model;
mod moe;
mod split;
mod stats;
mod timing;

pub use dense::{TILE_TOKENS, TILED_MIN_TOKENS};
pub use split::SplitStats;
pub use stats::GpuStats;
use stats::Segment;
pub use timing::{Clock, Timed};

use attention::kv_cache;
use model::GpuLayer;
use moe::Prediction;

/// Runs the model on a GPU through wgpu.
pub struct GpuBackend {
    cfg: Arc<ModelConfig>,
    dense: Arc<DenseWeights>,
    source: Arc<dyn ExpertSource>,
    gpu: Gpu,
    layers: Vec<Arc<GpuLayer>>,
    final_norm: GBuf,
    head: Arc<GpuMatrix>,
    rope_cos: GBuf,
    rope_sin: GBuf,
    /// One key/value cache per sequence ([`Backend::add_sequence`]): `kv[seq][layer]` is
    /// that layer's (keys, values), each `[capacity, kv_dim]` and its own buffer, so a
    /// cache never exceeds one binding however many sequences there are.
    kv: Vec<Vec<(GBuf, GBuf)>>,
    /// The sequence `rope` and `attention` use ([`Backend::select_sequence`]).
    current: usize,
    /// VRAM all key/value caches together may take; `None` when the adapter reports no
    /// memory size (then only an allocation failure stops [`Backend::add_sequence`]).
    kv_room: Option<u64>,
    /// How the caches store keys and values (the KV_F16 kernel variants for F16).
    kv_precision: KvPrecision,
    /// Bytes of one layer's keys (or values) in one cache: `capacity` rows of the precision's
    /// row size.
    kv_layer_bytes: u64,
    capacity: usize,
    vram: VramExperts,
    pool: BufferPool,
    subgroup: bool,
    shader_f16: bool,
    predict: bool,
    /// What happens to experts a layer needs that are not in VRAM.
    misses: MissPolicy,
    /// The host's buffers for the experts it computes ([`MissPolicy::Cpu`]).
    host: split::HostExperts,
    pred: Option<Prediction>,
    /// Counters the kernels add to and every readback brings along ([`DEVICE_COUNTERS`]
    /// words): the prediction's hits and total, the grouped expert kernels' weight passes
    /// and pairs.
    agree: GBuf,
    /// The block being recorded is a batched step (rows of distinct sequences), set by the
    /// row-wise attention ops: its experts run per pair, as each row's solo step runs them,
    /// and its dense products with the matrix-vector kernels (never tiled).
    batched_step: bool,
    /// Prompt blocks run their dense products tiled (`dense.rs`, `TILED_MIN_TOKENS`); false
    /// with [`GpuOptions::untiled_dense`].
    tiled_dense: bool,
    /// The partial results of the fused decode attention's key splits; `None` where the
    /// model's shape has no fused decode attention.
    attn_partial: Option<GBuf>,
    in_decode: bool,
    /// The device's counters when the current forward block began.
    block_device: DeviceCounters,
    /// The part of the block being recorded, and the dispatches when it began.
    segment: Segment,
    segment_start: u64,
    /// The current decode step's dispatches by segment so far.
    step: crate::backend::DecodeCounters,
    /// Whether the current block has reached the head (it computes logits).
    step_has_head: bool,
    fail_at_readback: Option<u64>,
    dense_bytes: u64,
    stats: GpuStats,
}

/// The `activation` code of expert_gate_up.wgsl and glu.wgsl (`gated_activation` in
/// common.wgsl) for the recipe's activation.
fn activation_code(a: Activation) -> u32 {
    match a {
        Activation::ClampedSwiGlu => 0,
        Activation::SiluGlu => 1,
    }
}

/// The `rule` code of router_topk.wgsl for the recipe's routing rule.
fn routing_code(r: Routing) -> u32 {
    match r {
        Routing::TopKThenSoftmax => 0,
        Routing::SoftmaxThenTopK { renormalize: false } => 1,
        Routing::SoftmaxThenTopK { renormalize: true } => 2,
    }
}

impl GpuBackend {
    /// Opens a device and uploads the model: dense weights, routers, RoPE tables, a KV
    /// cache of `capacity` positions and the VRAM expert cache.
    pub fn new(
        cfg: Arc<ModelConfig>,
        dense: Arc<DenseWeights>,
        experts: Arc<dyn ExpertSource>,
        capacity: usize,
        opts: &GpuOptions,
    ) -> Result<Self> {
        // The kernels follow the layer recipe (QK-norm, sinks, activation, routing rule,
        // dense or MoE layers), never the family.
        let open = device::open_timed(opts.api, opts.allow_software, opts.features, opts.timestamps)?;
        let report = open.report.clone();
        // Before anything is uploaded: an F16 cache needs the adapter's f16 conversions.
        let precision = opts.kv_precision;
        if precision == KvPrecision::F16 && !report.f16_in_f32 {
            return Err(Error::Backend(format!(
                "--kv-cache f16 needs pack2x16float/unpack2x16float, which wgpu does not allow on {} (no SHADER_F16_IN_F32; Mesa's llvmpipe grants it only with SHADER_F16); use --kv-cache f32",
                report.summary()
            )));
        }
        let k = cfg.experts_per_token;
        if k == 0 || k > MAX_TOP_K || k > cfg.num_experts {
            return Err(Error::Backend(format!("experts per token {k} is outside 1..={MAX_TOP_K}")));
        }
        if cfg.head_dim > MAX_HEAD_DIM || !cfg.head_dim.is_multiple_of(2) {
            return Err(Error::Backend(format!(
                "head_dim {} is not an even width up to {MAX_HEAD_DIM}",
                cfg.head_dim
            )));
        }
        // Parameter ring: every dispatch of a decode step, with room to spare; a batched
        // step over the reserved sequences adds four dispatches per row and layer (RoPE of
        // the query and the key, the key/value store, attention).
        let sequences = opts.kv_caches.max(1);
        let ring = 64 + (32 + 4 * sequences) * cfg.num_layers + 8 * 16 + opts.extra_dispatches;
        let mut gpu = Gpu::new(open, opts.max_binding_bytes, ring)?;

        let layers = model::upload_layers(&mut gpu, &cfg, &dense)?;
        let final_norm = upload_vector(&mut gpu, "norm", &dense.final_norm)?;
        let head = Arc::new(upload_matrix(&mut gpu, "lm_head", &dense.lm_head)?);
        gpu.sync()?;

        // RoPE tables for every position the cache can hold.
        let (cos, sin) = RopeFrequencies::from_config(&cfg).table(capacity);
        let rope_cos = upload_vector(&mut gpu, "rope cos", &cos)?;
        let rope_sin = upload_vector(&mut gpu, "rope sin", &sin)?;
        drop((cos, sin));

        let too_large = || {
            Error::Backend(format!(
                "a {precision} KV cache of {capacity} positions does not fit in 64-bit sizes; use a smaller --ctx"
            ))
        };
        let kv_bytes = precision.layer_bytes(capacity, cfg.kv_dim()).ok_or_else(too_large)?;
        if kv_bytes > gpu.max_binding {
            return Err(Error::Backend(format!(
                "a {precision} KV cache of {capacity} positions needs {kv_bytes} bytes per layer, over this adapter's storage binding limit of {}; use --ctx {} or less{}",
                gpu.max_binding,
                precision.positions_within(gpu.max_binding, cfg.kv_dim()),
                if precision == KvPrecision::F32 {
                    " (or --kv-cache f16, which holds twice as many)"
                } else {
                    ""
                }
            )));
        }
        let kv = vec![kv_cache(&mut gpu, 0, cfg.num_layers, kv_bytes)?];
        let seq_kv_bytes = precision.cache_bytes(&cfg, capacity).ok_or_else(too_large)?;
        let rope_bytes = rope_cos.size + rope_sin.size;

        let dense_bytes: u64 = layers
            .iter()
            .flat_map(|l| [&l.qkv.m, &l.o.m].into_iter().chain(l.ffn.matrices()))
            .map(|m| m.byte_len())
            .sum::<u64>()
            + head.byte_len();
        let budget = match opts.vram_bytes {
            Some(b) => b,
            None => default_expert_budget(
                &report,
                dense_bytes,
                seq_kv_bytes.saturating_mul(sequences as u64),
                experts.host_bytes(),
                crate::system::total_memory(),
            ),
        };
        let vram = VramExperts::new(&mut gpu, &cfg, &experts, budget)?;
        let expert_bytes = vram.slots as u64 * vram.layout.bytes();
        let kv_room = opts.kv_vram_bytes.or_else(|| {
            report
                .device_memory
                .map(|m| (m / 10 * 8).saturating_sub(dense_bytes + expert_bytes + rope_bytes + WORKING_BYTES))
        });
        let predict = opts.predict.unwrap_or(!vram.is_full());
        let agree = gpu.buffer_init("device counters", &[0u8; DEVICE_COUNTERS * 4])?;
        let attn_partial = match attention::decode_partial_bytes(&cfg) {
            Some(bytes) => Some(gpu.buffer(
                "decode attention splits",
                bytes,
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            )?),
            None => None,
        };

        let mut b = GpuBackend {
            subgroup: gpu.open.subgroup,
            shader_f16: gpu.open.shader_f16,
            cfg,
            dense,
            source: experts,
            gpu,
            layers,
            final_norm,
            head,
            rope_cos,
            rope_sin,
            kv,
            current: 0,
            kv_room,
            kv_precision: precision,
            kv_layer_bytes: kv_bytes,
            capacity,
            vram,
            pool: BufferPool::default(),
            predict,
            misses: opts.misses,
            host: Default::default(),
            pred: None,
            agree,
            batched_step: false,
            tiled_dense: !opts.untiled_dense,
            attn_partial,
            in_decode: false,
            block_device: DeviceCounters::default(),
            segment: Segment::Start,
            segment_start: 0,
            step: Default::default(),
            step_has_head: false,
            fail_at_readback: opts.fail_at_readback,
            dense_bytes,
            stats: GpuStats::default(),
        };
        b.stats.decode.layer_dispatches = vec![0; b.cfg.num_layers];
        b.prepare_kernels()?;
        b.prepare_fused_kernels()?;
        b.gpu.sync()?;
        b.stats.full_residency = b.vram.is_full();
        tracing::info!("{}", b.describe());
        Ok(b)
    }

    fn variant(&self, op: Op) -> Variant {
        let mut v = Variant { subgroup: self.subgroup, ..Default::default() };
        if op.uses_f16() {
            v.f16 = self.shader_f16;
        }
        if op.is_expert() {
            v.experts = self.vram.layout.format;
            v.pools = self.vram.pools_per_dispatch;
        }
        if op.uses_kv_cache() {
            v.kv_f16 = self.kv_precision == KvPrecision::F16;
        }
        v
    }

    /// How this backend's key/value caches store keys and values.
    pub fn kv_precision(&self) -> KvPrecision {
        self.kv_precision
    }

    /// Bytes of one sequence's key/value cache (keys and values of every layer).
    pub fn kv_cache_bytes(&self) -> u64 {
        // Allocated, so the product fits (checked in `new`).
        self.kv_layer_bytes * 2 * self.cfg.num_layers as u64
    }

    /// Words per position of one layer's keys (or values): the kernels' `kv_row`.
    fn kv_row(&self) -> u32 {
        self.kv_precision.row_words(self.cfg.kv_dim()) as u32
    }

    /// The kernels of the model's dense matrices (one per storage format in use), in a
    /// fixed order without repeats.
    fn matrix_ops(&self) -> Vec<Op> {
        let mut ops: Vec<Op> = self
            .layers
            .iter()
            .flat_map(|l| {
                [l.qkv.m.op, l.o.m.op].into_iter().chain(l.ffn.matrices().into_iter().map(|m| m.op))
            })
            .chain([self.head.op])
            .collect();
        ops.sort_by_key(|op| op.file());
        ops.dedup();
        ops
    }

    /// The layer `l`, or an error naming it.
    fn layer(&self, l: usize) -> Result<Arc<GpuLayer>> {
        self.layers.get(l).cloned().ok_or_else(|| Error::Backend(format!("no layer {l}")))
    }

    fn prepare_kernels(&mut self) -> Result<()> {
        // Every op but the products in their unused formats.
        let mut ops: Vec<Op> = Op::ALL.into_iter().filter(|op| !op.is_matvec()).collect();
        ops.extend(self.matrix_ops());
        for op in ops {
            let v = self.variant(op);
            self.gpu.prepare(op, v)?;
            if op.has_tiled() && self.tiled_dense {
                self.gpu.prepare(op, Variant { tiled: true, ..v })?;
            }
        }
        Ok(())
    }

    /// The adapter this backend runs on.
    pub fn adapter(&self) -> &AdapterReport {
        &self.gpu.open.report
    }

    /// The expert cache's shape: slots, pool buffers, pools bound per dispatch, and
    /// whether every expert is resident.
    pub fn residency(&self) -> (usize, usize, u32, bool) {
        (self.vram.slots, self.vram.pools.len(), self.vram.pools_per_dispatch, self.vram.is_full())
    }

    /// Experts in VRAM now (every expert of the model with full residency).
    pub fn resident_experts(&self) -> usize {
        self.vram.resident()
    }

    /// Counters so far.
    pub fn stats(&self) -> GpuStats {
        self.current_stats()
    }

    /// Uploads host values as a `[rows, width]` activation (tests and tools).
    pub fn upload(&mut self, rows: usize, width: usize, values: &[f32]) -> Result<GpuAct> {
        if values.len() != rows * width {
            return Err(Error::Backend(format!("upload: {} values for [{rows}, {width}]", values.len())));
        }
        let act = self.alloc(rows, width)?;
        self.gpu.stage(bytemuck::cast_slice(values), act.buf(), 0)?;
        Ok(act)
    }

    /// Uploads a host routing decision (tests and tools).
    pub fn upload_routes(&mut self, routes: &RouteTable) -> Result<GpuRoutes> {
        let rows = routes.rows();
        let k = routes.k;
        let mut w = Vec::with_capacity(rows * 2 * k);
        for r in 0..rows {
            w.extend_from_slice(routes.row_experts(r));
            w.extend(routes.row_weights(r).iter().map(|v| v.to_bits()));
        }
        let out = self.alloc_routes(rows)?;
        self.gpu.stage(bytemuck::cast_slice(&w), out.buf(), 0)?;
        Ok(out)
    }

    fn scratch(&mut self, bytes: u64) -> Result<Pooled> {
        self.pool.take(&mut self.gpu, bytes)
    }

    /// [`Self::read_back`] of `ranges` with the device counters brought along in the same
    /// readback (no extra wait): they update the statistics, and the bytes of `ranges` are
    /// returned.
    fn read_back_with_counters(&mut self, ranges: &[(&GBuf, u64, u64)]) -> Result<Vec<u8>> {
        let agree = self.agree.clone();
        let mut all = ranges.to_vec();
        all.push((&agree, 0, (DEVICE_COUNTERS * 4) as u64));
        let mut bytes = self.read_back(&all)?;
        let at = bytes.len() - DEVICE_COUNTERS * 4;
        let c = words(&bytes[at..]);
        self.stats.predicted_hits = c[0] as u64;
        self.stats.predicted_total = c[1] as u64;
        self.stats.expert_passes = c[2] as u64;
        self.stats.grouped_pairs = c[3] as u64;
        bytes.truncate(at);
        Ok(bytes)
    }

    fn read_back(&mut self, ranges: &[(&GBuf, u64, u64)]) -> Result<Vec<u8>> {
        if self.fail_at_readback.is_some_and(|n| self.gpu.counters().readbacks + 1 >= n) {
            return Err(Error::Backend("device lost (injected for testing)".into()));
        }
        let bytes = self.gpu.read_back(ranges)?;
        if self.in_decode {
            self.stats.decode_readbacks += 1;
        }
        Ok(bytes)
    }
}

/// Words of the device counters every readback brings along (`GpuBackend::agree`).
pub(super) const DEVICE_COUNTERS: usize = 4;

/// The default VRAM budget for experts: 80% of the adapter's memory
/// ([`AdapterReport::device_memory`]) minus the dense weights, the key/value caches
/// (`kv_bytes`, all the slots asked for) and 512 MiB of working space; 2 GiB when the API does
/// not report memory.
///
/// On unified memory (the adapter's memory is the system's RAM) the experts copied to the GPU
/// and the RAM tier's (`host_expert_bytes`, [`ExpertSource::host_bytes`]) are held twice in
/// the same RAM, as are the dense weights (mapped on the host, copied to the GPU), so the
/// budget is also at most what the machine's RAM (`total_ram`) has left after the system
/// reserve ([`crate::system::reserve`]), the RAM tier, both copies of the dense weights, the
/// caches and the working space. Software adapters also share the system's RAM: at most a
/// quarter of it.
pub fn default_expert_budget(
    report: &AdapterReport,
    dense_bytes: u64,
    kv_bytes: u64,
    host_expert_bytes: u64,
    total_ram: Option<u64>,
) -> u64 {
    let mut budget = match report.device_memory {
        Some(m) => (m / 10 * 8).saturating_sub(dense_bytes + kv_bytes + WORKING_BYTES),
        None => 2 << 30,
    };
    let total = total_ram.unwrap_or(8 << 30);
    if report.unified_memory {
        let held = [
            crate::system::reserve(total),
            host_expert_bytes,
            dense_bytes,
            dense_bytes,
            kv_bytes,
            WORKING_BYTES,
        ]
        .into_iter()
        .fold(0u64, u64::saturating_add);
        budget = budget.min(total.saturating_sub(held));
    }
    if report.is_software() {
        budget = budget.min(total / 4);
    }
    budget
}

fn check_shape(what: &str, act: &GpuAct, rows: usize, width: usize) -> Result<()> {
    crate::backend::check_shape(what, (act.rows(), act.width()), (rows, width))
}

impl Backend for GpuBackend {
    type Act = GpuAct;
    type Routes = GpuRoutes;

    fn describe(&self) -> String {
        let r = self.adapter();
        format!(
            "gpu {} ({:?}, {:?}, {}); kernels: {}{}; {} KV cache; experts in VRAM: {} ({} of {} slots); {}",
            r.name,
            r.backend,
            r.device_type,
            r.driver,
            if self.subgroup { "subgroup reductions" } else { "workgroup reductions" },
            if self.shader_f16 { ", f16 loads" } else { "" },
            self.kv_precision,
            if self.vram.is_full() { "all resident" } else { "LRU" },
            self.vram.slots,
            self.vram.shape().0 * self.vram.shape().1,
            self.source.describe()
        )
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn alloc(&mut self, rows: usize, width: usize) -> Result<GpuAct> {
        let mem = self.pool.take(&mut self.gpu, (rows * width * 4) as u64)?;
        Ok(GpuAct::new(rows, width, mem))
    }

    fn alloc_routes(&mut self, rows: usize) -> Result<GpuRoutes> {
        let k = self.cfg.experts_per_token;
        let mem = self.pool.take(&mut self.gpu, (rows * 2 * k * 4) as u64)?;
        Ok(GpuRoutes::new(rows, k, mem))
    }

    fn embed(&mut self, ids: &[u32], out: &mut GpuAct) -> Result<()> {
        let h = self.cfg.hidden_size;
        check_shape("embed", out, ids.len(), h)?;
        // The table stays on the host (it is as large as the head and needs one row per
        // token): its rows are decoded here and staged in order with the recorded work.
        let mut rows = vec![0.0f32; ids.len() * h];
        for (row, &id) in rows.chunks_mut(h).zip(ids) {
            if id as usize >= self.cfg.vocab_size {
                return Err(Error::invalid(format!("token ID {id} is outside the vocabulary")));
            }
            self.dense.embed.row_to_f32(id as usize, row);
        }
        // A new forward block begins: close the previous one's counts.
        self.begin_block(ids.len());
        self.gpu.stage(bytemuck::cast_slice(&rows), out.buf(), 0)?;
        if let Some(p) = self.pred.as_mut() {
            p.valid_for = None;
        }
        Ok(())
    }

    fn rms_norm(&mut self, norm: NormId, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        check_shape("rms_norm", out, x.rows(), x.width())?;
        self.enter(match norm {
            NormId::Attention(l) | NormId::Mlp(l) | NormId::Query(l) | NormId::Key(l) => Segment::Layer(l),
            NormId::Final => Segment::Head,
        });
        let w = match norm {
            NormId::Attention(l) => self.layers[l].attn_norm.clone(),
            NormId::Mlp(l) => self.layers[l].mlp_norm.clone(),
            NormId::Final => self.final_norm.clone(),
            NormId::Query(_) | NormId::Key(_) => {
                return Err(Error::Backend(
                    "rms_norm: QK-norm weights are applied with rms_norm_heads".into(),
                ));
            }
        };
        let (nx, ny) = self.gpu.grid(x.rows() as u64)?;
        let params =
            RmsNormParams { rows: x.rows() as u32, width: x.width() as u32, eps: self.cfg.rms_norm_eps, nx };
        let v = self.variant(Op::RmsNorm);
        self.gpu.dispatch(Op::RmsNorm, v, &params, &[x.bind(), out.bind(), Bind::whole(&w)], (nx, ny, 1))
    }

    fn rms_norm_heads(&mut self, norm: NormId, x: &mut GpuAct) -> Result<()> {
        let d = self.cfg.head_dim;
        let (l, key) = match norm {
            NormId::Query(l) => (l, false),
            NormId::Key(l) => (l, true),
            NormId::Attention(_) | NormId::Mlp(_) | NormId::Final => {
                return Err(Error::Backend(format!(
                    "rms_norm_heads: {norm:?} is not a QK-norm weight (use rms_norm)"
                )));
            }
        };
        if !x.width().is_multiple_of(d) {
            return Err(Error::Backend(format!(
                "rms_norm_heads: width {} is not whole heads of {d}",
                x.width()
            )));
        }
        let layer = self.layer(l)?;
        self.enter(Segment::Layer(l));
        let (q, k) = layer.qk_norm.as_ref().ok_or_else(|| {
            Error::Backend(format!("layer {l} has no QK-norm weights (the recipe has no QK-norm)"))
        })?;
        let w = if key { k } else { q };
        let slices = x.rows() * (x.width() / d);
        let (nx, ny) = self.gpu.grid(slices as u64)?;
        let params =
            RmsNormHeadsParams { slices: slices as u32, head_dim: d as u32, eps: self.cfg.rms_norm_eps, nx };
        let v = self.variant(Op::RmsNormHeads);
        self.gpu.dispatch(Op::RmsNormHeads, v, &params, &[x.bind(), Bind::whole(w)], (nx, ny, 1))
    }

    fn dense_mlp(&mut self, layer: usize, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        self.enter(Segment::Layer(layer));
        self.run_dense_mlp(layer, x, out)
    }

    fn linear(&mut self, id: LinearId, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        self.enter(match id {
            LinearId::Q(l) | LinearId::K(l) | LinearId::V(l) | LinearId::O(l) | LinearId::Router(l) => {
                Segment::Layer(l)
            }
            LinearId::LmHead => Segment::Head,
        });
        self.run_linear(id, x, out)
    }

    fn linear_qkv(
        &mut self,
        layer: usize,
        x: &GpuAct,
        q: &mut GpuAct,
        k: &mut GpuAct,
        v: &mut GpuAct,
    ) -> Result<()> {
        self.enter(Segment::Layer(layer));
        self.run_linear_qkv(layer, x, q, k, v)
    }

    fn fused_attention(&mut self, layer: usize, start_pos: usize, x: &mut GpuAct) -> Result<bool> {
        // A prompt block runs the ops (its rows attend to each other's keys).
        if x.rows() != 1 {
            return Ok(false);
        }
        if start_pos >= self.capacity {
            return Err(Error::ContextFull { needed: start_pos + 1, capacity: self.capacity });
        }
        self.enter(Segment::Layer(layer));
        self.run_fused_attention(layer, &[SeqPos { seq: self.current, pos: start_pos }], x)
    }

    fn fused_attention_rows(&mut self, layer: usize, rows: &[SeqPos], x: &mut GpuAct) -> Result<bool> {
        check_step_rows(x.rows(), rows, self.kv.len(), self.capacity)?;
        self.batched_step = true;
        self.enter(Segment::Layer(layer));
        self.run_fused_attention(layer, rows, x)
    }

    fn fused_moe(&mut self, layer: usize, x: &mut GpuAct, routes: &mut GpuRoutes) -> Result<bool> {
        self.enter(Segment::Layer(layer));
        self.run_fused_moe(layer, x, routes)
    }

    fn fused_head(&mut self, x: &GpuAct, logits: &mut GpuAct) -> Result<bool> {
        // The final norm runs inside the head's product (matvec NORM variant).
        self.enter(Segment::Head);
        let (head, norm) = (Arc::clone(&self.head), self.final_norm.clone());
        self.matvec_fused(&head, None, x, logits, Some(&norm), false)?;
        Ok(true)
    }

    fn argmax_rows(&mut self, logits: &GpuAct, first_position: usize) -> Result<Vec<u32>> {
        self.enter(Segment::Head);
        self.run_argmax(logits, first_position)
    }

    fn reduce_logits(&mut self, logits: &GpuAct, row: usize, plan: &SamplePlan) -> Result<PlannedLogits> {
        self.enter(Segment::Head);
        self.run_reduce(logits, row, plan)
    }

    fn rope(&mut self, x: &mut GpuAct, start_pos: usize) -> Result<()> {
        self.run_rope(x, start_pos)
    }

    fn rope_rows(&mut self, x: &mut GpuAct, rows: &[SeqPos]) -> Result<()> {
        self.batched_step = true;
        self.run_rope_rows(x, rows)
    }

    fn attention(
        &mut self,
        layer: usize,
        start_pos: usize,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        out: &mut GpuAct,
    ) -> Result<()> {
        self.enter(Segment::Layer(layer));
        self.run_attention(layer, start_pos, q, k, v, out)
    }

    fn attention_rows(
        &mut self,
        layer: usize,
        rows: &[SeqPos],
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        out: &mut GpuAct,
    ) -> Result<()> {
        self.enter(Segment::Layer(layer));
        self.run_attention_rows(layer, rows, q, k, v, out)
    }

    fn add_sequence(&mut self) -> Result<usize> {
        let cfg = Arc::clone(&self.cfg);
        let layer_bytes = self.kv_layer_bytes;
        let need = self.kv_cache_bytes();
        let seq = self.kv.len();
        if let Some(room) = self.kv_room {
            let used = need.saturating_mul(seq as u64);
            if used.saturating_add(need) > room {
                return Err(Error::Backend(format!(
                    "another {} key/value cache ({} positions x {} layers) needs {:.1} MiB of VRAM; {:.1} MiB of the {:.1} MiB left for key/value caches after the weights and the expert cache is free ({seq} sequence(s) hold {:.1} MiB); use a smaller --ctx, fewer --parallel slots{} or a smaller --vram-gb",
                    self.kv_precision,
                    self.capacity,
                    cfg.num_layers,
                    mib(need),
                    mib(room.saturating_sub(used)),
                    mib(room),
                    mib(used),
                    if self.kv_precision == KvPrecision::F32 {
                        ", --kv-cache f16 (half the bytes)"
                    } else {
                        ""
                    }
                )));
            }
        }
        let cache = kv_cache(&mut self.gpu, seq, cfg.num_layers, layer_bytes)?;
        self.kv.push(cache);
        Ok(seq)
    }

    fn select_sequence(&mut self, seq: usize) -> Result<()> {
        check_sequence(seq, self.kv.len())?;
        self.current = seq;
        Ok(())
    }

    fn route(&mut self, layer: usize, x: &GpuAct, routes: &mut GpuRoutes) -> Result<()> {
        self.enter(Segment::Layer(layer));
        self.run_route(layer, x, routes)
    }

    fn experts(&mut self, layer: usize, x: &GpuAct, routes: &GpuRoutes, out: &mut GpuAct) -> Result<()> {
        self.enter(Segment::Layer(layer));
        self.run_experts(layer, x, routes, out)
    }

    fn add(&mut self, x: &mut GpuAct, y: &GpuAct) -> Result<()> {
        check_shape("add", x, y.rows(), y.width())?;
        let n = y.rows() * y.width();
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let v = self.variant(Op::Add);
        let params = AddParams { n: n as u32, nx, _pad: [0; 2] };
        self.gpu.dispatch(Op::Add, v, &params, &[y.bind(), x.bind()], (nx, ny, 1))
    }

    fn copy_rows(&mut self, src: &GpuAct, first_row: usize, dst: &mut GpuAct) -> Result<()> {
        if dst.width() != src.width() || first_row + dst.rows() > src.rows() {
            return Err(Error::Backend("copy_rows: rows out of range".into()));
        }
        // The forward pass selects the rows whose logits it wants right before the head.
        self.enter(Segment::Head);
        let w = src.width();
        self.copy_words(src.buf(), first_row * w, dst.buf(), 0, dst.rows() * w)
    }

    fn read(&mut self, x: &GpuAct) -> Result<Vec<f32>> {
        // The prediction counters ride along with every readback (8 bytes, no extra wait).
        let bytes = self.read_back_with_counters(&[(x.buf(), 0, x.bytes())])?;
        Ok(floats(&bytes))
    }

    fn read_routes(&mut self, routes: &GpuRoutes) -> Result<RouteTable> {
        let bytes = self.read_back(&[(routes.buf(), 0, routes.bytes())])?;
        Ok(decode_routes(&bytes, routes.rows(), routes.k()))
    }

    /// Nothing: this backend predicts inside [`route`](Backend::route), with router L+1 on
    /// the device over layer L's normalized MoE input, and starts the predicted reads when
    /// it reads layer L's routing back (`GpuOptions::predict` decides whether it runs).
    fn predict_next(&mut self, _next: usize, _at: LayerPoint, _rows: RowKind, _x: &GpuAct) -> Result<()> {
        Ok(())
    }

    fn expert_stats(&self) -> ExpertStats {
        self.source.stats()
    }

    fn report(&self) -> Vec<String> {
        self.report_lines()
    }

    fn decode_counters(&self) -> Option<crate::backend::DecodeCounters> {
        Some(self.stats().decode)
    }
}

/// Bytes as MiB, for messages.
fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// The error for a part of a layer that the recipe asks for and the weights lack.
fn missing(layer: &str, what: &str) -> Error {
    Error::Backend(format!("{layer}: the layer recipe has {what} but the weights have none"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn adapter(
        device_type: wgpu::DeviceType,
        device_memory: Option<u64>,
        unified_memory: bool,
    ) -> AdapterReport {
        AdapterReport {
            name: "test".into(),
            backend: wgpu::Backend::Metal,
            device_type,
            driver: String::new(),
            vendor_device: (0, 0),
            device_memory,
            unified_memory,
            limits: wgpu::Limits::default(),
            shader_f16: false,
            subgroup: false,
            timestamps: false,
            f16_in_f32: true,
        }
    }

    #[test]
    fn the_expert_budget_counts_the_ram_tier_on_unified_memory() {
        let (dense, kv, ram) = (2 * GIB, 3 * GIB, Some(32 * GIB));
        // A discrete GPU with 24 GiB: 80% minus dense, caches and working space, whatever
        // the RAM tier holds.
        let discrete = adapter(wgpu::DeviceType::DiscreteGpu, Some(24 * GIB), false);
        let device_budget = 24 * GIB / 10 * 8 - dense - kv - WORKING_BYTES;
        assert_eq!(default_expert_budget(&discrete, dense, kv, 12 * GIB, ram), device_budget);
        // A 32 GiB Apple silicon machine (working set 24 GiB): the RAM tier's 12 GiB of
        // experts, both copies of the dense weights, the caches, the working space and the
        // 4 GiB reserve come out of the same 32 GiB.
        let apple = adapter(wgpu::DeviceType::IntegratedGpu, Some(24 * GIB), true);
        let room = 32 * GIB - 4 * GIB - 12 * GIB - 2 * dense - kv - WORKING_BYTES;
        assert!(room < device_budget);
        assert_eq!(default_expert_budget(&apple, dense, kv, 12 * GIB, ram), room);
        // With a small RAM tier (--ram-gb) the device's own budget is the bound again.
        assert_eq!(default_expert_budget(&apple, dense, kv, GIB, ram), device_budget);
        // A RAM tier as large as the machine leaves nothing (the floor of one token's
        // experts is applied by the expert cache, `VramExperts::new`).
        assert_eq!(default_expert_budget(&apple, dense, kv, 32 * GIB, ram), 0);
        // No memory query (GL): 2 GiB, still within the room on unified memory.
        let gl = adapter(wgpu::DeviceType::IntegratedGpu, None, true);
        assert_eq!(default_expert_budget(&gl, dense, kv, 12 * GIB, ram), 2 * GIB);
        assert_eq!(default_expert_budget(&gl, dense, kv, 12 * GIB, Some(16 * GIB)), 0);
        // A software adapter: at most a quarter of RAM too.
        let cpu = adapter(wgpu::DeviceType::Cpu, Some(64 * GIB), true);
        assert_eq!(default_expert_budget(&cpu, dense, kv, GIB, ram), 8 * GIB);
    }
}
