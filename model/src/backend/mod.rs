//! The compute interface the V4.1 layer math is written against (ARCHITECTURE.md §3). An op works on
//! whole rows of one sequence (row-major `f32` buffers holding bf16 or fp32 values as documented per
//! op), at the granularity the model needs: block-scaled FP8/FP4 GEMMs, plain GEMMs, RMSNorm, RoPE,
//! the QDQ points, sparse attention with a sink, mHC mixes/collapse/expand, index scores and top-k.
//!
//! Every op is a pure function of its inputs, so a sequence's numbers never depend on another
//! sequence or on how its tokens were chunked (batch invariance by construction).

pub mod cpu;

pub use cpu::CpuBackend;

use crate::weights::{Fp4Weight, Fp8Weight};

/// The pre/post/comb coefficients of one mHC site for one token (spec §3.2), all fp32.
#[derive(Debug, Clone, PartialEq)]
pub struct HcMix {
    /// Collapse weights `[hc]`.
    pub pre: Vec<f32>,
    /// Expansion weights of the sublayer output `[hc]`.
    pub post: Vec<f32>,
    /// Doubly-stochastic residual mix `[hc, hc]`, `comb[j * hc + k]` = from stream j into stream k.
    pub comb: Vec<f32>,
}

/// Parameters of one mHC site (`hc_{site}_fn/base/scale`).
#[derive(Debug, Clone)]
pub struct HcParams {
    /// `[(2 + hc) · hc, hc · dim]` fp32.
    pub proj: Vec<f32>,
    /// `[(2 + hc) · hc]` fp32.
    pub base: Vec<f32>,
    /// `[3]` fp32.
    pub scale: Vec<f32>,
}

/// RoPE frequencies of one rotary variant: `freqs[i]` rotates channel pair `(2i, 2i+1)`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub freqs: Vec<f32>,
}

/// The operations the model needs from a device. `CpuBackend` is the reference implementation.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Human-readable device name.
    fn name(&self) -> &str;

    /// `x [rows, w.inp]` (bf16) · FP8 `Wᵀ` with FP8-quantised activations → bf16 `[rows, w.out]`.
    fn gemm_fp8(&self, x: &[f32], w: &Fp8Weight) -> Vec<f32>;
    /// `x [rows, w.inp]` (bf16) · FP4 `Wᵀ` with FP8-quantised activations → bf16 `[rows, w.out]`.
    fn gemm_fp4(&self, x: &[f32], w: &Fp4Weight) -> Vec<f32>;
    /// Plain `x · Wᵀ` with `W [out, inp]`, fp32 accumulation, output rounded to bf16.
    fn linear_bf16(&self, x: &[f32], w: &[f32], out: usize, inp: usize) -> Vec<f32>;
    /// Plain `x · Wᵀ` with fp32 output (no rounding).
    fn linear_f32(&self, x: &[f32], w: &[f32], out: usize, inp: usize) -> Vec<f32>;
    /// Row-wise RMSNorm over rows of `weight.len()`, `bf16(w · (x · rsqrt(mean(x²) + eps)))`.
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32) -> Vec<f32>;
    /// Rotates the last `2 · table.freqs.len()` channels of every `stride`-wide vector of `x`
    /// (consecutive vectors of one row share `positions[row]`) by `±position · freq`, rounding to
    /// bf16. `vectors_per_row` vectors make up one row.
    fn rope(
        &self,
        x: &mut [f32],
        stride: usize,
        vectors_per_row: usize,
        positions: &[usize],
        table: &RopeTable,
        inverse: bool,
    );
    /// `Q8` QDQ in place (groups of 32, UE8M0).
    fn q8_qdq(&self, x: &mut [f32]);
    /// `Q4e` QDQ in place (groups of 32, UE8M0).
    fn q4e_qdq(&self, x: &mut [f32]);
    /// `Q4m` QDQ in place (groups of 16, E4M3 scales).
    fn q4m_qdq(&self, x: &mut [f32]);
    /// Single-query multi-head attention over `keys` (K = V, each `head_dim` long) with a per-head
    /// sink in the denominator: `q [heads, head_dim]` bf16 → bf16 `[heads, head_dim]`.
    fn sparse_attention(&self, q: &[f32], keys: &[&[f32]], sink: &[f32], scale: f32) -> Vec<f32>;
    /// The mHC coefficients of one token's streams `x [hc, dim]`.
    fn hc_mixes(
        &self,
        x: &[f32],
        params: &HcParams,
        hc: usize,
        sinkhorn_iters: usize,
        hc_eps: f32,
        norm_eps: f32,
    ) -> HcMix;
    /// `bf16(Σ_k w_k · x_k)` over the `w.len()` streams of `x [hc, dim]`.
    fn hc_collapse(&self, x: &[f32], weights: &[f32]) -> Vec<f32>;
    /// `X'_k = bf16(post_k · y + Σ_j comb[j][k] · X_j)`.
    fn hc_expand(&self, y: &[f32], residual: &[f32], mix: &HcMix) -> Vec<f32>;
    /// Index scores of one query (`q [heads, head_dim]`, per-head `weights`) against `keys`
    /// (`[n, head_dim]`), with the reference's bf16 rounding points.
    fn index_scores(&self, q: &[f32], weights: &[f32], keys: &[f32], head_dim: usize) -> Vec<f32>;
}
