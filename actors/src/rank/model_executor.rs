//! `ModelExecutor`: the `RankExecutor` over the real model of either family
//! (`deepinfer_model::any_model::AnyModel`: V4.1, or V4-Flash / V4-Flash-0731).
//!
//! Owns one sequence state per live request. A step is one `AnyModel::forward_step` over every
//! entry (each sequence's last logits row, or every row of a DSpark verify entry, `all_rows`),
//! bitwise what each sequence would get alone; the model is shared (read-only) by every rank of
//! the process. The runtime adds nothing to the numbers: the logits are exactly the model's.
//! Entries with sampling parameters are sampled inside the step on the model's backend; the
//! others' rows stay there (V4.1, `Model::forward_step` with `StepOptions::logits_on_device`) and `sample_logits` is
//! `Model::sample_rows` (the masked rows sampled where they are, only the ids come back); a V4
//! model returns host rows, sampled on the host. `draft` runs the checkpoint's DSpark heads over
//! every requested sequence (`AnyModel::draft_step`) when the model has them (V4-Flash's MTP
//! block has no confidence head and does not draft here). A sequence with a planned decoder
//! start (`plan_replay`, V4.1 decoder bounded replay) runs its prefill as
//! `Model::forward_step` does with `StepEntry::decoder_from`.
//! The prefix cache's blocks of this rank live here (`store_prefix_block`, `attach_prefix`,
//! `drop_prefix_block`, as the plans order them; the scheduler keeps the index): a V4.1
//! sequence's (caches, a hit replays) or a V4 sequence's (caches and ring rows, held through the
//! step that completes the block by `prepare_prefix_store`; a hit resumes at its end).
//! Context parallelism (`[parallel] context_parallel`, V4.1): a plain prefill chunk of at least
//! the threshold runs as `Model::prefill_context_parallel` over the CP group (the ranks are
//! threads on this rank's CPU backend, the window KV and compressor inputs all-gathered per
//! layer); this rank keeps the sequence's state, which is bitwise the one-rank prefill's, and
//! decodes it.
//!
//! Expert parallelism on CUDA (the model's backend is one EP rank, `backend::cuda::ep`): its MoE
//! layers are collectives of every EP rank, so each step begins one step of the group's
//! `Lockstep` through `DeviceExperts` (which swaps the rank's placement epoch there), and an
//! empty batch (an `Idle` plan) or an idle thread only follows the peers' steps with idle ones
//! (`ExpertHost::idle_expert_step`). On the CPU (`ExpertParallelFactory`) each step's routed
//! experts go through the committed `LocalComm` (`StepOptions::experts`), for either family.
//!
//! Built per rank by `rank::factory::ModelFactory` (or `ExpertParallelFactory`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_model::any_model::{AnyModel, AnySequence, AnyStepEntry, StepOptions};
use deepinfer_model::backend::LogprobPick;
use deepinfer_model::expert_dispatch::RoutedExperts;
use deepinfer_model::sampling::TokenLogprobs;
use deepinfer_model::state_bytes::StateBytes;
use deepinfer_model::v41::context_parallel::CpSplit;
use deepinfer_model::{EntryOutput, LogitsRow, LogitsWanted, PrefixBlock, v4};
use deepinfer_topology::{ContextParallel, DpRank, RequestId};

use crate::comm::{Comm, StepExperts};
use crate::experts::device::DeviceExperts;
use crate::experts::lockstep::FOLLOW_POLL;
use crate::experts::parallel::{ExpertParallel, StepRecord};

use crate::prefix_cache::BlockHash;
use crate::rank::executor::{
    Draft, ExecError, ExecStep, RankExecutor, SeqTokens, execute_rows, logprobs_on_host,
    sample_logits_on_host,
};
use crate::rank::memory::{DeviceMemory, StateMemory};
use crate::rank::sequences::{Sequences, sequence_error};
use crate::sampling::SamplingParams;

