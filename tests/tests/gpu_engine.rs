//! The engine on a CUDA topology: the rank thread runs the model on a `CudaBackend` of its own
//! GPU (`ModelFactory::per_device`, what `model_source::resolve` builds for `backend = "cuda"`).
//!
//! - Against the CPU engine, on the v41-tiny fixture: the same greedy tokens and every logits row
//!   the ranks return (chunked prefill, then decode, next to other requests) bitwise equal.
//! - Batch invariance (ARCHITECTURE.md §3): one probe request's logits alone equal, bit for bit,
//!   its logits inside batches of 2, 8, 32 and 64 other requests of different prompt lengths, in
//!   prefill and in decode (the batch each row was computed in is recorded and checked).
//!   Negative control: the probe with one prompt token changed is seen as different.
//! - The state pool on the GPU: the `pool_support` workload (preemption by recompute under a small
//!   budget, DSpark on) gives the unlimited pool's outputs, the live states never above budget.
//! - The prefix cache on the GPU (`replay = "exact"`): a writer then two readers that hit its
//!   blocks (one ending inside a ratio-2 group) give the CPU engine's cache-off tokens and rows,
//!   bitwise, at every position both computed.
//! - The built-in demo model resolved from a `backend = "cuda"` topology serves a request on the
//!   GPU with the tokens of the CPU model (the wiring from topology to rank device).
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a usable GPU every test fails, naming why. Fixtures: `tests/fixtures/`
//! (`$DEEPINFER_FIXTURES`, which the suite sets).
#![cfg(feature = "cuda")]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deepinfer_actors::gpu;
use deepinfer_actors::model_source::resolve;
use deepinfer_actors::rank::executor::ExecutorFactory;
use deepinfer_actors::rank::factory::{ModelFactory, RankDevices};
use deepinfer_actors::rank::observe::{ObservedFactory, ObservedRow, RankObserver};
use deepinfer_actors::{Completion, Engine, EngineConfig, GenerateRequest, ModelFacts};
use deepinfer_model::{LogitsWanted, Model};
use deepinfer_tests::forward;
use deepinfer_topology::{NodeConfig, Numerics, RequestId};

mod engine_support;
mod gpu_support;
mod pool_support;
use gpu_support::host_fixture_model;

/// One recorded row: the logits and the number of sequences in the step that computed it.
#[derive(Debug, Clone)]
struct Row {
    logits: Vec<f32>,
    batch: usize,
}

/// `(request, position) -> row`, as the rank returned it.
type Recorded = Arc<RowsWithBatch>;

/// Keeps each row the ranks return, with its position and batch size.
#[derive(Default)]
struct RowsWithBatch(Mutex<HashMap<(RequestId, usize), Row>>);

impl RankObserver for RowsWithBatch {
    fn row(&self, row: ObservedRow<'_>) {
        let kept = Row {
            logits: row.logits.to_vec(),
            batch: row.step_sequences,
        };
        self.0
            .lock()
            .expect("not poisoned")
            .insert((row.id, row.position), kept);
    }
}

/// Fails `test`, naming why, when no GPU is usable: GPU tests never pass as no-ops.
fn require_gpu(test: &str) {
    let gpus = gpu::inventory();
    assert!(
        gpus.count > 0,
        "{test}: no usable GPU ({}); GPU tests run on the H200 via tests/gpu-suite.sh",
        gpus.unavailable.unwrap_or_default()
    );
}

/// Fails `test` when `DEEPINFER_HF_MODEL_DIR` would replace the model it must resolve.
fn require_no_model_override(test: &str) {
    assert!(
        std::env::var_os(deepinfer_actors::model_source::MODEL_DIR_ENV).is_none(),
        "{test}: unset {}: it overrides the model this test resolves",
        deepinfer_actors::model_source::MODEL_DIR_ENV
    );
}

/// The repository's v41-tiny fixture (`$DEEPINFER_FIXTURES` on the H200).
fn v41_tiny_dir() -> PathBuf {
    deepinfer_tests::fixture_dir("v41/v41-tiny")
}

