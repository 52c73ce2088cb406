//! The read queue behind the RAM expert cache: which record the reader threads read next, and
//! how one record is split across them.
//!
//! - **Urgency first.** A read a computation waits for ([`Urgency::Demand`]) goes before a
//!   known next read ([`Urgency::Ahead`]), which goes before a guess ([`Urgency::Predicted`]).
//!   A guess never delays a read that is needed now.
//! - **Promotion and cancellation.** When a queued background read is asked for, it moves to
//!   the demand lane ([`ReadQueue::promote`]); when a prediction turns out wrong before any of
//!   its pieces started, it leaves the queue and costs the disk nothing; when some started,
//!   the pieces not yet handed out are dropped and the record never completes
//!   ([`ReadQueue::abandon`]).
//! - **Records split across readers.** A record is read in pieces of
//!   [`store::HASHED_READ_CHUNK`](crate::experts::store::HASHED_READ_CHUNK), and every reader
//!   takes the next piece of the most urgent record. One record is then read with all of the
//!   disk's queue depth, so the first expert a layer needs arrives after about one record's
//!   read time instead of all of them arriving together at the end, and the computation starts
//!   on it while the rest are read. Pieces are hashed in order as they complete, overlapping
//!   the check with the reads of later pieces.
//!
//! The queue decides only the order of reads, never their contents.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::experts::buffers::PooledBytes;

/// How long the disk has had at least one read in flight (the union of the reader threads'
/// read intervals, not their sum), and the sum of those intervals: over the union, the mean
/// number of reads in flight.
#[derive(Default)]
pub struct BusyClock {
    state: Mutex<Busy>,
}

#[derive(Default)]
struct Busy {
    in_flight: usize,
    since: Option<Instant>,
    total: Duration,
    stretches: u64,
    /// Sum of every read's duration.
    reading: Duration,
}

impl BusyClock {
    fn lock(&self) -> MutexGuard<'_, Busy> {
        // Updates are a few field writes; a panic cannot leave them half-done.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `read` counted as a read in flight; returns its result and how long it took.
    pub fn time<T>(&self, read: impl FnOnce() -> T) -> (T, Duration) {
        let start = Instant::now();
        {
            let mut b = self.lock();
            if b.in_flight == 0 {
                b.since = Some(Instant::now());
                b.stretches += 1;
            }
            b.in_flight += 1;
        }
        // Decrements even if `read` panics, so the clock never stays running.
        struct Done<'a>(&'a BusyClock, Instant);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                let mut b = self.0.lock();
                b.reading += self.1.elapsed();
                b.in_flight -= 1;
                if b.in_flight == 0
                    && let Some(t) = b.since.take()
                {
                    b.total += t.elapsed();
                }
            }
        }
        let _done = Done(self, start);
        let result = read();
        (result, start.elapsed())
    }

    /// Busy time so far, including the current stretch if a read is in flight.
    pub fn total(&self) -> Duration {
        let b = self.lock();
        b.total + b.since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Stretches of busy time so far: each began with the disk idle.
    pub fn stretches(&self) -> u64 {
        self.lock().stretches
    }

    /// Sum of the finished reads' durations.
    pub fn reading(&self) -> Duration {
        self.lock().reading
    }
}

/// How urgently a record is wanted. The readers serve the lanes in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Urgency {
    /// A computation is waiting for it.
    Demand,
    /// Known to be needed soon (the next group of a prefill block, the learned hot set).
    Ahead,
    /// A prediction of the next layer's routing, which may be wrong.
    Predicted,
}

impl Urgency {
    const ALL: [Urgency; 3] = [Urgency::Demand, Urgency::Ahead, Urgency::Predicted];

    fn lane(self) -> usize {
        match self {
            Urgency::Demand => 0,
            Urgency::Ahead => 1,
            Urgency::Predicted => 2,
        }
    }
}

/// Where one record lies and how it is checked.
#[derive(Clone, Copy, Debug)]
pub struct RecordPlan {
    /// `(layer, expert)`.
    pub key: (usize, usize),
    /// Byte offset in the expert file (4 KiB-aligned).
    pub offset: u64,
    /// Bytes to read (the record, a multiple of 4 KiB).
    pub len: usize,
    /// Bytes covered by the hash (the payload, at most `len`); `None`: not checked.
    pub hashed: Option<usize>,
}

/// The result of a whole record: its bytes and, when checked, the hash of its payload.
pub type RecordBytes = std::io::Result<(PooledBytes, Option<blake3::Hash>)>;

