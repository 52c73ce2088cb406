//! The one description of every stored weight format: which parts a matrix of the format
//! is stored in (role, element type, bytes per row), the manifest scheme naming it, and how
//! a [`MatrixData`] view is built over those parts.
//!
//! The container layout, the converter, the container reader and the expert store all go
//! through [`WeightFormat`]; every `match` on it is exhaustive, so adding a format is a
//! compile error at each place that must learn about it, never a silent fall-through to
//! another format (as candle's `GgmlType` and ggml's `type_traits` do for their formats).

use std::sync::Arc;

use half::f16;

use crate::error::Result;
use crate::format::container::manifest::{Dtype, Scheme};
use crate::quant::buffer::ByteRegion;
use crate::quant::{MatrixData, WeightBuf, int4, mxfp4};

/// A storage format of a `[rows, cols]` weight matrix (rows are outputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// 32-bit floats: one `data` part.
    F32,
    /// bfloat16: one `data` part.
    Bf16,
    /// INT8 per row: i8 `codes`, one f32 `scales` entry per row.
    Int8Row,
    /// INT4 in groups of 64 inputs: packed u8 `codes`, one f16 `scales` entry per group.
    Int4Gs64,
    /// MXFP4 as released: packed E2M1 u8 `codes` (two a byte, low nibble first), one E8M0
    /// `scales` byte per block of 32 inputs.
    Mxfp4,
}

/// One stored part of a matrix of some format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartInfo {
    /// Role name (`data`, `codes`, `scales`): the manifest part role, and the suffix of an
    /// expert record component (`gate_up.codes`).
    pub role: &'static str,
    /// Element type as recorded in the manifest.
    pub dtype: Dtype,
}

const DATA_F32: &[PartInfo] = &[PartInfo { role: "data", dtype: Dtype::F32 }];
const DATA_BF16: &[PartInfo] = &[PartInfo { role: "data", dtype: Dtype::Bf16 }];
const INT8_ROW: &[PartInfo] =
    &[PartInfo { role: "codes", dtype: Dtype::I8 }, PartInfo { role: "scales", dtype: Dtype::F32 }];
const INT4_GS64: &[PartInfo] =
    &[PartInfo { role: "codes", dtype: Dtype::U8 }, PartInfo { role: "scales", dtype: Dtype::F16 }];
const MXFP4: &[PartInfo] =
    &[PartInfo { role: "codes", dtype: Dtype::U8 }, PartInfo { role: "scales", dtype: Dtype::U8 }];

impl WeightFormat {
    /// Every format, for tests that walk them all.
    pub const ALL: [WeightFormat; 5] = [
        WeightFormat::F32,
        WeightFormat::Bf16,
        WeightFormat::Int8Row,
        WeightFormat::Int4Gs64,
        WeightFormat::Mxfp4,
    ];

