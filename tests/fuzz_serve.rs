//! Fuzzing of the servers' input handling, a few seconds per run:
//!
//! - the stdio protocol, in-process on the tiny fixture model: random bad lines (bytes that
//!   are not UTF-8, unknown commands, `TURN`s broken in one field, over-long and blank lines)
//!   between two valid turns; every bad line gets exactly one non-fatal `ERROR` (a blank line
//!   none), and the valid turns answer exactly as in a fresh session given only them;
//! - the HTTP request converter (`check_request`): arbitrary JSON values, mutated valid
//!   requests, truncated and garbage-tailed bodies; never a panic, and a clean `Err` for
//!   every input that cannot be a request.

mod common;

use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::serve::http::check_request;
use picchio::serve::stdio::max_line_bytes;
use picchio::session::Session;
use proptest::prelude::*;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------
// stdio.

/// Context of the fuzzed session.
const CTX: usize = 64;

/// The fixture's vocabulary size.
const VOCAB: u64 = 1000;

/// The first valid turn, from an empty cache.
const FIRST: &str = "TURN 3 0 0 1 0 3 1 2 3";

/// `pos` after [`FIRST`]: its 3 IDs and 3 tokens (the fixture's vocabulary has no stop token).
const POS: usize = 6;

fn second() -> String {
    format!("TURN 4 {POS} 0.8 0.9 20 2 7 8 seed=11")
}

fn fixture_session() -> (tempfile::TempDir, Session) {
    let dir = common::convert_fixture("tiny-f32", Default::default());
    let model = engine::open(dir.path(), &OpenOptions { ctx: CTX, ..Default::default() }).unwrap();
    let runner = engine::cpu_runner(&model, &RunOptions { ctx: CTX, max_batch: 64, ..Default::default() });
    (dir, Session::new(runner.unwrap()))
}

/// The reply lines of the protocol over `script`.
fn talk(session: &mut Session, script: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    picchio::serve::stdio::serve(session, script, &mut out).expect("serve ends cleanly");
    String::from_utf8(out).expect("replies are UTF-8").lines().map(String::from).collect()
}

fn answers(lines: &[String]) -> Vec<String> {
    lines.iter().filter(|l| l.starts_with("TOKEN ") || l.starts_with("DONE ")).cloned().collect()
}

/// A value that no numeric field of a `TURN` accepts (not a number, negative, not finite, or
/// out of range for every field).
fn bad_number() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("x".to_string()),
        Just("-1".to_string()),
        Just("NaN".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("1e39".to_string()),
        Just("0x10".to_string()),
        Just("--1".to_string()),
        "[a-z!@#%]{1,6}",
        // (Not "-0": a valid temperature.)
        "-[1-9][0-9]{0,3}",
        // (No `e` or `.`: "1e5" and "1.5" are numbers.)
        "[0-9]{1,3}[a-df-z]{1,3}[0-9]?",
    ]
}

/// The fields of a valid `TURN` continuing after [`FIRST`].
fn valid_fields() -> Vec<String> {
    ["TURN", "2", &POS.to_string(), "0.5", "0.9", "10", "2", "5", "6", "seed=1"].map(String::from).to_vec()
}

/// A `TURN` broken in one way, each one that the protocol must refuse.
fn broken_turn() -> impl Strategy<Value = Vec<String>> {
    prop_oneof![
        // A numeric field that is no valid number for it.
        (1usize..=6, bad_number()).prop_map(|(i, v)| {
            let mut f = valid_fields();
            f[i] = v;
            f
        }),
        // An ID outside the vocabulary, or not a u32.
        (
            7usize..=8,
            prop_oneof![
                (VOCAB..=u64::from(u32::MAX)).prop_map(|v| v.to_string()),
                Just("4294967296".into()),
                "-[0-9]{1,3}"
            ]
        )
            .prop_map(|(i, v)| {
                let mut f = valid_fields();
                f[i] = v;
                f
            }),
        // n_ids beyond the IDs given (the option then reads as an ID, or IDs run out).
        (3usize..100_000).prop_map(|n| {
            let mut f = valid_fields();
            f[6] = n.to_string();
            f
        }),
        // keep beyond pos.
        (POS + 1..usize::MAX).prop_map(|k| {
            let mut f = valid_fields();
            f[2] = k.to_string();
            f
        }),
        // A bad option.
        prop_oneof![
            Just("bogus=1".to_string()),
            Just("seed".to_string()),
            Just("seed=x".to_string()),
            Just("min_p=2".to_string()),
            Just("rep=0".to_string()),
            Just("rep=-1".to_string()),
            Just("rep_window=-1".to_string()),
            "[a-z_]{1,8}=[0-9]{0,3}".prop_filter("a known option", |o| {
                !["seed=", "min_p=", "rep=", "rep_window="].iter().any(|k| o.starts_with(k))
            }),
        ]
        .prop_map(|o| {
            let mut f = valid_fields();
            f[9] = o;
            f
        }),
        // Missing fields.
        (1usize..=6).prop_map(|m| valid_fields()[..m].to_vec()),
        // More IDs than the context holds.
        Just({
            let mut f = valid_fields()[..6].to_vec();
            f.push((CTX - POS + 1).to_string());
            f.extend(std::iter::repeat_n("9".to_string(), CTX - POS + 1));
            f
        }),
        // Nothing to consume and nothing to continue from (keep below pos, no IDs).
        (0..POS).prop_map(|k| ["TURN", "2", &k.to_string(), "0", "1", "0", "0"].map(String::from).to_vec()),
    ]
}

