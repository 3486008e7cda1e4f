//! `RankMsg`, the protocol of `RankActor`, and the step plan it executes.
//!
//! The diff protocol (vLLM's): a sequence's data travels once in `new_seqs`; afterwards a plan
//! names the sequence and its input (a prefill chunk, or `Decode`, whose input token is the one
//! the rank itself sampled last for that sequence, so plan N+1 can be built before step N's
//! tokens are known); `finished` tells the rank which sequence state to free after the step.
//! With the prefix cache, a new sequence may attach cached blocks (`NewSeq::prefix`, before the
//! work) and a plan stores and drops blocks (`cache_ops`, in order, after the work): the
//! scheduler decides, the rank's executor holds the blocks.

use std::time::Duration;

use deepinfer_topology::{DpRank, RequestId, StepId};
use ractor::{ActorRef, RpcReplyPort};

use crate::dspark::profile::ProfileRequest;
use crate::dspark::schedule::StepRateTable;
use crate::grammar::GrammarMatcher;
use crate::messages::scheduler::SchedulerMsg;
use crate::prefix_cache::BlockHash;
use crate::rank::memory::StateMemory;
use crate::sampling::{SamplingParams, TokenLogprobs};

/// What kind of step a plan is (a metric label, and `Idle` is mandatory for DP attention: every
/// rank steps every iteration because the MoE collectives involve all of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepMode {
    Idle,
    Prefill,
    Decode,
    Mixed,
}

impl StepMode {
    pub fn as_str(self) -> &'static str {
        match self {
            StepMode::Idle => "idle",
            StepMode::Prefill => "prefill",
            StepMode::Decode => "decode",
            StepMode::Mixed => "mixed",
        }
    }
}

/// A request's structured-output state, moved to the rank with the sequence.
#[derive(Debug, Clone)]
pub struct SeqGrammar {
    /// The llguidance matcher; masks each sampled position.
    pub matcher: GrammarMatcher,
    /// Sampled instead when the grammar fails (ends the request): the EOS token.
    pub end_token: u32,
}

/// A sequence the rank has not seen yet.
#[derive(Debug, Clone)]
pub struct NewSeq {
    pub id: RequestId,
    pub sampling: SamplingParams,
    pub grammar: Option<Box<SeqGrammar>>,
    /// Decoder bounded replay: the first prompt position the decoder layers run on, planned by
    /// the `ReplayActor` at admission; `None` = every position (replay off or a short prompt).
    pub decoder_from: Option<u32>,
    /// DSpark: the rank drafts a first proposal right after the prompt's last chunk, so the
    /// first decode step can already verify drafts (the scheduler runs DSpark and the request is
    /// unconstrained).
    pub speculative: bool,
    /// Report log-probabilities with this many alternatives (`RequestSpec::logprobs`).
    pub logprobs: Option<usize>,
    /// A prefix-cache hit: attach these blocks, then the prefill continues at `replay_from`.
    pub prefix: Option<PrefixAttach>,
}

/// A prefix-cache hit of a new sequence: its first blocks, from position 0, and where its
/// prefill starts (a multiple of every ratio, at most the blocks' end; the scheduler's first
/// chunk begins there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixAttach {
    pub blocks: Vec<BlockHash>,
    pub replay_from: usize,
}

/// What a plan does to the rank's cached blocks after its work, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOp {
    /// Keep the block of sequence `id`'s positions `[start, start + block_tokens)` as `hash`
    /// (the sequence has processed them by the end of this step's work; the rank is told before
    /// the work, `RankExecutor::prepare_prefix_store`, so a V4 sequence holds the rows it takes).
    Store {
        id: RequestId,
        hash: BlockHash,
        start: usize,
    },
    /// Drop a cached block (evicted).
    Drop(BlockHash),
}

/// One sequence's input in a step.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqInput {
    /// The next chunk of the prompt. `last` chunks produce the first generated token.
    Prefill { tokens: Vec<u32>, last: bool },
    /// One token: the rank's own last sampled token for this sequence.
    Decode,
    /// DSpark: the rank's last sampled token (the anchor) followed by up to `drafts` tokens of
    /// the rank's own current proposal for this sequence; the rank accepts a prefix of them,
    /// samples one more token, rolls back past the rejected ones, and proposes again.
    Verify { drafts: usize },
}

