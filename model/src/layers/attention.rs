//! The attention pieces both families share, each projection applied the family's way
//! ([`Projection`]) in its model's precision: the queries of a step's rows ([`queries`]), the K=V
//! rows ([`kv_rows`]) and the grouped low-rank output projection ([`output`]).

use crate::backend::{Groups, Precision, RopeTable, Rotation, Tensor, linear_by_groups};
use crate::layers::ctx::Ctx;
use crate::layers::weights::{AttentionWeights, Projection};

/// The queries of some rows: the `q_norm`-ed low-rank latent `qr [n, q_lora_rank]` (the indexer
/// reads it) and the rotated per-head queries `q [n, heads · head_dim]`.
pub struct Queries {
    pub qr: Tensor,
    pub q: Tensor,
}

/// `qr = q_norm(wq_a · xn)` and the rotated per-head queries `q = RoPE(wq_b · qr)` of the normed
/// inputs `xn [n, dim]` at `positions`; with `head_norm` (V4: `[head_dim]` ones, an unweighted
/// RMSNorm) every head of `q` is normed before RoPE.
pub fn queries<W: Projection, C, I>(
    ctx: &Ctx,
    w: &AttentionWeights<W, C, I>,
    xn: &Tensor,
    positions: &[usize],
    table: &RopeTable,
    head_norm: Option<&[f32]>,
) -> Queries {
    let cfg = ctx.cfg;
    let (backend, precision) = (ctx.backend, cfg.precision());
    let qr = backend.rms_norm(&w.wq_a.project(backend, xn), ctx.norm(&w.q_norm, precision));
    let q = w.wq_b.project(backend, &qr);
    let q = match head_norm {
        Some(unit) => backend.rms_norm(&q, ctx.norm(unit, precision)),
        None => q,
    };
    let rotation = Rotation::new(table, positions, precision);
    let q = backend.rope(q, (cfg.head_dim, cfg.n_heads), &rotation);
    Queries { qr, q }
}

/// The K=V rows `[n, head_dim]` of the normed inputs `xn [n, dim]`: `RoPE(kv_norm(wkv · xn))`.
pub fn kv_rows<W: Projection, C, I>(
    ctx: &Ctx,
    w: &AttentionWeights<W, C, I>,
    xn: &Tensor,
    positions: &[usize],
    table: &RopeTable,
) -> Tensor {
    let cfg = ctx.cfg;
    let (backend, precision) = (ctx.backend, cfg.precision());
    let kv = backend.rms_norm(&w.wkv.project(backend, xn), ctx.norm(&w.kv_norm, precision));
    let rotation = Rotation::new(table, positions, precision);
    backend.rope(kv, (cfg.head_dim, 1), &rotation)
}

/// De-rotates the attention outputs `o [n, heads · head_dim]` and applies the grouped low-rank
/// output projection → `[n, dim]`: [`grouped_low_rank`], then `wo_b`.
pub fn output<W: Projection, C, I>(
    ctx: &Ctx,
    w: &AttentionWeights<W, C, I>,
    o: Tensor,
    positions: &[usize],
    table: &RopeTable,
) -> Tensor {
    let z = grouped_low_rank(ctx, &w.wo_a, o, positions, table);
    w.wo_b.project(ctx.backend, &z)
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
    let inverse = Rotation::new(table, positions, precision).inverse();
    let o = backend.rope(o, (head_dim, heads), &inverse);
    let groups = cfg.o_groups;
    let shape = Groups {
        groups,
        out: cfg.o_lora_rank,
        inp: heads * head_dim / groups,
    };
    match precision {
        Precision::Bf16 => backend.linear_grouped_bf16(&o, wo_a, shape),
        Precision::F32 => linear_by_groups(backend, &o, shape, |x, g| {
            backend.linear_f32(x, shape.weight(wo_a, g))
        }),
    }
}
