//! One-block models for whole-step benchmarks, and the random checkpoint they load from (the model
//! crate's writer, reused when an identical one is already on disk).
//!
//! - V4.1 ([`BlockFamily::V41`]): layer 2's role (ratio-2 KV + index source: own compressor with
//!   gate, indexer top-512) with attention, mHC and the routed MoE at the real width (spec
//!   v41-architecture.md §1.2: d 5120, 64 heads × 512, q LoRA 1280, 8 × 1024 grouped output,
//!   384 experts × 2304 top-6 + 1 shared, FP8 32×32 dense, FP4 experts), no Engram, DSpark or
//!   vision.
//! - V4 ([`BlockFamily::V4`]): a CSA layer (ratio 4, overlapping compressor, indexer top-512,
//!   score routing) of the released V4-Flash config (`tests/data/deepseek-v4-flash.config.json`:
//!   d 4096, 64 heads × 512, 256 FP4 experts × 2048 top-6 + 1 shared, FP8 128×128), no MTP. 21 of
//!   V4-Flash's 43 layers are CSA layers, the most expensive kind.
//!
//! Both with a small vocabulary (the head is not what a block measures).

use std::path::Path;

use deepinfer_model::checkpoint::{INDEX_FILE, write_random_checkpoint};
use deepinfer_model::config::{
    ModelConfig, ModelFamily, RopeConfig, V4Attention, V4Mlp, YarnConfig,
};
use deepinfer_model::error::ModelError;

/// Which model family's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFamily {
    V41,
    V4,
}

impl BlockFamily {
    /// The family's name in tables and paths.
    pub fn name(self) -> &'static str {
        match self {
            BlockFamily::V41 => "v41",
            BlockFamily::V4 => "v4",
        }
    }

    /// The model crate's family.
    pub fn model_family(self) -> ModelFamily {
        match self {
            BlockFamily::V41 => ModelFamily::V41,
            BlockFamily::V4 => ModelFamily::V4,
        }
    }
}

/// Widths of the benchmark block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockWidth {
    /// The released model's real widths.
    Real,
    /// The same structure shrunk (V4.1: d 256, 4 heads × 64, 16 experts × 64; V4: the model
    /// crate's `reduced_v4` widths): CPU tests of the harness.
    Narrow,
}

/// The one-block config of `family` at `width` with `vocab_size` tokens and room for
/// `max_positions`.
pub fn block_config(
    family: BlockFamily,
    width: BlockWidth,
    vocab_size: usize,
    max_positions: usize,
) -> ModelConfig {
    match family {
        BlockFamily::V41 => v41_block(width, vocab_size, max_positions),
        BlockFamily::V4 => v4_block(width, vocab_size, max_positions),
    }
}

/// The released V4-Flash config (the shipped copy of its `config.json`, `tests/data`).
pub fn v4_flash_config() -> ModelConfig {
    deepinfer_actors::sim::shipped_config("deepseek-ai/DeepSeek-V4-Flash")
        .expect("V4-Flash is a shipped config")
        .expect("the shipped V4-Flash config parses")
}

/// A V4 one-block config: the released V4-Flash config (or the reduced V4 at `Narrow`) cut to one
/// CSA layer with score routing, no MTP.
fn v4_block(width: BlockWidth, vocab_size: usize, max_positions: usize) -> ModelConfig {
    let mut cfg = match width {
        BlockWidth::Real => v4_flash_config(),
        BlockWidth::Narrow => ModelConfig::reduced_v4(),
    };
    let csa = cfg.v4.as_ref().map_or(4, |v4| v4.csa_ratio);
    cfg.n_layers = 1;
    cfg.compress_ratios = vec![csa];
    cfg.kv_source_layers = vec![0];
    cfg.index_source_layers = vec![0];
    cfg.dspark = None;
    if let Some(v4) = cfg.v4.as_mut() {
        v4.attention = vec![V4Attention::Csa];
        v4.mlp = vec![V4Mlp::TopkMoe];
        v4.mtp_layers = 0;
    }
    cfg.vocab_size = vocab_size;
    cfg.max_position_embeddings = max_positions;
    (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) = (0, 1, Some(2));
    cfg
}

