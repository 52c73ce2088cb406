//! Parallel sequences on the GPU (issue 17): a batched decode step over several sequences,
//! each with its own key/value cache in VRAM, gives every row the CPU's top-1 (the CPU's
//! batched step equals its solo run bit for bit, tests/batched_decode.rs) and the very
//! logits of running that sequence alone on the GPU; a cache beyond the VRAM left for key/value
//! caches is refused with the sizes; and a GPU server with two slots serves two clients
//! at once, each getting what it gets alone.
//!
//! Tolerance between GPU batched rows and GPU solo runs: none (bit-identical). Every
//! kernel computes a row from that row's inputs in a fixed order (the matrix-vector
//! kernels reduce each token's dot product alone; RoPE, the key/value store and attention
//! run per row on that row's cache, as a solo decode step does), so nothing a neighbour
//! row holds can reach a row's numbers.

mod common;

use common::f16kv::F16KvCpu;
use common::fixture;
use common::gpu::{check_pinned_backend, gpu_options};
use common::http::{get_text, listener, metric, post};
use picchio::backend::cpu::CpuBackend;
use picchio::backend::gpu::context::SUBMIT_EVERY;
use picchio::backend::gpu::{GpuBackend, GpuOptions, KvPrecision, MissPolicy, TILED_MIN_TOKENS};
use picchio::backend::{Backend, SeqPos};
use picchio::engine::{self, Device, LoadedModel, OpenOptions, RunOptions, Runner};
use picchio::error::Error;
use picchio::fallback::FallbackRunner;
use picchio::format::container::{DenseFormat, ExpertFormat, Formats};
use picchio::model::{Forward, LogitRows, NoObserver};
use picchio::serve::http::{HttpOptions, serve};
use picchio::session::Session;
use serde_json::json;

const CTX: usize = 96;
const MXFP4: Formats = Formats { experts: ExpertFormat::Mxfp4, dense: DenseFormat::F32 };
/// Decode steps after each prompt.
const STEPS: usize = 10;

fn gpu_backend(model: &LoadedModel, opts: &GpuOptions) -> GpuBackend {
    let b =
        GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CTX, opts).unwrap();
    check_pinned_backend(b.adapter());
    b
}

/// Deterministic prompts of different lengths (1 to 23 tokens) over the vocabulary.
fn prompts(n: usize, seed: u64, vocab: usize) -> Vec<Vec<u32>> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .map(|i| {
            let len = 1 + (next() as usize % 8) + 5 * i;
            (0..len).map(|_| (next() % vocab as u64) as u32).collect()
        })
        .collect()
}

/// Every logit row of each sequence in `prompts` run on one runner with a cache each:
/// the prompt's last row (prefill per sequence), then one row per decode step, all
/// sequences advancing together in one batched step. `feed(seq, step, logits)` picks the
/// token a sequence consumes next.
fn batched(
    r: &mut dyn Runner,
    prompts: &[Vec<u32>],
    feed: &mut dyn FnMut(usize, usize, &[f32]) -> u32,
) -> Vec<Vec<Vec<f32>>> {
    for s in 1..prompts.len() {
        assert_eq!(r.add_sequence().unwrap(), s);
    }
    let vocab = r.config().vocab_size;
    let mut rows: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .enumerate()
        .map(|(s, p)| vec![r.forward_on(s, p, 0, LogitRows::Last, &mut NoObserver).unwrap()])
        .collect();
    for step in 0..STEPS {
        let at: Vec<SeqPos> =
            prompts.iter().enumerate().map(|(s, p)| SeqPos { seq: s, pos: p.len() + step }).collect();
        let ids: Vec<u32> = (0..prompts.len()).map(|s| feed(s, step, rows[s].last().unwrap())).collect();
        let logits = r.step(&at, &ids).unwrap();
        for (s, row) in logits.chunks(vocab).enumerate() {
            rows[s].push(row.to_vec());
        }
    }
    rows
}

/// The logit rows of one sequence run alone with ordinary forward calls (prefill, then
/// one position per call), consuming `tokens`.
fn solo(r: &mut dyn Runner, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut rows = vec![r.forward(prompt, 0, LogitRows::Last, &mut NoObserver).unwrap()];
    for (i, &t) in tokens.iter().enumerate() {
        rows.push(r.forward(&[t], prompt.len() + i, LogitRows::Last, &mut NoObserver).unwrap());
    }
    rows
}

