//! The WGSL kernels (`shaders/`, one op per file), their variants, and the small line
//! preprocessor that builds a variant's source.
//!
//! Every source is `common.wgsl` (enables, invocation IDs, the workgroup sum), the op's
//! `struct Params` generated from its Rust parameter struct ([`Op::params`],
//! [`super::params`]; no shader declares it), the product kernels' preludes, then the op's
//! file, whose entry line [`ENTRY_LINE`] is replaced by the real entry point
//! ([`entry_point`]). Variants differ only where an optional adapter feature is used (SUBGROUP
//! for reductions, SHADER_F16 for loading f16 scales), in the expert weight format (F32,
//! INT4-gs64 or MXFP4: [`SlotFormat`]), in how many expert pools the expert kernels bind,
//! in the key/value cache's precision (KV_F16: [`Variant::kv_f16`]), in the fusions (NORM,
//! ACCUMULATE, COMBINE) and, for the dense products, in the tiling (TILED: the tiled product
//! of prompt blocks, [`Variant::tiled`]). `all_variants` lists every
//! variant, so a test can translate each one for every target API.

use std::fmt::Write;

use crate::error::{Error, Result};

use super::vram::SlotFormat;

const COMMON: &str = include_str!("../../../shaders/common.wgsl");
const DECODE: &str = include_str!("../../../shaders/decode.wgsl");
const EXPERT_COMMON: &str = include_str!("../../../shaders/expert_common.wgsl");
const MATVEC_COMMON: &str = include_str!("../../../shaders/matvec_common.wgsl");
const MATMUL_COMMON: &str = include_str!("../../../shaders/matmul_common.wgsl");

/// Access of a storage binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
}

/// A compute kernel (one WGSL file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `y = W x + b`, F32 weights.
    MatvecF32,
    /// `y = W x + b`, BF16 weights.
    MatvecBf16,
    /// `y = W x + b`, INT8-per-row weights.
    MatvecInt8,
    /// `y = W x + b`, INT4-gs64 weights.
    MatvecInt4,
    /// RMSNorm.
    RmsNorm,
    /// RMSNorm over each head of a row, in place (QK-norm).
    RmsNormHeads,
    /// Rotary embedding.
    Rope,
    /// Attention over the KV cache, with or without sinks.
    Attention,
    /// Top-k of router logits and their weights by the routing rule.
    RouterTopk,
    /// Scores a routing prediction against the actual routing.
    RouteAgree,
    /// Residual add.
    Add,
    /// Weighted sum of expert outputs.
    MoeCombine,
    /// Fused gate/up projection, bias and gated activation of the selected experts.
    ExpertGateUp,
    /// Down projection and bias of the selected experts.
    ExpertDown,
    /// Stores keys and values in the KV cache.
    KvStore,
    /// Copies words between buffers.
    Copy,
    /// The gated activation of a dense MLP layer over its fused gate/up projection.
    Glu,
    /// One decoded token's attention per (KV head, key split), with its QK-norm, RoPE and
    /// key/value store (flash-decoding, first half).
    AttentionDecode,
    /// Combines the splits of [`Op::AttentionDecode`] and the sink per query head.
    AttentionMerge,
    /// The argmax of each row of logits (greedy decoding), in two stages.
    Argmax,
    /// A column range of a row-major activation (Q, K or V of the fused projection).
    GatherCols,
    /// A sampler's logit bias and penalties, applied in place to a row of logits.
    LogitsAdjust,
    /// The most likely tokens of a row of logits, ranked, and the row's statistics (sampling
    /// from candidates), in rounds.
    LogitsTopk,
    /// The (row, slot) pairs of a block grouped by expert (for the GROUPED expert kernels).
    ExpertGroup,
}

