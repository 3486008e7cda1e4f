//! A one-block V4.1 model for whole-step benchmarks: layer 2's role (ratio-2 KV + index source: own
//! compressor with gate, indexer top-512) with attention, mHC and the routed MoE at the real width
//! (spec v41-architecture.md §1.2: d 5120, 64 heads × 512, q LoRA 1280, 8 × 1024 grouped output,
//! 384 experts × 2304 top-6 + 1 shared, FP8 32×32 dense, FP4 experts), a small vocabulary, no Engram,
//! DSpark or vision; and the random checkpoint it loads from (the model crate's writer, reused when
//! an identical one is already on disk).

use std::path::Path;

use deepinfer_model::checkpoint::{INDEX_FILE, write_random_checkpoint};
use deepinfer_model::config::{
    ExpertDtype, HcConfig, ModelConfig, ModelFamily, QuantConfig, RopeConfig, WeightStorage,
    YarnConfig,
};
use deepinfer_model::error::ModelError;

/// Widths of the benchmark block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockWidth {
    /// V4.1-Flash's real widths.
    Real,
    /// The same structure shrunk (d 256, 4 heads × 64, 16 experts × 64): CPU tests of the harness.
    Narrow,
}

/// The one-block config at `width` with `vocab_size` tokens and room for `max_positions`.
pub fn block_config(width: BlockWidth, vocab_size: usize, max_positions: usize) -> ModelConfig {
    let (dim, heads, head_dim, rope, q_lora, o_lora, o_groups) = match width {
        BlockWidth::Real => (5120, 64, 512, 64, 1280, 1024, 8),
        BlockWidth::Narrow => (256, 4, 64, 16, 64, 64, 2),
    };
    let (inter, experts, index_heads, index_dim, topk, window) = match width {
        BlockWidth::Real => (2304, 384, 32, 128, 512, 128),
        BlockWidth::Narrow => (64, 16, 4, 64, 8, 16),
    };
    ModelConfig {
        family: ModelFamily::V41,
        vocab_size,
        dim,
        n_layers: 1,
        n_heads: heads,
        head_dim,
        rope_head_dim: rope,
        q_lora_rank: q_lora,
        o_lora_rank: o_lora,
        o_groups,
        moe_inter_dim: inter,
        n_routed_experts: experts,
        n_shared_experts: 1,
        n_activated_experts: 6,
        route_scale: 1.5,
        swiglu_limit: 10.0,
        norm_eps: 1e-20,
        window_size: window,
        max_position_embeddings: max_positions,
        rope: RopeConfig {
            theta: 10000.0,
            compress_theta: 160000.0,
            yarn: Some(YarnConfig {
                factor: 16.0,
                original_max_position: 65536,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
        },
        compress_ratios: vec![2],
        kv_source_layers: vec![0],
        index_source_layers: vec![0],
        candidate: None,
        index_n_heads: index_heads,
        index_head_dim: index_dim,
        index_topk: topk,
        hc: HcConfig {
            mult: 4,
            sinkhorn_iters: 20,
            eps: 1e-6,
        },
        engram: None,
        dspark: None,
        quant: QuantConfig {
            weight_block: [32, 32],
            expert_dtype: ExpertDtype::Fp4,
        },
        storage: WeightStorage::Quantized,
        v4: None,
        bos_token_id: 0,
        eos_token_id: 1,
        pad_token_id: Some(2),
        image_token_id: None,
        vision: None,
    }
}

/// Whether a random checkpoint was written or an identical one reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prepared {
    Written,
    Reused,
}

/// Makes `dir` hold a random checkpoint of `cfg` (seed `seed`, `shards` files): reuses one whose
/// `config.json` equals `cfg` and whose index exists (a previous run on the same machine; the seed
/// is not recorded, any random checkpoint of the config serves a benchmark), else writes it with
/// the model crate's synthetic writer.
pub fn prepare_checkpoint(
    cfg: &ModelConfig,
    seed: u64,
    dir: &Path,
    shards: usize,
) -> Result<Prepared, ModelError> {
    let config_path = dir.join("config.json");
    if config_path.exists() && dir.join(INDEX_FILE).exists() {
        let existing = ModelConfig::from_file(&config_path)?;
        if &existing == cfg {
            return Ok(Prepared::Reused);
        }
    }
    write_random_checkpoint(cfg, seed, dir, shards)?;
    Ok(Prepared::Written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_model::checkpoint::v41_inventory;

    #[test]
    fn both_widths_validate_and_real_width_has_the_spec_shapes() {
        for width in [BlockWidth::Real, BlockWidth::Narrow] {
            block_config(width, 512, 4096)
                .validate(Path::new("block/config.json"))
                .expect("valid");
        }
        let specs = v41_inventory(&block_config(BlockWidth::Real, 512, 4096));
        let expert_w2 = specs
            .iter()
            .find(|s| s.name == "layers.0.ffn.experts.383.w2")
            .expect("384 experts");
        assert_eq!(
            expert_w2.stored_bytes(),
            5120 * 2304 / 2 + 5120 * 72,
            "FP4 [5120, 2304] + scales"
        );
        assert!(
            specs
                .iter()
                .any(|s| s.name == "layers.0.attn.compressor.wgate.weight")
        );
        assert!(specs.iter().any(|s| s.name == "layers.0.attn.indexer.wq_b"));
    }

    #[test]
    fn an_identical_checkpoint_is_reused_and_a_different_one_rewritten() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cfg = block_config(BlockWidth::Narrow, 64, 256);
        assert_eq!(
            prepare_checkpoint(&cfg, 1, dir.path(), 2).expect("write"),
            Prepared::Written
        );
        assert_eq!(
            prepare_checkpoint(&cfg, 1, dir.path(), 2).expect("reuse"),
            Prepared::Reused
        );
        let other = block_config(BlockWidth::Narrow, 128, 256);
        assert_eq!(
            prepare_checkpoint(&other, 1, dir.path(), 2).expect("rewrite"),
            Prepared::Written
        );
    }
}
