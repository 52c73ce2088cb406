//! The engine thread: one [`Session`] owned by one std thread that serves jobs in the order
//! they arrive (FIFO). Each job streams what the model says back over its own channel;
//! a closed channel (the client went away) stops its prefill at the next block boundary and
//! its generation at the next token.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use super::logprobs::{ContentLogprobs, TokenLogprob};
use super::raw::{RawText, complete_raw};
use crate::chat::{ChatEvent, ChatFormat, Message, TurnOptions, complete_prompt};
use crate::error::Error;
use crate::session::{Session, StopReason};

/// One request for the engine.
pub(crate) struct Job {
    /// The rendered conversation to complete (token IDs of [`render_prompt`]), rendered by
    /// the request handler so the engine thread does not render it a second time.
    ///
    /// [`render_prompt`]: crate::chat::render_prompt
    pub prompt: Vec<u32>,
    /// Token limit and sampling.
    pub turn: TurnOptions,
    /// What the generated tokens are read as.
    pub output: Output,
    /// Where the pieces and the outcome go.
    pub events: UnboundedSender<WorkerMsg>,
    /// When the request was queued.
    pub queued_at: Instant,
}

/// What the generated tokens of a job are read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Output {
    /// Harmony messages: reasoning, answer and tool calls (chat completions, responses).
    Harmony,
    /// Plain text, token by token (`/v1/completions`).
    Raw(RawText),
}

/// Text the model produced, by kind.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Piece {
    /// Reasoning (the analysis channel).
    Reasoning(String),
    /// Answer or preamble text (all the text of a raw completion).
    Content(String),
    /// Argument text of a call of `recipient` (`functions.get_weather`).
    ToolCall {
        /// Who is called.
        recipient: String,
        /// More of the arguments.
        text: String,
    },
}

/// What the engine tells a request.
#[derive(Debug)]
pub(crate) enum WorkerMsg {
    /// The job left the queue and generation begins.
    Started,
    /// Log probabilities of the tokens of the content piece that follows (only when the
    /// request asked for them; see [`super::logprobs`]).
    Logprobs(Vec<TokenLogprob>),
    /// Newly generated text.
    Piece(Piece),
    /// The turn ended.
    Done(Result<Finished, Failure>),
}

/// A finished turn.
#[derive(Debug, Clone)]
pub(crate) struct Finished {
    /// The generated messages.
    pub messages: Vec<Message>,
    /// Why generation stopped.
    pub stop: StopReason,
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// Prompt positions reused from the cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// The generated token IDs.
    pub tokens: Vec<u32>,
}

impl Finished {
    /// Whether one of the messages is a tool call.
    pub fn called_tool(&self) -> bool {
        self.messages.iter().any(|m| m.recipient.is_some())
    }
}

/// Why a turn failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Failure {
    /// The request does not fit (should have been caught before queueing).
    ContextFull(String),
    /// The request was refused by the session (should have been caught before queueing).
    Invalid(String),
    /// The engine failed; the session was reset.
    Engine(String),
    /// The server is shutting down.
    ShuttingDown,
}

/// Counters shared by the worker, the handlers, `/health` and `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) queued: AtomicU64,
    pub(crate) busy: AtomicBool,
    pub(crate) completed: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) cached_tokens: AtomicU64,
    pub(crate) completion_tokens: AtomicU64,
    /// Prompt tokens computed (not reused from the cache; of a turn stopped during its
    /// prefill, only the blocks computed).
    pub(crate) prefill_tokens: AtomicU64,
    /// Microseconds from a turn's start to its first generated token.
    pub(crate) prefill_micros: AtomicU64,
    /// Microseconds from a turn's first generated token to its end.
    pub(crate) decode_micros: AtomicU64,
    /// The runner's expert cache counters after the last turn (cumulative).
    pub(crate) expert_hits: AtomicU64,
    pub(crate) expert_misses: AtomicU64,
    pub(crate) expert_bytes_read: AtomicU64,
}

