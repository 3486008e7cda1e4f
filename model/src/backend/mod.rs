//! The compute interface the V4.1 layer math is written against (ARCHITECTURE.md §3). An op works on
//! whole rows (row-major `f32` values holding bf16 or fp32 values as documented per op; the row ops
//! take and return [`Tensor`]s, which stay in device memory on a device backend), at the granularity
//! the model needs: block-scaled FP8/FP4 GEMMs, plain GEMMs, RMSNorm, RoPE,
//! the QDQ points, sparse attention with a sink, mHC mixes/collapse/expand, index scores and top-k,
//! the MoE router after its gate linear, the Engram table lookup and gate, and token sampling of a
//! batch of logit rows (each row with its own parameters: [`crate::sampling`] is its definition).
//!
//! Every op is a pure function of its inputs, so a sequence's numbers never depend on another
//! sequence or on how its tokens were chunked (batch invariance by construction).
//!
//! This module holds the declarations, their data types and the input checks every backend shares;
//! [`CpuBackend`] (`cpu.rs`) defines every op (the reference), `cuda/` implements them on the
//! device. The backend imports nothing from the model families (`model/tests/backend_floor.rs`).

pub mod comm_init;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod key_list;
pub mod position_ring;
pub mod select;
pub mod tensor;
pub mod weights;

pub use cpu::CpuBackend;
pub use key_list::{KeyList, KeyMirror, NO_KEYS};
pub use position_ring::{PositionRing, RingMirror, WindowKeys};
pub use select::{
    CandidateMask, Candidates, CompressedKeys, CompressedRows, IndexQueries, QueryKeys, SelectFrom,
    SelectPart, Selection,
};
pub use tensor::{Allocation, DeviceBuffer, DeviceView, Pinned, Tensor};

use crate::engram::gate::EngramGate;
use crate::engram::lookup::EngramTable;
use crate::sampling::{AllowedTokens, MaskError, SamplingParams, TokenLogprobs};
use crate::weights::{Fp4Weight, Fp8Weight};
use weights::{ExpertLinear, ExpertWeights, Linear};

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

    fn columns(&self, backend: &dyn Backend, first: usize, width: usize) -> Tensor {
        let pieces: Vec<(&Tensor, usize)> = (0..self.tokens())
            .map(|t| (&self.values, t * self.width() + first))
            .collect();
        backend.gather(&pieces, width)
    }
}

/// The constants of [`Backend::hc_mixes_rows`]: `hc` streams, `sinkhorn_iters` Sinkhorn
/// iterations, the mixes' `hc_eps` and the RMSNorm's `norm_eps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcMixing {
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

/// The V4 hyper-head's constants ([`Backend::hyper_head_weights_rows`]): `proj [hc, hc · dim]`,
/// `base [hc]`, the logits' `scale`, the weights' `hc_eps` and the RMSNorm's `norm_eps`.
#[derive(Debug, Clone, Copy)]
pub struct HyperHead<'a> {
    pub proj: &'a [f32],
    pub base: &'a [f32],
    pub scale: f32,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

/// The queries of a sparse attention ([`Backend::sparse_attention_rows`]): `q [n, heads ·
/// head_dim]`, a per-head `sink` in the softmax denominator, the logits' `scale`; probabilities
/// and output rounded at `precision`.
#[derive(Debug, Clone, Copy)]
pub struct AttentionQueries<'a> {
    pub q: &'a Tensor,
    pub sink: &'a [f32],
    pub scale: f32,
    pub precision: Precision,
}

/// A plain weight `W [out, inp]` (row-major fp32 values), by reference.
#[derive(Debug, Clone, Copy)]
pub struct DenseWeight<'a> {
    pub values: &'a [f32],
    pub out: usize,
    pub inp: usize,
}

/// A row-wise RMSNorm ([`Backend::rms_norm`]): rows of `weight.len()`, `eps` under the root,
/// results rounded at `precision`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm<'a> {
    pub weight: &'a [f32],
    pub eps: f32,
    pub precision: Precision,
}

/// How [`Backend::hc_collapse_rows_at`] collapses the `hc` streams of every token: by the
/// token's own `weights [n, hc]`, rounding at `precision`.
#[derive(Debug, Clone, Copy)]
pub struct HcCollapse<'a> {
    pub weights: &'a Tensor,
    pub hc: usize,
    pub precision: Precision,
}