/// One record being read, possibly by several readers at once, each into its own piece of
/// the buffer.
pub struct RecordRead {
    plan: RecordPlan,
    piece_len: usize,
    pieces: usize,
    /// The destination. Pieces are disjoint byte ranges of it; see the `Sync` impl.
    buf: UnsafeCell<Option<PooledBytes>>,
    base: *mut u8,
    progress: Mutex<Progress>,
}

struct Progress {
    done: Vec<bool>,
    finished: usize,
    /// Pieces hashed so far (in order).
    hashed: usize,
    /// `None` while one reader hashes (outside the lock) or when reads are not checked.
    hasher: Option<blake3::Hasher>,
    error: Option<std::io::Error>,
    /// When the first piece was handed to a reader.
    started: Option<Instant>,
    /// Set once the record's bytes have been handed out.
    taken: bool,
    /// Set when the record was abandoned: its remaining pieces are never read and it never
    /// completes.
    abandoned: bool,
}

// SAFETY: `buf` and `base` are written only through `piece_mut`, whose ranges are disjoint
// for distinct piece indices, and each index is handed to exactly one reader by the queue
// (`Job::next_piece` only grows). They are read (hashed) only for pieces marked done under
// the `progress` lock, which orders the write before the read, and the buffer is taken out
// exactly once (`Progress::taken`), after every piece is done. Nothing else touches them.
unsafe impl Sync for RecordRead {}
// SAFETY: the raw pointer points into the owned `PooledBytes`, which is `Send`.
unsafe impl Send for RecordRead {}

impl RecordRead {
    /// A read of `plan` into `buf` (at least `plan.len` bytes) in pieces of `piece_len`.
    pub fn new(plan: RecordPlan, mut buf: PooledBytes, piece_len: usize) -> Arc<Self> {
        let piece_len = piece_len.max(1);
        let pieces = plan.len.div_ceil(piece_len).max(1);
        let base = buf.as_mut().as_mut_ptr();
        assert!(buf.as_mut().len() >= plan.len, "the buffer holds the record");
        Arc::new(RecordRead {
            plan,
            piece_len,
            pieces,
            buf: UnsafeCell::new(Some(buf)),
            base,
            progress: Mutex::new(Progress {
                done: vec![false; pieces],
                finished: 0,
                hashed: 0,
                hasher: plan.hashed.map(|_| blake3::Hasher::new()),
                error: None,
                started: None,
                taken: false,
                abandoned: false,
            }),
        })
    }

    /// The record's `(layer, expert)`.
    pub fn key(&self) -> (usize, usize) {
        self.plan.key
    }

    /// Where the record lies and what its check covers.
    pub fn plan(&self) -> &RecordPlan {
        &self.plan
    }

    /// When its first piece was handed to a reader (`None`: still waiting in the queue).
    pub fn started(&self) -> Option<Instant> {
        self.lock().started
    }

    fn lock(&self) -> MutexGuard<'_, Progress> {
        // Every update is a few field writes; a panic cannot leave them half-done.
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn range(&self, piece: usize) -> (usize, usize) {
        let start = piece * self.piece_len;
        (start, (start + self.piece_len).min(self.plan.len))
    }

    /// Reads `piece` with `read` (file offset, destination) and records its outcome. Returns
    /// the whole record's bytes to the one caller that completes it.
    ///
    /// # Safety
    /// The caller is the one reader the queue handed `piece` to, and calls this once for it.
    unsafe fn read_piece(
        &self,
        piece: usize,
        read: impl FnOnce(u64, &mut [u8]) -> std::io::Result<()>,
    ) -> Option<RecordBytes> {
        let (start, end) = self.range(piece);
        let offset = self.plan.offset + start as u64;
        // SAFETY: `start..end` lies inside the buffer (`new` checked its length) and no other
        // reference to this range exists until the piece is marked done below (the caller's
        // contract).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.base.add(start), end - start) };
        let skip = {
            let p = self.lock();
            p.error.is_some() || p.abandoned
        };
        // A panic in the read must still mark the piece done, or the record would never
        // complete and its caller would wait for ever: it becomes the piece's error.
        let result = if skip {
            Ok(())
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(offset, dst)))
                .unwrap_or_else(|_| Err(std::io::Error::other("the reader panicked")))
        };
        let mut p = self.lock();
        p.done[piece] = true;
        p.finished += 1;
        if let Err(e) = result
            && p.error.is_none()
        {
            p.error = Some(e);
        }
        // Hash the completed prefix, in order, outside the lock.
        if let Some(payload) = self.plan.hashed {
            while p.error.is_none() && !p.abandoned && p.hashed < self.pieces && p.done[p.hashed] {
                let Some(mut hasher) = p.hasher.take() else { break };
                let (start, end) = self.range(p.hashed);
                drop(p);
                let end = end.min(payload);
                if start < end {
                    // SAFETY: this piece is done (its writer has finished, ordered by the
                    // lock) and no writer touches it again; the buffer is not yet taken.
                    let bytes = unsafe { std::slice::from_raw_parts(self.base.add(start), end - start) };
                    hasher.update(bytes);
                }
                p = self.lock();
                p.hasher = Some(hasher);
                p.hashed += 1;
            }
        }
        let checked = self.plan.hashed.is_none() || p.error.is_some() || p.hashed == self.pieces;
        let hasher_idle = self.plan.hashed.is_none() || p.hasher.is_some();
        if p.finished < self.pieces || !checked || !hasher_idle || p.taken || p.abandoned {
            return None;
        }
        p.taken = true;
        if let Some(e) = p.error.take() {
            return Some(Err(e));
        }
        let hash = p.hasher.take().map(|h| h.finalize());
        drop(p);
        // SAFETY: every piece is done and this is the one caller that saw `taken` unset.
        let buf = unsafe { (*self.buf.get()).take() }.expect("taken once");
        Some(Ok((buf, hash)))
    }
}

