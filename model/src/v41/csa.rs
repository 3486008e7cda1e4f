//! CSA2, the shared compressed branch (spec §3.4): the KV-source compressor (ratio-2 gated pooling or
//! ratio-1 projection), the index keys it derives, the indexer of an index source, the two-level
//! candidate blocks of the candidate source and the lowest-index-on-ties top-k.

use super::state::CompressorState;
use super::weights::{CompressorWeights, IndexerWeights};
pub use crate::backend::select::top_k_lowest_index;
use crate::backend::{
    CandidateMask, Candidates, DenseWeight, KeyList, Precision, QdqPoint, Rotation, SelectFrom,
    Selection, Tensor,
};
use crate::layers::ctx::Ctx;
use crate::layers::step::StepRows;

/// A step's products handed from sources to the layers that reuse them, one row per query of
/// the step.
#[derive(Debug, Default)]
pub struct StepShared {
    /// Compressed positions selected per query by the latest index source (ascending).
    pub selection: Option<Selection>,
    /// The candidate source's mask (over each query's visible compressed positions).
    pub candidates: Option<CandidateMask>,
}

/// The compressor's per-token projections of rows `xn [n, dim]` (any sequences): the ratio-1
/// latents `kv_norm(wkv · x)` (`[n, head_dim]`, bf16), or the fp32 `kv ‖ gate` rows of gated
/// pooling (`[n, 2 · head_dim]`).
pub fn compressor_inputs(ctx: &Ctx, weights: &CompressorWeights, xn: &Tensor) -> Tensor {
    let (dim, head_dim) = (ctx.cfg.dim, ctx.cfg.head_dim);
    if weights.ratio == 1 {
        return ctx.backend.rms_norm(
            &ctx.backend.linear_bf16(
                xn,
                DenseWeight {
                    values: &weights.wkv,
                    out: head_dim,
                    inp: dim,
                },
            ),
            ctx.norm(&weights.norm, Precision::Bf16),
        );
    }
    let gate_weights = weights.wgate.as_deref().unwrap_or(&[]);
    let kv = ctx.backend.linear_f32(
        xn,
        DenseWeight {
            values: &weights.wkv,
            out: head_dim,
            inp: dim,
        },
    );
    let gate = ctx.backend.linear_f32(
        xn,
        DenseWeight {
            values: gate_weights,
            out: head_dim,
            inp: dim,
        },
    );
    let pieces: Vec<(&Tensor, usize)> = (0..kv.len() / head_dim.max(1))
        .flat_map(|t| [(&kv, t * head_dim), (&gate, t * head_dim)])
        .collect();
    ctx.backend.gather(&pieces, head_dim)
}

/// One sequence's part of a compression step: its compressor state, the
/// [`compressor_inputs`] of its rows and their positions.
pub struct CompressJob<'a> {
    pub state: &'a mut CompressorState,
    pub inputs: Tensor,
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
    // Completed groups: (job, group) and where each one's latent comes from, in job then position
    // order: ratio 1 takes its input row as it is, gated pooling pools the group's pending rows
    // (all stored first: a ring only grows here, so every member stays where it was pushed).
    let mut groups: Vec<(usize, usize)> = Vec::new();
    let mut direct: Vec<Tensor> = Vec::new();
    for (j, job) in jobs.iter_mut().enumerate() {
        // Groups a prefix-cache hit attached stay as first computed: a replay never rewrites them.
        let held = job.state.compressed.len();
        for (input, &position) in job.inputs.split_rows(width).into_iter().zip(job.positions) {
            let group = position / ratio;
            if ratio == 1 {
                if group < held {
                    continue;
                }
                direct.push(input);
            } else {
                job.state.pending.push(input);
                if (position + 1) % ratio != 0 || group < held {
                    continue;
                }
            }
            groups.push((j, group));
        }
    }
    if groups.is_empty() {
        return;
    }
    let latents = if ratio == 1 {
        let pieces: Vec<(&Tensor, usize)> = direct.iter().map(|row| (row, 0)).collect();
        ctx.backend.gather(&pieces, head_dim)
    } else {
        let members: Vec<Vec<&Tensor>> = groups
            .iter()
            .map(|&(j, group)| {
                let pending = &jobs[j].state.pending;
                (group * ratio..(group + 1) * ratio)
                    .filter_map(|p| pending.get(p))
                    .collect()
            })
            .collect();
        let pooled = ctx.backend.gated_pool_rows(&members, head_dim);
        ctx.backend
            .rms_norm(&pooled, ctx.norm(&weights.norm, Precision::Bf16))
    };
    let group_positions: Vec<usize> = groups.iter().map(|&(_, g)| g * ratio).collect();
    let index_dim = ctx.cfg.index_head_dim;
    let keys = ctx.backend.linear_bf16(
        &latents,
        DenseWeight {
            values: &weights.index_wk,
            out: index_dim,
            inp: head_dim,
        },
    );
    let rotation = Rotation::new(table, &group_positions, Precision::Bf16);
    // Rows are whole QDQ groups (index_head_dim and head_dim are multiples of 32).
    let keys = ctx.backend.rope_qdq(
        keys,
        Some(ctx.norm(&weights.index_k_norm, Precision::Bf16)),
        (index_dim, 1),
        &rotation,
        QdqPoint::Q4e,
    );
    let entries = ctx
        .backend
        .rope_qdq(latents, None, (head_dim, 1), &rotation, QdqPoint::Q4m);
    for ((&(j, group), key), entry) in groups
        .iter()
        .zip(keys.split_rows(index_dim))
        .zip(entries.split_rows(head_dim))
    {
        let state = &mut *jobs[j].state;
        debug_assert_eq!(state.compressed.len(), group);
        state.index_keys.push(key);
        state.compressed.push(entry);
    }
}

