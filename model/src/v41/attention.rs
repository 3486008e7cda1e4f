//! Attention of one backbone layer over a chunk (spec §3.3): low-rank q, the layer's own window
//! K=V entry (RoPE + `Q8`), the compressed branch of its group, sparse attention with the sink,
//! inverse RoPE and the grouped low-rank output projection.

use super::Ctx;
use super::csa::{self, ChunkShared};
use super::state::SequenceState;
use super::step::StepRows;
use super::trace::ForwardTrace;
use super::weights::AttentionWeights;
use crate::backend::Precision;

/// The normed query latent `qr` and the rotated queries `q` of a chunk.
pub struct Queries {
    pub qr: Vec<f32>,
    pub q: Vec<f32>,
}

/// `qr = q_norm(wq_a · x)`, `q = RoPE(wq_b · qr)`.
pub fn queries(
    ctx: &Ctx,
    w: &AttentionWeights,
    xn: &[f32],
    positions: &[usize],
    table: &crate::backend::RopeTable,
) -> Queries {
    let qr = ctx.backend.rms_norm(
        &ctx.backend.gemm_fp8(xn, &w.wq_a),
        &w.q_norm,
        ctx.cfg.norm_eps,
    );
    let mut q = ctx.backend.gemm_fp8(&qr, &w.wq_b);
    ctx.backend.rope(
        &mut q,
        ctx.cfg.head_dim,
        ctx.cfg.n_heads,
        positions,
        table,
        false,
    );
    Queries { qr, q }
}

/// Window K=V entries of a chunk: `Q8(RoPE(kv_norm(wkv · x)))`, one `head_dim` row per token.
pub fn window_entries(
    ctx: &Ctx,
    w: &AttentionWeights,
    xn: &[f32],
    positions: &[usize],
    table: &crate::backend::RopeTable,
) -> Vec<f32> {
    let head_dim = ctx.cfg.head_dim;
    let mut kv = ctx.backend.rms_norm(
        &ctx.backend.gemm_fp8(xn, &w.wkv),
        &w.kv_norm,
        ctx.cfg.norm_eps,
    );
    ctx.backend
        .rope(&mut kv, head_dim, 1, positions, table, false);
    // Rows are whole QDQ groups (head_dim is a multiple of 32), so one call covers all of them.
    ctx.backend.q8_qdq(&mut kv);
    kv
}

/// Inverse RoPE on every head, `z_g = wo_a[g] · o_g` (bf16, one call per group over all rows),
/// `out = wo_b · z`.
pub fn output_projection(
    ctx: &Ctx,
    w: &AttentionWeights,
    mut o: Vec<f32>,
    positions: &[usize],
    table: &crate::backend::RopeTable,
) -> Vec<f32> {
    let cfg = ctx.cfg;
    ctx.backend
        .rope(&mut o, cfg.head_dim, cfg.n_heads, positions, table, true);
    let row_width = cfg.n_heads * cfg.head_dim;
    let group_width = row_width / cfg.o_groups;
    let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
    let mut z = vec![0.0f32; positions.len() * groups * rank];
    for g in 0..groups {
        let inputs: Vec<f32> = o
            .chunks_exact(row_width)
            .flat_map(|row| row[g * group_width..(g + 1) * group_width].iter().copied())
            .collect();
        let weights = &w.wo_a[g * rank * group_width..(g + 1) * rank * group_width];
        let zg = ctx.backend.linear_bf16(&inputs, weights, rank, group_width);
        for (t, z_row) in zg.chunks_exact(rank).enumerate() {
            let at = (t * groups + g) * rank;
            z[at..at + rank].copy_from_slice(z_row);
        }
    }
    ctx.backend.gemm_fp8(&z, &w.wo_b)
}

