//! Single-query multi-head attention with a per-head sink (`CpuBackend::sparse_attention`):
//! keys are shared by all heads (K = V), bit-exact with the CPU reference, one block per head with
//! one fixed reduction order (batch invariant).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{Rounding, dim, expect_len};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::AttentionParams;
use crate::runtime::KernelRuntime;

const OP: &str = "sparse_attention_sink_f32";
const THREADS: u32 = 256;
/// Must match `attention::MAX_DIMS_PER_THREAD`.
const MAX_HEAD_DIM: usize = 4 * THREADS as usize;

/// `out [heads, head_dim] = attention(q [heads, head_dim], keys [n_keys, head_dim], sink [heads])`,
/// f32 storage; `rounding` applies to the probabilities' weights and the outputs. `n_keys` may be 0 (only the sink: output 0); `keys` holds at least
/// `n_keys · head_dim` values (a device buffer cannot be empty).
pub fn sparse_attention_sink_f32(
    rt: &KernelRuntime,
    q: &CudaSlice<f32>,
    keys: &CudaSlice<f32>,
    n_keys: usize,
    sink: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    head_dim: usize,
    scale: f32,
    rounding: Rounding,
) -> Result<(), KernelError> {
    let heads = sink.len();
    if head_dim == 0 || head_dim > MAX_HEAD_DIM || heads == 0 {
        return Err(KernelError::Shape {
            op: OP,
            message: format!(
                "head_dim = {head_dim} must be in 1..={MAX_HEAD_DIM} and heads = {heads} positive"
            ),
        });
    }
    if keys.len() < n_keys * head_dim {
        return Err(KernelError::Shape {
            op: OP,
            message: format!(
                "keys hold {} values, fewer than {n_keys} keys of {head_dim}",
                keys.len()
            ),
        });
    }
    expect_len(OP, "q", q.len(), heads * head_dim)?;
    expect_len(OP, "out", out.len(), heads * head_dim)?;
    let params = AttentionParams {
        heads: dim(OP, "heads", heads)?,
        head_dim: dim(OP, "head_dim", head_dim)?,
        keys: dim(OP, "keys", n_keys)?,
        scale,
        round_bf16: rounding.flag(),
    };
    let cfg = LaunchConfig {
        grid_dim: (params.heads, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::SparseAttentionSinkF32)?);
    launch.arg(q).arg(keys).arg(sink).arg(out).arg(&params);
    // SAFETY: signature (const float* q, const float* keys, const float* sink, float* out,
    // AttentionParams); q/out hold heads * head_dim, keys >= n_keys * head_dim, sink heads values (checked
    // above); head_dim <= 4 * THREADS as the kernel's per-thread accumulators require.
    unsafe { launch.launch(cfg) }
        .map_err(KernelError::driver("launching sparse_attention_sink_f32"))?;
    Ok(())
}