/// The indexer's queries of rows (any sequences): rotated `Q4e` queries `[n, heads · head_dim]`
/// and scaled head weights `[n, heads]`.
pub struct IndexQueries {
    pub q: Tensor,
    pub head_weights: Tensor,
}

/// [`IndexQueries`] of the rows with query latents `qr`, normed inputs `xn` and `positions`.
pub fn index_queries(
    ctx: &Ctx,
    weights: &IndexerWeights,
    qr: &Tensor,
    xn: &Tensor,
    positions: &[usize],
    layer: usize,
) -> IndexQueries {
    let cfg = ctx.cfg;
    let (heads, head_dim) = (cfg.index_n_heads, cfg.index_head_dim);
    let table = ctx.rope.for_layer(cfg, layer);
    let rotation = Rotation::new(table, positions, Precision::Bf16);
    let q = ctx.backend.gemm_fp8(qr, &weights.wq_b);
    // Rows are whole QDQ groups (index_head_dim is a multiple of 32).
    let q = ctx
        .backend
        .rope_qdq(q, None, (head_dim, heads), &rotation, QdqPoint::Q4e);
    let weight_scale = (head_dim as f32).powf(-0.5) * (heads as f32).powf(-0.5);
    let head_weights = ctx.backend.scale_at(
        ctx.backend.linear_bf16(
            xn,
            DenseWeight {
                values: &weights.weights_proj,
                out: heads,
                inp: cfg.dim,
            },
        ),
        weight_scale,
        Precision::Bf16,
    );
    IndexQueries { q, head_weights }
}

/// The indexer of an index source over a step's `rows` (`index` their [`index_queries`]; the rows
/// of sequence `e` at `rows.spans[e]` score `index_keys[e]`, its source's keys): per query, the selected compressed positions (ascending), one backend op for the step,
/// where the backend computed them. A candidate source also publishes its candidate mask (one row
/// per query); a later index source of the same step is restricted by it.
pub fn select_step(
    ctx: &Ctx,
    index_keys: &[&KeyList],
    rows: &StepRows,
    index: &IndexQueries,
    layer: usize,
    shared: &mut StepShared,
) -> Selection {
    let cfg = ctx.cfg;
    let ratio = cfg.compress_ratio(layer);
    let visible = rows.visible_entries(ratio);
    let parts = rows.select_parts(index_keys, &visible);
    let candidate_source = cfg.candidate.as_ref().filter(|c| c.source_layer == layer);
    let candidates = match (candidate_source, &shared.candidates) {
        (Some(c), _) => Candidates::Produce {
            block_size: c.block_size,
            topk_blocks: c.topk_blocks,
        },
        (None, Some(mask)) if cfg.uses_candidates(layer) => Candidates::Apply(mask),
        _ => Candidates::None,
    };
    let queries = crate::backend::IndexQueries {
        q: &index.q,
        weights: &index.head_weights,
        head_dim: cfg.index_head_dim,
        precision: Precision::Bf16,
    };
    let from = SelectFrom {
        parts: &parts,
        k: cfg.index_topk,
        candidates,
    };
    let (selection, mask) = ctx.backend.select_rows(queries, from);
    if candidate_source.is_some() {
        shared.candidates = mask;
    }
    selection
}
