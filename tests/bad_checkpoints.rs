//! Broken checkpoints fail with a message naming the file or tensor, never a panic.

mod common;

use std::path::Path;

use common::fixture;
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

fn load_error(dir: &Path) -> String {
    match picchio::engine::load_hf(dir) {
        Ok(_) => panic!("{} loaded although it is broken", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Rewrites `file` in `dir` with `edit` applied to its tensor list.
fn rewrite(dir: &Path, file: &str, edit: impl FnOnce(&mut Vec<(String, TensorView<'_>)>)) {
    let path = dir.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView<'_>)> = st.tensors();
    edit(&mut tensors);
    let out = safetensors::serialize(tensors, None).unwrap();
    std::fs::write(&path, out).unwrap();
}

#[test]
fn truncated_shard_is_named() {
    let tmp = copy_fixture("tiny-mxfp4");
    let shard = tmp.path().join("model-00002-of-00003.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 1000).unwrap();
    let e = load_error(tmp.path());
    assert!(e.contains("model-00002-of-00003.safetensors") && e.contains("truncated"), "{e}");
}

#[test]
fn shard_cut_inside_its_header_is_named() {
    let tmp = copy_fixture("tiny-f32");
    let file = tmp.path().join("model.safetensors");
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(100).unwrap();
    let e = load_error(tmp.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let tmp = copy_fixture("tiny-f32");
    rewrite(tmp.path(), "model.safetensors", |t| t.retain(|(n, _)| n != "model.layers.2.self_attn.sinks"));
    let e = load_error(tmp.path());
    assert!(e.contains("missing tensor `model.layers.2.self_attn.sinks`"), "{e}");
}

#[test]
fn missing_expert_bias_is_named() {
    let tmp = copy_fixture("tiny-mxfp4");
    let file = "model-00001-of-00003.safetensors";
    rewrite(tmp.path(), file, |t| t.retain(|(n, _)| n != "model.layers.0.mlp.experts.down_proj_bias"));
    // The index still lists it: the shard no longer holds what the index promises.
    let e = load_error(tmp.path());
    assert!(e.contains("model.layers.0.mlp.experts.down_proj_bias"), "{e}");
}

#[test]
fn transposed_weight_fails_on_shape() {
    let tmp = copy_fixture("tiny-f32");
    let name = "model.layers.1.self_attn.q_proj.weight";
    rewrite(tmp.path(), "model.safetensors", |t| {
        let i = t.iter().position(|(n, _)| n == name).unwrap();
        let v = &t[i].1;
        let shape = vec![v.shape()[1], v.shape()[0]];
        t[i].1 = TensorView::new(v.dtype(), shape, v.data()).unwrap();
    });
    let e = load_error(tmp.path());
    assert!(e.contains(name) && e.contains("[64, 192]") && e.contains("[192, 64]"), "{e}");
}

#[test]
fn wrong_dtype_is_named() {
    let tmp = copy_fixture("tiny-mxfp4");
    let file = "model-00001-of-00003.safetensors";
    let name = "model.layers.0.mlp.experts.gate_up_proj_scales";
    rewrite(tmp.path(), file, |t| {
        let i = t.iter().position(|(n, _)| n == name).unwrap();
        let v = &t[i].1;
        t[i].1 = TensorView::new(safetensors::Dtype::I8, v.shape().to_vec(), v.data()).unwrap();
    });
    let e = load_error(tmp.path());
    assert!(e.contains(name) && e.contains("U8"), "{e}");
}

#[test]
fn index_naming_a_missing_shard_is_an_error() {
    let tmp = copy_fixture("tiny-mxfp4");
    std::fs::remove_file(tmp.path().join("model-00003-of-00003.safetensors")).unwrap();
    let e = load_error(tmp.path());
    assert!(e.contains("model-00003-of-00003.safetensors") && e.contains("does not exist"), "{e}");
}

#[test]
fn impossible_config_is_named() {
    let tmp = copy_fixture("tiny-f32");
    let path = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 4")).unwrap();
    let e = load_error(tmp.path());
    assert!(e.contains("config.json") && e.contains("num_key_value_heads 4"), "{e}");
}

#[test]
fn config_disagreeing_with_weights_names_the_tensor() {
    let tmp = copy_fixture("tiny-f32");
    let path = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96")).unwrap();
    let e = load_error(tmp.path());
    assert!(e.contains("model.layers.0.mlp.experts.gate_up_proj"), "{e}");
}

#[test]
fn not_a_checkpoint_directory() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("tiny-f32").join("config.json"), tmp.path().join("config.json")).unwrap();
    let e = load_error(tmp.path());
    assert!(e.contains("not a Hugging Face checkpoint"), "{e}");
    let e = load_error(&tmp.path().join("nope"));
    assert!(e.contains("does not exist"), "{e}");
}
