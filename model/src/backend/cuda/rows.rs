//! The row ops of [`CudaBackend`] (mHC mixes, collapse and expansion, sparse attention, index
//! scores): every token of every sequence of a step in one launch, each row computed as it
//! would be alone (batch invariance). Keys are read through
//! tables of device addresses, so a sequence's KV rows stay wherever its steps left them.

use super::*;
use crate::backend::CompressedRows;

/// The row-batched ops (every token of every sequence of a step in one call): one launch per op
/// (or per grid's worth of rows), each row computed exactly as the one-token op computes it alone
/// (batch invariance), the results left on the device.
impl CudaBackend {
    /// [`Backend::hc_mixes_rows`], with errors: `x [n, hc · dim]`, all tokens in one pair of
    /// launches (the partials, then the sums and Sinkhorn per token).
    pub fn try_hc_mixes_rows(
        &self,
        x: &Tensor,
        params: &HcParams,
        mixing: &HcMixing,
    ) -> Result<HcMixes, CudaBackendError> {
        const OP: &str = "hc_mixes_rows";
        let HcMixing {
            hc,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
        } = *mixing;
        let projections = (2 + hc) * hc;
        if hc == 0 || params.proj.is_empty() || !params.proj.len().is_multiple_of(projections) {
            return Err(shape_err(
                OP,
                format!(
                    "proj ({} values) is not {projections} whole projections (hc = {hc})",
                    params.proj.len()
                ),
            ));
        }
        let width = params.proj.len() / projections;
        if !x.len().is_multiple_of(width) {
            return Err(shape_err(
                OP,
                format!("x ({} values) is not whole {width}-wide tokens", x.len()),
            ));
        }
        let tokens = x.len() / width;
        if tokens == 0 {
            return Ok(HcMixes::from_host(hc, &[]));
        }
        let dproj = self.cached_f32(OP, &params.proj)?;
        let dbase = self.cached_f32(OP, &params.base)?;
        let dscale = self.cached_f32(OP, &params.scale)?;
        let dx = self.input(OP, x)?;
        // SAFETY: hc_mixes_f32 runs one block per token writing its pre, post and comb values.
        let mut dout = unsafe { self.alloc_written(OP, tokens * projections) }?;
        let config = HcMixesConfig {
            hc,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
        };
        hc_mixes_rows_f32(
            &self.rt, &dx, width, &dproj, &dbase, &dscale, &mut dout, config,
        )
        .map_err(op_err(OP))?;
        Ok(HcMixes {
            hc,
            values: self.tensor(dout),
        })
    }

    /// [`Backend::hc_collapse_rows_at`], with errors: `x [n, hc, dim]`, `weights [n, hc]`.
    pub fn try_hc_collapse_rows(
        &self,
        x: &Tensor,
        collapse: HcCollapse<'_>,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "hc_collapse_rows";
        let HcCollapse {
            weights,
            hc,
            precision,
        } = collapse;
        if hc == 0 || !weights.len().is_multiple_of(hc) {
            return Err(shape_err(
                OP,
                format!(
                    "weights ({} values) are not whole tokens of hc = {hc}",
                    weights.len()
                ),
            ));
        }
        let tokens = weights.len() / hc;
        if tokens == 0 && x.is_empty() {
            return Ok(Tensor::empty());
        }
        if tokens == 0 || x.is_empty() || !x.len().is_multiple_of(tokens * hc) {
            return Err(shape_err(
                OP,
                format!(
                    "x ({} values) is not {tokens} tokens of {hc} whole streams",
                    x.len()
                ),
            ));
        }
        let stream_len = x.len() / (tokens * hc);
        if tokens > MAX_TOKENS_PER_LAUNCH {
            return self.join_rows(tokens, stream_len, |rows| {
                let part = HcCollapse {
                    weights: &weights.rows(rows.clone(), hc),
                    ..collapse
                };
                self.try_hc_collapse_rows(&x.rows(rows, hc * stream_len), part)
            });
        }
        let dx = self.input(OP, x)?;
        let dw = self.input(OP, weights)?;
        // SAFETY: hc_collapse_f32 covers every (token, dim) with its grid.
        let mut dy = unsafe { self.alloc_written(OP, x.len() / hc) }?;
        hc_collapse_rows_f32(&self.rt, &dx, &dw, &mut dy, hc, rounding(precision))
            .map_err(op_err(OP))?;
        Ok(self.tensor(dy))
    }

