//! ChatML for Qwen3-MoE: the Hugging Face tokenizer, the rendering (token-exact against
//! Transformers' `apply_chat_template` on Qwen3's template, `fixtures/chatml/`), the turn
//! parser, and chat sessions through `generate -p`, `chat` and the HTTP server on the tiny
//! Qwen3 fixture with the fixture tokenizer (`fixtures/qwen3-tokenizer/`; the real Qwen
//! vocabulary is not available here).

#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use picchio::chat::{ChatFormat, ChatMl, DeltaKind, HfTokenizer, TextTokenizer};
use picchio::config::ModelFamily;
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::serve::http::{HttpOptions, render_request_with, serve};
use picchio::session::Session;
use serde_json::{Value, json};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn tokenizer_dir() -> PathBuf {
    fixtures().join("qwen3-tokenizer")
}

fn chatml(thinking: bool) -> ChatMl {
    ChatMl::from_dir(&tokenizer_dir()).unwrap().with_thinking(thinking)
}

fn references() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("chatml/references.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn rendering_is_token_exact_with_transformers() {
    let cases = references();
    assert!(cases.len() >= 7);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let thinking = case.get("enable_thinking").and_then(Value::as_bool).unwrap_or(true);
        let format = ChatFormat::ChatMl(Arc::new(chatml(thinking)));
        // Through the HTTP server's converter, as a request would go.
        let mut body = json!({"model": "x", "messages": case["messages"]});
        if let Some(tools) = case.get("tools") {
            body["tools"] = tools.clone();
        }
        let ours = render_request_with(&format, body.to_string().as_bytes(), "2026-01-01").unwrap();
        let expected = ids(&case["ids"]);
        let text = format.tokenizer().decode(&ours).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{name}: text");
        assert_eq!(ours, expected, "{name}: token IDs");
    }
}

#[test]
fn encoding_with_special_tokens_matches_transformers_and_plain_encoding_never_makes_them() {
    let t = HfTokenizer::from_file(&tokenizer_dir().join("tokenizer.json")).unwrap();
    assert_eq!(t.vocab_size(), 760);
    for case in references() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(t.encode_with_special(text).unwrap(), ids(&case["ids"]), "{}", case["name"]);
        let plain = t.encode(text).unwrap();
        assert!(plain.iter().all(|&id| !t.is_special(id)), "plain encoding made a control token");
        assert_eq!(t.decode(&plain).unwrap(), text, "plain encoding round-trips");
    }
    let im_end = t.special_id("<|im_end|>").unwrap();
    assert!(t.is_special(im_end));
    assert_eq!(t.decode(&[im_end]).unwrap(), "<|im_end|>");
    assert!(t.check(760).is_err());
    assert_eq!(t.special_id("<|nonexistent|>"), None);
}

#[test]
fn round_trips_and_streaming_never_split_a_character() {
    let t =
        TextTokenizer::Hf(Arc::new(HfTokenizer::from_file(&tokenizer_dir().join("tokenizer.json")).unwrap()));
    let text = "Caffè 🙂 東京の天気 — naïve ∞\n\t tabs and  spaces ";
    let ids = t.encode(text).unwrap();
    assert_eq!(t.decode(&ids).unwrap(), text);
    // A character split over tokens (the emoji is 4 bytes, bytes-level tokens hold fewer).
    let mut split = false;
    let mut d = t.stream_decoder();
    let mut out = String::new();
    for &id in &ids {
        let bytes = t.token_bytes(id).unwrap();
        split |= std::str::from_utf8(&bytes).is_err();
        if let Some(piece) = d.push(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "a piece split a character: {piece:?}");
            out.push_str(&piece);
        }
    }
    assert!(d.finish().is_none());
    assert_eq!(out, text);
    assert!(split, "the text should have a character split across tokens");
    assert!(d.push(10_000).is_err());
}

