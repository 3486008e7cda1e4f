//! Decoder bounded replay (spec §3.5) measured end to end: how far the logits move with replay on
//! vs off on the v41-tiny fixture and on the demo model (the prompt rows inside the kept suffix and
//! greedy decode rows after the prefill, teacher-forced with replay off's tokens so the rows are
//! comparable); exactness when nothing is dropped; chunked replay == one-shot replay bit for bit;
//! the bounds (`keep >= window + max_backtracking`, rewinds within `max_backtracking`); and the
//! engine wiring (the `ReplayActor` plans the decoder start at admission, the rank runs it).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use deepinfer_actors::rank::factory::ModelFactory;
use deepinfer_actors::rank::observe::{ObservedFactory, ObservedRow, RankObserver};
use deepinfer_actors::replay::state::ReplayState;
use deepinfer_actors::replay::suffix::ReplayError;
use deepinfer_actors::{Engine, EngineConfig, EngineError, GenerateRequest, ModelFacts};
use deepinfer_model::error::ModelError;
use deepinfer_model::v41::MAX_BACKTRACK;
use deepinfer_model::{EntryOutput, StepEntry, StepOptions};
use deepinfer_model::{LogitsWanted, Model, SequenceState};
use deepinfer_tests::drift::{
    Rows, argmax, check, demo_bounds, demo_model, dependency_halo, drift, fixture_bounds, prompt,
    report,
};
use deepinfer_tests::forward_one;
use deepinfer_tests::freed::FreedLengths;
use deepinfer_topology::{ModelDims, NodeConfig, ReplayConfig, RequestId};

fn replay_state(model: &Model, keep: Option<u32>) -> Result<ReplayState, ReplayError> {
    let config = ReplayConfig {
        decoder_keep_tokens: keep,
        max_backtracking: MAX_BACKTRACK as u32,
    };
    ReplayState::for_model(&config, model.config().window_size, MAX_BACKTRACK)
}

/// Replay off: the prompt in two plain chunks (`[0, from)` with the last row only, `[from, n)`
/// with every row), then `steps` greedy decode steps. Returns the rows and the greedy tokens.
fn run_off(model: &Model, tokens: &[u32], from: usize, steps: usize) -> (Rows, Vec<u32>) {
    let vocab = model.config().vocab_size;
    let mut seq = model.new_sequence();
    if from > 0 {
        forward_one(model, &mut seq, &tokens[..from], LogitsWanted::Last).expect("prefix");
    }
    let prompt =
        forward_one(model, &mut seq, &tokens[from..], LogitsWanted::All).expect("kept rows");
    let mut next = argmax(&prompt[prompt.len() - vocab..]) as u32;
    let (mut decode, mut greedy) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        greedy.push(next);
        let row = forward_one(model, &mut seq, &[next], LogitsWanted::Last).expect("decode");
        next = argmax(&row) as u32;
        decode.extend(row);
    }
    (Rows { prompt, decode }, greedy)
}

/// One chunk of `seq` as a one-entry step whose decoder starts at `from` (bounded replay).
fn replay_step(
    model: &Model,
    seq: &mut SequenceState,
    tokens: &[u32],
    want: LogitsWanted,
    from: usize,
) -> Result<Vec<f32>, ModelError> {
    let entry = StepEntry {
        decoder_from: Some(from),
        ..StepEntry::new(seq, tokens, want)
    };
    model
        .forward_step(&mut [entry], StepOptions::default())
        .and_then(EntryOutput::one_entry_logits)
}

/// Replay on: the prompt through one-entry steps with `decoder_from`, in chunks of `chunks` sizes,
/// then the given decode tokens teacher-forced.
fn run_replay(
    model: &Model,
    tokens: &[u32],
    from: usize,
    chunks: &[usize],
    decode_tokens: &[u32],
) -> (Rows, SequenceState) {
    let mut seq = model.new_sequence();
    let mut prompt = Vec::new();
    let mut start = 0;
    for &size in chunks {
        let end = (start + size).min(tokens.len());
        prompt.extend(
            replay_step(
                model,
                &mut seq,
                &tokens[start..end],
                LogitsWanted::All,
                from,
            )
            .expect("replay chunk"),
        );
        start = end;
    }
    assert_eq!(start, tokens.len(), "the chunks cover the prompt");
    let decode = decode_tokens
        .iter()
        .flat_map(|&t| {
            replay_step(model, &mut seq, &[t], LogitsWanted::Last, from).expect("decode")
        })
        .collect();
    (Rows { prompt, decode }, seq)
}

