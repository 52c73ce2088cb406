//! Matrix-vector products in every weight format against a memory copy of the same number
//! of bytes, in one run: the ratio says how close each kernel gets to the memory-bandwidth
//! floor. (A copy reads and writes its bytes; a product only reads them.) Then batched
//! products (`Matrix::matmul`, prefill) of 2, 4, 8 and 64 inputs.
//!
//! `cargo bench --bench kernels`; criterion reports each matrix-vector product as
//! bytes/second (throughput is set to the weight bytes one product reads), each batched
//! product as multiply-adds/second ("elem/s": `n * rows * cols` per product) and weight
//! bytes/second. The L2-resident shape shows the batched kernels' compute ceiling, the
//! expert shapes what the engine gets from the L3 or memory. Each product runs on one thread (`1t`) and on the
//! default rayon pool (`pool`), on the selected kernel path, which `PICCHIO_KERNELS` overrides:
//! `PICCHIO_KERNELS=scalar cargo bench --bench kernels -- 2880x2880` compares against the
//! reference. Without `PICCHIO_INT8_ACTIVATIONS=1`, the selected path's integer kernels on
//! quantized activations are measured beside the float ones (`avx512-vnni-q8`, `avx2-q8`, ...:
//! VNNI for INT4, INT8 and MXFP4, the other SIMD paths for MXFP4); with it, the products of
//! those formats are the integer kernels' (names ending in `-q8`).
//!
//! Then `stream_*`: matrix-vector products over more distinct matrices than any cache
//! holds, the memory-bound case decode is in, and products of 8 inputs over the same
//! matrices (`n8`), as a prefill's experts meet their weights: once each, from memory.
//!
//! First, the machine's own ceiling for the float kernels: `fma_peak` runs independent chains
//! of 512-bit (AVX-512) or 256-bit (AVX2) fused multiply-adds, so "a kernel reaches N% of the
//! f32 multiply-add peak" is a ratio of two figures from the same run (Zen 4 executes a
//! 512-bit FMA as two 256-bit halves, Zen 5 server cores natively: the peak is measured, not
//! taken from a datasheet). `op_rate` then gives the rate of each other 512-bit operation the
//! MXFP4 kernels are made of, alone and alternating with multiply-adds, so a kernel's operation
//! count converts into cycles on this CPU (on the 2026-12 Zen 5 VM, the lookups, widenings and
//! integer dot products share the two multiply-add units; shifts, conversions and integer adds
//! go to two others).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use criterion::{
    BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main, measurement::WallTime,
};
use picchio::bench::parallel_stream_sum;
use picchio::quant::buffer::{AlignedBytes, ByteRegion};
use picchio::quant::{KernelPath, Matrix, MatrixData, WeightBuf, int4, int8, kernels, mxfp4};
use rayon::ThreadPool;

/// A matrix that stays in a core's L2 cache (the kernels' compute ceiling, which other
/// cores' memory traffic does not disturb), one GPT-OSS expert's down projection, and its
/// fused gate/up projection.
const SHAPES: [(usize, usize); 3] = [(256, 2880), (2880, 2880), (5760, 2880)];
/// Inputs per batched product: what one expert gets in a 64-token prefill of the 120B (top-4
/// of 128 experts: about 2) and of the 20B (top-4 of 32: about 8), a few more, and what an
/// attention projection gets.
const BATCHES: [usize; 4] = [2, 4, 8, 64];

fn weights(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect()
}

fn input(cols: usize) -> Vec<f32> {
    (0..cols).map(|i| (i as f32 * 0.37).sin()).collect()
}

/// `v` in a 4 KiB-aligned buffer, as the engine holds weights (memory-mapped pages, or
/// [`AlignedBytes`] that experts are read into).
fn aligned<T: Pod>(v: Vec<T>) -> WeightBuf<T> {
    let bytes: &[u8] = bytemuck::cast_slice(&v);
    let mut buf = AlignedBytes::zeroed(bytes.len());
    buf.as_mut_slice().copy_from_slice(bytes);
    let region: Arc<dyn ByteRegion> = Arc::new(buf);
    WeightBuf::shared(&region, 0, bytes.len())
}

