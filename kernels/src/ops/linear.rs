//! Plain fp32 linears `y = x · Wᵀ` (`W [out, inp]`) in the CPU reference's sgemm summation order
//! (`deepinfer_model::quant::dot_f32_sgemm`): bit-exact with `CpuBackend::linear_f32` /
//! `linear_bf16`, and a row's values never depend on the other rows. Also the exact f32
//! dequantisation of weight rows that the fp32 linears over FP8 / FP4 weights consume.

use cudarc::driver::{CudaSlice, CudaViewMut};

use super::gemm::{DeviceFp4Weight, DeviceFp8Weight};

use super::{Rounding, dim, ensure, expect_len, launch_config, sgemm_chains};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::{DequantParams, LinearParams};
use crate::runtime::KernelRuntime;

const OP: &str = "linear_sgemm_f32";
/// Threads per block of every kernel here (and of `routed_exact`'s); must match `linear::THREADS`.
pub(super) const THREADS: u32 = 256;
/// Rows and columns of one partials block's tile; must match `linear::TILE_ROWS` / `TILE_COLS`.
pub(super) const TILE_ROWS: u32 = 8;
pub(super) const TILE_COLS: u32 = 32;
/// Largest `inp` (256 chains of 256 products).
pub(super) const MAX_INP: usize = 65_536;
/// The most block partials one launch pair keeps (64 Mi f32 = 256 MiB); more rows are taken in
/// chunks (rows never interact, so chunking changes no value).
pub(super) const MAX_PARTIALS: usize = 64 << 20;
/// The grid's z limit (row tiles of one launch).
const MAX_GRID_Z: usize = 65_535;

/// `y [rows, out] = x [rows, inp] · w [out, inp]ᵀ`, all f32 row-major; `output` says whether `y`
/// is rounded to bf16 (`linear_bf16`, in the CPU's bf16 GEMM order) or left in fp32 (`linear_f32`,
/// its sgemm order). Two launches per chunk of rows: every FMA chain ([`linear_chains`] per
/// output) in parallel into a scratch buffer of chain partials, then each output's partials added
/// in the CPU's order.
pub fn linear_sgemm_f32(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    (rows, out, inp): (usize, usize, usize),
    output: Rounding,
) -> Result<(), KernelError> {
    ensure(inp != 0 && inp <= MAX_INP, OP, || {
        format!("inp = {inp} must be in 1..={MAX_INP}")
    })?;
    expect_len(OP, "x", x.len(), rows * inp)?;
    expect_len(OP, "w", w.len(), out * inp)?;
    expect_len(OP, "y", y.len(), rows * out)?;
    if rows == 0 || out == 0 {
        return Ok(());
    }
    let blocks = linear_chains(inp, output.flag() != 0);
    let chunk_rows = (MAX_PARTIALS / (blocks * out))
        .min(MAX_GRID_Z * TILE_ROWS as usize)
        .clamp(1, rows);
    // SAFETY: per chunk, linear_sgemm_f32 (grid: every column tile, chain and row tile) writes
    // the partial of every (chain, row < count, column) before linear_sgemm_reduce reads exactly
    // those; the tail past a short last chunk is never read.
    let mut partials = unsafe { rt.alloc_written::<f32>(blocks * chunk_rows * out) }.map_err(
        KernelError::driver("allocating the linear's block partials"),
    )?;
    for first in (0..rows).step_by(chunk_rows) {
        let count = chunk_rows.min(rows - first);
        let params = LinearParams {
            rows: dim(OP, "rows", count)?,
            out: dim(OP, "out", out)?,
            inp: dim(OP, "inp", inp)?,
            round_bf16: output.flag(),
        };
        let x_rows = x.slice(first * inp..(first + count) * inp);
        let mut y_rows = y.slice_mut(first * out..(first + count) * out);
        let tiles = launch_config(
            (
                params.out.div_ceil(TILE_COLS),
                dim(OP, "chains", blocks)?,
                params.rows.div_ceil(TILE_ROWS),
            ),
            THREADS,
            0,
        );
        let mut launch = rt.launcher(KernelId::LinearSgemmF32)?;
        launch.arg(&x_rows).arg(w).arg(&mut partials).arg(&params);
        // SAFETY: signature (const float* x, const float* w, float* partials, LinearParams); x
        // holds params.rows * inp values, w out * inp (checked above), partials blocks *
        // chunk_rows * out >= blocks * params.rows * out; the kernel bounds-checks rows, columns
        // and the last block's length; grid.z = ceil(rows / 8) <= MAX_GRID_Z by the chunking.
        unsafe { launch.launch(tiles) }?;
        sgemm_reduce(rt, &partials, &mut y_rows, params)?;
    }
    Ok(())
}

