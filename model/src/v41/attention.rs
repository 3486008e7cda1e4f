//! Attention of one backbone layer over a chunk (spec §3.3): low-rank q, the layer's own window
//! K=V entry (RoPE + `Q8`), the compressed branch of its group, sparse attention with the sink,
//! inverse RoPE and the grouped low-rank output projection.

use super::Ctx;
use super::csa::{self, ChunkShared};
use super::state::LayerState;
use super::trace::ForwardTrace;
use super::weights::AttentionWeights;

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
    for row in kv.chunks_exact_mut(head_dim) {
        ctx.backend.q8_qdq(row);
    }
    kv
}

/// Sparse attention output of one query row, then inverse RoPE, grouped `wo_a` and `wo_b` (applied
/// to all rows at once by the caller through [`output_projection`]).
pub fn attend(ctx: &Ctx, w: &AttentionWeights, q: &[f32], keys: &[&[f32]]) -> Vec<f32> {
    let scale = (ctx.cfg.head_dim as f32).powf(-0.5);
    ctx.backend.sparse_attention(q, keys, &w.sink, scale)
}

/// Inverse RoPE on every head, `z_g = wo_a[g] · o_g` (bf16), `out = wo_b · z`.
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
    let group_width = cfg.n_heads * cfg.head_dim / cfg.o_groups;
    let rank = cfg.o_lora_rank;
    let mut z = Vec::with_capacity(positions.len() * cfg.o_groups * rank);
    for row in o.chunks_exact(cfg.n_heads * cfg.head_dim) {
        for (g, group) in row.chunks_exact(group_width).enumerate() {
            let weights = &w.wo_a[g * rank * group_width..(g + 1) * rank * group_width];
            z.extend(ctx.backend.linear_bf16(group, weights, rank, group_width));
        }
    }
    ctx.backend.gemm_fp8(&z, &w.wo_b)
}

/// Attention of backbone layer `layer` over a chunk of normed inputs `xn [n, dim]`.
pub fn forward(
    ctx: &Ctx,
    w: &AttentionWeights,
    layer: usize,
    xn: &[f32],
    positions: &[usize],
    layers: &mut [LayerState],
    shared: &mut ChunkShared,
    trace: Option<&mut ForwardTrace>,
) -> Vec<f32> {
    let cfg = ctx.cfg;
    let head_dim = cfg.head_dim;
    let table = ctx.rope.for_layer(cfg, layer);
    let Queries { qr, q } = queries(ctx, w, xn, positions, table);
    let kv = window_entries(ctx, w, xn, positions, table);
    for (row, &position) in kv.chunks_exact(head_dim).zip(positions) {
        layers[layer].window.push_at(position, row.to_vec());
    }

    let ratio = cfg.compress_ratio(layer);
    let mut selections: Vec<Vec<usize>> = vec![Vec::new(); positions.len()];
    let kv_source = cfg.kv_source_of(layer);
    if ratio > 0 {
        if let (Some(compressor_weights), Some(state)) =
            (&w.compressor, layers[layer].compressor.as_mut())
        {
            csa::compress_chunk(ctx, compressor_weights, state, xn, positions, layer);
        }
        if let Some(indexer) = &w.indexer {
            let keys = kv_source
                .and_then(|s| layers[s].compressor.as_ref())
                .map_or(&[][..], |c| &c.index_keys[..]);
            shared.topk = csa::select_chunk(ctx, indexer, keys, &qr, xn, positions, layer, shared);
            if let Some(forced) = trace
                .as_deref()
                .and_then(|t| t.inject.topk.get(layer).cloned().flatten())
            {
                shared.topk = forced;
            }
        }
        selections = shared.topk.clone();
    }
    if let Some(trace) = trace {
        trace.window_kv[layer] = kv.clone();
        trace.topk[layer] = selections.clone();
    }

    let row = cfg.n_heads * head_dim;
    let layer_state = &layers[layer];
    let compressed = kv_source
        .and_then(|s| layers[s].compressor.as_ref())
        .map_or(&[][..], |c| &c.compressed[..]);
    let mut o = Vec::with_capacity(positions.len() * row);
    for (t, &position) in positions.iter().enumerate() {
        let first = (position + 1).saturating_sub(cfg.window_size);
        let mut keys: Vec<&[f32]> = (first..=position)
            .filter_map(|p| layer_state.window.get(p))
            .collect();
        keys.extend(selections[t].iter().map(|&i| compressed[i].as_slice()));
        o.extend(attend(ctx, w, &q[t * row..(t + 1) * row], &keys));
    }
    output_projection(ctx, w, o, positions, table)
}
