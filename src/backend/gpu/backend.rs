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
use crate::model::weights::{DenseWeights, FeedForward};

use super::GpuOptions;
use super::buffers::{BufferPool, GpuAct, GpuRoutes, Pooled, decode_routes, floats, words};
use super::context::{Bind, DeviceCounters, GBuf, Gpu, STORAGE_ALIGN};
use super::device::{self, AdapterReport};
use super::shaders::{Op, Variant};
use super::vram::{VramExperts, VramStats};
use super::weights::{GpuMatrix, upload_matrix, upload_vector};

/// Tokens one matrix-vector workgroup serves (the `vec4` accumulators of matvec_*.wgsl).
const TOKENS_PER_GROUP: usize = 4;
/// Largest `k` router_topk.wgsl handles.
const MAX_TOP_K: usize = 16;
/// Largest head width attention.wgsl handles.
const MAX_HEAD_DIM: usize = 256;
/// VRAM left for activations, scratch buffers and the driver when budgeting the expert
/// cache and the key/value caches.
const WORKING_BYTES: u64 = 512 << 20;

struct GpuLinear {
    m: GpuMatrix,
    bias: Option<GBuf>,
}

/// The feed-forward block of a layer on the device.
enum GpuFfn {
    /// A MoE layer: its router (the experts live in the VRAM expert cache).
    Moe { router: GpuLinear },
    /// A dense gated MLP in the experts' layout (gate and up rows interleaved), in its
    /// dense weight format: run by the matrix-vector kernels and glu.wgsl.
    Dense { gate_up: GpuLinear, down: GpuLinear },
}

impl GpuFfn {
    /// The matrices of the block.
    fn matrices(&self) -> Vec<&GpuMatrix> {
        match self {
            GpuFfn::Moe { router } => vec![&router.m],
            GpuFfn::Dense { gate_up, down } => vec![&gate_up.m, &down.m],
        }
    }
}

struct GpuLayer {
    attn_norm: GBuf,
    mlp_norm: GBuf,
    q: GpuLinear,
    k: GpuLinear,
    v: GpuLinear,
    o: GpuLinear,
    /// One sink logit per query head, in families with sinks.
    sinks: Option<GBuf>,
    /// QK-norm weights (query, key), in families with QK-norm.
    qk_norm: Option<(GBuf, GBuf)>,
    ffn: GpuFfn,
}

impl GpuLayer {
    /// The router, on a MoE layer.
    fn router(&self) -> Option<&GpuLinear> {
        match &self.ffn {
            GpuFfn::Moe { router } => Some(router),
            GpuFfn::Dense { .. } => None,
        }
    }
}

/// The routing prediction for the next layer, kept across `route` calls.
struct Prediction {
    rows: usize,
    /// Ping-pong by layer parity: `bufs[l % 2]` holds the prediction for layer `l`.
    bufs: [GpuRoutes; 2],
    /// The layer the latest prediction is for.
    valid_for: Option<usize>,
}

/// Where the rows of an attention dispatch sit: `rows` rows of the activations from row
/// `row0`, in the cache of sequence `seq` from position `start_pos`.
#[derive(Clone, Copy)]
struct Placed {
    seq: usize,
    row0: usize,
    rows: usize,
    start_pos: usize,
}

/// Counters of a GPU run (what `--stats` prints).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuStats {
    /// Device work: submissions, dispatches, readbacks.
    pub device: DeviceCounters,
    /// Positions run (prompt and generated).
    pub positions: u64,
    /// Forward calls of a single position (decode steps).
    pub decode_steps: u64,
    /// Readbacks during those decode steps.
    pub decode_readbacks: u64,
    /// Submissions during those decode steps.
    pub decode_submissions: u64,
    /// Readbacks of a layer's routing (partial residency).
    pub route_readbacks: u64,
    /// VRAM expert cache counters.
    pub vram: VramStats,
    /// Experts of the next layer that the resident-router prediction got right.
    pub predicted_hits: u64,
    /// Experts the predicted layers used.
    pub predicted_total: u64,
    /// True when every expert is resident.
    pub full_residency: bool,
}

impl GpuStats {
    /// Readbacks per decoded position.
    pub fn readbacks_per_decode_step(&self) -> f64 {
        self.decode_readbacks as f64 / self.decode_steps.max(1) as f64
    }

    /// Share of next-layer experts predicted correctly (None before any prediction).
    pub fn prediction_accuracy(&self) -> Option<f64> {
        (self.predicted_total > 0).then(|| self.predicted_hits as f64 / self.predicted_total as f64)
    }
}

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
    capacity: usize,
    vram: VramExperts,
    pool: BufferPool,
    subgroup: bool,
    shader_f16: bool,
    predict: bool,
    pred: Option<Prediction>,
    agree: GBuf,
    in_decode: bool,
    /// Submissions when the current forward block began.
    block_start: u64,
    fail_at_readback: Option<u64>,
    dense_bytes: u64,
    stats: GpuStats,
}

