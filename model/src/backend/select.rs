//! The indexer's selection (spec §3.4) as the backend computes it: per query, the compressed
//! positions it attends to ([`Selection`]), and the two-level top-k's candidate mask
//! ([`CandidateMask`]). Both stay where they were computed: on a device they live in device memory
//! and go straight to the attention that reads them ([`QueryKeys`]); reading one on the host copies
//! it back once. The host functions here are the definition ([`top_k_lowest_index`],
//! [`candidate_mask`], [`select_host`]).

use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};

use super::{KeyList, Precision, Tensor, WindowKeys};

/// A selection or mask a device backend keeps in its own memory.
pub trait DeviceRows: Send + Sync + fmt::Debug {
    /// The rows, copied to the host (counted by the backend).
    fn download(&self) -> Vec<Vec<usize>>;
    fn as_any(&self) -> &dyn Any;
}

/// Per query of a step's rows, the ascending compressed positions it selected: query `t` holds
/// `counts[t]` of them (at most `k`).
#[derive(Clone)]
pub struct Selection {
    pub k: usize,
    pub counts: Vec<usize>,
    host: OnceLock<Vec<Vec<usize>>>,
    device: Option<Arc<dyn DeviceRows>>,
}

impl Selection {
    /// A selection on the host.
    pub fn host(rows: Vec<Vec<usize>>) -> Selection {
        Selection {
            k: rows.iter().map(Vec::len).max().unwrap_or(0),
            counts: rows.iter().map(Vec::len).collect(),
            host: OnceLock::from(rows),
            device: None,
        }
    }

    /// A selection in device memory: `counts[t]` positions of row `t`, rows `k` apart.
    pub fn device(k: usize, counts: Vec<usize>, rows: Arc<dyn DeviceRows>) -> Selection {
        Selection {
            k,
            counts,
            host: OnceLock::new(),
            device: Some(rows),
        }
    }

    /// Queries.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// The device rows, if the selection lives on a device.
    pub fn device_rows(&self) -> Option<&Arc<dyn DeviceRows>> {
        self.device.as_ref()
    }

    /// The selected positions of every query, on the host (copied back once from a device).
    pub fn rows(&self) -> &[Vec<usize>] {
        self.host.get_or_init(|| match &self.device {
            Some(rows) => rows.download(),
            None => Vec::new(),
        })
    }
}

impl fmt::Debug for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Selection")
            .field("k", &self.k)
            .field("counts", &self.counts)
            .field("on_device", &self.device.is_some())
            .finish()
    }
}

/// The candidate mask of a candidate source's queries (level one of the two-level top-k): per
/// query, which of its visible compressed positions a later index source may select.
#[derive(Clone)]
pub struct CandidateMask {
    /// Visible positions of each query.
    pub visible: Vec<usize>,
    host: OnceLock<Vec<Vec<bool>>>,
    device: Option<Arc<dyn Any + Send + Sync>>,
}

impl CandidateMask {
    /// A mask on the host.
    pub fn host(rows: Vec<Vec<bool>>) -> CandidateMask {
        CandidateMask {
            visible: rows.iter().map(Vec::len).collect(),
            host: OnceLock::from(rows),
            device: None,
        }
    }

    /// A mask in device memory (read only by the backend that made it).
    pub fn device(visible: Vec<usize>, mask: Arc<dyn Any + Send + Sync>) -> CandidateMask {
        CandidateMask {
            visible,
            host: OnceLock::new(),
            device: Some(mask),
        }
    }

    /// The device mask, if the mask lives on a device.
    pub fn device_mask(&self) -> Option<&Arc<dyn Any + Send + Sync>> {
        self.device.as_ref()
    }

    /// The host rows (a device mask has none: its backend applies it where it is).
    pub fn host_rows(&self) -> Option<&[Vec<bool>]> {
        self.host.get().map(Vec::as_slice)
    }
}

impl fmt::Debug for CandidateMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CandidateMask")
            .field("visible", &self.visible)
            .field("on_device", &self.device.is_some())
            .finish()
    }
}

/// What the two-level top-k asks of one index source's selection.
#[derive(Debug, Clone, Copy)]
pub enum Candidates<'a> {
    /// A plain index source.
    None,
    /// The candidate source: also return its candidate mask (blocks of `block_size` positions
    /// scored by their best, the newest pinned, the best `topk_blocks` kept).
    Produce {
        block_size: usize,
        topk_blocks: usize,
    },
    /// A later index source: scores outside the source's mask do not compete.
    Apply(&'a CandidateMask),
}

