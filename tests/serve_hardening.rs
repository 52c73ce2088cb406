//! Hostile input to the servers: the stdio protocol keeps its session through invalid UTF-8,
//! over-long and blank lines (with bounded memory), and the HTTP server bounds the time to
//! send a request head and body, the connections, and the body size, refuses trailing bytes,
//! checks the API key before routing, and answers 503 while the model loads.
//!
//! Every wait is bounded; servers listen on 127.0.0.1 only.

#[path = "common/child.rs"]
mod child;
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use child::Picchio;
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::serve::http::{HttpOptions, ServerHandle};
use picchio::session::Session;
use serde_json::{Value, json};

fn session(dir: &std::path::Path, ctx: usize) -> Session {
    let model = engine::open(dir, &OpenOptions { ctx, ..Default::default() }).unwrap();
    Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx, max_batch: 64, ..Default::default() }).unwrap(),
    )
}

/// The reply lines of the in-process protocol over `script`.
fn talk(session: &mut Session, script: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    picchio::serve::stdio::serve(session, script, &mut out).unwrap();
    String::from_utf8(out).unwrap().lines().map(String::from).collect()
}

/// The `TOKEN` and `DONE` lines.
fn answers(lines: &[String]) -> Vec<String> {
    lines.iter().filter(|l| l.starts_with("TOKEN ") || l.starts_with("DONE ")).cloned().collect()
}

/// Reads the child's replies to one `TURN`: the lines up to `DONE` or `ERROR`.
fn turn_reply(p: &Picchio) -> Vec<String> {
    let mut lines = Vec::new();
    for _ in 0..10_000 {
        let line = p.expect_line();
        let end = line.starts_with("DONE") || line.starts_with("ERROR");
        lines.push(line);
        if end {
            return lines;
        }
    }
    panic!("no DONE after 10000 lines: {lines:?}");
}

const FIRST: &str = "TURN 4 0 0 1 0 3 200006 1 200008\n";

/// `pos` after [`FIRST`]: 3 IDs and 4 tokens.
const FIRST_POS: usize = 7;

fn second() -> String {
    format!("TURN 3 {FIRST_POS} 0.7 0.9 40 2 5 6 seed=3\n")
}

/// What a fresh session answers to [`FIRST`] then [`second`].
fn fresh_answers(dir: &std::path::Path, ctx: usize) -> Vec<String> {
    let mut s = session(dir, ctx);
    answers(&talk(&mut s, format!("{FIRST}{}", second()).as_bytes()))
}

fn stdio_child(dir: &std::path::Path, ctx: usize) -> Picchio {
    let ctx = ctx.to_string();
    let p = Picchio::start(&["-q", "serve", "--stdio", "--ctx", &ctx, "-m", dir.to_str().unwrap()]);
    let ready = p.expect_line();
    assert!(ready.starts_with(&format!("READY {ctx} ")), "{ready}");
    p
}

#[test]
fn an_invalid_utf8_line_is_an_error_and_the_session_goes_on() {
    let model = common::tiny_real_vocab();
    let expect = fresh_answers(model.path(), 64);
    let mut p = stdio_child(model.path(), 64);
    p.send(FIRST.as_bytes());
    let mut got = turn_reply(&p);
    p.send(b"TURN 1 0 0 1 0 1 \xff\xfe\n");
    let error = p.expect_line();
    assert!(error.starts_with("ERROR BAD_UTF8 0 line 2 "), "{error}");
    p.send(b"\xc3\x28 lone continuation\n");
    let error = p.expect_line();
    assert!(error.starts_with("ERROR BAD_UTF8 0 line 3 "), "{error}");
    // The cache still holds the first turn: the second continues it exactly.
    p.send(second().as_bytes());
    got.extend(turn_reply(&p));
    assert_eq!(answers(&got), expect);
    p.send(b"SHUTDOWN\n");
    assert_eq!(p.expect_line(), "BYE");
    assert!(p.wait(Duration::from_secs(30)).is_some_and(|s| s.success()));
}

