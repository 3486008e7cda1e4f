//! RMSNorm on the device: `y = bf16(w · (x · rsqrt(mean(x²) + eps)))`, fp32 math.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{dim, expect_len};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::RmsNormParams;
use crate::runtime::KernelRuntime;

const OP: &str = "rms_norm_bf16";
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
    if cols == 0 {
        return Err(KernelError::Shape {
            op: OP,
            message: "cols = 0".to_string(),
        });
    }
    if eps.is_nan() || eps < 0.0 {
        return Err(KernelError::Shape {
            op: OP,
            message: format!("eps = {eps} is not a non-negative number"),
        });
    }
    expect_len(OP, "x", x.len(), rows * cols)?;
    expect_len(OP, "w", w.len(), cols)?;
    expect_len(OP, "y", y.len(), rows * cols)?;
    if rows == 0 {
        return Ok(());
    }
    let params = RmsNormParams {
        rows: dim(OP, "rows", rows)?,
        cols: dim(OP, "cols", cols)?,
        eps,
    };
    let cfg = LaunchConfig {
        grid_dim: (params.rows, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let function = rt.function(KernelId::RmsNormBf16)?;
    let mut launch = rt.stream().launch_builder(function);
    launch.arg(x).arg(w).arg(y).arg(&params);
    // SAFETY: signature (const bf16* x, const bf16* w, bf16* y, RmsNormParams); lengths checked
    // above; one block per row, each thread strides within its row.
    unsafe { launch.launch(cfg) }.map_err(KernelError::driver("launching rms_norm_bf16"))?;
    Ok(())
}
