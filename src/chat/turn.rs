//! One assistant turn of a conversation on a session, in the model's chat format (Harmony
//! or ChatML, see [`ChatFormat`]): render the conversation, reuse the longest common prefix
//! of the cache, generate until a stop token (`<|return|>` or `<|call|>`; `<|im_end|>`),
//! stream what each channel produces, and return the parsed assistant messages.
//!
//! Re-rendering is not prefix-preserving (past reasoning is dropped, and in Harmony a final
//! `<|return|>` becomes `<|end|>`), so the cache is matched token by token against the new
//! rendering rather than extended blindly.

use std::sync::Arc;

use crate::chat::format::ChatFormat;
use crate::chat::message::{Content, Conversation, Message};
use crate::chat::recovery::{Delta, DeltaKind};
use crate::chat::stop::StopMatcher;
use crate::chat::tokenizer::special;
use crate::constrain::Grammar;
use crate::constrain::VocabLimit;
use crate::error::Result;
use crate::model::LogitRows;
use crate::sample::{Sampled, Sampler, SamplingParams};
use crate::session::{Session, StopReason};

/// Something the assistant produced, as it is generated.
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// A token was generated (sent for every token, before any text it adds), with its log
    /// probabilities when the sampling settings ask for them, so a caller can stop the turn
    /// at any point, not only when text appears.
    Token(&'a Sampled),
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
    /// Stop strings (none empty; the HTTP server takes at most
    /// [`MAX_STOP_STRINGS`](crate::chat::MAX_STOP_STRINGS), as OpenAI does): the turn
    /// ends when one appears in the answer (`final` channel) text, and neither it nor
    /// anything after it is sent or kept ([`StopReason::StopString`]). Reasoning,
    /// commentary and tool-call arguments are never cut.
    pub stop: Vec<String>,
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
    /// Prompt tokens this turn computed: all those not reused, or fewer when the turn was
    /// stopped during the prefill (then the cache holds `reused + prefilled` positions).
    pub prefilled: usize,
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

/// Renders `conversation` for the assistant's next message in `format` (a
/// [`ChatFormat`], or a `&HarmonyEncoding`), as [`complete`] does.
pub fn render_prompt(format: impl Into<ChatFormat>, conversation: &Conversation) -> Result<Vec<u32>> {
    format.into().render_prompt(conversation)
}

/// Runs one assistant turn for `conversation` on `session`: renders it with
/// [`render_prompt`] and runs [`complete_prompt`]. `on_event` receives the generated text
/// as it comes; returning false stops the turn (what was generated is kept and consumed,
/// so the session stays consistent).
pub fn complete(
    session: &mut Session,
    format: impl Into<ChatFormat>,
    conversation: &Conversation,
    opts: &TurnOptions,
    on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool,
) -> Result<TurnOutcome> {
    let format = format.into();
    let prompt = format.render_prompt(conversation)?;
    complete_prompt(session, &format, &prompt, opts, on_event)
}

/// Runs one assistant turn for an already rendered `prompt` (the token IDs of
/// [`render_prompt`]), so a caller that needed the prompt anyway (the HTTP server counts
/// its tokens before queueing) does not render and tokenize the conversation twice.
/// Reuses the cached prefix, generates up to `opts.max_tokens` or until the context is full
/// (then the stop is [`StopReason::ContextFull`]), and streams to `on_event` as
/// [`complete`] does.
pub fn complete_prompt(
    session: &mut Session,
    format: impl Into<ChatFormat>,
    prompt: &[u32],
    opts: &TurnOptions,
    on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool,
) -> Result<TurnOutcome> {
    // With no limit, or one past the room, the session stops when the context is full.
    let format = format.into();
    let max_new = opts.max_tokens.unwrap_or(usize::MAX);
    let model_vocab = session.runner().config().vocab_size;
    opts.sampling.validate_for_vocab(model_vocab)?;
    let mut sampler = Sampler::new(opts.sampling.clone())?;
    if let Some(grammar) = &opts.grammar {
        // Started before the prefill, so the first mask is ready when its logits are.
        sampler = sampler.with_constraint(Box::new(grammar.start()));
    } else if let ChatFormat::ChatMl(c) = &format
        && c.tokenizer().vocab_size() < model_vocab
    {
        // IDs the model has and the tokenizer lacks mean nothing: never sample them.
        sampler = sampler.with_constraint(Box::new(VocabLimit::new(c.tokenizer().vocab_size(), model_vocab)));
    }
    let stops = format.stop_tokens(model_vocab);
    let mut parser = format.turn_parser(&opts.declared_functions);
    let mut answer = AnswerFilter { stops: StopMatcher::new(&opts.stop)?, released: 0 };
    let prefill = prefill_prompt(session, prompt, max_new, on_event)?;
    if !prefill.finished {
        return Ok(prefill.cancelled_outcome(prompt.len()));
    }
    let (reused, prefilled) = (prefill.reused, prefill.computed);
    let mut on_token = |sampled: &Sampled| -> bool {
        if !on_event(ChatEvent::Token(sampled)) {
            return false;
        }
        answer.forward(&parser.push(sampled.token), on_event)
    };
    let generation = session.generate(&[], max_new, &mut sampler, &stops, &mut on_token)?;
    // A turn cut short leaves a partial message: keep (and show) what was said.
    let tail = parser.finish();
    if !answer.stops.stopped() {
        answer.forward(&tail, on_event);
        answer.release_held(on_event);
    }
    let mut messages = parser.into_messages();
    let stop = if answer.stops.stopped() {
        cut_answer(&mut messages, answer.released);
        StopReason::StopString
    } else {
        generation.stop
    };
    Ok(TurnOutcome {
        messages,
        stop,
        prompt_tokens: prompt.len(),
        reused,
        prefilled,
        completion_tokens: generation.tokens.len(),
        tokens: generation.tokens,
    })
}

/// How the prompt of a turn went into the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptFill {
    /// Prompt positions reused from the cache.
    pub reused: usize,
    /// Prompt tokens computed after them.
    pub computed: usize,
    /// Whether the whole prompt is in (false: stopped between prefill blocks).
    pub finished: bool,
}

