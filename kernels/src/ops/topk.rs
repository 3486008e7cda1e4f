//! The indexer's selection on the device, over the flat scores of a batch of queries laid out as
//! [`DeviceVisiblePrefixes`] says: the top-k of `csa::top_k_lowest_index` ([`top_k_rows`]), the
//! candidate mask of the two-level top-k ([`candidate_mask_rows`]) and its application by a later
//! index layer ([`apply_mask_rows`]). Nothing comes back to the host. One block per query; a
//! query's result depends on its own scores alone (batch invariant).

use cudarc::driver::CudaSlice;

use super::index::DeviceVisiblePrefixes;
use super::{dim, ensure, expect_len, launch_config, shape_error};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::KernelRuntime;

const TOP_K_OP: &str = "top_k_rows";
const MASK_OP: &str = "candidate_mask_rows";
const APPLY_OP: &str = "apply_mask_rows";
/// Threads of one query's block (`topk::THREADS` in `indexer/topk.cuh`).
const THREADS: u32 = 1024;
/// Threads per block of [`apply_mask_rows`].
const APPLY_THREADS: u32 = 256;

/// Padding of [`top_k_rows`]' output rows after a query's `counts[t]` indices.
pub const NO_INDEX: u32 = u32::MAX;

/// Per query `t` of `visible`, the indices of the `min(k, visible[t])` largest of its scores in
/// `f32::total_cmp` order (ties to the lower index), ascending, into row `t` of `out
/// [queries, k]`, padded with [`NO_INDEX`]; `counts [queries]` gets `min(k, visible[t])`.
/// Exactly `csa::top_k_lowest_index` of each row (NaN, ±inf and ±0 ordered as `total_cmp`).
pub fn top_k_rows(
    rt: &KernelRuntime,
    scores: &CudaSlice<f32>,
    visible: &DeviceVisiblePrefixes,
    k: usize,
    out: &mut CudaSlice<u32>,
    counts: &mut CudaSlice<u32>,
) -> Result<(), KernelError> {
    ensure(
        k != 0,
        TOP_K_OP,
        || "k = 0 selects nothing; k must be positive",
    )?;
    let queries = visible.queries();
    expect_len(TOP_K_OP, "scores", scores.len(), visible.total().max(1))?;
    let out_len = queries
        .checked_mul(k)
        .ok_or_else(|| shape_error(TOP_K_OP, format!("{queries} queries x k = {k} overflows")))?;
    expect_len(TOP_K_OP, "out", out.len(), out_len)?;
    expect_len(TOP_K_OP, "counts", counts.len(), queries)?;
    let k = dim(TOP_K_OP, "k", k)?;
    let cfg = launch_config((dim(TOP_K_OP, "queries", queries)?, 1, 1), THREADS, 0);
    let (counts_of, starts) = counts_and_starts(visible);
    let mut launch = rt.launcher(KernelId::TopKRowsF32)?;
    launch
        .arg(scores)
        .arg(&counts_of)
        .arg(&starts)
        .arg(&k)
        .arg(out)
        .arg(counts);
    // SAFETY: signature (const float* scores, const u32_t* visible, const u32_t* starts, u32_t k,
    // u32_t* out, u32_t* counts); every query's scores lie inside `scores` (its length is the
    // prefixes' total, checked above, and DeviceVisiblePrefixes::upload checked the offsets), `out`
    // holds queries * k and `counts` queries values; the shared memory is static.
    unsafe { launch.launch(cfg) }
}

