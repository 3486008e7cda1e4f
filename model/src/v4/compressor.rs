//! The V4 compressed branch (spec v4-architecture.md §2.7, §2.8): gated softmax pooling of `ratio`
//! tokens per entry (HCA: one series; CSA and its indexer: two overlapping series, the entry of
//! window w pooling the "A" half of window w−1 and the "B" half of window w), RMSNorm and RoPE at
//! the entry's first position; and the Lightning Indexer's top-k selection of CSA entries.

use super::state::CompressorCache;
use super::weights::{CompressorWeights, IndexerWeights};
use crate::backend::RopeTable;
use crate::quant::exp_f32;
use crate::v41::Ctx;
use crate::v41::csa::top_k_lowest_index;

/// Appends the chunk's raw `kv ‖ gate` rows to `cache` and emits every entry completed by them.
pub fn append_chunk(
    ctx: &Ctx,
    w: &CompressorWeights,
    cache: &mut CompressorCache,
    xn: &[f32],
    positions: &[usize],
    table: &RopeTable,
) {
    let kv = w.wkv.apply(ctx.backend, xn);
    let gate = w.wgate.apply(ctx.backend, xn);
    let row = w.series() * w.width;
    let precision = ctx.cfg.precision();
    for (t, &position) in positions.iter().enumerate() {
        let mut raw = kv[t * row..(t + 1) * row].to_vec();
        raw.extend_from_slice(&gate[t * row..(t + 1) * row]);
        cache.pending.push_at(position, raw);
        if !(position + 1).is_multiple_of(w.ratio) {
            continue;
        }
        let entry = position / w.ratio;
        let pooled = pool(w, cache, entry);
        let normed = ctx
            .backend
            .rms_norm_at(&pooled.into(), &w.norm, ctx.cfg.norm_eps, precision);
        let normed = ctx.backend.rope_at(
            normed,
            w.width,
            1,
            &[entry * w.ratio],
            table,
            false,
            precision,
        );
        cache.entries.push(normed.into_vec());
    }
}

/// The pooled (pre-norm) entry `entry`: per channel, a softmax over its slots of `gate + ape`
/// weighting the slots' `kv`.
fn pool(w: &CompressorWeights, cache: &CompressorCache, entry: usize) -> Vec<f32> {
    let (ratio, width) = (w.ratio, w.width);
    let row = w.series() * width;
    // (raw row, column offset of this slot's series) of every slot, with its bias row.
    let mut slots: Vec<(&[f32], usize, &[f32])> = Vec::with_capacity(2 * ratio);
    let own_series = if w.overlapping { width } else { 0 };
    if w.overlapping && entry > 0 {
        for j in 0..ratio {
            if let Some(raw) = cache.pending.get((entry - 1) * ratio + j) {
                slots.push((&raw[..], 0, &w.ape[j * row..(j + 1) * row]));
            }
        }
    }
    for j in 0..ratio {
        if let Some(raw) = cache.pending.get(entry * ratio + j) {
            slots.push((&raw[..], own_series, &w.ape[j * row..(j + 1) * row]));
        }
    }
    let mut logits = vec![0.0f32; slots.len()];
    (0..width)
        .map(|c| {
            for (logit, (raw, offset, ape)) in logits.iter_mut().zip(&slots) {
                *logit = raw[row + offset + c] + ape[offset + c];
            }
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0.0f32;
            let mut value = 0.0f32;
            for (logit, (raw, offset, _)) in logits.iter().zip(&slots) {
                let e = exp_f32(logit - max);
                sum += e;
                value += e * raw[offset + c];
            }
            value / sum
        })
        .collect()
}

/// The indexer's selection for every query of a chunk: among the visible CSA entries
/// (`w < ⌊(t+1)/ratio⌋`), the `index_topk` with the highest `Σ_h ω_h · ReLU(q_h · k_w)`, ties to the
/// lower entry; ascending.
pub fn select_chunk(
    ctx: &Ctx,
    w: &IndexerWeights,
    keys: &[Vec<f32>],
    qr: &[f32],
    xn: &[f32],
    positions: &[usize],
    table: &RopeTable,
) -> Vec<Vec<usize>> {
    let cfg = ctx.cfg;
    let precision = cfg.precision();
    let (heads, head_dim) = (cfg.index_n_heads, cfg.index_head_dim);
    let q = ctx.backend.rope_at(
        w.wq_b.apply(ctx.backend, qr).into(),
        head_dim,
        heads,
        positions,
        table,
        false,
        precision,
    );
    let scale = (heads as f32).powf(-0.5) * (head_dim as f32).powf(-0.5);
    let head_weights: Vec<f32> = w
        .weights_proj
        .apply(ctx.backend, xn)
        .iter()
        .map(|v| v * scale)
        .collect();
    let flat_keys: Vec<f32> = keys.iter().flatten().copied().collect();
    let row = heads * head_dim;
    positions
        .iter()
        .enumerate()
        .map(|(t, &position)| {
            let visible = ((position + 1) / w.compressor.ratio).min(keys.len());
            let scores = ctx.backend.index_scores_at(
                &q[t * row..(t + 1) * row],
                &head_weights[t * heads..(t + 1) * heads],
                &flat_keys[..visible * head_dim],
                head_dim,
                precision,
            );
            top_k_lowest_index(&scores, cfg.index_topk.min(visible))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v4::weights::Linear;

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
            cache.pending.push_at(p, row.to_vec());
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
            cache.pending.push_at(p, row.to_vec());
        }
        let entry = pool(&w, &cache, 1);
        let expected = softmax_pool(&[(0.5, 1.0), (0.5, 5.0)]);
        assert!(
            (entry[0] - expected).abs() < 1e-6,
            "{entry:?} vs {expected}"
        );
    }
}
