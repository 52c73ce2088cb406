//! A `picchio` child process for the serve tests: its stdout read line by line on a thread,
//! so that every wait is bounded in time, and killed when dropped.
//!
//! Included with `#[path = "common/child.rs"] mod child;`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

/// A running `picchio` with piped stdin and stdout.
pub struct Picchio {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Picchio {
    /// Starts `picchio ARGS...` with stdin and stdout piped and stderr dropped.
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_picchio"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the picchio binary starts");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stdin = child.stdin.take();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Picchio { child, stdin, lines }
    }

    /// The process ID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next stdout line, waiting at most `timeout`; `None` at end of output or on timeout.
    pub fn line(&self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// The next stdout line; panics after 60 s or at end of output.
    pub fn expect_line(&self) -> String {
        self.line(Duration::from_secs(60)).expect("a line from picchio within 60 s")
    }

    /// Writes raw bytes to stdin.
    pub fn send(&mut self, bytes: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin is open");
        stdin.write_all(bytes).expect("picchio reads its stdin");
        stdin.flush().expect("picchio reads its stdin");
    }

    /// Closes stdin (end of input).
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Waits for the exit status, at most `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// The peak resident set (`VmHWM` of /proc/PID/status) in bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("/proc status");
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("a VmHWM line");
        let kb: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmHWM in kB");
        kb * 1024
    }
}

impl Drop for Picchio {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
