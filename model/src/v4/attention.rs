//! Attention of one V4 layer over a step's rows (spec v4-architecture.md §2.5–§2.8): low-rank query with a
//! per-head unweighted RMSNorm, one shared K=V head, the raw window plus the layer's compressed
//! entries (HCA: every complete entry; CSA: the indexer's top-k), a per-head sink, de-rotation of
//! the output and the grouped low-rank output projection. The projection steps are also used by
//! the speculative heads (MTP block, DSpark stages), which attend over their own keys.

use super::compressor;
use super::state::LayerState;
use super::weights::AttentionWeights;
use crate::backend::{AttentionQueries, CompressedKeys, NO_KEYS, QueryKeys, RopeTable, Tensor};
use crate::layers::attention::{Queries, kv_rows, output, queries};
use crate::layers::ctx::Ctx;
use crate::layers::step::StepRows;

/// Attention of the query rows `q [n, heads · head_dim]`, query `t` over its own `keys[t]` (K = V),
/// with the layer's sinks.
pub fn attend(ctx: &Ctx, w: &AttentionWeights, q: &Tensor, keys: &[QueryKeys<'_>]) -> Tensor {
    let queries = AttentionQueries {
        q,
        sink: &w.sink,
        scale: (ctx.cfg.head_dim as f32).powf(-0.5),
        precision: ctx.cfg.precision(),
    };
    ctx.backend.sparse_attention_rows(queries, keys)
}

/// Causal attention over the normed inputs `xn [n, dim]` of a step's rows (sequence `e`'s rows at
/// `rows.spans[e]`, its layer state `states[e]`), with RoPE `table`: projections, RoPE and the
/// output projection run over all rows at once; window pushes, the compressors, the indexer's
/// selection and the key lists are each sequence's own. Appends the rows to the states and returns
/// `[n, dim]`.
pub fn forward_rows(
    ctx: &Ctx,
    w: &AttentionWeights,
    table: &RopeTable,
    xn: &Tensor,
    rows: &StepRows,
    states: &mut [&mut LayerState],
    unit: &[f32],
) -> Tensor {
    let cfg = ctx.cfg;
    let head_dim = cfg.head_dim;
    let positions = &rows.positions[..];
    let Queries { qr, q } = queries(ctx, w, xn, positions, table, Some(unit));
    let kv = kv_rows(ctx, w, xn, positions, table);
    for (span, state) in rows.spans.iter().zip(states.iter_mut()) {
        for t in span.clone() {
            state
                .window
                .push_at(positions[t], kv.rows(t..t + 1, head_dim));
        }
    }

    if let Some(weights) = &w.compressor {
        let caches = states.iter_mut().map(|s| s.main.as_mut()).collect();
        compressor::append_rows(ctx, weights, caches, rows, xn, table);
    }
    let selection = w.indexer.as_ref().map(|indexer| {
        let caches = states.iter_mut().map(|s| s.index.as_mut()).collect();
        compressor::append_rows(ctx, &indexer.compressor, caches, rows, xn, table);
        compressor::select_rows(ctx, indexer, states, &qr, xn, rows, table)
    });

    let mut keys: Vec<QueryKeys<'_>> = Vec::with_capacity(positions.len());
    for (span, state) in rows.spans.iter().zip(states.iter()) {
        let main = state.main.as_ref();
        let entries = main.map_or(&NO_KEYS, |c| &c.entries);
        for t in span.clone() {
            let position = positions[t];
            let first = (position + 1).saturating_sub(cfg.window_size);
            // The indexer's selection of the compressed entries, or without an indexer every
            // entry the position sees (a prefix of the list); none without a compressor.
            let compressed = match (&selection, main) {
                (Some(selection), _) => Some(CompressedKeys::selected(entries, selection, t)),
                (None, Some(cache)) => {
                    let visible = ((position + 1) / cache.ratio).min(entries.len());
                    Some(CompressedKeys::prefix(entries, visible))
                }
                (None, None) => None,
            };
            keys.push(QueryKeys {
                window: Some(state.window.window(first, position)),
                listed: Vec::new(),
                compressed,
            });
        }
    }
    let o = attend(ctx, w, &q, &keys);
    output(ctx, w, o, positions, table)
}

/// [`forward_rows`] of one sequence's chunk at `positions`.
pub fn forward(
    ctx: &Ctx,
    w: &AttentionWeights,
    table: &RopeTable,
    xn: &Tensor,
    positions: &[usize],
    state: &mut LayerState,
    unit: &[f32],
) -> Tensor {
    let rows = StepRows::single(positions);
    forward_rows(ctx, w, table, xn, &rows, &mut [state], unit)
}
