//! The routed experts of an MoE layer driven by device routes (`route_experts_f32`'s `experts`
//! and `weights`), with no copy to the host: a device table of the layer's expert weights
//! ([`DeviceExpertTable`]), the routed GEMM whose every output row takes its own expert's weight
//! ([`gemm_routed`] for FP4 and FP8 experts; one row per block for decode, or rows grouped by
//! expert on the device into tiles of up to 32 rows whose expert's weights are read once, see
//! [`RoutedBlocks`]; the grouping is made once per MoE call for its three projections, see
//! [`ExpertGroups`]), the SwiGLU of expert rows quantised for `w2` in the same kernel
//! ([`swiglu_act_quant_fp8`]; [`swiglu_rows`] keeps f32 rows for V4's exact experts) and the
//! combine of a token's slot outputs with the shared expert ([`moe_combine`]). Each reproduces
//! `deepinfer_model::layers::moe::forward_rows` bit for bit (see `cuda/moe/routed.cu`).

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr};
use half::bf16;

use super::gemm::{DeviceFp4Weight, DeviceFp8Weight, GemmSplit, WARPS};
use super::gemm_fast::{FastFp4Weight, FastKernels, FastTile};
use super::quant::{ActGroup, DeviceActFp8, ELEMENTS_PER_WARP, WARPS_PER_BLOCK};
use super::routed_fast::gemm_fp4_routed_fast;
use super::{
    Rounding, dim as kernel_dim, ensure, expect_len, launch_config, shape_error, whole_rows,
};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::ActQuantParams;
use crate::runtime::{KernelRuntime, KernelValue, Launch};

/// Rows of one expert per routed-GEMM tile (`routed::TILE_ROWS`).
const TILE_ROWS: usize = 8;
/// Rows of one expert per tile of the expert-major kernel (`routed::EXPERT_TILE_ROWS`).
const EXPERT_TILE_ROWS: usize = 32;
/// Floats per tile row and warp of the expert-major kernel's shared partials (32 + 1 padding).
const EXPERT_PARTIAL_STRIDE: u32 = 33;
/// Output rows up to which [`RoutedBlocks::Auto`] takes one row per block. Measured on the H200
/// (real width, top-6, routed w1 alone; bench/README.md): one row per block 85 / 608 µs at 6 /
/// 48 rows against 96 / 641 µs for the expert-major tiles; at 384 rows the tiles win (3.89 ms
/// against 4.86 ms), and at 6144 rows (a 1024-token prefill) 28.1 ms against 77.6 ms (8-row
/// tiles: 31.7 ms).
const ROWS_PER_BLOCK_MAX: usize = 64;
/// Threads of the grouping kernel (`routed::GROUP_THREADS`).
const GROUP_THREADS: u32 = 1024;
/// Experts whose grouping counters fit the grouping kernel's shared memory comfortably.
const MAX_EXPERTS: usize = 4096;
/// Slots per token the combine kernel sorts (`routed::MAX_SLOTS`).
const MAX_SLOTS: usize = 64;
/// Threads per block of the combine kernel (`routed::COMBINE_THREADS`).
const COMBINE_THREADS: u32 = 256;
/// Threads per block of the SwiGLU kernel.
const SWIGLU_THREADS: u32 = 256;

/// Blocks of the SwiGLU kernel at most (it strides over the rest).
const SWIGLU_MAX_BLOCKS: u32 = 1 << 16;

/// `routed::RoutedGemmParams` in `cuda/moe/routed.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RoutedGemmParams {
    m: u32,
    n: u32,
    k: u32,
    w_scale_cols: u32,
    warps_per_col: u32,
    x_row_div: u32,
    n_experts: u32,
    which: u32,
}

/// `routed::GroupParams` in `cuda/moe/routed.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GroupParams {
    m: u32,
    n_experts: u32,
    tile_rows: u32,
}

/// `routed::SwigluParams` in `cuda/moe/routed.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
struct SwigluParams {
    n: u32,
    inter: u32,
    has_weights: u32,
    limit: f32,
    round_bf16: u32,
}

/// `routed::CombineParams` in `cuda/moe/routed.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CombineParams {
    rows: u32,
    k: u32,
    dim: u32,
    n_experts: u32,
    round_bf16: u32,
}

// SAFETY: plain `#[repr(C)]` structs of 32-bit fields, laid out as their CUDA mirrors.
unsafe impl KernelValue for RoutedGemmParams {}
// SAFETY: as above.
unsafe impl KernelValue for GroupParams {}
// SAFETY: as above.
unsafe impl KernelValue for SwigluParams {}
// SAFETY: as above.
unsafe impl KernelValue for CombineParams {}

/// One projection of a SwiGLU expert, or its gate and up projections together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProjection {
    /// Gate, `[inter, dim]`.
    W1,
    /// Up, `[inter, dim]`.
    W3,
    /// Down, `[dim, inter]`.
    W2,
    /// Gate and up of the same rows: the output holds two planes, `[2][m][inter]` (`W1`'s, then
    /// `W3`'s), bitwise what a `W1` and a `W3` launch give (the fast kernels run both in one
    /// launch).
    GateUp,
}

impl ExpertProjection {
    /// The table slot (`which` in the kernel): the first of [`ExpertProjection::planes`].
    pub(super) fn slot(self) -> u32 {
        match self {
            ExpertProjection::W1 | ExpertProjection::GateUp => 0,
            ExpertProjection::W3 => 1,
            ExpertProjection::W2 => 2,
        }
    }

    /// `(out, inp)` of this projection (of each plane) in experts of width `dim` and hidden
    /// width `inter`.
    pub(super) fn shape(self, dim: usize, inter: usize) -> (usize, usize) {
        match self {
            ExpertProjection::W1 | ExpertProjection::W3 | ExpertProjection::GateUp => (inter, dim),
            ExpertProjection::W2 => (dim, inter),
        }
    }

