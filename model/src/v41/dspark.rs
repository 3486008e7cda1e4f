//! The DSpark drafter (spec §3.10): context rings fed from the backbone taps at every forward, and
//! greedy block proposals (anchor + `block_size − 1` noise slots, bidirectional inside the block)
//! through the stages, the shared head plus the rank-r Markov bias, and the confidence head.
//! Proposals for many sequences run as rows of one pass ([`propose_many`]): the projections,
//! mHC, MoE and heads run once over every request's block; only the stage attention's key lists
//! (a sequence's own context ring) and the argmax chains are per request. No op mixes rows, so
//! each proposal is bitwise the one its sequence gets alone.

use super::attention::window_entries;
use super::block;
use super::state::SequenceState;
use super::weights::{AttentionWeights, DsparkWeights};
use crate::backend::{AttentionQueries, DenseWeight, Precision, QueryKeys, Tensor};
use crate::config::DsparkConfig;
use crate::layers::attention::{Queries, output, queries};
use crate::layers::ctx::Ctx;
use crate::layers::markov::{DraftProposal, decode_blocks};
use crate::layers::mhc;
use crate::layers::step::{EmbeddedRow, embedded_streams};

/// One proposal to draft: the sequence (its last processed token is the context's end) and the
/// anchor, the token just sampled for it.
#[derive(Clone, Copy)]
pub(crate) struct DraftRequest<'a> {
    pub seq: &'a SequenceState,
    pub anchor: u32,
}

/// Projects the taps `main_hidden [n, targets · dim]` to `main_x` and returns each stage's context
/// K=V entries (`[n, head_dim]`) for `positions`, to be appended to the stage's ring of the row's
/// sequence.
pub fn context_entries(
    ctx: &Ctx,
    w: &DsparkWeights,
    main_hidden: &Tensor,
    positions: &[usize],
) -> Vec<Tensor> {
    let main_x = ctx.backend.rms_norm(
        &ctx.backend.gemm_fp8(main_hidden, &w.main_proj),
        ctx.norm(&w.main_norm, Precision::Bf16),
    );
    w.stages
        .iter()
        .map(|stage| window_entries(ctx, &stage.attn, &main_x, positions, &ctx.rope.main))
        .collect()
}

/// Attention of stage `stage` over the draft rows of every request (`xn [requests · size, dim]`,
/// request `r` owning rows `r·size …`, at `positions`): queries, block K=V entries and the output
/// projection over all rows at once; each row's keys are its request's context ring + every draft
/// slot of its own block.
fn stage_attention(
    ctx: &Ctx,
    w: &AttentionWeights,
    stage: usize,
    xn: &Tensor,
    positions: &[usize],
    requests: &[DraftRequest],
    size: usize,
) -> Tensor {
    let cfg = ctx.cfg;
    let table = &ctx.rope.main;
    let Queries { q, .. } = queries(ctx, w, xn, positions, table, None);
    let block_kv = window_entries(ctx, w, xn, positions, table);
    let block_rows = block_kv.split_rows(cfg.head_dim);
    // A row's keys: its request's context ring at positions `last−w+1 … last`, listed by ring
    // slot as the reference does, then every draft slot of its own block.
    let mut keys: Vec<QueryKeys<'_>> = Vec::with_capacity(requests.len() * size);
    for (request, block) in requests.iter().zip(block_rows.chunks_exact(size)) {
        let last = request.seq.len - 1;
        let first = (last + 1).saturating_sub(cfg.window_size);
        let row_keys = QueryKeys {
            window: Some(request.seq.dspark[stage].slot_window(first, last, cfg.window_size)),
            listed: block.iter().collect(),
            compressed: None,
        };
        keys.extend(std::iter::repeat_n(row_keys, size));
    }
    let queries = AttentionQueries {
        q: &q,
        sink: &w.sink,
        scale: (cfg.head_dim as f32).powf(-0.5),
        precision: Precision::Bf16,
    };
    let o = ctx.backend.sparse_attention_rows(queries, &keys);
    output(ctx, w, o, positions, table)
}

/// The greedy proposals after the last processed token of every request's sequence, in request
/// order. The caller has checked each request (a processed token, an anchor inside the
/// vocabulary, one context ring per stage).
pub(crate) fn propose_many(
    ctx: &Ctx,
    w: &DsparkWeights,
    cfg: &DsparkConfig,
    embed: &[f32],
    head: &[f32],
    requests: &[DraftRequest],
) -> Vec<DraftProposal> {
    if requests.is_empty() {
        return Vec::new();
    }
    let model = ctx.cfg;
    let (hc, dim, vocab) = (model.hc.mult, model.dim, model.vocab_size);
    let size = cfg.block_size;
    let rows = requests.len() * size;
    let positions: Vec<usize> = requests
        .iter()
        .flat_map(|request| request.seq.len..request.seq.len + size)
        .collect();
    let embedded = requests.iter().flat_map(|request| {
        std::iter::once(request.anchor)
            .chain(std::iter::repeat_n(cfg.noise_token_id, size - 1))
            .map(EmbeddedRow::Token)
    });
    let mut streams = embedded_streams(ctx.backend, embed, embedded, dim, hc);
    let mut pre: Tensor = (0..rows * hc)
        .map(|i| if i % hc == 0 { 1.0 } else { 0.0 })
        .collect::<Vec<f32>>()
        .into();
    for (s, stage) in w.stages.iter().enumerate() {
        block::forward(ctx, stage, &mut streams, &mut pre, None, false, |xn| {
            stage_attention(ctx, &stage.attn, s, xn, &positions, requests, size)
        });
    }

    let hidden = mhc::collapse(ctx, &streams, &pre);
    let normed = ctx
        .backend
        .rms_norm(&hidden, ctx.norm(&w.norm, Precision::Bf16));
    let base = ctx.backend.linear_f32(
        &normed,
        DenseWeight {
            values: head,
            out: vocab,
            inp: dim,
        },
    );
    let heads = w.heads(cfg.markov_rank);
    let anchors: Vec<u32> = requests.iter().map(|request| request.anchor).collect();
    decode_blocks(ctx, &heads, &anchors, size, &hidden, &base)
}
