//! MoE dispatch and combine between DP ranks and EP ranks, inside a rank's step.
//!
//! Owns: the `Comm` trait (how one layer's routed rows reach the EP ranks holding replicas of
//! their experts and come back), `LocalComm` (`local.rs`: the shards of this process's EP ranks,
//! computed on the caller's thread; the other processes' EP ranks through `RemoteRanks`),
//! `RemoteRanks` and `ExpertServer` (`remote.rs`: the socket transport), the node bootstrap
//! (`bootstrap.rs`, which also hands CUDA nodes NCCL's unique id), `StepBeacon` (`steps.rs`:
//! across CUDA nodes, the step counts that keep the nodes' ranks in lockstep), the byte format
//! (`wire.rs`), `StepExperts` (the model's `RoutedExperts` hook
//! for one step over one `Comm`) and `EpError`.
//!
//! The protocol, per DP rank, step and backbone layer (one `Comm::serve_layer` call):
//! 1. Plan (`LayerPlan`): every (row, pick) goes to the EP rank of the replica serving its
//!    expert; each EP rank's rows are listed in increasing (row, pick) order. The counts per EP
//!    rank are known before any row moves.
//! 2. Dispatch: each EP rank gets its count, then per row its local slot and routing weight, then
//!    the rows (`wire::Dispatch`); this process's EP ranks are computed in place.
//! 3. Combine: each EP rank answers with its output rows in the same order (`wire::Reply`); they
//!    are put back at their (row, pick), and the model sums each row's picks in increasing logical
//!    expert id, whatever served them: every layout gives the bits of `ep = 1`.
//!
//! Every exchange between processes carries its tag (session, step, layer, epoch) and has a
//! timeout (`[cluster] exchange_timeout_ms`); a peer that fails or does not answer fails the
//! step with an error naming the DP rank, step, layer and EP rank, and stays failed (later calls
//! fail at once, like `deepinfer_model::expert_exchange`). The step's error fails the rank, and
//! the supervisor stops the engine (its rule 3: ep > 1).
//! Ordering: a `LocalComm` is immutable and belongs to one `PlacementEpoch`; a new placement is a
//! new `LocalComm`, adopted by a rank at its next step boundary, so no step mixes epochs; a
//! remote EP rank serves rows of its current, staged or previous epoch (nodes adopt a new one at
//! their own step boundaries, see `remote.rs`) and refuses any other.
//! Replica choice: a pure function of (layer, expert, the token's activation bits), so it does
//! not depend on the batch, the DP rank or the timing.

pub mod bootstrap;
mod local;
pub mod remote;
pub mod steps;
pub mod wire;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use deepinfer_model::expert_dispatch::{ExpertPick, RoutedExperts};
use deepinfer_topology::{DpRank, EpRank, PlacementEpoch, PlacementError};

pub use local::{LayerPlan, LocalComm, replica_index, token_key};

/// Spawns the thread `name` that accepts `listener`'s connections, each to `accepted`, until
/// `stop` is set (its owner then connects once to wake the loop).
pub(crate) fn accept_until_stopped(
    name: &str,
    listener: std::net::TcpListener,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    mut accepted: impl FnMut(std::net::TcpStream) + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            for conn in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                accepted(conn);
            }
        })
        .map(drop)
}

/// A loopback address whose port is free right now (for tests over real sockets).
#[cfg(test)]
pub(crate) fn free_loopback() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// An expert-parallel failure: a placement or shard that does not fit the model, a stale epoch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EpError {
    #[error("expert placement: {0}")]
    Placement(#[from] PlacementError),
    #[error("expert placement: {what} (expected {expected}, found {found})")]
    Shape {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("expert placement layer {layer}: {message}")]
    Layer { layer: usize, message: String },
    #[error("{rank}: shard of {found}, but the placement being built is {expected}")]
    ShardEpoch {
        rank: EpRank,
        expected: PlacementEpoch,
        found: PlacementEpoch,
    },
    #[error("{rank} layer {layer} slot {slot}: holds {found}, the placement says {expected}")]
    ShardSlot {
        rank: EpRank,
        layer: usize,
        slot: usize,
        expected: String,
        found: String,
    },
    #[error("{rank}: cannot commit {epoch}: {message}")]
    Commit {
        rank: EpRank,
        epoch: PlacementEpoch,
        message: String,
    },
    #[error("EPLB cannot commit {epoch}: {message}")]
    Staging {
        epoch: PlacementEpoch,
        message: String,
    },
    #[error("model: {0}")]
    Model(String),
    #[error("expert-parallel actor unreachable: {0}")]
    Actor(String),
    #[error(
        "DP rank {} step {} layer {}: EP rank {} on node {node} ({addr}) did not answer within \
         {waited_ms} ms",
        at.dp.0, at.step, at.layer, rank.0
    )]
    Timeout {
        at: LayerAt,
        rank: EpRank,
        node: usize,
        addr: String,
        waited_ms: u128,
    },
    #[error(
        "DP rank {} step {} layer {}: EP rank {} on node {node} ({addr}) failed: {reason}",
        at.dp.0, at.step, at.layer, rank.0
    )]
    PeerFailed {
        at: LayerAt,
        rank: EpRank,
        node: usize,
        addr: String,
        reason: String,
    },
    #[error("node bootstrap: {0}")]
    Bootstrap(String),
    #[error("EPLB: node {node} ({addr}) failed: {reason}")]
    Control {
        node: usize,
        addr: String,
        reason: String,
    },
}

