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
    /// What the near-end watch of a call has seen (see [`moe_forward`]).
    near_end: Mutex<NearEndProgress>,
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

/// What [`moe_forward`] hands the layer's output so far to when one expert is left to read.
pub type NearEnd<'a> = &'a (dyn Fn(&[f32]) + Sync);

/// Watches one row's experts for the moment all but one are computed and the last is still
/// being read, and then hands the partial output to its callback (see [`moe_forward`]).
struct NearEndWatch<'a> {
    callback: NearEnd<'a>,
    /// Distinct experts of the layer.
    experts: usize,
    progress: &'a Mutex<NearEndProgress>,
}

#[derive(Debug, Default)]
struct NearEndProgress {
    /// Experts handed over by the source so far.
    delivered: usize,
    /// Slots whose expert is computed.
    computed: Vec<usize>,
    /// Whether the callback has run.
    fired: bool,
    /// The weighted sum of the computed experts handed to the callback.
    partial: Vec<f32>,
}

impl<'a> NearEndWatch<'a> {
    /// A watch of `experts` distinct experts, its progress in `progress` (reset here: the
    /// buffers are reused from call to call).
    fn new(callback: NearEnd<'a>, experts: usize, progress: &'a Mutex<NearEndProgress>) -> Self {
        let mut p = progress.lock().unwrap_or_else(PoisonError::into_inner);
        p.delivered = 0;
        p.computed.clear();
        p.fired = false;
        drop(p);
        NearEndWatch { callback, experts, progress }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, NearEndProgress> {
        self.progress.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The source handed over one more expert.
    fn delivered(&self) {
        self.lock().delivered += 1;
    }

    /// The expert of `pairs` (slots of the one row) is computed; its output is in `contrib`.
    fn computed(&self, pairs: &[usize], routes: &RouteTable, contrib: &Mutex<&mut [f32]>, h: usize) {
        let partial = {
            let mut p = self.lock();
            p.computed.extend_from_slice(pairs);
            let due = !p.fired && p.computed.len() + 1 == self.experts && p.delivered < self.experts;
            if !due {
                return;
            }
            p.fired = true;
            let mut partial = std::mem::take(&mut p.partial);
            partial.clear();
            partial.resize(h, 0.0);
            let weights = routes.row_weights(0);
            let contrib = contrib.lock().unwrap_or_else(PoisonError::into_inner);
            for &j in &p.computed {
                let c = &contrib[j * h..(j + 1) * h];
                for (a, &b) in partial.iter_mut().zip(c) {
                    *a += weights[j] * b;
                }
            }
            partial
        };
        // Outside the lock: the other experts' tasks go on while the callback runs.
        (self.callback)(&partial);
        self.lock().partial = partial;
    }
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
///
/// `near_end`, for one row whose experts arrive one by one, is called once with the layer's
/// output so far (the weighted sum of every expert but one) when that last expert is still
/// being read and all the others are computed: a state close to the layer's output, from
/// which the next layer's routing can be predicted while the disk is still busy with this
/// layer (docs/memory.md, "Predicted prefetch"). It sees a copy; nothing it does changes the
/// result.
#[allow(clippy::too_many_arguments)]
pub fn moe_forward(
    cfg: &ModelConfig,
    source: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    routes: &RouteTable,
    then_prefetch: Option<(usize, &[usize])>,
    near_end: Option<NearEnd<'_>>,
    completion_driven: bool,
    scratch: &mut MoeScratch,
    out: &mut [f32],
) -> Result<()> {
    let h = cfg.hidden_size;
    let k = routes.k;
    let rows = routes.rows();
    let MoeScratch { ids, contrib, spare, near_end: near_end_progress } = scratch;
    let spare: &Mutex<Vec<ExpertScratch>> = spare;
    ids.clear();
    ids.extend(routes.experts.iter().map(|&e| e as usize));
    ids.sort_unstable();
    ids.dedup();

    // Unweighted output of every (row, slot) pair: per expert, its rows as one batch.
    let contrib = Mutex::new(zeroed(contrib, rows * k * h));
    // One row, one group, experts arriving one by one: the near-end state can be watched.
    let watch = match near_end {
        Some(callback)
            if rows == 1 && completion_driven && ids.len() >= 2 && ids.len() <= source.batch_limit() =>
        {
            Some(NearEndWatch::new(callback, ids.len(), near_end_progress))
        }
        Some(_) | None => None,
    };
    let watch = watch.as_ref();
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
        if let Some(watch) = watch {
            watch.computed(pairs, routes, &contrib, h);
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
                    if let Some(watch) = watch {
                        watch.delivered();
                    }
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::quant::Matrix;

    /// Random-looking but fixed values in [-0.5, 0.5).
    fn values(seed: u32, n: usize) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    }

    fn expert(cfg: &ModelConfig, seed: u32) -> Arc<ExpertWeights> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Arc::new(ExpertWeights {
            gate_up: Matrix::from_f32("gate_up", 2 * i, h, values(seed, 2 * i * h)).unwrap(),
            gate_up_bias: values(seed + 1, 2 * i),
            down: Matrix::from_f32("down", h, i, values(seed + 2, h * i)).unwrap(),
            down_bias: values(seed + 3, h),
        })
    }

    /// Hands experts over one by one in routing order; before the last, waits (up to 10 s)
    /// for `fired`, as a cache waits for the disk.
    struct OneByOne {
        experts: Vec<Arc<ExpertWeights>>,
        fired: Arc<AtomicBool>,
    }

    impl ExpertSource for OneByOne {
        fn expert(&self, _layer: usize, e: usize) -> Result<Arc<ExpertWeights>> {
            Ok(Arc::clone(&self.experts[e]))
        }
        fn describe(&self) -> String {
            "one by one".into()
        }
        fn expert_bytes(&self) -> u64 {
            0
        }
        fn host_bytes(&self) -> u64 {
            0
        }
        fn for_each_loaded(
            &self,
            _layer: usize,
            ids: &[usize],
            _ahead: &[usize],
            f: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
        ) -> Result<()> {
            for (i, &e) in ids.iter().enumerate() {
                if i + 1 == ids.len() {
                    let t0 = Instant::now();
                    while !self.fired.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(10) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                f(i, Arc::clone(&self.experts[e]))?;
            }
            Ok(())
        }
    }

    #[test]
    fn the_near_end_state_is_every_expert_but_the_last_and_changes_no_bit() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-f32");
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let (h, k) = (cfg.hidden_size, cfg.experts_per_token);
        assert!(k >= 2, "the fixture routes to several experts");
        // Set: the source does not wait (the plain run has nothing to wait for).
        let fired = Arc::new(AtomicBool::new(true));
        let source = OneByOne {
            experts: (0..cfg.num_experts as u32).map(|s| expert(&cfg, 10 * s)).collect(),
            fired: Arc::clone(&fired),
        };
        let x = values(7, h);
        // Slots in descending expert order, so arrival order (ascending ids) differs from slot order.
        let experts: Vec<u32> = (0..k as u32).rev().collect();
        let weights: Vec<f32> = (0..k).map(|j| 0.1 + j as f32 * 0.2).collect();
        let routes = RouteTable { k, experts: experts.clone(), weights: weights.clone() };

        let mut plain = vec![0.0; h];
        moe_forward(&cfg, &source, 0, &x, &routes, None, None, true, &mut MoeScratch::default(), &mut plain)
            .unwrap();

        fired.store(false, Ordering::SeqCst);
        let seen: Mutex<Vec<Vec<f32>>> = Mutex::default();
        let near_end = |partial: &[f32]| {
            seen.lock().unwrap().push(partial.to_vec());
            fired.store(true, Ordering::SeqCst);
        };
        let mut watched = vec![0.0; h];
        let cb: NearEnd<'_> = &near_end;
        moe_forward(
            &cfg,
            &source,
            0,
            &x,
            &routes,
            None,
            Some(cb),
            true,
            &mut MoeScratch::default(),
            &mut watched,
        )
        .unwrap();
        assert!(plain == watched, "watching the near end changed the layer's output");

        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 1, "called once");
        // The last to arrive is the highest expert id, in slot 0: every other slot's
        // weighted output, summed.
        let mut want = vec![0.0f32; h];
        for j in 1..k {
            let mut y = vec![0.0; h];
            expert_rows(
                &cfg,
                &source.experts[experts[j] as usize],
                &x,
                1,
                &mut MoeScratch::default(),
                &mut y,
            );
            for (a, b) in want.iter_mut().zip(&y) {
                *a += weights[j] * b;
            }
        }
        for (a, b) in seen[0].iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "near-end state {a} against {b}");
        }
        // Not called when every expert has arrived before the others are computed (the
        // source never waits), nor for more than one row.
        let quick = OneByOne { experts: source.experts.clone(), fired: Arc::new(AtomicBool::new(true)) };
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let count = |_: &[f32]| {
            calls.fetch_add(1, Ordering::SeqCst);
        };
        let cb: NearEnd<'_> = &count;
        let two = RouteTable {
            k,
            experts: [experts.clone(), experts.clone()].concat(),
            weights: [weights.clone(), weights].concat(),
        };
        let mut out2 = vec![0.0; 2 * h];
        let xx = [x.clone(), x].concat();
        moe_forward(&cfg, &quick, 0, &xx, &two, None, Some(cb), true, &mut MoeScratch::default(), &mut out2)
            .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 0, "two rows: no near-end state");
    }
}
