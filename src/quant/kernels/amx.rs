//! Intel AMX kernels: the integer MXFP4 product on quantized activations ([`super::q8`]) with
//! the tile matrix unit (`tdpbssd`) of Sapphire Rapids and later Xeons.
//!
//! AMX multiplies a tile of up to 16 rows of 64 signed bytes (here the inputs' codes of one
//! MXFP4 block) by a tile of 16 rows of 64 bytes holding 16 columns of 4 bytes (here 16 weight
//! rows' doubled E2M1 values of the same block) into 16 x 16 exact `i32` sums, at about 1.4
//! to 3.3 T multiply-adds a second on one core of the Xeon VM of docs/perf.md (2026-12-07),
//! where the AVX-512 VNNI kernel manages about a tenth of a tera. So the work left on the
//! vector units is decoding a block's weights into the tile layout and the f32 scaling of the
//! sums, which this kernel does once per block for 16 rows and every input together.
//!
//! Each output is `sum_b (HALF_SCALES[e_b] * s_g) * D_b` accumulated in block order with a
//! separate multiply and add, `D_b` the block's exact integer sum: the very operations of
//! [`super::q8::mxfp4_dot_reference`], so this kernel equals the scalar definition bit for bit,
//! whatever the number of inputs (and so a batched prefill equals token-by-token decoding).
//!
//! Rust has no stable AMX intrinsics or target features, so the tile instructions are inline
//! assembly and [`available`] checks the CPU (CPUID) and asks Linux for the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), which a process must do before its first tile
//! instruction. Other systems report AMX unavailable.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::holds_rows;
use super::q8::QuantizedX;
use super::x86::{FP4_DOUBLED_OFFSET, high_nibbles_up, load_pair_high_nibbles_up};
use crate::quant::mxfp4::{self, BLOCK, BLOCK_BYTES};

/// Most inputs one pass of [`mxfp4_dot_q8_amx`] takes: the 16 rows of a tile.
pub const MAX_INPUTS: usize = 16;

/// Weight rows a tile holds (its 16 columns of 4 bytes).
const TILE_ROWS: usize = 16;

/// How many blocks ahead of the tile product a block's weights are decoded, and behind it its
/// sums are scaled: the tile unit reads stores only once they have left the core's store
/// buffer (and the vector loads the tile store), which in-order retirement delays behind every
/// older instruction, so a stage one block apart waited for the whole previous block.
const AHEAD: usize = 4;
const BEHIND: usize = 4;
/// Buffers in the rings of decoded weights and of sums.
const WEIGHT_SLOTS: usize = AHEAD + 2;
const SUM_SLOTS: usize = BEHIND + 1;

/// Whether this CPU has AMX tiles with 8-bit integer products, plus AVX-512 VBMI (which the
/// weight decoding uses), and the operating system lets this process use the tile state
/// (checked, and on Linux requested, once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // CPUID leaf 7, subleaf 0: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
        #[allow(unused_unsafe)]
        // SAFETY: CPUID leaf 7 exists on every x86-64 CPU with AVX2, which the callers need.
        let leaf = unsafe { __cpuid_count(7, 0) };
        let amx = leaf.edx & (0b11 << 24) == 0b11 << 24;
        amx && is_x86_feature_detected!("avx512vbmi") && tile_state_permitted()
    })
}

/// Asks Linux for permission to use the AMX tile data state (`XFEATURE_XTILEDATA`); true if
/// granted (it fails on kernels before 5.16 and where the hypervisor hides the state).
#[cfg(target_os = "linux")]
fn tile_state_permitted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this `arch_prctl` request only changes which state the kernel lets the process
    // use; it reads and writes no memory of ours.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

/// Other systems: not used (Windows and macOS hand out the tile state differently).
#[cfg(not(target_os = "linux"))]
fn tile_state_permitted() -> bool {
    false
}

