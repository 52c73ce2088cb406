//! Attention on the device: RoPE, the key/value store and attention over each sequence's
//! cache, for a run of positions or the rows of a batched decode step.

use std::sync::Arc;

use crate::backend::{Backend, SeqPos, check_sequence, check_step_rows};
use crate::error::{Error, Result};

use super::super::buffers::GpuAct;
use super::super::context::{Bind, GBuf, Gpu};
use super::super::params::{
    AttentionDecodeParams, AttentionMergeParams, AttentionParams, KvStoreParams, RopeParams,
};
use super::super::shaders::Op;
use super::{GpuBackend, KvPrecision, check_shape};

/// Where the rows of an attention dispatch sit: `rows` rows of the activations from row
/// `row0`, in the cache of sequence `seq` from position `start_pos`.
#[derive(Clone, Copy)]
pub(super) struct Placed {
    pub(super) seq: usize,
    pub(super) row0: usize,
    pub(super) rows: usize,
    pub(super) start_pos: usize,
}

impl GpuBackend {
    /// An error unless keys, values and output fit `rows` query rows.
    pub(super) fn check_attention_shapes(
        &self,
        rows: usize,
        k: &GpuAct,
        v: &GpuAct,
        out: &GpuAct,
    ) -> Result<()> {
        check_shape("attention out", out, rows, self.cfg.q_dim())?;
        check_shape("attention keys", k, rows, self.cfg.kv_dim())?;
        check_shape("attention values", v, rows, self.cfg.kv_dim())
    }

    /// rope.wgsl over `rows` rows of `x` from row `row0`, the first at position `start_pos`
    /// (the caller has checked the positions against the capacity).
    pub(super) fn rope_dispatch(
        &mut self,
        x: &GpuAct,
        row0: usize,
        rows: usize,
        start_pos: usize,
    ) -> Result<()> {
        let d = self.cfg.head_dim;
        if !x.width().is_multiple_of(d) {
            return Err(Error::Backend(format!(
                "rope: width {} is not a multiple of head_dim {d}",
                x.width()
            )));
        }
        let heads = x.width() / d;
        let total = rows * heads * (d / 2);
        let (nx, ny) = self.gpu.grid(total.div_ceil(64) as u64)?;
        let params = RopeParams {
            rows: rows as u32,
            heads: heads as u32,
            head_dim: d as u32,
            start_pos: start_pos as u32,
            width: x.width() as u32,
            total: total as u32,
            nx,
            row0: row0 as u32,
        };
        let v = self.variant(Op::Rope);
        let (c, s) = (self.rope_cos.clone(), self.rope_sin.clone());
        self.gpu.dispatch(Op::Rope, v, &params, &[x.bind(), Bind::whole(&c), Bind::whole(&s)], (nx, ny, 1))
    }

