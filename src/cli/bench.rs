//! `picchio bench`: prefill and decode speed on a model, with where time went, the cache,
//! memory, and the decode time against the floor set by the bytes a token must read.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use picchio::bench::{
    RecordReadSpeed, copy_bandwidth, decode_bytes_per_token, disk_read_bandwidth, disk_record_bandwidth,
    prompt_ids, read_bandwidth,
};
use picchio::constrain::{Grammar, Vocabulary};
use picchio::experts::ExpertStats;
use picchio::experts::routing::{Concentration, RouteCounts};
use picchio::model::forward::PhaseTimes;
use picchio::model::{LogitRows, NoObserver};
use picchio::quant::kernels;
use picchio::sample::Sampler;
use picchio::session::Session;
use picchio::system::{cpu_description, gib, peak_rss, total_memory};
use serde_json::json;

use super::ModelArgs;

/// Arguments of `picchio bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length (random token IDs).
    #[arg(long, default_value_t = 64)]
    prompt: usize,
    /// Tokens to decode after the prompt.
    #[arg(long = "gen", default_value_t = 32)]
    decode_tokens: usize,
    /// Seed of the random prompt.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Do not load every expert into the RAM cache before timing (measure cold reads).
    #[arg(long)]
    no_preload: bool,
    /// Do not run the one warm-up token (rewound before timing) that pages in the dense
    /// weights and starts the worker threads.
    #[arg(long)]
    no_warmup: bool,
    /// Warm up with the whole prompt instead of one token (rewound before timing), as
    /// llama-bench's warm-up run does: the timed prefill then finds in the RAM cache what the
    /// same prompt read, so it measures a warm cache rather than a cold one.
    #[arg(long, conflicts_with = "no_warmup")]
    warmup_prompt: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Constrain the decode to JSON lines valid against the JSON schema in FILE (greedy,
    /// masks computed beside the forward pass as when serving) and report the grammar's
    /// time per token.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<std::path::PathBuf>,
    /// Instead of one stream, measure aggregate decode speed and expert traffic for each
    /// number of concurrent streams in the list (e.g. `1,2,4,8`): each stream a slot with
    /// its own random prompt, their decode steps batched; one row per count.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', conflicts_with = "json_schema",
          value_parser = clap::value_parser!(u64).range(1..=256))]
    streams: Vec<u64>,
    /// Skip the untimed pass after the timing that re-runs the prompt and the generated
    /// tokens (with `--streams`, those of every stream of the last count) to measure how
    /// concentrated their routing is.
    #[arg(long)]
    no_routing: bool,
}

/// The routing concentration of `sequences` (each a run's prompt and generated tokens),
/// measured in untimed passes from position 0 with the router's decisions observed. The
/// passes go through the expert source like any other (their reads and a learned hot set's
/// usage counts included), so they run after every timed counter has been taken.
fn measure_routing(
    session: &mut Session,
    sequences: &[Vec<u32>],
    experts: usize,
) -> anyhow::Result<Concentration> {
    // Untimed, but as long as a prefill of these tokens (and, with experts on disk, a read of
    // most of them): say so, or the wait after the measurements looks like a hang.
    tracing::info!(
        "timing done; re-running {} prompt and generated tokens, untimed, to measure routing \
         concentration (--no-routing skips this)",
        sequences.iter().map(Vec::len).sum::<usize>()
    );
    let mut counts = RouteCounts::new(experts);
    for ids in sequences {
        session.rewind(0)?;
        session.feed(ids, LogitRows::None, &mut counts)?;
    }
    Ok(counts.concentration())
}

/// Prints the routing line of the table.
fn print_routing(c: &Concentration) {
    println!(
        "routing: the top 10% / 25% of each layer's experts got {:.1}% / {:.1}% of its {} choices \
         (uniform routing of as many tokens: {:.1}% / {:.1}%; mean of {} layers, prompt and \
         generated tokens re-run untimed)",
        100.0 * c.top10,
        100.0 * c.top25,
        c.requests_per_layer,
        100.0 * c.uniform_top10,
        100.0 * c.uniform_top25,
        c.layers
    );
}

/// The routing concentration as JSON.
fn routing_json(c: &Concentration) -> serde_json::Value {
    json!({
        "layers": c.layers,
        "requests_per_layer": c.requests_per_layer,
        "top10_share": c.top10,
        "top25_share": c.top25,
        "uniform_top10_share": c.uniform_top10,
        "uniform_top25_share": c.uniform_top25,
    })
}

