//! The CPU F32 path against Transformers on every fixture: prompt logits, router top-k of
//! every layer and position, per-layer residuals, and the 32-token greedy continuation.

mod common;

use common::parity::{check_greedy, check_prompt, session};
use common::{FIXTURES, Reference, fixture};
use picchio::model::{LogitRows, NoObserver};

#[test]
fn f32_prompt_matches_transformers() {
    check_prompt("tiny-f32");
}

#[test]
fn f32_greedy_matches_transformers() {
    check_greedy("tiny-f32");
}

#[test]
fn mxfp4_prompt_matches_transformers() {
    check_prompt("tiny-mxfp4");
}

#[test]
fn mxfp4_greedy_matches_transformers() {
    check_greedy("tiny-mxfp4");
}

#[test]
fn second_shape_matches_transformers() {
    for name in ["alt-f32", "alt-mxfp4"] {
        check_prompt(name);
        check_greedy(name);
    }
}

#[test]
fn yarn_table_matches_transformers() {
    for name in FIXTURES {
        let r = Reference::load(&fixture(name));
        let cfg = picchio::ModelConfig::from_dir(&fixture(name)).unwrap();
        let f = picchio::model::rope::RopeFrequencies::from_config(&cfg);
        assert_eq!(f.inv_freq.len(), r.inv_freq.len());
        for (i, (a, b)) in f.inv_freq.iter().zip(&r.inv_freq).enumerate() {
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * b.abs(), "{name}: inv_freq[{i}] {a} vs {b}");
        }
        assert_eq!(Some(f.attention_factor), r.attention_factor, "{name}: attention factor");
    }
}

/// Token-by-token decode through the cache gives bit-identical logits to one batched
/// prefill of the same positions, and to batches split at odd boundaries.
#[test]
fn kv_cache_decode_equals_full_recompute() {
    for name in ["tiny-f32", "alt-mxfp4"] {
        let r = Reference::load(&fixture(name));
        let mut ids = r.prompt.clone();
        ids.extend_from_slice(&r.greedy);
        let full = session(name, 256).feed(&ids, LogitRows::All, &mut NoObserver).unwrap();

        let mut step = session(name, 256);
        let mut stepped = Vec::new();
        for &id in &ids {
            stepped.extend(step.feed(&[id], LogitRows::All, &mut NoObserver).unwrap());
        }
        assert!(full == stepped, "{name}: decode through the KV cache differs from full recompute");

        let mut blocks = session(name, 7);
        let mut blocked = blocks.feed(&ids[..30], LogitRows::All, &mut NoObserver).unwrap();
        blocked.extend(blocks.feed(&ids[30..], LogitRows::All, &mut NoObserver).unwrap());
        assert!(full == blocked, "{name}: blocked prefill differs from full recompute");
    }
}
