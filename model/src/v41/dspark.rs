//! The DSpark drafter (spec §3.10): context rings fed from the backbone taps at every forward, and
//! greedy block proposals (anchor + `block_size − 1` noise slots, bidirectional inside the block)
//! through the stages, the shared head plus the rank-r Markov bias, and the confidence head.
//! Proposals for many sequences run as rows of one pass ([`propose_many`]): the projections,
//! mHC, MoE and heads run once over every request's block; only the stage attention's key lists
//! (a sequence's own context ring) and the argmax chains are per request. No op mixes rows, so
//! each proposal is bitwise the one its sequence gets alone.

use super::attention::{Queries, output_projection, queries, window_entries};
use super::state::{PositionRing, SequenceState};
use super::weights::{AttentionWeights, DsparkWeights};
use super::{Ctx, block};
use crate::backend::{Precision, Tensor};
use crate::config::DsparkConfig;

/// One DSpark proposal.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftProposal {
    /// The anchor followed by the drafted tokens (`block_size + 1` ids).
    pub tokens: Vec<u32>,
    /// Draft logits `[block_size, vocab]` (Markov bias included), where the backend computed
    /// them (read on the host only when asked).
    pub logits: Tensor,
    /// Raw confidence per draft slot (no sigmoid).
    pub confidence: Vec<f32>,
}

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
        &w.main_norm,
        ctx.cfg.norm_eps,
        Precision::Bf16,
    );
    w.stages
        .iter()
        .map(|stage| window_entries(ctx, &stage.attn, &main_x, positions, &ctx.rope.main))
        .collect()
}

/// The context keys of a draft block after position `last`: the ring's entries at positions
/// `last−w+1 … last`, listed by ring slot as the reference does.
fn context_keys(ring: &PositionRing, last: usize, window: usize) -> Vec<&Tensor> {
    let held = window.min(last + 1);
    let first = last + 1 - held;
    (0..held)
        .filter_map(|slot| {
            let offset = (slot + window - first % window) % window;
            ring.get(first + offset)
        })
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
    let Queries { q, .. } = queries(ctx, w, xn, positions, table);
    let block_kv = window_entries(ctx, w, xn, positions, table);
    let block_rows = block_kv.split_rows(cfg.head_dim);
    let mut keys: Vec<Vec<&Tensor>> = Vec::with_capacity(requests.len() * size);
    for (request, block) in requests.iter().zip(block_rows.chunks_exact(size)) {
        let mut row_keys = context_keys(
            &request.seq.dspark[stage],
            request.seq.len - 1,
            cfg.window_size,
        );
        row_keys.extend(block);
        keys.extend(std::iter::repeat_n(row_keys, size));
    }
    let scale = (cfg.head_dim as f32).powf(-0.5);
    let o = ctx
        .backend
        .sparse_attention_rows_at(&q, &keys, &w.sink, scale, Precision::Bf16);
    output_projection(ctx, w, o, positions, table)
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
    let mut streams = Vec::with_capacity(rows * hc * dim);
    for request in requests {
        let ids = std::iter::once(request.anchor)
            .chain(std::iter::repeat_n(cfg.noise_token_id, size - 1));
        for id in ids {
            for _ in 0..hc {
                streams.extend_from_slice(&embed[id as usize * dim..(id as usize + 1) * dim]);
            }
        }
    }
    let mut streams = Tensor::from(streams);
    let mut pre: Tensor = (0..rows * hc)
        .map(|i| if i % hc == 0 { 1.0 } else { 0.0 })
        .collect::<Vec<f32>>()
        .into();
    for (s, stage) in w.stages.iter().enumerate() {
        block::forward(ctx, stage, &mut streams, &mut pre, None, false, |xn| {
            stage_attention(ctx, &stage.attn, s, xn, &positions, requests, size)
        });
    }

    let hidden = ctx
        .backend
        .hc_collapse_rows_at(&streams, &pre, hc, Precision::Bf16);
    let normed = ctx
        .backend
        .rms_norm(&hidden, &w.norm, model.norm_eps, Precision::Bf16);
    let base = ctx.backend.linear_f32(&normed, head, vocab, dim);
    let heads = MarkovHeads {
        markov_embed: &w.markov_embed,
        markov_head: &w.markov_head,
        confidence: &w.confidence,
        rank: cfg.markov_rank,
    };
    let anchors: Vec<u32> = requests.iter().map(|request| request.anchor).collect();
    decode_blocks(ctx, &heads, &anchors, size, &hidden, &base)
}

/// The Markov and confidence heads of a drafter's last stage (shared by V4.1 and V4-Flash-0731):
/// `markov_embed`/`markov_head` `[vocab, rank]`, `confidence` `[dim + rank]`.
pub(crate) struct MarkovHeads<'a> {
    pub markov_embed: &'a [f32],
    pub markov_head: &'a [f32],
    pub confidence: &'a [f32],
    pub rank: usize,
}

