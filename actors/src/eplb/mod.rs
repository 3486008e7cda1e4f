//! `EplbActor`: live expert-parallel load balancing.
//!
//! Owns: the `EplbState` (step clock, schedule, committed placement and epoch), the refs of the
//! `ExpertGroupActor`s (EP rank order) and the engine's `ExpertParallel`.
//! Accepts: `StepExecuted` (once per rank step, from the rank threads), `RebalanceNow`, `Status`.
//! Sends: `Stage`, `Commit`, `Abort` to the expert groups; reads and resets the load counters of
//! the committed `LocalComm` (every EP rank at one point, so the ranks' windows agree).
//! Ordering: a rebalance measures the window's per-slot counts, solves DeepSeek's EPLB (with the
//! topology's redundant experts), stages the new placement on every EP rank (weights copied),
//! commits it on every group, then publishes the new `LocalComm` in `ExpertParallel`: ranks adopt
//! it at their next step boundary, steps already running finish on the old epoch, so no step
//! mixes epochs and no request is lost or changed (every replica holds the model's weights and
//! the combine order is fixed in the model). Rebalances run one at a time.
//! Failure: a failed stage aborts the staged shards and keeps the placement in use; the error is
//! logged (automatic) or replied (`RebalanceNow`), never fatal.

pub mod state;

use std::sync::Arc;
use std::time::Duration;

use deepinfer_topology::{EpRank, ExpertPlacement, PlacementEpoch};
use ractor::rpc::CallResult;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::comm::{Comm, EpError, LocalComm};
use crate::experts::parallel::ExpertParallel;
use crate::experts::{ExpertGroupActor, ExpertGroupArgs};
use crate::messages::eplb::{EplbMsg, RebalanceReport};
use crate::messages::experts::{ExpertGroupMsg, StagedShard};
use crate::metrics as m;
use state::{EplbAction, EplbState};

/// How long one expert group may take to answer (staging copies weights).
const GROUP_TIMEOUT: Duration = Duration::from_secs(120);

/// Arguments of `EplbActor`.
pub struct EplbArgs {
    pub ep: Arc<ExpertParallel>,
    /// One per EP rank, in rank order.
    pub groups: Vec<ActorRef<ExpertGroupMsg>>,
}

pub struct EplbActorState {
    ep: Arc<ExpertParallel>,
    groups: Vec<ActorRef<ExpertGroupMsg>>,
    eplb: EplbState,
}

/// The actor (stateless handler; state in `EplbActorState`).
pub struct EplbActor;

async fn ask<T: Send + 'static>(
    group: &ActorRef<ExpertGroupMsg>,
    build: impl FnOnce(RpcReplyPort<T>) -> ExpertGroupMsg,
) -> Result<T, EpError> {
    match group.call(build, Some(GROUP_TIMEOUT)).await {
        Ok(CallResult::Success(value)) => Ok(value),
        Ok(CallResult::Timeout) => Err(EpError::Actor("an expert group timed out".into())),
        Ok(CallResult::SenderError) => {
            Err(EpError::Actor("an expert group dropped a reply".into()))
        }
        Err(e) => Err(EpError::Actor(e.to_string())),
    }
}

impl EplbActorState {
    async fn rebalance(&mut self) -> Result<RebalanceReport, EpError> {
        let loads = self.ep.current().take_loads();
        let measured = self.eplb.measure(&loads)?;
        let measured_epoch = self.eplb.epoch();
        m::record_eplb_imbalance(&measured.imbalance);
        let mut report = measured.report(measured_epoch);
        let Some((placement, planned)) = self.eplb.plan(&measured)? else {
            self.eplb.record(report.clone());
            return Ok(report);
        };
        report.planned_imbalance = planned;
        let placement = Arc::new(placement);
        let epoch = self.eplb.begin_stage();
        match self.stage_and_commit(epoch, &placement).await {
            Ok(copied) => {
                self.eplb.commit(epoch, placement)?;
                report.epoch = epoch;
                report.copied_experts = copied;
                report.committed = true;
                m::record_eplb_commit(epoch);
                tracing::info!(%epoch, copied, "expert placement committed");
                self.eplb.record(report.clone());
                Ok(report)
            }
            Err(e) => {
                for group in &self.groups {
                    let _ = group.cast(ExpertGroupMsg::Abort { epoch });
                }
                self.eplb.abort();
                Err(e)
            }
        }
    }

