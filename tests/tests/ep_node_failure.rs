//! The supervisor's rule 3 across nodes, in one process: node 0's engine (dp = 4, ep = 2 over two
//! nodes: two DP ranks and one EP rank here) whose peer joined the bootstrap but whose expert
//! server never answers. The request fails within the exchange timeout with an error naming the
//! DP rank, step, layer and EP rank; the whole engine is then `Stopped` (not only the failed DP
//! rank: the other could not complete an exchange either), later requests fail too, and nothing
//! hangs. And live EPLB across nodes: a node that reports its loads but never acknowledges
//! staging fails node 0's rebalance by name within the staging timeout, and the placement in use
//! stays.

mod ep_support;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deepinfer_actors::comm::Comm;
use deepinfer_actors::comm::bootstrap::{self, Member};
use deepinfer_actors::experts::factory::ExpertParallelFactory;
use deepinfer_actors::experts::parallel::EpSettings;
use deepinfer_actors::experts::shard::ExpertSource;
use deepinfer_actors::supervisor::policy::EngineHealth;
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest};
use deepinfer_topology::NodeConfig;
use ep_support::{facts, model};

const EXCHANGE_MS: u64 = 400;

fn loopback(listener: &TcpListener) -> std::net::SocketAddr {
    listener.local_addr().expect("address")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_fails_the_step_by_name_and_stops_the_engine() {
    let (_dir, model) = model();
    let boot = loopback(&TcpListener::bind("127.0.0.1:0").expect("port"));
    let node = NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\nnodes = 2\n[parallel]\ndp = 4\nep = 2\n\
             [cluster]\nnode = 0\nbootstrap = \"{boot}\"\nexchange_timeout_ms = {EXCHANGE_MS}\n"
        ),
        "two-node test",
    )
    .expect("topology");
    // Node 1 joins with an expert address that accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("listener");
    let member = Member {
        node: 1,
        nodes: 2,
        fingerprint: EpSettings::from_node(&node).fingerprint(&ExpertSource::from(model.clone())),
        expert_addr: loopback(&silent),
    };
    let peer =
        std::thread::spawn(move || bootstrap::join(boot, member, Duration::from_secs(60), None));
    let factory = {
        let (model, node) = (model.clone(), node.clone());
        tokio::task::spawn_blocking(move || ExpertParallelFactory::new(model, &node, "test".into()))
            .await
            .expect("bootstrap thread")
            .expect("node 0 joins")
    };
    peer.join().expect("peer thread").expect("node 1 joins");
    assert_eq!(
        factory.parallel.current().shards().len(),
        1,
        "node 0 holds EP rank 0 only"
    );
    let engine = Engine::start(EngineConfig {
        node,
        executor: Arc::new(factory),
        model: facts(&model),
        tokenizer: None,
    })
    .await
    .expect("engine starts");
    assert_eq!(engine.handle().dp_ranks(), 2);

    let started = Instant::now();
    let prompt: Vec<u32> = (10..30).collect();
    let stream = engine
        .generate(GenerateRequest::from_tokens(prompt.clone()).max_tokens(4))
        .await
        .expect("admitted");
    let error = tokio::time::timeout(Duration::from_secs(60), stream.collect())
        .await
        .expect("no hang")
        .expect_err("node 1 never answers");
    let message = error.to_string();
    for part in [
        "step 0 layer 0",
        "EP rank 1 on node 1",
        &format!("did not answer within {EXCHANGE_MS} ms"),
    ] {
        assert!(message.contains(part), "{message} lacks {part:?}");
    }
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(EXCHANGE_MS), "{waited:?}");
    assert!(
        waited < Duration::from_millis(EXCHANGE_MS + 20_000),
        "{waited:?}"
    );

    // Rule 3: the engine stops; later requests fail instead of waiting.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match engine.handle().health().await {
            Ok(EngineHealth::Stopped { reason }) => {
                assert!(
                    reason.contains("failed while expert parallelism spans 2 ranks"),
                    "{reason}"
                );
                break;
            }
            other => assert!(Instant::now() < deadline, "still {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let later = match engine
        .generate(GenerateRequest::from_tokens(prompt).max_tokens(2))
        .await
    {
        Err(refused) => refused.to_string(),
        Ok(stream) => tokio::time::timeout(Duration::from_secs(30), stream.collect())
            .await
            .expect("no hang")
            .expect_err("a stopped engine")
            .to_string(),
    };
    assert!(!later.is_empty());
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shutdown");
    drop(silent);
}

