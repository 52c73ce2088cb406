//! Conversion hardening: an output that is, contains or aliases the source is refused
//! before anything is written; a resumed conversion re-checks what its state file claims;
//! two conversions cannot write one directory at once; an interrupted long item resumes
//! from its last finished chunk; non-finite weights and scales are refused with names.

mod common;

use std::collections::BTreeMap;
use std::fs::OpenOptions as FileOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{convert_fixture, fixture};
use picchio::format::container::convert::{ConvertHooks, convert_with_hooks};
use picchio::format::container::{
    ConvertOptions, DenseFormat, ExpertFormat, Formats, Manifest, convert, verify::verify,
};
use picchio::format::safetensors::Checkpoint;

const EXACT: Formats = Formats { experts: ExpertFormat::F32, dense: DenseFormat::F32 };
const DEFAULT: Formats = Formats { experts: ExpertFormat::Int4, dense: DenseFormat::Auto };

fn opts(formats: Formats, interrupt_after: Option<usize>) -> ConvertOptions {
    ConvertOptions { formats, progress: false, interrupt_after }
}

/// A copy of fixture `name` in a fresh temporary directory.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&fixture(name), tmp.path());
    tmp
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Every file of `dir` (not recursive) with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

fn picchio(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().unwrap()
}

/// Runs `picchio convert src out`; returns its stderr, asserting it failed.
fn cli_convert_fails(src: &Path, out: &Path) -> String {
    let o = picchio(&["convert".as_ref(), src.as_os_str(), out.as_os_str()]);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "convert {} {} succeeded: {stderr}", src.display(), out.display());
    stderr
}

fn assert_verifies(dir: &Path) {
    let v = verify(dir, &mut |_, _| {}).unwrap();
    assert!(v.mismatches.is_empty(), "{:?}", v.mismatches);
}

fn assert_same_data(a: &Path, b: &Path) {
    for file in ["dense.bin", "experts.bin"] {
        let x = std::fs::read(a.join(file)).unwrap();
        let y = std::fs::read(b.join(file)).unwrap();
        assert!(x == y, "{file} differs from an uninterrupted conversion");
    }
}

// ---- 1. aliasing -------------------------------------------------------------------

#[test]
fn converting_into_the_source_itself_is_refused_and_changes_nothing() {
    let src = copy_fixture("tiny-f32");
    let before = snapshot(src.path());
    let e = cli_convert_fails(src.path(), src.path());
    assert!(e.contains("is the source") || e.contains("source"), "{e}");
    assert_eq!(snapshot(src.path()), before, "the source changed");
    // Through the library, and spelled differently (a `.` component).
    let e = convert(src.path(), &src.path().join("."), &opts(DEFAULT, None)).unwrap_err().to_string();
    assert!(e.contains(&src.path().display().to_string()), "{e}");
    assert_eq!(snapshot(src.path()), before, "the source changed");
}

#[test]
fn converting_into_a_directory_inside_the_source_is_refused() {
    let src = copy_fixture("tiny-mxfp4");
    let before = snapshot(src.path());
    // Not existing yet: it must not even be created.
    let out = src.path().join("converted");
    let e = cli_convert_fails(src.path(), &out);
    assert!(e.contains("inside the source"), "{e}");
    assert!(!out.exists(), "the output directory was created");
    // Existing.
    std::fs::create_dir(&out).unwrap();
    let e = convert(src.path(), &out, &opts(DEFAULT, None)).unwrap_err().to_string();
    assert!(e.contains("inside the source"), "{e}");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "something was written");
    // Deeper and through `..`.
    let e = convert(src.path(), &out.join("a/../b/c"), &opts(DEFAULT, None)).unwrap_err().to_string();
    assert!(e.contains("inside the source"), "{e}");
    assert_eq!(snapshot(src.path()), before, "the source changed");
}

#[test]
fn converting_through_a_symlink_of_the_source_is_refused() {
    let src = copy_fixture("tiny-f32");
    let before = snapshot(src.path());
    let other = tempfile::tempdir().unwrap();
    let link = other.path().join("link");
    std::os::unix::fs::symlink(src.path(), &link).unwrap();
    // Output is a symlink to the source.
    let e = cli_convert_fails(src.path(), &link);
    assert!(e.contains("source"), "{e}");
    // Source reached through a symlink, output the real directory.
    let e = cli_convert_fails(&link, src.path());
    assert!(e.contains("source"), "{e}");
    // Output inside the source through the link.
    let e = cli_convert_fails(src.path(), &link.join("sub"));
    assert!(e.contains("inside the source"), "{e}");
    assert_eq!(snapshot(src.path()), before, "the source changed");
    assert!(!src.path().join("sub").exists());
}

