//! Multi-head attention with a per-head sink (`CpuBackend::sparse_attention`) of a batch of
//! queries in one launch, each over its own list of key rows ([`DeviceKeyLists`]) of one key
//! buffer or of a device pointer table ([`DeviceKeyTable`], rows in many buffers):
//! keys are shared by all heads (K = V), bit-exact with the CPU reference, one block per
//! (head, query) with one fixed reduction order that depends only on that query's keys (batch
//! invariant). The `fast` numerics' row-batched entry ([`sparse_attention_sink_rows_ptr_fast`])
//! runs the same operation on tensor cores (`sparse_attention_fast.cuh`), a query's keys in
//! splits of 64 (one block each, reading each key tile once for 16 to 64 heads:
//! [`FastHeadBlock`]) merged in split order by a second launch: at the bf16 rounding points with
//! bf16 operands, in f32 precision with each f32 operand split into two bf16 pieces.
//!
//! The f32 form's error against the exact value (f64), derived from its arithmetic (what
//! tests/tests/fast_attention/mod.rs asserts). A split operand `x = x₀ + x₁ + r` has
//! `|r| ≤ 2^-16 |x|` (`x₀ = bf16(x)` within `2^-8 |x|`, `x₁ = bf16(x − x₀)` within `2^-8` of that
//! exact difference), and a product taken as `a₁b₀ + a₀b₁ + a₀b₀` misses `a₁b₁ + r_a b +
//! (a₀ + a₁) r_b`: at most `3.01 · 2^-16 |a b|` (values and products in fp32's normal range). The
//! tensor core adds an mma's 16 products to its accumulator within `17 · 2^-23` of the
//! magnitudes it adds (`ops::linear_fast`'s model).
//! - A score: per 64 dims a warp's 12 mma (4 k-steps × 3 pieces) on an accumulator bounded by
//!   its pieces' magnitudes (`≤ 1.02` of `Σ |q k|`: `12 · 17 · 1.02 · 1.01 ≤ 211`), the warps'
//!   partials added in dim order (`≤ 7` roundings of `2^-24`), the scale (one): with
//!   `S_j = scale · Σ_d |q_d k_jd|`, `|ŝ_j − s_j| ≤ δ_j = (3.01 · 2^-16 + 215 · 2^-23) S_j`.
//! - A weight `p_j = exp(s_j − M)` reaches the numerator and the denominator as `expf` of a
//!   rounded difference with the running max, times the rescales of its split's later tiles
//!   (`≤ SPLIT_TILES − 1`) and the merge weights of the splits (`≤ splits`): `c = SPLIT_TILES +
//!   splits` factors, each within `2^-22` (expf's 2 ulp) and `2^-24 R` (the difference's
//!   rounding; `R` bounds every `|s − M|` and `|sink − M|`) of its exact value, so both sides
//!   carry it within `1 ± ε_j`, `ε_j = δ_j (1 + δ_j) + c (2^-22 + 2^-24 R)`; the sink's term within
//!   `1 ± ε_sink`, `ε_sink = 2^-22 + 2^-24 R`. The max itself cancels in the quotient.
//! - The numerator `Σ p_j v_j` adds the split product (`3.01 · 2^-16`), the 12 mma of a split
//!   (`215 · 2^-23`, as above) and the rescales' and merges' fp32 roundings (`SPLIT_TILES +
//!   3 · splits`, of `2^-24`): `e_v` of `Σ p_j |v_j|`. The denominator's fp32 sums of positive
//!   terms (a 16-lane tree, two per tile's update, three per merge, the sink's addition):
//!   `e_l = (5 + 2 · SPLIT_TILES + 3 · splits) · 2^-24`.
//!
//! So, with `L = Σ_j p_j + exp(sink − M)`, `|ô − o| ≤ (Σ_j p_j ε_j (|v_j| + |o|) + ε_sink
//! exp(sink − M) |o| + e_v Σ_j p_j |v_j| + e_l L |o|) / (L (1 − ε − e_l)) + 2^-23 |o|` with
//! `ε = max(ε_j, ε_sink)` (the quotient of a perturbed numerator and denominator, then the
//! division's rounding): near `2^-14` of the output's weighted magnitude where bf16 operands
//! give `2^-8`.

use cudarc::driver::{CudaSlice, DeviceRepr};

use super::key_table::{DeviceKeyTable, KeyRows};
use super::{Rounding, dim, ensure, expect_len, launch_config, shape_error};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::AttentionParams;
use crate::runtime::{KernelRuntime, Launch};

