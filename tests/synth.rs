//! Synthetic checkpoints: deterministic for a seed, loadable, and scaled so activations stay
//! finite and routing stays varied through every layer, at the real width and at depth.

mod common;

use std::collections::HashSet;

use picchio::backend::RouteTable;
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::experts::routing::{Concentration, RouteCounts};
use picchio::model::{LogitRows, Observer};
use picchio::session::Session;
use picchio::synth::{SynthShape, SynthSpec, synth};

#[derive(Default)]
struct Routes(Vec<HashSet<u32>>);

impl Observer for Routes {
    fn routes(&mut self, layer: usize, _start: usize, r: &RouteTable) {
        if self.0.len() <= layer {
            self.0.resize(layer + 1, HashSet::new());
        }
        self.0[layer].extend(r.experts.iter().copied());
    }
}

/// Held while a real-width checkpoint and its container are on disk: each takes a few hundred
/// MB in the temp directory, and CI machines can be short of disk, so they take turns.
static REAL_WIDTH_ON_DISK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs a few tokens and checks logits and routing.
fn check_healthy(spec: &SynthSpec) {
    let src = tempfile::tempdir().unwrap();
    synth(spec, src.path(), &mut |_, _| {}).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let opts = OpenOptions { ctx: 64, cache_dir: Some(cache.path().to_path_buf()), ..Default::default() };
    let model = engine::open(src.path(), &opts).unwrap();
    let mut s = Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx: 64, max_batch: 64, ..Default::default() }).unwrap(),
    );
    let ids = picchio::bench::prompt_ids(12, spec.vocab, 5);
    let mut routes = Routes::default();
    let logits = s.feed(&ids, LogitRows::All, &mut routes).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
    let spread = logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(spread > 0.1 && spread < 1e4, "logits out of a sane range: max |logit| {spread}");
    assert_eq!(routes.0.len(), spec.layers);
    for (l, used) in routes.0.iter().enumerate() {
        assert!(used.len() > spec.top_k, "layer {l} routes every token to the same experts: {used:?}");
    }
}

#[test]
fn deep_model_stays_finite_and_routes_varied() {
    let spec = SynthSpec { layers: 36, vocab: 5000, ..SynthSpec::of(SynthShape::Tiny) };
    check_healthy(&spec);
}

#[test]
fn real_width_model_stays_finite_and_routes_varied() {
    let spec = SynthSpec { layers: 2, experts: 8, vocab: 2000, ..SynthSpec::of(SynthShape::GptOss20b) };
    let _turn = REAL_WIDTH_ON_DISK.lock().unwrap_or_else(|e| e.into_inner());
    check_healthy(&spec);
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let spec = SynthSpec { vocab: 3000, ..SynthSpec::of(SynthShape::Tiny) };
    let (a, b, c) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    synth(&spec, a.path(), &mut |_, _| {}).unwrap();
    synth(&spec, b.path(), &mut |_, _| {}).unwrap();
    synth(&SynthSpec { seed: 1, ..spec.clone() }, c.path(), &mut |_, _| {}).unwrap();
    let shard = "model-00001-of-00001.safetensors";
    let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(shard)).unwrap();
    assert!(read(&a) == read(&b));
    assert!(read(&a) != read(&c));
    let cfg = picchio::ModelConfig::from_dir(a.path()).unwrap();
    assert_eq!((cfg.num_layers, cfg.vocab_size, cfg.experts_per_token), (4, 3000, 4));
}

#[test]
fn tiny_with_real_vocabulary_is_made_in_seconds() {
    let t0 = std::time::Instant::now();
    let dir = common::tiny_real_vocab();
    let secs = t0.elapsed().as_secs_f64();
    let cfg = picchio::ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(cfg.vocab_size, 201_088);
    eprintln!("tiny synthetic model with the real vocabulary: made and converted in {secs:.2} s");
}

/// Qwen3-MoE at its real width (hidden 2048, 32/4 heads of 128, top-8, expert width 768),
/// two layers of 16 experts and a small vocabulary: converted with the defaults (INT4
/// experts from BF16), finite, routing varied, and the config read as the family.
#[test]
fn qwen3_real_width_model_converts_stays_finite_and_routes_varied() {
    let spec = SynthSpec { layers: 2, experts: 16, vocab: 3000, ..SynthSpec::of(SynthShape::Qwen3_30bA3b) };
    let _turn = REAL_WIDTH_ON_DISK.lock().unwrap_or_else(|e| e.into_inner());
    let src = tempfile::tempdir().unwrap();
    synth(&spec, src.path(), &mut |_, _| {}).unwrap();
    let cfg = picchio::ModelConfig::from_dir(src.path()).unwrap();
    assert_eq!(cfg.family, picchio::config::ModelFamily::Qwen3Moe);
    assert_eq!((cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size), (16, 8, 768));
    assert_eq!(cfg.recipe.routing, picchio::config::Routing::SoftmaxThenTopK { renormalize: true });
    check_healthy(&spec);
}

/// blake3 of every file `synth` writes into `dir`, in name order, as hex.
fn checkpoint_digest(dir: &std::path::Path) -> String {
    let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    let mut h = blake3::Hasher::new();
    for n in names {
        h.update(n.as_encoded_bytes());
        h.update(&std::fs::read(dir.join(&n)).unwrap());
    }
    h.finalize().to_hex().to_string()
}

