//! `SchedulerMsg`, the protocol of one DP rank's `SchedulerActor`.

use deepinfer_topology::{RequestId, StepId};
use ractor::RpcReplyPort;

use crate::messages::rank::{RankError, StepOutput};
use crate::messages::request::Admitted;

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
