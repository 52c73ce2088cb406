//! The one validation of a container's manifest against its config and its files, shared by
//! the loader ([`Container::open`](super::Container::open)) and `picchio verify`, so that
//! whatever one refuses the other refuses too.
//!
//! What is checked (all arithmetic on sizes from the manifest is checked):
//! - the header (format, version, complete, hash algorithm) and that no
//!   `convert.state.json` lies beside the manifest (an unfinished conversion);
//! - the data files: each exists, is a regular file (not a device, FIFO or directory; a
//!   symbolic link only to a file inside the container) and is exactly as long as
//!   `files` says;
//! - the dense tensors: exactly the set the config implies, no duplicates, each with the
//!   config's shape, a storage the manifest's formats allow, and byte counts its shape
//!   needs; every part in `dense.bin`, 256-byte aligned, inside the file, overlapping no
//!   other part;
//! - the expert store: in `experts.bin`, the scheme the formats name, the record layout the
//!   config implies, one record per (layer, expert) in layer-major order, each exactly where
//!   the layout puts it, the file exactly as long as the records need;
//! - every hash: 64 lower-case hex digits.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::convert::STATE_FILE;
use crate::format::container::layout::{TensorRole, dense_storage, dense_tensors, plan_experts, rows_cols};
use crate::format::container::manifest::{
    DENSE_ALIGN, DENSE_FILE, Dtype, EXPERTS_FILE, MANIFEST_FILE, Manifest, RECORD_ALIGN, TensorRecord,
};
use crate::quant::format::WeightFormat;

/// What a successful validation learned: the amount of work `verify` has to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidatedLayout {
    /// Dense parts plus expert records (the hashed items).
    pub items: usize,
    /// Bytes those items hold (what `verify` hashes).
    pub hashed_bytes: u64,
}

impl Manifest {
    /// Checks this manifest (read from `dir`) against `cfg` and the files in `dir`; see the
    /// module documentation for the list. The first problem found is returned, naming the
    /// file, tensor or record and the values at fault.
    pub fn validate(&self, dir: &Path, cfg: &ModelConfig) -> Result<ValidatedLayout> {
        let mpath = dir.join(MANIFEST_FILE);
        check_header(self, &mpath)?;
        check_no_state(dir)?;
        check_data_files(self, dir)?;
        let (parts, part_bytes) = check_tensors(self, dir, cfg)?;
        let (records, record_bytes) = check_experts(self, &mpath, cfg)?;
        let hashed_bytes = part_bytes
            .checked_add(record_bytes)
            .ok_or_else(|| Error::format(&mpath, "total byte count overflows"))?;
        Ok(ValidatedLayout { items: parts + records, hashed_bytes })
    }
}

/// The header fields `Manifest::read` does not check already.
fn check_header(m: &Manifest, mpath: &Path) -> Result<()> {
    if m.hash_algorithm != "blake3" {
        return Err(Error::format(
            mpath,
            format!("hash_algorithm is \"{}\", this build reads \"blake3\"", m.hash_algorithm),
        ));
    }
    if m.formats.experts.weight_format().map(|f| f.scheme()) != Some(m.experts.scheme) {
        return Err(Error::format(
            mpath,
            format!(
                "experts.scheme is {:?} but formats.experts is {:?}",
                m.experts.scheme, m.formats.experts
            ),
        ));
    }
    Ok(())
}