/// The measurement on the fixture: keep at the minimum (window 16 + 6 = 22), 64 and the default
/// 140; prompts of 200 tokens; 8 greedy decode steps. Measured (CPU reference, max|Δ|/range, mean
/// |Δ|/range, top-1 agreement):
/// - keep 22: kept prompt rows 0.327 / 0.0316 / 12 of 22 (largest row KL 0.235 nats); decode rows
///   0.0587 / 0.0074 / 7 of 8 (KL 0.0105);
/// - keep 64: 0.254 / 0.0125 / 52 of 64 (KL 0.251); decode 0.0068 / 0.0013 / 8 of 8 (KL 1.4e-4);
/// - keep 140: 0.288 / 0.0056 / 127 of 140 (KL 0.300); decode rows bitwise equal (past the
///   90-position dependency halo).
#[test]
fn replay_logits_drift_on_the_fixture_is_bounded() {
    let model = deepinfer_tests::v41_tiny_model();
    let vocab = model.config().vocab_size;
    let halo = dependency_halo(&model);
    assert_eq!(halo, 90, "fixture: window 16, decoder layers 6..12");
    let tokens = prompt(200, 3, 497);
    let steps = 8;
    for keep in [22, 64, 140] {
        let bounds = fixture_bounds(keep);
        let mut replay = replay_state(&model, Some(keep)).expect("valid bound");
        let suffix = replay.admit(RequestId(1), 200).expect("admitted");
        let from = suffix.start as usize;
        assert_eq!(from, 200 - keep as usize);
        let (off, greedy) = run_off(&model, &tokens, from, steps);
        let (on, _) = run_replay(&model, &tokens, from, &[48, 48, 48, 56], &greedy);
        assert_eq!(on.prompt.len(), keep as usize * vocab, "kept rows only");
        let d = drift(&off, &on, vocab);
        report("v41-tiny", keep, tokens.len(), &d);
        check(&d, &bounds, halo);
    }
}

/// The same measurement on the demo model (DeepSeek vocabulary, context 1024, the fixture's
/// architecture): a 600-token prompt, the default keep 140, 4 greedy decode steps. Measured:
/// kept prompt rows max|Δ|/range 0.265, mean 0.0046, top-1 120 of 140, largest row KL 0.242 nats;
/// decode rows bitwise equal.
#[test]
fn replay_logits_drift_on_the_demo_model_is_bounded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = demo_model(dir.path());
    let vocab = model.config().vocab_size;
    let halo = dependency_halo(&model);
    let prompt_len = 600;
    let tokens = prompt(prompt_len, 1000, 60_000);
    let keep = 140;
    let mut replay = replay_state(&model, Some(keep)).expect("valid bound");
    let from = replay
        .admit(RequestId(2), prompt_len as u32)
        .expect("admitted")
        .start as usize;
    assert_eq!(from, prompt_len - keep as usize);
    let (off, greedy) = run_off(&model, &tokens, from, 4);
    let (on, _) = run_replay(&model, &tokens, from, &[256, 256, 88], &greedy);
    let d = drift(&off, &on, vocab);
    report("demo", keep, prompt_len, &d);
    check(&d, &demo_bounds(), halo);
}

/// Chunked replay equals one-shot replay bit for bit under the same decoder start (chunks that
/// end before it, straddle it, or end exactly at it), decode rows included.
#[test]
fn chunked_replay_equals_one_shot_replay_bitwise() {
    let model = deepinfer_tests::v41_tiny_model();
    let vocab = model.config().vocab_size;
    let tokens = prompt(200, 3, 497);
    let keep = 22;
    let from = 200 - keep;
    let decode = [5u32, 77, 300];
    let mut one_shot_seq = model.new_sequence();
    let one_shot = replay_step(&model, &mut one_shot_seq, &tokens, LogitsWanted::All, from)
        .expect("one-shot bounded prefill");
    assert_eq!(one_shot.len(), keep * vocab);
    let one_shot_decode: Vec<f32> = decode
        .iter()
        .flat_map(|&t| {
            forward_one(&model, &mut one_shot_seq, &[t], LogitsWanted::Last).expect("decode")
        })
        .collect();
    let one_shot_draft = model
        .draft(&one_shot_seq, 9)
        .expect("DSpark draft after a bounded prefill");
    for chunks in [
        vec![48, 48, 48, 56],
        vec![100, 78, 22],
        vec![177, 2, 21],
        vec![200],
    ] {
        let (on, seq) = run_replay(&model, &tokens, from, &chunks, &decode);
        assert!(on.prompt == one_shot, "prompt rows, chunks {chunks:?}");
        assert!(
            on.decode == one_shot_decode,
            "decode rows, chunks {chunks:?}"
        );
        assert_eq!(
            model
                .draft(&seq, 9)
                .expect("DSpark draft after a bounded prefill"),
            one_shot_draft,
            "chunks {chunks:?}"
        );
    }
    // A chunk entirely before the decoder start returns no rows, even for `Last`.
    let mut seq = model.new_sequence();
    let none = replay_step(&model, &mut seq, &tokens[..100], LogitsWanted::Last, from)
        .expect("early chunk");
    assert!(none.is_empty());
    assert_eq!(seq.len(), 100);
}

