//! Subcommands of the `picchio` binary. Each lives in its own module; this one holds the
//! argument definitions shared by all of them.

mod bench;
mod bench_gpu;
mod chat;
mod convert;
mod devices;
mod generate;
pub mod runtime_dir;
mod serve;
mod synth;
mod tokens;
mod verify;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use picchio::format::container::{DenseFormat, ExpertFormat, Formats};

/// Picchio runs GPT-OSS mixture-of-experts models locally.
#[derive(Parser, Debug)]
#[command(name = "picchio", version, about, long_about = None)]
pub struct Cli {
    /// More log output on stderr (-v: debug, -vv: trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true)]
    pub quiet: bool,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate token IDs from a raw-ID prompt (greedy by default).
    Generate(generate::GenerateArgs),
    /// Convert a Hugging Face checkpoint into a Picchio container.
    Convert(convert::ConvertArgs),
    /// Re-hash every tensor and expert of a container against its manifest.
    Verify(verify::VerifyArgs),
    /// Write a random GPT-OSS or Qwen3-MoE checkpoint of exact shape (for benchmarks and tests).
    Synth(synth::SynthArgs),
    /// Measure prefill and decode speed (the key/value cache holds the positions the run needs
    /// unless `--ctx` says more).
    Bench(bench::BenchArgs),
    /// Time each hot GPU kernel at GPT-OSS-20B's shapes on a random model in memory, against
    /// a buffer-to-buffer copy of the same bytes (no model file needed).
    #[command(name = "bench-gpu")]
    BenchGpu(bench_gpu::BenchGpuArgs),
    /// Serve a session to another program (stdio line protocol or OpenAI-compatible HTTP).
    Serve(serve::ServeArgs),
    /// Chat with the model in the terminal.
    Chat(chat::ChatArgs),
    /// List GPU adapters: backend, type, memory, the limits and features Picchio uses.
    Devices(devices::DevicesArgs),
    /// Print the o200k_harmony token IDs of a text.
    Tokenize(tokens::TokenizeArgs),
    /// Print the token IDs of the prompt a chat completions request renders to.
    Render(tokens::RenderArgs),
}

/// An on/off switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Toggle {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

