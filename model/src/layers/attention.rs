//! The attention pieces both families share: the queries of a step's rows ([`Queries`]) and the
//! grouped low-rank output projection's first half ([`grouped_low_rank`]); each family applies its
//! own `wo_b` (V4.1: FP8, V4: its stored linear) in its model's precision.

use crate::backend::{Precision, RopeTable, Tensor};
use crate::layers::ctx::Ctx;

/// The queries of some rows: the `q_norm`-ed low-rank latent `qr [n, q_lora_rank]` (the indexer
/// reads it) and the rotated per-head queries `q [n, heads · head_dim]`.
pub struct Queries {
    pub qr: Tensor,
    pub q: Tensor,
}

/// Inverse RoPE on every head of the attention outputs `o [n, heads · head_dim]` at `positions`,
/// then `z_g = wo_a[g] · o_g` per output group (one call per group over all rows, in the model's
/// precision): returns `z [n, groups · o_lora_rank]`, row t holding every group's rank values in
/// group order, for the family's `wo_b`.
pub fn grouped_low_rank(
    ctx: &Ctx,
    wo_a: &[f32],
    o: Tensor,
    positions: &[usize],
    table: &RopeTable,
) -> Tensor {
    let cfg = ctx.cfg;
    let backend = ctx.backend;
    let precision = cfg.precision();
    let (heads, head_dim) = (cfg.n_heads, cfg.head_dim);
    let o = backend.rope(o, head_dim, heads, positions, table, true, precision);
    let row = heads * head_dim;
    let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
    let group_width = row / groups;
    let n = positions.len();
    let z_groups: Vec<Tensor> = (0..groups)
        .map(|g| {
            let pieces: Vec<(&Tensor, usize)> =
                (0..n).map(|t| (&o, t * row + g * group_width)).collect();
            let inputs = backend.gather(&pieces, group_width);
            let weights = &wo_a[g * rank * group_width..(g + 1) * rank * group_width];
            match precision {
                Precision::Bf16 => backend.linear_bf16(&inputs, weights, rank, group_width),
                Precision::F32 => backend.linear_f32(&inputs, weights, rank, group_width),
            }
        })
        .collect();
    let pieces: Vec<(&Tensor, usize)> = (0..n)
        .flat_map(|t| z_groups.iter().map(move |zg| (zg, t * rank)))
        .collect();
    backend.gather(&pieces, rank)
}