/// The same weights in each format.
fn matrices(rows: usize, cols: usize) -> Vec<Matrix> {
    let w = weights(rows, cols);
    let bf16 = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let mut i8_codes = vec![0i8; rows * cols];
    let i8_scales =
        w.chunks(cols).zip(i8_codes.chunks_mut(cols)).map(|(r, c)| int8::quantize_row(r, c)).collect();
    let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
    let mut i4_codes = vec![0u8; rows * rb];
    let mut i4_scales = vec![0u16; rows * g];
    for (r, row) in w.chunks(cols).enumerate() {
        int4::quantize_row(row, &mut i4_codes[r * rb..(r + 1) * rb], &mut i4_scales[r * g..(r + 1) * g]);
    }
    // MXFP4 as released: every code, and block scales near 1 (the kernels' speed does not
    // depend on the values).
    let (mb, mblocks) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    let mx_codes: Vec<u8> = (0..rows * mb).map(|i| (i * 7919 % 251) as u8).collect();
    let mx_scales: Vec<u8> = (0..rows * mblocks).map(|i| 122 + (i % 7) as u8).collect();
    let data = [
        MatrixData::F32(aligned(w)),
        MatrixData::Bf16(aligned(bf16)),
        MatrixData::Int8Rows { codes: aligned(i8_codes), scales: aligned(i8_scales) },
        MatrixData::Int4G64 { codes: aligned(i4_codes), scales: aligned(i4_scales) },
        MatrixData::Mxfp4 { codes: aligned(mx_codes), scales: aligned(mx_scales) },
    ];
    data.into_iter().map(|d| Matrix::new("bench", rows, cols, d).unwrap()).collect()
}

/// Benchmarks `f` on one thread and on the default pool.
fn bench_threads(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    one: &ThreadPool,
    mut f: impl FnMut() + Send,
) {
    g.bench_function(format!("{name}/1t"), |b| one.install(|| b.iter(&mut f)));
    g.bench_function(format!("{name}/pool"), |b| b.iter(&mut f));
}

/// Independent chains of fused multiply-adds, as many as keep the units busy despite their
/// latency; returns a value that depends on every chain so none is optimized away.
/// Multiply-adds per call: `iters * CHAINS * LANES`.
#[cfg(target_arch = "x86_64")]
mod fma_peak {
    use std::arch::x86_64::*;

    /// Chains in flight: more than latency (4-5 cycles) times units (2), and with the two
    /// constants within AVX2's 16 registers (more would spill to memory and measure that).
    pub const CHAINS: usize = 12;

    /// `iters` rounds of [`CHAINS`] 512-bit multiply-adds (16 lanes each).
    #[target_feature(enable = "avx512f")]
    pub fn avx512(iters: usize) -> f32 {
        let (m, a) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-4));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for c in &mut acc {
                *c = _mm512_fmadd_ps(*c, m, a);
            }
        }
        acc.iter().map(|&c| _mm512_reduce_add_ps(c)).sum()
    }

    /// `iters` rounds of [`CHAINS`] 256-bit multiply-adds (8 lanes each).
    #[target_feature(enable = "avx2,fma")]
    pub fn avx2(iters: usize) -> f32 {
        let (m, a) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-4));
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for c in &mut acc {
                *c = _mm256_fmadd_ps(*c, m, a);
            }
        }
        let mut lanes = [0.0f32; 8];
        acc.iter()
            .map(|&c| {
                // SAFETY: `lanes` has room for 8 floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), c) };
                lanes.iter().sum::<f32>()
            })
            .sum()
    }
}

/// How many 512-bit operations of each kind the CPU issues per second, alone and mixed with
/// multiply-adds: which of the operations the MXFP4 kernels are made of (lookups, widening,
/// shifts, integer dot products, conversions) compete with the multiply-adds for the same
/// units. Each function runs [`op_rate::CHAINS`] independent chains of its operation (in a
/// mix, alternate chains run each), `iters` rounds; operations per call: `iters * CHAINS`.
#[cfg(target_arch = "x86_64")]
mod op_rate {
    use std::arch::x86_64::*;

    /// Chains in flight: 8 per operation in a mix, enough to cover a multiply-add's latency at
    /// two a cycle; with 24 the compiler spilled them to memory and measured that.
    pub const CHAINS: usize = 16;

