//! The `picchio` command line.

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    cli::runtime_dir::ensure();
    let args = cli::Cli::parse();
    cli::init_logging(args.verbose, args.quiet);
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
