//! Each WGSL kernel against the CPU oracle's op on random inputs, through the `Backend`
//! ops of `GpuBackend` and `CpuBackend` on the same random model. Sizes are deliberately
//! not multiples of the workgroup size (hidden 100, intermediate 72, vocab 3001, 70-row
//! batches), matrices are split into many row blocks and experts into many pools by a
//! lowered binding limit, and every test runs in the adapter's best shader build and in
//! the portable one.

mod common;

use common::gpu::{Fmt, Rng, gpu_options, random_model, rel_diff, variants};
use picchio::backend::cpu::{CpuAct, CpuBackend};
use picchio::backend::gpu::{GpuBackend, GpuOptions};
use picchio::backend::{Backend, LinearId, NormId, RouteTable};
use picchio::engine::LoadedModel;

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
    each_variant("matvec", Some(64 << 10), |variant, opts| {
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

#[test]
fn attention_matches_cpu_across_tiles_windows_and_batches() {
    each_variant("attention", None, |variant, opts| {
        let model = random_model(7, Fmt::F32, Fmt::F32);
        let cfg = model.config.clone();
        let (mut c, mut g) = (cpu(&model), gpu(&model, opts));
        let mut rng = Rng::new(8);
        // A 70-row prefill (crossing a 64-key tile), single decode rows, then a 3-row block,
        // on a sliding (window 5) and a full layer.
        let mut pos = 0;
        for rows in [70, 1, 1, 3] {
            for layer in [0, 1] {
                let q = rng.vec(rows * cfg.q_dim(), 1.0);
                let k = rng.vec(rows * cfg.kv_dim(), 1.0);
                let v = rng.vec(rows * cfg.kv_dim(), 1.0);
                let mut co = c.alloc(rows, cfg.q_dim()).unwrap();
                c.attention(
                    layer,
                    pos,
                    &host(rows, cfg.q_dim(), q.clone()),
                    &host(rows, cfg.kv_dim(), k.clone()),
                    &host(rows, cfg.kv_dim(), v.clone()),
                    &mut co,
                )
                .unwrap();
                let (gq, gk, gv) = (
                    g.upload(rows, cfg.q_dim(), &q).unwrap(),
                    g.upload(rows, cfg.kv_dim(), &k).unwrap(),
                    g.upload(rows, cfg.kv_dim(), &v).unwrap(),
                );
                let mut go = g.alloc(rows, cfg.q_dim()).unwrap();
                g.attention(layer, pos, &gq, &gk, &gv, &mut go).unwrap();
                let d = rel_diff(&g.read(&go).unwrap(), &co.data);
                assert!(d < 1e-5, "{variant} layer {layer}, {rows} rows at {pos}: relative difference {d}");
            }
            pos += rows;
        }
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
            let budgets = [
                (Some(total * slot * 4), None),
                (Some(total * slot / 2), None),
                (Some(1), None),
                (Some(total * slot * 4), Some(3 * slot)),
            ];
            let mut first: Vec<Option<Vec<f32>>> = vec![None; cases.len()];
            for (vram, binding) in budgets {
                let opts = GpuOptions { vram_bytes: vram, max_binding_bytes: binding, ..base.clone() };
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