/// keep >= prompt length plans decoder start 0: bitwise the same logits as replay off.
#[test]
fn replay_keeping_the_whole_prompt_is_exact() {
    let model = deepinfer_tests::v41_tiny_model();
    let tokens = prompt(200, 3, 497);
    for keep in [200, 256] {
        let mut replay = replay_state(&model, Some(keep)).expect("valid bound");
        let from = replay.admit(RequestId(3), 200).expect("admitted").start as usize;
        assert_eq!(from, 0);
        let (off, greedy) = run_off(&model, &tokens, 0, 4);
        let (on, _) = run_replay(&model, &tokens, from, &[48, 48, 48, 56], &greedy);
        assert!(on.prompt == off.prompt, "keep {keep}: prompt rows");
        assert!(on.decode == off.decode, "keep {keep}: decode rows");
    }
}

/// keep below window + max_backtracking is a config error (topology and engine admission);
/// a rewind past the bound is an error in the replay state and in the model.
#[test]
fn replay_bounds_are_enforced() {
    let model = deepinfer_tests::v41_tiny_model();
    let window = model.config().window_size as u32;
    assert_eq!(window, 16, "the fixture's sliding window");
    let minimum = window + MAX_BACKTRACK as u32;

    // The topology refuses it when the window is stated, and against the checkpoint's dims.
    let text = format!(
        "[model]\nsliding_window_tokens = {window}\n[replay]\ndecoder_keep_tokens = {}\n",
        minimum - 1
    );
    let error = NodeConfig::from_toml_str(&text, "replay.toml").expect_err("keep too small");
    assert_eq!(error.field(), Some("replay.decoder_keep_tokens"), "{error}");
    let node = NodeConfig::from_toml_str(
        &format!("[replay]\ndecoder_keep_tokens = {}\n", minimum - 1),
        "replay.toml",
    )
    .expect("no window stated: checked against the model later");
    let dims = ModelDims {
        routed_experts: model.config().n_routed_experts as u16,
        sliding_window_tokens: window,
    };
    let error = node.check_model(&dims).expect_err("keep too small");
    assert_eq!(error.field(), Some("replay.decoder_keep_tokens"), "{error}");
    // The replay state (what the engine builds at start) refuses it too, naming the numbers.
    let error = replay_state(&model, Some(minimum - 1)).expect_err("keep too small");
    assert_eq!(
        error,
        ReplayError::KeepTooSmall {
            keep: minimum - 1,
            window,
            max_backtracking: MAX_BACKTRACK as u32
        }
    );
    assert!(replay_state(&model, Some(minimum)).is_ok());

    // A rewind past the bound: refused by the state (nothing changes) and by the model.
    let tokens = prompt(200, 3, 497);
    let mut replay = replay_state(&model, Some(minimum)).expect("valid bound");
    let id = RequestId(4);
    let from = replay.admit(id, 200).expect("admitted").start as usize;
    let mut seq = model.new_sequence();
    replay_step(&model, &mut seq, &tokens, LogitsWanted::Last, from).expect("bounded prefill");
    let drafts = MAX_BACKTRACK as u32 + 1;
    replay_step(
        &model,
        &mut seq,
        &tokens[..drafts as usize],
        LogitsWanted::All,
        from,
    )
    .expect("a verify block");
    replay.written(id, drafts).expect("written");
    assert_eq!(
        replay.rewind(id, 200),
        Err(ReplayError::RewindPastBound {
            requested: drafts,
            max_backtracking: MAX_BACKTRACK as u32
        })
    );
    assert!(
        model.rollback(&mut seq, 200).is_err(),
        "the model's rings cannot undo it either"
    );
    assert_eq!(
        seq.len(),
        200 + drafts as usize,
        "a refused rollback changes nothing"
    );
    replay.rewind(id, 201).expect("within the bound");
    model
        .rollback(&mut seq, 201)
        .expect("within the model's rings");
    assert_eq!(seq.len(), 201);
    assert!(replay.finish(id).is_some());
    assert_eq!(replay.rewind(id, 201), Err(ReplayError::UnknownRequest(id)));
}

