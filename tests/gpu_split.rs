//! CPU+GPU experts (`--expert-misses cpu`, the default when not every expert fits in VRAM):
//! the GPU computes the resident experts, the CPU the others from the RAM tier, and hot
//! experts are promoted into VRAM in the background.
//!
//! - Whatever the VRAM budget (all, half, the minimum), the RAM budget and the prediction,
//!   every prompt position's top-1 and 32 greedy tokens equal the CPU oracle's, for INT4
//!   and MXFP4 containers.
//! - With the experts split, no token waits on an upload (the upload policy, for contrast,
//!   does), the CPU computes some experts, and promotions happen.
//! - A second session starts with the learned hot set in VRAM.

mod common;

use common::gpu::gpu_options;
use common::{Reference, argmax, convert_fixture, fixture, greedy};
use picchio::backend::gpu::{GpuBackend, GpuOptions, GpuStats, MissPolicy};
use picchio::engine::{self, LoadedModel, OpenOptions, RunOptions, Runner};
use picchio::format::container::{DenseFormat, ExpertFormat, Formats};
use picchio::model::Forward;

const INT4: Formats = Formats { experts: ExpertFormat::Int4, dense: DenseFormat::Auto };
const MXFP4: Formats = Formats { experts: ExpertFormat::Mxfp4, dense: DenseFormat::F32 };
const CTX: usize = 128;

fn open(dir: &std::path::Path, ram_bytes: Option<u64>) -> LoadedModel {
    engine::load_container(dir, &OpenOptions { ctx: CTX, ram_bytes, ..Default::default() }).unwrap()
}

fn gpu_forward(model: &LoadedModel, opts: &GpuOptions) -> Forward<GpuBackend> {
    common::gpu::gpu_forward(model, opts, CTX)
}

/// The top-1 token at every prompt position, then a greedy continuation of `n` tokens.
fn top1_and_greedy(runner: &mut dyn Runner, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<u32>) {
    let vocab = runner.config().vocab_size;
    let (logits, tokens) = greedy(runner, prompt, n);
    (logits.chunks(vocab).map(|row| argmax(row) as u32).collect(), tokens)
}

fn cpu_oracle(model: &LoadedModel, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<u32>) {
    let ctx = CTX.min(model.config.max_position_embeddings);
    let mut cpu =
        engine::cpu_runner(model, &RunOptions { ctx, max_batch: 256, ..Default::default() }).unwrap();
    top1_and_greedy(cpu.as_mut(), prompt, n)
}

#[test]
fn top1_and_greedy_tokens_equal_the_cpu_oracle_wherever_the_experts_are() {
    let Some(base) = gpu_options("cpu+gpu experts parity") else { return };
    let r = Reference::load(&fixture("tiny-mxfp4"));
    for (formats, label) in [(INT4, "INT4"), (MXFP4, "MXFP4")] {
        let dir = convert_fixture("tiny-mxfp4", formats);
        let oracle = cpu_oracle(&open(dir.path(), None), &r.prompt, 32);
        let full = open(dir.path(), None);
        let cfg = full.config.clone();
        let expert = full.experts.expert_bytes();
        let all = expert * (cfg.num_layers * cfg.num_experts) as u64 * 2;
        // The RAM tier holding one layer's experts: most reads come from disk.
        let one_layer = Some(expert * cfg.num_experts as u64);
        let configs = [
            ("all resident", Some(all), None, None),
            ("half", Some(all / 4), None, None),
            ("half, RAM limited", Some(all / 4), one_layer, None),
            ("minimum", Some(1), None, None),
            ("minimum, RAM limited, prediction off", Some(1), one_layer, Some(false)),
            ("minimum, RAM limited, prediction on", Some(1), one_layer, Some(true)),
        ];
        for (what, vram, ram, predict) in configs {
            let model = if ram.is_some() { open(dir.path(), ram) } else { open(dir.path(), None) };
            let opts = GpuOptions { vram_bytes: vram, predict, ..base.clone() };
            let mut g = gpu_forward(&model, &opts);
            let (top1, tokens) = top1_and_greedy(&mut g, &r.prompt, 32);
            let s: GpuStats = g.backend().stats();
            eprintln!("{label} {what}: split {:?}; vram {:?}", s.split, s.vram);
            for (p, (got, want)) in top1.iter().zip(&oracle.0).enumerate() {
                assert_eq!(got, want, "{label} {what}: top-1 at prompt position {p}");
            }
            assert_eq!(tokens, oracle.1, "{label} {what}: greedy tokens");
            if s.full_residency {
                assert_eq!(s.split.layers, 0, "{label} {what}: {s:?}");
            } else {
                assert!(s.split.cpu_experts > 0 && s.split.cpu_pairs > 0, "{label} {what}: {s:?}");
                assert_eq!((s.split.upload_waits, s.vram.misses), (0, 0), "{label} {what}: {s:?}");
            }
        }
    }
}

