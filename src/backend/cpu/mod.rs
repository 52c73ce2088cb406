//! The CPU backend: the numeric oracle. Every op is computed immediately, in f32, with the
//! plain kernels of `quant::reference` and `model::math`; results do not depend on the
//! thread count.

pub mod attention;
pub mod kv_cache;
pub mod moe;

use std::sync::{Arc, Mutex, PoisonError};

use rayon::prelude::*;

use crate::backend::{
    Backend, LayerPoint, LinearId, NormId, Predict, RouteTable, RowKind, SeqPos, check_sequence,
    check_step_rows,
};
use crate::config::{MlpKind, ModelConfig, Routing};
use crate::error::{Error, Result};
use crate::experts::{ExpertSource, ExpertStats};
use crate::model::math::{rms_norm, rms_norm_in_place, route};
use crate::model::rope::{RopeFrequencies, rotate_half};
use crate::model::weights::{DenseWeights, FeedForward, LayerWeights, Linear};
use crate::quant::Matrix;

use attention::{AttentionShape, LayerCache, attend_group};
use kv_cache::KvCache;

/// Activations in host memory.
#[derive(Clone, Debug)]
pub struct CpuAct {
    /// Rows (token positions).
    pub rows: usize,
    /// Width of a row.
    pub width: usize,
    /// `rows * width` values.
    pub data: Vec<f32>,
}

impl CpuAct {
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.width..(r + 1) * self.width]
    }
}

/// Runs the model on the CPU.
pub struct CpuBackend {
    cfg: Arc<ModelConfig>,
    dense: Arc<DenseWeights>,
    experts: Arc<dyn ExpertSource>,
    /// cos and sin of every position the cache can hold, each `[capacity, head_dim / 2]`
    /// ([`RopeFrequencies::table`]), built once so that no token recomputes them.
    rope_cos: Vec<f32>,
    /// See `rope_cos`.
    rope_sin: Vec<f32>,
    /// One key/value cache per sequence ([`Backend::add_sequence`]), all of one capacity.
    kv: Vec<KvCache>,
    /// The sequence whose cache [`Backend::rope`] and [`Backend::attention`] use.
    current: usize,
    /// When each next layer's experts are predicted and prefetched.
    predict: Predict,
    /// Compute experts in arrival order rather than after all have arrived.
    completion_driven: bool,
    /// Router logits of one row (scratch of [`route_rows`]).
    router_logits: Vec<f32>,
    /// Buffers of the next layer's predictions, kept so that no token allocates, an early
    /// prediction waiting to be issued, and the residual the near-end prediction starts from.
    prediction: PredictionScratch,
    /// Buffers of the MoE block, reused by every layer of every token.
    moe: moe::MoeScratch,
    /// A decoded token's query, key and value one after another ([`Backend::linear_qkv`]).
    qkv: Vec<f32>,
}

/// Reusable buffers of [`CpuBackend::predict_next`] and of the near-end prediction.
#[derive(Default)]
struct PredictionScratch {
    /// The prediction made from the residual before or after a layer.
    guess: Guess,
    /// The layer `guess` was made for when it is still to be issued (an early one, issued by
    /// [`Backend::experts`] once the current layer's experts are secured).
    pending: Option<usize>,
    /// The next layer, when a decoded row's residual before this layer's experts is kept in
    /// `residual` so that a prediction can be made from it plus all of the layer's experts
    /// but the last, while that one is read ([`moe::moe_forward`]'s `near_end`).
    near_end: Option<usize>,
    /// That residual.
    residual: Vec<f32>,
    /// The near-end prediction (made on a pool thread, hence the lock).
    near_end_guess: Mutex<Guess>,
}

/// One prediction of a layer's routing, its buffers reused from token to token.
#[derive(Default)]
struct Guess {
    /// The input rows; [`Guess::predict`] normalizes them in place.
    rows: Vec<f32>,
    /// Router logits of one row.
    logits: Vec<f32>,
    /// The router's choice for each row.
    routes: RouteTable,
    /// The union of the rows' predicted experts, each row's first choices first.
    experts: Vec<usize>,
}

