//! The RAM expert cache: a least-recently-used cache bounded in bytes, in front of the disk
//! store, fed by a pool of reader threads. It decides only which experts are in memory and
//! when they arrive, never what they compute.
//!
//! - Misses are submitted to the readers at once, and callers can consume experts in
//!   completion order ([`ExpertSource::for_each_loaded`]). The readers serve demand before
//!   loads ahead before predictions, split each record across all of them, and drop queued
//!   predictions the routing did not confirm ([`crate::experts::readers`]).
//! - Predictions are acted on only while they pay ([`crate::experts::prediction`]).
//! - Experts a caller is using are pinned; nothing pinned is evicted.
//! - [`ExpertSource::prefetch`] loads predicted experts in the background into free or
//!   evictable slots, never past the budget and never evicting what is pinned or hot; the
//!   accuracy of predictions and the useful and wasted reads are counted.
//! - The learned hot set: usage counts persist beside the container; at start the most used
//!   experts (up to half the budget) are loaded first and protected from eviction.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::experts::buffers::BufferPool;
use crate::experts::policy::{CachePolicy, Candidate, Eviction, Occupancy, Popularity};
use crate::experts::prediction::PredictionGate;
use crate::experts::readers::{Abandoned, BusyClock, ReadQueue, RecordRead, Urgency};
use crate::experts::store::ExpertStore;
#[cfg(doc)]
use crate::experts::store::HASHED_READ_CHUNK;
use crate::experts::{ExpertSource, ExpertStats};
use crate::model::weights::ExpertWeights;

/// Settings of the RAM cache.
#[derive(Clone, Debug)]
pub struct CacheOptions {
    /// Memory for cached experts.
    pub capacity_bytes: u64,
    /// Reader threads (the disk queue depth).
    pub io_threads: usize,
    /// Where usage counts persist between sessions (`None`: not learned).
    pub usage_file: Option<PathBuf>,
    /// Check every record read against its hash (see [`ExpertStore::set_verify_reads`]).
    pub verify_reads: bool,
    /// What goes when room is needed.
    pub policy: CachePolicy,
    /// Where to record every request (`None`: not recorded); see [`RequestTrace`].
    pub trace: Option<PathBuf>,
    /// Bytes of the pieces a record is split into across the readers: a multiple of 4 KiB
    /// (direct I/O reads at piece offsets); [`HASHED_READ_CHUNK`] is the default.
    pub read_piece_bytes: usize,
    /// Map and touch the cache's buffers, up to its capacity, on a background thread after
    /// load ([`BufferPool::prepare`]), instead of on first use inside the reads.
    pub prepare_memory: bool,
}

/// A record of the requests the cache sees, one line each, for replaying them through other
/// policies (`benches/cache-sim/cache_sim.py --trace`): `D LAYER IDS` for the experts a
/// computation asks for, `P LAYER IDS` for a prediction, `A LAYER IDS` for a load ahead
/// (IDS comma-separated). Writing stops at the first error, which is logged once.
struct RequestTrace {
    out: Mutex<Option<std::io::BufWriter<std::fs::File>>>,
    path: PathBuf,
}

impl RequestTrace {
    fn create(path: &std::path::Path) -> Result<Self> {
        let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(RequestTrace { out: Mutex::new(Some(std::io::BufWriter::new(file))), path: path.to_path_buf() })
    }

    fn record(&self, kind: char, layer: usize, ids: &[usize]) {
        use std::io::Write;
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let Some(w) = out.as_mut() else { return };
        let line = (|| {
            write!(w, "{kind} {layer} ")?;
            for (i, e) in ids.iter().enumerate() {
                write!(w, "{}{e}", if i == 0 { "" } else { "," })?;
            }
            writeln!(w)
        })();
        if let Err(e) = line {
            tracing::warn!("expert request trace {} stopped: {e}", self.path.display());
            *out = None;
        }
    }
}

enum Slot {
    Loading,
    Ready(Arc<ExpertWeights>),
    /// The read or its checks failed; the error goes to the first caller that asks for it.
    Failed(Error),
}

