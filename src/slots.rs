//! Slots: several conversations on one loaded model, their decode steps batched.
//!
//! [`Slots::start`] takes a runner, gives it one key/value cache per slot
//! ([`Runner::add_sequence`]) and moves it onto a scheduler thread. Each slot is an ordinary
//! [`Session`] whose runner ([`SlotRunner`]) hands every forward call to that thread and
//! waits for its logits, so every turn feature built on sessions (prefix reuse, stop
//! strings, grammars, penalties, seeds, log probabilities) works per slot unchanged, each
//! slot driven from its own thread.
//!
//! The scheduler runs in rounds. A round gathers the calls of the slots that are expected
//! back (those it answered in the last round, except a turn's final consume), waiting at
//! most [`GATHER_WAIT`] for stragglers; then it runs every one-token call as one batched
//! step ([`Runner::step`]: dense products over all rows, each expert of the step's union
//! once, attention per sequence) and one block of the oldest longer call (a prompt), so a
//! long prompt is interleaved with running decodes instead of stalling them for its whole
//! length. Prompt blocks are cut exactly where the runner would cut them alone, and a
//! batched row is computed as it would be alone, so a slot's logits do not depend on what
//! runs beside it (on the CPU, bit for bit).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::SeqPos;
use crate::config::ModelConfig;
use crate::engine::{Pick, Picked, Runner};
use crate::error::{Error, Result};
use crate::experts::ExpertStats;
use crate::model::forward::PhaseTimes;
use crate::model::{LogitRows, NoObserver, Observer};
use crate::session::Session;

/// Longest a round waits for the calls of slots that are expected back (a slot samples
/// between its tokens) before it runs without them.
pub const GATHER_WAIT: Duration = Duration::from_millis(20);

/// Counters of the scheduler, shared with the slots' runners and the server's metrics.
#[derive(Debug, Default)]
pub struct SlotCounters {
    /// Batched decode steps run (rounds with at least one one-token call).
    pub steps: AtomicU64,
    /// Rows of those steps, summed (divided by `steps`: the mean batch size).
    pub step_rows: AtomicU64,
    /// Rows of the last step.
    pub last_step_rows: AtomicU64,
    /// Largest step so far.
    pub max_step_rows: AtomicU64,
    /// Prompt blocks run.
    pub prefill_blocks: AtomicU64,
}

/// What the runner reported after the last round, for the slots' [`Runner`] queries.
#[derive(Clone, Debug, Default)]
struct Snapshot {
    times: PhaseTimes,
    experts: ExpertStats,
    report: Vec<String>,
}

/// The state the scheduler shares with the slots.
#[derive(Debug, Default)]
struct Shared {
    counters: Arc<SlotCounters>,
    snapshot: Mutex<Snapshot>,
}

/// One forward call of a slot.
struct Call {
    seq: usize,
    ids: Vec<u32>,
    start_pos: usize,
    rows: LogitRows,
    /// What the last position hands back instead of logits rows (a greedy token or a
    /// planned pick, made where the logits are); `None`: the logits of `rows`.
    pick: Option<Pick>,
    /// IDs already computed (a prompt runs block by block).
    done: usize,
    /// Logits of the blocks computed so far.
    logits: Vec<f32>,
    reply: mpsc::SyncSender<Result<Picked>>,
}

impl Call {
    /// What the call's last position hands back, as a [`Pick`].
    fn last_pick(&self) -> Pick {
        match (&self.pick, self.rows) {
            (Some(p), _) => p.clone(),
            (None, LogitRows::None) => Pick::Nothing,
            (None, _) => Pick::Logits,
        }
    }
}

/// The handle of running slots: their counters, and the scheduler thread.
pub struct Slots {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    count: usize,
}