impl Op {
    /// Every op.
    pub const ALL: [Op; 24] = [
        Op::MatvecF32,
        Op::MatvecBf16,
        Op::MatvecInt8,
        Op::MatvecInt4,
        Op::RmsNorm,
        Op::RmsNormHeads,
        Op::Rope,
        Op::Attention,
        Op::RouterTopk,
        Op::RouteAgree,
        Op::Add,
        Op::MoeCombine,
        Op::ExpertGateUp,
        Op::ExpertDown,
        Op::KvStore,
        Op::Copy,
        Op::Glu,
        Op::AttentionDecode,
        Op::AttentionMerge,
        Op::Argmax,
        Op::GatherCols,
        Op::LogitsAdjust,
        Op::LogitsTopk,
        Op::ExpertGroup,
    ];

    /// File name under `shaders/`.
    pub fn file(self) -> &'static str {
        match self {
            Op::MatvecF32 => "matvec_f32.wgsl",
            Op::MatvecBf16 => "matvec_bf16.wgsl",
            Op::MatvecInt8 => "matvec_int8.wgsl",
            Op::MatvecInt4 => "matvec_int4.wgsl",
            Op::RmsNorm => "rmsnorm.wgsl",
            Op::RmsNormHeads => "rmsnorm_heads.wgsl",
            Op::Rope => "rope.wgsl",
            Op::Attention => "attention.wgsl",
            Op::RouterTopk => "router_topk.wgsl",
            Op::RouteAgree => "route_agree.wgsl",
            Op::Add => "add.wgsl",
            Op::MoeCombine => "moe_combine.wgsl",
            Op::ExpertGateUp => "expert_gate_up.wgsl",
            Op::ExpertDown => "expert_down.wgsl",
            Op::KvStore => "kv_store.wgsl",
            Op::Copy => "copy.wgsl",
            Op::Glu => "glu.wgsl",
            Op::AttentionDecode => "attention_decode.wgsl",
            Op::AttentionMerge => "attention_merge.wgsl",
            Op::Argmax => "argmax.wgsl",
            Op::GatherCols => "gather_cols.wgsl",
            Op::LogitsAdjust => "logits_adjust.wgsl",
            Op::LogitsTopk => "logits_topk.wgsl",
            Op::ExpertGroup => "expert_group.wgsl",
        }
    }

    fn text(self) -> &'static str {
        match self {
            Op::MatvecF32 => include_str!("../../../shaders/matvec_f32.wgsl"),
            Op::MatvecBf16 => include_str!("../../../shaders/matvec_bf16.wgsl"),
            Op::MatvecInt8 => include_str!("../../../shaders/matvec_int8.wgsl"),
            Op::MatvecInt4 => include_str!("../../../shaders/matvec_int4.wgsl"),
            Op::RmsNorm => include_str!("../../../shaders/rmsnorm.wgsl"),
            Op::RmsNormHeads => include_str!("../../../shaders/rmsnorm_heads.wgsl"),
            Op::Rope => include_str!("../../../shaders/rope.wgsl"),
            Op::Attention => include_str!("../../../shaders/attention.wgsl"),
            Op::RouterTopk => include_str!("../../../shaders/router_topk.wgsl"),
            Op::RouteAgree => include_str!("../../../shaders/route_agree.wgsl"),
            Op::Add => include_str!("../../../shaders/add.wgsl"),
            Op::MoeCombine => include_str!("../../../shaders/moe_combine.wgsl"),
            Op::ExpertGateUp => include_str!("../../../shaders/expert_gate_up.wgsl"),
            Op::ExpertDown => include_str!("../../../shaders/expert_down.wgsl"),
            Op::KvStore => include_str!("../../../shaders/kv_store.wgsl"),
            Op::Copy => include_str!("../../../shaders/copy.wgsl"),
            Op::Glu => include_str!("../../../shaders/glu.wgsl"),
            Op::AttentionDecode => include_str!("../../../shaders/attention_decode.wgsl"),
            Op::AttentionMerge => include_str!("../../../shaders/attention_merge.wgsl"),
            Op::Argmax => include_str!("../../../shaders/argmax.wgsl"),
            Op::GatherCols => include_str!("../../../shaders/gather_cols.wgsl"),
            Op::LogitsAdjust => include_str!("../../../shaders/logits_adjust.wgsl"),
            Op::LogitsTopk => include_str!("../../../shaders/logits_topk.wgsl"),
            Op::ExpertGroup => include_str!("../../../shaders/expert_group.wgsl"),
        }
    }

    /// True for the expert kernels (slot-format and pool-count variants).
    pub fn is_expert(self) -> bool {
        matches!(self, Op::ExpertGateUp | Op::ExpertDown)
    }

    /// True for the matrix-vector kernels (`matvec_*.wgsl`).
    pub fn is_matvec(self) -> bool {
        matches!(self, Op::MatvecF32 | Op::MatvecBf16 | Op::MatvecInt8 | Op::MatvecInt4)
    }

    /// True for the kernels built without wgpu's runtime bounds checks and loop bounding
    /// (`create_shader_module_trusted`): the product kernels, whose every index is kept in
    /// bounds by construction (matvec_common.wgsl, expert_common.wgsl) and whose loops are
    /// all counted. They dominate a token's time; the other kernels keep the checks.
    pub fn bounds_by_construction(self) -> bool {
        self.is_matvec() || self.is_expert()
    }

    /// True if the op has NORM variants (the input row RMS-normalized inside the kernel):
    /// the matrix-vector kernels and `expert_gate_up.wgsl`.
    pub fn has_norm(self) -> bool {
        self.is_matvec() || self == Op::ExpertGateUp
    }

    /// True if the op has ACCUMULATE variants (`y += W x + b`): the matrix-vector kernels.
    pub fn has_accumulate(self) -> bool {
        self.is_matvec()
    }

    /// True if the op has TILED variants (the tiled product of prompt blocks,
    /// `matmul_common.wgsl`): the matrix-vector kernels.
    pub fn has_tiled(self) -> bool {
        self.is_matvec()
    }

    /// True if the op has COMBINE variants (down, routing-weighted sum and residual add in
    /// one dispatch): `expert_down.wgsl`.
    pub fn has_combine(self) -> bool {
        self == Op::ExpertDown
    }

    /// True for the kernels that read or write the key/value cache, which have KV_F16
    /// variants ([`Variant::kv_f16`]): `kv_store`, `attention`, `attention_decode`.
    pub fn uses_kv_cache(self) -> bool {
        matches!(self, Op::KvStore | Op::Attention | Op::AttentionDecode)
    }

    /// True if the op has SHADER_F16 variants (f16 scales loaded as f16). The expert kernels
    /// read their records as u32 words (naga cannot bitcast a u32 to two f16), so they
    /// decode f16 scales with integer operations in every variant.
    pub fn uses_f16(self) -> bool {
        self == Op::MatvecInt4
    }

    /// The storage bindings after the uniform parameters at binding 0, in order, for the
    /// build `variant`: the op's own, then (expert kernels) `variant.pools` pools, then
    /// (NORM variants) the norm weight.
    pub fn bindings(self, variant: Variant) -> Vec<Access> {
        use Access::{Read as R, ReadWrite as W};
        let mut v = match self {
            Op::MatvecF32 | Op::MatvecBf16 => vec![R, W, R, R],
            Op::MatvecInt8 | Op::MatvecInt4 => vec![R, W, R, R, R],
            Op::RmsNorm => vec![R, W, R],
            Op::RmsNormHeads => vec![W, R],
            Op::Rope => vec![W, R, R],
            Op::Attention => vec![R, R, R, R, W],
            Op::RouterTopk => vec![R, W],
            Op::RouteAgree => vec![R, R, W],
            Op::Add => vec![R, W],
            Op::MoeCombine => vec![R, R, W],
            Op::ExpertGateUp | Op::ExpertDown => vec![R, R, R, W],
            Op::KvStore => vec![R, R, W, W],
            Op::Copy | Op::Glu | Op::GatherCols => vec![R, W],
            Op::AttentionDecode => vec![R, W, W, R, R, R, W],
            Op::AttentionMerge => vec![R, R, W],
            Op::Argmax => vec![R, W, W],
            Op::LogitsAdjust => vec![W, R],
            Op::LogitsTopk => vec![R, R, W, W],
            Op::ExpertGroup => vec![R, W, W],
        };
        if self.is_expert() {
            v.extend(std::iter::repeat_n(R, variant.pools as usize));
        }
        if variant.norm && self.has_norm() {
            v.push(R);
        }
        v
    }
}

