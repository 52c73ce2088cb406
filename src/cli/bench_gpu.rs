//! `picchio bench-gpu`: the per-kernel GPU microbenchmark (`picchio::gpu_bench`), as a
//! table or JSON.

use clap::Args;
use picchio::backend::gpu::{FeatureUse, GpuApi, GpuOptions};
use picchio::gpu_bench::{self, CaseResult, Options, Shape};
use picchio::system::cpu_description;

/// Arguments of `picchio bench-gpu`.
#[derive(Args, Debug)]
pub struct BenchGpuArgs {
    /// Layers of the random model: the products cycle through them (and the experts through
    /// every layer's), so more layers keep the weights out of the GPU's caches. Every
    /// layer's experts are resident: about 0.4 GB per layer in MXFP4 or INT4.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    layers: u64,
    /// Contexts (positions) at which attention is timed.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', default_values_t = [1024u64, 8192],
          value_parser = clap::value_parser!(u64).range(1..=131072))]
    ctx: Vec<u64>,
    /// Most calls per case, recorded into one submission (fewer when they would take over
    /// --case-seconds; at least 2).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=10000))]
    reps: u64,
    /// Time a case's calls should take, judged from one untimed warm-up call.
    #[arg(long, default_value_t = 0.25)]
    case_seconds: f64,
    /// Small shapes (hidden 576, 8 experts, vocabulary 8192) to check the path quickly;
    /// not GPT-OSS-20B's, and said so in the output.
    #[arg(long)]
    quick: bool,
    /// Also time the dense products with F32 weights.
    #[arg(long = "f32")]
    with_f32: bool,
    /// The graphics API (default: `WGPU_BACKEND`, else the best adapter of any).
    #[arg(long, value_enum)]
    gpu_backend: Option<GpuApi>,
    /// Build the kernels without optional features (SHADER_F16, SUBGROUP).
    #[arg(long)]
    portable: bool,
    /// Run the prompt-block cases with the matrix-vector kernels instead of the tiled
    /// product (to measure what the tiling gains).
    #[arg(long)]
    untiled: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

fn row(r: &CaseResult) -> String {
    format!(
        "{:<10} {:<20} {:>6} {:>11.1} {:>10.2} {:>8.2} {:>9.2} {:>6.2}  {}",
        r.case,
        r.format,
        r.kernel.calls,
        r.kernel.seconds_per_call * 1e6,
        r.bytes as f64 / 1e6,
        r.kernel_bytes_per_s / 1e9,
        r.copy_bytes_per_s / 1e9,
        r.ratio,
        r.detail
    )
}

/// Runs `picchio bench-gpu`.
pub fn run(args: BenchGpuArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.ctx.is_empty(), "--ctx needs at least one context");
    anyhow::ensure!(
        args.case_seconds.is_finite() && args.case_seconds > 0.0,
        "--case-seconds must be a positive number of seconds"
    );
    let layers = args.layers as usize;
    let shape = if args.quick { Shape::quick(layers) } else { Shape::gpt_oss_20b(layers) };
    let gpu = GpuOptions {
        api: args.gpu_backend,
        allow_software: true,
        features: if args.portable {
            FeatureUse { shader_f16: false, subgroup: false }
        } else {
            FeatureUse::default()
        },
        untiled_dense: args.untiled,
        ..Default::default()
    };
    let opts = Options {
        shape: shape.clone(),
        contexts: args.ctx.iter().map(|&c| c as usize).collect(),
        reps: args.reps as usize,
        seconds_per_case: args.case_seconds,
        f32: args.with_f32,
        gpu,
    };
    let shape_line = format!(
        "{}: hidden {}, {} query / {} KV heads of {}, {} experts top-{} of intermediate {}, vocabulary {}, {} layers (all full attention; calls cycle through them)",
        if args.quick { "QUICK shapes (--quick), NOT GPT-OSS-20B's" } else { "GPT-OSS-20B shapes" },
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.experts,
        shape.top_k,
        shape.intermediate,
        shape.vocab,
        shape.layers
    );
    let header = format!(
        "{:<10} {:<20} {:>6} {:>11} {:>10} {:>8} {:>9} {:>6}  {}",
        "case", "format", "calls", "us/call", "MB/call", "GB/s", "copy GB/s", "ratio", "shape"
    );
    let mut printed_header = false;
    let json = args.json;
    let report = gpu_bench::run(&opts, |r| {
        if !json {
            if !printed_header {
                println!("{shape_line}");
                println!("{header}");
                printed_header = true;
            }
            println!("{}", row(r));
        }
    })?;
    let machine = format!("{}; GPU: {}", cpu_description(), report.adapter);
    if json {
        let doc = serde_json::json!({
            "machine": machine,
            "quick": args.quick,
            "clock_description": report.clock.describe(),
            "report": report,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!();
    println!("machine  {machine}");
    println!("clock    {}", report.clock.describe());
    println!(
        "GB/s = bytes the op must read per call (weights, scales, biases, input; the key/value cache for attention) / time per call; \
         copy = a buffer-to-buffer copy of the same bytes from as many distinct regions, timed the same way; ratio = op / copy"
    );
    if report.adapter.contains("Cpu)") {
        println!("NOTE: a software adapter (CPU rasterizer): these figures measure the CPU, not a GPU");
    }
    Ok(())
}
