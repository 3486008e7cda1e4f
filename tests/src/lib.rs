//! deepinfer-tests: shared harness for the cross-crate integration and golden tests, and the one
//! way they find the golden fixtures kept in the repository (`tests/fixtures/`).

use std::path::PathBuf;

/// The variable that points the tests at another copy of `tests/fixtures/` (the GPU suite sets
/// it on the H200, where this build's source tree is not at the path it was built from).
pub const FIXTURES_ENV: &str = "DEEPINFER_FIXTURES";

/// `$DEEPINFER_FIXTURES`, else this repository's `tests/fixtures/`.
pub fn fixtures_root() -> PathBuf {
    std::env::var_os(FIXTURES_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures"))
}

/// The fixture directory `rel` under [`fixtures_root`] (e.g. `"v41/v41-tiny"`). Panics, naming the
/// path, when it holds no `config.json`: a missing fixture fails the test, never skips it.
pub fn fixture_dir(rel: &str) -> PathBuf {
    let dir = fixtures_root().join(rel);
    assert!(
        dir.join("config.json").is_file(),
        "fixture {rel} is missing: no {} (the fixtures live in tests/fixtures/; ${FIXTURES_ENV} \
         overrides their root)",
        dir.join("config.json").display()
    );
    dir
}

/// A file of the fixture `rel` (e.g. `fixture_file("v4/v4-tiny", "config.json")`), which must exist.
pub fn fixture_file(rel: &str, file: &str) -> PathBuf {
    let path = fixture_dir(rel).join(file);
    assert!(path.is_file(), "fixture file {} is missing", path.display());
    path
}

/// The V4.1 fixture `rel` (e.g. `"v41/v41-odd"`) loaded on the host with its stub Engram
/// vocabulary (fixture README "Tokenizer and Engram": compressed id = token id / 2).
pub fn v41_model(rel: &str) -> deepinfer_model::Model {
    let dir = fixture_dir(rel);
    let cfg = deepinfer_model::config::ModelConfig::from_file(&dir.join("config.json"))
        .unwrap_or_else(|e| panic!("{rel} config.json: {e}"));
    let pad = cfg
        .engram
        .as_ref()
        .unwrap_or_else(|| panic!("{rel} has no Engram"))
        .pad_token_id;
    let vocab = deepinfer_model::engram::CompressedVocab::halving_stub(cfg.vocab_size, pad)
        .expect("stub vocabulary");
    deepinfer_model::Model::load_with_vocab(&dir, Some(vocab))
        .unwrap_or_else(|e| panic!("{rel} loads: {e}"))
}

/// The test form of one sequence's forward: `tokens` appended to `seq` by a one-entry
/// `forward_step` of `model` with the default options; its `want`ed logits rows.
pub fn forward_one(
    model: &deepinfer_model::Model,
    seq: &mut deepinfer_model::SequenceState,
    tokens: &[u32],
    want: deepinfer_model::LogitsWanted,
) -> Result<Vec<f32>, deepinfer_model::error::ModelError> {
    use deepinfer_model::{EntryOutput, StepEntry, StepOptions};
    model
        .forward_step(
            &mut [StepEntry::new(seq, tokens, want)],
            StepOptions::default(),
        )
        .and_then(EntryOutput::one_entry_logits)
}

/// [`forward_one`] for a V4-family model.
pub fn forward_one_v4(
    model: &deepinfer_model::v4::Model,
    seq: &mut deepinfer_model::v4::SequenceState,
    tokens: &[u32],
    want: deepinfer_model::LogitsWanted,
) -> Result<Vec<f32>, deepinfer_model::error::ModelError> {
    use deepinfer_model::v4::{EntryOutput, StepEntry};
    model
        .forward_step(
            &mut [StepEntry::new(seq, tokens, want)],
            deepinfer_model::StepOptions::default(),
        )
        .and_then(EntryOutput::one_entry_logits)
}

/// [`forward_one`] for a model of either family.
pub fn forward_one_any(
    model: &deepinfer_model::any_model::AnyModel,
    seq: &mut deepinfer_model::any_model::AnySequence,
    tokens: &[u32],
    want: deepinfer_model::LogitsWanted,
) -> Result<Vec<f32>, deepinfer_model::error::ModelError> {
    use deepinfer_model::any_model::{AnyStepEntry, StepOptions};
    model
        .forward_step(
            &mut [AnyStepEntry::new(seq, tokens, want)],
            StepOptions::default(),
        )
        .and_then(deepinfer_model::EntryOutput::one_entry_logits)
}

/// The v41-tiny fixture model ([`v41_model`]).
pub fn v41_tiny_model() -> deepinfer_model::Model {
    v41_model("v41/v41-tiny")
}

/// The V4.1 fixture `rel` ([`v41_model`]) with room for `positions` tokens: its weights under a
/// copy of its `config.json` in `dir` whose `max_position_embeddings` is `positions` (the
/// fixtures' contexts are short; a long prefill test needs more).
pub fn v41_model_with_positions(
    rel: &str,
    positions: usize,
    dir: &std::path::Path,
) -> deepinfer_model::Model {
    let source = fixture_dir(rel);
    for entry in std::fs::read_dir(&source).expect("fixture directory") {
        let entry = entry.expect("fixture entry");
        let target = dir.join(entry.file_name());
        if entry.file_name() == "config.json" {
            let text = std::fs::read_to_string(entry.path()).expect("config.json");
            let mut config: serde_json::Value = serde_json::from_str(&text).expect("config json");
            let text_config = config
                .get_mut("text_config")
                .expect("a V4.1 config has text_config");
            text_config["max_position_embeddings"] = positions.into();
            std::fs::write(&target, config.to_string()).expect("config copy");
        } else {
            std::os::unix::fs::symlink(entry.path(), &target).expect("fixture link");
        }
    }
    let cfg = deepinfer_model::config::ModelConfig::from_file(&dir.join("config.json"))
        .unwrap_or_else(|e| panic!("{rel} config.json: {e}"));
    let pad = cfg.engram.as_ref().expect("Engram").pad_token_id;
    let vocab = deepinfer_model::engram::CompressedVocab::halving_stub(cfg.vocab_size, pad)
        .expect("stub vocabulary");
    deepinfer_model::Model::load_with_vocab(dir, Some(vocab))
        .unwrap_or_else(|e| panic!("{rel} with {positions} positions loads: {e}"))
}

/// The logits rows of `tokens` appended to `seq`: a one-entry [`AnyModel::forward_step`], the
/// one forward form ([`deepinfer_model::any_model::AnyModel`]).
///
/// [`AnyModel::forward_step`]: deepinfer_model::any_model::AnyModel::forward_step
pub fn forward(
    model: &deepinfer_model::any_model::AnyModel,
    seq: &mut deepinfer_model::any_model::AnySequence,
    tokens: &[u32],
    want: deepinfer_model::LogitsWanted,
) -> Result<Vec<f32>, deepinfer_model::error::ModelError> {
    use deepinfer_model::any_model::{AnyStepEntry, StepOptions};
    let mut entry = [AnyStepEntry::new(seq, tokens, want)];
    let output = model
        .forward_step(&mut entry, StepOptions::default())?
        .pop();
    Ok(output
        .and_then(deepinfer_model::EntryOutput::into_logits)
        .unwrap_or_default())
}

pub mod confident;
pub mod conformance;
pub mod data;
pub mod drift;
pub mod freed;
pub mod nudged;
