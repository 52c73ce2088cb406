//! Constrained decoding on the real o200k_harmony vocabulary: whatever the logits (seeded
//! noise, or an adversary preferring a forbidden reply), a constrained turn follows its
//! grammar: a JSON answer parses and validates, a required call addresses a declared
//! function with valid arguments, and undeclared or forbidden calls cannot be generated.

mod common;

use std::sync::Arc;

use picchio::chat::tokenizer::special;
use picchio::chat::{
    Conversation, HarmonyEncoding, Message, SystemContent, Tokenizer, TurnOptions, TurnOutcome, complete,
};
use picchio::constrain::{
    AnswerFormat, FunctionRule, Grammar, GrammarPart, TokenConstraint, ToolRule, TurnSpec, Vocabulary,
};
use picchio::sample::{Sampler, SamplingParams};
use picchio::session::{Session, StopReason};
use proptest::prelude::*;
use serde_json::{Value, json};

use common::noisy::Noisy;

fn vocab() -> Vocabulary {
    Vocabulary::shared(picchio::chat::VOCAB_SIZE).unwrap()
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    })
}

/// Whether `v` is valid against [`person_schema`], checked keyword by keyword.
fn is_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let name_ok = o.get("name").and_then(Value::as_str).is_some_and(|s| s.chars().count() <= 8);
    let age_ok = o.get("age").and_then(Value::as_i64).is_some_and(|a| (0..=120).contains(&a));
    let tags_ok = match o.get("tags") {
        None => true,
        Some(Value::Array(t)) => {
            t.len() <= 3 && t.iter().all(|x| ["a", "b", "c"].contains(&x.as_str().unwrap_or("")))
        }
        Some(_) => false,
    };
    name_ok && age_ok && tags_ok && o.keys().all(|k| ["name", "age", "tags"].contains(&k.as_str()))
}

fn city_function() -> FunctionRule {
    FunctionRule {
        name: "get_weather".into(),
        parameters: Some(json!({
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": false
        })),
        strict: true,
    }
}

/// One constrained turn of `runner` for a short conversation.
fn turn(runner: Noisy, spec: &TurnSpec, seed: u64, max_tokens: usize) -> TurnOutcome {
    let grammar = Arc::new(Grammar::for_turn(spec, &vocab()).unwrap());
    let harmony = HarmonyEncoding::new();
    let convo = Conversation::from_messages([
        Message::system(SystemContent::new().with_conversation_start_date("2026-12-01")),
        Message::user("Tell me about someone."),
    ]);
    let opts = TurnOptions {
        max_tokens: Some(max_tokens),
        sampling: SamplingParams { temperature: 1.0, seed, ..Default::default() },
        declared_functions: vec!["get_weather".into(), "get_time".into()],
        grammar: Some(grammar),
        stop: Vec::new(),
    };
    let mut session = Session::new(Box::new(runner));
    complete(&mut session, &harmony, &convo, &opts, &mut |_| true).unwrap()
}

fn decoded(outcome: &TurnOutcome) -> String {
    Tokenizer::new().decode(&outcome.tokens).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, failure_persistence: None, ..ProptestConfig::default() })]

    /// Under seeded noise the answer is JSON valid against the schema, after free reasoning.
    #[test]
    fn json_schema_answers_validate_under_random_logits(seed in any::<u64>()) {
        let spec = TurnSpec {
            answer: AnswerFormat::JsonSchema { schema: person_schema(), strict: true },
            tools: ToolRule::Forbidden,
        };
        // Noise picks the analysis channel as often as the final one, so the reasoning runs
        // to a geometric number of messages: over seeds 0..200 turns took 17-1534 tokens
        // (median ~40), and a CI run failed on a seed that needed 1520 under a budget of
        // 1500. The budget is set far out in that tail; running into it is still a failure.
        let out = turn(Noisy::new(seed, 8192), &spec, seed, 4000);
        prop_assert_eq!(out.stop, StopReason::Stop(special::RETURN), "{}", decoded(&out));
        let answer = out.answer().unwrap();
        let v: Value = serde_json::from_str(&answer).unwrap();
        prop_assert!(is_person(&v), "{answer}");
        prop_assert!(out.tool_calls().is_empty());
    }

    /// Under seeded noise a required call is a call of a declared function with arguments
    /// valid against its parameters.
    #[test]
    fn required_calls_are_declared_and_valid_under_random_logits(seed in any::<u64>()) {
        let spec = TurnSpec {
            answer: AnswerFormat::Text,
            tools: ToolRule::Required(vec![
                city_function(),
                FunctionRule {
                    name: "get_time".into(),
                    parameters: Some(json!({"type": "object", "properties": {}, "additionalProperties": false})),
                    strict: false,
                },
            ]),
        };
        // Noise alone keeps writing preambles; a push towards a call header, stronger than
        // any boosted token's noise (the function name and the arguments stay noise), makes
        // the turn end.
        let runner = Noisy::new(seed, 4096).with_script("<|channel|>commentary to=functions.", 20.0);
        let out = turn(runner, &spec, seed, 1500);
        prop_assert_eq!(out.stop, StopReason::Stop(special::CALL), "{}", decoded(&out));
        let calls = out.tool_calls();
        prop_assert_eq!(calls.len(), 1);
        let args: Value = serde_json::from_str(&calls[0].1).unwrap();
        match calls[0].0.as_str() {
            "functions.get_weather" => {
                let city = args.get("city").and_then(Value::as_str);
                prop_assert!(city.is_some_and(|c| c.chars().count() <= 10), "{args}");
                prop_assert_eq!(args.as_object().unwrap().len(), 1);
            }
            "functions.get_time" => prop_assert_eq!(args, json!({})),
            other => prop_assert!(false, "call of {other}"),
        }
    }
}