struct Entry {
    slot: Slot,
    last_use: u64,
    /// Callers currently using it.
    pins: u32,
    /// Part of the learned hot set: never evicted.
    protected: bool,
    /// Loaded by a prefetch and not yet asked for.
    speculative: bool,
    /// In the policy's window of recent arrivals, not yet admitted to its main part.
    in_window: bool,
    /// The read in progress while loading.
    read: Option<Arc<RecordRead>>,
    /// How long its read took, once loaded.
    read_time: Option<Duration>,
}

impl Entry {
    /// An expert a caller has just asked for and that is now being read: pinned once by that
    /// caller, used at `now`.
    fn demanded(now: u64) -> Self {
        Entry {
            slot: Slot::Loading,
            last_use: now,
            pins: 1,
            protected: false,
            speculative: false,
            in_window: true,
            read: None,
            read_time: None,
        }
    }
}

#[derive(Default)]
struct State {
    entries: HashMap<(usize, usize), Entry>,
    clock: u64,
    stats: ExpertStats,
    /// Usage count of every expert, this session plus the persisted history.
    usage: Vec<u64>,
    /// Recent use counts, by which [`CachePolicy::Frequency`] admits and evicts.
    popularity: Popularity,
    /// The last prediction for each layer (empty: none), scored and cleared when the layer's
    /// real routing arrives. The vectors are reused from token to token.
    predicted: Vec<Vec<usize>>,
    /// Whether acting on predictions pays.
    gate: PredictionGate,
    /// Recent time of one record read (seconds, exponentially weighted; 0: none yet).
    read_secs: f64,
}

struct Shared {
    store: ExpertStore,
    /// Buffers of evicted experts, reused by the next reads.
    buffers: Arc<BufferPool>,
    state: Mutex<State>,
    /// Signalled whenever a read completes.
    arrived: Condvar,
    /// Experts the budget holds.
    capacity: usize,
    policy: CachePolicy,
    /// Experts the policy's window of recent arrivals holds.
    window: usize,
    trace: Option<RequestTrace>,
    num_experts: usize,
    /// The reads waiting for the reader threads.
    queue: ReadQueue,
    /// Bytes of one piece of a record read.
    piece_bytes: usize,
    /// Time the disk had a read in flight.
    busy: BusyClock,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update under the lock is a single map operation or counter; a panic cannot
        // leave it half-done, so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the read of `key`, whose entry is in `st` and loading, with `urgency`. A record
    /// that cannot be planned fails its entry at once (its caller gets the error).
    fn start_read(&self, st: &mut State, key: (usize, usize), urgency: Urgency) {
        let plan = self.store.plan(key.0, key.1);
        let Some(entry) = st.entries.get_mut(&key) else { return };
        match plan {
            Ok(plan) => {
                let read = RecordRead::new(plan, self.buffers.take(), self.piece_bytes);
                entry.read = Some(Arc::clone(&read));
                self.queue.push(urgency, read);
            }
            Err(e) => {
                entry.slot = Slot::Failed(e);
                self.arrived.notify_all();
            }
        }
    }
}

/// Experts read from disk on demand and kept in a byte-bounded LRU cache.
pub struct CachedExperts {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    usage_file: Option<PathBuf>,
    io_threads: usize,
}

