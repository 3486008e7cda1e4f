//! The compute interface the V4.1 layer math is written against (ARCHITECTURE.md §3). An op works on
//! whole rows (row-major `f32` values holding bf16 or fp32 values as documented per op; the row ops
//! take and return [`Tensor`]s, which stay in device memory on a device backend), at the granularity
//! the model needs: block-scaled FP8/FP4 GEMMs, plain GEMMs, RMSNorm, RoPE,
//! the QDQ points, sparse attention with a sink, mHC mixes/collapse/expand, index scores and top-k,
//! the MoE router after its gate linear, Engram hashing and table lookup, and token sampling of a
//! batch of logit rows (each row with its own parameters: [`crate::sampling`] is its definition).
//!
//! Every op is a pure function of its inputs, so a sequence's numbers never depend on another
//! sequence or on how its tokens were chunked (batch invariance by construction).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod select;
pub mod tensor;

pub use cpu::CpuBackend;
pub use select::{CandidateMask, Candidates, QueryKeys, SelectedKeys, Selection};
pub use tensor::{DeviceBuffer, DeviceView, Tensor};

use crate::engram::{EngramGate, EngramTable, NgramHasher};
use crate::sampling::{AllowedTokens, MaskError, SamplingParams, TokenLogprobs};
use crate::v41::weights::{ExpertLinear, ExpertWeights};
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

/// The mHC coefficients of every token of a step ([`Backend::hc_mixes_rows`]): per token `pre
/// [hc] ‖ post [hc] ‖ comb [hc, hc]` (fp32), kept where they were computed.
#[derive(Debug, Clone)]
pub struct HcMixes {
    pub hc: usize,
    pub values: Tensor,
}

impl HcMixes {
    /// Values per token.
    pub fn width(&self) -> usize {
        (2 + self.hc) * self.hc
    }

    /// Tokens.
    pub fn tokens(&self) -> usize {
        self.values.len() / self.width().max(1)
    }

    /// The mixes of the host `mixes` (one per token, all of `hc` streams).
    pub fn from_host(hc: usize, mixes: &[HcMix]) -> HcMixes {
        let values = mixes
            .iter()
            .flat_map(|m| m.pre.iter().chain(&m.post).chain(&m.comb).copied())
            .collect::<Vec<f32>>();
        HcMixes {
            hc,
            values: values.into(),
        }
    }

    /// Token `t`'s coefficients, read on the host.
    pub fn token(&self, t: usize) -> HcMix {
        let (hc, width) = (self.hc, self.width());
        let v = &self.values[t * width..(t + 1) * width];
        HcMix {
            pre: v[..hc].to_vec(),
            post: v[hc..2 * hc].to_vec(),
            comb: v[2 * hc..].to_vec(),
        }
    }

    /// The collapse weights `pre [tokens, hc]`, gathered on the backend.
    pub fn pre(&self, backend: &dyn Backend) -> Tensor {
        self.columns(backend, 0, self.hc)
    }

    /// The expansion coefficients `post ‖ comb` `[tokens, hc + hc²]`, gathered on the backend.
    pub fn post_comb(&self, backend: &dyn Backend) -> Tensor {
        self.columns(backend, self.hc, self.width() - self.hc)
    }

    fn columns(&self, backend: &dyn Backend, first: usize, width: usize) -> Tensor {
        let pieces: Vec<(&Tensor, usize)> = (0..self.tokens())
            .map(|t| (&self.values, t * self.width() + first))
            .collect();
        backend.gather(&pieces, width)
    }
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

impl RopeTable {
    /// `(cos, sin)` of pair `pair` at `position`: the angle `position · freqs[pair]` in fp32, then
    /// the C library's fp32 `cosf`/`sinf`, as the reference's `torch.polar` (its CPU kernel calls
    /// `std::cos`/`std::sin` on fp32). glibc's are within an ulp but not correctly rounded: the
    /// sine of v41-odd's compressed pair 2 at position 71 is one ulp from the rounded exact one.
    /// Every backend rotates with these values (device backends upload them).
    pub fn cos_sin(&self, position: usize, pair: usize) -> (f32, f32) {
        let angle = position as f32 * self.freqs[pair];
        (angle.cos(), angle.sin())
    }
}

/// One row of [`Backend::sample_rows`]: its sequence's sampling parameters and the absolute
/// position of the token being sampled (the noise's counter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    pub params: SamplingParams,
    pub position: u64,
}

