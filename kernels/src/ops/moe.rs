//! The MoE router after the gate linear (`deepinfer_model::backend::cpu::route_experts`):
//! sqrt-softplus scores, biased top-k (or a forced list), normalised weights; bit-exact, one block
//! per token.

use cudarc::driver::CudaSlice;

use super::{dim, ensure, expect_len, launch_config, whole_rows};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::{KernelRuntime, KernelValue};

const OP: &str = "route_experts_f32";
/// `moe::THREADS` and `moe::GROUP` in `cuda/moe/route.cuh`.
const THREADS: u32 = 512;
const GROUP: usize = 32;
/// Experts whose top-k of any size fits the block's default 48 KiB of shared memory (40 KiB at
/// 2048, k >= 32).
const MAX_EXPERTS: usize = 2048;
/// The default dynamic shared memory limit of a block.
const SHARED_LIMIT: usize = 48 * 1024;

/// `moe::RouteParams` in `cuda/moe/route.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
struct RouteParams {
    rows: u32,
    experts: u32,
    selected: u32,
    forced: u32,
    route_scale: f32,
}

// SAFETY: a plain `#[repr(C)]` struct of integers and a float, laid out as its CUDA mirror.
unsafe impl KernelValue for RouteParams {}

/// Which experts each token takes.
#[derive(Debug, Clone, Copy)]
pub enum Selection<'a> {
    /// The `k` best (clamped to the expert count).
    TopK(usize),
    /// These experts (every id below the expert count; repeats allowed), the same for every
    /// token.
    Forced(&'a CudaSlice<u32>),
    /// Each token its own `per_row` experts: token `r` takes `ids[r · per_row ..][..per_row]`
    /// (a hash layer's experts of every token's id).
    ForcedRows {
        ids: &'a CudaSlice<u32>,
        per_row: usize,
    },
}

/// Routes `logits [rows, bias.len()]`: `experts [rows, selected]` and `weights [rows, selected]`
/// with `selected` = [`selected_count`].
pub fn route_experts_f32(
    rt: &KernelRuntime,
    logits: &CudaSlice<f32>,
    bias: &CudaSlice<f32>,
    selection: Selection<'_>,
    route_scale: f32,
    experts: &mut CudaSlice<u32>,
    weights: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let n_experts = bias.len();
    ensure(n_experts != 0 && n_experts <= MAX_EXPERTS, OP, || {
        format!("{n_experts} experts (1 to {MAX_EXPERTS})")
    })?;
    let rows = whole_rows(OP, logits.len(), n_experts, || {
        format!(
            "logits hold {} values, not whole rows of {n_experts}",
            logits.len()
        )
    })?;
    // A forced list may repeat an expert (it is replayed as given), so it may outnumber them.
    let selected = selected_count(selection, n_experts);
    if let Selection::ForcedRows { ids, .. } = selection {
        expect_len(OP, "forced rows", ids.len(), rows * selected)?;
    }
    expect_len(OP, "experts", experts.len(), rows * selected)?;
    expect_len(OP, "weights", weights.len(), rows * selected)?;
    if rows == 0 || selected == 0 {
        return Ok(());
    }
    let params = RouteParams {
        rows: dim(OP, "rows", rows)?,
        experts: dim(OP, "experts", n_experts)?,
        selected: dim(OP, "selected", selected)?,
        forced: match selection {
            Selection::TopK(_) => 0,
            Selection::Forced(_) => 1,
            Selection::ForcedRows { .. } => 2,
        },
        route_scale,
    };
    let shared = shared_bytes(n_experts, selected, params.forced != 0);
    ensure(shared <= SHARED_LIMIT, OP, || {
        format!(
            "{n_experts} experts choosing {selected} need {shared} bytes of shared memory (at most {SHARED_LIMIT})"
        )
    })?;
    let cfg = launch_config((params.rows, 1, 1), THREADS, shared as u32);
    // The forced list, or a one-element placeholder the kernel does not read.
    let placeholder;
    let forced = match selection {
        Selection::Forced(ids) | Selection::ForcedRows { ids, .. } => ids,
        Selection::TopK(_) => {
            // SAFETY: never read (forced = 0).
            placeholder = unsafe { rt.alloc_written::<u32>(1) }.map_err(KernelError::driver(
                "allocating the forced-list placeholder",
            ))?;
            &placeholder
        }
    };
    let mut launch = rt.launcher(KernelId::RouteExpertsF32)?;
    launch
        .arg(logits)
        .arg(bias)
        .arg(forced)
        .arg(experts)
        .arg(weights)
        .arg(&params);
    // SAFETY: signature (const float* logits, const float* bias, const u32* forced_ids,
    // u32* experts, float* weights, RouteParams); lengths checked above (a shared forced list
    // holds `selected` ids, per-row lists rows * selected); the dynamic shared memory is
    // `shared_bytes`, the kernel's layout.
    unsafe { launch.launch(cfg) }
}

/// The kernel's dynamic shared memory: the groups' candidates (two words each, a multiple of four;
/// `min(selected, GROUP)` a group of `GROUP` experts, none for a forced list), the keys of the
/// experts padded to whole groups, their scores and the chosen ids.
fn shared_bytes(n_experts: usize, selected: usize, forced: bool) -> usize {
    let padded = n_experts.div_ceil(GROUP) * GROUP;
    let per_group = if forced { 0 } else { selected.min(GROUP) };
    let slots = (padded / GROUP * per_group).next_multiple_of(4);
    4 * (2 * slots + padded + n_experts + selected)
}

/// Experts chosen per token for `selection` over `n_experts`.
pub fn selected_count(selection: Selection<'_>, n_experts: usize) -> usize {
    match selection {
        Selection::TopK(k) => k.min(n_experts),
        Selection::Forced(ids) => ids.len(),
        Selection::ForcedRows { per_row, .. } => per_row,
    }
}

#[cfg(test)]
mod tests {
    use super::super::assert_mirrors;
    use super::*;

    #[test]
    fn params_mirror_the_cuda_struct() {
        let header = include_str!("../../cuda/moe/route.cuh");
        assert_mirrors::<RouteParams>(
            header,
            20,
            &["rows", "experts", "selected", "forced", "route_scale"],
        );
    }

    #[test]
    fn the_shape_matches_the_kernel() {
        let header = include_str!("../../cuda/moe/route.cuh");
        assert!(header.contains(&format!("constexpr u32_t THREADS = {THREADS};")));
        assert!(header.contains(&format!("constexpr u32_t GROUP = {GROUP};")));
        // V4.1: 384 experts, top-6: 12 groups' 6 candidates.
        assert_eq!(shared_bytes(384, 6, false), 4 * (2 * 72 + 384 + 384 + 6));
        assert_eq!(shared_bytes(7, 3, true), 4 * (32 + 7 + 3));
        assert!(shared_bytes(MAX_EXPERTS, MAX_EXPERTS, false) <= SHARED_LIMIT);
    }
}
