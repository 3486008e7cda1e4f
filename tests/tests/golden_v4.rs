//! Golden tests of the DeepSeek-V4 forward pass on the CPU backend against Hugging Face
//! transformers 5.17 in float32 (`tests/fixtures/v4/v4-tiny`, tolerance from its README: every
//! `logits_*` row within 1e-4 × the logit range, greedy tokens equal), plus the chunking / verify /
//! rollback invariance of the per-sequence state on the fixture and on reduced random checkpoints
//! in the official format (FP8 128×128 tiles, FP4 experts, sharded; V4-Flash with its MTP block and
//! V4-Flash-0731 with its DSpark drafter, both ignored by the backbone as transformers does).

mod golden_support;

use std::path::Path;

use deepinfer_model::any_model::{AnyModel, AnySequence, AnyStepEntry, StepOptions};
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::v4::{Model, SequenceState};
use deepinfer_model::{EntryOutput, LogitsWanted};
use deepinfer_tests::forward_one_v4;
use golden_support::{Expected, argmax, ids};
use serde_json::Value;

/// README tolerance, relative to `max − min` of `logits_full`.
const TOLERANCE: f32 = 1e-4;

struct Fixture {
    model: Model,
    data: Expected,
}

impl std::ops::Deref for Fixture {
    type Target = Expected;
    fn deref(&self) -> &Expected {
        &self.data
    }
}

impl Fixture {
    fn load() -> Fixture {
        let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
        Fixture {
            model: Model::load(&dir).expect("fixture model loads"),
            data: Expected::read(&dir),
        }
    }

    fn ids(&self, key: &str) -> Vec<u32> {
        ids(&self.case()[key])
    }

    fn schedule(&self, label: &str) -> Vec<usize> {
        self.case()["schedules"][label]
            .as_array()
            .unwrap_or_else(|| panic!("schedule {label}"))
            .iter()
            .map(|v| v.as_u64().expect("chunk size") as usize)
            .collect()
    }

    /// `max − min` of `logits_full`.
    fn logit_range(&self) -> f32 {
        self.range_of("logits_full")
    }
}

/// Feeds `tokens` chunk by chunk through a fresh sequence and concatenates every row's logits.
fn run_schedule(model: &Model, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    run_schedule_with_state(model, tokens, chunks).0
}

/// [`run_schedule`], also returning the sequence state it leaves.
fn run_schedule_with_state(
    model: &Model,
    tokens: &[u32],
    chunks: &[usize],
) -> (Vec<f32>, SequenceState) {
    let mut seq = model.new_sequence();
    let mut logits = Vec::new();
    let mut start = 0;
    for &chunk in chunks {
        let rows = forward_one_v4(
            model,
            &mut seq,
            &tokens[start..start + chunk],
            LogitsWanted::All,
        )
        .expect("forward");
        logits.extend(rows);
        start += chunk;
    }
    assert_eq!(start, tokens.len(), "schedule covers the input");
    (logits, seq)
}

/// The largest per-position `max |Δ|` over rows, and the row where it occurs.
fn worst_row(ours: &[f32], reference: &[f32], vocab: usize) -> (f32, usize) {
    assert_eq!(ours.len(), reference.len());
    ours.chunks_exact(vocab)
        .zip(reference.chunks_exact(vocab))
        .enumerate()
        .map(|(t, (a, b))| {
            let diff = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            (diff, t)
        })
        .fold(
            (0.0, 0),
            |best, cur| if cur.0 > best.0 { cur } else { best },
        )
}

fn assert_matches(fx: &Fixture, label: &str, logits: &[f32]) {
    let vocab = fx.model.config().vocab_size;
    let range = fx.logit_range();
    let (diff, row) = worst_row(logits, &fx.f32(label), vocab);
    eprintln!(
        "{label}: max |Δ| / range = {:.3e} at row {row}",
        diff / range
    );
    assert!(
        diff <= TOLERANCE * range,
        "{label}: row {row} differs by {diff} (> {TOLERANCE} × range {range})"
    );
}

#[test]
fn full_prefill_matches_transformers() {
    let fx = Fixture::load();
    let tokens = fx.ids("input_ids");
    let logits = run_schedule(&fx.model, &tokens, &[tokens.len()]);
    assert_matches(&fx, "logits_full", &logits);
}