fn bits(v: f32) -> u32 {
    v.to_bits()
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
        let open = device::open(opts.api, opts.allow_software, opts.features)?;
        let report = open.report.clone();
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
        let ring = 64 + (32 + 4 * sequences) * cfg.num_layers + 8 * 16;
        let mut gpu = Gpu::new(open, opts.max_binding_bytes, ring)?;

        let lin = |gpu: &mut Gpu, name: &str, l: &crate::model::weights::Linear| -> Result<GpuLinear> {
            Ok(GpuLinear {
                m: upload_matrix(gpu, name, &l.weight)?,
                bias: match &l.bias {
                    Some(b) => Some(upload_vector(gpu, &format!("{name}.bias"), b)?),
                    None => None,
                },
            })
        };
        let recipe = cfg.recipe;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, w) in dense.layers.iter().enumerate() {
            let p = format!("layers.{l}");
            let sinks = match (recipe.attention_sinks, &w.attn.sinks) {
                (true, Some(s)) => Some(upload_vector(&mut gpu, &format!("{p}.sinks"), s)?),
                (false, _) => None,
                (true, None) => return Err(missing(&p, "attention sinks")),
            };
            let qk_norm = match (recipe.qk_norm, &w.attn.q_norm, &w.attn.k_norm) {
                (true, Some(q), Some(k)) => Some((
                    upload_vector(&mut gpu, &format!("{p}.q_norm"), q)?,
                    upload_vector(&mut gpu, &format!("{p}.k_norm"), k)?,
                )),
                (false, _, _) => None,
                (true, _, _) => return Err(missing(&p, "QK-norm weights")),
            };
            let ffn = match &w.ffn {
                FeedForward::Moe { router } => {
                    GpuFfn::Moe { router: lin(&mut gpu, &format!("{p}.router"), router)? }
                }
                FeedForward::Dense(mlp) => {
                    mlp.check_dims(cfg.hidden_size, cfg.dense_intermediate_size, &format!("{p}.mlp"))?;
                    GpuFfn::Dense {
                        gate_up: GpuLinear {
                            m: upload_matrix(&mut gpu, &format!("{p}.mlp.gate_up"), &mlp.gate_up)?,
                            bias: Some(upload_vector(
                                &mut gpu,
                                &format!("{p}.mlp.gate_up.bias"),
                                &mlp.gate_up_bias,
                            )?),
                        },
                        down: GpuLinear {
                            m: upload_matrix(&mut gpu, &format!("{p}.mlp.down_proj"), &mlp.down)?,
                            bias: Some(upload_vector(
                                &mut gpu,
                                &format!("{p}.mlp.down_proj.bias"),
                                &mlp.down_bias,
                            )?),
                        },
                    }
                }
            };
            layers.push(Arc::new(GpuLayer {
                attn_norm: upload_vector(&mut gpu, &format!("{p}.input_layernorm"), &w.attn_norm)?,
                mlp_norm: upload_vector(&mut gpu, &format!("{p}.post_attention_layernorm"), &w.mlp_norm)?,
                q: lin(&mut gpu, &format!("{p}.q_proj"), &w.attn.q)?,
                k: lin(&mut gpu, &format!("{p}.k_proj"), &w.attn.k)?,
                v: lin(&mut gpu, &format!("{p}.v_proj"), &w.attn.v)?,
                o: lin(&mut gpu, &format!("{p}.o_proj"), &w.attn.o)?,
                sinks,
                qk_norm,
                ffn,
            }));
        }
        let final_norm = upload_vector(&mut gpu, "norm", &dense.final_norm)?;
        let head = Arc::new(upload_matrix(&mut gpu, "lm_head", &dense.lm_head)?);
        gpu.sync()?;

        // RoPE tables for every position the cache can hold.
        let (cos, sin) = RopeFrequencies::from_config(&cfg).table(capacity);
        let rope_cos = upload_vector(&mut gpu, "rope cos", &cos)?;
        let rope_sin = upload_vector(&mut gpu, "rope sin", &sin)?;
        drop((cos, sin));

        let kv_bytes = (capacity * cfg.kv_dim() * 4) as u64;
        if kv_bytes > gpu.max_binding {
            return Err(Error::Backend(format!(
                "a KV cache of {capacity} positions needs {kv_bytes} bytes per layer, over this adapter's storage binding limit of {}; use --ctx {} or less",
                gpu.max_binding,
                gpu.max_binding / (cfg.kv_dim() as u64 * 4)
            )));
        }
        let kv = vec![kv_cache(&mut gpu, 0, cfg.num_layers, kv_bytes)?];
        let seq_kv_bytes = 2 * kv_bytes * cfg.num_layers as u64;
        let rope_bytes = rope_cos.size + rope_sin.size;

        let dense_bytes: u64 = layers
            .iter()
            .flat_map(|l| [&l.q.m, &l.k.m, &l.v.m, &l.o.m].into_iter().chain(l.ffn.matrices()))
            .map(|m| m.byte_len())
            .sum::<u64>()
            + head.byte_len();
        let budget = match opts.vram_bytes {
            Some(b) => b,
            None => default_expert_budget(
                &report,
                dense_bytes,
                sequences as u64 * seq_kv_bytes,
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
        let agree = gpu.buffer_init("prediction counters", &[0u8; 8])?;

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
            capacity,
            vram,
            pool: BufferPool::default(),
            predict,
            pred: None,
            agree,
            in_decode: false,
            block_start: 0,
            fail_at_readback: opts.fail_at_readback,
            dense_bytes,
            stats: GpuStats::default(),
        };
        b.prepare_kernels()?;
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
        v
    }

    fn prepare_kernels(&mut self) -> Result<()> {
        let mut ops = vec![
            Op::RmsNorm,
            Op::RmsNormHeads,
            Op::Rope,
            Op::Attention,
            Op::RouterTopk,
            Op::RouteAgree,
            Op::Add,
            Op::MoeCombine,
            Op::ExpertGateUp,
            Op::ExpertDown,
            Op::KvStore,
            Op::Copy,
            Op::Glu,
        ];
        for l in &self.layers {
            for m in [&l.q.m, &l.k.m, &l.v.m, &l.o.m].into_iter().chain(l.ffn.matrices()) {
                ops.push(m.op);
            }
        }
        ops.push(self.head.op);
        ops.dedup();
        for op in ops {
            let v = self.variant(op);
            self.gpu.prepare(op, v)?;
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

    /// Counters so far.
    pub fn stats(&self) -> GpuStats {
        let mut s = self.stats.clone();
        s.device = self.gpu.counters();
        if self.in_decode {
            s.decode_submissions += s.device.submissions - self.block_start;
        }
        s.vram = self.vram.stats;
        s
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

    /// `out = W x + b` over every row block of `m`. An output larger than one binding is
    /// computed a group of tokens at a time through a scratch buffer.
    fn matvec(&mut self, m: &GpuMatrix, bias: Option<&GBuf>, x: &GpuAct, out: &GpuAct) -> Result<()> {
        if x.width() != m.cols || out.width() != m.rows || out.rows() != x.rows() {
            return Err(Error::Backend(format!(
                "linear: [{}, {}] x [{}, {}] -> [{}, {}]",
                x.rows(),
                x.width(),
                m.rows,
                m.cols,
                out.rows(),
                out.width()
            )));
        }
        let row_bytes = (m.rows * 4) as u64;
        if out.bytes() <= self.gpu.max_binding {
            return self.matvec_into(m, bias, x, out.buf(), out.bytes());
        }
        let per = (self.gpu.max_binding / row_bytes) as usize;
        if per == 0 {
            return Err(Error::Backend(format!(
                "one output row of {row_bytes} bytes exceeds the binding limit"
            )));
        }
        let cols_bytes = (m.cols * 4) as u64;
        let mut t0 = 0;
        while t0 < x.rows() {
            let n = per.min(x.rows() - t0);
            let xs = GpuAct::new(n, m.cols, self.scratch(n as u64 * cols_bytes)?);
            self.copy_words(x.buf(), t0 * m.cols, xs.buf(), 0, n * m.cols)?;
            let ys = self.scratch(n as u64 * row_bytes)?;
            self.matvec_into(m, bias, &xs, ys.buf(), n as u64 * row_bytes)?;
            self.copy_words(ys.buf(), 0, out.buf(), t0 * m.rows, n * m.rows)?;
            t0 += n;
        }
        Ok(())
    }

    /// `dst[dst_at..][..n] = src[src_at..][..n]` in words, as a kernel (ordered after
    /// the compute that wrote `src` on every backend). Each side is bound as a window
    /// around its range, so buffers larger than one binding can be addressed.
    fn copy_words(&mut self, src: &GBuf, src_at: usize, dst: &GBuf, dst_at: usize, n: usize) -> Result<()> {
        let window = |at: usize| {
            let byte = at as u64 * 4;
            let base = byte - byte % STORAGE_ALIGN;
            (base, ((byte - base) / 4) as u32, (byte - base) + n as u64 * 4)
        };
        let (sb, so, ss) = window(src_at);
        let (db, d_o, ds) = window(dst_at);
        if ss > self.gpu.max_binding || ds > self.gpu.max_binding {
            return Err(Error::Backend(format!("a copy of {n} words exceeds the storage binding limit")));
        }
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let params = [n as u32, so, d_o, nx];
        let binds = [Bind::range(src, sb, ss), Bind::range(dst, db, ds)];
        let v = self.variant(Op::Copy);
        self.gpu.dispatch(Op::Copy, v, &params, &binds, (nx, ny, 1))
    }

    fn matvec_into(
        &mut self,
        m: &GpuMatrix,
        bias: Option<&GBuf>,
        x: &GpuAct,
        out: &GBuf,
        out_bytes: u64,
    ) -> Result<()> {
        let v = self.variant(m.op);
        let tokens = x.rows();
        let tiles = tokens.div_ceil(TOKENS_PER_GROUP);
        if tiles > self.gpu.max_groups as usize {
            return Err(Error::Backend(format!("{tokens} tokens in one product exceed the device's grid")));
        }
        let dummy = self.gpu.dummy.clone();
        for block in &m.blocks {
            let (nx, ny) = self.gpu.grid(block.rows as u64)?;
            let params = [
                block.rows as u32,
                m.cols as u32,
                block.row0 as u32,
                m.rows as u32,
                tokens as u32,
                bias.is_some() as u32,
                nx,
                0,
            ];
            let mut binds = vec![
                x.bind(),
                Bind::first(out, out_bytes),
                Bind::whole(bias.unwrap_or(&dummy)),
                Bind::whole(&block.data),
            ];
            if let Some(s) = &block.scales {
                binds.push(Bind::whole(s));
            }
            self.gpu.dispatch(m.op, v, &params, &binds, (nx, ny, tiles as u32))?;
        }
        Ok(())
    }

    /// A dense MLP on the rows of `x` into `out` (`[rows, hidden]`; the gate/up projection
    /// of all rows must fit one binding): gate_up x + b, the recipe's gated activation
    /// (glu.wgsl), then down act + b: the CPU's `expert_forward` with weight one.
    fn dense_block(&mut self, gate_up: &GpuLinear, down: &GpuLinear, x: &GpuAct, out: &GpuAct) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let rows = x.rows();
        let inter = down.m.cols;
        let gu = self.alloc(rows, gate_up.m.rows)?;
        self.matvec(&gate_up.m, gate_up.bias.as_ref(), x, &gu)?;
        let act = self.alloc(rows, inter)?;
        let n = rows * inter;
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let params = [
            n as u32,
            activation_code(cfg.recipe.activation),
            bits(cfg.swiglu_limit),
            bits(cfg.swiglu_alpha),
            nx,
            0,
            0,
            0,
        ];
        let v = self.variant(Op::Glu);
        self.gpu.dispatch(Op::Glu, v, &params, &[gu.bind(), act.bind()], (nx, ny, 1))?;
        self.matvec(&down.m, down.bias.as_ref(), &act, out)
    }

    fn topk(&mut self, logits: &GpuAct, routes: &GpuRoutes) -> Result<()> {
        let rows = logits.rows();
        let (nx, ny) = self.gpu.grid(rows.div_ceil(64) as u64)?;
        let params = [
            rows as u32,
            self.cfg.num_experts as u32,
            self.cfg.experts_per_token as u32,
            nx,
            routing_code(self.cfg.recipe.routing),
            0,
            0,
            0,
        ];
        let v = self.variant(Op::RouterTopk);
        self.gpu.dispatch(Op::RouterTopk, v, &params, &[logits.bind(), routes.bind()], (nx, ny, 1))
    }

    fn prediction_buffers(&mut self, rows: usize) -> Result<()> {
        if self.pred.as_ref().is_some_and(|p| p.rows == rows) {
            return Ok(());
        }
        let k = self.cfg.experts_per_token;
        let bytes = (rows * 2 * k * 4) as u64;
        let a = GpuRoutes::new(rows, k, self.scratch(bytes)?);
        let b = GpuRoutes::new(rows, k, self.scratch(bytes)?);
        self.pred = Some(Prediction { rows, bufs: [a, b], valid_for: None });
        Ok(())
    }

    /// Records the expert kernels of `layer` for every pair whose expert is resident.
    fn dispatch_experts(
        &mut self,
        layer: usize,
        x: &GpuAct,
        routes: &GpuRoutes,
        act: &GBuf,
        contrib: &GBuf,
    ) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let (h, i, k) = (cfg.hidden_size, cfg.intermediate_size, cfg.experts_per_token);
        let pairs = routes.rows() * k;
        let lay = self.vram.layout;
        let vg = self.variant(Op::ExpertGateUp);
        let vd = self.variant(Op::ExpertDown);
        let per = self.vram.pools_per_dispatch as usize;
        let pools = self.vram.pools.clone();
        let table = self.vram.table.clone();
        let spp = self.vram.slots_per_pool as u32;
        let dummy = self.gpu.dummy.clone();
        let (gx, gy) = self.gpu.grid(i as u64)?;
        let (dx, dy) = self.gpu.grid(h as u64)?;
        let act_bytes = (pairs * i * 4) as u64;
        let contrib_bytes = (pairs * h * 4) as u64;
        for first in (0..pools.len()).step_by(per) {
            let mut pool_binds: Vec<Bind<'_>> =
                pools[first..pools.len().min(first + per)].iter().map(Bind::whole).collect();
            while pool_binds.len() < per {
                pool_binds.push(Bind::whole(&dummy));
            }
            let mut p0 = 0;
            while p0 < pairs {
                let n = (self.gpu.max_groups as usize).min(pairs - p0);
                let gu = [
                    layer as u32,
                    k as u32,
                    cfg.num_experts as u32,
                    h as u32,
                    i as u32,
                    first as u32,
                    spp,
                    lay.stride,
                    lay.gu_w,
                    lay.gu_s,
                    lay.gu_b,
                    lay.gu_row_words,
                    lay.gu_groups,
                    gx,
                    p0 as u32,
                    bits(cfg.swiglu_limit),
                    bits(cfg.swiglu_alpha),
                    activation_code(cfg.recipe.activation),
                    0,
                    0,
                ];
                let mut binds =
                    vec![x.bind(), routes.bind(), Bind::whole(&table), Bind::first(act, act_bytes)];
                binds.extend(pool_binds.iter().copied());
                self.gpu.dispatch(Op::ExpertGateUp, vg, &gu, &binds, (gx, gy, n as u32))?;
                let dn = [
                    layer as u32,
                    k as u32,
                    cfg.num_experts as u32,
                    h as u32,
                    i as u32,
                    first as u32,
                    spp,
                    lay.stride,
                    lay.dn_w,
                    lay.dn_s,
                    lay.dn_b,
                    lay.dn_row_words,
                    lay.dn_groups,
                    dx,
                    p0 as u32,
                    0,
                ];
                let mut binds = vec![
                    Bind::first(act, act_bytes),
                    routes.bind(),
                    Bind::whole(&table),
                    Bind::first(contrib, contrib_bytes),
                ];
                binds.extend(pool_binds.iter().copied());
                self.gpu.dispatch(Op::ExpertDown, vd, &dn, &binds, (dx, dy, n as u32))?;
                p0 += n;
            }
        }
        Ok(())
    }

    /// An error unless keys, values and output fit `rows` query rows.
    fn check_attention_shapes(&self, rows: usize, k: &GpuAct, v: &GpuAct, out: &GpuAct) -> Result<()> {
        check_shape("attention out", out, rows, self.cfg.q_dim())?;
        check_shape("attention keys", k, rows, self.cfg.kv_dim())?;
        check_shape("attention values", v, rows, self.cfg.kv_dim())
    }

    /// rope.wgsl over `rows` rows of `x` from row `row0`, the first at position `start_pos`
    /// (the caller has checked the positions against the capacity).
    fn rope_dispatch(&mut self, x: &GpuAct, row0: usize, rows: usize, start_pos: usize) -> Result<()> {
        let d = self.cfg.head_dim;
        if !x.width().is_multiple_of(d) {
            return Err(Error::Backend(format!(
                "rope: width {} is not a multiple of head_dim {d}",
                x.width()
            )));
        }
        let heads = x.width() / d;
        let total = rows * heads * (d / 2);
        let (nx, ny) = self.gpu.grid(total.div_ceil(64) as u64)?;
        let params = [
            rows as u32,
            heads as u32,
            d as u32,
            start_pos as u32,
            x.width() as u32,
            total as u32,
            nx,
            row0 as u32,
        ];
        let v = self.variant(Op::Rope);
        let (c, s) = (self.rope_cos.clone(), self.rope_sin.clone());
        self.gpu.dispatch(Op::Rope, v, &params, &[x.bind(), Bind::whole(&c), Bind::whole(&s)], (nx, ny, 1))
    }

    /// kv_store.wgsl then attention.wgsl for the rows `at` places: their keys and values
    /// into the cache of `at.seq` from position `at.start_pos`, then each query row over its
    /// visible window there (the caller has checked shapes, sequence and capacity).
    fn attention_dispatch(
        &mut self,
        layer: usize,
        at: Placed,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        out: &GpuAct,
    ) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let (kc, vc) = self.kv[at.seq][layer].clone();
        let n = at.rows * cfg.kv_dim();
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let params = [n as u32, (at.start_pos * cfg.kv_dim()) as u32, nx, (at.row0 * cfg.kv_dim()) as u32];
        let var = self.variant(Op::KvStore);
        let binds = [k.bind(), v.bind(), Bind::whole(&kc), Bind::whole(&vc)];
        self.gpu.dispatch(Op::KvStore, var, &params, &binds, (nx, ny, 1))?;
        let (nx, ny) = self.gpu.grid((at.rows * cfg.num_heads) as u64)?;
        let params = [
            at.rows as u32,
            at.start_pos as u32,
            cfg.num_heads as u32,
            cfg.head_dim as u32,
            cfg.window(layer).unwrap_or(0) as u32,
            cfg.q_dim() as u32,
            cfg.kv_dim() as u32,
            (cfg.num_heads / cfg.num_kv_heads) as u32,
            bits(1.0 / (cfg.head_dim as f32).sqrt()),
            nx,
            self.layers[layer].sinks.is_some() as u32,
            at.row0 as u32,
        ];
        let sinks = self.layers[layer].sinks.clone().unwrap_or_else(|| self.gpu.dummy.clone());
        let var = self.variant(Op::Attention);
        let binds = [q.bind(), Bind::whole(&kc), Bind::whole(&vc), Bind::whole(&sinks), out.bind()];
        self.gpu.dispatch(Op::Attention, var, &params, &binds, (nx, ny, 1))
    }

    fn report_lines(&self) -> Vec<String> {
        let s = self.stats();
        let d = s.device;
        let mut lines = vec![format!(
            "gpu: {}; {} submissions, {} dispatches, {} readbacks ({:.1} KiB) for {} positions",
            self.adapter().summary(),
            d.submissions,
            d.dispatches,
            d.readbacks,
            d.readback_bytes as f64 / 1024.0,
            s.positions
        )];
        lines.push(format!(
            "  decode: {} steps, {:.2} readbacks and {:.2} submissions per step{}",
            s.decode_steps,
            s.readbacks_per_decode_step(),
            s.decode_submissions as f64 / s.decode_steps.max(1) as f64,
            if s.route_readbacks > 0 {
                format!(" ({} routing readbacks in all)", s.route_readbacks)
            } else {
                String::new()
            }
        ));
        lines.push(format!(
            "  dense weights in VRAM: {:.1} MiB; output head in {} row block(s) (storage binding limit {:.0} MiB)",
            self.dense_bytes as f64 / (1u64 << 20) as f64,
            self.head.blocks.len(),
            self.gpu.max_binding as f64 / (1u64 << 20) as f64
        ));
        let v = s.vram;
        lines.push(format!(
            "  vram experts: {} ({} of {} slots of {:.2} MiB in {} pool(s)); {} hits, {} misses, {} uploads ({} prefetched, {} of them used), {} evictions, {:.1} MiB uploaded",
            if s.full_residency { "all resident" } else { "LRU" },
            self.vram.resident(),
            self.vram.slots,
            self.vram.layout.bytes() as f64 / (1u64 << 20) as f64,
            self.vram.pools.len(),
            v.hits,
            v.misses,
            v.uploads,
            v.prefetches,
            v.prefetch_used,
            v.evictions,
            v.bytes as f64 / (1u64 << 20) as f64
        ));
        lines.push(match s.prediction_accuracy() {
            Some(a) => format!(
                "  routing prediction (router L+1 on layer L's activation): {}/{} next-layer experts = {:.1}%",
                s.predicted_hits,
                s.predicted_total,
                100.0 * a
            ),
            None if self.predict => "  routing prediction: no predictions read yet".into(),
            None => "  routing prediction: off (every expert resident; --gpu-predict to measure it)".into(),
        });
        lines
    }
}

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
            "gpu {} ({:?}, {:?}, {}); kernels: {}{}; experts in VRAM: {} ({} of {} slots); {}",
            r.name,
            r.backend,
            r.device_type,
            r.driver,
            if self.subgroup { "subgroup reductions" } else { "workgroup reductions" },
            if self.shader_f16 { ", f16 loads" } else { "" },
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
        // A new forward block begins: close the previous one's submission count.
        let now = self.gpu.counters().submissions;
        if self.in_decode {
            self.stats.decode_submissions += now - self.block_start;
        }
        self.block_start = now;
        self.gpu.stage(bytemuck::cast_slice(&rows), out.buf(), 0)?;
        self.in_decode = ids.len() == 1;
        self.stats.positions += ids.len() as u64;
        if self.in_decode {
            self.stats.decode_steps += 1;
        }
        if let Some(p) = self.pred.as_mut() {
            p.valid_for = None;
        }
        Ok(())
    }

    fn rms_norm(&mut self, norm: NormId, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        check_shape("rms_norm", out, x.rows(), x.width())?;
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
        let params = [x.rows() as u32, x.width() as u32, bits(self.cfg.rms_norm_eps), nx];
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
        let layer = self.layers.get(l).cloned().ok_or_else(|| Error::Backend(format!("no layer {l}")))?;
        let (q, k) = layer.qk_norm.as_ref().ok_or_else(|| {
            Error::Backend(format!("layer {l} has no QK-norm weights (the recipe has no QK-norm)"))
        })?;
        let w = if key { k } else { q };
        let slices = x.rows() * (x.width() / d);
        let (nx, ny) = self.gpu.grid(slices as u64)?;
        let params = [slices as u32, d as u32, bits(self.cfg.rms_norm_eps), nx];
        let v = self.variant(Op::RmsNormHeads);
        self.gpu.dispatch(Op::RmsNormHeads, v, &params, &[x.bind(), Bind::whole(w)], (nx, ny, 1))
    }

    fn dense_mlp(&mut self, layer: usize, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let rows = x.rows();
        check_shape("dense mlp out", out, rows, cfg.hidden_size)?;
        let owner =
            self.layers.get(layer).cloned().ok_or_else(|| Error::Backend(format!("no layer {layer}")))?;
        let GpuFfn::Dense { gate_up, down } = &owner.ffn else {
            return Err(Error::Backend(format!("layer {layer} is a MoE layer, not a dense one")));
        };
        // The gate/up projection of a block of rows is bound whole by glu.wgsl: blocks of
        // rows within the binding limit, through scratch buffers when there are several.
        let per = (self.gpu.max_binding / (gate_up.m.rows as u64 * 4)) as usize;
        if per == 0 {
            return Err(Error::Backend(format!(
                "layer {layer}: one row of the dense MLP's gate/up projection exceeds the storage binding limit"
            )));
        }
        if rows <= per {
            return self.dense_block(gate_up, down, x, out);
        }
        let h = cfg.hidden_size;
        let mut t0 = 0;
        while t0 < rows {
            let n = per.min(rows - t0);
            let xs = self.alloc(n, h)?;
            self.copy_words(x.buf(), t0 * h, xs.buf(), 0, n * h)?;
            let ys = self.alloc(n, h)?;
            self.dense_block(gate_up, down, &xs, &ys)?;
            self.copy_words(ys.buf(), 0, out.buf(), t0 * h, n * h)?;
            t0 += n;
        }
        Ok(())
    }

    fn linear(&mut self, id: LinearId, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        let layer =
            |l: usize| self.layers.get(l).cloned().ok_or_else(|| Error::Backend(format!("no layer {l}")));
        let (owner, pick): (Arc<GpuLayer>, fn(&GpuLayer) -> &GpuLinear) = match id {
            LinearId::Q(l) => (layer(l)?, |w| &w.q),
            LinearId::K(l) => (layer(l)?, |w| &w.k),
            LinearId::V(l) => (layer(l)?, |w| &w.v),
            LinearId::O(l) => (layer(l)?, |w| &w.o),
            LinearId::Router(l) => {
                let owner = layer(l)?;
                let Some(router) = owner.router() else {
                    return Err(Error::Backend(format!("layer {l} is a dense layer and has no router")));
                };
                return self.matvec(&router.m, router.bias.as_ref(), x, out);
            }
            LinearId::LmHead => {
                let head = Arc::clone(&self.head);
                return self.matvec(&head, None, x, out);
            }
        };
        let w = pick(&owner);
        self.matvec(&w.m, w.bias.as_ref(), x, out)
    }

    fn rope(&mut self, x: &mut GpuAct, start_pos: usize) -> Result<()> {
        if start_pos + x.rows() > self.capacity {
            return Err(Error::ContextFull { needed: start_pos + x.rows(), capacity: self.capacity });
        }
        self.rope_dispatch(x, 0, x.rows(), start_pos)
    }

    fn rope_rows(&mut self, x: &mut GpuAct, rows: &[SeqPos]) -> Result<()> {
        check_step_rows(x.rows(), rows, self.kv.len(), self.capacity)?;
        for (i, at) in rows.iter().enumerate() {
            self.rope_dispatch(x, i, 1, at.pos)?;
        }
        Ok(())
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
        let rows = q.rows();
        self.check_attention_shapes(rows, k, v, out)?;
        if start_pos + rows > self.capacity {
            return Err(Error::ContextFull { needed: start_pos + rows, capacity: self.capacity });
        }
        let at = Placed { seq: self.current, row0: 0, rows, start_pos };
        self.attention_dispatch(layer, at, q, k, v, out)
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
        self.check_attention_shapes(q.rows(), k, v, out)?;
        check_step_rows(q.rows(), rows, self.kv.len(), self.capacity)?;
        // Each row's store and attention bind its own sequence's cache: two dispatches per
        // row, recorded into the step's one submission (no wait between rows).
        for (i, r) in rows.iter().enumerate() {
            let at = Placed { seq: r.seq, row0: i, rows: 1, start_pos: r.pos };
            self.attention_dispatch(layer, at, q, k, v, out)?;
        }
        Ok(())
    }

    fn add_sequence(&mut self) -> Result<usize> {
        let cfg = Arc::clone(&self.cfg);
        let layer_bytes = (self.capacity * cfg.kv_dim() * 4) as u64;
        let need = 2 * layer_bytes * cfg.num_layers as u64;
        let seq = self.kv.len();
        if let Some(room) = self.kv_room {
            let used = need.saturating_mul(seq as u64);
            if used.saturating_add(need) > room {
                return Err(Error::Backend(format!(
                    "another key/value cache ({} positions x {} layers) needs {:.1} MiB of VRAM; {:.1} MiB of the {:.1} MiB left for key/value caches after the weights and the expert cache is free ({seq} sequence(s) hold {:.1} MiB); use a smaller --ctx, fewer --parallel slots or a smaller --vram-gb",
                    self.capacity,
                    cfg.num_layers,
                    mib(need),
                    mib(room.saturating_sub(used)),
                    mib(room),
                    mib(used)
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
        let cfg = Arc::clone(&self.cfg);
        let rows = x.rows();
        if routes.rows() != rows {
            return Err(Error::Backend(format!("route: {} routing rows for {rows} rows", routes.rows())));
        }
        let logits = self.alloc(rows, cfg.num_experts)?;
        let mut out = logits;
        self.linear(LinearId::Router(layer), x, &mut out)?;
        self.topk(&out, routes)?;
        if !self.predict {
            return Ok(());
        }
        // Score the prediction made for this layer at the previous one, on the GPU.
        self.prediction_buffers(rows)?;
        let pred = self.pred.take().ok_or_else(|| Error::Backend("prediction buffers".into()))?;
        let next_moe = self.layers.get(layer + 1).is_some_and(|l| l.router().is_some());
        let result = (|| {
            if pred.valid_for == Some(layer) {
                let (nx, ny) = self.gpu.grid(rows.div_ceil(64) as u64)?;
                let params = [rows as u32, cfg.experts_per_token as u32, nx, 0];
                let v = self.variant(Op::RouteAgree);
                let agree = self.agree.clone();
                let binds = [pred.bufs[layer % 2].bind(), routes.bind(), Bind::whole(&agree)];
                self.gpu.dispatch(Op::RouteAgree, v, &params, &binds, (nx, ny, 1))?;
            }
            // Router L+1 on layer L's normalized activation: the prefetcher's hint (when
            // layer L+1 is a MoE layer).
            if next_moe {
                self.linear(LinearId::Router(layer + 1), x, &mut out)?;
                self.topk(&out, &pred.bufs[(layer + 1) % 2])?;
            }
            Ok(())
        })();
        let mut pred = pred;
        pred.valid_for = next_moe.then_some(layer + 1);
        self.pred = Some(pred);
        result
    }

    fn experts(&mut self, layer: usize, x: &GpuAct, routes: &GpuRoutes, out: &mut GpuAct) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let (h, i, k) = (cfg.hidden_size, cfg.intermediate_size, cfg.experts_per_token);
        let rows = x.rows();
        check_shape("experts out", out, rows, h)?;
        let pairs = rows * k;
        let act = self.scratch((pairs * i * 4) as u64)?;
        let contrib = self.scratch((pairs * h * 4) as u64)?;
        let mut predicted: Vec<usize> = Vec::new();
        if self.vram.is_full() {
            // Every expert is resident: the kernels find their slots on the device.
            self.vram.stats.hits += pairs as u64;
            self.dispatch_experts(layer, x, routes, act.buf(), contrib.buf())?;
        } else {
            // Read back this layer's routing (and the prediction for the next layer, in the
            // same readback), make its experts resident, then dispatch.
            let next = self.pred.as_ref().filter(|p| p.valid_for == Some(layer + 1) && p.rows == rows);
            let mut ranges = vec![(routes.buf(), 0, routes.bytes())];
            if let Some(p) = next {
                let b = &p.bufs[(layer + 1) % 2];
                ranges.push((b.buf(), 0, b.bytes()));
            }
            let ranges: Vec<(GBuf, u64, u64)> =
                ranges.into_iter().map(|(b, o, s)| (b.clone(), o, s)).collect();
            let refs: Vec<(&GBuf, u64, u64)> = ranges.iter().map(|(b, o, s)| (b, *o, *s)).collect();
            let bytes = self.read_back(&refs)?;
            self.stats.route_readbacks += 1;
            let table = decode_routes(&bytes, rows, k);
            if ranges.len() > 1 {
                let p = decode_routes(&bytes[routes.bytes() as usize..], rows, k);
                predicted = p.experts.iter().map(|&e| e as usize).collect();
                predicted.sort_unstable();
                predicted.dedup();
                // Start the disk reads of the predicted experts now, in the RAM tier's
                // background readers, so they overlap this layer's uploads and kernels.
                if layer + 1 < cfg.num_layers {
                    self.source.prefetch(layer + 1, &predicted);
                }
            }
            let mut needed: Vec<usize> = table.experts.iter().map(|&e| e as usize).collect();
            needed.sort_unstable();
            needed.dedup();
            if needed.iter().any(|&e| e >= cfg.num_experts) {
                return Err(Error::Backend(format!("layer {layer}: routing names an expert out of range")));
            }
            for chunk in needed.chunks(self.vram.slots) {
                self.vram.ensure(&mut self.gpu, &self.source, layer, chunk, false)?;
                self.dispatch_experts(layer, x, routes, act.buf(), contrib.buf())?;
            }
        }
        let (nx, ny) = self.gpu.grid((rows * h).div_ceil(64) as u64)?;
        let params = [rows as u32, h as u32, k as u32, nx];
        let v = self.variant(Op::MoeCombine);
        let cb = Bind::first(contrib.buf(), (pairs * h * 4) as u64);
        self.gpu.dispatch(Op::MoeCombine, v, &params, &[cb, routes.bind(), out.bind()], (nx, ny, 1))?;
        if !predicted.is_empty() && layer + 1 < cfg.num_layers {
            // Submit this layer's work, then fetch and upload the predicted experts of the
            // next layer while the device runs it.
            self.gpu.flush()?;
            predicted.truncate(self.vram.slots);
            self.vram.ensure(&mut self.gpu, &self.source, layer + 1, &predicted, true)?;
        }
        Ok(())
    }

    fn add(&mut self, x: &mut GpuAct, y: &GpuAct) -> Result<()> {
        check_shape("add", x, y.rows(), y.width())?;
        let n = y.rows() * y.width();
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let v = self.variant(Op::Add);
        self.gpu.dispatch(Op::Add, v, &[n as u32, nx, 0, 0], &[y.bind(), x.bind()], (nx, ny, 1))
    }

    fn copy_rows(&mut self, src: &GpuAct, first_row: usize, dst: &mut GpuAct) -> Result<()> {
        if dst.width() != src.width() || first_row + dst.rows() > src.rows() {
            return Err(Error::Backend("copy_rows: rows out of range".into()));
        }
        let w = src.width();
        self.copy_words(src.buf(), first_row * w, dst.buf(), 0, dst.rows() * w)
    }

    fn read(&mut self, x: &GpuAct) -> Result<Vec<f32>> {
        // The prediction counters ride along with every readback (8 bytes, no extra wait).
        let agree = self.agree.clone();
        let bytes = self.read_back(&[(x.buf(), 0, x.bytes()), (&agree, 0, 8)])?;
        let n = x.bytes() as usize;
        let c = words(&bytes[n..n + 8]);
        self.stats.predicted_hits = c[0] as u64;
        self.stats.predicted_total = c[1] as u64;
        Ok(floats(&bytes[..n]))
    }

    fn read_routes(&mut self, routes: &GpuRoutes) -> Result<RouteTable> {
        let bytes = self.read_back(&[(routes.buf(), 0, routes.bytes())])?;
        Ok(decode_routes(&bytes, routes.rows(), routes.k()))
    }

    /// Nothing: this backend predicts inside [`route`](Backend::route), with router L+1 on
    /// the device over layer L's normalized MoE input, and starts the predicted reads when
    /// it reads layer L's routing back (`GpuOptions::predict` decides whether it runs).
    fn predict_next(&mut self, _layer: usize, _at: LayerPoint, _rows: RowKind, _x: &GpuAct) -> Result<()> {
        Ok(())
    }

    fn expert_stats(&self) -> ExpertStats {
        self.source.stats()
    }

    fn report(&self) -> Vec<String> {
        self.report_lines()
    }
}

/// The key/value cache of sequence `seq`: a (keys, values) pair of `layer_bytes` each for
/// every one of `layers` layers.
fn kv_cache(gpu: &mut Gpu, seq: usize, layers: usize, layer_bytes: u64) -> Result<Vec<(GBuf, GBuf)>> {
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
    (0..layers)
        .map(|l| {
            Ok((
                gpu.buffer(&format!("keys {seq}.{l}"), layer_bytes, usage)?,
                gpu.buffer(&format!("values {seq}.{l}"), layer_bytes, usage)?,
            ))
        })
        .collect()
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
