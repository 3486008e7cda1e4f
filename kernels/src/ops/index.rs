//! Lightning-indexer scores (`CpuBackend::index_scores`) of one query against compressed keys,
//! or of a batch of queries in one launch, each against its own window of the rows of one shared
//! key buffer or of a device pointer table ([`DeviceVisiblePrefixes`], [`DeviceKeyTable`]: the
//! queries of several sequences each see their own sequence's keys), with
//! the reference's bf16 rounding points: bit-exact, one block per query and tile of keys
//! ([`IndexTile`]), a key's score a function of that query and key alone (batch invariant).
//! The `fast` numerics' batch ([`index_scores_rows_ptr_fast`]) runs the dot products on tensor
//! cores: the same bits on the indexer's Q4e-QDQ'd inputs, many queries a block.

use cudarc::driver::{CudaSlice, CudaView};

use super::key_table::{DeviceKeyTable, KeyRows};
use super::{Rounding, dim, ensure, expect_len, launch_config, shape_error, whole_rows};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::IndexParams;
use crate::runtime::{KernelRuntime, Launch};

const OP: &str = "index_scores_f32";
/// `indexer::THREADS` in `cuda/indexer/index_scores.cuh`.
const THREADS: u32 = 128;
/// The most heads a launch takes.
const MAX_HEADS: usize = 4096;
/// Shared memory for a tile's key rows and for a chunk of the query's head rows.
const KEY_ROWS_BYTES: usize = 16 * 1024;
const HEAD_ROWS_BYTES: usize = 24 * 1024;
/// The most keys per block.
const MAX_TILE_KEYS: usize = 16;
/// The default dynamic shared memory limit of a block.
const SHARED_LIMIT: usize = 48 * 1024;
/// The fast kernel's shape (`cuda/indexer/index_scores_fast.cuh`): head_dim `HEAD_DIM`, at most
/// `MAX_HEADS` heads; `TILE_KEYS` keys and `GROUP` queries a block of `THREADS` threads.
const FAST_HEAD_DIM: usize = 128;
const FAST_MAX_HEADS: usize = 64;
const FAST_TILE_KEYS: usize = 128;
const FAST_GROUP: usize = 8;
/// The fewest blocks a fast launch takes before it narrows its queries a block (two a SM of the
/// H200's 132).
const FAST_MIN_BLOCKS: usize = 264;
const FAST_THREADS: u32 = 256;
/// `sizeof(fast_index::Shared)`: the fast kernel's dynamic shared memory, allowed at load.
const FAST_SHARED_BYTES: u32 = 107_104;

/// How a launch splits the work: keys per block and heads staged at a time, from the shape alone
/// (so a key's score never depends on the batch; the split never changes a sum's order), and the
/// dynamic shared memory that takes (the kernel's layout: f64 sums, key rows, head rows padded to
/// an odd stride, terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct IndexTile {
    keys: usize,
    head_chunk: usize,
}

impl IndexTile {
    fn of(heads: usize, head_dim: usize) -> IndexTile {
        let stride = head_dim | 1;
        IndexTile {
            keys: (KEY_ROWS_BYTES / (4 * head_dim)).clamp(1, MAX_TILE_KEYS),
            head_chunk: (HEAD_ROWS_BYTES / (4 * stride)).clamp(1, heads.max(1)),
        }
    }

    fn shared_bytes(self, head_dim: usize) -> usize {
        8 * self.keys
            + 4 * self.keys * head_dim
            + 4 * self.head_chunk * (head_dim | 1)
            + 4 * self.keys * self.head_chunk
    }

    fn params(
        self,
        op: &'static str,
        (heads, head_dim, keys): (usize, usize, usize),
        rounding: Rounding,
    ) -> Result<IndexParams, KernelError> {
        Ok(IndexParams {
            heads: dim(op, "heads", heads)?,
            head_dim: dim(op, "head_dim", head_dim)?,
            keys: dim(op, "keys", keys)?,
            round_bf16: rounding.flag(),
            tile_keys: dim(op, "tile keys", self.keys)?,
            head_chunk: dim(op, "head chunk", self.head_chunk)?,
        })
    }
}
/// The most queries one row-batched launch takes (the grid's y limit).
pub const MAX_QUERIES_PER_LAUNCH: usize = 65_535;

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
    check_heads(OP, heads, head_dim)?;
    let n = whole_rows(OP, keys.len(), head_dim, || {
        format!(
            "keys hold {} values, not a whole number of {head_dim}-wide keys",
            keys.len()
        )
    })?;
    expect_len(OP, "q", q.len(), heads * head_dim)?;
    expect_len(OP, "scores", scores.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let tile = IndexTile::of(heads, head_dim);
    let params = tile.params(OP, (heads, head_dim, n), rounding)?;
    let cfg = launch_config(
        (dim(OP, "key tiles", n.div_ceil(tile.keys))?, 1, 1),
        THREADS,
        dim(OP, "shared bytes", tile.shared_bytes(head_dim))?,
    );
    let mut launch = rt.launcher(KernelId::IndexScoresF32)?;
    launch.arg(q).arg(w).arg(keys).arg(scores).arg(&params);
    // SAFETY: signature (const float* q, const float* w, const float* keys, float* scores,
    // IndexParams); lengths checked above; the dynamic shared memory is the tile's layout.
    unsafe { launch.launch(cfg) }
}

