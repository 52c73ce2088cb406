//! The VRAM expert cache: expert records in slot pools (a few storage buffers, each within
//! the binding limit), a slot table `(layer, expert) -> slot` on the device that the expert
//! kernels read, and a least-recently-used policy bounded in bytes (`--vram-gb`).
//!
//! When every expert of the model fits, all are uploaded once and the table never changes
//! (full residency: no CPU round trip per layer). Otherwise (partial residency) the
//! backend makes each layer's experts resident before dispatching it, never evicting what
//! that layer needs, and prefetches the predicted experts of the next layer. A slot holds
//! the same component layout as an `experts.bin` record; where an expert sits never
//! changes what the kernels compute.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::experts::ExpertSource;
use crate::model::weights::ExpertWeights;
use crate::quant::{MatrixData, int4};

use super::context::{GBuf, Gpu};

/// Table entry of an expert that is not resident.
pub const NO_SLOT: u32 = u32::MAX;
/// Bytes uploaded between waits while filling VRAM (bounds the staging memory).
const UPLOAD_BATCH: u64 = 256 << 20;

/// How expert matrices are stored in a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotFormat {
    /// INT4-gs64 codes and f16 group scales.
    Int4,
    /// F32 rows.
    F32,
}

/// Where an expert's components sit inside its slot, in u32 words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    /// Matrix format.
    pub format: SlotFormat,
    /// Gate/up codes or values.
    pub gu_w: u32,
    /// Gate/up scales (INT4).
    pub gu_s: u32,
    /// Gate/up bias.
    pub gu_b: u32,
    /// Down codes or values.
    pub dn_w: u32,
    /// Down scales (INT4).
    pub dn_s: u32,
    /// Down bias.
    pub dn_b: u32,
    /// Words per gate/up row.
    pub gu_row_words: u32,
    /// Scale groups per gate/up row.
    pub gu_groups: u32,
    /// Words per down row.
    pub dn_row_words: u32,
    /// Scale groups per down row.
    pub dn_groups: u32,
    /// Words between slots (a multiple of 64: 256 bytes).
    pub stride: u32,
}

impl SlotLayout {
    /// The layout for a model's experts in `format`.
    pub fn new(cfg: &ModelConfig, format: SlotFormat) -> Self {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let mut at = 0usize;
        let mut take = |words: usize| {
            let start = at;
            at = (at + words).next_multiple_of(4);
            start as u32
        };
        let (gu_row_words, gu_groups, dn_row_words, dn_groups) = match format {
            SlotFormat::Int4 => {
                (int4::row_bytes(h) / 4, int4::groups(h), int4::row_bytes(i) / 4, int4::groups(i))
            }
            SlotFormat::F32 => (h, 0, i, 0),
        };
        let gu_w = take(2 * i * gu_row_words);
        let gu_s = take((2 * i * gu_groups).div_ceil(2));
        let gu_b = take(2 * i);
        let dn_w = take(h * dn_row_words);
        let dn_s = take((h * dn_groups).div_ceil(2));
        let dn_b = take(h);
        SlotLayout {
            format,
            gu_w,
            gu_s,
            gu_b,
            dn_w,
            dn_s,
            dn_b,
            gu_row_words: gu_row_words as u32,
            gu_groups: gu_groups as u32,
            dn_row_words: dn_row_words as u32,
            dn_groups: dn_groups as u32,
            stride: at.next_multiple_of(64) as u32,
        }
    }

    /// Bytes of one slot.
    pub fn bytes(&self) -> u64 {
        self.stride as u64 * 4
    }

    /// Writes `w` into `out` (one slot, zeroed by the caller).
    pub fn encode(&self, w: &ExpertWeights, out: &mut [u8], what: &str) -> Result<()> {
        fn put(out: &mut [u8], word: u32, bytes: &[u8]) {
            let at = word as usize * 4;
            out[at..at + bytes.len()].copy_from_slice(bytes);
        }
        let bad = || {
            Error::Backend(format!(
                "{what}: experts stored as {}/{} cannot go in {:?} VRAM slots",
                w.gate_up.format_name(),
                w.down.format_name(),
                self.format
            ))
        };
        match (&w.gate_up.data, &w.down.data, self.format) {
            (
                MatrixData::Int4G64 { codes: gc, scales: gs },
                MatrixData::Int4G64 { codes: dc, scales: ds },
                SlotFormat::Int4,
            ) => {
                put(out, self.gu_w, gc.as_slice());
                put(out, self.gu_s, bytemuck::cast_slice(gs.as_slice()));
                put(out, self.dn_w, dc.as_slice());
                put(out, self.dn_s, bytemuck::cast_slice(ds.as_slice()));
            }
            (MatrixData::F32(g), MatrixData::F32(d), SlotFormat::F32) => {
                put(out, self.gu_w, bytemuck::cast_slice(g.as_slice()));
                put(out, self.dn_w, bytemuck::cast_slice(d.as_slice()));
            }
            _ => return Err(bad()),
        }
        put(out, self.gu_b, bytemuck::cast_slice(&w.gate_up_bias));
        put(out, self.dn_b, bytemuck::cast_slice(&w.down_bias));
        Ok(())
    }
}

