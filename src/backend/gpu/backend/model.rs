//! The dense model on the device: each layer's norms, attention projections, sinks, QK-norm
//! weights and feed-forward block (a MoE layer's router, or a dense MLP), uploaded in their
//! container formats.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::weights::{AttentionWeights, DenseWeights, FeedForward};
use crate::quant::Matrix;

use super::super::context::{GBuf, Gpu};
use super::super::weights::{GpuMatrix, upload_matrix, upload_vector};
use super::missing;

pub(super) struct GpuLinear {
    pub(super) m: GpuMatrix,
    pub(super) bias: Option<GBuf>,
}

/// The feed-forward block of a layer on the device.
pub(super) enum GpuFfn {
    /// A MoE layer: its router (the experts live in the VRAM expert cache).
    Moe { router: GpuLinear },
    /// A dense gated MLP in the experts' layout (gate and up rows interleaved), in its
    /// dense weight format: run by the matrix-vector kernels and glu.wgsl.
    Dense { gate_up: GpuLinear, down: GpuLinear },
}

impl GpuFfn {
    /// The matrices of the block.
    pub(super) fn matrices(&self) -> Vec<&GpuMatrix> {
        match self {
            GpuFfn::Moe { router } => vec![&router.m],
            GpuFfn::Dense { gate_up, down } => vec![&gate_up.m, &down.m],
        }
    }
}

pub(super) struct GpuLayer {
    pub(super) attn_norm: GBuf,
    pub(super) mlp_norm: GBuf,
    /// The query, key and value projections stacked by rows (`[q_dim + 2 kv_dim, hidden]`,
    /// biases likewise, zeros where a projection has none): one product computes all three.
    pub(super) qkv: GpuLinear,
    pub(super) o: GpuLinear,
    /// One sink logit per query head, in families with sinks.
    pub(super) sinks: Option<GBuf>,
    /// QK-norm weights (query, key), in families with QK-norm.
    pub(super) qk_norm: Option<(GBuf, GBuf)>,
    /// The same QK-norm weights in one buffer (query then key), for the fused decode
    /// attention.
    pub(super) qk_w: Option<GBuf>,
    pub(super) ffn: GpuFfn,
}

impl GpuLayer {
    /// The router, on a MoE layer.
    pub(super) fn router(&self) -> Option<&GpuLinear> {
        match &self.ffn {
            GpuFfn::Moe { router } => Some(router),
            GpuFfn::Dense { .. } => None,
        }
    }
}

/// Uploads every layer's dense weights (norms, projections, sinks, QK-norm weights, the
/// router or the dense MLP), refusing weights that lack what the layer recipe asks for.
pub(super) fn upload_layers(
    gpu: &mut Gpu,
    cfg: &ModelConfig,
    dense: &DenseWeights,
) -> Result<Vec<Arc<GpuLayer>>> {
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
            (true, Some(s)) => Some(upload_vector(gpu, &format!("{p}.sinks"), s)?),
            (false, _) => None,
            (true, None) => return Err(missing(&p, "attention sinks")),
        };
        let (qk_norm, qk_w) = match (recipe.qk_norm, &w.attn.q_norm, &w.attn.k_norm) {
            (true, Some(q), Some(k)) => (
                Some((
                    upload_vector(gpu, &format!("{p}.q_norm"), q)?,
                    upload_vector(gpu, &format!("{p}.k_norm"), k)?,
                )),
                Some(upload_vector(gpu, &format!("{p}.qk_norm"), &[q.as_slice(), k.as_slice()].concat())?),
            ),
            (false, _, _) => (None, None),
            (true, _, _) => return Err(missing(&p, "QK-norm weights")),
        };
        let ffn = match &w.ffn {
            FeedForward::Moe { router } => GpuFfn::Moe { router: lin(gpu, &format!("{p}.router"), router)? },
            FeedForward::Dense(mlp) => {
                mlp.check_dims(cfg.hidden_size, cfg.dense_intermediate_size, &format!("{p}.mlp"))?;
                GpuFfn::Dense {
                    gate_up: GpuLinear {
                        m: upload_matrix(gpu, &format!("{p}.mlp.gate_up"), &mlp.gate_up)?,
                        bias: Some(upload_vector(gpu, &format!("{p}.mlp.gate_up.bias"), &mlp.gate_up_bias)?),
                    },
                    down: GpuLinear {
                        m: upload_matrix(gpu, &format!("{p}.mlp.down_proj"), &mlp.down)?,
                        bias: Some(upload_vector(gpu, &format!("{p}.mlp.down_proj.bias"), &mlp.down_bias)?),
                    },
                }
            }
        };
        layers.push(Arc::new(GpuLayer {
            attn_norm: upload_vector(gpu, &format!("{p}.input_layernorm"), &w.attn_norm)?,
            mlp_norm: upload_vector(gpu, &format!("{p}.post_attention_layernorm"), &w.mlp_norm)?,
            qkv: stacked_qkv(gpu, &p, &w.attn)?,
            o: lin(gpu, &format!("{p}.o_proj"), &w.attn.o)?,
            sinks,
            qk_norm,
            qk_w,
            ffn,
        }));
    }
    Ok(layers)
}

/// The query, key and value projections of a layer uploaded as one matrix, rows stacked in
/// that order, with one bias (a projection without one contributes zeros).
fn stacked_qkv(gpu: &mut Gpu, layer: &str, attn: &AttentionWeights) -> Result<GpuLinear> {
    let name = format!("{layer}.qkv_proj");
    let parts = [&attn.q, &attn.k, &attn.v];
    let m = Matrix::stack_rows(&name, &parts.map(|l| &l.weight))?;
    let bias = if parts.iter().any(|l| l.bias.is_some()) {
        let mut b = Vec::with_capacity(m.rows);
        for l in parts {
            match &l.bias {
                Some(v) => b.extend_from_slice(v),
                None => b.resize(b.len() + l.weight.rows, 0.0),
            }
        }
        Some(upload_vector(gpu, &format!("{name}.bias"), &b)?)
    } else {
        None
    };
    Ok(GpuLinear { m: upload_matrix(gpu, &name, &m)?, bias })
}
