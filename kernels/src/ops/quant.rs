//! FP8 activation quantisation `Q8` (v41-architecture.md §3.0) on the device.

use cudarc::driver::{CudaSlice, DeviceRepr};
use half::bf16;

use super::{dim, ensure, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::ActQuantParams;
use crate::runtime::KernelRuntime;

const OP: &str = "quantize_act_fp8";
/// Warps per block of the quantiser (and of `ops::routed`'s SwiGLU quantiser).
pub(super) const WARPS_PER_BLOCK: u32 = 8;
/// Elements one warp of the quantiser takes (`ACT_QUANT_PER_WARP`: 4 a lane).
pub(super) const ELEMENTS_PER_WARP: usize = 128;

/// Activation quantisation group along the last axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActGroup {
    /// 32 elements per scale (V4.1).
    G32,
    /// 128 elements per scale (V4).
    G128,
}

impl ActGroup {
    /// Elements per scale.
    pub fn elements(self) -> usize {
        match self {
            ActGroup::G32 => 32,
            ActGroup::G128 => 128,
        }
    }

    /// `Ok` when `self` is `G32`, else a shape error of `op`: `what` (e.g. "FP4 weights") needs
    /// 32-element activation groups.
    pub(crate) fn require_g32(self, op: &'static str, what: &str) -> Result<(), KernelError> {
        ensure(self == ActGroup::G32, op, || {
            format!(
                "{what} need 32-element activation groups, got {}",
                self.elements()
            )
        })
    }
}

/// The element type of the activations [`quantize_act_fp8`] reads: bf16, or f32 storage (any
/// fp32 values, as the CPU reference accepts). Sealed: the kernels read only these two.
pub trait ActInput: DeviceRepr + sealed::Sealed {
    /// The quantisation kernel of `group` for this input.
    fn kernel(group: ActGroup) -> KernelId;
}

impl ActInput for bf16 {
    fn kernel(group: ActGroup) -> KernelId {
        match group {
            ActGroup::G32 => KernelId::ActQuantFp8G32,
            ActGroup::G128 => KernelId::ActQuantFp8G128,
        }
    }
}

impl ActInput for f32 {
    fn kernel(group: ActGroup) -> KernelId {
        match group {
            ActGroup::G32 => KernelId::ActQuantFp8G32F32,
            ActGroup::G128 => KernelId::ActQuantFp8G128F32,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// Quantised activations on the device: `codes` E4M3 `[rows, cols]` row-major, `scales` f32
/// powers of two `[rows, cols / group]` row-major (`x ≈ e4m3(code) · scale`).
#[derive(Debug)]
pub struct DeviceActFp8 {
    pub rows: usize,
    pub cols: usize,
    pub group: ActGroup,
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<f32>,
}

impl DeviceActFp8 {
    /// Checks these activations against a GEMM's weight `[n, k]` and its output of `y_len`
    /// values (`[rows, n]`).
    pub(crate) fn check_gemm(
        &self,
        op: &'static str,
        (n, k): (usize, usize),
        y_len: usize,
    ) -> Result<(), KernelError> {
        ensure(self.cols == k, op, || {
            format!(
                "activation has {} columns, weight has {k} inputs",
                self.cols
            )
        })?;
        expect_len(op, "y", y_len, self.rows * n)
    }

    /// Allocates (zeroed) buffers for `[rows, cols]`; `cols` must be a multiple of the group.
    pub fn alloc(
        rt: &KernelRuntime,
        rows: usize,
        cols: usize,
        group: ActGroup,
    ) -> Result<DeviceActFp8, KernelError> {
        // SAFETY: both buffers are zero-filled right below, before anything can read them.
        let mut out = unsafe { DeviceActFp8::alloc_written(rt, rows, cols, group) }?;
        let stream = rt.stream();
        stream
            .memset_zeros(&mut out.codes)
            .and_then(|()| stream.memset_zeros(&mut out.scales))
            .map_err(KernelError::driver("zeroing activation buffers"))?;
        Ok(out)
    }

    /// [`DeviceActFp8::alloc`] uninitialised (poisoned under `DEEPINFER_CUDA_POISON`).
    ///
    /// # Safety
    ///
    /// The caller's launches write every code and scale before anything reads one.
    pub unsafe fn alloc_written(
        rt: &KernelRuntime,
        rows: usize,
        cols: usize,
        group: ActGroup,
    ) -> Result<DeviceActFp8, KernelError> {
        ensure(
            cols != 0 && cols.is_multiple_of(group.elements()),
            OP,
            || {
                format!(
                    "cols = {cols} is not a positive multiple of the group {}",
                    group.elements()
                )
            },
        )?;
        // SAFETY (both): the caller's contract.
        let codes = unsafe { rt.alloc_written::<u8>(rows * cols) }
            .map_err(KernelError::driver("allocating activation codes"))?;
        let scales = unsafe { rt.alloc_written::<f32>(rows * cols / group.elements()) }
            .map_err(KernelError::driver("allocating activation scales"))?;
        Ok(DeviceActFp8 {
            rows,
            cols,
            group,
            codes,
            scales,
        })
    }
}

/// Quantises `x` (`[out.rows, out.cols]`, row-major: bf16, or f32 storage of any fp32 values)
/// into `out`. Exact: the result equals the CPU definition bit for bit, whatever the number of
/// rows.
pub fn quantize_act_fp8_into<T: ActInput>(
    rt: &KernelRuntime,
    x: &CudaSlice<T>,
    out: &mut DeviceActFp8,
) -> Result<(), KernelError> {
    expect_len(OP, "x", x.len(), out.rows * out.cols)?;
    expect_len(OP, "codes", out.codes.len(), out.rows * out.cols)?;
    expect_len(
        OP,
        "scales",
        out.scales.len(),
        out.rows * out.cols / out.group.elements(),
    )?;
    if out.rows == 0 {
        return Ok(());
    }
    let params = ActQuantParams {
        rows: dim(OP, "rows", out.rows)?,
        cols: dim(OP, "cols", out.cols)?,
    };
    let warps = dim(
        OP,
        "warps",
        (out.rows * out.cols).div_ceil(ELEMENTS_PER_WARP),
    )?;
    let cfg = launch_config(
        (warps.div_ceil(WARPS_PER_BLOCK), 1, 1),
        WARPS_PER_BLOCK * 32,
        0,
    );
    let mut launch = rt.launcher(T::kernel(out.group))?;
    launch
        .arg(x)
        .arg(&mut out.codes)
        .arg(&mut out.scales)
        .arg(&params);
    // SAFETY: the kernel's signature is (const T*, u8*, float*, ActQuantParams), `T::kernel`
    // being the build that reads `x`'s element type; the buffer lengths were checked against
    // rows * cols above and the grid covers every element with warps of 128 (the kernel
    // bounds-checks the last warp's groups).
    unsafe { launch.launch(cfg) }
}

/// Allocating form of [`quantize_act_fp8_into`]: `x` quantised into new buffers for `[rows,
/// cols]`.
pub fn quantize_act_fp8<T: ActInput>(
    rt: &KernelRuntime,
    x: &CudaSlice<T>,
    rows: usize,
    cols: usize,
    group: ActGroup,
) -> Result<DeviceActFp8, KernelError> {
    // SAFETY: act_quant_fp8 writes every element's code and every group's scale (a warp per
    // 128 elements over all rows * cols).
    let mut out = unsafe { DeviceActFp8::alloc_written(rt, rows, cols, group) }?;
    quantize_act_fp8_into(rt, x, &mut out)?;
    Ok(out)
}
