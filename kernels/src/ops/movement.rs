//! Data movement on the device between ops: fixed-width pieces gathered from device addresses
//! ([`gather_ptrs_f32`]: rows of other buffers, column groups, interleavings, all in one launch),
//! bf16 GEMM outputs widened to f32 storage ([`bf16_to_f32`]), selected key rows written into
//! attention lists, and the one elementwise sum the drafter needs ([`add_f32`]).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{dim, expect_len};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;
/// Blocks of a gather launch (they stride over the pieces).
const GATHER_BLOCKS: u32 = 1024;

/// `out[p · width ..][..width] = *pieces[p]`: `pieces` holds the device address of each piece's
/// first value ([`super::key_table::key_row_address`]); every piece holds `width` values.
pub fn gather_ptrs_f32(
    rt: &KernelRuntime,
    pieces: &CudaSlice<u64>,
    width: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gather_ptrs_f32";
    expect_len(OP, "out", out.len(), pieces.len() * width)?;
    if pieces.is_empty() || width == 0 {
        return Ok(());
    }
    let width_u32 = dim(OP, "width", width)?;
    let n_pieces = dim(OP, "pieces", pieces.len())?;
    let cfg = LaunchConfig {
        grid_dim: (n_pieces.min(GATHER_BLOCKS), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::GatherPtrsF32)?);
    launch.arg(pieces).arg(out).arg(&width_u32).arg(&n_pieces);
    // SAFETY: signature (const u64* pieces, float* out, u32 width, u32 n_pieces); out holds
    // n_pieces * width values (checked) and the loops stop at n_pieces and width; each address
    // points at `width` readable floats of a live device buffer (the caller's contract, see
    // `key_table`).
    unsafe { launch.launch(cfg) }.map_err(KernelError::driver("launching gather_ptrs_f32"))?;
    Ok(())
}

/// `out[i] = f32(x[i])` (exact).
pub fn bf16_to_f32(
    rt: &KernelRuntime,
    x: &CudaSlice<bf16>,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "bf16_to_f32";
    expect_len(OP, "out", out.len(), x.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let n = x.len() as u64;
    let blocks = x.len().div_ceil(THREADS as usize).min(4096) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::Bf16ToF32)?);
    launch.arg(x).arg(out).arg(&n);
    // SAFETY: signature (const u16* x, float* out, u64 n); both hold n values (checked), the
    // kernel's grid-stride loop stops at n.
    unsafe { launch.launch(cfg) }.map_err(KernelError::driver("launching bf16_to_f32"))?;
    Ok(())
}

/// `x[i] += y[i]` in fp32 (exact as the host's f32 add).
pub fn add_f32(
    rt: &KernelRuntime,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "add_f32";
    expect_len(OP, "y", y.len(), x.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let n = x.len() as u64;
    let blocks = x.len().div_ceil(THREADS as usize).min(4096) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = rt.stream().launch_builder(rt.function(KernelId::AddF32)?);
    launch.arg(x).arg(y).arg(&n);
    // SAFETY: signature (float* x, const float* y, u64 n); both hold n values (checked), the
    // kernel's grid-stride loop stops at n.
    unsafe { launch.launch(cfg) }.map_err(KernelError::driver("launching add_f32"))?;
    Ok(())
}
