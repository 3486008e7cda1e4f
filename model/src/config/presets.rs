//! Reduced V4.1 configs for tests, golden fixtures and the demo model (spec §9): Tier A
//! "tiny-logic" (the golden fixture's config) and Tier B "narrow-real" (GPU-kernel geometry).

use super::{
    CandidateConfig, DsparkConfig, EngramConfig, ExpertDtype, HcConfig, ModelConfig, ModelFamily,
    QuantConfig, RopeConfig, VisionConfig, WeightStorage, YarnConfig,
};
use crate::engram::primes::EngramLayout;

impl ModelConfig {
    /// The "Tier A tiny-logic" V4.1 config of spec §9.1, with the golden fixture's one deviation
    /// (`moe_inter_dim` 64): 12 layers `0,0,2,2,2,2,1,1,1,1,1,1`, KV sources 2/4/6, index sources
    /// 2/4/6/8/10, candidate source 6, Engram at 1 and 4 (tables of 660 and 864 rows: the sums of the
    /// primes searched upwards from engram_vocab_size 100), 3 DSpark stages on layers 9–11, a 2-layer ViT. It equals the
    /// parsed `v41-tiny/config.json`.
    pub fn tiny_v41() -> ModelConfig {
        ModelConfig {
            family: ModelFamily::V41,
            vocab_size: 512,
            dim: 256,
            n_layers: 12,
            n_heads: 4,
            head_dim: 64,
            rope_head_dim: 16,
            q_lora_rank: 64,
            o_lora_rank: 64,
            o_groups: 2,
            moe_inter_dim: 64,
            n_routed_experts: 8,
            n_shared_experts: 1,
            n_activated_experts: 2,
            route_scale: 1.5,
            swiglu_limit: 10.0,
            norm_eps: 1e-20,
            window_size: 16,
            max_position_embeddings: 256,
            rope: RopeConfig {
                theta: 10000.0,
                compress_theta: 160000.0,
                yarn: Some(YarnConfig {
                    factor: 4.0,
                    original_max_position: 32,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                }),
            },
            compress_ratios: vec![0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1],
            kv_source_layers: vec![2, 4, 6],
            index_source_layers: vec![2, 4, 6, 8, 10],
            candidate: Some(CandidateConfig {
                source_layer: 6,
                topk_blocks: 3,
                block_size: 4,
            }),
            index_n_heads: 4,
            index_head_dim: 64,
            index_topk: 8,
            hc: HcConfig {
                mult: 4,
                sinkhorn_iters: 20,
                eps: 1e-6,
            },
            engram: Some(EngramConfig {
                layer_ids: vec![1, 4],
                num_embeddings: vec![660, 864],
                max_ngram_size: 4,
                vocab_size: 100,
                n_heads: 2,
                head_dim: 32,
                pad_token_id: 2,
                compressed_vocab_size: 256,
            }),
            dspark: Some(DsparkConfig {
                n_stages: 3,
                block_size: 5,
                noise_token_id: 511,
                target_layers: vec![9, 10, 11],
                markov_rank: 32,
                n_routed_experts: 4,
                n_activated_experts: 3,
            }),
            quant: QuantConfig {
                weight_block: [32, 32],
                expert_dtype: ExpertDtype::Fp4,
            },
            storage: WeightStorage::Quantized,
            v4: None,
            bos_token_id: 0,
            eos_token_id: 1,
            pad_token_id: Some(2),
            image_token_id: Some(500),
            vision: Some(VisionConfig {
                n_layers: 2,
                dim: 64,
                n_heads: 4,
                inter_dim: 96,
                patch_size: 14,
                rope_theta: 10000.0,
                downsample_ratio: 3,
                max_image_tokens: 40,
                min_pixels: 784,
                max_wh_ratio: None,
            }),
        }
    }

    /// The "Tier B narrow-real" V4.1 config of spec §9.2: the 12-layer schedule of
    /// [`ModelConfig::tiny_v41`] with the per-head geometry GPU kernels specialise on (head_dim 512,
    /// rope 64, index_head_dim 128, window 128, candidate block 8, Engram rows of 256 with 24 hash
    /// columns) and the rest shrunk (dim 1024, 8 heads in 8 output groups, q_lora 256, o_lora 128,
    /// 16 experts of width 256 top-6, DSpark 8 experts top-3, 8 index heads, top-64, 16 candidate
    /// blocks). Vocabulary, special ids and the 2-layer ViT are those of `tiny_v41`; the Engram
    /// table sizes are derived from the primes above 100.
    pub fn narrow_v41() -> ModelConfig {
        let tiny = ModelConfig::tiny_v41();
        let engram_heads = 8;
        let layout = EngramLayout::compute(2, 4, engram_heads, 100);
        ModelConfig {
            dim: 1024,
            n_heads: 8,
            head_dim: 512,
            rope_head_dim: 64,
            q_lora_rank: 256,
            o_lora_rank: 128,
            o_groups: 8,
            moe_inter_dim: 256,
            n_routed_experts: 16,
            n_activated_experts: 6,
            window_size: 128,
            max_position_embeddings: 4096,
            rope: RopeConfig {
                yarn: Some(YarnConfig {
                    factor: 4.0,
                    original_max_position: 1024,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                }),
                ..tiny.rope.clone()
            },
            candidate: Some(CandidateConfig {
                source_layer: 6,
                topk_blocks: 16,
                block_size: 8,
            }),
            index_n_heads: 8,
            index_head_dim: 128,
            index_topk: 64,
            engram: tiny.engram.clone().map(|engram| EngramConfig {
                num_embeddings: layout.num_embeddings(),
                n_heads: engram_heads,
                head_dim: 256,
                ..engram
            }),
            dspark: tiny.dspark.clone().map(|dspark| DsparkConfig {
                n_routed_experts: 8,
                markov_rank: 64,
                ..dspark
            }),
            ..tiny
        }
    }
}
