//! Sampling on the GPU: a sampler's planned pick decided from candidates the device ranks
//! (logits_adjust.wgsl, logits_topk.wgsl), against the host's pick from the full logits.
//! The ranking must equal the host's bit for bit (every step of the adjustment is one
//! correctly rounded operation, the ranking none), the statistics agree to f32 rounding,
//! and a session sampling on the GPU draws the same tokens as the same GPU session whose
//! picks are made on the host from its full logits, while reading back kilobytes a token.
//! Every test runs in the adapter's best shader build and in the portable one.

mod common;

use common::gpu::{Fmt, Rng, gpu_options, random_model, variants};
use picchio::ModelConfig;
use picchio::backend::Backend;
use picchio::backend::SeqPos;
use picchio::backend::gpu::{GpuBackend, GpuOptions};
use picchio::engine::{Pick, Picked, Runner};
use picchio::experts::ExpertStats;
use picchio::model::forward::PhaseTimes;
use picchio::model::{Forward, LogitRows, Observer};
use picchio::sample::{LogitStats, PlannedLogits, SamplePlan, Sampler, SamplingParams, rank};
use picchio::session::Session;

const CAPACITY: usize = 200;

fn each_variant(test: &str, mut f: impl FnMut(&str, &GpuOptions)) {
    let Some(base) = gpu_options(test) else { return };
    for (name, opts) in variants(&base) {
        f(name, &opts);
    }
}

/// The forward pass on the GPU over `model`.
fn gpu_forward(model: &picchio::engine::LoadedModel, opts: &GpuOptions) -> Forward<GpuBackend> {
    let b = GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, opts)
        .unwrap();
    Forward::new(b, 64)
}

/// Sampler settings that exercise every part of a plan.
fn settings() -> Vec<SamplingParams> {
    let p = |temperature| SamplingParams { temperature, seed: 5, ..Default::default() };
    vec![
        SamplingParams { logprobs: Some(5), repetition_penalty: 1.3, ..p(0.0) },
        p(1.0),
        SamplingParams { top_k: 40, ..p(0.7) },
        SamplingParams { top_p: 0.9, presence_penalty: 0.5, frequency_penalty: 0.25, ..p(1.0) },
        SamplingParams { min_p: 0.05, logit_bias: vec![(7, 20.0), (7, 1.5), (0, -100.0)], ..p(1.2) },
        SamplingParams { top_k: 512, logprobs: Some(20), repetition_penalty: 0.9, ..p(1.0) },
        SamplingParams { top_k: 900, ..p(1.0) },
    ]
}

/// A row of logits with ties, zeros of both signs and a spread of magnitudes.
fn row(rng: &mut Rng, vocab: usize) -> Vec<f32> {
    let mut r = rng.vec(vocab, 4.0);
    for (i, v) in r.iter_mut().enumerate() {
        match i % 97 {
            0 => *v = 3.0,
            1 => *v = -0.0,
            2 => *v = 0.0,
            _ => {}
        }
    }
    r
}

#[test]
fn device_candidates_equal_the_host_ranking_and_statistics() {
    each_variant("sampling candidates", |variant, opts| {
        let model = random_model(61, Fmt::F32, Fmt::F32);
        let mut g =
            GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, opts)
                .unwrap();
        let mut rng = Rng::new(62);
        let history: Vec<u32> = (0..30).map(|i| (i * 37) % 1000).collect();
        let (mut from_candidates, mut from_logits) = (0, 0);
        for vocab in [1, 3, 255, 1023, 1024, 1025, 5000, 201_088] {
            for params in settings() {
                let mut sampler = Sampler::new(params.clone()).unwrap();
                // A picked token or two, so the presence and frequency penalties bite.
                sampler.sample(&row(&mut rng, vocab), &history).unwrap();
                let plan = sampler.plan(&history, &[]).unwrap();
                let raw = row(&mut rng, vocab);
                let mut adjusted = raw.clone();
                plan.adjust_logits(&mut adjusted);
                // Two rows: the plan reduces the last one.
                let mut two = row(&mut rng, vocab);
                two.extend_from_slice(&raw);
                let logits = g.upload(2, vocab, &two).unwrap();
                let what = format!("{variant}, vocab {vocab}, {params:?}");
                match g.reduce_logits(&logits, 1, &plan).unwrap() {
                    PlannedLogits::Candidates(c) => {
                        from_candidates += 1;
                        let mut want = Vec::new();
                        rank(&adjusted, plan.candidates, &mut want);
                        let bits =
                            |v: &[(u32, f32)]| v.iter().map(|c| (c.0, c.1.to_bits())).collect::<Vec<_>>();
                        let zero_as_plus = |v: &[(u32, f32)]| {
                            v.iter().map(|c| (c.0, if c.1 == 0.0 { 0.0 } else { c.1 })).collect::<Vec<_>>()
                        };
                        assert_eq!(bits(&c.ranked), bits(&zero_as_plus(&want)), "{what}: ranking");
                        let host = LogitStats::of(&adjusted, &plan.rule, plan.logprobs.is_some());
                        assert_eq!(c.stats.max, host.max, "{what}");
                        assert_eq!(c.stats.vocab, vocab, "{what}");
                        let close = |a: Option<f64>, b: Option<f64>| match (a, b) {
                            (Some(a), Some(b)) => ((a - b) / b.abs().max(1.0)).abs() < 1e-5,
                            (None, None) => true,
                            _ => false,
                        };
                        assert!(close(c.stats.sum_at_temperature, host.sum_at_temperature), "{what}: {c:?}");
                        assert!(close(c.stats.log_partition, host.log_partition), "{what}");
                        assert!(plan.decides(&c), "{what}: handed back candidates that do not decide");
                        check_same_pick(&plan, &params, &PlannedLogits::Candidates(c), &adjusted, &what);
                    }
                    PlannedLogits::Full(values) => {
                        from_logits += 1;
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&values), bits(&adjusted), "{what}: adjusted row");
                    }
                }
            }
        }
        eprintln!(
            "{variant}: {from_candidates} picks from device candidates, {from_logits} from the full row"
        );
        assert!(from_candidates > 30 && from_logits > 0, "{variant}: {from_candidates} {from_logits}");
    });
}

