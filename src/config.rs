//! `ModelConfig`: every dimension and constant of a model, read from its `config.json`.
//!
//! Nothing here is specific to gpt-oss-20b or -120b: layer count, widths, heads, experts,
//! the attention pattern, the sliding window, RoPE/YaRN and the SwiGLU limit all come from
//! the file, and impossible combinations are rejected with the key and value named.
//!
//! The family (`model_type`) decides the layer recipe ([`LayerRecipe`]: QK-norm, sinks,
//! biases, the expert activation, the routing rule) in one match in
//! [`ModelConfig::from_json_str`]; everything downstream reads the recipe, never the family,
//! except the entry points of paths that support only some families, which match on it
//! exhaustively so that a new family is a compile error there.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Which attention a layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Causal attention over every earlier position.
    Full,
    /// Causal attention over the last `sliding_window` positions (the current one included).
    Sliding,
}

/// YaRN RoPE scaling parameters (`rope_scaling` with `rope_type: "yarn"`).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnScaling {
    /// Context extension factor (32 for GPT-OSS).
    pub factor: f64,
    /// Rotations bounding the extrapolated band (32).
    pub beta_fast: f64,
    /// Rotations bounding the interpolated band (1).
    pub beta_slow: f64,
    /// Context length the model was pre-trained with (4096).
    pub original_max_position_embeddings: f64,
    /// Whether the correction range is rounded to whole dimensions (false for GPT-OSS).
    pub truncate: bool,
    /// Explicit scale for cos and sin; `None` derives `0.1 ln(factor) + 1`.
    pub attention_factor: Option<f64>,
}

/// The RoPE frequency scheme.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq = theta^(-2i/d)`.
    None,
    /// YaRN (GPT-OSS).
    Yarn(YarnScaling),
}

/// The architecture family, from `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    /// OpenAI gpt-oss (`gpt_oss`).
    GptOss,
    /// Qwen3 mixture of experts (`qwen3_moe`).
    Qwen3Moe,
}

impl ModelFamily {
    /// The `model_type` string of the family.
    pub fn model_type(self) -> &'static str {
        match self {
            ModelFamily::GptOss => "gpt_oss",
            ModelFamily::Qwen3Moe => "qwen3_moe",
        }
    }
}

/// How a MoE layer turns router logits into experts and weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// gpt-oss: the top-k logits, softmax over those k.
    TopKThenSoftmax,
    /// Qwen3-MoE (and Mixtral-style): softmax over all experts, the top-k probabilities,
    /// divided by their sum when `renormalize` (`norm_topk_prob`).
    SoftmaxThenTopK {
        /// Whether the k probabilities are rescaled to sum to one.
        renormalize: bool,
    },
}

/// The gated activation of an expert (and of a dense MLP), applied to the interleaved
/// gate/up rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// gpt-oss: gate and up clamped to [`ModelConfig::swiglu_limit`],
    /// `(up + 1) * gate * sigmoid(alpha * gate)` with [`ModelConfig::swiglu_alpha`].
    ClampedSwiGlu,
    /// Plain SwiGLU: `silu(gate) * up`, no clamp.
    SiluGlu,
}

/// What a decoder layer's feed-forward block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// A router and experts.
    Moe,
    /// One dense gated MLP of `dense_intermediate_size` (Qwen3's `mlp_only_layers`).
    Dense,
}

/// The per-family shape of a decoder layer: which parts exist and which rules apply.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerRecipe {
    /// RMSNorm over each query and key head (before RoPE), with `q_norm`/`k_norm` weights.
    pub qk_norm: bool,
    /// A learned sink logit per query head in the attention softmax.
    pub attention_sinks: bool,
    /// Biases on the Q, K, V and O projections.
    pub attention_bias: bool,
    /// Biases on the router.
    pub router_bias: bool,
    /// Biases on the experts' projections (families without them load zeros: adding zero
    /// changes nothing).
    pub expert_bias: bool,
    /// The experts' activation.
    pub activation: Activation,
    /// The routing rule.
    pub routing: Routing,
}

/// Quantization metadata of a Hugging Face checkpoint (`quantization_config`).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct SourceQuantization {
    /// `quant_method`, e.g. `mxfp4`.
    pub method: String,
    /// Module name patterns that the source kept unquantized.
    pub modules_to_not_convert: Vec<String>,
}

/// Most positions a config may declare (`max_position_embeddings`, `sliding_window`):
/// 2^32 - 1, far beyond any released model; whether a context that long fits in memory is
/// checked when a model is put on a backend (`--ctx`), not here.
pub const MAX_POSITIONS: usize = u32::MAX as usize;

