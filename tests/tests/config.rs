//! `config.json` parsing and validation: the real DeepSeek-V4.1-Flash config (test data written from
//! the spec table, 3 311 bytes like the published file), the golden fixture's config, and bad
//! configs whose errors must name the file and the field. The V4 family: the real V4-Flash and
//! V4-Flash-0731 configs (test data written from v4-architecture.md §1.1, official flat layout),
//! the v4-tiny fixture's transformers-style config, and bad V4 configs.

use std::path::{Path, PathBuf};

use deepinfer_model::config::{
    ExpertDtype, ModelConfig, ModelFamily, V4Attention, V4Mlp, V4Qat, WeightStorage,
};
use deepinfer_model::error::ModelError;
use serde_json::{Value, json};

fn data_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
}

const REAL_CONFIG: &str = "deepseek-v4.1-flash.config.json";
fn v41_tiny_config() -> PathBuf {
    deepinfer_tests::fixture_file("v41/v41-tiny", "config.json")
}

fn real_json() -> Value {
    let text = std::fs::read_to_string(data_path(REAL_CONFIG)).expect("test data present");
    serde_json::from_str(&text).expect("test data is JSON")
}

/// Parses a modified copy of the real config and returns the error.
fn error_after(edit: impl FnOnce(&mut Value)) -> ModelError {
    let mut value = real_json();
    edit(&mut value);
    let origin = Path::new("/models/edited/config.json");
    ModelConfig::from_json_str(&value.to_string(), origin)
        .expect_err("edited config must be rejected")
}

/// Asserts a `Config` error on `field` whose message contains `needle` and whose display names the file.
fn assert_config_error(err: ModelError, field: &str, needle: &str) {
    let shown = err.to_string();
    match err {
        ModelError::Config {
            file,
            field: found_field,
            message,
        } => {
            assert_eq!(file, Path::new("/models/edited/config.json"));
            assert_eq!(found_field, field, "message: {message}");
            assert!(
                message.contains(needle),
                "message {message:?} lacks {needle:?}"
            );
            assert!(
                shown.contains("/models/edited/config.json") && shown.contains(field),
                "{shown}"
            );
        }
        other => panic!("expected a Config error on {field}, got {other:?}"),
    }
}

/// One edit of a config JSON document.
type Edit = Box<dyn FnOnce(&mut Value)>;

fn text_mut(value: &mut Value) -> &mut serde_json::Map<String, Value> {
    value["text_config"]
        .as_object_mut()
        .expect("text_config object")
}

#[test]
fn real_config_file_has_the_published_size_and_key_counts() {
    let bytes = std::fs::read(data_path(REAL_CONFIG)).expect("test data present");
    assert_eq!(bytes.len(), 3311);
    let value = real_json();
    assert_eq!(value["text_config"].as_object().map(|m| m.len()), Some(59));
    assert_eq!(
        value["vision_config"].as_object().map(|m| m.len()),
        Some(11)
    );
    assert_eq!(
        value["text_config"]["compress_ratios"]
            .as_array()
            .map(Vec::len),
        Some(43)
    );
}