/// `head_dim` and `heads` positive, `heads` within the kernel's shared memory.
fn check_heads(op: &'static str, heads: usize, head_dim: usize) -> Result<(), KernelError> {
    ensure(
        head_dim != 0 && heads != 0 && heads <= MAX_HEADS,
        op,
        || {
            format!(
                "head_dim = {head_dim} and heads = {heads} must be positive (heads <= {MAX_HEADS})"
            )
        },
    )?;
    let shared = IndexTile::of(heads, head_dim).shared_bytes(head_dim);
    ensure(shared <= SHARED_LIMIT, op, || {
        format!(
            "head_dim = {head_dim} needs {shared} bytes of shared memory (at most {SHARED_LIMIT})"
        )
    })?;
    Ok(())
}

/// Which keys each query of a batch sees, on the device: query `t` scores the `visible[t]` key rows
/// from row `first[t]` of a shared key buffer or table (its own sequence's keys in a batch of
/// several; row 0 when the queries share one prefix), into
/// `scores[starts[t] .. starts[t] + visible[t])` of one flat output of
/// [`DeviceVisiblePrefixes::total`] scores. Built only by [`DeviceVisiblePrefixes::upload`] or
/// [`DeviceVisiblePrefixes::upload_from`], which check every window against the key count.
#[derive(Debug)]
pub struct DeviceVisiblePrefixes {
    queries: usize,
    keys: usize,
    pub(super) max_visible: usize,
    total: usize,
    /// `[queries]` visible counts, `[queries]` output offsets, then `[queries]` first key rows:
    /// one upload.
    pub(super) counts_and_starts: CudaSlice<u32>,
}

impl DeviceVisiblePrefixes {
    /// Uploads the visible counts of a batch of queries that each see a prefix of one key buffer
    /// of `keys` keys (each count at most `keys`).
    pub fn upload(
        rt: &KernelRuntime,
        visible: &[usize],
        keys: usize,
    ) -> Result<DeviceVisiblePrefixes, KernelError> {
        DeviceVisiblePrefixes::upload_from(rt, &vec![0; visible.len()], visible, keys)
    }

    /// Uploads the key windows of a batch of queries over a key buffer of `keys` keys: query `t`
    /// sees `visible[t]` keys from row `first[t]` (`first[t] + visible[t]` at most `keys`).
    pub fn upload_from(
        rt: &KernelRuntime,
        first: &[usize],
        visible: &[usize],
        keys: usize,
    ) -> Result<DeviceVisiblePrefixes, KernelError> {
        const UPLOAD: &str = "DeviceVisiblePrefixes::upload";
        ensure(
            !visible.is_empty() && visible.len() <= MAX_QUERIES_PER_LAUNCH,
            UPLOAD,
            || {
                format!(
                    "{} queries (must be 1..={MAX_QUERIES_PER_LAUNCH})",
                    visible.len()
                )
            },
        )?;
        ensure(first.len() == visible.len(), UPLOAD, || {
            format!("{} first rows for {} queries", first.len(), visible.len())
        })?;
        if let Some(query) =
            (0..visible.len()).find(|&t| first[t].saturating_add(visible[t]) > keys)
        {
            return Err(shape_error(
                UPLOAD,
                format!(
                    "query {query} sees {} keys from row {}, beyond the {keys} given",
                    visible[query], first[query]
                ),
            ));
        }
        let total: usize = visible.iter().sum();
        dim(UPLOAD, "scores", total)?;
        dim(UPLOAD, "keys", keys)?;
        let mut counts_and_starts = Vec::with_capacity(3 * visible.len());
        // Every count and first row is <= keys and the total fits u32 (checked above), so each
        // value does.
        counts_and_starts.extend(visible.iter().map(|&v| v as u32));
        let mut start = 0u32;
        for &v in visible {
            counts_and_starts.push(start);
            start += v as u32;
        }
        counts_and_starts.extend(first.iter().map(|&f| f as u32));
        Ok(DeviceVisiblePrefixes {
            queries: visible.len(),
            keys,
            max_visible: visible.iter().copied().max().unwrap_or(0),
            total,
            counts_and_starts: rt
                .htod(&counts_and_starts)
                .map_err(KernelError::driver("uploading the visible counts"))?,
        })
    }

