//! The expert I/O levers change speed only: outputs are bit-identical across RAM cache
//! sizes, eviction policies, reader threads, direct I/O, prediction, completion-driven
//! compute, prefill block sizes, and the cache's memory prepared after load or taken on use;
//! a prefill block reads each expert of its union at most once; the frequency policy keeps
//! popular experts through a scan; and prediction (early, late or off) is issued in single
//! and batched decode steps, for layer 0 from the embedding too, without changing a bit.

mod common;

use std::path::Path;

use common::{Reference, convert_fixture, fixture};
use picchio::backend::{Predict, SeqPos};
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::experts::{CachePolicy, ExpertStats};
use picchio::format::container::{Container, Formats};
use picchio::model::{LogitRows, NoObserver};
use picchio::sample::Sampler;
use picchio::session::Session;
use picchio::synth::{SynthShape, SynthSpec};

#[derive(Clone, Debug)]
struct Setup {
    ram_experts: usize,
    policy: CachePolicy,
    io_threads: usize,
    piece: usize,
    direct: bool,
    predict: Predict,
    completion_driven: bool,
    block: usize,
    prepare_memory: bool,
}

fn expert_bytes(dir: &Path) -> u64 {
    Container::open(dir).unwrap().experts().record_bytes()
}

/// Prompt logits and 16 greedy tokens under `s`.
fn run(dir: &Path, prompt: &[u32], s: &Setup) -> (Vec<f32>, Vec<u32>) {
    let ctx = (prompt.len() + 17).max(128);
    let opts = OpenOptions {
        ram_bytes: Some(s.ram_experts as u64 * expert_bytes(dir)),
        cache_policy: s.policy,
        io_threads: s.io_threads,
        read_piece_bytes: s.piece,
        direct_io: Some(s.direct),
        hot_set: false,
        prepare_memory: s.prepare_memory,
        ctx,
        ..Default::default()
    };
    let model = engine::load_container(dir, &opts).unwrap();
    let run_opts = RunOptions {
        ctx,
        max_batch: s.block,
        predict: s.predict,
        completion_driven: s.completion_driven,
        ..Default::default()
    };
    let mut a = Session::new(engine::cpu_runner(&model, &run_opts).unwrap());
    let logits = a.feed(prompt, LogitRows::All, &mut NoObserver).unwrap();
    let mut b = Session::new(engine::cpu_runner(&model, &run_opts).unwrap());
    let tokens = b.generate(prompt, 16, &mut Sampler::greedy(), &[], &mut |_| true).unwrap().tokens;
    (logits, tokens)
}

/// A small `picchio synth` model (more experts and layers than the fixtures, MXFP4 experts
/// and BF16 dense weights as released), converted with the default formats.
fn small_synthetic() -> tempfile::TempDir {
    let spec = SynthSpec {
        layers: 6,
        experts: 16,
        hidden: 128,
        intermediate: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        vocab: 2048,
        window: 16,
        seed: 7,
        ..SynthSpec::of(SynthShape::Tiny)
    };
    common::synth_container(&spec)
}

