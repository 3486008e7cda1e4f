//! `config.json` parsing and validation. Owns the typed [`ModelConfig`] (spec v41-architecture.md
//! §1.2) and the derived layer-schedule queries (§2: KV source, index source, candidate use per
//! layer). Submodules: `fields` (typed JSON reading with named errors), `parse` (the nested V4.1
//! layout), `validate` (the structural checks DeepInfer applies before loading, §1.1 / §9),
//! `hf_json` (serialisation back to the Hugging Face layout), `presets` (reduced V4.1 configs of §9),
//! `v4` (the DeepSeek-V4 flat layout, legacy and transformers spellings, and its V4-only types),
//! `v4_presets` / `v4_json` / `v4_validate` (reduced V4 configs, serialisation, checks).

mod fields;
mod hf_json;
mod parse;
mod presets;
mod v4;
mod v4_json;
mod v4_presets;
mod v4_validate;
mod validate;

use std::path::Path;

use serde_json::Value;

use crate::error::ModelError;
use fields::Fields;
use validate::Validator;

pub use v4::{
    COMPRESSED_SPARSE_ATTENTION, HASH_MOE, HEAVILY_COMPRESSED_ATTENTION, SLIDING_ATTENTION,
    TOPK_MOE, V4_WEIGHT_BLOCK, V4Attention, V4Config, V4Mlp, V4Qat, WeightStorage,
};

/// The model families this crate knows about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFamily {
    /// DeepSeek-V4.1-Flash: nested `text_config` / `vision_config`, `model_type` `deepseek_v41`.
    V41,
    /// DeepSeek-V4-Flash / V4-Flash-0731: flat config, `model_type` `deepseek_v4`; the V4-only
    /// fields are in [`ModelConfig::v4`].
    V4,
}

/// Storage format of the routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertDtype {
    /// Packed E2M1 (`I8 [out, in/2]`) with 1×32 UE8M0 scales (V4.1).
    Fp4,
    /// E4M3 with block scales like the dense weights.
    Fp8,
}

impl ExpertDtype {
    /// The `expert_dtype` value of `config.json`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ExpertDtype::Fp4 => "fp4",
            ExpertDtype::Fp8 => "fp8",
        }
    }
}

/// Weight quantisation (`quantization_config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantConfig {
    /// Tile of one dense-weight scale, `[rows, cols]` (`[32, 32]` in V4.1).
    pub weight_block: [usize; 2],
    pub expert_dtype: ExpertDtype,
}

/// YaRN scaling of the compressed-layer RoPE (no mscale).
#[derive(Debug, Clone, PartialEq)]
pub struct YarnConfig {
    pub factor: f64,
    pub original_max_position: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// RoPE bases: `theta` for window-only (ratio 0) and DSpark layers, `compress_theta` (+ YaRN) for
/// compressed layers.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub compress_theta: f64,
    pub yarn: Option<YarnConfig>,
}

/// The two-level top-k: `source_layer` publishes `topk_blocks` blocks of `block_size` compressed
/// positions that restrict every later index source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateConfig {
    pub source_layer: usize,
    pub topk_blocks: usize,
    pub block_size: usize,
}

/// Manifold hyper-connections: `mult` residual streams, Sinkhorn iterations and epsilon.
#[derive(Debug, Clone, PartialEq)]
pub struct HcConfig {
    pub mult: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// Engram n-gram memory (spec §3.7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramConfig {
    /// Backbone layers with an Engram table (applied before the block).
    pub layer_ids: Vec<usize>,
    /// Table rows per Engram layer (the sum of that layer's primes).
    pub num_embeddings: Vec<usize>,
    /// Largest n-gram; sizes 2..=max_ngram_size are hashed.
    pub max_ngram_size: usize,
    /// Prime search start (`engram_vocab_size`).
    pub vocab_size: usize,
    /// Hash heads per n-gram size.
    pub n_heads: usize,
    /// Row width.
    pub head_dim: usize,
    pub pad_token_id: u32,
    /// Size of the tokenizer-normalised vocabulary the hashes run on.
    pub compressed_vocab_size: usize,
}

/// DSpark drafter (`mtp.0..n_stages`, spec §3.10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DsparkConfig {
    pub n_stages: usize,
    /// Anchor + noise slots per draft block.
    pub block_size: usize,
    pub noise_token_id: u32,
    /// Backbone layers whose attention input feeds `mtp.0.main_proj`.
    pub target_layers: Vec<usize>,
    pub markov_rank: usize,
    pub n_routed_experts: usize,
    pub n_activated_experts: usize,
}

/// Vision tower (`vision_config`); parsed and validated, not run yet.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub inter_dim: usize,
    pub patch_size: usize,
    pub rope_theta: f64,
    pub downsample_ratio: usize,
    pub max_image_tokens: usize,
    pub min_pixels: usize,
    pub max_wh_ratio: Option<f64>,
}

