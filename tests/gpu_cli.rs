//! The GPU through the `picchio` binary: `devices`, `generate --device gpu` (with
//! `--stats` and `--verify`) on the pinned adapter, the output head split across storage
//! bindings on the real 201088-token vocabulary, `bench --device gpu`, `--device auto`'s
//! CPU fallback line, and a clear error when the requested API has no adapter.

mod common;

use std::process::{Command, Output};

use common::fixture;
use common::gpu::gpu_options;

fn picchio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().expect("run picchio")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ids(out: &Output) -> Vec<u32> {
    text(&out.stdout).split_whitespace().map(|w| w.parse().unwrap()).collect()
}

/// With `WGPU_BACKEND=vulkan`, the GPU lines of `--stats` must name a Vulkan adapter.
fn assert_ran_on_pinned_gpu(stderr: &str) {
    let line = stderr
        .lines()
        .find(|l| l.trim_start().starts_with("gpu: "))
        .unwrap_or_else(|| panic!("no gpu line:\n{stderr}"));
    if std::env::var("WGPU_BACKEND").is_ok_and(|v| v.eq_ignore_ascii_case("vulkan")) {
        assert!(line.contains("(Vulkan,"), "not on Vulkan: {line}");
    }
}

#[test]
fn devices_lists_the_adapter_with_limits_and_features() {
    let Some(_) = gpu_options("devices") else { return };
    let out = picchio(&["devices"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    for want in [
        "backend ",
        "type ",
        "max_storage_buffer_binding_size",
        "max_compute_workgroup_size_x",
        "SHADER_F16",
        "SUBGROUP",
        "key/value cache: --kv-cache f32",
    ] {
        assert!(s.contains(want), "missing {want}:\n{s}");
    }
    if std::env::var("WGPU_BACKEND").is_ok_and(|v| v.eq_ignore_ascii_case("vulkan")) {
        assert!(s.contains("backend Vulkan"), "{s}");
    }
}

#[test]
fn generate_on_the_gpu_matches_the_cpu_with_stats_and_verify() {
    let Some(_) = gpu_options("generate") else { return };
    let cache = tempfile::tempdir().unwrap();
    let prompt = fixture("tiny-f32").join("prompt.ids");
    let base = [
        "generate",
        "--ids-file",
        prompt.to_str().unwrap(),
        "-n",
        "32",
        "--cache-dir",
        cache.path().to_str().unwrap(),
    ];
    let cpu = picchio(&[&base[..], &["--device", "cpu"]].concat());
    assert!(cpu.status.success(), "{}", text(&cpu.stderr));
    let gpu = picchio(&[&base[..], &["--device", "gpu", "--stats", "--verify"]].concat());
    let err = text(&gpu.stderr);
    assert!(gpu.status.success(), "{err}");
    assert_eq!(ids(&gpu), ids(&cpu));
    assert_ran_on_pinned_gpu(&err);
    assert!(err.contains("1.00 readbacks and "), "{err}");
    assert!(err.contains("verify: top-1 identical to the CPU oracle at all 72 positions"), "{err}");
    // The prompt's experts ran grouped: each expert of a layer's union read once, fewer
    // passes than (row, expert) pairs.
    let line = err.lines().find(|l| l.contains("prefill experts:")).unwrap_or_else(|| panic!("{err}"));
    let n: Vec<u64> = line.split(' ').filter_map(|w| w.parse().ok()).collect();
    assert!(n.len() == 2 && 0 < n[0] && n[0] < n[1], "{line}");
    // Partial residency: the routing is read back per layer and predicted.
    let small = picchio(&[&base[..], &["--device", "gpu", "--stats", "--vram-gb", "0.000001"]].concat());
    let err = text(&small.stderr);
    assert!(small.status.success(), "{err}");
    assert_eq!(ids(&small), ids(&cpu));
    assert!(err.contains("routing prediction (router L+1"), "{err}");
    // ... and the experts outside VRAM are computed on the CPU: the per-token line says how
    // many on each side, the bytes over the bus, the busy time and the waits, none on uploads.
    let line =
        err.lines().find(|l| l.contains("per decoded token: experts")).unwrap_or_else(|| panic!("{err}"));
    assert!(number_before(line, "on the CPU") > 0.0, "{line}");
    assert!(number_before(line, "KiB over the bus") > 0.0, "{line}");
    assert!(line.contains("ms on uploads (0 layers waited)"), "{line}");
    // An f16 key/value cache: the same tokens, verified, and the caches' line says f16 at
    // half the bytes (tiny-f32: 4 layers x keys and values x 96 values x 2 bytes a position).
    let f16 =
        picchio(&[&base[..], &["--device", "gpu", "--kv-cache", "f16", "--stats", "--verify"]].concat());
    let err = text(&f16.stderr);
    assert!(f16.status.success(), "{err}");
    assert_eq!(ids(&f16), ids(&cpu));
    assert!(err.contains("; f16 KV cache;"), "{err}");
    assert!(
        err.contains("key/value caches in VRAM: 1 x ")
            && err.contains(", f16: 1536 bytes a position over 4 layers)"),
        "{err}"
    );
    assert!(err.contains("verify: top-1 identical to the CPU oracle at all 72 positions"), "{err}");
    let f32 = picchio(&[&base[..], &["--device", "gpu", "--stats"]].concat());
    let err = text(&f32.stderr);
    assert!(
        err.contains("; f32 KV cache;") && err.contains(", f32: 3072 bytes a position over 4 layers)"),
        "{err}"
    );
    // The CPU keeps f32: asking it for f16 is an error, not a silent f32 cache.
    let cpu16 = picchio(&[&base[..], &["--device", "cpu", "--kv-cache", "f16"]].concat());
    assert!(!cpu16.status.success());
    assert!(text(&cpu16.stderr).contains("--kv-cache f16 is a GPU option"), "{}", text(&cpu16.stderr));
}

#[test]
fn the_real_vocabulary_head_is_split_across_bindings() {
    let Some(_) = gpu_options("head split") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("synth");
    let m = model.to_str().unwrap();
    let out = picchio(&[
        "synth",
        m,
        "--shape",
        "tiny",
        "--hidden",
        "192",
        "--layers",
        "2",
        "--experts",
        "4",
        "--top-k",
        "2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let cache = tmp.path().join("cache");
    // F32 head: 201088 x 192 x 4 bytes = 147 MiB, over lavapipe's 128 MiB binding limit.
    let args = [
        "generate",
        "-m",
        m,
        "--ids",
        "0 17 199998 200005 42",
        "-n",
        "3",
        "--device",
        "gpu",
        "--dense",
        "f32",
        "--verify",
        "--stats",
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    let out = picchio(&args);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(ids(&out).len(), 3);
    assert_ran_on_pinned_gpu(&err);
    let blocks = err
        .lines()
        .find_map(|l| l.split("output head in ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no head line:\n{err}"));
    assert!(blocks >= 2 || !err.contains("binding limit 128 MiB"), "head in {blocks} block(s):\n{err}");
    assert!(err.contains("verify: top-1 identical"), "{err}");
    // The INT8 head (default formats), split by a lowered binding limit.
    let args = [
        "generate",
        "-m",
        m,
        "--ids",
        "5 6 7",
        "-n",
        "3",
        "--device",
        "gpu",
        "--verify",
        "--stats",
        "--gpu-max-binding-mb",
        "8",
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    let out = picchio(&args);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("output head in 5 row block(s)"), "{err}");
}

#[test]
fn bench_runs_on_the_gpu() {
    let Some(_) = gpu_options("bench") else { return };
    let cache = tempfile::tempdir().unwrap();
    let out = picchio(&[
        "bench",
        "--device",
        "gpu",
        "--prompt",
        "8",
        "--gen",
        "4",
        "--cache-dir",
        cache.path().to_str().unwrap(),
    ]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(s.contains("backend  gpu ") && s.contains("decode"), "{s}");
    assert!(!s.contains("GPU: none"), "{s}");
    assert!(s.contains("device per decoded token (") && s.contains(" per layer "), "{s}");
}

/// Parses the number before `unit` in `line` (e.g. "17.0" of "17.0 per layer").
fn number_before(line: &str, unit: &str) -> f64 {
    let head = line.split(unit).next().unwrap_or_else(|| panic!("no {unit:?} in {line}"));
    head.split_whitespace()
        .last()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("{unit:?} in {line}"))
}

/// `bench --device gpu` reports what the device was asked per decoded token, in its table
/// and its JSON, and the figures add up: dispatches per token = per layer x layers + head
/// (+ any before the layers), bytes read back cover the logits. Counted, never assumed: the
/// values themselves change as kernels are fused or the readback shrinks.
#[test]
fn bench_reports_device_work_per_decoded_token() {
    let Some(_) = gpu_options("bench device counters") else { return };
    let cache = tempfile::tempdir().unwrap();
    let c = cache.path().to_str().unwrap();
    let base = ["bench", "--device", "gpu", "--prompt", "8", "--gen", "5", "--no-routing", "--cache-dir", c];
    let out = picchio(&[&base[..], &["--json"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench --json is JSON");
    let d = &doc["device_decode"];
    let num = |k: &str| d[k].as_f64().unwrap_or_else(|| panic!("no {k} in {d}"));
    let layers = d["layers"].as_u64().unwrap() as usize;
    assert_eq!(layers, 4, "the tiny fixture has 4 layers: {d}");
    // 5 tokens: the first comes from the prompt's logits, 4 decode steps compute logits and
    // the last token is only stored.
    assert_eq!((d["steps"].as_u64(), d["steps_without_logits"].as_u64()), (Some(4), Some(1)), "{d}");
    let each: Vec<f64> =
        d["dispatches_per_layer_each"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(each.len(), layers);
    assert!(each.iter().all(|&n| n >= 1.0), "every layer dispatches: {d}");
    let per_layer = num("dispatches_per_layer");
    assert!((per_layer - each.iter().sum::<f64>() / layers as f64).abs() < 1e-9, "{d}");
    assert!(num("head_dispatches_per_token") >= 1.0, "the head dispatches: {d}");
    let sum =
        per_layer * layers as f64 + num("head_dispatches_per_token") + num("other_dispatches_per_token");
    assert!(
        (num("dispatches_per_token") - sum).abs() < 1e-9,
        "per token {} != {sum}: {d}",
        num("dispatches_per_token")
    );
    assert!(num("submissions_per_token") >= 1.0, "{d}");
    assert!(num("readbacks_per_token") >= 1.0, "a token waits at least for its logits: {d}");
    assert!(num("readback_bytes_per_token") > 0.0, "{d}");
    let totals = &d["totals"];
    assert_eq!(totals["steps"], d["steps"]);
    // The same figures in the table.
    let out = picchio(&base);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let line = s.lines().find(|l| l.starts_with("device per decoded token")).unwrap_or_else(|| panic!("{s}"));
    assert!(line.contains(&format!("x {layers} layers")), "{line}");
    let (tok, lay, head) =
        (number_before(line, "dispatches ="), number_before(line, "per layer"), number_before(line, "head;"));
    assert!((tok - (lay * layers as f64 + head)).abs() < 0.11, "{line}");
    for want in ["submissions", "waits (readbacks)", "bytes read back"] {
        assert!(number_before(line, want) > 0.0, "{want}: {line}");
    }
    // Partial residency waits for each layer's routing: more readbacks per token.
    let out = picchio(&[&base[..], &["--json", "--vram-gb", "0.000001"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let small: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let waits = small["device_decode"]["readbacks_per_token"].as_f64().unwrap();
    assert!(waits > num("readbacks_per_token"), "{waits} vs {d}");
}

#[test]
fn auto_says_why_it_runs_on_the_cpu_and_gpu_mode_fails_clearly() {
    let Some(opts) = gpu_options("auto") else { return };
    let report = picchio::backend::gpu::probe(&opts).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let c = cache.path().to_str().unwrap();
    if report.is_software() {
        // Only a software adapter: auto stays on the CPU and says so in one line.
        let out = picchio(&["generate", "--ids", "1 2 3", "-n", "2", "--cache-dir", c]);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert_eq!(err.matches("running on the CPU").count(), 1, "{err}");
        assert!(err.contains("software"), "{err}");
    }
    // An API with no adapter here (Metal off Apple, DX12 off Windows): gpu mode is a clear
    // error, auto mode falls back.
    let api = if cfg!(target_vendor = "apple") { "dx12" } else { "metal" };
    let out = picchio(&[
        "generate",
        "--ids",
        "1 2 3",
        "-n",
        "2",
        "--device",
        "gpu",
        "--gpu-backend",
        api,
        "--cache-dir",
        c,
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("no GPU adapter"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let out = picchio(&["generate", "--ids", "1 2 3", "-n", "2", "--gpu-backend", api, "--cache-dir", c]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("running on the CPU"));
}

/// `bench-gpu --quick` runs every case through the backend's ops and reports, for each,
/// positive times, the bytes the op reads (as the shapes say) and a copy of as many bytes.
/// Speed is not asserted.
#[test]
fn bench_gpu_times_every_kernel_against_a_copy() {
    let Some(_) = gpu_options("bench-gpu") else { return };
    let out = picchio(&[
        "bench-gpu",
        "--quick",
        "--layers",
        "2",
        "--ctx",
        "64,200",
        "--reps",
        "3",
        "--case-seconds",
        "0.01",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench-gpu --json is JSON");
    assert_eq!(doc["quick"], true);
    let r = &doc["report"];
    assert!(["Timestamps", "WallClock"].contains(&r["clock"].as_str().unwrap()), "{r}");
    let cases = r["cases"].as_array().unwrap();
    let names: Vec<String> = cases
        .iter()
        .map(|c| format!("{} {}", c["case"].as_str().unwrap(), c["format"].as_str().unwrap()))
        .collect();
    for want in [
        "q bf16",
        "k bf16",
        "v bf16",
        "o bf16",
        "head bf16",
        "experts mxfp4",
        "attention f32 cache, ctx 64",
        "attention f32 cache, ctx 200",
        "q int8-row",
        "head int8-row",
        "experts int4-gs64",
        "q block bf16",
        "o block bf16",
        "q block int8-row",
    ] {
        assert!(names.iter().any(|n| n == want), "no {want:?} in {names:?}");
    }
    for c in cases {
        let calls = c["kernel"]["calls"].as_u64().unwrap();
        assert!((2..=3).contains(&calls), "{c}");
        assert_eq!(c["copy"]["calls"].as_u64(), Some(calls), "{c}");
        for k in ["kernel_bytes_per_s", "copy_bytes_per_s", "ratio"] {
            assert!(c[k].as_f64().unwrap() > 0.0, "{k}: {c}");
        }
    }
    let bytes = |case: &str, format: &str| {
        cases.iter().find(|c| c["case"] == case && c["format"] == format).unwrap()["bytes"].as_u64().unwrap()
    };
    // Quick shapes: hidden 576, 16 heads of 64 (q rows 1024), 4 KV heads of 64 (kv 256).
    assert_eq!(bytes("q", "bf16"), 1024 * 576 * 2 + 4 * 1024 + 4 * 576);
    assert_eq!(bytes("head", "int8-row"), 8192 * 576 + 4 * 8192 + 4 * 576);
    assert_eq!(bytes("attention", "f32 cache, ctx 200"), 2 * 200 * 256 * 4 + 1024 * 4 + 2 * 256 * 4);
    // A prompt block's product reads its weights once and all its tokens' inputs, tiled.
    assert_eq!(bytes("q block", "bf16"), 1024 * 576 * 2 + 4 * 1024 + 4 * 576 * 64);
    let block = cases.iter().find(|c| c["case"] == "q block").unwrap();
    assert_eq!(block["detail"], "[1024 x 576] x 64 tokens, tiled", "{block}");
    // The table says what it measured and on what.
    let out = picchio(&[
        "bench-gpu",
        "--quick",
        "--layers",
        "1",
        "--ctx",
        "64",
        "--reps",
        "2",
        "--case-seconds",
        "0.01",
        "--untiled",
    ]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(s.contains("QUICK shapes") && s.contains("copy GB/s") && s.contains("clock "), "{s}");
    // --untiled: the prompt blocks run the matrix-vector kernels, and the table says so.
    assert!(s.contains("x 64 tokens, matrix-vector kernels") && !s.contains("tiled\n"), "{s}");
    // Bad flags are errors, not panics.
    let out = picchio(&["bench-gpu", "--quick", "--case-seconds", "-1"]);
    assert!(!out.status.success() && !text(&out.stderr).contains("panicked"));
}
