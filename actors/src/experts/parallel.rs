//! `ExpertParallel`: the expert-parallel data plane one engine shares between its rank threads
//! and its `ExpertGroupActor`s / `EplbActor`.
//!
//! Owns: the source the shards copy their weights from (the model, or none when simulated), the placement shape, the EPLB schedule, the committed
//! `LocalComm` (the placement epoch ranks adopt at their next step), a bounded log of which epoch
//! each rank step ran on, and the `EplbActor`'s ref once the supervisor spawned it.
//! Ordering: `commit` swaps the current transport; a rank reads it once at the start of a step
//! (`begin_step`) and keeps it to the end, so a step never mixes epochs; the old transport lives
//! until its last step finishes (across nodes, until the next commit: peers that have not
//! adopted the new epoch yet still send rows of the old one, and a staged transport is served
//! to peers that adopted it first: `comm_of`). Across nodes it also loads only this node's
//! experts (`node_expert_filter`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use deepinfer_model::any_model::AnyModel;
use deepinfer_model::checkpoint::ExpertFilter;
use deepinfer_model::memory_plan::WeightSplit;
use deepinfer_topology::{
    ClusterConfig, DpRank, EpRank, ExpertPlacement, NodeConfig, PlacementEpoch, PlacementShape,
};
use ractor::ActorRef;
use ractor::rpc::CallResult;

use crate::comm::bootstrap::{self, Member};
use crate::comm::remote::{ExpertServer, RemoteRanks, Timeouts};
use crate::comm::wire::{Control, ControlReply};
use crate::comm::{Comm, EpError, LocalComm};
use crate::experts::shard::{ExpertShard, ExpertSource};
use crate::messages::eplb::{EplbMsg, EplbStatus, RebalanceReport};

/// How long the EPLB may take to answer (a rebalance copies weights).
const EPLB_TIMEOUT: Duration = Duration::from_secs(300);
/// Rank steps kept in the step log.
const STEP_LOG_CAPACITY: usize = 1 << 16;

/// When the EPLB measures and rebalances (in engine steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EplbSchedule {
    /// Rebalance automatically.
    pub enabled: bool,
    /// Steps of load measured before each rebalance (>= 1).
    pub window_steps: u64,
    /// Steps between rebalances (>= 1).
    pub interval_steps: u64,
}

/// The expert-parallel layout of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpSettings {
    /// EP ranks (shards).
    pub ep_ranks: usize,
    /// Physical slots per layer beyond the logical experts.
    pub redundant_experts: usize,
    /// Expert groups (hierarchical policy when they divide over the nodes).
    pub num_groups: usize,
    /// Nodes the EP ranks span.
    pub num_nodes: usize,
    pub eplb: EplbSchedule,
}

impl EpSettings {
    /// The settings a validated topology asks for (`[parallel] ep`, `[eplb]`, `[device] nodes`).
    pub fn from_node(node: &NodeConfig) -> EpSettings {
        EpSettings {
            ep_ranks: usize::from(node.parallel.ep),
            redundant_experts: usize::from(node.eplb.redundant_experts),
            num_groups: usize::from(node.eplb.num_groups),
            num_nodes: usize::from(node.device.nodes),
            eplb: EplbSchedule {
                enabled: node.eplb.enabled,
                window_steps: u64::from(node.eplb.window_steps),
                interval_steps: u64::from(node.eplb.rebalance_interval_steps),
            },
        }
    }

    /// What every node of a deployment must agree on (checked at the bootstrap): the model's
    /// expert shape and this layout, hashed.
    pub fn fingerprint(&self, source: &ExpertSource) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (source.layers(), source.routed_experts()).hash(&mut hasher);
        if let ExpertSource::Model(model) = source {
            let cfg = model.config();
            let family = format!("{:?}", cfg.family);
            (family, cfg.dim, cfg.vocab_size, cfg.n_activated_experts).hash(&mut hasher);
        }
        (
            self.ep_ranks,
            self.redundant_experts,
            self.num_groups,
            self.num_nodes,
        )
            .hash(&mut hasher);
        hasher.finish()
    }

    /// True when the topology needs expert parallelism (ep > 1, or the EPLB is on).
    pub fn is_needed(node: &NodeConfig) -> bool {
        node.parallel.ep > 1 || node.eplb.enabled
    }
}

/// Which placement epoch one rank step ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRecord {
    pub dp: DpRank,
    /// The rank's own step counter (0-based, every executed step, empty ones included).
    pub rank_step: u64,
    /// The epoch the step adopted at its start.
    pub epoch: PlacementEpoch,
    /// Lowest and highest epoch of the shards that served its picks (`None`: no MoE work).
    pub served: Option<(PlacementEpoch, PlacementEpoch)>,
    /// Tokens the step ran.
    pub tokens: usize,
}

