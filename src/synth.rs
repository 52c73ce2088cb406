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
        let norm = Fill::Uniform { std: 0.05, mean: 1.0 };
        let mut v = vec![
            SynthTensor::bf16(names::EMBED, vec![self.vocab, h], u(1.0)),
            SynthTensor::bf16(names::FINAL_NORM, vec![h], norm),
        ];
        for l in 0..self.layers {
            let n = names::layer(ModelFamily::Qwen3Moe, l);
            v.push(SynthTensor::bf16(&n.attn_norm, vec![h], norm));
            v.push(SynthTensor::bf16(&n.mlp_norm, vec![h], norm));
            for (name, rows, cols, std) in [
                (&n.q, q, h, inv(h)),
                (&n.k, kv, h, inv(h)),
                (&n.v, kv, h, inv(h)),
                (&n.o, h, q, 0.5 * inv(q)),
            ] {
                v.push(SynthTensor::bf16(&format!("{name}.weight"), vec![rows, cols], u(std)));
            }
            v.push(SynthTensor::bf16(&n.q_norm, vec![d], norm));
            v.push(SynthTensor::bf16(&n.k_norm, vec![d], norm));
            v.push(SynthTensor::bf16(&format!("{}.weight", n.router), vec![e, h], u(2.0 * inv(h))));
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
            v.push(SynthTensor::bf16(&format!("{p}.mlp.router.weight"), vec![e, h], u(2.0 * inv(h))));
            v.push(SynthTensor::bf16(&format!("{p}.mlp.router.bias"), vec![e], u(0.1)));
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
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// Uniform with this standard deviation around `mean`.
    Uniform { std: f32, mean: f32 },
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

/// Fills `out` with the next bytes of tensor `t`.
fn fill(t: &SynthTensor, rng: &mut Rng, out: &mut [u8]) {
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
        Fill::Uniform { std, mean } => {
            let a = std * 3f32.sqrt();
            for pair in out.chunks_mut(8) {
                let r = rng.next();
                for (k, dst) in pair.chunks_mut(2).enumerate() {
                    let u = ((r >> (16 * k)) & 0xffff) as f32 / 65535.0;
                    let v = mean + (2.0 * u - 1.0) * a;
                    dst.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                }
            }
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
        let mut left = t.bytes() as usize;
        while left > 0 {
            let n = left.min(buf.len());
            fill(t, &mut rng, &mut buf[..n]);
            w.write_all(&buf[..n]).map_err(io)?;
            progress(n as u64);
            left -= n;
        }
    }
    w.flush().map_err(io)?;
    w.into_inner().map_err(|e| Error::io(path, e.into_error()))?.sync_all().map_err(io)
}
