//! The CPU key/value cache: for each layer, keys and values of every cached position,
//! `[capacity, kv_heads * head_dim]`, written at their absolute positions.
//!
//! Positions are never shifted: rewinding a session to `keep` positions just means later
//! writes overwrite from `keep` on, so a cache can serve prefix reuse without copying.

/// Keys and values for every layer.
pub struct KvCache {
    capacity: usize,
    kv_dim: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    /// A cache for `layers` layers of `capacity` positions of width `kv_dim`. Memory is
    /// zero-filled lazily by the OS, so an unused tail costs no resident memory.
    pub fn new(layers: usize, capacity: usize, kv_dim: usize) -> Self {
        KvCache {
            capacity,
            kv_dim,
            keys: (0..layers).map(|_| vec![0.0; capacity * kv_dim]).collect(),
            values: (0..layers).map(|_| vec![0.0; capacity * kv_dim]).collect(),
        }
    }

    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stores the key and value of `pos` in `layer`.
    pub fn write(&mut self, layer: usize, pos: usize, key: &[f32], value: &[f32]) {
        let d = self.kv_dim;
        self.keys[layer][pos * d..(pos + 1) * d].copy_from_slice(key);
        self.values[layer][pos * d..(pos + 1) * d].copy_from_slice(value);
    }

    /// Keys of `layer`, `[capacity, kv_dim]`.
    pub fn keys(&self, layer: usize) -> &[f32] {
        &self.keys[layer]
    }

    /// Values of `layer`, `[capacity, kv_dim]`.
    pub fn values(&self, layer: usize) -> &[f32] {
        &self.values[layer]
    }

    /// Bytes the keys and values of `layers` layers take at `capacity` positions of `kv_dim`
    /// floats each.
    pub fn bytes_for(layers: usize, capacity: usize, kv_dim: usize) -> u64 {
        (2 * layers * capacity * kv_dim * std::mem::size_of::<f32>()) as u64
    }
}
