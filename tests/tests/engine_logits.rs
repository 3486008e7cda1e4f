//! The runtime adds no numerical difference: on DeepSeek's reference fixture (the v41-tiny
//! checkpoint), every logits row the engine's rank computes for a request — chunked prefill then
//! decode, through the scheduler and the rank thread, next to other requests on 2 DP ranks — is
//! bitwise equal to the row the `logits` tool writes for the same tokens fed in one chunk.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::rank::executor::ExecutorFactory;
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::rank::observe::{ObservedFactory, RowLog};
use deepinfer_actors::tools::logits;
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest, ModelFacts};
use deepinfer_model::Model;
use deepinfer_model::config::ModelConfig;
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::{NodeConfig, RequestId};
use safetensors::SafeTensors;

fn fixture() -> PathBuf {
    deepinfer_tests::fixture_dir("v41/v41-tiny")
}

fn tool_logits(model: &Path, tokens: &[u32]) -> Vec<f32> {
    let out = tempfile::tempdir().expect("tempdir");
    let request = logits::LogitsRequest {
        model_dir: model.to_path_buf(),
        tokens: tokens.to_vec(),
        chunks: Vec::new(),
        out: out.path().join("logits.safetensors"),
    };
    logits::run(&request).expect("logits tool runs");
    let bytes = std::fs::read(&request.out).expect("written");
    let tensors = SafeTensors::deserialize(&bytes).expect("safetensors");
    let view = tensors.tensor("logits").expect("logits");
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Two DP ranks on the CPU, prefill chunks of 7 tokens.
fn node() -> NodeConfig {
    NodeConfig::from_toml_str(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = 2\nep = 1\n\
         [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 7\n\
         overlap_depth = 2\nadmission_queue_capacity = 8\n",
        "engine logits test",
    )
    .expect("topology")
}

/// An engine running `executor` for the model of `cfg`, without a tokenizer.
async fn start(node: NodeConfig, executor: Arc<dyn ExecutorFactory>, cfg: &ModelConfig) -> Engine {
    let config = EngineConfig {
        node,
        executor,
        model: ModelFacts {
            vocab_size: cfg.vocab_size,
            bos_token_id: cfg.bos_token_id,
            eos_token_id: Some(cfg.eos_token_id),
            max_context_tokens: cfg.max_position_embeddings,
        },
        tokenizer: None,
    };
    Engine::start(config).await.expect("engine starts")
}

/// The fixture's model and config.
fn fixture_model() -> (Arc<Model>, ModelConfig) {
    let dir = fixture();
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("fixture config");
    let vocab = logits::engram_vocab_for_dir(&dir, &cfg).expect("stub vocabulary");
    let model = Arc::new(Model::load_with_vocab(&dir, vocab).expect("fixture loads"));
    (model, cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_logits_equal_the_logits_tool() {
    let dir = fixture();
    let (model, cfg) = fixture_model();
    let rows = Arc::new(RowLog::new());
    let node = node();
    let (executor, freed) = FreedLengths::track(Arc::new(ObservedFactory::new(
        Arc::new(ModelFactory::new(model, "v41-tiny fixture")),
        rows.clone(),
    )));
    let engine = start(node, executor, &cfg).await;
    // The fixture's own prompt (30 tokens: several prefill chunks, a ratio-2 group pending at the
    // boundary) plus two neighbours that share the ranks.
    let prompt: Vec<u32> = vec![
        482, 319, 349, 457, 296, 396, 425, 117, 31, 155, 147, 445, 465, 5, 256, 419, 69, 407, 63,
        240, 416, 156, 176, 144, 367, 132, 506, 228, 245, 258,
    ];
    let main = engine
        .generate(GenerateRequest::from_tokens(prompt.clone()).max_tokens(6))
        .await
        .expect("admitted");
    let others = [vec![7, 8, 9], (100..125).collect::<Vec<u32>>()];
    let mut neighbours = Vec::new();
    for p in &others {
        neighbours.push(
            engine
                .generate(GenerateRequest::from_tokens(p.clone()).max_tokens(4))
                .await
                .expect("admitted"),
        );
    }
    let done = tokio::time::timeout(Duration::from_secs(300), main.collect())
        .await
        .expect("finishes in time")
        .expect("completes");
    for stream in neighbours {
        tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("finishes in time")
            .expect("completes");
    }
    freed.shutdown_and_check_replay(engine).await;

    // The engine's rows for the main request, by position.
    let recorded = rows.snapshot();
    let ids: Vec<RequestId> = recorded.keys().map(|(id, _)| *id).collect();
    let main_id = ids
        .into_iter()
        .find(|id| {
            recorded.contains_key(&(*id, prompt.len() - 1)) && recorded.contains_key(&(*id, 6))
        })
        .expect("the main request's rows were recorded");
    let mut full = prompt.clone();
    full.extend(&done.tokens);
    let reference = tool_logits(&dir, &full[..full.len() - 1]);
    let v = cfg.vocab_size;
    let mut compared = 0;
    for ((id, position), row) in recorded.iter() {
        if *id != main_id || *position >= full.len() - 1 {
            continue;
        }
        assert_eq!(
            row.as_slice(),
            &reference[position * v..(position + 1) * v],
            "row of position {position}"
        );
        compared += 1;
    }
    // Prefill chunk ends (6, 13, 20, 27, 29) and every decode step after the prompt.
    assert!(
        compared >= 5 + done.tokens.len() - 1,
        "compared {compared} rows"
    );
    // The generated tokens are the argmax of those rows (greedy).
    for (g, token) in done.tokens.iter().enumerate() {
        let position = prompt.len() - 1 + g;
        let row = &reference[position * v..(position + 1) * v];
        let best = (0..v)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
            .unwrap();
        assert_eq!(*token as usize, best, "greedy token {g}");
    }
}

/// Log-probabilities (`GenerateRequest::logprobs`) of a seeded, sampled request through the
/// scheduler and the rank: the tokens are those of the same request without them, and each
/// token's log-probability and alternatives are the log-softmax (computed here, f64 and libm)
/// of the `logits` tool's row for the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_logprobs_are_the_log_softmax_of_the_logits_tools_rows() {
    let dir = fixture();
    let (model, cfg) = fixture_model();
    let factory = Arc::new(ModelFactory::new(model, "v41-tiny fixture"));
    let engine = start(node(), factory, &cfg).await;
    let prompt: Vec<u32> = (200..216).collect();
    let request = GenerateRequest::from_tokens(prompt.clone())
        .max_tokens(5)
        .temperature(0.9)
        .seed(21);
    let mut runs = Vec::new();
    for asked in [request.clone().logprobs(4), request] {
        let stream = engine.generate(asked).await.expect("admitted");
        let done = tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("finishes in time")
            .expect("completes");
        runs.push(done);
    }
    engine
        .shutdown(Duration::from_secs(60))
        .await
        .expect("shuts down");
    let (with, without) = (&runs[0], &runs[1]);
    assert_eq!(
        with.tokens, without.tokens,
        "asking for logprobs changed the tokens"
    );
    assert!(without.logprobs.is_empty());
    assert_eq!(with.logprobs.len(), with.tokens.len());
    let mut full = prompt.clone();
    full.extend(&with.tokens);
    let reference = tool_logits(&dir, &full[..full.len() - 1]);
    let v = cfg.vocab_size;
    for (g, (lp, &token)) in with.logprobs.iter().zip(&with.tokens).enumerate() {
        let position = prompt.len() - 1 + g;
        let row = &reference[position * v..(position + 1) * v];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let total: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        let expected = |t: u32| row[t as usize] as f64 - max - total.ln();
        // f32 rounding of a value of a few units: well under 1e-5.
        assert_eq!(lp.chosen.id, token);
        assert!(
            (lp.chosen.logprob as f64 - expected(token)).abs() < 1e-5,
            "token {g}"
        );
        let mut best: Vec<u32> = (0..v as u32).collect();
        best.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let top: Vec<u32> = lp.top.iter().map(|t| t.id).collect();
        assert_eq!(
            top,
            best[..4],
            "the alternatives of token {g}, most likely first"
        );
        for t in &lp.top {
            assert!((t.logprob as f64 - expected(t.id)).abs() < 1e-5);
        }
    }
}
