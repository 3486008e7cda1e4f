//! CSA2, the shared compressed branch (spec §3.4): the KV-source compressor (ratio-2 gated pooling or
//! ratio-1 projection), the index keys it derives, the indexer of an index source, the two-level
//! candidate blocks of the candidate source and the lowest-index-on-ties top-k.

use super::Ctx;
use super::state::CompressorState;
use super::weights::{CompressorWeights, IndexerWeights};
use crate::quant::round_bf16;

/// Per-chunk products handed from sources to the layers that reuse them.
#[derive(Debug, Default)]
pub struct ChunkShared {
    /// Compressed positions selected per query by the latest index source (ascending).
    pub topk: Vec<Vec<usize>>,
    /// Candidate mask per query (over its visible compressed positions) from the candidate source.
    pub candidates: Vec<Vec<bool>>,
}

/// Indices of the `k` largest scores, ties broken toward the lower index, returned ascending.
pub fn top_k_lowest_index(scores: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_unstable();
    order
}

/// Runs the compressor of a KV-source layer over a chunk: stores each token's fp32 `kv ‖ gate`,
/// emits every group completed in this chunk (latent → index key, latent → RoPE + `Q4m` entry).
pub fn compress_chunk(
    ctx: &Ctx,
    weights: &CompressorWeights,
    state: &mut CompressorState,
    xn: &[f32],
    positions: &[usize],
    layer: usize,
) {
    let (dim, head_dim) = (ctx.cfg.dim, ctx.cfg.head_dim);
    let ratio = weights.ratio;
    let table = ctx.rope.for_layer(ctx.cfg, layer);
    for (t, &position) in positions.iter().enumerate() {
        let x = &xn[t * dim..(t + 1) * dim];
        let latent = if ratio == 1 {
            ctx.backend.rms_norm(
                &ctx.backend.linear_bf16(x, &weights.wkv, head_dim, dim),
                &weights.norm,
                ctx.cfg.norm_eps,
            )
        } else {
            let gate_weights = weights.wgate.as_deref().unwrap_or(&[]);
            let mut row = ctx.backend.linear_f32(x, &weights.wkv, head_dim, dim);
            row.extend(ctx.backend.linear_f32(x, gate_weights, head_dim, dim));
            state.pending.push(row);
            if (position + 1) % ratio != 0 {
                continue;
            }
            let first = position + 1 - ratio;
            let members: Vec<&[f32]> = (first..=position)
                .filter_map(|p| state.pending.get(p))
                .collect();
            let pooled: Vec<f32> = (0..head_dim)
                .map(|c| {
                    let max = members
                        .iter()
                        .fold(f32::NEG_INFINITY, |m, r| m.max(r[head_dim + c]));
                    let exps: Vec<f32> = members
                        .iter()
                        .map(|r| (r[head_dim + c] - max).exp())
                        .collect();
                    let sum = exps.iter().fold(0.0f32, |a, e| a + e);
                    let value = members
                        .iter()
                        .zip(&exps)
                        .fold(0.0f32, |a, (r, e)| a + r[c] * (e / sum));
                    round_bf16(value)
                })
                .collect();
            ctx.backend
                .rms_norm(&pooled, &weights.norm, ctx.cfg.norm_eps)
        };
        let group = position / ratio;
        let group_position = [group * ratio];
        let index_dim = ctx.cfg.index_head_dim;
        let key = ctx
            .backend
            .linear_bf16(&latent, &weights.index_wk, index_dim, head_dim);
        let mut key = ctx
            .backend
            .rms_norm(&key, &weights.index_k_norm, ctx.cfg.norm_eps);
        ctx.backend
            .rope(&mut key, index_dim, 1, &group_position, table, false);
        ctx.backend.q4e_qdq(&mut key);
        let mut entry = latent;
        ctx.backend
            .rope(&mut entry, head_dim, 1, &group_position, table, false);
        ctx.backend.q4m_qdq(&mut entry);
        debug_assert_eq!(state.compressed.len(), group);
        state.index_keys.push(key);
        state.compressed.push(entry);
    }
}

