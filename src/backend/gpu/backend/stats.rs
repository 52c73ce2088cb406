//! What `--stats` reports of a GPU run: device counters, decode steps, the VRAM expert
//! cache and the routing prediction.

use super::super::context::DeviceCounters;
use super::super::vram::VramStats;
use super::GpuBackend;
use super::split::SplitStats;
use crate::backend::DecodeCounters;

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
    /// Dispatches, submissions, readbacks and bytes read back of the decode steps that
    /// computed logits (dispatches split by layer and head).
    pub decode: DecodeCounters,
    /// Readbacks of a layer's routing (partial residency).
    pub route_readbacks: u64,
    /// The CPU+GPU expert split (or the uploads) of partially resident layers, all blocks.
    pub split: SplitStats,
    /// The same for decode steps only (single positions): divided by `decode_steps`, per
    /// decoded token.
    pub decode_split: SplitStats,
    /// VRAM expert cache counters.
    pub vram: VramStats,
    /// Experts of the next layer that the resident-router prediction got right.
    pub predicted_hits: u64,
    /// Experts the predicted layers used.
    pub predicted_total: u64,
    /// True when every expert is resident.
    pub full_residency: bool,
    /// Weight passes of the grouped expert kernels (prompt blocks): per layer and block,
    /// the experts of the block's union, each read once for all its pairs.
    pub expert_passes: u64,
    /// The (row, expert) pairs those passes computed.
    pub grouped_pairs: u64,
    /// Dispatches of the tiled dense product (prompt blocks: each a row block of a matrix
    /// over the block's tokens, each weight read once per 32 tokens).
    pub tiled_products: u64,
    /// Token rows those tiled products computed, summed over the products (a product over
    /// a 64-token block counts 64, whatever its row blocks).
    pub tiled_tokens: u64,
    /// Sampled picks decided by the candidates ranked on the device (kilobytes read back).
    pub sampled_from_candidates: u64,
    /// Sampled picks that read the whole row of logits (the draw landed beyond the
    /// candidates, or a top-k above the device's limit).
    pub sampled_from_logits: u64,
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

/// The part of a forward block whose dispatches are being recorded (counted for decode
/// steps): before the first layer, a layer, or the head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Segment {
    /// From the embedding to the first op of a layer.
    #[default]
    Start,
    /// From the first op naming this layer to the next segment.
    Layer(usize),
    /// From the row selection, final norm or output head to the next block.
    Head,
}

/// Adds `n` dispatches to `segment`'s count in `step`.
fn add_segment(step: &mut DecodeCounters, segment: Segment, n: u64) {
    match segment {
        Segment::Start => step.other_dispatches += n,
        Segment::Head => step.head_dispatches += n,
        Segment::Layer(l) => {
            if step.layer_dispatches.len() <= l {
                step.layer_dispatches.resize(l + 1, 0);
            }
            step.layer_dispatches[l] += n;
        }
    }
}

impl GpuBackend {
    /// Attributes the dispatches recorded since the last mark to the current segment and
    /// enters `next` (nothing when already there).
    pub(super) fn enter(&mut self, next: Segment) {
        if self.segment != next {
            let now = self.gpu.counters().dispatches;
            add_segment(&mut self.step, self.segment, now - self.segment_start);
            self.segment_start = now;
            if next == Segment::Head {
                self.step_has_head = true;
            }
            self.segment = next;
        }
    }

    /// The counts of the decode step in progress, from its start to now.
    fn step_so_far(&self) -> DecodeCounters {
        let now = self.gpu.counters();
        let start = &self.block_device;
        let mut step = self.step.clone();
        add_segment(&mut step, self.segment, now.dispatches - self.segment_start);
        if self.step_has_head {
            step.steps = 1;
            step.dispatches = now.dispatches - start.dispatches;
            step.submissions = now.submissions - start.submissions;
            step.readbacks = now.readbacks - start.readbacks;
            step.readback_bytes = now.readback_bytes - start.readback_bytes;
        } else {
            step = DecodeCounters { steps_without_logits: 1, ..Default::default() };
        }
        step
    }

    /// A new forward block of `positions` positions begins: closes the previous block's
    /// counts and starts this one's.
    pub(super) fn begin_block(&mut self, positions: usize) {
        self.batched_step = false;
        let now = self.gpu.counters();
        if self.in_decode {
            self.stats.decode_submissions += now.submissions - self.block_device.submissions;
            let step = self.step_so_far();
            self.stats.decode.add(&step);
        }
        self.block_device = now;
        self.step = DecodeCounters { layer_dispatches: vec![0; self.cfg.num_layers], ..Default::default() };
        self.step_has_head = false;
        self.segment = Segment::Start;
        self.segment_start = now.dispatches;
        self.in_decode = positions == 1;
        self.stats.positions += positions as u64;
        if self.in_decode {
            self.stats.decode_steps += 1;
        }
    }