fn delta_times(a: PhaseTimes, b: PhaseTimes) -> PhaseTimes {
    PhaseTimes { attention: b.attention - a.attention, experts: b.experts - a.experts, head: b.head - a.head }
}

fn delta_stats(a: ExpertStats, b: ExpertStats) -> ExpertStats {
    b.since(&a)
}

struct Phase {
    tokens: usize,
    wall: Duration,
    times: PhaseTimes,
    experts: ExpertStats,
}

impl Phase {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// Wall time not spent waiting on the disk.
    fn compute(&self) -> f64 {
        (self.wall.as_secs_f64() - self.experts.disk_wait.as_secs_f64()).max(0.0)
    }

    /// Bytes of the reads whose expert was used (wasted prefetches excluded).
    fn useful_bytes(&self) -> f64 {
        let e = &self.experts;
        let per_read = if e.reads > 0 { e.bytes_read as f64 / e.reads as f64 } else { 0.0 };
        e.useful_reads() as f64 * per_read
    }

    /// `max(needed bytes / disk bandwidth, compute time)`: what the phase would take if
    /// every needed read streamed at the disk's speed behind the computation. Prefetches
    /// that were never used count against the phase, not towards its floor.
    fn floor(&self, disk_bw: f64) -> f64 {
        let io = if disk_bw > 0.0 { self.useful_bytes() / disk_bw } else { 0.0 };
        io.max(self.compute())
    }

    fn json(&self, disk_bw: f64) -> serde_json::Value {
        let e = &self.experts;
        json!({
            "tokens": self.tokens,
            "seconds": self.wall.as_secs_f64(),
            "tokens_per_s": self.tokens_per_s(),
            "attention_s": self.times.attention.as_secs_f64(),
            "experts_s": self.times.experts.as_secs_f64(),
            "head_s": self.times.head.as_secs_f64(),
            "disk_wait_s": e.disk_wait.as_secs_f64(),
            "cache_hit_rate": e.hit_rate(),
            "reads": e.reads,
            "bytes_read": e.bytes_read,
            "bytes_read_per_token": e.bytes_read as f64 / self.tokens.max(1) as f64,
            "prediction_accuracy": e.prediction_accuracy(),
            "predicted": e.predicted,
            "predicted_right": e.predicted_right,
            "prefetch_reads": e.prefetch_reads,
            "prefetch_useful": e.prefetch_useful,
            "prefetch_wasted": e.prefetch_wasted,
            "prefetch_pending": e.prefetch_pending,
            "prefetch_cancelled": e.prefetch_cancelled,
            "prefetch_abandoned": e.prefetch_abandoned,
            "promoted": e.promoted,
            "prediction_gated": e.prediction_gated,
            "prefetch_hidden_s": e.prefetch_hidden.as_secs_f64(),
            "prefetch_cost_s": e.prefetch_cost.as_secs_f64(),
            "disk_busy_s": e.disk_busy.as_secs_f64(),
            "disk_busy_stretches": e.busy_stretches,
            "disk_busy_bytes_per_s": e.bytes_read as f64 / e.disk_busy.as_secs_f64().max(1e-9),
            "check_s": e.check_time.as_secs_f64(),
            "reads_in_flight": e.read_time.as_secs_f64() / e.disk_busy.as_secs_f64().max(1e-9),
            "useful_bytes_read": self.useful_bytes(),
            "floor_s": self.floor(disk_bw),
            "over_floor": self.wall.as_secs_f64() / self.floor(disk_bw).max(1e-9),
        })
    }
}

/// The faster of the two record measurements (before and after the timed phases): the
/// floor's disk bandwidth.
fn faster_disk(before: Option<RecordReadSpeed>, after: Option<RecordReadSpeed>) -> Option<RecordReadSpeed> {
    match (before, after) {
        (Some(b), Some(a)) => Some(if a.bytes_per_s > b.bytes_per_s { a } else { b }),
        (b, a) => b.or(a),
    }
}

