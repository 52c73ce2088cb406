//! The layout of a container for a given model and choice of formats: which dense tensors
//! exist, how each is stored and where; how an expert record is laid out. The converter
//! writes to this layout and the reader checks a manifest against it, so both agree on
//! what a valid container for a config is.

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::format::container::manifest::{
    Component, DENSE_ALIGN, DENSE_FILE, Dtype, EXPERTS_FILE, ExpertRecord, ExpertStoreInfo, Part,
    RECORD_ALIGN, Scheme, TensorRecord, align_up,
};
use crate::quant::int4;

/// How experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ExpertFormat {
    /// INT4, groups of 64 inputs, f16 scales (default).
    Int4,
    /// F32, exact (for validation).
    F32,
}

/// How dense matrices are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DenseFormat {
    /// Attention and router at source precision (BF16 stays BF16, F32 stays F32);
    /// embedding and head INT8 per row (default).
    Auto,
    /// Attention and router BF16; embedding and head INT8 per row.
    Bf16,
    /// Everything F32, nothing quantized (for validation).
    F32,
}

/// The formats a container is converted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Formats {
    /// Expert matrices.
    pub experts: ExpertFormat,
    /// Dense matrices.
    pub dense: DenseFormat,
}

impl Default for Formats {
    fn default() -> Self {
        Formats { experts: ExpertFormat::Int4, dense: DenseFormat::Auto }
    }
}

/// What kind of tensor a dense entry is, which decides its storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// Embedding or output head: INT8 per row unless everything is F32.
    Vocab,
    /// Attention projection or router weight: source precision, BF16 or F32.
    Matrix,
    /// Norm weight, bias or sink: always F32 (small, and exact from BF16).
    Vector,
}

/// Every dense tensor the model needs: name, shape, role. Order is the file order.
pub fn dense_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, TensorRole)> {
    let h = cfg.hidden_size;
    let mut v = vec![
        ("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h], TensorRole::Vocab),
        ("lm_head.weight".to_string(), vec![cfg.vocab_size, h], TensorRole::Vocab),
        ("model.norm.weight".to_string(), vec![h], TensorRole::Vector),
    ];
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        let attn = [
            ("q_proj", cfg.q_dim(), h),
            ("k_proj", cfg.kv_dim(), h),
            ("v_proj", cfg.kv_dim(), h),
            ("o_proj", h, cfg.q_dim()),
        ];
        v.push((format!("{p}.input_layernorm.weight"), vec![h], TensorRole::Vector));
        for (name, rows, cols) in attn {
            v.push((format!("{p}.self_attn.{name}.weight"), vec![rows, cols], TensorRole::Matrix));
            v.push((format!("{p}.self_attn.{name}.bias"), vec![rows], TensorRole::Vector));
        }
        v.push((format!("{p}.self_attn.sinks"), vec![cfg.num_heads], TensorRole::Vector));
        v.push((format!("{p}.post_attention_layernorm.weight"), vec![h], TensorRole::Vector));
        v.push((format!("{p}.mlp.router.weight"), vec![cfg.num_experts, h], TensorRole::Matrix));
        v.push((format!("{p}.mlp.router.bias"), vec![cfg.num_experts], TensorRole::Vector));
    }
    v
}

