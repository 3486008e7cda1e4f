//! The routed experts of the V4 family on the device: fp32 linears whose weights (dense f32, FP8
//! with square tiles, or FP4) are dequantised exactly and whose activations stay unquantised, each
//! output row taking its own expert's weight from a device table ([`DeviceExactExpertTable`]),
//! driven by device routes with no copy to the host ([`gemm_exact_routed`]). Rows are grouped by
//! expert on the device (`routed::group_rows`), a block computes the sgemm-order FMA chains of
//! a tile of up to 8 rows of one expert, and the pairwise reduction of `ops::linear` adds them:
//! every row is bitwise what `CpuBackend::linear_f32` (or `linear_fp8_f32` / `linear_fp4_f32`)
//! gives for it, whichever rows share its tile. The SwiGLU and the combine are
//! [`super::routed::swiglu_rows`] / [`super::routed::moe_combine`] over f32 rows.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::gemm::{DeviceFp4Weight, DeviceFp8Weight};
use super::linear::{MAX_INP, MAX_PARTIALS, THREADS, TILE_COLS, TILE_ROWS, sgemm_reduce};
use super::routed::{ExpertProjection, ExpertTable, TableEntry, group_rows};
use super::{dim as kernel_dim, ensure, expect_len, launch_config, sgemm_chains, shape_error};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::LinearParams;
use crate::runtime::{KernelRuntime, KernelValue};

/// `routed::ExactRoutedParams` in `cuda/moe/routed.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ExactRoutedParams {
    m: u32,
    n: u32,
    k: u32,
    format: u32,
    tile: u32,
    scale_cols: u32,
    x_row_div: u32,
    n_experts: u32,
    which: u32,
}

// SAFETY: a plain `#[repr(C)]` struct of 32-bit fields, laid out as its CUDA mirror.
unsafe impl KernelValue for ExactRoutedParams {}

/// The stored format of one projection of every expert of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExactFormat {
    /// Dense f32 (BF16 checkpoints widened at load).
    F32,
    /// FP8 E4M3 with square `tile × tile` UE8M0 scales.
    Fp8 { tile: usize },
    /// FP4 E2M1 packed two per byte with 1×32 UE8M0 scales.
    Fp4,
}

impl ExactFormat {
    /// The kernel's `format` and `tile` values.
    fn code(self) -> (u32, usize) {
        match self {
            ExactFormat::F32 => (0, 1),
            ExactFormat::Fp8 { tile } => (1, tile),
            ExactFormat::Fp4 => (2, 32),
        }
    }
}

/// One projection of one expert on the device, borrowed for [`DeviceExactExpertTable::new`].
#[derive(Debug, Clone, Copy)]
pub enum ExactWeight<'a> {
    /// `[out, inp]` row-major f32 values.
    F32 {
        values: &'a CudaSlice<f32>,
        out: usize,
        inp: usize,
    },
    Fp8(&'a DeviceFp8Weight),
    Fp4(&'a DeviceFp4Weight),
}

impl ExactWeight<'_> {
    fn format(&self) -> ExactFormat {
        match self {
            ExactWeight::F32 { .. } => ExactFormat::F32,
            ExactWeight::Fp8(w) => ExactFormat::Fp8 { tile: w.tile },
            ExactWeight::Fp4(_) => ExactFormat::Fp4,
        }
    }

    /// `(out, inp)`.
    fn shape(&self) -> (usize, usize) {
        match self {
            ExactWeight::F32 { out, inp, .. } => (*out, *inp),
            ExactWeight::Fp8(w) => (w.out, w.inp),
            ExactWeight::Fp4(w) => (w.out, w.inp),
        }
    }

    /// The device addresses the kernel reads: codes (or values) and scales (a dense weight's
    /// scales slot repeats its values' address and is never read).
    fn addresses(&self, rt: &KernelRuntime, op: &'static str) -> Result<(u64, u64), KernelError> {
        let stream = rt.stream();
        Ok(match self {
            ExactWeight::F32 { values, out, inp } => {
                expect_len(op, "dense expert weight", values.len(), out * inp)?;
                let (ptr, _read) = values.device_ptr(stream);
                (ptr, ptr)
            }
            ExactWeight::Fp8(w) => {
                let (codes, _codes_read) = w.codes.device_ptr(stream);
                let (scales, _scales_read) = w.scales.device_ptr(stream);
                (codes, scales)
            }
            ExactWeight::Fp4(w) => {
                let (packed, _packed_read) = w.packed.device_ptr(stream);
                let (scales, _scales_read) = w.scales.device_ptr(stream);
                (packed, scales)
            }
        })
    }
}

