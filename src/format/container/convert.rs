//! `picchio convert`: a Hugging Face checkpoint to a Picchio container, streaming.
//!
//! Before anything is written, the output is checked not to be, contain or alias the
//! source ([`guard::check_not_aliased`]), and locked so no second conversion writes it
//! ([`guard::OutputLock`]). The whole layout is computed first, so every tensor and every
//! expert record has a fixed place in the output files. Work items (one dense tensor, or
//! all experts of one layer) are then converted in source order, each in bounded memory
//! (row chunks of at most [`CHUNK_BYTES`], one expert at a time), every value checked to be
//! finite, written with positioned writes and synced. A state file lists the finished
//! items, and the finished chunks or experts of the item in progress, so an interrupted
//! run resumes where it stopped, after re-hashing what the state claims against the
//! written bytes; `manifest.json` is written last and atomically, so a partial container
//! is never taken for a complete one.

mod guard;
mod state;

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Instant, UNIX_EPOCH};

use half::{bf16, f16};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use safetensors::Dtype as SrcDtype;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::container::layout::{Formats, plan_dense, plan_experts};
use crate::format::container::manifest::{
    self, DENSE_FILE, EXPERTS_FILE, ExpertStoreInfo, FileSizes, MANIFEST_FILE, Manifest, SourceInfo,
    TensorRecord, hash_hex,
};
use crate::format::hf::{
    ExpertLayout, check_checkpoint, check_finite, check_finite_bytes, dequantized_position, expert_layout,
    mxfp4_error, position,
};
use crate::format::safetensors::{Checkpoint, INDEX_FILE, SINGLE_FILE, TensorEntry, decode_floats};
use crate::io::{read_exact_at, write_all_at};
use crate::model::names;
use crate::quant::format::WeightFormat;
use crate::quant::mxfp4;
use crate::quant::{int4, int8};

pub use guard::LOCK_FILE;
use state::{Loaded, Partial, Region, Regions, State, Step, hash_region, temporary, write_atomically};

/// Largest slice of a dense tensor held in memory at once.
pub const CHUNK_BYTES: usize = 64 << 20;
/// File recording finished work items while a conversion runs.
pub const STATE_FILE: &str = "convert.state.json";

/// Options of a conversion.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Output formats.
    pub formats: Formats,
    /// Draw a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    /// Stop with an error after this many items, as an interruption would (for tests of
    /// resumption).
    #[doc(hidden)]
    pub interrupt_after: Option<usize>,
}

/// Test hooks of a conversion: smaller chunks and interruptions inside an item.
#[doc(hidden)]
#[derive(Clone, Debug, Default)]
pub struct ConvertHooks {
    /// Source bytes per dense chunk, and expert bytes between progress saves, instead of
    /// [`CHUNK_BYTES`].
    pub chunk_bytes: Option<usize>,
    /// Stop with an error right after this many mid-item progress saves of this run, as an
    /// interruption inside a long item would.
    pub interrupt_after_chunks: Option<usize>,
}

/// What a conversion did.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    /// The container directory.
    pub out: PathBuf,
    /// Items converted by this run.
    pub converted: usize,
    /// Items found already done (resumed run), their bytes re-checked.
    pub resumed: usize,
    /// Items the state claimed done whose written bytes did not match: converted again.
    pub redone: usize,
    /// Finished chunks or experts of a part-done item that a resumed run kept (re-checked).
    pub resumed_steps: usize,
    /// Source bytes read by this run.
    pub bytes_read: u64,
    /// Bytes of the container (dense + experts).
    pub bytes_written: u64,
    /// Wall time of this run.
    pub seconds: f64,
    /// Peak resident memory of the process, if known.
    pub peak_rss: Option<u64>,
}

/// A unit of conversion work.
#[derive(Clone, Debug)]
enum Item {
    /// Dense tensor `index` of the plan.
    Dense(usize),
    /// Every expert of a layer.
    Experts(usize),
}

impl Item {
    fn key(&self, plan: &[TensorRecord]) -> String {
        match self {
            Item::Dense(i) => format!("dense:{}", plan[*i].name),
            Item::Experts(l) => format!("experts:{l}"),
        }
    }
}

/// Copies the tokenizer side files of a Hugging Face release (`tokenizer.json`,
/// `tokenizer_config.json`, `generation_config.json`) that `src` has into the container, so
/// a ChatML model finds its tokenizer next to the container's `config.json`.
fn copy_tokenizer_files(src: &Path, out: &Path) -> Result<()> {
    for name in crate::chat::TOKENIZER_FILES {
        let from = src.join(name);
        if from.is_file() {
            std::fs::copy(&from, out.join(name)).map_err(|e| Error::io(&from, e))?;
        }
    }
    Ok(())
}

