//! Fuzzing the config parser: arbitrary JSON, and the fixture configs with values replaced
//! by huge, negative, zero, fractional, string, null or nested values and keys removed.
//! Every case gives either a clean error naming a key, or a config whose derived sizes
//! are all computable without overflow (checked here independently) and whose RoPE
//! frequencies are finite. Never a panic.

use std::path::Path;

use picchio::ModelConfig;
use picchio::model::rope::RopeFrequencies;
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// Every key the parser reads, top level and nested; an error must name one of them.
const KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "layer_types",
    "sliding_window",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "swiglu_limit",
    "max_position_embeddings",
    "quantization_config",
    "tie_word_embeddings",
    // Qwen3-MoE.
    "moe_intermediate_size",
    "num_experts",
    "norm_topk_prob",
    "mlp_only_layers",
    "decoder_sparse_step",
    "attention_bias",
    "use_sliding_window",
];

const NESTED: &[(&str, &str)] = &[
    ("rope_scaling", "rope_type"),
    ("rope_scaling", "factor"),
    ("rope_scaling", "beta_fast"),
    ("rope_scaling", "beta_slow"),
    ("rope_scaling", "original_max_position_embeddings"),
    ("rope_scaling", "truncate"),
    ("rope_scaling", "attention_factor"),
    ("quantization_config", "quant_method"),
    ("quantization_config", "modules_to_not_convert"),
];

/// The fixtures' config.json files, read once.
fn fixture_configs() -> &'static [Value] {
    static CONFIGS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    CONFIGS.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
        [
            "tiny-f32",
            "tiny-mxfp4",
            "alt-f32",
            "alt-mxfp4",
            "qwen3-tiny-f32",
            "qwen3-tiny-bf16",
            "qwen3-alt-f32",
        ]
        .iter()
        .map(|d| {
            let text = std::fs::read_to_string(root.join(d).join("config.json")).unwrap();
            serde_json::from_str(&text).unwrap()
        })
        .collect()
    })
}

/// Values chosen to hit the edges: huge, negative, zero, fractional, strings, null, nested.
fn nasty_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(2)),
        Just(json!(-1)),
        Just(json!(i64::MIN)),
        Just(json!(u64::MAX)),
        Just(json!(1u64 << 62)),
        Just(json!(1u64 << 40)),
        Just(json!(1u64 << 32)),
        Just(json!(u32::MAX)),
        Just(json!(1u64 << 24)),
        Just(json!(1u64 << 17)),
        Just(json!(0.5)),
        Just(json!(1e-60)),
        Just(json!(1e300)),
        Just(json!(-1e300)),
        Just(json!(f64::MIN_POSITIVE)),
        Just(json!("32")),
        Just(json!("yarn")),
        Just(json!("")),
        Just(Value::Null),
        Just(json!(true)),
        Just(json!([])),
        Just(json!([1, 2])),
        Just(json!(["sliding_attention"])),
        Just(json!({})),
        Just(json!({"rope_type": "yarn"})),
        any::<u64>().prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        (0u64..5000).prop_map(|n| json!(n)),
        any::<f64>().prop_filter("JSON numbers are finite", |f| f.is_finite()).prop_map(|f| json!(f)),
    ]
}

/// One edit of a config: replace or remove a top-level or nested key.
#[derive(Clone, Debug)]
enum Mutation {
    Set(usize, Value),
    Remove(usize),
    SetNested(usize, Value),
    RemoveNested(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (0..KEYS.len(), nasty_value()).prop_map(|(k, v)| Mutation::Set(k, v)),
        1 => (0..KEYS.len()).prop_map(Mutation::Remove),
        2 => (0..NESTED.len(), nasty_value()).prop_map(|(k, v)| Mutation::SetNested(k, v)),
        1 => (0..NESTED.len()).prop_map(Mutation::RemoveNested),
    ]
}

fn apply(cfg: &mut Value, m: &Mutation) {
    let Some(obj) = cfg.as_object_mut() else { return };
    match m {
        Mutation::Set(k, v) => {
            obj.insert(KEYS[*k].to_string(), v.clone());
        }
        Mutation::Remove(k) => {
            obj.remove(KEYS[*k]);
        }
        Mutation::SetNested(k, v) => {
            let (outer, inner) = NESTED[*k];
            if let Some(Value::Object(o)) = obj.get_mut(outer) {
                o.insert(inner.to_string(), v.clone());
            } else {
                let mut o = Map::new();
                o.insert(inner.to_string(), v.clone());
                obj.insert(outer.to_string(), Value::Object(o));
            }
        }
        Mutation::RemoveNested(k) => {
            let (outer, inner) = NESTED[*k];
            if let Some(Value::Object(o)) = obj.get_mut(outer) {
                o.remove(inner);
            }
        }
    }
}