impl PromptFill {
    /// The outcome of a turn stopped during its prefill: nothing generated.
    pub fn cancelled_outcome(&self, prompt_tokens: usize) -> TurnOutcome {
        TurnOutcome {
            messages: Vec::new(),
            stop: StopReason::Cancelled,
            prompt_tokens,
            reused: self.reused,
            prefilled: self.computed,
            completion_tokens: 0,
            tokens: Vec::new(),
        }
    }
}

/// Puts `prompt` in the cache for a turn that generates up to `max_new` tokens: reuses the
/// longest cached prefix (at most all but the last token), then computes the rest block by
/// block, sending [`ChatEvent::Prefill`] to `on_event` between blocks; false stops it, and
/// the cache keeps the blocks computed. Logits of the last position are kept for sampling
/// unless `max_new` is 0. An empty rest (an empty prompt) continues from the last consumed
/// token inside [`Session::generate`].
pub fn prefill_prompt(
    session: &mut Session,
    prompt: &[u32],
    max_new: usize,
    on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool,
) -> Result<PromptFill> {
    let reused = session.reuse_prefix(prompt)?;
    let rest = &prompt[reused..];
    if rest.is_empty() {
        return Ok(PromptFill { reused, computed: 0, finished: true });
    }
    let rows = if max_new > 0 { LogitRows::Last } else { LogitRows::None };
    let total = prompt.len();
    let finished = session
        .prefill(rest, rows, &mut |done| on_event(ChatEvent::Prefill { done: reused + done, total }))?;
    Ok(PromptFill { reused, computed: session.pos() - reused, finished })
}

/// Passes the parsed deltas on as events, the answer text through the stop strings.
struct AnswerFilter {
    stops: StopMatcher,
    /// Bytes of answer text passed on so far.
    released: usize,
}

impl AnswerFilter {
    /// Sends `deltas` to `on_event`; false when it asks to stop or a stop string was found.
    fn forward(&mut self, deltas: &[Delta], on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool) -> bool {
        for delta in deltas {
            if delta.kind == DeltaKind::Answer {
                let r = self.stops.push(&delta.text);
                if !self.send(&r.text, on_event) || r.stopped {
                    return false;
                }
            } else {
                // Other text interrupts the answer: what was held cannot become a stop
                // string anymore, and goes first to keep the order.
                if !self.release_held(on_event) || !on_event(delta_event(delta)) {
                    return false;
                }
            }
        }
        true
    }

    /// Sends the answer text held back for a possible stop string.
    fn release_held(&mut self, on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool) -> bool {
        let held = self.stops.flush();
        self.send(&held, on_event)
    }

    fn send(&mut self, text: &str, on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool) -> bool {
        if text.is_empty() {
            return true;
        }
        self.released += text.len();
        on_event(ChatEvent::Answer(text))
    }
}

/// Cuts the answer messages (`final`, no recipient) to their first `keep` bytes in all:
/// the message the cut falls in keeps its start (possibly nothing), later ones are dropped.
/// The deltas of a turn add up to its messages, so this is exactly the text sent.
fn cut_answer(messages: &mut Vec<Message>, keep: usize) {
    let mut left = Some(keep);
    messages.retain_mut(|m| {
        if m.recipient.is_some() || m.channel.as_deref() != Some("final") {
            return true;
        }
        let Some(budget) = left else { return false };
        let text = m.text();
        if text.len() <= budget {
            left = Some(budget - text.len());
        } else {
            let cut = (0..=budget).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
            m.content = vec![Content::Text { text: text[..cut].to_string() }];
            left = None;
        }
        true
    });
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

    #[test]
    fn a_stop_string_cuts_only_the_answer_messages() {
        let messages = || {
            vec![
                Message::assistant("analysis", "think"),
                Message::assistant("final", "Hello "),
                Message::tool_call("functions.f", "{}"),
                Message::assistant("final", "world, and more"),
                Message::assistant("final", "after"),
            ]
        };
        let mut m = messages();
        cut_answer(&mut m, "Hello world".len());
        let texts: Vec<String> = m.iter().map(Message::text).collect();
        assert_eq!(texts, ["think", "Hello ", "{}", "world"]);
        let mut m = messages();
        cut_answer(&mut m, 0);
        let texts: Vec<String> = m.iter().map(Message::text).collect();
        assert_eq!(texts, ["think", "", "{}"], "the message the cut falls in stays, empty");
        let mut m = messages();
        cut_answer(&mut m, 1000);
        assert_eq!(m, messages());
    }
}