/// The shape and the placement for equal loads (epoch 0) of `settings` over `layers` backbone
/// layers of `experts` routed experts.
fn epoch_zero(
    layers: usize,
    experts: usize,
    settings: EpSettings,
) -> Result<(PlacementShape, Arc<ExpertPlacement>), EpError> {
    let shape = PlacementShape {
        num_replicas: experts + settings.redundant_experts,
        num_groups: settings.num_groups,
        num_nodes: settings.num_nodes,
        num_gpus: settings.ep_ranks,
    };
    if settings.eplb.window_steps == 0 || settings.eplb.interval_steps == 0 {
        return Err(EpError::Shape {
            what: "EPLB window and interval steps (>= 1)",
            expected: 1,
            found: 0,
        });
    }
    let placement = Arc::new(ExpertPlacement::uniform(layers, experts, shape)?);
    Ok((shape, placement))
}

/// The routed experts the process of node `node.cluster.node` loads (a model of `layers`
/// backbone layers of `experts` routed experts): those its EP ranks' slots hold in the epoch-0
/// placement, redundant replicas included — what [`ExpertParallel::on_node`] builds its shards
/// from.
pub fn node_expert_filter(
    node: &NodeConfig,
    layers: usize,
    experts: usize,
) -> Result<ExpertFilter, EpError> {
    let (_, placement) = epoch_zero(layers, experts, EpSettings::from_node(node))?;
    let kept: Vec<Vec<bool>> = (0..layers)
        .map(|layer| {
            let mut row = vec![false; experts];
            for rank in node.ep_ranks_on_node() {
                for expert in placement.experts_on_rank(layer, EpRank(rank)) {
                    row[expert.index()] = true;
                }
            }
            row
        })
        .collect();
    Ok(ExpertFilter::new(move |layer, expert| {
        kept.get(layer)
            .and_then(|row| row.get(expert))
            .copied()
            .unwrap_or(false)
    }))
}

/// What the process of node `node.cluster.node` holds in host memory after a load with
/// [`node_expert_filter`]: its routed experts' bytes against the whole model's, and the weights
/// every node holds (the memory plan's dense and Engram shares of `model`'s config,
/// `memory_plan::WeightSplit`).
pub fn node_holdings(node: &NodeConfig, model: &AnyModel) -> String {
    let cfg = model.config();
    let (held, held_count) = model.experts().routed_expert_bytes();
    let WeightSplit {
        dense,
        routed,
        engram,
    } = WeightSplit::of(cfg);
    format!(
        "node {} of {} holds the routed experts of EP ranks {:?}: {held} of {routed} host bytes \
         ({held_count} of {} layer-experts); dense weights {dense} and Engram {engram} host \
         bytes, as every node",
        node.cluster.node,
        node.device.nodes,
        node.ep_ranks_on_node(),
        cfg.n_layers * cfg.n_routed_experts,
    )
}

/// The epoch-0 shards of EP ranks `ranks`.
fn build_shards(
    source: &ExpertSource,
    placement: &ExpertPlacement,
    ranks: std::ops::Range<usize>,
) -> Result<Vec<Arc<ExpertShard>>, EpError> {
    ranks
        .map(|r| {
            ExpertShard::build(source, placement, EpRank(r as u16), PlacementEpoch(0), None)
                .map(|(shard, _)| Arc::new(shard))
        })
        .collect()
}

/// A poisoned lock still holds a whole value (every update is one assignment).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The shared expert-parallel state of one engine.
#[derive(Debug)]
pub struct ExpertParallel {
    source: ExpertSource,
    shape: PlacementShape,
    settings: EpSettings,
    current: RwLock<Arc<LocalComm>>,
    /// Across nodes: the staged transport (served to peers' rows of its epoch before this node
    /// adopts it) and the one before the current (served to rows of peers that have not
    /// adopted the current yet).
    staged: Mutex<Option<Arc<LocalComm>>>,
    previous: Mutex<Option<Arc<LocalComm>>>,
    eplb: Mutex<Option<ActorRef<EplbMsg>>>,
    /// The runtime the `EplbActor` runs on (the expert server's threads call it from outside).
    runtime: Mutex<Option<tokio::runtime::Handle>>,
    /// A node other than 0 of several: its EPLB follows node 0's.
    follower: bool,
    log: Mutex<VecDeque<StepRecord>>,
    /// Across nodes: this node's expert server (stops accepting when the engine is dropped).
    server: Mutex<Option<ExpertServer>>,
}

