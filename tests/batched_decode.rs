//! Batched decode: a sequence's logits in a step that advances several sequences at once
//! equal, bit for bit, those of running it alone on the CPU (issue 17), on GPT-OSS (plain
//! and alternate shapes) and Qwen3-MoE fixtures, with greedy and seeded sampling; and the
//! same through slots (sessions on their own threads sharing one runner).

mod common;

use common::fixture;
use picchio::backend::SeqPos;
use picchio::engine::{self, LoadedModel, RunOptions, Runner};
use picchio::model::{LogitRows, NoObserver};
use picchio::sample::{Sampler, SamplingParams};
use picchio::session::Session;
use picchio::slots::Slots;
use proptest::prelude::*;

const CTX: usize = 96;

fn load(name: &str) -> LoadedModel {
    engine::load_hf(&fixture(name)).unwrap()
}

fn runner(model: &LoadedModel, block: usize) -> Box<dyn Runner> {
    engine::cpu_runner(model, &RunOptions { ctx: CTX, max_batch: block, ..Default::default() }).unwrap()
}

fn sampler(seed: Option<u64>) -> Sampler {
    match seed {
        None => Sampler::greedy(),
        Some(seed) => {
            Sampler::new(SamplingParams { temperature: 0.9, top_p: 0.95, seed, ..Default::default() })
                .unwrap()
        }
    }
}

/// Every logit row of a sequence run alone: the prompt's last row, then one row per
/// generated token (`steps` tokens picked by `sampler`), with the tokens.
fn solo(model: &LoadedModel, prompt: &[u32], steps: usize, seed: Option<u64>) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut r = runner(model, 4);
    let mut s = sampler(seed);
    let mut rows = vec![r.forward(prompt, 0, LogitRows::Last, &mut NoObserver).unwrap()];
    let mut history = prompt.to_vec();
    let mut tokens = Vec::new();
    for _ in 0..steps {
        let t = s.sample(rows.last().unwrap(), &history).unwrap();
        let logits = r.forward(&[t], history.len(), LogitRows::Last, &mut NoObserver).unwrap();
        history.push(t);
        tokens.push(t);
        rows.push(logits);
    }
    (rows, tokens)
}

/// The same sequences on one runner with a cache each, every decode position of all of
/// them in one batched step (a sequence that has finished its steps drops out).
fn batched(
    model: &LoadedModel,
    prompts: &[Vec<u32>],
    steps: &[usize],
    seeds: &[Option<u64>],
) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<u32>>) {
    let n = prompts.len();
    let mut r = runner(model, 4);
    for seq in 1..n {
        assert_eq!(r.add_sequence().unwrap(), seq);
    }
    let mut samplers: Vec<Sampler> = seeds.iter().map(|&s| sampler(s)).collect();
    let mut rows: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .enumerate()
        .map(|(seq, p)| vec![r.forward_on(seq, p, 0, LogitRows::Last, &mut NoObserver).unwrap()])
        .collect();
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    let mut tokens = vec![Vec::new(); n];
    let vocab = model.config.vocab_size;
    loop {
        let live: Vec<usize> = (0..n).filter(|&i| tokens[i].len() < steps[i]).collect();
        if live.is_empty() {
            break;
        }
        let mut at = Vec::new();
        let mut ids = Vec::new();
        for &i in &live {
            let t = samplers[i].sample(rows[i].last().unwrap(), &history[i]).unwrap();
            at.push(SeqPos { seq: i, pos: history[i].len() });
            ids.push(t);
            history[i].push(t);
            tokens[i].push(t);
        }
        let logits = r.step(&at, &ids).unwrap();
        assert_eq!(logits.len(), live.len() * vocab);
        for (&i, row) in live.iter().zip(logits.chunks_exact(vocab)) {
            rows[i].push(row.to_vec());
        }
    }
    (rows, tokens)
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect()
}

fn check(model: &LoadedModel, prompts: &[Vec<u32>], steps: &[usize], seeds: &[Option<u64>]) {
    let (rows, tokens) = batched(model, prompts, steps, seeds);
    for (i, prompt) in prompts.iter().enumerate() {
        let (alone, alone_tokens) = solo(model, prompt, steps[i], seeds[i]);
        assert_eq!(tokens[i], alone_tokens, "sequence {i}: tokens differ from a solo run");
        assert_eq!(bits(&rows[i]), bits(&alone), "sequence {i}: logits differ from a solo run");
    }
}