/// The executor of one rank over a shared model.
pub struct ModelExecutor {
    model: AnyModel,
    sequences: Sequences<AnySequence>,
    /// Decoder bounded replay: each planned sequence's decoder start.
    replay_from: HashMap<RequestId, usize>,
    /// Expert parallelism: the routed experts go through the committed `Comm` of each step.
    ep: Option<RankExperts>,
    /// Context parallelism of long prefill chunks.
    cp: Option<ContextParallel>,
    /// Expert parallelism on devices: the group's state and this rank's index in it.
    device: Option<(Arc<DeviceExperts>, usize)>,
    /// The prefix-cache blocks this rank keeps (the scheduler's index decides which).
    prefix_blocks: HashMap<BlockHash, KeptBlock>,
    /// The device the model's backend runs on and its free-memory reading (`None`: the host).
    memory: Option<DeviceMemory>,
}

/// The sequence [`RankExecutor::state_memory`] steps once to make the weights resident.
const WARM_UP: RequestId = RequestId(u64::MAX);

/// How long a CP rank waits for the others at one all-gather.
const CP_EXCHANGE_TIMEOUT: Duration = Duration::from_secs(300);

/// One rank's side of expert parallelism.
struct RankExperts {
    parallel: Arc<ExpertParallel>,
    dp: DpRank,
    steps: u64,
}

impl ModelExecutor {
    pub fn new(model: impl Into<AnyModel>) -> Self {
        ModelExecutor {
            model: model.into(),
            sequences: Sequences::default(),
            replay_from: HashMap::new(),
            ep: None,
            cp: None,
            device: None,
            prefix_blocks: HashMap::new(),
            memory: None,
        }
    }

    /// This executor's states on a device whose free memory `memory` reads (`None`: the host's
    /// memory, the CPU backend).
    pub fn with_device_memory(self, memory: Option<DeviceMemory>) -> Self {
        ModelExecutor { memory, ..self }
    }

    /// Puts the weights on the device: a device backend uploads each on first use, so one
    /// token through a scratch sequence reaches every layer (each MoE layer's expert table is
    /// uploaded whole, an EP rank's slots at its opening), then frees it. With device expert
    /// parallelism every rank runs this one step at once (`RankExecutor::state_memory`), so
    /// the collectives pair up.
    fn load_weights(&mut self) -> Result<(), ExecError> {
        self.new_sequence(WARM_UP)?;
        let token = self.model.config().bos_token_id;
        let entry = SeqTokens {
            id: WARM_UP,
            tokens: &[token],
            all_rows: false,
        };
        let stepped = execute_rows(self, &[entry]);
        self.free_sequence(WARM_UP);
        stepped.map(drop)
    }

    /// This executor as rank `rank` of a `DeviceExperts` group (its backend an EP rank whose
    /// MoE layers are collectives; `None`: off).
    pub fn with_device_experts(self, device: Option<(Arc<DeviceExperts>, usize)>) -> Self {
        ModelExecutor { device, ..self }
    }

    /// This executor with context parallelism of long prefill chunks (`None`: off).
    pub fn with_context_parallel(self, cp: Option<ContextParallel>) -> Self {
        ModelExecutor { cp, ..self }
    }

    /// Whether a step entry runs context-parallel: a plain prefill chunk (no replay, last row
    /// only) of at least the threshold.
    fn runs_context_parallel(&self, entry: &SeqTokens<'_>) -> bool {
        self.cp.is_some_and(|cp| {
            entry.tokens.len() >= cp.min_tokens as usize
                && !entry.all_rows
                && !self.replay_from.contains_key(&entry.id)
        })
    }

    /// An executor of DP rank `dp` whose routed experts run through `parallel`'s placement: each
    /// step adopts the committed epoch at its start and keeps it to its end.
    pub fn with_expert_parallel(
        model: impl Into<AnyModel>,
        parallel: Arc<ExpertParallel>,
        dp: DpRank,
    ) -> Self {
        ModelExecutor {
            ep: Some(RankExperts {
                parallel,
                dp,
                steps: 0,
            }),
            ..ModelExecutor::new(model)
        }
    }