/// The palette-1 tile configuration (`ldtilecfg`'s 64 bytes) for `inputs` inputs: tile 0 the
/// sums (`inputs` rows of 16 `i32`), tile 1 the inputs' codes of one block (`inputs` rows of
/// 32 bytes), tile 2 the weights of one block (8 rows of 16 x 4 bytes).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new(inputs: usize) -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        let rows = inputs.min(MAX_INPUTS) as u8;
        for (tile, rows, bytes) in [(0, rows, 64u16), (1, rows, BLOCK as u16), (2, (BLOCK / 4) as u8, 64)] {
            c[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&bytes.to_le_bytes());
            c[48 + tile] = rows;
        }
        TileConfig(c)
    }
}

/// 64-byte aligned rows: the weight tile and the sums, which the tile loads and stores read
/// and write whole.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lines<T, const N: usize>([T; N]);

/// The doubled E2M1 values ([`mxfp4::FP4_DOUBLED`]) four times over: `vpermb` looks up a byte
/// by its low 6 bits, so a code in the low nibble needs no masking of the upper ones.
static FP4_DOUBLED_64: [i8; 64] = {
    let mut t = [0i8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = mxfp4::FP4_DOUBLED[i % 16];
        i += 1;
    }
    t
};

/// `vpermt2d` indices that gather, from four rows' 16-byte blocks in each of two registers
/// (row `r` in 128-bit lane `r % 4`), 32-bit word `q` of rows 0..8 into lanes 0..8 and word
/// `q + 1` into lanes 8..16, for `q = 0` ([0]) and `q = 2` ([1]).
static TRANSPOSE_WORDS: [[i32; 16]; 2] = {
    let mut t = [[0i32; 16]; 2];
    let mut half = 0;
    while half < 2 {
        let mut j = 0;
        while j < 16 {
            let (q, r) = (2 * half + j / 8, j % 8);
            t[half][j] = (if r < 4 { 4 * r + q } else { 16 + 4 * (r - 4) + q }) as i32;
            j += 1;
        }
        half += 1;
    }
    t
};

