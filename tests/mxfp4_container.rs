//! The lossless MXFP4 container: experts kept as released (blocks and scales copied byte
//! for byte), token-exact against Transformers with `--dense source` and `--dense f32`;
//! `auto` resolving to MXFP4 for MXFP4 sources and INT4 for the others; the agreement of the
//! default container with Transformers reported beside INT4's.

mod common;

use std::path::Path;

use common::{Reference, argmax, convert_fixture, cpu_prompt_and_greedy, fixture, max_abs_diff};
use picchio::engine::{self, LoadedModel, OpenOptions};
use picchio::format::container::{ConvertOptions, DenseFormat, ExpertFormat, Formats, Manifest, convert};
use safetensors::SafeTensors;

const MXFP4_FIXTURES: [&str; 2] = ["tiny-mxfp4", "alt-mxfp4"];

/// Dtype and bytes of source tensor `name` of fixture `fixture_name` (sharded checkpoints).
fn source_tensor(fixture_name: &str, name: &str) -> (safetensors::Dtype, Vec<u8>) {
    let dir = fixture(fixture_name);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let shard = index["weight_map"][name].as_str().unwrap_or_else(|| panic!("{name} not in the index"));
    let bytes = std::fs::read(dir.join(shard)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    (t.dtype(), t.data().to_vec())
}

fn open(dir: &Path) -> LoadedModel {
    engine::load_container(dir, &OpenOptions { ctx: 128, ..Default::default() }).unwrap()
}

#[test]
fn mxfp4_experts_are_token_exact_against_transformers() {
    for name in MXFP4_FIXTURES {
        let r = Reference::load(&fixture(name));
        for dense in [DenseFormat::Source, DenseFormat::F32] {
            let dir = convert_fixture(name, Formats { experts: ExpertFormat::Mxfp4, dense });
            let m = Manifest::read(dir.path()).unwrap();
            assert_eq!(m.experts.scheme, picchio::format::container::manifest::Scheme::Mxfp4);
            let (logits, greedy) = cpu_prompt_and_greedy(&open(dir.path()), &r);
            let d = max_abs_diff(&logits, &r.logits);
            assert!(d < 1e-4, "{name} mxfp4 + dense {dense:?}: logits differ from Transformers by {d}");
            assert_eq!(greedy, r.greedy, "{name} mxfp4 + dense {dense:?}: greedy tokens");
            assert_eq!(greedy.len(), 32);
        }
    }
}

#[test]
fn dense_source_keeps_every_matrix_at_source_precision() {
    let dir =
        convert_fixture("tiny-mxfp4", Formats { experts: ExpertFormat::Mxfp4, dense: DenseFormat::Source });
    let m = Manifest::read(dir.path()).unwrap();
    let dense = std::fs::read(dir.path().join("dense.bin")).unwrap();
    for t in &m.tensors {
        if t.shape.len() == 2 {
            let (dtype, data) = source_tensor("tiny-mxfp4", &t.name);
            // Matrices (embedding and head included) are stored exactly as read.
            assert_eq!(t.parts.len(), 1, "{}", t.name);
            let p = &t.parts[0];
            let want = match dtype {
                safetensors::Dtype::BF16 => picchio::format::container::manifest::Dtype::Bf16,
                safetensors::Dtype::F32 => picchio::format::container::manifest::Dtype::F32,
                other => panic!("{}: fixture dtype {other:?}", t.name),
            };
            assert_eq!(p.dtype, want, "{}", t.name);
            assert!(dense[p.offset as usize..(p.offset + p.bytes) as usize] == *data, "{}", t.name);
        }
    }
}

#[test]
fn mxfp4_records_hold_the_source_blocks_and_scales_byte_for_byte() {
    let name = "alt-mxfp4";
    let dir = convert_fixture(name, Formats { experts: ExpertFormat::Mxfp4, dense: DenseFormat::Auto });
    let m = Manifest::read(dir.path()).unwrap();
    let cfg = picchio::config::ModelConfig::from_dir(dir.path()).unwrap();
    let experts = std::fs::read(dir.path().join("experts.bin")).unwrap();
    let names: Vec<&str> = m.experts.components.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        ["gate_up.codes", "gate_up.scales", "gate_up.bias", "down.codes", "down.scales", "down.bias"]
    );
    assert_eq!(m.experts.group_size, Some(32));
    let mut checked = 0;
    for rec in &m.experts.records {
        assert!(rec.offset.is_multiple_of(4096));
        let p = format!("model.layers.{}.mlp.experts", rec.layer);
        for c in &m.experts.components {
            assert!(c.offset.is_multiple_of(64), "{}", c.name);
            let (mat, role) = c.name.split_once('.').unwrap();
            let src_name = match role {
                "codes" => format!("{p}.{mat}_proj_blocks"),
                "scales" => format!("{p}.{mat}_proj_scales"),
                _ => continue,
            };
            let (_, data) = source_tensor(name, &src_name);
            let per = data.len() / cfg.num_experts;
            assert_eq!(per as u64, c.bytes, "{src_name}");
            let want = &data[rec.expert * per..(rec.expert + 1) * per];
            let at = (rec.offset + c.offset) as usize;
            assert!(&experts[at..at + per] == want, "layer {} expert {} {}", rec.layer, rec.expert, c.name);
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * cfg.num_layers * cfg.num_experts);
}

#[test]
fn auto_experts_resolve_by_source_and_mxfp4_of_a_dequantized_source_is_refused() {
    for (name, want) in [("tiny-mxfp4", ExpertFormat::Mxfp4), ("tiny-f32", ExpertFormat::Int4)] {
        let dir = convert_fixture(name, Formats::default());
        let m = Manifest::read(dir.path()).unwrap();
        assert_eq!(m.formats.experts, want, "{name}");
        // Converting again with `auto` finds the finished container (same resolved formats).
        let opts = ConvertOptions { formats: Formats::default(), progress: false, interrupt_after: None };
        let again = convert(&fixture(name), dir.path(), &opts).unwrap();
        assert_eq!(again.converted, 0, "{name}");
    }
    let out = tempfile::tempdir().unwrap();
    let opts = ConvertOptions {
        formats: Formats { experts: ExpertFormat::Mxfp4, dense: DenseFormat::Auto },
        progress: false,
        interrupt_after: None,
    };
    let e = convert(&fixture("tiny-f32"), out.path(), &opts).unwrap_err().to_string();
    assert!(e.contains("--experts mxfp4") && e.contains("not MXFP4"), "{e}");
    assert!(!out.path().join("manifest.json").exists());
}

#[test]
fn a_nan_scale_in_an_mxfp4_record_is_refused_on_load() {
    let dir =
        convert_fixture("tiny-mxfp4", Formats { experts: ExpertFormat::Mxfp4, dense: DenseFormat::Auto });
    let c = picchio::format::container::Container::open(dir.path()).unwrap();
    let info = c.experts().clone();
    let cfg = std::sync::Arc::new(c.config.clone());
    let scales = info.components.iter().find(|c| c.name == "down.scales").unwrap();
    let rec = &info.records[1];
    let path = dir.path().join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(rec.offset + scales.offset + 3) as usize] = 0xFF;
    std::fs::write(&path, &bytes).unwrap();
    let mut store = picchio::experts::ExpertStore::open(dir.path(), &info, cfg).unwrap();
    // With the hash check the damage is a hash mismatch; without it, the scale check names it.
    store.set_verify_reads(false);
    let len = store.read_bytes() as usize;
    let buf = picchio::experts::buffers::BufferPool::new(len, 1).take();
    let e = store.read_into(rec.layer, rec.expert, buf).unwrap_err().to_string();
    assert!(e.contains("down.scales") && e.contains("element 3"), "{e}");
}

