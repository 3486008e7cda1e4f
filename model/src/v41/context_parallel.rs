//! Context parallelism of one long prefill chunk over a group of `cp` ranks.
//!
//! Split ("mirror", DeepInfer's balanced CP): the chunk is cut into `2·cp` equal pieces and rank
//! `r` takes pieces `r` and `2·cp−1−r`. Causal attention work grows with the position, so a
//! piece near the start is paired with one near the end and every rank gets the same work (one
//! early and one late piece). The contiguous split (rank `r` takes piece `r` of `cp`) leaves the
//! last rank about `2·cp−1` times the first one's indexer work (the causal, quadratic part:
//! every query scores every visible compressed key); a striped split (token `t` on rank
//! `t mod cp`) balances as well but cuts every compression group and window across ranks and
//! gives each rank scattered rows; the mirror split keeps two runs per rank. `bench/` measures it.
//!
//! What a rank computes: its own tokens' rows through every layer (queries, attention, output
//! projection, MoE, Engram, head). What it needs from the others, all-gathered once per layer
//! through an [`Exchange`] (the in-process collective of the EP exchange, with its timeout and
//! abort; one thread per rank): the window K=V entries and the compressor inputs of their rows
//! (per-token `kv ‖ gate`), from which every rank rebuilds the same compressed KV and index keys
//! at every group boundary of every KV source — so a chunk boundary may split a compression group
//! (each rank pools every group of the chunk: small next to attention, and no second exchange).
//! The candidate pool and the indexer's selection are per query (the rank's own rows). Engram is
//! token-local given the tokens, which every rank holds. After the last layer the DSpark context
//! entries are all-gathered too, so every rank ends with the complete sequence state, bitwise the
//! single-rank prefill's (the CPU reference is batch-invariant: a row never depends on which other
//! rows share its step); the rank that will decode the sequence keeps it, the others drop theirs.

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use super::state::SequenceState;
use super::step::{StepEntry, StepExtras, StepOptions};
use super::{EntryOutput, LogitsWanted, Model};
use crate::backend::{Backend, Tensor};
use crate::error::ModelError;
use crate::expert_dispatch::RoutedExperts;
use crate::expert_exchange::{Exchange, ExchangeError, ExchangePhase, ExchangeTag};

/// How a chunk's tokens are dealt to the CP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpSplit {
    /// `2·cp` pieces, rank `r` takes pieces `r` and `2·cp−1−r` (balanced causal work).
    Mirror,
    /// `cp` pieces, rank `r` takes piece `r` (the naive split, for comparison).
    Contiguous,
}

/// The chunk offsets (ascending) rank `rank` of `ranks` computes in a chunk of `len` tokens.
/// Pieces are as equal as integers allow (the first `len mod pieces` get one more token).
pub fn rank_rows(len: usize, ranks: usize, rank: usize, split: CpSplit) -> Vec<usize> {
    let pieces = match split {
        CpSplit::Mirror => 2 * ranks,
        CpSplit::Contiguous => ranks,
    };
    let piece = |i: usize| {
        let (base, extra) = (len / pieces, len % pieces);
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    };
    match split {
        CpSplit::Mirror => piece(rank).chain(piece(pieces - 1 - rank)).collect(),
        CpSplit::Contiguous => piece(rank).collect(),
    }
}

/// One rank's part of a context-parallel step: its rows, every rank's rows and the exchange.
pub struct CpRank<'a> {
    rank: usize,
    /// Position of the chunk's first token (the sequence's length before it).
    start: usize,
    /// Chunk offsets of every rank's rows (ascending within each rank).
    rows: Vec<Vec<usize>>,
    exchange: &'a Exchange<Tensor>,
    /// Collectives this rank has entered (the tag's round).
    round: Cell<u64>,
    /// Time spent in collectives (waiting for the other ranks included).
    waited: Cell<Duration>,
    /// The first failed collective: the step fails after the layer that met it.
    failed: RefCell<Option<ExchangeError>>,
}

