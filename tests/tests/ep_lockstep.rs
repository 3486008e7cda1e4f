//! DP ranks in `Lockstep` (how expert parallelism on CUDA steps, `experts::device`), on CPU
//! backends so that CI runs the engine side of it:
//! - two ranks, often one busy and one idle, serve the requests with the tokens and logits rows
//!   of one rank, bitwise, and once the traffic is done no rank is behind: the idle rank
//!   followed every step its peer began (on CUDA each such step is every MoE layer's
//!   collective, which the busy rank cannot finish alone);
//! - with live EPLB over stand-in device ranks (skewed load counts; staging and adoption
//!   recorded, the CPU backends computing every expert), placements are staged and adopted by
//!   the rank threads under traffic: both ranks run every step index on the same epoch, the
//!   epochs advance, and the outputs stay those of one rank;
//! - with DSpark on, every rank profiles the steps-per-second table on its own executor (each
//!   rank's backend opened once, no scratch executor), the same steps on both ranks in lockstep,
//!   before it serves the tokens of one rank;
//! - the same group driven step by step: where the commit lands, a rank that cannot stage
//!   aborting the rebalance, and DSpark's start-up profile left out of the first window;
//! - two engines as two nodes (one rank each, their lockstep linked by `StepBeacon`s over
//!   loopback, as `deepinfer-node`s of a CUDA deployment over two nodes are): one serves, the
//!   other has no request, and its rank follows every step the busy node's rank began (each
//!   a collective over both nodes on CUDA), with nothing announced back and forth once idle;
//!   with live EPLB under loads that move, both nodes commit several placements at the same
//!   steps.

mod ep_support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deepinfer_actors::comm::steps::StepBeacon;
use deepinfer_actors::experts::cuda_layout::starting_placement;
use deepinfer_actors::experts::device::{DeviceExperts, DeviceRank};
use deepinfer_actors::messages::experts::ShardLoads;
use deepinfer_actors::rank::factory::{ModelFactory, RankDevices};
use deepinfer_actors::rank::observe::{ObservedFactory, ObservedRow, RankObserver};
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest};
use deepinfer_model::Model;
use deepinfer_model::backend::{Backend, CpuBackend};
use deepinfer_model::config::ModelConfig;
use deepinfer_topology::{ExpertPlacement, PlacementEpoch};
use ep_support::{
    bits, dspark_node, facts, model, node, run_engine, run_requests, shut_down, skewed_prompts,
    start_engine,
};

