//! The `fast` bf16 linear `y = x · Wᵀ` on tensor cores (mma.sync m16n8k16, bf16 operands, fp32
//! accumulation; `cuda/linear/linear_fast.cuh`): the V4.1 linears the reference runs in bf16
//! (`Backend::linear_bf16`, `Backend::linear_grouped_bf16`: the grouped `wo_a`, the compressor
//! and indexer projections) and V4's dense projections (`Backend::linear`, f32 outputs; V4's
//! float32 activations rounded to bf16 on the way in) in `Numerics::Fast`. Not bitwise equal to
//! the CPU's bf16 GEMM order, but deterministic and batch invariant: K is cut into [`PARTS`] parts by `inp` alone, each summed in K order, the parts
//! added in order, and the tile chosen by the row count never changes an output's arithmetic. A
//! grouped weight ([`FastBf16Weight::upload_grouped`]: `wo_a`'s 8 groups) runs its groups as
//! independent linears in one launch (grid z), each group bitwise its linear alone.
//!
//! Error bound against the exact value (f64) of the bf16 operands — what the GPU tests assert:
//! with `S = Σ_k |x_k w_k|`, the products are exact in fp32; each mma step adds 16 of them to the
//! fp32 accumulator, within `17 · 2^-23` of the magnitudes it adds (every term aligned to the
//! largest, fp32 precision; NVIDIA documents no more), each of the `PARTS - 1` part additions
//! rounds once (`2^-24`), so `|ŷ - y| ≤ e` with `e = (17 · ⌈K / 16⌉ + PARTS) · 2^-23 · S`, and the
//! bf16 output adds `2^-8 (|y| + e)`.

use cudarc::driver::CudaSlice;
use half::bf16;

