//! The model's small row math between backend ops, on the device (`cuda/rows/rows.cuh`), so that
//! activations need not visit the host inside a step; each launcher is bit-exact with the CPU
//! default of the `deepinfer-model` `Backend` op it implements:
//! - [`stream_means_f32`]: `bf16(mean over hc streams)` in the CPU's fold order
//!   (`Backend::stream_means_at`, the DSpark taps);
//! - [`scale_round_f32`]: `bf16(x · scale)` (`Backend::scale_at`, the indexer's head weights);
//! - [`gated_pool_f32`]: gated pooling of completed compressor groups
//!   (`Backend::gated_pool_rows`), whose `exp` is Rust's std `f32::exp` on x86-64 Linux,
//!   reproduced by [`exp_std_f32`];
//! - [`engram_inject_f32`]: the Engram gate and injection of the live tokens
//!   (`Backend::engram_inject`, `engram::EngramGate::inject`).
//!
//! Every output depends only on its own row or token (batch invariant).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Rounding, dim, ensure, expect_len, launch_config, whole_rows};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::{KernelRuntime, KernelValue};

/// Threads per block of the elementwise kernels (`rows::THREADS`).
const THREADS: u32 = 256;
/// Threads per Engram-injection block (`rows::INJECT_THREADS`).
const INJECT_THREADS: u32 = 256;
/// The most blocks a grid-stride launch uses.
const MAX_BLOCKS: usize = 1 << 16;
/// The most streams [`engram_inject_f32`] takes (`rows::MAX_HC`).
pub const MAX_HC: usize = 16;
/// The largest `dim` of [`engram_inject_f32`]: its products live in 32 KiB of shared memory
/// (under the 48 KiB a block gets without opting in; V4.1 has dim = 5120).
pub const MAX_INJECT_DIM: usize = 8192;

/// `rows::StreamMeansParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StreamMeansParams {
    tokens: u32,
    hc: u32,
    dim: u32,
    round_bf16: u32,
}

/// `rows::ScaleParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
struct ScaleParams {
    n: u64,
    scale: f32,
    round_bf16: u32,
}

/// `rows::PoolParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PoolParams {
    groups: u32,
    ratio: u32,
    head_dim: u32,
}

/// `rows::InjectParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
struct InjectParams {
    tokens: u32,
    live: u32,
    hc: u32,
    dim: u32,
    kv_stride: u32,
    eps: f32,
    inv_sqrt_dim: f32,
}

// SAFETY: plain `#[repr(C)]` structs of integers and floats, laid out as their CUDA mirrors
// (checked field by field in the tests below).
unsafe impl KernelValue for StreamMeansParams {}
// SAFETY: as above.
unsafe impl KernelValue for ScaleParams {}
// SAFETY: as above.
unsafe impl KernelValue for PoolParams {}
// SAFETY: as above.
unsafe impl KernelValue for InjectParams {}

/// A grid-stride launch over `total` elements.
fn stride_config(op: &'static str, total: usize) -> Result<LaunchConfig, KernelError> {
    let blocks = total.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS);
    Ok(launch_config(
        (dim(op, "blocks", blocks)?, 1, 1),
        THREADS,
        0,
    ))
}

/// `out [n, dim]` = `round(Σ_k streams[t, k, :] / hc)` of `streams [n, hc, dim]`, the sum folded
/// from 0 in stream order (rounded to bf16 with [`Rounding::Bf16`], as the model's
/// `Backend::stream_means_at`).
pub fn stream_means_f32(
    rt: &KernelRuntime,
    streams: &CudaSlice<f32>,
    hc: usize,
    dim_: usize,
    rounding: Rounding,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "stream_means_f32";
    let token_width = hc * dim_;
    ensure(
        hc != 0 && dim_ != 0 && streams.len().is_multiple_of(token_width),
        OP,
        || {
            format!(
                "streams ({} values) are not whole tokens of hc = {hc} × dim = {dim_} (both > 0)",
                streams.len()
            )
        },
    )?;
    let tokens = streams.len() / token_width;
    expect_len(OP, "out", out.len(), tokens * dim_)?;
    if tokens == 0 {
        return Ok(());
    }
    let params = StreamMeansParams {
        tokens: dim(OP, "tokens", tokens)?,
        hc: dim(OP, "hc", hc)?,
        dim: dim(OP, "dim", dim_)?,
        round_bf16: rounding.flag(),
    };
    let cfg = stride_config(OP, tokens * dim_)?;
    let mut launch = rt.launcher(KernelId::StreamMeansF32)?;
    launch.arg(streams).arg(out).arg(&params);
    // SAFETY: signature (const float* streams, float* out, StreamMeansParams); streams holds
    // tokens * hc * dim and out tokens * dim values (checked above).
    unsafe { launch.launch(cfg) }
}

