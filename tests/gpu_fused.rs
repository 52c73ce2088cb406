//! The GPU's fused decode paths against the CPU oracle's plain ops, on random models:
//! the attention half of a decoded token (stacked Q/K/V product, attention_decode.wgsl with
//! QK-norm, RoPE, the key/value store and flash-decoding over key splits, attention_merge.wgsl
//! with or without sinks, the output projection and the residual), at positions whose keys
//! span several splits and in sliding layers; and the greedy argmax (argmax.wgsl) with ties
//! and non-finite logits. Every test runs in the adapter's best shader build and in the
//! portable one. With an F16 key/value cache the same paths are checked against the CPU
//! within the derived bound of binary16 rounding (tests/common/gpu.rs,
//! `f16_attention_bounds`).

mod common;

use common::gpu::{
    F16_SUBNORMAL, F16_UNIT, Fmt, Rng, assert_within_f16_bounds, bounds_through, f16_attention_bounds,
    gpu_options, random_model, random_qwen3_model, rel_diff, variants,
};
use picchio::backend::cpu::{CpuAct, CpuBackend};
use picchio::backend::gpu::{GpuBackend, GpuOptions, KvPrecision};
use picchio::backend::{Backend, LinearId, NormId};
use picchio::engine::LoadedModel;
use picchio::model::math::argmax_with_margin;

/// Room for a prompt long enough that a decoded token's keys span three 128-key splits.
const CAPACITY: usize = 400;

fn each_variant(test: &str, mut f: impl FnMut(&str, &GpuOptions)) {
    let Some(base) = gpu_options(test) else { return };
    for (name, opts) in variants(&base) {
        f(name, &opts);
    }
}

/// The attention half of a layer as the forward pass runs it op by op: `x += O(attention(
/// rope(qk_norm(QKV(rms_norm(x))))))` for the `n` rows of `x` from position `pos`.
fn plain_attention_half<B: Backend>(b: &mut B, layer: usize, pos: usize, n: usize, x: &mut B::Act) {
    let cfg = b.config().clone();
    let mut normed = b.alloc(n, cfg.hidden_size).unwrap();
    let (mut q, mut k, mut v) = (
        b.alloc(n, cfg.q_dim()).unwrap(),
        b.alloc(n, cfg.kv_dim()).unwrap(),
        b.alloc(n, cfg.kv_dim()).unwrap(),
    );
    b.rms_norm(NormId::Attention(layer), x, &mut normed).unwrap();
    b.linear_qkv(layer, &normed, &mut q, &mut k, &mut v).unwrap();
    if cfg.recipe.qk_norm {
        b.rms_norm_heads(NormId::Query(layer), &mut q).unwrap();
        b.rms_norm_heads(NormId::Key(layer), &mut k).unwrap();
    }
    b.rope(&mut q, pos).unwrap();
    b.rope(&mut k, pos).unwrap();
    let mut attn = b.alloc(n, cfg.q_dim()).unwrap();
    b.attention(layer, pos, &q, &k, &v, &mut attn).unwrap();
    let mut proj = b.alloc(n, cfg.hidden_size).unwrap();
    b.linear(LinearId::O(layer), &attn, &mut proj).unwrap();
    b.add(x, &proj).unwrap();
}