    /// Runs the idle steps the device expert group's peers had begun, and this rank had not,
    /// when it looked: a peer that keeps leading is followed over several calls, so a plan of
    /// this rank's own that arrives meanwhile runs as its next step (pairing with the peer's)
    /// instead of waiting for the peer to go idle.
    fn follow_device_peers(&self) -> Result<Option<Duration>, ExecError> {
        let Some((device, rank)) = &self.device else {
            return Ok(None);
        };
        device
            .idle(*rank, self.model.backend())
            .map_err(|e| ExecError::Backend(format!("expert parallelism: {e}")))?;
        if !device.may_follow(*rank) {
            return Ok(Some(FOLLOW_POLL));
        }
        for _ in 0..device.lockstep().behind(*rank) {
            let (_, epoch) = begin_device_step(device, *rank, self.model.backend())?;
            self.model.experts().idle_expert_step();
            device
                .finish(*rank, epoch)
                .map_err(|e| ExecError::Backend(format!("expert parallelism: {e}")))?;
        }
        Ok(Some(FOLLOW_POLL))
    }
}

impl ModelExecutor {
    /// One `AnyModel::forward_step` over the batch (see [`RankExecutor::execute`]); the
    /// context-parallel entries run one by one over the CP group.
    fn step(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        if batch.is_empty() && self.device.is_some() {
            // Nothing of its own: the rank only follows the steps its peers began.
            self.follow_device_peers()?;
            return Ok(Vec::new());
        }
        let model = &self.model;
        let cp_ranks = self.cp.map_or(1, |cp| usize::from(cp.ranks));
        let in_cp: Vec<bool> = batch
            .iter()
            .map(|entry| self.runs_context_parallel(entry))
            .collect();
        let seqs = self
            .sequences
            .for_step(batch, |seq, tokens| model.check_chunk(seq, tokens))?;
        let device_step = match &self.device {
            Some((device, rank)) => Some(begin_device_step(device, *rank, model.backend())?),
            None => None,
        };
        // Expert parallelism: this step's placement epoch, read once at the step boundary.
        let comm = self.ep.as_ref().map(|ep| ep.parallel.current());
        let experts = match (&self.ep, comm.as_deref()) {
            (Some(ep), Some(comm)) => Some(StepExperts::new(comm, ep.dp, ep.steps)),
            _ => None,
        };
        // One forward over the whole step, entries in the batch's order.
        let mut entries = Vec::with_capacity(batch.len());
        for (i, (entry, seq)) in batch.iter().zip(seqs).enumerate() {
            entries.push(AnyStepEntry {
                seq,
                tokens: entry.tokens,
                want: if entry.all_rows {
                    LogitsWanted::All
                } else {
                    LogitsWanted::Last
                },
                decoder_from: self.replay_from.get(&entry.id).copied(),
                sample: sampling.get(i).copied().flatten(),
            });
        }
        let options = StepOptions {
            experts: experts.as_ref().map(|e| e as &dyn RoutedExperts),
            logits_on_device: true,
            family: (),
        };
        // Context-parallel entries run one by one over the CP group, the others as one step.
        let (cp_entries, mut entries): (Vec<_>, Vec<_>) = entries
            .into_iter()
            .enumerate()
            .partition(|(i, _)| in_cp[*i]);
        let mut outputs: Vec<Option<EntryOutput>> = (0..batch.len()).map(|_| None).collect();
        let cp_rows: Result<(), ExecError> = cp_entries.into_iter().try_for_each(|(i, entry)| {
            let output = prefill_context_parallel(model, cp_ranks, entry, options.experts);
            outputs[i] = Some(output?);
            Ok(())
        });
        let indices: Vec<usize> = entries.iter().map(|(i, _)| *i).collect();
        let mut step_entries: Vec<AnyStepEntry<'_>> = entries.drain(..).map(|(_, e)| e).collect();
        let rows = cp_rows.and_then(|()| {
            let rows = match step_entries.is_empty() {
                true => Vec::new(),
                false => model
                    .forward_step(&mut step_entries, options)
                    .map_err(|e| ExecError::Backend(e.to_string()))?,
            };
            for (i, row) in indices.into_iter().zip(rows) {
                outputs[i] = Some(row);
            }
            Ok(outputs.into_iter().flatten().collect())
        });
        // An exchange that failed left meaningless rows: the step fails (the supervisor's rule 3).
        let rows = match experts.as_ref().and_then(StepExperts::failure) {
            Some(failure) => Err(ExecError::Backend(format!("expert parallelism: {failure}"))),
            None => rows,
        };
        let rows = match (&self.device, device_step) {
            (Some((device, rank)), Some((_, epoch))) => match device.finish(*rank, epoch) {
                Ok(()) => rows,
                Err(e) => Err(ExecError::Backend(format!("expert parallelism: {e}"))),
            },
            _ => rows,
        };
        if let (Some(ep), Some(comm), Some(experts)) = (self.ep.as_mut(), &comm, &experts) {
            ep.parallel.finish_step(StepRecord {
                dp: ep.dp,
                rank_step: ep.steps,
                epoch: comm.epoch(),
                served: experts.epochs_seen(),
                tokens: batch.iter().map(|e| e.tokens.len()).sum(),
            });
            ep.steps += 1;
        }
        rows
    }
}

