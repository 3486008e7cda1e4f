//! DP ranks in `Lockstep` (how expert parallelism on CUDA steps, `experts::device`), on CPU
//! backends so that CI runs the engine side of it:
//! - two ranks, often one busy and one idle, serve the requests with the tokens and logits rows
//!   of one rank, bitwise, and once the traffic is done no rank is behind: the idle rank
//!   followed every step its peer began (on CUDA each such step is every MoE layer's
//!   collective, which the busy rank cannot finish alone);
//! - with live EPLB over stand-in device ranks (skewed load counts; staging and adoption
//!   recorded, the CPU backends computing every expert), placements are staged and adopted by
//!   the rank threads under traffic: both ranks run every step index on the same epoch, the
//!   epochs advance, and the outputs stay those of one rank.

mod ep_support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deepinfer_actors::experts::device::{DeviceExperts, DeviceRank, starting_placement};
use deepinfer_actors::messages::experts::ShardLoads;
use deepinfer_actors::rank::factory::{ModelFactory, RankDevices};
use deepinfer_actors::rank::observe::{ObservedFactory, RowLog};
use deepinfer_actors::{Engine, EngineConfig};
use deepinfer_model::backend::{Backend, CpuBackend};
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::{ExpertPlacement, PlacementEpoch};
use ep_support::{bits, facts, model, node, run_engine, run_requests, skewed_prompts};

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
    let two = ModelFactory::per_device(
        model.clone(),
        "two ranks in lockstep",
        RankDevices {
            per_node: 1,
            open: Arc::new(|_dp, _device| Ok(Box::new(CpuBackend::new()) as Box<dyn Backend>)),
            experts: Some(group.clone()),
        },
    );
    let rows = Arc::new(RowLog::new());
    let (executor, freed) =
        FreedLengths::track(Arc::new(ObservedFactory::new(Arc::new(two), rows.clone())));
    let config = EngineConfig {
        node: topology,
        executor,
        model: facts,
        tokenizer: None,
    };
    let engine = Engine::start(config).await.expect("engine starts");
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

/// Stands in for a CUDA EP rank: skewed load counts, staging and adoption recorded.
struct StandIn {
    layers: usize,
    slots: usize,
    /// `(epoch in use, staged epoch)`.
    state: Mutex<(PlacementEpoch, Option<PlacementEpoch>)>,
}

impl DeviceRank for StandIn {
    fn epoch(&self) -> PlacementEpoch {
        self.state.lock().expect("not poisoned").0
    }
    fn take_loads(&self) -> ShardLoads {
        let mut per_slot = vec![vec![1; self.slots]; self.layers];
        for layer in &mut per_slot {
            layer[0] = 50;
        }
        ShardLoads {
            epoch: self.epoch(),
            per_slot,
        }
    }
    fn stage(
        &self,
        _backend: &dyn Backend,
        _placement: Arc<ExpertPlacement>,
        epoch: PlacementEpoch,
    ) -> Result<usize, String> {
        self.state.lock().expect("not poisoned").1 = Some(epoch);
        Ok(1)
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
    let two = ModelFactory::per_device(
        model.clone(),
        "two ranks with stand-in device experts",
        RankDevices {
            per_node: 1,
            open: Arc::new(move |dp, _device| {
                let stand_in = StandIn {
                    layers,
                    slots,
                    state: Mutex::new((PlacementEpoch(0), None)),
                };
                registry.register(dp, Arc::new(stand_in));
                Ok(Box::new(CpuBackend::new()) as Box<dyn Backend>)
            }),
            experts: Some(group.clone()),
        },
    );
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