    /// [`Backend::hc_expand_rows_at`], with errors: `y [n, dim]`, `residual [n, hc, dim]`, one
    /// mix per token.
    pub fn try_hc_expand_rows(
        &self,
        y: &Tensor,
        expand: HcExpand<'_>,
    ) -> Result<Tensor, CudaBackendError> {
        const OP: &str = "hc_expand_rows";
        let HcExpand {
            residual,
            mixes,
            precision,
        } = expand;
        let (hc, tokens) = (mixes.hc, mixes.tokens());
        if tokens == 0 {
            return if y.is_empty() && residual.is_empty() {
                Ok(Tensor::empty())
            } else {
                Err(shape_err(OP, format!("no mixes for {} outputs", y.len())))
            };
        }
        if hc == 0 || y.is_empty() || !y.len().is_multiple_of(tokens) {
            return Err(shape_err(
                OP,
                format!(
                    "{tokens} tokens of {hc} streams and a {}-value output",
                    y.len()
                ),
            ));
        }
        if residual.len() != hc * y.len() {
            return Err(shape_err(
                OP,
                format!(
                    "residual has {} values, expected {hc} streams of the {}-value output",
                    residual.len(),
                    y.len()
                ),
            ));
        }
        let dim = y.len() / tokens;
        if tokens > MAX_TOKENS_PER_LAUNCH {
            return self.join_rows(tokens, hc * dim, |rows| {
                let part = HcMixes {
                    hc,
                    values: mixes.values.rows(rows.clone(), mixes.width()),
                };
                let expand = HcExpand {
                    residual: &residual.rows(rows.clone(), hc * dim),
                    mixes: &part,
                    precision,
                };
                self.try_hc_expand_rows(&y.rows(rows, dim), expand)
            });
        }
        // The mixes rows as hc_mixes_rows left them: the kernel reads post and comb in place.
        let dy = self.input(OP, y)?;
        let dres = self.input(OP, residual)?;
        let dmix = self.input(OP, &mixes.values)?;
        // SAFETY: hc_expand_f32 covers every (token, stream, dim) with its grid.
        let mut dout = unsafe { self.alloc_written(OP, hc * y.len()) }?;
        hc_expand_rows_f32(
            &self.rt,
            &dy,
            &dres,
            &dmix,
            &mut dout,
            hc,
            rounding(precision),
        )
        .map_err(op_err(OP))?;
        Ok(self.tensor(dout))
    }

