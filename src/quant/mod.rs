//! Weight formats and the matrix-vector products over them.
//!
//! A [`Matrix`] is `rows x cols`, row-major, one row per output: `y = W x` takes `cols`
//! inputs to `rows` outputs. Each format has a scalar reference kernel in [`reference`];
//! faster kernels are added beside it and tested against it.

pub mod buffer;
pub mod format;
pub mod int4;
pub mod int8;
pub mod kernels;
pub mod mxfp4;
pub mod reference;

use rayon::prelude::*;

pub use buffer::{AlignedRows, WeightBuf};
pub use kernels::KernelPath;
use kernels::q8::QuantizedX;

use crate::error::{Error, Result};

/// How a matrix's elements are stored.
#[derive(Clone, Debug)]
pub enum MatrixData {
    /// 32-bit floats.
    F32(WeightBuf<f32>),
    /// bfloat16 (the upper half of an f32), widened exactly to f32 before use.
    Bf16(WeightBuf<u16>),
    /// INT8, one f32 scale per row (see [`int8`]).
    Int8Rows {
        /// `rows * cols` codes.
        codes: WeightBuf<i8>,
        /// `rows` scales.
        scales: WeightBuf<f32>,
    },
    /// INT4 in groups of 64 inputs with an f16 scale each (see [`int4`]).
    Int4G64 {
        /// `rows * int4::row_bytes(cols)` code bytes.
        codes: WeightBuf<u8>,
        /// `rows * int4::groups(cols)` f16 scales.
        scales: WeightBuf<u16>,
    },
    /// MXFP4 as released: blocks of 32 E2M1 codes with an E8M0 scale each (see [`mxfp4`]).
    Mxfp4 {
        /// `rows * mxfp4::row_bytes(cols)` code bytes.
        codes: WeightBuf<u8>,
        /// `rows * mxfp4::blocks(cols)` E8M0 scale bytes.
        scales: WeightBuf<u8>,
    },
}

impl MatrixData {
    /// Short name of the storage format.
    pub fn format_name(&self) -> &'static str {
        match self {
            MatrixData::F32(_) => "f32",
            MatrixData::Bf16(_) => "bf16",
            MatrixData::Int8Rows { .. } => "int8-row",
            MatrixData::Int4G64 { .. } => "int4-gs64",
            MatrixData::Mxfp4 { .. } => "mxfp4",
        }
    }
}

/// A weight matrix: `rows` outputs by `cols` inputs, row-major.
#[derive(Clone, Debug)]
pub struct Matrix {
    /// Output dimension.
    pub rows: usize,
    /// Input (contraction) dimension.
    pub cols: usize,
    /// The elements.
    pub data: MatrixData,
}

/// Below this many multiply-adds a product runs on the calling thread: splitting it across
/// the pool would cost more than it saves.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// Inputs per task of [`transpose_into`]: one cache line of a row of `[rows, n]` products.
const TRANSPOSE_INPUTS: usize = 16;

/// `y[t * rows + r] = out[r * n + t]`: the `[rows, n]` products of a batched product as the
/// `[n, rows]` outputs. Tasks take [`TRANSPOSE_INPUTS`] inputs each, reading `out` a cache
/// line per row and writing as many sequential streams, on the thread pool when it is large:
/// element by element on one thread this was 4% of a 64-token prefill, with the other thread
/// waiting.
fn transpose_into(out: &[f32], n: usize, y: &mut [f32]) {
    let rows = out.len().checked_div(n).unwrap_or(0);
    if rows == 0 {
        return;
    }
    let block = |(b, ys): (usize, &mut [f32])| {
        let t0 = b * TRANSPOSE_INPUTS;
        for (r, vals) in out.chunks_exact(n).enumerate() {
            for (y_t, &v) in ys.chunks_exact_mut(rows).zip(&vals[t0..]) {
                y_t[r] = v;
            }
        }
    };
    let chunk = TRANSPOSE_INPUTS * rows;
    if out.len() < PARALLEL_MIN_WORK {
        y.chunks_mut(chunk).enumerate().for_each(block);
    } else {
        y.par_chunks_mut(chunk).enumerate().for_each(block);
    }
}

