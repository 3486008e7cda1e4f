//! `EplbActor`: live expert-parallel load balancing.
//!
//! Owns: the `EplbState` (step clock, schedule, committed placement and epoch), the refs of the
//! `ExpertGroupActor`s (EP rank order) and the engine's `ExpertParallel`.
//! Accepts: `StepExecuted` (once per rank step, from the rank threads), `RebalanceNow`, `Status`,
//! and on a node other than 0 of several, `Follow` (node 0's requests, from the expert server).
//! Sends: `Stage`, `Commit`, `Abort` to the expert groups; reads and resets the load counters of
//! the committed `LocalComm` (every EP rank at one point, so the ranks' windows agree). Across
//! nodes, node 0's also sends `wire::Control` requests to the other nodes (their loads, stage,
//! commit, abort), which their EPLB actors run on their own groups (README "Expert parallelism
//! across nodes").
//! Ordering: a rebalance measures the window's per-slot counts, solves DeepSeek's EPLB (with the
//! topology's redundant experts), stages the new placement on every EP rank (weights copied),
//! commits it on every group, then publishes the new `LocalComm` in `ExpertParallel`: ranks adopt
//! it at their next step boundary, steps already running finish on the old epoch, so no step
//! mixes epochs and no request is lost or changed (every replica holds the model's weights and
//! the combine order is fixed in the model). Rebalances run one at a time.
//! Across nodes a staged epoch is served to peers' rows before this node commits it, so the
//! nodes adopt it at their own step boundaries.
//! Failure: a failed stage (a node that fails or does not answer, named) aborts the staged
//! shards on every node and keeps the placement in use; the error is logged (automatic) or
//! replied (`RebalanceNow`), never fatal.

pub mod state;

use std::sync::Arc;
use std::time::Duration;

use deepinfer_topology::{EpRank, ExpertPlacement, PlacementEpoch};
use ractor::rpc::CallResult;
use ractor::{ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::comm::wire::{Control, ControlReply};
use crate::comm::{Comm, EpError, LocalComm};
use crate::experts::parallel::ExpertParallel;
use crate::experts::{ExpertGroupActor, ExpertGroupArgs};
use crate::messages::eplb::{EplbMsg, RebalanceReport};
use crate::messages::experts::{ExpertGroupMsg, ShardLoads, StagedShard};
use crate::metrics as m;
use crate::shell::{Children, Shell, ShellActor};
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
    /// On a node other than 0: the transport staged at node 0's request, until its commit.
    following: Option<Arc<LocalComm>>,
}

