//! The DSpark drafter (spec §3.10): context rings fed from the backbone taps at every forward, and
//! a greedy block proposal (anchor + `block_size − 1` noise slots, bidirectional inside the block)
//! through the stages, the shared head plus the rank-r Markov bias, and the confidence head.

use super::attention::{attend, output_projection, queries, window_entries};
use super::state::{PositionRing, SequenceState};
use super::weights::{AttentionWeights, DsparkWeights};
use super::{Ctx, block};
use crate::config::DsparkConfig;

/// One DSpark proposal.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftProposal {
    /// The anchor followed by the drafted tokens (`block_size + 1` ids).
    pub tokens: Vec<u32>,
    /// Draft logits `[block_size, vocab]` (Markov bias included).
    pub logits: Vec<f32>,
    /// Raw confidence per draft slot (no sigmoid).
    pub confidence: Vec<f32>,
}

/// Projects the taps `main_hidden [n, targets · dim]` to `main_x` and returns each stage's context
/// K=V entries (`[n, head_dim]`) for `positions`, to be appended to the stage's ring of the row's
/// sequence.
pub fn context_entries(
    ctx: &Ctx,
    w: &DsparkWeights,
    main_hidden: &[f32],
    positions: &[usize],
) -> Vec<Vec<f32>> {
    let main_x = ctx.backend.rms_norm(
        &ctx.backend.gemm_fp8(main_hidden, &w.main_proj),
        &w.main_norm,
        ctx.cfg.norm_eps,
    );
    w.stages
        .iter()
        .map(|stage| window_entries(ctx, &stage.attn, &main_x, positions, &ctx.rope.main))
        .collect()
}

/// Attention of one stage for the draft block at `positions` (`p+1 …`), keys = the stage's context
/// ring (positions `p−w+1 … p`, listed by ring slot as the reference does) + every draft slot.
fn stage_attention(
    ctx: &Ctx,
    w: &AttentionWeights,
    xn: &[f32],
    positions: &[usize],
    ring: &PositionRing,
    last: usize,
) -> Vec<f32> {
    let cfg = ctx.cfg;
    let table = &ctx.rope.main;
    let q = queries(ctx, w, xn, positions, table).q;
    let block_kv = window_entries(ctx, w, xn, positions, table);
    let window = cfg.window_size;
    let held = window.min(last + 1);
    let first = last + 1 - held;
    let mut keys: Vec<&[f32]> = (0..held)
        .filter_map(|slot| {
            let offset = (slot + window - first % window) % window;
            ring.get(first + offset)
        })
        .collect();
    keys.extend(block_kv.chunks_exact(cfg.head_dim));
    let row = cfg.n_heads * cfg.head_dim;
    let o: Vec<f32> = q
        .chunks_exact(row)
        .flat_map(|q_row| attend(ctx, w, q_row, &keys))
        .collect();
    output_projection(ctx, w, o, positions, table)
}

/// The greedy proposal after the last processed token of `seq`.
pub fn propose(
    ctx: &Ctx,
    w: &DsparkWeights,
    cfg: &DsparkConfig,
    embed: &[f32],
    head: &[f32],
    seq: &SequenceState,
    anchor: u32,
) -> DraftProposal {
    let model = ctx.cfg;
    let (hc, dim, vocab) = (model.hc.mult, model.dim, model.vocab_size);
    let last = seq.len - 1;
    let size = cfg.block_size;
    let positions: Vec<usize> = (last + 1..=last + size).collect();
    let ids: Vec<u32> = std::iter::once(anchor)
        .chain(std::iter::repeat_n(cfg.noise_token_id, size - 1))
        .collect();
    let mut streams = Vec::with_capacity(size * hc * dim);
    for &id in &ids {
        for _ in 0..hc {
            streams.extend_from_slice(&embed[id as usize * dim..(id as usize + 1) * dim]);
        }
    }
    let mut pre: Vec<f32> = (0..size * hc)
        .map(|i| if i % hc == 0 { 1.0 } else { 0.0 })
        .collect();
    for (stage, ring) in w.stages.iter().zip(&seq.dspark) {
        block::forward(ctx, stage, &mut streams, &mut pre, None, |xn| {
            stage_attention(ctx, &stage.attn, xn, &positions, ring, last)
        });
    }

    let heads = MarkovHeads {
        markov_embed: &w.markov_embed,
        markov_head: &w.markov_head,
        confidence: &w.confidence,
        rank: cfg.markov_rank,
    };
    decode_block(ctx, &heads, anchor, size, |i| {
        let width = hc * dim;
        let x = ctx.backend.hc_collapse(
            &streams[i * width..(i + 1) * width],
            &pre[i * hc..(i + 1) * hc],
        );
        let normed = ctx.backend.rms_norm(&x, &w.norm, model.norm_eps);
        let row = ctx.backend.linear_f32(&normed, head, vocab, dim);
        (x, row)
    })
}

/// The Markov and confidence heads of a drafter's last stage (shared by V4.1 and V4-Flash-0731):
/// `markov_embed`/`markov_head` `[vocab, rank]`, `confidence` `[dim + rank]`.
pub(crate) struct MarkovHeads<'a> {
    pub markov_embed: &'a [f32],
    pub markov_head: &'a [f32],
    pub confidence: &'a [f32],
    pub rank: usize,
}

/// Greedy sequential decoding of one draft block of `size` slots: `slot(k)` gives slot k's
/// pre-norm hidden `h_k [dim]` and its base logits `U_k [vocab]`; then `μ_k = markov_embed[x_k]`
/// (`x_0` = the anchor), `logits_k = U_k + markov_head · μ_k`, `x_{k+1} = argmax logits_k`, and the
/// raw confidence `w_conf · (h_k ‖ μ_k)`.
pub(crate) fn decode_block(
    ctx: &Ctx,
    heads: &MarkovHeads,
    anchor: u32,
    size: usize,
    mut slot: impl FnMut(usize) -> (Vec<f32>, Vec<f32>),
) -> DraftProposal {
    let (vocab, rank) = (ctx.cfg.vocab_size, heads.rank);
    let mut tokens = vec![anchor];
    let mut logits = Vec::with_capacity(size * vocab);
    let mut confidence = Vec::with_capacity(size);
    for i in 0..size {
        let (hidden, mut row) = slot(i);
        let previous = tokens[i] as usize;
        let markov = &heads.markov_embed[previous * rank..(previous + 1) * rank];
        for (l, bias) in
            row.iter_mut().zip(
                ctx.backend
                    .linear_f32(markov, heads.markov_head, vocab, rank),
            )
        {
            *l += bias;
        }
        tokens.push(argmax(&row));
        let features: Vec<f32> = hidden.iter().chain(markov).copied().collect();
        confidence.push(
            ctx.backend
                .linear_f32(&features, heads.confidence, 1, features.len())[0],
        );
        logits.extend(row);
    }
    DraftProposal {
        tokens,
        logits,
        confidence,
    }
}

/// Index of the first maximum.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
