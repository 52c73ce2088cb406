//! `picchio serve`: the stdio line protocol (docs/protocol.md) or an OpenAI-compatible HTTP
//! server (docs/http.md).

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use picchio::engine;
use picchio::serve::http::{self, HttpOptions, ServerHandle};
use picchio::session::Session;

use super::ModelArgs;

/// Arguments of `picchio serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Directory of the tokenizer files (tokenizer.json, generation_config.json) of a
    /// ChatML (Qwen3) model, when they are not next to its config.json.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<std::path::PathBuf>,
    /// Ask a ChatML (Qwen3) model to answer without thinking first (HTTP).
    #[arg(long)]
    no_thinking: bool,
    /// Serve the line protocol on stdin/stdout.
    #[arg(long, conflicts_with = "http")]
    stdio: bool,
    /// Serve the OpenAI-compatible HTTP API on ADDR (host:port, or a port on 127.0.0.1;
    /// default 127.0.0.1:8080).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:8080")]
    http: Option<String>,
    /// HTTP: require `Authorization: Bearer KEY` on every request but /health.
    #[arg(long, value_name = "KEY", env = "PICCHIO_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// HTTP: the model ID in /v1/models and responses (default: the model directory's name).
    #[arg(long, value_name = "NAME")]
    model_name: Option<String>,
    /// HTTP: seconds a connection has to send a request head; an idle keep-alive
    /// connection is closed after as long.
    #[arg(long, value_name = "SECS", default_value_t = http::DEFAULT_HEADER_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    header_timeout: u64,
    /// HTTP: seconds a request has to send its whole body (else 408).
    #[arg(long, value_name = "SECS", default_value_t = http::DEFAULT_BODY_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    body_timeout: u64,
    /// HTTP: connections served at once; one more gets an immediate 503.
    #[arg(long, value_name = "N", default_value_t = http::DEFAULT_MAX_CONNECTIONS as u64,
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    max_connections: u64,
    /// HTTP: largest request body in MiB (else 413).
    #[arg(long, value_name = "MIB", default_value_t = (http::DEFAULT_MAX_BODY_BYTES >> 20) as u64,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_body_mb: u64,
    /// HTTP: let browser pages from ORIGIN (`http://localhost:3000`, or `*` for any) call
    /// the API (CORS; off by default).
    #[arg(long, value_name = "ORIGIN")]
    cors: Option<String>,
    /// HTTP: do not hold `tool_choice` auto/none turns to the declared functions with a
    /// grammar (a call of an undeclared function is then returned as text); required and
    /// named calls and response formats are constrained regardless.
    #[arg(long)]
    no_tool_grammar: bool,
    /// HTTP: slots, the conversations served at once (each its own key/value cache, their
    /// decode steps batched; more requests queue). Default: as many full caches as fit in
    /// memory (in VRAM with --device gpu; in both with auto on a GPU), at most 4.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=256))]
    parallel: Option<u64>,
}

/// Runs `picchio serve`.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.stdio || args.http.is_some(), "choose a transport: --stdio or --http [ADDR]");
    args.model.apply_threads()?;
    match &args.http {
        Some(addr) => run_http(&args, addr),
        None => run_stdio(&args),
    }
}

/// Loads the model, leaving memory for `slots` key/value caches, and puts it in a session.
fn load_session(model_args: &ModelArgs, slots: usize) -> anyhow::Result<Session> {
    let model = model_args.open_for(model_args.ctx, slots)?;
    let ctx = model_args.ctx.unwrap_or_else(|| engine::default_ctx(&model.config));
    let runner = model_args.runner_for(&model, ctx, slots)?;
    tracing::info!("{}: {}", model.dir.display(), runner.describe());
    Ok(Session::new(runner))
}

/// Serves the line protocol on stdin/stdout.
fn run_stdio(args: &ServeArgs) -> anyhow::Result<()> {
    // Raw token IDs need only the stop tokens: a model without its tokenizer files still
    // serves, with Harmony's (as before the chat formats).
    let format = chat_format(args).unwrap_or_else(|e| {
        tracing::warn!("{e:#}; ending turns at Harmony's stop tokens");
        picchio::chat::ChatFormat::Harmony(picchio::chat::HarmonyEncoding::new())
    });
    let mut session = load_session(&args.model, 1)?;
    let stops = format.stop_tokens(session.runner().config().vocab_size);
    tracing::info!("serving on stdio");
    // Read ahead, so that CANCEL (or closing stdin) stops a turn in progress.
    let stdin = std::io::BufReader::new(std::io::stdin());
    picchio::serve::stdio::serve_cancellable_with_stops(
        &mut session,
        &stops,
        stdin,
        std::io::stdout().lock(),
    )?;
    Ok(())
}