/// Attention of backbone layer `layer` over the normed inputs `xn [n, dim]` of a step's rows
/// (`rows.spans[e]` are the rows of `seqs[e]`): projections, RoPE and the output projection run
/// over all rows at once; window pushes, the compressor, the indexer's selection and the key
/// lists are each sequence's own.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    ctx: &Ctx,
    w: &AttentionWeights,
    layer: usize,
    xn: &[f32],
    rows: &StepRows,
    seqs: &mut [&mut SequenceState],
    shared: &mut [ChunkShared],
    trace: Option<&mut ForwardTrace>,
) -> Vec<f32> {
    let cfg = ctx.cfg;
    let head_dim = cfg.head_dim;
    let positions = &rows.positions[..];
    let n = positions.len();
    let table = ctx.rope.for_layer(cfg, layer);
    let Queries { qr, q } = queries(ctx, w, xn, positions, table);
    let kv = window_entries(ctx, w, xn, positions, table);
    for (span, seq) in rows.spans.iter().zip(seqs.iter_mut()) {
        let window = &mut seq.layers[layer].window;
        for r in span.clone() {
            window.push_at(positions[r], kv[r * head_dim..(r + 1) * head_dim].to_vec());
        }
    }

    let ratio = cfg.compress_ratio(layer);
    let mut selections: Vec<Vec<usize>> = vec![Vec::new(); n];
    let kv_source = cfg.kv_source_of(layer);
    if ratio > 0 {
        if let Some(compressor_weights) = &w.compressor {
            let inputs = csa::compressor_inputs(ctx, compressor_weights, xn);
            let width = inputs.len() / n.max(1);
            let jobs = rows
                .spans
                .iter()
                .zip(seqs.iter_mut())
                .filter_map(|(span, seq)| {
                    Some(csa::CompressJob {
                        state: seq.layers[layer].compressor.as_mut()?,
                        inputs: &inputs[span.start * width..span.end * width],
                        positions: &positions[span.clone()],
                    })
                })
                .collect();
            csa::compress_chunk(ctx, compressor_weights, jobs, layer);
        }
        if let Some(indexer) = &w.indexer {
            let index = csa::index_queries(ctx, indexer, &qr, xn, positions, layer);
            let q_width = index.q.len() / n.max(1);
            let w_width = index.head_weights.len() / n.max(1);
            let forced = trace
                .as_deref()
                .and_then(|t| t.inject.topk.get(layer).cloned().flatten());
            for ((span, seq), shared) in rows.spans.iter().zip(seqs.iter()).zip(shared.iter_mut()) {
                let keys = kv_source
                    .and_then(|s| seq.layers[s].compressor.as_ref())
                    .map_or(&[][..], |c| &c.index_keys[..]);
                shared.topk = csa::select_chunk(
                    ctx,
                    keys,
                    &index.q[span.start * q_width..span.end * q_width],
                    &index.head_weights[span.start * w_width..span.end * w_width],
                    &positions[span.clone()],
                    layer,
                    shared,
                );
                if let Some(forced) = &forced {
                    shared.topk.clone_from(forced);
                }
            }
        }
        for (span, shared) in rows.spans.iter().zip(shared.iter()) {
            for (selection, topk) in selections[span.clone()].iter_mut().zip(&shared.topk) {
                selection.clone_from(topk);
            }
        }
    }
    if let Some(trace) = trace {
        trace.window_kv[layer] = kv.clone();
        trace.topk[layer] = selections.clone();
    }

    let mut keys: Vec<Vec<&[f32]>> = Vec::with_capacity(n);
    for (span, seq) in rows.spans.iter().zip(seqs.iter()) {
        let window = &seq.layers[layer].window;
        let compressed = kv_source
            .and_then(|s| seq.layers[s].compressor.as_ref())
            .map_or(&[][..], |c| &c.compressed[..]);
        for t in span.clone() {
            let position = positions[t];
            let first = (position + 1).saturating_sub(cfg.window_size);
            let mut row_keys: Vec<&[f32]> =
                (first..=position).filter_map(|p| window.get(p)).collect();
            row_keys.extend(selections[t].iter().map(|&i| compressed[i].as_slice()));
            keys.push(row_keys);
        }
    }
    let scale = (head_dim as f32).powf(-0.5);
    let o = ctx
        .backend
        .sparse_attention_rows_at(&q, &keys, &w.sink, scale, Precision::Bf16);
    output_projection(ctx, w, o, positions, table)
}