/// Level one of the two-level top-k (`csa::candidate_mask`) of every query of `visible`: its
/// scores split into blocks of `block_size` positions, each scored by its maximum (NaN never
/// wins), the newest (partial) block pinned to +inf, the best `min(topk_blocks, blocks)` blocks
/// kept by [`top_k_rows`]' rule; `mask` (the scores' layout) gets 1 at the positions of kept
/// blocks whose score is above -inf, else 0.
pub fn candidate_mask_rows(
    rt: &KernelRuntime,
    scores: &CudaSlice<f32>,
    visible: &DeviceVisiblePrefixes,
    block_size: usize,
    topk_blocks: usize,
    mask: &mut CudaSlice<u8>,
) -> Result<(), KernelError> {
    ensure(
        block_size != 0,
        MASK_OP,
        || "block_size = 0: candidate blocks must hold at least one position",
    )?;
    expect_len(MASK_OP, "scores", scores.len(), visible.total().max(1))?;
    expect_len(MASK_OP, "mask", mask.len(), visible.total().max(1))?;
    if visible.max_visible == 0 {
        return Ok(());
    }
    // A block wider than every row, or more blocks than any row has, changes nothing: clamping
    // both keeps them within u32 without changing the result.
    let block_size = dim(MASK_OP, "block_size", block_size.min(visible.max_visible))?;
    let topk_blocks = dim(MASK_OP, "topk_blocks", topk_blocks.min(visible.max_visible))?;
    let cfg = launch_config(
        (dim(MASK_OP, "queries", visible.queries())?, 1, 1),
        THREADS,
        0,
    );
    let (counts, starts) = counts_and_starts(visible);
    let mut launch = rt.launcher(KernelId::CandidateMaskRowsF32)?;
    launch
        .arg(scores)
        .arg(&counts)
        .arg(&starts)
        .arg(&block_size)
        .arg(&topk_blocks)
        .arg(mask);
    // SAFETY: signature (const float* scores, const u32_t* visible, const u32_t* starts,
    // u32_t block_size, u32_t topk_blocks, u8_t* mask); `scores` and `mask` both hold the
    // prefixes' total (checked above), so every query's row lies inside both; block_size > 0;
    // the shared memory is static.
    unsafe { launch.launch(cfg) }
}

/// A later index layer's restriction to the candidates: for every query `t`, score `i` of its row
/// in `scores` (layout `scores_visible`) becomes -inf where `mask` (layout `mask_visible`, from
/// [`candidate_mask_rows`]) holds 0, for `i < min(scores_visible[t], mask_visible[t])`; scores
/// beyond the mask's row stay as they are (the CPU's zip).
pub fn apply_mask_rows(
    rt: &KernelRuntime,
    scores: &mut CudaSlice<f32>,
    scores_visible: &DeviceVisiblePrefixes,
    mask: &CudaSlice<u8>,
    mask_visible: &DeviceVisiblePrefixes,
) -> Result<(), KernelError> {
    ensure(
        scores_visible.queries() == mask_visible.queries(),
        APPLY_OP,
        || {
            format!(
                "{} queries of scores but {} of the mask",
                scores_visible.queries(),
                mask_visible.queries()
            )
        },
    )?;
    expect_len(
        APPLY_OP,
        "scores",
        scores.len(),
        scores_visible.total().max(1),
    )?;
    expect_len(APPLY_OP, "mask", mask.len(), mask_visible.total().max(1))?;
    let reach = scores_visible.max_visible.min(mask_visible.max_visible);
    if reach == 0 {
        return Ok(());
    }
    let cfg = launch_config(
        (
            dim(
                APPLY_OP,
                "positions",
                reach.div_ceil(APPLY_THREADS as usize),
            )?,
            dim(APPLY_OP, "queries", scores_visible.queries())?,
            1,
        ),
        APPLY_THREADS,
        0,
    );
    let (score_counts, score_starts) = counts_and_starts(scores_visible);
    let (mask_counts, mask_starts) = counts_and_starts(mask_visible);
    let mut launch = rt.launcher(KernelId::ApplyMaskRowsF32)?;
    launch
        .arg(scores)
        .arg(&score_counts)
        .arg(&score_starts)
        .arg(mask)
        .arg(&mask_counts)
        .arg(&mask_starts);
    // SAFETY: signature (float* scores, const u32_t* score_visible, const u32_t* score_starts,
    // const u8_t* mask, const u32_t* mask_visible, const u32_t* mask_starts); both buffers hold
    // their prefixes' totals (checked above) and the kernel touches position i of query t only
    // below both of its visible counts; grid.y = queries <= the grid limit (upload checks it).
    unsafe { launch.launch(cfg) }
}

/// The device views of a batch's visible counts and its score offsets.
fn counts_and_starts(
    visible: &DeviceVisiblePrefixes,
) -> (
    cudarc::driver::CudaView<'_, u32>,
    cudarc::driver::CudaView<'_, u32>,
) {
    let (counts, starts, _) = visible.views();
    (counts, starts)
}
