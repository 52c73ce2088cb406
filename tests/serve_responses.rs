//! `POST /v1/responses` and the stored responses, through a real HTTP client: on the
//! scripted runner (exact reasoning, answers and tool calls) and on the tiny random model
//! with the real vocabulary (the real engine: counts and cache reuse).

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::Duration;

use common::scripted::{AFTER_TOOL_ANSWER, ANSWER, DEFAULT_REPLY, REASONING, Scripted, TOOL_ARGUMENTS};
use picchio::chat::{
    Conversation, HarmonyEncoding, Message, ReasoningEffort, RenderConfig, Role, SystemContent, Tokenizer,
    today_utc,
};
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

fn listener() -> std::net::TcpListener {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap()
}

fn scripted_server() -> ServerHandle {
    let session = Session::new(Box::new(Scripted::new(4096, Duration::ZERO)));
    serve(listener(), session, HttpOptions::new("scripted")).unwrap()
}

fn real_server(dir: &Path, ctx: usize) -> ServerHandle {
    let model = engine::open(dir, &OpenOptions { ctx, ..Default::default() }).unwrap();
    let runner =
        engine::cpu_runner(&model, &RunOptions { ctx, max_batch: 64, ..Default::default() }).unwrap();
    serve(listener(), Session::new(runner), HttpOptions::new("tiny")).unwrap()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

fn read(mut resp: ureq::http::Response<ureq::Body>) -> (u16, Value) {
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

fn post(server: &ServerHandle, body: &Value) -> (u16, Value) {
    let url = format!("{}/v1/responses", server.url());
    read(agent().post(url).header("content-type", "application/json").send(body.to_string()).unwrap())
}

/// A successful non-streaming response.
fn create(server: &ServerHandle, body: &Value) -> Value {
    let (status, v) = post(server, body);
    assert_eq!(status, 200, "{v}");
    v
}

fn get(server: &ServerHandle, id: &str) -> (u16, Value) {
    read(agent().get(format!("{}/v1/responses/{id}", server.url())).call().unwrap())
}

fn delete(server: &ServerHandle, id: &str) -> (u16, Value) {
    read(agent().delete(format!("{}/v1/responses/{id}", server.url())).call().unwrap())
}

/// A whole stream: (event name, payload) pairs. Checks that every event names its type in
/// both places and that the sequence numbers count up from 0.
fn stream(server: &ServerHandle, body: &Value) -> Vec<(String, Value)> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let resp = agent()
        .post(format!("{}/v1/responses", server.url()))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let content_type = resp.headers().get("content-type").unwrap().to_str().unwrap().to_string();
    assert!(content_type.starts_with("text/event-stream"), "{content_type}");
    let mut events = Vec::new();
    let mut name = None;
    for line in BufReader::new(resp.into_body().into_reader()).lines() {
        let line = line.unwrap();
        if let Some(n) = line.strip_prefix("event: ") {
            name = Some(n.to_string());
        } else if let Some(data) = line.strip_prefix("data: ") {
            assert_ne!(data, "[DONE]", "the Responses API sends no [DONE]");
            let v: Value = serde_json::from_str(data).unwrap();
            let n = name.take().expect("every data line follows its event line");
            assert_eq!(v["type"], n.as_str());
            assert_eq!(v["sequence_number"], events.len(), "sequence numbers count up from 0");
            events.push((n, v));
        }
    }
    events
}

fn kinds(events: &[(String, Value)]) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for (n, _) in events {
        // Runs of deltas count once: how many there are depends on tokenization.
        if !(n.ends_with(".delta") && out.last() == Some(&n.as_str())) {
            out.push(n);
        }
    }
    out
}

/// The concatenated deltas of `kind` for output item `index`.
fn deltas(events: &[(String, Value)], kind: &str, index: usize) -> String {
    events
        .iter()
        .filter(|(n, v)| n == kind && v["output_index"] == index)
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect()
}

const WEATHER_TOOL: &str = r#"[{"type": "function", "name": "get_weather", "description": "Current weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]"#;

fn weather_tools() -> Value {
    serde_json::from_str(WEATHER_TOOL).unwrap()
}

