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
//! - `two_processes_as_two_nodes_serve_what_one_rank_serves`: the v41-tiny fixture over two
//!   processes of this binary on one host as the two nodes of a deployment (`device.nodes = 2`,
//!   one GPU each: the child sees only the second GPU, `CUDA_VISIBLE_DEVICES`), joined through
//!   node 0's bootstrap on loopback, which hands node 1 NCCL's unique id: one communicator of
//!   global ranks 0 and 1 across the processes, the nodes' lockstep kept by their step counts.
//!   Node 0 serves the workload (its lone last request leaves node 1 idle, following) and gets
//!   the tokens and every logits row of `dp = ep = 1` on one GPU, bitwise; node 1
//!   (`node_1_of_two_processes`, which does nothing unless run as that child) followed every
//!   step and exits cleanly once node 0 closes its stdin.
//!
//! Needs two GPUs and `libnccl.so`: with fewer GPUs or no NCCL every test fails, naming why. Its
//! own test binary, so the one-GPU suite leaves it out: stage it alone with
//! `tests/gpu-suite.sh stage gpu_two` and run `bash .gpu/suite/gpu-suite.sh run` on a two-GPU
//! machine. Written without two GPUs; not run yet.
#![cfg(feature = "cuda")]

mod ep_support;
mod gpu_ep_support;
mod gpu_support;

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use deepinfer_actors::gpu;
use deepinfer_actors::model_source::MODEL_DIR_ENV;
use gpu_ep_support::{
    LIVE_EPLB, Source, check_live_eplb, check_same, node_of_two, resolve_on, serve, topology,
    workload,
};

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

/// Set (to node 0's bootstrap address) in the child process that runs node 1.
const NODE_1_OF: &str = "DEEPINFER_GPU_TWO_NODE_1_OF";
/// The child's test.
const NODE_1_TEST: &str = "node_1_of_two_processes";
/// Longest the child may take to end once node 0 is done.
const CHILD_LIMIT: Duration = Duration::from_secs(120);

/// The second GPU of this process's view, as the child's `CUDA_VISIBLE_DEVICES`.
fn second_gpu() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .nth(1)
            .unwrap_or_else(|| panic!("CUDA_VISIBLE_DEVICES={list} shows fewer than two GPUs"))
            .trim()
            .to_string(),
        _ => "1".to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_as_two_nodes_serve_what_one_rank_serves() {
    if std::env::var_os(NODE_1_OF).is_some() {
        return; // the child runs node 1 only
    }
    require_two_gpus();
    let prompts = workload();
    let max_tokens = 6;
    let expected = serve(
        Source::Fixture,
        topology(1, 1, "exact", ""),
        &prompts,
        max_tokens,
    )
    .await;

    let boot: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let exe = std::env::current_exe().expect("this test binary");
    let mut child = Command::new(exe)
        .args(["--exact", NODE_1_TEST, "--nocapture", "--test-threads=1"])
        .env(NODE_1_OF, boot.to_string())
        .env("CUDA_VISIBLE_DEVICES", second_gpu())
        .stdin(Stdio::piped())
        .spawn()
        .expect("node 1 starts");
    let got = serve(Source::Fixture, node_of_two(0, boot), &prompts, max_tokens).await;
    // Node 0 is done: node 1 shuts down.
    drop(child.stdin.take());
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("node 1's status") {
            break status;
        }
        if started.elapsed() > CHILD_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("node 1 did not end within {CHILD_LIMIT:?} of node 0");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let what = "v41-tiny (exact, node 0 of two processes, one GPU each)";
    assert!(
        got.layout.contains("EP ranks 0..1 of 2 (node 0 of 2)")
            && got.layout.contains("rows moved by NCCL"),
        "{what}: {}",
        got.layout
    );
    let compared = check_same(what, &got.served, &expected.served, prompts.len() + 1);
    assert!(status.success(), "node 1 failed: {status}");
    println!(
        "gpu_two {what}: {} requests, {compared} logits bitwise equal to one rank on one GPU",
        prompts.len() + 1
    );
}

/// Node 1 of `two_processes_as_two_nodes_serve_what_one_rank_serves`, run only as its child
/// (`NODE_1_OF` set; otherwise it returns at once): serves nothing, follows node 0's steps,
/// and shuts down once its stdin closes; fails unless it followed every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_1_of_two_processes() {
    let Some(boot) = std::env::var_os(NODE_1_OF) else {
        return;
    };
    let boot: SocketAddr = boot
        .to_str()
        .and_then(|b| b.parse().ok())
        .expect("node 0's address");
    let node = node_of_two(1, boot);
    let (resolved, node) =
        tokio::task::spawn_blocking(move || (resolve_on(Source::Fixture, &node), node))
            .await
            .expect("resolving thread");
    let layout = resolved.factory.describe();
    assert!(
        layout.contains("EP ranks 1..2 of 2 (node 1 of 2)"),
        "{layout}"
    );
    let group = resolved.factory.device_experts().expect("an EP rank");
    let (engine, _rows, freed) =
        ep_support::start_engine(node, resolved.factory, resolved.facts).await;
    tokio::task::spawn_blocking(|| {
        let mut rest = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut rest);
    })
    .await
    .expect("stdin closed");
    let lockstep = group.lockstep();
    let steps = lockstep.steps();
    assert_eq!(
        lockstep.behind(0),
        0,
        "node 1 is behind node 0's {steps} steps"
    );
    assert!(steps > 0, "node 1 heard of no step of node 0");
    let indices: Vec<u64> = group.step_log().iter().map(|s| s.index).collect();
    assert_eq!(indices, (0..steps).collect::<Vec<_>>());
    // It ran no sequence of its own: nothing to check against its `ReplayActor`.
    ep_support::shut_down(engine, &freed, false).await;
    println!("gpu_two node 1: followed all {steps} steps of node 0 on its own GPU");
}