/// A snapshot of the server's counters, as `GET /health` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Requests waiting for the engine.
    pub queued: u64,
    /// Whether the engine is generating now.
    pub busy: bool,
    /// Turns that ran to their end (stop token, token limit or full context).
    pub completed: u64,
    /// Turns stopped, or skipped in the queue, because their client disconnected.
    pub cancelled: u64,
    /// Turns the engine failed on.
    pub failed: u64,
    /// Prompt tokens of every turn run.
    pub prompt_tokens: u64,
    /// Of those, positions reused from the cache.
    pub cached_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
}

impl Counters {
    /// A job was queued.
    pub fn enqueued(&self) {
        self.queued.fetch_add(1, Ordering::SeqCst);
    }

    /// A job could not be queued after all.
    pub fn unqueued(&self) {
        self.queued.fetch_sub(1, Ordering::SeqCst);
    }

    /// A snapshot.
    pub fn snapshot(&self) -> Stats {
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        Stats {
            queued: get(&self.queued),
            busy: self.busy.load(Ordering::SeqCst),
            completed: get(&self.completed),
            cancelled: get(&self.cancelled),
            failed: get(&self.failed),
            prompt_tokens: get(&self.prompt_tokens),
            cached_tokens: get(&self.cached_tokens),
            completion_tokens: get(&self.completion_tokens),
        }
    }
}

/// Serves `jobs` on `session` until every sender is gone. `stopping` makes it cancel the
/// turn in progress and refuse the queued ones.
pub(crate) fn run(
    mut session: Session,
    format: ChatFormat,
    jobs: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
    stopping: Arc<AtomicBool>,
) {
    while let Ok(job) = jobs.recv() {
        counters.queued.fetch_sub(1, Ordering::SeqCst);
        if stopping.load(Ordering::SeqCst) {
            let _ = job.events.send(WorkerMsg::Done(Err(Failure::ShuttingDown)));
            continue;
        }
        if job.events.is_closed() {
            counters.cancelled.fetch_add(1, Ordering::SeqCst);
            tracing::info!("a queued request was dropped: its client disconnected");
            continue;
        }
        counters.busy.store(true, Ordering::SeqCst);
        run_job(&mut session, &format, &job, &counters, &stopping);
        counters.busy.store(false, Ordering::SeqCst);
    }
    tracing::debug!("the engine thread stops: no more requests");
}