#[test]
fn chunked_prefill_and_decode_match_transformers() {
    let fx = Fixture::load();
    let tokens = fx.ids("input_ids");
    for label in ["chunked", "decode"] {
        let logits = run_schedule(&fx.model, &tokens, &fx.schedule(label));
        assert_matches(&fx, &format!("logits_{label}"), &logits);
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    let fx = Fixture::load();
    let tokens = fx.ids("input_ids");
    let expected = fx.ids("greedy_tokens");
    let model = &fx.model;
    let mut seq = model.new_sequence();
    let mut last = forward_one_v4(model, &mut seq, &tokens, LogitsWanted::Last).expect("prefill");
    let mut greedy = Vec::with_capacity(expected.len());
    for _ in 0..expected.len() {
        let next = argmax(&last);
        greedy.push(next);
        last = forward_one_v4(model, &mut seq, &[next], LogitsWanted::Last).expect("decode");
    }
    assert_eq!(greedy, expected);
}

/// Bit-level comparison of two logits runs of the same model.
fn assert_identical(what: &str, ours: &[f32], reference: &[f32], vocab: usize) {
    assert_eq!(ours.len(), reference.len(), "{what}: row count");
    let (diff, row) = worst_row(ours, reference, vocab);
    assert!(diff == 0.0, "{what}: row {row} differs by {diff}");
}

/// Speculative verification on `tokens`: after a prefill of `prefix`, every step verifies the next
/// `accept` true tokens followed by `reject` wrong ones, keeps the rows of the accepted ones and
/// rolls the rejected ones back. Returns the concatenated kept rows.
fn run_with_rollbacks(model: &Model, tokens: &[u32], prefix: usize) -> Vec<f32> {
    let vocab = model.config().vocab_size;
    let mut seq = model.new_sequence();
    let mut logits =
        forward_one_v4(model, &mut seq, &tokens[..prefix], LogitsWanted::All).expect("prefill");
    let mut position = prefix;
    let mut step = 0usize;
    while position < tokens.len() {
        let accept = (1 + step % 5).min(tokens.len() - position);
        let reject = 6 - accept.min(5);
        let mut chunk = tokens[position..position + accept].to_vec();
        chunk.extend((0..reject).map(|i| ((tokens[position] as usize + 7 * i + 3) % vocab) as u32));
        let rows = forward_one_v4(model, &mut seq, &chunk, LogitsWanted::All).expect("verify");
        logits.extend_from_slice(&rows[..accept * vocab]);
        model
            .rollback(&mut seq, position + accept)
            .expect("rollback within the budget");
        assert_eq!(seq.len(), position + accept);
        position += accept;
        step += 1;
    }
    // Rolling back further than the rings hold is refused, not silently wrong.
    assert!(model.rollback(&mut seq, 0).is_err());
    assert!(model.rollback(&mut seq, tokens.len() + 1).is_err());
    logits
}

/// Chunked prefill, prefill + 40 single-token decode steps and verify/rollback over the last 40
/// tokens all give the one-shot logits bit for bit (every op is row-independent), and the
/// compressed caches hold ⌊T/m⌋ entries.
fn assert_state_invariance(model: &Model, tokens: &[u32]) {
    let vocab = model.config().vocab_size;
    let n = tokens.len();
    let (one_shot, seq) = run_schedule_with_state(model, tokens, &[n]);
    assert!(one_shot.iter().all(|v| v.is_finite()));
    let mut odd = vec![3, 1, 9, 6, 17, 2];
    let covered: usize = odd.iter().sum();
    odd.push(n - covered);
    assert_identical(
        "chunked",
        &run_schedule(model, tokens, &odd),
        &one_shot,
        vocab,
    );
    let decode: Vec<usize> = std::iter::once(n - 40)
        .chain(std::iter::repeat_n(1, 40))
        .collect();
    assert_identical(
        "decode",
        &run_schedule(model, tokens, &decode),
        &one_shot,
        vocab,
    );
    assert_identical(
        "verify/rollback",
        &run_with_rollbacks(model, tokens, n - 40),
        &one_shot,
        vocab,
    );

    let cfg = model.config();
    let v4 = cfg.v4.as_ref().expect("a V4 config");
    for layer in 0..cfg.n_layers {
        let ratio = cfg.compress_ratio(layer);
        let entries = seq.compressed_entries(layer).map(<[_]>::len);
        let keys = seq.index_keys(layer).map(<[_]>::len);
        match ratio {
            0 => assert_eq!((entries, keys), (None, None), "layer {layer}"),
            r if r == v4.csa_ratio => {
                assert_eq!((entries, keys), (Some(n / r), Some(n / r)), "layer {layer}")
            }
            r => assert_eq!((entries, keys), (Some(n / r), None), "layer {layer}"),
        }
    }
}

#[test]
fn fixture_state_is_chunking_verify_and_rollback_invariant() {
    let fx = Fixture::load();
    assert_state_invariance(&fx.model, &fx.ids("input_ids"));
}

/// The reduced V4-Flash in the official format (FP8 128×128 tiles, FP4 experts, MTP block, three
/// shards, no `model.` prefix) loads through the family dispatch and runs; 140 tokens cross the
/// HCA rate 128 and the window 16 many times.
#[test]
fn reduced_official_checkpoint_loads_runs_and_is_invariant() {
    let cfg = ModelConfig::reduced_v4();
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 7, dir.path(), 3).expect("checkpoint written");
    assert_official_format(dir.path());
    let AnyModel::V4(model) = AnyModel::load(dir.path(), None).expect("loads") else {
        panic!("a deepseek_v4 config must load as the V4 model");
    };
    assert_eq!(model.config(), &cfg);
    let vocab = cfg.vocab_size as u32;
    let tokens: Vec<u32> = (0..140u32).map(|i| (i * 37 + 11) % vocab).collect();
    assert_state_invariance(&model, &tokens);
}