/// Counters of the VRAM cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VramStats {
    /// Experts a layer needed that were resident.
    pub hits: u64,
    /// Experts a layer needed that had to be uploaded first.
    pub misses: u64,
    /// Experts uploaded (misses, prefetches, and the initial fill).
    pub uploads: u64,
    /// Uploads made on a prediction.
    pub prefetches: u64,
    /// Prefetched experts that a layer then used.
    pub prefetch_used: u64,
    /// Experts evicted.
    pub evictions: u64,
    /// Bytes uploaded.
    pub bytes: u64,
}

/// The expert cache in VRAM.
pub struct VramExperts {
    /// Slot layout.
    pub layout: SlotLayout,
    layers: usize,
    experts: usize,
    /// Slots in all.
    pub slots: usize,
    /// Slots per pool buffer.
    pub slots_per_pool: usize,
    /// The pool buffers.
    pub pools: Vec<GBuf>,
    /// Pools bound per dispatch (a kernel variant).
    pub pools_per_dispatch: u32,
    /// `(layer, expert) -> slot` on the device.
    pub table: GBuf,
    full: bool,
    map: HashMap<(usize, usize), usize>,
    owner: Vec<Option<(usize, usize)>>,
    last_use: Vec<u64>,
    prefetched: Vec<bool>,
    clock: u64,
    scratch: Vec<u8>,
    /// Counters.
    pub stats: VramStats,
}

impl VramExperts {
    /// A cache of at most `budget` bytes (at least one token's experts of a layer; at most
    /// every expert of the model, in which case all are uploaded now).
    pub fn new(
        gpu: &mut Gpu,
        cfg: &ModelConfig,
        source: &Arc<dyn ExpertSource>,
        budget: u64,
    ) -> Result<Self> {
        let probe = source.expert(0, 0)?;
        let format = match probe.gate_up.data {
            MatrixData::Int4G64 { .. } => SlotFormat::Int4,
            MatrixData::F32(_) => SlotFormat::F32,
            MatrixData::Bf16(_) | MatrixData::Int8Rows { .. } | MatrixData::Mxfp4 { .. } => {
                return Err(Error::Backend(format!(
                    "experts stored as {} have no VRAM slot format",
                    probe.gate_up.format_name()
                )));
            }
        };
        let layout = SlotLayout::new(cfg, format);
        let total = cfg.num_layers * cfg.num_experts;
        let min = cfg.experts_per_token.max(1);
        let mut slots = ((budget / layout.bytes()) as usize).min(total);
        if slots < min {
            tracing::warn!(
                "--vram-gb leaves room for {slots} experts; using the minimum of {min} (one token's experts of a layer, {:.1} MiB)",
                (min as u64 * layout.bytes()) as f64 / (1u64 << 20) as f64
            );
            slots = min;
        }
        let slots_per_pool = (gpu.max_binding / layout.bytes()) as usize;
        if slots_per_pool == 0 {
            return Err(Error::Backend(format!(
                "one expert ({} bytes) exceeds the storage binding limit of {} bytes",
                layout.bytes(),
                gpu.max_binding
            )));
        }
        let n_pools = slots.div_ceil(slots_per_pool);
        let bindable = gpu.max_storage_bindings.saturating_sub(4);
        let mut per_dispatch = 8u32;
        while per_dispatch > 1 && (per_dispatch > bindable || per_dispatch / 2 >= n_pools as u32) {
            per_dispatch /= 2;
        }
        if bindable == 0 {
            return Err(Error::Backend(format!(
                "the adapter allows {} storage buffers per kernel; the expert kernels need 5",
                gpu.max_storage_bindings
            )));
        }
        let mut pools = Vec::with_capacity(n_pools);
        for p in 0..n_pools {
            let n = slots_per_pool.min(slots - p * slots_per_pool);
            pools.push(gpu.buffer(
                &format!("expert pool {p}"),
                n as u64 * layout.bytes(),
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            )?);
        }
        let full = slots == total;
        let table_words: Vec<u32> = if full { (0..total as u32).collect() } else { vec![NO_SLOT; total] };
        let table = gpu.buffer_init("expert slot table", bytemuck::cast_slice(&table_words))?;
        let mut v = VramExperts {
            layout,
            layers: cfg.num_layers,
            experts: cfg.num_experts,
            slots,
            slots_per_pool,
            pools,
            pools_per_dispatch: per_dispatch,
            table,
            full,
            map: HashMap::new(),
            owner: vec![None; slots],
            last_use: vec![0; slots],
            prefetched: vec![false; slots],
            clock: 0,
            scratch: vec![0; layout.bytes() as usize],
            stats: VramStats::default(),
        };
        if full {
            let mut since_sync = 0;
            for l in 0..cfg.num_layers {
                let ids: Vec<usize> = (0..cfg.num_experts).collect();
                let weights = source.experts(l, &ids)?;
                for (e, w) in weights.iter().enumerate() {
                    let slot = l * cfg.num_experts + e;
                    v.upload(gpu, slot, w, &format!("layer {l} expert {e}"))?;
                    v.owner[slot] = Some((l, e));
                    v.map.insert((l, e), slot);
                    since_sync += layout.bytes();
                    if since_sync >= UPLOAD_BATCH {
                        gpu.sync()?;
                        since_sync = 0;
                    }
                }
            }
            gpu.sync()?;
        }
        Ok(v)
    }

