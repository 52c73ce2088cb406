//! How concentrated routing is: per-layer counts of the experts the router chose, and the
//! share of those choices that went to each layer's most popular experts. Uniform routing
//! gives the most popular 10% of experts 10% of the choices (in the limit of many tokens);
//! skewed routing, real or synthetic (`picchio synth --routing-skew`), gives them more.
//! This is what an expert cache, a learned hot set and batching several streams exploit.

use crate::backend::RouteTable;
use crate::model::Observer;

/// Expert choices per layer, counted from the router's decisions (an [`Observer`]: feed
/// tokens through a session with it to count their routing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteCounts {
    /// Experts per layer (0 until the first layer is seen).
    experts: usize,
    /// Experts per token.
    top_k: usize,
    /// `counts[layer][expert]`: how many tokens chose `expert` in `layer`.
    counts: Vec<Vec<u64>>,
}

impl RouteCounts {
    /// Empty counts for layers of `experts` experts.
    pub fn new(experts: usize) -> Self {
        RouteCounts { experts, top_k: 0, counts: Vec::new() }
    }

    /// Counts one routing decision of `layer` (experts outside `0..experts` are ignored:
    /// a router never returns them).
    pub fn add(&mut self, layer: usize, routes: &RouteTable) {
        if self.counts.len() <= layer {
            self.counts.resize(layer + 1, vec![0; self.experts]);
        }
        self.top_k = routes.k;
        let row = &mut self.counts[layer];
        for &e in &routes.experts {
            if let Some(c) = row.get_mut(e as usize) {
                *c += 1;
            }
        }
    }

    /// The counts of `layer` by expert (empty for a layer never seen, e.g. a dense one).
    pub fn layer(&self, layer: usize) -> &[u64] {
        self.counts.get(layer).map_or(&[], Vec::as_slice)
    }

    /// Experts per token of the counted decisions (0 before any).
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The concentration of the counted routing.
    pub fn concentration(&self) -> Concentration {
        let layers: Vec<&Vec<u64>> = self.counts.iter().filter(|c| c.iter().any(|&n| n > 0)).collect();
        let mean = |frac: f64| {
            let n = layers.len().max(1) as f64;
            layers.iter().map(|c| top_share(c, frac)).sum::<f64>() / n
        };
        let requests = layers.first().map_or(0, |c| c.iter().sum::<u64>());
        let tokens = if self.top_k > 0 { requests / self.top_k as u64 } else { 0 };
        let uniform = |frac: f64| uniform_top_share(self.experts, self.top_k, tokens as usize, frac);
        Concentration {
            layers: layers.len(),
            requests_per_layer: requests,
            top10: mean(0.10),
            top25: mean(0.25),
            uniform_top10: uniform(0.10),
            uniform_top25: uniform(0.25),
        }
    }
}

impl Observer for RouteCounts {
    fn routes(&mut self, layer: usize, _start_pos: usize, routes: &RouteTable) {
        self.add(layer, routes);
    }
}

/// How concentrated a run's routing was, averaged over its MoE layers (each layer weighs
/// the same).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Concentration {
    /// MoE layers counted.
    pub layers: usize,
    /// Expert choices per layer (tokens times experts per token).
    pub requests_per_layer: u64,
    /// Share of the choices that went to the most popular 10% of a layer's experts, 0..=1.
    pub top10: f64,
    /// The same for the most popular 25%.
    pub top25: f64,
    /// What uniform routing of as many tokens gives for `top10` on average: above 0.10,
    /// since with few tokens some experts are chosen more often by chance.
    pub uniform_top10: f64,
    /// The same for `top25`.
    pub uniform_top25: f64,
}

