//! The engine with expert parallelism over two GPUs of one host (`deepinfer_actors::experts::
//! device`): `parallel.dp = parallel.ep = 2` with `device.gpus_per_node = 2`, DP rank r on GPU r
//! as EP rank r holding half of every layer's experts, the routed rows moved between the GPUs by
//! NCCL (`NcclDevices`: the communicators created by the last rank to open its backend), laid
//! out from a topology as `deepinfer-node` does (`gpu_ep_support`).
//!
//! Models: the v41-tiny fixture (V4.1: FP4/FP8 experts, `moe_rows`) and the v4-tiny fixture (the
//! V4 family: exact fp32 experts through `moe_rows_exact`, hash layers included), in the `exact`
//! numerics, so every GPU computes the bits of the CPU reference.
//!
//! - `two_ep_ranks_on_two_gpus_serve_what_one_rank_serves`: each model: the workload of the EP
//!   tests (skewed prompts, all in flight at once, then a lone request leaving a rank idle)
//!   gives the tokens and every logits row of `dp = ep = 1` on one GPU, bitwise.
//! - `live_eplb_over_two_gpus_changes_no_output`: the same with `[eplb] enabled` (2 redundant
//!   slots, a rebalance every 4 steps over a 3-step window; each rank uploads the experts a new
//!   placement gives it from its host weights): placements committed under traffic, no request
//!   lost or changed, both ranks ran every step index on the same epoch, epochs never going back.
//!
//! Needs two GPUs and `libnccl.so`: with fewer GPUs or no NCCL every test fails, naming why. Its
//! own test binary, so the one-GPU suite leaves it out: stage it alone with
//! `tests/gpu-suite.sh stage gpu_two` and run `bash .gpu/suite/gpu-suite.sh run` on a two-GPU
//! machine. Written without two GPUs; not run yet.
#![cfg(feature = "cuda")]

mod ep_support;
mod gpu_ep_support;
mod gpu_support;

use deepinfer_actors::gpu;
use deepinfer_actors::model_source::MODEL_DIR_ENV;
use gpu_ep_support::{LIVE_EPLB, Source, check_live_eplb, check_same, serve, topology, workload};

const SOURCES: [(Source, &str); 2] = [(Source::Fixture, "v41-tiny"), (Source::V4Tiny, "v4-tiny")];

/// Fails unless two GPUs and the NCCL library are usable and no model override is set.
fn require_two_gpus() {
    let gpus = gpu::inventory();
    assert!(
        gpus.count >= 2,
        "gpu_two needs two GPUs, {} usable here ({}); run it on a two-GPU machine \
         (tests/gpu-suite.sh stage gpu_two)",
        gpus.count,
        gpus.unavailable.unwrap_or_default()
    );
    if let Err(reason) = gpu::nccl_available() {
        panic!("gpu_two moves rows between the GPUs through NCCL: {reason}");
    }
    assert!(
        std::env::var_os(MODEL_DIR_ENV).is_none(),
        "unset {MODEL_DIR_ENV}: it overrides the models this test resolves"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ep_ranks_on_two_gpus_serve_what_one_rank_serves() {
    require_two_gpus();
    let prompts = workload();
    let max_tokens = 6;
    for (source, name) in SOURCES {
        let expected = serve(source, topology(1, 1, "exact", ""), &prompts, max_tokens).await;
        let got = serve(source, topology(2, 2, "exact", ""), &prompts, max_tokens).await;
        let what = format!("{name} (exact, 2 GPUs)");
        assert!(got.group.is_some(), "{what}: the ranks are EP ranks");
        assert!(
            got.layout.contains("rows moved by NCCL"),
            "{what}: {}",
            got.layout
        );
        let compared = check_same(&what, &got.served, &expected.served, prompts.len() + 1);
        println!(
            "gpu_two {what}: 2 EP ranks on two GPUs, {} requests, {compared} logits bitwise \
             equal to one rank on one GPU",
            prompts.len() + 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_eplb_over_two_gpus_changes_no_output() {
    require_two_gpus();
    let prompts = workload();
    let max_tokens = 8;
    for (source, name) in SOURCES {
        let expected = serve(source, topology(1, 1, "exact", ""), &prompts, max_tokens).await;
        let got = serve(
            source,
            topology(2, 2, "exact", LIVE_EPLB),
            &prompts,
            max_tokens,
        )
        .await;
        let what = format!("{name} (exact, 2 GPUs, live EPLB)");
        assert!(
            got.layout.contains("rows moved by NCCL"),
            "{what}: {}",
            got.layout
        );
        let compared = check_same(&what, &got.served, &expected.served, prompts.len() + 1);
        let group = got.group.expect("the ranks are EP ranks");
        let (steps, rebalances, epoch) = check_live_eplb(&what, &group);
        println!(
            "gpu_two {what}: {steps} steps per rank, {rebalances} rebalances (now {epoch}), \
             {compared} logits bitwise equal to one rank on one GPU"
        );
    }
}
