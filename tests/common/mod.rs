//! Shared helpers for integration tests: fixture paths and Transformers references.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

pub mod browser;
pub mod f16kv;
pub mod gpu;
pub mod http;
pub mod noisy;
pub mod parity;
pub mod scripted;

/// `fixtures/<name>` in the source tree.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// Every fixture model: (directory name, has Transformers references).
pub const FIXTURES: [&str; 4] = ["tiny-f32", "tiny-mxfp4", "alt-f32", "alt-mxfp4"];

/// The references Transformers computed for a fixture (fixtures/gen_fixtures.py for
/// GPT-OSS, fixtures/gen_qwen3_fixtures.py for Qwen3-MoE).
pub struct Reference {
    pub prompt: Vec<u32>,
    /// `[T, vocab]`.
    pub logits: Vec<f32>,
    /// The MoE layers, in order: the router tensors are indexed by position in this list
    /// (`None`: every layer is MoE, as in GPT-OSS).
    pub moe_layers: Option<Vec<u32>>,
    /// `[moe layers, T, k]`.
    pub router_idx: Vec<u32>,
    /// `[moe layers, T, k]`.
    pub router_weights: Vec<f32>,
    pub greedy: Vec<u32>,
    pub greedy_margins: Vec<f32>,
    /// `[layers + 1, T, hidden]`.
    pub hidden: Vec<f32>,
    pub inv_freq: Vec<f32>,
    /// YaRN's attention factor (`None` for plain RoPE).
    pub attention_factor: Option<f32>,
}

pub fn floats(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("reference tensor {name}: {e}"));
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

pub fn ints(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("reference tensor {name}: {e}"));
    assert_eq!(t.dtype(), Dtype::I32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| u32::try_from(i32::from_le_bytes(c.try_into().unwrap())).unwrap())
        .collect()
}

impl Reference {
    pub fn load(fixture_dir: &Path) -> Self {
        let bytes = std::fs::read(fixture_dir.join("reference.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let has = |name: &str| st.names().contains(&name);
        Reference {
            prompt: ints(&st, "prompt_ids"),
            logits: floats(&st, "logits"),
            moe_layers: has("moe_layers").then(|| ints(&st, "moe_layers")),
            router_idx: ints(&st, "router_idx"),
            router_weights: floats(&st, "router_weights"),
            greedy: ints(&st, "greedy_ids"),
            greedy_margins: floats(&st, "greedy_margins"),
            hidden: floats(&st, "hidden_states"),
            inv_freq: floats(&st, "inv_freq"),
            attention_factor: has("attention_factor").then(|| floats(&st, "attention_factor")[0]),
        }
    }
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Converts fixture `name` into a fresh temporary container with `formats`.
pub fn convert_fixture(name: &str, formats: picchio::format::container::Formats) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let opts = picchio::format::container::ConvertOptions { formats, progress: false, interrupt_after: None };
    picchio::format::container::convert(&fixture(name), tmp.path(), &opts).unwrap();
    tmp
}

/// Index of the largest value.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// A synthetic tiny GPT-OSS with the real 201088-token vocabulary, converted to a container
/// with the default formats.
pub fn tiny_real_vocab() -> tempfile::TempDir {
    synth_container(&picchio::synth::SynthSpec::of(picchio::synth::SynthShape::Tiny))
}

/// A `picchio synth` checkpoint of `spec`, converted with the default formats (the
/// checkpoint itself is deleted).
pub fn synth_container(spec: &picchio::synth::SynthSpec) -> tempfile::TempDir {
    let src = tempfile::tempdir().unwrap();
    picchio::synth::synth(spec, src.path(), &mut |_, _| {}).unwrap();
    let out = tempfile::tempdir().unwrap();
    let opts = picchio::format::container::ConvertOptions {
        formats: Default::default(),
        progress: false,
        interrupt_after: None,
    };
    picchio::format::container::convert(src.path(), out.path(), &opts).unwrap();
    out
}

/// A CPU session over `model` with a context of 128 positions (or the model's maximum).
pub fn cpu_session(model: &picchio::engine::LoadedModel) -> picchio::session::Session {
    use picchio::engine::{self, RunOptions};
    let ctx = 128.min(model.config.max_position_embeddings);
    picchio::session::Session::new(
        engine::cpu_runner(model, &RunOptions { ctx, max_batch: 256, ..Default::default() }).unwrap(),
    )
}

/// On the CPU, `r`'s prompt logits (every position) and the greedy continuation as long as
/// `r`'s, each from a fresh session.
pub fn cpu_prompt_and_greedy(model: &picchio::engine::LoadedModel, r: &Reference) -> (Vec<f32>, Vec<u32>) {
    use picchio::model::{LogitRows, NoObserver};
    let logits = cpu_session(model).feed(&r.prompt, LogitRows::All, &mut NoObserver).unwrap();
    let out = cpu_session(model)
        .generate(&r.prompt, r.greedy.len(), &mut picchio::sample::Sampler::greedy(), &[], &mut |_| true)
        .unwrap();
    (logits, out.tokens)
}

/// Prompt logits (every position) and a greedy continuation of `n` tokens, as a Session
/// would run them (prefill, then one position per token).
pub fn greedy(runner: &mut dyn picchio::engine::Runner, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    greedy_observed(runner, prompt, n, &mut picchio::model::NoObserver)
}

/// [`greedy`] with `observer` watching the prompt's forward pass (its routes, residuals).
pub fn greedy_observed(
    runner: &mut dyn picchio::engine::Runner,
    prompt: &[u32],
    n: usize,
    observer: &mut dyn picchio::model::Observer,
) -> (Vec<f32>, Vec<u32>) {
    use picchio::model::{LogitRows, NoObserver};
    let vocab = runner.config().vocab_size;
    let logits = runner.forward(prompt, 0, LogitRows::All, observer).unwrap();
    let mut tokens = vec![argmax(&logits[logits.len() - vocab..]) as u32];
    let mut pos = prompt.len();
    while tokens.len() < n {
        let l = runner.forward(&tokens[tokens.len() - 1..], pos, LogitRows::Last, &mut NoObserver).unwrap();
        pos += 1;
        tokens.push(argmax(&l) as u32);
    }
    (logits, tokens)
}
