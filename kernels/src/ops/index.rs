//! Lightning-indexer scores (`CpuBackend::index_scores`) of one query against compressed keys,
//! or of a batch of queries in one launch, each against its own window of the rows of one shared
//! key buffer or of a device pointer table ([`DeviceVisiblePrefixes`], [`DeviceKeyTable`]: the
//! queries of several sequences each see their own sequence's keys), with
//! the reference's bf16 rounding points: bit-exact, one block per query and tile of keys
//! ([`IndexTile`]), a key's score a function of that query and key alone (batch invariant).

use cudarc::driver::CudaSlice;

use super::key_table::KeyRows;
use super::{Rounding, dim, ensure, expect_len, launch_config, shape_error, whole_rows};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::params::IndexParams;
use crate::runtime::KernelRuntime;

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

/// Index scores of every query `t` of `visible` (`q [queries, heads, head_dim]`, head weights
/// `w [queries, heads]`) against its `visible[t]` key rows of `keys` from row `first[t]` (`head_dim` values
/// each), in one launch (grid: max visible × queries), into the flat `scores [visible.total()]`
/// (query after query). Each score is exactly what [`index_scores_f32`] gives that query alone.
/// Rows read through a pointer table ([`KeyRows::Table`]) may lie in many separately allocated
/// buffers, which must stay allocated until this launch has run (see [`super::key_table`]).
#[allow(clippy::too_many_arguments)]
pub fn index_scores_rows_f32(
    rt: &KernelRuntime,
    q: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    keys: KeyRows<'_>,
    visible: &DeviceVisiblePrefixes,
    scores: &mut CudaSlice<f32>,
    heads: usize,
    head_dim: usize,
    rounding: Rounding,
) -> Result<(), KernelError> {
    let kernel = keys.kernel(
        KernelId::IndexScoresRowsF32,
        KernelId::IndexScoresRowsPtrF32,
    );
    let op = kernel.symbol();
    keys.check_covers(op, visible.keys, head_dim)?;
    check_heads(op, heads, head_dim)?;
    expect_len(op, "q", q.len(), visible.queries * heads * head_dim)?;
    expect_len(op, "w", w.len(), visible.queries * heads)?;
    expect_len(op, "scores", scores.len(), visible.total.max(1))?;
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
    let (counts, starts, first) = visible.views();
    let mut launch = rt.launcher(kernel)?;
    launch.arg(q).arg(w);
    keys.push(&mut launch);
    launch
        .arg(&counts)
        .arg(&first)
        .arg(&starts)
        .arg(scores)
        .arg(&params);
    // SAFETY: signature (const float* q, const float* w, const float* keys | const unsigned long
    // long* key_ptrs, const u32_t* visible, const u32_t* first_keys, const u32_t* score_starts,
    // float* scores, IndexParams); q holds queries * heads * head_dim, w queries * heads values,
    // every window first + visible is <= visible.keys and the key source holds that many
    // head_dim-wide rows (checked
    // above; a table's addresses are live rows by its unsafe constructor's contract), the
    // offsets place each query's scores inside `scores` (DeviceVisiblePrefixes::upload);
    // grid.y = queries <= the grid limit; the dynamic shared memory is the tile's layout.
    unsafe { launch.launch(cfg) }
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
}
