//! The server's other endpoints through a real HTTP client: `/tokenize`, `/detokenize`,
//! `/metrics`, and CORS (off by default, `HttpOptions::cors_origin` on).

mod common;

use std::time::Duration;

use common::http::{agent, listener, post};
use common::scripted::Scripted;
use picchio::chat::{HarmonyEncoding, Tokenizer};
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

fn server(options: HttpOptions) -> ServerHandle {
    serve(listener(), Session::new(Box::new(Scripted::new(4096, Duration::ZERO))), options).unwrap()
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let server = server(HttpOptions::new("s"));
    let text = "<|start|>user<|message|>Hello there<|end|>";
    let (status, v) = post(&server, "/tokenize", &json!({"prompt": text}));
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, Tokenizer::new().encode_with_special(text));
    assert_eq!((v["count"].as_u64(), v["max_model_len"].as_u64()), (Some(ids.len() as u64), Some(4096)));
    let (status, back) = post(&server, "/detokenize", &json!({"tokens": ids}));
    assert_eq!((status, back["prompt"].as_str()), (200, Some(text)));

    // A conversation is rendered as /v1/chat/completions renders it: the usage of a
    // completion counts the same tokens.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "low"});
    let (_, v) = post(&server, "/tokenize", &chat);
    let (_, done) = post(&server, "/v1/chat/completions", &chat);
    assert_eq!(v["count"], done["usage"]["prompt_tokens"]);
    let rendered = HarmonyEncoding::new()
        .tokenizer()
        .decode(&serde_json::from_value::<Vec<u32>>(v["tokens"].clone()).unwrap())
        .unwrap();
    assert!(rendered.contains("Reasoning: low") && rendered.ends_with("<|start|>assistant"), "{rendered}");

    let (status, e) = post(&server, "/detokenize", &json!({"tokens": [5, -1]}));
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("tokens[1]")));
    let (status, e) = post(&server, "/tokenize", &json!({"prompt": "x", "messages": []}));
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("prompt")));
}

#[test]
fn metrics_count_requests_and_tokens_in_prometheus_text() {
    let server = server(HttpOptions::new("s"));
    let (_, done) = post(&server, "/v1/responses", &json!({"input": "Hi"}));
    let (_, again) = post(&server, "/v1/responses", &json!({"input": "Hi", "store": false}));
    let mut resp = agent().get(format!("{}/metrics", server.url())).call().unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let content_type = resp.headers().get("content-type").unwrap().to_str().unwrap().to_string();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    let text = resp.body_mut().read_to_string().unwrap();
    let sample = |name: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name}: {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let u = |v: &Value, k: &str| v["usage"][k].as_f64().unwrap();
    assert_eq!(sample("picchio_requests_total{outcome=\"completed\"}"), 2.0);
    assert_eq!(sample("picchio_prompt_tokens_total"), u(&done, "input_tokens") + u(&again, "input_tokens"));
    assert_eq!(
        sample("picchio_completion_tokens_total"),
        u(&done, "output_tokens") + u(&again, "output_tokens")
    );
    let cached = again["usage"]["input_tokens_details"]["cached_tokens"].as_f64().unwrap();
    assert!(cached > 0.0);
    assert_eq!(sample("picchio_cached_tokens_total"), cached);
    assert_eq!(sample("picchio_prefill_tokens_total"), sample("picchio_prompt_tokens_total") - cached);
    assert!(sample("picchio_prefill_seconds_total") >= 0.0 && sample("picchio_decode_seconds_total") >= 0.0);
    assert_eq!(sample("picchio_queue_length"), 0.0);
    assert_eq!(sample("picchio_stored_responses"), 1.0, "store: false is not kept");
}

#[test]
fn cors_is_off_by_default_and_answers_the_allowed_origin() {
    let origin = "http://localhost:3000";
    let preflight = |server: &ServerHandle, origin: &str| {
        agent()
            .options(format!("{}/v1/chat/completions", server.url()))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization, content-type")
            .call()
            .unwrap()
    };
    let off = server(HttpOptions::new("s"));
    let resp = preflight(&off, origin);
    assert_eq!(resp.status().as_u16(), 405);
    assert!(resp.headers().get("access-control-allow-origin").is_none());

    let mut options = HttpOptions::new("s");
    options.cors_origin = Some(origin.into());
    options.api_key = Some("k".into());
    let on = server(options);
    let resp = preflight(&on, origin);
    assert_eq!(resp.status().as_u16(), 204, "a preflight needs no key");
    let h = resp.headers();
    assert_eq!(h.get("access-control-allow-origin").unwrap(), origin);
    assert!(h.get("access-control-allow-methods").unwrap().to_str().unwrap().contains("POST"));
    assert_eq!(h.get("access-control-allow-headers").unwrap(), "authorization, content-type");
    let resp = agent()
        .get(format!("{}/v1/models", on.url()))
        .header("origin", origin)
        .header("authorization", "Bearer k")
        .call()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers().get("access-control-allow-origin").unwrap(), origin);
    let resp = agent().get(format!("{}/v1/models", on.url())).header("origin", origin).call().unwrap();
    assert_eq!(resp.status().as_u16(), 401, "the key is still needed");
    assert_eq!(
        resp.headers().get("access-control-allow-origin").unwrap(),
        origin,
        "so the page can read the 401"
    );
    let other = preflight(&on, "http://evil.example");
    assert!(other.headers().get("access-control-allow-origin").is_none());
    assert_ne!(other.status().as_u16(), 204);

    let mut bad = HttpOptions::new("s");
    bad.cors_origin = Some("bad\norigin".into());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let session = Session::new(Box::new(Scripted::new(64, Duration::ZERO)));
    assert!(serve(listener, session, bad).is_err());
}

