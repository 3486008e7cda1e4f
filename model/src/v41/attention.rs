//! Attention of one backbone layer over a chunk (spec §3.3): low-rank q, the layer's own window
//! K=V entry (RoPE + `Q8`), the compressed branch of its group, sparse attention with the sink,
//! inverse RoPE and the grouped low-rank output projection.

use super::context_parallel::CpRank;
use super::csa::{self, StepShared};
use super::state::SequenceState;
use super::trace::ForwardTrace;
use super::weights::AttentionWeights;
use crate::backend::{
    AttentionQueries, CompressedKeys, KeyList, NO_KEYS, Precision, QdqPoint, QueryKeys, RopeTable,
    Rotation, Selection, Tensor,
};
use crate::layers::attention::{Queries, output, queries};
use crate::layers::ctx::Ctx;
use crate::layers::step::StepRows;
use crate::layers::weights::Projection;

/// Window K=V entries of a chunk: `Q8(RoPE(kv_norm(wkv · x)))`, one `head_dim` row per token
/// (rows are whole QDQ groups: head_dim is a multiple of 32).
pub fn window_entries(
    ctx: &Ctx,
    w: &AttentionWeights,
    xn: &Tensor,
    positions: &[usize],
    table: &RopeTable,
) -> Tensor {
    let (cfg, backend) = (ctx.cfg, ctx.backend);
    let precision = cfg.precision();
    backend.rope_qdq(
        w.wkv.project(backend, xn),
        Some(ctx.norm(&w.kv_norm, precision)),
        (cfg.head_dim, 1),
        &Rotation::new(table, positions, precision),
        QdqPoint::Q8,
    )
}

/// Attention of backbone layer `layer` over the normed inputs `xn [n, dim]` of a step's rows
/// (`rows.spans[e]` are the rows of `seqs[e]`): projections, RoPE and the output projection run
/// over all rows at once; window pushes, the compressor, the indexer's selection and the key
/// lists are each sequence's own. With `cp` (one sequence) the rows are a CP rank's own: the
/// window entries and compressor inputs of every rank's rows are all-gathered, so the window
/// and the compressed caches take the whole chunk.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    ctx: &Ctx,
    w: &AttentionWeights,
    layer: usize,
    xn: &Tensor,
    rows: &StepRows,
    seqs: &mut [&mut SequenceState],
    shared: &mut StepShared,
    trace: Option<&mut ForwardTrace>,
    cp: Option<&CpRank<'_>>,
) -> Tensor {
    let cfg = ctx.cfg;
    let head_dim = cfg.head_dim;
    let positions = &rows.positions[..];
    let n = positions.len();
    let table = ctx.rope.for_layer(cfg, layer);
    let Queries { qr, q } = queries(ctx, w, xn, positions, table, None);
    let kv = window_entries(ctx, w, xn, positions, table);
    // The rows whose window entries and compressor inputs enter the state, and their spans.
    let chunk_positions = cp.map(CpRank::chunk_positions);
    let (state_positions, state_spans) = match &chunk_positions {
        Some(all) => (&all[..], std::iter::once(0..all.len()).collect()),
        None => (positions, rows.spans.clone()),
    };
    let gathered = |own: &Tensor, width: usize| match cp {
        Some(cp) => cp.all_gather(ctx.backend, own, width, layer),
        None => own.clone(),
    };
    let state_kv = gathered(&kv, head_dim);
    for (span, seq) in state_spans.iter().zip(seqs.iter_mut()) {
        let window = &mut seq.layers[layer].window;
        for r in span.clone() {
            window.push_at(state_positions[r], state_kv.rows(r..r + 1, head_dim));
        }
    }

    let ratio = cfg.compress_ratio(layer);
    let kv_source = cfg.kv_source_of(layer);
    if ratio > 0 {
        if let Some(compressor_weights) = &w.compressor {
            let inputs = csa::compressor_inputs(ctx, compressor_weights, xn);
            let width = inputs.len() / n.max(1);
            let inputs = gathered(&inputs, width);
            let jobs = state_spans
                .iter()
                .zip(seqs.iter_mut())
                .filter_map(|(span, seq)| {
                    Some(csa::CompressJob {
                        state: seq.layers[layer].compressor.as_mut()?,
                        inputs: inputs.rows(span.clone(), width),
                        positions: &state_positions[span.clone()],
                    })
                })
                .collect();
            csa::compress_chunk(ctx, compressor_weights, jobs, layer);
        }
        if let Some(indexer) = &w.indexer {
            let index = csa::index_queries(ctx, indexer, &qr, xn, positions, layer);
            let forced = trace
                .as_deref()
                .and_then(|t| t.inject.topk.get(layer).cloned().flatten());
            let keys: Vec<&KeyList> = seqs
                .iter()
                .map(|seq| {
                    kv_source
                        .and_then(|s| seq.layers[s].compressor.as_ref())
                        .map_or(&NO_KEYS, |c| &c.index_keys)
                })
                .collect();
            let selection = csa::select_step(ctx, &keys, rows, &index, layer, shared);
            shared.selection = Some(match forced {
                Some(forced) => Selection::host(forced),
                None => selection,
            });
        }
    }
    // Each query's compressed selection: the step's latest index source's, row by row.
    let selection = shared.selection.as_ref().filter(|_| ratio > 0);
    if let Some(trace) = trace {
        trace.window_kv[layer] = kv.to_vec();
        trace.topk[layer] = (0..n)
            .map(|t| {
                selection
                    .filter(|s| t < s.len())
                    .map_or_else(Vec::new, |s| s.rows()[t].clone())
            })
            .collect();
    }

    let mut queries: Vec<QueryKeys<'_>> = Vec::with_capacity(n);
    for (span, seq) in rows.spans.iter().zip(seqs.iter()) {
        let window = &seq.layers[layer].window;
        let compressed = kv_source
            .and_then(|s| seq.layers[s].compressor.as_ref())
            .map_or(&NO_KEYS, |c| &c.compressed);
        for t in span.clone() {
            let position = positions[t];
            let first = (position + 1).saturating_sub(cfg.window_size);
            queries.push(QueryKeys {
                window: Some(window.window(first, position)),
                listed: Vec::new(),
                compressed: selection
                    .filter(|s| t < s.len())
                    .map(|selection| CompressedKeys::selected(compressed, selection, t)),
            });
        }
    }
    let attention = AttentionQueries {
        q: &q,
        sink: &w.sink,
        scale: (head_dim as f32).powf(-0.5),
        precision: Precision::Bf16,
    };
    let o = ctx.backend.sparse_attention_rows(attention, &queries);
    output(ctx, w, o, positions, table)
}
