//! The converted container: exactness with F32 formats, the L1 reference for the default
//! INT4/INT8 formats, the L2 gap to Transformers, identical output for every RAM cache
//! size, resumable conversion, and clear errors for broken inputs.

mod common;

use std::path::Path;

use common::{FIXTURES, Reference, argmax, convert_fixture, cpu_prompt_and_greedy, fixture, max_abs_diff};
use picchio::engine::{self, LoadedModel, OpenOptions};
use picchio::format::container::{DenseFormat, ExpertFormat, Formats};

const EXACT: Formats = Formats { experts: ExpertFormat::F32, dense: DenseFormat::F32 };
const DEFAULT: Formats = Formats { experts: ExpertFormat::Int4, dense: DenseFormat::Auto };

fn open(dir: &Path, ram_bytes: Option<u64>) -> LoadedModel {
    engine::load_container(dir, &OpenOptions { ram_bytes, ctx: 128, ..Default::default() }).unwrap()
}

#[test]
fn f32_container_is_token_exact_against_transformers() {
    for name in FIXTURES {
        let r = Reference::load(&fixture(name));
        let dir = convert_fixture(name, EXACT);
        let (logits, greedy) = cpu_prompt_and_greedy(&open(dir.path(), None), &r);
        let d = max_abs_diff(&logits, &r.logits);
        assert!(d < 1e-4, "{name}: F32 container logits differ from Transformers by {d}");
        assert_eq!(greedy, r.greedy, "{name}: F32 container greedy tokens");
    }
}

#[test]
fn default_container_matches_its_l1_reference() {
    for name in FIXTURES {
        let r = Reference::load(&fixture(name));
        let dir = convert_fixture(name, DEFAULT);
        let model = open(dir.path(), None);
        let reference = model.dequantized().unwrap();
        let vocab = model.config.vocab_size;
        let (logits, greedy) = cpu_prompt_and_greedy(&model, &r);
        let (ref_logits, ref_greedy) = cpu_prompt_and_greedy(&reference, &r);
        for pos in 0..r.prompt.len() {
            let (a, b) =
                (&logits[pos * vocab..(pos + 1) * vocab], &ref_logits[pos * vocab..(pos + 1) * vocab]);
            assert_eq!(argmax(a), argmax(b), "{name}: top-1 at prompt position {pos} differs from L1");
        }
        assert_eq!(greedy, ref_greedy, "{name}: greedy tokens differ from the L1 reference");
        let d = max_abs_diff(&logits, &ref_logits);
        eprintln!("{name}: INT4/INT8 runtime vs L1 (F32 on dequantized weights): max logit diff {d:.2e}");
    }
}

/// The L2 gap (quantization against Transformers), reported, with every top-1 divergence
/// required to be explained by the logit error at that position.
#[test]
fn default_container_l2_gap_is_reported_and_explained() {
    for name in FIXTURES {
        let r = Reference::load(&fixture(name));
        let dir = convert_fixture(name, DEFAULT);
        let model = open(dir.path(), None);
        let vocab = model.config.vocab_size;
        let (logits, greedy) = cpu_prompt_and_greedy(&model, &r);
        let t = r.prompt.len();
        let mut agree = 0;
        let mut worst = 0.0f32;
        for pos in 0..t {
            let (a, b) = (&logits[pos * vocab..(pos + 1) * vocab], &r.logits[pos * vocab..(pos + 1) * vocab]);
            let err = max_abs_diff(a, b);
            worst = worst.max(err);
            let (top_ref, top_ours) = (argmax(b), argmax(a));
            if top_ref == top_ours {
                agree += 1;
            } else {
                // Transformers' margin between its top-1 and our top-1 must be within twice
                // the logit error: the flip is quantization noise, not a wrong computation.
                let margin = b[top_ref] - b[top_ours];
                assert!(
                    margin <= 2.0 * err,
                    "{name}: position {pos} flips with margin {margin} > 2 x error {err}"
                );
            }
        }
        let same_prefix = greedy.iter().zip(&r.greedy).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{name}: L2 gap: top-1 agrees at {agree}/{t} prompt positions, max logit error {worst:.4}, greedy agrees for {same_prefix}/32 tokens"
        );
    }
}