/// The disk line of the table: the records' bandwidth before and after the timed phases (the
/// faster is the floor's) and the sequential one.
fn disk_line(
    before: Option<RecordReadSpeed>,
    after: Option<RecordReadSpeed>,
    seq_bw: f64,
    seq_direct: bool,
    readers: usize,
) -> String {
    let how = |direct: bool| if direct { "direct" } else { "through the page cache" };
    // The sequential measurement needs 8 MiB per stream; smaller files give none.
    let sequential = if seq_bw > 0.0 {
        format!("{:.2} GB/s in {readers} sequential streams ({})", seq_bw / 1e9, how(seq_direct))
    } else {
        "sequential streams not measured (file too small)".to_string()
    };
    match faster_disk(before, after) {
        None => "disk: not measured (no expert file)".to_string(),
        Some(d) => format!(
            "disk: {:.2} GB/s reading {} records in {} MiB pieces shared by {readers} readers ({}; the floor's: \
             the faster of {:.2} GB/s before the runs and {:.2} after), {sequential}",
            d.bytes_per_s / 1e9,
            d.records,
            picchio::experts::store::HASHED_READ_CHUNK >> 20,
            how(d.direct),
            before.map_or(0.0, |b| b.bytes_per_s) / 1e9,
            after.map_or(0.0, |a| a.bytes_per_s) / 1e9,
        ),
    }
}

