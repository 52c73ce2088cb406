//! The Hugging Face tensor names of a model, by family: the one table of names that the
//! weight assembly ([`crate::model::weights::DenseWeights::assemble`]), the list of dense
//! tensors the checkpoint check, converter and container reader use
//! ([`crate::format::container::layout::dense_tensors`]) and the expert readers share. A
//! family whose checkpoints name a tensor differently changes it here, once.

use crate::config::ModelFamily;

/// The token embedding.
pub const EMBED: &str = "model.embed_tokens.weight";
/// The output head (absent when the family ties it to the embedding).
pub const LM_HEAD: &str = "lm_head.weight";
/// The final RMSNorm weight.
pub const FINAL_NORM: &str = "model.norm.weight";

/// The names of one decoder layer's dense tensors. Linear layers are prefixes (add
/// `.weight`, and `.bias` where the recipe has biases); the others are whole names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerNames {
    /// RMSNorm weight before attention.
    pub attn_norm: String,
    /// Query, key, value and output projections (prefixes).
    pub q: String,
    /// See `q`.
    pub k: String,
    /// See `q`.
    pub v: String,
    /// See `q`.
    pub o: String,
    /// Attention sinks, in families with them.
    pub sinks: String,
    /// QK-norm weights, in families with them.
    pub q_norm: String,
    /// See `q_norm`.
    pub k_norm: String,
    /// RMSNorm weight before the feed-forward block.
    pub mlp_norm: String,
    /// The router of a MoE layer (prefix).
    pub router: String,
    /// The gate, up and down projections of a dense MLP layer.
    pub dense_gate: String,
    /// See `dense_gate`.
    pub dense_up: String,
    /// See `dense_gate`.
    pub dense_down: String,
}

/// The names of layer `layer`'s dense tensors in `family`'s checkpoints.
pub fn layer(family: ModelFamily, layer: usize) -> LayerNames {
    let p = format!("model.layers.{layer}");
    let a = format!("{p}.self_attn");
    let router = match family {
        ModelFamily::GptOss => format!("{p}.mlp.router"),
        ModelFamily::Qwen3Moe => format!("{p}.mlp.gate"),
    };
    LayerNames {
        attn_norm: format!("{p}.input_layernorm.weight"),
        q: format!("{a}.q_proj"),
        k: format!("{a}.k_proj"),
        v: format!("{a}.v_proj"),
        o: format!("{a}.o_proj"),
        sinks: format!("{a}.sinks"),
        q_norm: format!("{a}.q_norm.weight"),
        k_norm: format!("{a}.k_norm.weight"),
        mlp_norm: format!("{p}.post_attention_layernorm.weight"),
        router,
        dense_gate: format!("{p}.mlp.gate_proj.weight"),
        dense_up: format!("{p}.mlp.up_proj.weight"),
        dense_down: format!("{p}.mlp.down_proj.weight"),
    }
}

/// The prefix of layer `layer`'s fused expert tensors (GPT-OSS: `{prefix}.gate_up_proj`,
/// `_blocks`, `_scales`, `_bias`, ...).
pub fn fused_experts(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.experts")
}

/// One projection (`gate_proj`, `up_proj`, `down_proj`) of one expert in the separate
/// layout (Qwen3-MoE).
pub fn separate_expert(layer: usize, expert: usize, projection: &str) -> String {
    format!("model.layers.{layer}.mlp.experts.{expert}.{projection}.weight")
}