/// Options every command that runs a model takes.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model directory: a Picchio container, or a Hugging Face checkpoint (converted on
    /// first use into the cache directory). Default: the tiny model in fixtures/.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// RAM for the expert cache, in GiB (default: physical RAM minus dense weights, KV
    /// cache and a reserve for the system).
    #[arg(long)]
    pub ram_gb: Option<f64>,
    /// Where converted copies of Hugging Face checkpoints are kept (default: the user
    /// cache directory, e.g. ~/.cache/picchio).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Expert format when a Hugging Face checkpoint is converted.
    #[arg(long, value_enum, default_value_t = ExpertFormat::Auto)]
    pub experts: ExpertFormat,
    /// Dense format when a Hugging Face checkpoint is converted.
    #[arg(long, value_enum, default_value_t = DenseFormat::Auto)]
    pub dense: DenseFormat,
    /// Print cache, disk and timing statistics at the end.
    #[arg(long)]
    pub stats: bool,
    /// Context capacity in positions (the key/value cache size). Default: 32768 when that
    /// cache takes at most a quarter of the RAM left after a system reserve (4 GiB, or a
    /// quarter of RAM), else the most that does (a multiple of 1024, at least 4096); never
    /// above the model's maximum.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where to run: `auto` (a hardware GPU if one takes the model, else the CPU),
    /// `cpu`, or `gpu` (software adapters accepted; failures are errors).
    #[arg(long, value_enum, default_value_t = picchio::engine::Device::Auto)]
    pub device: picchio::engine::Device,
    /// Graphics API for the GPU (default: `WGPU_BACKEND`, else the best adapter of any).
    #[arg(long, value_enum)]
    pub gpu_backend: Option<picchio::backend::gpu::GpuApi>,
    /// VRAM for the expert cache, in GiB (default: from the adapter's memory).
    #[arg(long)]
    pub vram_gb: Option<f64>,
    /// Experts a layer needs that are not in VRAM: `cpu` (computed on the CPU from RAM while
    /// the GPU computes the resident ones; hot experts are promoted into VRAM in the
    /// background) or `upload` (copied into VRAM before the layer runs).
    #[arg(long, value_enum, default_value_t = picchio::backend::gpu::MissPolicy::Cpu)]
    pub expert_misses: picchio::backend::gpu::MissPolicy,
    /// How the GPU stores the key/value cache: `f32` (exact, the CPU oracle's), or `f16`
    /// (IEEE binary16: half the VRAM per position and half the bytes attention reads; each
    /// key and value rounded to 11 significant bits). The CPU always keeps f32.
    #[arg(long, value_enum, default_value_t = picchio::backend::gpu::KvPrecision::F32)]
    pub kv_cache: picchio::backend::gpu::KvPrecision,
    /// Run the CPU oracle in lockstep and stop at the first position whose top-1 token
    /// differs (reports both tokens, margins and the largest logit difference).
    #[arg(long)]
    pub verify: bool,
    /// Run the resident-router prediction (and report its accuracy) even when every
    /// expert is resident in VRAM.
    #[arg(long)]
    pub gpu_predict: bool,
    /// Threads reading experts from disk (the disk queue depth).
    #[arg(long, default_value_t = 4)]
    pub io_threads: usize,
    /// Read experts bypassing the page cache [default: on when the RAM cache cannot hold
    /// every expert].
    #[arg(long, value_enum)]
    pub direct_io: Option<Toggle>,
    /// When the next layer's experts are predicted and prefetched (CPU backend): `late` after
    /// each layer, from the state leaving it (the more accurate); `early` once a layer's
    /// routing is known, from the residual entering its MoE block (its reads overlap that
    /// layer's expert reads and compute, but fewer are right); `off`. In decode the
    /// prediction is each row's experts; in a prompt block, the first group of the next
    /// layer's union (as many as the RAM cache takes at once). Layer 0 is predicted from the
    /// token's embedding under both, so its reads run during its attention.
    #[arg(long, value_enum, default_value_t = picchio::backend::Predict::default())]
    pub predict: picchio::backend::Predict,
    /// The same as `--predict off`.
    #[arg(long, conflicts_with = "predict")]
    pub no_prefetch: bool,
    /// Wait for all of a layer's experts before computing (instead of computing each as it
    /// arrives).
    #[arg(long)]
    pub no_async: bool,
    /// Do not learn or preload the hot set of experts.
    #[arg(long)]
    pub no_hot_set: bool,
    /// What the RAM expert cache evicts: `frequency` admits an expert into the cache only
    /// if it is asked for more often than the one it would displace (scan-resistant: a
    /// prefill or a batch of streams does not flush what decode keeps using); `lru` drops the
    /// least recently used.
    #[arg(long, value_enum, default_value_t = picchio::experts::CachePolicy::Frequency)]
    pub cache_policy: picchio::experts::CachePolicy,
    /// Record every request the RAM expert cache sees in FILE, one line each (`D LAYER IDS`
    /// demanded, `P` predicted, `A` loaded ahead), to replay through other policies with
    /// `benches/cache-sim/cache_sim.py --trace FILE`.
    #[arg(long, value_name = "FILE")]
    pub expert_trace: Option<std::path::PathBuf>,
    /// Use expert records read from disk without checking them against their manifest
    /// hashes (the check runs on the reader threads; this flag exists to measure its cost).
    #[arg(long)]
    pub no_verify_reads: bool,
    /// Size of the pieces an expert record is split into for the reader threads, in KiB (a
    /// multiple of 4): every reader takes the next piece of the most urgent record, so one
    /// record is read with the whole queue depth and the first expert of a layer arrives
    /// early. A size of at least the record reads each record on one thread.
    #[arg(long, default_value_t = (picchio::experts::store::HASHED_READ_CHUNK >> 10) as u64, value_name = "KIB")]
    pub read_piece_kib: u64,
    /// Do not prepare the RAM expert cache's memory after load: by default a background
    /// thread maps and touches its buffers (up to `--ram-gb`), so that the first prompts do
    /// not pay the first touch of every page inside their expert reads; with this flag the
    /// memory is taken only as experts are read.
    #[arg(long)]
    pub lazy_cache_memory: bool,
    /// CPU backend: read the dense weights (attention, routers, head) from the memory-mapped
    /// container, 4 KiB pages, instead of a copy in huge pages made at start (on Linux, the
    /// default: faster decode; the mapped pages stay reclaimable page cache). Saves the copy's
    /// memory (about 1.9 GB for GPT-OSS-20B's default container) where the page cache is short.
    #[arg(long)]
    pub mapped_dense: bool,
    /// Quantize activations to int8 for the integer kernels: faster, but no longer
    /// implementation-exact against the F32 oracle (an error of about 0.3% per product). MXFP4
    /// experts have integer kernels on AVX2, AVX-512 and NEON; INT4 and INT8 weights on AVX-512
    /// VNNI only (elsewhere they keep the exact float kernels). No effect (with a warning) on
    /// the scalar path.
    #[arg(long)]
    pub int8_activations: bool,
    /// Positions processed together in a prefill block.
    #[arg(long, default_value_t = 256)]
    pub prefill_block: usize,
    /// Use only portable shaders (no SUBGROUP or SHADER_F16 even where present).
    #[arg(long, hide = true)]
    pub gpu_portable: bool,
    /// Run prompt blocks' dense products with the matrix-vector kernels instead of the
    /// tiled product (to measure what the tiling gains; docs/perf.md).
    #[arg(long, hide = true)]
    pub gpu_untiled: bool,
    /// Lower the storage binding limit to this many MiB (exercises split tensors).
    #[arg(long, hide = true)]
    pub gpu_max_binding_mb: Option<u64>,
}

