//! The weights of a model, independent of where they came from (a Hugging Face checkpoint
//! or a converted container) and of their storage format.

use crate::config::{MlpKind, ModelConfig};
use crate::error::{Error, Result};
use crate::model::names;
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
    /// One sink logit per query head, in families with sinks.
    pub sinks: Option<Vec<f32>>,
    /// RMSNorm weight `[head_dim]` applied to every query head before RoPE (QK-norm).
    pub q_norm: Option<Vec<f32>>,
    /// RMSNorm weight `[head_dim]` applied to every key head before RoPE (QK-norm).
    pub k_norm: Option<Vec<f32>>,
}

/// The feed-forward block of a layer.
#[derive(Clone, Debug)]
pub enum FeedForward {
    /// A router `[experts, hidden]` (with bias in families that have one); the experts
    /// themselves live in the expert store.
    Moe {
        /// The router.
        router: Linear,
    },
    /// One dense gated MLP, resident, in the experts' layout (interleaved gate/up rows,
    /// zero biases where the family has none) so the same activation code applies.
    Dense(ExpertWeights),
}

/// The dense (always resident) part of one decoder layer.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Attention projections and sinks.
    pub attn: AttentionWeights,
    /// RMSNorm weight before the feed-forward block.
    pub mlp_norm: Vec<f32>,
    /// The feed-forward block.
    pub ffn: FeedForward,
}

impl LayerWeights {
    /// The router, on a MoE layer.
    pub fn router(&self) -> Option<&Linear> {
        match &self.ffn {
            FeedForward::Moe { router } => Some(router),
            FeedForward::Dense(_) => None,
        }
    }
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
    /// Output head `[vocab, hidden]`, no bias (a copy of the embedding when the family
    /// ties them).
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
    /// An expert from separate `gate` and `up` `[intermediate, hidden]` and `down`
    /// `[hidden, intermediate]` matrices without biases (Qwen3-MoE's layout): gate and up
    /// rows are interleaved into the fused layout, the biases are zeros. `name` prefixes
    /// errors.
    pub fn from_separate(name: &str, gate: &Matrix, up: &Matrix, down: &Matrix) -> Result<ExpertWeights> {
        let (i, h) = (gate.rows, gate.cols);
        if (up.rows, up.cols) != (i, h) || (down.rows, down.cols) != (h, i) {
            return Err(Error::tensor(
                name,
                format!(
                    "gate {i}x{h}, up {}x{}, down {}x{}: up must match gate and down be {h}x{i}",
                    up.rows, up.cols, down.rows, down.cols
                ),
            ));
        }
        let mut gate_up = vec![0.0f32; 2 * i * h];
        for (r, pair) in gate_up.chunks_exact_mut(2 * h).enumerate() {
            let (g, u) = pair.split_at_mut(h);
            gate.row_to_f32(r, g);
            up.row_to_f32(r, u);
        }
        let mut down_f32 = vec![0.0f32; h * i];
        for (r, row) in down_f32.chunks_exact_mut(i).enumerate() {
            down.row_to_f32(r, row);
        }
        Ok(ExpertWeights {
            gate_up: Matrix::from_f32(&format!("{name}.gate_up"), 2 * i, h, gate_up)?,
            gate_up_bias: vec![0.0; 2 * i],
            down: Matrix::from_f32(&format!("{name}.down_proj"), h, i, down_f32)?,
            down_bias: vec![0.0; h],
        })
    }

    /// Bytes this expert occupies in memory.
    pub fn byte_len(&self) -> usize {
        self.gate_up.byte_len() + self.down.byte_len() + 4 * (self.gate_up_bias.len() + self.down_bias.len())
    }

    /// Checks the shapes against the config; `what` names the expert in errors.
    pub fn check(&self, cfg: &ModelConfig, what: &str) -> Result<()> {
        self.check_dims(cfg.hidden_size, cfg.intermediate_size, what)
    }