/// The MXFP4 rows of `cols` inputs (`codes`, `scales`: whole rows) times each of the `M`
/// quantized inputs, as [`super::q8::mxfp4_dot_reference`] defines it and bit for bit equal to
/// it, into `out[r * stride + t]`.
///
/// Per 16 rows and block: the rows' 16 code bytes are transposed into four registers of one
/// 32-bit word per row (`vpermt2d`, `vshufi64x2`), whose low and high nibbles are looked up
/// (`vpermb`) into the 8 x 64-byte weight tile: column `n` of tile row `2 q + h` holds row
/// `n`'s elements `8 q + 2 j + h`, `j < 4`, which is the order of
/// [`QuantizedX::mxfp4_tile_codes`]. One `tdpbssd` gives every input's exact sum with each of
/// the 16 rows; each input's 16 sums are converted to f32, multiplied by the rows' half scales
/// times the input's group scale, and added to its accumulator.
///
/// # Safety
/// The CPU must have AMX ([`available`], which also obtains the tile state from Linux).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
pub unsafe fn mxfp4_dot_q8_amx<const M: usize>(
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    xs: &[&QuantizedX; M],
    out: &mut [f32],
    stride: usize,
) {
    let (rb, bpr) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    if M == 0 || M > MAX_INPUTS || !holds_rows(codes.len(), rows, rb) || !holds_rows(scales.len(), rows, bpr)
    {
        return;
    }
    if M == 1 {
        // SAFETY: the caller's contract covers this function's features.
        return unsafe { mxfp4_dot_q8_rows16(codes, scales, rows, cols, xs[0], out, stride) };
    }
    // The blocks every input has (as the reference, which stops at the shorter of the two).
    let n = xs.iter().fold(bpr, |n, x| n.min(x.mxfp4_tile_codes().len() / BLOCK).min(2 * x.scales().len()));
    // The inputs' codes, input `t` at `t * n * 32`: block `b` of every input is then one tile
    // of `M` rows `n * 32` bytes apart.
    let a_stride = n * BLOCK;
    let mut a = vec![0i8; M * a_stride];
    for (row, x) in a.chunks_exact_mut(a_stride.max(1)).zip(xs) {
        row.copy_from_slice(&x.mxfp4_tile_codes()[..a_stride]);
    }
    let group_scales: [&[f32]; M] = std::array::from_fn(|t| &xs[t].scales()[..n.div_ceil(2)]);
    let config = TileConfig::new(M);
    // SAFETY: AMX is available (the caller's contract); the configuration is 64 readable bytes
    // describing tiles within the palette's limits (16 rows, 64 bytes a row).
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    // SAFETY: 64 readable bytes; unaligned loads are allowed.
    let table = unsafe { _mm512_loadu_si512(FP4_DOUBLED_64.as_ptr().cast()) };
    // SAFETY: as above.
    let (words_01, words_23) = unsafe {
        (
            _mm512_loadu_si512(TRANSPOSE_WORDS[0].as_ptr().cast()),
            _mm512_loadu_si512(TRANSPOSE_WORDS[1].as_ptr().cast()),
        )
    };
    // Rings of buffers for the pipeline below.
    let mut weights: [_; WEIGHT_SLOTS] = std::array::from_fn(|_| Lines([[0i8; 64]; BLOCK / 4]));
    let mut sums: [_; SUM_SLOTS] = std::array::from_fn(|_| Lines([[0i32; TILE_ROWS]; MAX_INPUTS]));
    let mut row_scales = RowScales::take(n);
    // A tile's missing rows past the last read zero codes.
    let zero_row = vec![[0u8; BLOCK_BYTES]; if rows.is_multiple_of(TILE_ROWS) { 0 } else { n }];
    let mut r0 = 0;
    while r0 < rows {
        let rr = TILE_ROWS.min(rows - r0);
        let row_codes: [&[[u8; BLOCK_BYTES]]; TILE_ROWS] = std::array::from_fn(|i| {
            if i < rr { codes[(r0 + i) * rb..][..n * BLOCK_BYTES].as_chunks().0 } else { &zero_row[..] }
        });
        row_scales.fill(scales, r0, rr, bpr);
        // Block `b`'s weights in tile layout into `weights[slot]`.
        let decode = |b: usize, tile: &mut [[i8; 64]; BLOCK / 4]| {
            // Rows `4 k .. 4 k + 4`, one per 128-bit lane.
            let four = |k: usize| {
                // SAFETY: each is 16 readable bytes; unaligned loads are allowed.
                let row = |i: usize| unsafe { _mm_loadu_si128(row_codes[4 * k + i][b].as_ptr().cast()) };
                let v = _mm512_castsi128_si512(row(0));
                let v = _mm512_inserti32x4::<1>(v, row(1));
                let v = _mm512_inserti32x4::<2>(v, row(2));
                _mm512_inserti32x4::<3>(v, row(3))
            };
            let (z0, z1, z2, z3) = (four(0), four(1), four(2), four(3));
            let (u01, u23) =
                (_mm512_permutex2var_epi32(z0, words_01, z1), _mm512_permutex2var_epi32(z2, words_01, z3));
            let (v01, v23) =
                (_mm512_permutex2var_epi32(z0, words_23, z1), _mm512_permutex2var_epi32(z2, words_23, z3));
            // Word `q` of all 16 rows.
            let words = [
                _mm512_shuffle_i64x2::<0x44>(u01, u23),
                _mm512_shuffle_i64x2::<0xee>(u01, u23),
                _mm512_shuffle_i64x2::<0x44>(v01, v23),
                _mm512_shuffle_i64x2::<0xee>(v01, v23),
            ];
            for (q, w) in words.into_iter().enumerate() {
                let low = _mm512_permutexvar_epi8(w, table);
                let high = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(w), table);
                // SAFETY: tile rows `2 q` and `2 q + 1` are 64 writable aligned bytes each.
                unsafe {
                    _mm512_store_si512(tile[2 * q].as_mut_ptr().cast(), low);
                    _mm512_store_si512(tile[2 * q + 1].as_mut_ptr().cast(), high);
                }
            }
        };
        // Block `b`'s sums of every input (`sums`) scaled into the accumulators.
        let scale = |b: usize, sums: &[[i32; TILE_ROWS]; MAX_INPUTS], acc: &mut [__m512; M]| {
            let row_scales = row_scales.half(b);
            for t in 0..M {
                // SAFETY: 64 readable aligned bytes.
                let sum = _mm512_cvtepi32_ps(unsafe { _mm512_load_si512(sums[t].as_ptr().cast()) });
                let scale = _mm512_mul_ps(row_scales, _mm512_set1_ps(group_scales[t][b / 2]));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(scale, sum));
            }
        };
        // A pipeline of three stages ([`AHEAD`], [`BEHIND`]), each on its own buffers: decode
        // block `b + AHEAD`, multiply block `b`, scale block `b - BEHIND`.
        let mut acc = [_mm512_setzero_ps(); M];
        for b in 0..AHEAD.min(n) {
            decode(b, &mut weights[b % WEIGHT_SLOTS].0);
        }
        // The same blocks of the next tile's rows, prefetched into L2 a cache line at a time as
        // this tile reaches them (16 rows side by side advance too slowly through each for the
        // hardware prefetchers).
        let next_codes: [&[[u8; BLOCK_BYTES]]; TILE_ROWS] = std::array::from_fn(|i| {
            let row = r0 + TILE_ROWS + i;
            if row < rows { codes[row * rb..][..n * BLOCK_BYTES].as_chunks().0 } else { &[] }
        });
        for b in 0..n {
            if b % (64 / BLOCK_BYTES) == 0 {
                for next in &next_codes {
                    if let Some(line) = next.get(b) {
                        // SAFETY: a prefetch reads nothing; the address is inside `codes`.
                        _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
                    }
                }
            }
            if b + AHEAD < n {
                decode(b + AHEAD, &mut weights[(b + AHEAD) % WEIGHT_SLOTS].0);
            }
            // SAFETY: AMX is configured (above) for these shapes: tile 1 reads `M` rows of 32
            // bytes from `a` at `b * 32`, `a_stride` apart (all inside `a`), tile 2 the 8 rows
            // of `weights[b % 2]`, and tile 0 is stored as `M` rows of 64 bytes into
            // `sums[b % 2]`.
            unsafe {
                asm!(
                    "tileloadd tmm1, [{a} + {a_stride}]",
                    "tileloadd tmm2, [{w} + {w_stride}]",
                    "tilezero tmm0",
                    "tdpbssd tmm0, tmm1, tmm2",
                    "tilestored [{s} + {s_stride}], tmm0",
                    a = in(reg) a.as_ptr().add(b * BLOCK),
                    a_stride = in(reg) a_stride,
                    w = in(reg) weights[b % WEIGHT_SLOTS].0.as_ptr(),
                    w_stride = in(reg) 64usize,
                    s = in(reg) sums[b % SUM_SLOTS].0.as_mut_ptr(),
                    s_stride = in(reg) 64usize,
                    options(nostack),
                )
            };
            if b >= BEHIND {
                scale(b - BEHIND, &sums[(b - BEHIND) % SUM_SLOTS].0, &mut acc);
            }
        }
        for b in n.saturating_sub(BEHIND)..n {
            scale(b, &sums[b % SUM_SLOTS].0, &mut acc);
        }
        for (t, acc) in acc.iter().enumerate() {
            let mut lanes = [0.0f32; TILE_ROWS];
            // SAFETY: 64 writable bytes.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc) };
            for (i, &v) in lanes.iter().enumerate().take(rr) {
                if let Some(o) = out.get_mut((r0 + i) * stride + t) {
                    *o = v;
                }
            }
        }
        r0 += rr;
    }
    row_scales.put_back();
    // SAFETY: AMX is available; releasing the tiles lets the kernel skip saving them.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The half scales ([`mxfp4::HALF_SCALES`]) of 16 rows for every block, one vector a block
