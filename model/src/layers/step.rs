//! The shape of one step shared by both families: which rows belong to which sequence
//! ([`StepRows`]), what each entry wants back ([`LogitsWanted`], sampled or not) and what it gets
//! ([`EntryOutput`]), and the head's bookkeeping from wanted rows to per-entry outputs.

use std::ops::Range;

use crate::backend::{Backend, KeyList, RowSampling, SelectPart, Tensor};
use crate::error::ModelError;
use crate::expert_dispatch::RoutedExperts;
use crate::layers::ring::MAX_BACKTRACK;
use crate::sampling::SamplingParams;

/// Chunks longer than this many tokens leave their sequence's rings compacted
/// ([`SequenceState::compact`]): the few rows a ring keeps then stop holding the chunk's buffers.
pub(crate) const COMPACT_AFTER: usize = 4 * MAX_BACKTRACK;

/// Where a step row's embedding comes from: a row of the model's embedding table, or values given
/// with the request (an image's patch embedding).
#[derive(Debug, Clone, Copy)]
pub enum EmbeddedRow<'r> {
    Token(u32),
    Given(&'r [f32]),
}

/// The residual streams a step starts from, `[n, hc · dim]`: each of the `n` `rows`' embedding
/// (`dim` values) in all `hc` streams. Token rows are read from `table` where it lives (on a
/// device backend: resident after the first step, so a step uploads only its ids); given rows
/// are uploaded, `n_given · dim` values, and the streams gathered from both.
pub fn embedded_streams<'r>(
    backend: &dyn Backend,
    table: &[f32],
    rows: impl IntoIterator<Item = EmbeddedRow<'r>>,
    dim: usize,
    hc: usize,
) -> Tensor {
    let rows: Vec<EmbeddedRow<'r>> = rows.into_iter().collect();
    let token = |row: &EmbeddedRow<'r>| match row {
        EmbeddedRow::Token(id) => Some(*id),
        EmbeddedRow::Given(_) => None,
    };
    let ids: Vec<u32> = rows.iter().filter_map(token).collect();
    if ids.len() == rows.len() {
        let streams: Vec<u32> = ids
            .iter()
            .flat_map(|&id| std::iter::repeat_n(id, hc))
            .collect();
        return backend.table_rows(table, dim, &streams);
    }
    let tokens = backend.table_rows(table, dim, &ids);
    let mut given = Vec::new();
    for row in &rows {
        if let EmbeddedRow::Given(values) = row {
            given.extend_from_slice(values);
        }
    }
    let given = backend.resident(Tensor::from(given));
    let (mut next_token, mut next_given) = (0, 0);
    let mut pieces: Vec<(&Tensor, usize)> = Vec::with_capacity(rows.len() * hc);
    for row in &rows {
        let piece = match row {
            EmbeddedRow::Token(_) => {
                next_token += 1;
                (&tokens, (next_token - 1) * dim)
            }
            EmbeddedRow::Given(_) => {
                next_given += 1;
                (&given, (next_given - 1) * dim)
            }
        };
        pieces.extend(std::iter::repeat_n(piece, hc));
    }
    backend.gather(&pieces, dim)
}

/// Which logits rows a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// One row per token of the chunk.
    All,
    /// Only the row of the chunk's last token.
    Last,
}

/// One sequence's part of a step (the families' `Model::forward_step`, `AnyModel::forward_step`):
/// `S` is the family's sequence state.
pub struct StepEntry<'a, S> {
    pub seq: &'a mut S,
    /// Appended at the sequence's next positions.
    pub tokens: &'a [u32],
    pub want: LogitsWanted,
    /// Decoder bounded replay (V4.1, spec §3.5, an approximation): rows at positions below it
    /// stop at the decoder boundary (the first ratio-1 layer, whose compressor still sees them),
    /// so layers from there on run only on positions `>= decoder_from`. Pass the same
    /// `decoder_from` (`prompt_len - keep`, see the runtime's `ReplayBound::plan_prefill`, which
    /// validates `keep >= window + max backtracking`) with every chunk of the prompt: the result
    /// is the same bit for bit however the prompt is chunked; decode steps (positions past it)
    /// are unaffected. Rows are returned for the kept positions only (a chunk entirely before
    /// `decoder_from` returns none). `None`: every layer sees every row.
    pub decoder_from: Option<usize>,
    /// Sample the wanted rows where the logits are computed and return token ids
    /// ([`EntryOutput::Tokens`]) instead of logits: the row of the token at position `p` gives the
    /// token at `p + 1`, sampled as [`crate::sampling::sample`] with that position as the noise
    /// counter. `None`: the logits rows ([`EntryOutput::Logits`], or
    /// [`EntryOutput::DeviceLogits`] left on the backend).
    pub sample: Option<SamplingParams>,
}

