//! Image preprocessing (spec §4.3): the resize plan (a pure function of the image size), the
//! aspect-preserving letterbox into the planned size (PIL's `ImageOps.pad` with its bicubic
//! resampling in 8-bit fixed point, gray 127 padding), and the normalised bf16 patches the ViT
//! takes, `(x / 255 − 0.5) / 0.5` in `[n_vit_h · n_vit_w, 3, p, p]` row-major patch order.

use super::VisionError;
use crate::config::VisionConfig;
use crate::quant::round_bf16;

/// An RGB image: `pixels` is `[height, width, 3]` bytes, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInput {
    pub pixels: Vec<u8>,
    pub width: usize,
    pub height: usize,
}

/// The planned pixel size of an image and its ViT / LM grids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageGrid {
    /// Pixel width and height after the letterbox (multiples of the patch size).
    pub width: usize,
    pub height: usize,
    pub n_vit_h: usize,
    pub n_vit_w: usize,
    pub n_llm_h: usize,
    pub n_llm_w: usize,
}

impl ImageGrid {
    /// LM positions of the image's span: `n_llm_h · (n_llm_w + 1) + 2`.
    pub fn span_len(&self) -> usize {
        span_len(self.n_llm_h, self.n_llm_w)
    }

    /// ViT patches.
    pub fn n_patches(&self) -> usize {
        self.n_vit_h * self.n_vit_w
    }

    /// Aligner cells (IMAGE positions).
    pub fn n_cells(&self) -> usize {
        self.n_llm_h * self.n_llm_w
    }
}

/// An image ready for the ViT.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedImage {
    pub grid: ImageGrid,
    /// `[n_patches, 3, p, p]` bf16 values.
    pub patches: Vec<f32>,
}

fn span_len(n_llm_h: usize, n_llm_w: usize) -> usize {
    n_llm_h * (n_llm_w + 1) + 2
}

/// The LM grid of a planned pixel size: `ceil((side / p) / r)` per side, as (rows, columns).
fn llm_grid(best_height: f64, best_width: f64, patch: f64, ratio: f64) -> (usize, usize) {
    let cells = |side: f64| ((side / patch).floor() / ratio).ceil() as usize;
    (cells(best_height), cells(best_width))
}

/// The largest aspect-preserving pixel size (height, width) whose span fits in `max_tokens`.
fn solve_resize_ratio(
    height: f64,
    width: f64,
    patch: f64,
    ratio: f64,
    max_tokens: f64,
) -> (f64, f64) {
    let aspect = height / width;
    let max_w = ((max_tokens - 2.0) / aspect + 0.25).sqrt() - 0.5;
    let max_h = max_w * aspect;
    let cell = patch * ratio;
    if max_w < 1.0 {
        // Very tall: one column.
        return (((max_tokens - 2.0) / 2.0).floor() * cell, cell);
    }
    if max_h < 1.0 {
        // Very wide: one row.
        return (cell, (max_tokens - 3.0) * cell);
    }
    let beta = (max_w.floor() * cell / width).min(max_h.floor() * cell / height);
    (
        (height * beta / patch).floor() * patch,
        (width * beta / patch).floor() * patch,
    )
}

/// The resize plan of an image of `width × height` pixels (spec §4.3 steps 1-3): clamp the aspect
/// ratio if the config says so, upscale below `min_pixels`, round each side up to whole patches,
/// and shrink aspect-preservingly when the span would exceed `max_image_tokens`.
pub fn plan_image_grid(
    width: usize,
    height: usize,
    cfg: &VisionConfig,
) -> Result<ImageGrid, VisionError> {
    if width == 0 || height == 0 {
        return Err(VisionError::EmptyImage { width, height });
    }
    let patch = cfg.patch_size as f64;
    let ratio = cfg.downsample_ratio as f64;
    let (mut w, mut h) = (width as f64, height as f64);
    if let Some(max_ratio) = cfg.max_wh_ratio
        && w > h * max_ratio
    {
        w = h * max_ratio;
    }
    let min_pixels = cfg.min_pixels as f64;
    if w * h < min_pixels {
        let scale = (min_pixels / (w * h)).sqrt();
        w = (w * scale).trunc();
        h = (h * scale).trunc();
    }
    let mut best_w = (w / patch).ceil() * patch;
    let mut best_h = (h / patch).ceil() * patch;
    let (mut n_llm_h, mut n_llm_w) = llm_grid(best_h, best_w, patch, ratio);
    if span_len(n_llm_h, n_llm_w) > cfg.max_image_tokens {
        (best_h, best_w) = solve_resize_ratio(h, w, patch, ratio, cfg.max_image_tokens as f64);
        (n_llm_h, n_llm_w) = llm_grid(best_h, best_w, patch, ratio);
    }
    let (best_w, best_h) = (best_w as usize, best_h as usize);
    Ok(ImageGrid {
        width: best_w,
        height: best_h,
        n_vit_h: best_h / cfg.patch_size,
        n_vit_w: best_w / cfg.patch_size,
        n_llm_h,
        n_llm_w,
    })
}

