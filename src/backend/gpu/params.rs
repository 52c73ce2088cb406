//! The uniform parameters of every kernel, defined once for both sides.
//!
//! Each parameter layout is a `#[repr(C)]` struct of named `u32`, `i32` or `f32` fields
//! declared with `kernel_params!`, which emits from the same field list the Rust struct
//! (plain old data: [`bytemuck::Pod`], no implicit padding) and, as
//! [`KernelParams::WGSL`], the WGSL declaration `struct Params { ... }` with the same
//! fields in the same order (each field's doc comment becomes a WGSL comment). The loader
//! ([`super::shaders::source`]) prepends that declaration to the op's source, so no
//! shader declares its parameters itself; every kernel reads them as
//! `@group(0) @binding(0) var<uniform> p: Params;`.
//!
//! [`Op::params`] maps every op to its layout with an exhaustive `match` (a new op without
//! a parameter struct does not compile), and [`Gpu::dispatch`](super::context::Gpu::dispatch)
//! takes the struct itself and refuses one that is not its op's. Floats are `f32` fields, so
//! the bytes the kernel reads are the value's own bits.
//!
//! Uniform layout: every field is a 4-byte scalar, so the WGSL offsets are the Rust ones;
//! a struct ends with explicit zero padding (`_pad`, written as `_pad0`, `_pad1`, ... in
//! WGSL) to a multiple of 16 bytes, and fits one slot of the parameter ring
//! ([`PARAM_SLOT`]). Both are checked at compile time; a unit test parses each generated
//! declaration with naga and compares its size with the Rust struct's.

use std::any::TypeId;

use super::context::PARAM_SLOT;
use super::shaders::Op;

/// A kernel's uniform parameters: a plain-old-data struct whose bytes are the kernel's
/// `p: Params`. Implemented by the structs `kernel_params!` declares.
pub trait KernelParams: bytemuck::Pod + 'static {
    /// The WGSL declaration `struct Params { ... }` of the same fields, in the same order,
    /// of the same types (the loader prepends it to the op's source).
    const WGSL: &'static str;
}

/// The scalar types a parameter field may have (4 bytes each, the same in Rust and WGSL).
pub trait WgslScalar: bytemuck::Pod {}

impl WgslScalar for u32 {}
impl WgslScalar for i32 {}
impl WgslScalar for f32 {}

/// The WGSL lines of `n` padding words `_pad0: u32, ...` (0 to 3: a struct pads to 16 bytes).
macro_rules! wgsl_pad {
    (0) => {
        ""
    };
    (1) => {
        "    _pad0: u32,\n"
    };
    (2) => {
        "    _pad0: u32,\n    _pad1: u32,\n"
    };
    (3) => {
        "    _pad0: u32,\n    _pad1: u32,\n    _pad2: u32,\n"
    };
}

/// Declares a parameter struct and its WGSL twin from one field list:
///
/// ```ignore
/// kernel_params! {
///     /// What the struct is for.
///     pub struct NameParams {
///         /// What the field is.
///         pub field: u32,
///         ...
///     }
///     pad 2
/// }
/// ```
///
/// `pad N` (optional, 1 to 3) appends `pub _pad: [u32; N]` (zeros; `_pad0` .. in WGSL) to
/// reach a multiple of 16 bytes. Fields are `u32`, `i32` or `f32`. Checked at compile
/// time: no implicit padding (the `Pod` derive), a multiple of 16 bytes, at most
/// [`PARAM_SLOT`] bytes.
macro_rules! kernel_params {
    (
        $(#[doc = $sdoc:literal])*
        pub struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                pub $field:ident: $ty:ident,
            )*
        }
        $(pad $pad:tt)?
    ) => {
        $(#[doc = $sdoc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        pub struct $name {
            $(
                $(#[doc = $doc])*
                pub $field: $ty,
            )*
            $(
                /// Zero padding to a multiple of 16 bytes (uniform layout).
                pub _pad: [u32; $pad],
            )?
        }

        impl KernelParams for $name {
            const WGSL: &'static str = concat!(
                "// ",
                stringify!($name),
                " (src/backend/gpu/params.rs), prepended by the loader.\n",
                "struct Params {\n",
                $(
                    $("    //", $doc, "\n",)*
                    "    ", stringify!($field), ": ", stringify!($ty), ",\n",
                )*
                $(wgsl_pad!($pad),)?
                "}\n\n",
            );
        }

        const _: fn() = || {
            fn scalar<T: WgslScalar>() {}
            $(scalar::<$ty>();)*
        };

        const _: () = {
            let size = std::mem::size_of::<$name>();
            assert!(size % 16 == 0, concat!(stringify!($name), ": not a multiple of 16 bytes (adjust `pad`)"));
            assert!(size <= PARAM_SLOT as usize, concat!(stringify!($name), ": larger than a parameter slot"));
        };
    };
}