/// One row of [`Backend::token_logprobs_masked`]: the token sampled from it and how many
/// alternatives to list (at most [`crate::sampling::MAX_TOP_LOGPROBS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobPick {
    pub token: u32,
    pub top: usize,
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
    /// [`Backend::sample_masked`] was not given one mask entry per row.
    #[error("sample_rows: {found} masks for {rows} rows")]
    MaskCount { found: usize, rows: usize },
    /// Row `row`'s mask does not fit the vocabulary or allows no token: that row's request fails.
    #[error("sample_rows: row {row}: {source}")]
    Mask {
        row: usize,
        #[source]
        source: MaskError,
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

/// One MoE layer as [`Backend::moe_rows`] runs it whole (spec §3.6).
#[derive(Debug, Clone, Copy)]
pub struct MoeLayer<'a> {
    /// Router weights `[n_experts, dim]`.
    pub gate: &'a [f32],
    /// Selection bias `[n_experts]`.
    pub bias: &'a [f32],
    /// Experts per token.
    pub n_activated: usize,
    pub route_scale: f32,
    pub experts: &'a [ExpertWeights<ExpertLinear>],
    pub shared: &'a ExpertWeights<ExpertLinear>,
    /// SwiGLU clamp (none when not positive).
    pub swiglu_limit: f32,
    pub precision: Precision,
}

