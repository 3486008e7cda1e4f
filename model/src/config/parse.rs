//! Parsing of the nested V4.1 layout (top level, `quantization_config`, `text_config`,
//! `vision_config`) into a [`ModelConfig`], with DeepInfer's fixed-value checks (dtype, activation,
//! bias, KV heads, router and quantisation scheme) at the field where they are read; and what both
//! families' parsers read alike ([`parse_dspark`], the YaRN and mHC keys).

use serde_json::Value;

use super::fields::Fields;
use super::{
    CandidateConfig, DsparkConfig, EngramConfig, ExpertDtype, FamilyFields, HcConfig, ModelConfig,
    ModelFamily, QuantConfig, RopeConfig, V41_ARCHITECTURE, V41_TEXT_MODEL_TYPE,
    V41_VISION_MODEL_TYPE, VisionConfig, WeightStorage, YarnConfig,
};
use crate::error::ModelError;

/// Parses the nested V4.1 layout (top level already known to say `deepseek_v41`).
pub(crate) fn parse_v41(top: &Fields<'_>) -> Result<ModelConfig, ModelError> {
    let file = top.file;
    let architectures = top.value("architectures")?;
    let names: Vec<&str> = architectures
        .as_array()
        .map(|list| list.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !names.contains(&V41_ARCHITECTURE) {
        return Err(top.error(
            "architectures",
            format!("expected [\"{V41_ARCHITECTURE}\"], found {architectures}"),
        ));
    }
    top.expect_str("dtype", "bfloat16")?;

    let quant_fields = Fields::new(
        top.value("quantization_config")?,
        "quantization_config.",
        file,
    )?;
    let quant = parse_quant(&quant_fields)?;

    let text = Fields::new(top.value("text_config")?, "text_config.", file)?;
    text.expect_str("model_type", V41_TEXT_MODEL_TYPE)?;
    text.expect_str("hidden_act", "silu")?;
    text.expect_bool("attention_bias", false)?;
    let dropout = text.f64("attention_dropout")?;
    if dropout != 0.0 {
        return Err(text.error(
            "attention_dropout",
            format!("expected 0.0, found {dropout}"),
        ));
    }
    let kv_heads = text.usize("num_key_value_heads")?;
    if kv_heads != 1 {
        return Err(text.error(
            "num_key_value_heads",
            format!("expected 1 (one shared K=V latent), found {kv_heads}"),
        ));
    }
    text.expect_bool("tie_word_embeddings", false)?;
    text.expect_str("scoring_func", "sqrtsoftplus")?;
    text.expect_str("topk_method", "noaux_tc")?;
    text.expect_bool("norm_topk_prob", true)?;

    let n_layers = text.usize("num_hidden_layers")?;
    let n_stages = text.usize("num_nextn_predict_layers")?;
    let all_ratios = text.usize_list("compress_ratios")?;
    if all_ratios.len() != n_layers + n_stages {
        return Err(text.error(
            "compress_ratios",
            format!(
                "expected num_hidden_layers + num_nextn_predict_layers = {n_layers} + {n_stages} = {} \
                 entries, found {}",
                n_layers + n_stages,
                all_ratios.len()
            ),
        ));
    }
    speculative_ratios_are_zero(&text, &all_ratios, n_layers, "DSpark stage")?;
    let compress_ratios = all_ratios[..n_layers].to_vec();

    let rope = RopeConfig {
        theta: text.f64("rope_theta")?,
        compress_theta: text.f64("compress_rope_theta")?,
        yarn: match text.optional("rope_scaling") {
            None => None,
            Some(value) => Some(parse_yarn(&Fields::new(
                value,
                "text_config.rope_scaling.",
                file,
            )?)?),
        },
    };

    let candidate = match text.optional("candidate_source_layer_id") {
        None => None,
        Some(_) => Some(CandidateConfig {
            source_layer: text.usize("candidate_source_layer_id")?,
            topk_blocks: text.usize("candidate_topk_blocks")?,
            block_size: text.usize("candidate_block_size")?,
        }),
    };

    let engram_layers = match text.optional("engram_layer_ids") {
        None => Vec::new(),
        Some(_) => text.usize_list("engram_layer_ids")?,
    };
    let engram = if engram_layers.is_empty() {
        None
    } else {
        Some(EngramConfig {
            layer_ids: engram_layers,
            num_embeddings: text.usize_list("engram_num_embeddings")?,
            max_ngram_size: text.usize("engram_max_ngram_size")?,
            vocab_size: text.usize("engram_vocab_size")?,
            n_heads: text.usize("engram_n_heads")?,
            head_dim: text.usize("engram_head_dim")?,
            pad_token_id: text.u32("engram_pad_token_id")?,
            compressed_vocab_size: text.usize("engram_compressed_vocab_size")?,
        })
    };

    let dspark = if n_stages == 0 {
        None
    } else {
        Some(parse_dspark(&text, n_stages, || {
            Ok((
                text.usize("dspark_n_routed_experts")?,
                text.usize("dspark_num_experts_per_tok")?,
            ))
        })?)
    };

    let vision = match top.optional("vision_config") {
        None => None,
        Some(value) => Some(parse_vision(&Fields::new(value, "vision_config.", file)?)?),
    };

    let family = FamilyFields {
        family: ModelFamily::V41,
        n_layers,
        head_dim: text.usize("head_dim")?,
        rope_head_dim: text.usize("qk_rope_head_dim")?,
        rope,
        compress_ratios,
        kv_source_layers: text.usize_list("kv_source_layer_ids")?,
        index_source_layers: text.usize_list("index_source_layer_ids")?,
        candidate,
        engram,
        dspark,
        quant,
        storage: WeightStorage::Quantized,
        v4: None,
        image_token_id: top.optional_u32("image_token_id")?,
        vision,
    };
    ModelConfig::from_family(&text, top, family)
}

/// The DSpark drafter keys both families spell alike, for `n_stages` stages; `experts` reads the
/// drafter's `(routed, activated)` expert counts the family's way (after the other keys).
pub(super) fn parse_dspark(
    fields: &Fields<'_>,
    n_stages: usize,
    experts: impl FnOnce() -> Result<(usize, usize), ModelError>,
) -> Result<DsparkConfig, ModelError> {
    let block_size = fields.usize("dspark_block_size")?;
    let noise_token_id = fields.u32("dspark_noise_token_id")?;
    let target_layers = fields.usize_list("dspark_target_layer_ids")?;
    let markov_rank = fields.usize("dspark_markov_rank")?;
    let (n_routed_experts, n_activated_experts) = experts()?;
    Ok(DsparkConfig {
        n_stages,
        block_size,
        noise_token_id,
        target_layers,
        markov_rank,
        n_routed_experts,
        n_activated_experts,
    })
}

/// The `compress_ratios` entries after the `n_layers` backbone entries belong to the speculative
/// layers (`layer_kind`: "DSpark stage" in V4.1, "MTP/DSpark layer" in V4), which attend through
/// the window only: each must be 0.
pub(super) fn speculative_ratios_are_zero(
    fields: &Fields<'_>,
    ratios: &[usize],
    n_layers: usize,
    layer_kind: &str,
) -> Result<(), ModelError> {
    let speculative = ratios.get(n_layers..).unwrap_or_default();
    match speculative.iter().position(|&ratio| ratio != 0) {
        None => Ok(()),
        Some(position) => Err(fields.error(
            "compress_ratios",
            format!(
                "entry {} belongs to {layer_kind} {position} and must be 0, found {}",
                n_layers + position,
                speculative[position]
            ),
        )),
    }
}

fn parse_quant(fields: &Fields<'_>) -> Result<QuantConfig, ModelError> {
    fields.expect_str("quant_method", "fp8")?;
    fields.expect_str("activation_scheme", "dynamic")?;
    fields.expect_str("scale_fmt", "ue8m0")?;
    let block = fields.usize_list("weight_block_size")?;
    if block != [32, 32] {
        return Err(fields.error(
            "weight_block_size",
            format!("expected [32, 32], found {block:?}"),
        ));
    }
    fields.expect_str("expert_dtype", "fp4")?;
    Ok(QuantConfig {
        weight_block: [32, 32],
        expert_dtype: ExpertDtype::Fp4,
    })
}

fn parse_yarn(fields: &Fields<'_>) -> Result<YarnConfig, ModelError> {
    fields.expect_str("rope_type", "yarn")?;
    yarn_values(fields)
}

/// The numbers of a YaRN dict (factor, original length, betas), spelled alike by V4 and V4.1;
/// each family checks its own `rope_type` spelling first.
pub(super) fn yarn_values(fields: &Fields<'_>) -> Result<YarnConfig, ModelError> {
    Ok(YarnConfig {
        factor: fields.f64("factor")?,
        original_max_position: fields.usize("original_max_position_embeddings")?,
        beta_fast: fields.f64("beta_fast")?,
        beta_slow: fields.f64("beta_slow")?,
    })
}

/// The mHC keys (`hc_mult`, `hc_sinkhorn_iters`, `hc_eps`), spelled alike by V4 and V4.1.
pub(super) fn parse_hc(fields: &Fields<'_>) -> Result<HcConfig, ModelError> {
    Ok(HcConfig {
        mult: fields.usize("hc_mult")?,
        sinkhorn_iters: fields.usize("hc_sinkhorn_iters")?,
        eps: fields.f32("hc_eps")?,
    })
}

fn parse_vision(fields: &Fields<'_>) -> Result<VisionConfig, ModelError> {
    fields.expect_str("model_type", V41_VISION_MODEL_TYPE)?;
    let max_wh_ratio = match fields.optional("max_wh_ratio") {
        None => None,
        Some(_) => Some(fields.f64("max_wh_ratio")?),
    };
    Ok(VisionConfig {
        n_layers: fields.usize("num_hidden_layers")?,
        dim: fields.usize("hidden_size")?,
        n_heads: fields.usize("num_attention_heads")?,
        inter_dim: fields.usize("intermediate_size")?,
        patch_size: fields.usize("patch_size")?,
        rope_theta: fields.f64("rope_theta")?,
        downsample_ratio: fields.usize("downsample_ratio")?,
        max_image_tokens: fields.usize("max_image_tokens")?,
        min_pixels: fields.usize("min_pixels")?,
        max_wh_ratio,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::{Fields, speculative_ratios_are_zero};
    use crate::error::ModelError;

    #[test]
    fn speculative_ratios_must_be_zero_and_the_error_names_entry_and_layer() {
        let object = json!({});
        let text = Fields::new(&object, "text_config.", Path::new("config.json")).expect("object");
        assert!(speculative_ratios_are_zero(&text, &[4, 128, 0, 0], 2, "DSpark stage").is_ok());
        assert!(speculative_ratios_are_zero(&text, &[4, 128], 2, "DSpark stage").is_ok());
        let err = speculative_ratios_are_zero(&text, &[4, 0, 0, 128], 2, "DSpark stage")
            .expect_err("a compressed speculative layer");
        let ModelError::Config { field, message, .. } = err else {
            panic!("expected a config error, found {err:?}");
        };
        assert_eq!(field, "text_config.compress_ratios");
        assert_eq!(
            message,
            "entry 3 belongs to DSpark stage 1 and must be 0, found 128"
        );
    }
}
