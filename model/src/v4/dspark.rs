//! The V4-Flash-0731 DSpark drafter (spec v4-architecture.md §4.2, namespace `mtp.0..2`): context
//! injection (the target-layer taps → `main_proj` → `main_norm` → each stage's K=V ring) at every
//! forward, and the greedy block proposal through V4 decoder blocks (sliding, main RoPE,
//! non-causal inside the block) collapsed by the last stage's learned hyper-head. The Markov and
//! confidence heads and the proposal loop are V4.1's ([`decode_blocks`]). Transformers drops
//! `mtp.*`, so there is no reference fixture for it.

use super::attention;
use super::block;
use super::weights::{AttentionWeights, HyperHeadWeights, LayerWeights, Loader};
use crate::backend::weights::Linear;
use crate::backend::{PositionRing, QueryKeys, RopeTable, Tensor};
use crate::config::{DsparkConfig, V4Attention, V4Mlp};
use crate::error::ModelError;
use crate::layers;
use crate::layers::attention::Queries;
use crate::layers::ctx::Ctx;
use crate::layers::markov::{DraftProposal, decode_blocks};
use crate::layers::step::{EmbeddedRow, embedded_streams};

/// The drafter's tensors: `mtp.0 … mtp.{n−1}` (sliding attention, top-k MoE with bias) and the
/// last stage's learned collapse of the block streams.
pub type DsparkWeights = layers::markov::DsparkWeights<LayerWeights, Linear, HyperHeadWeights>;

impl DsparkWeights {
    /// Reads `mtp.0 … mtp.{n−1}` for `dspark`; a missing tensor is an error naming it.
    pub(crate) fn load(
        loader: &Loader,
        dspark: &DsparkConfig,
    ) -> Result<DsparkWeights, ModelError> {
        let cfg = loader.cfg;
        let (dim, vocab, rank) = (cfg.dim, cfg.vocab_size, dspark.markov_rank);
        let experts = (dspark.n_routed_experts, dspark.n_activated_experts);
        let stages = (0..dspark.n_stages)
            .map(|s| {
                let prefix = format!("mtp.{s}.");
                loader.block(&prefix, V4Attention::Sliding, V4Mlp::TopkMoe, experts)
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let last = format!("mtp.{}.", dspark.n_stages.saturating_sub(1));
        let targets = dspark.target_layers.len();
        Ok(DsparkWeights {
            stages,
            main_proj: loader.linear("mtp.0.main_proj", dim, targets * dim)?,
            main_norm: loader.vector("mtp.0.main_norm.weight", &[dim])?,
            norm: loader.vector(&format!("{last}norm.weight"), &[dim])?,
            hyper_head: loader.hyper_head(&last)?,
            markov_embed: loader.vector(
                &format!("{last}markov_head.markov_w1.weight"),
                &[vocab, rank],
            )?,
            markov_head: loader.vector(
                &format!("{last}markov_head.markov_w2.weight"),
                &[vocab, rank],
            )?,
            confidence: loader.vector(
                &format!("{last}confidence_head.proj.weight"),
                &[1, dim + rank],
            )?,
        })
    }
}

/// Context injection: `m_p = RMSNorm(main_proj · c_p; main_norm)` of the taps
/// `main_hidden [n, targets · dim]`, then each stage's K=V row of `m_p` at `positions` into its
/// ring.
pub(crate) fn feed_context(
    ctx: &Ctx,
    w: &DsparkWeights,
    main_hidden: &Tensor,
    positions: &[usize],
    rings: &mut [PositionRing],
) {
    let cfg = ctx.cfg;
    let main_x = ctx.backend.rms_norm(
        &w.main_proj.apply(ctx.backend, main_hidden),
        ctx.norm(&w.main_norm, cfg.precision()),
    );
    for (stage, ring) in w.stages.iter().zip(rings.iter_mut()) {
        let rows = layers::attention::kv_rows(ctx, &stage.attn, &main_x, positions, &ctx.rope.main);
        for (row, &position) in rows.split_rows(cfg.head_dim).into_iter().zip(positions) {
            ring.push_at(position, row);
        }
    }
}

/// One stage's attention for the block at `positions` (`last + 1 …`): keys are the stage's
/// context rows of the last `window` positions up to `last`, then every block row (non-causal).
fn stage_attention(
    ctx: &Ctx,
    w: &AttentionWeights,
    xn: &Tensor,
    positions: &[usize],
    ring: &PositionRing,
    last: usize,
    unit: &[f32],
) -> Tensor {
    let cfg = ctx.cfg;
    let table: &RopeTable = &ctx.rope.main;
    let Queries { q, .. } = layers::attention::queries(ctx, w, xn, positions, table, Some(unit));
    let block_kv =
        layers::attention::kv_rows(ctx, w, xn, positions, table).split_rows(cfg.head_dim);
    let first = (last + 1).saturating_sub(cfg.window_size);
    let queries: Vec<QueryKeys<'_>> = positions
        .iter()
        .map(|_| QueryKeys {
            window: Some(ring.window(first, last)),
            listed: block_kv.iter().collect(),
            compressed: None,
        })
        .collect();
    let o = attention::attend(ctx, w, &q, &queries);
    layers::attention::output(ctx, w, o, positions, table)
}

/// What a proposal reads besides the drafter's weights.
pub(crate) struct ProposalInputs<'a> {
    /// `[vocab, dim]`.
    pub embed: &'a [f32],
    pub head: &'a Linear,
    /// One context ring per stage.
    pub rings: &'a [PositionRing],
    /// The last position with a target hidden state.
    pub last: usize,
    /// `[head_dim]` ones (the unweighted per-head query norm).
    pub unit: &'a [f32],
}

/// The greedy proposal for `anchor` at position `last + 1`: the block `[anchor, noise…]` through
/// every stage, the last stage's hyper-head, `norm` and the shared head, then the shared Markov /
/// confidence decoding.
pub(crate) fn propose(
    ctx: &Ctx,
    w: &DsparkWeights,
    dspark: &DsparkConfig,
    inputs: &ProposalInputs,
    anchor: u32,
) -> DraftProposal {
    let cfg = ctx.cfg;
    let (hc, dim) = (cfg.hc.mult, cfg.dim);
    let size = dspark.block_size;
    let last = inputs.last;
    let positions: Vec<usize> = (last + 1..=last + size).collect();
    let ids: Vec<u32> = std::iter::once(anchor)
        .chain(std::iter::repeat_n(dspark.noise_token_id, size - 1))
        .collect();
    let embedded = ids.iter().map(|&id| EmbeddedRow::Token(id));
    let mut streams = embedded_streams(ctx.backend, inputs.embed, embedded, dim, hc);
    for (stage, ring) in w.stages.iter().zip(inputs.rings) {
        block::forward(ctx, stage, &mut streams, &ids, |xn| {
            stage_attention(ctx, &stage.attn, xn, &positions, ring, last, inputs.unit)
        });
    }

    let heads = w.heads(dspark.markov_rank);
    // Every slot's hidden and base logits at once, where the backend computed them.
    let hidden = block::hyper_head(ctx, &w.hyper_head, &streams);
    let normed = ctx
        .backend
        .rms_norm(&hidden, ctx.norm(&w.norm, cfg.precision()));
    let base = inputs.head.apply(ctx.backend, &normed);
    decode_blocks(ctx, &heads, &[anchor], size, &hidden, &base)
        .pop()
        .unwrap_or_else(|| DraftProposal {
            tokens: vec![anchor],
            logits: Tensor::empty(),
            confidence: Vec::new(),
        })
}
