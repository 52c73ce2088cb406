//! Slots in the HTTP server (issue 17): concurrent clients, streaming and not, each get
//! exactly what they get alone (CPU); a client that goes away does not disturb the others;
//! prefix reuse works per slot; requests beyond the slots queue and are served.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::http::{get_text, listener, metric, open_stream, post, stream};
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

fn server(dir: &Path, parallel: usize) -> ServerHandle {
    let model = engine::open(dir, &OpenOptions { ctx: 512, ..Default::default() }).unwrap();
    let runner =
        engine::cpu_runner(&model, &RunOptions { ctx: 512, max_batch: 16, ..Default::default() }).unwrap();
    let mut options = HttpOptions::new("tiny");
    options.parallel = parallel;
    serve(listener(), Session::new(runner), options).unwrap()
}

/// Request `i`: a raw completion or a chat turn, streaming or not, each with its own prompt
/// length and seed.
fn request(i: usize) -> (&'static str, Value, bool) {
    let words = "one two three four five six seven eight nine ten ".repeat(i % 4 + 1);
    let streaming = i % 2 == 1;
    if i.is_multiple_of(3) {
        let mut body = json!({"prompt": format!("{i}: {words}"), "max_tokens": 12 + i, "temperature": 1.0,
                              "seed": i, "stream": streaming});
        if streaming {
            body["stream_options"] = json!({"include_usage": true});
        }
        ("/v1/completions", body, streaming)
    } else {
        let body = json!({"messages": [{"role": "user", "content": format!("Question {i}: {words}")}],
                          "max_tokens": 10 + i, "temperature": 0.8, "seed": i, "stream": streaming,
                          "stream_options": {"include_usage": true}});
        if !streaming {
            let mut body = body;
            body.as_object_mut().unwrap().remove("stream_options");
            return ("/v1/chat/completions", body, false);
        }
        ("/v1/chat/completions", body, true)
    }
}

/// What a request got, however it was delivered: its text (content and reasoning, or the
/// raw text), finish reason and completion tokens.
#[derive(Debug, PartialEq, Eq)]
struct Got {
    text: String,
    reasoning: String,
    finish: String,
    completion_tokens: u64,
}

fn run(server: &ServerHandle, i: usize) -> Got {
    let (path, body, streaming) = request(i);
    if !streaming {
        let (status, v) = post(server, path, &body);
        assert_eq!(status, 200, "{v}");
        let choice = &v["choices"][0];
        let text = choice["text"].as_str().or(choice["message"]["content"].as_str()).unwrap_or("");
        return Got {
            text: text.to_string(),
            reasoning: choice["message"]["reasoning_content"].as_str().unwrap_or("").to_string(),
            finish: choice["finish_reason"].as_str().unwrap().to_string(),
            completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap(),
        };
    }
    let mut got =
        Got { text: String::new(), reasoning: String::new(), finish: String::new(), completion_tokens: 0 };
    for chunk in stream(server, path, &body) {
        if let Some(choice) = chunk["choices"].get(0) {
            let delta = &choice["delta"];
            got.text += choice["text"].as_str().or(delta["content"].as_str()).unwrap_or("");
            got.reasoning += delta["reasoning_content"].as_str().unwrap_or("");
            if let Some(f) = choice["finish_reason"].as_str() {
                got.finish = f.to_string();
            }
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            got.completion_tokens = n;
        }
    }
    got
}

/// Each request alone on a one-slot server, one after another.
fn alone(dir: &Path, requests: impl Iterator<Item = usize>) -> Vec<Got> {
    let server = server(dir, 1);
    requests.map(|i| run(&server, i)).collect()
}