/// The HTTP settings these flags ask for.
fn http_options(args: &ServeArgs) -> anyhow::Result<HttpOptions> {
    let model_id = args.model_name.clone().unwrap_or_else(|| {
        let dir = args.model.model_dir();
        let dir = dir.canonicalize().unwrap_or(dir);
        dir.file_name().map_or_else(|| "gpt-oss".to_string(), |n| n.to_string_lossy().into_owned())
    });
    let mut options = HttpOptions::new(model_id);
    options.api_key = args.api_key.clone();
    options.stop_on_ctrl_c = true;
    options.cors_origin = args.cors.clone();
    options.tool_grammar = !args.no_tool_grammar;
    options.chat_format = chat_format(args)?;
    options.parallel = match args.parallel {
        Some(n) => usize::try_from(n).context("--parallel")?,
        None => default_parallel(&args.model),
    };
    options.header_timeout = Duration::from_secs(args.header_timeout);
    options.body_timeout = Duration::from_secs(args.body_timeout);
    options.max_connections = usize::try_from(args.max_connections).context("--max-connections")?;
    options.max_body_bytes = args
        .max_body_mb
        .checked_mul(1 << 20)
        .and_then(|b| usize::try_from(b).ok())
        .with_context(|| format!("--max-body-mb {} does not fit in memory sizes", args.max_body_mb))?;
    Ok(options)
}

/// The chat format of the model `-m` names, known from its config.json before it loads
/// (the server answers while it loads): Harmony for GPT-OSS; ChatML for Qwen3-MoE, with the
/// tokenizer of `--tokenizer` or of the model directory. A config that cannot be read is
/// left to the load, which reports it.
fn chat_format(args: &ServeArgs) -> anyhow::Result<picchio::chat::ChatFormat> {
    let dir = args.model.model_dir();
    let Ok(config) = picchio::ModelConfig::from_dir(&dir) else {
        return Ok(picchio::chat::ChatFormat::Harmony(picchio::chat::HarmonyEncoding::new()));
    };
    let dirs = vec![args.tokenizer.clone().unwrap_or(dir)];
    Ok(picchio::chat::ChatFormat::for_family(config.family, &dirs, !args.no_thinking)?)
}

/// The slots a server gets without `--parallel`: [`engine::default_parallel`] for the
/// model's config and context (1 when config.json cannot be read here; loading reports why);
/// with `--device gpu`, whose key/value caches live in VRAM,
/// [`engine::default_parallel_for_vram`] for the adapter's memory (1 when the adapter
/// reports none or cannot be opened; loading reports why); with `auto`, the smaller of the
/// two when a hardware adapter is present (its caches live in VRAM, and in RAM after a
/// fallback to the CPU).
fn default_parallel(model: &ModelArgs) -> usize {
    let Ok(cfg) = picchio::ModelConfig::from_dir(&model.model_dir()) else {
        return 1;
    };
    let ctx = model.ctx.unwrap_or_else(|| engine::default_ctx(&cfg));
    match model.device {
        engine::Device::Gpu => {
            let memory = model.gpu_options().ok().and_then(|opts| {
                let opts = picchio::backend::gpu::GpuOptions { allow_software: true, ..opts };
                picchio::backend::gpu::probe(&opts).ok()?.device_memory
            });
            memory.map_or(1, |m| engine::default_parallel_for_vram(&cfg, ctx, m, model.kv_cache))
        }
        // On a hardware GPU the caches live in VRAM, and in RAM if the CPU takes over.
        engine::Device::Auto => {
            let ram = engine::default_parallel(&cfg, ctx);
            let vram = model
                .gpu_options()
                .ok()
                .and_then(|opts| picchio::backend::gpu::probe(&opts).ok()?.device_memory)
                .map_or(ram, |m| engine::default_parallel_for_vram(&cfg, ctx, m, model.kv_cache));
            ram.min(vram)
        }
        engine::Device::Cpu => engine::default_parallel(&cfg, ctx),
    }
}

/// Serves HTTP: binds and answers (`/health` 503 "loading") while the model loads or
/// converts, then serves it until Ctrl-C.
fn run_http(args: &ServeArgs, addr: &str) -> anyhow::Result<()> {
    let listener = bind(addr)?;
    let options = http_options(args)?;
    let slots = options.parallel;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() && args.api_key.is_none() {
        tracing::warn!("listening on {local}, reachable from other machines, without --api-key");
    }
    let mut server = http::start(listener, options)?;
    // The address on stdout, for scripts that bind port 0 (and then poll /health).
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on {}", server.url())?;
    out.flush()?;
    drop(out);
    tracing::info!("chat in a browser at {}/", server.url());
    if let Err(e) = load_session(&args.model, slots).and_then(|s| attach(&mut server, s)) {
        server.shutdown();
        return Err(e);
    }
    let stats = server.wait();
    if args.model.stats {
        eprintln!("stats: {}", stats.summary());
    }
    Ok(())
}

/// Gives the server its session.
fn attach(server: &mut ServerHandle, session: Session) -> anyhow::Result<()> {
    server.attach(session)?;
    Ok(())
}

/// Binds `addr`: `host:port`, or a bare port on 127.0.0.1.
fn bind(addr: &str) -> anyhow::Result<TcpListener> {
    let listener = match addr.parse::<u16>() {
        Ok(port) => TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))),
        Err(_) => TcpListener::bind(addr),
    };
    listener.with_context(|| format!("cannot listen on {addr}"))
}
