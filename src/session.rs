//! A session: one conversation's key/value cache and position on a runner.
//!
//! Invariant: `pos` equals the number of valid positions in the cache, and every token the
//! session emits is also consumed (fed back), so the next turn continues from a cache that
//! matches the token history exactly. Every request is validated before any state changes.

use std::sync::Arc;

use crate::engine::{Pick, Picked, Runner};
use crate::error::{Error, Result};
use crate::model::{LogitRows, NoObserver, Observer};
use crate::sample::{PlannedLogits, SamplePlan, Sampled, Sampler};

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The requested number of tokens was produced.
    MaxTokens,
    /// A stop token was produced (and consumed).
    Stop(u32),
    /// The context is full; the last emitted token was consumed.
    ContextFull,
    /// The caller asked to stop.
    Cancelled,
    /// One of the caller's stop strings appeared in the answer text. Reported by a chat
    /// turn ([`crate::chat::complete_prompt`]), which sees text; the session itself stops
    /// only on tokens.
    StopString,
}

/// The result of a generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Tokens produced, stop token included.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
}

/// A conversation's state on a runner.
pub struct Session {
    runner: Box<dyn Runner>,
    /// Token at each valid cache position.
    tokens: Vec<u32>,
    /// The logit rows of the last forward pass (its last row belongs to the last consumed
    /// token); empty when they were not computed or no longer match the cache.
    logits: Vec<f32>,
    /// The next pick after the last consumed token, when the last forward pass was a
    /// greedy or planned step instead of logits.
    next_token: Option<Pending>,
}

/// The next pick, as a greedy or planned step left it.
enum Pending {
    /// The greedy token ([`Pick::Greedy`]).
    Greedy(u32),
    /// A planned pick and what the runner handed back for it ([`Pick::Planned`]).
    Planned(Arc<SamplePlan>, Box<PlannedLogits>),
}

impl Session {
    /// A fresh session (empty cache).
    pub fn new(runner: Box<dyn Runner>) -> Self {
        Session { runner, tokens: Vec::new(), logits: Vec::new(), next_token: None }
    }

    /// A session on `runner` whose cache already holds `tokens` at positions `0..` (the
    /// history of [`into_parts`](Self::into_parts), or of a slot's first cache). The
    /// caller vouches that the cache matches; no logits are kept, so the next turn
    /// recomputes its last token's.
    pub fn with_history(runner: Box<dyn Runner>, tokens: Vec<u32>) -> Self {
        Session { runner, tokens, logits: Vec::new(), next_token: None }
    }

    /// The runner and the tokens its cache holds, for [`with_history`](Self::with_history)
    /// (e.g. to put a session's runner behind [`crate::slots::Slots`]).
    pub fn into_parts(self) -> (Box<dyn Runner>, Vec<u32>) {
        (self.runner, self.tokens)
    }

    /// The runner.
    pub fn runner(&self) -> &dyn Runner {
        self.runner.as_ref()
    }

    /// Valid positions in the cache.
    pub fn pos(&self) -> usize {
        self.tokens.len()
    }

    /// Cache capacity.
    pub fn capacity(&self) -> usize {
        self.runner.capacity()
    }

