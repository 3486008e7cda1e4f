//! Attention of one V4 layer over a chunk (spec v4-architecture.md §2.5–§2.8): low-rank query with a
//! per-head unweighted RMSNorm, one shared K=V head, the raw window plus the layer's compressed
//! entries (HCA: every complete entry; CSA: the indexer's top-k), a per-head sink, de-rotation of
//! the output and the grouped low-rank output projection. The projection steps are also used by
//! the speculative heads (MTP block, DSpark stages), which attend over their own keys.

use super::compressor;
use super::state::LayerState;
use super::weights::AttentionWeights;
use crate::backend::RopeTable;
use crate::v41::Ctx;

/// The queries of a chunk: the `q_norm`-ed low-rank latent `qr [n, q_lora_rank]` (the CSA
/// indexer reads it) and the rotated per-head queries `q [n, heads · head_dim]`.
pub struct Queries {
    pub qr: Vec<f32>,
    pub q: Vec<f32>,
}

/// Queries of the normed inputs `xn [n, dim]` at `positions`.
pub fn queries(
    ctx: &Ctx,
    w: &AttentionWeights,
    xn: &[f32],
    positions: &[usize],
    table: &RopeTable,
    unit: &[f32],
) -> Queries {
    let cfg = ctx.cfg;
    let (backend, precision, eps) = (ctx.backend, cfg.precision(), cfg.norm_eps);
    let qr = backend.rms_norm_at(&w.wq_a.apply(backend, xn).into(), &w.q_norm, eps, precision);
    let q = backend.rms_norm_at(&w.wq_b.apply(backend, &qr).into(), unit, eps, precision);
    let q = backend.rope_at(
        q,
        cfg.head_dim,
        cfg.n_heads,
        positions,
        table,
        false,
        precision,
    );
    Queries {
        qr: qr.into_vec(),
        q: q.into_vec(),
    }
}

/// The K=V rows `[n, head_dim]` (after `kv_norm` and RoPE) of the normed inputs `xn [n, dim]`.
pub fn kv_rows(
    ctx: &Ctx,
    w: &AttentionWeights,
    xn: &[f32],
    positions: &[usize],
    table: &RopeTable,
) -> Vec<f32> {
    let cfg = ctx.cfg;
    let (backend, precision) = (ctx.backend, cfg.precision());
    let kv = backend.rms_norm_at(
        &w.wkv.apply(backend, xn).into(),
        &w.kv_norm,
        cfg.norm_eps,
        precision,
    );
    backend
        .rope_at(kv, cfg.head_dim, 1, positions, table, false, precision)
        .into_vec()
}

/// Attention of one query row `[heads · head_dim]` over `keys` (K = V) with the layer's sinks.
pub fn attend(ctx: &Ctx, w: &AttentionWeights, q_row: &[f32], keys: &[&[f32]]) -> Vec<f32> {
    let scale = (ctx.cfg.head_dim as f32).powf(-0.5);
    ctx.backend
        .sparse_attention_at(q_row, keys, &w.sink, scale, ctx.cfg.precision())
}

/// De-rotates the attention outputs `o [n, heads · head_dim]` and applies the grouped low-rank
/// output projection → `[n, dim]`.
pub fn output(
    ctx: &Ctx,
    w: &AttentionWeights,
    o: Vec<f32>,
    positions: &[usize],
    table: &RopeTable,
) -> Vec<f32> {
    let cfg = ctx.cfg;
    let backend = ctx.backend;
    let (heads, head_dim) = (cfg.n_heads, cfg.head_dim);
    let o = backend.rope_at(
        o.into(),
        head_dim,
        heads,
        positions,
        table,
        true,
        cfg.precision(),
    );
    let row = heads * head_dim;
    let groups = cfg.o_groups;
    let (group_width, rank) = (row / groups, cfg.o_lora_rank);
    let mut z = Vec::with_capacity(positions.len() * groups * rank);
    for o_row in o.chunks_exact(row) {
        for (g, group) in o_row.chunks_exact(group_width).enumerate() {
            let weights = &w.wo_a[g * rank * group_width..(g + 1) * rank * group_width];
            z.extend_from_slice(&backend.linear_f32(&group.into(), weights, rank, group_width));
        }
    }
    w.wo_b.apply(backend, &z)
}

/// Causal attention over the normed inputs `xn [n, dim]` of tokens at `positions`, with RoPE
/// `table`; appends the chunk to `state` and returns `[n, dim]`.
pub fn forward(
    ctx: &Ctx,
    w: &AttentionWeights,
    table: &RopeTable,
    xn: &[f32],
    positions: &[usize],
    state: &mut LayerState,
    unit: &[f32],
) -> Vec<f32> {
    let cfg = ctx.cfg;
    let Queries { qr, q } = queries(ctx, w, xn, positions, table, unit);
    let kv = kv_rows(ctx, w, xn, positions, table);
    for (row, &position) in kv.chunks_exact(cfg.head_dim).zip(positions) {
        state.window.push_at(position, row.to_vec());
    }

    if let (Some(weights), Some(cache)) = (&w.compressor, state.main.as_mut()) {
        compressor::append_chunk(ctx, weights, cache, xn, positions, table);
    }
    let selections = match (&w.indexer, state.index.as_mut()) {
        (Some(indexer), Some(cache)) => {
            compressor::append_chunk(ctx, &indexer.compressor, cache, xn, positions, table);
            Some(compressor::select_chunk(
                ctx,
                indexer,
                &cache.entries,
                &qr,
                xn,
                positions,
                table,
            ))
        }
        _ => None,
    };

    let (entries, ratio) = state
        .main
        .as_ref()
        .map_or((&[][..], 1), |c| (c.entries.as_slice(), c.ratio));
    let row = cfg.n_heads * cfg.head_dim;
    let mut o = Vec::with_capacity(positions.len() * row);
    for (t, &position) in positions.iter().enumerate() {
        let first = (position + 1).saturating_sub(cfg.window_size);
        let mut keys: Vec<&[f32]> = (first..=position)
            .filter_map(|p| state.window.get(p).map(|row| &row[..]))
            .collect();
        match &selections {
            Some(selected) => keys.extend(selected[t].iter().map(|&i| entries[i].as_slice())),
            None => {
                let visible = ((position + 1) / ratio).min(entries.len());
                keys.extend(entries[..visible].iter().map(Vec::as_slice));
            }
        }
        o.extend(attend(ctx, w, &q[t * row..(t + 1) * row], &keys));
    }
    output(ctx, w, o, positions, table)
}
