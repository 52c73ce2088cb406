//! Each WGSL kernel against the CPU oracle's op on random inputs, through the `Backend`
//! ops of `GpuBackend` and `CpuBackend` on the same random model (GPT-OSS-shaped, and
//! Qwen3-MoE-shaped for QK-norm, attention without sinks, softmax-then-top-k routing with
//! ties, plain SwiGLU experts and a dense MLP layer). Sizes are deliberately
//! not multiples of the workgroup size (hidden 100, intermediate 72, vocab 3001, 70-row
//! batches), matrices are split into many row blocks and experts into many pools by a
//! lowered binding limit, and every test runs in the adapter's best shader build and in
//! the portable one.

mod common;

use std::sync::Arc;

use common::gpu::{
    Fmt, Rng, assert_within_f16_bounds, f16_attention_bounds, f16_round, gpu_options, random_model,
    random_model_shaped, random_qwen3_model, rel_diff, variants,
};
use picchio::backend::cpu::{CpuAct, CpuBackend};
use picchio::backend::gpu::{GpuBackend, GpuOptions, KvPrecision, MissPolicy, TILE_TOKENS, TILED_MIN_TOKENS};
use picchio::backend::{Backend, LinearId, NormId, RouteTable};
use picchio::engine::LoadedModel;
use picchio::experts::ResidentExperts;
use picchio::model::weights::ExpertWeights;
use picchio::quant::{Matrix, MatrixData, WeightBuf, mxfp4};

const CAPACITY: usize = 96;

fn cpu(model: &LoadedModel) -> CpuBackend {
    CpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CAPACITY)
        .expect("a 96-position cache fits")
}

fn gpu(model: &LoadedModel, opts: &GpuOptions) -> GpuBackend {
    GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, opts).unwrap()
}

fn host(rows: usize, width: usize, data: Vec<f32>) -> CpuAct {
    CpuAct { rows, width, data }
}

/// Runs `f` for each shader build, with a fresh model and backends.
fn each_variant(test: &str, max_binding: Option<u64>, mut f: impl FnMut(&str, &GpuOptions)) {
    let Some(base) = gpu_options(test) else { return };
    for (name, mut opts) in variants(&base) {
        opts.max_binding_bytes = max_binding;
        f(name, &opts);
    }
}

#[test]
fn matvec_every_format_matches_cpu() {
    // The matrix-vector kernels alone (9 tokens would otherwise run tiled): the kernels of
    // decode and batched steps.
    each_variant("matvec", Some(64 << 10), |variant, opts| {
        let opts = &GpuOptions { untiled_dense: true, ..opts.clone() };
        for fmt in [Fmt::F32, Fmt::Bf16, Fmt::Int8, Fmt::Int4] {
            let model = random_model(1, fmt, Fmt::Int4);
            let cfg = model.config.clone();
            let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
            let mut rng = Rng::new(2);
            let ids = [
                (LinearId::LmHead, cfg.hidden_size, cfg.vocab_size),
                (LinearId::Q(0), cfg.hidden_size, cfg.q_dim()),
                (LinearId::K(2), cfg.hidden_size, cfg.kv_dim()),
                (LinearId::O(1), cfg.q_dim(), cfg.hidden_size),
                (LinearId::Router(2), cfg.hidden_size, cfg.num_experts),
            ];
            for (id, cols, rows_out) in ids {
                for tokens in [1, 3, 5, 9] {
                    let x = rng.vec(tokens * cols, 1.0);
                    let mut co = c.alloc(tokens, rows_out).unwrap();
                    c.linear(id, &host(tokens, cols, x.clone()), &mut co).unwrap();
                    let gx = g.upload(tokens, cols, &x).unwrap();
                    let mut go = g.alloc(tokens, rows_out).unwrap();
                    g.linear(id, &gx, &mut go).unwrap();
                    let got = g.read(&go).unwrap();
                    let d = rel_diff(&got, &co.data);
                    assert!(d < 2e-5, "{variant} {fmt:?} {id:?} tokens {tokens}: relative difference {d}");
                    // Each token's row is bit-identical to the token computed alone (a row of
                    // a batched decode step equals the same row decoded solo).
                    for t in [0, tokens - 1] {
                        let gx1 = g.upload(1, cols, &x[t * cols..(t + 1) * cols]).unwrap();
                        let mut go1 = g.alloc(1, rows_out).unwrap();
                        g.linear(id, &gx1, &mut go1).unwrap();
                        assert!(
                            g.read(&go1).unwrap()[..] == got[t * rows_out..(t + 1) * rows_out],
                            "{variant} {fmt:?} {id:?}: token {t} of {tokens} differs from the token alone"
                        );
                    }
                }
            }
            assert_eq!(g.stats().tiled_products, 0, "untiled_dense runs no tiled product");
        }
    });
}

#[test]
fn tiled_product_every_format_matches_cpu() {
    // Prompt blocks of TILED_MIN_TOKENS or more run the tiled product (matmul_common.wgsl):
    // token counts that are not multiples of its 32-token tile (8: a quarter tile; 33: a
    // full tile and one token; 70), rows that are not multiples of its 32-row tile (vocab
    // 3001, q_dim 96, 6 experts) or exactly one (kv_dim 32), columns that are not multiples
    // of its 32-column step (hidden 100), with bias (Q, K, O, router) and without (head).
    assert_eq!(TILED_MIN_TOKENS, 8, "the token counts below straddle the threshold");
    each_variant("tiled matvec", None, |variant, opts| {
        for fmt in [Fmt::F32, Fmt::Bf16, Fmt::Int8, Fmt::Int4] {
            let model = random_model(35, fmt, Fmt::Int4);
            let cfg = model.config.clone();
            let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
            let mut rng = Rng::new(36);
            let ids = [
                (LinearId::LmHead, cfg.hidden_size, cfg.vocab_size),
                (LinearId::Q(0), cfg.hidden_size, cfg.q_dim()),
                (LinearId::K(2), cfg.hidden_size, cfg.kv_dim()),
                (LinearId::O(1), cfg.q_dim(), cfg.hidden_size),
                (LinearId::Router(2), cfg.hidden_size, cfg.num_experts),
            ];
            for (id, cols, rows_out) in ids {
                for tokens in [7, 8, 9, TILE_TOKENS + 1, 70] {
                    let what = format!("{variant} {fmt:?} {id:?} tokens {tokens}");
                    let x = rng.vec(tokens * cols, 1.0);
                    let mut co = c.alloc(tokens, rows_out).unwrap();
                    c.linear(id, &host(tokens, cols, x.clone()), &mut co).unwrap();
                    let before = g.stats().tiled_tokens;
                    let gx = g.upload(tokens, cols, &x).unwrap();
                    let mut go = g.alloc(tokens, rows_out).unwrap();
                    g.linear(id, &gx, &mut go).unwrap();
                    let got = g.read(&go).unwrap();
                    let tiled = g.stats().tiled_tokens - before;
                    assert_eq!(tiled, if tokens >= TILED_MIN_TOKENS { tokens as u64 } else { 0 }, "{what}");
                    let d = rel_diff(&got, &co.data);
                    assert!(d < 2e-5, "{what}: relative difference {d}");
                    // A token's row does not depend on the block it is in: the same rows
                    // one token later in another block (another tile position) give the
                    // same bits.
                    if tokens > TILED_MIN_TOKENS {
                        let gx1 = g.upload(tokens - 1, cols, &x[cols..]).unwrap();
                        let mut go1 = g.alloc(tokens - 1, rows_out).unwrap();
                        g.linear(id, &gx1, &mut go1).unwrap();
                        assert!(
                            g.read(&go1).unwrap()[..] == got[rows_out..],
                            "{what}: a token's row depends on its place in the block"
                        );
                    }
                }
            }
        }
    });
}

