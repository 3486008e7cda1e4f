//! The cuBLASLt FP8 GEMM, a peer of the `fast` section: `y = x · Wᵀ` with E4M3 `x` and `W`, one
//! f32 scale per tensor (`CUBLASLT_MATMUL_DESC_{A,B}_SCALE_POINTER`), fp32 accumulation with
//! cuBLASLt's default promotion (no fast accumulation) and bf16 output — the per-tensor-scaled
//! FP8 GEMM behind torch's `_scaled_mm`. It does less than the fast kernel (no per-group block
//! scales), so it bounds from above what a tensor-core FP8 GEMM reaches on a shape.
//!
//! Layout: row-major `y[m, n] = x[m, k] · W[n, k]ᵀ` is column-major `yᵀ[n, m] = op(A) · B` with
//! `A` = W seen as a column-major `[k, n]` (transposed: the "TN" form cuBLASLt's FP8 kernels
//! require) and `B` = xᵀ as a column-major `[k, m]`. cuBLASLt may refuse an FP8 shape whose `m`
//! is not a multiple of 16: [`LtFp8::plan`] then plans the GEMM on `m` rounded up to 16 and says
//! so ([`LtPlan::rows`]).

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use anyhow::{Context, Result};
use deepinfer_kernels::cudarc::cublaslt::result as lt;
use deepinfer_kernels::cudarc::cublaslt::sys;
use deepinfer_kernels::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

/// Workspace cuBLASLt may use (its own default on sm_90 and later).
const WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLASLt handle and its workspace on one stream.
pub struct LtFp8 {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

impl LtFp8 {
    pub fn new(stream: Arc<CudaStream>) -> Result<LtFp8> {
        let handle = lt::create_handle().context("creating a cuBLASLt handle")?;
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        Ok(LtFp8 {
            handle,
            workspace,
            stream,
        })
    }

    /// Descriptors, scales and the heuristic's algorithm for `[m × k] · [n × k]ᵀ` (retried with
    /// `m` rounded up to 16 when cuBLASLt has no FP8 kernel for `m`).
    pub fn plan(&self, m: usize, n: usize, k: usize) -> Result<LtPlan> {
        match self.plan_rows(m, n, k) {
            Ok(plan) => Ok(plan),
            Err(first) if !m.is_multiple_of(16) => self
                .plan_rows(m.next_multiple_of(16), n, k)
                .with_context(|| format!("cuBLASLt FP8 at m = {m}: {first:#}; padded to 16")),
            Err(first) => Err(first),
        }
    }

    fn plan_rows(&self, rows: usize, n: usize, k: usize) -> Result<LtPlan> {
        let scale_a = self.stream.clone_htod(&[1.0f32])?;
        let scale_b = self.stream.clone_htod(&[1.0f32])?;
        let e4m3 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
        let (n64, k64, rows64) = (n as u64, k as u64, rows as u64);
        let mut plan = LtPlan {
            rows,
            desc: lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )?,
            a: lt::create_matrix_layout(e4m3, k64, n64, k as i64)?,
            b: lt::create_matrix_layout(e4m3, k64, rows64, k as i64)?,
            c: lt::create_matrix_layout(sys::cudaDataType_t::CUDA_R_16BF, n64, rows64, n as i64)?,
            algo: None,
            scale_a,
            scale_b,
        };
        {
            let transpose: i32 = 1;
            let keep: i32 = 0;
            // The scales' device addresses stay valid while the plan holds the slices.
            let (a_scale, _a_record) = plan.scale_a.device_ptr(&self.stream);
            let (b_scale, _b_record) = plan.scale_b.device_ptr(&self.stream);
            use sys::cublasLtMatmulDescAttributes_t as Attr;
            // SAFETY: the descriptor is alive; every value points at a live local of the size
            // given.
            unsafe {
                set_desc(plan.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &transpose)?;
                set_desc(plan.desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &keep)?;
                set_desc(
                    plan.desc,
                    Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    &a_scale,
                )?;
                set_desc(
                    plan.desc,
                    Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    &b_scale,
                )?;
            }
        }
        let pref = lt::create_matmul_pref()?;
        let workspace = WORKSPACE_BYTES;
        // SAFETY: every descriptor is alive; `workspace` is a live usize.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const usize).cast::<c_void>(),
                size_of::<usize>(),
            );
            let heuristic = set.and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.c,
                    plan.c,
                    pref,
                )
            });
            lt::destroy_matmul_pref(pref)?;
            heuristic
        };
        plan.algo = Some(heuristic.with_context(|| {
            format!("cuBLASLt has no FP8 GEMM for m = {rows}, n = {n}, k = {k}")
        })?);
        Ok(plan)
    }

    /// One GEMM of `plan`: `w` holds `n·k` E4M3 codes, `x` `rows·k`, `y` `rows·n` bf16 values.
    pub fn launch(
        &self,
        plan: &LtPlan,
        w: &CudaSlice<u8>,
        x: &CudaSlice<u8>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let algo = plan.algo.as_ref().context("an unplanned cuBLASLt GEMM")?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (a, _a_record) = w.device_ptr(&self.stream);
        let (b, _b_record) = x.device_ptr(&self.stream);
        let (d, _d_record) = y.device_ptr_mut(&self.stream);
        let (space, _space_record) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the plan's layouts describe `w`, `x` and `y` (the caller's sizes); the handle,
        // descriptors and workspace are alive for the call.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a as *const c_void,
                plan.a,
                b as *const c_void,
                plan.b,
                d as *const c_void,
                plan.c,
                d as *mut c_void,
                plan.c,
                &algo.algo,
                space as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .context("cuBLASLt FP8 GEMM")
    }
}

impl Drop for LtFp8 {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once.
        if let Err(e) = unsafe { lt::destroy_handle(self.handle) } {
            eprintln!("destroying the cuBLASLt handle: {e:?}");
        }
    }
}

/// One planned cuBLASLt FP8 GEMM shape.
pub struct LtPlan {
    /// Activation rows the plan multiplies (`m`, or `m` rounded up to 16).
    pub rows: usize,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: Option<sys::cublasLtMatmulHeuristicResult_t>,
    /// The per-tensor scales (1.0) the descriptor points at.
    scale_a: CudaSlice<f32>,
    scale_b: CudaSlice<f32>,
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `plan_rows` and is destroyed once.
        let results = unsafe {
            [
                lt::destroy_matrix_layout(self.a),
                lt::destroy_matrix_layout(self.b),
                lt::destroy_matrix_layout(self.c),
                lt::destroy_matmul_desc(self.desc),
            ]
        };
        for e in results.into_iter().filter_map(Result::err) {
            eprintln!("destroying a cuBLASLt descriptor: {e:?}");
        }
    }
}

/// Sets one attribute of a matmul descriptor to `value`.
///
/// # Safety
/// `desc` must be alive and `T` the attribute's type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attribute: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    // SAFETY: the caller's contract; `value` is a live `T` of `size_of::<T>()` bytes.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attribute,
            (value as *const T).cast::<c_void>(),
            size_of::<T>(),
        )
    }
    .with_context(|| format!("cuBLASLt descriptor attribute {attribute:?}"))
}
