//! The Engram gate and injection (spec §3.7 "Gate and injection"): from one token's `kv` (one key
//! per hc stream plus a shared value), a per-stream sigmoid gate of the normalised
//! stream·(q⊙k)·key dot product, then `X_k ← bf16(X_k + gate_k · value)`.

use crate::quant::{exp_f32, round_bf16, sum_f32_torch, sum_squares_f32_torch};

/// Gate floor under the signed square root.
const GATE_CLAMP: f32 = 1e-6;

/// The gate's parameters for one engram layer.
#[derive(Debug, Clone, PartialEq)]
pub struct EngramGate {
    dim: usize,
    hc_mult: usize,
    /// `fp32(q_weight) ⊙ fp32(k_weight)`, `[hc_mult, dim]`.
    weight: Vec<f32>,
    /// RMS epsilon (`norm_eps`).
    eps: f32,
}

/// `mean(x²)` in fp32, summed in the reference's torch order.
fn mean_square(xs: &[f32]) -> f32 {
    sum_squares_f32_torch(xs) / xs.len() as f32
}

impl EngramGate {
    /// `q_weight`, `k_weight` are `[hc_mult, dim]` bf16 values; only their product is kept.
    /// Returns `None` when either slice is not `hc_mult · dim` long.
    pub fn new(
        dim: usize,
        hc_mult: usize,
        q_weight: &[f32],
        k_weight: &[f32],
        eps: f32,
    ) -> Option<EngramGate> {
        if dim == 0 || q_weight.len() != hc_mult * dim || k_weight.len() != hc_mult * dim {
            return None;
        }
        let weight = q_weight.iter().zip(k_weight).map(|(q, k)| q * k).collect();
        Some(EngramGate {
            dim,
            hc_mult,
            weight,
            eps,
        })
    }

    /// Values per stream.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Streams per token.
    pub fn hc_mult(&self) -> usize {
        self.hc_mult
    }

    /// `fp32(q_weight) ⊙ fp32(k_weight)`, `[hc_mult, dim]`.
    pub fn weight(&self) -> &[f32] {
        &self.weight
    }

    /// The RMS epsilon.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// The gate of every stream of one token: `streams` `[hc_mult, dim]`, `kv` `[(hc_mult+1)·dim]`
    /// (keys first). `sigmoid(sign(d)·sqrt(max(|d|, 1e-6)))` with
    /// `d = Σ(h·w·key) · rsqrt(mean h² + ε) · rsqrt(mean key² + ε) / √dim`, all fp32, the sums in
    /// the reference's torch order and the sigmoid's `exp` its vectorised one ([`exp_f32`]).
    pub fn gates(&self, streams: &[f32], kv: &[f32]) -> Vec<f32> {
        let inv_sqrt_dim = (self.dim as f64).powf(-0.5) as f32;
        (0..self.hc_mult)
            .map(|k| {
                let range = k * self.dim..(k + 1) * self.dim;
                let (h, key, w) = (
                    &streams[range.clone()],
                    &kv[range.clone()],
                    &self.weight[range],
                );
                let rstd = (1.0 / (mean_square(h) + self.eps).sqrt())
                    * (1.0 / (mean_square(key) + self.eps).sqrt());
                let products: Vec<f32> = h
                    .iter()
                    .zip(w)
                    .zip(key)
                    .map(|((&h, &w), &key)| h * w * key)
                    .collect();
                let dot = sum_f32_torch(&products) * rstd * inv_sqrt_dim;
                let signed_root = dot.abs().max(GATE_CLAMP).sqrt().copysign(dot);
                1.0 / (1.0 + exp_f32(-signed_root))
            })
            .collect()
    }

    /// Injects one live token: `streams[k] ← bf16(streams[k] + gate_k · value)`.
    pub fn inject(&self, streams: &mut [f32], kv: &[f32]) {
        let gates = self.gates(streams, kv);
        let value = &kv[self.hc_mult * self.dim..(self.hc_mult + 1) * self.dim];
        for (stream, gate) in streams.chunks_exact_mut(self.dim).zip(gates) {
            for (x, &v) in stream.iter_mut().zip(value) {
                *x = round_bf16(*x + gate * v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_of_aligned_and_opposed_keys() {
        // dim 4, 2 streams, unit weights. Stream 0 equals its key, stream 1's key is its
        // negation.
        let dim = 4;
        let gate = EngramGate::new(dim, 2, &[1.0; 8], &[1.0; 8], 1e-20).expect("shapes match");
        let streams = [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        let mut kv = vec![1.0, 2.0, 3.0, 4.0, -1.0, -2.0, -3.0, -4.0];
        kv.extend([0.5; 4]);
        // d = Σx² / rms(x)² / √dim = dim / √dim = 2 for stream 0, −2 for stream 1.
        let expected = 1.0 / (1.0 + (-(2.0_f32).sqrt()).exp());
        let gates = gate.gates(&streams, &kv);
        assert!((gates[0] - expected).abs() < 1e-6, "{gates:?}");
        assert!((gates[1] - (1.0 - expected)).abs() < 1e-6, "{gates:?}");

        let mut injected = streams;
        gate.inject(&mut injected, &kv);
        assert_eq!(injected[0], round_bf16(1.0 + gates[0] * 0.5));
        assert_eq!(injected[7], round_bf16(4.0 + gates[1] * 0.5));
        assert!(EngramGate::new(dim, 2, &[1.0; 7], &[1.0; 8], 1e-20).is_none());
    }
}
