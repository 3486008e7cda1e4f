//! RMSNorm on the device: `y = w · (x · rsqrt(mean(x²) + eps))`, fp32 math, on f32 storage (the
//! model's host layout), the outputs rounded to bf16 or kept in fp32.

use cudarc::driver::CudaSlice;

use super::{Rounding, dim, ensure, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::RmsNormParams;
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;

/// RMSNorm of each row of `x` (f32 `[rows, cols]`, row-major, any fp32 values) with weight `w`
/// (f32 `[cols]`) into `y` (f32 `[rows, cols]`), every output rounded per `rounding`. One block per
/// row with a fixed reduction tree: batch invariant.
pub fn rms_norm_f32(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    rows: usize,
    cols: usize,
    eps: f32,
    rounding: Rounding,
) -> Result<(), KernelError> {
    let kernel = rounding.kernel(KernelId::RmsNormF32, KernelId::RmsNormF32Exact);
    let op = kernel.symbol();
    ensure(cols != 0, op, || "cols = 0")?;
    ensure(!eps.is_nan() && eps >= 0.0, op, || {
        format!("eps = {eps} is not a non-negative number")
    })?;
    expect_len(op, "x", x.len(), rows * cols)?;
    expect_len(op, "w", w.len(), cols)?;
    expect_len(op, "y", y.len(), rows * cols)?;
    if rows == 0 {
        return Ok(());
    }
    let params = RmsNormParams {
        rows: dim(op, "rows", rows)?,
        cols: dim(op, "cols", cols)?,
        eps,
    };
    let cfg = launch_config((params.rows, 1, 1), THREADS, 0);
    let mut launch = rt.launcher(kernel)?;
    launch.arg(x).arg(w).arg(y).arg(&params);
    // SAFETY: signature (const float* x, const float* w, float* y, RmsNormParams); lengths
    // checked above; one block per row, each thread strides within its row.
    unsafe { launch.launch(cfg) }
}
