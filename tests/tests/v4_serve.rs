//! A V4-family checkpoint served end to end through the runtime (CPU backend), the family picked
//! from its `config.json` by `model_source::resolve`:
//!
//! - The v4-tiny fixture behind an engine with 2 DP ranks, chunked prefill and async scheduling:
//!   several concurrent requests, greedy and seeded, get exactly the tokens of running
//!   `v4::Model` alone per request (same chunks, `sampling::sample` at each position).
//! - The offline job on a V4 directory (a random tiny V4 with the DeepSeek vocabulary, the shipped
//!   tokenizer): a completions line gives the text of the model's own greedy tokens, and a chat
//!   line is encoded with the V4 template (no V4.1 `<｜System｜>` token).
//! - A V4-Flash-0731-style checkpoint (reduced, random, with a DSpark drafter) behind an engine
//!   with `dspark.enabled`: its drafts are proposed and verified (every one, with a wrapper that
//!   reports them confident on an emulated fixed-cost device), rejected ones rolled back, and the
//!   greedy tokens equal running the model alone.
//! - V4.1-only features asked of a V4 checkpoint are refused at start, naming the field (a DSpark
//!   drafter it lacks), while expert parallelism with live EPLB resolves on the CPU and is laid
//!   out on CUDA ranks (each rank's backend its EP rank).
//!
//! Fixture: `tests/fixtures/v4/v4-tiny` (a missing one fails).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::frontend::codec::TextCodec;
use deepinfer_actors::job::{JobOptions, run_job};
use deepinfer_actors::model_source::{
    MODEL_DIR_ENV, check_v4_features, on_node, resolve, shipped_tokenizer,
};
use deepinfer_actors::openai::ServedModel;
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest};
use deepinfer_model::any_model::AnyModel;
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::{ModelConfig, ModelFamily};
use deepinfer_model::sampling::{SamplingParams, sample};
use deepinfer_model::v4;
use deepinfer_model::v4::{EntryOutput, StepEntry};
use deepinfer_model::{LogitsWanted, StepOptions};
use deepinfer_tests::confident::Confident;
use deepinfer_tests::forward;
use deepinfer_topology::NodeConfig;

const CHUNK: usize = 5;

fn v4_tiny() -> PathBuf {
    deepinfer_tests::fixture_dir("v4/v4-tiny")
}

/// The topology of a local model directory; `extra` is appended (more sections).
fn topology(dir: &Path, dp: u8, extra: &str) -> NodeConfig {
    let text = format!(
        "[model]\nsource = \"{}\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = {dp}\nep = 1\n\
         [scheduler]\nmax_batched_tokens = 256\nmax_running_requests = 8\n\
         prefill_chunk_tokens = {CHUNK}\noverlap_depth = 2\nadmission_queue_capacity = 16\n\
         [sampling]\nmax_tokens = 6\n{extra}",
        dir.display()
    );
    NodeConfig::from_toml_str(&text, "v4 serve test").expect("topology parses")
}

/// The process-wide model override would replace the directory under test.
fn overridden(test: &str) -> bool {
    let set = std::env::var_os(MODEL_DIR_ENV).is_some();
    if set {
        eprintln!("{test}: skipped: {MODEL_DIR_ENV} overrides the topology's model");
    }
    set
}

/// `n` tokens of `model` alone: the prompt in `CHUNK`-token chunks, then one token per step,
/// each sampled with `params` at its position; stops after `eos`.
fn alone(
    model: &v4::Model,
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
    eos: u32,
) -> Vec<u32> {
    let mut seq = model.new_sequence();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(CHUNK) {
        logits = model
            .forward_step(
                &mut [StepEntry::new(&mut seq, chunk, LogitsWanted::Last)],
                StepOptions::default(),
            )
            .and_then(EntryOutput::one_entry_logits)
            .expect("prefill alone");
    }
    let mut out = Vec::new();
    while out.len() < n {
        let position = prompt.len() + out.len();
        let token = sample(&logits, params, position as u64).expect("a token");
        out.push(token);
        if token == eos {
            break;
        }
        logits = model
            .forward_step(
                &mut [StepEntry::new(&mut seq, &[token], LogitsWanted::Last)],
                StepOptions::default(),
            )
            .and_then(EntryOutput::one_entry_logits)
            .expect("decode alone");
    }
    out
}

