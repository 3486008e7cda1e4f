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

/// The compressor's per-token projections of rows `xn [n, dim]` (any sequences): the ratio-1
/// latents `kv_norm(wkv · x)` (`[n, head_dim]`, bf16), or the fp32 `kv ‖ gate` rows of gated
/// pooling (`[n, 2 · head_dim]`).
pub fn compressor_inputs(ctx: &Ctx, weights: &CompressorWeights, xn: &[f32]) -> Vec<f32> {
    let (dim, head_dim) = (ctx.cfg.dim, ctx.cfg.head_dim);
    if weights.ratio == 1 {
        return ctx.backend.rms_norm(
            &ctx.backend.linear_bf16(xn, &weights.wkv, head_dim, dim),
            &weights.norm,
            ctx.cfg.norm_eps,
        );
    }
    let gate_weights = weights.wgate.as_deref().unwrap_or(&[]);
    let kv = ctx.backend.linear_f32(xn, &weights.wkv, head_dim, dim);
    let gate = ctx.backend.linear_f32(xn, gate_weights, head_dim, dim);
    kv.chunks_exact(head_dim)
        .zip(gate.chunks_exact(head_dim))
        .flat_map(|(kv, gate)| kv.iter().chain(gate).copied())
        .collect()
}

/// One sequence's part of a compression step: its compressor state, the
/// [`compressor_inputs`] of its rows and their positions.
pub struct CompressJob<'a> {
    pub state: &'a mut CompressorState,
    pub inputs: &'a [f32],
    pub positions: &'a [usize],
}

/// Runs the compressor of a KV-source layer over the rows of several sequences: each stores its
/// tokens' fp32 `kv ‖ gate`, and every group completed in this step is emitted (latent → index
/// key, latent → RoPE + `Q4m` entry), the emissions of all sequences in one pass of each op.
pub fn compress_chunk(
    ctx: &Ctx,
    weights: &CompressorWeights,
    mut jobs: Vec<CompressJob<'_>>,
    layer: usize,
) {
    let head_dim = ctx.cfg.head_dim;
    let ratio = weights.ratio;
    let table = ctx.rope.for_layer(ctx.cfg, layer);
    let width = if ratio == 1 { head_dim } else { 2 * head_dim };
    // Completed groups: (job, group) and the latent of each, in job then position order.
    let mut groups: Vec<(usize, usize)> = Vec::new();
    let mut latents: Vec<f32> = Vec::new();
    for (j, job) in jobs.iter_mut().enumerate() {
        for (input, &position) in job.inputs.chunks_exact(width).zip(job.positions) {
            if ratio == 1 {
                latents.extend_from_slice(input);
            } else {
                job.state.pending.push(input.to_vec());
                if (position + 1) % ratio != 0 {
                    continue;
                }
                let first = position + 1 - ratio;
                let members: Vec<&[f32]> = (first..=position)
                    .filter_map(|p| job.state.pending.get(p))
                    .collect();
                latents.extend((0..head_dim).map(|c| pool_channel(&members, head_dim, c)));
            }
            groups.push((j, position / ratio));
        }
    }
    if groups.is_empty() {
        return;
    }
    if ratio != 1 {
        latents = ctx
            .backend
            .rms_norm(&latents, &weights.norm, ctx.cfg.norm_eps);
    }
    let group_positions: Vec<usize> = groups.iter().map(|&(_, g)| g * ratio).collect();
    let index_dim = ctx.cfg.index_head_dim;
    let keys = ctx
        .backend
        .linear_bf16(&latents, &weights.index_wk, index_dim, head_dim);
    let mut keys = ctx
        .backend
        .rms_norm(&keys, &weights.index_k_norm, ctx.cfg.norm_eps);
    ctx.backend
        .rope(&mut keys, index_dim, 1, &group_positions, table, false);
    // Rows are whole QDQ groups (index_head_dim and head_dim are multiples of 32).
    ctx.backend.q4e_qdq(&mut keys);
    let mut entries = latents;
    ctx.backend
        .rope(&mut entries, head_dim, 1, &group_positions, table, false);
    ctx.backend.q4m_qdq(&mut entries);
    for ((&(j, group), key), entry) in groups
        .iter()
        .zip(keys.chunks_exact(index_dim))
        .zip(entries.chunks_exact(head_dim))
    {
        let state = &mut *jobs[j].state;
        debug_assert_eq!(state.compressed.len(), group);
        state.index_keys.push(key.to_vec());
        state.compressed.push(entry.to_vec());
    }
}

