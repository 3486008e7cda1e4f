//! Which CUDA expert-parallel layouts the engine runs (DEP: one EP rank per DP rank, `[parallel]
//! dp = ep`), where each rank runs, what the nodes of a deployment must agree on, how they join,
//! and the placement the ranks serve at start; the ranks' experts and live EPLB are
//! `experts::device`.
//!
//! Built ([`RankLinks`]): every rank on one GPU (`device.gpus_per_node = 1`, rows moved by
//! device copies), one rank per GPU of one node (`parallel.dp = parallel.ep =
//! device.gpus_per_node`, rows moved by NCCL, the communicators created once every rank's
//! backend opened), or one rank per GPU of every node of a deployment of one `deepinfer-node`
//! per node (`parallel.dp = parallel.ep = device.nodes x device.gpus_per_node`,
//! `[cluster] bootstrap`): [`join_nodes`] runs the node bootstrap, in which node 0 creates
//! NCCL's unique id and hands it to every node, and each node creates its ranks'
//! communicators as global ranks `node * gpus_per_node + local` of one NCCL communicator
//! (`NcclDevices` with an `NcclWorld`); the nodes' lockstep is kept by their step counts
//! (`comm::steps::StepBeacon`), so an idle rank follows a busy one of another node; DSpark's
//! start-up profile runs the same steps on every rank of every node (the profile's shape and
//! the EPLB schedule are part of the nodes' fingerprint, so that every node counts the same
//! steps). None of the NCCL layouts has run on two GPUs yet.
//! Refused before anything loads, naming the field and the numbers: several ranks per GPU over
//! several GPUs or nodes (`parallel.ep`: NCCL and the device copies do not mix), live EPLB with
//! one rank.

use std::net::TcpListener;
use std::sync::Arc;

use deepinfer_model::any_model::AnyModel;
use deepinfer_model::config::ModelConfig;
use deepinfer_topology::{ExpertPlacement, NodeConfig, PlacementShape};

use crate::comm::EpError;
use crate::comm::bootstrap::{self, Member, UniqueId, UniqueIdSource};
use crate::comm::steps::StepBeacon;
use crate::error::EngineError;
use crate::experts::parallel::EpSettings;
use crate::experts::shard::ExpertSource;

/// The device of DP rank `dp` with `per_node` GPUs per node.
pub fn device_of(dp: usize, per_node: usize) -> usize {
    dp % per_node.max(1)
}

/// Refuses, for a CUDA topology with expert parallelism, what the engine does not run on CUDA
/// yet, naming the field (`dp = ep` is the topology's own rule).
pub fn check_cuda_expert_parallel(node: &NodeConfig) -> Result<(), EngineError> {
    let refuse = |field: &str, message: String| {
        Err(EngineError::Config {
            field: field.to_string(),
            message: format!("{}: {message}", node.origin),
        })
    };
    let ep = node.parallel.ep;
    if ep == 1 {
        if node.eplb.enabled {
            return refuse(
                "eplb.enabled",
                "live EPLB on CUDA balances the experts over EP ranks: it needs parallel.dp = \
                 parallel.ep > 1"
                    .to_string(),
            );
        }
        return Ok(());
    }
    let gpus = node.device.gpus_per_node;
    let nodes = node.device.nodes;
    if nodes > 1 {
        let all = u32::from(nodes) * u32::from(gpus);
        if u32::from(ep) != all {
            return refuse(
                "parallel.ep",
                format!(
                    "EP ranks over several nodes share one NCCL communicator, one rank per GPU \
                     on every node: parallel.dp = parallel.ep = {ep} ranks on device.nodes x \
                     device.gpus_per_node = {nodes} x {gpus} = {all} GPUs; use \
                     parallel.dp = parallel.ep = {all}"
                ),
            );
        }
        return Ok(());
    }
    if gpus > 1 && ep != gpus {
        return refuse(
            "parallel.ep",
            format!(
                "EP ranks on several GPUs move rows through NCCL, one rank per GPU (a NCCL \
                 communicator holds one rank per GPU, and the device copies of ranks sharing a \
                 GPU do not mix with it): parallel.dp = parallel.ep = {ep} ranks on \
                 device.gpus_per_node = {gpus} GPUs; use parallel.dp = parallel.ep = {gpus}, or \
                 device.gpus_per_node = 1"
            ),
        );
    }
    Ok(())
}