/// A stable identity of a source checkpoint: its config, index and every shard's name,
/// size and modification time. A changed source gets a new identity.
pub fn source_identity(src: &Path) -> Result<String> {
    let mut h = blake3::Hasher::new();
    for name in ["config.json", INDEX_FILE] {
        let p = src.join(name);
        if p.exists() {
            h.update(name.as_bytes());
            h.update(&std::fs::read(&p).map_err(|e| Error::io(&p, e))?);
        }
    }
    let mut shards: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(|e| Error::io(src, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    for p in shards {
        let meta = std::fs::metadata(&p).map_err(|e| Error::io(&p, e))?;
        let mtime =
            meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        h.update(p.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(&meta.len().to_le_bytes());
        h.update(&mtime.to_le_bytes());
    }
    Ok(h.finalize().to_hex().to_string())
}

/// Converts the checkpoint in `src` into a container in `out`.
pub fn convert(src: &Path, out: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    convert_with_hooks(src, out, opts, &ConvertHooks::default())
}

/// [`convert`] with test hooks.
#[doc(hidden)]
pub fn convert_with_hooks(
    src: &Path,
    out: &Path,
    opts: &ConvertOptions,
    hooks: &ConvertHooks,
) -> Result<ConvertReport> {
    let started = Instant::now();
    let cfg = ModelConfig::from_dir(src)?;
    let ck = Checkpoint::open(src)?;
    let layout = expert_layout(&ck, &cfg)?;
    check_checkpoint(&ck, &cfg, layout)?;
    let formats =
        opts.formats.resolve(layout == ExpertLayout::Mxfp4).map_err(|why| Error::format(src, why))?;
    let expert_format = formats.experts.weight_format().expect("resolved formats name an expert format");
    // From here on, `out` is the resolved path: nothing is created through a `..`.
    let out = &guard::check_not_aliased(src, out)?;

    let is_bf16 = |name: &str| ck.get(name).is_some_and(|t| t.dtype == SrcDtype::BF16);
    let (mut dense, dense_bytes) = plan_dense(&cfg, formats, is_bf16);
    let (mut experts, experts_bytes) = plan_experts(&cfg, expert_format);
    let identity = source_identity(src)?;
    let plan_id = {
        let mut h = blake3::Hasher::new();
        h.update(identity.as_bytes());
        h.update(&serde_json::to_vec(&(&dense, &experts, formats)).expect("plan serializes"));
        h.finalize().to_hex().to_string()
    };

    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let _lock = guard::OutputLock::acquire(out)?;
    remove_stale_temporaries(out)?;
    if let Some(report) = already_converted(out, &identity, formats, started)? {
        return Ok(report);
    }
    let state_path = out.join(STATE_FILE);
    let (mut state, resuming) = load_state(&state_path, &plan_id, out);

    let (dense_path, experts_path) = (out.join(DENSE_FILE), out.join(EXPERTS_FILE));
    let dense_file = open_output(&dense_path, dense_bytes, resuming)?;
    let experts_file = open_output(&experts_path, experts_bytes, resuming)?;
    let cfg_src = src.join("config.json");
    std::fs::copy(&cfg_src, out.join("config.json")).map_err(|e| Error::io(&cfg_src, e))?;
    copy_tokenizer_files(src, out)?;

    let reader = SourceReader::open(&ck)?;
    let items = ordered_items(&ck, &cfg, &dense, layout);
    let outputs = Outputs {
        dense: &dense,
        experts: &experts,
        cfg: &cfg,
        dense_file: &dense_file,
        dense_path: &dense_path,
        experts_file: &experts_file,
        experts_path: &experts_path,
    };
    let checked = if resuming { recheck(&mut state, &outputs, out)? } else { state::Recheck::default() };
    let total: u64 = items.iter().map(|it| item_source_bytes(&ck, &cfg, &dense, layout, it)).sum();
    let done_bytes: u64 = items
        .iter()
        .filter(|it| state.done.contains_key(&it.key(&dense)))
        .map(|it| item_source_bytes(&ck, &cfg, &dense, layout, it))
        .sum();
    let bar = progress_bar(opts.progress, total, done_bytes);
    let chunk_bytes = hooks.chunk_bytes.unwrap_or(CHUNK_BYTES).max(1);
    let (mut converted, mut resumed, mut bytes_read, mut saves) = (0, 0, 0u64, 0usize);
    for item in &items {
        if opts.interrupt_after == Some(converted) {
            return Err(Error::invalid(format!("conversion interrupted after {converted} items")));
        }
        let key = item.key(&dense);
        if state.done.contains_key(&key) {
            resumed += 1;
            continue;
        }
        let item_bytes = item_source_bytes(&ck, &cfg, &dense, layout, item);
        let mut progress = ItemProgress {
            state: &mut state,
            state_path: &state_path,
            key: key.clone(),
            saves: &mut saves,
            interrupt_after: hooks.interrupt_after_chunks,
        };
        let hashes = match item {
            Item::Dense(i) => {
                let src_t = ck.require(&dense[*i].name)?;
                let target = Target { file: &dense_file, path: &dense_path };
                let h = convert_dense(&reader, &dense[*i], src_t, target, &bar, chunk_bytes, &mut progress)?;
                sync(&dense_file, &dense_path)?;
                h
            }
            Item::Experts(l) => {
                let job = ExpertJob {
                    reader: &reader,
                    ck: &ck,
                    cfg: &cfg,
                    layout,
                    info: &experts,
                    format: expert_format,
                    layer: *l,
                };
                let target = Target { file: &experts_file, path: &experts_path };
                let h = convert_expert_layer(&job, target, &bar, chunk_bytes, item_bytes, &mut progress)?;
                sync(&experts_file, &experts_path)?;
                h
            }
        };
        bytes_read += item_bytes;
        state.done.insert(key.clone(), hashes);
        if state.partial.as_ref().is_some_and(|p| p.key == key) {
            state.partial = None;
        }
        state::save(&state_path, &state)?;
        converted += 1;
    }
    bar.finish_and_clear();

    fill_hashes(&mut dense, &mut experts, &state, &cfg)?;
    let manifest = Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        complete: true,
        created_by: format!("picchio {}", env!("CARGO_PKG_VERSION")),
        hash_algorithm: "blake3".into(),
        source: SourceInfo { dir: src.display().to_string(), identity },
        formats,
        files: FileSizes { dense: dense_bytes, experts: experts_bytes },
        tensors: dense,
        experts,
    };
    write_atomically(
        &out.join(MANIFEST_FILE),
        &serde_json::to_vec_pretty(&manifest).expect("manifest serializes"),
    )?;
    sync_dir(out)?;
    let _ = std::fs::remove_file(&state_path);
    Ok(ConvertReport {
        out: out.to_path_buf(),
        converted,
        resumed,
        redone: checked.redone,
        resumed_steps: checked.kept_steps,
        bytes_read,
        bytes_written: dense_bytes + experts_bytes,
        seconds: started.elapsed().as_secs_f64(),
        peak_rss: crate::system::peak_rss(),
    })
}

/// Removes the temporaries of the state file and the manifest that a killed run may have
/// left half written (they are never read; this only keeps the directory clean).
fn remove_stale_temporaries(out: &Path) -> Result<()> {
    for name in [STATE_FILE, MANIFEST_FILE] {
        let tmp = temporary(&out.join(name));
        match std::fs::remove_file(&tmp) {
            Ok(()) => tracing::info!("{}: removed a temporary left by an interrupted run", tmp.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&tmp, e)),
        }
    }
    Ok(())
}

/// The state to continue from and whether it belongs to this plan (resume) or the outputs
/// start from scratch. A state that cannot be read or parsed could describe bytes that are
/// wrong, so it is never taken as absent over existing outputs: they are truncated.
fn load_state(path: &Path, plan_id: &str, out: &Path) -> (State, bool) {
    let fresh = || State { plan: plan_id.to_string(), ..State::default() };
    match state::load(path) {
        Loaded::Absent => (fresh(), false),
        Loaded::Unreadable(why) => {
            tracing::info!("{}: {why}; restarting the conversion from scratch", path.display());
            (fresh(), false)
        }
        Loaded::Found(s) if s.plan == plan_id => (s, true),
        Loaded::Found(_) => {
            tracing::info!(
                "{}: the previous partial conversion used other options or source; restarting",
                out.display()
            );
            (fresh(), false)
        }
    }
}

/// Re-hashes the written bytes of everything the state claims and logs what was kept.
fn recheck(state: &mut State, outputs: &Outputs<'_>, out: &Path) -> Result<state::Recheck> {
    let r = state::recheck(state, outputs)?;
    tracing::info!(
        "{}: resuming; re-checked {} finished items against the written bytes, {} did not match and will be redone",
        out.display(),
        r.kept + r.redone,
        r.redone
    );
    if let Some(p) = &state.partial {
        tracing::info!("{}: continuing {} after {} finished chunks", out.display(), p.key, r.kept_steps);
    }
    if r.dropped_steps > 0 {
        tracing::info!(
            "{}: {} finished chunks did not match and will be redone",
            out.display(),
            r.dropped_steps
        );
    }
    Ok(r)
}

/// The planned output files, for re-reading what a state claims.
struct Outputs<'a> {
    dense: &'a [TensorRecord],
    experts: &'a ExpertStoreInfo,
    cfg: &'a ModelConfig,
    dense_file: &'a File,
    dense_path: &'a Path,
    experts_file: &'a File,
    experts_path: &'a Path,
}

