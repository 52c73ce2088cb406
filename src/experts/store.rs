//! The expert store on disk: one flat file of 4 KiB-aligned records, one positioned read
//! per expert, straight into an aligned buffer that the expert's matrices then view.
//!
//! With direct I/O (`O_DIRECT` on Linux, `F_NOCACHE` on macOS, `FILE_FLAG_NO_BUFFERING`
//! on Windows) reads bypass the page cache, which otherwise holds a second copy of every
//! expert and competes with the RAM cache for memory. Where the file system refuses it,
//! the store falls back to buffered reads and says so once.
//!
//! Every record read is checked against its BLAKE3 hash from the manifest, on the reader
//! thread that read it, before any matrix views it: a flipped bit on disk is an error
//! naming the layer and expert, never different tokens. The check also covers a NaN or
//! infinity written over a scale; the INT4 scales and the biases are in addition tested for
//! finiteness as the record is decoded.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::manifest::{Component, Dtype, ExpertStoreInfo};
use crate::format::container::reader::first_non_finite_f32;
use crate::io::read_exact_at;

/// Bytes of a record read (and hashed) at a time when reads are checked: a multiple of 4 KiB
/// (direct I/O), large enough to keep the disk's requests big.
pub const HASHED_READ_CHUNK: usize = 2 << 20;
use crate::experts::readers::RecordPlan;
use crate::model::weights::ExpertWeights;
use crate::quant::buffer::ByteRegion;
use crate::quant::format::WeightFormat;
use crate::quant::{Matrix, WeightBuf};

/// Reads expert records from a container's expert file.
pub struct ExpertStore {
    path: PathBuf,
    file: File,
    /// The same file opened for direct I/O, while that works.
    direct: Option<File>,
    direct_failed: AtomicBool,
    info: ExpertStoreInfo,
    /// The storage format of both matrices, from the scheme and the first component.
    format: WeightFormat,
    cfg: Arc<ModelConfig>,
    /// Each record's expected BLAKE3, in record order.
    hashes: Vec<blake3::Hash>,
    /// Check each record read against its hash.
    verify_reads: bool,
    /// What the user should do about a damaged record (appended to the error).
    repair: String,
}

impl ExpertStore {
    /// Opens `dir/<info.file>` for buffered reads. The layout has already been checked
    /// against the config.
    pub fn open(dir: &Path, info: &ExpertStoreInfo, cfg: Arc<ModelConfig>) -> Result<Self> {
        Self::open_with(dir, info, cfg, false)
    }