/// `y = [W_0; W_1; ...] x` on `path` for parts of one format and input width (checked by
/// the callers), with INT4 and INT8 matrices on quantized activations if `quantize`: the
/// multi-row kernels with one input, the parts' rows split across the pool as one matrix's.
fn parts_matvec(parts: &[&Matrix], path: KernelPath, quantize: bool, x: &[f32], y: &mut [f32]) {
    let Some(first) = parts.first() else { return };
    assert_eq!(x.len(), first.cols, "matvec input length");
    let integer = first.integer_product().is_some();
    let qx = (integer && quantize).then(|| QuantizedX::new(x));
    // The kernels read `x` from a copy aligned to cache lines (padded to whole INT4 groups,
    // in the order the MXFP4 and BF16 kernels read): cheap next to the product, and no vector load
    // then straddles two lines.
    let aligned = qx.is_none().then(|| first.arranged_inputs(path, x, 1));
    let inputs =
        Inputs { x: aligned.as_ref().map_or_else(Vec::new, |a| a.rows().collect()), q: qx.iter().collect() };
    // Outputs `first..first + ys.len()` of the stacked rows, part by part.
    let task = |first: usize, ys: &mut [f32]| {
        let (mut at, mut ys, mut part_start) = (first, ys, 0);
        for m in parts {
            let part_end = part_start + m.rows;
            if at < part_end && !ys.is_empty() {
                let (now, rest) = ys.split_at_mut((part_end - at).min(ys.len()));
                m.rows_dot_multi(path, at - part_start, &inputs, now);
                at += now.len();
                ys = rest;
            }
            part_start = part_end;
        }
    };
    let rows = y.len();
    if rows * first.cols < PARALLEL_MIN_WORK {
        task(0, y);
    } else {
        // About eight pieces a thread (a power of two), for balance.
        let tasks = rayon::current_num_threads().max(1) * 8;
        let min_rows = (PARALLEL_MIN_WORK / first.cols.max(1)).max(1);
        let pieces = rows.div_ceil(rows.div_ceil(tasks).max(min_rows)).next_power_of_two();
        split_in_halves(0, y, pieces, &task);
    }
}

/// Runs `task(first, ys)` over `pieces` pieces of the outputs `ys` (output `first` onwards;
/// `pieces` a power of two), on the thread pool: halves `ys` at the whole number of
/// [`kernels::TASK_ROWS`] nearest its middle, and each half into `pieces / 2` the same way,
/// so pieces differ by at most `TASK_ROWS` rows (fewer pieces where `ys` has fewer
/// `TASK_ROWS`).
///
/// Equal chunks of a fixed size had given 2880 rows 15 chunks, one thread 8 of them and the
/// other 7, and a product waited about a fifteenth of its time for the slower thread. Halving
/// keeps any power-of-two number of threads' shares equal, and each thread goes through one
/// contiguous part of the matrix unless it steals.
fn split_in_halves<F>(first: usize, ys: &mut [f32], pieces: usize, task: &F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let units = ys.len().div_ceil(kernels::TASK_ROWS);
    if pieces < 2 || units < 2 {
        return task(first, ys);
    }
    let mid = units / 2 * kernels::TASK_ROWS;
    let (low, high) = ys.split_at_mut(mid);
    rayon::join(
        || split_in_halves(first, low, pieces / 2, task),
        || split_in_halves(first + mid, high, pieces / 2, task),
    );
}

/// Weight bytes in one block of rows of [`Matrix::matmul`] (one task for the thread pool): the
/// block stays in L2 while the passes of inputs go over it.
const MATMUL_BLOCK_BYTES: usize = 128 << 10;

/// Fewest rows in a block of [`Matrix::matmul`], whatever [`MATMUL_BLOCK_BYTES`] gives: a
/// block is also the unit over which the weights stream from memory, and a few wide rows (16
/// BF16 rows of 2880 are 92 KiB) end the stream before the prefetchers have reached speed. On
/// Zen 5, 64 rows instead of 16 made BF16 products of 4 and 8 inputs (a batched decode's
/// dense weights) from memory 10-60% faster on one thread and 5-18% on two, and left 64
/// inputs and MXFP4 blocks (80 rows at 128 KiB) as they were (docs/perf.md, 2026-12-05).
const MATMUL_BLOCK_MIN_ROWS: usize = 64;
const _: () = assert!(MATMUL_BLOCK_MIN_ROWS >= kernels::ROW_BLOCK);

/// The inputs of a batched product: each input row (padded to whole INT4 groups), or each
/// input quantized ([`kernels::q8`]) when INT4 and INT8 rows use the integer kernels.
struct Inputs<'a> {
    /// Float input rows (empty when `q` is used).
    x: Vec<&'a [f32]>,
    /// Quantized input rows (empty when `x` is used).
    q: Vec<&'a QuantizedX>,
}

