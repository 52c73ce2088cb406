//! The engine side of `POST /v1/completions`: a raw continuation of a prompt's token IDs,
//! with no chat format. The prompt goes in as [`complete_prompt`] puts a chat prompt in
//! (cached prefix reused, the rest block by block, stoppable between blocks), and what the
//! model writes comes back as text, decoded token by token, until a turn's stop token
//! (`<|return|>`, `<|call|>`, `<|endoftext|>`), which is not part of the text.
//!
//! [`complete_prompt`]: crate::chat::complete_prompt

use crate::chat::{ChatEvent, ChatFormat, TurnOptions, TurnOutcome, prefill_prompt};
use crate::error::Result;
use crate::sample::{Sampled, Sampler};
use crate::session::Session;

/// How generated tokens become text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawText {
    /// Leave special tokens (`<|channel|>`, `<|end|>`, ...) out of the text rather than
    /// writing their names.
    pub skip_special_tokens: bool,
}

/// Continues `prompt` on `session` with `opts.sampling`, up to `opts.max_tokens` (or the end
/// of the context), streaming the text to `on_event` as [`ChatEvent::Answer`] pieces that
/// never split a UTF-8 character. `on_event` also gets [`ChatEvent::Prefill`] between
/// prefill blocks and [`ChatEvent::Token`] before each token's text; returning false stops
/// the turn. The outcome has no messages: the text is what the pieces said.
pub(crate) fn complete_raw(
    session: &mut Session,
    format: &ChatFormat,
    prompt: &[u32],
    opts: &TurnOptions,
    text: RawText,
    on_event: &mut dyn FnMut(ChatEvent<'_>) -> bool,
) -> Result<TurnOutcome> {
    let max_new = opts.max_tokens.unwrap_or(usize::MAX);
    let mut sampler = Sampler::new(opts.sampling.clone())?;
    let stops = format.stop_tokens(session.runner().config().vocab_size);
    let tokenizer = format.tokenizer();
    let prefill = prefill_prompt(session, prompt, max_new, on_event)?;
    if !prefill.finished {
        return Ok(prefill.cancelled_outcome(prompt.len()));
    }
    let mut decoder = tokenizer.stream_decoder();
    let mut on_token = |sampled: &Sampled| -> bool {
        if !on_event(ChatEvent::Token(sampled)) {
            return false;
        }
        let id = sampled.token;
        let silent = stops.contains(&id) || (text.skip_special_tokens && tokenizer.is_special(id));
        if silent {
            return true;
        }
        match decoder.push(id) {
            Ok(Some(piece)) => on_event(ChatEvent::Answer(&piece)),
            Ok(None) => true,
            // An ID past the tokenizer's (a model with a padded vocabulary) has no text: shown as U+FFFD, as undecodable bytes are.
            Err(_) => on_event(ChatEvent::Answer("\u{FFFD}")),
        }
    };
    let generation = session.generate(&[], max_new, &mut sampler, &stops, &mut on_token)?;
    if let Some(rest) = decoder.finish() {
        on_event(ChatEvent::Answer(&rest));
    }
    Ok(TurnOutcome {
        messages: Vec::new(),
        stop: generation.stop,
        prompt_tokens: prompt.len(),
        reused: prefill.reused,
        prefilled: prefill.computed,
        completion_tokens: generation.tokens.len(),
        tokens: generation.tokens,
    })
}
