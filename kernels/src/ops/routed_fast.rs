//! The routed experts of the `fast` numerics: FP4 E2M1 expert weights on tensor cores
//! (`cuda/gemm/gemm_fast.cuh`, the body of the fast dense GEMMs with each code converted exactly
//! to E4M3), the rows grouped per expert on the device (`group_routed_rows`, once per MoE call:
//! [`super::routed::ExpertGroups::fast`]), each tile of up to 8 … 128 rows of one expert
//! streaming that expert's re-laid weights ([`FastFp4Weight`]) once. SwiGLU and the combine stay
//! those of `ops::routed`.
//!
//! A routed row's output depends only on its activation row and its expert's weights: the tile
//! ([`FastTile`], picked by the mean rows per expert when the slots are grouped) and the rows
//! sharing it change which thread computes it, never how (the GPU tests check a row alone against
//! inside 2 … 64 tokens). [`ExpertProjection::GateUp`](super::routed::ExpertProjection::GateUp)
//! runs `w1` and `w3` in one launch (the column blocks of both: twice the blocks of a decode
//! step's few rows in flight), each plane bitwise its own launch's. Production launches sum K in
//! one part; the benchmark's tile sweep also launches builds of other tiles and K splits
//! ([`gemm_fp4_routed_fast_variant`]).

use super::gemm_fast::{FastKernel, FastKernels, FastOutput, FastTile, FastVariant, reduce_parts};
use super::quant::DeviceActFp8;
use super::routed::{DeviceExpertTable, ExpertFormat, RoutedRows, SlotKernels, check_routed};
use super::{dim, ensure, launch_config};
use crate::error::KernelError;
use crate::params::FastRoutedParams;
use crate::runtime::KernelRuntime;

/// The [`RoutedRows`] `rows` of a [`DeviceExpertTable::fp4_fast`] table into `out` (as
/// [`super::routed::gemm_routed`] does), the slots grouped by
/// [`ExpertGroups::fast`](super::routed::ExpertGroups::fast): the
/// routed tile of their tile rows (the result does not depend on it). One K part. `out` bf16
/// (V4.1) or f32 (V4): see [`FastOutput`].
pub fn gemm_fp4_routed_fast<Y: FastOutput>(
    rt: &KernelRuntime,
    rows: RoutedRows<'_, DeviceActFp8>,
    table: &DeviceExpertTable,
    out: &mut Y,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp4_routed_fast";
    let (m, n, k) = check_routed(OP, ExpertFormat::Fp4Fast, rows, table, out.buffer())?;
    if m == 0 {
        return Ok(());
    }
    let tile_rows = rows
        .groups
        .groups_for(OP, SlotKernels::Fast, table)?
        .tile_rows;
    // The smallest routed tile that holds the groups' tiles: the tile they were grouped for.
    let kernel = FastKernel::production(rt, FastKernels::Fp4Routed, FastTile::Auto, tile_rows, k)?;
    launch_routed(rt, OP, &kernel, rows, table, out, (m, n, k))
}

/// [`gemm_fp4_routed_fast`] through a [`FastVariant`] of `FastKernels::Fp4Routed` (the
/// benchmark's sweep; the slots grouped in tiles of at most its token rows,
/// [`super::routed::ExpertGroups::fast_tile_rows`]): its tile, and K in parts of its span added by
/// `gemm_fast_reduce` in part order (one part when the span holds K: the production's bits).
pub fn gemm_fp4_routed_fast_variant<Y: FastOutput>(
    rt: &KernelRuntime,
    rows: RoutedRows<'_, DeviceActFp8>,
    table: &DeviceExpertTable,
    out: &mut Y,
    variant: &FastVariant,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp4_routed_fast_variant";
    let (m, n, k) = check_routed(OP, ExpertFormat::Fp4Fast, rows, table, out.buffer())?;
    if m == 0 {
        return Ok(());
    }
    let kernel = FastKernel::variant(OP, variant, FastKernels::Fp4Routed)?;
    launch_routed(rt, OP, &kernel, rows, table, out, (m, n, k))
}

