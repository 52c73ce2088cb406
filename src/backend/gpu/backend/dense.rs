//! Dense products on the device: matrix-vector kernels over a matrix's row blocks, word
//! copies, a dense MLP layer, and the model's linear layers by role.

use std::sync::Arc;

use crate::backend::{Backend, LinearId, NormId};
use crate::error::{Error, Result};

use super::super::buffers::GpuAct;
use super::super::context::{Bind, GBuf, STORAGE_ALIGN};
use super::super::params::{CopyParams, GatherColsParams, GluParams, MatvecParams};
use super::super::shaders::{Op, Variant};
use super::super::weights::GpuMatrix;
use super::model::{GpuFfn, GpuLayer, GpuLinear};
use super::{GpuBackend, TOKENS_PER_GROUP, activation_code, check_shape};

/// Output rows one matrix-vector workgroup computes (`R` in matvec_common.wgsl).
const MATVEC_ROWS: usize = 4;
/// Tokens one tiled-product workgroup computes (`TM` in matmul_common.wgsl).
pub const TILE_TOKENS: usize = 32;
/// Output rows one tiled-product workgroup computes (`TN` in matmul_common.wgsl).
const TILE_ROWS: usize = 32;
/// Fewest tokens a product runs tiled (the TILED variants, matmul_common.wgsl) in: a prompt
/// block of this many rows or more reads each weight once per [`TILE_TOKENS`] tokens instead
/// of once per 4 (the matrix-vector kernels' `TOKENS_PER_GROUP`). Below it, and always for
/// a decoded token or a batched step (whose rows must each equal the same row computed
/// alone, bit for bit), the matrix-vector kernels run. At 8 tokens a tile is a quarter
/// full, but its empty token groups skip their arithmetic, and the weights are read once
/// instead of twice. (Not tuned on a hardware GPU: none was at hand.)
pub const TILED_MIN_TOKENS: usize = 8;

impl GpuBackend {
    /// `out = W x + b` over every row block of `m`. An output larger than one binding is
    /// computed a group of tokens at a time through a scratch buffer.
    pub(super) fn matvec(
        &mut self,
        m: &GpuMatrix,
        bias: Option<&GBuf>,
        x: &GpuAct,
        out: &GpuAct,
    ) -> Result<()> {
        self.matvec_fused(m, bias, x, out, None, false)
    }