const FAST_OP: &str = "sparse_attention_sink_rows_ptr_fast";
/// The fast kernel's head dims (one warp per 64; the softmax's half-warps need a power of two).
const FAST_HEAD_DIMS: [usize; 4] = [64, 128, 256, 512];
/// Heads per group of the fast kernel (`fast_attention::HEADS`, one mma tile of rows).
const FAST_GROUP_HEADS: usize = 16;
/// Bytes of the fast split kernel's fixed shared regions (`sizeof(fast_attention::Shared<false,
/// 1>)`: row statistics, weights, partial scores, two key tiles and q, sized for 64 heads of 512
/// dims).
const FAST_SHARED_REGIONS: usize = 136_960;
/// The same of the whole-query kernel of bf16 operands (`sizeof(fast_attention::Shared<true,
/// 1>)`: rounds of two tiles, so two tiles' weights, partials and keys twice over; q for its
/// 512 threads), all of its shared memory: its f32 keys go through registers, not the staging
/// ring (`fast_attention::KEYS_IN_REGISTERS`).
const FAST_WHOLE_SHARED_REGIONS: usize = 140_288;
/// The same of the f32 kernels (`sizeof(fast_attention::Shared<_, 2>)`: two bf16 pieces of the
/// weights, the key tiles and q, sized for 32 heads of 512 dims).
const FAST_F32_SHARED_REGIONS: usize = 153_472;
/// The fewest blocks a fast launch should have before [`FastHeadBlock::choose`] narrows its head
/// block. At head_dim 512 a block's shared memory fills an SM whatever its heads, so more blocks
/// than SMs run in waves: wider blocks (each key tile read once for more heads) in fewer waves
/// win, and narrower ones pay only where the widest would leave most of the 132 SMs idle (a
/// decode step of one or two queries: 10 or 20 blocks of 64 heads).
const FAST_MIN_BLOCKS: usize = 32;
/// Keys per split of a query's list in the fast kernel (`fast_attention::SPLIT_KEYS`).
const FAST_SPLIT_KEYS: usize = 64;
/// The most bytes of split results one fast launch writes (its queries are launched in groups
/// that fit).
const FAST_SPLIT_SCRATCH_BYTES: usize = 128 << 20;
/// The fewest blocks a launch of the one-block-per-query form needs to be taken (two waves of the
/// H200's 132 SMs, one block each): a prefill's queries; a decode step's few queries take the
/// split blocks, which fill the device.
const FAST_WHOLE_MIN_BLOCKS: usize = 264;
/// The most threads of a block of the one-block-per-query kernel
/// (`fast_attention::MAX_WHOLE_THREADS`: its merged outputs stay in registers).
const FAST_WHOLE_THREADS: usize = 512;
/// Threads of a split-combine block (one float4 of outputs each).
const COMBINE_THREADS: usize = 128;
const THREADS: u32 = 512;
/// Must match `attention::MAX_DIMS_PER_THREAD`.
const MAX_HEAD_DIM: usize = 4 * THREADS as usize;
/// The most queries one row-batched launch takes (the grid's y limit).
pub const MAX_QUERIES_PER_LAUNCH: usize = 65_535;

/// The key lists of a batch of attention queries on the device: query `t` attends to the key
/// rows `key_rows[row_starts[t] .. row_starts[t + 1])` of a shared key buffer (or of a
/// [`DeviceKeyTable`]), in that order.
/// Built only by [`DeviceKeyLists::upload`] or [`DeviceKeyLists::compose`], which check every
/// row against the buffer's row count, so the kernel never reads outside it.
pub struct DeviceKeyLists {
    queries: usize,
    key_buffer_rows: usize,
    /// The longest list's length.
    longest: usize,
    /// Flattened row indices (at least one element: a device buffer cannot be empty).
    key_rows: CudaSlice<u32>,
    /// `[queries + 1]` prefix offsets into `key_rows`.
    row_starts: CudaSlice<u32>,
}

impl DeviceKeyLists {
    /// Uploads the lists `lists[t]` (row indices into a key buffer of `key_buffer_rows` rows), one
    /// per query: one upload of the flattened rows and one of the offsets.
    pub fn upload<L: AsRef<[u32]>>(
        rt: &KernelRuntime,
        lists: &[L],
        key_buffer_rows: usize,
    ) -> Result<DeviceKeyLists, KernelError> {
        const UPLOAD: &str = "DeviceKeyLists::upload";
        ensure(
            !lists.is_empty() && lists.len() <= MAX_QUERIES_PER_LAUNCH,
            UPLOAD,
            || {
                format!(
                    "{} queries (must be 1..={MAX_QUERIES_PER_LAUNCH})",
                    lists.len()
                )
            },
        )?;
        let total: usize = lists.iter().map(|l| l.as_ref().len()).sum();
        dim(UPLOAD, "listed keys", total)?;
        let mut row_starts = Vec::with_capacity(lists.len() + 1);
        let mut key_rows = Vec::with_capacity(total.max(1));
        row_starts.push(0u32);
        for (query, list) in lists.iter().enumerate() {
            if let Some(&bad) = list
                .as_ref()
                .iter()
                .find(|&&r| r as usize >= key_buffer_rows)
            {
                return Err(shape_error(
                    UPLOAD,
                    format!(
                        "query {query} lists key row {bad}, beyond the {key_buffer_rows} rows of the key buffer"
                    ),
                ));
            }
            key_rows.extend_from_slice(list.as_ref());
            // `total` fits u32 (checked above), so every prefix does.
            row_starts.push(key_rows.len() as u32);
        }
        if key_rows.is_empty() {
            key_rows.push(0); // never read: every list is empty
        }
        Ok(DeviceKeyLists {
            queries: lists.len(),
            key_buffer_rows,
            longest: lists.iter().map(|l| l.as_ref().len()).max().unwrap_or(0),
            key_rows: rt
                .htod(&key_rows)
                .map_err(KernelError::driver("uploading the key rows"))?,
            row_starts: rt
                .htod(&row_starts)
                .map_err(KernelError::driver("uploading the key-list offsets"))?,
        })
    }

    /// Number of queries.
    pub fn queries(&self) -> usize {
        self.queries
    }

