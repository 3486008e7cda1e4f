//! Topology invariance of expert parallelism, for both families: the same requests on `dp=1,
//! ep=1` (the model's own experts) and on `dp=2, ep=4` (V4.1) or `dp=2, ep=2` (V4: the v4-tiny
//! fixture, hash layers included) — experts sharded over the EP ranks through `LocalComm`, with
//! and without redundant experts, under the start-up and under a skewed placement — give
//! bitwise-identical logits rows and tokens.

mod ep_support;

use std::sync::Arc;

use deepinfer_actors::comm::{Comm, LocalComm, StepExperts};
use deepinfer_actors::experts::factory::ExpertParallelFactory;
use deepinfer_actors::experts::parallel::{EpSettings, EplbSchedule, ExpertParallel};
use deepinfer_actors::experts::shard::ExpertShard;
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_model::any_model::{AnyModel, AnyStepEntry, StepOptions};
use deepinfer_model::expert_dispatch::RoutedExperts;
use deepinfer_model::{EntryOutput, LogitsWanted};
use deepinfer_topology::{DpRank, EpRank, EplbPolicy, PlacementEpoch, rebalance_experts};
use ep_support::{bits, facts, facts_of, model, node, run_engine, v4_four_of_eight, v4_tiny};

fn settings(ep_ranks: usize, redundant_experts: usize) -> EpSettings {
    EpSettings {
        ep_ranks,
        redundant_experts,
        num_groups: 1,
        num_nodes: 1,
        eplb: EplbSchedule {
            enabled: false,
            window_steps: 1,
            interval_steps: 1,
        },
    }
}

/// Every logits row of `chunks` fed in turn to a fresh sequence of `model`, the routed experts
/// run through `comm` (`None`: the model's own experts). With a `comm`, checks that every step's
/// picks were served by its epoch, and returns the picks its shards served.
fn chunk_logits(
    model: &AnyModel,
    chunks: &[&[u32]],
    comm: Option<&LocalComm>,
) -> (Vec<Vec<f32>>, u64) {
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    for chunk in chunks {
        let step = comm.map(|comm| StepExperts::new(comm, DpRank(0), 0));
        let options = StepOptions {
            experts: step.as_ref().map(|s| s as &dyn RoutedExperts),
            ..StepOptions::default()
        };
        let entry = AnyStepEntry::new(&mut seq, chunk, LogitsWanted::All);
        let got = model
            .forward_step(&mut [entry], options)
            .and_then(EntryOutput::one_entry_logits)
            .expect("forward");
        if let (Some(step), Some(comm)) = (&step, comm) {
            assert_eq!(step.epochs_seen(), Some((comm.epoch(), comm.epoch())));
        }
        rows.push(got);
    }
    let served = comm.map_or(0, |comm| {
        let per_rank: Vec<u64> = comm
            .shards()
            .iter()
            .map(|shard| shard.take_loads().iter().flatten().sum())
            .collect();
        // Every EP rank served picks: the experts really were spread.
        assert!(
            per_rank.iter().all(|&n| n > 0),
            "picks per EP rank {per_rank:?}"
        );
        per_rank.iter().sum()
    });
    (rows, served)
}

