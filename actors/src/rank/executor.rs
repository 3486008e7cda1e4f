//! The execution boundary: `RankExecutor`, the synchronous interface the rank thread drives.
//!
//! Owns nothing but the contract. An executor holds the per-sequence model state of one DP rank
//! and runs one step: for each entry, append the entry's tokens to that sequence and return the
//! last row of logits. Sampling, the diff protocol and pipelining live above it in
//! `rank::worker`, so a backend only does the math. It runs on the rank's own OS thread, never
//! inside an async task.
//!
//! A step is one call, `execute`: every entry's tokens appended to its sequence; an entry with
//! sampling parameters comes back as sampled token ids (on the executor's device), the others as
//! their logits rows (the last, or every row of a DSpark verify, `all_rows`) — left where they
//! were computed on a device (`EntryOutput::DeviceLogits`), to be sampled by `sample_logits`
//! once their grammar masks are known, so a constrained decode step copies only the ids to the
//! host. Executors without a device return host rows and sample on the host ([`sample_on_host`]).
//! `draft` proposes the next tokens of a step's sequences with the executor's drafter (the
//! checkpoint's DSpark heads), if it has one.
//!
//! A wrapper that changes some calls of an executor (observing rows, counting, emulating a
//! device) is an [`ExecutorLayer`]: it writes only what it changes, [`Layered`] forwards the rest.

use std::sync::Arc;
use std::time::Duration;

use deepinfer_model::backend::LogprobPick;
use deepinfer_model::sampling::sample_allowed;
use deepinfer_model::{EntryOutput, LogitsRow};
use deepinfer_topology::RequestId;

use crate::prefix_cache::{BlockHash, PrefixGeometry};
use crate::rank::memory::StateMemory;
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

