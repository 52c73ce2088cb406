//! A scripted runner for server tests: it writes fixed Harmony replies (reasoning then an
//! answer, a tool call, the answer after the tool's result, or an answer that never ends),
//! chosen by what the prompt says, so that content, reasoning, tool calls and streaming can
//! be checked exactly.

use std::path::Path;
use std::time::Duration;

use picchio::chat::Tokenizer;
use picchio::config::ModelConfig;
use picchio::engine::Runner;
use picchio::experts::ExpertStats;
use picchio::model::forward::PhaseTimes;
use picchio::model::{LogitRows, Observer};

/// The default reply: reasoning, then an answer.
pub const REASONING: &str = "Thinking about it.";
pub const ANSWER: &str = "Hello from the scripted model!";
pub const DEFAULT_REPLY: &str = "<|channel|>analysis<|message|>Thinking about it.<|end|>\
    <|start|>assistant<|channel|>final<|message|>Hello from the scripted model!<|return|>";
/// When the tool `get_weather` is declared: reasoning, then a call.
pub const TOOL_ARGUMENTS: &str = r#"{"city":"Paris"}"#;
pub const TOOL_REPLY: &str = "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>\
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json\
    <|message|>{\"city\":\"Paris\"}<|call|>";
/// After the tool's result.
pub const AFTER_TOOL_ANSWER: &str = "It is sunny in Paris.";
pub const AFTER_TOOL_REPLY: &str = "<|channel|>final<|message|>It is sunny in Paris.<|return|>";
/// When the user says "forever": an answer that goes on until the token limit.
pub const ENDLESS_REPLY: &str = "<|channel|>final<|message|>";
pub const ENDLESS_FILLER: &str = " la";

/// A runner that writes a fixed reply after each prompt, chosen by what the prompt says.
/// It keeps the token history the session feeds it, so it knows where a prompt ends: a
/// forward call that is not the token it just predicted starts a new reply.
pub struct Scripted {
    config: ModelConfig,
    capacity: usize,
    tokenizer: Tokenizer,
    history: Vec<u32>,
    reply: Vec<u32>,
    filler: Option<u32>,
    reply_start: usize,
    predicted: Option<(usize, u32)>,
    delay: Duration,
    /// Positions per forward call a session feeds (the prefill block).
    block: usize,
}

impl Scripted {
    /// A runner with a context of `capacity` tokens that sleeps `delay` in every forward call.
    pub fn new(capacity: usize, delay: Duration) -> Self {
        let spec = picchio::synth::SynthSpec::of(picchio::synth::SynthShape::Tiny);
        let config =
            ModelConfig::from_json_str(&spec.config_json().to_string(), Path::new("scripted/config.json"))
                .unwrap();
        Scripted {
            config,
            capacity,
            tokenizer: Tokenizer::new(),
            history: Vec::new(),
            reply: Vec::new(),
            filler: None,
            reply_start: 0,
            predicted: None,
            delay,
            block: usize::MAX,
        }
    }

    /// The same runner taking `block` positions per forward call of a prefill.
    pub fn with_prefill_block(mut self, block: usize) -> Self {
        self.block = block;
        self
    }

    fn choose_reply(&mut self) {
        let text = self.tokenizer.decode(&self.history).unwrap();
        let (reply, filler) = if text.contains("<|start|>functions.get_weather") {
            (AFTER_TOOL_REPLY, None)
        } else if text.contains("get_weather") {
            (TOOL_REPLY, None)
        } else if text.contains("forever") {
            (ENDLESS_REPLY, Some(ENDLESS_FILLER))
        } else {
            (DEFAULT_REPLY, None)
        };
        self.reply = self.tokenizer.encode_with_special(reply);
        self.filler = filler.map(|f| {
            let t = self.tokenizer.encode(f);
            assert_eq!(t.len(), 1, "the filler is one token");
            t[0]
        });
    }

    fn next_token(&self) -> u32 {
        let k = self.history.len() - self.reply_start;
        match self.reply.get(k) {
            Some(&t) => t,
            None => self.filler.unwrap_or(199_999),
        }
    }
}

impl Runner for Scripted {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn describe(&self) -> String {
        "scripted".into()
    }

    fn prefill_block(&self) -> usize {
        self.block
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        _observer: &mut dyn Observer,
    ) -> picchio::Result<Vec<f32>> {
        std::thread::sleep(self.delay);
        let continues = ids.len() == 1 && self.predicted == Some((start_pos, ids[0]));
        self.history.truncate(start_pos);
        self.history.extend_from_slice(ids);
        if !continues {
            self.reply_start = self.history.len();
            self.choose_reply();
        }
        let next = self.next_token();
        let n = match rows {
            LogitRows::Last => 1,
            LogitRows::All => ids.len(),
            LogitRows::None => 0,
        };
        self.predicted = (n > 0).then_some((self.history.len(), next));
        let vocab = self.config.vocab_size;
        let mut logits = vec![0.0f32; n * vocab];
        for row in logits.chunks_exact_mut(vocab) {
            row[next as usize] = 40.0;
        }
        Ok(logits)
    }

    fn times(&self) -> PhaseTimes {
        PhaseTimes::default()
    }

    fn expert_stats(&self) -> ExpertStats {
        ExpertStats::default()
    }
}
