//! Loading a Hugging Face checkpoint directly: dense tensors memory-mapped (F32 or BF16 kept
//! as stored), experts decoded to F32 (GPT-OSS: from MXFP4 blocks/scales, or from the
//! dequantized `[E, in, out]` layout that `save_pretrained` writes, transposed to rows =
//! outputs; Qwen3-MoE: one `gate_proj`/`up_proj`/`down_proj` matrix per expert, rows =
//! outputs, gate and up interleaved into the fused layout). Every mandatory tensor must be
//! present with the shape the config implies.
//!
//! Every weight, bias and decoded MXFP4 value must be finite: a NaN or an infinity is an
//! error naming the tensor, the position and the value (the converter uses the same
//! checks, [`check_finite_bytes`] and [`check_finite`]).
//!
//! This path decodes every expert into memory, so it suits small models and tests; large
//! models run from a converted container.

use std::path::Path;

use crate::config::{MlpKind, ModelConfig, ModelFamily};
use crate::error::{Error, Result};
use crate::format::container::layout::dense_tensors;
use crate::format::safetensors::Checkpoint;
use crate::model::names;
use crate::model::weights::{DenseWeights, ExpertWeights};
use crate::quant::Matrix;
use crate::quant::mxfp4;

/// How a checkpoint stores its experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `*_blocks` (u8 `[E, out, in/32, 16]`) and `*_scales` (u8 `[E, out, in/32]`).
    Mxfp4,
    /// Dense `gate_up_proj` `[E, hidden, 2I]` and `down_proj` `[E, I, hidden]` (inputs first).
    Dequantized,
    /// One matrix per expert and projection, rows = outputs, no biases:
    /// `experts.{e}.gate_proj.weight` / `up_proj.weight` `[I, hidden]`, `down_proj.weight`
    /// `[hidden, I]` (Qwen3-MoE), in F32, BF16 or F16.
    Separate,
}

/// The expert layout of a checkpoint of `cfg`'s family (for GPT-OSS, detected from the
/// first MoE layer); fails naming the tensors looked for.
pub fn expert_layout(ck: &Checkpoint, cfg: &ModelConfig) -> Result<ExpertLayout> {
    match cfg.family {
        ModelFamily::GptOss => {}
        ModelFamily::Qwen3Moe => return Ok(ExpertLayout::Separate),
    }
    let p = format!("{}.", names::fused_experts(0));
    if ck.contains(&format!("{p}gate_up_proj_blocks")) {
        Ok(ExpertLayout::Mxfp4)
    } else if ck.contains(&format!("{p}gate_up_proj")) {
        Ok(ExpertLayout::Dequantized)
    } else {
        Err(Error::MissingTensor {
            name: format!("{p}gate_up_proj_blocks (or {p}gate_up_proj)"),
            dir: ck.dir().to_path_buf(),
        })
    }
}

/// Checks the presence, shape and dtype of every tensor the model reads from `ck` (dense
/// tensors F32, BF16 or F16; MXFP4 blocks and scales U8 with whole blocks; dequantized
/// experts and biases with the config's shapes), before anything is decoded or written.
/// The one check of a checkpoint's tensors, used by the converter and this loader.
pub fn check_checkpoint(ck: &Checkpoint, cfg: &ModelConfig, layout: ExpertLayout) -> Result<()> {
    for (name, shape, _) in dense_tensors(cfg) {
        let t = ck.require_shape(&name, &shape)?;
        if !is_dense_dtype(t.dtype) {
            return Err(Error::tensor(&name, format!("dtype {:?}, expected F32, BF16 or F16", t.dtype)));
        }
    }
    for l in (0..cfg.num_layers).filter(|&l| cfg.mlp_kinds[l] == MlpKind::Moe) {
        match layout {
            ExpertLayout::Separate => check_separate_experts(ck, cfg, l)?,
            ExpertLayout::Mxfp4 => check_fused_experts(ck, cfg, l, true)?,
            ExpertLayout::Dequantized => check_fused_experts(ck, cfg, l, false)?,
        }
    }
    Ok(())
}

