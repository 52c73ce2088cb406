//! The server's other endpoints through a real HTTP client: `/tokenize`, `/detokenize`,
//! `/metrics`, and CORS (off by default, `HttpOptions::cors_origin` on).

mod common;

use std::time::Duration;

use common::scripted::Scripted;
use picchio::chat::{HarmonyEncoding, Tokenizer};
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

fn server(options: HttpOptions) -> ServerHandle {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    serve(listener, Session::new(Box::new(Scripted::new(4096, Duration::ZERO))), options).unwrap()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

fn post(server: &ServerHandle, path: &str, body: &Value) -> (u16, Value) {
    let mut resp = agent()
        .post(format!("{}{path}", server.url()))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    let status = resp.status().as_u16();
    (status, serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap())
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
