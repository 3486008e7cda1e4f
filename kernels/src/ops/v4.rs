//! Launchers of the V4 family's float32 ops (`cuda/v4/v4.cu`): the compressor's softmax pooling
//! over slots given by device address ([`v4_pool_f32`]), the MoE route weights as a dense
//! `[rows, experts]` matrix ([`v4_dense_routes_f32`]) and the SwiGLU of exact expert rows scaled by
//! one column of it ([`v4_swiglu_f32`]) and the hyper-head's collapse weights
//! ([`v4_hyper_head_f32`]).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{dim, expect_len};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::KernelRuntime;

const THREADS: u32 = 256;

/// A grid-stride launch over `n` values.
fn launch_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 4096) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Pools `entries = slot_start.len() − 1` entries of `width` channels into `out [entries, width]`:
/// entry `e` takes the softmax over its slots `slot_start[e] .. slot_start[e + 1]` of
/// `gate_s + bias_s` weighting `kv_s` (`kv`, `gate`: one device address of `width` floats per slot;
/// `bias [slots, width]`).
///
/// # Safety
/// Every address in `kv` and `gate` must point at `width` readable floats of this context that
/// stay alive until the launch has run.
pub unsafe fn v4_pool_f32(
    rt: &KernelRuntime,
    kv: &CudaSlice<u64>,
    gate: &CudaSlice<u64>,
    bias: &CudaSlice<f32>,
    slot_start: &CudaSlice<u32>,
    width: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "v4_pool_f32";
    let slots = kv.len();
    expect_len(OP, "gate", gate.len(), slots)?;
    expect_len(OP, "bias", bias.len(), slots * width)?;
    let entries = slot_start.len().saturating_sub(1);
    expect_len(OP, "out", out.len(), entries * width)?;
    if entries == 0 || width == 0 {
        return Ok(());
    }
    let (entries_u32, width_u32) = (dim(OP, "entries", entries)?, dim(OP, "width", width)?);
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::V4PoolF32)?);
    launch
        .arg(kv)
        .arg(gate)
        .arg(bias)
        .arg(slot_start)
        .arg(&entries_u32)
        .arg(&width_u32)
        .arg(out);
    // SAFETY: signature (const u64* kv, const u64* gate, const float* bias, const u32* slot_start,
    // u32 entries, u32 width, float* out); lengths checked above, the addresses by the caller.
    unsafe { launch.launch(launch_config(entries * width)) }
        .map_err(KernelError::driver("launching v4_pool_f32"))?;
    Ok(())
}

/// Scatters the routes `ids [rows, k]` / `weights [rows, k]` into `dense [rows, experts]` (zeroed
/// by the caller; ids at or beyond `experts` are dropped).
pub fn v4_dense_routes_f32(
    rt: &KernelRuntime,
    ids: &CudaSlice<u32>,
    weights: &CudaSlice<f32>,
    k: usize,
    experts: usize,
    dense: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "v4_dense_routes_f32";
    expect_len(OP, "weights", weights.len(), ids.len())?;
    if k == 0 || !ids.len().is_multiple_of(k) {
        return Err(KernelError::Shape {
            op: OP,
            message: format!("{} ids are not whole rows of {k}", ids.len()),
        });
    }
    let rows = ids.len() / k;
    expect_len(OP, "dense", dense.len(), rows * experts)?;
    if rows == 0 {
        return Ok(());
    }
    let params = (
        dim(OP, "rows", rows)?,
        dim(OP, "k", k)?,
        dim(OP, "experts", experts)?,
    );
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::V4DenseRoutesF32)?);
    launch
        .arg(ids)
        .arg(weights)
        .arg(&params.0)
        .arg(&params.1)
        .arg(&params.2)
        .arg(dense);
    // SAFETY: signature (const u32* ids, const float* weights, u32 rows, u32 k, u32 experts,
    // float* dense); lengths checked above, ids at or beyond `experts` are skipped by the kernel.
    unsafe { launch.launch(launch_config(rows * k)) }
        .map_err(KernelError::driver("launching v4_dense_routes_f32"))?;
    Ok(())
}

/// One route-weight column of a dense `[rows, stride]` matrix, from its first value's offset.
#[derive(Debug, Clone, Copy)]
pub struct RouteColumn<'a> {
    pub dense: &'a CudaSlice<f32>,
    pub column: usize,
    pub stride: usize,
}

