//! Recycled expert buffers. Every expert record has the same size, so a buffer freed by an
//! evicted expert is the right slot for the next read. Reusing it skips what a fresh
//! allocation of a dozen MiB costs on every miss: mapping and zeroing new pages, faulting
//! them in as the read fills them, and unmapping them again at eviction. On a small
//! machine that work competes with the expert kernels for the same cores.

use std::sync::{Arc, Mutex};

use crate::quant::buffer::{AlignedBytes, ByteRegion};

/// A pool of 4 KiB-aligned buffers of one length.
pub struct BufferPool {
    len: usize,
    /// Free buffers kept for reuse at most (more are released to the system).
    keep: usize,
    free: Mutex<Vec<AlignedBytes>>,
}

impl BufferPool {
    /// A pool of `len`-byte buffers that keeps at most `keep` free ones.
    pub fn new(len: usize, keep: usize) -> Arc<Self> {
        Arc::new(BufferPool { len, keep, free: Mutex::new(Vec::new()) })
    }

    /// A buffer of the pool's length: a recycled one (its old contents still there) when one
    /// is free, else a new zeroed one. It returns to the pool when dropped.
    pub fn take(self: &Arc<Self>) -> PooledBytes {
        let recycled = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let bytes = recycled.unwrap_or_else(|| AlignedBytes::zeroed(self.len));
        PooledBytes { bytes: Some(bytes), pool: Arc::clone(self) }
    }

    /// Free buffers waiting for reuse.
    pub fn free_buffers(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
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
        drop(a);
        drop(b);
        // Only one is kept; it is the first one dropped, contents and all.
        assert_eq!(pool.free_buffers(), 1);
        let c = pool.take();
        assert_eq!(c.bytes().as_ptr(), a_ptr);
        assert_eq!(c.bytes()[0], 7);
        assert_eq!(pool.free_buffers(), 0);
    }
}
