//! DSpark on the real V4.1 model code (CPU backend): output with DSpark on equals DSpark off
//! token for token, on DeepSeek's v41-tiny fixture and on the built-in demo model.
//!
//! Both checkpoints have random weights, so their drafters are not trained to agree with their
//! targets and their confidence heads are uncalibrated: their own drafts are nearly all rejected.
//! On the CPU a step's cost grows about linearly with its tokens, so the hardware-aware scheduler
//! rightly verifies few drafts. To make the equality meaningful, runs force it to verify every
//! draft: `Confident` reports the highest raw confidence for the real drafted tokens and emulates
//! an accelerator whose step costs a fixed `EMULATED_STEP` on top, whatever its size, so nearly
//! every step verifies five drafts, rejects them and rolls the sequence back. For partial
//! acceptance, an oracle replaces the drafter on both models: it proposes the known continuation
//! (of the DSpark-off run at the same temperature and seed) with a seeded random number (0 to 5)
//! of its drafts right, greedy and seeded (temperature 1), on 2 DP ranks and on 2 DP x 4 EP
//! ranks; the output equals DSpark off and the schedulers accept exactly the drafts the oracle
//! counted right. The fixture also compares seeded sampling and EP with the model's own drafts.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deepinfer_actors::experts::factory::ExpertParallelFactory;
use deepinfer_actors::messages::scheduler::SchedulerStats;
use deepinfer_actors::model_source::build_demo;
use deepinfer_actors::rank::executor::{
    Draft, ExecError, ExecStep, ExecutorFactory, ExecutorLayer, LayeredFactory, RankExecutor,
};
use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::tools::logits;
use deepinfer_actors::{Engine, EngineConfig, ModelFacts};
use deepinfer_model::any_model::AnyModel;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::{EntryOutput, Model};
use deepinfer_tests::confident::Confident;
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::{NodeConfig, RequestId};

mod engine_support;
use engine_support::generate_all;

/// Fixed emulated device time per step of the forced and oracle runs: long enough that the host
/// time of a verify (which grows with its drafts, and with the machine's load; the demo model's
/// 129k-token head is slow on a loaded CPU) never makes verifying drafts look worse.
const EMULATED_STEP: Duration = Duration::from_secs(1);

/// What a correct verifier must make of the oracle's drafts, counted by the oracle as it executes
/// the verifies: per verify entry, the leading verified drafts that equal the reference.
#[derive(Default)]
struct OracleCounts {
    verifies: AtomicU64,
    accepted: AtomicU64,
    /// Verifies with some but not all of their verified drafts right.
    partial: AtomicU64,
}

/// Drafts the known continuation of each sequence (`references`: prompt + the DSpark-off output
/// of the same temperature and seed): the first 0 to 5 drafts true, the number drawn per draft
/// from `seed`, the rest corrupted; on the same emulated device.
struct Oracle {
    histories: HashMap<RequestId, Vec<u32>>,
    references: Arc<Vec<Vec<u32>>>,
    seed: u64,
    counts: Arc<OracleCounts>,
}

impl Oracle {
    fn reference(&self, known: &[u32]) -> Option<&Vec<u32>> {
        self.references.iter().find(|r| r.starts_with(known))
    }

    /// The oracle's proposal after `anchor` for sequence `id`: the known continuation, a seeded
    /// number of its drafts right; `None` for a sequence of no known continuation.
    fn draft_one(&self, id: RequestId, anchor: u32, vocab: u32) -> Option<Draft> {
        let history = self.histories.get(&id)?;
        let mut known = history.clone();
        known.push(anchor);
        let reference = self.reference(&known)?;
        let mut hasher = DefaultHasher::new();
        (self.seed, id, known.len()).hash(&mut hasher);
        let right = (hasher.finish() % 6) as usize;
        let tokens: Vec<u32> = (0..5)
            .map(|i| {
                let truth = reference.get(known.len() + i).copied().unwrap_or(0);
                if i < right {
                    truth
                } else {
                    (truth + 1) % vocab
                }
            })
            .collect();
        Some(Draft {
            confidences: vec![30.0; tokens.len()],
            tokens,
        })
    }
}