    /// How many projections (consecutive table slots, output planes) this is.
    pub fn planes(self) -> usize {
        match self {
            ExpertProjection::GateUp => 2,
            ExpertProjection::W1 | ExpertProjection::W3 | ExpertProjection::W2 => 1,
        }
    }
}

/// How the routed GEMM assigns output rows to blocks (the result does not depend on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoutedBlocks {
    /// [`RoutedBlocks::Rows`] up to 64 output rows (decode), [`RoutedBlocks::Experts`] above.
    Auto,
    /// One output row per block, straight from the routes.
    Rows,
    /// Rows grouped by expert on the device, up to 8 rows of one expert per block (each weight
    /// load and decode serves all of them).
    Tiles,
    /// Rows grouped by expert on the device, up to 32 rows of one expert per block, one warp per
    /// output column with one k-group per lane and five 32-group steps of weight loads in flight:
    /// an expert's weights are read once per launch for up to 32 of its rows.
    Experts,
}

/// The weight format of a table's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertFormat {
    /// FP4 E2M1 with 1×32 UE8M0 scales ([`DeviceFp4Weight`]).
    Fp4,
    /// FP8 E4M3 with 32×32 UE8M0 tiles ([`DeviceFp8Weight`] of tile 32).
    Fp8T32,
    /// FP4 E2M1 laid out for the `fast` tensor-core GEMM ([`FastFp4Weight`]; launched by
    /// [`super::routed_fast::gemm_fp4_routed_fast`]).
    Fp4Fast,
}

/// The three weights of one expert, borrowed for [`DeviceExpertTable`]'s constructors.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRefs<'a, W> {
    pub w1: &'a W,
    pub w3: &'a W,
    pub w2: &'a W,
}

/// The device address table of one layer's routed experts, all of one shape (`w1`, `w3`
/// `[inter, dim]`, `w2` `[dim, inter]`): `[3][n_experts][2]` addresses (codes, scales) of w1, w3,
/// w2, and the experts' `format` ([`ExpertFormat`] for the routed GEMMs' [`DeviceExpertTable`],
/// one per projection for the exact linears' [`super::routed_exact::DeviceExactExpertTable`]).
/// Built once from the cached weights; it does not own them.
#[derive(Debug)]
pub struct ExpertTable<F> {
    format: F,
    n_experts: usize,
    dim: usize,
    inter: usize,
    addresses: CudaSlice<u64>,
}

/// The table of the routed GEMMs ([`gemm_routed`], [`super::routed_fast::gemm_fp4_routed_fast`]):
/// every weight of one [`ExpertFormat`].
pub type DeviceExpertTable = ExpertTable<ExpertFormat>;

/// One weight of an expert, as a table holds it: its shape `(out, inp)` and the device addresses
/// of its codes (or values) and scales.
pub(super) struct TableEntry {
    pub(super) shape: (usize, usize),
    pub(super) codes: u64,
    pub(super) scales: u64,
}

impl<F: Copy> ExpertTable<F> {
    /// The table of `experts` in `format`: `entries(e, expert)` checks expert `e`'s weights and
    /// gives them, `[w1, w3, w2]`; every expert has expert 0's shapes.
    pub(super) fn upload<E>(
        rt: &KernelRuntime,
        op: &'static str,
        format: F,
        experts: &[E],
        entries: impl Fn(usize, &E) -> Result<[TableEntry; 3], KernelError>,
    ) -> Result<ExpertTable<F>, KernelError> {
        let Some(first) = experts.first() else {
            return Err(shape_error(op, "no experts"));
        };
        let [w1, ..] = entries(0, first)?;
        let (inter, dim) = w1.shape;
        let mut addresses = vec![0u64; 3 * experts.len() * 2];
        for (e, expert) in experts.iter().enumerate() {
            let projections = [ExpertProjection::W1, ExpertProjection::W3, ExpertProjection::W2];
            for (projection, weight) in projections.into_iter().zip(entries(e, expert)?) {
                let expected = projection.shape(dim, inter);
                ensure(weight.shape == expected, op, || {
                    format!(
                        "expert {e} {projection:?} is {:?}, expected {expected:?} (as expert 0)",
                        weight.shape
                    )
                })?;
                let at = (projection.slot() as usize * experts.len() + e) * 2;
                addresses[at] = weight.codes;
                addresses[at + 1] = weight.scales;
            }
        }
        let addresses = rt
            .htod(&addresses)
            .map_err(KernelError::driver("uploading the expert address table"))?;
        Ok(ExpertTable {
            format,
            n_experts: experts.len(),
            dim,
            inter,
            addresses,
        })
    }

    /// The experts' format (of the whole table or per projection, as `F` says).
    pub fn format(&self) -> F {
        self.format
    }

    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    /// The model width (`w1`/`w3` inputs, `w2` outputs).
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The expert's hidden width (`w1`/`w3` outputs, `w2` inputs).
    pub fn inter(&self) -> usize {
        self.inter
    }

    /// The device address table, `[3][n_experts][2]` (codes, scales).
    pub(super) fn addresses(&self) -> &CudaSlice<u64> {
        &self.addresses
    }
}

