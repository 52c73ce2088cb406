//! Loading a model and putting it on a backend: the object-safe [`Runner`] that sessions
//! and front-ends drive without knowing which backend or weight source is underneath.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{GpuBackend, GpuOptions, KvPrecision};
use crate::backend::{Backend, SeqPos};
use crate::config::{MlpKind, ModelConfig};
use crate::error::{Error, Result};
use crate::experts::{CacheOptions, CachedExperts, ExpertSource, ExpertStats, ExpertStore, ResidentExperts};
use crate::format::container::convert::{STATE_FILE, is_hf_checkpoint};
use crate::format::container::reader::{cached_copy_advice, cached_copy_damaged};
use crate::format::container::{
    Container, ConvertOptions, Formats, Manifest, convert, is_container, source_identity,
};
use crate::format::hf;
use crate::model::forward::PhaseTimes;
use crate::model::weights::{DenseWeights, ExpertWeights};
use crate::model::{Forward, LogitRows, Observer};
use crate::quant::Matrix;
use crate::sample::{PlannedLogits, SamplePlan};
use crate::system::gib;

/// A model on a backend, ready to run positions.
pub trait Runner: Send {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// Positions the key/value cache holds.
    fn capacity(&self) -> usize;
    /// One line describing backend and weights.
    fn describe(&self) -> String;
    /// Runs `ids` at positions `start_pos..`, returning logits for `rows`. The caller
    /// (a `Session`) has validated IDs and capacity.
    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>>;
    /// Runs `ids` on sequence `seq` at positions `start_pos..` and hands back what `pick`
    /// asks of the last position: nothing, its logits, the greedy next token (the argmax,
    /// the first of equal maxima, failing on non-finite logits as the sampler does), or a
    /// sampler's planned pick ([`crate::sample::Sampler::plan`]: the logits adjusted and
    /// reduced for [`crate::sample::Sampler::finish`]). The default computes the logits and
    /// makes the pick on the host; a runner on a GPU makes it there and reads back the token
    /// ID or a few kilobytes of candidates.
    fn forward_pick(&mut self, seq: usize, ids: &[u32], start_pos: usize, pick: &Pick) -> Result<Picked> {
        let rows = if matches!(pick, Pick::Nothing) { LogitRows::None } else { LogitRows::Last };
        let logits = self.forward_on(seq, ids, start_pos, rows, &mut crate::model::NoObserver)?;
        pick.on_host(logits, start_pos + ids.len().saturating_sub(1))
    }
    /// Most positions one forward call computes at once (the prefill block, `--prefill-block`);
    /// a session feeds long prompts in blocks of this size so it can stop between them.
    /// By default a runner takes any number of positions in one call.
    fn prefill_block(&self) -> usize {
        usize::MAX
    }
    /// Time spent so far, by phase.
    fn times(&self) -> PhaseTimes;
    /// Counters of the expert source.
    fn expert_stats(&self) -> ExpertStats;
    /// Extra lines for `--stats` (the device's counters, verification); none by default.
    fn report(&self) -> Vec<String> {
        Vec::new()
    }
    /// The device's decode counters ([`crate::backend::Backend::decode_counters`]); none by
    /// default.
    fn decode_counters(&self) -> Option<crate::backend::DecodeCounters> {
        None
    }
    /// Adds a key/value cache for another sequence and returns its index (0 is the one
    /// every runner starts with), so several conversations share the loaded weights. A
    /// runner with one cache refuses (the default); then it serves one sequence.
    fn add_sequence(&mut self) -> Result<usize> {
        Err(Error::Backend(format!("{} keeps one key/value cache", self.describe())))
    }
    /// [`forward`](Self::forward) on sequence `seq`. The default knows sequence 0 only.
    fn forward_on(
        &mut self,
        seq: usize,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        if seq != 0 {
            return Err(Error::Backend(format!("sequence {seq} does not exist (one key/value cache)")));
        }
        self.forward(ids, start_pos, rows, observer)
    }

    /// One batched decode step: sequence `rows[i].seq` consumes `ids[i]` at position
    /// `rows[i].pos`; returns every row's logits, `[rows, vocab]`. The sequences are
    /// distinct; the caller has validated IDs and capacity. A row's logits do not depend on
    /// the other rows (on the CPU, bit for bit). The default takes one row only.
    fn step(&mut self, rows: &[SeqPos], ids: &[u32]) -> Result<Vec<f32>> {
        match (rows, ids) {
            ([at], [_]) => {
                self.forward_on(at.seq, ids, at.pos, LogitRows::Last, &mut crate::model::NoObserver)
            }
            _ => Err(Error::Backend(format!("{} has no batched decode step", self.describe()))),
        }
    }