impl Outputs<'_> {
    fn dense_tensor(&self, key: &str) -> Option<&TensorRecord> {
        let name = key.strip_prefix("dense:")?;
        self.dense.iter().find(|t| t.name == name)
    }

    /// The MoE layer an `experts:L` key names (dense layers have no expert item).
    fn expert_layer(&self, key: &str) -> Option<usize> {
        key.strip_prefix("experts:")?.parse().ok().filter(|&l| self.cfg.expert_record(l, 0).is_some())
    }
}

impl Regions for Outputs<'_> {
    fn units(&self, key: &str) -> Option<usize> {
        if let Some(t) = self.dense_tensor(key) {
            return rows_cols(t).ok().map(|(rows, _)| rows);
        }
        self.expert_layer(key).map(|_| self.cfg.num_experts)
    }

    fn regions(&self, key: &str, start: usize, end: usize) -> Vec<Region<'_>> {
        if let Some(t) = self.dense_tensor(key) {
            let Ok((_, cols)) = rows_cols(t) else { return Vec::new() };
            return t
                .parts
                .iter()
                .zip(part_row_bytes(t, cols))
                .map(|(p, per_row)| Region {
                    file: self.dense_file,
                    path: self.dense_path,
                    offset: p.offset + (start * per_row) as u64,
                    len: (end.saturating_sub(start) * per_row) as u64,
                })
                .collect();
        }
        let Some(layer) = self.expert_layer(key) else { return Vec::new() };
        // An impossible range yields no regions, which matches no hashes: the work is redone.
        let Some(first) = self.cfg.expert_record(layer, 0) else { return Vec::new() };
        self.experts
            .records
            .get(first + start..first + end)
            .unwrap_or_default()
            .iter()
            .map(|r| Region {
                file: self.experts_file,
                path: self.experts_path,
                offset: r.offset,
                len: r.bytes,
            })
            .collect()
    }
}

