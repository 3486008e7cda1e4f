//! Lightning-indexer scores of one query against compressed keys (`CpuBackend::index_scores`),
//! with the reference's bf16 rounding points: bit-exact, one block per key (batch invariant).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{Rounding, dim, expect_len};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::IndexParams;
use crate::runtime::KernelRuntime;

const OP: &str = "index_scores_f32";
const THREADS: u32 = 64;
/// Heads whose terms fit the kernel's shared memory comfortably.
const MAX_HEADS: usize = 4096;

/// `scores [n] = index scores of q [heads, head_dim] with weights w [heads] against
/// keys [n, head_dim]`, all f32 storage; `rounding` Bf16 is the reference's rounding points, F32
/// rounds nowhere.
pub fn index_scores_f32(
    rt: &KernelRuntime,
    q: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    keys: &CudaSlice<f32>,
    scores: &mut CudaSlice<f32>,
    head_dim: usize,
    rounding: Rounding,
) -> Result<(), KernelError> {
    let heads = w.len();
    if head_dim == 0 || heads == 0 || heads > MAX_HEADS {
        return Err(KernelError::Shape {
            op: OP,
            message: format!(
                "head_dim = {head_dim} and heads = {heads} must be positive (heads <= {MAX_HEADS})"
            ),
        });
    }
    if !keys.len().is_multiple_of(head_dim) {
        return Err(KernelError::Shape {
            op: OP,
            message: format!(
                "keys hold {} values, not a whole number of {head_dim}-wide keys",
                keys.len()
            ),
        });
    }
    let n = keys.len() / head_dim;
    expect_len(OP, "q", q.len(), heads * head_dim)?;
    expect_len(OP, "scores", scores.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let params = IndexParams {
        heads: dim(OP, "heads", heads)?,
        head_dim: dim(OP, "head_dim", head_dim)?,
        keys: dim(OP, "keys", n)?,
        round_bf16: rounding.flag(),
    };
    let cfg = LaunchConfig {
        grid_dim: (params.keys, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: params.heads * 4,
    };
    let mut launch = rt
        .stream()
        .launch_builder(rt.function(KernelId::IndexScoresF32)?);
    launch.arg(q).arg(w).arg(keys).arg(scores).arg(&params);
    // SAFETY: signature (const float* q, const float* w, const float* keys, float* scores,
    // IndexParams); lengths checked above; the dynamic shared memory holds one float per head.
    unsafe { launch.launch(cfg) }.map_err(KernelError::driver("launching index_scores_f32"))?;
    Ok(())
}
