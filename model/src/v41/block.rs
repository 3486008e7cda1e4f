//! One block with lagged mHC (spec §3.2): attention and MoE each sit between a collapse of the hc
//! streams (with the *previous* site's `pre`) and an expansion through their own `post`/`comb`.
//! Every op runs once over all rows of a step (each row is one token of some sequence).

use super::weights::BlockWeights;
use crate::backend::{Precision, Tensor};
use crate::layers::ctx::Ctx;
use crate::layers::mhc;
use crate::layers::moe::{self, Route};

/// The normed attention inputs `RMSNorm_attn(collapse(X, pre))` `[n, dim]` of the rows.
pub fn attention_inputs(ctx: &Ctx, w: &BlockWeights, streams: &Tensor, pre: &Tensor) -> Tensor {
    let x = mhc::collapse(ctx, streams, pre);
    ctx.backend
        .rms_norm(&x, ctx.norm(&w.attn_norm, Precision::Bf16))
}

/// Runs one block over the rows. `streams` is `[n, hc, dim]`, `pre` is `[n, hc]` (the previous
/// FFN site's collapse weights) and is replaced by this block's FFN `pre`. `attention` maps the
/// normed attention inputs `[n, dim]` to the attention outputs `[n, dim]`; `forced_routes` (per
/// row) replaces the router's selection. Returns the routes when `need_routes` (else they may
/// stay on the device: empty).
pub fn forward(
    ctx: &Ctx,
    w: &BlockWeights,
    streams: &mut Tensor,
    pre: &mut Tensor,
    forced_routes: Option<&[Vec<usize>]>,
    need_routes: bool,
    attention: impl FnOnce(&Tensor) -> Tensor,
) -> Vec<Route> {
    let attn_mix = mhc::mixes(ctx, streams, &w.hc_attn);
    let y = attention(&attention_inputs(ctx, w, streams, pre));
    *streams = mhc::expand(ctx, &y, streams, &attn_mix);

    let ffn_mix = mhc::mixes(ctx, streams, &w.hc_ffn);
    let x = mhc::collapse(ctx, streams, &attn_mix.pre(ctx.backend));
    let xn = ctx
        .backend
        .rms_norm(&x, ctx.norm(&w.ffn_norm, Precision::Bf16));
    let (y, routes) = moe::forward_rows(ctx, &w.moe, &xn, forced_routes, need_routes);
    *streams = mhc::expand(ctx, &y, streams, &ffn_mix);
    *pre = ffn_mix.pre(ctx.backend);
    routes
}