    /// Lists written on the device from `segments`, each `count` consecutive flattened
    /// positions from `dst`: a run of table rows `first, first + 1, ...`
    /// ([`ListSegment::rows`]) or a device selection's rows `first + src[i]`
    /// ([`ListSegment::selected`]). Query `t`'s list is `[row_starts[t], row_starts[t + 1])`;
    /// the segments follow each other in position order and cover every position once. One upload of the segments and one of the
    /// offsets, one launch: a prefill's lists (a thousand queries of hundreds of keys) never
    /// pass through the host.
    ///
    /// # Safety
    /// Each selected segment's `src` is the device address of `count` u32 values, each below
    /// `key_buffer_rows − first`, in memory that stays allocated until the launches reading
    /// these lists have run.
    pub unsafe fn compose(
        rt: &KernelRuntime,
        segments: &[ListSegment],
        row_starts: &[u32],
        key_buffer_rows: usize,
    ) -> Result<DeviceKeyLists, KernelError> {
        const OP: &str = "DeviceKeyLists::compose";
        let queries = row_starts.len().saturating_sub(1);
        ensure(
            queries != 0 && queries <= MAX_QUERIES_PER_LAUNCH,
            OP,
            || format!("{queries} queries (must be 1..={MAX_QUERIES_PER_LAUNCH})"),
        )?;
        ensure(
            row_starts[0] == 0 && !row_starts.windows(2).any(|w| w[1] < w[0]),
            OP,
            || "list offsets that do not start at 0 and grow",
        )?;
        let total = row_starts[queries] as usize;
        let mut covered = 0usize;
        for (i, segment) in segments.iter().enumerate() {
            let (dst, count, first) = (
                segment.dst as usize,
                segment.count as usize,
                segment.first as usize,
            );
            let last_row = if segment.src == 0 {
                first + count
            } else {
                first + usize::from(count > 0)
            };
            ensure(
                dst == covered && dst + count <= total && last_row <= key_buffer_rows,
                OP,
                || {
                    format!(
                        "segment {i}: {count} rows from table row {first} at position {dst} do \
                         not follow position {covered} inside {total} listed rows of a \
                         {key_buffer_rows}-row table"
                    )
                },
            )?;
            covered += count;
        }
        ensure(covered == total, OP, || {
            format!("the segments cover {covered} of {total} listed positions")
        })?;
        let key_rows = if total == 0 {
            // One never-read row: a device buffer cannot be empty.
            rt.stream().alloc_zeros::<u32>(1)
        } else {
            // SAFETY: the launch below writes every position: the segments cover the `total`
            // positions of the buffer (checked above).
            unsafe { rt.alloc_written::<u32>(total) }
        }
        .map_err(KernelError::driver("allocating the key lists"))?;
        let mut lists = DeviceKeyLists {
            queries,
            key_buffer_rows,
            longest: row_starts
                .windows(2)
                .map(|w| (w[1] - w[0]) as usize)
                .max()
                .unwrap_or(0),
            row_starts: rt
                .htod(row_starts)
                .map_err(KernelError::driver("uploading the key-list offsets"))?,
            key_rows,
        };
        if segments.is_empty() {
            return Ok(lists);
        }
        let n_segments = dim(OP, "segments", segments.len())?;
        let dsegments = rt
            .htod(segments)
            .map_err(KernelError::driver("uploading the key-list segments"))?;
        let cfg = launch_config((n_segments.min(1024), 1, 1), 256, 0);
        let mut launch = rt.launcher(KernelId::ComposeKeyLists)?;
        launch
            .arg(&dsegments)
            .arg(&n_segments)
            .arg(&mut lists.key_rows);
        // SAFETY: signature (const ListSegment* segments, u32 n_segments, u32* key_rows); every
        // segment's positions [dst, dst + count) lie inside key_rows and its rows inside the
        // table (checked above); a selected segment's source is readable (the caller's contract).
        unsafe { launch.launch(cfg) }?;
        Ok(lists)
    }
}

/// A run of consecutive positions of [`DeviceKeyLists`] written on the device
/// ([`DeviceKeyLists::compose`]); mirrors `ListSegment` in `cuda/common/movement.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListSegment {
    /// Flattened position of the segment's first row.
    pub dst: u32,
    pub count: u32,
    /// The first table row (a run), or the table row of selected position 0 (a selection).
    pub first: u32,
    pub reserved: u32,
    /// 0 for a run of rows; else the device address of the `count` selected positions (u32).
    pub src: u64,
}

impl ListSegment {
    /// Table rows `first .. first + count` at positions `dst ..`.
    pub fn rows(dst: u32, first: u32, count: u32) -> ListSegment {
        ListSegment {
            dst,
            count,
            first,
            reserved: 0,
            src: 0,
        }
    }

    /// Table rows `first + src[i]` for the `count` positions at device address `src`.
    pub fn selected(dst: u32, first: u32, count: u32, src: u64) -> ListSegment {
        ListSegment {
            dst,
            count,
            first,
            reserved: 0,
            src,
        }
    }
}

// SAFETY: a plain `#[repr(C)]` struct of integers, laid out as its CUDA mirror.
unsafe impl DeviceRepr for ListSegment {}

/// A batch of attention queries, what both row-batched entries take beside their keys and
/// output: query `t` of `q [queries, heads, head_dim]` attends to its listed key rows
/// (`lists`) with the per-head `sink [heads]`, its scores scaled by `scale`, its outputs rounded
/// per `rounding`.
#[derive(Clone, Copy)]
pub struct AttentionRows<'a> {
    pub q: &'a CudaSlice<f32>,
    pub lists: &'a DeviceKeyLists,
    pub sink: &'a CudaSlice<f32>,
    pub head_dim: usize,
    pub scale: f32,
    pub rounding: Rounding,
}