/// Records finished steps of the item being converted in the state file, so an
/// interrupted run continues inside the item.
struct ItemProgress<'a> {
    state: &'a mut State,
    state_path: &'a Path,
    key: String,
    /// Saves made by this run, over all items.
    saves: &'a mut usize,
    interrupt_after: Option<usize>,
}

impl ItemProgress<'_> {
    /// The re-checked finished steps of this item from an earlier run.
    fn resumed_steps(&self) -> Vec<Step> {
        match &self.state.partial {
            Some(p) if p.key == self.key => p.steps.clone(),
            _ => Vec::new(),
        }
    }

    /// Syncs `target` and records `step` as finished.
    fn save(&mut self, step: Step, target: Target<'_>) -> Result<()> {
        sync(target.file, target.path)?;
        if self.state.partial.as_ref().is_none_or(|p| p.key != self.key) {
            self.state.partial = Some(Partial { key: self.key.clone(), steps: Vec::new() });
        }
        if let Some(p) = &mut self.state.partial {
            p.steps.push(step);
        }
        state::save(self.state_path, self.state)?;
        *self.saves += 1;
        if self.interrupt_after == Some(*self.saves) {
            return Err(Error::invalid(format!("conversion interrupted after {} chunks", *self.saves)));
        }
        Ok(())
    }
}

/// An output file being written.
#[derive(Clone, Copy)]
struct Target<'a> {
    file: &'a File,
    path: &'a Path,
}

/// A finished container of the same source and formats needs no work; any other complete
/// container in `out` is refused rather than overwritten.
fn already_converted(
    out: &Path,
    identity: &str,
    formats: Formats,
    started: Instant,
) -> Result<Option<ConvertReport>> {
    if !out.join(MANIFEST_FILE).exists() {
        return Ok(None);
    }
    let m = Manifest::read(out)?;
    if m.source.identity == identity && m.formats == formats {
        tracing::info!("{} is already a complete conversion of this source", out.display());
        // A conversion stopped between renaming the manifest into place and removing its
        // state file leaves both; the manifest is the later of the two, so the state is stale
        // (the caller holds the output lock, so no conversion is writing it).
        let state = out.join(STATE_FILE);
        match std::fs::remove_file(&state) {
            Ok(()) => tracing::info!("removed the stale {}", state.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&state, e)),
        }
        return Ok(Some(ConvertReport {
            out: out.to_path_buf(),
            converted: 0,
            resumed: 0,
            redone: 0,
            resumed_steps: 0,
            bytes_read: 0,
            bytes_written: m.files.dense + m.files.experts,
            seconds: started.elapsed().as_secs_f64(),
            peak_rss: crate::system::peak_rss(),
        }));
    }
    Err(Error::format(
        out,
        "already holds a complete container of another source or other formats; remove it or choose another directory",
    ))
}

/// Work items in the order their source bytes lie on disk (shard, then offset).
fn ordered_items(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    dense: &[TensorRecord],
    layout: ExpertLayout,
) -> Vec<Item> {
    let mut items: Vec<(usize, u64, Item)> = Vec::new();
    for (i, t) in dense.iter().enumerate() {
        let e = ck.get(&t.name).expect("checked");
        items.push((e.shard, e.offset as u64, Item::Dense(i)));
    }
    for l in cfg.moe_layers() {
        let first = match layout {
            ExpertLayout::Mxfp4 => format!("{}.gate_up_proj_blocks", names::fused_experts(l)),
            ExpertLayout::Dequantized => format!("{}.gate_up_proj", names::fused_experts(l)),
            ExpertLayout::Separate => names::separate_expert(l, 0, "gate_proj"),
        };
        let e = ck.get(&first).expect("checked");
        items.push((e.shard, e.offset as u64, Item::Experts(l)));
    }
    items.sort_by_key(|(s, o, _)| (*s, *o));
    items.into_iter().map(|(_, _, it)| it).collect()
}

/// Source bytes an item reads.
fn item_source_bytes(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    dense: &[TensorRecord],
    layout: ExpertLayout,
    item: &Item,
) -> u64 {
    match item {
        Item::Dense(i) => ck.get(&dense[*i].name).map_or(0, |t| t.len as u64),
        Item::Experts(l) => expert_tensor_names(*l, cfg.num_experts, layout)
            .iter()
            .filter_map(|n| ck.get(n))
            .map(|t| t.len as u64)
            .sum::<u64>()
            .max(cfg.num_experts as u64),
    }
}

fn expert_tensor_names(layer: usize, experts: usize, layout: ExpertLayout) -> Vec<String> {
    let p = names::fused_experts(layer);
    let mut v = Vec::new();
    for m in ["gate_up_proj", "down_proj"] {
        match layout {
            ExpertLayout::Mxfp4 => {
                v.push(format!("{p}.{m}_blocks"));
                v.push(format!("{p}.{m}_scales"));
            }
            ExpertLayout::Dequantized => v.push(format!("{p}.{m}")),
            ExpertLayout::Separate => {
                let projections =
                    if m == "gate_up_proj" { &["gate_proj", "up_proj"][..] } else { &["down_proj"] };
                for e in 0..experts {
                    for proj in projections {
                        v.push(names::separate_expert(layer, e, proj));
                    }
                }
                continue;
            }
        }
        v.push(format!("{p}.{m}_bias"));
    }
    v
}