/// One step of [`RankExecutor::execute`]: the entries `batch` (distinct sequences) and, per
/// entry, its sampling (`None`: its logits are returned); `sampling` may be empty (no entry
/// sampled).
#[derive(Debug, Clone, Copy)]
pub struct ExecStep<'a> {
    pub batch: &'a [SeqTokens<'a>],
    pub sampling: &'a [Option<SamplingParams>],
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
    /// Append each entry's tokens to its sequence, as one step; returns per entry and in order:
    /// with `sampling[i] = Some(params)`, its rows sampled ([`EntryOutput::Tokens`]: the row of
    /// the token at position `p` gives the token at `p + 1`, sampled as `sampling::sample` with
    /// that position as the noise counter); otherwise its last logits row (`vocab_size` wide),
    /// or for an `all_rows` entry every row concatenated, as [`EntryOutput::Logits`] or, on a
    /// device, [`EntryOutput::DeviceLogits`] (for [`RankExecutor::sample_logits`]). Entries
    /// name distinct sequences.
    fn execute(&mut self, step: ExecStep<'_>) -> Result<Vec<EntryOutput>, ExecError>;
    /// One token per row of [`EntryOutput::DeviceLogits`] rows, each sampled with its parameters
    /// at its position after its mask set the disallowed logits to −∞
    /// (`sampling::sample_allowed` is the definition); a device executor samples them all in one
    /// op and copies only the ids. The caller checks the masks first (a mask that allows nothing
    /// fails the whole call). The default reads the rows on the host and samples them there.
    fn sample_logits(&mut self, rows: &[LogitsRow<'_>]) -> Result<Vec<u32>, ExecError> {
        sample_logits_on_host(rows)
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
        logprobs_on_host(rows, picks)
    }
    /// Proposes, for every `(sequence, anchor)` of a step, the tokens after `anchor`, the token
    /// just sampled for that sequence (it will sit at position `sequence_len(id)`): one result
    /// per request in order, `None` when the executor has no drafter (the default); the first
    /// failing request fails the call.
    fn draft(&mut self, requests: &[(RequestId, u32)]) -> Result<Vec<Option<Draft>>, ExecError> {
        Ok(vec![None; requests.len()])
    }
    /// Decoder bounded replay for sequence `id`: from now on its prefill runs the decoder layers
    /// only on positions `>= decoder_from` (`StepEntry::decoder_from`). Executors without bounded
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
    /// Prefix cache: the step about to run completes sequence `id`'s block at `start`, which
    /// [`RankExecutor::store_prefix_block`] takes after the step: keep through the step what it
    /// takes (a V4 sequence's ring rows, `v4::SequenceState::hold_block_rows`). The default keeps
    /// nothing (a V4.1 block is append-only caches).
    fn prepare_prefix_store(&mut self, _id: RequestId, _start: usize) -> Result<(), ExecError> {
        Ok(())
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
    /// Where this rank's sequence states live, read now (`[memory] state_memory_fraction` is a
    /// share of it): a device executor makes its weights resident first (a device backend
    /// uploads each weight on first use), then reads its device's free memory. Sent to every
    /// rank at once, once all are built and before any plan, so the ranks sharing a device all
    /// loaded theirs by the last reading and EP ranks' steps pair up. The default: the host's
    /// memory (the engine reads it).
    fn state_memory(&mut self) -> Result<StateMemory, ExecError> {
        Ok(StateMemory::Host)
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
    /// Ranks whose MoE layers are collectives (`experts::lockstep`): runs the idle steps the
    /// peers have begun and this rank has not, and returns how soon to look again while the rank
    /// has nothing to run (`None`: this executor never follows peers).
    fn follow_peers(&mut self) -> Result<Option<Duration>, ExecError> {
        Ok(None)
    }
}

/// [`RankExecutor::sample_logits`] on the host: each row read and sampled there.
pub fn sample_logits_on_host(rows: &[LogitsRow<'_>]) -> Result<Vec<u32>, ExecError> {
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            sample_allowed(row.logits, &row.params, row.position, row.allowed)
                .map_err(|e| ExecError::Backend(format!("sampling row {i}: {e}")))
        })
        .collect()
}

/// [`RankExecutor::logprobs_logits`] on the host: each row read there.
pub fn logprobs_on_host(
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

/// Every entry's logits rows on the host: one [`RankExecutor::execute`] that samples nothing,
/// device rows read back.
pub fn execute_rows(
    executor: &mut dyn RankExecutor,
    batch: &[SeqTokens<'_>],
) -> Result<Vec<Vec<f32>>, ExecError> {
    executor
        .execute(ExecStep {
            batch,
            sampling: &[],
        })?
        .into_iter()
        .zip(batch)
        .map(|(output, entry)| {
            output.into_logits().ok_or_else(|| ExecError::Sequence {
                id: entry.id,
                message: "the step sampled an entry that asked for logits".to_string(),
            })
        })
        .collect()
}

/// The outputs of a step whose logits `rows` (per entry, as [`RankExecutor::execute`] orders
/// them) were computed on the host: entry `i` with `sampling[i]` sampled here, exactly as a
/// device samples in its step; `held[i]` is the entry's sequence length before the step.
pub fn sample_on_host(
    batch: &[SeqTokens<'_>],
    sampling: &[Option<SamplingParams>],
    held: &[usize],
    rows: Vec<Vec<f32>>,
    vocab: usize,
) -> Result<Vec<EntryOutput>, ExecError> {
    rows.into_iter()
        .zip(batch)
        .zip(held)
        .enumerate()
        .map(|(i, ((rows, entry), &held))| {
            let Some(params) = sampling.get(i).copied().flatten() else {
                return Ok(EntryOutput::Logits(rows));
            };
            // The position of the token of the first returned row.
            let first = if entry.all_rows {
                held
            } else {
                held + entry.tokens.len().saturating_sub(1)
            };
            rows.chunks_exact(vocab.max(1))
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

/// What a wrapper changes of the executor it wraps (a middleware); [`Layered`] runs it. Every
/// hook gets the wrapped executor and defaults to passing the call through, so a layer writes
/// only what it changes. The calls without a hook always pass through.
pub trait ExecutorLayer: Send {
    fn new_sequence(
        &mut self,
        inner: &mut dyn RankExecutor,
        id: RequestId,
    ) -> Result<(), ExecError> {
        inner.new_sequence(id)
    }
    fn free_sequence(&mut self, inner: &mut dyn RankExecutor, id: RequestId) {
        inner.free_sequence(id)
    }
    fn rollback(
        &mut self,
        inner: &mut dyn RankExecutor,
        id: RequestId,
        len: usize,
    ) -> Result<(), ExecError> {
        inner.rollback(id, len)
    }
    fn execute(
        &mut self,
        inner: &mut dyn RankExecutor,
        step: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        inner.execute(step)
    }
    fn sample_logits(
        &mut self,
        inner: &mut dyn RankExecutor,
        rows: &[LogitsRow<'_>],
    ) -> Result<Vec<u32>, ExecError> {
        inner.sample_logits(rows)
    }
    fn draft(
        &mut self,
        inner: &mut dyn RankExecutor,
        requests: &[(RequestId, u32)],
    ) -> Result<Vec<Option<Draft>>, ExecError> {
        inner.draft(requests)
    }
    fn plan_replay(
        &mut self,
        inner: &mut dyn RankExecutor,
        id: RequestId,
        decoder_from: usize,
    ) -> Result<(), ExecError> {
        inner.plan_replay(id, decoder_from)
    }
    fn state_memory(&mut self, inner: &mut dyn RankExecutor) -> Result<StateMemory, ExecError> {
        inner.state_memory()
    }
    fn device_latency(&self, inner: &dyn RankExecutor, batch_tokens: usize) -> Duration {
        inner.device_latency(batch_tokens)
    }
    /// Runs when the layered executor is dropped, before the wrapped one is.
    fn finish(&mut self, _inner: &mut dyn RankExecutor) {}
}

/// An executor with a layer over it: the layer's hooks, every other call passed through.
pub struct Layered<L: ExecutorLayer> {
    pub inner: Box<dyn RankExecutor>,
    pub layer: L,
}

impl<L: ExecutorLayer> Layered<L> {
    pub fn new(inner: Box<dyn RankExecutor>, layer: L) -> Self {
        Layered { inner, layer }
    }
}

impl<L: ExecutorLayer> Drop for Layered<L> {
    fn drop(&mut self) {
        self.layer.finish(self.inner.as_mut());
    }
}

impl<L: ExecutorLayer> RankExecutor for Layered<L> {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        self.layer.new_sequence(self.inner.as_mut(), id)
    }
    fn free_sequence(&mut self, id: RequestId) {
        self.layer.free_sequence(self.inner.as_mut(), id)
    }
    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError> {
        self.layer.rollback(self.inner.as_mut(), id, len)
    }
    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.inner.sequence_len(id)
    }
    fn live_sequences(&self) -> usize {
        self.inner.live_sequences()
    }
    fn execute(&mut self, step: ExecStep<'_>) -> Result<Vec<EntryOutput>, ExecError> {
        self.layer.execute(self.inner.as_mut(), step)
    }
    fn sample_logits(&mut self, rows: &[LogitsRow<'_>]) -> Result<Vec<u32>, ExecError> {
        self.layer.sample_logits(self.inner.as_mut(), rows)
    }
    fn logprobs_logits(
        &mut self,
        rows: &[LogitsRow<'_>],
        picks: &[LogprobPick],
    ) -> Result<Vec<TokenLogprobs>, ExecError> {
        self.inner.logprobs_logits(rows, picks)
    }
    fn draft(&mut self, requests: &[(RequestId, u32)]) -> Result<Vec<Option<Draft>>, ExecError> {
        self.layer.draft(self.inner.as_mut(), requests)
    }
    fn plan_replay(&mut self, id: RequestId, decoder_from: usize) -> Result<(), ExecError> {
        self.layer
            .plan_replay(self.inner.as_mut(), id, decoder_from)
    }
    fn attach_prefix(
        &mut self,
        id: RequestId,
        blocks: &[BlockHash],
        replay_from: usize,
    ) -> Result<(), ExecError> {
        self.inner.attach_prefix(id, blocks, replay_from)
    }
    fn prepare_prefix_store(&mut self, id: RequestId, start: usize) -> Result<(), ExecError> {
        self.inner.prepare_prefix_store(id, start)
    }
    fn store_prefix_block(
        &mut self,
        id: RequestId,
        hash: BlockHash,
        start: usize,
    ) -> Result<(), ExecError> {
        self.inner.store_prefix_block(id, hash, start)
    }
    fn drop_prefix_block(&mut self, hash: BlockHash) {
        self.inner.drop_prefix_block(hash)
    }
    fn state_bytes_held(&self) -> Option<u64> {
        self.inner.state_bytes_held()
    }
    fn state_memory(&mut self) -> Result<StateMemory, ExecError> {
        self.layer.state_memory(self.inner.as_mut())
    }
    fn device_latency(&self, batch_tokens: usize) -> Duration {
        self.layer.device_latency(self.inner.as_ref(), batch_tokens)
    }
    fn modelled_step_time(&self, batch_tokens: usize) -> Option<Duration> {
        self.inner.modelled_step_time(batch_tokens)
    }
    fn follow_peers(&mut self) -> Result<Option<Duration>, ExecError> {
        self.inner.follow_peers()
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
    /// The group its executors' device EP ranks step and swap placements through (expert
    /// parallelism on CUDA), for its step log and EPLB status.
    fn device_experts(&self) -> Option<Arc<crate::experts::device::DeviceExperts>> {
        None
    }
    /// The context parallelism its executors run (the engine refuses a topology that asks for
    /// another: `[parallel] context_parallel` is never accepted and ignored).
    fn context_parallel(&self) -> Option<deepinfer_topology::ContextParallel> {
        None
    }
}

/// Builds a layer for the executor of one DP rank.
pub type MakeLayer<L> = Arc<dyn Fn(usize) -> L + Send + Sync>;

/// A factory whose executors are the inner factory's, each with a layer over it ([`Layered`]);
/// every fact of the inner factory (window, family, state bytes, parallelism) passes through.
pub struct LayeredFactory<L: ExecutorLayer> {
    inner: Arc<dyn ExecutorFactory>,
    /// What the layer does, for the startup log ("observed", "measured" ...).
    what: String,
    layer: MakeLayer<L>,
}

impl<L: ExecutorLayer> LayeredFactory<L> {
    /// The executors of `inner`, each with the layer `layer(dp)` over it.
    pub fn layered(
        inner: Arc<dyn ExecutorFactory>,
        what: impl Into<String>,
        layer: impl Fn(usize) -> L + Send + Sync + 'static,
    ) -> Self {
        LayeredFactory {
            inner,
            what: what.into(),
            layer: Arc::new(layer),
        }
    }
}

impl<L: ExecutorLayer + 'static> ExecutorFactory for LayeredFactory<L> {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        Ok(Box::new(Layered::new(
            self.inner.build(dp)?,
            (self.layer)(dp),
        )))
    }
    fn describe(&self) -> String {
        format!("{} {}", self.what, self.inner.describe())
    }
    fn sliding_window(&self) -> Option<usize> {
        self.inner.sliding_window()
    }
    fn family(&self) -> deepinfer_model::config::ModelFamily {
        self.inner.family()
    }
    fn state_bytes(&self) -> Option<deepinfer_model::state_bytes::StateBytes> {
        self.inner.state_bytes()
    }
    fn prefix_geometry(&self) -> Option<PrefixGeometry> {
        self.inner.prefix_geometry()
    }
    fn expert_parallel(&self) -> Option<Arc<crate::experts::parallel::ExpertParallel>> {
        self.inner.expert_parallel()
    }
    fn device_experts(&self) -> Option<Arc<crate::experts::device::DeviceExperts>> {
        self.inner.device_experts()
    }
    fn context_parallel(&self) -> Option<deepinfer_topology::ContextParallel> {
        self.inner.context_parallel()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank::fake::{FakeConfig, FakeDrafter, FakeExecutor};

    /// Counts the sequences freed and drafts nothing; hooks nothing else.
    struct Counting {
        freed: usize,
    }

    impl ExecutorLayer for Counting {
        fn free_sequence(&mut self, inner: &mut dyn RankExecutor, id: RequestId) {
            self.freed += 1;
            inner.free_sequence(id)
        }
        fn draft(
            &mut self,
            _inner: &mut dyn RankExecutor,
            requests: &[(RequestId, u32)],
        ) -> Result<Vec<Option<Draft>>, ExecError> {
            Ok(vec![None; requests.len()])
        }
    }

    fn fake() -> FakeExecutor {
        let config = FakeConfig {
            vocab_size: 64,
            drafter: Some(FakeDrafter {
                block_size: 3,
                correct: 1,
                confidence: 1.5,
            }),
            device_time: Duration::from_millis(7),
            ..FakeConfig::default()
        };
        FakeExecutor::new(config, 0)
    }

    /// A layer changes what it hooks and nothing else: the layered executor's rows, lengths,
    /// rollbacks and device latency are the bare executor's, its drafts are the layer's (none).
    #[test]
    fn a_layer_changes_only_what_it_hooks() {
        let mut bare = fake();
        let mut layered = Layered::new(Box::new(fake()), Counting { freed: 0 });
        let id = RequestId(4);
        let prompt = [SeqTokens {
            id,
            tokens: &[5, 9, 11],
            all_rows: true,
        }];
        let mut rows = Vec::new();
        for executor in [&mut bare as &mut dyn RankExecutor, &mut layered] {
            executor.new_sequence(id).expect("new");
            rows.push(execute_rows(executor, &prompt).expect("step"));
            executor.rollback(id, 2).expect("rollback");
        }
        assert_eq!(rows[0], rows[1]);
        assert_eq!(layered.sequence_len(id), Ok(2));
        assert_eq!(layered.device_latency(8), bare.device_latency(8));
        let plain = bare.draft(&[(id, 3)]).expect("drafts");
        assert_eq!(plain[0].as_ref().map(|d| d.tokens.len()), Some(3));
        assert_eq!(layered.draft(&[(id, 3)]), Ok(vec![None]));
        layered.free_sequence(id);
        assert_eq!((layered.live_sequences(), layered.layer.freed), (0, 1));
    }

    /// Host sampling samples each wanted row at the position after its token: the last row of
    /// a plain entry at `held + tokens`, every row of a verify entry from `held + 1` on.
    #[test]
    fn host_sampling_counts_positions_from_the_sequence_length() {
        // Nearly flat rows: the token drawn depends on the noise, so on the position.
        let vocab = 64;
        let row = |tilt: f32| -> Vec<f32> { (0..vocab).map(|t| t as f32 * tilt).collect() };
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 5,
        };
        let batch = [
            SeqTokens {
                id: RequestId(1),
                tokens: &[1, 2],
                all_rows: false,
            },
            SeqTokens {
                id: RequestId(2),
                tokens: &[3, 4],
                all_rows: true,
            },
        ];
        let rows = vec![row(0.01), [row(0.02), row(0.03)].concat()];
        let got = sample_on_host(
            &batch,
            &[Some(params), Some(params)],
            &[10, 20],
            rows.clone(),
            vocab,
        )
        .expect("sampled");
        let expected = [
            vec![sample(&rows[0], &params, 12).expect("a token")],
            vec![
                sample(&rows[1][..vocab], &params, 21).expect("a token"),
                sample(&rows[1][vocab..], &params, 22).expect("a token"),
            ],
        ];
        assert_eq!(got[0], EntryOutput::Tokens(expected[0].clone()));
        assert_eq!(got[1], EntryOutput::Tokens(expected[1].clone()));
        let unsampled =
            sample_on_host(&batch, &[None, None], &[10, 20], rows.clone(), vocab).expect("logits");
        assert_eq!(unsampled[1], EntryOutput::Logits(rows[1].clone()));
    }
}