    /// The counters with the block in progress included.
    pub(super) fn current_stats(&self) -> GpuStats {
        let mut s = self.stats.clone();
        s.device = self.gpu.counters();
        if self.in_decode {
            s.decode_submissions += s.device.submissions - self.block_device.submissions;
            s.decode.add(&self.step_so_far());
        }
        s.vram = self.vram.stats;
        s
    }

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
        if s.decode.steps > 0 {
            lines.push(format!("  {}", s.decode.line()));
        }
        if s.grouped_pairs > 0 {
            lines.push(format!(
                "  prefill experts: {} weight passes for {} (row, expert) pairs: each expert of a block's union read once",
                s.expert_passes, s.grouped_pairs
            ));
        }
        if s.tiled_products > 0 {
            lines.push(format!(
                "  prefill dense products: {} tiled dispatches over {} token rows (each weight read once per {} tokens)",
                s.tiled_products,
                s.tiled_tokens,
                super::dense::TILE_TOKENS
            ));
        }
        if s.sampled_from_candidates + s.sampled_from_logits > 0 {
            lines.push(format!(
                "  sampling: {} picks from candidates ranked on the device, {} from the full logits",
                s.sampled_from_candidates, s.sampled_from_logits
            ));
        }
        lines.push(format!(
            "  dense weights in VRAM: {:.1} MiB; output head in {} row block(s) (storage binding limit {:.0} MiB)",
            self.dense_bytes as f64 / (1u64 << 20) as f64,
            self.head.blocks.len(),
            self.gpu.max_binding as f64 / (1u64 << 20) as f64
        ));
        let per_position = self.kv_precision.position_bytes(&self.cfg).unwrap_or(u64::MAX);
        lines.push(format!(
            "  key/value caches in VRAM: {} x {:.1} MiB ({} positions, {}: {} bytes a position over {} layers)",
            self.kv.len(),
            self.kv_cache_bytes() as f64 / (1u64 << 20) as f64,
            self.capacity,
            self.kv_precision,
            per_position,
            self.cfg.num_layers
        ));
        let v = s.vram;
        lines.push(format!(
            "  vram experts: {} ({} of {} slots of {:.2} MiB in {} pool(s)); {} hits, {} misses, {} uploads ({} prefetched, {} of them used; {} promoted in the background, {} from the hot set), {} evictions, {:.1} MiB uploaded",
            if s.full_residency {
                "all resident".to_string()
            } else {
                format!("partial, misses {}", self.misses)
            },
            self.vram.resident(),
            self.vram.slots,
            self.vram.layout.bytes() as f64 / (1u64 << 20) as f64,
            self.vram.pools.len(),
            v.hits,
            v.misses,
            v.uploads,
            v.prefetches,
            v.prefetch_used,
            v.promotions,
            v.hot_set,
            v.evictions,
            v.bytes as f64 / (1u64 << 20) as f64
        ));
        if s.split.layers > 0 {
            if s.decode_steps > 0 && s.decode_split.layers > 0 {
                lines.push(format!("  per decoded token: {}", split_line(&s.decode_split, s.decode_steps)));
            }
            lines.push(format!("  all blocks: {}", split_line(&s.split, 1)));
        }
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

/// One line of the CPU+GPU split's counters, divided by `per` (decode steps for a
/// per-token line, 1 for totals).
fn split_line(s: &SplitStats, per: u64) -> String {
    let n = per.max(1) as f64;
    format!(
        "experts {:.1} on the GPU, {:.1} on the CPU ({:.1} row pairs); {:.1} KiB over the bus; CPU busy {:.2} ms; waits: {:.2} ms on the RAM tier, {:.2} ms on the GPU, {:.2} ms on uploads ({} layers waited)",
        s.gpu_experts as f64 / n,
        s.cpu_experts as f64 / n,
        s.cpu_pairs as f64 / n,
        s.bus_bytes as f64 / 1024.0 / n,
        1e3 * s.cpu_busy_s / n,
        1e3 * s.source_wait_s / n,
        1e3 * s.device_wait_s / n,
        1e3 * s.upload_wait_s / n,
        s.upload_waits
    )
}
