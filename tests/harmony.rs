//! The tokenizer and the Harmony format against the official `openai-harmony` 0.0.8, whose
//! output is recorded in `fixtures/harmony/` by `gen_harmony.py` (no Python needed here).

use std::path::PathBuf;

use picchio::chat::tokenizer::special;
use picchio::chat::{
    Content, Conversation, HarmonyEncoding, MESSAGE_END_TOKENS, Message, ParseOptions, ParserState,
    RenderConfig, Role, STOP_TOKENS, StreamParser, Tokenizer, ToolNamespace, VOCAB_SIZE,
};
use serde::Deserialize;

fn fixture<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/harmony").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Panics with both renderings as text when the IDs differ.
fn assert_same_ids(tok: &Tokenizer, what: &str, got: &[u32], want: &[u32]) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        panic!(
            "{what}: IDs differ from index {first}\n got: {:?}\nwant: {:?}\n got text: {}\nwant text: {}",
            &got[first..(first + 8).min(got.len())],
            &want[first..(first + 8).min(want.len())],
            tok.decode(got).unwrap(),
            tok.decode(want).unwrap()
        );
    }
}

#[derive(Deserialize)]
struct RenderFile {
    cases: Vec<RenderCase>,
}

#[derive(Deserialize)]
struct RenderCase {
    name: String,
    auto_drop_analysis: bool,
    conversation: Conversation,
    completion_tokens: Vec<u32>,
    conversation_tokens: Vec<u32>,
    training_tokens: Vec<u32>,
    completion_text: String,
}

#[test]
fn renders_like_official() {
    let file: RenderFile = fixture("render.json");
    assert!(file.cases.len() >= 8);
    let h = HarmonyEncoding::new();
    let tok = h.tokenizer();
    for case in &file.cases {
        let config = RenderConfig { auto_drop_analysis: case.auto_drop_analysis };
        let convo = &case.conversation;
        let got = h.render_conversation_for_completion(convo, Role::Assistant, &config).unwrap();
        assert_same_ids(tok, &format!("{} completion", case.name), &got, &case.completion_tokens);
        assert_eq!(tok.decode_utf8(&got).unwrap(), case.completion_text, "{}", case.name);
        let got = h.render_conversation(convo, &config).unwrap();
        assert_same_ids(tok, &format!("{} conversation", case.name), &got, &case.conversation_tokens);
        let got = h.render_conversation_for_training(convo, &config).unwrap();
        assert_same_ids(tok, &format!("{} training", case.name), &got, &case.training_tokens);
        assert!(case.completion_tokens.ends_with(&[special::START, tok.encode("assistant")[0]]));

        // Our serde form reads back to the same conversation.
        let json = serde_json::to_string(convo).unwrap();
        assert_eq!(&Conversation::from_json(&json).unwrap(), convo, "{}", case.name);
    }
}

#[test]
fn rendering_rules_hold_in_fixtures() {
    let file: RenderFile = fixture("render.json");
    let text = |name: &str| &file.cases.iter().find(|c| c.name == name).unwrap().completion_text;
    let history = text("multi_turn_history");
    assert!(!history.contains("User asks a simple sum"), "analysis before the first final is dropped");
    assert!(history.contains("<|channel|>analysis<|message|>Multiply 4 by 3: 12.<|end|>"));
    assert!(
        history.contains("<|channel|>final<|message|>12.<|end|>"),
        "a final in history ends with <|end|>"
    );
    assert!(!history.contains("<|return|>"));
    assert!(text("multi_turn_history_keep_analysis").contains("User asks a simple sum."));
    let tools = text("function_tool_roundtrip");
    assert!(tools.contains("Calls to these tools must go to the commentary channel: 'functions'."));
    assert!(tools.contains(
        "<|start|>assistant to=functions.get_current_weather<|channel|>commentary <|constrain|>json<|message|>\
         {\"location\": \"San Francisco, CA\"}<|call|>"
    ));
    assert!(tools.contains(
        "<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>\
         {\"sunny\": true, \"temperature\": 20}<|end|>"
    ));
    assert!(text("single_user_medium").contains(
        "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message."
    ));
    assert!(text("ends_with_tool_call").ends_with("<|call|><|start|>assistant"));

    // The user's "<|end|>" is text, not the special token.
    let case = file.cases.iter().find(|c| c.name == "special_token_text").unwrap();
    let ends = case.completion_tokens.iter().filter(|&&t| t == special::END).count();
    assert_eq!(ends, 4, "system, user, assistant, user: one <|end|> each");
}

