//! The tensor inventory of a DeepSeek-V4 checkpoint (spec v4-architecture.md §5.2, §4.1, §4.2):
//! every tensor under its official name, with its storage kind and shape, derived from a V4
//! [`ModelConfig`]. Backbone layers carry the two mHC sites, attention (sliding / CSA with the
//! overlapping compressor and the indexer / HCA), and a hash-routed (`tid2eid`) or top-k (`bias`)
//! MoE; then the final norm, head and hyper-head; then the `mtp.*` namespace (plain MTP blocks or
//! the DSpark drafter).
//!
//! Storage follows [`ModelConfig::storage`]: `Quantized` lists the official dtypes (FP8 tiles for
//! dense projections, FP4/FP8 experts, BF16 norms/compressors/router/embeddings, F32 mHC/sinks/
//! position biases/router bias, I64 `tid2eid`); `Float32` lists every floating tensor as F32 (a
//! transformers save, the v4-tiny fixture); `Bfloat16` lists projections and norms as BF16 and keeps
//! the F32 tensors.

use crate::config::{ExpertDtype, ModelConfig, ModelFamily, V4Attention, V4Mlp, WeightStorage};

use super::inventory::{EMBED_STD, Init, TensorKind, TensorSpec, VECTOR_STD, projection_std};
use super::v41_inventory;

/// The inventory of `cfg`'s family: [`v41_inventory`] or [`v4_inventory`].
pub fn inventory_for(cfg: &ModelConfig) -> Vec<TensorSpec> {
    match cfg.family {
        ModelFamily::V41 => v41_inventory(cfg),
        ModelFamily::V4 => v4_inventory(cfg),
    }
}

/// Builds the list, choosing each tensor's kind from the storage format.
struct V4Inventory<'a> {
    cfg: &'a ModelConfig,
    specs: Vec<TensorSpec>,
}

