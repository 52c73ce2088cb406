//! The stdio line protocol on a tiny model with the real vocabulary: prefix reuse gives
//! exactly the tokens of a full re-prefill, bad requests get ERROR lines and leave the
//! session usable, and the binary speaks the protocol end to end.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::session::Session;

fn session(dir: &std::path::Path, ctx: usize) -> Session {
    let model = engine::open(dir, &OpenOptions { ctx, ..Default::default() }).unwrap();
    Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx, max_batch: 64, ..Default::default() }).unwrap(),
    )
}

/// Runs the protocol over `script` and returns the reply lines.
fn talk(session: &mut Session, script: &str) -> Vec<String> {
    let mut out = Vec::new();
    picchio::serve::stdio::serve(session, script.as_bytes(), &mut out).unwrap();
    String::from_utf8(out).unwrap().lines().map(String::from).collect()
}

fn tokens(lines: &[String]) -> Vec<u32> {
    lines.iter().filter_map(|l| l.strip_prefix("TOKEN ")).map(|t| t.parse().unwrap()).collect()
}

fn ids(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

#[test]
fn prefix_reuse_equals_full_reprefill() {
    let model = common::tiny_real_vocab();
    let prompt1 = [200006u32, 17360, 200008, 3575, 200007, 200006, 173781];
    let mut s = session(model.path(), 256);
    let first = talk(&mut s, &format!("TURN 6 0 0 1 0 {} {}\n", prompt1.len(), ids(&prompt1)));
    assert!(first[0].starts_with("READY 256 201088 200002 200012 199999"), "{first:?}");
    let t1 = tokens(&first);
    let done1 = first.last().unwrap();
    assert!(
        done1.starts_with("DONE ") && done1.ends_with(&format!(" {}", prompt1.len() + t1.len())),
        "{done1}"
    );

    // Second turn: keep everything cached, add new IDs.
    let new_ids = [200007u32, 200006, 1428, 200008, 99, 100];
    let keep = prompt1.len() + t1.len();
    let second =
        talk(&mut s, &format!("TURN 8 {keep} 0.7 0.9 40 {} {} seed=5\n", new_ids.len(), ids(&new_ids)));
    let t2 = tokens(&second);

    // The same history re-prefilled from scratch in a fresh session.
    let mut full: Vec<u32> = prompt1.to_vec();
    full.extend(&t1);
    full.extend(&new_ids);
    let mut fresh = session(model.path(), 256);
    let again = talk(&mut fresh, &format!("TURN 8 0 0.7 0.9 40 {} {} seed=5\n", full.len(), ids(&full)));
    assert_eq!(t2, tokens(&again), "prefix reuse diverged from a full re-prefill");
    assert!(!t2.is_empty());

    // Partial reuse: keep only part of the history and replace the rest.
    let keep = 3;
    let tail = [42u32, 43, 44];
    let third = talk(&mut s, &format!("TURN 5 {keep} 0 1 0 3 {}\n", ids(&tail)));
    let mut fresh = session(model.path(), 256);
    let mut redo = prompt1[..keep].to_vec();
    redo.extend(tail);
    let expect = talk(&mut fresh, &format!("TURN 5 0 0 1 0 {} {}\n", redo.len(), ids(&redo)));
    assert_eq!(tokens(&third), tokens(&expect));
}

#[test]
fn a_turn_with_no_ids_continues_where_the_last_one_stopped() {
    let model = common::tiny_real_vocab();
    let prompt = [200006u32, 17360, 200008, 3575, 200007, 200006, 173781];
    let mut s = session(model.path(), 256);
    let first = talk(&mut s, &format!("TURN 4 0 0 1 0 {} {}\n", prompt.len(), ids(&prompt)));
    let mut got = tokens(&first);
    assert!(first.last().unwrap().starts_with("DONE MAX_TOKENS 4 "), "{first:?}");
    let pos = prompt.len() + got.len();
    let more = talk(&mut s, &format!("TURN 3 {pos} 0 1 0 0\n"));
    assert!(more.last().unwrap().starts_with(&format!("DONE MAX_TOKENS 3 {}", pos + 3)), "{more:?}");
    got.extend(tokens(&more));

    // One turn of 7 tokens in a fresh session gives the same 7 tokens.
    let mut fresh = session(model.path(), 256);
    let whole = talk(&mut fresh, &format!("TURN 7 0 0 1 0 {} {}\n", prompt.len(), ids(&prompt)));
    assert_eq!(got, tokens(&whole));
}

#[test]
fn bad_requests_get_errors_and_the_next_turn_still_works() {
    let model = common::tiny_real_vocab();
    let mut s = session(model.path(), 32);
    let script = "TURN 3 0 0 1 0 2 5 6\n\
                  TURN 3 99 0 1 0 1 7\n\
                  TURN 3 0 0 1 0 40 "
        .to_string()
        + &ids(&[1; 40])
        + "\nFROB 1 2\n\
           TURN 3 0 0 1 0 2 5 201088\n\
           TURN 3 0 0 1 0 2 5 x\n\
           TURN 3 0 2.0 7 0 1 5\n\
           TURN 3 5 0 1 0 1 9\n";
    let lines = talk(&mut s, &script);
    let errors: Vec<&String> = lines.iter().filter(|l| l.starts_with("ERROR")).collect();
    let codes: Vec<&str> = errors.iter().map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(
        codes,
        ["KEEP_RANGE", "CONTEXT_FULL", "BAD_COMMAND", "BAD_ID", "BAD_ID", "BAD_ARGUMENT"],
        "{lines:?}"
    );
    assert!(errors.iter().all(|l| l.split_whitespace().nth(2) == Some("0")));
    // The last TURN (keep 5 of the first turn's 2 + 3 positions) ran after all the errors
    // and matches a fresh session given the same history.
    let dones: Vec<&String> = lines.iter().filter(|l| l.starts_with("DONE")).collect();
    assert_eq!(dones.len(), 2, "{lines:?}");
    let all_tokens = tokens(&lines);
    let (first, last) = all_tokens.split_at(3);
    let mut history = vec![5u32, 6];
    history.extend(first);
    history.push(9);
    let mut fresh = session(model.path(), 32);
    let expect = talk(&mut fresh, &format!("TURN 3 0 0 1 0 {} {}\n", history.len(), ids(&history)));
    assert_eq!(last, tokens(&expect).as_slice());
}

#[test]
fn the_binary_speaks_the_protocol() {
    let model = common::tiny_real_vocab();
    let mut child = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["-q", "serve", "--stdio", "--ctx", "64", "-m", model.path().to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("READY 64 201088"), "{line}");
    writeln!(stdin, "TURN 4 0 0 1 0 3 200006 1 200008").unwrap();
    let mut got = Vec::new();
    loop {
        line.clear();
        out.read_line(&mut line).unwrap();
        got.push(line.trim().to_string());
        if line.starts_with("DONE") || line.starts_with("ERROR") {
            break;
        }
    }
    assert!(got.last().unwrap().starts_with("DONE"), "{got:?}");
    writeln!(stdin, "SHUTDOWN").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "BYE");
    assert!(child.wait().unwrap().success());
}

