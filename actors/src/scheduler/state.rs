//! The scheduler of one DP rank as a pure state machine (no ractor, no tokio).
//!
//! Owns the rank's requests: the FIFO of waiting ones, the running set, each sequence's prefill
//! progress and generated count, the frees still to tell the rank, and the steps in flight.
//! Continuous batching: every plan first gives each running decode one token, then continues
//! prefills and admits waiting requests, chunking prompts so a plan never exceeds
//! `max_batched_tokens`. Async scheduling: up to `overlap_depth` plans may be in flight; a decode
//! is planned optimistically (the rank feeds it the token it sampled in the previous step) and a
//! token that arrives after its sequence finished is discarded. Outputs are matched to plans in
//! order; an output for an unknown step is counted and ignored.
//!
//! DSpark (when configured with `VerifySettings`): the scheduler is the verifier. A decoding
//! request without a grammar gets `Verify { drafts }` instead of `Decode`; the draft count comes
//! from the freshest calibrated confidences held for it (`on_proposals`; older or orphaned
//! proposals are dropped as stale) through `dspark::schedule`, capped by the plan's token budget
//! and by the tokens the request may still produce. With synchronous scheduling that is
//! Algorithm 1 (early stop). Under overlap the confidences held when a plan is built are already
//! about `overlap_depth` steps old (the rank drafts after each step; the proposals reach the
//! scheduler after it planned ahead), which is the paper's asynchronous setting: the budget is
//! the global optimum over the stale confidences (`RankedDrafts::verification_budget`, no early stop) and is
//! spent on the best candidates (`RankedDrafts::plan_with_budget`). No further lag is added on top. Since a verify produces between 1
//! and `1 + drafts` tokens, each request counts the most tokens its in-flight steps may produce.
//!
//! State memory (with a [`StatePool`], `with_pool`): every entry reserves the blocks of what it
//! will write before it is planned (a prefill chunk its tokens, a decode one position, a verify
//! the anchor and its drafts; a constrained request its whole length at admission). A request
//! that could never fit fails at submission naming the numbers; a waiting request is admitted
//! (FIFO) only when its first chunk fits; a verify gets fewer drafts when blocks are short. When
//! a running request cannot grow, the newest running request that is neither constrained nor
//! already in the plan is preempted (possibly itself; vLLM's and DeepInfer's recompute rule):
//! its state is freed by the plan, its blocks come back when that step is done, and it waits at
//! the head of the queue; once its last steps are back it is admitted again and prefills its
//! prompt followed by the tokens it delivered. Sampling noise is a pure function of (seed,
//! request, position) and prefill, decode and verify give the same rows, so it continues with
//! exactly the tokens it would have produced.
//!
//! Prefix cache (with a [`RankPrefixCache`], `with_prefix_cache`; the rule is in
//! `scheduler::prefix`): an admitted request whose prompt hits the cache attaches the cached
//! blocks and its prefill starts at the hit's replay start, so only the replayed and the new
//! tokens are planned and counted against `max_batched_tokens` (and reserved in the pool).
//! Admission prefers hits: among the first [`PREFER_HIT_WINDOW`] waiting requests the first
//! one a hit would serve is admitted before the queue's head, which is passed over at most
//! [`PREFER_HIT_WINDOW`] times (then FIFO again); a preempted head is never passed over.

use std::collections::{HashMap, VecDeque};

use deepinfer_topology::{ContextParallel, DpRank, RequestId, StepId};

use crate::dspark::schedule::{RankedDrafts, StepRateTable, VerifyPlan, VerifyScheduleError};
use crate::error::EngineError;
use crate::messages::dspark::ProposalBatch;
use crate::messages::rank::{
    NewSeq, PrefixAttach, SeqInput, SeqWork, StepMode, StepOutput, StepPlan,
};
use crate::messages::request::{FinishReason, RequestSpec, Usage};
use crate::messages::scheduler::{PrefixStats, SchedulerStats};
use crate::sampling::TokenLogprobs;
use crate::scheduler::pool::StatePool;
use crate::scheduler::prefix::RankPrefixCache;

/// Waiting requests the admission looks through for a prefix-cache hit, and the most times the
/// queue's head is passed over for one.
pub const PREFER_HIT_WINDOW: usize = 8;

/// The scheduler's limits (from the topology's `[scheduler]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Tokens per plan (>= 1).
    pub max_batched_tokens: usize,
    /// Requests prefilled or decoded at once (>= 1).
    pub max_running: usize,
    /// Largest prefill chunk of one request in one plan (>= 1).
    pub prefill_chunk_tokens: usize,
    /// Plans in flight (>= 1; 1 = synchronous scheduling).
    pub overlap_depth: usize,
    /// Context parallelism: a prompt whose remaining prefill reaches its threshold goes CP, in
    /// chunks of up to `ranks × prefill_chunk_tokens` (the CP group shares each chunk).
    pub context_parallel: Option<ContextParallel>,
}

impl SchedulerLimits {
    /// The limits of `node`'s `[scheduler]` (and its context parallelism).
    pub fn from_node(node: &deepinfer_topology::NodeConfig) -> SchedulerLimits {
        let s = &node.scheduler;
        SchedulerLimits {
            max_batched_tokens: s.max_batched_tokens as usize,
            max_running: s.max_running_requests as usize,
            prefill_chunk_tokens: s.prefill_chunk_tokens as usize,
            overlap_depth: usize::from(s.overlap_depth.max(1)),
            context_parallel: node.parallel.context_parallel,
        }
    }

    /// The largest next chunk of a prompt with `remaining` tokens left to prefill.
    fn chunk_cap(&self, remaining: usize) -> usize {
        match self.context_parallel {
            Some(cp) if remaining >= cp.min_tokens as usize => {
                usize::from(cp.ranks) * self.prefill_chunk_tokens
            }
            _ => self.prefill_chunk_tokens,
        }
    }
}

/// DSpark verification settings of a scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifySettings {
    /// Most drafts one request verifies per step (`dspark.max_draft_tokens`).
    pub max_draft_tokens: usize,
    /// Steps per second by batch tokens, profiled at engine start.
    pub table: StepRateTable,
}

/// The verifier side of DSpark in one scheduler.
#[derive(Debug)]
struct Verifier {
    max_draft_tokens: usize,
    table: StepRateTable,
    /// Async scheduling (overlap > 1): global budget search over stale confidences.
    asynchronous: bool,
    /// Per request: the step its freshest proposal is for, and its calibrated confidences.
    confidences: HashMap<RequestId, (StepId, Vec<f32>)>,
}

impl Verifier {
    fn plan(
        &mut self,
        rows: &[Vec<f32>],
        fixed_tokens: u32,
        budget: usize,
    ) -> Result<VerifyPlan, VerifyScheduleError> {
        let drafts = RankedDrafts::new(rows, self.max_draft_tokens, fixed_tokens)?;
        let wanted = if self.asynchronous {
            drafts.verification_budget(&self.table)
        } else {
            let plan = drafts.plan_verification(&self.table);
            let wanted = plan.lengths.iter().sum::<usize>();
            if wanted <= budget {
                return Ok(plan);
            }
            wanted
        };
        Ok(drafts.plan_with_budget(wanted.min(budget), &self.table))
    }
}

/// DSpark counters of one scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct DraftCounters {
    proposed: u64,
    verified: u64,
    accepted: u64,
    verify_entries: u64,
    rejecting: u64,
    stale: u64,
}

/// What one completed step did to a decoding request's positions, as the `ReplayActor` follows
/// them (`ReplayMsg::Written`, then `Rewind` when drafts were rejected, then `Commit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayUpdate {
    pub id: RequestId,
    /// Positions the step wrote: the anchor, plus the drafts of a verify.
    pub written: u32,
    /// The sequence's length after the step: its written end, or where the rank rolled it back
    /// to after rejected drafts; accepted for good.
    pub kept: u32,
    /// Drafts were rejected: the rank rewound the sequence to `kept`.
    pub rewound: bool,
}

