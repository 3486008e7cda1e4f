//! The V4.1 parameters in the form the forward pass consumes, read from a [`Checkpoint`] with every
//! name, dtype and shape checked (spec §6.2). Quantised projections stay FP8/FP4; `wo_a` is
//! dequantised to bf16 as the reference does at load time; fp32-promoted weights stay bf16-exact f32.

use crate::backend::HcParams;
use crate::backend::weights::{ExpertLinear, ExpertWeights};
use crate::checkpoint::{Checkpoint, ExpertFilter};
use crate::config::{ExpertDtype, ModelConfig};
use crate::error::ModelError;
use crate::layers::moe::MoeWeights;
use crate::weights::Fp8Weight;

/// The ratio-2 pooling compressor or the ratio-1 projection of a KV-source layer.
#[derive(Debug, Clone)]
pub struct CompressorWeights {
    pub ratio: usize,
    /// `[head_dim, dim]`.
    pub wkv: Vec<f32>,
    /// `[head_dim, dim]`, ratio > 1 only.
    pub wgate: Option<Vec<f32>>,
    /// `[head_dim]`.
    pub norm: Vec<f32>,
    /// `indexer.wk` `[index_head_dim, head_dim]`.
    pub index_wk: Vec<f32>,
    /// `indexer.k_norm` `[index_head_dim]`.
    pub index_k_norm: Vec<f32>,
}

/// The query side of an index source.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    pub wq_b: Fp8Weight,
    /// `[index_n_heads, dim]`.
    pub weights_proj: Vec<f32>,
}

/// Attention of one block (FP8 projections).
pub type AttentionWeights =
    crate::layers::weights::AttentionWeights<Fp8Weight, CompressorWeights, IndexerWeights>;

/// One block (backbone layer or DSpark stage).
pub type BlockWeights = crate::layers::weights::BlockWeights<AttentionWeights>;

/// The DSpark drafter's extra tensors (spec §3.10); V4.1 has no learned collapse.
pub type DsparkWeights = crate::layers::markov::DsparkWeights<BlockWeights, Fp8Weight, ()>;

fn hc_params(
    ckpt: &Checkpoint,
    prefix: &str,
    site: &str,
    cfg: &ModelConfig,
) -> Result<HcParams, ModelError> {
    let hc = cfg.hc.mult;
    let mix = (2 + hc) * hc;
    Ok(HcParams {
        proj: ckpt.f32(&format!("{prefix}hc_{site}_fn"), &[mix, hc * cfg.dim])?,
        base: ckpt.f32(&format!("{prefix}hc_{site}_base"), &[mix])?,
        scale: ckpt.f32(&format!("{prefix}hc_{site}_scale"), &[3])?,
    })
}

fn expert_linear(
    ckpt: &Checkpoint,
    prefix: &str,
    out: usize,
    inp: usize,
    dtype: ExpertDtype,
) -> Result<ExpertLinear, ModelError> {
    Ok(match dtype {
        ExpertDtype::Fp4 => ExpertLinear::Fp4(ckpt.fp4_weight(prefix, out, inp)?),
        ExpertDtype::Fp8 => ExpertLinear::Fp8(ckpt.fp8_weight(prefix, out, inp)?),
    })
}

/// Routed expert `expert` of the block at `prefix` (`layers.{l}.` or `mtp.{s}.`).
pub(crate) fn routed_expert(
    ckpt: &Checkpoint,
    prefix: &str,
    cfg: &ModelConfig,
    expert: usize,
) -> Result<ExpertWeights<ExpertLinear>, ModelError> {
    let (dim, inter, dtype) = (cfg.dim, cfg.moe_inter_dim, cfg.quant.expert_dtype);
    let p = format!("{prefix}ffn.experts.{expert}.");
    Ok(ExpertWeights {
        w1: expert_linear(ckpt, &format!("{p}w1"), inter, dim, dtype)?,
        w2: expert_linear(ckpt, &format!("{p}w2"), dim, inter, dtype)?,
        w3: expert_linear(ckpt, &format!("{p}w3"), inter, dim, dtype)?,
    })
}

/// The MoE of a block; `keeps(e)` says which routed experts are read (the others stay in the
/// checkpoint).
fn moe(
    ckpt: &Checkpoint,
    prefix: &str,
    cfg: &ModelConfig,
    (n_experts, n_activated): (usize, usize),
    keeps: impl Fn(usize) -> bool,
) -> Result<MoeWeights, ModelError> {
    let (dim, inter) = (cfg.dim, cfg.moe_inter_dim);
    let ids: Vec<usize> = (0..n_experts).filter(|&e| keeps(e)).collect();
    let experts = ids
        .iter()
        .map(|&e| routed_expert(ckpt, prefix, cfg, e))
        .collect::<Result<Vec<_>, ModelError>>()?;
    let shared = format!("{prefix}ffn.shared_experts.");
    Ok(MoeWeights {
        gate: ckpt.bf16(&format!("{prefix}ffn.gate.weight"), &[n_experts, dim])?,
        bias: ckpt.f32(&format!("{prefix}ffn.gate.bias"), &[n_experts])?,
        n_activated,
        experts,
        held: (ids.len() < n_experts).then_some(ids),
        shared: ExpertWeights {
            w1: ExpertLinear::Fp8(ckpt.fp8_weight(&format!("{shared}w1"), inter, dim)?),
            w2: ExpertLinear::Fp8(ckpt.fp8_weight(&format!("{shared}w2"), dim, inter)?),
            w3: ExpertLinear::Fp8(ckpt.fp8_weight(&format!("{shared}w3"), inter, dim)?),
        },
        tid2eid: None,
    })
}