#[test]
fn an_over_long_line_is_skipped_without_buffering_it() {
    let model = common::tiny_real_vocab();
    let expect = fresh_answers(model.path(), 64);
    let cap = picchio::serve::stdio::max_line_bytes(64);
    let line_len = 64usize << 20;
    assert!(cap < line_len / 100, "the cap {cap} for ctx 64 is far below the test line");
    let mut p = stdio_child(model.path(), 64);
    p.send(FIRST.as_bytes());
    let mut got = turn_reply(&p);
    let before = p.peak_rss();
    // A 64 MiB line: the start of a TURN, then IDs, sent 1 MiB at a time.
    let chunk = "1 ".repeat(1 << 19);
    p.send(b"TURN 1 0 0 1 0 99999999 ");
    for _ in 0..(line_len >> 20) {
        p.send(chunk.as_bytes());
    }
    p.send(b"\n");
    let error = p.expect_line();
    assert!(error.starts_with("ERROR LINE_TOO_LONG 0 line 2 "), "{error}");
    assert!(error.contains(&format!("limit of {cap} bytes")), "{error}");
    let grown = p.peak_rss().saturating_sub(before);
    assert!(grown < 8 << 20, "the peak RSS grew by {grown} bytes for a {line_len}-byte line");
    // A line just at the cap is read (and refused for what it says, not for its length).
    let mut at_cap = b"FROB ".to_vec();
    at_cap.resize(cap, b'x');
    at_cap.push(b'\n');
    p.send(&at_cap);
    let error = p.expect_line();
    assert!(error.starts_with("ERROR BAD_COMMAND 0 "), "{}", &error[..error.len().min(80)]);
    p.send(second().as_bytes());
    got.extend(turn_reply(&p));
    assert_eq!(answers(&got), expect);
    // End of input in the middle of an over-long line ends the session cleanly.
    p.send(&vec![b'y'; cap + 10]);
    p.close_stdin();
    let error = p.expect_line();
    assert!(error.starts_with("ERROR LINE_TOO_LONG 0 "), "{error}");
    assert!(p.wait(Duration::from_secs(30)).is_some_and(|s| s.success()));
}

#[test]
fn blank_lines_are_ignored() {
    let model = common::tiny_real_vocab();
    let mut plain = session(model.path(), 64);
    let expect = talk(&mut plain, format!("{FIRST}{}", second()).as_bytes());
    let mut s = session(model.path(), 64);
    let got = talk(&mut s, format!("\n  \n{FIRST}\t\r\n\r\n{}\n", second().replace('\n', "\r\n")).as_bytes());
    // No reply at all for a blank line (READY, then exactly the answers of the two turns).
    assert_eq!(got, expect);
}

// ---------------------------------------------------------------------------------------
// HTTP.

/// `picchio serve --http 127.0.0.1:0` with `flags`, once `/health` answers 200.
struct HttpChild {
    _process: Picchio,
    addr: SocketAddr,
    _model: tempfile::TempDir,
}

fn http_child(flags: &[&str]) -> HttpChild {
    let model = common::tiny_real_vocab();
    let mut args =
        vec!["-q", "serve", "--http", "127.0.0.1:0", "--ctx", "256", "-m", model.path().to_str().unwrap()];
    args.extend_from_slice(flags);
    let process = Picchio::start(&args);
    let line = process.expect_line();
    let addr: SocketAddr =
        line.strip_prefix("listening on http://").unwrap_or_else(|| panic!("{line}")).parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _) = request(addr, "GET", "/health", &[], b"");
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "/health answers {status} after 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    HttpChild { _process: process, addr, _model: model }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    stream.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    stream
}

/// The status and the body of the response read from `stream` until it closes.
fn read_response(stream: &mut TcpStream) -> (u16, Vec<u8>) {
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let status = status_of(&String::from_utf8_lossy(&raw));
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").map_or(raw.len(), |i| i + 4);
    (status, raw[split..].to_vec())
}

/// The status code of an HTTP/1.1 response that starts `text`.
fn status_of(text: &str) -> u16 {
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"))
}

/// One request on a new connection (`Connection: close`): the status and the body.
fn request(addr: SocketAddr, method: &str, path: &str, headers: &[&str], body: &[u8]) -> (u16, Vec<u8>) {
    let mut stream = connect(addr);
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    let _ = stream.write_all(body);
    read_response(&mut stream)
}

fn json_of(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)))
}

/// Waits until the server closes `stream`; how long that took.
fn time_to_close(stream: &mut TcpStream) -> Duration {
    let start = Instant::now();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return start.elapsed(),
            Ok(_) => {}
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the connection stays open");
    }
}

fn hi(max_tokens: u32) -> String {
    json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}).to_string()
}

#[test]
fn a_half_sent_request_head_is_closed_after_the_header_timeout() {
    let server = http_child(&["--header-timeout", "1"]);
    // Half a request head.
    let mut half = connect(server.addr);
    half.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n").unwrap();
    // A connection that sends nothing.
    let mut silent = connect(server.addr);
    // An idle keep-alive connection after one answered request.
    let mut kept = connect(server.addr);
    kept.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    let mut first = [0u8; 12];
    kept.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    for (what, stream) in [("half-sent", &mut half), ("silent", &mut silent), ("idle keep-alive", &mut kept)]
    {
        let waited = time_to_close(stream);
        assert!(waited < Duration::from_secs(5), "the {what} connection closed after {waited:?}");
    }
    // The server still answers.
    assert_eq!(request(server.addr, "GET", "/health", &[], b"").0, 200);
}

