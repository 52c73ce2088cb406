//! GPU test helpers: adapter discovery that skips loudly (or fails under
//! `PICCHIO_REQUIRE_GPU=1`), the check that the pinned backend really ran, and random
//! models of awkward shapes for kernel tests.

use std::sync::Arc;

use picchio::ModelConfig;
use picchio::backend::gpu::{AdapterReport, FeatureUse, GpuOptions, probe};
use picchio::engine::LoadedModel;
use picchio::experts::ResidentExperts;
use picchio::model::weights::{
    AttentionWeights, DenseWeights, ExpertWeights, FeedForward, LayerWeights, Linear,
};
use picchio::quant::{Matrix, MatrixData, WeightBuf, int4, int8};

/// True when the environment demands a GPU (CI sets `PICCHIO_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var("PICCHIO_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Options for a GPU test (software adapters allowed), or `None` after printing a loud
/// `SKIPPED` line when no adapter exists. Panics instead when a GPU is required.
pub fn gpu_options(test: &str) -> Option<GpuOptions> {
    let opts = GpuOptions { allow_software: true, ..Default::default() };
    match probe(&opts) {
        Ok(report) => {
            check_pinned_backend(&report);
            Some(opts)
        }
        Err(e) => {
            assert!(!gpu_required(), "PICCHIO_REQUIRE_GPU=1 but no GPU adapter: {e} ({test})");
            eprintln!("SKIPPED: no GPU adapter ({e}) [{test}]");
            None
        }
    }
}

/// With `WGPU_BACKEND=vulkan` (as CI pins it) the adapter must be a Vulkan one: a silent
/// fall-back to GL or to the CPU backend fails the test.
pub fn check_pinned_backend(report: &AdapterReport) {
    if std::env::var("WGPU_BACKEND").is_ok_and(|v| v.eq_ignore_ascii_case("vulkan")) {
        assert_eq!(
            report.backend,
            wgpu::Backend::Vulkan,
            "WGPU_BACKEND=vulkan but ran on {}",
            report.summary()
        );
    }
}

/// The shader builds to test on this adapter: the best one, and the portable one when the
/// best uses optional features.
pub fn variants(base: &GpuOptions) -> Vec<(&'static str, GpuOptions)> {
    let mut v = vec![("best", base.clone())];
    let report = probe(base).expect("adapter vanished");
    if report.subgroup || report.shader_f16 {
        v.push((
            "portable",
            GpuOptions { features: FeatureUse { shader_f16: false, subgroup: false }, ..base.clone() },
        ));
    }
    v
}

/// Deterministic pseudo-random numbers in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// Storage format of a random matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fmt {
    F32,
    Bf16,
    Int8,
    Int4,
}

/// A random `rows x cols` matrix in `fmt`, scaled so products stay near unit size.
pub fn matrix(rng: &mut Rng, rows: usize, cols: usize, fmt: Fmt) -> Matrix {
    let v = rng.vec(rows * cols, 1.5 / (cols as f32).sqrt());
    encode(rows, cols, v, fmt)
}

/// The `rows x cols` values `v` (row-major) stored in `fmt`.
pub fn encode(rows: usize, cols: usize, v: Vec<f32>, fmt: Fmt) -> Matrix {
    let data = match fmt {
        Fmt::F32 => MatrixData::F32(WeightBuf::owned(v)),
        Fmt::Bf16 => {
            MatrixData::Bf16(WeightBuf::owned(v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()))
        }
        Fmt::Int8 => {
            let mut codes = vec![0i8; rows * cols];
            let mut scales = vec![0f32; rows];
            for r in 0..rows {
                scales[r] =
                    int8::quantize_row(&v[r * cols..(r + 1) * cols], &mut codes[r * cols..(r + 1) * cols]);
            }
            MatrixData::Int8Rows { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) }
        }
        Fmt::Int4 => {
            let (rb, g) = (int4::row_bytes(cols), int4::groups(cols));
            let mut codes = vec![0u8; rows * rb];
            let mut scales = vec![0u16; rows * g];
            for r in 0..rows {
                int4::quantize_row(
                    &v[r * cols..(r + 1) * cols],
                    &mut codes[r * rb..(r + 1) * rb],
                    &mut scales[r * g..(r + 1) * g],
                );
            }
            MatrixData::Int4G64 { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) }
        }
    };
    Matrix::new("random", rows, cols, data).unwrap()
}

