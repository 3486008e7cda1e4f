//! The prefix cache in the engine (`[prefix_cache]`): the same requests through an engine with
//! the cache off and on, on the v41-tiny fixture, the demo model and the v4-tiny fixture.
//!
//! The rule (`actors/src/prefix_cache.rs`): with `replay = "exact"` (or a bounded replay that
//! covers the model's exact halo, the demo at the default keep 140) a hit's tokens and every
//! logits row the rank computes are bitwise the cache-off run's; with a shorter bounded replay
//! the rows drift within the rule `prefix_cache.rs` asserts for it (`replay_logits.rs`'s prompt
//! bounds at the same keep, KL <= 0.4 nats), compared up to the first differing token. A
//! V4-family hit replays nothing and is always bitwise (`replay = "exact"` is required).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::error::EngineError;
use deepinfer_actors::messages::scheduler::PrefixStats;
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::rank::observe::{ObservedFactory, RowLog};
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest, ModelFacts};
use deepinfer_model::any_model::AnyModel;
use deepinfer_tests::drift::{Rows, demo_model, drift, fixture_bounds, prompt, report};
use deepinfer_topology::{NodeConfig, RequestId};

mod engine_support;
use engine_support::generate_all;

const TIMEOUT: Duration = Duration::from_secs(300);

/// A CPU topology of `dp` ranks with `extra` sections appended.
fn node(dp: usize, scheduler: &str, extra: &str) -> NodeConfig {
    let text = format!(
        "[device]\nbackend = \"cpu\"\n[parallel]\ndp = {dp}\nep = 1\n[scheduler]\n{scheduler}\n\
         overlap_depth = 2\n{extra}"
    );
    NodeConfig::from_toml_str(&text, "prefix engine test").expect("topology")
}

/// The cache-on sections: `bytes` per rank, `replay` rule, decoder keep `keep`.
fn cache(bytes: u64, replay: &str, keep: usize) -> String {
    format!(
        "[prefix_cache]\nbytes_per_rank = {bytes}\nreplay = \"{replay}\"\n\
         [replay]\ndecoder_keep_tokens = {keep}\n"
    )
}

fn keep_only(keep: usize) -> String {
    format!("[replay]\ndecoder_keep_tokens = {keep}\n")
}

/// An engine over `model` whose ranks' rows go to `rows`.
async fn start(model: &AnyModel, node: NodeConfig, rows: &Arc<RowLog>) -> Engine {
    let factory = ModelFactory::new(model.clone(), "prefix engine test");
    let config = EngineConfig {
        node,
        executor: Arc::new(ObservedFactory::new(Arc::new(factory), rows.clone())),
        model: ModelFacts::of(model.config()),
        tokenizer: None,
    };
    Engine::start(config).await.expect("engine starts")
}

fn v41_tiny() -> AnyModel {
    Arc::new(deepinfer_tests::v41_tiny_model()).into()
}

/// The v4-tiny fixture (window 8, ratios 4 and 8, blocks of 64; a missing one fails).
fn v4_tiny() -> AnyModel {
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    AnyModel::load(&dir, None).expect("the v4-tiny fixture loads")
}

fn request(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest::from_tokens(prompt.to_vec())
        .max_tokens(max_tokens)
        .ignore_eos(true)
}

/// Runs `batches` in order (the requests of a batch at once, a batch after the previous one
/// ended), greedy, with `max_tokens` each; returns every request's tokens in submission order.
async fn run(engine: &Engine, batches: &[Vec<Vec<u32>>], max_tokens: usize) -> Vec<Vec<u32>> {
    let mut outputs = Vec::new();
    for batch in batches {
        outputs.extend(generate_all(engine, batch, max_tokens, (0.0, 0), TIMEOUT).await);
    }
    outputs
}

/// The prefix-cache stats of every rank.
async fn prefix_stats(engine: &Engine) -> Vec<PrefixStats> {
    let stats = engine.handle().scheduler_stats().await.expect("stats");
    stats.iter().map(|s| s.prefix).collect()
}

async fn shutdown(engine: Engine) {
    engine
        .shutdown(Duration::from_secs(60))
        .await
        .expect("shuts down");
}

/// One engine's run of some requests: their tokens, every row its ranks computed by (request,
/// position), and its ranks' prefix-cache stats.
struct Run {
    tokens: Vec<Vec<u32>>,
    rows: HashMap<(RequestId, usize), Vec<f32>>,
    stats: Vec<PrefixStats>,
}

