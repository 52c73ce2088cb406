//! `picchio tokenize` and `picchio render`, run as a user runs them.

use std::process::{Command, Output};

use picchio::chat::{
    Conversation, DeveloperContent, HarmonyEncoding, Message, ReasoningEffort, RenderConfig, Role,
    SystemContent, Tokenizer, today_utc,
};

fn picchio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().expect("run picchio")
}

fn ids(out: &Output) -> Vec<u32> {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap().split_whitespace().map(|t| t.parse().unwrap()).collect()
}

#[test]
fn tokenize_prints_the_ids_of_a_text() {
    let tokenizer = Tokenizer::new();
    let text = "Hello <|end|> world";
    assert_eq!(ids(&picchio(&["tokenize", text])), tokenizer.encode(text), "special strings are text");
    let special = ids(&picchio(&["tokenize", "--special", text]));
    assert_eq!(special, tokenizer.encode_with_special(text));
    assert!(special.contains(&tokenizer.special_id("<|end|>").unwrap()));
    let shown = picchio(&["tokenize", "--show", "Hi"]);
    let shown = String::from_utf8(shown.stdout).unwrap();
    assert_eq!(shown, format!("{}\t\"Hi\"\n", tokenizer.encode("Hi")[0]));
}

#[test]
fn render_prints_the_prompt_of_a_chat_request() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("request.json");
    std::fs::write(
        &path,
        r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "reasoning_effort": "high"}"#,
    )
    .unwrap();
    let expected = HarmonyEncoding::new()
        .render_conversation_for_completion(
            &Conversation::from_messages([
                Message::system(
                    SystemContent::new()
                        .with_reasoning_effort(ReasoningEffort::High)
                        .with_conversation_start_date(today_utc()),
                ),
                Message::developer(DeveloperContent::new().with_instructions("Be brief.")),
                Message::user("Hi"),
            ]),
            Role::Assistant,
            &RenderConfig::default(),
        )
        .unwrap();
    let path = path.to_str().unwrap();
    assert_eq!(ids(&picchio(&["render", path])), expected);
    let text = String::from_utf8(picchio(&["render", "--text", path]).stdout).unwrap();
    assert!(text.contains("Reasoning: high") && text.trim_end().ends_with("<|start|>assistant"), "{text}");

    std::fs::write(dir.path().join("bad.json"), r#"{"messages": [{"role": "robot", "content": "x"}]}"#)
        .unwrap();
    let out = picchio(&["render", dir.path().join("bad.json").to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.json") && err.contains("messages[0].role"), "{err}");
}
