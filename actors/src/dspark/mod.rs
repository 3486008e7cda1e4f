//! DSpark speculative decoding: the `DSparkActor`, the confidence-scheduled choice of
//! verification lengths, lossless acceptance and the start-up step-rate profile.
//!
//! Where the work happens (ARCHITECTURE §4: messages once per step, owned data):
//! - Drafting runs on the rank thread (`rank::worker`), because the drafter reads the sequence
//!   state the rank owns (the DSpark context rings fed by every target forward): after each
//!   `Verify` entry the worker calls `RankExecutor::draft` (the checkpoint's DSpark heads through
//!   `Model::draft`) and keeps the drafted tokens; the step output carries only each proposal's
//!   raw confidences.
//! - The scheduler forwards them, once per step, to this actor (`DSparkMsg::Drafted`), which does
//!   the drafter's scheduling side (`state.rs`): calibration `sigmoid(c / T)`, cutting to
//!   `max_draft_tokens`, dropping stale batches, and sends the verifier (that rank's
//!   `SchedulerActor`) a `ProposalBatch` tagged with the step it is for.
//! - The scheduler chooses each request's verify length from the freshest confidences it holds
//!   (`schedule.rs`, with the steps-per-second table from `profile.rs`); the rank verifies the
//!   anchor plus that many of its own drafts and accepts them with `accept.rs`.
//!
//! Owns: `DSparkState`. Accepts: `DSparkMsg::Drafted`. Sends: `SchedulerMsg::Proposals`.
//! Failure: a batch from an unknown rank is logged and dropped; the actor keeps running.

pub mod accept;
pub mod profile;
pub mod schedule;
pub mod state;

use ractor::{ActorProcessingErr, ActorRef};

use crate::messages::dspark::DSparkMsg;
use crate::messages::scheduler::SchedulerMsg;
use crate::shell::{Shell, ShellActor};
use state::{DSparkState, Routed};

/// Arguments of `DSparkActor`.
pub struct DSparkArgs {
    /// The verifiers, one per DP rank, in rank order.
    pub schedulers: Vec<ActorRef<SchedulerMsg>>,
    /// Most drafts a request verifies per step.
    pub max_draft_tokens: usize,
}

pub struct DSparkShell {
    state: DSparkState,
    schedulers: Vec<ActorRef<SchedulerMsg>>,
}

/// The actor (stateless handler; state in `DSparkShell`).
pub type DSparkActor = ShellActor<DSparkShell>;

impl Shell for DSparkShell {
    type Msg = DSparkMsg;
    type Args = DSparkArgs;

    async fn start(_: ActorRef<Self::Msg>, args: Self::Args) -> Result<Self, ActorProcessingErr> {
        Ok(DSparkShell {
            state: DSparkState::new(args.schedulers.len(), args.max_draft_tokens),
            schedulers: args.schedulers,
        })
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        match message {
            DSparkMsg::Drafted(batch) => match self.state.on_drafted(*batch) {
                Ok(Routed::Forward(dp, proposals)) => {
                    if let Some(scheduler) = self.schedulers.get(dp.index()) {
                        // A stopped scheduler means the engine is shutting down.
                        let _ = scheduler.cast(SchedulerMsg::Proposals(Box::new(proposals)));
                    }
                }
                Ok(Routed::Stale) => {
                    tracing::trace!(
                        stale = self.state.stale_batches(),
                        "stale DSpark batch dropped"
                    );
                }
                Err(error) => tracing::warn!(%error, "DSpark batch dropped"),
            },
        }
        Ok(())
    }
}
