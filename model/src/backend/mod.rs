//! The compute interface the V4.1 layer math is written against (ARCHITECTURE.md §3). An op works on
//! whole rows of one sequence (row-major `f32` buffers holding bf16 or fp32 values as documented per
//! op), at the granularity the model needs: block-scaled FP8/FP4 GEMMs, plain GEMMs, RMSNorm, RoPE,
//! the QDQ points, sparse attention with a sink, mHC mixes/collapse/expand, index scores and top-k,
//! the MoE router after its gate linear, Engram hashing and table lookup, and token sampling of a
//! batch of logit rows (each row with its own parameters: [`crate::sampling`] is its definition).
//!
//! Every op is a pure function of its inputs, so a sequence's numbers never depend on another
//! sequence or on how its tokens were chunked (batch invariance by construction).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

pub use cpu::CpuBackend;

use crate::engram::{EngramTable, NgramHasher};
use crate::sampling::SamplingParams;
use crate::weights::{FP4_GROUP, Fp4Weight, Fp8Weight, e2m1_to_f32, e8m0_to_f32};

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

/// Where an op rounds its results: `Bf16` at DeepSeek's reference rounding points (V4.1), `F32`
/// nowhere (the transformers float32 reference that V4 is matched against).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    Bf16,
    F32,
}

impl Precision {
    /// `x` rounded as this precision stores an activation.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::Bf16 => crate::quant::round_bf16(x),
            Precision::F32 => x,
        }
    }
}

/// RoPE frequencies of one rotary variant: `freqs[i]` rotates channel pair `(2i, 2i+1)`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub freqs: Vec<f32>,
}

/// One row of [`Backend::sample_rows`]: its sequence's sampling parameters and the absolute
/// position of the token being sampled (the noise's counter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    pub params: SamplingParams,
    pub position: u64,
}

/// Logits that [`Backend::sample_rows`] cannot sample from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleRowsError {
    /// A vocabulary of 0 tokens has nothing to pick.
    #[error("sample_rows: the vocabulary is empty ({rows} rows asked)")]
    EmptyVocab { rows: usize },
    /// The logits are not one `vocab`-wide row per sampled row.
    #[error("sample_rows: {found} logits are not {rows} rows of {vocab}")]
    LogitsShape {
        found: usize,
        rows: usize,
        vocab: usize,
    },
}

/// Which experts the MoE router takes for each token ([`Backend::route_experts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertSelection<'a> {
    /// The `k` highest biased scores, in descending order (ties: lower expert id first).
    TopK(usize),
    /// These experts in this order (ids at or beyond the expert count are dropped): a replayed
    /// routing decision; the weights still come from the token's own scores.
    Forced(&'a [usize]),
}

