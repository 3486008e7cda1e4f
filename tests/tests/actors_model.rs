//! The engine on the real V4.1 model code (CPU backend, tiny random checkpoint written through
//! the loader's synthesiser): greedy tokens through 2 DP ranks with chunked prefill equal a
//! direct one-entry `Model::forward_step` loop with the same chunks (the runtime adds no numerical difference).

use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::{Engine, EngineConfig, FinishReason, GenerateRequest, ModelFacts};
use deepinfer_model::backend::cpu::argmax;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{LogitsWanted, Model, checkpoint};
use deepinfer_tests::forward_one;
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::NodeConfig;

const CHUNK: usize = 5;

/// Greedy decoding straight on the model, prefilling in `CHUNK`-token chunks.
fn reference(model: &Model, prompt: &[u32], n: usize, eos: u32) -> Vec<u32> {
    let mut seq = model.new_sequence();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(CHUNK) {
        logits = forward_one(model, &mut seq, chunk, LogitsWanted::Last).unwrap();
    }
    let mut out = Vec::new();
    for _ in 0..n {
        let token = argmax(&logits);
        if token == eos {
            break;
        }
        out.push(token);
        logits = forward_one(model, &mut seq, &[token], LogitsWanted::Last).unwrap();
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_tokens_equal_direct_model_forward() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny_v41();
    checkpoint::write_random_checkpoint(&cfg, 7, dir.path(), 2).unwrap();
    let pad = cfg.engram.as_ref().map_or(2, |e| e.pad_token_id);
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, pad).unwrap();
    let model = Arc::new(Model::load_with_vocab(dir.path(), Some(vocab)).unwrap());
    let facts = ModelFacts {
        vocab_size: cfg.vocab_size,
        bos_token_id: cfg.bos_token_id,
        eos_token_id: Some(cfg.eos_token_id),
        max_context_tokens: cfg.max_position_embeddings,
    };
    let node = NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = 2\nep = 1\n\
             [scheduler]\nmax_batched_tokens = 256\nmax_running_requests = 8\nprefill_chunk_tokens = {CHUNK}\n\
             overlap_depth = 2\nadmission_queue_capacity = 16\n[sampling]\nmax_tokens = 6\n"
        ),
        "model test",
    )
    .unwrap();
    let factory = ModelFactory::new(model.clone(), "tiny V4.1");
    let (executor, freed) = FreedLengths::track(Arc::new(factory));
    let config = EngineConfig {
        node,
        executor,
        model: facts,
        tokenizer: None,
    };
    let engine = Engine::start(config).await.unwrap();
    let prompts: Vec<Vec<u32>> = vec![
        (0..12).map(|t| 3 + t * 17 % 500).collect(),
        vec![0, 100, 200],
        (0..21).map(|t| 5 + t * 29 % 507).collect(),
    ];
    let mut streams = Vec::new();
    for p in &prompts {
        streams.push(
            engine
                .generate(GenerateRequest::from_tokens(p.clone()).max_tokens(6))
                .await
                .unwrap(),
        );
    }
    let mut any_tokens = false;
    for (p, stream) in prompts.iter().zip(streams) {
        let done = tokio::time::timeout(Duration::from_secs(120), stream.collect())
            .await
            .unwrap()
            .unwrap();
        let expected = reference(&model, p, 6, cfg.eos_token_id);
        assert_eq!(done.tokens, expected, "prompt {p:?}");
        let reason = if expected.len() == 6 {
            FinishReason::Length
        } else {
            FinishReason::Stop
        };
        assert_eq!(done.reason, reason);
        any_tokens |= !done.tokens.is_empty();
    }
    assert!(any_tokens);
    freed.shutdown_and_check_replay(engine).await;
}