    /// [`step`](Self::step) where row `i` hands back what `picks[i]` asks
    /// ([`forward_pick`](Self::forward_pick)). The default reads every row's logits and
    /// makes the picks on the host.
    fn step_picks(&mut self, rows: &[SeqPos], ids: &[u32], picks: &[Pick]) -> Result<Vec<Picked>> {
        if picks.len() != rows.len() {
            return Err(Error::Backend(format!("step: {} picks for {} rows", picks.len(), rows.len())));
        }
        let logits = self.step(rows, ids)?;
        let vocab = self.config().vocab_size.max(1);
        logits
            .chunks(vocab)
            .zip(picks.iter().zip(rows))
            .map(|(row, (pick, at))| pick.on_host(row.to_vec(), at.pos))
            .collect()
    }
}

/// What a forward call hands back for its last position ([`Runner::forward_pick`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Pick {
    /// Nothing: only the cache changes (a turn's last token).
    Nothing,
    /// The logits.
    Logits,
    /// The greedy next token.
    Greedy,
    /// A sampler's planned pick (shared, so the session keeping it and the slots'
    /// scheduler carrying it copy no table per token).
    Planned(Arc<SamplePlan>),
}

/// What a [`Pick`] got.
#[derive(Clone, Debug, PartialEq)]
pub enum Picked {
    /// Nothing was asked.
    Nothing,
    /// The logits (of the last position, or of the rows a plain forward call asked for).
    Logits(Vec<f32>),
    /// The greedy next token.
    Greedy(u32),
    /// The planned pick's adjusted, reduced logits.
    Planned(PlannedLogits),
}

impl Pick {
    /// The pick made on the host from `logits`, the row of `position` (named in errors).
    pub fn on_host(&self, mut logits: Vec<f32>, position: usize) -> Result<Picked> {
        match self {
            Pick::Nothing => Ok(Picked::Nothing),
            Pick::Logits => Ok(Picked::Logits(logits)),
            Pick::Greedy => {
                crate::sample::check_finite(&logits, position)?;
                Ok(Picked::Greedy(crate::model::math::argmax_with_margin(&logits).0 as u32))
            }
            Pick::Planned(plan) => {
                plan.adjust_logits(&mut logits);
                Ok(Picked::Planned(PlannedLogits::Full(logits)))
            }
        }
    }
}

impl<B: Backend + Send> Runner for Forward<B> {
    fn config(&self) -> &ModelConfig {
        self.backend().config()
    }

    fn capacity(&self) -> usize {
        self.backend().capacity()
    }

    fn describe(&self) -> String {
        self.backend().describe()
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        self.run(ids, start_pos, rows, observer)
    }

    fn prefill_block(&self) -> usize {
        self.max_batch()
    }

    fn forward_pick(&mut self, seq: usize, ids: &[u32], start_pos: usize, pick: &Pick) -> Result<Picked> {
        self.backend_mut().select_sequence(seq)?;
        self.run_pick(ids, start_pos, pick)
    }

    fn times(&self) -> PhaseTimes {
        Forward::times(self)
    }

    fn expert_stats(&self) -> ExpertStats {
        self.backend().expert_stats()
    }

    fn report(&self) -> Vec<String> {
        self.backend().report()
    }

    fn decode_counters(&self) -> Option<crate::backend::DecodeCounters> {
        self.backend().decode_counters()
    }

    fn add_sequence(&mut self) -> Result<usize> {
        self.backend_mut().add_sequence()
    }

    fn forward_on(
        &mut self,
        seq: usize,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        self.run_on(seq, ids, start_pos, rows, observer)
    }

    fn step(&mut self, rows: &[SeqPos], ids: &[u32]) -> Result<Vec<f32>> {
        Forward::step(self, rows, ids)
    }

    fn step_picks(&mut self, rows: &[SeqPos], ids: &[u32], picks: &[Pick]) -> Result<Vec<Picked>> {
        Forward::step_picks(self, rows, ids, picks)
    }
}

/// A loaded model: configuration, dense weights and where experts come from.
#[derive(Clone)]
pub struct LoadedModel {
    /// The configuration.
    pub config: Arc<ModelConfig>,
    /// Resident dense weights.
    pub dense: Arc<DenseWeights>,
    /// The expert source.
    pub experts: Arc<dyn ExpertSource>,
    /// The directory the weights were loaded from (the container, after conversion).
    pub dir: PathBuf,
    /// The CPU backend's copy of `dense` in huge pages, made by the first CPU runner.
    pub cpu_dense: CpuDenseCopy,
}

/// The CPU backend's copy of a model's dense weights with every streamed matrix in huge
/// pages ([`DenseWeights::with_streamed_matrices_in_huge_pages`]), made once, on first use,
/// and shared by every CPU runner of the model (a lockstep oracle, a GPU run's fallback, a
/// server's runners). Only the GPU backend never asks for it: its weights go to the device.
#[derive(Clone, Default)]
pub struct CpuDenseCopy(Arc<std::sync::Mutex<Option<SourceAndCopy>>>);

