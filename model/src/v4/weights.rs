//! The V4 parameters in the form the forward pass consumes, read through the one checkpoint loader
//! by their official names (transformers-saved files are re-keyed by `checkpoint::names`). Every
//! projection is read in whatever format it is stored (FP8 tiles, packed FP4, BF16/F32,
//! [`Checkpoint::linear`]) and kept in that format; every product dequantises the weight exactly and
//! leaves the activations unquantised (the transformers float32 numerics of V4). Only `wo_a`, used
//! group by group, is dequantised at load.

use crate::backend::HcParams;
use crate::backend::weights::{ExpertLinear, ExpertWeights, Linear};
use crate::checkpoint::{Checkpoint, ExpertFilter, StoredLinear};
use crate::config::{ModelConfig, V4Attention, V4Mlp};
use crate::error::ModelError;
use crate::layers::moe::MoeWeights;

impl From<StoredLinear> for Linear {
    fn from(stored: StoredLinear) -> Linear {
        match stored {
            StoredLinear::Dense { out, inp, values } => Linear::Dense { out, inp, values },
            StoredLinear::Fp8(w) => Linear::Fp8(w),
            StoredLinear::Fp4(w) => Linear::Fp4(w),
        }
    }
}

/// The gated pooling compressor of a CSA layer (two overlapping series, `series = 2`), an HCA
/// layer (`series = 1`) or a CSA indexer (two series at the index width).
#[derive(Debug, Clone)]
pub struct CompressorWeights {
    /// Tokens per entry (m).
    pub ratio: usize,
    /// Whether each entry also pools the previous window (the CSA "A" series).
    pub overlapping: bool,
    /// Width of one entry.
    pub width: usize,
    /// `[series · width, dim]`.
    pub wkv: Linear,
    /// `[series · width, dim]`.
    pub wgate: Linear,
    /// Position bias `[ratio, series · width]`.
    pub ape: Vec<f32>,
    /// `[width]`.
    pub norm: Vec<f32>,
}

impl CompressorWeights {
    /// Number of series (2 for an overlapping compressor).
    pub fn series(&self) -> usize {
        if self.overlapping { 2 } else { 1 }
    }
}

/// The Lightning Indexer of a CSA layer: query projection, per-head weights, key compressor.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    /// `[index_n_heads · index_head_dim, q_lora_rank]`.
    pub wq_b: Linear,
    /// `[index_n_heads, dim]`.
    pub weights_proj: Linear,
    pub compressor: CompressorWeights,
}

/// Attention of one layer (any stored projection format).
pub type AttentionWeights =
    crate::layers::weights::AttentionWeights<Linear, CompressorWeights, IndexerWeights>;

/// One block (a backbone layer, the MTP block or a DSpark stage).
pub type LayerWeights = crate::layers::weights::BlockWeights<AttentionWeights>;

/// The learned final collapse `hc_head_{fn,base,scale}`.
#[derive(Debug, Clone)]
pub struct HyperHeadWeights {
    /// `[hc, hc · dim]`.
    pub proj: Vec<f32>,
    /// `[hc]`.
    pub base: Vec<f32>,
    /// `[1]`.
    pub scale: Vec<f32>,
}

/// Reads the V4 tensors of one model.
pub(crate) struct Loader<'a> {
    pub ckpt: &'a Checkpoint,
    pub cfg: &'a ModelConfig,
}

