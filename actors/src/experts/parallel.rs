//! `ExpertParallel`: the expert-parallel data plane one engine shares between its rank threads
//! and its `ExpertGroupActor`s / `EplbActor`.
//!
//! Owns: the source the shards copy their weights from (the model, or none when simulated), the placement shape, the EPLB schedule, the committed
//! `LocalComm` (the placement epoch ranks adopt at their next step), a bounded log of which epoch
//! each rank step ran on, and the `EplbActor`'s ref once the supervisor spawned it.
//! Ordering: `commit` swaps the current transport; a rank reads it once at the start of a step
//! (`begin_step`) and keeps it to the end, so a step never mixes epochs; the old transport lives
//! until its last step finishes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use deepinfer_topology::{
    ClusterConfig, DpRank, EpRank, ExpertPlacement, NodeConfig, PlacementEpoch, PlacementShape,
};
use ractor::ActorRef;
use ractor::rpc::CallResult;

use crate::comm::bootstrap::{self, Member};
use crate::comm::remote::{ExpertServer, RemoteRanks};
use crate::comm::{EpError, LocalComm};
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
            (cfg.dim, cfg.vocab_size, cfg.n_activated_experts).hash(&mut hasher);
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

/// The shape and the placement for equal loads (epoch 0) of `settings` over `source`.
fn epoch_zero(
    source: &ExpertSource,
    settings: EpSettings,
) -> Result<(PlacementShape, Arc<ExpertPlacement>), EpError> {
    let (layers, experts) = (source.layers(), source.routed_experts());
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

/// The shared expert-parallel state of one engine.
#[derive(Debug)]
pub struct ExpertParallel {
    source: ExpertSource,
    shape: PlacementShape,
    settings: EpSettings,
    current: RwLock<Arc<LocalComm>>,
    eplb: Mutex<Option<ActorRef<EplbMsg>>>,
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
        let (shape, placement) = epoch_zero(&source, settings)?;
        let shards = build_shards(&source, &placement, 0..settings.ep_ranks)?;
        let comm = LocalComm::new(PlacementEpoch(0), source.clone(), placement, shards)?;
        Ok(ExpertParallel::with_comm(source, shape, settings, comm))
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
        let (shape, placement) = epoch_zero(&source, settings)?;
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
        let joined = bootstrap::join(bootstrap_addr, me, cluster.bootstrap_timeout)?;
        let remote = RemoteRanks::new(
            joined.session,
            cluster.exchange_timeout,
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
        let parallel = ExpertParallel::with_comm(source, shape, settings, comm);
        let server = ExpertServer::start(listener, joined.session, Arc::downgrade(&parallel))?;
        *parallel.server.lock().unwrap_or_else(|p| p.into_inner()) = Some(server);
        Ok(parallel)
    }

    fn with_comm(
        source: ExpertSource,
        shape: PlacementShape,
        settings: EpSettings,
        comm: LocalComm,
    ) -> Arc<ExpertParallel> {
        Arc::new(ExpertParallel {
            source,
            shape,
            settings,
            current: RwLock::new(Arc::new(comm)),
            eplb: Mutex::new(None),
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

    /// Makes `comm` the transport of every step that starts from now on.
    pub(crate) fn commit(&self, comm: Arc<LocalComm>) {
        match self.current.write() {
            Ok(mut guard) => *guard = comm,
            Err(poisoned) => *poisoned.into_inner() = comm,
        }
    }

    /// The `EplbActor`, once spawned.
    pub fn eplb(&self) -> Option<ActorRef<EplbMsg>> {
        self.eplb
            .lock()
            .map(|g| g.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    pub(crate) fn attach_eplb(&self, eplb: ActorRef<EplbMsg>) {
        match self.eplb.lock() {
            Ok(mut guard) => *guard = Some(eplb),
            Err(poisoned) => *poisoned.into_inner() = Some(eplb),
        }
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
