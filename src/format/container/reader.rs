//! Opening a container: the manifest is checked against the layout the config implies
//! (every mandatory tensor present with its shape, scheme and byte counts; every expert
//! record where it should be; data files exactly as long as the manifest says), then the
//! dense weights are memory-mapped and the expert store is opened for positioned reads.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::layout::{ExpertFormat, TensorRole, dense_tensors, part_bytes, plan_experts};
use crate::format::container::manifest::{
    DENSE_FILE, Dtype, EXPERTS_FILE, ExpertStoreInfo, MANIFEST_FILE, Manifest, RECORD_ALIGN, Scheme,
    TensorRecord,
};
use crate::model::weights::DenseWeights;
use crate::quant::buffer::ByteRegion;
use crate::quant::{Matrix, MatrixData, WeightBuf};

/// An opened, checked container.
pub struct Container {
    /// The container directory.
    pub dir: PathBuf,
    /// Its configuration.
    pub config: ModelConfig,
    /// Its manifest.
    pub manifest: Manifest,
}

/// Whether `dir` looks like a container (it has a manifest), complete or not.
pub fn is_container(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

impl Container {
    /// Opens `dir` and checks the manifest against the config and the files on disk.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = Manifest::read(dir)?;
        let config = ModelConfig::from_dir(dir)?;
        let c = Container { dir: dir.to_path_buf(), config, manifest };
        c.check()?;
        Ok(c)
    }

    /// Format of the experts.
    pub fn expert_format(&self) -> ExpertFormat {
        match self.manifest.experts.scheme {
            Scheme::Int4Gs64 => ExpertFormat::Int4,
            _ => ExpertFormat::F32,
        }
    }

    fn check(&self) -> Result<()> {
        let m = &self.manifest;
        let mpath = self.dir.join(MANIFEST_FILE);
        for (file, want) in [(DENSE_FILE, m.files.dense), (EXPERTS_FILE, m.files.experts)] {
            let path = self.dir.join(file);
            let len = std::fs::metadata(&path).map_err(|e| Error::io(&path, e))?.len();
            if len != want {
                let what = if len < want { "truncated" } else { "longer than the manifest says" };
                return Err(Error::format(
                    &path,
                    format!("file is {what}: {len} bytes, manifest says {want}"),
                ));
            }
        }
        let by_name: HashMap<&str, &TensorRecord> = m.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        for (name, shape, role) in dense_tensors(&self.config) {
            let t = by_name
                .get(name.as_str())
                .ok_or_else(|| Error::MissingTensor { name: name.clone(), dir: self.dir.clone() })?;
            if t.shape != shape {
                return Err(Error::tensor(
                    &name,
                    format!("manifest shape {:?}, config implies {shape:?}", t.shape),
                ));
            }
            check_storage(t, role)?;
            for p in &t.parts {
                let want = part_bytes(&t.shape, t.scheme, &p.role, p.dtype);
                if p.bytes != want {
                    return Err(Error::tensor(
                        &name,
                        format!("part `{}` has {} bytes, its shape and scheme need {want}", p.role, p.bytes),
                    ));
                }
                if p.file != DENSE_FILE || p.offset.checked_add(p.bytes).is_none_or(|end| end > m.files.dense)
                {
                    return Err(Error::tensor(
                        &name,
                        format!("part `{}` lies outside {DENSE_FILE} ({}+{})", p.role, p.offset, p.bytes),
                    ));
                }
            }
        }
        self.check_experts(&mpath)
    }

    fn check_experts(&self, mpath: &Path) -> Result<()> {
        let cfg = &self.config;
        let e = &self.manifest.experts;
        let (want, _) = plan_experts(cfg, self.expert_format());
        if e.components != want.components || e.payload_bytes != want.payload_bytes {
            return Err(Error::format(
                mpath,
                format!(
                    "expert record layout does not match the config (hidden {}, intermediate {})",
                    cfg.hidden_size, cfg.intermediate_size
                ),
            ));
        }
        if e.records.len() != cfg.num_layers * cfg.num_experts {
            return Err(Error::format(
                mpath,
                format!(
                    "{} expert records, config needs {} x {}",
                    e.records.len(),
                    cfg.num_layers,
                    cfg.num_experts
                ),
            ));
        }
        for (n, r) in e.records.iter().enumerate() {
            let (layer, expert) = (n / cfg.num_experts, n % cfg.num_experts);
            if (r.layer, r.expert) != (layer, expert) {
                return Err(Error::format(
                    mpath,
                    format!(
                        "expert record {n} is ({}, {}), expected layer {layer} expert {expert}",
                        r.layer, r.expert
                    ),
                ));
            }
            let end = r.offset.checked_add(e.record_stride);
            if r.bytes != e.payload_bytes
                || !r.offset.is_multiple_of(RECORD_ALIGN)
                || end.is_none_or(|end| end > self.manifest.files.experts)
            {
                return Err(Error::format(
                    mpath,
                    format!(
                        "expert record for layer {layer} expert {expert} is misplaced or lies outside {EXPERTS_FILE}"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Memory-maps `dense.bin` and builds the dense weights.
    pub fn load_dense(&self) -> Result<DenseWeights> {
        let path = self.dir.join(DENSE_FILE);
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: read-only mapping of a file the container owns; not modified while open.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let region: Arc<dyn ByteRegion> = Arc::new(map);
        let tensor = |name: &str| -> Result<&TensorRecord> {
            self.manifest
                .tensor(name)
                .ok_or_else(|| Error::MissingTensor { name: name.into(), dir: self.dir.clone() })
        };
        // Shapes come from the manifest (checked against the data when it was opened) and
        // are checked against the config by `assemble`.
        DenseWeights::assemble(&self.config, &|name, _, _| matrix_from(tensor(name)?, &region), &|name, _| {
            vector_from(tensor(name)?, &region)
        })
    }

    /// Bytes of dense weights.
    pub fn dense_bytes(&self) -> u64 {
        self.manifest.files.dense
    }

    /// The expert store description.
    pub fn experts(&self) -> &ExpertStoreInfo {
        &self.manifest.experts
    }
}

/// Checks that a tensor's scheme and part dtypes are ones its role may have.
fn check_storage(t: &TensorRecord, role: TensorRole) -> Result<()> {
    let dtypes: Vec<(&str, Dtype)> = t.parts.iter().map(|p| (p.role.as_str(), p.dtype)).collect();
    let ok = match (t.scheme, role) {
        (Scheme::None, TensorRole::Vector) => dtypes == [("data", Dtype::F32)],
        (Scheme::None, _) => dtypes == [("data", Dtype::F32)] || dtypes == [("data", Dtype::Bf16)],
        (Scheme::Int8Row, TensorRole::Vocab | TensorRole::Matrix) => {
            dtypes == [("codes", Dtype::I8), ("scales", Dtype::F32)]
        }
        (Scheme::Int4Gs64, TensorRole::Matrix) => dtypes == [("codes", Dtype::U8), ("scales", Dtype::F16)],
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(Error::tensor(
            &t.name,
            format!("stored as {:?} with parts {dtypes:?}, which this tensor cannot be", t.scheme),
        ))
    }
}

fn part_buf<T: bytemuck::Pod>(
    t: &TensorRecord,
    role: &str,
    region: &Arc<dyn ByteRegion>,
) -> Result<WeightBuf<T>> {
    let p = t.part(role).ok_or_else(|| Error::tensor(&t.name, format!("no `{role}` part")))?;
    Ok(WeightBuf::shared(region, p.offset as usize, p.bytes as usize))
}

fn matrix_from(t: &TensorRecord, region: &Arc<dyn ByteRegion>) -> Result<Matrix> {
    let (rows, cols) = match t.shape[..] {
        [r, c] => (r, c),
        _ => return Err(Error::tensor(&t.name, format!("shape {:?} is not a matrix", t.shape))),
    };
    let data = match t.scheme {
        Scheme::None => match t.parts[0].dtype {
            Dtype::Bf16 => MatrixData::Bf16(part_buf(t, "data", region)?),
            _ => MatrixData::F32(part_buf(t, "data", region)?),
        },
        Scheme::Int8Row => MatrixData::Int8Rows {
            codes: part_buf(t, "codes", region)?,
            scales: part_buf(t, "scales", region)?,
        },
        Scheme::Int4Gs64 => MatrixData::Int4G64 {
            codes: part_buf(t, "codes", region)?,
            scales: part_buf(t, "scales", region)?,
        },
    };
    Matrix::new(&t.name, rows, cols, data)
}

fn vector_from(t: &TensorRecord, region: &Arc<dyn ByteRegion>) -> Result<Vec<f32>> {
    let buf: WeightBuf<f32> = part_buf(t, "data", region)?;
    Ok(buf.as_slice().to_vec())
}
