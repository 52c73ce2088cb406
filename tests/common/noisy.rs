//! A runner whose logits are seeded noise with boosts: a stand-in for a model that says
//! anything, for testing that a constraint keeps the output valid whatever the logits.
//! Boosted tokens (specials, JSON punctuation) make turns end within a few hundred
//! tokens; an optional script is preferred token by token after the prompt (an adversary
//! that keeps proposing, say, a call of an undeclared function).

use std::path::Path;

use picchio::chat::Tokenizer;
use picchio::config::ModelConfig;
use picchio::engine::Runner;
use picchio::experts::ExpertStats;
use picchio::model::forward::PhaseTimes;
use picchio::model::{LogitRows, Observer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A noisy runner over the o200k_harmony vocabulary (the synthetic tiny shape's config).
pub struct Noisy {
    config: ModelConfig,
    capacity: usize,
    rng: ChaCha8Rng,
    /// Added to the noise of these tokens at every position.
    boosts: Vec<(u32, f32)>,
    /// Preferred tokens after the prompt, by position, and how strongly.
    script: Vec<u32>,
    script_boost: f32,
    /// Positions fed so far and where the current reply began.
    pos: usize,
    reply_start: usize,
}

impl Noisy {
    /// Noise from `seed`; specials and the tokens of JSON punctuation boosted so turns end.
    pub fn new(seed: u64, capacity: usize) -> Self {
        let spec = picchio::synth::SynthSpec::of(picchio::synth::SynthShape::Tiny);
        let config =
            ModelConfig::from_json_str(&spec.config_json().to_string(), Path::new("noisy/config.json"))
                .unwrap();
        let tokenizer = Tokenizer::new();
        let mut boosts: Vec<(u32, f32)> = (199_998..201_088).map(|t| (t, 9.0)).collect();
        for text in ["\"", "\",", "\"}", "}", "]", ",", "\":", "true", "false", "1", "\"a\""] {
            for t in tokenizer.encode(text) {
                boosts.push((t, 7.0));
            }
        }
        Noisy {
            config,
            capacity,
            rng: ChaCha8Rng::seed_from_u64(seed),
            boosts,
            script: Vec::new(),
            script_boost: 0.0,
            pos: 0,
            reply_start: 0,
        }
    }

    /// The same runner preferring `script` (Harmony text with special tokens) after the
    /// prompt by `boost` over the noise.
    pub fn with_script(mut self, script: &str, boost: f32) -> Self {
        self.script = Tokenizer::new().encode_with_special(script);
        self.script_boost = boost;
        self
    }
}

impl Runner for Noisy {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn describe(&self) -> String {
        "noisy".into()
    }

    fn prefill_block(&self) -> usize {
        usize::MAX
    }

    fn forward(
        &mut self,
        ids: &[u32],
        start_pos: usize,
        rows: LogitRows,
        _observer: &mut dyn Observer,
    ) -> picchio::Result<Vec<f32>> {
        self.pos = start_pos + ids.len();
        if ids.len() > 1 {
            // A prompt: the reply starts after it.
            self.reply_start = self.pos;
        }
        let n = match rows {
            LogitRows::Last => 1,
            LogitRows::All => ids.len(),
            LogitRows::None => 0,
        };
        let vocab = self.config.vocab_size;
        let mut logits = vec![0.0f32; n * vocab];
        let k = self.pos - self.reply_start;
        for row in logits.chunks_exact_mut(vocab) {
            for v in row.iter_mut() {
                *v = self.rng.random::<f32>() * 4.0;
            }
            for &(t, b) in &self.boosts {
                row[t as usize] += b;
            }
            if let Some(&t) = self.script.get(k) {
                row[t as usize] += self.script_boost;
            }
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
