//! Broken containers are refused by `verify` and by the loader alike, with a message naming
//! the file, tensor or record; a damaged expert record is an error when it is read (naming
//! layer and expert), never different tokens; a damaged cached conversion says how to
//! rebuild it; non-finite small dense tensors are refused at load.

mod common;

use std::path::Path;
use std::process::Command;

use common::{convert_fixture, fixture};
use picchio::engine::{self, OpenOptions};
use picchio::format::container::verify::verify;
use picchio::format::container::{DenseFormat, ExpertFormat, Formats, Manifest};

const DEFAULT: Formats = Formats { experts: ExpertFormat::Int4, dense: DenseFormat::Auto };

fn opts() -> OpenOptions {
    OpenOptions { ctx: 128, hot_set: false, ..Default::default() }
}

/// The loader's error for `dir` (it must refuse it).
fn load_error(dir: &Path) -> String {
    match engine::load_container(dir, &opts()) {
        Ok(_) => panic!("the loader accepted {}", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// The error of `r`, which must be one (`what` says what was wrongly accepted).
fn error_of<T>(r: picchio::Result<T>, what: &str) -> String {
    match r {
        Ok(_) => panic!("{what}"),
        Err(e) => e.to_string(),
    }
}

/// `verify`'s error for `dir` (it must refuse it, not report "ok").
fn verify_error(dir: &Path) -> String {
    match verify(dir, &mut |_, _| {}) {
        Ok(r) => {
            panic!("verify accepted {} ({} checked, mismatches {:?})", dir.display(), r.checked, r.mismatches)
        }
        Err(e) => e.to_string(),
    }
}

/// Both the loader and `verify` refuse `dir` with messages containing every one of `needles`.
fn both_refuse(dir: &Path, needles: &[&str]) {
    for (who, e) in [("loader", load_error(dir)), ("verify", verify_error(dir))] {
        for n in needles {
            assert!(e.contains(n), "{who}: `{e}` does not mention `{n}`");
        }
    }
}

fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

fn tensor<'a>(v: &'a mut serde_json::Value, name: &str) -> &'a mut serde_json::Value {
    v["tensors"].as_array_mut().unwrap().iter_mut().find(|t| t["name"] == name).unwrap()
}

fn picchio(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().expect("run picchio")
}

#[test]
fn a_short_data_file_is_refused_by_both() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("dense.bin")).unwrap();
    f.set_len(f.metadata().unwrap().len() - 256).unwrap();
    both_refuse(dir.path(), &["dense.bin", "truncated"]);
}

#[test]
fn a_missing_tensor_or_changed_shape_is_refused_by_both() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        v["tensors"].as_array_mut().unwrap().retain(|t| t["name"] != "model.layers.2.mlp.router.bias");
    });
    both_refuse(dir.path(), &["missing tensor `model.layers.2.mlp.router.bias`"]);

    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        tensor(v, "model.layers.1.self_attn.q_proj.weight")["shape"] = [96, 32].into()
    });
    both_refuse(dir.path(), &["model.layers.1.self_attn.q_proj.weight", "[96, 32]"]);
}

#[test]
fn a_deleted_or_broken_config_is_refused_by_both() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    both_refuse(dir.path(), &["config.json"]);
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    both_refuse(dir.path(), &["config.json", "not valid JSON"]);
}

#[test]
fn a_duplicated_tensor_entry_is_an_error_not_a_panic() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        let t = tensor(v, "model.norm.weight").clone();
        v["tensors"].as_array_mut().unwrap().push(t);
    });
    both_refuse(dir.path(), &["model.norm.weight", "more than once"]);
}

#[test]
fn duplicated_or_reordered_expert_records_are_refused_by_both() {
    let dir = convert_fixture("tiny-mxfp4", DEFAULT);
    edit_manifest(dir.path(), |v| {
        let records = v["experts"]["records"].as_array_mut().unwrap();
        records[9] = records[8].clone();
    });
    both_refuse(dir.path(), &["layer 1, expert 0", "more than once"]);

    let dir = convert_fixture("tiny-mxfp4", DEFAULT);
    edit_manifest(dir.path(), |v| v["experts"]["records"].as_array_mut().unwrap().swap(3, 4));
    both_refuse(dir.path(), &["expert record 3", "out of place"]);
}

