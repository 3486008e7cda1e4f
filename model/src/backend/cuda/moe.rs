//! [`Backend::moe_rows`] on the device: the router, the routed experts and the shared expert of a
//! step's rows without leaving the device. The router's routes stay in device memory; every row
//! runs its chosen experts through one routed GEMM launch per projection (each row bitwise what
//! the dense GEMM gives for it), SwiGLU weights each row by its route, and the combine adds each
//! row's expert outputs in increasing expert id, then the shared expert — the order of the host
//! path, so the result is bitwise equal to it. SwiGLU and the quantisation of its rows for `w2`
//! are one kernel (`swiglu_act_quant_fp8`, bitwise the two steps). In the `fast` numerics the FP4
//! routed experts (`ops::routed_fast`) and the shared expert's GEMMs run on tensor cores instead
//! (its `w1` and `w3` in one launch, each plane bitwise its own launch's); the SwiGLU quantiser
//! and the combine are the same kernels. The routed chain ([`CudaBackend::routed_slots`]) also
//! serves V4's FP4 experts in the fast numerics (`v4.rs`), with f32 outputs and no bf16 rounding
//! ([`RoutedRow`]).

use deepinfer_kernels::ops::routed::{
    DeviceExpertTable, ExpertGroups, ExpertProjection, ExpertRefs, ExpertRowValue, RoutedRows,
    gemm_routed, moe_combine, swiglu_act_quant_fp8,
};
use deepinfer_kernels::ops::routed_fast::gemm_fp4_routed_fast;

use super::quantised::QuantisedHost;
use super::*;
use crate::backend::weights::{ExpertLinear, ExpertWeights, Linear};
use deepinfer_kernels::cudarc::driver::CudaView;

/// A layer's experts on the device: their address table and the weights it points into (held
/// here so that the addresses stay valid as long as the table).
pub(super) struct DeviceExperts {
    pub(super) table: DeviceExpertTable,
    _held: Vec<Arc<dyn Any + Send + Sync>>,
}

/// The element type of the routed GEMMs' output rows: bf16 from any FP4/FP8 table (V4.1's
/// rounding point), f32 from a fast FP4 table alone (V4's float32 experts in the fast numerics;
/// the exact routed kernels write bf16, and a launch on another table fails naming its format).
pub(super) trait RoutedRow: ExpertRowValue + Sized {
    /// The routed GEMM of `rows` over `table` into `out`.
    const GEMM: RoutedGemm<Self>;
}

/// A routed GEMM `(rt, rows, table, out)` into output rows of `T`.
pub(super) type RoutedGemm<T> = fn(
    &KernelRuntime,
    RoutedRows<'_, DeviceActFp8>,
    &DeviceExpertTable,
    &mut CudaSlice<T>,
) -> Result<(), KernelError>;

impl RoutedRow for bf16 {
    const GEMM: RoutedGemm<bf16> = gemm_routed;
}

impl RoutedRow for f32 {
    const GEMM: RoutedGemm<f32> = gemm_fp4_routed_fast;
}

impl CudaBackend {
    /// [`Backend::moe_rows`], with errors: `Ok(None)` when the layer's experts are not all FP4
    /// or all FP8 with 32×32 tiles (the routed GEMMs' formats) or the shared expert is not FP8/FP4.
    pub fn try_moe_rows(
        &self,
        x: &Tensor,
        layer: &MoeLayer<'_>,
    ) -> Result<Option<Tensor>, CudaBackendError> {
        const OP: &str = "moe_rows";
        let n_experts = layer.bias.len();
        if n_experts == 0 || layer.experts.len() != n_experts {
            return Ok(None);
        }
        let dim = layer.gate.len() / n_experts;
        let rows = whole_rows(OP, x, dim)?;
        if !shared_fits(layer.shared) {
            return Ok(None);
        }
        if let Some(result) = self.moe_rows_on_expert_rank(x, layer, None) {
            return result.map(Some);
        }
        let Some(experts) = self.device_experts(OP, layer.experts)? else {
            return Ok(None);
        };
        if rows == 0 {
            return Ok(Some(Tensor::empty()));
        }
        let rounding = rounding(layer.precision);
        let (ids, route_weights, k) = self.device_routes(OP, x, layer, rows)?;
        let a = self.quantised_activations(OP, x, dim, ActGroup::G32)?;
        let expert_out = self.routed_slots(
            OP,
            &a,
            &ids,
            k,
            &route_weights,
            &experts.table,
            layer.swiglu_limit,
            rounding,
        )?;

        // The shared expert on every row, then the combine.
        let shared = self.shared_expert(OP, &a, layer.shared, layer.swiglu_limit, rounding)?;
        // SAFETY: moe_combine runs one block per row and covers every column.
        let mut out = unsafe { self.alloc_written(OP, rows * dim) }?;
        moe_combine(
            &self.rt,
            &expert_out,
            &ids,
            n_experts,
            &shared,
            dim,
            rounding,
            &mut out,
        )
        .map_err(op_err(OP))?;
        Ok(Some(self.tensor(out)))
    }

