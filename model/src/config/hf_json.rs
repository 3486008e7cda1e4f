//! Serialisation of a [`ModelConfig`] to the Hugging Face `config.json` layout of the real
//! checkpoint (top level + `text_config` + `vision_config`), the inverse of parsing.

use serde_json::{Map, Value, json};

use super::{
    ExpertDtype, ModelConfig, ModelFamily, V41_ARCHITECTURE, V41_MODEL_TYPE, V41_TEXT_MODEL_TYPE,
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
        fields.insert("model_type".into(), json!(V41_TEXT_MODEL_TYPE));
        fields.insert("vocab_size".into(), json!(self.vocab_size));
        fields.insert("hidden_size".into(), json!(self.dim));
        fields.insert("moe_intermediate_size".into(), json!(self.moe_inter_dim));
        fields.insert("num_hidden_layers".into(), json!(self.n_layers));
        fields.insert("num_attention_heads".into(), json!(self.n_heads));
        fields.insert("num_key_value_heads".into(), json!(1));
        fields.insert("head_dim".into(), json!(self.head_dim));
        fields.insert("qk_rope_head_dim".into(), json!(self.rope_head_dim));
        fields.insert("q_lora_rank".into(), json!(self.q_lora_rank));
        fields.insert("o_lora_rank".into(), json!(self.o_lora_rank));
        fields.insert("o_groups".into(), json!(self.o_groups));
        fields.insert("hidden_act".into(), json!("silu"));
        fields.insert("swiglu_limit".into(), json!(self.swiglu_limit));
        fields.insert("rms_norm_eps".into(), json!(self.norm_eps));
        fields.insert("attention_bias".into(), json!(false));
        fields.insert("attention_dropout".into(), json!(0.0));
        fields.insert("initializer_range".into(), json!(0.02));
        fields.insert("use_cache".into(), json!(true));
        fields.insert("tie_word_embeddings".into(), json!(false));
        fields.insert(
            "max_position_embeddings".into(),
            json!(self.max_position_embeddings),
        );
        fields.insert("rope_theta".into(), json!(self.rope.theta));
        fields.insert("rope_scaling".into(), json!(self.rope.yarn.as_ref().map(|yarn| json!({ "rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "original_max_position_embeddings": yarn.original_max_position, }))));
        fields.insert("n_routed_experts".into(), json!(self.n_routed_experts));
        fields.insert("n_shared_experts".into(), json!(self.n_shared_experts));
        fields.insert(
            "num_experts_per_tok".into(),
            json!(self.n_activated_experts),
        );
        fields.insert("scoring_func".into(), json!("sqrtsoftplus"));
        fields.insert("topk_method".into(), json!("noaux_tc"));
        fields.insert("norm_topk_prob".into(), json!(true));
        fields.insert("routed_scaling_factor".into(), json!(self.route_scale));
        fields.insert("sliding_window".into(), json!(self.window_size));
        fields.insert("compress_ratios".into(), json!(compress_ratios));
        fields.insert(
            "compress_rope_theta".into(),
            json!(self.rope.compress_theta),
        );
        fields.insert("kv_source_layer_ids".into(), json!(self.kv_source_layers));
        fields.insert(
            "index_source_layer_ids".into(),
            json!(self.index_source_layers),
        );
        fields.insert("index_n_heads".into(), json!(self.index_n_heads));
        fields.insert("index_head_dim".into(), json!(self.index_head_dim));
        fields.insert("index_topk".into(), json!(self.index_topk));
        fields.insert("hc_mult".into(), json!(self.hc.mult));
        fields.insert("hc_sinkhorn_iters".into(), json!(self.hc.sinkhorn_iters));
        fields.insert("hc_eps".into(), json!(self.hc.eps));
        fields.insert(
            "num_nextn_predict_layers".into(),
            json!(self.n_dspark_stages()),
        );
        if let Some(candidate) = &self.candidate {
            fields.insert(
                "candidate_source_layer_id".into(),
                json!(candidate.source_layer),
            );
            fields.insert("candidate_topk_blocks".into(), json!(candidate.topk_blocks));
            fields.insert("candidate_block_size".into(), json!(candidate.block_size));
        }
        if let Some(engram) = &self.engram {
            fields.insert("engram_layer_ids".into(), json!(engram.layer_ids));
            fields.insert("engram_num_embeddings".into(), json!(engram.num_embeddings));
            fields.insert("engram_max_ngram_size".into(), json!(engram.max_ngram_size));
            fields.insert("engram_vocab_size".into(), json!(engram.vocab_size));
            fields.insert("engram_n_heads".into(), json!(engram.n_heads));
            fields.insert("engram_head_dim".into(), json!(engram.head_dim));
            fields.insert("engram_pad_token_id".into(), json!(engram.pad_token_id));
            fields.insert(
                "engram_compressed_vocab_size".into(),
                json!(engram.compressed_vocab_size),
            );
        }
        if let Some(dspark) = &self.dspark {
            fields.insert("dspark_block_size".into(), json!(dspark.block_size));
            fields.insert("dspark_noise_token_id".into(), json!(dspark.noise_token_id));
            fields.insert(
                "dspark_target_layer_ids".into(),
                json!(dspark.target_layers),
            );
            fields.insert("dspark_markov_rank".into(), json!(dspark.markov_rank));
            fields.insert(
                "dspark_n_routed_experts".into(),
                json!(dspark.n_routed_experts),
            );
            fields.insert(
                "dspark_num_experts_per_tok".into(),
                json!(dspark.n_activated_experts),
            );
        }
        let expert_dtype = match self.quant.expert_dtype {
            ExpertDtype::Fp4 => "fp4",
            ExpertDtype::Fp8 => "fp8",
        };
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
                "expert_dtype": expert_dtype,
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