/// How long the idle rank may take to catch up once the traffic is done (it polls every
/// `FOLLOW_POLL`).
const CATCH_UP: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_in_lockstep_serve_what_one_rank_serves() {
    let (_dir, model) = model();
    let facts = facts(&model);
    let mut prompts = skewed_prompts(3);
    prompts.extend([(10..24).collect(), vec![300, 1, 44, 500, 2]]);
    let max_tokens = 5;
    let one = ModelFactory::new(model.clone(), "one rank");
    let (expected, expected_rows) =
        run_engine(node(1, 1, ""), Arc::new(one), facts, &prompts, max_tokens).await;

    let topology = node(2, 2, "");
    let placement = starting_placement(&topology, model.config()).expect("placement");
    let group = Arc::new(DeviceExperts::new(&topology, 2, placement));
    let lockstep = group.lockstep();
    let two = two_ranks(&model, &group, |_| {});
    let (engine, rows, freed) = start_engine(topology, Arc::new(two), facts).await;
    // Two waves: the second's single request leaves one rank with nothing to do.
    let mut got = run_requests(&engine, &prompts, max_tokens).await;
    got.extend(run_requests(&engine, &prompts[3..4], max_tokens).await);
    let started = Instant::now();
    while (0..2).any(|rank| lockstep.behind(rank) > 0) {
        assert!(
            started.elapsed() < CATCH_UP,
            "a rank stays behind: {} and {} steps",
            lockstep.behind(0),
            lockstep.behind(1)
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let steps = lockstep.steps();
    freed.shutdown_and_check_replay(engine).await;

    let (got_first, got_second): (Vec<_>, Vec<_>) = got
        .into_iter()
        .partition(|(id, _)| expected.contains_key(id));
    assert_eq!(got_first.into_iter().collect::<BTreeMap<_, _>>(), expected);
    let (_, alone) = &got_second[0];
    assert_eq!(
        alone,
        &expected.values().nth(3).cloned().expect("request 4")
    );
    let rows = rows.snapshot();
    let mut compared = 0;
    for (key, reference) in &expected_rows {
        let live = rows.get(key).expect("every row of the one-rank run");
        assert_eq!(bits(live), bits(reference), "{key:?}");
        compared += 1;
    }
    // Each wave needs at least one step per generated token, both ranks in each.
    assert!(steps as usize >= 2 * max_tokens, "{steps} lockstep steps");
    // The step log: both ranks ran every step index, on epoch 0 (no EPLB).
    let log = group.step_log();
    for rank in 0..2 {
        let indices: Vec<u64> = log
            .iter()
            .filter(|s| s.dp == rank)
            .map(|s| s.index)
            .collect();
        assert_eq!(indices, (0..steps).collect::<Vec<_>>(), "rank {rank}");
    }
    assert!(log.iter().all(|s| s.epoch == PlacementEpoch(0)));
    println!(
        "two ranks in lockstep: {steps} steps each, {compared} rows bitwise equal to one rank"
    );
}

/// Node 0's engine serves the requests, node 1's none: node 1's rank follows every step node
/// 0's rank began, as heard through the step counts, and both step logs hold every index once;
/// the outputs are one rank's; idle, neither node steps again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_node_follows_the_steps_of_a_busy_one() {
    let (_dir, model) = model();
    let facts = facts(&model);
    let prompts = skewed_prompts(3);
    let max_tokens = 4;
    let one = ModelFactory::new(model.clone(), "one rank");
    let (expected, _) =
        run_engine(node(1, 1, ""), Arc::new(one), facts, &prompts, max_tokens).await;

    let (groups, _beacons) = two_nodes(&model, &node(1, 1, ""));
    let mut engines = Vec::new();
    for group in &groups {
        let one_rank = one_rank_of(&model, group, || {});
        engines.push(start_engine(node(1, 1, ""), Arc::new(one_rank), facts).await);
    }
    let got = run_requests(&engines[0].0, &prompts, max_tokens).await;
    assert_eq!(got, expected);
    let (busy, idle) = (groups[0].lockstep(), groups[1].lockstep());
    let started = Instant::now();
    while idle.behind(0) > 0 || idle.steps() < busy.steps() {
        assert!(
            started.elapsed() < CATCH_UP,
            "node 1 stays behind node 0: {} of {} steps",
            idle.steps() - idle.behind(0),
            busy.steps()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let steps = busy.steps();
    assert!(steps as usize >= max_tokens, "{steps} steps");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        (busy.steps(), idle.steps()),
        (steps, steps),
        "idle nodes stepped on"
    );
    for (n, group) in groups.iter().enumerate() {
        let indices: Vec<u64> = group.step_log().iter().map(|s| s.index).collect();
        assert_eq!(indices, (0..steps).collect::<Vec<_>>(), "node {n}");
    }
    for (n, (engine, _, freed)) in engines.into_iter().enumerate() {
        // Node 1 ran no sequence: nothing of its own to check against the `ReplayActor`.
        shut_down(engine, &freed, n == 0).await;
    }
    println!("two nodes in lockstep: node 1 followed all {steps} steps of node 0");
}

/// The logits rows each of two ranks computed.
#[derive(Default)]
struct RowsPerRank(Mutex<[usize; 2]>);

impl RankObserver for RowsPerRank {
    fn row(&self, row: ObservedRow<'_>) {
        self.0.lock().expect("not poisoned")[row.dp] += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dspark_profiles_on_every_rank_in_lockstep() {
    let (_dir, model) = model();
    let facts = facts(&model);
    let prompts = skewed_prompts(3);
    let max_tokens = 5;
    let one = ModelFactory::new(model.clone(), "one rank");
    let (expected, _) =
        run_engine(node(1, 1, ""), Arc::new(one), facts, &prompts, max_tokens).await;

    let topology = dspark_node(2, 2);
    let placement = starting_placement(&topology, model.config()).expect("placement");
    let group = Arc::new(DeviceExperts::new(&topology, 2, placement));
    let lockstep = group.lockstep();
    let opened = Arc::new(Mutex::new(Vec::new()));
    let log = opened.clone();
    let two = two_ranks(&model, &group, move |dp| {
        log.lock().expect("not poisoned").push(dp)
    });
    let rows = Arc::new(RowsPerRank::default());
    let engine = Engine::start(EngineConfig {
        node: topology,
        executor: Arc::new(ObservedFactory::new(Arc::new(two), rows.clone())),
        model: facts,
        tokenizer: None,
    })
    .await
    .expect("engine starts");
    // Started: both ranks ran the whole profile (a seeding step, then one per batch size) as
    // steps of their own, pairing up; no scratch executor opened a backend.
    assert_eq!(*opened.lock().expect("not poisoned"), vec![0, 1]);
    assert_eq!(lockstep.steps(), 1 + 6);
    assert!((0..2).all(|rank| lockstep.behind(rank) == 0));
    let profiled = *rows.0.lock().expect("not poisoned");
    assert!(
        profiled[0] > 0 && profiled[0] == profiled[1],
        "rows per rank: {profiled:?}"
    );

    let got = run_requests(&engine, &prompts, max_tokens).await;
    let started = Instant::now();
    while (0..2).any(|rank| lockstep.behind(rank) > 0) {
        assert!(started.elapsed() < CATCH_UP, "a rank stays behind");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let steps = lockstep.steps();
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shuts down");
    assert_eq!(
        got, expected,
        "DSpark on, two ranks in lockstep vs one rank"
    );
    let log = group.step_log();
    for rank in 0..2 {
        let indices: Vec<u64> = log
            .iter()
            .filter(|s| s.dp == rank)
            .map(|s| s.index)
            .collect();
        assert_eq!(indices, (0..steps).collect::<Vec<_>>(), "rank {rank}");
    }
    println!("DSpark over two ranks in lockstep: {profiled:?} profile rows, {steps} steps");
}

/// Two ranks on CPU backends stepping through `group`; `opened(dp)` runs as rank `dp`'s backend
/// opens (on its thread).
fn two_ranks(
    model: &Arc<Model>,
    group: &Arc<DeviceExperts>,
    opened: impl Fn(usize) + Send + Sync + 'static,
) -> ModelFactory {
    ModelFactory::per_device(
        model.clone(),
        "two CPU ranks stepping as device EP ranks",
        RankDevices {
            per_node: 1,
            open: Arc::new(move |dp, _device| {
                opened(dp);
                Ok(Box::new(CpuBackend::new()) as Box<dyn Backend>)
            }),
            experts: Some(group.clone()),
        },
    )
}

/// The load counts a [`StandIn`] reports.
enum Loads {
    /// Slot 0 of every layer ten times as busy as the others, every window.
    Fixed,
    /// The busy slot moves on by one at every window (`windows` taken so far), so that every
    /// window plans a new placement.
    Shifting { windows: usize },
    /// What the test served on the rank ([`StandIn::serve`]) since the last window.
    Served(Vec<Vec<u64>>),
}

/// Stands in for a CUDA EP rank: skewed load counts, staging and adoption recorded.
struct StandIn {
    layers: usize,
    slots: usize,
    loads: Mutex<Loads>,
    /// `(epoch in use, staged epoch)`.
    state: Mutex<(PlacementEpoch, Option<PlacementEpoch>)>,
    /// Every placement staged, with its epoch.
    staged: Mutex<Vec<(PlacementEpoch, Arc<ExpertPlacement>)>>,
    /// Staging fails (out of device memory).
    full: bool,
}

impl StandIn {
    fn new(layers: usize, slots: usize, full: bool) -> StandIn {
        StandIn::with_loads(layers, slots, full, Loads::Fixed)
    }

    fn with_loads(layers: usize, slots: usize, full: bool, loads: Loads) -> StandIn {
        StandIn {
            layers,
            slots,
            loads: Mutex::new(loads),
            state: Mutex::new((PlacementEpoch(0), None)),
            staged: Mutex::new(Vec::new()),
            full,
        }
    }

    /// Counts `picks` routed rows on slot `slot` of every layer (a [`Loads::Served`] rank).
    fn serve(&self, slot: usize, picks: u64) {
        if let Loads::Served(per_slot) = &mut *self.loads.lock().expect("not poisoned") {
            for layer in per_slot {
                layer[slot] += picks;
            }
        }
    }

    /// The placement staged as `epoch`.
    fn placement_of(&self, epoch: PlacementEpoch) -> Option<Arc<ExpertPlacement>> {
        let staged = self.staged.lock().expect("not poisoned");
        staged
            .iter()
            .find(|(e, _)| *e == epoch)
            .map(|(_, p)| p.clone())
    }
}

impl DeviceRank for StandIn {
    fn epoch(&self) -> PlacementEpoch {
        self.state.lock().expect("not poisoned").0
    }
    fn take_loads(&self) -> ShardLoads {
        let busy = |slot: usize| {
            let mut per_slot = vec![vec![1; self.slots]; self.layers];
            for layer in &mut per_slot {
                layer[slot] = 50;
            }
            per_slot
        };
        let per_slot = match &mut *self.loads.lock().expect("not poisoned") {
            Loads::Fixed => busy(0),
            Loads::Shifting { windows } => {
                *windows += 1;
                busy(*windows % self.slots)
            }
            Loads::Served(per_slot) => {
                std::mem::replace(per_slot, vec![vec![0; self.slots]; self.layers])
            }
        };
        ShardLoads {
            epoch: self.epoch(),
            per_slot,
        }
    }
    fn stage(
        &self,
        _backend: &dyn Backend,
        placement: Arc<ExpertPlacement>,
        epoch: PlacementEpoch,
    ) -> Result<usize, String> {
        if self.full {
            return Err("out of device memory".to_string());
        }
        self.state.lock().expect("not poisoned").1 = Some(epoch);
        self.staged
            .lock()
            .expect("not poisoned")
            .push((epoch, placement));
        Ok(3)
    }
    fn adopt(&self, _backend: &dyn Backend, epoch: PlacementEpoch) -> Result<usize, String> {
        let mut state = self.state.lock().expect("not poisoned");
        if state.1.take() != Some(epoch) {
            return Err(format!("{epoch} adopted without being staged"));
        }
        state.0 = epoch;
        Ok(1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_eplb_swaps_epochs_at_one_step_under_traffic() {
    let (_dir, model) = model();
    let facts = facts(&model);
    let prompts = skewed_prompts(6);
    let max_tokens = 6;
    let one = ModelFactory::new(model.clone(), "one rank");
    let (expected, _) =
        run_engine(node(1, 1, ""), Arc::new(one), facts, &prompts, max_tokens).await;

    let topology = node(
        2,
        2,
        "enabled = true\nredundant_experts = 2\nwindow_steps = 1\nrebalance_interval_steps = 2",
    );
    let placement = starting_placement(&topology, model.config()).expect("placement");
    let (layers, slots) = (placement.layers.len(), placement.slots_per_gpu);
    let group = Arc::new(DeviceExperts::new(&topology, 2, placement));
    let registry = group.clone();
    let two = two_ranks(&model, &group, move |dp| {
        registry.register(dp, Arc::new(StandIn::new(layers, slots, false)));
    });
    let (got, _) = run_engine(topology, Arc::new(two), facts, &prompts, max_tokens).await;
    assert_eq!(got, expected);

    let log = group.step_log();
    let mut epoch_of: BTreeMap<u64, PlacementEpoch> = BTreeMap::new();
    for step in &log {
        let first = *epoch_of.entry(step.index).or_insert(step.epoch);
        assert_eq!(first, step.epoch, "step {} on two epochs", step.index);
    }
    let epochs: Vec<PlacementEpoch> = epoch_of.values().copied().collect();
    assert!(epochs.windows(2).all(|w| w[0] <= w[1]), "{epochs:?}");
    let status = group.eplb_status().expect("EPLB on");
    let last = *epochs.last().expect("steps ran");
    assert!(
        last > PlacementEpoch(0),
        "no placement was committed: {status:?}"
    );
    assert_eq!(u64::from(last.get()), status.rebalances, "{status:?}");
    println!(
        "live EPLB over stand-in ranks: {} steps, {} rebalances committed under traffic",
        epochs.len(),
        status.rebalances
    );
}

/// Two stand-ins (rank 1's staging fails when `full`) in a group rebalancing every 3 steps over
/// a 1-step window, driven on this thread for 12 steps with rank 1 one step behind rank 0: the
/// epoch of each step index on each rank, the group and the stand-ins.
fn run_group(full: bool) -> (Vec<u32>, Vec<u32>, DeviceExperts, Vec<Arc<StandIn>>) {
    let cfg = ModelConfig::tiny_v41();
    let topology = node(
        2,
        2,
        "enabled = true\nredundant_experts = 2\nwindow_steps = 1\nrebalance_interval_steps = 3",
    );
    let placement = starting_placement(&topology, &cfg).expect("placement");
    let slots = placement.slots_per_gpu;
    let group = DeviceExperts::new(&topology, 2, placement);
    let ranks: Vec<Arc<StandIn>> = (0..2)
        .map(|rank| Arc::new(StandIn::new(cfg.n_layers, slots, full && rank == 1)))
        .collect();
    for (rank, stand_in) in ranks.iter().enumerate() {
        group.register(rank, stand_in.clone());
    }
    let backend = CpuBackend::new();
    for _ in 0..12 {
        for rank in 0..2 {
            let (_, epoch) = group.begin(rank, &backend).expect("step begins");
            group.finish(rank, epoch).expect("step finishes");
        }
    }
    let log = group.step_log();
    let epochs = |rank: usize| -> Vec<u32> {
        (0..12)
            .map(|index| {
                log.iter()
                    .find(|s| s.dp == rank && s.index == index)
                    .map(|s| s.epoch.get())
                    .expect("step logged")
            })
            .collect()
    };
    (epochs(0), epochs(1), group, ranks)
}

/// A rebalance is staged on each rank at its next step; the last rank to build it commits it
/// at the first step no rank has begun, and both ranks adopt it at that same step index; no
/// step index runs on two epochs, and epochs never go back.
#[test]
fn a_rebalance_is_staged_on_every_rank_then_adopted_at_one_step() {
    let (epochs, rank1, group, ranks) = run_group(false);
    assert_eq!(epochs, rank1);
    // Rank 0's third step (index 2) rebalances; rank 1 stages at its index 2, rank 0 at its
    // index 3 and commits from index 3, which neither had begun: both run it on epoch 1.
    assert_eq!(&epochs[..4], &[0, 0, 0, 1], "{epochs:?}");
    assert!(epochs.windows(2).all(|w| w[1] - w[0] <= 1), "{epochs:?}");
    assert!(
        ranks
            .iter()
            .all(|r| r.epoch() == PlacementEpoch(epochs[11]))
    );
    let status = group.eplb_status().expect("EPLB on");
    assert_eq!(status.epoch, PlacementEpoch(epochs[11]));
    assert_eq!(u64::from(epochs[11]), status.rebalances, "{status:?}");
    let last = status.last.expect("a rebalance report");
    assert!(!last.committed || last.copied_experts == 6, "{last:?}");
}

/// A rank that cannot build the new placement aborts the rebalance: every step stays on epoch
/// 0, nothing fails, and the rank that did build it never adopts it.
#[test]
fn a_failed_staging_keeps_the_placement() {
    let (epochs, rank1, group, ranks) = run_group(true);
    assert!(
        epochs.iter().chain(&rank1).all(|&e| e == 0),
        "{epochs:?} {rank1:?}"
    );
    assert!(ranks.iter().all(|r| r.epoch() == PlacementEpoch(0)));
    let status = group.eplb_status().expect("EPLB on");
    assert_eq!((status.epoch, status.rebalances), (PlacementEpoch(0), 0));
}

/// DSpark's start-up profile is no traffic: with a load window as long as the rebalance
/// interval (so that the first window starts at step 0), the first rebalance measures only the
/// steps served after the profile, and plans for their busy expert, not the profile's. Two
/// stand-ins counting what this test serves: 1000 picks a step on slot 0 during the profile,
/// 10 on slot 1 after it.
#[test]
fn the_first_rebalance_measures_traffic_not_the_profile() {
    let cfg = ModelConfig::tiny_v41();
    let topology = node(
        2,
        2,
        "enabled = true\nredundant_experts = 2\nwindow_steps = 4\nrebalance_interval_steps = 4\n\
         [dspark]\nenabled = true\nmax_draft_tokens = 5\nprofile_steps = 1\n",
    );
    let placement = starting_placement(&topology, &cfg).expect("placement");
    let slots = placement.slots_per_gpu;
    let group = DeviceExperts::new(&topology, 2, placement.clone());
    let profile = group.profile_steps();
    assert!(profile > 0, "DSpark on profiles");
    let served = || Loads::Served(vec![vec![0; slots]; cfg.n_layers]);
    let ranks: Vec<Arc<StandIn>> = (0..2)
        .map(|_| Arc::new(StandIn::with_loads(cfg.n_layers, slots, false, served())))
        .collect();
    for (rank, stand_in) in ranks.iter().enumerate() {
        group.register(rank, stand_in.clone());
    }
    let backend = CpuBackend::new();
    let step = |slot: usize, picks: u64| {
        for (rank, stand_in) in ranks.iter().enumerate() {
            let (_, epoch) = group.begin(rank, &backend).expect("step begins");
            stand_in.serve(slot, picks);
            group.finish(rank, epoch).expect("step finishes");
        }
    };
    for _ in 0..profile {
        step(0, 1000);
    }
    // Four steps of traffic end the first window; two more stage and commit its placement.
    for _ in 0..6 {
        step(1, 10);
    }
    let status = group.eplb_status().expect("EPLB on");
    assert_eq!(status.epoch, PlacementEpoch(1), "{status:?}");
    let first = status.last.expect("a rebalance report");
    // Rank 0 ends the window at its fourth step of traffic, rank 1 having run three.
    let traffic = (4 + 3) * 10 * cfg.n_layers as u64;
    assert_eq!(
        first.measured_picks, traffic,
        "the first window counted more than the traffic: {first:?}"
    );
    // The traffic's busy experts (slot 1 of each rank) got the redundant slots; the
    // profile's (slot 0) did not.
    let planned = ranks[0]
        .placement_of(PlacementEpoch(1))
        .expect("epoch 1 staged");
    for (layer, (before, after)) in placement.layers.iter().zip(&planned.layers).enumerate() {
        let replicas = after.logcnt();
        for rank in 0..2 {
            let busy = before.phy2log[rank * slots + 1].index();
            let profiled = before.phy2log[rank * slots].index();
            assert_eq!(replicas[busy], 2, "layer {layer}: {replicas:?}");
            assert_eq!(replicas[profiled], 1, "layer {layer}: {replicas:?}");
        }
    }
}

/// Two linked groups of one rank each, as two nodes of one deployment (`StepBeacon`s over
/// loopback, session 11): `topology` gives the EPLB and its timeouts; the beacons are returned
/// too (closing one is its node's process ending).
fn two_nodes(
    model: &Arc<Model>,
    topology: &deepinfer_topology::NodeConfig,
) -> (Vec<Arc<DeviceExperts>>, Vec<Arc<StepBeacon>>) {
    let listeners: Vec<std::net::TcpListener> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a port"))
        .collect();
    let addrs: Vec<std::net::SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr().expect("address"))
        .collect();
    let mut groups = Vec::new();
    let mut beacons = Vec::new();
    for (n, listener) in listeners.into_iter().enumerate() {
        let beacon = StepBeacon::start(listener, 11, n as u16, &addrs, Duration::from_secs(5))
            .expect("step counts");
        let placement = starting_placement(topology, model.config()).expect("placement");
        groups.push(DeviceExperts::across_nodes(
            topology,
            1,
            placement,
            beacon.clone(),
        ));
        beacons.push(beacon);
    }
    (groups, beacons)
}

/// One CPU rank of a node stepping through `group`; `opened` runs as its backend opens.
fn one_rank_of(
    model: &Arc<Model>,
    group: &Arc<DeviceExperts>,
    opened: impl Fn() + Send + Sync + 'static,
) -> ModelFactory {
    ModelFactory::per_device(
        model.clone(),
        "one CPU rank of a node",
        RankDevices {
            per_node: 1,
            open: Arc::new(move |_dp, _device| {
                opened();
                Ok(Box::new(CpuBackend::new()) as Box<dyn Backend>)
            }),
            experts: Some(group.clone()),
        },
    )
}

/// Waits until both nodes ran the same steps, neither behind, and agree on their commits.
async fn settle(groups: &[Arc<DeviceExperts>]) -> u64 {
    let (a, b) = (groups[0].lockstep(), groups[1].lockstep());
    let started = Instant::now();
    while a.behind(0) > 0 || b.behind(0) > 0 || a.steps() != b.steps() || a.commits() != b.commits()
    {
        assert!(
            started.elapsed() < CATCH_UP,
            "the nodes do not settle: {} and {} steps, commits {:?} and {:?}",
            a.steps(),
            b.steps(),
            a.commits(),
            b.commits()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    a.steps()
}

/// The epoch of every step index, the same on both nodes' ranks (each index logged once per
/// node, every index from 0 to `steps`).
fn epochs_of_both(groups: &[Arc<DeviceExperts>], steps: u64) -> Vec<u32> {
    let per_node: Vec<Vec<u32>> = groups
        .iter()
        .map(|group| {
            let log = group.step_log();
            let indices: Vec<u64> = log.iter().map(|s| s.index).collect();
            assert_eq!(indices, (0..steps).collect::<Vec<_>>());
            log.iter().map(|s| s.epoch.get()).collect()
        })
        .collect();
    assert_eq!(per_node[0], per_node[1], "a step index on two epochs");
    per_node[0].clone()
}

/// The EPLB topology of the two-node tests: rebalancing every 2 steps over 1, each exchange
/// at most `timeout_ms`.
fn eplb_topology(timeout_ms: u64) -> deepinfer_topology::NodeConfig {
    node(
        2,
        2,
        &format!(
            "enabled = true\nredundant_experts = 2\nwindow_steps = 1\n\
             rebalance_interval_steps = 2\n[cluster]\nexchange_timeout_ms = {timeout_ms}\n\
             bootstrap_timeout_seconds = 10\n"
        ),
    )
}

/// The tokens one rank serves for `prompts`, in prompt order (what the two-node runs compare
/// with).
async fn one_rank_tokens(
    model: &Arc<Model>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    let one = ModelFactory::new(model.clone(), "one rank");
    let (expected, _) = run_engine(
        node(1, 1, ""),
        Arc::new(one),
        facts(model),
        prompts,
        max_tokens,
    )
    .await;
    expected.into_values().collect()
}

/// What one run over two nodes gave: the outputs in prompt order, the groups, the beacons and
/// each node's stand-in rank.
struct TwoNodeRun {
    got: Vec<Vec<u32>>,
    groups: Vec<Arc<DeviceExperts>>,
    _beacons: Vec<Arc<StepBeacon>>,
    stand_ins: Vec<Arc<StandIn>>,
}

/// Runs `prompts` split over two engines as two nodes (the first half on node 0, the rest on
/// node 1), each node's rank a stand-in counting `loads()` (node 1's staging fails when
/// `full`).
async fn serve_on_two_nodes(
    full: bool,
    loads: fn() -> Loads,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> TwoNodeRun {
    let (_dir, model) = model();
    let facts = facts(&model);
    let topology = eplb_topology(5000);
    let placement = starting_placement(&topology, model.config()).expect("placement");
    let (layers, slots) = (placement.layers.len(), placement.slots_per_gpu);
    let (groups, beacons) = two_nodes(&model, &topology);
    let stand_ins: Vec<Arc<StandIn>> = (0..2)
        .map(|n| Arc::new(StandIn::with_loads(layers, slots, full && n == 1, loads())))
        .collect();
    let mut engines = Vec::new();
    for (group, stand_in) in groups.iter().zip(&stand_ins) {
        let (registry, stand_in) = (group.clone(), stand_in.clone());
        let factory = one_rank_of(&model, group, move || {
            registry.register(0, stand_in.clone());
        });
        engines.push(start_engine(node(1, 1, ""), Arc::new(factory), facts).await);
    }
    let half = prompts.len() / 2;
    let (first, second) = tokio::join!(
        run_requests(&engines[0].0, &prompts[..half], max_tokens),
        run_requests(&engines[1].0, &prompts[half..], max_tokens)
    );
    let got = first.into_values().chain(second.into_values()).collect();
    settle(&groups).await;
    for (engine, _, freed) in engines {
        shut_down(engine, &freed, true).await;
    }
    TwoNodeRun {
        got,
        groups,
        _beacons: beacons,
        stand_ins,
    }
}

/// Two engines as two nodes, live EPLB rebalancing every 2 steps under traffic whose busy
/// expert moves at every window: the outputs are those of one rank, every step index runs on
/// one epoch on both nodes, both commit the same epochs at the same steps, and the placement
/// changes at least twice (each commit a placement unlike the one before, the same on both
/// nodes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_eplb_across_two_nodes_commits_the_same_epochs_at_the_same_steps() {
    let (_dir, model) = model();
    let prompts = skewed_prompts(6);
    let max_tokens = 6;
    let expected = one_rank_tokens(&model, &prompts, max_tokens).await;

    let shifting = || Loads::Shifting { windows: 0 };
    let run = serve_on_two_nodes(false, shifting, &prompts, max_tokens).await;
    let groups = &run.groups;
    assert_eq!(run.got, expected, "two nodes with live EPLB vs one rank");
    let steps = groups[0].lockstep().steps();
    let epochs = epochs_of_both(groups, steps);
    assert!(epochs.windows(2).all(|w| w[0] <= w[1]), "{epochs:?}");
    let commits = groups[0].lockstep().commits();
    assert_eq!(commits, groups[1].lockstep().commits());
    assert!(commits.len() >= 3, "fewer than two rebalances: {commits:?}");
    let (lead, follow) = (
        groups[0].eplb_status().expect("EPLB on"),
        groups[1].eplb_status().expect("EPLB on"),
    );
    assert_eq!(lead.epoch, follow.epoch);
    assert_eq!(lead.rebalances, follow.rebalances);
    assert_eq!(lead.rebalances as usize, commits.len() - 1, "{lead:?}");
    assert!(groups.iter().all(|g| g.failure().is_none()));
    // Each committed epoch's placement, the same on both nodes, unlike the one before it.
    let mut placements =
        vec![starting_placement(&eplb_topology(5000), model.config()).expect("placement")];
    for &(step, epoch) in &commits[1..] {
        let on_node = |n: usize| {
            run.stand_ins[n]
                .placement_of(epoch)
                .unwrap_or_else(|| panic!("node {n} never staged {epoch} (committed at {step})"))
        };
        let placement = on_node(0);
        assert_eq!(
            placement,
            on_node(1),
            "the nodes committed different placements"
        );
        assert_ne!(
            placements.last(),
            Some(&placement),
            "{epoch} committed at step {step} changed nothing"
        );
        placements.push(placement);
    }
    println!(
        "live EPLB over two nodes: {steps} steps, commits at {commits:?}, epochs by step \
         {epochs:?}"
    );
}

/// Node 1 cannot stage (out of device memory): every rebalance is aborted on both nodes, every
/// step stays on epoch 0, nothing fails, and the outputs are those of one rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_stage_aborts_the_rebalance_on_both_nodes() {
    let (_dir, model) = model();
    let prompts = skewed_prompts(4);
    let max_tokens = 6;
    let expected = one_rank_tokens(&model, &prompts, max_tokens).await;

    let run = serve_on_two_nodes(true, || Loads::Fixed, &prompts, max_tokens).await;
    assert_eq!(run.got, expected);
    let groups = run.groups;
    let steps = groups[0].lockstep().steps();
    let epochs = epochs_of_both(&groups, steps);
    assert!(epochs.iter().all(|&e| e == 0), "{epochs:?}");
    for group in &groups {
        assert_eq!(group.lockstep().commits(), vec![(0, PlacementEpoch(0))]);
        let status = group.eplb_status().expect("EPLB on");
        assert_eq!((status.epoch, status.rebalances), (PlacementEpoch(0), 0));
        assert!(group.failure().is_none());
    }
    let last = groups[0]
        .eplb_status()
        .and_then(|s| s.last)
        .expect("a rebalance was tried");
    assert!(!last.committed, "{last:?}");
}

/// Node 1's process ends (its beacon closes) while both serve: node 0's next request fails
/// within the timeout, and its group names node 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_disappears_fails_the_other_naming_it() {
    let (_dir, model) = model();
    let facts = facts(&model);
    let topology = eplb_topology(2000);
    let placement = starting_placement(&topology, model.config()).expect("placement");
    let (layers, slots) = (placement.layers.len(), placement.slots_per_gpu);
    let (groups, beacons) = two_nodes(&model, &topology);
    let mut engines = Vec::new();
    for group in &groups {
        let registry = group.clone();
        let factory = one_rank_of(&model, group, move || {
            registry.register(0, Arc::new(StandIn::new(layers, slots, false)));
        });
        engines.push(start_engine(node(1, 1, ""), Arc::new(factory), facts).await);
    }
    let prompts = skewed_prompts(2);
    run_requests(&engines[0].0, &prompts, 4).await;
    settle(&groups).await;
    beacons[1].close();
    let started = Instant::now();
    let stream = engines[0]
        .0
        .generate(GenerateRequest::from_tokens(prompts[0].clone()).max_tokens(4))
        .await;
    let failed = match stream {
        Err(_) => true,
        Ok(stream) => tokio::time::timeout(Duration::from_secs(20), stream.collect())
            .await
            .expect("fails in time, no hang")
            .is_err(),
    };
    assert!(failed, "node 0 served without node 1");
    let failure = groups[0].failure().expect("node 0's group failed");
    assert!(failure.contains("node 1 is lost"), "{failure}");
    println!(
        "node 1 gone: node 0 failed in {:?}: {failure}",
        started.elapsed()
    );
    for (engine, _, _) in engines {
        let _ = engine.shutdown(Duration::from_secs(30)).await;
    }
}

/// Node 1 is up but never answers (a hung host: its address accepts, nothing comes back):
/// node 0's rebalance asks for its counts and its step fails within the exchange timeout,
/// naming node 1.
#[test]
fn a_node_that_never_answers_fails_the_step_within_the_timeout() {
    let cfg = ModelConfig::tiny_v41();
    let topology = eplb_topology(300);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let addrs = [
        listener.local_addr().expect("address"),
        silent.local_addr().expect("address"),
    ];
    let beacon =
        StepBeacon::start(listener, 11, 0, &addrs, Duration::from_secs(5)).expect("step counts");
    let placement = starting_placement(&topology, &cfg).expect("placement");
    let slots = placement.slots_per_gpu;
    let group = DeviceExperts::across_nodes(&topology, 1, placement, beacon);
    group.register(0, Arc::new(StandIn::new(cfg.n_layers, slots, false)));
    let backend = CpuBackend::new();
    let started = Instant::now();
    let error = loop {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no failure: a hang"
        );
        let stepped = group
            .begin(0, &backend)
            .and_then(|(_, epoch)| group.finish(0, epoch));
        if let Err(error) = stepped {
            break error;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let waited = started.elapsed();
    assert!(
        error.contains("node 1 sent no load counts within 300 ms"),
        "{error}"
    );
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    let again = group.begin(0, &backend).expect_err("failed for good");
    assert_eq!(again, error);
    println!("node 1 silent: node 0 failed after {waited:?}: {error}");
}

/// Two engines as two nodes with DSpark on: each node's rank runs the whole profile (a seeding
/// step, then one per batch size) as its own steps at start, which pair up across the nodes
/// (both count the same 7 steps), then both serve the tokens of one rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dspark_profiles_on_both_nodes_in_lockstep() {
    let (_dir, model) = model();
    let facts = facts(&model);
    let prompts = skewed_prompts(4);
    let max_tokens = 5;
    let expected = one_rank_tokens(&model, &prompts, max_tokens).await;

    let topology = dspark_node(1, 1);
    let (groups, _beacons) = two_nodes(&model, &topology);
    let mut engines = Vec::new();
    for group in &groups {
        let factory = one_rank_of(&model, group, || {});
        engines.push(
            Engine::start(EngineConfig {
                node: dspark_node(1, 1),
                executor: Arc::new(factory),
                model: facts,
                tokenizer: None,
            })
            .await
            .expect("engine starts"),
        );
    }
    assert_eq!(settle(&groups).await, 1 + 6, "the profile's steps");
    let half = prompts.len() / 2;
    let (first, second) = tokio::join!(
        run_requests(&engines[0], &prompts[..half], max_tokens),
        run_requests(&engines[1], &prompts[half..], max_tokens)
    );
    let got: Vec<Vec<u32>> = first.into_values().chain(second.into_values()).collect();
    assert_eq!(got, expected, "DSpark on two nodes vs one rank");
    let steps = settle(&groups).await;
    epochs_of_both(&groups, steps);
    for engine in engines {
        engine
            .shutdown(Duration::from_secs(30))
            .await
            .expect("shuts down");
    }
    println!("DSpark over two nodes: both profiled 7 steps, {steps} steps in all");
}
