//! Launchers of the V4 family's float32 ops (`cuda/v4/v4.cu`): the compressor's softmax pooling
//! over slots given by device address ([`v4_pool_f32`]) and the hyper-head's collapse weights
//! ([`v4_hyper_head_f32`], the squares in either [`SquaresOrder`]). The MoE's fp32 experts are
//! routed ops (`ops::routed_exact`).

use cudarc::driver::CudaSlice;

use super::{dim, ensure, expect_len, grid_stride_config, launch_config, sgemm_chains, whole_rows};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;
/// Threads per row of `v4_hyper_head_f32` (`HYPER_HEAD_THREADS` in the kernel).
const HYPER_HEAD_THREADS: u32 = 256;
/// The most FMA chains (`hc · sgemm_chains(width)`) one row's block holds (`HYPER_HEAD_MAX_CHAINS`).
const HYPER_HEAD_MAX_CHAINS: usize = 1024;

/// Pools `entries = slot_start.len() − 1` entries of `width` channels into `out [entries, width]`:
/// entry `e` takes the softmax over its slots `slot_start[e] .. slot_start[e + 1]` of
/// `gate_s + bias_s` weighting `kv_s` (`kv`, `gate`, `bias`: one device address of `width` floats
/// per slot).
///
/// # Safety
/// Every address in `kv`, `gate` and `bias` must point at `width` readable floats of this
/// context that stay alive until the launch has run.
pub unsafe fn v4_pool_f32(
    rt: &KernelRuntime,
    kv: &CudaSlice<u64>,
    gate: &CudaSlice<u64>,
    bias: &CudaSlice<u64>,
    slot_start: &CudaSlice<u32>,
    width: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "v4_pool_f32";
    let slots = kv.len();
    expect_len(OP, "gate", gate.len(), slots)?;
    expect_len(OP, "bias", bias.len(), slots)?;
    let entries = slot_start.len().saturating_sub(1);
    expect_len(OP, "out", out.len(), entries * width)?;
    if entries == 0 || width == 0 {
        return Ok(());
    }
    let (entries_u32, width_u32) = (dim(OP, "entries", entries)?, dim(OP, "width", width)?);
    let mut launch = rt.launcher(KernelId::V4PoolF32)?;
    launch
        .arg(kv)
        .arg(gate)
        .arg(bias)
        .arg(slot_start)
        .arg(&entries_u32)
        .arg(&width_u32)
        .arg(out);
    // SAFETY: signature (const u64* kv, const u64* gate, const u64* bias, const u32* slot_start,
    // u32 entries, u32 width, float* out); lengths checked above, the addresses by the caller.
    unsafe { launch.launch(grid_stride_config(entries * width, THREADS)) }
}

/// How [`v4_hyper_head_f32`] adds a row's squares in f64 (rounded once to f32 after).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SquaresOrder {
    /// In sequence from the first, the reference's order (exact numerics: the CPU's bits); one
    /// dependent chain of `width` adds.
    InOrder,
    /// By a fixed tree: 256 strided partials added by halving (fast numerics). The f64 sums
    /// differ by at most `2 (width − 1) 2^-53` of the sum, so the f32 sum is the reference's or one
    /// ulp from it; fixed per row, so batch invariant.
    Tree,
}

/// The hyper-head's collapse weights `pre [rows, hc]` of `x [rows, width]` with `proj [hc, width]`,
/// `base [hc]`: `σ(dot(x_r, proj_k) · inv_r · scale + base_k) + hc_eps`, `inv_r` the reciprocal
/// RMS of row `r` (its squares summed in f64 in `order`) with `norm_eps`.
#[allow(clippy::too_many_arguments)]
pub fn v4_hyper_head_f32(
    rt: &KernelRuntime,
    order: SquaresOrder,
    x: &CudaSlice<f32>,
    proj: &CudaSlice<f32>,
    base: &CudaSlice<f32>,
    scale: f32,
    hc_eps: f32,
    norm_eps: f32,
    pre: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "v4_hyper_head_f32";
    let hc = base.len();
    ensure(
        hc != 0 && proj.len().is_multiple_of(hc) && !proj.is_empty(),
        OP,
        || format!("a {}-value projection for {hc} weights", proj.len()),
    )?;
    let width = proj.len() / hc;
    let rows = whole_rows(OP, x.len(), width, || {
        format!("{} values are not whole rows of {width}", x.len())
    })?;
    expect_len(OP, "pre", pre.len(), rows * hc)?;
    let chains = hc * sgemm_chains(width);
    ensure(chains <= HYPER_HEAD_MAX_CHAINS, OP, || {
        format!(
            "{hc} weights of width {width} need {chains} FMA chains (at most {HYPER_HEAD_MAX_CHAINS})"
        )
    })?;
    if rows == 0 {
        return Ok(());
    }
    let (rows_u32, width_u32, hc_u32) = (
        dim(OP, "rows", rows)?,
        dim(OP, "width", width)?,
        dim(OP, "hc", hc)?,
    );
    let kernel = match order {
        SquaresOrder::InOrder => KernelId::V4HyperHeadF32,
        SquaresOrder::Tree => KernelId::V4HyperHeadTreeF32,
    };
    let mut launch = rt.launcher(kernel)?;
    launch
        .arg(x)
        .arg(proj)
        .arg(base)
        .arg(&rows_u32)
        .arg(&width_u32)
        .arg(&hc_u32)
        .arg(&scale)
        .arg(&hc_eps)
        .arg(&norm_eps)
        .arg(pre);
    let config = launch_config((rows_u32, 1, 1), HYPER_HEAD_THREADS, 0);
    // SAFETY: signature (const float* x, const float* proj, const float* base, u32 rows,
    // u32 width, u32 hc, float scale, float hc_eps, float norm_eps, float* pre); lengths checked.
    unsafe { launch.launch(config) }
}
