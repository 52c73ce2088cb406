//! The expert store on disk: one flat file of 4 KiB-aligned records, one positioned read
//! per expert, straight into an aligned buffer that the expert's matrices then view.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::manifest::{Component, ExpertStoreInfo, RECORD_ALIGN, Scheme, align_up};
use crate::io::read_exact_at;
use crate::model::weights::ExpertWeights;
use crate::quant::buffer::{AlignedBytes, ByteRegion};
use crate::quant::{Matrix, MatrixData, WeightBuf};

/// Reads expert records from a container's expert file.
pub struct ExpertStore {
    path: PathBuf,
    file: File,
    info: ExpertStoreInfo,
    cfg: Arc<ModelConfig>,
}

impl ExpertStore {
    /// Opens `dir/<info.file>`. The layout has already been checked against the config.
    pub fn open(dir: &Path, info: &ExpertStoreInfo, cfg: Arc<ModelConfig>) -> Result<Self> {
        let path = dir.join(&info.file);
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        Ok(ExpertStore { path, file, info: info.clone(), cfg })
    }

    /// Bytes one read moves (the payload rounded up to 4 KiB).
    pub fn read_bytes(&self) -> u64 {
        align_up(self.info.payload_bytes, RECORD_ALIGN)
    }

    /// Bytes one expert occupies in memory once read.
    pub fn expert_bytes(&self) -> u64 {
        self.read_bytes()
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.info.records.len()
    }

    /// True when the store holds no experts.
    pub fn is_empty(&self) -> bool {
        self.info.records.is_empty()
    }

    /// Reads and decodes the record of `expert` in `layer`.
    pub fn read(&self, layer: usize, expert: usize) -> Result<ExpertWeights> {
        let e_count = self.cfg.num_experts;
        if layer >= self.cfg.num_layers || expert >= e_count {
            return Err(Error::invalid(format!("no expert {expert} in layer {layer}")));
        }
        let rec = &self.info.records[layer * e_count + expert];
        let mut buf = AlignedBytes::zeroed(self.read_bytes() as usize);
        read_exact_at(&self.file, buf.as_mut_slice(), rec.offset).map_err(|e| {
            Error::format(
                &self.path,
                format!("reading layer {layer} expert {expert} at offset {}: {e}", rec.offset),
            )
        })?;
        let region: Arc<dyn ByteRegion> = Arc::new(buf);
        self.decode(&region, layer, expert)
    }

    /// Builds an expert's matrices as views into its record bytes.
    fn decode(&self, region: &Arc<dyn ByteRegion>, layer: usize, expert: usize) -> Result<ExpertWeights> {
        let (h, i) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        let name = format!("layer {layer} expert {expert}");
        let comp =
            |n: &str| -> Result<&Component> {
                self.info.components.iter().find(|c| c.name == n).ok_or_else(|| {
                    Error::format(&self.path, format!("expert records have no `{n}` component"))
                })
            };
        let view = |c: &Component| (c.offset as usize, c.bytes as usize);
        let matrix = |m: &str, rows: usize, cols: usize| -> Result<Matrix> {
            let data = match self.info.scheme {
                Scheme::Int4Gs64 => {
                    let (co, cb) = view(comp(&format!("{m}.codes"))?);
                    let (so, sb) = view(comp(&format!("{m}.scales"))?);
                    MatrixData::Int4G64 {
                        codes: WeightBuf::shared(region, co, cb),
                        scales: WeightBuf::shared(region, so, sb),
                    }
                }
                _ => {
                    let (o, b) = view(comp(&format!("{m}.data"))?);
                    MatrixData::F32(WeightBuf::shared(region, o, b))
                }
            };
            Matrix::new(&format!("{name} {m}"), rows, cols, data)
        };
        let bias = |m: &str| -> Result<Vec<f32>> {
            let (o, b) = view(comp(&format!("{m}.bias"))?);
            Ok(WeightBuf::<f32>::shared(region, o, b).as_slice().to_vec())
        };
        let w = ExpertWeights {
            gate_up: matrix("gate_up", 2 * i, h)?,
            gate_up_bias: bias("gate_up")?,
            down: matrix("down", h, i)?,
            down_bias: bias("down")?,
        };
        w.check(&self.cfg, &name)?;
        Ok(w)
    }
}
