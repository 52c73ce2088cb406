//! Malformed Harmony from real gpt-oss output (`fixtures/harmony/malformed/`, one file per
//! form seen in the peers' issue trackers) through every front-end's parse path: the
//! recovering parser fed token by token and at once, an assistant turn on a session (what
//! `chat` and `generate -p` run), and the HTTP server, streaming and not, with a runner
//! that replays the fixture's tokens.

use std::path::{Path, PathBuf};

use picchio::chat::{
    ChatEvent, Conversation, DeltaKind, HarmonyEncoding, Message, Tokenizer, TurnOptions, TurnParser,
    complete, parse_turn,
};
use picchio::config::ModelConfig;
use picchio::engine::Runner;
use picchio::experts::ExpertStats;
use picchio::model::forward::PhaseTimes;
use picchio::model::{LogitRows, Observer};
use picchio::sample::SamplingParams;
use picchio::serve::http::{HttpOptions, ServerHandle, serve};
use picchio::session::{Session, StopReason};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, Deserialize)]
struct Fixture {
    #[serde(skip)]
    name: String,
    /// Where the form was seen.
    #[allow(dead_code)]
    source: String,
    /// What the model wrote after the prompt's `<|start|>assistant`, special tokens as text.
    completion: String,
    /// The request's function tools.
    tools: Vec<String>,
    /// `auto` or `none`.
    tool_choice: String,
    expect: Expected,
}

impl Fixture {
    fn declared(&self) -> Vec<String> {
        if self.tool_choice == "none" { Vec::new() } else { self.tools.clone() }
    }

    fn tokens(&self) -> Vec<u32> {
        Tokenizer::new().encode_with_special(&self.completion)
    }
}

/// What the turn means, in OpenAI's terms.
#[derive(Debug, Default, Deserialize, PartialEq)]
struct Expected {
    content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Vec<Call>,
    finish_reason: String,
}

#[derive(Debug, Deserialize, PartialEq)]
struct Call {
    name: String,
    arguments: String,
}

fn fixtures() -> Vec<Fixture> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/harmony/malformed");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 25, "{} fixtures in {}", paths.len(), dir.display());
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            let mut f: Fixture =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            f.name = p.file_stem().unwrap().to_string_lossy().into_owned();
            f
        })
        .collect()
}

/// The OpenAI reading of generated messages: a recipient makes a tool call, analysis is
/// reasoning, everything else content (as the server maps them).
fn from_messages(messages: &[Message]) -> Expected {
    let mut e = Expected::default();
    for m in messages {
        if let Some(r) = &m.recipient {
            let name = r.strip_prefix("functions.").unwrap_or(r).to_string();
            e.tool_calls.push(Call { name, arguments: m.text() });
        } else if m.channel.as_deref() == Some("analysis") {
            e.reasoning.get_or_insert_with(String::new).push_str(&m.text());
        } else {
            e.content.get_or_insert_with(String::new).push_str(&m.text());
        }
    }
    e.finish_reason = finish_reason(!e.tool_calls.is_empty());
    e
}

fn finish_reason(called: bool) -> String {
    if called { "tool_calls" } else { "stop" }.to_string()
}

/// Collects streamed events the way a client would.
#[derive(Default)]
struct Collector(Expected);

impl Collector {
    fn event(&mut self, e: ChatEvent<'_>) {
        let x = &mut self.0;
        match e {
            ChatEvent::Reasoning(t) => x.reasoning.get_or_insert_with(String::new).push_str(t),
            ChatEvent::Answer(t) | ChatEvent::Commentary(t) => {
                x.content.get_or_insert_with(String::new).push_str(t)
            }
            ChatEvent::ToolCall { recipient, text: "" } => {
                let name = recipient.strip_prefix("functions.").unwrap_or(recipient).to_string();
                x.tool_calls.push(Call { name, arguments: String::new() });
            }
            ChatEvent::ToolCall { text, .. } => {
                x.tool_calls.last_mut().expect("arguments before the call opened").arguments.push_str(text)
            }
            ChatEvent::Token(_) | ChatEvent::Prefill { .. } => {}
        }
    }

    fn done(mut self) -> Expected {
        self.0.finish_reason = finish_reason(!self.0.tool_calls.is_empty());
        self.0
    }
}