/// The experts chosen for one token (in selection order) and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertRoute {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
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
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
        self.rms_norm_at(x, weight, eps, Precision::Bf16)
    }
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
    ) {
        self.rope_at(
            x,
            stride,
            vectors_per_row,
            positions,
            table,
            inverse,
            Precision::Bf16,
        );
    }
    /// `Q8` QDQ in place (groups of 32, UE8M0).
    fn q8_qdq(&self, x: &mut [f32]);
    /// `Q4e` QDQ in place (groups of 32, UE8M0).
    fn q4e_qdq(&self, x: &mut [f32]);
    /// `Q4m` QDQ in place (groups of 16, E4M3 scales).
    fn q4m_qdq(&self, x: &mut [f32]);
    /// Single-query multi-head attention over `keys` (K = V, each `head_dim` long) with a per-head
    /// sink in the denominator: `q [heads, head_dim]` bf16 → bf16 `[heads, head_dim]`.
    fn sparse_attention(&self, q: &[f32], keys: &[&[f32]], sink: &[f32], scale: f32) -> Vec<f32> {
        self.sparse_attention_at(q, keys, sink, scale, Precision::Bf16)
    }
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
    fn hc_collapse(&self, x: &[f32], weights: &[f32]) -> Vec<f32> {
        self.hc_collapse_at(x, weights, Precision::Bf16)
    }
    /// `X'_k = bf16(post_k · y + Σ_j comb[j][k] · X_j)`.
    fn hc_expand(&self, y: &[f32], residual: &[f32], mix: &HcMix) -> Vec<f32> {
        self.hc_expand_at(y, residual, mix, Precision::Bf16)
    }
    /// Index scores of one query (`q [heads, head_dim]`, per-head `weights`) against `keys`
    /// (`[n, head_dim]`), with the reference's bf16 rounding points.
    fn index_scores(&self, q: &[f32], weights: &[f32], keys: &[f32], head_dim: usize) -> Vec<f32> {
        self.index_scores_at(q, weights, keys, head_dim, Precision::Bf16)
    }

    /// [`Backend::rms_norm`] rounding at `precision`.
    fn rms_norm_at(&self, x: &[f32], weight: &[f32], eps: f32, precision: Precision) -> Vec<f32>;
    /// [`Backend::rope`] rounding at `precision`.
    fn rope_at(
        &self,
        x: &mut [f32],
        stride: usize,
        vectors_per_row: usize,
        positions: &[usize],
        table: &RopeTable,
        inverse: bool,
        precision: Precision,
    );
    /// [`Backend::sparse_attention`] rounding probabilities and output at `precision`.
    fn sparse_attention_at(
        &self,
        q: &[f32],
        keys: &[&[f32]],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Vec<f32>;
    /// [`Backend::hc_collapse`] rounding at `precision`.
    fn hc_collapse_at(&self, x: &[f32], weights: &[f32], precision: Precision) -> Vec<f32>;
    /// [`Backend::hc_expand`] rounding at `precision`.
    fn hc_expand_at(
        &self,
        y: &[f32],
        residual: &[f32],
        mix: &HcMix,
        precision: Precision,
    ) -> Vec<f32>;
    /// [`Backend::index_scores`] (`Σ_h w_h · ReLU(q_h · k)`) rounding at `precision`.
    fn index_scores_at(
        &self,
        q: &[f32],
        weights: &[f32],
        keys: &[f32],
        head_dim: usize,
        precision: Precision,
    ) -> Vec<f32>;

    /// [`Backend::hc_mixes`] of every token of `x [n, hc · dim]` (a token's width `hc · dim` is
    /// the projection's input width), one [`HcMix`] per token.
    fn hc_mixes_rows(
        &self,
        x: &[f32],
        params: &HcParams,
        hc: usize,
        sinkhorn_iters: usize,
        hc_eps: f32,
        norm_eps: f32,
    ) -> Vec<HcMix> {
        let width = params.proj.len() / ((2 + hc) * hc).max(1);
        if width == 0 {
            return Vec::new();
        }
        x.chunks_exact(width)
            .map(|token| self.hc_mixes(token, params, hc, sinkhorn_iters, hc_eps, norm_eps))
            .collect()
    }
    /// [`Backend::hc_collapse_at`] of every token: `x [n, hc, dim]` with its own weights
    /// `weights [n, hc]` → `[n, dim]`.
    fn hc_collapse_rows_at(
        &self,
        x: &[f32],
        weights: &[f32],
        hc: usize,
        precision: Precision,
    ) -> Vec<f32> {
        let tokens = weights.len() / hc.max(1);
        if tokens == 0 {
            return Vec::new();
        }
        x.chunks_exact(x.len() / tokens)
            .zip(weights.chunks_exact(hc))
            .flat_map(|(x, w)| self.hc_collapse_at(x, w, precision))
            .collect()
    }
    /// [`Backend::hc_expand_at`] of every token: `y [n, dim]`, `residual [n, hc, dim]`, one mix
    /// per token → `[n, hc, dim]`.
    fn hc_expand_rows_at(
        &self,
        y: &[f32],
        residual: &[f32],
        mixes: &[HcMix],
        precision: Precision,
    ) -> Vec<f32> {
        if mixes.is_empty() {
            return Vec::new();
        }
        let (dim, width) = (y.len() / mixes.len(), residual.len() / mixes.len());
        y.chunks_exact(dim)
            .zip(residual.chunks_exact(width))
            .zip(mixes)
            .flat_map(|((y, r), mix)| self.hc_expand_at(y, r, mix, precision))
            .collect()
    }
    /// [`Backend::sparse_attention_at`] of `keys.len()` queries `q [n, heads · head_dim]`, query
    /// `t` over its own `keys[t]` → `[n, heads · head_dim]`.
    fn sparse_attention_rows_at(
        &self,
        q: &[f32],
        keys: &[Vec<&[f32]>],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Vec<f32> {
        if keys.is_empty() {
            return Vec::new();
        }
        q.chunks_exact(q.len() / keys.len())
            .zip(keys)
            .flat_map(|(q, keys)| self.sparse_attention_at(q, keys, sink, scale, precision))
            .collect()
    }
    /// [`Backend::index_scores_at`] of `visible.len()` queries `q [n, heads · head_dim]` with
    /// their head weights `[n, heads]`: query `t` scores the first `visible[t]` keys of `keys`.
    fn index_scores_rows_at(
        &self,
        q: &[f32],
        weights: &[f32],
        keys: &[f32],
        head_dim: usize,
        visible: &[usize],
        precision: Precision,
    ) -> Vec<Vec<f32>> {
        if visible.is_empty() {
            return Vec::new();
        }
        q.chunks_exact(q.len() / visible.len())
            .zip(weights.chunks_exact(weights.len() / visible.len()))
            .zip(visible)
            .map(|((q, w), &seen)| {
                let seen = (seen * head_dim).min(keys.len());
                self.index_scores_at(q, w, &keys[..seen], head_dim, precision)
            })
            .collect()
    }

    /// One token per row of `logits` (`[rows.len(), vocab]`), each row sampled with its own
    /// parameters and position exactly as [`crate::sampling::sample`] does (the one definition of
    /// the sampling math; a device implementation must return the same ids).
    fn sample_rows(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        check_sample_rows(logits, vocab, rows)?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        Ok(logits
            .chunks_exact(vocab)
            .zip(rows)
            .map(|(row, r)| crate::sampling::sample(row, &r.params, r.position).unwrap_or(0))
            .collect())
    }

    /// One token per row of the fp32 logits `x · Wᵀ` ([`Backend::linear_f32`], `W [out, inp]`),
    /// sampled as [`Backend::sample_rows`] does: the head and the sampler of a step in one op, so a
    /// device backend keeps the logits where it computed them and returns only the ids.
    fn sample_linear(
        &self,
        x: &[f32],
        w: &[f32],
        out: usize,
        inp: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        self.sample_rows(&self.linear_f32(x, w, out, inp), out, rows)
    }

    /// The MoE router after the gate linear, one token per `bias.len()`-wide row of `logits`
    /// (`z`): scores `s = sqrt(softplus(z))` (the reference's vectorised softplus,
    /// [`cpu::router_scores`]), selection on `s + bias` ([`ExpertSelection`]), weights
    /// `s_e / (Σ s + 1e-20) · route_scale` over the selected experts (not normalised for a single
    /// expert). `bias` is the layer's `bias` or `bias_vl`. No logits (or no experts): no routes.
    fn route_experts(
        &self,
        logits: &[f32],
        bias: &[f32],
        selection: ExpertSelection<'_>,
        route_scale: f32,
    ) -> Vec<ExpertRoute> {
        cpu::route_experts(logits, bias, selection, route_scale)
    }

    /// Engram table row ids of hashed n-gram contexts: `contexts` holds `hasher.max_ngram()`
    /// compressed ids per token (lag 0 first, pad already substituted); the result is
    /// `[tokens, layers, columns]` as [`NgramHasher::rows_of_contexts`] computes it.
    fn engram_hash(&self, hasher: &NgramHasher, contexts: &[u64]) -> Vec<u32> {
        hasher.rows_of_contexts(contexts)
    }

    /// The bf16 values of Engram table rows `row_ids`, one `table.head_dim()`-wide row after
    /// another ([`EngramTable::gather`]: FP8 codes times their row scales; foreign ids give zeros).
    fn engram_gather(&self, table: &EngramTable, row_ids: &[u32]) -> Vec<f32> {
        let mut out = vec![0.0f32; row_ids.len() * table.head_dim()];
        table.gather(row_ids, &mut out);
        out
    }

    /// `x [rows, w.inp] · Wᵀ` in fp32 with the FP8 weight dequantised exactly and the activations
    /// left as they are (the transformers float32 numerics of V4); equals [`Backend::linear_f32`]
    /// on `w.to_f32()` without materialising it.
    fn linear_fp8_f32(&self, x: &[f32], w: &Fp8Weight) -> Vec<f32> {
        dequantised_linear(
            x,
            w.out,
            w.inp,
            |row, block| fp8_row(w, row, block),
            |x, rows, n| self.linear_f32(x, rows, n, w.inp),
        )
    }
    /// [`Backend::linear_fp8_f32`] for a packed FP4 weight.
    fn linear_fp4_f32(&self, x: &[f32], w: &Fp4Weight) -> Vec<f32> {
        dequantised_linear(
            x,
            w.out,
            w.inp,
            |row, block| fp4_row(w, row, block),
            |x, rows, n| self.linear_f32(x, rows, n, w.inp),
        )
    }
}

/// The shape check of [`Backend::sample_rows`], shared by every implementation.
pub fn check_sample_rows(
    logits: &[f32],
    vocab: usize,
    rows: &[RowSampling],
) -> Result<(), SampleRowsError> {
    if rows.is_empty() && logits.is_empty() {
        return Ok(());
    }
    if vocab == 0 {
        return Err(SampleRowsError::EmptyVocab { rows: rows.len() });
    }
    if rows.len().checked_mul(vocab) != Some(logits.len()) {
        return Err(SampleRowsError::LogitsShape {
            found: logits.len(),
            rows: rows.len(),
            vocab,
        });
    }
    Ok(())
}

/// Appends row `row` of an FP8 weight in f32 ([`Fp8Weight::dequant_row`], through the decode
/// table) to `block`.
fn fp8_row(w: &Fp8Weight, row: usize, block: &mut Vec<f32>) {
    let codes = crate::quant::e4m3_table();
    let tile_row = (row / w.block) * w.scale_cols();
    let scales = &w.scales[tile_row..tile_row + w.scale_cols()];
    for (tile, &scale) in w.data[row * w.inp..(row + 1) * w.inp]
        .chunks(w.block)
        .zip(scales)
    {
        let scale = e8m0_to_f32(scale);
        block.extend(tile.iter().map(|&code| codes[usize::from(code)] * scale));
    }
}

/// Appends row `row` of a packed FP4 weight in f32 ([`Fp4Weight::dequant_row`], one scale per
/// group) to `block`.
fn fp4_row(w: &Fp4Weight, row: usize, block: &mut Vec<f32>) {
    let scale_cols = w.scale_cols();
    let scales = &w.scales[row * scale_cols..(row + 1) * scale_cols];
    for (group, &scale) in w.packed[row * w.inp / 2..(row + 1) * w.inp / 2]
        .chunks(FP4_GROUP / 2)
        .zip(scales)
    {
        let scale = e8m0_to_f32(scale);
        for &byte in group {
            block.push(e2m1_to_f32(byte & 0x0f) * scale);
            block.push(e2m1_to_f32(byte >> 4) * scale);
        }
    }
}

/// Weight rows dequantised at a time by [`dequantised_linear`] (bounds its memory).
const DEQUANT_ROWS: usize = 256;

/// `x · Wᵀ` for a `[out, inp]` weight whose rows `dequant_row` appends to a buffer, through
/// `linear` (`x`, a block of dequantised rows, their count) one block of rows at a time.
fn dequantised_linear(
    x: &[f32],
    out: usize,
    inp: usize,
    dequant_row: impl Fn(usize, &mut Vec<f32>),
    linear: impl Fn(&[f32], &[f32], usize) -> Vec<f32>,
) -> Vec<f32> {
    let rows_of_x = x.len() / inp.max(1);
    let mut y = vec![0.0f32; rows_of_x * out];
    let mut block = Vec::with_capacity(DEQUANT_ROWS.min(out) * inp);
    for start in (0..out).step_by(DEQUANT_ROWS) {
        let count = DEQUANT_ROWS.min(out - start);
        block.clear();
        for row in start..start + count {
            dequant_row(row, &mut block);
        }
        let part = linear(x, &block, count);
        for (r, chunk) in part.chunks_exact(count).enumerate() {
            y[r * out + start..r * out + start + count].copy_from_slice(chunk);
        }
    }
    y
}
