//! The MoE block on the CPU: each expert of the batch's union is fetched once and applied
//! to every row that chose it, as one batched product; each row's contributions are then
//! summed in routing order, so the result is the same for any batch size, fetch order or
//! cache state.

use std::sync::{Mutex, PoisonError};

use crate::backend::RouteTable;
use crate::config::Activation;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::experts::ExpertSource;
use crate::model::math::{silu_glu_interleaved, swiglu_interleaved};
use crate::model::weights::ExpertWeights;

/// Reusable buffers of [`moe_forward`], kept by the backend so that a decoded token
/// allocates nothing in the MoE block once the buffers have grown to the batch size.
/// Their contents between calls mean nothing; every call resizes and overwrites them.
#[derive(Debug, Default)]
pub struct MoeScratch {
    /// The batch's union of chosen experts, ascending.
    ids: Vec<usize>,
    /// Unweighted output of every (row, slot) pair, `[rows * k, hidden]`.
    contrib: Vec<f32>,
    /// One [`ExpertScratch`] per expert being computed at once, kept for the next ones.
    spare: Mutex<Vec<ExpertScratch>>,
}

/// A spare expert's buffers from `spare` (new ones if every spare is in use).
fn take_spare(spare: &Mutex<Vec<ExpertScratch>>) -> ExpertScratch {
    spare.lock().unwrap_or_else(PoisonError::into_inner).pop().unwrap_or_default()
}

/// Gives an expert's buffers back to `spare` for the next expert.
fn give_back(spare: &Mutex<Vec<ExpertScratch>>, s: ExpertScratch) {
    spare.lock().unwrap_or_else(PoisonError::into_inner).push(s);
}

/// The working buffers of one expert's computation.
#[derive(Debug, Default)]
struct ExpertScratch {
    /// The (row, slot) pairs that chose the expert.
    pairs: Vec<usize>,
    /// Those pairs' input rows, `[pairs, hidden]`.
    xs: Vec<f32>,
    /// The expert's output for those rows, `[pairs, hidden]`.
    ys: Vec<f32>,
    /// Gate/up projection of those rows, `[pairs, 2 * intermediate]`.
    gate_up: Vec<f32>,
    /// SwiGLU activation of those rows, `[pairs, intermediate]`.
    act: Vec<f32>,
}

/// Empties `v` and refills it with `n` zeros (reusing its allocation).
fn zeroed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// One expert applied to `n` rows of `x` (`[n, hidden]`): `down(swiglu(gate_up x + b)) + b`,
/// unweighted, into `out` (`[n, hidden]`); `gate_up` and `act` are scratch.
fn expert_forward(
    cfg: &ModelConfig,
    w: &ExpertWeights,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    gate_up: &mut Vec<f32>,
    act: &mut Vec<f32>,
) {
    let i = w.down.cols;
    let gate_up = zeroed(gate_up, n * 2 * i);
    w.gate_up.matmul(x, n, gate_up);
    let act = zeroed(act, n * i);
    for (gu, a) in gate_up.chunks_mut(2 * i).zip(act.chunks_mut(i)) {
        for (g, &b) in gu.iter_mut().zip(&w.gate_up_bias) {
            *g += b;
        }
        match cfg.recipe.activation {
            Activation::ClampedSwiGlu => swiglu_interleaved(gu, cfg.swiglu_limit, cfg.swiglu_alpha, a),
            Activation::SiluGlu => silu_glu_interleaved(gu, a),
        }
    }
    w.down.matmul(act, n, out);
    for row in out.chunks_mut(cfg.hidden_size) {
        for (o, &b) in row.iter_mut().zip(&w.down_bias) {
            *o += b;
        }
    }
}

/// One expert's unweighted output on `rows` rows of `x` (`[rows, hidden]`) into `out`
/// (`[rows, hidden]`), as [`moe_forward`] computes each expert: for the GPU backend's
/// experts that are not in VRAM, computed on the CPU, and for a dense layer's gated MLP (an
/// expert of weight one, so exactly what an expert of the same weights would give).
pub fn expert_rows(
    cfg: &ModelConfig,
    w: &ExpertWeights,
    x: &[f32],
    rows: usize,
    scratch: &mut MoeScratch,
    out: &mut [f32],
) {
    let mut s = take_spare(&scratch.spare);
    expert_forward(cfg, w, x, rows, out, &mut s.gate_up, &mut s.act);
    give_back(&scratch.spare, s);
}