/// The operations the model needs from a device. `CpuBackend` is the reference implementation.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Human-readable device name.
    fn name(&self) -> &str;

    /// The concrete backend (e.g. to reach a `CudaBackend`'s expert slot under a model).
    fn as_any(&self) -> &dyn std::any::Any;

    /// `x [rows, w.inp]` (bf16) · FP8 `Wᵀ` with FP8-quantised activations → bf16 `[rows, w.out]`.
    fn gemm_fp8(&self, x: &Tensor, w: &Fp8Weight) -> Tensor;
    /// `x [rows, w.inp]` (bf16) · FP4 `Wᵀ` with FP8-quantised activations → bf16 `[rows, w.out]`.
    fn gemm_fp4(&self, x: &Tensor, w: &Fp4Weight) -> Tensor;
    /// Plain `x · Wᵀ` with `W [out, inp]`, fp32 accumulation, output rounded to bf16.
    fn linear_bf16(&self, x: &Tensor, w: &[f32], out: usize, inp: usize) -> Tensor;
    /// Plain `x · Wᵀ` with fp32 output (no rounding).
    fn linear_f32(&self, x: &Tensor, w: &[f32], out: usize, inp: usize) -> Tensor;
    /// Row-wise RMSNorm over rows of `weight.len()`, `bf16(w · (x · rsqrt(mean(x²) + eps)))`.
    fn rms_norm(&self, x: &Tensor, weight: &[f32], eps: f32) -> Tensor {
        self.rms_norm_at(x, weight, eps, Precision::Bf16)
    }
    /// `width` values from each `(tensor, offset)` of `pieces`, one after another: the row
    /// movement between ops (gathering rows, columns, interleaving) without leaving the device.
    fn gather(&self, pieces: &[(&Tensor, usize)], width: usize) -> Tensor {
        let mut out = Vec::with_capacity(pieces.len() * width);
        for (tensor, offset) in pieces {
            out.extend_from_slice(&tensor[*offset..*offset + width]);
        }
        out.into()
    }
    /// Rotates the last `2 · table.freqs.len()` channels of every `stride`-wide vector of `x`
    /// (consecutive vectors of one row share `positions[row]`) by `±position · freq`, rounding to
    /// bf16. `vectors_per_row` vectors make up one row.
    fn rope(
        &self,
        x: Tensor,
        stride: usize,
        vectors_per_row: usize,
        positions: &[usize],
        table: &RopeTable,
        inverse: bool,
    ) -> Tensor {
        self.rope_at(
            x,
            stride,
            vectors_per_row,
            positions,
            table,
            inverse,
            Precision::Bf16,
        )
    }
    /// `Q8` QDQ (groups of 32, UE8M0).
    fn q8_qdq(&self, x: Tensor) -> Tensor;
    /// `Q4e` QDQ (groups of 32, UE8M0).
    fn q4e_qdq(&self, x: Tensor) -> Tensor;
    /// `Q4m` QDQ (groups of 16, E4M3 scales).
    fn q4m_qdq(&self, x: Tensor) -> Tensor;
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
    fn rms_norm_at(&self, x: &Tensor, weight: &[f32], eps: f32, precision: Precision) -> Tensor;
    /// [`Backend::rope`] rounding at `precision`.
    #[allow(clippy::too_many_arguments)]
    fn rope_at(
        &self,
        x: Tensor,
        stride: usize,
        vectors_per_row: usize,
        positions: &[usize],
        table: &RopeTable,
        inverse: bool,
        precision: Precision,
    ) -> Tensor;
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
    /// the projection's input width).
    fn hc_mixes_rows(
        &self,
        x: &Tensor,
        params: &HcParams,
        hc: usize,
        sinkhorn_iters: usize,
        hc_eps: f32,
        norm_eps: f32,
    ) -> HcMixes {
        let width = params.proj.len() / ((2 + hc) * hc).max(1);
        if width == 0 {
            return HcMixes::from_host(hc, &[]);
        }
        let mixes: Vec<HcMix> = x
            .chunks_exact(width)
            .map(|token| self.hc_mixes(token, params, hc, sinkhorn_iters, hc_eps, norm_eps))
            .collect();
        HcMixes::from_host(hc, &mixes)
    }
    /// [`Backend::hc_collapse_at`] of every token: `x [n, hc, dim]` with its own weights
    /// `weights [n, hc]` → `[n, dim]`.
    fn hc_collapse_rows_at(
        &self,
        x: &Tensor,
        weights: &Tensor,
        hc: usize,
        precision: Precision,
    ) -> Tensor {
        let tokens = weights.len() / hc.max(1);
        if tokens == 0 {
            return Tensor::empty();
        }
        x.chunks_exact(x.len() / tokens)
            .zip(weights.chunks_exact(hc))
            .flat_map(|(x, w)| self.hc_collapse_at(x, w, precision))
            .collect::<Vec<f32>>()
            .into()
    }
    /// [`Backend::hc_expand_at`] of every token: `y [n, dim]`, `residual [n, hc, dim]`, each
    /// token's mix → `[n, hc, dim]`.
    fn hc_expand_rows_at(
        &self,
        y: &Tensor,
        residual: &Tensor,
        mixes: &HcMixes,
        precision: Precision,
    ) -> Tensor {
        let tokens = mixes.tokens();
        if tokens == 0 {
            return Tensor::empty();
        }
        let (dim, width) = (y.len() / tokens, residual.len() / tokens);
        y.chunks_exact(dim)
            .zip(residual.chunks_exact(width))
            .enumerate()
            .flat_map(|(t, (y, r))| self.hc_expand_at(y, r, &mixes.token(t), precision))
            .collect::<Vec<f32>>()
            .into()
    }
    /// [`Backend::sparse_attention_at`] of `keys.len()` queries `q [n, heads · head_dim]`, query
    /// `t` over its own `keys[t]` (each key one `head_dim` row) → `[n, heads · head_dim]`.
    fn sparse_attention_rows_at(
        &self,
        q: &Tensor,
        keys: &[Vec<&Tensor>],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Tensor {
        if keys.is_empty() {
            return Tensor::empty();
        }
        q.chunks_exact(q.len() / keys.len())
            .zip(keys)
            .flat_map(|(q, keys)| {
                let keys: Vec<&[f32]> = keys.iter().map(|k| &k[..]).collect();
                self.sparse_attention_at(q, &keys, sink, scale, precision)
            })
            .collect::<Vec<f32>>()
            .into()
    }
    /// [`Backend::sparse_attention_rows_at`] with each query's keys given as listed keys and a
    /// selection of compressed keys ([`QueryKeys`]), so a selection left on the device is read
    /// there.
    fn sparse_attention_selected(
        &self,
        q: &Tensor,
        queries: &[QueryKeys<'_>],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Tensor {
        let keys: Vec<Vec<&Tensor>> = queries.iter().map(QueryKeys::flattened).collect();
        self.sparse_attention_rows_at(q, &keys, sink, scale, precision)
    }
    /// The indexer's selection of one sequence's queries (`q [n, heads · head_dim]`, head
    /// weights `[n, heads]`, query `t` scoring the first `visible[t]` of `keys`): the top
    /// `min(k, visible)` scores of each (ties: lower index), ascending, restricted or accompanied
    /// by the two-level top-k's candidate mask as `candidates` says ([`select::select_host`] is
    /// the definition).
    #[allow(clippy::too_many_arguments)]
    fn select_rows(
        &self,
        q: &Tensor,
        weights: &Tensor,
        keys: &[&Tensor],
        head_dim: usize,
        visible: &[usize],
        k: usize,
        candidates: Candidates<'_>,
        precision: Precision,
    ) -> (Selection, Option<CandidateMask>) {
        let scores = self.index_scores_rows_at(q, weights, keys, head_dim, visible, precision);
        select::select_host(scores, k, candidates)
    }
    /// [`Backend::index_scores_at`] of `visible.len()` queries `q [n, heads · head_dim]` with
    /// their head weights `[n, heads]`: query `t` scores the first `visible[t]` of `keys` (each
    /// one `head_dim` row).
    fn index_scores_rows_at(
        &self,
        q: &Tensor,
        weights: &Tensor,
        keys: &[&Tensor],
        head_dim: usize,
        visible: &[usize],
        precision: Precision,
    ) -> Vec<Vec<f32>> {
        if visible.is_empty() {
            return Vec::new();
        }
        let flat: Vec<f32> = keys.iter().flat_map(|k| k.iter().copied()).collect();
        q.chunks_exact(q.len() / visible.len())
            .zip(weights.chunks_exact(weights.len() / visible.len()))
            .zip(visible)
            .map(|((q, w), &seen)| {
                let seen = (seen * head_dim).min(flat.len());
                self.index_scores_at(q, w, &flat[..seen], head_dim, precision)
            })
            .collect()
    }

    /// The whole MoE of every row of `x [n, dim]` in one op — the router (top-k on the layer's
    /// bias), the routed experts (each row's outputs added in increasing expert id), the shared
    /// expert, one rounding — bit for bit as `v41::moe::forward_rows` computes it from the ops
    /// one by one; `None` when this backend has no fused path for the layer (the model then runs
    /// those ops).
    fn moe_rows(&self, x: &Tensor, layer: &MoeLayer<'_>) -> Option<Tensor> {
        let _ = (x, layer);
        None
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

    /// [`Backend::sample_rows`] of the logits rows `logits` (`[rows.len(), vocab]`, a tensor:
    /// on a device backend they are read where they are) with row `r` restricted to
    /// `allowed[r]` when given: its disallowed logits are −∞ before the sampling math
    /// ([`crate::sampling::sample_allowed`] is the definition). A mask wider than the vocabulary
    /// or allowing nothing is [`SampleRowsError::Mask`] naming the row.
    fn sample_masked(
        &self,
        logits: &Tensor,
        vocab: usize,
        rows: &[RowSampling],
        allowed: &[Option<&AllowedTokens>],
    ) -> Result<Vec<u32>, SampleRowsError> {
        check_sample_masked(logits.len(), vocab, rows, allowed)?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        logits
            .chunks_exact(vocab)
            .zip(rows.iter().zip(allowed))
            .enumerate()
            .map(|(row, (values, (r, allowed)))| {
                crate::sampling::sample_allowed(values, &r.params, r.position, *allowed)
                    .map_err(|source| SampleRowsError::Mask { row, source })
            })
            .collect()
    }

    /// The log-probabilities of `picks[r].token` under row `r` of `logits` (`[picks.len(),
    /// vocab]`, read where they are) after `allowed[r]` (if any) set its disallowed logits to −∞,
    /// with `picks[r].top` alternatives ([`crate::sampling::token_logprobs`] is the definition;
    /// a device implementation returns the same bits). Checked as [`Backend::sample_masked`].
    fn token_logprobs_masked(
        &self,
        logits: &Tensor,
        vocab: usize,
        picks: &[LogprobPick],
        allowed: &[Option<&AllowedTokens>],
    ) -> Result<Vec<TokenLogprobs>, SampleRowsError> {
        check_logprob_picks(logits.len(), vocab, picks, allowed)?;
        logits
            .chunks_exact(vocab)
            .zip(picks.iter().zip(allowed))
            .enumerate()
            .map(|(row, (values, (pick, allowed)))| {
                crate::sampling::token_logprobs(values, *allowed, pick.token, pick.top)
                    .map_err(|source| SampleRowsError::Mask { row, source })
            })
            .collect()
    }

    /// One token per row of the fp32 logits `x · Wᵀ` ([`Backend::linear_f32`], `W [out, inp]`),
    /// sampled as [`Backend::sample_rows`] does: the head and the sampler of a step in one op, so a
    /// device backend keeps the logits where it computed them and returns only the ids.
    fn sample_linear(
        &self,
        x: &Tensor,
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
        logits: &Tensor,
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
    fn engram_gather(&self, table: &EngramTable, row_ids: &[u32]) -> Tensor {
        let mut out = vec![0.0f32; row_ids.len() * table.head_dim()];
        table.gather(row_ids, &mut out);
        out.into()
    }

    /// `x [rows, w.inp] · Wᵀ` in fp32 with the FP8 weight dequantised exactly and the activations
    /// left as they are (the transformers float32 numerics of V4); equals [`Backend::linear_f32`]
    /// on `w.to_f32()` without materialising it.
    fn linear_fp8_f32(&self, x: &Tensor, w: &Fp8Weight) -> Tensor {
        dequantised_linear(
            x.len(),
            w.out,
            w.inp,
            |row, block| fp8_row(w, row, block),
            |rows, n| self.linear_f32(x, rows, n, w.inp).into_vec(),
        )
        .into()
    }
    /// [`Backend::linear_fp8_f32`] for a packed FP4 weight.
    fn linear_fp4_f32(&self, x: &Tensor, w: &Fp4Weight) -> Tensor {
        dequantised_linear(
            x.len(),
            w.out,
            w.inp,
            |row, block| fp4_row(w, row, block),
            |rows, n| self.linear_f32(x, rows, n, w.inp).into_vec(),
        )
        .into()
    }

    /// `round(x · scale)` of every value, rounded at `precision` (the indexer's head weights,
    /// `v41::csa::index_queries`).
    fn scale_at(&self, x: Tensor, scale: f32, precision: Precision) -> Tensor {
        x.iter()
            .map(|w| precision.round(w * scale))
            .collect::<Vec<f32>>()
            .into()
    }
    /// `round(mean over the hc streams)` of every token of `streams [n, hc, dim]` → `[n, dim]`,
    /// the sum folded from 0 in stream order, rounded at `precision` (the DSpark taps).
    fn stream_means_at(
        &self,
        streams: &Tensor,
        hc: usize,
        dim: usize,
        precision: Precision,
    ) -> Tensor {
        if hc == 0 || dim == 0 {
            return Tensor::empty();
        }
        streams
            .chunks_exact(hc * dim)
            .flat_map(|token| {
                (0..dim).map(move |d| {
                    precision.round((0..hc).fold(0.0f32, |a, k| a + token[k * dim + d]) / hc as f32)
                })
            })
            .collect::<Vec<f32>>()
            .into()
    }
    /// Gated pooling of compressor groups → bf16 `[groups.len(), head_dim]`: group `g` pools its
    /// member rows `groups[g]` (each `kv ‖ gate`, `2 · head_dim` fp32 values, in position order,
    /// which is the fold order) channel by channel: the softmax of the gates over the members,
    /// the weighted sum of the values (`v41::csa::compress_chunk`).
    fn gated_pool_rows(&self, groups: &[Vec<&Tensor>], head_dim: usize) -> Tensor {
        groups
            .iter()
            .flat_map(|members| {
                let members: Vec<&[f32]> = members.iter().map(|row| &row[..]).collect();
                (0..head_dim)
                    .map(|c| pool_channel(&members, head_dim, c))
                    .collect::<Vec<f32>>()
            })
            .collect::<Vec<f32>>()
            .into()
    }
    /// [`EngramGate::inject`] of tokens `live` of `streams [tokens, hc, dim]`: live entry `i`
    /// (token `live[i]`, distinct) with its `kv` row `i` (`kv [live.len(), kv_stride]`, the hc
    /// keys then the value); the other tokens are left as they are.
    fn engram_inject(
        &self,
        streams: Tensor,
        kv: &Tensor,
        live: &[usize],
        gate: &EngramGate,
    ) -> Tensor {
        if live.is_empty() {
            return streams;
        }
        let mut streams = streams;
        let token_width = gate.hc_mult() * gate.dim();
        let kv_stride = kv.len() / live.len();
        let host = streams.host_mut();
        for (&token, kv) in live.iter().zip(kv.chunks_exact(kv_stride)) {
            gate.inject(
                &mut host[token * token_width..(token + 1) * token_width],
                kv,
            );
        }
        streams
    }
    /// `x + y` elementwise in fp32 (`y` as long as `x`).
    fn add(&self, x: Tensor, y: &Tensor) -> Tensor {
        let mut x = x;
        for (a, b) in x.host_mut().iter_mut().zip(y.iter()) {
            *a += b;
        }
        x
    }
    /// `x` where this backend's ops read it without a copy: as it is on the CPU; a host tensor
    /// uploaded once into device memory on a device backend (a step's embedded streams, which
    /// several ops of the first layer read).
    fn resident(&self, x: Tensor) -> Tensor {
        x
    }
    /// The index of the first maximum of every `width`-wide row of `x` (the drafter's greedy
    /// choice; rows hold no NaN).
    fn argmax_rows(&self, x: &Tensor, width: usize) -> Vec<u32> {
        if width == 0 {
            return Vec::new();
        }
        x.chunks_exact(width)
            .map(crate::v41::dspark::argmax)
            .collect()
    }
    /// The V4 hyper-head's collapse weights of every token of `x [n, hc · dim]` (`proj
    /// [hc, hc · dim]`, `base [hc]`): `σ(m_k · scale + base_k) + hc_eps` with
    /// `m = proj · x · rsqrt(mean(x²) + norm_eps)` → `[n, hc]` fp32 ([`crate::v4::hyper_head_weights`]).
    fn hyper_head_weights_rows(
        &self,
        x: &Tensor,
        proj: &[f32],
        base: &[f32],
        scale: f32,
        hc_eps: f32,
        norm_eps: f32,
    ) -> Tensor {
        let width = proj.len() / base.len().max(1);
        if width == 0 {
            return Tensor::empty();
        }
        x.chunks_exact(width)
            .flat_map(|x| crate::v4::hyper_head_weights(x, proj, base, scale, hc_eps, norm_eps))
            .collect::<Vec<f32>>()
            .into()
    }
    /// The V4 compressor's pooled entries → fp32 `[entries.len(), width]`: per channel, the softmax
    /// over an entry's slots of `gate + bias` weighting the slots' `kv` ([`crate::v4::PoolSlot`],
    /// [`crate::v4::pool_entry`]).
    fn compressor_pool_rows(
        &self,
        entries: &[Vec<crate::v4::PoolSlot<'_>>],
        width: usize,
    ) -> Tensor {
        entries
            .iter()
            .flat_map(|slots| crate::v4::pool_entry(slots, width))
            .collect::<Vec<f32>>()
            .into()
    }
    /// The V4 MoE of every row of `x [n, dim]` with exact (fp32) experts in one op, routed by the
    /// router's top-k or, on a hash layer, row `t` by the experts `hashed[t]` (weights from its own
    /// scores) — what `v41::moe::forward_rows` computes from the ops one by one, to the device's
    /// exponential; `None` when this backend has no such path (the model then runs those ops).
    fn moe_rows_exact(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
    ) -> Option<Tensor> {
        let _ = (x, layer, hashed);
        None
    }
}

/// The checks of [`Backend::token_logprobs_masked`]: those of [`check_sample_masked`] (the
/// picks are its rows).
pub fn check_logprob_picks(
    logits_len: usize,
    vocab: usize,
    picks: &[LogprobPick],
    allowed: &[Option<&AllowedTokens>],
) -> Result<(), SampleRowsError> {
    check_masked_rows(logits_len, vocab, picks.len(), allowed)
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

/// The checks of [`Backend::sample_masked`] (`logits_len` values), shared by every
/// implementation: the shape of [`check_sample_rows`], one mask entry per row, each mask within
/// the vocabulary and allowing some token.
pub fn check_sample_masked(
    logits_len: usize,
    vocab: usize,
    rows: &[RowSampling],
    allowed: &[Option<&AllowedTokens>],
) -> Result<(), SampleRowsError> {
    check_masked_rows(logits_len, vocab, rows.len(), allowed)
}

/// `logits_len` values are `rows` rows of `vocab`, with one mask entry per row, each within the
/// vocabulary and allowing some token.
fn check_masked_rows(
    logits_len: usize,
    vocab: usize,
    rows: usize,
    allowed: &[Option<&AllowedTokens>],
) -> Result<(), SampleRowsError> {
    if allowed.len() != rows {
        return Err(SampleRowsError::MaskCount {
            found: allowed.len(),
            rows,
        });
    }
    if rows == 0 && logits_len == 0 {
        return Ok(());
    }
    if vocab == 0 {
        return Err(SampleRowsError::EmptyVocab { rows });
    }
    if rows.checked_mul(vocab) != Some(logits_len) {
        return Err(SampleRowsError::LogitsShape {
            found: logits_len,
            rows,
            vocab,
        });
    }
    for (row, mask) in allowed.iter().enumerate() {
        if let Some(mask) = mask {
            mask.check_row(vocab)
                .map_err(|source| SampleRowsError::Mask { row, source })?;
        }
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

/// Gated pooling of channel `c` over a group's `kv ‖ gate` rows: softmax of the gates over the
/// group, the weighted sum of the values, bf16 ([`Backend::gated_pool_rows`]).
fn pool_channel(members: &[&[f32]], head_dim: usize, c: usize) -> f32 {
    let max = members
        .iter()
        .fold(f32::NEG_INFINITY, |m, r| m.max(r[head_dim + c]));
    let exps: Vec<f32> = members
        .iter()
        .map(|r| (r[head_dim + c] - max).exp())
        .collect();
    let sum = exps.iter().fold(0.0f32, |a, e| a + e);
    let value = members
        .iter()
        .zip(&exps)
        .fold(0.0f32, |a, (r, e)| a + r[c] * (e / sum));
    crate::quant::round_bf16(value)
}

/// Weight rows dequantised at a time by [`dequantised_linear`] (bounds its memory).
const DEQUANT_ROWS: usize = 256;

/// `x · Wᵀ` (`x` of `x_len` values) for a `[out, inp]` weight whose rows `dequant_row` appends to
/// a buffer, through `linear` (a block of dequantised rows, their count) one block of rows at a
/// time.
fn dequantised_linear(
    x_len: usize,
    out: usize,
    inp: usize,
    dequant_row: impl Fn(usize, &mut Vec<f32>),
    linear: impl Fn(&[f32], usize) -> Vec<f32>,
) -> Vec<f32> {
    let rows_of_x = x_len / inp.max(1);
    let mut y = vec![0.0f32; rows_of_x * out];
    let mut block = Vec::with_capacity(DEQUANT_ROWS.min(out) * inp);
    for start in (0..out).step_by(DEQUANT_ROWS) {
        let count = DEQUANT_ROWS.min(out - start);
        block.clear();
        for row in start..start + count {
            dequant_row(row, &mut block);
        }
        let part = linear(&block, count);
        for (r, chunk) in part.chunks_exact(count).enumerate() {
            y[r * out + start..r * out + start + count].copy_from_slice(chunk);
        }
    }
    y
}
