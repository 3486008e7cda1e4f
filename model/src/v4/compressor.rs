//! The V4 compressed branch (spec v4-architecture.md §2.7, §2.8): gated softmax pooling of `ratio`
//! tokens per entry (HCA: one series; CSA and its indexer: two overlapping series, the entry of
//! window w pooling the "A" half of window w−1 and the "B" half of window w), RMSNorm and RoPE at
//! the entry's first position; and the Lightning Indexer's top-k selection of CSA entries.

use super::state::{CompressorCache, LayerState};
use super::weights::{CompressorWeights, IndexerWeights};
use crate::backend::{
    Candidates, IndexQueries, KeyList, NO_KEYS, PoolSlot, RopeTable, Rotation, SelectFrom,
    Selection, Tensor,
};
use crate::layers::ctx::Ctx;
use crate::layers::step::StepRows;

/// Appends the step's raw `kv ‖ gate` rows (`xn [n, dim]`, the rows of sequence `e` at
/// `rows.spans[e]`) to each sequence's cache (`None`: the sequence has none) and emits every entry
/// completed by them, all sequences' entries in one pass of each op.
pub fn append_rows(
    ctx: &Ctx,
    w: &CompressorWeights,
    mut caches: Vec<Option<&mut CompressorCache>>,
    rows: &StepRows,
    xn: &Tensor,
    table: &RopeTable,
) {
    let backend = ctx.backend;
    let precision = ctx.cfg.precision();
    let kv = w.wkv.apply(backend, xn);
    let gate = w.wgate.apply(backend, xn);
    let half = w.series() * w.width;
    let pieces: Vec<(&Tensor, usize)> = (0..rows.positions.len())
        .flat_map(|t| [(&kv, t * half), (&gate, t * half)])
        .collect();
    let raw = backend.gather(&pieces, half);
    // (cache, entry) of every entry the step completes, in sequence then position order.
    let mut completed: Vec<(usize, usize)> = Vec::new();
    for (c, (span, cache)) in rows.spans.iter().zip(caches.iter_mut()).enumerate() {
        let Some(cache) = cache else { continue };
        for t in span.clone() {
            let position = rows.positions[t];
            cache
                .pending
                .push_at(position, raw.rows(t..t + 1, 2 * half));
            if (position + 1).is_multiple_of(w.ratio) {
                completed.push((c, position / w.ratio));
            }
        }
    }
    if completed.is_empty() {
        return;
    }
    let slots: Vec<Vec<PoolSlot<'_>>> = completed
        .iter()
        .map(|&(c, entry)| {
            caches[c]
                .as_deref()
                .map_or_else(Vec::new, |cache| entry_slots(w, cache, entry))
        })
        .collect();
    let pooled = backend.compressor_pool_rows(&slots, w.width);
    drop(slots);
    let normed = backend.rms_norm(&pooled, ctx.norm(&w.norm, precision));
    let starts: Vec<usize> = completed
        .iter()
        .map(|&(_, entry)| entry * w.ratio)
        .collect();
    let rotation = Rotation::new(table, &starts, precision);
    let rotated = backend.rope(normed, (w.width, 1), &rotation);
    for (&(c, _), entry) in completed.iter().zip(rotated.split_rows(w.width)) {
        if let Some(cache) = caches[c].as_deref_mut() {
            cache.entries.push(entry);
        }
    }
}

/// The slots of entry `entry`: the "A" half of the previous window (overlapping compressors),
/// then the entry's own window, each with its position bias.
fn entry_slots<'a>(
    w: &'a CompressorWeights,
    cache: &'a CompressorCache,
    entry: usize,
) -> Vec<PoolSlot<'a>> {
    let (ratio, half) = (w.ratio, w.series() * w.width);
    let bias = |j: usize| &w.ape[j * half..(j + 1) * half];
    let mut slots = Vec::with_capacity(2 * ratio);
    if w.overlapping && entry > 0 {
        for j in 0..ratio {
            if let Some(raw) = cache.pending.get((entry - 1) * ratio + j) {
                slots.push(PoolSlot {
                    raw,
                    offset: 0,
                    bias: bias(j),
                });
            }
        }
    }
    let own_series = if w.overlapping { w.width } else { 0 };
    for j in 0..ratio {
        if let Some(raw) = cache.pending.get(entry * ratio + j) {
            slots.push(PoolSlot {
                raw,
                offset: own_series,
                bias: bias(j),
            });
        }
    }
    slots
}