impl V4Inventory<'_> {
    fn push(&mut self, name: String, kind: TensorKind) {
        self.specs.push(TensorSpec { name, kind });
    }

    /// A plain floating tensor that the official format stores as BF16.
    fn bf16_like(&mut self, name: String, shape: Vec<usize>, init: Init) {
        let kind = match self.cfg.storage {
            WeightStorage::Float32 => TensorKind::F32 { shape, init },
            WeightStorage::Quantized | WeightStorage::Bfloat16 => TensorKind::Bf16 { shape, init },
        };
        self.push(name, kind);
    }

    /// A tensor every format stores as F32 (mHC, sinks, position biases, router bias).
    fn f32_tensor(&mut self, name: String, shape: Vec<usize>, std: f32) {
        self.push(name, TensorKind::f32_normal(shape, std));
    }

    fn norm(&mut self, prefix: &str, width: usize, mean: f32) {
        self.bf16_like(
            format!("{prefix}.weight"),
            vec![width],
            Init::NormWeight { mean },
        );
    }

    /// A projection `<prefix>.weight` the official format stores in BF16.
    fn bf16_projection(&mut self, prefix: &str, out: usize, inp: usize) {
        let std = projection_std(prefix, inp);
        self.bf16_like(
            format!("{prefix}.weight"),
            vec![out, inp],
            Init::Normal { std },
        );
    }

    /// A dense projection the official format stores as FP8 with square tiles.
    fn fp8_projection(&mut self, prefix: &str, out: usize, inp: usize) {
        if self.cfg.storage == WeightStorage::Quantized {
            let block = self.cfg.quant.weight_block[0];
            self.push(prefix.to_string(), TensorKind::Fp8Tiled { out, inp, block });
        } else {
            self.bf16_projection(prefix, out, inp);
        }
    }

    /// A routed-expert projection (FP4 or FP8 per `expert_dtype` in the official format).
    fn expert_projection(&mut self, prefix: &str, out: usize, inp: usize) {
        match (self.cfg.storage, self.cfg.quant.expert_dtype) {
            (WeightStorage::Quantized, ExpertDtype::Fp4) => {
                self.push(prefix.to_string(), TensorKind::Fp4 { out, inp });
            }
            _ => self.fp8_projection(prefix, out, inp),
        }
    }

    /// The three tensors of a hyper-connection site or head: `<stem>fn`, `<stem>base`, `<stem>scale`.
    fn hyper(&mut self, stem: &str, rows: usize, scales: usize) {
        let fan_in = self.cfg.hc.mult * self.cfg.dim;
        self.f32_tensor(
            format!("{stem}fn"),
            vec![rows, fan_in],
            projection_std("hc_fn", fan_in),
        );
        self.f32_tensor(format!("{stem}base"), vec![rows], VECTOR_STD);
        self.f32_tensor(format!("{stem}scale"), vec![scales], VECTOR_STD);
    }

    /// The learned final collapse `<p>hc_head_{fn,base,scale}`.
    fn hyper_head(&mut self, prefix: &str) {
        self.hyper(&format!("{prefix}hc_head_"), self.cfg.hc.mult, 1);
    }

    /// One decoder block (backbone layer, MTP block or DSpark stage) under `prefix` (`layers.3.`).
    fn block(&mut self, prefix: &str, attention: V4Attention, mlp: V4Mlp, n_experts: usize) {
        let cfg = self.cfg;
        let dim = cfg.dim;
        let hc = cfg.hc.mult;
        let inner = cfg.n_heads * cfg.head_dim;
        let grouped = cfg.o_groups * cfg.o_lora_rank;
        let inter = cfg.moe_inter_dim;
        let shared = cfg.moe_inter_dim * cfg.n_shared_experts;

        self.norm(&format!("{prefix}attn_norm"), dim, 0.025);
        self.norm(&format!("{prefix}ffn_norm"), dim, 0.2);
        for site in ["attn", "ffn"] {
            self.hyper(&format!("{prefix}hc_{site}_"), (2 + hc) * hc, 3);
        }
        self.f32_tensor(
            format!("{prefix}attn.attn_sink"),
            vec![cfg.n_heads],
            VECTOR_STD,
        );
        self.norm(&format!("{prefix}attn.q_norm"), cfg.q_lora_rank, 0.97);
        self.norm(&format!("{prefix}attn.kv_norm"), cfg.head_dim, 0.4);
        self.fp8_projection(&format!("{prefix}attn.wq_a"), cfg.q_lora_rank, dim);
        self.fp8_projection(&format!("{prefix}attn.wq_b"), inner, cfg.q_lora_rank);
        self.fp8_projection(&format!("{prefix}attn.wkv"), cfg.head_dim, dim);
        self.fp8_projection(&format!("{prefix}attn.wo_a"), grouped, inner / cfg.o_groups);
        self.fp8_projection(&format!("{prefix}attn.wo_b"), dim, grouped);
        self.compressed_attention(prefix, attention);

        self.bf16_projection(&format!("{prefix}ffn.gate"), n_experts, dim);
        match mlp {
            V4Mlp::HashMoe => self.push(
                format!("{prefix}ffn.gate.tid2eid"),
                TensorKind::ExpertTable {
                    rows: cfg.vocab_size,
                    k: cfg.n_activated_experts,
                    n_experts,
                },
            ),
            V4Mlp::TopkMoe => self.f32_tensor(
                format!("{prefix}ffn.gate.bias"),
                vec![n_experts],
                VECTOR_STD,
            ),
        }
        for expert in 0..n_experts {
            let p = format!("{prefix}ffn.experts.{expert}");
            self.expert_projection(&format!("{p}.w1"), inter, dim);
            self.expert_projection(&format!("{p}.w2"), dim, inter);
            self.expert_projection(&format!("{p}.w3"), inter, dim);
        }
        self.fp8_projection(&format!("{prefix}ffn.shared_experts.w1"), shared, dim);
        self.fp8_projection(&format!("{prefix}ffn.shared_experts.w2"), dim, shared);
        self.fp8_projection(&format!("{prefix}ffn.shared_experts.w3"), shared, dim);
    }

    /// The decoder block of an `mtp.*` layer, plain MTP block or DSpark stage alike: sliding
    /// attention and a top-k MoE over `n_experts` routed experts.
    fn speculative_block(&mut self, prefix: &str, n_experts: usize) {
        self.block(prefix, V4Attention::Sliding, V4Mlp::TopkMoe, n_experts);
    }

    /// The compressor of a CSA/HCA layer (CSA: two overlapping series, so twice the width) and the
    /// CSA indexer with its own compressor.
    fn compressed_attention(&mut self, prefix: &str, attention: V4Attention) {
        let cfg = self.cfg;
        let Some(v4) = &cfg.v4 else { return };
        let (ratio, series) = match attention {
            V4Attention::Sliding => return,
            V4Attention::Csa => (v4.csa_ratio, 2),
            V4Attention::Hca => (v4.hca_ratio, 1),
        };
        let dim = cfg.dim;
        let width = series * cfg.head_dim;
        let c = format!("{prefix}attn.compressor");
        self.bf16_projection(&format!("{c}.wkv"), width, dim);
        self.bf16_projection(&format!("{c}.wgate"), width, dim);
        self.f32_tensor(format!("{c}.ape"), vec![ratio, width], VECTOR_STD);
        self.norm(&format!("{c}.norm"), cfg.head_dim, 0.6);
        if attention != V4Attention::Csa {
            return;
        }
        let i = format!("{prefix}attn.indexer");
        self.fp8_projection(
            &format!("{i}.wq_b"),
            cfg.index_n_heads * cfg.index_head_dim,
            cfg.q_lora_rank,
        );
        self.bf16_projection(&format!("{i}.weights_proj"), cfg.index_n_heads, dim);
        let index_width = 2 * cfg.index_head_dim;
        self.bf16_projection(&format!("{i}.compressor.wkv"), index_width, dim);
        self.bf16_projection(&format!("{i}.compressor.wgate"), index_width, dim);
        self.f32_tensor(
            format!("{i}.compressor.ape"),
            vec![ratio, index_width],
            VECTOR_STD,
        );
        self.norm(&format!("{i}.compressor.norm"), cfg.index_head_dim, 0.5);
    }
}

