//! Sampling and output controls over HTTP, through a real HTTP client: stop strings held
//! back across stream chunks, log probabilities in both APIs and both modes, `logit_bias`
//! (its checks and its effect), and `seed`.
//!
//! The scripted runner writes fixed Harmony replies (logits 40 for the scripted token, 0
//! for every other), so texts and log probabilities are known exactly; the tiny random model
//! with the real vocabulary runs the real engine and sampler.

mod common;

use std::path::Path;
use std::time::Duration;

use common::http::{listener, ok, post};
use common::scripted::{ANSWER, REASONING, Scripted};
use picchio::chat::Tokenizer;
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

fn scripted_server() -> ServerHandle {
    let session = Session::new(Box::new(Scripted::new(4096, Duration::ZERO)));
    serve(listener(), session, HttpOptions::new("scripted")).unwrap()
}

fn real_server(dir: &Path) -> ServerHandle {
    let ctx = 256;
    let model = engine::open(dir, &OpenOptions { ctx, ..Default::default() }).unwrap();
    let runner =
        engine::cpu_runner(&model, &RunOptions { ctx, max_batch: 64, ..Default::default() }).unwrap();
    serve(listener(), Session::new(runner), HttpOptions::new("tiny")).unwrap()
}

/// The JSON events of `body` streamed (`"stream": true` added), `[DONE]` left out.
fn stream(server: &ServerHandle, path: &str, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    common::http::events(server, path, &body)
}

fn user(text: &str) -> Value {
    json!({"messages": [{"role": "user", "content": text}], "temperature": 0})
}

/// The content deltas of a chat stream, the reasoning, and the finish reason.
fn chat_stream(server: &ServerHandle, body: &Value) -> (Vec<String>, String, String) {
    let mut content = Vec::new();
    let mut reasoning = String::new();
    let mut finish = String::new();
    for chunk in stream(server, "/v1/chat/completions", body) {
        let choice = &chunk["choices"][0];
        if let Some(t) = choice["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
            content.push(t.to_string());
        }
        if let Some(t) = choice["delta"]["reasoning_content"].as_str() {
            reasoning.push_str(t);
        }
        if let Some(r) = choice["finish_reason"].as_str() {
            finish = r.to_string();
        }
    }
    (content, reasoning, finish)
}

#[test]
fn a_stop_string_split_across_chunks_is_never_sent() {
    // "m the s" spans the tokens of " from", " the" and " scripted".
    let stop = "m the s";
    let at = ANSWER.find(stop).unwrap();
    let tokenizer = Tokenizer::new();
    let pieces: Vec<String> =
        tokenizer.encode(ANSWER).iter().map(|&t| tokenizer.token_str(t).unwrap()).collect();
    assert!(pieces.iter().all(|p| !p.contains(stop)), "the stop string must span tokens: {pieces:?}");

    let mut body = user("Hi");
    body["stop"] = json!(["never", stop]);
    let v = ok(&scripted_server(), "/v1/chat/completions", &body);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["content"], ANSWER[..at]);
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["reasoning_content"], REASONING, "reasoning is not cut");

    let (content, reasoning, finish) = chat_stream(&scripted_server(), &body);
    assert_eq!(content.concat(), ANSWER[..at], "the stream says what the JSON answer says");
    assert!(content.len() > 1, "the answer came in pieces: {content:?}");
    assert!(content.iter().all(|piece| !piece.contains(stop)), "{content:?}");
    assert_eq!((reasoning.as_str(), finish.as_str()), (REASONING, "stop"));

    // A stop string in the reasoning only ("about") cuts nothing; text held back because it
    // could have started a stop string ("model" of "model?") is sent when it cannot.
    let mut body = user("Hi");
    body["stop"] = json!(["about", "model?"]);
    let v = ok(&scripted_server(), "/v1/chat/completions", &body);
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (content, reasoning, _) = chat_stream(&scripted_server(), &body);
    assert_eq!((content.concat().as_str(), reasoning.as_str()), (ANSWER, REASONING));

    // A stop string at the very start of the answer leaves it empty; the usage counts the
    // tokens generated up to the one that completed it.
    let mut body = user("Hi");
    body["stop"] = json!("Hello");
    let v = ok(&scripted_server(), "/v1/chat/completions", &body);
    assert_eq!(v["choices"][0]["message"]["content"], "");
    let (content, _, finish) = chat_stream(&scripted_server(), &body);
    assert_eq!((content.len(), finish.as_str()), (0, "stop"));
}

