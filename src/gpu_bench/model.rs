//! A random model of GPT-OSS-20B's shapes built in memory for the kernel benchmark:
//! the real widths, any number of layers, every layer full attention (a sliding layer
//! would read only its window), dense matrices in one format and experts in another.
//! Values are random codes drawn directly in each format (no quantization pass), scaled
//! so that products stay finite; their numbers do not matter, only their bytes.

use std::sync::Arc;

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::engine::LoadedModel;
use crate::error::{Error, Result};
use crate::experts::ResidentExperts;
use crate::model::weights::{
    AttentionWeights, DenseWeights, ExpertWeights, FeedForward, LayerWeights, Linear,
};
use crate::quant::{Matrix, MatrixData, WeightBuf, int4, mxfp4};

/// A weight format the benchmark builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Format {
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
    /// INT8 codes with an f32 scale per row.
    Int8,
    /// INT4 codes in groups of 64 with f16 scales.
    Int4,
    /// MXFP4 as released (E2M1 codes, E8M0 scale per 32).
    Mxfp4,
}

impl Format {
    /// The format's name as the container's manifest writes it.
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::Int8 => "int8-row",
            Format::Int4 => "int4-gs64",
            Format::Mxfp4 => "mxfp4",
        }
    }
}

/// The model's dimensions (GPT-OSS-20B's by default).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Shape {
    /// Hidden width.
    pub hidden: usize,
    /// Expert intermediate width.
    pub intermediate: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Vocabulary (rows of the head).
    pub vocab: usize,
    /// Layers.
    pub layers: usize,
}

impl Shape {
    /// GPT-OSS-20B's widths with `layers` layers.
    pub fn gpt_oss_20b(layers: usize) -> Self {
        Shape {
            hidden: 2880,
            intermediate: 2880,
            heads: 64,
            kv_heads: 8,
            head_dim: 64,
            experts: 32,
            top_k: 4,
            vocab: 201088,
            layers,
        }
    }

    /// A small shape for a quick check of the path (not the real widths).
    pub fn quick(layers: usize) -> Self {
        Shape {
            hidden: 576,
            intermediate: 576,
            heads: 16,
            kv_heads: 4,
            head_dim: 64,
            experts: 8,
            top_k: 4,
            vocab: 8192,
            layers,
        }
    }

    /// The configuration of this shape (GPT-OSS recipe, every layer full attention).
    pub fn config(&self) -> Result<ModelConfig> {
        let types = vec!["\"full_attention\""; self.layers].join(", ");
        let json = format!(
            r#"{{
            "model_type": "gpt_oss", "hidden_size": {}, "intermediate_size": {},
            "num_hidden_layers": {}, "num_attention_heads": {}, "num_key_value_heads": {},
            "head_dim": {}, "num_local_experts": {}, "num_experts_per_tok": {}, "vocab_size": {},
            "layer_types": [{types}], "sliding_window": 128, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "swiglu_limit": 7.0,
            "rope_scaling": {{"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096, "truncate": false}}
        }}"#,
            self.hidden,
            self.intermediate,
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.experts,
            self.top_k,
            self.vocab
        );
        ModelConfig::from_json_str(&json, std::path::Path::new("bench-gpu.json"))
    }
}

/// Fills `out` with pseudo-random bytes (xorshift64 per 64 KiB chunk, in parallel).
fn random_bytes(out: &mut [u8], seed: u64) {
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(i, chunk)| {
        let mut s =
            (seed ^ 0x9e37_79b9_7f4a_7c15).wrapping_add((i as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
        for word in chunk.chunks_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let b = s.to_le_bytes();
            word.copy_from_slice(&b[..word.len()]);
        }
    });
}

/// `n` random values of magnitude up to about `2^-4`, as f32 bit patterns with a random
/// sign and mantissa and an exponent in 2^-12..2^-5.
fn small_floats(n: usize, seed: u64) -> Vec<f32> {
    let mut bytes = vec![0u8; n * 4];
    random_bytes(&mut bytes, seed);
    bytes
        .par_chunks(4)
        .map(|c| {
            let r = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let exponent = 115 + (r >> 23) % 8;
            f32::from_bits((r & 0x8000_0000) | (exponent << 23) | (r & 0x007f_ffff))
        })
        .collect()
}

