//! Harmony turns on a session: a second turn reuses the cached prefix of the first and
//! produces exactly the tokens a fresh session gives for the same conversation.

mod common;

use picchio::chat::{
    ChatEvent, Conversation, HarmonyEncoding, Message, ReasoningEffort, SystemContent, TurnOptions, complete,
    complete_prompt, render_prompt,
};
use picchio::engine::{self, OpenOptions, RunOptions};
use picchio::sample::SamplingParams;
use picchio::session::{Session, StopReason};

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
        max_tokens: Some(12),
        sampling: SamplingParams { temperature: 0.8, seed: 11, ..Default::default() },
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
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
    let opts = TurnOptions {
        max_tokens: Some(20),
        sampling: SamplingParams::default(),
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
    };
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

/// Without a token limit a turn may use whatever the context has left after *its* prompt,
/// however full the cache was with a previous (here: another, longer) conversation.
#[test]
fn the_default_limit_is_the_room_after_the_new_prompt() {
    let model = common::tiny_real_vocab();
    let harmony = HarmonyEncoding::new();
    let mut s = session(model.path());
    let long = Conversation::from_messages([system(), Message::user("a long question ".repeat(100))]);
    let one = TurnOptions {
        max_tokens: Some(1),
        sampling: SamplingParams::default(),
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
    };
    complete(&mut s, &harmony, &long, &one, &mut |_| true).unwrap();
    let stale_room = s.capacity() - s.pos();

    let short = Conversation::from_messages([system(), Message::user("Hi")]);
    let opts = TurnOptions {
        max_tokens: None,
        sampling: SamplingParams::default(),
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
    };
    let turn = complete(&mut s, &harmony, &short, &opts, &mut |_| true).unwrap();
    assert!(turn.prompt_tokens + stale_room < s.capacity(), "the test needs a short second prompt");
    assert!(
        turn.completion_tokens > stale_room || matches!(turn.stop, StopReason::Stop(_)),
        "{} tokens generated (stop: {:?}): limited by the previous conversation's {} free positions",
        turn.completion_tokens,
        turn.stop,
        stale_room
    );
    eprintln!(
        "second conversation: {} tokens generated (stop: {:?}), {stale_room} positions were free before it",
        turn.completion_tokens, turn.stop
    );
    // The same as on a fresh session, stop reason included.
    let mut fresh = session(model.path());
    let again = complete(&mut fresh, &harmony, &short, &opts, &mut |_| true).unwrap();
    assert_eq!((&turn.tokens, turn.stop), (&again.tokens, again.stop));
    if !matches!(turn.stop, StopReason::Stop(_)) {
        assert_eq!(turn.stop, StopReason::ContextFull, "running out of room is a full context");
        assert_eq!(s.pos(), s.capacity());
        assert_eq!(turn.completion_tokens, s.capacity() - turn.prompt_tokens);
    }
}

/// A requested limit beyond the room is clamped to it and reported as a full context; one
/// within it ends the turn as `MaxTokens`. `complete_prompt` on a rendered prompt is
/// `complete`.
#[test]
fn a_limit_is_clamped_to_the_room_and_complete_prompt_matches_complete() {
    let model = common::tiny_real_vocab();
    let harmony = HarmonyEncoding::new();
    let convo = Conversation::from_messages([system(), Message::user("Count to ten")]);
    let prompt = render_prompt(&harmony, &convo).unwrap();
    let mut s = session(model.path());
    let room = s.capacity() - prompt.len();
    let within = TurnOptions {
        max_tokens: Some(5),
        sampling: SamplingParams::default(),
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
    };
    let a = complete_prompt(&mut s, &harmony, &prompt, &within, &mut |_| true).unwrap();
    let mut fresh = session(model.path());
    let b = complete(&mut fresh, &harmony, &convo, &within, &mut |_| true).unwrap();
    assert_eq!((&a.tokens, a.stop, a.prompt_tokens), (&b.tokens, b.stop, b.prompt_tokens));
    if !matches!(a.stop, StopReason::Stop(_)) {
        assert_eq!(a.stop, StopReason::MaxTokens);
        assert_eq!(a.completion_tokens, 5);
    }

    let beyond = TurnOptions {
        max_tokens: Some(room + 1000),
        sampling: SamplingParams::default(),
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
    };
    let c = complete_prompt(&mut s, &harmony, &prompt, &beyond, &mut |_| true).unwrap();
    assert!(c.completion_tokens <= room);
    if !matches!(c.stop, StopReason::Stop(_)) {
        assert_eq!(c.stop, StopReason::ContextFull);
        assert_eq!(c.completion_tokens, room);
    }
}

/// A session whose runner computes at most `block` positions per forward call.
fn session_in_blocks(dir: &std::path::Path, block: usize) -> Session {
    let model = engine::open(dir, &OpenOptions { ctx: 512, ..Default::default() }).unwrap();
    Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx: 512, max_batch: block, ..Default::default() }).unwrap(),
    )
}

#[test]
fn a_prefill_stopped_after_its_first_block_keeps_that_block_and_the_next_turn_matches_a_fresh_session() {
    let model = common::tiny_real_vocab();
    let harmony = HarmonyEncoding::new();
    let convo =
        Conversation::from_messages([system(), Message::user("Tell me a long story about a woodpecker")]);
    let opts = TurnOptions {
        max_tokens: Some(10),
        sampling: SamplingParams { temperature: 0.8, seed: 5, ..Default::default() },
        declared_functions: Vec::new(),
        stop: Vec::new(),
        grammar: None,
    };
    let block = 8;
    let prompt = render_prompt(&harmony, &convo).unwrap();
    assert!(prompt.len() > 3 * block, "the prompt must span several blocks: {} tokens", prompt.len());

    let mut s = session_in_blocks(model.path(), block);
    let mut progress = Vec::new();
    let mut tokens_seen = 0;
    let stopped = complete_prompt(&mut s, &harmony, &prompt, &opts, &mut |e| match e {
        ChatEvent::Prefill { done, total } => {
            progress.push((done, total));
            false
        }
        ChatEvent::Token(_) => {
            tokens_seen += 1;
            true
        }
        _ => true,
    })
    .unwrap();
    assert_eq!(stopped.stop, StopReason::Cancelled);
    assert_eq!(progress, vec![(block, prompt.len())], "asked once, after the first block");
    assert_eq!(tokens_seen, 0, "nothing is generated after a stopped prefill");
    assert!(stopped.tokens.is_empty() && stopped.messages.is_empty());
    assert_eq!(s.pos(), block, "the session holds exactly the computed block");
    assert_eq!(s.tokens(), &prompt[..block]);

    // The same turn again reuses the computed block and gives a fresh session's tokens.
    let mut blocks = 0;
    let again = complete_prompt(&mut s, &harmony, &prompt, &opts, &mut |e| {
        if let ChatEvent::Prefill { done, .. } = e {
            assert!(done > block && done < prompt.len(), "progress {done} outside the rest of the prompt");
            blocks += 1;
        }
        true
    })
    .unwrap();
    assert_eq!(again.reused, block);
    assert_eq!(blocks, (prompt.len() - block).div_ceil(block) - 1, "asked between every two blocks");
    let mut fresh = session_in_blocks(model.path(), block);
    let expected = complete_prompt(&mut fresh, &harmony, &prompt, &opts, &mut |_| true).unwrap();
    assert!(!expected.tokens.is_empty());
    assert_eq!(again.tokens, expected.tokens, "the stopped prefill changed the next turn's tokens");
    assert_eq!(s.pos(), prompt.len() + again.tokens.len());
}
