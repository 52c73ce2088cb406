//! `picchio serve`: the stdio line protocol (docs/protocol.md) or an OpenAI-compatible HTTP
//! server (docs/http.md).

use std::io::Write;
use std::net::{SocketAddr, TcpListener};

use anyhow::Context;
use clap::Args;
use picchio::engine;
use picchio::session::Session;

use super::ModelArgs;

/// Arguments of `picchio serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Serve the line protocol on stdin/stdout.
    #[arg(long, conflicts_with = "http")]
    stdio: bool,
    /// Serve the OpenAI-compatible HTTP API on ADDR (host:port, or a port on 127.0.0.1;
    /// default 127.0.0.1:8080).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:8080")]
    http: Option<String>,
    /// HTTP: require `Authorization: Bearer KEY` on /v1 requests.
    #[arg(long, value_name = "KEY", env = "PICCHIO_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// HTTP: the model ID in /v1/models and responses (default: the model directory's name).
    #[arg(long, value_name = "NAME")]
    model_name: Option<String>,
}

/// Runs `picchio serve`.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.stdio || args.http.is_some(), "choose a transport: --stdio or --http [ADDR]");
    args.model.apply_threads()?;
    // Bind first: a taken port is reported before the model loads.
    let listener = match &args.http {
        Some(addr) => Some(bind(addr)?),
        None => None,
    };
    let model = args.model.open(args.model.ctx)?;
    let ctx = args.model.ctx.unwrap_or_else(|| engine::default_ctx(&model.config));
    let runner = args.model.runner(&model, ctx)?;
    let Some(listener) = listener else {
        tracing::info!("serving {} on stdio; {}", model.dir.display(), runner.describe());
        let mut session = Session::new(runner);
        let stdin = std::io::stdin();
        picchio::serve::stdio::serve(&mut session, stdin.lock(), std::io::stdout().lock())?;
        return Ok(());
    };
    tracing::info!("{}", runner.describe());
    let model_id = args.model_name.clone().unwrap_or_else(|| {
        let dir = args.model.model_dir();
        let dir = dir.canonicalize().unwrap_or(dir);
        dir.file_name().map_or_else(|| "gpt-oss".to_string(), |n| n.to_string_lossy().into_owned())
    });
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() && args.api_key.is_none() {
        tracing::warn!("listening on {addr}, reachable from other machines, without --api-key");
    }
    let mut options = picchio::serve::http::HttpOptions::new(model_id);
    options.api_key = args.api_key.clone();
    options.stop_on_ctrl_c = true;
    let server = picchio::serve::http::serve(listener, Session::new(runner), options)?;
    // The address on stdout, for scripts that bind port 0.
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on {}", server.url())?;
    out.flush()?;
    drop(out);
    server.wait();
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