    /// Opens the store, with direct I/O if `direct` and the platform and file system allow
    /// it (else buffered, with one log line saying why). Every read is checked against the
    /// record's hash unless [`set_verify_reads`](Self::set_verify_reads) turns that off.
    pub fn open_with(
        dir: &Path,
        info: &ExpertStoreInfo,
        cfg: Arc<ModelConfig>,
        direct: bool,
    ) -> Result<Self> {
        let path = dir.join(&info.file);
        let format = check_info(&path, info, &cfg)?;
        let hashes = parse_hashes(&path, info)?;
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let direct = if direct {
            match open_direct(&path) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::info!(
                        "direct I/O unavailable for {} ({e}); reading through the page cache",
                        path.display()
                    );
                    None
                }
            }
        } else {
            None
        };
        let repair = format!(
            "run `picchio verify {}` to list the damage, then convert the source again into a new directory",
            dir.display()
        );
        Ok(ExpertStore {
            path,
            file,
            direct,
            direct_failed: AtomicBool::new(false),
            info: info.clone(),
            format,
            cfg,
            hashes,
            verify_reads: true,
            repair,
        })
    }

    /// Whether each record read is checked against its hash (on by default). Turning it off
    /// saves one BLAKE3 pass over every record read, on the reader threads; a damaged record
    /// then computes with whatever bytes it holds.
    pub fn set_verify_reads(&mut self, on: bool) {
        self.verify_reads = on;
    }

    /// Replaces the advice given when a record fails its hash (e.g. for a cached conversion:
    /// delete it to have it rebuilt).
    pub fn set_repair_advice(&mut self, advice: impl Into<String>) {
        self.repair = advice.into();
    }

    /// Whether reads currently bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some() && !self.direct_failed.load(Ordering::Relaxed)
    }

    /// The expert file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads `buf.len()` bytes (a multiple of 4 KiB into a 4 KiB-aligned buffer) at `offset`
    /// (4 KiB-aligned), directly when possible.
    pub fn read_raw(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if let Some(f) = &self.direct
            && !self.direct_failed.load(Ordering::Relaxed)
        {
            match read_exact_at(f, buf, offset) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                    if !self.direct_failed.swap(true, Ordering::Relaxed) {
                        tracing::info!(
                            "direct I/O refused by the file system for {} ({e}); reading through the page cache",
                            self.path.display()
                        );
                    }
                }
                Err(e) => return Err(e),
            }
        }
        read_exact_at(&self.file, buf, offset)
    }

    /// Reads `buf` at `offset` as [`read_raw`](Self::read_raw) does, and returns the BLAKE3
    /// hash of its first `payload` bytes. The read goes in chunks of [`HASHED_READ_CHUNK`],
    /// each hashed on a second thread while the next is read, so the hash is ready about one
    /// chunk's hashing after the last byte arrives instead of a whole record's (2-3 ms for a
    /// GPT-OSS record at 5 GB/s) later.
    fn read_hashed(&self, buf: &mut [u8], offset: u64, payload: usize) -> std::io::Result<blake3::Hash> {
        let (tx, rx) = std::sync::mpsc::channel::<&[u8]>();
        std::thread::scope(|scope| {
            let hasher = scope.spawn(move || {
                let mut h = blake3::Hasher::new();
                let mut left = payload;
                for chunk in rx {
                    let n = chunk.len().min(left);
                    h.update(&chunk[..n]);
                    left -= n;
                }
                h.finalize()
            });
            let read = (|| {
                let mut rest = buf;
                let mut at = offset;
                while !rest.is_empty() {
                    let n = rest.len().min(HASHED_READ_CHUNK);
                    let (chunk, tail) = rest.split_at_mut(n);
                    self.read_raw(chunk, at)?;
                    // The hasher only stops early if it panicked, which `join` reports below.
                    let _ = tx.send(chunk);
                    rest = tail;
                    at += n as u64;
                }
                Ok(())
            })();
            // Closing the channel ends the hasher, also after a failed read.
            drop(tx);
            let hash = hasher.join().map_err(|_| std::io::Error::other("the record hasher panicked"));
            read.and(hash)
        })
    }

    /// Bytes one read moves, and one expert occupies in memory once read (the payload
    /// rounded up to 4 KiB).
    pub fn read_bytes(&self) -> u64 {
        self.info.record_bytes()
    }

    /// Experts per layer.
    pub fn num_experts(&self) -> usize {
        self.cfg.num_experts
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.cfg.num_layers
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.info.records.len()
    }

    /// True when the store holds no experts.
    pub fn is_empty(&self) -> bool {
        self.info.records.is_empty()
    }

    /// Where the record of `expert` in `layer` lies and what its check covers, for readers
    /// that read it in pieces ([`crate::experts::readers`]).
    pub fn plan(&self, layer: usize, expert: usize) -> Result<RecordPlan> {
        let index = self.cfg.expert_record(layer, expert);
        let Some(rec) = index.and_then(|n| self.info.records.get(n)) else {
            return Err(Error::invalid(format!("no expert {expert} in layer {layer}")));
        };
        let len = usize::try_from(self.read_bytes())
            .map_err(|_| Error::format(&self.path, "expert records are too large for this machine"))?;
        let hashed = if self.verify_reads {
            let payload = usize::try_from(rec.bytes).ok().filter(|&b| b <= len).ok_or_else(|| {
                Error::format(
                    &self.path,
                    format!("layer {layer} expert {expert}: payload exceeds its record"),
                )
            })?;
            Some(payload)
        } else {
            None
        };
        Ok(RecordPlan { key: (layer, expert), offset: rec.offset, len, hashed })
    }

    /// The error for a failed read of `plan`'s record, naming it and its offset.
    pub fn read_error(&self, plan: &RecordPlan, e: std::io::Error) -> Error {
        let (layer, expert) = plan.key;
        Error::format(
            &self.path,
            format!("reading layer {layer} expert {expert} at offset {}: {e}", plan.offset),
        )
    }

    /// Checks a record read by `plan` against its manifest hash (`got`: the hash of its
    /// payload, `None` when reads are not checked) and decodes it into the expert's matrices,
    /// which view `buf`.
    pub fn finish<B>(&self, plan: &RecordPlan, buf: B, got: Option<blake3::Hash>) -> Result<ExpertWeights>
    where
        B: ByteRegion + 'static,
    {
        let (layer, expert) = plan.key;
        if plan.hashed.is_some() {
            let want = self.cfg.expert_record(layer, expert).and_then(|n| self.hashes.get(n));
            if got.is_none() || got.as_ref() != want {
                return Err(Error::format(
                    &self.path,
                    format!(
                        "layer {layer} expert {expert}: the record at offset {} fails its BLAKE3 check \
                         (the file was damaged or changed after conversion); {}",
                        plan.offset, self.repair
                    ),
                ));
            }
        }
        let region: Arc<dyn ByteRegion> = Arc::new(buf);
        self.decode(&region, layer, expert)
    }

    /// Reads and decodes the record of `expert` in `layer` into `buf` (4 KiB-aligned, at
    /// least [`read_bytes`](Self::read_bytes) long; its old contents are overwritten), which
    /// the expert's matrices then view. One caller reads the whole record; the RAM cache
    /// instead splits records across its readers ([`crate::experts::readers`]).
    pub fn read_into<B>(&self, layer: usize, expert: usize, mut buf: B) -> Result<ExpertWeights>
    where
        B: ByteRegion + AsMut<[u8]> + 'static,
    {
        let plan = self.plan(layer, expert)?;
        let dst = buf.as_mut();
        if dst.len() < plan.len {
            return Err(Error::invalid(format!(
                "a {}-byte buffer cannot hold a {}-byte expert record",
                dst.len(),
                plan.len
            )));
        }
        let got = match plan.hashed {
            None => {
                self.read_raw(&mut dst[..plan.len], plan.offset).map_err(|e| self.read_error(&plan, e))?;
                None
            }
            Some(payload) => Some(
                self.read_hashed(&mut dst[..plan.len], plan.offset, payload)
                    .map_err(|e| self.read_error(&plan, e))?,
            ),
        };
        self.finish(&plan, buf, got)
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
        let non_finite = |what: String, i: usize| {
            Error::format(
                &self.path,
                format!("{name}: {what} holds a NaN or infinity at element {i}; {}", self.repair),
            )
        };
        let matrix = |m: &str, rows: usize, cols: usize| -> Result<Matrix> {
            let range = |role: &str| Ok(view(comp(&format!("{m}.{role}"))?));
            let data = self.format.matrix_data(region, &range)?;
            if let Some((role, i)) = data.first_bad_scale() {
                return Err(non_finite(format!("{m}.{role}"), i));
            }
            Matrix::new(&format!("{name} {m}"), rows, cols, data)
        };
        let bias = |m: &str| -> Result<Vec<f32>> {
            let (o, b) = view(comp(&format!("{m}.bias"))?);
            let v = WeightBuf::<f32>::shared(region, o, b).as_slice().to_vec();
            match first_non_finite_f32(&v) {
                Some(i) => Err(non_finite(format!("{m}.bias"), i)),
                None => Ok(v),
            }
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

/// The few facts about the layout that reads rely on (the full validation is
/// `Manifest::validate`; a store may also be opened from a hand-made description): one
/// record per expert of each MoE layer, each payload inside its record, each component inside the payload, a
/// scheme that names a weight format. Returns that format.
fn check_info(path: &Path, info: &ExpertStoreInfo, cfg: &ModelConfig) -> Result<WeightFormat> {
    let bad = |what: String| Err(Error::format(path, format!("expert store layout: {what}")));
    if cfg.num_expert_records() != info.records.len() {
        return bad(format!(
            "{} records for {} MoE layers x {} experts",
            info.records.len(),
            cfg.moe_layers().count(),
            cfg.num_experts
        ));
    }
    if info.payload_bytes > info.record_bytes() || usize::try_from(info.record_bytes()).is_err() {
        return bad(format!("payload of {} bytes does not fit a record", info.payload_bytes));
    }
    if let Some(c) =
        info.components.iter().find(|c| c.offset.checked_add(c.bytes).is_none_or(|e| e > info.payload_bytes))
    {
        return bad(format!(
            "component `{}` ({} bytes at {}) lies outside the payload",
            c.name, c.bytes, c.offset
        ));
    }
    if let Some(r) = info.records.iter().find(|r| r.bytes != info.payload_bytes) {
        return bad(format!(
            "layer {} expert {} has {} payload bytes, not {}",
            r.layer, r.expert, r.bytes, info.payload_bytes
        ));
    }
    let first = info.components.first().map(|c| c.dtype);
    let Some(format) = WeightFormat::from_stored(info.scheme, first) else {
        return bad(format!("scheme {:?} with {first:?} components is no weight format", info.scheme));
    };
    // Every component a matrix view needs has the format's element type and is a whole
    // number of those elements (a view over it could not be built otherwise).
    for m in ["gate_up", "down"] {
        let wanted = format.parts().iter().map(|p| (format!("{m}.{}", p.role), p.dtype));
        for (n, dtype) in wanted.chain([(format!("{m}.bias"), Dtype::F32)]) {
            match info.components.iter().find(|c| c.name == n) {
                Some(c) if c.dtype == dtype && c.bytes.is_multiple_of(dtype.size()) => {}
                Some(c) => {
                    return bad(format!(
                        "component `{n}` is {:?} of {} bytes, expected {dtype:?}",
                        c.dtype, c.bytes
                    ));
                }
                None => return bad(format!("no `{n}` component")),
            }
        }
    }
    Ok(format)
}

/// Each record's hash, parsed once so that a read compares 32 bytes.
fn parse_hashes(path: &Path, info: &ExpertStoreInfo) -> Result<Vec<blake3::Hash>> {
    info.records
        .iter()
        .map(|r| {
            blake3::Hash::from_hex(&r.hash).map_err(|e| {
                Error::format(
                    path,
                    format!(
                        "layer {} expert {}: manifest hash {:?} is not valid: {e}",
                        r.layer, r.expert, r.hash
                    ),
                )
            })
        })
        .collect()
}

/// Opens `path` read-only bypassing the page cache.
#[cfg(target_os = "linux")]
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)
}

/// Opens `path` read-only bypassing the page cache.
#[cfg(target_os = "macos")]
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    use std::os::unix::io::AsRawFd;
    let f = File::open(path)?;
    // SAFETY: fcntl on a valid descriptor with an integer argument.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f)
}

/// Opens `path` read-only bypassing the page cache.
#[cfg(windows)]
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    use std::os::windows::fs::OpenOptionsExt;
    const FILE_FLAG_NO_BUFFERING: u32 = 0x2000_0000;
    std::fs::OpenOptions::new().read(true).custom_flags(FILE_FLAG_NO_BUFFERING).open(path)
}

/// Opens `path` read-only bypassing the page cache.
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
pub fn open_direct(_path: &Path) -> std::io::Result<File> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "no direct I/O on this platform"))
}
