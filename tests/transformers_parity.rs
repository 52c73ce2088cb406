//! The CPU F32 path against Transformers on every fixture: prompt logits, router top-k of
//! every layer and position, per-layer residuals, and the 32-token greedy continuation.

mod common;

use common::{FIXTURES, Reference, fixture, max_abs_diff};
use picchio::backend::RouteTable;
use picchio::engine::{self, RunOptions};
use picchio::model::{LogitRows, NoObserver, Observer};
use picchio::sample::Sampler;
use picchio::session::Session;

/// Records residuals and routes of a forward pass.
#[derive(Default)]
struct Recorder {
    /// `residuals[layer]` for all positions seen, in order.
    residuals: Vec<Vec<f32>>,
    routes: Vec<RouteTable>,
}

impl Observer for Recorder {
    fn residual(&mut self, layer: usize, _start: usize, rows: &[f32]) {
        if self.residuals.len() <= layer {
            self.residuals.resize(layer + 1, Vec::new());
        }
        self.residuals[layer].extend_from_slice(rows);
    }
    fn routes(&mut self, layer: usize, _start: usize, routes: &RouteTable) {
        if self.routes.len() <= layer {
            self.routes.resize(layer + 1, RouteTable { k: routes.k, ..Default::default() });
        }
        self.routes[layer].experts.extend_from_slice(&routes.experts);
        self.routes[layer].weights.extend_from_slice(&routes.weights);
    }
}

fn session(name: &str, max_batch: usize) -> Session {
    let model = engine::load_hf(&fixture(name)).unwrap();
    let ctx = 128.min(model.config.max_position_embeddings);
    Session::new(engine::cpu_runner(&model, &RunOptions { ctx, max_batch, ..Default::default() }).unwrap())
}

fn check_prompt(name: &str) {
    let r = Reference::load(&fixture(name));
    let mut s = session(name, 256);
    let cfg = s.runner().config().clone();
    let mut rec = Recorder::default();
    let logits = s.feed(&r.prompt, LogitRows::All, &mut rec).unwrap();
    let t = r.prompt.len();
    let (h, k) = (cfg.hidden_size, cfg.experts_per_token);

    // Residual stream layer by layer: the first layer that drifts is where a bug lives.
    for layer in 0..=cfg.num_layers {
        let want = &r.hidden[layer * t * h..(layer + 1) * t * h];
        let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let d = max_abs_diff(&rec.residuals[layer], want);
        assert!(d <= 1e-5 * scale, "{name}: residual entering layer {layer} differs by {d} (scale {scale})");
    }
    for layer in 0..cfg.num_layers {
        let got = &rec.routes[layer];
        let want_idx = &r.router_idx[layer * t * k..(layer + 1) * t * k];
        let want_w = &r.router_weights[layer * t * k..(layer + 1) * t * k];
        for pos in 0..t {
            assert_eq!(
                got.row_experts(pos),
                &want_idx[pos * k..(pos + 1) * k],
                "{name}: layer {layer} position {pos}: router top-{k} differs"
            );
        }
        let d = max_abs_diff(&got.weights, want_w);
        assert!(d < 1e-5, "{name}: layer {layer}: routing weights differ by {d}");
    }
    let d = max_abs_diff(&logits, &r.logits);
    assert!(d < 1e-4, "{name}: prompt logits differ by {d} (max-abs), limit 1e-4");
    eprintln!("{name}: prompt logits max-abs diff {d:.2e}");
}

fn check_greedy(name: &str) {
    let r = Reference::load(&fixture(name));
    let mut s = session(name, 256);
    let out = s.generate(&r.prompt, r.greedy.len(), &mut Sampler::greedy(), &[], &mut |_| true).unwrap();
    if let Some(step) = out.tokens.iter().zip(&r.greedy).position(|(a, b)| a != b) {
        panic!(
            "{name}: greedy token {step} is {} but Transformers gives {} (reference margin {})",
            out.tokens[step], r.greedy[step], r.greedy_margins[step]
        );
    }
    assert_eq!(out.tokens, r.greedy);
}

#[test]
fn f32_prompt_matches_transformers() {
    check_prompt("tiny-f32");
}

#[test]
fn f32_greedy_matches_transformers() {
    check_greedy("tiny-f32");
}

#[test]
fn mxfp4_prompt_matches_transformers() {
    check_prompt("tiny-mxfp4");
}

#[test]
fn mxfp4_greedy_matches_transformers() {
    check_greedy("tiny-mxfp4");
}

#[test]
fn second_shape_matches_transformers() {
    for name in ["alt-f32", "alt-mxfp4"] {
        check_prompt(name);
        check_greedy(name);
    }
}

#[test]
fn yarn_table_matches_transformers() {
    for name in FIXTURES {
        let r = Reference::load(&fixture(name));
        let cfg = picchio::ModelConfig::from_dir(&fixture(name)).unwrap();
        let f = picchio::model::rope::RopeFrequencies::from_config(&cfg);
        assert_eq!(f.inv_freq.len(), r.inv_freq.len());
        for (i, (a, b)) in f.inv_freq.iter().zip(&r.inv_freq).enumerate() {
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * b.abs(), "{name}: inv_freq[{i}] {a} vs {b}");
        }
        assert_eq!(f.attention_factor, r.attention_factor, "{name}: attention factor");
    }
}

/// Token-by-token decode through the cache gives bit-identical logits to one batched
/// prefill of the same positions, and to batches split at odd boundaries.
#[test]
fn kv_cache_decode_equals_full_recompute() {
    for name in ["tiny-f32", "alt-mxfp4"] {
        let r = Reference::load(&fixture(name));
        let mut ids = r.prompt.clone();
        ids.extend_from_slice(&r.greedy);
        let full = session(name, 256).feed(&ids, LogitRows::All, &mut NoObserver).unwrap();

        let mut step = session(name, 256);
        let mut stepped = Vec::new();
        for &id in &ids {
            stepped.extend(step.feed(&[id], LogitRows::All, &mut NoObserver).unwrap());
        }
        assert!(full == stepped, "{name}: decode through the KV cache differs from full recompute");

        let mut blocks = session(name, 7);
        let mut blocked = blocks.feed(&ids[..30], LogitRows::All, &mut NoObserver).unwrap();
        blocked.extend(blocks.feed(&ids[30..], LogitRows::All, &mut NoObserver).unwrap());
        assert!(full == blocked, "{name}: blocked prefill differs from full recompute");
    }
}
