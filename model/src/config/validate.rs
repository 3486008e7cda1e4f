//! Cross-field validation of a [`ModelConfig`] (spec §1.1 and §9): positive sizes, GEMM input
//! dimensions that are multiples of 32, the layer schedule (sources, ratios, candidate source),
//! Engram table sizes against their primes, DSpark and vision consistency. Errors name the file and
//! the Hugging Face field.

use std::path::{Path, PathBuf};

use super::{
    DsparkConfig, EngramConfig, ModelConfig, ModelFamily, VisionConfig, nearest_at_or_below,
};
use crate::engram::primes::EngramLayout;
use crate::error::ModelError;

/// Where V4.1 nests its text-model keys; V4's flat layout has no prefix.
const TEXT_PREFIX: &str = "text_config.";

/// Cross-field checks on a typed config; field names are the Hugging Face keys.
pub(crate) struct Validator<'a> {
    pub(crate) config: &'a ModelConfig,
    pub(crate) file: &'a Path,
}

impl Validator<'_> {
    pub(super) fn fail(&self, field: &str, message: impl Into<String>) -> ModelError {
        ModelError::Config {
            file: PathBuf::from(self.file),
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub(super) fn positive(&self, field: &str, value: usize) -> Result<(), ModelError> {
        if value == 0 {
            Err(self.fail(field, "must be at least 1, found 0"))
        } else {
            Ok(())
        }
    }

    /// Input dimensions of FP8/FP4 GEMMs and QDQ groups must be multiples of 32.
    pub(super) fn multiple_of(
        &self,
        field: &str,
        value: usize,
        unit: usize,
        why: &str,
    ) -> Result<(), ModelError> {
        if value == 0 || !value.is_multiple_of(unit) {
            Err(self.fail(
                field,
                format!("must be a positive multiple of {unit} ({why}), found {value}"),
            ))
        } else {
            Ok(())
        }
    }

    pub(super) fn token(&self, field: &str, id: u32) -> Result<(), ModelError> {
        if (id as usize) < self.config.vocab_size {
            Ok(())
        } else {
            Err(self.fail(
                field,
                format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.config.vocab_size
                ),
            ))
        }
    }

    /// Strictly ascending backbone layer ids.
    pub(super) fn layer_list(&self, field: &str, layers: &[usize]) -> Result<(), ModelError> {
        let n_layers = self.config.n_layers;
        if let Some(&bad) = layers.iter().find(|&&layer| layer >= n_layers) {
            return Err(self.fail(
                field,
                format!("layer {bad} is out of range (num_hidden_layers = {n_layers})"),
            ));
        }
        if layers.windows(2).any(|pair| pair[0] >= pair[1]) {
            return Err(self.fail(
                field,
                format!("must be strictly ascending, found {layers:?}"),
            ));
        }
        Ok(())
    }

    /// Head grouping, rope channels, experts per token and YaRN, shared by both families; `prefix`
    /// is where the family spells these keys ([`TEXT_PREFIX`] for V4.1, `""` for flat V4).
    pub(super) fn head_and_rope_shapes(&self, prefix: &str) -> Result<(), ModelError> {
        let c = self.config;
        if !c.n_heads.is_multiple_of(c.o_groups) {
            return Err(self.fail(
                &format!("{prefix}o_groups"),
                format!(
                    "num_attention_heads {} is not divisible by o_groups {}",
                    c.n_heads, c.o_groups
                ),
            ));
        }
        if c.rope_head_dim == 0
            || !c.rope_head_dim.is_multiple_of(2)
            || c.rope_head_dim > c.head_dim
            || c.rope_head_dim > c.index_head_dim
        {
            return Err(self.fail(
                &format!("{prefix}qk_rope_head_dim"),
                format!(
                    "must be even, positive and at most head_dim {} and index_head_dim {}, found {}",
                    c.head_dim, c.index_head_dim, c.rope_head_dim
                ),
            ));
        }
        self.experts_per_token(
            &format!("{prefix}num_experts_per_tok"),
            c.n_activated_experts,
            c.n_routed_experts,
            "n_routed_experts",
        )?;
        if let Some(yarn) = &c.rope.yarn
            && (yarn.factor < 1.0 || yarn.original_max_position == 0)
        {
            return Err(self.fail(
                &format!("{prefix}rope_scaling"),
                format!(
                    "factor must be >= 1 and original_max_position_embeddings >= 1, found {} and {}",
                    yarn.factor, yarn.original_max_position
                ),
            ));
        }
        Ok(())
    }

    /// BOS, EOS and the optional PAD token lie inside the vocabulary (top-level keys in both
    /// families).
    pub(super) fn special_tokens(&self) -> Result<(), ModelError> {
        let c = self.config;
        self.token("bos_token_id", c.bos_token_id)?;
        self.token("eos_token_id", c.eos_token_id)?;
        if let Some(pad) = c.pad_token_id {
            self.token("pad_token_id", pad)?;
        }
        Ok(())
    }

    /// The DSpark drafter's block, noise token, target layers, Markov rank and expert routing,
    /// shared by both families (the stage count is checked by the caller, under its own key).
    /// `prefix` is where the family spells the `dspark_*` keys; `routed_experts` names where the
    /// drafter's routed-expert count comes from in the error message.
    pub(super) fn dspark_drafter(
        &self,
        dspark: &DsparkConfig,
        prefix: &str,
        routed_experts: &str,
    ) -> Result<(), ModelError> {
        if dspark.block_size < 2 {
            return Err(self.fail(
                &format!("{prefix}dspark_block_size"),
                format!(
                    "must be at least 2 (anchor + drafts), found {}",
                    dspark.block_size
                ),
            ));
        }
        self.token(
            &format!("{prefix}dspark_noise_token_id"),
            dspark.noise_token_id,
        )?;
        let target_layers = format!("{prefix}dspark_target_layer_ids");
        self.layer_list(&target_layers, &dspark.target_layers)?;
        self.positive(&target_layers, dspark.target_layers.len())?;
        self.positive(&format!("{prefix}dspark_markov_rank"), dspark.markov_rank)?;
        self.experts_per_token(
            &format!("{prefix}dspark_num_experts_per_tok"),
            dspark.n_activated_experts,
            dspark.n_routed_experts,
            routed_experts,
        )
    }

    /// A top-k router picks `activated` of `routed` experts: 1..=routed; `routed_label` says where
    /// the routed count comes from.
    fn experts_per_token(
        &self,
        field: &str,
        activated: usize,
        routed: usize,
        routed_label: &str,
    ) -> Result<(), ModelError> {
        if activated == 0 || activated > routed {
            return Err(self.fail(
                field,
                format!("must be in 1..={routed} ({routed_label}), found {activated}"),
            ));
        }
        Ok(())
    }

    pub(crate) fn run(&self) -> Result<(), ModelError> {
        let c = self.config;
        if c.family == ModelFamily::V4 {
            return self.run_v4();
        }
        self.positive("text_config.vocab_size", c.vocab_size)?;
        self.positive("text_config.num_hidden_layers", c.n_layers)?;
        self.positive("text_config.num_attention_heads", c.n_heads)?;
        self.positive("text_config.sliding_window", c.window_size)?;
        self.positive(
            "text_config.max_position_embeddings",
            c.max_position_embeddings,
        )?;
        self.positive("text_config.n_routed_experts", c.n_routed_experts)?;
        self.positive("text_config.index_n_heads", c.index_n_heads)?;
        self.positive("text_config.index_topk", c.index_topk)?;
        self.positive("text_config.hc_mult", c.hc.mult)?;
        self.positive("text_config.hc_sinkhorn_iters", c.hc.sinkhorn_iters)?;
        if c.quant.weight_block != [32, 32] {
            return Err(self.fail(
                "quantization_config.weight_block_size",
                format!("expected [32, 32], found {:?}", c.quant.weight_block),
            ));
        }

        let gemm = "an FP8/FP4 GEMM input dimension";
        self.multiple_of("text_config.hidden_size", c.dim, 32, gemm)?;
        self.multiple_of("text_config.q_lora_rank", c.q_lora_rank, 32, gemm)?;
        self.multiple_of("text_config.o_lora_rank", c.o_lora_rank, 32, gemm)?;
        self.multiple_of(
            "text_config.moe_intermediate_size",
            c.moe_inter_dim,
            32,
            gemm,
        )?;
        self.multiple_of(
            "text_config.head_dim",
            c.head_dim,
            32,
            "FP8 window QDQ groups of 32",
        )?;
        self.multiple_of(
            "text_config.index_head_dim",
            c.index_head_dim,
            32,
            "FP4 QDQ groups of 32",
        )?;
        self.positive("text_config.o_groups", c.o_groups)?;
        self.head_and_rope_shapes(TEXT_PREFIX)?;

        self.special_tokens()?;
        if let Some(image) = c.image_token_id {
            self.token("image_token_id", image)?;
        }

        self.validate_schedule()?;
        if let Some(engram) = &c.engram {
            self.validate_engram(engram)?;
        }
        if let Some(dspark) = &c.dspark {
            self.validate_dspark(dspark)?;
        }
        if let Some(vision) = &c.vision {
            self.validate_vision(vision)?;
        }
        Ok(())
    }

    /// Compression ratios, KV / index sources and the candidate source (spec §2).
    fn validate_schedule(&self) -> Result<(), ModelError> {
        let c = self.config;
        if c.compress_ratios.len() != c.n_layers {
            return Err(self.fail(
                "text_config.compress_ratios",
                format!(
                    "expected one ratio per backbone layer ({}), found {}",
                    c.n_layers,
                    c.compress_ratios.len()
                ),
            ));
        }
        self.layer_list("text_config.kv_source_layer_ids", &c.kv_source_layers)?;
        self.layer_list("text_config.index_source_layer_ids", &c.index_source_layers)?;
        for (field, sources) in [
            ("text_config.kv_source_layer_ids", &c.kv_source_layers),
            ("text_config.index_source_layer_ids", &c.index_source_layers),
        ] {
            if let Some(&source) = sources.iter().find(|&&layer| c.compress_ratios[layer] == 0) {
                return Err(self.fail(
                    field,
                    format!("layer {source} has compress ratio 0 and cannot be a source"),
                ));
            }
        }
        for (layer, &ratio) in c.compress_ratios.iter().enumerate() {
            if ratio == 0 {
                continue;
            }
            let Some(kv_source) = nearest_at_or_below(&c.kv_source_layers, layer) else {
                return Err(self.fail(
                    "text_config.kv_source_layer_ids",
                    format!(
                        "compressed layer {layer} (ratio {ratio}) has no KV source at or below it"
                    ),
                ));
            };
            let source_ratio = c.compress_ratios[kv_source];
            if source_ratio != ratio {
                return Err(self.fail(
                    "text_config.compress_ratios",
                    format!(
                        "layer {layer} has ratio {ratio} but its KV source {kv_source} has ratio {source_ratio}"
                    ),
                ));
            }
            let index_source = nearest_at_or_below(&c.index_source_layers, layer);
            if index_source.is_none_or(|source| source < kv_source) {
                return Err(self.fail(
                    "text_config.index_source_layer_ids",
                    format!(
                        "compressed layer {layer} needs an index source in {kv_source}..={layer} (its KV \
                         source group), found {index_source:?}"
                    ),
                ));
            }
        }
        if let Some(candidate) = &c.candidate {
            let source = candidate.source_layer;
            if !c.is_kv_source(source) || !c.is_index_source(source) {
                return Err(self.fail(
                    "text_config.candidate_source_layer_id",
                    format!("layer {source} must be both a KV source and an index source"),
                ));
            }
            self.positive("text_config.candidate_topk_blocks", candidate.topk_blocks)?;
            self.positive("text_config.candidate_block_size", candidate.block_size)?;
            if let Some(&later) = c.index_source_layers.iter().find(|&&layer| {
                layer > source && nearest_at_or_below(&c.kv_source_layers, layer) != Some(source)
            }) {
                return Err(self.fail(
                    "text_config.candidate_source_layer_id",
                    format!(
                        "index source {later} follows candidate source {source} but reads another KV \
                         source's cache"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_engram(&self, engram: &EngramConfig) -> Result<(), ModelError> {
        self.layer_list("text_config.engram_layer_ids", &engram.layer_ids)?;
        if engram.num_embeddings.len() != engram.layer_ids.len() {
            return Err(self.fail(
                "text_config.engram_num_embeddings",
                format!(
                    "expected one table size per Engram layer ({}), found {}",
                    engram.layer_ids.len(),
                    engram.num_embeddings.len()
                ),
            ));
        }
        if engram.max_ngram_size < 2 {
            return Err(self.fail(
                "text_config.engram_max_ngram_size",
                format!(
                    "must be at least 2 (n-grams 2..=max), found {}",
                    engram.max_ngram_size
                ),
            ));
        }
        self.positive("text_config.engram_n_heads", engram.n_heads)?;
        self.multiple_of(
            "text_config.engram_head_dim",
            engram.head_dim,
            32,
            "FP8 row scales per 32",
        )?;
        // Each table holds one bucket range per (n-gram size, head), sized by primes searched
        // upwards from `engram_vocab_size`: its rows must be the sum of that layer's primes.
        let layout = EngramLayout::compute(
            engram.layer_ids.len(),
            engram.max_ngram_size,
            engram.n_heads,
            engram.vocab_size as u64,
        );
        let derived = layout.num_embeddings();
        if derived != engram.num_embeddings {
            return Err(self.fail(
                "text_config.engram_num_embeddings",
                format!(
                    "expected the sums of the Engram primes from engram_vocab_size {}: {derived:?}, \
                     found {:?}",
                    engram.vocab_size, engram.num_embeddings
                ),
            ));
        }
        if engram.compressed_vocab_size == 0
            || engram.compressed_vocab_size > self.config.vocab_size
        {
            return Err(self.fail(
                "text_config.engram_compressed_vocab_size",
                format!(
                    "must be in 1..={} (vocab_size), found {}",
                    self.config.vocab_size, engram.compressed_vocab_size
                ),
            ));
        }
        self.token("text_config.engram_pad_token_id", engram.pad_token_id)
    }

    fn validate_dspark(&self, dspark: &DsparkConfig) -> Result<(), ModelError> {
        self.positive("text_config.num_nextn_predict_layers", dspark.n_stages)?;
        self.dspark_drafter(dspark, TEXT_PREFIX, "dspark_n_routed_experts")
    }

    fn validate_vision(&self, vision: &VisionConfig) -> Result<(), ModelError> {
        self.positive("vision_config.num_hidden_layers", vision.n_layers)?;
        self.positive("vision_config.num_attention_heads", vision.n_heads)?;
        self.positive("vision_config.patch_size", vision.patch_size)?;
        self.positive("vision_config.downsample_ratio", vision.downsample_ratio)?;
        if !vision.dim.is_multiple_of(vision.n_heads)
            || !(vision.dim / vision.n_heads).is_multiple_of(4)
        {
            return Err(self.fail(
                "vision_config.hidden_size",
                format!(
                    "hidden_size {} / num_attention_heads {} must be a multiple of 4 (2-D RoPE)",
                    vision.dim, vision.n_heads
                ),
            ));
        }
        Ok(())
    }
}
