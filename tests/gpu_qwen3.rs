//! Qwen3-MoE on the GPU against the CPU oracle, on every Qwen3 fixture (fixtures/README.md):
//! the same top-1 token at every prompt position, the same experts at every MoE layer and
//! position, and the same greedy continuation, from the Hugging Face directory loaded in
//! memory and from the exact (`--experts f32 --dense f32`) and default (INT4 experts, INT8
//! embedding and head) containers. `qwen3-tiny-f32`
//! has a dense layer (2), renormalized top-3 and a 300-token prompt (two prefill blocks of
//! at most 256 positions); `qwen3-alt-f32` tied embeddings and top-2 not renormalized;
//! `qwen3-tiny-bf16` BF16 dense weights.

mod common;

use std::collections::BTreeMap;

use common::gpu::{check_pinned_backend, gpu_options};
use common::{argmax, convert_fixture, fixture, ints, max_abs_diff};
use picchio::backend::RouteTable;
use picchio::backend::gpu::context::SUBMIT_EVERY;
use picchio::backend::gpu::{GpuBackend, GpuOptions, MissPolicy};
use picchio::engine::{self, LoadedModel, OpenOptions, RunOptions, Runner};
use picchio::format::container::{DenseFormat, ExpertFormat, Formats};
use picchio::model::{Forward, Observer};
use safetensors::SafeTensors;

const EXACT: Formats = Formats { experts: ExpertFormat::F32, dense: DenseFormat::F32 };
/// `Formats::default()` (INT4 experts from a non-MXFP4 source, INT8 embedding and head).
const DEFAULT: Formats = Formats { experts: ExpertFormat::Auto, dense: DenseFormat::Auto };
const CTX: usize = 512;
const MAX_BATCH: usize = 256;

/// Where a case's weights come from.
#[derive(Clone, Copy, Debug)]
enum Source {
    /// The Hugging Face directory, every weight in memory (`engine::load_hf`).
    InMemory,
    /// A container converted with these formats.
    Container(Formats),
}

/// Every case: the fixture and its source (the dense-layer fixture from containers too).
const CASES: [(&str, Source); 8] = [
    ("qwen3-tiny-f32", Source::InMemory),
    ("qwen3-tiny-bf16", Source::InMemory),
    ("qwen3-alt-f32", Source::InMemory),
    ("qwen3-alt-f32", Source::Container(EXACT)),
    ("qwen3-alt-f32", Source::Container(DEFAULT)),
    ("qwen3-tiny-f32", Source::Container(EXACT)),
    ("qwen3-tiny-f32", Source::Container(DEFAULT)),
    ("qwen3-tiny-bf16", Source::Container(DEFAULT)),
];

/// Records the routing of every MoE layer, positions in order.
#[derive(Default)]
struct Routes(BTreeMap<usize, Vec<u32>>);

impl Observer for Routes {
    fn routes(&mut self, layer: usize, _start: usize, routes: &RouteTable) {
        self.0.entry(layer).or_default().extend_from_slice(&routes.experts);
    }
}

/// Prompt logits (every position), the experts of every MoE layer at every prompt
/// position, and a greedy continuation of `n` tokens.
fn run(runner: &mut dyn Runner, prompt: &[u32], n: usize) -> (Vec<f32>, Routes, Vec<u32>) {
    let mut routes = Routes::default();
    let (logits, tokens) = common::greedy_observed(runner, prompt, n, &mut routes);
    (logits, routes, tokens)
}

fn load(name: &str, source: Source) -> (LoadedModel, Option<tempfile::TempDir>) {
    match source {
        Source::InMemory => (engine::load_hf(&fixture(name)).unwrap(), None),
        Source::Container(formats) => {
            let dir = convert_fixture(name, formats);
            let model =
                engine::load_container(dir.path(), &OpenOptions { ctx: CTX, ..Default::default() }).unwrap();
            (model, Some(dir))
        }
    }
}

fn gpu_forward(model: &LoadedModel, opts: &GpuOptions) -> Forward<GpuBackend> {
    let b =
        GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CTX, opts).unwrap();
    check_pinned_backend(b.adapter());
    Forward::new(b, MAX_BATCH)
}