impl CachedExperts {
    /// A cache with the given options. It never holds more experts than the store has;
    /// experts pinned by the current call may exceed the bound briefly.
    /// Fails when a reader thread cannot be started (the threads started are stopped).
    pub fn with_options(mut store: ExpertStore, opts: CacheOptions) -> Result<Self> {
        if opts.read_piece_bytes == 0 || !opts.read_piece_bytes.is_multiple_of(4096) {
            return Err(Error::invalid(format!(
                "expert read pieces of {} bytes: must be a positive multiple of 4096 (--read-piece-kib)",
                opts.read_piece_bytes
            )));
        }
        store.set_verify_reads(opts.verify_reads);
        let trace = opts.trace.as_deref().map(RequestTrace::create).transpose()?;
        let expert_bytes = store.read_bytes().max(1);
        let total = store.len();
        let capacity = ((opts.capacity_bytes / expert_bytes) as usize).min(total);
        let (num_layers, num_experts) = (store.num_layers(), store.num_experts());
        // Usage counts are indexed `layer * num_experts + expert` over every layer (a dense
        // layer's stay zero), so the file does not depend on which layers are MoE.
        let slots = num_layers.saturating_mul(num_experts);
        let usage =
            opts.usage_file.as_deref().and_then(|p| read_usage(p, slots)).unwrap_or_else(|| vec![0; slots]);
        // Buffers freed by evictions are kept for the reads that caused them: a group of
        // misses takes all its buffers when it is queued, and a buffer released to the
        // system has to be mapped and faulted in again by the next read. Entries plus free
        // buffers never exceed the capacity (or the most entries the cache has held, when
        // pins took it past), and the preparation after load stops at the capacity, so
        // keeping up to it costs no memory beyond the budget.
        let buffers = BufferPool::new(store.read_bytes() as usize, capacity.max(opts.io_threads.max(1) + 2));
        let shared = Arc::new(Shared {
            store,
            buffers,
            state: Mutex::new(State {
                usage,
                popularity: Popularity::new(slots, popularity_sample(capacity)),
                predicted: vec![Vec::new(); num_layers],
                ..Default::default()
            }),
            arrived: Condvar::new(),
            capacity,
            policy: opts.policy,
            window: window_size(capacity),
            trace,
            num_experts,
            queue: ReadQueue::new(),
            piece_bytes: opts.read_piece_bytes,
            busy: BusyClock::default(),
        });
        let mut workers = Vec::new();
        for i in 0..opts.io_threads.max(1) {
            let reader = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("picchio-io-{i}"))
                .spawn(move || reader_loop(&reader));
            match spawned {
                Ok(w) => workers.push(w),
                Err(e) => {
                    // Closing the queue ends the readers already started.
                    shared.queue.close();
                    for w in workers {
                        let _ = w.join();
                    }
                    return Err(Error::invalid(format!(
                        "cannot start expert reader thread {} of {} (--io-threads): {e}",
                        i + 1,
                        opts.io_threads
                    )));
                }
            }
        }
        let cache = CachedExperts {
            shared,
            workers,
            usage_file: opts.usage_file,
            io_threads: opts.io_threads.max(1),
        };
        cache.load_hot_set();
        if opts.prepare_memory
            && let Err(e) = cache.shared.buffers.prepare(capacity)
        {
            // Only slower: the reads make their buffers as they need them.
            tracing::warn!("the expert cache's memory is not prepared in the background: {e}");
        }
        Ok(cache)
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.shared.store.is_direct()
    }

    /// Loads the most used experts of earlier sessions (at most half the budget) and
    /// protects them from eviction.
    fn load_hot_set(&self) {
        let hot = self.most_used(self.shared.capacity / 2);
        let mut st = self.shared.lock();
        let e = self.shared.num_experts;
        for &i in &hot {
            let key = (i / e, i % e);
            st.entries.insert(
                key,
                Entry { protected: true, pins: 0, last_use: 0, in_window: false, ..Entry::demanded(0) },
            );
            self.shared.start_read(&mut st, key, Urgency::Ahead);
        }
        st.stats.hot_set = hot.len() as u64;
    }

    /// The weights of `ids` of `layer`, in order, through [`Self::demand`].
    fn fetch(&self, layer: usize, ids: &[usize], count_use: bool) -> Result<Vec<Arc<ExpertWeights>>> {
        let mut out: Vec<Option<Arc<ExpertWeights>>> = vec![None; ids.len()];
        let mut put = |i: usize, w: Arc<ExpertWeights>| {
            out[i] = Some(w);
            Ok(())
        };
        self.demand(layer, ids, &[], &mut put, count_use)?;
        Ok(out.into_iter().map(|w| w.expect("every index is delivered")).collect())
    }

    /// Hands each of `ids` of `layer` to `f` as it arrives (reading the missing ones), the
    /// demand path of [`ExpertSource::for_each_loaded`]; `count_use` says whether the
    /// requests count towards the learned hot set (a preload or a probe does not).
    fn demand(
        &self,
        layer: usize,
        ids: &[usize],
        ahead: &[usize],
        f: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
        count_use: bool,
    ) -> Result<()> {
        if layer >= self.shared.store.num_layers() || ids.iter().any(|&e| e >= self.shared.num_experts) {
            return Err(Error::invalid(format!("no such experts in layer {layer}: {ids:?}")));
        }
        if let Some(t) = &self.shared.trace {
            t.record('D', layer, ids);
        }
        let mut to_read = Vec::new();
        {
            let mut st = self.shared.lock();
            st.clock += 1;
            let now = st.clock;
            let mut predicted = std::mem::take(&mut st.predicted[layer]);
            if !predicted.is_empty() {
                st.stats.predicted += ids.len() as u64;
                st.stats.predicted_right += ids.iter().filter(|e| predicted.contains(e)).count() as u64;
                for &e in predicted.iter().filter(|e| !ids.contains(e)) {
                    self.drop_wrong_guess(&mut st, (layer, e));
                }
                predicted.clear();
            }
            st.predicted[layer] = predicted;
            let e_count = self.shared.num_experts;
            for &e in ids {
                if count_use {
                    st.usage[layer * e_count + e] += 1;
                }
                st.popularity.record(layer * e_count + e);
                let found = st.entries.get_mut(&(layer, e)).map(|entry| {
                    entry.pins += 1;
                    entry.last_use = now;
                    let guess = std::mem::take(&mut entry.speculative);
                    // How far a background read had got: done (its whole read time is behind
                    // us), under way (the time since it started), or still queued.
                    let progress = match &entry.slot {
                        Slot::Ready(_) => entry.read_time.map(|d| (d, true)),
                        _ => entry.read.as_ref().and_then(|r| r.started()).map(|t| (t.elapsed(), false)),
                    };
                    (guess, progress, matches!(entry.slot, Slot::Loading))
                });
                match found {
                    Some((guess, progress, loading)) => {
                        st.stats.hits += 1;
                        if guess {
                            st.stats.prefetch_useful += 1;
                            let cap = if st.read_secs > 0.0 { st.read_secs } else { f64::INFINITY };
                            let hidden = progress.map_or(0.0, |(d, _)| d.as_secs_f64().min(cap));
                            st.gate.hid(hidden);
                            st.stats.prefetch_hidden += Duration::from_secs_f64(hidden);
                        }
                        if loading && self.shared.queue.promote((layer, e), Urgency::Demand) {
                            st.stats.promoted += 1;
                        }
                    }
                    None => {
                        st.stats.misses += 1;
                        st.entries.insert((layer, e), Entry::demanded(now));
                        to_read.push(e);
                    }
                }
            }
            self.evict_to_fit(&mut st, 0);
            for &e in &to_read {
                self.shared.start_read(&mut st, (layer, e), Urgency::Demand);
            }
        }
        // These are pinned now, so loading the next ones cannot push them out.
        if !ahead.is_empty() {
            self.start_loads(layer, ahead, false);
        }
        let result = self.deliver(layer, ids, f);
        self.unpin(layer, ids);
        result
    }

    /// The indices (`layer * experts + expert`) of at most `n` experts with a use count,
    /// most used first, ties by index.
    fn most_used(&self, n: usize) -> Vec<usize> {
        let st = self.shared.lock();
        let mut ranked: Vec<(u64, usize)> =
            st.usage.iter().enumerate().filter(|(_, c)| **c > 0).map(|(i, &c)| (c, i)).collect();
        ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        ranked.into_iter().take(n).map(|(_, i)| i).collect()
    }

    /// Writes the usage counts (history plus this session) for the next session.
    pub fn save_usage(&self) -> Result<()> {
        let Some(path) = &self.usage_file else { return Ok(()) };
        let usage = self.shared.lock().usage.clone();
        let text = serde_json::to_string(
            &serde_json::json!({ "format": "picchio-expert-usage/1", "counts": usage }),
        )
        .expect("usage serializes");
        std::fs::write(path, text).map_err(|e| Error::io(path, e))
    }

    /// Evicts unpinned, unprotected, loaded entries, as the policy chooses, until the cache
    /// is within budget (or nothing more can go). A failed read nobody waits for goes first
    /// (a request reads it again).
    fn evict_to_fit(&self, st: &mut State, room_for: usize) {
        while st.entries.len() + room_for > self.shared.capacity {
            let failed = st
                .entries
                .iter()
                .find(|(_, e)| e.pins == 0 && matches!(e.slot, Slot::Failed(_)))
                .map(|(k, _)| *k);
            let choice = match failed {
                Some(k) => Some(Eviction::Drop(k)),
                None => {
                    let e_count = self.shared.num_experts;
                    let window = st.entries.values().filter(|e| e.in_window).count();
                    let occupancy = Occupancy {
                        window,
                        window_cap: self.shared.window,
                        main: st.entries.len() - window,
                        main_cap: self.shared.capacity.saturating_sub(self.shared.window),
                    };
                    let candidates = st
                        .entries
                        .iter()
                        .filter(|(_, e)| e.pins == 0 && !e.protected && matches!(e.slot, Slot::Ready(_)))
                        .map(|(&(l, x), e)| Candidate {
                            key: (l, x),
                            last_use: e.last_use,
                            in_window: e.in_window,
                            popularity: st.popularity.of(l * e_count + x),
                        });
                    self.shared.policy.evict(candidates, occupancy)
                }
            };
            let victim = match choice {
                None => break,
                Some(Eviction::Drop(k)) => k,
                Some(Eviction::Admit(k)) => {
                    if let Some(e) = st.entries.get_mut(&k) {
                        e.in_window = false;
                    }
                    continue;
                }
                Some(Eviction::Replace { admit, drop }) => {
                    if let Some(e) = st.entries.get_mut(&admit) {
                        e.in_window = false;
                    }
                    drop
                }
            };
            if st.entries.remove(&victim).is_some_and(|e| e.speculative) {
                st.stats.prefetch_wasted += 1;
            }
            st.stats.evictions += 1;
        }
    }

    fn unpin(&self, layer: usize, ids: &[usize]) {
        let mut st = self.shared.lock();
        for &e in ids {
            if let Some(entry) = st.entries.get_mut(&(layer, e)) {
                entry.pins = entry.pins.saturating_sub(1);
            }
        }
        self.evict_to_fit(&mut st, 0);
    }
}

