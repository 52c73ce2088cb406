//! The weights of a model, independent of where they came from (a Hugging Face checkpoint
//! or a converted container) and of their storage format.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::quant::Matrix;

/// `y = W x + b`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: Matrix,
    /// `[out]`, if the layer has a bias.
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// `y = W x + b`.
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        self.weight.matvec(x, y);
        if let Some(b) = &self.bias {
            for (o, &b) in y.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}

/// One layer's attention block.
#[derive(Clone, Debug)]
pub struct AttentionWeights {
    /// Query projection `[heads * head_dim, hidden]`.
    pub q: Linear,
    /// Key projection `[kv_heads * head_dim, hidden]`.
    pub k: Linear,
    /// Value projection `[kv_heads * head_dim, hidden]`.
    pub v: Linear,
    /// Output projection `[hidden, heads * head_dim]`.
    pub o: Linear,
    /// One sink logit per query head.
    pub sinks: Vec<f32>,
}

/// The dense (always resident) part of one decoder layer.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Attention projections and sinks.
    pub attn: AttentionWeights,
    /// RMSNorm weight before the MoE block.
    pub mlp_norm: Vec<f32>,
    /// Router `[experts, hidden]` with bias `[experts]`.
    pub router: Linear,
}

/// Everything but the experts.
#[derive(Clone, Debug)]
pub struct DenseWeights {
    /// Token embedding `[vocab, hidden]`.
    pub embed: Matrix,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight.
    pub final_norm: Vec<f32>,
    /// Output head `[vocab, hidden]`, no bias.
    pub lm_head: Matrix,
}

/// One expert of one layer. Rows are outputs; `gate_up` interleaves gate (even rows) and
/// up (odd rows).
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `[2 * intermediate, hidden]`.
    pub gate_up: Matrix,
    /// `[2 * intermediate]`.
    pub gate_up_bias: Vec<f32>,
    /// `[hidden, intermediate]`.
    pub down: Matrix,
    /// `[hidden]`.
    pub down_bias: Vec<f32>,
}

impl ExpertWeights {
    /// Bytes this expert occupies in memory.
    pub fn byte_len(&self) -> usize {
        self.gate_up.byte_len() + self.down.byte_len() + 4 * (self.gate_up_bias.len() + self.down_bias.len())
    }

    /// Checks the shapes against the config; `what` names the expert in errors.
    pub fn check(&self, cfg: &ModelConfig, what: &str) -> Result<()> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let ok = self.gate_up.rows == 2 * i
            && self.gate_up.cols == h
            && self.gate_up_bias.len() == 2 * i
            && self.down.rows == h
            && self.down.cols == i
            && self.down_bias.len() == h;
        if ok {
            Ok(())
        } else {
            Err(Error::tensor(
                what,
                format!(
                    "expert shapes gate_up {}x{} (+{}), down {}x{} (+{}); expected {}x{h} (+{}), {h}x{i} (+{h})",
                    self.gate_up.rows,
                    self.gate_up.cols,
                    self.gate_up_bias.len(),
                    self.down.rows,
                    self.down.cols,
                    self.down_bias.len(),
                    2 * i,
                    2 * i
                ),
            ))
        }
    }
}

impl DenseWeights {
    /// Builds the dense weights from a source of tensors, by their Hugging Face names:
    /// `matrix(name, rows, cols)` and `vector(name, len)` fetch one tensor (the expected
    /// shape is given for sources that check it as they read), and every shape is checked
    /// against `cfg` at the end. The one table of names and shapes for every loader.
    pub fn assemble(
        cfg: &ModelConfig,
        matrix: &dyn Fn(&str, usize, usize) -> Result<Matrix>,
        vector: &dyn Fn(&str, usize) -> Result<Vec<f32>>,
    ) -> Result<DenseWeights> {
        let h = cfg.hidden_size;
        let linear = |name: &str, rows: usize, cols: usize| -> Result<Linear> {
            Ok(Linear {
                weight: matrix(&format!("{name}.weight"), rows, cols)?,
                bias: Some(vector(&format!("{name}.bias"), rows)?),
            })
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            layers.push(LayerWeights {
                attn_norm: vector(&format!("{p}.input_layernorm.weight"), h)?,
                attn: AttentionWeights {
                    q: linear(&format!("{p}.self_attn.q_proj"), cfg.q_dim(), h)?,
                    k: linear(&format!("{p}.self_attn.k_proj"), cfg.kv_dim(), h)?,
                    v: linear(&format!("{p}.self_attn.v_proj"), cfg.kv_dim(), h)?,
                    o: linear(&format!("{p}.self_attn.o_proj"), h, cfg.q_dim())?,
                    sinks: vector(&format!("{p}.self_attn.sinks"), cfg.num_heads)?,
                },
                mlp_norm: vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                router: linear(&format!("{p}.mlp.router"), cfg.num_experts, h)?,
            });
        }
        let dense = DenseWeights {
            embed: matrix("model.embed_tokens.weight", cfg.vocab_size, h)?,
            layers,
            final_norm: vector("model.norm.weight", h)?,
            lm_head: matrix("lm_head.weight", cfg.vocab_size, h)?,
        };
        dense.check(cfg)?;
        Ok(dense)
    }

    /// Checks every shape against the config, naming the first tensor that disagrees.
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        let h = cfg.hidden_size;
        let mat = |name: String, m: &Matrix, rows: usize, cols: usize| {
            if m.rows == rows && m.cols == cols {
                Ok(())
            } else {
                Err(Error::tensor(name, format!("shape [{}, {}], expected [{rows}, {cols}]", m.rows, m.cols)))
            }
        };
        let vec = |name: String, v: &[f32], len: usize| {
            if v.len() == len {
                Ok(())
            } else {
                Err(Error::tensor(name, format!("shape [{}], expected [{len}]", v.len())))
            }
        };
        let lin = |name: String, l: &Linear, rows: usize, cols: usize| {
            mat(format!("{name}.weight"), &l.weight, rows, cols)?;
            match &l.bias {
                Some(b) => vec(format!("{name}.bias"), b, rows),
                None => Ok(()),
            }
        };
        mat("embed_tokens".into(), &self.embed, cfg.vocab_size, h)?;
        mat("lm_head".into(), &self.lm_head, cfg.vocab_size, h)?;
        vec("norm".into(), &self.final_norm, h)?;
        if self.layers.len() != cfg.num_layers {
            return Err(Error::tensor(
                "layers",
                format!("{} layers, config says {}", self.layers.len(), cfg.num_layers),
            ));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("layers.{l}");
            vec(format!("{p}.input_layernorm"), &layer.attn_norm, h)?;
            vec(format!("{p}.post_attention_layernorm"), &layer.mlp_norm, h)?;
            lin(format!("{p}.self_attn.q_proj"), &layer.attn.q, cfg.q_dim(), h)?;
            lin(format!("{p}.self_attn.k_proj"), &layer.attn.k, cfg.kv_dim(), h)?;
            lin(format!("{p}.self_attn.v_proj"), &layer.attn.v, cfg.kv_dim(), h)?;
            lin(format!("{p}.self_attn.o_proj"), &layer.attn.o, h, cfg.q_dim())?;
            vec(format!("{p}.self_attn.sinks"), &layer.attn.sinks, cfg.num_heads)?;
            lin(format!("{p}.mlp.router"), &layer.router, cfg.num_experts, h)?;
        }
        Ok(())
    }
}
