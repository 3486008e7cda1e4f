//! A CUDA topology on a machine without the GPUs it needs: `deepinfer-node` says so in one line
//! and exits 1 (never a panic), and model resolution refuses it before loading anything; the
//! expert parallelism CUDA does not run (several EP ranks per GPU over several GPUs) is refused
//! naming the field, and the shipped two-GPU topology passes the checks that need no GPU, as
//! does one node of a CUDA deployment over two nodes (which needs only its own GPUs).
//! Where the GPUs exist (the H200 with a `cuda` build) the shortage checks are skipped, and say
//! so.

use std::process::Command;

use deepinfer_actors::experts::cuda_layout::{RankLinks, check_cuda_expert_parallel, rank_links};
use deepinfer_actors::gpu;
use deepinfer_actors::model_source::resolve;
use deepinfer_topology::NodeConfig;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

#[test]
fn node_refuses_a_cuda_topology_without_its_gpus_in_one_line() {
    let gpus = gpu::inventory();
    for (topology, needed) in [("configs/h200x1.toml", 1), ("configs/h200x2.toml", 2)] {
        if gpus.count >= needed {
            eprintln!("skipped {topology}: this machine has {} GPUs", gpus.count);
            continue;
        }
        let run = Command::new(env!("CARGO_BIN_EXE_deepinfer-node"))
            .current_dir(ROOT)
            .env_remove("DEEPINFER_HF_MODEL_DIR")
            .args(["--topology", topology])
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{topology}: {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{topology}: one line expected: {stderr}");
        let line = lines[0];
        assert!(line.starts_with("error: "), "{line}");
        assert!(line.contains(topology), "{line}");
        assert!(line.contains(&format!("needs {needed} GPUs")), "{line}");
        assert!(
            line.contains(&format!("only {} are available", gpus.count)),
            "{line}"
        );
        if gpus.count == 0 {
            // Why none: a build without CUDA support, or no driver.
            assert!(
                line.contains("no CUDA support") || line.contains("no CUDA driver"),
                "{line}"
            );
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(run.stdout.is_empty(), "{topology}: nothing on stdout");
    }
}

fn cuda_node(parallel: &str, eplb: &str) -> NodeConfig {
    NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"/nonexistent/checkpoint\"\n[device]\nbackend = \"cuda\"\n\
             gpus_per_node = 2\n[parallel]\n{parallel}\n[eplb]\n{eplb}\n"
        ),
        "cuda node test",
    )
    .expect("topology")
}

/// Several EP ranks per GPU over two GPUs are refused before the GPUs are counted, naming the
/// field and the numbers; the shipped two-GPU topology (one EP rank per GPU, NCCL) passes the
/// checks that run without a GPU and, here without its GPUs, fails only for the shortage.
#[test]
fn expert_parallelism_over_two_gpus_runs_one_rank_per_gpu() {
    if std::env::var_os(deepinfer_actors::model_source::MODEL_DIR_ENV).is_some() {
        return; // the checks run before any loading, but keep the environment's model out
    }
    let err = resolve(&cuda_node("dp = 4\nep = 4", ""))
        .err()
        .expect("two EP ranks per GPU over two GPUs are refused");
    assert_eq!(err.code(), "config");
    let message = err.to_string();
    assert!(message.contains("parallel.ep"), "{message}");
    assert!(message.contains("cuda node test"), "{message}");
    assert!(
        message.contains("parallel.dp = parallel.ep = 4 ranks on device.gpus_per_node = 2 GPUs"),
        "{message}"
    );
    assert!(message.contains("NCCL"), "{message}");

    let shipped =
        NodeConfig::from_file_with_env(std::path::Path::new(ROOT).join("configs/h200x2.toml"))
            .expect("shipped topology");
    assert_eq!(check_cuda_expert_parallel(&shipped), Ok(()));
    assert_eq!(rank_links(&shipped), Some(RankLinks::Nccl));
    let gpus = gpu::inventory();
    if gpus.count >= 2 {
        eprintln!(
            "skipped resolving h200x2.toml: this machine has {} GPUs",
            gpus.count
        );
        return;
    }
    let message = resolve(&shipped).err().expect("refused").to_string();
    assert!(message.contains("needs 2 GPUs"), "{message}");
    assert!(!message.contains("parallel.ep"), "{message}");
}

/// Node 1 of a CUDA deployment over two nodes of two GPUs (one EP rank per GPU on each, NCCL
/// across the nodes) passes the checks that run without a GPU and, here without its GPUs, fails
/// only for the shortage of its own two GPUs (not the deployment's four); two ranks per GPU over
/// the nodes are refused naming `parallel.ep` before the GPUs are counted.
#[test]
fn one_node_of_a_cuda_deployment_needs_its_own_gpus_only() {
    if std::env::var_os(deepinfer_actors::model_source::MODEL_DIR_ENV).is_some() {
        return;
    }
    let node = |ranks: u16| {
        NodeConfig::from_toml_str(
            &format!(
                "[model]\nsource = \"/nonexistent/checkpoint\"\n[device]\nbackend = \"cuda\"\n\
                 nodes = 2\ngpus_per_node = 2\n[parallel]\ndp = {ranks}\nep = {ranks}\n\
                 [cluster]\nnode = 1\nbootstrap = \"127.0.0.1:29500\"\n"
            ),
            "two node test",
        )
        .expect("topology")
    };
    let one_per_gpu = node(4);
    assert_eq!(check_cuda_expert_parallel(&one_per_gpu), Ok(()));
    assert_eq!(rank_links(&one_per_gpu), Some(RankLinks::Nccl));
    let message = resolve(&node(8)).err().expect("refused").to_string();
    assert!(message.contains("parallel.ep"), "{message}");
    assert!(
        message.contains("8 ranks on device.nodes x device.gpus_per_node = 2 x 2 = 4 GPUs"),
        "{message}"
    );
    let gpus = gpu::inventory();
    if gpus.count >= 2 {
        eprintln!(
            "skipped resolving node 1: this machine has {} GPUs",
            gpus.count
        );
        return;
    }
    let message = resolve(&one_per_gpu).err().expect("refused").to_string();
    assert!(
        message.contains("needs 2 GPUs (1 node(s) x 2 GPUs per node)"),
        "{message}"
    );
    assert!(!message.contains("parallel.ep"), "{message}");
}

#[test]
fn resolving_a_cuda_topology_without_its_gpus_is_a_clear_error() {
    if std::env::var_os(deepinfer_actors::model_source::MODEL_DIR_ENV).is_some() {
        return;
    }
    let one = NodeConfig::from_toml_str(
        "[model]\nsource = \"/nonexistent/checkpoint\"\n[device]\nbackend = \"cuda\"\n\
         gpus_per_node = 1\n[parallel]\ndp = 1\nep = 1\n",
        "one gpu test",
    )
    .expect("topology");
    let err = resolve(&one)
        .err()
        .expect("refused or the checkpoint is missing");
    let message = err.to_string();
    if gpu::inventory().count == 0 {
        assert_eq!(err.code(), "config", "{message}");
        assert!(message.contains("needs 1 GPUs"), "{message}");
        assert!(!message.contains("/nonexistent/checkpoint"), "{message}");
    } else {
        // The GPU exists: the checks pass and the missing checkpoint is what fails.
        assert!(message.contains("/nonexistent/checkpoint"), "{message}");
    }
}