/// Positioned reads of source tensors (not mapped, so resident memory stays bounded).
struct SourceReader {
    files: Vec<(PathBuf, File)>,
}

impl SourceReader {
    fn open(ck: &Checkpoint) -> Result<Self> {
        let files = ck
            .shards()
            .iter()
            .map(|s| File::open(&s.path).map(|f| (s.path.clone(), f)).map_err(|e| Error::io(&s.path, e)))
            .collect::<Result<_>>()?;
        Ok(SourceReader { files })
    }

    /// `len` bytes starting `start` bytes into tensor `t`.
    fn read(&self, t: &TensorEntry, start: usize, len: usize) -> Result<Vec<u8>> {
        let (path, file) = &self.files[t.shard];
        let mut buf = vec![0u8; len];
        read_exact_at(file, &mut buf, (t.offset + start) as u64)
            .map_err(|e| Error::format(path, format!("reading {len} bytes at {}: {e}", t.offset + start)))?;
        Ok(buf)
    }
}

fn open_output(path: &Path, len: u64, keep: bool) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(!keep)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    f.set_len(len).map_err(|e| Error::io(path, e))?;
    Ok(f)
}

fn sync(f: &File, path: &Path) -> Result<()> {
    f.sync_data().map_err(|e| Error::io(path, e))
}

/// Makes a rename in `dir` durable.
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

fn progress_bar(enabled: bool, total: u64, done: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "converting [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_position(done);
    bar
}

/// The stored format of dense tensor `t` (as planned, so always one).
fn tensor_format(t: &TensorRecord) -> Result<WeightFormat> {
    WeightFormat::from_stored(t.scheme, t.parts.first().map(|p| p.dtype))
        .ok_or_else(|| Error::tensor(&t.name, format!("scheme {:?} is no weight format", t.scheme)))
}

/// Bytes per row of each part of `t` (parts are row-major).
fn part_row_bytes(t: &TensorRecord, cols: usize) -> Vec<usize> {
    let Ok(format) = tensor_format(t) else { return Vec::new() };
    t.parts.iter().map(|p| format.part_row_bytes(&p.role, cols).unwrap_or(0)).collect()
}

/// Rows and columns of a dense tensor (a vector is one row).
fn rows_cols(t: &TensorRecord) -> Result<(usize, usize)> {
    match t.shape[..] {
        [r, c] => Ok((r, c)),
        [n] => Ok((1, n)),
        _ => Err(Error::tensor(&t.name, format!("unexpected shape {:?}", t.shape))),
    }
}

/// Converts one dense tensor in row chunks, checking every value is finite; returns the
/// hash of each part. Chunks finished by an earlier run (re-checked) are skipped; every
/// chunk but the last is recorded as a step when done. A tensor finished in one run is
/// hashed as it is written; one resumed mid-way is hashed by re-reading its parts.
fn convert_dense(
    reader: &SourceReader,
    t: &TensorRecord,
    src: &TensorEntry,
    out: Target<'_>,
    bar: &ProgressBar,
    chunk_bytes: usize,
    progress: &mut ItemProgress<'_>,
) -> Result<Vec<String>> {
    let (rows, cols) = rows_cols(t)?;
    let elems = rows.checked_mul(cols).filter(|n| *n > 0 && src.len.is_multiple_of(*n)).ok_or_else(|| {
        Error::tensor(&t.name, format!("{} bytes do not divide into {rows} x {cols} elements", src.len))
    })?;
    let elem = src.len / elems;
    let src_row = cols * elem;
    let chunk_rows = (chunk_bytes / src_row).max(1);
    let row_bytes = part_row_bytes(t, cols);
    let resumed = progress.resumed_steps();
    let mut r0 = resumed.last().map_or(0, |s| s.end);
    bar.inc((r0 * src_row) as u64);
    let mut hashers: Vec<blake3::Hasher> = t.parts.iter().map(|_| blake3::Hasher::new()).collect();
    while r0 < rows {
        let n = chunk_rows.min(rows - r0);
        let raw = reader.read(src, r0 * src_row, n * src_row)?;
        check_finite_bytes(&t.name, src.dtype, &raw, &|i| position(t.shape.len(), cols, r0 * cols + i))?;
        let raw_len = raw.len() as u64;
        let encoded = encode_dense_chunk(t, src.dtype, raw, n, cols)?;
        // The last chunk completes the item and needs no step hash; a resumed item is
        // hashed by re-reading, so needs no running hash.
        let last = r0 + n == rows;
        let mut chunk_hashes = Vec::with_capacity(encoded.len());
        for (((part, data), per_row), hasher) in
            t.parts.iter().zip(&encoded).zip(&row_bytes).zip(&mut hashers)
        {
            write_all_at(out.file, data, part.offset + (r0 * per_row) as u64)
                .map_err(|e| Error::format(out.path, format!("writing {}: {e}", t.name)))?;
            if resumed.is_empty() {
                hasher.update(data);
            }
            if !last {
                chunk_hashes.push(hash_hex(data));
            }
        }
        bar.inc(raw_len);
        r0 += n;
        if !last {
            progress.save(Step { end: r0, hashes: chunk_hashes }, out)?;
        }
    }
    if resumed.is_empty() {
        return Ok(hashers.into_iter().map(|h| h.finalize().to_hex().to_string()).collect());
    }
    t.parts
        .iter()
        .map(|p| hash_region(&Region { file: out.file, path: out.path, offset: p.offset, len: p.bytes }))
        .collect()
}

