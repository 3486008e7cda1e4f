//! `deepinfer-node memory-plan` for the released V4.1-Flash and V4-Flash configs on the shipped
//! SM100 ×64 and H200 ×8 topologies: its arithmetic checked against the checkpoint inventory and
//! against the bytes per token derived by hand from the config (one compressed-KV entry and one
//! index key per group of every KV source), and the README's copy of the V4-Flash plans kept
//! equal to the tool's output. V4.1-Flash fits neither: the engine holds its Engram tables
//! (188.8 GiB) whole on every GPU, and the plan says so, naming the numbers.

use std::path::{Path, PathBuf};

use deepinfer_actors::tools::memory_plan::{self, MemoryPlan, default_gpu_memory};
use deepinfer_model::checkpoint::inventory_for;
use deepinfer_model::config::{ModelConfig, ModelFamily, V4Attention};
use deepinfer_model::memory_plan::WORKSPACE_BYTES;
use deepinfer_topology::{Backend, NodeConfig};

const CONTEXTS: [usize; 3] = [8192, 32768, 131072];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn config(name: &str) -> ModelConfig {
    ModelConfig::from_file(&root().join("tests/data").join(name)).expect("released config")
}

fn plan(topology: &str, cfg: &ModelConfig) -> (NodeConfig, Result<MemoryPlan, String>) {
    let node = NodeConfig::from_file(root().join("configs").join(topology)).expect("topology");
    let plan = memory_plan::plan(&node, cfg, None, &CONTEXTS, || {
        Err("a GPU topology needs no host budget".to_string())
    });
    (node, plan)
}

/// State bytes per token from the config alone (f32 entries).
fn bytes_per_token_by_hand(cfg: &ModelConfig) -> f64 {
    let entry = |width: usize, ratio: usize| (width * 4) as f64 / ratio as f64;
    let (hd, ihd) = (cfg.head_dim, cfg.index_head_dim);
    let layers = 0..cfg.n_layers;
    let engram = if cfg.engram.is_some() { 8.0 } else { 0.0 };
    match cfg.family {
        ModelFamily::V41 => {
            let sources = layers.filter(|&l| cfg.is_kv_source(l) && cfg.compress_ratio(l) > 0);
            sources
                .map(|l| entry(hd + ihd, cfg.compress_ratio(l)))
                .sum::<f64>()
                + engram
        }
        ModelFamily::V4 => layers
            .map(|l| match cfg.v4_attention(l) {
                Some(V4Attention::Csa) => entry(hd + ihd, cfg.compress_ratio(l)),
                Some(V4Attention::Hca) => entry(hd, cfg.compress_ratio(l)),
                _ => 0.0,
            })
            .sum(),
    }
}

/// The weights on one GPU of `node` by hand from the inventory: dense weights, the routed
/// experts of one EP rank's slots, the Engram tables whole (one rank per GPU in the shipped
/// topologies).
fn weights_per_gpu_by_hand(node: &NodeConfig, cfg: &ModelConfig) -> (u64, u64, u64) {
    let inventory = inventory_for(cfg);
    let sum = |keep: &dyn Fn(&str) -> bool| -> u64 {
        inventory
            .iter()
            .filter(|t| keep(&t.name))
            .map(|t| t.stored_bytes() as u64)
            .sum()
    };
    let backbone_expert =
        |name: &str| name.starts_with("layers.") && name.contains(".ffn.experts.");
    let all = sum(&|_| true);
    let experts = sum(&backbone_expert);
    let engram = sum(&|name| name.ends_with(".engram.embed"));
    let dense = sum(&|name| !backbone_expert(name) && !name.ends_with(".engram.embed"));
    assert_eq!(dense + experts + engram, all);
    assert_eq!(
        node.parallel.dp,
        node.device.nodes * node.device.gpus_per_node
    );
    let slots = cfg.n_routed_experts as u64 + u64::from(node.eplb.redundant_experts);
    let ep = u64::from(node.parallel.ep);
    (
        all,
        dense + experts * slots / (cfg.n_routed_experts as u64 * ep),
        engram,
    )
}

fn check(topology: &str, config_name: &str) -> MemoryPlan {
    let cfg = config(config_name);
    let (node, plan) = plan(topology, &cfg);
    let plan = plan.expect("the plan fits");
    let (all, per_gpu, engram) = weights_per_gpu_by_hand(&node, &cfg);
    let gpu = plan.gpu.expect("a GPU plan");
    assert_eq!(
        (plan.weights.total(), gpu.weights(), gpu.engram),
        (all, per_gpu + engram, engram)
    );
    let Backend::Cuda { arch, .. } = node.device.backend else {
        panic!("a GPU topology")
    };
    assert_eq!(
        gpu.kv_budget,
        default_gpu_memory(arch) - per_gpu - engram - WORKSPACE_BYTES
    );
    // The state: bytes per token by hand; the budget and the blocks from the GPU.
    let by_hand = bytes_per_token_by_hand(&cfg);
    assert!(
        (plan.bytes.bytes_per_token() - by_hand).abs() < 1e-6,
        "{config_name}: {} bytes per token vs {by_hand} by hand",
        plan.bytes.bytes_per_token()
    );
    let budget = (gpu.kv_budget as f64 * 0.9 / gpu.ranks as f64) as u64;
    assert_eq!(plan.state_budget, budget);
    let blocks = (budget / plan.bytes.block_bytes()) as usize;
    assert_eq!(plan.blocks, blocks);
    let tokens = (blocks - plan.bytes.ring_blocks()) * plan.bytes.block_tokens;
    assert_eq!(plan.longest_context, tokens);
    // The longest context's cache bytes fit the budget; one more block of tokens would not.
    assert!(plan.bytes.bytes(tokens) <= budget);
    assert!(
        (plan.bytes.blocks_for(tokens + plan.bytes.block_tokens)) as u64 * plan.bytes.block_bytes()
            > budget
    );
    for &(len, n) in &plan.concurrent {
        assert_eq!(n, blocks / plan.bytes.blocks_for(len));
        assert!(n as u64 * plan.bytes.bytes(len) <= budget);
    }
    println!("{plan}");
    plan
}

#[test]
fn memory_plans_of_the_released_configs_follow_the_inventory() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README");
    for topology in ["sm100x64.toml", "h200x8.toml"] {
        let v4 = check(topology, "deepseek-v4-flash.config.json");
        // V4-Flash holds a 1M-token context on one rank of either topology.
        assert!(v4.longest_context >= v4.max_position, "{v4}");
        let text = v4
            .to_string()
            .replace(&v4.origin, &format!("configs/{topology}"));
        assert!(
            readme.contains(&text),
            "README lacks the memory plan of V4-Flash on {topology}:\n{text}"
        );
        // V4.1-Flash: its Engram tables alone exceed an H200, and with the rest a B200.
        let cfg = config("deepseek-v4.1-flash.config.json");
        let (node, plan) = plan(topology, &cfg);
        let err = plan.expect_err("V4.1-Flash with its Engram tables whole on every GPU");
        let (_, per_gpu, engram) = weights_per_gpu_by_hand(&node, &cfg);
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
        for part in [
            "does not fit".to_string(),
            format!("Engram {} (whole per GPU)", gib(engram)),
            format!("= {}", gib(per_gpu + engram + WORKSPACE_BYTES)),
        ] {
            assert!(err.contains(&part), "{topology}: {part}: {err}");
        }
        println!("V4.1-Flash on {topology}: {err}");
        assert!(
            readme.contains(&format!("configs/{topology}: {err}")),
            "README lacks V4.1-Flash's refusal on {topology}:\n{err}"
        );
    }
}
