//! `picchio serve`: the stdio line protocol (docs/protocol.md).

use clap::Args;
use picchio::engine::{self, RunOptions};
use picchio::session::Session;

use super::ModelArgs;

/// Arguments of `picchio serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Serve the line protocol on stdin/stdout.
    #[arg(long)]
    stdio: bool,
}

/// Runs `picchio serve`.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.stdio, "choose a transport: --stdio");
    args.model.apply_threads()?;
    let model = args.model.open(args.model.ctx)?;
    let ctx = args.model.ctx.unwrap_or_else(|| engine::default_ctx(&model.config));
    let runner = engine::cpu_runner(&model, &RunOptions { ctx, ..Default::default() })?;
    tracing::info!("serving {} on stdio; {}", model.dir.display(), runner.describe());
    let mut session = Session::new(runner);
    let stdin = std::io::stdin();
    picchio::serve::stdio::serve(&mut session, stdin.lock(), std::io::stdout().lock())?;
    Ok(())
}