/// `out [t] = attention(q [t], its listed keys, sink)` for every query `t` of `rows`, in one
/// launch (grid: heads × queries): `out` `[queries, heads, head_dim]`, `keys` at least the
/// lists' row count of `head_dim`-wide key rows. A query with no keys gets 0
/// (only the sink). Each `(head, query)`'s result depends only on that query and its keys (one
/// fixed reduction order): batch invariant. Rows read through a pointer table ([`KeyRows::Table`]) may lie
/// in many separately allocated buffers, which must stay allocated until this launch has run (the
/// table's constructors are `unsafe` for that promise; see [`super::key_table`]).
pub fn sparse_attention_sink_rows_f32(
    rt: &KernelRuntime,
    rows: AttentionRows<'_>,
    keys: KeyRows<'_>,
    out: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let kernel = keys.kernel(
        KernelId::SparseAttentionSinkRowsF32,
        KernelId::SparseAttentionSinkRowsPtrF32,
    );
    let op = kernel.symbol();
    keys.check_covers(op, rows.lists.key_buffer_rows, rows.head_dim)?;
    let params = rows_params(op, rows, out)?;
    let cfg = launch_config(
        (params.heads, dim(op, "queries", rows.lists.queries)?, 1),
        THREADS,
        0,
    );
    let mut launch = rows_launcher(rt, kernel, rows, keys, out)?;
    launch.arg(&params);
    // SAFETY: signature (const float* q, const float* keys | const unsigned long long* key_ptrs,
    // const u32_t* key_rows, const u32_t* row_starts, const float* sink, float* out,
    // AttentionParams); q/out hold queries * heads * head_dim values, row_starts queries + 1
    // non-decreasing offsets into key_rows, every listed row is below key_buffer_rows
    // (DeviceKeyLists::upload), and the key source holds that many head_dim-wide rows (checked
    // above; a table's addresses are live rows by its unsafe constructor's contract);
    // grid.y = queries <= the grid limit; head_dim <= 4 * THREADS.
    unsafe { launch.launch(cfg) }
}

/// A launch of the row-batched attention kernel `kernel` with its leading arguments pushed, in
/// their order: `(const float* q, const float* keys | const unsigned long long* key_ptrs, const
/// u32_t* key_rows, const u32_t* row_starts, const float* sink, float* out, ...)`; the caller
/// pushes the kernel's own.
fn rows_launcher<'a>(
    rt: &'a KernelRuntime,
    kernel: KernelId,
    rows: AttentionRows<'a>,
    keys: KeyRows<'a>,
    out: &'a mut CudaSlice<f32>,
) -> Result<Launch<'a>, KernelError> {
    let mut launch = rt.launcher(kernel)?;
    launch.arg(rows.q);
    keys.push(&mut launch);
    launch
        .arg(&rows.lists.key_rows)
        .arg(&rows.lists.row_starts)
        .arg(rows.sink)
        .arg(out);
    Ok(launch)
}

/// [`rows_launcher`] for the fast attention's kernel of the rows' rounding, in its whole-query
/// form (`whole_queries`) or its split form, reading keys through `key_ptrs`.
fn fast_rows_launcher<'a>(
    rt: &'a KernelRuntime,
    whole_queries: bool,
    rows: AttentionRows<'a>,
    key_ptrs: &'a DeviceKeyTable,
    out: &'a mut CudaSlice<f32>,
) -> Result<Launch<'a>, KernelError> {
    let rounding = rows.rounding;
    let kernel = if whole_queries {
        rounding.kernel(
            KernelId::SparseAttentionSinkRowsPtrFastWhole,
            KernelId::SparseAttentionSinkRowsPtrFastF32Whole,
        )
    } else {
        rounding.kernel(
            KernelId::SparseAttentionSinkRowsPtrFast,
            KernelId::SparseAttentionSinkRowsPtrFastF32,
        )
    };
    rows_launcher(rt, kernel, rows, KeyRows::Table(key_ptrs), out)
}

/// The checks and parameters every row-batched entry shares: `heads` from the sink, `head_dim`
/// in range, q and out of the lists' queries.
fn rows_params(
    op: &'static str,
    rows: AttentionRows<'_>,
    out: &CudaSlice<f32>,
) -> Result<AttentionParams, KernelError> {
    let AttentionRows {
        q,
        lists,
        sink,
        head_dim,
        scale,
        rounding,
    } = rows;
    let heads = sink.len();
    ensure(
        head_dim != 0 && head_dim <= MAX_HEAD_DIM && heads != 0,
        op,
        || {
            format!(
                "head_dim = {head_dim} must be in 1..={MAX_HEAD_DIM} and heads = {heads} positive"
            )
        },
    )?;
    let width = heads * head_dim;
    expect_len(op, "q", q.len(), lists.queries * width)?;
    expect_len(op, "out", out.len(), lists.queries * width)?;
    Ok(AttentionParams {
        heads: dim(op, "heads", heads)?,
        head_dim: dim(op, "head_dim", head_dim)?,
        keys: dim(op, "key rows", lists.key_buffer_rows)?,
        scale,
        round_bf16: rounding.flag(),
    })
}

/// Whether [`sparse_attention_sink_rows_ptr_fast`] takes rows of `head_dim` from `key_ptrs`: a
/// head_dim of 64, 128, 256 or 512 and every row 16-byte aligned (the kernel's float4 copies).
pub fn fast_attention_supports(head_dim: usize, key_ptrs: &DeviceKeyTable) -> bool {
    FAST_HEAD_DIMS.contains(&head_dim) && key_ptrs.rows_aligned_16()
}

/// The heads one block of the fast attention serves: groups of 16 whose warps share each key
/// tile, read from global memory and converted to bf16 once for all of them. Every block gives
/// the same bits (`sparse_attention_fast.cuh` says why); [`FastHeadBlock::choose`] picks one
/// by the launch's shape. The f32 kernels (two bf16 pieces of q and of the key tile in shared
/// memory) take at most 32 heads ([`FastHeadBlock::fits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastHeadBlock {
    /// 16 heads: the most blocks, for decode steps of few queries.
    Heads16,
    Heads32,
    /// 64 heads (V4.1's): a key tile read once per query and split (bf16 operands only).
    Heads64,
}

