//! `CpuBackend`: the plain reference implementation of [`Backend`]. Reductions are order-free (f64
//! accumulator rounded once to fp32, see [`dot_f32`]) except the plain linears, which follow the
//! summation order of the reference's CPU GEMMs — fp32 (`linear_f32`: router, head, ratio-2
//! compressor, and the mHC mixes projection: [`quant::dot_f32_sgemm`]) and bf16 (`linear_bf16`:
//! `wo_a`, ratio-1 compressor, index keys and head weights: [`quant::dot_bf16_gemm`]) — and the sums
//! the reference takes with torch's CPU `sum` ([`quant::sum_f32_torch`]): the means of squares
//! (RMSNorm, mHC) and the sparse attention's probability sums. `exp` follows the reference's two
//! kinds: its standalone `torch.exp`, which the fixtures' reference evaluates correctly rounded
//! ([`quant::exp_f32_accurate`]: the attention's online softmax and the mHC `comb` softmax), and
//! the vectorised one of torch's fused kernels ([`quant::exp_f32`]: sigmoids, SiLU, softplus).
//! `sqrt` is the correctly rounded one everywhere, as the reference's; RoPE rotates by the C
//! library's `cosf`/`sinf` ([`RopeTable::cos_sin`]), as the reference's. Every bf16 rounding sits
//! where DeepSeek's reference rounds; fp32 stays the working precision between operations.

mod dequant;
mod pool;

pub use pool::pool_entry;

use self::dequant::{DequantRow, dequantised_linear, fp4_row, fp8_row};
use self::pool::pool_channel;
use super::weights::Linear;
use super::{
    AttentionQueries, Backend, CandidateMask, DenseWeight, EngramInjection, ExpertRoute,
    ExpertSelection, Groups, HcCollapse, HcExpand, HcMix, HcMixes, HcMixing, HcParams, HyperHead,
    IndexQueries, LogprobPick, MaskedRows, MoeLayer, PoolSlot, Precision, QdqPoint, QueryKeys,
    RmsNorm, Rotation, Routing, RowSampling, SampleRowsError, SelectFrom, SelectPart, Selection,
    StreamShape, Tensor, check_sample_rows,
};
use crate::engram::lookup::EngramTable;
use crate::quant::{
    self, dot_bf16_gemm, dot_f32, dot_f32_sgemm, exp_f32, exp_f32_accurate, log1p_f32, sum_f32,
    sum_f32_torch, sum_squares_f32, sum_squares_f32_torch,
};
use crate::sampling::TokenLogprobs;
use crate::weights::{Fp4Weight, Fp8Weight};

/// Probabilities are accumulated in blocks of this many keys (the reference kernel's block).
const ATTENTION_BLOCK: usize = 64;

/// The reference CPU backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> CpuBackend {
        CpuBackend
    }
}