/// Encodes `n` rows of source bytes `raw` into the parts of `t`.
fn encode_dense_chunk(
    t: &TensorRecord,
    dtype: SrcDtype,
    raw: Vec<u8>,
    n: usize,
    cols: usize,
) -> Result<Vec<Vec<u8>>> {
    Ok(match tensor_format(t)? {
        // Already in the target format: written as read.
        WeightFormat::Bf16 if dtype == SrcDtype::BF16 => vec![raw],
        WeightFormat::F32 if dtype == SrcDtype::F32 => vec![raw],
        WeightFormat::Bf16 => {
            let f = decode_floats(&t.name, dtype, &raw)?;
            vec![f.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()).collect()]
        }
        WeightFormat::F32 => {
            let f = decode_floats(&t.name, dtype, &raw)?;
            vec![f.iter().flat_map(|v| v.to_le_bytes()).collect()]
        }
        WeightFormat::Int8Row => {
            let f = decode_floats(&t.name, dtype, &raw)?;
            let mut codes = vec![0u8; n * cols];
            let mut scales = vec![0u8; n * 4];
            codes
                .par_chunks_mut(cols)
                .zip(scales.par_chunks_mut(4))
                .zip(f.par_chunks(cols))
                .enumerate()
                .try_for_each(|(r, ((c, s), x))| {
                    let scale = int8::quantize_row(x, bytemuck::cast_slice_mut(c));
                    if !scale.is_finite() {
                        return Err(Error::tensor(
                            &t.name,
                            format!("chunk row {r}: INT8 scale {scale} is not finite"),
                        ));
                    }
                    s.copy_from_slice(&scale.to_le_bytes());
                    Ok(())
                })?;
            vec![codes, scales]
        }
        f @ (WeightFormat::Int4Gs64 | WeightFormat::Mxfp4) => {
            return Err(Error::tensor(&t.name, format!("dense {} is not a conversion target", f.name())));
        }
    })
}

/// Which expert matrix is being converted, for errors.
#[derive(Clone, Copy)]
struct ExpertAt<'a> {
    /// Source tensor name without suffix (`model.layers.L.mlp.experts.gate_up_proj`).
    name: &'a str,
    layer: usize,
    expert: usize,
}

/// Source rows of one expert matrix, decoded to f32 on demand.
enum ExpertRows<'a> {
    /// MXFP4 blocks and scales of this expert, rows = outputs.
    Mxfp4 { blocks: Vec<u8>, scales: Vec<u8>, groups: usize, at: ExpertAt<'a> },
    /// A dequantized `[in, out]` slice (checked finite), transposed on access.
    Transposed { data: Vec<f32>, inputs: usize, outputs: usize },
    /// Separate `gate` and `up` `[I, in]` matrices (checked finite), read as the fused
    /// gate/up with interleaved rows (even rows gate, odd rows up).
    Interleaved { gate: Vec<f32>, up: Vec<f32>, inputs: usize },
    /// A `[out, in]` matrix (checked finite), rows as they are.
    Rows { data: Vec<f32>, inputs: usize },
}

impl ExpertRows<'_> {
    fn row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        match self {
            ExpertRows::Mxfp4 { blocks, scales, groups, at } => mxfp4::decode_row(
                &blocks[r * groups * mxfp4::BLOCK_BYTES..(r + 1) * groups * mxfp4::BLOCK_BYTES],
                &scales[r * groups..(r + 1) * groups],
                out,
            )
            .map_err(|b| mxfp4_error(at.name, at.layer, at.expert, r, b)),
            ExpertRows::Transposed { data, inputs, outputs } => {
                for (c, o) in out.iter_mut().enumerate().take(*inputs) {
                    *o = data[c * outputs + r];
                }
                Ok(())
            }
            ExpertRows::Interleaved { gate, up, inputs } => {
                let half = if r.is_multiple_of(2) { gate } else { up };
                let row = r / 2;
                out[..*inputs].copy_from_slice(&half[row * inputs..(row + 1) * inputs]);
                Ok(())
            }
            ExpertRows::Rows { data, inputs } => {
                out[..*inputs].copy_from_slice(&data[r * inputs..(r + 1) * inputs]);
                Ok(())
            }
        }
    }
}

/// One expert layer to convert and where its source lies.
struct ExpertJob<'a> {
    reader: &'a SourceReader,
    ck: &'a Checkpoint,
    cfg: &'a ModelConfig,
    layout: ExpertLayout,
    info: &'a ExpertStoreInfo,
    /// Storage format of the expert matrices.
    format: WeightFormat,
    layer: usize,
}

