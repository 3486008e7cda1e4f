//! The mHC ops both families run at every site (spec §3.2): the mixes, the collapse of the
//! streams for a sublayer and the expansion of its output back into them, each rounded at the
//! model's precision.

use crate::backend::{HcCollapse, HcExpand, HcMixes, HcMixing, HcParams, Tensor};
use crate::layers::ctx::Ctx;

/// The mHC coefficients of every row of `streams [n, hc, dim]` at the site with `params`, with
/// the model's stream count, Sinkhorn iterations and epsilons.
pub fn mixes(ctx: &Ctx, streams: &Tensor, params: &HcParams) -> HcMixes {
    let cfg = ctx.cfg;
    let mixing = HcMixing {
        hc: cfg.hc.mult,
        sinkhorn_iters: cfg.hc.sinkhorn_iters,
        hc_eps: cfg.hc.eps,
        norm_eps: cfg.norm_eps,
    };
    ctx.backend.hc_mixes_rows(streams, params, &mixing)
}

/// `Σ_k pre_k · X_k` of every row of `streams [n, hc, dim]` by its own weights `pre [n, hc]` →
/// `[n, dim]`.
pub fn collapse(ctx: &Ctx, streams: &Tensor, pre: &Tensor) -> Tensor {
    let collapse = HcCollapse {
        weights: pre,
        hc: ctx.cfg.hc.mult,
        precision: ctx.cfg.precision(),
    };
    ctx.backend.hc_collapse_rows_at(streams, collapse)
}

/// The sublayer output `y [n, dim]` expanded into `streams [n, hc, dim]` through each row's mix
/// of `mixes` → the new streams `[n, hc, dim]`.
pub fn expand(ctx: &Ctx, y: &Tensor, streams: &Tensor, mixes: &HcMixes) -> Tensor {
    let expand = HcExpand {
        residual: streams,
        mixes,
        precision: ctx.cfg.precision(),
    };
    ctx.backend.hc_expand_rows_at(y, expand)
}