/// How the EP ranks of a CUDA topology move routed rows between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankLinks {
    /// Every rank on one GPU: device copies (`SharedDevice`).
    SharedDevice,
    /// One rank per GPU of the node, or of every node: NCCL (`NcclDevices`).
    Nccl,
}

/// The links of `node`'s EP ranks once [`check_cuda_expert_parallel`] accepted it; `None`
/// without expert parallelism.
pub fn rank_links(node: &NodeConfig) -> Option<RankLinks> {
    match (
        node.parallel.ep,
        node.device.gpus_per_node,
        node.device.nodes,
    ) {
        (1, _, _) => None,
        (_, 1, 1) => Some(RankLinks::SharedDevice),
        _ => Some(RankLinks::Nccl),
    }
}

/// What every node of a CUDA deployment must agree on (checked at the bootstrap): the model's
/// expert shape and the expert-parallel layout (as on the CPU, `EpSettings::fingerprint`), the
/// backend with its numerics, the GPUs per node, DSpark's profile (its settings and the
/// scheduler limits that size it) and the EPLB's schedule.
pub fn cuda_fingerprint(node: &NodeConfig, model: &AnyModel) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    EpSettings::from_node(node)
        .fingerprint(&ExpertSource::from(model.clone()))
        .hash(&mut hasher);
    (
        format!("{:?}", node.device.backend),
        node.device.gpus_per_node,
    )
        .hash(&mut hasher);
    // What decides how many collective steps each node runs outside of traffic (DSpark's
    // start-up profile) and when node 0 rebalances, which every node follows.
    let (dspark, scheduler, eplb) = (&node.dspark, &node.scheduler, &node.eplb);
    (
        dspark.enabled,
        dspark.max_draft_tokens,
        dspark.profile_steps,
        scheduler.max_batched_tokens,
        scheduler.max_running_requests,
    )
        .hash(&mut hasher);
    (
        eplb.enabled,
        eplb.window_steps,
        eplb.rebalance_interval_steps,
    )
        .hash(&mut hasher);
    hasher.finish()
}

/// What one node of a CUDA deployment over several nodes got from the others ([`join_nodes`]).
#[derive(Debug)]
pub struct NodeLinks {
    /// NCCL's unique id, created by node 0.
    pub unique_id: UniqueId,
    /// The global EP rank of this node's first rank (`node * gpus_per_node`).
    pub first_rank: usize,
    /// EP ranks of all nodes (the communicator's size).
    pub ranks: usize,
    /// The other nodes' step counts, which this node's `Lockstep` follows
    /// ([`DeviceExperts::across_nodes`]).
    pub peers: Arc<StepBeacon>,
}

/// Node `[cluster] node` of a CUDA deployment over `device.nodes` nodes joins the others:
/// binds its peer address (`[cluster] expert_listen`), goes through node 0's bootstrap
/// (`[cluster] bootstrap`; every node must agree on `fingerprint`, [`cuda_fingerprint`]; node 0
/// creates NCCL's unique id from `source` and every node gets it), then links its step counts
/// to theirs. Blocks until every node joined or `[cluster] bootstrap_timeout_seconds` passed.
pub fn join_nodes(
    node: &NodeConfig,
    fingerprint: u64,
    source: &dyn UniqueIdSource,
) -> Result<NodeLinks, EpError> {
    let cluster = &node.cluster;
    let bootstrap_addr = cluster
        .bootstrap
        .ok_or_else(|| EpError::Bootstrap("several nodes need [cluster] bootstrap".into()))?;
    let listener = TcpListener::bind(cluster.expert_listen).map_err(|e| {
        EpError::Bootstrap(format!("step counts on {}: {e}", cluster.expert_listen))
    })?;
    let expert_addr = listener
        .local_addr()
        .map_err(|e| EpError::Bootstrap(format!("step counts address: {e}")))?;
    let me = Member {
        node: cluster.node,
        nodes: node.device.nodes,
        fingerprint,
        expert_addr,
    };
    let joined = bootstrap::join(bootstrap_addr, me, cluster.bootstrap_timeout, Some(source))?;
    let unique_id = joined
        .unique_id
        .ok_or_else(|| EpError::Bootstrap("node 0 sent no unique id".into()))?;
    let peers = StepBeacon::start(
        listener,
        joined.session,
        cluster.node,
        &joined.experts,
        cluster.bootstrap_timeout,
    )?;
    Ok(NodeLinks {
        unique_id,
        first_rank: usize::from(node.ep_ranks_on_node().start),
        ranks: usize::from(node.parallel.ep),
        peers,
    })
}

