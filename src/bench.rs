//! Measurements for `picchio bench`: the memory-copy bandwidth of this machine (the floor
//! every weight-streaming kernel is compared with) and the weight bytes one decoded token
//! must touch.

use std::time::Instant;

use rayon::prelude::*;

use crate::config::MlpKind;
use crate::engine::LoadedModel;
use crate::model::weights::FeedForward;
use crate::quant::buffer::{AlignedBytes, ByteRegion};

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
///
/// The bytes lie where weights lie ([`AlignedBytes`]: transparent huge pages where the kernel
/// gives them, as the expert buffers do) and are summed with the widest vector loads this CPU
/// has, in independent chains ([`stream_sum`]). A plain `Vec` of 4 KiB pages summed with the
/// baseline's 128-bit loads measured 21.7 (1 thread) and 33.9 GB/s (2) on the 2-core Zen 5 VM
/// where this reached 37.0 and 44.2: a floor below what the memory gives, so a kernel could
/// be "under its floor".
pub fn read_bandwidth(bytes: usize, reps: usize) -> f64 {
    let mut buf = AlignedBytes::zeroed(bytes.next_multiple_of(STREAM_CHUNK));
    // Written once, so every page is the buffer's own (untouched, they would all read the
    // kernel's one shared zero page, from the cache).
    buf.as_mut_slice().fill(1);
    let src = buf.bytes();
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        std::hint::black_box(parallel_stream_sum(src));
        best = best.min(t0.elapsed().as_secs_f64());
    }
    src.len() as f64 / best
}

/// Bytes [`stream_sum`] takes a step: four 64-byte vectors.
const STREAM_CHUNK: usize = 256;

/// [`stream_sum`] of `bytes` split evenly over the current rayon pool: the read that
/// [`read_bandwidth`] times, public so that `benches/kernels` compares each kernel with a pure
/// read of the same bytes.
pub fn parallel_stream_sum(bytes: &[u8]) -> u64 {
    let chunk = bytes.len().div_ceil(rayon::current_num_threads().max(1)).next_multiple_of(STREAM_CHUNK);
    bytes.par_chunks(chunk.max(STREAM_CHUNK)).map(stream_sum).reduce(|| 0, u64::wrapping_add)
}

/// The wrapping sum of `bytes` as little-endian `u64`s (whole [`STREAM_CHUNK`]s; the rest is
/// ignored): a read of every byte with the widest loads this CPU has, in four independent
/// chains, each line asked for [`crate::quant::kernels::STREAM_AHEAD_BYTES`] ahead as the
/// one-input kernels ask for theirs, and nothing else.
fn stream_sum(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { stream_sum_avx512(bytes) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { stream_sum_avx2(bytes) };
        }
    }
    stream_sum_portable(bytes)
}

/// [`stream_sum`] in plain Rust: 16 `u64` chains, which the compiler turns into the baseline's
/// vectors (NEON's 128 bits on aarch64, its full width).
#[inline(always)]
fn stream_sum_portable(bytes: &[u8]) -> u64 {
    let mut acc = [0u64; 16];
    for step in bytes.as_chunks::<128>().0 {
        for (a, w) in acc.iter_mut().zip(step.as_chunks::<8>().0) {
            *a = a.wrapping_add(u64::from_le_bytes(*w));
        }
    }
    acc.iter().fold(0, |s, &a| s.wrapping_add(a))
}