/// (lane `i` for row `i`), made once per 16 rows so that the products' loops only load them:
/// every 16 blocks, 16 bytes of each row are loaded four rows to a register, two byte permutes
/// a register pair make them 8 blocks of 8 rows, and one byte permute a block puts each row's
/// byte into its lane. (No gathers: on this kind of Xeon with current microcode they cost
/// several times as much.) Its buffers are this thread's, reused from call to call
/// ([`RowScales::take`], [`RowScales::put_back`]): a decoded token makes thousands of calls.
#[derive(Default)]
struct RowScales {
    /// A copy of the rows' scale bytes, row after row, `stride` apart, where they cannot be
    /// read in place (made on first use).
    bytes: Vec<u8>,
    /// Blocks a row, rounded up to whole 16-byte loads.
    stride: usize,
    /// Blocks a row.
    blocks: usize,
    /// Block `b`'s half scales of the 16 rows.
    half: Vec<Lines<f32, TILE_ROWS>>,
}

/// `vpermt2b` indices that take byte `8 i` of rows 0..8 (first register, row `i` in 64-bit
/// lane `i`) and 8..16 (second) into byte `4 i`, the low byte of 32-bit lane `i`; adding `k`
/// takes byte `8 i + k` (block `k` of the eight). The other bytes are masked off.
static ROW_BYTES: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 16 {
        t[4 * i] = (8 * i) as u8;
        i += 1;
    }
    t
};