    /// The router's top-k on the device: each row's `k` expert ids `[rows, k]` and route weights.
    pub(super) fn device_routes(
        &self,
        op: &'static str,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        rows: usize,
    ) -> Result<(CudaSlice<u32>, CudaSlice<f32>, usize), CudaBackendError> {
        self.routes(op, x, layer, None, rows)
    }

    /// Every row's `k` experts `[rows, k]` and route weights `[rows, k]` on the device: the
    /// router's top-k of the layer's bias, or each row's hashed experts with their weights.
    pub(super) fn routes(
        &self,
        op: &'static str,
        x: &Tensor,
        layer: &MoeLayer<'_>,
        hashed: Option<&[Vec<usize>]>,
        rows: usize,
    ) -> Result<(CudaSlice<u32>, CudaSlice<f32>, usize), CudaBackendError> {
        let n_experts = layer.bias.len();
        let dim = layer.gate.len() / n_experts;
        let gate = DenseWeight {
            values: layer.gate,
            out: n_experts,
            inp: dim,
        };
        let logits = self.try_linear(x, gate, Rounding::F32)?;
        let dbias = self.cached_f32(op, layer.bias)?;
        // A hash layer's experts of every row, checked and uploaded (the router reads each named
        // expert's score: every id must name one).
        let forced = match hashed {
            None => None,
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
                if let Some(bad) = hashed.iter().flatten().find(|&&e| e >= n_experts) {
                    return Err(shape_err(
                        op,
                        format!("hashed route names expert {bad} of {n_experts}"),
                    ));
                }
                let host_ids: Vec<u32> = hashed.iter().flatten().map(|&e| e as u32).collect();
                let ids = self
                    .rt
                    .htod(&host_ids)
                    .map_err(driver_err(op, "uploading the hashed experts"))?;
                Some((ids, k))
            }
        };
        // Each row's weights from its own scores over its own experts.
        let selection = match &forced {
            None => RouteSelection::TopK(layer.n_activated),
            Some((ids, k)) => RouteSelection::ForcedRows { ids, per_row: *k },
        };
        let k = selected_count(selection, n_experts);
        // SAFETY (both): route_experts_f32 runs one block per row that writes all k ids and
        // weights of the row (the chosen ranks 0..k, each filled).
        let mut ids = unsafe { self.alloc_written::<u32>(op, rows * k) }?;
        let mut weights = unsafe { self.alloc_written(op, rows * k) }?;
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
        Ok((ids, weights, k))
    }

    /// The routed experts of `ids.len()` slots: slot `j` runs expert `ids[j]` of `table` on the
    /// FP8 row `j / x_row_div` of `a` — `w1` and `w3` (one call, [`ExpertProjection::GateUp`]:
    /// one launch on the fast kernels), SwiGLU weighted by `route_weights[j]` (rounded at
    /// `rounding`) and quantised in 32-groups by one kernel, `w2` — into `[slots,
    /// dim]` of `T` (bf16: V4.1; f32: V4 in the fast numerics). The slots are grouped by expert once for
    /// the three routed GEMMs ([`ExpertGroups`]). Each slot is what the dense GEMMs of the
    /// table's numerics give for it, whichever slots run with it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn routed_slots<T: RoutedRow>(
        &self,
        op: &'static str,
        a: &DeviceActFp8,
        ids: &CudaSlice<u32>,
        x_row_div: usize,
        route_weights: &CudaSlice<f32>,
        table: &DeviceExpertTable,
        limit: f32,
        rounding: Rounding,
    ) -> Result<CudaSlice<T>, CudaBackendError> {
        let (slots, inter, dim) = (ids.len(), table.inter(), table.dim());
        let groups = ExpertGroups::new(&self.rt, ids, table).map_err(op_err(op))?;
        let routed = |x: &DeviceActFp8,
                      x_row_div: usize,
                      which: ExpertProjection,
                      width: usize|
         -> Result<CudaSlice<T>, CudaBackendError> {
            // SAFETY: the routed GEMMs write every slot row of every plane: each row lies in a
            // tile (or its own block) whose kernel stores all its columns, rows of unknown ids as
            // zeros.
            let mut out = unsafe { self.alloc_written::<T>(op, which.planes() * slots * width) }?;
            let rows = RoutedRows {
                x,
                groups: &groups,
                x_row_div,
                which,
            };
            T::GEMM(&self.rt, rows, table, &mut out).map_err(op_err(op))?;
            Ok(out)
        };
        let gate_up = routed(a, x_row_div, ExpertProjection::GateUp, inter)?;
        let weights = Some(route_weights);
        let shape = (slots, inter);
        let a_hidden = self.swiglu_quantised(
            op,
            gate_up.split_at(slots * inter),
            weights,
            shape,
            (limit, rounding),
        )?;
        routed(&a_hidden, 1, ExpertProjection::W2, dim)
    }

    /// The SwiGLU rows of `gate` and `up` (`[rows, inter]`, bf16 or f32), each row weighted by
    /// its `route_weights` entry (or not), clamped at `limit`, rounded at `rounding`, quantised
    /// to FP8 32-groups in the same kernel (the `w2` GEMM's activations).
    fn swiglu_quantised<T: ExpertRowValue>(
        &self,
        op: &'static str,
        (gate, up): (CudaView<'_, T>, CudaView<'_, T>),
        route_weights: Option<&CudaSlice<f32>>,
        (rows, inter): (usize, usize),
        (limit, rounding): (f32, Rounding),
    ) -> Result<DeviceActFp8, CudaBackendError> {
        // SAFETY: swiglu_act_quant_fp8 writes every code and every group's scale (a warp per 128
        // values over all rows * inter).
        let mut out = unsafe { DeviceActFp8::alloc_written(&self.rt, rows, inter, ActGroup::G32) }
            .map_err(op_err(op))?;
        swiglu_act_quant_fp8(
            &self.rt,
            &gate,
            &up,
            route_weights,
            limit,
            rounding,
            &mut out,
        )
        .map_err(op_err(op))?;
        Ok(out)
    }

    /// The shared expert of the rows `a` (FP8 32-group activations): bf16 `[rows, dim]`.
    pub(super) fn shared_expert(
        &self,
        op: &'static str,
        a: &DeviceActFp8,
        shared: &ExpertWeights<ExpertLinear>,
        limit: f32,
        rounding: Rounding,
    ) -> Result<CudaSlice<bf16>, CudaBackendError> {
        let dense =
            |x: &DeviceActFp8, w: &ExpertLinear| -> Result<CudaSlice<bf16>, CudaBackendError> {
                let out_width = match w {
                    ExpertLinear::Fp4(w) => w.out,
                    ExpertLinear::Fp8(w) => w.out,
                    ExpertLinear::Exact(_) => 0,
                };
                // SAFETY: the dense GEMMs below write all x.rows * out_width values (see
                // `quantised_gemm`).
                let mut y = unsafe { self.alloc_written::<bf16>(op, x.rows * out_width) }?;
                match (w, self.numerics) {
                    (ExpertLinear::Fp4(w), Numerics::Exact) => {
                        gemm_fp4(&self.rt, x, &*self.device_form(w)?, &mut y, GemmSplit::Auto)
                    }
                    (ExpertLinear::Fp4(w), Numerics::Fast) => {
                        gemm_fp4_fast(&self.rt, x, &*self.device_form(w)?, &mut y, FastTile::Auto)
                    }
                    (ExpertLinear::Fp8(w), Numerics::Exact) => {
                        gemm_fp8(&self.rt, x, &*self.device_form(w)?, &mut y, GemmSplit::Auto)
                    }
                    (ExpertLinear::Fp8(w), Numerics::Fast) => {
                        gemm_fp8_fast(&self.rt, x, &*self.device_form(w)?, &mut y, FastTile::Auto)
                    }
                    (ExpertLinear::Exact(_), _) => {
                        return Err(shape_err(op, "an exact shared expert".to_string()));
                    }
                }
                .map_err(op_err(op))?;
                Ok(y)
            };
        // w1 and w3 in one fast launch when they share format and shape (V4.1's do): the planes
        // [2][rows][inter] of one buffer, each bitwise its own launch's. Else one launch each.
        let pair = self.shared_gate_up(op, a, shared)?;
        let separate;
        let (gate, up) = match &pair {
            Some(both) => both.split_at(both.len() / 2),
            None => {
                separate = (dense(a, &shared.w1)?, dense(a, &shared.w3)?);
                (separate.0.slice(..), separate.1.slice(..))
            }
        };
        let shape = (a.rows, gate.len() / a.rows.max(1));
        let a_hidden = self.swiglu_quantised(op, (gate, up), None, shape, (limit, rounding))?;
        dense(&a_hidden, &shared.w2)
    }

    /// The shared expert's `w1` and `w3` of the rows `a` in one fast launch, bf16 planes
    /// `[2][rows][inter]`; `None` in the exact numerics or unless both are FP8 (in one tile) or
    /// both FP4 of one shape.
    fn shared_gate_up(
        &self,
        op: &'static str,
        a: &DeviceActFp8,
        shared: &ExpertWeights<ExpertLinear>,
    ) -> Result<Option<CudaSlice<bf16>>, CudaBackendError> {
        if self.numerics != Numerics::Fast {
            return Ok(None);
        }
        // SAFETY: the pair's launch writes both planes, all 2 * rows * inter values.
        let planes = |inter: usize| unsafe { self.alloc_written::<bf16>(op, 2 * a.rows * inter) };
        let both = match (&shared.w1, &shared.w3) {
            (ExpertLinear::Fp8(w1), ExpertLinear::Fp8(w3))
                if (w1.out, w1.inp, w1.block) == (w3.out, w3.inp, w3.block) =>
            {
                let (d1, d3) = (self.device_form(w1)?, self.device_form(w3)?);
                let mut y = planes(w1.out)?;
                gemm_fp8_fast(&self.rt, a, [&*d1, &*d3], &mut y, FastTile::Auto)
                    .map_err(op_err(op))?;
                y
            }
            (ExpertLinear::Fp4(w1), ExpertLinear::Fp4(w3))
                if (w1.out, w1.inp) == (w3.out, w3.inp) =>
            {
                let (d1, d3) = (self.device_form(w1)?, self.device_form(w3)?);
                let mut y = planes(w1.out)?;
                gemm_fp4_fast(&self.rt, a, [&*d1, &*d3], &mut y, FastTile::Auto)
                    .map_err(op_err(op))?;
                y
            }
            _ => return Ok(None),
        };
        Ok(Some(both))
    }

    /// The fast table of V4 FP4 `experts` (table index = position in the list), laid out for
    /// the tensor-core routed GEMM; `None` unless [`v4_fast_shape`] takes them.
    pub(super) fn v4_fast_expert_table_of(
        &self,
        op: &'static str,
        experts: &[&ExpertWeights<ExpertLinear>],
    ) -> Result<Option<DeviceExperts>, CudaBackendError> {
        if v4_fast_shape(experts).is_none() {
            return Ok(None);
        }
        let fp4: Option<Vec<[&Fp4Weight; 3]>> = experts
            .iter()
            .map(|e| Some([v4_fp4(&e.w1)?, v4_fp4(&e.w3)?, v4_fp4(&e.w2)?]))
            .collect();
        let Some(fp4) = fp4 else {
            return Ok(None);
        };
        let build = DeviceExpertTable::fp4_fast;
        self.expert_table(op, &fp4, |w| self.device_form(w), build)
            .map(Some)
    }

    /// The device table of a layer's experts, built once and cached with the weights; `None`
    /// when they are not all FP4 or all FP8 with 32×32 tiles.
    fn device_experts(
        &self,
        op: &'static str,
        experts: &[ExpertWeights<ExpertLinear>],
    ) -> Result<Option<Arc<DeviceExperts>>, CudaBackendError> {
        self.cached_expert_table(
            experts,
            |cache| &mut cache.expert_tables,
            |all| self.expert_table_of(op, all),
        )
    }

    /// Drops the cached device copies of `expert`'s weights (an EP rank no longer holds it),
    /// whichever form they take: FP4/FP8 (and their tensor-core layouts), or exact (dense f32,
    /// FP8, FP4).
    pub(super) fn forget_expert(&self, expert: &ExpertWeights<ExpertLinear>) {
        let mut cache = self.lock_weights();
        for w in [&expert.w1, &expert.w3, &expert.w2] {
            match w {
                ExpertLinear::Fp4(w) | ExpertLinear::Exact(Linear::Fp4(w)) => {
                    cache.quantised.remove(&w.key());
                }
                ExpertLinear::Fp8(w) | ExpertLinear::Exact(Linear::Fp8(w)) => {
                    cache.quantised.remove(&w.key());
                }
                ExpertLinear::Exact(Linear::Dense { values, .. }) => {
                    cache.f32s.remove(&HostKey::f32s(values));
                }
            }
        }
    }

    /// The device table of `experts` (table index = position in the list); `None` when they
    /// are not all FP4 or all FP8 with 32×32 tiles. FP4 experts in the `fast` numerics are laid
    /// out for the tensor-core GEMM; FP8 experts run the exact routed kernels in both.
    pub(super) fn expert_table_of(
        &self,
        op: &'static str,
        experts: &[&ExpertWeights<ExpertLinear>],
    ) -> Result<Option<DeviceExperts>, CudaBackendError> {
        let fp4: Option<Vec<[&Fp4Weight; 3]>> = experts
            .iter()
            .map(|e| match (&e.w1, &e.w3, &e.w2) {
                (ExpertLinear::Fp4(w1), ExpertLinear::Fp4(w3), ExpertLinear::Fp4(w2)) => {
                    Some([w1, w3, w2])
                }
                _ => None,
            })
            .collect();
        let fp8: Option<Vec<[&Fp8Weight; 3]>> = experts
            .iter()
            .map(|e| match (&e.w1, &e.w3, &e.w2) {
                (ExpertLinear::Fp8(w1), ExpertLinear::Fp8(w3), ExpertLinear::Fp8(w2))
                    if [w1, w3, w2].iter().all(|w| w.block == 32) =>
                {
                    Some([w1, w3, w2])
                }
                _ => None,
            })
            .collect();
        match (fp4, self.numerics) {
            (Some(fp4), Numerics::Exact) => {
                return self
                    .expert_table(op, &fp4, |w| self.device_form(w), DeviceExpertTable::fp4)
                    .map(Some);
            }
            (Some(fp4), Numerics::Fast) => {
                return self
                    .expert_table(
                        op,
                        &fp4,
                        |w| self.device_form(w),
                        DeviceExpertTable::fp4_fast,
                    )
                    .map(Some);
            }
            (None, _) => {}
        }
        if let Some(fp8) = fp8 {
            self.expert_table(op, &fp8, |w| self.device_form(w), DeviceExpertTable::fp8)
                .map(Some)
        } else {
            Ok(None)
        }
    }

    /// The device table of experts given as host weights `[w1, w3, w2]`: each weight uploaded
    /// (or found) in the cache by `cached`, the table built by `build` over them.
    fn expert_table<H, W: Send + Sync + 'static>(
        &self,
        op: &'static str,
        experts: &[[&H; 3]],
        cached: impl Fn(&H) -> Result<Arc<W>, CudaBackendError>,
        build: unsafe fn(
            &KernelRuntime,
            &[ExpertRefs<'_, W>],
        ) -> Result<DeviceExpertTable, KernelError>,
    ) -> Result<DeviceExperts, CudaBackendError> {
        let weights = experts
            .iter()
            .map(|[w1, w3, w2]| Ok([cached(w1)?, cached(w3)?, cached(w2)?]))
            .collect::<Result<Vec<_>, CudaBackendError>>()?;
        let refs: Vec<ExpertRefs<'_, W>> = weights
            .iter()
            .map(|[w1, w3, w2]| ExpertRefs {
                w1: &**w1,
                w3: &**w3,
                w2: &**w2,
            })
            .collect();
        // SAFETY: the table is stored next to `weights` (the Arcs it points into) in one
        // `DeviceExperts`, which outlives every launch that reads it.
        let table = unsafe { build(&self.rt, &refs) }.map_err(op_err(op))?;
        Ok(DeviceExperts {
            table,
            _held: held(weights),
        })
    }
}