#[test]
fn with_experts_split_no_token_waits_on_an_upload() {
    let Some(base) = gpu_options("cpu+gpu experts, no upload waits") else { return };
    let r = Reference::load(&fixture("tiny-mxfp4"));
    let dir = convert_fixture("tiny-mxfp4", MXFP4);
    let model = open(dir.path(), None);
    let cfg = model.config.clone();
    let all = model.experts.expert_bytes() * (cfg.num_layers * cfg.num_experts) as u64;
    let half = Some(all / 2);
    let run = |misses: MissPolicy| {
        let mut g = gpu_forward(&model, &GpuOptions { vram_bytes: half, misses, ..base.clone() });
        let out = top1_and_greedy(&mut g, &r.prompt, 24);
        (out, g.backend().stats())
    };
    let (cpu_out, s) = run(MissPolicy::Cpu);
    let d = s.decode_split;
    eprintln!("cpu: decode {d:?}; all {:?}; vram {:?}", s.split, s.vram);
    assert!(!s.full_residency);
    assert!(d.layers > 0 && d.cpu_experts > 0, "the CPU computed experts of decoded tokens: {d:?}");
    assert!(d.gpu_experts > 0, "the GPU computed resident experts of decoded tokens: {d:?}");
    assert_eq!(s.split.upload_waits, 0, "no layer waited on an upload: {s:?}");
    assert_eq!(s.vram.misses, 0, "nothing was uploaded on demand: {s:?}");
    assert!(s.vram.promotions > 0, "hot experts were promoted in the background: {s:?}");
    // Only activations crossed the bus for the split: each such layer's input rows and the
    // host-computed pairs' outputs, `hidden` floats each.
    let h = (cfg.hidden_size * 4) as u64;
    assert_eq!(d.bus_bytes, d.layers * h + d.cpu_pairs * h, "{d:?}");
    // The upload policy, for contrast, makes layers wait.
    let (upload_out, u) = run(MissPolicy::Upload);
    assert!(u.split.upload_waits > 0 && u.vram.misses > 0, "{u:?}");
    assert_eq!(u.split.cpu_experts, 0, "{u:?}");
    assert_eq!(cpu_out.1, upload_out.1, "the same greedy tokens either way");
}

#[test]
fn a_second_session_starts_with_the_learned_hot_set_in_vram() {
    let Some(base) = gpu_options("vram hot set") else { return };
    let r = Reference::load(&fixture("tiny-mxfp4"));
    let dir = convert_fixture("tiny-mxfp4", INT4);
    let opts = |model: &LoadedModel| {
        let cfg = &model.config;
        let quarter = model.experts.expert_bytes() * (cfg.num_layers * cfg.num_experts / 4) as u64;
        GpuOptions { vram_bytes: Some(quarter), ..base.clone() }
    };
    let first = {
        let model = open(dir.path(), None);
        let mut g = gpu_forward(&model, &opts(&model));
        let out = top1_and_greedy(&mut g, &r.prompt, 8);
        let s = g.backend().stats();
        assert_eq!(s.vram.hot_set, 0, "no history yet: {s:?}");
        out
        // Dropping the model saves the usage counts beside the container.
    };
    let model = open(dir.path(), None);
    let mut g = gpu_forward(&model, &opts(&model));
    let (slots, _, _, full) = g.backend().residency();
    let resident = g.backend().resident_experts();
    assert!(!full);
    let s = g.backend().stats();
    assert!(s.vram.hot_set > 0 && s.vram.hot_set as usize == resident, "{s:?}");
    assert!(resident <= slots);
    assert_eq!(top1_and_greedy(&mut g, &r.prompt, 8), first, "the hot set changes placement, not tokens");
}
