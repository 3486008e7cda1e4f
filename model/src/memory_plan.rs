//! The device memory plan of a deployment, per GPU, from the checkpoint's tensor inventory
//! (`config.json` alone, so it can be checked before any weight is read; the vision tower is
//! not counted). The one computation of what a GPU holds: the engine's start-up fit check and
//! the `memory-plan` subcommand both use [`plan_node`].
//!
//! What a GPU holds today, per DP rank on it (each rank has a backend of its own, with its own
//! copy of what it uploads; [`GpuShare`]): the dense weights (everything but the backbone's
//! routed experts and the Engram tables: attention, shared experts, router, embeddings, head,
//! Engram projections, DSpark stages with their own experts), since every DP rank runs them;
//! the routed experts of its EP rank's slots only (`slots_per_gpu` of the placement per
//! backbone layer: the CUDA expert rank uploads only those); the Engram tables whole (the CUDA
//! backend uploads them once per rank: they are not sharded over the EP ranks). Then
//! [`WORKSPACE_BYTES`] for the CUDA context, kernels and a step's activations; the rest is the
//! KV budget. A plan whose KV budget would be negative is [`MemoryPlanError`], naming every
//! number.

use deepinfer_topology::{NodeConfig, PlacementShape};

use crate::checkpoint::inventory_for;
use crate::config::ModelConfig;

/// Kept free on every GPU for the CUDA context, the kernels and a step's activations (bytes).
pub const WORKSPACE_BYTES: u64 = 4 << 30;

/// How a checkpoint's bytes split by where they are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightSplit {
    /// Weights every DP rank holds.
    pub dense: u64,
    /// The backbone's routed experts (every layer, every logical expert).
    pub routed: u64,
    /// The Engram tables.
    pub engram: u64,
}

impl WeightSplit {
    /// The split of `cfg`'s checkpoint inventory.
    pub fn of(cfg: &ModelConfig) -> WeightSplit {
        let mut split = WeightSplit {
            dense: 0,
            routed: 0,
            engram: 0,
        };
        for spec in inventory_for(cfg) {
            let bytes = spec.stored_bytes() as u64;
            if is_backbone_expert(&spec.name) {
                split.routed += bytes;
            } else if spec.name.ends_with(".engram.embed") {
                split.engram += bytes;
            } else {
                split.dense += bytes;
            }
        }
        split
    }

    /// Every byte of the inventory.
    pub fn total(&self) -> u64 {
        self.dense + self.routed + self.engram
    }
}

/// Who shares one GPU: `ranks` DP ranks (each one EP rank with expert parallelism), each
/// holding `slots_per_rank` routed-expert slots per backbone layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuShare {
    pub ranks: usize,
    pub slots_per_rank: usize,
}

impl GpuShare {
    /// The share of the busiest GPU of `node` for a model of `routed_experts` experts: DP rank
    /// `r` runs on GPU `r % gpus_per_node` of its node, and each holds its EP rank's slots of
    /// the placement (every expert and the redundant slots with `ep = 1`).
    pub fn of_node(node: &NodeConfig, routed_experts: usize) -> GpuShare {
        let experts = u16::try_from(routed_experts).unwrap_or(u16::MAX);
        let gpus =
            usize::from(node.device.nodes.max(1)) * usize::from(node.device.gpus_per_node.max(1));
        GpuShare {
            ranks: usize::from(node.parallel.dp.max(1)).div_ceil(gpus),
            slots_per_rank: PlacementShape::from_config(node, experts).slots_per_gpu(),
        }
    }
}

/// One GPU's share of a deployment (bytes; every field but `total` and `kv_budget` summed over
/// the ranks on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMemoryPlan {
    /// The GPU's memory.
    pub total: u64,
    /// DP ranks on this GPU, each with its own copy of the dense weights and Engram tables.
    pub ranks: usize,
    /// Weights every rank holds.
    pub dense: u64,
    /// The routed experts of the ranks' slots.
    pub experts: u64,
    /// Routed-expert slots per backbone layer of each rank, and logical experts per layer.
    pub slots: usize,
    pub logical_experts: usize,
    /// The Engram tables, whole on every rank.
    pub engram: u64,
    /// [`WORKSPACE_BYTES`].
    pub workspace: u64,
    /// What is left for the KV cache.
    pub kv_budget: u64,
}

