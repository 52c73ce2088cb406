//! `POST /v1/completions` through a real HTTP client, on the scripted runner (which writes
//! a fixed Harmony reply whatever the prompt's format): raw text out to the stop token,
//! streaming equal to non-streaming, token-ID prompts, `echo`, special tokens, the
//! cache, cancellation, and the refusals.

mod common;

use std::time::{Duration, Instant};

use common::http::{self, listener};
use common::scripted::{DEFAULT_REPLY, ENDLESS_FILLER, Scripted};
use picchio::chat::Tokenizer;
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

fn server(capacity: usize) -> ServerHandle {
    let session = Session::new(Box::new(Scripted::new(capacity, Duration::ZERO)));
    serve(listener(), session, HttpOptions::new("s")).unwrap()
}

const PATH: &str = "/v1/completions";

fn post(server: &ServerHandle, body: &Value) -> (u16, Value) {
    http::post(server, PATH, body)
}

fn complete(server: &ServerHandle, body: &Value) -> Value {
    http::ok(server, PATH, body)
}

/// The `data:` payloads of a stream.
fn open_stream(server: &ServerHandle, body: &Value) -> impl Iterator<Item = String> {
    http::open_stream(server, PATH, body)
}

/// The JSON chunks of a stream, which must end with `[DONE]`.
fn stream(server: &ServerHandle, body: &Value) -> Vec<Value> {
    http::stream(server, PATH, body)
}

/// The reply the scripted runner writes, as text up to (not including) its stop token.
fn reply_text() -> String {
    DEFAULT_REPLY.strip_suffix("<|return|>").unwrap().to_string()
}

fn reply_tokens() -> Vec<u32> {
    Tokenizer::new().encode_with_special(DEFAULT_REPLY)
}

#[test]
fn a_completion_is_the_raw_text_to_the_stop_token() {
    let server = server(4096);
    let prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant";
    let v = complete(&server, &json!({"model": "x", "prompt": prompt, "max_tokens": 200, "temperature": 0}));
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert_eq!(v["model"], "s");
    let choice = &v["choices"][0];
    assert_eq!(choice["text"].as_str(), Some(reply_text().as_str()), "special tokens by name, no stop token");
    assert_eq!((choice["index"].as_u64(), choice["finish_reason"].as_str()), (Some(0), Some("stop")));
    assert!(choice["logprobs"].is_null());
    let tokenizer = Tokenizer::new();
    let prompt_ids = tokenizer.encode_with_special(prompt);
    assert_eq!(prompt_ids[0], tokenizer.special_id("<|start|>").unwrap(), "special strings are tokens");
    let usage = &v["usage"];
    assert_eq!(usage["prompt_tokens"].as_u64(), Some(prompt_ids.len() as u64));
    assert_eq!(
        usage["completion_tokens"].as_u64(),
        Some(reply_tokens().len() as u64),
        "the stop token counts"
    );
    assert_eq!(usage["total_tokens"].as_u64(), Some((prompt_ids.len() + reply_tokens().len()) as u64));

    // The same prompt as token IDs (and as a one-element list of them) is the same request;
    // the second time the cache holds all of it but the last token.
    for prompt in [json!(prompt_ids), json!([prompt_ids])] {
        let again =
            complete(&server, &json!({"prompt": prompt, "max_tokens": 200, "return_token_ids": true}));
        assert_eq!(again["choices"][0]["text"], v["choices"][0]["text"]);
        assert_eq!(again["usage"]["prompt_tokens"], usage["prompt_tokens"]);
        let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert_eq!(cached, prompt_ids.len() as u64 - 1, "{again}");
        assert_eq!(again["prompt_token_ids"], json!(prompt_ids));
        assert_eq!(again["choices"][0]["token_ids"], json!(reply_tokens()));
    }
}

#[test]
fn max_tokens_defaults_to_16_and_ends_with_length() {
    let server = server(4096);
    let v = complete(&server, &json!({"prompt": "Once upon a time"}));
    let tokens = reply_tokens();
    let tokenizer = Tokenizer::new();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(tokenizer.decode(&tokens[..16]).unwrap().as_str()));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 16);
}

#[test]
fn echo_special_tokens_and_skip_special_tokens() {
    let server = server(4096);
    let v = complete(&server, &json!({"prompt": "Once", "max_tokens": 200, "echo": true}));
    assert_eq!(v["choices"][0]["text"].as_str(), Some(format!("Once{}", reply_text()).as_str()));

    let tokenizer = Tokenizer::new();
    let plain: Vec<u32> = reply_tokens().into_iter().filter(|&t| !tokenizer.is_special(t)).collect();
    let v = complete(&server, &json!({"prompt": "Once", "max_tokens": 200, "skip_special_tokens": true}));
    assert_eq!(v["choices"][0]["text"].as_str(), Some(tokenizer.decode(&plain).unwrap().as_str()));

    // With "special_tokens": false the same text is ordinary characters: more tokens.
    let text = "<|start|>user";
    let special = complete(&server, &json!({"prompt": text, "max_tokens": 1}));
    let plain = complete(&server, &json!({"prompt": text, "max_tokens": 1, "special_tokens": false}));
    assert_eq!(
        special["usage"]["prompt_tokens"].as_u64(),
        Some(tokenizer.encode_with_special(text).len() as u64)
    );
    assert_eq!(plain["usage"]["prompt_tokens"].as_u64(), Some(tokenizer.encode(text).len() as u64));
    assert!(plain["usage"]["prompt_tokens"].as_u64() > special["usage"]["prompt_tokens"].as_u64());
}

