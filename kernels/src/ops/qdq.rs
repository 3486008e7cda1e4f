//! The in-place QDQ points (`Q8`, `Q4e`, `Q4m`, v41-architecture.md §3.0) on f32 storage of bf16
//! values. Groups are consecutive from element 0 (32, 32 and 16 values; a shorter last group is
//! allowed, as in the CPU reference). Bit-exact with `deepinfer_model::quant::{q8_qdq_group32,
//! q4_qdq_e8m0_group32, q4_qdq_e4m3_group16}`; every group is independent (batch invariant).

use cudarc::driver::CudaSlice;

use super::{dim, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::QdqParams;
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;

/// Which quantisation point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QdqPoint {
    /// Groups of 32, UE8M0 scale, E4M3 values (window KV).
    Q8,
    /// Groups of 32, UE8M0 scale, E2M1 values (indexer queries and keys).
    Q4e,
    /// Groups of 16, E4M3 scale, E2M1 values (compressed KV).
    Q4m,
}

impl QdqPoint {
    fn kernel(self) -> KernelId {
        match self {
            QdqPoint::Q8 => KernelId::Q8QdqF32,
            QdqPoint::Q4e => KernelId::Q4eQdqF32,
            QdqPoint::Q4m => KernelId::Q4mQdqF32,
        }
    }
}

/// Quantises and dequantises every value of `x` in place.
pub fn qdq_f32(
    rt: &KernelRuntime,
    x: &mut CudaSlice<f32>,
    point: QdqPoint,
) -> Result<(), KernelError> {
    let kernel = point.kernel();
    let n = dim(kernel.symbol(), "n", x.len())?;
    if n == 0 {
        return Ok(());
    }
    let cfg = launch_config((n.div_ceil(THREADS), 1, 1), THREADS, 0);
    let params = QdqParams { n };
    let mut launch = rt.launcher(kernel)?;
    launch.arg(x).arg(&params);
    // SAFETY: signature (float* x, QdqParams); the grid covers n threads and the kernel checks
    // i < n before touching x (which holds n values). Whole warps stay converged for the shuffles.
    unsafe { launch.launch(cfg) }
}
