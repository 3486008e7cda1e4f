//! `CpuBackend` with some ops' results changed ([`Nudged`]): for tests that must see a change fail
//! (one value of one op moved), and for measuring what differences of a given size do to a
//! model's outputs (one bf16 ulp on a share of an op's outputs: the size of difference the V4.1
//! fixtures call free, `fixtures/v41/README.md`, "Tolerances").

use deepinfer_model::backend::select::{
    CandidateMask, IndexQueries, QueryKeys, SelectFrom, SelectPart, Selection,
};
use deepinfer_model::backend::weights::Linear;
use deepinfer_model::backend::{
    AttentionQueries, Backend, CpuBackend, DenseWeight, EngramInjection, ExpertRoute, Groups,
    HcCollapse, HcExpand, HcMixes, HcMixing, HcParams, HyperHead, LogprobPick, MaskedRows,
    MoeLayer, PoolSlot, Precision, QdqPoint, RmsNorm, Rotation, Routing, RowSampling,
    SampleRowsError, StreamShape, Tensor,
};
use deepinfer_model::engram::EngramTable;
use deepinfer_model::sampling::TokenLogprobs;
use deepinfer_model::weights::{Fp4Weight, Fp8Weight};
use std::sync::atomic::{AtomicU64, Ordering};

/// How [`Nudged`] changes a nudged op's result.
#[derive(Debug, Clone, Copy)]
pub enum Change {
    /// The first non-zero value `v` becomes `v · (1 + factor) + shift` (`route_experts`: the
    /// first route's first weight `w · (1 + factor)`).
    First { factor: f32, shift: f32 },
    /// Each non-zero value moves by one bf16 ulp (the values are bf16), up or down, with
    /// probability `per_million / 10^6`: a pure function of (`seed`, the op call's index since
    /// the backend was made, the value's index), so a run is reproducible.
    Bf16Ulps { seed: u64, per_million: u64 },
}

/// `CpuBackend` with the results of the ops named in `ops` changed by `change`, every other op the
/// reference's. The ops it can change: `gemm_fp8`, `gemm_fp4`, `linear_bf16`, `rms_norm`,
/// `sparse_attention_rows`, `hyper_head_weights_rows` and (`Change::First` only) `route_experts`.
#[derive(Debug)]
pub struct Nudged {
    inner: CpuBackend,
    ops: Vec<&'static str>,
    change: Change,
    calls: AtomicU64,
}

impl Nudged {
    /// `op`'s first non-zero value scaled by `1 + factor`.
    pub fn new(op: &'static str, factor: f32) -> Nudged {
        Nudged::changing(&[op], Change::First { factor, shift: 0.0 })
    }

    /// `op`'s first non-zero value plus `shift`.
    pub fn shifted(op: &'static str, shift: f32) -> Nudged {
        Nudged::changing(&[op], Change::First { factor: 0.0, shift })
    }

