//! The byte model of a sequence's state (`deepinfer_model::state_bytes`) against the bytes the
//! real state objects hold: both families, synthetic checkpoints with every state component
//! (Engram, DSpark, the V4 MTP block) and DeepSeek's fixtures, fed in prefill chunks, decode steps
//! and a rollback. The model is exact for a sequence fed forward and an upper bound after a
//! rollback; a drift between what the state holds and what the pool accounts fails here. At a
//! long context the bytes the state keeps alive (`pinned_bytes`) are checked against the model
//! too.

use std::path::Path;

use deepinfer_model::LogitsWanted;
use deepinfer_model::any_model::{AnyModel, AnySequence, AnyStepEntry, StepOptions};
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::state_bytes::StateBytes;

/// Feeds `len` tokens to a fresh sequence in uneven chunks, checking after each chunk that the
/// state holds exactly `StateBytes::bytes(len)`; then rolls back 4 tokens and checks the bound.
fn check(name: &str, model: &AnyModel, len: usize) {
    let bytes = StateBytes::of(model.config());
    let vocab = model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..len as u32).map(|i| (i * 37 + 11) % vocab).collect();
    let mut seq = model.new_sequence();
    let mut fed = 0;
    let mut chunk = 1;
    let mut checked = Vec::new();
    while fed < len {
        let n = chunk.min(len - fed);
        let mut entry = [AnyStepEntry::new(
            &mut seq,
            &tokens[fed..fed + n],
            LogitsWanted::Last,
        )];
        model
            .forward_step(&mut entry, StepOptions::default())
            .expect("forward");
        fed += n;
        assert_eq!(
            seq.held_bytes(),
            bytes.bytes(fed),
            "{name}: state bytes after {fed} tokens (chunk {n})"
        );
        checked.push(fed);
        chunk = if chunk >= 13 { 1 } else { chunk * 3 + 1 };
    }
    model.rollback(&mut seq, len - 4).expect("rollback");
    assert!(
        seq.held_bytes() <= bytes.bytes(len - 4),
        "{name}: after a rollback"
    );
    assert!(
        bytes.blocks_for(len) as u64 * bytes.block_bytes() >= bytes.bytes(len),
        "{name}: the blocks cover the bytes"
    );
    println!(
        "{name}: {} bytes held at {len} tokens = model; checked at {checked:?}",
        bytes.bytes(len)
    );
}

fn synthetic(cfg: &ModelConfig, dir: &Path) -> AnyModel {
    write_random_checkpoint(cfg, 11, dir, 1).expect("checkpoint written");
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, 2).expect("stub vocabulary");
    AnyModel::load(dir, Some(vocab)).expect("model loads")
}

#[test]
fn state_bytes_match_the_synthetic_models_of_both_families() {
    let configs = [
        ("tiny V4.1 (Engram, DSpark)", ModelConfig::tiny_v41()),
        ("tiny V4", ModelConfig::tiny_v4()),
        ("reduced V4 (MTP block)", ModelConfig::reduced_v4()),
        ("reduced V4 (DSpark)", ModelConfig::reduced_v4_dspark()),
    ];
    for (name, cfg) in configs {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = synthetic(&cfg, dir.path());
        // Past the window, past two blocks, through groups of every ratio.
        let len = cfg.window_size + 2 * StateBytes::of(&cfg).block_tokens + 5;
        check(name, &model, len.min(cfg.max_position_embeddings));
    }
}

#[test]
fn state_bytes_match_the_fixtures() {
    for (name, dir) in [("v41-tiny", "v41/v41-tiny"), ("v4-tiny", "v4/v4-tiny")] {
        let dir = deepinfer_tests::fixture_dir(dir);
        let cfg = ModelConfig::from_file(&dir.join("config.json"))
            .unwrap_or_else(|e| panic!("the {name} fixture is required: {e}"));
        let vocab = CompressedVocab::halving_stub(cfg.vocab_size, 2).expect("stub vocabulary");
        let model = AnyModel::load(&dir, Some(vocab)).expect("fixture loads");
        let len = (cfg.window_size + 2 * StateBytes::of(&cfg).block_tokens + 5)
            .min(cfg.max_position_embeddings);
        check(name, &model, len);
    }
}

/// Tokens of the long context [`long_states_pin_what_the_model_predicts`] fills, in prefill
/// chunks of [`LONG_CHUNK`] (as the device bench's `state` section fills its block, scaled to
/// the small windows: a chunk is many windows long), then [`LONG_DECODE`] decode steps.
const LONG_CONTEXT: usize = 2048;
const LONG_CHUNK: usize = 512;
const LONG_DECODE: usize = 16;

/// `StateBytes::bytes(len)` against what the state holds (its own count: equal) and what it
/// keeps alive (the distinct allocations its rows and entries pin, whole, and the Engram
/// history's capacity: at most 5% more). On a device a row that views a step's buffer pins all
/// of it: a ring left uncompacted after a long chunk pins the chunk's buffers.
fn check_pinned(name: &str, seq: &AnySequence, bytes: &StateBytes) {
    let (planned, held, pinned) = (bytes.bytes(seq.len()), seq.held_bytes(), seq.pinned_bytes());
    println!(
        "{name} at {}: plan {planned}, held {held}, pinned {pinned} ({:.4} x plan)",
        seq.len(),
        pinned as f64 / planned as f64
    );
    assert_eq!(held, planned, "{name}: held at {}", seq.len());
    assert!(
        pinned >= planned && pinned as f64 <= 1.05 * planned as f64,
        "{name}: {pinned} bytes pinned for a plan of {planned} at {} tokens",
        seq.len()
    );
}

#[test]
fn long_states_pin_what_the_model_predicts() {
    let configs = [
        ("tiny V4.1 (Engram, DSpark)", ModelConfig::tiny_v41()),
        ("reduced V4 (MTP block)", ModelConfig::reduced_v4()),
        ("reduced V4 (DSpark)", ModelConfig::reduced_v4_dspark()),
    ];
    for (name, mut cfg) in configs {
        cfg.max_position_embeddings = cfg
            .max_position_embeddings
            .max(LONG_CONTEXT + LONG_DECODE + 1);
        let dir = tempfile::tempdir().expect("tempdir");
        let model = synthetic(&cfg, dir.path());
        let bytes = StateBytes::of(&cfg);
        let vocab = cfg.vocab_size as u32;
        let tokens: Vec<u32> = (0..LONG_CONTEXT as u32)
            .map(|i| (i * 37 + 11) % vocab)
            .collect();
        let mut seq = model.new_sequence();
        for chunk in tokens.chunks(LONG_CHUNK) {
            let mut entry = [AnyStepEntry::new(&mut seq, chunk, LogitsWanted::Last)];
            model
                .forward_step(&mut entry, StepOptions::default())
                .expect("prefill chunk");
        }
        check_pinned(name, &seq, &bytes);
        for step in 0..LONG_DECODE as u32 {
            let token = [(step * 13 + 5) % vocab];
            let mut entry = [AnyStepEntry::new(&mut seq, &token, LogitsWanted::Last)];
            model
                .forward_step(&mut entry, StepOptions::default())
                .expect("decode step");
        }
        check_pinned(name, &seq, &bytes);
    }
}
