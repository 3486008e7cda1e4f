//! The V4-Flash MTP block (spec v4-architecture.md §4.1, namespace `mtp.0.*`): from the backbone's
//! last-layer streams at position `i` (before the hyper-head) and the embedding of token `i+1`, a
//! sliding-window decoder block at position `i` whose hyper-head, `norm` and the shared head give
//! the logits of token `i+2`. The block keeps its own window of K=V rows ([`MtpState`]), one per
//! position it processed; transformers drops `mtp.*`, so there is no reference fixture for it.
//!
//! [`MtpState`]: super::state::MtpState

use super::attention;
use super::block;
use super::state::LayerState;
use super::weights::{HyperHeadWeights, LayerWeights, Loader};
use crate::backend::Tensor;
use crate::backend::weights::Linear;
use crate::config::{V4Attention, V4Mlp};
use crate::error::ModelError;
use crate::layers::ctx::Ctx;

/// The tensors of the MTP block `mtp.0`.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    /// Sliding attention, top-k MoE with bias.
    pub block: LayerWeights,
    /// `[dim, dim]`, applied to the normed embedding.
    pub e_proj: Linear,
    /// `[dim, dim]`, applied to every normed backbone stream.
    pub h_proj: Linear,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// The final norm before the shared head.
    pub norm: Vec<f32>,
    pub hyper_head: HyperHeadWeights,
}

impl MtpWeights {
    /// Reads `mtp.0.*`; a missing tensor is an error naming it.
    pub(crate) fn load(loader: &Loader) -> Result<MtpWeights, ModelError> {
        let cfg = loader.cfg;
        let dim = cfg.dim;
        let p = "mtp.0.";
        let experts = (cfg.n_routed_experts, cfg.n_activated_experts);
        Ok(MtpWeights {
            block: loader.block(p, V4Attention::Sliding, V4Mlp::TopkMoe, experts)?,
            e_proj: loader.linear(&format!("{p}e_proj"), dim, dim)?,
            h_proj: loader.linear(&format!("{p}h_proj"), dim, dim)?,
            enorm: loader.vector(&format!("{p}enorm.weight"), &[dim])?,
            hnorm: loader.vector(&format!("{p}hnorm.weight"), &[dim])?,
            norm: loader.vector(&format!("{p}norm.weight"), &[dim])?,
            hyper_head: loader.hyper_head(p)?,
        })
    }
}

/// MTP entries: entry `t` pairs the backbone streams `hidden[t] [hc, dim]` of position
/// `positions[t]` with the token that follows it, `next[t]`.
pub(crate) struct Entries<'a> {
    pub hidden: &'a Tensor,
    pub next: &'a [u32],
    pub positions: &'a [usize],
}

/// Runs the block over `entries` (`embed [vocab, dim]` is the shared embedding, `unit` the
/// `[head_dim]` ones of the per-head query norm). Appends the entries' K=V rows to `state` and
/// returns the block's output streams `[n, hc, dim]`.
pub(crate) fn run(
    ctx: &Ctx,
    w: &MtpWeights,
    embed: &[f32],
    entries: &Entries,
    state: &mut LayerState,
    unit: &[f32],
) -> Tensor {
    let Entries {
        hidden,
        next,
        positions,
    } = *entries;
    let cfg = ctx.cfg;
    let (backend, precision) = (ctx.backend, cfg.precision());
    let (hc, dim) = (cfg.hc.mult, cfg.dim);
    let embedded: Vec<f32> = next
        .iter()
        .flat_map(|&t| {
            embed[t as usize * dim..(t as usize + 1) * dim]
                .iter()
                .copied()
        })
        .collect();
    let e = w.e_proj.apply(
        backend,
        &backend.rms_norm(&embedded.into(), ctx.norm(&w.enorm, precision)),
    );
    let h = w.h_proj.apply(
        backend,
        &backend.rms_norm(hidden, ctx.norm(&w.hnorm, precision)),
    );
    // Every stream of entry t gets entry t's projected embedding added.
    let pieces: Vec<(&Tensor, usize)> = (0..h.len() / dim.max(1))
        .map(|row| (&e, (row / hc) * dim))
        .collect();
    let mut streams = backend.add(h, &backend.gather(&pieces, dim));
    let table = &ctx.rope.main;
    block::forward(ctx, &w.block, &mut streams, next, |xn| {
        attention::forward(ctx, &w.block.attn, table, xn, positions, state, unit)
    });
    streams
}

/// The logits `[vocab]` of one entry's output streams `x [hc, dim]`:
/// `head · RMSNorm(HyperHead_mtp(x); mtp.norm)`.
pub(crate) fn logits(ctx: &Ctx, w: &MtpWeights, head: &Linear, x: &Tensor) -> Vec<f32> {
    let cfg = ctx.cfg;
    let h = block::hyper_head(ctx, &w.hyper_head, x);
    let h = ctx.backend.rms_norm(&h, ctx.norm(&w.norm, cfg.precision()));
    head.apply(ctx.backend, &h).into_vec()
}