impl Guess {
    /// Predicts which experts `layer` will choose for `self.rows` (each `cfg.hidden_size`
    /// wide): every row normalized with its pre-MoE norm and routed through its router, the
    /// union into `experts`, deduplicated, every row's first choice before any row's second
    /// so that the likeliest are read first. False (and nothing predicted) when `layer` has
    /// no router.
    fn predict(&mut self, cfg: &ModelConfig, layer: &LayerWeights) -> bool {
        let Some(router) = layer.router() else { return false };
        let (k, width) = (cfg.experts_per_token, cfg.hidden_size);
        for row in self.rows.chunks_exact_mut(width) {
            rms_norm_in_place(row, &layer.mlp_norm, cfg.rms_norm_eps);
        }
        route_rows(router, k, cfg.recipe.routing, &self.rows, width, &mut self.logits, &mut self.routes);
        let rows = self.rows.len() / width;
        self.experts.clear();
        for j in 0..k {
            for r in 0..rows {
                let e = self.routes.experts[r * k + j] as usize;
                if !self.experts.contains(&e) {
                    self.experts.push(e);
                }
            }
        }
        true
    }
}

/// Routes each `width`-wide row of `x` through `router`: its top `k` experts and their weights
/// into `routes` (resized to fit); `logits` is scratch.
fn route_rows(
    router: &Linear,
    k: usize,
    routing: Routing,
    x: &[f32],
    width: usize,
    logits: &mut Vec<f32>,
    routes: &mut RouteTable,
) {
    let rows = x.len() / width;
    logits.resize(router.weight.rows, 0.0);
    routes.k = k;
    routes.experts.resize(rows * k, 0);
    routes.weights.resize(rows * k, 0.0);
    let chosen = routes.experts.chunks_exact_mut(k).zip(routes.weights.chunks_exact_mut(k));
    for (row, (experts, weights)) in x.chunks_exact(width).zip(chosen) {
        router.forward(row, logits);
        route(logits, k, routing, experts, weights);
    }
}

impl CpuBackend {
    /// A backend with a key/value cache of `capacity` positions. Fails, saying how much
    /// memory was asked for and how much is available, when the cache or the RoPE tables
    /// cannot be allocated.
    pub fn new(
        cfg: Arc<ModelConfig>,
        dense: Arc<DenseWeights>,
        experts: Arc<dyn ExpertSource>,
        capacity: usize,
    ) -> Result<Self> {
        let (rope_cos, rope_sin) = RopeFrequencies::from_config(&cfg).try_table(capacity)?;
        let kv = vec![KvCache::new(cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)?];
        Ok(CpuBackend {
            cfg,
            dense,
            experts,
            rope_cos,
            rope_sin,
            kv,
            current: 0,
            predict: Predict::Off,
            completion_driven: true,
            router_logits: Vec::new(),
            prediction: PredictionScratch::default(),
            moe: moe::MoeScratch::default(),
            qkv: Vec::new(),
        })
    }

    /// Sets how experts are fetched: `predict` says when each next layer's experts are
    /// predicted and prefetched (off until set); `completion_driven` computes
    /// experts as they arrive. Neither changes any result.
    pub fn with_expert_pipeline(mut self, predict: Predict, completion_driven: bool) -> Self {
        self.predict = predict;
        self.completion_driven = completion_driven;
        self
    }

    /// The attention geometry of `layer`.
    fn attention_shape(&self, layer: usize) -> AttentionShape {
        let cfg = &self.cfg;
        AttentionShape {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            window: cfg.window(layer),
        }
    }

