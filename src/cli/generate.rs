//! `picchio generate`: a raw-ID prompt in, generated IDs out (stdout holds nothing else).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use picchio::engine;
use picchio::format::npy;
use picchio::model::{LogitRows, NoObserver};
use picchio::sample::Sampler;
use picchio::session::{Session, StopReason};

use super::ModelArgs;
use super::chat::ChatSettings;

/// Arguments of `picchio generate`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true)))]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt token IDs, whitespace-separated, e.g. --ids "1 2 3".
    #[arg(long, group = "input")]
    ids: Option<String>,
    /// File of prompt token IDs (decimal, whitespace-separated).
    #[arg(long, group = "input")]
    ids_file: Option<PathBuf>,
    /// A user message: one chat turn (Harmony or ChatML, by the model), printing the final answer.
    #[arg(short = 'p', long, group = "input")]
    prompt: Option<String>,
    /// Sampling and turn settings; `-n/--max-tokens` defaults to 16 for raw IDs and to the
    /// rest of the context for -p.
    #[command(flatten)]
    chat: ChatSettings,
    /// Write the F32 logits of every prompt position to this .npy file, shape [T, vocab].
    #[arg(long)]
    logits_out: Option<PathBuf>,
}

/// Parses decimal token IDs separated by whitespace; errors name `source`, the line and
/// the offending text.
pub fn parse_ids(text: &str, source: &str) -> anyhow::Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (line_no, line) in text.lines().enumerate() {
        for word in line.split_whitespace() {
            let id: u32 = word.parse().map_err(|_| {
                anyhow::anyhow!(
                    "{source}: line {}: `{word}` is not a token ID (a non-negative integer)",
                    line_no + 1
                )
            })?;
            ids.push(id);
        }
    }
    anyhow::ensure!(!ids.is_empty(), "{source}: the prompt is empty");
    Ok(ids)
}

fn read_prompt(args: &GenerateArgs) -> anyhow::Result<Vec<u32>> {
    match (&args.ids, &args.ids_file) {
        (Some(text), _) => parse_ids(text, "--ids"),
        (None, Some(path)) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            parse_ids(&text, &path.display().to_string())
        }
        (None, None) => anyhow::bail!("give the prompt with --ids, --ids-file or -p"),
    }
}

/// Runs `picchio generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    args.model.apply_threads()?;
    if let Some(text) = &args.prompt {
        return chat_turn(&args, text);
    }
    // Raw token IDs have no answer text to look for stop strings in.
    anyhow::ensure!(args.chat.stop.is_empty(), "--stop applies to the answer of -p, not to raw token IDs");
    let prompt = read_prompt(&args)?;
    let started = Instant::now();
    let model = args.model.open(args.model.ctx)?;
    let ctx = args.model.ctx.unwrap_or_else(|| engine::default_ctx(&model.config));
    let runner = args.model.runner(&model, ctx)?;
    tracing::info!(
        "loaded {} in {:.2?}: {} layers, {} experts (top-{}), vocab {}; {}",
        model.dir.display(),
        started.elapsed(),
        model.config.num_layers,
        model.config.num_experts,
        model.config.experts_per_token,
        model.config.vocab_size,
        runner.describe()
    );
    let mut session = Session::new(runner);
    // Validate the whole request before any work.
    session.check_ids(&prompt)?;
    session.check_fits(0, prompt.len())?;

    let t0 = Instant::now();
    if let Some(path) = &args.logits_out {
        check_logits_fit(prompt.len(), session.runner().config().vocab_size)?;
        let logits = session.feed(&prompt, LogitRows::All, &mut NoObserver)?;
        write_logits(path, &logits, prompt.len(), session.runner().config().vocab_size)?;
        emit_continuation(&mut session, &[], &args, t0)?;
    } else {
        emit_continuation(&mut session, &prompt, &args, t0)?;
    }
    if args.model.stats {
        super::print_stats(session.runner(), prompt.len(), session.pos() - prompt.len(), t0.elapsed());
    } else if args.model.verify {
        for line in session.runner().report().iter().filter(|l| l.starts_with("verify")) {
            eprintln!("{line}");
        }
    }
    Ok(())
}