/// Pool counts the expert kernels are built for.
pub const POOL_VARIANTS: [u32; 4] = [1, 2, 4, 8];

/// One build of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Variant {
    /// SHADER_F16: f16 scales loaded as f16 (else unpacked from u32).
    pub f16: bool,
    /// SUBGROUP: reductions with subgroupAdd (else a shared-memory tree).
    pub subgroup: bool,
    /// Expert kernels: the slot format they read (F32, INT4-gs64, MXFP4); F32 for other ops.
    pub experts: SlotFormat,
    /// Expert kernels: pool buffers bound (one of [`POOL_VARIANTS`]); 0 for other ops.
    pub pools: u32,
    /// NORM (matrix-vector kernels, `expert_gate_up`): the input is the raw residual row
    /// and the kernel uses `norm_w[c] * (x[c] * inv)` with `inv = 1 / sqrt(sum(x^2) / cols
    /// + eps)`, as `model::math::rms_norm_in_place` and rmsnorm.wgsl (the same sum order).
    pub norm: bool,
    /// ACCUMULATE (matrix-vector kernels): `y += W x + b` instead of `y = W x + b`.
    pub accumulate: bool,
    /// COMBINE (`expert_down`): `out[r] += sum_j w[r][j] * (down_j act[r][j] + b_j)` in
    /// routing order, one workgroup per (output block, token row) over all k experts.
    pub combine: bool,
    /// GROUPED (expert kernels): one workgroup per (output block, expert) over the pairs
    /// routed to that expert (grouped by expert_group.wgsl), each weight chunk loaded once
    /// for a tile of 8 of them; a prompt block reads each expert of its union once.
    pub grouped: bool,
    /// TILED (matrix-vector kernels): the tiled matrix-matrix product of prompt blocks
    /// (`matmul_common.wgsl` in place of `matvec_common.wgsl`): a workgroup computes 32 rows
    /// for 32 tokens from weight and input tiles in workgroup memory, each weight loaded
    /// once per 32 tokens instead of once per 4. With NORM and ACCUMULATE as the untiled
    /// build.
    pub tiled: bool,
    /// KV_F16 (`kv_store`, `attention`, `attention_decode`): the key/value cache holds
    /// binary16 pairs in u32 words (`pack2x16float` / `unpack2x16float`, core WGSL: no
    /// `enable f16`), rows of `ceil(kv_dim / 2)` words; else f32 values.
    pub kv_f16: bool,
}