/// The three projections of one expert (`w1`, `w3` `[inter, dim]`, `w2` `[dim, inter]`).
#[derive(Debug, Clone, Copy)]
pub struct ExactExpertRefs<'a> {
    pub w1: ExactWeight<'a>,
    pub w3: ExactWeight<'a>,
    pub w2: ExactWeight<'a>,
}

/// The device address table of one layer's routed experts for [`gemm_exact_routed`]: each
/// projection in one format across the experts.
pub type DeviceExactExpertTable = ExpertTable<[ExactFormat; 3]>;

impl DeviceExactExpertTable {
    /// The table of `experts` (expert `e` is `experts[e]`).
    ///
    /// # Safety
    /// The table keeps the weights' device addresses, not the weights: every weight in `experts`
    /// must stay alive (and unmoved on the device) for as long as launches read this table.
    pub unsafe fn new(
        rt: &KernelRuntime,
        experts: &[ExactExpertRefs<'_>],
    ) -> Result<DeviceExactExpertTable, KernelError> {
        const OP: &str = "DeviceExactExpertTable::new";
        let formats_of = |e: &ExactExpertRefs<'_>| [e.w1.format(), e.w3.format(), e.w2.format()];
        let Some(first) = experts.first() else {
            return Err(shape_error(OP, "no experts"));
        };
        let formats = formats_of(first);
        let entry = |weight: ExactWeight<'_>| -> Result<TableEntry, KernelError> {
            let shape = weight.shape();
            check_format(OP, weight.format(), shape.1)?;
            let (codes, scales) = weight.addresses(rt, OP)?;
            Ok(TableEntry {
                shape,
                codes,
                scales,
            })
        };
        ExpertTable::upload(rt, OP, formats, experts, |e, expert| {
            ensure(formats_of(expert) == formats, OP, || {
                format!(
                    "expert {e} is {:?}, expected {formats:?} (as expert 0)",
                    formats_of(expert)
                )
            })?;
            Ok([entry(expert.w1)?, entry(expert.w3)?, entry(expert.w2)?])
        })
    }
}

/// A format the kernel can read for rows of `inp` inputs: FP4 needs whole 32-groups (two codes
/// per byte), FP8 a positive tile.
fn check_format(op: &'static str, format: ExactFormat, inp: usize) -> Result<(), KernelError> {
    let fits = match format {
        ExactFormat::F32 => true,
        ExactFormat::Fp8 { tile } => tile > 0,
        ExactFormat::Fp4 => inp.is_multiple_of(32),
    };
    ensure(fits, op, || format!("{format:?} weights of {inp} inputs"))
}

/// The rows of an exact routed linear: output row `j` is `x[j / x_row_div] · W_{experts[j]}ᵀ`
/// for the `which` projection of a table's experts (`x` `[rows, inp]` f32, `experts` `[m]` with
/// `m = rows · x_row_div`). The rows are grouped by expert per launch (and per chunk of rows:
/// the chunks depend on the projection's shape).
#[derive(Clone, Copy)]
pub struct ExactRoutedRows<'a> {
    pub x: &'a CudaSlice<f32>,
    pub experts: &'a CudaSlice<u32>,
    pub x_row_div: usize,
    pub which: ExpertProjection,
}

