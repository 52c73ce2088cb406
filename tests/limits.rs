//! Limits on user values: context sizes, thread counts, memory flags and config values that
//! would overflow or exhaust the machine give clean errors naming the flag or key (never a
//! panic or an abort), and non-finite logits are an error instead of a token.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use picchio::ModelConfig;
use picchio::engine::{self, Runner};
use picchio::experts::ExpertStats;
use picchio::model::forward::PhaseTimes;
use picchio::model::{LogitRows, Observer};
use picchio::sample::Sampler;
use picchio::session::Session;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("tiny-f32")
}

/// Runs `picchio generate` on `model` with `extra` flags (converted copies go to `cache`).
fn generate(model: &Path, cache: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["generate", "-q", "--ids", "1 2 3", "-n", "2", "-m"])
        .arg(model)
        .arg("--cache-dir")
        .arg(cache)
        .args(extra)
        .output()
        .expect("running picchio")
}

/// Asserts a clean error exit (status 1, no panic, no abort) whose stderr holds every
/// string of `expect`; returns stderr.
fn assert_clean_error(out: &Output, expect: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "expected exit status 1, got {:?}; stderr:\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "panicked:\n{stderr}");
    for e in expect {
        assert!(stderr.contains(e), "stderr does not mention `{e}`:\n{stderr}");
    }
    stderr
}

