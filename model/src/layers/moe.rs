//! The MoE feed-forward (spec §3.6): sqrt-softplus router with bias-steered top-k selection and
//! unbiased normalised weights, FP4 routed experts and the FP8 shared expert, SwiGLU with clamps.
//! Both families run it.

use crate::backend::weights::{ExpertLinear, ExpertWeights};
use crate::backend::{
    Backend, DenseWeight, ExpertRoute, ExpertSelection, MoeLayer, Routing, Tensor,
};
use crate::expert_dispatch::ExpertPick;
use crate::layers::ctx::Ctx;
use crate::quant::exp_f32;

/// Router + routed experts + the shared expert of one block.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `[n_experts, dim]` (bf16 values, used in fp32).
    pub gate: Vec<f32>,
    /// Selection bias `[n_experts]` (fp32).
    pub bias: Vec<f32>,
    pub n_activated: usize,
    /// The routed experts this model holds, in increasing expert id: all of them, or those the
    /// loader's `ExpertFilter` kept (see `held`).
    pub experts: Vec<ExpertWeights<ExpertLinear>>,
    /// The expert id of each entry of `experts` when the loader kept only some (increasing);
    /// `None`: entry `e` is expert `e`, every expert is here.
    pub held: Option<Vec<usize>>,
    pub shared: ExpertWeights<ExpertLinear>,
    /// A hash layer's `tid2eid` `[vocab, n_activated]` (V4): the experts of every token id,
    /// chosen instead of the biased top-k.
    pub tid2eid: Option<Vec<usize>>,
}

impl MoeWeights {
    /// The weights of routed expert `expert`, if this model holds it.
    pub fn expert(&self, expert: usize) -> Option<&ExpertWeights<ExpertLinear>> {
        match &self.held {
            None => self.experts.get(expert),
            Some(ids) => ids
                .binary_search(&expert)
                .ok()
                .and_then(|i| self.experts.get(i)),
        }
    }

    /// The first routed expert (of `n_experts`) this model does not hold, if any.
    pub fn first_missing(&self) -> Option<usize> {
        let n_experts = self.bias.len();
        (0..n_experts).find(|&e| self.expert(e).is_none())
    }
}

/// The router's bias choice for the rows of one block call: row `t` of the chunk selects its
/// experts with `bias_vl` when `image_rows[t]` (spec §3.6), with the gate's bias otherwise.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ImageRouting<'a> {
    image_rows: &'a [bool],
    bias_vl: &'a [f32],
}

impl<'a> ImageRouting<'a> {
    pub(crate) fn new(image_rows: &'a [bool], bias_vl: &'a [f32]) -> ImageRouting<'a> {
        ImageRouting {
            image_rows,
            bias_vl,
        }
    }

    /// The selection bias of chunk row `row`: `bias_vl` for an image-span row, `None` (the
    /// gate's own bias) otherwise.
    pub(crate) fn bias_for(&self, row: usize) -> Option<&'a [f32]> {
        self.image_rows
            .get(row)
            .copied()
            .unwrap_or(false)
            .then_some(self.bias_vl)
    }
}

/// The experts chosen for one token (in selection order) and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Routers of every row of `x [n, dim]`: top-k of `s + bias` (ties: lower expert id), weights
/// `s / Σs · scale`. `forced[t]` replaces row t's selection (the weights still come from its own
/// scores); image-span rows (`ctx.image_routing`) select with `bias_vl` instead of the gate's bias.
pub fn route_rows(
    ctx: &Ctx,
    w: &MoeWeights,
    x: &Tensor,
    forced: Option<&[Vec<usize>]>,
) -> Vec<Route> {
    let n_experts = w.bias.len();
    let logits = ctx.backend.linear_f32(
        x,
        DenseWeight {
            values: &w.gate,
            out: n_experts,
            inp: ctx.cfg.dim,
        },
    );
    let into_route = |r: ExpertRoute| Route {
        experts: r.experts,
        weights: r.weights,
    };
    let bias_of = |t: usize| {
        ctx.image_routing
            .and_then(|routing| routing.bias_for(t))
            .unwrap_or(&w.bias)
    };
    let rows = logits.len() / n_experts.max(1);
    let uniform = forced.is_none() && (0..rows).all(|t| std::ptr::eq(bias_of(t), &w.bias[..]));
    if uniform {
        // One router call for the whole step: every row selects alike.
        let selection = ExpertSelection::TopK(w.n_activated);
        return ctx
            .backend
            .route_experts(
                &logits,
                Routing {
                    bias: &w.bias,
                    selection,
                    route_scale: ctx.cfg.route_scale,
                },
            )
            .into_iter()
            .map(into_route)
            .collect();
    }
    logits
        .chunks_exact(n_experts)
        .enumerate()
        .map(|(t, row)| {
            let selection = match forced.and_then(|f| f.get(t)) {
                Some(forced) => ExpertSelection::Forced(forced),
                None => ExpertSelection::TopK(w.n_activated),
            };
            let routed = ctx.backend.route_experts(
                &row.into(),
                Routing {
                    bias: bias_of(t),
                    selection,
                    route_scale: ctx.cfg.route_scale,
                },
            );
            routed.into_iter().next().map_or(
                Route {
                    experts: Vec::new(),
                    weights: Vec::new(),
                },
                into_route,
            )
        })
        .collect()
}

pub(crate) trait ExpertProjection {
    fn apply(&self, backend: &dyn Backend, x: &Tensor) -> Tensor;
}

