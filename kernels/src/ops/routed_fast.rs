//! The routed experts of the `fast` numerics: FP4 E2M1 expert weights on tensor cores
//! (`cuda/gemm/gemm_fast.cuh`, the body of the fast dense GEMMs with each code converted exactly
//! to E4M3), the rows grouped per expert on the device (`group_routed_rows`, as the exact
//! expert-major kernel), each tile of up to 8 … 128 rows of one expert streaming that expert's
//! re-laid weights ([`FastFp4Weight`]) once. SwiGLU and the combine stay those of
//! `ops::routed`.
//!
//! A routed row's output depends only on its activation row and its expert's weights: the tile
//! ([`FastTile`], picked by the mean rows per expert) and the rows sharing it change which
//! thread computes it, never how (the GPU tests check a row alone against inside 2 … 64 tokens).

use cudarc::driver::CudaSlice;

use super::gemm_fast::{FastKernels, FastOutput, FastTile};
use super::quant::DeviceActFp8;
use super::routed::{DeviceExpertTable, ExpertFormat, RoutedRows, check_routed, group_rows};
use super::{dim, ensure, launch_config};
use crate::error::KernelError;
use crate::params::FastRoutedParams;
use crate::runtime::KernelRuntime;

/// The [`RoutedRows`] `rows` of a [`DeviceExpertTable::fp4_fast`] table into `out` (as
/// [`super::routed::gemm_routed`], which runs this with [`FastTile::Auto`]) with an explicit tile
/// (the result does not depend on it); `Auto` takes the smallest tile that holds the mean rows
/// per expert. `out` bf16 (V4.1) or f32 (V4): see [`FastOutput`].
pub fn gemm_fp4_routed_fast_tiled<T: FastOutput>(
    rt: &KernelRuntime,
    rows: RoutedRows<'_, DeviceActFp8>,
    table: &DeviceExpertTable,
    out: &mut CudaSlice<T>,
    tile: FastTile,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp4_routed_fast";
    let (m, n, k) = check_routed(OP, ExpertFormat::Fp4Fast, rows, table, out)?;
    let (x, experts, x_row_div, which) = (rows.x, rows.experts, rows.x_row_div, rows.which);
    if m == 0 {
        return Ok(());
    }
    let tile = tile
        .resolve(m.div_ceil(table.n_experts()))
        .fitting(FastKernels::Fp4Routed, k);
    let (tokens, warps) = FastKernels::Fp4Routed.block(tile);
    let params = FastRoutedParams {
        m: dim(OP, "m", m)?,
        n: dim(OP, "n", n)?,
        k: dim(OP, "k", k)?,
        x_row_div: dim(OP, "x_row_div", x_row_div)?,
        n_experts: dim(OP, "experts", table.n_experts())?,
        which: which.slot(),
        out_f32: T::OUT_F32,
    };
    let groups = group_rows(
        rt,
        OP,
        &experts.slice(..),
        table.n_experts(),
        tokens as usize,
    )?;
    let tiles = dim(OP, "tiles", groups.max_tiles)?;
    ensure(tiles <= 65_535, OP, || {
        format!("m = {m} needs up to {tiles} expert tiles (> 65535)")
    })?;
    let kernel = FastKernels::Fp4Routed.kernel(tile);
    let cfg = launch_config(
        (params.n.div_ceil(16 * warps), tiles, 1),
        warps * 32,
        FastKernels::Fp4Routed.launch_shared_bytes(tile, k),
    );
    let mut launch = rt.launcher(kernel)?;
    launch.arg(&x.codes).arg(&x.scales);
    groups
        .push_args(&mut launch, table.addresses())
        .arg(out)
        .arg(&params);
    // SAFETY: signature (const u8* a, const float* sa, const u32* order, const u32* tiles,
    // const u32* tile_count, const u64* table, void* y, FastRoutedParams), y written as T
    // (out_f32 = T::OUT_F32, FastOutput sealed to bf16 and f32). group_rows wrote
    // tiles of at most `tokens` rows (the kernel's BT), blocks past *tile_count return; a tile's
    // rows are output rows < m (order is a permutation of 0..m), each reading x row
    // j / x_row_div < x.rows (x holds x.rows * k codes and x.rows * k / 32 scales); the table
    // holds 3 * n_experts address pairs of live FastFp4Weights of this shape (the constructor's
    // contract: chunks and band scales built for n, k), the bucket of unknown ids is never looked
    // up; every load is bounds-checked against n, k and the tile's count; out holds m * n values.
    unsafe { launch.launch(cfg) }
}
