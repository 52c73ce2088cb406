//! What `--stats` reports of a GPU run: device counters, decode steps, the VRAM expert
//! cache and the routing prediction.

use super::super::context::DeviceCounters;
use super::super::vram::VramStats;
use super::GpuBackend;

/// Counters of a GPU run (what `--stats` prints).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuStats {
    /// Device work: submissions, dispatches, readbacks.
    pub device: DeviceCounters,
    /// Positions run (prompt and generated).
    pub positions: u64,
    /// Forward calls of a single position (decode steps).
    pub decode_steps: u64,
    /// Readbacks during those decode steps.
    pub decode_readbacks: u64,
    /// Submissions during those decode steps.
    pub decode_submissions: u64,
    /// Readbacks of a layer's routing (partial residency).
    pub route_readbacks: u64,
    /// VRAM expert cache counters.
    pub vram: VramStats,
    /// Experts of the next layer that the resident-router prediction got right.
    pub predicted_hits: u64,
    /// Experts the predicted layers used.
    pub predicted_total: u64,
    /// True when every expert is resident.
    pub full_residency: bool,
}

impl GpuStats {
    /// Readbacks per decoded position.
    pub fn readbacks_per_decode_step(&self) -> f64 {
        self.decode_readbacks as f64 / self.decode_steps.max(1) as f64
    }

    /// Share of next-layer experts predicted correctly (None before any prediction).
    pub fn prediction_accuracy(&self) -> Option<f64> {
        (self.predicted_total > 0).then(|| self.predicted_hits as f64 / self.predicted_total as f64)
    }
}

impl GpuBackend {
    pub(super) fn report_lines(&self) -> Vec<String> {
        let s = self.stats();
        let d = s.device;
        let mut lines = vec![format!(
            "gpu: {}; {} submissions, {} dispatches, {} readbacks ({:.1} KiB) for {} positions",
            self.adapter().summary(),
            d.submissions,
            d.dispatches,
            d.readbacks,
            d.readback_bytes as f64 / 1024.0,
            s.positions
        )];
        lines.push(format!(
            "  decode: {} steps, {:.2} readbacks and {:.2} submissions per step{}",
            s.decode_steps,
            s.readbacks_per_decode_step(),
            s.decode_submissions as f64 / s.decode_steps.max(1) as f64,
            if s.route_readbacks > 0 {
                format!(" ({} routing readbacks in all)", s.route_readbacks)
            } else {
                String::new()
            }
        ));
        lines.push(format!(
            "  dense weights in VRAM: {:.1} MiB; output head in {} row block(s) (storage binding limit {:.0} MiB)",
            self.dense_bytes as f64 / (1u64 << 20) as f64,
            self.head.blocks.len(),
            self.gpu.max_binding as f64 / (1u64 << 20) as f64
        ));
        let v = s.vram;
        lines.push(format!(
            "  vram experts: {} ({} of {} slots of {:.2} MiB in {} pool(s)); {} hits, {} misses, {} uploads ({} prefetched, {} of them used), {} evictions, {:.1} MiB uploaded",
            if s.full_residency { "all resident" } else { "LRU" },
            self.vram.resident(),
            self.vram.slots,
            self.vram.layout.bytes() as f64 / (1u64 << 20) as f64,
            self.vram.pools.len(),
            v.hits,
            v.misses,
            v.uploads,
            v.prefetches,
            v.prefetch_used,
            v.evictions,
            v.bytes as f64 / (1u64 << 20) as f64
        ));
        lines.push(match s.prediction_accuracy() {
            Some(a) => format!(
                "  routing prediction (router L+1 on layer L's activation): {}/{} next-layer experts = {:.1}%",
                s.predicted_hits,
                s.predicted_total,
                100.0 * a
            ),
            None if self.predict => "  routing prediction: no predictions read yet".into(),
            None => "  routing prediction: off (every expert resident; --gpu-predict to measure it)".into(),
        });
        lines
    }
}