impl<'a> CpRank<'a> {
    /// Rank `rank` of `exchange.ranks()` over a chunk of `len` tokens from position `start`,
    /// dealt by `split`.
    pub fn new(
        rank: usize,
        start: usize,
        len: usize,
        split: CpSplit,
        exchange: &'a Exchange<Tensor>,
    ) -> Self {
        let ranks = exchange.ranks();
        CpRank {
            rank,
            start,
            rows: (0..ranks)
                .map(|r| rank_rows(len, ranks, r, split))
                .collect(),
            exchange,
            round: Cell::new(0),
            waited: Cell::new(Duration::ZERO),
            failed: RefCell::new(None),
        }
    }

    /// The chunk offsets this rank computes.
    pub fn own_rows(&self) -> &[usize] {
        &self.rows[self.rank]
    }

    /// The positions of this rank's rows.
    pub(crate) fn own_positions(&self) -> Vec<usize> {
        self.own_rows().iter().map(|&o| self.start + o).collect()
    }

    /// The positions of the whole chunk.
    pub(crate) fn chunk_positions(&self) -> Vec<usize> {
        (self.start..self.start + self.len()).collect()
    }

    /// Tokens in the chunk.
    fn len(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    /// Whether this rank computes the chunk's last token.
    pub(crate) fn owns_last(&self) -> bool {
        self.own_rows().last() == Some(&(self.len() - 1))
    }

    /// Every rank's `width`-wide rows of `own` (this rank's rows, in its order), in chunk order.
    /// A failed collective leaves zeros of the right size and is reported by [`CpRank::failure`].
    pub(crate) fn all_gather(
        &self,
        backend: &dyn Backend,
        own: &Tensor,
        width: usize,
        layer: usize,
    ) -> Tensor {
        let (ranks, len) = (self.rows.len(), self.len());
        let round = self.round.get();
        self.round.set(round + 1);
        let tag = ExchangeTag {
            round,
            layer,
            epoch: 0,
            phase: ExchangePhase::ContextGather,
        };
        let parts = (0..ranks).map(|_| own.clone()).collect();
        let entered = Instant::now();
        let received = self.exchange.all_to_all(self.rank, tag, parts);
        self.waited.set(self.waited.get() + entered.elapsed());
        let received = match received {
            Ok(received) => received,
            Err(err) => {
                self.failed.borrow_mut().get_or_insert(err);
                return Tensor::from(vec![0.0; len * width]);
            }
        };
        // Chunk offset → (source rank, row within its part).
        let mut pieces: Vec<(&Tensor, usize)> = vec![(own, 0); len];
        for (part, rows) in received.iter().zip(&self.rows) {
            for (i, &offset) in rows.iter().enumerate() {
                pieces[offset] = (part, i * width);
            }
        }
        backend.gather(&pieces, width)
    }

    /// Whether this split is of the chunk of `len` tokens from position `start`, with at least
    /// two tokens per rank.
    pub(crate) fn check_chunk(&self, start: usize, len: usize) -> Result<(), ModelError> {
        let ranks = self.rows.len();
        if self.len() != len || self.start != start || self.len() < 2 * ranks {
            return Err(ModelError::Sequence {
                message: format!(
                    "context-parallel split of {} tokens from position {} over {ranks} ranks \
                     for a chunk of {len} tokens from position {start} (at least 2 per rank)",
                    self.len(),
                    self.start,
                ),
            });
        }
        Ok(())
    }

    /// The collective failure met so far, if any.
    pub(crate) fn failure(&self) -> Option<ModelError> {
        self.failed
            .borrow()
            .as_ref()
            .map(|err| ModelError::Sequence {
                message: format!("context-parallel rank {}: {err}", self.rank),
            })
    }
}

/// What a context-parallel prefill returns.
pub struct CpPrefill {
    /// The wanted logits rows in chunk order (`[rows, vocab]`), as the single-rank prefill's.
    pub logits: Vec<f32>,
    /// Every rank's sequence state after the prefill (all equal; the decoding rank keeps its own).
    pub states: Vec<SequenceState>,
    /// Every rank's wall time outside the collectives (its own work; a rank with less work
    /// waits for the others at the next all-gather).
    pub busy: Vec<Duration>,
}

impl Model {
    /// A prefill of `tokens` after `seq` over `ranks` CP ranks in this process (one thread per
    /// rank, the ranks' exchange waiting at most `timeout`), split by `split`: every rank runs
    /// [`Model::forward_step`] with its [`CpRank`] ([`StepExtras::cp`]); `experts` runs the
    /// routed experts elsewhere (expert parallelism), for every rank.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_context_parallel(
        &self,
        seq: &SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        ranks: usize,
        split: CpSplit,
        timeout: Duration,
        experts: Option<&dyn RoutedExperts>,
    ) -> Result<CpPrefill, ModelError> {
        if ranks == 0 {
            return Err(ModelError::Unsupported {
                what: "a context-parallel group of 0 ranks".to_string(),
            });
        }
        let exchange = Exchange::new(ranks, timeout);
        type RankResult = Result<(Vec<f32>, SequenceState, Duration), ModelError>;
        let results: Vec<RankResult> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..ranks)
                .map(|rank| {
                    let exchange = &exchange;
                    let mut state = seq.clone();
                    scope.spawn(move || {
                        let started = Instant::now();
                        let cp = CpRank::new(rank, seq.len, tokens.len(), split, exchange);
                        let options = StepOptions {
                            experts,
                            family: StepExtras {
                                cp: Some(&cp),
                                ..StepExtras::default()
                            },
                            ..StepOptions::default()
                        };
                        let mut entry = [StepEntry::new(&mut state, tokens, want)];
                        let result = self
                            .forward_step(&mut entry, options)
                            .and_then(EntryOutput::one_entry_logits);
                        if let Err(err) = &result {
                            exchange.abort(rank, &err.to_string());
                        }
                        let busy = started.elapsed().saturating_sub(cp.waited.get());
                        result.map(|logits| (logits, state, busy))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(ModelError::Sequence {
                            message: "a context-parallel rank panicked".to_string(),
                        })
                    })
                })
                .collect()
        });
        let vocab = self.cfg.vocab_size;
        let mut by_offset: Vec<Option<Vec<f32>>> = vec![None; tokens.len()];
        let (mut states, mut busy) = (Vec::with_capacity(ranks), Vec::with_capacity(ranks));
        for (rank, result) in results.into_iter().enumerate() {
            let (logits, state, time) = result?;
            busy.push(time);
            let owned = rank_rows(tokens.len(), ranks, rank, split);
            let wanted: Vec<usize> = match want {
                LogitsWanted::All => owned,
                LogitsWanted::Last => owned
                    .into_iter()
                    .filter(|&o| o + 1 == tokens.len())
                    .collect(),
            };
            for (row, offset) in logits.chunks(vocab).zip(wanted) {
                by_offset[offset] = Some(row.to_vec());
            }
            states.push(state);
        }
        Ok(CpPrefill {
            logits: by_offset.into_iter().flatten().flatten().collect(),
            states,
            busy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_pairs_an_early_and_a_late_piece_and_covers_every_token_once() {
        assert_eq!(rank_rows(8, 2, 0, CpSplit::Mirror), vec![0, 1, 6, 7]);
        assert_eq!(rank_rows(8, 2, 1, CpSplit::Mirror), vec![2, 3, 4, 5]);
        assert_eq!(rank_rows(8, 2, 1, CpSplit::Contiguous), vec![4, 5, 6, 7]);
        for split in [CpSplit::Mirror, CpSplit::Contiguous] {
            for (len, ranks) in [(1003, 4), (5, 4), (64, 3)] {
                let mut all: Vec<usize> = (0..ranks)
                    .flat_map(|r| rank_rows(len, ranks, r, split))
                    .collect();
                all.sort_unstable();
                assert_eq!(all, (0..len).collect::<Vec<_>>(), "{split:?} {len}/{ranks}");
            }
        }
    }
}
