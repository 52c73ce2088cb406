//! A small HTTP client for the server tests: JSON posts and server-sent event streams.

use std::io::{BufRead, BufReader};
use std::time::Duration;

use picchio::serve::http::ServerHandle;
use serde_json::Value;

/// A listener on a free local port.
pub fn listener() -> std::net::TcpListener {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap()
}

/// An agent that reports error statuses as answers (not errors), with a 120 s limit.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// POSTs `body` as JSON to `path` and returns the status and the parsed answer.
pub fn post(server: &ServerHandle, path: &str, body: &Value) -> (u16, Value) {
    let mut resp = agent()
        .post(format!("{}{path}", server.url()))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

/// POSTs `body` as JSON to `path`, asserts a 200 and returns the parsed answer.
pub fn ok(server: &ServerHandle, path: &str, body: &Value) -> Value {
    let (status, v) = post(server, path, body);
    assert_eq!(status, 200, "{v}");
    v
}

/// GETs `path` and returns the status and the body text.
pub fn get_text(server: &ServerHandle, path: &str) -> (u16, String) {
    let mut resp = agent().get(format!("{}{path}", server.url())).call().unwrap();
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap())
}

/// Starts a streaming POST to `path` and returns a reader of its `data:` payloads (the
/// connection closes when the reader is dropped).
pub fn open_stream(server: &ServerHandle, path: &str, body: &Value) -> impl Iterator<Item = String> + use<> {
    let resp = agent()
        .post(format!("{}{path}", server.url()))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let lines = BufReader::new(resp.into_body().into_reader()).lines();
    lines.map_while(Result::ok).filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
}

/// A whole stream: the JSON chunks before `[DONE]` (which must come last).
pub fn stream(server: &ServerHandle, path: &str, body: &Value) -> Vec<Value> {
    let mut chunks = Vec::new();
    let mut done = false;
    for data in open_stream(server, path, body) {
        assert!(!done, "data after [DONE]: {data}");
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str::<Value>(&data).unwrap());
        }
    }
    assert!(done, "the stream did not end with [DONE]");
    chunks
}

/// The JSON payloads of a stream of either API, `[DONE]` left out (Chat Completions and
/// completions end with it; Responses streams end with their last event).
pub fn events(server: &ServerHandle, path: &str, body: &Value) -> Vec<Value> {
    open_stream(server, path, body)
        .take_while(|d| d != "[DONE]")
        .map(|d| serde_json::from_str(&d).unwrap_or_else(|e| panic!("not JSON ({e}): {d}")))
        .collect()
}

/// The value of the sample `name` (no labels) in a `/metrics` text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}