struct Job {
    read: Arc<RecordRead>,
    /// The next piece to hand out.
    next_piece: usize,
}

#[derive(Default)]
struct Lanes {
    lanes: [VecDeque<Job>; 3],
    closed: bool,
    /// Tests hold the readers to see the queue as a burst of requests leaves it.
    #[cfg(test)]
    held: bool,
}

/// The queue of record reads, by urgency, shared by the reader threads.
#[derive(Default)]
pub struct ReadQueue {
    lanes: Mutex<Lanes>,
    wake: Condvar,
}

/// What [`ReadQueue::abandon`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abandoned {
    /// No piece had started: the read left the queue and costs nothing.
    Cancelled,
    /// Some pieces had started: the rest were dropped. `read_bytes` is what the started
    /// pieces read (or are reading).
    Partly {
        /// Bytes of the pieces handed out.
        read_bytes: usize,
    },
    /// Every piece was already handed out (or the read was not queued): the record will
    /// complete as usual.
    NotQueued,
}

/// A piece of a record, handed to one reader.
pub struct Piece {
    read: Arc<RecordRead>,
    index: usize,
}

impl Piece {
    /// The record this piece belongs to.
    pub fn record(&self) -> &Arc<RecordRead> {
        &self.read
    }

    /// Reads the piece with `read(file offset, destination)`; the caller that completes the
    /// record gets its bytes (or the first error of its pieces).
    pub fn read(self, read: impl FnOnce(u64, &mut [u8]) -> std::io::Result<()>) -> Option<RecordBytes> {
        // SAFETY: the queue hands each (record, index) out once, as this `Piece`, which is
        // consumed here.
        unsafe { self.read.read_piece(self.index, read) }
    }
}

impl ReadQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Lanes> {
        // Updates are single deque operations; a panic cannot leave one half-done.
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `read` behind the reads of its urgency.
    pub fn push(&self, urgency: Urgency, read: Arc<RecordRead>) {
        self.lock().lanes[urgency.lane()].push_back(Job { read, next_piece: 0 });
        self.wake.notify_all();
    }

