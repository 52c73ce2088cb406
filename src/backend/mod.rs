//! The boundary between the model math and the hardware that runs it.
//!
//! The forward pass (`model::forward`) is written once, as a sequence of [`Backend`] ops
//! over activations that live on the backend's device. The CPU backend computes each op
//! immediately; a GPU backend records them and synchronizes only in [`Backend::read`].

pub mod cpu;
mod decode_counters;
pub mod gpu;

pub use decode_counters::DecodeCounters;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::experts::ExpertStats;
use crate::sample::{PlannedLogits, SamplePlan};

/// A dense linear layer of the model, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearId {
    /// Query projection of a layer.
    Q(usize),
    /// Key projection of a layer.
    K(usize),
    /// Value projection of a layer.
    V(usize),
    /// Attention output projection of a layer.
    O(usize),
    /// Router of a layer.
    Router(usize),
    /// Output head.
    LmHead,
}

/// An RMSNorm weight of the model, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormId {
    /// Before attention in a layer.
    Attention(usize),
    /// Before the MoE block in a layer.
    Mlp(usize),
    /// Before the output head.
    Final,
    /// Over each query head of a layer, before RoPE (QK-norm).
    Query(usize),
    /// Over each key head of a layer, before RoPE (QK-norm).
    Key(usize),
}

/// The routing decision for a batch of rows: for each row, `k` experts in descending
/// router-logit order and their softmax weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteTable {
    /// Experts per row.
    pub k: usize,
    /// `rows * k` expert indices.
    pub experts: Vec<u32>,
    /// `rows * k` weights.
    pub weights: Vec<f32>,
}

impl RouteTable {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.experts.len().checked_div(self.k).unwrap_or(0)
    }

    /// Experts of row `r`.
    pub fn row_experts(&self, r: usize) -> &[u32] {
        &self.experts[r * self.k..(r + 1) * self.k]
    }

    /// Weights of row `r`.
    pub fn row_weights(&self, r: usize) -> &[f32] {
        &self.weights[r * self.k..(r + 1) * self.k]
    }
}

/// When the next layer's experts are predicted and prefetched (`--predict`). A prediction
/// only starts background reads of layer L+1's experts; the real router of L+1 still decides,
/// so no setting changes a number.
///
/// Both predictions run router L+1 over a residual normalized with L+1's pre-MoE norm; they
/// differ in which residual, so in accuracy and in how long their reads have to land. `Late`
/// is the default because it is right far more often: on the 6-layer synthetic 120B with a
/// 1.5 GiB cache, 87.5% of the routed experts against 54.1% for `Early`, which read 22% more
/// records per decoded token than `Late` (36% more than no prediction) to hide them; on the
/// tiny fixtures 88.5% / 70.3% (GPT-OSS) and 89.6% / 78.1% (Qwen3-MoE; docs/memory.md,
/// "Predicted prefetch"). `Early`'s reads have all of layer L's expert reads and compute to
/// land in, where `Late`'s have only L+1's attention (one token's: shorter than one record
/// read); whether that pays for its wasted reads is a wall-time question for a quiet machine.
///
/// In a prompt block the prediction is the first group of L+1's union (the CPU backend reads
/// a union in ascending groups as large as the RAM cache takes at once), so the disk works
/// through L's last computations and L+1's attention instead of idling between layers.
///
/// Layer 0 has no layer before it: both predict it from the token rows' embedding
/// ([`LayerPoint::LayerInput`]), so a decode step's first reads start during layer 0's
/// attention rather than after its routing (on the 12-layer synthetic 120B, skewed routing,
/// 81% right, and the disk idle 3 ms less a decoded token besides the head; docs/perf.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Predict {
    /// Once layer L's routing is known: from the residual entering L's MoE block (after L's
    /// attention), so L's whole MoE block is missing from the real input of L+1's router.
    /// The reads are issued once L's own experts are secured in the cache (pinned or
    /// reading), so they cannot take their room.
    Early,
    /// After layer L: from the residual leaving L, so only L+1's attention is missing (more
    /// accurate, but little time left to read).
    #[default]
    Late,
    /// No prediction (prefill blocks still load the next group of a layer's exact union
    /// ahead).
    Off,
}

/// A point at which the forward pass offers the residual stream for the prediction of a
/// layer's experts ([`Backend::predict_next`], which names the layer predicted, `next`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerPoint {
    /// Inside layer `next - 1`, once its MLP block's input is known (after attention; on a
    /// MoE layer, after routing and before the experts are read): where [`Predict::Early`]
    /// predicts.
    BeforeMlp,
    /// The input of layer `next`: what layer `next - 1` left, or for layer 0 the token rows'
    /// embedding. The guess misses only layer `next`'s attention. Where [`Predict::Late`]
    /// predicts every layer, and [`Predict::Early`] layer 0 (which has no earlier point): a
    /// decode step's first reads then run during layer 0's attention instead of after it.
    LayerInput,
}