#[test]
fn builtin_tools_match_official() {
    let file: RenderFile = fixture("render.json");
    let case = file.cases.iter().find(|c| c.name == "builtin_tools").unwrap();
    let Content::System(sys) = &case.conversation.messages[0].content[0] else { panic!("no system content") };
    let tools = sys.tools.as_ref().unwrap();
    assert_eq!(tools["browser"], ToolNamespace::browser());
    assert_eq!(tools["python"], ToolNamespace::python());
}

#[derive(Deserialize)]
struct ParseFile {
    cases: Vec<ParseCase>,
}

#[derive(Deserialize)]
struct ParseCase {
    name: String,
    role: Option<Role>,
    strict: bool,
    tokens: Vec<u32>,
    messages: Option<Vec<Message>>,
    error: Option<String>,
    stream: Vec<StreamStep>,
}

#[derive(Deserialize, Debug, PartialEq, Default)]
struct StreamStep {
    token: Option<u32>,
    error: Option<String>,
    state: Option<String>,
    role: Option<Role>,
    channel: Option<String>,
    recipient: Option<String>,
    content_type: Option<String>,
    delta: Option<String>,
    content: Option<String>,
    n_messages: Option<usize>,
}

fn step_of(p: &StreamParser, token: Option<u32>) -> StreamStep {
    let state = match p.state() {
        ParserState::ExpectStart => "ExpectStart",
        ParserState::Header => "Header",
        ParserState::Content => "Content",
    };
    StreamStep {
        token,
        error: None,
        state: Some(state.to_string()),
        role: p.current_role(),
        channel: p.current_channel().map(Into::into),
        recipient: p.current_recipient().map(Into::into),
        content_type: p.current_content_type().map(Into::into),
        delta: p.last_content_delta().map(Into::into),
        content: Some(p.current_content().to_string()),
        n_messages: Some(p.messages().len()),
    }
}

#[test]
fn parses_like_official() {
    let file: ParseFile = fixture("parse.json");
    let h = HarmonyEncoding::new();
    for case in &file.cases {
        let options = ParseOptions { strict: case.strict };
        let result = h.parse_messages_with_options(&case.tokens, case.role, options);
        match (&case.messages, &case.error) {
            (Some(want), None) => assert_eq!(&result.unwrap(), want, "{}", case.name),
            (None, Some(err)) => assert_eq!(&result.unwrap_err().to_string(), err, "{}", case.name),
            _ => panic!("{}: fixture needs messages or error", case.name),
        }

        // Token by token: state, channel, recipient, delta and content after every token.
        let mut p = StreamParser::with_options(h, case.role, options);
        for (i, want) in case.stream.iter().enumerate() {
            let r = match want.token {
                Some(t) => p.push(t),
                None => p.finish(),
            };
            let got = match r {
                Ok(()) => step_of(&p, want.token),
                Err(e) => StreamStep { token: want.token, error: Some(e.to_string()), ..Default::default() },
            };
            assert_eq!(&got, want, "{} step {i}", case.name);
        }
    }
}