/// Fills both caches of `layers` with a `prompt`-row block op by op, then decodes single
/// rows: the GPU's fused attention half against the CPU's ops, compared after every row.
fn check_fused_attention(
    variant: &str,
    opts: &GpuOptions,
    model: &LoadedModel,
    layers: &[usize],
    prompt: usize,
) {
    let cfg = model.config.clone();
    let mut c = CpuBackend::new(cfg.clone(), model.dense.clone(), model.experts.clone(), CAPACITY).unwrap();
    let mut g =
        GpuBackend::new(cfg.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, opts).unwrap();
    let mut rng = Rng::new(91);
    let h = cfg.hidden_size;
    for &layer in layers {
        let x = rng.vec(prompt * h, 1.0);
        let mut cx = picchio::backend::cpu::CpuAct { rows: prompt, width: h, data: x.clone() };
        let mut gx = g.upload(prompt, h, &x).unwrap();
        plain_attention_half(&mut c, layer, 0, prompt, &mut cx);
        assert!(!g.fused_attention(layer, 0, &mut gx).unwrap(), "a prompt block is not fused");
        plain_attention_half(&mut g, layer, 0, prompt, &mut gx);
        for pos in prompt..prompt + 3 {
            let x = rng.vec(h, 1.0);
            let mut cx = picchio::backend::cpu::CpuAct { rows: 1, width: h, data: x.clone() };
            let mut gx = g.upload(1, h, &x).unwrap();
            plain_attention_half(&mut c, layer, pos, 1, &mut cx);
            assert!(g.fused_attention(layer, pos, &mut gx).unwrap(), "{variant}: a decoded row is fused");
            let d = rel_diff(&g.read(&gx).unwrap(), &cx.data);
            assert!(d < 1e-5, "{variant} layer {layer} position {pos}: relative difference {d}");
        }
    }
}

/// The CPU's attention half as [`plain_attention_half`] runs it, returning the queries and
/// keys (after QK-norm and RoPE) and the values it computed; with `stored`, it stores and
/// attends with those keys and values instead of its own (the ones a GPU cache holds).
fn cpu_attention_half(
    c: &mut CpuBackend,
    layer: usize,
    pos: usize,
    x: &mut CpuAct,
    stored: Option<(&[f32], &[f32])>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let cfg = c.config().clone();
    let n = x.rows;
    let mut normed = c.alloc(n, cfg.hidden_size).unwrap();
    let (mut q, mut k, mut v) = (
        c.alloc(n, cfg.q_dim()).unwrap(),
        c.alloc(n, cfg.kv_dim()).unwrap(),
        c.alloc(n, cfg.kv_dim()).unwrap(),
    );
    c.rms_norm(NormId::Attention(layer), x, &mut normed).unwrap();
    c.linear_qkv(layer, &normed, &mut q, &mut k, &mut v).unwrap();
    if cfg.recipe.qk_norm {
        c.rms_norm_heads(NormId::Query(layer), &mut q).unwrap();
        c.rms_norm_heads(NormId::Key(layer), &mut k).unwrap();
    }
    c.rope(&mut q, pos).unwrap();
    c.rope(&mut k, pos).unwrap();
    let computed = (q.data.clone(), k.data.clone(), v.data.clone());
    if let Some((sk, sv)) = stored {
        k.data.copy_from_slice(sk);
        v.data.copy_from_slice(sv);
    }
    let mut attn = c.alloc(n, cfg.q_dim()).unwrap();
    c.attention(layer, pos, &q, &k, &v, &mut attn).unwrap();
    let mut proj = c.alloc(n, cfg.hidden_size).unwrap();
    c.linear(LinearId::O(layer), &attn, &mut proj).unwrap();
    c.add(x, &proj).unwrap();
    computed
}