impl ExecutorLayer for Oracle {
    fn new_sequence(
        &mut self,
        inner: &mut dyn RankExecutor,
        id: RequestId,
    ) -> Result<(), ExecError> {
        inner.new_sequence(id)?;
        self.histories.insert(id, Vec::new());
        Ok(())
    }
    fn free_sequence(&mut self, inner: &mut dyn RankExecutor, id: RequestId) {
        inner.free_sequence(id);
        self.histories.remove(&id);
    }
    fn rollback(
        &mut self,
        inner: &mut dyn RankExecutor,
        id: RequestId,
        len: usize,
    ) -> Result<(), ExecError> {
        inner.rollback(id, len)?;
        if let Some(history) = self.histories.get_mut(&id) {
            history.truncate(len);
        }
        Ok(())
    }
    fn execute(
        &mut self,
        inner: &mut dyn RankExecutor,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        for entry in batch.iter().filter(|e| e.all_rows) {
            let mut known = self.histories.get(&entry.id).cloned().unwrap_or_default();
            known.push(entry.tokens[0]);
            // Entries of no request's continuation are the DSpark profile's probes.
            let Some(reference) = self.reference(&known) else {
                continue;
            };
            let drafts = &entry.tokens[1..];
            let right = drafts
                .iter()
                .zip(&reference[known.len()..])
                .take_while(|(d, r)| d == r)
                .count();
            let counts = &self.counts;
            counts.verifies.fetch_add(1, Ordering::Relaxed);
            counts.accepted.fetch_add(right as u64, Ordering::Relaxed);
            if right > 0 && right < drafts.len() {
                counts.partial.fetch_add(1, Ordering::Relaxed);
            }
        }
        let rows = inner.execute(ExecStep { batch, sampling })?;
        for entry in batch {
            if let Some(history) = self.histories.get_mut(&entry.id) {
                history.extend_from_slice(entry.tokens);
            }
        }
        Ok(rows)
    }
    fn draft(
        &mut self,
        inner: &mut dyn RankExecutor,
        requests: &[(RequestId, u32)],
    ) -> Result<Vec<Option<Draft>>, ExecError> {
        let vocab = inner.vocab_size() as u32;
        Ok(requests
            .iter()
            .map(|&(id, anchor)| self.draft_one(id, anchor, vocab))
            .collect())
    }
    fn device_latency(&self, _inner: &dyn RankExecutor, _batch_tokens: usize) -> Duration {
        EMULATED_STEP
    }
}

/// DSpark with the oracle's partially right drafts, greedy and seeded (temperature 1), on 2 DP
/// ranks and on 2 DP x 4 EP ranks: the output equals DSpark off, and the schedulers accept
/// exactly the drafts the oracle counted right (so the mean accepted length is the oracle's).
async fn check_oracle(name: &str, model: Arc<Model>, facts: ModelFacts, prompts: &[Vec<u32>]) {
    const MAX_TOKENS: usize = 16;
    let plain: Arc<dyn ExecutorFactory> = Arc::new(ModelFactory::new(model.clone(), name));
    let running = prompts.len().div_ceil(2);
    for temperature in [0.0, 1.0] {
        let (off, _) = generate_at(
            temperature,
            plain.clone(),
            facts,
            node(2, 2, running, false),
            prompts,
            MAX_TOKENS,
        )
        .await;
        let references: Arc<Vec<Vec<u32>>> = Arc::new(
            prompts
                .iter()
                .zip(&off)
                .map(|(p, out)| p.iter().chain(out).copied().collect())
                .collect(),
        );
        for ep in [1, 4] {
            let topology = node_ep(2, ep, 2, running, true);
            let inner: Arc<dyn ExecutorFactory> = if ep == 1 {
                plain.clone()
            } else {
                Arc::new(
                    ExpertParallelFactory::new(model.clone(), &topology, name.into())
                        .expect("expert-parallel factory"),
                )
            };
            let counts = Arc::new(OracleCounts::default());
            let (references, counted) = (references.clone(), counts.clone());
            let oracle: Arc<dyn ExecutorFactory> = Arc::new(LayeredFactory::layered(
                inner,
                "oracle-drafting",
                move |dp| Oracle {
                    histories: HashMap::new(),
                    references: references.clone(),
                    seed: 0x0dd5_eed5 + dp as u64,
                    counts: counted.clone(),
                },
            ));
            let (on, stats) =
                generate_at(temperature, oracle, facts, topology, prompts, MAX_TOKENS).await;
            let run = format!("{name}, temperature {temperature}, dp=2 ep={ep}, oracle drafts");
            assert_eq!(on, off, "{run}: DSpark on vs off");
            let (verifies, accepted, partial) = (
                counts.verifies.load(Ordering::Relaxed),
                counts.accepted.load(Ordering::Relaxed),
                counts.partial.load(Ordering::Relaxed),
            );
            println!(
                "{run}: {verifies} verifies ({partial} partially right), {accepted} drafts right; \
                 mean accepted length {:?} ({stats:?})",
                stats.mean_accepted_length()
            );
            assert_eq!(
                (stats.verify_entries, stats.draft_tokens_accepted),
                (verifies, accepted),
                "{run}: verifies and accepted drafts against the oracle's count"
            );
            assert_eq!(
                stats.mean_accepted_length(),
                Some((verifies + accepted) as f64 / verifies as f64),
                "{run}: the mean accepted length is the oracle's"
            );
            assert!(
                partial > 0,
                "{run}: some verifies accept part of their drafts"
            );
            assert!(accepted > 0, "{run}: some drafts are accepted");
        }
    }
}