impl Matrix {
    /// Builds a matrix, checking that `data` holds exactly what `rows x cols` needs.
    pub fn new(name: &str, rows: usize, cols: usize, data: MatrixData) -> Result<Self> {
        let (have, want) = match &data {
            MatrixData::F32(b) => (vec![b.len()], vec![rows * cols]),
            MatrixData::Bf16(b) => (vec![b.len()], vec![rows * cols]),
            MatrixData::Int8Rows { codes, scales } => {
                (vec![codes.len(), scales.len()], vec![rows * cols, rows])
            }
            MatrixData::Int4G64 { codes, scales } => (
                vec![codes.len(), scales.len()],
                vec![rows * int4::row_bytes(cols), rows * int4::groups(cols)],
            ),
            MatrixData::Mxfp4 { codes, scales } => {
                if !cols.is_multiple_of(mxfp4::BLOCK) {
                    return Err(Error::tensor(
                        name,
                        format!("mxfp4 [{rows}, {cols}]: inputs are not a multiple of {}", mxfp4::BLOCK),
                    ));
                }
                (
                    vec![codes.len(), scales.len()],
                    vec![rows * mxfp4::row_bytes(cols), rows * mxfp4::blocks(cols)],
                )
            }
        };
        if have != want {
            return Err(Error::tensor(
                name,
                format!("{} [{rows}, {cols}] holds {have:?} elements, expected {want:?}", data.format_name()),
            ));
        }
        Ok(Matrix { rows, cols, data })
    }