/// Model-level, either family: `forward_step` with `StepOptions::experts` over a `LocalComm` of
/// `ep_settings` equals it without bit for bit, for a prefill in chunks then decode steps, under
/// the start-up placement and under a skewed one (solved as `policy`); every routed pick of
/// every backbone layer (a V4 hash layer's included) goes through the shards.
fn assert_local_comm_equals_the_model(
    model: &AnyModel,
    ep_settings: EpSettings,
    policy: EplbPolicy,
) {
    let cfg = model.config().clone();
    let prompt: Vec<u32> = vec![5, 9, 300, 41, 41, 7, 7, 7, 200, 13, 2, 99];
    let chunks: &[&[u32]] = &[
        &prompt[..5],
        &prompt[5..11],
        &prompt[11..],
        &[17],
        &[400],
        &[3],
    ];
    let tokens: usize = chunks.iter().map(|c| c.len()).sum();
    let (expected, _) = chunk_logits(model, chunks, None);

    let parallel = ExpertParallel::new(model.clone(), ep_settings).expect("ep state");
    let uniform = parallel.current();
    // A skewed placement (one hot expert per layer) as epoch 1, built like a rebalance does.
    let loads: Vec<Vec<f64>> = (0..cfg.n_layers)
        .map(|l| {
            (0..cfg.n_routed_experts)
                .map(|e| if e == l % 8 { 100.0 } else { 1.0 + e as f64 })
                .collect()
        })
        .collect();
    let placement = Arc::new(rebalance_experts(&loads, parallel.shape()).expect("solved"));
    assert_eq!(placement.policy, policy);
    assert_ne!(*placement, **uniform.placement());
    let shards = (0..ep_settings.ep_ranks)
        .map(|r| {
            let previous = &uniform.shards()[r];
            ExpertShard::build(
                &model.clone().into(),
                &placement,
                EpRank(r as u16),
                PlacementEpoch(1),
                Some(previous),
            )
            .map(|(s, _)| Arc::new(s))
        })
        .collect::<Result<Vec<_>, _>>()
        .expect("shards");
    let skewed = LocalComm::new(PlacementEpoch(1), model.clone(), placement, shards).expect("comm");

    for comm in [uniform.as_ref(), &skewed] {
        let (got, served) = chunk_logits(model, chunks, Some(comm));
        for (step, (got, want)) in got.iter().zip(&expected).enumerate() {
            let differs = bits(got).iter().zip(bits(want)).position(|(a, b)| *a != b);
            assert!(
                got.len() == want.len() && differs.is_none(),
                "{policy:?} {} step {step}: {} of {} logits, first difference at {differs:?}",
                comm.epoch(),
                got.len(),
                want.len()
            );
        }
        assert_eq!(
            served as usize,
            tokens * cfg.n_layers * cfg.n_activated_experts,
            "every routed pick of every backbone layer goes through the shards"
        );
    }
}

/// V4.1 on 4 EP ranks (4 redundant slots), with the global policy and with the hierarchical
/// one (2 nodes, 2 expert groups).
#[test]
fn local_comm_logits_equal_the_model_bitwise() {
    let (_dir, model) = model();
    let hierarchical = EpSettings {
        num_groups: 2,
        num_nodes: 2,
        ..settings(4, 4)
    };
    // One group over two nodes does not divide: DeepSeek's global policy.
    let global = EpSettings {
        num_nodes: 2,
        ..settings(4, 4)
    };
    let model = AnyModel::from(model);
    assert_local_comm_equals_the_model(&model, global, EplbPolicy::Global);
    assert_local_comm_equals_the_model(&model, hierarchical, EplbPolicy::Hierarchical);
}

/// The V4 family on 2 EP ranks, with and without 2 redundant slots: the v4-tiny fixture (its
/// hash layers' picks come from `tid2eid`, handed to the shards like the router's) and a random
/// tiny V4 with 4 of 8 experts active (so a combine in another order than increasing expert id
/// would change bits).
#[test]
fn v4_local_comm_logits_equal_the_model_bitwise() {
    let (_dir, four) = v4_four_of_eight();
    for model in [AnyModel::from(v4_tiny()), AnyModel::from(four)] {
        let k = model.config().n_activated_experts;
        for redundant in [0, 2] {
            println!("V4 with {k} active experts, 2 EP ranks, {redundant} redundant slots");
            // One group on one node: DeepSeek's hierarchical policy.
            let policy = EplbPolicy::Hierarchical;
            assert_local_comm_equals_the_model(&model, settings(2, redundant), policy);
        }
    }
}

