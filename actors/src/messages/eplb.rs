//! `EplbMsg`, the protocol of `EplbActor`.

use deepinfer_topology::{DpRank, PlacementEpoch};
use ractor::RpcReplyPort;

use crate::comm::EpError;
use crate::comm::wire::{Control, ControlReply};

/// What one rebalance measured and did.
#[derive(Debug, Clone, PartialEq)]
pub struct RebalanceReport {
    /// The epoch the loads were measured under.
    pub measured_epoch: PlacementEpoch,
    /// The epoch in use after this rebalance (= `measured_epoch` when nothing changed).
    pub epoch: PlacementEpoch,
    /// Per layer: picks served by the busiest EP rank / the mean over EP ranks (1 = even),
    /// measured over the window.
    pub measured_imbalance: Vec<f64>,
    /// Per layer: the same ratio the new placement expects for the measured logical loads.
    pub planned_imbalance: Vec<f64>,
    /// Picks measured in the window, all layers.
    pub measured_picks: u64,
    /// Expert slots whose weights were copied for the new placement.
    pub copied_experts: usize,
    /// False when the placement stayed (a layer's window too thin to plan from, see
    /// `eplb::state::MIN_PICKS_PER_SLOT`, or the solver returned the same placement).
    pub committed: bool,
}

/// The EPLB's view, for tests and the supervisor.
#[derive(Debug, Clone, PartialEq)]
pub struct EplbStatus {
    pub epoch: PlacementEpoch,
    /// Engine steps counted (the most any DP rank executed).
    pub steps: u64,
    pub rebalances: u64,
    /// The oldest epoch a DP rank's last step ran on: shards of older epochs are retired.
    pub oldest_rank_epoch: PlacementEpoch,
    /// The last rebalance's report.
    pub last: Option<RebalanceReport>,
}

/// Messages of `EplbActor`.
#[derive(Debug)]
pub enum EplbMsg {
    /// A rank finished a step on placement `epoch` (from the rank thread, once per step).
    StepExecuted {
        dp: DpRank,
        epoch: PlacementEpoch,
    },
    /// Measure the loads since the last measurement and rebalance now.
    RebalanceNow(RpcReplyPort<Result<RebalanceReport, EpError>>),
    Status(RpcReplyPort<EplbStatus>),
    /// On a node other than 0: node 0's EPLB asks (through this node's expert server) for this
    /// node's loads, or to stage, commit or abort a placement epoch on its EP ranks.
    Follow {
        control: Control,
        reply: RpcReplyPort<ControlReply>,
    },
}