#[test]
fn output_is_identical_for_every_ram_cache_size() {
    for name in ["tiny-mxfp4", "alt-f32"] {
        let r = Reference::load(&fixture(name));
        let dir = convert_fixture(name, DEFAULT);
        let probe = open(dir.path(), None);
        let cfg = probe.config.clone();
        let c = picchio::format::container::Container::open(dir.path()).unwrap();
        let expert = c.experts().record_bytes();
        let all = expert * (cfg.num_layers * cfg.num_experts) as u64;
        let sizes = [expert * cfg.num_layers as u64, all / 2, all];
        let results: Vec<_> =
            sizes.iter().map(|&ram| cpu_prompt_and_greedy(&open(dir.path(), Some(ram)), &r)).collect();
        for (size, res) in sizes.iter().zip(&results).skip(1) {
            assert!(res.0 == results[0].0, "{name}: logits differ with a {size}-byte cache");
            assert_eq!(res.1, results[0].1, "{name}: tokens differ with a {size}-byte cache");
        }
        // The smallest cache really did evict and re-read.
        let small = open(dir.path(), Some(sizes[0]));
        cpu_prompt_and_greedy(&small, &r);
        let s = small.experts.stats();
        assert!(s.evictions > 0 && s.misses > (cfg.num_layers * cfg.num_experts) as u64, "{name}: {s:?}");
    }
}

#[test]
fn verify_passes_then_names_a_flipped_expert_byte() {
    let dir = convert_fixture("tiny-mxfp4", DEFAULT);
    let report = picchio::format::container::verify::verify(dir.path(), &mut |_, _| {}).unwrap();
    assert!(report.mismatches.is_empty());
    let m = picchio::format::container::Manifest::read(dir.path()).unwrap();
    let rec = m.experts.records.iter().find(|r| r.layer == 2 && r.expert == 5).unwrap();
    let path = dir.path().join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[rec.offset as usize + 100] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    let report = picchio::format::container::verify::verify(dir.path(), &mut |_, _| {}).unwrap();
    assert_eq!(report.mismatches.len(), 1, "{:?}", report.mismatches);
    assert_eq!(report.mismatches[0].what, "expert layer 2 expert 5");
}

#[test]
fn verify_names_a_flipped_dense_byte() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let m = picchio::format::container::Manifest::read(dir.path()).unwrap();
    let part = m.tensor("model.layers.1.self_attn.k_proj.weight").unwrap().parts[0].clone();
    let path = dir.path().join("dense.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[part.offset as usize + 3] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let report = picchio::format::container::verify::verify(dir.path(), &mut |_, _| {}).unwrap();
    assert_eq!(report.mismatches.len(), 1);
    assert_eq!(report.mismatches[0].what, "tensor model.layers.1.self_attn.k_proj.weight part data");
}

