//! The engine threads: a dispatcher that takes jobs in the order they arrive (FIFO) and
//! gives each to a free slot, preferring the slot whose cached tokens share the longest
//! prefix with the job's prompt, and one thread per slot that owns its [`Session`] (the
//! slots share one runner through [`crate::slots`], which batches their decode steps). A
//! job waits in the queue while every slot is busy. Each job streams what the model says
//! back over its own channel; a closed channel (the client went away) stops its prefill at
//! the next block boundary and its generation at the next token, on its slot only.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::Instant;

use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use super::logprobs::{ContentLogprobs, TokenLogprob};
use super::raw::{RawText, complete_raw};
use crate::chat::{ChatEvent, ChatFormat, Message, TurnOptions, complete_prompt};
use crate::error::Error;
use crate::session::{Session, StopReason};
use crate::slots::SlotCounters;

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
    /// Slots running a job now.
    pub(crate) active: AtomicU64,
    /// Slots the server has (set when the model is attached).
    pub(crate) slots: AtomicU64,
    /// The slots' scheduler counters (steps and their sizes), once the model is attached.
    pub(crate) scheduler: OnceLock<Arc<SlotCounters>>,
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
    /// Whether the engine is generating now (some slot runs a job).
    pub busy: bool,
    /// Slots: conversations served at once (`--parallel`); 0 before the model is attached.
    pub slots: u64,
    /// Slots running a job now.
    pub active_slots: u64,
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
    /// Decode steps run (each advances every slot that was decoding by one token).
    pub decode_steps: u64,
    /// Rows of those steps, summed: over `decode_steps`, the mean batch size.
    pub decode_step_rows: u64,
    /// Expert weight requests (served from memory or disk) so far.
    pub expert_requests: u64,
    /// Bytes of expert weights read from disk so far.
    pub expert_bytes_read: u64,
}

impl Stats {
    /// One line for `--stats`: slots, steps and their mean size, and the expert traffic per
    /// generated token.
    pub fn summary(&self) -> String {
        let per = |total: u64, n: u64| if n == 0 { 0.0 } else { total as f64 / n as f64 };
        format!(
            "{} slot(s); {} completion tokens in {} decode steps (mean batch {:.2} rows); per generated token \
             {:.1} expert requests and {:.0} expert bytes read from disk",
            self.slots,
            self.completion_tokens,
            self.decode_steps,
            per(self.decode_step_rows, self.decode_steps),
            per(self.expert_requests, self.completion_tokens),
            per(self.expert_bytes_read, self.completion_tokens),
        )
    }
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
            busy: get(&self.active) > 0,
            slots: get(&self.slots),
            active_slots: get(&self.active),
            completed: get(&self.completed),
            cancelled: get(&self.cancelled),
            failed: get(&self.failed),
            prompt_tokens: get(&self.prompt_tokens),
            cached_tokens: get(&self.cached_tokens),
            completion_tokens: get(&self.completion_tokens),
            decode_steps: self.scheduler.get().map_or(0, |c| get(&c.steps)),
            decode_step_rows: self.scheduler.get().map_or(0, |c| get(&c.step_rows)),
            expert_requests: get(&self.expert_hits).saturating_add(get(&self.expert_misses)),
            expert_bytes_read: get(&self.expert_bytes_read),
        }
    }
}

/// A slot as the dispatcher sees it: where its jobs go and, while it is free, the tokens
/// its cache holds.
struct SlotLine {
    jobs: mpsc::Sender<Job>,
    /// `Some(cached tokens)` while the slot is free.
    free: Option<Vec<u32>>,
}

/// Serves `jobs` on `sessions` (one per slot) until every sender is gone: each job goes to
/// a free slot, the one whose cache shares the longest prefix with its prompt (the lowest
/// on a tie), and waits in the queue while none is free. `stopping` makes every slot
/// cancel its turn and the queued jobs be refused.
pub(crate) fn run(
    sessions: Vec<Session>,
    format: ChatFormat,
    jobs: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
    stopping: Arc<AtomicBool>,
) {
    let (freed, free_slots) = mpsc::channel::<(usize, Vec<u32>)>();
    let mut lines = Vec::new();
    let mut threads = Vec::new();
    for (i, mut session) in sessions.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel::<Job>();
        lines.push(SlotLine { jobs: tx, free: Some(session.tokens().to_vec()) });
        let (counters, stopping, freed) = (Arc::clone(&counters), Arc::clone(&stopping), freed.clone());
        let format = format.clone();
        let thread = std::thread::Builder::new().name(format!("picchio-slot-{i}")).spawn(move || {
            while let Ok(job) = rx.recv() {
                run_job(&mut session, &format, &job, &counters, &stopping);
                counters.active.fetch_sub(1, Ordering::SeqCst);
                if freed.send((i, session.tokens().to_vec())).is_err() {
                    break;
                }
            }
        });
        match thread {
            Ok(t) => threads.push(t),
            Err(e) => {
                tracing::error!("cannot start the thread of slot {i}: {e}");
                lines.pop();
            }
        }
    }
    drop(freed);
    while let Ok(job) = jobs.recv() {
        // Wait for a free slot; the job stays counted as queued until it gets one.
        while let Ok((i, tokens)) = free_slots.try_recv() {
            lines[i].free = Some(tokens);
        }
        if lines.iter().all(|l| l.free.is_none()) {
            match free_slots.recv() {
                Ok((i, tokens)) => lines[i].free = Some(tokens),
                Err(_) => break,
            }
        }
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
        let Some(slot) = best_slot(&lines, &job.prompt) else { break };
        lines[slot].free = None;
        counters.active.fetch_add(1, Ordering::SeqCst);
        if let Err(mpsc::SendError(job)) = lines[slot].jobs.send(job) {
            counters.active.fetch_sub(1, Ordering::SeqCst);
            let _ = job
                .events
                .send(WorkerMsg::Done(Err(Failure::Engine("the slot's thread has stopped".into()))));
        }
    }
    drop(lines);
    for thread in threads {
        if thread.join().is_err() {
            tracing::error!("a slot's thread panicked");
        }
    }
    tracing::debug!("the engine threads stop: no more requests");
}

/// The free slot whose cached tokens share the longest prefix with `prompt` (the lowest
/// index on a tie); `None` when no slot is free.
fn best_slot(lines: &[SlotLine], prompt: &[u32]) -> Option<usize> {
    let shared = |tokens: &[u32]| tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    lines
        .iter()
        .enumerate()
        .filter_map(|(i, l)| l.free.as_deref().map(|t| (i, shared(t))))
        .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
        .map(|(i, _)| i)
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
