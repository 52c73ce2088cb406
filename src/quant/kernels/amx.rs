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
use super::x86::{FP4_DOUBLED_OFFSET, high_nibbles_up};
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
    let mut row_scales = RowScales::new(n);
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
    // SAFETY: AMX is available; releasing the tiles lets the kernel skip saving them.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The half scales ([`mxfp4::HALF_SCALES`]) of 16 rows, block by block, as one vector a block
/// (lane `i` for row `i`): the rows' scale bytes copied once per 16 rows, then one gather a
/// block.
struct RowScales {
    /// The rows' scale bytes, row after row, `stride` apart.
    bytes: Vec<u8>,
    /// Blocks a row, plus 3 (so that the gather's 4-byte reads stay inside).
    stride: usize,
    /// The gather's offsets of block 0: `i * stride`.
    offsets: __m512i,
}

impl RowScales {
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn new(blocks: usize) -> Self {
        let stride = blocks + 3;
        let offsets = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(stride as i32),
        );
        RowScales { bytes: vec![0; TILE_ROWS * stride], stride, offsets }
    }

    /// Takes the scales of rows `r0 .. r0 + rows` (at most 16) of `scales` (`bpr` a row); the
    /// lanes of rows past those keep what they held (their codes are zero).
    fn fill(&mut self, scales: &[u8], r0: usize, rows: usize, bpr: usize) {
        let blocks = self.stride - 3;
        for (i, row) in scales[r0 * bpr..].chunks_exact(bpr).take(rows.min(TILE_ROWS)).enumerate() {
            self.bytes[i * self.stride..][..blocks].copy_from_slice(&row[..blocks]);
        }
    }

    /// The 16 rows' half scales of block `b` (below the `blocks` given to [`RowScales::new`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn half(&self, b: usize) -> __m512 {
        Self::half_of(self.bytes_from(b))
    }

    /// Per row (lane), its scale bytes of blocks `b .. b + 4` (past the last: zeros or other
    /// rows' bytes), block `b` in the low byte.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn bytes_from(&self, b: usize) -> __m512i {
        assert!(b + 3 < self.stride);
        // SAFETY: every offset plus `b` is a row's start plus at most `blocks - 1`, and 4 bytes
        // from there lie inside `bytes` (`blocks + 3` a row).
        unsafe {
            _mm512_i32gather_epi32::<1>(
                _mm512_add_epi32(self.offsets, _mm512_set1_epi32(b as i32)),
                self.bytes.as_ptr().cast(),
            )
        }
    }

    /// The half scales of the scale bytes in the low bytes of `e`'s lanes.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn half_of(e: __m512i) -> __m512 {
        let e = _mm512_and_si512(e, _mm512_set1_epi32(0xff));
        // `2^(e - 128)` is the f32 with biased exponent `e - 1` for `e` in 2..=254; the
        // subnormal and NaN ones (`e` 0, 1, 255) are looked up.
        let normal =
            _mm512_cmplt_epu32_mask(_mm512_sub_epi32(e, _mm512_set1_epi32(2)), _mm512_set1_epi32(253));
        let v = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1))));
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

/// `vpermt2d` indices of the folds in [`mxfp4_dot_q8_rows16`]: level `l` (0, 1, 2) adds
/// index set 0 and 1 of two vectors of `2^l` rows each into one of `2^(l+1)` rows with half as
/// many partial sums per row and block. Level 0's inputs are `vpdpbusd` results (block `b`'s 8
/// partials in 32-bit lanes `4 b .. 4 b + 4` and `8 + 4 b .. 12 + 4 b`); every other vector has
/// lane `(2 row + block) * parts + part`.
static FOLDS: [[[i32; 16]; 2]; 3] = {
    let mut t = [[[0i32; 16]; 2]; 3];
    let mut level = 0;
    while level < 3 {
        let rows_in = 1 << level;
        let parts_out = 4 >> level;
        let parts_in = 2 * parts_out;
        let mut set = 0;
        while set < 2 {
            let mut o = 0;
            while o < 16 {
                let part = o % parts_out + set * parts_out;
                let block = (o / parts_out) % 2;
                let row = o / (2 * parts_out);
                let (second, row) = (row >= rows_in, row % rows_in);
                let lane = if level == 0 {
                    if part < 4 { 4 * block + part } else { 8 + 4 * block + part - 4 }
                } else {
                    (2 * row + block) * parts_in + part
                };
                t[level][set][o] = (lane + if second { 16 } else { 0 }) as i32;
                o += 1;
            }
            set += 1;
        }
        level += 1;
    }
    t
};

/// `vpermt2d` indices that take block `b`'s sums of rows 0..8 (first vector, lane `2 row + b`)
/// and 8..16 (second) into one vector of 16 rows.
static BLOCK_SUMS: [[i32; 16]; 2] = {
    let mut t = [[0i32; 16]; 2];
    let mut b = 0;
    while b < 2 {
        let mut o = 0;
        while o < 16 {
            t[b][o] = ((o % 8) * 2 + b + if o >= 8 { 16 } else { 0 }) as i32;
            o += 1;
        }
        b += 1;
    }
    t
};