#[test]
fn gpu_equals_the_cpu_on_every_qwen3_fixture_and_source() {
    let Some(opts) = gpu_options("qwen3 fixture parity") else { return };
    for (name, source) in CASES {
        let st_bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&st_bytes).unwrap();
        let (prompt, greedy_len) = (ints(&st, "prompt_ids"), ints(&st, "greedy_ids").len());
        let (model, _dir) = load(name, source);
        let cfg = model.config.clone();
        let vocab = cfg.vocab_size;
        let mut cpu =
            engine::cpu_runner(&model, &RunOptions { ctx: CTX, max_batch: MAX_BATCH, ..Default::default() })
                .unwrap();
        let (cpu_logits, cpu_routes, cpu_tokens) = run(cpu.as_mut(), &prompt, greedy_len);
        let mut g = gpu_forward(&model, &opts);
        let (gpu_logits, gpu_routes, gpu_tokens) = run(&mut g, &prompt, greedy_len);
        let what = format!("{name} {source:?}");
        for pos in 0..prompt.len() {
            let (a, b) =
                (&gpu_logits[pos * vocab..(pos + 1) * vocab], &cpu_logits[pos * vocab..(pos + 1) * vocab]);
            assert_eq!(argmax(a), argmax(b), "{what}: top-1 at prompt position {pos}");
        }
        let moe_layers = cfg.mlp_kinds.iter().filter(|&&k| k == picchio::config::MlpKind::Moe).count();
        assert_eq!(cpu_routes.0.len(), moe_layers, "{what}: every MoE layer routed, no dense one");
        assert_eq!(
            gpu_routes.0.keys().collect::<Vec<_>>(),
            cpu_routes.0.keys().collect::<Vec<_>>(),
            "{what}"
        );
        for (layer, experts) in &cpu_routes.0 {
            assert_eq!(experts.len(), prompt.len() * cfg.experts_per_token, "{what}: layer {layer}");
            assert!(gpu_routes.0[layer] == *experts, "{what}: experts of layer {layer} differ");
        }
        assert_eq!(gpu_tokens, cpu_tokens, "{what}: greedy tokens");
        let d = max_abs_diff(&gpu_logits, &cpu_logits);
        eprintln!(
            "{what} on {}: top-1 and experts equal at all {} prompt positions, {} greedy tokens identical; max |logit difference| GPU vs CPU {d:.3e}",
            g.backend().adapter().summary(),
            prompt.len(),
            gpu_tokens.len()
        );
        assert!(d < 1e-3, "{what}: max logit difference {d}");
    }
}

/// The dense layer among the MoE ones in every residency: all experts resident (one
/// submission and one readback per decoded token), the prediction on (layer 1 predicts
/// nothing for the dense layer 2, layer 3 is not scored), and the minimum LRU cache with
/// and without the prediction. Placement never changes a number.
#[test]
fn the_dense_layer_runs_in_every_residency_with_identical_numbers() {
    let Some(base) = gpu_options("qwen3 residency") else { return };
    let model = engine::load_hf(&fixture("qwen3-tiny-f32")).unwrap();
    let cfg = model.config.clone();
    assert!(cfg.mlp_kinds.contains(&picchio::config::MlpKind::Dense), "the fixture has a dense layer");
    let st_bytes = std::fs::read(fixture("qwen3-tiny-f32").join("reference.safetensors")).unwrap();
    let prompt = ints(&SafeTensors::deserialize(&st_bytes).unwrap(), "prompt_ids")[..40].to_vec();
    let configs = [
        ("all resident", None, None),
        ("prediction on", None, Some(true)),
        ("minimum", Some(1), None),
        ("minimum, prediction off", Some(1), Some(false)),
    ];
    let mut first: Option<(Vec<f32>, Vec<u32>)> = None;
    for (what, vram, predict) in configs {
        // Every expert on the GPU, uploaded when missing: where an expert sits in VRAM
        // changes no bit (tests/gpu_split.rs covers experts computed on the CPU).
        let opts = GpuOptions { vram_bytes: vram, predict, misses: MissPolicy::Upload, ..base.clone() };
        let mut g = gpu_forward(&model, &opts);
        let (logits, _, tokens) = run(&mut g, &prompt, 8);
        let s = g.backend().stats();
        let (slots, _, _, full) = g.backend().residency();
        if full {
            assert_eq!(slots, 3 * cfg.num_experts, "{what}: slots for the three MoE layers only");
            // One wait per decoded token; its work in submissions of SUBMIT_EVERY dispatches
            // (a layer records at most 17).
            assert_eq!(s.decode_readbacks, s.decode_steps, "{what}");
            let per_token = 1 + (17 * cfg.num_layers as u64 + 8) / SUBMIT_EVERY as u64;
            assert!(s.decode_submissions <= s.decode_steps * per_token, "{what}: {s:?}");
        } else {
            assert_eq!(slots, cfg.experts_per_token, "{what}");
            assert!(s.route_readbacks > 0 && s.vram.misses > 0, "{what}: {s:?}");
        }
        if predict != Some(false) && (!full || predict == Some(true)) {
            assert!(s.predicted_total > 0, "{what}: no prediction was scored");
        }
        match &first {
            None => first = Some((logits, tokens)),
            Some(f) => {
                assert!(f.0 == logits, "{what}: logits differ from the all-resident run");
                assert_eq!(f.1, tokens, "{what}: tokens differ");
            }
        }
    }
}