    /// kv_store.wgsl then attention.wgsl for the rows `at` places: their keys and values
    /// into the cache of `at.seq` from position `at.start_pos`, then each query row over its
    /// visible window there (the caller has checked shapes, sequence and capacity).
    pub(super) fn attention_dispatch(
        &mut self,
        layer: usize,
        at: Placed,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        out: &GpuAct,
    ) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let (kc, vc) = self.kv[at.seq][layer].clone();
        // One invocation per cache word: a value (F32) or a pair of values (F16).
        let kv_row = self.kv_row();
        let n = at.rows * kv_row as usize;
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let params = KvStoreParams {
            n: n as u32,
            offset: (at.start_pos * kv_row as usize) as u32,
            nx,
            src: (at.row0 * cfg.kv_dim()) as u32,
            kv_dim: cfg.kv_dim() as u32,
            kv_row,
            _pad: [0; 2],
        };
        let var = self.variant(Op::KvStore);
        let binds = [k.bind(), v.bind(), Bind::whole(&kc), Bind::whole(&vc)];
        self.gpu.dispatch(Op::KvStore, var, &params, &binds, (nx, ny, 1))?;
        let (nx, ny) = self.gpu.grid((at.rows * cfg.num_heads) as u64)?;
        let params = AttentionParams {
            rows: at.rows as u32,
            start_pos: at.start_pos as u32,
            heads: cfg.num_heads as u32,
            head_dim: cfg.head_dim as u32,
            window: cfg.window(layer).unwrap_or(0) as u32,
            q_stride: cfg.q_dim() as u32,
            kv_dim: cfg.kv_dim() as u32,
            group: (cfg.num_heads / cfg.num_kv_heads) as u32,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            nx,
            has_sinks: self.layers[layer].sinks.is_some() as u32,
            row0: at.row0 as u32,
            kv_row,
            _pad: [0; 3],
        };
        let sinks = self.layers[layer].sinks.clone().unwrap_or_else(|| self.gpu.dummy.clone());
        let var = self.variant(Op::Attention);
        let binds = [q.bind(), Bind::whole(&kc), Bind::whole(&vc), Bind::whole(&sinks), out.bind()];
        self.gpu.dispatch(Op::Attention, var, &params, &binds, (nx, ny, 1))
    }

    /// The keys and values sequence `seq`'s cache holds for `layer` at `positions`, as f32
    /// (`[positions, kv_dim]` each; an F16 cache's values widened exactly): what attention
    /// reads (tests and tools). A readback: waits for the recorded work.
    pub fn read_kv_cache(
        &mut self,
        seq: usize,
        layer: usize,
        positions: std::ops::Range<usize>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        check_sequence(seq, self.kv.len())?;
        if layer >= self.cfg.num_layers || positions.start > positions.end || positions.end > self.capacity {
            return Err(Error::Backend(format!(
                "read_kv_cache: layer {layer}, positions {positions:?} are outside the cache ({} layers, {} positions)",
                self.cfg.num_layers, self.capacity
            )));
        }
        if positions.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let (kc, vc) = self.kv[seq][layer].clone();
        let row = self.kv_row() as u64 * 4;
        let (offset, len) = (positions.start as u64 * row, positions.len() as u64 * row);
        let bytes = self.read_back(&[(&kc, offset, len), (&vc, offset, len)])?;
        let kv_dim = self.cfg.kv_dim();
        let decode = |b: &[u8]| -> Vec<f32> {
            let words = super::super::buffers::words(b);
            match self.kv_precision {
                KvPrecision::F32 => words.into_iter().map(f32::from_bits).collect(),
                KvPrecision::F16 => words
                    .chunks(row as usize / 4)
                    .flat_map(|w| {
                        w.iter()
                            .flat_map(|&x| [x as u16, (x >> 16) as u16])
                            .take(kv_dim)
                            .map(|h| half::f16::from_bits(h).to_f32())
                    })
                    .collect(),
            }
        };
        let n = len as usize;
        Ok((decode(&bytes[..n]), decode(&bytes[n..2 * n])))
    }

    pub(super) fn run_rope(&mut self, x: &mut GpuAct, start_pos: usize) -> Result<()> {
        if start_pos + x.rows() > self.capacity {
            return Err(Error::ContextFull { needed: start_pos + x.rows(), capacity: self.capacity });
        }
        self.rope_dispatch(x, 0, x.rows(), start_pos)
    }

    pub(super) fn run_rope_rows(&mut self, x: &mut GpuAct, rows: &[SeqPos]) -> Result<()> {
        check_step_rows(x.rows(), rows, self.kv.len(), self.capacity)?;
        for (i, at) in rows.iter().enumerate() {
            self.rope_dispatch(x, i, 1, at.pos)?;
        }
        Ok(())
    }

    pub(super) fn run_attention(
        &mut self,
        layer: usize,
        start_pos: usize,
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        out: &mut GpuAct,
    ) -> Result<()> {
        let rows = q.rows();
        self.check_attention_shapes(rows, k, v, out)?;
        if start_pos + rows > self.capacity {
            return Err(Error::ContextFull { needed: start_pos + rows, capacity: self.capacity });
        }
        let at = Placed { seq: self.current, row0: 0, rows, start_pos };
        self.attention_dispatch(layer, at, q, k, v, out)
    }

    pub(super) fn run_attention_rows(
        &mut self,
        layer: usize,
        rows: &[SeqPos],
        q: &GpuAct,
        k: &GpuAct,
        v: &GpuAct,
        out: &mut GpuAct,
    ) -> Result<()> {
        self.check_attention_shapes(q.rows(), k, v, out)?;
        check_step_rows(q.rows(), rows, self.kv.len(), self.capacity)?;
        // Each row's store and attention bind its own sequence's cache: two dispatches per
        // row, recorded into the step's one submission (no wait between rows).
        for (i, r) in rows.iter().enumerate() {
            let at = Placed { seq: r.seq, row0: i, rows: 1, start_pos: r.pos };
            self.attention_dispatch(layer, at, q, k, v, out)?;
        }
        Ok(())
    }
}

