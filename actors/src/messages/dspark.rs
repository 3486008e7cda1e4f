//! `DSparkMsg`, the protocol of the `DSparkActor`, and the proposal batch it sends the verifier.

use deepinfer_topology::{DpRank, RequestId, StepId};

use crate::messages::rank::DraftSummary;

/// Proposals a rank drafted after step `drafted_after`, as the rank reported them (raw
/// confidence-head logits).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftedBatch {
    pub dp: DpRank,
    pub drafted_after: StepId,
    pub drafts: Vec<DraftSummary>,
}

/// One request's calibrated proposal: the probability that each draft survives given that the
/// earlier ones did.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibratedProposal {
    pub id: RequestId,
    pub confidences: Vec<f32>,
}

/// What the verifier (the rank's `SchedulerActor`) receives: calibrated proposals for the steps
/// from `for_step` on (the first step the rank launches after drafting them).
#[derive(Debug, Clone, PartialEq)]
pub struct ProposalBatch {
    pub for_step: StepId,
    pub proposals: Vec<CalibratedProposal>,
}

/// Messages of `DSparkActor`.
#[derive(Debug)]
pub enum DSparkMsg {
    /// From a scheduler, once per step that drafted anything.
    Drafted(Box<DraftedBatch>),
}