/// The batched-step checks on `model` for 1 to 4 sequences with prompts of different
/// lengths: each GPU row's top-1 equals the CPU's, and its logits those of a solo GPU run
/// (unless `opts` computes experts missing from VRAM on the CPU, where which experts the
/// solo run's cache held changes the rounding: then the top-1 only).
/// With an F16 cache the CPU is the one on binary16-rounded keys and values
/// (tests/common/f16kv.rs), the numbers an F16 cache is defined to have.
fn check_batched(label: &str, model: &LoadedModel, opts: &GpuOptions) {
    let vocab = model.config.vocab_size;
    // Solo runs start at position 0 and attend only up to their own position, so one
    // backend serves them all.
    let mut alone_on = Forward::new(gpu_backend(model, opts), 16);
    for n in 1..=4 {
        let ps = prompts(n, 17 * n as u64 + label.len() as u64, vocab);
        // The CPU's batched step picks greedy tokens; the GPU runs consume the same ones, so
        // every row is compared at the same positions and inputs.
        let mut cpu: Box<dyn Runner> = match opts.kv_precision {
            KvPrecision::F32 => {
                engine::cpu_runner(model, &RunOptions { ctx: CTX, max_batch: 16, ..Default::default() })
                    .unwrap()
            }
            KvPrecision::F16 => Box::new(Forward::new(
                F16KvCpu(
                    CpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CTX)
                        .unwrap(),
                ),
                16,
            )),
        };
        let mut tokens = vec![Vec::new(); n];
        let cpu_rows = batched(cpu.as_mut(), &ps, &mut |s, _, l| {
            let t = common::argmax(l) as u32;
            tokens[s].push(t);
            t
        });
        let mut gpu = Forward::new(gpu_backend(model, opts), 16);
        let gpu_rows = batched(&mut gpu, &ps, &mut |s, step, _| tokens[s][step]);
        for s in 0..n {
            let alone = solo(&mut alone_on, &ps[s], &tokens[s]);
            for (step, ((g, c), a)) in gpu_rows[s].iter().zip(&cpu_rows[s]).zip(&alone).enumerate() {
                let what = format!("{label}, {n} sequences, sequence {s}, step {step}");
                assert_eq!(common::argmax(g), common::argmax(c), "top-1 differs from the CPU: {what}");
                if opts.misses == MissPolicy::Upload || opts.vram_bytes.is_none() {
                    assert!(g == a, "batched row differs from the solo GPU run: {what}");
                } else {
                    assert_eq!(
                        common::argmax(g),
                        common::argmax(a),
                        "top-1 differs from the solo run: {what}"
                    );
                }
            }
        }
    }
}

#[test]
fn batched_gpu_rows_have_the_cpu_top1_and_the_solo_gpu_logits_on_every_fixture() {
    let Some(opts) = gpu_options("batched decode") else { return };
    // GPT-OSS (sliding windows of 8 and 5 that the later positions pass, sinks) and
    // Qwen3-MoE (QK-norm, no sinks; a dense layer and renormalized top-3 in qwen3-tiny,
    // tied embeddings and top-2 in qwen3-alt).
    for name in ["tiny-f32", "alt-f32", "qwen3-tiny-f32", "qwen3-alt-f32"] {
        check_batched(name, &engine::load_hf(&fixture(name)).unwrap(), &opts);
    }
    // The smallest VRAM expert cache: each layer reads back the routing of all rows and
    // makes the union resident a chunk at a time.
    let model = engine::load_hf(&fixture("tiny-f32")).unwrap();
    check_batched(
        "tiny-f32, smallest expert cache",
        &model,
        &GpuOptions { vram_bytes: Some(1), misses: MissPolicy::Upload, ..opts.clone() },
    );
    // The same with the missing experts computed on the CPU (the default).
    check_batched(
        "tiny-f32, smallest expert cache, CPU+GPU experts",
        &model,
        &GpuOptions { vram_bytes: Some(1), misses: MissPolicy::Cpu, ..opts.clone() },
    );
    // MXFP4 experts in a container.
    let dir = common::convert_fixture("tiny-mxfp4", MXFP4);
    let model = engine::load_container(dir.path(), &OpenOptions { ctx: CTX, ..Default::default() }).unwrap();
    check_batched("tiny-mxfp4 as MXFP4", &model, &opts);
}

#[test]
fn batched_gpu_rows_with_an_f16_cache_equal_solo_runs_and_the_rounded_cpu() {
    let Some(opts) = gpu_options("batched decode, f16 cache") else { return };
    let opts = GpuOptions { kv_precision: KvPrecision::F16, ..opts };
    // Sliding windows and sinks; QK-norm and no sinks.
    for name in ["tiny-f32", "qwen3-tiny-f32"] {
        check_batched(&format!("{name}, f16 cache"), &engine::load_hf(&fixture(name)).unwrap(), &opts);
    }
}