    /// The device views of the visible counts, the score offsets and the first key rows.
    pub(super) fn views(
        &self,
    ) -> (
        cudarc::driver::CudaView<'_, u32>,
        cudarc::driver::CudaView<'_, u32>,
        cudarc::driver::CudaView<'_, u32>,
    ) {
        let q = self.queries;
        (
            self.counts_and_starts.slice(..q),
            self.counts_and_starts.slice(q..2 * q),
            self.counts_and_starts.slice(2 * q..),
        )
    }

    /// Number of queries.
    pub fn queries(&self) -> usize {
        self.queries
    }

    /// Scores of all queries together (the flat output's length).
    pub fn total(&self) -> usize {
        self.total
    }
}

/// A batch of index-score queries, what both row-batched entries take beside their keys and
/// scores: query `t` of `visible` (`q [queries, heads, head_dim]`, head weights
/// `w [queries, heads]`) sees its `visible[t]` key rows from row `first[t]`.
#[derive(Clone, Copy)]
pub struct IndexRows<'a> {
    pub q: &'a CudaSlice<f32>,
    pub w: &'a CudaSlice<f32>,
    pub visible: &'a DeviceVisiblePrefixes,
    pub heads: usize,
    pub head_dim: usize,
}

/// Index scores of every query of `rows` against its visible key rows of `keys` (`head_dim`
/// values each), in one launch (grid: max visible × queries), into the flat `scores [visible.total()]`
/// (query after query). Each score is exactly what [`index_scores_f32`] gives that query alone.
/// Rows read through a pointer table ([`KeyRows::Table`]) may lie in many separately allocated
/// buffers, which must stay allocated until this launch has run (see [`super::key_table`]).
pub fn index_scores_rows_f32(
    rt: &KernelRuntime,
    rows: IndexRows<'_>,
    keys: KeyRows<'_>,
    scores: &mut CudaSlice<f32>,
    rounding: Rounding,
) -> Result<(), KernelError> {
    let IndexRows {
        visible,
        heads,
        head_dim,
        ..
    } = rows;
    let kernel = keys.kernel(
        KernelId::IndexScoresRowsF32,
        KernelId::IndexScoresRowsPtrF32,
    );
    let op = kernel.symbol();
    check_heads(op, heads, head_dim)?;
    check_rows(op, rows, keys, scores)?;
    if visible.max_visible == 0 {
        return Ok(());
    }
    let tile = IndexTile::of(heads, head_dim);
    let params = tile.params(op, (heads, head_dim, visible.keys), rounding)?;
    let cfg = launch_config(
        (
            dim(op, "key tiles", visible.max_visible.div_ceil(tile.keys))?,
            dim(op, "queries", visible.queries)?,
            1,
        ),
        THREADS,
        dim(op, "shared bytes", tile.shared_bytes(head_dim))?,
    );
    let views = visible.views();
    let mut launch = rt.launcher(kernel)?;
    push_rows(&mut launch, rows, keys, &views, scores);
    launch.arg(&params);
    // SAFETY: signature (const float* q, const float* w, const float* keys | const unsigned long
    // long* key_ptrs, const u32_t* visible, const u32_t* first_keys, const u32_t* score_starts,
    // float* scores, IndexParams); the buffers hold the batch (`check_rows`; a table's addresses
    // are live rows by its unsafe constructor's contract); grid.y = queries <= the grid limit;
    // the dynamic shared memory is the tile's layout.
    unsafe { launch.launch(cfg) }
}

/// Whether [`index_scores_rows_ptr_fast`] takes `heads` heads of `head_dim` from `key_ptrs`:
/// head_dim 128 (V4.1's and V4's indexers), 1 to 64 heads, every row 16-byte aligned (the
/// kernel's float4 loads).
pub fn fast_index_supports(heads: usize, head_dim: usize, key_ptrs: &DeviceKeyTable) -> bool {
    head_dim == FAST_HEAD_DIM && (1..=FAST_MAX_HEADS).contains(&heads) && key_ptrs.rows_aligned_16()
}