/// One input's [`mxfp4_dot_q8_amx`] with AVX-512 VNNI alone, 16 rows at a time, bit for bit the
/// same (the scalar definition): a tile product and the store of its sums take about 10 ns
/// however few inputs there are, which for a single input (decoding) is slower than this.
///
/// Per row and block pair, as [`super::x86::mxfp4_dot_q8_vnni`] (its layout of
/// [`QuantizedX::mxfp4_groups`]): the pair's codes looked up into weights plus 12, one
/// `vpdpbusd` from the input's bias, giving 8 exact partial sums of each block. The 16 rows'
/// partials are then folded (`vpermt2d`, integer adds: exact in any order) into each row's
/// two block sums, which are scaled and added in block order.
///
/// # Safety
/// The CPU must have AVX-512 (F, BW, VL) and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
    let pairs = n.div_ceil(2);
    let (groups, group_scales) = (&x.mxfp4_groups()[..pairs], &x.scales()[..pairs]);
    // SAFETY: 16 readable bytes; unaligned loads are allowed.
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(FP4_DOUBLED_OFFSET.as_ptr().cast()) });
    let nibbles = _mm512_set1_epi8(0x0f);
    // SAFETY: as above, 64 bytes each.
    let folds = FOLDS.map(|l| l.map(|i| unsafe { _mm512_loadu_si512(i.as_ptr().cast()) }));
    // SAFETY: as above.
    let block_sums = BLOCK_SUMS.map(|i| unsafe { _mm512_loadu_si512(i.as_ptr().cast()) });
    let fold = |level: usize, a: __m512i, b: __m512i| {
        let [i, j] = folds[level];
        _mm512_add_epi32(_mm512_permutex2var_epi32(a, i, b), _mm512_permutex2var_epi32(a, j, b))
    };
    let mut row_scales = RowScales::new(n);
    let zero_pairs = vec![[0u8; PAIR_BYTES]; if rows.is_multiple_of(TILE_ROWS) { 0 } else { n / 2 }];
    let mut r0 = 0;
    while r0 < rows {
        let rr = TILE_ROWS.min(rows - r0);
        row_scales.fill(scales, r0, rr, bpr);
        // Whole pairs of each row (rows past the last: zeros), and the last odd block.
        let row_pairs: [&[[u8; PAIR_BYTES]]; TILE_ROWS] = std::array::from_fn(|i| {
            if i < rr { codes[(r0 + i) * rb..][..n / 2 * PAIR_BYTES].as_chunks().0 } else { &zero_pairs[..] }
        });
        let last_block: [&[u8]; TILE_ROWS] = std::array::from_fn(|i| {
            if i < rr && n % 2 == 1 {
                &codes[(r0 + i) * rb + (n - 1) * BLOCK_BYTES..][..BLOCK_BYTES]
            } else {
                &[0; BLOCK_BYTES]
            }
        });
        // The next 16 rows, prefetched into L2 a line at a time as these reach the same place.
        let next_codes: [&[u8]; TILE_ROWS] = std::array::from_fn(|i| {
            let row = r0 + TILE_ROWS + i;
            if row < rows { &codes[row * rb..][..n * BLOCK_BYTES] } else { &[] }
        });
        let mut acc = _mm512_setzero_ps();
        for (g, (group, &s)) in groups.iter().zip(group_scales).enumerate() {
            let at = g * PAIR_BYTES;
            if at.is_multiple_of(64) {
                for next in next_codes.iter().filter(|c| c.len() > at) {
                    _mm_prefetch::<_MM_HINT_T1>(next[at..].as_ptr().cast());
                }
            }
            // SAFETY: `codes` and `bias` are 64 aligned bytes each.
            let (p, bias) = unsafe {
                (
                    _mm512_load_si512(group.codes.as_ptr().cast()),
                    _mm512_load_si512(group.bias.as_ptr().cast()),
                )
            };
            let partials: [__m512i; TILE_ROWS] = std::array::from_fn(|i| {
                let v = match row_pairs[i].get(g) {
                    // SAFETY: 32 readable bytes; unaligned loads are allowed.
                    Some(pair) => _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(pair.as_ptr().cast()) }),
                    // A last odd block: a zero second block (weight 12, which the bias cancels).
                    // SAFETY: 16 readable bytes.
                    None => _mm512_broadcast_i64x4(_mm256_zextsi128_si256(unsafe {
                        _mm_loadu_si128(last_block[i].as_ptr().cast())
                    })),
                };
                let w = _mm512_shuffle_epi8(table, _mm512_and_si512(high_nibbles_up(v), nibbles));
                _mm512_dpbusd_epi32(bias, w, p)
            });
            let two: [__m512i; 8] = std::array::from_fn(|j| fold(0, partials[2 * j], partials[2 * j + 1]));
            let four: [__m512i; 4] = std::array::from_fn(|j| fold(1, two[2 * j], two[2 * j + 1]));
            let (low, high) = (fold(2, four[0], four[1]), fold(2, four[2], four[3]));
            let s = _mm512_set1_ps(s);
            // Both blocks' scale bytes in one gather.
            let e = row_scales.bytes_from(2 * g);
            for (b, sums) in block_sums.iter().enumerate().take(n - 2 * g) {
                let sum = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(low, *sums, high));
                let e = if b == 0 { e } else { _mm512_srli_epi32::<8>(e) };
                let scale = _mm512_mul_ps(RowScales::half_of(e), s);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(scale, sum));
            }
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
}
