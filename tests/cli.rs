//! The `picchio` binary as a user runs it: stdout carries only generated IDs; bad input
//! gets a clear message and a non-zero exit.

mod common;

use std::process::{Command, Output};

use common::{Reference, fixture, max_abs_diff};

fn picchio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().expect("run picchio")
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
    let out = picchio(&["generate", "--ids", "0 5 17 999", "-n", "8"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout_ids(&out).len(), 8);
}

#[test]
fn reproduces_transformers_greedy_tokens() {
    for name in ["tiny-f32", "tiny-mxfp4"] {
        let dir = fixture(name);
        let r = Reference::load(&dir);
        let prompt = dir.join("prompt.ids");
        let out = picchio(&[
            "generate",
            "-m",
            dir.to_str().unwrap(),
            "--ids-file",
            prompt.to_str().unwrap(),
            "-n",
            "32",
        ]);
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
    let out = picchio(&[
        "generate",
        "--ids-file",
        prompt.to_str().unwrap(),
        "-n",
        "2",
        "--logits-out",
        npy.to_str().unwrap(),
    ]);
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
    let out = picchio(&["generate", "--ids", "1 2 1000", "-n", "3"]);
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
    let out = picchio(&["generate", "--ids-file", prompt.to_str().unwrap(), "--ctx", "10"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let e = stderr(&out);
    assert!(e.contains("context full") && e.contains("capacity is 10"), "{e}");
}

#[test]
fn generation_stops_cleanly_when_the_context_fills() {
    let out = picchio(&["generate", "--ids", "1 2 3", "-n", "20", "--ctx", "8"]);
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