/// The prompt of a plain question with no instructions or tools.
fn expected_prompt(user_text: &str) -> Vec<u32> {
    let convo = Conversation::from_messages([
        Message::system(
            SystemContent::new()
                .with_reasoning_effort(ReasoningEffort::Medium)
                .with_conversation_start_date(today_utc()),
        ),
        Message::user(user_text),
    ]);
    HarmonyEncoding::new()
        .render_conversation_for_completion(&convo, Role::Assistant, &RenderConfig::default())
        .unwrap()
}

fn assert_refused(server: &ServerHandle, body: Value, param: &str, code: Option<&str>) {
    let (status, v) = post(server, &body);
    assert_eq!(status, 400, "{body}: {v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["param"], param, "{body}: {v}");
    if let Some(code) = code {
        assert_eq!(v["error"]["code"], code, "{v}");
    }
    assert!(!v["error"]["message"].as_str().unwrap().is_empty());
}

#[test]
fn a_response_has_reasoning_then_a_message_and_is_stored() {
    let server = scripted_server();
    let v = create(&server, &json!({"model": "x", "input": "Hi", "temperature": 0, "metadata": {"k": "v"}}));
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!((v["status"].as_str(), v["model"].as_str()), (Some("completed"), Some("scripted")));
    assert!(v["error"].is_null() && v["incomplete_details"].is_null());
    assert_eq!(v["metadata"], json!({"k": "v"}));
    assert_eq!(v["store"], true);
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 2, "{v}");
    assert_eq!(output[0]["type"], "reasoning");
    assert!(output[0]["id"].as_str().unwrap().starts_with("rs_"));
    assert_eq!(output[0]["content"], json!([{"type": "reasoning_text", "text": REASONING}]));
    assert_eq!(output[1]["type"], "message");
    assert!(output[1]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (output[1]["role"].as_str(), output[1]["status"].as_str()),
        (Some("assistant"), Some("completed"))
    );
    assert_eq!(output[1]["content"][0]["type"], "output_text");
    assert_eq!(output[1]["content"][0]["text"], ANSWER);

    let usage = &v["usage"];
    let reply_len = Tokenizer::new().encode_with_special(DEFAULT_REPLY).len();
    assert_eq!(usage["input_tokens"], expected_prompt("Hi").len());
    assert_eq!(usage["output_tokens"], reply_len);
    assert_eq!(usage["total_tokens"], expected_prompt("Hi").len() + reply_len);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    let reasoning_tokens = Tokenizer::new().encode(REASONING).len();
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], reasoning_tokens);

    // Stored: GET returns it again; DELETE forgets it.
    let id = v["id"].as_str().unwrap();
    assert_eq!(get(&server, id), (200, v.clone()));
    let (status, deleted) = delete(&server, id);
    assert_eq!((status, deleted), (200, json!({"id": id, "object": "response.deleted", "deleted": true})));
    let (status, missing) = get(&server, id);
    assert_eq!((status, missing["error"]["code"].as_str()), (404, Some("not_found")));
    assert_eq!(delete(&server, id).0, 404);

    // `store: false` is not kept.
    let unstored = create(&server, &json!({"input": "Hi", "store": false}));
    assert_eq!(unstored["store"], false);
    assert_eq!(get(&server, unstored["id"].as_str().unwrap()).0, 404);
}

