//! `picchio chat`: an interactive terminal chat. Answers stream as they are generated, the
//! reasoning is shown dimmed (or hidden), follow-up turns reuse the cached prefix, Ctrl-C
//! stops the current answer (not the program), and conversations can be saved and loaded.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use picchio::chat::{
    ChatEvent, ChatFormat, Conversation, DeveloperContent, Message, ReasoningEffort, SystemContent,
    TurnOptions, TurnOutcome, VOCAB_SIZE, complete, today_utc,
};
use picchio::engine;
use picchio::sample::SamplingParams;
use picchio::session::{Session, StopReason};
use rustyline::error::ReadlineError;
use serde::{Deserialize, Serialize};

use super::ModelArgs;

/// How hard the model thinks before answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reasoning {
    /// Short reasoning.
    Low,
    /// The default.
    Medium,
    /// Long reasoning.
    High,
}

impl From<Reasoning> for ReasoningEffort {
    fn from(r: Reasoning) -> Self {
        match r {
            Reasoning::Low => ReasoningEffort::Low,
            Reasoning::Medium => ReasoningEffort::Medium,
            Reasoning::High => ReasoningEffort::High,
        }
    }
}

/// Conversation and sampling settings shared by `chat` and `generate -p`.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct ChatSettings {
    /// Reasoning effort.
    #[arg(long, value_enum, default_value_t = Reasoning::Medium)]
    pub reasoning: Reasoning,
    /// Instructions for the assistant (the Harmony developer message).
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling temperature; 0 is greedy [default: 1.0 for chat, 0 for raw token IDs].
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens less likely than this share of the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty over the last 64 tokens (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Sampler seed (default: different every run).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most tokens per answer (default: what the context has left).
    #[arg(short = 'n', long)]
    pub max_tokens: Option<usize>,
    /// End the answer where this text appears in it (not shown); may be repeated.
    /// Reasoning is not cut.
    #[arg(long = "stop", value_name = "TEXT")]
    #[serde(default)]
    pub stop: Vec<String>,
    /// Lower the logit of every token already in the answer by this much (-2..2, 0: off).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    #[serde(default)]
    pub presence_penalty: f32,
    /// Lower the logit of every token already in the answer by this much per use (-2..2).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    #[serde(default)]
    pub frequency_penalty: f32,
    /// Add BIAS (-100..100) to the logit of token ID, as `ID=BIAS`; may be repeated
    /// (+100 all but forces the token, -100 all but forbids it).
    #[arg(long = "logit-bias", value_name = "ID=BIAS", value_parser = parse_logit_bias, allow_hyphen_values = true)]
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Ask a ChatML (Qwen3) model to answer without thinking first (the template's
    /// `enable_thinking=false`); Harmony models set this with --reasoning.
    #[arg(long)]
    #[serde(default)]
    pub no_thinking: bool,
    /// Directory of the tokenizer files (tokenizer.json, generation_config.json) of a
    /// ChatML model, when they are not next to its config.json.
    #[arg(long, value_name = "DIR")]
    #[serde(skip)]
    pub tokenizer: Option<std::path::PathBuf>,
}

/// Parses `ID=BIAS` of `--logit-bias`.
fn parse_logit_bias(text: &str) -> Result<(u32, f32), String> {
    let (id, bias) = text.split_once('=').ok_or_else(|| format!("{text:?} is not ID=BIAS"))?;
    let id = id.trim().parse().map_err(|_| format!("{id:?} is not a token ID"))?;
    let bias = bias.trim().parse().map_err(|_| format!("{bias:?} is not a number"))?;
    Ok((id, bias))
}

impl ChatSettings {
    /// The system and developer messages a conversation starts with.
    pub fn opening(&self) -> Vec<Message> {
        let system = SystemContent::new()
            .with_reasoning_effort(self.reasoning.into())
            .with_conversation_start_date(today_utc());
        let mut v = vec![Message::system(system)];
        if let Some(instructions) = &self.system {
            v.push(Message::developer(DeveloperContent::new().with_instructions(instructions.clone())));
        }
        v
    }

    /// Sampling settings for a turn (`turn` varies the default seed between turns);
    /// `default_temperature` applies when `--temperature` is not given.
    pub fn sampling_with(&self, turn: u64, default_temperature: f32) -> SamplingParams {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        SamplingParams {
            temperature: self.temperature.unwrap_or(default_temperature),
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.clone(),
            seed: seed.wrapping_add(turn),
            ..Default::default()
        }
    }

    /// Turn options for turn number `turn`. Without `--max-tokens` the limit is left to
    /// [`complete`], which knows the rendered prompt's length and so what the context has
    /// left for the answer.
    pub fn turn(&self, turn: u64) -> TurnOptions {
        // No tools are declared here, so the model's calls are shown as its commentary.
        TurnOptions {
            max_tokens: self.max_tokens,
            sampling: self.sampling_with(turn, 1.0),
            declared_functions: Vec::new(),
            stop: self.stop.clone(),
            grammar: None,
        }
    }
}

/// Arguments of `picchio chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    settings: ChatSettings,
    /// Do not show the model's reasoning.
    #[arg(long)]
    hide_reasoning: bool,
}