    /// One operation (or a pair of them, alternating over the chains) as a function, with
    /// AVX-512 F, BW and VNNI (or the target features given first).
    macro_rules! rate {
        ($(#[$doc:meta])* $name:ident, |$v:ident, $k:ident| $a:expr) => {
            rate!($(#[$doc])* $name, |$v, $k| $a, $a);
        };
        ($(#[$doc:meta])* $name:ident, |$v:ident, $k:ident| $a:expr, $b:expr) => {
            rate!($(#[$doc])* "avx512f,avx512bw,avx512vnni", $name, |$v, $k| $a, $b);
        };
        ($(#[$doc:meta])* $features:literal, $name:ident, |$v:ident, $k:ident| $a:expr, $b:expr) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub fn $name(iters: usize) -> i32 {
                let $k = (_mm512_set1_epi32(3), _mm512_castsi512_ps(_mm512_set1_epi32(0x3f80_0001)));
                let _ = $k;
                let mut acc: [__m512i; CHAINS] = std::array::from_fn(|i| _mm512_set1_epi32(i as i32));
                for _ in 0..iters {
                    for pair in acc.as_chunks_mut::<2>().0 {
                        let $v = pair[0];
                        pair[0] = opaque($a);
                        let $v = pair[1];
                        pair[1] = opaque($b);
                    }
                }
                acc.iter().fold(0, |s, &v| s ^ _mm512_reduce_add_epi32(v))
            }
        };
    }

    /// `v`, which the compiler cannot see through: without it, it merges successive shifts or
    /// adds of a chain into one and measures nothing.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn opaque(mut v: __m512i) -> __m512i {
        // SAFETY: an empty instruction sequence that claims to modify a register.
        unsafe { std::arch::asm!("/* {0} */", inout(zmm_reg) v, options(pure, nomem, nostack)) };
        v
    }

    /// Lane 0 of `v` (as f32) in every lane, from a register.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn bcast(v: __m512i) -> __m512i {
        _mm512_castps_si512(_mm512_broadcastss_ps(_mm512_castps512_ps128(_mm512_castsi512_ps(v))))
    }

    /// A 512-bit multiply-add, as an integer vector (the casts cost nothing).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn madd(v: __m512i, k: (__m512i, __m512)) -> __m512i {
        _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(v), k.1, k.1))
    }

    rate!(
        /// `vfmadd` alone (the reference: the multiply-add peak in operations).
        fma, |v, k| madd(v, k));
    rate!(
        /// `vpermps`: the float kernel's E2M1 lookup.
        permps, |v, k| _mm512_castps_si512(_mm512_permutexvar_ps(v, k.1)));
    rate!(
        /// `vpmovzxbd`: the float kernel's widening of a block's code bytes to indices.
        zero_extend, |v, k| _mm512_cvtepu8_epi32(_mm512_castsi512_si128(v)));
    rate!(
        /// `vpsrld`: the float kernel's high-nibble shift.
        shift, |v, k| _mm512_srli_epi32::<1>(v));
    rate!(
        /// `vpdpbusd`: the integer kernels' dot product.
        dpbusd, |v, k| _mm512_dpbusd_epi32(v, k.0, k.0));
    rate!(
        /// `vcvtdq2ps`: the integer kernels' conversion of block sums.
        convert, |v, k| _mm512_castps_si512(_mm512_cvtepi32_ps(v)));
    rate!(
        /// `vpaddd`: a simple integer operation.
        add, |v, k| _mm512_add_epi32(v, k.0));
    rate!(
        /// Multiply-adds and lookups on alternate chains: as fast as the faster alone if they
        /// use different units, as the slower if they share.
        fma_and_permps, |v, k| madd(v, k), _mm512_castps_si512(_mm512_permutexvar_ps(v, k.1)));
    rate!(
        /// `vbroadcastss` from a register: the float kernel's broadcast of a block's scale.
        broadcast, |v, k| bcast(v));
    rate!(
        /// Multiply-adds and broadcasts on alternate chains.
        fma_and_broadcast, |v, k| madd(v, k), bcast(v));
    rate!(
        /// Multiply-adds and widenings on alternate chains.
        fma_and_zero_extend, |v, k| madd(v, k), _mm512_cvtepu8_epi32(_mm512_castsi512_si128(v)));
    rate!(
        /// Multiply-adds and shifts on alternate chains.
        fma_and_shift, |v, k| madd(v, k), _mm512_srli_epi32::<1>(v));
    rate!(
        /// Multiply-adds and integer dot products on alternate chains.
        fma_and_dpbusd, |v, k| madd(v, k), _mm512_dpbusd_epi32(v, k.0, k.0));
    rate!(
        /// Multiply-adds and conversions on alternate chains.
        fma_and_convert, |v, k| madd(v, k), _mm512_castps_si512(_mm512_cvtepi32_ps(v)));
    rate!(
        /// Multiply-adds and integer adds on alternate chains.
        fma_and_add, |v, k| madd(v, k), _mm512_add_epi32(v, k.0));

    /// `vdpbf16ps` (AVX-512 BF16): 32 BF16 products added in pairs to 16 f32 lanes, as an
    /// integer vector.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dot_bf16(v: __m512i, k: (__m512i, __m512)) -> __m512i {
        // SAFETY: a vector of 16 u32 and one of 32 BF16 values are the same 64 bytes.
        let pairs = unsafe { std::mem::transmute::<__m512, __m512bh>(k.1) };
        _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(v), pairs, pairs))
    }

    rate!(
        /// `vdpbf16ps` alone: twice a `vfmadd`'s multiply-adds an operation, if it issues as
        /// often (docs/perf.md, 2026-12-07: a BF16-activation kernel built on it was slower).
        "avx512f,avx512bw,avx512vnni,avx512bf16",
        dpbf16, |v, k| dot_bf16(v, k), dot_bf16(v, k));
    rate!(
        /// Multiply-adds and `vdpbf16ps` on alternate chains.
        "avx512f,avx512bw,avx512vnni,avx512bf16",
        fma_and_dpbf16, |v, k| madd(v, k), dot_bf16(v, k));
}

