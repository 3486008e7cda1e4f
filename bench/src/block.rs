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

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use deepinfer_model::checkpoint::{Checkpoint, INDEX_FILE, write_random_checkpoint};
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

/// Makes `dir` hold a random checkpoint of `cfg` (seed `seed`, `shards` files) with a balanced
/// router ([`balance_routers`]): reuses one whose `config.json` equals `cfg` and whose index
/// exists (a previous run on the same machine; the seed is not recorded, any random checkpoint of
/// the config serves a benchmark), else writes it with the model crate's synthetic writer.
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
            balance_routers(dir)?;
            return Ok(Prepared::Reused);
        }
    }
    write_random_checkpoint(cfg, seed, dir, shards)?;
    balance_routers(dir)?;
    Ok(Prepared::Written)
}

/// The name ending of the routers' selection bias (`layers.L.ffn.gate.bias`, both families).
const ROUTER_BIAS: &str = ".ffn.gate.bias";

/// Sets every router's selection bias in the checkpoint at `dir` to zero, in place.
///
/// The released routers' biases were trained so that the experts' loads balance; the synthetic
/// writer's are random (`N(0, 0.25)`) and make every token favour the same experts. Drawn as the
/// writer draws the real-width V4.1 router (384 experts, gate std 2.9/√5120, top-6 of
/// `sqrt(softplus(z)) + bias`), 64 independent unit-RMS inputs select about 131 distinct experts
/// with such a bias and about 239 without, where the cost model's floor counts 244
/// (`cost::expected_experts`): a decode step would read about half the expert bytes its floor
/// counts. With the bias at zero the selection follows the gate's scores alone, spread over the
/// experts as a balanced router's.
pub fn balance_routers(dir: &Path) -> Result<(), ModelError> {
    // Where each bias lies in its shard, found by the loader; its mapping is closed before the
    // files are written.
    let biases = {
        let ckpt = Checkpoint::open(dir)?;
        ckpt.names()
            .into_iter()
            .filter(|name| name.ends_with(ROUTER_BIAS))
            .map(|name| {
                let tensor = ckpt.tensor(name)?;
                Ok((tensor.file.to_path_buf(), tensor.offset, tensor.bytes.len()))
            })
            .collect::<Result<Vec<_>, ModelError>>()?
    };
    for (file, offset, len) in biases {
        let io = |source| ModelError::io(&file, source);
        let mut shard = OpenOptions::new().write(true).open(&file).map_err(io)?;
        shard.seek(SeekFrom::Start(offset as u64)).map_err(io)?;
        // Zero bytes are zero in every float format.
        shard.write_all(&vec![0u8; len]).map_err(io)?;
    }
    Ok(())
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

    /// The routers' biases read zero after `prepare_checkpoint`, on a written and on a reused
    /// checkpoint; every other byte is the synthetic writer's (the image bias included).
    #[test]
    fn prepared_checkpoints_have_balanced_routers_and_nothing_else_changed() {
        for family in [BlockFamily::V41, BlockFamily::V4] {
            let cfg = block_config(family, BlockWidth::Narrow, 64, 256);
            let raw = tempfile::tempdir().expect("temp dir");
            write_random_checkpoint(&cfg, 5, raw.path(), 2).expect("write");
            let prepared = tempfile::tempdir().expect("temp dir");
            prepare_checkpoint(&cfg, 5, prepared.path(), 2).expect("prepare");
            let (raw_ckpt, ckpt) = (
                Checkpoint::open(raw.path()).expect("open"),
                Checkpoint::open(prepared.path()).expect("open"),
            );
            let experts = [cfg.n_routed_experts];
            let bias = |c: &Checkpoint, name: &str| c.f32(name, &experts).expect(name);
            let mut zeroed = 0;
            for layer in 0..cfg.n_layers {
                let name = format!("layers.{layer}.ffn.gate.bias");
                if !raw_ckpt.contains(&name) {
                    continue;
                }
                assert!(bias(&raw_ckpt, &name).iter().any(|&b| b != 0.0), "{name}");
                assert!(bias(&ckpt, &name).iter().all(|&b| b == 0.0), "{name}");
                zeroed += cfg.n_routed_experts * 4;
                let vl = format!("layers.{layer}.ffn.gate.bias_vl");
                if raw_ckpt.contains(&vl) {
                    assert_eq!(bias(&raw_ckpt, &vl), bias(&ckpt, &vl), "{vl}");
                }
            }
            assert!(zeroed > 0, "{family:?}: the block has a top-k router");
            let differing: usize = shard_files(raw.path())
                .iter()
                .map(|file| {
                    let a = std::fs::read(raw.path().join(file)).expect("read");
                    let b = std::fs::read(prepared.path().join(file)).expect("read");
                    assert_eq!(a.len(), b.len(), "{file}");
                    a.iter().zip(&b).filter(|(x, y)| x != y).count()
                })
                .sum();
            assert!(
                differing > 0 && differing <= zeroed,
                "{differing} bytes of {zeroed}"
            );
            // A reused checkpoint is balanced again (its biases rewritten by hand here).
            std::fs::copy(
                raw.path().join(INDEX_FILE),
                prepared.path().join(INDEX_FILE),
            )
            .expect("copy");
            for file in shard_files(raw.path()) {
                std::fs::copy(raw.path().join(&file), prepared.path().join(&file)).expect("copy");
            }
            assert_eq!(
                prepare_checkpoint(&cfg, 5, prepared.path(), 2).expect("reuse"),
                Prepared::Reused
            );
            let ckpt = Checkpoint::open(prepared.path()).expect("open");
            for layer in 0..cfg.n_layers {
                let name = format!("layers.{layer}.ffn.gate.bias");
                if ckpt.contains(&name) {
                    assert!(bias(&ckpt, &name).iter().all(|&b| b == 0.0), "{name}");
                }
            }
        }
    }

    fn shard_files(dir: &Path) -> Vec<String> {
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".safetensors"))
            .collect();
        files.sort();
        files
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
