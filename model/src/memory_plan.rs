//! The device memory plan of a deployment, per GPU, from the checkpoint's tensor inventory
//! (`config.json` alone, so it can be checked before any weight is read; the vision tower is
//! not counted).
//!
//! What a GPU holds today: the dense weights (everything but the backbone's routed experts and
//! the Engram tables: attention, shared experts, router, embeddings, head, DSpark stages with
//! their own experts) on every GPU, since every DP rank runs them; the routed experts of its EP
//! rank's slots only (`slots_per_gpu` per backbone layer); the Engram tables whole (the CUDA
//! backend uploads them once per rank); [`WORKSPACE_BYTES`] for the CUDA context, kernels and a
//! step's activations; the rest is the KV budget. A plan whose KV budget would be negative is
//! [`MemoryPlanError`], naming every number.

use crate::checkpoint::inventory_for;
use crate::config::ModelConfig;

/// Kept free on every GPU for the CUDA context, the kernels and a step's activations (bytes).
pub const WORKSPACE_BYTES: u64 = 4 << 30;

/// One GPU's share of a deployment (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMemoryPlan {
    /// The GPU's memory.
    pub total: u64,
    /// Weights every GPU holds.
    pub dense: u64,
    /// The routed experts of this GPU's slots.
    pub experts: u64,
    /// Routed-expert slots per backbone layer on this GPU, and logical experts per layer.
    pub slots: usize,
    pub logical_experts: usize,
    /// The Engram tables.
    pub engram: u64,
    /// [`WORKSPACE_BYTES`].
    pub workspace: u64,
    /// What is left for the KV cache.
    pub kv_budget: u64,
}

/// The deployment does not fit its GPUs: `plan` with no KV budget, `needed` bytes in all.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "the model does not fit a GPU of {}: dense {} + experts {} ({} slots of {} per layer) + \
     Engram {} + workspace {} = {}, {} short",
    gib(plan.total), gib(plan.dense), gib(plan.experts), plan.slots, plan.logical_experts,
    gib(plan.engram), gib(plan.workspace), gib(*needed), gib(needed - plan.total)
)]
pub struct MemoryPlanError {
    pub plan: GpuMemoryPlan,
    pub needed: u64,
}

/// `bytes` in GiB with two decimals.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl std::fmt::Display for GpuMemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory per GPU of {}: dense {}, experts {} ({} slots of {} per layer), Engram {}, \
             workspace {}, KV budget {}",
            gib(self.total),
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

/// The plan of one GPU of `gpu_bytes` holding `slots_per_gpu` routed-expert slots per backbone
/// layer of `cfg`'s model.
pub fn plan_gpu(
    cfg: &ModelConfig,
    slots_per_gpu: usize,
    gpu_bytes: u64,
) -> Result<GpuMemoryPlan, MemoryPlanError> {
    let (mut dense, mut routed, mut engram) = (0u64, 0u64, 0u64);
    for spec in inventory_for(cfg) {
        let bytes = spec.stored_bytes() as u64;
        if is_backbone_expert(&spec.name) {
            routed += bytes;
        } else if spec.name.ends_with(".engram.embed") {
            engram += bytes;
        } else {
            dense += bytes;
        }
    }
    let logical_experts = cfg.n_routed_experts;
    // Every expert of every layer has the same shapes: slots cost their share of the total.
    let experts = routed * slots_per_gpu as u64 / logical_experts.max(1) as u64;
    let needed = dense + experts + engram + WORKSPACE_BYTES;
    let plan = GpuMemoryPlan {
        total: gpu_bytes,
        dense,
        experts,
        slots: slots_per_gpu,
        logical_experts,
        engram,
        workspace: WORKSPACE_BYTES,
        kv_budget: gpu_bytes.saturating_sub(needed),
    };
    if needed > gpu_bytes {
        return Err(MemoryPlanError { plan, needed });
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const H200: u64 = 143_771 << 20;

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
        let err = plan_gpu(&cfg, cfg.n_routed_experts, H200).expect_err("475 GiB on one H200");
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
        let plan = plan_gpu(&cfg, 96, H200).expect("fits 4 H200s");
        let whole = plan_gpu(&cfg, 384, u64::MAX / 2).expect("a huge GPU");
        assert_eq!(plan.experts * 4, whole.experts);
        assert_eq!(plan.dense, whole.dense);
        assert_eq!(
            plan.kv_budget,
            H200 - plan.dense - plan.experts - WORKSPACE_BYTES
        );
        assert!(plan.kv_budget > 40 << 30, "{plan}");
        assert!(plan.to_string().contains("96 slots of 384"), "{plan}");
        assert!(plan_gpu(&cfg, 384, H200).is_err());
    }
}