impl<'a, S> StepEntry<'a, S> {
    /// `tokens` appended to `seq`, its `want`ed logits rows back (no replay, no sampling).
    pub fn new(seq: &'a mut S, tokens: &'a [u32], want: LogitsWanted) -> Self {
        StepEntry {
            seq,
            tokens,
            want,
            decoder_from: None,
            sample: None,
        }
    }
}

/// How a step runs beyond its entries (the defaults: every expert here, logits read on the host,
/// nothing of the family's own). `F` is what only one family runs (`v41::StepExtras`: a trace,
/// image spans, a context-parallel rank); `()` where a family has none.
#[derive(Clone, Copy, Default)]
pub struct StepOptions<'a, F = ()> {
    /// Runs the backbone's routed experts elsewhere (expert parallelism, either family).
    pub experts: Option<&'a dyn RoutedExperts>,
    /// Leave the unsampled entries' rows where the backend computed them
    /// ([`EntryOutput::DeviceLogits`], V4.1; a V4 model reads them on the host), to be sampled
    /// once their masks are known (`v41::Model::sample_rows`).
    pub logits_on_device: bool,
    /// The family's own options.
    pub family: F,
}

impl<F: Default> StepOptions<'_, F> {
    /// Every expert here, the unsampled rows left on the backend.
    pub fn on_device() -> Self {
        StepOptions {
            logits_on_device: true,
            ..StepOptions::default()
        }
    }
}

impl<'a> StepOptions<'a> {
    /// These options with the family's own `family` options.
    pub fn with_family<F>(self, family: F) -> StepOptions<'a, F> {
        StepOptions {
            experts: self.experts,
            logits_on_device: self.logits_on_device,
            family,
        }
    }
}

/// What a step returns for one entry.
#[derive(Debug, Clone, PartialEq)]
pub enum EntryOutput {
    /// The wanted logits rows (`[rows, vocab]` fp32).
    Logits(Vec<f32>),
    /// One sampled token per wanted row.
    Tokens(Vec<u32>),
    /// The wanted logits rows left where the backend computed them (device memory on a device
    /// backend, never read on the host by the step): `forward_step`'s (with `StepOptions::logits_on_device`)
    /// unsampled entries, to be sampled later with [`Model::sample_rows`].
    DeviceLogits(Tensor),
}

impl EntryOutput {
    /// The logits (device logits read on the host), or `None` for sampled tokens.
    pub fn into_logits(self) -> Option<Vec<f32>> {
        match self {
            EntryOutput::Logits(logits) => Some(logits),
            EntryOutput::DeviceLogits(logits) => Some(logits.into_vec()),
            EntryOutput::Tokens(_) => None,
        }
    }

    /// The logits rows of a one-entry step's `outputs` (the form of a single sequence's forward):
    /// a sampled entry or a step of another size is an error.
    pub fn one_entry_logits(outputs: Vec<EntryOutput>) -> Result<Vec<f32>, ModelError> {
        let entries = outputs.len();
        let mut outputs = outputs.into_iter();
        match (outputs.next().and_then(EntryOutput::into_logits), entries) {
            (Some(logits), 1) => Ok(logits),
            _ => Err(ModelError::Sequence {
                message: format!(
                    "a one-entry step returned {entries} outputs, not one entry's logits"
                ),
            }),
        }
    }

    /// The sampled tokens, or `None` for logits.
    pub fn into_tokens(self) -> Option<Vec<u32>> {
        match self {
            EntryOutput::Tokens(tokens) => Some(tokens),
            EntryOutput::Logits(_) | EntryOutput::DeviceLogits(_) => None,
        }
    }
}

