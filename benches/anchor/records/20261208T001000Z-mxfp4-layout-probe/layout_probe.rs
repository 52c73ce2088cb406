//! Probe: the exact MXFP4 matrix-vector product of Picchio's AVX-512 kernel (per block: widen 16
//! code bytes to dwords, a shift for the high nibbles, two `vpermps` lookups in the E2M1 table
//! scaled by the block's exponent, two FMAs; four rows side by side), written out alone, over
//! 512 MiB of 2880-wide rows in huge pages, in two layouts:
//!   A: row-major, as the container holds them (each row's 1440 code bytes, scales apart);
//!   B: four rows interleaved block by block (block b of rows r..r+3 in one 64-byte line,
//!      their four scale bytes together), so the product reads one sequential stream.
//! Prints GB/s (codes + scales) for one thread and two, against a plain read of the codes.
use std::arch::x86_64::*;
use std::time::Instant;

const COLS: usize = 2880;
const BPR: usize = COLS / 32;
const RB: usize = BPR * 16;

static ADD: [i32; 256] = {
    let mut a = [0i32; 256];
    let mut i = 0;
    while i < 256 {
        a[i] = ((i as i32) - 127) << 23;
        i += 1;
    }
    a
};
static FP4: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The E2M1 table times 2^(s - 127) (the zeros kept).
#[inline(always)]
unsafe fn scaled(table: __m512, s: u8) -> __m512 {
    let add = _mm512_set1_epi32(*ADD.get_unchecked(s as usize));
    _mm512_castsi512_ps(_mm512_mask_add_epi32(_mm512_castps_si512(table), 0xfefe, _mm512_castps_si512(table), add))
}

/// One block of one row: `acc += decode(code bytes at c) * (xe, xo)`.
#[inline(always)]
unsafe fn block(table: __m512, s: u8, c: *const u8, xe: __m512, xo: __m512, acc: &mut [__m512]) {
    let t = scaled(table, s);
    let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(c.cast()));
    acc[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, t), xe, acc[0]);
    acc[1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32::<4>(idx), t), xo, acc[1]);
}

/// Layout A. `AHEAD > 0`: every 4 blocks, each row prefetches (L2) the line `AHEAD` bytes on
/// (12 KiB is about the rows 8 further on: Picchio's kernel's own prefetch).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn product_a<const AHEAD: usize>(codes: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    let table = _mm512_loadu_ps(FP4.as_ptr());
    for (g, o) in out.chunks_exact_mut(4).enumerate() {
        let r = 4 * g;
        let mut acc = [_mm512_setzero_ps(); 8];
        for b in 0..BPR {
            let xe = _mm512_loadu_ps(x.as_ptr().add(b * 32));
            let xo = _mm512_loadu_ps(x.as_ptr().add(b * 32 + 16));
            if AHEAD > 0 && b % 4 == 0 {
                for i in 0..4 {
                    _mm_prefetch::<_MM_HINT_T1>(codes.as_ptr().wrapping_add((r + i) * RB + b * 16 + AHEAD).cast());
                }
            }
            for i in 0..4 {
                let c = codes.as_ptr().add((r + i) * RB + b * 16);
                block(table, *scales.get_unchecked((r + i) * BPR + b), c, xe, xo, &mut acc[2 * i..2 * i + 2]);
            }
        }
        for i in 0..4 {
            o[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
        }
    }
}

/// Layout B. `AHEAD > 0`: each block (one line) prefetches (L2) the line `AHEAD` bytes on.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn product_b<const AHEAD: usize>(codes: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    let table = _mm512_loadu_ps(FP4.as_ptr());
    for (g, o) in out.chunks_exact_mut(4).enumerate() {
        let (cg, sg) = (codes.as_ptr().add(g * 4 * RB), scales.as_ptr().add(g * 4 * BPR));
        let mut acc = [_mm512_setzero_ps(); 8];
        for b in 0..BPR {
            let xe = _mm512_loadu_ps(x.as_ptr().add(b * 32));
            let xo = _mm512_loadu_ps(x.as_ptr().add(b * 32 + 16));
            if AHEAD > 0 {
                _mm_prefetch::<_MM_HINT_T1>(cg.wrapping_add(b * 64 + AHEAD).cast());
                if b % 16 == 0 {
                    _mm_prefetch::<_MM_HINT_T1>(sg.wrapping_add(b * 4 + AHEAD / 16).cast());
                }
            }
            for i in 0..4 {
                block(table, *sg.add(b * 4 + i), cg.add(b * 64 + i * 16), xe, xo, &mut acc[2 * i..2 * i + 2]);
            }
        }
        for i in 0..4 {
            o[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
        }
    }
}

/// A plain read of `codes` (512-bit loads, xor-reduced).
#[target_feature(enable = "avx512f")]
unsafe fn read(codes: &[u8], out: &mut [f32]) {
    let mut acc = _mm512_setzero_si512();
    for c in codes.chunks_exact(64) {
        acc = _mm512_xor_si512(acc, _mm512_loadu_si512(c.as_ptr().cast()));
    }
    out[0] = _mm512_reduce_add_epi32(acc) as f32;
}