impl ExpertProjection for ExpertLinear {
    fn apply(&self, backend: &dyn Backend, x: &Tensor) -> Tensor {
        match self {
            ExpertLinear::Fp4(w) => backend.gemm_fp4(x, w),
            ExpertLinear::Fp8(w) => backend.gemm_fp8(x, w),
            ExpertLinear::Exact(w) => w.apply(backend, x),
        }
    }
}

/// One SwiGLU expert on the rows of `x [m, dim]`; `weights` (routed experts, one per row)
/// multiplies each row's activation before `w2`.
pub(crate) fn expert<W: ExpertProjection>(
    ctx: &Ctx,
    e: &ExpertWeights<W>,
    x: &Tensor,
    weights: Option<&[f32]>,
) -> Tensor {
    let limit = ctx.cfg.swiglu_limit;
    let precision = ctx.cfg.precision();
    let gate = e.w1.apply(ctx.backend, x);
    let up = e.w3.apply(ctx.backend, x);
    let rows = x.len() / ctx.cfg.dim.max(1);
    let inter = gate.len() / rows.max(1);
    let hidden: Vec<f32> = gate
        .iter()
        .zip(&up)
        .enumerate()
        .map(|(i, (&g, &u))| {
            let (g, u) = if limit > 0.0 {
                (g.min(limit), u.clamp(-limit, limit))
            } else {
                (g, u)
            };
            let a = g / (1.0 + exp_f32(-g)) * u;
            let weight = weights.and_then(|w| w.get(i / inter.max(1)));
            precision.round(weight.map_or(a, |w| w * a))
        })
        .collect();
    e.w2.apply(ctx.backend, &hidden.into())
}

/// The layer as one [`MoeLayer`] op.
pub(crate) fn layer_op<'a>(ctx: &Ctx<'a>, w: &'a MoeWeights) -> MoeLayer<'a> {
    MoeLayer {
        gate: &w.gate,
        bias: &w.bias,
        n_activated: w.n_activated,
        route_scale: ctx.cfg.route_scale,
        experts: &w.experts,
        shared: &w.shared,
        swiglu_limit: ctx.cfg.swiglu_limit,
        precision: ctx.cfg.precision(),
    }
}

/// MoE of every row of `x [n, dim]`: each row's routed experts summed in increasing expert id,
/// then the shared expert, in fp32 (the routed experts run grouped: one expert call over all the
/// rows that chose it, whose rows do not depend on each other). `forced` as in [`route_rows`].
/// Without forced routes, image rows or an expert site, and when the caller does not need the
/// routes back, the backend may run the whole layer as one op ([`Backend::moe_rows`]); the
/// routes then stay on the device and come back empty.
pub fn forward_rows(
    ctx: &Ctx,
    w: &MoeWeights,
    x: &Tensor,
    forced: Option<&[Vec<usize>]>,
    need_routes: bool,
) -> (Tensor, Vec<Route>) {
    let dim = ctx.cfg.dim;
    if !need_routes
        && forced.is_none()
        && ctx.routed.is_none()
        && ctx.image_routing.is_none()
        && let Some(y) = ctx.backend.moe_rows(x, &layer_op(ctx, w))
    {
        return (y, Vec::new());
    }
    let routes = route_rows(ctx, w, x, forced);
    let mut y = vec![0.0f32; x.len()];
    let mut add = |t: usize, output: &[f32]| {
        for (acc, v) in y[t * dim..(t + 1) * dim].iter_mut().zip(output) {
            *acc += v;
        }
    };
    match ctx.routed {
        // Expert parallelism: every row's picks (in increasing expert id) go to the expert site
        // in one call per layer; each row's outputs are added in that order.
        Some(site) => {
            let picks: Vec<Vec<ExpertPick>> = routes
                .iter()
                .map(|route| {
                    let mut picks: Vec<ExpertPick> = route
                        .experts
                        .iter()
                        .zip(&route.weights)
                        .map(|(&expert, &weight)| ExpertPick { expert, weight })
                        .collect();
                    picks.sort_by_key(|pick| pick.expert);
                    picks
                })
                .collect();
            let outputs = site
                .experts
                .run(site.layer, &x[..routes.len() * dim], &picks);
            for (t, row) in outputs.iter().enumerate() {
                for output in row {
                    add(t, output);
                }
            }
        }
        None => {
            // Rows (with their weights) of every expert; visiting experts in increasing id adds
            // each row's outputs in that order.
            // (The model refuses to run a layer whose experts it does not all hold here:
            // `Model::check_experts_held`.)
            let mut users: Vec<Vec<(usize, f32)>> = vec![Vec::new(); w.bias.len()];
            for (t, route) in routes.iter().enumerate() {
                for (&expert, &weight) in route.experts.iter().zip(&route.weights) {
                    if let Some(rows) = users.get_mut(expert) {
                        rows.push((t, weight));
                    }
                }
            }
            for (id, rows) in users.iter().enumerate() {
                let Some(weights) = w.expert(id).filter(|_| !rows.is_empty()) else {
                    continue;
                };
                let pieces: Vec<(&Tensor, usize)> =
                    rows.iter().map(|&(t, _)| (x, t * dim)).collect();
                let xe = ctx.backend.gather(&pieces, dim);
                let scale: Vec<f32> = rows.iter().map(|&(_, weight)| weight).collect();
                let out = expert(ctx, weights, &xe, Some(&scale));
                for (&(t, _), output) in rows.iter().zip(out.chunks_exact(dim)) {
                    add(t, output);
                }
            }
        }
    }
    for (acc, v) in y.iter_mut().zip(expert(ctx, &w.shared, x, None).iter()) {
        *acc += v;
    }
    let precision = ctx.cfg.precision();
    let y: Vec<f32> = y.into_iter().map(|v| precision.round(v)).collect();
    (y.into(), routes)
}