/// The `(token, logprob, bytes, top)` of a logprobs entry, checking its shape.
fn entry(e: &Value, top: usize) -> (String, f64, Vec<u8>, Vec<(String, f64)>) {
    let token = e["token"].as_str().unwrap().to_string();
    let logprob = e["logprob"].as_f64().unwrap();
    let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
    let alternatives: Vec<(String, f64)> = e["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            assert!(a["bytes"].is_array());
            (a["token"].as_str().unwrap().to_string(), a["logprob"].as_f64().unwrap())
        })
        .collect();
    assert_eq!(alternatives.len(), top);
    (token, logprob, bytes, alternatives)
}

/// Checks entries for the scripted answer: its tokens in order, each almost certain (logit
/// 40 against 0: log p = -(V-1) e^-40), the runner-up 40 nats below.
fn check_scripted(entries: &[Value], top: usize) {
    let tokenizer = Tokenizer::new();
    let want: Vec<String> =
        tokenizer.encode(ANSWER).iter().map(|&t| tokenizer.token_str(t).unwrap()).collect();
    let mut text = String::new();
    let mut bytes = Vec::new();
    for e in entries {
        let (token, logprob, b, alternatives) = entry(e, top);
        assert!((-1e-6..=0.0).contains(&logprob), "{logprob}");
        if top > 0 {
            assert_eq!(alternatives[0].0, token, "the picked token is the most likely");
            assert!((alternatives[1].1 - (-40.0)).abs() < 1e-3, "{alternatives:?}");
        }
        text.push_str(&token);
        bytes.extend(b);
    }
    assert_eq!(entries.len(), want.len(), "one entry per content token, no headers or control tokens");
    assert_eq!(text, ANSWER);
    assert_eq!(bytes, ANSWER.as_bytes());
}

