//! Expert placement: DeepSeek's EPLB algorithm (balanced packing, expert replication,
//! hierarchical or global policy) as a deterministic pure function from per-layer expert
//! loads to a placement (`phy2log`, `log2phy`, `logcnt`), plus the `eplb-plan` JSON form.
//!
//! Physical slot `s` of a layer lives on EP rank `s / slots_per_gpu`.

mod packing;
mod plan_json;
mod solver;

pub use plan_json::{eplb_plan_json, parse_loads_json};
pub use solver::rebalance_experts;

use crate::error::PlacementError;
use crate::ids::{EpRank, ExpertId};
use crate::validate::NodeConfig;

/// The cluster shape a placement is solved for (DeepSeek's `num_replicas`, `num_groups`,
/// `num_nodes`, `num_gpus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementShape {
    /// Physical expert slots per MoE layer (>= logical experts, a multiple of `num_gpus`).
    pub num_replicas: usize,
    /// Expert groups (divides the logical experts when the hierarchical policy is used).
    pub num_groups: usize,
    /// Nodes (divides `num_gpus`).
    pub num_nodes: usize,
    /// GPUs = EP ranks in all.
    pub num_gpus: usize,
}

impl PlacementShape {
    /// The shape a topology implies for a model with `routed_experts` experts per layer:
    /// routed + redundant slots, `eplb.num_groups`, `device.nodes`, `parallel.ep` ranks.
    pub fn from_config(config: &NodeConfig, routed_experts: u16) -> Self {
        Self {
            num_replicas: config.physical_experts(routed_experts) as usize,
            num_groups: usize::from(config.eplb.num_groups),
            num_nodes: usize::from(config.device.nodes),
            num_gpus: usize::from(config.parallel.ep),
        }
    }

    /// Physical slots on each GPU.
    pub fn slots_per_gpu(&self) -> usize {
        self.num_replicas / self.num_gpus.max(1)
    }

    /// Hierarchical when the groups divide over the nodes, global otherwise.
    pub fn policy(&self) -> EplbPolicy {
        if self.num_nodes > 0 && self.num_groups.is_multiple_of(self.num_nodes) {
            EplbPolicy::Hierarchical
        } else {
            EplbPolicy::Global
        }
    }
}

/// Which EPLB policy produced a placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EplbPolicy {
    /// Groups packed onto nodes, replicas made and packed per node (groups % nodes == 0).
    Hierarchical,
    /// One group, one node: replicate over all experts, pack straight onto GPUs.
    Global,
}

/// The placement of one MoE layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlacement {
    /// Logical expert held by each physical slot (`slot = gpu * slots_per_gpu + local`).
    pub phy2log: Vec<ExpertId>,
    /// Physical slots of each logical expert, in replica-rank order (never empty).
    pub log2phy: Vec<Vec<u32>>,
}

impl LayerPlacement {
    /// Replica count of each logical expert.
    pub fn logcnt(&self) -> Vec<usize> {
        self.log2phy.iter().map(Vec::len).collect()
    }
}

/// A solved placement for every MoE layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPlacement {
    /// The policy that was used.
    pub policy: EplbPolicy,
    /// Physical slots per GPU (EP rank).
    pub slots_per_gpu: usize,
    /// One entry per MoE layer, in load-table order.
    pub layers: Vec<LayerPlacement>,
}

impl ExpertPlacement {
    /// The placement for equal loads: the start-up placement before any load is measured.
    pub fn uniform(
        num_layers: usize,
        num_experts: usize,
        shape: PlacementShape,
    ) -> Result<Self, PlacementError> {
        rebalance_experts(&vec![vec![1.0; num_experts]; num_layers], shape)
    }

    /// The EP rank that owns a physical slot.
    pub fn rank_of_slot(&self, slot: u32) -> EpRank {
        let rank = slot as usize / self.slots_per_gpu.max(1);
        EpRank(u16::try_from(rank).unwrap_or(u16::MAX))
    }

    /// The logical experts held by one EP rank in one layer (slot order); empty when the
    /// layer or rank is out of range.
    pub fn experts_on_rank(&self, layer: usize, rank: EpRank) -> &[ExpertId] {
        let start = rank.index() * self.slots_per_gpu;
        self.layers
            .get(layer)
            .and_then(|placement| placement.phy2log.get(start..start + self.slots_per_gpu))
            .unwrap_or(&[])
    }