/// Runs one job and reports its outcome.
fn run_job(
    session: &mut Session,
    format: &ChatFormat,
    job: &Job,
    counters: &Counters,
    stopping: &AtomicBool,
) {
    let started = Instant::now();
    let _ = job.events.send(WorkerMsg::Started);
    let mut gone = false;
    let mut first_token: Option<Instant> = None;
    let mut logprobs = ContentLogprobs::default();
    let tokenizer = format.tokenizer();
    let mut on_event = |event: ChatEvent<'_>| {
        let piece = match event {
            ChatEvent::Prefill { .. } => {
                // Checked between prefill blocks, so a long prompt stops when its client goes.
                gone |= job.events.is_closed() || stopping.load(Ordering::SeqCst);
                return !gone;
            }
            ChatEvent::Token(sampled) => {
                first_token.get_or_insert_with(Instant::now);
                if sampled.logprobs.is_some() {
                    logprobs.on_token(&tokenizer, sampled);
                }
                // Checked on every token, so a client that went away stops generation at once.
                gone |= job.events.is_closed() || stopping.load(Ordering::SeqCst);
                return !gone;
            }
            ChatEvent::Reasoning(t) => {
                logprobs.discard();
                Piece::Reasoning(t.to_string())
            }
            ChatEvent::Answer(t) | ChatEvent::Commentary(t) => {
                let entries = logprobs.take_for_content();
                if !entries.is_empty() && job.events.send(WorkerMsg::Logprobs(entries)).is_err() {
                    gone = true;
                    return false;
                }
                Piece::Content(t.to_string())
            }
            ChatEvent::ToolCall { recipient, text } => {
                logprobs.discard();
                Piece::ToolCall { recipient: recipient.to_string(), text: text.to_string() }
            }
        };
        if job.events.send(WorkerMsg::Piece(piece)).is_err() || stopping.load(Ordering::SeqCst) {
            gone = true;
            return false;
        }
        true
    };
    let result = catch_unwind(AssertUnwindSafe(|| match job.output {
        Output::Harmony => complete_prompt(session, format, &job.prompt, &job.turn, &mut on_event),
        Output::Raw(text) => complete_raw(session, format, &job.prompt, &job.turn, text, &mut on_event),
    }));
    record_times(session, counters, started, first_token);
    let outcome = match result {
        Ok(Ok(turn)) => {
            counters.prompt_tokens.fetch_add(turn.prompt_tokens as u64, Ordering::SeqCst);
            counters.cached_tokens.fetch_add(turn.reused as u64, Ordering::SeqCst);
            counters.completion_tokens.fetch_add(turn.completion_tokens as u64, Ordering::SeqCst);
            // Only what was computed: a turn stopped during its prefill computed part of it.
            counters.prefill_tokens.fetch_add(turn.prefilled as u64, Ordering::SeqCst);
            let secs = started.elapsed().as_secs_f64();
            let cancelled = gone || turn.stop == StopReason::Cancelled;
            if cancelled && stopping.load(Ordering::SeqCst) {
                counters.cancelled.fetch_add(1, Ordering::SeqCst);
                let _ = job.events.send(WorkerMsg::Done(Err(Failure::ShuttingDown)));
                return;
            }
            if cancelled {
                counters.cancelled.fetch_add(1, Ordering::SeqCst);
                tracing::info!(
                    "generation cancelled after {} tokens ({secs:.2} s): the client disconnected",
                    turn.completion_tokens
                );
            } else {
                counters.completed.fetch_add(1, Ordering::SeqCst);
                tracing::debug!(
                    "turn: {} prompt tokens ({} cached), {} generated in {secs:.2} s ({:.1} tokens/s), \
                     {:.2} s queued",
                    turn.prompt_tokens,
                    turn.reused,
                    turn.completion_tokens,
                    turn.completion_tokens as f64 / secs.max(1e-9),
                    started.duration_since(job.queued_at).as_secs_f64()
                );
            }
            Ok(Finished {
                messages: turn.messages,
                stop: turn.stop,
                prompt_tokens: turn.prompt_tokens,
                cached_tokens: turn.reused,
                completion_tokens: turn.completion_tokens,
                tokens: turn.tokens,
            })
        }
        Ok(Err(e)) => {
            counters.failed.fetch_add(1, Ordering::SeqCst);
            Err(match e {
                // Refused before any state changed.
                Error::ContextFull { .. } => Failure::ContextFull(e.to_string()),
                Error::Invalid(m) => Failure::Invalid(m),
                other => {
                    tracing::error!("the engine failed: {other}; the session is reset");
                    let _ = session.rewind(0);
                    Failure::Engine(other.to_string())
                }
            })
        }
        Err(panic) => {
            counters.failed.fetch_add(1, Ordering::SeqCst);
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            tracing::error!("the engine panicked: {what}; the session is reset");
            let _ = session.rewind(0);
            Err(Failure::Engine(format!("internal error: {what}")))
        }
    };
    let _ = job.events.send(WorkerMsg::Done(outcome));
}

/// Adds a turn's prefill and decode times to the counters (a turn that generated nothing
/// counts as prefill only) and copies the runner's expert cache counters.
fn record_times(session: &Session, counters: &Counters, started: Instant, first_token: Option<Instant>) {
    let micros = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    let end = Instant::now();
    let decode_from = first_token.unwrap_or(end);
    counters.prefill_micros.fetch_add(micros(decode_from.duration_since(started)), Ordering::SeqCst);
    counters.decode_micros.fetch_add(micros(end.duration_since(decode_from)), Ordering::SeqCst);
    let experts = session.runner().expert_stats();
    counters.expert_hits.store(experts.hits, Ordering::SeqCst);
    counters.expert_misses.store(experts.misses, Ordering::SeqCst);
    counters.expert_bytes_read.store(experts.bytes_read, Ordering::SeqCst);
}