/// Most decoder layers a config may declare.
pub const MAX_LAYERS: usize = 1 << 12;

/// All dimensions and constants of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Architecture family.
    pub family: ModelFamily,
    /// Vocabulary size (rows of the embedding and of the output head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Per-expert intermediate width (the fused gate/up has twice this many rows); Qwen3's
    /// `moe_intermediate_size`.
    pub intermediate_size: usize,
    /// Intermediate width of the dense MLP layers (Qwen3's `intermediate_size`; equal to
    /// `intermediate_size` for families without dense layers).
    pub dense_intermediate_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA: each serves `num_heads / num_kv_heads` query heads).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub experts_per_token: usize,
    /// Attention kind of each layer.
    pub layer_types: Vec<AttentionKind>,
    /// Window of the sliding layers (positions seen, the current one included).
    pub sliding_window: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling scheme.
    pub rope_scaling: RopeScaling,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Clamp of the SwiGLU inputs (7.0 for GPT-OSS).
    pub swiglu_limit: f32,
    /// Slope of the SwiGLU sigmoid (1.702 for GPT-OSS; not in config.json).
    pub swiglu_alpha: f32,
    /// The family's layer recipe.
    pub recipe: LayerRecipe,
    /// The feed-forward kind of each layer.
    pub mlp_kinds: Vec<MlpKind>,
    /// Whether the output head is the embedding (`tie_word_embeddings`; no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Source quantization, if the checkpoint declares one.
    pub source_quantization: Option<SourceQuantization>,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    /// Reads and validates a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates config JSON; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| Error::config(path, format!("not valid JSON: {e}")))?;
        let obj = value.as_object().ok_or_else(|| Error::config(path, "expected a JSON object"))?;
        let keys = Keys { obj, path };

        let model_type = keys.string("model_type")?;
        let family = match model_type.as_str() {
            "gpt_oss" => ModelFamily::GptOss,
            "qwen3_moe" => ModelFamily::Qwen3Moe,
            other => {
                return Err(Error::config(
                    path,
                    format!("model_type \"{other}\" is not supported (supported: gpt_oss, qwen3_moe)"),
                ));
            }
        };

        let hidden_size = keys.usize("hidden_size")?;
        let num_heads = keys.usize("num_attention_heads")?;
        let num_layers = keys.usize("num_hidden_layers")?;
        let head_dim = match keys.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    return Err(Error::config(
                        path,
                        format!(
                            "head_dim is absent and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
                        ),
                    ));
                }
                hidden_size / num_heads
            }
        };
        let num_kv_heads = keys.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        let experts_per_token = match keys.opt_usize("num_experts_per_tok")? {
            Some(k) => k,
            None => keys.opt_usize("experts_per_token")?.ok_or_else(|| {
                Error::config(path, "missing key num_experts_per_tok (or experts_per_token)")
            })?,
        };
        let family_keys = match family {
            ModelFamily::GptOss => gpt_oss_keys(&keys, num_layers)?,
            ModelFamily::Qwen3Moe => qwen3_moe_keys(&keys, num_layers)?,
        };

        let rope_scaling = match obj.get("rope_scaling") {
            None | Some(Value::Null) => RopeScaling::None,
            Some(Value::Object(rs)) => parse_rope_scaling(rs, path)?,
            Some(other) => {
                return Err(Error::config(path, format!("rope_scaling is {other}, expected an object")));
            }
        };

        let source_quantization = match obj.get("quantization_config") {
            None | Some(Value::Null) => None,
            Some(Value::Object(q)) => Some(parse_source_quantization(q, path)?),
            Some(other) => {
                return Err(Error::config(
                    path,
                    format!("quantization_config is {other}, expected an object"),
                ));
            }
        };

        let cfg = ModelConfig {
            family,
            vocab_size: keys.usize("vocab_size")?,
            hidden_size,
            intermediate_size: family_keys.intermediate_size,
            dense_intermediate_size: family_keys.dense_intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            num_experts: family_keys.num_experts,
            experts_per_token,
            layer_types: family_keys.layer_types,
            sliding_window: family_keys.sliding_window,
            rope_theta: keys.opt_f64("rope_theta")?.unwrap_or(10000.0),
            rope_scaling,
            rms_norm_eps: to_f32("rms_norm_eps", keys.opt_f64("rms_norm_eps")?.unwrap_or(1e-5), path)?,
            swiglu_limit: to_f32("swiglu_limit", keys.opt_f64("swiglu_limit")?.unwrap_or(7.0), path)?,
            swiglu_alpha: 1.702,
            max_position_embeddings: keys.opt_usize("max_position_embeddings")?.unwrap_or(131072),
            source_quantization,
            recipe: family_keys.recipe,
            mlp_kinds: family_keys.mlp_kinds,
            tie_word_embeddings: family_keys.tie_word_embeddings,
        };
        cfg.validate().map_err(|m| Error::config(path, m))?;
        Ok(cfg)
    }

    /// Checks that the dimensions describe a model that can exist and that every size the
    /// engine derives from them is computable without overflow; the message names the
    /// offending keys and values.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.validate_dimensions()?;
        self.validate_structure()?;
        self.validate_constants()?;
        if let RopeScaling::Yarn(y) = &self.rope_scaling {
            y.validate()?;
        }
        self.derived_sizes()?;
        Ok(())
    }

    /// Every dimension is positive and within the supported maximum.
    fn validate_dimensions(&self) -> std::result::Result<(), String> {
        let keys = self.family_key_names();
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            (keys.expert_intermediate, self.intermediate_size),
            (keys.dense_intermediate, self.dense_intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            (keys.experts, self.num_experts),
            ("num_experts_per_tok", self.experts_per_token),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(format!("{key} is 0; it must be positive"));
            }
        }
        // Sizes beyond these would overflow index arithmetic long before any real model.
        let limits = [
            ("vocab_size", self.vocab_size, 1 << 24),
            ("hidden_size", self.hidden_size, 1 << 17),
            (keys.expert_intermediate, self.intermediate_size, 1 << 18),
            (keys.dense_intermediate, self.dense_intermediate_size, 1 << 18),
            ("num_hidden_layers", self.num_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_heads, 1 << 12),
            ("num_key_value_heads", self.num_kv_heads, 1 << 12),
            ("head_dim", self.head_dim, 1 << 12),
            (keys.experts, self.num_experts, 1 << 14),
            ("max_position_embeddings", self.max_position_embeddings, MAX_POSITIONS),
            ("sliding_window", self.sliding_window, MAX_POSITIONS),
        ];
        for (key, v, max) in limits {
            if v > max {
                return Err(format!("{key} is {v}, larger than the supported maximum {max}"));
            }
        }
        Ok(())
    }

    /// The config keys this family reads the expert count and the two intermediate widths
    /// from, so that errors name the key the file has.
    fn family_key_names(&self) -> FamilyKeyNames {
        match self.family {
            ModelFamily::GptOss => FamilyKeyNames {
                experts: "num_local_experts",
                expert_intermediate: "intermediate_size",
                dense_intermediate: "intermediate_size",
            },
            ModelFamily::Qwen3Moe => FamilyKeyNames {
                experts: "num_experts",
                expert_intermediate: "moe_intermediate_size",
                dense_intermediate: "intermediate_size",
            },
        }
    }

    /// Heads, experts and layer types fit together.
    fn validate_structure(&self) -> std::result::Result<(), String> {
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} is odd; RoPE rotates pairs of halves", self.head_dim));
        }
        if self.experts_per_token > self.num_experts {
            return Err(format!(
                "num_experts_per_tok {} exceeds {} {}",
                self.experts_per_token,
                self.family_key_names().experts,
                self.num_experts
            ));
        }
        if self.layer_types.len() != self.num_layers {
            return Err(format!(
                "layer_types has {} entries but num_hidden_layers is {}",
                self.layer_types.len(),
                self.num_layers
            ));
        }
        if self.mlp_kinds.len() != self.num_layers {
            return Err(format!(
                "{} feed-forward kinds for num_hidden_layers {}",
                self.mlp_kinds.len(),
                self.num_layers
            ));
        }
        if self.layer_types.contains(&AttentionKind::Sliding) && self.sliding_window == 0 {
            return Err("layer_types has sliding layers but sliding_window is 0 or absent".into());
        }
        Ok(())
    }

    /// The floating-point constants are finite and in range.
    fn validate_constants(&self) -> std::result::Result<(), String> {
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(format!("rms_norm_eps {} must be a positive number", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(format!("rope_theta {:?} must be a finite number greater than 1", self.rope_theta));
        }
        if !(self.swiglu_limit.is_finite() && self.swiglu_limit > 0.0) {
            return Err(format!("swiglu_limit {} must be a positive number", self.swiglu_limit));
        }
        if !(self.swiglu_alpha.is_finite() && self.swiglu_alpha > 0.0) {
            return Err(format!("swiglu_alpha {} must be a positive number", self.swiglu_alpha));
        }
        Ok(())
    }

    /// Every size the engine derives from this config, computed with checked arithmetic;
    /// the error names the keys whose product overflows. [`ModelConfig::validate`] calls
    /// it, so for a config read from a file it always succeeds.
    pub fn derived_sizes(&self) -> std::result::Result<DerivedSizes, String> {
        const F32: u64 = std::mem::size_of::<f32>() as u64;
        let n = |v: usize| v as u64;
        let overflow = |what: &str, keys: &str| {
            format!(
                "{keys}: the {what} they imply does not fit in 64 bits; the config cannot describe a real model"
            )
        };
        let mul = |factors: &[u64], what: &str, keys: &str| {
            factors.iter().try_fold(1u64, |acc, &f| acc.checked_mul(f)).ok_or_else(|| overflow(what, keys))
        };
        let add = |terms: &[u64], what: &str, keys: &str| {
            terms.iter().try_fold(0u64, |acc, &t| acc.checked_add(t)).ok_or_else(|| overflow(what, keys))
        };
        let heads = "num_attention_heads, num_key_value_heads and head_dim";
        let q_dim = mul(&[n(self.num_heads), n(self.head_dim)], "query width", heads)?;
        let kv_dim = mul(&[n(self.num_kv_heads), n(self.head_dim)], "key/value width", heads)?;
        let kv_keys = "num_hidden_layers, num_key_value_heads and head_dim";
        let kv_bytes_per_position = mul(&[2, n(self.num_layers), kv_dim, F32], "KV cache", kv_keys)?;
        let kv_bytes_max = mul(
            &[kv_bytes_per_position, n(self.max_position_embeddings)],
            "KV cache at max_position_embeddings",
            "max_position_embeddings with num_hidden_layers, num_key_value_heads and head_dim",
        )?;
        let rope_table_bytes_max = mul(
            &[2, n(self.max_position_embeddings), n(self.head_dim / 2), F32],
            "RoPE table",
            "max_position_embeddings and head_dim",
        )?;
        let embedding_bytes =
            mul(&[n(self.vocab_size), n(self.hidden_size), F32], "embedding", "vocab_size and hidden_size")?;
        let ffn = "hidden_size and intermediate_size";
        let gate_up = mul(&[2, n(self.intermediate_size), n(self.hidden_size)], "expert", ffn)?;
        let down = mul(&[n(self.hidden_size), n(self.intermediate_size)], "expert", ffn)?;
        let gate_up_bias = mul(&[2, n(self.intermediate_size)], "expert", ffn)?;
        let biases = add(&[gate_up_bias, n(self.hidden_size)], "expert", ffn)?;
        let expert_values = add(&[gate_up, down, biases], "expert", ffn)?;
        let expert_bytes_f32 = mul(&[expert_values, F32], "expert", ffn)?;
        let all_experts_bytes_f32 = mul(
            &[expert_bytes_f32, n(self.num_experts), n(self.num_layers)],
            "expert store",
            "num_local_experts, num_hidden_layers, hidden_size and intermediate_size",
        )?;
        let attn = "hidden_size, num_attention_heads, num_key_value_heads and head_dim";
        let projections = add(&[q_dim, kv_dim, kv_dim, q_dim], "attention weights", attn)?;
        let attention_bytes_per_layer =
            mul(&[projections, n(self.hidden_size), F32], "attention weights", attn)?;
        let to_usize = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| format!("{heads}: the {what} {v} does not fit in usize"))
        };
        Ok(DerivedSizes {
            q_dim: to_usize(q_dim, "query width")?,
            kv_dim: to_usize(kv_dim, "key/value width")?,
            kv_bytes_per_position,
            kv_bytes_max,
            rope_table_bytes_max,
            embedding_bytes,
            expert_bytes_f32,
            all_experts_bytes_f32,
            attention_bytes_per_layer,
        })
    }

    /// Bytes of the F32 key/value cache for `ctx` positions, `None` on overflow.
    pub fn kv_bytes(&self, ctx: usize) -> Option<u64> {
        crate::backend::cpu::kv_cache::KvCache::bytes_for(self.num_layers, ctx, self.kv_dim())
    }

    /// Bytes of the F32 RoPE cos and sin tables for `ctx` positions, `None` on overflow.
    pub fn rope_table_bytes(&self, ctx: usize) -> Option<u64> {
        (ctx as u64).checked_mul(self.head_dim as u64)?.checked_mul(std::mem::size_of::<f32>() as u64)
    }

    /// The layers whose feed-forward is a mixture of experts, in order. Only these have
    /// expert records; a dense MLP layer's weights are dense tensors.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.mlp_kinds.iter().enumerate().filter(|(_, k)| **k == MlpKind::Moe).map(|(l, _)| l)
    }

    /// Number of expert records: experts per layer times the MoE layers. Cannot overflow
    /// for a validated config (both are bounded).
    pub fn num_expert_records(&self) -> usize {
        self.moe_layers().count() * self.num_experts
    }

    /// Position of the record of `expert` in `layer` in the expert store: records are
    /// ordered by MoE layer, then expert, and dense layers have none. `None` for a dense
    /// layer or an index out of range.
    pub fn expert_record(&self, layer: usize, expert: usize) -> Option<usize> {
        if expert >= self.num_experts || *self.mlp_kinds.get(layer)? != MlpKind::Moe {
            return None;
        }
        let moe_before = self.mlp_kinds[..layer].iter().filter(|k| **k == MlpKind::Moe).count();
        Some(moe_before * self.num_experts + expert)
    }

    /// Width of all query heads together. Cannot overflow for a validated config (heads
    /// and head_dim are each at most 4096).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of all key (or value) heads together. Cannot overflow for a validated config.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Attention kind of layer `layer` (`layer < num_layers`, an index the engine owns).
    pub fn attention(&self, layer: usize) -> AttentionKind {
        self.layer_types[layer]
    }

    /// How many earlier-or-current positions layer `layer` attends to at most
    /// (`None` for full attention).
    pub fn window(&self, layer: usize) -> Option<usize> {
        match self.layer_types[layer] {
            AttentionKind::Full => None,
            AttentionKind::Sliding => Some(self.sliding_window),
        }
    }
}