/// A random GPT-OSS-shaped model with sizes that are not multiples of the workgroup
/// size: hidden 100, intermediate 72, 6 query / 2 KV heads of 16, 6 experts top-4,
/// layers sliding (window 5) / full / sliding, vocab 3001. Dense matrices in `dense`,
/// experts in `experts` (F32 or Int4).
pub fn random_model(seed: u64, dense: Fmt, experts: Fmt) -> LoadedModel {
    random_model_shaped(seed, dense, experts, 100, 72)
}

/// [`random_model`] with another hidden and intermediate size (MXFP4 experts need whole
/// blocks of 32).
#[allow(dead_code)]
pub fn random_model_shaped(seed: u64, dense: Fmt, experts: Fmt, hidden: usize, inter: usize) -> LoadedModel {
    let json = r#"{
        "model_type": "gpt_oss", "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 6, "num_experts_per_tok": 4, "vocab_size": 3001,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 5, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0, "swiglu_limit": 7.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": false}
    }"#;
    let json = json.replace("HIDDEN", &hidden.to_string()).replace("INTER", &inter.to_string());
    let cfg = ModelConfig::from_json_str(&json, std::path::Path::new("random.json")).unwrap();
    let mut rng = Rng::new(seed);
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let lin = |rng: &mut Rng, rows: usize, cols: usize| Linear {
        weight: matrix(rng, rows, cols, dense),
        bias: Some(rng.vec(rows, 0.1)),
    };
    let layers = (0..cfg.num_layers)
        .map(|_| LayerWeights {
            attn_norm: rng.vec(h, 0.5).iter().map(|v| 1.0 + v).collect(),
            attn: AttentionWeights {
                q: lin(&mut rng, cfg.q_dim(), h),
                k: lin(&mut rng, cfg.kv_dim(), h),
                v: lin(&mut rng, cfg.kv_dim(), h),
                o: lin(&mut rng, h, cfg.q_dim()),
                sinks: Some(rng.vec(cfg.num_heads, 2.0)),
                q_norm: None,
                k_norm: None,
            },
            mlp_norm: rng.vec(h, 0.5).iter().map(|v| 1.0 + v).collect(),
            ffn: FeedForward::Moe {
                router: Linear {
                    weight: matrix(&mut rng, cfg.num_experts, h, dense),
                    bias: Some(rng.vec(cfg.num_experts, 0.5)),
                },
            },
        })
        .collect();
    let dense_w = DenseWeights {
        embed: matrix(&mut rng, cfg.vocab_size, h, dense),
        layers,
        final_norm: rng.vec(h, 0.5).iter().map(|v| 1.0 + v).collect(),
        lm_head: matrix(&mut rng, cfg.vocab_size, h, dense),
    };
    let experts_w = (0..cfg.num_layers)
        .map(|_| {
            (0..cfg.num_experts)
                .map(|_| ExpertWeights {
                    gate_up: matrix(&mut rng, 2 * i, h, experts),
                    gate_up_bias: rng.vec(2 * i, 0.5),
                    down: matrix(&mut rng, h, i, experts),
                    down_bias: rng.vec(h, 0.5),
                })
                .collect()
        })
        .collect();
    dense_w.check(&cfg).unwrap();
    LoadedModel {
        config: Arc::new(cfg),
        dense: Arc::new(dense_w),
        experts: Arc::new(ResidentExperts::new(experts_w)),
        dir: std::path::PathBuf::from("random"),
        cpu_dense: Default::default(),
    }
}

