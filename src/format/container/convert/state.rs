//! The progress record of a running conversion (`convert.state.json`): the plan it belongs
//! to, the finished items with the hashes of what they wrote, and the finished steps (row
//! chunks of a dense tensor, or experts of a layer) of at most one item in progress.
//!
//! Nothing in it is trusted on resume: every hash it claims is compared with the bytes
//! actually in the output files before the work is built on (see [`recheck`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::io::{read_exact_at, write_all_at};

/// The progress record kept beside a running conversion.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// Hash of the layout, formats and source identity this state belongs to.
    pub plan: String,
    /// Finished items and the hashes of what they wrote (one per part or record).
    pub done: BTreeMap<String, Vec<String>>,
    /// The finished steps of an item not yet done.
    #[serde(default)]
    pub partial: Option<Partial>,
}

/// The finished steps of one item, in order.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Partial {
    /// The item's key (`dense:NAME` or `experts:LAYER`).
    pub key: String,
    /// Consecutive steps from the start of the item.
    pub steps: Vec<Step>,
}

/// One finished step: units (rows of a dense tensor, experts of a layer) from the end of
/// the previous step up to `end`, and the hashes of the bytes they wrote.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Step {
    /// One past the last unit of the step.
    pub end: usize,
    /// Dense: one hash per part, of the step's rows of that part. Experts: one hash per
    /// record.
    pub hashes: Vec<String>,
}

/// What was found at the state path.
pub enum Loaded {
    /// No state file.
    Absent,
    /// A state file that cannot be read or parsed, and why.
    Unreadable(String),
    /// A parsed state.
    Found(State),
}

/// Reads the state file at `path`.
pub fn load(path: &Path) -> Loaded {
    match std::fs::read(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Loaded::Absent,
        Err(e) => Loaded::Unreadable(format!("cannot be read ({e})")),
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(s) => Loaded::Found(s),
            Err(e) => Loaded::Unreadable(format!("does not parse ({e})")),
        },
    }
}

/// A byte range of an output file.
#[derive(Clone, Copy, Debug)]
pub struct Region<'a> {
    /// The open output file.
    pub file: &'a File,
    /// Its path, for errors.
    pub path: &'a Path,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range.
    pub len: u64,
}

/// Where an item's units lie in the output files.
pub trait Regions {
    /// How many units (rows or experts) the item `key` has, or `None` for an unknown key.
    fn units(&self, key: &str) -> Option<usize>;
    /// The regions written by units `start..end` of item `key`, in hash order.
    fn regions(&self, key: &str, start: usize, end: usize) -> Vec<Region<'_>>;
}

/// Bytes read at a time when re-hashing written output.
const HASH_CHUNK: u64 = 16 << 20;

/// BLAKE3 of a region, read back from its file.
pub fn hash_region(r: &Region<'_>) -> Result<String> {
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; r.len.min(HASH_CHUNK) as usize];
    let mut done = 0u64;
    while done < r.len {
        let n = (r.len - done).min(HASH_CHUNK) as usize;
        read_exact_at(r.file, &mut buf[..n], r.offset + done).map_err(|e| {
            Error::format(r.path, format!("re-reading {n} bytes at {}: {e}", r.offset + done))
        })?;
        h.update(&buf[..n]);
        done += n as u64;
    }
    Ok(h.finalize().to_hex().to_string())
}

/// Whether the regions of units `start..end` of `key` hold bytes with exactly `hashes`.
fn matches(layout: &dyn Regions, key: &str, start: usize, end: usize, hashes: &[String]) -> Result<bool> {
    let regions = layout.regions(key, start, end);
    if regions.len() != hashes.len() {
        return Ok(false);
    }
    for (r, h) in regions.iter().zip(hashes) {
        if hash_region(r)? != *h {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What [`recheck`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recheck {
    /// Items claimed done whose bytes matched.
    pub kept: usize,
    /// Items claimed done whose bytes did not match (or were not theirs): to be redone.
    pub redone: usize,
    /// Finished steps of the item in progress whose bytes matched.
    pub kept_steps: usize,
    /// Steps claimed for the item in progress that did not match, with every later one.
    pub dropped_steps: usize,
}

/// Compares everything `state` claims with the written bytes: a done item stays done only
/// if every part or record it lists hashes as recorded; of the item in progress, only the
/// leading steps that match are kept. Unknown keys are dropped.
pub fn recheck(state: &mut State, layout: &dyn Regions) -> Result<Recheck> {
    let mut r = Recheck::default();
    let mut bad = Vec::new();
    for (key, hashes) in &state.done {
        let ok = match layout.units(key) {
            Some(units) => matches(layout, key, 0, units, hashes)?,
            None => false,
        };
        if ok {
            r.kept += 1;
        } else {
            bad.push(key.clone());
        }
    }
    r.redone = bad.len();
    for key in bad {
        state.done.remove(&key);
    }
    if let Some(p) = &mut state.partial {
        let units = if state.done.contains_key(&p.key) { None } else { layout.units(&p.key) };
        let mut keep = 0;
        if let Some(units) = units {
            let mut start = 0;
            for step in &p.steps {
                if step.end <= start
                    || step.end > units
                    || !matches(layout, &p.key, start, step.end, &step.hashes)?
                {
                    break;
                }
                start = step.end;
                keep += 1;
            }
        }
        r.kept_steps = keep;
        r.dropped_steps = p.steps.len() - keep;
        p.steps.truncate(keep);
        if keep == 0 {
            state.partial = None;
        }
    }
    Ok(r)
}

/// The temporary a file is written to before it is renamed into place.
pub fn temporary(path: &Path) -> std::path::PathBuf {
    path.with_extension("tmp")
}

/// Writes `bytes` to `path` via a synced temporary file and a rename, so readers see
/// either the old or the new content; a temporary left by a kill is simply overwritten.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temporary(path);
    {
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        write_all_at(&f, bytes, 0).map_err(|e| Error::io(&tmp, e))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Writes the state file.
pub fn save(path: &Path, state: &State) -> Result<()> {
    write_atomically(
        path,
        &serde_json::to_vec(state).expect("the state serializes: plain strings and numbers"),
    )
}
