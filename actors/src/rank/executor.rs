//! The execution boundary: `RankExecutor`, the synchronous interface the rank thread drives.
//!
//! Owns nothing but the contract. An executor holds the per-sequence model state of one DP rank
//! and runs one step: for each entry, append the entry's tokens to that sequence and return the
//! last row of logits. Sampling, the diff protocol and pipelining live above it in
//! `rank::worker`, so a backend only does the math. It runs on the rank's own OS thread, never
//! inside an async task.
//!
//! Speculative decoding (DSpark) adds two things: an entry may ask for every row of its tokens
//! (`all_rows`, a verify of anchor + drafts), and `draft` proposes the next tokens of a sequence
//! with the executor's drafter (the checkpoint's DSpark heads), if it has one (`draft_many` for
//! all of a step's sequences at once).
//!
//! Structured outputs add a deferred sampling: `execute_deferred` leaves the rows of the entries
//! it does not sample where they were computed (`EntryOutput::DeviceLogits`), and
//! `sample_logits` samples them once their grammar masks are known, so a constrained decode
//! step copies only the ids to the host. Executors without a device keep the defaults: host
//! logits, masked and sampled by the worker.

use std::time::Duration;

use deepinfer_model::backend::LogprobPick;
use deepinfer_model::sampling::sample_allowed;
use deepinfer_model::{EntryOutput, LogitsRow};
use deepinfer_topology::RequestId;

use crate::prefix_cache::{BlockHash, PrefixGeometry};
use crate::sampling::{SamplingParams, TokenLogprobs, sample, token_logprobs};

/// The error of an executor that keeps no prefix blocks.
fn no_prefix_blocks(id: RequestId) -> ExecError {
    ExecError::Sequence {
        id,
        message: "this executor keeps no prefix-cache blocks".into(),
    }
}

/// A backend failure, reported to the scheduler as `RankError::Backend`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    #[error("unknown sequence {0}")]
    UnknownSequence(RequestId),
    #[error("sequence {0} already exists")]
    DuplicateSequence(RequestId),
    #[error("sequence {id}: {message}")]
    Sequence { id: RequestId, message: String },
    #[error("{0}")]
    Backend(String),
}

/// One sequence's tokens in a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqTokens<'a> {
    pub id: RequestId,
    pub tokens: &'a [u32],
    /// Return a logits row for every token (a DSpark verify), not only the last.
    pub all_rows: bool,
}

/// A drafter's proposal for the tokens after a sequence's anchor (owned data).
#[derive(Debug, Clone, PartialEq)]
pub struct Draft {
    /// The drafted tokens, for the positions after the anchor (the anchor excluded).
    pub tokens: Vec<u32>,
    /// Raw confidence per drafted token (the confidence head's logit, before the sigmoid).
    pub confidences: Vec<f32>,
}