#[test]
fn rmsnorm_matches_cpu() {
    each_variant("rmsnorm", None, |variant, opts| {
        let model = random_model(3, Fmt::F32, Fmt::F32);
        let h = model.config.hidden_size;
        let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
        let mut rng = Rng::new(4);
        for (rows, norm) in [(1, NormId::Final), (7, NormId::Attention(1)), (70, NormId::Mlp(2))] {
            let x = rng.vec(rows * h, 3.0);
            let mut co = c.alloc(rows, h).unwrap();
            c.rms_norm(norm, &host(rows, h, x.clone()), &mut co).unwrap();
            let gx = g.upload(rows, h, &x).unwrap();
            let mut go = g.alloc(rows, h).unwrap();
            g.rms_norm(norm, &gx, &mut go).unwrap();
            let d = rel_diff(&g.read(&go).unwrap(), &co.data);
            assert!(d < 1e-5, "{variant} rows {rows}: relative difference {d}");
        }
    });
}

#[test]
fn rope_matches_cpu() {
    each_variant("rope", None, |variant, opts| {
        let model = random_model(5, Fmt::F32, Fmt::F32);
        let cfg = model.config.clone();
        let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
        let mut rng = Rng::new(6);
        for (rows, width, start) in
            [(5, cfg.q_dim(), 70), (3, cfg.kv_dim(), 0), (1, cfg.q_dim(), CAPACITY - 1)]
        {
            let x = rng.vec(rows * width, 1.0);
            let mut cx = host(rows, width, x.clone());
            c.rope(&mut cx, start).unwrap();
            let mut gx = g.upload(rows, width, &x).unwrap();
            g.rope(&mut gx, start).unwrap();
            let d = rel_diff(&g.read(&gx).unwrap(), &cx.data);
            assert!(d < 1e-6, "{variant} rows {rows} at {start}: relative difference {d}");
        }
    });
}

/// GPU attention against the CPU's on `model` layers `layers`, with random queries, keys and
/// values: a 70-row prefill (crossing a 64-key tile), single decode rows, then a 3-row block.
///
/// The cache read back holds exactly the keys and values given, or with an F16 cache
/// (`opts.kv_precision`) those rounded to the nearest binary16 (as `half` rounds them; WGSL
/// would allow either neighbour). With an F16 cache the output is checked twice: against the
/// CPU oracle on the exact keys and values within the bound of binary16 rounding
/// ([`f16_attention_bounds`]) plus the f32 tolerance, and against the CPU on the rounded keys
/// and values within the f32 tolerance alone. The rounding must also show (a difference from
/// the oracle beyond the f32 tolerance), or the cache is not F16.
fn check_attention(variant: &str, opts: &GpuOptions, model: &LoadedModel, seed: u64, layers: &[usize]) {
    let cfg = model.config.clone();
    let f16 = opts.kv_precision == KvPrecision::F16;
    let (mut c, mut g) = (cpu(model), gpu(model, opts));
    assert_eq!(g.kv_precision(), opts.kv_precision);
    // The CPU on the keys and values an F16 cache holds, and the exact ones so far per layer.
    let mut c16 = cpu(model);
    let mut cached: Vec<(Vec<f32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); cfg.num_layers];
    let (mut worst, mut share) = (0.0f64, 0.0f64);
    let mut rng = Rng::new(seed);
    let mut pos = 0;
    for rows in [70, 1, 1, 3] {
        for &layer in layers {
            let q = rng.vec(rows * cfg.q_dim(), 1.0);
            let k = rng.vec(rows * cfg.kv_dim(), 1.0);
            let v = rng.vec(rows * cfg.kv_dim(), 1.0);
            let mut co = c.alloc(rows, cfg.q_dim()).unwrap();
            let (cq, ck, cv) = (
                host(rows, cfg.q_dim(), q.clone()),
                host(rows, cfg.kv_dim(), k.clone()),
                host(rows, cfg.kv_dim(), v.clone()),
            );
            c.attention(layer, pos, &cq, &ck, &cv, &mut co).unwrap();
            let (gq, gk, gv) = (
                g.upload(rows, cfg.q_dim(), &q).unwrap(),
                g.upload(rows, cfg.kv_dim(), &k).unwrap(),
                g.upload(rows, cfg.kv_dim(), &v).unwrap(),
            );
            let mut go = g.alloc(rows, cfg.q_dim()).unwrap();
            g.attention(layer, pos, &gq, &gk, &gv, &mut go).unwrap();
            let got = g.read(&go).unwrap();
            let what = format!("{variant} layer {layer}, {rows} rows at {pos}");
            // The cache holds the keys and values as given (F32), or rounded to the nearest
            // binary16 (F16), bit for bit.
            let (sk, sv) = g.read_kv_cache(0, layer, pos..pos + rows).unwrap();
            let (wk, wv) = if f16 { (f16_round(&k), f16_round(&v)) } else { (k.clone(), v.clone()) };
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&sk) == bits(&wk) && bits(&sv) == bits(&wv), "{what}: the stored keys or values");
            if !f16 {
                let d = rel_diff(&got, &co.data);
                assert!(d < 1e-5, "{what}: relative difference {d}");
                continue;
            }
            let (k16, v16) =
                (host(rows, cfg.kv_dim(), f16_round(&k)), host(rows, cfg.kv_dim(), f16_round(&v)));
            let mut co16 = c16.alloc(rows, cfg.q_dim()).unwrap();
            c16.attention(layer, pos, &cq, &k16, &v16, &mut co16).unwrap();
            let d = rel_diff(&got, &co16.data);
            assert!(
                d < 1e-5,
                "{what}: relative difference {d} from the CPU on binary16-rounded keys and values"
            );
            let (keys, values) = &mut cached[layer];
            keys.extend_from_slice(&k);
            values.extend_from_slice(&v);
            let bounds = f16_attention_bounds(&cfg, layer, pos, &q, keys, values);
            let (w, sh) = assert_within_f16_bounds(&got, &co.data, &bounds, &what);
            worst = worst.max(w);
            share = share.max(sh);
        }
        pos += rows;
    }
    if f16 {
        eprintln!(
            "{variant}: f16 cache vs the f32 oracle: largest |difference| {worst:.3e}, at most {:.1}% of its bound",
            100.0 * share
        );
        assert!(worst > 1e-5, "{variant}: no difference from the f32 oracle: is the cache f16?");
    }
}

#[test]
fn attention_matches_cpu_across_tiles_windows_and_batches() {
    each_variant("attention", None, |variant, opts| {
        // A sliding (window 5) and a full layer.
        check_attention(variant, opts, &random_model(7, Fmt::F32, Fmt::F32), 8, &[0, 1]);
    });
}

#[test]
fn attention_with_an_f16_cache_is_within_the_rounding_bound_of_the_cpu() {
    each_variant("attention, f16 cache", None, |variant, opts| {
        let opts = GpuOptions { kv_precision: KvPrecision::F16, ..opts.clone() };
        // A sliding (window 5) and a full layer with sinks; QK-norm's shape without sinks.
        check_attention(variant, &opts, &random_model(7, Fmt::F32, Fmt::F32), 8, &[0, 1]);
        check_attention(variant, &opts, &random_qwen3_model(25, Fmt::F32, Fmt::F32, true), 26, &[0, 1, 2]);
    });
}