impl FastHeadBlock {
    pub const ALL: [FastHeadBlock; 3] = [
        FastHeadBlock::Heads16,
        FastHeadBlock::Heads32,
        FastHeadBlock::Heads64,
    ];

    /// Whether the kernels of `rounding` take this block: its groups of 16 heads within
    /// `fast_attention::MAX_GROUPS / PIECES` (4 with bf16 operands, 2 with f32's two pieces).
    pub fn fits(self, rounding: Rounding) -> bool {
        let max_groups = match rounding {
            Rounding::Bf16 => 4,
            Rounding::F32 => 2,
        };
        self.groups() <= max_groups
    }

    /// Groups of 16 heads (`blockDim.x / (head_dim / 2)` in the kernel).
    fn groups(self) -> usize {
        match self {
            FastHeadBlock::Heads16 => 1,
            FastHeadBlock::Heads32 => 2,
            FastHeadBlock::Heads64 => 4,
        }
    }

    /// Threads of a block at `head_dim`: `head_dim / 2` a group of 16 heads.
    fn threads(self, head_dim: usize) -> usize {
        self.groups() * head_dim / 2
    }

    /// The head blocks of a launch over `heads` heads and the threads of each.
    fn grid(self, heads: usize, head_dim: usize) -> Result<(u32, u32), KernelError> {
        Ok((
            dim(
                FAST_OP,
                "head blocks",
                heads.div_ceil(FAST_GROUP_HEADS * self.groups()),
            )?,
            dim(FAST_OP, "threads", self.threads(head_dim))?,
        ))
    }

    /// The widest block of the one-block-per-query kernel of `rounding`: within
    /// [`FAST_WHOLE_THREADS`] threads and with no group wholly past `heads` (32 heads at V4.1's
    /// head_dim 512).
    fn widest_whole(heads: usize, head_dim: usize, rounding: Rounding) -> FastHeadBlock {
        FastHeadBlock::ALL
            .into_iter()
            .rev()
            .find(|block| {
                block.fits(rounding)
                    && block.threads(head_dim) <= FAST_WHOLE_THREADS
                    && block.groups() <= heads.div_ceil(FAST_GROUP_HEADS)
            })
            .unwrap_or(FastHeadBlock::Heads16)
    }

    /// The widest block of the kernels of `rounding` with no group wholly past `heads` that
    /// still gives a launch of `query_splits` (queries × their most splits) at least
    /// [`FAST_MIN_BLOCKS`] blocks; 16 heads when none does (a decode step of one query: 4 × 10
    /// blocks).
    pub fn choose(heads: usize, query_splits: usize, rounding: Rounding) -> FastHeadBlock {
        let groups = heads.div_ceil(FAST_GROUP_HEADS);
        FastHeadBlock::ALL
            .into_iter()
            .rev()
            .find(|block| {
                block.fits(rounding)
                    && block.groups() <= groups
                    && groups.div_ceil(block.groups()) * query_splits >= FAST_MIN_BLOCKS
            })
            .unwrap_or(FastHeadBlock::Heads16)
    }
}

/// Dynamic shared memory of a fast-attention block of `head_dim` (`fast_attention::Shared<whole,
/// 1>` of the bf16 kernels, `Shared<whole, 2>` of the f32 ones, then, but in the whole-query
/// kernel of bf16 operands, the staging ring of two tiles of 16 f32 keys): at most 202 496 (split
/// blocks) and 140 288 (whole queries) bytes with bf16 operands, 219 008 with f32's, at head_dim
/// 512.
pub(crate) const fn fast_shared_bytes(head_dim: usize, rounding: Rounding, whole: bool) -> u32 {
    let staging = 2 * 16 * 4 * head_dim;
    (match (rounding, whole) {
        (Rounding::Bf16, false) => FAST_SHARED_REGIONS + staging,
        (Rounding::Bf16, true) => FAST_WHOLE_SHARED_REGIONS,
        (Rounding::F32, _) => FAST_F32_SHARED_REGIONS + staging,
    }) as u32
}

const _: () = assert!(
    fast_shared_bytes(512, Rounding::Bf16, false) <= 227 * 1024
        && fast_shared_bytes(512, Rounding::Bf16, true) <= 227 * 1024
        && fast_shared_bytes(512, Rounding::F32, false) <= 227 * 1024,
    "a block's shared memory on sm_90 and sm_100"
);

/// The dynamic shared memory kernel `id` needs, if it is the fast attention (`None` otherwise):
/// its widest head_dim's, allowed at load.
pub(crate) fn dynamic_shared_bytes(id: KernelId) -> Option<u32> {
    match id {
        KernelId::SparseAttentionSinkRowsPtrFast => Some(fast_shared_bytes(512, Rounding::Bf16, false)),
        KernelId::SparseAttentionSinkRowsPtrFastWhole => {
            Some(fast_shared_bytes(512, Rounding::Bf16, true))
        }
        KernelId::SparseAttentionSinkRowsPtrFastF32 => Some(fast_shared_bytes(512, Rounding::F32, false)),
        KernelId::SparseAttentionSinkRowsPtrFastF32Whole => {
            Some(fast_shared_bytes(512, Rounding::F32, true))
        }
        _ => None,
    }
}