use super::{Rounding, dim, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::LinearParams;
use crate::runtime::KernelRuntime;

const OP: &str = "linear_bf16_fast";
/// K parts (warps per block); must match `linear_fast::PARTS`.
pub const PARTS: usize = 8;
/// K elements per chunk (weight rows are padded to a multiple); `linear_fast::CHUNK`.
const CHUNK: usize = 32;
/// Largest `inp`.
const MAX_INP: usize = 65_536;
/// The grid's y limit (row tiles of one launch).
const MAX_GRID_Y: usize = 65_535;
/// The grid's z limit (groups of one launch).
const MAX_GROUPS: usize = 65_535;

/// A bf16 weight `[out, inp]` on the device for [`linear_bf16_fast`]: rows padded with zeros to
/// a multiple of 32 elements (16-byte aligned chunks). With `groups > 1` it is `groups`
/// independent weights of `out / groups` rows each: group `g` maps columns
/// `[g · inp, (g + 1) · inp)` of the input to columns `[g · out / groups, (g + 1) · out / groups)`
/// of the output.
pub struct FastBf16Weight {
    /// `out` rows of `inp.div_ceil(32) · 32` bf16 values.
    pub codes: CudaSlice<bf16>,
    pub out: usize,
    pub inp: usize,
    pub groups: usize,
}

impl FastBf16Weight {
    /// Uploads `w [out, inp]` (f32 storage of bf16 values: rounded to nearest, exact for them).
    pub fn upload(
        rt: &KernelRuntime,
        out: usize,
        inp: usize,
        w: &[f32],
    ) -> Result<FastBf16Weight, KernelError> {
        FastBf16Weight::upload_grouped(rt, 1, out, inp, w)
    }

    /// Uploads `groups` weights `[out / groups, inp]`, one after the other in `w [out, inp]`.
    pub fn upload_grouped(
        rt: &KernelRuntime,
        groups: usize,
        out: usize,
        inp: usize,
        w: &[f32],
    ) -> Result<FastBf16Weight, KernelError> {
        if inp == 0 || inp > MAX_INP {
            return Err(KernelError::Shape {
                op: OP,
                message: format!("inp = {inp} must be in 1..={MAX_INP}"),
            });
        }
        if groups == 0 || !out.is_multiple_of(groups) || groups > MAX_GROUPS {
            return Err(KernelError::Shape {
                op: OP,
                message: format!(
                    "{groups} groups must divide out = {out} (at most {MAX_GROUPS} groups)"
                ),
            });
        }
        expect_len(OP, "w", w.len(), out * inp)?;
        let stride = inp.div_ceil(CHUNK) * CHUNK;
        let mut codes = vec![bf16::ZERO; out * stride];
        for (padded, row) in codes.chunks_exact_mut(stride).zip(w.chunks_exact(inp)) {
            for (code, &v) in padded.iter_mut().zip(row) {
                *code = bf16::from_f32(v);
            }
        }
        let codes = rt
            .htod(&codes)
            .map_err(KernelError::driver("uploading a fast bf16 weight"))?;
        Ok(FastBf16Weight {
            codes,
            out,
            inp,
            groups,
        })
    }
}

/// The mma tiles per warp (16 rows × 8 columns each) for `rows` rows: more rows share each
/// weight load as they grow; the result never depends on it.
fn tile_for(rows: usize) -> (KernelId, usize, usize) {
    match rows {
        0..=16 => (KernelId::LinearBf16FastT1x1, 1, 1),
        17..=64 => (KernelId::LinearBf16FastT2x2, 2, 2),
        _ => (KernelId::LinearBf16FastT4x2, 4, 2),
    }
}

/// `y [rows, w.out] = x [rows, w.groups · w.inp] · wᵀ`, group by group (f32 storage; `x`
/// converted to bf16 by rounding to nearest even, exact for bf16 values), `y` rounded to bf16
/// when `output` is [`Rounding::Bf16`], else the fp32 sum as it is.
pub fn linear_bf16_fast(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    w: &FastBf16Weight,
    y: &mut CudaSlice<f32>,
    rows: usize,
    output: Rounding,
) -> Result<(), KernelError> {
    linear_bf16_fast_as_if(rt, x, w, y, (rows, rows), output)
}

/// [`linear_bf16_fast`] of `rows` rows with the tile it would take for `tile_rows` rows (tests:
/// every tile gives the same bits).
pub fn linear_bf16_fast_as_if(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    w: &FastBf16Weight,
    y: &mut CudaSlice<f32>,
    (rows, tile_rows): (usize, usize),
    output: Rounding,
) -> Result<(), KernelError> {
    let (kernel, mt, nt) = tile_for(tile_rows);
    let (x_width, group_out) = (w.groups * w.inp, w.out / w.groups);
    expect_len(OP, "x", x.len(), rows * x_width)?;
    expect_len(OP, "y", y.len(), rows * w.out)?;
    if rows == 0 || w.out == 0 {
        return Ok(());
    }
    let (tile_rows, tile_cols) = (16 * mt, 8 * nt);
    let chunk_rows = MAX_GRID_Y * tile_rows;
    for first in (0..rows).step_by(chunk_rows) {
        let count = chunk_rows.min(rows - first);
        let params = LinearParams {
            rows: dim(OP, "rows", count)?,
            out: dim(OP, "out", group_out)?,
            inp: dim(OP, "inp", w.inp)?,
            round_bf16: output.flag(),
        };
        let x_rows = x.slice(first * x_width..(first + count) * x_width);
        let mut y_rows = y.slice_mut(first * w.out..(first + count) * w.out);
        let grid = launch_config(
            (
                dim(OP, "column tiles", group_out.div_ceil(tile_cols))?,
                dim(OP, "row tiles", count.div_ceil(tile_rows))?,
                dim(OP, "groups", w.groups)?,
            ),
            (32 * PARTS) as u32,
            0,
        );
        let mut launch = rt.launcher(kernel)?;
        launch
            .arg(&x_rows)
            .arg(&w.codes)
            .arg(&mut y_rows)
            .arg(&params);
        // SAFETY: signature (const float* x, const uint4* w, float* y, LinearParams); x holds
        // params.rows * groups * inp values and y params.rows * groups * params.out (checked
        // above; grid.z = groups); w holds groups * params.out rows of inp.div_ceil(32) * 32
        // bf16 (FastBf16Weight::upload_grouped), read 16 bytes at a time from 16-byte aligned
        // chunks (the allocation is aligned, a row is a multiple of 64 bytes); the kernel
        // bounds-checks rows, columns and k against params and offsets each group by them.
        unsafe { launch.launch(grid) }?;
    }
    Ok(())
}