type Kernel = unsafe fn(&[u8], &[u8], &[f32], &mut [f32]);

/// Bytes in huge pages (`MADV_HUGEPAGE`), filled with a xorshift stream mapped by `f`.
fn huge(n: usize, seed: u64, f: impl Fn(u64) -> u8) -> &'static mut [u8] {
    // SAFETY: an anonymous private mapping of `n` bytes, never unmapped.
    let s = unsafe {
        let p = libc::mmap(std::ptr::null_mut(), n, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert!(p != libc::MAP_FAILED);
        libc::madvise(p, n, libc::MADV_HUGEPAGE);
        std::slice::from_raw_parts_mut(p.cast::<u8>(), n)
    };
    let mut st = seed;
    for b in s.iter_mut() {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        *b = f(st);
    }
    s
}

/// Runs `k` over the rows `[r0, r1)` in `pieces` pieces split in halves on the rayon pool
/// (as Picchio's `split_in_halves`), or statically in halves per thread when `pieces == 0`.
fn run(k: Kernel, codes: &[u8], scales: &[u8], x: &[f32], out: &mut [f32], first: usize, pieces: usize) {
    let units = out.len() / 4;
    if pieces < 2 || units < 2 {
        let n = out.len();
        // SAFETY: the CPU has AVX-512 (checked in `main`).
        return unsafe { k(&codes[first * RB..(first + n) * RB], &scales[first * BPR..(first + n) * BPR], x, out) };
    }
    let mid = units / 2 * 4;
    let (lo, hi) = out.split_at_mut(mid);
    rayon::join(|| run(k, codes, scales, x, lo, first, pieces / 2), || run(k, codes, scales, x, hi, first + mid, pieces / 2));
}

fn main() {
    assert!(is_x86_feature_detected!("avx512bw"), "needs AVX-512");
    let rows = (512usize << 20) / (RB + BPR) / 64 * 64;
    let codes = huge(rows * RB, 0x1234_5678, |v| v as u8);
    let scales = huge(rows * BPR, 0x8765_4321, |v| 120 + (v % 10) as u8);
    let x: Vec<f32> = (0..COLS).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let bytes = (codes.len() + scales.len()) as f64;
    let mut out = vec![0f32; rows];
    let kernels: [(&str, Kernel); 5] = [
        ("read of the codes", |c, _, _, o| unsafe { read(c, o) }),
        ("A row-major, no prefetch", |c, s, x, o| unsafe { product_a::<0>(c, s, x, o) }),
        ("A row-major, rows ahead (Picchio's)", |c, s, x, o| unsafe { product_a::<12288>(c, s, x, o) }),
        ("B interleaved, no prefetch", |c, s, x, o| unsafe { product_b::<0>(c, s, x, o) }),
        ("B interleaved, 2 KiB ahead", |c, s, x, o| unsafe { product_b::<2048>(c, s, x, o) }),
    ];
    // Per matrix of 5760 rows (an expert's gate_up), 16 pieces: how Picchio splits a product.
    let matrix = 5760;
    for round in 1..=2 {
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for (name, k) in kernels {
                for (how, pieces) in [("halves", 0usize), ("per matrix, 16 pieces", 16)] {
                    if pieces > 0 && name.starts_with("read") {
                        continue;
                    }
                    let t0 = Instant::now();
                    pool.install(|| {
                        if pieces == 0 {
                            let per = rows / threads / 4 * 4;
                            rayon::scope(|s| {
                                for (t, o) in out.chunks_mut(per).enumerate() {
                                    let (codes, scales, x) = (&*codes, &*scales, &x);
                                    s.spawn(move |_| run(k, codes, scales, x, o, t * per, 1));
                                }
                            });
                        } else {
                            for (m, o) in out.chunks_mut(matrix).enumerate() {
                                run(k, codes, scales, &x, o, m * matrix, pieces);
                            }
                        }
                    });
                    let s = t0.elapsed().as_secs_f64();
                    println!("round {round}, {threads} thread(s), {name:36} {how:22} {:6.2} GB/s", bytes / s / 1e9);
                }
            }
        }
    }
    // The kernel's own rate: 4 rows (23 KB, in L1/L2) again and again.
    for (name, k) in &kernels[1..] {
        let (c, s) = (&codes[..4 * RB], &scales[..4 * BPR]);
        let reps = 100_000;
        let t0 = Instant::now();
        for _ in 0..reps {
            // SAFETY: AVX-512 checked above.
            unsafe { k(c, s, &x, &mut out[..4]) };
        }
        let secs = t0.elapsed().as_secs_f64();
        println!("in cache, 1 thread, {name:36} {:6.2} GB/s", (reps * 4 * (RB + BPR)) as f64 / secs / 1e9);
    }
    std::hint::black_box(&out);
}