/// The actor (stateless handler; state in `EplbActorState`).
pub type EplbActor = ShellActor<EplbActorState>;

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
        if self.ep.follower() {
            return Err(EpError::Actor(
                "this node's EPLB follows node 0's: rebalance there".into(),
            ));
        }
        let loads = self.take_loads_everywhere().await?;
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
                self.abort_here(epoch);
                // Best effort: a node that failed may not answer.
                let _ = self
                    .on_other_nodes(Control::Abort { epoch: epoch.get() })
                    .await;
                self.eplb.abort();
                Err(e)
            }
        }
    }

    /// Every EP rank's loads since the last reading, in rank order: this node's, then (node 0
    /// of several) each other node's, read and reset over the socket.
    async fn take_loads_everywhere(&self) -> Result<Vec<ShardLoads>, EpError> {
        let mut loads = self.ep.current().take_loads();
        for reply in self.on_other_nodes(Control::TakeLoads).await? {
            let ControlReply::Loads(ranks) = reply else {
                return Err(EpError::Actor(format!("expected loads, got {reply:?}")));
            };
            loads.extend(ranks.into_iter().map(|(epoch, per_slot)| ShardLoads {
                epoch: PlacementEpoch(epoch),
                per_slot,
            }));
        }
        Ok(loads)
    }

    /// Sends `control` to every other node (none in a one-process engine), in node order.
    async fn on_other_nodes(&self, control: Control) -> Result<Vec<ControlReply>, EpError> {
        let Some(remote) = self.ep.current().remote() else {
            return Ok(Vec::new());
        };
        tokio::task::spawn_blocking(move || remote.control_all(&control))
            .await
            .map_err(|e| EpError::Actor(format!("EPLB control thread: {e}")))?
    }

    /// Stages `placement` as `epoch` here and on every other node, commits it on every other
    /// node, then here. Returns the expert slots copied.
    async fn stage_and_commit(
        &self,
        epoch: PlacementEpoch,
        placement: &Arc<ExpertPlacement>,
    ) -> Result<usize, EpError> {
        let (comm, mut copied) = self.stage_here(epoch, placement).await?;
        let stage = Control::Stage {
            epoch: epoch.get(),
            placement: placement.as_ref().clone(),
        };
        for reply in self.on_other_nodes(stage).await? {
            match reply {
                ControlReply::Staged { copied: more } => copied += more as usize,
                other => return Err(staging_error(epoch, &other)),
            }
        }
        let commit = Control::Commit { epoch: epoch.get() };
        for reply in self.on_other_nodes(commit).await? {
            if reply != ControlReply::Done {
                return Err(staging_error(epoch, &reply));
            }
        }
        self.commit_here(epoch, comm).await?;
        Ok(copied)
    }

    /// Stages `placement` as `epoch` on this node's groups and serves its transport to rows of
    /// that epoch (a peer may adopt it first). Returns it and the expert slots copied.
    async fn stage_here(
        &self,
        epoch: PlacementEpoch,
        placement: &Arc<ExpertPlacement>,
    ) -> Result<(Arc<LocalComm>, usize), EpError> {
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
        let comm = Arc::new(self.ep.current().next_epoch(
            epoch,
            placement.clone(),
            staged.into_iter().map(|s| s.shard).collect(),
        )?);
        self.ep.stage(comm.clone());
        Ok((comm, copied))
    }

    /// Commits `epoch` on this node's groups and publishes its transport `comm`: the rank
    /// steps that start from now on adopt it.
    async fn commit_here(
        &self,
        epoch: PlacementEpoch,
        comm: Arc<LocalComm>,
    ) -> Result<(), EpError> {
        for group in &self.groups {
            ask(group, |reply| ExpertGroupMsg::Commit { epoch, reply }).await??;
        }
        self.ep.commit(comm);
        Ok(())
    }

    /// Drops a staged `epoch` here.
    fn abort_here(&self, epoch: PlacementEpoch) {
        for group in &self.groups {
            let _ = group.cast(ExpertGroupMsg::Abort { epoch });
        }
        self.ep.abort_staged(epoch);
    }

    /// On a node other than 0: runs node 0's EPLB request (`EplbMsg::Follow`).
    async fn follow(&mut self, control: Control) -> ControlReply {
        let result = match control {
            Control::TakeLoads => Ok(ControlReply::Loads(
                self.ep
                    .current()
                    .take_loads()
                    .into_iter()
                    .map(|loads| (loads.epoch.get(), loads.per_slot))
                    .collect(),
            )),
            Control::Stage { epoch, placement } => {
                self.follow_stage(PlacementEpoch(epoch), Arc::new(placement))
                    .await
            }
            Control::Commit { epoch } => self.follow_commit(PlacementEpoch(epoch)).await,
            Control::Abort { epoch } => {
                let epoch = PlacementEpoch(epoch);
                self.abort_here(epoch);
                if self.following.take().is_some() {
                    self.eplb.abort();
                }
                Ok(ControlReply::Done)
            }
        };
        result.unwrap_or_else(|e| ControlReply::Failure(e.to_string()))
    }

    async fn follow_stage(
        &mut self,
        epoch: PlacementEpoch,
        placement: Arc<ExpertPlacement>,
    ) -> Result<ControlReply, EpError> {
        if self.following.take().is_some() {
            self.eplb.abort();
        }
        let next = self.eplb.begin_stage();
        if next != epoch {
            self.eplb.abort();
            return Err(EpError::Staging {
                epoch,
                message: format!("this node's next placement epoch is {next}"),
            });
        }
        match self.stage_here(epoch, &placement).await {
            Ok((comm, copied)) => {
                self.following = Some(comm);
                Ok(ControlReply::Staged {
                    copied: copied as u64,
                })
            }
            Err(e) => {
                self.abort_here(epoch);
                self.eplb.abort();
                Err(e)
            }
        }
    }

    async fn follow_commit(&mut self, epoch: PlacementEpoch) -> Result<ControlReply, EpError> {
        let comm = match self.following.take() {
            Some(comm) if comm.epoch() == epoch => comm,
            other => {
                let message = match &other {
                    Some(comm) => format!("the staged placement is {}", comm.epoch()),
                    None => "nothing is staged".to_string(),
                };
                self.following = other;
                return Err(EpError::Staging { epoch, message });
            }
        };
        let placement = comm.placement().clone();
        self.commit_here(epoch, comm).await?;
        self.eplb.commit(epoch, placement)?;
        m::record_eplb_commit(epoch);
        tracing::info!(%epoch, "expert placement committed (following node 0)");
        Ok(ControlReply::Done)
    }
}

/// A node's unexpected answer to a staging or commit request.
fn staging_error(epoch: PlacementEpoch, reply: &ControlReply) -> EpError {
    EpError::Staging {
        epoch,
        message: format!("a node answered {reply:?}"),
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
    let mut children = Children::new(supervisor, GROUP_TIMEOUT);
    let mut groups = Vec::new();
    let mut ranks = Vec::new();
    for shard in parallel.current().shards() {
        let rank = shard.rank();
        let args = ExpertGroupArgs {
            source: parallel.source().clone(),
            current: shard.clone(),
        };
        let group = children
            .spawn::<ExpertGroupActor>(args, format!("expert group {rank}"))
            .await?;
        ranks.push((rank, group.get_cell()));
        groups.push(group);
    }
    let args = EplbArgs {
        ep: parallel.clone(),
        groups,
    };
    let eplb = children.spawn::<EplbActor>(args, "EPLB actor").await?;
    let eplb_cell = eplb.get_cell();
    parallel.attach_eplb(eplb);
    Ok(ExpertActors {
        groups: ranks,
        eplb: eplb_cell,
    })
}

impl Shell for EplbActorState {
    type Msg = EplbMsg;
    type Args = EplbArgs;

    async fn start(_: ActorRef<Self::Msg>, args: Self::Args) -> Result<Self, ActorProcessingErr> {
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
            following: None,
        })
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        match message {
            EplbMsg::StepExecuted { dp, epoch } => match self.eplb.on_step(dp, epoch) {
                Some(EplbAction::StartWindow) => {
                    if let Err(error) = self.take_loads_everywhere().await {
                        tracing::warn!(%error, "EPLB window start: a node's loads were not reset");
                    }
                }
                Some(EplbAction::Rebalance) => {
                    if let Err(error) = self.rebalance().await {
                        tracing::warn!(%error, "EPLB rebalance failed; the placement stays");
                    }
                }
                None => {}
            },
            EplbMsg::RebalanceNow(reply) => {
                let _ = reply.send(self.rebalance().await);
            }
            EplbMsg::Status(reply) => {
                let _ = reply.send(self.eplb.status());
            }
            EplbMsg::Follow { control, reply } => {
                let _ = reply.send(self.follow(control).await);
            }
        }
        Ok(())
    }
}