/// The placement the EP ranks of `node` serve at start (epoch 0): equal loads over `cfg`'s
/// routed experts and the topology's redundant slots.
pub fn starting_placement(
    node: &NodeConfig,
    cfg: &ModelConfig,
) -> Result<Arc<ExpertPlacement>, EngineError> {
    let experts = u16::try_from(cfg.n_routed_experts).map_err(|_| EngineError::Model {
        what: "expert parallelism".to_string(),
        message: format!("{} routed experts exceed u16", cfg.n_routed_experts),
    })?;
    let shape = PlacementShape::from_config(node, experts);
    ExpertPlacement::uniform(cfg.n_layers, cfg.n_routed_experts, shape)
        .map(Arc::new)
        .map_err(|e| EngineError::Config {
            field: "parallel.ep".to_string(),
            message: format!("{}: {e}", node.origin),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::device::DeviceExperts;
    use crate::experts::lockstep::NodePeers;
    use deepinfer_topology::EpRank;

    fn cuda(extra: &str) -> NodeConfig {
        let text = format!("[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\n{extra}");
        NodeConfig::from_toml_str(&text, "cuda ep test").expect("topology")
    }

    fn refusal(node: &NodeConfig) -> (String, String) {
        match check_cuda_expert_parallel(node) {
            Err(EngineError::Config { field, message }) => {
                assert!(message.starts_with("cuda ep test: "), "{message}");
                (field, message)
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn ranks(gpus: u16, ranks: u16) -> String {
        format!("gpus_per_node = {gpus}\n[parallel]\ndp = {ranks}\nep = {ranks}\n")
    }

    /// Ranks on one GPU (device copies) and one rank per GPU of one node (NCCL) run, with
    /// live EPLB and DSpark too (the ranks profile DSpark's step rate together); several ranks
    /// per GPU over several GPUs, and live EPLB over one rank are refused naming the field and
    /// the numbers; `ep != dp` (and context parallelism) never get here: the topology refuses
    /// them. (Several nodes: the next test.)
    #[test]
    fn what_cuda_expert_parallelism_runs_and_refuses() {
        let eplb = "[eplb]\nenabled = true\n";
        let dspark = "[dspark]\nenabled = true\n";
        let both = format!("{eplb}{dspark}");
        for (gpus, count, links) in [
            (1, 2, RankLinks::SharedDevice),
            (1, 4, RankLinks::SharedDevice),
            (2, 2, RankLinks::Nccl),
            (8, 8, RankLinks::Nccl),
        ] {
            for extra in ["", eplb, dspark, &both] {
                let node = cuda(&format!("{}{extra}", ranks(gpus, count)));
                assert!(
                    check_cuda_expert_parallel(&node).is_ok(),
                    "{count} ranks on {gpus} GPUs {extra}"
                );
                assert_eq!(
                    rank_links(&node),
                    Some(links),
                    "{count} ranks on {gpus} GPUs"
                );
            }
        }
        assert!(check_cuda_expert_parallel(&cuda("")).is_ok());
        assert!(check_cuda_expert_parallel(&cuda(dspark)).is_ok());
        assert_eq!(rank_links(&cuda("")), None);
        assert_eq!(refusal(&cuda(eplb)).0, "eplb.enabled");

        let (field, message) = refusal(&cuda(&ranks(2, 4)));
        assert_eq!(field, "parallel.ep");
        for part in [
            "parallel.dp = parallel.ep = 4 ranks on device.gpus_per_node = 2 GPUs",
            "one rank per GPU",
            "use parallel.dp = parallel.ep = 2",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }

        let err = NodeConfig::from_toml_str(
            "[device]\nbackend = \"cuda\"\ngpus_per_node = 1\n[parallel]\ndp = 2\nep = 1\n",
            "ep below dp",
        )
        .expect_err("ep != dp on cuda");
        assert!(err.to_string().contains("parallel.ep"), "{err}");
    }

    /// Node `node` of `nodes` with `gpus` GPUs each and `count` DP = EP ranks in all.
    fn on_nodes(nodes: u16, node: u16, gpus: u16, count: u16, extra: &str) -> NodeConfig {
        cuda(&format!(
            "nodes = {nodes}\n{}{extra}[cluster]\nnode = {node}\nbootstrap = \"127.0.0.1:29500\"\n",
            ranks(gpus, count)
        ))
    }

    /// Over several nodes, one rank per GPU on every node runs (NCCL, whatever the GPUs per
    /// node), on every node of the deployment, with live EPLB and DSpark too; several ranks per
    /// GPU are refused naming the field and the numbers.
    #[test]
    fn what_cuda_expert_parallelism_runs_over_several_nodes() {
        for (nodes, gpus) in [(2, 1), (2, 2), (2, 8), (4, 8)] {
            for node in [0, nodes - 1] {
                let topology = on_nodes(nodes, node, gpus, nodes * gpus, "");
                let what = format!("node {node} of {nodes} with {gpus} GPUs each");
                assert_eq!(check_cuda_expert_parallel(&topology), Ok(()), "{what}");
                assert_eq!(rank_links(&topology), Some(RankLinks::Nccl), "{what}");
                assert_eq!(
                    usize::from(topology.dp_on_node()),
                    usize::from(gpus),
                    "{what}"
                );
            }
        }

        for (gpus, count, uses) in [(1, 4, 2), (2, 8, 4)] {
            let (field, message) = refusal(&on_nodes(2, 1, gpus, count, ""));
            assert_eq!(field, "parallel.ep");
            for part in [
                format!(
                    "parallel.dp = parallel.ep = {count} ranks on device.nodes x \
                     device.gpus_per_node = 2 x {gpus} = {uses} GPUs"
                ),
                "one rank per GPU on every node".to_string(),
                format!("use parallel.dp = parallel.ep = {uses}"),
            ] {
                assert!(message.contains(&part), "{part}: {message}");
            }
        }

        for extra in [
            "[eplb]\nenabled = true\n",
            "[dspark]\nenabled = true\n",
            "[eplb]\nenabled = true\n[dspark]\nenabled = true\n",
        ] {
            for node in [0, 1] {
                let topology = on_nodes(2, node, 2, 4, extra);
                assert_eq!(check_cuda_expert_parallel(&topology), Ok(()), "{extra}");
            }
        }
    }

    /// Every shipped topology with `backend = "cuda"` passes the start check on every one of its
    /// nodes (as each node of a real deployment runs it), the flagship `sm100x64.toml` (8 nodes
    /// of 8 GPUs, live EPLB and DSpark on) included.
    #[test]
    fn every_shipped_cuda_config_passes_the_start_check_on_every_node() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut checked = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("configs/") {
            let path = entry.expect("an entry").path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable");
            let node = NodeConfig::from_toml_str(&text, &path.display().to_string())
                .unwrap_or_else(|e| panic!("{e}"));
            if node.device.backend == deepinfer_topology::Backend::Cpu {
                continue;
            }
            for index in 0..node.device.nodes {
                let mut on = node.clone();
                on.cluster.node = index;
                if on.device.nodes > 1 {
                    on.cluster.bootstrap = Some("127.0.0.1:29500".parse().expect("address"));
                }
                assert_eq!(
                    check_cuda_expert_parallel(&on),
                    Ok(()),
                    "{} node {index}",
                    path.display()
                );
            }
            checked.push(
                path.file_name()
                    .expect("a name")
                    .to_string_lossy()
                    .into_owned(),
            );
        }
        checked.sort();
        for name in ["h200x1.toml", "h200x2.toml", "h200x8.toml", "sm100x64.toml"] {
            assert!(checked.iter().any(|c| c == name), "{name}: {checked:?}");
        }
        let flagship = NodeConfig::from_toml_str(
            &std::fs::read_to_string(dir.join("sm100x64.toml")).expect("readable"),
            "sm100x64",
        )
        .expect("valid");
        assert!(flagship.eplb.enabled && flagship.dspark.enabled);
        assert_eq!((flagship.device.nodes, flagship.parallel.ep), (8, 64));
    }

    /// Every node of one deployment has the same fingerprint; another layout, GPU count or
    /// numerics does not.
    #[test]
    fn nodes_agree_on_the_fingerprint_of_what_they_run() {
        let (_dir, model) = crate::experts::tiny_test_model();
        let model = AnyModel::from(model);
        let of = |node: u16, gpus: u16, count: u16| {
            cuda_fingerprint(&on_nodes(2, node, gpus, count, ""), &model)
        };
        let node0 = of(0, 2, 4);
        assert_eq!(of(1, 2, 4), node0);
        assert_ne!(of(1, 1, 2), node0);
        let exact = cuda(&format!(
            "numerics = \"exact\"\nnodes = 2\n{}[cluster]\nnode = 1\n\
             bootstrap = \"127.0.0.1:29500\"\n",
            ranks(2, 4)
        ));
        assert_ne!(cuda_fingerprint(&exact, &model), node0);
    }

    #[test]
    fn ranks_wrap_over_the_gpus_of_a_node() {
        let devices: Vec<usize> = (0..5).map(|dp| device_of(dp, 2)).collect();
        assert_eq!(devices, vec![0, 1, 0, 1, 0]);
        assert!((0..4).all(|dp| device_of(dp, 1) == 0));
        assert_eq!(device_of(3, 0), 0);
    }

    /// Epoch 0 splits every layer's experts over the ranks, for either family (the tiny models:
    /// 8 experts, 2 ranks of 4 slots, no redundant slot): each rank uploads half, the halves
    /// disjoint.
    #[test]
    fn the_starting_placement_gives_each_rank_its_share() {
        let node = cuda("gpus_per_node = 1\n[parallel]\ndp = 2\nep = 2\n");
        for cfg in [ModelConfig::tiny_v41(), ModelConfig::tiny_v4()] {
            let family = cfg.family;
            let placement = starting_placement(&node, &cfg).expect("placement");
            assert_eq!(placement.slots_per_gpu, 4, "{family:?}");
            assert_eq!(placement.layers.len(), cfg.n_layers, "{family:?}");
            for layer in 0..cfg.n_layers {
                let (a, b) = (
                    placement.held_experts(layer, EpRank(0)),
                    placement.held_experts(layer, EpRank(1)),
                );
                assert_eq!(a.len(), 4, "{family:?} layer {layer}");
                assert_eq!(
                    a.len() + b.len(),
                    cfg.n_routed_experts,
                    "{family:?} layer {layer}"
                );
                assert!(a.iter().all(|e| !b.contains(e)), "{family:?} layer {layer}");
            }
        }
    }

    /// Two nodes of two GPUs each join over loopback (a fake unique id for NCCL's): both get
    /// node 0's id, their first global ranks (0 and 2) and the communicator's size, and each
    /// hears the steps the other's ranks lead; nodes of another layout are refused.
    #[test]
    fn nodes_join_with_the_unique_id_and_hear_each_others_steps() {
        let boot = crate::comm::free_loopback();
        let topology = move |node: u16| {
            cuda(&format!(
                "nodes = 2\n{}[cluster]\nnode = {node}\nbootstrap = \"{boot}\"\n\
                 bootstrap_timeout_seconds = 20\n",
                ranks(2, 4)
            ))
        };
        let id: UniqueId = std::array::from_fn(|i| (255 - i) as u8);
        let fake = move || -> Result<UniqueId, String> { Ok(id) };
        let never = || -> Result<UniqueId, String> { Err("a follower creates no id".into()) };
        let second = std::thread::spawn(move || join_nodes(&topology(1), 9, &never));
        let first = join_nodes(&topology(0), 9, &fake).expect("node 0");
        let second = second.join().expect("thread").expect("node 1");
        assert_eq!((first.unique_id, second.unique_id), (id, id));
        assert_eq!((first.first_rank, second.first_rank), (0, 2));
        assert_eq!((first.ranks, second.ranks), (4, 4));
        let group = DeviceExperts::across_nodes(
            &topology(1),
            2,
            ExpertPlacement::uniform(1, 8, PlacementShape::from_config(&topology(1), 8))
                .map(Arc::new)
                .expect("placement"),
            second.peers.clone(),
        );
        first.peers.announce(3);
        let started = std::time::Instant::now();
        while group.lockstep().behind(0) < 3 {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(10),
                "node 1 hears 3"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            (group.lockstep().behind(1), group.lockstep().steps()),
            (3, 3)
        );

        let boot = crate::comm::free_loopback();
        let topology = move |node: u16, fingerprint: u64| {
            let text = format!(
                "nodes = 2\n{}[cluster]\nnode = {node}\nbootstrap = \"{boot}\"\n\
                 bootstrap_timeout_seconds = 20\n",
                ranks(2, 4)
            );
            (cuda(&text), fingerprint)
        };
        let other = std::thread::spawn(move || {
            let (node, fingerprint) = topology(1, 8);
            join_nodes(&node, fingerprint, &never)
        });
        let (node, fingerprint) = topology(0, 9);
        let err = join_nodes(&node, fingerprint, &fake).expect_err("another fingerprint");
        assert!(
            err.to_string().contains("another model or topology"),
            "{err}"
        );
        assert!(other.join().expect("thread").is_err());
    }
}