/// The indexer of an index source: per query, the selected compressed positions (ascending).
/// A candidate source also publishes its candidate mask; a later index source is restricted by it.
pub fn select_chunk(
    ctx: &Ctx,
    weights: &IndexerWeights,
    index_keys: &[Vec<f32>],
    qr: &[f32],
    xn: &[f32],
    positions: &[usize],
    layer: usize,
    shared: &mut ChunkShared,
) -> Vec<Vec<usize>> {
    let cfg = ctx.cfg;
    let (heads, head_dim) = (cfg.index_n_heads, cfg.index_head_dim);
    let ratio = cfg.compress_ratio(layer);
    let table = ctx.rope.for_layer(cfg, layer);
    let mut q = ctx.backend.gemm_fp8(qr, &weights.wq_b);
    ctx.backend
        .rope(&mut q, head_dim, heads, positions, table, false);
    let row = heads * head_dim;
    for q_row in q.chunks_exact_mut(row) {
        ctx.backend.q4e_qdq(q_row);
    }
    let weight_scale = (head_dim as f32).powf(-0.5) * (heads as f32).powf(-0.5);
    let head_weights: Vec<f32> = ctx
        .backend
        .linear_bf16(xn, &weights.weights_proj, heads, cfg.dim)
        .iter()
        .map(|w| round_bf16(w * weight_scale))
        .collect();
    let flat_keys: Vec<f32> = index_keys.iter().flatten().copied().collect();
    let is_candidate_source = cfg
        .candidate
        .as_ref()
        .is_some_and(|c| c.source_layer == layer);
    let uses_candidates = cfg.uses_candidates(layer);
    let mut selections = Vec::with_capacity(positions.len());
    let mut candidates = Vec::new();
    for (t, &position) in positions.iter().enumerate() {
        let visible = (position + 1) / ratio;
        let mut scores = ctx.backend.index_scores(
            &q[t * row..(t + 1) * row],
            &head_weights[t * heads..(t + 1) * heads],
            &flat_keys[..visible * head_dim],
            head_dim,
        );
        if is_candidate_source {
            candidates.push(candidate_mask(ctx, &scores));
        } else if uses_candidates && let Some(mask) = shared.candidates.get(t) {
            for (score, keep) in scores.iter_mut().zip(mask) {
                if !keep {
                    *score = f32::NEG_INFINITY;
                }
            }
        }
        selections.push(top_k_lowest_index(&scores, cfg.index_topk.min(visible)));
    }
    if is_candidate_source {
        shared.candidates = candidates;
    }
    selections
}

/// Level one of the two-level top-k: blocks of `block_size` positions scored by their best
/// position, the newest (partial) block pinned, the best `topk_blocks` kept.
fn candidate_mask(ctx: &Ctx, scores: &[f32]) -> Vec<bool> {
    let Some(candidate) = &ctx.cfg.candidate else {
        return vec![true; scores.len()];
    };
    let block_size = candidate.block_size;
    if scores.is_empty() {
        return Vec::new();
    }
    let mut block_scores: Vec<f32> = scores
        .chunks(block_size)
        .map(|b| b.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s)))
        .collect();
    let newest = (scores.len() - 1) / block_size;
    block_scores[newest] = f32::INFINITY;
    let kept = top_k_lowest_index(&block_scores, candidate.topk_blocks.min(block_scores.len()));
    let mut mask = vec![false; scores.len()];
    for block in kept {
        if block_scores[block] > f32::NEG_INFINITY {
            let end = ((block + 1) * block_size).min(scores.len());
            mask[block * block_size..end]
                .iter_mut()
                .for_each(|m| *m = true);
        }
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_prefers_the_lower_index_on_ties_and_returns_ascending() {
        let scores = [1.0, 3.0, 2.0, 3.0, 2.0, f32::NEG_INFINITY];
        assert_eq!(top_k_lowest_index(&scores, 3), vec![1, 2, 3]);
        assert_eq!(top_k_lowest_index(&scores, 2), vec![1, 3]);
        assert_eq!(top_k_lowest_index(&[2.0, 2.0, 2.0], 1), vec![0]);
        assert_eq!(top_k_lowest_index(&scores, 0), Vec::<usize>::new());
    }
}