/// Node 1 as node 0's EPLB sees it: it reports heavy, skewed loads for its EP rank (`layers`
/// layers of `slots` slots) and never answers a staging request.
fn loads_but_never_stages(listener: TcpListener, layers: usize, slots: usize) {
    use deepinfer_actors::comm::wire::{Control, ControlReply, Request};
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            match Request::receive(&mut conn) {
                Ok(Some(Request::Control(request))) if request.control == Control::TakeLoads => {
                    let per_slot: Vec<Vec<u64>> = (0..layers)
                        .map(|_| {
                            (0..slots)
                                .map(|s| 100 * (s as u64 + 1) * (s as u64 + 1))
                                .collect()
                        })
                        .collect();
                    let _ = ControlReply::Loads(vec![(0, per_slot)]).send(&mut conn);
                }
                // Staging (or anything else): the connection stays open, unanswered.
                _ => held.push(conn),
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_never_stages_fails_the_rebalance_by_name_and_the_placement_stays() {
    let (_dir, model) = model();
    let boot = loopback(&TcpListener::bind("127.0.0.1:0").expect("port"));
    let staging_seconds = 2;
    let node = NodeConfig::from_toml_str(
        &format!(
            "[model]\nsource = \"demo\"\n[device]\nnodes = 2\n[parallel]\ndp = 2\nep = 2\n\
             [eplb]\nenabled = true\nredundant_experts = 2\nrebalance_interval_steps = 100000\n\
             window_steps = 100000\n\
             [cluster]\nnode = 0\nbootstrap = \"{boot}\"\nexchange_timeout_ms = {EXCHANGE_MS}\n\
             bootstrap_timeout_seconds = {staging_seconds}\n"
        ),
        "two-node EPLB test",
    )
    .expect("topology");
    let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
    let member = Member {
        node: 1,
        nodes: 2,
        fingerprint: EpSettings::from_node(&node).fingerprint(&ExpertSource::from(model.clone())),
        expert_addr: loopback(&listener),
    };
    let layers = model.config().n_layers;
    loads_but_never_stages(listener, layers, 5);
    let peer =
        std::thread::spawn(move || bootstrap::join(boot, member, Duration::from_secs(60), None));
    let factory = {
        let (model, node) = (model.clone(), node.clone());
        tokio::task::spawn_blocking(move || ExpertParallelFactory::new(model, &node, "test".into()))
            .await
            .expect("bootstrap thread")
            .expect("node 0 joins")
    };
    peer.join().expect("peer thread").expect("node 1 joins");
    let parallel = factory.parallel.clone();
    let engine = Engine::start(EngineConfig {
        node,
        executor: Arc::new(factory),
        model: facts(&model),
        tokenizer: None,
    })
    .await
    .expect("engine starts");

    let started = Instant::now();
    let error = parallel
        .rebalance_now()
        .await
        .expect_err("node 1 never stages");
    let waited = started.elapsed();
    let message = error.to_string();
    assert!(
        message.contains("node 1")
            && message.contains(&format!("within {}", staging_seconds * 1000)),
        "{message}"
    );
    assert!(waited >= Duration::from_secs(staging_seconds), "{waited:?}");
    assert!(
        waited < Duration::from_secs(staging_seconds + 30),
        "{waited:?}"
    );
    let status = parallel.eplb_status().await.expect("status");
    assert_eq!(status.epoch.get(), 0, "the placement in use stays");
    assert_eq!(parallel.current().epoch().get(), 0);
    engine
        .shutdown(Duration::from_secs(30))
        .await
        .expect("shutdown");
}