/// `vpermt2b` indices that take, from two registers of four rows' 16 bytes each (row `i` in
/// 128-bit lane `i % 4` of register `i / 4`), bytes `0..8` of each of the 8 rows into 64-bit
/// lane `i`; adding 8 takes bytes `8..16`.
static EIGHT_OF_EACH_ROW: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 8 {
        let mut k = 0;
        while k < 8 {
            t[8 * i + k] = (if i < 4 { 16 * i + k } else { 64 + 16 * (i - 4) + k }) as u8;
            k += 1;
        }
        i += 1;
    }
    t
};

/// The low byte of each 32-bit lane.
const LOW_BYTES: __mmask64 = 0x1111_1111_1111_1111;

thread_local! {
    /// The buffers of the last [`RowScales`] this thread put back.
    static ROW_SCALES: std::cell::Cell<RowScales> = std::cell::Cell::new(RowScales::default());
}

impl RowScales {
    /// A table for rows of `blocks` blocks, in this thread's buffers (allocating only when
    /// they are too small); give them back with [`RowScales::put_back`].
    fn take(blocks: usize) -> Self {
        let mut scales = ROW_SCALES.take();
        scales.stride = blocks.next_multiple_of(16);
        scales.blocks = blocks;
        scales.half.resize(blocks, Lines([0.0; TILE_ROWS]));
        scales
    }

    /// Keeps the buffers for this thread's next [`RowScales::take`].
    fn put_back(self) {
        ROW_SCALES.set(self);
    }