/// Dense weights and the CPU backend's copy of them.
type SourceAndCopy = (Arc<DenseWeights>, Arc<DenseWeights>);

impl CpuDenseCopy {
    /// The copy of `source`: made now, or the one made before from this same `source` (a
    /// model rebuilt with other dense weights gets its own copy, never a stale one).
    fn of(&self, source: &Arc<DenseWeights>) -> Arc<DenseWeights> {
        // A poisoned lock only means a copy panicked; the slot is then simply refilled.
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match &*slot {
            Some((from, copy)) if Arc::ptr_eq(from, source) => Arc::clone(copy),
            _ => {
                let t0 = std::time::Instant::now();
                let copy = Arc::new(source.with_streamed_matrices_in_huge_pages());
                tracing::debug!(
                    "dense weights copied into huge pages in {:.2} s",
                    t0.elapsed().as_secs_f64()
                );
                *slot = Some((Arc::clone(source), Arc::clone(&copy)));
                copy
            }
        }
    }
}

impl LoadedModel {
    /// The same model with every weight decoded to F32 and every expert in memory: the
    /// level-L1 reference for a quantized container (small models only).
    pub fn dequantized(&self) -> Result<LoadedModel> {
        let cfg = &self.config;
        let dense = self.dense.map_matrices(Matrix::dequantized, Matrix::dequantized);
        let experts = (0..cfg.num_layers)
            .map(|l| {
                let experts = match cfg.mlp_kinds[l] {
                    MlpKind::Moe => cfg.num_experts,
                    MlpKind::Dense => 0,
                };
                (0..experts)
                    .map(|e| {
                        let w = self.experts.expert(l, e)?;
                        Ok(ExpertWeights {
                            gate_up: w.gate_up.dequantized(),
                            gate_up_bias: w.gate_up_bias.clone(),
                            down: w.down.dequantized(),
                            down_bias: w.down_bias.clone(),
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LoadedModel {
            config: Arc::clone(&self.config),
            dense: Arc::new(dense),
            experts: Arc::new(ResidentExperts::new(experts)),
            dir: self.dir.clone(),
            cpu_dense: CpuDenseCopy::default(),
        })
    }
}

/// Options for running a model.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Key/value cache capacity in positions (`--ctx`).
    pub ctx: usize,
    /// Most positions processed in one forward batch (the prefill block).
    pub max_batch: usize,
    /// When each next layer's experts are predicted and prefetched in decode (CPU backend;
    /// the GPU backend's resident-router prediction is `GpuOptions::predict`).
    pub predict: crate::backend::Predict,
    /// Compute each expert as soon as it arrives from disk, instead of waiting for all.
    pub completion_driven: bool,
    /// CPU backend: stream the dense matrices from a copy in huge pages
    /// ([`CpuDenseCopy`]) rather than from the memory-mapped container (`--mapped-dense`
    /// turns it off).
    pub dense_in_huge_pages: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            ctx: 4096,
            max_batch: 256,
            predict: crate::backend::Predict::default(),
            completion_driven: true,
            dense_in_huge_pages: true,
        }
    }
}

/// Positions a default context holds when memory allows ([`default_ctx_for_memory`]).
pub const DEFAULT_CTX_TARGET: usize = 32_768;

/// Fewest positions a default context holds (unless the model's maximum is smaller).
pub const DEFAULT_CTX_FLOOR: usize = 4096;

/// The context capacity used when `--ctx` is not given, sized from this machine's physical
/// memory by [`default_ctx_for_memory`] (8 GiB assumed when the OS does not say).
pub fn default_ctx(cfg: &ModelConfig) -> usize {
    default_ctx_for_memory(cfg, crate::system::total_memory().unwrap_or(8 << 30))
}

/// The default context on a machine with `total_memory` bytes of RAM: the rule is
/// [`DEFAULT_CTX_TARGET`] positions when their F32 key/value cache (every layer, sliding
/// ones included, holds every position: `layers x 2 x kv_heads x head_dim x 4` bytes per
/// position) plus the RoPE tables take at most a quarter of the memory left after the
/// system reserve the expert cache also leaves (4 GiB, or a quarter of RAM on small
/// machines); otherwise the most positions that do, rounded down to a multiple of 1024 and
/// not below [`DEFAULT_CTX_FLOOR`]. Either way capped by the model's
/// `max_position_embeddings`. The other three quarters stay for the dense weights and the
/// expert cache, whose default budget subtracts this cache ([`default_ram_budget`]).
pub fn default_ctx_for_memory(cfg: &ModelConfig, total_memory: u64) -> usize {
    let reserve = crate::system::reserve(total_memory);
    let kv_room = total_memory.saturating_sub(reserve) / 4;
    let per_position = cfg.kv_bytes(1).zip(cfg.rope_table_bytes(1)).and_then(|(k, r)| k.checked_add(r));
    let fits = match per_position {
        Some(b) if b > 0 => usize::try_from(kv_room / b).unwrap_or(usize::MAX),
        _ => 0,
    };
    let ctx = if fits >= DEFAULT_CTX_TARGET {
        DEFAULT_CTX_TARGET
    } else {
        (fits / 1024 * 1024).max(DEFAULT_CTX_FLOOR)
    };
    ctx.min(cfg.max_position_embeddings)
}

/// Most slots a server gets by default ([`default_parallel_for_memory`]).
pub const DEFAULT_PARALLEL_MAX: usize = 4;

/// The number of slots (`serve --parallel`) used when none is given, on this machine: see
/// [`default_parallel_for_memory`]; 1 without a memory figure from the OS.
pub fn default_parallel(cfg: &ModelConfig, ctx: usize) -> usize {
    crate::system::total_memory().map_or(1, |total| default_parallel_for_memory(cfg, ctx, total))
}

/// How many key/value caches of `ctx` positions fit, each full, in the quarter of the
/// memory left after the system reserve that [`default_ctx_for_memory`] gives the cache,
/// between 1 and [`DEFAULT_PARALLEL_MAX`]: the slots a server runs without `--parallel`.
pub fn default_parallel_for_memory(cfg: &ModelConfig, ctx: usize, total_memory: u64) -> usize {
    let reserve = crate::system::reserve(total_memory);
    let kv_room = total_memory.saturating_sub(reserve) / 4;
    match cfg.kv_bytes(ctx) {
        Some(per_slot) if per_slot > 0 => {
            usize::try_from(kv_room / per_slot).unwrap_or(usize::MAX).clamp(1, DEFAULT_PARALLEL_MAX)
        }
        _ => 1,
    }
}

/// How many key/value caches of `ctx` positions stored in `precision` (`--kv-cache`) fit,
/// each full, in a quarter of 80% of an adapter's `device_memory` (the rest is for the dense
/// weights and the expert cache), between 1 and [`DEFAULT_PARALLEL_MAX`]: the slots a server
/// on `--device gpu` runs without `--parallel`, whose caches live in VRAM.
pub fn default_parallel_for_vram(
    cfg: &ModelConfig,
    ctx: usize,
    device_memory: u64,
    precision: KvPrecision,
) -> usize {
    let kv_room = device_memory / 10 * 8 / 4;
    match precision.cache_bytes(cfg, ctx) {
        Some(per_slot) if per_slot > 0 => {
            usize::try_from(kv_room / per_slot).unwrap_or(usize::MAX).clamp(1, DEFAULT_PARALLEL_MAX)
        }
        _ => 1,
    }
}

/// Options for opening a model directory.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// RAM for the expert cache in bytes; `None` sizes it from the machine.
    pub ram_bytes: Option<u64>,
    /// Formats used when a Hugging Face directory has to be converted first.
    pub formats: Formats,
    /// Where converted copies of Hugging Face directories go; `None`: the user cache.
    pub cache_dir: Option<PathBuf>,
    /// Show a progress bar while converting.
    pub progress: bool,
    /// Context capacity the model will run with (to reserve KV memory).
    pub ctx: usize,
    /// Key/value caches of `ctx` positions the model will run with (slots of a server):
    /// the expert cache's default budget leaves room for all of them.
    pub kv_caches: usize,
    /// Reader threads for experts (the disk queue depth).
    pub io_threads: usize,
    /// Direct I/O for expert reads (bypassing the page cache); `None`: on when the RAM
    /// cache cannot hold every expert.
    pub direct_io: Option<bool>,
    /// Learn the hot set: persist usage counts and preload the most used experts.
    pub hot_set: bool,
    /// Check every expert record read from disk against its manifest hash (on the reader
    /// threads); off only to measure what the check costs.
    pub verify_reads: bool,
    /// What the RAM expert cache evicts when room is needed.
    pub cache_policy: crate::experts::CachePolicy,
    /// Record every request the expert cache sees in this file (for replaying them through
    /// other policies); `None`: not recorded.
    pub expert_trace: Option<PathBuf>,
    /// Bytes of the pieces expert records are split into across the reader threads (a
    /// multiple of 4 KiB); see [`crate::experts::readers`].
    pub read_piece_bytes: usize,
    /// Prepare the expert cache's memory (map and touch its buffers) on a background thread
    /// after load, so that the first prompts do not pay it inside their reads.
    pub prepare_memory: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            ram_bytes: None,
            formats: Formats::default(),
            cache_dir: None,
            progress: false,
            ctx: 4096,
            kv_caches: 1,
            io_threads: 4,
            direct_io: None,
            hot_set: true,
            verify_reads: true,
            cache_policy: crate::experts::CachePolicy::default(),
            expert_trace: None,
            read_piece_bytes: crate::experts::store::HASHED_READ_CHUNK,
            prepare_memory: true,
        }
    }
}

