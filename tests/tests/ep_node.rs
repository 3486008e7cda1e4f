//! The topology switches expert parallelism on: resolving a model for `[parallel] ep > 1` or
//! `[eplb] enabled = true` gives an executor factory with expert-parallel state (so the
//! supervisor spawns the expert groups and the EPLB); `ep = 1` without EPLB keeps the plain
//! model; an EP size that does not divide the expert slots is a clear error.

use deepinfer_actors::model_source::resolve;
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_topology::NodeConfig;

fn node(dir: &std::path::Path, parallel: &str, eplb: &str) -> NodeConfig {
    NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"{}\"\n[device]\nbackend = \"cpu\"\n[parallel]\n{parallel}\n[eplb]\n{eplb}\n",
            dir.display()
        ),
        "ep node test",
    )
    .expect("topology")
}

#[test]
fn topology_decides_expert_parallelism() {
    if std::env::var_os(deepinfer_actors::model_source::MODEL_DIR_ENV).is_some() {
        return; // the override would replace the checkpoint under test
    }
    let mut cfg = ModelConfig::tiny_v41();
    cfg.engram = None;
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 2, dir.path(), 1).expect("checkpoint");

    let plain = resolve(&node(dir.path(), "dp = 2\nep = 1", "")).expect("resolves");
    assert!(plain.factory.expert_parallel().is_none());

    let sharded =
        resolve(&node(dir.path(), "dp = 1\nep = 4", "redundant_experts = 4")).expect("resolves");
    let parallel = sharded.factory.expert_parallel().expect("expert parallel");
    let settings = parallel.settings();
    assert_eq!((settings.ep_ranks, settings.redundant_experts), (4, 4));
    assert_eq!(parallel.current().shards().len(), 4);
    assert_eq!(parallel.shape().num_replicas, 12);
    assert!(sharded.factory.describe().contains("4 EP ranks"));

    let balanced =
        resolve(&node(dir.path(), "dp = 1\nep = 1", "enabled = true")).expect("resolves");
    assert!(balanced.factory.expert_parallel().is_some());

    let err = resolve(&node(dir.path(), "dp = 1\nep = 3", ""))
        .err()
        .expect("3 EP ranks cannot hold 8 slots");
    let message = err.to_string();
    assert!(message.contains("expert parallelism"), "{message}");
    assert!(message.contains("num_gpus"), "{message}");
}