#[test]
fn router_top_k_and_softmax_match_cpu() {
    each_variant("router", None, |variant, opts| {
        for fmt in [Fmt::F32, Fmt::Bf16] {
            let model = random_model(9, fmt, Fmt::F32);
            let cfg = model.config.clone();
            let h = cfg.hidden_size;
            let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
            let mut rng = Rng::new(10);
            for (rows, layer) in [(1, 0), (9, 1), (70, 2)] {
                let x = rng.vec(rows * h, 2.0);
                let mut cr = c.alloc_routes(rows).unwrap();
                c.route(layer, &host(rows, h, x.clone()), &mut cr).unwrap();
                let gx = g.upload(rows, h, &x).unwrap();
                let mut gr = g.alloc_routes(rows).unwrap();
                g.route(layer, &gx, &mut gr).unwrap();
                let got = g.read_routes(&gr).unwrap();
                assert_eq!(got.k, cr.k);
                assert_eq!(got.experts, cr.experts, "{variant} {fmt:?} layer {layer} rows {rows}: experts");
                let d = rel_diff(&got.weights, &cr.weights);
                assert!(d < 1e-5, "{variant} {fmt:?} layer {layer}: weights differ by {d}");
            }
        }
    });
}

#[test]
fn prediction_agreement_is_counted_on_the_gpu() {
    each_variant("route_agree", None, |variant, opts| {
        let model = random_model(11, Fmt::F32, Fmt::F32);
        let cfg = model.config.clone();
        let h = cfg.hidden_size;
        let opts = GpuOptions { predict: Some(true), ..opts.clone() };
        let (mut c, mut g) = (cpu(&model), gpu(&model, &opts));
        let mut rng = Rng::new(12);
        let rows = 5;
        let x0 = rng.vec(rows * h, 2.0);
        let x1 = rng.vec(rows * h, 2.0);
        // The GPU predicts layer 1 from x0 (router 1 on x0) and scores it against router 1 on x1.
        let (g0, g1) = (g.upload(rows, h, &x0).unwrap(), g.upload(rows, h, &x1).unwrap());
        let mut gr = g.alloc_routes(rows).unwrap();
        let mut e = g.alloc(rows, h).unwrap();
        g.embed(&vec![0; rows], &mut e).unwrap();
        g.route(0, &g0, &mut gr).unwrap();
        g.route(1, &g1, &mut gr).unwrap();
        g.read(&g1).unwrap();
        let s = g.stats();
        let (mut p, mut a) = (c.alloc_routes(rows).unwrap(), c.alloc_routes(rows).unwrap());
        c.route(1, &host(rows, h, x0), &mut p).unwrap();
        c.route(1, &host(rows, h, x1), &mut a).unwrap();
        let want: usize =
            (0..rows).map(|r| p.row_experts(r).iter().filter(|e| a.row_experts(r).contains(e)).count()).sum();
        assert_eq!(s.predicted_total, (rows * cfg.experts_per_token) as u64, "{variant}");
        assert_eq!(s.predicted_hits, want as u64, "{variant}");
    });
}

fn routes(rng: &mut Rng, rows: usize, k: usize, experts: usize) -> RouteTable {
    let mut t = RouteTable { k, experts: Vec::new(), weights: Vec::new() };
    for _ in 0..rows {
        let mut picked: Vec<u32> = Vec::new();
        while picked.len() < k {
            let e = ((rng.next() + 1.0) * 0.5 * experts as f32) as u32 % experts as u32;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        let w: Vec<f32> = (0..k).map(|_| rng.next().abs() + 0.1).collect();
        let sum: f32 = w.iter().sum();
        t.experts.extend(picked);
        t.weights.extend(w.iter().map(|v| v / sum));
    }
    t
}

#[test]
fn experts_match_cpu_in_every_residency() {
    let Some(base) = gpu_options("experts") else { return };
    for (variant, base) in variants(&base) {
        for efmt in [Fmt::Int4, Fmt::F32] {
            let model = random_model(13, Fmt::F32, efmt);
            let cfg = model.config.clone();
            let (h, k) = (cfg.hidden_size, cfg.experts_per_token);
            let slot = model.experts.expert_bytes();
            let total = (cfg.num_layers * cfg.num_experts) as u64;
            let mut c = cpu(&model);
            let mut rng = Rng::new(14);
            let cases: Vec<(usize, usize, RouteTable, Vec<f32>)> = [(1, 0), (5, 1), (70, 2)]
                .into_iter()
                .map(|(rows, layer)| {
                    (rows, layer, routes(&mut rng, rows, k, cfg.num_experts), rng.vec(rows * h, 1.0))
                })
                .collect();
            let want: Vec<Vec<f32>> = cases
                .iter()
                .map(|(rows, layer, r, x)| {
                    let mut o = c.alloc(*rows, h).unwrap();
                    c.experts(*layer, &host(*rows, h, x.clone()), r, &mut o).unwrap();
                    o.data
                })
                .collect();
            // All resident; half; the minimum (k slots: prefill unions run in chunks); and
            // all resident in many small pools (several dispatch groups of pools; the
            // lowered binding limit then only admits the small batches).
            // Every expert on the GPU (missing ones uploaded), where placement changes no
            // bit; then half and the minimum with the missing experts computed on the CPU,
            // within the same tolerance of the CPU.
            let (upload, split) = (MissPolicy::Upload, MissPolicy::Cpu);
            let budgets = [
                (Some(total * slot * 4), None, upload),
                (Some(total * slot / 2), None, upload),
                (Some(1), None, upload),
                (Some(total * slot * 4), Some(3 * slot), upload),
                (Some(total * slot / 2), None, split),
                (Some(1), None, split),
            ];
            let mut first: Vec<Option<Vec<f32>>> = vec![None; cases.len()];
            for (vram, binding, misses) in budgets {
                let opts =
                    GpuOptions { vram_bytes: vram, max_binding_bytes: binding, misses, ..base.clone() };
                let mut g = gpu(&model, &opts);
                let shape = g.residency();
                for (n, ((rows, layer, r, x), w)) in cases.iter().zip(&want).enumerate() {
                    if binding.is_some() && *rows > 5 {
                        continue;
                    }
                    let gx = g.upload(*rows, h, x).unwrap();
                    let gr = g.upload_routes(r).unwrap();
                    let mut go = g.alloc(*rows, h).unwrap();
                    g.experts(*layer, &gx, &gr, &mut go).unwrap();
                    let out = g.read(&go).unwrap();
                    let d = rel_diff(&out, w);
                    assert!(
                        d < 2e-5,
                        "{variant} {efmt:?} {shape:?}: layer {layer} rows {rows}: relative difference {d}"
                    );
                    match &first[n] {
                        _ if misses == split => {}
                        None => first[n] = Some(out),
                        Some(f) => {
                            assert!(f == &out, "{variant} {efmt:?}: placement {shape:?} changed the numbers")
                        }
                    }
                }
                if binding.is_some() {
                    assert!(
                        shape.1 > shape.2 as usize,
                        "{shape:?}: expected more pools than one dispatch binds"
                    );
                } else if vram == Some(1) {
                    assert_eq!(shape.0, k, "the minimum cache holds one token's experts of a layer");
                }
            }
        }
    }
}

#[test]
fn embed_add_and_copy_rows_match_cpu() {
    each_variant("elementwise", None, |variant, opts| {
        for fmt in [Fmt::F32, Fmt::Bf16, Fmt::Int8] {
            let model = random_model(15, fmt, Fmt::F32);
            let h = model.config.hidden_size;
            let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
            let ids = [0u32, 3000, 17, 1234, 5];
            let mut ce = c.alloc(ids.len(), h).unwrap();
            c.embed(&ids, &mut ce).unwrap();
            let mut ge = g.alloc(ids.len(), h).unwrap();
            g.embed(&ids, &mut ge).unwrap();
            assert_eq!(g.read(&ge).unwrap(), ce.data, "{variant} {fmt:?}: embedding rows");
            let y = Rng::new(16).vec(ids.len() * h, 1.0);
            c.add(&mut ce, &host(ids.len(), h, y.clone())).unwrap();
            let gy = g.upload(ids.len(), h, &y).unwrap();
            g.add(&mut ge, &gy).unwrap();
            assert_eq!(g.read(&ge).unwrap(), ce.data, "{variant} {fmt:?}: add");
            let mut cs = c.alloc(2, h).unwrap();
            c.copy_rows(&ce, 3, &mut cs).unwrap();
            let mut gs = g.alloc(2, h).unwrap();
            g.copy_rows(&ge, 3, &mut gs).unwrap();
            assert_eq!(g.read(&gs).unwrap(), cs.data, "{variant} {fmt:?}: copy_rows");
        }
    });
}

/// An MXFP4 matrix whose block `b` of row `r` has the scale byte `scale(r, b)`, with random
/// codes; `small(e)` limits the codes of a block to magnitudes up to 1 (for scales whose
/// large codes would not be finite f32 weights).
fn mxfp4_matrix(rng: &mut Rng, rows: usize, cols: usize, scale: impl Fn(usize, usize) -> u8) -> Matrix {
    let (rb, nb) = (mxfp4::row_bytes(cols), mxfp4::blocks(cols));
    let mut codes = vec![0u8; rows * rb];
    let mut scales = vec![0u8; rows * nb];
    for r in 0..rows {
        for b in 0..nb {
            let e = scale(r, b);
            scales[r * nb + b] = e;
            for j in 0..mxfp4::BLOCK_BYTES {
                let byte = ((rng.next() + 1.0) * 128.0) as u32 as u8;
                // Codes 0..2 and 8..10: magnitudes 0, 0.5, 1.
                let small = |c: u8| (c & 8) | ((c & 7) % 3);
                codes[r * rb + b * mxfp4::BLOCK_BYTES + j] =
                    if e >= 250 { small(byte & 15) | (small(byte >> 4) << 4) } else { byte };
            }
        }
    }
    let data = MatrixData::Mxfp4 { codes: WeightBuf::owned(codes), scales: WeightBuf::owned(scales) };
    Matrix::new("random mxfp4", rows, cols, data).unwrap()
}

/// One token's input for the MXFP4 expert test: block 0 of magnitude 2^-124 (so its
/// products with scales up to 254 are O(1)), block 1 of magnitude 2^115 (against scales
/// 0..12, 0 included), block 2 of magnitude 2^-5 against realistic scales 118..136.
/// Magnitudes are kept at least half the block's power, so no input is subnormal.
fn mxfp4_input(rng: &mut Rng, rows: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * 96);
    for _ in 0..rows {
        for pow in [-124, 115, -5] {
            for _ in 0..32 {
                let u = rng.next();
                x.push(u.signum() * (0.5 + 0.5 * u.abs()) * 2f32.powi(pow));
            }
        }
    }
    x
}

