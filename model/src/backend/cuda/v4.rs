//! The V4 family's ops on [`CudaBackend`], so that a V4 step's activations stay on the device: the
//! hyper-head's collapse weights (`v4_hyper_head_f32`), the compressor's softmax pooling over
//! slots read in place (`v4_pool_f32`), and the MoE with exact fp32 experts — device routes (top-k, or a hash layer's experts with their router
//! weights) as a dense `[rows, experts]` weight matrix, every expert over every row (unrouted rows
//! weigh 0), sums in increasing expert id, then the shared expert. Numerics: bit for bit the CPU's
//! (its sgemm order for every product, its exponential, its sums in its order).

use deepinfer_kernels::ops::v4::{
    RouteColumn, v4_dense_routes_f32, v4_hyper_head_f32, v4_pool_f32, v4_swiglu_f32,
};

use super::*;
use crate::v4::{Linear, PoolSlot};
use crate::v41::weights::{ExpertLinear, ExpertWeights};

/// One exact expert's dense weights `w1`, `w3` `[inter, dim]` and `w2` `[dim, inter]`.
struct DenseExpert<'a> {
    w1: &'a [f32],
    w3: &'a [f32],
    w2: &'a [f32],
    inter: usize,
}

impl<'a> DenseExpert<'a> {
    /// The expert's weights when all three are dense fp32 of matching shapes for `dim`.
    fn of(e: &'a ExpertWeights<ExpertLinear>, dim: usize) -> Option<DenseExpert<'a>> {
        let dense = |w: &'a ExpertLinear| match w {
            ExpertLinear::Exact(Linear::Dense { out, inp, values }) => {
                Some((*out, *inp, &values[..]))
            }
            _ => None,
        };
        let ((i1, d1, w1), (i3, d3, w3), (d2, i2, w2)) =
            (dense(&e.w1)?, dense(&e.w3)?, dense(&e.w2)?);
        let shapes_fit = d1 == dim && d3 == dim && d2 == dim && i1 == i3 && i1 == i2 && i1 > 0;
        shapes_fit.then_some(DenseExpert {
            w1,
            w3,
            w2,
            inter: i1,
        })
    }
}

