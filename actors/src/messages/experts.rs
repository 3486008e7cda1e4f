//! `ExpertGroupMsg`, the protocol of one EP rank's `ExpertGroupActor`. Placement-scoped
//! messages carry the `PlacementEpoch` they are about.

use std::sync::Arc;

use deepinfer_topology::{ExpertPlacement, PlacementEpoch};
use ractor::RpcReplyPort;

use crate::comm::EpError;
use crate::experts::shard::{ExpertShard, StageReport};

/// Picks served by one shard's physical slots since its counters were last read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLoads {
    /// The epoch of the shard the counts come from.
    pub epoch: PlacementEpoch,
    /// `[layer][local slot]`.
    pub per_slot: Vec<Vec<u64>>,
}

/// A shard built for a placement, not yet in use.
#[derive(Debug, Clone)]
pub struct StagedShard {
    pub shard: Arc<ExpertShard>,
    pub report: StageReport,
}

/// Messages of `ExpertGroupActor`.
#[derive(Debug)]
pub enum ExpertGroupMsg {
    /// Build (copy weights for) this rank's shard of `placement` as epoch `epoch`.
    Stage {
        epoch: PlacementEpoch,
        placement: Arc<ExpertPlacement>,
        reply: RpcReplyPort<Result<StagedShard, EpError>>,
    },
    /// The staged shard of `epoch` is now the one in use.
    Commit {
        epoch: PlacementEpoch,
        reply: RpcReplyPort<Result<(), EpError>>,
    },
    /// Drop a staged shard of `epoch` (a rebalance that did not commit).
    Abort { epoch: PlacementEpoch },
}
