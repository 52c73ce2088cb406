//! Constrained decoding: a grammar decides which tokens may come next, and the sampler
//! picks only among those. Built on the `llguidance` crate (the grammar engine llama.cpp
//! and vLLM use) over the model's vocabulary ([`vocab`]); the grammars of whole Harmony
//! turns come from [`grammar`].
//!
//! The sampler sees a constraint through [`TokenConstraint`]: it asks for the mask of the
//! next position and reports each token it emits. [`GrammarConstraint`] computes the next
//! mask on its own thread as soon as a token is reported, so while the session runs the
//! forward pass for that token (tens of milliseconds or more on a real model) the mask is
//! computed beside it, and the sampler rarely waits.

pub mod grammar;
pub mod vocab;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use llguidance::Matcher;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;

pub use grammar::{AnswerFormat, FunctionRule, ToolRule, TurnSpec};
pub use vocab::Vocabulary;

use crate::error::{Error, Result};

/// The tokens allowed at one position.
#[derive(Clone, Debug)]
pub struct TokenMask {
    bits: SimpleVob,
}

impl TokenMask {
    /// Whether token `id` is allowed (an ID outside the vocabulary never is).
    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.bits.len() && self.bits.is_allowed(id)
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.bits.num_set()
    }
}

/// Allows only the IDs a tokenizer has (`0..allowed`) in a model of `model_vocab` IDs: a
/// model whose vocabulary is larger than its tokenizer's never samples an ID that has no
/// text.
#[derive(Debug)]
pub struct VocabLimit {
    mask: TokenMask,
}

impl VocabLimit {
    /// IDs `0..allowed` of `model_vocab`.
    pub fn new(allowed: usize, model_vocab: usize) -> Self {
        let mut bits = SimpleVob::alloc(model_vocab);
        for id in 0..allowed.min(model_vocab) {
            bits.allow_token(id as u32);
        }
        VocabLimit { mask: TokenMask { bits } }
    }
}

impl TokenConstraint for VocabLimit {
    fn mask(&mut self) -> Result<&TokenMask> {
        Ok(&self.mask)
    }

    fn advance(&mut self, _token: u32) {}

    fn stats(&self) -> ConstraintStats {
        ConstraintStats::default()
    }
}

/// Something that restricts which token may come next. The sampler calls
/// [`mask`](Self::mask) before each pick and [`advance`](Self::advance) with each token it
/// emits.
pub trait TokenConstraint: Send + std::fmt::Debug {
    /// The tokens allowed at the next position (waiting for it if it is being computed).
    /// Fails when the constraint broke or allows nothing.
    fn mask(&mut self) -> Result<&TokenMask>;

    /// Takes `token` (which the last mask allowed) as emitted, and starts on the next mask.
    /// A failure shows at the next [`mask`](Self::mask).
    fn advance(&mut self, token: u32);

    /// Time spent so far, for measurement.
    fn stats(&self) -> ConstraintStats;
}

/// Where a constraint's time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ConstraintStats {
    /// Masks computed.
    pub masks: u64,
    /// Total time computing masks (on the constraint's thread).
    pub compute: Duration,
    /// Total time the sampler waited for a mask (what the constraint adds to decoding).
    pub waited: Duration,
}

/// Which part of a request a grammar error comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrammarPart {
    /// The schema of the final answer.
    Answer,
    /// The parameters schema of the named function.
    Parameters(String),
    /// The turn grammar as a whole.
    Turn,
}

/// A grammar that does not compile, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct GrammarError {
    /// The part of the request at fault.
    pub part: GrammarPart,
    /// What the grammar engine said.
    pub message: String,
}

/// A compiled grammar over a vocabulary, ready to start constraints from.
pub struct Grammar {
    matcher: Matcher,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("vocab_size", &self.vocab_size).finish()
    }
}

