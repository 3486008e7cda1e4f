//! The aligner (spec §4.2): the ViT features on their `[n_vit_h, n_vit_w]` grid, zero-padded at
//! the bottom/right to multiples of `r`, are cut into `r × r` cells (a pixel-unshuffle: each cell
//! one vector ordered (channel, cell row, cell column), cells in reading order) and projected by a
//! two-layer MLP with an erf GELU to one LM embedding row per cell (bf16 after each op).

use super::preprocess::ImageGrid;
use super::vit::BiasedLinear;
use crate::checkpoint::Checkpoint;
use crate::config::VisionConfig;
use crate::error::ModelError;
use crate::quant::{exp_f32, round_bf16};

/// The projector's parameters.
#[derive(Debug, Clone)]
pub struct AlignerWeights {
    pub ratio: usize,
    /// `[dim, vision_dim · r²]` + bias.
    pub w1: BiasedLinear,
    /// `[dim, dim]` + bias.
    pub w2: BiasedLinear,
}

impl AlignerWeights {
    /// Loads `aligner.w1/w2.{weight,bias}` for an LM of width `dim`.
    pub fn load(
        ckpt: &Checkpoint,
        cfg: &VisionConfig,
        dim: usize,
    ) -> Result<AlignerWeights, ModelError> {
        let r = cfg.downsample_ratio;
        Ok(AlignerWeights {
            ratio: r,
            w1: BiasedLinear::load(ckpt, "aligner.w1", dim, cfg.dim * r * r, true)?,
            w2: BiasedLinear::load(ckpt, "aligner.w2", dim, dim, true)?,
        })
    }

    /// ViT features `[n_vit_h · n_vit_w, vision_dim]` → `[n_llm_h · n_llm_w, dim]` bf16 rows.
    pub fn forward(&self, features: &[f32], grid: &ImageGrid) -> Vec<f32> {
        let cells = unfold_cells(features, grid, self.ratio);
        let hidden: Vec<f32> = self.w1.apply(&cells).into_iter().map(gelu_bf16).collect();
        self.w2.apply(&hidden)
    }
}

/// The `r × r` cells of the zero-padded feature grid, each `[channel, cell row, cell column]`.
pub fn unfold_cells(features: &[f32], grid: &ImageGrid, ratio: usize) -> Vec<f32> {
    let channels = features.len() / grid.n_patches().max(1);
    let n_llm_h = grid.n_vit_h.div_ceil(ratio);
    let n_llm_w = grid.n_vit_w.div_ceil(ratio);
    let mut cells = Vec::with_capacity(n_llm_h * n_llm_w * channels * ratio * ratio);
    for cell_row in 0..n_llm_h {
        for cell_col in 0..n_llm_w {
            for c in 0..channels {
                for dy in 0..ratio {
                    for dx in 0..ratio {
                        let (y, x) = (cell_row * ratio + dy, cell_col * ratio + dx);
                        cells.push(if y < grid.n_vit_h && x < grid.n_vit_w {
                            features[(y * grid.n_vit_w + x) * channels + c]
                        } else {
                            0.0
                        });
                    }
                }
            }
        }
    }
    cells
}

/// `erf` in fp32 as torch's vectorised CPU kernel computes it (Abramowitz-Stegun 7.1.26 with
/// fused multiply-adds and the vectorised `exp`).
fn erf_f32(x: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_8,
        -1.453_152,
        1.061_405_4,
    ];
    let sign = x.is_sign_negative();
    let ax = x.abs();
    let t = 1.0 / P.mul_add(ax, 1.0);
    let r = A[4]
        .mul_add(t, A[3])
        .mul_add(t, A[2])
        .mul_add(t, A[1])
        .mul_add(t, A[0]);
    let e = -exp_f32(-(x * x));
    let y = (e * t).mul_add(r, 1.0);
    if sign { -y } else { y }
}

/// `bf16(x · 0.5 · (1 + erf(x / √2)))` (torch's exact GELU on bf16 input, in fp32).
fn gelu_bf16(x: f32) -> f32 {
    let alpha = std::f32::consts::FRAC_1_SQRT_2;
    round_bf16(x * 0.5 * (1.0 + erf_f32(x * alpha)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unfold_pads_with_zeros_and_orders_channel_row_column() {
        // 2×4 grid, 2 channels, value = 100·y + 10·x + c; r = 3 → 1×2 cells.
        let grid = ImageGrid {
            width: 56,
            height: 28,
            n_vit_h: 2,
            n_vit_w: 4,
            n_llm_h: 1,
            n_llm_w: 2,
        };
        let features: Vec<f32> = (0..2)
            .flat_map(|y| {
                (0..4).flat_map(move |x| (0..2).map(move |c| (100 * y + 10 * x + c) as f32))
            })
            .collect();
        let cells = unfold_cells(&features, &grid, 3);
        assert_eq!(cells.len(), 2 * 2 * 9);
        // Cell 0, channel 1: rows 0..3 × columns 0..3; row 2 is padding.
        assert_eq!(
            cells[9..18],
            [1.0, 11.0, 21.0, 101.0, 111.0, 121.0, 0.0, 0.0, 0.0]
        );
        // Cell 1, channel 0: column 3 only, then padding.
        assert_eq!(
            cells[18..27],
            [30.0, 0.0, 0.0, 130.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        );
    }

    #[test]
    fn erf_is_within_the_approximation_error() {
        for i in -400..=400 {
            let x = i as f32 / 100.0;
            let exact = libm_erf(f64::from(x));
            let error = (f64::from(erf_f32(x)) - exact).abs();
            // The approximation itself is within 1.5e-7; fp32 evaluation adds a few ulps of 1.
            assert!(error < 5e-7, "erf({x}): error {error:e}");
        }
        assert_eq!(gelu_bf16(0.0), 0.0);
        assert_eq!(gelu_bf16(10.0), 10.0);
    }

    /// erf in f64 by its Maclaurin series (|x| ≤ 4 converges well in f64 with enough terms).
    fn libm_erf(x: f64) -> f64 {
        let mut term = x;
        let mut sum = x;
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }
}