/// A reader thread: reads the next piece of the most urgent record; whoever completes a
/// record checks and decodes it and publishes the result.
fn reader_loop(shared: &Shared) {
    while let Some(piece) = shared.queue.next() {
        let read = Arc::clone(piece.record());
        let started = Instant::now();
        let mut reading = Duration::ZERO;
        let bytes = piece.read(|offset, dst| {
            let (result, took) = shared.busy.time(|| shared.store.read_raw(dst, offset));
            reading = took;
            result
        });
        // What the piece took beyond its read: checking the record's hash in order.
        shared.lock().stats.check_time += started.elapsed().saturating_sub(reading);
        let Some(bytes) = bytes else { continue };
        let plan = *read.plan();
        let (layer, expert) = plan.key;
        // A panic while decoding must not leave the slot loading forever (its caller would
        // wait for ever): it becomes that read's error.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (buf, hash) = bytes.map_err(|e| shared.store.read_error(&plan, e))?;
            shared.store.finish(&plan, buf, hash)
        }))
        .unwrap_or_else(|panic| {
            Err(Error::format(
                shared.store.path(),
                format!("reading layer {layer} expert {expert} failed: {}", panic_text(&*panic)),
            ))
        });
        let took = read.started().map(|t| t.elapsed());
        let mut st = shared.lock();
        st.stats.reads += 1;
        st.stats.bytes_read += shared.store.read_bytes();
        if let Some(d) = took {
            let secs = d.as_secs_f64();
            st.read_secs = if st.read_secs == 0.0 { secs } else { 0.9 * st.read_secs + 0.1 * secs };
        }
        // No entry: nobody waits for it any more (cannot happen: loading entries are not
        // evicted, and cancelled and abandoned reads never complete).
        if let Some(entry) = st.entries.get_mut(&(layer, expert)) {
            entry.read = None;
            entry.read_time = took;
            entry.slot = match result {
                Ok(w) => Slot::Ready(Arc::new(w)),
                Err(e) => Slot::Failed(e),
            };
        }
        drop(st);
        shared.arrived.notify_all();
    }
}