/// What the rows of a forward block are, for the prediction: a prompt block's experts are
/// known exactly (its routing's union, loaded ahead group by group), a decode step's next
/// layer is not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// Consecutive positions of one sequence (a prefill block of two or more rows).
    Prompt,
    /// Each row one sequence's next token (a single decoded token, or a batched step).
    Decode,
}

/// Where one row of a batched decode step sits: the sequence whose key/value cache it
/// extends, and its position there. A step advances several sequences by one token each,
/// so each row attends over its own sequence's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqPos {
    /// The sequence (its key/value cache), from [`Backend::add_sequence`]; 0 is the first.
    pub seq: usize,
    /// The row's position in that sequence.
    pub pos: usize,
}

/// The error of a backend asked for a sequence or a batched step it does not have.
fn one_sequence(what: &str) -> crate::error::Error {
    crate::error::Error::Backend(format!(
        "{what}: this backend keeps one key/value cache (one sequence) and has no batched decode step"
    ))
}

/// Ops the forward pass needs. Activations are `[rows, width]` row-major f32 owned by the
/// backend; row `i` of a batch starting at `start_pos` is the token at position
/// `start_pos + i`. The key/value cache lives inside the backend.
pub trait Backend {
    /// Activations on the device.
    type Act: Send;
    /// A routing decision on the device.
    type Routes: Send;

    /// One line describing the backend (device, kernels).
    fn describe(&self) -> String;
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// Positions the key/value cache can hold.
    fn capacity(&self) -> usize;

    /// A `[rows, width]` activation buffer (contents unspecified).
    fn alloc(&mut self, rows: usize, width: usize) -> Result<Self::Act>;
    /// A routing buffer for `rows` rows.
    fn alloc_routes(&mut self, rows: usize) -> Result<Self::Routes>;

