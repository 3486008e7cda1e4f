//! The `fast` bf16 linear `y = x · Wᵀ` on tensor cores (mma.sync m16n8k16, bf16 operands, fp32
//! accumulation; `cuda/linear/linear_fast.cuh`): the V4.1 linears the reference runs in bf16
//! (`Backend::linear_bf16`: the grouped `wo_a`, the compressor and indexer projections) and V4's
//! dense projections (`Backend::linear`, f32 outputs; V4's float32 activations rounded to bf16
//! on the way in) in `Numerics::Fast`. Not bitwise equal to the CPU's bf16 GEMM order, but deterministic and batch
//! invariant: K is cut into [`PARTS`] parts by `inp` alone, each summed in K order, the parts
//! added in order, and the tile chosen by the row count never changes an output's arithmetic.
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

/// A bf16 weight `[out, inp]` on the device for [`linear_bf16_fast`]: rows padded with zeros to
/// a multiple of 32 elements (16-byte aligned chunks).
pub struct FastBf16Weight {
    /// `out` rows of `inp.div_ceil(32) · 32` bf16 values.
    pub codes: CudaSlice<bf16>,
    pub out: usize,
    pub inp: usize,
}

impl FastBf16Weight {
    /// Uploads `w [out, inp]` (f32 storage of bf16 values: rounded to nearest, exact for them).
    pub fn upload(
        rt: &KernelRuntime,
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
        Ok(FastBf16Weight { codes, out, inp })
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

/// `y [rows, w.out] = x [rows, w.inp] · wᵀ` (f32 storage; `x` converted to bf16 by rounding to
/// nearest even, exact for bf16 values), `y` rounded to bf16 when `output` is [`Rounding::Bf16`],
/// else the fp32 sum as it is.
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
    expect_len(OP, "x", x.len(), rows * w.inp)?;
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
            out: dim(OP, "out", w.out)?,
            inp: dim(OP, "inp", w.inp)?,
            round_bf16: output.flag(),
        };
        let x_rows = x.slice(first * w.inp..(first + count) * w.inp);
        let mut y_rows = y.slice_mut(first * w.out..(first + count) * w.out);
        let grid = launch_config(
            (
                dim(OP, "column tiles", w.out.div_ceil(tile_cols))?,
                dim(OP, "row tiles", count.div_ceil(tile_rows))?,
                1,
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
        // params.rows * inp values and y params.rows * out (checked above); w holds out rows of
        // inp.div_ceil(32) * 32 bf16 (FastBf16Weight::upload), read 16 bytes at a time from
        // 16-byte aligned chunks (the allocation is aligned, a row is a multiple of 64 bytes);
        // the kernel bounds-checks rows, columns and k against params.
        unsafe { launch.launch(grid) }?;
    }
    Ok(())
}