/// Opens a model directory: a container directly, or a Hugging Face checkpoint through
/// its converted copy in the cache (converting it on first use).
pub fn open(path: &Path, opts: &OpenOptions) -> Result<LoadedModel> {
    if !path.is_dir() {
        return Err(Error::format(path, "model directory does not exist"));
    }
    if is_container(path) {
        return load_container(path, opts);
    }
    if path.join(STATE_FILE).exists() {
        return Err(Error::format(
            path,
            "is an incomplete conversion (interrupted); run `picchio convert` on its source again to finish it",
        ));
    }
    if !is_hf_checkpoint(path) {
        return Err(Error::format(
            path,
            "neither a Picchio container (manifest.json) nor a Hugging Face checkpoint (config.json + model.safetensors)",
        ));
    }
    let target = converted_copy_dir(path, opts)?;
    if is_container(&target) {
        // A cached copy whose manifest cannot be read is damaged; converting over it would
        // fail on the same manifest, so the user is told to delete it.
        Manifest::read(&target).map_err(|e| cached_copy_damaged(&target, e))?;
    } else {
        tracing::info!("converting {} into {} (first use)", path.display(), target.display());
        let report = convert(
            path,
            &target,
            &ConvertOptions { formats: opts.formats, progress: opts.progress, interrupt_after: None },
        )?;
        tracing::info!(
            "converted in {:.1} s ({} written, peak RSS {})",
            report.seconds,
            gib(report.bytes_written),
            report.peak_rss.map_or("unknown".into(), gib)
        );
    }
    load_container(&target, opts)
}