fn checked(factors: &[u64]) -> Option<u64> {
    factors.iter().try_fold(1u64, |acc, &f| acc.checked_mul(f))
}

/// The sizes the engine derives, recomputed here with checked arithmetic: all must exist
/// and agree with `derived_sizes`; every layer's attention kind must be readable; the RoPE
/// frequencies must be finite.
fn assert_usable(c: &ModelConfig) {
    let n = |v: usize| v as u64;
    let sizes = c.derived_sizes().expect("a parsed config has computable sizes");
    let kv_dim = checked(&[n(c.num_kv_heads), n(c.head_dim)]).expect("kv_dim");
    assert_eq!(sizes.kv_dim as u64, kv_dim);
    assert_eq!(sizes.q_dim as u64, checked(&[n(c.num_heads), n(c.head_dim)]).expect("q_dim"));
    assert_eq!(c.kv_dim() as u64, kv_dim);
    let per_pos = checked(&[2, n(c.num_layers), kv_dim, 4]).expect("KV bytes per position");
    assert_eq!(sizes.kv_bytes_per_position, per_pos);
    assert_eq!(sizes.kv_bytes_max, checked(&[per_pos, n(c.max_position_embeddings)]).expect("KV at max"));
    assert_eq!(c.kv_bytes(c.max_position_embeddings), Some(sizes.kv_bytes_max));
    assert!(c.rope_table_bytes(c.max_position_embeddings).is_some());
    assert_eq!(sizes.embedding_bytes, checked(&[n(c.vocab_size), n(c.hidden_size), 4]).expect("embedding"));
    let expert = checked(&[3, n(c.intermediate_size), n(c.hidden_size)])
        .and_then(|w| w.checked_add(2 * n(c.intermediate_size) + n(c.hidden_size)))
        .and_then(|v| v.checked_mul(4))
        .expect("expert bytes");
    assert_eq!(sizes.expert_bytes_f32, expert);
    assert!(checked(&[expert, n(c.num_experts), n(c.num_layers)]).is_some(), "all experts");
    assert!(c.experts_per_token >= 1 && c.experts_per_token <= c.num_experts);
    assert!(c.num_heads.is_multiple_of(c.num_kv_heads));
    assert_eq!(c.layer_types.len(), c.num_layers);
    assert_eq!(c.mlp_kinds.len(), c.num_layers);
    assert!(checked(&[3, n(c.dense_intermediate_size), n(c.hidden_size), 4]).is_some(), "dense MLP bytes");
    for l in 0..c.num_layers {
        let _ = (c.attention(l), c.window(l));
    }
    let rope = RopeFrequencies::from_config(c);
    assert!(rope.inv_freq.iter().all(|f| f.is_finite()), "inv_freq {:?}", rope.inv_freq);
    assert!(rope.attention_factor.is_finite() && rope.attention_factor > 0.0);
    assert!(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0);
    assert!(c.swiglu_limit.is_finite() && c.swiglu_limit > 0.0);
}

fn check(text: &str) -> Result<(), TestCaseError> {
    match ModelConfig::from_json_str(text, Path::new("fuzz/config.json")) {
        Ok(c) => assert_usable(&c),
        Err(e) => {
            let msg = e.to_string();
            prop_assert!(msg.contains("fuzz/config.json"), "error does not name the file: {}", msg);
            let named = KEYS.iter().chain(NESTED.iter().map(|(_, k)| k)).any(|k| msg.contains(k));
            let not_an_object = msg.contains("not valid JSON") || msg.contains("expected a JSON object");
            prop_assert!(named || not_an_object, "error names no key: {}", msg);
        }
    }
    Ok(())
}

fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| json!(f)),
        "[a-z_]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS.to_vec()), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_fixture_configs_parse_or_fail_cleanly(
        which in 0usize..4,
        mutations in prop::collection::vec(mutation(), 1..5),
    ) {
        let mut cfg = fixture_configs()[which].clone();
        for m in &mutations {
            apply(&mut cfg, m);
        }
        check(&cfg.to_string())?;
    }

    #[test]
    fn arbitrary_json_parses_or_fails_cleanly(value in arbitrary_json()) {
        check(&value.to_string())?;
    }

    #[test]
    fn arbitrary_text_fails_cleanly(text in "\\PC{0,64}") {
        check(&text)?;
    }
}

#[test]
fn every_fixture_config_parses() {
    for cfg in fixture_configs().iter() {
        check(&cfg.to_string()).unwrap();
    }
}