/// Runs `picchio bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    args.model.apply_threads()?;
    anyhow::ensure!(args.prompt > 0, "--prompt must be at least 1");
    let needed =
        args.prompt.checked_add(args.decode_tokens).and_then(|n| n.checked_add(1)).ok_or_else(|| {
            anyhow::anyhow!(
                "--prompt {} plus --gen {} positions is too large",
                args.prompt,
                args.decode_tokens
            )
        })?;
    // Without `--ctx`, the positions this run needs (not the serving default, whose key/value
    // cache would take RAM from the expert cache being measured).
    let ctx = args.model.ctx.unwrap_or(needed).max(needed);
    let model = args.model.open(Some(ctx))?;
    let cfg = model.config.clone();
    let threads = rayon::current_num_threads();

    let expert_bytes = model.experts.expert_bytes();
    let token_bytes = decode_bytes_per_token(&model, expert_bytes);
    let experts_file = model.dir.join(picchio::format::container::manifest::EXPERTS_FILE);
    let all_experts = (cfg.num_layers * cfg.num_experts) as u64;
    let fits = model.experts.batch_limit() as u64 * 2 >= all_experts;
    // The floor's disk bandwidth is measured the way the expert readers read: whole records
    // at scattered offsets, in pieces pulled by every reader; the sequential figure beside it
    // says what the same disk gives to long contiguous reads.
    // A virtual disk's speed drifts within a run (1.53 to 3.11 GB/s between runs a minute
    // apart on a 2-core Zen 4 VM): the records are measured again after the timed phases, and
    // the floor takes the faster of the two, so a slow moment at the start cannot put the
    // floor below what the disk gave the run.
    let records = if experts_file.exists() {
        let container = picchio::format::container::Container::open(&model.dir)?;
        let store = container.experts();
        Some((store.records.iter().map(|r| r.offset).collect::<Vec<u64>>(), store.record_bytes()))
    } else {
        None
    };
    let io = args.model.io_threads;
    let record_speed = |seed: u64| -> anyhow::Result<Option<RecordReadSpeed>> {
        let Some((offsets, record_bytes)) = &records else { return Ok(None) };
        Ok(Some(disk_record_bandwidth(&experts_file, offsets, *record_bytes, 1 << 30, io, seed)?))
    };
    let disk_before = record_speed(1)?;
    let (disk_seq_bw, disk_seq_direct) =
        if records.is_some() { disk_read_bandwidth(&experts_file, 1 << 30, io)? } else { (0.0, false) };

    if fits && !args.no_preload {
        let t0 = Instant::now();
        let all: Vec<usize> = (0..cfg.num_experts).collect();
        // Not counted as uses: the learned hot set stays what the runs use.
        for l in 0..cfg.num_layers {
            model.experts.preload(l, &all)?;
        }
        tracing::info!("preloaded every expert in {:.1} s", t0.elapsed().as_secs_f64());
    }
    // The cache's memory, prepared in the background after load, is ready before the clock
    // starts, as a served session's first prompt finds it after a few idle seconds.
    if let Some(p) = model.experts.wait_prepared()
        && p.buffers > 0
    {
        tracing::info!(
            "expert cache memory prepared: {} buffers ({:.2} GiB) in {:.1} s",
            p.buffers,
            p.buffers as f64 * expert_bytes as f64 / (1u64 << 30) as f64,
            p.elapsed.as_secs_f64()
        );
    }
    if !args.streams.is_empty() {
        return streams::run(&args, &model, ctx);
    }
    let runner = args.model.runner(&model, ctx)?;
    let description = runner.describe();
    let mut session = Session::new(runner);
    let prompt = prompt_ids(args.prompt, cfg.vocab_size, args.seed);
    // One warm-up token (or the whole prompt), then rewound, as llama-bench's warm-up run:
    // it pages in the dense weights (memory-mapped, perhaps evicted by whatever ran before)
    // and starts the worker threads, so that neither is charged to the prefill.
    if !args.no_warmup {
        let warmup = if args.warmup_prompt { &prompt[..] } else { &prompt[..1.min(prompt.len())] };
        session.feed(warmup, LogitRows::Last, &mut NoObserver)?;
        session.rewind(0)?;
    }

    let snap = |s: &Session| (s.runner().times(), s.runner().expert_stats());
    let (t_a, e_a) = snap(&session);
    let t0 = Instant::now();
    session.feed(&prompt, LogitRows::Last, &mut NoObserver)?;
    let prefill_wall = t0.elapsed();
    let (t_b, e_b) = snap(&session);
    let counters_before = session.runner().decode_counters();
    let mut sampler = Sampler::greedy();
    let mut grammar_setup = None;
    if let Some(path) = &args.json_schema {
        let t = Instant::now();
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let schema: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        let vocab = Vocabulary::shared(cfg.vocab_size)?;
        let grammar =
            Grammar::json_lines(&schema, &vocab).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        sampler = sampler.with_constraint(Box::new(grammar.start()));
        grammar_setup = Some(t.elapsed());
    }
    let t1 = Instant::now();
    let generation = session.generate(&[], args.decode_tokens, &mut sampler, &[], &mut |_| true)?;
    let decode_wall = t1.elapsed();
    // Per decoded token: the mask's compute time (on its own thread) and how long sampling
    // waited for it (what the grammar adds to the decode).
    let grammar = sampler.constraint().map(|c| {
        let s = c.stats();
        let per = |d: Duration| 1e3 * d.as_secs_f64() / s.masks.max(1) as f64;
        (s.masks, per(s.compute), per(s.waited), grammar_setup.unwrap_or_default())
    });
    let (t_c, e_c) = snap(&session);
    // Peak memory of the runs, before the floors' buffers (1.5 GiB) add to it.
    let rss = peak_rss().unwrap_or(0);
    // The memory floors, measured in this run, after the timed phases: measured before, while
    // the cache's buffers were still being prepared in the background, `read` gave 20-29 GB/s
    // against 40-44 in a process of its own (2-core Zen 5 VM), and measured between
    // preparation and prefill, their buffers pushed the memory-mapped dense weights out of the
    // page cache and the prefill lost 15-30%.
    let copy_bw = copy_bandwidth(512 << 20, 5);
    let read_bw = read_bandwidth(512 << 20, 5);
    // Other records than the first measurement's (another seed), so that a buffered read
    // cannot find them in the page cache.
    let disk_after = record_speed(2)?;
    let disk = faster_disk(disk_before, disk_after);
    let disk_bw = disk.map_or(0.0, |d| d.bytes_per_s);
    // What the device was asked per decoded token (GPU backends count it).
    let device_decode = session.runner().decode_counters().map(|c| match &counters_before {
        Some(b) => c.since(b),
        None => c,
    });
    let prefill = Phase {
        tokens: args.prompt,
        wall: prefill_wall,
        times: delta_times(t_a, t_b),
        experts: delta_stats(e_a, e_b),
    };
    let decode = Phase {
        tokens: generation.tokens.len(),
        wall: decode_wall,
        times: delta_times(t_b, t_c),
        experts: delta_stats(e_b, e_c),
    };
    let n_dec = decode.tokens.max(1) as f64;
    let ms_per_token = 1e3 * decode.wall.as_secs_f64() / n_dec;
    let copy_floor = token_bytes as f64 / copy_bw;
    let read_floor = token_bytes as f64 / read_bw;
    let gpu = if description.starts_with("gpu ") {
        description.split(';').next().unwrap_or("").trim_start_matches("gpu ").to_string()
    } else {
        "none (CPU backend)".to_string()
    };
    let path = kernels::selected();
    let machine = format!(
        "{}; {threads} threads; kernels {}{}; RAM {}; GPU: {gpu}",
        cpu_description(),
        path.name(),
        if path.quantizes_activations() { " (int8 activations)" } else { "" },
        total_memory().map_or("unknown".into(), gib)
    );
    let report = session.runner().report();
    let routing = if args.no_routing {
        None
    } else {
        let ids: Vec<u32> = prompt.iter().chain(&generation.tokens).copied().collect();
        Some(measure_routing(&mut session, &[ids], cfg.num_experts)?)
    };

    if args.json {
        let out = json!({
            "model": model.dir.display().to_string(),
            "machine": machine,
            "backend": description,
            "prefill": prefill.json(disk_bw),
            "decode": decode.json(disk_bw),
            "copy_bandwidth_bytes_per_s": copy_bw,
            "read_bandwidth_bytes_per_s": read_bw,
            "disk_read_bandwidth_bytes_per_s": disk_bw,
            "disk_read_bandwidth_before_bytes_per_s": disk_before.map_or(0.0, |d| d.bytes_per_s),
            "disk_read_bandwidth_after_bytes_per_s": disk_after.map_or(0.0, |d| d.bytes_per_s),
            "disk_read_direct": disk.is_some_and(|d| d.direct),
            "disk_read_pattern": disk.map(|d| json!({
                "records": d.records,
                "requests": d.requests,
                "request_bytes": picchio::experts::store::HASHED_READ_CHUNK,
                "bytes": d.bytes,
                "readers": args.model.io_threads,
                "order": "pseudo-random records, pieces from a shared queue",
                "destination_bytes": picchio::bench::READ_DESTINATION_BYTES,
            })),
            "disk_sequential_bandwidth_bytes_per_s": disk_seq_bw,
            "disk_sequential_direct": disk_seq_direct,
            "decode_bytes_per_token": token_bytes,
            "decode_copy_floor_s_per_token": copy_floor,
            "decode_over_copy_floor": ms_per_token / 1e3 / copy_floor,
            "decode_read_floor_s_per_token": read_floor,
            "decode_over_read_floor": ms_per_token / 1e3 / read_floor,
            "peak_rss_bytes": rss,
            "device_report": report,
            "device_decode": device_decode.as_ref().map(|c| c.json()),
            "routing": routing.as_ref().map(routing_json),
            "grammar": grammar.map(|(masks, compute_ms, waited_ms, setup)| json!({
                "masks": masks,
                "mask_compute_ms_per_token": compute_ms,
                "mask_wait_ms_per_token": waited_ms,
                "setup_s": setup.as_secs_f64(),
            })),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("model    {}", model.dir.display());
    println!("machine  {machine}");
    println!("backend  {description}");
    println!();
    println!(
        "{:<8} {:>6} {:>8} {:>10} {:>9} {:>8} {:>8} {:>8} {:>7} {:>10} {:>9}",
        "phase",
        "tokens",
        "tok/s",
        "attention",
        "experts",
        "head",
        "disk",
        "hit",
        "reads",
        "read/tok",
        "/floor"
    );
    for (name, p) in [("prefill", &prefill), ("decode", &decode)] {
        println!(
            "{:<8} {:>6} {:>8.2} {:>9.3}s {:>8.3}s {:>7.3}s {:>7.3}s {:>7.1}% {:>7} {:>10} {:>8.2}x",
            name,
            p.tokens,
            p.tokens_per_s(),
            p.times.attention.as_secs_f64(),
            p.times.experts.as_secs_f64(),
            p.times.head.as_secs_f64(),
            p.experts.disk_wait.as_secs_f64(),
            100.0 * p.experts.hit_rate(),
            p.experts.reads,
            gib(p.experts.bytes_read / p.tokens.max(1) as u64),
            p.wall.as_secs_f64() / p.floor(disk_bw).max(1e-9)
        );
    }
    println!();
    println!(
        "memory: copy {:.2} GB/s, read {:.2} GB/s; {}",
        copy_bw / 1e9,
        read_bw / 1e9,
        disk_line(disk_before, disk_after, disk_seq_bw, disk_seq_direct, args.model.io_threads)
    );
    println!(
        "decode: {} of weights per token, {ms_per_token:.1} ms/token = {:.2}x the copy floor ({:.1} ms), {:.2}x the read floor ({:.1} ms)",
        gib(token_bytes),
        ms_per_token / 1e3 / copy_floor,
        copy_floor * 1e3,
        ms_per_token / 1e3 / read_floor,
        read_floor * 1e3,
    );
    if let Some(c) = &device_decode {
        println!("{}", c.line());
    }
    if let Some(acc) = decode.experts.prediction_accuracy() {
        println!(
            "prediction: {:.1}% of routed experts predicted; {} prefetch reads, {} useful, {} wasted, {} unused so far, \
             {} cancelled unread, {} stopped part-read; {} background reads promoted on demand; {} predictions not read (not paying); \
             {:.2} s of reads hidden, {:.2} s wasted",
            100.0 * acc,
            decode.experts.prefetch_reads,
            decode.experts.prefetch_useful,
            decode.experts.prefetch_wasted,
            decode.experts.prefetch_pending,
            decode.experts.prefetch_cancelled,
            decode.experts.prefetch_abandoned,
            decode.experts.promoted,
            decode.experts.prediction_gated,
            decode.experts.prefetch_hidden.as_secs_f64(),
            decode.experts.prefetch_cost.as_secs_f64()
        );
    }
    println!(
        "prefill {:.2} tok/s, decode {:.2} tok/s, peak RSS {} ('/floor': wall over max(bytes of used reads / disk bandwidth, compute))",
        prefill.tokens_per_s(),
        decode.tokens_per_s(),
        gib(rss)
    );
    if let Some(c) = &routing {
        print_routing(c);
    }
    if let Some((masks, compute_ms, waited_ms, setup)) = grammar {
        println!(
            "grammar: {masks} masks, {compute_ms:.3} ms/token computing (beside the forward pass), \
             {waited_ms:.3} ms/token waited for by sampling; setup {:.2} s (vocabulary trie and schema)",
            setup.as_secs_f64()
        );
    }
    for line in report {
        println!("{line}");
    }
    Ok(())
}

/// `picchio bench --streams`: aggregate decode throughput of several concurrent streams.
mod streams {
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Barrier};
    use std::time::{Duration, Instant};

    use picchio::bench::prompt_ids;
    use picchio::engine::LoadedModel;
    use picchio::experts::ExpertStats;
    use picchio::model::{LogitRows, NoObserver};
    use picchio::sample::Sampler;
    use picchio::session::Session;
    use picchio::slots::Slots;
    use serde_json::json;

    use super::{BenchArgs, measure_routing, print_routing, routing_json};

    /// The decode of one stream count.
    struct Row {
        streams: usize,
        tokens: usize,
        wall: Duration,
        experts: ExpertStats,
        steps: u64,
        step_rows: u64,
    }

    impl Row {
        fn tokens_per_s(&self) -> f64 {
            self.tokens as f64 / self.wall.as_secs_f64().max(1e-9)
        }

        fn per_token(&self, total: u64) -> f64 {
            total as f64 / self.tokens.max(1) as f64
        }

        fn mean_batch(&self) -> f64 {
            self.step_rows as f64 / self.steps.max(1) as f64
        }
    }

    /// Runs every stream count of `args.streams` in turn on `model` (the expert cache stays
    /// warm from one count to the next) and prints a row each.
    pub(super) fn run(args: &BenchArgs, model: &LoadedModel, ctx: usize) -> anyhow::Result<()> {
        let vocab = model.config.vocab_size;
        let mut rows = Vec::new();
        let mut description = String::new();
        // The prompt and generated tokens of every stream of the last count.
        let mut sequences = Vec::new();
        for &n in &args.streams {
            let n = usize::try_from(n)?;
            let runner = args.model.runner_for(model, ctx, n)?;
            description = runner.describe();
            let (slots, sessions) = Slots::start(runner, n, Vec::new())?;
            anyhow::ensure!(
                slots.count() == n,
                "{description} runs {} stream(s) at once, not {n}",
                slots.count()
            );
            let prompts: Vec<Vec<u32>> =
                (0..n).map(|i| prompt_ids(args.prompt, vocab, args.seed.wrapping_add(i as u64))).collect();
            // Every stream's prompt goes in first; the decodes then start together.
            let ready = Arc::new(Barrier::new(n + 1));
            let finished = Arc::new(Barrier::new(n + 1));
            let gen_tokens = args.decode_tokens;
            let (before, t0, generated) = std::thread::scope(|s| -> anyhow::Result<_> {
                let handles: Vec<_> = sessions
                    .into_iter()
                    .zip(&prompts)
                    .map(|(mut session, prompt): (Session, &Vec<u32>)| {
                        let (ready, finished) = (Arc::clone(&ready), Arc::clone(&finished));
                        s.spawn(move || -> anyhow::Result<Vec<u32>> {
                            let fed = session.feed(prompt, LogitRows::Last, &mut NoObserver);
                            ready.wait();
                            fed?;
                            let generated =
                                session.generate(&[], gen_tokens, &mut Sampler::greedy(), &[], &mut |_| true);
                            finished.wait();
                            Ok(generated?.tokens)
                        })
                    })
                    .collect();
                ready.wait();
                let before = (slots.expert_stats(), steps(&slots));
                let t0 = Instant::now();
                finished.wait();
                let generated = handles
                    .into_iter()
                    .map(|h| h.join().map_err(|_| anyhow::anyhow!("a stream panicked"))?)
                    .collect::<anyhow::Result<Vec<Vec<u32>>>>()?;
                Ok((before, t0, generated))
            })?;
            let wall = t0.elapsed();
            let tokens = generated.iter().map(Vec::len).sum();
            sequences = prompts.iter().zip(&generated).map(|(p, g)| [p.as_slice(), g].concat()).collect();
            let (steps_now, rows_now) = steps(&slots);
            rows.push(Row {
                streams: n,
                tokens,
                wall,
                experts: slots.expert_stats().since(&before.0),
                steps: steps_now - before.1.0,
                step_rows: rows_now - before.1.1,
            });
            slots.join();
        }
        let routing = if args.no_routing {
            None
        } else {
            let mut session = Session::new(args.model.runner(model, ctx)?);
            Some(measure_routing(&mut session, &sequences, model.config.num_experts)?)
        };
        if args.json {
            let out: Vec<_> = rows
                .iter()
                .map(|r| {
                    json!({
                        "streams": r.streams,
                        "tokens": r.tokens,
                        "seconds": r.wall.as_secs_f64(),
                        "tokens_per_s": r.tokens_per_s(),
                        "steps": r.steps,
                        "mean_batch": r.mean_batch(),
                        "expert_requests_per_token": r.per_token(r.experts.hits + r.experts.misses),
                        "bytes_read_per_token": r.per_token(r.experts.bytes_read),
                        "cache_hit_rate": r.experts.hit_rate(),
                        "prefetch_reads": r.experts.prefetch_reads,
                        "predicted": r.experts.predicted,
                        "predicted_right": r.experts.predicted_right,
                    })
                })
                .collect();
            let doc = json!({"model": model.dir.display().to_string(), "backend": description,
                             "prompt": args.prompt, "gen": args.decode_tokens, "streams": out,
                             "routing": routing.as_ref().map(routing_json)});
            println!("{}", serde_json::to_string_pretty(&doc)?);
            return Ok(());
        }
        println!("model    {}", model.dir.display());
        println!("backend  {description}");
        println!("each stream: {} prompt tokens, then {} greedy tokens", args.prompt, args.decode_tokens);
        println!("streams  tokens/s  speedup  mean batch  expert requests/token  bytes read/token  hit rate");
        let base = rows.first().map_or(1.0, Row::tokens_per_s);
        for r in &rows {
            println!(
                "{:>7}  {:>8.2}  {:>6.2}x  {:>10.2}  {:>21.1}  {:>15}  {:>7.1} %",
                r.streams,
                r.tokens_per_s(),
                r.tokens_per_s() / base.max(1e-9),
                r.mean_batch(),
                r.per_token(r.experts.hits + r.experts.misses),
                picchio::system::gib(r.per_token(r.experts.bytes_read) as u64),
                100.0 * r.experts.hit_rate(),
            );
        }
        if let Some(c) = &routing {
            print_routing(c);
        }
        Ok(())
    }

    fn steps(slots: &Slots) -> (u64, u64) {
        let c = slots.counters();
        (c.steps.load(Ordering::SeqCst), c.step_rows.load(Ordering::SeqCst))
    }
}