/// Engine-level: dp=1/ep=1 against dp=2/ep=4 (no redundancy) and dp=2/ep=4 with 4 redundant
/// experts: every logits row both runs computed for a (request, position) is bitwise equal, and
/// so are the generated tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp2_ep4_logits_equal_dp1_ep1_bitwise() {
    let (_dir, model) = model();
    let facts = facts(&model);
    let prompts: Vec<Vec<u32>> = vec![
        (10..27).collect(),
        vec![7, 8, 9],
        vec![300, 1, 44, 44, 44, 500, 2],
        (100..111).rev().collect(),
    ];
    let reference = ModelFactory::new(model.clone(), "plain");
    let (ref_tokens, ref_rows) =
        run_engine(node(1, 1, ""), Arc::new(reference), facts, &prompts, 5).await;
    assert_eq!(ref_tokens.len(), prompts.len());

    for redundant in [0u16, 4] {
        let topology = node(2, 4, &format!("redundant_experts = {redundant}"));
        let factory = ExpertParallelFactory::new(model.clone(), &topology, "ep test".into())
            .expect("ep factory");
        let (tokens, rows) = run_engine(topology, Arc::new(factory), facts, &prompts, 5).await;
        assert_eq!(
            tokens, ref_tokens,
            "tokens with {redundant} redundant experts"
        );
        let mut compared = 0;
        for (key, row) in &rows {
            if let Some(reference) = ref_rows.get(key) {
                assert_eq!(
                    bits(row),
                    bits(reference),
                    "row {key:?}, redundant {redundant}"
                );
                compared += 1;
            }
        }
        // At least every decode row of every request (the prefill chunking may differ).
        let decode_rows: usize = ref_tokens.values().map(|t| t.len().saturating_sub(1)).sum();
        assert!(
            compared >= decode_rows + prompts.len(),
            "compared {compared} rows, redundant {redundant}"
        );
    }
}

/// Engine-level, V4 family: the v4-tiny fixture (and a random tiny V4 with 4 of 8 experts active,
/// where the combine order shows) on dp=1/ep=1 against dp=2/ep=2 (with and without 2 redundant
/// experts): every logits row both runs computed for a (request, position) is bitwise equal, and
/// so are the generated tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v4_tiny_dp2_ep2_logits_equal_dp1_ep1_bitwise() {
    let (_dir, four) = v4_four_of_eight();
    let prompts: Vec<Vec<u32>> = vec![
        (10..27).collect(),
        vec![7, 8, 9],
        vec![300, 1, 44, 44, 44, 500, 2],
        (100..111).rev().collect(),
    ];
    for (name, model) in [("v4-tiny", v4_tiny()), ("V4 with 4 of 8 active", four)] {
        let facts = facts_of(model.config());
        let reference = ModelFactory::new(model.clone(), "plain");
        let (ref_tokens, ref_rows) =
            run_engine(node(1, 1, ""), Arc::new(reference), facts, &prompts, 5).await;
        assert_eq!(ref_tokens.len(), prompts.len());

        for redundant in [0u16, 2] {
            let topology = node(2, 2, &format!("redundant_experts = {redundant}"));
            let factory = ExpertParallelFactory::new(model.clone(), &topology, "v4 ep test".into())
                .expect("ep factory");
            let (tokens, rows) = run_engine(topology, Arc::new(factory), facts, &prompts, 5).await;
            assert_eq!(
                tokens, ref_tokens,
                "{name}: tokens, {redundant} redundant experts"
            );
            let mut compared = 0;
            for (key, row) in &rows {
                if let Some(reference) = ref_rows.get(key) {
                    let same = bits(row) == bits(reference);
                    assert!(same, "{name}: row {key:?}, redundant {redundant}");
                    compared += 1;
                }
            }
            // At least every decode row of every request (the prefill chunking may differ).
            let decode_rows: usize = ref_tokens.values().map(|t| t.len().saturating_sub(1)).sum();
            assert!(
                compared >= decode_rows + prompts.len(),
                "{name}: compared {compared} rows, redundant {redundant}"
            );
            println!("{name} dp=ep=2, {redundant} redundant: {compared} logits rows bitwise equal");
        }
    }
}