impl GpuMemoryPlan {
    /// The weights on this GPU.
    pub fn weights(&self) -> u64 {
        self.dense + self.experts + self.engram
    }
}

/// The deployment does not fit its GPUs: `plan` with no KV budget, `needed` bytes in all.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "the model does not fit a GPU of {}: dense {} + experts {} ({} slots of {} per layer) + \
     Engram {} (whole per GPU) + workspace {}{} = {}, {} short",
    gib(plan.total), gib(plan.dense), gib(plan.experts), plan.slots, plan.logical_experts,
    gib(plan.engram), gib(plan.workspace), ranks_note(plan.ranks), gib(*needed),
    gib(needed - plan.total)
)]
pub struct MemoryPlanError {
    pub plan: GpuMemoryPlan,
    pub needed: u64,
}

/// `bytes` in GiB with two decimals.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn ranks_note(ranks: usize) -> String {
    match ranks {
        1 => String::new(),
        n => format!(" (for {n} ranks on the GPU)"),
    }
}

impl std::fmt::Display for GpuMemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory per GPU of {}{}: dense {}, experts {} ({} slots of {} per layer), Engram {} \
             (whole per GPU), workspace {}, KV budget {}",
            gib(self.total),
            ranks_note(self.ranks),
            gib(self.dense),
            gib(self.experts),
            self.slots,
            self.logical_experts,
            gib(self.engram),
            gib(self.workspace),
            gib(self.kv_budget)
        )
    }
}

/// Whether inventory entry `name` is a backbone routed expert (`layers.N.ffn.experts.E...`).
fn is_backbone_expert(name: &str) -> bool {
    name.starts_with("layers.") && name.contains(".ffn.experts.")
}

/// The plan of one GPU of `gpu_bytes` shared as `share` by ranks of `cfg`'s model.
pub fn plan_gpu(
    cfg: &ModelConfig,
    share: GpuShare,
    gpu_bytes: u64,
) -> Result<GpuMemoryPlan, MemoryPlanError> {
    let split = WeightSplit::of(cfg);
    let logical_experts = cfg.n_routed_experts;
    let ranks = share.ranks.max(1) as u64;
    // Every expert of every layer has the same shapes: slots cost their share of the total.
    let experts = split.routed * share.slots_per_rank as u64 / logical_experts.max(1) as u64;
    let plan = GpuMemoryPlan {
        total: gpu_bytes,
        ranks: share.ranks.max(1),
        dense: split.dense * ranks,
        experts: experts * ranks,
        slots: share.slots_per_rank,
        logical_experts,
        engram: split.engram * ranks,
        workspace: WORKSPACE_BYTES,
        kv_budget: 0,
    };
    let needed = plan.weights() + WORKSPACE_BYTES;
    if needed > gpu_bytes {
        return Err(MemoryPlanError { plan, needed });
    }
    Ok(GpuMemoryPlan {
        kv_budget: gpu_bytes - needed,
        ..plan
    })
}

