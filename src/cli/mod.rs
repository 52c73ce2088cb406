//! Subcommands of the `picchio` binary. Each lives in its own module; this one holds the
//! argument definitions shared by all of them.

mod generate;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

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
}

/// Options every command that runs a model takes.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model directory (a Hugging Face checkpoint). Default: the tiny model in fixtures/.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Context capacity in positions (the key/value cache size). Default: 4096, or the
    /// model's maximum if smaller.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

impl ModelArgs {
    /// The model directory to use.
    pub fn model_dir(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(picchio::default_model_dir)
    }

    /// Sizes the worker pool.
    pub fn apply_threads(&self) -> anyhow::Result<()> {
        if let Some(n) = self.threads {
            anyhow::ensure!(n > 0, "--threads must be at least 1");
            rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
        }
        Ok(())
    }
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
        .with_target(false)
        .without_time()
        .init();
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
    }
}