/// Launches the routed `kernel` on the checked `rows` (`m` output rows of the `[n, k]`
/// projection), K in parts of `kernel.span` codes.
fn launch_routed<Y: FastOutput>(
    rt: &KernelRuntime,
    op: &'static str,
    kernel: &FastKernel,
    rows: RoutedRows<'_, DeviceActFp8>,
    table: &DeviceExpertTable,
    out: &mut Y,
    (m, n, k): (usize, usize, usize),
) -> Result<(), KernelError> {
    let (x, x_row_div, which) = (rows.x, rows.x_row_div, rows.which);
    let (tokens, warps) = kernel.block;
    let parts = k.div_ceil(kernel.span).max(1);
    let projections = which.planes();
    ensure(parts == 1 || projections == 1, op, || {
        format!("{which:?} runs in one K part ({parts} asked)")
    })?;
    let params = FastRoutedParams {
        m: dim(op, "m", m)?,
        n: dim(op, "n", n)?,
        k: dim(op, "k", k)?,
        span: dim(op, "span", kernel.span)?,
        parts: dim(op, "parts", parts)?,
        x_row_div: dim(op, "x_row_div", x_row_div)?,
        n_experts: dim(op, "experts", table.n_experts())?,
        which: which.slot(),
        store: Y::STORE,
        projections: dim(op, "projections", projections)?,
    };
    let groups = rows.groups.groups_for(op, SlotKernels::Fast, table)?;
    ensure(groups.tile_rows <= tokens as usize, op, || {
        format!(
            "slots grouped in tiles of {} rows, a kernel of {tokens} token rows",
            groups.tile_rows
        )
    })?;
    let tiles = dim(op, "tiles", groups.max_tiles)?;
    ensure(tiles <= 65_535 && params.parts <= 65_535, op, || {
        format!("m = {m} needs up to {tiles} expert tiles, K {parts} parts (> 65535)")
    })?;
    // blockIdx.z: the K part, or with several projections (one part) the projection.
    let cfg = launch_config(
        (
            params.n.div_ceil(16 * warps),
            tiles,
            params.parts.max(params.projections),
        ),
        warps * 32,
        kernel.shared_bytes,
    );
    // The parts' sums [parts][m][n] (one value, unread, with one part).
    let count = m * n;
    // SAFETY: with parts > 1 every block writes its part's sums (zeros for unknown ids) of its
    // tile's rows and its columns; the tiles hold every row (order is a permutation of 0..m) and
    // the column blocks every column, so the launch writes all parts * m * n values before the
    // reduction reads them, in stream order; with one part the kernel never touches the buffer.
    let mut partials =
        unsafe { rt.alloc_written::<f32>(if parts > 1 { parts * count } else { 1 }) }.map_err(
            KernelError::driver("allocating the routed GEMM's part sums"),
        )?;
    let mut launch = rt.launcher_of(kernel.function, kernel.name);
    launch.arg(&x.codes).arg(&x.scales);
    groups
        .push_args(&mut launch, table.addresses())
        .arg(out.buffer())
        .arg(&mut partials)
        .arg(&params);
    // SAFETY: signature (const u8* a, const float* sa, const u32* order, const u32* tiles,
    // const u32* tile_count, const u64* table, void* y, float* partials, FastRoutedParams), y
    // written as Y::Value (store = Y::STORE, FastOutput sealed to bf16 and f32 buffers). The
    // groups are those of the m slot ids (check_routed) over this table's n_experts
    // (groups_for), tiles of at most `tokens` rows (checked above: the kernel's BT); blocks past
    // *tile_count return; a tile's rows are output rows < m (order is a permutation of 0..m),
    // each reading x row j / x_row_div < x.rows (x holds x.rows * k codes and x.rows * k / 32
    // scales); the table holds 3 * n_experts address pairs of live FastFp4Weights of this shape
    // (the constructor's contract: chunks and band scales built for n, k), the bucket of unknown
    // ids is never looked up; block z reads K codes [z span, min(k, (z + 1) span)) with
    // z < parts = ceil(k / span), span a multiple of the kernel's stage (FastKernel); every load
    // is bounds-checked against n, k and the tile's count; with projections > 1 (one part)
    // block z computes slot which + z < 3 (GateUp: slots 0 and 1) into plane z; out holds
    // projections * m * n values (check_routed), partials parts * m * n when parts > 1 (then
    // one projection, checked above).
    unsafe { launch.launch(cfg) }?;
    if parts > 1 {
        reduce_parts(rt, op, &partials, out, count, parts)?;
    }
    Ok(())
}