    /// The token at every valid position.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Checks that every ID is in the vocabulary; the error names the first bad one.
    pub fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.runner.config().vocab_size;
        match ids.iter().enumerate().find(|&(_, &id)| id as usize >= vocab) {
            Some((i, id)) => Err(Error::invalid(format!(
                "token ID {id} (input position {i}) is outside the vocabulary (0..{vocab})"
            ))),
            None => Ok(()),
        }
    }

    /// Checks that `keep` cached positions plus `new` more fit.
    pub fn check_fits(&self, keep: usize, new: usize) -> Result<()> {
        if keep > self.pos() {
            return Err(Error::invalid(format!(
                "cannot keep {keep} positions: only {} are cached",
                self.pos()
            )));
        }
        match keep.checked_add(new) {
            Some(needed) if needed <= self.capacity() => {}
            needed => {
                return Err(Error::ContextFull {
                    needed: needed.unwrap_or(usize::MAX),
                    capacity: self.capacity(),
                });
            }
        }
        Ok(())
    }

    /// Drops every position from `keep` on.
    pub fn rewind(&mut self, keep: usize) -> Result<()> {
        self.check_fits(keep, 0)?;
        if keep < self.tokens.len() {
            self.tokens.truncate(keep);
            self.logits.clear();
            self.next_token = None;
        }
        Ok(())
    }

    /// Consumes `ids` after the cached positions and returns logits for `rows`.
    /// Validates IDs and capacity first: on error, nothing has changed.
    pub fn feed(&mut self, ids: &[u32], rows: LogitRows, observer: &mut dyn Observer) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.consume(ids, rows, observer)?;
        Ok(self.logits.clone())
    }

    /// Consumes `ids` after the cached positions in blocks of the runner's
    /// [`prefill_block`](Runner::prefill_block), asking `keep_going` between blocks (with the
    /// number of `ids` consumed so far) whether to go on. Returns whether every ID was
    /// consumed; the logits for `rows` stay for sampling, as after [`feed`](Self::feed).
    ///
    /// Validates IDs and capacity first: on error nothing has changed. When stopped, the
    /// session holds exactly the blocks that were computed (the cache still matches the
    /// token history) and no logits, so the next turn reuses those positions as a prefix.
    pub fn prefill(
        &mut self,
        ids: &[u32],
        rows: LogitRows,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool> {
        self.check_ids(ids)?;
        self.check_fits(self.pos(), ids.len())?;
        let block = self.runner.prefill_block().max(1);
        let blocks = ids.len().div_ceil(block);
        let mut logits = Vec::new();
        for (b, chunk) in ids.chunks(block).enumerate() {
            if b > 0 && !keep_going(b * block) {
                self.logits.clear();
                return Ok(false);
            }
            let block_rows = match rows {
                LogitRows::All => LogitRows::All,
                LogitRows::Last if b + 1 == blocks => LogitRows::Last,
                LogitRows::Last | LogitRows::None => LogitRows::None,
            };
            self.consume(chunk, block_rows, &mut NoObserver)?;
            logits.append(&mut self.logits);
        }
        self.logits = logits;
        Ok(true)
    }

    /// [`feed`](Self::feed) without handing the logits out (they stay for sampling).
    fn consume(&mut self, ids: &[u32], rows: LogitRows, observer: &mut dyn Observer) -> Result<()> {
        self.check_ids(ids)?;
        self.check_fits(self.pos(), ids.len())?;
        if ids.is_empty() {
            return Ok(());
        }
        let logits = self.runner.forward(ids, self.pos(), rows, observer)?;
        self.tokens.extend_from_slice(ids);
        self.logits = if matches!(rows, LogitRows::None) { Vec::new() } else { logits };
        self.next_token = None;
        Ok(())
    }

    /// Consumes `token` and keeps the greedy next token instead of logits (for a plain
    /// greedy sampler: on a GPU only the token ID is read back). On error nothing has
    /// changed but the logits, which no longer match.
    fn consume_greedy(&mut self, token: u32) -> Result<()> {
        self.check_ids(&[token])?;
        self.check_fits(self.pos(), 1)?;
        self.logits.clear();
        self.next_token = None;
        let Picked::Greedy(next) = self.runner.forward_pick(0, &[token], self.pos(), &Pick::Greedy)? else {
            return Err(Error::Backend("a greedy step handed back no token".into()));
        };
        self.tokens.push(token);
        self.next_token = Some(Pending::Greedy(next));
        Ok(())
    }

    /// Consumes `token` and keeps what the runner hands back for the sampler's planned
    /// next pick instead of logits (on a GPU, candidates of a few kilobytes). On error
    /// nothing has changed but the logits, which no longer match.
    fn consume_planned(&mut self, token: u32, plan: SamplePlan) -> Result<()> {
        self.check_ids(&[token])?;
        self.check_fits(self.pos(), 1)?;
        self.logits.clear();
        self.next_token = None;
        let plan = Arc::new(plan);
        let pick = Pick::Planned(Arc::clone(&plan));
        let Picked::Planned(handed) = self.runner.forward_pick(0, &[token], self.pos(), &pick)? else {
            return Err(Error::Backend("a planned step handed back no logits".into()));
        };
        self.tokens.push(token);
        self.next_token = Some(Pending::Planned(plan, Box::new(handed)));
        Ok(())
    }

    /// The logits after the last consumed token, if they were computed.
    fn last_logits(&self) -> Option<&[f32]> {
        let vocab = self.runner.config().vocab_size;
        self.logits.len().checked_sub(vocab).and_then(|start| self.logits.get(start..))
    }

    /// Length of the longest common prefix of the cached tokens and `ids`.
    pub fn common_prefix(&self, ids: &[u32]) -> usize {
        self.tokens.iter().zip(ids).take_while(|(a, b)| a == b).count()
    }

    /// Makes the cache hold exactly the prefix of `full_prompt` that it shares with the
    /// cached tokens (at most all but the last prompt token, so the last one is fed again
    /// and yields logits), and returns how many positions were reused. Checks the whole
    /// prompt first: on error nothing has changed.
    pub fn reuse_prefix(&mut self, full_prompt: &[u32]) -> Result<usize> {
        self.check_ids(full_prompt)?;
        if full_prompt.len() > self.capacity() {
            return Err(Error::ContextFull { needed: full_prompt.len(), capacity: self.capacity() });
        }
        let keep = self.common_prefix(full_prompt).min(full_prompt.len().saturating_sub(1));
        self.rewind(keep)?;
        Ok(keep)
    }

    /// Feeds `prompt`, then produces up to `max_new` tokens, feeding each one back. Stops
    /// early on a token in `stop`, when the context is full, or when `on_token` returns
    /// false. `on_token` gets each token as it is picked, with its log probabilities when
    /// the sampler's settings ask for them. An empty prompt continues from the last
    /// consumed token.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampler: &mut Sampler,
        stop: &[u32],
        on_token: &mut dyn FnMut(&Sampled) -> bool,
    ) -> Result<Generation> {
        if prompt.is_empty() && max_new > 0 && self.last_logits().is_none() && self.next_token.is_none() {
            // Continue from the last consumed token: its logits were not kept (a turn ends
            // by consuming its last token without them), so compute them again; its cache
            // entry is rewritten with the same values.
            let Some(&last) = self.tokens.last() else {
                return Err(Error::invalid("empty prompt and nothing to continue from"));
            };
            self.rewind(self.pos() - 1)?;
            self.consume(&[last], LogitRows::Last, &mut NoObserver)?;
        }
        if !prompt.is_empty() {
            let rows = if max_new > 0 { LogitRows::Last } else { LogitRows::None };
            self.consume(prompt, rows, &mut NoObserver)?;
        }
        let mut out = Vec::new();
        while out.len() < max_new {
            if self.pos() >= self.capacity() {
                return Ok(Generation { tokens: out, stop: StopReason::ContextFull });
            }
            let sampled = match self.next_token.take() {
                Some(Pending::Greedy(token)) => Sampled::token(token),
                Some(Pending::Planned(plan, handed)) => sampler.finish(&plan, &handed)?,
                None => {
                    let Some(logits) = self.last_logits() else {
                        break;
                    };
                    // Non-finite logits are an error, not a token: the cache still matches
                    // the history (the last token was consumed), so the session stays usable.
                    sampler.sample_with_logprobs(logits, &self.tokens)?
                }
            };
            let token = sampled.token;
            // A constraint computes its next mask while the token is consumed below.
            sampler.advance(token);
            out.push(token);
            let keep_going = on_token(&sampled);
            let is_stop = stop.contains(&token);
            let more = keep_going && !is_stop && out.len() < max_new;
            // Consume what was emitted, so the cache matches the history. A plain greedy
            // sampler takes the next token straight from the runner.
            // Any other sampler without a grammar plans its pick, so the runner reduces the
            // logits where they are.
            if more && sampler.is_plain_greedy() {
                self.consume_greedy(token)?;
            } else if let Some(plan) = more.then(|| sampler.plan(&self.tokens, &[token])).flatten() {
                self.consume_planned(token, plan)?;
            } else {
                self.consume(
                    &[token],
                    if more { LogitRows::Last } else { LogitRows::None },
                    &mut NoObserver,
                )?;
            }
            if is_stop {
                return Ok(Generation { tokens: out, stop: StopReason::Stop(token) });
            }
            if !keep_going {
                return Ok(Generation { tokens: out, stop: StopReason::Cancelled });
            }
        }
        Ok(Generation { tokens: out, stop: StopReason::MaxTokens })
    }
}
