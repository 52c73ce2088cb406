//! `picchio synth`: write a random GPT-OSS or Qwen3-MoE checkpoint of exact shape.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use picchio::synth::{SynthShape, SynthSpec, synth};
use picchio::system::gib;

/// Arguments of `picchio synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Output directory (a Hugging Face checkpoint): new, or empty.
    out: PathBuf,
    /// Starting shape (default: the full 20B, about 13 GB); every dimension below overrides it.
    #[arg(long, value_enum, default_value_t = SynthShape::GptOss20b)]
    shape: SynthShape,
    /// Decoder layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Experts per layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Experts per token.
    #[arg(long)]
    top_k: Option<usize>,
    /// Residual width (a multiple of 32).
    #[arg(long)]
    hidden: Option<usize>,
    /// Per-expert intermediate width (a multiple of 32).
    #[arg(long)]
    intermediate: Option<usize>,
    /// Query heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads.
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Width of a head.
    #[arg(long)]
    head_dim: Option<usize>,
    /// Vocabulary size.
    #[arg(long)]
    vocab: Option<usize>,
    /// Sliding window.
    #[arg(long)]
    window: Option<usize>,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest shard, in GiB.
    #[arg(long, default_value_t = 4.0)]
    shard_gb: f64,
    /// Skew of the routing, 0 to 16 (GPT-OSS only): some experts of every layer get more
    /// tokens than others, in a per-layer random order, through a router bias that makes an
    /// expert's chance fall about as `(1 + 32 * rank / experts)^-S` (formula in
    /// docs/perf.md, "Skewed synthetic routing"). 0 (the default) is the near-uniform
    /// routing of random router weights; 1 is the skewed option of the perf records.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_name = "S")]
    routing_skew: f64,
}

/// Refuses an output directory that exists and is not empty: synth writes gigabytes of
/// shards and would mix them with what is there.
fn check_out_dir(out: &Path) -> anyhow::Result<()> {
    match std::fs::read_dir(out) {
        Ok(mut entries) => {
            anyhow::ensure!(
                entries.next().is_none(),
                "{} is not empty; synth writes a new checkpoint (the default shape is the full 20B, \
                 about 13 GB) only into a new or empty directory",
                out.display()
            );
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            anyhow::bail!("{} exists and is not a directory", out.display())
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", out.display())),
    }
}

/// Runs `picchio synth`.
pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    check_out_dir(&a.out)?;
    let mut s = SynthSpec::of(a.shape);
    let set = |dst: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *dst = v;
        }
    };
    set(&mut s.layers, a.layers);
    set(&mut s.experts, a.experts);
    set(&mut s.top_k, a.top_k);
    set(&mut s.hidden, a.hidden);
    set(&mut s.intermediate, a.intermediate);
    set(&mut s.heads, a.heads);
    set(&mut s.kv_heads, a.kv_heads);
    set(&mut s.head_dim, a.head_dim);
    set(&mut s.vocab, a.vocab);
    set(&mut s.window, a.window);
    s.seed = a.seed;
    s.routing_skew = a.routing_skew;
    anyhow::ensure!(a.shard_gb > 0.0, "--shard-gb must be positive");
    s.shard_bytes = (a.shard_gb * (1u64 << 30) as f64) as u64;
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let b = ProgressBar::new(0);
        b.set_style(ProgressStyle::with_template(
            "synth [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )?);
        b
    } else {
        ProgressBar::hidden()
    };
    let t0 = Instant::now();
    let r = synth(&s, &a.out, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("writing {}", a.out.display()))?;
    bar.finish_and_clear();
    tracing::info!(
        "{}: {} layers x {} experts (top-{}), hidden {}, vocab {}, routing skew {}: {} in {} shards, {:.1} s",
        a.out.display(),
        s.layers,
        s.experts,
        s.top_k,
        s.hidden,
        s.vocab,
        s.routing_skew,
        gib(r.bytes),
        r.shards,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_new_or_empty_directory_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(check_out_dir(&tmp.path().join("new")).is_ok());
        assert!(check_out_dir(tmp.path()).is_ok());
        std::fs::write(tmp.path().join("notes.txt"), "keep me").unwrap();
        let e = check_out_dir(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("is not empty"), "{e}");
        let e = check_out_dir(&tmp.path().join("notes.txt")).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }
}
