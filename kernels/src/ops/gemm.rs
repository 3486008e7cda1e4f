//! Block-scaled GEMMs with FP8 activations: FP8 weights (32×32 or 128×128 tiles) and FP4 expert
//! weights (1×32 scales). `y[m, n] = Σ_k a[m, k] · w[n, k]` (`y = a · wᵀ`), bf16 output. A
//! group's partial is the exact sum of its exact products rounded once to fp32, the scaled partials
//! are added in K order in fp32 (see `cuda/gemm/gemm_block_scaled.cuh`): bit-exact with
//! `deepinfer_model::quant::gemm_fp8` / `gemm_fp4`, and batch invariant by construction.

use cudarc::driver::CudaSlice;
use half::bf16;

use super::quant::{ActGroup, DeviceActFp8};
use super::{dim, ensure, expect_len, launch_config, shape_error};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::GemmParams;
use crate::runtime::KernelRuntime;

/// Warps per block and rows per block; must match `gemm::WARPS` and the `BM` template argument of
/// the instantiations. A block covers `WARPS / warps_per_column` output columns.
pub(crate) const WARPS: u32 = 8;
const ROWS_PER_BLOCK: u32 = 8;
/// `GemmSplit::Auto` takes the column-per-warp kernel up to this many rows.
const COLUMN_PER_WARP_MAX_ROWS: usize = 4;

/// Which kernel and work split computes a GEMM. In the block-tiled kernel, `warps_per_column`
/// warps share one output column's K range, each computing every `warps_per_column`-th chunk of
/// 32 k-group partials; in the column-per-warp kernel one warp owns a column. Either way one
/// thread adds all partials in K order, so the result is bitwise the same for every choice (only
/// the speed changes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmSplit {
    /// Chosen from the shape: [`GemmSplit::ColumnPerWarp`] up to 4 rows (decode), else the
    /// block-tiled kernel with more warps per column when M is small.
    Auto,
    /// The block-tiled kernel with 1, 2, 4 or 8 warps per column.
    WarpsPerColumn(u32),
    /// The column-per-warp kernel: one warp per output column over all of K, lanes taking
    /// 16-element slices (`gemm_warp_tile`); same sums in the same order.
    ColumnPerWarp,
}

impl GemmSplit {
    pub(crate) fn warps_per_column(
        self,
        op: &'static str,
        m: usize,
        k_groups: usize,
    ) -> Result<u32, KernelError> {
        match self {
            // Measured on the H200 (device_bench split sweep, M = 1 and 8): two warps per
            // column help when K spans at least two chunks of 32 k-groups; more do not.
            GemmSplit::Auto => Ok(if m <= 16 && k_groups.div_ceil(32) >= 2 {
                2
            } else {
                1
            }),
            GemmSplit::WarpsPerColumn(w @ (1 | 2 | 4 | 8)) => Ok(w),
            // Not a block-tiled split: the column-per-warp kernel ignores the field.
            GemmSplit::ColumnPerWarp => Ok(1),
            GemmSplit::WarpsPerColumn(w) => Err(shape_error(
                op,
                format!("{w} warps per column: must be 1, 2, 4 or 8"),
            )),
        }
    }
}

/// An FP8 E4M3 weight `[out, inp]` on the device with UE8M0 scales per `tile × tile` block
/// (`[ceil(out/tile), ceil(inp/tile)]`), both row-major — the checkpoint layout.
#[derive(Debug)]
pub struct DeviceFp8Weight {
    pub out: usize,
    pub inp: usize,
    pub tile: usize,
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
}

/// The checkpoint bytes of an FP8 weight `[out, inp]`: E4M3 `codes` `[out, inp]` and UE8M0
/// `scales` per `tile × tile` block (`[ceil(out/tile), ceil(inp/tile)]`), both row-major. `tile`
/// is 32 (V4.1) or 128 (V4); `inp` must be a multiple of 32.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Bytes<'a> {
    pub out: usize,
    pub inp: usize,
    pub tile: usize,
    pub codes: &'a [u8],
    pub scales: &'a [u8],
}

/// The checkpoint bytes of an FP4 weight `[out, inp]`: E2M1 `packed` `[out, inp/2]` (element 2k
/// in the low nibble of byte k) and UE8M0 `scales` `[out, inp/32]`, both row-major; `inp` must be
/// a multiple of 32.
#[derive(Debug, Clone, Copy)]
pub struct Fp4Bytes<'a> {
    pub out: usize,
    pub inp: usize,
    pub packed: &'a [u8],
    pub scales: &'a [u8],
}