/// The pick of `plan` from what the device handed back equals its pick from the host's
/// adjusted row (two samplers of the same settings and state).
fn check_same_pick(
    plan: &SamplePlan,
    params: &SamplingParams,
    handed: &PlannedLogits,
    adjusted: &[f32],
    what: &str,
) {
    let got = Sampler::new(params.clone()).unwrap().finish(plan, handed).unwrap();
    let want =
        Sampler::new(params.clone()).unwrap().finish(plan, &PlannedLogits::Full(adjusted.to_vec())).unwrap();
    assert_eq!(got.token, want.token, "{what}: token");
    if let (Some(g), Some(w)) = (&got.logprobs, &want.logprobs) {
        assert!((g.logprob - w.logprob).abs() < 1e-4, "{what}: {g:?} {w:?}");
        assert_eq!(
            g.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            w.top.iter().map(|t| t.0).collect::<Vec<_>>()
        );
    }
}

#[test]
fn non_finite_logits_are_refused_naming_the_position() {
    each_variant("sampling, non-finite", |variant, opts| {
        let model = random_model(63, Fmt::F32, Fmt::F32);
        let vocab = model.config.vocab_size;
        let mut g =
            GpuBackend::new(model.config.clone(), model.dense.clone(), model.experts.clone(), CAPACITY, opts)
                .unwrap();
        let mut rng = Rng::new(64);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let params = SamplingParams { temperature: 1.0, repetition_penalty: 1.2, ..Default::default() };
            // The bad logit sits on a penalized token: the adjustment leaves it as it is.
            let plan = Sampler::new(params).unwrap().plan(&[777; 42], &[]).unwrap();
            let mut r = rng.vec(vocab, 1.0);
            r[777] = bad;
            let logits = g.upload(1, vocab, &r).unwrap();
            let err = g.reduce_logits(&logits, 0, &plan).unwrap_err().to_string();
            assert!(err.contains("non-finite") && err.contains("position 41"), "{variant}: {err}");
        }
    });
}

/// The GPU runner with the trait's default planned step: its full logits, adjusted and
/// sampled on the host.
struct HostPicks(Forward<GpuBackend>);

impl Runner for HostPicks {
    fn config(&self) -> &ModelConfig {
        self.0.backend().config()
    }
    fn capacity(&self) -> usize {
        self.0.backend().capacity()
    }
    fn describe(&self) -> String {
        "the GPU, picking on the host".into()
    }
    fn forward(
        &mut self,
        ids: &[u32],
        start: usize,
        rows: LogitRows,
        o: &mut dyn Observer,
    ) -> picchio::Result<Vec<f32>> {
        self.0.run(ids, start, rows, o)
    }
    fn times(&self) -> PhaseTimes {
        PhaseTimes::default()
    }
    fn expert_stats(&self) -> ExpertStats {
        ExpertStats::default()
    }
}