/// `x[i] = round(x[i] · scale)` in place (rounded to bf16 with [`Rounding::Bf16`], as
/// `csa::index_queries` scales the indexer's head weights).
pub fn scale_round_f32(
    rt: &KernelRuntime,
    x: &mut CudaSlice<f32>,
    scale: f32,
    rounding: Rounding,
) -> Result<(), KernelError> {
    const OP: &str = "scale_round_f32";
    if x.is_empty() {
        return Ok(());
    }
    let params = ScaleParams {
        n: x.len() as u64,
        scale,
        round_bf16: rounding.flag(),
    };
    let cfg = stride_config(OP, x.len())?;
    let mut launch = rt.launcher(KernelId::ScaleRoundF32)?;
    launch.arg(x).arg(&params);
    // SAFETY: signature (float* x, ScaleParams); x holds n values.
    unsafe { launch.launch(cfg) }
}

/// `x[i] = exp(x[i])` in place, bit for bit as Rust's std `f32::exp` on x86-64 Linux (glibc's
/// `expf` in its FMA build, which the gated pooling of the CPU reference calls).
pub fn exp_std_f32(rt: &KernelRuntime, x: &mut CudaSlice<f32>) -> Result<(), KernelError> {
    const OP: &str = "exp_std_f32";
    if x.is_empty() {
        return Ok(());
    }
    let n = x.len() as u64;
    let cfg = stride_config(OP, x.len())?;
    let mut launch = rt.launcher(KernelId::ExpStdF32)?;
    launch.arg(x).arg(&n);
    // SAFETY: signature (float* x, unsigned long long n); x holds n values.
    unsafe { launch.launch(cfg) }
}

/// `out [groups, head_dim]`: the gated pooling of every channel of every group, as the model's
/// `Backend::gated_pool_rows`: over the `ratio` member rows of group `g`, each a `kv ‖ gate` row
/// of `2 · head_dim` f32 values at device address `members[g · ratio + j]` (member order is the
/// fold order), `bf16(Σ_j kv_j[c] · (e_j / Σ e))` with `e_j = exp(gate_j[c] − max gate[c])`.
///
/// # Safety
/// Every address in `members` must point at `2 · head_dim` f32 values of device memory of `rt`'s
/// context that stay allocated until the launch has run (the buffers held until it is enqueued
/// on the runtime's stream, when they are freed on that stream); the kernel reads them unchecked.
pub unsafe fn gated_pool_f32(
    rt: &KernelRuntime,
    members: &CudaSlice<u64>,
    groups: usize,
    ratio: usize,
    head_dim: usize,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gated_pool_f32";
    ensure(ratio != 0 && head_dim != 0, OP, || {
        format!("ratio = {ratio} and head_dim = {head_dim} must be positive")
    })?;
    expect_len(OP, "members", members.len(), groups * ratio)?;
    expect_len(OP, "out", out.len(), groups * head_dim)?;
    if groups == 0 {
        return Ok(());
    }
    let params = PoolParams {
        groups: dim(OP, "groups", groups)?,
        ratio: dim(OP, "ratio", ratio)?,
        head_dim: dim(OP, "head_dim", head_dim)?,
    };
    let cfg = stride_config(OP, groups * head_dim)?;
    let mut launch = rt.launcher(KernelId::GatedPoolF32)?;
    launch.arg(members).arg(out).arg(&params);
    // SAFETY: signature (const u64* members, float* out, PoolParams); members holds groups *
    // ratio addresses, each valid for 2 * head_dim values by the caller's contract, out groups *
    // head_dim values.
    unsafe { launch.launch(cfg) }
}

/// The shape and settings of [`engram_inject_f32`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngramInjectShape {
    /// Streams per token (`hc_mult`).
    pub hc: usize,
    /// Values per stream.
    pub dim: usize,
    /// Values per `kv` row (at least `(hc + 1) · dim`: the hc keys, then the value).
    pub kv_stride: usize,
    /// The RMS epsilon (`norm_eps`).
    pub eps: f32,
}

