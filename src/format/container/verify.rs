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

/// Bytes read and hashed at a time.
const VERIFY_CHUNK: usize = 16 << 20;

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
    // One buffer for the whole run: parts are hashed in chunks of at most this size, so the
    // memory used does not grow with the largest tensor (the head is over half a GB).
    let mut buf = vec![0u8; (VERIFY_CHUNK as u64).min(total) as usize];
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
        let mut hasher = blake3::Hasher::new();
        let mut done = 0u64;
        let mut failure = None;
        while done < bytes {
            let n = (bytes - done).min(buf.len() as u64) as usize;
            if let Err(e) = read_exact_at(f, &mut buf[..n], offset + done) {
                failure = Some(format!("cannot read {bytes} bytes at {offset} of {file}: {e}"));
                break;
            }
            hasher.update(&buf[..n]);
            done += n as u64;
        }
        let outcome = failure.or_else(|| {
            let got = hasher.finalize().to_hex().to_string();
            (got != hash).then(|| format!("hash {got} does not match the manifest's {hash}"))
        });
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