/// One bad line (without its newline) and whether it must be answered (a blank line is not).
fn bad_line() -> impl Strategy<Value = (Vec<u8>, bool)> {
    let cap = max_line_bytes(CTX);
    let sep = prop_oneof![Just(" "), Just("\t"), Just("  "), Just(" \t ")];
    prop_oneof![
        // Not UTF-8: random bytes with a 0xff somewhere.
        (
            proptest::collection::vec(any::<u8>().prop_filter("newline", |b| *b != b'\n'), 0..80),
            any::<prop::sample::Index>()
        )
            .prop_map(|(mut bytes, at)| {
                let i = at.index(bytes.len() + 1);
                bytes.insert(i, 0xff);
                (bytes, true)
            }),
        // An unknown command.
        ("[A-Za-z0-9_=.-]{1,12}", "[ -~\t]{0,60}")
            .prop_filter("a known command", |(cmd, _)| !["TURN", "RESET", "SHUTDOWN"].contains(&cmd.as_str()))
            .prop_map(|(cmd, rest)| (format!("{cmd} {rest}").into_bytes(), true)),
        // A broken TURN, its fields separated by random blanks.
        (broken_turn(), sep).prop_map(|(fields, sep)| (fields.join(sep).into_bytes(), true)),
        // Over the line cap.
        (1usize..3000, "[ -~]{0,20}").prop_map(move |(extra, head)| {
            let mut line = format!("TURN {head}").into_bytes();
            line.resize(cap + extra, b'7');
            (line, true)
        }),
        // Blank.
        "[ \t\r]{0,8}".prop_map(|s| (s.into_bytes(), false)),
    ]
}

#[test]
fn random_bad_lines_leave_the_session_as_a_fresh_one() {
    let (_dir, mut fresh) = fixture_session();
    let expect = answers(&talk(&mut fresh, format!("{FIRST}\n{}\n", second()).as_bytes()));
    assert_eq!(expect.last().map(String::as_str), Some("DONE MAX_TOKENS 4 12"), "{expect:?}");
    let (_dir2, session) = fixture_session();
    let session = std::cell::RefCell::new(session);
    let config = ProptestConfig { cases: 600, failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |(lines in proptest::collection::vec(bad_line(), 1..8))| {
        let mut script = format!("{FIRST}\n").into_bytes();
        for (line, _) in &lines {
            script.extend_from_slice(line);
            script.push(b'\n');
        }
        script.extend_from_slice(format!("{}\n", second()).as_bytes());
        let out = talk(&mut session.borrow_mut(), &script);
        let errors: Vec<&String> = out.iter().filter(|l| l.starts_with("ERROR ")).collect();
        let answered = lines.iter().filter(|(_, answered)| *answered).count();
        prop_assert_eq!(errors.len(), answered, "{:?}", out);
        for e in &errors {
            prop_assert!(e.split(' ').nth(2) == Some("0"), "a fatal error: {}", e);
        }
        prop_assert_eq!(answers(&out), expect.clone());
    });
}

// ---------------------------------------------------------------------------------------
// The HTTP request converter.

/// Field names of requests, messages and tools, so that random objects hit real fields.
const KEYS: [&str; 36] = [
    "messages",
    "role",
    "content",
    "tool_calls",
    "tools",
    "function",
    "name",
    "arguments",
    "parameters",
    "type",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "include_usage",
    "tool_choice",
    "reasoning_effort",
    "response_format",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
    "logprobs",
    "top_logprobs",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "return_token_ids",
    "text",
    "id",
];

/// Strings that mean something to the converter.
const WORDS: [&str; 14] = [
    "user",
    "assistant",
    "system",
    "developer",
    "tool",
    "function",
    "text",
    "auto",
    "none",
    "low",
    "high",
    "get_weather",
    "call_1",
    "<|start|>",
];

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        prop_oneof![Just(1e308f64), Just(-1e308), Just(f64::MIN_POSITIVE), Just(3.5e38)]
            .prop_map(Value::from),
        proptest::sample::select(WORDS.as_slice()).prop_map(Value::from),
        ".{0,24}".prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec(
                (
                    prop_oneof![
                        proptest::sample::select(KEYS.as_slice()).prop_map(String::from),
                        "[a-z_]{0,8}"
                    ],
                    inner
                ),
                0..6,
            )
            .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
}