fn node(dp: usize, overlap: usize, running: usize, dspark: bool) -> NodeConfig {
    node_ep(dp, 1, overlap, running, dspark)
}

fn node_ep(dp: usize, ep: usize, overlap: usize, running: usize, dspark: bool) -> NodeConfig {
    let text = format!(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = {dp}\nep = {ep}\n\
         [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = {running}\nprefill_chunk_tokens = 16\n\
         overlap_depth = {overlap}\nadmission_queue_capacity = 8\n\
         [dspark]\nenabled = {dspark}\nmax_draft_tokens = 5\nprofile_steps = 1\n"
    );
    NodeConfig::from_toml_str(&text, "dspark model test").expect("topology")
}

/// Outputs of `prompts` (in order; greedy at temperature 0, else seeded sampling) and the
/// summed scheduler stats.
async fn generate_at(
    temperature: f32,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
    node: NodeConfig,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, SchedulerStats) {
    let (factory, freed) = FreedLengths::track(factory);
    let engine = Engine::start(EngineConfig {
        node,
        executor: factory,
        model: facts,
        tokenizer: None,
    })
    .await
    .expect("engine starts");
    let outputs = generate_all(
        &engine,
        prompts,
        max_tokens,
        (temperature, 5),
        Duration::from_secs(300),
    )
    .await;
    let mut total = SchedulerStats::default();
    for s in engine.handle().scheduler_stats().await.expect("stats") {
        total.draft_tokens_proposed += s.draft_tokens_proposed;
        total.draft_tokens_verified += s.draft_tokens_verified;
        total.draft_tokens_accepted += s.draft_tokens_accepted;
        total.verify_entries += s.verify_entries;
        total.rejecting_verifies += s.rejecting_verifies;
    }
    // Bounded replay is on by default: the `ReplayActor` followed every step's positions, took
    // one rewind per verify that rejected a draft, refused none, and freed every request.
    let replay = engine
        .handle()
        .replay_stats()
        .await
        .expect("replay stats")
        .expect("bounded replay is on");
    assert_eq!(
        (replay.refused, replay.live, replay.rewinds),
        (0, 0, total.rejecting_verifies),
        "replay stats {replay:?} against the schedulers' {total:?}"
    );
    freed.shutdown_and_check_replay(engine).await;
    (outputs, total)
}

/// Runs `prompts` on `dp` ranks with `overlap` plans in flight, with DSpark off, on verifying
/// every draft and, when `own_confidences`, on with the model's own confidences; asserts equal
/// outputs.
async fn check_lossless(
    name: &str,
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
    (dp, overlap): (usize, usize),
    prompts: &[Vec<u32>],
    max_tokens: usize,
    own_confidences: bool,
) {
    let running = prompts.len().div_ceil(dp);
    let (off, _) = generate(
        factory.clone(),
        facts,
        node(dp, overlap, running, false),
        prompts,
        max_tokens,
    )
    .await;
    let own = if own_confidences {
        let (on, own) = generate(
            factory.clone(),
            facts,
            node(dp, overlap, running, true),
            prompts,
            max_tokens,
        )
        .await;
        assert_eq!(on, off, "{name}: DSpark on (own confidences) vs off");
        Some(own)
    } else {
        None
    };
    let forced_factory: Arc<dyn ExecutorFactory> =
        Arc::new(Confident::factory(factory, EMULATED_STEP));
    let (forced_on, forced) = generate(
        forced_factory,
        facts,
        node(dp, overlap, running, true),
        prompts,
        max_tokens,
    )
    .await;
    for out in &off {
        assert_eq!(out.len(), max_tokens);
    }
    assert_eq!(
        forced_on, off,
        "{name}: DSpark on (every draft verified) vs off"
    );
    let runs = own
        .map(|own| ("own confidences", own))
        .into_iter()
        .chain([("every draft verified", forced)]);
    for (label, stats) in runs {
        println!(
            "{name}, {label}: proposed {}, verified {}, accepted {}, verify entries {}, mean accepted length {:?}",
            stats.draft_tokens_proposed,
            stats.draft_tokens_verified,
            stats.draft_tokens_accepted,
            stats.verify_entries,
            stats.mean_accepted_length()
        );
        assert!(stats.draft_tokens_proposed > 0, "{name}: the drafter ran");
        assert!(stats.verify_entries > 0, "{name}: drafts were verified");
        assert!(
            stats.draft_tokens_accepted <= stats.draft_tokens_verified,
            "{name}, {label}: {stats:?}"
        );
    }
    // How many drafts a verify takes depends on the profiled step rates (real CPU time + the
    // emulated device step), so under machine load it varies; at least one per verify on average
    // still shows that the scheduler verifies the confident drafts.
    assert!(
        forced.draft_tokens_verified >= forced.verify_entries,
        "{name}: the forced run verifies drafts in most steps ({forced:?})"
    );
}

/// Greedy outputs and stats (see `generate_at`).
async fn generate(
    factory: Arc<dyn ExecutorFactory>,
    facts: ModelFacts,
    node: NodeConfig,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, SchedulerStats) {
    generate_at(0.0, factory, facts, node, prompts, max_tokens).await
}

fn fixture() -> PathBuf {
    deepinfer_tests::fixture_dir("v41/v41-tiny")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dspark_output_equals_plain_decoding_on_the_fixture() {
    let dir = fixture();
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("fixture config");
    let vocab = logits::engram_vocab_for_dir(&dir, &cfg).expect("stub vocabulary");
    let model = Arc::new(Model::load_with_vocab(&dir, vocab).expect("fixture loads"));
    let facts = ModelFacts {
        vocab_size: cfg.vocab_size,
        bos_token_id: cfg.bos_token_id,
        eos_token_id: Some(cfg.eos_token_id),
        max_context_tokens: cfg.max_position_embeddings,
    };
    let factory: Arc<dyn ExecutorFactory> =
        Arc::new(ModelFactory::new(model.clone(), "v41-tiny fixture"));
    let prompts = vec![
        vec![
            482, 319, 349, 457, 296, 396, 425, 117, 31, 155, 147, 445, 465, 5, 256, 419, 69, 407,
            63, 240, 416, 156, 176, 144, 367, 132, 506, 228, 245, 258,
        ],
        vec![7, 8, 9],
        (100..120).collect(),
    ];
    check_lossless(
        "v41-tiny",
        factory.clone(),
        facts,
        (2, 2),
        &prompts,
        24,
        true,
    )
    .await;

    check_oracle("v41-tiny", model.clone(), facts, &prompts).await;

    // Seeded sampling: the acceptance rule reproduces the non-speculative sample exactly.
    let forced: Arc<dyn ExecutorFactory> =
        Arc::new(Confident::factory(factory.clone(), EMULATED_STEP));
    let sample =
        |factory, dspark| generate_at(1.0, factory, facts, node(2, 2, 2, dspark), &prompts, 16);
    let (sampled_off, _) = sample(factory.clone(), false).await;
    let (sampled_on, sampled_stats) = sample(forced, true).await;
    assert_eq!(
        sampled_on, sampled_off,
        "v41-tiny: seeded sampling with DSpark on vs off"
    );
    let (greedy_off, _) = generate(factory, facts, node(2, 2, 2, false), &prompts, 16).await;
    assert_ne!(
        sampled_off, greedy_off,
        "temperature 1 differs from greedy somewhere"
    );
    println!("v41-tiny, seeded sampling, every draft verified: {sampled_stats:?}");
    assert!(sampled_stats.draft_tokens_verified >= sampled_stats.verify_entries);

    // With expert parallelism (2 DP ranks, 4 EP ranks): verifying and rolling back drafts whose
    // routed experts run on the expert shards changes no token either.
    let ep_node = node_ep(2, 4, 2, 2, true);
    let ep_factory: Arc<dyn ExecutorFactory> = Arc::new(Confident::factory(
        Arc::new(
            ExpertParallelFactory::new(model.clone(), &ep_node, "v41-tiny fixture".into())
                .expect("expert-parallel factory"),
        ),
        EMULATED_STEP,
    ));
    let (ep_on, ep_stats) = generate(ep_factory, facts, ep_node, &prompts, 16).await;
    assert_eq!(
        ep_on, greedy_off,
        "v41-tiny: DSpark on with dp=2, ep=4 vs off"
    );
    println!("v41-tiny, dp=2 ep=4, every draft verified: {ep_stats:?}");
    assert!(ep_stats.draft_tokens_verified > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dspark_greedy_equals_plain_greedy_on_the_demo_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = build_demo(dir.path()).expect("demo model");
    let prompts = vec![vec![0, 4211, 9, 1234, 77, 5000]];
    check_lossless(
        "demo",
        demo.factory,
        demo.facts,
        (1, 1),
        &prompts,
        10,
        false,
    )
    .await;
    let AnyModel::V41(model) = demo.model else {
        panic!("the demo model is a V4.1 model")
    };
    let prompts = vec![vec![0, 4211, 9, 1234, 77, 5000], vec![0, 17, 300, 4000]];
    check_oracle("demo", model, demo.facts, &prompts).await;
}