fn case(vocab: usize) -> impl Strategy<Value = (Vec<Vec<u32>>, Vec<usize>, Vec<Option<u64>>)> {
    (1usize..5).prop_flat_map(move |n| {
        (
            proptest::collection::vec(proptest::collection::vec(0..vocab as u32, 1..12), n),
            proptest::collection::vec(1usize..7, n),
            proptest::collection::vec(proptest::option::of(0u64..1000), n),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn batched_rows_equal_solo_runs_on_gpt_oss((prompts, steps, seeds) in case(200)) {
        check(&load("tiny-f32"), &prompts, &steps, &seeds);
    }

    #[test]
    fn batched_rows_equal_solo_runs_on_the_alternate_shape((prompts, steps, seeds) in case(200)) {
        check(&load("alt-f32"), &prompts, &steps, &seeds);
    }

    #[test]
    fn batched_rows_equal_solo_runs_on_qwen3((prompts, steps, seeds) in case(200)) {
        check(&load("qwen3-tiny-f32"), &prompts, &steps, &seeds);
    }
}

#[test]
fn a_step_refuses_a_sequence_twice_and_an_unknown_one() {
    let model = load("tiny-f32");
    let mut r = runner(&model, 4);
    r.add_sequence().unwrap();
    let twice = [SeqPos { seq: 1, pos: 0 }, SeqPos { seq: 1, pos: 1 }];
    let e = r.step(&twice, &[1, 2]).unwrap_err().to_string();
    assert!(e.contains("sequence 1 has two rows"), "{e}");
    let unknown = [SeqPos { seq: 0, pos: 0 }, SeqPos { seq: 5, pos: 0 }];
    let e = r.step(&unknown, &[1, 2]).unwrap_err().to_string();
    assert!(e.contains("sequence 5 does not exist"), "{e}");
    let full = [SeqPos { seq: 0, pos: 0 }, SeqPos { seq: 1, pos: CTX }];
    assert!(r.step(&full, &[1, 2]).is_err(), "a position past the capacity is refused");
}

/// Sessions on slots, each generating on its own thread at once, produce exactly the tokens
/// they produce alone, and their cached prefixes stay their own.
#[test]
fn slot_sessions_generate_what_solo_sessions_do() {
    for name in ["tiny-f32", "qwen3-tiny-f32"] {
        let model = load(name);
        let prompts: Vec<Vec<u32>> =
            vec![vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], vec![7], vec![30, 31, 32, 33, 34], vec![99, 98]];
        let seeds = [None, Some(3), Some(11), None];
        let solo: Vec<Vec<u32>> = prompts
            .iter()
            .zip(seeds)
            .map(|(p, seed)| {
                let mut s = Session::new(runner(&model, 4));
                s.generate(p, 12, &mut sampler(seed), &[], &mut |_| true).unwrap().tokens
            })
            .collect();
        let (slots, sessions) = Slots::start(runner(&model, 4), prompts.len(), Vec::new()).unwrap();
        assert_eq!(slots.count(), prompts.len());
        let results: Vec<(Vec<u32>, Session)> = std::thread::scope(|scope| {
            let handles: Vec<_> = sessions
                .into_iter()
                .zip(&prompts)
                .zip(seeds)
                .map(|((mut s, p), seed)| {
                    scope.spawn(move || {
                        let tokens =
                            s.generate(p, 12, &mut sampler(seed), &[], &mut |_| true).unwrap().tokens;
                        (tokens, s)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, ((tokens, _), alone)) in results.iter().zip(&solo).enumerate() {
            assert_eq!(tokens, alone, "{name}: slot {i}");
        }
        let steps = slots.counters().steps.load(std::sync::atomic::Ordering::SeqCst);
        let rows = slots.counters().step_rows.load(std::sync::atomic::Ordering::SeqCst);
        assert!(rows > steps, "{name}: some steps batched more than one row ({rows} rows in {steps} steps)");
        // Each slot continues from its own cache: a second turn that extends its history
        // reuses all of it and still matches a solo session doing the same two turns.
        let mut sessions: Vec<Session> = results.into_iter().map(|(_, s)| s).collect();
        let mut second = sessions.remove(2);
        let mut alone = Session::new(runner(&model, 4));
        let first = alone.generate(&prompts[2], 12, &mut sampler(Some(11)), &[], &mut |_| true).unwrap();
        assert_eq!(first.tokens, solo[2]);
        let more = [40u32, 41];
        let mut full = alone.tokens().to_vec();
        full.extend_from_slice(&more);
        let cached = alone.pos();
        assert_eq!(second.reuse_prefix(&full).unwrap(), cached, "{name}: slot 2 kept its whole history");
        assert_eq!(alone.reuse_prefix(&full).unwrap(), cached);
        let rest = &full[cached..];
        let a = second.generate(rest, 6, &mut Sampler::greedy(), &[], &mut |_| true).unwrap();
        let b = alone.generate(rest, 6, &mut Sampler::greedy(), &[], &mut |_| true).unwrap();
        assert_eq!(a.tokens, b.tokens, "{name}: second turn on slot 2");
        drop(second);
        drop(sessions);
        slots.join();
    }
}

/// A long prompt on one slot runs in blocks between the steps of another slot's decode.
#[test]
fn a_long_prompt_is_interleaved_with_running_decodes() {
    let model = load("tiny-f32");
    let (slots, mut sessions) = Slots::start(runner(&model, 4), 2, Vec::new()).unwrap();
    let mut b = sessions.pop().unwrap();
    let mut a = sessions.pop().unwrap();
    let long: Vec<u32> = (0..64).map(|i| (i * 7 % 200) as u32).collect();
    let expected_b = Session::new(runner(&model, 4))
        .generate(&long, 4, &mut Sampler::greedy(), &[], &mut |_| true)
        .unwrap()
        .tokens;
    let expected_a = Session::new(runner(&model, 4))
        .generate(&[5, 6], 40, &mut Sampler::greedy(), &[], &mut |_| true)
        .unwrap()
        .tokens;
    let (ta, tb) = std::thread::scope(|scope| {
        let ha = scope.spawn(|| a.generate(&[5, 6], 40, &mut Sampler::greedy(), &[], &mut |_| true).unwrap());
        let hb = scope.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            b.generate(&long, 4, &mut Sampler::greedy(), &[], &mut |_| true).unwrap()
        });
        (ha.join().unwrap(), hb.join().unwrap())
    });
    assert_eq!(ta.tokens, expected_a);
    assert_eq!(tb.tokens, expected_b);
    let blocks = slots.counters().prefill_blocks.load(std::sync::atomic::Ordering::SeqCst);
    assert!(blocks >= 64 / 4, "the 64-token prompt ran in blocks of 4 ({blocks} blocks)");
    drop((a, b));
    slots.join();
}

/// On a converted container (MXFP4 experts through the RAM cache), batched rows equal solo
/// runs too, and a step asks the expert source for each expert of its union once: fewer
/// requests than its rows' routes, never more than every expert of every layer.
#[test]
fn a_step_on_a_quantized_container_matches_solo_runs_and_reads_the_union_once() {
    let dir = common::convert_fixture("tiny-mxfp4", Default::default());
    let model =
        engine::load_container(dir.path(), &engine::OpenOptions { ctx: CTX, ..Default::default() }).unwrap();
    let prompts = vec![vec![3, 1, 4, 1, 5], vec![9, 2, 6], vec![5, 3, 5, 8, 9, 7, 9]];
    check(&model, &prompts, &[5, 5, 5], &[None, Some(7), Some(8)]);

    let cfg = &model.config;
    let mut r = runner(&model, 4);
    let mut at = Vec::new();
    for (seq, p) in prompts.iter().enumerate() {
        if seq > 0 {
            r.add_sequence().unwrap();
        }
        r.forward_on(seq, p, 0, LogitRows::Last, &mut NoObserver).unwrap();
        at.push(SeqPos { seq, pos: p.len() });
    }
    let before = r.expert_stats();
    r.step(&at, &[10, 11, 12]).unwrap();
    let s = r.expert_stats().since(&before);
    let requests = s.hits + s.misses;
    let routes = (prompts.len() * cfg.experts_per_token * cfg.num_layers) as u64;
    let all = (cfg.num_experts * cfg.num_layers) as u64;
    assert!(requests <= all && requests < routes, "{requests} expert requests for {routes} routes");
}