    /// The cache of sequence `seq` in `layer`, with the layer's sinks.
    fn layer_cache(&self, seq: usize, layer: usize) -> LayerCache<'_> {
        LayerCache {
            positions: self.kv[seq].capacity(),
            keys: self.kv[seq].keys(layer),
            values: self.kv[seq].values(layer),
            sinks: self.dense.layers[layer].attn.sinks.as_deref(),
        }
    }

    /// The weight of a norm; an error for a QK-norm the family does not have.
    fn norm_weight(&self, norm: NormId) -> Result<&[f32]> {
        let missing =
            |what: &str, l: usize| Error::Backend(format!("layer {l} has no {what} weight (no QK-norm)"));
        Ok(match norm {
            NormId::Attention(l) => &self.dense.layers[l].attn_norm,
            NormId::Mlp(l) => &self.dense.layers[l].mlp_norm,
            NormId::Final => &self.dense.final_norm,
            NormId::Query(l) => {
                self.dense.layers[l].attn.q_norm.as_deref().ok_or_else(|| missing("q_norm", l))?
            }
            NormId::Key(l) => {
                self.dense.layers[l].attn.k_norm.as_deref().ok_or_else(|| missing("k_norm", l))?
            }
        })
    }

    /// The router of `layer`, or an error on a dense layer.
    fn router(&self, layer: usize) -> Result<&Linear> {
        self.dense.layers[layer]
            .router()
            .ok_or_else(|| Error::Backend(format!("layer {layer} is a dense layer and has no router")))
    }

    /// The weight matrix and bias of a linear layer.
    fn linear_parts(&self, id: LinearId) -> Result<(&Matrix, Option<&[f32]>)> {
        fn lin(l: &Linear) -> (&Matrix, Option<&[f32]>) {
            (&l.weight, l.bias.as_deref())
        }
        let d = &self.dense;
        Ok(match id {
            LinearId::Q(l) => lin(&d.layers[l].attn.q),
            LinearId::K(l) => lin(&d.layers[l].attn.k),
            LinearId::V(l) => lin(&d.layers[l].attn.v),
            LinearId::O(l) => lin(&d.layers[l].attn.o),
            LinearId::Router(l) => lin(self.router(l)?),
            LinearId::LmHead => (&d.lm_head, None),
        })
    }
}