impl Fp8Bytes<'_> {
    /// Checks the shape and the lengths: `tile` 32 or 128, `inp` a positive multiple of 32.
    pub(crate) fn check(&self, op: &'static str) -> Result<(), KernelError> {
        let (out, inp, tile) = (self.out, self.inp, self.tile);
        ensure(tile == 32 || tile == 128, op, || {
            format!("tile {tile} is neither 32 nor 128")
        })?;
        check_k_groups(op, out, inp)?;
        expect_len(op, "codes", self.codes.len(), out * inp)?;
        expect_len(
            op,
            "scales",
            self.scales.len(),
            out.div_ceil(tile) * inp.div_ceil(tile),
        )
    }
}

impl Fp4Bytes<'_> {
    /// Checks the shape and the lengths: `inp` a positive multiple of 32, `packed`
    /// `out · inp / 2` bytes, `scales` `out · inp / 32`.
    pub(crate) fn check(&self, op: &'static str) -> Result<(), KernelError> {
        check_k_groups(op, self.out, self.inp)?;
        expect_len(op, "packed", self.packed.len(), self.out * self.inp / 2)?;
        expect_len(op, "scales", self.scales.len(), self.out * self.inp / 32)
    }
}

/// Checks a block-scaled weight's shape `[out, inp]`: both positive, `inp` whole 32-element
/// k-groups.
fn check_k_groups(op: &'static str, out: usize, inp: usize) -> Result<(), KernelError> {
    ensure(inp != 0 && inp.is_multiple_of(32) && out != 0, op, || {
        format!("[{out}, {inp}]: inp must be a positive multiple of 32")
    })?;
    Ok(())
}