/// A saved conversation (`/save`, `/load`).
#[derive(Serialize, Deserialize)]
struct SavedChat {
    format: String,
    settings: ChatSettings,
    conversation: Conversation,
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// The model's chat format; for Harmony, fails unless the model speaks o200k_harmony.
pub fn open_format(
    model_args: &ModelArgs,
    model: &engine::LoadedModel,
    settings: &ChatSettings,
) -> anyhow::Result<ChatFormat> {
    let format = model_args.chat_format(model, settings.tokenizer.as_deref(), !settings.no_thinking)?;
    match &format {
        ChatFormat::Harmony(_) => require_harmony_vocab(model.config.vocab_size)?,
        ChatFormat::ChatMl(_) => {}
    }
    Ok(format)
}

/// Fails unless the model speaks o200k_harmony.
pub fn require_harmony_vocab(vocab: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        vocab == VOCAB_SIZE,
        "this model's vocabulary has {vocab} tokens, not the {VOCAB_SIZE} of o200k_harmony; chat needs a GPT-OSS \
         vocabulary: pass -m with a GPT-OSS checkpoint (or, to try it out, a random one: `picchio synth --shape \
         tiny DIR`), or use `generate --ids` for raw token IDs"
    );
    Ok(())
}

/// Prints streamed events: reasoning dimmed (unless hidden), the answer plain.
struct Printer {
    color: bool,
    hide_reasoning: bool,
    in_reasoning: bool,
}

impl Printer {
    fn event(&mut self, e: ChatEvent<'_>) {
        self.write_event(&mut std::io::stdout().lock(), e);
    }

    /// Writes one event: a tool call's label once, when the call opens (its first,
    /// empty event), then its arguments as they come.
    fn write_event(&mut self, out: &mut impl Write, e: ChatEvent<'_>) {
        match e {
            ChatEvent::Reasoning(t) if !self.hide_reasoning => {
                if !self.in_reasoning {
                    self.in_reasoning = true;
                    let _ = write!(out, "{}", if self.color { DIM } else { "[reasoning] " });
                }
                let _ = write!(out, "{t}");
            }
            ChatEvent::Reasoning(_) | ChatEvent::Token(_) | ChatEvent::Prefill { .. } => {}
            ChatEvent::Answer(t) | ChatEvent::Commentary(t) => {
                self.end_reasoning(out);
                let _ = write!(out, "{t}");
            }
            ChatEvent::ToolCall { recipient, text: "" } => {
                self.end_reasoning(out);
                let _ = write!(out, "[call {recipient}] ");
            }
            ChatEvent::ToolCall { text, .. } => {
                let _ = write!(out, "{text}");
            }
        }
        let _ = out.flush();
    }

    fn end_reasoning(&mut self, out: &mut impl Write) {
        if self.in_reasoning {
            self.in_reasoning = false;
            let _ = write!(out, "{}\n\n", if self.color { RESET } else { "" });
        }
    }
}

