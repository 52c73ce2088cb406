//! Measurements for `picchio bench`: the memory-copy bandwidth of this machine (the floor
//! every weight-streaming kernel is compared with) and the weight bytes one decoded token
//! must touch.

use std::time::Instant;

use rayon::prelude::*;

use crate::config::MlpKind;
use crate::engine::LoadedModel;
use crate::model::weights::FeedForward;

/// Bytes per second of a parallel memory copy of `bytes` bytes (best of `reps` runs),
/// counting each byte once (as a weight-streaming kernel reads each weight once).
pub fn copy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(rayon::current_num_threads().max(1)).max(4096);
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    bytes as f64 / best
}

/// Bytes per second of a parallel read of `bytes` bytes (a streaming sum; best of `reps`):
/// what a kernel that only reads its weights can reach at most.
pub fn read_bandwidth(bytes: usize, reps: usize) -> f64 {
    let src: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let chunk = src.len().div_ceil(rayon::current_num_threads().max(1)).max(512);
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        let sum: u64 = src.par_chunks(chunk).map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b))).sum();
        std::hint::black_box(sum);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    (src.len() * 8) as f64 / best
}

/// Read bandwidth of `path` in bytes per second: `streams` threads each read a contiguous
/// part of up to `bytes` bytes sequentially in 8 MiB requests (the queue depth the expert
/// readers use), bypassing the page cache where the platform allows (so a cached file does
/// not pass for a fast disk). Returns the bandwidth and whether the reads were direct.
pub fn disk_read_bandwidth(
    path: &std::path::Path,
    bytes: u64,
    streams: usize,
) -> crate::error::Result<(f64, bool)> {
    use crate::error::Error;
    use crate::quant::buffer::AlignedBytes;
    const REQUEST: u64 = 8 << 20;
    let len = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    let streams = streams.max(1) as u64;
    let per_stream = bytes.min(len) / streams / REQUEST * REQUEST;
    if per_stream == 0 {
        return Ok((0.0, false));
    }
    let (file, direct) = match crate::experts::store::open_direct(path) {
        Ok(f) => (f, true),
        Err(_) => (std::fs::File::open(path).map_err(|e| Error::io(path, e))?, false),
    };
    let t0 = Instant::now();
    std::thread::scope(|s| -> crate::error::Result<()> {
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                let file = &file;
                s.spawn(move || -> std::io::Result<()> {
                    let mut buf = AlignedBytes::zeroed(REQUEST as usize);
                    let mut off = i * per_stream;
                    while off < (i + 1) * per_stream {
                        crate::io::read_exact_at(file, buf.as_mut_slice(), off)?;
                        off += REQUEST;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| Error::invalid("a disk benchmark thread panicked"))?
                .map_err(|e| Error::io(path, e))?;
        }
        Ok(())
    })?;
    Ok(((per_stream * streams) as f64 / t0.elapsed().as_secs_f64(), direct))
}

/// Weight bytes a decoded token reads: every attention and router matrix, the dense MLPs,
/// the output head, one embedding row, and `experts_per_token` experts in every MoE layer.
pub fn decode_bytes_per_token(model: &LoadedModel, expert_bytes: u64) -> u64 {
    let cfg = &model.config;
    let d = &model.dense;
    let mut bytes = d.lm_head.byte_len() as u64 + (d.embed.byte_len() / cfg.vocab_size) as u64;
    for l in &d.layers {
        for m in [&l.attn.q, &l.attn.k, &l.attn.v, &l.attn.o].into_iter().chain(l.router()) {
            bytes += m.weight.byte_len() as u64 + 4 * m.bias.as_ref().map_or(0, Vec::len) as u64;
        }
        if let FeedForward::Dense(w) = &l.ffn {
            bytes += w.byte_len() as u64;
        }
    }
    let moe_layers = cfg.mlp_kinds.iter().filter(|&&k| k == MlpKind::Moe).count();
    bytes + expert_bytes * (moe_layers * cfg.experts_per_token) as u64
}

/// Deterministic pseudo-random token IDs below `vocab`.
pub fn prompt_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed ^ 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_ids_are_in_range_and_repeatable() {
        let a = prompt_ids(100, 1000, 7);
        assert_eq!(a, prompt_ids(100, 1000, 7));
        assert!(a.iter().all(|&i| i < 1000));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 50);
    }

    #[test]
    fn copy_bandwidth_is_positive() {
        assert!(copy_bandwidth(1 << 20, 2) > 0.0);
    }
}