/// The dense dtypes a checkpoint may store weights in.
fn is_dense_dtype(dtype: safetensors::Dtype) -> bool {
    matches!(dtype, safetensors::Dtype::F32 | safetensors::Dtype::BF16 | safetensors::Dtype::F16)
}

/// GPT-OSS: layer `l`'s fused `gate_up_proj`/`down_proj` (MXFP4 blocks and scales when
/// `mxfp4`, else dequantized `[E, in, out]`) and their biases.
fn check_fused_experts(ck: &Checkpoint, cfg: &ModelConfig, l: usize, mxfp4: bool) -> Result<()> {
    let (h, i, e) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
    let p = names::fused_experts(l);
    for (m, rows, cols) in [("gate_up_proj", 2 * i, h), ("down_proj", h, i)] {
        if mxfp4 {
            if !cols.is_multiple_of(mxfp4::BLOCK) {
                return Err(Error::tensor(
                    format!("{p}.{m}_blocks"),
                    format!("input dimension {cols} is not a multiple of the MXFP4 block size 32"),
                ));
            }
            let g = cols / mxfp4::BLOCK;
            let shapes = [("blocks", vec![e, rows, g, mxfp4::BLOCK_BYTES]), ("scales", vec![e, rows, g])];
            for (suffix, shape) in shapes {
                let name = format!("{p}.{m}_{suffix}");
                let t = ck.require_shape(&name, &shape)?;
                if t.dtype != safetensors::Dtype::U8 {
                    return Err(Error::tensor(&name, format!("dtype {:?}, expected U8", t.dtype)));
                }
            }
        } else {
            ck.require_shape(&format!("{p}.{m}"), &[e, cols, rows])?;
        }
        ck.require_shape(&format!("{p}.{m}_bias"), &[e, rows])?;
    }
    Ok(())
}

/// Qwen3-MoE: every expert's `gate_proj`, `up_proj` and `down_proj` of layer `l`.
fn check_separate_experts(ck: &Checkpoint, cfg: &ModelConfig, l: usize) -> Result<()> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    for expert in 0..cfg.num_experts {
        for (m, rows, cols) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            let name = names::separate_expert(l, expert, m);
            let t = ck.require_shape(&name, &[rows, cols])?;
            if !is_dense_dtype(t.dtype) {
                return Err(Error::tensor(&name, format!("dtype {:?}, expected F32, BF16 or F16", t.dtype)));
            }
        }
    }
    Ok(())
}

/// Loads the dense part of a checkpoint, checking every tensor's presence, shape and
/// dtype, then that every value is finite.
pub fn load_dense(ck: &Checkpoint, cfg: &ModelConfig) -> Result<DenseWeights> {
    let w = DenseWeights::assemble(cfg, &|name, rows, cols| ck.matrix(name, rows, cols), &|name, len| {
        ck.f32_tensor(name, &[len])
    })?;
    for (name, shape, _) in dense_tensors(cfg) {
        let t = ck.require_shape(&name, &shape)?;
        let cols = shape.last().copied().unwrap_or(1);
        check_finite_bytes(&name, t.dtype, ck.bytes(t), &|i| position(shape.len(), cols, i))?;
    }
    Ok(w)
}

/// Where element `i` of a row-major tensor of `rank` dimensions (1 or 2) and `cols`
/// columns lies, in words: `row r, column c` or `element i`.
pub fn position(rank: usize, cols: usize, i: usize) -> String {
    if rank >= 2 && cols > 0 {
        format!("row {}, column {}", i / cols, i % cols)
    } else {
        format!("element {i}")
    }
}