    /// Takes the scales of rows `r0 .. r0 + rows` (at most 16) of `scales` (`bpr` a row); the
    /// lanes of rows past those get scale 1 (their codes are zero).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi")]
    fn fill(&mut self, scales: &[u8], r0: usize, rows: usize, bpr: usize) {
        let (blocks, stride) = (self.blocks, self.stride);
        let start = r0 * bpr;
        // The loads read `stride` bytes from each row's start: straight from `scales` where
        // that stays inside it, else from a copy.
        let last_row = start + (TILE_ROWS - 1) * bpr;
        let (source, step): (&[u8], usize) =
            if rows >= TILE_ROWS && scales.len().saturating_sub(last_row) >= stride {
                (&scales[start..], bpr)
            } else {
                self.bytes.resize(TILE_ROWS * stride, 0);
                let mut given = scales[start..].chunks_exact(bpr).take(rows.min(TILE_ROWS));
                for line in self.bytes.chunks_exact_mut(stride) {
                    match given.next() {
                        Some(row) => line[..blocks].copy_from_slice(&row[..blocks]),
                        None => line.fill(127),
                    }
                }
                (&self.bytes[..], stride)
            };
        // SAFETY: 64 readable bytes each; unaligned loads are allowed.
        let (row_bytes, eight) = unsafe {
            (
                _mm512_loadu_si512(ROW_BYTES.as_ptr().cast()),
                _mm512_loadu_si512(EIGHT_OF_EACH_ROW.as_ptr().cast()),
            )
        };
        let next_eight = _mm512_add_epi8(eight, _mm512_set1_epi8(8));
        for c in (0..blocks).step_by(16) {
            // Rows `4 j .. 4 j + 4`, bytes `c .. c + 16` of each.
            macro_rules! four {
                ($j:expr) => {{
                    let j: usize = $j;
                    // SAFETY: row `i`'s 16 bytes from `c` lie inside `source` (checked above
                    // for `scales`; the copy has `stride` bytes a row); unaligned loads are
                    // allowed.
                    let row = |i: usize| unsafe {
                        _mm_loadu_si128(source[(4 * j + i) * step + c..][..16].as_ptr().cast())
                    };
                    let v = _mm512_castsi128_si512(row(0));
                    let v = _mm512_inserti32x4::<1>(v, row(1));
                    let v = _mm512_inserti32x4::<2>(v, row(2));
                    _mm512_inserti32x4::<3>(v, row(3))
                }};
            }
            let z = [four!(0), four!(1), four!(2), four!(3)];
            // Whether every scale byte of these blocks is in 2..=254, where the half scale is
            // an exponent shift (each 128-bit lane holds one row's 16 bytes).
            let here = (blocks - c).min(16);
            let valid: __mmask64 = ((1u64 << here) - 1) * 0x0001_0001_0001_0001;
            let normal = z.iter().all(|&v| {
                let shifted = _mm512_sub_epi8(v, _mm512_set1_epi8(2));
                _mm512_mask_cmpge_epu8_mask(valid, shifted, _mm512_set1_epi8(253u8 as i8)) == 0
            });
            // Blocks `c .. c + 8` and `c + 8 .. c + 16`, rows 0..8 and 8..16.
            let halves = [
                (_mm512_permutex2var_epi8(z[0], eight, z[1]), _mm512_permutex2var_epi8(z[2], eight, z[3])),
                (
                    _mm512_permutex2var_epi8(z[0], next_eight, z[1]),
                    _mm512_permutex2var_epi8(z[2], next_eight, z[3]),
                ),
            ];
            for (h, (low, high)) in halves.into_iter().enumerate() {
                for k in 0..8.min(blocks.saturating_sub(c + 8 * h)) {
                    let index = _mm512_add_epi8(row_bytes, _mm512_set1_epi8(k as i8));
                    let e = _mm512_maskz_permutex2var_epi8(LOW_BYTES, low, index, high);
                    let half = if normal { Self::half_of_normal(e) } else { Self::half_of(e) };
                    // SAFETY: 64 writable aligned bytes.
                    unsafe { _mm512_store_ps(self.half[c + 8 * h + k].0.as_mut_ptr(), half) };
                }
            }
        }
    }

    /// The 16 rows' half scales of block `b` (below the `blocks` given to [`RowScales::take`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn half(&self, b: usize) -> __m512 {
        // SAFETY: 64 readable aligned bytes.
        unsafe { _mm512_load_ps(self.half[b].0.as_ptr()) }
    }

    /// The half scales of scale bytes `e` in 2..=254 in the low bytes of `e`'s lanes (the
    /// others zero): `2^(e - 128)` is the f32 with biased exponent `e - 1`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn half_of_normal(e: __m512i) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1))))
    }

    /// The half scales of any scale bytes in the low bytes of `e`'s lanes (the others zero):
    /// [`RowScales::half_of_normal`] where all are in 2..=254, the subnormal and NaN ones (`e`
    /// 0, 1, 255) looked up.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn half_of(e: __m512i) -> __m512 {
        let normal =
            _mm512_cmplt_epu32_mask(_mm512_sub_epi32(e, _mm512_set1_epi32(2)), _mm512_set1_epi32(253));
        let v = Self::half_of_normal(e);
        if normal == 0xffff {
            return v;
        }
        let mut bytes = [0u32; TILE_ROWS];
        // SAFETY: 64 writable bytes.
        unsafe { _mm512_storeu_si512(bytes.as_mut_ptr().cast(), e) };
        let lanes = bytes.map(|e| mxfp4::HALF_SCALES[e as usize & 0xff]);
        // SAFETY: 64 readable bytes.
        unsafe { _mm512_loadu_ps(lanes.as_ptr()) }
    }
}