    /// The first of `parts` and their rows in all, where they can stand one under another: at
    /// least one part, all of the first one's format and input width. Errors name `name` and
    /// the part that does not fit.
    fn stacked_rows<'m>(name: &str, parts: &[&'m Matrix]) -> Result<(&'m Matrix, usize)> {
        let Some(&first) = parts.first() else {
            return Err(Error::tensor(name, "stacking no matrices"));
        };
        let mut rows = 0usize;
        for m in parts {
            if m.cols != first.cols || m.format_name() != first.format_name() {
                return Err(Error::tensor(
                    name,
                    format!(
                        "cannot stack {} [{}, {}] under {} [{}, {}]",
                        m.format_name(),
                        m.rows,
                        m.cols,
                        first.format_name(),
                        first.rows,
                        first.cols
                    ),
                ));
            }
            rows = rows.checked_add(m.rows).ok_or_else(|| Error::tensor(name, "too many rows"))?;
        }
        Ok((first, rows))
    }

    /// The rows of `parts` one after another, as one matrix of their common format and
    /// input width (each row's codes and scales copied as they are, so the stacked matrix
    /// computes exactly what the parts do). A GPU runs the three attention projections as
    /// one product this way. Fails, naming `name`, on no parts, different widths or formats.
    pub fn stack_rows(name: &str, parts: &[&Matrix]) -> Result<Self> {
        fn cat<T: bytemuck::Pod>(bufs: &[&WeightBuf<T>]) -> WeightBuf<T> {
            WeightBuf::owned(bufs.iter().flat_map(|b| b.as_slice().iter().copied()).collect())
        }
        let (first, rows) = Self::stacked_rows(name, parts)?;
        let cols = first.cols;
        // Every part has the first one's format (checked above by name), so each arm
        // collects the same variant from every part.
        macro_rules! collect {
            ($variant:ident, $field:ident) => {
                parts
                    .iter()
                    .filter_map(|m| match &m.data {
                        MatrixData::$variant { $field, .. } => Some($field),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
            };
        }
        let data = match &first.data {
            MatrixData::F32(_) => MatrixData::F32(cat(&parts
                .iter()
                .filter_map(|m| if let MatrixData::F32(b) = &m.data { Some(b) } else { None })
                .collect::<Vec<_>>())),
            MatrixData::Bf16(_) => MatrixData::Bf16(cat(&parts
                .iter()
                .filter_map(|m| if let MatrixData::Bf16(b) = &m.data { Some(b) } else { None })
                .collect::<Vec<_>>())),
            MatrixData::Int8Rows { .. } => MatrixData::Int8Rows {
                codes: cat(&collect!(Int8Rows, codes)),
                scales: cat(&collect!(Int8Rows, scales)),
            },
            MatrixData::Int4G64 { .. } => MatrixData::Int4G64 {
                codes: cat(&collect!(Int4G64, codes)),
                scales: cat(&collect!(Int4G64, scales)),
            },
            MatrixData::Mxfp4 { .. } => MatrixData::Mxfp4 {
                codes: cat(&collect!(Mxfp4, codes)),
                scales: cat(&collect!(Mxfp4, scales)),
            },
        };
        Matrix::new(name, rows, cols, data)
    }

    /// An F32 matrix from owned data.
    pub fn from_f32(name: &str, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        Self::new(name, rows, cols, MatrixData::F32(WeightBuf::owned(data)))
    }

    /// Short name of the storage format.
    pub fn format_name(&self) -> &'static str {
        self.data.format_name()
    }

    /// Bytes of weight data (what one full product must read).
    pub fn byte_len(&self) -> usize {
        match &self.data {
            MatrixData::F32(b) => b.byte_len(),
            MatrixData::Bf16(b) => b.byte_len(),
            MatrixData::Int8Rows { codes, scales } => codes.byte_len() + scales.byte_len(),
            MatrixData::Int4G64 { codes, scales } => codes.byte_len() + scales.byte_len(),
            MatrixData::Mxfp4 { codes, scales } => codes.byte_len() + scales.byte_len(),
        }
    }

    /// The product of this matrix's rows with quantized activations ([`kernels::q8`]), for
    /// the formats that have one: INT4, INT8 and MXFP4 rows.
    pub fn integer_product(&self) -> Option<kernels::Product> {
        match self.data {
            MatrixData::Int4G64 { .. } => Some(kernels::Product::Int4Q8),
            MatrixData::Int8Rows { .. } => Some(kernels::Product::Int8Q8),
            MatrixData::Mxfp4 { .. } => Some(kernels::Product::Mxfp4Q8),
            MatrixData::F32(_) | MatrixData::Bf16(_) => None,
        }
    }

    /// Whether products of this matrix on `path` quantize the activations by default: int8
    /// activations are on ([`kernels::int8_activations`]) and `path` has an integer kernel for
    /// this format ([`KernelPath::has_integer_kernel`]); otherwise the exact float kernels run.
    pub fn quantizes_on(&self, path: KernelPath) -> bool {
        kernels::int8_activations()
            && path.is_available()
            && self.integer_product().is_some_and(|p| path.has_integer_kernel(p))
    }

    /// Length of the input a row dot product takes: `cols`, or whole INT4 groups.
    fn padded_cols(&self) -> usize {
        match self.data {
            MatrixData::Int4G64 { .. } => int4::groups(self.cols) * int4::GROUP,
            _ => self.cols,
        }
    }

    /// Writes row `r`, decoded to f32, into `out` (embedding lookup).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            MatrixData::F32(b) => out.copy_from_slice(&b.as_slice()[r * c..(r + 1) * c]),
            MatrixData::Bf16(b) => {
                for (o, &w) in out.iter_mut().zip(&b.as_slice()[r * c..(r + 1) * c]) {
                    *o = reference::bf16_to_f32(w);
                }
            }
            MatrixData::Int8Rows { codes, scales } => {
                int8::dequantize_row(&codes.as_slice()[r * c..(r + 1) * c], scales.as_slice()[r], out)
            }
            MatrixData::Int4G64 { codes, scales } => {
                let (rb, g) = (int4::row_bytes(c), int4::groups(c));
                int4::dequantize_row(
                    &codes.as_slice()[r * rb..(r + 1) * rb],
                    &scales.as_slice()[r * g..(r + 1) * g],
                    out,
                )
            }
            MatrixData::Mxfp4 { codes, scales } => {
                let (rb, b) = (mxfp4::row_bytes(c), mxfp4::blocks(c));
                mxfp4::dequantize_row(
                    &codes.as_slice()[r * rb..(r + 1) * rb],
                    &scales.as_slice()[r * b..(r + 1) * b],
                    out,
                )
            }
        }
    }

    /// `y = W x` on the selected kernel path ([`kernels::selected`]). Rows are split across
    /// threads for large matrices; every output is the same sequential dot product whatever
    /// the thread count, so results do not depend on it.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        self.matvec_with(kernels::selected(), x, y)
    }

    /// [`Matrix::matvec`] on a given kernel path (the scalar reference if this CPU cannot run
    /// it). With int8 activations on ([`kernels::int8_activations`]), a matrix whose format has
    /// an integer kernel on `path` ([`KernelPath::has_integer_kernel`]) quantizes `x` once here
    /// and uses it.
    pub fn matvec_with(&self, path: KernelPath, x: &[f32], y: &mut [f32]) {
        self.matvec_impl(path, self.quantizes_on(path), x, y)
    }

    /// [`Matrix::matvec_with`], but INT4 and INT8 matrices always quantize the activations
    /// ([`kernels::q8`]) and use the integer kernels: AVX-512 VNNI on
    /// [`KernelPath::Avx512Vnni`], the scalar definition on other paths. F32 and BF16 matrices
    /// are unaffected.
    pub fn matvec_q8_with(&self, path: KernelPath, x: &[f32], y: &mut [f32]) {
        self.matvec_impl(path, true, x, y)
    }

    /// `y = W x` on `path`, with INT4 and INT8 matrices on quantized activations if `quantize`:
    /// the multi-row kernels with one input (bit-identical to the single-row product), rows
    /// split across threads in pieces of whole row blocks.
    fn matvec_impl(&self, path: KernelPath, quantize: bool, x: &[f32], y: &mut [f32]) {
        assert_eq!(y.len(), self.rows, "matvec output length");
        parts_matvec(&[self], path, quantize, x, y)
    }

    /// `y = [W_0; W_1; ...] x`: the products of `parts` over the same input, their outputs one
    /// after another in `y`, as one product split across the thread pool. Each output is
    /// bit-identical to its part's [`Matrix::matvec`]. The three attention projections of a
    /// decoded token run this way: one split instead of three, so the small key and value
    /// products (a twentieth of a millisecond each) do not each wait for a slower thread.
    /// Fails, naming the part, where the parts differ in format or input width (the caller
    /// runs them one by one then); `y` must hold the parts' rows together.
    pub fn matvec_parts(parts: &[&Matrix], x: &[f32], y: &mut [f32]) -> Result<()> {
        let (first, rows) = Self::stacked_rows("matvec_parts", parts)?;
        if y.len() != rows {
            return Err(Error::tensor("matvec_parts", format!("{} outputs for {rows} rows", y.len())));
        }
        let path = kernels::selected();
        parts_matvec(parts, path, first.quantizes_on(path), x, y);
        Ok(())
    }

    /// The `n` input rows of `x` copied into rows aligned to cache lines, padded to the
    /// kernels' width (whole INT4 groups), and for MXFP4 and BF16 in the order the kernels of
    /// `path` read ([`kernels::mxfp4_input_order`], [`kernels::bf16_input_order`]).
    fn arranged_inputs(&self, path: KernelPath, x: &[f32], n: usize) -> AlignedRows {
        let mut rows = AlignedRows::new(x, n, self.cols, self.padded_cols());
        let order = match &self.data {
            MatrixData::Mxfp4 { .. } => kernels::mxfp4_input_order(path),
            MatrixData::Bf16(_) => kernels::bf16_input_order(path),
            MatrixData::F32(_) | MatrixData::Int8Rows { .. } | MatrixData::Int4G64 { .. } => None,
        };
        if let Some(order) = order {
            for i in 0..n {
                kernels::arrange_inputs(order, rows.row_mut(i));
            }
        }
        rows
    }

    /// `Y = X W^T`: `x` holds `n` input rows (`[n, cols]`), `y` gets `[n, rows]`. Every
    /// output is bit-identical to what [`Matrix::matvec`] gives for that input (the same kernel
    /// path, the same activation quantization, and multi-input kernels that apply to each
    /// input exactly the single-input kernel's operations), so batched prefill and
    /// token-by-token decode agree exactly, whatever `n`, the blocking or the thread count.
    ///
    /// Each weight row is loaded, unpacked or widened once per pass of up to
    /// [`kernels::max_inputs`] inputs rather than once per input. Rows are processed in blocks
    /// (split across threads) small enough to stay in the core's L2 cache while every pass of
    /// inputs goes over them.
    pub fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_with(kernels::selected(), x, n, y)
    }

    /// [`Matrix::matmul`] on a given kernel path: each output is bit-identical to
    /// [`Matrix::matvec_with`] on `path` for that input.
    pub fn matmul_with(&self, path: KernelPath, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_impl(path, self.quantizes_on(path), x, n, y)
    }

    /// [`Matrix::matmul_with`] with INT4 and INT8 matrices always on quantized activations:
    /// each output is bit-identical to [`Matrix::matvec_q8_with`] on `path` for that input.
    pub fn matmul_q8_with(&self, path: KernelPath, x: &[f32], n: usize, y: &mut [f32]) {
        self.matmul_impl(path, true, x, n, y)
    }

    /// `Y = X W^T` on `path`, with INT4 and INT8 matrices on quantized activations if `quantize`.
    fn matmul_impl(&self, path: KernelPath, quantize: bool, x: &[f32], n: usize, y: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "matmul input length");
        assert_eq!(y.len(), n * self.rows, "matmul output length");
        match n {
            0 => return,
            1 => return self.matvec_impl(path, quantize, x, y),
            _ => {}
        }
        // The same arithmetic as matvec, input by input: the same kernel path, and on paths
        // that quantize activations each input is quantized exactly as matvec would.
        let integer = self.integer_product().is_some();
        let quantize = integer && quantize;
        let quantized: Vec<QuantizedX> =
            if quantize { x.chunks(self.cols).map(QuantizedX::new).collect() } else { Vec::new() };
        // Float inputs are copied to rows aligned to cache lines (padded to whole INT4 groups,
        // in the order the MXFP4 and BF16 kernels read).
        let aligned = (!quantize).then(|| self.arranged_inputs(path, x, n));
        let inputs = Inputs {
            x: aligned.as_ref().map_or_else(Vec::new, |a| a.rows().collect()),
            q: quantized.iter().collect(),
        };
        // Blocks of rows for all inputs: `out` is `[rows in block, n]`.
        // A whole number of [`kernels::TASK_ROWS`].
        let row_bytes = (self.byte_len() / self.rows.max(1)).max(1);
        let rows_per_block = (MATMUL_BLOCK_BYTES / row_bytes).max(MATMUL_BLOCK_MIN_ROWS) / kernels::TASK_ROWS
            * kernels::TASK_ROWS;
        let mut out = vec![0.0f32; self.rows * n];
        if self.rows * self.cols * n < PARALLEL_MIN_WORK {
            self.rows_dot_multi(path, 0, &inputs, &mut out);
        } else {
            out.par_chunks_mut(rows_per_block * n)
                .enumerate()
                .for_each(|(b, o)| self.rows_dot_multi(path, b * rows_per_block, &inputs, o));
        }
        transpose_into(&out, n, y);
    }

    /// Rows `r0 ..` (as many as `out`, `[rows, n]`, holds) against every input of `inputs`
    /// (the quantized ones for INT4, INT8 and MXFP4 if there are any, else the float ones
    /// from [`Matrix::arranged_inputs`]), into `out` (`[rows, n]`).
    fn rows_dot_multi(&self, path: KernelPath, r0: usize, inputs: &Inputs, out: &mut [f32]) {
        let c = self.cols;
        let n = inputs.x.len().max(inputs.q.len());
        let r1 = (r0 + out.len() / n.max(1)).min(self.rows);
        match &self.data {
            MatrixData::F32(b) => {
                kernels::f32_dot_multi_with(path, &b.as_slice()[r0 * c..r1 * c], c, &inputs.x, out)
            }
            MatrixData::Bf16(b) => {
                kernels::bf16_dot_multi_arranged_with(path, &b.as_slice()[r0 * c..r1 * c], c, &inputs.x, out)
            }
            MatrixData::Int8Rows { codes, scales } => {
                let (codes, scales) = (&codes.as_slice()[r0 * c..r1 * c], &scales.as_slice()[r0..r1]);
                if inputs.q.is_empty() {
                    kernels::int8_dot_multi_with(path, codes, scales, c, &inputs.x, out)
                } else {
                    kernels::int8_dot_q8_multi_with(path, codes, scales, c, &inputs.q, out)
                }
            }
            MatrixData::Int4G64 { codes, scales } => {
                let (rb, g) = (int4::row_bytes(c), int4::groups(c));
                let (codes, scales) =
                    (&codes.as_slice()[r0 * rb..r1 * rb], &scales.as_slice()[r0 * g..r1 * g]);
                if inputs.q.is_empty() {
                    kernels::int4_dot_multi_with(path, codes, scales, c, &inputs.x, out)
                } else {
                    kernels::int4_dot_q8_multi_with(path, codes, scales, c, &inputs.q, out)
                }
            }
            MatrixData::Mxfp4 { codes, scales } => {
                let (rb, b) = (mxfp4::row_bytes(c), mxfp4::blocks(c));
                let (codes, scales) =
                    (&codes.as_slice()[r0 * rb..r1 * rb], &scales.as_slice()[r0 * b..r1 * b]);
                if inputs.q.is_empty() {
                    kernels::mxfp4_dot_multi_arranged_with(path, codes, scales, c, &inputs.x, out)
                } else {
                    kernels::mxfp4_dot_q8_multi_with(path, codes, scales, c, &inputs.q, out)
                }
            }
        }
    }

    /// The same matrix with its large buffers copied from a memory-mapped file into huge
    /// pages ([`WeightBuf::in_huge_pages`]): the same bytes, so every product is the same,
    /// streamed faster by the CPU kernels.
    pub fn in_huge_pages(&self) -> Matrix {
        let data = match &self.data {
            MatrixData::F32(w) => MatrixData::F32(w.in_huge_pages()),
            MatrixData::Bf16(w) => MatrixData::Bf16(w.in_huge_pages()),
            MatrixData::Int8Rows { codes, scales } => {
                MatrixData::Int8Rows { codes: codes.in_huge_pages(), scales: scales.in_huge_pages() }
            }
            MatrixData::Int4G64 { codes, scales } => {
                MatrixData::Int4G64 { codes: codes.in_huge_pages(), scales: scales.in_huge_pages() }
            }
            MatrixData::Mxfp4 { codes, scales } => {
                MatrixData::Mxfp4 { codes: codes.in_huge_pages(), scales: scales.in_huge_pages() }
            }
        };
        Matrix { rows: self.rows, cols: self.cols, data }
    }

    /// The same matrix stored as F32 (dequantized): the L1 reference runs on this.
    pub fn dequantized(&self) -> Matrix {
        Matrix { rows: self.rows, cols: self.cols, data: MatrixData::F32(WeightBuf::owned(self.to_f32())) }
    }

    /// The whole matrix decoded to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols).enumerate() {
            self.row_to_f32(r, row);
        }
        out
    }
}