/// A state file beside a manifest means a conversion into this directory did not finish.
fn check_no_state(dir: &Path) -> Result<()> {
    let state = dir.join(STATE_FILE);
    if std::fs::symlink_metadata(&state).is_ok() {
        return Err(Error::format(
            &state,
            format!(
                "lies beside {MANIFEST_FILE}: a conversion into this directory did not finish; \
                 run `picchio convert <source> {}` again to finish it",
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// Each data file exists, is a regular file inside the container, and has the manifest's length.
fn check_data_files(m: &Manifest, dir: &Path) -> Result<()> {
    let root = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
    for (name, want) in [(DENSE_FILE, m.files.dense), (EXPERTS_FILE, m.files.experts)] {
        let path = dir.join(name);
        let len = regular_file_len(&root, &path)?;
        if len != want {
            let what = if len < want { "truncated" } else { "longer than the manifest says" };
            return Err(Error::format(&path, format!("file is {what}: {len} bytes, manifest says {want}")));
        }
    }
    Ok(())
}

/// The length of `path`, which must be a regular file, or a symbolic link to one inside
/// `root` (the canonical container directory).
pub fn regular_file_len(root: &Path, path: &Path) -> Result<u64> {
    let link = std::fs::symlink_metadata(path).map_err(|e| Error::io(path, e))?;
    if link.file_type().is_symlink() {
        let target: PathBuf = path.canonicalize().map_err(|e| Error::io(path, e))?;
        if !target.starts_with(root) {
            return Err(Error::format(
                path,
                format!("is a symbolic link to {}, outside the container", target.display()),
            ));
        }
    }
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::format(path, "is not a regular file (a device, FIFO or directory?)"));
    }
    Ok(meta.len())
}

/// Whether `s` is a BLAKE3 hash as the manifest writes it: 64 lower-case hex digits.
pub fn is_hash_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Checks every dense tensor; returns the number of parts and their total bytes.
fn check_tensors(m: &Manifest, dir: &Path, cfg: &ModelConfig) -> Result<(usize, u64)> {
    let wanted = dense_tensors(cfg);
    let known: HashSet<&str> = wanted.iter().map(|(n, _, _)| n.as_str()).collect();
    let mut seen = HashSet::new();
    for t in &m.tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(Error::tensor(&t.name, "appears more than once in the manifest"));
        }
        if !known.contains(t.name.as_str()) {
            return Err(Error::tensor(&t.name, "is in the manifest but is not a tensor of this model"));
        }
    }
    let by_name: std::collections::HashMap<&str, &TensorRecord> =
        m.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    // (offset, end, tensor, role) of every part, to find overlaps.
    let mut ranges: Vec<(u64, u64, &str, &str)> = Vec::new();
    let mut total = 0u64;
    for (name, shape, role) in &wanted {
        let t = by_name
            .get(name.as_str())
            .ok_or_else(|| Error::MissingTensor { name: name.clone(), dir: dir.to_path_buf() })?;
        if &t.shape != shape {
            return Err(Error::tensor(
                name,
                format!("manifest shape {:?}, config implies {shape:?}", t.shape),
            ));
        }
        let format = check_storage(m, t, *role)?;
        for p in &t.parts {
            let want = checked_part_bytes(&t.shape, format, &p.role)
                .ok_or_else(|| Error::tensor(name, format!("part `{}`: byte count overflows", p.role)))?;
            if p.bytes != want {
                return Err(Error::tensor(
                    name,
                    format!("part `{}` has {} bytes, its shape and scheme need {want}", p.role, p.bytes),
                ));
            }
            if p.file != DENSE_FILE {
                return Err(Error::tensor(
                    name,
                    format!("part `{}` names file {:?}; dense parts live in {DENSE_FILE}", p.role, p.file),
                ));
            }
            let end = p.offset.checked_add(p.bytes).filter(|&end| end <= m.files.dense).ok_or_else(|| {
                Error::tensor(
                    name,
                    format!(
                        "part `{}` lies outside {DENSE_FILE} (offset {} + {} bytes, file has {})",
                        p.role, p.offset, p.bytes, m.files.dense
                    ),
                )
            })?;
            if !p.offset.is_multiple_of(DENSE_ALIGN) {
                return Err(Error::tensor(
                    name,
                    format!("part `{}` offset {} is not a multiple of {DENSE_ALIGN}", p.role, p.offset),
                ));
            }
            if !is_hash_hex(&p.hash) {
                return Err(Error::tensor(
                    name,
                    format!("part `{}` hash {:?} is not 64 lower-case hex digits", p.role, p.hash),
                ));
            }
            total = total.checked_add(p.bytes).ok_or_else(|| Error::tensor(name, "byte total overflows"))?;
            ranges.push((p.offset, end, name.as_str(), p.role.as_str()));
        }
    }
    check_overlaps(&mut ranges)?;
    Ok((ranges.len(), total))
}

/// No two dense parts share a byte.
fn check_overlaps(ranges: &mut [(u64, u64, &str, &str)]) -> Result<()> {
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if b.0 < a.1 {
            return Err(Error::tensor(
                b.2,
                format!(
                    "part `{}` at {}..{} of {DENSE_FILE} overlaps part `{}` of `{}` at {}..{}",
                    b.3, b.0, b.1, a.3, a.2, a.0, a.1
                ),
            ));
        }
    }
    Ok(())
}

