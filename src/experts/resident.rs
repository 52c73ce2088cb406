//! Every expert held in memory: the source for small models and for tests.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::experts::ExpertSource;
use crate::model::weights::ExpertWeights;

/// All experts of all layers, in memory.
pub struct ResidentExperts {
    /// `layers[l][e]`.
    layers: Vec<Vec<Arc<ExpertWeights>>>,
}

impl ResidentExperts {
    /// Wraps experts indexed `[layer][expert]`.
    pub fn new(layers: Vec<Vec<ExpertWeights>>) -> Self {
        ResidentExperts {
            layers: layers.into_iter().map(|l| l.into_iter().map(Arc::new).collect()).collect(),
        }
    }
}

impl ExpertSource for ResidentExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<Arc<ExpertWeights>> {
        self.layers
            .get(layer)
            .and_then(|l| l.get(expert))
            .cloned()
            .ok_or_else(|| Error::invalid(format!("no expert {expert} in layer {layer}")))
    }

    fn expert_bytes(&self) -> u64 {
        self.layers.iter().flatten().next().map_or(0, |e| e.byte_len() as u64)
    }

    fn host_bytes(&self) -> u64 {
        self.layers.iter().flatten().map(|e| e.byte_len() as u64).sum()
    }

    fn describe(&self) -> String {
        let bytes: usize = self.layers.iter().flatten().map(|e| e.byte_len()).sum();
        format!(
            "all {} experts resident ({:.1} MiB)",
            self.layers.iter().map(Vec::len).sum::<usize>(),
            bytes as f64 / (1 << 20) as f64
        )
    }
}
