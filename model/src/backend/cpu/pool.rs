//! Gated softmax pooling, the reference of the compressors' pooling ops: V4.1's
//! ([`crate::backend::Backend::gated_pool_rows`]) and V4's with a position bias
//! ([`crate::backend::Backend::compressor_pool_rows`]).

use crate::backend::PoolSlot;
use crate::quant::{exp_f32, round_bf16};

/// Gated pooling of channel `c` over a group's `kv ‖ gate` rows: softmax of the gates over the
/// group, the weighted sum of the values, bf16 ([`Backend::gated_pool_rows`]).
pub(super) fn pool_channel(members: &[&[f32]], head_dim: usize, c: usize) -> f32 {
    let max = members
        .iter()
        .fold(f32::NEG_INFINITY, |m, r| m.max(r[head_dim + c]));
    let exps: Vec<f32> = members
        .iter()
        .map(|r| (r[head_dim + c] - max).exp())
        .collect();
    let sum = exps.iter().fold(0.0f32, |a, e| a + e);
    let value = members
        .iter()
        .zip(&exps)
        .fold(0.0f32, |a, (r, e)| a + r[c] * (e / sum));
    round_bf16(value)
}

/// One pooled (pre-norm) entry `[width]` of its `slots`: per channel, a softmax over the slots of
/// `gate + bias` weighting the slots' `kv`.
pub fn pool_entry(slots: &[PoolSlot<'_>], width: usize) -> Vec<f32> {
    let mut logits = vec![0.0f32; slots.len()];
    (0..width)
        .map(|c| {
            for (logit, slot) in logits.iter_mut().zip(slots) {
                let half = slot.raw.len() / 2;
                *logit = slot.raw[half + slot.offset + c] + slot.bias[slot.offset + c];
            }
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0.0f32;
            let mut value = 0.0f32;
            for (logit, slot) in logits.iter().zip(slots) {
                let e = exp_f32(logit - max);
                sum += e;
                value += e * slot.raw[slot.offset + c];
            }
            value / sum
        })
        .collect()
}