kernel_params! {
    /// The matrix-vector kernels (`matvec_common.wgsl`, every weight format): `y = W x + b`
    /// for one row block of a matrix.
    pub struct MatvecParams {
        /// Rows of this block.
        pub rows: u32,
        /// Columns of the matrix (the input width).
        pub cols: u32,
        /// The block's first row in the matrix (its rows' offset in `y` and the bias).
        pub row_offset: u32,
        /// Words between tokens' rows of `y` (the matrix's rows).
        pub out_stride: u32,
        /// Token rows of `x` and `y`.
        pub tokens: u32,
        /// 1 when the bias binding holds a bias, 0 when it is the placeholder.
        pub has_bias: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// RMSNorm epsilon (NORM variants).
        pub eps: f32,
        /// 16-byte chunks per stored (padded) row of the weights.
        pub row_chunks: u32,
    }
    pad 3
}

kernel_params! {
    /// `rmsnorm.wgsl`: RMSNorm of each row.
    pub struct RmsNormParams {
        /// Rows.
        pub rows: u32,
        /// Values per row.
        pub width: u32,
        /// RMSNorm epsilon.
        pub eps: f32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
}

kernel_params! {
    /// `rmsnorm_heads.wgsl`: RMSNorm of each head of each row, in place (QK-norm).
    pub struct RmsNormHeadsParams {
        /// Heads in all rows (rows times heads per row).
        pub slices: u32,
        /// Values per head (and of the weight).
        pub head_dim: u32,
        /// RMSNorm epsilon.
        pub eps: f32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
}

kernel_params! {
    /// `rope.wgsl`: rotary embedding of rows `row0 .. row0 + rows`, in place.
    pub struct RopeParams {
        /// Rows rotated.
        pub rows: u32,
        /// Heads per row.
        pub heads: u32,
        /// Values per head.
        pub head_dim: u32,
        /// Position of the first rotated row (row r is at `start_pos + r`).
        pub start_pos: u32,
        /// Values per row of the activation.
        pub width: u32,
        /// Rotated pairs in all: rows * heads * head_dim / 2 (one invocation each).
        pub total: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// First row of the activation rotated.
        pub row0: u32,
    }
}

kernel_params! {
    /// `attention.wgsl`: attention of query rows `row0 .. row0 + rows` over the KV cache.
    pub struct AttentionParams {
        /// Query rows.
        pub rows: u32,
        /// Position of the first query row (row r is at `start_pos + r`).
        pub start_pos: u32,
        /// Query heads.
        pub heads: u32,
        /// Values per head.
        pub head_dim: u32,
        /// Sliding window in positions; 0 for a full-attention layer.
        pub window: u32,
        /// Values per query (and output) row: heads * head_dim.
        pub q_stride: u32,
        /// Values per key or value row of the cache: kv_heads * head_dim.
        pub kv_dim: u32,
        /// Query heads per KV head.
        pub group: u32,
        /// Score scale: 1 / sqrt(head_dim).
        pub scale: f32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// 1 when the layer has attention sinks (the sinks binding is read), else 0.
        pub has_sinks: u32,
        /// First query and output row.
        pub row0: u32,
        /// Words per position of the cache: kv_dim (F32), ceil(kv_dim / 2) (KV_F16).
        pub kv_row: u32,
    }
    pad 3
}

kernel_params! {
    /// `router_topk.wgsl`: the top-k experts of each row of router logits and their weights.
    pub struct RouterTopkParams {
        /// Rows of logits.
        pub rows: u32,
        /// Experts (logits per row).
        pub experts: u32,
        /// Experts selected per row.
        pub k: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// The routing rule: 0 top-k then softmax, 1 softmax then top-k, 2 softmax then
        /// top-k renormalized.
        pub rule: u32,
    }
    pad 3
}

kernel_params! {
    /// `route_agree.wgsl`: counts the predicted experts that the actual routing selected.
    pub struct RouteAgreeParams {
        /// Routing rows.
        pub rows: u32,
        /// Experts per row.
        pub k: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
    pad 1
}

kernel_params! {
    /// `add.wgsl`: `y += x`.
    pub struct AddParams {
        /// Values added.
        pub n: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
    pad 2
}

kernel_params! {
    /// `moe_combine.wgsl`: the routing-weighted sum of the experts' outputs.
    pub struct MoeCombineParams {
        /// Token rows.
        pub rows: u32,
        /// Values per output row.
        pub hidden: u32,
        /// Experts per row.
        pub k: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
}

kernel_params! {
    /// `expert_gate_up.wgsl`: the gate/up projection, bias and gated activation of the
    /// selected experts resident in one pool group. Its first 15 fields are those of
    /// [`ExpertDownParams`] (`expert_common.wgsl` reads them from either).
    pub struct ExpertGateUpParams {
        /// The layer (its row of the slot table).
        pub layer: u32,
        /// Experts per token row.
        pub k: u32,
        /// Experts per layer.
        pub experts: u32,
        /// Hidden size (the input width).
        pub hidden: u32,
        /// Intermediate size (outputs per pair).
        pub inter: u32,
        /// The first pool this dispatch binds.
        pub pool_first: u32,
        /// Slots per pool.
        pub slots_per_pool: u32,
        /// Words between slots.
        pub stride: u32,
        /// Word offset of the gate/up weights in a slot.
        pub w_off: u32,
        /// Word offset of the gate/up scales in a slot (INT4, MXFP4).
        pub s_off: u32,
        /// Word offset of the gate/up bias in a slot.
        pub b_off: u32,
        /// Words per gate/up row.
        pub row_words: u32,
        /// Scale groups (INT4) or blocks (MXFP4) per gate/up row.
        pub groups: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// The first (row, expert) pair of this dispatch (pair = pair_first + z).
        pub pair_first: u32,
        /// Clamp limit of the clipped SwiGLU.
        pub limit: f32,
        /// Sigmoid scale of the clipped SwiGLU.
        pub alpha: f32,
        /// The gated activation: 0 clipped SwiGLU, 1 silu(gate) * up.
        pub activation: u32,
        /// RMSNorm epsilon (NORM variant).
        pub eps: f32,
    }
    pad 1
}

kernel_params! {
    /// `expert_down.wgsl`: the down projection and bias of the selected experts resident in
    /// one pool group (COMBINE: also the routing-weighted sum and the residual add). The
    /// fields are the first 15 of [`ExpertGateUpParams`], for the down matrix.
    pub struct ExpertDownParams {
        /// The layer (its row of the slot table).
        pub layer: u32,
        /// Experts per token row.
        pub k: u32,
        /// Experts per layer.
        pub experts: u32,
        /// Hidden size (outputs per pair).
        pub hidden: u32,
        /// Intermediate size (the input width).
        pub inter: u32,
        /// The first pool this dispatch binds.
        pub pool_first: u32,
        /// Slots per pool.
        pub slots_per_pool: u32,
        /// Words between slots.
        pub stride: u32,
        /// Word offset of the down weights in a slot.
        pub w_off: u32,
        /// Word offset of the down scales in a slot (INT4, MXFP4).
        pub s_off: u32,
        /// Word offset of the down bias in a slot.
        pub b_off: u32,
        /// Words per down row.
        pub row_words: u32,
        /// Scale groups (INT4) or blocks (MXFP4) per down row.
        pub groups: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// The first pair (COMBINE: token row) of this dispatch (z counts from it).
        pub pair_first: u32,
    }
    pad 1
}

kernel_params! {
    /// `kv_store.wgsl`: keys and values of a batch into a layer's KV cache.
    pub struct KvStoreParams {
        /// Cache words written (of keys, and of values): rows * kv_row (one invocation each).
        pub n: u32,
        /// Word offset in the cache of the first stored value: start position * kv_row.
        pub offset: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// Offset in the batch's keys and values of the first stored value: row0 * kv_dim.
        pub src: u32,
        /// Values per key or value row of the batch: kv_heads * head_dim.
        pub kv_dim: u32,
        /// Words per position of the cache: kv_dim (F32), ceil(kv_dim / 2) (KV_F16).
        pub kv_row: u32,
    }
    pad 2
}

kernel_params! {
    /// `copy.wgsl`: `dst[dst_offset + i] = src[src_offset + i]` for `i < n`.
    pub struct CopyParams {
        /// Words copied.
        pub n: u32,
        /// First word read, within the source binding.
        pub src_offset: u32,
        /// First word written, within the destination binding.
        pub dst_offset: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
}

kernel_params! {
    /// `glu.wgsl`: the gated activation of a dense MLP layer.
    pub struct GluParams {
        /// Outputs (rows times the intermediate size).
        pub n: u32,
        /// The gated activation: 0 clipped SwiGLU, 1 silu(gate) * up.
        pub activation: u32,
        /// Clamp limit of the clipped SwiGLU.
        pub limit: f32,
        /// Sigmoid scale of the clipped SwiGLU.
        pub alpha: f32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
    pad 3
}

kernel_params! {
    /// `attention_decode.wgsl`: one decoded token's attention per (KV head, key split).
    pub struct AttentionDecodeParams {
        /// The token's position (its key and value are stored there).
        pub pos: u32,
        /// The first visible position (the sliding window's start, else 0).
        pub first: u32,
        /// Keys per split (a multiple of 64).
        pub chunk: u32,
        /// Key splits.
        pub splits: u32,
        /// KV heads.
        pub kv_heads: u32,
        /// Values per head.
        pub head_dim: u32,
        /// Query heads per KV head.
        pub group: u32,
        /// Values per query row: heads * head_dim.
        pub q_dim: u32,
        /// Values per key or value row: kv_heads * head_dim.
        pub kv_dim: u32,
        /// Score scale: 1 / sqrt(head_dim).
        pub scale: f32,
        /// QK-norm epsilon.
        pub eps: f32,
        /// 1 when the recipe has QK-norm (the `qk_w` binding is read), else 0.
        pub has_qk_norm: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// The token's row of the fused Q/K/V projection.
        pub row: u32,
        /// Words per position of the cache: kv_dim (F32), ceil(kv_dim / 2) (KV_F16).
        pub kv_row: u32,
    }
    pad 1
}

kernel_params! {
    /// `attention_merge.wgsl`: combines the splits of `attention_decode.wgsl` and the sink.
    pub struct AttentionMergeParams {
        /// Query heads.
        pub heads: u32,
        /// Values per head.
        pub head_dim: u32,
        /// Query heads per KV head.
        pub group: u32,
        /// Key splits written by `attention_decode.wgsl`.
        pub splits: u32,
        /// 1 when the layer has attention sinks (the sinks binding is read), else 0.
        pub has_sinks: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
        /// The output row written.
        pub row: u32,
    }
    pad 1
}

kernel_params! {
    /// `argmax.wgsl`: the greedy token of each row of logits, in two stages.
    pub struct ArgmaxParams {
        /// 0: each workgroup scans a span of a row; 1: each row's spans are reduced.
        pub stage: u32,
        /// Logits per row.
        pub vocab: u32,
        /// Rows (the grid's y; the kernel does not read it).
        pub rows: u32,
        /// Logits per workgroup of stage 0.
        pub span: u32,
        /// Workgroups (spans) per row of stage 0.
        pub blocks: u32,
    }
    pad 3
}

kernel_params! {
    /// `gather_cols.wgsl`: `out[r][c] = src[r][col0 + c]`.
    pub struct GatherColsParams {
        /// Rows.
        pub rows: u32,
        /// Columns of the output.
        pub width: u32,
        /// Columns of the source.
        pub src_width: u32,
        /// The first source column copied.
        pub col0: u32,
        /// Workgroups along x of the 2-D grid (`flat_wid`).
        pub nx: u32,
    }
    pad 3
}

/// A parameter layout as the loader and the dispatcher see it, whatever its type.
#[derive(Clone, Copy, Debug)]
pub struct ParamsLayout {
    /// The Rust struct's name (for messages).
    pub name: &'static str,
    /// Its WGSL declaration ([`KernelParams::WGSL`]).
    pub wgsl: &'static str,
    /// Its size in bytes.
    pub size: usize,
    type_id: TypeId,
}

impl ParamsLayout {
    /// The layout of `P`.
    pub fn of<P: KernelParams>() -> Self {
        let name = std::any::type_name::<P>();
        ParamsLayout {
            name: name.rsplit("::").next().unwrap_or(name),
            wgsl: P::WGSL,
            size: std::mem::size_of::<P>(),
            type_id: TypeId::of::<P>(),
        }
    }

    /// True if this is the layout of `P`.
    pub fn is<P: KernelParams>(&self) -> bool {
        self.type_id == TypeId::of::<P>()
    }
}

kernel_params! {
    /// `logits_adjust.wgsl`: a sampler's bias and penalties applied to one row of logits.
    pub struct LogitsAdjustParams {
        /// Entries of the adjustment table (six words each).
        pub count: u32,
        /// Logits per row (entries naming a token at or past it are skipped).
        pub vocab: u32,
        /// Where the row starts in the logits buffer, in elements.
        pub row_offset: u32,
        /// Workgroups along the grid's x (the table is indexed from x and y).
        pub nx: u32,
    }
}

kernel_params! {
    /// `logits_topk.wgsl`: one round of ranking the most likely tokens of a row.
    pub struct LogitsTopkParams {
        /// 0: read the row of logits (and write the statistics); later rounds read the
        /// previous round's entries.
        pub stage: u32,
        /// Entries this round reads.
        pub n: u32,
        /// Entries each workgroup keeps.
        pub k: u32,
        /// The softmax temperature of the statistics' first sum (1 for a greedy plan).
        pub temperature: f32,
        /// Round 0: where the row starts in the logits buffer, in elements.
        pub row_offset: u32,
    }
    pad 3
}

kernel_params! {
    /// `expert_group.wgsl`: a block's (row, slot) pairs grouped by expert.
    pub struct ExpertGroupParams {
        /// Pairs (rows times k).
        pub pairs: u32,
        /// Experts a row is routed to.
        pub k: u32,
        /// Experts of the layer.
        pub experts: u32,
    }
    pad 1
}

impl Op {
    /// The op's parameter layout: the struct [`Gpu::dispatch`](super::context::Gpu::dispatch)
    /// takes for it and whose WGSL the loader prepends to its source. Exhaustive: a new op
    /// needs a parameter struct here.
    pub fn params(self) -> ParamsLayout {
        match self {
            Op::MatvecF32 | Op::MatvecBf16 | Op::MatvecInt8 | Op::MatvecInt4 => {
                ParamsLayout::of::<MatvecParams>()
            }
            Op::RmsNorm => ParamsLayout::of::<RmsNormParams>(),
            Op::RmsNormHeads => ParamsLayout::of::<RmsNormHeadsParams>(),
            Op::Rope => ParamsLayout::of::<RopeParams>(),
            Op::Attention => ParamsLayout::of::<AttentionParams>(),
            Op::RouterTopk => ParamsLayout::of::<RouterTopkParams>(),
            Op::RouteAgree => ParamsLayout::of::<RouteAgreeParams>(),
            Op::Add => ParamsLayout::of::<AddParams>(),
            Op::MoeCombine => ParamsLayout::of::<MoeCombineParams>(),
            Op::ExpertGateUp => ParamsLayout::of::<ExpertGateUpParams>(),
            Op::ExpertDown => ParamsLayout::of::<ExpertDownParams>(),
            Op::KvStore => ParamsLayout::of::<KvStoreParams>(),
            Op::Copy => ParamsLayout::of::<CopyParams>(),
            Op::Glu => ParamsLayout::of::<GluParams>(),
            Op::AttentionDecode => ParamsLayout::of::<AttentionDecodeParams>(),
            Op::AttentionMerge => ParamsLayout::of::<AttentionMergeParams>(),
            Op::Argmax => ParamsLayout::of::<ArgmaxParams>(),
            Op::GatherCols => ParamsLayout::of::<GatherColsParams>(),
            Op::LogitsAdjust => ParamsLayout::of::<LogitsAdjustParams>(),
            Op::LogitsTopk => ParamsLayout::of::<LogitsTopkParams>(),
            Op::ExpertGroup => ParamsLayout::of::<ExpertGroupParams>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use naga::valid::{Capabilities, ValidationFlags, Validator};

    use super::*;

    /// The WGSL `struct Params` of `layout`, parsed and validated with naga as the uniform
    /// every kernel binds: its size and its members' (name, offset).
    fn wgsl_struct(layout: &ParamsLayout) -> (u32, Vec<(String, u32)>) {
        let src = format!(
            "{}@group(0) @binding(0) var<uniform> p: Params;\n\
             @compute @workgroup_size(1)\nfn main() {{ let q = p; }}\n",
            layout.wgsl
        );
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{}: {}", layout.name, e.emit_to_string(&src)));
        Validator::new(ValidationFlags::all(), Capabilities::empty())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}: {}", layout.name, e.emit_to_string(&src)));
        let ty = module.types.iter().find(|(_, t)| t.name.as_deref() == Some("Params"));
        match ty.map(|(_, t)| &t.inner) {
            Some(naga::TypeInner::Struct { members, span }) => {
                (*span, members.iter().map(|m| (m.name.clone().unwrap_or_default(), m.offset)).collect())
            }
            other => panic!("{}: no struct Params ({other:?})", layout.name),
        }
    }

    #[test]
    fn every_ops_params_parse_with_the_rust_size() {
        for op in Op::ALL {
            let layout = op.params();
            let (span, members) = wgsl_struct(&layout);
            assert_eq!(span as usize, layout.size, "{op:?}: {} in WGSL and Rust", layout.name);
            assert!(layout.size % 16 == 0 && layout.size <= PARAM_SLOT as usize, "{op:?}");
            // One 4-byte scalar per word, in order: the WGSL offsets are the Rust ones.
            assert_eq!(members.len() * 4, layout.size, "{op:?}");
            for (i, (name, offset)) in members.iter().enumerate() {
                assert_eq!(*offset as usize, 4 * i, "{op:?}: {name}");
            }
        }
    }

    #[test]
    fn fields_keep_their_names_types_and_values() {
        let layout = ParamsLayout::of::<GluParams>();
        let (_, members) = wgsl_struct(&layout);
        let names: Vec<&str> = members.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["n", "activation", "limit", "alpha", "nx", "_pad0", "_pad1", "_pad2"]);
        assert!(GluParams::WGSL.contains("    limit: f32,\n") && GluParams::WGSL.contains("    n: u32,\n"));
        // Field docs become WGSL comments.
        assert!(GluParams::WGSL.contains("    // Clamp limit of the clipped SwiGLU.\n"));
        let p = GluParams { n: 5, activation: 1, limit: 7.0, alpha: 1.702, nx: 3, _pad: [0; 3] };
        let words: &[u32] = bytemuck::cast_slice(bytemuck::bytes_of(&p));
        assert_eq!(words, [5, 1, 7.0f32.to_bits(), 1.702f32.to_bits(), 3, 0, 0, 0]);
    }

    #[test]
    fn the_expert_layouts_share_their_first_fields() {
        let (_, gate_up) = wgsl_struct(&ParamsLayout::of::<ExpertGateUpParams>());
        let (_, down) = wgsl_struct(&ParamsLayout::of::<ExpertDownParams>());
        assert_eq!(gate_up[..15], down[..15]);
    }

    #[test]
    fn a_layout_knows_its_type() {
        let layout = Op::MatvecInt4.params();
        assert!(layout.is::<MatvecParams>() && !layout.is::<CopyParams>());
        assert_eq!(layout.name, "MatvecParams");
        assert_eq!(Op::MatvecF32.params().wgsl, MatvecParams::WGSL);
    }
}