/// The plan of the busiest GPU of `node` ([`GpuShare::of_node`]), of `gpu_bytes`.
pub fn plan_node(
    node: &NodeConfig,
    cfg: &ModelConfig,
    gpu_bytes: u64,
) -> Result<GpuMemoryPlan, MemoryPlanError> {
    plan_gpu(
        cfg,
        GpuShare::of_node(node, cfg.n_routed_experts),
        gpu_bytes,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const H200: u64 = 143_771 << 20;

    fn one_rank(slots_per_rank: usize) -> GpuShare {
        GpuShare {
            ranks: 1,
            slots_per_rank,
        }
    }

    fn real_v41() -> ModelConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/deepseek-v4.1-flash.config.json");
        ModelConfig::from_file(&path).expect("the real V4.1-Flash config")
    }

    /// V4.1-Flash's bytes split as the spec counts them (routed experts 268.95 GiB, Engram
    /// tables 188.83 GiB, 475.2 GiB in all with the vision tower): on one GPU per EP rank with every expert there it
    /// does not fit, and the error names the numbers.
    #[test]
    fn the_real_model_splits_as_the_spec_counts_and_one_h200_is_short() {
        let cfg = real_v41();
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let err =
            plan_gpu(&cfg, one_rank(cfg.n_routed_experts), H200).expect_err("475 GiB on one H200");
        let text = err.to_string();
        let (plan, short) = (err.plan, err.needed - H200);
        assert!(gib(short) > 330.0, "{}", gib(short));
        assert!(
            (gib(plan.experts) - 268.95).abs() < 0.05,
            "{}",
            gib(plan.experts)
        );
        assert!(
            (gib(plan.engram) - 188.83).abs() < 0.05,
            "{}",
            gib(plan.engram)
        );
        // 475.2 GiB less the vision tower (0.49 B bf16 parameters, not in the inventory).
        let all = gib(plan.dense + plan.experts + plan.engram);
        assert!((all - 474.3).abs() < 0.1, "{all}");
        assert!(text.contains("experts 268.9"), "{text}");
        assert!(text.contains("384 slots of 384"), "{text}");
        assert!(text.contains("Engram 188.8"), "{text}");
        assert!(text.contains("short"), "{text}");
    }

    /// Without the Engram tables on the GPUs, EP over 4 H200s (96 slots each) leaves a KV
    /// budget; the experts shrink by the EP degree.
    #[test]
    fn expert_parallelism_divides_the_experts() {
        let mut cfg = real_v41();
        cfg.engram = None;
        let plan = plan_gpu(&cfg, one_rank(96), H200).expect("fits 4 H200s");
        let whole = plan_gpu(&cfg, one_rank(384), u64::MAX / 2).expect("a huge GPU");
        assert_eq!(plan.experts * 4, whole.experts);
        assert_eq!(plan.dense, whole.dense);
        assert_eq!(
            plan.kv_budget,
            H200 - plan.dense - plan.experts - WORKSPACE_BYTES
        );
        assert!(plan.kv_budget > 40 << 30, "{plan}");
        assert!(plan.to_string().contains("96 slots of 384"), "{plan}");
        assert!(plan_gpu(&cfg, one_rank(384), H200).is_err());
    }

    /// Two DP = EP ranks on one GPU (`gpus_per_node = 1`): each holds half the slots and its own
    /// copy of the dense weights and Engram tables; their experts together are every expert once.
    #[test]
    fn ranks_sharing_a_gpu_each_hold_their_copy() {
        let node = NodeConfig::from_toml_str(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\ngpus_per_node = 1\n\
             [parallel]\ndp = 2\nep = 2\n",
            "two ranks on one GPU",
        )
        .expect("topology");
        let cfg = ModelConfig::tiny_v41();
        let half = cfg.n_routed_experts / 2;
        let share = GpuShare::of_node(&node, cfg.n_routed_experts);
        assert_eq!(
            share,
            GpuShare {
                ranks: 2,
                slots_per_rank: half
            }
        );
        let two = plan_node(&node, &cfg, H200).expect("fits");
        let one = plan_gpu(&cfg, one_rank(half), H200).expect("fits");
        let split = WeightSplit::of(&cfg);
        assert_eq!(
            (two.dense, two.experts, two.engram),
            (2 * one.dense, 2 * one.experts, 2 * one.engram)
        );
        assert_eq!((two.experts, two.engram), (split.routed, 2 * split.engram));
        assert!(split.engram > 0 && split.dense > 0);
        assert_eq!(two.kv_budget, H200 - two.weights() - WORKSPACE_BYTES);
        assert!(
            two.to_string().contains("(for 2 ranks on the GPU)"),
            "{two}"
        );
    }
}
