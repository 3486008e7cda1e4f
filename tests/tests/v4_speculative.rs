//! The speculative heads of DeepSeek-V4 on the CPU backend: the V4-Flash MTP block
//! (`v4::Model::mtp_logits`) and the V4-Flash-0731 DSpark drafter (`v4::Model::draft`), on reduced
//! random checkpoints written by the synth writer in the official format (FP8 128×128 tiles, FP4
//! experts, sharded, `mtp.*` names).
//!
//! There is no reference fixture for these heads: transformers drops every `mtp.*` tensor on load,
//! so nothing here is compared with another implementation. The tests pin what must hold whatever
//! the weights are: the heads load and a missing tensor is named; drafts are deterministic, have
//! the documented shapes and greedy tokens; drafting leaves the sequence untouched; the context
//! the heads keep is the same bit for bit however the context was chunked or rolled back; and one
//! component (the Markov bias and the confidence head's Markov half) equals a direct computation
//! from the checkpoint's tensors.

use std::path::Path;

use deepinfer_model::LogitsWanted;
use deepinfer_model::backend::CpuBackend;
use deepinfer_model::checkpoint::{Checkpoint, write_random_checkpoint};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::v4::{DraftProposal, Model, SequenceState};
use deepinfer_tests::forward_one_v4;
use safetensors::Dtype;

mod checkpoint_patch;
use checkpoint_patch::patch_tensor;
use deepinfer_model::backend::cpu::argmax;

/// Context tokens: more than the reduced window (16) so the heads' rings wrap.
const CONTEXT: usize = 30;

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % vocab) as u32).collect()
}

fn written(cfg: &ModelConfig, seed: u64, shards: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(cfg, seed, dir.path(), shards).expect("checkpoint written");
    dir
}

fn load(cfg: &ModelConfig, dir: &Path) -> Model {
    let ckpt = Checkpoint::open(dir).expect("checkpoint opens");
    Model::from_checkpoint(cfg.clone(), &ckpt, Box::new(CpuBackend::new())).expect("model loads")
}

/// Runs `tokens` in chunks of the given sizes on a fresh sequence; returns the state and all rows.
fn prefill(model: &Model, tokens: &[u32], chunks: &[usize]) -> (SequenceState, Vec<f32>) {
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    let mut start = 0;
    for &chunk in chunks {
        rows.extend(
            forward_one_v4(
                model,
                &mut seq,
                &tokens[start..start + chunk],
                LogitsWanted::All,
            )
            .expect("forward"),
        );
        start += chunk;
    }
    assert_eq!(start, tokens.len(), "the chunks cover the tokens");
    (seq, rows)
}

/// A checkpoint whose config asks for a head the files lack fails to load, naming a tensor of
/// the missing namespace.
fn assert_missing_head(written_cfg: &ModelConfig, asked: &ModelConfig, namespace: &str) {
    let dir = written(written_cfg, 3, 1);
    let ckpt = Checkpoint::open(dir.path()).expect("opens");
    let err = Model::from_checkpoint(asked.clone(), &ckpt, Box::new(CpuBackend::new()))
        .expect_err("a missing head must not load");
    let message = err.to_string();
    assert!(
        message.contains(namespace),
        "the error names the missing {namespace} tensor: {message}"
    );
}

#[test]
fn missing_speculative_tensors_are_named() {
    let mtp = ModelConfig::reduced_v4();
    let mut no_mtp = mtp.clone();
    if let Some(v4) = no_mtp.v4.as_mut() {
        v4.mtp_layers = 0;
    }
    assert_missing_head(&no_mtp, &mtp, "`mtp.0.");

    // Two stages written, three asked for: the third stage is named.
    let three = ModelConfig::reduced_v4_dspark();
    let mut two = three.clone();
    if let Some(d) = two.dspark.as_mut() {
        d.n_stages = 2;
    }
    assert_missing_head(&two, &three, "`mtp.2.");
}