/// Checks that a tensor is stored as the manifest's formats store a tensor of its role;
/// returns its format.
fn check_storage(m: &Manifest, t: &TensorRecord, role: TensorRole) -> Result<WeightFormat> {
    let dtypes: Vec<(&str, Dtype)> = t.parts.iter().map(|p| (p.role.as_str(), p.dtype)).collect();
    let found = [false, true].into_iter().map(|bf16| dense_storage(role, m.formats, bf16)).find(|f| {
        f.scheme() == t.scheme && f.parts().iter().map(|p| (p.role, p.dtype)).eq(dtypes.iter().copied())
    });
    let Some(format) = found else {
        return Err(Error::tensor(
            &t.name,
            format!(
                "stored as {:?} with parts {dtypes:?}, which the formats {:?} do not give this tensor",
                t.scheme, m.formats
            ),
        ));
    };
    let want_group = format.group_size();
    if t.group_size != want_group {
        return Err(Error::tensor(
            &t.name,
            format!("group_size {:?}, scheme {:?} needs {want_group:?}", t.group_size, t.scheme),
        ));
    }
    Ok(format)
}

/// Byte count of part `role` of a tensor of `shape` stored as `format`; `None` on overflow,
/// a role the format does not have, or a shape that is not a vector or matrix.
pub fn checked_part_bytes(shape: &[usize], format: WeightFormat, role: &str) -> Option<u64> {
    let (rows, cols) = rows_cols(shape)?;
    format.part_bytes(role, rows, cols)
}

/// Checks the expert store; returns the number of records and their payload bytes.
fn check_experts(m: &Manifest, mpath: &Path, cfg: &ModelConfig) -> Result<(usize, u64)> {
    let e = &m.experts;
    if e.file != EXPERTS_FILE {
        return Err(Error::format(
            mpath,
            format!("experts.file is {:?}; expert records live in {EXPERTS_FILE}", e.file),
        ));
    }
    let Some(wanted) = m.formats.experts.weight_format() else {
        return Err(Error::format(
            mpath,
            "formats.experts is `auto`; a conversion records the format it chose",
        ));
    };
    let first = e.components.first().map(|c| c.dtype);
    let format = WeightFormat::from_stored(e.scheme, first).filter(|f| *f == wanted).ok_or_else(|| {
        Error::format(
            mpath,
            format!("experts.scheme is {:?} but formats.experts is {:?}", e.scheme, m.formats.experts),
        )
    })?;
    for cols in [cfg.hidden_size, cfg.intermediate_size] {
        format.check_cols(cols).map_err(|why| Error::format(mpath, format!("experts: {why}")))?;
    }
    let want_group = format.group_size();
    if e.group_size != want_group {
        return Err(Error::format(
            mpath,
            format!("experts.group_size {:?}, scheme {:?} needs {want_group:?}", e.group_size, e.scheme),
        ));
    }
    let count = cfg.num_expert_records();
    if e.records.len() != count {
        return Err(Error::format(
            mpath,
            format!(
                "{} expert records, config needs {} MoE layers x {} experts",
                e.records.len(),
                cfg.moe_layers().count(),
                cfg.num_experts
            ),
        ));
    }
    let (want, _) = plan_experts(cfg, format);
    if e.components != want.components || e.payload_bytes != want.payload_bytes {
        return Err(Error::format(
            mpath,
            format!(
                "expert record layout does not match the config (hidden {}, intermediate {})",
                cfg.hidden_size, cfg.intermediate_size
            ),
        ));
    }
    if e.record_stride != want.record_stride || !e.record_stride.is_multiple_of(RECORD_ALIGN) {
        return Err(Error::format(
            mpath,
            format!("experts.record_stride is {}, the layout needs {}", e.record_stride, want.record_stride),
        ));
    }
    let needed = (count as u64)
        .checked_mul(e.record_stride)
        .ok_or_else(|| Error::format(mpath, "experts file size overflows"))?;
    if m.files.experts != needed {
        return Err(Error::format(
            mpath,
            format!(
                "files.experts is {} bytes, {count} records of {} bytes need {needed}",
                m.files.experts, e.record_stride
            ),
        ));
    }
    check_records(m, mpath, cfg)?;
    let total = (count as u64)
        .checked_mul(e.payload_bytes)
        .ok_or_else(|| Error::format(mpath, "expert payload total overflows"))?;
    Ok((count, total))
}