    /// True when every expert of the model is resident.
    pub fn is_full(&self) -> bool {
        self.full
    }

    /// Experts resident now.
    pub fn resident(&self) -> usize {
        self.map.len()
    }

    fn upload(&mut self, gpu: &mut Gpu, slot: usize, w: &ExpertWeights, what: &str) -> Result<()> {
        self.scratch.fill(0);
        self.layout.encode(w, &mut self.scratch, what)?;
        let pool = &self.pools[slot / self.slots_per_pool];
        let offset = (slot % self.slots_per_pool) as u64 * self.layout.bytes();
        gpu.write(pool, offset, &self.scratch)?;
        self.stats.uploads += 1;
        self.stats.bytes += self.layout.bytes();
        Ok(())
    }

    fn set_table(&self, gpu: &mut Gpu, layer: usize, expert: usize, slot: u32) -> Result<()> {
        gpu.write(&self.table, ((layer * self.experts + expert) * 4) as u64, &slot.to_le_bytes())
    }

    /// A free slot, or the least recently used one not in `keep`.
    fn victim(&self, keep: &HashSet<(usize, usize)>) -> Option<usize> {
        if let Some(free) = self.owner.iter().position(Option::is_none) {
            return Some(free);
        }
        (0..self.slots)
            .filter(|&s| self.owner[s].is_some_and(|o| !keep.contains(&o)))
            .min_by_key(|&s| (self.last_use[s], s))
    }

    /// Makes `experts` of `layer` resident (at most `slots` of them), uploading misses from
    /// `source` and evicting least recently used experts outside the set. `prefetch` marks
    /// uploads made on a prediction (and does not count hits or misses).
    pub fn ensure(
        &mut self,
        gpu: &mut Gpu,
        source: &Arc<dyn ExpertSource>,
        layer: usize,
        experts: &[usize],
        prefetch: bool,
    ) -> Result<()> {
        if self.full {
            if !prefetch {
                self.stats.hits += experts.len() as u64;
            }
            return Ok(());
        }
        self.clock += 1;
        let keep: HashSet<(usize, usize)> = experts.iter().map(|&e| (layer, e)).collect();
        let mut missing = Vec::new();
        for &e in experts {
            match self.map.get(&(layer, e)) {
                Some(&slot) => {
                    self.last_use[slot] = self.clock;
                    if !prefetch {
                        self.stats.hits += 1;
                        if std::mem::take(&mut self.prefetched[slot]) {
                            self.stats.prefetch_used += 1;
                        }
                    }
                }
                None => missing.push(e),
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        // Let the device run what is recorded while the missing experts are fetched (the
        // writes below would submit it anyway, being ordered after it).
        gpu.flush()?;
        let weights = source.experts(layer, &missing)?;
        for (&e, w) in missing.iter().zip(&weights) {
            let Some(slot) = self.victim(&keep) else {
                if prefetch {
                    break;
                }
                return Err(Error::Backend(format!(
                    "VRAM expert cache: no slot for layer {layer} expert {e} ({} slots)",
                    self.slots
                )));
            };
            if let Some(old) = self.owner[slot].take() {
                self.map.remove(&old);
                self.set_table(gpu, old.0, old.1, NO_SLOT)?;
                self.stats.evictions += 1;
            }
            self.upload(gpu, slot, w, &format!("layer {layer} expert {e}"))?;
            self.owner[slot] = Some((layer, e));
            self.map.insert((layer, e), slot);
            self.last_use[slot] = self.clock;
            self.prefetched[slot] = prefetch;
            self.set_table(gpu, layer, e, slot as u32)?;
            if prefetch {
                self.stats.prefetches += 1;
            } else {
                self.stats.misses += 1;
            }
        }
        Ok(())
    }

    /// Layers and experts per layer.
    pub fn shape(&self) -> (usize, usize) {
        (self.layers, self.experts)
    }
}