    /// Short name (the one [`MatrixData::format_name`] gives).
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Int8Row => "int8-row",
            WeightFormat::Int4Gs64 => "int4-gs64",
            WeightFormat::Mxfp4 => "mxfp4",
        }
    }

    /// The manifest scheme recording this format (plain floats are scheme `none`, told
    /// apart by the dtype of their `data` part).
    pub fn scheme(self) -> Scheme {
        match self {
            WeightFormat::F32 | WeightFormat::Bf16 => Scheme::None,
            WeightFormat::Int8Row => Scheme::Int8Row,
            WeightFormat::Int4Gs64 => Scheme::Int4Gs64,
            WeightFormat::Mxfp4 => Scheme::Mxfp4,
        }
    }

    /// Inputs sharing one scale, where the format groups inputs (recorded in the manifest
    /// as `group_size`).
    pub fn group_size(self) -> Option<usize> {
        match self {
            WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::Int8Row => None,
            WeightFormat::Int4Gs64 => Some(int4::GROUP),
            WeightFormat::Mxfp4 => Some(mxfp4::BLOCK),
        }
    }

    /// The format a manifest entry names: its scheme and the dtype of its first part (which
    /// tells F32 from BF16 under scheme `none`). `None` for a combination no format has.
    pub fn from_stored(scheme: Scheme, first_dtype: Option<Dtype>) -> Option<WeightFormat> {
        match scheme {
            Scheme::None => match first_dtype? {
                Dtype::F32 => Some(WeightFormat::F32),
                Dtype::Bf16 => Some(WeightFormat::Bf16),
                Dtype::F16 | Dtype::I8 | Dtype::U8 => None,
            },
            Scheme::Int8Row => Some(WeightFormat::Int8Row),
            Scheme::Int4Gs64 => Some(WeightFormat::Int4Gs64),
            Scheme::Mxfp4 => Some(WeightFormat::Mxfp4),
        }
    }

    /// The parts a matrix is stored in, in storage order.
    pub fn parts(self) -> &'static [PartInfo] {
        match self {
            WeightFormat::F32 => DATA_F32,
            WeightFormat::Bf16 => DATA_BF16,
            WeightFormat::Int8Row => INT8_ROW,
            WeightFormat::Int4Gs64 => INT4_GS64,
            WeightFormat::Mxfp4 => MXFP4,
        }
    }

    /// Why a matrix of `cols` inputs cannot be stored in this format, if it cannot.
    pub fn check_cols(self, cols: usize) -> std::result::Result<(), String> {
        match self {
            WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::Int8Row | WeightFormat::Int4Gs64 => Ok(()),
            WeightFormat::Mxfp4 if cols.is_multiple_of(mxfp4::BLOCK) => Ok(()),
            WeightFormat::Mxfp4 => Err(format!("{cols} inputs are not a whole number of MXFP4 blocks of 32")),
        }
    }

    /// Bytes one row of `cols` inputs takes in part `role`; `None` for a role the format
    /// does not have or a size that overflows.
    pub fn part_row_bytes(self, role: &str, cols: usize) -> Option<usize> {
        match (self, role) {
            (WeightFormat::F32, "data") => cols.checked_mul(4),
            (WeightFormat::Bf16, "data") => cols.checked_mul(2),
            (WeightFormat::Int8Row, "codes") => Some(cols),
            (WeightFormat::Int8Row, "scales") => Some(4),
            (WeightFormat::Int4Gs64, "codes") => Some(int4::row_bytes(cols)),
            (WeightFormat::Int4Gs64, "scales") => int4::groups(cols).checked_mul(2),
            (WeightFormat::Mxfp4, "codes") => Some(mxfp4::row_bytes(cols)),
            (WeightFormat::Mxfp4, "scales") => Some(mxfp4::blocks(cols)),
            (
                WeightFormat::F32
                | WeightFormat::Bf16
                | WeightFormat::Int8Row
                | WeightFormat::Int4Gs64
                | WeightFormat::Mxfp4,
                _,
            ) => None,
        }
    }

    /// Bytes of part `role` of a `[rows, cols]` matrix (checked arithmetic).
    pub fn part_bytes(self, role: &str, rows: usize, cols: usize) -> Option<u64> {
        let b = rows.checked_mul(self.part_row_bytes(role, cols)?)?;
        u64::try_from(b).ok()
    }

    /// Bytes per row over all parts.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        self.parts().iter().try_fold(0usize, |sum, p| sum.checked_add(self.part_row_bytes(p.role, cols)?))
    }

    /// Builds the matrix storage over `region`; `range(role)` gives each part's byte offset
    /// and length within the region (already checked to lie inside it, and to be a whole
    /// number of the part's elements).
    pub fn matrix_data(
        self,
        region: &Arc<dyn ByteRegion>,
        range: &dyn Fn(&str) -> Result<(usize, usize)>,
    ) -> Result<MatrixData> {
        let buf = |role: &str| -> Result<(usize, usize)> { range(role) };
        Ok(match self {
            WeightFormat::F32 => {
                let (o, b) = buf("data")?;
                MatrixData::F32(WeightBuf::shared(region, o, b))
            }
            WeightFormat::Bf16 => {
                let (o, b) = buf("data")?;
                MatrixData::Bf16(WeightBuf::shared(region, o, b))
            }
            WeightFormat::Int8Row => {
                let ((co, cb), (so, sb)) = (buf("codes")?, buf("scales")?);
                MatrixData::Int8Rows {
                    codes: WeightBuf::shared(region, co, cb),
                    scales: WeightBuf::shared(region, so, sb),
                }
            }
            WeightFormat::Int4Gs64 => {
                let ((co, cb), (so, sb)) = (buf("codes")?, buf("scales")?);
                MatrixData::Int4G64 {
                    codes: WeightBuf::shared(region, co, cb),
                    scales: WeightBuf::shared(region, so, sb),
                }
            }
            WeightFormat::Mxfp4 => {
                let ((co, cb), (so, sb)) = (buf("codes")?, buf("scales")?);
                MatrixData::Mxfp4 {
                    codes: WeightBuf::shared(region, co, cb),
                    scales: WeightBuf::shared(region, so, sb),
                }
            }
        })
    }
}

