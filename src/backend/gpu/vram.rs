//! The VRAM expert cache: expert records in slot pools (a few storage buffers, each within
//! the binding limit), a slot table `(layer, expert) -> slot` on the device that the expert
//! kernels read, and a least-recently-used policy bounded in bytes (`--vram-gb`).
//!
//! When every expert of the model fits, all are uploaded once and the table never changes
//! (full residency: no CPU round trip per layer). Otherwise (partial residency) the cache
//! starts with the learned hot set and, by default ([`MissPolicy::Cpu`]), the backend
//! computes the resident experts on the GPU and the others on the CPU from the RAM tier,
//! while experts the CPU computed often enough are promoted into VRAM in the background
//! (`promote.rs`), taking the place of a less used one (TinyLFU admission: recent use
//! counts, halved now and then). With [`MissPolicy::Upload`] a layer's missing experts are
//! uploaded before it runs instead, evicting the least recently used. A slot holds
//! the bytes of an `experts.bin` record in the record's layout (components on 64-byte
//! boundaries, 4 KiB multiples), for F32, INT4-gs64 and MXFP4 alike; where an expert sits
//! never changes what the kernels compute.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::{MlpKind, ModelConfig};
use crate::error::{Error, Result};
use crate::experts::ExpertSource;
use crate::experts::policy::Popularity;
use crate::model::weights::ExpertWeights;
use crate::quant::{MatrixData, int4, mxfp4};

use super::context::{GBuf, Gpu};
use super::promote::{Promoted, Promoter, Promotion};

/// What the GPU backend does with the experts a layer needs that are not in VRAM
/// (`--expert-misses`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MissPolicy {
    /// Compute them on the CPU from the RAM tier while the GPU computes the resident ones;
    /// only activations cross the bus, and hot experts are promoted into VRAM in the
    /// background. No token waits on an upload.
    #[default]
    Cpu,
    /// Upload them before the layer runs (the layer waits for the host to fetch and copy
    /// them), evicting the least recently used: every expert is computed on the GPU.
    Upload,
}

impl std::fmt::Display for MissPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MissPolicy::Cpu => "cpu",
            MissPolicy::Upload => "upload",
        })
    }
}

/// Requests between halvings of the VRAM cache's use counts, per slot (popularity fades
/// after this many requests a slot).
const POPULARITY_SAMPLE_PER_SLOT: u64 = 8;

/// Table entry of an expert that is not resident.
pub const NO_SLOT: u32 = u32::MAX;
/// Bytes uploaded between waits while filling VRAM (bounds the staging memory).
const UPLOAD_BATCH: u64 = 256 << 20;

/// How expert matrices are stored in a slot: the one description of each expert weight
/// format on the GPU (words per row, scale groups, scale words, shader flag, how a
/// [`MatrixData`] is written). Every match on it is exhaustive, so a new format is a
/// compile error in each place that must handle it, never a fall-through to F32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum SlotFormat {
    /// F32 rows (the portable default kernel build).
    #[default]
    F32,
    /// INT4-gs64 codes and f16 group scales (`src/quant/int4.rs`).
    Int4,
    /// MXFP4 as released: E2M1 codes (low nibble = even element) and one E8M0 scale byte
    /// per block of 32 (`src/quant/mxfp4.rs`).
    Mxfp4,
}

impl SlotFormat {
    /// Every slot format (the expert kernel variants built for each).
    pub const ALL: [SlotFormat; 3] = [SlotFormat::F32, SlotFormat::Int4, SlotFormat::Mxfp4];

    /// The slot format for expert matrices stored as `data`, or an error naming `what` for
    /// formats the expert kernels do not read.
    pub fn of(data: &MatrixData, what: &str) -> Result<SlotFormat> {
        match data {
            MatrixData::F32(_) => Ok(SlotFormat::F32),
            MatrixData::Int4G64 { .. } => Ok(SlotFormat::Int4),
            MatrixData::Mxfp4 { .. } => Ok(SlotFormat::Mxfp4),
            MatrixData::Bf16(_) | MatrixData::Int8Rows { .. } => Err(Error::Backend(format!(
                "{what}: experts stored as {} have no VRAM slot format (F32, INT4-gs64 or MXFP4)",
                data.format_name()
            ))),
        }
    }