/// The dynamic shared memory kernel `id` needs, if it is the fast indexer (`None` otherwise).
pub(crate) fn dynamic_shared_bytes(id: KernelId) -> Option<u32> {
    (id == KernelId::IndexScoresRowsPtrFast).then_some(FAST_SHARED_BYTES)
}

/// The scores of [`index_scores_rows_f32`] through a pointer table at the bf16 rounding points,
/// on tensor cores (the `fast` numerics, `index_scores_fast.cuh`): q and the keys converted to
/// bf16, each head's dot product an fp32 mma chain, everything after it the exact kernel's
/// operations (the bf16 roundings, the f64 head sum in head order). On Q4e-QDQ'd q and keys (the
/// indexer's) these are the exact kernel's bits (the kernel's header says when); deterministic
/// and batch invariant: a block stages a tile of 128 keys once for up to 8 queries, and no score
/// depends on which. `queries_per_block` (1 ..= 8) chooses that where it says (tests); `None`
/// takes the most that still give the launch [`FAST_MIN_BLOCKS`] blocks (a decode step's few
/// queries: one a block). Needs [`fast_index_supports`].
pub fn index_scores_rows_ptr_fast(
    rt: &KernelRuntime,
    rows: IndexRows<'_>,
    key_ptrs: &DeviceKeyTable,
    scores: &mut CudaSlice<f32>,
    queries_per_block: Option<usize>,
) -> Result<(), KernelError> {
    let IndexRows {
        visible,
        heads,
        head_dim,
        ..
    } = rows;
    let op = KernelId::IndexScoresRowsPtrFast.symbol();
    ensure(fast_index_supports(heads, head_dim, key_ptrs), op, || {
        format!(
            "head_dim = {head_dim} must be {FAST_HEAD_DIM}, heads = {heads} within \
             1..={FAST_MAX_HEADS} and every key row 16-byte aligned (aligned: {})",
            key_ptrs.rows_aligned_16()
        )
    })?;
    let keys = KeyRows::Table(key_ptrs);
    check_rows(op, rows, keys, scores)?;
    if visible.max_visible == 0 {
        return Ok(());
    }
    let tile = IndexTile {
        keys: FAST_TILE_KEYS,
        head_chunk: heads,
    };
    let params = tile.params(op, (heads, head_dim, visible.keys), Rounding::Bf16)?;
    let queries = dim(op, "queries", visible.queries)?;
    let tiles = visible.max_visible.div_ceil(FAST_TILE_KEYS);
    let group = match queries_per_block {
        Some(group) => {
            ensure((1..=FAST_GROUP).contains(&group), op, || {
                format!("{group} queries a block (1..={FAST_GROUP})")
            })?;
            group
        }
        None => [FAST_GROUP, 4, 2, 1]
            .into_iter()
            .find(|&group| tiles * visible.queries.div_ceil(group) >= FAST_MIN_BLOCKS)
            .unwrap_or(1),
    };
    let cfg = launch_config(
        (
            dim(op, "key tiles", tiles)?,
            dim(op, "query groups", visible.queries.div_ceil(group))?,
            1,
        ),
        FAST_THREADS,
        FAST_SHARED_BYTES,
    );
    let views = visible.views();
    let mut launch = rt.launcher(KernelId::IndexScoresRowsPtrFast)?;
    push_rows(&mut launch, rows, keys, &views, scores);
    let group = dim(op, "queries a block", group)?;
    launch.arg(&queries).arg(&group).arg(&params);
    // SAFETY: signature (const float* q, const float* w, const unsigned long long* key_ptrs,
    // const u32_t* visible, const u32_t* first_keys, const u32_t* score_starts, float* scores,
    // u32_t queries, u32_t group, IndexParams); the buffers hold the batch (`check_rows`; the
    // table's addresses are live rows by its unsafe constructor's contract, 16-byte aligned, of
    // head_dim 128 floats, and heads <= 64: `fast_index_supports`); grid.y = ceil(queries /
    // group), 1 <= group <= 8, queries <= MAX_QUERIES_PER_LAUNCH; FAST_SHARED_BYTES =
    // sizeof(fast_index::Shared), allowed at load (`dynamic_shared_bytes`).
    unsafe { launch.launch(cfg) }
}

