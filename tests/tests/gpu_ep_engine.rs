//! The engine with expert parallelism on CUDA (`deepinfer_actors::experts::device`), laid out
//! from a topology as `deepinfer-node` does (`model_source::resolve`, or `on_node` for the
//! fixtures loaded as `resolve` would hand them over): `parallel.dp = parallel.ep = 2` on one GPU
//! (`device.gpus_per_node = 1`), each rank's backend its EP rank holding half of every layer's
//! experts, rows moved between the ranks by device copies, the ranks in `Lockstep` (one rank is
//! often idle and follows the other's steps).
//!
//! Models: the v41-tiny fixture and the demo model (V4.1: FP4/FP8 experts, `moe_rows`), and the
//! v4-tiny fixture (the V4 family: exact fp32 experts through `moe_rows_exact`, its first three
//! layers hash-routed by token id).
//!
//! - `two_ep_ranks_on_one_gpu_serve_what_one_rank_serves`: each model, in the `exact` and `fast`
//!   numerics: the workload of the CPU EP tests (`ep_support`: skewed prompts, all in flight at
//!   once, then a lone request) gives the tokens and every logits row of `dp = ep = 1` on CUDA,
//!   bitwise.
//! - `live_eplb_under_traffic_changes_no_output`: the same with `[eplb] enabled` (2 redundant
//!   slots, a rebalance every 4 steps over a 3-step window): placements committed under traffic
//!   (at least one), no request lost or changed (tokens and rows bitwise those of one rank), both
//!   ranks ran every step index on the same epoch, epochs never going back.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! The V4.1 models passed on the H200 (2026-12-05); the v4-tiny cases were written without a
//! GPU and have not run yet.
#![cfg(feature = "cuda")]

mod ep_support;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use deepinfer_actors::experts::device::DeviceExperts;
use deepinfer_actors::gpu;
use deepinfer_actors::model_source::{self, MODEL_DIR_ENV, ResolvedModel, resolve};
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_model::any_model::AnyModel;
use deepinfer_topology::{NodeConfig, PlacementEpoch, RequestId};
use ep_support::{bits, facts_of, run_engine, skewed_prompts, v4_tiny};

mod gpu_support;
use gpu_support::host_fixture_model;

/// What the ranks serve.
#[derive(Clone, Copy)]
enum Source {
    /// The v41-tiny fixture.
    Fixture,
    /// The built-in demo model (`[model] source = "demo"`).
    Demo,
    /// The v4-tiny fixture (the V4 family's exact experts).
    V4Tiny,
}

/// A CUDA topology of `ranks` DP = EP ranks on one GPU, `extra` sections appended.
fn topology(ranks: u16, numerics: &str, extra: &str) -> NodeConfig {
    NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\narch = \"sm90\"\n\
             gpus_per_node = 1\nnumerics = \"{numerics}\"\n[parallel]\ndp = {ranks}\nep = {ranks}\n\
             [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 5\n\
             overlap_depth = 2\nadmission_queue_capacity = 32\n{extra}"
        ),
        &format!("gpu ep engine ({ranks} ranks, {numerics})"),
    )
    .expect("topology")
}

/// `model` (a fixture, named `name`) as `resolve` would hand it over, laid out on `node` by
/// `model_source::on_node`.
fn loaded_on(node: &NodeConfig, model: AnyModel, name: &str) -> ResolvedModel {
    let loaded = ResolvedModel {
        factory: Arc::new(ModelFactory::new(model.clone(), name)),
        facts: facts_of(model.config()),
        model,
        tokenizer: PathBuf::from(model_source::SHIPPED_TOKENIZER),
        notice: None,
        name: name.to_string(),
    };
    model_source::on_node(node, loaded)
        .unwrap_or_else(|e| panic!("{name} on the topology's devices: {e}"))
}

/// The v41-tiny fixture with its stub Engram vocabulary.
fn v41_tiny() -> AnyModel {
    let (model, _) = host_fixture_model(&deepinfer_tests::fixture_dir("v41/v41-tiny"));
    AnyModel::V41(Arc::new(model))
}

type Served = (
    BTreeMap<RequestId, Vec<u32>>,
    HashMap<(RequestId, usize), Vec<f32>>,
);

/// `prompts` (then the first one alone, leaving a rank idle) served on `node`; the ranks'
/// `DeviceExperts` group, when they have one.
async fn serve(
    source: Source,
    node: NodeConfig,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Served, Option<Arc<DeviceExperts>>) {
    let origin = node.origin.clone();
    let resolved = tokio::task::spawn_blocking(move || {
        let resolved = match source {
            Source::Fixture => Ok(loaded_on(&node, v41_tiny(), "v41-tiny")),
            Source::Demo => resolve(&node),
            Source::V4Tiny => Ok(loaded_on(&node, AnyModel::V4(v4_tiny()), "v4-tiny")),
        };
        resolved.map(|r| (r, node))
    })
    .await
    .expect("resolving thread");
    let (resolved, node) = resolved.unwrap_or_else(|e| panic!("{origin}: {e}"));
    println!("{origin}: {}", resolved.factory.describe());
    let group = resolved.factory.device_experts();
    let mut all = prompts.to_vec();
    all.push(prompts[0].clone());
    let served = run_engine(node, resolved.factory, resolved.facts, &all, max_tokens).await;
    (served, group)
}