/// Records the decoder starts the ranks receive.
#[derive(Default)]
struct PlannedStarts(Mutex<Vec<(RequestId, usize)>>);

impl RankObserver for PlannedStarts {
    fn row(&self, _row: ObservedRow<'_>) {}
    fn replay_planned(&self, _dp: usize, id: RequestId, decoder_from: usize) {
        self.0.lock().expect("starts").push((id, decoder_from));
    }
}

/// The engine's config (its executor wrapped to report the lengths the ranks free).
fn engine_config(
    model: &Arc<Model>,
    keep: u32,
    starts: &Arc<PlannedStarts>,
) -> (EngineConfig, Arc<FreedLengths>) {
    let cfg = model.config();
    let node = NodeConfig::from_toml_str(
        &format!(
            "[parallel]\ndp = 2\nep = 1\n[scheduler]\nmax_batched_tokens = 256\n\
             max_running_requests = 8\nprefill_chunk_tokens = 48\noverlap_depth = 2\n\
             admission_queue_capacity = 16\n[sampling]\nmax_tokens = 6\n\
             [replay]\ndecoder_keep_tokens = {keep}\nmax_backtracking = 6\n"
        ),
        "replay engine test",
    )
    .expect("topology");
    let (executor, freed) = FreedLengths::track(Arc::new(ObservedFactory::new(
        Arc::new(ModelFactory::new(model.clone(), "v41-tiny fixture")),
        starts.clone(),
    )));
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
    (config, freed)
}

/// Greedy tokens straight on the model with bounded replay from `from`, prefilling in 48-token
/// chunks (the engine's schedule).
fn direct_greedy(model: &Model, prompt: &[u32], from: usize, n: usize) -> Vec<u32> {
    let eos = model.config().eos_token_id;
    let mut seq = model.new_sequence();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(48) {
        logits = replay_step(model, &mut seq, chunk, LogitsWanted::Last, from).expect("prefill");
    }
    let mut out = Vec::new();
    for _ in 0..n {
        let token = argmax(&logits) as u32;
        if token == eos {
            break;
        }
        out.push(token);
        logits = forward_one(model, &mut seq, &[token], LogitsWanted::Last).expect("decode");
    }
    out
}

/// The engine wiring: the ReplayActor plans each request's decoder start at admission, the start
/// travels with the request to its rank, and the rank's executor runs the bounded forward: the
/// engine's greedy tokens equal a direct loop of one-entry steps with `decoder_from`; a short
/// prompt keeps everything.
/// A keep below window + max_backtracking refuses to start the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_runs_bounded_replay_planned_at_admission() {
    let model = deepinfer_tests::v41_tiny_model();
    let model = Arc::new(model);
    let starts = Arc::new(PlannedStarts::default());
    let error = Engine::start(engine_config(&model, 21, &starts).0)
        .await
        .expect_err("keep 21 < window 16 + 6");
    match error {
        EngineError::Config { field, .. } => assert_eq!(field, "replay.decoder_keep_tokens"),
        other => panic!("expected a config error, got {other}"),
    }

    let (config, freed) = engine_config(&model, 22, &starts);
    let engine = Engine::start(config).await.expect("engine starts");
    let prompts = [prompt(200, 3, 497), prompt(12, 40, 400)];
    let mut streams = Vec::new();
    for p in &prompts {
        streams.push(
            engine
                .generate(GenerateRequest::from_tokens(p.clone()).max_tokens(6))
                .await
                .expect("admitted"),
        );
    }
    for (p, stream) in prompts.iter().zip(streams) {
        let done = tokio::time::timeout(Duration::from_secs(300), stream.collect())
            .await
            .expect("in time")
            .expect("generated");
        let from = p.len().saturating_sub(22);
        if from > 0 {
            // At keep 22 the first generated token already differs from a full prefill's.
            assert_ne!(
                done.tokens,
                direct_greedy(&model, p, 0, 6),
                "the engine ran the full prefill"
            );
        }
        assert_eq!(
            done.tokens,
            direct_greedy(&model, p, from, 6),
            "prompt of {}",
            p.len()
        );
    }
    freed.shutdown_and_check_replay(engine).await;
    let starts: Vec<usize> = starts
        .0
        .lock()
        .expect("starts")
        .iter()
        .map(|s| s.1)
        .collect();
    assert_eq!(starts, vec![178], "only the long prompt skips decoder rows");
}