/// Loads block `layer` (a backbone layer, its routed experts those `filter` keeps) or a DSpark
/// stage (`prefix` = `mtp.{s}.`, `layer` = None, every expert).
pub fn load_block(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    prefix: &str,
    layer: Option<usize>,
    filter: &ExpertFilter,
) -> Result<BlockWeights, ModelError> {
    let (dim, heads, head_dim) = (cfg.dim, cfg.n_heads, cfg.head_dim);
    let a = format!("{prefix}attn.");
    let group_width = heads * head_dim / cfg.o_groups;
    let wo_a = ckpt
        .fp8_weight(
            &format!("{a}wo_a"),
            cfg.o_groups * cfg.o_lora_rank,
            group_width,
        )?
        .to_f32();
    let ratio = layer.map_or(0, |l| cfg.compress_ratio(l));
    let compressor = match layer {
        Some(l) if cfg.is_kv_source(l) && ratio > 0 => {
            let c = format!("{a}compressor.");
            Some(CompressorWeights {
                ratio,
                wkv: ckpt.bf16(&format!("{c}wkv.weight"), &[head_dim, dim])?,
                wgate: if ratio > 1 {
                    Some(ckpt.bf16(&format!("{c}wgate.weight"), &[head_dim, dim])?)
                } else {
                    None
                },
                norm: ckpt.bf16(&format!("{c}norm.weight"), &[head_dim])?,
                index_wk: ckpt.bf16(
                    &format!("{a}indexer.wk.weight"),
                    &[cfg.index_head_dim, head_dim],
                )?,
                index_k_norm: ckpt
                    .bf16(&format!("{a}indexer.k_norm.weight"), &[cfg.index_head_dim])?,
            })
        }
        _ => None,
    };
    let indexer = match layer {
        Some(l) if cfg.is_index_source(l) && ratio > 0 => Some(IndexerWeights {
            wq_b: ckpt.fp8_weight(
                &format!("{a}indexer.wq_b"),
                cfg.index_n_heads * cfg.index_head_dim,
                cfg.q_lora_rank,
            )?,
            weights_proj: ckpt.bf16(
                &format!("{a}indexer.weights_proj.weight"),
                &[cfg.index_n_heads, dim],
            )?,
        }),
        _ => None,
    };
    let attn = AttentionWeights {
        wq_a: ckpt.fp8_weight(&format!("{a}wq_a"), cfg.q_lora_rank, dim)?,
        q_norm: ckpt.bf16(&format!("{a}q_norm.weight"), &[cfg.q_lora_rank])?,
        wq_b: ckpt.fp8_weight(&format!("{a}wq_b"), heads * head_dim, cfg.q_lora_rank)?,
        wkv: ckpt.fp8_weight(&format!("{a}wkv"), head_dim, dim)?,
        kv_norm: ckpt.bf16(&format!("{a}kv_norm.weight"), &[head_dim])?,
        wo_a,
        wo_b: ckpt.fp8_weight(&format!("{a}wo_b"), dim, cfg.o_groups * cfg.o_lora_rank)?,
        sink: ckpt.f32(&format!("{a}attn_sink"), &[heads])?,
        compressor,
        indexer,
    };
    let (n_experts, n_activated) = match (layer, &cfg.dspark) {
        (None, Some(d)) => (d.n_routed_experts, d.n_activated_experts),
        _ => (cfg.n_routed_experts, cfg.n_activated_experts),
    };
    Ok(BlockWeights {
        attn_norm: ckpt.bf16(&format!("{prefix}attn_norm.weight"), &[dim])?,
        ffn_norm: ckpt.bf16(&format!("{prefix}ffn_norm.weight"), &[dim])?,
        hc_attn: hc_params(ckpt, prefix, "attn", cfg)?,
        hc_ffn: hc_params(ckpt, prefix, "ffn", cfg)?,
        attn,
        moe: moe(ckpt, prefix, cfg, (n_experts, n_activated), |e| {
            layer.is_none_or(|l| filter.keeps(l, e))
        })?,
    })
}

/// Loads the DSpark stages and heads, if the config has a drafter.
pub fn load_dspark(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
) -> Result<Option<DsparkWeights>, ModelError> {
    let Some(dspark) = &cfg.dspark else {
        return Ok(None);
    };
    if dspark.n_stages == 0 {
        return Ok(None);
    }
    let stages = (0..dspark.n_stages)
        .map(|s| load_block(ckpt, cfg, &format!("mtp.{s}."), None, &ExpertFilter::all()))
        .collect::<Result<Vec<_>, ModelError>>()?;
    let last = format!("mtp.{}.", dspark.n_stages - 1);
    let (dim, vocab, rank) = (cfg.dim, cfg.vocab_size, dspark.markov_rank);
    Ok(Some(DsparkWeights {
        stages,
        main_proj: ckpt.fp8_weight("mtp.0.main_proj", dim, dim * dspark.target_layers.len())?,
        main_norm: ckpt.bf16("mtp.0.main_norm.weight", &[dim])?,
        norm: ckpt.bf16(&format!("{last}norm.weight"), &[dim])?,
        hyper_head: (),
        markov_embed: ckpt.bf16(&format!("{last}markov_head.embed.weight"), &[vocab, rank])?,
        markov_head: ckpt.bf16(&format!("{last}markov_head.head.weight"), &[vocab, rank])?,
        confidence: ckpt.bf16(
            &format!("{last}confidence_head.proj.weight"),
            &[1, dim + rank],
        )?,
    }))
}
