//! RMSNorm on the device: `y = w · (x · rsqrt(mean(x²) + eps))`, fp32 math, on f32 storage (the
//! model's host layout), the outputs rounded to bf16 or kept in fp32; rounded to bf16, optionally
//! quantised to FP8 in the same launch for the GEMM that reads them ([`rms_norm_act_quant_f32`]).

use cudarc::driver::CudaSlice;

use super::quant::{ActGroup, DeviceActFp8};
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
    launch(rt, kernel, (x, w, y), (rows, cols, eps), None)
}

/// [`rms_norm_f32`] with bf16 rounding that also quantises the rounded outputs into `act`
/// (`[rows, cols]` in groups of 32): the codes and scales `quantize_act_fp8` gives `y`, in the
/// same launch.
pub fn rms_norm_act_quant_f32(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    act: &mut DeviceActFp8,
    eps: f32,
) -> Result<(), KernelError> {
    let op = KernelId::RmsNormActQuantG32F32.symbol();
    ensure(act.group == ActGroup::G32, op, || {
        format!("activation group {:?} (only 32)", act.group)
    })?;
    ensure(act.cols.is_multiple_of(32), op, || {
        format!("cols = {} is not a multiple of the group 32", act.cols)
    })?;
    expect_len(op, "codes", act.codes.len(), act.rows * act.cols)?;
    expect_len(op, "scales", act.scales.len(), act.rows * act.cols / 32)?;
    let shape = (act.rows, act.cols, eps);
    launch(
        rt,
        KernelId::RmsNormActQuantG32F32,
        (x, w, y),
        shape,
        Some((&mut act.codes, &mut act.scales)),
    )
}

/// One launch of an RMSNorm `kernel` over `rows` rows of `cols`, with the FP8 outputs of the
/// quantising kernel.
fn launch(
    rt: &KernelRuntime,
    kernel: KernelId,
    (x, w, y): (&CudaSlice<f32>, &CudaSlice<f32>, &mut CudaSlice<f32>),
    (rows, cols, eps): (usize, usize, f32),
    act: Option<(&mut CudaSlice<u8>, &mut CudaSlice<f32>)>,
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
    launch.arg(x).arg(w).arg(y);
    if let Some((codes, scales)) = act {
        launch.arg(codes).arg(scales);
    }
    launch.arg(&params);
    // SAFETY: signature (const float* x, const float* w, float* y, [u8_t* codes, float* scales,]
    // RmsNormParams), the codes and scales exactly for the quantising kernel; lengths checked
    // above (codes and scales by the caller); one block per row, each thread strides within its
    // row, and a quantising launch's cols are whole groups (DeviceActFp8's allocation checks it).
    unsafe { launch.launch(cfg) }
}