/// One sequence's queries in a step's index selection ([`super::Backend::select_rows`]): the
/// sequence's index keys (one `head_dim` row each) and, per query, how many of them it scores
/// (the first `visible[t]`, at most all of them).
#[derive(Debug, Clone, Copy)]
pub struct SelectPart<'a> {
    pub keys: &'a KeyList,
    pub visible: &'a [usize],
}

/// The indexer's queries of a step ([`super::Backend::select_rows`],
/// [`super::Backend::index_scores_rows_at`]): `q [n, heads · head_dim]` with their head weights
/// `weights [n, heads]`, the scores rounded at `precision`.
#[derive(Debug, Clone, Copy)]
pub struct IndexQueries<'a> {
    pub q: &'a Tensor,
    pub weights: &'a Tensor,
    pub head_dim: usize,
    pub precision: Precision,
}

/// What [`super::Backend::select_rows`] selects from: each query's part of `parts` (the parts'
/// queries in order), the top `k` of its scores, under the two-level top-k's `candidates`.
#[derive(Debug, Clone, Copy)]
pub struct SelectFrom<'a> {
    pub parts: &'a [SelectPart<'a>],
    pub k: usize,
    pub candidates: Candidates<'a>,
}

/// The index scores of a step's queries, part by part (`score(queries, part)`: the scores of
/// one part's queries, given its rows of `queries`), in query order; the first error ends it.
pub fn scores_by_part<E>(
    queries: IndexQueries<'_>,
    parts: &[SelectPart<'_>],
    mut score: impl FnMut(IndexQueries<'_>, SelectPart<'_>) -> Result<Vec<Vec<f32>>, E>,
) -> Result<Vec<Vec<f32>>, E> {
    let n: usize = parts.iter().map(|part| part.visible.len()).sum();
    let (q_width, w_width) = (queries.q.len() / n.max(1), queries.weights.len() / n.max(1));
    let mut first = 0;
    let mut scores = Vec::with_capacity(n);
    for part in parts {
        let rows = first..first + part.visible.len();
        first = rows.end;
        if rows.is_empty() {
            continue;
        }
        let q = queries.q.rows(rows.clone(), q_width);
        let weights = queries.weights.rows(rows, w_width);
        let part_queries = IndexQueries {
            q: &q,
            weights: &weights,
            ..queries
        };
        scores.extend(score(part_queries, *part)?);
    }
    Ok(scores)
}

/// The keys of one attention query: its `window` (a run of a ring's positions), then `listed`
/// in order, then its `compressed` entries.
#[derive(Debug, Clone)]
pub struct QueryKeys<'a> {
    pub window: Option<WindowKeys<'a>>,
    pub listed: Vec<&'a Tensor>,
    pub compressed: Option<CompressedKeys<'a>>,
}

/// The compressed part of a query's keys ([`QueryKeys`]): `rows` of a sequence's compressed
/// `entries` (one `head_dim` row each).
#[derive(Debug, Clone, Copy)]
pub struct CompressedKeys<'a> {
    pub entries: &'a KeyList,
    pub rows: CompressedRows<'a>,
}

/// Which compressed entries a query reads ([`CompressedKeys`]), in order.
#[derive(Debug, Clone, Copy)]
pub enum CompressedRows<'a> {
    /// `entries[i]` for every position `i` that row `row` of an indexer's `selection` holds.
    Selected {
        selection: &'a Selection,
        row: usize,
    },
    /// The first `count` entries (a layer without an indexer: every entry the query sees), one
    /// run of the list's rows.
    Prefix(usize),
}

impl<'a> CompressedKeys<'a> {
    /// The entries row `row` of `selection` holds.
    pub fn selected(entries: &'a KeyList, selection: &'a Selection, row: usize) -> Self {
        CompressedKeys {
            entries,
            rows: CompressedRows::Selected { selection, row },
        }
    }

    /// The first `count` entries.
    pub fn prefix(entries: &'a KeyList, count: usize) -> Self {
        CompressedKeys {
            entries,
            rows: CompressedRows::Prefix(count),
        }
    }