/// The MTP logits: deterministic, one vocabulary row, dependent on the anchor; drafting leaves
/// the sequence untouched; chunked or rolled-back contexts give the same logits bit for bit.
#[test]
fn mtp_logits_are_stable_under_chunking_rollback_and_drafting() {
    let cfg = ModelConfig::reduced_v4();
    let dir = written(&cfg, 7, 3);
    let model = load(&cfg, dir.path());
    let vocab = cfg.vocab_size;
    let text = tokens(CONTEXT + 6, vocab);
    let anchor = text[CONTEXT];

    let (seq, _) = prefill(&model, &text[..CONTEXT], &[CONTEXT]);
    let logits = model.mtp_logits(&seq, anchor).expect("mtp logits");
    assert_eq!(logits.len(), vocab);
    assert!(logits.iter().all(|v| v.is_finite()));
    assert_eq!(logits, model.mtp_logits(&seq, anchor).expect("again"));
    let other = model
        .mtp_logits(&seq, (anchor + 1) % vocab as u32)
        .expect("other anchor");
    assert_ne!(logits, other, "the anchor's embedding enters the block");

    // Chunked prefill: the MTP entries of chunk boundaries are computed in the next call.
    let (chunked, _) = prefill(&model, &text[..CONTEXT], &[7, 1, 13, 9]);
    assert_eq!(logits, model.mtp_logits(&chunked, anchor).expect("chunked"));

    // A verify of five wrong tokens rolled back.
    let (mut rolled, _) = prefill(&model, &text[..CONTEXT], &[CONTEXT]);
    let wrong: Vec<u32> = (0..5).map(|i| (anchor + 3 + i) % vocab as u32).collect();
    forward_one_v4(&model, &mut rolled, &wrong, LogitsWanted::All).expect("verify");
    model.rollback(&mut rolled, CONTEXT).expect("rollback");
    assert_eq!(logits, model.mtp_logits(&rolled, anchor).expect("rolled"));
    forward_one_v4(&model, &mut rolled, &text[CONTEXT..], LogitsWanted::All)
        .expect("accepted tokens after the rollback");

    // Drafting does not change what follows: later rows and later MTP logits.
    let (mut drafted, _) = prefill(&model, &text[..CONTEXT], &[CONTEXT]);
    model.mtp_logits(&drafted, anchor).expect("draft");
    let after = forward_one_v4(&model, &mut drafted, &text[CONTEXT..], LogitsWanted::All)
        .expect("after drafting");
    let (straight, rows) = prefill(&model, &text, &[CONTEXT + 6]);
    assert_eq!(after, rows[CONTEXT * vocab..]);
    let next = text[CONTEXT + 5];
    let expected = model.mtp_logits(&straight, next).expect("straight");
    assert_eq!(model.mtp_logits(&drafted, next).expect("drafted"), expected);
    assert_eq!(model.mtp_logits(&rolled, next).expect("rolled"), expected);
    assert!(model.draft(&straight, next).is_err(), "no DSpark stages");
}

/// Checks a proposal's shapes and greedy tokens.
fn assert_well_formed(proposal: &DraftProposal, anchor: u32, block: usize, vocab: usize) {
    assert_eq!(proposal.tokens.len(), block + 1);
    assert_eq!(proposal.tokens[0], anchor);
    assert_eq!(proposal.logits.len(), block * vocab);
    assert_eq!(proposal.confidence.len(), block);
    assert!(proposal.logits.iter().all(|v| v.is_finite()));
    assert!(proposal.confidence.iter().all(|v| v.is_finite()));
    for (k, row) in proposal.logits.chunks_exact(vocab).enumerate() {
        assert_eq!(
            proposal.tokens[k + 1],
            argmax(row),
            "draft {k} is its row's argmax"
        );
    }
}