/// Runs `picchio chat`.
pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    args.model.apply_threads()?;
    let model = args.model.open(args.model.ctx)?;
    let format = open_format(&args.model, &model, &args.settings)?;
    let ctx = args.model.ctx.unwrap_or_else(|| engine::default_ctx(&model.config));
    let runner = args.model.runner(&model, ctx)?;
    let mut session = Session::new(runner);
    let mut settings = args.settings.clone();
    let mut conversation = Conversation::from_messages(settings.opening());

    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = Arc::clone(&interrupted);
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .context("installing the Ctrl-C handler")?;
    }
    let color = std::io::stdout().is_terminal();
    let mut editor = rustyline::DefaultEditor::new()?;
    let mut last: Option<(TurnOutcome, f64)> = None;
    let mut turns = 0u64;
    eprintln!(
        "picchio chat: {} ({} layers, {} experts, {}). /help for commands, Ctrl-C stops an answer, Ctrl-D exits.",
        model.dir.display(),
        model.config.num_layers,
        model.config.num_experts,
        format.name()
    );
    loop {
        let line = match editor.readline(">>> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => {
                eprintln!("(Ctrl-D or /exit to quit)");
                continue;
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        };
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(text);
        if let Some(cmd) = text.strip_prefix('/') {
            let (name, arg) = cmd.split_once(' ').map_or((cmd, ""), |(a, b)| (a, b.trim()));
            match name {
                "exit" | "quit" => break,
                "help" => eprintln!(
                    "/reset  start over\n/stats  speed, cache and context use\n/save FILE  save the conversation as JSON\n\
                     /load FILE  load a saved conversation\n/exit  quit"
                ),
                "reset" => {
                    conversation = Conversation::from_messages(settings.opening());
                    session.rewind(0)?;
                    eprintln!("(conversation cleared)");
                }
                "stats" => print_stats(&session, last.as_ref()),
                "save" => match save(Path::new(arg), &settings, &conversation) {
                    Ok(()) => eprintln!("(saved to {arg})"),
                    Err(e) => eprintln!("error: {e:#}"),
                },
                "load" => match load(Path::new(arg)) {
                    Ok(saved) => {
                        settings = saved.settings;
                        conversation = saved.conversation;
                        eprintln!("(loaded {} messages from {arg})", conversation.messages.len());
                    }
                    Err(e) => eprintln!("error: {e:#}"),
                },
                other => eprintln!("unknown command /{other} (/help lists them)"),
            }
            continue;
        }
        conversation.messages.push(Message::user(text));
        interrupted.store(false, Ordering::SeqCst);
        let mut printer = Printer { color, hide_reasoning: args.hide_reasoning, in_reasoning: false };
        let opts = settings.turn(turns);
        turns += 1;
        let t0 = Instant::now();
        let result = complete(&mut session, &format, &conversation, &opts, &mut |e| {
            printer.event(e);
            !interrupted.load(Ordering::SeqCst)
        });
        printer.end_reasoning(&mut std::io::stdout());
        println!();
        match result {
            Ok(outcome) => {
                match outcome.stop {
                    StopReason::Cancelled => eprintln!("(stopped)"),
                    StopReason::ContextFull => eprintln!("(the context is full: /reset to start over)"),
                    StopReason::MaxTokens => eprintln!("(answer cut at --max-tokens)"),
                    StopReason::Stop(_) | StopReason::StopString => {}
                }
                conversation.messages.extend(outcome.messages.iter().cloned());
                last = Some((outcome, t0.elapsed().as_secs_f64()));
            }
            Err(e) => {
                conversation.messages.pop();
                eprintln!("error: {e}");
            }
        }
    }
    Ok(())
}

fn print_stats(session: &Session, last: Option<&(TurnOutcome, f64)>) {
    eprintln!("context: {} of {} positions used", session.pos(), session.capacity());
    if let Some((o, secs)) = last {
        eprintln!(
            "last turn: {} prompt tokens ({} reused from the cache), {} generated in {:.2} s ({:.2} tokens/s)",
            o.prompt_tokens,
            o.reused,
            o.completion_tokens,
            secs,
            o.completion_tokens as f64 / secs.max(1e-9)
        );
    }
    let r = session.runner();
    let t = r.times();
    let e = r.expert_stats();
    eprintln!(
        "time: attention {:.2} s, experts {:.2} s (disk wait {:.2} s), head {:.2} s; expert cache {:.1}% hits, {} read",
        t.attention.as_secs_f64(),
        t.experts.as_secs_f64(),
        e.disk_wait.as_secs_f64(),
        t.head.as_secs_f64(),
        100.0 * e.hit_rate(),
        picchio::system::gib(e.bytes_read)
    );
}

fn save(path: &Path, settings: &ChatSettings, conversation: &Conversation) -> anyhow::Result<()> {
    anyhow::ensure!(!path.as_os_str().is_empty(), "give a file name: /save FILE");
    let saved = SavedChat {
        format: "picchio-chat/1".into(),
        settings: settings.clone(),
        conversation: conversation.clone(),
    };
    std::fs::write(path, serde_json::to_vec_pretty(&saved)?)
        .with_context(|| format!("writing {}", path.display()))
}

fn load(path: &Path) -> anyhow::Result<SavedChat> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let saved: SavedChat = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a saved picchio chat", path.display()))?;
    anyhow::ensure!(saved.format == "picchio-chat/1", "{}: unknown format {}", path.display(), saved.format);
    Ok(saved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_call_is_labelled_once() {
        let mut printer = Printer { color: false, hide_reasoning: false, in_reasoning: false };
        let mut out = Vec::new();
        let recipient = "functions.get_weather";
        for e in [
            ChatEvent::Reasoning("Call it."),
            ChatEvent::Token(&picchio::sample::Sampled::token(1)),
            ChatEvent::ToolCall { recipient, text: "" },
            ChatEvent::ToolCall { recipient, text: "{\"city\"" },
            ChatEvent::ToolCall { recipient, text: ": \"Rome\"}" },
        ] {
            printer.write_event(&mut out, e);
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[reasoning] Call it.\n\n[call functions.get_weather] {\"city\": \"Rome\"}"
        );
    }
}