impl Grammar {
    /// Compiles a grammar in llguidance's Lark dialect.
    pub fn from_lark(
        lark: &str,
        vocab: &Vocabulary,
        part: GrammarPart,
    ) -> std::result::Result<Grammar, GrammarError> {
        let parser = vocab
            .factory()
            .create_parser(TopLevelGrammar::from_lark(lark.to_string()))
            .map_err(|e| GrammarError { part: part.clone(), message: e.to_string() })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError { part, message: e });
        }
        Ok(Grammar { matcher, vocab_size: vocab.size() })
    }

    /// Compiles the grammar of a whole assistant turn. Each JSON schema is compiled on its
    /// own first, so an error names the schema it is in.
    pub fn for_turn(spec: &TurnSpec, vocab: &Vocabulary) -> std::result::Result<Grammar, GrammarError> {
        if let AnswerFormat::JsonSchema { schema, strict } = &spec.answer {
            check_schema(schema, *strict, vocab, GrammarPart::Answer)?;
        }
        if let ToolRule::Required(functions) = &spec.tools {
            for f in functions {
                if let Some(p) = &f.parameters {
                    check_schema(p, f.strict, vocab, GrammarPart::Parameters(f.name.clone()))?;
                }
            }
        }
        Grammar::from_lark(&spec.lark(), vocab, GrammarPart::Turn)
    }

    /// JSON values valid against `schema`, one per line, without end: a grammar for
    /// measuring the cost of masks over a raw decode (`picchio bench --json-schema`), where
    /// no chat format frames the output.
    pub fn json_lines(
        schema: &serde_json::Value,
        vocab: &Vocabulary,
    ) -> std::result::Result<Grammar, GrammarError> {
        check_schema(schema, true, vocab, GrammarPart::Answer)?;
        let lark = format!("start: (value \"\\n\")+\nvalue: {}\n", grammar::json_rule(schema, true));
        Grammar::from_lark(&lark, vocab, GrammarPart::Turn)
    }

    /// A constraint at the start of the grammar, computing its masks on its own thread.
    pub fn start(&self) -> GrammarConstraint {
        GrammarConstraint::new(self.matcher.deep_clone())
    }

    /// Whether `tokens` are a complete sentence of the grammar (every token allowed in
    /// turn, and the grammar finished or able to finish after the last).
    pub fn accepts(&self, tokens: &[u32]) -> bool {
        let mut m = self.matcher.deep_clone();
        m.consume_tokens(tokens).is_ok()
            && (m.is_stopped() && !m.is_error() || m.is_accepting().unwrap_or(false))
    }
}

/// Compiles `schema` alone, so its error can be told apart from the rest of the grammar.
fn check_schema(
    schema: &serde_json::Value,
    strict: bool,
    vocab: &Vocabulary,
    part: GrammarPart,
) -> std::result::Result<(), GrammarError> {
    if !schema.is_object() && !schema.is_boolean() {
        return Err(GrammarError { part, message: "a JSON schema must be an object".into() });
    }
    Grammar::from_lark(&format!("start: {}\n", grammar::json_rule(schema, strict)), vocab, part).map(|_| ())
}

/// A mask computed on the constraint's thread, and how long it took.
struct Computed {
    mask: std::result::Result<SimpleVob, String>,
    took: Duration,
}

/// A grammar being followed token by token; the next mask is computed on a thread of its
/// own while the caller runs the model (see the module docs). The thread ends with it.
pub struct GrammarConstraint {
    tokens: mpsc::Sender<u32>,
    masks: mpsc::Receiver<Computed>,
    /// The mask of the next position, once received.
    current: Option<TokenMask>,
    /// A mask is being computed (a token was reported since the last one arrived).
    pending: bool,
    stats: ConstraintStats,
}

impl std::fmt::Debug for GrammarConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarConstraint").field("stats", &self.stats).finish()
    }
}

impl GrammarConstraint {
    fn new(mut matcher: Matcher) -> Self {
        let (tokens, token_rx) = mpsc::channel::<u32>();
        let (mask_tx, masks) = mpsc::channel::<Computed>();
        std::thread::Builder::new()
            .name("picchio-grammar".into())
            .spawn(move || {
                loop {
                    let t0 = Instant::now();
                    let mask = matcher.compute_mask_or_eos().map_err(|e| e.to_string());
                    if mask_tx.send(Computed { mask, took: t0.elapsed() }).is_err() {
                        return;
                    }
                    let Ok(token) = token_rx.recv() else { return };
                    // An error leaves the matcher failed; the next mask reports it.
                    let _ = matcher.consume_token(token);
                }
            })
            .map_or_else(
                |e| {
                    // No thread: every mask reports it.
                    let (tx, rx) = mpsc::channel();
                    let _ = tx.send(Computed {
                        mask: Err(format!("cannot start the grammar thread: {e}")),
                        took: Duration::ZERO,
                    });
                    GrammarConstraint {
                        tokens: mpsc::channel().0,
                        masks: rx,
                        current: None,
                        pending: true,
                        stats: ConstraintStats::default(),
                    }
                },
                |_| GrammarConstraint {
                    tokens,
                    masks,
                    current: None,
                    pending: true,
                    stats: ConstraintStats::default(),
                },
            )
    }
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self) -> Result<&TokenMask> {
        if self.pending {
            let t0 = Instant::now();
            let computed = self.masks.recv().map_err(|_| Error::Constraint("its thread stopped".into()))?;
            self.stats.waited += t0.elapsed();
            self.stats.compute += computed.took;
            self.stats.masks += 1;
            self.pending = false;
            let bits = computed.mask.map_err(Error::Constraint)?;
            self.current = Some(TokenMask { bits });
        }
        match &self.current {
            Some(m) if m.count() > 0 => Ok(m),
            Some(_) => Err(Error::Constraint(
                "it allows no token here (it needs a token the model's vocabulary lacks)".into(),
            )),
            None => Err(Error::Constraint("it failed earlier".into())),
        }
    }

    fn advance(&mut self, token: u32) {
        self.current = None;
        self.pending = true;
        // A closed channel (the thread is gone) shows as an error at the next mask.
        let _ = self.tokens.send(token);
    }

    fn stats(&self) -> ConstraintStats {
        self.stats
    }
}
