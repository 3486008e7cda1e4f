//! Expert parallelism on CUDA ranks (DEP: one EP rank per DP rank, `[parallel] dp = ep`): the
//! ranks' experts on their devices, their lockstep, and live EPLB within a node and across
//! nodes (which layouts run, and how nodes join: `experts::cuda_layout`).
//!
//! DP rank r runs on GPU `r % gpus_per_node` of its node and is EP rank r: its backend holds
//! only the experts of its slots (`deepinfer_model::backend::cuda::ep::ExpertRank`, uploaded
//! when the rank's backend opens, registered here as a [`DeviceRank`]) and moves routed rows to
//! the other ranks inside each MoE layer; the ranks step in `Lockstep`. Either family: V4.1's
//! FP4/FP8 experts (`moe_rows`) or the V4 family's exact fp32 ones (`moe_rows_exact`, hash
//! layers included), every placement giving the outputs of one rank bit for bit.
//! Live EPLB ([`DeviceExperts`], `[eplb] enabled`): the EPLB's state machine (`EplbState`, the
//! `EplbActor`'s logic) is advanced by rank 0 at the end of each of its steps (every rank runs
//! the same steps), DSpark's start-up profile excepted (no traffic: its steps are not counted,
//! and each rank's load counters are reset after them); a rebalance measures the ranks' per-slot counts and solves the placement,
//! then each rank builds its next `ExpertRank` (the experts it lacks uploaded from the host
//! weights every rank holds, of either kind; the same transport) at the start of its next step
//! or at its next idle poll, and once every rank has, the epoch is committed at the first step
//! no rank has begun: every rank adopts it there (dropping the experts it no longer holds), so
//! no step mixes epochs and no request is lost or changed. While a rank stages, its device
//! holds both epochs' experts.
//! Across nodes (one `deepinfer-node` per node) node 0's rank 0 runs the state machine and the
//! nodes agree over their step-count connections (`comm::steps::StepBeacon`, `wire::NodeEplb`):
//! (1) at a rebalance node 0 takes its ranks' counts and sends `TakeLoads` to every node, which
//! answers `Loads` (its ranks' counts, in rank order); (2) with all of them, node 0 solves the
//! placement over every EP rank, stages it on its ranks and sends `Stage` to every node; each
//! builds it on its ranks and answers `Staged` (or `Abort` with why: the rebalance is then
//! dropped on every node, node 0 sending `Abort` to all, and the placement stays); (3) once its
//! ranks and every node staged, node 0 holds its ranks before step S, one past every step it
//! knows begun, and sends `Propose(S)`; each node holds its ranks before S if none has begun it
//! and answers `Ready`, or `Late` with its count (node 0 then proposes past it); (4) with every
//! `Ready`, node 0 commits at S and sends `Commit(S)`; each node commits at S and lets its ranks
//! go. So every rank of every node runs steps before S on the old epoch and S on, the new.
//! Waits: loads, the proposal and a held rank at most `[cluster] exchange_timeout_ms`; staging
//! `bootstrap_timeout_seconds` more. A node lost (its connection closed or failed) or an
//! exchange past its timeout fails the group: every later step of every rank fails naming the
//! node (the supervisor's rule 3 stops the engine), never a hang.
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use deepinfer_model::backend::Backend;
use deepinfer_topology::{DpRank, ExpertPlacement, NodeConfig, PlacementEpoch, PlacementShape};

use crate::comm::steps::{NodeInbox, StepBeacon};
use crate::comm::wire::NodeEplb;
use crate::dspark::profile::ProfileRequest;
use crate::eplb::state::{EplbAction, EplbState};
use crate::experts::lockstep::{Held, Lockstep};
use crate::experts::parallel::EpSettings;
use crate::messages::eplb::{EplbStatus, RebalanceReport};
use crate::messages::experts::ShardLoads;
use crate::metrics as m;
use crate::scheduler::state::SchedulerLimits;

/// Rank steps kept in the step log.
const STEP_LOG_CAPACITY: usize = 1 << 16;