#[test]
fn every_fixture_parses_the_same_token_by_token_and_at_once() {
    let h = HarmonyEncoding::new();
    for f in fixtures() {
        let mut parser = TurnParser::new(h, &f.declared());
        let mut seen = Collector::default();
        let mut deltas = Vec::new();
        for t in f.tokens() {
            deltas.extend(parser.push(t));
        }
        deltas.extend(parser.finish());
        for d in &deltas {
            let event = match &d.kind {
                DeltaKind::Reasoning => ChatEvent::Reasoning(&d.text),
                DeltaKind::Answer => ChatEvent::Answer(&d.text),
                DeltaKind::Commentary => ChatEvent::Commentary(&d.text),
                DeltaKind::ToolCall(r) => ChatEvent::ToolCall { recipient: r, text: &d.text },
            };
            seen.event(event);
        }
        assert_eq!(seen.done(), f.expect, "{}: streamed deltas", f.name);
        assert_eq!(from_messages(parser.messages()), f.expect, "{}: streamed messages", f.name);
        let at_once = parse_turn(h, &f.tokens(), &f.declared());
        assert_eq!(at_once, parser.messages(), "{}: at once", f.name);
    }
}

#[test]
fn a_long_headerless_answer_streams_before_the_turn_ends() {
    let f = fixtures().into_iter().find(|f| f.name == "no_header_long").unwrap();
    let tokens = f.tokens();
    let mut parser = TurnParser::new(HarmonyEncoding::new(), &[]);
    let first = tokens.iter().position(|&t| !parser.push(t).is_empty()).expect("no delta before the end");
    assert!(first < 60 && first + 10 < tokens.len(), "first text after {first} of {} tokens", tokens.len());
}

// ---------------------------------------------------------------------------------------
// A runner that replays a fixture.

/// Writes the completion of the fixture the prompt names (`fixture:NAME`), then
/// `<|endoftext|>`.
struct Replay {
    config: ModelConfig,
    tokenizer: Tokenizer,
    replies: Vec<(String, Vec<u32>)>,
    history: Vec<u32>,
    reply: Vec<u32>,
    reply_start: usize,
    predicted: Option<(usize, u32)>,
}

impl Replay {
    fn new(fixtures: &[Fixture]) -> Self {
        let spec = picchio::synth::SynthSpec::of(picchio::synth::SynthShape::Tiny);
        let config =
            ModelConfig::from_json_str(&spec.config_json().to_string(), Path::new("replay/config.json"))
                .unwrap();
        Replay {
            config,
            tokenizer: Tokenizer::new(),
            replies: fixtures.iter().map(|f| (format!("fixture:{}<|end|>", f.name), f.tokens())).collect(),
            history: Vec::new(),
            reply: Vec::new(),
            reply_start: 0,
            predicted: None,
        }
    }
}

impl Runner for Replay {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn capacity(&self) -> usize {
        8192
    }

    fn describe(&self) -> String {
        "replay".into()
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        _observer: &mut dyn Observer,
    ) -> picchio::Result<Vec<f32>> {
        let continues = ids.len() == 1 && self.predicted == Some((start_pos, ids[0]));
        self.history.truncate(start_pos);
        self.history.extend_from_slice(ids);
        if !continues {
            self.reply_start = self.history.len();
            let text = self.tokenizer.decode(&self.history).unwrap();
            self.reply = self
                .replies
                .iter()
                .find(|(key, _)| text.contains(key.as_str()))
                .map_or_else(|| panic!("the prompt names no fixture: {text}"), |(_, reply)| reply.clone());
        }
        let next = self.reply.get(self.history.len() - self.reply_start).copied().unwrap_or(199_999);
        let n = match rows {
            LogitRows::Last => 1,
            LogitRows::All => ids.len(),
            LogitRows::None => 0,
        };
        self.predicted = (n > 0).then_some((self.history.len(), next));
        let vocab = self.config.vocab_size;
        let mut logits = vec![0.0f32; n * vocab];
        for row in logits.chunks_exact_mut(vocab) {
            row[next as usize] = 40.0;
        }
        Ok(logits)
    }

    fn times(&self) -> PhaseTimes {
        PhaseTimes::default()
    }

    fn expert_stats(&self) -> ExpertStats {
        ExpertStats::default()
    }
}