async fn run_on(
    model: &AnyModel,
    node: NodeConfig,
    batches: &[Vec<Vec<u32>>],
    max_tokens: usize,
) -> Run {
    let rows = Arc::new(RowLog::new());
    let engine = start(model, node, &rows).await;
    let tokens = run(&engine, batches, max_tokens).await;
    let stats = prefix_stats(&engine).await;
    shutdown(engine).await;
    Run {
        tokens,
        rows: rows.snapshot(),
        stats,
    }
}

/// The same requests with the cache off and on: their tokens, and the rows at every position
/// both runs computed (a hit skips the positions before its replay start; chunk ends differ).
struct Compared {
    off: Vec<Vec<u32>>,
    on: Vec<Vec<u32>>,
    common_rows: HashMap<(RequestId, usize), (Vec<f32>, Vec<f32>)>,
    stats: Vec<PrefixStats>,
}

fn compare(off: &Run, on: Run) -> Compared {
    assert!(
        off.stats.iter().all(|s| s.budget_bytes == 0),
        "the cache is off"
    );
    let common_rows = on
        .rows
        .into_iter()
        .filter_map(|(key, row)| off.rows.get(&key).map(|o| (key, (o.clone(), row))))
        .collect();
    Compared {
        off: off.tokens.clone(),
        on: on.tokens,
        common_rows,
        stats: on.stats,
    }
}

impl Compared {
    /// Every common row is bitwise equal, and the tokens too; returns how many rows.
    fn assert_bitwise(&self) -> usize {
        assert_eq!(self.on, self.off, "tokens");
        for ((id, position), (off, on)) in &self.common_rows {
            assert!(off == on, "request {id}, row of position {position}");
        }
        self.common_rows.len()
    }
}

/// Shared 200 tokens, then a writer and readers diverging at 200 and at 129 (inside a ratio-2
/// group and a block).
fn fixture_prompts() -> (Vec<u32>, Vec<Vec<u32>>) {
    let shared = prompt(200, 3, 497);
    let writer = [&shared[..], &prompt(36, 11, 400)].concat();
    let readers = vec![
        [&shared[..], &prompt(30, 40, 300)].concat(),
        [&shared[..129], &prompt(90, 90, 300)].concat(),
    ];
    (writer, readers)
}

/// v41-tiny, decoder keep 22: with `replay = "exact"` (112 tokens) the readers hit 3 and 2
/// blocks and everything is bitwise the cache-off run; with the bounded replay (22 tokens) the
/// rows drift within the rule and the hits skip more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v41_tiny_hits_are_exact_with_the_exact_replay_and_within_the_rule_bounded() {
    let model = v41_tiny();
    let (writer, readers) = fixture_prompts();
    let batches = vec![vec![writer], readers.clone()];
    let scheduler = "max_batched_tokens = 256\nprefill_chunk_tokens = 64";
    let off = run_on(&model, node(1, scheduler, &keep_only(22)), &batches, 4).await;
    let on = node(1, scheduler, &cache(1 << 30, "exact", 22));
    let exact = compare(&off, run_on(&model, on, &batches, 4).await);
    let rows = exact.assert_bitwise();
    assert!(rows >= 3 * 4, "the decode rows of every request: {rows}");
    let s = exact.stats[0];
    // Reader 1: decoder start 208 -> 3 blocks; reader 2: 129 shared -> 2 blocks.
    assert_eq!(
        (s.counters.requests, s.counters.hit_requests),
        (3, 2),
        "{s:?}"
    );
    assert_eq!(s.counters.hit_tokens, 192 + 128);
    assert_eq!(s.counters.skipped_tokens, (192 - 112) + (128 - 112));
    assert_eq!(
        s.cached_blocks,
        3 + 1,
        "the writer's 3, reader 2's own block after 128"
    );
    assert_eq!(s.evictions, 0);

    let on = node(1, scheduler, &cache(1 << 30, "bounded", 22));
    let bounded = compare(&off, run_on(&model, on, &batches, 4).await);
    let s = bounded.stats[0].counters;
    assert_eq!(
        (s.hit_requests, s.skipped_tokens),
        (2, (192 - 22) + (128 - 22))
    );
    assert_eq!(bounded.on[0], bounded.off[0], "the writer is a miss");
    let vocab = model.config().vocab_size;
    let rule = fixture_bounds(22);
    for (r, reader) in readers.iter().enumerate() {
        let id = RequestId(1 + r as u64);
        // Rows up to the first differing token are computed on the same tokens.
        let same = bounded.on[1 + r]
            .iter()
            .zip(&bounded.off[1 + r])
            .take_while(|(a, b)| a == b)
            .count();
        let positions = reader.len() - 1..reader.len() + same.min(3);
        // The rows of one run (`on`: the cache-on run) at those positions.
        let rows = |on: bool| {
            let rows = positions.clone().flat_map(|p| {
                let (off_row, on_row) = &bounded.common_rows[&(id, p)];
                if on { on_row.clone() } else { off_row.clone() }
            });
            let all: Vec<f32> = rows.collect();
            Rows {
                prompt: all[..vocab].to_vec(),
                decode: all[vocab..].to_vec(),
            }
        };
        let d = drift(&rows(false), &rows(true), vocab);
        report("prefix hit in the engine, v41-tiny", 22, reader.len(), &d);
        assert!(d.prompt_max > 0.0, "a replay of 22 tokens drifts: {d:?}");
        assert!(
            d.prompt_max.max(d.decode_max) <= rule.prompt_max
                && d.prompt_kl.max(d.decode_kl) <= 0.4,
            "{d:?}"
        );
    }
}

