//! Typed launchers, one module per operation. Each checks its buffers' lengths against the shape
//! it is given and returns [`crate::KernelError::Shape`] before launching anything.

pub mod attention;
pub mod engram;
pub mod gemm;
pub mod gemm_fast;
pub mod index;
pub mod key_table;
pub mod linear;
pub mod linear_fast;
pub mod mhc;
pub mod moe;
pub mod movement;
pub mod norm;
pub mod qdq;
pub mod quant;
pub mod rope;
pub mod routed;
pub mod routed_exact;
pub mod routed_fast;
pub mod rows;
pub mod sampling;
pub mod topk;
pub mod v4;

use cudarc::driver::LaunchConfig;

use crate::error::KernelError;
use crate::id::KernelId;

/// How an op on f32 storage rounds its outputs: to bf16 at the reference's rounding points
/// (V4.1), or not at all (fp32, the float32 reference of V4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    Bf16,
    F32,
}

impl Rounding {
    /// The kernels' `round_bf16` flag.
    pub(crate) fn flag(self) -> u32 {
        u32::from(self == Rounding::Bf16)
    }

    /// Of an op built once per rounding, the kernel of this one: `bf16` or `f32`.
    pub(crate) fn kernel(self, bf16: KernelId, f32: KernelId) -> KernelId {
        match self {
            Rounding::Bf16 => bf16,
            Rounding::F32 => f32,
        }
    }
}

/// `grid` blocks of `threads` threads each, with `shared_bytes` of dynamic shared memory.
pub(crate) fn launch_config(
    grid: (u32, u32, u32),
    threads: u32,
    shared_bytes: u32,
) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared_bytes,
    }
}

/// A grid-stride launch over `n` values: blocks of `threads` threads, at least one and at most
/// 4096 blocks (the kernel loops over the rest).
pub(crate) fn grid_stride_config(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 4096) as u32;
    launch_config((blocks, 1, 1), threads, 0)
}

/// The [`KernelError::Shape`] error of `op`: its arguments do not fit together, as `message` says.
pub(crate) fn shape_error(op: &'static str, message: impl Into<String>) -> KernelError {
    KernelError::Shape {
        op,
        message: message.into(),
    }
}

/// `Ok` when `ok`, else the shape error of `op` with `message()` (built only on failure: the
/// checks run on every launch).
pub(crate) fn ensure<M: Into<String>>(
    ok: bool,
    op: &'static str,
    message: impl FnOnce() -> M,
) -> Result<(), KernelError> {
    if ok {
        Ok(())
    } else {
        Err(shape_error(op, message()))
    }
}

/// `len / width`, the number of `width`-wide rows in `len` values, or the shape error of `op`
/// with `message()` unless `width` is positive and they are whole rows.
pub(crate) fn whole_rows<M: Into<String>>(
    op: &'static str,
    len: usize,
    width: usize,
    message: impl FnOnce() -> M,
) -> Result<usize, KernelError> {
    ensure(width != 0 && len.is_multiple_of(width), op, message)?;
    Ok(len / width)
}

/// `value` as a u32 kernel dimension, or a shape error naming it.
pub(crate) fn dim(op: &'static str, what: &str, value: usize) -> Result<u32, KernelError> {
    u32::try_from(value).map_err(|_| shape_error(op, format!("{what} = {value} exceeds u32")))
}

/// Chains of the CPU reference's sgemm summation order for a dot product of `k` products
/// (`deepinfer_model::quant::sgemm_chains`, `refmath::sgemm_chains`): the largest power of two
/// that keeps every chain at least 256 products long.
pub(crate) fn sgemm_chains(k: usize) -> usize {
    let mut chains = 1;
    while k >= 2 * 256 * chains {
        chains *= 2;
    }
    chains
}

/// A shape error unless `found == expected`.
pub(crate) fn expect_len(
    op: &'static str,
    what: &str,
    found: usize,
    expected: usize,
) -> Result<(), KernelError> {
    ensure(found == expected, op, || {
        format!("{what} has {found} elements, expected {expected}")
    })
}

/// The field names, in order, of `struct name { ... };` in a CUDA header (for the layout tests of
/// the launchers' `#[repr(C)]` mirrors).
#[cfg(test)]
pub(crate) fn cuda_struct_fields(header: &str, name: &str) -> Vec<String> {
    let Some(start) = header.find(&format!("struct {name} {{")) else {
        return Vec::new();
    };
    let body = &header[start..];
    let body = &body[..body.find("};").unwrap_or(body.len())];
    body.lines()
        .skip(1)
        .filter_map(|line| line.split_once(';').map(|(decl, _)| decl))
        .filter_map(|decl| decl.split_whitespace().last().map(str::to_string))
        .collect()
}

/// Asserts that `T` is `size` bytes and mirrors the CUDA struct of its name in `header`: the same
/// `fields`, in order.
#[cfg(test)]
#[track_caller]
pub(crate) fn assert_mirrors<T>(header: &str, size: usize, fields: &[&str]) {
    let name = std::any::type_name::<T>()
        .rsplit("::")
        .next()
        .unwrap_or_default();
    assert_eq!(std::mem::size_of::<T>(), size, "{name}");
    assert_eq!(cuda_struct_fields(header, name), fields, "{name}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_stride_launch_covers_n_in_one_to_4096_blocks() {
        let blocks = |n| grid_stride_config(n, 256).grid_dim;
        assert_eq!(blocks(0), (1, 1, 1), "an empty launch still has a block");
        assert_eq!(blocks(256), (1, 1, 1));
        assert_eq!(blocks(257), (2, 1, 1));
        assert_eq!(blocks(4096 * 256), (4096, 1, 1));
        assert_eq!(
            blocks(4096 * 256 + 1),
            (4096, 1, 1),
            "the kernel strides over the rest"
        );
        let cfg = grid_stride_config(1000, 128);
        assert_eq!((cfg.block_dim, cfg.shared_mem_bytes), ((128, 1, 1), 0));
    }

    #[test]
    fn a_launch_config_is_its_grid_threads_and_shared_bytes() {
        let cfg = launch_config((3, 5, 7), 96, 4096);
        assert_eq!(cfg.grid_dim, (3, 5, 7));
        assert_eq!(cfg.block_dim, (96, 1, 1));
        assert_eq!(cfg.shared_mem_bytes, 4096);
    }
}