#[test]
fn mxfp4_experts_match_cpu_at_extreme_and_realistic_scales() {
    let Some(base) = gpu_options("mxfp4 experts") else { return };
    // Hidden 96 (3 blocks) and intermediate 160 (5 blocks): whole MXFP4 blocks, neither a
    // multiple of the workgroup size.
    let (h, inter) = (96, 160);
    let shaped = random_model_shaped(17, Fmt::F32, Fmt::F32, h, inter);
    let cfg = shaped.config.clone();
    let mut rng = Rng::new(18);
    let experts: Vec<Vec<ExpertWeights>> = (0..cfg.num_layers)
        .map(|_| {
            (0..cfg.num_experts)
                .map(|_| ExpertWeights {
                    // Gate/up: block 0 at scales 242..254, block 1 at 0..12, block 2 at 118..136.
                    gate_up: mxfp4_matrix(&mut rng, 2 * inter, h, |r, b| match b {
                        0 => 242 + (r % 13) as u8,
                        1 => (r % 13) as u8,
                        _ => 118 + ((r * 7 + 3) % 19) as u8,
                    }),
                    gate_up_bias: rng.vec(2 * inter, 0.5),
                    // Down: realistic scales 118..128 (its inputs are the clipped SwiGLU
                    // outputs, so extreme scales would overflow there).
                    down: mxfp4_matrix(&mut rng, h, inter, |r, b| 118 + ((r * 5 + b * 3) % 11) as u8),
                    down_bias: rng.vec(h, 0.5),
                })
                .collect()
        })
        .collect();
    let model = LoadedModel { experts: Arc::new(ResidentExperts::new(experts)), ..shaped };
    let k = cfg.experts_per_token;
    let slot = model.experts.expert_bytes();
    let total = (cfg.num_layers * cfg.num_experts) as u64;
    let mut c = cpu(&model);
    let cases: Vec<(usize, usize, RouteTable, Vec<f32>)> = [(1, 0), (5, 1), (70, 2)]
        .into_iter()
        .map(|(rows, layer)| {
            (rows, layer, routes(&mut rng, rows, k, cfg.num_experts), mxfp4_input(&mut rng, rows))
        })
        .collect();
    let want: Vec<Vec<f32>> = cases
        .iter()
        .map(|(rows, layer, r, x)| {
            let mut o = c.alloc(*rows, h).unwrap();
            c.experts(*layer, &host(*rows, h, x.clone()), r, &mut o).unwrap();
            assert!(o.data.iter().all(|v| v.is_finite()), "CPU outputs are finite");
            o.data
        })
        .collect();
    for (variant, base) in variants(&base) {
        let mut first: Vec<Option<Vec<f32>>> = vec![None; cases.len()];
        // All resident, and the minimum LRU cache (k slots).
        for vram in [total * slot * 4, 1] {
            let opts = GpuOptions { vram_bytes: Some(vram), misses: MissPolicy::Upload, ..base.clone() };
            let mut g = gpu(&model, &opts);
            let shape = g.residency();
            for (n, ((rows, layer, r, x), w)) in cases.iter().zip(&want).enumerate() {
                let gx = g.upload(*rows, h, x).unwrap();
                let gr = g.upload_routes(r).unwrap();
                let mut go = g.alloc(*rows, h).unwrap();
                g.experts(*layer, &gx, &gr, &mut go).unwrap();
                let out = g.read(&go).unwrap();
                let d = rel_diff(&out, w);
                assert!(
                    d < 2e-5,
                    "{variant} mxfp4 {shape:?}: layer {layer} rows {rows}: relative difference {d}"
                );
                match &first[n] {
                    None => first[n] = Some(out),
                    Some(f) => assert!(f == &out, "{variant} mxfp4: placement {shape:?} changed the numbers"),
                }
            }
        }
    }
}

#[test]
fn mxfp4_scale_extremes_are_not_flushed() {
    // The block scales 0 (2^-127, subnormal in f32) and 254 alone, against inputs that make
    // the products normal: a GPU that built the subnormal scale and flushed it would give
    // 0 for the e = 0 rows, far outside the tolerance.
    let Some(base) = gpu_options("mxfp4 scale extremes") else { return };
    let (h, inter) = (32, 32);
    let shaped = random_model_shaped(19, Fmt::F32, Fmt::F32, h, inter);
    let cfg = shaped.config.clone();
    let mut rng = Rng::new(20);
    for (e, pow) in [(0u8, 120), (254, -124)] {
        let experts: Vec<Vec<ExpertWeights>> = (0..cfg.num_layers)
            .map(|_| {
                (0..cfg.num_experts)
                    .map(|_| ExpertWeights {
                        gate_up: mxfp4_matrix(&mut rng, 2 * inter, h, |_, _| e),
                        gate_up_bias: vec![0.0; 2 * inter],
                        down: mxfp4_matrix(&mut rng, h, inter, |_, _| 125),
                        down_bias: vec![0.0; h],
                    })
                    .collect()
            })
            .collect();
        let model = LoadedModel { experts: Arc::new(ResidentExperts::new(experts)), ..shaped.clone() };
        let mut c = cpu(&model);
        let rows = 3;
        let x: Vec<f32> = (0..rows * h)
            .map(|_| {
                let u = rng.next();
                u.signum() * (0.5 + 0.5 * u.abs()) * 2f32.powi(pow)
            })
            .collect();
        let r = routes(&mut rng, rows, cfg.experts_per_token, cfg.num_experts);
        let mut want = c.alloc(rows, h).unwrap();
        c.experts(0, &host(rows, h, x.clone()), &r, &mut want).unwrap();
        let biggest = want.data.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(biggest > 1e-3, "scale {e}: the CPU result is not negligible ({biggest})");
        for (variant, opts) in variants(&base) {
            let mut g = gpu(&model, &opts);
            let gx = g.upload(rows, h, &x).unwrap();
            let gr = g.upload_routes(&r).unwrap();
            let mut go = g.alloc(rows, h).unwrap();
            g.experts(0, &gx, &gr, &mut go).unwrap();
            let d = rel_diff(&g.read(&go).unwrap(), &want.data);
            assert!(d < 2e-5, "{variant} scale {e}: relative difference {d}");
        }
    }
}

