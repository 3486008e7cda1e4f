//! Shared by the GPU test binaries of the engine with expert parallelism on CUDA
//! (`gpu_ep_engine.rs`: ranks on one GPU; `gpu_two.rs`: one rank per GPU over two): a CUDA
//! topology, the models the ranks serve laid out on it as `deepinfer-node` does
//! (`model_source::resolve`, or `on_node` for the fixtures loaded as `resolve` would hand them
//! over), the workload (`ep_support`'s skewed prompts, then a lone request leaving a rank
//! idle), and the checks: bitwise equal outputs, and a live EPLB's step log.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use deepinfer_actors::experts::device::DeviceExperts;
use deepinfer_actors::model_source::{self, ResolvedModel, resolve};
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_model::any_model::AnyModel;
use deepinfer_topology::{NodeConfig, PlacementEpoch, RequestId};

use crate::ep_support::{bits, facts_of, run_engine, skewed_prompts, v4_tiny};
use crate::gpu_support::host_fixture_model;

/// What the ranks serve.
#[derive(Clone, Copy)]
pub enum Source {
    /// The v41-tiny fixture.
    Fixture,
    /// The built-in demo model (`[model] source = "demo"`).
    Demo,
    /// The v4-tiny fixture (the V4 family's exact experts).
    V4Tiny,
}

/// A CUDA topology of `ranks` DP = EP ranks on `gpus` GPUs of one node, `extra` sections
/// appended.
pub fn topology(ranks: u16, gpus: u16, numerics: &str, extra: &str) -> NodeConfig {
    NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\narch = \"sm90\"\n\
             gpus_per_node = {gpus}\nnumerics = \"{numerics}\"\n[parallel]\ndp = {ranks}\nep = {ranks}\n\
             [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 5\n\
             overlap_depth = 2\nadmission_queue_capacity = 32\n{extra}"
        ),
        &format!("gpu ep engine ({ranks} ranks on {gpus} GPUs, {numerics})"),
    )
    .expect("topology")
}

/// Node `node` of two (`device.nodes = 2`, one GPU and one DP = EP rank each, `exact`),
/// joining through node 0's bootstrap address `boot`: one process of a two-node deployment.
pub fn node_of_two(node: u16, boot: std::net::SocketAddr) -> NodeConfig {
    NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\narch = \"sm90\"\n\
             nodes = 2\ngpus_per_node = 1\nnumerics = \"exact\"\n[parallel]\ndp = 2\nep = 2\n\
             [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 5\n\
             overlap_depth = 2\nadmission_queue_capacity = 32\n\
             [cluster]\nnode = {node}\nbootstrap = \"{boot}\"\nbootstrap_timeout_seconds = 300\n"
        ),
        &format!("gpu ep engine (node {node} of 2, one GPU each, exact)"),
    )
    .expect("topology")
}

/// `source`'s model laid out on `node` (blocking: across nodes it waits for the others at the
/// bootstrap).
pub fn resolve_on(source: Source, node: &NodeConfig) -> ResolvedModel {
    match source {
        Source::Fixture => loaded_on(node, v41_tiny(), "v41-tiny"),
        Source::Demo => resolve(node).unwrap_or_else(|e| panic!("{}: {e}", node.origin)),
        Source::V4Tiny => loaded_on(node, AnyModel::V4(v4_tiny()), "v4-tiny"),
    }
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

pub type Served = (
    BTreeMap<RequestId, Vec<u32>>,
    HashMap<(RequestId, usize), Vec<f32>>,
);

/// What one engine run served, how its ranks were laid out, and their `DeviceExperts` group
/// (when they have one).
pub struct Run {
    pub served: Served,
    /// The factory's description (where the ranks run, how rows move).
    pub layout: String,
    pub group: Option<Arc<DeviceExperts>>,
}

/// `prompts` (then the first one alone, leaving a rank idle) served on `node`.
pub async fn serve(
    source: Source,
    node: NodeConfig,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Run {
    let origin = node.origin.clone();
    let (resolved, node) = tokio::task::spawn_blocking(move || (resolve_on(source, &node), node))
        .await
        .expect("resolving thread");
    let layout = resolved.factory.describe();
    println!("{origin}: {layout}");
    let group = resolved.factory.device_experts();
    let mut all = prompts.to_vec();
    all.push(prompts[0].clone());
    let served = run_engine(node, resolved.factory, resolved.facts, &all, max_tokens).await;
    Run {
        served,
        layout,
        group,
    }
}

/// `got` is `expected`: the same tokens for every request, every row bitwise; returns the
/// logits compared.
pub fn check_same(what: &str, got: &Served, expected: &Served, requests: usize) -> usize {
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

/// Skewed prompts, all in flight at once, and two more.
pub fn workload() -> Vec<Vec<u32>> {
    let mut prompts = skewed_prompts(6);
    prompts.extend([(10..24).collect(), vec![300, 1, 44, 500, 2]]);
    prompts
}

/// The `[eplb]` of the live-EPLB runs: 2 redundant slots, a rebalance every 4 steps over a
/// 3-step window.
pub const LIVE_EPLB: &str = "[eplb]\nenabled = true\nredundant_experts = 2\nwindow_steps = 3\n\
                             rebalance_interval_steps = 4\n";

/// A live EPLB ran on `group`'s two ranks: at least one rebalance, every step index on one
/// epoch on both ranks, both ranks ran every step, epochs never went back and at least one
/// placement was committed under traffic. Returns (steps per rank, rebalances, epoch now).
pub fn check_live_eplb(what: &str, group: &DeviceExperts) -> (usize, u64, PlacementEpoch) {
    let status = group.eplb_status().expect("EPLB on");
    assert!(status.rebalances >= 1, "{what}: {status:?}");
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
    (per_rank(0), status.rebalances, status.epoch)
}