#[test]
fn real_config_parses_with_every_field() {
    let cfg = ModelConfig::from_file(&data_path(REAL_CONFIG)).expect("real config parses");
    assert_eq!(cfg.family, ModelFamily::V41);
    assert_eq!(
        (
            cfg.vocab_size,
            cfg.dim,
            cfg.n_layers,
            cfg.n_heads,
            cfg.head_dim,
            cfg.rope_head_dim
        ),
        (129280, 5120, 40, 64, 512, 64)
    );
    assert_eq!(
        (cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups),
        (1280, 1024, 8)
    );
    assert_eq!(
        (
            cfg.moe_inter_dim,
            cfg.n_routed_experts,
            cfg.n_shared_experts,
            cfg.n_activated_experts
        ),
        (2304, 384, 1, 6)
    );
    assert_eq!(
        (cfg.route_scale, cfg.swiglu_limit, cfg.norm_eps),
        (1.5, 10.0, 1e-20)
    );
    assert_eq!(
        (cfg.window_size, cfg.max_position_embeddings),
        (128, 1_048_576)
    );
    assert_eq!(
        (cfg.rope.theta, cfg.rope.compress_theta),
        (10000.0, 160000.0)
    );
    let yarn = cfg.rope.yarn.as_ref().expect("yarn");
    assert_eq!(
        (
            yarn.factor,
            yarn.original_max_position,
            yarn.beta_fast,
            yarn.beta_slow
        ),
        (16.0, 65536, 32.0, 1.0)
    );
    let mut ratios = vec![0, 0];
    ratios.extend([2; 18]);
    ratios.extend([1; 20]);
    assert_eq!(
        cfg.compress_ratios, ratios,
        "40 entries: the 3 DSpark zeros are dropped"
    );
    assert_eq!(cfg.kv_source_layers, [2, 8, 14, 20]);
    assert_eq!(cfg.index_source_layers, [2, 8, 14, 20, 24, 28, 32, 36]);
    let candidate = cfg.candidate.as_ref().expect("candidate");
    assert_eq!(
        (
            candidate.source_layer,
            candidate.topk_blocks,
            candidate.block_size
        ),
        (20, 2048, 8)
    );
    assert_eq!(
        (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk),
        (32, 128, 512)
    );
    assert_eq!(
        (cfg.hc.mult, cfg.hc.sinkhorn_iters, cfg.hc.eps),
        (4, 20, 1e-6)
    );
    let engram = cfg.engram.as_ref().expect("engram");
    assert_eq!(engram.layer_ids, [1, 14]);
    assert_eq!(engram.num_embeddings, [384_006_168, 384_016_682]);
    assert_eq!(
        (
            engram.max_ngram_size,
            engram.vocab_size,
            engram.n_heads,
            engram.head_dim
        ),
        (4, 16_000_000, 8, 256)
    );
    assert_eq!(
        (engram.pad_token_id, engram.compressed_vocab_size),
        (2, 99092)
    );
    let dspark = cfg.dspark.as_ref().expect("dspark");
    assert_eq!(
        (dspark.n_stages, dspark.block_size, dspark.noise_token_id),
        (3, 5, 128799)
    );
    assert_eq!(dspark.target_layers, [37, 38, 39]);
    assert_eq!(
        (
            dspark.markov_rank,
            dspark.n_routed_experts,
            dspark.n_activated_experts
        ),
        (256, 128, 3)
    );
    assert_eq!(cfg.quant.weight_block, [32, 32]);
    assert_eq!(cfg.quant.expert_dtype, ExpertDtype::Fp4);
    assert_eq!((cfg.bos_token_id, cfg.eos_token_id), (0, 1));
    assert_eq!(
        (cfg.pad_token_id, cfg.image_token_id),
        (Some(2), Some(129264))
    );
    let vision = cfg.vision.as_ref().expect("vision");
    assert_eq!(
        (
            vision.n_layers,
            vision.dim,
            vision.n_heads,
            vision.inter_dim,
            vision.patch_size
        ),
        (32, 1024, 16, 2816, 14)
    );
    assert_eq!(
        (
            vision.downsample_ratio,
            vision.max_image_tokens,
            vision.min_pixels
        ),
        (3, 1024, 295_936)
    );
    assert_eq!((vision.rope_theta, vision.max_wh_ratio), (10000.0, None));
}

#[test]
fn real_config_layer_schedule_matches_spec_section_2() {
    let cfg = ModelConfig::from_file(&data_path(REAL_CONFIG)).expect("real config parses");
    assert_eq!(cfg.kv_source_of(5), Some(2));
    assert_eq!(cfg.index_source_of(26), Some(24));
    assert!(cfg.uses_candidates(28));
    // Every layer against the maps of spec §2.
    for layer in 0..40 {
        let kv = match layer {
            0 | 1 => None,
            2..=7 => Some(2),
            8..=13 => Some(8),
            14..=19 => Some(14),
            _ => Some(20),
        };
        let index = match layer {
            0 | 1 => None,
            2..=7 => Some(2),
            8..=13 => Some(8),
            14..=19 => Some(14),
            20..=23 => Some(20),
            _ => Some(layer / 4 * 4),
        };
        assert_eq!(cfg.kv_source_of(layer), kv, "kv source of layer {layer}");
        assert_eq!(
            cfg.index_source_of(layer),
            index,
            "index source of layer {layer}"
        );
        assert_eq!(
            cfg.uses_candidates(layer),
            [24, 28, 32, 36].contains(&layer),
            "candidates at layer {layer}"
        );
    }
    assert_eq!(
        cfg.kv_source_of(40),
        None,
        "DSpark ids are not backbone layers"
    );
    assert!(cfg.is_engram_layer(14) && !cfg.is_engram_layer(2));
    assert_eq!(cfg.n_dspark_stages(), 3);
}

#[test]
fn fixture_config_parses_and_equals_tiny_v41() {
    let cfg = ModelConfig::from_file(&v41_tiny_config()).expect("fixture config parses");
    assert_eq!(cfg, ModelConfig::tiny_v41());
    assert_eq!(cfg.kv_source_of(5), Some(4));
    assert_eq!(cfg.index_source_of(9), Some(8));
    assert!(cfg.uses_candidates(8) && cfg.uses_candidates(10) && !cfg.uses_candidates(6));
}

