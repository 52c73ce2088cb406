//! `picchio bench-gpu`: each hot kernel of a decode step at GPT-OSS-20B's shapes, timed
//! through the GPU backend's own [`Backend`] ops on a random model built in memory, so it
//! measures whatever the kernels are: the Q/K/V/O products and the head in each dense
//! format the container uses, the experts (gate/up, down and their combination, top-k of
//! every resident expert) in INT4-gs64 and MXFP4, and attention at several contexts with an
//! F32 and an F16 key/value cache (`--kv-cache`); and the Q/K/V and O products of a prompt
//! block of [`BLOCK_TOKENS`] tokens (tiled, or the matrix-vector kernels with
//! [`GpuOptions::untiled_dense`]). Each
//! case reports the time per call, the bytes the op must read, its GB/s, and the GB/s of a
//! buffer-to-buffer copy of the same bytes measured in the same run, with their ratio.
//!
//! Each call of a case reads other weights than the call before (the layers, or the
//! experts, cycle), so that a weight matrix smaller than the GPU's last-level cache is not
//! read from it; the copy cycles through as many source regions.

pub mod model;

use crate::backend::gpu::{Clock, GpuBackend, GpuOptions, KvPrecision, Timed};
use crate::backend::{Backend, LinearId, RouteTable};
use crate::engine::LoadedModel;
use crate::error::{Error, Result};

pub use model::{Format, Shape, random_matrix, random_model};

/// Tokens of the prompt-block cases (`q block`, `o block`): a prefill block's dense products.
pub const BLOCK_TOKENS: usize = 64;

/// What to measure.
#[derive(Clone, Debug)]
pub struct Options {
    /// The model's shape (layers included).
    pub shape: Shape,
    /// Contexts at which attention is timed (positions attended).
    pub contexts: Vec<usize>,
    /// Most calls per case.
    pub reps: usize,
    /// Seconds a case's timed calls should take: the number of calls is this over the time
    /// of one untimed warm-up call, between 2 and `reps`.
    pub seconds_per_case: f64,
    /// Also time the dense products in F32.
    pub f32: bool,
    /// How to open the device (timestamps are asked for here).
    pub gpu: GpuOptions,
}

/// One case's result.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CaseResult {
    /// The op: `q`, `k`, `v`, `o`, `head`, `experts`, `attention`.
    pub case: String,
    /// The weights' format (`bf16`, `int8-row`, `mxfp4`...; for attention the cache's
    /// precision and the context, `f32 cache, ctx 1024`).
    pub format: String,
    /// Shapes in words.
    pub detail: String,
    /// Bytes one call must read (weights, scales, biases, inputs; the cache for attention).
    pub bytes: u64,
    /// Distinct weight sets the calls cycle through (the copy cycles through as many).
    pub regions: usize,
    /// The op's timing.
    pub kernel: Timed,
    /// The copy's timing.
    pub copy: Timed,
    /// `bytes` per second of the op.
    pub kernel_bytes_per_s: f64,
    /// `bytes` per second of the copy.
    pub copy_bytes_per_s: f64,
    /// The op's bandwidth over the copy's.
    pub ratio: f64,
}

/// Everything measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    /// The adapter, in one line.
    pub adapter: String,
    /// How the cases were timed.
    pub clock: Clock,
    /// The model's shape.
    pub shape: Shape,
    /// Contexts of the attention cases.
    pub contexts: Vec<usize>,
    /// The cases, in the order run.
    pub cases: Vec<CaseResult>,
}

/// The models measured in turn: (dense format, expert format, whether attention is timed
/// on it, whether its experts are).
fn plans(f32: bool) -> Vec<(Format, Format, bool, bool)> {
    let mut p = vec![(Format::Bf16, Format::Mxfp4, true, true), (Format::Int8, Format::Int4, false, true)];
    if f32 {
        p.push((Format::F32, Format::Mxfp4, false, false));
    }
    p
}

