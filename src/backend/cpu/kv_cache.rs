//! The CPU key/value cache: for each layer, keys and values of every cached position,
//! `[kv_heads, capacity, head_dim]`, written at their absolute positions. Each key/value head's
//! positions are contiguous, so that attention, which goes through one head's positions in
//! order, streams them (with the positions' heads side by side, each step jumped over the
//! other heads' values and a decoded token's attention over a long cache waited on memory).
//!
//! Positions are never shifted: rewinding a session to `keep` positions just means later
//! writes overwrite from `keep` on, so a cache can serve prefix reuse without copying.
//!
//! The cache is allocated fallibly: its size comes from `--ctx` and the config, so a
//! request the machine cannot hold is an error that says how much was asked for and how
//! much memory is available, never an abort.

use crate::error::{Error, Result};
use crate::system::{available_memory, gib};

/// Keys and values for every layer.
pub struct KvCache {
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    /// A cache for `layers` layers of `capacity` positions of `kv_heads` heads of `head_dim`
    /// values. Memory is
    /// zero-filled lazily by the OS, so an unused tail costs no resident memory. Fails,
    /// naming `--ctx`, the bytes needed and the memory available, when the size overflows
    /// or the allocation is refused.
    pub fn new(layers: usize, capacity: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let kv_dim =
            kv_heads.checked_mul(head_dim).ok_or_else(|| kv_cache_too_large(layers, capacity, usize::MAX))?;
        let too_big = || kv_cache_too_large(layers, capacity, kv_dim);
        let per_layer = capacity.checked_mul(kv_dim).ok_or_else(too_big)?;
        Self::bytes_for(layers, capacity, kv_dim).ok_or_else(too_big)?;
        let mut keys = Vec::new();
        let mut values = Vec::new();
        keys.try_reserve_exact(layers).map_err(|_| too_big())?;
        values.try_reserve_exact(layers).map_err(|_| too_big())?;
        for _ in 0..layers {
            keys.push(zeroed_f32(per_layer).ok_or_else(too_big)?);
            values.push(zeroed_f32(per_layer).ok_or_else(too_big)?);
        }
        Ok(KvCache { capacity, kv_heads, head_dim, keys, values })
    }

    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stores the key and value of `pos` in `layer`. The backend checks `pos < capacity`
    /// before it runs a position (`Error::ContextFull` otherwise).
    pub fn write(&mut self, layer: usize, pos: usize, key: &[f32], value: &[f32]) {
        let d = self.head_dim;
        for h in 0..self.kv_heads {
            let at = (h * self.capacity + pos) * d;
            self.keys[layer][at..at + d].copy_from_slice(&key[h * d..(h + 1) * d]);
            self.values[layer][at..at + d].copy_from_slice(&value[h * d..(h + 1) * d]);
        }
    }

    /// Keys of `layer`, `[kv_heads, capacity, head_dim]`.
    pub fn keys(&self, layer: usize) -> &[f32] {
        &self.keys[layer]
    }

    /// Values of `layer`, `[kv_heads, capacity, head_dim]`.
    pub fn values(&self, layer: usize) -> &[f32] {
        &self.values[layer]
    }

    /// Bytes the keys and values of `layers` layers take at `capacity` positions of `kv_dim`
    /// floats each; `None` when that does not fit in 64 bits.
    pub fn bytes_for(layers: usize, capacity: usize, kv_dim: usize) -> Option<u64> {
        [layers, capacity, kv_dim, std::mem::size_of::<f32>()]
            .iter()
            .try_fold(2u64, |acc, &f| acc.checked_mul(u64::try_from(f).ok()?))
    }
}

/// The error for a cache that cannot be allocated: names `--ctx`, the size and what the
/// machine has available.
fn kv_cache_too_large(layers: usize, capacity: usize, kv_dim: usize) -> Error {
    let needed = match KvCache::bytes_for(layers, capacity, kv_dim) {
        Some(b) => gib(b),
        None => "more than 2^64 bytes".to_string(),
    };
    let available = available_memory().map_or_else(|| "an unknown amount of memory".to_string(), gib);
    Error::invalid(format!(
        "KV cache for --ctx {capacity} needs {needed} ({layers} layers x {kv_dim} floats x 2 per position); \
         this machine has {available} available"
    ))
}

/// `n` zeros, allocated fallibly and zero-filled lazily by the OS (as `vec![0.0; n]` is),
/// so that untouched pages cost no resident memory; `None` when the allocation fails.
pub fn zeroed_f32(n: usize) -> Option<Vec<f32>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(n).ok()?;
    // SAFETY: `layout` has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<f32>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `n` f32
    // values (the layout `Vec<f32>` uses for capacity `n`), and all `n` values are
    // initialized (all-zero bits are 0.0).
    Some(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_overflow_are_errors_naming_ctx() {
        assert_eq!(KvCache::bytes_for(2, 3, 4), Some(2 * 2 * 3 * 4 * 4));
        assert_eq!(KvCache::bytes_for(24, 1 << 62, 512), None);
        let e = KvCache::new(24, 1 << 62, 8, 64).err().expect("an overflowing size is refused").to_string();
        assert!(e.contains("--ctx 4611686018427387904") && e.contains("available"), "{e}");
    }

    #[test]
    fn a_refused_allocation_is_an_error() {
        // 2^60 bytes per layer: no machine grants it.
        let e =
            KvCache::new(1, 1 << 56, 1, 4).err().expect("an impossible allocation is refused").to_string();
        assert!(e.contains("--ctx 72057594037927936 needs"), "{e}");
    }

    #[test]
    fn each_head_s_positions_are_contiguous() {
        // 2 heads of 2 values, 3 positions: head 0's positions, then head 1's.
        let mut kv = KvCache::new(1, 3, 2, 2).unwrap();
        kv.write(0, 1, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(kv.keys(0), &[0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]);
        assert_eq!(kv.values(0), &[0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0, 7.0, 8.0, 0.0, 0.0]);
    }

    #[test]
    fn a_cache_starts_zeroed() {
        let mut kv = KvCache::new(2, 3, 1, 4).unwrap();
        assert!(kv.keys(1).iter().chain(kv.values(0)).all(|&v| v == 0.0));
        kv.write(1, 2, &[1.0; 4], &[2.0; 4]);
        assert_eq!(&kv.keys(1)[8..], &[1.0; 4]);
        assert_eq!(&kv.values(1)[8..], &[2.0; 4]);
        assert_eq!(zeroed_f32(0), Some(Vec::new()));
    }
}