/// A keep-alive connection that holds one of the server's connection slots: it has had one
/// request answered with 200 (a connection over the limit would get 503) and stays open. A
/// slot can still be held for a moment by a connection the client has already closed (such
/// as `http_child`'s readiness probe), so a refused attempt is retried, for up to 10 s.
fn hold_a_slot(addr: SocketAddr) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut stream = connect(addr);
        stream.write_all(format!("GET /health HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes()).unwrap();
        let status = read_one_response(&mut stream);
        if status == 200 {
            return stream;
        }
        assert!(Instant::now() < deadline, "no connection slot after 10 s (last answer {status})");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The status of one response read from a keep-alive `stream`: its head, then as many body
/// bytes as its `content-length` says, leaving the connection open.
fn read_one_response(stream: &mut TcpStream) -> u16 {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => raw.push(byte[0]),
            other => panic!("the response head ended early ({other:?}): {:?}", String::from_utf8_lossy(&raw)),
        }
    }
    let head = String::from_utf8_lossy(&raw);
    let status = status_of(&head);
    let head = head.to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap_or_else(|_| panic!("content-length in {head:?}")));
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).unwrap();
    status
}

#[test]
fn idle_connections_over_the_limit_do_not_block_real_requests() {
    // The idle connections hold their slots until this test closes them: a header timeout far
    // beyond the test's length, so that no refusal below can race it. (With 2 and then 6 s the
    // test failed on loaded CI machines: an idle connection timed out among the refusals and
    // a request got through. That the header timeout closes idle and half-sent connections is
    // `a_half_sent_request_head_is_closed_after_the_header_timeout`.) Each idle connection has
    // had a request answered, so all three slots are known to be theirs: a connection that
    // merely connects may be refused while the readiness probe still holds a slot, and then
    // requests get through, racing each other's slot release (a CI run saw a 200 among the
    // refusals that way).
    let server = http_child(&["--max-connections", "3", "--header-timeout", "120"]);
    let idle: Vec<TcpStream> = (0..3).map(|_| hold_a_slot(server.addr)).collect();
    // Beyond the limit, a real request gets a clean 503 at once, not a hang.
    let start = Instant::now();
    let (status, body) = request(server.addr, "GET", "/health", &[], b"");
    let took = start.elapsed();
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    assert!(json_of(&body)["error"]["message"].as_str().unwrap().contains("limit of 3 connections"));
    assert!(took < Duration::from_secs(2), "the refusal took {took:?}");
    // Many more: each refused cleanly.
    for _ in 0..20 {
        assert_eq!(request(server.addr, "GET", "/health", &[], b"").0, 503);
    }
    // Once the idle clients go away, their slots come back and real requests go through.
    drop(idle);
    // (A closed connection gives its slot back a moment after the client closes it.)
    let deadline = Instant::now() + Duration::from_secs(10);
    let answer = loop {
        let answer = request(server.addr, "POST", "/v1/chat/completions", &[], hi(2).as_bytes());
        if answer.0 != 503 || Instant::now() > deadline {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(answer.0, 200, "{}", String::from_utf8_lossy(&answer.1));
}

#[test]
fn a_body_over_the_limit_is_413() {
    let server = http_child(&["--max-body-mb", "1"]);
    let big = json!({"messages": [{"role": "user", "content": "a".repeat(3 << 19)}]}).to_string();
    let (status, body) = request(server.addr, "POST", "/v1/chat/completions", &[], big.as_bytes());
    assert_eq!(status, 413);
    let v = json_of(&body);
    assert_eq!(v["error"]["code"], "request_too_large");
    assert!(v["error"]["message"].as_str().unwrap().contains(&(1usize << 20).to_string()), "{v}");
    // Just under the limit is read (and answered for what it says).
    let ok = hi(1);
    assert_eq!(request(server.addr, "POST", "/v1/chat/completions", &[], ok.as_bytes()).0, 200);
}

#[test]
fn a_slow_body_is_408() {
    let server = http_child(&["--body-timeout", "1"]);
    let body = hi(1);
    let mut stream = connect(server.addr);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&body.as_bytes()[..5]).unwrap();
    let start = Instant::now();
    let (status, answer) = read_response(&mut stream);
    assert_eq!(status, 408, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(json_of(&answer)["error"]["code"], "request_timeout");
    let waited = start.elapsed();
    assert!(waited > Duration::from_millis(500) && waited < Duration::from_secs(5), "{waited:?}");
    // The whole body in time is fine.
    assert_eq!(request(server.addr, "POST", "/v1/chat/completions", &[], body.as_bytes()).0, 200);
}

#[test]
fn trailing_bytes_after_the_json_are_400() {
    let server = http_child(&[]);
    let good = hi(1);
    for tail in [" x", "}", "{}", "\u{0}", ", 1", " []"] {
        let body = format!("{good}{tail}");
        let (status, answer) = request(server.addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
        assert_eq!(status, 400, "{body:?}");
        let v = json_of(&answer);
        assert!(v["error"]["message"].as_str().unwrap().contains("after the JSON value"), "{v}");
    }
    // Whitespace after the value is fine.
    let body = format!("{good} \r\n\t");
    assert_eq!(request(server.addr, "POST", "/v1/chat/completions", &[], body.as_bytes()).0, 200);
}

#[test]
fn the_api_key_is_checked_before_routing() {
    let server = http_child(&["--api-key", "k1"]);
    let key = ["authorization: Bearer k1"];
    for (method, path) in
        [("GET", "/v1/nothing"), ("GET", "/nothing"), ("POST", "/v1/models"), ("GET", "/health/")]
    {
        let (status, body) = request(server.addr, method, path, &[], b"");
        assert_eq!(status, 401, "{method} {path}");
        assert_eq!(json_of(&body)["error"]["code"], "invalid_api_key");
        assert_eq!(request(server.addr, method, path, &["authorization: Bearer nope"], b"").0, 401);
    }
    assert_eq!(request(server.addr, "GET", "/v1/nothing", &key, b"").0, 404);
    assert_eq!(request(server.addr, "POST", "/v1/models", &key, b"").0, 405);
    assert_eq!(request(server.addr, "GET", "/health", &[], b"").0, 200, "/health needs no key");
}

#[test]
fn health_is_503_while_the_model_loads() {
    let model = common::tiny_real_vocab();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut options = HttpOptions::new("tiny");
    options.api_key = Some("k1".into());
    let mut server: ServerHandle = picchio::serve::http::start(listener, options).unwrap();
    let addr = server.local_addr();
    assert!(!server.is_ready());
    let key = ["authorization: Bearer k1"];
    let (status, body) = request(addr, "GET", "/health", &[], b"");
    assert_eq!(status, 503);
    assert_eq!(json_of(&body), json!({"status": "loading", "model": "tiny"}));
    let (status, body) = request(addr, "POST", "/v1/chat/completions", &key, hi(1).as_bytes());
    assert_eq!(status, 503);
    assert!(json_of(&body)["error"]["message"].as_str().unwrap().contains("loading"));
    assert_eq!(request(addr, "GET", "/v1/models", &key, b"").0, 503);
    assert_eq!(request(addr, "GET", "/v1/nothing", &[], b"").0, 401, "the key comes first");

    server.attach(session(model.path(), 256)).unwrap();
    assert!(server.is_ready());
    let (status, body) = request(addr, "GET", "/health", &[], b"");
    assert_eq!(status, 200);
    assert_eq!(
        (json_of(&body)["status"].as_str(), json_of(&body)["context_length"].as_u64()),
        (Some("ok"), Some(256))
    );
    let (status, body) = request(addr, "POST", "/v1/chat/completions", &key, hi(2).as_bytes());
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(server.attach(session(model.path(), 256)).is_err(), "one session per server");
    server.shutdown();
}

#[test]
fn out_of_range_options_are_refused() {
    let listener = || std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    type Setter = fn(&mut HttpOptions);
    let cases: [(&str, Setter); 4] = [
        ("max_connections", |o| o.max_connections = 0),
        ("header_timeout", |o| o.header_timeout = Duration::ZERO),
        ("body_timeout", |o| o.body_timeout = Duration::ZERO),
        ("max_body_bytes", |o| o.max_body_bytes = 0),
    ];
    for (name, set) in cases {
        let mut options = HttpOptions::new("m");
        set(&mut options);
        let e = picchio::serve::http::start(listener(), options)
            .err()
            .unwrap_or_else(|| panic!("{name} accepted"));
        assert!(e.to_string().contains(name), "{e}");
    }
    // And on the command line.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["serve", "--http", "127.0.0.1:0", "--max-connections", "0", "-m", "/nonexistent"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-connections"));
}