impl DeviceExpertTable {
    /// The table of FP4 experts (expert `e` is `experts[e]`).
    ///
    /// # Safety
    /// The table keeps the weights' device addresses, not the weights: every weight in `experts`
    /// must stay alive (and unmoved on the device) for as long as launches read this table.
    pub unsafe fn fp4(
        rt: &KernelRuntime,
        experts: &[ExpertRefs<'_, DeviceFp4Weight>],
    ) -> Result<DeviceExpertTable, KernelError> {
        let op = "DeviceExpertTable::fp4";
        DeviceExpertTable::build(rt, op, ExpertFormat::Fp4, experts, |w| {
            Ok(((w.out, w.inp), &w.packed, &w.scales))
        })
    }

    /// The table of FP8 experts with 32×32 tiles.
    ///
    /// # Safety
    /// As [`DeviceExpertTable::fp4`]: the weights must outlive every launch reading the table.
    pub unsafe fn fp8(
        rt: &KernelRuntime,
        experts: &[ExpertRefs<'_, DeviceFp8Weight>],
    ) -> Result<DeviceExpertTable, KernelError> {
        let op = "DeviceExpertTable::fp8";
        DeviceExpertTable::build(rt, op, ExpertFormat::Fp8T32, experts, |w| {
            ensure(w.tile == 32, op, || {
                format!("FP8 expert with {0}x{0} tiles (only 32x32)", w.tile)
            })?;
            Ok(((w.out, w.inp), &w.codes, &w.scales))
        })
    }

    /// The table of FP4 experts laid out for the `fast` GEMM.
    ///
    /// # Safety
    /// As [`DeviceExpertTable::fp4`]: the weights must outlive every launch reading the table.
    pub unsafe fn fp4_fast(
        rt: &KernelRuntime,
        experts: &[ExpertRefs<'_, FastFp4Weight>],
    ) -> Result<DeviceExpertTable, KernelError> {
        let op = "DeviceExpertTable::fp4_fast";
        DeviceExpertTable::build(rt, op, ExpertFormat::Fp4Fast, experts, |w| {
            Ok(((w.out, w.inp), &w.chunks, &w.band_scales))
        })
    }

    /// The table of `experts` in `format`, `parts(weight)` checking a weight and giving its
    /// shape `(out, inp)`, codes and scales.
    fn build<W>(
        rt: &KernelRuntime,
        op: &'static str,
        format: ExpertFormat,
        experts: &[ExpertRefs<'_, W>],
        parts: impl Fn(&W) -> Result<((usize, usize), &CudaSlice<u8>, &CudaSlice<u8>), KernelError>,
    ) -> Result<DeviceExpertTable, KernelError> {
        ensure(experts.len() <= MAX_EXPERTS, op, || {
            format!("{} experts (at most {MAX_EXPERTS})", experts.len())
        })?;
        let stream = rt.stream();
        let entry = |weight: &W| -> Result<TableEntry, KernelError> {
            let (shape, codes, scales) = parts(weight)?;
            Ok(TableEntry {
                shape,
                codes: codes.device_ptr(stream).0,
                scales: scales.device_ptr(stream).0,
            })
        };
        ExpertTable::upload(rt, op, format, experts, |_, expert| {
            Ok([entry(expert.w1)?, entry(expert.w3)?, entry(expert.w2)?])
        })
    }
}

/// Which routed kernels read the slots of an [`ExpertGroups`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotKernels {
    /// FP4/FP8 tables, one output row per block, straight from the ids (no grouping).
    Rows,
    /// FP4/FP8 tables, block-tiled tiles of up to 8 rows of one expert.
    Tiles,
    /// FP4/FP8 tables, expert-major tiles of up to 32 rows of one expert.
    Experts,
    /// A fast FP4 table (`ops::routed_fast`), tiles of up to the tensor-core tile's rows.
    Fast,
}

/// The slots of one MoE call as the routed GEMMs read them: their expert ids (`[m]`, ids `>=
/// n_experts` dropped) and, for the kernels that take tiles, the rows grouped by expert on the
/// device (`group_routed_rows`: an order of the rows, bucket by bucket, cut into tiles). The
/// grouping depends on the ids alone, so one serves the call's `w1`, `w3` and `w2` launches
/// (each of `m` output rows); the kernels and their tile are chosen here, for all three (the
/// result depends on neither).
pub struct ExpertGroups<'a> {
    experts: &'a CudaSlice<u32>,
    n_experts: usize,
    kernels: SlotKernels,
    /// `None` for [`SlotKernels::Rows`] and for no slots.
    groups: Option<RowGroups>,
}

impl<'a> ExpertGroups<'a> {
    /// The production layout of `table`'s kernels: [`RoutedBlocks::Auto`] for an FP4 or FP8
    /// table, [`FastTile::Auto`] for a fast FP4 table.
    pub fn new(
        rt: &KernelRuntime,
        experts: &'a CudaSlice<u32>,
        table: &DeviceExpertTable,
    ) -> Result<ExpertGroups<'a>, KernelError> {
        match table.format {
            ExpertFormat::Fp4Fast => ExpertGroups::fast(rt, experts, table, FastTile::Auto),
            ExpertFormat::Fp4 | ExpertFormat::Fp8T32 => {
                ExpertGroups::blocks(rt, experts, table, RoutedBlocks::Auto)
            }
        }
    }

    /// The slots of an FP4 or FP8 `table`'s kernels in `blocks` ([`RoutedBlocks::Auto`]: one row
    /// per block up to 64 slots, expert-major tiles above).
    pub fn blocks(
        rt: &KernelRuntime,
        experts: &'a CudaSlice<u32>,
        table: &DeviceExpertTable,
        blocks: RoutedBlocks,
    ) -> Result<ExpertGroups<'a>, KernelError> {
        const OP: &str = "ExpertGroups::blocks";
        ensure(
            table.format != ExpertFormat::Fp4Fast,
            OP,
            || "fast FP4 tables take a FastTile (ExpertGroups::fast)",
        )?;
        let m = experts.len();
        let (kernels, tile_rows) = match blocks {
            RoutedBlocks::Auto if m <= ROWS_PER_BLOCK_MAX => (SlotKernels::Rows, 1),
            RoutedBlocks::Rows => (SlotKernels::Rows, 1),
            RoutedBlocks::Tiles => (SlotKernels::Tiles, TILE_ROWS),
            RoutedBlocks::Auto | RoutedBlocks::Experts => {
                (SlotKernels::Experts, EXPERT_TILE_ROWS.min(m))
            }
        };
        ExpertGroups::grouped(rt, OP, experts, table, kernels, tile_rows)
    }