#[test]
fn a_source_inside_the_output_is_refused() {
    let out = tempfile::tempdir().unwrap();
    let src = out.path().join("model");
    copy_dir(&fixture("tiny-f32"), &src);
    let before = snapshot(&src);
    let e = cli_convert_fails(&src, out.path());
    assert!(e.contains("inside the output"), "{e}");
    assert_eq!(snapshot(&src), before);
    assert!(!out.path().join("dense.bin").exists(), "something was written");
    assert!(!out.path().join("config.json").exists(), "something was written");
}

#[test]
fn the_engine_cache_conversion_goes_through_the_same_check() {
    let src = copy_fixture("tiny-f32");
    let before = snapshot(src.path());
    let o = picchio::engine::OpenOptions { cache_dir: Some(src.path().to_path_buf()), ..Default::default() };
    let e = match picchio::engine::open(src.path(), &o) {
        Ok(_) => panic!("a cache inside the source was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("inside the source"), "{e}");
    assert_eq!(snapshot(src.path()), before);
    assert_eq!(
        std::fs::read_dir(src.path()).unwrap().filter(|e| e.as_ref().unwrap().path().is_dir()).count(),
        0
    );
}

// ---- 2. resume re-checks its state ---------------------------------------------------

fn state_path(out: &Path) -> PathBuf {
    out.join("convert.state.json")
}

fn read_state(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(state_path(out)).unwrap()).unwrap()
}

fn done_keys(out: &Path) -> Vec<String> {
    read_state(out)["done"].as_object().unwrap().keys().cloned().collect()
}

#[test]
fn a_truncated_dense_file_is_redone_on_resume() {
    let src = fixture("tiny-mxfp4");
    let fresh = convert_fixture("tiny-mxfp4", DEFAULT);
    let out = tempfile::tempdir().unwrap();
    assert!(convert(&src, out.path(), &opts(DEFAULT, Some(30))).is_err());
    let dense = out.path().join("dense.bin");
    let len = std::fs::metadata(&dense).unwrap().len();
    FileOptions::new().write(true).open(&dense).unwrap().set_len(len / 3).unwrap();
    let r = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert!(r.resumed < 30, "every claimed item was trusted: {r:?}");
    assert_verifies(out.path());
    assert_same_data(out.path(), fresh.path());
}

#[test]
fn an_altered_expert_record_is_redone_on_resume() {
    let src = fixture("tiny-mxfp4");
    let fresh = convert_fixture("tiny-mxfp4", DEFAULT);
    let m = Manifest::read(fresh.path()).unwrap();
    let out = tempfile::tempdir().unwrap();
    // Stop before the last item, so at least one expert layer is done.
    let items = m.tensors.len() + 4;
    assert!(convert(&src, out.path(), &opts(DEFAULT, Some(items - 1))).is_err());
    let layer: usize = done_keys(out.path())
        .iter()
        .find_map(|k| k.strip_prefix("experts:").map(|l| l.parse().unwrap()))
        .expect("an expert layer is done");
    let rec = m.experts.records.iter().find(|r| r.layer == layer && r.expert == 5).unwrap();
    let f = FileOptions::new().read(true).write(true).open(out.path().join("experts.bin")).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, rec.offset + 17).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], rec.offset + 17).unwrap();
    drop(f);
    let r = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert_eq!(r.resumed, items - 2, "{r:?}");
    assert_verifies(out.path());
    assert_same_data(out.path(), fresh.path());
}

/// A state that claims every item done, with `hash` giving each part's or record's hash.
fn forge_state(out: &Path, m: &Manifest, hash: impl Fn(&str) -> String) {
    let mut s = read_state(out);
    let mut done = serde_json::Map::new();
    for t in &m.tensors {
        let hashes: Vec<String> = t.parts.iter().map(|p| hash(&p.hash)).collect();
        done.insert(format!("dense:{}", t.name), hashes.into());
    }
    for l in 0..4 {
        let hashes: Vec<String> =
            m.experts.records.iter().filter(|r| r.layer == l).map(|r| hash(&r.hash)).collect();
        done.insert(format!("experts:{l}"), hashes.into());
    }
    s["done"] = done.into();
    std::fs::write(state_path(out), serde_json::to_vec(&s).unwrap()).unwrap();
}