/// One rank's experts on its device, as the engine drives them (`gpu.rs` implements it over the
/// CUDA `ExpertRank`); `backend` is always the rank's own.
pub trait DeviceRank: Send + Sync {
    /// The epoch the rank serves.
    fn epoch(&self) -> PlacementEpoch;
    /// Routed rows each slot served since the last call, the counters reset.
    fn take_loads(&self) -> ShardLoads;
    /// Builds the rank of `placement` as `epoch` (uploading the experts it lacks), not in use
    /// until `adopt`; returns the (layer, expert) pairs uploaded.
    fn stage(
        &self,
        backend: &dyn Backend,
        placement: Arc<ExpertPlacement>,
        epoch: PlacementEpoch,
    ) -> Result<usize, String>;
    /// Serves the staged `epoch` from the next MoE layer on and drops the experts it no longer
    /// holds; returns how many.
    fn adopt(&self, backend: &dyn Backend, epoch: PlacementEpoch) -> Result<usize, String>;
}

/// Which epoch one rank step ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStep {
    pub dp: usize,
    /// The step's lockstep index (the same on every rank for the same collectives).
    pub index: u64,
    pub epoch: PlacementEpoch,
}

/// A rebalance whose placement the ranks are building.
struct Staged {
    epoch: PlacementEpoch,
    placement: Arc<ExpertPlacement>,
    /// This node's ranks that built it.
    built: Vec<bool>,
    report: RebalanceReport,
    /// Across nodes: by node, those that said their ranks built it (node 0's own entry: its
    /// ranks, `built`); a node other than 0 keeps only its own.
    staged: Vec<bool>,
    /// Across nodes: the staging and the commit must be over by then.
    deadline: Instant,
    /// Node 0: the step proposed to commit at, awaiting every node's `Ready`.
    proposal: Option<Proposal>,
    /// A node other than 0 told node 0 that its ranks built it.
    told: bool,
}

/// Node 0's proposed commit step.
struct Proposal {
    step: u64,
    /// By node: it said no rank of it began `step` and holds them before it.
    ready: Vec<bool>,
    deadline: Instant,
}

/// Node 0's request for every node's load counts.
struct PendingLoads {
    round: u64,
    /// By node, in node order (node 0's own taken as it asked).
    loads: Vec<Option<Vec<ShardLoads>>>,
    deadline: Instant,
}

struct Eplb {
    state: EplbState,
    staged: Option<Staged>,
    /// Node 0 across nodes: the load counts it waits for.
    loads: Option<PendingLoads>,
    /// Node 0 across nodes: the last `TakeLoads` round.
    round: u64,
}

/// This node's place among the nodes of a deployment, for live EPLB across nodes.
struct Nodes {
    beacon: Arc<StepBeacon>,
    me: u16,
    count: u16,
    /// Longest wait of one exchange (loads, the commit step): `[cluster] exchange_timeout_ms`.
    exchange: Duration,
    /// Longest staging (reads weights): `[cluster] bootstrap_timeout_seconds`.
    staging: Duration,
}

/// The engine-wide side of expert parallelism on CUDA (module doc).
pub struct DeviceExperts {
    lockstep: Lockstep,
    ranks: Mutex<Vec<Option<Arc<dyn DeviceRank>>>>,
    /// `None`: the placement of epoch 0 stays.
    eplb: Mutex<Option<Eplb>>,
    log: Mutex<VecDeque<DeviceStep>>,
    /// Live EPLB across nodes (`None`: one process, or EPLB off).
    nodes: Option<Nodes>,
    /// Why the group can no longer step (live EPLB across nodes failed: a node lost, an
    /// exchange past its timeout); every later step fails with it.
    failure: Mutex<Option<String>>,
    /// Steps each rank leads before it follows any peer: DSpark's start-up profile (0: off).
    profile_steps: u64,
}

impl std::fmt::Debug for DeviceExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceExperts")
            .field("ranks", &self.lockstep.ranks())
            .finish_non_exhaustive()
    }
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is complete or not made.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// `ranks` as the wire carries them.
fn wire_loads(ranks: &[ShardLoads]) -> Vec<(u32, Vec<Vec<u64>>)> {
    ranks
        .iter()
        .map(|l| (l.epoch.get(), l.per_slot.clone()))
        .collect()
}