/// Per-rank model execution. Synchronous; one instance per rank thread.
pub trait RankExecutor: Send {
    /// Width of a logits row.
    fn vocab_size(&self) -> usize;
    /// Create the (empty) state of a sequence.
    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError>;
    /// Drop a sequence's state; unknown ids are ignored.
    fn free_sequence(&mut self, id: RequestId);
    /// Keep only the first `len` tokens of a sequence (after a partially accepted verify).
    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError>;
    /// Tokens held by a sequence.
    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError>;
    /// Sequences currently held.
    fn live_sequences(&self) -> usize;
    /// Append each entry's tokens to its sequence; returns, per entry and in order, its last
    /// logits row (`vocab_size` wide), or for an `all_rows` entry every row concatenated
    /// (`tokens.len() * vocab_size`). Entries name distinct sequences.
    fn execute(&mut self, batch: &[SeqTokens<'_>]) -> Result<Vec<Vec<f32>>, ExecError>;
    /// [`RankExecutor::execute`] where entry `i` with `sampling[i] = Some(params)` gets its rows
    /// sampled by the executor and returns token ids ([`EntryOutput::Tokens`]): the row of the
    /// token at position `p` gives the token at `p + 1`, sampled as `sampling::sample` with that
    /// position as the noise counter. An executor on a device samples there, so those logits
    /// never reach the host. Other entries return their logits rows ([`EntryOutput::Logits`]).
    /// The default runs `execute` and samples on the host (the same math).
    fn execute_sampled(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        let held = batch
            .iter()
            .map(|entry| self.sequence_len(entry.id))
            .collect::<Result<Vec<_>, _>>()?;
        let rows = self.execute(batch)?;
        let vocab = self.vocab_size().max(1);
        rows.into_iter()
            .zip(batch)
            .zip(held)
            .enumerate()
            .map(|(i, ((rows, entry), held))| {
                let Some(params) = sampling.get(i).copied().flatten() else {
                    return Ok(EntryOutput::Logits(rows));
                };
                // The position of the token of the first returned row.
                let first = if entry.all_rows {
                    held
                } else {
                    held + entry.tokens.len().saturating_sub(1)
                };
                rows.chunks_exact(vocab)
                    .enumerate()
                    .map(|(r, row)| {
                        sample(row, &params, (first + r + 1) as u64).ok_or_else(|| {
                            ExecError::Backend(format!("empty logits row for {}", entry.id))
                        })
                    })
                    .collect::<Result<Vec<u32>, _>>()
                    .map(EntryOutput::Tokens)
            })
            .collect()
    }
    /// [`RankExecutor::execute_sampled`] where every entry without sampling parameters may
    /// return its rows where they were computed ([`EntryOutput::DeviceLogits`], not read on the
    /// host), to be sampled by [`RankExecutor::sample_logits`] once the grammar masks are in.
    /// The default is `execute_sampled`: host logits ([`EntryOutput::Logits`]), masked and
    /// sampled by the worker (the fallback of executors without a device).
    fn execute_deferred(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        self.execute_sampled(batch, sampling)
    }
    /// One token per row of [`EntryOutput::DeviceLogits`] rows, each sampled with its parameters
    /// at its position after its mask set the disallowed logits to −∞
    /// (`sampling::sample_allowed` is the definition); a device executor samples them all in one
    /// op and copies only the ids. The caller checks the masks first (a mask that allows nothing
    /// fails the whole call). The default reads the rows on the host and samples them there.
    fn sample_logits(&mut self, rows: &[LogitsRow<'_>]) -> Result<Vec<u32>, ExecError> {
        rows.iter()
            .enumerate()
            .map(|(i, row)| {
                sample_allowed(row.logits, &row.params, row.position, row.allowed)
                    .map_err(|e| ExecError::Backend(format!("sampling row {i}: {e}")))
            })
            .collect()
    }
    /// The log-probabilities of `picks[i].token`, sampled from row `i` of `rows` (after its
    /// mask; `sampling::token_logprobs` is the definition), with `picks[i].top` alternatives: a
    /// device executor computes them all in one op where the rows are and copies back only the
    /// results. The default reads the rows on the host.
    fn logprobs_logits(
        &mut self,
        rows: &[LogitsRow<'_>],
        picks: &[LogprobPick],
    ) -> Result<Vec<TokenLogprobs>, ExecError> {
        rows.iter()
            .zip(picks)
            .enumerate()
            .map(|(i, (row, pick))| {
                token_logprobs(row.logits, row.allowed, pick.token, pick.top)
                    .map_err(|e| ExecError::Backend(format!("log-probabilities of row {i}: {e}")))
            })
            .collect()
    }
    /// Proposes the tokens after `anchor`, the token just sampled for sequence `id` (it will
    /// sit at position `sequence_len(id)`). `None` when the executor has no drafter.
    fn draft(&mut self, _id: RequestId, _anchor: u32) -> Result<Option<Draft>, ExecError> {
        Ok(None)
    }
    /// [`RankExecutor::draft`] for every `(sequence, anchor)` of a step at once, one result per
    /// request in order (`None` without a drafter); the first failing request fails the call.
    /// The default drafts one request after another; a device executor drafts them all in one
    /// pass.
    fn draft_many(
        &mut self,
        requests: &[(RequestId, u32)],
    ) -> Result<Vec<Option<Draft>>, ExecError> {
        requests
            .iter()
            .map(|&(id, anchor)| self.draft(id, anchor))
            .collect()
    }
    /// Decoder bounded replay for sequence `id`: from now on its prefill runs the decoder layers
    /// only on positions `>= decoder_from` (`Model::forward_replay`). Executors without bounded
    /// replay ignore it and run the full prefill (exact).
    fn plan_replay(&mut self, _id: RequestId, _decoder_from: usize) -> Result<(), ExecError> {
        Ok(())
    }
    /// Prefix cache: attaches the cached `blocks` (from position 0) to the new, empty sequence
    /// `id`, whose prefill then continues at `replay_from` (`SequenceState::attach_prefix`).
    /// Executors without prefix blocks refuse (the engine only turns the cache on when its
    /// factory has a [`ExecutorFactory::prefix_geometry`]).
    fn attach_prefix(
        &mut self,
        id: RequestId,
        _blocks: &[BlockHash],
        _replay_from: usize,
    ) -> Result<(), ExecError> {
        Err(no_prefix_blocks(id))
    }
    /// Prefix cache: keeps sequence `id`'s block of positions `[start, start + block tokens)`
    /// as `hash` (`SequenceState::prefix_block`).
    fn store_prefix_block(
        &mut self,
        id: RequestId,
        _hash: BlockHash,
        _start: usize,
    ) -> Result<(), ExecError> {
        Err(no_prefix_blocks(id))
    }
    /// Prefix cache: drops a kept block (unknown hashes are ignored).
    fn drop_prefix_block(&mut self, _hash: BlockHash) {}
    /// Bytes the live sequences' states hold now (`SequenceState::held_bytes`); `None` for an
    /// executor without model state.
    fn state_bytes_held(&self) -> Option<u64> {
        None
    }
    /// Time the device still needs after `execute` returned before the step's results exist
    /// (an asynchronous device queue). Zero for the CPU backend, whose work is done on return.
    fn device_latency(&self, _batch_tokens: usize) -> Duration {
        Duration::ZERO
    }
    /// A simulated device's modelled time (virtual) for a verify-shaped step of `batch_tokens`
    /// tokens; DSpark's step-rate profile takes it instead of timing steps. `None` (real
    /// devices): time them.
    fn modelled_step_time(&self, _batch_tokens: usize) -> Option<Duration> {
        None
    }
}

/// Builds one executor per rank, on that rank's thread (a model load happens there, never on
/// an async worker).
pub trait ExecutorFactory: Send + Sync {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError>;
    /// What it runs, for the startup log.
    fn describe(&self) -> String;
    /// The served model's sliding window (tokens), when its executors run bounded replay (the
    /// engine then validates `[replay]` against it and spawns the `ReplayActor`).
    fn sliding_window(&self) -> Option<usize> {
        None
    }
    /// The family of the served model (the engine picks the chat encoding by it).
    fn family(&self) -> deepinfer_model::config::ModelFamily {
        deepinfer_model::config::ModelFamily::V41
    }
    /// The byte model of its executors' sequence states, when they hold real ones (the engine
    /// then accounts each rank's states in a `StatePool`); `None` = unaccounted.
    fn state_bytes(&self) -> Option<deepinfer_model::state_bytes::StateBytes> {
        None
    }
    /// What a prefix cache needs of the served model, when its executors keep prefix blocks
    /// (the engine refuses `[prefix_cache]` otherwise).
    fn prefix_geometry(&self) -> Option<PrefixGeometry> {
        None
    }
    /// The expert-parallel state its executors share, when they run expert parallelism (the
    /// supervisor then spawns the expert groups and the EPLB over it).
    fn expert_parallel(&self) -> Option<std::sync::Arc<crate::experts::parallel::ExpertParallel>> {
        None
    }
    /// The context parallelism its executors run (the engine refuses a topology that asks for
    /// another: `[parallel] context_parallel` is never accepted and ignored).
    fn context_parallel(&self) -> Option<deepinfer_topology::ContextParallel> {
        None
    }
}
