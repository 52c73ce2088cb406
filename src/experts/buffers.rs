//! Recycled expert buffers. Every expert record has the same size, so a buffer freed by an
//! evicted expert is the right slot for the next read. Reusing it skips what a fresh
//! allocation of a dozen MiB costs on every miss: mapping and zeroing new pages, faulting
//! them in as the read fills them, and unmapping them again at eviction. On a small
//! machine that work competes with the expert kernels for the same cores.
//!
//! The pool can also prepare its memory ahead of need ([`BufferPool::prepare`]): a
//! background thread maps and touches buffers up to the cache's capacity, so that the
//! first prompt of a session that fills the cache does not pay the first touch of every
//! page (about 1 GB/s on a VM, where direct compaction for huge pages can stall longer)
//! inside its reads.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::quant::buffer::{AlignedBytes, ByteRegion};

/// A pool of 4 KiB-aligned buffers of one length.
pub struct BufferPool {
    len: usize,
    /// Free buffers kept for reuse at most (more are released to the system).
    keep: usize,
    free: Mutex<Vec<AlignedBytes>>,
    /// Buffers that exist: on loan plus free.
    live: AtomicUsize,
    /// Set by the first [`BufferPool::prepare`]: the pool is prepared once.
    started: AtomicBool,
    /// Set to stop a [`BufferPool::prepare`] thread early ([`BufferPool::stop_preparing`]).
    stop: AtomicBool,
    /// The state of the memory preparation, and a signal when it ends.
    preparing: Mutex<Preparation>,
    prepared: Condvar,
}

/// What [`BufferPool::prepare`] did (while it runs, only that it runs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Preparation {
    /// A preparation thread is running.
    pub running: bool,
    /// Buffers it made and touched.
    pub buffers: usize,
    /// Time it took.
    pub elapsed: Duration,
}

impl BufferPool {
    /// A pool of `len`-byte buffers that keeps at most `keep` free ones.
    pub fn new(len: usize, keep: usize) -> Arc<Self> {
        Arc::new(BufferPool {
            len,
            keep,
            free: Mutex::new(Vec::new()),
            live: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            preparing: Mutex::new(Preparation::default()),
            prepared: Condvar::new(),
        })
    }

    /// A buffer of the pool's length: a recycled one (its old contents still there) when one
    /// is free, else a new zeroed one. It returns to the pool when dropped.
    pub fn take(self: &Arc<Self>) -> PooledBytes {
        let recycled = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let bytes = recycled.unwrap_or_else(|| {
            self.live.fetch_add(1, Ordering::Relaxed);
            AlignedBytes::zeroed(self.len)
        });
        PooledBytes { bytes: Some(bytes), pool: Arc::clone(self) }
    }