/// Where the converted copy of the checkpoint `src` lives: keyed by the source's identity
/// and the formats, so a changed source or other formats get a fresh conversion.
pub fn converted_copy_dir(src: &Path, opts: &OpenOptions) -> Result<PathBuf> {
    let root = match &opts.cache_dir {
        Some(d) => d.clone(),
        None => dirs::cache_dir()
            .ok_or_else(|| Error::invalid("no user cache directory on this platform; pass --cache-dir"))?
            .join("picchio"),
    };
    let mut h = blake3::Hasher::new();
    h.update(source_identity(src)?.as_bytes());
    h.update(&serde_json::to_vec(&opts.formats).expect("formats serialize"));
    let key = h.finalize().to_hex();
    let name = src
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    Ok(root.join(format!("{name}-{}", &key.as_str()[..16])))
}

/// Loads a container: dense weights mapped, experts through a RAM cache whose reads are
/// checked against the records' hashes. A container inside the conversion cache is
/// Picchio's own copy of a checkpoint: when it fails to load, or a record later fails its
/// hash, the error says to delete it so that the next run rebuilds it (it is never deleted
/// here).
pub fn load_container(dir: &Path, opts: &OpenOptions) -> Result<LoadedModel> {
    let cache_root = opts.cache_dir.clone().or_else(|| dirs::cache_dir().map(|d| d.join("picchio")));
    let cached = cache_root.is_some_and(|root| {
        matches!((dir.canonicalize(), root.canonicalize()), (Ok(d), Ok(r)) if d.starts_with(&r) && d != r)
    });
    let c = Container::open(dir).map_err(|e| if cached { cached_copy_damaged(dir, e) } else { e })?;
    let config = Arc::new(c.config.clone());
    let dense = c.load_dense().map_err(|e| if cached { cached_copy_damaged(dir, e) } else { e })?;
    let expert_bytes = c.experts().record_bytes();
    let ram = match opts.ram_bytes {
        Some(b) => b,
        None => {
            // The caches of every slot, as if each held one long context (a context too
            // large to compute leaves the floor, as in `default_ram_budget`).
            let positions = opts.ctx.saturating_mul(opts.kv_caches.max(1));
            default_ram_budget(&config, c.dense_bytes(), expert_bytes, positions)
        }
    };
    let all_fit = ram >= expert_bytes.saturating_mul(c.experts().records.len() as u64);
    let direct = opts.direct_io.unwrap_or(!all_fit);
    let mut store = ExpertStore::open_with(dir, c.experts(), Arc::clone(&config), direct)?;
    if cached {
        store.set_repair_advice(cached_copy_advice(dir));
    }
    let usage_file = opts.hot_set.then(|| dir.join(USAGE_FILE));
    let cache = CachedExperts::with_options(
        store,
        CacheOptions {
            capacity_bytes: ram,
            io_threads: opts.io_threads.max(1),
            usage_file,
            verify_reads: opts.verify_reads,
            policy: opts.cache_policy,
            trace: opts.expert_trace.clone(),
            read_piece_bytes: opts.read_piece_bytes,
            prepare_memory: opts.prepare_memory,
        },
    )?;
    Ok(LoadedModel {
        config,
        dense: Arc::new(dense),
        experts: Arc::new(cache),
        dir: dir.to_path_buf(),
        cpu_dense: CpuDenseCopy::default(),
    })
}