/// A reader submitted right after the writer waits while the writer's chunks fill the step
/// budget, and is admitted in the plan of the writer's last chunk: it hits the 3 blocks the
/// writer's earlier chunks completed while the writer is still prefilling, bitwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hit_on_a_prefix_another_running_sequence_is_still_prefilling() {
    let model = v41_tiny();
    let (writer, readers) = fixture_prompts();
    let batches = vec![vec![writer, readers[0].clone()]];
    let scheduler = "max_batched_tokens = 64\nprefill_chunk_tokens = 64\nmax_running_requests = 4";
    let off = run_on(&model, node(1, scheduler, &keep_only(22)), &batches, 4).await;
    let on = node(1, scheduler, &cache(1 << 30, "exact", 22));
    let compared = compare(&off, run_on(&model, on, &batches, 4).await);
    compared.assert_bitwise();
    let s = compared.stats[0].counters;
    assert_eq!((s.hit_requests, s.hit_tokens), (1, 192), "{s:?}");
}

/// Twelve requests over four prompts of two blocks each, five blocks of budget: blocks are
/// evicted and stored again, the bytes stay within the budget after every batch, and the outputs
/// stay bitwise the cache-off run's (`off` and `on(budget)`: the topologies' extra sections).
async fn evict_under_a_tiny_budget(model: &AnyModel, off: &str, on: impl Fn(u64) -> String) {
    let geometry = deepinfer_actors::prefix_cache::PrefixGeometry::of(model.config());
    let budget = 5 * geometry.cached_block_bytes();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|p| prompt(150 + 10 * p, 20 * p as u32, 400))
        .collect();
    let scheduler = "max_batched_tokens = 512\nprefill_chunk_tokens = 64";
    let (off_rows, on_rows) = (Arc::new(RowLog::new()), Arc::new(RowLog::new()));
    let off = start(model, node(1, scheduler, off), &off_rows).await;
    let on = start(model, node(1, scheduler, &on(budget)), &on_rows).await;
    let mut evictions = 0;
    for round in 0..3 {
        let batch: Vec<Vec<u32>> = (0..4).map(|i| prompts[(i + round) % 4].clone()).collect();
        let expected = run(&off, std::slice::from_ref(&batch), 2).await;
        assert_eq!(run(&on, &[batch], 2).await, expected, "round {round}");
        let s = prefix_stats(&on).await[0];
        assert!(s.cached_bytes <= budget, "{s:?}");
        evictions = s.evictions;
    }
    let s = prefix_stats(&on).await[0];
    assert!(evictions > 0 && s.counters.hit_requests > 0, "{s:?}");
    shutdown(off).await;
    shutdown(on).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_a_tiny_budget_keeps_the_outputs_and_the_bound() {
    evict_under_a_tiny_budget(&v41_tiny(), &keep_only(22), |budget| {
        cache(budget, "exact", 22)
    })
    .await;
}