impl Variant {
    /// Short label, e.g. `sg+f16+int4+p2` or `sg+mxfp4+p1`.
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if self.subgroup {
            parts.push("sg".to_string());
        }
        if self.f16 {
            parts.push("f16".to_string());
        }
        if self.experts != SlotFormat::F32 {
            parts.push(self.experts.label().to_string());
        }
        if self.pools > 0 {
            parts.push(format!("p{}", self.pools));
        }
        if self.norm {
            parts.push("norm".to_string());
        }
        if self.accumulate {
            parts.push("acc".to_string());
        }
        if self.combine {
            parts.push("combine".to_string());
        }
        if self.grouped {
            parts.push("grouped".to_string());
        }
        if self.tiled {
            parts.push("tiled".to_string());
        }
        if self.kv_f16 {
            parts.push("kvf16".to_string());
        }
        if parts.is_empty() { "portable".into() } else { parts.join("+") }
    }
}

/// Keeps or drops lines between `//#if NAME` (or `//#if !NAME`), `//#else` and `//#endif`.
pub fn preprocess(text: &str, flags: &[&str]) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    // For each open block: (this branch is kept, the enclosing block is kept).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        let active = stack.last().is_none_or(|&(on, outer)| on && outer);
        if let Some(cond) = t.strip_prefix("//#if ") {
            let cond = cond.trim();
            let on = match cond.strip_prefix('!') {
                Some(name) => !flags.contains(&name.trim()),
                None => flags.contains(&cond),
            };
            stack.push((on, active));
        } else if t == "//#else" {
            let top = stack
                .last_mut()
                .ok_or_else(|| Error::Backend(format!("line {}: //#else without //#if", n + 1)))?;
            top.0 = !top.0;
        } else if t == "//#endif" {
            stack.pop().ok_or_else(|| Error::Backend(format!("line {}: //#endif without //#if", n + 1)))?;
        } else if active {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !stack.is_empty() {
        return Err(Error::Backend("unterminated //#if".into()));
    }
    Ok(out)
}