/// `EngramGate::inject` of every live token: for live entry `i` (token `live[i]`) and stream `k`,
/// `x[token, k, :] ← bf16(x[token, k, :] + gate_k · value)`, the gate
/// `sigmoid(sign(d)·sqrt(max(|d|, 1e-6)))` of
/// `d = Σ(h·w·key) · rsqrt(mean h² + ε) · rsqrt(mean key² + ε) / √dim` (the sums in torch's CPU
/// order), with `streams [tokens, hc, dim]`, `kv [live, kv_stride]` (row `i` for entry `i`: the
/// hc keys, then the value) and `weight [hc, dim]` (`q_weight ⊙ k_weight`). Live ids must be
/// distinct; ids at or past `tokens` live on the device unchecked and are skipped.
pub fn engram_inject_f32(
    rt: &KernelRuntime,
    streams: &mut CudaSlice<f32>,
    kv: &CudaSlice<f32>,
    live: &CudaSlice<u32>,
    weight: &CudaSlice<f32>,
    shape: EngramInjectShape,
) -> Result<(), KernelError> {
    const OP: &str = "engram_inject_f32";
    let EngramInjectShape {
        hc,
        dim: dim_,
        kv_stride,
        eps,
    } = shape;
    ensure(
        hc != 0 && hc <= MAX_HC && dim_ != 0 && dim_ <= MAX_INJECT_DIM,
        OP,
        || format!("hc = {hc} must be in 1..={MAX_HC} and dim = {dim_} in 1..={MAX_INJECT_DIM}"),
    )?;
    ensure(kv_stride >= (hc + 1) * dim_, OP, || {
        format!("kv rows of {kv_stride} values cannot hold {hc} keys and a value of {dim_} values")
    })?;
    let token_width = hc * dim_;
    let tokens = whole_rows(OP, streams.len(), token_width, || {
        format!(
            "streams ({} values) are not whole tokens of {hc} × {dim_}",
            streams.len()
        )
    })?;
    expect_len(OP, "kv", kv.len(), live.len() * kv_stride)?;
    expect_len(OP, "weight", weight.len(), token_width)?;
    if live.is_empty() {
        return Ok(());
    }
    let params = InjectParams {
        tokens: dim(OP, "tokens", tokens)?,
        live: dim(OP, "live tokens", live.len())?,
        hc: dim(OP, "hc", hc)?,
        dim: dim(OP, "dim", dim_)?,
        kv_stride: dim(OP, "kv_stride", kv_stride)?,
        eps,
        // As EngramGate::gates computes it.
        inv_sqrt_dim: (dim_ as f64).powf(-0.5) as f32,
    };
    let cfg = launch_config(
        (params.live, 1, 1),
        INJECT_THREADS,
        dim(OP, "shared memory", dim_ * size_of::<f32>())?,
    );
    let mut launch = rt.launcher(KernelId::EngramInjectF32)?;
    launch
        .arg(streams)
        .arg(kv)
        .arg(weight)
        .arg(live)
        .arg(&params);
    // SAFETY: signature (float* streams, const float* kv, const float* weight, const u32* live,
    // InjectParams); one block per live entry, streams tokens * hc * dim, kv live * kv_stride,
    // weight hc * dim values (checked above); live ids >= tokens are skipped by the kernel; the
    // dynamic shared memory holds dim floats (<= 32 KiB).
    unsafe { launch.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::super::assert_mirrors;
    use super::*;

    #[test]
    fn params_mirror_the_cuda_structs() {
        let header = include_str!("../../cuda/rows/rows.cuh");
        assert_mirrors::<StreamMeansParams>(header, 16, &["tokens", "hc", "dim", "round_bf16"]);
        assert_mirrors::<ScaleParams>(header, 16, &["n", "scale", "round_bf16"]);
        assert_mirrors::<PoolParams>(header, 12, &["groups", "ratio", "head_dim"]);
        assert_mirrors::<InjectParams>(
            header,
            28,
            &[
                "tokens",
                "live",
                "hc",
                "dim",
                "kv_stride",
                "eps",
                "inv_sqrt_dim",
            ],
        );
    }

    #[test]
    fn the_limits_match_the_kernels() {
        let header = include_str!("../../cuda/rows/rows.cuh");
        assert!(header.contains(&format!("constexpr u32_t MAX_HC = {MAX_HC};")));
        assert!(header.contains(&format!("constexpr u32_t THREADS = {THREADS};")));
        assert!(header.contains(&format!(
            "constexpr u32_t INJECT_THREADS = {INJECT_THREADS};"
        )));
    }
}