    /// The slots of a fast FP4 `table`'s kernel with `tile` (`Auto`: the smallest routed tile
    /// that holds the mean rows per expert).
    pub fn fast(
        rt: &KernelRuntime,
        experts: &'a CudaSlice<u32>,
        table: &DeviceExpertTable,
        tile: FastTile,
    ) -> Result<ExpertGroups<'a>, KernelError> {
        let kernels = FastKernels::Fp4Routed;
        let per_expert = experts.len().div_ceil(table.n_experts);
        let (tokens, _) = kernels.block(tile.resolve(kernels, per_expert));
        ExpertGroups::fast_tile_rows(rt, experts, table, tokens as usize)
    }

    /// The slots of a fast FP4 `table` in tiles of at most `tile_rows` rows of one expert, read
    /// by any routed tensor-core build of at least that many token rows (the benchmark's tile
    /// sweep: a [`super::gemm_fast::FastVariant`]'s rows).
    pub fn fast_tile_rows(
        rt: &KernelRuntime,
        experts: &'a CudaSlice<u32>,
        table: &DeviceExpertTable,
        tile_rows: usize,
    ) -> Result<ExpertGroups<'a>, KernelError> {
        const OP: &str = "ExpertGroups::fast";
        ensure(table.format == ExpertFormat::Fp4Fast, OP, || {
            format!("a FastTile on a table of {:?} experts", table.format)
        })?;
        ExpertGroups::grouped(rt, OP, experts, table, SlotKernels::Fast, tile_rows)
    }

    /// `experts` grouped for `kernels` in tiles of at most `tile_rows` rows (no grouping for one
    /// row per block or no slots).
    fn grouped(
        rt: &KernelRuntime,
        op: &'static str,
        experts: &'a CudaSlice<u32>,
        table: &DeviceExpertTable,
        kernels: SlotKernels,
        tile_rows: usize,
    ) -> Result<ExpertGroups<'a>, KernelError> {
        let groups = if kernels == SlotKernels::Rows || experts.is_empty() {
            None
        } else {
            Some(group_rows(
                rt,
                op,
                &experts.slice(..),
                table.n_experts,
                tile_rows,
            )?)
        };
        Ok(ExpertGroups {
            experts,
            n_experts: table.n_experts,
            kernels,
            groups,
        })
    }

    /// The slots' expert ids.
    pub fn experts(&self) -> &CudaSlice<u32> {
        self.experts
    }

    /// The grouped rows for a launch of `kernels` on `table`'s experts: a shape error when these
    /// slots were laid out for other kernels or another table's expert count, or have no groups
    /// (`Rows`, or no slots: the launchers return before).
    pub(super) fn groups_for(
        &self,
        op: &'static str,
        kernels: SlotKernels,
        table: &DeviceExpertTable,
    ) -> Result<&RowGroups, KernelError> {
        ensure(
            self.kernels == kernels && self.n_experts == table.n_experts,
            op,
            || {
                format!(
                    "slots grouped for {:?} kernels over {} experts, launched as {kernels:?} \
                     over {}",
                    self.kernels, self.n_experts, table.n_experts
                )
            },
        )?;
        self.groups
            .as_ref()
            .ok_or_else(|| shape_error(op, "the slots hold no row groups"))
    }
}

/// The rows of a routed GEMM: output row `j` is `x[j / x_row_div] · W_{experts[j]}ᵀ` for the
/// `which` projection of a table's experts (`x` `[rows, inp]`, `groups` the `m = rows ·
/// x_row_div` slots with their expert ids, laid out for the table's kernels).
pub struct RoutedRows<'a, X> {
    pub x: &'a X,
    pub groups: &'a ExpertGroups<'a>,
    pub x_row_div: usize,
    pub which: ExpertProjection,
}

impl<X> Clone for RoutedRows<'_, X> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<X> Copy for RoutedRows<'_, X> {}

/// The [`RoutedRows`] `rows` of `table`'s experts into `out`: `x` 32-groups, `out` bf16 `[m,
/// out]` (a plane of it per projection: [`ExpertProjection::GateUp`]); a row whose id is `>=
/// table.n_experts()` is zero. The kernels are the ones the slots
/// were laid out for ([`ExpertGroups`]), of the table's format: FP4 and FP8 (32×32 tiles) rows
/// are bitwise what [`super::gemm::gemm_fp4`] / [`super::gemm::gemm_fp8`] give for that x row
/// and that expert's weight, whichever [`RoutedBlocks`]; a fast FP4 table runs the tensor-core
/// kernel of [`super::routed_fast`].
pub fn gemm_routed(
    rt: &KernelRuntime,
    rows: RoutedRows<'_, DeviceActFp8>,
    table: &DeviceExpertTable,
    out: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    match table.format {
        ExpertFormat::Fp4Fast => gemm_fp4_routed_fast(rt, rows, table, out),
        ExpertFormat::Fp4 | ExpertFormat::Fp8T32 => gemm_routed_block_scaled(rt, rows, table, out),
    }
}

