//! One block with lagged mHC (spec §3.2): attention and MoE each sit between a collapse of the hc
//! streams (with the *previous* site's `pre`) and an expansion through their own `post`/`comb`.

use super::Ctx;
use super::moe::{self, Route};
use super::weights::BlockWeights;

/// The normed attention inputs `RMSNorm_attn(collapse(X, pre))` `[n, dim]` of a chunk.
pub fn attention_inputs(ctx: &Ctx, w: &BlockWeights, streams: &[f32], pre: &[f32]) -> Vec<f32> {
    let (hc, dim) = (ctx.cfg.hc.mult, ctx.cfg.dim);
    let width = hc * dim;
    streams
        .chunks_exact(width)
        .zip(pre.chunks_exact(hc))
        .flat_map(|(x, p)| {
            let x = ctx.backend.hc_collapse(x, p);
            ctx.backend.rms_norm(&x, &w.attn_norm, ctx.cfg.norm_eps)
        })
        .collect()
}

/// Runs one block over a chunk. `streams` is `[n, hc, dim]`, `pre` is `[n, hc]` (the previous
/// FFN site's collapse weights) and is replaced by this block's FFN `pre`. `attention` maps the
/// normed attention inputs `[n, dim]` to the attention outputs `[n, dim]`; `forced_routes` (per
/// row) replaces the router's selection. Returns the routes.
pub fn forward(
    ctx: &Ctx,
    w: &BlockWeights,
    streams: &mut [f32],
    pre: &mut [f32],
    forced_routes: Option<&[Vec<usize>]>,
    attention: impl FnOnce(&[f32]) -> Vec<f32>,
) -> Vec<Route> {
    let cfg = ctx.cfg;
    let (hc, dim) = (cfg.hc.mult, cfg.dim);
    let width = hc * dim;
    let n = streams.len() / width;
    let mixes = |streams: &[f32], params| {
        (0..n)
            .map(|t| {
                ctx.backend.hc_mixes(
                    &streams[t * width..(t + 1) * width],
                    params,
                    hc,
                    cfg.hc.sinkhorn_iters,
                    cfg.hc.eps,
                    cfg.norm_eps,
                )
            })
            .collect::<Vec<_>>()
    };

    let attn_mix = mixes(streams, &w.hc_attn);
    let y = attention(&attention_inputs(ctx, w, streams, pre));
    for t in 0..n {
        let expanded = ctx.backend.hc_expand(
            &y[t * dim..(t + 1) * dim],
            &streams[t * width..(t + 1) * width],
            &attn_mix[t],
        );
        streams[t * width..(t + 1) * width].copy_from_slice(&expanded);
    }

    let ffn_mix = mixes(streams, &w.hc_ffn);
    let mut routes = Vec::with_capacity(n);
    for t in 0..n {
        let x = ctx
            .backend
            .hc_collapse(&streams[t * width..(t + 1) * width], &attn_mix[t].pre);
        let xn = ctx.backend.rms_norm(&x, &w.ffn_norm, cfg.norm_eps);
        let (y, route) = moe::forward_token(
            ctx,
            &w.moe,
            &xn,
            forced_routes.and_then(|r| r.get(t)).map(Vec::as_slice),
            // Image-span rows select with `bias_vl` (spec §3.6).
            ctx.image_routing.and_then(|routing| routing.bias_for(t)),
        );
        let expanded = ctx
            .backend
            .hc_expand(&y, &streams[t * width..(t + 1) * width], &ffn_mix[t]);
        streams[t * width..(t + 1) * width].copy_from_slice(&expanded);
        pre[t * hc..(t + 1) * hc].copy_from_slice(&ffn_mix[t].pre);
        routes.push(route);
    }
    routes
}
