//! The state-pool workload shared by the CPU (`state_pool.rs`) and GPU (`gpu_engine.rs`) tests:
//! a workload whose states need several times a small pool (long prompts, seeded sampling, DSpark
//! verifying drafts, async scheduling) runs on an unlimited pool and on one that holds the
//! longest request and one block more; outputs equal, preemptions happened, and the bytes the
//! rank's live states really hold (summed after every step) never pass the budget.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deepinfer_actors::messages::scheduler::SchedulerStats;
use deepinfer_actors::rank::executor::{
    ExecError, ExecStep, ExecutorFactory, ExecutorLayer, LayeredFactory, RankExecutor,
};
use deepinfer_actors::{Engine, EngineConfig, ModelFacts};
use deepinfer_model::EntryOutput;
use deepinfer_tests::confident::Confident;
use deepinfer_topology::NodeConfig;

use crate::engine_support::generate_all;

/// Emulated device time per step: makes verifying drafts worth it to the DSpark planner.
const EMULATED_STEP: Duration = Duration::from_millis(20);

/// Records the most bytes the inner executor's live states held after any step.
pub struct Measured {
    peak: Arc<AtomicU64>,
}

impl ExecutorLayer for Measured {
    fn execute(
        &mut self,
        inner: &mut dyn RankExecutor,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        let outputs = inner.execute(ExecStep { batch, sampling })?;
        let held = inner.state_bytes_held().expect("a model executor");
        self.peak.fetch_max(held, Ordering::Relaxed);
        Ok(outputs)
    }
}

/// One DP rank on `device` (a `[device]` table's lines) with a state budget of `state_bytes`.
pub fn node(device: &str, state_bytes: u64) -> NodeConfig {
    let text = format!(
        "[model]\nsource = \"demo\"\n[device]\n{device}\n\
         [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 8\nprefill_chunk_tokens = 32\n\
         overlap_depth = 2\nadmission_queue_capacity = 16\n\
         [dspark]\nenabled = true\nmax_draft_tokens = 5\nprofile_steps = 1\n\
         [memory]\nstate_bytes_per_rank = {state_bytes}\n"
    );
    NodeConfig::from_toml_str(&text, "state pool test").expect("topology")
}

/// Outputs (seeded sampling, temperature 1), the scheduler's stats and the peak of the live
/// states' bytes.
async fn run(
    device: &str,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
    state_bytes: u64,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, SchedulerStats, u64) {
    let peak = Arc::new(AtomicU64::new(0));
    let measured = peak.clone();
    let measured = LayeredFactory::layered(factory, "measured", move |_| Measured {
        peak: measured.clone(),
    });
    // Drafts reported with the highest confidence, on an emulated device.
    let executor: Arc<dyn ExecutorFactory> =
        Arc::new(Confident::factory(Arc::new(measured), EMULATED_STEP));
    let engine = Engine::start(EngineConfig {
        node: node(device, state_bytes),
        executor,
        model: facts,
        tokenizer: None,
    })
    .await
    .expect("engine starts");
    let outputs = generate_all(
        &engine,
        prompts,
        max_tokens,
        (1.0, 9),
        Duration::from_secs(600),
    )
    .await;
    let stats = engine.handle().scheduler_stats().await.expect("stats")[0];
    let replay = engine
        .handle()
        .replay_stats()
        .await
        .expect("replay stats")
        .expect("bounded replay is on");
    assert_eq!(
        (replay.refused, replay.live),
        (0, 0),
        "the ReplayActor followed every request through its preemptions: {replay:?}"
    );
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shuts down");
    (outputs, stats, peak.load(Ordering::Relaxed))
}

/// Runs the workload on an unlimited pool and on one that holds the longest request and one
/// block more; asserts equal outputs, preemptions, and the budget.
pub async fn check(
    name: &str,
    device: &str,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) {
    let model = factory.state_bytes().expect("a byte model");
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_tokens;
    let blocks = model.blocks_for(longest) + 1;
    let budget = blocks as u64 * model.block_bytes();
    let total: u64 = prompts
        .iter()
        .map(|p| model.bytes(p.len() + max_tokens))
        .sum();
    assert!(total > 2 * budget, "{name}: the workload needs preemption");
    let (free, free_stats, free_peak) =
        run(device, factory.clone(), facts, 1 << 40, prompts, max_tokens).await;
    let (small, stats, peak) = run(device, factory, facts, budget, prompts, max_tokens).await;
    println!(
        "{name}: states of {total} bytes in a {budget}-byte pool ({blocks} blocks of {} bytes, \
         {} tokens): {} preemptions, {} resumed, peak {peak} bytes (unlimited: peak {free_peak}, \
         {} preemptions); drafts verified {}, accepted {}",
        model.block_bytes(),
        model.block_tokens,
        stats.preemptions,
        stats.resumed,
        free_stats.preemptions,
        stats.draft_tokens_verified,
        stats.draft_tokens_accepted,
    );
    for out in &free {
        assert_eq!(out.len(), max_tokens);
    }
    assert_eq!(small, free, "{name}: outputs with preemption vs unlimited");
    assert_eq!(free_stats.preemptions, 0);
    assert!(stats.preemptions > 0, "{name}: the small pool preempted");
    assert_eq!(
        stats.resumed, stats.preemptions,
        "{name}: every preempted request resumed"
    );
    assert!(
        peak <= budget,
        "{name}: {peak} bytes held, over the {budget}-byte budget"
    );
    assert!(
        free_peak > budget,
        "{name}: unlimited, the states pass the small budget"
    );
    assert!(
        stats.draft_tokens_verified > 0,
        "{name}: DSpark verified drafts"
    );
}

/// `count` prompts of `base`, `base + 9`, ... tokens.
pub fn prompts(count: u32, vocab: u32, base: usize) -> Vec<Vec<u32>> {
    (0..count)
        .map(|r| {
            let len = base + 9 * r as usize;
            (0..len as u32)
                .map(|i| (i * 31 + r * 7 + 3) % vocab)
                .collect()
        })
        .collect()
}