/// How [`Backend::hc_expand_rows_at`] expands a sublayer's output back into the streams: the
/// `residual [n, hc, dim]` streams, each token's mix of `mixes`, rounding at `precision`.
#[derive(Debug, Clone, Copy)]
pub struct HcExpand<'a> {
    pub residual: &'a Tensor,
    pub mixes: &'a HcMixes,
    pub precision: Precision,
}

/// The layout of a step's mHC streams `[n, hc, dim]`: `hc` streams of `dim` per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamShape {
    pub hc: usize,
    pub dim: usize,
}

/// The shape of a grouped linear ([`Backend::linear_grouped_bf16`], [`linear_by_groups`]):
/// `groups` weights `[out, inp]` one after another; group `g` maps its `inp` columns of the input
/// to its `out` columns of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups {
    pub groups: usize,
    pub out: usize,
    pub inp: usize,
}

impl Groups {
    /// Group `g`'s weight `[out, inp]` among the grouped weights `w`.
    pub fn weight<'w>(&self, w: &'w [f32], g: usize) -> DenseWeight<'w> {
        let size = self.out * self.inp;
        DenseWeight {
            values: &w[g * size..(g + 1) * size],
            out: self.out,
            inp: self.inp,
        }
    }
}

/// A grouped linear from its groups ([`Groups`]): `x [n, groups · inp]`; `linear(inputs, g)` maps
/// group `g`'s columns `[n, inp]` to `[n, out]`; the groups' outputs side by side, `[n, groups ·
/// out]`.
pub fn linear_by_groups(
    backend: &dyn Backend,
    x: &Tensor,
    shape: Groups,
    linear: impl Fn(&Tensor, usize) -> Tensor,
) -> Tensor {
    let Groups { groups, out, inp } = shape;
    let n = x.len() / (groups * inp).max(1);
    let outputs: Vec<Tensor> = (0..groups)
        .map(|g| {
            let pieces: Vec<(&Tensor, usize)> =
                (0..n).map(|t| (x, (t * groups + g) * inp)).collect();
            linear(&backend.gather(&pieces, inp), g)
        })
        .collect();
    let pieces: Vec<(&Tensor, usize)> = (0..n)
        .flat_map(|t| outputs.iter().map(move |y| (y, t * out)))
        .collect();
    backend.gather(&pieces, out)
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

/// A quantisation point of the activations (v41-architecture.md §3.0): values quantised and
/// dequantised in place, in consecutive groups (a shorter last group is allowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QdqPoint {
    /// Groups of 32, UE8M0 scale, E4M3 values (the window entries).
    Q8,
    /// Groups of 32, UE8M0 scale, E2M1 values (the indexer's queries and keys).
    Q4e,
    /// Groups of 16, E4M3 scale, E2M1 values (the compressed entries).
    Q4m,
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

/// How [`Backend::rope`] rotates the rows of a step: channel pair `i` of row `r` by the angle
/// `±positions[r] · table.freqs[i]` (`inverse`: the negative one), rounding at `precision`.
#[derive(Debug, Clone, Copy)]
pub struct Rotation<'a> {
    pub table: &'a RopeTable,
    pub positions: &'a [usize],
    pub inverse: bool,
    pub precision: Precision,
}

impl<'a> Rotation<'a> {
    /// The rotation by `+position · freq` of rows at `positions`.
    pub fn new(table: &'a RopeTable, positions: &'a [usize], precision: Precision) -> Rotation<'a> {
        Rotation {
            table,
            positions,
            inverse: false,
            precision,
        }
    }

    /// The same rotation by the negative angle.
    pub fn inverse(self) -> Rotation<'a> {
        Rotation {
            inverse: true,
            ..self
        }
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

/// How [`Backend::route_experts`] routes: selection on the scores plus `bias` (the layer's `bias`
/// or `bias_vl`, one per expert) as `selection` says, the weights scaled by `route_scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routing<'a> {
    pub bias: &'a [f32],
    pub selection: ExpertSelection<'a>,
    pub route_scale: f32,
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

/// One slot of a compressed entry ([`Backend::compressor_pool_rows`]): a token's raw `kv ‖ gate`
/// row, the column offset of the slot's series inside each half, and the slot's position-bias row
/// (as wide as one half).
#[derive(Debug, Clone, Copy)]
pub struct PoolSlot<'a> {
    pub raw: &'a Tensor,
    pub offset: usize,
    pub bias: &'a [f32],
}

