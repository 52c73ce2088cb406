//! Which cached expert makes room for another: the eviction policy of the RAM expert cache.
//! It decides only what stays in memory, never what is computed.
//!
//! - [`CachePolicy::Lru`]: the least recently used expert goes.
//! - [`CachePolicy::Frequency`] (the default): experts arrive in a small *window* (recency)
//!   in front of the *main* part, which is ordered by how often each expert was asked for
//!   lately (use counts halved every so many requests, so popularity can change). When the
//!   window is full, its oldest expert competes with the main part's least used one: it
//!   takes that one's place only if it has been asked for more often; otherwise it goes.
//!   This is W-TinyLFU (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache
//!   Admission Policy", 2017), with exact counts instead of a sketch since the experts are few.
//!
//! Why it matters here: a decode step of several streams, or a prefill, touches more experts
//! than the cache holds, each needed again only after every other layer's. Under LRU that
//! cyclic sweep evicts each expert just before its next use (measured: the hit rate fell from
//! 0.48 for one stream to 0.27 for four). With admission by frequency the sweep passes through
//! the window and the main part keeps a stable, popular set.

use std::fmt;

/// How the RAM expert cache chooses what to evict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CachePolicy {
    /// A recency window in front of a frequency-ordered main part (W-TinyLFU): scan-resistant.
    #[default]
    Frequency,
    /// Least recently used.
    Lru,
}

impl fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CachePolicy::Frequency => "frequency",
            CachePolicy::Lru => "lru",
        })
    }
}

/// Recent use counts of every expert, halved every `sample` requests so that what was
/// popular long ago fades (TinyLFU's reset).
#[derive(Debug, Default)]
pub(crate) struct Popularity {
    counts: Vec<u32>,
    since_reset: u64,
    sample: u64,
}

impl Popularity {
    /// Counts for `slots` experts, halved every `sample` (at least 1) requests.
    pub(crate) fn new(slots: usize, sample: u64) -> Self {
        Popularity { counts: vec![0; slots], since_reset: 0, sample: sample.max(1) }
    }

    /// One request for expert `index`.
    pub(crate) fn record(&mut self, index: usize) {
        if let Some(c) = self.counts.get_mut(index) {
            *c = c.saturating_add(1);
        }
        self.since_reset += 1;
        if self.since_reset >= self.sample {
            self.since_reset = 0;
            for c in &mut self.counts {
                *c /= 2;
            }
        }
    }

    /// The recent use count of expert `index` (0 for an index out of range).
    pub(crate) fn of(&self, index: usize) -> u32 {
        self.counts.get(index).copied().unwrap_or(0)
    }
}

/// An expert that may be evicted: loaded, unpinned and not protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Candidate<K> {
    pub key: K,
    /// The cache's clock at its last use (0: a prediction nobody asked for).
    pub last_use: u64,
    /// Still in the window (not yet admitted to the main part).
    pub in_window: bool,
    /// Its recent use count.
    pub popularity: u32,
}

/// What to do towards making room for one expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Eviction<K> {
    /// Drop this one.
    Drop(K),
    /// Move this one from the full window to the main part, which has room: nothing goes
    /// yet (ask again).
    Admit(K),
    /// Move `admit` from the window to the full main part in place of `drop`, which goes.
    Replace { admit: K, drop: K },
}

/// How full the two parts of the cache are, in experts (pinned and loading ones included;
/// the protected hot set counts in the main part).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Occupancy {
    pub window: usize,
    pub window_cap: usize,
    pub main: usize,
    pub main_cap: usize,
}