/// Largest |a - b| relative to the largest |b| (at least 1).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / scale
}

/// A random Qwen3-MoE-shaped model for kernel tests: hidden 100, 6 query / 2 KV heads of
/// 24 (heads x head_dim = 144, not the hidden size), QK-norm, no sinks and no biases
/// anywhere, 6 experts top-4 of intermediate 72 (`renormalize`: `norm_topk_prob`), layer 1 a
/// dense MLP of intermediate 88, tied embeddings, vocab 3001. Dense matrices in `dense`
/// (the dense MLP too), experts in `experts` (F32 or Int4). In every MoE router, experts 2
/// and 4 have the same row and experts 1 and 5 zero rows, so their logits tie exactly.
#[allow(dead_code)]
pub fn random_qwen3_model(seed: u64, dense: Fmt, experts: Fmt, renormalize: bool) -> LoadedModel {
    let json = r#"{
        "model_type": "qwen3_moe", "hidden_size": 100, "intermediate_size": 88,
        "moe_intermediate_size": 72, "num_hidden_layers": 3, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 24, "num_experts": 6, "num_experts_per_tok": 4,
        "norm_topk_prob": RENORM, "mlp_only_layers": [1], "decoder_sparse_step": 1,
        "vocab_size": 3001, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": true, "attention_bias": false,
        "use_sliding_window": false, "torch_dtype": "float32"
    }"#;
    let json = json.replace("RENORM", if renormalize { "true" } else { "false" });
    let cfg = ModelConfig::from_json_str(&json, std::path::Path::new("random-qwen3.json")).unwrap();
    let mut rng = Rng::new(seed);
    let (h, i, di) = (cfg.hidden_size, cfg.intermediate_size, cfg.dense_intermediate_size);
    let lin = |rng: &mut Rng, rows: usize, cols: usize| Linear {
        weight: matrix(rng, rows, cols, dense),
        bias: None,
    };
    let norm = |rng: &mut Rng, n: usize| -> Vec<f32> { rng.vec(n, 0.5).iter().map(|v| 1.0 + v).collect() };
    let layers = (0..cfg.num_layers)
        .map(|l| LayerWeights {
            attn_norm: norm(&mut rng, h),
            attn: AttentionWeights {
                q: lin(&mut rng, cfg.q_dim(), h),
                k: lin(&mut rng, cfg.kv_dim(), h),
                v: lin(&mut rng, cfg.kv_dim(), h),
                o: lin(&mut rng, h, cfg.q_dim()),
                sinks: None,
                q_norm: Some(norm(&mut rng, cfg.head_dim)),
                k_norm: Some(norm(&mut rng, cfg.head_dim)),
            },
            mlp_norm: norm(&mut rng, h),
            ffn: match cfg.mlp_kinds[l] {
                picchio::config::MlpKind::Moe => {
                    let mut w = rng.vec(cfg.num_experts * h, 1.5 / (h as f32).sqrt());
                    w.copy_within(2 * h..3 * h, 4 * h);
                    w[h..2 * h].fill(0.0);
                    w[5 * h..6 * h].fill(0.0);
                    let weight = encode(cfg.num_experts, h, w, dense);
                    FeedForward::Moe { router: Linear { weight, bias: None } }
                }
                picchio::config::MlpKind::Dense => FeedForward::Dense(ExpertWeights {
                    gate_up: matrix(&mut rng, 2 * di, h, dense),
                    gate_up_bias: vec![0.0; 2 * di],
                    down: matrix(&mut rng, h, di, dense),
                    down_bias: vec![0.0; h],
                }),
            },
        })
        .collect();
    let embed = matrix(&mut rng, cfg.vocab_size, h, dense);
    let dense_w = DenseWeights { lm_head: embed.clone(), embed, layers, final_norm: norm(&mut rng, h) };
    let experts_w = (0..cfg.num_layers)
        .map(|l| {
            let n = match cfg.mlp_kinds[l] {
                picchio::config::MlpKind::Moe => cfg.num_experts,
                picchio::config::MlpKind::Dense => 0,
            };
            (0..n)
                .map(|_| ExpertWeights {
                    gate_up: matrix(&mut rng, 2 * i, h, experts),
                    gate_up_bias: vec![0.0; 2 * i],
                    down: matrix(&mut rng, h, i, experts),
                    down_bias: vec![0.0; h],
                })
                .collect()
        })
        .collect();
    dense_w.check(&cfg).unwrap();
    LoadedModel {
        config: Arc::new(cfg),
        dense: Arc::new(dense_w),
        experts: Arc::new(ResidentExperts::new(experts_w)),
        dir: std::path::PathBuf::from("random-qwen3"),
        cpu_dense: Default::default(),
    }
}

