//! The V4 family's ops on [`CudaBackend`], so that a V4 step's activations stay on the device: the
//! hyper-head's collapse weights (`v4_hyper_head_f32`), the compressor's softmax pooling over
//! slots read in place (`v4_pool_f32`), and the MoE (`moe_rows_exact`): device routes (top-k, or a
//! hash layer's experts with their router weights; the router gate in exact fp32 in both
//! numerics), each (row, slot) through its own expert (rows grouped by expert on the device),
//! SwiGLU weighted by the route, the combine in increasing expert id, then the shared expert; on
//! a backend that is one EP rank of several the routed slots run on the ranks holding their
//! experts, by the same kernels (`ep.rs`).
//!
//! Exact numerics: bit for bit the CPU's (the routed exact linears, `ops::routed_exact`, in its
//! sgemm order; its exponential; its sums in its order). Fast numerics: the hyper head's sum of
//! squares by a fixed tree (`SquaresOrder::Tree`, within one f32 ulp); FP4 routed experts run
//! V4.1's fast routed chain (`moe.rs` `routed_slots`: the rows quantised to E4M3 in 1×32 groups,
//! the tensor-core FP4 GEMM per expert tile, SwiGLU, the hidden rows quantised again, `w2`) with
//! V4's float32 rounding points: every GEMM output, the SwiGLU and the combine stay f32 (no bf16
//! rounding); the shared expert's projections take [`Backend::linear`]'s fast kernels; dense or
//! FP8 routed experts keep the exact routed linears (no fast grouped kernel reads them).

use deepinfer_kernels::ops::routed::{ExpertProjection, moe_combine, swiglu_rows};
use deepinfer_kernels::ops::routed_exact::{
    DeviceExactExpertTable, ExactExpertRefs, ExactRoutedRows, ExactWeight, gemm_exact_routed,
};
use deepinfer_kernels::ops::v4::{SquaresOrder, v4_hyper_head_f32, v4_pool_f32};

use super::moe::{DeviceExperts, uniform_expert_shape, v4_fast_shape};
use super::*;
use crate::backend::PoolSlot;
use crate::backend::weights::Linear;
use crate::backend::weights::{ExpertLinear, ExpertWeights};

/// A layer's exact experts on the device: their address table and the weights it points into
/// (held here so that the addresses stay valid as long as the table).
pub(super) struct DeviceExactExperts {
    pub(super) table: DeviceExactExpertTable,
    _held: Vec<Arc<dyn Any + Send + Sync>>,
}

/// A layer's routed experts as one rank of this backend runs them: FP4 experts on the fast
/// routed chain (fast numerics), or the exact routed linears.
enum V4Experts {
    Fast(Arc<DeviceExperts>),
    Exact(Arc<DeviceExactExperts>),
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

/// The format (kind, tile) and `(out, inp)` of an exact projection, as the routed table requires
/// them alike.
fn exact_kind(w: &ExpertLinear) -> Option<((u8, usize), usize, usize)> {
    match w {
        ExpertLinear::Exact(Linear::Dense { out, inp, .. }) => Some(((0, 0), *out, *inp)),
        ExpertLinear::Exact(Linear::Fp8(w)) => Some(((1, w.block), w.out, w.inp)),
        ExpertLinear::Exact(Linear::Fp4(w)) => Some(((2, 32), w.out, w.inp)),
        _ => None,
    }
}

/// The shared expert's exact projections `[w1, w3, w2]`, if all three are exact.
fn exact_shared(shared: &ExpertWeights<ExpertLinear>) -> Option<[&Linear; 3]> {
    Some([exact(&shared.w1)?, exact(&shared.w3)?, exact(&shared.w2)?])
}

/// The `(dim, inter)` of `experts` when every projection is exact, each in one format and shape
/// across them (`w1`, `w3`: `[inter, dim]`; `w2`: `[dim, inter]`), as the routed table requires;
/// `None` otherwise (or for no experts).
fn exact_shape(experts: &[&ExpertWeights<ExpertLinear>]) -> Option<(usize, usize)> {
    uniform_expert_shape(experts, exact_kind)
}

/// A list's `(dim, inter)` when a routed table takes it ([`exact_shape`], [`v4_fast_shape`]).
type ExpertShape = fn(&[&ExpertWeights<ExpertLinear>]) -> Option<(usize, usize)>;

/// The `table` of `experts` when `shape` (their `(dim, inter)`) takes them at width `dim`, else
/// `None` (the table's own shape check has no width to compare).
fn of_width<T>(
    experts: &[&ExpertWeights<ExpertLinear>],
    dim: usize,
    shape: ExpertShape,
    table: impl FnOnce() -> Result<Option<T>, CudaBackendError>,
) -> Result<Option<T>, CudaBackendError> {
    if shape(experts).is_none_or(|(width, _)| width != dim) {
        return Ok(None);
    }
    table()
}

impl CudaBackend {
    /// [`Backend::hyper_head_weights_rows`], with errors: one launch of `v4_hyper_head_f32`
    /// (the CPU's sgemm-order dot products and sigmoid; the sum of squares in the CPU's order in
    /// the exact numerics, bit for bit, by a fixed tree in the fast ones: `SquaresOrder`).
    pub fn try_hyper_head_weights_rows(
        &self,
        x: &Tensor,
        head: &HyperHead<'_>,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "hyper_head_weights_rows";
        let hc = head.base.len();
        if hc == 0 || x.is_empty() {
            return Ok(Tensor::empty());
        }
        let width = head.proj.len() / hc;
        whole_rows(OP, x, width)?;
        let input = self.input(OP, x)?;
        let proj = self.cached_f32(OP, head.proj)?;
        let base = self.cached_f32(OP, head.base)?;
        // SAFETY: v4_hyper_head_f32 runs one block per row writing its hc weights.
        let mut pre = unsafe { self.alloc_written(OP, x.len() / width * hc) }?;
        let (scale, hc_eps, norm_eps) = (head.scale, head.hc_eps, head.norm_eps);
        let order = match self.numerics {
            Numerics::Exact => SquaresOrder::InOrder,
            Numerics::Fast => SquaresOrder::Tree,
        };
        v4_hyper_head_f32(
            &self.rt, order, &input, &proj, &base, scale, hc_eps, norm_eps, &mut pre,
        )
        .map_err(op_err(OP))?;
        Ok(self.tensor(pre))
    }