/// The written checkpoint really is in the official layout the test claims.
fn assert_official_format(dir: &Path) {
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("index parses");
    let map = index["weight_map"].as_object().expect("weight_map");
    let shards: std::collections::BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
    assert_eq!(shards.len(), 3);
    for name in [
        "layers.3.attn.wq_a.scale",
        "layers.0.ffn.experts.0.w1.scale",
        "layers.0.ffn.gate.tid2eid",
        "mtp.0.e_proj.weight",
    ] {
        assert!(map.contains_key(name), "{name} in the index");
    }
    assert!(!map.keys().any(|k| k.starts_with("model.")));
}

/// The family dispatch gives the V4 model the `logits` tool runs: same rows as [`Model`].
#[test]
fn any_model_dispatches_the_fixture_to_v4() {
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    let fx = Fixture::load();
    let any = AnyModel::load(&dir, None).expect("loads");
    assert!(matches!(any, AnyModel::V4(_)));
    let tokens = &fx.ids("input_ids")[..20];
    let mut seq = any.new_sequence();
    assert!(matches!(seq, AnySequence::V4(_)));
    let forward = |seq: &mut AnySequence, chunk: &[u32]| {
        let mut entry = [AnyStepEntry::new(seq, chunk, LogitsWanted::All)];
        let output = any.forward_step(&mut entry, StepOptions::default());
        output
            .expect("forward")
            .pop()
            .and_then(EntryOutput::into_logits)
    };
    let mut rows = forward(&mut seq, &tokens[..12]).expect("logits");
    rows.extend(forward(&mut seq, &tokens[12..]).expect("logits"));
    assert_eq!(seq.len(), 20);
    let direct = run_schedule(&fx.model, tokens, &[20]);
    assert_identical("AnyModel", &rows, &direct, fx.model.config().vocab_size);
    any.rollback(&mut seq, 17).expect("rollback");
    assert_eq!(seq.len(), 17);
}

/// A V4-Flash-0731-style checkpoint (DSpark drafter in `mtp.0..2`, which the backbone ignores like
/// transformers does) loads and runs its backbone; chunking changes nothing.
#[test]
fn reduced_dspark_checkpoint_runs_its_backbone() {
    let cfg = ModelConfig::reduced_v4_dspark();
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 11, dir.path(), 2).expect("checkpoint written");
    let any = AnyModel::load(dir.path(), None).expect("loads");
    let AnyModel::V4(model) = &any else {
        panic!("a deepseek_v4 config must load as the V4 model");
    };
    let tokens: Vec<u32> = (0..24u32).map(|i| (i * 53 + 5) % 512).collect();
    let one_shot = run_schedule(model, &tokens, &[24]);
    assert!(one_shot.iter().all(|v| v.is_finite()));
    assert_ne!(one_shot[..512], one_shot[512..1024]);
    let chunked = run_schedule(model, &tokens, &[5, 1, 18]);
    assert_identical("chunked", &chunked, &one_shot, 512);
}
