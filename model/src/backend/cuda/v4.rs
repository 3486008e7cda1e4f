//! The V4 family's ops on [`CudaBackend`], so that a V4 step's activations stay on the device: the
//! hyper-head's collapse weights (`v4_hyper_head_f32`), the compressor's softmax pooling over
//! slots read in place (`v4_pool_f32`), and the MoE with exact fp32 experts (dense, FP8 or FP4
//! weights dequantised exactly): device routes (top-k, or a hash layer's experts with their
//! router weights), each (row, slot) through its own expert by the routed exact linears
//! (`ops::routed_exact`, rows grouped by expert on the device), SwiGLU weighted by the route,
//! the combine in increasing expert id, then the shared expert. Numerics: bit for bit the CPU's
//! (its sgemm order for every product, its exponential, its sums in its order).

use deepinfer_kernels::ops::routed::{ExpertProjection, moe_combine, swiglu_rows};
use deepinfer_kernels::ops::routed_exact::{
    DeviceExactExpertTable, ExactExpertRefs, ExactWeight, gemm_exact_routed,
};
use deepinfer_kernels::ops::v4::{v4_hyper_head_f32, v4_pool_f32};

use super::*;
use crate::backend::PoolSlot;
use crate::backend::weights::Linear;
use crate::backend::weights::{ExpertLinear, ExpertWeights};

/// A layer's exact experts on the device: their address table and the weights it points into
/// (held here so that the addresses stay valid as long as the table).
pub(super) struct DeviceExactExperts {
    table: DeviceExactExpertTable,
    _held: Vec<Arc<dyn Any + Send + Sync>>,
}

/// One projection's device copy, kept while the table is built.
enum DeviceLinear {
    F32(Arc<CudaSlice<f32>>, usize, usize),
    Fp8(Arc<DeviceFp8Weight>),
    Fp4(Arc<DeviceFp4Weight>),
}

impl DeviceLinear {
    fn weight(&self) -> ExactWeight<'_> {
        match self {
            DeviceLinear::F32(values, out, inp) => ExactWeight::F32 {
                values,
                out: *out,
                inp: *inp,
            },
            DeviceLinear::Fp8(w) => ExactWeight::Fp8(w),
            DeviceLinear::Fp4(w) => ExactWeight::Fp4(w),
        }
    }

    fn held(self) -> Arc<dyn Any + Send + Sync> {
        match self {
            DeviceLinear::F32(values, ..) => values,
            DeviceLinear::Fp8(w) => w,
            DeviceLinear::Fp4(w) => w,
        }
    }
}

/// The linear of an exact projection.
fn exact(w: &ExpertLinear) -> Option<&Linear> {
    match w {
        ExpertLinear::Exact(linear) => Some(linear),
        _ => None,
    }
}