// Qwen3-MoE's recipe (random_qwen3_model: heads x head_dim = 144 on a hidden size of 100,
// QK-norm, no sinks, no biases, plain SwiGLU, softmax-then-top-k routing, layer 1 dense).

#[test]
fn qk_norm_matches_cpu_on_heads_wider_than_the_hidden_size() {
    each_variant("rmsnorm_heads", None, |variant, opts| {
        let model = random_qwen3_model(21, Fmt::F32, Fmt::F32, true);
        let cfg = model.config.clone();
        let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
        let mut rng = Rng::new(22);
        let cases = [
            (1, NormId::Query(0), cfg.q_dim()),
            (7, NormId::Key(2), cfg.kv_dim()),
            (70, NormId::Query(1), cfg.q_dim()),
        ];
        for (rows, norm, width) in cases {
            let x = rng.vec(rows * width, 3.0);
            let mut cx = host(rows, width, x.clone());
            c.rms_norm_heads(norm, &mut cx).unwrap();
            let mut gx = g.upload(rows, width, &x).unwrap();
            g.rms_norm_heads(norm, &mut gx).unwrap();
            let got = g.read(&gx).unwrap();
            let d = rel_diff(&got, &cx.data);
            assert!(d < 1e-5, "{variant} {norm:?} rows {rows}: relative difference {d}");
            // The weight is the layer's query or key one, not the other.
            let other = match norm {
                NormId::Query(l) => NormId::Key(l),
                _ => NormId::Query(0),
            };
            let mut ox = host(rows, width, x.clone());
            c.rms_norm_heads(other, &mut ox).unwrap();
            assert!(rel_diff(&got, &ox.data) > 1e-3, "{variant} {norm:?}: the weight of {other:?} was used");
        }
        let mut gx = g.upload(1, cfg.hidden_size, &rng.vec(cfg.hidden_size, 1.0)).unwrap();
        assert!(g.rms_norm_heads(NormId::Query(0), &mut gx).is_err(), "a width of partial heads is refused");
    });
}

#[test]
fn softmax_then_top_k_routing_matches_cpu_with_ties() {
    each_variant("router softmax-topk", None, |variant, opts| {
        let mut straddles = 0;
        for renormalize in [true, false] {
            for fmt in [Fmt::F32, Fmt::Bf16] {
                let model = random_qwen3_model(23, fmt, Fmt::F32, renormalize);
                let cfg = model.config.clone();
                let (h, k) = (cfg.hidden_size, cfg.experts_per_token);
                let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
                let mut rng = Rng::new(24);
                for (rows, layer) in [(1, 0), (9, 2), (70, 0)] {
                    let x = rng.vec(rows * h, 2.0);
                    let mut cr = c.alloc_routes(rows).unwrap();
                    c.route(layer, &host(rows, h, x.clone()), &mut cr).unwrap();
                    let gx = g.upload(rows, h, &x).unwrap();
                    let mut gr = g.alloc_routes(rows).unwrap();
                    g.route(layer, &gx, &mut gr).unwrap();
                    let got = g.read_routes(&gr).unwrap();
                    let what =
                        format!("{variant} {fmt:?} renormalize {renormalize} layer {layer} rows {rows}");
                    assert_eq!(got.experts, cr.experts, "{what}: experts");
                    let d = rel_diff(&got.weights, &cr.weights);
                    assert!(d < 1e-5, "{what}: weights differ by {d}");
                    for r in 0..rows {
                        let (e, w) = (got.row_experts(r), got.row_weights(r));
                        let sum: f32 = w.iter().sum();
                        if renormalize {
                            assert!((sum - 1.0).abs() < 1e-5, "{what}: row {r} weights sum to {sum}");
                        } else {
                            assert!(sum < 1.0 - 1e-4, "{what}: row {r} weights sum to {sum}, not below 1");
                        }
                        // Experts 2 and 4 (same router row), 1 and 5 (zero rows) tie: the
                        // lower one comes first and is the one kept at the k boundary.
                        for (lo, hi) in [(2u32, 4u32), (1, 5)] {
                            let (pl, ph) = (e.iter().position(|&x| x == lo), e.iter().position(|&x| x == hi));
                            match (pl, ph) {
                                (Some(a), Some(b)) => assert_eq!(a + 1, b, "{what}: row {r} tie {lo}/{hi}"),
                                (None, Some(_)) => panic!("{what}: row {r} kept {hi} over its tie {lo}"),
                                (Some(_), None) => straddles += 1,
                                (None, None) => {}
                            }
                        }
                        assert_eq!(e.len(), k);
                    }
                }
                let gx = g.upload(1, h, &rng.vec(h, 1.0)).unwrap();
                let mut gr = g.alloc_routes(1).unwrap();
                assert!(g.route(1, &gx, &mut gr).is_err(), "the dense layer 1 has no router");
            }
        }
        assert!(straddles > 0, "{variant}: no tie fell on the top-k boundary");
    });
}

#[test]
fn attention_without_sinks_matches_cpu() {
    each_variant("attention without sinks", None, |variant, opts| {
        let model = random_qwen3_model(25, Fmt::F32, Fmt::F32, true);
        assert!(!model.config.recipe.attention_sinks);
        check_attention(variant, opts, &model, 26, &[0, 1, 2]);
    });
}