/// Scheme and part dtypes for a dense tensor, given its role, the chosen formats and
/// whether the source stores it as BF16.
pub fn dense_storage(
    role: TensorRole,
    formats: Formats,
    source_is_bf16: bool,
) -> (Scheme, Vec<(&'static str, Dtype)>) {
    match (role, formats.dense) {
        (TensorRole::Vector, _) | (_, DenseFormat::F32) => (Scheme::None, vec![("data", Dtype::F32)]),
        (TensorRole::Vocab, _) => (Scheme::Int8Row, vec![("codes", Dtype::I8), ("scales", Dtype::F32)]),
        (TensorRole::Matrix, DenseFormat::Bf16) => (Scheme::None, vec![("data", Dtype::Bf16)]),
        (TensorRole::Matrix, DenseFormat::Auto) => {
            (Scheme::None, vec![("data", if source_is_bf16 { Dtype::Bf16 } else { Dtype::F32 })])
        }
    }
}

/// Byte count of one part of a tensor of `shape` stored as `scheme`.
pub fn part_bytes(shape: &[usize], scheme: Scheme, role: &str, dtype: Dtype) -> u64 {
    let rows = if shape.len() == 2 { shape[0] } else { 1 } as u64;
    let cols = *shape.last().unwrap_or(&1) as u64;
    match (scheme, role) {
        (Scheme::None, _) => rows * cols * dtype.size(),
        (Scheme::Int8Row, "codes") => rows * cols,
        (Scheme::Int8Row, _) => rows * 4,
        (Scheme::Int4Gs64, "codes") => rows * int4::row_bytes(cols as usize) as u64,
        (Scheme::Int4Gs64, _) => rows * int4::groups(cols as usize) as u64 * 2,
    }
}

/// Lays out the dense tensors in `dense.bin` (each part 256-byte aligned). `is_bf16`
/// tells whether the source stores a tensor as BF16. Hashes are left empty.
pub fn plan_dense(
    cfg: &ModelConfig,
    formats: Formats,
    is_bf16: impl Fn(&str) -> bool,
) -> (Vec<TensorRecord>, u64) {
    let mut offset = 0u64;
    let mut out = Vec::new();
    for (name, shape, role) in dense_tensors(cfg) {
        let (scheme, parts) = dense_storage(role, formats, is_bf16(&name));
        let parts = parts
            .into_iter()
            .map(|(r, dtype)| {
                let bytes = part_bytes(&shape, scheme, r, dtype);
                let p = Part {
                    role: r.into(),
                    dtype,
                    file: DENSE_FILE.into(),
                    offset,
                    bytes,
                    hash: String::new(),
                };
                offset = align_up(offset + bytes, DENSE_ALIGN);
                p
            })
            .collect();
        let group_size = (scheme == Scheme::Int4Gs64).then_some(int4::GROUP);
        out.push(TensorRecord { name, shape, scheme, group_size, parts });
    }
    (out, offset)
}

/// Lays out expert records in `experts.bin`. Hashes are left empty.
pub fn plan_experts(cfg: &ModelConfig, format: ExpertFormat) -> (ExpertStoreInfo, u64) {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let mats = [("gate_up", 2 * i, h), ("down", h, i)];
    let mut components = Vec::new();
    let mut offset = 0u64;
    let mut push = |name: String, dtype: Dtype, shape: Vec<usize>, bytes: u64| {
        components.push(Component { name, dtype, shape, offset, bytes });
        offset = align_up(offset + bytes, 64);
    };
    let scheme = match format {
        ExpertFormat::Int4 => Scheme::Int4Gs64,
        ExpertFormat::F32 => Scheme::None,
    };
    for (m, rows, cols) in mats {
        match format {
            ExpertFormat::Int4 => {
                let rb = int4::row_bytes(cols);
                let g = int4::groups(cols);
                push(format!("{m}.codes"), Dtype::U8, vec![rows, rb], (rows * rb) as u64);
                push(format!("{m}.scales"), Dtype::F16, vec![rows, g], (rows * g * 2) as u64);
            }
            ExpertFormat::F32 => {
                push(format!("{m}.data"), Dtype::F32, vec![rows, cols], (rows * cols * 4) as u64)
            }
        }
        push(format!("{m}.bias"), Dtype::F32, vec![rows], (rows * 4) as u64);
    }
    let payload = components.last().map_or(0, |c| c.offset + c.bytes);
    let stride = align_up(payload, RECORD_ALIGN);
    let records: Vec<ExpertRecord> = (0..cfg.num_layers)
        .flat_map(|layer| (0..cfg.num_experts).map(move |expert| (layer, expert)))
        .enumerate()
        .map(|(n, (layer, expert))| ExpertRecord {
            layer,
            expert,
            offset: n as u64 * stride,
            bytes: payload,
            hash: String::new(),
        })
        .collect();
    let total = records.len() as u64 * stride;
    let group_size = (scheme == Scheme::Int4Gs64).then_some(int4::GROUP);
    (
        ExpertStoreInfo {
            file: EXPERTS_FILE.into(),
            scheme,
            group_size,
            record_stride: stride,
            payload_bytes: payload,
            components,
            records,
        },
        total,
    )
}