#[test]
fn a_forged_state_listing_every_item_is_redone() {
    let src = fixture("tiny-mxfp4");
    let fresh = convert_fixture("tiny-mxfp4", DEFAULT);
    let m = Manifest::read(fresh.path()).unwrap();
    // Made-up hashes, and then the true hashes of the finished container over files that
    // do not hold those bytes: both are caught by re-reading.
    for forged in [&(|_: &str| "0".repeat(64)) as &dyn Fn(&str) -> String, &|h: &str| h.to_string()] {
        let out = tempfile::tempdir().unwrap();
        assert!(convert(&src, out.path(), &opts(DEFAULT, Some(2))).is_err());
        forge_state(out.path(), &m, forged);
        let r = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
        assert!(r.resumed <= 2, "{r:?}");
        assert_verifies(out.path());
        assert_same_data(out.path(), fresh.path());
    }
}

#[test]
fn a_state_file_that_does_not_parse_restarts_from_scratch() {
    let src = fixture("tiny-f32");
    let fresh = convert_fixture("tiny-f32", DEFAULT);
    let out = tempfile::tempdir().unwrap();
    assert!(convert(&src, out.path(), &opts(DEFAULT, Some(20))).is_err());
    let text = std::fs::read(state_path(out.path())).unwrap();
    std::fs::write(state_path(out.path()), &text[..text.len() / 2]).unwrap();
    let r = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert_eq!(r.resumed, 0);
    assert_verifies(out.path());
    assert_same_data(out.path(), fresh.path());
}

#[test]
fn half_written_temporary_files_left_by_a_kill_are_harmless() {
    let src = fixture("tiny-f32");
    let fresh = convert_fixture("tiny-f32", DEFAULT);
    let out = tempfile::tempdir().unwrap();
    assert!(convert(&src, out.path(), &opts(DEFAULT, Some(20))).is_err());
    std::fs::write(out.path().join("convert.state.tmp"), b"{\"plan\": \"x\", \"do").unwrap();
    std::fs::write(out.path().join("manifest.tmp"), b"{\"format\": \"picchio\", ").unwrap();
    let r = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert_eq!(r.resumed, 20);
    assert_verifies(out.path());
    assert_same_data(out.path(), fresh.path());
    assert!(!out.path().join("convert.state.tmp").exists());
    assert!(!out.path().join("manifest.tmp").exists());
    // A stale manifest temporary beside a complete container changes nothing either.
    std::fs::write(out.path().join("manifest.tmp"), b"garbage").unwrap();
    let again = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert_eq!((again.converted, again.resumed), (0, 0));
    assert_verifies(out.path());
}

/// Takes the conversion lock of `out` as another process would, writing `pid` into it.
fn hold_lock(out: &Path, pid: u32) -> std::fs::File {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(out).unwrap();
    let mut f = FileOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(out.join("convert.lock"))
        .unwrap();
    // SAFETY: flock on a valid descriptor owned by `f`.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(rc, 0, "could not take the lock");
    write!(f, "{pid}").unwrap();
    f
}

#[test]
fn a_second_conversion_is_refused_while_the_first_holds_the_lock() {
    let src = fixture("tiny-mxfp4");
    let out = tempfile::tempdir().unwrap();
    let lock = hold_lock(out.path(), 424242);
    let e = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap_err().to_string();
    assert!(e.contains("another conversion is writing"), "{e}");
    assert!(e.contains("pid 424242"), "{e}");
    assert!(e.contains(&out.path().display().to_string()), "{e}");
    let stderr = cli_convert_fails(&src, out.path());
    assert!(stderr.contains("another conversion is writing"), "{stderr}");
    assert!(!out.path().join("dense.bin").exists(), "the refused run wrote data");
    // Released (as when the holder dies): the conversion runs.
    drop(lock);
    convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert_verifies(out.path());
}

fn hooks(chunk_bytes: usize, interrupt_after_chunks: Option<usize>) -> ConvertHooks {
    ConvertHooks { chunk_bytes: Some(chunk_bytes), interrupt_after_chunks }
}