/// Runs every case, calling `progress` after each.
pub fn run(opts: &Options, mut progress: impl FnMut(&CaseResult)) -> Result<Report> {
    if opts.shape.layers == 0 {
        return Err(Error::invalid("the benchmark needs at least one layer"));
    }
    let capacity = opts.contexts.iter().copied().max().unwrap_or(1).max(2);
    let mut cases = Vec::new();
    let mut adapter = String::new();
    let mut clock = Clock::WallClock;
    for (dense, experts, attention, moe) in plans(opts.f32) {
        tracing::info!(
            "bench-gpu: building a random model ({} dense, {} experts)",
            dense.name(),
            experts.name()
        );
        let model = random_model(&opts.shape, dense, experts)?;
        let total =
            (model.config.num_layers * model.config.num_experts) as u64 * model.experts.expert_bytes();
        let gpu_opts = GpuOptions {
            vram_bytes: Some(total.saturating_mul(2).max(1)),
            timestamps: true,
            extra_dispatches: opts.reps.max(1) * 16 + 64,
            ..opts.gpu.clone()
        };
        let mut b = GpuBackend::new(
            model.config.clone(),
            model.dense.clone(),
            model.experts.clone(),
            capacity,
            &gpu_opts,
        )?;
        if !b.residency().3 {
            return Err(Error::Backend("not every expert is resident; the benchmark needs them all".into()));
        }
        adapter = b.adapter().summary();
        clock = b.clock();
        let mut bench = Bench { b: &mut b, model: &model, opts, progress: &mut progress, out: &mut cases };
        for case in ["q", "k", "v", "o", "head"] {
            bench.linear(case, dense, 1)?;
        }
        for case in ["q", "o"] {
            bench.linear(case, dense, BLOCK_TOKENS)?;
        }
        if moe {
            bench.experts(experts)?;
        }
        if attention {
            for &ctx in &opts.contexts {
                bench.attention(ctx)?;
            }
            // The same attention cases with an F16 cache: another backend on the same model,
            // with one token's experts of a layer in VRAM (a slot holds a record rounded up
            // to 4 KiB, under twice its bytes; its expert cases are not run).
            drop(b);
            let one_token =
                (model.config.experts_per_token as u64).saturating_mul(model.experts.expert_bytes());
            let f16_opts = GpuOptions {
                kv_precision: KvPrecision::F16,
                vram_bytes: Some(one_token.saturating_mul(2).max(1)),
                ..gpu_opts.clone()
            };
            let mut b = GpuBackend::new(
                model.config.clone(),
                model.dense.clone(),
                model.experts.clone(),
                capacity,
                &f16_opts,
            )?;
            let mut bench =
                Bench { b: &mut b, model: &model, opts, progress: &mut progress, out: &mut cases };
            for &ctx in &opts.contexts {
                bench.attention(ctx)?;
            }
        }
    }
    Ok(Report { adapter, clock, shape: opts.shape.clone(), contexts: opts.contexts.clone(), cases })
}

/// The state of one model's cases.
struct Bench<'a, P: FnMut(&CaseResult)> {
    b: &'a mut GpuBackend,
    model: &'a LoadedModel,
    opts: &'a Options,
    progress: &'a mut P,
    out: &'a mut Vec<CaseResult>,
}