/// The line every kernel declares its entry point with (after `@compute
/// @workgroup_size(WG)`); the loader replaces it with [`entry_point`]. Kernels use no
/// `@builtin` of their own.
pub const ENTRY_LINE: &str = "fn main(ids: Ids) {";

/// The entry point that replaces [`ENTRY_LINE`]: each builtin a separate argument, and `ids`
/// (the `Ids` struct of `common.wgsl`) built from them as the kernel's first statement. One
/// line, so a kernel's line numbers stay as in its file.
///
/// Why not the struct itself as the input: subgroup builtins have no HLSL semantic. naga
/// emulates them (WaveGetLaneIndex(), the group index over WaveGetLaneCount()) only when they
/// are arguments of the entry point; as members of an input struct it writes them with no
/// semantic, and DXC refuses the entry point. `tests/gpu_translate.rs` checks every input of
/// every HLSL entry point has a semantic.
pub fn entry_point(subgroup: bool) -> &'static str {
    if subgroup {
        "fn main(@builtin(local_invocation_index) ep_lid: u32, @builtin(workgroup_id) ep_wid: vec3<u32>, \
         @builtin(subgroup_invocation_id) ep_sg_lane: u32, @builtin(subgroup_id) ep_sg_id: u32, \
         @builtin(num_subgroups) ep_sg_count: u32) { \
         let ids = Ids(ep_lid, ep_wid, ep_sg_lane, ep_sg_id, ep_sg_count);"
    } else {
        "fn main(@builtin(local_invocation_index) ep_lid: u32, @builtin(workgroup_id) ep_wid: vec3<u32>) { \
         let ids = Ids(ep_lid, ep_wid);"
    }
}

/// `text` (a kernel after preprocessing) with its one [`ENTRY_LINE`] replaced by
/// [`entry_point`]; an error when the kernel has no such line, several, or a `@builtin`.
fn with_entry_point(text: &str, subgroup: bool) -> Result<String> {
    if text.contains("@builtin") {
        return Err(Error::Backend(format!(
            "declares a @builtin; kernels take their IDs from `{ENTRY_LINE}` (the loader adds the builtins)"
        )));
    }
    let entries = text.lines().filter(|l| l.trim() == ENTRY_LINE).count();
    if entries != 1 {
        return Err(Error::Backend(format!(
            "{entries} lines `{ENTRY_LINE}`; a kernel declares its entry point with exactly one"
        )));
    }
    let mut out = String::with_capacity(text.len() + 256);
    for line in text.lines() {
        out.push_str(if line.trim() == ENTRY_LINE { entry_point(subgroup) } else { line });
        out.push('\n');
    }
    Ok(out)
}