    /// [`Backend::compressor_pool_rows`], with errors: one launch over tables of the slots' `kv`,
    /// gate and bias addresses (rows read where earlier steps left them; the bias rows, slices of
    /// the compressor's weights, from the weight cache: no per-call copy).
    pub fn try_compressor_pool_rows(
        &self,
        entries: &[Vec<PoolSlot<'_>>],
        width: usize,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "compressor_pool_rows";
        if entries.is_empty() || width == 0 {
            return Ok(Tensor::empty());
        }
        let mut keep = HostUploads::default();
        let mut cached_bias = Vec::new();
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
                let row = self.cached_f32(OP, bias_row)?;
                bias.push(key_row_address(&self.rt, &row, 0, width).map_err(op_err(OP))?);
                cached_bias.push(row);
            }
            let count = u32::try_from(kv.len())
                .map_err(|_| shape_err(OP, format!("{} slots exceed u32", kv.len())))?;
            slot_start.push(count);
        }
        let upload_u64 =
            |values: &[u64], what: &'static str| self.rt.htod(values).map_err(driver_err(OP, what));
        let kv = upload_u64(&kv, "uploading the kv addresses")?;
        let gate = upload_u64(&gate, "uploading the gate addresses")?;
        let bias = upload_u64(&bias, "uploading the bias addresses")?;
        let slot_start = self
            .rt
            .htod(&slot_start)
            .map_err(driver_err(OP, "uploading the slot starts"))?;
        // SAFETY: v4_pool_f32's grid-stride loop writes every (entry, channel), zeros for an
        // entry without slots.
        let mut out = unsafe { self.alloc_written(OP, entries.len() * width) }?;
        // SAFETY: every address is `width` values of a buffer of this context (checked by
        // `address_of` and `key_row_address`): a slot tensor's, borrowed for this call, an upload
        // in `keep` or a cached bias row in `cached_bias` (also held by the weight cache), held
        // until the launch is enqueued; buffers are freed in order on the runtime's stream.
        unsafe { v4_pool_f32(&self.rt, &kv, &gate, &bias, &slot_start, width, &mut out) }
            .map_err(op_err(OP))?;
        drop((keep, cached_bias));
        Ok(self.tensor(out))
    }