/// [`gemm_routed`] on an FP4 or FP8 table: one row per block or the grouped tiles, as the slots
/// were laid out ([`ExpertGroups::blocks`]).
fn gemm_routed_block_scaled(
    rt: &KernelRuntime,
    rows: RoutedRows<'_, DeviceActFp8>,
    table: &DeviceExpertTable,
    out: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let op = match table.format {
        ExpertFormat::Fp8T32 => "gemm_fp8_routed",
        ExpertFormat::Fp4 | ExpertFormat::Fp4Fast => "gemm_fp4_routed",
    };
    let (m, n, k) = check_routed(op, table.format, rows, table, out)?;
    let (x, slots, x_row_div, which) = (rows.x, rows.groups, rows.x_row_div, rows.which);
    if m == 0 {
        return Ok(());
    }
    let per_row = slots.kernels == SlotKernels::Rows;
    let expert_major = slots.kernels == SlotKernels::Experts;
    // The per-row kernel runs one warp per output column (`gemm_warp_tile`); the tiles kernel
    // (block-tiled) splits K as the dense GEMM does. Measured on the H200: the column-per-warp
    // body is faster for one row and slower for tiles of 8 (real-width MoE at 64 rows 8.2 ->
    // 8.5 ms, so the tiles keep the block-tiled body).
    let mut warps_per_col = if per_row || expert_major {
        1
    } else {
        GemmSplit::Auto.warps_per_column(op, m, k / 32)?
    };
    while warps_per_col > 1 && n.div_ceil((WARPS / warps_per_col) as usize) > 65_535 {
        warps_per_col /= 2;
    }
    let mut params = RoutedGemmParams {
        m: kernel_dim(op, "m", m)?,
        n: kernel_dim(op, "n", n)?,
        k: kernel_dim(op, "k", k)?,
        w_scale_cols: kernel_dim(op, "weight scale columns", k / 32)?,
        warps_per_col,
        x_row_div: kernel_dim(op, "x_row_div", x_row_div)?,
        n_experts: kernel_dim(op, "experts", table.n_experts)?,
        which: which.slot(),
    };
    // One launch per projection (GateUp: w1, then w3), each into its plane of `out`.
    let planes = (0..which.planes()).map(|p| (which.slot() + p as u32, p * m * n..(p + 1) * m * n));
    let col_blocks = params.n.div_ceil(WARPS / warps_per_col);
    ensure(col_blocks <= 65_535, op, || {
        format!("n = {n} needs {col_blocks} column blocks (> 65535)")
    })?;
    let (rows_kernel, tiles_kernel, experts_kernel) = match table.format {
        ExpertFormat::Fp4 => (
            KernelId::GemmFp4RoutedRowsG32,
            KernelId::GemmFp4RoutedTilesG32,
            KernelId::GemmFp4RoutedExpertsG32,
        ),
        ExpertFormat::Fp8T32 => (
            KernelId::GemmFp8T32RoutedRowsG32,
            KernelId::GemmFp8T32RoutedTilesG32,
            KernelId::GemmFp8T32RoutedExpertsG32,
        ),
        ExpertFormat::Fp4Fast => {
            return Err(shape_error(
                op,
                "fast FP4 tables run the kernels of routed_fast (gemm_routed)",
            ));
        }
    };
    if per_row {
        ensure(slots.n_experts == table.n_experts, op, || {
            format!(
                "slots over {} experts, a table of {}",
                slots.n_experts, table.n_experts
            )
        })?;
        let cfg = launch_config((params.m, col_blocks, 1), WARPS * 32, 0);
        for (slot, plane) in planes {
            params.which = slot;
            let mut plane = out.slice_mut(plane);
            let mut launch = rt.launcher(rows_kernel)?;
            launch
                .arg(&x.codes)
                .arg(&x.scales)
                .arg(slots.experts)
                .arg(&table.addresses)
                .arg(&mut plane)
                .arg(&params);
            // SAFETY: signature (const u8* a, const float* sa, const u32* experts, const u64*
            // table, bf16* y, RoutedGemmParams). Block j < m computes output row j, reading x row
            // j / x_row_div < x.rows (x holds x.rows * k codes and x.rows * k / 32 scales) and
            // experts[j] (experts holds m ids, check_routed); the table holds 3 * n_experts
            // address pairs of live weights of this shape and format (the constructors'
            // contract), slot < 3, ids >= n_experts are never looked up; the plane holds m * n
            // values (out holds one per projection, check_routed).
            unsafe { launch.launch(cfg) }?;
        }
        return Ok(());
    }
    let kernels = if expert_major {
        SlotKernels::Experts
    } else {
        SlotKernels::Tiles
    };
    let groups = slots.groups_for(op, kernels, table)?;
    let (kernel, shared_bytes) = if expert_major {
        let tile_rows = kernel_dim(op, "tile rows", groups.tile_rows)?;
        ensure(groups.tile_rows <= EXPERT_TILE_ROWS, op, || {
            format!(
                "tiles of {} rows (at most {EXPERT_TILE_ROWS})",
                groups.tile_rows
            )
        })?;
        let partials = WARPS * tile_rows * EXPERT_PARTIAL_STRIDE;
        (experts_kernel, 4 * partials)
    } else {
        ensure(groups.tile_rows <= TILE_ROWS, op, || {
            format!("tiles of {} rows (at most {TILE_ROWS})", groups.tile_rows)
        })?;
        (tiles_kernel, 0)
    };
    let cfg = launch_config(
        (kernel_dim(op, "tiles", groups.max_tiles)?, col_blocks, 1),
        WARPS * 32,
        shared_bytes,
    );
    for (slot, plane) in planes {
        params.which = slot;
        let mut plane = out.slice_mut(plane);
        let mut launch = rt.launcher(kernel)?;
        launch.arg(&x.codes).arg(&x.scales);
        groups
            .push_args(&mut launch, &table.addresses)
            .arg(&mut plane)
            .arg(&params);
        // SAFETY: signature (const u8* a, const float* sa, const u32* order, const u32* tiles,
        // const u32* tile_count, const u64* table, bf16* y, RoutedGemmParams), both kernels. The
        // groups are those of the m slot ids (check_routed: experts holds m ids) over this
        // table's n_experts (groups_for). Blocks past *tile_count return; a tile holds at most
        // tile_rows rows, checked above against the kernel's (for the expert-major kernel the
        // dynamic shared memory holds WARPS * tile_rows * 33 partials, and it checks column
        // n < p.n per warp); its rows are output rows < m (order is a permutation of 0..m), each
        // reading x row j / x_row_div < x.rows (x holds x.rows * k codes and x.rows * k / 32
        // scales); the table holds 3 * n_experts address pairs of live weights of this shape and
        // format (the constructors' contract), slot < 3, the bucket of unknown ids is never
        // looked up; the plane holds m * n values (out one per projection, check_routed).
        unsafe { launch.launch(cfg) }?;
    }
    Ok(())
}