#[test]
fn narrow_v41_is_a_valid_tier_b_config() {
    let cfg = ModelConfig::narrow_v41();
    cfg.validate(Path::new("narrow_v41"))
        .expect("Tier B config validates");
    assert_eq!(
        (cfg.dim, cfg.head_dim, cfg.rope_head_dim, cfg.window_size),
        (1024, 512, 64, 128)
    );
    let engram = cfg.engram.as_ref().expect("engram");
    assert_eq!((engram.n_heads, engram.head_dim), (8, 256));
    // 24 distinct primes above 100 per table.
    assert!(engram.num_embeddings.iter().all(|&rows| rows > 24 * 100));
    assert_eq!(cfg.compress_ratios, ModelConfig::tiny_v41().compress_ratios);
}

#[test]
fn hf_json_round_trips_every_config() {
    for cfg in [
        ModelConfig::from_file(&data_path(REAL_CONFIG)).expect("real config parses"),
        ModelConfig::tiny_v41(),
        ModelConfig::narrow_v41(),
    ] {
        let json = cfg.to_hf_json().expect("serialises");
        let back = ModelConfig::from_json_str(&json.to_string(), Path::new("roundtrip.json"))
            .expect("serialised config parses");
        assert_eq!(back, cfg);
    }
    // The serialised real config has the published key sets.
    let json = ModelConfig::from_file(&data_path(REAL_CONFIG))
        .expect("parses")
        .to_hf_json()
        .expect("serialises");
    let original = real_json();
    let keys = |v: &Value, part: &str| {
        let mut keys: Vec<String> = v[part]
            .as_object()
            .expect("object")
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(keys(&json, "text_config"), keys(&original, "text_config"));
    assert_eq!(
        keys(&json, "vision_config"),
        keys(&original, "vision_config")
    );
}

#[test]
fn wrong_model_type_is_rejected_by_name() {
    let err = error_after(|v| v["model_type"] = json!("llama"));
    assert_config_error(err, "model_type", "unknown model type \"llama\"");
    let err = error_after(|v| v["text_config"]["model_type"] = json!("deepseek_v4_text"));
    assert_config_error(err, "text_config.model_type", "deepseek_v41_text");
    let err = error_after(|v| v["architectures"] = json!(["DeepseekV3ForCausalLM"]));
    assert_config_error(err, "architectures", "DeepseekV41ForCausalLM");
}

#[test]
fn v4_model_type_selects_the_flat_layout() {
    // The nested V4.1 document relabelled as deepseek_v4 is read as a flat V4 config, whose
    // top-level fields it lacks.
    let err = error_after(|v| v["model_type"] = json!("deepseek_v4"));
    assert_config_error(err, "hidden_act", "missing");
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    let err = error_after(|v| {
        text_mut(v).remove("hidden_size");
    });
    assert_config_error(err, "text_config.hidden_size", "missing");
    let err = error_after(|v| {
        v.as_object_mut()
            .expect("object")
            .remove("quantization_config");
    });
    assert_config_error(err, "quantization_config", "missing");
    let err = error_after(|v| v["text_config"]["num_attention_heads"] = json!("64"));
    assert_config_error(
        err,
        "text_config.num_attention_heads",
        "non-negative integer",
    );
    let err = error_after(|v| {
        v["text_config"]["rope_scaling"]
            .as_object_mut()
            .expect("obj")
            .clear()
    });
    assert_config_error(err, "text_config.rope_scaling.rope_type", "missing");
    let err = error_after(|v| v["text_config"]["dspark_markov_rank"] = json!(-1));
    assert_config_error(
        err,
        "text_config.dspark_markov_rank",
        "non-negative integer",
    );
}

#[test]
fn deepinfer_format_checks_are_enforced() {
    let cases: Vec<(Edit, &str, &str)> = vec![
        (
            Box::new(|v| v["dtype"] = json!("float16")),
            "dtype",
            "bfloat16",
        ),
        (
            Box::new(|v| v["quantization_config"]["weight_block_size"] = json!([128, 128])),
            "quantization_config.weight_block_size",
            "[32, 32]",
        ),
        (
            Box::new(|v| v["quantization_config"]["scale_fmt"] = json!("e4m3")),
            "quantization_config.scale_fmt",
            "ue8m0",
        ),
        (
            Box::new(|v| v["quantization_config"]["expert_dtype"] = json!("fp8")),
            "quantization_config.expert_dtype",
            "fp4",
        ),
        (
            Box::new(|v| v["quantization_config"]["activation_scheme"] = json!("static")),
            "quantization_config.activation_scheme",
            "dynamic",
        ),
        (
            Box::new(|v| v["text_config"]["hidden_act"] = json!("gelu")),
            "text_config.hidden_act",
            "silu",
        ),
        (
            Box::new(|v| v["text_config"]["attention_bias"] = json!(true)),
            "text_config.attention_bias",
            "expected false",
        ),
        (
            Box::new(|v| v["text_config"]["num_key_value_heads"] = json!(8)),
            "text_config.num_key_value_heads",
            "found 8",
        ),
        (
            Box::new(|v| v["text_config"]["attention_dropout"] = json!(0.1)),
            "text_config.attention_dropout",
            "0.1",
        ),
    ];
    for (edit, field, needle) in cases {
        assert_config_error(error_after(edit), field, needle);
    }
}

#[test]
fn inconsistent_layer_schedules_are_rejected() {
    // 44 ratios for 40 + 3 layers.
    let err = error_after(|v| {
        v["text_config"]["compress_ratios"]
            .as_array_mut()
            .expect("list")
            .push(json!(0))
    });
    assert_config_error(err, "text_config.compress_ratios", "43 entries, found 44");
    // A DSpark stage with a non-zero ratio.
    let err = error_after(|v| v["text_config"]["compress_ratios"][41] = json!(1));
    assert_config_error(err, "text_config.compress_ratios", "DSpark stage 1");
    // Layer 5 reads KV source 2 (ratio 2) but claims ratio 1.
    let err = error_after(|v| v["text_config"]["compress_ratios"][5] = json!(1));
    assert_config_error(
        err,
        "text_config.compress_ratios",
        "layer 5 has ratio 1 but its KV source 2 has ratio 2",
    );
    // A KV source with ratio 0.
    let err = error_after(|v| v["text_config"]["kv_source_layer_ids"] = json!([1, 2, 8, 14, 20]));
    assert_config_error(
        err,
        "text_config.kv_source_layer_ids",
        "layer 1 has compress ratio 0",
    );
    // Compressed layers before the first KV source.
    let err = error_after(|v| v["text_config"]["kv_source_layer_ids"] = json!([8, 14, 20]));
    assert_config_error(err, "text_config.kv_source_layer_ids", "compressed layer 2");
    // An index group that straddles a KV group: layer 8 would use layer 2's selection.
    let err = error_after(|v| {
        v["text_config"]["index_source_layer_ids"] = json!([2, 14, 20, 24, 28, 32, 36])
    });
    assert_config_error(
        err,
        "text_config.index_source_layer_ids",
        "compressed layer 8",
    );
    // Unsorted sources.
    let err = error_after(|v| v["text_config"]["kv_source_layer_ids"] = json!([2, 14, 8, 20]));
    assert_config_error(err, "text_config.kv_source_layer_ids", "strictly ascending");
    // Candidate source that is not a KV source.
    let err = error_after(|v| v["text_config"]["candidate_source_layer_id"] = json!(24));
    assert_config_error(err, "text_config.candidate_source_layer_id", "layer 24");
}

#[test]
fn dimension_and_group_constraints_are_enforced() {
    let err = error_after(|v| v["text_config"]["o_groups"] = json!(3));
    assert_config_error(err, "text_config.o_groups", "not divisible");
    let err = error_after(|v| v["text_config"]["hidden_size"] = json!(5000));
    assert_config_error(err, "text_config.hidden_size", "multiple of 32");
    let err = error_after(|v| v["text_config"]["moe_intermediate_size"] = json!(2300));
    assert_config_error(err, "text_config.moe_intermediate_size", "multiple of 32");
    let err = error_after(|v| v["text_config"]["qk_rope_head_dim"] = json!(63));
    assert_config_error(err, "text_config.qk_rope_head_dim", "even");
    let err = error_after(|v| v["text_config"]["num_experts_per_tok"] = json!(400));
    assert_config_error(err, "text_config.num_experts_per_tok", "found 400");
    let err = error_after(|v| v["text_config"]["engram_num_embeddings"] = json!([384006168]));
    assert_config_error(
        err,
        "text_config.engram_num_embeddings",
        "one table size per Engram layer (2), found 1",
    );
    let err =
        error_after(|v| v["text_config"]["engram_num_embeddings"] = json!([384006169, 384016682]));
    assert_config_error(
        err,
        "text_config.engram_num_embeddings",
        "[384006168, 384016682], found [384006169",
    );
    let err = error_after(|v| v["text_config"]["engram_vocab_size"] = json!(15000000));
    assert_config_error(
        err,
        "text_config.engram_num_embeddings",
        "engram_vocab_size 15000000",
    );
    let err = error_after(|v| v["text_config"]["engram_head_dim"] = json!(250));
    assert_config_error(err, "text_config.engram_head_dim", "multiple of 32");
    let err = error_after(|v| v["text_config"]["dspark_target_layer_ids"] = json!([37, 38, 40]));
    assert_config_error(
        err,
        "text_config.dspark_target_layer_ids",
        "layer 40 is out of range",
    );
    let err = error_after(|v| v["image_token_id"] = json!(200000));
    assert_config_error(err, "image_token_id", "outside the vocabulary");
}

#[test]
fn unreadable_inputs_name_the_file() {
    let err = ModelConfig::from_json_str("{ not json", Path::new("/x/config.json"))
        .expect_err("bad JSON");
    assert!(
        matches!(&err, ModelError::Config { field, .. } if field == "(document)"),
        "{err:?}"
    );
    assert!(err.to_string().contains("/x/config.json"));
    let missing = Path::new("/nonexistent/deepinfer/config.json");
    match ModelConfig::from_file(missing) {
        Err(ModelError::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("expected an Io error, got {other:?}"),
    }
}

#[test]
fn optional_parts_may_be_absent() {
    let mut value = real_json();
    value
        .as_object_mut()
        .expect("object")
        .remove("vision_config");
    value["image_token_id"] = Value::Null;
    let text = text_mut(&mut value);
    text.insert("num_nextn_predict_layers".into(), json!(0));
    let ratios: Vec<Value> = text["compress_ratios"].as_array().expect("list")[..40].to_vec();
    text.insert("compress_ratios".into(), Value::Array(ratios));
    text.insert("engram_layer_ids".into(), json!([]));
    for key in [
        "dspark_block_size",
        "dspark_noise_token_id",
        "engram_num_embeddings",
    ] {
        text.remove(key);
    }
    let cfg = ModelConfig::from_json_str(&value.to_string(), Path::new("text-only.json"))
        .expect("a text-only config without DSpark and Engram parses");
    assert_eq!(
        (
            cfg.dspark.is_none(),
            cfg.engram.is_none(),
            cfg.vision.is_none()
        ),
        (true, true, true)
    );
    assert_eq!(cfg.image_token_id, None);
    assert_eq!(cfg.compress_ratios.len(), 40);
}

const V4_FLASH_CONFIG: &str = "deepseek-v4-flash.config.json";
const V4_FLASH_0731_CONFIG: &str = "deepseek-v4-flash-0731.config.json";
fn v4_tiny_config() -> PathBuf {
    deepinfer_tests::fixture_file("v4/v4-tiny", "config.json")
}

fn json_of(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("test data present");
    serde_json::from_str(&text).expect("test data is JSON")
}

/// Parses an edited copy of a V4 config document and returns the error.
fn v4_error_after(path: &Path, edit: impl FnOnce(&mut Value)) -> ModelError {
    let mut value = json_of(path);
    edit(&mut value);
    ModelConfig::from_json_str(&value.to_string(), Path::new("/models/edited/config.json"))
        .expect_err("edited V4 config must be rejected")
}

#[test]
fn v4_flash_config_parses_with_derived_values() {
    let cfg = ModelConfig::from_file(&data_path(V4_FLASH_CONFIG)).expect("V4-Flash config parses");
    assert_eq!(cfg.family, ModelFamily::V4);
    assert_eq!(
        (
            cfg.vocab_size,
            cfg.dim,
            cfg.n_layers,
            cfg.n_heads,
            cfg.head_dim,
            cfg.rope_head_dim
        ),
        (129280, 4096, 43, 64, 512, 64)
    );
    assert_eq!(
        (cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups),
        (1024, 1024, 8)
    );
    assert_eq!(
        (
            cfg.moe_inter_dim,
            cfg.n_routed_experts,
            cfg.n_shared_experts,
            cfg.n_activated_experts
        ),
        (2048, 256, 1, 6)
    );
    assert_eq!(
        (cfg.route_scale, cfg.swiglu_limit, cfg.norm_eps),
        (1.5, 10.0, 1e-6)
    );
    assert_eq!(
        (cfg.window_size, cfg.max_position_embeddings),
        (128, 1_048_576)
    );
    assert_eq!(
        (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk),
        (64, 128, 512)
    );
    assert_eq!(
        (cfg.hc.mult, cfg.hc.sinkhorn_iters, cfg.hc.eps),
        (4, 20, 1e-6)
    );
    assert_eq!(
        (cfg.rope.theta, cfg.rope.compress_theta),
        (10000.0, 160000.0)
    );
    let yarn = cfg.rope.yarn.as_ref().expect("YaRN on the compress rope");
    assert_eq!(
        (
            yarn.factor,
            yarn.original_max_position,
            yarn.beta_fast,
            yarn.beta_slow
        ),
        (16.0, 65536, 32.0, 1.0)
    );
    assert_eq!(cfg.storage, WeightStorage::Quantized);
    assert_eq!(cfg.quant.weight_block, [128, 128]);
    assert_eq!(cfg.quant.expert_dtype, ExpertDtype::Fp4);
    assert_eq!(
        (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id),
        (0, 1, None)
    );

    // Schedule: 2 sliding, 21 CSA (even 2..=42), 20 HCA (odd 3..=41); the 44th list entry is MTP.
    let v4 = cfg.v4.as_ref().expect("V4 part");
    let count = |kind| v4.attention.iter().filter(|&&a| a == kind).count();
    assert_eq!(
        (
            count(V4Attention::Sliding),
            count(V4Attention::Csa),
            count(V4Attention::Hca)
        ),
        (2, 21, 20)
    );
    assert_eq!(cfg.compress_ratios.len(), 43);
    assert_eq!(&cfg.compress_ratios[..5], &[0, 0, 4, 128, 4]);
    assert_eq!(cfg.compress_ratios[42], 4);
    assert_eq!((v4.csa_ratio, v4.hca_ratio), (4, 128));
    assert_eq!(v4.n_hash_layers(), 3);
    assert_eq!(
        &v4.mlp[..4],
        &[
            V4Mlp::HashMoe,
            V4Mlp::HashMoe,
            V4Mlp::HashMoe,
            V4Mlp::TopkMoe
        ]
    );
    assert_eq!(v4.mtp_layers, 1);
    assert_eq!(cfg.n_mtp_layers(), 1);
    assert!(cfg.dspark.is_none());
    assert_eq!(v4.qat, V4Qat::OFFICIAL);
    assert_eq!(
        (
            v4.qat.kv_nope_fp8_group,
            v4.qat.index_fp4_group,
            v4.qat.act_fp8_group
        ),
        (64, 32, 128)
    );
    assert!(cfg.has_hc_head() && cfg.has_q_head_norm());
    // Every compressed layer is its own KV source; only CSA layers index.
    assert_eq!(cfg.kv_source_layers, (2..43).collect::<Vec<_>>());
    assert_eq!(
        cfg.index_source_layers,
        (2..43).step_by(2).collect::<Vec<_>>()
    );
    assert_eq!(
        (
            cfg.kv_source_of(1),
            cfg.kv_source_of(3),
            cfg.kv_source_of(42)
        ),
        (None, Some(3), Some(42))
    );
    assert_eq!(
        (cfg.index_source_of(3), cfg.index_source_of(4)),
        (None, Some(4))
    );
    assert_eq!(cfg.v4_attention(41), Some(V4Attention::Hca));
    assert_eq!(cfg.v4_mlp(2), Some(V4Mlp::HashMoe));
    assert!(!cfg.uses_candidates(4));
    // V4.1 configs say the opposite.
    let v41 = ModelConfig::from_file(&data_path(REAL_CONFIG)).expect("V4.1 parses");
    assert!(!v41.has_hc_head() && !v41.has_q_head_norm() && v41.v4.is_none());
    assert_eq!(v41.storage, WeightStorage::Quantized);
}

#[test]
fn v4_flash_0731_config_parses_with_the_dspark_drafter() {
    let flash = ModelConfig::from_file(&data_path(V4_FLASH_CONFIG)).expect("V4-Flash parses");
    let cfg = ModelConfig::from_file(&data_path(V4_FLASH_0731_CONFIG)).expect("0731 parses");
    let dspark = cfg.dspark.as_ref().expect("DSpark drafter");
    // Three stages from the three trailing compress_ratios entries, despite the raw
    // num_nextn_predict_layers = 1.
    assert_eq!(dspark.n_stages, 3);
    assert_eq!(cfg.n_dspark_stages(), 3);
    assert_eq!((dspark.block_size, dspark.noise_token_id), (5, 128799));
    assert_eq!(dspark.target_layers, vec![40, 41, 42]);
    assert_eq!(dspark.markov_rank, 256);
    assert_eq!(
        (dspark.n_routed_experts, dspark.n_activated_experts),
        (256, 6)
    );
    assert_eq!(cfg.n_mtp_layers(), 0);
    // Same backbone as V4-Flash.
    let backbone = |c: &ModelConfig| {
        let mut c = c.clone();
        c.dspark = None;
        if let Some(v4) = c.v4.as_mut() {
            v4.mtp_layers = 0;
        }
        c
    };
    assert_eq!(backbone(&cfg), backbone(&flash));
}

#[test]
fn v4_fixture_config_parses_and_equals_tiny_v4() {
    let cfg = ModelConfig::from_file(&v4_tiny_config()).expect("fixture config parses");
    assert_eq!(cfg, ModelConfig::tiny_v4());
    let v4 = cfg.v4.as_ref().expect("V4 part");
    assert_eq!((v4.csa_ratio, v4.hca_ratio), (4, 8));
    assert_eq!(cfg.compress_ratios, vec![0, 0, 4, 8, 4, 8]);
    assert_eq!(v4.n_hash_layers(), 3);
    assert_eq!(cfg.rope_head_dim, 16);
    assert_eq!(cfg.storage, WeightStorage::Float32);
    assert_eq!(
        cfg.rope.yarn.as_ref().map(|y| y.original_max_position),
        Some(4096)
    );
}

#[test]
fn v4_configs_round_trip_through_json() {
    for cfg in [
        ModelConfig::from_file(&data_path(V4_FLASH_CONFIG)).expect("parses"),
        ModelConfig::from_file(&data_path(V4_FLASH_0731_CONFIG)).expect("parses"),
        ModelConfig::tiny_v4(),
        ModelConfig::reduced_v4(),
        ModelConfig::reduced_v4_dspark(),
    ] {
        let json = cfg.to_hf_json().expect("serialises");
        let back = ModelConfig::from_json_str(&json.to_string(), Path::new("roundtrip.json"))
            .expect("serialised V4 config parses");
        assert_eq!(back, cfg);
    }
    let keys = |v: &Value| {
        let mut keys: Vec<String> = v.as_object().expect("object").keys().cloned().collect();
        keys.sort();
        keys
    };
    // The official configs serialise to their own key sets (legacy spelling) ...
    for name in [V4_FLASH_CONFIG, V4_FLASH_0731_CONFIG] {
        let json = ModelConfig::from_file(&data_path(name))
            .expect("parses")
            .to_hf_json()
            .expect("serialises");
        assert_eq!(keys(&json), keys(&json_of(&data_path(name))), "{name}");
    }
    // ... and the fixture's schedule (HCA rate 8) needs the transformers spelling.
    let json = ModelConfig::tiny_v4().to_hf_json().expect("serialises");
    let fixture = json_of(&v4_tiny_config());
    for key in keys(&json) {
        assert!(fixture.get(&key).is_some(), "{key} is not a fixture key");
    }
    assert_eq!(json["layer_types"], fixture["layer_types"]);
    assert_eq!(json["mlp_layer_types"], fixture["mlp_layer_types"]);
    assert_eq!(json["compress_rates"], fixture["compress_rates"]);
}

#[test]
fn transformers_and_legacy_spellings_give_the_same_config() {
    // The V4-Flash schedule written with the transformers keys parses to the same config.
    let mut value = json_of(&data_path(V4_FLASH_CONFIG));
    let object = value.as_object_mut().expect("object");
    let mut layer_types = vec!["sliding_attention"; 2];
    for _ in 0..20 {
        layer_types.push("compressed_sparse_attention");
        layer_types.push("heavily_compressed_attention");
    }
    layer_types.push("compressed_sparse_attention");
    object.insert("layer_types".into(), json!(layer_types));
    object.insert(
        "compress_rates".into(),
        json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}),
    );
    let mut mlp = vec!["hash_moe"; 3];
    mlp.extend(vec!["moe"; 40]);
    object.insert("mlp_layer_types".into(), json!(mlp));
    object.remove("compress_ratios");
    object.remove("num_hash_layers");
    object.remove("qk_rope_head_dim");
    object.insert("partial_rotary_factor".into(), json!(0.125));
    object.remove("rope_scaling");
    object.insert(
        "rope_parameters".into(),
        json!({
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
            "compress": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 160000.0,
                         "partial_rotary_factor": 0.125, "attention_factor": 1.0}
        }),
    );
    let transformers = ModelConfig::from_json_str(&value.to_string(), Path::new("hf.json"))
        .expect("transformers spelling parses");
    let legacy = ModelConfig::from_file(&data_path(V4_FLASH_CONFIG)).expect("parses");
    assert_eq!(transformers, legacy);
}