/// What [`Backend::engram_inject`] adds to the streams: live entry `i` is token `live[i]`
/// (distinct) with its `kv` row `i` (`kv [live.len(), kv_stride]`, the hc keys then the value),
/// injected through `gate`.
#[derive(Debug, Clone, Copy)]
pub struct EngramInjection<'a> {
    pub kv: &'a Tensor,
    pub live: &'a [usize],
    pub gate: &'a EngramGate,
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
    fn linear_bf16(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor;
    /// Plain `x · Wᵀ` with fp32 output (no rounding).
    fn linear_f32(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor;
    /// The grouped bf16 linear (V4.1's grouped `wo_a`): `x [n, groups · inp]`, `w` the `groups`
    /// weights `[out, inp]` one after another; group `g` is [`Backend::linear_bf16`] of the
    /// columns `[g · inp, (g + 1) · inp)` of `x` into the columns `[g · out, (g + 1) · out)` of
    /// the result `[n, groups · out]` ([`linear_by_groups`] is the definition).
    fn linear_grouped_bf16(&self, x: &Tensor, w: &[f32], shape: Groups) -> Tensor;
    /// `width` values from each `(tensor, offset)` of `pieces`, one after another: the row
    /// movement between ops (gathering rows, columns, interleaving) without leaving the device.
    fn gather(&self, pieces: &[(&Tensor, usize)], width: usize) -> Tensor;
    /// Rows `ids` of the row-major host table `table` (`width` values a row), one after another:
    /// a step's token embeddings. A device backend keeps the table resident from its first call
    /// on, so a step uploads only its ids. Every id must be a row of the table (the model checks
    /// token ids against the vocabulary before a step).
    fn table_rows(&self, table: &[f32], width: usize, ids: &[u32]) -> Tensor;
    /// The rotated, quantised rows of a cache or an index: [`Backend::rms_norm`] by `norm` when
    /// given, then [`Backend::rope`] of `layout` by `rotation` (a table without frequencies
    /// rotates nothing), then the QDQ `point` over the values in its groups — one op, so that a
    /// device runs it as one pass.
    fn rope_qdq(
        &self,
        x: Tensor,
        norm: Option<RmsNorm<'_>>,
        layout: (usize, usize),
        rotation: &Rotation<'_>,
        point: QdqPoint,
    ) -> Tensor;
    /// Row-wise RMSNorm over rows of `norm.weight.len()`, `round(w · (x · rsqrt(mean(x²) +
    /// eps)))` rounded at `norm.precision` ([`RmsNorm`]).
    fn rms_norm(&self, x: &Tensor, norm: RmsNorm<'_>) -> Tensor;
    /// Rotates the last `2 · table.freqs.len()` channels of every `stride`-wide vector of `x`,
    /// `layout = (stride, vectors_per_row)`: the `vectors_per_row` consecutive vectors of row `r`
    /// by `rotation` at `positions[r]` ([`Rotation`]).
    fn rope(&self, x: Tensor, layout: (usize, usize), rotation: &Rotation<'_>) -> Tensor;

    /// The mHC coefficients ([`HcMix`]) of every token's streams `x [n, hc · dim]` (a token's
    /// width `hc · dim` is the projection's input width).
    fn hc_mixes_rows(&self, x: &Tensor, params: &HcParams, mixing: &HcMixing) -> HcMixes;
    /// `round(Σ_k w_k · x_k)` over the `hc` streams of every token: `x [n, hc, dim]` with its own
    /// weights `collapse.weights [n, hc]` → `[n, dim]`, rounded at `collapse.precision`.
    fn hc_collapse_rows_at(&self, x: &Tensor, collapse: HcCollapse<'_>) -> Tensor;
    /// `X'_k = round(post_k · y + Σ_j comb[j][k] · X_j)` of every token: `y [n, dim]`,
    /// `expand.residual [n, hc, dim]`, each token's mix → `[n, hc, dim]`, rounded at
    /// `expand.precision`.
    fn hc_expand_rows_at(&self, y: &Tensor, expand: HcExpand<'_>) -> Tensor;
    /// Multi-head attention of `keys.len()` queries ([`AttentionQueries`]), query `t` over its
    /// own keys `keys[t]` (K = V, each key one `head_dim` row: a run of a window ring, keys
    /// listed one by one and a selection or a prefix of a compressed list, [`QueryKeys`], so that
    /// the rings' and lists' device mirrors and a selection left on the device are read there) →
    /// `[n, heads · head_dim]`.
    fn sparse_attention_rows(
        &self,
        queries: AttentionQueries<'_>,
        keys: &[QueryKeys<'_>],
    ) -> Tensor;
    /// The indexer's selection of a step's queries ([`IndexQueries`], the queries of `from.parts`
    /// in order; query `t` of a part scores the first `visible[t]` of its part's keys): the top
    /// `min(k, visible)` scores of each (ties: lower index), ascending, one selection row per
    /// query; restricted or accompanied by the two-level top-k's candidate mask (one row per
    /// query) as `from.candidates` says ([`select::select_host`] is the definition).
    fn select_rows(
        &self,
        queries: IndexQueries<'_>,
        from: SelectFrom<'_>,
    ) -> (Selection, Option<CandidateMask>);
    /// Index scores `Σ_h w_h · ReLU(q_h · k)` of `part.visible.len()` queries ([`IndexQueries`]):
    /// query `t` scores the first `part.visible[t]` of `part.keys` (each one `head_dim` row).
    fn index_scores_rows_at(
        &self,
        queries: IndexQueries<'_>,
        part: SelectPart<'_>,
    ) -> Vec<Vec<f32>>;

    /// The whole MoE of every row of `x [n, dim]` in one op — the router (top-k on the layer's
    /// bias), the routed experts (each row's outputs added in increasing expert id), the shared
    /// expert, one rounding — bit for bit as `layers::moe::forward_rows` computes it from the ops
    /// one by one; `None` when this backend has no fused path for the layer (the model then runs
    /// those ops).
    fn moe_rows(&self, x: &Tensor, layer: &MoeLayer<'_>) -> Option<Tensor>;

    /// One token per row of `logits` (`[rows.len(), vocab]`), each row sampled with its own
    /// parameters and position exactly as [`crate::sampling::sample`] does (the one definition of
    /// the sampling math; a device implementation must return the same ids).
    fn sample_rows(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError>;

    /// [`Backend::sample_rows`] of the [`MaskedRows`] `rows` (the logits read where they are on
    /// a device backend) with row `r` restricted to `allowed[r]` when given: its disallowed
    /// logits are −∞ before the sampling math ([`crate::sampling::sample_allowed`] is the
    /// definition). A mask wider than the vocabulary or allowing nothing is
    /// [`SampleRowsError::Mask`] naming the row.
    fn sample_masked(&self, rows: MaskedRows<'_, RowSampling>)
    -> Result<Vec<u32>, SampleRowsError>;

    /// The log-probabilities of `picks.rows[r].token` under row `r` of the [`MaskedRows`] `picks`
    /// after `allowed[r]` (if any) set its disallowed logits to −∞, with `picks.rows[r].top`
    /// alternatives ([`crate::sampling::token_logprobs`] is the definition; a device
    /// implementation returns the same bits). Checked as [`Backend::sample_masked`].
    fn token_logprobs_masked(
        &self,
        picks: MaskedRows<'_, LogprobPick>,
    ) -> Result<Vec<TokenLogprobs>, SampleRowsError>;

    /// One token per row of the fp32 logits `x · Wᵀ` ([`Backend::linear_f32`], `W [out, inp]`),
    /// sampled as [`Backend::sample_rows`] does: the head and the sampler of a step in one op, so a
    /// device backend keeps the logits where it computed them and returns only the ids.
    fn sample_linear(
        &self,
        x: &Tensor,
        head: DenseWeight<'_>,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError>;

    /// The MoE router after the gate linear, one token per `routing.bias.len()`-wide row of
    /// `logits` (`z`): scores `s = sqrt(softplus(z))` (the reference's vectorised softplus,
    /// [`cpu::router_scores`]), selection on `s + bias` ([`ExpertSelection`]), weights
    /// `s_e / (Σ s + 1e-20) · route_scale` over the selected experts (not normalised for a single
    /// expert) ([`Routing`]). No logits (or no experts): no routes.
    fn route_experts(&self, logits: &Tensor, routing: Routing<'_>) -> Vec<ExpertRoute>;

    /// The bf16 values of Engram table rows `row_ids`, one `table.head_dim()`-wide row after
    /// another ([`EngramTable::gather`]: FP8 codes times their row scales; foreign ids give zeros).
    fn engram_gather(&self, table: &EngramTable, row_ids: &[u32]) -> Tensor;

    /// `x [rows, inp] · Wᵀ` → fp32 `[rows, out]` for a V4 projection in its stored format
    /// ([`Linear`]: dense, FP8 or FP4). The reference: fp32 with the weight dequantised exactly
    /// and the activations left as they are (the transformers float32 numerics of V4), i.e.
    /// [`Backend::linear_f32`] on the dense weight without materialising it. A `fast` CUDA
    /// backend runs it on tensor cores instead (`cuda/dense.rs`), within its error bound.
    fn linear(&self, x: &Tensor, w: &Linear) -> Tensor;

    /// `round(x · scale)` of every value, rounded at `precision` (the indexer's head weights,
    /// `v41::csa::index_queries`).
    fn scale_at(&self, x: Tensor, scale: f32, precision: Precision) -> Tensor;
    /// `round(mean over the hc streams)` of every token of `streams [n, hc, dim]` (`shape`) →
    /// `[n, dim]`, the sum folded from 0 in stream order, rounded at `precision` (the DSpark
    /// taps).
    fn stream_means_at(&self, streams: &Tensor, shape: StreamShape, precision: Precision)
    -> Tensor;
    /// Gated pooling of compressor groups → bf16 `[groups.len(), head_dim]`: group `g` pools its
    /// member rows `groups[g]` (each `kv ‖ gate`, `2 · head_dim` fp32 values, in position order,
    /// which is the fold order) channel by channel: the softmax of the gates over the members,
    /// the weighted sum of the values (`v41::csa::compress_chunk`).
    fn gated_pool_rows(&self, groups: &[Vec<&Tensor>], head_dim: usize) -> Tensor;
    /// [`EngramGate::inject`] of the live tokens of `streams [tokens, hc, dim]`, each with its
    /// `kv` row ([`EngramInjection`]); the other tokens are left as they are.
    fn engram_inject(&self, streams: Tensor, injection: EngramInjection<'_>) -> Tensor;
    /// `x + y` elementwise in fp32 (`y` as long as `x`).
    fn add(&self, x: Tensor, y: &Tensor) -> Tensor;
    /// `x` where this backend's ops read it without a copy: as it is on the CPU; a host tensor
    /// uploaded once into device memory on a device backend (a step's embedded streams, which
    /// several ops of the first layer read).
    fn resident(&self, x: Tensor) -> Tensor;
    /// The index of the first maximum of every `width`-wide row of `x` (the drafter's greedy
    /// choice; rows hold no NaN).
    fn argmax_rows(&self, x: &Tensor, width: usize) -> Vec<u32>;
    /// The V4 hyper-head's collapse weights of every token of `x [n, hc · dim]` (`proj
    /// [hc, hc · dim]`, `base [hc]`): `σ(m_k · scale + base_k) + hc_eps` with
    /// `m = proj · x · rsqrt(mean(x²) + norm_eps)` → `[n, hc]` fp32 ([`cpu::hyper_head_weights`]).
    fn hyper_head_weights_rows(&self, x: &Tensor, head: &HyperHead<'_>) -> Tensor;
    /// The V4 compressor's pooled entries → fp32 `[entries.len(), width]`: per channel, the softmax
    /// over an entry's slots of `gate + bias` weighting the slots' `kv` ([`PoolSlot`],
    /// [`cpu::pool_entry`]).
    fn compressor_pool_rows(&self, entries: &[Vec<PoolSlot<'_>>], width: usize) -> Tensor;
    /// The V4 MoE of every row of `x [n, dim]` with exact (fp32) experts in one op, routed by the
    /// router's top-k or, on a hash layer, row `t` by the experts `hashed[t]` (weights from its own
    /// scores) — what `layers::moe::forward_rows` computes from the ops one by one, to the device's
    /// exponential; `None` when this backend has no such path (the model then runs those ops).
    fn moe_rows_exact(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
    ) -> Option<Tensor>;
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

/// Logits rows `logits` (`[rows.len(), vocab]`, a tensor) with one entry of `rows` (a row's
/// sampling, or a token whose log-probability is asked) and one optional mask of `allowed` per
/// row ([`Backend::sample_masked`], [`Backend::token_logprobs_masked`]).
pub struct MaskedRows<'a, R> {
    pub logits: &'a Tensor,
    pub vocab: usize,
    pub rows: &'a [R],
    pub allowed: &'a [Option<&'a AllowedTokens>],
}

impl<R> Clone for MaskedRows<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for MaskedRows<'_, R> {}

impl<R> MaskedRows<'_, R> {
    /// The checks every implementation shares: the shape of [`check_sample_rows`], one mask
    /// entry per row, each mask within the vocabulary and allowing some token.
    pub fn check(&self) -> Result<(), SampleRowsError> {
        check_masked_rows(self.logits.len(), self.vocab, self.rows.len(), self.allowed)
    }
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
