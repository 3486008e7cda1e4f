//! Interleaved-pair partial RoPE on the device, in place, on f32 storage (the model's host
//! layout), the outputs rounded to bf16 or kept in fp32; and RoPE between an optional RMSNorm and
//! a QDQ point in one pass ([`rope_qdq_f32`]: the rotated, quantised rows of caches and indexes).

use cudarc::driver::{CudaSlice, DevicePtr};

use super::qdq::QdqPoint;
use super::{Rounding, dim, ensure, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::{RopeParams, RopeQdqParams};
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

/// What a rotation reads on the device: pair `(2i, 2i+1)` of the rotated channels of token `t`
/// turns by the angle in row `positions[t]` of `cos`/`sin` (f32 `[table_rows, rope_dim/2]`),
/// by the negative angle when `inverse`. Positions are not read back: a position outside
/// `0..table_rows` leaves its token unrotated, so callers validate positions on the host.
#[derive(Debug, Clone, Copy)]
pub struct RopeRotation<'a> {
    pub positions: &'a CudaSlice<i32>,
    pub cos: &'a CudaSlice<f32>,
    pub sin: &'a CudaSlice<f32>,
    pub shape: RopeShape,
    pub inverse: bool,
}

impl RopeRotation<'_> {
    /// A position per token and a cos/sin table of `table_rows` rows of `rope_dim / 2` values.
    fn check(&self, op: &'static str) -> Result<(), KernelError> {
        let RopeShape {
            tokens,
            rope_dim,
            table_rows,
            ..
        } = self.shape;
        expect_len(op, "positions", self.positions.len(), tokens)?;
        expect_len(op, "cos", self.cos.len(), table_rows * rope_dim / 2)?;
        expect_len(op, "sin", self.sin.len(), table_rows * rope_dim / 2)
    }
}

/// Rotates, in place, the last `rope_dim` channels of every head of `x` (f32 storage
/// `[tokens, heads, head_dim]`, row-major) by `rotation`. Every rotated value is rounded per
/// `rounding` and stored as f32; the channels outside the rotated tail are untouched.
pub fn rope_interleaved_f32(
    rt: &KernelRuntime,
    x: &mut CudaSlice<f32>,
    rotation: RopeRotation<'_>,
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
    } = rotation.shape;
    ensure(
        rope_dim != 0 && rope_dim % 2 == 0 && rope_dim <= head_dim,
        op,
        || format!("rope_dim = {rope_dim} must be even, positive and <= head_dim = {head_dim}"),
    )?;
    expect_len(op, "x", x.len(), tokens * heads * head_dim)?;
    rotation.check(op)?;
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
        inverse: u32::from(rotation.inverse),
    };
    let cfg = launch_config((pairs.div_ceil(THREADS), 1, 1), THREADS, 0);
    let mut launch = rt.launcher(kernel)?;
    launch
        .arg(x)
        .arg(rotation.positions)
        .arg(rotation.cos)
        .arg(rotation.sin)
        .arg(&params);
    // SAFETY: signature (float* x, const int* positions, const float* cos, const float* sin,
    // RopeParams); lengths checked above; the kernel bounds-checks pair indices and positions.
    unsafe { launch.launch(cfg) }
}

/// The columns of a row one block of [`rope_qdq_f32`] takes (`rope_qdq::CHUNK`).
const ROPE_QDQ_CHUNK: usize = 512;

/// The most values a row of [`rope_qdq_f32`] may hold: a row's blocks are the grid's y (at most
/// 65535).
pub const ROPE_QDQ_MAX_COLS: usize = 65535 * ROPE_QDQ_CHUNK;

/// The rows of a [`rope_qdq_f32`]: read from `x`, normed first when `norm` is `(w [cols], eps)`
/// (a norm reads whole rows while other blocks write theirs: never in place).
#[derive(Debug, Clone, Copy)]
pub struct RopeQdqInput<'a> {
    /// `None`: the rows are `y`'s own (in place).
    pub x: Option<&'a CudaSlice<f32>>,
    pub norm: Option<(&'a CudaSlice<f32>, f32)>,
}