#[test]
fn parts_outside_the_containers_own_files_are_refused_by_both() {
    for file in ["/dev/zero", "../config.json", "config.json", "experts.bin"] {
        let dir = convert_fixture("tiny-f32", DEFAULT);
        edit_manifest(dir.path(), |v| tensor(v, "lm_head.weight")["parts"][0]["file"] = file.into());
        both_refuse(dir.path(), &["lm_head.weight", file]);
    }
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| v["experts"]["file"] = "/dev/zero".into());
    both_refuse(dir.path(), &["experts.file", "/dev/zero"]);
}

#[test]
fn overflowing_misaligned_or_overlapping_parts_are_refused_by_both() {
    let name = "model.layers.0.self_attn.k_proj.weight";
    // An offset that overflows when its byte count is added.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| tensor(v, name)["parts"][0]["offset"] = (u64::MAX - 255).into());
    both_refuse(dir.path(), &[name, "outside dense.bin"]);
    // Off the 256-byte grid.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        let p = &mut tensor(v, name)["parts"][0]["offset"];
        *p = (p.as_u64().unwrap() + 4).into();
    });
    both_refuse(dir.path(), &[name, "not a multiple of 256"]);
    // On top of another tensor's bytes.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| {
        let other = tensor(v, "model.layers.0.self_attn.q_proj.weight")["parts"][0]["offset"].clone();
        tensor(v, name)["parts"][0]["offset"] = other;
    });
    both_refuse(dir.path(), &["overlaps"]);
    // An expert record placed past the end of the file.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| v["experts"]["records"][5]["offset"] = (1u64 << 62).into());
    both_refuse(dir.path(), &["expert record 5", "offset 4611686018427387904"]);
}

#[test]
fn malformed_hashes_and_headers_are_refused_by_both() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| v["experts"]["records"][2]["hash"] = "xyz".into());
    both_refuse(dir.path(), &["expert record 2", "hash \"xyz\""]);
    let dir = convert_fixture("tiny-f32", DEFAULT);
    edit_manifest(dir.path(), |v| v["hash_algorithm"] = "sha256".into());
    both_refuse(dir.path(), &["manifest.json", "sha256"]);
}

#[cfg(unix)]
#[test]
fn data_files_that_are_links_out_devices_or_fifos_are_refused_by_both() {
    // A symbolic link to a device.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let dense = dir.path().join("dense.bin");
    std::fs::remove_file(&dense).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &dense).unwrap();
    both_refuse(dir.path(), &["dense.bin", "outside the container"]);
    // A symbolic link to a copy outside the directory.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let outside = tempfile::tempdir().unwrap();
    let experts = dir.path().join("experts.bin");
    std::fs::rename(&experts, outside.path().join("experts.bin")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("experts.bin"), &experts).unwrap();
    both_refuse(dir.path(), &["experts.bin", "outside the container"]);
    // A FIFO.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let dense = dir.path().join("dense.bin");
    std::fs::remove_file(&dense).unwrap();
    let c = std::ffi::CString::new(dense.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    both_refuse(dir.path(), &["dense.bin", "not a regular file"]);
    // A link inside the container is fine.
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let experts = dir.path().join("experts.bin");
    std::fs::rename(&experts, dir.path().join("experts.data")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("experts.data"), &experts).unwrap();
    assert!(verify(dir.path(), &mut |_, _| {}).unwrap().mismatches.is_empty());
    engine::load_container(dir.path(), &opts()).unwrap();
}

#[test]
fn a_state_file_beside_the_manifest_is_refused_by_both() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    std::fs::write(dir.path().join("convert.state.json"), "{}").unwrap();
    both_refuse(dir.path(), &["convert.state.json", "did not finish"]);
    // engine::open too, and through the CLI.
    let e = match engine::open(dir.path(), &opts()) {
        Ok(_) => panic!("opened a container with a state file"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("convert.state.json"), "{e}");
}