/// `x · Wᵀ` row by row, output `(r, o)` the `dot` of row `r` of `x` and row `o` of `W` (of which at
/// most `w.out` rows are read: a shorter weight yields the rows it has).
fn linear_rows(x: &Tensor, w: DenseWeight<'_>, dot: impl Fn(&[f32], &[f32]) -> f32) -> Tensor {
    let DenseWeight { values, out, inp } = w;
    let rows = x.len() / inp;
    let mut y = Vec::with_capacity(rows * out);
    for row in x.chunks_exact(inp) {
        for w_row in values.chunks_exact(inp).take(out) {
            y.push(dot(row, w_row));
        }
    }
    y.into()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// The one-token (one-query) cases the row ops of the [`Backend`] impl are made of.
impl CpuBackend {
    /// The mHC coefficients of one token's streams `x [hc, dim]`.
    fn hc_mixes(&self, x: &[f32], params: &HcParams, mixing: &HcMixing) -> HcMix {
        let HcMixing {
            hc,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
        } = *mixing;
        let n = x.len();
        let mean_square = sum_squares_f32_torch(x) / n as f32;
        let inv = 1.0 / (mean_square + norm_eps).sqrt();
        let mixes: Vec<f32> = params
            .proj
            .chunks_exact(n)
            .map(|row| dot_f32_sgemm(x, row) * inv)
            .collect();
        let pre = (0..hc)
            .map(|k| sigmoid(mixes[k] * params.scale[0] + params.base[k]) + hc_eps)
            .collect();
        let post = (0..hc)
            .map(|k| 2.0 * sigmoid(mixes[hc + k] * params.scale[1] + params.base[hc + k]))
            .collect();
        let mut comb: Vec<f32> = (0..hc * hc)
            .map(|i| mixes[2 * hc + i] * params.scale[2] + params.base[2 * hc + i])
            .collect();
        // Row softmax (+eps), then column normalisation, then (iters − 1) row/column passes. The
        // softmax is the reference's explicit `torch.exp` of the max-shifted logits, divided by
        // the row sum: the accurate `exp`, not the sigmoid's vectorised one.
        for row in comb.chunks_exact_mut(hc) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for v in row.iter_mut() {
                *v = exp_f32_accurate(*v - max);
            }
            let sum = row.iter().fold(0.0f32, |a, v| a + v);
            for v in row.iter_mut() {
                *v = *v / sum + hc_eps;
            }
        }
        normalise_columns(&mut comb, hc, hc_eps);
        for _ in 1..sinkhorn_iters {
            for row in comb.chunks_exact_mut(hc) {
                let sum = row.iter().fold(0.0f32, |a, v| a + v) + hc_eps;
                for v in row.iter_mut() {
                    *v /= sum;
                }
            }
            normalise_columns(&mut comb, hc, hc_eps);
        }
        HcMix { pre, post, comb }
    }

    /// Single-query multi-head attention over `keys` (K = V, each `head_dim` long) with a per-head
    /// sink in the denominator: `q [heads, head_dim]` → `[heads, head_dim]`, probabilities and
    /// output rounded at `precision`.
    fn sparse_attention(
        &self,
        q: &[f32],
        keys: &[&[f32]],
        sink: &[f32],
        scale: f32,
        precision: Precision,
    ) -> Vec<f32> {
        let heads = sink.len();
        let head_dim = q.len() / heads;
        let mut out = vec![0.0f32; q.len()];
        for h in 0..heads {
            let q_head = &q[h * head_dim..(h + 1) * head_dim];
            let mut running_max = -1e30f32;
            let mut denominator = 0.0f32;
            let mut acc = vec![0.0f32; head_dim];
            for block in keys.chunks(ATTENTION_BLOCK) {
                let scores: Vec<f32> = block.iter().map(|k| dot_f32(q_head, k) * scale).collect();
                let block_max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let new_max = running_max.max(block_max);
                let rescale = exp_f32_accurate(running_max - new_max);
                let probs: Vec<f32> = scores
                    .iter()
                    .map(|s| exp_f32_accurate(s - new_max))
                    .collect();
                denominator = denominator * rescale + sum_f32_torch(&probs);
                for a in acc.iter_mut() {
                    *a *= rescale;
                }
                let weights: Vec<f32> = probs.iter().map(|&p| precision.round(p)).collect();
                for d in 0..head_dim {
                    acc[d] += sum_f32(weights.iter().zip(block).map(|(p, k)| p * k[d]));
                }
                running_max = new_max;
            }
            denominator += exp_f32_accurate(sink[h] - running_max);
            for d in 0..head_dim {
                out[h * head_dim + d] = precision.round(acc[d] / denominator);
            }
        }
        out
    }

    /// `round(Σ_k w_k · x_k)` over the `w.len()` streams of `x [hc, dim]`.
    fn hc_collapse(&self, x: &[f32], weights: &[f32], precision: Precision) -> Vec<f32> {
        let dim = x.len() / weights.len();
        (0..dim)
            .map(|d| {
                let sum = weights
                    .iter()
                    .enumerate()
                    .fold(0.0f32, |acc, (k, w)| acc + w * x[k * dim + d]);
                precision.round(sum)
            })
            .collect()
    }

    /// `X'_k = round(post_k · y + Σ_j comb[j][k] · X_j)`.
    fn hc_expand(
        &self,
        y: &[f32],
        residual: &[f32],
        mix: &HcMix,
        precision: Precision,
    ) -> Vec<f32> {
        let hc = mix.post.len();
        let dim = y.len();
        let mut out = vec![0.0f32; hc * dim];
        for k in 0..hc {
            for d in 0..dim {
                let mixed = (0..hc).fold(0.0f32, |acc, j| {
                    acc + mix.comb[j * hc + k] * residual[j * dim + d]
                });
                out[k * dim + d] = precision.round(mix.post[k] * y[d] + mixed);
            }
        }
        out
    }

    /// Index scores `Σ_h w_h · ReLU(q_h · k)` of one query (`q [heads, head_dim]`, per-head
    /// `weights`) against `keys` (`[n, head_dim]`).
    fn index_scores(
        &self,
        q: &[f32],
        weights: &[f32],
        keys: &[f32],
        head_dim: usize,
        precision: Precision,
    ) -> Vec<f32> {
        keys.chunks_exact(head_dim)
            .map(|key| {
                let per_head = weights
                    .iter()
                    .zip(q.chunks_exact(head_dim))
                    .map(|(w, q_head)| {
                        let logit = precision.round(dot_f32(q_head, key));
                        precision.round(logit.max(0.0) * w)
                    });
                precision.round(sum_f32(per_head))
            })
            .collect()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn gemm_fp8(&self, x: &Tensor, w: &Fp8Weight) -> Tensor {
        quant::gemm_fp8(x, w).into()
    }

    fn gemm_fp4(&self, x: &Tensor, w: &Fp4Weight) -> Tensor {
        quant::gemm_fp4(x, w).into()
    }

    fn linear_bf16(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor {
        linear_rows(x, w, |row, w_row| {
            quant::round_bf16(dot_bf16_gemm(row, w_row))
        })
    }

    fn linear_grouped_bf16(&self, x: &Tensor, w: &[f32], shape: Groups) -> Tensor {
        super::linear_by_groups(self, x, shape, |inputs, g| {
            self.linear_bf16(inputs, shape.weight(w, g))
        })
    }

    fn linear_f32(&self, x: &Tensor, w: DenseWeight<'_>) -> Tensor {
        linear_rows(x, w, dot_f32_sgemm)
    }

    fn rms_norm(&self, x: &Tensor, norm: RmsNorm<'_>) -> Tensor {
        let (weight, eps, precision) = (norm.weight, norm.eps, norm.precision);
        let dim = weight.len();
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks_exact(dim) {
            let mean_square = sum_squares_f32_torch(row) / dim as f32;
            let inv = 1.0 / (mean_square + eps).sqrt();
            y.extend(
                row.iter()
                    .zip(weight)
                    .map(|(v, w)| precision.round(w * (v * inv))),
            );
        }
        y.into()
    }

    fn rope(&self, mut x: Tensor, layout: (usize, usize), rotation: &Rotation<'_>) -> Tensor {
        let (stride, vectors_per_row) = layout;
        let Rotation {
            table,
            positions,
            inverse,
            precision,
        } = *rotation;
        let pairs = table.freqs.len();
        let tail = stride - 2 * pairs;
        for (vector_index, vector) in x.host_mut().chunks_exact_mut(stride).enumerate() {
            let position = positions[vector_index / vectors_per_row];
            for i in 0..pairs {
                let (cos, sin) = table.cos_sin(position, i);
                let sin = if inverse { -sin } else { sin };
                let re = vector[tail + 2 * i];
                let im = vector[tail + 2 * i + 1];
                vector[tail + 2 * i] = precision.round(re * cos - im * sin);
                vector[tail + 2 * i + 1] = precision.round(re * sin + im * cos);
            }
        }
        x
    }

    fn rope_qdq(
        &self,
        x: Tensor,
        norm: Option<RmsNorm<'_>>,
        layout: (usize, usize),
        rotation: &Rotation<'_>,
        point: QdqPoint,
    ) -> Tensor {
        let x = match norm {
            Some(norm) => self.rms_norm(&x, norm),
            None => x,
        };
        let mut x = self.rope(x, layout, rotation);
        let values = x.host_mut();
        match point {
            QdqPoint::Q8 => quant::q8_qdq_group32(values),
            QdqPoint::Q4e => quant::q4_qdq_e8m0_group32(values),
            QdqPoint::Q4m => quant::q4_qdq_e4m3_group16(values),
        }
        x
    }

    fn gather(&self, pieces: &[(&Tensor, usize)], width: usize) -> Tensor {
        let mut out = Vec::with_capacity(pieces.len() * width);
        for (tensor, offset) in pieces {
            out.extend_from_slice(&tensor[*offset..*offset + width]);
        }
        out.into()
    }
    fn table_rows(&self, table: &[f32], width: usize, ids: &[u32]) -> Tensor {
        let mut out = Vec::with_capacity(ids.len() * width);
        for &id in ids {
            let at = id as usize * width;
            out.extend_from_slice(&table[at..at + width]);
        }
        out.into()
    }
    fn hc_mixes_rows(&self, x: &Tensor, params: &HcParams, mixing: &HcMixing) -> HcMixes {
        let hc = mixing.hc;
        let width = params.proj.len() / ((2 + hc) * hc).max(1);
        if width == 0 {
            return HcMixes::from_host(hc, &[]);
        }
        let mixes: Vec<HcMix> = x
            .chunks_exact(width)
            .map(|token| self.hc_mixes(token, params, mixing))
            .collect();
        HcMixes::from_host(hc, &mixes)
    }
    fn hc_collapse_rows_at(&self, x: &Tensor, collapse: HcCollapse<'_>) -> Tensor {
        let (weights, hc, precision) = (collapse.weights, collapse.hc, collapse.precision);
        let tokens = weights.len() / hc.max(1);
        if tokens == 0 {
            return Tensor::empty();
        }
        x.chunks_exact(x.len() / tokens)
            .zip(weights.chunks_exact(hc))
            .flat_map(|(x, w)| self.hc_collapse(x, w, precision))
            .collect::<Vec<f32>>()
            .into()
    }
    fn hc_expand_rows_at(&self, y: &Tensor, expand: HcExpand<'_>) -> Tensor {
        let HcExpand {
            residual,
            mixes,
            precision,
        } = expand;
        let tokens = mixes.tokens();
        if tokens == 0 {
            return Tensor::empty();
        }
        let (dim, width) = (y.len() / tokens, residual.len() / tokens);
        y.chunks_exact(dim)
            .zip(residual.chunks_exact(width))
            .enumerate()
            .flat_map(|(t, (y, r))| self.hc_expand(y, r, &mixes.token(t), precision))
            .collect::<Vec<f32>>()
            .into()
    }
    fn sparse_attention_rows(
        &self,
        queries: AttentionQueries<'_>,
        keys: &[QueryKeys<'_>],
    ) -> Tensor {
        if keys.is_empty() {
            return Tensor::empty();
        }
        let AttentionQueries { q, sink, .. } = queries;
        q.chunks_exact(q.len() / keys.len())
            .zip(keys)
            .flat_map(|(q, keys)| {
                let keys: Vec<&[f32]> = keys.flattened().into_iter().map(|k| &k[..]).collect();
                self.sparse_attention(q, &keys, sink, queries.scale, queries.precision)
            })
            .collect::<Vec<f32>>()
            .into()
    }
    fn select_rows(
        &self,
        queries: IndexQueries<'_>,
        from: SelectFrom<'_>,
    ) -> (Selection, Option<CandidateMask>) {
        let Ok(scores) = super::select::scores_by_part(queries, from.parts, |queries, part| {
            Ok::<_, std::convert::Infallible>(self.index_scores_rows_at(queries, part))
        });
        super::select::select_host(scores, from.k, from.candidates)
    }
    fn index_scores_rows_at(
        &self,
        queries: IndexQueries<'_>,
        part: SelectPart<'_>,
    ) -> Vec<Vec<f32>> {
        let (visible, head_dim) = (part.visible, queries.head_dim);
        if visible.is_empty() {
            return Vec::new();
        }
        let flat: Vec<f32> = part.keys.iter().flat_map(|k| k.iter().copied()).collect();
        let (q, weights) = (queries.q, queries.weights);
        q.chunks_exact(q.len() / visible.len())
            .zip(weights.chunks_exact(weights.len() / visible.len()))
            .zip(visible)
            .map(|((q, w), &seen)| {
                let seen = (seen * head_dim).min(flat.len());
                self.index_scores(q, w, &flat[..seen], head_dim, queries.precision)
            })
            .collect()
    }
    fn moe_rows(&self, x: &Tensor, layer: &MoeLayer<'_>) -> Option<Tensor> {
        let _ = (x, layer);
        None
    }
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
    fn sample_masked(
        &self,
        rows: MaskedRows<'_, RowSampling>,
    ) -> Result<Vec<u32>, SampleRowsError> {
        rows.check()?;
        if rows.rows.is_empty() {
            return Ok(Vec::new());
        }
        rows.logits
            .chunks_exact(rows.vocab)
            .zip(rows.rows.iter().zip(rows.allowed))
            .enumerate()
            .map(|(row, (values, (r, allowed)))| {
                crate::sampling::sample_allowed(values, &r.params, r.position, *allowed)
                    .map_err(|source| SampleRowsError::Mask { row, source })
            })
            .collect()
    }
    fn token_logprobs_masked(
        &self,
        picks: MaskedRows<'_, LogprobPick>,
    ) -> Result<Vec<TokenLogprobs>, SampleRowsError> {
        picks.check()?;
        picks
            .logits
            .chunks_exact(picks.vocab)
            .zip(picks.rows.iter().zip(picks.allowed))
            .enumerate()
            .map(|(row, (values, (pick, allowed)))| {
                crate::sampling::token_logprobs(values, *allowed, pick.token, pick.top)
                    .map_err(|source| SampleRowsError::Mask { row, source })
            })
            .collect()
    }

    fn sample_linear(
        &self,
        x: &Tensor,
        head: DenseWeight<'_>,
        rows: &[RowSampling],
    ) -> Result<Vec<u32>, SampleRowsError> {
        let logits = self.linear_f32(x, head);
        self.sample_rows(&logits, head.out, rows)
    }
    fn route_experts(&self, logits: &Tensor, routing: Routing<'_>) -> Vec<ExpertRoute> {
        route_experts(logits, routing)
    }
    fn engram_gather(&self, table: &EngramTable, row_ids: &[u32]) -> Tensor {
        let mut out = vec![0.0f32; row_ids.len() * table.head_dim()];
        table.gather(row_ids, &mut out);
        out.into()
    }
    fn linear(&self, x: &Tensor, w: &Linear) -> Tensor {
        // The quantised formats: their shape and how one row is dequantised.
        let (out, inp, dequant_row): (usize, usize, DequantRow<'_>) = match w {
            Linear::Dense { out, inp, values } => {
                let (out, inp) = (*out, *inp);
                return self.linear_f32(x, DenseWeight { values, out, inp });
            }
            Linear::Fp8(w) => (w.out, w.inp, &|row, block| fp8_row(w, row, block)),
            Linear::Fp4(w) => (w.out, w.inp, &|row, block| fp4_row(w, row, block)),
        };
        dequantised_linear(x.len(), out, inp, dequant_row, |values, out| {
            let block = DenseWeight { values, out, inp };
            self.linear_f32(x, block).into_vec()
        })
        .into()
    }
    fn scale_at(&self, x: Tensor, scale: f32, precision: Precision) -> Tensor {
        x.iter()
            .map(|w| precision.round(w * scale))
            .collect::<Vec<f32>>()
            .into()
    }
    fn stream_means_at(
        &self,
        streams: &Tensor,
        shape: StreamShape,
        precision: Precision,
    ) -> Tensor {
        let StreamShape { hc, dim } = shape;
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
    fn engram_inject(&self, streams: Tensor, injection: EngramInjection<'_>) -> Tensor {
        let EngramInjection { kv, live, gate } = injection;
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
    fn add(&self, x: Tensor, y: &Tensor) -> Tensor {
        let mut x = x;
        for (a, b) in x.host_mut().iter_mut().zip(y.iter()) {
            *a += b;
        }
        x
    }
    fn resident(&self, x: Tensor) -> Tensor {
        x
    }
    fn argmax_rows(&self, x: &Tensor, width: usize) -> Vec<u32> {
        if width == 0 {
            return Vec::new();
        }
        x.chunks_exact(width).map(argmax).collect()
    }
    fn hyper_head_weights_rows(&self, x: &Tensor, head: &HyperHead<'_>) -> Tensor {
        let width = head.proj.len() / head.base.len().max(1);
        if width == 0 {
            return Tensor::empty();
        }
        x.chunks_exact(width)
            .flat_map(|x| hyper_head_weights(x, head))
            .collect::<Vec<f32>>()
            .into()
    }
    fn compressor_pool_rows(&self, entries: &[Vec<PoolSlot<'_>>], width: usize) -> Tensor {
        entries
            .iter()
            .flat_map(|slots| pool_entry(slots, width))
            .collect::<Vec<f32>>()
            .into()
    }
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

/// The hyper-head's collapse weights of one token's streams `x [hc · dim]` ([`HyperHead`]):
/// `pre_k = σ(m_k · scale + base_k) + hc_eps` with `m = proj · RMSNorm_u(x)`.
pub fn hyper_head_weights(x: &[f32], head: &HyperHead<'_>) -> Vec<f32> {
    let inv = 1.0 / (sum_squares_f32(x) / x.len() as f32 + head.norm_eps).sqrt();
    head.proj
        .chunks_exact(x.len())
        .zip(head.base)
        .map(|(row, base)| {
            let logit = dot_f32_sgemm(x, row) * inv * head.scale + base;
            1.0 / (1.0 + exp_f32(-logit)) + head.hc_eps
        })
        .collect()
}

/// Index of the first maximum.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// `ln(1 + e^z)` as the reference's vectorised softplus computes it (torch's `Vectorized` kernel):
/// its `exp` ([`exp_f32`]), then its `log1p` ([`log1p_f32`], SLEEF's, not always correctly rounded:
/// a correctly rounded `log1p` leaves 3 more of the fixture's 2400 routing weights an ulp off);
/// above 20 the input itself (torch's threshold).
pub fn softplus(z: f32) -> f32 {
    if z > 20.0 { z } else { log1p_f32(exp_f32(z)) }
}

/// The sqrt-softplus router scores of one token's gate logits.
pub fn router_scores(logits: &[f32]) -> Vec<f32> {
    logits.iter().map(|&z| softplus(z).sqrt()).collect()
}

/// [`Backend::route_experts`]'s reference: per token, the selection on `s + bias` in descending
/// order (ties: the lower expert id, i.e. torch's sorted top-k), then `s / (Σs + 1e-20) · scale`.
pub fn route_experts(logits: &[f32], routing: Routing<'_>) -> Vec<ExpertRoute> {
    let (bias, route_scale) = (routing.bias, routing.route_scale);
    let n_experts = bias.len();
    if n_experts == 0 {
        return Vec::new();
    }
    logits
        .chunks_exact(n_experts)
        .map(|row| {
            let scores = router_scores(row);
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            let experts: Vec<usize> = match routing.selection {
                ExpertSelection::Forced(forced) => {
                    forced.iter().copied().filter(|&e| e < n_experts).collect()
                }
                ExpertSelection::TopK(k) => {
                    let mut order: Vec<usize> = (0..n_experts).collect();
                    order.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
                    order.truncate(k);
                    order
                }
            };
            let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
            if weights.len() > 1 {
                let sum = weights.iter().fold(0.0f32, |a, v| a + v) + 1e-20;
                weights.iter_mut().for_each(|v| *v /= sum);
            }
            weights.iter_mut().for_each(|v| *v *= route_scale);
            ExpertRoute { experts, weights }
        })
        .collect()
}

fn normalise_columns(comb: &mut [f32], hc: usize, eps: f32) {
    for k in 0..hc {
        let sum = (0..hc).fold(0.0f32, |a, j| a + comb[j * hc + k]) + eps;
        for j in 0..hc {
            comb[j * hc + k] /= sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeTable;
    use crate::quant::round_bf16;

    #[test]
    fn sinkhorn_output_is_nearly_doubly_stochastic() {
        let hc = 4;
        let dim = 8;
        let x: Vec<f32> = (0..hc * dim)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.125)
            .collect();
        let params = HcParams {
            proj: (0..(2 + hc) * hc * hc * dim)
                .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.01)
                .collect(),
            base: vec![0.1; (2 + hc) * hc],
            scale: vec![1.0, 0.5, 2.0],
        };
        let mixing = HcMixing {
            hc,
            sinkhorn_iters: 20,
            hc_eps: 1e-6,
            norm_eps: 1e-20,
        };
        let mix = CpuBackend.hc_mixes(&x, &params, &mixing);
        for j in 0..hc {
            let row: f32 = mix.comb[j * hc..(j + 1) * hc].iter().sum();
            let col: f32 = (0..hc).map(|r| mix.comb[r * hc + j]).sum();
            assert!((row - 1.0).abs() < 1e-3, "row {j} sums to {row}");
            assert!((col - 1.0).abs() < 1e-3, "column {j} sums to {col}");
        }
        assert!(mix.pre.iter().all(|&p| p > 0.0 && p < 1.0 + 1e-5));
        assert!(mix.post.iter().all(|&p| p > 0.0 && p < 2.0));
    }

    #[test]
    fn attention_with_sink_matches_the_closed_form() {
        let q = vec![1.0f32, 0.0];
        let k0 = [1.0f32, 2.0];
        let k1 = [0.0f32, 4.0];
        let out = CpuBackend.sparse_attention(&q, &[&k0, &k1], &[0.5], 1.0, Precision::Bf16);
        // p is computed relative to the running max (1.0): p0 = 1, p1 = e^-1.
        let p1 = round_bf16(exp_f32_accurate(-1.0));
        let d = 1.0 + exp_f32_accurate(-1.0) + exp_f32_accurate(-0.5);
        assert_eq!(out[0], round_bf16(1.0 / d));
        assert_eq!(out[1], round_bf16((2.0 + p1 * 4.0) / d));
        // No keys: only the sink, output 0.
        assert_eq!(
            CpuBackend.sparse_attention(&q, &[], &[0.5], 1.0, Precision::Bf16),
            vec![0.0, 0.0]
        );
    }

    #[test]
    fn attention_sums_probabilities_in_torch_order_with_the_accurate_exp() {
        // One key at the max (p = 1) and 15 whose p is about 0.75 · 2^-24 (3/8 of an ulp of 1):
        // torch's 8-lane sum adds them to 1 as 7 lanes of two, each rounding up (1 + 7 ulps);
        // an exactly rounded sum gives 1 + 6 ulps.
        let q = vec![1.0f32];
        // The last small one where the vectorised exp is an ulp off.
        let off = (0..10_000)
            .map(|i| -16.923_214 - i as f32 * 1e-6)
            .find(|&s| exp_f32(s) != exp_f32_accurate(s))
            .expect("a score where the two exps differ");
        let scores: Vec<f32> = std::iter::once(0.0)
            .chain((1..15).map(|i| -16.923_214 + i as f32 * 1e-6))
            .chain([off])
            .collect();
        let keys: Vec<[f32; 1]> = scores.iter().map(|&s| [s]).collect();
        let key_refs: Vec<&[f32]> = keys.iter().map(|k| &k[..]).collect();
        let probs: Vec<f32> = scores.iter().map(|&s| exp_f32_accurate(s)).collect();
        let torch_order = sum_f32_torch(&probs);
        assert_ne!(
            torch_order,
            sum_f32(probs.iter().copied()),
            "the orders differ here"
        );
        let out =
            CpuBackend.sparse_attention(&q, &key_refs, &[f32::NEG_INFINITY], 1.0, Precision::F32);
        let weighted = probs.iter().zip(&scores).map(|(p, s)| p * s);
        assert_eq!(out[0], sum_f32(weighted) / torch_order);
        // Two keys, the second where the vectorised exp is an ulp off (and the output shows it):
        // its weight is the correctly rounded one.
        let output = |p: f32, s: f32| p * s / (1.0 + p);
        let s = (0..100_000)
            .map(|i| -0.7 - i as f32 * 1e-6)
            .find(|&s| output(exp_f32(s), s) != output(exp_f32_accurate(s), s))
            .expect("a score where the two exps give different outputs");
        let (k0, k1) = ([0.0f32], [s]);
        let out =
            CpuBackend.sparse_attention(&q, &[&k0, &k1], &[f32::NEG_INFINITY], 1.0, Precision::F32);
        assert_eq!(out[0], output(exp_f32_accurate(s), s));
    }

    /// A query reading the first `count` of a compressed list (a layer without an indexer) has
    /// the keys of that prefix listed one by one after its window and its own key, and of a
    /// selection of positions `0..count`: the three attend bitwise alike, over counts 0, 1, some
    /// and all. Negative control: a prefix one shorter changes the output.
    #[test]
    fn a_compressed_prefix_attends_as_its_entries_listed_one_by_one() {
        use crate::backend::{CompressedKeys, KeyList, PositionRing};
        let (heads, d) = (2, 4);
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 64.0;
        let row = |r: usize| Tensor::from((0..d).map(|c| value(r * d + c)).collect::<Vec<f32>>());
        let mut ring = PositionRing::starting_at(0);
        for p in 0..6 {
            ring.push(row(100 + p));
        }
        let entries = KeyList::from((0..5).map(row).collect::<Vec<Tensor>>());
        let own: Vec<Tensor> = (0..4).map(|t| row(200 + t)).collect();
        let counts = [0usize, 1, 3, 5];
        let selection = Selection::host(counts.iter().map(|&c| (0..c).collect()).collect());
        let q = Tensor::from(
            (0..4 * heads * d)
                .map(|i| value(300 + i))
                .collect::<Vec<f32>>(),
        );
        let attention = AttentionQueries {
            q: &q,
            sink: &[0.25, -0.5],
            scale: 0.5,
            precision: Precision::Bf16,
        };
        // Query t: window positions t..=t+2, its own key, then `listed` entries one by one.
        let query = |t: usize, listed: usize| QueryKeys {
            window: Some(ring.window(t, t + 2)),
            listed: std::iter::once(&own[t])
                .chain(entries.iter().take(listed))
                .collect(),
            compressed: None,
        };
        let prefix_of = |counts: &[usize]| -> Vec<QueryKeys<'_>> {
            (0..4)
                .map(|t| QueryKeys {
                    compressed: Some(CompressedKeys::prefix(&entries, counts[t])),
                    ..query(t, 0)
                })
                .collect()
        };
        let prefix = prefix_of(&counts);
        let one_by_one: Vec<QueryKeys<'_>> = (0..4).map(|t| query(t, counts[t])).collect();
        let selected: Vec<QueryKeys<'_>> = (0..4)
            .map(|t| QueryKeys {
                compressed: Some(CompressedKeys::selected(&entries, &selection, t)),
                ..query(t, 0)
            })
            .collect();
        for t in 0..4 {
            assert_eq!(prefix[t].len(), 3 + 1 + counts[t], "query {t}'s keys");
        }
        let bits = |keys: &[QueryKeys<'_>]| -> Vec<u32> {
            let y = CpuBackend.sparse_attention_rows(attention, keys);
            y.iter().map(|v| v.to_bits()).collect()
        };
        let from_prefix = bits(&prefix);
        assert_eq!(
            from_prefix,
            bits(&one_by_one),
            "the prefix listed one by one"
        );
        assert_eq!(from_prefix, bits(&selected), "a selection of the prefix");
        let shorter = bits(&prefix_of(&counts.map(|c| c.saturating_sub(1))));
        let width = heads * d;
        for t in 1..4 {
            let rows = t * width..(t + 1) * width;
            assert_ne!(
                shorter[rows.clone()],
                from_prefix[rows],
                "query {t}, one entry fewer"
            );
        }
    }

    #[test]
    fn router_takes_the_biased_top_k_and_normalises_the_unbiased_scores() {
        // Token 0: experts 1 and 3 tie on z; the bias lifts expert 0 above both.
        let logits = [0.0f32, 2.0, -1.0, 2.0, 30.0, 30.0, 30.0, 30.0];
        let bias = [3.0f32, 0.0, 0.0, 0.0];
        fn routing<'a>(bias: &'a [f32], selection: ExpertSelection<'a>, scale: f32) -> Routing<'a> {
            Routing {
                bias,
                selection,
                route_scale: scale,
            }
        }
        let routes = route_experts(&logits, routing(&bias, ExpertSelection::TopK(3), 2.0));
        assert_eq!(routes.len(), 2);
        assert_eq!(
            routes[0].experts,
            vec![0, 1, 3],
            "bias first, then the lower id of a tie"
        );
        let s = router_scores(&logits[..4]);
        let sum = s[0] + s[1] + s[3] + 1e-20;
        let expected: Vec<f32> = [s[0], s[1], s[3]].iter().map(|v| v / sum * 2.0).collect();
        assert_eq!(
            routes[0].weights, expected,
            "weights from the unbiased scores"
        );
        // Above softplus's threshold the score is sqrt(z); all tied: the lowest ids after the bias.
        assert_eq!(routes[1].experts, vec![0, 1, 2]);
        assert_eq!(router_scores(&[30.0]), vec![30f32.sqrt()]);
        // A single expert is scaled, not normalised; forced ids keep their order, foreign ids drop.
        let single = route_experts(&logits[..4], routing(&bias, ExpertSelection::TopK(1), 2.0));
        assert_eq!(single[0].weights, vec![s[0] * 2.0]);
        let forced = route_experts(
            &logits[..4],
            routing(&bias, ExpertSelection::Forced(&[3, 9, 2]), 1.0),
        );
        assert_eq!(forced[0].experts, vec![3, 2]);
        assert!(route_experts(&logits, routing(&[], ExpertSelection::TopK(2), 1.0)).is_empty());
    }

    #[test]
    fn sample_rows_samples_each_row_with_its_own_parameters() {
        use crate::backend::{RowSampling, SampleRowsError};
        use crate::sampling::{SamplingParams, sample};
        let logits = [0.0f32, 5.0, 1.0, 9.0, 2.0, 3.0];
        let noisy = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 0.9,
            seed: 4,
        };
        let rows = [
            RowSampling {
                params: SamplingParams::greedy(),
                position: 0,
            },
            RowSampling {
                params: noisy,
                position: 17,
            },
        ];
        let tokens = CpuBackend.sample_rows(&logits, 3, &rows);
        assert_eq!(
            tokens,
            Ok(vec![1, sample(&logits[3..], &noisy, 17).unwrap_or(9)])
        );
        assert_eq!(
            CpuBackend.sample_rows(&logits[..5], 3, &rows),
            Err(SampleRowsError::LogitsShape {
                found: 5,
                rows: 2,
                vocab: 3
            })
        );
        assert_eq!(
            CpuBackend.sample_rows(&[], 0, &rows),
            Err(SampleRowsError::EmptyVocab { rows: 2 })
        );
        assert_eq!(CpuBackend.sample_rows(&[], 0, &[]), Ok(Vec::new()));
    }

    #[test]
    fn rope_then_inverse_rope_is_near_identity() {
        let table = RopeTable {
            freqs: vec![1.0, 0.1],
        };
        let original = vec![0.5f32, -0.25, 1.0, 2.0, 0.75, -1.5];
        let rotation = Rotation::new(&table, &[7], Precision::Bf16);
        let x = CpuBackend.rope(original.clone().into(), (6, 1), &rotation);
        assert_eq!(&x[..2], &original[..2]);
        assert_ne!(&x[2..], &original[2..]);
        let x = CpuBackend.rope(x, (6, 1), &rotation.inverse());
        for (a, b) in x.iter().zip(&original) {
            assert!((a - b).abs() < 0.02, "{a} vs {b}");
        }
    }
}