#[cfg(test)]
mod stack_tests {
    use super::*;

    fn int4_matrix(rows: usize, cols: usize, seed: u32) -> Matrix {
        let mut codes = vec![0u8; rows * int4::row_bytes(cols)];
        let mut scales = vec![0u16; rows * int4::groups(cols)];
        for r in 0..rows {
            let row: Vec<f32> =
                (0..cols).map(|c| ((r * 31 + c * 7 + seed as usize) % 23) as f32 / 11.0 - 1.0).collect();
            int4::quantize_row(
                &row,
                &mut codes[r * int4::row_bytes(cols)..][..int4::row_bytes(cols)],
                &mut scales[r * int4::groups(cols)..][..int4::groups(cols)],
            );
        }
        let data = MatrixData::Int4G64 { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) };
        Matrix::new("m", rows, cols, data).unwrap()
    }

    #[test]
    fn stacked_rows_compute_what_the_parts_compute() {
        let cols = 130;
        let parts = [int4_matrix(5, cols, 1), int4_matrix(3, cols, 2), int4_matrix(3, cols, 3)];
        let refs: Vec<&Matrix> = parts.iter().collect();
        let stacked = Matrix::stack_rows("qkv", &refs).unwrap();
        assert_eq!((stacked.rows, stacked.cols), (11, cols));
        let x: Vec<f32> = (0..cols).map(|c| (c as f32 * 0.37).sin()).collect();
        let mut want = Vec::new();
        for m in &parts {
            let mut y = vec![0.0; m.rows];
            m.matvec(&x, &mut y);
            want.extend(y);
        }
        let mut got = vec![0.0; 11];
        stacked.matvec(&x, &mut got);
        assert_eq!(got, want);
    }

    #[test]
    fn stacking_refuses_other_widths_and_formats() {
        let a = int4_matrix(2, 64, 0);
        let b = int4_matrix(2, 128, 0);
        let err = Matrix::stack_rows("qkv", &[&a, &b]).unwrap_err().to_string();
        assert!(err.contains("qkv") && err.contains("cannot stack"), "{err}");
        let f = Matrix::from_f32("f", 2, 64, vec![0.0; 128]).unwrap();
        assert!(Matrix::stack_rows("qkv", &[&a, &f]).is_err());
        assert!(Matrix::stack_rows("qkv", &[]).is_err());
    }
}

