//! The per-rank state pool on the real V4.1 model (CPU backend), on DeepSeek's v41-tiny fixture
//! and on the built-in demo model: a workload whose states need several times a small pool
//! (long prompts, seeded sampling, DSpark verifying drafts, async scheduling) completes with
//! preemptions, every output bitwise equal to the same workload on an unlimited pool, and the
//! bytes the rank's live states really hold (summed after every step) never pass the budget
//! (`pool_support`; the same workload on the H200 is in `gpu_engine.rs`). With
//! `[memory] state_memory_fraction` each rank's pool is its share of the memory its states live
//! in: the host's, or (ranks reporting a device, here with fake figures) its device's free
//! memory split among the ranks on it.

use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::model_source::build_demo;
use deepinfer_actors::rank::executor::{
    ExecError, ExecutorFactory, ExecutorLayer, LayeredFactory, RankExecutor,
};
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::rank::memory::StateMemory;
use deepinfer_actors::tools::logits;
use deepinfer_actors::{Engine, EngineConfig, EngineError, ModelFacts};
use deepinfer_model::Model;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::state_bytes::StateBytes;
use deepinfer_topology::NodeConfig;

mod engine_support;
mod pool_support;
use pool_support::{check, prompts};

const CPU: &str = "backend = \"cpu\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_is_exact_and_bounded_on_the_fixture() {
    let dir = deepinfer_tests::fixture_dir("v41/v41-tiny");
    let cfg = ModelConfig::from_file(&dir.join("config.json"))
        .unwrap_or_else(|e| panic!("the v41-tiny fixture is required: {e}"));
    let vocab = logits::engram_vocab_for_dir(&dir, &cfg).expect("stub vocabulary");
    let model = Arc::new(Model::load_with_vocab(&dir, vocab).expect("fixture loads"));
    let facts = ModelFacts {
        vocab_size: cfg.vocab_size,
        bos_token_id: cfg.bos_token_id,
        eos_token_id: Some(cfg.eos_token_id),
        max_context_tokens: cfg.max_position_embeddings,
    };
    let factory: Arc<dyn ExecutorFactory> = Arc::new(ModelFactory::new(model, "v41-tiny fixture"));
    // Prompts of 130..=157 tokens: the longer ones run bounded replay (keep 140) too.
    let prompts = prompts(4, cfg.vocab_size as u32, 130);
    check("v41-tiny", CPU, factory, facts, &prompts, 24).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_is_exact_and_bounded_on_the_demo_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = build_demo(dir.path()).expect("demo model");
    let prompts = prompts(4, 50_000, 90);
    check("demo", CPU, demo.factory, demo.facts, &prompts, 16).await;
}

/// Rank `dp` on device `dp % 2` with `free[dp % 2]` bytes free (a fake device reading over the
/// CPU executor's, which is the host).
struct FakeDevice {
    dp: usize,
    free: [u64; 2],
}

impl ExecutorLayer for FakeDevice {
    fn state_memory(&mut self, inner: &mut dyn RankExecutor) -> Result<StateMemory, ExecError> {
        assert_eq!(inner.state_memory()?, StateMemory::Host, "a CPU executor");
        let device = self.dp % 2;
        Ok(StateMemory::Device {
            device,
            free_bytes: self.free[device],
        })
    }
}

/// A small random V4.1 model (no Engram) and its facts.
fn tiny() -> (tempfile::TempDir, Arc<Model>, ModelFacts) {
    let mut cfg = ModelConfig::tiny_v41();
    cfg.engram = None;
    let dir = tempfile::tempdir().expect("tempdir");
    deepinfer_model::checkpoint::write_random_checkpoint(&cfg, 9, dir.path(), 1)
        .expect("random checkpoint");
    let model = Arc::new(Model::load(dir.path()).expect("model loads"));
    let facts = ModelFacts::of(model.config());
    (dir, model, facts)
}

/// `dp` CPU ranks with `memory` as the `[memory]` table's lines.
fn fraction_node(dp: usize, memory: &str) -> NodeConfig {
    let text = format!(
        "[model]\nsource = \"demo\"\n[device]\n{CPU}\n[parallel]\ndp = {dp}\n\
         [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 32\n\
         overlap_depth = 1\nadmission_queue_capacity = 8\n[memory]\n{memory}\n"
    );
    NodeConfig::from_toml_str(&text, "state fraction test").expect("topology")
}

async fn start(node: NodeConfig, executor: Arc<dyn ExecutorFactory>, facts: ModelFacts) -> Engine {
    Engine::start(EngineConfig {
        node,
        executor,
        model: facts,
        tokenizer: None,
    })
    .await
    .expect("engine starts")
}

/// `state_memory_fraction` on ranks that report a device: each rank's pool is the fraction of
/// its device's free memory split among the ranks on it (two fake devices with different free
/// memory, two ranks on one), the engine serves on it; a fraction that leaves less than one
/// sequence is refused naming the field and the numbers. On the host (the CPU ranks' own
/// reading) every rank gets the same share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fraction_of_each_ranks_memory_sizes_its_pool() {
    let (_dir, model, facts) = tiny();
    let bytes = StateBytes::of(model.config());
    let block = bytes.block_bytes();
    let plain: Arc<dyn ExecutorFactory> = Arc::new(ModelFactory::new(model, "tiny"));
    let on_devices = |free: [u64; 2]| -> Arc<dyn ExecutorFactory> {
        Arc::new(LayeredFactory::layered(
            plain.clone(),
            "fake devices",
            move |dp| FakeDevice { dp, free },
        ))
    };
    // Device 0 (ranks 0, 2): 0.5 * 400 blocks / 2; device 1 (rank 1): 0.5 * 300 blocks.
    let node = fraction_node(3, "state_memory_fraction = 0.5");
    let engine = start(node.clone(), on_devices([400 * block, 300 * block]), facts).await;
    let stats = engine.handle().scheduler_stats().await.expect("stats");
    let blocks: Vec<usize> = stats.iter().map(|s| s.state_blocks_total).collect();
    assert_eq!(blocks, vec![100, 150, 100]);
    let prompts = prompts(3, facts.vocab_size as u32, 40);
    let outputs =
        engine_support::generate_all(&engine, &prompts, 8, (0.0, 1), Duration::from_secs(300))
            .await;
    assert!(outputs.iter().all(|o| o.len() == 8), "{outputs:?}");
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shuts down");

    let short = (bytes.ring_blocks() as u64 + 1) * block;
    let config = EngineConfig {
        node,
        executor: on_devices([400 * block, short]),
        model: facts,
        tokenizer: None,
    };
    let error = Engine::start(config).await.expect_err("refused");
    let text = error.to_string();
    assert!(
        matches!(&error, EngineError::Config { field, .. } if field == "memory.state_memory_fraction"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "0.5 of the {short} bytes free on device 1 over the 1 ranks"
        )),
        "{text}"
    );

    let host = start(
        fraction_node(2, "state_memory_fraction = 0.01"),
        plain,
        facts,
    )
    .await;
    let stats = host.handle().scheduler_stats().await.expect("stats");
    assert!(stats[0].state_blocks_total > 0, "{stats:?}");
    assert_eq!(stats[0].state_blocks_total, stats[1].state_blocks_total);
    host.shutdown(Duration::from_secs(30))
        .await
        .expect("shuts down");
}
