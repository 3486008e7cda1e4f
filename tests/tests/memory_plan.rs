//! `deepinfer-node memory-plan` for the released V4.1-Flash and V4-Flash configs on the shipped
//! SM100 ×64 and H200 ×8 topologies: its arithmetic checked against the checkpoint inventory and
//! against the bytes per token derived by hand from the config (one compressed-KV entry and one
//! index key per group of every KV source), and the README's copy of the V4.1 plans kept equal
//! to the tool's output.

use std::path::{Path, PathBuf};

use deepinfer_actors::tools::memory_plan::{self, MemoryPlan, default_gpu_memory};
use deepinfer_model::checkpoint::inventory_for;
use deepinfer_model::config::{ModelConfig, ModelFamily, V4Attention};
use deepinfer_topology::{Backend, NodeConfig};

const CONTEXTS: [usize; 3] = [8192, 32768, 131072];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn config(name: &str) -> ModelConfig {
    ModelConfig::from_file(&root().join("tests/data").join(name)).expect("released config")
}

fn plan(topology: &str, cfg: &ModelConfig) -> (NodeConfig, MemoryPlan) {
    let node = NodeConfig::from_file(root().join("configs").join(topology)).expect("topology");
    let plan = memory_plan::plan(&node, cfg, None, &CONTEXTS, || {
        Err("a GPU topology needs no host budget".to_string())
    })
    .expect("plan");
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

fn check(topology: &str, config_name: &str) -> MemoryPlan {
    let cfg = config(config_name);
    let (node, plan) = plan(topology, &cfg);
    // Weights: every inventory tensor; routed experts split over the EP ranks' slots, Engram
    // tables over the EP ranks.
    let inventory = inventory_for(&cfg);
    let sum = |keep: &dyn Fn(&str) -> bool| -> u64 {
        inventory
            .iter()
            .filter(|t| keep(&t.name))
            .map(|t| t.stored_bytes() as u64)
            .sum()
    };
    let all = sum(&|_| true);
    let experts = sum(&|name| name.contains(".ffn.experts."));
    let engram = sum(&|name| name.contains(".engram."));
    let replicated = sum(&|name| !name.contains(".ffn.experts.") && !name.contains(".engram."));
    assert_eq!(replicated + experts + engram, all);
    let slots = cfg.n_routed_experts as u64 + u64::from(node.eplb.redundant_experts);
    let ep = u64::from(node.parallel.ep);
    let per_gpu = replicated
        + (experts * slots).div_ceil(cfg.n_routed_experts as u64 * ep)
        + engram.div_ceil(ep);
    assert_eq!((plan.weights_bytes, plan.weights_per_gpu), (all, per_gpu));
    // The state: bytes per token by hand; the budget and the blocks from the GPU.
    let by_hand = bytes_per_token_by_hand(&cfg);
    assert!(
        (plan.bytes.bytes_per_token() - by_hand).abs() < 1e-6,
        "{config_name}: {} bytes per token vs {by_hand} by hand",
        plan.bytes.bytes_per_token()
    );
    let Backend::Cuda { arch, .. } = node.device.backend else {
        panic!("a GPU topology")
    };
    let budget = ((default_gpu_memory(arch) - per_gpu) as f64 * 0.9) as u64;
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
        let v41 = check(topology, "deepseek-v4.1-flash.config.json");
        // V4.1-Flash holds a 1M-token context on one rank of either topology.
        assert!(v41.longest_context >= v41.max_position, "{v41}");
        let text = v41
            .to_string()
            .replace(&v41.origin, &format!("configs/{topology}"));
        assert!(
            readme.contains(&text),
            "README lacks the memory plan of V4.1-Flash on {topology}:\n{text}"
        );
        check(topology, "deepseek-v4-flash.config.json");
    }
}