/// The weights of every expert, as the type-erased handles [`DeviceExperts`] holds.
fn held<W: Send + Sync + 'static>(weights: Vec<[Arc<W>; 3]>) -> Vec<Arc<dyn Any + Send + Sync>> {
    weights
        .into_iter()
        .flatten()
        .map(|w| w as Arc<dyn Any + Send + Sync>)
        .collect()
}

/// The FP4 weight of a V4 projection (`ExpertLinear::Exact`), if it is one.
fn v4_fp4(w: &ExpertLinear) -> Option<&Fp4Weight> {
    match w {
        ExpertLinear::Exact(Linear::Fp4(w)) => Some(w),
        _ => None,
    }
}

/// The `(dim, inter)` of V4 experts the fast routed chain takes: every projection FP4, one shape
/// across them (`w1`, `w3`: `[inter, dim]`; `w2`: `[dim, inter]`); `None` otherwise (or for no
/// experts).
pub(super) fn v4_fast_shape(experts: &[&ExpertWeights<ExpertLinear>]) -> Option<(usize, usize)> {
    uniform_expert_shape(experts, |w| v4_fp4(w).map(|w| ((), w.out, w.inp)))
}

/// The `(dim, inter)` of `experts` when `kind` takes every projection (`Some((format, out,
/// inp))`) and each projection has one kind across them (`w1`, `w3`: `[inter, dim]`; `w2`:
/// `[dim, inter]`), as a routed table requires; `None` otherwise (or for no experts).
pub(super) fn uniform_expert_shape<F: PartialEq>(
    experts: &[&ExpertWeights<ExpertLinear>],
    kind: impl Fn(&ExpertLinear) -> Option<(F, usize, usize)>,
) -> Option<(usize, usize)> {
    let kinds = |e: &ExpertWeights<ExpertLinear>| Some([kind(&e.w1)?, kind(&e.w3)?, kind(&e.w2)?]);
    let expected = kinds(experts.first()?)?;
    let [(_, i1, d1), (_, i3, d3), (_, d2, i2)] = &expected;
    let fits = d1 == d3 && d1 == d2 && i1 == i3 && i1 == i2 && *i1 > 0 && *d1 > 0;
    (fits && experts.iter().all(|e| kinds(e).as_ref() == Some(&expected))).then_some((*d1, *i1))
}