/// The key/value cache of sequence `seq`: a (keys, values) pair of `layer_bytes` each for
/// every one of `layers` layers (`layer_bytes` from the cache's [`super::KvPrecision`]).
pub(super) fn kv_cache(
    gpu: &mut Gpu,
    seq: usize,
    layers: usize,
    layer_bytes: u64,
) -> Result<Vec<(GBuf, GBuf)>> {
    // COPY_SRC: read back by `GpuBackend::read_kv_cache` (tests and tools).
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
    (0..layers)
        .map(|l| {
            Ok((
                gpu.buffer(&format!("keys {seq}.{l}"), layer_bytes, usage)?,
                gpu.buffer(&format!("values {seq}.{l}"), layer_bytes, usage)?,
            ))
        })
        .collect()
}

/// Keys one split of the fused decode attention covers (a multiple of its 64-key tile),
/// unless the context needs more than [`MAX_SPLITS`] splits.
const SPLIT_KEYS: usize = 128;
/// Most splits of the fused decode attention (its partial buffer is sized for them).
pub(super) const MAX_SPLITS: usize = 256;

/// Bytes of the partial buffer of the fused decode attention for `cfg`, or `None` where its
/// kernel does not take the shape (more than 16 query heads per KV head, more than 2048
/// query values per KV head, head_dim over 256): such a model decodes with the separate
/// kernels.
pub(super) fn decode_partial_bytes(cfg: &crate::config::ModelConfig) -> Option<u64> {
    let kv = cfg.num_kv_heads;
    if kv == 0 || !cfg.num_heads.is_multiple_of(kv) {
        return None;
    }
    let group = cfg.num_heads / kv;
    let d = cfg.head_dim;
    if group == 0 || group > 16 || group * d > 2048 || d > 256 {
        return None;
    }
    Some((kv * MAX_SPLITS * group * (d + 2) * 4) as u64)
}

/// Keys per split and splits for a decode over `keys` visible keys.
fn splits_for(keys: usize) -> (usize, usize) {
    let mut chunk = SPLIT_KEYS;
    if keys.div_ceil(chunk) > MAX_SPLITS {
        chunk = keys.div_ceil(MAX_SPLITS).next_multiple_of(64);
    }
    (chunk, keys.div_ceil(chunk).max(1))
}

