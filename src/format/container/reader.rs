//! Opening a container: the manifest is validated against the layout the config implies
//! and the files on disk ([`Manifest::validate`], the same check `picchio verify` runs
//! first), then the dense weights are memory-mapped and the expert store is opened for
//! positioned reads. Small dense tensors (norm weights, biases, sinks, per-row and group
//! scales) are checked for NaN and infinity as they are loaded; the large matrices are not
//! read at load (their bytes are checked by `verify` and at conversion).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::layout::ExpertFormat;
use crate::format::container::manifest::{
    DENSE_FILE, ExpertStoreInfo, MANIFEST_FILE, Manifest, TensorRecord,
};
use crate::model::weights::DenseWeights;
use crate::quant::buffer::ByteRegion;
use crate::quant::format::WeightFormat;
use crate::quant::{Matrix, WeightBuf};

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
    /// Opens `dir` and validates the manifest against the config and the files on disk.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = Manifest::read(dir)?;
        let config = ModelConfig::from_dir(dir)?;
        manifest.validate(dir, &config)?;
        Ok(Container { dir: dir.to_path_buf(), config, manifest })
    }

    /// Format of the experts (validated against the manifest's formats when opened).
    pub fn expert_format(&self) -> ExpertFormat {
        self.manifest.formats.experts
    }

    /// Memory-maps `dense.bin` and builds the dense weights.
    pub fn load_dense(&self) -> Result<DenseWeights> {
        let path = self.dir.join(DENSE_FILE);
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: read-only mapping of a file the container owns; not modified while open.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        if map.len() as u64 != self.manifest.files.dense {
            return Err(Error::format(
                &path,
                format!(
                    "changed while opening: {} bytes mapped, the manifest says {}",
                    map.len(),
                    self.manifest.files.dense
                ),
            ));
        }
        prefault(&map, &self.per_token_ranges());
        let region: Arc<dyn ByteRegion> = Arc::new(map);
        let tensor = |name: &str| -> Result<&TensorRecord> {
            self.manifest
                .tensor(name)
                .ok_or_else(|| Error::MissingTensor { name: name.into(), dir: self.dir.clone() })
        };
        // Shapes come from the manifest (validated against the config when it was opened)
        // and are checked against the config again by `assemble`.
        DenseWeights::assemble(&self.config, &|name, _, _| matrix_from(tensor(name)?, &region), &|name, _| {
            vector_from(tensor(name)?, &region)
        })
    }

    /// Byte ranges of `dense.bin` that every token reads: every dense part except the
    /// embedding's (a token reads one row of it), unless the head is the embedding.
    pub fn per_token_ranges(&self) -> Vec<std::ops::Range<usize>> {
        let skip_embedding = !self.config.tie_word_embeddings;
        self.manifest
            .tensors
            .iter()
            .filter(|t| !(skip_embedding && t.name == crate::model::names::EMBED))
            .flat_map(|t| t.parts.iter())
            .filter(|p| p.file == DENSE_FILE)
            .filter_map(|p| {
                let start = usize::try_from(p.offset).ok()?;
                Some(start..start.checked_add(usize::try_from(p.bytes).ok()?)?)
            })
            .collect()
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

/// What to do about a damaged container that is Picchio's cached conversion of a
/// checkpoint (`dir`, inside the conversion cache): delete it, and the next run rebuilds it.
pub fn cached_copy_advice(dir: &Path) -> String {
    format!(
        "{} is Picchio's cached conversion of a checkpoint: delete that directory \
         (e.g. `rm -r '{}'`) and run again to rebuild it from the checkpoint",
        dir.display(),
        dir.display()
    )
}

/// `e`, from loading the cached conversion `dir`, with [`cached_copy_advice`] added.
pub fn cached_copy_damaged(dir: &Path, e: Error) -> Error {
    Error::format(dir, format!("the cached conversion is damaged: {e}; {}", cached_copy_advice(dir)))
}

/// A view of part `role` of `t` in the mapped `dense.bin`; the range is checked against the
/// mapping (validation checked it against the file, which may have changed since).
fn part_buf<T: bytemuck::Pod>(
    t: &TensorRecord,
    role: &str,
    region: &Arc<dyn ByteRegion>,
) -> Result<WeightBuf<T>> {
    let (offset, bytes) = part_range(t, role, std::mem::size_of::<T>(), region)?;
    Ok(WeightBuf::shared(region, offset, bytes))
}

/// The byte range of part `role` of `t` in the mapped `dense.bin`, checked to lie inside
/// the mapping and to be a whole number of `elem`-byte elements.
fn part_range(
    t: &TensorRecord,
    role: &str,
    elem: usize,
    region: &Arc<dyn ByteRegion>,
) -> Result<(usize, usize)> {
    let p = t.part(role).ok_or_else(|| Error::tensor(&t.name, format!("no `{role}` part")))?;
    let len = region.bytes().len();
    let range = usize::try_from(p.offset)
        .ok()
        .zip(usize::try_from(p.bytes).ok())
        .filter(|&(o, b)| o.checked_add(b).is_some_and(|end| end <= len));
    match range {
        Some((offset, bytes)) if bytes.is_multiple_of(elem) => Ok((offset, bytes)),
        _ => Err(Error::tensor(
            &t.name,
            format!(
                "part `{role}` ({} bytes at {}) does not fit the {len}-byte {DENSE_FILE}",
                p.bytes, p.offset
            ),
        )),
    }
}

/// Refuses a tensor holding NaN or infinity at `index` of its part `role`.
fn refuse_non_finite(t: &TensorRecord, role: &str, index: Option<usize>) -> Result<()> {
    match index {
        None => Ok(()),
        Some(i) => Err(Error::tensor(
            &t.name,
            format!(
                "part `{role}` holds a NaN or infinity at element {i}; the container is damaged \
                 (run `picchio verify` on it and convert the source again)"
            ),
        )),
    }
}

fn matrix_from(t: &TensorRecord, region: &Arc<dyn ByteRegion>) -> Result<Matrix> {
    let (rows, cols) = match t.shape[..] {
        [r, c] => (r, c),
        _ => return Err(Error::tensor(&t.name, format!("shape {:?} is not a matrix", t.shape))),
    };
    let format = WeightFormat::from_stored(t.scheme, t.parts.first().map(|p| p.dtype)).ok_or_else(|| {
        Error::tensor(&t.name, format!("scheme {:?} with these parts is no weight format", t.scheme))
    })?;
    let mut ranges = Vec::new();
    for p in format.parts() {
        let stored = t.part(p.role).map(|s| s.dtype);
        if stored != Some(p.dtype) {
            return Err(Error::tensor(
                &t.name,
                format!("part `{}` is {stored:?}, format {} needs {:?}", p.role, format.name(), p.dtype),
            ));
        }
        ranges.push((p.role, part_range(t, p.role, p.dtype.size() as usize, region)?));
    }
    let range = |role: &str| -> Result<(usize, usize)> {
        ranges
            .iter()
            .find(|(r, _)| *r == role)
            .map(|(_, x)| *x)
            .ok_or_else(|| Error::tensor(&t.name, format!("no `{role}` part")))
    };
    let data = format.matrix_data(region, &range)?;
    if let Some((role, i)) = data.first_bad_scale() {
        refuse_non_finite(t, role, Some(i))?;
    }
    Matrix::new(&t.name, rows, cols, data)
}

fn vector_from(t: &TensorRecord, region: &Arc<dyn ByteRegion>) -> Result<Vec<f32>> {
    let buf: WeightBuf<f32> = part_buf(t, "data", region)?;
    refuse_non_finite(t, "data", first_non_finite_f32(buf.as_slice()))?;
    Ok(buf.as_slice().to_vec())
}

/// Index of the first NaN or infinity in `values`.
pub fn first_non_finite_f32(values: &[f32]) -> Option<usize> {
    // A whole-slice test first (it vectorizes); the position only when there is one.
    if values.iter().fold(true, |ok, v| ok & v.is_finite()) {
        return None;
    }
    values.iter().position(|v| !v.is_finite())
}

/// Index of the first NaN or infinity in IEEE half `bits` (exponent all ones).
pub fn first_non_finite_f16(bits: &[u16]) -> Option<usize> {
    let bad = |b: &u16| b & 0x7c00 == 0x7c00;
    if !bits.iter().fold(false, |any, b| any | bad(b)) {
        return None;
    }
    bits.iter().position(bad)
}

/// Brings `ranges` of the mapped dense weights into memory now, at load, so the first prompt
/// of a session does not pay for them as page faults in the middle of its prefill (on a cold
/// start that is every attention matrix, router and the head: hundreds of MB read 4 KiB or
/// one read-ahead window at a time). The kernel is asked to read the ranges ahead
/// (`MADV_WILLNEED`, large requests), then one byte per page is touched to wait for them.
/// Ranges outside the map are ignored (the manifest was validated against the file).
fn prefault(map: &Mmap, ranges: &[std::ops::Range<usize>]) {
    const PAGE: usize = 4096;
    let ranges: Vec<_> = ranges.iter().filter(|r| r.start < r.end && r.end <= map.len()).cloned().collect();
    #[cfg(unix)]
    for r in &ranges {
        // Only a hint: an error (e.g. an unaligned start on some platform) changes nothing.
        let _ = map.advise_range(memmap2::Advice::WillNeed, r.start, r.end - r.start);
    }
    let mut sum = 0u8;
    for r in &ranges {
        for at in (r.start..r.end).step_by(PAGE) {
            sum = sum.wrapping_add(map[at]);
        }
    }
    std::hint::black_box(sum);
}