/// Unit roundoff of an F16 key/value cache: a stored value is rounded to the nearest binary16
/// (11 significant bits), a relative error of at most 2^-11. WGSL lets `pack2x16float` round
/// to either neighbour; tests/gpu_kernels.rs and tests/gpu_fused.rs check that the device
/// rounds to nearest (its results equal the CPU's on values rounded with `half`).
#[allow(dead_code)]
pub const F16_UNIT: f64 = 1.0 / 2048.0;

/// The absolute error of a value stored in binary16's subnormal range (below 2^-14): half the
/// subnormal spacing 2^-24.
#[allow(dead_code)]
pub const F16_SUBNORMAL: f64 = 1.0 / (1u64 << 25) as f64;

/// `x` rounded to binary16 and widened back (round to nearest even, `half`'s conversion): the
/// values an F16 key/value cache holds.
#[allow(dead_code)]
pub fn f16_round(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// For `rows` query rows of layer `layer` from position `start` (`q`: `[rows, q_dim]`, after
/// QK-norm and RoPE; `keys`, `values`: `[positions, kv_dim]` from position 0, at least to the
/// last row's), the most each attention output value can move when the cache holds every key
/// and value rounded to binary16 instead of exactly; `[rows, q_dim]`.
///
/// Each stored value x becomes x' with |x' - x| <= u |x| + a (u = [`F16_UNIT`], a =
/// [`F16_SUBNORMAL`]). For one query head with query q, scale c, visible keys k_j and values
/// v_j (the window's), and a sink logit or none:
///
/// * a score s_j = c q.k_j moves by at most d_j = c sum_i |q_i| (u |k_ji| + a) <= d = max_j d_j;
/// * a softmax weight p_j = e^s_j / (e^sink + sum_l e^s_l) has its numerator scaled by at most
///   e^(+-d) and its denominator too (the sink does not move), so |p'_j - p_j| <= (e^2d - 1) p_j;
/// * an output o_i = sum_j p_j v_ji moves by sum_j (p'_j - p_j) v_ji + sum_j p'_j (v'_ji - v_ji),
///   and since sum_j p_j <= 1 and sum_j p'_j <= 1 (the sink takes the rest),
///   |o'_i - o_i| <= (e^2d - 1) V_i + u V_i + a, with V_i = max_j |v_ji|.
///
/// This is the exact-arithmetic effect of the rounding; each side's own f32 arithmetic is
/// the f32 tests' tolerance, added by the caller.
#[allow(dead_code)]
pub fn f16_attention_bounds(
    cfg: &ModelConfig,
    layer: usize,
    start: usize,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
) -> Vec<f64> {
    let (d, q_dim, kv_dim) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
    let group = cfg.num_heads / cfg.num_kv_heads;
    let (u, a) = (F16_UNIT, F16_SUBNORMAL);
    let scale = 1.0 / (d as f64).sqrt();
    let rows = q.len() / q_dim;
    let mut out = vec![0.0f64; q.len()];
    for r in 0..rows {
        let pos = start + r;
        let first = cfg.window(layer).map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..cfg.num_heads {
            let qh = &q[r * q_dim + h * d..r * q_dim + (h + 1) * d];
            let kv0 = (h / group) * d;
            let mut delta = 0.0f64;
            let mut vmax = vec![0.0f64; d];
            for j in first..=pos {
                let k = &keys[j * kv_dim + kv0..j * kv_dim + kv0 + d];
                let v = &values[j * kv_dim + kv0..j * kv_dim + kv0 + d];
                let dj: f64 =
                    qh.iter().zip(k).map(|(&qi, &ki)| (qi as f64).abs() * (u * (ki as f64).abs() + a)).sum();
                delta = delta.max(scale * dj);
                for (m, &vi) in vmax.iter_mut().zip(v) {
                    *m = m.max((vi as f64).abs());
                }
            }
            let grow = (2.0 * delta).exp() - 1.0;
            for (i, &vm) in vmax.iter().enumerate() {
                out[r * q_dim + h * d + i] = grow * vm + u * vm + a;
            }
        }
    }
    out
}

/// The bounds `bounds` of a product's inputs carried through `y = W x (+ anything exact)`:
/// `sum_c |W[r][c]| bounds[t][c]` for each row `t` of `bounds` (`[rows, cols]`, `W`
/// `[out, cols]` row-major as f32).
#[allow(dead_code)]
pub fn bounds_through(w: &[f32], cols: usize, bounds: &[f64]) -> Vec<f64> {
    let out = w.len() / cols;
    bounds
        .chunks(cols)
        .flat_map(|b| {
            (0..out).map(move |r| {
                w[r * cols..(r + 1) * cols].iter().zip(b).map(|(&x, &e)| (x as f64).abs() * e).sum::<f64>()
            })
        })
        .collect()
}

/// Checks `|got - want| <= F32_TOL * max(1, max |want|) + bound` for every value (`F32_TOL`
/// the f32 tests' relative tolerance 1e-5, the two sides' f32 arithmetic) and returns the
/// largest |got - want| and the largest share of its allowance any value used.
#[allow(dead_code)]
pub fn assert_within_f16_bounds(got: &[f32], want: &[f32], bounds: &[f64], what: &str) -> (f64, f64) {
    assert_eq!((got.len(), want.len()), (bounds.len(), bounds.len()), "{what}");
    let f32_tol = 1e-5 * want.iter().fold(1.0f32, |m, v| m.max(v.abs())) as f64;
    let (mut worst, mut share) = (0.0f64, 0.0f64);
    for (i, ((&g, &w), &b)) in got.iter().zip(want).zip(bounds).enumerate() {
        let e = (g as f64 - w as f64).abs();
        let allowed = f32_tol + b;
        assert!(
            e <= allowed,
            "{what}: value {i}: GPU {g} vs CPU {w}, |difference| {e:.3e} over the f16 bound {b:.3e} + f32 tolerance {f32_tol:.3e}"
        );
        worst = worst.max(e);
        share = share.max(e / allowed);
    }
    (worst, share)
}

/// `model` on the GPU with `opts`, a context of `ctx` positions (at most the model's) and
/// blocks of up to 256 positions, checked to run on the pinned backend.
#[allow(dead_code)]
pub fn gpu_forward(
    model: &LoadedModel,
    opts: &GpuOptions,
    ctx: usize,
) -> picchio::model::Forward<picchio::backend::gpu::GpuBackend> {
    let ctx = ctx.min(model.config.max_position_embeddings);
    let b = picchio::backend::gpu::GpuBackend::new(
        model.config.clone(),
        model.dense.clone(),
        model.experts.clone(),
        ctx,
        opts,
    )
    .unwrap();
    check_pinned_backend(b.adapter());
    picchio::model::Forward::new(b, 256)
}