/// Sizes derived from a [`ModelConfig`], each computed with checked arithmetic (see
/// [`ModelConfig::derived_sizes`]). Byte counts assume F32, the widest format, so that
/// every narrower format's size is smaller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DerivedSizes {
    /// Width of all query heads together.
    pub q_dim: usize,
    /// Width of all key (or value) heads together.
    pub kv_dim: usize,
    /// Bytes of one position's keys and values over every layer.
    pub kv_bytes_per_position: u64,
    /// Bytes of the key/value cache at `max_position_embeddings` positions.
    pub kv_bytes_max: u64,
    /// Bytes of the RoPE cos and sin tables at `max_position_embeddings` positions.
    pub rope_table_bytes_max: u64,
    /// Bytes of the embedding table (the output head has the same size).
    pub embedding_bytes: u64,
    /// Bytes of one expert (gate/up, down and their biases).
    pub expert_bytes_f32: u64,
    /// Bytes of every expert of every layer.
    pub all_experts_bytes_f32: u64,
    /// Bytes of one layer's q, k, v and o projections.
    pub attention_bytes_per_layer: u64,
}

impl YarnScaling {
    /// Every field is finite and in range; the message names the `rope_scaling` key.
    fn validate(&self) -> std::result::Result<(), String> {
        if !(self.factor.is_finite() && self.factor >= 1.0) {
            return Err(format!(
                "rope_scaling.factor {:?} must be a finite number of at least 1",
                self.factor
            ));
        }
        let positive = [
            ("original_max_position_embeddings", self.original_max_position_embeddings),
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("rope_scaling.{key} {v:?} must be a positive finite number"));
            }
        }
        // YaRN's correction range takes ln(original_max / (beta 2 pi)); extreme values would
        // make it infinite and the frequencies NaN.
        for (key, beta) in [("beta_fast", self.beta_fast), ("beta_slow", self.beta_slow)] {
            let ratio = self.original_max_position_embeddings / (beta * 2.0 * std::f64::consts::PI);
            if !(ratio.is_finite() && ratio > 0.0 && ratio.ln().is_finite()) {
                return Err(format!(
                    "rope_scaling.{key} {beta:?} with original_max_position_embeddings {:?} makes the YaRN \
                     correction range infinite",
                    self.original_max_position_embeddings
                ));
            }
        }
        // It multiplies cos and sin in f32: it must stay positive and finite there too.
        if let Some(a) = self.attention_factor
            && !(a > 0.0 && (a as f32).is_finite() && (a as f32) > 0.0)
        {
            return Err(format!(
                "rope_scaling.attention_factor {a:?} must be a positive number in the range of a 32-bit float"
            ));
        }
        Ok(())
    }
}