#[test]
fn streaming_sends_typed_events_in_order_and_ends_as_the_json_answer() {
    let server = scripted_server();
    let events = stream(&server, &json!({"input": "Hi", "temperature": 0}));
    assert_eq!(
        kinds(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let created = &events[0].1["response"];
    assert_eq!(
        (created["status"].as_str(), created["output"].as_array().map(Vec::len)),
        (Some("in_progress"), Some(0))
    );
    assert_eq!(deltas(&events, "response.reasoning_text.delta", 0), REASONING);
    assert_eq!(deltas(&events, "response.output_text.delta", 1), ANSWER);
    assert_eq!(events[2].1["item"]["status"], "in_progress");
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["status"], "completed");
    assert_eq!(completed["id"], created["id"]);
    // Every event of an item names that item.
    let message_id = &completed["output"][1]["id"];
    for (n, v) in &events {
        let text_event = n.starts_with("response.output_text") || n.starts_with("response.content_part");
        if text_event && v["output_index"] == 1 {
            assert_eq!(&v["item_id"], message_id, "{n}");
        }
    }
    // The stream's final object is what the JSON answer would be (IDs aside), and stored.
    let plain = create(&server, &json!({"input": "Hi", "temperature": 0}));
    let strip = |v: &Value| {
        let mut v = v.clone();
        for k in ["id", "created_at"] {
            v[k] = Value::Null;
        }
        for item in v["output"].as_array_mut().unwrap() {
            item["id"] = Value::Null;
        }
        v["usage"]["input_tokens_details"]["cached_tokens"] = Value::Null;
        v
    };
    assert_eq!(strip(completed), strip(&plain));
    assert_eq!(get(&server, completed["id"].as_str().unwrap()), (200, completed.clone()));
}

#[test]
fn a_tool_round_trip_through_previous_response_id_reuses_the_cache() {
    let server = scripted_server();
    let first =
        create(&server, &json!({"input": "Weather in Paris?", "tools": weather_tools(), "temperature": 0}));
    let output = first["output"].as_array().unwrap();
    assert_eq!(output.len(), 2, "{first}");
    assert_eq!(output[0]["type"], "reasoning");
    let call = &output[1];
    assert_eq!(call["type"], "function_call");
    assert!(call["id"].as_str().unwrap().starts_with("fc_"));
    assert_eq!(
        (call["name"].as_str(), call["arguments"].as_str()),
        (Some("get_weather"), Some(TOOL_ARGUMENTS))
    );
    assert_eq!(call["status"], "completed");
    let call_id = call["call_id"].as_str().unwrap();
    assert!(call_id.starts_with("call_"));
    assert_eq!(first["tools"][0]["name"], "get_weather", "the tools are echoed");

    let result = json!([{"type": "function_call_output", "call_id": call_id, "output": "Sunny, 24 C"}]);
    let second = create(
        &server,
        &json!({"input": result, "previous_response_id": first["id"], "tools": weather_tools(), "temperature": 0}),
    );
    assert_eq!(second["previous_response_id"], first["id"]);
    let answer = second["output"].as_array().unwrap();
    assert_eq!(answer.len(), 1, "{second}");
    assert_eq!(answer[0]["content"][0]["text"], AFTER_TOOL_ANSWER);
    // The second prompt extends the first prompt and its output: all of that is reused.
    let first_total = first["usage"]["total_tokens"].as_u64().unwrap();
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(cached, first_total, "{second}");

    // The same conversation sent whole, output items passed back, renders the same prompt.
    let mut items =
        vec![json!({"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]})];
    items.extend(output.iter().cloned());
    items.push(result[0].clone());
    let whole =
        create(&server, &json!({"input": items, "tools": weather_tools(), "temperature": 0, "store": false}));
    assert_eq!(whole["usage"]["input_tokens"], second["usage"]["input_tokens"]);
    assert_eq!(whole["output"][0]["content"][0]["text"], AFTER_TOOL_ANSWER);

    // Streamed, the call comes as argument deltas.
    let events = stream(&server, &json!({"input": "Weather in Paris?", "tools": weather_tools()}));
    assert_eq!(deltas(&events, "response.function_call_arguments.delta", 1), TOOL_ARGUMENTS);
    let done = events.iter().find(|(n, _)| n == "response.function_call_arguments.done").unwrap();
    assert_eq!(
        (done.1["name"].as_str(), done.1["arguments"].as_str()),
        (Some("get_weather"), Some(TOOL_ARGUMENTS))
    );
    let added =
        events.iter().find(|(n, v)| n == "response.output_item.added" && v["output_index"] == 1).unwrap();
    assert_eq!(added.1["item"]["type"], "function_call");
    assert_eq!(added.1["item"]["arguments"], "");

    // A deleted link breaks its chain, with a clear error.
    assert_eq!(delete(&server, first["id"].as_str().unwrap()).0, 200);
    let (status, v) = post(&server, &json!({"input": "And tomorrow?", "previous_response_id": second["id"]}));
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "previous_response_id");
    assert!(v["error"]["message"].as_str().unwrap().contains(first["id"].as_str().unwrap()), "{v}");
}

#[test]
fn the_token_limit_makes_an_incomplete_response() {
    let server = scripted_server();
    let v = create(&server, &json!({"input": "Sing forever", "max_output_tokens": 8}));
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 8);
    assert_eq!(v["output"][0]["status"], "incomplete");
    let events = stream(&server, &json!({"input": "Sing forever", "max_output_tokens": 8}));
    let (last, v) = events.last().unwrap();
    assert_eq!((last.as_str(), v["response"]["status"].as_str()), ("response.completed", Some("incomplete")));
}

#[test]
fn bad_requests_are_refused_naming_the_field() {
    let server = scripted_server();
    let unsupported = Some("unsupported_parameter");
    assert_refused(&server, json!({}), "input", None);
    assert_refused(&server, json!({"input": []}), "input", None);
    assert_refused(&server, json!({"input": 5}), "input", None);
    assert_refused(&server, json!({"input": [5]}), "input[0]", None);
    assert_refused(&server, json!({"input": [{"role": "robot", "content": "x"}]}), "input[0].role", None);
    assert_refused(&server, json!({"input": [{"role": "user"}]}), "input[0].content", None);
    assert_refused(
        &server,
        json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
        "input[0].content[0].type",
        unsupported,
    );
    assert_refused(
        &server,
        json!({"input": [{"type": "item_reference", "id": "x"}]}),
        "input[0].type",
        unsupported,
    );
    assert_refused(
        &server,
        json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}),
        "input[0].call_id",
        None,
    );
    assert_refused(
        &server,
        json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
        "input[0].call_id",
        None,
    );
    // A required or named call needs the function among the tools.
    assert_refused(&server, json!({"input": "x", "tool_choice": "required"}), "tool_choice", None);
    assert_refused(
        &server,
        json!({"input": "x", "tool_choice": {"type": "function", "name": "f"}}),
        "tool_choice",
        None,
    );
    assert_refused(
        &server,
        json!({"input": "x", "tools": [{"type": "web_search"}]}),
        "tools[0].type",
        unsupported,
    );
    assert_refused(
        &server,
        json!({"input": "x", "tools": [{"type": "function", "name": "a.b"}]}),
        "tools[0].name",
        None,
    );
    assert_refused(
        &server,
        json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
        "text.format.type",
        None,
    );
    assert_refused(&server, json!({"input": "x", "reasoning": {"effort": "max"}}), "reasoning.effort", None);
    assert_refused(&server, json!({"input": "x", "max_output_tokens": 0}), "max_output_tokens", None);
    assert_refused(&server, json!({"input": "x", "temperature": 3}), "temperature", None);
    assert_refused(
        &server,
        json!({"input": "x", "previous_response_id": "resp_nope"}),
        "previous_response_id",
        None,
    );
    assert_refused(&server, json!({"input": "x", "background": true}), "background", unsupported);
    assert_refused(&server, json!({"input": "x", "truncation": "auto"}), "truncation", unsupported);
    let long: String = (0..5000).map(|i| format!("{i} ")).collect();
    let (status, v) = post(&server, &json!({"input": long}));
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("context_length_exceeded")));
    // Nothing reached the engine.
    let (_, health) = read(agent().get(format!("{}/health", server.url())).call().unwrap());
    assert_eq!(health["completed"], 0);
}

#[test]
fn the_real_engine_continues_a_stored_response_from_its_cache() {
    let model = common::tiny_real_vocab();
    let server = real_server(model.path(), 512);
    let first = create(
        &server,
        &json!({"input": "Hello", "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 6,
                "reasoning": {"effort": "low"}}),
    );
    assert_eq!(first["reasoning"]["effort"], "low");
    assert_eq!(first["instructions"], "Be brief.");
    let usage = &first["usage"];
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    let out = usage["output_tokens"].as_u64().unwrap();
    assert!((1..=6).contains(&out), "{first}");
    let second = create(
        &server,
        &json!({"input": "Again", "instructions": "Be brief.", "previous_response_id": first["id"],
                "temperature": 0, "max_output_tokens": 4, "reasoning": {"effort": "low"}}),
    );
    let input = second["usage"]["input_tokens"].as_u64().unwrap();
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(input > usage["input_tokens"].as_u64().unwrap(), "the history is in the prompt: {second}");
    // At least the first prompt but its last token (`assistant`, which a turn with no
    // parsed output leaves for the next role) is reused.
    assert!(cached + 1 >= usage["input_tokens"].as_u64().unwrap(), "the first prompt is reused: {second}");
}