/// One operation of [`op_rate`]: its name and its chains.
#[cfg(target_arch = "x86_64")]
type OpRate = (&'static str, fn(usize) -> i32);

/// The operation rates of [`op_rate`], on one thread (`elem/s` = operations per second).
#[cfg(target_arch = "x86_64")]
fn bench_op_rate(c: &mut Criterion, one: &ThreadPool) {
    const ITERS: usize = 1 << 16;
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni"))
    {
        return;
    }
    let mut g = c.benchmark_group("op_rate");
    g.measurement_time(Duration::from_secs(1)).warm_up_time(Duration::from_millis(500)).sample_size(20);
    g.throughput(Throughput::Elements((ITERS * op_rate::CHAINS) as u64));
    let mut ops: Vec<OpRate> = vec![
        // SAFETY (all): only called where the CPU has AVX-512 F, BW and VNNI (checked above).
        ("fma", |n| unsafe { op_rate::fma(n) }),
        ("vpermps", |n| unsafe { op_rate::permps(n) }),
        ("vpmovzxbd", |n| unsafe { op_rate::zero_extend(n) }),
        ("vpsrld", |n| unsafe { op_rate::shift(n) }),
        ("vpdpbusd", |n| unsafe { op_rate::dpbusd(n) }),
        ("vcvtdq2ps", |n| unsafe { op_rate::convert(n) }),
        ("vpaddd", |n| unsafe { op_rate::add(n) }),
        ("vbroadcastss", |n| unsafe { op_rate::broadcast(n) }),
        ("fma+vpermps", |n| unsafe { op_rate::fma_and_permps(n) }),
        ("fma+vbroadcastss", |n| unsafe { op_rate::fma_and_broadcast(n) }),
        ("fma+vpmovzxbd", |n| unsafe { op_rate::fma_and_zero_extend(n) }),
        ("fma+vpsrld", |n| unsafe { op_rate::fma_and_shift(n) }),
        ("fma+vpdpbusd", |n| unsafe { op_rate::fma_and_dpbusd(n) }),
        ("fma+vcvtdq2ps", |n| unsafe { op_rate::fma_and_convert(n) }),
        ("fma+vpaddd", |n| unsafe { op_rate::fma_and_add(n) }),
    ];
    if is_x86_feature_detected!("avx512bf16") {
        // SAFETY (both): the CPU has AVX-512 BF16 (checked here) besides F, BW and VNNI.
        ops.push(("vdpbf16ps", |n| unsafe { op_rate::dpbf16(n) }));
        ops.push(("fma+vdpbf16ps", |n| unsafe { op_rate::fma_and_dpbf16(n) }));
    } else {
        eprintln!("SKIPPED: op_rate vdpbf16ps: this CPU has no AVX-512 BF16");
    }
    for (name, f) in ops {
        g.bench_function(format!("{name}/1t"), |b| one.install(|| b.iter(|| black_box(f(black_box(ITERS))))));
    }
    g.finish();
}

/// One width of [`fma_peak`]: its name, f32 lanes, whether this CPU has it, and the chains.
#[cfg(target_arch = "x86_64")]
type FmaWidth = (&'static str, usize, bool, fn(usize) -> f32);

/// The f32 multiply-add peak, on one thread and on every thread of the pool at once
/// (`elem/s` = multiply-adds per second).
#[cfg(target_arch = "x86_64")]
fn bench_fma_peak(c: &mut Criterion, one: &ThreadPool) {
    const ITERS: usize = 1 << 16;
    let mut g = c.benchmark_group("fma_peak");
    g.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_secs(1)).sample_size(20);
    let widths: [FmaWidth; 2] = [
        ("avx512", 16, is_x86_feature_detected!("avx512f"), |n| {
            // SAFETY: only called where the CPU has AVX-512 F (checked beside it).
            unsafe { fma_peak::avx512(n) }
        }),
        ("avx2", 8, is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"), |n| {
            // SAFETY: only called where the CPU has AVX2 and FMA (checked beside it).
            unsafe { fma_peak::avx2(n) }
        }),
    ];
    for (name, lanes, available, f) in widths {
        if !available {
            continue;
        }
        let per_call = (ITERS * fma_peak::CHAINS * lanes) as u64;
        g.throughput(Throughput::Elements(per_call));
        g.bench_function(format!("{name}/1t"), |b| one.install(|| b.iter(|| black_box(f(black_box(ITERS))))));
        let threads = rayon::current_num_threads();
        g.throughput(Throughput::Elements(per_call * threads as u64));
        g.bench_function(format!("{name}/pool"), |b| {
            b.iter(|| black_box(rayon::broadcast(|_| f(black_box(ITERS)))))
        });
    }
    g.finish();
}