impl ExpertParallel {
    /// Epoch 0: the placement for equal loads, each shard's weights copied from `source`.
    pub fn new(
        source: impl Into<ExpertSource>,
        settings: EpSettings,
    ) -> Result<Arc<ExpertParallel>, EpError> {
        let source = source.into();
        let (shape, placement) = epoch_zero(source.layers(), source.routed_experts(), settings)?;
        let shards = build_shards(&source, &placement, 0..settings.ep_ranks)?;
        let comm = LocalComm::new(PlacementEpoch(0), source.clone(), placement, shards)?;
        Ok(ExpertParallel::with_comm(
            source, shape, settings, comm, false,
        ))
    }

    /// Epoch 0 on node `cluster.node` of `settings.num_nodes`: only this node's EP ranks get
    /// shards; the nodes join (`comm::bootstrap`, blocking until all did or the timeout), and the
    /// other nodes' EP ranks are served through their expert servers, this node's through its
    /// own (started here).
    pub fn on_node(
        source: impl Into<ExpertSource>,
        settings: EpSettings,
        cluster: &ClusterConfig,
    ) -> Result<Arc<ExpertParallel>, EpError> {
        let source = source.into();
        let (shape, placement) = epoch_zero(source.layers(), source.routed_experts(), settings)?;
        // Node 0's EPLB rebalances every node; the others follow it (`EplbMsg::Follow`).
        let mut settings = settings;
        settings.eplb.enabled &= cluster.node == 0;
        let bootstrap_addr = cluster
            .bootstrap
            .ok_or_else(|| EpError::Bootstrap("several nodes need [cluster] bootstrap".into()))?;
        let nodes = settings.num_nodes.max(1);
        let per_node = settings.ep_ranks / nodes;
        let node = usize::from(cluster.node);
        let listener = std::net::TcpListener::bind(cluster.expert_listen).map_err(|e| {
            EpError::Bootstrap(format!("expert server on {}: {e}", cluster.expert_listen))
        })?;
        let expert_addr = listener
            .local_addr()
            .map_err(|e| EpError::Bootstrap(format!("expert server address: {e}")))?;
        let shards = build_shards(&source, &placement, node * per_node..(node + 1) * per_node)?;
        let me = Member {
            node: cluster.node,
            nodes: nodes as u16,
            fingerprint: settings.fingerprint(&source),
            expert_addr,
        };
        let joined = bootstrap::join(bootstrap_addr, me, cluster.bootstrap_timeout, None)?;
        let remote = RemoteRanks::new(
            joined.session,
            Timeouts {
                exchange: cluster.exchange_timeout,
                staging: cluster.bootstrap_timeout,
            },
            node,
            per_node,
            &joined.experts,
        );
        let comm = LocalComm::across_nodes(
            PlacementEpoch(0),
            source.clone(),
            placement,
            shards,
            Arc::new(remote),
        )?;
        let parallel = ExpertParallel::with_comm(source, shape, settings, comm, node != 0);
        let server = ExpertServer::start(listener, joined.session, Arc::downgrade(&parallel))?;
        *parallel.server.lock().unwrap_or_else(|p| p.into_inner()) = Some(server);
        Ok(parallel)
    }

    fn with_comm(
        source: ExpertSource,
        shape: PlacementShape,
        settings: EpSettings,
        comm: LocalComm,
        follower: bool,
    ) -> Arc<ExpertParallel> {
        Arc::new(ExpertParallel {
            source,
            shape,
            settings,
            current: RwLock::new(Arc::new(comm)),
            staged: Mutex::new(None),
            previous: Mutex::new(None),
            eplb: Mutex::new(None),
            runtime: Mutex::new(None),
            follower,
            log: Mutex::new(VecDeque::new()),
            server: Mutex::new(None),
        })
    }

    /// Where the shards' weights come from.
    pub fn source(&self) -> &ExpertSource {
        &self.source
    }

    pub fn shape(&self) -> PlacementShape {
        self.shape
    }

    pub fn settings(&self) -> EpSettings {
        self.settings
    }