impl GpuBackend {
    /// The attention half of decoded tokens' layer in four kernels: the stacked Q/K/V
    /// product of the residual with the attention norm inside it (all rows at once), then per row
    /// attention_decode.wgsl (QK-norm, RoPE, the key/value store and attention over the key
    /// splits, in the row's own sequence's cache at its position) and attention_merge.wgsl,
    /// and the output projection adding itself to the residual. Each row of `x` is one token at
    /// `rows[i]` (sequence, position); the caller has checked them. `false` where the model's
    /// shape has no fused decode attention (then the ops run one by one). A row is computed
    /// the same way whatever the other rows are, so a batched step's rows equal solo runs.
    pub(super) fn run_fused_attention(
        &mut self,
        layer: usize,
        rows: &[SeqPos],
        x: &mut GpuAct,
    ) -> Result<bool> {
        let Some(partial) = self.attn_partial.clone() else {
            return Ok(false);
        };
        let cfg = Arc::clone(&self.cfg);
        let n = x.rows();
        let owner = self.layer(layer)?;
        // The attention norm runs inside the product (matvec NORM variant).
        let qkv = self.qkv_product(&owner, x, Some(&owner.attn_norm))?;
        let attn = self.alloc(n, cfg.q_dim())?;
        let group = cfg.num_heads / cfg.num_kv_heads;
        let dummy = self.gpu.dummy.clone();
        let (c, s) = (self.rope_cos.clone(), self.rope_sin.clone());
        let sinks = owner.sinks.clone().unwrap_or_else(|| dummy.clone());
        let qk_w = owner.qk_w.clone().unwrap_or_else(|| dummy.clone());
        for (row, at) in rows.iter().enumerate() {
            let pos = at.pos;
            let first = cfg.window(layer).map_or(0, |w| (pos + 1).saturating_sub(w));
            let (chunk, splits) = splits_for(pos + 1 - first);
            let (kc, vc) = self.kv[at.seq][layer].clone();
            let (nx, ny) = self.gpu.grid((cfg.num_kv_heads * splits) as u64)?;
            let params = AttentionDecodeParams {
                pos: pos as u32,
                first: first as u32,
                chunk: chunk as u32,
                splits: splits as u32,
                kv_heads: cfg.num_kv_heads as u32,
                head_dim: cfg.head_dim as u32,
                group: group as u32,
                q_dim: cfg.q_dim() as u32,
                kv_dim: cfg.kv_dim() as u32,
                scale: 1.0 / (cfg.head_dim as f32).sqrt(),
                eps: cfg.rms_norm_eps,
                has_qk_norm: owner.qk_w.is_some() as u32,
                nx,
                row: row as u32,
                kv_row: self.kv_row(),
                _pad: [0; 1],
            };
            let binds = [
                qkv.bind(),
                Bind::whole(&kc),
                Bind::whole(&vc),
                Bind::whole(&c),
                Bind::whole(&s),
                Bind::whole(&qk_w),
                Bind::whole(&partial),
            ];
            let v = self.variant(Op::AttentionDecode);
            self.gpu.dispatch(Op::AttentionDecode, v, &params, &binds, (nx, ny, 1))?;

            let (nx, ny) = self.gpu.grid(cfg.num_heads as u64)?;
            let params = AttentionMergeParams {
                heads: cfg.num_heads as u32,
                head_dim: cfg.head_dim as u32,
                group: group as u32,
                splits: splits as u32,
                has_sinks: owner.sinks.is_some() as u32,
                nx,
                row: row as u32,
                _pad: [0; 1],
            };
            let v = self.variant(Op::AttentionMerge);
            let binds = [Bind::whole(&partial), Bind::whole(&sinks), attn.bind()];
            self.gpu.dispatch(Op::AttentionMerge, v, &params, &binds, (nx, ny, 1))?;
        }
        // The output projection adds itself to the residual (matvec ACCUMULATE variant).
        self.matvec_fused(&owner.o.m, owner.o.bias.as_ref(), &attn, x, None, true)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_key_within_the_partial_buffer() {
        for keys in [1, 63, 64, 128, 129, 1000, 32768, 32769, 131072, 1 << 20] {
            let (chunk, splits) = splits_for(keys);
            assert!(splits <= MAX_SPLITS, "{keys}: {splits} splits");
            assert!(chunk % 64 == 0 && chunk * splits >= keys && chunk * (splits - 1) < keys, "{keys}");
        }
    }
}