/// The pool bindings (from binding 5, each `array<vec4<u32>>`: 16-byte loads) and
/// `pool_load(pool, word)` of the expert kernels (for loads outside the loops).
fn pool_decls(pools: u32) -> String {
    let mut s = String::new();
    for i in 0..pools {
        let _ = writeln!(s, "@group(0) @binding({}) var<storage, read> pool{i}: array<vec4<u32>>;", 5 + i);
    }
    let _ = writeln!(s, "const POOLS: u32 = {pools}u;");
    s.push_str("fn pool_load(pool: u32, i: u32) -> u32 {\n    switch pool {\n");
    for i in 1..pools {
        let _ = writeln!(s, "        case {i}u: {{ return pool{i}[i >> 2u][i & 3u]; }}");
    }
    s.push_str("        default: { return pool0[i >> 2u][i & 3u]; }\n    }\n}\n");
    s
}

/// Emits the lines between `//#pools` and `//#endpools` once per pool, `POOL_INDEX` replaced
/// by the pool's index and `POOL` by its binding's name (`pool0`, ...): the per-pool copies
/// of the expert kernels' inner loops, so no loop chooses a pool.
pub fn expand_pools(text: &str, pools: u32) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut block: Option<Vec<&str>> = None;
    for (n, line) in text.lines().enumerate() {
        match (line.trim(), block.as_mut()) {
            ("//#pools", None) => block = Some(Vec::new()),
            ("//#pools", Some(_)) => return Err(Error::Backend(format!("line {}: nested //#pools", n + 1))),
            ("//#endpools", Some(lines)) => {
                for i in 0..pools {
                    for l in lines.iter() {
                        out.push_str(
                            &l.replace("POOL_INDEX", &i.to_string()).replace("POOL", &format!("pool{i}")),
                        );
                        out.push('\n');
                    }
                }
                block = None;
            }
            ("//#endpools", None) => {
                return Err(Error::Backend(format!("line {}: //#endpools without //#pools", n + 1)));
            }
            (_, Some(lines)) => lines.push(line),
            (_, None) => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    if block.is_some() {
        return Err(Error::Backend("unterminated //#pools".into()));
    }
    Ok(out)
}

/// The full WGSL source of `op` built as `variant`.
pub fn source(op: Op, variant: Variant) -> Result<String> {
    let mut flags = Vec::new();
    if variant.f16 {
        flags.push("F16");
    }
    if variant.subgroup {
        flags.push("SUBGROUP");
    }
    if let Some(flag) = variant.experts.flag() {
        flags.push(flag);
    }
    if variant.norm {
        if !op.has_norm() {
            return Err(Error::Backend(format!("{} has no NORM variant", op.file())));
        }
        flags.push("NORM");
    }
    if variant.accumulate {
        if !op.has_accumulate() {
            return Err(Error::Backend(format!("{} has no ACCUMULATE variant", op.file())));
        }
        flags.push("ACCUMULATE");
    }
    if variant.combine {
        if !op.has_combine() {
            return Err(Error::Backend(format!("{} has no COMBINE variant", op.file())));
        }
        flags.push("COMBINE");
    }
    if variant.grouped {
        if !op.is_expert() || variant.norm || variant.combine {
            return Err(Error::Backend(format!(
                "{} has no GROUPED variant [{}]",
                op.file(),
                variant.label()
            )));
        }
        flags.push("GROUPED");
    }
    if variant.tiled {
        if !op.has_tiled() {
            return Err(Error::Backend(format!("{} has no TILED variant", op.file())));
        }
        flags.push("TILED");
    }
    if variant.kv_f16 {
        if !op.uses_kv_cache() {
            return Err(Error::Backend(format!("{} has no KV_F16 variant", op.file())));
        }
        flags.push("KV_F16");
    }
    let mut src = preprocess(COMMON, &flags)?;
    // The op's parameters, declared from their Rust struct (params.rs): after common.wgsl's
    // `enable` directives, before everything that reads `p`.
    src.push_str(op.params().wgsl);
    if op.is_expert() {
        if !POOL_VARIANTS.contains(&variant.pools) {
            return Err(Error::Backend(format!("no expert kernel for {} pools", variant.pools)));
        }
        src.push_str(&pool_decls(variant.pools));
    }
    if variant.norm {
        // The norm weight is the last binding, after the op's own (and the pools).
        let binding = op.bindings(variant).len();
        let _ = writeln!(src, "@group(0) @binding({binding}) var<storage, read> norm_w: array<f32>;");
    }
    if op.is_matvec() || op.is_expert() {
        src.push_str(DECODE);
    }
    if op.is_expert() {
        let common = preprocess(EXPERT_COMMON, &flags)
            .and_then(|t| expand_pools(&t, variant.pools))
            .map_err(|e| Error::Backend(format!("expert_common.wgsl: {e}")))?;
        src.push_str(&common);
    }
    if op.is_matvec() {
        let (common, name) = match variant.tiled {
            true => (MATMUL_COMMON, "matmul_common.wgsl"),
            false => (MATVEC_COMMON, "matvec_common.wgsl"),
        };
        src.push_str(&preprocess(common, &flags).map_err(|e| Error::Backend(format!("{name}: {e}")))?);
    }
    let kernel = preprocess(op.text(), &flags).and_then(|k| with_entry_point(&k, variant.subgroup));
    src.push_str(&kernel.map_err(|e| Error::Backend(format!("{}: {e}", op.file())))?);
    Ok(src)
}

/// Every variant of every op: what a device may build.
pub fn all_variants() -> Vec<(Op, Variant)> {
    let mut out = Vec::new();
    for op in Op::ALL {
        for subgroup in [false, true] {
            let formats: &[SlotFormat] = if op.is_expert() { &SlotFormat::ALL } else { &[SlotFormat::F32] };
            for &experts in formats {
                for f16 in if op.uses_f16() { vec![false, true] } else { vec![false] } {
                    let pools: &[u32] = if op.is_expert() { &POOL_VARIANTS } else { &[0] };
                    for &pools in pools {
                        for norm in if op.has_norm() { vec![false, true] } else { vec![false] } {
                            for accumulate in
                                if op.has_accumulate() { vec![false, true] } else { vec![false] }
                            {
                                for combine in if op.has_combine() { vec![false, true] } else { vec![false] }
                                {
                                    let groupings = if op.is_expert() && !norm && !combine {
                                        vec![false, true]
                                    } else {
                                        vec![false]
                                    };
                                    for grouped in groupings {
                                        for kv_f16 in
                                            if op.uses_kv_cache() { vec![false, true] } else { vec![false] }
                                        {
                                            for tiled in
                                                if op.has_tiled() { vec![false, true] } else { vec![false] }
                                            {
                                                out.push((
                                                    op,
                                                    Variant {
                                                        f16,
                                                        subgroup,
                                                        experts,
                                                        pools,
                                                        norm,
                                                        accumulate,
                                                        combine,
                                                        grouped,
                                                        tiled,
                                                        kv_f16,
                                                    },
                                                ));
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preprocessor_keeps_the_selected_branches() {
        let text = "a\n//#if X\nb\n//#if !Y\nc\n//#else\nd\n//#endif\n//#else\ne\n//#endif\nf\n";
        assert_eq!(preprocess(text, &["X"]).unwrap(), "a\nb\nc\nf\n");
        assert_eq!(preprocess(text, &["X", "Y"]).unwrap(), "a\nb\nd\nf\n");
        assert_eq!(preprocess(text, &["Y"]).unwrap(), "a\ne\nf\n");
        assert!(preprocess("//#if X\n", &[]).is_err());
        assert!(preprocess("//#endif\n", &[]).is_err());
    }

    #[test]
    fn pool_blocks_are_emitted_once_per_pool() {
        let text = "a\n//#pools\nfn f_POOL() { POOL_INDEX }\n//#endpools\nb\n";
        assert_eq!(expand_pools(text, 2).unwrap(), "a\nfn f_pool0() { 0 }\nfn f_pool1() { 1 }\nb\n");
        assert!(expand_pools("//#pools\n", 1).is_err());
        assert!(expand_pools("//#endpools\n", 1).is_err());
    }

    #[test]
    fn every_variant_builds_a_source() {
        for (op, v) in all_variants() {
            let src = source(op, v).unwrap();
            assert!(!src.lines().any(|l| l.trim_start().starts_with("//#")), "{} {}", op.file(), v.label());
            assert_eq!(src.contains("enable f16;"), v.f16, "{} {}", op.file(), v.label());
            assert_eq!(src.contains("subgroupAdd"), v.subgroup, "{} {}", op.file(), v.label());
            assert!(!src.lines().any(|l| l.trim() == ENTRY_LINE), "{} {}", op.file(), v.label());
            assert_eq!(
                src.lines().filter(|l| l.starts_with("fn main(")).count(),
                1,
                "{} {}",
                op.file(),
                v.label()
            );
            assert_eq!(src.contains("@builtin(subgroup_id)"), v.subgroup, "{} {}", op.file(), v.label());
            // An F16 cache is packed and unpacked in f32 arithmetic (no f16 types), and only
            // the cache's kernels have the variant.
            assert_eq!(src.contains("unpack2x16float("), v.kv_f16, "{} {}", op.file(), v.label());
            assert!(!v.kv_f16 || op.uses_kv_cache(), "{} {}", op.file(), v.label());
            // TILED builds are the tiled product (matmul_common.wgsl's `matmul`), only of the
            // matrix-vector kernels, and the untiled ones are not.
            assert_eq!(src.contains("fn matmul("), v.tiled, "{} {}", op.file(), v.label());
            assert!(!v.tiled || op.has_tiled(), "{} {}", op.file(), v.label());
            // The entry point is one line: the kernel's lines keep their count.
            let kernel = preprocess(op.text(), &[]).unwrap();
            assert_eq!(
                with_entry_point(&kernel, v.subgroup).unwrap().lines().count(),
                kernel.lines().count()
            );
        }
    }

    #[test]
    fn params_are_declared_once_by_the_loader() {
        for text in [COMMON, DECODE, EXPERT_COMMON, MATVEC_COMMON, MATMUL_COMMON]
            .into_iter()
            .chain(Op::ALL.map(Op::text))
        {
            assert!(!text.contains("struct Params"), "a shader declares its own Params:\n{text}");
        }
        for (op, v) in all_variants() {
            let src = source(op, v).unwrap();
            assert_eq!(src.matches("struct Params {").count(), 1, "{} {}", op.file(), v.label());
            assert!(src.contains(op.params().wgsl), "{} {}", op.file(), v.label());
        }
        // Each kernel's binding comment names its struct.
        for op in Op::ALL {
            let texts: &[&str] = if op.is_matvec() { &[MATVEC_COMMON, MATMUL_COMMON] } else { &[op.text()] };
            let line = format!("// `Params` is {} (src/backend/gpu/params.rs)", op.params().name);
            for text in texts {
                assert!(text.contains(&line), "{}: no `{line}`", op.file());
            }
        }
    }

    #[test]
    fn a_kernel_needs_exactly_one_entry_line_and_no_builtins() {
        let ok = "@compute @workgroup_size(WG)\nfn main(ids: Ids) {\n    let i = ids.lid;\n}\n";
        let out = with_entry_point(ok, true).unwrap();
        assert!(out.contains("let ids = Ids(ep_lid, ep_wid, ep_sg_lane, ep_sg_id, ep_sg_count);"), "{out}");
        assert!(out.ends_with("    let i = ids.lid;\n}\n"), "{out}");
        let out = with_entry_point(ok, false).unwrap();
        assert!(out.contains("let ids = Ids(ep_lid, ep_wid);") && !out.contains("subgroup"), "{out}");
        assert!(with_entry_point("fn main(ids: Ids, x: u32) {\n}\n", false).is_err());
        assert!(with_entry_point(&format!("{ok}{ok}"), false).is_err());
        let builtin = "fn main(ids: Ids) {\n}\nfn f(@builtin(subgroup_id) s: u32) {}\n";
        assert!(with_entry_point(builtin, false).unwrap_err().to_string().contains("@builtin"));
    }
}
