//! Qwen3-MoE: the CPU F32 path against Transformers on every Qwen3 fixture (see
//! fixtures/README.md): the residual stream entering every layer, the router top-k and
//! weights of every MoE layer at every position, the prompt logits, the 32-token greedy
//! continuation, the RoPE frequencies; decode through the cache against one batch; the
//! exact container token-exact and the default one against its L1 reference on every
//! fixture (dense layers included). The GPU against this CPU path: tests/gpu_qwen3.rs.

mod common;

use common::parity::{check_greedy, check_prompt, session};
use common::{Reference, argmax, fixture, max_abs_diff};
use picchio::engine::{self, RunOptions};
use picchio::engine::{LoadedModel, OpenOptions};
use picchio::format::container::{ConvertOptions, DenseFormat, ExpertFormat, Formats};
use picchio::model::{LogitRows, NoObserver};
use picchio::sample::Sampler;
use picchio::session::Session;

/// Every Qwen3-MoE fixture: renormalized top-3 with a dense layer and a 300-token prompt
/// (F32 and BF16), and a second shape with un-renormalized top-2 and tied embeddings.
const QWEN3_FIXTURES: [&str; 3] = ["qwen3-tiny-f32", "qwen3-tiny-bf16", "qwen3-alt-f32"];

#[test]
fn f32_prompt_matches_transformers() {
    check_prompt("qwen3-tiny-f32");
}

#[test]
fn f32_greedy_matches_transformers() {
    check_greedy("qwen3-tiny-f32");
}

#[test]
fn bf16_checkpoint_matches_transformers() {
    check_prompt("qwen3-tiny-bf16");
    check_greedy("qwen3-tiny-bf16");
}

#[test]
fn second_shape_tied_and_not_renormalized_matches_transformers() {
    check_prompt("qwen3-alt-f32");
    check_greedy("qwen3-alt-f32");
}

#[test]
fn config_reads_the_family_recipe() {
    use picchio::config::{MlpKind, ModelFamily, Routing};
    let tiny = picchio::ModelConfig::from_dir(&fixture("qwen3-tiny-f32")).unwrap();
    assert_eq!(tiny.family, ModelFamily::Qwen3Moe);
    assert_eq!((tiny.intermediate_size, tiny.dense_intermediate_size), (96, 160));
    assert_eq!(tiny.mlp_kinds, [MlpKind::Moe, MlpKind::Moe, MlpKind::Dense, MlpKind::Moe]);
    assert_eq!(tiny.recipe.routing, Routing::SoftmaxThenTopK { renormalize: true });
    assert!(tiny.recipe.qk_norm && !tiny.recipe.attention_sinks && !tiny.tie_word_embeddings);
    assert_eq!(tiny.q_dim(), 96, "heads x head_dim need not equal hidden (64)");
    let alt = picchio::ModelConfig::from_dir(&fixture("qwen3-alt-f32")).unwrap();
    assert_eq!(alt.recipe.routing, Routing::SoftmaxThenTopK { renormalize: false });
    assert!(alt.tie_word_embeddings);
    // The BF16 fixture's config says `torch_dtype`, the F32 one `dtype`: both are read.
    let bf16 = picchio::ModelConfig::from_dir(&fixture("qwen3-tiny-bf16")).unwrap();
    assert_eq!(bf16.mlp_kinds, tiny.mlp_kinds);
}

#[test]
fn rope_frequencies_match_transformers() {
    for name in QWEN3_FIXTURES {
        let r = Reference::load(&fixture(name));
        let cfg = picchio::ModelConfig::from_dir(&fixture(name)).unwrap();
        let f = picchio::model::rope::RopeFrequencies::from_config(&cfg);
        assert_eq!(f.inv_freq.len(), r.inv_freq.len(), "{name}");
        for (i, (a, b)) in f.inv_freq.iter().zip(&r.inv_freq).enumerate() {
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * b.abs(), "{name}: inv_freq[{i}] {a} vs {b}");
        }
        assert_eq!(f.attention_factor, 1.0, "{name}: plain RoPE has no attention factor");
        assert_eq!(r.attention_factor, None, "{name}: the reference has none either");
    }
}