/// Refuses `--logits-out` for a prompt whose `[T, vocab]` F32 logits would not fit in the
/// machine's physical memory (they are held at once before writing).
fn check_logits_fit(rows: usize, vocab: usize) -> anyhow::Result<()> {
    let bytes = (rows as u64).checked_mul(vocab as u64).and_then(|n| n.checked_mul(4));
    let total = picchio::system::total_memory();
    match (bytes, total) {
        (Some(b), Some(t)) if b <= t => return Ok(()),
        // Without a memory figure only an overflowing size is refused.
        (Some(_), None) => return Ok(()),
        _ => {}
    }
    anyhow::bail!(
        "--logits-out for {rows} prompt positions x {vocab} tokens needs {}; this machine has {} of memory",
        bytes.map_or_else(|| "more than 2^64 bytes".to_string(), picchio::system::gib),
        total.map_or_else(|| "an unknown amount".to_string(), picchio::system::gib)
    )
}

fn write_logits(path: &Path, logits: &[f32], rows: usize, vocab: usize) -> anyhow::Result<()> {
    npy::write_f32(path, &[rows, vocab], logits)?;
    tracing::info!("wrote logits [{rows}, {vocab}] to {}", path.display());
    Ok(())
}

fn emit_continuation(
    session: &mut Session,
    prompt: &[u32],
    args: &GenerateArgs,
    t0: Instant,
) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut first = true;
    let mut write_error = None;
    let params = args.chat.sampling_with(0, 0.0);
    params.validate_for_vocab(session.runner().config().vocab_size)?;
    let mut sampler = Sampler::new(params)?;
    let max_tokens = args.chat.max_tokens.unwrap_or(16);
    let generation = session.generate(prompt, max_tokens, &mut sampler, &[], &mut |s| {
        let sep = if first { "" } else { " " };
        first = false;
        match write!(out, "{sep}{}", s.token).and_then(|_| out.flush()) {
            Ok(()) => true,
            Err(e) => {
                write_error = Some(e);
                false
            }
        }
    })?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    writeln!(out)?;
    let n = generation.tokens.len();
    let secs = t0.elapsed().as_secs_f64();
    tracing::info!("{n} tokens in {secs:.2}s ({:.2} tokens/s incl. prompt)", n as f64 / secs.max(1e-9));
    if generation.stop == StopReason::ContextFull {
        tracing::warn!("stopped after {n} tokens: the context ({} positions) is full", session.capacity());
    }
    Ok(())
}

/// `generate -p`: one chat turn in the model's format; the final answer goes to stdout as it is generated.
fn chat_turn(args: &GenerateArgs, text: &str) -> anyhow::Result<()> {
    let model = args.model.open(args.model.ctx)?;
    let format = super::chat::open_format(&args.model, &model, &args.chat)?;
    let ctx = args.model.ctx.unwrap_or_else(|| engine::default_ctx(&model.config));
    let mut session = Session::new(args.model.runner(&model, ctx)?);
    let mut messages = args.chat.opening();
    messages.push(picchio::chat::Message::user(text));
    let conversation = picchio::chat::Conversation::from_messages(messages);
    let opts = args.chat.turn(0);
    let t0 = Instant::now();
    // Ctrl-C stops the turn between prefill blocks or after the token being generated.
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = Arc::clone(&interrupted);
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .context("installing the Ctrl-C handler")?;
    }
    let mut out = std::io::stdout().lock();
    let outcome = picchio::chat::complete(&mut session, &format, &conversation, &opts, &mut |e| {
        if let picchio::chat::ChatEvent::Answer(t) = e {
            let _ = write!(out, "{t}");
            let _ = out.flush();
        }
        !interrupted.load(Ordering::SeqCst)
    })?;
    writeln!(out)?;
    drop(out);
    if outcome.stop == StopReason::Cancelled {
        eprintln!("{}", interrupted_message(&outcome));
        std::process::exit(INTERRUPTED_STATUS);
    }
    if outcome.answer().is_none() {
        tracing::warn!(
            "the model gave no final answer: {} after {} tokens",
            describe_stop(outcome.stop),
            outcome.completion_tokens
        );
    }
    if args.model.stats {
        super::print_stats(session.runner(), outcome.prompt_tokens, outcome.completion_tokens, t0.elapsed());
    }
    Ok(())
}