/// Where one layer's exchange is: the DP rank, its step (the rank's own counter) and the
/// backbone layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerAt {
    pub dp: DpRank,
    pub step: u64,
    pub layer: usize,
}

/// What serving one layer's rows produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedLayer {
    /// `outputs[r][k]`: pick `k` of row `r` (`dim` wide, the routing weight applied).
    pub outputs: Vec<Vec<Vec<f32>>>,
    /// Lowest and highest placement epoch of the shards that computed them (`None`: no pick).
    pub epochs: Option<(PlacementEpoch, PlacementEpoch)>,
}

/// The MoE transport of one placement epoch.
pub trait Comm: Send + Sync {
    /// The placement epoch this transport serves.
    fn epoch(&self) -> PlacementEpoch;
    /// EP ranks it spans.
    fn ep_ranks(&self) -> usize;
    /// Serves every pick of the rows `x` (`[picks.len(), dim]`) of one layer (see the module
    /// doc's protocol): `picks[r]` are row `r`'s picks in increasing expert id.
    fn serve_layer(
        &self,
        at: LayerAt,
        x: &[f32],
        picks: &[Vec<ExpertPick>],
    ) -> Result<ServedLayer, EpError>;
}

/// The model's routed-expert hook for one step of one DP rank: every layer's picks go through one
/// `Comm`; the epochs of the shards that served the step are recorded, and so is the first
/// failure (after it, every layer gets rows of zeros at once: the caller fails the step and
/// discards its outputs, see `failure`).
pub struct StepExperts<'c> {
    comm: &'c dyn Comm,
    dp: DpRank,
    step: u64,
    lowest: AtomicU32,
    highest: AtomicU32,
    failure: Mutex<Option<EpError>>,
}

impl<'c> StepExperts<'c> {
    /// Step `step` of DP rank `dp` over `comm`.
    pub fn new(comm: &'c dyn Comm, dp: DpRank, step: u64) -> Self {
        StepExperts {
            comm,
            dp,
            step,
            lowest: AtomicU32::new(u32::MAX),
            highest: AtomicU32::new(0),
            failure: Mutex::new(None),
        }
    }

    /// The lowest and highest epoch that served a pick of this step (`None` before any pick).
    pub fn epochs_seen(&self) -> Option<(PlacementEpoch, PlacementEpoch)> {
        let lowest = self.lowest.load(Ordering::Relaxed);
        let highest = self.highest.load(Ordering::Relaxed);
        (lowest <= highest).then_some((PlacementEpoch(lowest), PlacementEpoch(highest)))
    }

    /// The exchange that failed this step, if any: the step's outputs are then meaningless.
    pub fn failure(&self) -> Option<EpError> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl RoutedExperts for StepExperts<'_> {
    fn run(&self, layer: usize, x: &[f32], picks: &[Vec<ExpertPick>]) -> Vec<Vec<Vec<f32>>> {
        let zeros = || {
            let dim = x.len() / picks.len().max(1);
            picks
                .iter()
                .map(|row| vec![vec![0.0; dim]; row.len()])
                .collect()
        };
        if self.failure().is_some() {
            return zeros();
        }
        let at = LayerAt {
            dp: self.dp,
            step: self.step,
            layer,
        };
        match self.comm.serve_layer(at, x, picks) {
            Ok(served) => {
                if let Some((lowest, highest)) = served.epochs {
                    self.lowest.fetch_min(lowest.get(), Ordering::Relaxed);
                    self.highest.fetch_max(highest.get(), Ordering::Relaxed);
                }
                served.outputs
            }
            Err(error) => {
                let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
                failure.get_or_insert(error);
                zeros()
            }
        }
    }
}