    /// Free buffers waiting for reuse.
    pub fn free_buffers(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Buffers that exist, on loan or free.
    pub fn live_buffers(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Starts a background thread that makes buffers, touching every page, until `target`
    /// buffers exist (on loan or free; never more than the pool keeps free), then ends.
    /// Reads that come meanwhile take the buffers it has made, or make their own; it stops
    /// early when the pool is dropped. Does nothing if a preparation already ran or runs.
    /// Fails only when the thread cannot be started.
    pub fn prepare(self: &Arc<Self>, target: usize) -> std::io::Result<()> {
        if self.started.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.lock_preparation().running = true;
        let pool: Weak<BufferPool> = Arc::downgrade(self);
        let target = target.min(self.keep);
        let spawned = std::thread::Builder::new().name("picchio-prepare".into()).spawn(move || {
            let t0 = Instant::now();
            let mut made = 0;
            loop {
                let Some(pool) = pool.upgrade() else { return };
                if pool.stop.load(Ordering::Relaxed) || pool.live_buffers() >= target {
                    pool.finish_preparation(made, t0.elapsed());
                    return;
                }
                pool.live.fetch_add(1, Ordering::Relaxed);
                let mut bytes = AlignedBytes::zeroed(pool.len);
                touch_pages(bytes.as_mut_slice());
                made += 1;
                // Dropped (and counted out again) if the free list is full meanwhile.
                drop(PooledBytes { bytes: Some(bytes), pool: Arc::clone(&pool) });
            }
        });
        if let Err(e) = spawned {
            self.lock_preparation().running = false;
            return Err(e);
        }
        Ok(())
    }

    /// Waits until a [`BufferPool::prepare`] thread has ended (at once if none runs) and
    /// returns what it did.
    pub fn wait_prepared(&self) -> Preparation {
        let mut p = self.lock_preparation();
        while p.running {
            p = self.prepared.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        *p
    }

    /// Ends a [`BufferPool::prepare`] thread after the buffer it is making (the cache that
    /// owns the pool is closing).
    pub fn stop_preparing(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    fn finish_preparation(&self, buffers: usize, elapsed: Duration) {
        let mut p = self.lock_preparation();
        *p = Preparation { running: false, buffers, elapsed };
        self.prepared.notify_all();
    }

    fn lock_preparation(&self) -> std::sync::MutexGuard<'_, Preparation> {
        self.preparing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Writes one byte of every 4 KiB page of a fresh zeroed buffer (a zero: the contents stay
/// what they were), so that the kernel backs every page now.
fn touch_pages(bytes: &mut [u8]) {
    for page in bytes.chunks_mut(4096) {
        // SAFETY: a valid, exclusively borrowed byte; the volatile write keeps the
        // compiler from dropping a store of the value already there.
        unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
    }
}

/// A buffer on loan from a [`BufferPool`].
pub struct PooledBytes {
    /// Always `Some` until dropped.
    bytes: Option<AlignedBytes>,
    pool: Arc<BufferPool>,
}

impl PooledBytes {
    fn inner(&self) -> &AlignedBytes {
        self.bytes.as_ref().expect("present until drop")
    }
}

impl AsMut<[u8]> for PooledBytes {
    fn as_mut(&mut self) -> &mut [u8] {
        self.bytes.as_mut().expect("present until drop").as_mut_slice()
    }
}

impl ByteRegion for PooledBytes {
    fn bytes(&self) -> &[u8] {
        self.inner().bytes()
    }
}

impl Drop for PooledBytes {
    fn drop(&mut self) {
        let Some(bytes) = self.bytes.take() else { return };
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.pool.keep {
            free.push(bytes);
            return;
        }
        drop(free);
        self.pool.live.fetch_sub(1, Ordering::Relaxed);
        // Released outside the lock: unmapping a large buffer is not free.
        drop(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_buffers_are_reused_up_to_the_limit() {
        let pool = BufferPool::new(8192, 1);
        let mut a = pool.take();
        a.as_mut()[0] = 7;
        let a_ptr = a.bytes().as_ptr();
        let b = pool.take();
        assert_eq!(b.bytes().len(), 8192);
        assert_eq!(a_ptr as usize % 4096, 0);
        assert_eq!(pool.live_buffers(), 2);
        drop(a);
        drop(b);
        // Only one is kept; it is the first one dropped, contents and all.
        assert_eq!(pool.free_buffers(), 1);
        assert_eq!(pool.live_buffers(), 1);
        let c = pool.take();
        assert_eq!(c.bytes().as_ptr(), a_ptr);
        assert_eq!(c.bytes()[0], 7);
        assert_eq!(pool.free_buffers(), 0);
    }

    #[test]
    fn preparation_makes_buffers_up_to_the_target_counting_those_on_loan() {
        let pool = BufferPool::new(3 * 4096 + 100, 8);
        let on_loan = pool.take();
        pool.prepare(5).unwrap();
        let p = pool.wait_prepared();
        assert!(!p.running);
        assert_eq!(p.buffers, 4, "one of the five exists already, on loan");
        assert_eq!(pool.live_buffers(), 5);
        assert_eq!(pool.free_buffers(), 4);
        // Prepared buffers are zeroed and of the pool's length.
        let b = pool.take();
        assert_eq!(b.bytes().len(), 3 * 4096 + 100);
        assert!(b.bytes().iter().all(|&x| x == 0));
        // A second preparation does nothing.
        pool.prepare(8).unwrap();
        assert_eq!(pool.wait_prepared().buffers, 4);
        drop((on_loan, b));
        assert_eq!(pool.live_buffers(), 5);
    }

    #[test]
    fn preparation_never_exceeds_what_the_pool_keeps() {
        let pool = BufferPool::new(4096, 3);
        pool.prepare(100).unwrap();
        assert_eq!(pool.wait_prepared().buffers, 3);
        assert_eq!(pool.live_buffers(), 3);
        // Waiting with no preparation returns at once.
        assert!(!BufferPool::new(4096, 1).wait_prepared().running);
    }
}
