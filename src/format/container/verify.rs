//! `picchio verify`: runs the loader's validation of a container, then re-hashes every
//! stored part and expert record and reports each one whose bytes no longer match the
//! manifest.

use std::fs::File;
use std::path::Path;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::manifest::{DENSE_FILE, EXPERTS_FILE, Manifest};
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

/// Validates the container in `dir` exactly as the loader does (header, config, layout,
/// file kinds and sizes: see [`Manifest::validate`]), failing with the first problem, then
/// re-hashes every part and record and reports each one whose bytes do not match.
/// `progress` is called with the bytes hashed so far and the total.
pub fn verify(dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
    let m = Manifest::read(dir)?;
    let cfg = ModelConfig::from_dir(dir)?;
    let layout = m.validate(dir, &cfg)?;
    let total = layout.hashed_bytes;
    let mut report = VerifyReport::default();
    let open = |name: &str| -> Result<File> {
        let p = dir.join(name);
        File::open(&p).map_err(|e| Error::io(&p, e))
    };
    // Validation allows parts in these two files only.
    let dense = open(DENSE_FILE)?;
    let experts = open(EXPERTS_FILE)?;
    // One buffer for the whole run: parts are hashed in chunks of at most this size, so the
    // memory used does not grow with the largest tensor (the head is over half a GB).
    let mut buf = vec![0u8; (VERIFY_CHUNK as u64).min(total) as usize];
    let mut check = |file: &File, name: &str, offset: u64, bytes: u64, hash: &str, what: String| {
        let outcome = match hash_range(file, offset, bytes, &mut buf) {
            Err(e) => Some(format!("cannot read {bytes} bytes at {offset} of {name}: {e}")),
            Ok(got) => (got != hash).then(|| format!("hash {got} does not match the manifest's {hash}")),
        };
        if let Some(reason) = outcome {
            report.mismatches.push(Mismatch { what, reason });
        }
        report.checked += 1;
        // Cannot overflow: validation summed the same byte counts with checked arithmetic.
        report.bytes += bytes;
        progress(report.bytes, total);
    };
    for t in &m.tensors {
        for p in &t.parts {
            let what = format!("tensor {} part {}", t.name, p.role);
            check(&dense, DENSE_FILE, p.offset, p.bytes, &p.hash, what);
        }
    }
    for r in &m.experts.records {
        let what = format!("expert layer {} expert {}", r.layer, r.expert);
        check(&experts, EXPERTS_FILE, r.offset, r.bytes, &r.hash, what);
    }
    Ok(report)
}

/// Hex BLAKE3 of `bytes` bytes of `file` at `offset`, read in chunks of `buf.len()`.
fn hash_range(file: &File, offset: u64, bytes: u64, buf: &mut [u8]) -> std::io::Result<String> {
    let mut hasher = blake3::Hasher::new();
    let mut done = 0u64;
    while done < bytes {
        let n = (bytes - done).min(buf.len() as u64) as usize;
        let at = offset
            .checked_add(done)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "offset overflows"))?;
        read_exact_at(file, &mut buf[..n], at)?;
        hasher.update(&buf[..n]);
        done += n as u64;
    }
    Ok(hasher.finalize().to_hex().to_string())
}