/// [`stream_sum`] with 512-bit loads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn stream_sum_avx512(bytes: &[u8]) -> u64 {
    use crate::quant::kernels::STREAM_AHEAD_BYTES;
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    for step in bytes.as_chunks::<STREAM_CHUNK>().0 {
        for (k, a) in acc.iter_mut().enumerate() {
            let line = step.as_ptr().wrapping_add(64 * k);
            // A hint: never dereferenced, never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T1>(line.wrapping_add(STREAM_AHEAD_BYTES).cast());
            // SAFETY: bytes `64 k .. 64 k + 64` of the step are readable; unaligned loads are allowed.
            let v = unsafe { _mm512_loadu_si512(line.cast()) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let s = _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
    _mm512_reduce_add_epi64(s) as u64
}

/// [`stream_sum`] with 256-bit loads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn stream_sum_avx2(bytes: &[u8]) -> u64 {
    use crate::quant::kernels::STREAM_AHEAD_BYTES;
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    for step in bytes.as_chunks::<128>().0 {
        for line in [0, 64] {
            let ahead = step.as_ptr().wrapping_add(STREAM_AHEAD_BYTES + line);
            // A hint: never dereferenced, never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T1>(ahead.cast());
        }
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: bytes `32 k .. 32 k + 32` of the step are readable; unaligned loads are allowed.
            let v = unsafe { _mm256_loadu_si256(step.as_ptr().add(32 * k).cast()) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let s = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` is 32 writable bytes; unaligned stores are allowed.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
    lanes.iter().fold(0, |a, &b| a.wrapping_add(b))
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
        join_readers(handles, path)
    })?;
    Ok(((per_stream * streams) as f64 / t0.elapsed().as_secs_f64(), direct))
}

/// Waits for the reader threads of a disk measurement; the first failure names `path`.
fn join_readers(
    handles: Vec<std::thread::ScopedJoinHandle<'_, std::io::Result<()>>>,
    path: &std::path::Path,
) -> crate::error::Result<()> {
    use crate::error::Error;
    for h in handles {
        h.join()
            .map_err(|_| Error::invalid("a disk benchmark thread panicked"))?
            .map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// What [`disk_record_bandwidth`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecordReadSpeed {
    /// Bytes per second over the whole measurement (0 when nothing was read).
    pub bytes_per_s: f64,
    /// Bytes read, counted as each request completes.
    pub bytes: u64,
    /// Records read.
    pub records: usize,
    /// Read requests issued (the records' pieces).
    pub requests: usize,
    /// Whether the reads bypassed the page cache.
    pub direct: bool,
}

/// The requests [`disk_record_bandwidth`] issues, as `(offset, length)` in issue order: the
/// records of `record_bytes` bytes at `offsets`, as many whole records as `budget` bytes
/// hold (at least one, at most all), in a pseudo-random order fixed by `seed`, each split
/// into pieces of at most `piece` bytes.
pub fn record_read_plan(
    offsets: &[u64],
    record_bytes: u64,
    budget: u64,
    piece: u64,
    seed: u64,
) -> Vec<(u64, u64)> {
    if offsets.is_empty() || record_bytes == 0 || piece == 0 {
        return Vec::new();
    }
    let take = usize::try_from(budget / record_bytes).unwrap_or(usize::MAX).clamp(1, offsets.len());
    // A partial Fisher-Yates shuffle (xorshift64) picks `take` distinct records.
    let mut order: Vec<u64> = offsets.to_vec();
    let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
    for i in 0..take {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let j = i + (s % (order.len() - i) as u64) as usize;
        order.swap(i, j);
    }
    let mut plan = Vec::new();
    for &start in &order[..take] {
        let mut done = 0;
        while done < record_bytes {
            let n = piece.min(record_bytes - done);
            plan.push((start + done, n));
            done += n;
        }
    }
    plan
}

/// Bytes of memory [`disk_record_bandwidth`] reads into, in 2 MiB slots taken in turn. Where
/// the data lands matters on a VM: on the Intel Xeon VM of docs/perf.md (2026-12-07,
/// `benches/regime/disk_probe.c`) four readers of the same records got 2.8-3.0 GB/s into one
/// reused 2 MiB buffer each, 2.9-3.0 into 8 MiB of slots in turn, and 2.1-2.2 into 32 MiB to
/// 1.5 GiB of them, which is where a cache's reads land (the engine's reads ran at 1.9-2.2
/// GB/s while busy). 64 MiB is past that threshold and small next to a cache's budget.
pub const READ_DESTINATION_BYTES: usize = 64 << 20;

/// Read bandwidth of `path` measured the way the expert readers read it: whole records of
/// `record_bytes` bytes at `offsets` (a container's records), about `budget` bytes of them
/// taken in a pseudo-random order ([`record_read_plan`], fixed `seed`), each split into
/// [`HASHED_READ_CHUNK`](crate::experts::store::HASHED_READ_CHUNK) pieces, `readers` threads
/// each pulling the next piece from one shared counter, so a record's pieces are read by
/// several threads at once, each into the next of its slots of [`READ_DESTINATION_BYTES`]
/// of memory (as the cache's buffers take the reads). Direct I/O where the platform and file
/// system allow (offsets and `record_bytes` are multiples of 4 KiB in a container). A record
/// past the end of the file, or a failed read, is an error naming the file.
pub fn disk_record_bandwidth(
    path: &std::path::Path,
    offsets: &[u64],
    record_bytes: u64,
    budget: u64,
    readers: usize,
    seed: u64,
) -> crate::error::Result<RecordReadSpeed> {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    use crate::error::Error;
    use crate::quant::buffer::AlignedBytes;
    let piece = crate::experts::store::HASHED_READ_CHUNK as u64;
    let len = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    let plan = record_read_plan(offsets, record_bytes, budget, piece, seed);
    let records = plan.len().div_ceil(record_bytes.div_ceil(piece).max(1) as usize);
    if let Some(&(at, n)) = plan.iter().find(|&&(at, n)| at.checked_add(n).is_none_or(|end| end > len)) {
        return Err(Error::format(
            path,
            format!("a record piece of {n} bytes at offset {at} runs past the end of the file ({len} bytes)"),
        ));
    }
    let (file, direct) = match crate::experts::store::open_direct(path) {
        Ok(f) => (f, true),
        Err(_) => (std::fs::File::open(path).map_err(|e| Error::io(path, e))?, false),
    };
    let readers = readers.clamp(1, plan.len().max(1));
    // Each reader reads into its own slots of one region, the next slot every time, touched
    // before the timing: as the cache's record buffers are filled, every read lands in other
    // memory than the reads just before it.
    let piece_len = piece as usize;
    let slots = (READ_DESTINATION_BYTES / piece_len / readers).max(2);
    let mut destination = AlignedBytes::zeroed(slots * readers * piece_len);
    destination.as_mut_slice().fill(1);
    let (next, read) = (AtomicUsize::new(0), AtomicU64::new(0));
    let t0 = Instant::now();
    std::thread::scope(|s| -> crate::error::Result<()> {
        let handles: Vec<_> = destination
            .as_mut_slice()
            .chunks_exact_mut(slots * piece_len)
            .map(|own| {
                let (file, plan, next, read) = (&file, &plan, &next, &read);
                s.spawn(move || -> std::io::Result<()> {
                    for k in 0.. {
                        let Some(&(at, n)) = plan.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            break;
                        };
                        let slot = &mut own[(k % slots) * piece_len..][..n as usize];
                        crate::io::read_exact_at(file, slot, at)?;
                        read.fetch_add(n, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        join_readers(handles, path)
    })?;
    let secs = t0.elapsed().as_secs_f64();
    let bytes = read.into_inner();
    let bytes_per_s = if bytes == 0 { 0.0 } else { bytes as f64 / secs.max(1e-9) };
    Ok(RecordReadSpeed { bytes_per_s, bytes, records, requests: plan.len(), direct })
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

    /// A temporary file of `records` records of `record_bytes` bytes (plus a 4 KiB header, so
    /// that offsets do not start at 0) and the records' offsets.
    fn record_file(records: u64, record_bytes: u64) -> (tempfile::NamedTempFile, Vec<u64>) {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(4096 + records * record_bytes).unwrap();
        (f, (0..records).map(|r| 4096 + r * record_bytes).collect())
    }

    #[test]
    fn the_record_plan_covers_each_chosen_record_once_in_pieces() {
        let piece = crate::experts::store::HASHED_READ_CHUNK as u64;
        let record = 2 * piece + 12288;
        let offsets: Vec<u64> = (0..10).map(|r| r * record).collect();
        let plan = record_read_plan(&offsets, record, 4 * record + 1, piece, 3);
        assert_eq!(plan, record_read_plan(&offsets, record, 4 * record + 1, piece, 3), "deterministic");
        assert_eq!(plan.len(), 4 * 3, "four records of three pieces");
        assert!(plan.iter().all(|&(_, n)| n <= piece && n > 0));
        let mut starts: Vec<u64> = plan.chunks(3).map(|p| p[0].0).collect();
        for p in plan.chunks(3) {
            assert_eq!(p[1].0, p[0].0 + piece);
            assert_eq!(p[2], (p[0].0 + 2 * piece, 12288));
        }
        starts.sort_unstable();
        starts.dedup();
        assert_eq!(starts.len(), 4, "distinct records");
        assert!(starts.iter().all(|s| offsets.contains(s)));
        assert_ne!(plan.chunks(3).map(|p| p[0].0).collect::<Vec<_>>(), offsets[..4], "not in file order");
        // At least one record, at most all of them.
        assert_eq!(record_read_plan(&offsets, record, 1, piece, 3).len(), 3);
        assert_eq!(record_read_plan(&offsets, record, u64::MAX, piece, 3).len(), 30);
    }

    #[test]
    fn record_bandwidth_reads_exactly_the_bytes_it_reports() {
        let piece = crate::experts::store::HASHED_READ_CHUNK as u64;
        let record = piece + 8192;
        let (f, offsets) = record_file(6, record);
        let speed = disk_record_bandwidth(f.path(), &offsets, record, 4 * record, 3, 1).unwrap();
        assert!(speed.bytes_per_s > 0.0, "{speed:?}");
        assert_eq!(speed.bytes, 4 * record, "{speed:?}");
        assert_eq!((speed.records, speed.requests), (4, 8), "{speed:?}");
        // A budget larger than the file reads every record once.
        let all = disk_record_bandwidth(f.path(), &offsets, record, 1 << 40, 8, 1).unwrap();
        assert_eq!(all.bytes, 6 * record, "{all:?}");
    }

    #[test]
    fn record_bandwidth_errors_name_the_file() {
        let record = 8192;
        let (f, mut offsets) = record_file(2, record);
        offsets.push(4096 + 2 * record);
        let err = disk_record_bandwidth(f.path(), &offsets, record, 1 << 30, 2, 1).unwrap_err().to_string();
        assert!(err.contains(&f.path().display().to_string()) && err.contains("past the end"), "{err}");
        let missing = f.path().with_extension("missing");
        let err = disk_record_bandwidth(&missing, &offsets, record, 1 << 30, 2, 1).unwrap_err().to_string();
        assert!(err.contains(&missing.display().to_string()), "{err}");
    }

    #[test]
    fn stream_sum_reads_every_whole_chunk_on_every_path() {
        let bytes: Vec<u8> = (0..4 * STREAM_CHUNK + 13).map(|i| (i * 7 + 3) as u8).collect();
        let expected = bytes[..4 * STREAM_CHUNK]
            .as_chunks::<8>()
            .0
            .iter()
            .fold(0u64, |s, w| s.wrapping_add(u64::from_le_bytes(*w)));
        assert_eq!(stream_sum(&bytes), expected);
        assert_eq!(stream_sum_portable(&bytes), expected);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            assert_eq!(unsafe { stream_sum_avx2(&bytes) }, expected);
        }
        assert!(read_bandwidth(1 << 20, 2) > 0.0);
    }

    #[test]
    fn copy_bandwidth_is_positive() {
        assert!(copy_bandwidth(1 << 20, 2) > 0.0);
    }
}
