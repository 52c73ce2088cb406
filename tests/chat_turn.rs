//! Harmony turns on a session: a second turn reuses the cached prefix of the first and
//! produces exactly the tokens a fresh session gives for the same conversation.

mod common;

use picchio::chat::{
    ChatEvent, Conversation, HarmonyEncoding, Message, ReasoningEffort, SystemContent, TurnOptions, complete,
};
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::sample::SamplingParams;
use picchio::session::Session;

fn session(dir: &std::path::Path) -> Session {
    let model = engine::open(dir, &OpenOptions { ctx: 512, ..Default::default() }).unwrap();
    Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx: 512, max_batch: 64, ..Default::default() }).unwrap(),
    )
}

fn system() -> Message {
    Message::system(
        SystemContent::new()
            .with_reasoning_effort(ReasoningEffort::Low)
            .with_conversation_start_date("2026-11-29"),
    )
}

#[test]
fn second_turn_reuses_the_prefix_and_matches_a_fresh_session() {
    let model = common::tiny_real_vocab();
    let harmony = HarmonyEncoding::new();
    let opts = TurnOptions {
        max_tokens: 12,
        sampling: SamplingParams { temperature: 0.8, seed: 11, ..Default::default() },
    };
    let mut convo = Conversation::from_messages([system(), Message::user("Hello there")]);
    let mut s = session(model.path());
    let mut events = 0;
    let first = complete(&mut s, &harmony, &convo, &opts, &mut |_e: ChatEvent<'_>| {
        events += 1;
        true
    })
    .unwrap();
    assert_eq!(first.reused, 0);
    assert_eq!(first.completion_tokens, first.tokens.len());
    assert_eq!(s.pos(), first.prompt_tokens + first.tokens.len(), "every generated token is consumed");

    // The next turn: the assistant's reply (as a final answer) and a new question.
    convo.messages.push(Message::assistant("final", "Hi! How can I help?"));
    convo.messages.push(Message::user("Tell me a story"));
    let second = complete(&mut s, &harmony, &convo, &opts, &mut |_| true).unwrap();
    assert!(second.reused > 0, "nothing was reused");
    assert!(second.reused < second.prompt_tokens);
    let mut fresh = session(model.path());
    let again = complete(&mut fresh, &harmony, &convo, &opts, &mut |_| true).unwrap();
    assert_eq!(again.reused, 0);
    assert_eq!(second.tokens, again.tokens, "reusing {} positions changed the tokens", second.reused);
    eprintln!("second turn reused {} of {} prompt positions", second.reused, second.prompt_tokens);
}

#[test]
fn a_stopped_turn_keeps_the_session_consistent() {
    let model = common::tiny_real_vocab();
    let harmony = HarmonyEncoding::new();
    let convo = Conversation::from_messages([system(), Message::user("Count to ten")]);
    let opts = TurnOptions { max_tokens: 20, sampling: SamplingParams::default() };
    let mut s = session(model.path());
    let mut seen = 0;
    let cut = complete(&mut s, &harmony, &convo, &opts, &mut |_| {
        seen += 1;
        seen < 3
    })
    .unwrap();
    assert_eq!(s.pos(), cut.prompt_tokens + cut.tokens.len());
    // Greedy decoding from a fresh session reproduces the same first tokens.
    let mut fresh = session(model.path());
    let full = complete(&mut fresh, &harmony, &convo, &opts, &mut |_| true).unwrap();
    assert_eq!(cut.tokens[..], full.tokens[..cut.tokens.len()]);
}
