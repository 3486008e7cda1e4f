//! One V4 decoder layer with two-site mHC (spec v4-architecture.md §2.4): each site computes its
//! own pre/post/comb from the streams entering it (Sinkhorn in the backend's `hc_mixes`), collapses
//! them for its sublayer and expands the output back; and the learned final hyper-head collapse.

use super::weights::{HyperHeadWeights, LayerWeights};
use crate::backend::HcMix;
use crate::quant::{dot_f32_sgemm, exp_f32, sum_squares_f32};
use crate::v41::Ctx;
use crate::v41::moe;

/// Runs one layer over a chunk: `streams` is `[n, hc, dim]`, `tokens` the chunk's ids (hash
/// routing); `attention` maps the normed attention inputs `[n, dim]` to its outputs `[n, dim]`.
pub fn forward(
    ctx: &Ctx,
    w: &LayerWeights,
    streams: &mut [f32],
    tokens: &[u32],
    attention: impl FnOnce(&[f32]) -> Vec<f32>,
) {
    let cfg = ctx.cfg;
    let precision = cfg.precision();
    let (hc, dim) = (cfg.hc.mult, cfg.dim);
    let width = hc * dim;
    let backend = ctx.backend;
    let mixes = |streams: &[f32], params| -> Vec<HcMix> {
        streams
            .chunks_exact(width)
            .map(|x| {
                backend.hc_mixes(
                    x,
                    params,
                    hc,
                    cfg.hc.sinkhorn_iters,
                    cfg.hc.eps,
                    cfg.norm_eps,
                )
            })
            .collect()
    };

    let attn_mix = mixes(streams, &w.hc_attn);
    let xn: Vec<f32> = streams
        .chunks_exact(width)
        .zip(&attn_mix)
        .flat_map(|(x, mix)| {
            let x = backend.hc_collapse_at(x, &mix.pre, precision);
            backend
                .rms_norm_at(&x.into(), &w.attn_norm, cfg.norm_eps, precision)
                .into_vec()
        })
        .collect();
    let y = attention(&xn);
    for (t, (x, mix)) in streams.chunks_exact_mut(width).zip(&attn_mix).enumerate() {
        let expanded = backend.hc_expand_at(&y[t * dim..(t + 1) * dim], x, mix, precision);
        x.copy_from_slice(&expanded);
    }

    let ffn_mix = mixes(streams, &w.hc_ffn);
    let k = w.moe.n_activated;
    for ((x, mix), &token) in streams.chunks_exact_mut(width).zip(&ffn_mix).zip(tokens) {
        let collapsed = backend.hc_collapse_at(x, &mix.pre, precision);
        let xn = backend
            .rms_norm_at(&collapsed.into(), &w.ffn_norm, cfg.norm_eps, precision)
            .into_vec();
        let hashed = w
            .tid2eid
            .as_ref()
            .map(|table| &table[token as usize * k..(token as usize + 1) * k]);
        let (f, _route) = moe::forward_token(ctx, &w.moe, &xn, hashed);
        let expanded = backend.hc_expand_at(&f, x, mix, precision);
        x.copy_from_slice(&expanded);
    }
}

/// The final collapse of one token's streams `x [hc, dim]`: `pre_k = σ(m_k · s + b_k) + ε` with
/// `m = hc_fn · RMSNorm_u(x)`, then `Σ_k pre_k · x_k`.
pub fn hyper_head(ctx: &Ctx, w: &HyperHeadWeights, x: &[f32]) -> Vec<f32> {
    let cfg = ctx.cfg;
    let inv = 1.0 / (sum_squares_f32(x) / x.len() as f32 + cfg.norm_eps).sqrt();
    let pre: Vec<f32> = w
        .proj
        .chunks_exact(x.len())
        .zip(&w.base)
        .map(|(row, base)| {
            let logit = dot_f32_sgemm(x, row) * inv * w.scale[0] + base;
            1.0 / (1.0 + exp_f32(-logit)) + cfg.hc.eps
        })
        .collect();
    ctx.backend.hc_collapse_at(x, &pre, cfg.precision())
}