/// The positions of a step's rows and which rows belong to which sequence.
pub(crate) struct StepRows {
    pub positions: Vec<usize>,
    /// The rows of entry `e` (consecutive, in entry order).
    pub spans: Vec<Range<usize>>,
}

impl StepRows {
    /// The rows of one chunk per entry, given as (first position, token count).
    pub(crate) fn new(chunks: impl Iterator<Item = (usize, usize)>) -> StepRows {
        let mut rows = StepRows {
            positions: Vec::new(),
            spans: Vec::new(),
        };
        for (start, len) in chunks {
            let first = rows.positions.len();
            rows.positions.extend(start..start + len);
            rows.spans.push(first..first + len);
        }
        rows
    }

    /// One sequence's rows at `positions`.
    pub(crate) fn single(positions: &[usize]) -> StepRows {
        StepRows {
            positions: positions.to_vec(),
            spans: std::iter::once(0..positions.len()).collect(),
        }
    }

    /// How many compressed entries (of `ratio` positions each) every row sees: `(position + 1) /
    /// ratio`.
    pub(crate) fn visible_entries(&self, ratio: usize) -> Vec<usize> {
        self.positions.iter().map(|&p| (p + 1) / ratio).collect()
    }

    /// The parts of an index selection over the rows ([`Backend::select_rows`]): entry `e`'s rows
    /// score `keys[e]`, row `t` the first `visible[t]` of them.
    pub(crate) fn select_parts<'a>(
        &self,
        keys: &'a [&'a KeyList],
        visible: &'a [usize],
    ) -> Vec<SelectPart<'a>> {
        keys.iter()
            .zip(&self.spans)
            .map(|(keys, span)| SelectPart {
                keys,
                visible: &visible[span.clone()],
            })
            .collect()
    }

    /// Drops the first `dropped[e]` rows of every entry; returns the kept flag of every old row.
    pub(crate) fn drop_leading(&mut self, dropped: &[usize]) -> Vec<bool> {
        let mut kept = vec![true; self.positions.len()];
        let mut first = 0;
        for (span, &drop) in self.spans.iter_mut().zip(dropped) {
            let drop = drop.min(span.len());
            kept[span.start..span.start + drop].fill(false);
            let len = span.len() - drop;
            *span = first..first + len;
            first += len;
        }
        let mut flags = kept.iter();
        self.positions.retain(|_| *flags.next().unwrap_or(&true));
        kept
    }

    /// Every row of entry `e` kept (`width` values per row) out of `values`.
    pub(crate) fn of(&self, e: usize, values: &Tensor, width: usize) -> Tensor {
        values.rows(self.spans[e].clone(), width)
    }
}

/// The `width`-wide rows `rows` of `values`, one after another.
pub(crate) fn gather_rows(
    backend: &dyn Backend,
    values: &Tensor,
    rows: impl Iterator<Item = usize>,
    width: usize,
) -> Tensor {
    let pieces: Vec<(&Tensor, usize)> = rows.map(|r| (values, r * width)).collect();
    backend.gather(&pieces, width)
}

/// A bad entry of a step: its index, when the step has more than one.
pub(crate) fn step_error(entry: usize, entries: usize, err: ModelError) -> ModelError {
    match err {
        ModelError::Sequence { message } if entries > 1 => ModelError::Sequence {
            message: format!("step entry {entry}: {message}"),
        },
        other => other,
    }
}

/// What an entry wants back: which logits rows, and whether they are sampled.
pub(crate) type EntryWant = (LogitsWanted, Option<SamplingParams>);