/// Rank `rank` begins a step of its device expert group on `backend` (`DeviceExperts::begin`).
fn begin_device_step(
    device: &DeviceExperts,
    rank: usize,
    backend: &dyn deepinfer_model::backend::Backend,
) -> Result<(u64, deepinfer_topology::PlacementEpoch), ExecError> {
    device
        .begin(rank, backend)
        .map_err(|e| ExecError::Backend(format!("expert parallelism: {e}")))
}

/// The prefix cache keeps V4.1 sequences only (the factory gives a V4 model no prefix geometry, so
/// the engine never turns the cache on for one).
/// A prefix-cache block of either family's sequences.
#[derive(Debug)]
enum KeptBlock {
    V41(PrefixBlock),
    V4(v4::PrefixBlock),
}

impl KeptBlock {
    fn v41(&self) -> Option<&PrefixBlock> {
        match self {
            KeptBlock::V41(block) => Some(block),
            KeptBlock::V4(_) => None,
        }
    }

    fn v4(&self) -> Option<&v4::PrefixBlock> {
        match self {
            KeptBlock::V4(block) => Some(block),
            KeptBlock::V41(_) => None,
        }
    }

    #[cfg(test)]
    fn held_bytes(&self) -> u64 {
        match self {
            KeptBlock::V41(block) => block.held_bytes(),
            KeptBlock::V4(block) => block.held_bytes(),
        }
    }
}

/// One prefill chunk over a CP group of `ranks` (V4.1); this rank keeps the state (every rank's
/// is the same). The unsampled row stays where it was computed.
fn prefill_context_parallel(
    model: &AnyModel,
    ranks: usize,
    entry: AnyStepEntry<'_>,
    experts: Option<&dyn RoutedExperts>,
) -> Result<EntryOutput, ExecError> {
    let backend = |e: deepinfer_model::error::ModelError| ExecError::Backend(e.to_string());
    let (AnyModel::V41(model), AnySequence::V41(seq)) = (model, entry.seq) else {
        return Err(ExecError::Backend(
            "context parallelism runs V4.1 models only".to_string(),
        ));
    };
    let prefill = model
        .prefill_context_parallel(
            seq,
            entry.tokens,
            LogitsWanted::Last,
            ranks,
            CpSplit::Mirror,
            CP_EXCHANGE_TIMEOUT,
            experts,
        )
        .map_err(backend)?;
    **seq = prefill.states.into_iter().next().ok_or_else(|| {
        ExecError::Backend("a context-parallel prefill without ranks".to_string())
    })?;
    let logits = deepinfer_model::backend::Tensor::from(prefill.logits);
    Ok(match entry.sample {
        Some(params) => EntryOutput::Tokens(
            model
                .sample_rows(&[LogitsRow {
                    logits: &logits,
                    params,
                    position: seq.len() as u64,
                    allowed: None,
                }])
                .map_err(backend)?,
        ),
        None => EntryOutput::DeviceLogits(logits),
    })
}