#[test]
fn streaming_equals_non_streaming() {
    let server = server(4096);
    let body = json!({"prompt": "Tell me", "max_tokens": 200, "seed": 3, "echo": true});
    let whole = complete(&server, &body);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = stream(&server, &streamed);
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-"));
    assert_eq!(chunks[0]["choices"][0]["text"], "Tell me", "echo comes first");
    let mut text = String::new();
    let mut finish = None;
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!((c["id"].as_str(), c["object"].as_str()), (Some(id), Some("text_completion")), "{c}");
        if i + 1 == chunks.len() {
            assert_eq!(c["choices"], json!([]), "the usage chunk has no choice");
            for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                assert_eq!(c["usage"][key], whole["usage"][key], "{key}");
            }
            continue;
        }
        assert!(finish.is_none(), "a chunk after the finish reason: {c}");
        let choice = &c["choices"][0];
        text.push_str(choice["text"].as_str().unwrap());
        finish = choice["finish_reason"].as_str().map(str::to_string);
    }
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(finish.as_deref(), Some("stop"));

    // Without include_usage there is no usage chunk.
    streamed["stream_options"] = json!(null);
    let chunks = stream(&server, &streamed);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "{chunks:?}");
}

#[test]
fn bad_requests_are_refused_naming_the_field() {
    let server = server(64);
    let cases = [
        (json!({}), "prompt", None),
        (json!({"prompt": ""}), "prompt", None),
        (json!({"prompt": ["one", "two"]}), "prompt", Some("unsupported_parameter")),
        (json!({"prompt": [1, 2, 999_999]}), "prompt[2]", None),
        (json!({"prompt": "x", "suffix": "y"}), "suffix", Some("unsupported_parameter")),
        (json!({"prompt": "x", "stop": ["\n"]}), "stop", Some("unsupported_parameter")),
        (json!({"prompt": "x", "logprobs": 1}), "logprobs", Some("unsupported_parameter")),
        (json!({"prompt": "x", "n": 2}), "n", Some("unsupported_parameter")),
        (json!({"prompt": "x", "max_tokens": 0}), "max_tokens", None),
        (json!({"prompt": "x", "top_p": 0}), "top_p", None),
        (json!({"prompt": "word ".repeat(100)}), "prompt", Some("context_length_exceeded")),
    ];
    for (body, param, code) in cases {
        let (status, v) = post(&server, &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["param"].as_str(), Some(param), "{body}: {v}");
        assert_eq!(v["error"]["code"].as_str(), code, "{body}: {v}");
    }
    assert_eq!(server.stats().prompt_tokens, 0, "no refused request reached the engine");
}

#[test]
fn a_dropped_completion_stream_cancels_its_generation() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let session = Session::new(Box::new(Scripted::new(100_000, Duration::from_millis(5))));
    let server = serve(listener, session, HttpOptions::new("s")).unwrap();
    let body = json!({"prompt": "Sing forever", "stream": true, "max_tokens": 50_000});
    let mut data = open_stream(&server, &body);
    let mut fillers = 0;
    while fillers < 3 {
        let chunk: Value = serde_json::from_str(&data.next().unwrap()).unwrap();
        if chunk["choices"][0]["text"] == ENDLESS_FILLER {
            fillers += 1;
        }
    }
    drop(data);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.stats().cancelled != 1 || server.stats().busy {
        assert!(Instant::now() < deadline, "not cancelled: {:?}", server.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(server.stats().completion_tokens < 5_000);
    let v = complete(&server, &json!({"prompt": "Hi", "max_tokens": 3}));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

fn real_session(dir: &std::path::Path, ctx: usize) -> Session {
    use picchio::engine::{self, OpenOptions, RunOptions};
    let model = engine::open(dir, &OpenOptions { ctx, ..Default::default() }).unwrap();
    Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx, max_batch: 16, ..Default::default() }).unwrap(),
    )
}

#[test]
fn on_the_real_engine_a_completion_is_the_greedy_continuation_of_a_fresh_session() {
    let model = common::tiny_real_vocab();
    let server = serve(
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        real_session(model.path(), 256),
        HttpOptions::new("t"),
    )
    .unwrap();
    // 40 prompt tokens: three prefill blocks of 16.
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + 37 * i).collect();
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": true});
    let v = complete(&server, &body);
    let served: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();

    let mut fresh = real_session(model.path(), 256);
    let mut sampler = picchio::sample::Sampler::new(picchio::sample::SamplingParams {
        temperature: 0.0,
        ..Default::default()
    })
    .unwrap();
    let stops = picchio::chat::turn_stop_tokens(201_088);
    let expected = fresh.generate(&prompt, 12, &mut sampler, &stops, &mut |_| true).unwrap();
    assert_eq!(served, expected.tokens);
    let shown: Vec<u32> = expected.tokens.iter().copied().filter(|t| !stops.contains(t)).collect();
    assert_eq!(v["choices"][0]["text"].as_str(), Some(Tokenizer::new().decode(&shown).unwrap().as_str()));
    let reason = if served.len() < 12 { "stop" } else { "length" };
    assert_eq!(v["choices"][0]["finish_reason"], reason);

    // Again: the cache is reused and the answer is the same.
    let again = complete(&server, &body);
    assert_eq!(again["choices"][0]["token_ids"], v["choices"][0]["token_ids"]);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 39);
}