fn open_error(dir: &Path) -> String {
    match engine::open(dir, &OpenOptions { ctx: 128, ..Default::default() }) {
        Ok(_) => panic!("{} opened although it is broken", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn manifest_disagreeing_with_the_data_is_named() {
    // A tensor listed with a shape the config does not imply.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        let t = v["tensors"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|t| t["name"] == "model.layers.0.self_attn.v_proj.weight")
            .unwrap();
        t["shape"] = serde_json::json!([64, 96]);
    });
    let e = open_error(dir.path());
    assert!(e.contains("model.layers.0.self_attn.v_proj.weight") && e.contains("[64, 96]"), "{e}");

    // A part whose byte count does not fit its shape.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        let t =
            v["tensors"].as_array_mut().unwrap().iter_mut().find(|t| t["name"] == "lm_head.weight").unwrap();
        t["parts"][1]["bytes"] = serde_json::json!(8);
    });
    let e = open_error(dir.path());
    assert!(e.contains("lm_head.weight") && e.contains("scales"), "{e}");

    // A missing tensor.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        v["tensors"].as_array_mut().unwrap().retain(|t| t["name"] != "model.layers.3.self_attn.sinks");
    });
    let e = open_error(dir.path());
    assert!(e.contains("missing tensor `model.layers.3.self_attn.sinks`"), "{e}");

    // The expert file shorter than the manifest says (a short read waiting to happen).
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("experts.bin")).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 4096).unwrap();
    let e = open_error(dir.path());
    assert!(e.contains("experts.bin") && e.contains("truncated"), "{e}");

    // An impossible config.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let cfg = dir.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("\"num_experts_per_tok\": 4", "\"num_experts_per_tok\": 9")).unwrap();
    let e = open_error(dir.path());
    assert!(e.contains("num_experts_per_tok 9 exceeds num_local_experts 8"), "{e}");
}

#[test]
fn broken_sources_fail_conversion_with_names() {
    let run_convert = |src: &Path| {
        let out = tempfile::tempdir().unwrap();
        let opts = picchio::format::container::ConvertOptions {
            formats: DEFAULT,
            progress: false,
            interrupt_after: None,
        };
        picchio::format::container::convert(src, out.path(), &opts).unwrap_err().to_string()
    };
    // Truncated shard.
    let src = common_copy("tiny-mxfp4");
    let shard = src.path().join("model-00003-of-00003.safetensors");
    let f = std::fs::OpenOptions::new().write(true).open(&shard).unwrap();
    f.set_len(f.metadata().unwrap().len() - 10).unwrap();
    let e = run_convert(src.path());
    assert!(e.contains("model-00003-of-00003.safetensors") && e.contains("truncated"), "{e}");
    // Missing expert tensor.
    let src = common_copy("tiny-f32");
    drop_tensor(&src.path().join("model.safetensors"), "model.layers.3.mlp.experts.down_proj_bias");
    let e = run_convert(src.path());
    assert!(e.contains("missing tensor `model.layers.3.mlp.experts.down_proj_bias`"), "{e}");
    // Wrong shape (a transposed projection).
    let src = common_copy("alt-f32");
    let file = src.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = st.tensors();
    let name = "model.layers.2.self_attn.o_proj.weight";
    let i = tensors.iter().position(|(n, _)| n == name).unwrap();
    let v = &tensors[i].1;
    let shape = vec![v.shape()[1], v.shape()[0]];
    tensors[i].1 = safetensors::tensor::TensorView::new(v.dtype(), shape, v.data()).unwrap();
    std::fs::write(&file, safetensors::serialize(tensors, None).unwrap()).unwrap();
    let e = run_convert(src.path());
    assert!(e.contains(name) && e.contains("[64, 96]") && e.contains("[96, 64]"), "{e}");
}