/// Bytes of weights the streaming benchmark goes through: more than any L3, as the experts
/// and dense weights a decoded token reads are, and as `picchio bench`'s read floor (512 MiB).
/// (128 MiB was not: the Intel Xeon VM of 2026-12-07 reports a 480 MiB L3, and a read of 128
/// MiB ran at 52 GiB/s on two threads there against 31 for 512 MiB.)
const STREAM_BYTES: usize = 512 << 20;

/// Matrix-vector products over [`STREAM_BYTES`] of distinct expert-shaped matrices (the
/// 5760x2880 gate/up projection), one after another as decode goes through a layer's
/// weights, so every weight comes from memory: the memory-bound case, against a copy and a
/// read of the same bytes (the read: huge pages, `picchio::bench::parallel_stream_sum`).
/// MXFP4 (the experts as released), BF16 (attention) and INT4-gs64 (experts converted from
/// BF16 sources).
fn bench_stream(c: &mut Criterion, one: &ThreadPool, path: KernelPath) {
    let (rows, cols) = (5760, 2880);
    let mut g = c.benchmark_group(format!("stream_{rows}x{cols}"));
    g.measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1)).sample_size(10);
    let x = input(cols);
    let (mb, blocks) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    let mxfp4_bytes = rows * (mb + blocks);
    let mxfp4: Vec<Matrix> = (0..STREAM_BYTES / mxfp4_bytes)
        .map(|i| {
            let codes: Vec<u8> = (0..rows * mb).map(|j| ((j + i) * 7919 % 251) as u8).collect();
            let scales: Vec<u8> = (0..rows * blocks).map(|j| 122 + ((j + i) % 7) as u8).collect();
            let data = MatrixData::Mxfp4 { codes: aligned(codes), scales: aligned(scales) };
            Matrix::new("stream", rows, cols, data).unwrap()
        })
        .collect();
    let bf16: Vec<Matrix> = (0..STREAM_BYTES / (rows * cols * 2))
        .map(|i| {
            let w = (0..rows * cols)
                .map(|j| half::bf16::from_f32(((j + i) % 1000) as f32 * 1e-3).to_bits())
                .collect();
            Matrix::new("stream", rows, cols, MatrixData::Bf16(aligned(w))).unwrap()
        })
        .collect();
    // INT4-gs64 (the format of experts converted from BF16 sources), scales near 1e-2.
    let (ib, groups) = (int4::row_bytes(cols), int4::groups(cols));
    let int4: Vec<Matrix> = (0..STREAM_BYTES / (rows * (ib + 2 * groups)))
        .map(|i| {
            let codes: Vec<u8> = (0..rows * ib).map(|j| ((j + i) * 7919 % 251) as u8).collect();
            let scales: Vec<u16> = (0..rows * groups)
                .map(|j| half::f16::from_f32(1e-2 * (1 + (j + i) % 7) as f32).to_bits())
                .collect();
            let data = MatrixData::Int4G64 { codes: aligned(codes), scales: aligned(scales) };
            Matrix::new("stream", rows, cols, data).unwrap()
        })
        .collect();
    let mut y = vec![0.0f32; rows];
    for (name, ms) in [("mxfp4", &mxfp4), ("bf16", &bf16), ("int4", &int4)] {
        let bytes: usize = ms.iter().map(Matrix::byte_len).sum();
        g.throughput(Throughput::Bytes(bytes as u64));
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        g.bench_function(format!("{name}/memcpy"), |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
        // The ceiling of a kernel that only reads: the same number of bytes, where weights lie
        // (huge pages), summed with the widest loads, on one thread and on the pool.
        let mut read = AlignedBytes::zeroed(bytes);
        read.as_mut_slice().fill(1);
        bench_threads(&mut g, &format!("{name}/read"), one, || {
            black_box(parallel_stream_sum(read.bytes()));
        });
        bench_threads(&mut g, &format!("{name}/{}", path.name()), one, || {
            for m in ms.iter() {
                m.matvec(black_box(&x), &mut y);
            }
        });
        // A prefill's expert products: a few inputs per matrix, every weight from memory
        // once (the `matmul_*` groups reuse one matrix that stays in L3). Multiply-adds/s.
        let n = STREAM_BATCH;
        let xs: Vec<f32> = (0..n).flat_map(|t| x.iter().map(move |v| v + t as f32 * 1e-3)).collect();
        let mut ys = vec![0.0f32; n * rows];
        g.throughput(Throughput::Elements((n * rows * cols * ms.len()) as u64));
        bench_threads(&mut g, &format!("{name}/n{n}/{}", path.name()), one, || {
            for m in ms.iter() {
                m.matmul(black_box(&xs), n, &mut ys);
            }
        });
    }
    g.finish();
}