/// The sums of 16 rows' two blocks of a pair, from four vectors of four rows each in which
/// 32-bit lane `4 k + i` holds row `i`'s sum of quarter `k` of the pair's `vpdpbusd` lanes
/// (quarters 0 and 2 the first block, 1 and 3 the second): the first block's 16 sums, then the
/// second's (lane `i` for row `i`). Integer adds, exact.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn block_sums(q: [__m512i; 4]) -> (__m512i, __m512i) {
    // Rows 0..4's first block, their second, rows 4..8's first, their second.
    let halves = |a: __m512i, b: __m512i| {
        _mm512_add_epi32(_mm512_shuffle_i64x2::<0x44>(a, b), _mm512_shuffle_i64x2::<0xee>(a, b))
    };
    let (low, high) = (halves(q[0], q[1]), halves(q[2], q[3]));
    (_mm512_shuffle_i64x2::<0x88>(low, high), _mm512_shuffle_i64x2::<0xdd>(low, high))
}

/// Pairs of adjacent 32-bit lanes of `a` and of `b` added (`a`'s two sums, then `b`'s, in each
/// 128-bit lane): a signed saturating pack to 16 bits and a multiply-add by ones, exact while
/// every lane fits in 16 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn add_adjacent(a: __m512i, b: __m512i) -> __m512i {
    _mm512_madd_epi16(_mm512_packs_epi32(a, b), _mm512_set1_epi16(1))
}