/// `out = w_r · silu(g') · u'` over `gate`, `up` `[rows, inter]` (clamped at `limit` when
/// positive); `w_r` is row `r`'s value of `route`, or 1 without one.
pub fn v4_swiglu_f32(
    rt: &KernelRuntime,
    gate: &CudaSlice<f32>,
    up: &CudaSlice<f32>,
    route: Option<RouteColumn<'_>>,
    inter: usize,
    limit: f32,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "v4_swiglu_f32";
    let n = gate.len();
    expect_len(OP, "up", up.len(), n)?;
    expect_len(OP, "out", out.len(), n)?;
    if inter == 0 || !n.is_multiple_of(inter) || limit.is_nan() {
        return Err(KernelError::Shape {
            op: OP,
            message: format!("{n} values are not whole rows of {inter} (limit {limit})"),
        });
    }
    let rows = n / inter;
    if rows == 0 {
        return Ok(());
    }
    // The route column starts at its first value: a view of the dense matrix from `column`.
    let (route_view, stride, has_route) = match route {
        Some(r) => {
            if r.column >= r.stride || r.dense.len() != rows * r.stride {
                return Err(KernelError::Shape {
                    op: OP,
                    message: format!(
                        "route column {} of a {}-value matrix of stride {} for {rows} rows",
                        r.column,
                        r.dense.len(),
                        r.stride
                    ),
                });
            }
            (r.dense.slice(r.column..), r.stride, 1u32)
        }
        None => (gate.slice(0..), 0, 0u32),
    };
    let (stride, rows_u32, inter_u32) = (
        dim(OP, "stride", stride)?,
        dim(OP, "rows", rows)?,
        dim(OP, "inter", inter)?,
    );
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::V4SwigluF32)?);
    launch
        .arg(gate)
        .arg(up)
        .arg(&route_view)
        .arg(&stride)
        .arg(&has_route)
        .arg(&rows_u32)
        .arg(&inter_u32)
        .arg(&limit)
        .arg(out);
    // SAFETY: signature (const float* gate, const float* up, const float* route, u32 route_stride,
    // u32 has_route, u32 rows, u32 inter, float limit, float* out); lengths checked above; the
    // route view holds (rows − 1) · stride + 1 values when read (has_route), is unread otherwise.
    unsafe { launch.launch(launch_config(n)) }
        .map_err(KernelError::driver("launching v4_swiglu_f32"))?;
    Ok(())
}

/// The hyper-head's collapse weights `pre [rows, hc]` of `x [rows, width]` with `proj [hc, width]`,
/// `base [hc]`: `σ(dot(x_r, proj_k) · inv_r · scale + base_k) + hc_eps`, `inv_r` the reciprocal
/// RMS of row `r` (its squares summed in f64, in order) with `norm_eps`.
#[allow(clippy::too_many_arguments)]
pub fn v4_hyper_head_f32(
    rt: &KernelRuntime,
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
    if hc == 0 || !proj.len().is_multiple_of(hc) || proj.is_empty() {
        return Err(KernelError::Shape {
            op: OP,
            message: format!("a {}-value projection for {hc} weights", proj.len()),
        });
    }
    let width = proj.len() / hc;
    if !x.len().is_multiple_of(width) {
        return Err(KernelError::Shape {
            op: OP,
            message: format!("{} values are not whole rows of {width}", x.len()),
        });
    }
    let rows = x.len() / width;
    expect_len(OP, "pre", pre.len(), rows * hc)?;
    if rows == 0 {
        return Ok(());
    }
    let (rows_u32, width_u32, hc_u32) = (
        dim(OP, "rows", rows)?,
        dim(OP, "width", width)?,
        dim(OP, "hc", hc)?,
    );
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::V4HyperHeadF32)?);
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
    let config = LaunchConfig {
        grid_dim: (rows_u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: signature (const float* x, const float* proj, const float* base, u32 rows,
    // u32 width, u32 hc, float scale, float hc_eps, float norm_eps, float* pre); lengths checked.
    unsafe { launch.launch(config) }.map_err(KernelError::driver("launching v4_hyper_head_f32"))?;
    Ok(())
}