#[test]
fn silu_glu_experts_match_cpu_beside_a_dense_layer() {
    let Some(base) = gpu_options("silu experts") else { return };
    for (variant, base) in variants(&base) {
        for efmt in [Fmt::Int4, Fmt::F32] {
            let model = random_qwen3_model(27, Fmt::F32, efmt, true);
            let cfg = model.config.clone();
            let (h, k) = (cfg.hidden_size, cfg.experts_per_token);
            let slot = model.experts.expert_bytes();
            let mut c = cpu(&model);
            let mut rng = Rng::new(28);
            // Layers 0 and 2 are MoE; layer 1 (dense) has no experts to hold.
            let cases: Vec<(usize, usize, RouteTable, Vec<f32>)> = [(1, 0), (5, 2), (70, 2)]
                .into_iter()
                .map(|(rows, layer)| {
                    (rows, layer, routes(&mut rng, rows, k, cfg.num_experts), rng.vec(rows * h, 1.0))
                })
                .collect();
            let want: Vec<Vec<f32>> = cases
                .iter()
                .map(|(rows, layer, r, x)| {
                    let mut o = c.alloc(*rows, h).unwrap();
                    c.experts(*layer, &host(*rows, h, x.clone()), r, &mut o).unwrap();
                    o.data
                })
                .collect();
            let moe_experts = 2 * cfg.num_experts;
            for vram in [moe_experts as u64 * slot * 4, 1] {
                let opts = GpuOptions { vram_bytes: Some(vram), misses: MissPolicy::Upload, ..base.clone() };
                let mut g = gpu(&model, &opts);
                let shape = g.residency();
                // Full residency holds the MoE layers' experts and no slot for the dense layer.
                let want_slots = if vram > 1 { moe_experts } else { k };
                assert_eq!((shape.0, shape.3), (want_slots, vram > 1), "{variant} {efmt:?}: slots");
                let shape = g.residency();
                assert_eq!(
                    shape.3,
                    vram > 1,
                    "{variant} {efmt:?}: the MoE layers' experts alone fill the cache"
                );
                for ((rows, layer, r, x), w) in cases.iter().zip(&want) {
                    let gx = g.upload(*rows, h, x).unwrap();
                    let gr = g.upload_routes(r).unwrap();
                    let mut go = g.alloc(*rows, h).unwrap();
                    g.experts(*layer, &gx, &gr, &mut go).unwrap();
                    let d = rel_diff(&g.read(&go).unwrap(), w);
                    assert!(
                        d < 2e-5,
                        "{variant} {efmt:?} {shape:?}: layer {layer} rows {rows}: relative difference {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn dense_mlp_matches_cpu_in_every_dense_format() {
    // A 32 KiB binding limit splits the F32 and BF16 gate/up projections into row blocks,
    // and 70 rows into blocks of 46 and 24 (the gate/up output bound whole), both run tiled.
    each_variant("dense mlp", Some(32 << 10), |variant, opts| {
        for fmt in [Fmt::F32, Fmt::Bf16, Fmt::Int8, Fmt::Int4] {
            let model = random_qwen3_model(29, fmt, Fmt::Int4, true);
            let h = model.config.hidden_size;
            let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
            let mut rng = Rng::new(30);
            for rows in [1, 5, 70] {
                let x = rng.vec(rows * h, 1.0);
                let mut co = c.alloc(rows, h).unwrap();
                c.dense_mlp(1, &host(rows, h, x.clone()), &mut co).unwrap();
                let gx = g.upload(rows, h, &x).unwrap();
                let mut go = g.alloc(rows, h).unwrap();
                g.dense_mlp(1, &gx, &mut go).unwrap();
                let d = rel_diff(&g.read(&go).unwrap(), &co.data);
                assert!(d < 2e-5, "{variant} {fmt:?} rows {rows}: relative difference {d}");
            }
            let gx = g.upload(1, h, &rng.vec(h, 1.0)).unwrap();
            let mut go = g.alloc(1, h).unwrap();
            assert!(g.dense_mlp(0, &gx, &mut go).is_err(), "layer 0 is a MoE layer");
        }
    });
}

// Fusion variants (NORM, ACCUMULATE, COMBINE): each against the CPU composition of the ops
// it fuses, and bit for bit against the GPU's own unfused chain (the forward pass may use
// either, and a placement must never change a number).

/// The (linear, norm) pairs of the fused-product tests: every role a NORM product has in
/// the forward pass (attention input, router input, head), plus O with the MLP norm.
fn fused_linears(cfg: &picchio::ModelConfig) -> Vec<(LinearId, NormId, usize, usize)> {
    vec![
        (LinearId::Q(0), NormId::Attention(0), cfg.hidden_size, cfg.q_dim()),
        (LinearId::K(2), NormId::Attention(2), cfg.hidden_size, cfg.kv_dim()),
        (LinearId::Router(1), NormId::Mlp(1), cfg.hidden_size, cfg.num_experts),
        (LinearId::LmHead, NormId::Final, cfg.hidden_size, cfg.vocab_size),
    ]
}

#[test]
fn fused_norm_product_matches_cpu_rms_norm_then_product() {
    // A 64 KiB binding limit splits the head into row blocks and its 9-token output into
    // token groups.
    each_variant("matvec norm", Some(64 << 10), |variant, opts| {
        for fmt in [Fmt::F32, Fmt::Bf16, Fmt::Int8, Fmt::Int4] {
            let model = random_model(31, fmt, Fmt::Int4);
            let cfg = model.config.clone();
            let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
            g.prepare_fused_kernels().unwrap();
            let mut rng = Rng::new(32);
            for (id, norm, cols, rows_out) in fused_linears(&cfg) {
                // 9 and 33 tokens run tiled (up to the head, whose output the binding limit
                // splits into groups of 5 tokens).
                for tokens in [1, 3, 5, 9, 33] {
                    let what = format!("{variant} {fmt:?} {id:?} {norm:?} tokens {tokens}");
                    let x = rng.vec(tokens * cols, 3.0);
                    let mut cn = c.alloc(tokens, cols).unwrap();
                    c.rms_norm(norm, &host(tokens, cols, x.clone()), &mut cn).unwrap();
                    let mut co = c.alloc(tokens, rows_out).unwrap();
                    c.linear(id, &cn, &mut co).unwrap();
                    let gx = g.upload(tokens, cols, &x).unwrap();
                    let mut go = g.alloc(tokens, rows_out).unwrap();
                    g.linear_fused(id, &gx, &mut go, Some(norm), false).unwrap();
                    let got = g.read(&go).unwrap();
                    let d = rel_diff(&got, &co.data);
                    assert!(d < 2e-5, "{what}: relative difference {d}");
                    // The GPU's unfused chain gives the same bits.
                    let mut gn = g.alloc(tokens, cols).unwrap();
                    g.rms_norm(norm, &gx, &mut gn).unwrap();
                    let mut gu = g.alloc(tokens, rows_out).unwrap();
                    g.linear(id, &gn, &mut gu).unwrap();
                    assert!(g.read(&gu).unwrap() == got, "{what}: differs from rms_norm then linear");
                }
            }
        }
    });
}

#[test]
fn fused_accumulate_product_matches_cpu_product_then_add() {
    each_variant("matvec accumulate", Some(64 << 10), |variant, opts| {
        for fmt in [Fmt::F32, Fmt::Bf16, Fmt::Int8, Fmt::Int4] {
            let model = random_model(33, fmt, Fmt::Int4);
            let cfg = model.config.clone();
            let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
            let mut rng = Rng::new(34);
            let mut ids: Vec<(LinearId, Option<NormId>, usize, usize)> =
                vec![(LinearId::O(1), None, cfg.q_dim(), cfg.hidden_size)];
            ids.extend(fused_linears(&cfg).into_iter().map(|(id, n, c, r)| (id, Some(n), c, r)));
            for (id, norm, cols, rows_out) in ids {
                for tokens in [1, 3, 5, 9, 33] {
                    let what = format!("{variant} {fmt:?} {id:?} {norm:?} tokens {tokens}");
                    let x = rng.vec(tokens * cols, 1.0);
                    let residual = rng.vec(tokens * rows_out, 2.0);
                    let mut cin = host(tokens, cols, x.clone());
                    if let Some(n) = norm {
                        let mut cn = c.alloc(tokens, cols).unwrap();
                        c.rms_norm(n, &cin, &mut cn).unwrap();
                        cin = cn;
                    }
                    let mut co = c.alloc(tokens, rows_out).unwrap();
                    c.linear(id, &cin, &mut co).unwrap();
                    let mut want = host(tokens, rows_out, residual.clone());
                    c.add(&mut want, &co).unwrap();
                    let gx = g.upload(tokens, cols, &x).unwrap();
                    let mut gy = g.upload(tokens, rows_out, &residual).unwrap();
                    g.linear_fused(id, &gx, &mut gy, norm, true).unwrap();
                    let got = g.read(&gy).unwrap();
                    let d = rel_diff(&got, &want.data);
                    assert!(d < 2e-5, "{what}: relative difference {d}");
                    // The GPU's unfused chain (norm, product, add) gives the same bits.
                    let gin = match norm {
                        Some(n) => {
                            let mut gn = g.alloc(tokens, cols).unwrap();
                            g.rms_norm(n, &gx, &mut gn).unwrap();
                            gn
                        }
                        None => g.upload(tokens, cols, &x).unwrap(),
                    };
                    let mut gp = g.alloc(tokens, rows_out).unwrap();
                    g.linear(id, &gin, &mut gp).unwrap();
                    if (tokens * rows_out * 4) as u64 > 64 << 10 {
                        continue; // add.wgsl binds the whole output: within one binding only
                    }
                    let mut gr = g.upload(tokens, rows_out, &residual).unwrap();
                    g.add(&mut gr, &gp).unwrap();
                    assert!(g.read(&gr).unwrap() == got, "{what}: differs from linear then add");
                }
            }
            let gx = g.upload(1, cfg.hidden_size, &rng.vec(cfg.hidden_size, 1.0)).unwrap();
            let mut gy = g.alloc(1, cfg.hidden_size).unwrap();
            assert!(g.linear_fused(LinearId::Q(0), &gx, &mut gy, None, true).is_err(), "wrong shape refused");
        }
    });
}

/// A model of hidden 96 and intermediate 160 (whole MXFP4 blocks, no multiple of 64) with
/// random MXFP4 experts at realistic scales.
fn mxfp4_model(seed: u64) -> LoadedModel {
    let (h, inter) = (96, 160);
    let shaped = random_model_shaped(seed, Fmt::F32, Fmt::F32, h, inter);
    let cfg = shaped.config.clone();
    let mut rng = Rng::new(seed + 1);
    let experts: Vec<Vec<ExpertWeights>> = (0..cfg.num_layers)
        .map(|_| {
            (0..cfg.num_experts)
                .map(|_| ExpertWeights {
                    gate_up: mxfp4_matrix(&mut rng, 2 * inter, h, |r, b| 120 + ((r * 3 + b) % 7) as u8),
                    gate_up_bias: rng.vec(2 * inter, 0.5),
                    down: mxfp4_matrix(&mut rng, h, inter, |r, b| 118 + ((r * 5 + b * 3) % 9) as u8),
                    down_bias: rng.vec(h, 0.5),
                })
                .collect()
        })
        .collect();
    LoadedModel { experts: Arc::new(ResidentExperts::new(experts)), ..shaped }
}

#[test]
fn fused_experts_match_cpu_norm_experts_combine_add() {
    let Some(base) = gpu_options("experts norm+combine") else { return };
    let models = [
        ("int4", random_model(35, Fmt::F32, Fmt::Int4)),
        ("f32", random_model(37, Fmt::F32, Fmt::F32)),
        ("mxfp4", mxfp4_model(39)),
        ("qwen3 int4", random_qwen3_model(41, Fmt::F32, Fmt::Int4, true)),
        // Rows of 98 and 70 inputs: F32 expert rows that are not whole 16-byte chunks,
        // INT4 groups with padding, dense rows padded at upload.
        ("f32 98x70", random_model_shaped(43, Fmt::Bf16, Fmt::F32, 98, 70)),
        ("int4 98x70", random_model_shaped(45, Fmt::Int8, Fmt::Int4, 98, 70)),
    ];
    let mut declined_pools = 0;
    for (variant, base) in variants(&base) {
        for (name, model) in &models {
            let cfg = model.config.clone();
            let (h, k) = (cfg.hidden_size, cfg.experts_per_token);
            let slot = model.experts.expert_bytes();
            let total = (cfg.num_layers * cfg.num_experts) as u64;
            let layers: Vec<usize> =
                (0..cfg.num_layers).filter(|&l| cfg.mlp_kinds[l] == picchio::config::MlpKind::Moe).collect();
            let mut c = cpu(model);
            let mut rng = Rng::new(36);
            let cases: Vec<(usize, usize, RouteTable, Vec<f32>)> = [1, 5, 70]
                .into_iter()
                .enumerate()
                .map(|(n, rows)| {
                    let layer = layers[n % layers.len()];
                    (rows, layer, routes(&mut rng, rows, k, cfg.num_experts), rng.vec(rows * h, 2.0))
                })
                .collect();
            // The CPU composition: h + experts(rms_norm_mlp(h)), combined in routing order.
            let want: Vec<Vec<f32>> = cases
                .iter()
                .map(|(rows, layer, r, x)| {
                    let mut n = c.alloc(*rows, h).unwrap();
                    c.rms_norm(NormId::Mlp(*layer), &host(*rows, h, x.clone()), &mut n).unwrap();
                    let mut o = c.alloc(*rows, h).unwrap();
                    c.experts(*layer, &n, r, &mut o).unwrap();
                    let mut res = host(*rows, h, x.clone());
                    c.add(&mut res, &o).unwrap();
                    res.data
                })
                .collect();
            // Every expert resident (fused), the minimum cache and many small pools (fused
            // only when one dispatch binds them all; else declined: nothing recorded, the
            // residual untouched).
            for (vram, binding) in [(total * slot * 4, None), (1, None), (total * slot * 4, Some(3 * slot))] {
                let opts = GpuOptions {
                    vram_bytes: Some(vram),
                    max_binding_bytes: binding,
                    misses: MissPolicy::Upload,
                    ..base.clone()
                };
                let mut g = gpu(model, &opts);
                g.prepare_fused_kernels().unwrap();
                let shape = g.residency();
                let fused = shape.3 && shape.1 <= shape.2 as usize;
                if binding.is_none() {
                    assert_eq!(fused, vram > 1, "{variant} {name} {shape:?}: fused iff all resident");
                }
                if !fused && shape.3 {
                    declined_pools += 1;
                }
                for ((rows, layer, r, x), w) in cases.iter().zip(&want) {
                    if binding.is_some() && *rows > 5 {
                        continue;
                    }
                    let what = format!("{variant} {name} vram {vram}: layer {layer} rows {rows}");
                    let gr = g.upload_routes(r).unwrap();
                    let gx = g.upload(*rows, h, x).unwrap();
                    // In place, as the forward pass uses it: h += moe(norm(h)).
                    assert_eq!(g.mlp_experts_fused(*layer, &gx, &gr, &gx).unwrap(), fused, "{what}");
                    let got = g.read(&gx).unwrap();
                    if !fused {
                        assert!(&got == x, "{what}: the declined fusion changed the residual");
                        continue;
                    }
                    let d = rel_diff(&got, w);
                    assert!(d < 2e-5, "{what}: relative difference {d}");
                    // Into another residual buffer: the same bits.
                    let (gin, gy) = (g.upload(*rows, h, x).unwrap(), g.upload(*rows, h, x).unwrap());
                    assert!(g.mlp_experts_fused(*layer, &gin, &gr, &gy).unwrap(), "{what}");
                    assert!(g.read(&gy).unwrap() == got, "{what}: separate output differs");
                    // The unfused chain (rms_norm, experts, moe_combine, add) gives the same bits.
                    let gx = g.upload(*rows, h, x).unwrap();
                    let mut gn = g.alloc(*rows, h).unwrap();
                    g.rms_norm(NormId::Mlp(*layer), &gx, &mut gn).unwrap();
                    let mut ge = g.alloc(*rows, h).unwrap();
                    g.experts(*layer, &gn, &gr, &mut ge).unwrap();
                    let mut gres = g.upload(*rows, h, x).unwrap();
                    g.add(&mut gres, &ge).unwrap();
                    assert!(g.read(&gres).unwrap() == got, "{what}: differs from the unfused chain");
                }
            }
        }
    }
    assert!(declined_pools > 0, "no case had every expert resident in more pools than one dispatch binds");
}

/// `Gpu::dispatch` takes the op's own parameter struct (`Op::params`) and refuses another
/// one, recording nothing.
#[test]
fn a_dispatch_with_another_ops_parameters_is_refused() {
    use picchio::backend::gpu::context::{Bind, Gpu};
    use picchio::backend::gpu::device;
    use picchio::backend::gpu::params::{AddParams, CopyParams};
    use picchio::backend::gpu::shaders::{Op, Variant};

    let Some(opts) = gpu_options("dispatch params") else { return };
    let open = device::open(opts.api, opts.allow_software, opts.features).unwrap();
    let mut gpu = Gpu::new(open, None, 64).unwrap();
    let x = gpu.buffer_init("x", &[0u8; 64]).unwrap();
    let y = gpu.buffer_init("y", &[0u8; 64]).unwrap();
    let binds = [Bind::whole(&x), Bind::whole(&y)];
    let v = Variant::default();
    let wrong = CopyParams { n: 16, src_offset: 0, dst_offset: 0, nx: 1 };
    let err = gpu.dispatch(Op::Add, v, &wrong, &binds, (1, 1, 1)).unwrap_err().to_string();
    assert!(err.contains("CopyParams") && err.contains("AddParams"), "{err}");
    assert_eq!(gpu.counters().dispatches, 0);
    let right = AddParams { n: 16, nx: 1, _pad: [0; 2] };
    gpu.dispatch(Op::Add, v, &right, &binds, (1, 1, 1)).unwrap();
    assert_eq!(gpu.counters().dispatches, 1);
    gpu.sync().unwrap();
}

#[test]
fn a_prompt_block_reads_each_expert_of_its_union_once_and_computes_each_pair_as_alone() {
    each_variant("grouped experts", None, |variant, opts| {
        for (label, model) in [
            ("INT4", random_model(71, Fmt::F32, Fmt::Int4)),
            ("F32", random_model(71, Fmt::F32, Fmt::F32)),
            ("MXFP4", mxfp4_model(72)),
        ] {
            let cfg = model.config.clone();
            let (h, k) = (cfg.hidden_size, cfg.experts_per_token);
            let mut rng = Rng::new(73);
            for (rows, budget) in [(70, None), (9, Some(1u64)), (2, None)] {
                let opts = GpuOptions { vram_bytes: budget, misses: MissPolicy::Upload, ..opts.clone() };
                let mut g = gpu(&model, &opts);
                let layer = 1;
                let r = routes(&mut rng, rows, k, cfg.num_experts);
                let x = rng.vec(rows * h, 1.0);
                let before = g.stats();
                let (gx, gr) = (g.upload(rows, h, &x).unwrap(), g.upload_routes(&r).unwrap());
                let mut go = g.alloc(rows, h).unwrap();
                g.experts(layer, &gx, &gr, &mut go).unwrap();
                let grouped = g.read(&go).unwrap();
                let after = g.stats();
                let mut union: Vec<u32> = r.experts.clone();
                union.sort_unstable();
                union.dedup();
                let what = format!("{variant} {label}, {rows} rows, budget {budget:?}");
                assert_eq!(after.expert_passes - before.expert_passes, union.len() as u64, "{what}");
                assert_eq!(after.grouped_pairs - before.grouped_pairs, (rows * k) as u64, "{what}");
                // Each row alone runs per pair: the same numbers, bit for bit.
                for row in 0..rows {
                    let one = RouteTable {
                        k,
                        experts: r.row_experts(row).to_vec(),
                        weights: r.row_weights(row).to_vec(),
                    };
                    let (gx, gr) =
                        (g.upload(1, h, &x[row * h..(row + 1) * h]).unwrap(), g.upload_routes(&one).unwrap());
                    let mut go = g.alloc(1, h).unwrap();
                    g.experts(layer, &gx, &gr, &mut go).unwrap();
                    let alone = g.read(&go).unwrap();
                    assert!(
                        alone == grouped[row * h..(row + 1) * h],
                        "{what}: row {row} differs from its solo run"
                    );
                }
                let solo = g.stats();
                assert_eq!(solo.grouped_pairs, after.grouped_pairs, "{what}: a single row ran grouped");
            }
        }
    });
}

/// kv_store.wgsl's KV_F16 variant alone, on rows the models never have: an odd `kv_dim` (a
/// row of ceil(kv_dim / 2) words ending in a zero half), rows stored from a middle row of the
/// batch to a middle position of the cache, and values beyond binary16's range (saturated
/// to +-65504, where WGSL would leave the conversion indeterminate). Every word is checked
/// against `half`'s round-to-nearest-even conversion; the words around the stored rows stay
/// as they were.
#[test]
fn kv_store_packs_odd_rows_with_a_zero_half_and_saturates() {
    use picchio::backend::gpu::context::{Bind, Gpu};
    use picchio::backend::gpu::device;
    use picchio::backend::gpu::params::KvStoreParams;
    use picchio::backend::gpu::shaders::{Op, Variant};

    let Some(base) = gpu_options("kv_store, odd rows") else { return };
    for (name, opts) in variants(&base) {
        let open = device::open(opts.api, opts.allow_software, opts.features).unwrap();
        if !open.report.f16_in_f32 {
            eprintln!("SKIPPED [{name}]: {} has no pack2x16float", open.report.summary());
            continue;
        }
        let subgroup = open.subgroup;
        let mut gpu = Gpu::new(open, None, 64).unwrap();
        let mut rng = Rng::new(77);
        for kv_dim in [7usize, 9, 1, 70] {
            let (batch, rows, row0, start, capacity) = (5, 3, 1, 4, 10);
            let row = KvPrecision::F16.row_words(kv_dim) as usize;
            let mut k = rng.vec(batch * kv_dim, 3.0);
            let v = rng.vec(batch * kv_dim, 3.0);
            k[row0 * kv_dim] = 1.0e6;
            k[(row0 + 1) * kv_dim] = -7.0e4;
            let sentinel = vec![0xdead_beefu32; capacity * row];
            let bytes = |x: &[f32]| x.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
            let words = |x: &[u32]| x.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
            let (kb, vb) =
                (gpu.buffer_init("k", &bytes(&k)).unwrap(), gpu.buffer_init("v", &bytes(&v)).unwrap());
            let keys = gpu.buffer_init("keys", &words(&sentinel)).unwrap();
            let values = gpu.buffer_init("values", &words(&sentinel)).unwrap();
            let n = rows * row;
            let params = KvStoreParams {
                n: n as u32,
                offset: (start * row) as u32,
                nx: n.div_ceil(64) as u32,
                src: (row0 * kv_dim) as u32,
                kv_dim: kv_dim as u32,
                kv_row: row as u32,
                _pad: [0; 2],
            };
            let variant = Variant { subgroup, kv_f16: true, ..Default::default() };
            let binds = [Bind::whole(&kb), Bind::whole(&vb), Bind::whole(&keys), Bind::whole(&values)];
            gpu.dispatch(Op::KvStore, variant, &params, &binds, (params.nx, 1, 1)).unwrap();
            let size = (capacity * row * 4) as u64;
            let out = gpu.read_back(&[(&keys, 0, size), (&values, 0, size)]).unwrap();
            let got: Vec<u32> = out.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
            let half = |x: f32| half::f16::from_f32(x.clamp(-65504.0, 65504.0)).to_bits() as u32;
            for (which, src, stored) in
                [("keys", &k, &got[..capacity * row]), ("values", &v, &got[capacity * row..])]
            {
                for p in 0..capacity {
                    for w in 0..row {
                        let want = if (start..start + rows).contains(&p) {
                            let r = row0 + p - start;
                            let c = 2 * w;
                            let lo = half(src[r * kv_dim + c]);
                            let hi = if c + 1 < kv_dim { half(src[r * kv_dim + c + 1]) } else { 0 };
                            lo | (hi << 16)
                        } else {
                            0xdead_beef
                        };
                        assert_eq!(
                            stored[p * row + w],
                            want,
                            "[{name}] kv_dim {kv_dim}: {which} at position {p}, word {w}"
                        );
                    }
                }
            }
            // The saturated keys: +-65504 (0x7bff, 0xfbff).
            assert_eq!(got[start * row] & 0xffff, 0x7bff, "[{name}] kv_dim {kv_dim}");
            assert_eq!(got[(start + 1) * row] & 0xffff, 0xfbff, "[{name}] kv_dim {kv_dim}");
        }
    }
}