#[test]
fn a_session_samples_the_same_tokens_from_device_candidates_reading_back_kilobytes() {
    each_variant("sampling session", |variant, opts| {
        let model = random_model(65, Fmt::F32, Fmt::F32);
        let forward = || gpu_forward(&model, opts);
        let prompt: Vec<u32> = (0..9).map(|i| (i * 311 + 5) % 3001).collect();
        let vocab = model.config.vocab_size;
        for params in settings() {
            let mut session = Session::new(Box::new(forward()));
            let mut sampler = Sampler::new(params.clone()).unwrap();
            let got = session.generate(&prompt, 32, &mut sampler, &[], &mut |_| true).unwrap();
            let mut host = Session::new(Box::new(HostPicks(forward())));
            let mut sampler = Sampler::new(params.clone()).unwrap();
            let want = host.generate(&prompt, 32, &mut sampler, &[], &mut |_| true).unwrap();
            assert_eq!(got.tokens, want.tokens, "{variant}: {params:?}");

            // What the decode steps read back: per pick from candidates, the ranking, the
            // statistics of each 1024 logits and the 16-byte device counters; per pick
            // from the full row, the row too.
            let runner = session.runner();
            let report = runner.report().join("\n");
            let line = report.lines().find(|l| l.contains("sampling:")).unwrap_or_else(|| panic!("{report}"));
            let numbers: Vec<u64> = line.split(' ').filter_map(|w| w.parse().ok()).collect();
            let (from_candidates, from_logits) = (numbers[0], numbers[1]);
            let plan = Sampler::new(params.clone()).unwrap().plan(&prompt, &[]).unwrap();
            let counters = runner.decode_counters().unwrap();
            assert_eq!(from_candidates + from_logits, counters.steps, "{variant}: {params:?}: {report}");
            let candidates = if plan.reducible() {
                (plan.candidates * 8 + vocab.div_ceil(1024) * 16 + 16) as u64
            } else {
                0
            };
            let row = (vocab * 4 + 16) as u64;
            let expected = counters.steps * candidates + from_logits * row;
            assert_eq!(counters.readback_bytes, expected, "{variant}: {params:?}: {report}");
            if plan.reducible() && (plan.rule.top_k > 0 || plan.rule.is_greedy()) {
                // Top-k and greedy picks always lie within the candidates.
                assert_eq!(from_logits, 0, "{variant}: {params:?}: {report}");
            }
            eprintln!(
                "{variant} {params:?}: {} of {} picks from device candidates, {:.0} bytes read back a token",
                from_candidates,
                counters.steps,
                counters.readback_bytes as f64 / counters.steps as f64
            );
        }
    });
}

#[test]
fn a_batched_step_picks_each_row_as_its_solo_step_does() {
    each_variant("sampling, batched step", |variant, opts| {
        let model = random_model(66, Fmt::F32, Fmt::F32);
        let forward = || gpu_forward(&model, opts);
        let prompts: Vec<Vec<u32>> =
            (0..4).map(|s| (0..5 + s).map(|i| (i * 97 + s * 13) as u32 % 3001).collect()).collect();
        let params =
            SamplingParams { temperature: 0.9, top_k: 50, repetition_penalty: 1.1, ..Default::default() };
        let plan = |prompt: &[u32]| Sampler::new(params.clone()).unwrap().plan(prompt, &[7]).unwrap();
        let picks: Vec<Pick> = vec![
            Pick::Greedy,
            Pick::Planned(std::sync::Arc::new(plan(&prompts[1]))),
            Pick::Logits,
            Pick::Planned(std::sync::Arc::new(plan(&prompts[3]))),
        ];
        // The batch: four sequences on one runner, one token each after their prompts.
        let mut batch = forward();
        for seq in 1..4 {
            assert_eq!(Runner::add_sequence(&mut batch).unwrap(), seq);
        }
        for (seq, prompt) in prompts.iter().enumerate() {
            batch.forward_on(seq, prompt, 0, LogitRows::None, &mut picchio::model::NoObserver).unwrap();
        }
        let rows: Vec<SeqPos> =
            prompts.iter().enumerate().map(|(seq, p)| SeqPos { seq, pos: p.len() }).collect();
        let got = Runner::step_picks(&mut batch, &rows, &[7; 4], &picks).unwrap();
        for (seq, prompt) in prompts.iter().enumerate() {
            let mut solo = forward();
            solo.forward_on(0, prompt, 0, LogitRows::None, &mut picchio::model::NoObserver).unwrap();
            let want = solo.forward_pick(0, &[7], prompt.len(), &picks[seq]).unwrap();
            match (&got[seq], &want) {
                (Picked::Logits(a), Picked::Logits(b)) => {
                    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                    assert!(d < 1e-4, "{variant}: row {seq}: logits differ by {d}");
                }
                (a, b) => assert_eq!(a, b, "{variant}: row {seq}"),
            }
        }
    });
}