/// The checks both row-batched launchers share: `q` holds the batch's `queries · heads · head_dim`
/// values and `w` its `queries · heads`; every window `first + visible` is within `visible.keys`
/// rows ([`DeviceVisiblePrefixes::upload_from`]) and the key source holds that many of `head_dim`;
/// the offsets place each query's scores inside `scores`.
fn check_rows(
    op: &'static str,
    rows: IndexRows<'_>,
    keys: KeyRows<'_>,
    scores: &CudaSlice<f32>,
) -> Result<(), KernelError> {
    let IndexRows {
        q,
        w,
        visible,
        heads,
        head_dim,
    } = rows;
    keys.check_covers(op, visible.keys, head_dim)?;
    expect_len(op, "q", q.len(), visible.queries * heads * head_dim)?;
    expect_len(op, "w", w.len(), visible.queries * heads)?;
    expect_len(op, "scores", scores.len(), visible.total.max(1))
}

/// Pushes the arguments both row-batched kernels start with: q, w, the keys, the visible counts,
/// the first key rows, the score offsets ([`DeviceVisiblePrefixes::views`]) and the scores.
fn push_rows<'a>(
    launch: &mut Launch<'a>,
    rows: IndexRows<'a>,
    keys: KeyRows<'a>,
    (counts, starts, first): &'a (CudaView<'a, u32>, CudaView<'a, u32>, CudaView<'a, u32>),
    scores: &'a mut CudaSlice<f32>,
) {
    launch.arg(rows.q).arg(rows.w);
    keys.push(launch);
    launch.arg(counts).arg(first).arg(starts).arg(scores);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_the_default_shared_memory_and_take_whole_indexers_at_once() {
        // V4.1 / V4: 32 or 64 heads of 128: 16 keys a block, every head (or 47) staged at once.
        let v41 = IndexTile::of(32, 128);
        assert_eq!(
            v41,
            IndexTile {
                keys: 16,
                head_chunk: 32
            }
        );
        assert_eq!(
            v41.shared_bytes(128),
            8 * 16 + 4 * 16 * 128 + 4 * 32 * 129 + 4 * 16 * 32
        );
        assert_eq!(IndexTile::of(64, 128).head_chunk, 47);
        // Odd and wide heads: the stride is odd, the tile shrinks, one key at the widest.
        assert_eq!(
            IndexTile::of(3, 72).shared_bytes(72),
            8 * 16 + 4 * 16 * 72 + 4 * 3 * 73 + 4 * 16 * 3
        );
        assert_eq!(
            IndexTile::of(8, 4096),
            IndexTile {
                keys: 1,
                head_chunk: 1
            }
        );
        for (heads, head_dim) in [
            (1, 1),
            (32, 128),
            (64, 128),
            (4096, 16),
            (7, 2047),
            (8, 4096),
        ] {
            assert!(
                check_heads("test", heads, head_dim).is_ok(),
                "{heads} x {head_dim}"
            );
        }
        let err = check_heads("test", 1, 8192).expect_err("a 32 KiB key row");
        assert!(err.to_string().contains("head_dim = 8192 needs"), "{err}");
    }

    /// `FAST_SHARED_BYTES` is `fast_index::Shared`'s layout (the kernel asserts its size): keys
    /// and two query buffers of rows of head_dim + 8 bf16, two term buffers of rows of 72 bf16,
    /// two sets of weights and the group's windows. Two blocks fit an SM (228 KiB, 1 KiB of each
    /// block reserved), and only the fast kernel asks for it.
    #[test]
    fn the_fast_kernels_shared_memory_is_its_layout_and_two_blocks_fit_an_sm() {
        let row = 2 * (FAST_HEAD_DIM + 8);
        let layout = FAST_TILE_KEYS * row
            + 2 * FAST_MAX_HEADS * row
            + 2 * FAST_TILE_KEYS * 2 * (FAST_MAX_HEADS + 8)
            + 2 * FAST_MAX_HEADS * 4
            + 3 * FAST_GROUP * 4;
        assert_eq!(FAST_SHARED_BYTES as usize, layout);
        assert!(2 * (layout + 1024) <= 228 * 1024);
        assert_eq!(FAST_THREADS as usize, 2 * FAST_TILE_KEYS);
        assert_eq!(
            dynamic_shared_bytes(KernelId::IndexScoresRowsPtrFast),
            Some(FAST_SHARED_BYTES)
        );
        assert_eq!(dynamic_shared_bytes(KernelId::IndexScoresRowsPtrF32), None);
    }
}
