//! `picchio synth`: random checkpoints of exact shape, in the released layout, for
//! measuring speed where real weights cannot be had: GPT-OSS (config.json with
//! `quantization_config`, BF16 dense tensors, MXFP4 experts) and Qwen3-MoE (BF16, one
//! matrix per expert and projection), sharded safetensors with an index.
//!
//! Compute and I/O depend on shapes, not values, so a random checkpoint of the real shape
//! is an honest stand-in for everything but routing statistics. Values are scaled so that
//! activations stay finite through every layer and routing is not degenerate. Output is
//! deterministic for a seed; memory stays bounded (tensors are generated in chunks and
//! streamed to disk).
//!
//! Random router weights route near-uniformly: every expert of a layer is about equally
//! popular. Real routing is skewed, which is what expert caches, hot sets and batching
//! exploit, so [`SynthSpec::routing_skew`] can model it (GPT-OSS only): it adds to each
//! layer's router bias a Zipf-like term over a per-layer random popularity order,
//! `-S * skew_scale * ln(1 + 32 * rank / experts)` (see [`skew_bias`] and [`skew_scale`]),
//! which makes an expert's chance of being chosen fall about as `(1 + 32 * rank /
//! experts)^-S`. This is a model of skewed routing, not a measurement of any real model's.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use half::bf16;
use serde_json::{Value, json};

use crate::config::ModelFamily;
use crate::error::{Error, Result};
use crate::model::names;

/// A named starting shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthShape {
    /// gpt-oss-20b: 24 layers, 32 experts.
    #[value(name = "gpt-oss-20b")]
    GptOss20b,
    /// gpt-oss-120b: 36 layers, 128 experts.
    #[value(name = "gpt-oss-120b")]
    GptOss120b,
    /// A few MB of layers with the real 201088-token vocabulary (for chat tests).
    Tiny,
    /// Qwen3-30B-A3B: 48 layers, 128 experts (top-8), BF16 (about 61 GB).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// Qwen3-235B-A22B: 94 layers, 128 experts (top-8), BF16 (about 470 GB).
    #[value(name = "qwen3-235b-a22b")]
    Qwen3_235bA22b,
}

/// Every dimension of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    /// The family whose checkpoint layout is written: GPT-OSS (MXFP4 experts as released) or
    /// Qwen3-MoE (BF16, one matrix per expert and projection).
    pub family: ModelFamily,
    /// Decoder layers.
    pub layers: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Residual width.
    pub hidden: usize,
    /// Per-expert intermediate width.
    pub intermediate: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Sliding window.
    pub window: usize,
    /// Seed of every random value.
    pub seed: u64,
    /// Largest shard in bytes.
    pub shard_bytes: u64,
    /// How strongly routing favours some experts of each layer (0: the near-uniform routing
    /// of random router weights, byte-identical to checkpoints made before the option
    /// existed). GPT-OSS only: Qwen3-MoE's router has no bias to carry it. See
    /// [`skew_bias`] for the formula.
    pub routing_skew: f64,
}

/// Largest accepted [`SynthSpec::routing_skew`]: at 16 a layer's few most popular experts
/// already take nearly every token; nothing beyond it is a different model of routing,
/// only a larger number (and biases that lose BF16 precision).
pub const MAX_ROUTING_SKEW: f64 = 16.0;

/// Standard deviation of a synthetic router logit for a unit-RMS input: the router weights
/// are drawn with standard deviation `ROUTER_LOGIT_STD / sqrt(hidden)`, so their dot
/// product with a normed hidden state spreads by this much on every shape. The routing
/// skew is expressed in these units, so that one S means the same on every width.
pub const ROUTER_LOGIT_STD: f32 = 2.0;

/// Experts per layer that the skew's popularity curve is written for: ranks are scaled to
/// this many, so a layer of 128 experts follows the same curve over the share of its
/// experts as one of 32 (the 20B's width), where the formula is plain Zipf over the rank.
const SKEW_REFERENCE_EXPERTS: f64 = 32.0;