    /// How many entries the query reads.
    pub fn len(&self) -> usize {
        match self.rows {
            CompressedRows::Selected { selection, row } => selection.counts[row],
            CompressedRows::Prefix(count) => count,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entries the query reads, in order, on the host side of the list (a selection read
    /// there).
    pub fn keys(&self) -> Vec<&'a Tensor> {
        let entries = self.entries;
        match self.rows {
            CompressedRows::Selected { selection, row } => {
                selection.rows()[row].iter().map(|&i| &entries[i]).collect()
            }
            CompressedRows::Prefix(count) => entries[..count].iter().collect(),
        }
    }
}

impl<'a> QueryKeys<'a> {
    /// Keys listed one by one.
    pub fn listed(listed: Vec<&'a Tensor>) -> QueryKeys<'a> {
        QueryKeys {
            window: None,
            listed,
            compressed: None,
        }
    }

    /// Every key of the query in order, on the host side of the list (a selection read there).
    pub fn flattened(&self) -> Vec<&'a Tensor> {
        let mut keys: Vec<&'a Tensor> = self.window.iter().flat_map(WindowKeys::rows).collect();
        keys.extend(&self.listed);
        if let Some(compressed) = &self.compressed {
            keys.extend(compressed.keys());
        }
        keys
    }

    /// How many keys the query has.
    pub fn len(&self) -> usize {
        self.window.as_ref().map_or(0, WindowKeys::len)
            + self.listed.len()
            + self.compressed.as_ref().map_or(0, CompressedKeys::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The rows of every query's listed keys in a table of keys: `row_of(t, i, key)` gives key `i` of
/// query `t` its row, called only for the keys a query does not share with the query before it
/// (a window slides by one key per query of a sequence, so the keys the two share, the same
/// tensors, keep the rows they had).
pub fn listed_key_rows<E>(
    queries: &[QueryKeys<'_>],
    mut row_of: impl FnMut(usize, usize, &Tensor) -> Result<u32, E>,
) -> Result<Vec<Vec<u32>>, E> {
    let mut lists: Vec<Vec<u32>> = Vec::with_capacity(queries.len());
    for (t, query) in queries.iter().enumerate() {
        let previous = t
            .checked_sub(1)
            .map(|p| (&queries[p].listed[..], &lists[p][..]));
        let shift = previous.and_then(|(keys, _)| sliding_shift(keys, &query.listed));
        let mut list = Vec::with_capacity(query.len());
        for (i, key) in query.listed.iter().enumerate() {
            let shared = previous.zip(shift).and_then(|((keys, rows), shift)| {
                keys.get(shift + i)
                    .filter(|k| std::ptr::eq(**k, *key))
                    .map(|_| rows[shift + i])
            });
            list.push(match shared {
                Some(row) => row,
                None => row_of(t, i, key)?,
            });
        }
        lists.push(list);
    }
    Ok(lists)
}

/// Where `current`'s first key stands in `previous` (the same tensor, 0 or 1 places on: a
/// window that grew or slid by one key).
fn sliding_shift(previous: &[&Tensor], current: &[&Tensor]) -> Option<usize> {
    let first = current.first()?;
    (0..previous.len().min(2)).find(|&d| std::ptr::eq(previous[d], *first))
}

/// Indices of the `k` largest scores, ties broken toward the lower index, returned ascending.
pub fn top_k_lowest_index(scores: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_unstable();
    order
}

/// Level one of the two-level top-k over one query's scores: blocks of `block_size` positions
/// scored by their best position, the newest (partial) block pinned, the best `topk_blocks` kept
/// (a block whose best is −∞ is never kept).
pub fn candidate_mask(scores: &[f32], block_size: usize, topk_blocks: usize) -> Vec<bool> {
    if scores.is_empty() || block_size == 0 {
        return vec![true; scores.len()];
    }
    let mut block_scores: Vec<f32> = scores
        .chunks(block_size)
        .map(|b| b.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s)))
        .collect();
    let newest = (scores.len() - 1) / block_size;
    block_scores[newest] = f32::INFINITY;
    let kept = top_k_lowest_index(&block_scores, topk_blocks.min(block_scores.len()));
    let mut mask = vec![false; scores.len()];
    for block in kept {
        if block_scores[block] > f32::NEG_INFINITY {
            let end = ((block + 1) * block_size).min(scores.len());
            mask[block * block_size..end].fill(true);
        }
    }
    mask
}

/// The selection of queries from their index scores (`scores[t]`: query `t`'s visible scores):
/// the definition [`super::Backend::select_rows`] implements.
pub fn select_host(
    mut scores: Vec<Vec<f32>>,
    k: usize,
    candidates: Candidates<'_>,
) -> (Selection, Option<CandidateMask>) {
    let mut produced = Vec::new();
    for (t, scores) in scores.iter_mut().enumerate() {
        match candidates {
            Candidates::None => {}
            Candidates::Produce {
                block_size,
                topk_blocks,
            } => produced.push(candidate_mask(scores, block_size, topk_blocks)),
            Candidates::Apply(mask) => {
                if let Some(mask) = mask.host_rows().and_then(|rows| rows.get(t)) {
                    for (score, keep) in scores.iter_mut().zip(mask) {
                        if !keep {
                            *score = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
    }
    let rows = scores
        .iter()
        .map(|scores| top_k_lowest_index(scores, k.min(scores.len())))
        .collect();
    let mask =
        matches!(candidates, Candidates::Produce { .. }).then(|| CandidateMask::host(produced));
    let mut selection = Selection::host(rows);
    selection.k = k;
    (selection, mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sliding and growing windows over two sequences' keys, a query with a key of its own in
    /// the middle, a window that jumps, and an empty list: every key gets the row a lookup per
    /// key would give it, and the lookup runs once per key a query does not share with the one
    /// before.
    #[test]
    fn listed_key_rows_reuse_the_rows_of_a_sliding_window() {
        let keys: Vec<Tensor> = (0..12).map(|i| Tensor::from(&[i as f32][..])).collect();
        let other = Tensor::from(&[99.0f32][..]);
        let window = |range: std::ops::Range<usize>| keys[range].iter().collect::<Vec<_>>();
        let mut odd = window(3..7);
        odd[2] = &other;
        let queries: Vec<QueryKeys<'_>> = [
            window(0..1),
            window(0..2),
            window(0..3),
            window(1..4),
            window(2..5),
            odd,
            window(4..7),
            window(6..8),
            Vec::new(),
            window(8..10),
            window(9..12),
        ]
        .into_iter()
        .map(QueryKeys::listed)
        .collect();
        let row = |key: &Tensor| key.as_host()[0] as u32;
        let mut lookups = Vec::new();
        let lists = listed_key_rows(&queries, |t, i, key| {
            lookups.push((t, i));
            Ok::<u32, ()>(row(key))
        })
        .expect("rows");
        for (query, list) in queries.iter().zip(&lists) {
            let expected: Vec<u32> = query.listed.iter().map(|k| row(k)).collect();
            assert_eq!(list, &expected);
        }
        assert_eq!(
            lookups,
            vec![
                (0, 0),
                (1, 1),
                (2, 2),
                (3, 2),
                (4, 2),
                (5, 2), // the odd query's own key, then its newest
                (5, 3),
                (6, 1), // the key the odd query replaced
                (7, 0), // a jump of two keys: no reuse
                (7, 1),
                (9, 0), // a new sequence after an empty list
                (9, 1),
                (10, 1),
                (10, 2),
            ]
        );
        let failed = listed_key_rows(&queries, |t, _, _| if t == 3 { Err(t) } else { Ok(0) });
        assert_eq!(failed, Err(3));
    }

    #[test]
    fn top_k_prefers_the_lower_index_on_ties_and_returns_ascending() {
        let scores = [1.0, 3.0, 2.0, 3.0, 2.0, f32::NEG_INFINITY];
        assert_eq!(top_k_lowest_index(&scores, 3), vec![1, 2, 3]);
        assert_eq!(top_k_lowest_index(&scores, 2), vec![1, 3]);
        assert_eq!(top_k_lowest_index(&[2.0, 2.0, 2.0], 1), vec![0]);
        assert_eq!(top_k_lowest_index(&scores, 0), Vec::<usize>::new());
    }

    #[test]
    fn a_candidate_mask_keeps_the_best_blocks_and_the_newest() {
        // Blocks of 2: [0, 5] [1, 1] [9, -inf] [0.5]; keep 2 blocks: the newest (pinned) and [9].
        let scores = [0.0, 5.0, 1.0, 1.0, 9.0, f32::NEG_INFINITY, 0.5];
        let mask = candidate_mask(&scores, 2, 2);
        assert_eq!(mask, vec![false, false, false, false, true, true, true]);
        let (selection, produced) = select_host(
            vec![scores.to_vec()],
            2,
            Candidates::Produce {
                block_size: 2,
                topk_blocks: 2,
            },
        );
        assert_eq!(selection.rows(), &[vec![1, 4]]);
        let produced = produced.expect("a candidate source returns its mask");
        let (restricted, _) = select_host(vec![scores.to_vec()], 2, Candidates::Apply(&produced));
        assert_eq!(restricted.rows(), &[vec![4, 6]]);
    }
}