/// The checks of a routed launch of `format` experts: the table's format, 32-element groups,
/// `x`'s columns, `x_row_div > 0` and the lengths of the slots' ids and `out` (one `[m, n]`
/// plane per projection); gives (m, n, k): output rows, the projection's out and in features.
pub(super) fn check_routed<T>(
    op: &'static str,
    format: ExpertFormat,
    rows: RoutedRows<'_, DeviceActFp8>,
    table: &DeviceExpertTable,
    out: &CudaSlice<T>,
) -> Result<(usize, usize, usize), KernelError> {
    let (x, experts, x_row_div, which) = (rows.x, rows.groups.experts, rows.x_row_div, rows.which);
    ensure(table.format == format, op, || {
        format!("the table holds {:?} experts", table.format)
    })?;
    x.group.require_g32(op, "expert GEMMs")?;
    let (n, k) = which.shape(table.dim, table.inter);
    ensure(x.cols == k, op, || {
        format!("x has {} columns, {which:?} has {k} inputs", x.cols)
    })?;
    ensure(x_row_div != 0, op, || "x_row_div is 0")?;
    let m = x.rows * x_row_div;
    expect_len(op, "experts", experts.len(), m)?;
    expect_len(op, "out", out.len(), which.planes() * m * n)?;
    Ok((m, n, k))
}

/// The rows of a routed launch bucketed by expert on the device (`group_routed_rows`): `order`
/// (a permutation of the rows, bucket by bucket; ids `>= n_experts` in a last bucket), the tiles
/// `{bucket, start, count}` of at most `tile_rows` rows of one bucket and their count. At most
/// `max_tiles`: ceil(m / tile_rows) full tiles plus one partial tile per non-empty bucket.
pub(super) struct RowGroups {
    pub order: CudaSlice<u32>,
    pub tiles: CudaSlice<u32>,
    pub tile_count: CudaSlice<u32>,
    pub tile_rows: usize,
    pub max_tiles: usize,
}

impl RowGroups {
    /// Pushes what every routed kernel takes after its activations: these rows' `order`,
    /// `tiles` and `tile_count`, then the expert table's `addresses`.
    pub(super) fn push_args<'a, 'l>(
        &'a self,
        launch: &'l mut Launch<'a>,
        addresses: &'a CudaSlice<u64>,
    ) -> &'l mut Launch<'a> {
        launch
            .arg(&self.order)
            .arg(&self.tiles)
            .arg(&self.tile_count)
            .arg(addresses)
    }
}

/// Groups the `experts.len()` rows by their expert id (see [`RowGroups`]).
pub(super) fn group_rows(
    rt: &KernelRuntime,
    op: &'static str,
    experts: &CudaView<'_, u32>,
    n_experts: usize,
    tile_rows: usize,
) -> Result<RowGroups, KernelError> {
    let m = experts.len();
    ensure(n_experts <= MAX_EXPERTS && tile_rows != 0, op, || {
        format!("{n_experts} experts (at most {MAX_EXPERTS}), tiles of {tile_rows}")
    })?;
    let max_tiles = m.div_ceil(tile_rows) + m.min(n_experts + 1);
    // SAFETY (the three allocations): group_routed_rows writes all of `order` (a permutation of
    // 0..m), `tile_count` and the first *tile_count tiles before any launch reads them, in stream
    // order; the routed kernels read no tile past *tile_count.
    let mut order = unsafe { rt.alloc_written::<u32>(m) }
        .map_err(KernelError::driver("allocating the routed row order"))?;
    let mut tiles = unsafe { rt.alloc_written::<u32>(3 * max_tiles) }
        .map_err(KernelError::driver("allocating the routed tiles"))?;
    let mut tile_count = unsafe { rt.alloc_written::<u32>(1) }
        .map_err(KernelError::driver("allocating the routed tile count"))?;
    let group = GroupParams {
        m: kernel_dim(op, "m", m)?,
        n_experts: kernel_dim(op, "experts", n_experts)?,
        tile_rows: kernel_dim(op, "tile rows", tile_rows)?,
    };
    let group_cfg = launch_config((1, 1, 1), GROUP_THREADS, 4 * 2 * (group.n_experts + 1));
    let mut launch = rt.launcher(KernelId::GroupRoutedRows)?;
    launch
        .arg(experts)
        .arg(&mut order)
        .arg(&mut tiles)
        .arg(&mut tile_count)
        .arg(&group);
    // SAFETY: signature (const u32* experts, u32* order, u32* tiles, u32* tile_count,
    // GroupParams); experts and order hold m values, tiles 3 * max_tiles (the kernel writes at
    // most that many tiles, see above), the dynamic shared memory 2 * (n_experts + 1) counters.
    unsafe { launch.launch(group_cfg) }?;
    Ok(RowGroups {
        order,
        tiles,
        tile_count,
        tile_rows,
        max_tiles,
    })
}

/// The element type of the expert rows [`swiglu_act_quant_fp8`] and [`moe_combine`] read: bf16
/// (the V4.1 routed GEMMs' outputs) or f32 (V4's experts), each with its kernel.
pub trait ExpertRowValue: DeviceRepr {
    const SWIGLU_ACT_QUANT: KernelId;
    const COMBINE: KernelId;
}

impl ExpertRowValue for bf16 {
    const SWIGLU_ACT_QUANT: KernelId = KernelId::SwigluActQuantFp8G32;
    const COMBINE: KernelId = KernelId::MoeCombineF32;
}

impl ExpertRowValue for f32 {
    const SWIGLU_ACT_QUANT: KernelId = KernelId::SwigluActQuantFp8G32F32;
    const COMBINE: KernelId = KernelId::MoeCombineExactF32;
}