/// Share of `counts` held by the largest `frac` of its entries, counting the boundary entry
/// in proportion (so that equal counts give exactly `frac`); 0 without counts.
pub fn top_share(counts: &[u64], frac: f64) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 || counts.is_empty() {
        return 0.0;
    }
    let mut sorted = counts.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let m = frac.clamp(0.0, 1.0) * sorted.len() as f64;
    let whole = m.floor() as usize;
    let mut top: f64 = sorted[..whole].iter().map(|&c| c as f64).sum();
    if let Some(&next) = sorted.get(whole) {
        top += (m - whole as f64) * next as f64;
    }
    top / total as f64
}

/// Mean [`top_share`] of `tokens` tokens that each choose `top_k` distinct experts of
/// `experts` uniformly at random (a fixed-seed simulation of 256 runs): the baseline a
/// measured share is compared with. 0 when there is nothing to route.
pub fn uniform_top_share(experts: usize, top_k: usize, tokens: usize, frac: f64) -> f64 {
    const RUNS: usize = 256;
    if experts == 0 || top_k == 0 || top_k > experts || tokens == 0 {
        return 0.0;
    }
    let mut state = 0x5eed_u64;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut ids: Vec<usize> = (0..experts).collect();
    let mut sum = 0.0;
    for _ in 0..RUNS {
        let mut counts = vec![0u64; experts];
        for _ in 0..tokens {
            // The first `top_k` of a partial Fisher-Yates shuffle: distinct experts.
            for i in 0..top_k {
                let j = i + (next() % (experts - i) as u64) as usize;
                ids.swap(i, j);
                counts[ids[i]] += 1;
            }
        }
        sum += top_share(&counts, frac);
    }
    sum / RUNS as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_share_counts_the_boundary_expert_in_proportion() {
        assert_eq!(top_share(&[5; 32], 0.10), 0.10);
        assert_eq!(top_share(&[5; 32], 0.25), 0.25);
        assert_eq!(top_share(&[0; 8], 0.25), 0.0);
        // 10 experts: the top 10% is the single largest.
        assert_eq!(top_share(&[1, 1, 1, 1, 1, 1, 1, 1, 1, 11], 0.10), 0.55);
        // 4 experts, top 10% = 0.4 of the largest.
        assert!((top_share(&[10, 0, 0, 0], 0.10) - 0.4).abs() < 1e-12);
        assert_eq!(top_share(&[3, 1], 1.0), 1.0);
    }

    #[test]
    fn uniform_baseline_is_above_frac_for_few_tokens_and_tends_to_it() {
        let few = uniform_top_share(32, 4, 96, 0.10);
        let many = uniform_top_share(32, 4, 20_000, 0.10);
        assert!(few > 0.12 && few < 0.20, "{few}");
        assert!(many > 0.10 && many < 0.105, "{many}");
        assert!(many < few);
        assert_eq!(uniform_top_share(32, 4, 0, 0.10), 0.0);
        assert_eq!(uniform_top_share(4, 4, 10, 0.25), 0.25);
    }

    #[test]
    fn counts_per_layer_and_reports_concentration() {
        let mut c = RouteCounts::new(4);
        // Layer 0: every token chooses experts 0 and 1; layer 1: spread evenly.
        for t in 0..8u32 {
            c.add(0, &RouteTable { k: 2, experts: vec![0, 1], weights: vec![0.5, 0.5] });
            c.add(1, &RouteTable { k: 2, experts: vec![t % 4, (t + 2) % 4], weights: vec![0.5, 0.5] });
        }
        assert_eq!(c.layer(0), &[8, 8, 0, 0]);
        assert_eq!(c.layer(1), &[4, 4, 4, 4]);
        assert_eq!(c.layer(7), &[] as &[u64]);
        let k = c.concentration();
        assert_eq!((k.layers, k.requests_per_layer), (2, 16));
        // Top 25% of 4 experts = 1 expert: half of layer 0's choices, a quarter of layer 1's.
        assert!((k.top25 - (0.5 + 0.25) / 2.0).abs() < 1e-12, "{k:?}");
        assert!(k.uniform_top25 > 0.25, "{k:?}");
    }
}