/// The exit status after Ctrl-C, as shells report a process ended by SIGINT.
const INTERRUPTED_STATUS: i32 = 130;

/// What a `-p` turn stopped by Ctrl-C had done.
fn interrupted_message(outcome: &picchio::chat::TurnOutcome) -> String {
    let in_cache = outcome.reused + outcome.prefilled;
    if outcome.completion_tokens == 0 && in_cache < outcome.prompt_tokens {
        format!(
            "interrupted: stopped while reading the prompt ({in_cache} of {} tokens computed)",
            outcome.prompt_tokens
        )
    } else {
        format!("interrupted: stopped after {} generated tokens", outcome.completion_tokens)
    }
}

/// Why a `-p` turn ended, in words (no raw token IDs).
fn describe_stop(stop: StopReason) -> String {
    use picchio::chat::tokenizer::special;
    match stop {
        StopReason::Stop(special::CALL) => {
            "it tried to call a tool (generate -p declares none, so the call is not run)".to_string()
        }
        StopReason::Stop(special::RETURN) => "it ended its turn".to_string(),
        StopReason::Stop(special::ENDOFTEXT) => "it ended the text".to_string(),
        StopReason::Stop(t) => format!("it stopped at token {t}"),
        StopReason::MaxTokens => "it reached --max-tokens".to_string(),
        StopReason::ContextFull => "the context is full (see --ctx)".to_string(),
        StopReason::Cancelled => "it was stopped".to_string(),
        StopReason::StopString => "a --stop string appeared in the answer".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_are_described_without_raw_ids() {
        let call = describe_stop(StopReason::Stop(picchio::chat::tokenizer::special::CALL));
        assert!(call.contains("call a tool") && !call.contains("200012"), "{call}");
        assert_eq!(describe_stop(StopReason::MaxTokens), "it reached --max-tokens");
    }

    #[test]
    fn interruptions_say_where_they_stopped() {
        let outcome = |prefilled, completion_tokens| picchio::chat::TurnOutcome {
            messages: Vec::new(),
            stop: StopReason::Cancelled,
            prompt_tokens: 100,
            reused: 10,
            prefilled,
            completion_tokens,
            tokens: Vec::new(),
        };
        assert_eq!(
            interrupted_message(&outcome(54, 0)),
            "interrupted: stopped while reading the prompt (64 of 100 tokens computed)"
        );
        assert_eq!(interrupted_message(&outcome(90, 7)), "interrupted: stopped after 7 generated tokens");
    }

    #[test]
    fn ids_parse_across_lines() {
        assert_eq!(parse_ids("0 1\n 2\t3\n\n", "x").unwrap(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn logits_out_that_cannot_fit_is_refused() {
        assert!(check_logits_fit(10, 1000).is_ok());
        let e = check_logits_fit(1 << 40, 201_088).unwrap_err().to_string();
        assert!(e.contains("--logits-out for 1099511627776 prompt positions") && e.contains("needs"), "{e}");
    }

    #[test]
    fn bad_ids_name_line_and_text() {
        let e = parse_ids("1 2\n3 x4", "p.ids").unwrap_err().to_string();
        assert!(e.contains("p.ids: line 2: `x4`"), "{e}");
        let e = parse_ids("-1", "p.ids").unwrap_err().to_string();
        assert!(e.contains("`-1`"), "{e}");
        let e = parse_ids("99999999999", "p.ids").unwrap_err().to_string();
        assert!(e.contains("99999999999"), "{e}");
        assert!(parse_ids(" \n", "p.ids").unwrap_err().to_string().contains("empty"));
    }
}