impl ModelArgs {
    /// The model directory to use.
    pub fn model_dir(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(picchio::default_model_dir)
    }

    /// The chat format of `model` (loaded from these options): Harmony for GPT-OSS; ChatML
    /// for Qwen3-MoE, its tokenizer read from `tokenizer` (`--tokenizer DIR`) when given,
    /// else from the loaded directory (the container) or the `-m` directory.
    pub fn chat_format(
        &self,
        model: &picchio::engine::LoadedModel,
        tokenizer: Option<&std::path::Path>,
        thinking: bool,
    ) -> anyhow::Result<picchio::chat::ChatFormat> {
        let dirs = match tokenizer {
            Some(dir) => vec![dir.to_path_buf()],
            None => {
                let mut dirs = vec![model.dir.clone()];
                if self.model_dir() != model.dir {
                    dirs.push(self.model_dir());
                }
                dirs
            }
        };
        Ok(picchio::chat::ChatFormat::for_family(model.config.family, &dirs, thinking)?)
    }

    /// Opens the model with these options for a context of `ctx` positions.
    pub fn open(&self, ctx: Option<usize>) -> anyhow::Result<picchio::engine::LoadedModel> {
        self.open_for(ctx, 1)
    }

    /// [`open`](Self::open) for `kv_caches` key/value caches of `ctx` positions (the slots
    /// of a server), so the expert cache's default budget leaves room for all of them.
    pub fn open_for(
        &self,
        ctx: Option<usize>,
        kv_caches: usize,
    ) -> anyhow::Result<picchio::engine::LoadedModel> {
        use anyhow::Context;
        let dir = self.model_dir();
        let ram_bytes = self.ram_gb.map(|g| gib_flag("--ram-gb", g)).transpose()?;
        check_count("--io-threads", self.io_threads, MAX_IO_THREADS)?;
        self.check_ctx_early(&dir, ctx)?;
        // The expert cache's default budget leaves room for the context actually used: the
        // default one, computed from config.json as the front-ends compute it after loading.
        let ctx = ctx
            .or_else(|| picchio::ModelConfig::from_dir(&dir).ok().map(|c| picchio::engine::default_ctx(&c)));
        let opts = picchio::engine::OpenOptions {
            ram_bytes,
            formats: Formats { experts: self.experts, dense: self.dense },
            cache_dir: self.cache_dir.clone(),
            progress: !self.quiet_progress(),
            ctx: ctx.unwrap_or(4096),
            kv_caches,
            io_threads: self.io_threads,
            direct_io: self.direct_io.map(|t| t == Toggle::On),
            hot_set: !self.no_hot_set,
            verify_reads: !self.no_verify_reads,
            cache_policy: self.cache_policy,
            expert_trace: self.expert_trace.clone(),
            read_piece_bytes: read_piece_bytes(self.read_piece_kib)?,
            prepare_memory: !self.lazy_cache_memory,
        };
        picchio::engine::open(&dir, &opts).with_context(|| format!("loading model {}", dir.display()))
    }

