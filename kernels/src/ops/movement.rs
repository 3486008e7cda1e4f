//! Data movement on the device between ops: fixed-width pieces gathered from device addresses
//! ([`gather_ptrs_f32`]: rows of other buffers, column groups, interleavings, all in one launch),
//! bf16 GEMM outputs widened to f32 storage ([`bf16_to_f32`]), selected key rows written into
//! attention lists, and the one elementwise sum the drafter needs ([`add_f32`]).

use cudarc::driver::CudaSlice;
use half::bf16;

use super::{dim, ensure, expect_len, grid_stride_config, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::{KernelRuntime, KernelValue};

const THREADS: u32 = 256;
/// movement.cu's `GATHER_TILE`: the columns one gather block copies (256 threads, 4 values each).
const GATHER_TILE: usize = 1024;
/// Rows of gather blocks along the pieces (they stride over the rest).
const GATHER_PIECE_BLOCKS: u32 = 4096;

/// Piece addresses a gather takes in its kernel parameters instead of a device table.
pub const GATHER_INLINE: usize = 128;

/// `movement.cu`'s `InlinePieces`: up to [`GATHER_INLINE`] addresses by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct InlinePieces {
    pieces: [u64; GATHER_INLINE],
}

// SAFETY: a plain `#[repr(C)]` array of integers, laid out as its CUDA mirror.
unsafe impl KernelValue for InlinePieces {}

/// `out[p · width ..][..width] = *pieces[p]`: `pieces` holds the device address of each piece's
/// first value ([`super::key_table::key_row_address`]); every piece holds `width` values.
pub fn gather_ptrs_f32(
    rt: &KernelRuntime,
    pieces: &CudaSlice<u64>,
    width: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    launch_gather(rt, Some(pieces), &[], pieces.len(), width, out)
}

/// [`gather_ptrs_f32`] from host-side addresses: up to [`GATHER_INLINE`] pieces travel in the
/// kernel parameters (no upload), more in a table uploaded for the launch.
pub fn gather_addresses_f32(
    rt: &KernelRuntime,
    addresses: &[u64],
    width: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    if addresses.len() > GATHER_INLINE {
        let table = rt.htod(addresses).map_err(KernelError::driver(
            "uploading the gather's piece addresses",
        ))?;
        return launch_gather(rt, Some(&table), &[], addresses.len(), width, out);
    }
    launch_gather(rt, None, addresses, addresses.len(), width, out)
}

/// One gather launch over the device table `pieces`, or over `inline` when there is none.
fn launch_gather(
    rt: &KernelRuntime,
    pieces: Option<&CudaSlice<u64>>,
    inline: &[u64],
    n_pieces: usize,
    width: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gather_ptrs_f32";
    expect_len(OP, "out", out.len(), n_pieces * width)?;
    if n_pieces == 0 || width == 0 {
        return Ok(());
    }
    let width_u32 = dim(OP, "width", width)?;
    let n_pieces_u32 = dim(OP, "pieces", n_pieces)?;
    let mut by_value = InlinePieces {
        pieces: [0; GATHER_INLINE],
    };
    if pieces.is_none() {
        ensure(
            inline.len() == n_pieces && n_pieces <= GATHER_INLINE,
            OP,
            || {
                format!(
                    "{} inline addresses for {n_pieces} pieces (at most {GATHER_INLINE})",
                    inline.len()
                )
            },
        )?;
        by_value.pieces[..n_pieces].copy_from_slice(inline);
    }
    // movement.cu's GATHER_TILE columns a block, pieces along y (at most GATHER_PIECE_BLOCKS
    // rows of blocks; the kernel strides over the rest).
    let column_blocks = dim(OP, "column tiles", width.div_ceil(GATHER_TILE))?;
    let cfg = launch_config(
        (column_blocks, n_pieces_u32.min(GATHER_PIECE_BLOCKS), 1),
        THREADS,
        0,
    );
    let null_table = 0u64;
    let mut launch = rt.launcher(KernelId::GatherPtrsF32)?;
    match pieces {
        Some(table) => launch.arg(table),
        None => launch.arg(&null_table),
    };
    launch
        .arg(&by_value)
        .arg(out)
        .arg(&width_u32)
        .arg(&n_pieces_u32);
    // SAFETY: signature (const u64* pieces, InlinePieces inline, float* out, u32 width,
    // u32 n_pieces); a null `pieces` makes the kernel read the first n_pieces addresses of
    // `inline` (all set above); out holds n_pieces * width values (checked) and the loops stop at
    // n_pieces and width; each address points at `width` readable floats of a live device buffer
    // (the caller's contract, see `key_table`).
    unsafe { launch.launch(cfg) }
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
    let cfg = grid_stride_config(x.len().div_ceil(4), THREADS); // a thread per 4 values
    let mut launch = rt.launcher(KernelId::Bf16ToF32)?;
    launch.arg(x).arg(out).arg(&n);
    // SAFETY: signature (const u16* x, float* out, u64 n); both hold n values (checked), the
    // kernel's grid-stride loop stops at n.
    unsafe { launch.launch(cfg) }
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
    let cfg = grid_stride_config(x.len(), THREADS);
    let mut launch = rt.launcher(KernelId::AddF32)?;
    launch.arg(x).arg(y).arg(&n);
    // SAFETY: signature (float* x, const float* y, u64 n); both hold n values (checked), the
    // kernel's grid-stride loop stops at n.
    unsafe { launch.launch(cfg) }
}