#[test]
fn a_huge_manifest_is_refused_before_it_is_read() {
    let dir = convert_fixture("tiny-f32", DEFAULT);
    let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("manifest.json")).unwrap();
    // Sparse: no disk is used, and a reader that slurps it would hold 64 MiB of zeros.
    f.set_len((64 << 20) + 1).unwrap();
    both_refuse(dir.path(), &["manifest.json", "at most 67108864"]);
}

/// Flips one payload byte in every record of `layer`.
fn flip_layer(dir: &Path, layer: usize) {
    let m = Manifest::read(dir).unwrap();
    let path = dir.join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    for r in m.experts.records.iter().filter(|r| r.layer == layer) {
        bytes[r.offset as usize + 1000] ^= 0x20;
    }
    std::fs::write(&path, bytes).unwrap();
}

#[test]
fn a_flipped_expert_byte_fails_generate_naming_layer_and_expert() {
    let dir = convert_fixture("tiny-mxfp4", DEFAULT);
    let d = dir.path().to_str().unwrap();
    let ok = picchio(&["generate", "-m", d, "--ids", "1 2 3", "-n", "4", "--device", "cpu"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    flip_layer(dir.path(), 1);
    let out = picchio(&["generate", "-m", d, "--ids", "1 2 3", "-n", "4", "--device", "cpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "generate exited 0 on a damaged container: {err}");
    assert!(out.stdout.is_empty() || !String::from_utf8_lossy(&out.stdout).contains("panicked"));
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("layer 1 expert ") && err.contains("BLAKE3"), "{err}");
    assert!(err.contains("picchio verify"), "{err}");
    // verify names the same records.
    let out = picchio(&["verify", d]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("BAD expert layer 1 expert 0"), "{err}");
}

#[test]
fn a_damaged_record_read_through_the_library_names_layer_and_expert() {
    let dir = convert_fixture("tiny-mxfp4", DEFAULT);
    let m = Manifest::read(dir.path()).unwrap();
    let rec = m.experts.records.iter().find(|r| r.layer == 2 && r.expert == 5).unwrap().clone();
    let path = dir.path().join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[rec.offset as usize + 7] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    // Whole records on one reader, and records split into 4 KiB pieces across readers (the
    // damaged byte is then in the first piece, hashed before the others).
    for piece in [picchio::experts::store::HASHED_READ_CHUNK, 4096, 8192] {
        let model =
            engine::load_container(dir.path(), &OpenOptions { read_piece_bytes: piece, ..opts() }).unwrap();
        let e = error_of(model.experts.expert(2, 5), "a damaged record was accepted");
        assert!(
            e.contains("experts.bin") && e.contains("layer 2 expert 5") && e.contains("BLAKE3"),
            "{piece}: {e}"
        );
        // The error is not sticky for other experts, and the same expert fails again.
        model.experts.expert(2, 4).unwrap();
        assert!(model.experts.expert(2, 5).is_err());
    }
    let bad = engine::load_container(dir.path(), &OpenOptions { read_piece_bytes: 1000, ..opts() });
    let e = error_of(bad.map(|_| ()), "a piece size that is no multiple of 4 KiB was accepted");
    assert!(e.contains("1000") && e.contains("4096"), "{e}");
}

#[test]
fn a_damaged_cached_conversion_says_how_to_rebuild_it() {
    let cache = tempfile::tempdir().unwrap();
    let src = fixture("tiny-f32");
    let o = OpenOptions { cache_dir: Some(cache.path().to_path_buf()), ..opts() };
    let model = engine::open(&src, &o).unwrap();
    let target = model.dir.clone();
    drop(model);
    assert!(target.starts_with(cache.path()));
    // A damaged record: found when read, with the advice to delete the copy.
    flip_layer(&target, 0);
    let model = engine::open(&src, &o).unwrap();
    let e = error_of(model.experts.expert(0, 3), "damaged record accepted");
    assert!(e.contains("delete") && e.contains(&target.display().to_string()), "{e}");
    drop(model);
    // A truncated file: found at open, with the same advice; nothing is deleted.
    let f = std::fs::OpenOptions::new().write(true).open(target.join("experts.bin")).unwrap();
    f.set_len(4096).unwrap();
    let e = match engine::open(&src, &o) {
        Ok(_) => panic!("a truncated cached copy opened"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("truncated") && e.contains("delete") && e.contains(&target.display().to_string()),
        "{e}"
    );
    assert!(target.join("manifest.json").exists());
    // A manifest that cannot be read: the same advice.
    std::fs::write(target.join("manifest.json"), "{").unwrap();
    let e = match engine::open(&src, &o) {
        Ok(_) => panic!("a cached copy with a broken manifest opened"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("manifest.json") && e.contains("delete"), "{e}");
}

/// Writes `value` (little-endian bytes) at byte `at` of the dense part of `tensor`/`role`,
/// and re-hashes the part in the manifest, as a converter that wrote the bad value would.
fn poke_dense(dir: &Path, name: &str, role: &str, at: usize, value: &[u8]) {
    let m = Manifest::read(dir).unwrap();
    let p = m.tensor(name).unwrap().part(role).unwrap().clone();
    let path = dir.join("dense.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    let start = p.offset as usize + at;
    bytes[start..start + value.len()].copy_from_slice(value);
    let hash = picchio::format::container::manifest::hash_hex(
        &bytes[p.offset as usize..(p.offset + p.bytes) as usize],
    );
    std::fs::write(&path, bytes).unwrap();
    edit_manifest(dir, |v| {
        let parts = tensor(v, name)["parts"].as_array_mut().unwrap();
        let part = parts.iter_mut().find(|q| q["role"] == role).unwrap();
        part["hash"] = hash.into();
    });
}

#[test]
fn non_finite_small_dense_tensors_are_refused_at_load() {
    let cases: [(&str, &str, usize, Vec<u8>); 4] = [
        ("model.norm.weight", "data", 12, f32::NAN.to_le_bytes().to_vec()),
        ("model.layers.3.self_attn.sinks", "data", 4, f32::INFINITY.to_le_bytes().to_vec()),
        ("model.layers.0.mlp.router.bias", "data", 0, f32::NEG_INFINITY.to_le_bytes().to_vec()),
        ("lm_head.weight", "scales", 40, f32::INFINITY.to_le_bytes().to_vec()),
    ];
    for (name, role, at, value) in cases {
        let dir = convert_fixture("tiny-f32", DEFAULT);
        poke_dense(dir.path(), name, role, at, &value);
        let e = load_error(dir.path());
        assert!(e.contains(name) && e.contains(role) && e.contains("NaN or infinity"), "{e}");
    }
}

#[test]
fn a_non_finite_expert_scale_is_refused_when_read() {
    let dir = convert_fixture("tiny-mxfp4", DEFAULT);
    let m = Manifest::read(dir.path()).unwrap();
    let comp = m.experts.components.iter().find(|c| c.name == "down.scales").unwrap().clone();
    let rec = m.experts.records.iter().find(|r| r.layer == 3 && r.expert == 6).unwrap().clone();
    let path = dir.path().join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = (rec.offset + comp.offset) as usize + 2;
    bytes[at..at + 2].copy_from_slice(&0x7c00u16.to_le_bytes());
    let payload = &bytes[rec.offset as usize..(rec.offset + rec.bytes) as usize];
    let hash = picchio::format::container::manifest::hash_hex(payload);
    std::fs::write(&path, &bytes).unwrap();
    let n = m.experts.records.iter().position(|r| r.layer == 3 && r.expert == 6).unwrap();
    edit_manifest(dir.path(), |v| v["experts"]["records"][n]["hash"] = hash.into());
    let model = engine::load_container(dir.path(), &opts()).unwrap();
    let e = error_of(model.experts.expert(3, 6), "an infinite scale was accepted");
    assert!(
        e.contains("layer 3 expert 6") && e.contains("down.scales") && e.contains("NaN or infinity"),
        "{e}"
    );
}