    /// [`Backend::sparse_attention_rows`], with errors: one table of the distinct listed
    /// keys' device addresses followed by every window ring's rows and every compressed entry of
    /// each sequence that a query reads from; each query's list names its window's rows, its
    /// listed rows, then its compressed rows — one run for a prefix, and a selection's written on
    /// the device from a device selection, so the selection never comes back to the host — and
    /// one launch computes every (head, query).
    pub fn try_sparse_attention_rows(
        &self,
        attention: AttentionQueries<'_>,
        queries: &[QueryKeys<'_>],
    ) -> Result<Tensor, CudaBackendError> {
        let AttentionQueries { q, sink, .. } = attention;
        const OP: &str = "sparse_attention_rows";
        let n = queries.len();
        if n == 0 {
            return if q.is_empty() {
                Ok(Tensor::empty())
            } else {
                Err(shape_err(
                    OP,
                    format!("{} query values but no key lists", q.len()),
                ))
            };
        }
        let heads = sink.len();
        if heads == 0 || q.is_empty() || !q.len().is_multiple_of(n * heads) {
            return Err(shape_err(
                OP,
                format!(
                    "q ({} values) is not {n} queries of {heads} whole heads",
                    q.len()
                ),
            ));
        }
        let head_dim = q.len() / (n * heads);
        let width = heads * head_dim;
        if n > MAX_QUERIES_PER_ATTENTION_LAUNCH {
            return self.join_rows(n, width, |rows| {
                let q = q.rows(rows.clone(), width);
                self.try_sparse_attention_rows(
                    AttentionQueries { q: &q, ..attention },
                    &queries[rows],
                )
            });
        }
        // The key table: first one row per listed key a query does not share with the query
        // before it (a sequence's consecutive queries, whose lists grow or slide by one, reuse
        // its rows: `listed_key_rows`; keys of other sequences are distinct, and a repeat
        // elsewhere only costs a row), then every window ring and every compressed list a query
        // reads once, whole, from its device mirror (`key_tables`): a query's window is one or
        // two runs of its ring's rows, a prefix of a list one run of the list's.
        let mut table = KeyTableBuilder::new(self, OP, head_dim);
        let lists = select::listed_key_rows(queries, |t, i, key| {
            if key.len() != head_dim {
                return Err(shape_err(
                    OP,
                    format!(
                        "key {i} of query {t} has {} values, head_dim is {head_dim}",
                        key.len()
                    ),
                ));
            }
            table.listed(key)
        })?;
        let mut segments = ListSegments::with_queries(n);
        for ((t, query), list) in queries.iter().enumerate().zip(&lists) {
            if let Some(window) = query.window.as_ref().filter(|w| !w.is_empty()) {
                let base = table.ring(window.ring)?;
                for run in window.runs() {
                    let first = rows_u32(OP, run.start - window.ring.start())?;
                    segments.run(base + first, run.len())?;
                }
            }
            segments.rows(list)?;
            if let Some(compressed) = query.compressed {
                let entries = compressed.entries;
                let base = table.list(entries)?;
                match compressed.rows {
                    CompressedRows::Prefix(count) => {
                        if count > entries.len() {
                            return Err(shape_err(
                                OP,
                                format!(
                                    "query {t} reads the first {count} compressed entries of {}",
                                    entries.len()
                                ),
                            ));
                        }
                        segments.run(base, count)?;
                    }
                    CompressedRows::Selected { selection, row } => {
                        let count = selection.counts[row];
                        match selection
                            .device_rows()
                            .and_then(|rows| rows.as_any().downcast_ref::<DeviceSelectionRows>())
                        {
                            Some(device) => {
                                segments.selected(base, count, device.row_address(&self.rt, row))?
                            }
                            None => {
                                let rows = &selection.rows()[row];
                                let mut table_rows = Vec::with_capacity(rows.len());
                                for &i in rows {
                                    if i >= entries.len() {
                                        return Err(shape_err(
                                            OP,
                                            format!(
                                                "query {t} selects compressed entry {i} of {}",
                                                entries.len()
                                            ),
                                        ));
                                    }
                                    table_rows.push(base + i as u32);
                                }
                                segments.rows(&table_rows)?;
                            }
                        }
                    }
                }
            }
            segments.end_query();
        }
        let (table, _uploads) = table.finish()?;
        // SAFETY: each selected segment reads `count` positions of a device selection below the
        // compressed list's visible count (the top-k's contract), so `base + position` is a row
        // of that list in the table; the selection is held by the caller's `QueryKeys`.
        let dlists = unsafe {
            DeviceKeyLists::compose(
                &self.rt,
                &segments.segments,
                &segments.row_starts,
                table.rows(),
            )
        }
        .map_err(op_err(OP))?;
        let dsink = self.cached_f32(OP, sink)?;
        let dq = self.input(OP, q)?;
        // SAFETY: both attention kernels write every head's head_dim outputs of every query
        // (the fast one directly for one split, else through its split combine).
        let mut dout = unsafe { self.alloc_written(OP, q.len()) }?;
        // The fast numerics take the tensor-core kernel when its shape allows: with bf16
        // operands at the bf16 rounding points (where q, the keys and the weights are bf16
        // values), with each f32 operand split into two bf16 pieces in f32 precision (V4); a
        // call's choice depends only on head_dim, the precision and the rows' alignment, never
        // on the batch.
        let rows = AttentionRows {
            q: &dq,
            lists: &dlists,
            sink: &dsink,
            head_dim,
            scale: attention.scale,
            rounding: rounding(attention.precision),
        };
        let fast = self.numerics == Numerics::Fast && fast_attention_supports(head_dim, &table);
        if fast {
            let blocks = FastAttentionBlocks::default();
            sparse_attention_sink_rows_ptr_fast(&self.rt, rows, &table, &mut dout, blocks)
        } else {
            sparse_attention_sink_rows_f32(&self.rt, rows, KeyRows::Table(&table), &mut dout)
        }
        .map_err(op_err(OP))?;
        Ok(self.tensor(dout))
    }

    /// [`Backend::select_rows`], with errors: the index scores of every part's queries in one
    /// launch (one key table over all parts' keys), the candidate mask (produced or applied) and
    /// the top-k all on the device; the selection stays there ([`DeviceSelectionRows`]).
    pub fn try_select_rows(
        &self,
        queries: IndexQueries<'_>,
        from: SelectFrom<'_>,
    ) -> Result<(Selection, Option<CandidateMask>), CudaBackendError> {
        const OP: &str = "select_rows";
        let SelectFrom {
            parts,
            k,
            candidates,
        } = from;
        let seen: Vec<usize> = parts
            .iter()
            .flat_map(|part| part.visible.iter().map(|&v| v.min(part.keys.len())))
            .collect();
        let n = seen.len();
        let max_seen = seen.iter().copied().max().unwrap_or(0);
        let device_mask = match candidates {
            Candidates::Apply(mask) => match mask.device_mask() {
                Some(found) => Some(found.downcast_ref::<DeviceMask>().ok_or_else(|| {
                    shape_err(OP, "a candidate mask of another backend".to_string())
                })?),
                None => None,
            },
            _ => None,
        };
        let host_mask = matches!(candidates, Candidates::Apply(_)) && device_mask.is_none();
        if k == 0 || max_seen == 0 || host_mask || n > MAX_QUERIES_PER_INDEX_LAUNCH {
            // Nothing to select on the device (or a host mask): the definition, on the host.
            let scores = select::scores_by_part(queries, parts, |queries, part| {
                self.try_index_scores_rows(queries, part)
            })?;
            return Ok(select::select_host(scores, k, candidates));
        }
        let heads = index_heads(OP, queries, n)?;
        let (mut scores, dvisible, table_rows) =
            self.device_index_scores(OP, queries, parts, heads)?;
        let stream = self.rt.stream();
        let mut produced = None;
        match candidates {
            Candidates::None => {}
            Candidates::Produce {
                block_size,
                topk_blocks,
            } => {
                // Stays zeroed: candidate_mask_rows not audited for full coverage.
                let mut mask = self.alloc_zeroed::<u8>(OP, dvisible.total().max(1))?;
                candidate_mask_rows(
                    &self.rt,
                    &scores,
                    &dvisible,
                    block_size,
                    topk_blocks,
                    &mut mask,
                )
                .map_err(op_err(OP))?;
                let visible_of_mask = DeviceVisiblePrefixes::upload(&self.rt, &seen, table_rows)
                    .map_err(op_err(OP))?;
                produced = Some(CandidateMask::device(
                    seen.clone(),
                    Arc::new(DeviceMask {
                        mask,
                        visible: visible_of_mask,
                    }),
                ));
            }
            Candidates::Apply(_) => {
                if let Some(mask) = device_mask {
                    apply_mask_rows(&self.rt, &mut scores, &dvisible, &mask.mask, &mask.visible)
                        .map_err(op_err(OP))?;
                }
            }
        }
        // Stay zeroed: top_k_rows fills only each query's first min(visible, k) rows.
        let mut rows = self.alloc_zeroed::<u32>(OP, n * k)?;
        let mut counts = self.alloc_zeroed::<u32>(OP, n)?;
        top_k_rows(&self.rt, &scores, &dvisible, k, &mut rows, &mut counts).map_err(op_err(OP))?;
        let host_counts: Vec<usize> = seen.iter().map(|&s| s.min(k)).collect();
        let device = DeviceSelectionRows {
            rows,
            k,
            counts: host_counts.clone(),
            stream: stream.clone(),
            transfers: self.transfers.clone(),
        };
        Ok((
            Selection::device(k, host_counts, Arc::new(device)),
            produced,
        ))
    }

    /// [`Backend::index_scores_rows_at`], with errors: `q [n, heads · head_dim]`, `weights
    /// [n, heads]`; query `t` scores the first `part.visible[t]` keys (at most all of them, as
    /// the trait's default clamps), one launch for all.
    pub fn try_index_scores_rows(
        &self,
        queries: IndexQueries<'_>,
        part: SelectPart<'_>,
    ) -> Result<Vec<Vec<f32>>, CudaBackendError> {
        const OP: &str = "index_scores_rows";
        let SelectPart { keys, visible } = part;
        let n = visible.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let heads = index_heads(OP, queries, n)?;
        if n > MAX_QUERIES_PER_INDEX_LAUNCH {
            let mut joined = Vec::with_capacity(n);
            for start in (0..n).step_by(MAX_QUERIES_PER_INDEX_LAUNCH) {
                let rows = start..(start + MAX_QUERIES_PER_INDEX_LAUNCH).min(n);
                let q = queries.q.rows(rows.clone(), heads * queries.head_dim);
                let weights = queries.weights.rows(rows.clone(), heads);
                let chunk = IndexQueries {
                    q: &q,
                    weights: &weights,
                    ..queries
                };
                let visible = &visible[rows];
                joined.extend(self.try_index_scores_rows(chunk, SelectPart { keys, visible })?);
            }
            return Ok(joined);
        }
        let seen: Vec<usize> = visible.iter().map(|&v| v.min(keys.len())).collect();
        let max_seen = seen.iter().copied().max().unwrap_or(0);
        if max_seen == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        let (dscores, _, _) = self.device_index_scores(OP, queries, &[part], heads)?;
        let flat = self.download(OP, &dscores)?;
        let mut rest = flat.as_slice();
        Ok(seen
            .iter()
            .map(|&count| {
                let (scores, tail) = rest.split_at(count);
                rest = tail;
                scores.to_vec()
            })
            .collect())
    }

    /// The index scores (`heads` heads) of query `t` over the first `seen[t]` of its part's
    /// keys, left on the device in the layout of the returned visible prefixes; also the key
    /// table's row count.
    fn device_index_scores(
        &self,
        op: &'static str,
        queries: IndexQueries<'_>,
        parts: &[SelectPart<'_>],
        heads: usize,
    ) -> Result<(CudaSlice<f32>, DeviceVisiblePrefixes, usize), CudaBackendError> {
        let head_dim = queries.head_dim;
        // One table over the parts' key lists, each whole and in key order, from their device
        // mirrors (`key_tables`); a query scores its part's rows from the part's first.
        let (mut first, mut seen) = (Vec::new(), Vec::new());
        let mut table = KeyTableBuilder::new(self, op, head_dim);
        for part in parts {
            let base = table.list(part.keys)? as usize;
            first.extend(std::iter::repeat_n(base, part.visible.len()));
            seen.extend(part.visible.iter().map(|&v| v.min(part.keys.len())));
        }
        let (table, _uploads) = table.finish()?;
        let dvisible = DeviceVisiblePrefixes::upload_from(&self.rt, &first, &seen, table.rows())
            .map_err(op_err(op))?;
        let dq = self.input(op, queries.q)?;
        let dw = self.input(op, queries.weights)?;
        // Stays zeroed: one unwritten value when nothing is visible (`max(1)`).
        let mut scores = self.alloc_zeroed(op, dvisible.total().max(1))?;
        // The fast numerics take the tensor-core kernel at the bf16 rounding points (the exact
        // kernel's bits on the indexer's Q4e-QDQ'd q and keys) when its shape allows; the choice
        // depends only on heads, head_dim, the precision and the rows' alignment.
        let fast = self.numerics == Numerics::Fast
            && queries.precision == Precision::Bf16
            && fast_index_supports(heads, head_dim, &table);
        let rows = IndexRows {
            q: &dq,
            w: &dw,
            visible: &dvisible,
            heads,
            head_dim,
        };
        if fast {
            index_scores_rows_ptr_fast(&self.rt, rows, &table, &mut scores, None)
        } else {
            let keys = KeyRows::Table(&table);
            index_scores_rows_f32(
                &self.rt,
                rows,
                keys,
                &mut scores,
                rounding(queries.precision),
            )
        }
        .map_err(op_err(op))?;
        Ok((scores, dvisible, table.rows()))
    }

    /// The outputs of `rows` in launches of at most a grid's worth each (`chunk` runs one range
    /// of rows), joined in row order on the device.
    fn join_rows(
        &self,
        rows: usize,
        width: usize,
        chunk: impl Fn(std::ops::Range<usize>) -> Result<Tensor, CudaBackendError>,
    ) -> Result<Tensor, CudaBackendError> {
        let step = MAX_TOKENS_PER_LAUNCH.min(MAX_QUERIES_PER_ATTENTION_LAUNCH);
        let parts = (0..rows)
            .step_by(step)
            .map(|start| chunk(start..(start + step).min(rows)))
            .collect::<Result<Vec<Tensor>, _>>()?;
        let pieces: Vec<(&Tensor, usize)> = parts
            .iter()
            .flat_map(|part| (0..part.len() / width.max(1)).map(move |r| (part, r * width)))
            .collect();
        self.try_gather(&pieces, width)
    }
}

/// The attention's key lists as [`ListSegment`]s, query by query: listed rows as runs of
/// consecutive table rows (a sequence's window keys are one run: `listed_key_rows` appends a
/// query's new keys after the ones it shares), device selections as they are.
struct ListSegments {
    segments: Vec<ListSegment>,
    row_starts: Vec<u32>,
    position: u32,
}

impl ListSegments {
    fn with_queries(queries: usize) -> ListSegments {
        let mut row_starts = Vec::with_capacity(queries + 1);
        row_starts.push(0);
        ListSegments {
            segments: Vec::with_capacity(2 * queries),
            row_starts,
            position: 0,
        }
    }

    /// Appends `rows` to the current query's list, one segment per run of consecutive rows.
    fn rows(&mut self, rows: &[u32]) -> Result<(), CudaBackendError> {
        let mut rest = rows;
        while let Some(&first) = rest.first() {
            let run = 1 + rest
                .windows(2)
                .take_while(|pair| pair[1] == pair[0].wrapping_add(1))
                .count();
            self.run(first, run)?;
            rest = &rest[run..];
        }
        Ok(())
    }

    /// Appends the `count` table rows from `first` on to the current query's list.
    fn run(&mut self, first: u32, count: usize) -> Result<(), CudaBackendError> {
        if count == 0 {
            return Ok(());
        }
        self.push(ListSegment::rows(self.position, first, 0), count)
    }

    /// Appends `count` rows `first + src[i]` of a device selection to the current query's list.
    fn selected(&mut self, first: u32, count: usize, src: u64) -> Result<(), CudaBackendError> {
        if count == 0 {
            return Ok(());
        }
        self.push(ListSegment::selected(self.position, first, 0, src), count)
    }

    fn push(&mut self, mut segment: ListSegment, count: usize) -> Result<(), CudaBackendError> {
        let too_long = || shape_err("sparse_attention_rows", "key lists beyond u32".to_string());
        segment.count = u32::try_from(count).map_err(|_| too_long())?;
        self.position = self
            .position
            .checked_add(segment.count)
            .ok_or_else(too_long)?;
        self.segments.push(segment);
        Ok(())
    }

    fn end_query(&mut self) {
        self.row_starts.push(self.position);
    }
}

/// A selection in device memory: `[queries, k]` positions, row `t` holding `counts[t]`.
#[derive(Debug)]
pub struct DeviceSelectionRows {
    rows: CudaSlice<u32>,
    k: usize,
    counts: Vec<usize>,
    stream: Arc<CudaStream>,
    transfers: Arc<TransferCounters>,
}

impl DeviceSelectionRows {
    /// The device address of row `row`'s positions.
    fn row_address(&self, rt: &KernelRuntime, row: usize) -> u64 {
        let (base, _sync) = self.rows.device_ptr(rt.stream());
        base + (row * self.k * std::mem::size_of::<u32>()) as u64
    }
}

impl DeviceRows for DeviceSelectionRows {
    fn download(&self) -> Vec<Vec<usize>> {
        self.transfers.result::<u32>(self.rows.len());
        let flat = self
            .stream
            .clone_dtoh(&self.rows)
            .unwrap_or_else(|err| panic!("CUDA backend: copying a selection to the host: {err}"));
        self.counts
            .iter()
            .enumerate()
            .map(|(t, &count)| {
                flat[t * self.k..t * self.k + count]
                    .iter()
                    .map(|&i| i as usize)
                    .collect()
            })
            .collect()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A candidate mask in device memory, with the visible prefixes of its queries.
struct DeviceMask {
    mask: CudaSlice<u8>,
    visible: DeviceVisiblePrefixes,
}

/// The heads of `queries` indexer queries `q [n, heads · head_dim]` with head weights
/// `[n, heads]`, or the shape error naming what does not fit.
fn index_heads(
    op: &'static str,
    index: IndexQueries<'_>,
    queries: usize,
) -> Result<usize, CudaBackendError> {
    let (q, weights, head_dim) = (index.q, index.weights, index.head_dim);
    if weights.is_empty() || !weights.len().is_multiple_of(queries) {
        return Err(shape_err(
            op,
            format!(
                "weights ({} values) are not {queries} queries of whole heads",
                weights.len()
            ),
        ));
    }
    let heads = weights.len() / queries;
    if head_dim == 0 || q.len() != queries * heads * head_dim {
        return Err(shape_err(
            op,
            format!(
                "q has {} values, expected {queries} queries of {heads} heads of {head_dim}",
                q.len()
            ),
        ));
    }
    Ok(heads)
}