fn concurrently(server: &ServerHandle, requests: &[usize]) -> Vec<Got> {
    std::thread::scope(|s| {
        let handles: Vec<_> = requests.iter().map(|&i| s.spawn(move || run(server, i))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn wait_idle(server: &ServerHandle) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.stats().busy && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn concurrent_clients_get_what_they_get_alone_and_extra_ones_queue() {
    let model = common::tiny_real_vocab();
    let requests: Vec<usize> = (0..6).collect();
    let expected = alone(model.path(), requests.iter().copied());
    assert!(expected.iter().all(|g| g.completion_tokens > 0));
    // Three slots for six requests: three queue, and every answer is the solo one.
    let server = server(model.path(), 3);
    assert_eq!(server.stats().slots, 3);
    let got = concurrently(&server, &requests);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, e, "request {i}");
    }
    wait_idle(&server);
    let stats = server.stats();
    assert_eq!((stats.completed, stats.queued, stats.active_slots), (6, 0, 0));
    assert!(
        stats.decode_step_rows > stats.decode_steps,
        "some steps batched several slots: {} rows in {} steps",
        stats.decode_step_rows,
        stats.decode_steps
    );
    let (status, text) = get_text(&server, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(metric(&text, "picchio_slots"), 3.0);
    assert_eq!(metric(&text, "picchio_active_slots"), 0.0);
    assert_eq!(metric(&text, "picchio_decode_steps_total"), stats.decode_steps as f64);
    assert!(metric(&text, "picchio_expert_requests_per_generated_token") > 0.0, "{text}");
}

#[test]
fn a_client_that_goes_away_does_not_disturb_the_others() {
    let model = common::tiny_real_vocab();
    let requests = [1usize, 2, 3];
    let expected = alone(model.path(), requests.iter().copied());
    let server = server(model.path(), 4);
    let endless = json!({"messages": [{"role": "user", "content": "Go on and on"}], "max_tokens": 400,
                         "temperature": 1.0, "seed": 9, "stream": true});
    let server = &server;
    let got = std::thread::scope(|s| {
        let leaver = s.spawn(|| {
            let mut events = open_stream(server, "/v1/chat/completions", &endless);
            // Read a few chunks, then hang up while the others run.
            for _ in 0..3 {
                events.next().expect("a chunk");
            }
        });
        let handles: Vec<_> = requests.iter().map(|&i| s.spawn(move || run(server, i))).collect();
        leaver.join().unwrap();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert_eq!(got, expected);
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.stats().cancelled != 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    wait_idle(server);
    let stats = server.stats();
    assert_eq!((stats.cancelled, stats.completed), (1, 3));
    // The slot the leaver used serves again.
    assert_eq!(run(server, 4), alone(model.path(), [4].into_iter()).remove(0));
}

#[test]
fn each_slot_reuses_its_own_conversation_prefix() {
    let model = common::tiny_real_vocab();
    let server = server(model.path(), 2);
    let first = |topic: &str| {
        json!({"messages": [{"role": "user", "content": format!("Tell me about {topic}, in a long and detailed way please")}],
               "max_tokens": 8, "seed": 1})
    };
    let follow_up = |topic: &str, reply: &Value| {
        json!({"messages": [
            {"role": "user", "content": format!("Tell me about {topic}, in a long and detailed way please")},
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"].clone()},
            {"role": "user", "content": "And more?"}], "max_tokens": 4, "seed": 2})
    };
    let topics = ["rivers", "mountains"];
    let replies: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> =
            topics.iter().map(|t| s.spawn(|| post(&server, "/v1/chat/completions", &first(t)).1)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Both follow-ups at once: each goes to the slot holding its conversation.
    let again: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = topics
            .iter()
            .zip(&replies)
            .map(|(t, r)| {
                let body = follow_up(t, r);
                let server = &server;
                s.spawn(move || post(server, "/v1/chat/completions", &body).1)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, v) in topics.iter().zip(&again) {
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(cached >= 20 && cached < prompt, "{t}: {cached} of {prompt} prompt tokens reused: {v}");
    }
    // And they match a fresh one-slot server that saw only that conversation.
    for (t, v) in topics.iter().zip(&again) {
        let fresh = server_one(model.path());
        let r = post(&fresh, "/v1/chat/completions", &first(t)).1;
        let w = post(&fresh, "/v1/chat/completions", &follow_up(t, &r)).1;
        assert_eq!(w["choices"][0]["message"], v["choices"][0]["message"], "{t}");
    }
}

fn server_one(dir: &Path) -> ServerHandle {
    server(dir, 1)
}