    /// The committed transport (what the next step adopts).
    pub fn current(&self) -> Arc<LocalComm> {
        // A poisoned lock still holds a complete `Arc` (the swap is one assignment).
        match self.current.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Makes `comm` the transport of every step that starts from now on (the one it replaces
    /// is still served to peers' rows of its epoch until the next commit).
    pub(crate) fn commit(&self, comm: Arc<LocalComm>) {
        let replaced = {
            let mut guard = self.current.write().unwrap_or_else(|p| p.into_inner());
            std::mem::replace(&mut *guard, comm.clone())
        };
        // In one process no peer sends rows: the old transport lives until its last step ends.
        *lock(&self.previous) = replaced.remote().is_some().then_some(replaced);
        let mut staged = lock(&self.staged);
        if staged.as_ref().is_some_and(|s| s.epoch() == comm.epoch()) {
            *staged = None;
        }
    }

    /// Serves `comm` (a staged placement) to peers' rows of its epoch; steps here keep the
    /// current one until `commit`.
    pub(crate) fn stage(&self, comm: Arc<LocalComm>) {
        *lock(&self.staged) = Some(comm);
    }

    /// Drops the staged transport of `epoch`, if it is the one staged.
    pub(crate) fn abort_staged(&self, epoch: PlacementEpoch) {
        let mut staged = lock(&self.staged);
        if staged.as_ref().is_some_and(|s| s.epoch() == epoch) {
            *staged = None;
        }
    }

    /// The transport that serves rows of placement `epoch`: the current one, the staged one or
    /// the one before the current (`None`: none of them).
    pub fn comm_of(&self, epoch: PlacementEpoch) -> Option<Arc<LocalComm>> {
        let current = self.current();
        if current.epoch() == epoch {
            return Some(current);
        }
        [&self.staged, &self.previous]
            .into_iter()
            .find_map(|slot| lock(slot).clone().filter(|comm| comm.epoch() == epoch))
    }

    /// Runs a request of node 0's EPLB (from this node's expert server thread) on this node's
    /// `EplbActor`.
    pub(crate) fn follow(&self, control: Control) -> ControlReply {
        let eplb = self.eplb();
        let runtime = lock(&self.runtime).clone();
        let (Some(eplb), Some(runtime)) = (eplb, runtime) else {
            return ControlReply::Failure("this node's EPLB has not started".into());
        };
        let call = eplb.call(
            |reply| EplbMsg::Follow { control, reply },
            Some(EPLB_TIMEOUT),
        );
        match runtime.block_on(call) {
            Ok(CallResult::Success(reply)) => reply,
            Ok(_) => ControlReply::Failure("this node's EPLB did not answer".into()),
            Err(e) => ControlReply::Failure(format!("this node's EPLB: {e}")),
        }
    }

    /// Whether this is a node other than 0 of several (its EPLB follows node 0's).
    pub fn follower(&self) -> bool {
        self.follower
    }

    /// The `EplbActor`, once spawned.
    pub fn eplb(&self) -> Option<ActorRef<EplbMsg>> {
        self.eplb
            .lock()
            .map(|g| g.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Attaches the spawned `EplbActor` (called on its runtime).
    pub(crate) fn attach_eplb(&self, eplb: ActorRef<EplbMsg>) {
        *lock(&self.runtime) = tokio::runtime::Handle::try_current().ok();
        *lock(&self.eplb) = Some(eplb);
    }

    /// Records a finished rank step and tells the EPLB (one message per step).
    pub(crate) fn finish_step(&self, record: StepRecord) {
        {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            if log.len() == STEP_LOG_CAPACITY {
                log.pop_front();
            }
            log.push_back(record);
        }
        if let Some(eplb) = self.eplb() {
            // The EPLB stopping (shutdown) must not fail the step.
            let _ = eplb.cast(EplbMsg::StepExecuted {
                dp: record.dp,
                epoch: record.epoch,
            });
        }
    }

    /// Asks the EPLB to measure the loads since its last measurement and rebalance now.
    pub async fn rebalance_now(&self) -> Result<RebalanceReport, EpError> {
        let eplb = self.eplb_or_error()?;
        match eplb.call(EplbMsg::RebalanceNow, Some(EPLB_TIMEOUT)).await {
            Ok(CallResult::Success(report)) => report,
            Ok(_) => Err(EpError::Actor("the EPLB did not answer".into())),
            Err(e) => Err(EpError::Actor(e.to_string())),
        }
    }

    /// The EPLB's status (epoch, steps, rebalances, last report).
    pub async fn eplb_status(&self) -> Result<EplbStatus, EpError> {
        let eplb = self.eplb_or_error()?;
        match eplb.call(EplbMsg::Status, Some(EPLB_TIMEOUT)).await {
            Ok(CallResult::Success(status)) => Ok(status),
            Ok(_) => Err(EpError::Actor("the EPLB did not answer".into())),
            Err(e) => Err(EpError::Actor(e.to_string())),
        }
    }

    fn eplb_or_error(&self) -> Result<ActorRef<EplbMsg>, EpError> {
        self.eplb()
            .ok_or_else(|| EpError::Actor("no EPLB actor (the engine has not started it)".into()))
    }

    /// The most recent rank steps (oldest first, at most 65536).
    pub fn step_log(&self) -> Vec<StepRecord> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.iter().copied().collect()
    }
}
