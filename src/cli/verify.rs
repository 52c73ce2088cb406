//! `picchio verify`: re-hash a container against its manifest.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use picchio::format::container::convert::is_hf_checkpoint;
use picchio::format::container::is_container;
use picchio::format::container::verify::verify;
use picchio::system::gib;

/// Arguments of `picchio verify`.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The container directory.
    dir: PathBuf,
}

/// Runs `picchio verify`; fails if anything does not match.
pub fn run(args: VerifyArgs) -> anyhow::Result<()> {
    let dir = &args.dir;
    if !is_container(dir) && is_hf_checkpoint(dir) {
        anyhow::bail!(
            "{} is a Hugging Face checkpoint, not a Picchio container: there is no manifest to verify \
             against. Convert it first (`picchio convert {} OUT`), then verify OUT",
            dir.display(),
            dir.display()
        );
    }
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let b = ProgressBar::new(0);
        b.set_style(ProgressStyle::with_template(
            "verifying [{bar:40}] {binary_bytes}/{binary_total_bytes} ETA {eta}",
        )?);
        b
    } else {
        ProgressBar::hidden()
    };
    let report = verify(&args.dir, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("verifying {}", args.dir.display()))?;
    bar.finish_and_clear();
    for m in &report.mismatches {
        eprintln!("BAD {}: {}", m.what, m.reason);
    }
    if report.mismatches.is_empty() {
        eprintln!("ok: {} tensors and experts, {} hashed, all match", report.checked, gib(report.bytes));
        Ok(())
    } else {
        anyhow::bail!(
            "{} of {} tensors and experts do not match the manifest",
            report.mismatches.len(),
            report.checked
        )
    }
}