    /// Refuses a `--ctx` the model's config.json cannot take (or this machine cannot hold)
    /// before the model is loaded or converted. A config that cannot be read is left to the
    /// load, which reports it.
    fn check_ctx_early(&self, dir: &std::path::Path, ctx: Option<usize>) -> anyhow::Result<()> {
        let (Some(ctx), Ok(cfg)) = (ctx, picchio::ModelConfig::from_dir(dir)) else {
            return Ok(());
        };
        let kv = match self.device {
            picchio::engine::Device::Cpu => picchio::engine::KvPlacement::Host,
            _ => picchio::engine::KvPlacement::Device,
        };
        Ok(picchio::engine::check_context(&cfg, ctx, kv)?)
    }

    /// The GPU options these flags ask for.
    pub fn gpu_options(&self) -> anyhow::Result<picchio::backend::gpu::GpuOptions> {
        use picchio::backend::gpu::{FeatureUse, GpuOptions};
        let vram_bytes = self.vram_gb.map(|g| gib_flag("--vram-gb", g)).transpose()?;
        let max_binding_bytes = self
            .gpu_max_binding_mb
            .map(|m| {
                m.checked_mul(1 << 20)
                    .filter(|&b| b > 0)
                    .ok_or_else(|| anyhow::anyhow!("--gpu-max-binding-mb {m} is out of range (1..2^44)"))
            })
            .transpose()?;
        Ok(GpuOptions {
            api: self.gpu_backend,
            allow_software: false,
            features: if self.gpu_portable {
                FeatureUse { shader_f16: false, subgroup: false }
            } else {
                FeatureUse::default()
            },
            vram_bytes,
            max_binding_bytes,
            predict: self.gpu_predict.then_some(true),
            misses: self.expert_misses,
            fail_at_readback: None,
            kv_caches: 1,
            kv_vram_bytes: None,
            kv_precision: self.kv_cache,
            timestamps: false,
            extra_dispatches: 0,
            untiled_dense: self.gpu_untiled,
        })
    }

    /// Puts `model` on the device these flags choose, with a context of `ctx` positions.
    pub fn runner(
        &self,
        model: &picchio::engine::LoadedModel,
        ctx: usize,
    ) -> anyhow::Result<Box<dyn picchio::engine::Runner>> {
        self.runner_for(model, ctx, 1)
    }

    /// [`runner`](Self::runner) for `kv_caches` key/value caches (the slots of a server): on
    /// the GPU the expert cache's default VRAM budget leaves room for all of them.
    pub fn runner_for(
        &self,
        model: &picchio::engine::LoadedModel,
        ctx: usize,
        kv_caches: usize,
    ) -> anyhow::Result<Box<dyn picchio::engine::Runner>> {
        anyhow::ensure!(self.prefill_block > 0, "--prefill-block must be at least 1");
        anyhow::ensure!(
            !(self.device == picchio::engine::Device::Cpu
                && self.kv_cache == picchio::backend::gpu::KvPrecision::F16),
            "--kv-cache f16 is a GPU option: the CPU backend keeps an f32 key/value cache (use --device gpu or auto)"
        );
        let opts = picchio::engine::RunOptions {
            ctx,
            max_batch: self.prefill_block,
            predict: if self.no_prefetch { picchio::backend::Predict::Off } else { self.predict },
            completion_driven: !self.no_async,
            dense_in_huge_pages: !self.mapped_dense,
        };
        let gpu = picchio::backend::gpu::GpuOptions { kv_caches, ..self.gpu_options()? };
        Ok(picchio::engine::runner(model, &opts, self.device, &gpu, self.verify)?)
    }