/// The fixture loaded on the host (CPU backend), and its facts.
fn fixture_model() -> (Arc<Model>, ModelFacts) {
    let (model, cfg) = host_fixture_model(&v41_tiny_dir());
    let facts = ModelFacts {
        vocab_size: cfg.vocab_size,
        bos_token_id: cfg.bos_token_id,
        eos_token_id: Some(cfg.eos_token_id),
        max_context_tokens: cfg.max_position_embeddings,
    };
    (Arc::new(model), facts)
}

/// One DP rank with the given prefill chunk; room for 65 requests in one step.
fn topology(backend: &str, prefill_chunk: usize) -> NodeConfig {
    topology_with(backend, prefill_chunk, "")
}

/// [`topology`] with `extra` sections appended.
fn topology_with(backend: &str, prefill_chunk: usize, extra: &str) -> NodeConfig {
    let device = if backend == "cuda" {
        "backend = \"cuda\"\narch = \"sm90\"\ngpus_per_node = 1\nnumerics = \"exact\""
    } else {
        "backend = \"cpu\""
    };
    NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\n{device}\n[parallel]\ndp = 1\nep = 1\n\
             [scheduler]\nmax_batched_tokens = 8192\nmax_running_requests = 128\n\
             prefill_chunk_tokens = {prefill_chunk}\noverlap_depth = 2\nadmission_queue_capacity = 256\n\
             {extra}"
        ),
        &format!("gpu engine test ({backend})"),
    )
    .expect("topology")
}

/// An engine over `factory`, recording every row.
async fn recorded_engine(
    node: NodeConfig,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
) -> (Engine, Recorded) {
    let rows: Recorded = Arc::default();
    let config = EngineConfig {
        node,
        executor: Arc::new(ObservedFactory::new(factory, rows.clone())),
        model: facts,
        tokenizer: None,
    };
    (Engine::start(config).await.expect("engine starts"), rows)
}

fn cuda_factory(model: &Arc<Model>) -> Arc<dyn ExecutorFactory> {
    Arc::new(ModelFactory::per_device(
        model.clone(),
        "v41-tiny on the CUDA backend",
        RankDevices {
            per_node: 1,
            open: Arc::new(|_dp, ordinal| gpu::open_cuda_backend(ordinal, Numerics::Exact)),
            experts: None,
        },
    ))
}

/// Submits every request (in order, without waiting), then collects them all.
async fn run_all(engine: &Engine, requests: &[(Vec<u32>, usize)]) -> Vec<Completion> {
    let mut streams = Vec::new();
    for (prompt, max_tokens) in requests {
        let request = GenerateRequest::from_tokens(prompt.clone())
            .max_tokens(*max_tokens)
            .ignore_eos(true);
        streams.push(engine.generate(request).await.expect("admitted"));
    }
    let mut done = Vec::new();
    for stream in streams {
        let completion = tokio::time::timeout(Duration::from_secs(240), stream.collect())
            .await
            .expect("finishes in time")
            .expect("completes");
        done.push(completion);
    }
    done
}

/// The rows recorded for request `id`, by position.
fn rows_of(recorded: &Recorded, id: RequestId) -> Vec<(usize, Row)> {
    let recorded = recorded.0.lock().expect("not poisoned");
    let mut rows: Vec<(usize, Row)> = recorded
        .iter()
        .filter(|((rid, _), _)| *rid == id)
        .map(|((_, position), row)| (*position, row.clone()))
        .collect();
    rows.sort_by_key(|(position, _)| *position);
    rows
}

/// Bitwise comparison of two rows: the count of equal values and the largest difference.
fn compare(a: &[f32], b: &[f32]) -> (usize, f32) {
    assert_eq!(a.len(), b.len(), "row widths");
    let equal = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() == y.to_bits())
        .count();
    let max_diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    (equal, max_diff)
}

/// A deterministic prompt of `len` tokens (ids 3..500 of the fixture's 512).
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (seed.wrapping_mul(7919) + i * 131 + i * i * 17) % 497)
        .collect()
}