/// File beside a container where expert usage counts persist between sessions.
pub const USAGE_FILE: &str = "expert-usage.json";

/// Memory left for the expert cache: physical RAM minus the dense weights, the KV cache and
/// a reserve for the OS and everything else (4 GiB, or a quarter of RAM on small machines);
/// never less than one token's experts in every layer.
pub fn default_ram_budget(cfg: &ModelConfig, dense_bytes: u64, expert_bytes: u64, ctx: usize) -> u64 {
    let total = crate::system::total_memory().unwrap_or(8 << 30);
    // A context too large to compute needs more than any machine has; the run options
    // refuse it later with a message, so here it just leaves the floor.
    let kv = cfg.kv_bytes(ctx).unwrap_or(u64::MAX);
    let reserve = crate::system::reserve(total);
    let per_token = (cfg.num_layers as u64).saturating_mul(cfg.experts_per_token as u64);
    let floor = expert_bytes.saturating_mul(per_token);
    total.saturating_sub(dense_bytes.saturating_add(kv).saturating_add(reserve)).max(floor)
}

/// Loads a Hugging Face checkpoint directly, every expert decoded to F32 in memory. For
/// small models and validation against Transformers; large models run from a container.
pub fn load_hf(dir: &Path) -> Result<LoadedModel> {
    if !dir.is_dir() {
        return Err(Error::format(dir, "model directory does not exist"));
    }
    let (cfg, ck) = hf::open(dir)?;
    let dense = hf::load_dense(&ck, &cfg)?;
    let experts = hf::load_all_experts(&ck, &cfg)?;
    Ok(LoadedModel {
        config: Arc::new(cfg),
        dense: Arc::new(dense),
        experts: Arc::new(ResidentExperts::new(experts)),
        dir: dir.to_path_buf(),
        cpu_dense: CpuDenseCopy::default(),
    })
}

/// Where a backend keeps its key/value cache, for the memory check of [`check_context_memory`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPlacement {
    /// In host memory (the CPU backend).
    Host,
    /// On the device (the GPU backend checks its own memory); only the RoPE tables are
    /// built in host memory.
    Device,
}

fn check_run_options(model: &LoadedModel, opts: &RunOptions, kv: KvPlacement) -> Result<()> {
    check_context(&model.config, opts.ctx, kv)
}

/// Checks a context capacity against a model: at least 1, at most its
/// `max_position_embeddings`, and within memory ([`check_context_memory`]). Front-ends call
/// it before loading (so a bad `--ctx` is refused before a conversion); putting a model on
/// a backend calls it again.
pub fn check_context(cfg: &ModelConfig, ctx: usize, kv: KvPlacement) -> Result<()> {
    if ctx == 0 {
        return Err(Error::invalid("--ctx must be at least 1"));
    }
    if ctx > cfg.max_position_embeddings {
        return Err(Error::invalid(format!(
            "--ctx {ctx} exceeds the model's max_position_embeddings {}",
            cfg.max_position_embeddings
        )));
    }
    check_context_memory(cfg, ctx, kv)
}

/// Refuses, before anything is allocated, a context of `ctx` positions whose host buffers
/// (the F32 key/value cache when it lives in host memory, and the RoPE tables) need more
/// than the machine's physical memory. The message names `--ctx`, the bytes needed, and
/// the memory the machine has and has available. Without a memory figure from the OS it
/// passes, and the fallible allocation reports instead.
pub fn check_context_memory(cfg: &ModelConfig, ctx: usize, kv: KvPlacement) -> Result<()> {
    let Some(total) = crate::system::total_memory() else {
        return Ok(());
    };
    let kv_bytes = match kv {
        KvPlacement::Host => cfg.kv_bytes(ctx),
        KvPlacement::Device => Some(0),
    };
    let need = kv_bytes.zip(cfg.rope_table_bytes(ctx)).and_then(|(k, r)| k.checked_add(r));
    if need.is_some_and(|n| n <= total) {
        return Ok(());
    }
    let (what, verb) = match kv {
        KvPlacement::Host => ("KV cache", "needs"),
        KvPlacement::Device => ("RoPE tables", "need"),
    };
    let available = crate::system::available_memory().map_or_else(|| "an unknown amount".to_string(), gib);
    Err(Error::invalid(format!(
        "{what} for --ctx {ctx} {verb} {}; this machine has {available} available ({} of physical memory); \
         choose a smaller --ctx",
        need.map_or_else(|| "more than 2^64 bytes".to_string(), gib),
        gib(total),
    )))
}

