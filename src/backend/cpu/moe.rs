//! The MoE block on the CPU: each expert of the batch's union is fetched once and applied
//! to every row that chose it, as one batched product; each row's contributions are then
//! summed in routing order, so the result is the same for any batch size, fetch order or
//! cache state.

use crate::backend::RouteTable;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::experts::ExpertSource;
use crate::model::math::swiglu_interleaved;
use crate::model::weights::ExpertWeights;

/// One expert applied to `n` rows of `x` (`[n, hidden]`): `down(swiglu(gate_up x + b)) + b`,
/// unweighted, into `out` (`[n, hidden]`).
pub fn expert_forward(cfg: &ModelConfig, w: &ExpertWeights, x: &[f32], n: usize, out: &mut [f32]) {
    let i = cfg.intermediate_size;
    let mut gate_up = vec![0.0f32; n * 2 * i];
    w.gate_up.matmul(x, n, &mut gate_up);
    let mut act = vec![0.0f32; n * i];
    for (gu, a) in gate_up.chunks_mut(2 * i).zip(act.chunks_mut(i)) {
        for (g, &b) in gu.iter_mut().zip(&w.gate_up_bias) {
            *g += b;
        }
        swiglu_interleaved(gu, cfg.swiglu_limit, cfg.swiglu_alpha, a);
    }
    w.down.matmul(&act, n, out);
    for row in out.chunks_mut(cfg.hidden_size) {
        for (o, &b) in row.iter_mut().zip(&w.down_bias) {
            *o += b;
        }
    }
}

/// `out[r] = sum_j w[r][j] * expert_{e[r][j]}(x[r])` for a batch of `routes.rows()` rows.
///
/// The union of chosen experts is fetched in groups the source can hold (each expert once
/// per call), the next group loading while the current one computes; with
/// `completion_driven` each expert is computed as soon as it arrives. Every (row, slot)
/// contribution is kept apart and the sum is taken in routing order at the end, so neither
/// the grouping nor the arrival order changes a bit of the result.
pub fn moe_forward(
    cfg: &ModelConfig,
    source: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    routes: &RouteTable,
    completion_driven: bool,
    out: &mut [f32],
) -> Result<()> {
    let h = cfg.hidden_size;
    let k = routes.k;
    let rows = routes.rows();
    let mut ids: Vec<usize> = routes.experts.iter().map(|&e| e as usize).collect();
    ids.sort_unstable();
    ids.dedup();

    // Unweighted output of every (row, slot) pair: per expert, its rows as one batch.
    let mut contrib = vec![0.0f32; rows * k * h];
    let mut apply = |e: usize, w: &ExpertWeights| {
        let pairs: Vec<usize> = (0..rows * k).filter(|&p| routes.experts[p] as usize == e).collect();
        let mut xs = Vec::with_capacity(pairs.len() * h);
        for &p in &pairs {
            xs.extend_from_slice(&x[(p / k) * h..(p / k + 1) * h]);
        }
        let mut ys = vec![0.0f32; pairs.len() * h];
        expert_forward(cfg, w, &xs, pairs.len(), &mut ys);
        for (&p, y) in pairs.iter().zip(ys.chunks(h)) {
            contrib[p * h..(p + 1) * h].copy_from_slice(y);
        }
    };
    let groups: Vec<&[usize]> = ids.chunks(source.batch_limit().max(1)).collect();
    for (g, group) in groups.iter().enumerate() {
        let next: &[usize] = groups.get(g + 1).copied().unwrap_or(&[]);
        if completion_driven {
            source.for_each_loaded(layer, group, next, &mut |i, w| {
                apply(group[i], &w);
                Ok(())
            })?;
        } else {
            let weights = source.experts(layer, group)?;
            source.load_ahead(layer, next);
            for (e, w) in group.iter().zip(weights) {
                apply(*e, &w);
            }
        }
    }

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