    /// [`Backend::moe_rows_exact`], with errors; `None` unless every expert (and the shared one)
    /// is a V4 projection (dense, FP8 or FP4, each projection in one format and shape across the
    /// experts) and the layer keeps fp32 activations. In the fast numerics FP4 experts take the
    /// fast routed chain (module doc). On an EP rank (`ep.rs`) the routed experts run on the
    /// ranks that hold them.
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
        if exact_shared(layer.shared).is_none() {
            return Ok(None);
        }
        let rows = whole_rows(OP, x, dim)?;
        if let Some(result) = self.moe_rows_on_expert_rank(x, layer, hashed) {
            return result.map(Some);
        }
        // The fast table (every projection FP4) in the fast numerics, else the exact one; each
        // built once per layer and cached with the weights.
        let fast_table = |all: &[&ExpertWeights<ExpertLinear>]| {
            of_width(all, dim, v4_fast_shape, || {
                self.v4_fast_expert_table_of(OP, all)
            })
        };
        let exact_table = |all: &[&ExpertWeights<ExpertLinear>]| {
            of_width(all, dim, exact_shape, || {
                self.exact_expert_table_of(OP, all)
            })
        };
        let fast = match self.numerics {
            Numerics::Fast => {
                self.cached_expert_table(layer.experts, |c| &mut c.expert_tables, fast_table)?
            }
            Numerics::Exact => None,
        };
        let experts = match fast {
            Some(fast) => V4Experts::Fast(fast),
            None => match self.cached_expert_table(
                layer.experts,
                |cache| &mut cache.exact_expert_tables,
                exact_table,
            )? {
                Some(exact) => V4Experts::Exact(exact),
                None => return Ok(None),
            },
        };
        if rows == 0 {
            return Ok(Some(Tensor::empty()));
        }
        let (ids, route_weights, k) = self.routes(OP, x, layer, hashed, rows)?;
        let limit = layer.swiglu_limit;
        let expert_out = match &experts {
            V4Experts::Fast(fast) => {
                let a = self.quantised_activations(OP, x, dim, ActGroup::G32)?;
                let (table, rounding) = (&fast.table, Rounding::F32);
                self.routed_slots::<f32>(OP, &a, &ids, k, &route_weights, table, limit, rounding)?
            }
            V4Experts::Exact(exact) => {
                let x = &*self.input(OP, x)?;
                self.exact_slots(OP, x, &ids, k, &route_weights, &exact.table, limit)?
            }
        };
        self.v4_shared_combine(OP, x, layer, &expert_out, &ids)
            .map(Some)
    }

    /// The routed exact experts of `ids.len()` slots: slot `j` runs expert `ids[j]` of `table`
    /// on the f32 row `j / x_row_div` of `x` — `w1` and `w3`, SwiGLU weighted by
    /// `route_weights[j]`, `w2` — into f32 `[slots, dim]` (each slot bitwise the CPU's fp32
    /// linears for it, whichever slots run with it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn exact_slots(
        &self,
        op: &'static str,
        x: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        x_row_div: usize,
        route_weights: &CudaSlice<f32>,
        table: &DeviceExactExpertTable,
        limit: f32,
    ) -> Result<CudaSlice<f32>, CudaBackendError> {
        let (slots, inter, dim) = (ids.len(), table.inter(), table.dim());
        let routed = |x: &CudaSlice<f32>,
                      x_row_div: usize,
                      which: ExpertProjection,
                      width: usize|
         -> Result<CudaSlice<f32>, CudaBackendError> {
            // SAFETY: gemm_exact_routed's reduction writes every (slot, column); every slot row
            // lies in a tile of its partials launch.
            let mut out = unsafe { self.alloc_written(op, slots * width) }?;
            let rows = ExactRoutedRows {
                x,
                experts: ids,
                x_row_div,
                which,
            };
            gemm_exact_routed(&self.rt, rows, table, &mut out).map_err(op_err(op))?;
            Ok(out)
        };
        let gate = routed(x, x_row_div, ExpertProjection::W1, inter)?;
        let up = routed(x, x_row_div, ExpertProjection::W3, inter)?;
        // SAFETY: swiglu_rows's grid-stride loop writes every value.
        let mut hidden = unsafe { self.alloc_written(op, gate.len()) }?;
        let weights = Some(route_weights);
        swiglu_rows(
            &self.rt,
            &gate,
            &up,
            weights,
            limit,
            Rounding::F32,
            &mut hidden,
        )
        .map_err(op_err(op))?;
        routed(&hidden, 1, ExpertProjection::W2, dim)
    }

    /// The shared expert on every row of `x` (its projections by [`Backend::linear`]: exact, or
    /// the fast kernels of the fast numerics; SwiGLU in fp32), then the combine with the routed
    /// slots' outputs `expert_out` (f32 `[rows · k, dim]`, slot order, experts `ids`): each row's
    /// slots in increasing expert id, then the shared expert, in fp32.
    pub(super) fn v4_shared_combine(
        &self,
        op: &'static str,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        expert_out: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
    ) -> Result<Tensor, CudaBackendError> {
        let n_experts = layer.bias.len();
        let dim = layer.gate.len() / n_experts.max(1);
        let [s1, s3, s2] = exact_shared(layer.shared)
            .ok_or_else(|| shape_err(op, "a shared expert that is not exact".to_string()))?;
        let shared_gate = self.try_linear_v4(x, s1)?;
        let shared_up = self.try_linear_v4(x, s3)?;
        // SAFETY: swiglu_rows's grid-stride loop writes every value.
        let mut shared_hidden = unsafe { self.alloc_written(op, shared_gate.len()) }?;
        swiglu_rows(
            &self.rt,
            &*self.input(op, &shared_gate)?,
            &*self.input(op, &shared_up)?,
            None,
            layer.swiglu_limit,
            Rounding::F32,
            &mut shared_hidden,
        )
        .map_err(op_err(op))?;
        let shared_out = self.try_linear_v4(&self.tensor(shared_hidden), s2)?;
        // SAFETY: moe_combine runs one block per row and covers every column.
        let mut out = unsafe { self.alloc_written(op, whole_rows(op, x, dim)? * dim) }?;
        moe_combine(
            &self.rt,
            expert_out,
            ids,
            n_experts,
            &*self.input(op, &shared_out)?,
            dim,
            Rounding::F32,
            &mut out,
        )
        .map_err(op_err(op))?;
        Ok(self.tensor(out))
    }

    /// The device table of exact `experts` (table index = position in the list), each weight
    /// uploaded (or found) in the weight cache; `None` when a projection is not exact or not of
    /// one format and shape across them ([`exact_shape`]).
    pub(super) fn exact_expert_table_of(
        &self,
        op: &'static str,
        experts: &[&ExpertWeights<ExpertLinear>],
    ) -> Result<Option<DeviceExactExperts>, CudaBackendError> {
        if exact_shape(experts).is_none() {
            return Ok(None);
        }
        let device = |w: &ExpertLinear| -> Result<DeviceLinear, CudaBackendError> {
            match w {
                ExpertLinear::Exact(Linear::Dense { out, inp, values }) => {
                    Ok(DeviceLinear::F32(self.cached_f32(op, values)?, *out, *inp))
                }
                ExpertLinear::Exact(Linear::Fp8(w)) => Ok(DeviceLinear::Fp8(self.device_form(w)?)),
                ExpertLinear::Exact(Linear::Fp4(w)) => Ok(DeviceLinear::Fp4(self.device_form(w)?)),
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
        Ok(Some(DeviceExactExperts {
            table,
            _held: weights
                .into_iter()
                .flatten()
                .map(DeviceLinear::held)
                .collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::super::expert_fixtures::{dense, expert, fp8, uniform};
    use super::*;

    /// What an EP rank's slots may hold as one exact table (`ep.rs` `slot_experts`): exact
    /// projections of one format and shape across the experts give `(dim, inter)`; a quantised
    /// (V4.1) expert, a second format or another shape among them gives none, so the rank takes
    /// them as FP4/FP8 tables or refuses the layer.
    #[test]
    fn exact_tables_need_one_exact_format_and_shape() {
        let (dim, inter) = (64, 32);
        let a = uniform(dense, dim, inter);
        let b = uniform(dense, dim, inter);
        assert_eq!(exact_shape(&[&a, &b]), Some((dim, inter)));
        let exact_fp8 = |out, inp| ExpertLinear::Exact(Linear::Fp8(fp8(out, inp)));
        let c = uniform(exact_fp8, dim, inter);
        let d = uniform(exact_fp8, dim, inter);
        assert_eq!(exact_shape(&[&c, &d]), Some((dim, inter)));
        assert_eq!(exact_shape(&[&a, &c]), None, "two formats");
        let wide = uniform(dense, dim, 2 * inter);
        assert_eq!(exact_shape(&[&wide]), Some((dim, 2 * inter)));
        assert_eq!(exact_shape(&[&a, &wide]), None, "two shapes");
        let v41 = uniform(|out, inp| ExpertLinear::Fp8(fp8(out, inp)), dim, inter);
        assert_eq!(exact_shape(&[&v41]), None, "V4.1's FP8 experts");
        let odd = expert(dense(inter, dim), dense(inter, dim), dense(dim, inter + 1));
        assert_eq!(exact_shape(&[&odd]), None, "w2 does not read w1's outputs");
        assert_eq!(exact_shape(&[]), None);
        assert!(exact_shared(&a).is_some() && exact_shared(&v41).is_none());
    }
}