/// An adversary that wants to call a function nobody declared.
const EVIL_CALL: &str =
    "<|channel|>commentary to=functions.evil <|constrain|>json<|message|>{\"x\":1}<|call|>";

#[test]
fn an_undeclared_function_cannot_be_called() {
    let spec = TurnSpec { answer: AnswerFormat::Text, tools: ToolRule::Optional(vec!["get_weather".into()]) };
    for seed in 0..4 {
        let out = turn(Noisy::new(seed, 4096).with_script(EVIL_CALL, 60.0), &spec, seed, 1500);
        let text = decoded(&out);
        assert!(!text.contains("functions.evil"), "{text}");
        for (recipient, _) in out.tool_calls() {
            assert_eq!(recipient, "functions.get_weather", "{text}");
        }
        assert!(matches!(out.stop, StopReason::Stop(special::RETURN | special::CALL)), "{text}");
    }
}

#[test]
fn forbidden_tools_cannot_be_called_and_a_named_function_is_the_one_called() {
    let weather = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}<|call|>";
    let none = TurnSpec { answer: AnswerFormat::Text, tools: ToolRule::Forbidden };
    let out = turn(Noisy::new(3, 4096).with_script(weather, 60.0), &none, 3, 1500);
    assert!(out.tool_calls().is_empty(), "{}", decoded(&out));
    assert_eq!(out.stop, StopReason::Stop(special::RETURN), "{}", decoded(&out));

    // The adversary wants get_weather; the request names get_time.
    let named = TurnSpec {
        answer: AnswerFormat::Text,
        tools: ToolRule::Required(vec![FunctionRule {
            name: "get_time".into(),
            parameters: None,
            strict: true,
        }]),
    };
    let out = turn(Noisy::new(4, 4096).with_script(weather, 60.0), &named, 4, 1500);
    let calls = out.tool_calls();
    assert_eq!(calls.len(), 1, "{}", decoded(&out));
    assert_eq!(calls[0].0, "functions.get_time");
    assert!(serde_json::from_str::<Value>(&calls[0].1).unwrap().is_object());
}

#[test]
fn an_adversary_writing_invalid_json_still_answers_valid_json() {
    let bad = "<|channel|>final<|message|>Sure! Here is the JSON: {name: Bob}<|return|>";
    let spec = TurnSpec { answer: AnswerFormat::JsonObject, tools: ToolRule::Forbidden };
    let out = turn(Noisy::new(5, 4096).with_script(bad, 60.0), &spec, 5, 1500);
    assert_eq!(out.stop, StopReason::Stop(special::RETURN), "{}", decoded(&out));
    assert!(serde_json::from_str::<Value>(&out.answer().unwrap()).unwrap().is_object());
}

#[test]
fn bad_schemas_are_refused_naming_their_part() {
    let v = vocab();
    let spec = |schema: Value| TurnSpec {
        answer: AnswerFormat::JsonSchema { schema, strict: true },
        tools: ToolRule::Forbidden,
    };
    let e = Grammar::for_turn(&spec(json!({"type": "no-such-type"})), &v).unwrap_err();
    assert_eq!(e.part, GrammarPart::Answer);
    assert!(!e.message.is_empty());
    let e = Grammar::for_turn(&spec(json!([1, 2])), &v).unwrap_err();
    assert_eq!(e.part, GrammarPart::Answer);
    let tools = TurnSpec {
        answer: AnswerFormat::Text,
        tools: ToolRule::Required(vec![FunctionRule {
            name: "f".into(),
            parameters: Some(json!({
                "type": "object",
                "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}},
                "required": ["a"]
            })),
            strict: true,
        }]),
    };
    let e = Grammar::for_turn(&tools, &v).unwrap_err();
    assert_eq!(e.part, GrammarPart::Parameters("f".into()), "{}", e.message);
    // A keyword the engine cannot enforce: refused when strict (naming it), ignored if not.
    let format =
        json!({"type": "object", "properties": {"u": {"type": "string", "format": "no-such-format"}}});
    let e = Grammar::for_turn(&spec(format.clone()), &v).unwrap_err();
    assert!(e.message.contains("no-such-format"), "{}", e.message);
    let lenient = TurnSpec {
        answer: AnswerFormat::JsonSchema { schema: format, strict: false },
        tools: ToolRule::Forbidden,
    };
    assert!(Grammar::for_turn(&lenient, &v).is_ok());
}