/// A copy of the tiny checkpoint whose config.json has `edit` applied.
fn edited_copy(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let copy = dir.join("model");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(tiny()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let path = copy.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    copy
}

fn tiny_config_text() -> String {
    std::fs::read_to_string(tiny().join("config.json")).unwrap()
}

fn parse(cfg: &serde_json::Value) -> picchio::Result<ModelConfig> {
    ModelConfig::from_json_str(&cfg.to_string(), Path::new("config.json"))
}

#[test]
fn huge_ctx_on_the_tiny_model_is_a_clean_error() {
    let tmp = tempfile::tempdir().unwrap();
    for ctx in ["4611686018427387904", "1099511627776"] {
        let out = generate(&tiny(), tmp.path(), &["--ctx", ctx]);
        assert_clean_error(&out, &[&format!("--ctx {ctx}"), "max_position_embeddings 131072"]);
    }
}

/// The rule: a config may declare up to 2^32 - 1 positions (refused beyond, naming the
/// key); a `--ctx` within that whose KV cache does not fit in memory is refused before
/// anything is allocated, naming --ctx, the bytes needed and the memory available.
#[test]
fn huge_ctx_on_a_model_that_allows_it_is_refused_for_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let model = edited_copy(tmp.path(), |c| c["max_position_embeddings"] = serde_json::json!(u32::MAX));
    let cache = tmp.path().join("cache");
    let out = generate(&model, &cache, &["--ctx", "4294967295", "--device", "cpu"]);
    assert_clean_error(&out, &["KV cache for --ctx 4294967295 needs", "GiB", "available"]);
    // Refused from config.json alone, before the checkpoint was converted.
    let converted = std::fs::read_dir(&cache).map_or(0, |d| d.count());
    assert_eq!(converted, 0, "the checkpoint was converted before --ctx was refused");
    // Without --device cpu the KV cache may live on a GPU; the host's RoPE tables alone
    // are too large here.
    let out = generate(&model, &cache, &["--ctx", "4294967295"]);
    assert_clean_error(&out, &["for --ctx 4294967295 need", "GiB", "available"]);
    let out = generate(&model, &cache, &["--ctx", "1099511627776"]);
    assert_clean_error(&out, &["--ctx 1099511627776", "max_position_embeddings 4294967295"]);
    let out = generate(&model, &cache, &["--ctx", "4611686018427387904"]);
    assert_clean_error(&out, &["--ctx 4611686018427387904", "max_position_embeddings"]);
    // A sensible context on the same model still works.
    let out = generate(&model, &cache, &["--ctx", "64"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_config_declaring_too_many_positions_is_refused_naming_the_key() {
    for n in [1u64 << 40, 1 << 62, u64::MAX] {
        let mut cfg: serde_json::Value = serde_json::from_str(&tiny_config_text()).unwrap();
        cfg["max_position_embeddings"] = serde_json::json!(n);
        let e = parse(&cfg).unwrap_err().to_string();
        assert!(e.contains("max_position_embeddings") && e.contains(&n.to_string()), "{e}");
    }
    // Through the binary too: the error names the file and the key.
    let tmp = tempfile::tempdir().unwrap();
    let model = edited_copy(tmp.path(), |c| c["max_position_embeddings"] = serde_json::json!(1u64 << 40));
    let out = generate(&model, &tmp.path().join("cache"), &[]);
    assert_clean_error(&out, &["config.json", "max_position_embeddings is 1099511627776"]);
}

#[test]
fn dimensions_whose_products_overflow_are_refused() {
    // Each within its own bound, but every expert of every layer in F32 exceeds 2^64 bytes.
    let mut cfg: serde_json::Value = serde_json::from_str(&tiny_config_text()).unwrap();
    cfg["hidden_size"] = serde_json::json!(1 << 17);
    cfg["intermediate_size"] = serde_json::json!(1 << 18);
    cfg["num_local_experts"] = serde_json::json!(1 << 14);
    cfg["num_hidden_layers"] = serde_json::json!(1 << 12);
    cfg["layer_types"] = serde_json::Value::Null;
    let e = parse(&cfg).unwrap_err().to_string();
    assert!(e.contains("num_local_experts") && e.contains("does not fit in 64 bits"), "{e}");
}

#[test]
fn thread_and_memory_flags_out_of_range_are_clean_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--io-threads", "3000"], "--io-threads 3000"),
        (&["--io-threads", "0"], "--io-threads 0"),
        (&["--io-threads", "18446744073709551615"], "--io-threads 18446744073709551615"),
        (&["--threads", "100000"], "--threads 100000"),
        (&["--threads", "0"], "--threads 0"),
        (&["--ram-gb=1e30"], "--ram-gb"),
        (&["--ram-gb=-1"], "--ram-gb"),
        (&["--ram-gb=NaN"], "--ram-gb"),
        (&["--prefill-block", "0"], "--prefill-block"),
        (&["--ctx", "0"], "--ctx"),
        (&["--top-p=NaN"], "top_p"),
        (&["--top-p=-0.5"], "top_p"),
        (&["--temperature=NaN"], "temperature"),
        (&["--temperature=-1"], "temperature"),
        (&["--repeat-penalty=inf"], "repetition_penalty"),
    ];
    for (flags, expect) in cases {
        let out = generate(&tiny(), tmp.path(), flags);
        assert_clean_error(&out, &[expect]);
    }
    // Huge but harmless values run: they are limits, not allocations.
    let out =
        generate(&tiny(), tmp.path(), &["--top-k", "18446744073709551615", "--seed", "18446744073709551615"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = generate(&tiny(), tmp.path(), &["--prefill-block", "18446744073709551615", "--ctx", "16"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn bench_lengths_that_overflow_are_a_clean_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["bench", "-q", "--prompt", "18446744073709551615", "--gen", "1", "-m"])
        .arg(tiny())
        .output()
        .expect("running picchio");
    assert_clean_error(&out, &["--prompt 18446744073709551615"]);
}

#[test]
fn rope_scaling_fields_of_the_wrong_kind_are_errors_naming_the_key() {
    let cases: &[(&str, serde_json::Value, &str)] = &[
        ("rope_type", serde_json::json!(5), "rope_scaling.rope_type is 5"),
        ("rope_type", serde_json::json!("linear"), "rope_type \"linear\" is not supported"),
        ("factor", serde_json::json!("32"), "rope_scaling.factor is \"32\""),
        ("factor", serde_json::json!(0.5), "rope_scaling.factor 0.5"),
        ("truncate", serde_json::json!("no"), "rope_scaling.truncate is \"no\""),
        ("attention_factor", serde_json::json!(0), "rope_scaling.attention_factor 0"),
        ("attention_factor", serde_json::json!(-1.5), "rope_scaling.attention_factor -1.5"),
        ("beta_fast", serde_json::json!(0), "rope_scaling.beta_fast 0"),
        ("beta_slow", serde_json::json!(-1), "rope_scaling.beta_slow -1"),
        (
            "original_max_position_embeddings",
            serde_json::json!(0),
            "rope_scaling.original_max_position_embeddings 0",
        ),
        ("original_max_position_embeddings", serde_json::json!([4096]), "expected a number"),
    ];
    for (key, value, expect) in cases {
        let mut cfg: serde_json::Value = serde_json::from_str(&tiny_config_text()).unwrap();
        cfg["rope_scaling"][key] = value.clone();
        let e = parse(&cfg).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(expect), "{key} = {value}: error `{e}` does not mention `{expect}`");
    }
    // A rope_scaling without a type is not silently plain RoPE.
    let mut cfg: serde_json::Value = serde_json::from_str(&tiny_config_text()).unwrap();
    cfg["rope_scaling"].as_object_mut().unwrap().remove("rope_type");
    assert!(parse(&cfg).unwrap_err().to_string().contains("rope_scaling has no rope_type"));
}

#[test]
fn other_config_values_outside_the_format_are_errors_naming_the_key() {
    let cases: &[(&str, serde_json::Value, &str)] = &[
        ("rms_norm_eps", serde_json::json!(1e-60), "rms_norm_eps is 1"),
        ("rms_norm_eps", serde_json::json!(1e300), "rms_norm_eps is 1"),
        ("rms_norm_eps", serde_json::json!(-1e-5), "rms_norm_eps"),
        ("swiglu_limit", serde_json::json!(1e300), "swiglu_limit is 1"),
        ("rope_theta", serde_json::json!(0.5), "rope_theta 0.5"),
        ("sliding_window", serde_json::json!(1u64 << 40), "sliding_window is 1099511627776"),
        ("num_key_value_heads", serde_json::json!(1 << 13), "num_key_value_heads is 8192"),
        (
            "quantization_config",
            serde_json::json!({"quant_method": 4}),
            "quantization_config.quant_method is 4",
        ),
        (
            "quantization_config",
            serde_json::json!({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", 7]}),
            "quantization_config.modules_to_not_convert[1] is 7",
        ),
        ("layer_types", serde_json::json!(["full_attention"]), "layer_types has 1 entries"),
    ];
    for (key, value, expect) in cases {
        let mut cfg: serde_json::Value = serde_json::from_str(&tiny_config_text()).unwrap();
        cfg[key] = value.clone();
        let e = parse(&cfg).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(expect), "{key} = {value}: error `{e}` does not mention `{expect}`");
    }
}

/// A runner whose logits are all `value` (NaN or infinity for the tests).
struct Constant {
    config: ModelConfig,
    value: f32,
}

impl Runner for Constant {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn capacity(&self) -> usize {
        32
    }

    fn describe(&self) -> String {
        "constant logits".into()
    }

    fn forward(
        &mut self,
        ids: &[u32],
        _start_pos: usize,
        rows: LogitRows,
        _observer: &mut dyn Observer,
    ) -> picchio::Result<Vec<f32>> {
        let n = match rows {
            LogitRows::Last => 1,
            LogitRows::All => ids.len(),
            LogitRows::None => 0,
        };
        let mut logits = vec![0.0; n * self.config.vocab_size];
        if let Some(v) = logits.get_mut(3) {
            *v = self.value;
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

fn constant_session(value: f32) -> Session {
    let config = ModelConfig::from_dir(&tiny()).unwrap();
    Session::new(Box::new(Constant { config, value }))
}

#[test]
fn non_finite_logits_are_an_error_not_a_token() {
    for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut s = constant_session(value);
        let mut emitted = Vec::new();
        let e = s
            .generate(&[1, 2, 3], 4, &mut Sampler::greedy(), &[], &mut |t| {
                emitted.push(t.token);
                true
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("non-finite logits at position 2"), "{e}");
        assert!(e.contains("picchio verify"), "{e}");
        assert!(emitted.is_empty(), "tokens were emitted from non-finite logits: {emitted:?}");
        // The cache still matches the history: the prompt was consumed, nothing else.
        assert_eq!(s.tokens(), &[1, 2, 3]);
    }
}

#[test]
fn fits_check_does_not_overflow() {
    let mut s = constant_session(0.0);
    s.feed(&[1], LogitRows::None, &mut picchio::model::NoObserver).unwrap();
    let e = s.check_fits(1, usize::MAX).unwrap_err();
    assert!(matches!(e, picchio::Error::ContextFull { .. }), "{e}");
    assert!(s.check_fits(1, 31).is_ok());
    assert!(s.check_fits(1, 32).is_err());
}

/// Writes NaN into the first value of tensor `name` of a safetensors file.
fn poison_tensor(file: &Path, name: &str) {
    let mut bytes = std::fs::read(file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize + 8 + header_len;
    bytes[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_checkpoint_with_nan_weights_fails_generation_with_a_clear_message() {
    let tmp = tempfile::tempdir().unwrap();
    let model = edited_copy(tmp.path(), |_| {});
    poison_tensor(&model.join("model.safetensors"), "model.norm.weight");
    // The direct Hugging Face path; loading may itself refuse the non-finite weight.
    let result = engine::load_hf(&model).and_then(|m| {
        let runner = engine::cpu_runner(&m, &engine::RunOptions { ctx: 32, ..Default::default() })?;
        Session::new(runner).generate(&[1, 2, 3], 4, &mut Sampler::greedy(), &[], &mut |_| true)
    });
    let e = result.expect_err("NaN weights produce tokens").to_string();
    assert!(e.contains("non-finite") || e.contains("NaN"), "{e}");
}

#[test]
fn a_huge_layer_count_without_layer_types_is_refused_without_allocating() {
    let mut cfg: serde_json::Value = serde_json::from_str(&tiny_config_text()).unwrap();
    cfg.as_object_mut().unwrap().remove("layer_types");
    cfg["num_hidden_layers"] = serde_json::json!(u64::MAX);
    let e = parse(&cfg).unwrap_err().to_string();
    assert!(e.contains("num_hidden_layers is 18446744073709551615"), "{e}");
}

#[test]
fn generate_on_a_checkpoint_with_nan_weights_exits_with_a_clear_message() {
    let tmp = tempfile::tempdir().unwrap();
    let model = edited_copy(tmp.path(), |_| {});
    poison_tensor(&model.join("model.safetensors"), "model.norm.weight");
    // Whether conversion refuses the weight or the sampler refuses the logits, the run ends
    // with a clean error that says what is non-finite, and no token on stdout.
    let out = generate(&model, &tmp.path().join("cache"), &[]);
    let stderr = assert_clean_error(&out, &[]);
    assert!(stderr.contains("non-finite") || stderr.contains("NaN"), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty(), "tokens were printed");
}