impl CudaBackend {
    /// [`Backend::hyper_head_weights_rows`], with errors: one launch of `v4_hyper_head_f32`
    /// (the CPU's sum of squares, sgemm-order dot products and sigmoid, bit for bit).
    pub fn try_hyper_head_weights_rows(
        &self,
        x: &Tensor,
        proj: &[f32],
        base: &[f32],
        scale: f32,
        hc_eps: f32,
        norm_eps: f32,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "hyper_head_weights_rows";
        let hc = base.len();
        if hc == 0 || x.is_empty() {
            return Ok(Tensor::empty());
        }
        let width = proj.len() / hc;
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(shape_err(
                OP,
                format!("{} values are not whole rows of {width}", x.len()),
            ));
        }
        let input = self.input(OP, x)?;
        let proj = self.cached_f32(OP, proj)?;
        let base = self.cached_f32(OP, base)?;
        let mut pre = self.alloc(OP, x.len() / width * hc)?;
        v4_hyper_head_f32(
            &self.rt, &input, &proj, &base, scale, hc_eps, norm_eps, &mut pre,
        )
        .map_err(op_err(OP))?;
        Ok(self.tensor(pre))
    }

    /// [`Backend::compressor_pool_rows`], with errors: one launch over tables of the slots' `kv`
    /// and gate addresses (rows read where earlier steps left them) and their bias rows.
    pub fn try_compressor_pool_rows(
        &self,
        entries: &[Vec<PoolSlot<'_>>],
        width: usize,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "compressor_pool_rows";
        if entries.is_empty() || width == 0 {
            return Ok(Tensor::empty());
        }
        let mut keep = Vec::new();
        let (mut kv, mut gate, mut bias) = (Vec::new(), Vec::new(), Vec::new());
        let mut slot_start = vec![0u32];
        for slots in entries {
            for slot in slots {
                let half = slot.raw.len() / 2;
                let bias_row =
                    slot.bias
                        .get(slot.offset..slot.offset + width)
                        .ok_or_else(|| {
                            shape_err(
                                OP,
                                format!(
                                    "a bias row of {} values has no {width} at {}",
                                    slot.bias.len(),
                                    slot.offset
                                ),
                            )
                        })?;
                kv.push(self.address_of(OP, slot.raw, slot.offset, width, &mut keep)?);
                gate.push(self.address_of(OP, slot.raw, half + slot.offset, width, &mut keep)?);
                bias.extend_from_slice(bias_row);
            }
            let count = u32::try_from(kv.len())
                .map_err(|_| shape_err(OP, format!("{} slots exceed u32", kv.len())))?;
            slot_start.push(count);
        }
        let upload_u64 =
            |values: &[u64], what: &'static str| self.rt.htod(values).map_err(driver_err(OP, what));
        let kv = upload_u64(&kv, "uploading the kv addresses")?;
        let gate = upload_u64(&gate, "uploading the gate addresses")?;
        let bias = self.upload(OP, &bias)?;
        let slot_start = self
            .rt
            .htod(&slot_start)
            .map_err(driver_err(OP, "uploading the slot starts"))?;
        let mut out = self.alloc(OP, entries.len() * width)?;
        // SAFETY: every address is `width` values of a buffer of this context (checked by
        // `address_of`): a slot tensor's, borrowed for this call, or an upload in `keep`, held
        // until the launch is enqueued; buffers are freed in order on the runtime's stream.
        unsafe { v4_pool_f32(&self.rt, &kv, &gate, &bias, &slot_start, width, &mut out) }
            .map_err(op_err(OP))?;
        drop(keep);
        Ok(self.tensor(out))
    }

    /// [`Backend::moe_rows_exact`], with errors; `None` unless every expert (and the shared one)
    /// is dense fp32 and the layer keeps fp32 activations.
    pub fn try_moe_rows_exact(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
    ) -> Result<Option<Tensor>, CudaBackendError> {
        const OP: &str = "moe_rows_exact";
        let n_experts = layer.bias.len();
        if n_experts == 0 || layer.experts.len() != n_experts || layer.precision != Precision::F32 {
            return Ok(None);
        }
        let dim = layer.gate.len() / n_experts;
        let experts: Option<Vec<DenseExpert<'_>>> = layer
            .experts
            .iter()
            .map(|e| DenseExpert::of(e, dim))
            .collect();
        let (Some(experts), Some(shared)) = (experts, DenseExpert::of(layer.shared, dim)) else {
            return Ok(None);
        };
        if dim == 0 || !x.len().is_multiple_of(dim) {
            return Err(shape_err(
                OP,
                format!("x holds {} values, not whole rows of {dim}", x.len()),
            ));
        }
        let rows = x.len() / dim;
        if rows == 0 {
            return Ok(Some(Tensor::empty()));
        }
        // A hash row naming one expert twice runs it twice on the host; one dense weight cannot.
        let repeats = |ids: &Vec<usize>| ids.iter().enumerate().any(|(i, e)| ids[..i].contains(e));
        if hashed.is_some_and(|rows| rows.iter().any(repeats)) {
            return Ok(None);
        }
        let dense = self.dense_routes(OP, x, layer, hashed, rows, dim)?;
        let swiglu = |expert: &DenseExpert<'_>,
                      route: Option<RouteColumn<'_>>|
         -> Result<Tensor, CudaBackendError> {
            let gate = self.try_linear(x, expert.w1, expert.inter, dim, Rounding::F32)?;
            let up = self.try_linear(x, expert.w3, expert.inter, dim, Rounding::F32)?;
            let mut hidden = self.alloc(OP, rows * expert.inter)?;
            v4_swiglu_f32(
                &self.rt,
                &*self.input(OP, &gate)?,
                &*self.input(OP, &up)?,
                route,
                expert.inter,
                layer.swiglu_limit,
                &mut hidden,
            )
            .map_err(op_err(OP))?;
            self.try_linear(
                &self.tensor(hidden),
                expert.w2,
                dim,
                expert.inter,
                Rounding::F32,
            )
        };
        let mut sum: Option<Tensor> = None;
        for (e, expert) in experts.iter().enumerate() {
            let route = RouteColumn {
                dense: &dense,
                column: e,
                stride: n_experts,
            };
            let out = swiglu(expert, Some(route))?;
            sum = Some(match sum {
                None => out,
                Some(acc) => self.try_add(acc, &out)?,
            });
        }
        let shared = swiglu(&shared, None)?;
        Ok(Some(match sum {
            None => shared,
            Some(acc) => self.try_add(acc, &shared)?,
        }))
    }

    /// The route weights of every row as a dense `[rows, experts]` matrix on the device: the
    /// router's top-k of the layer's bias, or each row's hashed experts with their weights.
    fn dense_routes(
        &self,
        op: &'static str,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
        rows: usize,
        dim: usize,
    ) -> Result<CudaSlice<f32>, CudaBackendError> {
        let n_experts = layer.bias.len();
        let logits = self.try_linear(x, layer.gate, n_experts, dim, Rounding::F32)?;
        let dbias = self.cached_f32(op, layer.bias)?;
        let stream = self.rt.stream();
        let (ids, weights, k) = match hashed {
            None => {
                let selection = RouteSelection::TopK(layer.n_activated);
                let k = selected_count(selection, n_experts);
                let mut ids = stream
                    .alloc_zeros::<u32>(rows * k)
                    .map_err(driver_err(op, "allocating the routes"))?;
                let mut weights = self.alloc(op, rows * k)?;
                route_experts_f32(
                    &self.rt,
                    &*self.input(op, &logits)?,
                    &dbias,
                    selection,
                    layer.route_scale,
                    &mut ids,
                    &mut weights,
                )
                .map_err(op_err(op))?;
                (ids, weights, k)
            }
            Some(hashed) => {
                let k = hashed.first().map_or(0, Vec::len);
                if hashed.len() != rows || hashed.iter().any(|h| h.len() != k) || k == 0 {
                    return Err(shape_err(
                        op,
                        format!(
                            "hashed routes for {} rows (of {k}), {rows} rows",
                            hashed.len()
                        ),
                    ));
                }
                let host_ids: Vec<u32> = hashed
                    .iter()
                    .flatten()
                    .map(|&e| u32::try_from(e).unwrap_or(u32::MAX))
                    .collect();
                let ids = self
                    .rt
                    .htod(&host_ids)
                    .map_err(driver_err(op, "uploading the hashed experts"))?;
                // Each row's weights from its own scores, its own forced list.
                let mut per_row = Vec::with_capacity(rows);
                for (r, row_ids) in host_ids.chunks_exact(k).enumerate() {
                    let forced = self
                        .rt
                        .htod(row_ids)
                        .map_err(driver_err(op, "uploading a row's hashed experts"))?;
                    let mut row_experts = stream
                        .alloc_zeros::<u32>(k)
                        .map_err(driver_err(op, "allocating a row's routes"))?;
                    let mut row_weights = self.alloc(op, k)?;
                    route_experts_f32(
                        &self.rt,
                        &*self.input(op, &logits.rows(r..r + 1, n_experts))?,
                        &dbias,
                        RouteSelection::Forced(&forced),
                        layer.route_scale,
                        &mut row_experts,
                        &mut row_weights,
                    )
                    .map_err(op_err(op))?;
                    per_row.push(self.tensor(row_weights));
                }
                let pieces: Vec<(&Tensor, usize)> = per_row.iter().map(|t| (t, 0)).collect();
                let weights = self.try_gather(&pieces, k)?;
                let weights = self.input(op, &weights)?.into_owned(self, op)?;
                (ids, weights, k)
            }
        };
        let mut dense = stream
            .alloc_zeros::<f32>(rows * n_experts)
            .map_err(driver_err(op, "allocating the dense routes"))?;
        v4_dense_routes_f32(&self.rt, &ids, &weights, k, n_experts, &mut dense)
            .map_err(op_err(op))?;
        Ok(dense)
    }
}