/// One input's [`mxfp4_dot_q8_amx`] with AVX-512 VNNI alone, 16 rows at a time, bit for bit the
/// same (the scalar definition): a tile product and the store of its sums take about 10 ns
/// however few inputs there are, which for a single input (decoding) is slower than this.
///
/// Per row and block pair, as [`super::x86::mxfp4_dot_q8_vnni`] (its layout of
/// [`QuantizedX::mxfp4_groups`]): the pair's codes looked up into weights plus 12, one
/// `vpdpbusd` from the input's bias, giving in each 32-bit lane an exact partial sum of four
/// products of one block, at most `4 * 12 * 127 = 6096` in magnitude. The 16 rows' partials are
/// folded into each row's two block sums: two rounds of [`add_adjacent`] (sums of at most four
/// lanes, 24384, still fit in 16 bits) and 128-bit shuffles with 32-bit adds
/// ([`block_sums`]). The sums are then scaled and added in block order.
///
/// # Safety
/// The CPU must have AVX-512 (F, BW, VL, VBMI) and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
unsafe fn mxfp4_dot_q8_rows16(
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &QuantizedX,
    out: &mut [f32],
    stride: usize,
) {
    const PAIR_BYTES: usize = 2 * BLOCK_BYTES;
    // The caller ([`mxfp4_dot_q8_amx`]) has checked that `codes` and `scales` hold `rows` rows.
    let (rb, bpr) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    let n = bpr.min(2 * x.mxfp4_groups().len()).min(2 * x.scales().len());
    let (pairs, odd) = (n / 2, n % 2 == 1);
    let (groups, group_scales) = (&x.mxfp4_groups()[..n.div_ceil(2)], &x.scales()[..n.div_ceil(2)]);
    // SAFETY: 16 readable bytes; unaligned loads are allowed.
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(FP4_DOUBLED_OFFSET.as_ptr().cast()) });
    let nibbles = _mm512_set1_epi8(0x0f);
    let mut row_scales = RowScales::take(n);
    // A last group of fewer than 16 rows is copied here with zero rows after it.
    let mut padded = vec![0u8; if rows.is_multiple_of(TILE_ROWS) { 0 } else { TILE_ROWS * rb }];
    let mut r0 = 0;
    while r0 < rows {
        let rr = TILE_ROWS.min(rows - r0);
        row_scales.fill(scales, r0, rr, bpr);
        let block: &[u8] = if rr == TILE_ROWS {
            &codes[r0 * rb..][..TILE_ROWS * rb]
        } else {
            padded[..rr * rb].copy_from_slice(&codes[r0 * rb..][..rr * rb]);
            &padded
        };
        // The next 16 rows, prefetched into L2 a line at a time as these reach the same place.
        let next = codes.get((r0 + TILE_ROWS) * rb..).unwrap_or(&[]);
        let next_rows = rows.saturating_sub(r0 + TILE_ROWS).min(TILE_ROWS);
        let mut acc = _mm512_setzero_ps();
        // Pair `$g` of the 16 rows, each row's code bytes in both halves of a register with
        // the upper half's high nibbles moved down (`$load(i)` for row `i`), into `acc` (at
        // most `$blocks` of its blocks).
        macro_rules! pair {
            ($g:expr, $blocks:expr, $load:expr) => {{
                let g: usize = $g;
                let (group, s) = (&groups[g], _mm512_set1_ps(group_scales[g]));
                // SAFETY: `codes` and `bias` are 64 aligned bytes each.
                let (p, bias) = unsafe {
                    (
                        _mm512_load_si512(group.codes.as_ptr().cast()),
                        _mm512_load_si512(group.bias.as_ptr().cast()),
                    )
                };
                let product = |i: usize| {
                    let w = _mm512_shuffle_epi8(table, _mm512_and_si512($load(i), nibbles));
                    _mm512_dpbusd_epi32(bias, w, p)
                };
                // Rows `4 j .. 4 j + 4`: their quarter sums.
                let quad = |j: usize| {
                    let a = add_adjacent(product(4 * j), product(4 * j + 1));
                    let b = add_adjacent(product(4 * j + 2), product(4 * j + 3));
                    add_adjacent(a, b)
                };
                let (first, second) = block_sums([quad(0), quad(1), quad(2), quad(3)]);
                for (b, sum) in [first, second].into_iter().enumerate().take($blocks) {
                    let scale = _mm512_mul_ps(row_scales.half(2 * g + b), s);
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(sum)));
                }
            }};
        }
        let base = block.as_ptr();
        for g in 0..pairs {
            let at = g * PAIR_BYTES;
            if at.is_multiple_of(64) {
                for i in 0..next_rows {
                    _mm_prefetch::<_MM_HINT_T1>(next[i * rb + at..].as_ptr().cast());
                }
            }
            // SAFETY: row `i < 16` of `block` (16 rows of `rb` bytes) holds whole pair `g <
            // pairs` at `i * rb + at`: 32 readable bytes.
            pair!(g, 2, |i: usize| unsafe { load_pair_high_nibbles_up(base.add(i * rb + at)) });
        }
        if odd {
            // The last block with a zero second block (weight 12, which the bias cancels).
            let at = pairs * PAIR_BYTES;
            pair!(pairs, 1, |i: usize| {
                let row = &block[i * rb + at..][..BLOCK_BYTES];
                // SAFETY: 16 readable bytes; unaligned loads are allowed.
                high_nibbles_up(_mm512_broadcast_i64x4(_mm256_zextsi128_si256(unsafe {
                    _mm_loadu_si128(row.as_ptr().cast())
                })))
            });
        }
        let mut lanes = [0.0f32; TILE_ROWS];
        // SAFETY: 64 writable bytes.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        for (i, &v) in lanes.iter().enumerate().take(rr) {
            if let Some(o) = out.get_mut((r0 + i) * stride) {
                *o = v;
            }
        }
        r0 += rr;
    }
    row_scales.put_back();
}
