//! Serialisation of a V4 [`ModelConfig`] to a flat `config.json`, the inverse of `v4::parse_v4`:
//! the official spelling (legacy `compress_ratios` with MTP/DSpark entries, `num_hash_layers`,
//! `rope_scaling`, `quantization_config` + top-level `expert_dtype`) whenever the schedule fits it
//! (rates 4/128, hash layers first), else the transformers spelling (`layer_types`,
//! `compress_rates`, `mlp_layer_types`, `rope_parameters`).

use serde_json::{Map, Value, json};

use super::hf_json::{dspark_keys, shared_text_keys};
use super::v4::{ATTENTION_TYPES, LEGACY_CSA_RATIO, LEGACY_HCA_RATIO, MLP_TYPES};
use super::{
    COMPRESSED_SPARSE_ATTENTION, HEAVILY_COMPRESSED_ATTENTION, ModelConfig, V4_MODEL_TYPE,
    V4Config, V4Mlp, WeightStorage,
};

const V4_ARCHITECTURE: &str = "DeepseekV4ForCausalLM";

/// The spelling in `names` of each of `kinds` (every kind has one).
fn type_names<T: PartialEq>(kinds: &[T], names: &[(&'static str, T)]) -> Vec<&'static str> {
    let name = |kind: &T| names.iter().find(|(_, k)| k == kind).map(|&(name, _)| name);
    kinds.iter().filter_map(name).collect()
}

/// Whether `v4`'s schedule can be written with the legacy keys.
fn fits_legacy(v4: &V4Config) -> bool {
    let hash = v4.n_hash_layers();
    v4.csa_ratio == LEGACY_CSA_RATIO
        && v4.hca_ratio == LEGACY_HCA_RATIO
        && v4.mlp[..hash].iter().all(|&mlp| mlp == V4Mlp::HashMoe)
}

/// The flat V4 `config.json` of `cfg` (family V4 with `v4` set).
pub(super) fn to_json(cfg: &ModelConfig, v4: &V4Config) -> Value {
    let mut fields = Map::new();
    let mut put = |key: &str, value: Value| {
        fields.insert(key.to_string(), value);
    };
    put("architectures", json!([V4_ARCHITECTURE]));
    put("model_type", json!(V4_MODEL_TYPE));
    for (key, value) in shared_text_keys(cfg) {
        put(key, value);
    }
    put("bos_token_id", json!(cfg.bos_token_id));
    put("eos_token_id", json!(cfg.eos_token_id));
    if let Some(pad) = cfg.pad_token_id {
        put("pad_token_id", json!(pad));
    }
    let yarn = cfg.rope.yarn.as_ref();
    let speculative = cfg.n_mtp_layers() + cfg.n_dspark_stages();
    if fits_legacy(v4) {
        let mut ratios = cfg.compress_ratios.clone();
        ratios.extend(std::iter::repeat_n(0, speculative));
        put("compress_ratios", json!(ratios));
        put("num_hash_layers", json!(v4.n_hash_layers()));
        put("topk_method", json!("noaux_tc"));
        put("rope_theta", json!(cfg.rope.theta));
        put("compress_rope_theta", json!(cfg.rope.compress_theta));
        put(
            "rope_scaling",
            json!(yarn.map(|yarn| json!({
                "type": "yarn",
                "factor": yarn.factor,
                "original_max_position_embeddings": yarn.original_max_position,
                "beta_fast": yarn.beta_fast,
                "beta_slow": yarn.beta_slow,
            }))),
        );
        // 0731 keeps the raw value 1 while its list describes the 3 DSpark stages.
        put(
            "num_nextn_predict_layers",
            json!(if cfg.dspark.is_some() { 1 } else { speculative }),
        );
    } else {
        let layer_types = type_names(&v4.attention, &ATTENTION_TYPES);
        let mlp_types = type_names(&v4.mlp, &MLP_TYPES);
        put("layer_types", json!(layer_types));
        put(
            "compress_rates",
            json!({
                COMPRESSED_SPARSE_ATTENTION: v4.csa_ratio,
                HEAVILY_COMPRESSED_ATTENTION: v4.hca_ratio,
            }),
        );
        put("mlp_layer_types", json!(mlp_types));
        let partial = cfg.rope_head_dim as f64 / cfg.head_dim as f64;
        put("partial_rotary_factor", json!(partial));
        let compress = match yarn {
            Some(yarn) => json!({
                "rope_type": "yarn",
                "attention_factor": 1.0,
                "factor": yarn.factor,
                "original_max_position_embeddings": yarn.original_max_position,
                "beta_fast": yarn.beta_fast,
                "beta_slow": yarn.beta_slow,
                "rope_theta": cfg.rope.compress_theta,
                "partial_rotary_factor": partial,
            }),
            None => json!({
                "rope_type": "default",
                "rope_theta": cfg.rope.compress_theta,
                "partial_rotary_factor": partial,
            }),
        };
        put(
            "rope_parameters",
            json!({
                "main": {
                    "rope_type": "default",
                    "rope_theta": cfg.rope.theta,
                    "partial_rotary_factor": partial,
                },
                "compress": compress,
            }),
        );
        put("num_nextn_predict_layers", json!(speculative));
    }
    if let Some(dspark) = &cfg.dspark {
        for (key, value) in dspark_keys(dspark) {
            put(key, value);
        }
        if dspark.n_routed_experts != cfg.n_routed_experts {
            put("dspark_n_routed_experts", json!(dspark.n_routed_experts));
        }
        if dspark.n_activated_experts != cfg.n_activated_experts {
            put(
                "dspark_num_experts_per_tok",
                json!(dspark.n_activated_experts),
            );
        }
    }
    match cfg.storage {
        WeightStorage::Quantized => {
            put("torch_dtype", json!("bfloat16"));
            put(
                "quantization_config",
                json!({
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "scale_fmt": "ue8m0",
                    "activation_scheme": "dynamic",
                    "weight_block_size": cfg.quant.weight_block,
                }),
            );
            put("expert_dtype", json!(cfg.quant.expert_dtype.name()));
        }
        WeightStorage::Float32 => put("dtype", json!("float32")),
        WeightStorage::Bfloat16 => put("dtype", json!("bfloat16")),
    }
    Value::Object(fields)
}