/// Puts a loaded model on the CPU backend.
pub fn cpu_runner(model: &LoadedModel, opts: &RunOptions) -> Result<Box<dyn Runner>> {
    check_run_options(model, opts, KvPlacement::Host)?;
    let dense = match opts.dense_in_huge_pages {
        true => model.cpu_dense.of(&model.dense),
        false => Arc::clone(&model.dense),
    };
    let backend = CpuBackend::new(Arc::clone(&model.config), dense, Arc::clone(&model.experts), opts.ctx)?
        .with_expert_pipeline(opts.predict, opts.completion_driven);
    Ok(Box::new(Forward::new(backend, opts.max_batch)))
}

/// Puts a loaded model on a GPU (see `backend::gpu`). Fails with `Error::Backend` when no
/// suitable adapter exists or the device cannot hold the model.
pub fn gpu_runner(model: &LoadedModel, opts: &RunOptions, gpu: &GpuOptions) -> Result<Box<dyn Runner>> {
    check_run_options(model, opts, KvPlacement::Device)?;
    let backend = GpuBackend::new(
        Arc::clone(&model.config),
        Arc::clone(&model.dense),
        Arc::clone(&model.experts),
        opts.ctx,
        gpu,
    )?;
    Ok(Box::new(Forward::new(backend, opts.max_batch)))
}

/// Where a model runs (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// The GPU when a hardware adapter exists and takes the model, else the CPU (one log
    /// line says why); a device failure later continues on the CPU.
    #[default]
    Auto,
    /// The CPU backend (the oracle).
    Cpu,
    /// The GPU (software adapters accepted); any failure is an error.
    Gpu,
}

