//! Shared by the expert-parallel tests: a small random V4.1 model (4 of 8 experts per token, so
//! the combine order matters), the V4 family's v4-tiny fixture (`tests/fixtures/v4/v4-tiny`: its
//! first three layers hash-routed by token id, 2 of 8 experts per token) and a random tiny V4
//! with 4 of 8 active, a node topology, an observed executor factory that keeps every logits row
//! by (request, position), and a driver that runs a fixed set of requests (and checks the
//! `ReplayActor`'s lengths against the ranks' at the end).

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::rank::executor::ExecutorFactory;
use deepinfer_actors::rank::observe::{ObservedFactory, RowLog};
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest, ModelFacts};
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::{Model, v4};
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::{NodeConfig, RequestId};

/// The tiny V4.1 architecture without Engram, 4 of its 8 experts active per token.
pub fn model() -> (tempfile::TempDir, Arc<Model>) {
    let mut cfg = ModelConfig::tiny_v41();
    cfg.engram = None;
    cfg.n_activated_experts = 4;
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 5, dir.path(), 1).expect("random checkpoint");
    let model = Model::load(dir.path()).expect("model loads");
    (dir, Arc::new(model))
}

/// The v4-tiny fixture (a missing one fails).
pub fn v4_tiny() -> Arc<v4::Model> {
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    Arc::new(v4::Model::load(&dir).expect("the v4-tiny fixture loads"))
}

/// A random tiny V4 (the v4-tiny architecture) with 4 of its 8 experts active per token, the
/// hash layers' `tid2eid` as wide: with more than two picks the combine order matters.
pub fn v4_four_of_eight() -> (tempfile::TempDir, Arc<v4::Model>) {
    let mut cfg = ModelConfig::tiny_v4();
    cfg.n_activated_experts = 4;
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 6, dir.path(), 1).expect("random V4 checkpoint");
    let model = v4::Model::load(dir.path()).expect("V4 model loads");
    (dir, Arc::new(model))
}

pub fn facts(model: &Model) -> ModelFacts {
    facts_of(model.config())
}

/// The facts of a model of either family with config `cfg`.
pub fn facts_of(cfg: &ModelConfig) -> ModelFacts {
    ModelFacts {
        vocab_size: cfg.vocab_size,
        bos_token_id: cfg.bos_token_id,
        eos_token_id: Some(cfg.eos_token_id),
        max_context_tokens: cfg.max_position_embeddings,
    }
}

/// A CPU topology with `dp` / `ep` ranks and the given `[eplb]` body.
pub fn node(dp: u16, ep: u16, eplb: &str) -> NodeConfig {
    topology(dp, ep, &format!("[eplb]\n{eplb}\n"))
}

/// `node(dp, ep, "")` with DSpark on: 5 drafts at most, one timed step per profiled batch size
/// (1, 2, 4, 8, 16 and 24 tokens: 4 running requests verifying 5 drafts each).
pub fn dspark_node(dp: u16, ep: u16) -> NodeConfig {
    topology(
        dp,
        ep,
        "[dspark]\nenabled = true\nmax_draft_tokens = 5\nprofile_steps = 1\n",
    )
}

/// A CPU topology with `dp` / `ep` ranks and the given tables.
fn topology(dp: u16, ep: u16, tables: &str) -> NodeConfig {
    NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = {dp}\nep = {ep}\n\
             [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 5\n\
             overlap_depth = 2\nadmission_queue_capacity = 32\n{tables}"
        ),
        "ep test",
    )
    .expect("topology")
}

/// Prompts whose routing is skewed: few distinct tokens, repeated.
pub fn skewed_prompts(count: usize) -> Vec<Vec<u32>> {
    (0..count)
        .map(|i| {
            let base = 40 + (i % 3) as u32;
            (0..9 + i % 4)
                .map(|k| if k % 3 == 0 { base } else { 7 })
                .collect()
        })
        .collect()
}

/// Runs `prompts` (each `max_tokens` long at most) on a started engine, all in flight at once;
/// returns the generated tokens by request id, in submission order.
pub async fn run_requests(
    engine: &Engine,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> BTreeMap<RequestId, Vec<u32>> {
    let mut streams = Vec::new();
    for prompt in prompts {
        streams.push(
            engine
                .generate(GenerateRequest::from_tokens(prompt.clone()).max_tokens(max_tokens))
                .await
                .expect("admitted"),
        );
    }
    let mut out = BTreeMap::new();
    for stream in streams {
        let done = tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("finishes in time")
            .expect("completes");
        out.insert(done.id, done.tokens);
    }
    out
}

/// Starts an engine over `factory` that keeps every row its ranks return and tracks the lengths
/// the `ReplayActor` frees (check them with `FreedLengths::shutdown_and_check_replay`).
pub async fn start_engine(
    node: NodeConfig,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
) -> (Engine, Arc<RowLog>, Arc<FreedLengths>) {
    let rows = Arc::new(RowLog::new());
    let (executor, freed) =
        FreedLengths::track(Arc::new(ObservedFactory::new(factory, rows.clone())));
    let config = EngineConfig {
        node,
        executor,
        model: facts,
        tokenizer: None,
    };
    let engine = Engine::start(config).await.expect("engine starts");
    (engine, rows, freed)
}

/// Starts an engine over `factory`, runs `prompts`, shuts it down (checking the `ReplayActor`'s
/// lengths when the model runs bounded replay); returns the tokens and rows.
pub async fn run_engine(
    node: NodeConfig,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (
    BTreeMap<RequestId, Vec<u32>>,
    HashMap<(RequestId, usize), Vec<f32>>,
) {
    let replays = factory.sliding_window().is_some();
    let (engine, rows, freed) = start_engine(node, factory, facts).await;
    let tokens = run_requests(&engine, prompts, max_tokens).await;
    shut_down(engine, &freed, replays).await;
    let rows = rows.snapshot();
    (tokens, rows)
}

/// Shuts `engine` down; when its model runs bounded replay (`replays`: V4.1; a V4-family model
/// has none, so no `ReplayActor`), checks the `ReplayActor`'s lengths against the ranks'.
pub async fn shut_down(engine: Engine, freed: &FreedLengths, replays: bool) {
    if replays {
        freed.shutdown_and_check_replay(engine).await;
    } else {
        engine
            .shutdown(Duration::from_secs(30))
            .await
            .expect("shuts down");
    }
}

/// Bit patterns of a row (so equality is bitwise, NaN included).
pub fn bits(row: &[f32]) -> Vec<u32> {
    row.iter().map(|v| v.to_bits()).collect()
}