/// The first non-finite value of little-endian F32, BF16 or F16 `bytes`: its element
/// index and value. Other dtypes hold no floats and are `None`.
pub fn first_non_finite_bytes(dtype: safetensors::Dtype, bytes: &[u8]) -> Option<(usize, f32)> {
    use safetensors::Dtype;
    match dtype {
        Dtype::F32 => {
            bytes.chunks_exact(4).position(|c| c[3] & 0x7f == 0x7f && c[2] & 0x80 == 0x80).map(|i| {
                let c = &bytes[4 * i..4 * i + 4];
                (i, f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            })
        }
        Dtype::BF16 => {
            bytes.chunks_exact(2).position(|c| c[1] & 0x7f == 0x7f && c[0] & 0x80 == 0x80).map(|i| {
                (
                    i,
                    crate::quant::reference::bf16_to_f32(u16::from_le_bytes([
                        bytes[2 * i],
                        bytes[2 * i + 1],
                    ])),
                )
            })
        }
        Dtype::F16 => bytes.chunks_exact(2).position(|c| c[1] & 0x7c == 0x7c).map(|i| {
            (i, half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32())
        }),
        _ => None,
    }
}

/// Fails if `bytes` (of `dtype`) hold a NaN or an infinity, naming `tensor`, the
/// position (`at` turns an element index into words) and the value.
pub fn check_finite_bytes(
    tensor: &str,
    dtype: safetensors::Dtype,
    bytes: &[u8],
    at: &dyn Fn(usize) -> String,
) -> Result<()> {
    match first_non_finite_bytes(dtype, bytes) {
        Some((i, v)) => Err(non_finite(tensor, &at(i), v)),
        None => Ok(()),
    }
}

/// Fails if `values` hold a NaN or an infinity, naming `tensor`, the position (`at` turns
/// an element index into words) and the value.
pub fn check_finite(tensor: &str, values: &[f32], at: &dyn Fn(usize) -> String) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(non_finite(tensor, &at(i), values[i])),
        None => Ok(()),
    }
}

/// The error for a non-finite value `v` of `tensor` at `position`.
fn non_finite(tensor: &str, position: &str, v: f32) -> Error {
    Error::tensor(tensor, format!("{position}: {v} is not finite (weights must be finite numbers)"))
}

/// Decodes one expert of one layer to F32, rows = outputs.
pub fn load_expert(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    layout: ExpertLayout,
    layer: usize,
    expert: usize,
) -> Result<ExpertWeights> {
    let (h, i, e_count) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
    let p = names::fused_experts(layer);
    let bias = |name: &str, len: usize| -> Result<Vec<f32>> {
        let name = format!("{p}.{name}");
        let b = ck.f32_range(&name, &[e_count, len], expert * len, len)?;
        check_finite(&name, &b, &|j| format!("expert {expert}, element {j}"))?;
        Ok(b)
    };
    let (gate_up, down) = match layout {
        ExpertLayout::Mxfp4 => (
            decode_mxfp4_expert(ck, &format!("{p}.gate_up_proj"), layer, e_count, expert, 2 * i, h)?,
            decode_mxfp4_expert(ck, &format!("{p}.down_proj"), layer, e_count, expert, h, i)?,
        ),
        ExpertLayout::Dequantized => (
            transpose_expert(ck, &format!("{p}.gate_up_proj"), e_count, expert, h, 2 * i)?,
            transpose_expert(ck, &format!("{p}.down_proj"), e_count, expert, i, h)?,
        ),
        ExpertLayout::Separate => return load_separate_expert(ck, cfg, layer, expert),
    };
    let w = ExpertWeights {
        gate_up: Matrix::from_f32(&format!("{p}.gate_up_proj[{expert}]"), 2 * i, h, gate_up)?,
        gate_up_bias: bias("gate_up_proj_bias", 2 * i)?,
        down: Matrix::from_f32(&format!("{p}.down_proj[{expert}]"), h, i, down)?,
        down_bias: bias("down_proj_bias", h)?,
    };
    w.check(cfg, &format!("{p}[{expert}]"))?;
    Ok(w)
}

/// One expert in the separate layout, each matrix checked finite, fused into the record
/// layout (interleaved gate/up rows, zero biases).
fn load_separate_expert(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    layer: usize,
    expert: usize,
) -> Result<ExpertWeights> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let matrix = |m: &str, rows: usize, cols: usize| -> Result<Matrix> {
        let name = names::separate_expert(layer, expert, m);
        let t = ck.require_shape(&name, &[rows, cols])?;
        check_finite_bytes(&name, t.dtype, ck.bytes(t), &|j| position(2, cols, j))?;
        ck.matrix(&name, rows, cols)
    };
    let w = ExpertWeights::from_separate(
        &format!("{}.{expert}", names::fused_experts(layer)),
        &matrix("gate_proj", i, h)?,
        &matrix("up_proj", i, h)?,
        &matrix("down_proj", h, i)?,
    )?;
    w.check(cfg, &format!("{}.{expert}", names::fused_experts(layer)))?;
    Ok(w)
}

