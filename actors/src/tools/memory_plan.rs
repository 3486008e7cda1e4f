//! `deepinfer-node memory-plan`: how a checkpoint's sequence states fit a topology, without a
//! GPU. From the model's `config.json` and the topology: the state bytes per token and per
//! sequence by layer kind (`deepinfer_model::state_bytes`), the weights per GPU as the engine
//! places them (`deepinfer_model::memory_plan`, the computation the engine's start-up check
//! uses: dense weights on every DP rank, the routed experts of its EP rank's slots, the Engram
//! tables whole on every rank, the workspace), each rank's state budget (`[memory]` bytes, or
//! its fraction of the GPU's KV budget), the pool's blocks, the longest context one sequence
//! may reach and how many sequences of a given length fit at once. A topology whose weights do
//! not fit its GPUs is an error naming the numbers.

use std::fmt;

use deepinfer_model::config::ModelConfig;
use deepinfer_model::memory_plan::{GpuMemoryPlan, WeightSplit, plan_node};
use deepinfer_model::state_bytes::StateBytes;
use deepinfer_topology::{Arch, Backend, MemoryConfig, NodeConfig};

const GIB: f64 = (1u64 << 30) as f64;

/// Memory of one GPU of `arch` when the caller gives none: an H200 (sm90, 140 GiB as the device
/// reports it) or a B200 (sm100, 179 GiB).
pub fn default_gpu_memory(arch: Arch) -> u64 {
    match arch {
        Arch::Sm90 => 140 << 30,
        Arch::Sm100 => 179 << 30,
    }
}

/// One layer kind's share of a sequence's state.
#[derive(Debug, Clone, PartialEq)]
pub struct KindRow {
    pub kind: String,
    /// Bytes per token of its append-only caches (once the rings are full).
    pub bytes_per_token: f64,
    /// Bytes of its bounded rings (whatever the length).
    pub ring_bytes: u64,
}

/// The plan ([module docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub origin: String,
    pub kinds: Vec<KindRow>,
    pub bytes: StateBytes,
    /// Checkpoint bytes by placement: dense, the backbone's routed experts, Engram tables.
    pub weights: WeightSplit,
    /// The busiest GPU's plan (`None` on the CPU backend).
    pub gpu: Option<GpuMemoryPlan>,
    /// Each DP rank's state budget.
    pub state_budget: u64,
    pub blocks: usize,
    /// Longest context of one sequence alone in a rank's pool (the model's
    /// `max_position_embeddings` is reported beside it).
    pub longest_context: usize,
    pub max_position: usize,
    /// `(context, sequences of that length that fit in one rank's pool at once)`.
    pub concurrent: Vec<(usize, usize)>,
}

/// Plans `cfg` on `node`; `gpu_memory` overrides [`default_gpu_memory`]; `host_budget` is the
/// state budget of a CPU rank with a memory fraction (the host's available memory share).
pub fn plan(
    node: &NodeConfig,
    cfg: &ModelConfig,
    gpu_memory: Option<u64>,
    contexts: &[usize],
    host_budget: impl FnOnce() -> Result<u64, String>,
) -> Result<MemoryPlan, String> {
    let bytes = StateBytes::of(cfg);
    let mut kinds: Vec<KindRow> = Vec::new();
    for part in &bytes.parts {
        let row = match kinds.iter_mut().find(|k| k.kind == part.kind) {
            Some(row) => row,
            None => {
                kinds.push(KindRow {
                    kind: part.kind.clone(),
                    bytes_per_token: 0.0,
                    ring_bytes: 0,
                });
                kinds.last_mut().expect("pushed")
            }
        };
        row.bytes_per_token += part.bytes_per_token();
        row.ring_bytes += part.ring_bytes();
    }
    let weights = WeightSplit::of(cfg);
    let gpu = match node.device.backend {
        Backend::Cpu => None,
        Backend::Cuda { arch, .. } => {
            let memory = gpu_memory.unwrap_or_else(|| default_gpu_memory(arch));
            Some(plan_node(node, cfg, memory).map_err(|e| e.to_string())?)
        }
    };
    let state_budget = match (node.memory, gpu) {
        (MemoryConfig::StateBytes(budget), _) => budget,
        // As the engine cuts it (`scheduler::pool::rank_budgets`): split over the GPU's ranks.
        (MemoryConfig::Fraction(fraction), Some(gpu)) => {
            (gpu.kv_budget as f64 * fraction / gpu.ranks.max(1) as f64) as u64
        }
        (MemoryConfig::Fraction(_), None) => host_budget()?,
    };
    let blocks = (state_budget / bytes.block_bytes()) as usize;
    let longest_context = blocks.saturating_sub(bytes.ring_blocks()) * bytes.block_tokens;
    let concurrent = contexts
        .iter()
        .map(|&len| (len, blocks / bytes.blocks_for(len).max(1)))
        .collect();
    Ok(MemoryPlan {
        origin: node.origin.clone(),
        kinds,
        weights,
        gpu,
        state_budget,
        blocks,
        longest_context,
        max_position: cfg.max_position_embeddings,
        concurrent,
        bytes,
    })
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| b as f64 / GIB;
        writeln!(f, "memory plan for {}", self.origin)?;
        writeln!(f, "state per sequence (f32 rows), by layer kind:")?;
        writeln!(
            f,
            "  {:<22} {:>14} {:>14}",
            "kind", "bytes/token", "ring bytes"
        )?;
        for k in &self.kinds {
            writeln!(
                f,
                "  {:<22} {:>14.1} {:>14}",
                k.kind, k.bytes_per_token, k.ring_bytes
            )?;
        }
        writeln!(
            f,
            "  {:<22} {:>14.1} {:>14}",
            "total",
            self.bytes.bytes_per_token(),
            self.bytes.ring_bytes()
        )?;
        writeln!(
            f,
            "blocks: {} tokens, {} bytes; a sequence's rings take {} blocks",
            self.bytes.block_tokens,
            self.bytes.block_bytes(),
            self.bytes.ring_blocks()
        )?;
        writeln!(
            f,
            "weights: {:.2} GiB in the checkpoint ({:.2} GiB routed experts, {:.2} GiB Engram \
             tables)",
            gib(self.weights.total()),
            gib(self.weights.routed),
            gib(self.weights.engram)
        )?;
        if let Some(gpu) = &self.gpu {
            writeln!(f, "{gpu}")?;
        }
        writeln!(
            f,
            "state budget per DP rank: {:.2} GiB = {} blocks",
            gib(self.state_budget),
            self.blocks
        )?;
        writeln!(
            f,
            "longest context of one sequence: {} tokens (the model's limit: {})",
            self.longest_context, self.max_position
        )?;
        for (len, n) in &self.concurrent {
            writeln!(f, "sequences of {len} tokens at once per DP rank: {n}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_without_room_for_the_weights_is_an_error() {
        let node = NodeConfig::from_toml_str(
            "[device]\nbackend = \"cuda\"\ngpus_per_node = 1\n[parallel]\ndp = 1\nep = 1\n",
            "one gpu",
        )
        .unwrap();
        let cfg = ModelConfig::tiny_v41();
        let err = plan(&node, &cfg, Some(1), &[], || Ok(0)).unwrap_err();
        assert!(err.contains("does not fit a GPU of 0.00 GiB"), "{err}");
    }
}
