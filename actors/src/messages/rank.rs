//! `RankMsg`, the protocol of `RankActor`, and the step plan it executes.
//!
//! The diff protocol (vLLM's): a sequence's data travels once in `new_seqs`; afterwards a plan
//! names the sequence and its input (a prefill chunk, or `Decode`, whose input token is the one
//! the rank itself sampled last for that sequence, so plan N+1 can be built before step N's
//! tokens are known); `finished` tells the rank which sequence state to free after the step.

use std::time::Duration;

use deepinfer_topology::{DpRank, RequestId, StepId};
use ractor::ActorRef;

use crate::grammar::GrammarMatcher;
use crate::messages::scheduler::SchedulerMsg;
use crate::sampling::SamplingParams;

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
}

/// One sequence's input in a step.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqInput {
    /// The next chunk of the prompt. `last` chunks produce the first generated token.
    Prefill { tokens: Vec<u32>, last: bool },
    /// One token: the rank's own last sampled token for this sequence.
    Decode,
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

/// A finished step: the tokens sampled for the sequences that produced one.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub step: StepId,
    pub dp: DpRank,
    pub mode: StepMode,
    pub sampled: Vec<(RequestId, u32)>,
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
    /// Connect the rank thread to its scheduler (sent once, before any plan).
    Attach(ActorRef<SchedulerMsg>),
    /// Run a plan; at most `overlap_depth` are outstanding (the scheduler's credit count).
    Execute(Box<StepPlan>),
    /// The rank thread died; the actor fails so the supervisor applies its policy.
    ThreadExited(RankError),
}