impl Slots {
    /// Puts `runner` behind a scheduler thread with up to `slots` sequences and returns one
    /// session per slot. The first session starts with `history` (the tokens the runner's
    /// first cache already holds, e.g. from [`Session::into_parts`]); the others start
    /// empty. A runner that cannot add as many caches (VRAM or memory runs out) gives fewer slots: the log
    /// says so, and the result has as many sessions as there are slots.
    pub fn start(
        mut runner: Box<dyn Runner>,
        slots: usize,
        history: Vec<u32>,
    ) -> Result<(Slots, Vec<Session>)> {
        let mut count = 1;
        while count < slots.max(1) {
            match runner.add_sequence() {
                Ok(seq) if seq == count => count += 1,
                Ok(seq) => return Err(Error::Backend(format!("add_sequence gave {seq}, expected {count}"))),
                Err(e) => {
                    tracing::warn!("{count} slot(s) instead of {slots}: {e}");
                    break;
                }
            }
        }
        let shared = Arc::new(Shared::default());
        let cfg = runner.config().clone();
        let (capacity, describe, prefill_block) =
            (runner.capacity(), runner.describe(), runner.prefill_block());
        *shared.snapshot.lock().unwrap_or_else(|p| p.into_inner()) =
            Snapshot { times: runner.times(), experts: runner.expert_stats(), report: runner.report() };
        let (tx, rx) = mpsc::channel::<Call>();
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("picchio-slots".into())
                .spawn(move || Scheduler::new(runner, rx, shared).run())
                .map_err(|e| Error::io("<slots thread>", e))?
        };
        let mut history = Some(history);
        let sessions = (0..count)
            .map(|seq| {
                let runner = SlotRunner {
                    seq,
                    tx: tx.clone(),
                    cfg: cfg.clone(),
                    capacity,
                    prefill_block,
                    describe: format!("{describe}; slot {seq} of {count}"),
                    shared: Arc::clone(&shared),
                };
                let tokens = if seq == 0 { history.take().unwrap_or_default() } else { Vec::new() };
                Session::with_history(Box::new(runner), tokens)
            })
            .collect();
        Ok((Slots { shared, thread: Some(thread), count }, sessions))
    }

    /// Number of slots.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The scheduler's counters.
    pub fn counters(&self) -> &SlotCounters {
        &self.shared.counters
    }

    /// The scheduler's counters, to keep beyond this handle (the server's metrics).
    pub fn shared_counters(&self) -> Arc<SlotCounters> {
        Arc::clone(&self.shared.counters)
    }

    /// The expert source's counters after the last round.
    pub fn expert_stats(&self) -> ExpertStats {
        lock(&self.shared.snapshot).experts
    }

    /// Waits for the scheduler thread, which ends once every slot's session is dropped.
    pub fn join(mut self) {
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the slots' scheduler thread panicked");
        }
    }
}

fn lock<T: Clone>(m: &Mutex<T>) -> T {
    m.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The runner of one slot: forwards each call to the scheduler and waits for its logits.
pub struct SlotRunner {
    seq: usize,
    tx: mpsc::Sender<Call>,
    cfg: ModelConfig,
    capacity: usize,
    /// The shared runner's prefill block, so a session stops between the same blocks.
    prefill_block: usize,
    describe: String,
    shared: Arc<Shared>,
}

impl SlotRunner {
    /// Hands a forward call to the scheduler and waits for its answer.
    fn call(&self, ids: &[u32], start_pos: usize, rows: LogitRows, pick: Option<Pick>) -> Result<Picked> {
        let (reply, answer) = mpsc::sync_channel(1);
        let call = Call {
            seq: self.seq,
            ids: ids.to_vec(),
            start_pos,
            rows,
            pick,
            done: 0,
            logits: Vec::new(),
            reply,
        };
        let gone = || Error::Backend("the slots' scheduler has stopped".into());
        self.tx.send(call).map_err(|_| gone())?;
        answer.recv().map_err(|_| gone())?
    }
}

impl Runner for SlotRunner {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        observer: &mut dyn Observer,
    ) -> Result<Vec<f32>> {
        if observer.enabled() {
            return Err(Error::invalid("observers cannot watch a slot's forward pass; run a session alone"));
        }
        match self.call(ids, start_pos, rows, None)? {
            Picked::Logits(logits) => Ok(logits),
            Picked::Nothing => Ok(Vec::new()),
            _ => Err(Error::Backend("the slots' scheduler answered logits with a pick".into())),
        }
    }

    fn forward_pick(&mut self, seq: usize, ids: &[u32], start_pos: usize, pick: &Pick) -> Result<Picked> {
        if seq != 0 {
            return Err(Error::Backend(format!("sequence {seq} does not exist (a slot is one sequence)")));
        }
        let rows = if matches!(pick, Pick::Nothing) { LogitRows::None } else { LogitRows::Last };
        self.call(ids, start_pos, rows, Some(pick.clone()))
    }

    fn prefill_block(&self) -> usize {
        self.prefill_block
    }

    fn times(&self) -> PhaseTimes {
        lock(&self.shared.snapshot).times
    }

    fn expert_stats(&self) -> ExpertStats {
        lock(&self.shared.snapshot).experts
    }

    fn report(&self) -> Vec<String> {
        lock(&self.shared.snapshot).report
    }
}