/// Every record is the (layer, expert) its position says, once, where the layout puts it.
fn check_records(m: &Manifest, mpath: &Path, cfg: &ModelConfig) -> Result<()> {
    let e = &m.experts;
    let mut seen = HashSet::new();
    let moe_layers: Vec<usize> = cfg.moe_layers().collect();
    for (n, r) in e.records.iter().enumerate() {
        let (layer, expert) = (moe_layers[n / cfg.num_experts], n % cfg.num_experts);
        let what = format!("expert record {n} (layer {}, expert {})", r.layer, r.expert);
        if !seen.insert((r.layer, r.expert)) {
            return Err(Error::format(mpath, format!("{what} appears more than once")));
        }
        if (r.layer, r.expert) != (layer, expert) {
            return Err(Error::format(
                mpath,
                format!("{what} is out of place: position {n} holds layer {layer} expert {expert}"),
            ));
        }
        let want_offset = (n as u64).checked_mul(e.record_stride);
        if Some(r.offset) != want_offset || r.bytes != e.payload_bytes {
            return Err(Error::format(
                mpath,
                format!(
                    "{what} is at offset {} with {} bytes; the layout puts it at {} with {}",
                    r.offset,
                    r.bytes,
                    want_offset.map_or("an overflowing offset".into(), |o| o.to_string()),
                    e.payload_bytes
                ),
            ));
        }
        if !is_hash_hex(&r.hash) {
            return Err(Error::format(
                mpath,
                format!("{what}: hash {:?} is not 64 lower-case hex digits", r.hash),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_64_lower_case_hex_digits() {
        assert!(is_hash_hex(&"0123456789abcdef".repeat(4)));
        assert!(!is_hash_hex(&"0123456789ABCDEF".repeat(4)));
        assert!(!is_hash_hex(&"0".repeat(63)));
        assert!(!is_hash_hex(&"g".repeat(64)));
        assert!(!is_hash_hex(""));
    }

    #[test]
    fn part_sizes_that_overflow_are_none() {
        let huge = [usize::MAX, usize::MAX];
        assert_eq!(checked_part_bytes(&huge, WeightFormat::F32, "data"), None);
        assert_eq!(checked_part_bytes(&huge, WeightFormat::Int8Row, "codes"), None);
        assert_eq!(checked_part_bytes(&huge, WeightFormat::Int4Gs64, "scales"), None);
        assert_eq!(checked_part_bytes(&[3, 100], WeightFormat::Int4Gs64, "codes"), Some(3 * 64));
        assert_eq!(checked_part_bytes(&[3, 64], WeightFormat::Mxfp4, "scales"), Some(3 * 2));
        assert_eq!(checked_part_bytes(&[7], WeightFormat::F32, "data"), Some(28));
        assert_eq!(checked_part_bytes(&[7], WeightFormat::F32, "codes"), None);
    }
}