/// Two DP ranks: the repeat of a prompt goes to the rank that cached it although a filler made
/// that rank the more loaded one (its extra work is below the cached tokens), and hits there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp2_places_the_repeat_on_the_rank_holding_its_prefix() {
    let model = v41_tiny();
    let rows = Arc::new(RowLog::new());
    let scheduler = "max_batched_tokens = 256\nprefill_chunk_tokens = 64";
    let engine = start(
        &model,
        node(2, scheduler, &cache(1 << 30, "exact", 22)),
        &rows,
    )
    .await;
    let (writer, readers) = fixture_prompts();
    let first = engine
        .generate(request(&writer, 2))
        .await
        .expect("admitted");
    assert_eq!(first.dp().index(), 0, "an idle engine starts at rank 0");
    tokio::time::timeout(TIMEOUT, first.collect())
        .await
        .expect("in time")
        .expect("completes");
    // The filler (20 + 100 tokens of work) goes to rank 0 too (a tie) and keeps it busy.
    let filler = engine
        .generate(request(&prompt(20, 7, 300), 100))
        .await
        .expect("admitted");
    let repeat = engine
        .generate(request(&readers[0], 2))
        .await
        .expect("admitted");
    assert_eq!(
        (filler.dp().index(), repeat.dp().index()),
        (0, 0),
        "the repeat follows its cached prefix"
    );
    for stream in [filler, repeat] {
        tokio::time::timeout(TIMEOUT, stream.collect())
            .await
            .expect("in time")
            .expect("completes");
    }
    let stats = prefix_stats(&engine).await;
    assert_eq!(
        (stats[0].counters.hit_requests, stats[1].counters.requests),
        (1, 0),
        "{stats:?}"
    );
    shutdown(engine).await;
}

/// The demo model at the default keep (140, bounded): a second request sharing a 400-token
/// system prompt hits (4 blocks attached, replay from 116), and its tokens and rows are bitwise
/// the cache-off run's (the keep covers the demo's exact halo, 112).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_requests_sharing_a_system_prompt_hit_and_stay_exact_at_the_default_keep() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = AnyModel::from(Arc::new(demo_model(dir.path())));
    let system = prompt(400, 1000, 60_000);
    let first = [&system[..], &prompt(30, 7, 50_000)].concat();
    let second = [&system[..], &prompt(30, 300, 50_000)].concat();
    let scheduler = "max_batched_tokens = 512\nprefill_chunk_tokens = 128";
    let batches = [vec![first], vec![second]];
    let off = run_on(&model, node(1, scheduler, ""), &batches, 3).await;
    let on = node(
        1,
        scheduler,
        "[prefix_cache]\nbytes_per_rank = 1073741824\n",
    );
    let compared = compare(&off, run_on(&model, on, &batches, 3).await);
    compared.assert_bitwise();
    let s = compared.stats[0];
    assert_eq!(
        (
            s.counters.requests,
            s.counters.hit_requests,
            s.counters.hit_tokens
        ),
        (2, 1, 256),
        "{s:?}"
    );
    assert_eq!(s.counters.skipped_tokens, 256 - 140);
    assert!(s.cached_bytes > 0 && s.cached_bytes <= s.budget_bytes);
}

/// The cache's bytes come out of the rank's state budget (`[memory]`): the pool gets the rest,
/// and a cache that leaves nothing is refused naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_pool_gets_the_rank_budget_less_the_cache() {
    let model = v41_tiny();
    let bytes = deepinfer_model::state_bytes::StateBytes::of(model.config());
    let block = bytes.block_bytes();
    let rows = Arc::new(RowLog::new());
    let scheduler = "max_batched_tokens = 256\nprefill_chunk_tokens = 64";
    let memory = |budget: u64| format!("[memory]\nstate_bytes_per_rank = {budget}\n");
    let cache_bytes = 40 * block;
    let on = format!(
        "{}{}",
        memory(100 * block),
        cache(cache_bytes, "bounded", 22)
    );
    let engine = start(&model, node(1, scheduler, &on), &rows).await;
    let stats = engine.handle().scheduler_stats().await.expect("stats");
    assert_eq!(
        stats[0].state_blocks_total, 60,
        "(100 - 40) blocks of state"
    );
    assert_eq!(stats[0].prefix.budget_bytes, cache_bytes);
    shutdown(engine).await;
    let all = format!(
        "{}{}",
        memory(cache_bytes),
        cache(cache_bytes, "bounded", 22)
    );
    let config = EngineConfig {
        node: node(1, scheduler, &all),
        executor: Arc::new(ModelFactory::new(model.clone(), "v41-tiny")),
        model: ModelFacts::of(model.config()),
        tokenizer: None,
    };
    let error = Engine::start(config).await.expect_err("refused");
    assert!(
        matches!(&error, EngineError::Config { field, .. } if field == "prefix_cache.bytes_per_rank"),
        "{error}"
    );
}