/// The protocol with its input read ahead, in-process on the scripted runner (one position
/// per forward call, 10 ms each): the test writes requests into a pipe and reads the
/// replies from another.
struct Piped {
    requests: Option<std::io::PipeWriter>,
    replies: std::io::Lines<BufReader<std::io::PipeReader>>,
    server: std::thread::JoinHandle<()>,
}

impl Piped {
    fn start() -> Self {
        let runner =
            common::scripted::Scripted::new(4096, std::time::Duration::from_millis(10)).with_prefill_block(1);
        let (input, requests) = std::io::pipe().unwrap();
        let (replies, output) = std::io::pipe().unwrap();
        let server = std::thread::spawn(move || {
            let mut session = Session::new(Box::new(runner));
            picchio::serve::stdio::serve_cancellable(&mut session, BufReader::new(input), output).unwrap();
        });
        let mut p = Piped { requests: Some(requests), replies: BufReader::new(replies).lines(), server };
        assert!(p.reply().starts_with("READY 4096 "));
        p
    }

    fn send(&mut self, text: &str) {
        let w = self.requests.as_mut().unwrap();
        w.write_all(text.as_bytes()).unwrap();
        w.flush().unwrap();
    }

    fn reply(&mut self) -> String {
        self.replies.next().expect("a reply line").unwrap()
    }

    /// The `DONE` line of the turn in progress, skipping its `TOKEN` lines.
    fn done(&mut self) -> Vec<String> {
        loop {
            let line = self.reply();
            if line.starts_with("DONE ") {
                return line.split(' ').map(String::from).collect();
            }
            assert!(line.starts_with("TOKEN "), "{line}");
        }
    }
}

