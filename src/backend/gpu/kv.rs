//! The precision of the GPU's key/value cache and the sizes it implies.
//!
//! The cache keeps one row per position and layer for keys and one for values, each
//! `kv_dim = kv_heads * head_dim` values wide. In F32 a value is one 4-byte word. In F16
//! two values share a word as IEEE binary16 (`pack2x16float` / `unpack2x16float`, low half
//! the even column), and a row is `ceil(kv_dim / 2)` words, so a row with an odd `kv_dim`
//! ends with a zero half (with the even `head_dim` the backend requires, `kv_dim` is even
//! and every head starts on a word). Every size here is computed with checked arithmetic.

use crate::config::ModelConfig;

/// How the GPU stores keys and values (`--kv-cache`). The CPU oracle always keeps F32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum KvPrecision {
    /// 4 bytes a value: the values the kernels computed, bit for bit.
    #[default]
    F32,
    /// 2 bytes a value, IEEE binary16 (half the cache's VRAM and the bytes attention reads;
    /// each stored value rounded to 11 significant bits, finite values beyond +-65504
    /// saturated to +-65504).
    F16,
}

impl KvPrecision {
    /// `f32` or `f16`, as the flag spells it.
    pub fn label(self) -> &'static str {
        match self {
            KvPrecision::F32 => "f32",
            KvPrecision::F16 => "f16",
        }
    }

    /// Bytes one value takes (before a row's padding).
    pub fn value_bytes(self) -> u64 {
        match self {
            KvPrecision::F32 => 4,
            KvPrecision::F16 => 2,
        }
    }

    /// 4-byte words one position's keys (or values) take in one layer: `kv_dim`, or
    /// `ceil(kv_dim / 2)` in F16.
    pub fn row_words(self, kv_dim: usize) -> u64 {
        let n = kv_dim as u64;
        match self {
            KvPrecision::F32 => n,
            KvPrecision::F16 => n.div_ceil(2),
        }
    }

    /// Bytes of one layer's keys (or values) for `positions` positions; `None` on overflow.
    pub fn layer_bytes(self, positions: usize, kv_dim: usize) -> Option<u64> {
        self.row_words(kv_dim).checked_mul(4)?.checked_mul(positions as u64)
    }

    /// Bytes one position takes in a whole cache: keys and values of every layer; `None` on
    /// overflow.
    pub fn position_bytes(self, cfg: &ModelConfig) -> Option<u64> {
        self.cache_bytes(cfg, 1)
    }

    /// Bytes of one sequence's cache of `positions` positions: keys and values of every
    /// layer (sliding layers hold every position too); `None` on overflow.
    pub fn cache_bytes(self, cfg: &ModelConfig, positions: usize) -> Option<u64> {
        self.layer_bytes(positions, cfg.kv_dim())?.checked_mul(2)?.checked_mul(cfg.num_layers as u64)
    }

    /// Positions one layer's keys (or values) can hold within `binding_bytes` (one storage
    /// binding), for the message that refuses a larger `--ctx`.
    pub fn positions_within(self, binding_bytes: u64, kv_dim: usize) -> u64 {
        binding_bytes / self.row_words(kv_dim).saturating_mul(4).max(1)
    }
}

impl std::fmt::Display for KvPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-OSS-20B's attention shape: 24 layers, 8 KV heads of 64.
    fn gpt_oss_20b() -> ModelConfig {
        let json = r#"{
            "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
            "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
            "vocab_size": 201088, "sliding_window": 128, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "swiglu_limit": 7.0
        }"#;
        ModelConfig::from_json_str(json, std::path::Path::new("20b.json")).unwrap()
    }

    #[test]
    fn f16_halves_every_size_and_pads_an_odd_row() {
        let cfg = gpt_oss_20b();
        // 24 layers x keys and values x 512 values x 4 bytes = 98,304 bytes a position.
        assert_eq!(KvPrecision::F32.position_bytes(&cfg), Some(24 * 2 * 512 * 4));
        assert_eq!(KvPrecision::F16.position_bytes(&cfg), Some(24 * 2 * 512 * 2));
        assert_eq!(KvPrecision::F32.position_bytes(&cfg), cfg.kv_bytes(1), "the CPU's F32 cache size");
        assert_eq!(KvPrecision::F16.cache_bytes(&cfg, 131_072), Some(24 * 2 * 512 * 2 * 131_072));
        // An odd row takes a whole last word.
        assert_eq!(KvPrecision::F16.row_words(7), 4);
        assert_eq!(KvPrecision::F16.layer_bytes(10, 7), Some(160));
        assert_eq!(KvPrecision::F32.layer_bytes(10, 7), Some(280));
        // Overflow is None, never a wrapped size.
        assert_eq!(KvPrecision::F16.layer_bytes(usize::MAX, 512), None);
        assert_eq!(KvPrecision::F32.cache_bytes(&cfg, usize::MAX), None);
        // 128 MiB bindings (lavapipe): 65,536 positions of 512 values in F32, twice as many in F16.
        assert_eq!(KvPrecision::F32.positions_within(128 << 20, 512), 65_536);
        assert_eq!(KvPrecision::F16.positions_within(128 << 20, 512), 131_072);
    }
}