/// What a caught panic says.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

impl Drop for CachedExperts {
    fn drop(&mut self) {
        if let Err(e) = self.save_usage() {
            tracing::debug!("expert usage not saved: {e}");
        }
        self.shared.buffers.stop_preparing();
        // Closing the queue ends the readers (reads in flight finish first).
        self.shared.queue.close();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl ExpertSource for CachedExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<Arc<ExpertWeights>> {
        Ok(self.experts(layer, &[expert])?.remove(0))
    }

    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>> {
        self.fetch(layer, ids, true)
    }

    fn for_each_loaded(
        &self,
        layer: usize,
        ids: &[usize],
        ahead: &[usize],
        f: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
    ) -> Result<()> {
        self.demand(layer, ids, ahead, f, true)
    }

    fn preload(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>> {
        self.fetch(layer, ids, false)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        self.start_loads(layer, ids, true);
    }

    fn load_ahead(&self, layer: usize, ids: &[usize]) {
        self.start_loads(layer, ids, false);
    }

    fn batch_limit(&self) -> usize {
        (self.shared.capacity / 2).max(1)
    }

    fn hot_experts(&self, n: usize) -> Vec<(usize, usize)> {
        let e = self.shared.num_experts;
        self.most_used(n).into_iter().map(|i| (i / e, i % e)).collect()
    }

    fn wait_prepared(&self) -> Option<crate::experts::buffers::Preparation> {
        Some(self.shared.buffers.wait_prepared())
    }

    fn expert_bytes(&self) -> u64 {
        self.shared.store.read_bytes()
    }

    fn host_bytes(&self) -> u64 {
        // Entries plus the buffers kept for reuse never exceed the capacity (see `with_options`).
        self.shared.capacity as u64 * self.shared.store.read_bytes()
    }

    fn describe(&self) -> String {
        format!(
            "experts from disk ({} reader thread{}, {}) through a {} RAM cache ({} of {} experts, {} policy)",
            self.io_threads,
            if self.io_threads == 1 { "" } else { "s" },
            if self.is_direct() { "direct I/O" } else { "buffered" },
            crate::system::gib(self.shared.capacity as u64 * self.shared.store.read_bytes()),
            self.shared.capacity,
            self.shared.store.len(),
            self.shared.policy
        )
    }

    fn stats(&self) -> ExpertStats {
        let st = self.shared.lock();
        let mut stats = st.stats;
        stats.disk_busy = self.shared.busy.total();
        stats.busy_stretches = self.shared.busy.stretches();
        stats.read_time = self.shared.busy.reading();
        stats.prefetch_pending = st.entries.values().filter(|e| e.speculative).count() as u64;
        stats
    }
}

impl CachedExperts {
    /// Hands each of `ids` to `f` as soon as it is in memory (already cached ones first),
    /// waiting for reads in between; the wait is counted as disk time.
    fn deliver(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(usize, Arc<ExpertWeights>) -> Result<()>,
    ) -> Result<()> {
        let mut pending: Vec<usize> = (0..ids.len()).collect();
        while !pending.is_empty() {
            let ready = {
                let mut st = self.shared.lock();
                loop {
                    let mut ready = Vec::new();
                    for &i in &pending {
                        let key = (layer, ids[i]);
                        match st.entries.get(&key).map(|e| &e.slot) {
                            Some(Slot::Ready(w)) => ready.push((i, Arc::clone(w))),
                            Some(Slot::Loading) => {}
                            Some(Slot::Failed(_)) => {
                                // The failed entry goes (a later request reads it again); its
                                // error, with its kind, goes to this caller.
                                if let Some(Entry { slot: Slot::Failed(e), .. }) = st.entries.remove(&key) {
                                    return Err(e);
                                }
                            }
                            None => {
                                // Another caller took this expert's error; read it again.
                                let now = st.clock;
                                st.entries.insert(key, Entry::demanded(now));
                                self.shared.start_read(&mut st, key, Urgency::Demand);
                            }
                        }
                    }
                    if !ready.is_empty() {
                        break ready;
                    }
                    let t0 = Instant::now();
                    st = self.shared.arrived.wait(st).unwrap_or_else(|p| p.into_inner());
                    st.stats.disk_wait += t0.elapsed();
                }
            };
            pending.retain(|i| !ready.iter().any(|(r, _)| r == i));
            for (i, w) in ready {
                f(i, w)?;
            }
        }
        Ok(())
    }
}

impl CachedExperts {
    /// Starts background reads of `ids` of `layer` into free or evictable room; a
    /// `prediction` is remembered and scored against the layer's real routing.
    fn start_loads(&self, layer: usize, ids: &[usize], prediction: bool) {
        if layer >= self.shared.store.num_layers() {
            return;
        }
        if let Some(t) = &self.shared.trace {
            t.record(if prediction { 'P' } else { 'A' }, layer, ids);
        }
        let mut st = self.shared.lock();
        if prediction {
            // A newer prediction of the same layer (made from a later, better state)
            // supersedes the older: the older's guesses it drops leave the queue if their
            // reads have not started.
            let mut predicted = std::mem::take(&mut st.predicted[layer]);
            for &e in predicted.iter().filter(|e| !ids.contains(e)) {
                self.drop_wrong_guess(&mut st, (layer, e));
            }
            predicted.clear();
            predicted.extend_from_slice(ids);
            st.predicted[layer] = predicted;
            // The prediction is scored either way (its accuracy is reported), but read only
            // while predictions pay.
            if !st.gate.admit() {
                st.stats.prediction_gated += 1;
                return;
            }
        }
        {
            for &e in ids {
                if e >= self.shared.num_experts || st.entries.contains_key(&(layer, e)) {
                    continue;
                }
                // Only into free room or room freed from unpinned, cold entries.
                self.evict_to_fit(&mut st, 1);
                if st.entries.len() >= self.shared.capacity {
                    st.stats.prefetch_skipped += 1;
                    continue;
                }
                let now = st.clock;
                st.entries
                    .insert((layer, e), Entry { pins: 0, speculative: prediction, ..Entry::demanded(now) });
                if prediction {
                    st.stats.prefetch_reads += 1;
                }
                let urgency = if prediction { Urgency::Predicted } else { Urgency::Ahead };
                self.shared.start_read(&mut st, (layer, e), urgency);
            }
        }
    }

    /// A predicted expert the routing did not choose: cancelled if its read has not
    /// started (the disk never reads it), abandoned if only some of its pieces have (the rest
    /// are never read; the gate is charged the share read), else charged to the prediction
    /// gate and left to go first when room is needed, before anything that was used.
    fn drop_wrong_guess(&self, st: &mut State, key: (usize, usize)) {
        let Some(entry) = st.entries.get_mut(&key) else { return };
        if !entry.speculative {
            return;
        }
        entry.last_use = 0;
        let loading = matches!(entry.slot, Slot::Loading) && entry.pins == 0;
        let outcome = if loading { self.shared.queue.abandon(key) } else { Abandoned::NotQueued };
        // The share of one record's read time the guess cost the disk.
        let share = match outcome {
            Abandoned::Cancelled => {
                st.entries.remove(&key);
                st.stats.prefetch_cancelled += 1;
                return;
            }
            Abandoned::Partly { read_bytes } => {
                // Nobody waits for it (it is unpinned), and the record never completes.
                st.entries.remove(&key);
                st.stats.prefetch_abandoned += 1;
                st.stats.bytes_read += read_bytes as u64;
                read_bytes as f64 / self.shared.store.read_bytes().max(1) as f64
            }
            Abandoned::NotQueued => 1.0,
        };
        let cost = st.read_secs * share;
        st.gate.wasted(cost);
        st.stats.prefetch_cost += Duration::from_secs_f64(cost);
    }
}

/// Usage counts persisted by an earlier session, if the file matches this store.
fn read_usage(path: &std::path::Path, len: usize) -> Option<Vec<u64>> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let counts: Vec<u64> = v.get("counts")?.as_array()?.iter().map(|c| c.as_u64().unwrap_or(0)).collect();
    (counts.len() == len).then_some(counts)
}

/// Requests between two halvings of the popularity counts: ten per expert the cache holds,
/// TinyLFU's sample size, so a count reflects the last few passes over the cache.
fn popularity_sample(capacity: usize) -> u64 {
    (capacity as u64).saturating_mul(10).max(1)
}

/// Experts the window of recent arrivals holds under [`CachePolicy::Frequency`].
fn window_size(capacity: usize) -> usize {
    (capacity / WINDOW_SHARE).max(1)
}

/// The window is 1/WINDOW_SHARE of the cache.
const WINDOW_SHARE: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::store::HASHED_READ_CHUNK;
    use crate::format::container::{Container, ConvertOptions, convert};
    use crate::synth::{SynthShape, SynthSpec, synth};