    /// Stages `placement` as `epoch` on every group, commits it on every group, then publishes
    /// the transport. Returns the expert slots copied.
    async fn stage_and_commit(
        &self,
        epoch: PlacementEpoch,
        placement: &Arc<ExpertPlacement>,
    ) -> Result<usize, EpError> {
        let mut staged: Vec<StagedShard> = Vec::with_capacity(self.groups.len());
        for group in &self.groups {
            let placement = placement.clone();
            let shard = ask(group, |reply| ExpertGroupMsg::Stage {
                epoch,
                placement,
                reply,
            })
            .await??;
            staged.push(shard);
        }
        let copied = staged.iter().map(|s| s.report.copied).sum();
        let comm = LocalComm::new(
            epoch,
            self.ep.source().clone(),
            placement.clone(),
            staged.into_iter().map(|s| s.shard).collect(),
        )?;
        for group in &self.groups {
            ask(group, |reply| ExpertGroupMsg::Commit { epoch, reply }).await??;
        }
        self.ep.commit(Arc::new(comm));
        Ok(copied)
    }
}

/// The expert-parallel children of the supervisor.
pub(crate) struct ExpertActors {
    /// One `ExpertGroupActor` per EP rank.
    pub groups: Vec<(EpRank, ActorCell)>,
    pub eplb: ActorCell,
}

/// Spawns one `ExpertGroupActor` per EP rank (each over its epoch-0 shard) and the
/// `EplbActor`, linked to `supervisor`, and attaches the EPLB to `parallel` so rank steps reach
/// it.
pub(crate) async fn spawn_expert_actors(
    parallel: Arc<ExpertParallel>,
    supervisor: ActorCell,
) -> Result<ExpertActors, String> {
    let mut cells = Vec::new();
    let mut groups = Vec::new();
    let mut ranks = Vec::new();
    for shard in parallel.current().shards() {
        let rank = shard.rank();
        let args = ExpertGroupArgs {
            source: parallel.source().clone(),
            current: shard.clone(),
        };
        match Actor::spawn_linked(None, ExpertGroupActor, args, supervisor.clone()).await {
            Ok((group, _)) => {
                cells.push(group.get_cell());
                ranks.push((rank, group.get_cell()));
                groups.push(group);
            }
            Err(e) => {
                stop_cells(&cells).await;
                return Err(format!("expert group {rank}: {e}"));
            }
        }
    }
    let args = EplbArgs {
        ep: parallel.clone(),
        groups,
    };
    match Actor::spawn_linked(None, EplbActor, args, supervisor).await {
        Ok((eplb, _)) => {
            let eplb_cell = eplb.get_cell();
            parallel.attach_eplb(eplb);
            Ok(ExpertActors {
                groups: ranks,
                eplb: eplb_cell,
            })
        }
        Err(e) => {
            stop_cells(&cells).await;
            Err(format!("EPLB actor: {e}"))
        }
    }
}

async fn stop_cells(cells: &[ActorCell]) {
    for cell in cells {
        let _ = cell
            .stop_and_wait(Some("engine start failed".into()), Some(GROUP_TIMEOUT))
            .await;
    }
}

impl Actor for EplbActor {
    type Msg = EplbMsg;
    type State = EplbActorState;
    type Arguments = EplbArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<EplbMsg>,
        args: EplbArgs,
    ) -> Result<EplbActorState, ActorProcessingErr> {
        let current = args.ep.current();
        // Picks served before the engine started (e.g. a step-rate profile) are no traffic.
        current.take_loads();
        let eplb = EplbState::new(
            args.ep.settings().eplb,
            args.ep.shape(),
            current.epoch(),
            current.placement().clone(),
        );
        m::record_eplb_commit(eplb.epoch());
        Ok(EplbActorState {
            ep: args.ep,
            groups: args.groups,
            eplb,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<EplbMsg>,
        message: EplbMsg,
        state: &mut EplbActorState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            EplbMsg::StepExecuted { dp, epoch } => match state.eplb.on_step(dp, epoch) {
                Some(EplbAction::StartWindow) => {
                    state.ep.current().take_loads();
                }
                Some(EplbAction::Rebalance) => {
                    if let Err(error) = state.rebalance().await {
                        tracing::warn!(%error, "EPLB rebalance failed; the placement stays");
                    }
                }
                None => {}
            },
            EplbMsg::RebalanceNow(reply) => {
                let _ = reply.send(state.rebalance().await);
            }
            EplbMsg::Status(reply) => {
                let _ = reply.send(state.eplb.status());
            }
        }
        Ok(())
    }
}
