//! `SchedulerMsg`, the protocol of one DP rank's `SchedulerActor`.

use deepinfer_topology::{RequestId, StepId};
use ractor::{ActorRef, RpcReplyPort};

use crate::messages::dspark::{DSparkMsg, ProposalBatch};
use crate::messages::rank::{RankError, StepOutput};
use crate::messages::request::Admitted;
use crate::scheduler::prefix::PrefixCounters;

/// A snapshot of one scheduler (for tests, the supervisor and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    /// Plans sent to the rank and not answered yet.
    pub in_flight_steps: usize,
    /// Steps completed so far, `Idle` ones included.
    pub steps_done: u64,
    /// Of `steps_done`, the `Idle` ones.
    pub idle_steps_done: u64,
    /// Sequence states the rank held after the last completed step.
    pub rank_live_sequences: usize,
    /// True once the rank failed; the scheduler then refuses work.
    pub rank_failed: bool,
    /// DSpark: drafted tokens reported by the rank.
    pub draft_tokens_proposed: u64,
    /// DSpark: drafted tokens fed to the model in verify entries.
    pub draft_tokens_verified: u64,
    /// DSpark: of those, the accepted ones.
    pub draft_tokens_accepted: u64,
    /// DSpark: verify entries completed (each produces `accepted + 1` tokens).
    pub verify_entries: u64,
    /// DSpark: of those, the ones that rejected a draft (the rank rolled the sequence back).
    pub rejecting_verifies: u64,
    /// DSpark: proposal batches dropped as stale.
    pub stale_proposals: u64,
    /// State pool blocks of the rank (0 without a pool).
    pub state_blocks_total: usize,
    /// Of those, the blocks held by sequences or retired and not freed by the rank yet.
    pub state_blocks_used: usize,
    /// Requests preempted for state memory (each resumes by recompute).
    pub preemptions: u64,
    /// Preempted requests admitted again.
    pub resumed: u64,
    /// The rank's prefix cache (all 0 when it is off).
    pub prefix: PrefixStats,
}

/// A rank's prefix cache in a [`SchedulerStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixStats {
    /// Lookups and hits (requests and tokens).
    pub counters: PrefixCounters,
    /// Bytes and blocks cached now (bytes <= `budget_bytes`).
    pub cached_bytes: u64,
    pub cached_blocks: usize,
    pub evictions: u64,
    pub budget_bytes: u64,
}

impl SchedulerStats {
    /// Mean tokens produced per verify entry (accepted drafts + the bonus token); `None`
    /// before the first verify.
    pub fn mean_accepted_length(&self) -> Option<f64> {
        (self.verify_entries > 0).then(|| {
            (self.draft_tokens_accepted + self.verify_entries) as f64 / self.verify_entries as f64
        })
    }
}

/// Messages of `SchedulerActor`.
#[derive(Debug)]
pub enum SchedulerMsg {
    /// A validated request from the frontend.
    Submit(Box<Admitted>),
    /// Stop generating for a request and free its state.
    Abort(RequestId),
    /// Another rank got work: step (`Idle` if need be) so collectives can complete.
    Wake,
    /// From the rank thread.
    StepDone(Box<StepOutput>),
    /// From the `DSparkActor`: calibrated confidences of the rank's latest proposals.
    Proposals(Box<ProposalBatch>),
    /// From the supervisor: the `DSparkActor` that calibrates this rank's proposals.
    AttachDrafter(ActorRef<DSparkMsg>),
    /// From the rank thread: the step failed and the thread is gone.
    StepFailed {
        step: StepId,
        error: RankError,
    },
    /// From the supervisor: the rank is lost (its actor failed).
    RankLost(RankError),
    Stats(RpcReplyPort<SchedulerStats>),
    /// Reply once no request is left on this rank.
    Drain(RpcReplyPort<()>),
}