/// [`check_fused_attention`] with an F16 cache, after the prompt block (kv_store and
/// attention.wgsl) and at each decoded row (attention_decode.wgsl over the key splits, which
/// also stores the row's key and value):
///
/// * each key and value the GPU stored is the CPU's rounded to binary16: within u |x| + a of
///   it (u = 2^-11, a = 2^-25, tests/common/gpu.rs) plus the f32 tolerance (each side
///   computed x itself);
/// * the GPU's residual equals, within the f32 tolerance, the CPU's attention half run on the
///   keys and values the GPU's cache holds (read back): the kernels attend with exactly what
///   is stored;
/// * the GPU's residual is within the bound of binary16 rounding of every key and value
///   ([`f16_attention_bounds`], carried through the output projection:
///   sum_c |W_o[r][c]| bound_c) plus the f32 tolerance of the CPU oracle, and the rounding
///   shows somewhere (a difference beyond the f32 tolerance).
///
/// The second check uses the stored values rather than the CPU's own keys rounded: each side
/// computes its keys, and a value within f32 rounding of a binary16 rounding boundary rounds
/// one way on the GPU and the other on the CPU, one binary16 step apart (seen: a relative
/// difference of 4e-5 after a 260-row prompt), which the f32 tolerance does not cover.
fn check_fused_attention_f16(
    variant: &str,
    opts: &GpuOptions,
    model: &LoadedModel,
    layers: &[usize],
    prompt: usize,
) {
    let cfg = model.config.clone();
    let cpu = || CpuBackend::new(cfg.clone(), model.dense.clone(), model.experts.clone(), CAPACITY).unwrap();
    // The oracle, and the CPU attending with the GPU's stored keys and values.
    let (mut c, mut c16) = (cpu(), cpu());
    let opts = GpuOptions { kv_precision: KvPrecision::F16, ..opts.clone() };
    let mut g =
        GpuBackend::new(cfg.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, &opts).unwrap();
    let mut rng = Rng::new(91);
    let h = cfg.hidden_size;
    let (mut worst, mut share) = (0.0f64, 0.0f64);
    for &layer in layers {
        let o = model.dense.layers[layer].attn.o.weight.to_f32();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (pos, rows) in [(0, prompt), (prompt, 1), (prompt + 1, 1), (prompt + 2, 1)] {
            let x = rng.vec(rows * h, 1.0);
            let mut cx = CpuAct { rows, width: h, data: x.clone() };
            let mut cx16 = cx.clone();
            let (q, k, v) = cpu_attention_half(&mut c, layer, pos, &mut cx, None);
            keys.extend_from_slice(&k);
            values.extend_from_slice(&v);
            let mut gx = g.upload(rows, h, &x).unwrap();
            if rows == 1 {
                assert!(g.fused_attention(layer, pos, &mut gx).unwrap(), "{variant}: a decoded row is fused");
            } else {
                plain_attention_half(&mut g, layer, pos, rows, &mut gx);
            }
            let got = g.read(&gx).unwrap();
            let what = format!("{variant} f16 cache, layer {layer}, {rows} row(s) at position {pos}");
            let (sk, sv) = g.read_kv_cache(0, layer, pos..pos + rows).unwrap();
            for (name, stored, exact) in [("key", &sk, &k), ("value", &sv, &v)] {
                let f32_tol = 1e-5 * exact.iter().fold(1.0f32, |m, x| m.max(x.abs())) as f64;
                for (i, (&s, &x)) in stored.iter().zip(exact.iter()).enumerate() {
                    let allowed = F16_UNIT * (x as f64).abs() + F16_SUBNORMAL + f32_tol;
                    let e = (s as f64 - x as f64).abs();
                    assert!(
                        e <= allowed,
                        "{what}: stored {name} {i} is {s}, the CPU's {x}: {e:.3e} > {allowed:.3e}"
                    );
                }
            }
            cpu_attention_half(&mut c16, layer, pos, &mut cx16, Some((&sk, &sv)));
            let d = rel_diff(&got, &cx16.data);
            assert!(
                d < 1e-5,
                "{what}: relative difference {d} from the CPU attending with the stored keys and values"
            );
            let bounds = f16_attention_bounds(&cfg, layer, pos, &q, &keys, &values);
            let bounds = bounds_through(&o, cfg.q_dim(), &bounds);
            let (w, sh) = assert_within_f16_bounds(&got, &cx.data, &bounds, &what);
            worst = worst.max(w);
            share = share.max(sh);
        }
    }
    eprintln!(
        "{variant}: f16 cache vs the f32 oracle after the attention half: largest |difference| {worst:.3e}, at most {:.1}% of its bound",
        100.0 * share
    );
    assert!(worst > 1e-5, "{variant}: no difference from the f32 oracle: is the cache f16?");
}

