//! The RAM expert cache: a least-recently-used cache bounded in bytes, in front of the
//! disk store. It decides only which experts are in memory, never what they compute.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::error::Result;
use crate::experts::store::ExpertStore;
use crate::experts::{ExpertSource, ExpertStats};
use crate::model::weights::ExpertWeights;

struct Entry {
    weights: Arc<ExpertWeights>,
    last_use: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<(usize, usize), Entry>,
    clock: u64,
    stats: ExpertStats,
}

/// Experts read from disk on demand and kept in a byte-bounded LRU cache.
pub struct CachedExperts {
    store: ExpertStore,
    capacity_bytes: u64,
    expert_bytes: u64,
    state: Mutex<State>,
}

impl CachedExperts {
    /// A cache of at most `capacity_bytes` over `store`. It never holds more experts than
    /// the store has; experts in use by the current call may exceed the bound briefly.
    pub fn new(store: ExpertStore, capacity_bytes: u64) -> Self {
        let expert_bytes = store.expert_bytes().max(1);
        let capacity_bytes = capacity_bytes.min(expert_bytes * store.len() as u64);
        CachedExperts { store, capacity_bytes, expert_bytes, state: Mutex::new(State::default()) }
    }

    /// Experts the cache can hold.
    pub fn capacity_experts(&self) -> u64 {
        self.capacity_bytes / self.expert_bytes
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map inconsistent (every update
        // is a single insert/remove), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ExpertSource for CachedExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<Arc<ExpertWeights>> {
        Ok(self.experts(layer, &[expert])?.remove(0))
    }

    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>> {
        let mut found: Vec<Option<Arc<ExpertWeights>>> = vec![None; ids.len()];
        {
            let mut st = self.lock();
            st.clock += 1;
            let now = st.clock;
            let mut hits = 0;
            for (slot, &e) in found.iter_mut().zip(ids) {
                if let Some(entry) = st.entries.get_mut(&(layer, e)) {
                    entry.last_use = now;
                    *slot = Some(Arc::clone(&entry.weights));
                    hits += 1;
                }
            }
            st.stats.hits += hits;
        }
        let missing: Vec<usize> = (0..ids.len()).filter(|&i| found[i].is_none()).collect();
        if missing.is_empty() {
            return Ok(found.into_iter().flatten().collect());
        }
        let t0 = Instant::now();
        let mut loaded = Vec::with_capacity(missing.len());
        for &i in &missing {
            loaded.push((i, Arc::new(self.store.read(layer, ids[i])?)));
        }
        let wait = t0.elapsed();

        let mut st = self.lock();
        st.stats.misses += missing.len() as u64;
        st.stats.bytes_read += missing.len() as u64 * self.store.read_bytes();
        st.stats.disk_wait += wait;
        let now = st.clock;
        for (i, w) in loaded {
            st.entries.insert((layer, ids[i]), Entry { weights: Arc::clone(&w), last_use: now });
            found[i] = Some(w);
        }
        // Evict least recently used entries, never the ones this call needs.
        let needed: HashSet<(usize, usize)> = ids.iter().map(|&e| (layer, e)).collect();
        let limit = (self.capacity_bytes / self.expert_bytes) as usize;
        while st.entries.len() > limit {
            let victim = st
                .entries
                .iter()
                .filter(|(k, _)| !needed.contains(k))
                .min_by_key(|(k, e)| (e.last_use, **k))
                .map(|(k, _)| *k);
            match victim {
                Some(k) => {
                    st.entries.remove(&k);
                    st.stats.evictions += 1;
                }
                None => break,
            }
        }
        Ok(found.into_iter().flatten().collect())
    }

    fn expert_bytes(&self) -> u64 {
        self.expert_bytes
    }

    fn describe(&self) -> String {
        format!(
            "experts from disk through a {} RAM cache ({} of {} experts)",
            crate::system::gib(self.capacity_bytes),
            self.capacity_experts(),
            self.store.len()
        )
    }

    fn stats(&self) -> ExpertStats {
        self.lock().stats
    }
}