    /// The preprocessor flag of the expert kernels' variant for this format (`None`: the
    /// default branch, F32).
    pub fn flag(self) -> Option<&'static str> {
        match self {
            SlotFormat::F32 => None,
            SlotFormat::Int4 => Some("INT4"),
            SlotFormat::Mxfp4 => Some("MXFP4"),
        }
    }

    /// Short name for variant labels.
    pub fn label(self) -> &'static str {
        match self {
            SlotFormat::F32 => "f32",
            SlotFormat::Int4 => "int4",
            SlotFormat::Mxfp4 => "mxfp4",
        }
    }

    /// `(words per row, scale groups per row)` of a matrix row of `cols` inputs.
    fn row_shape(self, cols: usize) -> Result<(usize, usize)> {
        match self {
            SlotFormat::F32 => Ok((cols, 0)),
            SlotFormat::Int4 => Ok((int4::row_bytes(cols) / 4, int4::groups(cols))),
            SlotFormat::Mxfp4 => {
                if !cols.is_multiple_of(mxfp4::BLOCK) {
                    return Err(Error::Backend(format!(
                        "MXFP4 expert rows of {cols} inputs are not whole blocks of {}",
                        mxfp4::BLOCK
                    )));
                }
                Ok((mxfp4::row_bytes(cols) / 4, mxfp4::blocks(cols)))
            }
        }
    }

    /// Bytes of `n` scales (f16 for INT4, one byte for MXFP4).
    fn scale_bytes(self, n: usize) -> usize {
        match self {
            SlotFormat::F32 => 0,
            SlotFormat::Int4 => 2 * n,
            SlotFormat::Mxfp4 => n,
        }
    }
}

/// Alignment of each component in a slot, in words: 64 bytes, as in an `experts.bin` record.
const COMPONENT_WORDS: usize = 16;
/// Slots are whole multiples of 4 KiB, as `experts.bin` records are.
const STRIDE_WORDS: usize = 1024;

/// Where an expert's components sit inside its slot, in u32 words.
///
/// The layout is the container's record layout (docs/format.md): gate_up codes, scales,
/// bias, then down codes, scales, bias, each starting on a 64-byte boundary, the slot padded
/// to a multiple of 4 KiB. So a slot holds exactly the bytes of the expert's record, for
/// every format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    /// Matrix format.
    pub format: SlotFormat,
    /// Gate/up codes or values.
    pub gu_w: u32,
    /// Gate/up scales (INT4, MXFP4).
    pub gu_s: u32,
    /// Gate/up bias.
    pub gu_b: u32,
    /// Down codes or values.
    pub dn_w: u32,
    /// Down scales (INT4, MXFP4).
    pub dn_s: u32,
    /// Down bias.
    pub dn_b: u32,
    /// Words per gate/up row.
    pub gu_row_words: u32,
    /// Scale groups (INT4) or blocks (MXFP4) per gate/up row.
    pub gu_groups: u32,
    /// Words per down row.
    pub dn_row_words: u32,
    /// Scale groups or blocks per down row.
    pub dn_groups: u32,
    /// Words between slots (a multiple of 1024: 4 KiB).
    pub stride: u32,
}