/// A random `rows x cols` matrix in `fmt`.
pub fn random_matrix(rows: usize, cols: usize, fmt: Format, seed: u64) -> Result<Matrix> {
    let bytes = |n: usize, seed: u64| {
        let mut v = vec![0u8; n];
        random_bytes(&mut v, seed);
        v
    };
    let data = match fmt {
        Format::F32 => MatrixData::F32(WeightBuf::owned(small_floats(rows * cols, seed))),
        Format::Bf16 => MatrixData::Bf16(WeightBuf::owned(
            small_floats(rows * cols, seed).into_par_iter().map(|v| (v.to_bits() >> 16) as u16).collect(),
        )),
        Format::Int8 => MatrixData::Int8Rows {
            codes: WeightBuf::owned(bytes(rows * cols, seed).into_iter().map(|b| b as i8).collect()),
            scales: WeightBuf::owned(vec![1.0 / 4096.0; rows]),
        },
        Format::Int4 => MatrixData::Int4G64 {
            codes: WeightBuf::owned(bytes(rows * int4::row_bytes(cols), seed)),
            // f16 1/1024.
            scales: WeightBuf::owned(vec![0x1400; rows * int4::groups(cols)]),
        },
        Format::Mxfp4 => MatrixData::Mxfp4 {
            codes: WeightBuf::owned(bytes(rows * mxfp4::row_bytes(cols), seed)),
            // 2^-8 .. 2^-5.
            scales: WeightBuf::owned(
                bytes(rows * mxfp4::blocks(cols), seed ^ 1).into_iter().map(|b| 119 + b % 4).collect(),
            ),
        },
    };
    Matrix::new("bench-gpu random", rows, cols, data)
}

/// A random model of `shape`: attention, routers and head in `dense`, experts in `experts`
/// (INT4-gs64, MXFP4 or F32), all in memory.
pub fn random_model(shape: &Shape, dense: Format, experts: Format) -> Result<LoadedModel> {
    if dense == Format::Mxfp4 {
        return Err(Error::invalid("dense MXFP4 matrices have no GPU kernel"));
    }
    let cfg = shape.config()?;
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let mut seed = 1u64;
    let mut next = || {
        seed += 1;
        seed
    };
    let bias = |n: usize, s: u64| small_floats(n, s);
    let lin = |rows: usize, cols: usize, s: u64| -> Result<Linear> {
        Ok(Linear { weight: random_matrix(rows, cols, dense, s)?, bias: Some(bias(rows, s ^ 7)) })
    };
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for _ in 0..cfg.num_layers {
        layers.push(LayerWeights {
            attn_norm: vec![1.0; h],
            attn: AttentionWeights {
                q: lin(cfg.q_dim(), h, next())?,
                k: lin(cfg.kv_dim(), h, next())?,
                v: lin(cfg.kv_dim(), h, next())?,
                o: lin(h, cfg.q_dim(), next())?,
                sinks: Some(vec![0.5; cfg.num_heads]),
                q_norm: None,
                k_norm: None,
            },
            mlp_norm: vec![1.0; h],
            ffn: FeedForward::Moe { router: lin(cfg.num_experts, h, next())? },
        });
    }
    let head = random_matrix(cfg.vocab_size, h, dense, next())?;
    // The embedding shares the head's buffer (the GPU never reads it).
    let dense_w = DenseWeights { embed: head.clone(), layers, final_norm: vec![1.0; h], lm_head: head };
    dense_w.check(&cfg)?;
    let mut expert_layers = Vec::with_capacity(cfg.num_layers);
    for _ in 0..cfg.num_layers {
        let mut layer = Vec::with_capacity(cfg.num_experts);
        for _ in 0..cfg.num_experts {
            layer.push(ExpertWeights {
                gate_up: random_matrix(2 * i, h, experts, next())?,
                gate_up_bias: bias(2 * i, next()),
                down: random_matrix(h, i, experts, next())?,
                down_bias: bias(h, next()),
            });
        }
        expert_layers.push(layer);
    }
    Ok(LoadedModel {
        config: Arc::new(cfg),
        dense: Arc::new(dense_w),
        experts: Arc::new(ResidentExperts::new(expert_layers)),
        dir: std::path::PathBuf::from("bench-gpu (random, in memory)"),
        cpu_dense: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quick_model_has_its_shape_and_finite_weights() {
        let shape = Shape::quick(2);
        let m = random_model(&shape, Format::Bf16, Format::Mxfp4).unwrap();
        assert_eq!((m.config.hidden_size, m.config.num_layers, m.config.vocab_size), (576, 2, 8192));
        assert_eq!((m.config.window(0), m.config.window(1)), (None, None), "every layer full attention");
        let mut row = vec![0.0; 576];
        m.dense.lm_head.row_to_f32(5, &mut row);
        assert!(row.iter().all(|v| v.is_finite() && v.abs() < 1.0), "{:?}", &row[..4]);
        let q = &m.dense.layers[1].attn.q.weight;
        assert_eq!((q.rows, q.cols, q.byte_len()), (1024, 576, 1024 * 576 * 2));
        for fmt in [Format::F32, Format::Int8, Format::Int4, Format::Mxfp4] {
            let mx = random_matrix(8, 128, fmt, 3).unwrap();
            let mut r = vec![0.0; 128];
            mx.row_to_f32(7, &mut r);
            assert!(r.iter().all(|v| v.is_finite()) && r.iter().any(|&v| v != 0.0), "{fmt:?}");
        }
    }
}