#[cfg(test)]
mod split_tests {
    use std::sync::Mutex;

    use super::*;

    /// The pieces `split_in_halves` hands out for `rows` outputs, as (first, len), sorted.
    fn pieces(rows: usize, pieces: usize) -> Vec<(usize, usize)> {
        let seen = Mutex::new(Vec::new());
        let mut ys = vec![0.0f32; rows];
        split_in_halves(0, &mut ys, pieces, &|first, piece: &mut [f32]| {
            piece.fill(1.0);
            seen.lock().unwrap().push((first, piece.len()));
        });
        assert!(ys.iter().all(|&y| y == 1.0), "{rows} rows: some output was not handed out");
        let mut seen = seen.into_inner().unwrap();
        seen.sort_unstable();
        seen
    }

    #[test]
    fn every_row_once_in_whole_task_rows_and_pieces_within_a_task_of_rows() {
        for rows in [1, 15, 16, 17, 100, 512, 2880, 4096, 5760, 201_088] {
            for n in [1, 2, 4, 16, 64] {
                let got = pieces(rows, n);
                assert_eq!(
                    got.len(),
                    n.min(rows.div_ceil(kernels::TASK_ROWS)),
                    "{rows} rows in {n}: {got:?}"
                );
                let mut next = 0;
                for &(first, len) in &got {
                    assert_eq!(first, next, "{rows} rows in {n}: {got:?}");
                    assert_eq!(first % kernels::TASK_ROWS, 0, "{rows} rows in {n}: {got:?}");
                    next += len;
                }
                assert_eq!(next, rows);
                let (min, max) =
                    got.iter().fold((usize::MAX, 0), |(lo, hi), &(_, len)| (lo.min(len), hi.max(len)));
                assert!(max - min <= kernels::TASK_ROWS, "{rows} rows in {n}: {got:?}");
            }
        }
    }

