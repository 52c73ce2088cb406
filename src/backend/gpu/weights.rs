//! Dense weights in VRAM, uploaded once in their container format (F32, BF16 pairs,
//! INT8 codes with row scales, INT4 codes with f16 group scales: nothing is expanded to
//! f32). A matrix larger than one storage binding is split by rows into blocks, each its
//! own buffer(s) within the binding limit; a product dispatches once per block.
//!
//! Alignment by construction: every row of values or codes is stored padded with zeros to
//! a whole number of 16-byte chunks ([`CHUNK_BYTES`], `GpuMatrix::row_chunks`), so the
//! matrix-vector kernels read rows as `array<vec4<...>>` with aligned 16-byte loads. F32
//! rows of a multiple of 4 columns, BF16 of 8, INT8 of 16 and every INT4-gs64 row (32-byte
//! groups) need no padding and are uploaded as stored; others are copied padded. Scales
//! are not padded (INT8: one f32 per row; INT4: `groups` f16 per row).

use crate::error::{Error, Result};
use crate::quant::{Matrix, MatrixData, int4};

use super::context::{GBuf, Gpu};
use super::shaders::Op;

/// Bytes of one aligned load of the matrix-vector kernels: rows are padded to a multiple.
pub const CHUNK_BYTES: usize = 16;

/// One row block of a matrix.
pub struct MatrixBlock {
    /// First row of the block in the whole matrix.
    pub row0: usize,
    /// Rows in the block.
    pub rows: usize,
    /// Values or codes.
    pub data: GBuf,
    /// Scales (INT8: f32 per row; INT4: f16 per group), if the format has them.
    pub scales: Option<GBuf>,
}

/// A weight matrix on the device.
pub struct GpuMatrix {
    /// Output dimension.
    pub rows: usize,
    /// Input dimension.
    pub cols: usize,
    /// The kernel for its format.
    pub op: Op,
    /// 16-byte chunks per stored (padded) row of values or codes.
    pub row_chunks: usize,
    /// Row blocks, in order.
    pub blocks: Vec<MatrixBlock>,
}

impl GpuMatrix {
    /// Bytes on the device.
    pub fn byte_len(&self) -> u64 {
        self.blocks.iter().map(|b| b.data.size + b.scales.as_ref().map_or(0, |s| s.size)).sum()
    }
}

fn as_bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Uploads `m`, split into row blocks whose every buffer fits one binding.
pub fn upload_matrix(gpu: &mut Gpu, name: &str, m: &Matrix) -> Result<GpuMatrix> {
    let (op, data_row, scale_row): (Op, usize, usize) = match &m.data {
        MatrixData::F32(_) => (Op::MatvecF32, 4 * m.cols, 0),
        MatrixData::Bf16(_) => (Op::MatvecBf16, 2 * m.cols, 0),
        MatrixData::Int8Rows { .. } => (Op::MatvecInt8, m.cols, 4),
        MatrixData::Int4G64 { .. } => (Op::MatvecInt4, int4::row_bytes(m.cols), 2 * int4::groups(m.cols)),
        MatrixData::Mxfp4 { .. } => {
            return Err(Error::Backend(format!("{name}: MXFP4 matrices have no GPU kernel yet")));
        }
    };
    if m.cols == 0 {
        return Err(Error::Backend(format!("{name}: a matrix with no columns")));
    }
    // Rows padded to whole chunks; rows per block: every buffer (padded to whole words)
    // within the binding limit.
    let padded_row = data_row.next_multiple_of(CHUNK_BYTES).max(CHUNK_BYTES);
    let limit = gpu.max_binding as usize;
    let room = limit.saturating_sub(4);
    let per_block = (room / padded_row).min(room.checked_div(scale_row).unwrap_or(usize::MAX));
    if per_block == 0 {
        return Err(Error::Backend(format!(
            "{name}: one row ({data_row} bytes) exceeds the storage binding limit of {limit} bytes"
        )));
    }
    let mut blocks = Vec::new();
    let mut row0 = 0;
    while row0 < m.rows {
        let rows = per_block.min(m.rows - row0);
        let label = format!("{name}[{row0}..{}]", row0 + rows);
        let (d, s): (&[u8], Option<&[u8]>) = match &m.data {
            MatrixData::F32(b) => (as_bytes(b.as_slice()), None),
            MatrixData::Bf16(b) => (as_bytes(b.as_slice()), None),
            MatrixData::Int8Rows { codes, scales } => {
                (as_bytes(codes.as_slice()), Some(as_bytes(scales.as_slice())))
            }
            MatrixData::Int4G64 { codes, scales } => {
                (as_bytes(codes.as_slice()), Some(as_bytes(scales.as_slice())))
            }
            MatrixData::Mxfp4 { codes, scales } => (codes.as_slice(), Some(scales.as_slice())),
        };
        let stored = &d[row0 * data_row..(row0 + rows) * data_row];
        let data = if padded_row == data_row {
            gpu.buffer_init(&label, stored)?
        } else {
            let mut padded = vec![0u8; rows * padded_row];
            for (dst, src) in padded.chunks_exact_mut(padded_row).zip(stored.chunks_exact(data_row)) {
                dst[..data_row].copy_from_slice(src);
            }
            gpu.buffer_init(&label, &padded)?
        };
        let scales = match s {
            Some(s) => Some(
                gpu.buffer_init(&format!("{label} scales"), &s[row0 * scale_row..(row0 + rows) * scale_row])?,
            ),
            None => None,
        };
        blocks.push(MatrixBlock { row0, rows, data, scales });
        row0 += rows;
    }
    Ok(GpuMatrix { rows: m.rows, cols: m.cols, op, row_chunks: padded_row / CHUNK_BYTES, blocks })
}

/// Uploads an f32 vector (norm weight, bias, sinks).
pub fn upload_vector(gpu: &mut Gpu, name: &str, v: &[f32]) -> Result<GBuf> {
    gpu.buffer_init(name, as_bytes(v))
}