/// A validated model configuration. Build it with [`ModelConfig::from_file`] /
/// [`ModelConfig::from_json_str`] (which validate), or edit [`ModelConfig::tiny_v41`] and call
/// [`ModelConfig::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: ModelFamily,
    pub vocab_size: usize,
    pub dim: usize,
    /// Backbone layers only (DSpark stages are in `dspark`).
    pub n_layers: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    /// RoPE channels at the end of each head.
    pub rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub o_groups: usize,
    pub moe_inter_dim: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub n_activated_experts: usize,
    pub route_scale: f32,
    pub swiglu_limit: f32,
    pub norm_eps: f32,
    pub window_size: usize,
    pub max_position_embeddings: usize,
    pub rope: RopeConfig,
    /// One ratio per backbone layer (the DSpark entries of the file, all 0, are dropped).
    pub compress_ratios: Vec<usize>,
    pub kv_source_layers: Vec<usize>,
    pub index_source_layers: Vec<usize>,
    pub candidate: Option<CandidateConfig>,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub hc: HcConfig,
    pub engram: Option<EngramConfig>,
    pub dspark: Option<DsparkConfig>,
    pub quant: QuantConfig,
    /// How the checkpoint stores its weights (always `Quantized` for V4.1).
    pub storage: WeightStorage,
    /// The V4-only schedule and constants; `None` for V4.1.
    pub v4: Option<V4Config>,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: Option<u32>,
    pub image_token_id: Option<u32>,
    pub vision: Option<VisionConfig>,
}

/// The last element of `sorted` that is `<= layer`.
pub(crate) fn nearest_at_or_below(sorted: &[usize], layer: usize) -> Option<usize> {
    sorted.iter().copied().take_while(|&s| s <= layer).last()
}

pub(crate) const V41_ARCHITECTURE: &str = "DeepseekV41ForCausalLM";
pub(crate) const V41_MODEL_TYPE: &str = "deepseek_v41";
pub(crate) const V41_TEXT_MODEL_TYPE: &str = "deepseek_v41_text";
pub(crate) const V41_VISION_MODEL_TYPE: &str = "deepseek_v41_vision";
pub(crate) const V4_MODEL_TYPE: &str = "deepseek_v4";

/// What each family's parser reads its own way (or not at all); [`ModelConfig::from_family`] adds the keys
/// both families spell alike.
struct FamilyFields {
    family: ModelFamily,
    n_layers: usize,
    head_dim: usize,
    rope_head_dim: usize,
    rope: RopeConfig,
    compress_ratios: Vec<usize>,
    kv_source_layers: Vec<usize>,
    index_source_layers: Vec<usize>,
    candidate: Option<CandidateConfig>,
    engram: Option<EngramConfig>,
    dspark: Option<DsparkConfig>,
    quant: QuantConfig,
    storage: WeightStorage,
    v4: Option<V4Config>,
    image_token_id: Option<u32>,
    vision: Option<VisionConfig>,
}