/// The row-batched sink attention of [`sparse_attention_sink_rows_f32`] (rows read through a
/// pointer table) at `rounding`, on tensor cores (the `fast` numerics,
/// `sparse_attention_fast.cuh`), scores and outputs accumulated in fp32 in a fixed order:
/// - [`Rounding::Bf16`]: q and the keys as bf16 (exact for the V4.1 rounding points), the weights
///   rounded to bf16, the outputs too;
/// - [`Rounding::F32`]: q, the keys and the fp32 weights each split into two bf16 pieces (the
///   module's bound: near fp32 accuracy), the outputs the f32 values; at most 32 heads a block.
///
/// A query's keys go in splits of [`FAST_SPLIT_KEYS`] merged in split order; the split count
/// depends only on the query's key count. Deterministic and batch invariant; not bitwise equal
/// to the exact kernel. Needs [`fast_attention_supports`]. `blocks` chooses the launch's form
/// where it says (tests); every form gives the same bits.
pub fn sparse_attention_sink_rows_ptr_fast(
    rt: &KernelRuntime,
    rows: AttentionRows<'_>,
    key_ptrs: &DeviceKeyTable,
    out: &mut CudaSlice<f32>,
    blocks: FastAttentionBlocks,
) -> Result<(), KernelError> {
    let AttentionRows {
        lists,
        sink,
        head_dim,
        rounding,
        ..
    } = rows;
    ensure(fast_attention_supports(head_dim, key_ptrs), FAST_OP, || {
        format!(
            "head_dim {head_dim} must be one of {FAST_HEAD_DIMS:?} and every key row 16-byte \
                 aligned (aligned: {})",
            key_ptrs.rows_aligned_16()
        )
    })?;
    KeyRows::Table(key_ptrs).check_covers(FAST_OP, lists.key_buffer_rows, head_dim)?;
    let params = rows_params(FAST_OP, rows, out)?;
    if let Some(block) = blocks.heads {
        ensure(block.fits(rounding), FAST_OP, || {
            format!("{block:?} is wider than the {rounding:?} kernels' blocks")
        })?;
    }
    let heads = sink.len();
    let max_splits = lists.longest.div_ceil(FAST_SPLIT_KEYS).max(1);
    let grid_z = dim(FAST_OP, "splits", max_splits)?;
    ensure(grid_z <= 65_535, FAST_OP, || {
        format!(
            "a list of {} keys needs {max_splits} splits of {FAST_SPLIT_KEYS} (at most 65535)",
            lists.longest
        )
    })?;
    let whole_block = blocks
        .heads
        .unwrap_or_else(|| FastHeadBlock::widest_whole(heads, head_dim, rounding));
    let whole = blocks.whole_queries.unwrap_or_else(|| {
        max_splits > 1
            && lists.queries * heads.div_ceil(FAST_GROUP_HEADS * whole_block.groups())
                >= FAST_WHOLE_MIN_BLOCKS
    });
    if whole {
        return launch_whole_queries(rt, rows, key_ptrs, out, &params, whole_block);
    }
    let head_block = blocks.heads;
    // Each launch's queries write their splits' results (acc and stats of every head) to scratch.
    let split_values = (heads * head_dim + 2 * heads) * max_splits;
    let per_launch = if max_splits == 1 {
        lists.queries
    } else {
        (FAST_SPLIT_SCRATCH_BYTES / (4 * split_values)).clamp(1, lists.queries)
    };
    let scratch_values = |values: usize| if max_splits == 1 { 1 } else { values };
    // SAFETY: the scratch is written by the attention launch before the combine reads it (same
    // stream); nothing reads it uninitialised.
    let mut split_acc = unsafe {
        rt.alloc_written::<f32>(scratch_values(per_launch * max_splits * heads * head_dim))
    }
    .map_err(KernelError::driver(
        "allocating the attention's split scratch",
    ))?;
    let mut split_stats =
        unsafe { rt.alloc_written::<f32>(scratch_values(per_launch * max_splits * heads * 2)) }
            .map_err(KernelError::driver(
                "allocating the attention's split statistics",
            ))?;
    let shared = fast_shared_bytes(head_dim, rounding, false);
    let combine_blocks = dim(
        FAST_OP,
        "combine blocks",
        (heads * head_dim / 4).div_ceil(COMBINE_THREADS),
    )?;
    for query0 in (0..lists.queries).step_by(per_launch) {
        let count = per_launch.min(lists.queries - query0);
        let block = head_block
            .unwrap_or_else(|| FastHeadBlock::choose(heads, count * max_splits, rounding));
        let (head_blocks, threads) = block.grid(heads, head_dim)?;
        let count = dim(FAST_OP, "queries", count)?;
        let query0 = dim(FAST_OP, "first query", query0)?;
        let mut launch =
            fast_rows_launcher(rt, false, rows, key_ptrs, &mut *out)?;
        launch
            .arg(&mut split_acc)
            .arg(&mut split_stats)
            .arg(&query0)
            .arg(&grid_z)
            .arg(&params);
        // SAFETY: signature (const float* q, const unsigned long long* key_ptrs, const u32_t*
        // key_rows, const u32_t* row_starts, const float* sink, float* out, float* split_acc,
        // float* split_stats, u32_t query0, u32_t max_splits, AttentionParams); q/out hold
        // queries * heads * head_dim values, every listed row is below key_buffer_rows
        // (DeviceKeyLists::upload) and the table covers them with 16-byte aligned rows of
        // head_dim floats (checked above; live by the table's contract); groups * head_dim / 2
        // threads (32..1024, a multiple of 32; the block fits the rounding's kernel, checked or
        // chosen so: within its launch bounds, 512 for the f32 kernel's two groups) serve
        // 16 * groups heads a block over ceil(heads / (16 * groups)) blocks, and the
        // fast_shared_bytes(head_dim, rounding, false) of dynamic shared memory are within what the
        // runtime allowed the kernel at load (`dynamic_shared_bytes`, head_dim 512's); the
        // params' round_bf16 is the rounding's, as the combine reads it; queries query0 ..
        // query0 + count exist and the scratch holds count * max_splits split results when a
        // list has several splits (each list has at most max_splits: `longest`); grid.y = count
        // <= per_launch, grid.z = max_splits <= 65535.
        unsafe {
            launch.launch(launch_config((head_blocks, count, grid_z), threads, shared))?;
        }
        if max_splits == 1 {
            continue;
        }
        let mut combine = rt.launcher(KernelId::SparseAttentionSplitCombine)?;
        combine
            .arg(&lists.row_starts)
            .arg(sink)
            .arg(&mut *out)
            .arg(&split_acc)
            .arg(&split_stats)
            .arg(&query0)
            .arg(&grid_z)
            .arg(&params);
        // SAFETY: signature (const u32_t* row_starts, const float* sink, float* out, const float*
        // split_acc, const float* split_stats, u32_t query0, u32_t max_splits, AttentionParams),
        // the attention launch's arguments: it reads only the split results that launch wrote
        // (the queries of several splits) and writes their outputs, one float4 a thread over
        // grid (ceil(heads * head_dim / 4 / COMBINE_THREADS), count) (threads past the heads
        // write nothing; head_dim / 4 float4 a head, 16-byte aligned as the buffers are).
        unsafe {
            combine.launch(launch_config(
                (combine_blocks, count, 1),
                COMBINE_THREADS as u32,
                0,
            ))?;
        }
    }
    Ok(())
}