fn turn(max_new: usize, keep: usize, new: &[u32]) -> String {
    format!("TURN {max_new} {keep} 0 1 0 {} {}\n", new.len(), ids(new))
}

#[test]
fn cancel_stops_a_turn_between_prefill_blocks() {
    let mut p = Piped::start();
    let long = vec![1000u32; 300]; // 3 s of prefill
    let started = std::time::Instant::now();
    p.send(&turn(5, 0, &long));
    std::thread::sleep(std::time::Duration::from_millis(300));
    p.send("CANCEL\n");
    let done = p.done();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "the prefill ran on: {:?}",
        started.elapsed()
    );
    assert_eq!((done[1].as_str(), done[2].as_str()), ("CANCELLED", "0"), "{done:?}");
    let pos: usize = done[3].parse().unwrap();
    assert!(pos > 0 && pos < long.len(), "pos {pos}: the computed blocks stay cached");

    // The next turn keeps what was computed and sends the rest.
    p.send(&turn(3, pos, &long[pos..]));
    let done = p.done();
    assert_ne!(done[1], "CANCELLED", "{done:?}");
    let n: usize = done[2].parse().unwrap();
    assert_eq!(done[3], (long.len() + n).to_string());

    // A CANCEL with no turn running gets no reply; a turn queued behind another is
    // cancelled by the CANCEL that follows it, not the one before.
    p.send("CANCEL\n");
    p.send(&format!("{}{}CANCEL\n", turn(2, 0, &long[..20]), turn(2, 0, &long)));
    let first = p.done();
    assert_ne!(first[1], "CANCELLED", "{first:?}");
    let second = p.done();
    assert_eq!(second[1..], ["CANCELLED", "0", "1"], "stopped after its first block");
    p.send("SHUTDOWN\n");
    assert_eq!(p.reply(), "BYE");
    p.server.join().unwrap();
}

#[test]
fn closing_stdin_stops_a_turn_and_the_server() {
    let mut p = Piped::start();
    p.send(&turn(5, 0, &[1000u32; 300]));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let closed = std::time::Instant::now();
    p.requests = None;
    let done = p.done();
    assert_eq!(done[1], "CANCELLED", "{done:?}");
    p.server.join().unwrap();
    assert!(closed.elapsed() < std::time::Duration::from_secs(2), "{:?}", closed.elapsed());
}

#[test]
fn without_read_ahead_a_cancel_comes_after_its_turn() {
    let model = common::tiny_real_vocab();
    let mut s = session(model.path(), 256);
    let lines = talk(&mut s, &format!("{}CANCEL\nSHUTDOWN\n", turn(4, 0, &[1000, 1001, 1002])));
    assert_eq!(lines.len(), 1 + 4 + 1 + 1, "READY, 4 tokens, DONE, BYE and nothing for CANCEL: {lines:?}");
    assert!(lines[5].starts_with("DONE MAX_TOKENS 4 7"), "{lines:?}");
}

#[test]
fn bias_penalties_and_logprobs_options() {
    let model = common::tiny_real_vocab();
    let mut s = session(model.path(), 256);
    // +100 on token 1000 forces it; logprobs=2 adds its log probability and the top two.
    let lines = talk(&mut s, "TURN 3 0 0 1 0 2 17360 3575 bias=1000:100 logprobs=2 presence=0.5\n");
    let token_lines: Vec<&String> = lines.iter().filter(|l| l.starts_with("TOKEN ")).collect();
    assert_eq!(token_lines.len(), 3, "{lines:?}");
    for line in token_lines {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), 5, "{line}");
        assert_eq!(fields[1], "1000");
        let logprob: f32 = fields[2].parse().unwrap();
        assert!((-1e-3..=0.0).contains(&logprob), "{line}");
        assert_eq!(fields[3], format!("1000:{logprob}"), "the picked token is the most likely");
        let (_, second) = fields[4].split_once(':').unwrap();
        assert!(second.parse::<f32>().unwrap() < logprob - 50.0, "{line}");
    }
    assert!(lines.last().unwrap().starts_with("DONE MAX_TOKENS 3"), "{lines:?}");
    // A bias for a token outside the vocabulary is refused, and the session is unchanged.
    let pos = s.pos();
    let lines = talk(&mut s, "TURN 3 0 0 1 0 1 5 bias=201088:1\n");
    assert!(lines[1].starts_with("ERROR BAD_ID 0") && lines[1].contains("201088"), "{lines:?}");
    assert_eq!(s.pos(), pos);
}