    /// The product with its fusions, one dispatch per row block:
    ///
    /// * `norm: Some(w)`: `x` is the raw residual and token t's input is
    ///   `w[c] * (x[t][c] * inv_t)`, `inv_t = 1 / sqrt(sum_c x[t][c]^2 / cols + eps)` (the
    ///   model's `rms_norm_eps`): exactly what `rms_norm` writes (same expression, same
    ///   reduction), so `matvec_fused(.., Some(w), ..)` equals `rms_norm` then `matvec`;
    /// * `accumulate`: `out[t][row] += W x + b` (the residual add of `Backend::add`,
    ///   `out + (W x + b)`) instead of `=`.
    ///
    /// `x` and `out` must be different buffers. With neither flag this is [`Self::matvec`].
    ///
    /// A prompt block of [`TILED_MIN_TOKENS`] rows or more runs the tiled product (the TILED
    /// variants, with the same fusions; equal to the matrix-vector kernels within f32
    /// rounding, not bit for bit); fewer rows, a decoded token and a batched step run the
    /// matrix-vector kernels.
    pub(super) fn matvec_fused(
        &mut self,
        m: &GpuMatrix,
        bias: Option<&GBuf>,
        x: &GpuAct,
        out: &GpuAct,
        norm: Option<&GBuf>,
        accumulate: bool,
    ) -> Result<()> {
        if x.width() != m.cols || out.width() != m.rows || out.rows() != x.rows() {
            return Err(Error::Backend(format!(
                "linear: [{}, {}] x [{}, {}] -> [{}, {}]",
                x.rows(),
                x.width(),
                m.rows,
                m.cols,
                out.rows(),
                out.width()
            )));
        }
        let row_bytes = (m.rows * 4) as u64;
        if x.buf().id == out.buf().id {
            return Err(Error::Backend("linear: the input and the output are the same buffer".into()));
        }
        if let Some(w) = norm
            && w.size < (m.cols * 4) as u64
        {
            return Err(Error::Backend(format!(
                "linear: a norm weight of {} bytes for {} columns",
                w.size, m.cols
            )));
        }
        if let Some(b) = bias
            && b.size < (m.rows * 4) as u64
        {
            return Err(Error::Backend(format!("linear: a bias of {} bytes for {} rows", b.size, m.rows)));
        }
        if out.bytes() <= self.gpu.max_binding {
            return self.matvec_into(m, bias, x, out.buf(), out.bytes(), norm, accumulate);
        }
        let per = (self.gpu.max_binding / row_bytes) as usize;
        if per == 0 {
            return Err(Error::Backend(format!(
                "one output row of {row_bytes} bytes exceeds the binding limit"
            )));
        }
        let cols_bytes = (m.cols * 4) as u64;
        let mut t0 = 0;
        while t0 < x.rows() {
            let n = per.min(x.rows() - t0);
            let xs = GpuAct::new(n, m.cols, self.scratch(n as u64 * cols_bytes)?);
            self.copy_words(x.buf(), t0 * m.cols, xs.buf(), 0, n * m.cols)?;
            let ys = self.scratch(n as u64 * row_bytes)?;
            if accumulate {
                self.copy_words(out.buf(), t0 * m.rows, ys.buf(), 0, n * m.rows)?;
            }
            self.matvec_into(m, bias, &xs, ys.buf(), n as u64 * row_bytes, norm, accumulate)?;
            self.copy_words(ys.buf(), 0, out.buf(), t0 * m.rows, n * m.rows)?;
            t0 += n;
        }
        Ok(())
    }

    /// `dst[dst_at..][..n] = src[src_at..][..n]` in words, as a kernel (ordered after
    /// the compute that wrote `src` on every backend). Each side is bound as a window
    /// around its range, so buffers larger than one binding can be addressed.
    pub(super) fn copy_words(
        &mut self,
        src: &GBuf,
        src_at: usize,
        dst: &GBuf,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        let window = |at: usize| {
            let byte = at as u64 * 4;
            let base = byte - byte % STORAGE_ALIGN;
            (base, ((byte - base) / 4) as u32, (byte - base) + n as u64 * 4)
        };
        let (sb, so, ss) = window(src_at);
        let (db, d_o, ds) = window(dst_at);
        if ss > self.gpu.max_binding || ds > self.gpu.max_binding {
            return Err(Error::Backend(format!("a copy of {n} words exceeds the storage binding limit")));
        }
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let params = CopyParams { n: n as u32, src_offset: so, dst_offset: d_o, nx };
        let binds = [Bind::range(src, sb, ss), Bind::range(dst, db, ds)];
        let v = self.variant(Op::Copy);
        self.gpu.dispatch(Op::Copy, v, &params, &binds, (nx, ny, 1))
    }

    /// True when a product over `tokens` rows runs tiled ([`TILED_MIN_TOKENS`]): a prompt
    /// block (not a batched step) of enough rows, on a backend that tiles.
    pub(super) fn tiles(&self, tokens: usize) -> bool {
        self.tiled_dense && !self.batched_step && tokens >= TILED_MIN_TOKENS
    }