#[test]
fn a_batched_step_is_one_submission_and_one_readback_with_every_expert_resident() {
    let Some(opts) = gpu_options("batched step submissions") else { return };
    let model = engine::load_hf(&fixture("tiny-f32")).unwrap();
    let ps = prompts(4, 3, model.config.vocab_size);
    let mut f = Forward::new(gpu_backend(&model, &GpuOptions { kv_caches: 4, ..opts }), 16);
    for (s, p) in ps.iter().enumerate() {
        if s > 0 {
            assert_eq!(f.backend_mut().add_sequence().unwrap(), s);
        }
        f.run_on(s, p, 0, LogitRows::Last, &mut NoObserver).unwrap();
    }
    assert!(f.backend().residency().3, "every expert is resident");
    let before = f.backend().stats().device;
    for step in 0..5 {
        let at: Vec<SeqPos> =
            ps.iter().enumerate().map(|(s, p)| SeqPos { seq: s, pos: p.len() + step }).collect();
        f.step(&at, &[7, 8, 9, 10]).unwrap();
    }
    let after = f.backend().stats().device;
    assert_eq!(after.readbacks - before.readbacks, 5, "one readback (the logits of all rows) per step");
    // The step's work goes out in submissions of SUBMIT_EVERY dispatches while the rest is
    // recorded, the last with the readback: no wait before the logits.
    let per_step = (after.dispatches - before.dispatches) / 5;
    let submissions = per_step / SUBMIT_EVERY as u64 + 1;
    assert_eq!(after.submissions - before.submissions, 5 * submissions, "{per_step} dispatches a step");
}

#[test]
fn a_batched_step_of_many_rows_runs_the_matrix_vector_kernels() {
    // A step of more rows than a prompt block needs to run its dense products tiled
    // (TILED_MIN_TOKENS) still computes each row as the row's solo decode step does, bit for
    // bit: batched steps never use the tiled product. The prompts (8 tokens and more) do.
    let Some(opts) = gpu_options("batched step, many rows") else { return };
    let model = engine::load_hf(&fixture("tiny-f32")).unwrap();
    let n = TILED_MIN_TOKENS + 1;
    let vocab = model.config.vocab_size;
    let ps: Vec<Vec<u32>> = (0..n)
        .map(|s| (0..TILED_MIN_TOKENS + s % 3).map(|i| ((s * 31 + i * 7) % vocab) as u32).collect())
        .collect();
    let mut f = Forward::new(gpu_backend(&model, &GpuOptions { kv_caches: n, ..opts.clone() }), 16);
    let mut solo_f = Forward::new(gpu_backend(&model, &opts), 16);
    let mut last = Vec::new();
    for (s, p) in ps.iter().enumerate() {
        if s > 0 {
            assert_eq!(f.backend_mut().add_sequence().unwrap(), s);
        }
        last.push(f.run_on(s, p, 0, LogitRows::Last, &mut NoObserver).unwrap());
    }
    let tiled = f.backend().stats().tiled_products;
    assert!(tiled > 0, "prompts of {TILED_MIN_TOKENS} tokens or more run tiled");
    let at: Vec<SeqPos> = ps.iter().enumerate().map(|(s, p)| SeqPos { seq: s, pos: p.len() }).collect();
    let ids: Vec<u32> = last.iter().map(|l| common::argmax(l) as u32).collect();
    let rows = f.step(&at, &ids).unwrap();
    assert_eq!(f.backend().stats().tiled_products, tiled, "a batched step runs no tiled product");
    for (s, row) in rows.chunks(vocab).enumerate() {
        let alone = solo(&mut solo_f, &ps[s], &ids[s..s + 1]);
        assert!(row == &alone[1][..], "sequence {s}: the batched row differs from its solo decode step");
    }
}

#[test]
fn a_sequence_beyond_the_vram_left_for_caches_is_refused_with_the_sizes() {
    let Some(opts) = gpu_options("add_sequence beyond VRAM") else { return };
    let model = engine::load_hf(&fixture("tiny-f32")).unwrap();
    let cfg = &model.config;
    // An F16 cache is half the bytes: room for two F32 caches and a half holds five F16 ones.
    let per_f16 = (2 * CTX * cfg.kv_dim() * 2 * cfg.num_layers) as u64;
    let room = 5 * per_f16 + per_f16 / 2;
    let mut b = gpu_backend(
        &model,
        &GpuOptions { kv_vram_bytes: Some(room), kv_precision: KvPrecision::F16, ..opts.clone() },
    );
    assert_eq!(b.kv_cache_bytes(), per_f16);
    for s in 1..5 {
        assert_eq!(b.add_sequence().unwrap(), s);
    }
    let err = b.add_sequence().unwrap_err().to_string();
    let need = format!(
        "another f16 key/value cache ({CTX} positions x {} layers) needs {:.1} MiB",
        cfg.num_layers,
        per_f16 as f64 / (1 << 20) as f64
    );
    assert!(err.contains(&need), "{err}");
    drop(b);
    let per_sequence = (2 * CTX * cfg.kv_dim() * 4 * cfg.num_layers) as u64;
    // Room for two caches and a half: the second is added, the third refused.
    let room = 2 * per_sequence + per_sequence / 2;
    let mut b = gpu_backend(&model, &GpuOptions { kv_vram_bytes: Some(room), ..opts });
    assert_eq!(b.kv_cache_bytes(), per_sequence);
    assert_eq!(b.add_sequence().unwrap(), 1);
    let err = b.add_sequence().unwrap_err();
    let Error::Backend(msg) = &err else { panic!("not a backend error: {err}") };
    let need = format!("needs {:.1} MiB of VRAM", per_sequence as f64 / (1 << 20) as f64);
    let free = format!("{:.1} MiB of the", (room - 2 * per_sequence) as f64 / (1 << 20) as f64);
    assert!(msg.contains(&need) && msg.contains(&free), "{msg}");
    assert!(b.select_sequence(2).is_err(), "the refused sequence does not exist");
    // The two caches that fit still work.
    let mut f = Forward::new(b, 16);
    let step = f.step(&[SeqPos { seq: 0, pos: 0 }, SeqPos { seq: 1, pos: 0 }], &[3, 5]).unwrap();
    assert_eq!(step.len(), 2 * cfg.vocab_size);
}