/// What the shell must deliver to a request's event channel.
#[derive(Debug, Clone)]
pub enum Emission {
    Token(RequestId, u32),
    /// The log-probabilities of the request's next `Token`.
    Logprobs(RequestId, Box<TokenLogprobs>),
    Finished(RequestId, FinishReason, Usage),
    Failed(RequestId, EngineError),
}

#[derive(Debug)]
struct Seq {
    spec: RequestSpec,
    /// Tokens to prefill: the prompt, or once preempted the prompt and the tokens delivered.
    prefill_len: usize,
    /// Of those, the tokens already planned.
    prefilled: usize,
    /// The rank knows this sequence (its `NewSeq` was planned).
    on_rank: bool,
    /// Tokens delivered.
    output: Vec<u32>,
    /// The most tokens the planned, unreturned steps may produce for this sequence.
    outputs_in_flight: usize,
    /// The most positions the rank's state may hold once the planned steps are done (what
    /// its pool blocks cover).
    held_max: usize,
    /// Has a grammar (never drafted for, never preempted).
    constrained: bool,
    /// Preempted and not admitted again yet.
    preempted: bool,
    /// Decoder bounded replay start (see `NewSeq::decoder_from`).
    decoder_from: Option<u32>,
    /// The prefix-cache hit of its admission, until `NewSeq` carries it to the rank.
    prefix: Option<PrefixAttach>,
    /// Times a prefix-cache hit was admitted before it while it headed the queue.
    passed_over: usize,
}

impl Seq {
    fn prefill_done(&self) -> bool {
        self.prefilled == self.prefill_len
    }

    fn generated(&self) -> usize {
        self.output.len()
    }

    /// The next `n` tokens to prefill: the prompt, then (when resumed) the tokens delivered.
    fn next_prefill(&self, n: usize) -> Vec<u32> {
        let context = self.spec.prompt.iter().chain(&self.output);
        context.skip(self.prefilled).take(n).copied().collect()
    }

    /// The most positions the state may ever hold.
    fn max_len(&self) -> usize {
        self.spec.prompt.len() + self.spec.max_tokens
    }
}

/// A producing entry of a plan in flight.
#[derive(Debug, Clone, Copy)]
struct Produces {
    id: RequestId,
    /// The most tokens it may produce.
    most: usize,
    /// A prefill's last chunk (it writes no position the `ReplayActor` has not seen).
    prefill: bool,
}

/// A plan in flight.
#[derive(Debug)]
struct InFlight {
    step: StepId,
    produces: Vec<Produces>,
    /// Pool blocks of the states this plan frees on the rank (free once it is done).
    releases: usize,
}

/// What a request that must grow got.
enum Growth {
    Granted,
    /// Short of blocks that in-flight steps will free: try again next plan.
    Wait,
    /// Preempted to make room (it was the newest).
    Preempted,
}

/// One rank's scheduling state.
#[derive(Debug)]
pub struct SchedulerState {
    dp: DpRank,
    limits: SchedulerLimits,
    next_step: StepId,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    seqs: HashMap<RequestId, Seq>,
    pending_frees: Vec<RequestId>,
    /// Steps in flight, each with the most tokens it may produce per sequence.
    in_flight: VecDeque<InFlight>,
    /// The rank's state memory; `None` = unaccounted (a backend without a byte model).
    pool: Option<StatePool>,
    /// Pool blocks retired since the last plan (released when the plan that frees them is done).
    retired_blocks: usize,
    preemptions: u64,
    resumed: u64,
    verifier: Option<Verifier>,
    /// The rank's prefix cache; `None` = off.
    prefix: Option<RankPrefixCache>,
    drafts: DraftCounters,
    steps_done: u64,
    idle_steps_done: u64,
    unknown_outputs: u64,
    rank_live_sequences: usize,
    rank_failure: Option<String>,
}

impl SchedulerState {
    pub fn new(dp: DpRank, limits: SchedulerLimits) -> Self {
        SchedulerState {
            dp,
            limits,
            next_step: StepId(0),
            waiting: VecDeque::new(),
            running: Vec::new(),
            seqs: HashMap::new(),
            pending_frees: Vec::new(),
            in_flight: VecDeque::new(),
            pool: None,
            retired_blocks: 0,
            preemptions: 0,
            resumed: 0,
            verifier: None,
            prefix: None,
            drafts: DraftCounters::default(),
            steps_done: 0,
            idle_steps_done: 0,
            unknown_outputs: 0,
            rank_live_sequences: 0,
            rank_failure: None,
        }
    }

    /// Turns DSpark verification on: decoding requests without a grammar verify drafts.
    pub fn with_dspark(mut self, settings: VerifySettings) -> Self {
        self.verifier = Some(Verifier {
            max_draft_tokens: settings.max_draft_tokens,
            table: settings.table,
            asynchronous: self.limits.overlap_depth > 1,
            confidences: HashMap::new(),
        });
        self
    }

    /// Accounts the rank's state memory in `pool` (admission, growth and preemption by blocks).
    pub fn with_pool(mut self, pool: StatePool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Serves prompts from `cache` (see the module docs).
    pub fn with_prefix_cache(mut self, cache: RankPrefixCache) -> Self {
        self.prefix = Some(cache);
        self
    }

    /// Records the calibrated confidences of a rank's newest proposals. A proposal for a
    /// request that is gone, or not newer than the one held, is stale and dropped. Returns the
    /// number dropped.
    pub fn on_proposals(&mut self, batch: &ProposalBatch) -> usize {
        let Some(verifier) = self.verifier.as_mut() else {
            return batch.proposals.len();
        };
        let mut dropped = 0;
        for proposal in &batch.proposals {
            let live = self.seqs.contains_key(&proposal.id);
            let newer = verifier
                .confidences
                .get(&proposal.id)
                .is_none_or(|(step, _)| batch.for_step > *step);
            if live && newer {
                verifier
                    .confidences
                    .insert(proposal.id, (batch.for_step, proposal.confidences.clone()));
            } else {
                dropped += 1;
            }
        }
        self.drafts.stale += dropped as u64;
        dropped
    }

    /// Queues a request; refused once the rank has failed.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<(), EngineError> {
        self.submit_with_replay(spec, None)
    }