#[test]
fn bad_v4_configs_name_the_field() {
    let flash = data_path(V4_FLASH_CONFIG);
    let dspark = data_path(V4_FLASH_0731_CONFIG);
    let fixture = v4_tiny_config();
    let cases: Vec<(&Path, Edit, &str, &str)> = vec![
        (
            &flash,
            Box::new(|v| v["compress_ratios"][3] = json!(5)),
            "compress_ratios",
            "entry 3 is 5",
        ),
        (
            &flash,
            Box::new(|v| v["compress_ratios"][43] = json!(4)),
            "compress_ratios",
            "entry 43",
        ),
        (
            &flash,
            Box::new(|v| v["compress_ratios"] = json!([0, 0, 4])),
            "compress_ratios",
            "at least num_hidden_layers = 43",
        ),
        (
            &flash,
            Box::new(|v| v["num_nextn_predict_layers"] = json!(2)),
            "compress_ratios",
            "num_nextn_predict_layers is 2",
        ),
        (
            &flash,
            Box::new(|v| {
                v.as_object_mut().expect("object").remove("num_hash_layers");
            }),
            "num_hash_layers",
            "missing",
        ),
        (
            &flash,
            Box::new(|v| {
                v.as_object_mut().expect("object").remove("compress_ratios");
            }),
            "layer_types",
            "compress_ratios",
        ),
        (
            &flash,
            Box::new(|v| v["num_key_value_heads"] = json!(8)),
            "num_key_value_heads",
            "found 8",
        ),
        (
            &flash,
            Box::new(|v| v["hidden_act"] = json!("gelu")),
            "hidden_act",
            "silu",
        ),
        (
            &flash,
            Box::new(|v| v["scoring_func"] = json!("softmax")),
            "scoring_func",
            "sqrtsoftplus",
        ),
        (
            &flash,
            Box::new(|v| v["quantization_config"]["weight_block_size"] = json!([128, 64])),
            "quantization_config.weight_block_size",
            "[128, 64]",
        ),
        (
            &flash,
            Box::new(|v| v["quantization_config"]["fmt"] = json!("e5m2")),
            "quantization_config.fmt",
            "e4m3",
        ),
        (
            &flash,
            Box::new(|v| v["expert_dtype"] = json!("int4")),
            "expert_dtype",
            "int4",
        ),
        (
            &flash,
            Box::new(|v| v["rope_scaling"]["type"] = json!("linear")),
            "rope_scaling.type",
            "yarn",
        ),
        (
            &flash,
            Box::new(|v| v["hidden_size"] = json!(4004)),
            "hidden_size",
            "multiple of 32",
        ),
        (
            &flash,
            Box::new(|v| v["o_groups"] = json!(7)),
            "o_groups",
            "not divisible",
        ),
        (
            &flash,
            Box::new(|v| v["num_experts_per_tok"] = json!(300)),
            "num_experts_per_tok",
            "1..=256",
        ),
        (
            &flash,
            Box::new(|v| v["eos_token_id"] = json!(200000)),
            "eos_token_id",
            "outside the vocabulary",
        ),
        (
            &dspark,
            Box::new(|v| v["dspark_target_layer_ids"] = json!([40, 43])),
            "dspark_target_layer_ids",
            "layer 43 is out of range",
        ),
        (
            &dspark,
            Box::new(|v| v["dspark_block_size"] = json!(1)),
            "dspark_block_size",
            "at least 2",
        ),
        (
            &fixture,
            Box::new(|v| v["layer_types"][2] = json!("full_attention")),
            "layer_types",
            "entry 2",
        ),
        (
            &fixture,
            Box::new(|v| v["layer_types"] = json!(["sliding_attention"])),
            "layer_types",
            "one entry per backbone layer (6)",
        ),
        (
            &fixture,
            Box::new(|v| v["mlp_layer_types"][4] = json!("dense")),
            "mlp_layer_types",
            "entry 4",
        ),
        (
            &fixture,
            Box::new(|v| v["num_hash_layers"] = json!(2)),
            "num_hash_layers",
            "3",
        ),
        (
            &fixture,
            Box::new(|v| {
                v["compress_rates"]
                    .as_object_mut()
                    .expect("object")
                    .remove("heavily_compressed_attention");
            }),
            "compress_rates.heavily_compressed_attention",
            "missing",
        ),
        (
            &fixture,
            Box::new(|v| v["qk_rope_head_dim"] = json!(32)),
            "qk_rope_head_dim",
            "disagrees",
        ),
        (
            &fixture,
            Box::new(|v| v["rope_parameters"]["compress"]["attention_factor"] = json!(1.2773)),
            "rope_parameters.compress.attention_factor",
            "no YaRN mscale",
        ),
        (
            &fixture,
            Box::new(|v| v["rope_parameters"]["main"]["rope_type"] = json!("yarn")),
            "rope_parameters.main.rope_type",
            "default",
        ),
        (
            &fixture,
            Box::new(|v| v["rope_theta"] = json!(5000.0)),
            "rope_theta",
            "disagrees",
        ),
        (
            &fixture,
            Box::new(|v| v["dtype"] = json!("float16")),
            "dtype",
            "float16",
        ),
        (
            &fixture,
            Box::new(|v| v["compress_rates"]["heavily_compressed_attention"] = json!(0)),
            "compress_rates.heavily_compressed_attention",
            "at least 1",
        ),
    ];
    for (path, edit, field, needle) in cases {
        assert_config_error(v4_error_after(path, edit), field, needle);
    }
}