/// Inputs of the batched products in [`bench_stream`]: about what each expert gets in a
/// 64-token prefill of the 20B shape (64 tokens x top-4 over 32 experts).
const STREAM_BATCH: usize = 8;

fn bench(c: &mut Criterion) {
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    #[cfg(target_arch = "x86_64")]
    bench_fma_peak(c, &one);
    #[cfg(target_arch = "x86_64")]
    bench_op_rate(c, &one);
    bench_stream(c, &one, kernels::selected());
    let path = kernels::selected();
    // Without int8 activations, the selected path's integer kernels are measured too.
    let extra_q8 = !kernels::int8_activations();
    for (rows, cols) in SHAPES {
        let x = input(cols);
        let mut g = c.benchmark_group(format!("matvec_{rows}x{cols}"));
        g.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_secs(1)).sample_size(20);
        for m in matrices(rows, cols) {
            let name = m.format_name();
            g.throughput(Throughput::Bytes(m.byte_len() as u64));
            let src = vec![1u8; m.byte_len()];
            let mut dst = vec![0u8; m.byte_len()];
            g.bench_function(format!("{name}/memcpy"), |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
            let mut y = vec![0.0f32; rows];
            bench_threads(&mut g, &format!("{name}/{}", path.name()), &one, || {
                m.matvec(black_box(&x), &mut y)
            });
            if extra_q8 && m.integer_product().is_some_and(|p| path.has_integer_kernel(p)) {
                bench_threads(&mut g, &format!("{name}/{}-q8", path.name()), &one, || {
                    m.matvec_q8_with(path, black_box(&x), &mut y)
                });
            }
        }
        g.finish();
    }
    for (rows, cols) in SHAPES {
        let mut g = c.benchmark_group(format!("matmul_{rows}x{cols}"));
        g.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_secs(1)).sample_size(10);
        for m in matrices(rows, cols).into_iter().filter(|m| !matches!(m.data, MatrixData::F32(_))) {
            // With PICCHIO_INT8_ACTIVATIONS=1, the formats the path has integer kernels for
            // (VNNI: INT4, INT8 and MXFP4; AVX2, AVX-512, NEON: MXFP4) run them.
            let q8 = if m.quantizes_on(path) { "-q8" } else { "" };
            for n in BATCHES {
                let x: Vec<f32> =
                    (0..n).flat_map(|t| input(cols).into_iter().map(move |v| v + t as f32 * 1e-3)).collect();
                let mut y = vec![0.0f32; n * rows];
                g.throughput(Throughput::ElementsAndBytes {
                    elements: (n * rows * cols) as u64,
                    bytes: m.byte_len() as u64,
                });
                let name = format!("{}/n{n}/{}{q8}", m.format_name(), path.name());
                bench_threads(&mut g, &name, &one, || m.matmul(black_box(&x), n, &mut y));
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
