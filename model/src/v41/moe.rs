//! The MoE feed-forward (spec §3.6): sqrt-softplus router with bias-steered top-k selection and
//! unbiased normalised weights, FP4 routed experts and the FP8 shared expert, SwiGLU with clamps.

use super::Ctx;
use super::weights::{ExpertLinear, ExpertWeights, MoeWeights};
use crate::backend::{Backend, ExpertRoute, ExpertSelection};
use crate::expert_dispatch::ExpertPick;
use crate::quant::exp_f32;

/// The experts chosen for one token (in selection order) and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Router of one token: top-k of `s + bias` (ties: lower expert id), weights `s / Σs · scale`.
/// `forced` replaces the selection (the weights still come from this token's scores);
/// `bias_override` replaces the gate's selection bias (`bias_vl` on image rows).
pub fn route(
    ctx: &Ctx,
    w: &MoeWeights,
    x: &[f32],
    forced: Option<&[usize]>,
    bias_override: Option<&[f32]>,
) -> Route {
    let n_experts = w.bias.len();
    let logits = ctx.backend.linear_f32(x, &w.gate, n_experts, ctx.cfg.dim);
    let selection = match forced {
        Some(forced) => ExpertSelection::Forced(forced),
        None => ExpertSelection::TopK(w.n_activated),
    };
    let bias = bias_override.unwrap_or(&w.bias);
    let routed = ctx
        .backend
        .route_experts(&logits, bias, selection, ctx.cfg.route_scale);
    let ExpertRoute { experts, weights } = routed.into_iter().next().unwrap_or(ExpertRoute {
        experts: Vec::new(),
        weights: Vec::new(),
    });
    Route { experts, weights }
}

pub(crate) trait ExpertProjection {
    fn apply(&self, backend: &dyn Backend, x: &[f32]) -> Vec<f32>;
}

impl ExpertProjection for ExpertLinear {
    fn apply(&self, backend: &dyn Backend, x: &[f32]) -> Vec<f32> {
        match self {
            ExpertLinear::Fp4(w) => backend.gemm_fp4(x, w),
            ExpertLinear::Fp8(w) => backend.gemm_fp8(x, w),
            ExpertLinear::Exact(w) => w.apply(backend, x),
        }
    }
}

/// One SwiGLU expert on one token; `weight` (routed experts) multiplies the activation before `w2`.
pub(crate) fn expert<W: ExpertProjection>(
    ctx: &Ctx,
    e: &ExpertWeights<W>,
    x: &[f32],
    weight: Option<f32>,
) -> Vec<f32> {
    let limit = ctx.cfg.swiglu_limit;
    let precision = ctx.cfg.precision();
    let gate = e.w1.apply(ctx.backend, x);
    let up = e.w3.apply(ctx.backend, x);
    let hidden: Vec<f32> = gate
        .iter()
        .zip(&up)
        .map(|(&g, &u)| {
            let (g, u) = if limit > 0.0 {
                (g.min(limit), u.clamp(-limit, limit))
            } else {
                (g, u)
            };
            let a = g / (1.0 + exp_f32(-g)) * u;
            precision.round(weight.map_or(a, |w| w * a))
        })
        .collect();
    e.w2.apply(ctx.backend, &hidden)
}

/// MoE of one token: routed experts in increasing id, then the shared expert, summed in fp32.
pub fn forward_token(
    ctx: &Ctx,
    w: &MoeWeights,
    x: &[f32],
    forced: Option<&[usize]>,
    bias_override: Option<&[f32]>,
) -> (Vec<f32>, Route) {
    let route = route(ctx, w, x, forced, bias_override);
    let mut picks: Vec<ExpertPick> = route
        .experts
        .iter()
        .zip(&route.weights)
        .map(|(&expert, &weight)| ExpertPick { expert, weight })
        .collect();
    picks.sort_by_key(|pick| pick.expert);
    // Wherever the routed experts run, their outputs are summed here in increasing expert id.
    let outputs = match ctx.routed {
        Some(site) => site.experts.run(site.layer, x, &picks),
        None => picks
            .iter()
            .map(|pick| expert(ctx, &w.experts[pick.expert], x, Some(pick.weight)))
            .collect(),
    };
    let mut y = vec![0.0f32; x.len()];
    for output in outputs {
        for (acc, v) in y.iter_mut().zip(output) {
            *acc += v;
        }
    }
    for (acc, v) in y.iter_mut().zip(expert(ctx, &w.shared, x, None)) {
        *acc += v;
    }
    let precision = ctx.cfg.precision();
    (y.into_iter().map(|v| precision.round(v)).collect(), route)
}
