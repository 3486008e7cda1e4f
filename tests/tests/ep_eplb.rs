//! Live EPLB on the engine: under skewed routing a rebalance lowers the load imbalance measured
//! on the EP ranks, and placements swapped by epoch under traffic lose and change nothing (every
//! request finishes with the tokens of a run without rebalancing, every sampled logits row
//! bitwise equal to that run's) while no step mixes epochs — for a V4.1 model on 4 EP ranks and
//! for the V4 family's v4-tiny fixture on 2.

mod ep_support;

use std::collections::BTreeSet;
use std::sync::Arc;

use deepinfer_actors::experts::factory::ExpertParallelFactory;
use deepinfer_actors::messages::eplb::{EplbStatus, RebalanceReport};
use deepinfer_actors::rank::executor::ExecutorFactory;
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::rank::observe::{ObservedFactory, RowLog};
use deepinfer_actors::{Engine, EngineConfig};
use deepinfer_model::any_model::AnyModel;
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::PlacementEpoch;
use ep_support::{
    bits, facts, facts_of, model, node, run_engine, run_requests, shut_down, skewed_prompts,
    v4_tiny,
};

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

async fn rebalance_now(factory: &ExpertParallelFactory) -> RebalanceReport {
    factory
        .parallel
        .rebalance_now()
        .await
        .expect("rebalance succeeds")
}

async fn status(factory: &ExpertParallelFactory) -> EplbStatus {
    factory.parallel.eplb_status().await.expect("EPLB status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_lowers_the_measured_imbalance_under_skewed_routing() {
    let (_dir, model) = model();
    let topology = node(2, 4, "redundant_experts = 4");
    let factory = ExpertParallelFactory::new(model.clone(), &topology, "eplb test".into())
        .expect("ep factory");
    let (executor, freed) = FreedLengths::track(Arc::new(factory.clone()));
    let config = EngineConfig {
        node: topology,
        executor,
        model: facts(&model),
        tokenizer: None,
    };
    let engine = Engine::start(config).await.expect("engine starts");
    let prompts = skewed_prompts(6);

    run_requests(&engine, &prompts, 3).await;
    let first = rebalance_now(&factory).await;
    assert_eq!(first.measured_epoch, PlacementEpoch(0));
    assert!(first.measured_picks > 0);
    assert!(first.committed, "skewed load moves experts: {first:?}");
    assert_eq!(first.epoch, PlacementEpoch(1));
    assert!(first.copied_experts > 0);
    assert!(mean(&first.planned_imbalance) < mean(&first.measured_imbalance));

    // The same traffic again, now on the new placement.
    run_requests(&engine, &prompts, 3).await;
    let second = rebalance_now(&factory).await;
    assert_eq!(second.measured_epoch, PlacementEpoch(1));
    let (before, after) = (
        mean(&first.measured_imbalance),
        mean(&second.measured_imbalance),
    );
    println!(
        "mean measured imbalance (busiest EP rank / mean): before {before:.3}, after {after:.3}"
    );
    assert!(before > 1.2, "the routing is skewed: {before}");
    assert!(after < before, "imbalance {before} -> {after}");
    let st = status(&factory).await;
    assert!(st.rebalances >= 1);
    freed.shutdown_and_check_replay(engine).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epoch_swaps_under_traffic_lose_and_change_nothing() {
    let (_dir, model) = model();
    epoch_swaps_lose_and_change_nothing(AnyModel::from(model), 4, 4).await;
}

/// The V4 family: the v4-tiny fixture (hash-routed first layers) on dp = ep = 2 with 2 redundant
/// slots, rebalanced under traffic as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v4_tiny_epoch_swaps_under_traffic_lose_and_change_nothing() {
    epoch_swaps_lose_and_change_nothing(AnyModel::from(v4_tiny()), 2, 2).await;
}

/// `model` on dp = 2 over `ep` EP ranks with `redundant` redundant slots, rebalancing every 3
/// engine steps over a 2-step window while skewed and plain requests run, against dp = ep = 1:
/// every request finishes with the same tokens, every sampled logits row bitwise equal; at least
/// one placement was committed under traffic and no step mixed epochs.
async fn epoch_swaps_lose_and_change_nothing(model: AnyModel, ep: u16, redundant: u16) {
    let facts = facts_of(model.config());
    let mut prompts = skewed_prompts(6);
    prompts.extend([
        (10..24).collect(),
        vec![300, 1, 44, 500, 2],
        (60..69).rev().collect(),
    ]);
    let max_tokens = 6;

    let reference = ModelFactory::new(model.clone(), "plain");
    let (expected, expected_rows) = run_engine(
        node(1, 1, ""),
        Arc::new(reference),
        facts,
        &prompts,
        max_tokens,
    )
    .await;

    // Rebalance every 3 engine steps over a 2-step window, while the requests run.
    let topology = node(
        2,
        ep,
        &format!(
            "enabled = true\nredundant_experts = {redundant}\nwindow_steps = 2\n\
             rebalance_interval_steps = 3"
        ),
    );
    let factory = ExpertParallelFactory::new(model.clone(), &topology, "eplb test".into())
        .expect("ep factory");
    let replays = factory.sliding_window().is_some();
    let rows = Arc::new(RowLog::new());
    let (executor, freed) = FreedLengths::track(Arc::new(ObservedFactory::new(
        Arc::new(factory.clone()),
        rows.clone(),
    )));
    let config = EngineConfig {
        node: topology,
        executor,
        model: facts,
        tokenizer: None,
    };
    let engine = Engine::start(config).await.expect("engine starts");
    let got = run_requests(&engine, &prompts, max_tokens).await;
    let st = status(&factory).await;
    shut_down(engine, &freed, replays).await;

    // Zero lost or changed requests, and every row a token was sampled from bitwise the
    // reference's (request ids are given in submission order by both engines).
    assert_eq!(got.len(), prompts.len());
    assert_eq!(got, expected);
    let rows = rows.snapshot();
    let mut compared = 0;
    for ((id, tokens), prompt) in got.iter().zip(&prompts) {
        for position in prompt.len() - 1..prompt.len() - 1 + tokens.len() {
            let key = (*id, position);
            let (live, reference) = (rows.get(&key), expected_rows.get(&key));
            let (Some(live), Some(reference)) = (live, reference) else {
                panic!("request {id:?} position {position}: a sampled row is missing");
            };
            assert_eq!(
                bits(live),
                bits(reference),
                "request {id:?} position {position}: logits under live EPLB swaps"
            );
            compared += 1;
        }
    }
    println!("{compared} sampled logits rows bitwise equal to the run without rebalancing");

    // Placements really changed under traffic, and no step mixed epochs.
    assert!(st.rebalances >= 1, "{st:?}");
    let log = factory.parallel.step_log();
    let mut epochs_used = BTreeSet::new();
    let mut last_epoch_of_rank = [PlacementEpoch(0); 2];
    for record in &log {
        if let Some((lowest, highest)) = record.served {
            assert_eq!(
                (lowest, highest),
                (record.epoch, record.epoch),
                "{record:?}"
            );
            epochs_used.insert(record.epoch);
        }
        // A rank never goes back to an older placement.
        let last = &mut last_epoch_of_rank[record.dp.index()];
        assert!(record.epoch >= *last, "{record:?} after {last}");
        *last = record.epoch;
    }
    println!(
        "{} rank steps, {} rebalances, epochs that served tokens: {epochs_used:?}",
        log.len(),
        st.rebalances
    );
    assert!(
        epochs_used.len() >= 2,
        "steps ran on several epochs: {epochs_used:?}"
    );
}