    fn quiet_progress(&self) -> bool {
        !std::io::IsTerminal::is_terminal(&std::io::stderr())
    }

    /// Sizes the worker pool and sets process-wide kernel choices.
    pub fn apply_threads(&self) -> anyhow::Result<()> {
        if self.int8_activations {
            anyhow::ensure!(
                picchio::quant::kernels::set_int8_activations(true),
                "--int8-activations came too late: kernels were already in use"
            );
            let path = picchio::quant::kernels::selected();
            if !path.quantizes_activations() {
                tracing::warn!(
                    "--int8-activations has no effect with the {} kernels: they have no integer \
                     kernels, so the exact float kernels run",
                    path.name()
                );
            }
        }
        if let Some(n) = self.threads {
            check_count("--threads", n, MAX_THREADS)?;
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build_global()
                .map_err(|e| anyhow::anyhow!("--threads {n}: cannot start the worker threads: {e}"))?;
        }
        Ok(())
    }
}

/// Most worker threads `--threads` accepts: far more than any machine has cores, few
/// enough that starting them cannot exhaust the OS.
pub const MAX_THREADS: usize = 1024;

/// Most expert reader threads `--io-threads` accepts (the disk queue depth; no disk gains
/// from more).
pub const MAX_IO_THREADS: usize = 256;

/// Largest memory flag (`--ram-gb`, `--vram-gb`) in GiB: 1 PiB, beyond any machine.
pub const MAX_GIB: f64 = (1u64 << 20) as f64;

/// Checks a count flag: `1..=max`, the error naming the flag and the value.
pub fn check_count(flag: &str, n: usize, max: usize) -> anyhow::Result<()> {
    anyhow::ensure!((1..=max).contains(&n), "{flag} {n} is out of range (1..={max})");
    Ok(())
}

/// Converts a memory flag in GiB to bytes: a finite positive number up to [`MAX_GIB`],
/// the error naming the flag and the value.
pub fn gib_flag(flag: &str, gib: f64) -> anyhow::Result<u64> {
    anyhow::ensure!(
        gib.is_finite() && gib > 0.0 && gib <= MAX_GIB,
        "{flag} must be a positive number of GiB up to {MAX_GIB}, got {gib}"
    );
    // In range: at most 2^50 bytes, exact in f64 and in u64.
    Ok((gib * (1u64 << 30) as f64) as u64)
}

/// Sends logs to stderr, filtered by `RUST_LOG` or the verbosity flags.
pub fn init_logging(verbose: u8, quiet: bool) {
    let default = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "info",
        (false, 1) => "debug",
        (false, _) => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a terminal: a log file or pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .without_time()
        .init();
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Verify(args) => verify::run(args),
        Command::Synth(args) => synth::run(args),
        Command::Bench(args) => bench::run(args),
        Command::BenchGpu(args) => bench_gpu::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Devices(args) => devices::run(args),
        Command::Tokenize(args) => tokens::tokenize(args),
        Command::Render(args) => tokens::render(args),
    }
}