/// The scheduler thread's state.
struct Scheduler {
    runner: Box<dyn Runner>,
    calls: mpsc::Receiver<Call>,
    shared: Arc<Shared>,
    /// Calls waiting, in arrival order.
    pending: Vec<Call>,
    /// Slots expected back with their next call soon.
    expected: Vec<usize>,
    block: usize,
}

impl Scheduler {
    fn new(runner: Box<dyn Runner>, calls: mpsc::Receiver<Call>, shared: Arc<Shared>) -> Self {
        let block = runner.prefill_block().max(1);
        Scheduler { runner, calls, shared, pending: Vec::new(), expected: Vec::new(), block }
    }

    /// Serves rounds until every slot's runner is gone.
    fn run(mut self) {
        loop {
            if self.pending.is_empty() {
                match self.calls.recv() {
                    Ok(call) => self.pending.push(call),
                    Err(_) => return,
                }
            }
            self.gather();
            self.round();
            self.publish();
        }
    }

    /// Takes every call that has arrived, then waits up to [`GATHER_WAIT`] for the expected
    /// slots that have not called yet.
    fn gather(&mut self) {
        while let Ok(call) = self.calls.try_recv() {
            self.pending.push(call);
        }
        let deadline = Instant::now() + GATHER_WAIT;
        while self.expected.iter().any(|s| !self.pending.iter().any(|c| c.seq == *s)) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            match self.calls.recv_timeout(deadline - now) {
                Ok(call) => self.pending.push(call),
                Err(_) => break,
            }
        }
    }

    /// One batched decode step over the one-token calls, then one block of the oldest prompt.
    fn round(&mut self) {
        self.expected.clear();
        let (decode, mut rest): (Vec<Call>, Vec<Call>) =
            std::mem::take(&mut self.pending).into_iter().partition(|c| c.ids.len() == 1);
        if !decode.is_empty() {
            self.decode(decode);
        }
        if let Some(i) = rest.iter().position(|c| c.ids.len() > 1) {
            let call = rest.remove(i);
            if let Some(call) = self.prompt_block(call) {
                self.expected.push(call.seq);
                rest.insert(i, call);
            }
        }
        // Empty calls (none are sent by sessions) are answered at once.
        rest.retain(|c| {
            if c.ids.is_empty() {
                let _ = c.reply.send(Ok(Picked::Nothing));
                return false;
            }
            true
        });
        self.pending = rest;
    }

    /// Runs the one-token calls as one step and answers each.
    fn decode(&mut self, calls: Vec<Call>) {
        let counters = &self.shared.counters;
        let n = calls.len() as u64;
        counters.steps.fetch_add(1, Ordering::SeqCst);
        counters.step_rows.fetch_add(n, Ordering::SeqCst);
        counters.last_step_rows.store(n, Ordering::SeqCst);
        counters.max_step_rows.fetch_max(n, Ordering::SeqCst);
        if let [call] = calls.as_slice() {
            // One row: the runner's own path, as a session alone would run it.
            let (seq, pos, pick) = (call.seq, call.start_pos, call.last_pick());
            let result = catch(|| self.runner.forward_pick(seq, &call.ids, pos, &pick));
            self.answer(calls.into_iter().next().expect("one call"), result);
            return;
        }
        let rows: Vec<SeqPos> = calls.iter().map(|c| SeqPos { seq: c.seq, pos: c.start_pos }).collect();
        let ids: Vec<u32> = calls.iter().map(|c| c.ids[0]).collect();
        let picks: Vec<Pick> = calls.iter().map(Call::last_pick).collect();
        let result = catch(|| self.runner.step_picks(&rows, &ids, &picks));
        match result {
            Ok(picked) if picked.len() == calls.len() => {
                for (call, row) in calls.into_iter().zip(picked) {
                    self.answer(call, Ok(row));
                }
            }
            Ok(picked) => {
                let e = format!("the step handed back {} rows for {}", picked.len(), calls.len());
                for call in calls {
                    self.answer(call, Err(Error::Backend(e.clone())));
                }
            }
            Err(e) => {
                for call in calls {
                    self.answer(call, Err(Error::Backend(e.to_string())));
                }
            }
        }
    }

    /// Answers a finished call and notes whether its slot is expected back.
    fn answer(&mut self, call: Call, result: Result<Picked>) {
        // A turn ends by consuming its last token without logits; anything else is
        // followed by the slot's next call.
        let ends_turn = call.ids.len() == 1 && matches!(call.last_pick(), Pick::Nothing);
        if result.is_ok() && !ends_turn {
            self.expected.push(call.seq);
        }
        let _ = call.reply.send(result);
    }

    /// Runs the next block of a prompt call: the finished call is answered (`None`), an
    /// unfinished one comes back to wait for the next round.
    fn prompt_block(&mut self, mut call: Call) -> Option<Call> {
        let end = call.ids.len().min(call.done + self.block);
        let last = end == call.ids.len();
        let rows = match call.rows {
            LogitRows::All => LogitRows::All,
            LogitRows::Last if last => LogitRows::Last,
            LogitRows::Last | LogitRows::None => LogitRows::None,
        };
        let ids = &call.ids[call.done..end];
        let pos = call.start_pos + call.done;
        let seq = call.seq;
        let result = match (&call.pick, last) {
            (Some(pick), true) => catch(|| self.runner.forward_pick(seq, ids, pos, pick)),
            _ => catch(|| self.runner.forward_on(seq, ids, pos, rows, &mut NoObserver)).map(Picked::Logits),
        };
        self.shared.counters.prefill_blocks.fetch_add(1, Ordering::SeqCst);
        match result {
            Ok(Picked::Logits(mut logits)) if call.pick.is_none() => {
                call.logits.append(&mut logits);
                call.done = end;
                if !last {
                    return Some(call);
                }
                let logits = std::mem::take(&mut call.logits);
                self.answer(call, Ok(Picked::Logits(logits)));
            }
            Ok(_) if !last => {
                call.done = end;
                return Some(call);
            }
            Ok(picked) => self.answer(call, Ok(picked)),
            Err(e) => self.answer(call, Err(e)),
        }
        None
    }

    /// Copies the runner's counters where the slots read them.
    fn publish(&self) {
        let snapshot = Snapshot {
            times: self.runner.times(),
            experts: self.runner.expert_stats(),
            report: self.runner.report(),
        };
        *self.shared.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = snapshot;
    }
}

/// Runs `f`, turning a panic into an error (the scheduler serves the other slots on).
fn catch<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(Error::Backend(format!("internal error: {what}")))
        }
    }
}
