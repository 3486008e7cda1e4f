//! An `Engine` dropped without `shutdown` stops its actor tree: its rank threads exit instead of
//! staying parked until the process ends. (Its own test binary: it counts this process's
//! threads by name, which other tests' engines would disturb.)

use std::time::{Duration, Instant};

use deepinfer_actors::rank::fake::FakeConfig;
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest};
use deepinfer_topology::NodeConfig;

/// Threads of this process whose name starts like a rank thread's (`deepinfer-rank-dpN`, cut
/// to 15 bytes by Linux).
fn rank_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("deepinfer-rank"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_engine_ends_its_rank_threads() {
    if !std::path::Path::new("/proc/self/task").is_dir() {
        eprintln!("skipped: no /proc on this system");
        return;
    }
    let node = NodeConfig::from_toml_str(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = 3\nep = 1\n",
        "drop test",
    )
    .expect("topology");
    let engine = Engine::start(EngineConfig::fake(node, FakeConfig::default()))
        .await
        .expect("engine starts");
    let stream = engine
        .generate(GenerateRequest::from_tokens(vec![5, 6]).max_tokens(4))
        .await
        .expect("admitted");
    stream.collect().await.expect("completes");
    assert_eq!(rank_threads(), 3, "one thread per DP rank while it runs");

    drop(engine);
    let deadline = Instant::now() + Duration::from_secs(10);
    while rank_threads() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} rank threads still alive 10 s after the drop",
            rank_threads()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