fn common_copy(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

fn drop_tensor(file: &Path, name: &str) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = st.tensors();
    tensors.retain(|(n, _)| n != name);
    std::fs::write(file, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

#[test]
fn interrupted_conversion_resumes_and_is_never_taken_for_complete() {
    let src = fixture("tiny-mxfp4");
    let fresh = convert_fixture("tiny-mxfp4", DEFAULT);
    let out = tempfile::tempdir().unwrap();
    let convert = |interrupt_after| {
        let opts =
            picchio::format::container::ConvertOptions { formats: DEFAULT, progress: false, interrupt_after };
        picchio::format::container::convert(&src, out.path(), &opts)
    };
    let e = convert(Some(7)).unwrap_err().to_string();
    assert!(e.contains("interrupted after 7 items"), "{e}");
    assert!(!out.path().join("manifest.json").exists());
    assert!(out.path().join("convert.state.json").exists());
    // An incomplete directory is refused, not loaded.
    let e = open_error(out.path());
    assert!(e.contains("incomplete conversion"), "{e}");
    // A second interruption keeps the first run's work.
    assert!(convert(Some(5)).is_err());
    // Re-running finishes the remaining items only, and the result is byte-identical to
    // an uninterrupted conversion.
    let r = convert(None).unwrap();
    assert_eq!(r.resumed, 12);
    assert!(r.converted > 0);
    for file in ["dense.bin", "experts.bin"] {
        let a = std::fs::read(out.path().join(file)).unwrap();
        let b = std::fs::read(fresh.path().join(file)).unwrap();
        assert!(a == b, "{file} differs after a resumed conversion");
    }
    assert!(!out.path().join("convert.state.json").exists());
    let v = picchio::format::container::verify::verify(out.path(), &mut |_, _| {}).unwrap();
    assert!(v.mismatches.is_empty(), "{:?}", v.mismatches);
    // A run over a complete container does nothing; other formats are refused.
    let again = convert(None).unwrap();
    assert_eq!((again.converted, again.resumed), (0, 0));
    let opts =
        picchio::format::container::ConvertOptions { formats: EXACT, progress: false, interrupt_after: None };
    let e = picchio::format::container::convert(&src, out.path(), &opts).unwrap_err().to_string();
    assert!(e.contains("already holds a complete container"), "{e}");
}

#[test]
fn a_state_from_other_options_restarts_cleanly() {
    let src = fixture("alt-f32");
    let out = tempfile::tempdir().unwrap();
    let opts = |formats, interrupt_after| picchio::format::container::ConvertOptions {
        formats,
        progress: false,
        interrupt_after,
    };
    assert!(picchio::format::container::convert(&src, out.path(), &opts(EXACT, Some(4))).is_err());
    let r = picchio::format::container::convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert_eq!(r.resumed, 0);
    let v = picchio::format::container::verify::verify(out.path(), &mut |_, _| {}).unwrap();
    assert!(v.mismatches.is_empty());
    let model = open(out.path(), None);
    assert_eq!(model.experts.expert(0, 0).unwrap().gate_up.format_name(), "int4-gs64");
}

#[test]
fn the_dense_weights_every_token_reads_are_prefaulted_but_not_the_embedding() {
    use picchio::format::container::{Container, Manifest};
    for name in ["tiny-mxfp4", "qwen3-tiny-f32"] {
        let dir = convert_fixture(name, DEFAULT);
        let c = Container::open(dir.path()).unwrap();
        let m = Manifest::read(dir.path()).unwrap();
        let ranges = c.per_token_ranges();
        let covered = |t: &str| {
            let rec = m.tensor(t).unwrap_or_else(|| panic!("{name}: no {t}"));
            rec.parts
                .iter()
                .all(|p| ranges.iter().any(|r| r.start == p.offset as usize && r.len() == p.bytes as usize))
        };
        assert!(!covered("model.embed_tokens.weight"), "{name}: the embedding is prefaulted");
        assert!(covered("lm_head.weight"), "{name}: the head is not prefaulted");
        assert!(covered("model.layers.0.self_attn.q_proj.weight"), "{name}: attention is not prefaulted");
        let embed: u64 = m.tensor("model.embed_tokens.weight").unwrap().parts.iter().map(|p| p.bytes).sum();
        let total: u64 = ranges.iter().map(|r| r.len() as u64).sum();
        assert_eq!(total + embed, c.dense_bytes() - padding(&m), "{name}: every other dense byte is covered");
    }
}

/// Bytes of `dense.bin` between parts (alignment padding).
fn padding(m: &picchio::format::container::Manifest) -> u64 {
    let parts: u64 = m
        .tensors
        .iter()
        .flat_map(|t| t.parts.iter())
        .filter(|p| p.file == "dense.bin")
        .map(|p| p.bytes)
        .sum();
    m.files.dense - parts
}
