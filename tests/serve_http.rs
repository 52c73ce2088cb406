//! The OpenAI-compatible HTTP server, through a real HTTP client.
//!
//! Two kinds of model: the tiny random model with the real vocabulary (`tiny_real_vocab`),
//! which runs the real engine but writes random tokens (so only structure, counts and
//! equality between equivalent runs are checked), and a scripted runner that writes fixed
//! Harmony replies (reasoning then an answer, a tool call, or an answer that never ends) so
//! that content, reasoning, tool calls, streaming and cancellation can be checked exactly.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use picchio::chat::{
    Conversation, DeveloperContent, HarmonyEncoding, Message, ReasoningEffort, RenderConfig, Role,
    SystemContent, Tokenizer, today_utc,
};
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

use common::scripted::{AFTER_TOOL_ANSWER, ANSWER, DEFAULT_REPLY, REASONING, Scripted, TOOL_ARGUMENTS};

// ---------------------------------------------------------------------------------------
// Servers and a client.

fn listener() -> std::net::TcpListener {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap()
}

fn scripted_server(capacity: usize, delay: Duration, options: HttpOptions) -> ServerHandle {
    serve(listener(), Session::new(Box::new(Scripted::new(capacity, delay))), options).unwrap()
}

fn real_session(dir: &Path, ctx: usize) -> Session {
    let model = engine::open(dir, &OpenOptions { ctx, ..Default::default() }).unwrap();
    Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx, max_batch: 64, ..Default::default() }).unwrap(),
    )
}