/// The fixture's own prompt (30 tokens).
const PROBE: [u32; 30] = [
    482, 319, 349, 457, 296, 396, 425, 117, 31, 155, 147, 445, 465, 5, 256, 419, 69, 407, 63, 240,
    416, 156, 176, 144, 367, 132, 506, 228, 245, 258,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_engine_equals_the_cpu_engine_bitwise() {
    let test = "cuda_engine_equals_the_cpu_engine_bitwise";
    require_gpu(test);
    let (model, facts) = fixture_model();
    let requests: Vec<(Vec<u32>, usize)> = vec![
        (PROBE.to_vec(), 6),
        (prompt(1, 3), 5),
        (prompt(2, 17), 4),
        (prompt(3, 41), 6),
    ];
    // Chunks of 7 tokens: several prefill chunks per prompt, next to decodes.
    let cpu_factory: Arc<dyn ExecutorFactory> =
        Arc::new(ModelFactory::new(model.clone(), "v41-tiny on the CPU"));
    let (cpu, cpu_rows) = recorded_engine(topology("cpu", 7), cpu_factory, facts).await;
    let cpu_done = run_all(&cpu, &requests).await;
    cpu.shutdown(Duration::from_secs(30)).await.expect("stops");

    let started = Instant::now();
    let (cuda, cuda_rows) = recorded_engine(topology("cuda", 7), cuda_factory(&model), facts).await;
    let opened = started.elapsed();
    let started = Instant::now();
    let cuda_done = run_all(&cuda, &requests).await;
    let served = started.elapsed();
    cuda.shutdown(Duration::from_secs(30)).await.expect("stops");

    let (mut rows, mut values, mut equal) = (0, 0, 0);
    let mut max_diff = 0.0f32;
    for (c, g) in cpu_done.iter().zip(&cuda_done) {
        assert_eq!(c.tokens, g.tokens, "greedy tokens of {} / {}", c.id, g.id);
        let cpu_rows = rows_of(&cpu_rows, c.id);
        let cuda_rows = rows_of(&cuda_rows, g.id);
        let positions = |rows: &[(usize, Row)]| rows.iter().map(|(p, _)| *p).collect::<Vec<_>>();
        assert_eq!(positions(&cpu_rows), positions(&cuda_rows), "row positions");
        for ((position, c_row), (_, g_row)) in cpu_rows.iter().zip(&cuda_rows) {
            let (same, diff) = compare(&c_row.logits, &g_row.logits);
            rows += 1;
            values += c_row.logits.len();
            equal += same;
            max_diff = max_diff.max(diff);
            assert_eq!(
                same,
                c_row.logits.len(),
                "{}: row at position {position}: max|diff| {diff}",
                g.id
            );
        }
    }
    eprintln!(
        "{test}: {} requests, {rows} rows, {equal} / {values} logits bitwise equal (max|diff| \
         {max_diff}); CUDA engine start {:.2} s, serving {:.2} s",
        requests.len(),
        opened.as_secs_f64(),
        served.as_secs_f64()
    );
    // Prefill chunk ends and every decode step of every request were compared.
    assert!(rows >= 4 * 5, "compared {rows} rows");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_logits_do_not_depend_on_the_batch() {
    let test = "probe_logits_do_not_depend_on_the_batch";
    require_gpu(test);
    const PROBE_TOKENS: usize = 5;
    let (model, facts) = fixture_model();
    // Prompts fit one chunk: the probe's prefill is one row, then one row per decode step.
    let (engine, recorded) =
        recorded_engine(topology("cuda", 128), cuda_factory(&model), facts).await;

    let started = Instant::now();
    let alone = run_all(&engine, &[(PROBE.to_vec(), PROBE_TOKENS)]).await;
    let reference = rows_of(&recorded, alone[0].id);
    eprintln!(
        "{test}: alone: {} rows in {:.2} s",
        reference.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        reference.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
        (PROBE.len() - 1..PROBE.len() + PROBE_TOKENS - 1).collect::<Vec<_>>(),
        "one prefill row, then one row per decode step"
    );
    assert!(reference.iter().all(|(_, row)| row.batch == 1));

    // Negative control: one prompt token changed gives other logits, and `compare` sees it.
    let mut changed = PROBE.to_vec();
    changed[PROBE.len() / 2] = changed[PROBE.len() / 2] % 400 + 7;
    let control = run_all(&engine, &[(changed, PROBE_TOKENS)]).await;
    let control_rows = rows_of(&recorded, control[0].id);
    let (same, diff) = compare(&reference[0].1.logits, &control_rows[0].1.logits);
    eprintln!(
        "{test}: negative control (one prompt token changed): {same} / {} prefill logits equal, \
         max|diff| {diff}",
        reference[0].1.logits.len()
    );
    assert!(
        same < reference[0].1.logits.len(),
        "a changed prompt token must change the logits"
    );

    let mut total_equal = 0;
    for others in [2usize, 8, 32, 64] {
        // Neighbours of different lengths (3..=60 tokens) that decode longer than the probe, so
        // every probe step has company. The probe comes last: the first neighbours fill the
        // rank's overlap window, so the probe's prefill is planned with the others' work.
        let mut requests: Vec<(Vec<u32>, usize)> = (0..others)
            .map(|k| {
                let len = 3 + (k * 37 + others) % 58;
                (
                    prompt(k as u32 + 100 * others as u32, len),
                    PROBE_TOKENS + 3,
                )
            })
            .collect();
        let probe_at = requests.len();
        requests.push((PROBE.to_vec(), PROBE_TOKENS));
        let started = Instant::now();
        let done = run_all(&engine, &requests).await;
        let elapsed = started.elapsed();
        let probe = &done[probe_at];
        assert_eq!(
            probe.tokens, alone[0].tokens,
            "{others} others: probe tokens"
        );
        let rows = rows_of(&recorded, probe.id);
        assert_eq!(rows.len(), reference.len(), "{others} others: probe rows");
        let mut batches = Vec::new();
        for ((position, row), (ref_position, ref_row)) in rows.iter().zip(&reference) {
            assert_eq!(position, ref_position);
            let (same, diff) = compare(&row.logits, &ref_row.logits);
            assert_eq!(
                same,
                ref_row.logits.len(),
                "{others} others: probe row at position {position} (batch {}): max|diff| {diff}",
                row.batch
            );
            total_equal += same;
            batches.push(row.batch);
        }
        // The probe really shared its steps: its prefill with other prefills, and at least one
        // decode step with every other request.
        assert!(
            batches[0] >= 2,
            "{others} others: prefill batch {batches:?}"
        );
        assert!(
            batches[1..].iter().any(|&b| b == others + 1),
            "{others} others: decode batches {batches:?}"
        );
        eprintln!(
            "{test}: {others} others: probe rows bitwise equal, batch sizes of its steps \
             {batches:?} (prefill, then decode); {} requests in {:.2} s",
            requests.len(),
            elapsed.as_secs_f64()
        );
    }
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("stops");
    eprintln!("{test}: {total_equal} probe logits bitwise equal across 4 batch sizes");
}

/// The demo model resolved from a `backend = "cuda"` topology: the engine's rank runs it on the
/// GPU, with the tokens of a greedy loop on the CPU model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cuda_topology_runs_the_demo_model_on_the_gpu() {
    let test = "a_cuda_topology_runs_the_demo_model_on_the_gpu";
    require_gpu(test);
    require_no_model_override(test);
    let node = topology("cuda", 64);
    let resolved = tokio::task::spawn_blocking(move || resolve(&node))
        .await
        .expect("joins")
        .expect("resolves on the GPU topology");
    let description = resolved.factory.describe();
    assert!(description.contains("CUDA backend"), "{description}");
    let prompt: Vec<u32> = prompt(5, 11).iter().map(|t| t * 211).collect();
    let max_tokens = 4;

    // The CPU model, greedily.
    let mut seq = resolved.model.new_sequence();
    let mut logits =
        forward(&resolved.model, &mut seq, &prompt, LogitsWanted::Last).expect("cpu prefill");
    let mut expected = Vec::new();
    for _ in 0..max_tokens {
        let best = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .expect("a row") as u32;
        expected.push(best);
        logits =
            forward(&resolved.model, &mut seq, &[best], LogitsWanted::Last).expect("cpu decode");
    }

    let started = Instant::now();
    let config = EngineConfig {
        node: topology("cuda", 64),
        executor: resolved.factory.clone(),
        model: resolved.facts,
        tokenizer: None,
    };
    let engine = Engine::start(config).await.expect("engine starts");
    let done = run_all(&engine, &[(prompt, max_tokens)]).await;
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("stops");
    assert_eq!(done[0].tokens, expected, "GPU engine vs CPU greedy");
    eprintln!(
        "{test}: {description}: tokens {:?} equal the CPU's ({:.2} s with engine start)",
        done[0].tokens,
        started.elapsed().as_secs_f64()
    );
}

/// The V4 tiny fixture resolved from a `backend = "cuda"` topology (`ModelFactory::per_device`): the
/// engine's rank runs `v4::Model` on the GPU, and several concurrent requests, greedy and seeded
/// (sampled on the device), get the tokens of the CPU engine on the same directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cuda_topology_serves_the_v4_tiny_fixture_with_the_cpu_tokens() {
    let test = "a_cuda_topology_serves_the_v4_tiny_fixture_with_the_cpu_tokens";
    require_gpu(test);
    require_no_model_override(test);
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    let v4_topology = |backend: &str| {
        let device = if backend == "cuda" {
            "backend = \"cuda\"\narch = \"sm90\"\ngpus_per_node = 1\nnumerics = \"exact\""
        } else {
            "backend = \"cpu\""
        };
        NodeConfig::from_toml_str(
            &format!(
                "[model]\nsource = \"{}\"\n[device]\n{device}\n[parallel]\ndp = 1\nep = 1\n\
                 [scheduler]\nmax_batched_tokens = 512\nmax_running_requests = 16\n\
                 prefill_chunk_tokens = 7\noverlap_depth = 2\nadmission_queue_capacity = 32\n",
                dir.display()
            ),
            &format!("gpu engine V4 test ({backend})"),
        )
        .expect("topology")
    };
    // Prompts of different lengths (ids 2..1023 of the fixture's 1024); odd ones sample seeded.
    let requests: Vec<(Vec<u32>, bool)> = (0..6u32)
        .map(|r| {
            let len = 3 + 5 * r as usize;
            let tokens = (0..len as u32)
                .map(|i| 2 + (r * 7919 + i * 131 + i * i * 17) % 1022)
                .collect();
            (tokens, r % 2 == 1)
        })
        .collect();
    let max_tokens = 6;
    let mut outputs = Vec::new();
    let mut description = String::new();
    for backend in ["cpu", "cuda"] {
        let node = v4_topology(backend);
        let resolved = tokio::task::spawn_blocking(move || resolve(&node))
            .await
            .expect("joins")
            .expect("the V4 fixture resolves");
        description = resolved.factory.describe();
        let engine = Engine::start(EngineConfig {
            node: v4_topology(backend),
            executor: resolved.factory.clone(),
            model: resolved.facts,
            tokenizer: None,
        })
        .await
        .expect("engine starts");
        let mut streams = Vec::new();
        for (r, (tokens, seeded)) in requests.iter().enumerate() {
            let mut request = GenerateRequest::from_tokens(tokens.clone())
                .max_tokens(max_tokens)
                .ignore_eos(true);
            if *seeded {
                request = request.temperature(0.8).top_p(0.9).seed(100 + r as u64);
            }
            streams.push(engine.generate(request).await.expect("admitted"));
        }
        let mut tokens = Vec::new();
        for stream in streams {
            let done = tokio::time::timeout(Duration::from_secs(240), stream.collect())
                .await
                .expect("finishes in time")
                .expect("completes");
            tokens.push(done.tokens);
        }
        engine
            .shutdown(Duration::from_secs(30))
            .await
            .expect("stops");
        outputs.push(tokens);
    }
    assert!(description.contains("CUDA backend"), "{description}");
    assert!(description.starts_with("V4 model"), "{description}");
    for (r, (cpu, cuda)) in outputs[0].iter().zip(&outputs[1]).enumerate() {
        assert_eq!(cpu.len(), max_tokens, "request {r}");
        assert_eq!(cuda, cpu, "request {r}: GPU engine vs CPU engine");
    }
    eprintln!(
        "{test}: {description}: {} requests' tokens equal the CPU engine's",
        requests.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_pool_preemption_is_exact_and_bounded_on_the_gpu() {
    require_gpu("state_pool_preemption_is_exact_and_bounded_on_the_gpu");
    let (model, facts) = fixture_model();
    let device = "backend = \"cuda\"\narch = \"sm90\"\ngpus_per_node = 1\nnumerics = \"exact\"";
    // Prompts of 130..=157 tokens: the longer ones run bounded replay (keep 140) too.
    let prompts = pool_support::prompts(4, facts.vocab_size as u32, 130);
    pool_support::check(
        "v41-tiny on the GPU",
        device,
        cuda_factory(&model),
        facts,
        &prompts,
        24,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_hits_on_the_gpu_equal_the_cpu_engine_without_the_cache() {
    require_gpu("prefix_cache_hits_on_the_gpu_equal_the_cpu_engine_without_the_cache");
    let (model, facts) = fixture_model();
    let shared = prompt(5, 200);
    let writer = [&shared[..], &prompt(6, 36)].concat();
    let readers = vec![
        ([&shared[..], &prompt(7, 30)].concat(), 4),
        ([&shared[..129], &prompt(8, 90)].concat(), 4),
    ];
    let keep = "[replay]\ndecoder_keep_tokens = 22\n";
    let cache = format!("{keep}[prefix_cache]\nbytes_per_rank = 1073741824\nreplay = \"exact\"\n");
    let cpu_factory: Arc<dyn ExecutorFactory> =
        Arc::new(ModelFactory::new(model.clone(), "v41-tiny on the CPU"));
    let (cpu, cpu_rows) = recorded_engine(topology_with("cpu", 64, keep), cpu_factory, facts).await;
    let mut cpu_done = run_all(&cpu, &[(writer.clone(), 4)]).await;
    cpu_done.extend(run_all(&cpu, &readers).await);
    cpu.shutdown(Duration::from_secs(30)).await.expect("stops");
    let node = topology_with("cuda", 64, &cache);
    let (cuda, cuda_rows) = recorded_engine(node, cuda_factory(&model), facts).await;
    let mut cuda_done = run_all(&cuda, &[(writer, 4)]).await;
    cuda_done.extend(run_all(&cuda, &readers).await);
    let stats = cuda.handle().scheduler_stats().await.expect("stats");
    cuda.shutdown(Duration::from_secs(30)).await.expect("stops");
    let hits = stats[0].prefix.counters;
    assert_eq!(
        (hits.hit_requests, hits.hit_tokens),
        (2, 192 + 128),
        "{hits:?}"
    );
    let mut compared = 0;
    for (c, g) in cpu_done.iter().zip(&cuda_done) {
        assert_eq!(c.tokens, g.tokens, "greedy tokens of {}", g.id);
        let cpu_rows: HashMap<usize, Row> = rows_of(&cpu_rows, c.id).into_iter().collect();
        for (position, g_row) in rows_of(&cuda_rows, g.id) {
            let Some(c_row) = cpu_rows.get(&position) else {
                continue;
            };
            let (same, diff) = compare(&c_row.logits, &g_row.logits);
            assert_eq!(
                same,
                c_row.logits.len(),
                "{}: row {position}: max|diff| {diff}",
                g.id
            );
            compared += 1;
        }
    }
    assert!(
        compared >= 3 * 4,
        "the decode rows of every request: {compared}"
    );
}