/// Nodes whose entry is `false`, as "node 1, node 3".
fn missing(by_node: impl IntoIterator<Item = bool>) -> String {
    by_node
        .into_iter()
        .enumerate()
        .filter(|(_, done)| !done)
        .map(|(node, _)| format!("node {node}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn empty_report(epoch: PlacementEpoch) -> RebalanceReport {
    RebalanceReport {
        measured_epoch: epoch,
        epoch,
        measured_imbalance: Vec::new(),
        planned_imbalance: Vec::new(),
        measured_picks: 0,
        copied_experts: 0,
        committed: false,
    }
}

impl DeviceExperts {
    /// `ranks` EP ranks serving `placement` as epoch 0, rebalanced live when `node`'s
    /// `[eplb] enabled`.
    pub fn new(node: &NodeConfig, ranks: usize, placement: Arc<ExpertPlacement>) -> DeviceExperts {
        DeviceExperts::with_ranks(node, ranks, ranks, placement)
    }

    /// `ranks` EP ranks here of `all` in the group.
    fn with_ranks(
        node: &NodeConfig,
        ranks: usize,
        all: usize,
        placement: Arc<ExpertPlacement>,
    ) -> DeviceExperts {
        let settings = EpSettings::from_node(node);
        let eplb = settings.eplb.enabled.then(|| Eplb {
            state: EplbState::new(
                settings.eplb,
                PlacementShape {
                    num_replicas: placement.layers.first().map_or(0, |l| l.phy2log.len()),
                    num_groups: settings.num_groups,
                    num_nodes: settings.num_nodes,
                    num_gpus: all,
                },
                PlacementEpoch(0),
                placement,
            ),
            staged: None,
            loads: None,
            round: 0,
        });
        m::record_eplb_commit(PlacementEpoch(0));
        DeviceExperts {
            lockstep: Lockstep::new(ranks),
            ranks: Mutex::new(vec![None; ranks]),
            eplb: Mutex::new(eplb),
            log: Mutex::new(VecDeque::new()),
            nodes: None,
            failure: Mutex::new(None),
            profile_steps: match node.dspark.enabled {
                true => ProfileRequest::for_engine(&node.dspark, &SchedulerLimits::from_node(node))
                    .executor_steps(),
                false => 0,
            },
        }
    }

    /// This node's `ranks` ranks of a group spanning `beacon.nodes()` nodes with as many ranks
    /// each (the other nodes' ranks are heard through `beacon`, [`NodeLinks::peers`]). With
    /// live EPLB, node 0 leads the rebalances and the other nodes follow it over the beacon's
    /// connections (module doc); `[cluster] exchange_timeout_ms` bounds each exchange and
    /// `bootstrap_timeout_seconds` a staging.
    pub fn across_nodes(
        node: &NodeConfig,
        ranks: usize,
        placement: Arc<ExpertPlacement>,
        beacon: Arc<StepBeacon>,
    ) -> Arc<DeviceExperts> {
        let all = ranks * usize::from(beacon.nodes().max(1));
        let mut group = DeviceExperts::with_ranks(node, ranks, all, placement);
        group.lockstep = Lockstep::across_nodes(ranks, beacon.clone());
        let live = locked(&group.eplb).is_some();
        if live {
            group.nodes = Some(Nodes {
                me: beacon.node(),
                count: beacon.nodes(),
                exchange: node.cluster.exchange_timeout,
                staging: node.cluster.bootstrap_timeout,
                beacon: beacon.clone(),
            });
        }
        let group = Arc::new(group);
        if live {
            let inbox: Arc<dyn NodeInbox> = group.clone();
            beacon.deliver_to(Arc::downgrade(&inbox));
        }
        group
    }

    pub fn lockstep(&self) -> &Lockstep {
        &self.lockstep
    }

    /// Rank `rank`'s experts, once its backend opened.
    pub fn register(&self, rank: usize, experts: Arc<dyn DeviceRank>) {
        if let Some(entry) = locked(&self.ranks).get_mut(rank) {
            *entry = Some(experts);
        }
    }

    fn rank(&self, rank: usize) -> Option<Arc<dyn DeviceRank>> {
        locked(&self.ranks).get(rank).cloned().flatten()
    }

    /// Why the group can no longer step, if it cannot (live EPLB across nodes failed).
    pub fn failure(&self) -> Option<String> {
        locked(&self.failure).clone()
    }

    /// The group cannot step any more: every later step fails with `why` (the first kept).
    fn fail(&self, why: String) -> String {
        let mut failure = locked(&self.failure);
        if failure.is_none() {
            tracing::error!(%why, "expert parallelism across nodes failed");
            *failure = Some(why);
        }
        self.lockstep.interrupt();
        failure.clone().unwrap_or_default()
    }

    /// A failure, or an exchange across nodes past its timeout (which then fails the group).
    fn check(&self) -> Result<(), String> {
        if let Some(failure) = self.failure() {
            return Err(failure);
        }
        let Some(nodes) = &self.nodes else {
            return Ok(());
        };
        let now = Instant::now();
        let late = {
            let eplb = locked(&self.eplb);
            let Some(eplb) = eplb.as_ref() else {
                return Ok(());
            };
            let ms = nodes.exchange.as_millis();
            let loads = eplb.loads.as_ref().filter(|l| now >= l.deadline).map(|l| {
                format!(
                    "{} sent no load counts within {ms} ms",
                    missing(l.loads.iter().map(Option::is_some))
                )
            });
            let staged = eplb.staged.as_ref().and_then(|s| {
                let epoch = s.epoch;
                match &s.proposal {
                    Some(p) if now >= p.deadline => Some(format!(
                        "{} did not answer the commit of {epoch} at step {} within {ms} ms",
                        missing(p.ready.iter().copied()),
                        p.step
                    )),
                    Some(_) => None,
                    None if now < s.deadline => None,
                    None if nodes.me != 0 => Some(format!(
                        "node 0 neither committed nor aborted {epoch} within {} ms",
                        (nodes.staging + nodes.exchange).as_millis()
                    )),
                    None => Some(format!(
                        "{} did not stage {epoch} within {} ms",
                        missing(s.staged.iter().copied()),
                        (nodes.staging + nodes.exchange).as_millis()
                    )),
                }
            });
            loads.or(staged)
        };
        match late {
            Some(late) => Err(self.fail(format!("live EPLB across nodes: {late}"))),
            None => Ok(()),
        }
    }

    /// Rank `rank` begins a step on `backend`: it first builds a staged placement it has not
    /// (committing it when it is the last rank to), then adopts the step's epoch if new.
    /// Returns the step's lockstep index and epoch. Across nodes with live EPLB, a rank held
    /// before the step the nodes agree to commit at waits for the commit (at most
    /// `[cluster] exchange_timeout_ms`), and a failed agreement fails the step naming the node.
    pub fn begin(
        &self,
        rank: usize,
        backend: &dyn Backend,
    ) -> Result<(u64, PlacementEpoch), String> {
        self.check()?;
        self.stage(rank, backend);
        let (index, epoch) = match &self.nodes {
            None => self.lockstep.begin(rank),
            Some(nodes) => match self.lockstep.begin_within(rank, nodes.exchange) {
                Ok(begun) => begun,
                Err(held) => {
                    self.check()?;
                    let step = match held {
                        Held::TimedOut(step) | Held::Interrupted(step) => step,
                    };
                    let who = match nodes.me {
                        0 => "the other nodes",
                        _ => "node 0",
                    };
                    return Err(self.fail(format!(
                        "live EPLB across nodes: node {} rank {rank} waited {} ms before step \
                         {step} for {who} to commit or abort a placement",
                        nodes.me,
                        nodes.exchange.as_millis()
                    )));
                }
            },
        };
        if let Some(experts) = self.rank(rank)
            && experts.epoch() != epoch
        {
            let released = experts.adopt(backend, epoch)?;
            tracing::info!(rank, %epoch, index, released, "EP rank adopted a placement");
        }
        let mut log = locked(&self.log);
        if log.len() == STEP_LOG_CAPACITY {
            log.pop_front();
        }
        log.push_back(DeviceStep {
            dp: rank,
            index,
            epoch,
        });
        Ok((index, epoch))
    }

    /// Whether idle rank `rank` may follow its peers' steps: once it ran DSpark's start-up
    /// profile (with DSpark on), so that the profile's steps pair up one for one on every rank
    /// of every node, however late a node starts, instead of a late node's ranks first
    /// following an earlier node's profile as idle steps and then profiling alone.
    pub fn may_follow(&self, rank: usize) -> bool {
        self.lockstep.started(rank) >= self.profile_steps
    }

    /// An idle rank `rank` builds a staged placement it has not (so that staging never waits
    /// for traffic), and sees a failure of the group.
    pub fn idle(&self, rank: usize, backend: &dyn Backend) -> Result<(), String> {
        self.check()?;
        self.stage(rank, backend);
        Ok(())
    }

    /// Builds the staged placement on rank `rank` if it has not yet (the upload runs without
    /// the EPLB's lock held); the last rank to build it commits it (one process), proposes the
    /// commit step (node 0 of several, once every node staged) or tells node 0 (another node).
    /// A rank that cannot build it (e.g. out of device memory) aborts the rebalance on every
    /// node: the placement in use stays, as with the CPU's `EplbActor` (logged, never fatal).
    fn stage(&self, rank: usize, backend: &dyn Backend) {
        let pending = locked(&self.eplb).as_ref().and_then(|eplb| {
            let staged = eplb.staged.as_ref()?;
            (!staged.built.get(rank).copied().unwrap_or(true))
                .then(|| (staged.epoch, staged.placement.clone()))
        });
        let (Some((epoch, placement)), Some(experts)) = (pending, self.rank(rank)) else {
            return;
        };
        let built = experts.stage(backend, placement, epoch);
        let mut eplb = locked(&self.eplb);
        let Some(eplb) = eplb.as_mut() else {
            return;
        };
        if eplb.staged.as_ref().is_none_or(|s| s.epoch != epoch) {
            return;
        }
        let uploaded = match built {
            Ok(uploaded) => uploaded,
            Err(error) => {
                let me = self.nodes.as_ref().map_or(0, |n| n.me);
                let reason = format!("node {me} EP rank {rank}: {error}");
                tracing::warn!(rank, %epoch, %error, "EPLB staging failed; the placement stays");
                self.abort(eplb, epoch, reason, true);
                return;
            }
        };
        let Some(staged) = eplb.staged.as_mut() else {
            return;
        };
        staged.built[rank] = true;
        staged.report.copied_experts += uploaded;
        if !staged.built.iter().all(|&b| b) {
            return;
        }
        match &self.nodes {
            None => self.commit_here(eplb),
            Some(nodes) if nodes.me == 0 => {
                staged.staged[0] = true;
                self.propose(eplb, nodes, None);
            }
            Some(nodes) => {
                if !staged.told {
                    staged.told = true;
                    nodes.beacon.send_eplb(
                        0,
                        NodeEplb::Staged {
                            epoch: epoch.get(),
                            copied: staged.report.copied_experts as u64,
                        },
                    );
                }
            }
        }
    }

    /// One process: every rank built the staged placement; it is committed at the first step
    /// no rank has begun.
    fn commit_here(&self, eplb: &mut Eplb) {
        let Some(staged) = eplb.staged.take() else {
            return;
        };
        let epoch = staged.epoch;
        // The state stages exactly `epoch` (`plan` began it): its commit cannot refuse.
        if let Err(error) = eplb.state.commit(epoch, staged.placement) {
            tracing::warn!(%error, "EPLB commit refused; the placement stays");
            eplb.state.abort();
            return;
        }
        let from = self.lockstep.commit(epoch);
        self.committed(eplb, epoch, from, staged.report);
    }

    fn committed(
        &self,
        eplb: &mut Eplb,
        epoch: PlacementEpoch,
        from: u64,
        report: RebalanceReport,
    ) {
        m::record_eplb_commit(epoch);
        let mut report = report;
        report.committed = true;
        report.epoch = epoch;
        tracing::info!(%epoch, from, copied = report.copied_experts, "expert placement committed");
        eplb.state.record(report);
    }

    /// The staged `epoch` is dropped (`reason`) and the placement in use stays; node 0 tells
    /// every other node, another node tells node 0 when the failure is its own (`tell`).
    fn abort(&self, eplb: &mut Eplb, epoch: PlacementEpoch, reason: String, tell: bool) {
        let Some(staged) = eplb.staged.take_if(|s| s.epoch == epoch) else {
            return;
        };
        eplb.state.abort();
        self.lockstep.release();
        tracing::warn!(%epoch, %reason, "EPLB rebalance aborted; the placement stays");
        let mut report = staged.report;
        report.epoch = eplb.state.epoch();
        eplb.state.record(report);
        let Some(nodes) = &self.nodes else {
            return;
        };
        let message = NodeEplb::Abort {
            epoch: epoch.get(),
            reason,
        };
        match nodes.me {
            0 => (1..nodes.count).for_each(|n| nodes.beacon.send_eplb(n, message.clone())),
            _ if tell => nodes.beacon.send_eplb(0, message),
            _ => {}
        }
    }

    /// Node 0: once its ranks and every node staged, holds its ranks before a step none heard
    /// of has begun (`after`: past the most steps a node said it began) and proposes it.
    fn propose(&self, eplb: &mut Eplb, nodes: &Nodes, after: Option<u64>) {
        let Some(epoch) = eplb
            .staged
            .as_ref()
            .filter(|s| s.staged.iter().all(|&s| s))
            .map(|s| s.epoch)
        else {
            return;
        };
        let step = match after {
            None => self.lockstep.hold_beyond(1),
            Some(began) => {
                let step = (began + 1).max(self.lockstep.steps() + 1);
                if let Err(here) = self.lockstep.hold_at(step) {
                    // Cannot be: `step` is past every step begun here.
                    let reason = format!("node 0 began {here} steps, past step {step}");
                    self.abort(eplb, epoch, reason, true);
                    return;
                }
                step
            }
        };
        let mut ready = vec![false; usize::from(nodes.count)];
        ready[0] = true;
        if let Some(staged) = eplb.staged.as_mut() {
            staged.proposal = Some(Proposal {
                step,
                ready,
                deadline: Instant::now() + nodes.exchange,
            });
        }
        for n in 1..nodes.count {
            nodes.beacon.send_eplb(
                n,
                NodeEplb::Propose {
                    epoch: epoch.get(),
                    step,
                },
            );
        }
    }

    /// After a step of rank `rank`: rank 0 (every rank runs the same steps) advances the EPLB's
    /// schedule, which may start a load window or measure one and stage a new placement (node
    /// 0 of several asks every node for its counts first). A failed measure or plan keeps the
    /// placement in use (logged, never fatal); an exchange across nodes past its timeout fails
    /// the step naming the node.
    pub fn finish(&self, rank: usize, epoch: PlacementEpoch) -> Result<(), String> {
        self.check()?;
        if self.profiling(rank) {
            return Ok(());
        }
        if rank != 0 || self.nodes.as_ref().is_some_and(|n| n.me != 0) {
            return Ok(());
        }
        let mut eplb = locked(&self.eplb);
        let Some(eplb) = eplb.as_mut() else {
            return Ok(());
        };
        let action = eplb.state.on_step(DpRank(0), epoch);
        let Some(nodes) = &self.nodes else {
            match action {
                Some(EplbAction::StartWindow) => {
                    self.take_loads();
                }
                Some(EplbAction::Rebalance) if eplb.staged.is_none() => {
                    let loads = self.take_loads();
                    if let Err(error) = self.plan(eplb, loads) {
                        tracing::warn!(%error, "EPLB rebalance failed; the placement stays");
                    }
                }
                _ => {}
            }
            return Ok(());
        };
        match action {
            Some(EplbAction::StartWindow) => {
                self.take_loads();
                eplb.round += 1;
                for n in 1..nodes.count {
                    nodes
                        .beacon
                        .send_eplb(n, NodeEplb::TakeLoads { round: eplb.round });
                }
            }
            Some(EplbAction::Rebalance) if eplb.staged.is_none() && eplb.loads.is_none() => {
                eplb.round += 1;
                let mut loads = vec![None; usize::from(nodes.count)];
                loads[0] = Some(self.take_loads());
                eplb.loads = Some(PendingLoads {
                    round: eplb.round,
                    loads,
                    deadline: Instant::now() + nodes.exchange,
                });
                for n in 1..nodes.count {
                    nodes
                        .beacon
                        .send_eplb(n, NodeEplb::TakeLoads { round: eplb.round });
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether the step rank `rank` just finished was one of DSpark's start-up profile (its
    /// first [`DeviceExperts::profile_steps`]): no traffic, so the EPLB's schedule does not
    /// count it, and after the last one the rank's load counters are reset, so that the first
    /// window measures traffic only, however long it is.
    fn profiling(&self, rank: usize) -> bool {
        let started = self.lockstep.started(rank);
        if started > self.profile_steps {
            return false;
        }
        if started == self.profile_steps
            && let Some(experts) = self.rank(rank)
        {
            experts.take_loads();
        }
        true
    }

    /// Steps each rank runs for DSpark's start-up profile before any traffic (0: DSpark off).
    pub fn profile_steps(&self) -> u64 {
        self.profile_steps
    }

    fn take_loads(&self) -> Vec<ShardLoads> {
        let ranks = locked(&self.ranks).clone();
        ranks
            .iter()
            .flatten()
            .map(|experts| experts.take_loads())
            .collect()
    }

    /// Measures the window (every EP rank's counts, in rank order) and, when the placement
    /// should change, stages the new one (across nodes: node 0 sends it to every node). A
    /// window a rank served partly on another epoch (it adopts a commit at its next step) is
    /// skipped.
    fn plan(&self, eplb: &mut Eplb, loads: Vec<ShardLoads>) -> Result<(), String> {
        if loads.iter().any(|l| l.epoch != eplb.state.epoch()) {
            return Ok(());
        }
        let measured = eplb.state.measure(&loads).map_err(|e| e.to_string())?;
        m::record_eplb_imbalance(&measured.imbalance);
        let mut report = measured.report(eplb.state.epoch());
        match eplb.state.plan(&measured).map_err(|e| e.to_string())? {
            None => eplb.state.record(report),
            Some((placement, planned)) => {
                report.planned_imbalance = planned;
                let epoch = eplb.state.begin_stage();
                let count = self.nodes.as_ref().map_or(1, |n| usize::from(n.count));
                let wait = self
                    .nodes
                    .as_ref()
                    .map_or(Duration::ZERO, |n| n.staging + n.exchange);
                eplb.staged = Some(Staged {
                    epoch,
                    placement: Arc::new(placement),
                    built: vec![false; self.lockstep.ranks()],
                    report,
                    staged: vec![false; count],
                    deadline: Instant::now() + wait,
                    proposal: None,
                    told: false,
                });
                if let (Some(nodes), Some(staged)) = (&self.nodes, &eplb.staged) {
                    for n in 1..nodes.count {
                        nodes.beacon.send_eplb(
                            n,
                            NodeEplb::Stage {
                                epoch: epoch.get(),
                                placement: (*staged.placement).clone(),
                            },
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Node 0 hears node `from`.
    fn lead(&self, eplb: &mut Eplb, nodes: &Nodes, from: u16, message: NodeEplb) {
        let node = usize::from(from);
        match message {
            NodeEplb::Loads { round, ranks } => {
                let Some(pending) = eplb.loads.as_mut().filter(|p| p.round == round) else {
                    return;
                };
                if let Some(entry) = pending.loads.get_mut(node) {
                    *entry = Some(
                        ranks
                            .into_iter()
                            .map(|(epoch, per_slot)| ShardLoads {
                                epoch: PlacementEpoch(epoch),
                                per_slot,
                            })
                            .collect(),
                    );
                }
                if pending.loads.iter().all(Option::is_some)
                    && let Some(pending) = eplb.loads.take()
                {
                    let loads = pending.loads.into_iter().flatten().flatten().collect();
                    if let Err(error) = self.plan(eplb, loads) {
                        tracing::warn!(%error, "EPLB rebalance failed; the placement stays");
                    }
                }
            }
            NodeEplb::Staged { epoch, copied } => {
                let Some(staged) = eplb
                    .staged
                    .as_mut()
                    .filter(|s| s.epoch.get() == epoch && s.proposal.is_none())
                else {
                    return;
                };
                if let Some(entry) = staged.staged.get_mut(node) {
                    *entry = true;
                }
                staged.report.copied_experts += copied as usize;
                self.propose(eplb, nodes, None);
            }
            NodeEplb::Ready { epoch, step } => {
                let Some(staged) = eplb.staged.as_mut().filter(|s| s.epoch.get() == epoch) else {
                    return;
                };
                let Some(proposal) = staged.proposal.as_mut().filter(|p| p.step == step) else {
                    return;
                };
                if let Some(entry) = proposal.ready.get_mut(node) {
                    *entry = true;
                }
                if !proposal.ready.iter().all(|&r| r) {
                    return;
                }
                let Some(staged) = eplb.staged.take() else {
                    return;
                };
                let epoch = staged.epoch;
                if let Err(error) = eplb.state.commit(epoch, staged.placement.clone()) {
                    eplb.staged = Some(staged);
                    self.abort(eplb, epoch, format!("node 0: {error}"), true);
                    return;
                }
                if let Err(began) = self.lockstep.commit_at(step, epoch) {
                    // Cannot be: node 0's ranks are held before `step`.
                    self.fail(format!(
                        "live EPLB across nodes: node 0 committed {epoch} at step {step}, which \
                         its ranks had begun ({began} steps)"
                    ));
                    return;
                }
                for n in 1..nodes.count {
                    nodes.beacon.send_eplb(
                        n,
                        NodeEplb::Commit {
                            epoch: epoch.get(),
                            step,
                        },
                    );
                }
                self.committed(eplb, epoch, step, staged.report);
            }
            NodeEplb::Late { epoch, step, began } => {
                let proposed = eplb.staged.as_ref().is_some_and(|s| {
                    s.epoch.get() == epoch && s.proposal.as_ref().is_some_and(|p| p.step == step)
                });
                if proposed {
                    self.propose(eplb, nodes, Some(began));
                }
            }
            NodeEplb::Abort { epoch, reason } => {
                self.abort(eplb, PlacementEpoch(epoch), reason, true);
            }
            other => {
                tracing::warn!(
                    from,
                    ?other,
                    "EPLB: node 0 ignores a message meant for a follower"
                );
            }
        }
    }

    /// A node other than 0 hears node 0.
    fn follow(&self, eplb: &mut Eplb, nodes: &Nodes, message: NodeEplb) {
        let me = nodes.me;
        let reply = |message: NodeEplb| nodes.beacon.send_eplb(0, message);
        match message {
            NodeEplb::TakeLoads { round } => reply(NodeEplb::Loads {
                round,
                ranks: wire_loads(&self.take_loads()),
            }),
            NodeEplb::Stage { epoch, placement } => {
                let expected = eplb.state.epoch().next();
                if eplb.staged.is_some() || expected.get() != epoch {
                    reply(NodeEplb::Abort {
                        epoch,
                        reason: format!(
                            "node {me} cannot stage epoch {epoch}: it is at {}, staging {:?}",
                            eplb.state.epoch(),
                            eplb.staged.as_ref().map(|s| s.epoch)
                        ),
                    });
                    return;
                }
                let epoch = eplb.state.begin_stage();
                eplb.staged = Some(Staged {
                    epoch,
                    placement: Arc::new(placement),
                    built: vec![false; self.lockstep.ranks()],
                    report: empty_report(eplb.state.epoch()),
                    staged: Vec::new(),
                    deadline: Instant::now() + nodes.staging + nodes.exchange,
                    proposal: None,
                    told: false,
                });
            }
            NodeEplb::Propose { epoch, step } => {
                let built = eplb
                    .staged
                    .as_ref()
                    .is_some_and(|s| s.epoch.get() == epoch && s.built.iter().all(|&b| b));
                if !built {
                    reply(NodeEplb::Abort {
                        epoch,
                        reason: format!("node {me} has not staged epoch {epoch}"),
                    });
                    return;
                }
                match self.lockstep.hold_at(step) {
                    Ok(()) => reply(NodeEplb::Ready { epoch, step }),
                    Err(began) => reply(NodeEplb::Late { epoch, step, began }),
                }
            }
            NodeEplb::Commit { epoch, step } => {
                let Some(staged) = eplb.staged.take_if(|s| s.epoch.get() == epoch) else {
                    self.fail(format!(
                        "live EPLB across nodes: node 0 committed epoch {epoch}, which node \
                         {me} has not staged"
                    ));
                    return;
                };
                let epoch = staged.epoch;
                if let Err(error) = eplb.state.commit(epoch, staged.placement) {
                    self.fail(format!("live EPLB across nodes: node {me}: {error}"));
                    return;
                }
                if let Err(began) = self.lockstep.commit_at(step, epoch) {
                    self.fail(format!(
                        "live EPLB across nodes: node 0 committed {epoch} at step {step}, which \
                         a rank of node {me} had begun ({began} steps)"
                    ));
                    return;
                }
                self.committed(eplb, epoch, step, staged.report);
            }
            NodeEplb::Abort { epoch, reason } => {
                self.abort(eplb, PlacementEpoch(epoch), reason, false);
            }
            other => {
                tracing::warn!(
                    me,
                    ?other,
                    "EPLB: a follower ignores a message meant for node 0"
                );
            }
        }
    }

    /// The most recent rank steps (oldest first, at most 65536).
    pub fn step_log(&self) -> Vec<DeviceStep> {
        locked(&self.log).iter().copied().collect()
    }

    /// The EPLB's status (`None`: off).
    pub fn eplb_status(&self) -> Option<EplbStatus> {
        locked(&self.eplb).as_ref().map(|eplb| eplb.state.status())
    }
}

impl NodeInbox for DeviceExperts {
    fn receive(&self, from: u16, message: NodeEplb) {
        let Some(nodes) = &self.nodes else {
            return;
        };
        let mut eplb = locked(&self.eplb);
        let Some(eplb) = eplb.as_mut() else {
            return;
        };
        if nodes.me == 0 {
            self.lead(eplb, nodes, from, message);
        } else if from == 0 {
            self.follow(eplb, nodes, message);
        }
    }

    fn lost(&self, node: u16, why: String) {
        self.fail(format!(
            "live EPLB across nodes: node {node} is lost: {why}"
        ));
    }
}