/// The fast attention in its one-block-per-query form (`sparse_attention_sink_rows_ptr_fast_whole`
/// or `_fast_f32_whole` by `rounding`: each block runs its query's splits one after the other and
/// merges them as the split blocks' combine does), `block` heads a block (at most
/// [`FAST_WHOLE_THREADS`] threads; one that fits the rounding's kernel).
fn launch_whole_queries(
    rt: &KernelRuntime,
    rows: AttentionRows<'_>,
    key_ptrs: &DeviceKeyTable,
    out: &mut CudaSlice<f32>,
    params: &AttentionParams,
    block: FastHeadBlock,
) -> Result<(), KernelError> {
    let AttentionRows {
        lists,
        sink,
        rounding,
        ..
    } = rows;
    let heads = sink.len();
    let head_dim = params.head_dim as usize;
    ensure(
        block.threads(head_dim) <= FAST_WHOLE_THREADS,
        FAST_OP,
        || {
            format!(
                "{block:?} at head_dim {head_dim} needs {} threads; a block running whole \
                 queries takes at most {FAST_WHOLE_THREADS}",
                block.threads(head_dim)
            )
        },
    )?;
    let (head_blocks, threads) = block.grid(heads, head_dim)?;
    let shared = fast_shared_bytes(head_dim, rounding, true);
    for query0 in (0..lists.queries).step_by(MAX_QUERIES_PER_LAUNCH) {
        let count = dim(
            FAST_OP,
            "queries",
            MAX_QUERIES_PER_LAUNCH.min(lists.queries - query0),
        )?;
        let query0 = dim(FAST_OP, "first query", query0)?;
        let mut launch =
            fast_rows_launcher(rt, true, rows, key_ptrs, &mut *out)?;
        launch.arg(&query0).arg(params);
        // SAFETY: signature (const float* q, const unsigned long long* key_ptrs, const u32_t*
        // key_rows, const u32_t* row_starts, const float* sink, float* out, u32_t query0,
        // AttentionParams); the buffers as for the split form (checked by the caller); at most
        // FAST_WHOLE_THREADS threads (checked), a multiple of 32, serving 16 * groups heads a block
        // (a block that fits the rounding's kernel: checked or chosen by the caller) over
        // ceil(heads / (16 * groups)) blocks; the whole kernel's dynamic shared memory (its regions sized
        // for FAST_WHOLE_THREADS threads), allowed at load; queries query0 .. query0 + count exist.
        unsafe {
            launch.launch(launch_config((head_blocks, count, 1), threads, shared))?;
        }
    }
    Ok(())
}