    /// One product into `out` (within one binding), one dispatch per row block: the
    /// matrix-vector kernels, or the tiled product for a prompt block ([`Self::tiles`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matvec_into(
        &mut self,
        m: &GpuMatrix,
        bias: Option<&GBuf>,
        x: &GpuAct,
        out: &GBuf,
        out_bytes: u64,
        norm: Option<&GBuf>,
        accumulate: bool,
    ) -> Result<()> {
        let mut v = self.variant(m.op);
        v.norm = norm.is_some();
        v.accumulate = accumulate;
        let eps = self.cfg.rms_norm_eps;
        let tokens = x.rows();
        v.tiled = self.tiles(tokens);
        let (tile_tokens, tile_rows) =
            if v.tiled { (TILE_TOKENS, TILE_ROWS) } else { (TOKENS_PER_GROUP, MATVEC_ROWS) };
        let tiles = tokens.div_ceil(tile_tokens);
        if tiles > self.gpu.max_groups as usize {
            return Err(Error::Backend(format!("{tokens} tokens in one product exceed the device's grid")));
        }
        let dummy = self.gpu.dummy.clone();
        for block in &m.blocks {
            // `tile_rows` rows per workgroup (matvec_common.wgsl, matmul_common.wgsl).
            let (nx, ny) = self.gpu.grid(block.rows.div_ceil(tile_rows) as u64)?;
            let params = MatvecParams {
                rows: block.rows as u32,
                cols: m.cols as u32,
                row_offset: block.row0 as u32,
                out_stride: m.rows as u32,
                tokens: tokens as u32,
                has_bias: bias.is_some() as u32,
                nx,
                eps,
                row_chunks: m.row_chunks as u32,
                _pad: [0; 3],
            };
            let mut binds = vec![
                x.bind(),
                Bind::first(out, out_bytes),
                Bind::whole(bias.unwrap_or(&dummy)),
                Bind::whole(&block.data),
            ];
            if let Some(s) = &block.scales {
                binds.push(Bind::whole(s));
            }
            if let Some(w) = norm {
                binds.push(Bind::whole(w));
            }
            self.gpu.dispatch(m.op, v, &params, &binds, (nx, ny, tiles as u32))?;
            if v.tiled {
                self.stats.tiled_products += 1;
            }
        }
        if v.tiled {
            self.stats.tiled_tokens += tokens as u64;
        }
        Ok(())
    }

    /// A dense MLP on the rows of `x` into `out` (`[rows, hidden]`; the gate/up projection
    /// of all rows must fit one binding): gate_up x + b, the recipe's gated activation
    /// (glu.wgsl), then down act + b: the CPU's `expert_forward` with weight one.
    pub(super) fn dense_block(
        &mut self,
        gate_up: &GpuLinear,
        down: &GpuLinear,
        x: &GpuAct,
        out: &GpuAct,
    ) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let rows = x.rows();
        let inter = down.m.cols;
        let gu = self.alloc(rows, gate_up.m.rows)?;
        self.matvec(&gate_up.m, gate_up.bias.as_ref(), x, &gu)?;
        let act = self.alloc(rows, inter)?;
        let n = rows * inter;
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let params = GluParams {
            n: n as u32,
            activation: activation_code(cfg.recipe.activation),
            limit: cfg.swiglu_limit,
            alpha: cfg.swiglu_alpha,
            nx,
            _pad: [0; 3],
        };
        let v = self.variant(Op::Glu);
        self.gpu.dispatch(Op::Glu, v, &params, &[gu.bind(), act.bind()], (nx, ny, 1))?;
        self.matvec(&down.m, down.bias.as_ref(), &act, out)
    }

    pub(super) fn run_dense_mlp(&mut self, layer: usize, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        let cfg = Arc::clone(&self.cfg);
        let rows = x.rows();
        check_shape("dense mlp out", out, rows, cfg.hidden_size)?;
        let owner = self.layer(layer)?;
        let GpuFfn::Dense { gate_up, down } = &owner.ffn else {
            return Err(Error::Backend(format!("layer {layer} is a MoE layer, not a dense one")));
        };
        // The gate/up projection of a block of rows is bound whole by glu.wgsl: blocks of
        // rows within the binding limit, through scratch buffers when there are several.
        let per = (self.gpu.max_binding / (gate_up.m.rows as u64 * 4)) as usize;
        if per == 0 {
            return Err(Error::Backend(format!(
                "layer {layer}: one row of the dense MLP's gate/up projection exceeds the storage binding limit"
            )));
        }
        if rows <= per {
            return self.dense_block(gate_up, down, x, out);
        }
        let h = cfg.hidden_size;
        let mut t0 = 0;
        while t0 < rows {
            let n = per.min(rows - t0);
            let xs = self.alloc(n, h)?;
            self.copy_words(x.buf(), t0 * h, xs.buf(), 0, n * h)?;
            let ys = self.alloc(n, h)?;
            self.dense_block(gate_up, down, &xs, &ys)?;
            self.copy_words(ys.buf(), 0, out.buf(), t0 * h, n * h)?;
            t0 += n;
        }
        Ok(())
    }

    /// Builds the fused kernel variants a fused forward pass uses (so that a broken shader
    /// fails at load, not mid-token): NORM and ACCUMULATE of every dense matrix format in the
    /// model (tiled too, for prompt blocks, when the backend tiles), and, when
    /// [`Self::experts_fused`] can apply (every expert resident in one pool group),
    /// expert_gate_up NORM and expert_down COMBINE. Unfused variants are built by
    /// `prepare_kernels`.
    pub fn prepare_fused_kernels(&mut self) -> Result<()> {
        let ops = self.matrix_ops();
        let tilings: &[bool] = if self.tiled_dense { &[false, true] } else { &[false] };
        for op in ops {
            for (norm, accumulate) in [(true, false), (false, true)] {
                for &tiled in tilings {
                    let v = Variant { norm, accumulate, tiled, ..self.variant(op) };
                    self.gpu.prepare(op, v)?;
                }
            }
        }
        if self.fused_experts_fit(1) {
            let gate_up = Variant { norm: true, ..self.variant(Op::ExpertGateUp) };
            self.gpu.prepare(Op::ExpertGateUp, gate_up)?;
            let down = Variant { combine: true, ..self.variant(Op::ExpertDown) };
            self.gpu.prepare(Op::ExpertDown, down)?;
        }
        Ok(())
    }

    /// The norm weight of `norm` (attention, MLP or final; QK-norm weights are per head).
    pub(super) fn norm_weight(&self, norm: NormId) -> Result<GBuf> {
        let layer = |l: usize| self.layers.get(l).ok_or_else(|| Error::Backend(format!("no layer {l}")));
        match norm {
            NormId::Attention(l) => Ok(layer(l)?.attn_norm.clone()),
            NormId::Mlp(l) => Ok(layer(l)?.mlp_norm.clone()),
            NormId::Final => Ok(self.final_norm.clone()),
            NormId::Query(_) | NormId::Key(_) => {
                Err(Error::Backend(format!("{norm:?} is a QK-norm weight, not a row norm")))
            }
        }
    }

    /// The linear layer `id` with the fusions of [`Self::matvec_fused`]: `norm: Some(n)`
    /// reads `x` as the raw residual and normalizes it with `n`'s weight inside the
    /// product; `accumulate` adds the result to `out` (`out += W x + b`). Equal to
    /// `rms_norm(n)` then `linear(id)` (then `add`) on the unfused path. For the forward
    /// pass's fused orchestration and for tests.
    pub fn linear_fused(
        &mut self,
        id: LinearId,
        x: &GpuAct,
        out: &mut GpuAct,
        norm: Option<NormId>,
        accumulate: bool,
    ) -> Result<()> {
        let w = norm.map(|n| self.norm_weight(n)).transpose()?;
        let w = w.as_ref();
        let layer = |l: usize| self.layer(l);
        let (q, kv) = (self.cfg.q_dim(), self.cfg.kv_dim());
        let (owner, col0, width) = match id {
            LinearId::Q(l) => (layer(l)?, 0, q),
            LinearId::K(l) => (layer(l)?, q, kv),
            LinearId::V(l) => (layer(l)?, q + kv, kv),
            LinearId::O(l) => {
                let owner = layer(l)?;
                return self.matvec_fused(&owner.o.m, owner.o.bias.as_ref(), x, out, w, accumulate);
            }
            LinearId::Router(l) => {
                let owner = layer(l)?;
                let Some(router) = owner.router() else {
                    return Err(Error::Backend(format!("layer {l} is a dense layer and has no router")));
                };
                return self.matvec_fused(&router.m, router.bias.as_ref(), x, out, w, accumulate);
            }
            LinearId::LmHead => {
                let head = Arc::clone(&self.head);
                return self.matvec_fused(&head, None, x, out, w, accumulate);
            }
        };
        // One projection alone: the stacked product, then its columns.
        let want = (x.rows(), width);
        crate::backend::check_shape(&format!("{id:?} out"), (out.rows(), out.width()), want)?;
        let qkv = self.qkv_product(&owner, x, w)?;
        if !accumulate {
            return self.gather_cols(&qkv, col0, out);
        }
        let part = self.alloc(out.rows(), out.width())?;
        self.gather_cols(&qkv, col0, &part)?;
        self.add(out, &part)
    }

    pub(super) fn run_linear(&mut self, id: LinearId, x: &GpuAct, out: &mut GpuAct) -> Result<()> {
        self.linear_fused(id, x, out, None, false)
    }

    /// The stacked query/key/value product of `layer` over `x`: `[rows, q_dim + 2 kv_dim]`;
    /// with `norm`, `x` is the raw residual normalized inside the product.
    pub(super) fn qkv_product(
        &mut self,
        layer: &GpuLayer,
        x: &GpuAct,
        norm: Option<&GBuf>,
    ) -> Result<GpuAct> {
        let qkv = self.alloc(x.rows(), layer.qkv.m.rows)?;
        self.matvec_fused(&layer.qkv.m, layer.qkv.bias.as_ref(), x, &qkv, norm, false)?;
        Ok(qkv)
    }

    /// The three projections as one product and three column copies (gather_cols.wgsl).
    pub(super) fn run_linear_qkv(
        &mut self,
        layer: usize,
        x: &GpuAct,
        q: &mut GpuAct,
        k: &mut GpuAct,
        v: &mut GpuAct,
    ) -> Result<()> {
        let owner = self.layer(layer)?;
        let (qd, kvd) = (self.cfg.q_dim(), self.cfg.kv_dim());
        let qkv = self.qkv_product(&owner, x, None)?;
        self.gather_cols(&qkv, 0, q)?;
        self.gather_cols(&qkv, qd, k)?;
        self.gather_cols(&qkv, qd + kvd, v)
    }

    /// `out[r][c] = src[r][col0 + c]` for every row and column of `out`.
    fn gather_cols(&mut self, src: &GpuAct, col0: usize, out: &GpuAct) -> Result<()> {
        if out.rows() != src.rows() || col0 + out.width() > src.width() {
            return Err(Error::Backend(format!(
                "columns {col0}..{} of [{}, {}] into [{}, {}]",
                col0 + out.width(),
                src.rows(),
                src.width(),
                out.rows(),
                out.width()
            )));
        }
        let n = out.rows() * out.width();
        let (nx, ny) = self.gpu.grid(n.div_ceil(64) as u64)?;
        let params = GatherColsParams {
            rows: out.rows() as u32,
            width: out.width() as u32,
            src_width: src.width() as u32,
            col0: col0 as u32,
            nx,
            _pad: [0; 3],
        };
        let v = self.variant(Op::GatherCols);
        self.gpu.dispatch(Op::GatherCols, v, &params, &[src.bind(), out.bind()], (nx, ny, 1))
    }
}
