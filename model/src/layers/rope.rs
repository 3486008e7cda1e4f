//! RoPE frequency tables (spec §3.8): the main table (θ = `rope_theta`, no YaRN) for window-only
//! layers and DSpark stages, and the compressed table (θ = `compress_rope_theta` with YaRN) for
//! every layer with a compression ratio. Computed in fp32 exactly as the reference does.

use crate::backend::RopeTable;
use crate::config::{ModelConfig, YarnConfig};

/// Frequencies `1 / base^(2i / rope_dim)` with the optional YaRN blend, all in fp32.
pub fn rope_table(rope_dim: usize, base: f64, yarn: Option<&YarnConfig>) -> RopeTable {
    let pairs = rope_dim / 2;
    let base32 = base as f32;
    let mut freqs: Vec<f32> = (0..pairs)
        .map(|i| 1.0f32 / base32.powf((2 * i) as f32 / rope_dim as f32))
        .collect();
    if let Some(yarn) = yarn {
        let dim = rope_dim as f64;
        let corrected_dim = |rotations: f64| {
            dim * (yarn.original_max_position as f64 / (rotations * 2.0 * std::f64::consts::PI))
                .ln()
                / (2.0 * base.ln())
        };
        let low = corrected_dim(yarn.beta_fast).floor().max(0.0);
        let high = corrected_dim(yarn.beta_slow).ceil().min(dim - 1.0);
        let span = (high - low).max(1e-3) as f32;
        let factor = yarn.factor as f32;
        for (i, freq) in freqs.iter_mut().enumerate() {
            let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
            let smooth = 1.0 - ramp;
            *freq = *freq / factor * (1.0 - smooth) + *freq * smooth;
        }
    }
    RopeTable { freqs }
}

/// The two tables a V4.1 model uses.
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// Window-only layers and DSpark stages.
    pub main: RopeTable,
    /// Layers with a compression ratio (their q, window KV, latents and index q/k).
    pub compressed: RopeTable,
}

impl RopeTables {
    pub fn new(cfg: &ModelConfig) -> RopeTables {
        RopeTables {
            main: rope_table(cfg.rope_head_dim, cfg.rope.theta, None),
            compressed: rope_table(
                cfg.rope_head_dim,
                cfg.rope.compress_theta,
                cfg.rope.yarn.as_ref(),
            ),
        }
    }

    /// The table of backbone layer `layer`.
    pub fn for_layer(&self, cfg: &ModelConfig, layer: usize) -> &RopeTable {
        if cfg.compress_ratio(layer) > 0 {
            &self.compressed
        } else {
            &self.main
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_keeps_fast_pairs_and_divides_slow_pairs() {
        let yarn = YarnConfig {
            factor: 16.0,
            original_max_position: 65536,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let plain = rope_table(64, 160000.0, None);
        let scaled = rope_table(64, 160000.0, Some(&yarn));
        // spec §3.8: low = 15, high = 25 for the real config.
        for i in 0..=15 {
            assert_eq!(scaled.freqs[i], plain.freqs[i], "pair {i}");
        }
        for i in 25..32 {
            assert_eq!(scaled.freqs[i], plain.freqs[i] / 16.0, "pair {i}");
        }
        assert!(scaled.freqs[20] < plain.freqs[20] && scaled.freqs[20] > plain.freqs[20] / 16.0);
    }
}
