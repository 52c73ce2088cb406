//! The forward pass of every model family, written once over the [`Backend`] ops; the
//! config's layer recipe says which optional steps a family has.
//!
//! Per layer: RMSNorm, Q/K/V (with bias where the family has them), QK-norm per head
//! (Qwen3-MoE), RoPE on Q and K, attention over the cache (with sinks in GPT-OSS; sliding on
//! sliding layers), output projection, residual; RMSNorm, then on a MoE layer the router's
//! rule and the experts, on a dense layer one gated MLP; residual. Then the final RMSNorm and
//! the head.

use std::time::{Duration, Instant};

use crate::backend::{Backend, LayerPoint, LinearId, NormId, RouteTable, RowKind, SeqPos};
use crate::config::MlpKind;
use crate::engine::{Pick, Picked};
use crate::error::{Error, Result};

/// Which positions of a batch get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// Only the last position (generation).
    Last,
    /// Every position (scoring, `--logits-out`, validation).
    All,
    /// None: only the key/value cache is filled (consuming a token nobody needs logits of).
    None,
}

/// Receives intermediate values during a forward pass (validation checkpoints, seed 0.3).
/// Observing forces readbacks, so it is for tests and diagnostics only; [`NoObserver`]
/// turns it off.
pub trait Observer {
    /// Whether to read anything back at all.
    fn enabled(&self) -> bool {
        true
    }
    /// The residual stream entering layer `layer` (layer == num_layers: after the last),
    /// `[rows, hidden]`, for positions `start_pos..`.
    fn residual(&mut self, _layer: usize, _start_pos: usize, _rows: &[f32]) {}
    /// The routing decision of `layer` (a MoE layer; dense layers have none) for
    /// positions `start_pos..`.
    fn routes(&mut self, _layer: usize, _start_pos: usize, _routes: &RouteTable) {}
}

/// Observes nothing (no readbacks).
pub struct NoObserver;

impl Observer for NoObserver {
    fn enabled(&self) -> bool {
        false
    }
}

/// Where time went, by phase (wall clock on the calling thread).
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimes {
    /// Norm, projections, RoPE, attention, output projection.
    pub attention: Duration,
    /// Norm, routing, experts (including waiting for expert weights).
    pub experts: Duration,
    /// Final norm and output head, with the readback.
    pub head: Duration,
}

/// Where the rows of a block sit in the key/value caches.
#[derive(Clone, Copy, Debug)]
enum Placement<'a> {
    /// Consecutive positions from `start_pos` of the backend's selected sequence (a prompt
    /// block, or one token).
    Run {
        /// Position of the first row.
        start_pos: usize,
    },
    /// One row per sequence, each at its own position (a batched decode step).
    Rows(&'a [SeqPos]),
}

/// Scratch buffers for a batch of a given size, reused across calls.
struct Scratch<B: Backend> {
    rows: usize,
    x: B::Act,
    normed: B::Act,
    q: B::Act,
    k: B::Act,
    v: B::Act,
    attn: B::Act,
    proj: B::Act,
    routes: B::Routes,
}

/// A backend plus the buffers and counters of the forward pass.
pub struct Forward<B: Backend> {
    backend: B,
    scratch: Option<Scratch<B>>,
    /// Largest number of positions processed in one batch.
    max_batch: usize,
    times: PhaseTimes,
}

