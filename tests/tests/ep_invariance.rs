//! Topology invariance of expert parallelism: the same requests on `dp=1, ep=1` (the model's own
//! experts) and on `dp=2, ep=4` (experts sharded over 4 EP ranks through `LocalComm`, with and
//! without redundant experts, under the start-up and under a skewed placement) give
//! bitwise-identical logits rows and tokens.

mod ep_support;

use std::sync::Arc;

use deepinfer_actors::comm::{Comm, LocalComm, StepExperts};
use deepinfer_actors::experts::factory::ExpertParallelFactory;
use deepinfer_actors::experts::parallel::{EpSettings, EplbSchedule, ExpertParallel};
use deepinfer_actors::experts::shard::ExpertShard;
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_model::LogitsWanted;
use deepinfer_model::{EntryOutput, StepEntry, StepOptions};
use deepinfer_tests::forward_one;
use deepinfer_topology::{EpRank, EplbPolicy, PlacementEpoch, rebalance_experts};
use ep_support::{bits, facts, model, node, run_engine};

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

/// Model-level: `forward_step` with `StepOptions::experts` over a `LocalComm` equals it without bit for bit, for a
/// prefill in chunks then decode steps, under the start-up and under a skewed placement, with the
/// global policy and with the hierarchical one (2 nodes, 2 expert groups).
#[test]
fn local_comm_logits_equal_the_model_bitwise() {
    let (_dir, model) = model();
    let cfg = model.config();
    let prompt: Vec<u32> = vec![5, 9, 300, 41, 41, 7, 7, 7, 200, 13, 2, 99];
    let chunks: &[&[u32]] = &[
        &prompt[..5],
        &prompt[5..11],
        &prompt[11..],
        &[17],
        &[400],
        &[3],
    ];
    let mut plain = model.new_sequence();
    let mut expected = Vec::new();
    for chunk in chunks {
        expected.push(forward_one(&model, &mut plain, chunk, LogitsWanted::All).expect("forward"));
    }

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
    for (ep_settings, policy) in [
        (global, EplbPolicy::Global),
        (hierarchical, EplbPolicy::Hierarchical),
    ] {
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
        let shards = (0..4)
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
        let skewed =
            LocalComm::new(PlacementEpoch(1), model.clone(), placement, shards).expect("comm");

        for comm in [uniform.as_ref(), &skewed] {
            let mut seq = model.new_sequence();
            for (chunk, want) in chunks.iter().zip(&expected) {
                let step = StepExperts::new(comm, deepinfer_topology::DpRank(0), 0);
                let got = model
                    .forward_step(
                        &mut [StepEntry::new(&mut seq, chunk, LogitsWanted::All)],
                        StepOptions {
                            experts: Some(&step),
                            ..StepOptions::default()
                        },
                    )
                    .and_then(EntryOutput::one_entry_logits)
                    .expect("forward with experts");
                assert_eq!(bits(&got), bits(want), "{policy:?} {}", comm.epoch());
                assert_eq!(step.epochs_seen(), Some((comm.epoch(), comm.epoch())));
            }
            // Every EP rank served picks: the experts really were spread.
            for shard in comm.shards() {
                let served: u64 = shard.take_loads().iter().flatten().sum();
                assert!(served > 0, "{policy:?}: {} served nothing", shard.rank());
            }
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
