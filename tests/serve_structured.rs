//! Structured output and forced tool calls over HTTP, through a real client, on a runner
//! whose logits are seeded noise or an adversary that prefers what the request forbids
//! (an undeclared function, a final answer instead of the required call, prose instead
//! of JSON): `response_format`, `text.format` and `tool_choice` hold whatever the model
//! prefers, streaming and not, on Chat Completions and Responses.

mod common;

use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::Session;
use serde_json::{Value, json};

use common::http::{events as stream, listener, ok, post};
use common::noisy::Noisy;

fn server(runner: Noisy) -> ServerHandle {
    serve(listener(), Session::new(Box::new(runner)), HttpOptions::new("noisy")).unwrap()
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

/// Whether `text` is JSON valid against [`person_schema`], checked keyword by keyword.
fn is_person(text: &str) -> bool {
    let Ok(Value::Object(o)) = serde_json::from_str::<Value>(text) else { return false };
    o.len() == 2
        && o.get("name").and_then(Value::as_str).is_some_and(|s| s.chars().count() <= 8)
        && o.get("age").and_then(Value::as_i64).is_some_and(|a| (0..=120).contains(&a))
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"], "additionalProperties": false}, "strict": true}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {}, "additionalProperties": false}}}
    ])
}

/// The same tools in the Responses API's flat spelling.
fn flat_tools() -> Value {
    Value::Array(
        tools()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let mut f = t["function"].clone();
                f["type"] = json!("function");
                f
            })
            .collect(),
    )
}

fn chat_body(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Tell me about someone."}],
        "max_tokens": 1500,
        "temperature": 1.0,
        "seed": 3
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

const PROSE: &str = "<|channel|>final<|message|>Sure! Here is the JSON you asked for: {name: Bob}<|return|>";
const EVIL_CALL: &str =
    "<|channel|>commentary to=functions.evil <|constrain|>json<|message|>{\"x\":1}<|call|>";
const WEATHER_CALL: &str =
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}<|call|>";

#[test]
fn json_schema_answers_validate_streaming_and_not() {
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person_schema(), "strict": true}});
    let s = server(Noisy::new(1, 8192).with_script(PROSE, 40.0));
    let v = ok(&s, "/v1/chat/completions", &chat_body(json!({"response_format": format})));
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{v}");
    let content = choice["message"]["content"].as_str().unwrap();
    assert!(is_person(content), "{content}");
    assert!(choice["message"]["tool_calls"].is_null());

    let chunks = stream(
        &s,
        "/v1/chat/completions",
        &chat_body(json!({"response_format": format, "stream": true, "seed": 9})),
    );
    let content: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert!(is_person(&content), "{content}");
    let finish: Vec<&str> = chunks.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finish, ["stop"]);

    // json_object: an object, whatever the adversary writes.
    let v = ok(&s, "/v1/chat/completions", &chat_body(json!({"response_format": {"type": "json_object"}})));
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(content).unwrap().is_object(), "{content}");
}

#[test]
fn required_and_named_tool_choices_force_a_valid_call() {
    // The adversary wants to call a function nobody declared; tool_choice requires a call
    // of a declared one. (Pure noise would write preambles until the token limit: the
    // reasoning and preambles before a required call stay free.)
    let s = server(Noisy::new(2, 8192).with_script(EVIL_CALL, 40.0));
    let v = ok(&s, "/v1/chat/completions", &chat_body(json!({"tools": tools(), "tool_choice": "required"})));
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    match calls[0]["function"]["name"].as_str().unwrap() {
        "get_weather" => assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 10), "{args}"),
        "get_time" => assert_eq!(args, json!({})),
        other => panic!("called {other}"),
    }

    // The adversary wants get_weather; the request names get_time (streamed).
    let s = server(Noisy::new(3, 8192).with_script(WEATHER_CALL, 40.0));
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let chunks = stream(
        &s,
        "/v1/chat/completions",
        &chat_body(json!({"tools": tools(), "tool_choice": named, "stream": true})),
    );
    let names: Vec<&str> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten())
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(names, ["get_time"]);
    let args: String = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten())
        .filter_map(|t| t["function"]["arguments"].as_str())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), json!({}));
    let finish: Vec<&str> = chunks.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finish, ["tool_calls"]);
}

