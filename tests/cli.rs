//! The `picchio` binary as a user runs it: stdout carries only generated IDs; bad input
//! gets a clear message and a non-zero exit.

mod common;

use std::process::{Command, Output};

use common::{Reference, fixture, max_abs_diff};

fn picchio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().expect("run picchio")
}

/// Runs a model command with converted copies kept in a test's own cache directory.
fn picchio_cached(cache: &std::path::Path, args: &[&str]) -> Output {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--cache-dir", cache.to_str().unwrap()]);
    picchio(&all)
}

/// `picchio -q bench --device cpu --json --no-routing --no-hot-set -m MODEL ARGS` with the
/// conversion cache in `cache`; asserts success and returns the JSON report.
fn bench_json(cache: &std::path::Path, model: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["-q", "bench", "--device", "cpu", "--json", "--no-routing", "--no-hot-set"];
    all.extend(["-m", model.to_str().unwrap()]);
    all.extend(args);
    let out = picchio_cached(cache, &all);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn stdout_ids(out: &Output) -> Vec<u32> {
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .split_whitespace()
        .map(|w| w.parse().unwrap_or_else(|_| panic!("stdout holds `{w}`, not an ID")))
        .collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn default_model_prints_exactly_n_ids() {
    let cache = tempfile::tempdir().unwrap();
    let out = picchio_cached(cache.path(), &["generate", "--ids", "0 5 17 999", "-n", "8"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout_ids(&out).len(), 8);
}

/// With the exact formats (everything F32) the converted fixture reproduces Transformers.
#[test]
fn reproduces_transformers_greedy_tokens() {
    let cache = tempfile::tempdir().unwrap();
    for name in ["tiny-f32", "tiny-mxfp4"] {
        let dir = fixture(name);
        let r = Reference::load(&dir);
        let prompt = dir.join("prompt.ids");
        let (dir, prompt) = (dir.to_str().unwrap(), prompt.to_str().unwrap());
        let args =
            ["generate", "-m", dir, "--ids-file", prompt, "-n", "32", "--experts", "f32", "--dense", "f32"];
        let out = picchio_cached(cache.path(), &args);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout_ids(&out), r.greedy, "{name}");
    }
}

#[test]
fn logits_out_writes_prompt_logits() {
    let dir = fixture("tiny-f32");
    let r = Reference::load(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let npy = tmp.path().join("logits.npy");
    let prompt = dir.join("prompt.ids");
    let out = picchio_cached(
        tmp.path(),
        &[
            "generate",
            "--ids-file",
            prompt.to_str().unwrap(),
            "-n",
            "2",
            "--logits-out",
            npy.to_str().unwrap(),
            "--experts",
            "f32",
            "--dense",
            "f32",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout_ids(&out), r.greedy[..2]);
    let bytes = std::fs::read(&npy).unwrap();
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
    assert!(header.contains(&format!("'shape': ({}, 1000)", r.prompt.len())), "{header}");
    let data: Vec<f32> =
        bytes[10 + hlen..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert!(max_abs_diff(&data, &r.logits) < 1e-4);
}

#[test]
fn id_outside_vocabulary_is_refused() {
    let cache = tempfile::tempdir().unwrap();
    let out = picchio_cached(cache.path(), &["generate", "--ids", "1 2 1000", "-n", "3"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let e = stderr(&out);
    assert!(e.contains("token ID 1000") && e.contains("outside the vocabulary"), "{e}");
}

#[test]
fn unreadable_or_malformed_ids_file_is_named() {
    let out = picchio(&["generate", "--ids-file", "/nonexistent/prompt.ids"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("/nonexistent/prompt.ids"), "{}", stderr(&out));

    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.ids");
    std::fs::write(&bad, "1 2 3\n4 five 6\n").unwrap();
    let out = picchio(&["generate", "--ids-file", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("bad.ids: line 2: `five`"), "{e}");
}

#[test]
fn prompt_longer_than_context_is_refused() {
    let prompt = fixture("tiny-f32").join("prompt.ids");
    let cache = tempfile::tempdir().unwrap();
    let out =
        picchio_cached(cache.path(), &["generate", "--ids-file", prompt.to_str().unwrap(), "--ctx", "10"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let e = stderr(&out);
    assert!(e.contains("context full") && e.contains("capacity is 10"), "{e}");
}

#[test]
fn generation_stops_cleanly_when_the_context_fills() {
    let cache = tempfile::tempdir().unwrap();
    let out = picchio_cached(cache.path(), &["generate", "--ids", "1 2 3", "-n", "20", "--ctx", "8"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // 3 prompt positions + 5 generated (each consumed) fill the 8 positions.
    assert_eq!(stdout_ids(&out).len(), 5);
    assert!(stderr(&out).contains("context"), "{}", stderr(&out));
}

#[test]
fn missing_model_directory_is_named() {
    let out = picchio(&["generate", "-m", "/nonexistent/model", "--ids", "1"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("/nonexistent/model"), "{}", stderr(&out));
}

#[test]
fn checkpoint_is_converted_once_then_reused_and_reconverted_when_changed() {
    let cache = tempfile::tempdir().unwrap();
    let src = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("tiny-mxfp4")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), src.path().join(entry.file_name())).unwrap();
    }
    let args = ["generate", "-m", src.path().to_str().unwrap(), "--ids", "3 1 4 1 5", "-n", "4"];
    let first = picchio_cached(cache.path(), &args);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(stderr(&first).contains("converting"), "{}", stderr(&first));
    let second = picchio_cached(cache.path(), &args);
    assert!(second.status.success());
    assert!(!stderr(&second).contains("converting"), "{}", stderr(&second));
    assert_eq!(stdout_ids(&first), stdout_ids(&second));
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 1);
    // A changed source (here: one shard rewritten) gets its own conversion.
    let shard = src.path().join("model-00002-of-00003.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&shard, bytes).unwrap();
    let third = picchio_cached(cache.path(), &args);
    assert!(third.status.success());
    assert!(stderr(&third).contains("converting"), "{}", stderr(&third));
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 2);
}

#[test]
fn convert_then_verify_from_the_command_line() {
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("c");
    let r = picchio(&["convert", fixture("alt-mxfp4").to_str().unwrap(), target.to_str().unwrap()]);
    assert!(r.status.success(), "{}", stderr(&r));
    let v = picchio(&["verify", target.to_str().unwrap()]);
    assert!(v.status.success(), "{}", stderr(&v));
    assert!(stderr(&v).contains("all match"));
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(target.join("manifest.json")).unwrap()).unwrap();
    let rec = &m["experts"]["records"][7];
    let path = target.join("experts.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[rec["offset"].as_u64().unwrap() as usize + 1] ^= 0x80;
    std::fs::write(&path, bytes).unwrap();
    let v = picchio(&["verify", target.to_str().unwrap()]);
    assert!(!v.status.success());
    let e = stderr(&v);
    assert!(e.contains(&format!("BAD expert layer {} expert {}", rec["layer"], rec["expert"])), "{e}");
}

#[test]
fn stats_report_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let out = picchio_cached(
        cache.path(),
        &["generate", "--ids", "9 8 7", "-n", "3", "--stats", "--ram-gb", "0.0001"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let e = stderr(&out);
    assert!(e.contains("expert cache:") && e.contains("misses") && e.contains("disk wait"), "{e}");
}

#[test]
fn ctrl_c_stops_generate_p_during_the_prompt_with_a_message() {
    let model = common::tiny_real_vocab();
    // 20000 positions one at a time: about ten seconds of prefill on the tiny model.
    let prompt = "word ".repeat(20_000);
    let child = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["-q", "generate", "-m", model.path().to_str().unwrap(), "-p", &prompt])
        .args(["--prefill-block", "1", "--ctx", "32768", "--threads", "1", "-n", "4"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let sent = std::time::Instant::now();
    // SAFETY: kill(2) with a PID this test spawned and has not waited for yet.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    assert!(sent.elapsed() < std::time::Duration::from_secs(5), "took {:?} to stop", sent.elapsed());
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("interrupted: stopped while reading the prompt ("), "{err}");
    assert!(!err.contains("panicked") && !err.contains("Error"), "{err}");
}

#[test]
fn logit_bias_and_stop_flags_of_generate() {
    let cache = tempfile::tempdir().unwrap();
    // +100 forces token 5 at every step, greedy or not.
    for temperature in ["0", "1"] {
        let args = [
            "generate",
            "--ids",
            "0 17 42",
            "-n",
            "4",
            "--logit-bias",
            "5=100",
            "--temperature",
            temperature,
        ];
        let out = picchio_cached(cache.path(), &args);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout_ids(&out), [5, 5, 5, 5]);
    }
    // A bias for a token outside the vocabulary, out of range, or malformed is refused.
    let out = picchio_cached(cache.path(), &["generate", "--ids", "1 2", "--logit-bias", "1000=1"]);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(stderr(&out).contains("logit_bias names token 1000"), "{}", stderr(&out));
    let out = picchio_cached(cache.path(), &["generate", "--ids", "1 2", "--logit-bias", "5=-101"]);
    assert!(!out.status.success() && stderr(&out).contains("logit_bias"), "{}", stderr(&out));
    let out = picchio(&["generate", "--ids", "1 2", "--logit-bias", "5"]);
    assert!(!out.status.success() && stderr(&out).contains("ID=BIAS"), "{}", stderr(&out));
    // Stop strings need answer text: refused with raw token IDs.
    let out = picchio(&["generate", "--ids", "1 2", "--stop", "x"]);
    assert!(
        !out.status.success() && stderr(&out).contains("--stop applies to the answer of -p"),
        "{}",
        stderr(&out)
    );
}

/// `bench --predict` reaches the CPU backend (`off` predicts nothing, `early` and `late` are
/// scored in the JSON), `--no-prefetch` conflicts with an explicit `--predict`, and the JSON
/// carries the floor's record-pattern disk bandwidth (the faster of its measurements before
/// and after the timed phases) beside the sequential one.
#[test]
fn bench_predict_flag_and_both_disk_figures() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("tiny-mxfp4");
    let bench = |extra: &[&str]| {
        bench_json(cache.path(), &model, &[&["--prompt", "4", "--gen", "6"], extra].concat())
    };
    for predict in ["early", "late"] {
        let doc = bench(&["--predict", predict]);
        let d = &doc["decode"];
        let (predicted, right) = (d["predicted"].as_u64().unwrap(), d["predicted_right"].as_u64().unwrap());
        assert!(predicted > 0 && right <= predicted, "{predict}: {d}");
        let floor_bw = doc["disk_read_bandwidth_bytes_per_s"].as_f64().unwrap();
        let before = doc["disk_read_bandwidth_before_bytes_per_s"].as_f64().unwrap();
        let after = doc["disk_read_bandwidth_after_bytes_per_s"].as_f64().unwrap();
        assert!(before > 0.0 && after > 0.0, "{doc}");
        assert_eq!(floor_bw, before.max(after), "the floor takes the faster measurement: {doc}");
        assert!(doc["disk_sequential_bandwidth_bytes_per_s"].is_number(), "{doc}");
        let pattern = &doc["disk_read_pattern"];
        assert_eq!(pattern["request_bytes"], 2 << 20, "{pattern}");
        assert!(pattern["records"].as_u64().unwrap() > 0, "{pattern}");
    }
    for off in [&["--predict", "off"][..], &["--no-prefetch"][..]] {
        assert_eq!(bench(off)["decode"]["predicted"], 0, "{off:?}");
    }
    let out = picchio_cached(
        cache.path(),
        &["bench", "--predict", "late", "--no-prefetch", "-m", model.to_str().unwrap()],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--no-prefetch") && stderr(&out).contains("--predict"), "{}", stderr(&out));
}

/// `bench --warmup-prompt` warms up with the whole prompt, as llama-bench does: with the
/// cache cold (`--no-preload`) and large enough for everything, the timed prefill then reads
/// nothing, where after the default one-token warm-up it reads what the rest of the prompt
/// needs; `--no-warmup` conflicts with it.
#[test]
fn bench_warmup_prompt_leaves_the_prefill_nothing_to_read() {
    let cache = tempfile::tempdir().unwrap();
    let model = fixture("tiny-mxfp4");
    let prefill = |extra: &[&str]| {
        let args = [&["--prompt", "12", "--gen", "2", "--no-preload"], extra].concat();
        bench_json(cache.path(), &model, &args)["prefill"].clone()
    };
    let cold = prefill(&[]);
    assert!(cold["reads"].as_u64().unwrap() > 0, "{cold}");
    let warm = prefill(&["--warmup-prompt"]);
    assert_eq!(warm["reads"], 0, "{warm}");
    assert_eq!(warm["cache_hit_rate"], 1.0, "{warm}");
    let out = picchio_cached(
        cache.path(),
        &["bench", "--warmup-prompt", "--no-warmup", "-m", model.to_str().unwrap()],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--no-warmup"), "{}", stderr(&out));
}