fn get(server: &ServerHandle, path: &str) -> (u16, Value) {
    let mut resp = agent().get(format!("{}{path}", server.url())).call().unwrap();
    let status = resp.status().as_u16();
    (status, serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap())
}

/// The `data:` payloads of a chat completions stream, before `[DONE]`.
fn chat_stream(server: &ServerHandle, body: &Value) -> Vec<Value> {
    use std::io::{BufRead, BufReader};
    let resp = agent()
        .post(format!("{}/v1/chat/completions", server.url()))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let lines = BufReader::new(resp.into_body().into_reader()).lines();
    let data: Vec<String> =
        lines.map_while(Result::ok).filter_map(|l| l.strip_prefix("data: ").map(str::to_string)).collect();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[test]
fn reasoning_comes_under_both_names_unless_excluded() {
    use common::scripted::{ANSWER, REASONING};
    let server = server(HttpOptions::new("s"));
    let hi = json!([{"role": "user", "content": "Hi"}]);
    let (status, v) = post(&server, "/v1/chat/completions", &json!({"messages": hi}));
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert_eq!(
        (message["reasoning"].as_str(), message["reasoning_content"].as_str()),
        (Some(REASONING), Some(REASONING))
    );
    let chunks = chat_stream(&server, &json!({"messages": hi, "stream": true}));
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let reasoning: String = deltas.iter().filter_map(|d| d["reasoning"].as_str()).collect();
    assert_eq!(reasoning, REASONING);
    assert!(deltas.iter().all(|d| d["reasoning"] == d["reasoning_content"]), "{deltas:?}");

    // reasoning.exclude drops it from the answer and the stream; it is still generated.
    let excluded = json!({"messages": hi, "reasoning": {"effort": "low", "exclude": true}});
    let (status, x) = post(&server, "/v1/chat/completions", &excluded);
    assert_eq!(status, 200, "{x}");
    let message = &x["choices"][0]["message"];
    assert!(message["reasoning"].is_null() && message["reasoning_content"].is_null(), "{x}");
    assert_eq!(message["content"], ANSWER);
    assert_eq!(x["usage"]["completion_tokens"], v["usage"]["completion_tokens"]);
    let mut streamed = excluded.clone();
    streamed["stream"] = json!(true);
    let chunks = chat_stream(&server, &streamed);
    let deltas: Vec<&Value> =
        chunks.iter().filter_map(|c| c["choices"].get(0)).map(|c| &c["delta"]).collect();
    assert!(deltas.iter().all(|d| d.get("reasoning").is_none() && d.get("reasoning_content").is_none()));
    let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
    assert_eq!(content, ANSWER);

    // reasoning.effort is Harmony's effort, and it must agree with reasoning_effort.
    let (_, t) = post(&server, "/tokenize", &excluded);
    let ids: Vec<u32> = serde_json::from_value(t["tokens"].clone()).unwrap();
    assert!(Tokenizer::new().decode(&ids).unwrap().contains("Reasoning: low"));
    let (status, e) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": hi, "reasoning_effort": "high", "reasoning": {"effort": "low"}}),
    );
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("reasoning.effort")), "{e}");
    let (status, e) = post(&server, "/v1/responses", &json!({"input": "Hi", "reasoning": {"exclude": true}}));
    assert_eq!((status, e["error"]["code"].as_str()), (400, Some("unsupported_parameter")), "{e}");

    // A past assistant message's `reasoning` goes back in as its analysis.
    let history = json!({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "reasoning": "I should call the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]});
    let (_, t) = post(&server, "/tokenize", &history);
    let ids: Vec<u32> = serde_json::from_value(t["tokens"].clone()).unwrap();
    let text = Tokenizer::new().decode(&ids).unwrap();
    assert!(text.contains("<|channel|>analysis<|message|>I should call the tool."), "{text}");
}

#[test]
fn input_items_are_listed_in_pages() {
    let server = server(HttpOptions::new("s"));
    let input = json!([
        {"role": "user", "content": "first"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "second"}], "id": "msg_given"},
        {"role": "user", "content": "third"}
    ]);
    let (status, r) = post(&server, "/v1/responses", &json!({"input": input}));
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().unwrap();
    let (status, all) = get(&server, &format!("/v1/responses/{id}/input_items"));
    assert_eq!(status, 200, "{all}");
    assert_eq!((all["object"].as_str(), all["has_more"].as_bool()), (Some("list"), Some(false)));
    let data = all["data"].as_array().unwrap();
    let texts: Vec<&str> = data.iter().map(|i| i["content"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["third", "second", "first"], "newest first by default");
    assert!(data.iter().all(|i| i["type"] == "message" && i["id"].is_string()), "{all}");
    assert_eq!(data[0]["content"][0]["type"], "input_text");
    assert_eq!(data[1]["id"], "msg_given", "a client's ID is kept");
    assert_eq!((&all["first_id"], &all["last_id"]), (&data[0]["id"], &data[2]["id"]));

    let (_, page) = get(&server, &format!("/v1/responses/{id}/input_items?order=asc&limit=2"));
    let texts: Vec<&str> =
        page["data"].as_array().unwrap().iter().map(|i| i["content"][0]["text"].as_str().unwrap()).collect();
    assert_eq!((texts, page["has_more"].as_bool()), (vec!["first", "second"], Some(true)));
    let after = page["last_id"].as_str().unwrap();
    let (_, rest) = get(&server, &format!("/v1/responses/{id}/input_items?order=asc&limit=2&after={after}"));
    assert_eq!(rest["data"].as_array().unwrap().len(), 1);
    assert_eq!(
        (rest["data"][0]["content"][0]["text"].as_str(), rest["has_more"].as_bool()),
        (Some("third"), Some(false))
    );

    let (status, e) = get(&server, &format!("/v1/responses/{id}/input_items?limit=0"));
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("limit")));
    let (status, e) = get(&server, &format!("/v1/responses/{id}/input_items?after=nope"));
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("after")));
    let (status, e) = get(&server, "/v1/responses/resp_none/input_items");
    assert_eq!((status, e["error"]["param"].as_str()), (404, Some("response_id")));

    // A string input is one user message; a continuation lists only its own input.
    let (_, next) = post(&server, "/v1/responses", &json!({"input": "more", "previous_response_id": id}));
    let (_, items) = get(&server, &format!("/v1/responses/{}/input_items", next["id"].as_str().unwrap()));
    assert_eq!(items["data"].as_array().unwrap().len(), 1, "{items}");
    assert_eq!(items["data"][0]["role"], "user");
    assert_eq!(items["data"][0]["content"], json!([{"type": "input_text", "text": "more"}]));
}