/// Gated pooling of channel `c` over a group's `kv ‖ gate` rows: softmax of the gates over the
/// group, the weighted sum of the values, bf16.
fn pool_channel(members: &[&[f32]], head_dim: usize, c: usize) -> f32 {
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
}

/// The indexer's queries of rows (any sequences): rotated `Q4e` queries `[n, heads · head_dim]`
/// and scaled head weights `[n, heads]`.
pub struct IndexQueries {
    pub q: Vec<f32>,
    pub head_weights: Vec<f32>,
}

/// [`IndexQueries`] of the rows with query latents `qr`, normed inputs `xn` and `positions`.
pub fn index_queries(
    ctx: &Ctx,
    weights: &IndexerWeights,
    qr: &[f32],
    xn: &[f32],
    positions: &[usize],
    layer: usize,
) -> IndexQueries {
    let cfg = ctx.cfg;
    let (heads, head_dim) = (cfg.index_n_heads, cfg.index_head_dim);
    let table = ctx.rope.for_layer(cfg, layer);
    let mut q = ctx.backend.gemm_fp8(qr, &weights.wq_b);
    ctx.backend
        .rope(&mut q, head_dim, heads, positions, table, false);
    // Rows are whole QDQ groups (index_head_dim is a multiple of 32).
    ctx.backend.q4e_qdq(&mut q);
    let weight_scale = (head_dim as f32).powf(-0.5) * (heads as f32).powf(-0.5);
    let head_weights = ctx
        .backend
        .linear_bf16(xn, &weights.weights_proj, heads, cfg.dim)
        .iter()
        .map(|w| round_bf16(w * weight_scale))
        .collect();
    IndexQueries { q, head_weights }
}

/// The indexer of an index source over one sequence's rows (`q` and `head_weights` its rows of
/// [`index_queries`]): per query, the selected compressed positions (ascending). A candidate
/// source also publishes its candidate mask; a later index source is restricted by it.
pub fn select_chunk(
    ctx: &Ctx,
    index_keys: &[Vec<f32>],
    q: &[f32],
    head_weights: &[f32],
    positions: &[usize],
    layer: usize,
    shared: &mut ChunkShared,
) -> Vec<Vec<usize>> {
    let cfg = ctx.cfg;
    let head_dim = cfg.index_head_dim;
    let ratio = cfg.compress_ratio(layer);
    let flat_keys: Vec<f32> = index_keys.iter().flatten().copied().collect();
    let is_candidate_source = cfg
        .candidate
        .as_ref()
        .is_some_and(|c| c.source_layer == layer);
    let uses_candidates = cfg.uses_candidates(layer);
    let visible: Vec<usize> = positions.iter().map(|&p| (p + 1) / ratio).collect();
    let all_scores = ctx.backend.index_scores_rows_at(
        q,
        head_weights,
        &flat_keys,
        head_dim,
        &visible,
        crate::backend::Precision::Bf16,
    );
    let mut selections = Vec::with_capacity(positions.len());
    let mut candidates = Vec::new();
    for (t, (mut scores, &seen)) in all_scores.into_iter().zip(&visible).enumerate() {
        if is_candidate_source {
            candidates.push(candidate_mask(ctx, &scores));
        } else if uses_candidates && let Some(mask) = shared.candidates.get(t) {
            for (score, keep) in scores.iter_mut().zip(mask) {
                if !keep {
                    *score = f32::NEG_INFINITY;
                }
            }
        }
        selections.push(top_k_lowest_index(&scores, cfg.index_topk.min(seen)));
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