#[test]
fn every_fixture_through_an_assistant_turn() {
    // `chat` and `generate -p` run `complete` (they declare no tools; the fixtures' tools
    // are declared here so calls are covered too).
    let all = fixtures();
    let mut session = Session::new(Box::new(Replay::new(&all)));
    let h = HarmonyEncoding::new();
    for f in &all {
        let convo = Conversation::from_messages([Message::user(format!("fixture:{}", f.name))]);
        let opts = TurnOptions {
            max_tokens: Some(400),
            sampling: SamplingParams::default(),
            declared_functions: f.declared(),
            stop: Vec::new(),
            grammar: None,
        };
        let mut seen = Collector::default();
        let outcome = complete(&mut session, &h, &convo, &opts, &mut |e| {
            seen.event(e);
            true
        })
        .unwrap();
        assert!(matches!(outcome.stop, StopReason::Stop(_)), "{}: {:?}", f.name, outcome.stop);
        assert_eq!(outcome.tokens, f.tokens(), "{}: the replayed tokens", f.name);
        assert_eq!(seen.done(), f.expect, "{}: streamed events", f.name);
        assert_eq!(from_messages(&outcome.messages), f.expect, "{}: messages", f.name);
    }
}

// ---------------------------------------------------------------------------------------
// Through the HTTP server.

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(60)))
        .build()
        .into()
}

fn request(f: &Fixture, stream: bool) -> Value {
    let tools: Vec<Value> = f
        .tools
        .iter()
        .map(|name| {
            json!({"type": "function", "function": {"name": name, "description": "A tool.",
                   "parameters": {"type": "object", "properties": {}}}})
        })
        .collect();
    json!({
        "model": "replay",
        "messages": [{"role": "user", "content": format!("fixture:{}", f.name)}],
        "tools": tools,
        "tool_choice": f.tool_choice,
        "stream": stream,
    })
}

fn post(server: &ServerHandle, body: &Value) -> ureq::http::Response<ureq::Body> {
    let resp = agent()
        .post(format!("{}/v1/chat/completions", server.url()))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    resp
}

fn non_streaming(server: &ServerHandle, f: &Fixture) -> Expected {
    let v: Value =
        serde_json::from_str(&post(server, &request(f, false)).body_mut().read_to_string().unwrap()).unwrap();
    let choice = &v["choices"][0];
    let m = &choice["message"];
    Expected {
        content: m["content"].as_str().map(str::to_string),
        reasoning: m["reasoning_content"].as_str().map(str::to_string),
        tool_calls: m["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| Call {
                name: c["function"]["name"].as_str().unwrap().to_string(),
                arguments: c["function"]["arguments"].as_str().unwrap().to_string(),
            })
            .collect(),
        finish_reason: choice["finish_reason"].as_str().unwrap().to_string(),
    }
}

fn streaming(server: &ServerHandle, f: &Fixture) -> Expected {
    use std::io::BufRead;
    let resp = post(server, &request(f, true));
    let mut e = Expected::default();
    let mut done = false;
    for line in std::io::BufReader::new(resp.into_body().into_reader()).lines().map_while(Result::ok) {
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        let Some(choice) = v["choices"].get(0) else { continue };
        let delta = &choice["delta"];
        // The role chunk carries an empty content: not an answer.
        if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            e.content.get_or_insert_with(String::new).push_str(t);
        }
        if let Some(t) = delta["reasoning_content"].as_str() {
            e.reasoning.get_or_insert_with(String::new).push_str(t);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if call["id"].is_string() {
                assert_eq!(index, e.tool_calls.len(), "{}: a new call takes the next index", f.name);
                let name = call["function"]["name"].as_str().unwrap().to_string();
                e.tool_calls.push(Call { name, arguments: String::new() });
            }
            e.tool_calls[index].arguments.push_str(call["function"]["arguments"].as_str().unwrap());
        }
        if let Some(r) = choice["finish_reason"].as_str() {
            e.finish_reason = r.to_string();
        }
    }
    assert!(done, "{}: no [DONE]", f.name);
    e
}

#[test]
fn every_fixture_through_http_streaming_and_not() {
    let all = fixtures();
    let session = Session::new(Box::new(Replay::new(&all)));
    let server =
        // The replayed tokens are malformed on purpose: the tool grammar (which would make
        // them impossible) is off, so the parser's recovery is what is tested.
        serve(
            std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
            session,
            HttpOptions { tool_grammar: false, ..HttpOptions::new("replay") },
        )
            .unwrap();
    for f in &all {
        assert_eq!(non_streaming(&server, f), f.expect, "{}: non-streaming", f.name);
        assert_eq!(streaming(&server, f), f.expect, "{}: streaming", f.name);
    }
}
