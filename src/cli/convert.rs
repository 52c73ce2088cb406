//! `picchio convert`: a Hugging Face checkpoint to a Picchio container.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use picchio::format::container::{ConvertOptions, DenseFormat, ExpertFormat, Formats, convert};
use picchio::system::gib;

/// Arguments of `picchio convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// The Hugging Face checkpoint directory.
    src: PathBuf,
    /// The container directory to write (created; an interrupted conversion resumes).
    out: PathBuf,
    /// Expert format.
    #[arg(long, value_enum, default_value_t = ExpertFormat::Auto)]
    experts: ExpertFormat,
    /// Dense format.
    #[arg(long, value_enum, default_value_t = DenseFormat::Auto)]
    dense: DenseFormat,
}

/// Runs `picchio convert`.
pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let opts = ConvertOptions {
        formats: Formats { experts: args.experts, dense: args.dense },
        progress,
        interrupt_after: None,
    };
    let r = convert(&args.src, &args.out, &opts)
        .with_context(|| format!("converting {} into {}", args.src.display(), args.out.display()))?;
    tracing::info!(
        "{}: {} items converted{}{} in {:.1} s, {} read, container {}, peak RSS {}",
        r.out.display(),
        r.converted,
        if r.resumed > 0 {
            format!(" ({} already done and re-checked, resumed)", r.resumed)
        } else {
            String::new()
        },
        if r.redone > 0 {
            format!(" ({} claimed done but wrong on disk, redone)", r.redone)
        } else {
            String::new()
        },
        r.seconds,
        gib(r.bytes_read),
        gib(r.bytes_written),
        r.peak_rss.map_or("unknown".into(), gib)
    );
    Ok(())
}