/// The shared expert runs on the rows' FP8 32-group activations: FP4, or FP8 with 32×32 tiles.
fn shared_fits(shared: &ExpertWeights<ExpertLinear>) -> bool {
    [&shared.w1, &shared.w3, &shared.w2]
        .into_iter()
        .all(|w| match w {
            ExpertLinear::Fp4(_) => true,
            ExpertLinear::Fp8(w) => w.block == 32,
            ExpertLinear::Exact(_) => false,
        })
}

#[cfg(test)]
mod tests {
    use super::super::expert_fixtures::{dense, expert, fp4, uniform};
    use super::*;

    /// What the fast routed chain takes of V4's experts (`moe_rows_exact` and an EP rank's
    /// slots in the fast numerics): FP4 projections of one shape across the experts give `(dim,
    /// inter)`; a dense projection, V4.1's FP4 experts, a second shape, or `w2` not reading
    /// `w1`'s outputs give none (those experts keep the exact routed linears, or V4.1's chain).
    #[test]
    fn v4_fast_tables_need_fp4_projections_of_one_shape() {
        let (dim, inter) = (128, 64);
        let (a, b) = (uniform(fp4, dim, inter), uniform(fp4, dim, inter));
        assert_eq!(v4_fast_shape(&[&a, &b]), Some((dim, inter)));
        let mixed = expert(dense(inter, dim), fp4(inter, dim), fp4(dim, inter));
        assert_eq!(v4_fast_shape(&[&mixed]), None, "a dense w1");
        assert_eq!(
            v4_fast_shape(&[&a, &mixed]),
            None,
            "one expert of another format"
        );
        let v41 = |out, inp| match fp4(out, inp) {
            ExpertLinear::Exact(Linear::Fp4(w)) => ExpertLinear::Fp4(w),
            _ => unreachable!("fp4 builds an exact FP4 projection"),
        };
        let v41 = uniform(v41, dim, inter);
        assert_eq!(v4_fast_shape(&[&v41]), None, "V4.1's FP4 experts");
        let wide = uniform(fp4, dim, 2 * inter);
        assert_eq!(v4_fast_shape(&[&a, &wide]), None, "two shapes");
        let odd = expert(fp4(inter, dim), fp4(inter, dim), fp4(dim, 2 * inter));
        assert_eq!(
            v4_fast_shape(&[&odd]),
            None,
            "w2 does not read w1's outputs"
        );
        assert_eq!(v4_fast_shape(&[]), None);
    }
}