#[test]
fn an_interruption_inside_a_long_tensor_resumes_from_its_last_chunk() {
    // tiny-f32's first item is lm_head, F32 [1000, 64]: 16 KiB chunks are 64 rows, so it
    // spans 16 chunks.
    let src = fixture("tiny-f32");
    let fresh = convert_fixture("tiny-f32", DEFAULT);
    let out = tempfile::tempdir().unwrap();
    let e =
        convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(16 << 10, Some(3))).unwrap_err();
    assert!(e.to_string().contains("interrupted after 3 chunks"), "{e}");
    let s = read_state(out.path());
    assert!(s["done"].as_object().unwrap().is_empty(), "{s}");
    assert_eq!(s["partial"]["key"], "dense:lm_head.weight");
    assert_eq!(s["partial"]["steps"].as_array().unwrap().len(), 3);
    assert_eq!(s["partial"]["steps"][2]["end"], 192);
    // The resumed run keeps the three chunks, with another chunk size even.
    let r = convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(40 << 10, None)).unwrap();
    assert_eq!((r.resumed, r.resumed_steps, r.redone), (0, 3, 0), "{r:?}");
    assert_verifies(out.path());
    assert_same_data(out.path(), fresh.path());
}

#[test]
fn an_altered_chunk_of_a_part_done_tensor_is_redone() {
    let src = fixture("tiny-f32");
    let fresh = convert_fixture("tiny-f32", DEFAULT);
    let m = Manifest::read(fresh.path()).unwrap();
    let head = m.tensors.iter().find(|t| t.name == "lm_head.weight").unwrap();
    let out = tempfile::tempdir().unwrap();
    assert!(convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(16 << 10, Some(4))).is_err());
    // Row 100 (chunk 1) of the INT8 codes.
    let f = FileOptions::new().write(true).open(out.path().join("dense.bin")).unwrap();
    f.write_all_at(&[0x55], head.parts[0].offset + 100 * 64).unwrap();
    drop(f);
    let r = convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(16 << 10, None)).unwrap();
    assert_eq!(r.resumed_steps, 1, "only chunk 0 precedes the altered one: {r:?}");
    assert_verifies(out.path());
    assert_same_data(out.path(), fresh.path());
}

#[test]
fn interrupting_after_every_chunk_and_expert_still_converts_exactly() {
    // 4 KiB chunks: every expert record (over 4 KiB) is a step of its layer, and the
    // embedding and head span many chunks. Each run stops after one step; the runs
    // together must give the container an uninterrupted run gives.
    for (name, formats) in [("tiny-mxfp4", DEFAULT), ("alt-f32", EXACT)] {
        let src = fixture(name);
        let fresh = convert_fixture(name, formats);
        let out = tempfile::tempdir().unwrap();
        let mut runs = 0;
        let mut resumed_steps = 0;
        loop {
            runs += 1;
            assert!(runs < 1000, "{name}: no progress");
            match convert_with_hooks(&src, out.path(), &opts(formats, None), &hooks(4 << 10, Some(1))) {
                Ok(_) => break,
                Err(e) => assert!(e.to_string().contains("interrupted after 1 chunks"), "{e}"),
            }
            // Every interrupted run leaves its finished step recorded.
            let s = read_state(out.path());
            assert!(s["partial"]["steps"].as_array().is_some_and(|a| !a.is_empty()), "{s}");
            resumed_steps += 1;
        }
        assert!(runs > 20 && resumed_steps == runs - 1, "{name}: only {runs} runs");
        assert_verifies(out.path());
        assert_same_data(out.path(), fresh.path());
    }
}

#[test]
fn an_interruption_inside_an_expert_layer_resumes_from_the_next_expert() {
    let src = fixture("tiny-mxfp4");
    let fresh = convert_fixture("tiny-mxfp4", DEFAULT);
    let out = tempfile::tempdir().unwrap();
    // Run until the partial item is an expert layer.
    let mut steps = None;
    for _ in 0..200 {
        assert!(
            convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(4 << 10, Some(1))).is_err()
        );
        let s = read_state(out.path());
        if s["partial"]["key"].as_str().is_some_and(|k| k.starts_with("experts:")) {
            steps = Some(s["partial"]["steps"].clone());
            break;
        }
    }
    let steps = steps.expect("an expert layer was interrupted");
    assert_eq!(steps.as_array().unwrap().len(), 1);
    assert_eq!(steps[0]["end"], 1, "the first expert is recorded as done");
    let r = convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(4 << 10, None)).unwrap();
    assert_eq!(r.resumed_steps, 1, "{r:?}");
    assert_verifies(out.path());
    assert_same_data(out.path(), fresh.path());
}