/// Converts a config constant to f32, refusing values that f32 cannot hold (they would
/// become 0 or infinity silently).
fn to_f32(key: &str, v: f64, path: &Path) -> Result<f32> {
    let f = v as f32;
    if !f.is_finite() || (v != 0.0 && f == 0.0) {
        return Err(Error::config(path, format!("{key} is {v:?}, outside the range of a 32-bit float")));
    }
    Ok(f)
}

/// Reads `quantization_config`; wrong types are errors naming the key.
fn parse_source_quantization(q: &Map<String, Value>, path: &Path) -> Result<SourceQuantization> {
    let method = match q.get("quant_method") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => {
            return Err(Error::config(
                path,
                format!("quantization_config.quant_method is {v}, expected a string"),
            ));
        }
    };
    let modules_to_not_convert = match q.get("modules_to_not_convert") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().map(String::from).ok_or_else(|| {
                    Error::config(
                        path,
                        format!("quantization_config.modules_to_not_convert[{i}] is {v}, expected a string"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?,
        Some(v) => {
            return Err(Error::config(
                path,
                format!("quantization_config.modules_to_not_convert is {v}, expected a list of strings"),
            ));
        }
    };
    Ok(SourceQuantization { method, modules_to_not_convert })
}

/// Reads `rope_scaling`. Only YaRN (and `default`, plain RoPE, as Transformers spells
/// "no scaling") are supported; wrong types and out-of-range values are errors naming the
/// key, never replaced by defaults.
fn parse_rope_scaling(rs: &Map<String, Value>, path: &Path) -> Result<RopeScaling> {
    let kind =
        match rs.get("rope_type").map(|v| ("rope_type", v)).or_else(|| rs.get("type").map(|v| ("type", v))) {
            Some((_, Value::String(s))) => s.as_str(),
            Some((key, v)) => {
                return Err(Error::config(path, format!("rope_scaling.{key} is {v}, expected a string")));
            }
            None => return Err(Error::config(path, "rope_scaling has no rope_type (expected \"yarn\")")),
        };
    let num = |key: &str| -> Result<Option<f64>> {
        match rs.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Error::config(path, format!("rope_scaling.{key} is {v}, expected a number"))),
        }
    };
    let required = |key: &str| -> Result<f64> {
        num(key)?.ok_or_else(|| Error::config(path, format!("rope_scaling (yarn) has no {key}")))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "yarn" => {
            let truncate = match rs.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(Error::config(
                        path,
                        format!("rope_scaling.truncate is {v}, expected true or false"),
                    ));
                }
            };
            let yarn = YarnScaling {
                factor: required("factor")?,
                beta_fast: num("beta_fast")?.unwrap_or(32.0),
                beta_slow: num("beta_slow")?.unwrap_or(1.0),
                original_max_position_embeddings: required("original_max_position_embeddings")?,
                truncate,
                attention_factor: num("attention_factor")?,
            };
            yarn.validate().map_err(|m| Error::config(path, m))?;
            Ok(RopeScaling::Yarn(yarn))
        }
        other => Err(Error::config(
            path,
            format!("rope_scaling.rope_type \"{other}\" is not supported (supported: yarn, default)"),
        )),
    }
}