/// Token-by-token decode through the cache and prefill in odd-sized blocks give
/// bit-identical logits to one batch over the same positions.
#[test]
fn kv_cache_decode_equals_one_batch() {
    let r = Reference::load(&fixture("qwen3-alt-f32"));
    let mut ids = r.prompt.clone();
    ids.extend_from_slice(&r.greedy);
    let vocab = r.logits.len() / r.prompt.len();
    let full = session("qwen3-alt-f32", 256).feed(&ids, LogitRows::All, &mut NoObserver).unwrap();
    let mut blocks = session("qwen3-alt-f32", 7);
    let blocked = blocks.feed(&ids, LogitRows::All, &mut NoObserver).unwrap();
    assert_eq!(blocked, full, "prefill in blocks of 7");
    let mut step = session("qwen3-alt-f32", 256);
    for (p, &id) in ids.iter().enumerate() {
        let row = step.feed(&[id], LogitRows::All, &mut NoObserver).unwrap();
        assert_eq!(row, full[p * vocab..(p + 1) * vocab], "position {p}");
    }
}

fn convert(name: &str, formats: Formats) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let opts = ConvertOptions { formats, progress: false, interrupt_after: None };
    picchio::format::container::convert(&fixture(name), out.path(), &opts).unwrap();
    out
}

fn open(dir: &std::path::Path) -> LoadedModel {
    engine::load_container(dir, &OpenOptions { ctx: 512, ..Default::default() }).unwrap()
}

/// Prompt logits and the greedy continuation of `r` on `model`'s CPU path.
fn prompt_and_greedy(model: &LoadedModel, r: &Reference) -> (Vec<f32>, Vec<u32>) {
    let run = RunOptions { ctx: 512, ..Default::default() };
    let logits = Session::new(engine::cpu_runner(model, &run).unwrap())
        .feed(&r.prompt, LogitRows::All, &mut NoObserver)
        .unwrap();
    let out = Session::new(engine::cpu_runner(model, &run).unwrap())
        .generate(&r.prompt, r.greedy.len(), &mut Sampler::greedy(), &[], &mut |_| true)
        .unwrap();
    (logits, out.tokens)
}

/// The exact container (F32 experts and dense tensors) is token-exact against Transformers.
#[test]
fn exact_container_is_token_exact_against_transformers() {
    for name in QWEN3_FIXTURES {
        let r = Reference::load(&fixture(name));
        let dir = convert(name, Formats { experts: ExpertFormat::F32, dense: DenseFormat::F32 });
        let model = open(dir.path());
        let (logits, greedy) = prompt_and_greedy(&model, &r);
        let d = max_abs_diff(&logits, &r.logits);
        assert!(d < 1e-4, "{name}: F32 container logits differ from Transformers by {d}");
        assert_eq!(greedy, r.greedy, "{name}: F32 container greedy tokens");
    }
}

/// `--dense source` keeps the BF16 checkpoint's matrices BF16 (widened exactly when
/// computed), so with F32 experts the container is as exact as the F32 one.
#[test]
fn source_precision_container_keeps_bf16_and_stays_exact() {
    let name = "qwen3-tiny-bf16";
    let r = Reference::load(&fixture(name));
    let dir = convert(name, Formats { experts: ExpertFormat::F32, dense: DenseFormat::Source });
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("manifest.json")).unwrap()).unwrap();
    let scheme = |t: &str| {
        let tensors = manifest["tensors"].as_array().unwrap();
        let rec = tensors.iter().find(|x| x["name"] == t).unwrap_or_else(|| panic!("no tensor {t}"));
        format!("{}/{}", rec["scheme"].as_str().unwrap(), rec["parts"][0]["dtype"].as_str().unwrap())
    };
    assert_eq!(scheme("model.layers.2.mlp.gate_proj.weight"), "none/bf16", "the dense MLP stays BF16");
    assert_eq!(scheme("model.layers.0.self_attn.q_proj.weight"), "none/bf16");
    assert_eq!(scheme("model.embed_tokens.weight"), "none/bf16");
    let (logits, greedy) = prompt_and_greedy(&open(dir.path()), &r);
    let d = max_abs_diff(&logits, &r.logits);
    assert!(d < 1e-4, "BF16-kept container logits differ from the reference by {d}");
    assert_eq!(greedy, r.greedy);
}