/// The format and shape of an exact projection, as the routed table requires them alike.
fn exact_kind(w: &ExpertLinear) -> Option<(u8, usize, usize, usize)> {
    match w {
        ExpertLinear::Exact(Linear::Dense { out, inp, .. }) => Some((0, 0, *out, *inp)),
        ExpertLinear::Exact(Linear::Fp8(w)) => Some((1, w.block, w.out, w.inp)),
        ExpertLinear::Exact(Linear::Fp4(w)) => Some((2, 32, w.out, w.inp)),
        _ => None,
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
        whole_rows(OP, x, width)?;
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
    /// is exact (dense, FP8 or FP4, each projection in one format and shape across the experts)
    /// and the layer keeps fp32 activations.
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
        let shared = layer.shared;
        let (Some(s1), Some(s3), Some(s2)) =
            (exact(&shared.w1), exact(&shared.w3), exact(&shared.w2))
        else {
            return Ok(None);
        };
        let rows = whole_rows(OP, x, dim)?;
        let Some(experts) = self.exact_experts(OP, layer.experts, dim)? else {
            return Ok(None);
        };
        if rows == 0 {
            return Ok(Some(Tensor::empty()));
        }
        let (ids, route_weights, _) = self.routes(OP, x, layer, hashed, rows)?;
        let slots = ids.len();
        let inter = experts.table.inter();
        let routed = |x: &CudaSlice<f32>,
                      x_row_div: usize,
                      which: ExpertProjection,
                      width: usize|
         -> Result<CudaSlice<f32>, CudaBackendError> {
            let mut out = self.alloc(OP, slots * width)?;
            gemm_exact_routed(
                &self.rt,
                x,
                &ids,
                x_row_div,
                &experts.table,
                which,
                &mut out,
            )
            .map_err(op_err(OP))?;
            Ok(out)
        };
        let dx = self.input(OP, x)?;
        let k = slots / rows;
        let gate = routed(&dx, k, ExpertProjection::W1, inter)?;
        let up = routed(&dx, k, ExpertProjection::W3, inter)?;
        let mut hidden = self.alloc(OP, slots * inter)?;
        swiglu_rows(
            &self.rt,
            &gate,
            &up,
            Some(&route_weights),
            layer.swiglu_limit,
            Rounding::F32,
            &mut hidden,
        )
        .map_err(op_err(OP))?;
        let expert_out = routed(&hidden, 1, ExpertProjection::W2, dim)?;

        // The shared expert on every row, then the combine.
        let shared_gate = self.try_exact_linear(x, s1)?;
        let shared_up = self.try_exact_linear(x, s3)?;
        let mut shared_hidden = self.alloc(OP, shared_gate.len())?;
        swiglu_rows(
            &self.rt,
            &*self.input(OP, &shared_gate)?,
            &*self.input(OP, &shared_up)?,
            None,
            layer.swiglu_limit,
            Rounding::F32,
            &mut shared_hidden,
        )
        .map_err(op_err(OP))?;
        let shared_out = self.try_exact_linear(&self.tensor(shared_hidden), s2)?;
        let mut out = self.alloc(OP, rows * dim)?;
        moe_combine(
            &self.rt,
            &expert_out,
            &ids,
            n_experts,
            &*self.input(OP, &shared_out)?,
            dim,
            Rounding::F32,
            &mut out,
        )
        .map_err(op_err(OP))?;
        Ok(Some(self.tensor(out)))
    }

    /// [`Linear::apply`] on this backend, with errors.
    fn try_exact_linear(&self, x: &Tensor, w: &Linear) -> Result<Tensor, CudaBackendError> {
        match w {
            Linear::Dense { out, inp, values } => {
                self.try_linear(x, values, *out, *inp, Rounding::F32)
            }
            Linear::Fp8(w) => self.try_linear_fp8_f32(x, w),
            Linear::Fp4(w) => self.try_linear_fp4_f32(x, w),
        }
    }

    /// The device table of a layer's exact experts, built once and cached with the weights;
    /// `None` when a projection is not exact or not of one format and shape across the experts.
    fn exact_experts(
        &self,
        op: &'static str,
        experts: &[ExpertWeights<ExpertLinear>],
        dim: usize,
    ) -> Result<Option<Arc<DeviceExactExperts>>, CudaBackendError> {
        let key = (experts.as_ptr() as usize, experts.len());
        if let Some(found) = self.lock_weights().exact_expert_tables.get(&key) {
            return Ok(Some(found.clone()));
        }
        let Some(first) = experts.first() else {
            return Ok(None);
        };
        let kinds = |e: &ExpertWeights<ExpertLinear>| {
            [exact_kind(&e.w1), exact_kind(&e.w3), exact_kind(&e.w2)]
        };
        let expected = kinds(first);
        let shapes_fit = match expected {
            [
                Some((_, _, i1, d1)),
                Some((_, _, i3, d3)),
                Some((_, _, d2, i2)),
            ] => d1 == dim && d3 == dim && d2 == dim && i1 == i3 && i1 == i2 && i1 > 0,
            _ => false,
        };
        if !shapes_fit || experts.iter().any(|e| kinds(e) != expected) {
            return Ok(None);
        }
        let device = |w: &ExpertLinear| -> Result<DeviceLinear, CudaBackendError> {
            match w {
                ExpertLinear::Exact(Linear::Dense { out, inp, values }) => {
                    Ok(DeviceLinear::F32(self.cached_f32(op, values)?, *out, *inp))
                }
                ExpertLinear::Exact(Linear::Fp8(w)) => Ok(DeviceLinear::Fp8(self.cached_fp8(w)?)),
                ExpertLinear::Exact(Linear::Fp4(w)) => Ok(DeviceLinear::Fp4(self.cached_fp4(w)?)),
                _ => Err(shape_err(op, "a quantised V4.1 expert".to_string())),
            }
        };
        let weights = experts
            .iter()
            .map(|e| Ok([device(&e.w1)?, device(&e.w3)?, device(&e.w2)?]))
            .collect::<Result<Vec<_>, CudaBackendError>>()?;
        let refs: Vec<ExactExpertRefs<'_>> = weights
            .iter()
            .map(|[w1, w3, w2]| ExactExpertRefs {
                w1: w1.weight(),
                w3: w3.weight(),
                w2: w2.weight(),
            })
            .collect();
        // SAFETY: the table is stored next to `weights` (the Arcs it points into) in one
        // `DeviceExactExperts`, which outlives every launch that reads it.
        let table = unsafe { DeviceExactExpertTable::new(&self.rt, &refs) }.map_err(op_err(op))?;
        let built = Arc::new(DeviceExactExperts {
            table,
            _held: weights
                .into_iter()
                .flatten()
                .map(DeviceLinear::held)
                .collect(),
        });
        self.lock_weights()
            .exact_expert_tables
            .insert(key, built.clone());
        Ok(Some(built))
    }
}