impl<P: FnMut(&CaseResult)> Bench<'_, P> {
    /// Times `call` after one warm-up call, as many times as fit the case's time budget.
    fn time(&mut self, mut call: impl FnMut(&mut GpuBackend, usize) -> Result<()>) -> Result<Timed> {
        let warm = self.b.time_calls(1, &mut call)?;
        let fit = (self.opts.seconds_per_case / warm.wall_seconds_per_call.max(1e-9)) as usize;
        self.b.time_calls(fit.clamp(2, self.opts.reps.max(2)), call)
    }

    fn record(
        &mut self,
        case: &str,
        format: &str,
        detail: String,
        bytes: u64,
        regions: usize,
        kernel: Timed,
    ) -> Result<()> {
        let copy = self.b.time_copy(bytes, regions, kernel.calls)?;
        let per_s = |t: &Timed| bytes as f64 / t.seconds_per_call.max(1e-12);
        let r = CaseResult {
            case: case.into(),
            format: format.into(),
            detail,
            bytes,
            regions,
            kernel_bytes_per_s: per_s(&kernel),
            copy_bytes_per_s: per_s(&copy),
            ratio: per_s(&kernel) / per_s(&copy),
            kernel,
            copy,
        };
        (self.progress)(&r);
        self.out.push(r);
        Ok(())
    }

    /// A dense product over `tokens` rows: `q`, `k`, `v`, `o` (cycling through the layers)
    /// or `head`; over more than one token the case is named `q block` (`o block`, ...).
    /// (`q`, `k` and `v` each run the stacked Q/K/V product; their bytes count their own
    /// weights only.)
    fn linear(&mut self, case: &str, format: Format, tokens: usize) -> Result<()> {
        let d = &self.model.dense;
        let layers = self.model.config.num_layers;
        let (id, regions): (fn(usize) -> LinearId, usize) = match case {
            "q" => (LinearId::Q, layers),
            "k" => (LinearId::K, layers),
            "v" => (LinearId::V, layers),
            "o" => (LinearId::O, layers),
            _ => (|_| LinearId::LmHead, 1),
        };
        let lin = match id(0) {
            LinearId::Q(_) => &d.layers[0].attn.q,
            LinearId::K(_) => &d.layers[0].attn.k,
            LinearId::V(_) => &d.layers[0].attn.v,
            LinearId::O(_) => &d.layers[0].attn.o,
            _ => &crate::model::weights::Linear { weight: d.lm_head.clone(), bias: None },
        };
        let (rows, cols) = (lin.weight.rows, lin.weight.cols);
        let bytes =
            (lin.weight.byte_len() + 4 * lin.bias.as_ref().map_or(0, Vec::len) + 4 * cols * tokens) as u64;
        let x = self.b.upload(tokens, cols, &vec![0.01; cols * tokens])?;
        let mut y = self.b.alloc(tokens, rows)?;
        let before = self.b.stats().tiled_products;
        let t = self.time(|b, i| b.linear(id(i % regions), &x, &mut y))?;
        let (name, detail) = match tokens {
            1 => (case.to_string(), format!("[{rows} x {cols}] x 1 token")),
            _ => {
                let how =
                    if self.b.stats().tiled_products > before { "tiled" } else { "matrix-vector kernels" };
                (format!("{case} block"), format!("[{rows} x {cols}] x {tokens} tokens, {how}"))
            }
        };
        self.record(&name, format.name(), detail, bytes, regions, t)
    }

    /// The experts of one token (top-k of every resident expert), cycling through layers
    /// and experts so that each call reads other experts.
    fn experts(&mut self, format: Format) -> Result<()> {
        let cfg = self.model.config.clone();
        let (h, k, e, layers) = (cfg.hidden_size, cfg.experts_per_token, cfg.num_experts, cfg.num_layers);
        let w = self.model.experts.experts(0, &[0])?;
        let one = &w[0];
        let expert = (one.gate_up.byte_len()
            + one.down.byte_len()
            + 4 * (one.gate_up_bias.len() + one.down_bias.len())) as u64;
        let bytes = k as u64 * expert + 4 * h as u64;
        let sets = (layers * (e / k).max(1)).min(self.opts.reps).max(1);
        let mut routes = Vec::with_capacity(sets);
        for s in 0..sets {
            let first = (s / layers) * k;
            let table = RouteTable {
                k,
                experts: (0..k).map(|j| ((first + j) % e) as u32).collect(),
                weights: vec![1.0 / k as f32; k],
            };
            routes.push((s % layers, self.b.upload_routes(&table)?));
        }
        let x = self.b.upload(1, h, &vec![0.01; h])?;
        let mut y = self.b.alloc(1, h)?;
        let t = self.time(|b, i| {
            let (layer, r) = &routes[i % routes.len()];
            b.experts(*layer, &x, r, &mut y)
        })?;
        let detail = format!(
            "{k} of {e} experts x {layers} layers resident, gate_up [{} x {h}] + down [{h} x {}] + combine",
            2 * cfg.intermediate_size,
            cfg.intermediate_size
        );
        self.record("experts", format.name(), detail, bytes, sets, t)
    }

    /// Bytes of `positions` positions of one layer's keys and values in the backend's cache.
    fn cache_bytes(&self, positions: usize) -> u64 {
        let kv = self.model.config.kv_dim();
        self.b.kv_precision().layer_bytes(positions, kv).map_or(u64::MAX, |b| b.saturating_mul(2))
    }

    /// Decode attention of one token over `ctx` cached positions (the key/value store of
    /// the new position included), cycling through the layers' caches, in the backend's
    /// cache precision.
    fn attention(&mut self, ctx: usize) -> Result<()> {
        let cfg = self.model.config.clone();
        let (q, kv, layers) = (cfg.q_dim(), cfg.kv_dim(), cfg.num_layers);
        let pos = ctx.clamp(1, self.b.capacity()) - 1;
        let precision = self.b.kv_precision();
        let bytes = self.cache_bytes(pos + 1) + (q * 4 + 2 * kv * 4) as u64;
        let (xq, xk, xv) = (
            self.b.upload(1, q, &vec![0.1; q])?,
            self.b.upload(1, kv, &vec![0.1; kv])?,
            self.b.upload(1, kv, &vec![0.1; kv])?,
        );
        let mut out = self.b.alloc(1, q)?;
        let t = self.time(|b, i| b.attention(i % layers, pos, &xq, &xk, &xv, &mut out))?;
        let detail = format!(
            "{} heads over {} KV heads of {}, {} positions",
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            pos + 1
        );
        self.record("attention", &format!("{precision} cache, ctx {}", pos + 1), detail, bytes, layers, t)?;
        self.attention_half(ctx)
    }

    /// A decoded token's whole attention half as the forward pass runs it on the GPU
    /// (`Backend::fused_attention`: the stacked Q/K/V product with the norm inside,
    /// attention_decode over the key splits, attention_merge, the output projection added to
    /// the residual) over `ctx` cached positions, cycling through the layers.
    fn attention_half(&mut self, ctx: usize) -> Result<()> {
        let cfg = self.model.config.clone();
        let (kv, h, layers) = (cfg.kv_dim(), cfg.hidden_size, cfg.num_layers);
        let pos = ctx.clamp(1, self.b.capacity()) - 1;
        let precision = self.b.kv_precision();
        let attn = &self.model.dense.layers[0].attn;
        let weights: usize = [&attn.q, &attn.k, &attn.v, &attn.o].iter().map(|l| l.weight.byte_len()).sum();
        let bytes = self.cache_bytes(pos + 1) + (weights + 2 * h * 4) as u64;
        let format = attn.q.weight.format_name();
        let mut x = self.b.upload(1, h, &vec![0.1; h])?;
        let t = self.time(|b, i| {
            if b.fused_attention(i % layers, pos, &mut x)? {
                Ok(())
            } else {
                Err(crate::error::Error::Backend("this shape has no fused decode attention".into()))
            }
        })?;
        let detail = format!(
            "norm + Q/K/V [{} x {h}] + attention over {} positions + O + residual, {format} weights",
            cfg.q_dim() + 2 * kv,
            pos + 1
        );
        let format = format!("{precision} cache, ctx {}", pos + 1);
        self.record("attention half (fused)", &format, detail, bytes, layers, t)
    }
}