#[test]
fn every_lever_gives_bit_identical_output() {
    let mut models: Vec<(String, tempfile::TempDir, Vec<u32>)> = ["tiny-mxfp4", "alt-f32", "qwen3-tiny-f32"]
        .into_iter()
        .map(|name| {
            let prompt = Reference::load(&fixture(name)).prompt;
            (name.to_string(), convert_fixture(name, Formats::default()), prompt)
        })
        .collect();
    // A prompt that crosses the synthetic model's window twice, ID 0 included.
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 389 + 11 * (i % 3)) % 2048).collect();
    models.push(("synthetic 6x16".to_string(), small_synthetic(), prompt));
    for (name, dir, prompt) in &models {
        let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
        let all = cfg.num_layers * cfg.num_experts;
        let base = Setup {
            ram_experts: all,
            policy: CachePolicy::Frequency,
            io_threads: 4,
            piece: picchio::experts::store::HASHED_READ_CHUNK,
            direct: false,
            predict: Predict::Early,
            completion_driven: true,
            block: 256,
            prepare_memory: true,
        };
        let reference = run(dir.path(), prompt, &base);
        let variants = [
            Setup { ram_experts: cfg.num_layers, ..base.clone() },
            Setup { ram_experts: all / 2, ..base.clone() },
            Setup { ram_experts: 1, ..base.clone() },
            Setup { policy: CachePolicy::Lru, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { policy: CachePolicy::Lru, ram_experts: all / 2, ..base.clone() },
            Setup { policy: CachePolicy::Lru, ram_experts: 1, ..base.clone() },
            Setup { io_threads: 1, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { io_threads: 8, ram_experts: cfg.num_layers, ..base.clone() },
            // Records split into pieces across the readers, whole or with a short last piece.
            Setup { piece: 4096, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { piece: 12288, io_threads: 3, direct: true, ram_experts: 2, ..base.clone() },
            Setup {
                piece: 4096,
                io_threads: 1,
                predict: Predict::Late,
                ram_experts: all / 3,
                ..base.clone()
            },
            // Late prediction, near-end prediction in decode and wrong guesses stopped
            // part-read (records of several pieces, two readers).
            Setup {
                piece: 4096,
                io_threads: 2,
                predict: Predict::Late,
                ram_experts: 2 * cfg.num_layers,
                block: 1,
                ..base.clone()
            },
            Setup { direct: true, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { predict: Predict::Off, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { predict: Predict::Late, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { predict: Predict::Late, ram_experts: all / 2, ..base.clone() },
            Setup { predict: Predict::Late, ram_experts: 1, block: 1, ..base.clone() },
            Setup { predict: Predict::Off, ram_experts: 1, block: 1, ..base.clone() },
            Setup { predict: Predict::Early, ram_experts: 3, block: 1, ..base.clone() },
            Setup { predict: Predict::Early, completion_driven: false, ram_experts: 3, ..base.clone() },
            Setup { completion_driven: false, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { block: 1, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { block: 7, ram_experts: 3, ..base.clone() },
            Setup { block: 16, io_threads: 8, direct: true, ram_experts: all / 3, ..base.clone() },
            // Buffers made as reads need them instead of prepared after load.
            Setup { prepare_memory: false, ram_experts: cfg.num_layers, ..base.clone() },
            Setup { prepare_memory: false, ram_experts: 1, block: 1, ..base.clone() },
            Setup { prepare_memory: false, direct: true, ram_experts: all / 2, ..base.clone() },
        ];
        for v in &variants {
            let got = run(dir.path(), prompt, v);
            assert!(got.0 == reference.0, "{name}: prompt logits differ under {v:?}");
            assert_eq!(got.1, reference.1, "{name}: tokens differ under {v:?}");
        }
    }
}

#[test]
fn a_prefill_block_reads_each_expert_at_most_once() {
    let name = "tiny-mxfp4";
    let r = Reference::load(&fixture(name));
    let dir = convert_fixture(name, Formats::default());
    let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
    // A cache of 6 experts (of 32): each layer's union (8 experts) must be read in groups.
    let opts = OpenOptions {
        ram_bytes: Some(6 * expert_bytes(dir.path())),
        io_threads: 4,
        hot_set: false,
        ctx: 128,
        ..Default::default()
    };
    let model = engine::load_container(dir.path(), &opts).unwrap();
    let run_opts = RunOptions { ctx: 128, max_batch: 40, ..Default::default() };
    let mut s = Session::new(engine::cpu_runner(&model, &run_opts).unwrap());
    let mut routes = common_routes::Unions::default();
    s.feed(&r.prompt, LogitRows::Last, &mut routes).unwrap();
    let stats = model.experts.stats();
    let union_total: usize = routes.0.iter().map(|u| u.len()).sum();
    assert_eq!(routes.0.len(), cfg.num_layers);
    assert!(stats.reads as usize <= union_total, "{} reads for unions totalling {union_total}", stats.reads);
    assert_eq!(stats.reads as usize, union_total, "a cold cache must read each union member exactly once");
    eprintln!("prefill block of {}: {} reads for {} union members", r.prompt.len(), stats.reads, union_total);

    // Token by token the same prompt reads far more (the point of the union).
    let model = engine::load_container(dir.path(), &opts).unwrap();
    let run_opts = RunOptions { ctx: 128, max_batch: 1, predict: Predict::Off, ..Default::default() };
    let mut s = Session::new(engine::cpu_runner(&model, &run_opts).unwrap());
    s.feed(&r.prompt, LogitRows::Last, &mut NoObserver).unwrap();
    let token_by_token = model.experts.stats().reads;
    assert!(token_by_token > 2 * stats.reads, "token by token {token_by_token} vs block {}", stats.reads);
}

#[test]
fn prediction_is_scored_and_the_hot_set_is_learned() {
    let name = "tiny-mxfp4";
    let r = Reference::load(&fixture(name));
    let dir = convert_fixture(name, Formats::default());
    let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
    let opts = OpenOptions {
        ram_bytes: Some(cfg.num_layers as u64 * 6 * expert_bytes(dir.path())),
        io_threads: 4,
        hot_set: true,
        ctx: 128,
        ..Default::default()
    };
    {
        let model = engine::load_container(dir.path(), &opts).unwrap();
        let mut s =
            Session::new(engine::cpu_runner(&model, &RunOptions { ctx: 128, ..Default::default() }).unwrap());
        s.generate(&r.prompt, 16, &mut Sampler::greedy(), &[], &mut |_| true).unwrap();
        let st = model.experts.stats();
        let acc = st.prediction_accuracy().expect("decode made predictions");
        eprintln!(
            "prediction accuracy {:.1}%: {} prefetch reads, {} useful, {} wasted, {} skipped",
            100.0 * acc,
            st.prefetch_reads,
            st.prefetch_useful,
            st.prefetch_wasted,
            st.prefetch_skipped
        );
        assert!(st.prefetch_reads > 0);
        assert!(acc > 0.0 && acc <= 1.0);
        assert!(st.prefetch_useful + st.prefetch_wasted <= st.prefetch_reads);
    }
    // The counts were saved; the next session preloads and protects the hottest experts.
    let usage = dir.path().join(picchio::engine::USAGE_FILE);
    assert!(usage.exists(), "usage counts were not saved");
    let model = engine::load_container(dir.path(), &opts).unwrap();
    let hot = model.experts.stats().hot_set;
    assert_eq!(hot, (cfg.num_layers * 6 / 2) as u64, "half the cache is given to the hot set");
    let mut s =
        Session::new(engine::cpu_runner(&model, &RunOptions { ctx: 128, ..Default::default() }).unwrap());
    s.feed(&r.prompt, LogitRows::Last, &mut NoObserver).unwrap();
    assert!(model.experts.stats().hits > 0);
}

mod common_routes {
    use std::collections::HashSet;

    use picchio::backend::RouteTable;
    use picchio::model::Observer;

    /// The union of experts each layer routed to.
    #[derive(Default)]
    pub struct Unions(pub Vec<HashSet<u32>>);

    impl Observer for Unions {
        fn routes(&mut self, layer: usize, _start: usize, r: &RouteTable) {
            if self.0.len() <= layer {
                self.0.resize(layer + 1, HashSet::new());
            }
            self.0[layer].extend(r.experts.iter().copied());
        }
    }
}

/// Experts of `layer` requested in groups of `group` (as a forward pass asks for them), then
/// released.
fn request(model: &engine::LoadedModel, layer: usize, ids: &[usize], group: usize) {
    for chunk in ids.chunks(group) {
        model.experts.experts(layer, chunk).unwrap();
    }
}

#[test]
fn the_frequency_policy_keeps_popular_experts_through_a_scan() {
    let dir = small_synthetic();
    let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
    let popular: Vec<usize> = (0..8).collect();
    let every: Vec<usize> = (0..cfg.num_experts).collect();
    let mut hits_after_scan = Vec::new();
    for policy in [CachePolicy::Frequency, CachePolicy::Lru] {
        let opts = OpenOptions {
            ram_bytes: Some(16 * expert_bytes(dir.path())),
            cache_policy: policy,
            hot_set: false,
            ctx: 128,
            ..Default::default()
        };
        let model = engine::load_container(dir.path(), &opts).unwrap();
        // Eight experts of layer 0 asked for five times each ...
        for _ in 0..5 {
            request(&model, 0, &popular, 4);
        }
        // ... then a sweep over every expert of the other layers, five times the cache, each
        // asked for once (a prefill's union, or a batch of streams) ...
        for layer in 1..cfg.num_layers {
            request(&model, layer, &every, 4);
        }
        // ... then the popular ones again.
        let before = model.experts.stats();
        request(&model, 0, &popular, 4);
        let after = model.experts.stats().since(&before);
        assert_eq!(after.hits + after.misses, popular.len() as u64);
        hits_after_scan.push((policy, after.hits));
    }
    eprintln!("hits on the popular experts after the sweep: {hits_after_scan:?}");
    assert_eq!(
        hits_after_scan,
        vec![(CachePolicy::Frequency, 8), (CachePolicy::Lru, 0)],
        "the frequency policy keeps all eight through the sweep; LRU keeps none"
    );
}

/// `steps` greedy tokens from `prompt` under `predict`, with a cache of 6 experts and the
/// request trace on: the trace's text and the cache's counters.
fn traced_generate(dir: &Path, prompt: &[u32], predict: Predict, steps: usize) -> (String, ExpertStats) {
    let trace = dir.join(format!("requests-{predict:?}.txt"));
    let opts = OpenOptions {
        ram_bytes: Some(6 * expert_bytes(dir)),
        hot_set: false,
        ctx: 128,
        expert_trace: Some(trace.clone()),
        ..Default::default()
    };
    let stats = {
        let model = engine::load_container(dir, &opts).unwrap();
        let run_opts = RunOptions { ctx: 128, predict, ..Default::default() };
        let mut s = Session::new(engine::cpu_runner(&model, &run_opts).unwrap());
        s.generate(prompt, steps, &mut Sampler::greedy(), &[], &mut |_| true).unwrap();
        model.experts.stats()
    };
    (std::fs::read_to_string(&trace).unwrap(), stats)
}

#[test]
fn the_request_trace_records_every_request() {
    let name = "tiny-mxfp4";
    let r = Reference::load(&fixture(name));
    let dir = convert_fixture(name, Formats::default());
    let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
    let (text, stats) = traced_generate(dir.path(), &r.prompt, Predict::default(), 4);
    let mut demanded = 0u64;
    let mut predictions = 0u64;
    for line in text.lines() {
        let parts: Vec<&str> = line.split(' ').collect();
        assert_eq!(parts.len(), 3, "line {line:?}");
        let layer: usize = parts[1].parse().unwrap();
        assert!(layer < cfg.num_layers, "line {line:?}");
        let ids: Vec<usize> = parts[2].split(',').map(|e| e.parse().unwrap()).collect();
        assert!(ids.iter().all(|&e| e < cfg.num_experts), "line {line:?}");
        match parts[0] {
            "D" => demanded += ids.len() as u64,
            "P" => predictions += 1,
            "A" => {}
            other => panic!("unknown record {other:?} in {line:?}"),
        }
    }
    assert_eq!(demanded, stats.hits + stats.misses, "every request is recorded once");
    assert!(predictions > 0, "decode predictions are recorded");
}

#[test]
fn every_forward_pass_predicts_layer_zero_from_the_embedding_first() {
    let name = "tiny-mxfp4";
    let r = Reference::load(&fixture(name));
    let dir = convert_fixture(name, Formats::default());
    let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
    assert!(cfg.num_layers > 1, "the passes are told apart by layer 0 following the last layer");
    let steps = 4;
    for predict in [Predict::Early, Predict::Late] {
        let (text, _) = traced_generate(dir.path(), &r.prompt, predict, steps);
        // A forward pass starts where layer 0 is demanded after another layer (or first):
        // layer 0's prediction must come before it, since the pass began.
        let (mut passes, mut predicted_zero, mut last_demanded) = (0, false, None);
        for line in text.lines() {
            let parts: Vec<&str> = line.split(' ').collect();
            let layer: usize = parts[1].parse().unwrap();
            match (parts[0], layer) {
                ("P", 0) => predicted_zero = true,
                ("D", 0) if last_demanded != Some(0) => {
                    assert!(
                        predicted_zero,
                        "{predict:?}: pass {passes} demands layer 0 unpredicted:\n{text}"
                    );
                    predicted_zero = false;
                    passes += 1;
                }
                _ => {}
            }
            if parts[0] == "D" {
                last_demanded = Some(layer);
            }
        }
        // The prompt, then every generated token but the last is fed back.
        assert!(passes >= steps, "{predict:?}: {passes} forward passes for {steps} tokens:\n{text}");
    }
}

/// What a run of several sequences decoding together gave: every logit row of the batched
/// steps (bits), and the expert counters of those steps alone, and of a single-sequence
/// decode before them.
struct BatchedRun {
    step_logits: Vec<u32>,
    solo_decode: picchio::experts::ExpertStats,
    steps: picchio::experts::ExpertStats,
}

/// The container at `dir` with a cache of `ram_experts` experts, no hot set, 128 positions.
fn open_with_cache(dir: &Path, ram_experts: usize) -> engine::LoadedModel {
    let opts = OpenOptions {
        ram_bytes: Some(ram_experts as u64 * expert_bytes(dir)),
        hot_set: false,
        ctx: 128,
        ..Default::default()
    };
    engine::load_container(dir, &opts).unwrap()
}

/// Four prompts on one runner under `predict` with a cache of `ram_experts`: sequence 0 decodes
/// two tokens alone, then six batched steps advance all four sequences (one drops out after
/// three, so steps of four and three rows).
fn batched_run(dir: &Path, predict: Predict, ram_experts: usize) -> BatchedRun {
    let model = open_with_cache(dir, ram_experts);
    let vocab = model.config.vocab_size;
    let run_opts = RunOptions { ctx: 128, max_batch: 8, predict, ..Default::default() };
    let mut r = engine::cpu_runner(&model, &run_opts).unwrap();
    let prompts: Vec<Vec<u32>> =
        (0..4u32).map(|s| (0..5 + 3 * s).map(|i| (i * 37 + s * 101 + 3) % vocab as u32).collect()).collect();
    let mut last = Vec::new();
    for (seq, p) in prompts.iter().enumerate() {
        if seq > 0 {
            assert_eq!(r.add_sequence().unwrap(), seq);
        }
        last.push(r.forward_on(seq, p, 0, LogitRows::Last, &mut NoObserver).unwrap());
    }
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let next = |logits: &[f32]| common::argmax(logits) as u32;
    let before_solo = model.experts.stats();
    for _ in 0..2 {
        let t = next(&last[0]);
        last[0] = r.forward_on(0, &[t], pos[0], LogitRows::Last, &mut NoObserver).unwrap();
        pos[0] += 1;
    }
    let before_steps = model.experts.stats();
    let mut step_logits = Vec::new();
    for step in 0..6 {
        let live: Vec<usize> = (0..4).filter(|&s| s != 3 || step < 3).collect();
        let at: Vec<SeqPos> = live.iter().map(|&s| SeqPos { seq: s, pos: pos[s] }).collect();
        let ids: Vec<u32> = live.iter().map(|&s| next(&last[s])).collect();
        let logits = r.step(&at, &ids).unwrap();
        for (&s, row) in live.iter().zip(logits.chunks_exact(vocab)) {
            last[s] = row.to_vec();
            pos[s] += 1;
        }
        step_logits.extend(logits.iter().map(|v| v.to_bits()));
    }
    BatchedRun {
        step_logits,
        solo_decode: before_steps.since(&before_solo),
        steps: model.experts.stats().since(&before_steps),
    }
}

#[test]
fn prediction_is_issued_in_single_and_batched_decode_and_changes_no_bit() {
    let gpt_oss = convert_fixture("tiny-mxfp4", Formats::default());
    let qwen3 = convert_fixture("qwen3-tiny-f32", Formats::default());
    for (name, dir) in [("tiny-mxfp4", &gpt_oss), ("qwen3-tiny-f32", &qwen3)] {
        let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
        // Room for a few layers' worth of experts, not all: predictions find room and misses.
        let ram = 3 * cfg.experts_per_token + 2;
        let off = batched_run(dir.path(), Predict::Off, ram);
        assert_eq!(off.solo_decode.predicted, 0, "{name}: off predicts nothing");
        assert_eq!(
            off.steps.predicted + off.steps.prefetch_reads + off.solo_decode.prefetch_reads,
            0,
            "{name}"
        );
        for predict in [Predict::Early, Predict::Late] {
            let on = batched_run(dir.path(), predict, ram);
            assert!(on.step_logits == off.step_logits, "{name}: batched logits differ with {predict:?}");
            for (what, st) in [("single-sequence decode", &on.solo_decode), ("batched steps", &on.steps)] {
                eprintln!(
                    "{name} {predict:?} {what}: {}/{} routed experts predicted, {} prefetch reads",
                    st.predicted_right, st.predicted, st.prefetch_reads
                );
                assert!(st.predicted > 0, "{name}: {predict:?} made no prediction in {what}");
                assert!(st.predicted_right <= st.predicted, "{name}");
            }
            let reads = on.solo_decode.prefetch_reads + on.steps.prefetch_reads;
            assert!(reads > 0, "{name}: {predict:?} issued no prefetch read");
        }
    }
}

/// Prompt logits of one prefill block and the cache's counters over it, under `predict`.
fn prefill_run(dir: &Path, prompt: &[u32], predict: Predict, ram_experts: usize) -> (Vec<u32>, ExpertStats) {
    let model = open_with_cache(dir, ram_experts);
    let run_opts = RunOptions { ctx: 128, max_batch: 256, predict, ..Default::default() };
    let mut s = Session::new(engine::cpu_runner(&model, &run_opts).unwrap());
    let logits = s.feed(prompt, LogitRows::All, &mut NoObserver).unwrap();
    (logits.iter().map(|v| v.to_bits()).collect(), model.experts.stats())
}

#[test]
fn prompt_blocks_predict_each_layers_first_group_and_change_no_bit() {
    let dir = small_synthetic();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 389 + 7) % 2048).collect();
    // 10 of the 96 experts: each layer's union is read in groups of 5.
    let (off_logits, off) = prefill_run(dir.path(), &prompt, Predict::Off, 10);
    assert_eq!(off.predicted + off.prefetch_reads, 0, "off predicts nothing");
    for predict in [Predict::Early, Predict::Late] {
        let (logits, st) = prefill_run(dir.path(), &prompt, predict, 10);
        assert!(logits == off_logits, "prompt logits differ with {predict:?}");
        eprintln!(
            "{predict:?}: {}/{} experts of first groups predicted, {} prefetch reads, {} useful",
            st.predicted_right, st.predicted, st.prefetch_reads, st.prefetch_useful
        );
        // Every layer is predicted (layer 0 from the embedding), each prediction scored
        // against the first group the layer asks for (5 experts).
        let layers = picchio::ModelConfig::from_dir(dir.path()).unwrap().num_layers as u64;
        assert_eq!(st.predicted, layers * 5, "{predict:?}: every layer's first group is scored");
        assert!(st.predicted_right > 0 && st.prefetch_reads > 0, "{predict:?}: predictions were read");
        assert!(st.prefetch_reads <= layers * 5, "{predict:?}: a prediction never exceeds one group");
    }
}

#[test]
fn a_preload_is_not_a_use_of_the_learned_hot_set() {
    let name = "tiny-mxfp4";
    let dir = convert_fixture(name, Formats::default());
    let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
    let opts = OpenOptions { hot_set: true, ctx: 128, ..Default::default() };
    {
        let model = engine::load_container(dir.path(), &opts).unwrap();
        let all: Vec<usize> = (0..cfg.num_experts).collect();
        for l in 0..cfg.num_layers {
            assert_eq!(model.experts.preload(l, &all).unwrap().len(), all.len());
        }
        assert!(model.experts.hot_experts(usize::MAX).is_empty(), "a preload counted as a use");
        // One real use is counted.
        model.experts.expert(1, 2).unwrap();
        assert_eq!(model.experts.hot_experts(usize::MAX), vec![(1, 2)]);
    }
    // The next session learned only the real use.
    let model = engine::load_container(dir.path(), &opts).unwrap();
    assert_eq!(model.experts.hot_experts(usize::MAX), vec![(1, 2)]);
}
