//! `picchio verify`: re-hashes every stored part and expert record of a container and
//! reports each one whose bytes no longer match the manifest.

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::container::manifest::Manifest;
use crate::io::read_exact_at;

/// One mismatch found by [`verify`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// What failed: `tensor <name> part <role>` or `expert layer L expert E`.
    pub what: String,
    /// Why: a hash mismatch or a read error.
    pub reason: String,
}

/// The outcome of verifying a container.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    /// Parts and records checked.
    pub checked: usize,
    /// Bytes hashed.
    pub bytes: u64,
    /// Everything that did not match.
    pub mismatches: Vec<Mismatch>,
}

/// Re-hashes every part and record of the container in `dir`. `progress` is called with
/// the bytes hashed so far and the total.
pub fn verify(dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
    let m = Manifest::read(dir)?;
    let total = m.tensors.iter().flat_map(|t| &t.parts).map(|p| p.bytes).sum::<u64>()
        + m.experts.records.iter().map(|r| r.bytes).sum::<u64>();
    let mut report = VerifyReport::default();
    let open = |name: &str| -> Result<File> {
        let p = dir.join(name);
        File::open(&p).map_err(|e| Error::io(&p, e))
    };
    let mut files = std::collections::HashMap::new();
    let mut check = |file: &str,
                     offset: u64,
                     bytes: u64,
                     hash: &str,
                     what: String,
                     report: &mut VerifyReport|
     -> Result<()> {
        if !files.contains_key(file) {
            files.insert(file.to_string(), open(file)?);
        }
        let f = &files[file];
        let mut buf = vec![0u8; bytes as usize];
        let outcome = match read_exact_at(f, &mut buf, offset) {
            Ok(()) => {
                let got = blake3::hash(&buf).to_hex().to_string();
                (got != hash).then(|| format!("hash {got} does not match the manifest's {hash}"))
            }
            Err(e) => Some(format!("cannot read {bytes} bytes at {offset} of {file}: {e}")),
        };
        if let Some(reason) = outcome {
            report.mismatches.push(Mismatch { what, reason });
        }
        report.checked += 1;
        report.bytes += bytes;
        Ok(())
    };
    for t in &m.tensors {
        for p in &t.parts {
            check(
                &p.file,
                p.offset,
                p.bytes,
                &p.hash,
                format!("tensor {} part {}", t.name, p.role),
                &mut report,
            )?;
            progress(report.bytes, total);
        }
    }
    for r in &m.experts.records {
        let what = format!("expert layer {} expert {}", r.layer, r.expert);
        check(&m.experts.file, r.offset, r.bytes, &r.hash, what, &mut report)?;
        progress(report.bytes, total);
    }
    Ok(report)
}
