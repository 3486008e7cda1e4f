//! Seeded sampling on the built-in demo model (real V4.1 numerics, CPU backend): with a `seed`,
//! a request's tokens are a pure function of the request, whatever batch it runs in, in whatever
//! order the requests arrive and on whatever topology: each request alone on one rank equals
//! all of them at once on 2 DP ranks, and in reverse order on 2 DP x 4 EP ranks. Negative
//! controls: the samples differ from greedy decoding, and another seed changes them. Every
//! engine's `ReplayActor` ends with the ranks' sequence lengths.

use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::experts::factory::ExpertParallelFactory;
use deepinfer_actors::model_source::build_demo;
use deepinfer_actors::rank::executor::ExecutorFactory;
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest, ModelFacts};
use deepinfer_model::any_model::AnyModel;
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::NodeConfig;

const MAX_TOKENS: usize = 8;

fn node(dp: usize, ep: usize) -> NodeConfig {
    let text = format!(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = {dp}\nep = {ep}\n\
         [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 8\nprefill_chunk_tokens = 7\n\
         overlap_depth = 2\nadmission_queue_capacity = 16\n"
    );
    NodeConfig::from_toml_str(&text, "seeded demo test").expect("topology")
}

fn request(prompt: &[u32], temperature: f32, seed: u64) -> GenerateRequest {
    GenerateRequest::from_tokens(prompt.to_vec())
        .max_tokens(MAX_TOKENS)
        .ignore_eos(true)
        .temperature(temperature)
        .seed(seed)
}

/// The tokens of `requests` submitted in `order` (all in flight at once when `together`, else
/// one after the other), by request index.
async fn run(
    node: NodeConfig,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
    requests: &[GenerateRequest],
    order: &[usize],
    together: bool,
) -> Vec<Vec<u32>> {
    let (executor, freed) = FreedLengths::track(factory);
    let engine = Engine::start(EngineConfig {
        node,
        executor,
        model: facts,
        tokenizer: None,
    })
    .await
    .expect("engine starts");
    let mut out = vec![Vec::new(); requests.len()];
    let collect = |stream: deepinfer_actors::EventStream| async move {
        tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("finishes in time")
            .expect("completes")
            .tokens
    };
    if together {
        let mut streams = Vec::new();
        for &i in order {
            let stream = engine
                .generate(requests[i].clone())
                .await
                .expect("admitted");
            streams.push((i, stream));
        }
        for (i, stream) in streams {
            out[i] = collect(stream).await;
        }
    } else {
        for &i in order {
            let stream = engine
                .generate(requests[i].clone())
                .await
                .expect("admitted");
            out[i] = collect(stream).await;
        }
    }
    freed.shutdown_and_check_replay(engine).await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_demo_tokens_do_not_depend_on_batch_order_or_topology() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = build_demo(dir.path()).expect("demo model");
    let AnyModel::V41(model) = demo.model.clone() else {
        panic!("the demo model is a V4.1 model")
    };
    let prompts: Vec<Vec<u32>> = vec![
        vec![0, 4211, 9, 1234, 77, 5000],
        vec![0, 17, 300, 4000, 12, 12, 12, 9, 88, 1024, 3],
        vec![0, 64000],
        vec![0, 99, 98, 97, 96, 95, 94, 93, 92],
    ];
    let seeded: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| request(p, 1.0, 7 + i as u64))
        .collect();
    let forward: Vec<usize> = (0..prompts.len()).collect();
    let reversed: Vec<usize> = forward.iter().rev().copied().collect();

    let alone = run(
        node(1, 1),
        demo.factory.clone(),
        demo.facts,
        &seeded,
        &forward,
        false,
    )
    .await;
    let batched = run(
        node(2, 1),
        demo.factory.clone(),
        demo.facts,
        &seeded,
        &forward,
        true,
    )
    .await;
    let ep_node = node(2, 4);
    let ep_factory: Arc<dyn ExecutorFactory> = Arc::new(
        ExpertParallelFactory::new(model, &ep_node, "demo, expert parallel".into())
            .expect("expert-parallel factory"),
    );
    let ep_reversed = run(ep_node, ep_factory, demo.facts, &seeded, &reversed, true).await;
    println!("seeded demo tokens: {alone:?}");
    for out in &alone {
        assert_eq!(out.len(), MAX_TOKENS);
    }
    assert_eq!(batched, alone, "all at once on dp=2 vs each alone on dp=1");
    assert_eq!(
        ep_reversed, alone,
        "reversed on dp=2 ep=4 vs each alone on dp=1"
    );

    // Negative controls: sampling is not greedy, and the seed matters.
    let greedy: Vec<GenerateRequest> = prompts.iter().map(|p| request(p, 0.0, 0)).collect();
    let reseeded: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| request(p, 1.0, 1000 + i as u64))
        .collect();
    let both: Vec<GenerateRequest> = greedy.into_iter().chain(reseeded).collect();
    let all: Vec<usize> = (0..both.len()).collect();
    let controls = run(node(2, 1), demo.factory, demo.facts, &both, &all, true).await;
    let (greedy, reseeded) = controls.split_at(prompts.len());
    assert_ne!(greedy, &alone[..], "temperature 1 differs from greedy");
    assert_ne!(reseeded, &alone[..], "another seed gives other tokens");
}