#[test]
fn parsed_tool_call_and_answer() {
    let h = HarmonyEncoding::new();
    let tok = h.tokenizer();
    let ids = tok.encode_with_special(
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary \
         to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Rome\"}<|call|>",
    );
    let mut p = h.stream_parser(Some(Role::Assistant));
    let mut analysis = String::new();
    for &t in &ids {
        p.push(t).unwrap();
        if p.current_channel() == Some("analysis") {
            analysis.push_str(p.last_content_delta().unwrap_or(""));
        }
        if STOP_TOKENS.contains(&t) {
            break;
        }
    }
    assert_eq!(analysis, "Need the weather.");
    let msgs = p.messages();
    assert_eq!(msgs.len(), 2);
    assert_eq!(msgs[1], Message::tool_call("functions.get_weather", "{\"city\":\"Rome\"}"));
    assert_eq!(p.state(), ParserState::ExpectStart);
}

#[derive(Deserialize)]
struct TokenizerFile {
    encode: Vec<TextIds>,
    encode_with_special: Vec<TextIds>,
    decode: Vec<DecodeCase>,
    stop_tokens: Vec<u32>,
    stop_tokens_for_assistant_actions: Vec<u32>,
}

#[derive(Deserialize)]
struct TextIds {
    text: String,
    tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct DecodeCase {
    tokens: Vec<u32>,
    text: String,
    special: Vec<bool>,
}

#[test]
fn tokenizes_like_official() {
    let file: TokenizerFile = fixture("tokenizer.json");
    let tok = Tokenizer::new();
    for c in &file.encode {
        assert_same_ids(&tok, &format!("encode {:?}", c.text), &tok.encode(&c.text), &c.tokens);
        assert_eq!(tok.decode_utf8(&c.tokens).unwrap(), c.text);
    }
    for c in &file.encode_with_special {
        assert_same_ids(&tok, &format!("special {:?}", c.text), &tok.encode_with_special(&c.text), &c.tokens);
        assert_eq!(tok.decode_utf8(&c.tokens).unwrap(), c.text);
    }
    for c in &file.decode {
        assert_eq!(tok.decode(&c.tokens).unwrap(), c.text, "{:?}", c.tokens);
        let special: Vec<bool> = c.tokens.iter().map(|&t| tok.is_special(t)).collect();
        assert_eq!(special, c.special, "{:?}", c.tokens);
    }
    let mut ends = MESSAGE_END_TOKENS.to_vec();
    ends.sort();
    assert_eq!(ends, file.stop_tokens, "official stop_tokens() = message ends");
    assert_eq!(STOP_TOKENS.to_vec(), file.stop_tokens_for_assistant_actions);
}

#[test]
fn special_token_ids() {
    let tok = Tokenizer::new();
    assert_eq!(tok.vocab_size(), 201_088);
    for (name, id) in [
        ("<|startoftext|>", 199_998),
        ("<|endoftext|>", 199_999),
        ("<|reserved_200000|>", 200_000),
        ("<|reserved_200001|>", 200_001),
        ("<|return|>", 200_002),
        ("<|constrain|>", 200_003),
        ("<|reserved_200004|>", 200_004),
        ("<|channel|>", 200_005),
        ("<|start|>", 200_006),
        ("<|end|>", 200_007),
        ("<|message|>", 200_008),
        ("<|reserved_200009|>", 200_009),
        ("<|reserved_200011|>", 200_011),
        ("<|call|>", 200_012),
        ("<|reserved_200013|>", 200_013),
        ("<|reserved_201087|>", 201_087),
    ] {
        assert_eq!(tok.special_id(name), Some(id), "{name}");
        assert_eq!(tok.token_str(id).unwrap(), name);
        assert!(tok.is_special(id));
    }
    assert!(!tok.is_special(199_997));
    assert_eq!(tok.special_id("<|reserved_201088|>"), None);
    assert_eq!(HarmonyEncoding::new().stop_tokens(), &[200_002, 200_012]);
}

#[test]
fn encode_decode_round_trip() {
    let tok = Tokenizer::new();
    let texts = [
        "plain ASCII text, with punctuation!?",
        "emoji 🎉🧪👩🏽‍🔬 flags 🇫🇷🇧🇷 and ❤️‍🔥",
        "中文、日本語のテキスト、한국어 문장입니다.",
        "whitespace   runs\t\t\tand\n\n\n\nnewlines \r\n  \u{3000}",
        "fn main() { let x: Vec<u8> = vec![0xff; 3]; println!(\"{x:?}\"); }",
        "<|end|> typed by a user stays text <|start|>",
        "",
    ];
    for text in texts {
        let ids = tok.encode(text);
        assert!(ids.iter().all(|&t| !tok.is_special(t)), "{text:?}");
        assert_eq!(tok.decode(&ids).unwrap(), text);
        assert_eq!(tok.decode_utf8(&ids).unwrap(), text);
    }
    let s = "<|start|>user<|message|>hi 👋<|end|><|start|>assistant";
    let ids = tok.encode_with_special(s);
    assert_eq!(ids[0], special::START);
    assert_eq!(ids.iter().filter(|&&t| tok.is_special(t)).count(), 4);
    assert_eq!(tok.decode(&ids).unwrap(), s);
    assert_ne!(tok.encode(s), ids);
}

/// Single-byte token IDs of `bytes`, so that characters arrive split across tokens.
fn byte_ids(tok: &Tokenizer, bytes: &[u8]) -> Vec<u32> {
    bytes
        .iter()
        .map(|&b| (0..special::FIRST).find(|&id| tok.token_bytes(id).unwrap() == [b]).unwrap())
        .collect()
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let tok = Tokenizer::new();
    let text = "a😀é你b🇮🇹";
    let mut ids = byte_ids(&tok, text.as_bytes());
    ids.extend(tok.encode(" and then 👩‍👩‍👧 ✓"));
    let mut d = tok.stream_decoder();
    let mut pieces = Vec::new();
    for &id in &ids {
        if let Some(piece) = d.push(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            pieces.push(piece);
        }
    }
    assert_eq!(d.finish(), None);
    assert_eq!(pieces.concat(), format!("{text} and then 👩‍👩‍👧 ✓"));
    assert_eq!(pieces[..4], ["a", "😀", "é", "你"]);

    // An unfinished character is held back, then flushed as U+FFFD at the end.
    let mut d = tok.stream_decoder();
    for id in byte_ids(&tok, &"你".as_bytes()[..2]) {
        assert_eq!(d.push(id).unwrap(), None);
    }
    assert_eq!(d.pending_len(), 2);
    assert_eq!(d.finish().as_deref(), Some("\u{FFFD}"));

    // Invalid bytes become U+FFFD right away; the pieces still add up to `decode`.
    let ids = [byte_ids(&tok, b"\xff\xfeok\xe4"), tok.encode("x")].concat();
    let mut d = tok.stream_decoder();
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&d.push(id).unwrap().unwrap_or_default());
    }
    out.push_str(&d.finish().unwrap_or_default());
    assert_eq!(out, tok.decode(&ids).unwrap());
}

#[test]
fn out_of_range_ids_are_errors() {
    let h = HarmonyEncoding::new();
    let tok = h.tokenizer();
    let bad = VOCAB_SIZE as u32;
    assert!(tok.decode(&[1, 2, bad]).is_err());
    assert!(tok.decode_utf8(&[u32::MAX]).is_err());
    assert!(tok.token_bytes(bad).is_err());
    assert!(tok.stream_decoder().push(bad).is_err());
    let mut p = h.stream_parser(Some(Role::Assistant));
    assert!(p.push(bad).is_err());
    assert!(p.tokens().is_empty(), "a rejected ID changes nothing");
    assert!(
        h.parse_messages_from_completion_tokens(&[special::CHANNEL, bad], Some(Role::Assistant)).is_err()
    );
    assert!(tok.decode_utf8(&byte_ids(tok, b"\xff")).is_err());
}