/// The SwiGLU launch of `n` values: the route weights (one per row of `n / weights.len()`
/// values, or none) checked against `n`, `limit` not NaN; gives the kernel's parameters and
/// the weights' buffer (a one-element placeholder the kernel does not read without weights).
fn swiglu_params<'w>(
    rt: &KernelRuntime,
    op: &'static str,
    n: usize,
    route_weights: Option<&'w CudaSlice<f32>>,
    limit: f32,
    rounding: Rounding,
    placeholder: &'w mut Option<CudaSlice<f32>>,
) -> Result<(SwigluParams, &'w CudaSlice<f32>), KernelError> {
    let inter = match route_weights {
        Some(w) if w.is_empty() && n == 0 => 1,
        Some(w) if w.is_empty() || !n.is_multiple_of(w.len()) => {
            return Err(shape_error(
                op,
                format!("{n} values are not whole rows of {} route weights", w.len()),
            ));
        }
        Some(w) => n / w.len(),
        None => n.max(1),
    };
    ensure(!limit.is_nan(), op, || "the SwiGLU limit is NaN")?;
    let params = SwigluParams {
        n: kernel_dim(op, "values", n)?,
        inter: kernel_dim(op, "inter", inter)?,
        has_weights: u32::from(route_weights.is_some()),
        limit,
        round_bf16: rounding.flag(),
    };
    let weights = match route_weights {
        Some(w) => w,
        None => {
            // SAFETY: never read (has_weights = 0).
            let one = unsafe { rt.alloc_written::<f32>(1) }.map_err(KernelError::driver(
                "allocating the route-weight placeholder",
            ))?;
            placeholder.insert(one)
        }
    };
    Ok((params, weights))
}

/// `out[i] = round(weight · g / (1 + exp_f32(-g)) · u)` with `g`, `u` the f32 values `gate[i]`,
/// `up[i]` clamped as `layers::moe::expert` does when `limit > 0` (`g.min(limit)`,
/// `u.clamp(-limit, limit)`); `weight` is `route_weights[i / inter]` with `inter = len /
/// route_weights.len()` (one weight per row), or 1 (no multiplication) without weights. V4's
/// exact experts (unquantised hidden rows); the quantised experts take [`swiglu_act_quant_fp8`].
pub fn swiglu_rows(
    rt: &KernelRuntime,
    gate: &CudaSlice<f32>,
    up: &CudaSlice<f32>,
    route_weights: Option<&CudaSlice<f32>>,
    limit: f32,
    rounding: Rounding,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "swiglu_rows";
    let n = gate.len();
    expect_len(OP, "up", up.len(), n)?;
    expect_len(OP, "out", out.len(), n)?;
    let mut placeholder = None;
    let (params, weights) =
        swiglu_params(rt, OP, n, route_weights, limit, rounding, &mut placeholder)?;
    if n == 0 {
        return Ok(());
    }
    let cfg = launch_config(
        (
            params.n.div_ceil(SWIGLU_THREADS).min(SWIGLU_MAX_BLOCKS),
            1,
            1,
        ),
        SWIGLU_THREADS,
        0,
    );
    let mut launch = rt.launcher(KernelId::SwigluExactRowsF32)?;
    launch.arg(gate).arg(up).arg(weights).arg(out).arg(&params);
    // SAFETY: signature (const float* gate, const float* up, const float* weights, float* out,
    // SwigluParams); gate, up and out hold n values; with has_weights the kernel reads
    // weights[i / inter] < n / inter = weights.len().
    unsafe { launch.launch(cfg) }
}

/// The SwiGLU values of [`swiglu_rows`] (`gate`, `up` bf16 or f32 `[out.rows, out.cols]`: two
/// buffers, or the two planes of an [`ExpertProjection::GateUp`] output; `route_weights` one
/// per row or none) quantised into `out` (FP8, 32-groups) in the same
/// kernel, with no f32 hidden rows in memory: bitwise what [`swiglu_rows`] then
/// [`super::quant::quantize_act_fp8_into`] of its f32 rows give (the same operations on the
/// same values).
pub fn swiglu_act_quant_fp8<T: ExpertRowValue>(
    rt: &KernelRuntime,
    gate: &CudaView<'_, T>,
    up: &CudaView<'_, T>,
    route_weights: Option<&CudaSlice<f32>>,
    limit: f32,
    rounding: Rounding,
    out: &mut DeviceActFp8,
) -> Result<(), KernelError> {
    const OP: &str = "swiglu_act_quant_fp8";
    out.group.require_g32(OP, "SwiGLU rows")?;
    let n = out.rows * out.cols;
    expect_len(OP, "gate", gate.len(), n)?;
    expect_len(OP, "up", up.len(), n)?;
    expect_len(OP, "codes", out.codes.len(), n)?;
    expect_len(OP, "scales", out.scales.len(), n / ActGroup::G32.elements())?;
    if let Some(w) = route_weights {
        expect_len(OP, "route weights", w.len(), out.rows)?;
    }
    let mut placeholder = None;
    let (params, weights) =
        swiglu_params(rt, OP, n, route_weights, limit, rounding, &mut placeholder)?;
    if n == 0 {
        return Ok(());
    }
    let quant = ActQuantParams {
        rows: kernel_dim(OP, "rows", out.rows)?,
        cols: kernel_dim(OP, "cols", out.cols)?,
    };
    // The quantiser's grid: a warp per 128 elements (act_quant_fp8's).
    let warps = kernel_dim(OP, "warps", n.div_ceil(ELEMENTS_PER_WARP))?;
    let cfg = launch_config(
        (warps.div_ceil(WARPS_PER_BLOCK), 1, 1),
        WARPS_PER_BLOCK * 32,
        0,
    );
    let mut launch = rt.launcher(T::SWIGLU_ACT_QUANT)?;
    launch
        .arg(gate)
        .arg(up)
        .arg(weights)
        .arg(&mut out.codes)
        .arg(&mut out.scales)
        .arg(&params)
        .arg(&quant);
    // SAFETY: signature (const T* gate, const T* up, const float* weights, u8* codes,
    // float* scales, SwigluParams, ActQuantParams), `T::SWIGLU_ACT_QUANT` the build reading T.
    // gate, up and codes hold n = rows * cols values (whole allocations: the lanes' 4-element
    // loads at multiples of 4 are aligned), scales n / 32 (cols is a multiple of 32,
    // DeviceActFp8's contract); the grid covers every element with warps of 128 (the kernel
    // returns from warps past the end and writes no group past it); with has_weights the kernel
    // reads weights[i / inter], inter = cols, < rows = weights.len().
    unsafe { launch.launch(cfg) }
}

