//! Weight formats and the matrix-vector products over them.
//!
//! A [`Matrix`] is `rows x cols`, row-major, one row per output: `y = W x` takes `cols`
//! inputs to `rows` outputs. Each format has a scalar reference kernel in [`reference`];
//! faster kernels are added beside it and tested against it.

pub mod buffer;
pub mod reference;

use rayon::prelude::*;

pub use buffer::WeightBuf;

use crate::error::{Error, Result};

/// How a matrix's elements are stored.
#[derive(Clone, Debug)]
pub enum MatrixData {
    /// 32-bit floats.
    F32(WeightBuf<f32>),
    /// bfloat16 (the upper half of an f32), widened exactly to f32 before use.
    Bf16(WeightBuf<u16>),
}

/// A weight matrix: `rows` outputs by `cols` inputs, row-major.
#[derive(Clone, Debug)]
pub struct Matrix {
    /// Output dimension.
    pub rows: usize,
    /// Input (contraction) dimension.
    pub cols: usize,
    /// The elements.
    pub data: MatrixData,
}

/// Below this many multiply-adds a product runs on the calling thread: splitting it across
/// the pool would cost more than it saves.
const PARALLEL_MIN_WORK: usize = 1 << 15;

impl Matrix {
    /// Builds a matrix, checking that `data` holds exactly `rows * cols` elements.
    pub fn new(name: &str, rows: usize, cols: usize, data: MatrixData) -> Result<Self> {
        let len = match &data {
            MatrixData::F32(b) => b.len(),
            MatrixData::Bf16(b) => b.len(),
        };
        if len != rows * cols {
            return Err(Error::tensor(
                name,
                format!("holds {len} elements, expected {rows} x {cols} = {}", rows * cols),
            ));
        }
        Ok(Matrix { rows, cols, data })
    }

    /// An F32 matrix from owned data.
    pub fn from_f32(name: &str, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        Self::new(name, rows, cols, MatrixData::F32(WeightBuf::owned(data)))
    }

    /// Short name of the storage format.
    pub fn format_name(&self) -> &'static str {
        match self.data {
            MatrixData::F32(_) => "f32",
            MatrixData::Bf16(_) => "bf16",
        }
    }

    /// Bytes of weight data (what one full product must read).
    pub fn byte_len(&self) -> usize {
        match &self.data {
            MatrixData::F32(b) => b.byte_len(),
            MatrixData::Bf16(b) => b.byte_len(),
        }
    }

    /// Dot product of row `r` with `x`.
    #[inline]
    pub fn row_dot(&self, r: usize, x: &[f32]) -> f32 {
        let c = self.cols;
        match &self.data {
            MatrixData::F32(b) => reference::dot_f32(&b.as_slice()[r * c..(r + 1) * c], x),
            MatrixData::Bf16(b) => reference::dot_bf16(&b.as_slice()[r * c..(r + 1) * c], x),
        }
    }

    /// Writes row `r`, widened to f32, into `out` (embedding lookup).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            MatrixData::F32(b) => out.copy_from_slice(&b.as_slice()[r * c..(r + 1) * c]),
            MatrixData::Bf16(b) => {
                for (o, &w) in out.iter_mut().zip(&b.as_slice()[r * c..(r + 1) * c]) {
                    *o = reference::bf16_to_f32(w);
                }
            }
        }
    }

    /// `y = W x`. Rows are split across threads for large matrices; every output is the
    /// same sequential dot product whatever the thread count, so results do not depend on it.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec input length");
        assert_eq!(y.len(), self.rows, "matvec output length");
        if self.rows * self.cols < PARALLEL_MIN_WORK {
            for (r, out) in y.iter_mut().enumerate() {
                *out = self.row_dot(r, x);
            }
        } else {
            let chunk = (PARALLEL_MIN_WORK / self.cols).max(1);
            y.par_chunks_mut(chunk).enumerate().for_each(|(ci, ys)| {
                for (i, out) in ys.iter_mut().enumerate() {
                    *out = self.row_dot(ci * chunk + i, x);
                }
            });
        }
    }

    /// The whole matrix widened to f32 (for tests and the L1 reference).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols).enumerate() {
            self.row_to_f32(r, row);
        }
        out
    }
}
