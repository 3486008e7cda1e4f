//! The engine with expert parallelism on CUDA (`deepinfer_actors::experts::device`), laid out
//! from a topology as `deepinfer-node` does (`gpu_ep_support`): `parallel.dp = parallel.ep = 2`
//! on one GPU (`device.gpus_per_node = 1`), each rank's backend its EP rank holding half of every
//! layer's experts, rows moved between the ranks by device copies, the ranks in `Lockstep` (one
//! rank is often idle and follows the other's steps). Two GPUs: `gpu_two.rs`.
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
//! - `dspark_over_two_ep_ranks_serves_the_tokens_of_one_rank`: `[dspark] enabled` on the V4.1
//!   models: at start every rank profiles the steps-per-second table on its own executor, the
//!   same steps in lockstep (the profile's MoE collectives pair up through the device copies),
//!   then the ranks serve the greedy tokens one rank serves without DSpark (lossless; which
//!   tokens are drafted follows the profiled rates, so only the tokens are compared). Written
//!   without a GPU (session 14), not run yet.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! The V4.1 models passed on the H200 (2026-12-05); the v4-tiny cases were written without a
//! GPU and have not run yet.
#![cfg(feature = "cuda")]

mod ep_support;
mod gpu_ep_support;
mod gpu_support;

use deepinfer_actors::gpu;
use deepinfer_actors::model_source::MODEL_DIR_ENV;
use gpu_ep_support::{LIVE_EPLB, Source, check_live_eplb, check_same, serve, topology, workload};

/// The `[dspark]` of the DSpark runs (the engine's block of 5 drafts, a short profile).
const DSPARK: &str = "[dspark]\nenabled = true\nmax_draft_tokens = 5\nprofile_steps = 2\n";

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

const SOURCES: [(Source, &str); 3] = [
    (Source::Fixture, "v41-tiny"),
    (Source::Demo, "demo"),
    (Source::V4Tiny, "v4-tiny"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ep_ranks_on_one_gpu_serve_what_one_rank_serves() {
    require_gpu();
    let prompts = workload();
    let max_tokens = 6;
    for (source, name) in SOURCES {
        for numerics in ["exact", "fast"] {
            let expected = serve(source, topology(1, 1, numerics, ""), &prompts, max_tokens).await;
            let got = serve(source, topology(2, 1, numerics, ""), &prompts, max_tokens).await;
            let what = format!("{name} ({numerics})");
            assert!(got.group.is_some(), "{what}: the ranks are EP ranks");
            assert!(
                got.layout.contains("rows moved by device copies"),
                "{what}: {}",
                got.layout
            );
            let compared = check_same(&what, &got.served, &expected.served, prompts.len() + 1);
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
    for (source, name) in SOURCES {
        for numerics in ["exact", "fast"] {
            let expected = serve(source, topology(1, 1, numerics, ""), &prompts, max_tokens).await;
            let got = serve(
                source,
                topology(2, 1, numerics, LIVE_EPLB),
                &prompts,
                max_tokens,
            )
            .await;
            let what = format!("{name} ({numerics}, live EPLB)");
            let compared = check_same(&what, &got.served, &expected.served, prompts.len() + 1);
            let group = got.group.expect("the ranks are EP ranks");
            let (steps, rebalances, epoch) = check_live_eplb(&what, &group);
            println!(
                "gpu_ep_engine {what}: {steps} steps per rank, {rebalances} rebalances (now \
                 {epoch}), {compared} logits bitwise equal to one rank"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dspark_over_two_ep_ranks_serves_the_tokens_of_one_rank() {
    require_gpu();
    let prompts = workload();
    let max_tokens = 8;
    for (source, name) in [(Source::Fixture, "v41-tiny"), (Source::Demo, "demo")] {
        for numerics in ["exact", "fast"] {
            let expected = serve(source, topology(1, 1, numerics, ""), &prompts, max_tokens).await;
            let got = serve(
                source,
                topology(2, 1, numerics, DSPARK),
                &prompts,
                max_tokens,
            )
            .await;
            let what = format!("{name} ({numerics}, DSpark)");
            let group = got.group.expect("the ranks are EP ranks");
            assert_eq!(
                got.served.0.len(),
                prompts.len() + 1,
                "{what}: requests served"
            );
            assert_eq!(got.served.0, expected.served.0, "{what}: tokens");
            let steps = group.lockstep().steps();
            assert!(
                (0..2).all(|rank| group.lockstep().behind(rank) == 0),
                "{what}"
            );
            println!(
                "gpu_ep_engine {what}: 2 EP ranks on one GPU, {steps} lockstep steps (the \
                 profile's included), the tokens of one rank without DSpark"
            );
        }
    }
}
