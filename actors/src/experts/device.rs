//! Expert parallelism on CUDA ranks (DEP: one EP rank per DP rank, `[parallel] dp = ep`): which
//! layouts the engine runs, where each rank runs, and the placement its backend serves.
//!
//! DP rank r runs on GPU `r % gpus_per_node` of its node and is EP rank r: its backend holds
//! only the experts of its slots (`deepinfer_model::backend::cuda::ep::ExpertRank`, uploaded
//! when the rank's backend opens) and moves routed rows to the other ranks inside each MoE layer.
//! Built: every rank on one GPU (`device.gpus_per_node = 1`, rows moved by device copies), the
//! placement of equal loads (epoch 0). Refused before anything loads, naming the field: ranks on
//! several GPUs (the NCCL transport exists at the model level, not wired into the engine's rank
//! start) and live EPLB on CUDA.

use std::sync::Arc;

use deepinfer_model::config::ModelConfig;
use deepinfer_topology::{ExpertPlacement, NodeConfig, PlacementShape};

use crate::error::EngineError;

/// The device of DP rank `dp` with `per_node` GPUs per node.
pub fn device_of(dp: usize, per_node: usize) -> usize {
    dp % per_node.max(1)
}

/// Refuses, for a CUDA topology with expert parallelism (`ep > 1` or `[eplb] enabled`), what the
/// engine does not run on CUDA yet, naming the field (`dp = ep` is the topology's own rule).
pub fn check_cuda_expert_parallel(node: &NodeConfig) -> Result<(), EngineError> {
    let refuse = |field: &str, message: String| {
        Err(EngineError::Config {
            field: field.to_string(),
            message: format!("{}: {message}", node.origin),
        })
    };
    if node.eplb.enabled {
        return refuse(
            "eplb.enabled",
            "live EPLB runs on the CPU backend only so far; with device.backend = \"cuda\" the \
             placement of equal loads is served (eplb.enabled = false)"
                .to_string(),
        );
    }
    if node.parallel.ep == 1 {
        return Ok(());
    }
    let gpus = u32::from(node.device.nodes) * u32::from(node.device.gpus_per_node);
    if gpus > 1 {
        return refuse(
            "device.gpus_per_node",
            format!(
                "expert parallelism on CUDA runs its {} EP ranks on one GPU so far (rows moved by \
                 device copies); EP ranks on {gpus} GPUs need the NCCL transport, not wired into \
                 the engine yet: use device.nodes = 1 and device.gpus_per_node = 1",
                node.parallel.ep
            ),
        );
    }
    Ok(())
}

/// The placement the EP ranks of `node` serve at start (epoch 0): equal loads over `cfg`'s
/// routed experts and the topology's redundant slots.
pub fn starting_placement(
    node: &NodeConfig,
    cfg: &ModelConfig,
) -> Result<Arc<ExpertPlacement>, EngineError> {
    let experts = u16::try_from(cfg.n_routed_experts).map_err(|_| EngineError::Model {
        what: "expert parallelism".to_string(),
        message: format!("{} routed experts exceed u16", cfg.n_routed_experts),
    })?;
    let shape = PlacementShape::from_config(node, experts);
    ExpertPlacement::uniform(cfg.n_layers, cfg.n_routed_experts, shape)
        .map(Arc::new)
        .map_err(|e| EngineError::Config {
            field: "parallel.ep".to_string(),
            message: format!("{}: {e}", node.origin),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_topology::EpRank;

    fn cuda(extra: &str) -> NodeConfig {
        let text = format!("[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\n{extra}");
        NodeConfig::from_toml_str(&text, "cuda ep test").expect("topology")
    }

    fn refused_field(node: &NodeConfig) -> String {
        match check_cuda_expert_parallel(node) {
            Err(EngineError::Config { field, message }) => {
                assert!(message.starts_with("cuda ep test: "), "{message}");
                field
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// Two ranks on one GPU run; ranks over several GPUs and live EPLB are refused naming their
    /// field; `ep != dp` (and context parallelism) never get here: the topology refuses them.
    #[test]
    fn what_cuda_expert_parallelism_runs_and_refuses() {
        let shared = "gpus_per_node = 1\n[parallel]\ndp = 2\nep = 2\n";
        assert!(check_cuda_expert_parallel(&cuda(shared)).is_ok());
        assert!(check_cuda_expert_parallel(&cuda("")).is_ok());
        assert_eq!(
            refused_field(&cuda("gpus_per_node = 2\n[parallel]\ndp = 2\nep = 2\n")),
            "device.gpus_per_node"
        );
        assert_eq!(
            refused_field(&cuda(&format!("{shared}[eplb]\nenabled = true\n"))),
            "eplb.enabled"
        );
        let err = NodeConfig::from_toml_str(
            "[device]\nbackend = \"cuda\"\ngpus_per_node = 1\n[parallel]\ndp = 2\nep = 1\n",
            "ep below dp",
        )
        .expect_err("ep != dp on cuda");
        assert!(err.to_string().contains("parallel.ep"), "{err}");
    }

    #[test]
    fn ranks_wrap_over_the_gpus_of_a_node() {
        let devices: Vec<usize> = (0..5).map(|dp| device_of(dp, 2)).collect();
        assert_eq!(devices, vec![0, 1, 0, 1, 0]);
        assert!((0..4).all(|dp| device_of(dp, 1) == 0));
        assert_eq!(device_of(3, 0), 0);
    }

    /// Epoch 0 splits every layer's experts over the ranks (the tiny model: 8 experts, 2 ranks
    /// of 4 slots, no redundant slot): each rank uploads half, the halves disjoint.
    #[test]
    fn the_starting_placement_gives_each_rank_its_share() {
        let cfg = ModelConfig::tiny_v41();
        let node = cuda("gpus_per_node = 1\n[parallel]\ndp = 2\nep = 2\n");
        let placement = starting_placement(&node, &cfg).expect("placement");
        assert_eq!(placement.slots_per_gpu, cfg.n_routed_experts / 2);
        assert_eq!(placement.layers.len(), cfg.n_layers);
        for layer in 0..cfg.n_layers {
            let (a, b) = (
                placement.held_experts(layer, EpRank(0)),
                placement.held_experts(layer, EpRank(1)),
            );
            assert_eq!(a.len() + b.len(), cfg.n_routed_experts, "layer {layer}");
            assert!(a.iter().all(|e| !b.contains(e)), "layer {layer}");
        }
    }
}