/// `out[r] = sum_j w[r][j] * expert_{e[r][j]}(x[r])` for a batch of `routes.rows()` rows.
///
/// The union of chosen experts is fetched in groups the source can hold (each expert once
/// per call), the next group loading while the current one computes; with
/// `completion_driven` each expert is computed as soon as it arrives. Every (row, slot)
/// contribution is kept apart and the sum is taken in routing order at the end, so neither
/// the grouping nor the arrival order changes a bit of the result. `scratch` holds the
/// intermediate buffers, reused across calls. `then_prefetch` (a layer and experts) is
/// handed to [`ExpertSource::prefetch`] as soon as every expert this call needs is secured in
/// the source (at the first arrival of the last group): a prediction of the next layer whose
/// reads then overlap this layer's reads and compute without evicting what it is about to use.
#[allow(clippy::too_many_arguments)]
pub fn moe_forward(
    cfg: &ModelConfig,
    source: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    routes: &RouteTable,
    then_prefetch: Option<(usize, &[usize])>,
    completion_driven: bool,
    scratch: &mut MoeScratch,
    out: &mut [f32],
) -> Result<()> {
    let h = cfg.hidden_size;
    let k = routes.k;
    let rows = routes.rows();
    let MoeScratch { ids, contrib, spare } = scratch;
    let spare: &Mutex<Vec<ExpertScratch>> = spare;
    ids.clear();
    ids.extend(routes.experts.iter().map(|&e| e as usize));
    ids.sort_unstable();
    ids.dedup();

    // Unweighted output of every (row, slot) pair: per expert, its rows as one batch.
    let contrib = Mutex::new(zeroed(contrib, rows * k * h));
    let apply = |e: usize, w: &ExpertWeights| {
        let mut s = take_spare(spare);
        let ExpertScratch { pairs, xs, ys, gate_up, act } = &mut s;
        pairs.clear();
        pairs.extend((0..rows * k).filter(|&p| routes.experts[p] as usize == e));
        xs.clear();
        for &p in pairs.iter() {
            xs.extend_from_slice(&x[(p / k) * h..(p / k + 1) * h]);
        }
        let ys = zeroed(ys, pairs.len() * h);
        expert_forward(cfg, w, xs, pairs.len(), ys, gate_up, act);
        {
            let mut contrib = contrib.lock().unwrap_or_else(PoisonError::into_inner);
            for (&p, y) in pairs.iter().zip(ys.chunks(h)) {
                contrib[p * h..(p + 1) * h].copy_from_slice(y);
            }
        }
        give_back(spare, s);
    };
    let mut then_prefetch = then_prefetch;
    let mut groups = ids.chunks(source.batch_limit().max(1)).peekable();
    while let Some(group) = groups.next() {
        let next: &[usize] = groups.peek().copied().unwrap_or(&[]);
        let last = next.is_empty();
        // Once the last group is secured (pinned, or reading), every expert of this layer
        // is: the predicted reads go in behind them and cannot take their room.
        let mut secured = || {
            if last && let Some((l, experts)) = then_prefetch.take() {
                source.prefetch(l, experts);
            }
        };
        // Each expert is a task on the thread pool (its products split across the pool
        // too), so one expert's gathering, activation and copies overlap the others'
        // products instead of leaving the other threads waiting. The group's tasks end
        // with its scope, before the next group is fetched, as when they ran in turn.
        let apply = &apply;
        rayon::scope(|tasks| -> Result<()> {
            if completion_driven {
                source.for_each_loaded(layer, group, next, &mut |i, w| {
                    secured();
                    let e = group[i];
                    tasks.spawn(move |_| apply(e, &w));
                    Ok(())
                })
            } else {
                let weights = source.experts(layer, group)?;
                source.load_ahead(layer, next);
                secured();
                for (&e, w) in group.iter().zip(weights) {
                    tasks.spawn(move |_| apply(e, &w));
                }
                Ok(())
            }
        })?;
    }
    if let Some((l, experts)) = then_prefetch {
        source.prefetch(l, experts);
    }
    let contrib = contrib.into_inner().unwrap_or_else(PoisonError::into_inner);

    for r in 0..rows {
        let o = &mut out[r * h..(r + 1) * h];
        o.fill(0.0);
        for (j, &w) in routes.row_weights(r).iter().enumerate() {
            let c = &contrib[(r * k + j) * h..(r * k + j + 1) * h];
            for (a, &b) in o.iter_mut().zip(c) {
                *a += w * b;
            }
        }
    }
    Ok(())
}