/// Fails unless a GPU is usable and no model override is set.
fn require_gpu() {
    let gpus = gpu::inventory();
    assert!(
        gpus.count > 0,
        "no usable GPU ({}); GPU tests run on the H200 via tests/gpu-suite.sh",
        gpus.unavailable.unwrap_or_default()
    );
    assert!(
        std::env::var_os(MODEL_DIR_ENV).is_none(),
        "unset {MODEL_DIR_ENV}: it overrides the models this test resolves"
    );
}

/// `got` is `expected`: the same tokens for every request, every row bitwise; returns the
/// logits compared.
fn check_same(what: &str, got: &Served, expected: &Served, requests: usize) -> usize {
    let ((got, rows), (expected, expected_rows)) = (got, expected);
    assert_eq!(got.len(), requests, "{what}: requests served");
    assert_eq!(got, expected, "{what}: tokens");
    let mut compared = 0;
    for (key, reference) in expected_rows {
        let live = rows
            .get(key)
            .unwrap_or_else(|| panic!("{what}: row {key:?} missing"));
        assert_eq!(bits(live), bits(reference), "{what}: row {key:?}");
        compared += live.len();
    }
    assert_eq!(rows.len(), expected_rows.len(), "{what}: rows");
    compared
}

const SOURCES: [(Source, &str); 3] = [
    (Source::Fixture, "v41-tiny"),
    (Source::Demo, "demo"),
    (Source::V4Tiny, "v4-tiny"),
];

fn workload() -> Vec<Vec<u32>> {
    let mut prompts = skewed_prompts(6);
    prompts.extend([(10..24).collect(), vec![300, 1, 44, 500, 2]]);
    prompts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ep_ranks_on_one_gpu_serve_what_one_rank_serves() {
    require_gpu();
    let prompts = workload();
    let max_tokens = 6;
    for (source, name) in SOURCES {
        for numerics in ["exact", "fast"] {
            let (expected, _) =
                serve(source, topology(1, numerics, ""), &prompts, max_tokens).await;
            let (got, group) = serve(source, topology(2, numerics, ""), &prompts, max_tokens).await;
            let what = format!("{name} ({numerics})");
            assert!(group.is_some(), "{what}: the ranks are EP ranks");
            let compared = check_same(&what, &got, &expected, prompts.len() + 1);
            println!(
                "gpu_ep_engine {what}: 2 EP ranks on one GPU, {} requests, {compared} logits \
                 bitwise equal to one rank",
                prompts.len() + 1
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_eplb_under_traffic_changes_no_output() {
    require_gpu();
    let prompts = workload();
    let max_tokens = 8;
    let eplb = "[eplb]\nenabled = true\nredundant_experts = 2\nwindow_steps = 3\n\
                rebalance_interval_steps = 4\n";
    for (source, name) in SOURCES {
        for numerics in ["exact", "fast"] {
            let (expected, _) =
                serve(source, topology(1, numerics, ""), &prompts, max_tokens).await;
            let (got, group) =
                serve(source, topology(2, numerics, eplb), &prompts, max_tokens).await;
            let what = format!("{name} ({numerics}, live EPLB)");
            let compared = check_same(&what, &got, &expected, prompts.len() + 1);
            let group = group.expect("the ranks are EP ranks");
            let status = group.eplb_status().expect("EPLB on");
            assert!(status.rebalances >= 1, "{what}: {status:?}");
            // Every step index ran on one epoch on both ranks; epochs never go back.
            let log = group.step_log();
            let mut epoch_of: BTreeMap<u64, PlacementEpoch> = BTreeMap::new();
            for step in &log {
                let first = *epoch_of.entry(step.index).or_insert(step.epoch);
                assert_eq!(
                    first, step.epoch,
                    "{what}: step {} on two epochs",
                    step.index
                );
            }
            let per_rank = |rank: usize| log.iter().filter(|s| s.dp == rank).count();
            assert_eq!(per_rank(0), per_rank(1), "{what}: steps per rank");
            let epochs: Vec<PlacementEpoch> = epoch_of.values().copied().collect();
            assert!(
                epochs.windows(2).all(|w| w[0] <= w[1]),
                "{what}: {epochs:?}"
            );
            assert!(
                epochs.last() > epochs.first(),
                "{what}: a placement was committed under traffic: {status:?}"
            );
            println!(
                "gpu_ep_engine {what}: {} steps per rank, {} rebalances (now {}), {compared} \
                 logits bitwise equal to one rank",
                per_rank(0),
                status.rebalances,
                status.epoch
            );
        }
    }
}