impl ModelConfig {
    /// Reads and validates a `config.json`.
    pub fn from_file(path: &Path) -> Result<ModelConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::io(path, source))?;
        ModelConfig::from_json_str(&text, path)
    }

    /// Parses and validates the text of a `config.json`; `origin` names the file in errors.
    pub fn from_json_str(text: &str, origin: &Path) -> Result<ModelConfig, ModelError> {
        let root: Value = serde_json::from_str(text).map_err(|err| ModelError::Config {
            file: origin.to_path_buf(),
            field: "(document)".to_string(),
            message: format!("not valid JSON: {err}"),
        })?;
        let top = Fields::new(&root, "", origin)?;
        let model_type = top.str("model_type")?;
        let config = match model_type {
            V41_MODEL_TYPE => parse::parse_v41(&top)?,
            V4_MODEL_TYPE => v4::parse_v4(&top)?,
            other => {
                return Err(top.error(
                    "model_type",
                    format!(
                        "unknown model type \"{other}\", expected \"{V41_MODEL_TYPE}\" or \
                         \"{V4_MODEL_TYPE}\""
                    ),
                ));
            }
        };
        config.validate(origin)?;
        Ok(config)
    }

    /// The [`ModelConfig`] of `family`'s fields and the keys V4 and V4.1 spell alike: the model
    /// dimensions, MoE, indexer and mHC keys under `text` (`text_config` in V4.1, the top level in
    /// V4) and the token ids under `top`.
    fn from_family(
        text: &Fields<'_>,
        top: &Fields<'_>,
        family: FamilyFields,
    ) -> Result<ModelConfig, ModelError> {
        Ok(ModelConfig {
            family: family.family,
            vocab_size: text.usize("vocab_size")?,
            dim: text.usize("hidden_size")?,
            n_layers: family.n_layers,
            n_heads: text.usize("num_attention_heads")?,
            head_dim: family.head_dim,
            rope_head_dim: family.rope_head_dim,
            q_lora_rank: text.usize("q_lora_rank")?,
            o_lora_rank: text.usize("o_lora_rank")?,
            o_groups: text.usize("o_groups")?,
            moe_inter_dim: text.usize("moe_intermediate_size")?,
            n_routed_experts: text.usize("n_routed_experts")?,
            n_shared_experts: text.usize("n_shared_experts")?,
            n_activated_experts: text.usize("num_experts_per_tok")?,
            route_scale: text.f32("routed_scaling_factor")?,
            swiglu_limit: text.f32("swiglu_limit")?,
            norm_eps: text.f32("rms_norm_eps")?,
            window_size: text.usize("sliding_window")?,
            max_position_embeddings: text.usize("max_position_embeddings")?,
            rope: family.rope,
            compress_ratios: family.compress_ratios,
            kv_source_layers: family.kv_source_layers,
            index_source_layers: family.index_source_layers,
            candidate: family.candidate,
            index_n_heads: text.usize("index_n_heads")?,
            index_head_dim: text.usize("index_head_dim")?,
            index_topk: text.usize("index_topk")?,
            hc: parse::parse_hc(text)?,
            engram: family.engram,
            dspark: family.dspark,
            quant: family.quant,
            storage: family.storage,
            v4: family.v4,
            bos_token_id: top.u32("bos_token_id")?,
            eos_token_id: top.u32("eos_token_id")?,
            pad_token_id: top.optional_u32("pad_token_id")?,
            image_token_id: family.image_token_id,
            vision: family.vision,
        })
    }

    /// Compression ratio of backbone layer `layer` (0 = window only).
    pub fn compress_ratio(&self, layer: usize) -> usize {
        self.compress_ratios.get(layer).copied().unwrap_or(0)
    }

    /// The KV source whose compressed cache layer `layer` reads (nearest source `<= layer`);
    /// `None` for window-only layers and layers out of range.
    pub fn kv_source_of(&self, layer: usize) -> Option<usize> {
        if self.compress_ratio(layer) == 0 {
            return None;
        }
        nearest_at_or_below(&self.kv_source_layers, layer)
    }

    /// The index source whose top-k selection layer `layer` uses (nearest source `<= layer`);
    /// `None` for window-only layers and layers out of range. In V4 a CSA layer is its own index
    /// source and an HCA layer has none (it attends to every compressed entry).
    pub fn index_source_of(&self, layer: usize) -> Option<usize> {
        if self.compress_ratio(layer) == 0 {
            return None;
        }
        if self.v4.is_some() {
            return self.is_index_source(layer).then_some(layer);
        }
        nearest_at_or_below(&self.index_source_layers, layer)
    }

    /// Whether `layer` owns a compressor (and index keys).
    pub fn is_kv_source(&self, layer: usize) -> bool {
        self.kv_source_layers.contains(&layer)
    }

    /// Whether `layer` runs its own indexer.
    pub fn is_index_source(&self, layer: usize) -> bool {
        self.index_source_layers.contains(&layer)
    }

    /// Whether `layer` is an index source restricted by the candidate mask of the candidate source.
    pub fn uses_candidates(&self, layer: usize) -> bool {
        match &self.candidate {
            Some(candidate) => self.is_index_source(layer) && layer > candidate.source_layer,
            None => false,
        }
    }

    /// Whether `layer` has an Engram table.
    pub fn is_engram_layer(&self, layer: usize) -> bool {
        self.engram
            .as_ref()
            .is_some_and(|engram| engram.layer_ids.contains(&layer))
    }

    /// V4 attention type of `layer` (`None` for V4.1 and out-of-range layers).
    pub fn v4_attention(&self, layer: usize) -> Option<V4Attention> {
        self.v4.as_ref()?.attention.get(layer).copied()
    }

    /// V4 MLP type of `layer` (`None` for V4.1 and out-of-range layers).
    pub fn v4_mlp(&self, layer: usize) -> Option<V4Mlp> {
        self.v4.as_ref()?.mlp.get(layer).copied()
    }

    /// Whether the final collapse is a learned hyper-head (`hc_head_{fn,base,scale}`): V4 yes,
    /// V4.1 (single-pass mHC) no.
    pub fn has_hc_head(&self) -> bool {
        self.family == ModelFamily::V4
    }

    /// Whether each query head is RMS-normalised (unweighted) after `wq_b`: V4 yes, V4.1 no.
    pub fn has_q_head_norm(&self) -> bool {
        self.family == ModelFamily::V4
    }

    /// Plain (non-DSpark) MTP blocks in the `mtp.*` namespace (V4-Flash: 1; otherwise 0).
    pub fn n_mtp_layers(&self) -> usize {
        self.v4.as_ref().map_or(0, |v4| v4.mtp_layers)
    }

    /// Number of DSpark stages (`num_nextn_predict_layers`; 0 without a drafter).
    pub fn n_dspark_stages(&self) -> usize {
        self.dspark.as_ref().map_or(0, |dspark| dspark.n_stages)
    }

    /// Checks every structural constraint of spec §1.1 / §9; errors name `origin` and the
    /// Hugging Face field.
    pub fn validate(&self, origin: &Path) -> Result<(), ModelError> {
        Validator {
            config: self,
            file: origin,
        }
        .run()
    }
}
