//! DP ranks in `Lockstep` (how expert parallelism on CUDA steps, `experts::device`), on CPU
//! backends so that CI runs the engine side of it: two ranks, often one busy and one idle, serve
//! the requests with the tokens and logits rows of one rank, bitwise, and once the traffic is
//! done no rank is behind: the idle rank followed every step its peer began (on CUDA each such
//! step is every MoE layer's collective, which the busy rank cannot finish alone).

mod ep_support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deepinfer_actors::experts::device::{DeviceExperts, starting_placement};
use deepinfer_actors::rank::factory::{ModelFactory, RankDevices};
use deepinfer_actors::rank::observe::{ObservedFactory, RowLog};
use deepinfer_actors::{Engine, EngineConfig};
use deepinfer_model::backend::{Backend, CpuBackend};
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::PlacementEpoch;
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
