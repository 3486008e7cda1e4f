//! Interleaved-pair partial RoPE on the device, in place, on f32 storage (the model's host
//! layout), the outputs rounded to bf16 or kept in fp32.

use cudarc::driver::CudaSlice;

use super::{Rounding, dim, ensure, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::RopeParams;
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;

/// The shape of a RoPE application.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// The rotated channels are the last `rope_dim` of each head (even, ≤ head_dim).
    pub rope_dim: usize,
    /// Rows of the cos/sin tables (positions must be below this).
    pub table_rows: usize,
}

/// Rotates, in place, the last `rope_dim` channels of every head of `x` (f32 storage
/// `[tokens, heads, head_dim]`, row-major): pair `(2i, 2i+1)` of token `t` by the angle in row
/// `positions[t]` of `cos`/`sin` (f32 `[table_rows, rope_dim/2]`); `inverse` rotates by the
/// negative angle. Every rotated value is rounded per `rounding` and stored as f32; the channels
/// outside the rotated tail are untouched. Positions live on the device and are not read back: a
/// position outside `0..table_rows` leaves that token unchanged, so callers validate positions on
/// the host.
pub fn rope_interleaved_f32(
    rt: &KernelRuntime,
    x: &mut CudaSlice<f32>,
    positions: &CudaSlice<i32>,
    cos: &CudaSlice<f32>,
    sin: &CudaSlice<f32>,
    shape: RopeShape,
    inverse: bool,
    rounding: Rounding,
) -> Result<(), KernelError> {
    let kernel = rounding.kernel(
        KernelId::RopeInterleavedF32,
        KernelId::RopeInterleavedF32Exact,
    );
    let op = kernel.symbol();
    let RopeShape {
        tokens,
        heads,
        head_dim,
        rope_dim,
        table_rows,
    } = shape;
    ensure(
        rope_dim != 0 && rope_dim % 2 == 0 && rope_dim <= head_dim,
        op,
        || format!("rope_dim = {rope_dim} must be even, positive and <= head_dim = {head_dim}"),
    )?;
    expect_len(op, "x", x.len(), tokens * heads * head_dim)?;
    expect_len(op, "positions", positions.len(), tokens)?;
    expect_len(op, "cos", cos.len(), table_rows * rope_dim / 2)?;
    expect_len(op, "sin", sin.len(), table_rows * rope_dim / 2)?;
    let pairs = dim(op, "pairs", tokens * heads * rope_dim / 2)?;
    if pairs == 0 {
        return Ok(());
    }
    let params = RopeParams {
        tokens: dim(op, "tokens", tokens)?,
        heads: dim(op, "heads", heads)?,
        head_dim: dim(op, "head_dim", head_dim)?,
        rope_dim: dim(op, "rope_dim", rope_dim)?,
        table_rows: dim(op, "table_rows", table_rows)?,
        inverse: u32::from(inverse),
    };
    let cfg = launch_config((pairs.div_ceil(THREADS), 1, 1), THREADS, 0);
    let mut launch = rt.launcher(kernel)?;
    launch.arg(x).arg(positions).arg(cos).arg(sin).arg(&params);
    // SAFETY: signature (float* x, const int* positions, const float* cos, const float* sin,
    // RopeParams); lengths checked above; the kernel bounds-checks pair indices and positions.
    unsafe { launch.launch(cfg) }
}