/// The default container (INT4 experts, INT8 embedding and head) against its level-L1
/// reference: F32 arithmetic on the same quantized weights.
#[test]
fn default_container_matches_its_l1_reference() {
    for name in QWEN3_FIXTURES {
        let r = Reference::load(&fixture(name));
        let dir = convert(name, Formats::default());
        let model = open(dir.path());
        let reference = model.dequantized().unwrap();
        let vocab = model.config.vocab_size;
        let (logits, greedy) = prompt_and_greedy(&model, &r);
        let (ref_logits, ref_greedy) = prompt_and_greedy(&reference, &r);
        for pos in 0..r.prompt.len() {
            let (a, b) =
                (&logits[pos * vocab..(pos + 1) * vocab], &ref_logits[pos * vocab..(pos + 1) * vocab]);
            assert_eq!(argmax(a), argmax(b), "{name}: top-1 at prompt position {pos} differs from L1");
        }
        assert_eq!(greedy, ref_greedy, "{name}: greedy tokens differ from the L1 reference");
    }
}

/// A dense MLP layer is stored as three dense tensors and has no expert records: the store
/// holds one record per expert of each MoE layer only, in layer order, and `open` on the
/// Hugging Face directory converts it like any other checkpoint.
#[test]
fn dense_layers_are_dense_tensors_without_expert_records() {
    let name = "qwen3-tiny-f32";
    let cfg = picchio::config::ModelConfig::from_dir(&fixture(name)).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let model = engine::open(
        &fixture(name),
        &OpenOptions { ctx: 512, cache_dir: Some(cache.path().to_path_buf()), ..Default::default() },
    )
    .unwrap();
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 1, "open converted the checkpoint");
    let container = std::fs::read_dir(cache.path()).unwrap().next().unwrap().unwrap().path();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(container.join("manifest.json")).unwrap()).unwrap();
    let records = manifest["experts"]["records"].as_array().unwrap();
    let moe_layers: Vec<usize> = cfg.moe_layers().collect();
    assert_eq!(moe_layers, [0, 1, 3], "the fixture's layer 2 is dense");
    assert_eq!(records.len(), moe_layers.len() * cfg.num_experts);
    for (n, rec) in records.iter().enumerate() {
        let (layer, expert) = (moe_layers[n / cfg.num_experts], n % cfg.num_experts);
        assert_eq!(
            (rec["layer"].as_u64(), rec["expert"].as_u64()),
            (Some(layer as u64), Some(expert as u64))
        );
        assert_eq!(cfg.expert_record(layer, expert), Some(n));
    }
    assert_eq!(cfg.expert_record(2, 0), None, "a dense layer has no record");
    let tensors = manifest["tensors"].as_array().unwrap();
    for m in ["gate_proj", "up_proj", "down_proj"] {
        let t = format!("model.layers.2.mlp.{m}.weight");
        assert!(tensors.iter().any(|x| x["name"] == t.as_str()), "no dense tensor {t}");
    }
    let r = Reference::load(&fixture(name));
    let (_, greedy) = prompt_and_greedy(&model, &r);
    assert_eq!(greedy, prompt_and_greedy(&model.dequantized().unwrap(), &r).1);
}

/// A manifest that gives a dense layer expert records is refused, naming the record.
#[test]
fn a_record_for_a_dense_layer_is_refused() {
    let dir = convert("qwen3-tiny-f32", Formats { experts: ExpertFormat::F32, dense: DenseFormat::F32 });
    let path = dir.path().join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let records = manifest["experts"]["records"].as_array_mut().unwrap();
    let n = records.iter().position(|r| r["layer"] == 3).unwrap();
    records[n]["layer"] = 2.into();
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let err = engine::load_container(dir.path(), &OpenOptions { ctx: 64, ..Default::default() })
        .err()
        .expect("a record for dense layer 2 must not load")
        .to_string();
    assert!(err.contains(&format!("expert record {n} (layer 2, expert 0)")), "{err}");
}
