//! The mHC mixes both families compute at every site (spec §3.2).

use crate::backend::{HcMixes, HcMixing, HcParams, Tensor};
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