#[test]
fn the_mask_covers_exactly_the_model_vocabulary() {
    let tokenizer = Tokenizer::new();
    // A model with more IDs than the tokenizer: the extra ones are never allowed.
    let big = Vocabulary::new(&tokenizer, 201_100, special::ENDOFTEXT).unwrap();
    let g = Grammar::from_lark("start: /[a-z ]+/\n", &big, GrammarPart::Turn).unwrap();
    let mut c = g.start();
    let mask = c.mask().unwrap();
    assert!(mask.allows(tokenizer.encode("hello")[0]));
    assert!((201_088..201_100).all(|t| !mask.allows(t)));
    assert!(!mask.allows(special::START) && !mask.allows(201_100));
    // A model with fewer: a grammar over its IDs works, and nothing beyond is allowed.
    let small = Vocabulary::new(&tokenizer, 1000, 999).unwrap();
    let g = Grammar::from_lark("start: /[0-9]+/\n", &small, GrammarPart::Turn).unwrap();
    let mut c = g.start();
    let mask = c.mask().unwrap();
    assert!(mask.count() > 0 && mask.allows(tokenizer.encode("7")[0]));
    assert!(!mask.allows(1000) && !mask.allows(special::START));
    // A grammar needing a token the model lacks compiles to a mask that allows nothing.
    match Grammar::from_lark("start: <[200006]>\n", &small, GrammarPart::Turn) {
        Err(e) => assert!(!e.message.is_empty()),
        Ok(g) => assert!(g.start().mask().is_err()),
    }
}

#[test]
fn the_sampler_picks_only_allowed_tokens_and_the_mask_is_computed_ahead() {
    let tokenizer = Tokenizer::new();
    let v = vocab();
    let g = Grammar::from_lark("start: \"yes\" | \"no\"\n", &v, GrammarPart::Turn).unwrap();
    // Logits that prefer a forbidden token by far, greedy and sampled.
    let mut logits = vec![0.0f32; v.size()];
    logits[tokenizer.encode("maybe")[0] as usize] = 50.0;
    for temperature in [0.0, 1.0] {
        let mut s = Sampler::new(SamplingParams { temperature, seed: 1, ..Default::default() })
            .unwrap()
            .with_constraint(Box::new(g.start()));
        let t = s.sample(&logits, &[]).unwrap();
        assert!(["yes", "no", "y", "n"].contains(&tokenizer.decode(&[t]).unwrap().as_str()));
        s.advance(t);
        let stats = s.constraint().unwrap().stats();
        assert_eq!(stats.masks, 1);
    }
    assert!(g.accepts(&tokenizer.encode("yes")));
    assert!(!g.accepts(&tokenizer.encode("maybe")));
}

#[test]
fn well_formed_replies_are_sentences_of_the_grammar_and_undeclared_calls_are_not() {
    use common::scripted::{DEFAULT_REPLY, TOOL_REPLY};
    let tokenizer = Tokenizer::new();
    let spec = TurnSpec { answer: AnswerFormat::Text, tools: ToolRule::Optional(vec!["get_weather".into()]) };
    let g = Grammar::for_turn(&spec, &vocab()).unwrap();
    let in_channel = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>";
    // TOOL_REPLY puts the recipient after the role, as a rendered conversation does.
    for reply in [DEFAULT_REPLY, TOOL_REPLY, in_channel] {
        assert!(g.accepts(&tokenizer.encode_with_special(reply)), "{reply}");
    }
    assert!(!g.accepts(&tokenizer.encode_with_special(EVIL_CALL)));
    let none =
        Grammar::for_turn(&TurnSpec { answer: AnswerFormat::Text, tools: ToolRule::Forbidden }, &vocab())
            .unwrap();
    assert!(none.accepts(&tokenizer.encode_with_special(DEFAULT_REPLY)));
    assert!(!none.accepts(&tokenizer.encode_with_special(TOOL_REPLY)));
}

#[test]
fn a_finished_grammar_allows_only_its_end_token() {
    let tokenizer = Tokenizer::new();
    let g = Grammar::from_lark("start: \"yes\"\n", &vocab(), GrammarPart::Turn).unwrap();
    let mut c = g.start();
    for t in tokenizer.encode("yes") {
        assert!(c.mask().unwrap().allows(t));
        c.advance(t);
    }
    // The session stops on it (`<|endoftext|>` is one of a turn's stop tokens).
    let mask = c.mask().unwrap();
    assert_eq!(mask.count(), 1);
    assert!(mask.allows(special::ENDOFTEXT));
}