#[test]
fn stop_tokens_come_from_generation_config() {
    let c = chatml(true);
    let t = c.tokenizer();
    let (im_end, eot) = (t.special_id("<|im_end|>").unwrap(), t.special_id("<|endoftext|>").unwrap());
    assert_eq!(c.stop_tokens(), [im_end, eot]);
    // An int, and absent (by name).
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(tokenizer_dir().join("tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(ChatMl::from_dir(dir.path()).unwrap().stop_tokens(), [im_end, eot]);
    std::fs::write(dir.path().join("generation_config.json"), format!("{{\"eos_token_id\": {eot}}}"))
        .unwrap();
    assert_eq!(ChatMl::from_dir(dir.path()).unwrap().stop_tokens(), [eot]);
    std::fs::write(dir.path().join("generation_config.json"), "{\"eos_token_id\": \"x\"}").unwrap();
    let e = ChatMl::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("generation_config.json") && e.contains("eos_token_id"), "{e}");
    // No tokenizer at all: the error names the path and what is needed.
    let empty = tempfile::tempdir().unwrap();
    let e = ChatFormat::for_family(ModelFamily::Qwen3Moe, &[empty.path().to_path_buf()], true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&empty.path().join("tokenizer.json").display().to_string()) && e.contains("--tokenizer"),
        "{e}"
    );
    // GPT-OSS needs none.
    assert!(matches!(
        ChatFormat::for_family(ModelFamily::GptOss, &[], true).unwrap(),
        ChatFormat::Harmony(_)
    ));
}

/// Tokens of `text` with control tokens, as the model would generate them.
fn generated(format: &ChatFormat, text: &str) -> Vec<u32> {
    format.tokenizer().encode_with_special(text).unwrap()
}

/// The deltas of `text` parsed token by token, joined by kind, and the messages.
fn parse(
    format: &ChatFormat,
    text: &str,
    declared: &[&str],
) -> (Vec<(DeltaKind, String)>, Vec<picchio::chat::Message>) {
    let declared: Vec<String> = declared.iter().map(|s| s.to_string()).collect();
    let mut p = format.turn_parser(&declared);
    let mut deltas: Vec<(DeltaKind, String)> = Vec::new();
    let mut all = Vec::new();
    for t in generated(format, text) {
        all.extend(p.push(t));
    }
    all.extend(p.finish());
    for d in all {
        match deltas.last_mut() {
            Some((k, s)) if *k == d.kind && !matches!(k, DeltaKind::ToolCall(_)) => s.push_str(&d.text),
            _ => deltas.push((d.kind, d.text)),
        }
    }
    (deltas, p.into_messages())
}

#[test]
fn the_parser_gives_reasoning_answer_and_tool_calls() {
    let f = ChatFormat::ChatMl(Arc::new(chatml(true)));
    let (d, m) = parse(&f, "<think>\nLet me see.\n\nOk.\n</think>\n\nIt is sunny 🙂.<|im_end|>", &[]);
    assert_eq!(
        d,
        [(DeltaKind::Reasoning, "Let me see.\n\nOk.".into()), (DeltaKind::Answer, "It is sunny 🙂.".into())]
    );
    assert_eq!((m[0].channel.as_deref(), m[0].text().as_str()), (Some("analysis"), "Let me see.\n\nOk."));
    assert_eq!((m[1].channel.as_deref(), m[1].text().as_str()), (Some("final"), "It is sunny 🙂."));

    let text = "<think>\nCall it.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>";
    let (d, m) = parse(&f, text, &["get_weather"]);
    let call = DeltaKind::ToolCall("functions.get_weather".into());
    assert_eq!(
        d,
        [
            (DeltaKind::Reasoning, "Call it.".into()),
            (call.clone(), String::new()),
            (call, "{\"city\":\"Rome\"}".into())
        ]
    );
    assert_eq!(m.last().unwrap().recipient.as_deref(), Some("functions.get_weather"));
    assert_eq!(m.last().unwrap().text(), "{\"city\":\"Rome\"}");
}

#[test]
fn malformed_or_undeclared_calls_stay_text() {
    let f = ChatFormat::ChatMl(Arc::new(chatml(true)));
    let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\"\n</tool_call><|im_end|>";
    let (d, m) = parse(&f, bad, &["get_weather"]);
    assert_eq!(
        d,
        [(
            DeltaKind::Answer,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\"\n</tool_call>".into()
        )]
    );
    assert!(m.iter().all(|m| m.recipient.is_none()));
    // Undeclared: text.
    let (d, _) =
        parse(&f, "<tool_call>\n{\"name\": \"rm\", \"arguments\": {}}\n</tool_call>", &["get_weather"]);
    assert!(matches!(&d[..], [(DeltaKind::Answer, t)] if t.contains("\"rm\"")), "{d:?}");
    // Cut off inside the call (no closing tag), and a stray control token: kept, no panic.
    let (d, _) = parse(&f, "Hi<|im_start|> there<tool_call>\n{\"name\": ", &["get_weather"]);
    assert_eq!(d, [(DeltaKind::Answer, "Hi there<tool_call>\n{\"name\": ".into())]);
}

