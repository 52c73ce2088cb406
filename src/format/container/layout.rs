//! The layout of a container for a given model and choice of formats: which dense tensors
//! exist, how each is stored and where; how an expert record is laid out. The converter
//! writes to this layout and the reader checks a manifest against it, so both agree on
//! what a valid container for a config is.

use serde::{Deserialize, Serialize};

use crate::config::{MlpKind, ModelConfig};
use crate::format::container::manifest::{
    Component, DENSE_ALIGN, DENSE_FILE, Dtype, EXPERTS_FILE, ExpertRecord, ExpertStoreInfo, Part,
    RECORD_ALIGN, TensorRecord, align_up,
};
use crate::model::names;
use crate::quant::format::WeightFormat;

/// How experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ExpertFormat {
    /// MXFP4 for an MXFP4 source (kept as released), INT4 for any other (default). A
    /// conversion resolves it: a manifest never records `auto`.
    Auto,
    /// MXFP4 as released, blocks and scales copied byte for byte (lossless; MXFP4 sources
    /// only).
    Mxfp4,
    /// INT4, groups of 64 inputs, f16 scales (for BF16/F32 sources; lossy from MXFP4).
    Int4,
    /// F32, exact (for validation).
    F32,
}

impl ExpertFormat {
    /// The stored format, or `None` for [`ExpertFormat::Auto`] (not yet resolved).
    pub fn weight_format(self) -> Option<WeightFormat> {
        match self {
            ExpertFormat::Auto => None,
            ExpertFormat::Mxfp4 => Some(WeightFormat::Mxfp4),
            ExpertFormat::Int4 => Some(WeightFormat::Int4Gs64),
            ExpertFormat::F32 => Some(WeightFormat::F32),
        }
    }
}

/// How dense matrices are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DenseFormat {
    /// Attention and router at source precision (BF16 stays BF16, F32 stays F32);
    /// embedding and head INT8 per row (default).
    Auto,
    /// Every matrix, embedding and head included, at source precision (BF16 stays BF16,
    /// F32 stays F32, F16 widens exactly to F32): nothing quantized, nothing rounded.
    Source,
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
        Formats { experts: ExpertFormat::Auto, dense: DenseFormat::Auto }
    }
}

