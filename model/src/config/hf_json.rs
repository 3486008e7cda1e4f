//! Serialisation of a [`ModelConfig`] to the Hugging Face `config.json` layout of the real
//! checkpoint (top level + `text_config` + `vision_config`), the inverse of parsing, and the
//! backbone and DSpark keys V4's flat layout (`v4_json`) writes alike.

use serde_json::{Map, Value, json};

use super::{
    DsparkConfig, ModelConfig, ModelFamily, V41_ARCHITECTURE, V41_MODEL_TYPE, V41_TEXT_MODEL_TYPE,
    V41_VISION_MODEL_TYPE,
};
use crate::error::ModelError;

impl ModelConfig {
    /// Serialises to the Hugging Face `config.json` layout of the real checkpoint (V4.1: top level +
    /// `text_config` + `vision_config`; V4: the flat layout), the inverse of
    /// [`ModelConfig::from_json_str`].
    pub fn to_hf_json(&self) -> Result<Value, ModelError> {
        if self.family == ModelFamily::V4 {
            return match &self.v4 {
                Some(v4) => Ok(super::v4_json::to_json(self, v4)),
                None => Err(ModelError::Unsupported {
                    what: "writing a DeepSeek-V4 config without its V4 schedule".to_string(),
                }),
            };
        }
        let mut compress_ratios = self.compress_ratios.clone();
        compress_ratios.extend(std::iter::repeat_n(0, self.n_dspark_stages()));
        let mut fields = Map::new();
        let mut put = |key: &str, value: Value| {
            fields.insert(key.to_string(), value);
        };
        put("model_type", json!(V41_TEXT_MODEL_TYPE));
        for (key, value) in shared_text_keys(self) {
            put(key, value);
        }
        put("attention_bias", json!(false));
        put("attention_dropout", json!(0.0));
        put("initializer_range", json!(0.02));
        put("use_cache", json!(true));
        put("rope_theta", json!(self.rope.theta));
        put("rope_scaling", json!(self.rope.yarn.as_ref().map(|yarn| json!({ "rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "original_max_position_embeddings": yarn.original_max_position, }))));
        put("topk_method", json!("noaux_tc"));
        put("compress_ratios", json!(compress_ratios));
        put("compress_rope_theta", json!(self.rope.compress_theta));
        put("kv_source_layer_ids", json!(self.kv_source_layers));
        put("index_source_layer_ids", json!(self.index_source_layers));
        put("num_nextn_predict_layers", json!(self.n_dspark_stages()));
        if let Some(candidate) = &self.candidate {
            put("candidate_source_layer_id", json!(candidate.source_layer));
            put("candidate_topk_blocks", json!(candidate.topk_blocks));
            put("candidate_block_size", json!(candidate.block_size));
        }
        if let Some(engram) = &self.engram {
            put("engram_layer_ids", json!(engram.layer_ids));
            put("engram_num_embeddings", json!(engram.num_embeddings));
            put("engram_max_ngram_size", json!(engram.max_ngram_size));
            put("engram_vocab_size", json!(engram.vocab_size));
            put("engram_n_heads", json!(engram.n_heads));
            put("engram_head_dim", json!(engram.head_dim));
            put("engram_pad_token_id", json!(engram.pad_token_id));
            put(
                "engram_compressed_vocab_size",
                json!(engram.compressed_vocab_size),
            );
        }
        if let Some(dspark) = &self.dspark {
            for (key, value) in dspark_keys(dspark) {
                put(key, value);
            }
            put("dspark_n_routed_experts", json!(dspark.n_routed_experts));
            put(
                "dspark_num_experts_per_tok",
                json!(dspark.n_activated_experts),
            );
        }
        let mut root = json!({
            "architectures": [V41_ARCHITECTURE],
            "model_type": V41_MODEL_TYPE,
            "dtype": "bfloat16",
            "transformers_version": "5.6.0",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": self.quant.weight_block,
                "scale_fmt": "ue8m0",
                "expert_dtype": self.quant.expert_dtype.name(),
            },
            "text_config": Value::Object(fields),
        });
        if let Some(vision) = &self.vision {
            root.as_object_mut()
                .expect("invariant: the json! literal above is an object")
                .insert(
                    "vision_config".into(),
                    json!({
                        "model_type": V41_VISION_MODEL_TYPE,
                        "num_hidden_layers": vision.n_layers,
                        "hidden_size": vision.dim,
                        "num_attention_heads": vision.n_heads,
                        "intermediate_size": vision.inter_dim,
                        "patch_size": vision.patch_size,
                        "rope_theta": vision.rope_theta,
                        "downsample_ratio": vision.downsample_ratio,
                        "max_image_tokens": vision.max_image_tokens,
                        "min_pixels": vision.min_pixels,
                        "max_wh_ratio": vision.max_wh_ratio,
                    }),
                );
        }
        Ok(root)
    }
}

/// The text-backbone keys that V4.1's `text_config` and V4's flat layout spell and fill alike.
pub(super) fn shared_text_keys(cfg: &ModelConfig) -> [(&'static str, Value); 29] {
    [
        ("vocab_size", json!(cfg.vocab_size)),
        ("hidden_size", json!(cfg.dim)),
        ("num_hidden_layers", json!(cfg.n_layers)),
        ("num_attention_heads", json!(cfg.n_heads)),
        ("num_key_value_heads", json!(1)),
        ("head_dim", json!(cfg.head_dim)),
        ("qk_rope_head_dim", json!(cfg.rope_head_dim)),
        ("q_lora_rank", json!(cfg.q_lora_rank)),
        ("o_lora_rank", json!(cfg.o_lora_rank)),
        ("o_groups", json!(cfg.o_groups)),
        ("moe_intermediate_size", json!(cfg.moe_inter_dim)),
        ("n_routed_experts", json!(cfg.n_routed_experts)),
        ("n_shared_experts", json!(cfg.n_shared_experts)),
        ("num_experts_per_tok", json!(cfg.n_activated_experts)),
        ("scoring_func", json!("sqrtsoftplus")),
        ("norm_topk_prob", json!(true)),
        ("routed_scaling_factor", json!(cfg.route_scale)),
        ("swiglu_limit", json!(cfg.swiglu_limit)),
        ("hidden_act", json!("silu")),
        ("rms_norm_eps", json!(cfg.norm_eps)),
        ("sliding_window", json!(cfg.window_size)),
        (
            "max_position_embeddings",
            json!(cfg.max_position_embeddings),
        ),
        ("index_n_heads", json!(cfg.index_n_heads)),
        ("index_head_dim", json!(cfg.index_head_dim)),
        ("index_topk", json!(cfg.index_topk)),
        ("hc_mult", json!(cfg.hc.mult)),
        ("hc_sinkhorn_iters", json!(cfg.hc.sinkhorn_iters)),
        ("hc_eps", json!(cfg.hc.eps)),
        ("tie_word_embeddings", json!(false)),
    ]
}

/// The DSpark keys both families write alike (each writes the expert counts its own way).
pub(super) fn dspark_keys(dspark: &DsparkConfig) -> [(&'static str, Value); 4] {
    [
        ("dspark_block_size", json!(dspark.block_size)),
        ("dspark_noise_token_id", json!(dspark.noise_token_id)),
        ("dspark_target_layer_ids", json!(dspark.target_layers)),
        ("dspark_markov_rank", json!(dspark.markov_rank)),
    ]
}
