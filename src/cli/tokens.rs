//! `picchio tokenize` and `picchio render`: the token IDs a text, or a chat conversation,
//! becomes (as `POST /tokenize` answers), without a model.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use picchio::chat::{Tokenizer, today_utc};

/// Arguments of `picchio tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// The text (default: all of stdin).
    text: Option<String>,
    /// Read special-token strings (`<|start|>`, `<|end|>`, ...) as those tokens, as in a
    /// raw Harmony prompt; by default they are plain text, as in a user's message.
    #[arg(long)]
    special: bool,
    /// Print each token's text beside its ID, one per line.
    #[arg(long)]
    show: bool,
}

/// Arguments of `picchio render`.
#[derive(Args, Debug)]
pub struct RenderArgs {
    /// A `POST /v1/chat/completions` body (`messages`, `tools`, `reasoning_effort`, ...), as
    /// a JSON file, or `-` for stdin.
    request: PathBuf,
    /// Print the rendered prompt as text rather than its IDs.
    #[arg(long)]
    text: bool,
}

fn read_stdin() -> anyhow::Result<String> {
    let mut text = String::new();
    std::io::stdin().read_to_string(&mut text).context("reading stdin")?;
    Ok(text)
}

/// Prints `ids` on one line, or with their text one per line.
fn print_ids(tokenizer: &Tokenizer, ids: &[u32], show: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if show {
        for &id in ids {
            writeln!(out, "{id}\t{:?}", tokenizer.token_str(id)?)?;
        }
    } else {
        let line: Vec<String> = ids.iter().map(u32::to_string).collect();
        writeln!(out, "{}", line.join(" "))?;
    }
    Ok(())
}

/// Runs `picchio tokenize`.
pub fn tokenize(args: TokenizeArgs) -> anyhow::Result<()> {
    let text = match args.text {
        Some(t) => t,
        None => read_stdin()?,
    };
    let tokenizer = Tokenizer::new();
    let ids = if args.special { tokenizer.encode_with_special(&text) } else { tokenizer.encode(&text) };
    print_ids(&tokenizer, &ids, args.show)
}

/// Runs `picchio render`.
pub fn render(args: RenderArgs) -> anyhow::Result<()> {
    let body = if args.request.as_os_str() == "-" {
        read_stdin()?.into_bytes()
    } else {
        std::fs::read(&args.request).with_context(|| format!("reading {}", args.request.display()))?
    };
    let ids = picchio::serve::http::render_request(&body, &today_utc())
        .with_context(|| format!("{} is not a valid chat completions request", args.request.display()))?;
    let tokenizer = Tokenizer::new();
    if args.text {
        println!("{}", tokenizer.decode(&ids)?);
        Ok(())
    } else {
        print_ids(&tokenizer, &ids, false)
    }
}