/// One sequence's work in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqWork {
    pub id: RequestId,
    pub input: SeqInput,
}

/// Everything a rank executes in one step.
#[derive(Debug, Clone)]
pub struct StepPlan {
    pub step: StepId,
    pub mode: StepMode,
    pub new_seqs: Vec<NewSeq>,
    pub work: Vec<SeqWork>,
    /// Prefix-cache stores and drops, after the work and before `finished` are freed.
    pub cache_ops: Vec<CacheOp>,
    /// Sequences whose state the rank frees after this step's work.
    pub finished: Vec<RequestId>,
}

impl StepPlan {
    /// Tokens this plan feeds through the model.
    pub fn token_count(&self) -> usize {
        self.work
            .iter()
            .map(|w| match &w.input {
                SeqInput::Prefill { tokens, .. } => tokens.len(),
                SeqInput::Decode => 1,
                SeqInput::Verify { drafts } => 1 + drafts,
            })
            .sum()
    }
}

/// Timing of one step on the rank thread.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepTiming {
    /// Host (CPU) time the rank thread spent preparing and launching the step.
    pub host: Duration,
    /// Of `host`, the part that ran while an earlier step was still on the device (hidden by
    /// async scheduling).
    pub hidden_host: Duration,
    /// From launch to results available.
    pub total: Duration,
}

/// The outcome of one `Verify` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyOutcome {
    pub id: RequestId,
    /// Drafts fed to the model after the anchor (tokens).
    pub verified: usize,
    /// Of those, the accepted prefix (tokens); `accepted + 1` tokens were produced.
    pub accepted: usize,
}

/// A proposal the rank drafted after this step, summarised for the verifier: the rank keeps
/// the drafted tokens, the scheduler only needs their confidences to choose verify lengths.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftSummary {
    pub id: RequestId,
    /// Raw confidence (confidence-head logit) of each drafted token, in order.
    pub confidences: Vec<f32>,
}

/// A finished step: the tokens sampled for the sequences that produced one.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub step: StepId,
    pub dp: DpRank,
    pub mode: StepMode,
    /// Tokens produced, in order; a `Verify` entry contributes its accepted drafts and its bonus
    /// token (several consecutive entries with the same id).
    pub sampled: Vec<(RequestId, u32)>,
    /// The log-probabilities of the sampled tokens of the sequences that asked for them, in the
    /// order of `sampled`.
    pub logprobs: Vec<(RequestId, TokenLogprobs)>,
    /// One per `Verify` entry of the plan.
    pub verified: Vec<VerifyOutcome>,
    /// Proposals drafted after this step (for the next one).
    pub drafts: Vec<DraftSummary>,
    /// Sequences whose state the rank holds after the step (after `finished` were freed).
    pub live_sequences: usize,
    pub timing: StepTiming,
}

/// Why a rank could not run a step.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RankError {
    #[error("the rank thread panicked: {message}")]
    Panicked { message: String },
    #[error("the backend failed: {message}")]
    Backend { message: String },
    #[error("the rank thread is gone")]
    ThreadGone,
    #[error("taken out of service by the supervisor: {message}")]
    Lost { message: String },
}

/// Messages of `RankActor`.
#[derive(Debug)]
pub enum RankMsg {
    /// DSpark: measure the steps-per-second table on the rank's executor (sent once, by the
    /// supervisor to every rank at the same time, before `Attach`).
    Profile(
        ProfileRequest,
        RpcReplyPort<Result<StepRateTable, RankError>>,
    ),
    /// `[memory] state_memory_fraction`: where the rank's states live and, on a device, its free
    /// memory once the weights are resident (`RankExecutor::state_memory`; sent once, by the
    /// supervisor to every rank at the same time, before `Attach`).
    StateMemory(RpcReplyPort<Result<StateMemory, RankError>>),
    /// Connect the rank thread to its scheduler (sent once, before any plan).
    Attach(ActorRef<SchedulerMsg>),
    /// Run a plan; at most `overlap_depth` are outstanding (the scheduler's credit count).
    Execute(Box<StepPlan>),
    /// The rank thread died; the actor fails so the supervisor applies its policy.
    ThreadExited(RankError),
}
