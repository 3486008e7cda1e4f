//! One V4 decoder layer with two-site mHC (spec v4-architecture.md §2.4) over a step's rows: each
//! site computes its own pre/post/comb from the streams entering it (Sinkhorn in the backend's
//! `hc_mixes_rows`), collapses them for its sublayer and expands the output back; and the learned
//! final hyper-head collapse. Every op runs once over all rows (each row one token of some
//! sequence) and no op mixes rows.

use super::weights::{HyperHeadWeights, LayerWeights};
use crate::backend::{HyperHead, MoeLayer, Tensor};
use crate::layers::ctx::Ctx;
use crate::layers::{mhc, moe};

/// Runs one layer over the rows: `streams` is `[n, hc, dim]`, `tokens` the rows' ids (hash
/// routing); `attention` maps the normed attention inputs `[n, dim]` to its outputs `[n, dim]`;
/// the routed experts run at `ctx.routed` when set (expert parallelism: the hash layers' picks
/// are handed over like the router's, so where they run cannot change a bit).
pub fn forward(
    ctx: &Ctx,
    w: &LayerWeights,
    streams: &mut Tensor,
    tokens: &[u32],
    attention: impl FnOnce(&Tensor) -> Tensor,
) {
    let cfg = ctx.cfg;
    let precision = cfg.precision();
    let backend = ctx.backend;

    let attn_mix = mhc::mixes(ctx, streams, &w.hc_attn);
    let x = mhc::collapse(ctx, streams, &attn_mix.pre(backend));
    let y = attention(&backend.rms_norm(&x, ctx.norm(&w.attn_norm, precision)));
    *streams = mhc::expand(ctx, &y, streams, &attn_mix);

    let ffn_mix = mhc::mixes(ctx, streams, &w.hc_ffn);
    let x = mhc::collapse(ctx, streams, &ffn_mix.pre(backend));
    let xn = backend.rms_norm(&x, ctx.norm(&w.ffn_norm, precision));
    // Hash layers: every row's experts come from its token id (`tid2eid`).
    let k = w.moe.n_activated;
    let hashed: Option<Vec<Vec<usize>>> = w.moe.tid2eid.as_ref().map(|table| {
        tokens
            .iter()
            .map(|&token| table[token as usize * k..(token as usize + 1) * k].to_vec())
            .collect()
    });
    let layer = MoeLayer {
        gate: &w.moe.gate,
        bias: &w.moe.bias,
        n_activated: w.moe.n_activated,
        route_scale: cfg.route_scale,
        experts: &w.moe.experts,
        shared: &w.moe.shared,
        swiglu_limit: cfg.swiglu_limit,
        precision,
    };
    // With an expert site (expert parallelism) the routed experts run there, never fused here.
    let fused = match ctx.routed {
        None => backend.moe_rows_exact(&xn, &layer, hashed.as_deref()),
        Some(_) => None,
    };
    let f = match fused {
        Some(f) => f,
        None => moe::forward_rows(ctx, &w.moe, &xn, hashed.as_deref(), false).0,
    };
    *streams = mhc::expand(ctx, &f, streams, &ffn_mix);
}

/// The final collapse of every row's streams `x [n, hc, dim]` → `[n, dim]`: weights
/// [`crate::backend::cpu::hyper_head_weights`] on the backend, then `Σ_k pre_k · x_k`.
pub fn hyper_head(ctx: &Ctx, w: &HyperHeadWeights, x: &Tensor) -> Tensor {
    let cfg = ctx.cfg;
    let head = HyperHead {
        proj: &w.proj,
        base: &w.base,
        scale: w.scale.first().copied().unwrap_or(1.0),
        hc_eps: cfg.hc.eps,
        norm_eps: cfg.norm_eps,
    };
    let pre = ctx.backend.hyper_head_weights_rows(x, &head);
    mhc::collapse(ctx, x, &pre)
}