    /// A converted tiny synthetic container (4 layers of 8 experts).
    fn tiny_container() -> tempfile::TempDir {
        let src = tempfile::tempdir().unwrap();
        synth(&SynthSpec::of(SynthShape::Tiny), src.path(), &mut |_, _| {}).unwrap();
        let out = tempfile::tempdir().unwrap();
        let opts = ConvertOptions { formats: Default::default(), progress: false, interrupt_after: None };
        convert(src.path(), out.path(), &opts).unwrap();
        out
    }

    /// A cache over `dir` with room for `experts` records and two readers.
    fn cache(dir: &std::path::Path, experts: u64) -> CachedExperts {
        let c = Container::open(dir).unwrap();
        let store = ExpertStore::open_with(dir, c.experts(), Arc::new(c.config.clone()), false).unwrap();
        let capacity_bytes = experts * store.read_bytes();
        let opts = CacheOptions {
            capacity_bytes,
            io_threads: 2,
            usage_file: None,
            verify_reads: true,
            policy: CachePolicy::default(),
            trace: None,
            read_piece_bytes: HASHED_READ_CHUNK,
            prepare_memory: false,
        };
        CachedExperts::with_options(store, opts).unwrap()
    }

    fn same_weights(a: &ExpertWeights, b: &ExpertWeights) -> bool {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        bits(&a.gate_up.to_f32()) == bits(&b.gate_up.to_f32())
            && bits(&a.down.to_f32()) == bits(&b.down.to_f32())
            && bits(&a.gate_up_bias) == bits(&b.gate_up_bias)
            && bits(&a.down_bias) == bits(&b.down_bias)
    }