// ---- 4. finite weights and scales ----------------------------------------------------

/// Overwrites bytes `at` bytes into tensor `name` of the checkpoint in `dir`.
fn patch(dir: &Path, name: &str, at: usize, bytes: &[u8]) {
    let (path, offset) = {
        let ck = Checkpoint::open(dir).unwrap();
        let t = ck.require(name).unwrap();
        assert!(at + bytes.len() <= t.len, "{name}: patch outside the tensor");
        (ck.shards()[t.shard].path.clone(), t.offset + at)
    };
    let f = FileOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(bytes, offset as u64).unwrap();
}

fn convert_error(src: &Path, formats: Formats) -> String {
    let out = tempfile::tempdir().unwrap();
    convert(src, out.path(), &opts(formats, None)).unwrap_err().to_string()
}

fn load_hf_error(src: &Path) -> String {
    match picchio::engine::load_hf(src) {
        Ok(_) => panic!("{} loaded with a non-finite value", src.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_nan_in_a_dense_weight_is_named() {
    // F32 source: row 2, column 5 of a projection.
    let src = copy_fixture("tiny-f32");
    let name = "model.layers.1.self_attn.q_proj.weight";
    patch(src.path(), name, (2 * 64 + 5) * 4, &f32::NAN.to_le_bytes());
    for e in [convert_error(src.path(), DEFAULT), convert_error(src.path(), EXACT), load_hf_error(src.path())]
    {
        assert!(
            e.contains(name) && e.contains("row 2") && e.contains("column 5") && e.contains("NaN"),
            "{e}"
        );
    }
    // BF16 source: the embedding (INT8 path) and an attention matrix kept as stored.
    let src = copy_fixture("tiny-mxfp4");
    let name = "model.embed_tokens.weight";
    patch(src.path(), name, (999 * 64 + 63) * 2, &0xff80u16.to_le_bytes()); // -inf
    for e in [convert_error(src.path(), DEFAULT), load_hf_error(src.path())] {
        assert!(
            e.contains(name) && e.contains("row 999") && e.contains("column 63") && e.contains("-inf"),
            "{e}"
        );
    }
    let src = copy_fixture("tiny-mxfp4");
    let name = "model.layers.3.self_attn.k_proj.weight";
    patch(src.path(), name, 7 * 2, &0x7fc1u16.to_le_bytes()); // NaN
    for e in [convert_error(src.path(), DEFAULT), load_hf_error(src.path())] {
        assert!(
            e.contains(name) && e.contains("row 0") && e.contains("column 7") && e.contains("NaN"),
            "{e}"
        );
    }
}

#[test]
fn an_inf_in_a_bias_or_expert_weight_is_named() {
    let src = copy_fixture("tiny-f32");
    let name = "model.layers.2.mlp.experts.down_proj_bias";
    patch(src.path(), name, (3 * 64 + 7) * 4, &f32::INFINITY.to_le_bytes());
    for e in [convert_error(src.path(), DEFAULT), convert_error(src.path(), EXACT), load_hf_error(src.path())]
    {
        assert!(
            e.contains(name) && e.contains("expert 3") && e.contains("element 7") && e.contains("inf"),
            "{e}"
        );
    }
    // A dense bias.
    let src = copy_fixture("tiny-f32");
    let name = "model.layers.0.mlp.router.bias";
    patch(src.path(), name, 4 * 4, &f32::NEG_INFINITY.to_le_bytes());
    for e in [convert_error(src.path(), DEFAULT), load_hf_error(src.path())] {
        assert!(e.contains(name) && e.contains("-inf"), "{e}");
    }
    // A dequantized expert weight: source layout [expert, input, output].
    let src = copy_fixture("tiny-f32");
    let name = "model.layers.1.mlp.experts.gate_up_proj";
    patch(src.path(), name, ((6 * 64 + 10) * 256 + 33) * 4, &f32::NAN.to_le_bytes());
    for e in [convert_error(src.path(), DEFAULT), convert_error(src.path(), EXACT), load_hf_error(src.path())]
    {
        assert!(e.contains(name) && e.contains("expert 6") && e.contains("NaN"), "{e}");
        assert!(e.contains("input 10") && e.contains("output 33"), "{e}");
    }
}

#[test]
fn an_mxfp4_scale_that_decodes_to_nan_or_inf_is_named() {
    // tiny-mxfp4 down_proj: [8 experts, 64 rows, 4 blocks]; blocks [8, 64, 4, 16].
    let name = "model.layers.2.mlp.experts.down_proj";
    let scale_at = (2 * 64 + 5) * 4 + 1; // expert 2, row 5, block 1
    // 255 is NaN in E8M0.
    let src = copy_fixture("tiny-mxfp4");
    patch(src.path(), &format!("{name}_scales"), scale_at, &[255]);
    for e in [convert_error(src.path(), DEFAULT), convert_error(src.path(), EXACT), load_hf_error(src.path())]
    {
        assert!(e.contains(&format!("{name}_scales")), "{e}");
        assert!(e.contains("layer 2") && e.contains("expert 2") && e.contains("row 5"), "{e}");
        assert!(e.contains("block 1") && e.contains("255") && e.contains("NaN"), "{e}");
    }
    // 254 (2^127) times the FP4 value 6.0 overflows f32.
    let src = copy_fixture("tiny-mxfp4");
    patch(src.path(), &format!("{name}_scales"), scale_at, &[254]);
    patch(src.path(), &format!("{name}_blocks"), scale_at * 16, &[0x07]); // element 32: 6.0
    for e in [convert_error(src.path(), DEFAULT), convert_error(src.path(), EXACT), load_hf_error(src.path())]
    {
        assert!(e.contains(&format!("{name}_scales")), "{e}");
        assert!(e.contains("layer 2") && e.contains("expert 2") && e.contains("row 5"), "{e}");
        assert!(e.contains("block 1") && e.contains("254") && e.contains("inf"), "{e}");
    }
}

#[test]
fn an_int4_scale_that_overflows_f16_is_named() {
    // 6.0 * 2^(150 - 127) = 5e7 is a finite f32, but the INT4 group scale 5e7 / 8 exceeds
    // the largest f16 (65504).
    let name = "model.layers.1.mlp.experts.gate_up_proj";
    let scale_at = (4 * 256 + 9) * 2; // expert 4, row 9, block 0
    let src = copy_fixture("tiny-mxfp4");
    patch(src.path(), &format!("{name}_scales"), scale_at, &[150]);
    patch(src.path(), &format!("{name}_blocks"), scale_at * 16, &[0x77]);
    let e = convert_error(src.path(), DEFAULT);
    assert!(
        e.contains(name) && e.contains("layer 1") && e.contains("expert 4") && e.contains("row 9"),
        "{e}"
    );
    assert!(e.contains("f16"), "{e}");
    // Exact formats store the value as it is, and the direct loader takes it.
    let out = tempfile::tempdir().unwrap();
    convert(src.path(), out.path(), &opts(EXACT, None)).unwrap();
    assert_verifies(out.path());
    picchio::engine::load_hf(src.path()).unwrap();
}

// ---- fuzz: damage while interrupted ---------------------------------------------------

/// Every part and record hash of a container, in manifest order.
fn all_hashes(dir: &Path) -> Vec<String> {
    let m = Manifest::read(dir).unwrap();
    let dense = m.tensors.iter().flat_map(|t| t.parts.iter().map(|p| p.hash.clone()));
    dense.chain(m.experts.records.iter().map(|r| r.hash.clone())).collect()
}

/// Flips or truncates `file` at a position chosen by `at` (kind 1: flip, 2: truncate).
fn damage(file: &Path, kind: u8, at: proptest::sample::Index, byte: u8) {
    let Ok(len) = std::fs::metadata(file).map(|m| m.len() as usize) else { return };
    if len == 0 || kind == 0 {
        return;
    }
    let i = at.index(len) as u64;
    let f = FileOptions::new().read(true).write(true).open(file).unwrap();
    if kind == 1 {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, i).unwrap();
        f.write_all_at(&[b[0] ^ byte.max(1)], i).unwrap();
    } else {
        f.set_len(i).unwrap();
    }
}

#[test]
fn any_damage_while_interrupted_ends_in_the_same_verified_container() {
    use proptest::prelude::*;
    use proptest::sample::Index;
    use proptest::test_runner::{Config, TestRunner};
    let src = fixture("tiny-mxfp4");
    let fresh = convert_fixture("tiny-mxfp4", DEFAULT);
    let want = all_hashes(fresh.path());
    let mut runner = TestRunner::new(Config { cases: 24, failure_persistence: None, ..Config::default() });
    let damage_kind = 0u8..3;
    let strategy = (
        1usize..25,
        (damage_kind.clone(), any::<Index>(), any::<u8>()),
        (damage_kind.clone(), any::<Index>(), any::<u8>()),
        (damage_kind, any::<Index>(), any::<u8>()),
    );
    runner
        .run(&strategy, |(chunks, on_state, on_dense, on_experts)| {
            let out = tempfile::tempdir().unwrap();
            let first =
                convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(16 << 10, Some(chunks)));
            prop_assume!(first.is_err());
            damage(&state_path(out.path()), on_state.0, on_state.1, on_state.2);
            damage(&out.path().join("dense.bin"), on_dense.0, on_dense.1, on_dense.2);
            damage(&out.path().join("experts.bin"), on_experts.0, on_experts.1, on_experts.2);
            let r = convert_with_hooks(&src, out.path(), &opts(DEFAULT, None), &hooks(16 << 10, None));
            prop_assert!(r.is_ok(), "{r:?}");
            let v = verify(out.path(), &mut |_, _| {}).unwrap();
            prop_assert!(v.mismatches.is_empty(), "{:?}", v.mismatches);
            prop_assert_eq!(all_hashes(out.path()), want.clone());
            Ok(())
        })
        .unwrap();
}

// ---- real kills ------------------------------------------------------------------------

#[test]
fn a_conversion_killed_at_any_moment_resumes_to_the_same_container() {
    use picchio::synth::{SynthShape, SynthSpec, synth};
    // The real 201088-token vocabulary: a 25 MB embedding and head.
    let src = tempfile::tempdir().unwrap();
    synth(&SynthSpec::of(SynthShape::Tiny), src.path(), &mut |_, _| {}).unwrap();
    let fresh = tempfile::tempdir().unwrap();
    convert(src.path(), fresh.path(), &opts(DEFAULT, None)).unwrap();
    let out = tempfile::tempdir().unwrap();
    // The CLI's default experts are `auto` (MXFP4 for this source); the library reference
    // above uses the INT4 formats, so the CLI is given them too.
    let args = [
        "-q".as_ref(),
        "convert".as_ref(),
        src.path().as_os_str(),
        out.path().as_os_str(),
        "--experts".as_ref(),
        "int4".as_ref(),
    ];
    let mut interrupted_with_progress = 0;
    for delay_ms in [30u64, 80, 130, 180, 230, 280, 330, 380] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        // SIGKILL: no cleanup runs; the lock must still be released and the state usable.
        let _ = child.kill();
        let status = child.wait().unwrap();
        if status.success() {
            break;
        }
        interrupted_with_progress += usize::from(state_path(out.path()).exists());
    }
    eprintln!("{interrupted_with_progress} kills left progress to resume from");
    let o = picchio(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!state_path(out.path()).exists());
    assert_verifies(out.path());
    assert_eq!(all_hashes(out.path()), all_hashes(fresh.path()));
}

/// A conversion killed after its manifest was renamed into place but before its state file
/// was removed leaves both; the loader refuses such a directory, and converting again
/// removes the stale state instead of leaving the container unusable.
#[test]
fn a_stale_state_beside_a_complete_manifest_is_removed_by_the_next_conversion() {
    let src = fixture("tiny-f32");
    let out = tempfile::tempdir().unwrap();
    convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    std::fs::write(state_path(out.path()), b"{\"plan\": \"stale\", \"done\": {}}").unwrap();
    let refused = picchio::format::container::Container::open(out.path()).err().expect("refused");
    assert!(refused.to_string().contains("convert.state.json"), "{refused}");
    let again = convert(&src, out.path(), &opts(DEFAULT, None)).unwrap();
    assert_eq!((again.converted, again.resumed), (0, 0));
    assert!(!state_path(out.path()).exists());
    picchio::format::container::Container::open(out.path()).unwrap();
    assert_verifies(out.path());
}