    /// A matrix of `format` ("bf16", "mxfp4" or "f32") with varied codes and scales.
    fn matrix(format: &str, rows: usize, cols: usize, seed: usize) -> Matrix {
        let byte = |j: usize| ((j + seed) * 7919 % 251) as u8;
        let data = match format {
            "bf16" => MatrixData::Bf16(WeightBuf::owned(
                (0..rows * cols)
                    .map(|j| half::bf16::from_f32(byte(j) as f32 / 125.0 - 1.0).to_bits())
                    .collect(),
            )),
            "mxfp4" => MatrixData::Mxfp4 {
                codes: WeightBuf::owned((0..rows * mxfp4::row_bytes(cols)).map(byte).collect()),
                scales: WeightBuf::owned(
                    (0..rows * mxfp4::blocks(cols)).map(|j| 120 + byte(j) % 10).collect(),
                ),
            },
            _ => MatrixData::F32(WeightBuf::owned(
                (0..rows * cols).map(|j| byte(j) as f32 / 125.0 - 1.0).collect(),
            )),
        };
        Matrix::new("m", rows, cols, data).unwrap()
    }

    #[test]
    fn parts_in_one_product_give_each_part_s_own_outputs_bit_for_bit() {
        // Large enough to split across the pool, with part boundaries inside the pieces.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for format in ["bf16", "mxfp4", "f32"] {
            let cols = 320;
            let parts =
                [matrix(format, 200, cols, 1), matrix(format, 24, cols, 2), matrix(format, 37, cols, 3)];
            let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
            let want: Vec<f32> = parts
                .iter()
                .flat_map(|m| {
                    let mut y = vec![0.0; m.rows];
                    m.matvec(&x, &mut y);
                    y
                })
                .collect();
            let refs: Vec<&Matrix> = parts.iter().collect();
            let mut got = vec![f32::NAN; want.len()];
            pool.install(|| Matrix::matvec_parts(&refs, &x, &mut got)).unwrap();
            assert_eq!(got, want, "{format}");
        }
    }

    #[test]
    fn parts_of_other_formats_or_widths_or_a_wrong_output_are_refused() {
        let x = vec![0.5; 64];
        let (a, b) = (matrix("bf16", 16, 64, 0), matrix("f32", 16, 64, 0));
        let err = Matrix::matvec_parts(&[&a, &b], &x, &mut [0.0; 32]).unwrap_err().to_string();
        assert!(err.contains("f32") && err.contains("bf16"), "{err}");
        let wide = matrix("bf16", 16, 96, 0);
        assert!(Matrix::matvec_parts(&[&a, &wide], &x, &mut [0.0; 32]).is_err());
        assert!(Matrix::matvec_parts(&[&a, &a], &x, &mut [0.0; 31]).is_err());
        assert!(Matrix::matvec_parts(&[], &x, &mut []).is_err());
    }

    #[test]
    fn two_threads_get_equal_halves_where_equal_chunks_did_not() {
        // Equal chunks of 192 rows (2880 / 16, rounded up to whole tasks of rows) made 15.
        let got = pieces(2880, 16);
        assert_eq!(got.len(), 16, "{got:?}");
        let low: usize = got.iter().filter(|&&(first, _)| first < 1440).map(|&(_, len)| len).sum();
        assert_eq!(low, 1440, "{got:?}");
    }
}
