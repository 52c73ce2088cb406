//! `picchio chat` driven through a pseudo-terminal: a question, a streamed answer, /stats,
//! a second turn reusing the cache, Ctrl-C stopping an answer (not the program), exit.

#![cfg(unix)]

mod common;

use std::time::Duration;

use expectrl::{Eof, Expect, Regex};

#[test]
fn chat_through_a_terminal() {
    let model = common::tiny_real_vocab();
    let cmd = format!(
        "{} -q chat -m {} --max-tokens 60 --seed 3 --ctx 2048",
        env!("CARGO_BIN_EXE_picchio"),
        model.path().display()
    );
    let mut p = expectrl::spawn(cmd).expect("spawn picchio chat in a pty");
    p.set_expect_timeout(Some(Duration::from_secs(60)));
    p.expect(">>> ").expect("first prompt");
    p.send_line("Hello, who are you?").unwrap();
    // The answer streams (this random model's output is shown as text), then the prompt
    // comes back.
    let turn = p.expect(">>> ").expect("prompt after the first answer");
    let answer = String::from_utf8_lossy(turn.before()).to_string();
    assert!(answer.trim().len() > 10, "no answer was streamed: {answer:?}");

    p.send_line("/stats").unwrap();
    p.expect(Regex(r"context: \d+ of 2048 positions used")).expect("/stats context line");
    p.expect(Regex(r"last turn: \d+ prompt tokens \(0 reused")).expect("/stats turn line");
    p.expect(">>> ").unwrap();

    p.send_line("And a second question?").unwrap();
    p.expect(">>> ").expect("prompt after the second answer");
    p.send_line("/stats").unwrap();
    let reused = p.expect(Regex(r"\((\d+) reused from the cache\)")).expect("/stats after the second turn");
    let n: usize = String::from_utf8_lossy(reused.matches().nth(1).unwrap()).parse().unwrap();
    assert!(n > 0, "the second turn reused nothing");
    p.expect(">>> ").unwrap();

    p.send_line("/exit").unwrap();
    p.expect(Eof).expect("exit");
}

#[test]
fn ctrl_c_stops_the_answer_not_the_program() {
    let model = common::tiny_real_vocab();
    let cmd = format!(
        "{} -q chat -m {} --max-tokens 3000 --seed 3 --ctx 4096",
        env!("CARGO_BIN_EXE_picchio"),
        model.path().display()
    );
    let mut p = expectrl::spawn(cmd).expect("spawn picchio chat in a pty");
    p.set_expect_timeout(Some(Duration::from_secs(120)));
    p.expect(">>> ").unwrap();
    p.send_line("Write something very long").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    p.send(expectrl::ControlCode::EndOfText).unwrap();
    p.expect("(stopped)").expect("Ctrl-C stops the answer");
    p.expect(">>> ").expect("the prompt returns after Ctrl-C");
    // Still usable: /stats answers and shows fewer than 3000 generated tokens.
    p.send_line("/stats").unwrap();
    let m = p.expect(Regex(r"(\d+) generated in")).unwrap();
    let n: usize = String::from_utf8_lossy(m.matches().nth(1).unwrap()).parse().unwrap();
    assert!(n < 3000, "the answer ran to the limit ({n} tokens)");
    p.send_line("/exit").unwrap();
    p.expect(Eof).expect("exit");
}