/// The cache-on section of a V4 engine (its hits resume: `replay = "exact"`).
fn v4_cache(bytes: u64) -> String {
    format!("[prefix_cache]\nbytes_per_rank = {bytes}\nreplay = \"exact\"\n")
}

/// Shared 200 tokens, then a writer and readers diverging at 200, at 133 (inside a ratio-4 and a
/// ratio-8 group) and at the end of the third block (the reader is the writer's first 192).
fn v4_prompts() -> (Vec<u32>, Vec<Vec<u32>>) {
    let shared = prompt(200, 3, 900);
    let writer = [&shared[..], &prompt(36, 11, 800)].concat();
    let readers = vec![
        [&shared[..], &prompt(30, 40, 700)].concat(),
        [&shared[..133], &prompt(90, 90, 700)].concat(),
        shared[..192].to_vec(),
    ];
    (writer, readers)
}

/// v4-tiny (blocks of 64; a hit resumes at its end, replaying nothing): the readers hit 3, 2
/// and 2 blocks: blocks end at multiples of every ratio, so the reader diverging inside a
/// compression group hits up to the block before it and prefills the group's tokens again, and
/// the exact repeat of 3 blocks hits 2 (its last token is computed). Tokens and every row both
/// runs computed are bitwise the cache-off run's. The prefill chunks (60 tokens) end inside
/// blocks, so a block's rows come from two plans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v4_tiny_hits_resume_bitwise_including_inside_a_compression_group() {
    let model = v4_tiny();
    let (writer, readers) = v4_prompts();
    let batches = vec![vec![writer], readers];
    let scheduler = "max_batched_tokens = 256\nprefill_chunk_tokens = 60";
    let off = run_on(&model, node(1, scheduler, ""), &batches, 4).await;
    let on = node(1, scheduler, &v4_cache(1 << 30));
    let compared = compare(&off, run_on(&model, on, &batches, 4).await);
    let rows = compared.assert_bitwise();
    assert!(rows >= 4 * 4, "the decode rows of every request: {rows}");
    let s = compared.stats[0];
    assert_eq!(
        (s.counters.requests, s.counters.hit_requests),
        (4, 3),
        "{s:?}"
    );
    assert_eq!(s.counters.hit_tokens, 192 + 128 + 128);
    assert_eq!(
        s.counters.skipped_tokens, s.counters.hit_tokens,
        "no replay"
    );
    assert_eq!(
        s.cached_blocks,
        3 + 1,
        "the writer's 3, the diverging reader's own block after 128"
    );
    assert_eq!(s.evictions, 0);
}

/// A v4-tiny reader submitted right after the writer waits while the writer's chunks fill the
/// step budget, is admitted in the plan of the writer's last chunk and hits the 3 blocks the
/// writer's earlier chunks completed, bitwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v4_hit_on_a_prefix_another_running_sequence_is_still_prefilling() {
    let model = v4_tiny();
    let (writer, readers) = v4_prompts();
    let batches = vec![vec![writer, readers[0].clone()]];
    let scheduler = "max_batched_tokens = 64\nprefill_chunk_tokens = 64\nmax_running_requests = 4";
    let off = run_on(&model, node(1, scheduler, ""), &batches, 4).await;
    let on = node(1, scheduler, &v4_cache(1 << 30));
    let compared = compare(&off, run_on(&model, on, &batches, 4).await);
    compared.assert_bitwise();
    let s = compared.stats[0].counters;
    assert_eq!((s.hit_requests, s.hit_tokens), (1, 192), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v4_eviction_under_a_tiny_budget_keeps_the_outputs_and_the_bound() {
    evict_under_a_tiny_budget(&v4_tiny(), "", v4_cache).await;
}