impl SlotLayout {
    /// The layout for a model's experts in `format`. Fails for shapes the format cannot
    /// store (MXFP4 rows that are not whole blocks) or slots beyond 32-bit word offsets.
    pub fn new(cfg: &ModelConfig, format: SlotFormat) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (gu_row_words, gu_groups) = format.row_shape(h)?;
        let (dn_row_words, dn_groups) = format.row_shape(i)?;
        let too_big = || {
            Error::Backend(format!("an expert of hidden {h}, intermediate {i} is too large for a VRAM slot"))
        };
        let mut at = 0usize;
        let mut take = |bytes: Option<usize>| -> Result<usize> {
            let words = bytes.ok_or_else(too_big)?.div_ceil(4);
            let start = at;
            at = start
                .checked_add(words)
                .and_then(|e| e.checked_next_multiple_of(COMPONENT_WORDS))
                .ok_or_else(too_big)?;
            Ok(start)
        };
        let rows_gu = 2usize.checked_mul(i).ok_or_else(too_big)?;
        let gu_w = take(rows_gu.checked_mul(gu_row_words).and_then(|w| w.checked_mul(4)))?;
        let gu_s = take(rows_gu.checked_mul(gu_groups).map(|n| format.scale_bytes(n)))?;
        let gu_b = take(rows_gu.checked_mul(4))?;
        let dn_w = take(h.checked_mul(dn_row_words).and_then(|w| w.checked_mul(4)))?;
        let dn_s = take(h.checked_mul(dn_groups).map(|n| format.scale_bytes(n)))?;
        let dn_b = take(h.checked_mul(4))?;
        let stride = at.checked_next_multiple_of(STRIDE_WORDS).ok_or_else(too_big)?;
        let word = |v: usize| u32::try_from(v).map_err(|_| too_big());
        Ok(SlotLayout {
            format,
            gu_w: word(gu_w)?,
            gu_s: word(gu_s)?,
            gu_b: word(gu_b)?,
            dn_w: word(dn_w)?,
            dn_s: word(dn_s)?,
            dn_b: word(dn_b)?,
            gu_row_words: word(gu_row_words)?,
            gu_groups: word(gu_groups)?,
            dn_row_words: word(dn_row_words)?,
            dn_groups: word(dn_groups)?,
            stride: word(stride)?,
        })
    }

    /// Bytes of one slot.
    pub fn bytes(&self) -> u64 {
        self.stride as u64 * 4
    }

    /// Writes `w` into `out` (one slot, zeroed by the caller): each component copied as it
    /// is stored, to its offset.
    pub fn encode(&self, w: &ExpertWeights, out: &mut [u8], what: &str) -> Result<()> {
        fn put(out: &mut [u8], word: u32, bytes: &[u8], what: &str) -> Result<()> {
            let at = word as usize * 4;
            let dst = out.get_mut(at..at + bytes.len()).ok_or_else(|| {
                Error::Backend(format!("{what}: a component of {} bytes overruns its VRAM slot", bytes.len()))
            })?;
            dst.copy_from_slice(bytes);
            Ok(())
        }
        let bad = || {
            Error::Backend(format!(
                "{what}: experts stored as {}/{} cannot go in {:?} VRAM slots",
                w.gate_up.format_name(),
                w.down.format_name(),
                self.format
            ))
        };
        let parts: [&[u8]; 4] = match self.format {
            SlotFormat::F32 => match (&w.gate_up.data, &w.down.data) {
                (MatrixData::F32(g), MatrixData::F32(d)) => {
                    [bytemuck::cast_slice(g.as_slice()), &[], bytemuck::cast_slice(d.as_slice()), &[]]
                }
                _ => return Err(bad()),
            },
            SlotFormat::Int4 => match (&w.gate_up.data, &w.down.data) {
                (
                    MatrixData::Int4G64 { codes: gc, scales: gs },
                    MatrixData::Int4G64 { codes: dc, scales: ds },
                ) => [
                    gc.as_slice(),
                    bytemuck::cast_slice(gs.as_slice()),
                    dc.as_slice(),
                    bytemuck::cast_slice(ds.as_slice()),
                ],
                _ => return Err(bad()),
            },
            SlotFormat::Mxfp4 => match (&w.gate_up.data, &w.down.data) {
                (
                    MatrixData::Mxfp4 { codes: gc, scales: gs },
                    MatrixData::Mxfp4 { codes: dc, scales: ds },
                ) => [gc.as_slice(), gs.as_slice(), dc.as_slice(), ds.as_slice()],
                _ => return Err(bad()),
            },
        };
        let [gw, gs, dw, ds] = parts;
        put(out, self.gu_w, gw, what)?;
        put(out, self.gu_s, gs, what)?;
        put(out, self.gu_b, bytemuck::cast_slice(&w.gate_up_bias), what)?;
        put(out, self.dn_w, dw, what)?;
        put(out, self.dn_s, ds, what)?;
        put(out, self.dn_b, bytemuck::cast_slice(&w.down_bias), what)?;
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
    /// Experts promoted into VRAM in the background (written; included in `uploads`).
    pub promotions: u64,
    /// Experts preloaded at start from the learned hot set.
    pub hot_set: u64,
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
    /// Slots a background promotion is writing (free, but not to be handed out).
    filling: Vec<bool>,
    /// Recent use counts of every `(layer, expert)` (index `layer * experts + expert`).
    popularity: Popularity,
    promoter: Option<Promoter>,
    clock: u64,
    scratch: Vec<u8>,
    /// Counters.
    pub stats: VramStats,
}

