//! The weight layout both families' blocks share: one block's norms, hyper-connection mixes,
//! attention and MoE ([`BlockWeights`]), and one layer's attention projections
//! ([`AttentionWeights`]). The families differ only in the projection format `W` (V4: a stored
//! `Linear` of any format; V4.1: FP8) and in their compressor and indexer weights.

use crate::backend::weights::Linear;
use crate::backend::{Backend, HcParams, Tensor};
use crate::layers::moe::MoeWeights;
use crate::weights::Fp8Weight;

/// An attention projection weight applied the family's way: `x [rows, inp] · Wᵀ → [rows, out]`.
pub trait Projection {
    fn project(&self, backend: &dyn Backend, x: &Tensor) -> Tensor;
}

/// V4: the weight dequantised exactly, the activations unquantised (fp32).
impl Projection for Linear {
    fn project(&self, backend: &dyn Backend, x: &Tensor) -> Tensor {
        self.apply(backend, x)
    }
}

/// V4.1: the FP8 GEMM (activations quantised per 1×32 group, spec §6.3).
impl Projection for Fp8Weight {
    fn project(&self, backend: &dyn Backend, x: &Tensor) -> Tensor {
        backend.gemm_fp8(x, self)
    }
}

/// Attention of one layer: `W` the projection format, `C` the compressor, `I` the indexer.
#[derive(Debug, Clone)]
pub struct AttentionWeights<W, C, I> {
    pub wq_a: W,
    pub q_norm: Vec<f32>,
    pub wq_b: W,
    pub wkv: W,
    pub kv_norm: Vec<f32>,
    /// `[o_groups · o_lora_rank, n_heads · head_dim / o_groups]`, dequantised at load (used per
    /// group).
    pub wo_a: Vec<f32>,
    pub wo_b: W,
    /// `[n_heads]` fp32.
    pub sink: Vec<f32>,
    pub compressor: Option<C>,
    pub indexer: Option<I>,
}

/// One block (a backbone layer, the MTP block or a DSpark stage) with the attention `A`.
#[derive(Debug, Clone)]
pub struct BlockWeights<A> {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub hc_attn: HcParams,
    pub hc_ffn: HcParams,
    pub attn: A,
    /// Router, routed and shared experts.
    pub moe: MoeWeights,
}
