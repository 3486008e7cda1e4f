//! DSpark end to end on the fake backend (its scripted drafter knows how many drafts are right):
//! lossless greedy and seeded output, acceptance length, and verify lengths that follow the
//! drafter's confidences through the profiled step-rate table.

use std::time::Duration;

use deepinfer_actors::messages::scheduler::SchedulerStats;
use deepinfer_actors::rank::fake::{FakeConfig, FakeDrafter, favoured_token};
use deepinfer_actors::{Engine, EngineConfig, GenerateRequest};
use deepinfer_topology::NodeConfig;

const LIMIT: Duration = Duration::from_secs(60);
/// Tokens generated per request.
const GENERATED: usize = 40;

fn node(dp: usize, overlap_depth: usize, dspark: bool) -> NodeConfig {
    let text = format!(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = {dp}\nep = 1\n\
         [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 16\n\
         overlap_depth = {overlap_depth}\nadmission_queue_capacity = 64\n[sampling]\nmax_tokens = 64\n\
         [dspark]\nenabled = {dspark}\nmax_draft_tokens = 5\nprofile_steps = 2\n"
    );
    NodeConfig::from_toml_str(&text, "dspark test").expect("test topology")
}

/// A step takes 2 ms on the emulated device (time for the proposals' trip through the
/// `DSparkActor`) whatever its size, so verifying is free.
fn drafting(correct: usize, confidence: f32) -> FakeConfig {
    FakeConfig {
        device_time: Duration::from_millis(2),
        drafter: Some(FakeDrafter {
            block_size: 5,
            correct,
            confidence,
        }),
        ..FakeConfig::default()
    }
}

/// The greedy chain the fake backend produces after `prompt`.
fn greedy_chain(prompt: &[u32], n: usize, vocab: usize) -> Vec<u32> {
    let mut last = *prompt.last().expect("non-empty prompt");
    (prompt.len() - 1..prompt.len() - 1 + n)
        .map(|position| {
            last = favoured_token(last, position, vocab);
            last
        })
        .collect()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 6, 7], vec![40, 41], (100..130).collect(), vec![9]]
}

/// Runs every prompt concurrently; returns the outputs (in prompt order) and the summed stats.
async fn run(
    node: NodeConfig,
    fake: FakeConfig,
    request: impl Fn(Vec<u32>) -> GenerateRequest,
) -> (Vec<Vec<u32>>, SchedulerStats) {
    let engine = Engine::start(EngineConfig::fake(node, fake))
        .await
        .expect("engine starts");
    let mut streams = Vec::new();
    for prompt in prompts() {
        streams.push(engine.generate(request(prompt)).await.expect("admitted"));
    }
    let mut outputs = Vec::new();
    for stream in streams {
        outputs.push(stream.collect().await.expect("completes").tokens);
    }
    let mut total = SchedulerStats::default();
    for s in engine.handle().scheduler_stats().await.expect("stats") {
        total.draft_tokens_proposed += s.draft_tokens_proposed;
        total.draft_tokens_verified += s.draft_tokens_verified;
        total.draft_tokens_accepted += s.draft_tokens_accepted;
        total.verify_entries += s.verify_entries;
    }
    engine
        .shutdown(Duration::from_secs(10))
        .await
        .expect("shuts down");
    (outputs, total)
}

fn greedy(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest::from_tokens(prompt)
        .max_tokens(GENERATED)
        .ignore_eos(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_is_unchanged_and_several_tokens_are_accepted_per_step() {
    tokio::time::timeout(LIMIT, async {
        let vocab = FakeConfig::default().vocab_size;
        for depth in [1, 2] {
            // Three of every five drafts are right: a full verify yields 3 drafts + the bonus.
            let (on, stats) = run(node(2, depth, true), drafting(3, 5.0), greedy).await;
            let (off, off_stats) = run(node(2, depth, false), drafting(3, 5.0), greedy).await;
            for (prompt, (with, without)) in prompts().iter().zip(on.iter().zip(&off)) {
                assert_eq!(
                    with,
                    &greedy_chain(prompt, GENERATED, vocab),
                    "prompt {prompt:?}"
                );
                assert_eq!(with, without);
            }
            let mean = stats.mean_accepted_length().expect("verifies ran");
            println!("overlap {depth}: mean accepted length {mean:.2} ({stats:?})");
            assert!(stats.draft_tokens_accepted <= 3 * stats.verify_entries);
            // Without any confidences yet the first verifies of a request take no drafts, and
            // under overlap a verify in flight reserves its full length near `max_tokens`.
            assert!(mean > 2.0, "mean accepted length {mean}");
            assert_eq!(off_stats.verify_entries, 0, "DSpark off verifies nothing");
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_lengths_follow_the_drafter_confidence() {
    tokio::time::timeout(LIMIT, async {
        // 4 ms per step + 1 ms per token: a draft pays for itself only if it likely survives.
        let costly = |confidence| FakeConfig {
            device_time: Duration::from_millis(4),
            device_time_per_token: Duration::from_millis(1),
            ..drafting(5, confidence)
        };
        let (_, sure) = run(node(1, 1, true), costly(5.0), greedy).await;
        let (_, unsure) = run(node(1, 1, true), costly(-5.0), greedy).await;
        let per_entry =
            |s: &SchedulerStats| s.draft_tokens_verified as f64 / s.verify_entries.max(1) as f64;
        println!(
            "drafts verified per entry: confident {:.2}, unsure {:.2}",
            per_entry(&sure),
            per_entry(&unsure)
        );
        assert!(per_entry(&sure) > 2.5, "{sure:?}");
        assert_eq!(unsure.draft_tokens_verified, 0, "{unsure:?}");
        assert!(unsure.draft_tokens_proposed > 0, "{unsure:?}");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_with_dspark_is_deterministic() {
    tokio::time::timeout(LIMIT, async {
        let sampled = |prompt: Vec<u32>| {
            GenerateRequest::from_tokens(prompt)
                .max_tokens(GENERATED)
                .ignore_eos(true)
                .temperature(1.0)
                .seed(11)
        };
        let (first, stats) = run(node(2, 2, true), drafting(4, 5.0), sampled).await;
        let (second, _) = run(node(2, 2, true), drafting(4, 5.0), sampled).await;
        let (off, _) = run(node(2, 2, false), drafting(4, 5.0), sampled).await;
        assert_eq!(first, second);
        // The acceptance rule reproduces the non-speculative sample token for token.
        assert_eq!(first, off);
        assert!(stats.draft_tokens_accepted > 0, "{stats:?}");
        // Sampling is not greedy here: some token differs from the greedy chain.
        let vocab = FakeConfig::default().vocab_size;
        assert!(
            prompts()
                .iter()
                .zip(&first)
                .any(|(p, out)| out != &greedy_chain(p, GENERATED, vocab)),
            "temperature 1 should leave the greedy chain somewhere"
        );
    })
    .await
    .expect("test timed out");
}