/// Names of the family-specific keys, for errors.
struct FamilyKeyNames {
    experts: &'static str,
    expert_intermediate: &'static str,
    dense_intermediate: &'static str,
}

/// What a family reads from config.json beyond the keys every family shares.
struct FamilyKeys {
    intermediate_size: usize,
    dense_intermediate_size: usize,
    num_experts: usize,
    layer_types: Vec<AttentionKind>,
    sliding_window: usize,
    recipe: LayerRecipe,
    mlp_kinds: Vec<MlpKind>,
    tie_word_embeddings: bool,
}

/// A per-layer list for a layer count within bounds, else empty (validation then reports
/// the count itself), so that a huge count allocates nothing.
fn per_layer<T>(num_layers: usize, f: impl FnMut(usize) -> T) -> Vec<T> {
    (0..if num_layers <= MAX_LAYERS { num_layers } else { 0 }).map(f).collect()
}

/// gpt-oss: `layer_types` (default alternating sliding/full), `sliding_window`,
/// `num_local_experts`, every layer MoE, sinks and biases everywhere, clamped SwiGLU.
fn gpt_oss_keys(keys: &Keys<'_>, num_layers: usize) -> Result<FamilyKeys> {
    let path = keys.path;
    let layer_types = match keys.obj.get("layer_types") {
        None | Some(Value::Null) => {
            per_layer(num_layers, |i| if i % 2 == 0 { AttentionKind::Sliding } else { AttentionKind::Full })
        }
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("sliding_attention") => Ok(AttentionKind::Sliding),
                Some("full_attention") => Ok(AttentionKind::Full),
                _ => Err(Error::config(
                    path,
                    format!("layer_types[{i}] is {v}, expected \"sliding_attention\" or \"full_attention\""),
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(other) => {
            return Err(Error::config(path, format!("layer_types is {other}, expected a list")));
        }
    };
    if keys.opt_bool("tie_word_embeddings")?.unwrap_or(false) {
        return Err(Error::config(
            path,
            "tie_word_embeddings is true; gpt-oss keeps a separate lm_head and tied heads are not supported",
        ));
    }
    let intermediate_size = keys.usize("intermediate_size")?;
    Ok(FamilyKeys {
        intermediate_size,
        dense_intermediate_size: intermediate_size,
        num_experts: keys.usize("num_local_experts")?,
        layer_types,
        sliding_window: keys.opt_usize("sliding_window")?.unwrap_or(0),
        recipe: LayerRecipe {
            qk_norm: false,
            attention_sinks: true,
            attention_bias: true,
            router_bias: true,
            expert_bias: true,
            activation: Activation::ClampedSwiGlu,
            routing: Routing::TopKThenSoftmax,
        },
        mlp_kinds: per_layer(num_layers, |_| MlpKind::Moe),
        tie_word_embeddings: false,
    })
}

/// Qwen3-MoE: `moe_intermediate_size` for the experts and `intermediate_size` for the dense
/// layers (`mlp_only_layers`, `decoder_sparse_step`), `num_experts`, `norm_topk_prob`,
/// `attention_bias`, `tie_word_embeddings`; full attention everywhere (`use_sliding_window`
/// true is refused), QK-norm, no sinks, plain SwiGLU without biases.
fn qwen3_moe_keys(keys: &Keys<'_>, num_layers: usize) -> Result<FamilyKeys> {
    let path = keys.path;
    if keys.opt_bool("use_sliding_window")?.unwrap_or(false) {
        return Err(Error::config(
            path,
            "use_sliding_window is true; sliding-window Qwen3-MoE layers are not supported",
        ));
    }
    let num_experts = keys.usize("num_experts")?;
    let step = keys.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(Error::config(path, "decoder_sparse_step is 0; it must be positive"));
    }
    let dense_only: Vec<usize> = match keys.obj.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) if n < num_layers => Ok(n),
                _ => Err(Error::config(
                    path,
                    format!("mlp_only_layers[{i}] is {v}, expected a layer index below num_hidden_layers {num_layers}"),
                )),
            })
            .collect::<Result<_>>()?,
        Some(other) => {
            return Err(Error::config(path, format!("mlp_only_layers is {other}, expected a list")));
        }
    };
    let mlp_kinds = per_layer(num_layers, |l| {
        if !dense_only.contains(&l) && num_experts > 0 && (l + 1) % step == 0 {
            MlpKind::Moe
        } else {
            MlpKind::Dense
        }
    });
    let attention_bias = keys.opt_bool("attention_bias")?.unwrap_or(false);
    Ok(FamilyKeys {
        intermediate_size: keys.usize("moe_intermediate_size")?,
        dense_intermediate_size: keys.usize("intermediate_size")?,
        num_experts,
        layer_types: per_layer(num_layers, |_| AttentionKind::Full),
        sliding_window: 0,
        recipe: LayerRecipe {
            qk_norm: true,
            attention_sinks: false,
            attention_bias,
            router_bias: false,
            expert_bias: false,
            activation: Activation::SiluGlu,
            routing: Routing::SoftmaxThenTopK {
                renormalize: keys.opt_bool("norm_topk_prob")?.unwrap_or(false),
            },
        },
        mlp_kinds,
        tie_word_embeddings: keys.opt_bool("tie_word_embeddings")?.unwrap_or(false),
    })
}