    /// The next piece to read: the front record of the most urgent lane that has one.
    /// Blocks while the queue is empty; `None` once it is closed.
    pub fn next(&self) -> Option<Piece> {
        let mut q = self.lock();
        loop {
            if q.closed {
                return None;
            }
            #[cfg(test)]
            if q.held {
                q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            for lane in &mut q.lanes {
                let Some(job) = lane.front_mut() else { continue };
                let index = job.next_piece;
                job.next_piece += 1;
                let read = Arc::clone(&job.read);
                if job.next_piece >= read.pieces {
                    lane.pop_front();
                }
                if index == 0 {
                    read.lock().started = Some(Instant::now());
                }
                return Some(Piece { read, index });
            }
            q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Moves the queued read of `key` (started or not) to the back of `to`'s lane if it waits
    /// in a less urgent one. Returns whether it moved.
    pub fn promote(&self, key: (usize, usize), to: Urgency) -> bool {
        let mut q = self.lock();
        for from in Urgency::ALL.into_iter().filter(|&u| u > to) {
            let lane = &mut q.lanes[from.lane()];
            if let Some(at) = lane.iter().position(|j| j.read.key() == key) {
                let job = lane.remove(at).expect("position is in range");
                q.lanes[to.lane()].push_back(job);
                return true;
            }
        }
        false
    }

    /// Takes the read of `key` out of the queue, whether or not some of its pieces are being
    /// read. Without a started piece it is cancelled: it costs the disk nothing and its
    /// buffer goes back to the pool. With some, the pieces
    /// not yet handed out are never read and the record never completes: the readers of the
    /// pieces in flight finish them and get `None`, and the buffer goes back to the pool when
    /// the last of them lets the record go. The caller must forget the read (nobody may wait
    /// for it).
    pub fn abandon(&self, key: (usize, usize)) -> Abandoned {
        let mut q = self.lock();
        for lane in &mut q.lanes {
            let Some(at) = lane.iter().position(|j| j.read.key() == key) else { continue };
            let job = lane.remove(at).expect("position is in range");
            if job.next_piece == 0 {
                return Abandoned::Cancelled;
            }
            let read = &job.read;
            let mut p = read.lock();
            for piece in job.next_piece..read.pieces {
                p.done[piece] = true;
                p.finished += 1;
            }
            p.abandoned = true;
            let read_bytes = read.range(job.next_piece - 1).1;
            return Abandoned::Partly { read_bytes };
        }
        Abandoned::NotQueued
    }

    /// Ends the queue: every waiting and later [`next`](Self::next) returns `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_all();
    }

    /// Holds the readers (no piece is handed out) until released, so that a test sees what
    /// a sequence of requests leaves in the queue.
    #[cfg(test)]
    pub(crate) fn hold(&self, held: bool) {
        self.lock().held = held;
        self.wake.notify_all();
    }

    /// Records waiting in each lane (demand, ahead, predicted), for tests and logs.
    pub fn queued(&self) -> [usize; 3] {
        let q = self.lock();
        [q.lanes[0].len(), q.lanes[1].len(), q.lanes[2].len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::buffers::BufferPool;

    fn record(pool: &Arc<BufferPool>, key: (usize, usize), len: usize, hashed: bool) -> Arc<RecordRead> {
        let plan = RecordPlan { key, offset: 4096 * key.1 as u64, len, hashed: hashed.then_some(len - 100) };
        RecordRead::new(plan, pool.take(), 4096)
    }

    /// Fills each piece with bytes derived from its file offset.
    fn fill(offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
        for (i, b) in dst.iter_mut().enumerate() {
            *b = ((offset as usize + i) % 251) as u8;
        }
        Ok(())
    }

    #[test]
    fn demand_goes_before_ahead_before_predicted() {
        let pool = BufferPool::new(4096, 4);
        let q = ReadQueue::new();
        q.push(Urgency::Predicted, record(&pool, (0, 1), 4096, false));
        q.push(Urgency::Ahead, record(&pool, (0, 2), 4096, false));
        q.push(Urgency::Demand, record(&pool, (0, 3), 4096, false));
        let order: Vec<_> = (0..3).map(|_| q.next().unwrap().record().key()).collect();
        assert_eq!(order, [(0, 3), (0, 2), (0, 1)]);
        assert_eq!(q.queued(), [0, 0, 0]);
    }

    #[test]
    fn a_promoted_prediction_overtakes_other_guesses_and_a_cancelled_one_is_never_read() {
        let pool = BufferPool::new(4096, 4);
        let q = ReadQueue::new();
        for e in 0..3 {
            q.push(Urgency::Predicted, record(&pool, (1, e), 4096, false));
        }
        assert!(q.promote((1, 2), Urgency::Demand));
        assert_eq!(q.abandon((1, 0)), Abandoned::Cancelled);
        assert_eq!(q.abandon((1, 0)), Abandoned::NotQueued, "already gone");
        assert_eq!(q.queued(), [1, 0, 1]);
        assert_eq!(q.next().unwrap().record().key(), (1, 2));
        let last = q.next().unwrap();
        assert_eq!(last.record().key(), (1, 1));
        assert_eq!(q.abandon((1, 1)), Abandoned::NotQueued, "a read whose every piece started completes");
        assert!(!q.promote((9, 9), Urgency::Demand));
    }

    #[test]
    fn pieces_of_one_record_go_to_several_readers_and_complete_once_with_the_right_hash() {
        let len = 5 * 4096 + 4096;
        let pool = BufferPool::new(len, 2);
        let q = ReadQueue::new();
        let rec = record(&pool, (2, 3), len, true);
        q.push(Urgency::Demand, Arc::clone(&rec));
        let mut pieces: Vec<Option<Piece>> = (0..6).map(|_| q.next()).collect();
        assert_eq!(q.queued(), [0, 0, 0], "every piece handed out, the record left the queue");
        // Complete them out of order: only the last completion returns the record.
        let mut outcomes = Vec::new();
        for i in [3usize, 0, 5, 1, 4, 2] {
            let piece = pieces[i].take().unwrap();
            assert_eq!(piece.index, i);
            outcomes.push(piece.read(fill));
        }
        assert!(outcomes[..5].iter().all(Option::is_none));
        let (bytes, hash) = outcomes.pop().unwrap().unwrap().unwrap();
        use crate::quant::buffer::ByteRegion;
        let mut want = vec![0u8; len];
        fill(rec.plan.offset, &mut want).unwrap();
        assert_eq!(&bytes.bytes()[..len], &want[..]);
        assert_eq!(hash, Some(blake3::hash(&want[..len - 100])));
    }

    #[test]
    fn a_failed_piece_fails_the_record_once() {
        let len = 3 * 4096;
        let pool = BufferPool::new(len, 2);
        let q = ReadQueue::new();
        q.push(Urgency::Demand, record(&pool, (0, 0), len, true));
        let a = q.next().unwrap();
        let b = q.next().unwrap();
        let c = q.next().unwrap();
        assert!(a.read(fill).is_none());
        assert!(b.read(|_, _| Err(std::io::Error::other("bad sector"))).is_none());
        match c.read(fill) {
            Some(Err(e)) => assert!(e.to_string().contains("bad sector"), "{e}"),
            Some(Ok(_)) => panic!("a record with a failed piece was returned"),
            None => panic!("the last piece did not complete the record"),
        }
    }

    #[test]
    fn an_abandoned_record_reads_no_more_pieces_never_completes_and_frees_its_buffer() {
        let len = 4 * 4096;
        let pool = BufferPool::new(len, 4);
        let q = ReadQueue::new();
        q.push(Urgency::Predicted, record(&pool, (3, 1), len, true));
        q.push(Urgency::Predicted, record(&pool, (3, 2), len, true));
        assert_eq!(q.abandon((3, 2)), Abandoned::Cancelled, "nothing of it had started");
        let first = q.next().unwrap();
        let second = q.next().unwrap();
        assert_eq!(q.abandon((3, 1)), Abandoned::Partly { read_bytes: 2 * 4096 });
        assert_eq!(q.queued(), [0, 0, 0], "its other pieces left the queue");
        assert_eq!(q.abandon((3, 1)), Abandoned::NotQueued);
        let mut read = 0;
        let count = |offset: u64, dst: &mut [u8]| {
            read += 1;
            fill(offset, dst)
        };
        assert!(first.read(count).is_none());
        assert!(second.read(fill).is_none(), "the record never completes");
        assert_eq!(read, 0, "a piece handed out but not yet read is skipped once abandoned");
        assert_eq!(pool.free_buffers(), 2, "both buffers are back in the pool");

        // A record whose every piece was handed out completes as usual.
        q.push(Urgency::Predicted, record(&pool, (3, 3), 4096, false));
        let only = q.next().unwrap();
        assert_eq!(q.abandon((3, 3)), Abandoned::NotQueued);
        assert!(matches!(only.read(fill), Some(Ok(_))));
    }

    #[test]
    fn the_busy_clock_counts_overlapping_reads_once_and_idle_time_not_at_all() {
        let clock = Arc::new(BusyClock::default());
        let nap = Duration::from_millis(40);
        // Two reads of 40 ms side by side: about 40 ms busy, not 80.
        std::thread::scope(|s| {
            for _ in 0..2 {
                let clock = Arc::clone(&clock);
                s.spawn(move || assert!(clock.time(|| std::thread::sleep(nap)).1 >= nap));
            }
        });
        let overlapped = clock.total();
        assert_eq!(clock.stretches(), 1, "one stretch: the second read began while the first was in flight");
        assert!(clock.reading() >= 2 * nap, "each read's own time is summed: {:?}", clock.reading());
        assert!(overlapped >= nap && overlapped < 2 * nap - Duration::from_millis(10), "{overlapped:?}");
        // Idle time is not counted; a later read adds its own time.
        std::thread::sleep(nap);
        assert_eq!(clock.total(), overlapped);
        clock.time(|| std::thread::sleep(nap));
        assert!(clock.total() >= overlapped + nap);
        assert_eq!(clock.stretches(), 2);
    }

    #[test]
    fn close_wakes_and_ends_the_readers() {
        let q = Arc::new(ReadQueue::new());
        let waiter = {
            let q = Arc::clone(&q);
            std::thread::spawn(move || q.next().is_none())
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.close();
        assert!(waiter.join().unwrap());
    }
}