#[test]
fn a_device_failure_during_batched_steps_continues_every_sequence_on_the_cpu() {
    let Some(opts) = gpu_options("fallback of batched steps") else { return };
    let model = engine::load_hf(&fixture("tiny-f32")).unwrap();
    let ps = prompts(3, 5, model.config.vocab_size);
    let run = RunOptions { ctx: CTX, max_batch: 16, ..Default::default() };
    let mut cpu = engine::cpu_runner(&model, &run).unwrap();
    let mut tokens = vec![Vec::new(); ps.len()];
    let want = batched(cpu.as_mut(), &ps, &mut |s, _, l| {
        let t = common::argmax(l) as u32;
        tokens[s].push(t);
        t
    });
    // Every expert is resident: one readback per prefill and per step, so the sixth, the
    // third step's, fails as a lost device would.
    let gpu = engine::gpu_runner(&model, &run, &GpuOptions { fail_at_readback: Some(6), ..opts }).unwrap();
    let mut r = FallbackRunner::new(gpu, model.clone(), run);
    let got = batched(&mut r, &ps, &mut |s, step, _| tokens[s][step]);
    assert!(r.report().iter().any(|l| l.contains("fell back to the CPU")), "{:?}", r.report());
    for s in 0..ps.len() {
        for (i, (g, w)) in got[s].iter().zip(&want[s]).enumerate() {
            assert_eq!(common::argmax(g), common::argmax(w), "sequence {s}, row {i}");
            // Rows from the failed step on come from the CPU, which replayed each
            // sequence's cached positions: the CPU's own numbers.
            if i >= 3 {
                assert!(g == w, "sequence {s}, row {i} after the fallback differs from the CPU");
            }
        }
    }
}

#[test]
fn a_gpu_server_with_two_slots_serves_two_clients_at_once() {
    let Some(opts) = gpu_options("GPU server with --parallel 2") else { return };
    let dir = common::tiny_real_vocab();
    let model = engine::open(dir.path(), &OpenOptions { ctx: 256, ..Default::default() }).unwrap();
    let run = RunOptions { ctx: 256, max_batch: 16, ..Default::default() };
    let runner =
        engine::runner(&model, &run, Device::Gpu, &GpuOptions { kv_caches: 2, ..opts }, false).unwrap();
    let mut options = HttpOptions::new("tiny");
    options.parallel = 2;
    let server = serve(listener(), Session::new(runner), options).unwrap();
    assert_eq!(server.stats().slots, 2, "the GPU runner gives two slots");
    let body = |i: usize| {
        json!({"prompt": format!("{i}: one two three four five ").repeat(i + 1), "max_tokens": 10,
               "temperature": 0.0})
    };
    let ask = |i: usize| {
        let (status, v) = post(&server, "/v1/completions", &body(i));
        assert_eq!(status, 200, "{v}");
        (v["choices"][0]["text"].as_str().unwrap().to_string(), v["usage"]["completion_tokens"].as_u64())
    };
    let together: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2).map(|i| s.spawn(move || ask(i))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Each again alone, one after the other: the same greedy answers.
    for (i, got) in together.iter().enumerate() {
        assert!(got.1.is_some_and(|n| n > 0), "request {i} generated nothing");
        assert_eq!(got, &ask(i), "request {i}: concurrent and alone differ");
    }
    let (status, text) = get_text(&server, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(metric(&text, "picchio_slots"), 2.0);
    let stats = server.stats();
    assert!(
        stats.decode_step_rows > stats.decode_steps,
        "some steps batched both slots: {} rows in {} steps",
        stats.decode_step_rows,
        stats.decode_steps
    );
}