impl CachePolicy {
    /// Chooses the next move towards making room, among `candidates`, for a cache filled as
    /// `occupancy` says. `None` when nothing can go.
    pub(crate) fn evict<K: Copy + Ord>(
        self,
        candidates: impl Iterator<Item = Candidate<K>>,
        occupancy: Occupancy,
    ) -> Option<Eviction<K>> {
        match self {
            CachePolicy::Lru => candidates.min_by_key(|c| (c.last_use, c.key)).map(|c| Eviction::Drop(c.key)),
            CachePolicy::Frequency => {
                let mut oldest_in_window: Option<Candidate<K>> = None;
                let mut least_used_in_main: Option<Candidate<K>> = None;
                for c in candidates {
                    let best = if c.in_window { &mut oldest_in_window } else { &mut least_used_in_main };
                    let better = match best {
                        None => true,
                        Some(b) if c.in_window => (c.last_use, c.key) < (b.last_use, b.key),
                        Some(b) => (c.popularity, c.last_use, c.key) < (b.popularity, b.last_use, b.key),
                    };
                    if better {
                        *best = Some(c);
                    }
                }
                let Occupancy { window, window_cap, main, main_cap } = occupancy;
                match (oldest_in_window, least_used_in_main) {
                    // The window is over its size: its oldest leaves it, into the main part
                    // if that has room, else in place of the main part's least used expert
                    // if it was asked for more often, else out of the cache.
                    (Some(w), _) if window > window_cap && main < main_cap => Some(Eviction::Admit(w.key)),
                    (Some(w), Some(m)) if window > window_cap => Some(if w.popularity > m.popularity {
                        Eviction::Replace { admit: w.key, drop: m.key }
                    } else {
                        Eviction::Drop(w.key)
                    }),
                    // The window within its size: the main part gives up its least used.
                    (_, Some(m)) => Some(Eviction::Drop(m.key)),
                    (Some(w), None) => Some(Eviction::Drop(w.key)),
                    (None, None) => None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(key: u32, last_use: u64, in_window: bool, popularity: u32) -> Candidate<u32> {
        Candidate { key, last_use, in_window, popularity }
    }

    fn occ(window: usize, main: usize) -> Occupancy {
        Occupancy { window, window_cap: 2, main, main_cap: 8 }
    }

    #[test]
    fn lru_drops_the_least_recently_used() {
        let c = [cand(1, 5, true, 9), cand(2, 3, false, 0), cand(3, 4, true, 1)];
        assert_eq!(CachePolicy::Lru.evict(c.into_iter(), occ(2, 9)), Some(Eviction::Drop(2)));
        assert_eq!(CachePolicy::Lru.evict(std::iter::empty::<Candidate<u32>>(), occ(0, 11)), None);
    }

    #[test]
    fn a_full_window_moves_its_oldest_into_a_main_part_with_room() {
        let c = [cand(1, 1, true, 0), cand(4, 9, true, 7), cand(2, 2, false, 2)];
        assert_eq!(CachePolicy::Frequency.evict(c.into_iter(), occ(3, 7)), Some(Eviction::Admit(1)));
    }

    #[test]
    fn a_full_window_displaces_only_a_less_used_main_expert() {
        let p = CachePolicy::Frequency;
        // Both parts full; the window's oldest (key 1) used 3 times, main's least used twice.
        let c = [cand(1, 1, true, 3), cand(4, 9, true, 7), cand(2, 2, false, 2), cand(3, 0, false, 5)];
        assert_eq!(p.evict(c.into_iter(), occ(3, 8)), Some(Eviction::Replace { admit: 1, drop: 2 }));
        // Used as often as main's least used: it goes, the main part stays as it is.
        let c = [cand(1, 1, true, 2), cand(2, 2, false, 2)];
        assert_eq!(p.evict(c.into_iter(), occ(3, 8)), Some(Eviction::Drop(1)));
    }

    #[test]
    fn a_window_within_its_size_takes_room_from_the_least_used_main_expert() {
        let p = CachePolicy::Frequency;
        let c = [cand(1, 1, true, 0), cand(2, 8, false, 4), cand(3, 9, false, 1)];
        assert_eq!(p.evict(c.into_iter(), occ(2, 9)), Some(Eviction::Drop(3)));
        // Only window experts evictable (the rest pinned): the oldest goes.
        let c = [cand(5, 7, true, 9), cand(6, 2, true, 9)];
        assert_eq!(p.evict(c.into_iter(), occ(2, 9)), Some(Eviction::Drop(6)));
    }

    #[test]
    fn popularity_fades_by_halving() {
        let mut p = Popularity::new(3, 4);
        for _ in 0..3 {
            p.record(0);
        }
        assert_eq!(p.of(0), 3);
        p.record(1);
        // Fourth request: every count halved.
        assert_eq!((p.of(0), p.of(1)), (1, 0));
        p.record(7);
        assert_eq!(p.of(7), 0);
    }
}