/// An RGB image buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rgb {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

/// Fixed-point fraction bits of PIL's 8-bit resampling coefficients.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The bicubic kernel (a = −0.5) with support 2.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output pixel: the first input pixel and the fixed-point weights of the inputs from there
/// (an antialiased bicubic filter when shrinking).
fn resample_weights(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i64>)> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C casts truncate toward zero.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let weights: Vec<f64> = (xmin..xmax)
                .map(|x| bicubic((x as f64 - center + 0.5) / filter_scale))
                .collect();
            let total: f64 = weights.iter().sum();
            let one = f64::from(1u32 << PRECISION_BITS);
            let fixed = weights
                .iter()
                .map(|&w| {
                    let w = if total != 0.0 { w / total } else { w };
                    if w < 0.0 {
                        (-0.5 + w * one) as i64
                    } else {
                        (0.5 + w * one) as i64
                    }
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

/// A fixed-point accumulator back to a byte.
fn clip8(v: i64) -> u8 {
    if v >= 1 << (PRECISION_BITS + 8) {
        255
    } else if v <= 0 {
        0
    } else {
        (v >> PRECISION_BITS) as u8
    }
}

/// One resampling pass along x (`horizontal`) or y.
fn resample_pass(image: &Rgb, out_size: usize, horizontal: bool) -> Rgb {
    let (width, height) = if horizontal {
        (out_size, image.height)
    } else {
        (image.width, out_size)
    };
    let in_size = if horizontal {
        image.width
    } else {
        image.height
    };
    let weights = resample_weights(in_size, out_size);
    let mut pixels = vec![0u8; width * height * 3];
    for y in 0..height {
        for x in 0..width {
            let (first, k) = &weights[if horizontal { x } else { y }];
            for c in 0..3 {
                let mut acc: i64 = 1 << (PRECISION_BITS - 1);
                for (i, &w) in k.iter().enumerate() {
                    let (sx, sy) = if horizontal {
                        (first + i, y)
                    } else {
                        (x, first + i)
                    };
                    acc += i64::from(image.pixels[(sy * image.width + sx) * 3 + c]) * w;
                }
                pixels[(y * width + x) * 3 + c] = clip8(acc);
            }
        }
    }
    Rgb {
        width,
        height,
        pixels,
    }
}

/// PIL's bicubic `resize`: a horizontal pass then a vertical one, each only when that side changes.
fn resize(image: &Rgb, width: usize, height: usize) -> Rgb {
    let mut out = image.clone();
    if width != out.width {
        out = resample_pass(&out, width, true);
    }
    if height != out.height {
        out = resample_pass(&out, height, false);
    }
    out
}

/// Gray of the letterbox padding.
const PAD_GRAY: u8 = 127;

/// PIL's `ImageOps.pad`: resize preserving the aspect ratio so the image fits `width × height`,
/// then paste it centred on gray (offsets rounded half to even, as Python's `round`).
fn letterbox(image: &Rgb, width: usize, height: usize) -> Rgb {
    let image_ratio = image.width as f64 / image.height as f64;
    let target_ratio = width as f64 / height as f64;
    if image_ratio == target_ratio {
        return resize(image, width, height);
    }
    let mut out = Rgb {
        width,
        height,
        pixels: vec![PAD_GRAY; width * height * 3],
    };
    let (fitted, x0, y0) = if image_ratio > target_ratio {
        let new_height =
            (image.height as f64 / image.width as f64 * width as f64).round_ties_even() as usize;
        let fitted = resize(image, width, new_height);
        let y0 = ((height as f64 - new_height as f64) * 0.5).round_ties_even();
        (fitted, 0i64, y0 as i64)
    } else {
        let new_width =
            (image.width as f64 / image.height as f64 * height as f64).round_ties_even() as usize;
        let fitted = resize(image, new_width, height);
        let x0 = ((width as f64 - new_width as f64) * 0.5).round_ties_even();
        (fitted, x0 as i64, 0i64)
    };
    // Paste, clipping whatever falls outside (PIL's paste does the same).
    for y in 0..fitted.height {
        let ty = y as i64 + y0;
        if ty < 0 || ty >= height as i64 {
            continue;
        }
        for x in 0..fitted.width {
            let tx = x as i64 + x0;
            if tx < 0 || tx >= width as i64 {
                continue;
            }
            let to = (ty as usize * width + tx as usize) * 3;
            let from = (y * fitted.width + x) * 3;
            out.pixels[to..to + 3].copy_from_slice(&fitted.pixels[from..from + 3]);
        }
    }
    out
}

/// Letterboxed RGB bytes `[grid.height, grid.width, 3]` of `image` at its planned size.
pub fn letterboxed_pixels(image: &ImageInput, grid: &ImageGrid) -> Result<Vec<u8>, VisionError> {
    fitted_pixels(image, grid, false)
}

/// `image` at its planned size: letterboxed, or stretched (`stretch`, an image at or beyond the
/// config's `max_wh_ratio`).
fn fitted_pixels(
    image: &ImageInput,
    grid: &ImageGrid,
    stretch: bool,
) -> Result<Vec<u8>, VisionError> {
    let expected = image
        .width
        .checked_mul(image.height)
        .and_then(|pixels| pixels.checked_mul(3))
        .unwrap_or(usize::MAX);
    if image.width == 0 || image.height == 0 {
        return Err(VisionError::EmptyImage {
            width: image.width,
            height: image.height,
        });
    }
    if image.pixels.len() != expected {
        return Err(VisionError::PixelBuffer {
            width: image.width,
            height: image.height,
            expected,
            found: image.pixels.len(),
        });
    }
    let rgb = Rgb {
        width: image.width,
        height: image.height,
        pixels: image.pixels.clone(),
    };
    Ok(if stretch {
        resize(&rgb, grid.width, grid.height).pixels
    } else {
        letterbox(&rgb, grid.width, grid.height).pixels
    })
}

/// Plans, fits (letterboxes, or stretches beyond `max_wh_ratio`), normalises and cuts `image`
/// into patches.
pub fn prepare(image: &ImageInput, cfg: &VisionConfig) -> Result<PreparedImage, VisionError> {
    let grid = plan_image_grid(image.width, image.height, cfg)?;
    let stretch = cfg
        .max_wh_ratio
        .is_some_and(|ratio| image.width as f64 >= ratio * image.height as f64);
    let pixels = fitted_pixels(image, &grid, stretch)?;
    Ok(PreparedImage {
        patches: patchify(&pixels, &grid, cfg.patch_size),
        grid,
    })
}

/// `bf16((x / 255 − 0.5) / 0.5)` of every byte of a `[height, width, 3]` image at its planned
/// size, cut into `[n_patches, 3, p, p]` with patches in row-major order.
pub fn patchify(pixels: &[u8], grid: &ImageGrid, patch: usize) -> Vec<f32> {
    let normalise = |byte: u8| round_bf16((f32::from(byte) / 255.0 - 0.5) / 0.5);
    let mut patches = Vec::with_capacity(grid.n_patches() * 3 * patch * patch);
    for ph in 0..grid.n_vit_h {
        for pw in 0..grid.n_vit_w {
            for c in 0..3 {
                for row in 0..patch {
                    let y = ph * patch + row;
                    for col in 0..patch {
                        let x = pw * patch + col;
                        patches.push(normalise(pixels[(y * grid.width + x) * 3 + c]));
                    }
                }
            }
        }
    }
    patches
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real checkpoint's vision config (spec §4.3: `p = 14`, `r = 3`, 1024 tokens, 544²).
    fn real_config() -> VisionConfig {
        VisionConfig {
            n_layers: 32,
            dim: 1024,
            n_heads: 16,
            inter_dim: 2816,
            patch_size: 14,
            rope_theta: 10000.0,
            downsample_ratio: 3,
            max_image_tokens: 1024,
            min_pixels: 544 * 544,
            max_wh_ratio: None,
        }
    }

    #[test]
    fn plan_matches_the_spec_token_counts() {
        let cfg = real_config();
        // (width, height) → (best width, best height, n_llm_h, n_llm_w, span tokens).
        for ((w, h), (bw, bh, lh, lw, tokens)) in [
            ((640, 480), (644, 490, 12, 16, 206)),
            ((1920, 1080), (1708, 966, 23, 41, 968)),
            ((4096, 4096), (1302, 1302, 31, 31, 994)),
            ((100, 100), (546, 546, 13, 13, 184)),
        ] {
            let grid = plan_image_grid(w, h, &cfg).expect("plan");
            assert_eq!(
                (
                    grid.width,
                    grid.height,
                    grid.n_llm_h,
                    grid.n_llm_w,
                    grid.span_len()
                ),
                (bw, bh, lh, lw, tokens),
                "{w}×{h}"
            );
            assert_eq!(grid.n_vit_w * 14, grid.width);
        }
        // Degenerate aspect ratios collapse to one column / one row and still fit.
        let tall = plan_image_grid(10, 100_000, &cfg).expect("tall");
        assert_eq!(tall.n_llm_w, 1);
        assert!(tall.span_len() <= 1024);
        let wide = plan_image_grid(100_000, 10, &cfg).expect("wide");
        assert_eq!(wide.n_llm_h, 1);
        assert!(wide.span_len() <= 1024);
        assert!(matches!(
            plan_image_grid(0, 5, &cfg),
            Err(VisionError::EmptyImage { .. })
        ));
    }

    #[test]
    fn letterbox_centres_a_resized_image_on_gray() {
        // 40×20 of one colour into 28×28: fitted 28×14, pasted at y = 7.
        let colour = [200u8, 30, 90];
        let image = ImageInput {
            pixels: colour.repeat(40 * 20),
            width: 40,
            height: 20,
        };
        let grid = ImageGrid {
            width: 28,
            height: 28,
            n_vit_h: 2,
            n_vit_w: 2,
            n_llm_h: 1,
            n_llm_w: 1,
        };
        let out = letterboxed_pixels(&image, &grid).expect("letterbox");
        for y in 0..28 {
            let expect = if (7..21).contains(&y) {
                colour
            } else {
                [PAD_GRAY; 3]
            };
            for x in 0..28 {
                assert_eq!(
                    out[(y * 28 + x) * 3..(y * 28 + x) * 3 + 3],
                    expect,
                    "({x}, {y})"
                );
            }
        }
        // A valid size is left untouched.
        let gradient: Vec<u8> = (0..28 * 14 * 3).map(|i| (i * 7 % 256) as u8).collect();
        let same = ImageInput {
            pixels: gradient.clone(),
            width: 28,
            height: 14,
        };
        let grid = ImageGrid {
            height: 14,
            n_vit_h: 1,
            ..grid
        };
        assert_eq!(letterboxed_pixels(&same, &grid).expect("same"), gradient);
        let short = ImageInput {
            pixels: vec![0; 5],
            width: 2,
            height: 2,
        };
        assert!(matches!(
            letterboxed_pixels(&short, &grid),
            Err(VisionError::PixelBuffer { expected: 12, .. })
        ));
    }

    #[test]
    fn bicubic_shrink_keeps_ramps_and_interpolates() {
        // A horizontal ramp halved: each output averages its input pair, within a rounding step.
        let ramp = Rgb {
            width: 8,
            height: 1,
            pixels: (0..8u8).flat_map(|x| [x * 30, x * 30, x * 30]).collect(),
        };
        let half = resize(&ramp, 4, 1);
        for (x, px) in half.pixels.chunks_exact(3).enumerate().skip(1).take(2) {
            let expect = (2 * x) as f64 * 30.0 + 15.0;
            assert!((f64::from(px[0]) - expect).abs() <= 1.0, "x {x}: {px:?}");
        }
        // Weights sum to one in fixed point (within the per-tap rounding).
        for (_, k) in resample_weights(98, 33) {
            let total: i64 = k.iter().sum();
            assert!((total - (1 << PRECISION_BITS)).abs() <= k.len() as i64);
        }
    }
}