    /// The near-end prediction of a layer is followed by the one after the layer: the newer
    /// supersedes the older. Guesses only the older made leave the queue unread, the guesses
    /// both made are read once, and the experts delivered are the store's.
    #[test]
    fn a_newer_prediction_of_a_layer_drops_the_older_guesses_it_does_not_repeat() {
        let dir = tiny_container();
        let cache = cache(dir.path(), 16);
        cache.shared.queue.hold(true);
        cache.prefetch(1, &[0, 1, 2, 3]);
        assert_eq!(cache.shared.queue.queued(), [0, 0, 4], "four guesses wait in the predicted lane");
        cache.prefetch(1, &[0, 1, 4, 5]);
        assert_eq!(cache.shared.queue.queued(), [0, 0, 4], "2 and 3 left, 4 and 5 joined");
        {
            let st = cache.shared.lock();
            assert_eq!(st.stats.prefetch_cancelled, 2);
            assert_eq!(st.stats.prefetch_reads, 6);
            for e in [0, 1, 4, 5] {
                assert!(st.entries.contains_key(&(1, e)), "expert {e} is still loading");
            }
            for e in [2, 3] {
                assert!(!st.entries.contains_key(&(1, e)), "expert {e} was dropped");
            }
            assert_eq!(st.predicted[1], vec![0, 1, 4, 5]);
        }
        cache.shared.queue.hold(false);
        let got = cache.experts(1, &[0, 1, 4, 5]).unwrap();
        let stats = cache.stats();
        assert_eq!(stats.reads, 4, "only the guesses still wanted were read");
        assert_eq!(stats.prefetch_useful, 4);
        assert_eq!(stats.predicted_right, 4);
        assert_eq!(stats.bytes_read, 4 * cache.shared.store.read_bytes());

        let plain = self::cache(dir.path(), 16);
        let want = plain.experts(1, &[0, 1, 4, 5]).unwrap();
        for (e, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(same_weights(a, b), "expert {e} differs from a read without prediction");
        }
    }
}