/// Puts a loaded model on `device`. With `verify`, the result runs the CPU oracle in
/// lockstep and fails at the first position whose top-1 token differs.
pub fn runner(
    model: &LoadedModel,
    opts: &RunOptions,
    device: Device,
    gpu: &GpuOptions,
    verify: bool,
) -> Result<Box<dyn Runner>> {
    // A context the model cannot take is the caller's error on every device, not a reason
    // for `auto` to try the CPU.
    if opts.ctx == 0 || opts.ctx > model.config.max_position_embeddings {
        check_context(&model.config, opts.ctx, KvPlacement::Host)?;
    }
    let primary = match device {
        Device::Cpu => cpu_runner(model, opts)?,
        Device::Gpu => gpu_runner(model, opts, &GpuOptions { allow_software: true, ..gpu.clone() })?,
        Device::Auto => match gpu_runner(model, opts, &GpuOptions { allow_software: false, ..gpu.clone() }) {
            Ok(r) => Box::new(crate::fallback::FallbackRunner::new(r, model.clone(), opts.clone())),
            Err(e) => {
                tracing::info!("running on the CPU: {e}");
                cpu_runner(model, opts)?
            }
        },
    };
    if verify {
        return Ok(Box::new(crate::lockstep::LockstepRunner::new(primary, cpu_runner(model, opts)?)));
    }
    Ok(primary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{SynthShape, SynthSpec};

    fn config(shape: SynthShape) -> ModelConfig {
        let json = SynthSpec::of(shape).config_json().to_string();
        ModelConfig::from_json_str(&json, Path::new("synth/config.json")).unwrap()
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_default_context_is_the_target_where_its_cache_fits_in_a_quarter_of_the_room() {
        let cfg = config(SynthShape::GptOss20b);
        // 24 layers x 2 x 8 KV heads x 64 x 4 bytes = 96 KiB per position (plus RoPE).
        assert_eq!(cfg.kv_bytes(1), Some(24 * 2 * 8 * 64 * 4));
        let per_position = cfg.kv_bytes(1).unwrap() + cfg.rope_table_bytes(1).unwrap();
        for total in [64 * GIB, 128 * GIB, 1 << 50] {
            assert_eq!(default_ctx_for_memory(&cfg, total), DEFAULT_CTX_TARGET, "{total} bytes");
        }
        // 16 GiB: a quarter of the 12 GiB after the reserve is 3 GiB, just short of 32768
        // positions' 3 GiB plus RoPE: the most that fit, a multiple of 1024.
        let room = (16 * GIB - 4 * GIB) / 4;
        let expected = (room / per_position) as usize / 1024 * 1024;
        assert_eq!(default_ctx_for_memory(&cfg, 16 * GIB), expected);
        assert!((30 * 1024..DEFAULT_CTX_TARGET).contains(&expected), "{expected}");
        // 8 GiB: the reserve is a quarter of RAM (2 GiB); 1.5 GiB holds 15 Ki positions.
        assert_eq!(
            default_ctx_for_memory(&cfg, 8 * GIB),
            ((6 * GIB / 4) / per_position) as usize / 1024 * 1024
        );
        // Tiny machines keep the floor.
        assert_eq!(default_ctx_for_memory(&cfg, GIB), DEFAULT_CTX_FLOOR);
        assert_eq!(default_ctx_for_memory(&cfg, 0), DEFAULT_CTX_FLOOR);
    }

    #[test]
    fn the_default_slots_are_the_full_caches_that_fit_in_the_quarter_of_the_room() {
        let cfg = config(SynthShape::GptOss20b);
        // 96 KiB per position: 32768 positions are 3 GiB a cache.
        let per_slot = cfg.kv_bytes(DEFAULT_CTX_TARGET).unwrap();
        assert_eq!(per_slot, 3 * GIB);
        // 128 GiB: a quarter of 124 GiB holds ten; capped.
        assert_eq!(default_parallel_for_memory(&cfg, DEFAULT_CTX_TARGET, 128 * GIB), DEFAULT_PARALLEL_MAX);
        // 32 GiB: a quarter of 28 GiB is 7 GiB, two caches.
        assert_eq!(default_parallel_for_memory(&cfg, DEFAULT_CTX_TARGET, 32 * GIB), 2);
        // 16 GiB: 3 GiB of room, not one whole cache: still one slot.
        assert_eq!(default_parallel_for_memory(&cfg, DEFAULT_CTX_TARGET, 16 * GIB), 1);
        // A short context leaves room for more.
        assert_eq!(default_parallel_for_memory(&cfg, 4096, 16 * GIB), DEFAULT_PARALLEL_MAX);
        assert_eq!(default_parallel_for_memory(&cfg, usize::MAX, 1 << 50), 1);
    }

    #[test]
    fn the_default_gpu_slots_are_the_full_caches_that_fit_in_a_quarter_of_80_percent_of_vram() {
        let cfg = config(SynthShape::GptOss20b);
        let f32 = KvPrecision::F32;
        // 3 GiB a cache at the target context. 80 GiB: a quarter of 64 GiB holds five; capped.
        assert_eq!(default_parallel_for_vram(&cfg, DEFAULT_CTX_TARGET, 80 * GIB, f32), DEFAULT_PARALLEL_MAX);
        // 24 GiB: a quarter of 19.2 GiB is 4.8 GiB, one cache.
        assert_eq!(default_parallel_for_vram(&cfg, DEFAULT_CTX_TARGET, 24 * GIB, f32), 1);
        // 40 GiB: 8 GiB of room, two caches.
        assert_eq!(default_parallel_for_vram(&cfg, DEFAULT_CTX_TARGET, 40 * GIB, f32), 2);
        // A short context (384 MiB a cache) leaves room for more; too little memory, one.
        assert_eq!(default_parallel_for_vram(&cfg, 4096, 24 * GIB, f32), DEFAULT_PARALLEL_MAX);
        assert_eq!(default_parallel_for_vram(&cfg, DEFAULT_CTX_TARGET, GIB, f32), 1);
        assert_eq!(default_parallel_for_vram(&cfg, usize::MAX, 1 << 50, f32), 1);
        // An F16 cache is 1.5 GiB at the target context: 4.8 GiB of room on 24 GiB holds three,
        // 8 GiB on 40 GiB five (capped at four).
        let f16 = KvPrecision::F16;
        assert_eq!(KvPrecision::F16.cache_bytes(&cfg, DEFAULT_CTX_TARGET), Some(3 * GIB / 2));
        assert_eq!(default_parallel_for_vram(&cfg, DEFAULT_CTX_TARGET, 24 * GIB, f16), 3);
        assert_eq!(default_parallel_for_vram(&cfg, DEFAULT_CTX_TARGET, 40 * GIB, f16), DEFAULT_PARALLEL_MAX);
        assert_eq!(default_parallel_for_vram(&cfg, usize::MAX, 1 << 50, f16), 1);
    }

    #[test]
    fn the_default_context_grows_with_the_model_and_never_passes_its_maximum() {
        let big = config(SynthShape::GptOss120b);
        let small = config(SynthShape::GptOss20b);
        // 36 layers need more memory for the same positions.
        assert!(default_ctx_for_memory(&big, 16 * GIB) < default_ctx_for_memory(&small, 16 * GIB));
        assert_eq!(default_ctx_for_memory(&big, 64 * GIB), DEFAULT_CTX_TARGET);
        let mut short = small.clone();
        short.max_position_embeddings = 2048;
        assert_eq!(default_ctx_for_memory(&short, 128 * GIB), 2048);
        assert_eq!(default_ctx_for_memory(&short, 0), 2048);
        // Every result is a context check_context's limits accept.
        for total in [0, GIB, 8 * GIB, 16 * GIB, 1 << 40] {
            let ctx = default_ctx_for_memory(&big, total);
            assert!((1..=big.max_position_embeddings).contains(&ctx), "{ctx}");
        }
    }
}