#[test]
fn undeclared_and_forbidden_calls_cannot_be_generated() {
    // auto: the adversary calls `evil`, which nobody declared.
    let s = server(Noisy::new(4, 8192).with_script(EVIL_CALL, 40.0));
    let v = ok(&s, "/v1/chat/completions", &chat_body(json!({"tools": tools(), "return_token_ids": true})));
    let message = &v["choices"][0]["message"];
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        assert_ne!(call["function"]["name"], "evil", "{v}");
    }
    let text = format!("{}{}", message["content"], message["reasoning_content"]);
    assert!(!text.contains("functions.evil"), "{v}");

    // none: the adversary calls a declared function, which tool_choice forbids.
    let s = server(Noisy::new(5, 8192).with_script(WEATHER_CALL, 40.0));
    let v = ok(&s, "/v1/chat/completions", &chat_body(json!({"tools": tools(), "tool_choice": "none"})));
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{v}");
    assert!(choice["message"]["tool_calls"].is_null(), "{v}");
}

#[test]
fn responses_text_format_and_named_tool_choice() {
    let s = server(Noisy::new(6, 8192).with_script(PROSE, 40.0));
    let format = json!({"format": {"type": "json_schema", "name": "person", "schema": person_schema(), "strict": true}});
    let v = ok(
        &s,
        "/v1/responses",
        &json!({"input": "Someone?", "text": format, "max_output_tokens": 1500, "store": false}),
    );
    assert_eq!(v["status"], "completed", "{v}");
    let message = v["output"].as_array().unwrap().iter().find(|i| i["type"] == "message").unwrap();
    let text = message["content"][0]["text"].as_str().unwrap();
    assert!(is_person(text), "{text}");

    let s = server(Noisy::new(8, 8192).with_script(EVIL_CALL, 40.0));
    let named = json!({"type": "function", "name": "get_weather"});
    let v = ok(
        &s,
        "/v1/responses",
        &json!({"input": "Weather?", "tools": flat_tools(), "tool_choice": named, "max_output_tokens": 1500, "store": false}),
    );
    let calls: Vec<&Value> =
        v["output"].as_array().unwrap().iter().filter(|i| i["type"] == "function_call").collect();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["name"], "get_weather");
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{args}");

    // Streamed: the text deltas make valid JSON too.
    let s = server(Noisy::new(9, 8192).with_script(PROSE, 40.0));
    let events = stream(
        &s,
        "/v1/responses",
        &json!({"input": "Someone?", "text": format, "max_output_tokens": 1500, "store": false, "stream": true}),
    );
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert!(is_person(&text), "{text}");
}

#[test]
fn unenforceable_schemas_and_bad_choices_are_400_naming_the_parameter() {
    let s = server(Noisy::new(7, 8192));
    let unknown =
        json!({"type": "object", "properties": {"u": {"type": "string", "format": "no-such-format"}}});
    let cases = [
        (
            "/v1/chat/completions",
            chat_body(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unknown, "strict": true}}}),
            ),
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            chat_body(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": unknown, "strict": true}}], "tool_choice": "required"}),
            ),
            "tools[0].function.parameters",
        ),
        ("/v1/chat/completions", chat_body(json!({"tool_choice": "required"})), "tool_choice"),
        (
            "/v1/chat/completions",
            chat_body(
                json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            ),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat_body(json!({"response_format": {"type": "yaml"}})),
            "response_format.type",
        ),
        (
            "/v1/responses",
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": unknown, "strict": true}}}),
            "text.format.schema",
        ),
    ];
    for (path, body, param) in cases {
        let (status, v) = post(&s, path, &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    // Not strict: the keyword is ignored and the request is served.
    let lenient = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": unknown}});
    let (status, v) =
        post(&s, "/v1/chat/completions", &chat_body(json!({"response_format": lenient, "max_tokens": 5})));
    assert_eq!(status, 200, "{v}");
}
