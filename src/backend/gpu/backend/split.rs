//! CPU+GPU experts ([`MissPolicy::Cpu`](crate::backend::gpu::MissPolicy)): when a layer
//! needs experts that are not in VRAM, the GPU computes the resident ones while the CPU
//! computes the others from the RAM tier, each pair's unweighted output lands in the same
//! contribution buffer, and moe_combine.wgsl sums them in routing order. Only activations
//! cross the bus: the layer's normalized input rows come back with its routing (one
//! readback), and each host-computed pair's output goes up (`hidden` floats). Experts the
//! host computed are offered to the VRAM cache for background promotion; no token waits on
//! an upload.
//!
//! Which side computes an expert changes its rounding, not the math: the GPU kernels and
//! the CPU kernels agree on the top-1 token at every position (tests/gpu_split.rs).

use std::time::Instant;

use crate::backend::RouteTable;
use crate::backend::cpu::moe::{MoeScratch, expert_rows};
use crate::error::{Error, Result};

use super::super::buffers::GpuAct;
use super::super::buffers::GpuRoutes;
use super::super::context::GBuf;
use super::GpuBackend;

/// Counters of the CPU+GPU expert split (partial residency).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SplitStats {
    /// MoE layers run with some experts outside VRAM.
    pub layers: u64,
    /// Distinct experts computed on the GPU (resident) in those layers.
    pub gpu_experts: u64,
    /// Distinct experts computed on the CPU.
    pub cpu_experts: u64,
    /// (row, expert) pairs computed on the CPU.
    pub cpu_pairs: u64,
    /// Bytes that crossed the bus for the split: input rows read back and contributions
    /// written (not counting promotions, which are in the VRAM counters).
    pub bus_bytes: u64,
    /// Seconds the host computed experts (its busy time in the split).
    pub cpu_busy_s: f64,
    /// Seconds the host waited for the expert source (RAM tier, disk) before computing.
    pub source_wait_s: f64,
    /// Seconds the host waited for the device at the routing readback (the GPU's work
    /// before the layer's experts, not overlapped with anything on the host).
    pub device_wait_s: f64,
    /// Layers that waited for experts to be uploaded before running
    /// ([`MissPolicy::Upload`](crate::backend::gpu::MissPolicy); always 0 with `Cpu`).
    pub upload_waits: u64,
    /// Seconds those layers waited (fetching and copying the experts).
    pub upload_wait_s: f64,
}

impl SplitStats {
    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &SplitStats) {
        self.layers += other.layers;
        self.gpu_experts += other.gpu_experts;
        self.cpu_experts += other.cpu_experts;
        self.cpu_pairs += other.cpu_pairs;
        self.bus_bytes += other.bus_bytes;
        self.cpu_busy_s += other.cpu_busy_s;
        self.source_wait_s += other.source_wait_s;
        self.device_wait_s += other.device_wait_s;
        self.upload_waits += other.upload_waits;
        self.upload_wait_s += other.upload_wait_s;
    }
}

/// The host's working buffers for the experts it computes, reused across layers.
#[derive(Debug, Default)]
pub(super) struct HostExperts {
    scratch: MoeScratch,
    /// The pairs of the expert being computed.
    pairs: Vec<usize>,
    /// Their input rows.
    xs: Vec<f32>,
    /// Their outputs.
    ys: Vec<f32>,
}

impl GpuBackend {
    /// The experts of `layer` split between the devices: `needed` (distinct experts of
    /// `table`) that are resident run on the GPU over `routes` (by pair, or grouped by
    /// `order`), the others on the CPU over `xs` (the layer's input rows, read back with
    /// the routing); every pair's output lands in `contrib`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn split_experts(
        &mut self,
        layer: usize,
        x: &GpuAct,
        xs: &[f32],
        table: &RouteTable,
        needed: &[usize],
        routes: &GpuRoutes,
        order: Option<&GBuf>,
        act: &GBuf,
        contrib: &GBuf,
    ) -> Result<SplitStats> {
        let h = self.cfg.hidden_size;
        let mut s = SplitStats { layers: 1, ..Default::default() };
        // Promotions written since the last layer become visible before this one records.
        self.vram.finish_promotions(&mut self.gpu)?;
        let (resident, host) = self.vram.split(layer, needed);
        s.gpu_experts = resident.len() as u64;
        s.cpu_experts = host.len() as u64;
        if !resident.is_empty() {
            self.dispatch_experts(layer, x, routes, order, act, contrib)?;
        }
        // The device starts on the resident experts while the host computes the others.
        self.gpu.flush()?;
        if host.is_empty() {
            return Ok(s);
        }
        if xs.len() != table.rows() * h {
            return Err(Error::Backend(format!(
                "layer {layer}: {} input values read back for {} rows of {h}",
                xs.len(),
                table.rows()
            )));
        }
        let t0 = Instant::now();
        let weights = self.source.experts(layer, &host)?;
        let t1 = Instant::now();
        s.source_wait_s = (t1 - t0).as_secs_f64();
        let mut work = std::mem::take(&mut self.host);
        let result = (|| {
            for (&e, w) in host.iter().zip(&weights) {
                work.pairs.clear();
                work.pairs.extend((0..table.experts.len()).filter(|&p| table.experts[p] as usize == e));
                work.xs.clear();
                for &p in &work.pairs {
                    let r = p / table.k;
                    work.xs.extend_from_slice(&xs[r * h..(r + 1) * h]);
                }
                let n = work.pairs.len();
                work.ys.clear();
                work.ys.resize(n * h, 0.0);
                expert_rows(&self.cfg, w, &work.xs, n, &mut work.scratch, &mut work.ys);
                for (&p, y) in work.pairs.iter().zip(work.ys.chunks(h)) {
                    self.gpu.write(contrib, (p * h * 4) as u64, bytemuck::cast_slice(y))?;
                    s.bus_bytes += (h * 4) as u64;
                }
                s.cpu_pairs += n as u64;
            }
            Ok::<(), Error>(())
        })();
        self.host = work;
        result?;
        s.cpu_busy_s = t1.elapsed().as_secs_f64();
        // Offer what the host computed to VRAM: the ones used more lately than the
        // coldest resident expert are written in the background.
        for (&e, w) in host.iter().zip(weights) {
            self.vram.promote(&mut self.gpu, layer, e, w)?;
        }
        Ok(s)
    }
}