/// Typed access to config keys with errors that name the key and the value found.
struct Keys<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Keys<'_> {
    fn string(&self, key: &str) -> Result<String> {
        match self.obj.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(Error::config(self.path, format!("{key} is {v}, expected a string"))),
            None => Err(Error::config(self.path, format!("missing key {key}"))),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| Error::config(self.path, format!("missing key {key}")))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => usize::try_from(n)
                    .map(Some)
                    .map_err(|_| Error::config(self.path, format!("{key} is {n}, too large"))),
                None => {
                    Err(Error::config(self.path, format!("{key} is {v}, expected a non-negative integer")))
                }
            },
        }
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Error::config(self.path, format!("{key} is {v}, expected a number"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Error::config(self.path, format!("{key} is {v}, expected true or false"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT_OSS_20B: &str = r#"{
        "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
        "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
            "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true, "vocab_size": 201088
    }"#;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("config.json"))
    }

    #[test]
    fn expert_records_skip_dense_layers() {
        let mut c = parse(GPT_OSS_20B).unwrap();
        assert_eq!(c.num_expert_records(), 24 * 32);
        assert_eq!(c.expert_record(23, 31), Some(24 * 32 - 1));
        c.mlp_kinds[0] = MlpKind::Dense;
        c.mlp_kinds[5] = MlpKind::Dense;
        assert_eq!(c.num_expert_records(), 22 * 32);
        assert_eq!(c.expert_record(0, 0), None);
        assert_eq!(c.expert_record(1, 0), Some(0));
        assert_eq!(c.expert_record(4, 31), Some(4 * 32 - 1));
        assert_eq!(c.expert_record(5, 3), None);
        assert_eq!(c.expert_record(6, 0), Some(4 * 32));
        assert_eq!(c.expert_record(6, 32), None, "expert out of range");
        assert_eq!(c.expert_record(24, 0), None, "layer out of range");
        let mut n = 0;
        for l in c.moe_layers() {
            for e in 0..32 {
                assert_eq!(c.expert_record(l, e), Some(n));
                n += 1;
            }
        }
        assert_eq!(n, c.num_expert_records());
    }

    #[test]
    fn reads_the_released_20b_config() {
        let c = parse(GPT_OSS_20B).unwrap();
        assert_eq!(c.num_layers, 24);
        assert_eq!(c.num_experts, 32);
        assert_eq!(c.experts_per_token, 4);
        assert_eq!(c.q_dim(), 4096);
        assert_eq!(c.kv_dim(), 512);
        // No layer_types key: even layers slide.
        assert_eq!(c.layer_types[0], AttentionKind::Sliding);
        assert_eq!(c.layer_types[1], AttentionKind::Full);
        assert_eq!(c.window(0), Some(128));
        assert_eq!(c.window(1), None);
        match &c.rope_scaling {
            RopeScaling::Yarn(y) => {
                assert_eq!(y.factor, 32.0);
                assert!(!y.truncate);
            }
            other => panic!("expected YaRN, got {other:?}"),
        }
        assert_eq!(c.source_quantization.as_ref().unwrap().method, "mxfp4");
    }

    #[test]
    fn older_key_for_top_k_is_accepted() {
        let text = GPT_OSS_20B.replace("\"num_experts_per_tok\": 4,", "");
        assert_eq!(parse(&text).unwrap().experts_per_token, 4);
    }

    #[test]
    fn impossible_dimensions_are_named() {
        let cases = [
            ("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 7", "num_key_value_heads 7"),
            ("\"hidden_size\": 2880", "\"hidden_size\": 0", "hidden_size is 0"),
            ("\"head_dim\": 64", "\"head_dim\": 63", "head_dim 63 is odd"),
            ("\"num_experts_per_tok\": 4", "\"num_experts_per_tok\": 33", "num_experts_per_tok 33"),
            ("\"vocab_size\": 201088", "\"vocab_size\": -5", "vocab_size is -5"),
            ("\"model_type\": \"gpt_oss\"", "\"model_type\": \"llama\"", "llama"),
        ];
        for (from, to, expect) in cases {
            let text = GPT_OSS_20B.replace(from, to);
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains(expect), "for {to}: error `{err}` does not mention `{expect}`");
            assert!(err.contains("config.json"), "error `{err}` does not name the file");
        }
    }

    #[test]
    fn layer_types_must_match_layer_count() {
        let text = GPT_OSS_20B.replace(
            "\"num_hidden_layers\": 24",
            "\"num_hidden_layers\": 2, \"layer_types\": [\"full_attention\"]",
        );
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("layer_types has 1 entries"), "{err}");
    }

    #[test]
    fn missing_key_is_named() {
        let text = GPT_OSS_20B.replace("\"intermediate_size\": 2880,", "");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("missing key intermediate_size"), "{err}");
    }
}