/// Each row of `[tokens, heads · head_dim]` values (`input`'s, or `y`'s in place): RMSNorm when
/// the input has one (bf16 outputs), then [`rope_interleaved_f32`]'s rotation with bf16 rounding
/// (`rope_dim` may be 0: none), then the QDQ `point`, into `y` — the bits of those launches one
/// after another, in one. A row holds at most [`ROPE_QDQ_MAX_COLS`] values, a multiple of 32;
/// `head_dim` and `rope_dim` are even.
pub fn rope_qdq_f32(
    rt: &KernelRuntime,
    input: RopeQdqInput<'_>,
    y: &mut CudaSlice<f32>,
    rotation: RopeRotation<'_>,
    point: QdqPoint,
) -> Result<(), KernelError> {
    let kernel = match point {
        QdqPoint::Q8 => KernelId::RopeQdqQ8F32,
        QdqPoint::Q4e => KernelId::RopeQdqQ4eF32,
        QdqPoint::Q4m => KernelId::RopeQdqQ4mF32,
    };
    let op = kernel.symbol();
    let RopeShape {
        tokens,
        heads,
        head_dim,
        rope_dim,
        table_rows,
    } = rotation.shape;
    let cols = heads * head_dim;
    ensure(
        cols != 0 && cols <= ROPE_QDQ_MAX_COLS && cols.is_multiple_of(32),
        op,
        || format!("a row of {cols} values (a positive multiple of 32, at most {ROPE_QDQ_MAX_COLS})"),
    )?;
    ensure(
        head_dim % 2 == 0 && rope_dim % 2 == 0 && rope_dim <= head_dim,
        op,
        || format!("head_dim = {head_dim} and rope_dim = {rope_dim} must be even, rope_dim <= head_dim"),
    )?;
    expect_len(op, "y", y.len(), tokens * cols)?;
    if let Some(x) = input.x {
        expect_len(op, "x", x.len(), tokens * cols)?;
    }
    let eps = match input.norm {
        Some((w, eps)) => {
            expect_len(op, "w", w.len(), cols)?;
            ensure(!eps.is_nan() && eps >= 0.0, op, || {
                format!("eps = {eps} is not a non-negative number")
            })?;
            eps
        }
        None => 0.0,
    };
    ensure(input.norm.is_none() || input.x.is_some(), op, || {
        "a norm in place (every block of a row reads the whole row)".to_string()
    })?;
    rotation.check(op)?;
    if tokens == 0 {
        return Ok(());
    }
    let params = RopeQdqParams {
        rows: dim(op, "tokens", tokens)?,
        cols: dim(op, "cols", cols)?,
        stride: dim(op, "head_dim", head_dim)?,
        rope_dim: dim(op, "rope_dim", rope_dim)?,
        table_rows: dim(op, "table_rows", table_rows)?,
        inverse: u32::from(rotation.inverse),
        eps,
    };
    let chunks = dim(op, "chunks", cols.div_ceil(ROPE_QDQ_CHUNK))?;
    let cfg = launch_config((params.rows, chunks, 1), THREADS, 0);
    let y_address = y.device_ptr(rt.stream()).0;
    let mut launch = rt.launcher(kernel)?;
    match input.x {
        Some(x) => launch.arg(x),
        None => launch.arg(&y_address),
    };
    match input.norm {
        Some((w, _)) => launch.arg(w),
        None => launch.arg(&0u64),
    };
    launch
        .arg(y)
        .arg(rotation.positions)
        .arg(rotation.cos)
        .arg(rotation.sin)
        .arg(&params);
    // SAFETY: signature (const float* x, const float* w, float* y, const int* positions, const
    // float* cos, const float* sin, RopeQdqParams), x being y itself in place and w null without
    // a norm (then x is not y); lengths checked above; a block per 512 columns of a row, whose
    // threads read their own elements before writing them and together cover the row.
    unsafe { launch.launch(cfg) }
}