impl Formats {
    /// The formats with `auto` experts resolved for a source whose experts are MXFP4
    /// (`source_mxfp4`) or not; MXFP4 asked of a source that has no MXFP4 experts is an
    /// error (there are no blocks to keep, and re-encoding to MXFP4 would be lossy).
    pub fn resolve(self, source_mxfp4: bool) -> std::result::Result<Formats, String> {
        let experts = match (self.experts, source_mxfp4) {
            (ExpertFormat::Auto, true) => ExpertFormat::Mxfp4,
            (ExpertFormat::Auto, false) => ExpertFormat::Int4,
            (ExpertFormat::Mxfp4, false) => {
                return Err("--experts mxfp4 keeps MXFP4 experts as released, but this checkpoint's \
                     experts are not MXFP4 (they are stored dequantized); use --experts int4 or f32"
                    .into());
            }
            (e @ (ExpertFormat::Mxfp4 | ExpertFormat::Int4 | ExpertFormat::F32), _) => e,
        };
        Ok(Formats { experts, dense: self.dense })
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

/// Every dense tensor the model needs: name, shape, role. Order is the file order. The
/// family's recipe decides which exist (biases, sinks, QK-norm, a router or a dense MLP per
/// layer, a separate head).
pub fn dense_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, TensorRole)> {
    let h = cfg.hidden_size;
    let r = cfg.recipe;
    let mut v = vec![(names::EMBED.to_string(), vec![cfg.vocab_size, h], TensorRole::Vocab)];
    if !cfg.tie_word_embeddings {
        v.push((names::LM_HEAD.to_string(), vec![cfg.vocab_size, h], TensorRole::Vocab));
    }
    v.push((names::FINAL_NORM.to_string(), vec![h], TensorRole::Vector));
    for l in 0..cfg.num_layers {
        let n = names::layer(cfg.family, l);
        let attn = [
            (&n.q, cfg.q_dim(), h),
            (&n.k, cfg.kv_dim(), h),
            (&n.v, cfg.kv_dim(), h),
            (&n.o, h, cfg.q_dim()),
        ];
        v.push((n.attn_norm.clone(), vec![h], TensorRole::Vector));
        for (name, rows, cols) in attn {
            v.push((format!("{name}.weight"), vec![rows, cols], TensorRole::Matrix));
            if r.attention_bias {
                v.push((format!("{name}.bias"), vec![rows], TensorRole::Vector));
            }
        }
        if r.qk_norm {
            v.push((n.q_norm.clone(), vec![cfg.head_dim], TensorRole::Vector));
            v.push((n.k_norm.clone(), vec![cfg.head_dim], TensorRole::Vector));
        }
        if r.attention_sinks {
            v.push((n.sinks.clone(), vec![cfg.num_heads], TensorRole::Vector));
        }
        v.push((n.mlp_norm.clone(), vec![h], TensorRole::Vector));
        match cfg.mlp_kinds[l] {
            MlpKind::Moe => {
                v.push((format!("{}.weight", n.router), vec![cfg.num_experts, h], TensorRole::Matrix));
                if r.router_bias {
                    v.push((format!("{}.bias", n.router), vec![cfg.num_experts], TensorRole::Vector));
                }
            }
            MlpKind::Dense => {
                let i = cfg.dense_intermediate_size;
                v.push((n.dense_gate.clone(), vec![i, h], TensorRole::Matrix));
                v.push((n.dense_up.clone(), vec![i, h], TensorRole::Matrix));
                v.push((n.dense_down.clone(), vec![h, i], TensorRole::Matrix));
            }
        }
    }
    v
}

/// The stored format of a dense tensor, given its role, the chosen formats and whether
/// the source stores it as BF16 (anything else is kept or widened as F32).
pub fn dense_storage(role: TensorRole, formats: Formats, source_is_bf16: bool) -> WeightFormat {
    let source = if source_is_bf16 { WeightFormat::Bf16 } else { WeightFormat::F32 };
    match (role, formats.dense) {
        (TensorRole::Vector, _) | (_, DenseFormat::F32) => WeightFormat::F32,
        (TensorRole::Vocab | TensorRole::Matrix, DenseFormat::Source) => source,
        (TensorRole::Vocab, DenseFormat::Auto | DenseFormat::Bf16) => WeightFormat::Int8Row,
        (TensorRole::Matrix, DenseFormat::Bf16) => WeightFormat::Bf16,
        (TensorRole::Matrix, DenseFormat::Auto) => source,
    }
}

/// Rows and columns of a tensor of `shape` (a vector is one row).
pub fn rows_cols(shape: &[usize]) -> Option<(usize, usize)> {
    match shape {
        [r, c] => Some((*r, *c)),
        [n] => Some((1, *n)),
        _ => None,
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
        let format = dense_storage(role, formats, is_bf16(&name));
        let (rows, cols) = rows_cols(&shape).expect("the model's tensors are vectors or matrices");
        let parts = format
            .parts()
            .iter()
            .map(|info| {
                let bytes = format.part_bytes(info.role, rows, cols).expect("the config's sizes are checked");
                let p = Part {
                    role: info.role.into(),
                    dtype: info.dtype,
                    file: DENSE_FILE.into(),
                    offset,
                    bytes,
                    hash: String::new(),
                };
                offset = align_up(offset + bytes, DENSE_ALIGN);
                p
            })
            .collect();
        out.push(TensorRecord {
            name,
            shape,
            scheme: format.scheme(),
            group_size: format.group_size(),
            parts,
        });
    }
    (out, offset)
}

/// Lays out expert records in `experts.bin` for expert storage `format`, one per expert of
/// each MoE layer (dense layers have none; see [`ModelConfig::expert_record`]): per matrix
/// (`gate_up`, then `down`) the format's parts (`gate_up.codes`, `gate_up.scales`, or
/// `gate_up.data`), then its `bias`, each 64-byte aligned; the record padded to 4 KiB.
/// Hashes are left empty.
pub fn plan_experts(cfg: &ModelConfig, format: WeightFormat) -> (ExpertStoreInfo, u64) {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let mats = [("gate_up", 2 * i, h), ("down", h, i)];
    let mut components = Vec::new();
    let mut offset = 0u64;
    let mut push = |name: String, dtype: Dtype, shape: Vec<usize>, bytes: u64| {
        components.push(Component { name, dtype, shape, offset, bytes });
        offset = align_up(offset + bytes, 64);
    };
    for (m, rows, cols) in mats {
        for p in format.parts() {
            let row = format.part_row_bytes(p.role, cols).expect("the config's sizes are checked");
            let shape = vec![rows, row / p.dtype.size() as usize];
            push(format!("{m}.{}", p.role), p.dtype, shape, (rows * row) as u64);
        }
        push(format!("{m}.bias"), Dtype::F32, vec![rows], (rows * 4) as u64);
    }
    let payload = components.last().map_or(0, |c| c.offset + c.bytes);
    let stride = align_up(payload, RECORD_ALIGN);
    let records: Vec<ExpertRecord> = cfg
        .moe_layers()
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
    (
        ExpertStoreInfo {
            file: EXPERTS_FILE.into(),
            scheme: format.scheme(),
            group_size: format.group_size(),
            record_stride: stride,
            payload_bytes: payload,
            components,
            records,
        },
        total,
    )
}
