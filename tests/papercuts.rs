//! What a new user sees on stderr: no driver noise, no colour codes in a pipe, and errors
//! that say what to do.

mod common;

use std::process::{Command, Output};

use common::fixture;

fn picchio(args: &[&str], env_remove: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_picchio"));
    cmd.args(args);
    for k in env_remove {
        cmd.env_remove(k);
    }
    cmd.output().expect("run picchio")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_default_start_in_a_pipe_prints_no_driver_noise_and_no_colour() {
    // Without XDG_RUNTIME_DIR (a server, a container), Mesa used to print an error twice
    // while the GPU adapters were probed; logs in a pipe carried ANSI colour codes.
    let cache = tempfile::tempdir().unwrap();
    for quiet in [false, true] {
        let mut args =
            vec!["generate", "--ids", "1 2 3", "-n", "2", "--cache-dir", cache.path().to_str().unwrap()];
        if quiet {
            args.insert(0, "-q");
        }
        let out = picchio(&args, &["XDG_RUNTIME_DIR", "RUST_LOG"]);
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        assert!(!err.contains("XDG_RUNTIME_DIR"), "quiet {quiet}: {err}");
        assert!(!err.contains('\x1b'), "quiet {quiet}: colour codes in a pipe: {err:?}");
        if quiet {
            assert!(err.is_empty(), "-q printed: {err}");
        } else {
            assert!(err.contains("INFO"), "{err}");
        }
    }
}

#[test]
fn verify_on_a_checkpoint_says_convert_it_first() {
    let out = picchio(&["verify", fixture("tiny-f32").to_str().unwrap()], &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("is a Hugging Face checkpoint") && err.contains("picchio convert"), "{err}");
    assert_eq!(err.matches("manifest").count(), 1, "the cause is said once: {err}");
}

#[test]
fn a_missing_file_is_reported_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = picchio(&["verify", tmp.path().to_str().unwrap()], &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn synth_refuses_a_directory_that_is_not_empty() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("mine.txt"), "keep").unwrap();
    let out = picchio(&["synth", tmp.path().to_str().unwrap()], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("is not empty"), "{}", stderr(&out));
    let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["mine.txt"], "nothing was written");
}