/// Prints where time went and what the expert cache did (stderr).
pub fn print_stats(
    runner: &dyn picchio::engine::Runner,
    prompt: usize,
    generated: usize,
    wall: std::time::Duration,
) {
    let t = runner.times();
    let e = runner.expert_stats();
    let secs = wall.as_secs_f64().max(1e-9);
    eprintln!(
        "stats: {prompt} prompt + {generated} generated positions in {secs:.3} s ({:.2} positions/s)",
        (prompt + generated) as f64 / secs
    );
    eprintln!(
        "  time: attention {:.3} s, experts {:.3} s (of which disk wait {:.3} s), head {:.3} s",
        t.attention.as_secs_f64(),
        t.experts.as_secs_f64(),
        e.disk_wait.as_secs_f64(),
        t.head.as_secs_f64()
    );
    eprintln!(
        "  expert cache: {} hits, {} misses ({:.1}% hits), {} read, {} evictions",
        e.hits,
        e.misses,
        100.0 * e.hit_rate(),
        picchio::system::gib(e.bytes_read),
        e.evictions
    );
    if e.predicted > 0 || e.prediction_gated > 0 {
        eprintln!(
            "  prediction: {:.1}% right; {} reads ({} useful, {} wasted, {} cancelled unread, {} stopped part-read); {} not read \
             (not paying); {:.3} s of reads hidden, {:.3} s wasted; {} background reads promoted on demand",
            100.0 * e.prediction_accuracy().unwrap_or(0.0),
            e.prefetch_reads,
            e.prefetch_useful,
            e.prefetch_wasted,
            e.prefetch_cancelled,
            e.prefetch_abandoned,
            e.prediction_gated,
            e.prefetch_hidden.as_secs_f64(),
            e.prefetch_cost.as_secs_f64(),
            e.promoted
        );
    }
    for line in runner.report() {
        eprintln!("  {line}");
    }
}

/// `--read-piece-kib` in bytes: a multiple of 4 KiB (direct I/O), at most 1 GiB.
fn read_piece_bytes(kib: u64) -> anyhow::Result<usize> {
    if kib == 0 || !kib.is_multiple_of(4) || kib > 1 << 20 {
        anyhow::bail!("--read-piece-kib {kib}: must be a multiple of 4 between 4 and 1048576 (1 GiB)");
    }
    usize::try_from(kib << 10)
        .map_err(|_| anyhow::anyhow!("--read-piece-kib {kib} is too large for this machine"))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn read_pieces_are_whole_4_kib_pages() {
        assert_eq!(super::read_piece_bytes(2048).unwrap(), 2 << 20);
        for kib in [0, 6, 1025 * 1024] {
            let e = super::read_piece_bytes(kib).unwrap_err().to_string();
            assert!(e.contains(&format!("--read-piece-kib {kib}")), "{e}");
        }
    }

    #[test]
    fn numeric_flags_are_bounded() {
        assert!(super::check_count("--io-threads", 4, 256).is_ok());
        for n in [0, 257, usize::MAX] {
            let e = super::check_count("--io-threads", n, 256).unwrap_err().to_string();
            assert!(e.contains(&format!("--io-threads {n}")), "{e}");
        }
        assert_eq!(super::gib_flag("--ram-gb", 1.5).unwrap(), 3 << 29);
        for g in [-1.0, 0.0, f64::NAN, f64::INFINITY, 1e30] {
            let e = super::gib_flag("--ram-gb", g).unwrap_err().to_string();
            assert!(e.contains("--ram-gb"), "{e}");
        }
    }

    /// No two arguments of a command share a long or short name (clap only checks this in
    /// debug builds, and the tests run in release).
    #[test]
    fn argument_names_are_unique_in_every_command() {
        fn check(cmd: &clap::Command, path: &str) {
            let (mut longs, mut shorts) =
                (std::collections::HashSet::new(), std::collections::HashSet::new());
            for a in cmd.get_arguments() {
                if let Some(l) = a.get_long() {
                    assert!(longs.insert(l.to_string()), "`{path}` declares --{l} twice");
                }
                if let Some(s) = a.get_short() {
                    assert!(shorts.insert(s), "`{path}` declares -{s} twice");
                }
            }
            for sub in cmd.get_subcommands() {
                check(sub, &format!("{path} {}", sub.get_name()));
            }
        }
        check(&super::Cli::command(), "picchio");
    }
}
