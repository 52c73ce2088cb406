//! The CPU F32 path against a fixture's Transformers references, in the seed's validation
//! order (section 0.3): the residual stream entering every layer, the router top-k and
//! weights of every MoE layer at every position, the prompt logits, then the greedy
//! continuation. Shared by every family's parity test.

use std::collections::BTreeMap;

use picchio::backend::RouteTable;
use picchio::engine::{self, RunOptions};
use picchio::model::{LogitRows, Observer};
use picchio::sample::Sampler;
use picchio::session::Session;

use super::{Reference, fixture, max_abs_diff};

/// Records residuals and routes of a forward pass, by layer.
#[derive(Default)]
pub struct Recorder {
    /// `residuals[layer]` for all positions seen, in order.
    pub residuals: Vec<Vec<f32>>,
    /// The routes of each MoE layer, all positions seen, in order.
    pub routes: BTreeMap<usize, RouteTable>,
}

impl Observer for Recorder {
    fn residual(&mut self, layer: usize, _start: usize, rows: &[f32]) {
        if self.residuals.len() <= layer {
            self.residuals.resize(layer + 1, Vec::new());
        }
        self.residuals[layer].extend_from_slice(rows);
    }
    fn routes(&mut self, layer: usize, _start: usize, routes: &RouteTable) {
        let t = self.routes.entry(layer).or_insert_with(|| RouteTable { k: routes.k, ..Default::default() });
        t.experts.extend_from_slice(&routes.experts);
        t.weights.extend_from_slice(&routes.weights);
    }
}

/// A CPU session on fixture `name` loaded from its Hugging Face directory, with room for
/// 512 positions (or the model's limit) and prefill blocks of `max_batch`.
pub fn session(name: &str, max_batch: usize) -> Session {
    let model = engine::load_hf(&fixture(name)).unwrap();
    let ctx = 512.min(model.config.max_position_embeddings);
    Session::new(engine::cpu_runner(&model, &RunOptions { ctx, max_batch, ..Default::default() }).unwrap())
}

/// The prompt of fixture `name` in one batch: every layer's residual within 1e-5 of its
/// scale, the same router top-k at every MoE layer and position (weights within 1e-5), and
/// the prompt logits within 1e-4.
pub fn check_prompt(name: &str) {
    let r = Reference::load(&fixture(name));
    let mut s = session(name, 256);
    let cfg = s.runner().config().clone();
    let mut rec = Recorder::default();
    let logits = s.feed(&r.prompt, LogitRows::All, &mut rec).unwrap();
    let t = r.prompt.len();
    let (h, k) = (cfg.hidden_size, cfg.experts_per_token);

    // The first layer that drifts is where a bug lives.
    for layer in 0..=cfg.num_layers {
        let want = &r.hidden[layer * t * h..(layer + 1) * t * h];
        let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let d = max_abs_diff(&rec.residuals[layer], want);
        assert!(d <= 1e-5 * scale, "{name}: residual entering layer {layer} differs by {d} (scale {scale})");
    }
    let moe_layers = r.moe_layers.clone().unwrap_or_else(|| (0..cfg.num_layers as u32).collect());
    let observed: Vec<u32> = rec.routes.keys().map(|&l| l as u32).collect();
    assert_eq!(observed, moe_layers, "{name}: the MoE layers (the others are dense MLPs)");
    for (m, &layer) in moe_layers.iter().enumerate() {
        let got = &rec.routes[&(layer as usize)];
        let want_idx = &r.router_idx[m * t * k..(m + 1) * t * k];
        let want_w = &r.router_weights[m * t * k..(m + 1) * t * k];
        for pos in 0..t {
            assert_eq!(
                got.row_experts(pos),
                &want_idx[pos * k..(pos + 1) * k],
                "{name}: layer {layer} position {pos}: router top-{k} differs"
            );
        }
        let d = max_abs_diff(&got.weights, want_w);
        eprintln!("{name}: layer {layer}: routing weights max diff {d:e}");
        assert!(d < 1e-5, "{name}: layer {layer}: routing weights differ by {d}");
    }
    let d = max_abs_diff(&logits, &r.logits);
    assert!(d < 1e-4, "{name}: prompt logits differ by {d} (max-abs), limit 1e-4");
    eprintln!("{name}: prompt logits max-abs diff {d:.2e}");
}

/// The greedy continuation of fixture `name` equals Transformers', token for token; the
/// first difference is reported with the reference's margin at that step.
pub fn check_greedy(name: &str) {
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