    /// The distinct logical experts EP rank `rank` holds in `layer`, increasing: the weights
    /// its device holds for this placement (a replicated expert once).
    pub fn held_experts(&self, layer: usize, rank: EpRank) -> Vec<usize> {
        let mut held: Vec<usize> = self
            .experts_on_rank(layer, rank)
            .iter()
            .map(|e| e.index())
            .collect();
        held.sort_unstable();
        held.dedup();
        held
    }

    /// The `(layer, expert)` pairs EP rank `rank` holds under this placement and not under
    /// `next`, by layer then expert: what it releases when `next` is committed (and, read the
    /// other way, `next.released_by(self, rank)` is what it must upload before).
    pub fn released_by(&self, next: &ExpertPlacement, rank: EpRank) -> Vec<(usize, usize)> {
        (0..self.layers.len())
            .flat_map(|layer| {
                let kept = next.held_experts(layer, rank);
                self.held_experts(layer, rank)
                    .into_iter()
                    .filter(move |e| !kept.contains(e))
                    .map(move |e| (layer, e))
            })
            .collect()
    }

    /// Largest replica count of any expert in any layer (the `log2phy` padding width).
    pub fn max_replicas(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|layer| layer.log2phy.iter().map(Vec::len))
            .max()
            .unwrap_or(0)
    }

    /// Expected load of each GPU in each layer when an expert's load is split evenly over
    /// its replicas. `loads` must have this placement's layer and expert counts.
    pub fn gpu_loads(&self, loads: &[Vec<f64>]) -> Result<Vec<Vec<f64>>, PlacementError> {
        if loads.len() != self.layers.len() {
            return Err(PlacementError::RaggedLoads {
                layer: loads.len().min(self.layers.len()),
                expected: self.layers.len(),
                got: loads.len(),
            });
        }
        let mut per_layer = Vec::with_capacity(loads.len());
        for (layer, (placement, row)) in self.layers.iter().zip(loads).enumerate() {
            if row.len() != placement.log2phy.len() {
                return Err(PlacementError::RaggedLoads {
                    layer,
                    expected: placement.log2phy.len(),
                    got: row.len(),
                });
            }
            let gpus = placement.phy2log.len() / self.slots_per_gpu.max(1);
            let mut gpu_load = vec![0.0; gpus];
            for (slot, expert) in placement.phy2log.iter().enumerate() {
                let copies = placement.log2phy[expert.index()].len() as f64;
                gpu_load[slot / self.slots_per_gpu] += row[expert.index()] / copies;
            }
            per_layer.push(gpu_load);
        }
        Ok(per_layer)
    }

    /// Balancedness of each layer under `loads`: mean GPU load / busiest GPU load, in
    /// (0, 1] (1 = perfectly even; a layer without load counts as 1).
    pub fn balancedness(&self, loads: &[Vec<f64>]) -> Result<Vec<f64>, PlacementError> {
        Ok(self
            .gpu_loads(loads)?
            .iter()
            .map(|per_gpu| {
                let busiest = per_gpu.iter().copied().fold(0.0, f64::max);
                if busiest > 0.0 {
                    per_gpu.iter().sum::<f64>() / per_gpu.len() as f64 / busiest
                } else {
                    1.0
                }
            })
            .collect())
    }

    /// The `eplb-plan` JSON: `{"phy2log": [L][R], "log2phy": [L][E][max_replicas] padded
    /// with -1, "logcnt": [L][E]}`, as DeepSeek's `rebalance_experts` returns them.
    pub fn to_plan_json(&self) -> serde_json::Value {
        let width = self.max_replicas();
        let phy2log: Vec<Vec<u16>> = self
            .layers
            .iter()
            .map(|layer| layer.phy2log.iter().map(|e| e.get()).collect())
            .collect();
        let log2phy: Vec<Vec<Vec<i64>>> = self
            .layers
            .iter()
            .map(|layer| {
                layer
                    .log2phy
                    .iter()
                    .map(|slots| {
                        let mut padded: Vec<i64> = slots.iter().map(|&s| i64::from(s)).collect();
                        padded.resize(width, -1);
                        padded
                    })
                    .collect()
            })
            .collect();
        let logcnt: Vec<Vec<usize>> = self.layers.iter().map(LayerPlacement::logcnt).collect();
        serde_json::json!({ "phy2log": phy2log, "log2phy": log2phy, "logcnt": logcnt })
    }
}
