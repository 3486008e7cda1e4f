//! Context parallelism of a long prefill (`deepinfer_model::v41::context_parallel`) against the
//! single-rank prefill, on the v41-tiny fixture (given room for the long prompt) and on the demo
//! model, with cp = 2 and cp = 4 (mirror split): the logits and every rank's final sequence state
//! are bitwise the single-rank prefill's, and so are the greedy decode steps that follow. The
//! prompt lengths put piece boundaries inside ratio-2 compression groups (asserted). Both prompts
//! are the long prefill (~2k tokens: 128 windows, ~1k compressed groups). The engine with
//! `[parallel] context_parallel = 2` generates the same tokens as without, and refuses executors
//! that do not run the topology's context parallelism; a V4-family model with CP is refused at
//! start.

use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::rank::context_parallel::ContextParallelFactory;
use deepinfer_actors::rank::executor::ExecutorFactory;
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::{Engine, EngineConfig, EngineError, GenerateRequest, ModelFacts};
use deepinfer_model::v41::context_parallel::{CpSplit, rank_rows};
use deepinfer_model::{LogitsWanted, Model, SequenceState};
use deepinfer_tests::drift;
use deepinfer_tests::forward_one;
use deepinfer_topology::NodeConfig;

const DECODE_STEPS: usize = 3;

/// The CP chunk's length (odd piece boundaries at cp 2 and cp 4: 4 ∤ len + 1, 8 ∤ len + 1).
const PROMPT_TOKENS: usize = 2050;

/// A deterministic prompt of `n` ids in `3..vocab`, with a repeated stretch (Engram n-grams fire).
fn prompt(n: usize, vocab: u32) -> Vec<u32> {
    drift::prompt(n, 3, vocab - 3)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Greedy decode steps after a prefill whose last logits row is `last`: every step's logits.
fn decode(model: &Model, seq: &mut SequenceState, last: &[f32]) -> Vec<Vec<f32>> {
    let mut next = drift::argmax(last) as u32;
    (0..DECODE_STEPS)
        .map(|_| {
            let logits = forward_one(model, seq, &[next], LogitsWanted::Last).expect("decode step");
            next = drift::argmax(&logits) as u32;
            logits
        })
        .collect()
}

/// Some piece boundary of the mirror split of `len` tokens after `prefix` falls inside a ratio-2
/// compression group (the group's two tokens are computed on two ranks).
fn splits_a_group(prefix: usize, len: usize, ranks: usize) -> bool {
    (0..ranks).any(|r| {
        let rows = rank_rows(len, ranks, r, CpSplit::Mirror);
        let first = rows[0] + prefix;
        let end = rows[rows.len() - 1] + prefix + 1;
        first % 2 == 1 || end % 2 == 1
    })
}

/// Prefills `tokens[prefix..]` after a single-rank prefill of `tokens[..prefix]`, on one rank and
/// on `ranks` CP ranks, and compares logits, states and decode steps bit for bit.
fn cp_equals_single_rank(model: &Model, tokens: &[u32], prefix: usize, want: LogitsWanted) {
    let vocab = model.config().vocab_size;
    let mut single = model.new_sequence();
    if prefix > 0 {
        forward_one(model, &mut single, &tokens[..prefix], LogitsWanted::Last).expect("prefix");
    }
    let before = single.clone();
    let chunk = &tokens[prefix..];
    let logits = forward_one(model, &mut single, chunk, want).expect("single-rank prefill");
    let single_decode = decode(model, &mut single.clone(), &logits[logits.len() - vocab..]);
    for ranks in [2, 4] {
        assert!(splits_a_group(prefix, chunk.len(), ranks), "cp {ranks}");
        let cp = model
            .prefill_context_parallel(
                &before,
                chunk,
                want,
                ranks,
                CpSplit::Mirror,
                Duration::from_secs(60),
                None,
            )
            .expect("context-parallel prefill");
        assert_eq!(cp.logits.len(), logits.len(), "cp {ranks}: logits rows");
        assert!(
            bits(&cp.logits) == bits(&logits),
            "cp {ranks}: prefill logits differ from the single-rank prefill's"
        );
        assert_eq!(cp.states.len(), ranks);
        for (rank, state) in cp.states.iter().enumerate() {
            assert!(
                *state == single,
                "cp {ranks}: rank {rank}'s final state differs"
            );
        }
        // The decoding rank (any: every rank holds the whole state) continues bit for bit.
        let mut state = cp.states.into_iter().next_back().expect("a rank");
        let steps = decode(model, &mut state, &cp.logits[cp.logits.len() - vocab..]);
        for (step, (cp_row, row)) in steps.iter().zip(&single_decode).enumerate() {
            assert!(
                bits(cp_row) == bits(row),
                "cp {ranks}: decode step {step} differs"
            );
        }
    }
}

#[test]
fn v41_tiny_long_prefill_with_cp_2_and_4_is_bitwise_the_single_rank_prefill() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = deepinfer_tests::v41_model_with_positions("v41/v41-tiny", 4096, dir.path());
    // 2 tokens, then the CP chunk: odd piece boundaries from an even start.
    let tokens = prompt(2 + PROMPT_TOKENS, model.config().vocab_size as u32);
    cp_equals_single_rank(&model, &tokens, 2, LogitsWanted::All);
}