/// Greedy sequential decoding of one draft block per anchor ([`decode_slot`] per slot): block
/// `b`'s slot `k` is row `b·size + k` of
/// `hidden` (`[rows, dim]`) and of `base` (`[rows, vocab]`), where the backend computed them.
/// Slot `k` of every block runs as one Markov GEMM, one confidence GEMM and one argmax over all
/// blocks; each block's chain of tokens is its own.
pub(crate) fn decode_blocks(
    ctx: &Ctx,
    heads: &MarkovHeads,
    anchors: &[u32],
    size: usize,
    hidden: &Tensor,
    base: &Tensor,
) -> Vec<DraftProposal> {
    let vocab = ctx.cfg.vocab_size;
    let mut drafting = Drafting::new(anchors, size);
    let rows = anchors.len() * size;
    if let Some(dim) = hidden.len().checked_div(rows) {
        for k in 0..size {
            let pieces = |t, width| -> Vec<(&Tensor, usize)> {
                (0..anchors.len())
                    .map(|b| (t, (b * size + k) * width))
                    .collect()
            };
            let slot_hidden = ctx.backend.gather(&pieces(hidden, dim), dim);
            let slot_base = ctx.backend.gather(&pieces(base, vocab), vocab);
            decode_slot(ctx, heads, &mut drafting, &slot_hidden, slot_base);
        }
    }
    drafting.finish(ctx)
}

/// The blocks being drafted: each one's tokens so far (its anchor first) and confidences, and the
/// logits of every slot decoded (`[blocks, vocab]` each, where the backend computed them).
struct Drafting {
    tokens: Vec<Vec<u32>>,
    confidence: Vec<Vec<f32>>,
    slot_logits: Vec<Tensor>,
}

impl Drafting {
    fn new(anchors: &[u32], size: usize) -> Drafting {
        Drafting {
            tokens: anchors
                .iter()
                .map(|&anchor| {
                    let mut tokens = Vec::with_capacity(size + 1);
                    tokens.push(anchor);
                    tokens
                })
                .collect(),
            confidence: anchors.iter().map(|_| Vec::with_capacity(size)).collect(),
            slot_logits: Vec::with_capacity(size),
        }
    }

    /// One proposal per block; its logits gathered from the slots' (`[slots, vocab]`).
    fn finish(self, ctx: &Ctx) -> Vec<DraftProposal> {
        let vocab = ctx.cfg.vocab_size;
        let slot_logits = &self.slot_logits;
        self.tokens
            .into_iter()
            .zip(self.confidence)
            .enumerate()
            .map(|(b, (tokens, confidence))| {
                let pieces: Vec<(&Tensor, usize)> =
                    slot_logits.iter().map(|slot| (slot, b * vocab)).collect();
                DraftProposal {
                    tokens,
                    logits: ctx.backend.gather(&pieces, vocab),
                    confidence,
                }
            })
            .collect()
    }
}

/// The next slot `k` of every block, given each one's `h_k` (`hidden [n, dim]`) and base logits
/// `U_k` (`base [n, vocab]`): `μ_k = markov_embed[x_k]` (`x_k` the block's last token, the anchor
/// at `k = 0`), `logits_k = U_k + markov_head · μ_k`, `x_{k+1} = argmax logits_k` (first maximum),
/// and the raw confidence `w_conf · (h_k ‖ μ_k)`. The logits stay where the backend computed them;
/// the drafted ids and the confidences come to the host.
fn decode_slot(
    ctx: &Ctx,
    heads: &MarkovHeads,
    drafting: &mut Drafting,
    hidden: &Tensor,
    base: Tensor,
) {
    let (vocab, rank, n) = (ctx.cfg.vocab_size, heads.rank, drafting.tokens.len());
    if n == 0 {
        return;
    }
    let dim = hidden.len() / n;
    let markov: Tensor = drafting
        .tokens
        .iter()
        .flat_map(|tokens| {
            let previous = tokens.last().map_or(0, |&t| t as usize);
            heads.markov_embed[previous * rank..(previous + 1) * rank]
                .iter()
                .copied()
        })
        .collect::<Vec<f32>>()
        .into();
    let bias = ctx
        .backend
        .linear_f32(&markov, heads.markov_head, vocab, rank);
    let logits = ctx.backend.add(base, &bias);
    // `h_k ‖ μ_k` per block, gathered in pieces of a width dividing both.
    let piece = gcd(dim, rank).max(1);
    let markov_ref = &markov;
    let features_pieces: Vec<(&Tensor, usize)> = (0..n)
        .flat_map(|b| {
            let h = (0..dim / piece).map(move |i| (hidden, b * dim + i * piece));
            let m = (0..rank / piece).map(move |i| (markov_ref, b * rank + i * piece));
            h.chain(m)
        })
        .collect();
    let features = ctx.backend.gather(&features_pieces, piece);
    let confidence = ctx
        .backend
        .linear_f32(&features, heads.confidence, 1, dim + rank);
    let next = ctx.backend.argmax_rows(&logits, vocab);
    for ((tokens, confidences), (&token, &c)) in drafting
        .tokens
        .iter_mut()
        .zip(drafting.confidence.iter_mut())
        .zip(next.iter().zip(confidence.iter()))
    {
        tokens.push(token);
        confidences.push(c);
    }
    drafting.slot_logits.push(logits);
}

/// The greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}