/// Converts every expert of a layer, checking every value is finite; returns the hash of
/// each record, in expert order. Experts finished by an earlier run (re-checked) are
/// skipped; progress is recorded after every `chunk_bytes` of records.
fn convert_expert_layer(
    job: &ExpertJob<'_>,
    out: Target<'_>,
    bar: &ProgressBar,
    chunk_bytes: usize,
    item_bytes: u64,
    progress: &mut ItemProgress<'_>,
) -> Result<Vec<String>> {
    let e_count = job.cfg.num_experts;
    let resumed = progress.resumed_steps();
    let first = resumed.last().map_or(0, |s| s.end);
    let mut hashes: Vec<String> = resumed.into_iter().flat_map(|s| s.hashes).collect();
    bar.inc(item_bytes * first as u64 / e_count.max(1) as u64);
    let (mut step, mut unsaved) = (Vec::new(), 0usize);
    for expert in first..e_count {
        let (record, read) = convert_expert(job, expert)?;
        let n = job.cfg.expert_record(job.layer, expert).expect("expert items are MoE layers");
        let rec = &job.info.records[n];
        write_all_at(out.file, &record, rec.offset).map_err(|e| {
            Error::format(out.path, format!("writing layer {} expert {expert}: {e}", job.layer))
        })?;
        let h = hash_hex(&record);
        hashes.push(h.clone());
        step.push(h);
        bar.inc(read as u64);
        unsaved += record.len();
        if unsaved >= chunk_bytes && expert + 1 < e_count {
            progress.save(Step { end: expert + 1, hashes: std::mem::take(&mut step) }, out)?;
            unsaved = 0;
        }
    }
    Ok(hashes)
}

/// Builds the record of one expert; returns it and the source bytes read.
fn convert_expert(job: &ExpertJob<'_>, expert: usize) -> Result<(Vec<u8>, usize)> {
    let (h, i, e_count) = (job.cfg.hidden_size, job.cfg.intermediate_size, job.cfg.num_experts);
    let (reader, ck, info) = (job.reader, job.ck, job.info);
    let p = names::fused_experts(job.layer);
    let mut record = vec![0u8; info.payload_bytes as usize];
    let mut read = 0usize;
    for (m, rows, cols) in [("gate_up", 2 * i, h), ("down", h, i)] {
        let src_name = format!("{p}.{m}_proj");
        let at = ExpertAt { name: &src_name, layer: job.layer, expert };
        let source = match job.layout {
            ExpertLayout::Mxfp4 => {
                let g = cols / mxfp4::BLOCK;
                let bt = ck.require(&format!("{src_name}_blocks"))?;
                let st = ck.require(&format!("{src_name}_scales"))?;
                let (bb, sb) = (rows * g * mxfp4::BLOCK_BYTES, rows * g);
                let blocks = reader.read(bt, expert * bb, bb)?;
                let scales = reader.read(st, expert * sb, sb)?;
                read += bb + sb;
                ExpertRows::Mxfp4 { blocks, scales, groups: g, at }
            }
            ExpertLayout::Dequantized => {
                let t = ck.require(&src_name)?;
                let elem = t.len / (e_count * rows * cols);
                let per = rows * cols * elem;
                let raw = reader.read(t, expert * per, per)?;
                read += per;
                let data = decode_floats(&src_name, t.dtype, &raw)?;
                check_finite(&src_name, &data, &|k| dequantized_position(expert, rows, k))?;
                ExpertRows::Transposed { data, inputs: cols, outputs: rows }
            }
            ExpertLayout::Separate => {
                // One matrix per projection; no biases (the record's stay zero).
                let mut whole = |proj: &str| -> Result<Vec<f32>> {
                    let name = names::separate_expert(job.layer, expert, proj);
                    let t = ck.require(&name)?;
                    let raw = reader.read(t, 0, t.len)?;
                    read += raw.len();
                    let data = decode_floats(&name, t.dtype, &raw)?;
                    let cols = if proj == "down_proj" { i } else { h };
                    check_finite(&name, &data, &|k| crate::format::hf::position(2, cols, k))?;
                    Ok(data)
                };
                let source = if m == "gate_up" {
                    ExpertRows::Interleaved { gate: whole("gate_proj")?, up: whole("up_proj")?, inputs: cols }
                } else {
                    ExpertRows::Rows { data: whole("down_proj")?, inputs: cols }
                };
                encode_matrix(&source, info, job.format, m, (rows, cols), at, &mut record)?;
                continue;
            }
        };
        encode_matrix(&source, info, job.format, m, (rows, cols), at, &mut record)?;
        let bias_name = format!("{src_name}_bias");
        let bt = ck.require(&bias_name)?;
        let elem = bt.len / (e_count * rows);
        let raw = reader.read(bt, expert * rows * elem, rows * elem)?;
        read += raw.len();
        let bias = decode_floats(&bias_name, bt.dtype, &raw)?;
        check_finite(&bias_name, &bias, &|k| format!("expert {expert}, element {k}"))?;
        let c = component(info, &format!("{m}.bias"))?;
        record[c.0..c.0 + c.1].copy_from_slice(bytemuck::cast_slice(&bias));
    }
    Ok((record, read))
}

/// Offset and length of a record component.
fn component(info: &ExpertStoreInfo, name: &str) -> Result<(usize, usize)> {
    info.components
        .iter()
        .find(|c| c.name == name)
        .map(|c| (c.offset as usize, c.bytes as usize))
        .ok_or_else(|| Error::format(EXPERTS_FILE, format!("layout has no `{name}` component")))
}

