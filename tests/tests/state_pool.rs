//! The per-rank state pool on the real V4.1 model (CPU backend), on DeepSeek's v41-tiny fixture
//! and on the built-in demo model: a workload whose states need several times a small pool
//! (long prompts, seeded sampling, DSpark verifying drafts, async scheduling) completes with
//! preemptions, every output bitwise equal to the same workload on an unlimited pool, and the
//! bytes the rank's live states really hold (summed after every step) never pass the budget
//! (`pool_support`; the same workload on the H200 is in `gpu_engine.rs`).

use std::sync::Arc;

use deepinfer_actors::ModelFacts;
use deepinfer_actors::model_source::build_demo;
use deepinfer_actors::rank::executor::ExecutorFactory;
use deepinfer_actors::rank::model_executor::ModelFactory;
use deepinfer_actors::tools::logits;
use deepinfer_model::Model;
use deepinfer_model::config::ModelConfig;

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
    let factory: Arc<dyn ExecutorFactory> = Arc::new(ModelFactory {
        model,
        description: "v41-tiny fixture".into(),
    });
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