#[test]
fn chat_logprobs_have_openai_s_shape_in_both_modes() {
    let mut body = user("Hi");
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let v = ok(&scripted_server(), "/v1/chat/completions", &body);
    let logprobs = &v["choices"][0]["logprobs"];
    assert!(logprobs["refusal"].is_null());
    check_scripted(logprobs["content"].as_array().unwrap(), 2);

    let chunks = stream(&scripted_server(), "/v1/chat/completions", &body);
    let mut entries = Vec::new();
    for c in &chunks {
        let choice = &c["choices"][0];
        match choice["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
            Some(text) => {
                let these = choice["logprobs"]["content"].as_array().unwrap();
                let joined: String = these.iter().map(|e| e["token"].as_str().unwrap()).collect();
                assert_eq!(joined, text, "each chunk carries its own tokens");
                entries.extend(these.iter().cloned());
            }
            None => assert!(choice["logprobs"].is_null(), "{c}"),
        }
    }
    check_scripted(&entries, 2);

    // Without top_logprobs the entries have no alternatives; without logprobs, null.
    let mut body = user("Hi");
    body["logprobs"] = json!(true);
    let v = ok(&scripted_server(), "/v1/chat/completions", &body);
    check_scripted(v["choices"][0]["logprobs"]["content"].as_array().unwrap(), 0);
    let v = ok(&scripted_server(), "/v1/chat/completions", &user("Hi"));
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[test]
fn responses_logprobs_are_in_the_output_text_and_its_deltas() {
    let body = json!({"input": "Hi", "temperature": 0, "top_logprobs": 3});
    let v = ok(&scripted_server(), "/v1/responses", &body);
    let message = v["output"].as_array().unwrap().iter().find(|i| i["type"] == "message").unwrap();
    check_scripted(message["content"][0]["logprobs"].as_array().unwrap(), 3);
    let reasoning = v["output"].as_array().unwrap().iter().find(|i| i["type"] == "reasoning").unwrap();
    assert!(reasoning["content"][0].get("logprobs").is_none(), "reasoning has no log probabilities");

    let events = stream(&scripted_server(), "/v1/responses", &body);
    let mut entries = Vec::new();
    for e in events.iter().filter(|e| e["type"] == "response.output_text.delta") {
        entries.extend(e["logprobs"].as_array().unwrap().iter().cloned());
    }
    check_scripted(&entries, 3);
    let done = events.iter().find(|e| e["type"] == "response.output_text.done").unwrap();
    check_scripted(done["logprobs"].as_array().unwrap(), 3);

    // OpenAI's way of asking: include.
    let body = json!({"input": "Hi", "temperature": 0, "include": ["message.output_text.logprobs"]});
    let v = ok(&scripted_server(), "/v1/responses", &body);
    let message = v["output"].as_array().unwrap().iter().find(|i| i["type"] == "message").unwrap();
    check_scripted(message["content"][0]["logprobs"].as_array().unwrap(), 0);
    let (status, e) = post(&scripted_server(), "/v1/responses", &json!({"input": "Hi", "top_logprobs": 21}));
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("top_logprobs")));
}

#[test]
fn logit_bias_is_checked_and_applied() {
    let server = scripted_server();
    for (bias, why) in [
        (json!({"abc": 1}), "not a token ID"),
        (json!({"201088": 1}), "outside the vocabulary"),
        (json!({"7": -101}), "from -100 to 100"),
    ] {
        let mut body = user("Hi");
        body["logit_bias"] = bias.clone();
        let (status, v) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "logit_bias");
        let message = v["error"]["message"].as_str().unwrap();
        let key = bias.as_object().unwrap().keys().next().unwrap().clone();
        assert!(message.contains(&format!("{key:?}")) && message.contains(why), "{message}");
    }
    assert_eq!(server.stats().prompt_tokens, 0, "refused before the engine");

    // On the real engine, greedy: +100 forces a token, -100 forbids the greedy choice.
    let model = common::tiny_real_vocab();
    let server = real_server(model.path());
    let tokens = |extra: Value| -> Vec<u64> {
        let mut body = user("Hello");
        body["max_tokens"] = json!(4);
        body["return_token_ids"] = json!(true);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let v = ok(&server, "/v1/chat/completions", &body);
        serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap()
    };
    let greedy = tokens(json!({}));
    assert_eq!(tokens(json!({"logit_bias": {"1000": 100}})), [1000; 4]);
    let first = greedy[0].to_string();
    let avoided = tokens(json!({"logit_bias": {first.clone(): -100}}));
    assert!(!avoided.contains(&greedy[0]), "{avoided:?} holds {first}");
}

#[test]
fn the_same_seed_gives_the_same_tokens() {
    let model = common::tiny_real_vocab();
    let server = real_server(model.path());
    let run = |server: &ServerHandle, seed: u64| -> Value {
        let body = json!({"messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 1.0,
                          "seed": seed, "max_tokens": 8, "return_token_ids": true});
        ok(server, "/v1/chat/completions", &body)["choices"][0]["token_ids"].clone()
    };
    let a = run(&server, 42);
    assert_eq!(a.as_array().unwrap().len(), 8);
    assert_eq!(run(&server, 42), a, "the same server, the prompt reused from the cache");
    assert_eq!(run(&real_server(model.path()), 42), a, "a fresh server");
    assert_ne!(run(&server, 43), a, "another seed");
}