/// The [`ExactRoutedRows`] `rows` of `table` into `out` in fp32: `x` `[rows, inp]` f32, `out` `[m,
/// out]` f32. Every
/// row is bitwise the CPU reference's fp32 linear of that x row and that expert's weight
/// (dequantised exactly); a row whose id is `>= table.n_experts()` holds zeros or garbage that
/// [`super::routed::moe_combine`] skips.
pub fn gemm_exact_routed(
    rt: &KernelRuntime,
    rows: ExactRoutedRows<'_>,
    table: &DeviceExactExpertTable,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gemm_exact_routed";
    let (x, experts, x_row_div, which) = (rows.x, rows.experts, rows.x_row_div, rows.which);
    ensure(
        which.planes() == 1,
        OP,
        || "the exact routed linears run one projection a launch (W1 and W3 apart, not GateUp)",
    )?;
    let slot = which.slot() as usize;
    let (n, k) = which.shape(table.dim(), table.inter());
    ensure(
        k != 0 && k <= MAX_INP && x_row_div != 0 && x.len().is_multiple_of(k),
        OP,
        || {
            format!(
                "x holds {} values for {k} inputs (at most {MAX_INP}), x_row_div {x_row_div}",
                x.len()
            )
        },
    )?;
    let m = (x.len() / k) * x_row_div;
    expect_len(OP, "experts", experts.len(), m)?;
    expect_len(OP, "out", out.len(), m * n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (format, tile) = table.format()[slot].code();
    let blocks = sgemm_chains(k);
    // Chunks of whole x rows (x_row_div output rows each) whose partials fit MAX_PARTIALS.
    let chunk_rows = ((MAX_PARTIALS / (blocks * n)) / x_row_div).max(1) * x_row_div;
    let chunk_rows = chunk_rows.min(m);
    // SAFETY: per chunk, gemm_exact_routed_partials_f32 writes the partial of every (chain, row <
    // count, column): group_rows puts every row in a tile and the unknown ids' tile computes with
    // zero weights; sgemm_reduce reads exactly those.
    let mut partials = unsafe { rt.alloc_written::<f32>(blocks * chunk_rows * n) }
        .map_err(KernelError::driver("allocating the routed block partials"))?;
    for first in (0..m).step_by(chunk_rows) {
        let count = chunk_rows.min(m - first);
        let ids = experts.slice(first..first + count);
        let groups = group_rows(rt, OP, &ids, table.n_experts(), TILE_ROWS as usize)?;
        let params = ExactRoutedParams {
            m: kernel_dim(OP, "m", count)?,
            n: kernel_dim(OP, "n", n)?,
            k: kernel_dim(OP, "k", k)?,
            format,
            tile: kernel_dim(OP, "tile", tile)?,
            scale_cols: kernel_dim(OP, "scale columns", k.div_ceil(tile))?,
            x_row_div: kernel_dim(OP, "x_row_div", x_row_div)?,
            n_experts: kernel_dim(OP, "experts", table.n_experts())?,
            which: slot as u32,
        };
        let x_rows = x.slice(first / x_row_div * k..(first + count).div_ceil(x_row_div) * k);
        let cfg = launch_config(
            (
                kernel_dim(OP, "tiles", groups.max_tiles)?,
                params.n.div_ceil(TILE_COLS),
                kernel_dim(OP, "chains", blocks)?,
            ),
            THREADS,
            0,
        );
        let mut launch = rt.launcher(KernelId::GemmExactRoutedPartialsF32)?;
        launch.arg(&x_rows);
        groups
            .push_args(&mut launch, table.addresses())
            .arg(&mut partials)
            .arg(&params);
        // SAFETY: signature (const float* x, const u32* order, const u32* tiles, const u32*
        // tile_count, const u64* table, float* partials, ExactRoutedParams). Blocks past
        // *tile_count return; a tile's rows are chunk rows < count (order is a permutation of
        // 0..count), each reading x row j / x_row_div of the chunk's x rows (count / x_row_div
        // rows of k values: chunks start at a multiple of x_row_div); the table holds 3 *
        // n_experts address pairs of live weights of this shape and format (the constructor's
        // contract; the bucket of unknown ids reads none); partials holds blocks * count * n.
        unsafe { launch.launch(cfg) }?;
        let reduce = LinearParams {
            rows: params.m,
            out: params.n,
            inp: params.k,
            round_bf16: 0,
        };
        let mut y = out.slice_mut(first * n..(first + count) * n);
        sgemm_reduce(rt, &partials, &mut y, reduce)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::assert_mirrors;
    use super::*;

    const SOURCE: &str = include_str!("../../cuda/moe/routed.cu");

    #[test]
    fn params_mirror_the_cuda_struct() {
        assert_mirrors::<ExactRoutedParams>(
            SOURCE,
            36,
            &[
                "m",
                "n",
                "k",
                "format",
                "tile",
                "scale_cols",
                "x_row_div",
                "n_experts",
                "which",
            ],
        );
        assert!(SOURCE.contains("EXACT_F32 = 0;"));
        assert!(SOURCE.contains("EXACT_FP8 = 1;"));
        assert!(SOURCE.contains("EXACT_FP4 = 2;"));
        assert_eq!(ExactFormat::F32.code().0, 0);
        assert_eq!(ExactFormat::Fp8 { tile: 128 }.code(), (1, 128));
        assert_eq!(ExactFormat::Fp4.code(), (2, 32));
    }

    #[test]
    fn fp4_needs_whole_groups() {
        assert!(check_format("t", ExactFormat::Fp4, 64).is_ok());
        assert!(check_format("t", ExactFormat::Fp4, 48).is_err());
        assert!(check_format("t", ExactFormat::Fp8 { tile: 0 }, 64).is_err());
        assert!(check_format("t", ExactFormat::F32, 7).is_ok());
    }
}
