//! The MoE block on the CPU: each expert of the batch's union is fetched once and applied
//! to every row that chose it; each row's contributions are then summed in routing order,
//! so the result is the same for any batch size, fetch order or cache state.

use rayon::prelude::*;

use crate::backend::RouteTable;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::experts::ExpertSource;
use crate::model::math::swiglu_interleaved;
use crate::model::weights::ExpertWeights;

/// One expert applied to one row: `down(swiglu(gate_up x + b_gu)) + b_down`, unweighted.
pub fn expert_forward(cfg: &ModelConfig, w: &ExpertWeights, x: &[f32], out: &mut [f32]) {
    let i = cfg.intermediate_size;
    let mut gate_up = vec![0.0f32; 2 * i];
    w.gate_up.matvec(x, &mut gate_up);
    for (g, &b) in gate_up.iter_mut().zip(&w.gate_up_bias) {
        *g += b;
    }
    let mut act = vec![0.0f32; i];
    swiglu_interleaved(&gate_up, cfg.swiglu_limit, cfg.swiglu_alpha, &mut act);
    w.down.matvec(&act, out);
    for (o, &b) in out.iter_mut().zip(&w.down_bias) {
        *o += b;
    }
}

/// `out[r] = sum_j w[r][j] * expert_{e[r][j]}(x[r])` for a batch of `routes.rows()` rows.
pub fn moe_forward(
    cfg: &ModelConfig,
    source: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    routes: &RouteTable,
    out: &mut [f32],
) -> Result<()> {
    let h = cfg.hidden_size;
    let k = routes.k;
    let rows = routes.rows();
    // The union of chosen experts, fetched once each, in expert order.
    let mut ids: Vec<usize> = routes.experts.iter().map(|&e| e as usize).collect();
    ids.sort_unstable();
    ids.dedup();
    let weights = source.experts(layer, &ids)?;

    // Unweighted output of every (row, slot) pair, each computed independently.
    let mut contrib = vec![0.0f32; rows * k * h];
    contrib.par_chunks_mut(h).enumerate().for_each(|(pair, dst)| {
        let row = pair / k;
        let u = ids.partition_point(|&e| e < routes.experts[pair] as usize);
        expert_forward(cfg, &weights[u], &x[row * h..(row + 1) * h], dst);
    });

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
