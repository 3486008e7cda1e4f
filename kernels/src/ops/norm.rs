//! RMSNorm on the device: `y = bf16(w · (x · rsqrt(mean(x²) + eps)))`, fp32 math, on bf16
//! storage or on f32 storage of bf16 values (the model's host layout).

use cudarc::driver::{CudaSlice, DeviceRepr};
use half::bf16;

use super::{Rounding, dim, ensure, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::RmsNormParams;
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;

/// RMSNorm of each row of `x` (bf16 `[rows, cols]`, row-major) with weight `w` (bf16 `[cols]`)
/// into `y` (bf16 `[rows, cols]`). One block per row with a fixed reduction tree: batch invariant.
pub fn rms_norm_bf16(
    rt: &KernelRuntime,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<(), KernelError> {
    launch_rms_norm(rt, KernelId::RmsNormBf16, x, w, y, rows, cols, eps)
}

/// [`rms_norm_bf16`] on f32 storage: `x` and `w` are read as f32 (x may hold any fp32 values),
/// every output is rounded per `rounding` and stored as f32.
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
    launch_rms_norm(rt, kernel, x, w, y, rows, cols, eps)
}

fn launch_rms_norm<T: DeviceRepr>(
    rt: &KernelRuntime,
    kernel: KernelId,
    x: &CudaSlice<T>,
    w: &CudaSlice<T>,
    y: &mut CudaSlice<T>,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<(), KernelError> {
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
    // SAFETY: signature (const T* x, const T* w, T* y, RmsNormParams) with T the element type of
    // `kernel` (bf16 or f32, matching the slices); lengths checked above; one block per row, each
    // thread strides within its row.
    unsafe { launch.launch(cfg) }
}
