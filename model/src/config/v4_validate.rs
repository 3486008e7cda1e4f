//! Cross-field validation of a V4 [`ModelConfig`](super::ModelConfig) (spec v4-architecture.md
//! §1): positive sizes, head grouping, the per-layer schedule against `compress_ratios`, FP4 group
//! divisibility of quantised experts, MTP / DSpark consistency. Errors name the flat V4 key.

use super::validate::Validator;
use super::{ExpertDtype, V4Attention, WeightStorage};
use crate::error::ModelError;

impl Validator<'_> {
    /// Checks a V4-family config (the flat field names of the V4 `config.json`).
    pub(super) fn run_v4(&self) -> Result<(), ModelError> {
        let c = self.config;
        if c.v4.is_none() {
            return Err(self.fail(
                "model_type",
                "a deepseek_v4 config needs its V4 schedule (ModelConfig::v4 is None)",
            ));
        }
        for (field, value) in [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.dim),
            ("num_hidden_layers", c.n_layers),
            ("num_attention_heads", c.n_heads),
            ("head_dim", c.head_dim),
            ("q_lora_rank", c.q_lora_rank),
            ("o_lora_rank", c.o_lora_rank),
            ("o_groups", c.o_groups),
            ("moe_intermediate_size", c.moe_inter_dim),
            ("n_routed_experts", c.n_routed_experts),
            ("n_shared_experts", c.n_shared_experts),
            ("sliding_window", c.window_size),
            ("max_position_embeddings", c.max_position_embeddings),
            ("index_n_heads", c.index_n_heads),
            ("index_head_dim", c.index_head_dim),
            ("index_topk", c.index_topk),
            ("hc_mult", c.hc.mult),
            ("hc_sinkhorn_iters", c.hc.sinkhorn_iters),
        ] {
            self.positive(field, value)?;
        }
        self.head_and_rope_shapes("")?;
        if c.storage == WeightStorage::Quantized {
            let [rows, cols] = c.quant.weight_block;
            if rows == 0 || rows != cols {
                return Err(self.fail(
                    "quantization_config.weight_block_size",
                    format!(
                        "expected a positive square block, found {:?}",
                        c.quant.weight_block
                    ),
                ));
            }
            if c.quant.expert_dtype == ExpertDtype::Fp4 {
                let why = "FP4 expert scale groups of 32";
                self.multiple_of("hidden_size", c.dim, 32, why)?;
                self.multiple_of("moe_intermediate_size", c.moe_inter_dim, 32, why)?;
            }
        }
        self.special_tokens()?;
        self.validate_v4_schedule()?;
        self.validate_v4_drafter()
    }

    fn validate_v4_schedule(&self) -> Result<(), ModelError> {
        let c = self.config;
        let Some(v4) = &c.v4 else { return Ok(()) };
        for (field, len) in [
            ("layer_types", v4.attention.len()),
            ("mlp_layer_types", v4.mlp.len()),
            ("compress_ratios", c.compress_ratios.len()),
        ] {
            if len != c.n_layers {
                return Err(self.fail(
                    field,
                    format!(
                        "expected one entry per backbone layer ({}), found {len}",
                        c.n_layers
                    ),
                ));
            }
        }
        self.positive("compress_rates.compressed_sparse_attention", v4.csa_ratio)?;
        self.positive("compress_rates.heavily_compressed_attention", v4.hca_ratio)?;
        for (layer, (&attention, &ratio)) in v4.attention.iter().zip(&c.compress_ratios).enumerate()
        {
            let expected = match attention {
                V4Attention::Sliding => 0,
                V4Attention::Csa => v4.csa_ratio,
                V4Attention::Hca => v4.hca_ratio,
            };
            if ratio != expected {
                return Err(self.fail(
                    "compress_ratios",
                    format!(
                        "layer {layer} is {attention:?} and needs ratio {expected}, found {ratio}"
                    ),
                ));
            }
        }
        let owners: Vec<usize> = (0..c.n_layers)
            .filter(|&layer| c.compress_ratios[layer] != 0)
            .collect();
        if c.kv_source_layers != owners {
            return Err(self.fail(
                "compress_ratios",
                format!(
                    "every compressed layer owns its compressor in V4: expected KV sources \
                     {owners:?}, found {:?}",
                    c.kv_source_layers
                ),
            ));
        }
        let indexed: Vec<usize> = (0..c.n_layers)
            .filter(|&layer| v4.attention[layer] == V4Attention::Csa)
            .collect();
        if c.index_source_layers != indexed {
            return Err(self.fail(
                "layer_types",
                format!(
                    "every CSA layer runs its own indexer in V4: expected index sources \
                     {indexed:?}, found {:?}",
                    c.index_source_layers
                ),
            ));
        }
        if c.candidate.is_some() || c.engram.is_some() || c.vision.is_some() {
            return Err(self.fail(
                "model_type",
                "candidate pools, Engram and a vision tower are V4.1-only",
            ));
        }
        Ok(())
    }

    fn validate_v4_drafter(&self) -> Result<(), ModelError> {
        let c = self.config;
        let mtp_layers = c.n_mtp_layers();
        let Some(dspark) = &c.dspark else {
            return Ok(());
        };
        if mtp_layers != 0 {
            return Err(self.fail(
                "num_nextn_predict_layers",
                format!(
                    "the mtp namespace is either {mtp_layers} plain MTP block(s) or a DSpark \
                     drafter, not both"
                ),
            ));
        }
        self.positive("compress_ratios (DSpark stages)", dspark.n_stages)?;
        self.dspark_drafter(dspark, "", "DSpark routed experts")
    }
}