/// A valid request using most features.
fn valid_request() -> Value {
    json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": null, "reasoning_content": "Call it.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
            {"role": "user", "content": "Thanks"}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_tokens": 9, "seed": 3,
        "stream": false, "reasoning_effort": "low", "tool_choice": "auto"
    })
}

/// Replaces, removes or adds a value at a random place of `v`: `path` steers the walk,
/// `action` picks what happens at its end.
fn mutate(v: &mut Value, path: &[prop::sample::Index], action: u8, new: Value) {
    let Some((step, rest)) = path.split_first() else {
        *v = new;
        return;
    };
    match v {
        Value::Object(map) if !map.is_empty() => {
            let key = map.keys().nth(step.index(map.len())).cloned().expect("index within the map");
            if rest.is_empty() && action.is_multiple_of(3) {
                map.remove(&key);
            } else if rest.is_empty() && action % 3 == 1 {
                map.insert(KEYS[step.index(KEYS.len())].to_string(), new);
            } else if let Some(child) = map.get_mut(&key) {
                mutate(child, rest, action, new);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            let i = step.index(items.len());
            if rest.is_empty() && action.is_multiple_of(3) {
                items.remove(i);
            } else {
                mutate(&mut items[i], rest, action, new);
            }
        }
        _ => *v = new,
    }
}

fn fuzz_config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

#[test]
fn the_valid_request_is_accepted() {
    let n = check_request(valid_request().to_string().as_bytes()).unwrap();
    assert!(n > 20, "{n} prompt tokens");
}

#[test]
fn arbitrary_json_never_panics_and_non_objects_are_refused() {
    proptest!(fuzz_config(1500), |(v in json_value())| {
        let result = check_request(v.to_string().as_bytes());
        if !v.is_object() {
            prop_assert!(result.is_err(), "{} was accepted", v);
        }
        if let Err(e) = result {
            prop_assert!(!e.to_string().is_empty());
        }
    });
}

#[test]
fn mutated_requests_never_panic() {
    let base = valid_request();
    proptest!(fuzz_config(1500), |(
        path in proptest::collection::vec(any::<prop::sample::Index>(), 1..6),
        action in any::<u8>(),
        new in json_value(),
    )| {
        let mut v = base.clone();
        mutate(&mut v, &path, action, new);
        // Accepted or refused, never a panic.
        let _ = check_request(v.to_string().as_bytes());
    });
}

#[test]
fn bad_values_of_known_fields_are_refused() {
    let base = valid_request();
    let bad = prop_oneof![
        (
            Just("temperature"),
            prop_oneof![
                (2.0001f64..1e30).prop_map(Value::from),
                (-1e30f64..-1e-9).prop_map(Value::from),
                ".{0,5}".prop_map(Value::from)
            ]
        ),
        (
            Just("top_p"),
            prop_oneof![(1.0001f64..1e30).prop_map(Value::from), (-1e30f64..=0.0).prop_map(Value::from)]
        ),
        (Just("top_k"), (i64::MIN..-1).prop_map(Value::from)),
        (
            Just("min_p"),
            prop_oneof![(1.0001f64..1e9).prop_map(Value::from), (-1e9f64..-1e-9).prop_map(Value::from)]
        ),
        (
            Just("max_tokens"),
            prop_oneof![
                Just(Value::from(0)),
                (i64::MIN..0).prop_map(Value::from),
                (0.5f64..1e9).prop_map(Value::from)
            ]
        ),
        (Just("n"), (2u64..u64::MAX).prop_map(Value::from)),
        (Just("seed"), prop_oneof![(0.5f64..1e9).prop_map(Value::from), ".{0,5}".prop_map(Value::from)]),
        (
            Just("messages"),
            prop_oneof![Just(json!([])), Just(Value::Null), any::<i64>().prop_map(Value::from)]
        ),
        (
            Just("reasoning_effort"),
            "[a-z]{0,8}"
                .prop_filter("known", |s| !["low", "medium", "high"].contains(&s.as_str()))
                .prop_map(Value::from)
        ),
        (Just("repetition_penalty"), (-1e9f64..=0.0).prop_map(Value::from)),
    ];
    proptest!(fuzz_config(1500), |((field, value) in bad)| {
        let mut v = base.clone();
        v[field] = value.clone();
        let result = check_request(v.to_string().as_bytes());
        prop_assert!(result.is_err(), "{} = {} was accepted", field, value);
    });
}

#[test]
fn truncated_bodies_and_trailing_garbage_are_refused() {
    let body = valid_request().to_string();
    let len = body.len();
    proptest!(fuzz_config(1500), |(cut in 0..len, tail in "[^ \t\r\n]{1,8}", flip in 0..len, byte in any::<u8>())| {
        prop_assert!(check_request(&body.as_bytes()[..cut]).is_err(), "a prefix of {} bytes was accepted", cut);
        let garbage = format!("{body}{tail}");
        prop_assert!(check_request(garbage.as_bytes()).is_err(), "trailing {:?} was accepted", tail);
        let mut flipped = body.clone().into_bytes();
        flipped[flip] = byte;
        let _ = check_request(&flipped);
    });
}