    /// `ops` changed by `change`.
    pub fn changing(ops: &[&'static str], change: Change) -> Nudged {
        Nudged {
            inner: CpuBackend,
            ops: ops.to_vec(),
            change,
            calls: AtomicU64::new(0),
        }
    }

    fn nudge(&self, op: &str, y: Tensor) -> Tensor {
        if !self.ops.contains(&op) {
            return y;
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let mut y = y.into_vec();
        match self.change {
            Change::First { factor, shift } => {
                if let Some(first) = y.iter_mut().find(|v| **v != 0.0) {
                    *first = *first * (1.0 + factor) + shift;
                }
            }
            Change::Bf16Ulps { seed, per_million } => {
                for (i, v) in y.iter_mut().enumerate() {
                    let draw = splitmix(seed ^ splitmix(call ^ splitmix(i as u64)));
                    if draw % 1_000_000 < per_million && *v != 0.0 {
                        // One bf16 ulp: the low 16 bits of a bf16 value's f32 bits are zero.
                        let bits = v.to_bits();
                        let ulp = 1u32 << 16;
                        let moved = if draw & (1 << 40) == 0 {
                            bits.wrapping_add(ulp)
                        } else {
                            bits.wrapping_sub(ulp)
                        };
                        *v = f32::from_bits(moved);
                    }
                }
            }
        }
        Tensor::from(y)
    }
}

/// SplitMix64's output function: a well-mixed 64-bit value of `z`.
fn splitmix(z: u64) -> u64 {
    let z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Backend for Nudged {
    fn name(&self) -> &str {
        "nudged cpu"
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn gemm_fp8(&self, x: &Tensor, w: &Fp8Weight) -> Tensor {
        self.nudge("gemm_fp8", self.inner.gemm_fp8(x, w))
    }
    fn linear_bf16(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor {
        self.nudge("linear_bf16", self.inner.linear_bf16(x, w))
    }
    fn rms_norm(&self, x: &Tensor, norm: RmsNorm<'_>) -> Tensor {
        self.nudge("rms_norm", self.inner.rms_norm(x, norm))
    }
    fn route_experts(&self, logits: &Tensor, routing: Routing<'_>) -> Vec<ExpertRoute> {
        let mut routes = self.inner.route_experts(logits, routing);
        if let Change::First { factor, .. } = self.change
            && self.ops.contains(&"route_experts")
            && let Some(w) = routes.first_mut().and_then(|r| r.weights.first_mut())
        {
            *w *= 1.0 + factor;
        }
        routes
    }
    fn gemm_fp4(&self, x: &Tensor, w: &Fp4Weight) -> Tensor {
        self.nudge("gemm_fp4", self.inner.gemm_fp4(x, w))
    }
    fn linear_f32(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor {
        self.inner.linear_f32(x, w)
    }
    fn linear_grouped_bf16(&self, x: &Tensor, w: &[f32], shape: Groups) -> Tensor {
        self.inner.linear_grouped_bf16(x, w, shape)
    }
    fn gather(&self, pieces: &[(&Tensor, usize)], width: usize) -> Tensor {
        self.inner.gather(pieces, width)
    }
    fn table_rows(&self, table: &[f32], width: usize, ids: &[u32]) -> Tensor {
        self.inner.table_rows(table, width, ids)
    }
    fn rope_qdq(
        &self,
        x: Tensor,
        norm: Option<RmsNorm<'_>>,
        layout: (usize, usize),
        rotation: &Rotation<'_>,
        point: QdqPoint,
    ) -> Tensor {
        // The norm through this backend's own (nudged when `rms_norm` is).
        let x = match norm {
            Some(norm) => self.rms_norm(&x, norm),
            None => x,
        };
        self.inner.rope_qdq(x, None, layout, rotation, point)
    }
    fn rope(&self, x: Tensor, layout: (usize, usize), rotation: &Rotation<'_>) -> Tensor {
        self.inner.rope(x, layout, rotation)
    }
    fn hc_mixes_rows(&self, x: &Tensor, params: &HcParams, mixing: &HcMixing) -> HcMixes {
        self.inner.hc_mixes_rows(x, params, mixing)
    }
    fn hc_collapse_rows_at(&self, x: &Tensor, collapse: HcCollapse<'_>) -> Tensor {
        self.inner.hc_collapse_rows_at(x, collapse)
    }
    fn hc_expand_rows_at(&self, y: &Tensor, expand: HcExpand<'_>) -> Tensor {
        self.inner.hc_expand_rows_at(y, expand)
    }
    fn sparse_attention_rows(
        &self,
        queries: AttentionQueries<'_>,
        keys: &[QueryKeys<'_>],
    ) -> Tensor {
        self.nudge(
            "sparse_attention_rows",
            self.inner.sparse_attention_rows(queries, keys),
        )
    }
    fn select_rows(
        &self,
        queries: IndexQueries<'_>,
        from: SelectFrom<'_>,
    ) -> (Selection, Option<CandidateMask>) {
        self.inner.select_rows(queries, from)
    }
    fn index_scores_rows_at(
        &self,
        queries: IndexQueries<'_>,
        part: SelectPart<'_>,
    ) -> Vec<Vec<f32>> {
        self.inner.index_scores_rows_at(queries, part)
    }
    fn moe_rows(&self, x: &Tensor, layer: &MoeLayer<'_>) -> Option<Tensor> {
        self.inner.moe_rows(x, layer)
    }
    fn sample_rows(
        &self,
        logits: &[f32],
        vocab: usize,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        self.inner.sample_rows(logits, vocab, rows)
    }
    fn sample_masked(
        &self,
        rows: MaskedRows<'_, RowSampling>,
    ) -> Result<Vec<u32>, SampleRowsError> {
        self.inner.sample_masked(rows)
    }
    fn token_logprobs_masked(
        &self,
        picks: MaskedRows<'_, LogprobPick>,
    ) -> Result<Vec<TokenLogprobs>, SampleRowsError> {
        self.inner.token_logprobs_masked(picks)
    }
    fn sample_linear(
        &self,
        x: &Tensor,
        head: DenseWeight<'_>,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        self.inner.sample_linear(x, head, rows)
    }
    fn engram_gather(&self, table: &EngramTable, row_ids: &[u32]) -> Tensor {
        self.inner.engram_gather(table, row_ids)
    }
    fn linear(&self, x: &Tensor, w: &Linear) -> Tensor {
        self.inner.linear(x, w)
    }
    fn scale_at(&self, x: Tensor, scale: f32, precision: Precision) -> Tensor {
        self.inner.scale_at(x, scale, precision)
    }
    fn stream_means_at(
        &self,
        streams: &Tensor,
        shape: StreamShape,
        precision: Precision,
    ) -> Tensor {
        self.inner.stream_means_at(streams, shape, precision)
    }
    fn gated_pool_rows(&self, groups: &[Vec<&Tensor>], head_dim: usize) -> Tensor {
        self.inner.gated_pool_rows(groups, head_dim)
    }
    fn engram_inject(&self, streams: Tensor, injection: EngramInjection<'_>) -> Tensor {
        self.inner.engram_inject(streams, injection)
    }
    fn add(&self, x: Tensor, y: &Tensor) -> Tensor {
        self.inner.add(x, y)
    }
    fn resident(&self, x: Tensor) -> Tensor {
        self.inner.resident(x)
    }
    fn argmax_rows(&self, x: &Tensor, width: usize) -> Vec<u32> {
        self.inner.argmax_rows(x, width)
    }
    fn hyper_head_weights_rows(&self, x: &Tensor, head: &HyperHead<'_>) -> Tensor {
        self.nudge(
            "hyper_head_weights_rows",
            self.inner.hyper_head_weights_rows(x, head),
        )
    }
    fn compressor_pool_rows(&self, entries: &[Vec<PoolSlot<'_>>], width: usize) -> Tensor {
        self.inner.compressor_pool_rows(entries, width)
    }
    fn moe_rows_exact(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
    ) -> Option<Tensor> {
        self.inner.moe_rows_exact(x, layer, hashed)
    }
}
