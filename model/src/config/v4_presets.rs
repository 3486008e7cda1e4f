//! Reduced V4 configs for tests and synthetic checkpoints: the v4-tiny golden fixture's config
//! (transformers spelling, float32 storage) and a reduced V4-Flash in the official format (FP8
//! 128×128, FP4 experts, MTP or a DSpark drafter).

use super::{
    DsparkConfig, ExpertDtype, HcConfig, ModelConfig, ModelFamily, QuantConfig, RopeConfig,
    V4_WEIGHT_BLOCK, V4Attention, V4Config, V4Mlp, V4Qat, WeightStorage, YarnConfig,
};

impl ModelConfig {
    /// The v4-tiny fixture's config (spec v4-architecture.md §7.1): 6 layers sliding, sliding,
    /// CSA(4), HCA(8), CSA, HCA; hash MoE on layers 0–2; d 64, 4 heads of 64 (rope 16), q LoRA 32,
    /// 2 output groups of rank 16, 8 experts of 32 top-2, 32 indexer heads of 32 top-4, window 8,
    /// SwiGLU limit 0.15, YaRN 16 over 4096 on the compress rope; float32 storage, no MTP. It
    /// equals the parsed `v4-tiny/config.json`.
    pub fn tiny_v4() -> ModelConfig {
        use V4Attention::{Csa, Hca, Sliding};
        use V4Mlp::{HashMoe, TopkMoe};
        ModelConfig {
            family: ModelFamily::V4,
            vocab_size: 1024,
            dim: 64,
            n_layers: 6,
            n_heads: 4,
            head_dim: 64,
            rope_head_dim: 16,
            q_lora_rank: 32,
            o_lora_rank: 16,
            o_groups: 2,
            moe_inter_dim: 32,
            n_routed_experts: 8,
            n_shared_experts: 1,
            n_activated_experts: 2,
            route_scale: 1.5,
            swiglu_limit: 0.15,
            norm_eps: 1e-6,
            window_size: 8,
            max_position_embeddings: 65536,
            rope: RopeConfig {
                theta: 10000.0,
                compress_theta: 160000.0,
                yarn: Some(YarnConfig {
                    factor: 16.0,
                    original_max_position: 4096,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                }),
            },
            compress_ratios: vec![0, 0, 4, 8, 4, 8],
            kv_source_layers: vec![2, 3, 4, 5],
            index_source_layers: vec![2, 4],
            candidate: None,
            index_n_heads: 32,
            index_head_dim: 32,
            index_topk: 4,
            hc: HcConfig {
                mult: 4,
                sinkhorn_iters: 20,
                eps: 1e-6,
            },
            engram: None,
            dspark: None,
            quant: QuantConfig {
                weight_block: [V4_WEIGHT_BLOCK, V4_WEIGHT_BLOCK],
                expert_dtype: ExpertDtype::Fp8,
            },
            storage: WeightStorage::Float32,
            v4: Some(V4Config {
                attention: vec![Sliding, Sliding, Csa, Hca, Csa, Hca],
                mlp: vec![HashMoe, HashMoe, HashMoe, TopkMoe, TopkMoe, TopkMoe],
                csa_ratio: 4,
                hca_ratio: 8,
                mtp_layers: 0,
                qat: V4Qat::OFFICIAL,
            }),
            bos_token_id: 0,
            eos_token_id: 1,
            pad_token_id: None,
            image_token_id: None,
            vision: None,
        }
    }

    /// A reduced V4-Flash in the official checkpoint format: the real layer kinds and rates
    /// (sliding, sliding, CSA 4, HCA 128, CSA 4; 3 hash layers), one MTP block, FP8 weights with
    /// 128×128 UE8M0 tiles (d 256 and q LoRA 160 give full and partial tiles), FP4 experts
    /// (8 of width 96, top-2), vocabulary 512.
    pub fn reduced_v4() -> ModelConfig {
        use V4Attention::{Csa, Hca, Sliding};
        use V4Mlp::{HashMoe, TopkMoe};
        ModelConfig {
            vocab_size: 512,
            dim: 256,
            n_layers: 5,
            n_heads: 4,
            head_dim: 128,
            rope_head_dim: 32,
            q_lora_rank: 160,
            o_lora_rank: 64,
            moe_inter_dim: 96,
            swiglu_limit: 10.0,
            window_size: 16,
            max_position_embeddings: 4096,
            rope: RopeConfig {
                theta: 10000.0,
                compress_theta: 160000.0,
                yarn: Some(YarnConfig {
                    factor: 16.0,
                    original_max_position: 256,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                }),
            },
            compress_ratios: vec![0, 0, 4, 128, 4],
            kv_source_layers: vec![2, 3, 4],
            index_source_layers: vec![2, 4],
            index_n_heads: 8,
            index_head_dim: 64,
            index_topk: 8,
            quant: QuantConfig {
                weight_block: [V4_WEIGHT_BLOCK, V4_WEIGHT_BLOCK],
                expert_dtype: ExpertDtype::Fp4,
            },
            storage: WeightStorage::Quantized,
            v4: Some(V4Config {
                attention: vec![Sliding, Sliding, Csa, Hca, Csa],
                mlp: vec![HashMoe, HashMoe, HashMoe, TopkMoe, TopkMoe],
                csa_ratio: 4,
                hca_ratio: 128,
                mtp_layers: 1,
                qat: V4Qat::OFFICIAL,
            }),
            ..ModelConfig::tiny_v4()
        }
    }

    /// [`ModelConfig::reduced_v4`] with a V4-Flash-0731-style 3-stage DSpark drafter (block 5,
    /// Markov rank 32, target layers 2–4) instead of the MTP block.
    pub fn reduced_v4_dspark() -> ModelConfig {
        let base = ModelConfig::reduced_v4();
        ModelConfig {
            dspark: Some(DsparkConfig {
                n_stages: 3,
                block_size: 5,
                noise_token_id: 511,
                target_layers: vec![2, 3, 4],
                markov_rank: 32,
                n_routed_experts: base.n_routed_experts,
                n_activated_experts: base.n_activated_experts,
            }),
            v4: base.v4.clone().map(|v4| V4Config {
                mtp_layers: 0,
                ..v4
            }),
            ..base
        }
    }
}
