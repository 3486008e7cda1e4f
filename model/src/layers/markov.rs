//! The end of every DSpark drafter (V4.1 and V4-Flash-0731): the last stage's Markov and
//! confidence heads decoding one greedy block per anchor into a [`DraftProposal`].

use crate::backend::{DenseWeight, Tensor};
use crate::layers::ctx::Ctx;

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

/// A DSpark drafter's tensors in either family (V4.1, V4-Flash-0731): `B` is a stage's block, `W`
/// the `main_proj` format and `H` the family's collapse of the last stage's streams before `norm`
/// (V4: the learned hyper-head; V4.1: none, `()`).
#[derive(Debug, Clone)]
pub struct DsparkWeights<B, W, H> {
    /// `mtp.0 … mtp.{n−1}`.
    pub stages: Vec<B>,
    /// `[dim, targets · dim]`.
    pub main_proj: W,
    pub main_norm: Vec<f32>,
    /// The last stage's norm before the shared head.
    pub norm: Vec<f32>,
    pub hyper_head: H,
    /// `[vocab, rank]`, an embedding table (V4's `markov_head.markov_w1`).
    pub markov_embed: Vec<f32>,
    /// `[vocab, rank]`, a vocabulary projection (V4's `markov_head.markov_w2`).
    pub markov_head: Vec<f32>,
    /// `confidence_head.proj` `[dim + rank]`.
    pub confidence: Vec<f32>,
}

impl<B, W, H> DsparkWeights<B, W, H> {
    /// The drafter's Markov and confidence heads, of rank `rank`.
    pub(crate) fn heads(&self, rank: usize) -> MarkovHeads<'_> {
        MarkovHeads {
            markov_embed: &self.markov_embed,
            markov_head: &self.markov_head,
            confidence: &self.confidence,
            rank,
        }
    }
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
    let bias = ctx.backend.linear_f32(
        &markov,
        DenseWeight {
            values: heads.markov_head,
            out: vocab,
            inp: rank,
        },
    );
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
    let confidence = ctx.backend.linear_f32(
        &features,
        DenseWeight {
            values: heads.confidence,
            out: 1,
            inp: dim + rank,
        },
    );
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