/// Adds a linear layer's `bias` (if it has one) to every row of its output `out`.
fn add_bias(out: &mut CpuAct, bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in out.data.chunks_mut(out.width.max(1)) {
            for (o, &b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}

/// Attends every row of `q` over the cache and at the position `at(row)` gives, into `out`:
/// one pool task per (row, key/value head), the query heads that share the head's keys and
/// values together ([`attend_group`]), so each task reads them once. Each head's result is
/// independent of the split.
fn attend_rows<'c>(
    cfg: &ModelConfig,
    shape: AttentionShape,
    q: &CpuAct,
    out: &mut CpuAct,
    at: impl Fn(usize) -> (LayerCache<'c>, usize) + Sync,
) {
    let width = cfg.head_dim * (cfg.num_heads / cfg.num_kv_heads);
    out.data.par_chunks_mut(width).enumerate().for_each_init(Vec::new, |scores, (i, o)| {
        let (r, kvh) = (i / cfg.num_kv_heads, i % cfg.num_kv_heads);
        let (cache, pos) = at(r);
        attend_group(shape, cache, kvh, &q.row(r)[kvh * width..(kvh + 1) * width], pos, scores, o);
    });
}

fn check_shape(what: &str, act: &CpuAct, rows: usize, width: usize) -> Result<()> {
    crate::backend::check_shape(what, (act.rows, act.width), (rows, width))
}

impl Backend for CpuBackend {
    type Act = CpuAct;
    type Routes = RouteTable;

    fn on_workers<R: Send>(&mut self, f: impl FnOnce(&mut Self) -> R + Send) -> R {
        if rayon::current_thread_index().is_some() {
            return f(self);
        }
        // A join called from outside the pool runs both halves on its workers and blocks
        // this thread once, for the whole block.
        rayon::join(|| f(self), || ()).0
    }

    fn describe(&self) -> String {
        let path = crate::quant::kernels::selected();
        format!(
            "cpu ({} threads, {} kernels{}; {})",
            rayon::current_num_threads(),
            path.name(),
            if path.quantizes_activations() { " with int8 activations" } else { "" },
            self.experts.describe()
        )
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn capacity(&self) -> usize {
        self.kv[0].capacity()
    }

    fn alloc(&mut self, rows: usize, width: usize) -> Result<CpuAct> {
        Ok(CpuAct { rows, width, data: vec![0.0; rows * width] })
    }

    fn alloc_routes(&mut self, rows: usize) -> Result<RouteTable> {
        let k = self.cfg.experts_per_token;
        Ok(RouteTable { k, experts: vec![0; rows * k], weights: vec![0.0; rows * k] })
    }

    fn embed(&mut self, ids: &[u32], out: &mut CpuAct) -> Result<()> {
        check_shape("embed", out, ids.len(), self.cfg.hidden_size)?;
        for (row, &id) in out.data.chunks_mut(self.cfg.hidden_size).zip(ids) {
            self.dense.embed.row_to_f32(id as usize, row);
        }
        Ok(())
    }

    fn rms_norm(&mut self, norm: NormId, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        check_shape("rms_norm", out, x.rows, x.width)?;
        let w = self.norm_weight(norm)?;
        let eps = self.cfg.rms_norm_eps;
        for (xr, or) in x.data.chunks(x.width).zip(out.data.chunks_mut(x.width)) {
            rms_norm(xr, w, eps, or);
        }
        Ok(())
    }

    fn rms_norm_heads(&mut self, norm: NormId, x: &mut CpuAct) -> Result<()> {
        let d = self.cfg.head_dim;
        if !x.width.is_multiple_of(d) {
            return Err(Error::Backend(format!(
                "rms_norm_heads: width {} is not whole heads of {d}",
                x.width
            )));
        }
        let w = self.norm_weight(norm)?;
        let eps = self.cfg.rms_norm_eps;
        for head in x.data.chunks_exact_mut(d) {
            rms_norm_in_place(head, w, eps);
        }
        Ok(())
    }

    fn linear(&mut self, id: LinearId, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        let (w, bias) = self.linear_parts(id)?;
        check_shape("linear", out, x.rows, w.rows)?;
        w.matmul(&x.data, x.rows, &mut out.data);
        add_bias(out, bias);
        Ok(())
    }

    /// A single row (a decoded token) runs the three projections as one product split across
    /// the pool ([`Matrix::matvec_parts`]); more rows, or projections of different formats or
    /// widths, run them one by one. The same outputs either way.
    fn linear_qkv(
        &mut self,
        layer: usize,
        x: &CpuAct,
        q: &mut CpuAct,
        k: &mut CpuAct,
        v: &mut CpuAct,
    ) -> Result<()> {
        // The weights through their own handle, so that the scratch below can be borrowed.
        let dense = Arc::clone(&self.dense);
        let attn = &dense.layers[layer].attn;
        let parts = [&attn.q, &attn.k, &attn.v];
        let one_product = x.rows == 1 && {
            self.qkv.resize(parts.iter().map(|p| p.weight.rows).sum(), 0.0);
            Matrix::matvec_parts(&parts.map(|p| &p.weight), &x.data, &mut self.qkv).is_ok()
        };
        if !one_product {
            self.linear(LinearId::Q(layer), x, q)?;
            self.linear(LinearId::K(layer), x, k)?;
            return self.linear(LinearId::V(layer), x, v);
        }
        let mut stacked = self.qkv.as_slice();
        for (out, part) in [q, k, v].into_iter().zip(parts) {
            check_shape("linear", out, 1, part.weight.rows)?;
            let (these, rest) = stacked.split_at(part.weight.rows);
            out.data.copy_from_slice(these);
            add_bias(out, part.bias.as_deref());
            stacked = rest;
        }
        Ok(())
    }

    fn rope(&mut self, x: &mut CpuAct, start_pos: usize) -> Result<()> {
        let d = self.cfg.head_dim;
        let half = d / 2;
        let capacity = self.capacity();
        if start_pos + x.rows > capacity {
            return Err(Error::ContextFull { needed: start_pos + x.rows, capacity });
        }
        let width = x.width;
        for (r, row) in x.data.chunks_mut(width).enumerate() {
            let p = start_pos + r;
            let cos = &self.rope_cos[p * half..(p + 1) * half];
            let sin = &self.rope_sin[p * half..(p + 1) * half];
            for head in row.chunks_mut(d) {
                rotate_half(head, cos, sin);
            }
        }
        Ok(())
    }

    fn rope_rows(&mut self, x: &mut CpuAct, rows: &[SeqPos]) -> Result<()> {
        check_step_rows(x.rows, rows, self.kv.len(), self.capacity())?;
        let d = self.cfg.head_dim;
        let half = d / 2;
        let width = x.width;
        for (row, at) in x.data.chunks_mut(width).zip(rows) {
            let p = at.pos;
            let cos = &self.rope_cos[p * half..(p + 1) * half];
            let sin = &self.rope_sin[p * half..(p + 1) * half];
            for head in row.chunks_mut(d) {
                rotate_half(head, cos, sin);
            }
        }
        Ok(())
    }

    fn add_sequence(&mut self) -> Result<usize> {
        let cfg = &self.cfg;
        self.kv.try_reserve(1).map_err(|_| Error::invalid("no memory for another key/value cache"))?;
        self.kv.push(KvCache::new(cfg.num_layers, self.capacity(), cfg.num_kv_heads, cfg.head_dim)?);
        Ok(self.kv.len() - 1)
    }

    fn select_sequence(&mut self, seq: usize) -> Result<()> {
        check_sequence(seq, self.kv.len())?;
        self.current = seq;
        Ok(())
    }

    fn attention_rows(
        &mut self,
        layer: usize,
        rows: &[SeqPos],
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        out: &mut CpuAct,
    ) -> Result<()> {
        let cfg = &self.cfg;
        check_shape("attention out", out, q.rows, cfg.q_dim())?;
        check_step_rows(q.rows, rows, self.kv.len(), self.capacity())?;
        for (r, at) in rows.iter().enumerate() {
            self.kv[at.seq].write(layer, at.pos, k.row(r), v.row(r));
        }
        // Each row over its own sequence's cache: exactly the computation of `attention` for
        // that row alone.
        let shape = self.attention_shape(layer);
        attend_rows(&self.cfg, shape, q, out, |r| (self.layer_cache(rows[r].seq, layer), rows[r].pos));
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        start_pos: usize,
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        out: &mut CpuAct,
    ) -> Result<()> {
        let cfg = &self.cfg;
        check_shape("attention out", out, q.rows, cfg.q_dim())?;
        let capacity = self.capacity();
        if start_pos + q.rows > capacity {
            return Err(Error::ContextFull { needed: start_pos + q.rows, capacity });
        }
        let kv = &mut self.kv[self.current];
        for r in 0..k.rows {
            kv.write(layer, start_pos + r, k.row(r), v.row(r));
        }
        let shape = self.attention_shape(layer);
        let cache = self.layer_cache(self.current, layer);
        attend_rows(&self.cfg, shape, q, out, |r| (cache, start_pos + r));
        Ok(())
    }

    fn route(&mut self, layer: usize, x: &CpuAct, routes: &mut RouteTable) -> Result<()> {
        let router = self.dense.layers[layer]
            .router()
            .ok_or_else(|| Error::Backend(format!("layer {layer} is a dense layer and has no router")))?;
        let (k, routing) = (self.cfg.experts_per_token, self.cfg.recipe.routing);
        route_rows(router, k, routing, &x.data, x.width, &mut self.router_logits, routes);
        Ok(())
    }

    fn dense_mlp(&mut self, layer: usize, x: &CpuAct, out: &mut CpuAct) -> Result<()> {
        check_shape("dense mlp out", out, x.rows, self.cfg.hidden_size)?;
        let FeedForward::Dense(w) = &self.dense.layers[layer].ffn else {
            return Err(Error::Backend(format!("layer {layer} is a MoE layer, not a dense one")));
        };
        // A dense MLP is an expert of weight one.
        moe::expert_rows(&self.cfg, w, &x.data, x.rows, &mut self.moe, &mut out.data);
        Ok(())
    }

    fn experts(&mut self, layer: usize, x: &CpuAct, routes: &RouteTable, out: &mut CpuAct) -> Result<()> {
        check_shape("experts out", out, x.rows, self.cfg.hidden_size)?;
        let near_end_layer = self.prediction.near_end.take().filter(|&n| n == layer + 1);
        // An early prediction of the next layer, made for this layer's routing.
        let next = match self.prediction.pending.take() {
            Some(next) if next == layer + 1 => Some((next, self.prediction.guess.experts.as_slice())),
            Some(_) | None => None,
        };
        let source = self.experts.as_ref();
        // The late prediction made a step early: from the residual plus every expert of
        // this layer but the one still being read. The prediction after the layer then
        // supersedes it (the reads it drops are cancelled or stopped part-read).
        let (cfg, layers) = (&self.cfg, &self.dense.layers);
        let (residual, near_end_guess) = (&self.prediction.residual, &self.prediction.near_end_guess);
        let predict_near_end = |partial: &[f32]| {
            let Some(next) = near_end_layer else { return };
            let mut g = near_end_guess.lock().unwrap_or_else(PoisonError::into_inner);
            g.rows.clear();
            g.rows.extend(residual.iter().zip(partial).map(|(r, p)| r + p));
            if g.predict(cfg, &layers[next]) {
                source.prefetch(next, &g.experts);
            }
        };
        let near_end: Option<moe::NearEnd<'_>> = near_end_layer.map(|_| &predict_near_end as _);
        moe::moe_forward(
            &self.cfg,
            source,
            layer,
            &x.data,
            routes,
            next,
            near_end,
            self.completion_driven,
            &mut self.moe,
            &mut out.data,
        )
    }

    fn add(&mut self, x: &mut CpuAct, y: &CpuAct) -> Result<()> {
        check_shape("add", x, y.rows, y.width)?;
        for (a, &b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    fn copy_rows(&mut self, src: &CpuAct, first_row: usize, dst: &mut CpuAct) -> Result<()> {
        if dst.width != src.width || first_row + dst.rows > src.rows {
            return Err(Error::Backend("copy_rows: rows out of range".into()));
        }
        let w = src.width;
        dst.data.copy_from_slice(&src.data[first_row * w..(first_row + dst.rows) * w]);
        Ok(())
    }

    fn read(&mut self, x: &CpuAct) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn read_routes(&mut self, routes: &RouteTable) -> Result<RouteTable> {
        Ok(routes.clone())
    }

    fn expert_stats(&self) -> ExpertStats {
        self.experts.stats()
    }

    fn predict_next(&mut self, next: usize, at: LayerPoint, rows: RowKind, x: &CpuAct) -> Result<()> {
        if next >= self.cfg.num_layers {
            return Ok(());
        }
        // The layer the residual is inside of, at `BeforeMlp` (none before layer 0).
        let inside = match (at, next.checked_sub(1)) {
            (LayerPoint::BeforeMlp, None) => return Ok(()),
            (LayerPoint::BeforeMlp, layer) => layer,
            (LayerPoint::LayerInput, _) => None,
        };
        // A decoded row's residual before a MoE block, kept for the near-end prediction of
        // the late predictor (see `experts`).
        let near_end = self.predict == Predict::Late
            && rows == RowKind::Decode
            && x.rows == 1
            && inside.is_some_and(|layer| self.cfg.mlp_kinds[layer] == MlpKind::Moe)
            && self.dense.layers[next].router().is_some();
        if near_end {
            self.prediction.residual.clear();
            self.prediction.residual.extend_from_slice(&x.data);
            self.prediction.near_end = Some(next);
        }
        let due = match (self.predict, at) {
            (Predict::Early, LayerPoint::BeforeMlp) | (Predict::Late, LayerPoint::LayerInput) => true,
            // Layer 0 has no point before its input: both predictors use the embedding.
            (Predict::Early, LayerPoint::LayerInput) => next == 0,
            (Predict::Late, LayerPoint::BeforeMlp) | (Predict::Off, _) => false,
        };
        // Predicting L+2 as well was measured to waste five times as many reads for no gain
        // (docs/perf.md), so the prediction looks one layer ahead.
        if !due {
            return Ok(());
        }
        // Each row's residual through layer `next`'s router; the union over the rows (a
        // batched step's sequences).
        check_shape("prediction input", x, x.rows, self.cfg.hidden_size)?;
        let guess = &mut self.prediction.guess;
        guess.rows.clear();
        guess.rows.extend_from_slice(&x.data);
        if !guess.predict(&self.cfg, &self.dense.layers[next]) {
            return Ok(());
        }
        match rows {
            RowKind::Decode => {}
            // A prompt block's next layer asks for its union group by group in ascending
            // order (`moe_forward`), each group as large as the source's batch limit: the
            // predicted union in that order, as much of it as the first group holds, is read
            // while this layer finishes and the next one's attention runs, so the disk does
            // not idle between layers.
            RowKind::Prompt => {
                guess.experts.sort_unstable();
                guess.experts.truncate(self.experts.batch_limit());
            }
        }
        match inside.map(|layer| self.cfg.mlp_kinds[layer]) {
            // This layer's experts are not secured yet: issued by `experts` once they are, so
            // that the prediction's reads cannot take their room first.
            Some(MlpKind::Moe) => self.prediction.pending = Some(next),
            Some(MlpKind::Dense) | None => self.experts.prefetch(next, &guess.experts),
        }
        Ok(())
    }

    fn report(&self) -> Vec<String> {
        Vec::new()
    }
}