/// Encodes one expert matrix into its record components as `format`, rows in parallel.
/// MXFP4 is a pass-through: the source's blocks and scales are copied byte for byte, after
/// every block is checked to decode to finite values. An INT4 group whose scale rounds to
/// infinity in f16 (largest magnitude above about `8 * 65504`) is an error naming the
/// matrix, layer, expert, row and group.
fn encode_matrix(
    src: &ExpertRows<'_>,
    info: &ExpertStoreInfo,
    format: WeightFormat,
    m: &str,
    (rows, cols): (usize, usize),
    at: ExpertAt<'_>,
    record: &mut [u8],
) -> Result<()> {
    match format {
        WeightFormat::Int4Gs64 => {
            let (co, cb) = component(info, &format!("{m}.codes"))?;
            let (so, sb) = component(info, &format!("{m}.scales"))?;
            let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
            // Components are disjoint and in order: codes before scales.
            let (head, tail) = record.split_at_mut(so);
            let codes = &mut head[co..co + cb];
            let scales = &mut tail[..sb];
            codes.par_chunks_mut(rb).zip(scales.par_chunks_mut(2 * g)).enumerate().try_for_each(
                |(r, (c, s))| {
                    let mut x = vec![0.0f32; cols];
                    src.row(r, &mut x)?;
                    let mut sc = vec![0u16; g];
                    int4::quantize_row(&x, c, &mut sc);
                    check_int4_scales(&x, &sc, at, r)?;
                    for (dst, v) in s.chunks_exact_mut(2).zip(&sc) {
                        dst.copy_from_slice(&v.to_le_bytes());
                    }
                    Ok::<(), Error>(())
                },
            )?;
            debug_assert_eq!(codes.len(), rows * rb);
        }
        WeightFormat::Mxfp4 => {
            let ExpertRows::Mxfp4 { blocks, scales, .. } = src else {
                return Err(Error::tensor(at.name, "MXFP4 experts need an MXFP4 source (blocks and scales)"));
            };
            // Every block must decode to finite values, as for any other target.
            (0..rows).into_par_iter().try_for_each(|r| {
                let mut x = vec![0.0f32; cols];
                src.row(r, &mut x)
            })?;
            let (co, cb) = component(info, &format!("{m}.codes"))?;
            let (so, sb) = component(info, &format!("{m}.scales"))?;
            if blocks.len() != cb || scales.len() != sb {
                return Err(Error::tensor(
                    at.name,
                    format!(
                        "layer {}, expert {}: {} block and {} scale bytes, the record holds {cb} and {sb}",
                        at.layer,
                        at.expert,
                        blocks.len(),
                        scales.len()
                    ),
                ));
            }
            record[co..co + cb].copy_from_slice(blocks);
            record[so..so + sb].copy_from_slice(scales);
        }
        WeightFormat::F32 => {
            let (o, b) = component(info, &format!("{m}.data"))?;
            record[o..o + b].par_chunks_mut(cols * 4).enumerate().try_for_each(|(r, dst)| {
                let mut x = vec![0.0f32; cols];
                src.row(r, &mut x)?;
                dst.copy_from_slice(bytemuck::cast_slice(&x));
                Ok::<(), Error>(())
            })?;
        }
        f @ (WeightFormat::Bf16 | WeightFormat::Int8Row) => {
            return Err(Error::tensor(at.name, format!("{} is not an expert format", f.name())));
        }
    }
    Ok(())
}

/// Fails on the first INT4 group of row `r` whose f16 scale is not finite.
fn check_int4_scales(x: &[f32], scales: &[u16], at: ExpertAt<'_>, r: usize) -> Result<()> {
    let Some(g) = scales.iter().position(|s| !f16::from_bits(*s).is_finite()) else { return Ok(()) };
    let group = &x[g * int4::GROUP..((g + 1) * int4::GROUP).min(x.len())];
    let max = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    Err(Error::tensor(
        at.name,
        format!(
            "layer {}, expert {}, row {r}, INT4 group {g}: the largest magnitude {max} needs a scale of {} which overflows f16 (largest 65504); convert with --experts f32",
            at.layer,
            at.expert,
            max / 8.0
        ),
    ))
}

/// Copies the hashes recorded in the state into the manifest records.
fn fill_hashes(
    dense: &mut [TensorRecord],
    experts: &mut ExpertStoreInfo,
    state: &State,
    cfg: &ModelConfig,
) -> Result<()> {
    for t in dense.iter_mut() {
        let key = format!("dense:{}", t.name);
        let hashes =
            state.done.get(&key).ok_or_else(|| Error::invalid(format!("conversion lost track of {key}")))?;
        for (p, h) in t.parts.iter_mut().zip(hashes) {
            p.hash = h.clone();
        }
    }
    for l in cfg.moe_layers() {
        let key = format!("experts:{l}");
        let hashes =
            state.done.get(&key).ok_or_else(|| Error::invalid(format!("conversion lost track of {key}")))?;
        for (e, h) in hashes.iter().enumerate() {
            let n =
                cfg.expert_record(l, e).ok_or_else(|| Error::invalid(format!("{key} has extra hashes")))?;
            experts.records[n].hash = h.clone();
        }
    }
    Ok(())
}

/// Whether `dir` is a Hugging Face checkpoint (not a container).
pub fn is_hf_checkpoint(dir: &Path) -> bool {
    dir.join("config.json").is_file() && (dir.join(SINGLE_FILE).is_file() || dir.join(INDEX_FILE).is_file())
}