    /// Checks the shapes against hidden width `h` and intermediate width `i`.
    pub fn check_dims(&self, h: usize, i: usize, what: &str) -> Result<()> {
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
    /// The same weights with the embedding passed through `embed` and every other matrix
    /// (attention, routers, dense MLPs, head) through `each`; vectors and biases are kept.
    /// Layers are mapped in parallel (copies and decodes of large matrices).
    pub fn map_matrices(
        &self,
        embed: impl Fn(&Matrix) -> Matrix + Sync,
        each: impl Fn(&Matrix) -> Matrix + Sync,
    ) -> DenseWeights {
        use rayon::prelude::*;
        let lin = |l: &Linear| Linear { weight: each(&l.weight), bias: l.bias.clone() };
        let layer = |l: &LayerWeights| LayerWeights {
            attn_norm: l.attn_norm.clone(),
            attn: AttentionWeights {
                q: lin(&l.attn.q),
                k: lin(&l.attn.k),
                v: lin(&l.attn.v),
                o: lin(&l.attn.o),
                sinks: l.attn.sinks.clone(),
                q_norm: l.attn.q_norm.clone(),
                k_norm: l.attn.k_norm.clone(),
            },
            mlp_norm: l.mlp_norm.clone(),
            ffn: match &l.ffn {
                FeedForward::Moe { router } => FeedForward::Moe { router: lin(router) },
                FeedForward::Dense(w) => FeedForward::Dense(ExpertWeights {
                    gate_up: each(&w.gate_up),
                    gate_up_bias: w.gate_up_bias.clone(),
                    down: each(&w.down),
                    down_bias: w.down_bias.clone(),
                }),
            },
        };
        let ((embed, lm_head), layers) = rayon::join(
            || rayon::join(|| embed(&self.embed), || each(&self.lm_head)),
            || self.layers.par_iter().map(layer).collect(),
        );
        DenseWeights { embed, layers, final_norm: self.final_norm.clone(), lm_head }
    }

    /// The CPU backend's copy: every matrix a token streams (all but the embedding, of which
    /// a token reads one row) moved from a memory-mapped file into huge pages
    /// ([`Matrix::in_huge_pages`]). The same bytes: every product is bit for bit the same.
    pub fn with_streamed_matrices_in_huge_pages(&self) -> DenseWeights {
        self.map_matrices(Matrix::clone, Matrix::in_huge_pages)
    }

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
        let recipe = cfg.recipe;
        let linear = |name: &str, rows: usize, cols: usize, bias: bool| -> Result<Linear> {
            Ok(Linear {
                weight: matrix(&format!("{name}.weight"), rows, cols)?,
                bias: if bias { Some(vector(&format!("{name}.bias"), rows)?) } else { None },
            })
        };
        let optional = |present: bool, name: &str, len: usize| -> Result<Option<Vec<f32>>> {
            if present { vector(name, len).map(Some) } else { Ok(None) }
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let n = names::layer(cfg.family, l);
            let bias = recipe.attention_bias;
            let ffn = match cfg.mlp_kinds[l] {
                MlpKind::Moe => {
                    FeedForward::Moe { router: linear(&n.router, cfg.num_experts, h, recipe.router_bias)? }
                }
                MlpKind::Dense => {
                    let i = cfg.dense_intermediate_size;
                    let gate = matrix(&n.dense_gate, i, h)?;
                    let up = matrix(&n.dense_up, i, h)?;
                    let down = matrix(&n.dense_down, h, i)?;
                    FeedForward::Dense(ExpertWeights::from_separate(
                        &format!("layer {l} dense MLP"),
                        &gate,
                        &up,
                        &down,
                    )?)
                }
            };
            layers.push(LayerWeights {
                attn_norm: vector(&n.attn_norm, h)?,
                attn: AttentionWeights {
                    q: linear(&n.q, cfg.q_dim(), h, bias)?,
                    k: linear(&n.k, cfg.kv_dim(), h, bias)?,
                    v: linear(&n.v, cfg.kv_dim(), h, bias)?,
                    o: linear(&n.o, h, cfg.q_dim(), bias)?,
                    sinks: optional(recipe.attention_sinks, &n.sinks, cfg.num_heads)?,
                    q_norm: optional(recipe.qk_norm, &n.q_norm, cfg.head_dim)?,
                    k_norm: optional(recipe.qk_norm, &n.k_norm, cfg.head_dim)?,
                },
                mlp_norm: vector(&n.mlp_norm, h)?,
                ffn,
            });
        }
        let embed = matrix(names::EMBED, cfg.vocab_size, h)?;
        let lm_head =
            if cfg.tie_word_embeddings { embed.clone() } else { matrix(names::LM_HEAD, cfg.vocab_size, h)? };
        let dense = DenseWeights { embed, layers, final_norm: vector(names::FINAL_NORM, h)?, lm_head };
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
            let a = &layer.attn;
            let present = |v: &Option<Vec<f32>>| v.is_some();
            if present(&a.sinks) != cfg.recipe.attention_sinks || present(&a.q_norm) != cfg.recipe.qk_norm {
                return Err(Error::tensor(
                    format!("{p}.self_attn"),
                    "sinks or QK-norm weights present where the family has none, or missing",
                ));
            }
            for (name, v, len) in [
                ("sinks", &a.sinks, cfg.num_heads),
                ("q_norm", &a.q_norm, cfg.head_dim),
                ("k_norm", &a.k_norm, cfg.head_dim),
            ] {
                if let Some(v) = v {
                    vec(format!("{p}.self_attn.{name}"), v, len)?;
                }
            }
            match (&layer.ffn, cfg.mlp_kinds[l]) {
                (FeedForward::Moe { router }, MlpKind::Moe) => {
                    lin(names::layer(cfg.family, l).router, router, cfg.num_experts, h)?
                }
                (FeedForward::Dense(w), MlpKind::Dense) => {
                    w.check_dims(h, cfg.dense_intermediate_size, &format!("{p}.mlp"))?
                }
                (FeedForward::Moe { .. }, MlpKind::Dense) | (FeedForward::Dense(_), MlpKind::Moe) => {
                    return Err(Error::tensor(
                        format!("{p}.mlp"),
                        "the layer's feed-forward kind (MoE or dense) differs from the config's",
                    ));
                }
            }
        }
        Ok(())
    }
}
