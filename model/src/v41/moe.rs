//! The MoE feed-forward (spec §3.6): sqrt-softplus router with bias-steered top-k selection and
//! unbiased normalised weights, FP4 routed experts and the FP8 shared expert, SwiGLU with clamps.

use super::Ctx;
use super::csa::top_k_lowest_index;
use super::weights::{ExpertLinear, ExpertWeights, MoeWeights};
use crate::backend::Backend;
use crate::expert_dispatch::ExpertPick;
use crate::quant::{exp_f32, log1p_f32};

/// The experts chosen for one token (in selection order) and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// `ln(1 + e^z)` as the reference's vectorised softplus computes it (torch's `Vectorized` kernel):
/// its `exp` ([`exp_f32`]), then its `log1p` ([`log1p_f32`], SLEEF's, not always correctly rounded:
/// a correctly rounded `log1p` leaves 3 more of the fixture's 2400 routing weights an ulp off).
fn softplus(z: f32) -> f32 {
    if z > 20.0 { z } else { log1p_f32(exp_f32(z)) }
}

/// Router of one token: top-k of `s + bias` (ties: lower expert id), weights `s / Σs · scale`.
/// `forced` replaces the selection (the weights still come from this token's scores).
pub fn route(ctx: &Ctx, w: &MoeWeights, x: &[f32], forced: Option<&[usize]>) -> Route {
    let n_experts = w.bias.len();
    let scores: Vec<f32> = ctx
        .backend
        .linear_f32(x, &w.gate, n_experts, ctx.cfg.dim)
        .iter()
        .map(|&z| softplus(z).sqrt())
        .collect();
    let biased: Vec<f32> = scores.iter().zip(&w.bias).map(|(s, b)| s + b).collect();
    let experts = match forced {
        Some(forced) => forced.iter().copied().filter(|&e| e < n_experts).collect(),
        None => {
            let mut experts = top_k_lowest_index(&biased, w.n_activated);
            // Selection order: descending biased score, lower id first on ties (torch's sorted top-k).
            experts.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
            experts
        }
    };
    let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
    if weights.len() > 1 {
        let sum = weights.iter().fold(0.0f32, |a, v| a + v) + 1e-20;
        weights.iter_mut().for_each(|v| *v /= sum);
    }
    weights.iter_mut().for_each(|v| *v *= ctx.cfg.route_scale);
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
) -> (Vec<f32>, Route) {
    let route = route(ctx, w, x, forced);
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