/// Per token `t` of `out [rows, dim]`: from 0.0f32, add its slot outputs `routed[t, s]`
/// (`routed` `[rows, k, dim]`, bf16 or f32) in increasing `experts[t, s]` (equal ids in slot
/// order; ids `>= n_experts` skipped), then `shared[t]` (`[rows, dim]`), then round — the order of
/// `layers::moe::forward_rows`. `rows = shared.len() / dim`, `k = experts.len() / rows` (at most 64).
#[allow(clippy::too_many_arguments)]
pub fn moe_combine<T: ExpertRowValue>(
    rt: &KernelRuntime,
    routed: &CudaSlice<T>,
    experts: &CudaSlice<u32>,
    n_experts: usize,
    shared: &CudaSlice<T>,
    dim: usize,
    rounding: Rounding,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "moe_combine";
    let rows = whole_rows(OP, shared.len(), dim, || {
        format!("shared has {} values, not rows of dim {dim}", shared.len())
    })?;
    expect_len(OP, "out", out.len(), rows * dim)?;
    if rows == 0 {
        expect_len(OP, "experts", experts.len(), 0)?;
        return expect_len(OP, "routed", routed.len(), 0);
    }
    let k = whole_rows(OP, experts.len(), rows, || {
        format!(
            "experts has {} ids, not whole rows for {rows} tokens",
            experts.len()
        )
    })?;
    ensure(k <= MAX_SLOTS, OP, || {
        format!("{k} experts per token (at most {MAX_SLOTS})")
    })?;
    expect_len(OP, "routed", routed.len(), rows * k * dim)?;
    let params = CombineParams {
        rows: kernel_dim(OP, "rows", rows)?,
        k: kernel_dim(OP, "k", k)?,
        dim: kernel_dim(OP, "dim", dim)?,
        n_experts: kernel_dim(OP, "experts", n_experts)?,
        round_bf16: rounding.flag(),
    };
    let col_blocks = params.dim.div_ceil(COMBINE_THREADS);
    ensure(col_blocks <= 65_535, OP, || {
        format!("dim = {dim} needs {col_blocks} column blocks (> 65535)")
    })?;
    let cfg = launch_config((params.rows, col_blocks, 1), COMBINE_THREADS, 0);
    let mut launch = rt.launcher(T::COMBINE)?;
    launch
        .arg(routed)
        .arg(experts)
        .arg(shared)
        .arg(out)
        .arg(&params);
    // SAFETY: signature (const T* slot_out, const u32* experts, const T* shared_out,
    // float* out, CombineParams); lengths checked above (rows * k * dim, rows * k, rows * dim,
    // rows * dim); k <= MAX_SLOTS, the kernel's shared order array.
    unsafe { launch.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::super::assert_mirrors;
    use super::*;

    const SOURCE: &str = include_str!("../../cuda/moe/routed.cu");

    #[test]
    fn params_mirror_the_cuda_structs() {
        assert_mirrors::<RoutedGemmParams>(
            SOURCE,
            32,
            &[
                "m",
                "n",
                "k",
                "w_scale_cols",
                "warps_per_col",
                "x_row_div",
                "n_experts",
                "which",
            ],
        );
        assert_mirrors::<SwigluParams>(
            SOURCE,
            20,
            &["n", "inter", "has_weights", "limit", "round_bf16"],
        );
        assert_mirrors::<CombineParams>(
            SOURCE,
            20,
            &["rows", "k", "dim", "n_experts", "round_bf16"],
        );
    }

    #[test]
    fn group_params_mirror_the_cuda_struct() {
        assert_mirrors::<GroupParams>(SOURCE, 12, &["m", "n_experts", "tile_rows"]);
    }

    #[test]
    fn launcher_limits_match_the_kernel_constants() {
        assert!(SOURCE.contains(&format!(" TILE_ROWS = {TILE_ROWS};")));
        assert!(SOURCE.contains(&format!("EXPERT_TILE_ROWS = {EXPERT_TILE_ROWS};")));
        assert!(SOURCE.contains(&format!("EXPERT_PARTIAL_STRIDE = {EXPERT_PARTIAL_STRIDE};")));
        assert!(SOURCE.contains(&format!("GROUP_THREADS = {GROUP_THREADS};")));
        assert!(SOURCE.contains(&format!("MAX_SLOTS = {MAX_SLOTS};")));
        assert!(SOURCE.contains(&format!("COMBINE_THREADS = {COMBINE_THREADS};")));
    }

    #[test]
    fn the_swiglu_quantiser_takes_the_act_quant_layout() {
        let act_quant = include_str!("../../cuda/quant/act_quant.cuh");
        assert!(act_quant.contains("ACT_QUANT_PER_LANE = 4;"));
        assert!(act_quant.contains("ACT_QUANT_PER_WARP = 32 * ACT_QUANT_PER_LANE;"));
        assert_eq!(ELEMENTS_PER_WARP, 128);
        assert!(SOURCE.contains("act_quant_lane<32>(v, valid, base, codes, scales);"));
    }

    #[test]
    fn projections_take_their_table_slots() {
        assert_eq!(ExpertProjection::W1.slot(), 0);
        assert_eq!(ExpertProjection::W3.slot(), 1);
        assert_eq!(ExpertProjection::W2.slot(), 2);
    }
}