/// A device form of an FP8 weight, made from its checkpoint bytes ([`DeviceFp8Weight`] for the
/// exact kernels, [`super::gemm_fast::FastFp8Weight`] for the tensor-core GEMM).
pub trait Fp8Form: Sized {
    /// Uploads the bytes, checking them ([`Fp8Bytes`]).
    fn upload(rt: &KernelRuntime, w: Fp8Bytes<'_>) -> Result<Self, KernelError>;
}

/// A device form of an FP4 weight, made from its checkpoint bytes ([`DeviceFp4Weight`] for the
/// exact kernels, [`super::gemm_fast::FastFp4Weight`] for the tensor-core GEMMs).
pub trait Fp4Form: Sized {
    /// Uploads the bytes, checking them ([`Fp4Bytes`]).
    fn upload(rt: &KernelRuntime, w: Fp4Bytes<'_>) -> Result<Self, KernelError>;
}

impl Fp8Form for DeviceFp8Weight {
    fn upload(rt: &KernelRuntime, w: Fp8Bytes<'_>) -> Result<DeviceFp8Weight, KernelError> {
        w.check("DeviceFp8Weight::upload")?;
        let (codes, scales) = upload_as_is(rt, "FP8", w.codes, w.scales)?;
        Ok(DeviceFp8Weight {
            out: w.out,
            inp: w.inp,
            tile: w.tile,
            codes,
            scales,
        })
    }
}

/// Uploads a weight's codes and scales as the checkpoint lays them out (the exact kernels'
/// layout), naming its `format` in an error.
fn upload_as_is(
    rt: &KernelRuntime,
    format: &str,
    codes: &[u8],
    scales: &[u8],
) -> Result<(CudaSlice<u8>, CudaSlice<u8>), KernelError> {
    let codes = rt
        .htod(codes)
        .map_err(KernelError::driver(format!("uploading {format} weight codes")))?;
    let scales = rt
        .htod(scales)
        .map_err(KernelError::driver(format!("uploading {format} weight scales")))?;
    Ok((codes, scales))
}

/// An FP4 E2M1 expert weight `[out, inp]` on the device: `packed` `[out, inp/2]` (element 2k in
/// the low nibble of byte k), `scales` UE8M0 `[out, inp/32]`, both row-major.
#[derive(Debug)]
pub struct DeviceFp4Weight {
    pub out: usize,
    pub inp: usize,
    pub packed: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
}

impl Fp4Form for DeviceFp4Weight {
    fn upload(rt: &KernelRuntime, w: Fp4Bytes<'_>) -> Result<DeviceFp4Weight, KernelError> {
        w.check("DeviceFp4Weight::upload")?;
        let (packed, scales) = upload_as_is(rt, "FP4", w.packed, w.scales)?;
        Ok(DeviceFp4Weight {
            out: w.out,
            inp: w.inp,
            packed,
            scales,
        })
    }
}

/// `y = a · wᵀ` for an FP8 weight. Supported (tile, activation group): (32, 32) V4.1 and
/// (128, 128) V4 (the activation group is the tile side, as in `deepinfer_model::quant::gemm_fp8`).
/// `y` is bf16 `[a.rows, w.out]`, row-major. `split` picks the kernel and work split
/// ([`GemmSplit::Auto`] in production); the result does not depend on it.
pub fn gemm_fp8(
    rt: &KernelRuntime,
    a: &DeviceActFp8,
    w: &DeviceFp8Weight,
    y: &mut CudaSlice<bf16>,
    split: GemmSplit,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp8";
    let kernels = match (w.tile, a.group) {
        (32, ActGroup::G32) => (KernelId::GemmFp8T32G32, KernelId::GemmFp8T32G32Warp),
        (128, ActGroup::G128) => (KernelId::GemmFp8T128G128, KernelId::GemmFp8T128G128Warp),
        (tile, group) => {
            return Err(shape_error(
                OP,
                format!(
                    "no kernel for {tile}x{tile} weight tiles with {}-element activation groups",
                    group.elements()
                ),
            ));
        }
    };
    let w_scale_cols = w.inp.div_ceil(w.tile);
    launch_gemm(
        rt,
        OP,
        kernels,
        a,
        (w.out, w.inp),
        &w.codes,
        &w.scales,
        w_scale_cols,
        y,
        split,
    )
}

/// `y = a · wᵀ` for an FP4 expert weight (activation groups of 32). `y` is bf16 `[a.rows, w.out]`.
/// `split` as in [`gemm_fp8`].
pub fn gemm_fp4(
    rt: &KernelRuntime,
    a: &DeviceActFp8,
    w: &DeviceFp4Weight,
    y: &mut CudaSlice<bf16>,
    split: GemmSplit,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_fp4";
    a.group.require_g32(OP, "FP4 GEMMs")?;
    launch_gemm(
        rt,
        OP,
        (KernelId::GemmFp4G32, KernelId::GemmFp4G32Warp),
        a,
        (w.out, w.inp),
        &w.packed,
        &w.scales,
        w.inp / 32,
        y,
        split,
    )
}

/// Launches the block-tiled kernel `kernels.0` or the column-per-warp kernel `kernels.1`, as
/// `split` says.
fn launch_gemm(
    rt: &KernelRuntime,
    op: &'static str,
    kernels: (KernelId, KernelId),
    a: &DeviceActFp8,
    (n, k): (usize, usize),
    w: &CudaSlice<u8>,
    ws: &CudaSlice<u8>,
    w_scale_cols: usize,
    y: &mut CudaSlice<bf16>,
    split: GemmSplit,
) -> Result<(), KernelError> {
    a.check_gemm(op, (n, k), y.len())?;
    if a.rows == 0 {
        return Ok(());
    }
    let column_per_warp = match split {
        // Measured on the H200 (device_bench --sweep): one warp per column is the fastest at
        // M = 1 (wq_b 64 -> 37 us, FP4 experts 30 -> 24 us), but not at M = 8 for K = 5120.
        GemmSplit::Auto => a.rows <= COLUMN_PER_WARP_MAX_ROWS,
        GemmSplit::ColumnPerWarp => true,
        GemmSplit::WarpsPerColumn(_) => false,
    };
    let mut warps_per_col = split.warps_per_column(op, a.rows, k / a.group.elements())?;
    if column_per_warp {
        warps_per_col = 1;
    }
    if split == GemmSplit::Auto {
        while warps_per_col > 1 && n.div_ceil((WARPS / warps_per_col) as usize) > 65_535 {
            warps_per_col /= 2;
        }
    }
    let params = GemmParams {
        m: dim(op, "m", a.rows)?,
        n: dim(op, "n", n)?,
        k: dim(op, "k", k)?,
        w_scale_cols: dim(op, "weight scale columns", w_scale_cols)?,
        warps_per_col,
    };
    let kernel = if column_per_warp {
        kernels.1
    } else {
        kernels.0
    };
    // Both kernels cover WARPS / warps_per_col columns per block (one warp per column in the
    // column-per-warp kernel, warps_per_col = 1).
    let col_blocks = params.n.div_ceil(WARPS / warps_per_col);
    ensure(col_blocks <= 65_535, op, || {
        format!("n = {n} needs {col_blocks} column blocks (> 65535)")
    })?;
    let cfg = launch_config(
        (params.m.div_ceil(ROWS_PER_BLOCK), col_blocks, 1),
        WARPS * 32,
        0,
    );
    let mut launch = rt.launcher(kernel)?;
    launch
        .arg(&a.codes)
        .arg(&a.scales)
        .arg(w)
        .arg(ws)
        .arg(y)
        .arg(&params);
    // SAFETY: the kernel's signature is (const u8* a, const float* sa, const u8* w, const u8* ws,
    // bf16* y, GemmParams). The activation buffers hold rows * k codes and rows * k / group scales
    // (DeviceActFp8's invariant), the weight buffers were length-checked at upload for [n, k], k is
    // a multiple of 32 (so every 16-byte load is aligned and in bounds), and y holds m * n values.
    unsafe { launch.launch(cfg) }
}