/// Loads every expert of every layer, decoded to F32.
pub fn load_all_experts(ck: &Checkpoint, cfg: &ModelConfig) -> Result<Vec<Vec<ExpertWeights>>> {
    let layout = expert_layout(ck, cfg)?;
    (0..cfg.num_layers)
        .map(|l| match cfg.mlp_kinds[l] {
            MlpKind::Moe => (0..cfg.num_experts).map(|e| load_expert(ck, cfg, layout, l, e)).collect(),
            MlpKind::Dense => Ok(Vec::new()),
        })
        .collect()
}

/// One expert's `[rows, cols]` matrix from MXFP4 `{name}_blocks` / `{name}_scales`.
fn decode_mxfp4_expert(
    ck: &Checkpoint,
    name: &str,
    layer: usize,
    experts: usize,
    expert: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>> {
    if !cols.is_multiple_of(mxfp4::BLOCK) {
        return Err(Error::tensor(
            format!("{name}_blocks"),
            format!("input dimension {cols} is not a multiple of the MXFP4 block size 32"),
        ));
    }
    let groups = cols / mxfp4::BLOCK;
    let blocks = ck.u8_tensor(&format!("{name}_blocks"), &[experts, rows, groups, mxfp4::BLOCK_BYTES])?;
    let scales = ck.u8_tensor(&format!("{name}_scales"), &[experts, rows, groups])?;
    let block_stride = rows * groups * mxfp4::BLOCK_BYTES;
    let scale_stride = rows * groups;
    let blocks = &blocks[expert * block_stride..(expert + 1) * block_stride];
    let scales = &scales[expert * scale_stride..(expert + 1) * scale_stride];
    let mut out = vec![0.0f32; rows * cols];
    for r in 0..rows {
        mxfp4::decode_row(
            &blocks[r * groups * mxfp4::BLOCK_BYTES..(r + 1) * groups * mxfp4::BLOCK_BYTES],
            &scales[r * groups..(r + 1) * groups],
            &mut out[r * cols..(r + 1) * cols],
        )
        .map_err(|b| mxfp4_error(name, layer, expert, r, b))?;
    }
    Ok(out)
}

/// The error for an MXFP4 block of expert matrix `name` (without the `_scales` suffix)
/// that does not decode to finite values.
pub fn mxfp4_error(name: &str, layer: usize, expert: usize, row: usize, bad: mxfp4::BadBlock) -> Error {
    Error::tensor(format!("{name}_scales"), format!("layer {layer}, expert {expert}, row {row}, {bad}"))
}

/// Where element `i` of one expert's `[inputs, outputs]` slice of a dequantized expert
/// tensor lies, in words.
pub fn dequantized_position(expert: usize, outputs: usize, i: usize) -> String {
    format!("expert {expert}, input {}, output {}", i / outputs.max(1), i % outputs.max(1))
}

/// One expert of a dequantized `[E, in, out]` tensor, transposed to `[out, in]`.
fn transpose_expert(
    ck: &Checkpoint,
    name: &str,
    experts: usize,
    expert: usize,
    inputs: usize,
    outputs: usize,
) -> Result<Vec<f32>> {
    let per = inputs * outputs;
    let src = ck.f32_range(name, &[experts, inputs, outputs], expert * per, per)?;
    check_finite(name, &src, &|i| dequantized_position(expert, outputs, i))?;
    let mut out = vec![0.0f32; inputs * outputs];
    for r in 0..inputs {
        for c in 0..outputs {
            out[c * inputs + r] = src[r * outputs + c];
        }
    }
    Ok(out)
}

/// Opens a Hugging Face checkpoint directory: config and tensors.
pub fn open(dir: &Path) -> Result<(ModelConfig, Checkpoint)> {
    let cfg = ModelConfig::from_dir(dir)?;
    let ck = Checkpoint::open(dir)?;
    Ok((cfg, ck))
}
