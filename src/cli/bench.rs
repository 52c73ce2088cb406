//! `picchio bench`: prefill and decode speed on a model, with where time went, the cache,
//! memory, and the decode time against the floor set by the bytes a token must read.

use std::time::{Duration, Instant};

use clap::Args;
use picchio::bench::{copy_bandwidth, decode_bytes_per_token, prompt_ids};
use picchio::engine;
use picchio::experts::ExpertStats;
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
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

struct Phase {
    wall: Duration,
    times: PhaseTimes,
    experts: ExpertStats,
}

fn delta_times(a: PhaseTimes, b: PhaseTimes) -> PhaseTimes {
    PhaseTimes { attention: b.attention - a.attention, experts: b.experts - a.experts, head: b.head - a.head }
}

fn delta_stats(a: ExpertStats, b: ExpertStats) -> ExpertStats {
    b.since(&a)
}

/// Runs `picchio bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    args.model.apply_threads()?;
    anyhow::ensure!(args.prompt > 0, "--prompt must be at least 1");
    let model = args.model.open(args.model.ctx)?;
    let cfg = model.config.clone();
    let ctx =
        args.model.ctx.unwrap_or_else(|| engine::default_ctx(&cfg)).max(args.prompt + args.decode_tokens + 1);
    let threads = rayon::current_num_threads();

    let bandwidth = copy_bandwidth(512 << 20, 5);
    let expert_bytes = model.experts.expert_bytes();
    let token_bytes = decode_bytes_per_token(&model, expert_bytes);

    if !args.no_preload {
        let t0 = Instant::now();
        let all: Vec<usize> = (0..cfg.num_experts).collect();
        for l in 0..cfg.num_layers {
            model.experts.experts(l, &all)?;
        }
        tracing::info!("preloaded experts in {:.1} s", t0.elapsed().as_secs_f64());
    }
    let runner = args.model.runner(&model, ctx)?;
    let description = runner.describe();
    let mut session = Session::new(runner);
    let prompt = prompt_ids(args.prompt, cfg.vocab_size, args.seed);

    let snap = |s: &Session| (s.runner().times(), s.runner().expert_stats());
    let (t_a, e_a) = snap(&session);
    let t0 = Instant::now();
    session.feed(&prompt, LogitRows::Last, &mut NoObserver)?;
    let prefill_wall = t0.elapsed();
    let (t_b, e_b) = snap(&session);
    let t1 = Instant::now();
    let generation = session.generate(&[], args.decode_tokens, &mut Sampler::greedy(), &[], &mut |_| true)?;
    let decode_wall = t1.elapsed();
    let (t_c, e_c) = snap(&session);
    let prefill = Phase { wall: prefill_wall, times: delta_times(t_a, t_b), experts: delta_stats(e_a, e_b) };
    let decode = Phase { wall: decode_wall, times: delta_times(t_b, t_c), experts: delta_stats(e_b, e_c) };
    let n_dec = generation.tokens.len().max(1);

    let prefill_tps = args.prompt as f64 / prefill.wall.as_secs_f64();
    let decode_tps = generation.tokens.len() as f64 / decode.wall.as_secs_f64().max(1e-9);
    let floor = token_bytes as f64 / bandwidth;
    let ratio = (decode.wall.as_secs_f64() / n_dec as f64) / floor;
    let rss = peak_rss().unwrap_or(0);
    let gpu = if description.starts_with("gpu ") {
        description.split(';').next().unwrap_or("").trim_start_matches("gpu ").to_string()
    } else {
        "none (CPU backend)".to_string()
    };
    let machine = format!(
        "{}; {threads} threads; kernels {}; RAM {}; GPU: {gpu}",
        cpu_description(),
        kernels::selected().name(),
        total_memory().map_or("unknown".into(), gib)
    );
    let report = session.runner().report();

    if args.json {
        let phase = |p: &Phase, n: usize| {
            json!({
                "seconds": p.wall.as_secs_f64(),
                "tokens": n,
                "tokens_per_s": n as f64 / p.wall.as_secs_f64().max(1e-9),
                "attention_s": p.times.attention.as_secs_f64(),
                "experts_s": p.times.experts.as_secs_f64(),
                "head_s": p.times.head.as_secs_f64(),
                "disk_wait_s": p.experts.disk_wait.as_secs_f64(),
                "cache_hit_rate": p.experts.hit_rate(),
                "bytes_read_per_token": p.experts.bytes_read as f64 / n.max(1) as f64,
            })
        };
        let out = json!({
            "model": model.dir.display().to_string(),
            "machine": machine,
            "backend": description,
            "prefill": phase(&prefill, args.prompt),
            "decode": phase(&decode, generation.tokens.len()),
            "copy_bandwidth_bytes_per_s": bandwidth,
            "decode_bytes_per_token": token_bytes,
            "decode_floor_s_per_token": floor,
            "decode_over_floor": ratio,
            "peak_rss_bytes": rss,
            "device_report": report,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("model    {}", model.dir.display());
    println!("machine  {machine}");
    println!("backend  {description}");
    println!();
    println!(
        "{:<8} {:>7} {:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>12}",
        "phase", "tokens", "tok/s", "attention", "experts", "head", "disk", "hit rate", "read/token"
    );
    for (name, p, n) in [("prefill", &prefill, args.prompt), ("decode", &decode, generation.tokens.len())] {
        println!(
            "{:<8} {:>7} {:>9.2} {:>9.3}s {:>9.3}s {:>8.3}s {:>8.3}s {:>8.1}% {:>12}",
            name,
            n,
            n as f64 / p.wall.as_secs_f64().max(1e-9),
            p.times.attention.as_secs_f64(),
            p.times.experts.as_secs_f64(),
            p.times.head.as_secs_f64(),
            p.experts.disk_wait.as_secs_f64(),
            100.0 * p.experts.hit_rate(),
            gib(p.experts.bytes_read / n.max(1) as u64)
        );
    }
    println!();
    println!(
        "decode floor: {} of weights per token / {:.2} GB/s memory copy = {:.1} ms; measured {:.1} ms/token = {:.2}x the floor",
        gib(token_bytes),
        bandwidth / 1e9,
        floor * 1e3,
        1e3 * decode.wall.as_secs_f64() / n_dec as f64,
        ratio
    );
    println!("prefill {prefill_tps:.2} tok/s, decode {decode_tps:.2} tok/s, peak RSS {}", gib(rss));
    for line in report {
        println!("{line}");
    }
    Ok(())
}
