//! The exact dequantisation of FP8/FP4 weights for the fp32 linears of V4
//! ([`crate::backend::Backend::linear`]), a bounded block of weight rows at a time.

use crate::weights::{FP4_GROUP, Fp4Weight, Fp8Weight, e2m1_to_f32, e8m0_to_f32};

/// Appends row `row` of an FP8 weight in f32 ([`Fp8Weight::dequant_row`], through the decode
/// table) to `block`.
pub(super) fn fp8_row(w: &Fp8Weight, row: usize, block: &mut Vec<f32>) {
    let codes = crate::quant::e4m3_table();
    let tile_row = (row / w.block) * w.scale_cols();
    let scales = &w.scales[tile_row..tile_row + w.scale_cols()];
    for (tile, &scale) in w.data[row * w.inp..(row + 1) * w.inp]
        .chunks(w.block)
        .zip(scales)
    {
        let scale = e8m0_to_f32(scale);
        block.extend(tile.iter().map(|&code| codes[usize::from(code)] * scale));
    }
}

/// Appends row `row` of a packed FP4 weight in f32 ([`Fp4Weight::dequant_row`], one scale per
/// group) to `block`.
pub(super) fn fp4_row(w: &Fp4Weight, row: usize, block: &mut Vec<f32>) {
    let scale_cols = w.scale_cols();
    let scales = &w.scales[row * scale_cols..(row + 1) * scale_cols];
    for (group, &scale) in w.packed[row * w.inp / 2..(row + 1) * w.inp / 2]
        .chunks(FP4_GROUP / 2)
        .zip(scales)
    {
        let scale = e8m0_to_f32(scale);
        for &byte in group {
            block.push(e2m1_to_f32(byte & 0x0f) * scale);
            block.push(e2m1_to_f32(byte >> 4) * scale);
        }
    }
}

/// Appends weight row `row`, dequantised, to a buffer.
pub(super) type DequantRow<'a> = &'a dyn Fn(usize, &mut Vec<f32>);

/// Weight rows dequantised at a time by [`dequantised_linear`] (bounds its memory).
const DEQUANT_ROWS: usize = 256;

/// `x · Wᵀ` (`x` of `x_len` values) for a `[out, inp]` weight whose rows `dequant_row` appends to
/// a buffer, through `linear` (a block of dequantised rows, their count) one block of rows at a
/// time.
pub(super) fn dequantised_linear(
    x_len: usize,
    out: usize,
    inp: usize,
    dequant_row: impl Fn(usize, &mut Vec<f32>),
    linear: impl Fn(&[f32], usize) -> Vec<f32>,
) -> Vec<f32> {
    let rows_of_x = x_len / inp.max(1);
    let mut y = vec![0.0f32; rows_of_x * out];
    let mut block = Vec::with_capacity(DEQUANT_ROWS.min(out) * inp);
    for start in (0..out).step_by(DEQUANT_ROWS) {
        let count = DEQUANT_ROWS.min(out - start);
        block.clear();
        for row in start..start + count {
            dequant_row(row, &mut block);
        }
        let part = linear(&block, count);
        for (r, chunk) in part.chunks_exact(count).enumerate() {
            y[r * out + start..r * out + start + count].copy_from_slice(chunk);
        }
    }
    y
}