impl VramExperts {
    /// A cache of at most `budget` bytes (at least one token's experts of a layer; at most
    /// every expert of the model's MoE layers, in which case all are uploaded now). Dense
    /// MLP layers (`MlpKind::Dense`) have no experts: their table entries stay empty.
    pub fn new(
        gpu: &mut Gpu,
        cfg: &ModelConfig,
        source: &Arc<dyn ExpertSource>,
        budget: u64,
    ) -> Result<Self> {
        let moe_layers: Vec<usize> =
            (0..cfg.num_layers).filter(|&l| cfg.mlp_kinds[l] == MlpKind::Moe).collect();
        let Some(&first_moe) = moe_layers.first() else {
            return Err(Error::Backend(
                "the model has no MoE layer: the GPU backend needs at least one layer of experts".into(),
            ));
        };
        let hot = source.hot_experts(moe_layers.len() * cfg.num_experts);
        // A probe of the format, not a use.
        let probe = source.preload(first_moe, &[0])?.remove(0);
        let format = SlotFormat::of(&probe.gate_up.data, &format!("layer {first_moe} expert 0"))?;
        let layout = SlotLayout::new(cfg, format)?;
        let total = moe_layers.len() * cfg.num_experts;
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
        // Full residency: the experts of the n-th MoE layer fill slots n * experts.. in order.
        let mut table_words = vec![NO_SLOT; cfg.num_layers * cfg.num_experts];
        if full {
            for (n, &l) in moe_layers.iter().enumerate() {
                for e in 0..cfg.num_experts {
                    table_words[l * cfg.num_experts + e] = (n * cfg.num_experts + e) as u32;
                }
            }
        }
        let table = gpu.buffer_init("expert slot table", bytemuck::cast_slice(&table_words))?;
        let mut v = VramExperts {
            layout,
            layers: moe_layers.len(),
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
            filling: vec![false; slots],
            popularity: Popularity::new(
                cfg.num_layers * cfg.num_experts,
                POPULARITY_SAMPLE_PER_SLOT.saturating_mul(slots as u64),
            ),
            promoter: None,
            clock: 0,
            scratch: vec![0; layout.bytes() as usize],
            stats: VramStats::default(),
        };
        if full {
            let mut since_sync = 0;
            for &l in &moe_layers {
                let ids: Vec<usize> = (0..cfg.num_experts).collect();
                let weights = source.preload(l, &ids)?;
                for (e, w) in weights.iter().enumerate() {
                    let slot = table_words[l * cfg.num_experts + e] as usize;
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
        } else {
            v.load_hot_set(gpu, cfg, source, &hot)?;
        }
        Ok(v)
    }

    /// Fills the slots with `hot`, the learned hot set of the expert source (the most used
    /// experts of earlier sessions, most used first; MoE layers only), at load.
    fn load_hot_set(
        &mut self,
        gpu: &mut Gpu,
        cfg: &ModelConfig,
        source: &Arc<dyn ExpertSource>,
        hot: &[(usize, usize)],
    ) -> Result<()> {
        let hot: Vec<(usize, usize)> = hot
            .iter()
            .copied()
            .filter(|&(l, e)| l < cfg.num_layers && cfg.mlp_kinds[l] == MlpKind::Moe && e < cfg.num_experts)
            .take(self.slots)
            .collect();
        let mut since_sync = 0;
        for (slot, &(l, e)) in hot.iter().enumerate() {
            let w = source.preload(l, &[e])?.remove(0);
            self.upload(gpu, slot, &w, &format!("layer {l} expert {e}"))?;
            self.owner[slot] = Some((l, e));
            self.map.insert((l, e), slot);
            self.set_table(gpu, l, e, slot as u32)?;
            since_sync += self.layout.bytes();
            if since_sync >= UPLOAD_BATCH {
                gpu.sync()?;
                since_sync = 0;
            }
        }
        self.stats.hot_set = hot.len() as u64;
        gpu.sync()
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

    /// A free slot (not being filled), or the least recently used one not in `keep`.
    fn victim(&self, keep: &HashSet<(usize, usize)>) -> Option<usize> {
        if let Some(free) = self.free_slot() {
            return Some(free);
        }
        (0..self.slots)
            .filter(|&s| self.owner[s].is_some_and(|o| !keep.contains(&o)))
            .min_by_key(|&s| (self.last_use[s], s))
    }

    /// A slot that holds nothing and is not being filled.
    fn free_slot(&self) -> Option<usize> {
        (0..self.slots).find(|&s| self.owner[s].is_none() && !self.filling[s])
    }

    fn index(&self, layer: usize, expert: usize) -> usize {
        layer * self.experts + expert
    }

    /// Splits the experts `layer` needs (`needed`, distinct) into those resident now and
    /// those to compute on the host, counting each request's use ([`MissPolicy::Cpu`]).
    pub fn split(&mut self, layer: usize, needed: &[usize]) -> (Vec<usize>, Vec<usize>) {
        self.clock += 1;
        let (mut resident, mut host) = (Vec::new(), Vec::new());
        for &e in needed {
            let i = self.index(layer, e);
            self.popularity.record(i);
            match self.map.get(&(layer, e)) {
                Some(&slot) => {
                    self.last_use[slot] = self.clock;
                    self.stats.hits += 1;
                    resident.push(e);
                }
                None => host.push(e),
            }
        }
        (resident, host)
    }

    /// Starts promoting `weights`, expert `expert` of `layer` (just computed on the host),
    /// into VRAM in the background when a slot is free, or when it has been used more
    /// lately than the least used resident expert, which it then replaces (that one's
    /// table entry is cleared now, so no kernel recorded from here on reads the slot).
    /// Returns whether it was queued. Never waits: with [`super::promote::IN_FLIGHT`]
    /// promotions outstanding (after taking in those already written) it declines.
    pub fn promote(
        &mut self,
        gpu: &mut Gpu,
        layer: usize,
        expert: usize,
        weights: Arc<ExpertWeights>,
    ) -> Result<bool> {
        if self.full || self.map.contains_key(&(layer, expert)) {
            return Ok(false);
        }
        if self.promoter.is_none() {
            self.promoter = Some(Promoter::start(gpu.queue.clone(), self.layout)?);
        }
        if !self.promoter.as_ref().is_some_and(Promoter::has_room) {
            // Those written since the last look free their place in the ring (no wait).
            self.finish_promotions(gpu)?;
            if !self.promoter.as_ref().is_some_and(Promoter::has_room) {
                return Ok(false);
            }
        }
        let heat = self.popularity.of(self.index(layer, expert));
        let slot = match self.free_slot() {
            Some(s) => s,
            None => {
                let coldest = (0..self.slots)
                    .filter_map(|s| self.owner[s].map(|(l, e)| (s, self.popularity.of(self.index(l, e)))))
                    .min_by_key(|&(s, pop)| (pop, self.last_use[s], s));
                match coldest {
                    Some((s, pop)) if pop < heat => s,
                    _ => return Ok(false),
                }
            }
        };
        if let Some(old) = self.owner[slot].take() {
            self.map.remove(&old);
            self.set_table(gpu, old.0, old.1, NO_SLOT)?;
            self.stats.evictions += 1;
        }
        self.filling[slot] = true;
        let pool = self.pools[slot / self.slots_per_pool].buf.clone();
        let offset = (slot % self.slots_per_pool) as u64 * self.layout.bytes();
        let job = Promotion { key: (layer, expert), weights, slot, pool, offset };
        if let Some(p) = self.promoter.as_mut() {
            p.send(job)?;
        }
        Ok(true)
    }

    /// Makes the promotions written since the last call visible to the kernels: each
    /// slot's table entry is set (the write lands before the next submission, after the
    /// slot's bytes). Never waits.
    pub fn finish_promotions(&mut self, gpu: &mut Gpu) -> Result<()> {
        let done = match self.promoter.as_mut() {
            Some(p) => p.finished(),
            None => return Ok(()),
        };
        self.settle(gpu, done)
    }

    /// Waits for every promotion in flight and makes them visible (tests, and before a
    /// statistic that counts them).
    pub fn drain_promotions(&mut self, gpu: &mut Gpu) -> Result<()> {
        let done = match self.promoter.as_mut() {
            Some(p) => p.drain(),
            None => return Ok(()),
        };
        self.settle(gpu, done)
    }

    fn settle(&mut self, gpu: &mut Gpu, done: Vec<Promoted>) -> Result<()> {
        for Promoted { key: (l, e), slot, result } in done {
            self.filling[slot] = false;
            match result {
                Ok(()) => {
                    self.owner[slot] = Some((l, e));
                    self.map.insert((l, e), slot);
                    self.last_use[slot] = self.clock;
                    self.set_table(gpu, l, e, slot as u32)?;
                    gpu.count_upload(self.layout.bytes());
                    self.stats.uploads += 1;
                    self.stats.promotions += 1;
                    self.stats.bytes += self.layout.bytes();
                }
                Err(err) => tracing::warn!("layer {l} expert {e} not promoted into VRAM: {err}"),
            }
        }
        Ok(())
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

    /// MoE layers and experts per layer (their product: the model's experts).
    pub fn shape(&self) -> (usize, usize) {
        (self.layers, self.experts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_slots_follow_the_container_record() {
        let json = r#"{"model_type": "gpt_oss", "hidden_size": 96, "intermediate_size": 160,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "num_local_experts": 2, "num_experts_per_tok": 1, "vocab_size": 10,
            "layer_types": ["full_attention"]}"#;
        let cfg = ModelConfig::from_json_str(json, std::path::Path::new("t.json")).unwrap();
        let l = SlotLayout::new(&cfg, SlotFormat::Mxfp4).unwrap();
        // gate_up codes [320, 48] bytes, scales [320, 3], bias [320] f32, down codes
        // [96, 80], scales [96, 5], bias [96] f32: each on a 64-byte boundary.
        let at = |bytes: usize| bytes.next_multiple_of(64) / 4;
        let gu_s = at(320 * 48);
        let gu_b = gu_s + at(320 * 3);
        let dn_w = gu_b + at(320 * 4);
        let dn_s = dn_w + at(96 * 80);
        let dn_b = dn_s + at(96 * 5);
        assert_eq!(
            (l.gu_w, l.gu_s, l.gu_b, l.dn_w, l.dn_s, l.dn_b),
            (0, gu_s as u32, gu_b as u32, dn_w as u32, dn_s as u32, dn_b as u32)
        );
        assert_eq!((l.gu_row_words, l.gu_groups, l.dn_row_words, l.dn_groups), (12, 3, 20, 5));
        assert_eq!(l.bytes() % 4096, 0);
        assert!(l.bytes() >= (dn_b as u64 + 96) * 4 && l.bytes() < (dn_b as u64 + 96) * 4 + 4096);
        // Rows that are not whole blocks are refused, not truncated.
        let bad = json.replace("\"hidden_size\": 96", "\"hidden_size\": 100");
        let cfg = ModelConfig::from_json_str(&bad, std::path::Path::new("t.json")).unwrap();
        assert!(SlotLayout::new(&cfg, SlotFormat::Mxfp4).is_err());
        assert!(SlotLayout::new(&cfg, SlotFormat::Int4).is_ok());
    }
}