// ---------------------------------------------------------------------------------------
// Sessions on the tiny Qwen3 model (random weights: structure and consistency, not text).

fn model_dir() -> PathBuf {
    fixtures().join("qwen3-tiny-f32")
}

fn picchio(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().unwrap()
}

#[test]
fn generate_p_runs_a_chatml_turn_and_finds_the_tokenizer() {
    let cache = tempfile::tempdir().unwrap();
    let m = model_dir();
    let base = ["-q", "generate", "-m", m.to_str().unwrap(), "--cache-dir", cache.path().to_str().unwrap()];
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(&["-p", "Hello there", "-n", "12", "--temperature", "0", "--ctx", "256"]);
        args.extend_from_slice(extra);
        picchio(&args)
    };
    let out = run(&[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // --tokenizer from elsewhere gives the same turn; a directory without one is refused by path.
    let again = run(&["--tokenizer", tokenizer_dir().to_str().unwrap()]);
    assert!(again.status.success());
    assert_eq!(out.stdout, again.stdout, "greedy turns differ");
    let empty = tempfile::tempdir().unwrap();
    let refused = run(&["--tokenizer", empty.path().to_str().unwrap()]);
    assert!(!refused.status.success());
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(e.contains("tokenizer.json") && e.contains(empty.path().to_str().unwrap()), "{e}");
}

#[test]
fn chat_runs_chatml_turns_in_a_terminal() {
    use expectrl::{Eof, Expect, Regex};
    let cache = tempfile::tempdir().unwrap();
    let cmd = format!(
        "{} -q chat -m {} --cache-dir {} --max-tokens 20 --seed 3 --ctx 1024",
        env!("CARGO_BIN_EXE_picchio"),
        model_dir().display(),
        cache.path().display()
    );
    let mut p = expectrl::spawn(cmd).expect("spawn picchio chat");
    p.set_expect_timeout(Some(Duration::from_secs(120)));
    p.expect("chatml").expect("the banner names the format");
    p.expect(">>> ").expect("first prompt");
    p.send_line("Hello, who are you?").unwrap();
    p.expect(">>> ").expect("prompt after the first answer");
    p.send_line("Tell me more.").unwrap();
    p.expect(">>> ").expect("prompt after the second answer");
    p.send_line("/stats").unwrap();
    let reused = p.expect(Regex(r"\((\d+) reused from the cache\)")).expect("/stats");
    let n: usize = String::from_utf8_lossy(reused.matches().nth(1).unwrap()).parse().unwrap();
    assert!(n > 0, "the second turn reused nothing");
    p.expect(">>> ").unwrap();
    p.send_line("/exit").unwrap();
    p.expect(Eof).expect("exit");
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

fn post(url: &str, body: &Value) -> (u16, String) {
    let mut resp =
        agent().post(url).header("content-type", "application/json").send(body.to_string()).unwrap();
    (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap())
}

#[test]
fn the_http_server_speaks_chatml() {
    let dir = model_dir();
    let format = ChatFormat::for_family(ModelFamily::Qwen3Moe, std::slice::from_ref(&dir), true).unwrap();
    let model = engine::open(&dir, &OpenOptions { ctx: 512, ..Default::default() }).unwrap();
    let session = Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx: 512, max_batch: 64, ..Default::default() }).unwrap(),
    );
    let options = HttpOptions { chat_format: format.clone(), ..HttpOptions::new("qwen3-tiny") };
    let server = serve(std::net::TcpListener::bind("127.0.0.1:0").unwrap(), session, options).unwrap();
    let url = server.url();
    let request = json!({"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 0});

    // Not streaming: the prompt is the ChatML rendering, the tokens are what greedy gives.
    let (status, text) = post(&format!("{url}/v1/chat/completions"), &request);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let expected_prompt = render_request_with(&format, request.to_string().as_bytes(), "2026-01-01").unwrap();
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, expected_prompt.len());
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(completion > 0 && completion <= 10);
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    let reasoning = v["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or_default().to_string();

    // The same turn on a session of our own, through the library: the same text.
    let session_model = engine::open(&dir, &OpenOptions { ctx: 512, ..Default::default() }).unwrap();
    let mut own = Session::new(
        engine::cpu_runner(&session_model, &RunOptions { ctx: 512, max_batch: 64, ..Default::default() })
            .unwrap(),
    );
    let opts = picchio::chat::TurnOptions {
        max_tokens: Some(10),
        sampling: picchio::sample::SamplingParams::default(),
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
    };
    let turn =
        picchio::chat::complete_prompt(&mut own, &format, &expected_prompt, &opts, &mut |_| true).unwrap();
    assert_eq!(turn.completion_tokens as u64, completion);
    // The model has 1100 IDs, the tokenizer 760: the rest are never sampled.
    assert!(turn.tokens.iter().all(|&t| t < 760), "{:?}", turn.tokens);
    assert_eq!(turn.answer().unwrap_or_default(), content);
    assert_eq!(turn.reasoning(), reasoning);

    // Streaming: the deltas add up to the same content.
    let (status, text) = post(
        &format!("{url}/v1/chat/completions"),
        &json!({"stream": true, "model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 0}),
    );
    assert_eq!(status, 200);
    let mut streamed = String::new();
    let mut streamed_reasoning = String::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|l| *l != "[DONE]") {
        let chunk: Value = serde_json::from_str(line).unwrap();
        if let Some(delta) = chunk["choices"].get(0).map(|c| &c["delta"]) {
            streamed.push_str(delta["content"].as_str().unwrap_or_default());
            streamed_reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(streamed, content);
    assert_eq!(streamed_reasoning, reasoning);

    // A request with a tool call and its result is rendered as ChatML (checked by /tokenize).
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let with_call = json!({"model": "x", "tools": tools, "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]});
    let (status, text) = post(&format!("{url}/tokenize"), &with_call);
    assert_eq!(status, 200, "{text}");
    let tokens: Vec<u32> = serde_json::from_str::<Value>(&text).unwrap()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let rendered = format.tokenizer().decode(&tokens).unwrap();
    assert!(
        rendered.contains(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"
        ),
        "{rendered}"
    );
    assert!(
        rendered.contains("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>"),
        "{rendered}"
    );
    assert!(rendered.ends_with("<|im_start|>assistant\n"), "{rendered}");
    let (status, text) = post(
        &format!("{url}/v1/chat/completions"),
        &json!({"model": "x", "tools": with_call["tools"], "messages": with_call["messages"], "max_tokens": 5}),
    );
    assert_eq!(status, 200, "{text}");
    // Constrained decoding is Harmony-only: refused with a reason.
    let (status, text) = post(
        &format!("{url}/v1/chat/completions"),
        &json!({"model": "x", "tools": tools, "tool_choice": "required", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("ChatML"), "{text}");
    server.shutdown();
}

#[test]
fn the_stdio_protocol_stops_at_the_chatml_stop_tokens() {
    use std::io::{BufRead, BufReader, Write};
    let cache = tempfile::tempdir().unwrap();
    let m = model_dir();
    let mut child = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["-q", "serve", "--stdio", "--ctx", "256", "-m", m.to_str().unwrap()])
        .args(["--cache-dir", cache.path().to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    out.read_line(&mut ready).unwrap();
    child.stdin.take().unwrap().write_all(b"SHUTDOWN\n").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(child.wait().unwrap().success(), "{rest}");
    let stops = chatml(true).stop_tokens().iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    assert_eq!(ready.trim(), format!("READY 256 1100 {stops}"));
}

#[test]
fn convert_copies_the_tokenizer_files_into_the_container() {
    use picchio::format::container::{ConvertOptions, Formats};
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("alt");
    let opts = ConvertOptions { formats: Formats::default(), progress: false, interrupt_after: None };
    picchio::format::container::convert(&fixtures().join("qwen3-alt-f32"), &target, &opts).unwrap();
    for name in picchio::chat::TOKENIZER_FILES {
        let copied = std::fs::read(target.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(copied, std::fs::read(fixtures().join("qwen3-alt-f32").join(name)).unwrap(), "{name}");
    }
    // The container alone gives the model its format.
    let model = engine::open(&target, &OpenOptions { ctx: 128, ..Default::default() }).unwrap();
    let format = ChatFormat::for_family(model.config.family, std::slice::from_ref(&model.dir), true).unwrap();
    assert_eq!(format.name(), "chatml");
}