impl MatrixData {
    /// The format of this storage.
    pub fn format(&self) -> WeightFormat {
        match self {
            MatrixData::F32(_) => WeightFormat::F32,
            MatrixData::Bf16(_) => WeightFormat::Bf16,
            MatrixData::Int8Rows { .. } => WeightFormat::Int8Row,
            MatrixData::Int4G64 { .. } => WeightFormat::Int4Gs64,
            MatrixData::Mxfp4 { .. } => WeightFormat::Mxfp4,
        }
    }

    /// The first scale that is not a finite number, as (part role, index): an f32 INT8 row
    /// scale or f16 INT4 group scale that is NaN or infinite, or the E8M0 NaN byte `0xFF`
    /// of an MXFP4 block. Plain floats have no scales (their values are checked where they
    /// are written). A loader refuses such a matrix instead of computing NaN.
    pub fn first_bad_scale(&self) -> Option<(&'static str, usize)> {
        let at = |i: Option<usize>| i.map(|i| ("scales", i));
        match self {
            MatrixData::F32(_) | MatrixData::Bf16(_) => None,
            MatrixData::Int8Rows { scales, .. } => at(scales.as_slice().iter().position(|s| !s.is_finite())),
            MatrixData::Int4G64 { scales, .. } => {
                at(scales.as_slice().iter().position(|s| !f16::from_bits(*s).is_finite()))
            }
            MatrixData::Mxfp4 { scales, .. } => {
                at(scales.as_slice().iter().position(|s| mxfp4::scale_value(*s).is_none()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_round_trips_through_its_manifest_entry() {
        for f in WeightFormat::ALL {
            let first = f.parts().first().map(|p| p.dtype);
            assert_eq!(WeightFormat::from_stored(f.scheme(), first), Some(f), "{}", f.name());
            for p in f.parts() {
                assert!(f.part_row_bytes(p.role, 64).is_some(), "{} {}", f.name(), p.role);
            }
            assert_eq!(f.part_row_bytes("nonsense", 64), None);
        }
    }

    #[test]
    fn row_bytes_match_the_codecs() {
        assert_eq!(WeightFormat::Mxfp4.row_bytes(64), Some(32 + 2));
        assert_eq!(WeightFormat::Int4Gs64.row_bytes(128), Some(64 + 4));
        assert_eq!(WeightFormat::Int8Row.row_bytes(10), Some(14));
        assert_eq!(WeightFormat::Bf16.row_bytes(10), Some(20));
        assert_eq!(WeightFormat::F32.part_bytes("data", usize::MAX, 2), None);
        assert!(WeightFormat::Mxfp4.check_cols(48).is_err());
        assert!(WeightFormat::Mxfp4.check_cols(64).is_ok());
    }
}