#[test]
fn demo_model_long_prefill_with_cp_2_and_4_is_bitwise_the_single_rank_prefill() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = drift::demo_model_with_positions(dir.path(), Some(4096));
    // From position 0, one more token: odd piece boundaries again.
    let tokens = prompt(PROMPT_TOKENS + 1, 50_000);
    cp_equals_single_rank(&model, &tokens, 0, LogitsWanted::Last);
}

#[test]
fn a_split_with_fewer_than_two_tokens_per_rank_is_refused() {
    let model = deepinfer_tests::v41_tiny_model();
    let err = model
        .prefill_context_parallel(
            &model.new_sequence(),
            &[5, 6, 7],
            LogitsWanted::Last,
            2,
            CpSplit::Mirror,
            Duration::from_secs(5),
            None,
        )
        .err()
        .expect("3 tokens over 2 ranks is refused");
    assert!(err.to_string().contains("at least 2 per rank"), "{err}");
}

/// A CPU node of one DP rank, with `parallel` as its `[parallel]` lines.
fn node(parallel: &str) -> NodeConfig {
    let text = format!(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\n{parallel}\n\
         [scheduler]\nmax_batched_tokens = 128\nmax_running_requests = 4\nprefill_chunk_tokens = 32\n\
         overlap_depth = 2\nadmission_queue_capacity = 16\n"
    );
    NodeConfig::from_toml_str(&text, "context-parallel test").expect("topology")
}

fn engine_config(
    model: &Model,
    node: NodeConfig,
    executor: Arc<dyn ExecutorFactory>,
) -> EngineConfig {
    let cfg = model.config();
    EngineConfig {
        node,
        executor,
        model: ModelFacts {
            vocab_size: cfg.vocab_size,
            bos_token_id: cfg.bos_token_id,
            eos_token_id: None,
            max_context_tokens: cfg.max_position_embeddings,
        },
        tokenizer: None,
    }
}

/// Greedy tokens of `prompts` (all in flight at once) on an engine over `executor`.
async fn generate(config: EngineConfig, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let engine = Engine::start(config).await.expect("engine starts");
    let mut streams = Vec::new();
    for prompt in prompts {
        let request = GenerateRequest::from_tokens(prompt.clone())
            .max_tokens(4)
            .ignore_eos(true);
        streams.push(engine.generate(request).await.expect("admitted"));
    }
    let mut tokens = Vec::new();
    for stream in streams {
        let done = tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("in time")
            .expect("generated");
        tokens.push(done.tokens);
    }
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shutdown");
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_generates_the_same_tokens_with_context_parallelism_on_and_off() {
    let model = Arc::new(deepinfer_tests::v41_tiny_model());
    let vocab = model.config().vocab_size as u32;
    // 150 tokens: a CP chunk of 2 x 32 (remaining >= 40), another, then 22 in plain chunks;
    // 45 tokens: one CP chunk, then 13 plain; 12 tokens: never CP.
    let prompts = vec![prompt(150, vocab), prompt(45, vocab), prompt(12, vocab)];
    let plain = ModelFactory::new(model.clone(), "tiny V4.1");
    let off = generate(
        engine_config(&model, node("dp = 1"), Arc::new(plain)),
        &prompts,
    )
    .await;
    let on_node = node("dp = 1\ncontext_parallel = 2\ncontext_parallel_min_tokens = 40");
    let cp = on_node.parallel.context_parallel.expect("CP on");
    let factory = ContextParallelFactory {
        model: model.clone(),
        cp,
        experts: None,
        description: "tiny V4.1".into(),
    };
    let on = generate(engine_config(&model, on_node, Arc::new(factory)), &prompts).await;
    assert!(off.iter().all(|t| t.len() == 4), "{off:?}");
    assert_eq!(on, off);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_refuses_executors_that_do_not_run_the_topologys_context_parallelism() {
    let model = Arc::new(deepinfer_tests::v41_tiny_model());
    let plain = ModelFactory::new(model.clone(), "tiny V4.1");
    let node = node("dp = 1\ncontext_parallel = 2");
    let Err(err) = Engine::start(engine_config(&model, node, Arc::new(plain))).await else {
        panic!("an executor without context parallelism is refused");
    };
    assert!(
        matches!(&err, EngineError::Config { field, .. } if field == "parallel.context_parallel"),
        "{err}"
    );
}

#[test]
fn a_v4_model_with_context_parallelism_is_refused_naming_the_field() {
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    let text = format!(
        "[model]\nsource = \"{}\"\n[device]\nbackend = \"cpu\"\n[parallel]\ncontext_parallel = 2\n",
        dir.display()
    );
    let node = NodeConfig::from_toml_str(&text, "v4 cp test").expect("topology");
    let Err(err) = deepinfer_actors::model_source::resolve(&node) else {
        panic!("a V4 model with context_parallel = 2 resolved");
    };
    assert!(
        matches!(&err, EngineError::Config { field, .. } if field == "parallel.context_parallel"),
        "{err}"
    );
}
