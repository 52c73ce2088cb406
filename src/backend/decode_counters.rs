//! What a device was asked to do during decode steps (single-position forward calls):
//! dispatches (split by layer and head), submissions, waits and bytes read back. A GPU
//! backend counts them; `picchio bench` reports them per decoded token.

use serde::Serialize;

/// Device work counted over decode steps that computed logits, cumulative (see
/// [`DecodeCounters::since`]). A step that only stores a token in the cache (the last
/// generated token, whose logits nobody needs) is counted in `steps_without_logits` alone,
/// so that every figure per step is one of a whole token.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DecodeCounters {
    /// Decode steps (forward calls of a single position) that computed logits.
    pub steps: u64,
    /// Decode steps that did not (not counted in any other field).
    pub steps_without_logits: u64,
    /// Compute dispatches recorded during those steps, in all.
    pub dispatches: u64,
    /// Dispatches of each layer (from its first op to the next layer's or the head's),
    /// summed over the steps; one entry per layer.
    pub layer_dispatches: Vec<u64>,
    /// Dispatches of the head: the row selection, final norm and output head and anything
    /// after them until the next step.
    pub head_dispatches: u64,
    /// Dispatches before the first layer's first op (e.g. an embedding kernel).
    pub other_dispatches: u64,
    /// Command submissions during those steps.
    pub submissions: u64,
    /// Readbacks during those steps (each one waits for the device).
    pub readbacks: u64,
    /// Bytes those readbacks copied to the host.
    pub readback_bytes: u64,
}

impl DecodeCounters {
    /// The counts accumulated after `earlier` (a snapshot of the same counters).
    pub fn since(&self, earlier: &DecodeCounters) -> DecodeCounters {
        let layer_dispatches = self
            .layer_dispatches
            .iter()
            .enumerate()
            .map(|(i, &n)| n.saturating_sub(earlier.layer_dispatches.get(i).copied().unwrap_or(0)))
            .collect();
        DecodeCounters {
            steps: self.steps.saturating_sub(earlier.steps),
            steps_without_logits: self.steps_without_logits.saturating_sub(earlier.steps_without_logits),
            dispatches: self.dispatches.saturating_sub(earlier.dispatches),
            layer_dispatches,
            head_dispatches: self.head_dispatches.saturating_sub(earlier.head_dispatches),
            other_dispatches: self.other_dispatches.saturating_sub(earlier.other_dispatches),
            submissions: self.submissions.saturating_sub(earlier.submissions),
            readbacks: self.readbacks.saturating_sub(earlier.readbacks),
            readback_bytes: self.readback_bytes.saturating_sub(earlier.readback_bytes),
        }
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &DecodeCounters) {
        if self.layer_dispatches.len() < other.layer_dispatches.len() {
            self.layer_dispatches.resize(other.layer_dispatches.len(), 0);
        }
        for (a, b) in self.layer_dispatches.iter_mut().zip(&other.layer_dispatches) {
            *a += b;
        }
        self.steps += other.steps;
        self.steps_without_logits += other.steps_without_logits;
        self.dispatches += other.dispatches;
        self.head_dispatches += other.head_dispatches;
        self.other_dispatches += other.other_dispatches;
        self.submissions += other.submissions;
        self.readbacks += other.readbacks;
        self.readback_bytes += other.readback_bytes;
    }

    /// `total` per decode step (0 without steps).
    pub fn per_step(&self, total: u64) -> f64 {
        if self.steps == 0 { 0.0 } else { total as f64 / self.steps as f64 }
    }

    /// Dispatches per step of each layer.
    pub fn per_layer(&self) -> Vec<f64> {
        self.layer_dispatches.iter().map(|&n| self.per_step(n)).collect()
    }

    /// (mean, min, max) dispatches per step over the layers (zeros without layers).
    pub fn layer_summary(&self) -> (f64, f64, f64) {
        let per = self.per_layer();
        if per.is_empty() {
            return (0.0, 0.0, 0.0);
        }
        let mean = per.iter().sum::<f64>() / per.len() as f64;
        let min = per.iter().copied().fold(f64::INFINITY, f64::min);
        let max = per.iter().copied().fold(0.0, f64::max);
        (mean, min, max)
    }

    /// The counters per decoded token, as `bench --json` reports them.
    pub fn json(&self) -> serde_json::Value {
        let (mean, min, max) = self.layer_summary();
        serde_json::json!({
            "steps": self.steps,
            "steps_without_logits": self.steps_without_logits,
            "layers": self.layer_dispatches.len(),
            "dispatches_per_token": self.per_step(self.dispatches),
            "dispatches_per_layer": mean,
            "dispatches_per_layer_min": min,
            "dispatches_per_layer_max": max,
            "dispatches_per_layer_each": self.per_layer(),
            "head_dispatches_per_token": self.per_step(self.head_dispatches),
            "other_dispatches_per_token": self.per_step(self.other_dispatches),
            "submissions_per_token": self.per_step(self.submissions),
            "readbacks_per_token": self.per_step(self.readbacks),
            "readback_bytes_per_token": self.per_step(self.readback_bytes),
            "totals": self,
        })
    }

    /// One line for the `bench` table.
    pub fn line(&self) -> String {
        let (mean, min, max) = self.layer_summary();
        let range = if (max - min).abs() < 1e-9 { String::new() } else { format!(" ({min:.1}..{max:.1})") };
        format!(
            "device per decoded token ({} steps{}): {:.1} dispatches = {:.1} per layer{range} x {} layers + {:.1} head{}; \
             {:.2} submissions, {:.2} waits (readbacks), {:.0} bytes read back",
            self.steps,
            if self.steps_without_logits > 0 {
                format!(", {} without logits left out", self.steps_without_logits)
            } else {
                String::new()
            },
            self.per_step(self.dispatches),
            mean,
            self.layer_dispatches.len(),
            self.per_step(self.head_dispatches),
            if self.other_dispatches > 0 {
                format!(" + {:.1} before the layers", self.per_step(self.other_dispatches))
            } else {
                String::new()
            },
            self.per_step(self.submissions),
            self.per_step(self.readbacks),
            self.per_step(self.readback_bytes),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_and_per_step() {
        let a = DecodeCounters {
            steps: 1,
            steps_without_logits: 0,
            dispatches: 10,
            layer_dispatches: vec![4, 4],
            head_dispatches: 2,
            other_dispatches: 0,
            submissions: 1,
            readbacks: 1,
            readback_bytes: 100,
        };
        let mut b = DecodeCounters {
            steps: 2,
            steps_without_logits: 1,
            dispatches: 30,
            layer_dispatches: vec![12, 14],
            head_dispatches: 4,
            other_dispatches: 0,
            submissions: 3,
            readbacks: 4,
            readback_bytes: 400,
        };
        b.add(&DecodeCounters { steps: 1, ..Default::default() });
        let d = b.since(&a);
        assert_eq!((d.steps, d.steps_without_logits), (2, 1));
        assert_eq!(d.layer_dispatches, vec![8, 10]);
        assert_eq!(d.per_step(d.dispatches), 10.0);
        assert_eq!(d.layer_summary(), (4.5, 4.0, 5.0));
        assert_eq!(d.per_step(d.readback_bytes), 150.0);
        assert!(d.line().contains("4.5 per layer (4.0..5.0) x 2 layers + 1.0 head"), "{}", d.line());
        assert_eq!(DecodeCounters::default().per_step(5), 0.0);
    }
}