fn real_server(dir: &Path, ctx: usize) -> ServerHandle {
    serve(listener(), real_session(dir, ctx), HttpOptions::new("tiny")).unwrap()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// POSTs `body` (raw text) and returns the status and the parsed JSON answer.
fn post_raw(server: &ServerHandle, path: &str, body: String, key: Option<&str>) -> (u16, Value) {
    let mut req = agent().post(format!("{}{path}", server.url())).header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let mut resp = req.send(body).unwrap();
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

fn chat(server: &ServerHandle, body: &Value) -> (u16, Value) {
    post_raw(server, "/v1/chat/completions", body.to_string(), None)
}

/// A successful non-streaming completion.
fn complete(server: &ServerHandle, body: &Value) -> Value {
    let (status, v) = chat(server, body);
    assert_eq!(status, 200, "{v}");
    v
}

fn get(server: &ServerHandle, path: &str, key: Option<&str>) -> (u16, Value) {
    let mut req = agent().get(format!("{}{path}", server.url()));
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let mut resp = req.call().unwrap();
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

/// Starts a streaming request and returns a reader of its `data:` payloads.
fn open_stream(server: &ServerHandle, body: &Value) -> impl Iterator<Item = String> {
    let resp = agent()
        .post(format!("{}/v1/chat/completions", server.url()))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let content_type = resp.headers().get("content-type").unwrap().to_str().unwrap().to_string();
    assert!(content_type.starts_with("text/event-stream"), "{content_type}");
    let lines = BufReader::new(resp.into_body().into_reader()).lines();
    lines.map_while(Result::ok).filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
}

/// A whole stream: the chunks before `[DONE]` (which must come last).
fn stream(server: &ServerHandle, body: &Value) -> Vec<Value> {
    let mut chunks = Vec::new();
    let mut done = false;
    for data in open_stream(server, body) {
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

/// What a stream said: content, reasoning, tool calls (id, name, arguments), finish
/// reason and usage. Checks the shape of every chunk on the way.
#[derive(Debug, Default, PartialEq)]
struct Streamed {
    content: String,
    reasoning: String,
    tool_calls: Vec<(String, String, String)>,
    finish_reason: Option<String>,
    usage: Option<Value>,
}

fn collect(chunks: &[Value]) -> Streamed {
    let mut s = Streamed::default();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "the first chunk names the role");
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id, "one ID for every chunk");
        assert!(c["created"].as_u64().unwrap() > 0);
        let choices = c["choices"].as_array().unwrap();
        if choices.is_empty() {
            assert_eq!(i, chunks.len() - 1, "the usage chunk comes last");
            s.usage = Some(c["usage"].clone());
            continue;
        }
        assert!(s.finish_reason.is_none(), "a chunk after the finish reason");
        let choice = &choices[0];
        assert_eq!(choice["index"], 0);
        let delta = &choice["delta"];
        if let Some(t) = delta["content"].as_str() {
            s.content.push_str(t);
        }
        if let Some(t) = delta["reasoning_content"].as_str() {
            s.reasoning.push_str(t);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if let Some(id) = call["id"].as_str() {
                assert_eq!(index, s.tool_calls.len(), "a new call takes the next index");
                assert_eq!(call["type"], "function");
                let name = call["function"]["name"].as_str().unwrap();
                s.tool_calls.push((id.to_string(), name.to_string(), String::new()));
            }
            s.tool_calls[index].2.push_str(call["function"]["arguments"].as_str().unwrap());
        }
        if let Some(r) = choice["finish_reason"].as_str() {
            s.finish_reason = Some(r.to_string());
        }
    }
    assert!(s.finish_reason.is_some(), "no chunk had a finish reason");
    s
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// The prompt the server should render for a system instruction and a user message.
fn expected_prompt(instructions: &str, user_text: &str) -> Vec<u32> {
    let convo = Conversation::from_messages([
        Message::system(
            SystemContent::new()
                .with_reasoning_effort(ReasoningEffort::Medium)
                .with_conversation_start_date(today_utc()),
        ),
        Message::developer(DeveloperContent::new().with_instructions(instructions)),
        Message::user(user_text),
    ]);
    HarmonyEncoding::new()
        .render_conversation_for_completion(&convo, Role::Assistant, &RenderConfig::default())
        .unwrap()
}

fn assert_openai_error(v: &Value, kind: &str) {
    let e = &v["error"];
    assert!(!e["message"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(e["type"], kind, "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn a_completion_has_openai_shape_and_consistent_usage() {
    let model = common::tiny_real_vocab();
    let server = real_server(model.path(), 256);
    let body = json!({
        "model": "anything",
        "messages": [{"role": "system", "content": "Be brief."}, user("Hello")],
        "temperature": 0, "max_tokens": 6, "return_token_ids": true,
    });
    let v = complete(&server, &body);
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], "tiny", "the served model's ID, whatever the request says");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    let choice = &choices[0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(
        choice["message"].get("content").is_some() && choice["message"].get("reasoning_content").is_some()
    );
    let finish = choice["finish_reason"].as_str().unwrap();
    assert!(["stop", "length"].contains(&finish), "{finish}");

    // Usage: the rendered prompt and the generated tokens.
    let prompt = expected_prompt("Be brief.", "Hello");
    let tokens = choice["token_ids"].as_array().unwrap().len();
    let usage = &v["usage"];
    assert_eq!(usage["prompt_tokens"], prompt.len());
    assert_eq!(serde_json::from_value::<Vec<u32>>(v["prompt_token_ids"].clone()).unwrap(), prompt);
    assert_eq!(usage["completion_tokens"], tokens);
    assert_eq!(usage["total_tokens"], prompt.len() + tokens);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    if finish == "length" {
        assert_eq!(tokens, 6);
    }

    // The same request again reuses the whole prompt but its last token, and greedy
    // decoding gives the same tokens.
    let again = complete(&server, &body);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], prompt.len() - 1);
    assert_eq!(again["choices"][0]["token_ids"], choice["token_ids"]);
    assert_ne!(again["id"], v["id"]);

    let (status, models) = get(&server, "/v1/models", None);
    assert_eq!(status, 200);
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(get(&server, "/v1/models/tiny", None).0, 200);
    let (status, missing) = get(&server, "/v1/models/other", None);
    assert_eq!(status, 404);
    assert_eq!(missing["error"]["code"], "model_not_found");
    let (status, health) = get(&server, "/health", None);
    assert_eq!(status, 200);
    assert_eq!((health["status"].as_str(), health["completed"].as_u64()), (Some("ok"), Some(2)));
    assert_eq!(health["context_length"], 256);
}

#[test]
fn scripted_replies_map_to_content_and_reasoning() {
    let server = scripted_server(4096, Duration::ZERO, HttpOptions::new("scripted"));
    let v = complete(&server, &json!({"messages": [user("Hi")], "temperature": 0}));
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], ANSWER);
    assert_eq!(m["reasoning_content"], REASONING);
    assert!(m.get("tool_calls").is_none(), "no tool calls, no key");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let reply_len = Tokenizer::new().encode_with_special(DEFAULT_REPLY).len();
    assert_eq!(v["usage"]["completion_tokens"], reply_len, "every reply token, <|return|> included");
}

#[test]
fn streaming_equals_non_streaming() {
    // Scripted: exact content and reasoning.
    let body = json!({"messages": [user("Hi")], "temperature": 0});
    let plain = complete(&scripted_server(4096, Duration::ZERO, HttpOptions::new("s")), &body);
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let chunks = stream(&scripted_server(4096, Duration::ZERO, HttpOptions::new("s")), &streaming);
    let s = collect(&chunks);
    assert_eq!(s.content, plain["choices"][0]["message"]["content"].as_str().unwrap());
    assert_eq!(s.reasoning, plain["choices"][0]["message"]["reasoning_content"].as_str().unwrap());
    assert_eq!(s.finish_reason.as_deref(), Some("stop"));
    assert_eq!(s.usage.as_ref(), Some(&plain["usage"]), "a fresh server reports the same usage");
    assert!(chunks.len() > 4, "the text came in pieces: {} chunks", chunks.len());

    // Without include_usage there is no usage chunk.
    streaming["stream_options"] = json!({"include_usage": false});
    let s = collect(&stream(&scripted_server(4096, Duration::ZERO, HttpOptions::new("s")), &streaming));
    assert_eq!(s.usage, None);

    // The real engine, greedy, on fresh servers: the same tokens either way.
    let model = common::tiny_real_vocab();
    let body = json!({"messages": [user("Tell me a story")], "temperature": 0, "max_tokens": 7});
    let plain = complete(&real_server(model.path(), 256), &body);
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let s = collect(&stream(&real_server(model.path(), 256), &streaming));
    assert_eq!(s.usage.as_ref(), Some(&plain["usage"]));
    assert_eq!(s.finish_reason.as_deref(), plain["choices"][0]["finish_reason"].as_str());
    let plain_content = plain["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert_eq!(s.content, plain_content);
}

#[test]
fn tool_calls_round_trip() {
    let server = scripted_server(4096, Duration::ZERO, HttpOptions::new("s"));
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let question = user("What is the weather in Paris?");
    let body = json!({"messages": [question], "tools": tools, "temperature": 0});
    let v = complete(&server, &body);
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let m = &choice["message"];
    assert_eq!(m["content"], Value::Null);
    assert!(!m["reasoning_content"].as_str().unwrap().is_empty());
    let call = &m["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], TOOL_ARGUMENTS);

    // Streamed: ID and name first, then the arguments in pieces.
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let s = collect(&stream(&scripted_server(4096, Duration::ZERO, HttpOptions::new("s")), &streaming));
    assert_eq!(s.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(s.tool_calls.len(), 1);
    let (id, name, arguments) = &s.tool_calls[0];
    assert!(id.starts_with("call_"));
    assert_eq!((name.as_str(), arguments.as_str()), ("get_weather", TOOL_ARGUMENTS));
    assert_eq!(s.reasoning, m["reasoning_content"].as_str().unwrap());

    // The tool's answer goes back with the call; the conversation continues from the cache.
    let follow_up = json!({
        "messages": [question, m, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 C"}],
        "tools": tools, "temperature": 0,
    });
    let v2 = complete(&server, &follow_up);
    assert_eq!(v2["choices"][0]["message"]["content"], AFTER_TOOL_ANSWER);
    assert_eq!(v2["choices"][0]["finish_reason"], "stop");
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let first_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let first_total = first_prompt + v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(cached > first_prompt, "the reasoning and the call were reused too: {cached} of {first_total}");

    // A tool result must answer a known call.
    let mut bad = follow_up.clone();
    bad["messages"][2]["tool_call_id"] = json!("call_unknown");
    let (status, e) = chat(&server, &bad);
    assert_eq!(status, 400);
    assert_eq!(e["error"]["param"], "messages[2].tool_call_id");
}

#[test]
fn a_follow_up_reuses_the_cache_and_matches_a_fresh_server() {
    let model = common::tiny_real_vocab();
    let server = real_server(model.path(), 512);
    let first = json!({"messages": [user("Hello there")], "temperature": 0.8, "seed": 5, "max_tokens": 8,
                       "return_token_ids": true});
    let v1 = complete(&server, &first);
    assert_eq!(v1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = json!({
        "messages": [user("Hello there"), {"role": "assistant", "content": "Hi! How can I help?"},
                     user("Tell me a story")],
        "temperature": 0.8, "seed": 5, "max_tokens": 8, "return_token_ids": true,
    });
    let v2 = complete(&server, &second);
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let prompt = v2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached >= v1["usage"]["prompt_tokens"].as_u64().unwrap(), "the first prompt is reused");
    assert!(cached < prompt);

    let fresh = complete(&real_server(model.path(), 512), &second);
    assert_eq!(fresh["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(fresh["usage"]["prompt_tokens"], prompt);
    assert_eq!(fresh["choices"][0]["token_ids"], v2["choices"][0]["token_ids"], "reuse changed the tokens");
    assert_eq!(fresh["choices"][0]["message"], v2["choices"][0]["message"]);
    assert_eq!(fresh["usage"]["completion_tokens"], v2["usage"]["completion_tokens"]);
}

#[test]
fn a_dropped_stream_cancels_its_generation() {
    // 5 ms a token: the 50000 tokens asked for would take minutes.
    let server = scripted_server(100_000, Duration::from_millis(5), HttpOptions::new("s"));
    let body = json!({"messages": [user("Sing forever")], "stream": true, "max_tokens": 50_000});
    let mut data = open_stream(&server, &body);
    let mut content_chunks = 0;
    while content_chunks < 3 {
        let chunk: Value = serde_json::from_str(&data.next().unwrap()).unwrap();
        if chunk["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty()) {
            content_chunks += 1;
        }
    }
    drop(data);

    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, h) = get(&server, "/health", None);
        if h["cancelled"] == 1 && h["busy"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "the generation was not cancelled: {h}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The engine is free: the next request is served at once.
    let start = Instant::now();
    let v = complete(&server, &json!({"messages": [user("Hi")]}));
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER);
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    let stats = server.stats();
    assert_eq!((stats.cancelled, stats.completed), (1, 1));
    assert!(stats.completion_tokens < 5_000, "{} tokens were generated", stats.completion_tokens);
}

#[test]
fn a_client_that_disconnects_during_a_long_prefill_frees_the_server_at_the_next_block() {
    use std::io::Write;
    // One position per forward call, 20 ms each: the prompt below takes seconds to prefill.
    let runner = Scripted::new(100_000, Duration::from_millis(20)).with_prefill_block(1);
    let server = serve(listener(), Session::new(Box::new(runner)), HttpOptions::new("s")).unwrap();
    let long = "paste ".repeat(400);
    let body = json!({"messages": [user(&long)], "max_tokens": 5}).to_string();
    let mut socket = std::net::TcpStream::connect(server.local_addr()).unwrap();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.stats().busy {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    drop(socket);
    let dropped = Instant::now();
    while server.stats().cancelled != 1 || server.stats().busy {
        assert!(Instant::now() < deadline, "not cancelled: {:?}", server.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    // The whole prefill is 400+ positions, 8 s or more; stopping at a block boundary is quick.
    let stopped_in = dropped.elapsed();
    assert!(
        stopped_in < Duration::from_secs(3),
        "the prefill ran on for {stopped_in:?} after the disconnect"
    );
    let stats = server.stats();
    assert_eq!((stats.completed, stats.completion_tokens), (0, 0), "{stats:?}");

    // The server is free: a short request completes at once.
    let v = complete(&server, &json!({"messages": [user("Hi")], "max_tokens": 5}));
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(server.stats().completed, 1);
}

#[test]
fn a_disconnected_non_streaming_request_is_cancelled_too() {
    use std::io::Write;
    let server = scripted_server(100_000, Duration::from_millis(5), HttpOptions::new("s"));
    let body = json!({"messages": [user("Sing forever")], "max_tokens": 50_000}).to_string();
    let mut socket = std::net::TcpStream::connect(server.local_addr()).unwrap();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.stats().busy {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(socket);
    while server.stats().cancelled != 1 || server.stats().busy {
        assert!(Instant::now() < deadline, "not cancelled: {:?}", server.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.stats().completed, 0);
}

#[test]
fn bad_requests_get_openai_errors_and_never_reach_the_engine() {
    let mut options = HttpOptions::new("s");
    options.api_key = Some("sekret".into());
    options.max_body_bytes = 4 << 20;
    let server = scripted_server(200, Duration::ZERO, options);
    let key = Some("sekret");
    let good = json!({"messages": [user("Hi")]});
    let send = |body: String, key: Option<&str>| post_raw(&server, "/v1/chat/completions", body, key);

    // Authentication.
    let (status, v) = send(good.to_string(), None);
    assert_eq!(status, 401);
    assert_openai_error(&v, "invalid_request_error");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    assert_eq!(send(good.to_string(), Some("wrong")).0, 401);
    assert_eq!(get(&server, "/v1/models", None).0, 401);
    assert_eq!(get(&server, "/v1/models", key).0, 200);
    assert_eq!(get(&server, "/health", None).0, 200, "health needs no key");

    // Malformed, missing or wrong-typed fields, bad values.
    let cases = [
        ("{\"messages\": [", None),
        ("[]", None),
        ("{}", Some("messages")),
        (r#"{"messages": []}"#, Some("messages")),
        (r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#, Some("temperature")),
        (r#"{"messages": [{"role": "user", "content": "x"}], "temperature": 9}"#, Some("temperature")),
        (r#"{"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}"#, Some("top_p")),
        (r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#, Some("max_tokens")),
        (r#"{"messages": [{"role": "user", "content": "x"}], "n": 3}"#, Some("n")),
        (
            r#"{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}"#,
            Some("stop"),
        ),
        (r#"{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}"#, Some("logit_bias")),
        (r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, Some("messages[0].role")),
        (r#"{"messages": [{"role": "user", "content": 42}]}"#, Some("messages[0].content")),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
            Some("messages[0].content[0].type"),
        ),
    ];
    for (body, param) in cases {
        let (status, v) = send(body.to_string(), key);
        assert_eq!(status, 400, "{body}: {v}");
        assert_openai_error(&v, "invalid_request_error");
        assert_eq!(v["error"]["param"].as_str(), param, "{body}: {v}");
    }

    // Too large a body.
    let huge = format!(r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#, "a".repeat(5 << 20));
    let (status, v) = send(huge, key);
    assert_eq!(status, 413);
    assert_openai_error(&v, "invalid_request_error");

    // A prompt longer than the context (200 tokens).
    let long = json!({"messages": [user(&"many words ".repeat(300))]});
    let (status, v) = send(long.to_string(), key);
    assert_eq!(status, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");

    // Unknown route, wrong method.
    let (status, v) = get(&server, "/v1/nothing", key);
    assert_eq!(status, 404);
    assert_openai_error(&v, "invalid_request_error");
    let (status, v) = get(&server, "/v1/chat/completions", key);
    assert_eq!(status, 405);
    assert_openai_error(&v, "invalid_request_error");

    let stats = server.stats();
    assert_eq!((stats.completed, stats.failed, stats.cancelled, stats.prompt_tokens), (0, 0, 0, 0));
    // And a good request still works.
    let (status, v) = send(good.to_string(), key);
    assert_eq!(status, 200, "{v}");
    assert_eq!(server.stats().completed, 1);
}

#[test]
fn concurrent_requests_are_queued_and_all_answered() {
    let model = common::tiny_real_vocab();
    let server = real_server(model.path(), 256);
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let server = &server;
                s.spawn(move || {
                    chat(
                        server,
                        &json!({"messages": [user(&format!("Question {i}"))], "max_tokens": 10, "seed": i}),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (status, v) in &answers {
        assert_eq!(*status, 200, "{v}");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    }
    // The worker clears its busy flag just after sending the last answer: wait for it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while server.stats().busy && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let stats = server.stats();
    assert_eq!((stats.completed, stats.queued, stats.busy), (3, 0, false));
}

/// Kills the child process when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_binary_serves_http() {
    let model = common::tiny_real_vocab();
    let mut child = Killed(
        Command::new(env!("CARGO_BIN_EXE_picchio"))
            .args([
                "serve",
                "--http",
                "127.0.0.1:0",
                "--ctx",
                "256",
                "--model-name",
                "tiny-bin",
                "--api-key",
                "k1",
            ])
            .arg("-m")
            .arg(model.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stdout = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{line}")).to_string();
    let agent = agent();
    // The server listens before the model is loaded: /health is 503 until it is ready.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut resp = loop {
        let resp = agent.get(format!("{url}/health")).call().unwrap();
        if resp.status().as_u16() != 503 || Instant::now() > deadline {
            break resp;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(resp.status().as_u16(), 200);
    let health: Value = serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!((health["model"].as_str(), health["context_length"].as_u64()), (Some("tiny-bin"), Some(256)));
    let mut resp = agent
        .post(format!("{url}/v1/chat/completions"))
        .header("authorization", "Bearer k1")
        .send(json!({"messages": [user("Hi")], "max_tokens": 3}).to_string())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let v: Value = serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(v["model"], "tiny-bin");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    let resp = agent.post(format!("{url}/v1/chat/completions")).send("{}").unwrap();
    assert_eq!(resp.status().as_u16(), 401);

    // The request log is on stderr.
    let _ = child.0.kill();
    let _ = child.0.wait();
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut log).unwrap();
    assert!(log.contains("POST /v1/chat/completions 200"), "{log}");
    assert!(log.contains("POST /v1/chat/completions 401"), "{log}");
}