/// Sends a chat completion on a raw socket and returns it, so the test can drop it.
fn send_raw(server: &ServerHandle, body: &Value) -> std::net::TcpStream {
    use std::io::Write;
    let body = body.to_string();
    let mut socket = std::net::TcpStream::connect(server.local_addr()).unwrap();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    socket
}

#[test]
fn metrics_after_a_turn_cancelled_in_its_prefill_count_what_was_computed() {
    // One position per forward call, 10 ms each.
    let runner = Scripted::new(4096, Duration::from_millis(10)).with_prefill_block(1);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let server = serve(listener, Session::new(Box::new(runner)), HttpOptions::new("s")).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "paste ".repeat(150)}], "max_tokens": 2});
    let (_, t) = post(&server, "/tokenize", &body);
    let prompt = t["count"].as_f64().unwrap();
    let socket = send_raw(&server, &body);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !server.stats().busy {
        assert!(std::time::Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    drop(socket);
    while server.stats().cancelled != 1 || server.stats().busy {
        assert!(std::time::Instant::now() < deadline, "not cancelled: {:?}", server.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    let metrics = || {
        let text = agent()
            .get(format!("{}/metrics", server.url()))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        move |name: &str| -> f64 {
            let line =
                text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        }
    };
    let m = metrics();
    assert_eq!(m("picchio_requests_total{outcome=\"cancelled\"}"), 1.0);
    assert_eq!(m("picchio_requests_total{outcome=\"completed\"}"), 0.0);
    assert_eq!(m("picchio_prompt_tokens_total"), prompt, "the prompt of every turn run");
    assert_eq!(m("picchio_cached_tokens_total"), 0.0);
    let computed = m("picchio_prefill_tokens_total");
    assert!(computed > 0.0 && computed < prompt / 2.0, "{computed} of {prompt} computed before the stop");
    assert_eq!(m("picchio_completion_tokens_total"), 0.0);
    assert!(m("picchio_prefill_seconds_total") > 0.2);
    assert_eq!(m("picchio_decode_seconds_total"), 0.0);
    assert_eq!((m("picchio_queue_length"), m("picchio_busy")), (0.0, 0.0));

    // The computed blocks stayed in the cache: the same prompt again reuses them, and the
    // two turns together computed the prompt exactly once.
    let (status, v) = post(&server, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64(), Some(computed));
    let m = metrics();
    assert_eq!(m("picchio_requests_total{outcome=\"completed\"}"), 1.0);
    assert_eq!(m("picchio_prompt_tokens_total"), 2.0 * prompt);
    assert_eq!(m("picchio_cached_tokens_total"), computed);
    assert_eq!(m("picchio_prefill_tokens_total"), prompt);
    assert_eq!(m("picchio_completion_tokens_total"), 2.0);
}
