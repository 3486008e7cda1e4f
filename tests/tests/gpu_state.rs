//! GPU tests of what a sequence's state keeps alive on the device (`pinned_bytes`: every buffer a
//! row or entry views, whole) against the byte model (`StateBytes`, what the state pool admits
//! by). On a device a row is a view of the buffer its step produced, so a ring or cache that
//! keeps views of a long chunk's or a batched step's buffers pins more than it holds; the CPU
//! backend copies rows and cannot show it (`state_bytes.rs` checks the same bound there).
//!
//! - After a chunked prefill (synthetic tiny V4.1 with Engram and DSpark, reduced V4 with the MTP
//!   block, reduced V4 with DSpark): every ring was compacted at the chunk's end, every cache
//!   entry is a row of a chunk buffer the sequence holds whole.
//! - After batched decode steps (four V4.1 sequences, each step's entries in one shared buffer)
//!   and then solo steps: the entries of the batched steps were packed into buffers of their own.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a CUDA driver every test fails, naming why.
#![cfg(feature = "cuda")]

use std::path::Path;

use deepinfer_model::LogitsWanted;
use deepinfer_model::any_model::{AnyModel, AnySequence, AnyStepEntry, StepOptions};
use deepinfer_model::checkpoint::{Checkpoint, write_random_checkpoint};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::state_bytes::StateBytes;

mod gpu_support;

use gpu_support::cuda_backend;

/// Prompt tokens, prefill chunk (longer than the rings: the chunk's end compacts them) and the
/// positions every config must reach.
const PROMPT: usize = 384;
const CHUNK: usize = 128;
const MAX_POSITIONS: usize = 1024;

/// `cfg` (positions raised to [`MAX_POSITIONS`]) with a random checkpoint in `dir`, on device 0.
fn cuda_model(test: &str, mut cfg: ModelConfig, dir: &Path) -> AnyModel {
    cfg.max_position_embeddings = cfg.max_position_embeddings.max(MAX_POSITIONS);
    write_random_checkpoint(&cfg, 11, dir, 1).expect("checkpoint written");
    let vocab = cfg.engram.as_ref().map(|engram| {
        CompressedVocab::halving_stub(cfg.vocab_size, engram.pad_token_id).expect("vocab")
    });
    let ckpt = Checkpoint::open(dir).expect("checkpoint opens");
    AnyModel::from_checkpoint(cfg, &ckpt, vocab, Box::new(cuda_backend(test))).expect("model")
}

/// One forward of `tokens[i]` appended to `seqs[i]`, all in one step.
fn step(model: &AnyModel, seqs: &mut [AnySequence], tokens: &[Vec<u32>]) {
    let mut entries: Vec<AnyStepEntry<'_>> = seqs
        .iter_mut()
        .zip(tokens)
        .map(|(seq, tokens)| AnyStepEntry::new(seq, tokens, LogitsWanted::Last))
        .collect();
    model
        .forward_step(&mut entries, StepOptions::default())
        .expect("forward step");
}

/// A prompt of `len` tokens keyed by `seed`.
fn prompt(model: &AnyModel, seed: u32, len: usize) -> Vec<u32> {
    let vocab = model.config().vocab_size as u32;
    (0..len as u32)
        .map(|i| (i * 37 + seed * 101 + 11) % vocab)
        .collect()
}

/// Holds exactly the byte model and pins at most 5% more.
fn check_pinned(what: &str, model: &AnyModel, seq: &AnySequence) {
    let planned = StateBytes::of(model.config()).bytes(seq.len());
    let (held, pinned) = (seq.held_bytes(), seq.pinned_bytes());
    println!(
        "{what} at {}: plan {planned}, held {held}, pinned {pinned} ({:.4} x plan)",
        seq.len(),
        pinned as f64 / planned as f64
    );
    assert_eq!(held, planned, "{what}: held");
    assert!(
        pinned >= planned && pinned as f64 <= 1.05 * planned as f64,
        "{what}: {pinned} bytes pinned for a plan of {planned}"
    );
}

#[test]
fn a_chunked_prefill_pins_what_the_model_predicts() {
    const TEST: &str = "a_chunked_prefill_pins_what_the_model_predicts";
    let configs = [
        ("tiny V4.1 (Engram, DSpark)", ModelConfig::tiny_v41()),
        ("reduced V4 (MTP block)", ModelConfig::reduced_v4()),
        ("reduced V4 (DSpark)", ModelConfig::reduced_v4_dspark()),
    ];
    for (name, cfg) in configs {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = cuda_model(TEST, cfg, dir.path());
        let tokens = prompt(&model, 0, PROMPT);
        let mut seq = [model.new_sequence()];
        for chunk in tokens.chunks(CHUNK) {
            step(&model, &mut seq, &[chunk.to_vec()]);
        }
        check_pinned(name, &model, &seq[0]);
    }
}

#[test]
fn batched_decode_leaves_each_sequence_entries_of_its_own() {
    const TEST: &str = "batched_decode_leaves_each_sequence_entries_of_its_own";
    let dir = tempfile::tempdir().expect("tempdir");
    let model = cuda_model(TEST, ModelConfig::tiny_v41(), dir.path());
    let mut seqs: Vec<AnySequence> = (0..4).map(|_| model.new_sequence()).collect();
    for (s, seq) in seqs.iter_mut().enumerate() {
        let tokens = prompt(&model, s as u32, PROMPT / 2 + 8 * s);
        step(&model, std::slice::from_mut(seq), &[tokens]);
    }
    // Batched steps: every KV source emits one buffer of all four sequences' entries a step.
    let vocab = model.config().vocab_size as u32;
    for t in 0..80u32 {
        let tokens: Vec<Vec<u32>> = (0..4u32)
            .map(|s| vec![(t * 13 + s * 7 + 5) % vocab])
            .collect();
        step(&model, &mut seqs, &tokens);
    }
    // The survivor alone long enough that its rings hold only its own rows and its caches look
    // at their tails again (64 groups of the ratio-2 sources).
    seqs.truncate(1);
    for t in 0..80u32 {
        step(&model, &mut seqs, &[vec![(t * 17 + 3) % vocab]]);
    }
    check_pinned("tiny V4.1 after batched decode", &model, &seqs[0]);
}
