//! One assistant turn of a Harmony conversation on a session: render the conversation,
//! reuse the longest common prefix of the cache, generate until `<|return|>` or `<|call|>`,
//! stream what each channel produces, and return the parsed assistant messages.
//!
//! Re-rendering is not prefix-preserving (past analysis is dropped and a final
//! `<|return|>` becomes `<|end|>`), so the cache is matched token by token against the new
//! rendering rather than extended blindly.

use std::sync::Arc;

use crate::chat::RenderConfig;
use crate::chat::harmony::HarmonyEncoding;
use crate::chat::message::{Conversation, Message, Role};
use crate::chat::recovery::{Delta, DeltaKind, TurnParser};
use crate::chat::tokenizer::special;
use crate::constrain::Grammar;
use crate::error::Result;
use crate::model::LogitRows;
use crate::sample::{Sampler, SamplingParams};
use crate::session::{Session, StopReason};

/// Something the assistant produced, as it is generated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatEvent<'a> {
    /// Text added to the reasoning (the `analysis` channel).
    Reasoning(&'a str),
    /// Text added to the answer (the `final` channel).
    Answer(&'a str),
    /// Text added to a call of a declared function (a message addressed to `recipient`).
    /// The first event of each call has empty text: it announces the call, so a call
    /// without arguments is seen and two calls of one function are told apart.
    ToolCall {
        /// Who the call is for, e.g. `functions.get_weather`.
        recipient: &'a str,
        /// The new text of the arguments.
        text: &'a str,
    },
    /// Text on another channel without a recipient (e.g. a commentary preamble).
    Commentary(&'a str),
    /// A token was generated (sent for every token, before any text it adds), so a caller
    /// can stop the turn at any point, not only when text appears.
    Token(u32),
    /// The prompt is being computed: `done` of its `total` tokens are in the cache (reused
    /// ones included). Sent between prefill blocks, so a caller can stop a long prompt
    /// before its first token; the cache then keeps the computed blocks.
    Prefill {
        /// Prompt tokens in the cache so far.
        done: usize,
        /// Tokens of the whole prompt.
        total: usize,
    },
}

/// Settings of one turn.
#[derive(Clone, Debug)]
pub struct TurnOptions {
    /// Most tokens to generate; `None` means until the context is full. Either way the
    /// turn ends when the context is (the room depends on the rendered prompt, known only
    /// then: re-rendering drops past reasoning, so the previous turn's cache position says
    /// little about it).
    pub max_tokens: Option<usize>,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// The functions the model may call (bare names: `get_weather` for
    /// `to=functions.get_weather`). A message addressed to anything else is text; empty
    /// means no tool calls at all (see [`crate::chat::recovery`]).
    pub declared_functions: Vec<String>,
    /// A grammar the generated turn must follow (structured output, forced tool calls),
    /// compiled over the model's vocabulary for the tokens after `<|start|>assistant`;
    /// `None` leaves the turn free.
    pub grammar: Option<Arc<Grammar>>,
}

/// What a turn did.
#[derive(Clone, Debug)]
pub struct TurnOutcome {
    /// The assistant messages generated (reasoning, answer, tool calls), complete or, if
    /// the turn was cut short, up to the last complete one plus the partial one.
    pub messages: Vec<Message>,
    /// Why generation stopped.
    pub stop: StopReason,
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// Prompt positions reused from the cache.
    pub reused: usize,
    /// Tokens generated (terminator included).
    pub completion_tokens: usize,
    /// The generated token IDs.
    pub tokens: Vec<u32>,
}

impl TurnOutcome {
    /// The text of the answer (`final` channel), if any.
    pub fn answer(&self) -> Option<String> {
        self.messages.iter().rev().find(|m| m.channel.as_deref() == Some("final")).map(Message::text)
    }

    /// The reasoning text (`analysis` channel), joined.
    pub fn reasoning(&self) -> String {
        self.messages.iter().filter(|m| m.channel.as_deref() == Some("analysis")).map(Message::text).collect()
    }

    /// Tool calls: (recipient, arguments).
    pub fn tool_calls(&self) -> Vec<(String, String)> {
        self.messages.iter().filter_map(|m| m.recipient.as_ref().map(|r| (r.clone(), m.text()))).collect()
    }
}

/// The tokens that end an assistant turn in a vocabulary of `vocab` tokens: `<|return|>`,
/// `<|call|>`, and `<|endoftext|>`.
pub fn turn_stop_tokens(vocab: usize) -> Vec<u32> {
    let mut stops = crate::chat::harmony::STOP_TOKENS.to_vec();
    stops.push(special::ENDOFTEXT);
    stops.retain(|&t| (t as usize) < vocab);
    stops
}

/// Renders `conversation` for the assistant's next message, as [`complete`] does.
pub fn render_prompt(harmony: &HarmonyEncoding, conversation: &Conversation) -> Result<Vec<u32>> {
    harmony.render_conversation_for_completion(conversation, Role::Assistant, &RenderConfig::default())
}

/// Runs one assistant turn for `conversation` on `session`: renders it with
/// [`render_prompt`] and runs [`complete_prompt`]. `on_event` receives the generated text
/// as it comes; returning false stops the turn (what was generated is kept and consumed,
/// so the session stays consistent).
pub fn complete(
    session: &mut Session,
    harmony: &HarmonyEncoding,
    conversation: &Conversation,
    opts: &TurnOptions,
    on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool,
) -> Result<TurnOutcome> {
    let prompt = render_prompt(harmony, conversation)?;
    complete_prompt(session, harmony, &prompt, opts, on_event)
}

/// Runs one assistant turn for an already rendered `prompt` (the token IDs of
/// [`render_prompt`]), so a caller that needed the prompt anyway (the HTTP server counts
/// its tokens before queueing) does not render and tokenize the conversation twice.
/// Reuses the cached prefix, generates up to `opts.max_tokens` or until the context is full
/// (then the stop is [`StopReason::ContextFull`]), and streams to `on_event` as
/// [`complete`] does.
pub fn complete_prompt(
    session: &mut Session,
    harmony: &HarmonyEncoding,
    prompt: &[u32],
    opts: &TurnOptions,
    on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool,
) -> Result<TurnOutcome> {
    // With no limit, or one past the room, the session stops when the context is full.
    let max_new = opts.max_tokens.unwrap_or(usize::MAX);
    let mut sampler = Sampler::new(opts.sampling.clone())?;
    if let Some(grammar) = &opts.grammar {
        // Started before the prefill, so the first mask is ready when its logits are.
        sampler = sampler.with_constraint(Box::new(grammar.start()));
    }
    let reused = session.reuse_prefix(prompt)?;
    let stops = turn_stop_tokens(session.runner().config().vocab_size);
    let mut parser = TurnParser::new(*harmony, &opts.declared_functions);
    // The prompt goes in block by block, so the caller can stop it between blocks; an empty
    // rest (an empty prompt) continues from the last consumed token inside `generate`.
    let rest = &prompt[reused..];
    if !rest.is_empty() {
        let rows = if max_new > 0 { LogitRows::Last } else { LogitRows::None };
        let total = prompt.len();
        let finished = session
            .prefill(rest, rows, &mut |done| on_event(ChatEvent::Prefill { done: reused + done, total }))?;
        if !finished {
            return Ok(TurnOutcome {
                messages: Vec::new(),
                stop: StopReason::Cancelled,
                prompt_tokens: prompt.len(),
                reused,
                completion_tokens: 0,
                tokens: Vec::new(),
            });
        }
    }
    let mut on_token = |id: u32| -> bool {
        if !on_event(ChatEvent::Token(id)) {
            return false;
        }
        parser.push(id).iter().all(|delta| on_event(delta_event(delta)))
    };
    let generation = session.generate(&[], max_new, &mut sampler, &stops, &mut on_token)?;
    // A turn cut short leaves a partial message: keep (and show) what was said.
    for delta in parser.finish() {
        on_event(delta_event(&delta));
    }
    Ok(TurnOutcome {
        messages: parser.into_messages(),
        stop: generation.stop,
        prompt_tokens: prompt.len(),
        reused,
        completion_tokens: generation.tokens.len(),
        tokens: generation.tokens,
    })
}

/// The event of a parsed delta.
fn delta_event(delta: &Delta) -> ChatEvent<'_> {
    let text = delta.text.as_str();
    match &delta.kind {
        DeltaKind::Reasoning => ChatEvent::Reasoning(text),
        DeltaKind::Answer => ChatEvent::Answer(text),
        DeltaKind::Commentary => ChatEvent::Commentary(text),
        DeltaKind::ToolCall(recipient) => ChatEvent::ToolCall { recipient, text },
    }
}

/// Today's date in UTC as `YYYY-MM-DD` (for the system message).
pub fn today_utc() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    civil_date(secs / 86_400)
}

/// The proleptic Gregorian date of a day count since 1970-01-01.
fn civil_date(days: u64) -> String {
    // Howard Hinnant's days-to-civil algorithm.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert_eq!(civil_date(20_786), "2026-11-29");
        assert_eq!(today_utc().len(), 10);
    }
}