    /// `out[i] = embed[ids[i]]`. IDs are already validated against the vocabulary.
    fn embed(&mut self, ids: &[u32], out: &mut Self::Act) -> Result<()>;
    /// `out = rmsnorm(x) * weight`, row by row.
    fn rms_norm(&mut self, norm: NormId, x: &Self::Act, out: &mut Self::Act) -> Result<()>;
    /// RMSNorm of every `head_dim` slice of every row of `x`, in place, with the weight of
    /// `norm` ([`NormId::Query`] or [`NormId::Key`]): QK-norm, for families with it.
    fn rms_norm_heads(&mut self, norm: NormId, x: &mut Self::Act) -> Result<()>;
    /// `out = W x + b`, row by row.
    fn linear(&mut self, w: LinearId, x: &Self::Act, out: &mut Self::Act) -> Result<()>;
    /// The three attention projections of `layer` over the same input: `q = Wq x + bq`,
    /// `k = Wk x + bk`, `v = Wv x + bv`. The default runs [`linear`](Self::linear) three
    /// times; a backend may run them as one product over the stacked matrices.
    fn linear_qkv(
        &mut self,
        layer: usize,
        x: &Self::Act,
        q: &mut Self::Act,
        k: &mut Self::Act,
        v: &mut Self::Act,
    ) -> Result<()> {
        self.linear(LinearId::Q(layer), x, q)?;
        self.linear(LinearId::K(layer), x, k)?;
        self.linear(LinearId::V(layer), x, v)
    }
    /// Rotates every head of every row by its position (`x` is `[rows, heads * head_dim]`).
    fn rope(&mut self, x: &mut Self::Act, start_pos: usize) -> Result<()>;
    /// Stores the rows' keys and values at their positions in the cache of `layer`, then
    /// attends each query row over its visible window (causal; sliding where the layer
    /// slides) with the layer's sinks. `out` is `[rows, heads * head_dim]`.
    fn attention(
        &mut self,
        layer: usize,
        start_pos: usize,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// Router logits of `layer` and the config's routing rule (top-k and the weights),
    /// for every row.
    fn route(&mut self, layer: usize, x: &Self::Act, routes: &mut Self::Routes) -> Result<()>;
    /// `out[r] = sum_j w[r][j] * expert_{e[r][j]}(x[r])`, summed in routing order.
    fn experts(
        &mut self,
        layer: usize,
        x: &Self::Act,
        routes: &Self::Routes,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// The dense gated MLP of a dense layer (`MlpKind::Dense`): `out[r] = mlp(x[r])`.
    fn dense_mlp(&mut self, layer: usize, x: &Self::Act, out: &mut Self::Act) -> Result<()>;
    /// `x += y`.
    fn add(&mut self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    /// Copies `dst.rows` rows of `src`, starting at row `first_row`, into `dst`.
    fn copy_rows(&mut self, src: &Self::Act, first_row: usize, dst: &mut Self::Act) -> Result<()>;

    /// Reads activations back to the host (a synchronization point).
    fn read(&mut self, x: &Self::Act) -> Result<Vec<f32>>;
    /// Reads a routing decision back to the host (for observers and verification).
    fn read_routes(&mut self, routes: &Self::Routes) -> Result<RouteTable>;

    /// Called twice in every layer, at each [`LayerPoint`], with the residual stream there:
    /// a backend may predict layer `next`'s experts from it and start loading them (which
    /// point it uses is its [`Predict`] setting). `next` past the last layer, or
    /// [`LayerPoint::BeforeMlp`] with `next == 0` (no layer before the first), asks for
    /// nothing. `rows` says whether the block is a prompt block or a decode step. Must not
    /// change results. Required, so that each backend says what it does.
    fn predict_next(&mut self, next: usize, at: LayerPoint, rows: RowKind, x: &Self::Act) -> Result<()>;

    /// The attention half of layer `layer` as one fused sequence of kernels, for the
    /// `x.rows()` positions from `start_pos` of the selected sequence: `x += O(attention(
    /// rope(QKV(rms_norm(x)))))` with the key/value cache extended, the same math as the
    /// ops one by one. Returns `false`, having done nothing, where the backend has no fused
    /// path for this block; the forward pass then runs the ops. The default has none, so
    /// the CPU oracle stays the plain sequence of ops.
    fn fused_attention(&mut self, _layer: usize, _start_pos: usize, _x: &mut Self::Act) -> Result<bool> {
        Ok(false)
    }

    /// [`fused_attention`](Self::fused_attention) for the rows of a batched decode step: row
    /// `i` of `x` is a token of sequence `rows[i].seq` at position `rows[i].pos`, as in
    /// [`attention_rows`](Self::attention_rows). `false`, having done nothing, where the
    /// backend has no fused path; the default has none.
    fn fused_attention_rows(&mut self, _layer: usize, _rows: &[SeqPos], _x: &mut Self::Act) -> Result<bool> {
        Ok(false)
    }

    /// The MoE half of layer `layer` fused: `x += experts(rms_norm(x))` by the layer's
    /// routing, which is left in `routes` (for observers). A backend that fuses it also
    /// makes its own prediction of the next layer (the forward pass then skips
    /// [`predict_next`](Self::predict_next) at [`LayerPoint::BeforeMlp`]). Returns `false`,
    /// having done nothing, where it has no fused path; the default has none.
    fn fused_moe(&mut self, _layer: usize, _x: &mut Self::Act, _routes: &mut Self::Routes) -> Result<bool> {
        Ok(false)
    }

    /// `logits = head(rms_norm_final(x))` in one fused step. Returns `false`, having done
    /// nothing, where the backend has no fused path; the default has none.
    fn fused_head(&mut self, _x: &Self::Act, _logits: &mut Self::Act) -> Result<bool> {
        Ok(false)
    }

    /// The argmax of every row of `logits` (`[rows, vocab]`; the first of equal maxima, as
    /// [`crate::model::math::argmax_with_margin`]), failing as the sampler does
    /// ([`crate::sample::check_finite`]) when a row holds a non-finite value;
    /// `first_position` names the first row's position in that error. A synchronization
    /// point. The default reads the logits back; a GPU reads back only the IDs.
    fn argmax_rows(&mut self, logits: &Self::Act, first_position: usize) -> Result<Vec<u32>> {
        let values = self.read(logits)?;
        let vocab = self.config().vocab_size;
        let mut out = Vec::with_capacity(values.len() / vocab.max(1));
        for (r, row) in values.chunks(vocab.max(1)).enumerate() {
            crate::sample::check_finite(row, first_position + r)?;
            out.push(crate::model::math::argmax_with_margin(row).0 as u32);
        }
        Ok(out)
    }

    /// Row `row` of `logits` (`[rows, vocab]`) adjusted by `plan`'s bias and penalties and
    /// reduced as it asks ([`crate::sample::SamplePlan`]): candidates that decide the pick,
    /// or the whole adjusted row. A synchronization point. The default reads the logits
    /// back and adjusts the row on the host; a GPU adjusts and ranks on the device and reads
    /// back the candidates (kilobytes), reading the row only when they do not decide.
    fn reduce_logits(&mut self, logits: &Self::Act, row: usize, plan: &SamplePlan) -> Result<PlannedLogits> {
        let values = self.read(logits)?;
        let vocab = self.config().vocab_size;
        let start = row * vocab;
        let mut row = values
            .get(start..start + vocab)
            .ok_or_else(|| Error::Backend(format!("no row {row} in {} logits", values.len())))?
            .to_vec();
        plan.adjust_logits(&mut row);
        Ok(PlannedLogits::Full(row))
    }

    /// Counters of the expert source behind the backend.
    fn expert_stats(&self) -> ExpertStats;

    /// Runs `f` (a whole forward block) where the backend's parallel ops are cheapest to
    /// start. The default runs it here; the CPU backend runs it on a worker of its thread
    /// pool, so that each parallel product forks among workers that are still spinning
    /// rather than waking them, and the caller, from sleep for every product.
    fn on_workers<R: Send>(&mut self, f: impl FnOnce(&mut Self) -> R + Send) -> R
    where
        Self: Sized,
    {
        f(self)
    }

    /// Adds a key/value cache for another sequence (of the same capacity) and returns its
    /// index, so that several conversations share the loaded weights. A backend that keeps
    /// one cache refuses (the default).
    fn add_sequence(&mut self) -> Result<usize> {
        Err(one_sequence("add_sequence"))
    }

    /// Makes [`rope`](Self::rope) and [`attention`](Self::attention) use the cache of
    /// sequence `seq` (0 until changed). The default knows sequence 0 only.
    fn select_sequence(&mut self, seq: usize) -> Result<()> {
        if seq == 0 { Ok(()) } else { Err(one_sequence("select_sequence")) }
    }

    /// [`rope`](Self::rope) for a batched decode step: row `i` is rotated by `rows[i].pos`.
    /// Unsupported by default.
    fn rope_rows(&mut self, _x: &mut Self::Act, _rows: &[SeqPos]) -> Result<()> {
        Err(one_sequence("rope_rows"))
    }

    /// [`attention`](Self::attention) for a batched decode step: row `i` stores its key and
    /// value at `rows[i].pos` in the cache of `rows[i].seq` and attends over that sequence's
    /// visible window. The sequences of the rows are distinct. Unsupported by default.
    fn attention_rows(
        &mut self,
        _layer: usize,
        _rows: &[SeqPos],
        _q: &Self::Act,
        _k: &Self::Act,
        _v: &Self::Act,
        _out: &mut Self::Act,
    ) -> Result<()> {
        Err(one_sequence("attention_rows"))
    }

    /// Lines about the device for `--stats` (submissions, readbacks, VRAM cache); empty
    /// when the backend has nothing to add.
    fn report(&self) -> Vec<String> {
        Vec::new()
    }

    /// What the device was asked to do during decode steps (dispatches by layer,
    /// submissions, readbacks); `None` for a backend that does not count them (the CPU).
    fn decode_counters(&self) -> Option<DecodeCounters> {
        None
    }
}

/// An error unless a buffer of shape `have` (rows, width) has the shape `want`; `what` names
/// the operation.
pub(crate) fn check_shape(
    what: &str,
    have: (usize, usize),
    want: (usize, usize),
) -> crate::error::Result<()> {
    if have == want {
        return Ok(());
    }
    Err(crate::error::Error::Backend(format!(
        "{what}: buffer is [{}, {}], expected [{}, {}]",
        have.0, have.1, want.0, want.1
    )))
}

/// An error unless `seq` is one of a backend's `sequences` key/value caches.
pub(crate) fn check_sequence(seq: usize, sequences: usize) -> crate::error::Result<()> {
    if seq < sequences {
        return Ok(());
    }
    Err(crate::error::Error::Backend(format!("sequence {seq} does not exist ({sequences} key/value caches)")))
}

/// An error unless `rows` places `n` rows of a batched step: distinct sequences among the
/// backend's `sequences`, each position within the cache `capacity`.
pub(crate) fn check_step_rows(
    n: usize,
    rows: &[SeqPos],
    sequences: usize,
    capacity: usize,
) -> crate::error::Result<()> {
    use crate::error::Error;
    if rows.len() != n {
        return Err(Error::Backend(format!("batched step: {n} rows but {} placements", rows.len())));
    }
    for (i, at) in rows.iter().enumerate() {
        check_sequence(at.seq, sequences)?;
        if at.pos >= capacity {
            return Err(Error::ContextFull { needed: at.pos + 1, capacity });
        }
        if rows[..i].iter().any(|other| other.seq == at.seq) {
            return Err(Error::Backend(format!("batched step: sequence {} has two rows", at.seq)));
        }
    }
    Ok(())
}