/// FMA chains per output of an `inp`-product linear: the CPU reference's sgemm order, or its bf16
/// GEMM order (`quant::dot_bf16_gemm`, chains of 32) for the bf16-rounded linears
/// (`linear::chain_count`).
fn linear_chains(inp: usize, bf16_order: bool) -> usize {
    if bf16_order {
        inp.div_ceil(32)
    } else {
        sgemm_chains(inp)
    }
}

/// `y[i]` = the block partials of output `i` (`partials[b][i]`, b-major, `params.rows ·
/// params.out` outputs) added in the CPU's pairwise tree, rounded as `params` says: the second
/// launch of every sgemm-order linear (also of the routed exact experts, `ops::routed_exact`).
pub(crate) fn sgemm_reduce(
    rt: &KernelRuntime,
    partials: &CudaSlice<f32>,
    y: &mut CudaViewMut<'_, f32>,
    params: LinearParams,
) -> Result<(), KernelError> {
    let outputs = params.rows as usize * params.out as usize;
    let blocks = linear_chains(params.inp as usize, params.round_bf16 != 0);
    ensure(
        partials.len() >= blocks * outputs && y.len() == outputs,
        "linear_sgemm_reduce_f32",
        || {
            format!(
                "{} partials and {} outputs for {blocks} blocks of {outputs}",
                partials.len(),
                y.len()
            )
        },
    )?;
    let reduce = launch_config(
        (dim(OP, "rows * out", outputs)?.div_ceil(THREADS), 1, 1),
        THREADS,
        0,
    );
    let mut launch = rt.launcher(KernelId::LinearSgemmReduceF32)?;
    launch.arg(partials).arg(y).arg(&params);
    // SAFETY: signature (const float* partials, float* y, LinearParams); partials holds at least
    // blocks * rows * out values and y rows * out (checked above); the kernel bounds-checks its
    // output index.
    unsafe { launch.launch(reduce) }
}

/// Rows `row_start..row_start + rows` of an FP8 weight, dequantised exactly to f32 into
/// `out [rows, w.inp]`.
pub fn dequant_fp8_rows_f32(
    rt: &KernelRuntime,
    w: &DeviceFp8Weight,
    row_start: usize,
    rows: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let scale_cols = w.inp.div_ceil(w.tile);
    let params = dequant_params(
        "dequant_fp8_rows_f32",
        (w.out, w.inp),
        row_start,
        rows,
        (w.tile, scale_cols),
        out,
    )?;
    launch_dequant(
        rt,
        KernelId::DequantFp8RowsF32,
        &w.codes,
        &w.scales,
        out,
        params,
    )
}

/// Rows `row_start..row_start + rows` of an FP4 weight, dequantised exactly to f32 into
/// `out [rows, w.inp]`.
pub fn dequant_fp4_rows_f32(
    rt: &KernelRuntime,
    w: &DeviceFp4Weight,
    row_start: usize,
    rows: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let params = dequant_params(
        "dequant_fp4_rows_f32",
        (w.out, w.inp),
        row_start,
        rows,
        (32, w.inp / 32),
        out,
    )?;
    launch_dequant(
        rt,
        KernelId::DequantFp4RowsF32,
        &w.packed,
        &w.scales,
        out,
        params,
    )
}

fn dequant_params(
    op: &'static str,
    (n, k): (usize, usize),
    row_start: usize,
    rows: usize,
    (tile, scale_cols): (usize, usize),
    out: &CudaSlice<f32>,
) -> Result<DequantParams, KernelError> {
    ensure(rows != 0 && row_start + rows <= n, op, || {
        format!("rows {row_start}..{} of a {n}-row weight", row_start + rows)
    })?;
    expect_len(op, "out", out.len(), rows * k)?;
    Ok(DequantParams {
        row_start: dim(op, "row_start", row_start)?,
        rows: dim(op, "rows", rows)?,
        k: dim(op, "k", k)?,
        tile: dim(op, "tile", tile)?,
        scale_cols: dim(op, "scale_cols", scale_cols)?,
    })
}

fn launch_dequant(
    rt: &KernelRuntime,
    kernel: KernelId,
    codes: &CudaSlice<u8>,
    scales: &CudaSlice<u8>,
    out: &mut CudaSlice<f32>,
    params: DequantParams,
) -> Result<(), KernelError> {
    let total = dim(kernel.symbol(), "rows * k", out.len())?;
    let cfg = launch_config((total.div_ceil(THREADS), 1, 1), THREADS, 0);
    let mut launch = rt.launcher(kernel)?;
    launch.arg(codes).arg(scales).arg(out).arg(&params);
    // SAFETY: signature (const u8* codes, const u8* scales, float* out, DequantParams); the weight
    // buffers were length-checked at upload for [n, k], the rows lie inside n and out holds
    // rows * k values (checked by dequant_params); the kernel bounds-checks its index.
    unsafe { launch.launch(cfg) }
}