/// What each of a step's `entries` wants back, in entry order.
pub(crate) fn entry_wants<S>(entries: &[StepEntry<'_, S>]) -> Vec<EntryWant> {
    entries
        .iter()
        .map(|entry| (entry.want, entry.sample))
        .collect()
}

/// The rows (of `rows`) each entry wants back: every row of its span, or its last one
/// (none when `holds_last` is false: a context-parallel rank without the chunk's last token).
pub(crate) fn wanted_rows(
    rows: &StepRows,
    wants: &[EntryWant],
    holds_last: bool,
) -> Vec<Vec<usize>> {
    rows.spans
        .iter()
        .zip(wants)
        .map(|(span, (want, _))| match want {
            LogitsWanted::All => span.clone().collect(),
            LogitsWanted::Last if !holds_last => Vec::new(),
            LogitsWanted::Last => span.clone().last().into_iter().collect(),
        })
        .collect()
}

/// The wanted rows, in entry order, of the entries that sample (`sampled`) or of those that do not.
pub(crate) fn rows_of<'a>(
    wanted: &'a [Vec<usize>],
    wants: &'a [EntryWant],
    sampled: bool,
) -> impl Iterator<Item = usize> + 'a {
    wanted
        .iter()
        .zip(wants)
        .filter(move |(_, (_, sample))| sample.is_some() == sampled)
        .flat_map(|(rows, _)| rows.iter().copied())
}

/// How each sampled row is sampled: its entry's parameters, with the position of the token it
/// gives (the row's own position plus one) as the noise counter.
pub(crate) fn row_sampling(
    rows: &StepRows,
    wanted: &[Vec<usize>],
    wants: &[EntryWant],
) -> Vec<RowSampling> {
    wanted
        .iter()
        .zip(wants)
        .filter_map(|(entry_rows, (_, sample))| Some((entry_rows, (*sample)?)))
        .flat_map(|(entry_rows, params)| {
            entry_rows.iter().map(move |&row| RowSampling {
                params,
                position: rows.positions[row] as u64 + 1,
            })
        })
        .collect()
}

/// The logits rows of the entries that do not sample, in entry order (`[rows, vocab]`).
pub(crate) enum HeadLogits {
    /// Read on the host.
    Host(Vec<f32>),
    /// Left where the backend computed them.
    Device(Tensor),
}

/// Each entry's output: its sampled `tokens`, or its rows of `logits` (both in entry order).
pub(crate) fn entry_outputs(
    wanted: &[Vec<usize>],
    wants: &[EntryWant],
    tokens: &[u32],
    logits: &HeadLogits,
    vocab: usize,
) -> Vec<EntryOutput> {
    let (mut at_logits, mut at_tokens) = (0, 0);
    wanted
        .iter()
        .zip(wants)
        .map(|(rows, (_, sample))| {
            let n = rows.len();
            if sample.is_some() {
                at_tokens += n;
                EntryOutput::Tokens(tokens[at_tokens - n..at_tokens].to_vec())
            } else {
                at_logits += n;
                let span = (at_logits - n) * vocab..at_logits * vocab;
                match logits {
                    HeadLogits::Host(host) => EntryOutput::Logits(host[span].to_vec()),
                    HeadLogits::Device(device) => EntryOutput::DeviceLogits(device.range(span)),
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// Token rows come from the table, given rows as they are, each in all `hc` streams in row
    /// order; all-token steps take the table path alone.
    #[test]
    fn embedded_streams_repeat_each_row_in_every_stream_in_row_order() {
        let backend = CpuBackend;
        let (dim, hc) = (2, 3);
        let table: Vec<f32> = (0..8).map(|v| v as f32).collect(); // rows [0,1] [2,3] [4,5] [6,7]
        let image = [10.0, 11.0];
        let rows = [
            EmbeddedRow::Token(3),
            EmbeddedRow::Given(&image),
            EmbeddedRow::Token(1),
        ];
        let streams = embedded_streams(&backend, &table, rows, dim, hc).into_vec();
        let expected: Vec<f32> = [[6.0, 7.0], [10.0, 11.0], [2.0, 3.0]]
            .iter()
            .flat_map(|row| std::iter::repeat_n(row.to_vec(), hc).flatten())
            .collect();
        assert_eq!(streams, expected);
        let tokens = [EmbeddedRow::Token(0), EmbeddedRow::Token(2)];
        let streams = embedded_streams(&backend, &table, tokens, dim, 2).into_vec();
        assert_eq!(streams, [0.0, 1.0, 0.0, 1.0, 4.0, 5.0, 4.0, 5.0]);
    }
}