/// DSpark proposals: shapes, greedy drafts, determinism; drafting leaves the sequence untouched;
/// chunked or rolled-back contexts give the same proposal bit for bit.
#[test]
fn dspark_proposals_are_stable_under_chunking_rollback_and_drafting() {
    let cfg = ModelConfig::reduced_v4_dspark();
    let block = cfg.dspark.as_ref().expect("drafter").block_size;
    let dir = written(&cfg, 11, 2);
    let model = load(&cfg, dir.path());
    let vocab = cfg.vocab_size;
    let text = tokens(CONTEXT + 6, vocab);
    let anchor = text[CONTEXT];

    let (seq, _) = prefill(&model, &text[..CONTEXT], &[CONTEXT]);
    let proposal = model.draft(&seq, anchor).expect("draft");
    assert_well_formed(&proposal, anchor, block, vocab);
    assert_eq!(proposal, model.draft(&seq, anchor).expect("again"));
    let rows: Vec<&[f32]> = proposal.logits.chunks_exact(vocab).collect();
    assert_ne!(rows[0], rows[1], "block slots see different positions");

    let (chunked, _) = prefill(&model, &text[..CONTEXT], &[5, 1, 17, 7]);
    assert_eq!(proposal, model.draft(&chunked, anchor).expect("chunked"));

    let (mut rolled, _) = prefill(&model, &text[..CONTEXT], &[CONTEXT]);
    forward_one_v4(&model, &mut rolled, &proposal.tokens, LogitsWanted::All)
        .expect("verify the whole block");
    model.rollback(&mut rolled, CONTEXT).expect("rollback");
    assert_eq!(proposal, model.draft(&rolled, anchor).expect("rolled"));
    forward_one_v4(&model, &mut rolled, &text[CONTEXT..], LogitsWanted::All)
        .expect("accepted tokens after the rollback");

    let (mut drafted, _) = prefill(&model, &text[..CONTEXT], &[CONTEXT]);
    model.draft(&drafted, anchor).expect("draft");
    let after = forward_one_v4(&model, &mut drafted, &text[CONTEXT..], LogitsWanted::All)
        .expect("after drafting");
    let (straight, all_rows) = prefill(&model, &text, &[CONTEXT + 6]);
    assert_eq!(after, all_rows[CONTEXT * vocab..]);
    let next = text[CONTEXT + 5];
    let expected = model.draft(&straight, next).expect("straight");
    assert_eq!(model.draft(&drafted, next).expect("drafted"), expected);
    assert_eq!(model.draft(&rolled, next).expect("rolled"), expected);
    assert!(model.mtp_logits(&straight, next).is_err(), "no MTP block");
}

/// Hand check of the Markov head: with `markov_w1[anchor] = 0` the first draft row is the base
/// logits `U_0`; with `markov_w1[anchor] = e_j` it is `U_0 + markov_w2[:, j]`, and the raw
/// confidence moves by `w_conf[dim + j]`.
#[test]
fn markov_bias_row_is_w2_times_w1_of_the_anchor() {
    let cfg = ModelConfig::reduced_v4_dspark();
    let dspark = cfg.dspark.clone().expect("drafter");
    let (vocab, dim, rank) = (cfg.vocab_size, cfg.dim, dspark.markov_rank);
    let last = format!("mtp.{}.", dspark.n_stages - 1);
    let w1 = format!("{last}markov_head.markov_w1.weight");
    let dir = written(&cfg, 5, 2);
    let text = tokens(CONTEXT, vocab);
    let anchor = 77u32;
    let j = 5usize;
    let row = anchor as usize * rank * 2..(anchor as usize + 1) * rank * 2;

    let propose = |dir: &Path| {
        let model = load(&cfg, dir);
        let (seq, _) = prefill(&model, &text, &[CONTEXT]);
        model.draft(&seq, anchor).expect("draft")
    };
    patch_tensor(dir.path(), &w1, Dtype::BF16, |data| {
        data[row.clone()].fill(0)
    });
    let base = propose(dir.path());
    patch_tensor(dir.path(), &w1, Dtype::BF16, |data| {
        // bf16 1.0 = 0x3F80, little-endian.
        data[row.start + 2 * j..row.start + 2 * j + 2].copy_from_slice(&[0x80, 0x3f]);
    });
    let biased = propose(dir.path());

    let ckpt = Checkpoint::open(dir.path()).expect("opens");
    let w2 = ckpt
        .bf16_or_f32(
            &format!("{last}markov_head.markov_w2.weight"),
            &[vocab, rank],
        )
        .expect("w2");
    let conf = ckpt
        .bf16_or_f32(
            &format!("{last}confidence_head.proj.weight"),
            &[1, dim + rank],
        )
        .expect("confidence");
    let scale = base.logits[..vocab]
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let mut moved = 0;
    for v in 0..vocab {
        let observed = biased.logits[v] - base.logits[v];
        let expected = w2[v * rank + j];
        assert!(
            (observed - expected).abs() <= 4.0 * f32::EPSILON * (scale + expected.abs()),
            "vocab {v}: bias {observed} vs markov_w2[{v}, {j}] = {expected}"
        );
        moved += usize::from(expected != 0.0);
    }
    assert!(moved > vocab / 2, "the checked column is not trivial");
    let conf_shift = biased.confidence[0] - base.confidence[0];
    let expected = conf[dim + j];
    assert!(
        (conf_shift - expected).abs() <= 1e-5 * (1.0 + base.confidence[0].abs()),
        "confidence moves by {conf_shift}, w_conf[dim + {j}] = {expected}"
    );
    assert_eq!(base.tokens[1], argmax(&base.logits[..vocab]));
}