fn prompt(seed: u32, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 2 + (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919) >> 7) % (vocab - 2))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_serves_v4_tiny_with_the_tokens_of_the_model_alone() {
    let test = "engine_serves_v4_tiny_with_the_tokens_of_the_model_alone";
    let dir = v4_tiny();
    if overridden(test) {
        return;
    }
    let node = topology(&dir, 2, "");
    let resolved = tokio::task::spawn_blocking(move || resolve(&node))
        .await
        .expect("joins")
        .expect("the V4 directory resolves");
    assert_eq!(resolved.factory.family(), ModelFamily::V4);
    assert_eq!(resolved.factory.sliding_window(), None, "no bounded replay");
    let description = resolved.factory.describe();
    assert!(description.starts_with("V4 model"), "{description}");
    let AnyModel::V4(served) = &resolved.model else {
        panic!("a V4 directory resolved as {description}");
    };
    let cfg = served.config().clone();
    let (vocab, eos) = (cfg.vocab_size as u32, cfg.eos_token_id);
    let engine = Engine::start(EngineConfig {
        node: topology(&dir, 2, ""),
        executor: resolved.factory.clone(),
        model: resolved.facts,
        // The fixture's 1024-token vocabulary is smaller than the shipped tokenizer's.
        tokenizer: None,
    })
    .await
    .expect("engine starts");

    let greedy = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let seeded = |seed| SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed,
    };
    let cases: Vec<(Vec<u32>, SamplingParams)> = vec![
        (prompt(1, 12, vocab), greedy),
        (prompt(2, 3, vocab), seeded(11)),
        (prompt(3, 21, vocab), greedy),
        (prompt(4, 9, vocab), seeded(12)),
        (prompt(5, 16, vocab), seeded(13)),
    ];
    let max_tokens = 6;
    let mut streams = Vec::new();
    for (tokens, params) in &cases {
        let mut request = GenerateRequest::from_tokens(tokens.clone()).max_tokens(max_tokens);
        if params.temperature > 0.0 {
            request = request
                .temperature(params.temperature)
                .top_k(params.top_k)
                .top_p(params.top_p)
                .seed(params.seed);
        }
        streams.push(engine.generate(request).await.expect("admitted"));
    }
    // A fresh load of the same directory, run one request at a time.
    let reference = v4::Model::load(&dir).expect("fixture loads");
    let mut distinct = std::collections::HashSet::new();
    for (i, ((tokens, params), stream)) in cases.iter().zip(streams).enumerate() {
        let done = tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("in time")
            .expect("completes");
        let expected = alone(&reference, tokens, params, max_tokens, eos);
        assert_eq!(done.tokens, expected, "request {i} ({params:?})");
        distinct.insert(done.tokens);
    }
    assert!(distinct.len() > 1, "every request gave the same tokens");
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("stops");
}