/// Router-logit units per unit of the skew's log-popularity for layers of `experts` that
/// choose `top_k` each: `ROUTER_LOGIT_STD / lambda(z)`, where `z` is the standard-normal
/// quantile that `top_k / experts` of the logits exceed and `lambda(z) = phi(z) / Q(z)` the
/// inverse Mills ratio. Near that threshold a bias `b` multiplies an expert's chance of
/// being among the top `k` by about `exp(b * lambda(z) / ROUTER_LOGIT_STD)`, so with this
/// scale `skew_bias` gives chances falling about as `(1 + 32 * rank / experts)^-S` on every
/// width and top-k (the 20B's 4 of 32: 1.214; the 120B's 4 of 128: 0.888). Needs
/// `0 < top_k < experts`.
pub fn skew_scale(experts: usize, top_k: usize) -> f64 {
    let share = top_k as f64 / experts as f64;
    // Bisection for Q(z) = share; Q falls from 1 to 0 over [-8, 8].
    let (mut lo, mut hi) = (-8.0f64, 8.0f64);
    for _ in 0..80 {
        let mid = 0.5 * (lo + hi);
        if normal_tail(mid) > share {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let z = 0.5 * (lo + hi);
    let density = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
    f64::from(ROUTER_LOGIT_STD) * share / density
}

/// The standard normal's upper tail `Q(z) = P(X > z)` (Abramowitz and Stegun 7.1.26,
/// absolute error below 1.5e-7).
fn normal_tail(z: f64) -> f64 {
    if z < 0.0 {
        return 1.0 - normal_tail(-z);
    }
    let x = z / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    0.5 * poly * (-x * x).exp()
}

/// The routing-skew term of one layer's router bias, indexed by expert: expert `e` of
/// popularity rank `r` (0 = most popular; the order is a seeded random permutation, drawn
/// per layer from `seed` and `layer_key`, so different layers favour different experts)
/// gets `-skew * skew_scale(experts, top_k) * ln(1 + 32 * r / experts)`. All zeros when
/// `skew` is 0.
pub fn skew_bias(experts: usize, top_k: usize, skew: f64, seed: u64, layer_key: &str) -> Vec<f32> {
    let mut bias = vec![0f32; experts];
    if skew == 0.0 {
        return bias;
    }
    let mut order: Vec<usize> = (0..experts).collect();
    let mut rng = Rng::for_tensor(seed, &format!("{layer_key}#popularity"));
    for i in (1..experts).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let scale = skew_scale(experts, top_k);
    for (rank, &e) in order.iter().enumerate() {
        let scaled = SKEW_REFERENCE_EXPERTS * rank as f64 / experts as f64;
        bias[e] = (-skew * scale * scaled.ln_1p()) as f32;
    }
    bias
}

impl SynthSpec {
    /// The spec of a named shape, with seed 0 and 4 GiB shards.
    pub fn of(shape: SynthShape) -> Self {
        let base = SynthSpec {
            family: ModelFamily::GptOss,
            layers: 24,
            experts: 32,
            top_k: 4,
            hidden: 2880,
            intermediate: 2880,
            heads: 64,
            kv_heads: 8,
            head_dim: 64,
            vocab: 201088,
            window: 128,
            seed: 0,
            shard_bytes: 4 << 30,
            routing_skew: 0.0,
        };
        match shape {
            SynthShape::GptOss20b => base,
            SynthShape::GptOss120b => SynthSpec { layers: 36, experts: 128, ..base },
            SynthShape::Tiny => SynthSpec {
                layers: 4,
                experts: 8,
                hidden: 64,
                intermediate: 64,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                ..base
            },
            SynthShape::Qwen3_30bA3b => SynthSpec {
                family: ModelFamily::Qwen3Moe,
                layers: 48,
                experts: 128,
                top_k: 8,
                hidden: 2048,
                intermediate: 768,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                vocab: 151936,
                ..base
            },
            SynthShape::Qwen3_235bA22b => SynthSpec {
                family: ModelFamily::Qwen3Moe,
                layers: 94,
                experts: 128,
                top_k: 8,
                hidden: 4096,
                intermediate: 1536,
                heads: 64,
                kv_heads: 4,
                head_dim: 128,
                vocab: 151936,
                ..base
            },
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::invalid(m));
        if !self.hidden.is_multiple_of(32) || !self.intermediate.is_multiple_of(32) {
            return bad(format!(
                "hidden ({}) and intermediate ({}) must be multiples of 32 (the MXFP4 block)",
                self.hidden, self.intermediate
            ));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!("heads ({}) must be a multiple of kv heads ({})", self.heads, self.kv_heads));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return bad(format!(
                "top-k ({}) must be between 1 and the expert count ({})",
                self.top_k, self.experts
            ));
        }
        if self.layers == 0 || self.vocab == 0 || !self.head_dim.is_multiple_of(2) || self.window == 0 {
            return bad("layers, vocab and window must be positive and head_dim even".into());
        }
        let s = self.routing_skew;
        if !(0.0..=MAX_ROUTING_SKEW).contains(&s) {
            return bad(format!("--routing-skew {s}: must be a number from 0 to {MAX_ROUTING_SKEW}"));
        }
        if s > 0.0 {
            if self.top_k >= self.experts {
                return bad(format!(
                    "--routing-skew {s}: needs top-k ({}) below the expert count ({}); when every \
                     expert is chosen there is nothing to skew",
                    self.top_k, self.experts
                ));
            }
            match self.family {
                ModelFamily::GptOss => {}
                ModelFamily::Qwen3Moe => {
                    return bad(format!(
                        "--routing-skew {s}: not available for Qwen3-MoE, whose router has no bias to \
                         carry the skew (it would take changing other weights, e.g. a shared direction \
                         in every embedding, which this generator does not model)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The config.json of the checkpoint.
    pub fn config_json(&self) -> Value {
        match self.family {
            ModelFamily::GptOss => self.gpt_oss_config(),
            ModelFamily::Qwen3Moe => self.qwen3_moe_config(),
        }
    }

    /// Qwen3-MoE's config.json, as the released Qwen3-30B-A3B writes it (every layer MoE).
    fn qwen3_moe_config(&self) -> Value {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": self.layers,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": self.intermediate,
            "norm_topk_prob": true,
            "num_attention_heads": self.heads,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "output_router_logits": false,
            "rms_norm_eps": 1e-06,
            "rope_scaling": null,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_cache": true,
            "use_sliding_window": false,
            "vocab_size": self.vocab,
            "synthetic": { "generator": "picchio synth", "seed": self.seed }
        })
    }

    /// GPT-OSS's config.json, as the released gpt-oss-20b writes it.
    fn gpt_oss_config(&self) -> Value {
        let layer_types: Vec<&str> = (0..self.layers)
            .map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
            .collect();
        let mut cfg = json!({
            "architectures": ["GptOssForCausalLM"],
            "attention_bias": true,
            "attention_dropout": 0.0,
            "experts_per_token": self.top_k,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initial_context_length": 4096,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "layer_types": layer_types,
            "max_position_embeddings": 131072,
            "model_type": "gpt_oss",
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "num_local_experts": self.experts,
            "output_router_logits": false,
            "quantization_config": {
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head"
                ],
                "quant_method": "mxfp4"
            },
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": false
            },
            "rope_theta": 150000,
            "router_aux_loss_coef": 0.9,
            "sliding_window": self.window,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_cache": true,
            "vocab_size": self.vocab,
            "synthetic": { "generator": "picchio synth", "seed": self.seed }
        });
        if self.routing_skew > 0.0 {
            cfg["synthetic"]["routing_skew"] = json!(self.routing_skew);
        }
        if self.vocab > 200002 {
            cfg["eos_token_id"] = json!(200002);
            cfg["pad_token_id"] = json!(199999);
        }
        cfg
    }

    /// Every tensor: name, dtype, shape and how to fill it.
    fn tensors(&self) -> Vec<SynthTensor> {
        match self.family {
            ModelFamily::GptOss => self.gpt_oss_tensors(),
            ModelFamily::Qwen3Moe => self.qwen3_moe_tensors(),
        }
    }

    /// Qwen3-MoE's tensors, BF16, names from [`names`]: QK-norm weights, a router without
    /// bias, three matrices per expert, no biases anywhere.
    fn qwen3_moe_tensors(&self) -> Vec<SynthTensor> {
        let (h, i, e, d) = (self.hidden, self.intermediate, self.experts, self.head_dim);
        let q = self.heads * d;
        let kv = self.kv_heads * d;
        let inv = |n: usize| 1.0 / (n as f32).sqrt();
        let u = |std: f32| Fill::Uniform { std, mean: 0.0 };
        let norm = || Fill::Uniform { std: 0.05, mean: 1.0 };
        let mut v = vec![
            SynthTensor::bf16(names::EMBED, vec![self.vocab, h], u(1.0)),
            SynthTensor::bf16(names::FINAL_NORM, vec![h], norm()),
        ];
        for l in 0..self.layers {
            let n = names::layer(ModelFamily::Qwen3Moe, l);
            v.push(SynthTensor::bf16(&n.attn_norm, vec![h], norm()));
            v.push(SynthTensor::bf16(&n.mlp_norm, vec![h], norm()));
            for (name, rows, cols, std) in [
                (&n.q, q, h, inv(h)),
                (&n.k, kv, h, inv(h)),
                (&n.v, kv, h, inv(h)),
                (&n.o, h, q, 0.5 * inv(q)),
            ] {
                v.push(SynthTensor::bf16(&format!("{name}.weight"), vec![rows, cols], u(std)));
            }
            v.push(SynthTensor::bf16(&n.q_norm, vec![d], norm()));
            v.push(SynthTensor::bf16(&n.k_norm, vec![d], norm()));
            v.push(SynthTensor::bf16(
                &format!("{}.weight", n.router),
                vec![e, h],
                u(ROUTER_LOGIT_STD * inv(h)),
            ));
            for expert in 0..e {
                for (proj, rows, cols, std) in [
                    ("gate_proj", i, h, inv(h)),
                    ("up_proj", i, h, inv(h)),
                    ("down_proj", h, i, 0.5 * inv(i)),
                ] {
                    let name = names::separate_expert(l, expert, proj);
                    v.push(SynthTensor::bf16(&name, vec![rows, cols], u(std)));
                }
            }
        }
        v.push(SynthTensor::bf16(names::LM_HEAD, vec![self.vocab, h], u(inv(h))));
        v
    }

    /// GPT-OSS's tensors: BF16 dense weights, MXFP4 experts with BF16 biases.
    fn gpt_oss_tensors(&self) -> Vec<SynthTensor> {
        let (h, i, e) = (self.hidden, self.intermediate, self.experts);
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        let inv = |n: usize| 1.0 / (n as f32).sqrt();
        let mut v = vec![
            SynthTensor::bf16(
                "model.embed_tokens.weight",
                vec![self.vocab, h],
                Fill::Uniform { std: 1.0, mean: 0.0 },
            ),
            SynthTensor::bf16("model.norm.weight", vec![h], Fill::Uniform { std: 0.05, mean: 1.0 }),
        ];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            let u = |std: f32| Fill::Uniform { std, mean: 0.0 };
            v.push(SynthTensor::bf16(
                &format!("{p}.input_layernorm.weight"),
                vec![h],
                Fill::Uniform { std: 0.05, mean: 1.0 },
            ));
            v.push(SynthTensor::bf16(
                &format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Fill::Uniform { std: 0.05, mean: 1.0 },
            ));
            for (name, rows, cols, std) in [
                ("q_proj", q, h, inv(h)),
                ("k_proj", kv, h, inv(h)),
                ("v_proj", kv, h, inv(h)),
                ("o_proj", h, q, 0.5 * inv(q)),
            ] {
                v.push(SynthTensor::bf16(&format!("{p}.self_attn.{name}.weight"), vec![rows, cols], u(std)));
                v.push(SynthTensor::bf16(&format!("{p}.self_attn.{name}.bias"), vec![rows], u(0.02)));
            }
            v.push(SynthTensor::bf16(&format!("{p}.self_attn.sinks"), vec![self.heads], u(0.5)));
            v.push(SynthTensor::bf16(
                &format!("{p}.mlp.router.weight"),
                vec![e, h],
                u(ROUTER_LOGIT_STD * inv(h)),
            ));
            let bias = format!("{p}.mlp.router.bias");
            let fill = if self.routing_skew > 0.0 {
                Fill::UniformPlus {
                    std: 0.1,
                    add: skew_bias(e, self.top_k, self.routing_skew, self.seed, &bias),
                }
            } else {
                u(0.1)
            };
            v.push(SynthTensor::bf16(&bias, vec![e], fill));
            for (name, rows, cols, std) in
                [("gate_up_proj", 2 * i, h, inv(h)), ("down_proj", h, i, 0.5 * inv(i))]
            {
                let groups = cols / 32;
                v.push(SynthTensor {
                    name: format!("{p}.mlp.experts.{name}_blocks"),
                    dtype: "U8",
                    shape: vec![e, rows, groups, 16],
                    fill: Fill::RandomBytes,
                });
                v.push(SynthTensor {
                    name: format!("{p}.mlp.experts.{name}_scales"),
                    dtype: "U8",
                    shape: vec![e, rows, groups],
                    fill: Fill::Mxfp4Scales { std },
                });
                v.push(SynthTensor::bf16(&format!("{p}.mlp.experts.{name}_bias"), vec![e, rows], u(0.02)));
            }
        }
        v.push(SynthTensor::bf16(
            "lm_head.weight",
            vec![self.vocab, h],
            Fill::Uniform { std: inv(h), mean: 0.0 },
        ));
        v
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Debug)]
enum Fill {
    /// Uniform with this standard deviation around `mean`.
    Uniform { std: f32, mean: f32 },
    /// Uniform with this standard deviation around zero, plus `add[i]` at element `i` (the
    /// router bias with the routing skew; the random part is drawn as `Uniform` draws it).
    UniformPlus { std: f32, add: Vec<f32> },
    /// Uniform random bytes (MXFP4 codes: every E2M1 value equally likely).
    RandomBytes,
    /// E8M0 scales giving the decoded weights about this standard deviation.
    Mxfp4Scales { std: f32 },
}

struct SynthTensor {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    fill: Fill,
}

impl SynthTensor {
    fn bf16(name: &str, shape: Vec<usize>, fill: Fill) -> Self {
        SynthTensor { name: name.into(), dtype: "BF16", shape, fill }
    }

    fn bytes(&self) -> u64 {
        let n: usize = self.shape.iter().product();
        (n * if self.dtype == "BF16" { 2 } else { 1 }) as u64
    }
}

/// splitmix64: a small, fast, well-mixed deterministic generator.
struct Rng(u64);

impl Rng {
    fn for_tensor(seed: u64, name: &str) -> Self {
        let h = blake3::hash(&[seed.to_le_bytes().as_slice(), name.as_bytes()].concat());
        Rng(u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes")))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Root-mean-square of the 16 E2M1 values.
const FP4_RMS: f32 = 2.926_175;

/// Fills `out` with the next bytes of tensor `t`, which start at byte `start` of it.
fn fill(t: &SynthTensor, rng: &mut Rng, out: &mut [u8], start: usize) {
    match t.fill {
        Fill::RandomBytes => {
            for chunk in out.chunks_mut(8) {
                let r = rng.next().to_le_bytes();
                chunk.copy_from_slice(&r[..chunk.len()]);
            }
        }
        Fill::Mxfp4Scales { std } => {
            let base = (std / FP4_RMS).log2().round() as i32 + 127;
            for b in out.iter_mut() {
                // A little spread between blocks, as real checkpoints have.
                let jitter = (rng.next() % 3) as i32 - 1;
                *b = (base + jitter).clamp(1, 254) as u8;
            }
        }
        Fill::Uniform { std, mean } => fill_uniform(std, rng, out, |_, v| mean + v),
        Fill::UniformPlus { std, ref add } => {
            // Bytes from `start` of a BF16 tensor: element `start / 2 + i` at pair `i`.
            let first = start / 2;
            fill_uniform(std, rng, out, |i, v| v + add.get(first + i).copied().unwrap_or(0.0))
        }
    }
}

/// BF16 values, four per 64-bit draw: `value(i, u)` for the `i`-th value of `out` and a
/// uniform draw `u` of standard deviation `std` around zero.
fn fill_uniform(std: f32, rng: &mut Rng, out: &mut [u8], value: impl Fn(usize, f32) -> f32) {
    let a = std * 3f32.sqrt();
    for (p, pair) in out.chunks_mut(8).enumerate() {
        let r = rng.next();
        for (k, dst) in pair.chunks_mut(2).enumerate() {
            let u = ((r >> (16 * k)) & 0xffff) as f32 / 65535.0;
            let v = value(4 * p + k, (2.0 * u - 1.0) * a);
            dst.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
        }
    }
}

/// What `synth` wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    /// Shard files written.
    pub shards: usize,
    /// Total tensor bytes.
    pub bytes: u64,
}

/// Writes the checkpoint of `spec` into `out`, calling `progress(done, total)` as bytes
/// are written.
pub fn synth(spec: &SynthSpec, out: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<SynthReport> {
    spec.check()?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let tensors = spec.tensors();
    // Whole tensors per shard, in order, up to the shard size.
    let mut shards: Vec<Vec<&SynthTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in &tensors {
        if size > 0 && size + t.bytes() > spec.shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("non-empty").push(t);
        size += t.bytes();
    }
    let total: u64 = tensors.iter().map(SynthTensor::bytes).sum();
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut done = 0u64;
    for (s, shard) in shards.iter().enumerate() {
        let fname = format!("model-{:05}-of-{n:05}.safetensors", s + 1);
        let path = out.join(&fname);
        write_shard(&path, shard, spec.seed, &mut |b| {
            done += b;
            progress(done, total);
        })?;
        for t in shard {
            weight_map.insert(t.name.clone(), json!(fname));
        }
    }
    let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    write_json(&out.join("model.safetensors.index.json"), &index)?;
    write_json(&out.join("config.json"), &spec.config_json())?;
    Ok(SynthReport { shards: n, bytes: total })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("json serializes") + "\n";
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
}

fn write_shard(
    path: &Path,
    tensors: &[&SynthTensor],
    seed: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for t in tensors {
        let end = offset + t.bytes();
        header.insert(
            t.name.clone(),
            json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut text = serde_json::to_string(&Value::Object(header)).expect("header serializes");
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let io = |e| Error::io(path, e);
    w.write_all(&(text.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(text.as_bytes()).map_err(io)?;
    let mut buf = vec![0u8; 8 << 20];
    for t in tensors {
        let mut rng = Rng::for_tensor(seed, &t.name);
        let total = t.bytes() as usize;
        let mut left = total;
        while left > 0 {
            let n = left.min(buf.len());
            fill(t, &mut rng, &mut buf[..n], total - left);
            w.write_all(&buf[..n]).map_err(io)?;
            progress(n as u64);
            left -= n;
        }
    }
    w.flush().map_err(io)?;
    w.into_inner().map_err(|e| Error::io(path, e.into_error()))?.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_bias_follows_the_formula_in_a_per_layer_order() {
        let a = skew_bias(32, 4, 1.0, 0, "model.layers.0.mlp.router.bias");
        let b = skew_bias(32, 4, 1.0, 0, "model.layers.1.mlp.router.bias");
        let other_seed = skew_bias(32, 4, 1.0, 1, "model.layers.0.mlp.router.bias");
        assert!(a != b && a != other_seed, "the popularity order does not vary");
        assert_eq!(a, skew_bias(32, 4, 1.0, 0, "model.layers.0.mlp.router.bias"));
        // Same curve in every layer: the sorted values are the formula over the ranks.
        for v in [&a, &b] {
            let mut sorted = v.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            for (rank, got) in sorted.iter().enumerate() {
                let want = -skew_scale(32, 4) * (1.0 + rank as f64).ln();
                assert!((f64::from(*got) - want).abs() < 1e-5, "rank {rank}: {got} vs {want}");
            }
        }
        // 128 experts follow the same curve over the share of experts: rank 4 of 128 is
        // biased like rank 1 of 32.
        let mut wide = skew_bias(128, 4, 0.5, 0, "x");
        wide.sort_by(|x, y| y.total_cmp(x));
        let want = -0.5 * skew_scale(128, 4) * 2f64.ln();
        assert!((f64::from(wide[4]) - want).abs() < 1e-5, "{} vs {want}", wide[4]);
        assert!(skew_bias(8, 4, 0.0, 0, "x").iter().all(|&v| v == 0.0));
    }

    #[test]
    fn skew_scale_is_the_logit_spread_over_the_inverse_mills_ratio() {
        // Q(z) from its tables: Q(0) = 0.5, Q(1.959964) = 0.025.
        assert!((normal_tail(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_tail(1.959_964) - 0.025).abs() < 1e-6);
        assert!((normal_tail(-1.0) - 0.841_344_7).abs() < 1e-6);
        // The 20B (4 of 32) and 120B (4 of 128) widths.
        assert!((skew_scale(32, 4) - 1.214_456).abs() < 1e-4, "{}", skew_scale(32, 4));
        assert!((skew_scale(128, 4) - 0.888_015).abs() < 1e-4, "{}", skew_scale(128, 4));
        // Half the experts chosen: z = 0, lambda = phi(0) / 0.5.
        let half = 2.0 * 0.5 * (2.0 * std::f64::consts::PI).sqrt();
        assert!((skew_scale(16, 8) - half).abs() < 1e-4);
    }

    #[test]
    fn skewed_router_bias_adds_to_the_unskewed_draw() {
        let spec = SynthSpec { routing_skew: 1.5, ..SynthSpec::of(SynthShape::Tiny) };
        let name = "model.layers.2.mlp.router.bias";
        let find = |s: &SynthSpec| s.tensors().into_iter().find(|t| t.name == name).unwrap();
        let (plain, skewed) = (find(&SynthSpec { routing_skew: 0.0, ..spec.clone() }), find(&spec));
        let draw = |t: &SynthTensor| {
            let mut out = vec![0u8; t.bytes() as usize];
            fill(t, &mut Rng::for_tensor(spec.seed, name), &mut out, 0);
            out.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect::<Vec<_>>()
        };
        let add = skew_bias(spec.experts, spec.top_k, 1.5, spec.seed, name);
        for ((p, s), a) in draw(&plain).iter().zip(draw(&skewed)).zip(add) {
            // Each value is rounded to BF16 once, after the sum.
            assert!((p + a - s).abs() <= 0.02 * (1.0 + a.abs()), "{p} + {a} vs {s}");
        }
        assert!(spec.config_json()["synthetic"]["routing_skew"] == 1.5);
        assert!(SynthSpec::of(SynthShape::Tiny).config_json()["synthetic"].get("routing_skew").is_none());
    }
}