/// The indexer's selection for every query of the step (`qr`, `xn` its rows; sequence `e`'s rows
/// at `rows.spans[e]` score `states[e]`'s indexer keys): among the visible CSA entries
/// (`w < ⌊(t+1)/ratio⌋`), the `index_topk` with the highest `Σ_h ω_h · ReLU(q_h · k_w)`, ties to the
/// lower entry; ascending. One selection row per query of the step, in one backend op, where the
/// backend computed it.
pub fn select_rows(
    ctx: &Ctx,
    w: &IndexerWeights,
    states: &[&mut LayerState],
    qr: &Tensor,
    xn: &Tensor,
    rows: &StepRows,
    table: &RopeTable,
) -> Selection {
    let cfg = ctx.cfg;
    let backend = ctx.backend;
    let precision = cfg.precision();
    let (heads, head_dim) = (cfg.index_n_heads, cfg.index_head_dim);
    let rotation = Rotation::new(table, &rows.positions, precision);
    let q = backend.rope(w.wq_b.apply(backend, qr), (head_dim, heads), &rotation);
    let scale = (heads as f32).powf(-0.5) * (head_dim as f32).powf(-0.5);
    let head_weights = backend.scale_at(w.weights_proj.apply(backend, xn), scale, precision);
    let keys: Vec<&KeyList> = states
        .iter()
        .map(|state| {
            state
                .index
                .as_ref()
                .map_or(&NO_KEYS, |cache| &cache.entries)
        })
        .collect();
    let visible = rows.visible_entries(w.compressor.ratio);
    let parts = rows.select_parts(&keys, &visible);
    let queries = IndexQueries {
        q: &q,
        weights: &head_weights,
        head_dim,
        precision,
    };
    let from = SelectFrom {
        parts: &parts,
        k: cfg.index_topk,
        candidates: Candidates::None,
    };
    backend.select_rows(queries, from).0
}

/// The pooled entry `entry` of `cache` (the unit tests' view of
/// [`crate::backend::cpu::pool_entry`]).
#[cfg(test)]
fn pool(w: &CompressorWeights, cache: &CompressorCache, entry: usize) -> Vec<f32> {
    crate::backend::cpu::pool_entry(&entry_slots(w, cache, entry), w.width)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::weights::Linear;

    fn weights(ratio: usize, overlapping: bool, ape: Vec<f32>) -> CompressorWeights {
        let unused = Linear::Dense {
            out: 0,
            inp: 0,
            values: Vec::new(),
        };
        CompressorWeights {
            ratio,
            overlapping,
            width: 1,
            wkv: unused.clone(),
            wgate: unused,
            ape,
            norm: vec![1.0],
        }
    }

    /// `Σ softmax(logits) · values` in f64.
    fn softmax_pool(slots: &[(f64, f64)]) -> f32 {
        let max = slots.iter().fold(f64::NEG_INFINITY, |m, s| m.max(s.0));
        let sum: f64 = slots.iter().map(|s| (s.0 - max).exp()).sum();
        (slots.iter().map(|s| (s.0 - max).exp() * s.1).sum::<f64>() / sum) as f32
    }

    #[test]
    fn csa_entry_pools_previous_a_half_and_own_b_half_with_position_bias() {
        // ratio 2, width 1, two series: raw row = [kv_A, kv_B, gate_A, gate_B].
        let ape = vec![0.1, -0.2, 0.3, 0.4]; // [j][series]
        let w = weights(2, true, ape);
        let mut cache = CompressorCache::new(2, true);
        let rows = [
            [1.0f32, 2.0, 0.5, -0.5],
            [3.0, -1.0, 1.5, 0.25],
            [-2.0, 0.5, -1.0, 2.0],
            [4.0, 1.0, 0.0, 1.0],
        ];
        for (p, row) in rows.iter().enumerate() {
            cache.pending.push_at(p, Tensor::from(&row[..]));
        }
        // Entry 0 has no previous window: its B slots only.
        let first = pool(&w, &cache, 0);
        let expected = softmax_pool(&[(-0.5 - 0.2, 2.0), (0.25 + 0.4, -1.0)]);
        assert!(
            (first[0] - expected).abs() < 1e-6,
            "{first:?} vs {expected}"
        );
        // Entry 1: A slots of tokens 0, 1 and B slots of tokens 2, 3.
        let second = pool(&w, &cache, 1);
        let expected = softmax_pool(&[
            (0.5 + 0.1, 1.0),
            (1.5 + 0.3, 3.0),
            (2.0 - 0.2, 0.5),
            (1.0 + 0.4, 1.0),
        ]);
        assert!(
            (second[0] - expected).abs() < 1e-6,
            "{second:?} vs {expected}"
        );
    }

    #[test]
    fn hca_entry_pools_only_its_own_window() {
        let w = weights(2, false, vec![0.5, -0.5]);
        let mut cache = CompressorCache::new(2, false);
        for (p, row) in [[9.0f32, 3.0], [7.0, -3.0], [1.0, 0.0], [5.0, 1.0]]
            .iter()
            .enumerate()
        {
            cache.pending.push_at(p, Tensor::from(&row[..]));
        }
        let entry = pool(&w, &cache, 1);
        let expected = softmax_pool(&[(0.5, 1.0), (0.5, 5.0)]);
        assert!(
            (entry[0] - expected).abs() < 1e-6,
            "{entry:?} vs {expected}"
        );
    }
}