/// A tiny V4 with the DeepSeek vocabulary (so the shipped tokenizer fits), written at random.
fn write_v4_with_deepseek_vocab(dir: &Path) {
    let mut cfg = ModelConfig::tiny_v4();
    cfg.vocab_size = 129_280;
    cfg.max_position_embeddings = 1024;
    write_random_checkpoint(&cfg, 4, dir, 1).expect("checkpoint written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_offline_job_serves_a_v4_directory() {
    let test = "the_offline_job_serves_a_v4_directory";
    if overridden(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().to_path_buf();
    write_v4_with_deepseek_vocab(&path);
    let node = topology(&path, 1, "");
    let resolved = tokio::task::spawn_blocking(move || resolve(&node))
        .await
        .expect("joins")
        .expect("the V4 directory resolves");
    assert_eq!(resolved.tokenizer, shipped_tokenizer());
    let model = resolved.model.clone();
    let engine = Engine::start(EngineConfig {
        node: topology(&path, 1, ""),
        executor: resolved.factory.clone(),
        model: resolved.facts,
        tokenizer: Some(resolved.tokenizer.clone()),
    })
    .await
    .expect("engine starts");

    let text = "The capital of France is";
    let chat = serde_json::json!({
        "model": "DeepSeek-V4-Flash",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        "max_tokens": 3
    });
    let input = format!(
        "{}\n{}\n",
        serde_json::json!({"custom_id": "text", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": text, "max_tokens": 4, "temperature": 0}}),
        serde_json::json!({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": chat}),
    );
    let served = ServedModel {
        name: resolved.name.clone(),
        family: ModelFamily::V4,
        context_tokens: resolved.facts.max_context_tokens,
        thinking_by_default: false,
    };
    let options = JobOptions::new(served, 4);
    let mut output = Vec::new();
    let summary = run_job(
        &engine.handle(),
        input.as_bytes(),
        &options,
        &mut output,
        Arc::new(|| {}),
        tokio::sync::watch::channel(false).1,
    )
    .await
    .expect("the job runs");
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("stops");
    let lines: Vec<serde_json::Value> = output
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("an output line is JSON"))
        .collect();
    assert_eq!((summary.succeeded, summary.failed), (2, 0), "{lines:?}");
    let line = |id: &str| {
        lines
            .iter()
            .find(|l| l["custom_id"] == id)
            .unwrap_or_else(|| panic!("no output line {id}: {lines:?}"))
            .clone()
    };

    // The completion is the text of the model's own greedy tokens.
    let codec = TextCodec::load_for(&shipped_tokenizer(), 0, ModelFamily::V4).expect("codec");
    let prompt = codec.encode_text(text).expect("encodes");
    let mut seq = model.new_sequence();
    let mut logits = forward(&model, &mut seq, &prompt, LogitsWanted::Last).expect("prefill");
    let greedy = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let mut expected = Vec::new();
    for k in 0..4 {
        let token = sample(&logits, &greedy, (prompt.len() + k) as u64).expect("a token");
        expected.push(token);
        if token == 1 {
            break;
        }
        logits = forward(&model, &mut seq, &[token], LogitsWanted::Last).expect("decode");
    }
    let body = &line("text")["response"]["body"];
    assert_eq!(
        body["usage"]["prompt_tokens"].as_u64(),
        Some(prompt.len() as u64)
    );
    assert_eq!(
        body["choices"][0]["text"].as_str(),
        Some(codec.decode(&expected).as_str()),
        "{body}"
    );

    // The chat line was encoded with the V4 template.
    let encoded = codec.encode_chat(&chat).expect("V4 chat encodes");
    let body = &line("chat")["response"]["body"];
    assert_eq!(
        body["usage"]["prompt_tokens"].as_u64(),
        Some(encoded.tokens.len() as u64),
        "{body}"
    );
    let v41 = TextCodec::load(&shipped_tokenizer(), 0)
        .expect("V4.1 codec")
        .encode_chat(&chat)
        .expect("V4.1 chat encodes");
    assert_ne!(encoded.tokens, v41.tokens, "V4 and V4.1 templates differ");
}

#[test]
fn v41_only_features_on_a_v4_checkpoint_are_refused_naming_the_field() {
    let test = "v41_only_features_on_a_v4_checkpoint_are_refused_naming_the_field";
    let dir = v4_tiny();
    if overridden(test) {
        return;
    }
    let err = resolve(&topology(&dir, 1, "[dspark]\nenabled = true\n"))
        .err()
        .expect("dspark.enabled was not refused");
    assert_eq!(err.code(), "config", "{err}");
    assert!(err.to_string().contains("dspark.enabled"), "{err}");
    // Expert parallelism and live EPLB run on the CPU (`tests/tests/ep_invariance.rs`,
    // `ep_eplb.rs`: bitwise the tokens of one rank).
    let mut node = topology(&dir, 2, "[eplb]\nenabled = true\n");
    node.parallel.ep = 2;
    let resolved = resolve(&node).expect("a V4 checkpoint resolves with expert parallelism");
    assert!(resolved.factory.expert_parallel().is_some());
    assert_eq!(resolved.factory.family(), ModelFamily::V4);
    assert_eq!(resolved.factory.sliding_window(), None, "no bounded replay");
    let description = resolved.factory.describe();
    assert!(
        description.contains("experts over 2 EP ranks"),
        "{description}"
    );
    // And on CUDA ranks: each rank's backend is its EP rank of the exact experts, live EPLB on
    // them (laid out here without a GPU: the backends open when the ranks start).
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("fixture config");
    let text = format!(
        "[model]\nsource = \"{}\"\n[device]\nbackend = \"cuda\"\ngpus_per_node = 1\n\
         [parallel]\ndp = 2\nep = 2\n[eplb]\nenabled = true\n",
        dir.display()
    );
    let cuda = NodeConfig::from_toml_str(&text, "v4 cuda ep").expect("topology parses");
    check_v4_features(&cuda, &cfg).expect("CUDA expert parallelism on V4");
    let loaded = resolve(&topology(&dir, 1, "")).expect("v4-tiny resolves");
    let laid_out = on_node(&cuda, loaded).expect("V4 on CUDA EP ranks");
    let group = laid_out
        .factory
        .device_experts()
        .expect("the ranks are EP ranks");
    assert_eq!(group.lockstep().ranks(), 2);
    assert!(
        group.eplb_status().is_some(),
        "live EPLB on the device ranks"
    );
    assert!(
        laid_out.factory.expert_parallel().is_none(),
        "the device ranks, not the CPU's expert parallelism"
    );
    let description = laid_out.factory.describe();
    assert!(
        description.contains("V4 model")
            && description
                .contains("each its EP rank of 2 (4 expert slots per layer on each, rows moved by device copies, EPLB on)"),
        "{description}"
    );
    // Bounded replay (on by default) is not refused: V4 runs the full prefill.
    assert!(topology(&dir, 1, "").replay.decoder_keep_tokens.is_some());
}

/// Emulated device time per step, so that verifying every draft is what the scheduler picks.
const EMULATED_STEP: Duration = Duration::from_millis(200);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v4_dspark_drafter_speculates_without_changing_greedy_tokens() {
    let test = "a_v4_dspark_drafter_speculates_without_changing_greedy_tokens";
    if overridden(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().to_path_buf();
    let cfg = ModelConfig::reduced_v4_dspark();
    write_random_checkpoint(&cfg, 9, &path, 1).expect("checkpoint written");
    let dspark = "[dspark]\nenabled = true\nmax_draft_tokens = 5\nprofile_steps = 1\n";
    let node = topology(&path, 1, dspark);
    let resolved = tokio::task::spawn_blocking(move || resolve(&node))
        .await
        .expect("joins")
        .expect("a V4 checkpoint with a DSpark drafter resolves with dspark.enabled");
    let AnyModel::V4(served) = &resolved.model else {
        panic!("a V4 directory resolved as {}", resolved.factory.describe());
    };
    let served = served.clone();
    let engine = Engine::start(EngineConfig {
        node: topology(&path, 1, dspark),
        executor: Arc::new(Confident::factory(resolved.factory.clone(), EMULATED_STEP)),
        model: resolved.facts,
        tokenizer: None,
    })
    .await
    .expect("engine starts");
    let vocab = cfg.vocab_size as u32;
    let prompts = [prompt(6, 11, vocab), prompt(7, 4, vocab)];
    let max_tokens = 7;
    let mut streams = Vec::new();
    for tokens in &prompts {
        let request = GenerateRequest::from_tokens(tokens.clone())
            .max_tokens(max_tokens)
            .ignore_eos(true);
        streams.push(engine.generate(request).await.expect("admitted"));
    }
    let greedy = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    for (i, (tokens, stream)) in prompts.iter().zip(streams).enumerate() {
        let done = tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("in time")
            .expect("completes");
        // `u32::MAX` is no token: the alone run ignores the end of sequence too.
        let expected = alone(&served, tokens, &greedy, max_tokens, u32::MAX);
        assert_eq!(done.tokens, expected, "request {i}");
    }
    let stats = engine.handle().scheduler_stats().await.expect("stats");
    let proposed: u64 = stats.iter().map(|s| s.draft_tokens_proposed).sum();
    let verified: u64 = stats.iter().map(|s| s.draft_tokens_verified).sum();
    let rejecting: u64 = stats.iter().map(|s| s.rejecting_verifies).sum();
    println!("{test}: proposed {proposed}, verified {verified}, rejecting verifies {rejecting}");
    assert!(
        proposed > 0 && verified > 0,
        "the drafter's proposals were verified"
    );
    assert!(rejecting > 0, "random drafts were rejected and rolled back");
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("stops");
}