/// The V4.1 one-block config at `width`: [`ModelConfig::tiny_v41`]'s shared settings (mHC,
/// quantisation, RoPE thetas, routing scale, special ids) with the block's widths, one ratio-2
/// layer that is its own KV and index source, and no Engram, DSpark or vision.
fn v41_block(width: BlockWidth, vocab_size: usize, max_positions: usize) -> ModelConfig {
    let (dim, heads, head_dim, rope, q_lora, o_lora, o_groups) = match width {
        BlockWidth::Real => (5120, 64, 512, 64, 1280, 1024, 8),
        BlockWidth::Narrow => (256, 4, 64, 16, 64, 64, 2),
    };
    let (inter, experts, index_heads, index_dim, topk, window) = match width {
        BlockWidth::Real => (2304, 384, 32, 128, 512, 128),
        BlockWidth::Narrow => (64, 16, 4, 64, 8, 16),
    };
    let tiny = ModelConfig::tiny_v41();
    ModelConfig {
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
        n_activated_experts: 6,
        window_size: window,
        max_position_embeddings: max_positions,
        rope: RopeConfig {
            yarn: Some(YarnConfig {
                factor: 16.0,
                original_max_position: 65536,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
            ..tiny.rope.clone()
        },
        compress_ratios: vec![2],
        kv_source_layers: vec![0],
        index_source_layers: vec![0],
        candidate: None,
        index_n_heads: index_heads,
        index_head_dim: index_dim,
        index_topk: topk,
        engram: None,
        dspark: None,
        image_token_id: None,
        vision: None,
        ..tiny
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
    use deepinfer_model::checkpoint::{TensorSpec, inventory_for, v41_inventory};
    use deepinfer_model::config::ExpertDtype;

    /// The stored bytes of the tensor `name` of `specs` (which must list it).
    fn stored_bytes(specs: &[TensorSpec], name: &str) -> usize {
        let spec = specs.iter().find(|s| s.name == name);
        spec.unwrap_or_else(|| panic!("no {name}")).stored_bytes()
    }

    #[test]
    fn every_block_validates_and_the_v41_block_has_the_spec_shapes() {
        for family in [BlockFamily::V41, BlockFamily::V4] {
            for width in [BlockWidth::Real, BlockWidth::Narrow] {
                block_config(family, width, 512, 4096)
                    .validate(Path::new("block/config.json"))
                    .expect("valid");
            }
        }
        let specs = v41_inventory(&block_config(BlockFamily::V41, BlockWidth::Real, 512, 4096));
        let expert_w2 = "layers.0.ffn.experts.383.w2";
        // FP4 [5120, 2304] + scales.
        assert_eq!(stored_bytes(&specs, expert_w2), 5120 * 2304 / 2 + 5120 * 72);
        assert!(
            specs
                .iter()
                .any(|s| s.name == "layers.0.attn.compressor.wgate.weight")
        );
        assert!(specs.iter().any(|s| s.name == "layers.0.attn.indexer.wq_b"));
    }

    #[test]
    fn the_v4_block_is_one_real_v4_flash_csa_layer() {
        let cfg = block_config(BlockFamily::V4, BlockWidth::Real, 512, 4096);
        assert_eq!((cfg.dim, cfg.n_heads, cfg.head_dim), (4096, 64, 512));
        assert_eq!((cfg.n_routed_experts, cfg.moe_inter_dim), (256, 2048));
        assert_eq!(cfg.n_activated_experts, 6);
        assert_eq!(cfg.quant.weight_block, [128, 128]);
        assert_eq!(cfg.quant.expert_dtype, ExpertDtype::Fp4);
        assert_eq!(cfg.compress_ratios, vec![4]);
        assert_eq!(cfg.v4_attention(0), Some(V4Attention::Csa));
        assert_eq!(cfg.index_topk, 512);
        let specs = inventory_for(&cfg);
        let expert_w2 = "layers.0.ffn.experts.255.w2";
        // FP4 [4096, 2048] + scales.
        assert_eq!(stored_bytes(&specs, expert_w2), 4096 * 2048 / 2 + 4096 * 64);
    }

    #[test]
    fn an_identical_checkpoint_is_reused_and_a_different_one_rewritten() {
        let dir = tempfile::tempdir().expect("temp dir");
        let cfg = block_config(BlockFamily::V41, BlockWidth::Narrow, 64, 256);
        assert_eq!(
            prepare_checkpoint(&cfg, 1, dir.path(), 2).expect("write"),
            Prepared::Written
        );
        assert_eq!(
            prepare_checkpoint(&cfg, 1, dir.path(), 2).expect("reuse"),
            Prepared::Reused
        );
        let other = block_config(BlockFamily::V41, BlockWidth::Narrow, 128, 256);
        assert_eq!(
            prepare_checkpoint(&other, 1, dir.path(), 2).expect("rewrite"),
            Prepared::Written
        );
    }
}