#[test]
fn fused_decode_attention_with_an_f16_cache_is_within_the_rounding_bound_of_the_cpu() {
    each_variant("fused decode attention, f16 cache", |variant, opts| {
        // Sliding (window 5) and full layers with sinks, three key splits; BF16 projections
        // with a prompt ending inside a split's first tile; QK-norm and no sinks.
        check_fused_attention_f16(variant, opts, &random_model(41, Fmt::F32, Fmt::F32), &[0, 1], 260);
        check_fused_attention_f16(variant, opts, &random_model(42, Fmt::Bf16, Fmt::F32), &[1], 129);
        let qwen3 = random_qwen3_model(43, Fmt::F32, Fmt::F32, true);
        assert!(qwen3.config.recipe.qk_norm && !qwen3.config.recipe.attention_sinks);
        check_fused_attention_f16(variant, opts, &qwen3, &[0, 2], 200);
    });
}

#[test]
fn fused_decode_attention_matches_the_cpu_ops_across_splits_windows_and_sinks() {
    each_variant("fused decode attention", |variant, opts| {
        // Layer 0 slides (window 5), layer 1 sees all 260+ keys: three splits of 128.
        check_fused_attention(variant, opts, &random_model(41, Fmt::F32, Fmt::F32), &[0, 1], 260);
        // BF16 projections, a prompt that ends inside the first tile of a split.
        check_fused_attention(variant, opts, &random_model(42, Fmt::Bf16, Fmt::F32), &[1], 129);
    });
}

#[test]
fn fused_decode_attention_with_qk_norm_and_no_sinks_matches_the_cpu_ops() {
    each_variant("fused decode attention, QK-norm", |variant, opts| {
        let model = random_qwen3_model(43, Fmt::F32, Fmt::F32, true);
        assert!(model.config.recipe.qk_norm && !model.config.recipe.attention_sinks);
        check_fused_attention(variant, opts, &model, &[0, 2], 200);
    });
}

#[test]
fn greedy_argmax_on_the_gpu_matches_the_cpu_with_ties_and_refuses_non_finite_logits() {
    each_variant("argmax", |variant, opts| {
        let model = random_model(44, Fmt::F32, Fmt::F32);
        let vocab = model.config.vocab_size;
        let mut g =
            GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, opts)
                .unwrap();
        let mut rng = Rng::new(45);
        let mut rows = Vec::new();
        // Random rows; a row whose maximum appears twice (the lower index wins); a row of
        // equal values; a maximum in the last element.
        rows.push(rng.vec(vocab, 3.0));
        let mut tie = rng.vec(vocab, 1.0);
        tie[2999] = 9.0;
        tie[1717] = 9.0;
        rows.push(tie);
        rows.push(vec![0.25; vocab]);
        let mut last = rng.vec(vocab, 1.0);
        last[vocab - 1] = 5.0;
        rows.push(last);
        let flat: Vec<f32> = rows.concat();
        let logits = g.upload(rows.len(), vocab, &flat).unwrap();
        let got = g.argmax_rows(&logits, 10).unwrap();
        let want: Vec<u32> = rows.iter().map(|r| argmax_with_margin(r).0 as u32).collect();
        assert_eq!(got, want, "{variant}");
        assert_eq!(want[1], 1717);
        assert_eq!(want[2], 0);

        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut row = rng.vec(vocab, 1.0);
            row[777] = bad;
            let logits = g.upload(1, vocab, &row).unwrap();
            let err = g.argmax_rows(&logits, 33).unwrap_err().to_string();
            assert!(err.contains("non-finite") && err.contains("position 33"), "{variant}: {err}");
        }
    });
}

#[test]
fn greedy_argmax_covers_a_real_sized_vocabulary() {
    each_variant("argmax, real vocabulary", |variant, opts| {
        let model = random_model(46, Fmt::F32, Fmt::F32);
        let mut g =
            GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, opts)
                .unwrap();
        let vocab = 201_088;
        let mut rng = Rng::new(47);
        for at in [0, 1023, 1024, 150_000, vocab - 1] {
            let mut row = rng.vec(vocab, 1.0);
            row[at] = 2.0;
            let logits = g.upload(1, vocab, &row).unwrap();
            assert_eq!(g.argmax_rows(&logits, 0).unwrap(), vec![at as u32], "{variant}");
        }
    });
}