impl Loader<'_> {
    /// A projection `<prefix>.weight` `[out, inp]` in any stored format.
    pub fn linear(&self, prefix: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
        Ok(self.stored(prefix, out, inp)?.into())
    }

    fn stored(&self, prefix: &str, out: usize, inp: usize) -> Result<StoredLinear, ModelError> {
        let block = self.cfg.quant.weight_block[0];
        self.ckpt.linear(prefix, out, inp, block)
    }

    /// A BF16 or F32 vector/matrix.
    pub fn vector(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.ckpt.bf16_or_f32(name, shape)
    }

    fn hc(&self, stem: &str, rows: usize, scales: usize) -> Result<HcParams, ModelError> {
        let width = self.cfg.hc.mult * self.cfg.dim;
        Ok(HcParams {
            proj: self.ckpt.f32(&format!("{stem}fn"), &[rows, width])?,
            base: self.ckpt.f32(&format!("{stem}base"), &[rows])?,
            scale: self.ckpt.f32(&format!("{stem}scale"), &[scales])?,
        })
    }

    /// `hc_head_{fn,base,scale}` under `prefix`.
    pub fn hyper_head(&self, prefix: &str) -> Result<HyperHeadWeights, ModelError> {
        let hc = self.hc(&format!("{prefix}hc_head_"), self.cfg.hc.mult, 1)?;
        Ok(HyperHeadWeights {
            proj: hc.proj,
            base: hc.base,
            scale: hc.scale,
        })
    }

    fn compressor(
        &self,
        prefix: &str,
        ratio: usize,
        overlapping: bool,
        width: usize,
    ) -> Result<CompressorWeights, ModelError> {
        let dim = self.cfg.dim;
        let series = if overlapping { 2 } else { 1 };
        Ok(CompressorWeights {
            ratio,
            overlapping,
            width,
            wkv: self.linear(&format!("{prefix}wkv"), series * width, dim)?,
            wgate: self.linear(&format!("{prefix}wgate"), series * width, dim)?,
            ape: self
                .ckpt
                .f32(&format!("{prefix}ape"), &[ratio, series * width])?,
            norm: self.vector(&format!("{prefix}norm.weight"), &[width])?,
        })
    }

    /// The attention of the block under `prefix` (`layers.3.`, `mtp.0.`).
    fn attention(&self, prefix: &str, kind: V4Attention) -> Result<AttentionWeights, ModelError> {
        let cfg = self.cfg;
        let (dim, heads, head_dim) = (cfg.dim, cfg.n_heads, cfg.head_dim);
        let a = format!("{prefix}attn.");
        let v4 = cfg.v4.as_ref().ok_or_else(|| ModelError::Unsupported {
            what: "a V4 layer in a config without the V4 schedule".to_string(),
        })?;
        let compressor = match kind {
            V4Attention::Sliding => None,
            V4Attention::Csa => {
                Some(self.compressor(&format!("{a}compressor."), v4.csa_ratio, true, head_dim)?)
            }
            V4Attention::Hca => {
                Some(self.compressor(&format!("{a}compressor."), v4.hca_ratio, false, head_dim)?)
            }
        };
        let indexer = match kind {
            V4Attention::Csa => {
                let i = format!("{a}indexer.");
                Some(IndexerWeights {
                    wq_b: self.linear(
                        &format!("{i}wq_b"),
                        cfg.index_n_heads * cfg.index_head_dim,
                        cfg.q_lora_rank,
                    )?,
                    weights_proj: self.linear(
                        &format!("{i}weights_proj"),
                        cfg.index_n_heads,
                        dim,
                    )?,
                    compressor: self.compressor(
                        &format!("{i}compressor."),
                        v4.csa_ratio,
                        true,
                        cfg.index_head_dim,
                    )?,
                })
            }
            _ => None,
        };
        let inner = heads * head_dim;
        let grouped = cfg.o_groups * cfg.o_lora_rank;
        Ok(AttentionWeights {
            wq_a: self.linear(&format!("{a}wq_a"), cfg.q_lora_rank, dim)?,
            q_norm: self.vector(&format!("{a}q_norm.weight"), &[cfg.q_lora_rank])?,
            wq_b: self.linear(&format!("{a}wq_b"), inner, cfg.q_lora_rank)?,
            wkv: self.linear(&format!("{a}wkv"), head_dim, dim)?,
            kv_norm: self.vector(&format!("{a}kv_norm.weight"), &[head_dim])?,
            wo_a: self
                .stored(&format!("{a}wo_a"), grouped, inner / cfg.o_groups)?
                .to_f32(),
            wo_b: self.linear(&format!("{a}wo_b"), dim, grouped)?,
            sink: self.ckpt.f32(&format!("{a}attn_sink"), &[heads])?,
            compressor,
            indexer,
        })
    }

    fn expert(
        &self,
        prefix: &str,
        inter: usize,
    ) -> Result<ExpertWeights<ExpertLinear>, ModelError> {
        let dim = self.cfg.dim;
        let dense = |name: &str, out, inp| -> Result<ExpertLinear, ModelError> {
            Ok(ExpertLinear::Exact(self.linear(
                &format!("{prefix}{name}"),
                out,
                inp,
            )?))
        };
        Ok(ExpertWeights {
            w1: dense("w1", inter, dim)?,
            w2: dense("w2", dim, inter)?,
            w3: dense("w3", inter, dim)?,
        })
    }

    /// The `tid2eid` table of a hash layer, every entry checked to name an expert.
    fn tid2eid(&self, name: &str) -> Result<Vec<usize>, ModelError> {
        let cfg = self.cfg;
        let k = cfg.n_activated_experts;
        let table = self.ckpt.i64(name, &[cfg.vocab_size, k])?;
        table
            .iter()
            .enumerate()
            .map(|(i, &e)| {
                usize::try_from(e)
                    .ok()
                    .filter(|&e| e < cfg.n_routed_experts)
                    .ok_or_else(|| ModelError::Checkpoint {
                        file: self.ckpt.dir().to_path_buf(),
                        tensor: name.to_string(),
                        message: format!(
                            "token {} slot {}: expert {e} is outside 0..{}",
                            i / k,
                            i % k,
                            cfg.n_routed_experts
                        ),
                    })
            })
            .collect()
    }

    /// Routed expert `expert` of backbone layer `layer`.
    pub fn routed_expert(
        &self,
        layer: usize,
        expert: usize,
    ) -> Result<ExpertWeights<ExpertLinear>, ModelError> {
        let prefix = format!("layers.{layer}.ffn.experts.{expert}.");
        self.expert(&prefix, self.cfg.moe_inter_dim)
    }

    /// The MoE of the block under `prefix` over `n_experts` routed experts, `n_activated` per
    /// token (hash layers: the backbone's `n_activated_experts`, the width of `tid2eid`); only
    /// the routed experts `keeps(e)` are read (the others stay in the checkpoint).
    fn moe(
        &self,
        prefix: &str,
        kind: V4Mlp,
        (n_experts, n_activated): (usize, usize),
        keeps: &dyn Fn(usize) -> bool,
    ) -> Result<MoeWeights, ModelError> {
        let cfg = self.cfg;
        let p = format!("{prefix}ffn.");
        let (bias, tid2eid) = match kind {
            V4Mlp::TopkMoe => (self.ckpt.f32(&format!("{p}gate.bias"), &[n_experts])?, None),
            V4Mlp::HashMoe => (
                vec![0.0; n_experts],
                Some(self.tid2eid(&format!("{p}gate.tid2eid"))?),
            ),
        };
        let ids: Vec<usize> = (0..n_experts).filter(|&e| keeps(e)).collect();
        let experts = ids
            .iter()
            .map(|e| self.expert(&format!("{p}experts.{e}."), cfg.moe_inter_dim))
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(MoeWeights {
            gate: self.vector(&format!("{p}gate.weight"), &[n_experts, cfg.dim])?,
            bias,
            n_activated,
            experts,
            held: (ids.len() < n_experts).then_some(ids),
            shared: self.expert(
                &format!("{p}shared_experts."),
                cfg.moe_inter_dim * cfg.n_shared_experts,
            )?,
            tid2eid,
        })
    }

    /// Backbone layer `layer`, its routed experts those `filter` keeps.
    pub fn layer(&self, layer: usize, filter: &ExpertFilter) -> Result<LayerWeights, ModelError> {
        let cfg = self.cfg;
        let (attention, mlp) = match (cfg.v4_attention(layer), cfg.v4_mlp(layer)) {
            (Some(attention), Some(mlp)) => (attention, mlp),
            _ => {
                return Err(ModelError::Unsupported {
                    what: format!("layer {layer} has no V4 attention / MLP type in the config"),
                });
            }
        };
        let experts = (cfg.n_routed_experts, cfg.n_activated_experts);
        let keeps = |e: usize| filter.keeps(layer, e);
        self.block_keeping(&format!("layers.{layer}."), attention, mlp, experts, &keeps)
    }

    /// The decoder block under `prefix` (the MTP block or a DSpark stage) with `(routed,
    /// activated)` experts, all of them read.
    pub fn block(
        &self,
        prefix: &str,
        attention: V4Attention,
        mlp: V4Mlp,
        experts: (usize, usize),
    ) -> Result<LayerWeights, ModelError> {
        self.block_keeping(prefix, attention, mlp, experts, &|_| true)
    }

    /// [`Loader::block`] reading only the routed experts `keeps(e)`.
    fn block_keeping(
        &self,
        prefix: &str,
        attention: V4Attention,
        mlp: V4Mlp,
        experts: (usize, usize),
        keeps: &dyn Fn(usize) -> bool,
    ) -> Result<LayerWeights, ModelError> {
        let cfg = self.cfg;
        let hc = cfg.hc.mult;
        let mix = (2 + hc) * hc;
        Ok(LayerWeights {
            attn_norm: self.vector(&format!("{prefix}attn_norm.weight"), &[cfg.dim])?,
            ffn_norm: self.vector(&format!("{prefix}ffn_norm.weight"), &[cfg.dim])?,
            hc_attn: self.hc(&format!("{prefix}hc_attn_"), mix, 3)?,
            hc_ffn: self.hc(&format!("{prefix}hc_ffn_"), mix, 3)?,
            attn: self.attention(prefix, attention)?,
            moe: self.moe(prefix, mlp, experts, keeps)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CpuBackend, Tensor};
    use crate::weights::{Fp4Weight, Fp8Weight};

    fn bytes(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 24) as u8)
            .collect()
    }

    /// Quantised projections give bit for bit the products of their dequantised matrices, across
    /// several dequantisation blocks and partial FP8 tiles.
    #[test]
    fn quantised_linears_equal_their_dequantised_dense_form() {
        let (out, inp, rows) = (300, 160, 3);
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        // E4M3 codes without the NaN pattern; scales around 2^0.
        let codes: Vec<u8> = bytes(out * inp, 1)
            .into_iter()
            .map(|b| if b & 0x7f == 0x7f { 0x7e } else { b })
            .collect();
        let fp8 = Fp8Weight {
            out,
            inp,
            block: 128,
            data: codes,
            scales: bytes(out.div_ceil(128) * inp.div_ceil(128), 2)
                .into_iter()
                .map(|b| 120 + b % 12)
                .collect(),
        };
        let fp4 = Fp4Weight {
            out,
            inp,
            packed: bytes(out * inp / 2, 3),
            scales: bytes(out * inp / 32, 4)
                .into_iter()
                .map(|b| 120 + b % 12)
                .collect(),
        };
        let backend = CpuBackend::new();
        let dense = |values: Vec<f32>| Linear::Dense { out, inp, values };
        for (quantised, values) in [
            (Linear::Fp8(fp8.clone()), fp8.to_f32()),
            (Linear::Fp4(fp4.clone()), fp4.to_f32()),
        ] {
            let x = Tensor::from(&x);
            let y = quantised.apply(&backend, &x).into_vec();
            assert_eq!(y.len(), rows * out);
            assert_eq!(y, dense(values).apply(&backend, &x).into_vec());
            assert!(y.iter().any(|&v| v != 0.0));
        }
    }
}