/// Without `--routing-skew` (S = 0) the generator writes exactly the bytes it wrote before
/// the option existed: the digest was recorded from the generator at `31bdef6`.
#[test]
fn unskewed_checkpoint_is_byte_identical_to_the_generator_before_skew() {
    let spec = SynthSpec { vocab: 3000, ..SynthSpec::of(SynthShape::Tiny) };
    let dir = tempfile::tempdir().unwrap();
    synth(&spec, dir.path(), &mut |_, _| {}).unwrap();
    assert_eq!(
        checkpoint_digest(dir.path()),
        "2df350df9ca07927c071f7b744800d9f21e0e36a9ace024e8a4ee1db5616b78b"
    );
}

/// The routing concentration of 64 random tokens on `spec`'s checkpoint, converted to a
/// container with the default formats and run on the CPU.
fn measured_concentration(spec: &SynthSpec) -> Concentration {
    let out = common::synth_container(spec);
    let model = engine::open(out.path(), &OpenOptions { ctx: 128, ..Default::default() }).unwrap();
    let mut s = Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx: 128, max_batch: 64, ..Default::default() }).unwrap(),
    );
    let mut counts = RouteCounts::new(spec.experts);
    let logits =
        s.feed(&picchio::bench::prompt_ids(64, spec.vocab, 3), LogitRows::Last, &mut counts).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
    for l in 0..spec.layers {
        assert_eq!(counts.layer(l).iter().sum::<u64>(), 64 * spec.top_k as u64, "layer {l}");
    }
    counts.concentration()
}

/// With `--routing-skew` the checkpoint converts and runs, and its routing is clearly more
/// concentrated than the unskewed one's and than uniform routing of as many tokens; the
/// unskewed one stays near uniform.
#[test]
fn skewed_checkpoint_converts_runs_and_concentrates_routing() {
    let spec = SynthSpec { layers: 3, experts: 32, vocab: 2000, seed: 4, ..SynthSpec::of(SynthShape::Tiny) };
    let flat = measured_concentration(&spec);
    let skewed = measured_concentration(&SynthSpec { routing_skew: 1.0, ..spec.clone() });
    eprintln!("unskewed {flat:?}\nskewed {skewed:?}");
    assert_eq!((skewed.layers, skewed.requests_per_layer), (3, 256));
    assert!(flat.top10 < flat.uniform_top10 + 0.06, "unskewed routing is not near uniform: {flat:?}");
    assert!(skewed.top10 > skewed.uniform_top10 + 0.15, "skew 1 barely concentrates routing: {skewed:?}");
    assert!(skewed.top25 > flat.top25 + 0.15, "{flat:?} vs {skewed:?}");
}

/// Out-of-range skews and a skew for a family without a router bias are refused before
/// anything is written, naming the flag.
#[test]
fn hostile_routing_skews_are_refused_naming_the_flag() {
    let spec = SynthSpec { vocab: 3000, ..SynthSpec::of(SynthShape::Tiny) };
    for s in [-1.0, -0.0001, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 16.5, 1e300] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("m");
        let e = synth(&SynthSpec { routing_skew: s, ..spec.clone() }, &out, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("--routing-skew"), "{s}: {e}");
        assert!(!out.exists(), "{s}: wrote {}", out.display());
    }
    let qwen = SynthSpec {
        layers: 1,
        experts: 16,
        vocab: 3000,
        routing_skew: 1.0,
        ..SynthSpec::of(SynthShape::Qwen3_30bA3b)
    };
    let e =
        synth(&qwen, &tempfile::tempdir().unwrap().path().join("q"), &mut |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("--routing-skew") && e.contains("Qwen3-MoE"), "{e}");
    let all_chosen = SynthSpec { top_k: 8, routing_skew: 1.0, ..spec.clone() };
    let e = synth(&all_chosen, &tempfile::tempdir().unwrap().path().join("a"), &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("--routing-skew") && e.contains("top-k (8)"), "{e}");
    // The command line reaches the same check (a negative value is a value, not a flag).
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["synth", "--shape", "tiny", "--routing-skew", "-2"])
        .arg(dir.path().join("m"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--routing-skew -2"), "{err}");
}

/// `picchio bench` states the routing concentration of the run's tokens, in one stream and
/// in several: on a skewed checkpoint clearly above uniform routing of as many tokens.
#[test]
fn bench_reports_the_routing_concentration_of_a_skewed_checkpoint() {
    let spec = SynthSpec { experts: 32, vocab: 2000, routing_skew: 1.0, ..SynthSpec::of(SynthShape::Tiny) };
    let src = tempfile::tempdir().unwrap();
    synth(&spec, src.path(), &mut |_, _| {}).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let bench = |extra: &[&str]| -> serde_json::Value {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_picchio"))
            .args(["-q", "bench", "--device", "cpu", "--prompt", "32", "--gen", "8", "--json", "-m"])
            .arg(src.path())
            .arg("--cache-dir")
            .arg(cache.path())
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    for (extra, streams) in [(&[][..], 1u64), (&["--streams", "1,2"][..], 2)] {
        let doc = bench(extra);
        let r = &doc["routing"];
        // Every stream's 32 prompt and 8 generated tokens, 4 experts each.
        assert_eq!(r["requests_per_layer"], streams * 40 * 4, "{r}");
        assert_eq!(r["layers"], 4, "{r}");
        let (top10, uniform) =
            (r["top10_share"].as_f64().unwrap(), r["uniform_top10_share"].as_f64().unwrap());
        assert!(top10 > uniform + 0.1, "{r}");
    }
    assert!(bench(&["--no-routing"])["routing"].is_null());
}