/// How a fast-attention launch lays out its blocks; a field left `None` is chosen by the launch's
/// shape. No choice changes a bit (`sparse_attention_fast.cuh`); tests force each.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FastAttentionBlocks {
    /// The heads a block serves ([`FastHeadBlock::choose`] for the split blocks; the widest within
    /// [`FAST_WHOLE_THREADS`] threads for whole queries).
    pub heads: Option<FastHeadBlock>,
    /// One block per query running all of its splits (`true`), or one block per split and a
    /// combine launch (`false`); by default whole queries where the split form is not needed to
    /// fill the device ([`FAST_WHOLE_MIN_BLOCKS`]).
    pub whole_queries: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_widest_head_block_that_keeps_the_launch_wide_is_chosen() {
        // V4.1: 64 heads, 10 splits of 640 keys a query.
        for (queries, block) in [
            (1, FastHeadBlock::Heads16),
            (2, FastHeadBlock::Heads32),
            (3, FastHeadBlock::Heads32),
            (4, FastHeadBlock::Heads64),
            (8, FastHeadBlock::Heads64),
            (64, FastHeadBlock::Heads64),
            (1024, FastHeadBlock::Heads64),
        ] {
            assert_eq!(
                FastHeadBlock::choose(64, queries * 10, Rounding::Bf16),
                block,
                "{queries} queries"
            );
            // The f32 kernels (V4-Flash: 64 heads too) stop at 32 heads a block.
            let f32_block = if block == FastHeadBlock::Heads64 {
                FastHeadBlock::Heads32
            } else {
                block
            };
            assert_eq!(
                FastHeadBlock::choose(64, queries * 10, Rounding::F32),
                f32_block,
                "{queries} queries, f32"
            );
        }
        // No block wider than the heads' groups: 4 heads, 6 heads, 48 heads.
        for rounding in [Rounding::Bf16, Rounding::F32] {
            assert_eq!(
                FastHeadBlock::choose(4, 100_000, rounding),
                FastHeadBlock::Heads16
            );
            assert_eq!(
                FastHeadBlock::choose(6, 100_000, rounding),
                FastHeadBlock::Heads16
            );
            assert_eq!(
                FastHeadBlock::choose(48, 100_000, rounding),
                FastHeadBlock::Heads32
            );
        }
        assert!(FastHeadBlock::Heads64.fits(Rounding::Bf16));
        assert!(!FastHeadBlock::Heads64.fits(Rounding::F32));
        assert!(FastHeadBlock::Heads32.fits(Rounding::F32));
    }

    #[test]
    fn a_whole_query_block_is_the_widest_within_its_threads() {
        // V4.1 (64 heads of 512): 32 heads, 512 threads; narrower heads fit 64 a block.
        let widest = |heads, head_dim| FastHeadBlock::widest_whole(heads, head_dim, Rounding::Bf16);
        assert_eq!(widest(64, 512), FastHeadBlock::Heads32);
        assert_eq!(FastHeadBlock::Heads32.threads(512), FAST_WHOLE_THREADS);
        assert_eq!(widest(64, 256), FastHeadBlock::Heads64);
        assert_eq!(widest(64, 128), FastHeadBlock::Heads64);
        // No block wider than the heads' groups: 4 heads, 20 heads.
        assert_eq!(widest(4, 64), FastHeadBlock::Heads16);
        assert_eq!(widest(20, 128), FastHeadBlock::Heads32);
        // The f32 kernels: 32 heads at every head_dim (V4-Flash's 512, v4-tiny's 64).
        for head_dim in [64, 128, 256, 512] {
            assert_eq!(
                FastHeadBlock::widest_whole(64, head_dim, Rounding::F32),
                FastHeadBlock::Heads32
            );
        }
        assert_eq!(
            FastHeadBlock::widest_whole(4, 64, Rounding::F32),
            FastHeadBlock::Heads16
        );
    }

    #[test]
    fn the_fast_attention_shared_memory_is_its_regions_and_any_staging_ring() {
        // Split blocks: 2 × 64 f32 statistics and 64 rescales, 64 × 24 bf16 weights, 32 warps ×
        // 16 × 16 f32 partials, 2 × 16 bf16 key rows of 520, 64 q rows of 520, 4 tiles of 16 key
        // addresses.
        assert_eq!(
            FAST_SHARED_REGIONS,
            3 * 64 * 4 + 64 * 24 * 2 + 32 * 16 * 16 * 4 + (2 * 16 + 64) * 520 * 2 + 4 * 16 * 8
        );
        assert_eq!(fast_shared_bytes(512, Rounding::Bf16, false), 202_496);
        assert_eq!(fast_shared_bytes(64, Rounding::Bf16, false), 136_960 + 8192);
        assert_eq!(
            dynamic_shared_bytes(KernelId::SparseAttentionSinkRowsPtrFast),
            Some(202_496)
        );
        // Whole queries (rounds of two tiles, at most 512 threads): 2 × 64 statistics and two
        // tiles' 64 rescales, 64 × 40 weights, two tiles of 16 warps' partials, 2 × 2 × 16 key
        // rows of 520, q rows of head_dim + 8 for 512 threads (32 · 512 + 128 · 4 bf16: 32 rows of
        // 520 or 64 of 264), 4 rounds of 32 key addresses.
        assert_eq!(
            FAST_WHOLE_SHARED_REGIONS,
            (2 * 64 + 2 * 64) * 4
                + 64 * 40 * 2
                + 2 * 16 * 16 * 16 * 4
                + 2 * 2 * 16 * 520 * 2
                + (32 * 512 + 128 * 4) * 2
                + 4 * 32 * 8
        );
        // Its keys go through registers: no staging ring, at every head_dim.
        for head_dim in FAST_HEAD_DIMS {
            assert_eq!(fast_shared_bytes(head_dim, Rounding::Bf16, true), 140_288);
        }
        assert_eq!(
            dynamic_shared_bytes(KernelId::SparseAttentionSinkRowsPtrFastWhole),
            Some(140_288)
        );
        // The f32 kernels (both forms): 3 × 32 statistics, two pieces of 32 × 24 weights, 16
        // warps' partials, two pieces of the 2 × 16 key rows and of 32 q rows, the key addresses.
        assert_eq!(
            FAST_F32_SHARED_REGIONS,
            3 * 32 * 4
                + 2 * 32 * 24 * 2
                + 16 * 16 * 16 * 4
                + 2 * (2 * 16 + 32) * 520 * 2
                + 4 * 16 * 8
        );
        for whole in [false, true] {
            assert_eq!(fast_shared_bytes(512, Rounding::F32, whole), 219_008);
        }
        for id in [
            KernelId::SparseAttentionSinkRowsPtrFastF32,
            KernelId::SparseAttentionSinkRowsPtrFastF32Whole,
        ] {
            assert_eq!(dynamic_shared_bytes(id), Some(219_008));
        }
        assert_eq!(
            dynamic_shared_bytes(KernelId::SparseAttentionSplitCombine),
            None
        );
    }
}