    /// [`SchedulerState::submit`] with the decoder start the `ReplayActor` planned.
    pub fn submit_with_replay(
        &mut self,
        spec: RequestSpec,
        decoder_from: Option<u32>,
    ) -> Result<(), EngineError> {
        if let Some(message) = &self.rank_failure {
            return Err(EngineError::RankFailed {
                dp: self.dp.index(),
                message: message.clone(),
            });
        }
        let id = spec.id;
        let tokens = spec.prompt.len() + spec.max_tokens;
        if let Some(pool) = self.pool.as_ref().filter(|pool| !pool.fits_alone(tokens)) {
            let usage = pool.usage();
            return Err(EngineError::StateTooLarge {
                dp: self.dp.index(),
                tokens,
                blocks: pool.blocks_for(tokens),
                block_bytes: usage.block_bytes,
                total_blocks: usage.total_blocks,
            });
        }
        self.seqs.insert(
            id,
            Seq {
                prefill_len: spec.prompt.len(),
                prefilled: 0,
                on_rank: false,
                output: Vec::new(),
                outputs_in_flight: 0,
                held_max: 0,
                constrained: spec.grammar.is_some(),
                preempted: false,
                decoder_from,
                prefix: None,
                passed_over: 0,
                spec,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Removes a request; its rank state is freed by the next plan. `None` if unknown.
    pub fn abort(&mut self, id: RequestId) -> Option<Emission> {
        self.remove(id)?;
        Some(Emission::Failed(id, EngineError::Aborted))
    }

    fn remove(&mut self, id: RequestId) -> Option<Seq> {
        let seq = self.seqs.remove(&id)?;
        if let Some(verifier) = self.verifier.as_mut() {
            verifier.confidences.remove(&id);
        }
        self.waiting.retain(|w| *w != id);
        self.running.retain(|r| *r != id);
        if seq.on_rank {
            self.pending_frees.push(id);
        }
        if let Some(pool) = self.pool.as_mut() {
            self.retired_blocks += pool.retire(id);
        }
        if let Some(cache) = self.prefix.as_mut() {
            cache.release(id);
        }
        Some(seq)
    }

    /// Preempts running `id` (see the module docs): freed by the next plan, its blocks
    /// retired, waiting at the head of the queue to be prefilled again.
    fn preempt(&mut self, id: RequestId) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        tracing::debug!(dp = %self.dp, %id, generated = seq.output.len(), "preempted for state memory");
        seq.prefilled = 0;
        seq.held_max = 0;
        seq.preempted = true;
        seq.prefix = None;
        if let Some(cache) = self.prefix.as_mut() {
            cache.release(id);
        }
        if std::mem::take(&mut seq.on_rank) {
            self.pending_frees.push(id);
        }
        if let Some(verifier) = self.verifier.as_mut() {
            verifier.confidences.remove(&id);
        }
        if let Some(pool) = self.pool.as_mut() {
            self.retired_blocks += pool.retire(id);
        }
        self.running.retain(|r| *r != id);
        self.waiting.push_front(id);
        self.preemptions += 1;
    }

    /// Reserves the blocks for running `id` to hold `len` positions, preempting the newest
    /// preemptable running request (not constrained, without an entry in `planned`) while the
    /// free blocks and those in-flight steps will free fall short.
    fn grow(&mut self, id: RequestId, len: usize, planned: &[SeqWork]) -> Growth {
        loop {
            let Some(pool) = self.pool.as_mut() else {
                return Growth::Granted;
            };
            if pool.reserve(id, len) {
                return Growth::Granted;
            }
            let short = pool.blocks_for(len) - pool.held(id);
            if pool.free_blocks() + pool.releasing_blocks() >= short {
                return Growth::Wait;
            }
            let victim = self.running.iter().rev().copied().find(|r| {
                !planned.iter().any(|w| w.id == *r)
                    && self.seqs.get(r).is_some_and(|seq| !seq.constrained)
            });
            match victim {
                None => return Growth::Wait,
                Some(victim) => {
                    self.preempt(victim);
                    if victim == id {
                        return Growth::Preempted;
                    }
                }
            }
        }
    }

    /// The largest chunk `<= n` of `id`'s prefill whose blocks are free, reserved.
    fn reserve_chunk(&mut self, id: RequestId, n: usize) -> usize {
        let (Some(pool), Some(seq)) = (self.pool.as_mut(), self.seqs.get(&id)) else {
            return n;
        };
        let n = n.min(pool.room(id).saturating_sub(seq.held_max));
        if n > 0 && !pool.reserve(id, seq.held_max + n) {
            return 0;
        }
        n
    }

    /// Requests waiting or running.
    pub fn has_requests(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Whether another plan may be sent now.
    pub fn has_credit(&self) -> bool {
        self.rank_failure.is_none() && self.in_flight.len() < self.limits.overlap_depth
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The next step id, recorded in flight with what it may produce and the pool blocks of
    /// the frees it carries.
    fn take_step_id(&mut self, produces: Vec<Produces>) -> StepId {
        let step = self.next_step;
        self.next_step = step.next();
        self.in_flight.push_back(InFlight {
            step,
            produces,
            releases: std::mem::take(&mut self.retired_blocks),
        });
        step
    }

    /// Builds the next plan if there is a credit and anything to do (work or frees).
    pub fn build_plan(&mut self) -> Option<StepPlan> {
        if !self.has_credit() {
            return None;
        }
        let mut budget = self.limits.max_batched_tokens;
        // The plan's entries (their requests are never preempted for another one).
        let mut work = Vec::new();
        let mut new_seqs = Vec::new();
        let (mut decodes, mut prefills) = (0usize, 0usize);
        // Verify entries: (index in `work`, most drafts the request may still use).
        let mut verifies: Vec<(usize, usize)> = Vec::new();
        let speculative = self.verifier.is_some();
        // 1. One token for every running decode that may still produce one.
        for id in self.running.clone() {
            if budget == 0 {
                break;
            }
            let Some(seq) = self.seqs.get(&id).filter(|_| self.running.contains(&id)) else {
                continue;
            };
            if !seq.prefill_done() || seq.generated() + seq.outputs_in_flight >= seq.spec.max_tokens
            {
                continue;
            }
            let len = seq.held_max + 1;
            if !matches!(self.grow(id, len, &work), Growth::Granted) {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            seq.held_max = len;
            seq.outputs_in_flight += 1;
            let input = if speculative && !seq.constrained {
                let room = seq.spec.max_tokens - seq.generated() - seq.outputs_in_flight;
                verifies.push((work.len(), room));
                SeqInput::Verify { drafts: 0 }
            } else {
                SeqInput::Decode
            };
            work.push(SeqWork { id, input });
            budget -= 1;
            decodes += 1;
        }
        // 2. Continue running prefills, then admit waiting requests (FIFO) while their first
        //    chunk fits.
        for id in self.running.clone() {
            if budget == 0 {
                break;
            }
            let Some(seq) = self.seqs.get(&id).filter(|_| self.running.contains(&id)) else {
                continue;
            };
            if seq.prefill_done() {
                continue;
            }
            let remaining = seq.prefill_len - seq.prefilled;
            let wanted = remaining.min(self.limits.chunk_cap(remaining)).min(budget);
            let held = seq.held_max;
            let n = self.reserve_chunk(id, wanted);
            if n == 0 {
                // Cannot grow: wait for blocks, or make room by preemption.
                self.grow(id, held + 1, &work);
                continue;
            }
            if let Some(entry) = self.prefill_entry(id, n, speculative, &mut new_seqs) {
                work.push(entry);
                budget -= n;
                prefills += 1;
            }
        }
        while self.running.len() < self.limits.max_running && budget > 0 {
            let Some((id, n)) = self.admit_next(budget) else {
                break;
            };
            if let Some(entry) = self.prefill_entry(id, n, speculative, &mut new_seqs) {
                work.push(entry);
                budget -= n;
                prefills += 1;
            }
        }
        // 3. DSpark: how many drafts each verifying request verifies.
        if !verifies.is_empty() {
            let fixed = u32::try_from(self.limits.max_batched_tokens - budget - verifies.len())
                .unwrap_or(u32::MAX);
            self.choose_verify_lengths(&mut work, &verifies, fixed, budget);
        }
        if work.is_empty() && self.pending_frees.is_empty() {
            return None;
        }
        let mode = match (prefills > 0, decodes > 0) {
            (false, false) => StepMode::Idle,
            (true, false) => StepMode::Prefill,
            (false, true) => StepMode::Decode,
            (true, true) => StepMode::Mixed,
        };
        let finished = std::mem::take(&mut self.pending_frees);
        let cache_ops = self
            .prefix
            .as_mut()
            .map(RankPrefixCache::finish_plan)
            .unwrap_or_default();
        let produces = work
            .iter()
            .filter_map(|w| {
                let (most, prefill) = match &w.input {
                    SeqInput::Decode => (1, false),
                    SeqInput::Prefill { last: true, .. } => (1, true),
                    SeqInput::Verify { drafts } => (1 + drafts, false),
                    SeqInput::Prefill { last: false, .. } => return None,
                };
                Some(Produces {
                    id: w.id,
                    most,
                    prefill,
                })
            })
            .collect();
        Some(StepPlan {
            step: self.take_step_id(produces),
            mode,
            new_seqs,
            work,
            cache_ops,
            finished,
        })
    }

    /// Moves the next waiting request ([`SchedulerState::next_admission`]) to the running set
    /// when its first chunk (at most `budget` tokens, after a prefix-cache hit's replay start; a
    /// constrained request: its whole length) fits in the free blocks, and returns it with that
    /// chunk's size. A preempted request waits until its last steps are back and its old state
    /// is freed.
    fn admit_next(&mut self, budget: usize) -> Option<(RequestId, usize)> {
        let index = self.next_admission();
        let id = *self.waiting.get(index)?;
        let seq = self.seqs.get(&id)?;
        if seq.outputs_in_flight > 0 || self.pending_frees.contains(&id) {
            return None;
        }
        let prefill_len = seq.spec.prompt.len() + seq.output.len();
        let hit = self
            .prefix
            .as_ref()
            .map(|cache| cache.hit(&seq.spec.prompt, &seq.spec.prefix_chain, seq.decoder_from))
            .unwrap_or_default();
        let remaining = prefill_len - hit.replay_from;
        let n = remaining.min(self.limits.chunk_cap(remaining)).min(budget);
        let reserve = if seq.constrained {
            seq.max_len()
        } else {
            hit.replay_from + n
        };
        if let Some(pool) = self.pool.as_mut()
            && !pool.reserve(id, reserve)
        {
            return None;
        }
        let prefix = match self.prefix.as_mut() {
            Some(cache) => cache.admit(
                id,
                &seq.spec.prompt,
                &seq.spec.prefix_chain,
                seq.decoder_from,
            ),
            None => None,
        };
        let seq = self.seqs.get_mut(&id)?;
        seq.prefill_len = prefill_len;
        seq.prefilled = hit.replay_from;
        seq.held_max = hit.replay_from;
        seq.prefix = prefix;
        if std::mem::take(&mut seq.preempted) {
            self.resumed += 1;
        }
        if index > 0
            && let Some(head) = self.waiting.front().and_then(|h| self.seqs.get_mut(h))
        {
            head.passed_over += 1;
        }
        self.waiting.remove(index);
        self.running.push(id);
        Some((id, n))
    }

    /// The index in the queue of the request to admit next: the head, unless a prefix-cache
    /// hit waits among the first [`PREFER_HIT_WINDOW`] and the head is neither preempted nor
    /// passed over that many times already (then the first such hit).
    fn next_admission(&self) -> usize {
        let Some(cache) = self.prefix.as_ref() else {
            return 0;
        };
        let head_waits = self
            .waiting
            .front()
            .and_then(|id| self.seqs.get(id))
            .is_some_and(|head| !head.preempted && head.passed_over < PREFER_HIT_WINDOW);
        if !head_waits {
            return 0;
        }
        self.waiting
            .iter()
            .take(PREFER_HIT_WINDOW)
            .position(|id| {
                self.seqs.get(id).is_some_and(|seq| {
                    let spec = &seq.spec;
                    !seq.preempted
                        && cache
                            .hit(&spec.prompt, &spec.prefix_chain, seq.decoder_from)
                            .cached
                            > 0
                })
            })
            .unwrap_or(0)
    }

    /// The entry of `id`'s next prefill chunk of `n` tokens (blocks reserved), introducing the
    /// sequence to the rank when it is new there.
    fn prefill_entry(
        &mut self,
        id: RequestId,
        n: usize,
        speculative: bool,
        new_seqs: &mut Vec<NewSeq>,
    ) -> Option<SeqWork> {
        let seq = self.seqs.get_mut(&id)?;
        let tokens = seq.next_prefill(n);
        seq.prefilled += n;
        seq.held_max += n;
        if let Some(cache) = self.prefix.as_mut() {
            cache.prefilled(id, seq.prefilled);
        }
        let last = seq.prefill_done();
        if last {
            seq.outputs_in_flight += 1;
        }
        if !seq.on_rank {
            seq.on_rank = true;
            new_seqs.push(NewSeq {
                id,
                sampling: seq.spec.sampling,
                grammar: seq.spec.grammar.take(),
                decoder_from: seq.decoder_from,
                speculative: speculative && !seq.constrained,
                logprobs: seq.spec.logprobs,
                prefix: seq.prefix.take(),
            });
        }
        Some(SeqWork {
            id,
            input: SeqInput::Prefill { tokens, last },
        })
    }

    /// Sets the draft count of each verify entry from the requests' confidences; `fixed` are
    /// the plan's other tokens (prefill chunks and plain decodes), `budget` the tokens left.
    fn choose_verify_lengths(
        &mut self,
        work: &mut [SeqWork],
        verifies: &[(usize, usize)],
        fixed: u32,
        budget: usize,
    ) {
        let Some(verifier) = self.verifier.as_mut() else {
            return;
        };
        let rows: Vec<Vec<f32>> = verifies
            .iter()
            .map(|&(index, room)| {
                let held = verifier
                    .confidences
                    .get(&work[index].id)
                    .map_or(&[][..], |(_, c)| c.as_slice());
                held[..held.len().min(room)].to_vec()
            })
            .collect();
        let lengths = match verifier.plan(&rows, fixed, budget) {
            Ok(plan) => plan.lengths,
            Err(error) => {
                tracing::warn!(%error, "verify lengths: no drafts this step");
                return;
            }
        };
        for (&(index, _), drafts) in verifies.iter().zip(lengths) {
            let entry = &mut work[index];
            let Some(seq) = self.seqs.get_mut(&entry.id) else {
                continue;
            };
            // The drafts whose positions fit in the blocks held and free.
            let drafts = match self.pool.as_mut() {
                Some(pool) => {
                    let fit = drafts.min(pool.room(entry.id).saturating_sub(seq.held_max));
                    if pool.reserve(entry.id, seq.held_max + fit) {
                        fit
                    } else {
                        0
                    }
                }
                None => drafts,
            };
            entry.input = SeqInput::Verify { drafts };
            seq.outputs_in_flight += drafts;
            seq.held_max += drafts;
        }
    }

    /// An `Idle` plan (the rank has nothing to do but must step with its peers); only when
    /// nothing else is in flight.
    pub fn idle_plan(&mut self) -> Option<StepPlan> {
        if !self.has_credit() || !self.in_flight.is_empty() {
            return None;
        }
        let finished = std::mem::take(&mut self.pending_frees);
        Some(StepPlan {
            step: self.take_step_id(Vec::new()),
            mode: StepMode::Idle,
            new_seqs: Vec::new(),
            work: Vec::new(),
            cache_ops: Vec::new(),
            finished,
        })
    }

    /// The position updates of `output` for the `ReplayActor`, one per request that decoded or
    /// verified in it (a prefill's first token writes no position past the prompt); to be
    /// taken before [`SchedulerState::on_step_done`] applies the output. A request that has
    /// delivered `g` tokens fed the `g`-th as the step's anchor at position `prompt + g - 1`;
    /// a verify of `k` drafts wrote `k + 1` positions and keeps `prompt + g + accepted`.
    pub fn replay_updates(&self, output: &StepOutput) -> Vec<ReplayUpdate> {
        let Some(front) = self.in_flight.front().filter(|f| f.step == output.step) else {
            return Vec::new();
        };
        let position = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let mut updates: Vec<ReplayUpdate> = Vec::new();
        for &(id, _) in &output.sampled {
            if updates.iter().any(|u| u.id == id) {
                continue;
            }
            let Some(seq) = self.seqs.get(&id) else {
                continue;
            };
            let prefill = front.produces.iter().any(|p| p.id == id && p.prefill);
            if prefill {
                continue;
            }
            let before = seq.spec.prompt.len() + seq.generated();
            let update = match output.verified.iter().find(|v| v.id == id) {
                Some(v) => ReplayUpdate {
                    id,
                    written: position(v.verified + 1),
                    kept: position(before + v.accepted),
                    rewound: v.accepted < v.verified,
                },
                None => ReplayUpdate {
                    id,
                    written: 1,
                    kept: position(before),
                    rewound: false,
                },
            };
            updates.push(update);
        }
        updates
    }

    /// Applies a step's output; returns what to deliver.
    pub fn on_step_done(&mut self, output: &StepOutput) -> Vec<Emission> {
        if self.in_flight.front().map(|f| f.step) != Some(output.step) {
            self.unknown_outputs += 1;
            return Vec::new();
        }
        let Some(done) = self.in_flight.pop_front() else {
            return Vec::new();
        };
        for p in done.produces {
            if let Some(seq) = self.seqs.get_mut(&p.id) {
                seq.outputs_in_flight = seq.outputs_in_flight.saturating_sub(p.most);
            }
        }
        if let Some(pool) = self.pool.as_mut() {
            pool.release(done.releases);
        }
        self.drafts.proposed += output
            .drafts
            .iter()
            .map(|d| d.confidences.len() as u64)
            .sum::<u64>();
        for outcome in &output.verified {
            // The rank rolled the sequence back past the rejected drafts: their blocks are free.
            if let Some(seq) = self.seqs.get_mut(&outcome.id).filter(|seq| seq.on_rank) {
                let rejected = outcome.verified.saturating_sub(outcome.accepted);
                seq.held_max = seq.held_max.saturating_sub(rejected);
                if let Some(pool) = self.pool.as_mut() {
                    pool.shrink(outcome.id, seq.held_max);
                }
            }
            self.drafts.verified += outcome.verified as u64;
            self.drafts.accepted += outcome.accepted as u64;
            self.drafts.verify_entries += 1;
            if outcome.accepted < outcome.verified {
                self.drafts.rejecting += 1;
            }
        }
        self.steps_done += 1;
        if output.mode == StepMode::Idle {
            self.idle_steps_done += 1;
        }
        self.rank_live_sequences = output.live_sequences;
        let mut emissions = Vec::new();
        let mut logprobs = output.logprobs.iter().peekable();
        for &(id, token) in &output.sampled {
            // The sampled tokens' log-probabilities come in the same order.
            let token_logprobs = logprobs
                .next_if(|(of, lp)| *of == id && lp.token == token)
                .map(|(_, lp)| lp);
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            if seq.spec.stop_token_ids.contains(&token) {
                emissions.push(self.finish(id, FinishReason::Stop));
                continue;
            }
            seq.output.push(token);
            if let Some(lp) = token_logprobs {
                emissions.push(Emission::Logprobs(id, Box::new(lp.clone())));
            }
            emissions.push(Emission::Token(id, token));
            if seq.generated() >= seq.spec.max_tokens {
                emissions.push(self.finish(id, FinishReason::Length));
            }
        }
        emissions
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason) -> Emission {
        let usage = match self.remove(id) {
            Some(seq) => Usage {
                prompt_tokens: seq.spec.prompt.len(),
                completion_tokens: seq.generated(),
            },
            None => Usage::default(),
        };
        Emission::Finished(id, reason, usage)
    }

    /// The rank is lost: every request fails with `RankFailed`, and later submissions too.
    pub fn fail_all(&mut self, message: &str) -> Vec<Emission> {
        if self.rank_failure.is_none() {
            self.rank_failure = Some(message.to_string());
        }
        let error = EngineError::RankFailed {
            dp: self.dp.index(),
            message: message.to_string(),
        };
        let mut ids: Vec<RequestId> = self.seqs.keys().copied().collect();
        ids.sort_unstable();
        self.seqs.clear();
        self.waiting.clear();
        self.running.clear();
        self.pending_frees.clear();
        self.in_flight.clear();
        self.retired_blocks = 0;
        if let Some(pool) = self.pool.as_mut() {
            pool.clear();
        }
        if let Some(verifier) = self.verifier.as_mut() {
            verifier.confidences.clear();
        }
        if let Some(cache) = self.prefix.as_mut() {
            cache.clear();
        }
        ids.into_iter()
            .map(|id| Emission::Failed(id, error.clone()))
            .collect()
    }

    pub fn stats(&self) -> SchedulerStats {
        let usage = self.pool.as_ref().map(StatePool::usage).unwrap_or_default();
        let prefix = self
            .prefix
            .as_ref()
            .map(|cache| {
                let (bytes, blocks, evictions) = cache.usage();
                PrefixStats {
                    counters: cache.counters(),
                    cached_bytes: bytes,
                    cached_blocks: blocks,
                    evictions,
                    budget_bytes: cache.budget_bytes(),
                }
            })
            .unwrap_or_default();
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            in_flight_steps: self.in_flight.len(),
            steps_done: self.steps_done,
            idle_steps_done: self.idle_steps_done,
            rank_live_sequences: self.rank_live_sequences,
            rank_failed: self.rank_failure.is_some(),
            draft_tokens_proposed: self.drafts.proposed,
            draft_tokens_verified: self.drafts.verified,
            draft_tokens_accepted: self.drafts.accepted,
            verify_entries: self.drafts.verify_entries,
            rejecting_verifies: self.drafts.rejecting,
            stale_proposals: self.drafts.stale,
            state_blocks_total: usage.total_blocks,
            state_blocks_used: usage.used_blocks,
            preemptions: self.preemptions,
            resumed: self.resumed,
            prefix,
        }
    }

    /// Outputs that matched no plan in flight (a protocol error; counted, not fatal).
    pub fn unknown_outputs(&self) -> u64 {
        self.unknown_outputs
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::messages::rank::StepTiming;
    use crate::sampling::SamplingParams;
    use rand::{Rng, SeedableRng};

    const EOS: u32 = 1;

    fn limits(budget: usize, depth: usize) -> SchedulerLimits {
        SchedulerLimits {
            max_batched_tokens: budget,
            max_running: 4,
            prefill_chunk_tokens: 8,
            overlap_depth: depth,
            context_parallel: None,
        }
    }

    fn spec(id: u64, prompt_len: usize, max_tokens: usize) -> RequestSpec {
        RequestSpec {
            id: RequestId(id),
            prompt: (0..prompt_len as u32).map(|t| t + 10).collect(),
            sampling: SamplingParams::greedy(),
            max_tokens,
            stop_token_ids: vec![EOS],
            grammar: None,
            logprobs: None,
            prefix_chain: Vec::new(),
        }
    }

    /// Plays the rank: every producing entry samples `token`.
    pub(crate) fn output_for(plan: &StepPlan, token: u32) -> StepOutput {
        let sampled = plan
            .work
            .iter()
            .filter(|w| {
                matches!(
                    w.input,
                    SeqInput::Decode | SeqInput::Prefill { last: true, .. }
                )
            })
            .map(|w| (w.id, token))
            .collect();
        StepOutput {
            step: plan.step,
            dp: DpRank(0),
            mode: plan.mode,
            sampled,
            logprobs: Vec::new(),
            verified: Vec::new(),
            drafts: Vec::new(),
            live_sequences: 0,
            timing: StepTiming::default(),
        }
    }

    #[test]
    fn a_prompt_reaching_the_cp_threshold_gets_cp_sized_chunks_until_its_rest_is_short() {
        let cp = ContextParallel {
            ranks: 4,
            min_tokens: 20,
        };
        let scheduler = || {
            let limits = SchedulerLimits {
                context_parallel: Some(cp),
                ..limits(64, 1)
            };
            SchedulerState::new(DpRank(0), limits)
        };
        let mut s = scheduler();
        // 45 tokens: one CP chunk of 4 x 8, then 13 < 20 left in plain chunks of 8.
        s.submit(spec(1, 45, 1)).unwrap();
        let mut chunks = Vec::new();
        while let Some(plan) = s.build_plan() {
            if plan.mode != StepMode::Prefill {
                break;
            }
            chunks.push(plan.token_count());
            s.on_step_done(&output_for(&plan, 5));
        }
        assert_eq!(chunks, vec![32, 8, 5]);
        // Below the threshold from the start: plain chunks only.
        let mut s = scheduler();
        s.submit(spec(2, 19, 1)).unwrap();
        let plan = s.build_plan().unwrap();
        assert_eq!(plan.token_count(), 8);
    }

    #[test]
    fn long_prompt_is_chunked_then_decoded_to_max_tokens() {
        let mut s = SchedulerState::new(DpRank(0), limits(6, 1));
        s.submit(spec(1, 14, 2)).unwrap();
        let p0 = s.build_plan().unwrap();
        assert_eq!(
            (p0.mode, p0.token_count(), p0.new_seqs.len()),
            (StepMode::Prefill, 6, 1)
        );
        assert!(
            s.build_plan().is_none(),
            "depth 1 allows one plan in flight"
        );
        assert!(s.on_step_done(&output_for(&p0, 5)).is_empty());
        let p1 = s.build_plan().unwrap();
        assert_eq!((p1.token_count(), p1.new_seqs.len()), (6, 0));
        s.on_step_done(&output_for(&p1, 5));
        let p2 = s.build_plan().unwrap();
        assert_eq!(
            p2.work,
            vec![SeqWork {
                id: RequestId(1),
                input: SeqInput::Prefill {
                    tokens: vec![22, 23],
                    last: true
                }
            }]
        );
        let e = s.on_step_done(&output_for(&p2, 42));
        assert!(matches!(e[..], [Emission::Token(RequestId(1), 42)]));
        let p3 = s.build_plan().unwrap();
        assert_eq!((p3.mode, p3.token_count()), (StepMode::Decode, 1));
        let e = s.on_step_done(&output_for(&p3, 43));
        assert!(matches!(
            e[..],
            [
                Emission::Token(_, 43),
                Emission::Finished(
                    _,
                    FinishReason::Length,
                    Usage {
                        prompt_tokens: 14,
                        completion_tokens: 2
                    }
                )
            ]
        ));
        // The next plan only frees the finished sequence.
        let p4 = s.build_plan().unwrap();
        assert_eq!(
            (p4.mode, p4.finished.clone()),
            (StepMode::Idle, vec![RequestId(1)])
        );
        assert!(!s.has_requests());
    }

    #[test]
    fn eos_finishes_with_stop_and_is_not_delivered() {
        let mut s = SchedulerState::new(DpRank(0), limits(16, 1));
        s.submit(spec(1, 3, 10)).unwrap();
        let p = s.build_plan().unwrap();
        let e = s.on_step_done(&output_for(&p, EOS));
        assert!(matches!(
            e[..],
            [Emission::Finished(
                _,
                FinishReason::Stop,
                Usage {
                    completion_tokens: 0,
                    ..
                }
            )]
        ));
    }

    #[test]
    fn overlap_plans_decodes_ahead_and_drops_late_tokens() {
        let mut s = SchedulerState::new(DpRank(0), limits(16, 2));
        s.submit(spec(1, 2, 5)).unwrap();
        let p0 = s.build_plan().unwrap();
        let p1 = s.build_plan().unwrap();
        assert_eq!(
            p1.work,
            vec![SeqWork {
                id: RequestId(1),
                input: SeqInput::Decode
            }],
            "planned before p0 returned"
        );
        assert!(s.build_plan().is_none(), "depth 2");
        // p0's token is EOS: p1's token arrives for a finished sequence and is discarded.
        assert!(matches!(
            s.on_step_done(&output_for(&p0, EOS))[..],
            [Emission::Finished(..)]
        ));
        assert!(s.on_step_done(&output_for(&p1, 99)).is_empty());
        assert_eq!(s.build_plan().unwrap().finished, vec![RequestId(1)]);
    }

    #[test]
    fn abort_frees_only_sequences_the_rank_knows() {
        let mut s = SchedulerState::new(DpRank(0), limits(4, 1));
        s.submit(spec(1, 2, 5)).unwrap();
        s.submit(spec(2, 2, 5)).unwrap();
        s.submit(spec(3, 2, 5)).unwrap();
        let p = s.build_plan().unwrap(); // admits 1 and 2 (budget 4)
        assert_eq!(p.new_seqs.len(), 2);
        assert!(matches!(
            s.abort(RequestId(3)),
            Some(Emission::Failed(_, EngineError::Aborted))
        ));
        assert!(matches!(
            s.abort(RequestId(1)),
            Some(Emission::Failed(_, EngineError::Aborted))
        ));
        assert!(s.abort(RequestId(1)).is_none());
        s.on_step_done(&output_for(&p, 7));
        let next = s.build_plan().unwrap();
        assert_eq!(next.finished, vec![RequestId(1)]);
        assert!(next.work.iter().all(|w| w.id == RequestId(2)));
    }

    #[test]
    fn fail_all_fails_everything_and_refuses_new_work() {
        let mut s = SchedulerState::new(DpRank(2), limits(4, 2));
        s.submit(spec(1, 2, 5)).unwrap();
        s.submit(spec(2, 2, 5)).unwrap();
        s.build_plan().unwrap();
        let e = s.fail_all("boom");
        assert_eq!(e.len(), 2);
        assert!(e.iter().all(|e| matches!(
            e,
            Emission::Failed(_, EngineError::RankFailed { dp: 2, .. })
        )));
        assert!(s.submit(spec(3, 1, 1)).is_err());
        assert!(s.build_plan().is_none());
    }

    #[test]
    fn unknown_step_output_is_counted_and_ignored() {
        let mut s = SchedulerState::new(DpRank(0), limits(4, 1));
        s.submit(spec(1, 2, 5)).unwrap();
        let mut p = s.build_plan().unwrap();
        p.step = StepId(77);
        assert!(s.on_step_done(&output_for(&p, 3)).is_empty());
        assert_eq!(s.unknown_outputs(), 1);
    }

    /// Random submits, aborts and completions: the budget is never exceeded, nothing aborted or
    /// finished is scheduled, every sequence is introduced before its work, every admitted
    /// request ends exactly once, and at the end the rank has been told to free everything.
    #[test]
    fn randomized_invariants() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for depth in 1..=3 {
            let mut s = SchedulerState::new(DpRank(0), limits(10, depth));
            let mut known_to_rank = std::collections::HashSet::new();
            let mut live: std::collections::HashSet<RequestId> = Default::default();
            let mut ended = std::collections::HashSet::new();
            let mut plans = VecDeque::new();
            let mut next_id = 0;
            for _ in 0..3000 {
                match rng.random_range(0..10) {
                    0..=2 if next_id < 200 => {
                        next_id += 1;
                        s.submit(spec(
                            next_id,
                            rng.random_range(1..30),
                            rng.random_range(1..6),
                        ))
                        .unwrap();
                        live.insert(RequestId(next_id));
                    }
                    3 if next_id > 0 => {
                        let id = RequestId(rng.random_range(1..=next_id));
                        if s.abort(id).is_some() {
                            assert!(live.remove(&id) && ended.insert(id));
                        }
                    }
                    4..=6 => {
                        if let Some(p) = s.build_plan() {
                            assert!(p.token_count() <= 10);
                            for n in &p.new_seqs {
                                assert!(known_to_rank.insert(n.id));
                            }
                            for w in &p.work {
                                assert!(live.contains(&w.id), "scheduled {} after it ended", w.id);
                                assert!(known_to_rank.contains(&w.id));
                            }
                            for f in &p.finished {
                                assert!(known_to_rank.remove(f) && !live.contains(f));
                            }
                            plans.push_back(p);
                        }
                    }
                    _ => {
                        if let Some(p) = plans.pop_front() {
                            let token = if rng.random_bool(0.1) { EOS } else { 5 };
                            for e in s.on_step_done(&output_for(&p, token)) {
                                if let Emission::Finished(id, ..) = e {
                                    assert!(live.remove(&id) && ended.insert(id));
                                }
                            }
                        }
                    }
                }
            }
            // Drain: run plans until everything ended and was freed.
            for _ in 0..10_000 {
                if let Some(p) = s.build_plan() {
                    for f in &p.finished {
                        known_to_rank.remove(f);
                    }
                    plans.push_back(p);
                }
                let Some(p) = plans.pop_front() else { break };
                for e in s.on_step_done(&output_for(&p, 5)) {
                    if let Emission::Finished(id, ..) = e {
                        assert!(live.remove(&id) && ended.insert(id));
                    }
                }
            }
            assert!(
                live.is_empty() && !s.has_requests(),
                "depth {depth}: {} requests never ended",
                live.len()
            );
            assert!(
                known_to_rank.is_empty(),
                "depth {depth}: the rank still holds {known_to_rank:?}"
            );
            assert_eq!(ended.len() as u64, next_id);
        }
    }

    mod memory {
        use super::*;
        use crate::messages::rank::VerifyOutcome;
        use deepinfer_model::config::ModelConfig;
        use deepinfer_model::state_bytes::StateBytes;

        /// A scheduler whose pool holds `blocks` blocks of the tiny V4.1 model's states.
        fn pooled(blocks: usize, depth: usize) -> (SchedulerState, StateBytes) {
            let model = StateBytes::of(&ModelConfig::tiny_v41());
            let pool = StatePool::new(model.clone(), blocks as u64 * model.block_bytes());
            let limits = SchedulerLimits {
                max_batched_tokens: 64,
                max_running: 4,
                prefill_chunk_tokens: 32,
                overlap_depth: depth,
                context_parallel: None,
            };
            (
                SchedulerState::new(DpRank(0), limits).with_pool(pool),
                model,
            )
        }

        #[test]
        fn a_request_that_can_never_fit_fails_naming_the_numbers() {
            let (mut s, model) = pooled(10, 1);
            let fits = (10 - model.ring_blocks()) * model.block_tokens;
            s.submit(spec(1, fits - 5, 5)).expect("exactly fits");
            let err = s.submit(spec(2, fits - 5, 6)).unwrap_err();
            assert!(matches!(
                err,
                EngineError::StateTooLarge { tokens, total_blocks: 10, .. } if tokens == fits + 1
            ));
            let message = err.to_string();
            assert!(
                message.contains(&format!("{} tokens", fits + 1)),
                "{message}"
            );
            assert!(message.contains("holds 10 blocks"), "{message}");
        }

        /// Plays the rank: each sequence's length, and the tokens it was fed (a resumed
        /// sequence must be fed its prompt and then exactly the tokens it delivered).
        #[derive(Default)]
        struct Rank {
            fed: HashMap<RequestId, Vec<u32>>,
            delivered: HashMap<RequestId, Vec<u32>>,
            /// Verifies accept `step % 3` of their drafts.
            steps: usize,
        }

        impl Rank {
            /// Runs `plan`: the token sampled for a sequence is a function of its length, as
            /// seeded sampling is of the position, so recompute reproduces it.
            fn run(&mut self, plan: &StepPlan) -> StepOutput {
                let mut out = output_for(plan, 0);
                out.sampled.clear();
                self.steps += 1;
                for w in &plan.work {
                    let fed = self.fed.entry(w.id).or_default();
                    let mut accepted = 0;
                    match &w.input {
                        SeqInput::Prefill { tokens, last } => {
                            fed.extend(tokens);
                            if !last {
                                continue;
                            }
                        }
                        SeqInput::Decode => {
                            fed.push(*self.delivered[&w.id].last().expect("a token"));
                        }
                        SeqInput::Verify { drafts } => {
                            fed.push(*self.delivered[&w.id].last().expect("a token"));
                            accepted = (self.steps % 3).min(*drafts);
                            out.verified.push(VerifyOutcome {
                                id: w.id,
                                verified: *drafts,
                                accepted,
                            });
                        }
                    }
                    // The anchor's token, then one per accepted draft (each a true token fed).
                    for k in 0..=accepted {
                        if k > 0 {
                            let token = *self.delivered[&w.id].last().expect("a token");
                            fed.push(token);
                        }
                        let token = 100 + fed.len() as u32;
                        self.delivered.entry(w.id).or_default().push(token);
                        out.sampled.push((w.id, token));
                    }
                }
                for id in &plan.finished {
                    self.fed.remove(id);
                }
                out
            }
        }

        /// Six requests whose states need twice the pool: every request completes with the
        /// tokens it would produce alone, some after a preemption, and the modelled bytes of
        /// the states on the rank never pass the budget.
        #[test]
        fn preempted_requests_resume_with_their_tokens_and_the_pool_bounds_the_states() {
            for (depth, dspark) in [(1, false), (2, false), (1, true), (2, true)] {
                let (s, model) = pooled(16, depth);
                let mut s = if dspark {
                    s.with_dspark(VerifySettings {
                        max_draft_tokens: 5,
                        table: super::dspark::linear_table(),
                    })
                } else {
                    s
                };
                let budget = 16 * model.block_bytes();
                for id in 1..=6 {
                    s.submit(spec(id, 40 + 7 * id as usize, 120)).unwrap();
                }
                let mut rank = Rank::default();
                let mut outputs: HashMap<RequestId, Vec<u32>> = HashMap::new();
                let mut plans = VecDeque::new();
                let mut most = 0;
                for _ in 0..20_000 {
                    while let Some(plan) = s.build_plan() {
                        plans.push_back(plan);
                    }
                    let Some(plan) = plans.pop_front() else { break };
                    let out = rank.run(&plan);
                    if dspark {
                        let ids: Vec<(u64, f32)> = rank.fed.keys().map(|id| (id.0, 0.99)).collect();
                        s.on_proposals(&super::dspark::proposals(plan.step.0 + 1, &ids));
                    }
                    let held: u64 = rank.fed.values().map(|f| model.bytes(f.len())).sum();
                    assert!(held <= budget, "{held} bytes over the {budget}-byte budget");
                    most = most.max(held);
                    for e in s.on_step_done(&out) {
                        if let Emission::Token(id, t) = e {
                            outputs.entry(id).or_default().push(t);
                        }
                    }
                }
                assert!(
                    !s.has_requests(),
                    "depth {depth}, dspark {dspark}: every request ended; {:?}",
                    s.stats()
                );
                let stats = s.stats();
                assert!(stats.preemptions > 0, "the workload needs preemption");
                assert_eq!(stats.resumed, stats.preemptions);
                for id in 1..=6u64 {
                    let prompt = 40 + 7 * id as usize;
                    // Alone, the k-th token is sampled after prompt + k - 1 fed tokens.
                    let alone: Vec<u32> = (0..120).map(|k| 100 + (prompt + k) as u32).collect();
                    assert_eq!(outputs[&RequestId(id)], alone, "request {id}");
                }
                assert_eq!(stats.state_blocks_used, 0, "every block came back");
                println!(
                    "depth {depth}, dspark {dspark}: {} preemptions, {} drafts verified, peak \
                     {most} of {budget} bytes",
                    stats.preemptions, stats.draft_tokens_verified
                );
            }
        }
    }

    mod dspark {
        use super::*;
        use crate::dspark::schedule::StepRatePoint;
        use crate::messages::dspark::CalibratedProposal;
        use crate::messages::rank::VerifyOutcome;

        /// 10 ms per step plus 1 ms per token: each extra token costs ~8% of a small step.
        pub(super) fn linear_table() -> StepRateTable {
            StepRateTable::new(
                (1..=64)
                    .map(|b| StepRatePoint {
                        batch_tokens: b,
                        steps_per_second: 1000.0 / (10.0 + f64::from(b)),
                    })
                    .collect(),
            )
            .unwrap()
        }

        fn speculative(depth: usize) -> SchedulerState {
            SchedulerState::new(DpRank(0), limits(64, depth)).with_dspark(VerifySettings {
                max_draft_tokens: 5,
                table: linear_table(),
            })
        }

        pub(super) fn proposals(for_step: u64, rows: &[(u64, f32)]) -> ProposalBatch {
            ProposalBatch {
                for_step: StepId(for_step),
                proposals: rows
                    .iter()
                    .map(|&(id, c)| CalibratedProposal {
                        id: RequestId(id),
                        confidences: vec![c; 5],
                    })
                    .collect(),
            }
        }

        fn drafts_of(plan: &StepPlan) -> Vec<(RequestId, usize)> {
            plan.work
                .iter()
                .filter_map(|w| match w.input {
                    SeqInput::Verify { drafts } => Some((w.id, drafts)),
                    _ => None,
                })
                .collect()
        }

        /// Prefills requests 1.. with `n` tokens each and returns the scheduler ready to decode.
        fn decoding(requests: u64, max_tokens: usize) -> SchedulerState {
            let mut s = speculative(1);
            for id in 1..=requests {
                s.submit(spec(id, 2, max_tokens)).unwrap();
            }
            let p = s.build_plan().unwrap();
            s.on_step_done(&output_for(&p, 5));
            s
        }

        #[test]
        fn verify_lengths_follow_the_confidences() {
            let mut s = decoding(2, 50);
            // Without proposals nothing is verified yet, but the entries are verifies.
            let p = s.build_plan().unwrap();
            assert_eq!(drafts_of(&p), vec![(RequestId(1), 0), (RequestId(2), 0)]);
            s.on_step_done(&output_for(&p, 5));
            // Confident request 1 verifies all five drafts, unsure request 2 none.
            s.on_proposals(&proposals(2, &[(1, 0.95), (2, 0.05)]));
            let p = s.build_plan().unwrap();
            assert_eq!(drafts_of(&p), vec![(RequestId(1), 5), (RequestId(2), 0)]);
            assert_eq!(p.token_count(), 7);
            s.on_step_done(&output_for(&p, 5));
            // The confidences flip: so do the lengths.
            s.on_proposals(&proposals(3, &[(1, 0.05), (2, 0.95)]));
            let p = s.build_plan().unwrap();
            assert_eq!(drafts_of(&p), vec![(RequestId(1), 0), (RequestId(2), 5)]);
        }

        #[test]
        fn stale_and_orphaned_proposals_are_dropped() {
            let mut s = decoding(1, 50);
            assert_eq!(s.on_proposals(&proposals(4, &[(1, 0.95)])), 0);
            // Older than the one held, or the same step again: stale.
            assert_eq!(s.on_proposals(&proposals(3, &[(1, 0.05)])), 1);
            assert_eq!(s.on_proposals(&proposals(4, &[(1, 0.05)])), 1);
            // For a request this scheduler does not hold: dropped.
            assert_eq!(s.on_proposals(&proposals(5, &[(9, 0.95)])), 1);
            assert_eq!(s.stats().stale_proposals, 3);
            // The fresh, confident proposal is the one used.
            let p = s.build_plan().unwrap();
            assert_eq!(drafts_of(&p), vec![(RequestId(1), 5)]);
        }

        #[test]
        fn drafts_never_exceed_the_tokens_a_request_may_still_produce() {
            let mut s = decoding(1, 4); // 1 token generated, 3 to go
            s.on_proposals(&proposals(2, &[(1, 0.99)]));
            let p = s.build_plan().unwrap();
            assert_eq!(drafts_of(&p), vec![(RequestId(1), 2)]);
            // The rank accepts both drafts and adds the bonus: the request is complete.
            let mut out = output_for(&p, 5);
            out.sampled = vec![(RequestId(1), 6), (RequestId(1), 7), (RequestId(1), 8)];
            out.verified = vec![VerifyOutcome {
                id: RequestId(1),
                verified: 2,
                accepted: 2,
            }];
            let e = s.on_step_done(&out);
            assert!(
                matches!(
                    e[..],
                    [
                        Emission::Token(_, 6),
                        Emission::Token(_, 7),
                        Emission::Token(_, 8),
                        Emission::Finished(_, FinishReason::Length, _)
                    ]
                ),
                "{e:?}"
            );
            let stats = s.stats();
            assert_eq!(
                (stats.draft_tokens_verified, stats.draft_tokens_accepted),
                (2, 2)
            );
            assert_eq!(stats.mean_accepted_length(), Some(3.0));
        }

        /// Prompt 2, one token from the prefill: a decode writes position 2 and keeps 3; a
        /// verify of 5 drafts from 2 delivered tokens writes 6 positions and, accepting 2,
        /// rewinds to 2 + 2 + 2 = 6 and commits it; accepting all keeps the written end.
        #[test]
        fn replay_updates_follow_the_positions_the_rank_wrote_and_kept() {
            let mut s = decoding(2, 50);
            let p = s.build_plan().unwrap(); // verifies of 0 drafts: one token each
            let mut out = output_for(&p, 5);
            out.sampled = vec![(RequestId(1), 5), (RequestId(2), 5)];
            out.verified = (1..=2)
                .map(|id| VerifyOutcome {
                    id: RequestId(id),
                    verified: 0,
                    accepted: 0,
                })
                .collect();
            let decoded = |id| ReplayUpdate {
                id: RequestId(id),
                written: 1,
                kept: 3,
                rewound: false,
            };
            assert_eq!(s.replay_updates(&out), vec![decoded(1), decoded(2)]);
            s.on_step_done(&out);
            s.on_proposals(&proposals(2, &[(1, 0.99), (2, 0.99)]));
            let p = s.build_plan().unwrap();
            assert_eq!(drafts_of(&p), vec![(RequestId(1), 5), (RequestId(2), 5)]);
            let mut out = output_for(&p, 5);
            out.sampled = vec![
                (RequestId(1), 6),
                (RequestId(1), 7),
                (RequestId(1), 8),
                (RequestId(2), 9),
            ];
            out.sampled.extend((0..5).map(|t| (RequestId(2), 10 + t)));
            out.verified = vec![
                VerifyOutcome {
                    id: RequestId(1),
                    verified: 5,
                    accepted: 2,
                },
                VerifyOutcome {
                    id: RequestId(2),
                    verified: 5,
                    accepted: 5,
                },
            ];
            let updates = s.replay_updates(&out);
            assert_eq!(
                updates,
                vec![
                    ReplayUpdate {
                        id: RequestId(1),
                        written: 6,
                        kept: 6,
                        rewound: true,
                    },
                    ReplayUpdate {
                        id: RequestId(2),
                        written: 6,
                        kept: 9,
                        rewound: false,
                    },
                ]
            );
            s.on_step_done(&out);
            assert_eq!(s.stats().rejecting_verifies, 1);
            // An output that is not the next one in flight updates nothing.
            assert!(s.replay_updates(&out).is_empty());
        }

        #[test]
        fn overlapping_plans_count_the_most_a_verify_may_produce() {
            let mut s = speculative(2);
            s.submit(spec(1, 2, 8)).unwrap();
            let p0 = s.build_plan().unwrap(); // prefill: 1 token in flight
            s.on_proposals(&proposals(1, &[(1, 0.99)]));
            let p1 = s.build_plan().unwrap(); // verify of up to 5 drafts: 6 more in flight
            assert_eq!(drafts_of(&p1), vec![(RequestId(1), 5)]);
            s.on_step_done(&output_for(&p0, 5));
            // 1 generated + up to 6 in flight leaves room for 1 token: a verify of 0 drafts.
            let p2 = s.build_plan().unwrap();
            assert_eq!(drafts_of(&p2), vec![(RequestId(1), 0)]);
            assert!(s.build_plan().is_none(), "depth 2");
        }

        #[test]
        fn constrained_requests_decode_without_drafts() {
            let mut s = speculative(1);
            use crate::grammar::{Constraint, ConstraintStart, GrammarEngine};
            let engine =
                GrammarEngine::from_tokenizer_file(&crate::model_source::shipped_tokenizer())
                    .unwrap();
            let grammar = engine
                .compile(&Constraint::Regex("[0-9]{3}".into()))
                .unwrap();
            let mut constrained = spec(1, 2, 10);
            constrained.grammar = Some(Box::new(crate::messages::rank::SeqGrammar {
                matcher: engine.matcher(&grammar, ConstraintStart::Answer),
                end_token: EOS,
            }));
            s.submit(constrained).unwrap();
            let p = s.build_plan().unwrap();
            s.on_step_done(&output_for(&p, 5));
            s.on_proposals(&proposals(1, &[(1, 0.99)]));
            let p = s.build_plan().unwrap();
            assert_eq!(p.work[0].input, SeqInput::Decode);
        }
    }
}