/// Every tensor of a V4 checkpoint for `cfg` (official names), in model order: embedding,
/// backbone layers, final norm, head, hyper-head, then `mtp.*`. Returns an empty list for a V4.1
/// config.
pub fn v4_inventory(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let Some(v4) = &cfg.v4 else {
        return Vec::new();
    };
    let mut inv = V4Inventory {
        cfg,
        specs: Vec::new(),
    };
    let dim = cfg.dim;
    inv.bf16_like(
        "embed.weight".into(),
        vec![cfg.vocab_size, dim],
        Init::Normal { std: EMBED_STD },
    );
    for layer in 0..cfg.n_layers {
        inv.block(
            &format!("layers.{layer}."),
            v4.attention[layer],
            v4.mlp[layer],
            cfg.n_routed_experts,
        );
    }
    inv.norm("norm", dim, 1.0);
    inv.bf16_projection("head", cfg.vocab_size, dim);
    inv.hyper_head("");
    // V4-Flash MTP blocks (§4.1): a sliding top-k block plus embedding/hidden projections.
    for block in 0..v4.mtp_layers {
        let prefix = format!("mtp.{block}.");
        inv.speculative_block(&prefix, cfg.n_routed_experts);
        inv.fp8_projection(&format!("{prefix}e_proj"), dim, dim);
        inv.fp8_projection(&format!("{prefix}h_proj"), dim, dim);
        for norm in ["enorm", "hnorm", "norm"] {
            inv.norm(&format!("{prefix}{norm}"), dim, 1.0);
        }
        inv.hyper_head(&prefix);
    }
    // V4-Flash-0731 DSpark drafter (§4.2).
    if let Some(dspark) = &cfg.dspark {
        for stage in 0..dspark.n_stages {
            let prefix = format!("mtp.{stage}.");
            inv.speculative_block(&prefix, dspark.n_routed_experts);
            if stage == 0 {
                inv.fp8_projection(
                    &format!("{prefix}main_proj"),
                    dim,
                    dspark.target_layers.len() * dim,
                );
                inv.norm(&format!("{prefix}main_norm"), dim, 1.0);
            }
            if stage + 1 == dspark.n_stages {
                inv.norm(&format!("{prefix}norm"), dim, 1.0);
                inv.hyper_head(&prefix);
                let rank = dspark.markov_rank;
                inv.bf16_like(
                    format!("{prefix}markov_head.markov_w1.weight"),
                    vec![cfg.vocab_size, rank],
                    Init::Normal { std: EMBED_STD },
                );
                inv.bf16_projection(
                    &format!("{prefix}markov_head.markov_w2"),
                    cfg.vocab_size,
                    rank,
                );
                inv.bf16_projection(&format!("{prefix}confidence_head.proj"), 1, dim + rank);
            }
        }
    }
    inv.specs
}