/// Agreement with Transformers of the default container (MXFP4 experts, INT8 embedding and
/// head) and of INT4 experts: top-1 over the prompt positions and the matching greedy
/// prefix, printed for docs/validation.md (run with --nocapture).
#[test]
fn default_and_int4_agreement_with_transformers_is_reported() {
    for name in MXFP4_FIXTURES {
        let r = Reference::load(&fixture(name));
        for (label, formats) in [
            ("default (mxfp4 + int8 head)", Formats::default()),
            ("int4 + int8 head", Formats { experts: ExpertFormat::Int4, dense: DenseFormat::Auto }),
        ] {
            let dir = convert_fixture(name, formats);
            let model = open(dir.path());
            let vocab = model.config.vocab_size;
            let (logits, greedy) = cpu_prompt_and_greedy(&model, &r);
            let t = r.prompt.len();
            let agree = (0..t)
                .filter(|&p| {
                    argmax(&logits[p * vocab..(p + 1) * vocab])
                        == argmax(&r.logits[p * vocab..(p + 1) * vocab])
                })
                .count();
            let prefix = greedy.iter().zip(&r.greedy).take_while(|(a, b)| a == b).count();
            let d = max_abs_diff(&logits, &r.logits);
            eprintln!(
                "{name}: {label}: top-1 agrees at {agree}/{t} prompt positions, greedy prefix {prefix}/{}, max logit error {d:.4}",
                r.greedy.len()
            );
        }
    }
}