impl RankExecutor for ModelExecutor {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        self.sequences.open(id, || self.model.new_sequence())
    }

    fn free_sequence(&mut self, id: RequestId) {
        self.sequences.close(id);
        self.replay_from.remove(&id);
    }

    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError> {
        let seq = self.sequences.get_mut(id)?;
        self.model
            .rollback(seq, len)
            .map_err(|e| sequence_error(id, e))
    }

    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.sequences.get(id).map(AnySequence::len)
    }

    fn live_sequences(&self) -> usize {
        self.sequences.live()
    }

    fn state_bytes_held(&self) -> Option<u64> {
        Some(self.sequences.states().map(AnySequence::held_bytes).sum())
    }

    fn state_memory(&mut self) -> Result<StateMemory, ExecError> {
        let Some(DeviceMemory { device, probe }) = self.memory.clone() else {
            return Ok(StateMemory::Host);
        };
        self.load_weights()?;
        let free_bytes = probe.free_bytes().map_err(|e| {
            ExecError::Backend(format!("reading the free memory of device {device}: {e}"))
        })?;
        Ok(StateMemory::Device { device, free_bytes })
    }

    fn execute(
        &mut self,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        self.step(batch, sampling)
    }

    fn follow_peers(&mut self) -> Result<Option<Duration>, ExecError> {
        self.follow_device_peers()
    }

    fn sample_logits(&mut self, rows: &[LogitsRow<'_>]) -> Result<Vec<u32>, ExecError> {
        let AnyModel::V41(model) = &self.model else {
            return sample_logits_on_host(rows);
        };
        model
            .sample_rows(rows)
            .map_err(|e| ExecError::Backend(e.to_string()))
    }

    fn logprobs_logits(
        &mut self,
        rows: &[LogitsRow<'_>],
        picks: &[LogprobPick],
    ) -> Result<Vec<TokenLogprobs>, ExecError> {
        let AnyModel::V41(model) = &self.model else {
            return logprobs_on_host(rows, picks);
        };
        model
            .token_logprobs_rows(rows, picks)
            .map_err(|e| ExecError::Backend(e.to_string()))
    }

    fn plan_replay(&mut self, id: RequestId, decoder_from: usize) -> Result<(), ExecError> {
        self.sequences.get(id)?;
        if decoder_from > 0 && matches!(self.model, AnyModel::V41(_)) {
            self.replay_from.insert(id, decoder_from);
        }
        Ok(())
    }

    fn attach_prefix(
        &mut self,
        id: RequestId,
        blocks: &[BlockHash],
        replay_from: usize,
    ) -> Result<(), ExecError> {
        let held = blocks
            .iter()
            .map(|hash| {
                self.prefix_blocks
                    .get(hash)
                    .ok_or_else(|| ExecError::Sequence {
                        id,
                        message: format!("prefix block {hash:?} is not kept on this rank"),
                    })
            })
            .collect::<Result<Vec<&KeptBlock>, _>>()?;
        let cfg = self.model.config();
        let other_family = || ExecError::Sequence {
            id,
            message: "a prefix block of the other model family".to_string(),
        };
        match self.sequences.get_mut(id)? {
            AnySequence::V41(seq) => {
                let blocks: Option<Vec<&PrefixBlock>> = held.iter().map(|b| b.v41()).collect();
                let blocks = blocks.ok_or_else(other_family)?;
                seq.attach_prefix(&blocks, replay_from, &cfg.compress_ratios)
            }
            AnySequence::V4(seq) => {
                let blocks: Option<Vec<&v4::PrefixBlock>> = held.iter().map(|b| b.v4()).collect();
                let blocks = blocks.ok_or_else(other_family)?;
                seq.attach_prefix(&blocks, replay_from, cfg.window_size)
            }
        }
        .map_err(|e| sequence_error(id, e))
    }

    fn prepare_prefix_store(&mut self, id: RequestId, start: usize) -> Result<(), ExecError> {
        if let AnySequence::V4(seq) = self.sequences.get_mut(id)? {
            seq.hold_block_rows(start);
        }
        Ok(())
    }

    fn store_prefix_block(
        &mut self,
        id: RequestId,
        hash: BlockHash,
        start: usize,
    ) -> Result<(), ExecError> {
        let cfg = self.model.config();
        let block_tokens = StateBytes::of(cfg).block_tokens;
        let block = match self.sequences.get(id)? {
            AnySequence::V41(seq) => seq
                .prefix_block(start, block_tokens, &cfg.compress_ratios)
                .map(KeptBlock::V41),
            AnySequence::V4(seq) => seq
                .prefix_block(start, block_tokens, cfg.window_size)
                .map(KeptBlock::V4),
        }
        .map_err(|e| sequence_error(id, e))?;
        self.prefix_blocks.insert(hash, block);
        Ok(())
    }

    fn drop_prefix_block(&mut self, hash: BlockHash) {
        self.prefix_blocks.remove(&hash);
    }

    fn draft(&mut self, requests: &[(RequestId, u32)]) -> Result<Vec<Option<Draft>>, ExecError> {
        if !self.model.has_drafter() {
            return Ok(vec![None; requests.len()]);
        }
        let seqs = requests
            .iter()
            .map(|&(id, anchor)| Ok((self.sequences.get(id)?, anchor)))
            .collect::<Result<Vec<_>, ExecError>>()?;
        // One drafting pass over every request; the first failing one fails the call.
        self.model
            .draft_step(&seqs)
            .into_iter()
            .zip(requests)
            .map(|(proposal, &(id, _))| {
                let proposal = proposal.map_err(|e| sequence_error(id, e))?;
                Ok(Some(Draft {
                    // The proposal starts with the anchor itself.
                    tokens: proposal.tokens.get(1..).unwrap_or_default().to_vec(),
                    confidences: proposal.confidence,
                }))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use deepinfer_model::checkpoint::write_random_checkpoint;
    use deepinfer_model::config::ModelConfig;
    use deepinfer_topology::RequestId;

    use super::*;
    use crate::experts::tiny_test_model;
    use crate::rank::executor::execute_rows;

    /// The tiny V4 architecture (v4-tiny's config) with seeded random weights.
    fn tiny_v4() -> (tempfile::TempDir, AnyModel) {
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_checkpoint(&ModelConfig::tiny_v4(), 3, dir.path(), 1).expect("written");
        let model = deepinfer_model::v4::Model::load(dir.path()).expect("loads");
        (dir, AnyModel::from(Arc::new(model)))
    }

    /// Two executors of `model`, each with fresh sequences `ids`: one under test, one whose plain
    /// steps are the reference.
    fn executor_pair(
        model: impl Into<AnyModel>,
        ids: [RequestId; 2],
    ) -> (ModelExecutor, ModelExecutor) {
        let model = model.into();
        let mut pair = (ModelExecutor::new(model.clone()), ModelExecutor::new(model));
        for executor in [&mut pair.0, &mut pair.1] {
            for id in ids {
                executor.new_sequence(id).expect("new");
            }
        }
        pair
    }

    fn entry(id: RequestId, tokens: &[u32]) -> SeqTokens<'_> {
        SeqTokens {
            id,
            tokens,
            all_rows: false,
        }
    }

    /// A device of `free` bytes free that counts its readings.
    struct Reading {
        free: u64,
        reads: std::sync::atomic::AtomicUsize,
    }

    impl crate::rank::memory::FreeMemory for Reading {
        fn free_bytes(&self) -> Result<u64, String> {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(self.free)
        }
    }

    /// On a device, the executor reads the device's free memory (once, after its warm-up step,
    /// which leaves no sequence and changes no later result); on the host it reads nothing.
    #[test]
    fn a_device_executor_reads_its_free_memory_after_a_warm_up_step() {
        let (_dir, model) = tiny_test_model();
        let probe = Arc::new(Reading {
            free: 123 << 20,
            reads: Default::default(),
        });
        let memory = DeviceMemory {
            device: 3,
            probe: probe.clone(),
        };
        let mut device = ModelExecutor::new(model.clone()).with_device_memory(Some(memory));
        let mut host = ModelExecutor::new(model);
        assert_eq!(host.state_memory(), Ok(StateMemory::Host));
        assert_eq!(
            device.state_memory(),
            Ok(StateMemory::Device {
                device: 3,
                free_bytes: 123 << 20
            })
        );
        assert_eq!(probe.reads.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(device.live_sequences(), 0, "the warm-up sequence is freed");
        let id = RequestId(5);
        let mut rows = Vec::new();
        for executor in [&mut device, &mut host] {
            executor.new_sequence(id).expect("new");
            rows.push(execute_rows(executor, &[entry(id, &[3, 1, 4, 1, 5])]).expect("step"));
        }
        assert_eq!(
            rows[0], rows[1],
            "the warm-up leaves the numbers as they were"
        );
    }

    /// An unsampled V4.1 entry's rows stay on the backend (bitwise the logits read on the
    /// host) while a sampling entry is sampled in the step; `sample_logits` samples the kept row
    /// with its mask as the host does (masked row, then `sample`).
    #[test]
    fn unsampled_rows_stay_on_the_backend_and_sample_with_their_masks() {
        use deepinfer_model::sampling::{AllowedTokens, sample};
        let (_dir, model) = tiny_test_model();
        let vocab = model.config().vocab_size;
        let (kept, host) = (RequestId(1), RequestId(2));
        let (mut deferred, mut reference) = executor_pair(model, [kept, host]);
        let batch = [entry(kept, &[3, 9, 27][..]), entry(host, &[5, 6][..])];
        let params = SamplingParams {
            temperature: 0.9,
            top_k: 0,
            top_p: 0.95,
            seed: 21,
        };
        let outputs = deferred
            .execute(ExecStep {
                batch: &batch,
                sampling: &[None, Some(params)],
            })
            .expect("step");
        let logits = execute_rows(&mut reference, &batch).expect("step");
        let EntryOutput::DeviceLogits(row) = &outputs[0] else {
            panic!("the unsampled entry's rows were not kept: {:?}", outputs[0]);
        };
        assert_eq!(**row, logits[0][..]);
        let expected_in_step = sample(&logits[1], &params, 2).expect("a token");
        assert_eq!(outputs[1], EntryOutput::Tokens(vec![expected_in_step]));
        let mask = AllowedTokens::from_tokens(vocab, &[1, 2, 40, 41, 42]);
        let mut masked = logits[0].clone();
        mask.apply(&mut masked).expect("fits");
        let got = deferred
            .sample_logits(&[LogitsRow {
                logits: row,
                params,
                position: 3,
                allowed: Some(&mask),
            }])
            .expect("sampled");
        assert_eq!(got, vec![sample(&masked, &params, 3).expect("a token")]);
        assert!(mask.is_allowed(got[0]));
    }

    /// On a V4 model: a sampled entry returns the token `sample` picks from the logits the
    /// unsampled run returns, at the position after its chunk; a verify entry returns every
    /// row; rows come back on the host.
    #[test]
    fn v4_sampled_and_verify_entries_match_the_logits() {
        use crate::sampling::sample;
        let (_dir, model) = tiny_v4();
        let vocab = model.config().vocab_size;
        let (a, b) = (RequestId(1), RequestId(2));
        let (mut sampled, mut reference) = executor_pair(model, [a, b]);
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
            seed: 17,
        };
        let batch = [entry(a, &[3, 9, 27]), entry(b, &[5, 6])];
        let outputs = sampled
            .execute(ExecStep {
                batch: &batch,
                sampling: &[Some(params), None],
            })
            .expect("step");
        let logits = execute_rows(&mut reference, &batch).expect("step");
        let token = sample(&logits[0], &params, 3).expect("a token");
        assert_eq!(outputs[0], EntryOutput::Tokens(vec![token]));
        assert_eq!(outputs[1], EntryOutput::Logits(logits[1].clone()));
        let verify = SeqTokens {
            id: b,
            tokens: &[8, 1, 2],
            all_rows: true,
        };
        let rows = execute_rows(&mut reference, &[verify]).expect("verify");
        assert_eq!(rows[0].len(), 3 * vocab);
        assert_eq!(reference.sequence_len(b), Ok(5));
        reference.rollback(b, 3).expect("rolls back");
        assert_eq!(reference.sequence_len(b), Ok(3));
    }

    /// Bad input fails with the sequence named, before any sequence changes; a V4 model without
    /// a DSpark drafter proposes nothing and ignores a decoder start (it has no bounded replay).
    #[test]
    fn bad_entries_are_named_and_nothing_drafts_without_a_drafter() {
        let (_dir, model) = tiny_v4();
        let mut executor = ModelExecutor::new(model);
        let (a, b) = (RequestId(1), RequestId(2));
        executor.new_sequence(a).expect("new");
        assert_eq!(
            executor.new_sequence(a),
            Err(ExecError::DuplicateSequence(a))
        );
        assert_eq!(
            execute_rows(&mut executor, &[entry(b, &[1])]).err(),
            Some(ExecError::UnknownSequence(b))
        );
        executor.new_sequence(b).expect("new");
        let err = execute_rows(&mut executor, &[entry(a, &[4, 5]), entry(b, &[1024])])
            .expect_err("a token outside the vocabulary");
        let ExecError::Sequence { id, message } = err else {
            panic!("not a sequence error: {err:?}");
        };
        assert_eq!(id, b);
        assert!(message.contains("1024"), "{message}");
        assert_eq!(executor.sequence_len(a), Ok(0), "nothing ran");
        let twice = execute_rows(&mut executor, &[entry(a, &[4]), entry(a, &[5])]);
        assert!(matches!(twice, Err(ExecError::Backend(_))), "{twice:?}");
        executor.plan_replay(a, 1).expect("ignored");
        execute_rows(&mut executor, &[entry(a, &[4, 5])]).expect("runs in full");
        assert_eq!(executor.draft(&[(a, 6)]), Ok(vec![None]));
        assert_eq!(
            executor.draft(&[(RequestId(9), 6)]),
            Ok(vec![None]),
            "nothing to draft without a drafter"
        );
        executor.free_sequence(a);
        assert_eq!(executor.live_sequences(), 1);
    }

    /// The rank keeps the blocks the plans store (their bytes are the geometry's, what the
    /// scheduler's index accounts), a new sequence attaches them and continues bitwise as
    /// `SequenceState::attach_prefix` does, and unknown or dropped blocks are refused naming
    /// the request.
    #[test]
    fn stored_blocks_attach_to_new_sequences_and_weigh_what_the_index_counts() {
        use crate::prefix_cache::PrefixGeometry;
        use deepinfer_model::StepOptions;
        let (_dir, model) = tiny_test_model();
        let geometry = PrefixGeometry::of(model.config());
        let n = geometry.block_tokens;
        let prompt: Vec<u32> = (0..2 * n as u32 + 5).map(|t| t * 13 % 97 + 2).collect();
        let mut executor = ModelExecutor::new(model.clone());
        let (writer, reader) = (RequestId(1), RequestId(2));
        executor.new_sequence(writer).expect("new");
        let cold = execute_rows(&mut executor, &[entry(writer, &prompt)]).expect("prefill");
        let hashes = [BlockHash(7), BlockHash(8)];
        for (i, hash) in hashes.iter().enumerate() {
            executor
                .store_prefix_block(writer, *hash, i * n)
                .expect("stored");
            assert_eq!(
                executor.prefix_blocks[hash].held_bytes(),
                geometry.block_bytes
            );
        }
        executor.free_sequence(writer);
        let from = n;
        executor.new_sequence(reader).expect("new");
        executor
            .attach_prefix(reader, &hashes, from)
            .expect("attached");
        let expected = {
            let cfg = model.config();
            let mut seq = model.new_sequence();
            let blocks: Vec<&PrefixBlock> = hashes
                .iter()
                .filter_map(|h| executor.prefix_blocks[h].v41())
                .collect();
            seq.attach_prefix(&blocks, from, &cfg.compress_ratios)
                .expect("attached");
            let mut replay = [deepinfer_model::StepEntry::new(
                &mut seq,
                &prompt[from..],
                LogitsWanted::Last,
            )];
            let outputs = model.forward_step(&mut replay, StepOptions::default());
            outputs
                .expect("replay")
                .pop()
                .and_then(EntryOutput::into_logits)
        };
        let hit = execute_rows(&mut executor, &[entry(reader, &prompt[from..])]).expect("replay");
        assert_eq!(Some(&hit[0]), expected.as_ref());
        assert_eq!(hit[0].len(), cold[0].len());
        executor.drop_prefix_block(hashes[1]);
        executor.new_sequence(RequestId(3)).expect("new");
        let error = executor
            .attach_prefix(RequestId(3), &hashes, from)
            .unwrap_err();
        assert!(
            matches!(&error, ExecError::Sequence { id, message }
                if *id == RequestId(3) && message.contains("not kept on this rank")),
            "{error}"
        );
        let early = executor
            .store_prefix_block(reader, BlockHash(9), 2 * n)
            .unwrap_err();
        assert!(early.to_string().contains("reaches past"), "{early}");
    }
}