impl<B: Backend> Forward<B> {
    /// Wraps a backend. Prompts longer than `max_batch` are processed in blocks.
    pub fn new(backend: B, max_batch: usize) -> Self {
        Forward { backend, scratch: None, max_batch: max_batch.max(1), times: PhaseTimes::default() }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, to change (add sequences).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Largest number of positions processed in one batch (the prefill block).
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Time spent so far, by phase.
    pub fn times(&self) -> PhaseTimes {
        self.times
    }

    /// Runs `ids` at positions `start_pos..` and returns logits (`[rows, vocab]`, rows as
    /// `logits` asks). The caller has validated IDs and capacity.
    pub fn run(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        logits: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        let blocks = ids.len().div_ceil(self.max_batch);
        for (b, block) in ids.chunks(self.max_batch).enumerate() {
            let last_block = b + 1 == blocks;
            let rows = match logits {
                LogitRows::All => Some(0..block.len()),
                LogitRows::Last if last_block => Some(block.len() - 1..block.len()),
                LogitRows::Last | LogitRows::None => None,
            };
            let pos = start_pos + b * self.max_batch;
            let part = self.run_block(block, pos, rows, observer)?;
            out.extend_from_slice(&part);
        }
        Ok(out)
    }

    /// Runs `ids` on sequence `seq` of the backend (see [`Backend::add_sequence`]) at
    /// positions `start_pos..`, as [`run`](Self::run) does on the first.
    pub fn run_on(
        &mut self,
        seq: usize,
        ids: &[u32],
        start_pos: usize,
        logits: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        self.backend.select_sequence(seq)?;
        self.run(ids, start_pos, logits, observer)
    }

    /// One batched decode step: advances each sequence `rows[i].seq` by the token `ids[i]`
    /// at position `rows[i].pos`, and returns every row's logits (`[rows, vocab]`). The dense
    /// products run over all rows at once, each expert of the step's union once over the
    /// rows that chose it, and attention per row over its own sequence's cache. Every kernel
    /// computes a row exactly as it would alone, so on the CPU each row's logits equal, bit
    /// for bit, those of running its sequence alone. The caller has validated IDs and
    /// capacity; the sequences must be distinct.
    pub fn step(&mut self, rows: &[SeqPos], ids: &[u32]) -> Result<Vec<f32>> {
        if rows.len() != ids.len() {
            return Err(Error::Backend(format!("step: {} tokens for {} rows", ids.len(), rows.len())));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let logits = self.step_layers(rows, ids)?;
        self.read_logits(logits)
    }

    /// The layers and the head of a batched step (`rows`, `ids` checked non-empty and of
    /// one length): every row's logits, on the device.
    fn step_layers(&mut self, rows: &[SeqPos], ids: &[u32]) -> Result<Option<B::Act>> {
        let mut s = self.scratch(ids.len())?;
        let (times, scratch, all) = (&mut self.times, &mut s, Some(0..ids.len()));
        let placement = Placement::Rows(rows);
        let result =
            self.backend.on_workers(move |b| layers(b, times, scratch, ids, placement, all, &mut NoObserver));
        self.scratch = Some(s);
        result
    }

    /// [`step`](Self::step) where row `i` hands back what `picks[i]` asks: logits rows
    /// read back together, greedy tokens found by [`Backend::argmax_rows`] (8 bytes a row),
    /// planned picks reduced by [`Backend::reduce_logits`] row by row.
    pub fn step_picks(&mut self, rows: &[SeqPos], ids: &[u32], picks: &[Pick]) -> Result<Vec<Picked>> {
        if rows.len() != ids.len() || picks.len() != ids.len() {
            return Err(Error::Backend(format!(
                "step: {} tokens and {} picks for {} rows",
                ids.len(),
                picks.len(),
                rows.len()
            )));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let logits = self
            .step_layers(rows, ids)?
            .ok_or_else(|| Error::Backend("the step computed no logits".into()))?;
        let t0 = Instant::now();
        let vocab = self.backend.config().vocab_size;
        let values = match picks.iter().any(|p| matches!(p, Pick::Logits)) {
            true => self.backend.read(&logits)?,
            false => Vec::new(),
        };
        let greedy = match picks.iter().any(|p| matches!(p, Pick::Greedy)) {
            true => self.backend.argmax_rows(&logits, rows[0].pos).map_err(|e| match e {
                // The device names the row's index; name the rows' positions instead.
                Error::Tensor { .. } => Error::tensor(
                    "logits",
                    format!(
                        "the model produced non-finite logits in a batched step (positions {:?}); its weights are \
                         likely corrupt or non-finite: run `picchio verify` on the model",
                        rows.iter().map(|r| r.pos).collect::<Vec<_>>()
                    ),
                ),
                other => other,
            })?,
            false => Vec::new(),
        };
        let mut out = Vec::with_capacity(picks.len());
        for (r, pick) in picks.iter().enumerate() {
            out.push(match pick {
                Pick::Nothing => Picked::Nothing,
                Pick::Logits => Picked::Logits(values[r * vocab..(r + 1) * vocab].to_vec()),
                Pick::Greedy => Picked::Greedy(greedy[r]),
                Pick::Planned(plan) => Picked::Planned(self.backend.reduce_logits(&logits, r, plan)?),
            });
        }
        self.times.head += t0.elapsed();
        Ok(out)
    }

    /// Runs `ids` at positions `start_pos..` of the selected sequence and returns the
    /// argmax of the last position's logits (the greedy next token), as
    /// [`Backend::argmax_rows`] finds it: a GPU reads back the token ID, not the logits.
    /// The caller has validated IDs and capacity.
    pub fn run_greedy(&mut self, ids: &[u32], start_pos: usize) -> Result<u32> {
        let logits = self.last_logits(ids, start_pos)?;
        let t0 = Instant::now();
        let token = self.backend.argmax_rows(&logits, start_pos + ids.len() - 1)?;
        self.times.head += t0.elapsed();
        token.first().copied().ok_or_else(|| Error::Backend("argmax of no rows".into()))
    }

    /// Runs `ids` at positions `start_pos..` of the selected sequence and hands back what
    /// `pick` asks of the last position ([`crate::engine::Runner::forward_pick`]): a
    /// greedy token is found by [`Backend::argmax_rows`] and a planned pick reduced by
    /// [`Backend::reduce_logits`] where the logits are. The caller has validated IDs and
    /// capacity.
    pub fn run_pick(&mut self, ids: &[u32], start_pos: usize, pick: &Pick) -> Result<Picked> {
        match pick {
            Pick::Nothing => {
                self.run(ids, start_pos, LogitRows::None, &mut NoObserver).map(|_| Picked::Nothing)
            }
            Pick::Logits => self.run(ids, start_pos, LogitRows::Last, &mut NoObserver).map(Picked::Logits),
            Pick::Greedy => self.run_greedy(ids, start_pos).map(Picked::Greedy),
            Pick::Planned(plan) => {
                // The last position's logits are the block's only row.
                let logits = self.last_logits(ids, start_pos)?;
                let t0 = Instant::now();
                let reduced = self.backend.reduce_logits(&logits, 0, plan);
                self.times.head += t0.elapsed();
                reduced.map(Picked::Planned)
            }
        }
    }

    /// Runs `ids` block by block and returns the last position's logits, on the device.
    fn last_logits(&mut self, ids: &[u32], start_pos: usize) -> Result<B::Act> {
        if ids.is_empty() {
            return Err(Error::invalid("a decoding step needs at least one token"));
        }
        let blocks = ids.len().div_ceil(self.max_batch);
        let mut logits = None;
        for (b, block) in ids.chunks(self.max_batch).enumerate() {
            let rows = (b + 1 == blocks).then(|| block.len() - 1..block.len());
            logits = self.run_layers(block, start_pos + b * self.max_batch, rows, &mut NoObserver)?;
        }
        logits.ok_or_else(|| Error::Backend("the last block computed no logits".into()))
    }

    /// Reads the logits a block computed back to the host (none: an empty vector).
    fn read_logits(&mut self, logits: Option<B::Act>) -> Result<Vec<f32>> {
        let Some(logits) = logits else {
            return Ok(Vec::new());
        };
        let t0 = Instant::now();
        let out = self.backend.read(&logits);
        self.times.head += t0.elapsed();
        out
    }

    fn scratch(&mut self, rows: usize) -> Result<Scratch<B>> {
        if let Some(s) = self.scratch.take()
            && s.rows == rows
        {
            return Ok(s);
        }
        let cfg = self.backend.config().clone();
        let b = &mut self.backend;
        Ok(Scratch {
            rows,
            x: b.alloc(rows, cfg.hidden_size)?,
            normed: b.alloc(rows, cfg.hidden_size)?,
            q: b.alloc(rows, cfg.q_dim())?,
            k: b.alloc(rows, cfg.kv_dim())?,
            v: b.alloc(rows, cfg.kv_dim())?,
            attn: b.alloc(rows, cfg.q_dim())?,
            proj: b.alloc(rows, cfg.hidden_size)?,
            routes: b.alloc_routes(rows)?,
        })
    }

    fn run_block(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        logit_rows: Option<std::ops::Range<usize>>,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        let logits = self.run_layers(ids, start_pos, logit_rows, observer)?;
        self.read_logits(logits)
    }

    /// The layers and head of one block, leaving the logits of `logit_rows` on the device.
    fn run_layers(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        logit_rows: Option<std::ops::Range<usize>>,
        observer: &mut dyn Observer,
    ) -> Result<Option<B::Act>> {
        let mut s = self.scratch(ids.len())?;
        let placement = Placement::Run { start_pos };
        let result = if observer.enabled() {
            layers(&mut self.backend, &mut self.times, &mut s, ids, placement, logit_rows, observer)
        } else {
            // Without an observer (which need not be `Send`) the block runs where the
            // backend's parallel ops start cheapest.
            let (times, scratch) = (&mut self.times, &mut s);
            self.backend
                .on_workers(move |b| layers(b, times, scratch, ids, placement, logit_rows, &mut NoObserver))
        };
        self.scratch = Some(s);
        result
    }
}

/// The layers and the head over one block of rows placed as `placement` says: the model's
/// math, in the order the module documentation gives, timed by phase into `times`.
/// Observers see positions from the block's start (0 for a batched step, which runs
/// without one).
fn layers<B: Backend>(
    b: &mut B,
    times: &mut PhaseTimes,
    s: &mut Scratch<B>,
    ids: &[u32],
    placement: Placement<'_>,
    logit_rows: Option<std::ops::Range<usize>>,
    observer: &mut dyn Observer,
) -> Result<Option<B::Act>> {
    let start_pos = match placement {
        Placement::Run { start_pos } => start_pos,
        Placement::Rows(_) => 0,
    };
    // A one-row run is a decoded token; more rows of one run are a prompt block.
    let row_kind = match placement {
        Placement::Run { .. } if ids.len() > 1 => RowKind::Prompt,
        Placement::Run { .. } | Placement::Rows(_) => RowKind::Decode,
    };
    let observe = observer.enabled();
    let layers = b.config().num_layers;
    let qk_norm = b.config().recipe.qk_norm;
    b.embed(ids, &mut s.x)?;
    for layer in 0..layers {
        if observe {
            observer.residual(layer, start_pos, &b.read(&s.x)?);
        }
        let t0 = Instant::now();
        b.predict_next(layer, LayerPoint::LayerInput, row_kind, &s.x)?;
        let fused = match placement {
            Placement::Run { start_pos } => b.fused_attention(layer, start_pos, &mut s.x)?,
            Placement::Rows(rows) => b.fused_attention_rows(layer, rows, &mut s.x)?,
        };
        if !fused {
            b.rms_norm(NormId::Attention(layer), &s.x, &mut s.normed)?;
            b.linear_qkv(layer, &s.normed, &mut s.q, &mut s.k, &mut s.v)?;
            if qk_norm {
                b.rms_norm_heads(NormId::Query(layer), &mut s.q)?;
                b.rms_norm_heads(NormId::Key(layer), &mut s.k)?;
            }
            match placement {
                Placement::Run { start_pos } => {
                    b.rope(&mut s.q, start_pos)?;
                    b.rope(&mut s.k, start_pos)?;
                    b.attention(layer, start_pos, &s.q, &s.k, &s.v, &mut s.attn)?;
                }
                Placement::Rows(rows) => {
                    b.rope_rows(&mut s.q, rows)?;
                    b.rope_rows(&mut s.k, rows)?;
                    b.attention_rows(layer, rows, &s.q, &s.k, &s.v, &mut s.attn)?;
                }
            }
            b.linear(LinearId::O(layer), &s.attn, &mut s.proj)?;
            b.add(&mut s.x, &s.proj)?;
        }
        let t1 = Instant::now();
        let moe = b.config().mlp_kinds[layer] == MlpKind::Moe;
        if moe && b.fused_moe(layer, &mut s.x, &mut s.routes)? {
            if observe {
                observer.routes(layer, start_pos, &b.read_routes(&s.routes)?);
            }
        } else {
            b.rms_norm(NormId::Mlp(layer), &s.x, &mut s.normed)?;
            if moe {
                b.route(layer, &s.normed, &mut s.routes)?;
                if observe {
                    observer.routes(layer, start_pos, &b.read_routes(&s.routes)?);
                }
                b.predict_next(layer + 1, LayerPoint::BeforeMlp, row_kind, &s.x)?;
                b.experts(layer, &s.normed, &s.routes, &mut s.proj)?;
            } else {
                b.predict_next(layer + 1, LayerPoint::BeforeMlp, row_kind, &s.x)?;
                b.dense_mlp(layer, &s.normed, &mut s.proj)?
            }
            b.add(&mut s.x, &s.proj)?;
        }
        let t2 = Instant::now();
        times.attention += t1 - t0;
        times.experts += t2 - t1;
    }
    if observe {
        observer.residual(layers, start_pos, &b.read(&s.x)?);
    }
    let Some(rows) = logit_rows else {
        return Ok(None);
    };
    let t0 = Instant::now();
    let vocab = b.config().vocab_size;
    let hidden = b.config().hidden_size;
    let mut logits = b.alloc(rows.len(), vocab)?;
    if rows.len() == ids.len() {
        head(b, &s.x, &mut s.normed, &mut logits)?;
    } else {
        let mut selected = b.alloc(rows.len(), hidden)?;
        b.copy_rows(&s.x, rows.start, &mut selected)?;
        let mut normed = b.alloc(rows.len(), hidden)?;
        head(b, &selected, &mut normed, &mut logits)?;
    }
    times.head += t0.elapsed();
    Ok(Some(logits))
}

/// `logits = head(rms_norm_final(x))`, fused where the backend can (`normed` is scratch of
/// `x`'s shape).
fn head<B: Backend>(b: &mut B, x: &B::Act, normed: &mut B::Act, logits: &mut B::Act) -> Result<()> {
    if b.fused_head(x, logits)? {
        return Ok(());
    }
    b.rms_norm(NormId::Final, x, normed)?;
    b.linear(LinearId::LmHead, normed, logits)
}
