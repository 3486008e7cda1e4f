//! `Model::draft_step` drafts the DSpark proposals of many sequences in one pass; each proposal
//! (tokens, logits, confidences) must be bitwise what `Model::draft` gives for its sequence alone,
//! and a bad request must fail only itself. The rank executor's `draft` over many sequences gives
//! the same drafts as over one sequence at a time.

use deepinfer_actors::rank::executor::{Draft, ExecError, RankExecutor, SeqTokens, execute_rows};
use deepinfer_actors::rank::model_executor::ModelExecutor;
use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{DraftProposal, LogitsWanted, Model, SequenceState};
use deepinfer_tests::forward_one;
use deepinfer_topology::RequestId;
use std::sync::Arc;

fn synthetic_model(dir: &std::path::Path) -> Model {
    let cfg = ModelConfig::tiny_v41();
    write_random_checkpoint(&cfg, 11, dir, 1).expect("checkpoint written");
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, 2).expect("stub vocabulary");
    Model::load_with_vocab(dir, Some(vocab)).expect("model loads")
}

fn tokens(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 131) >> 7) % vocab as u32)
        .collect()
}

/// Prompt lengths of the five sequences: one token, inside the window (16), past it, and long.
const PROMPTS: [usize; 5] = [1, 6, 17, 45, 120];

/// Five sequences of different lengths (the last two also decoded one more token), with an
/// anchor each.
fn sequences(model: &Model) -> Vec<(SequenceState, u32)> {
    let vocab = model.config().vocab_size;
    PROMPTS
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut seq = model.new_sequence();
            forward_one(
                model,
                &mut seq,
                &tokens(i as u32 + 1, len, vocab),
                LogitsWanted::Last,
            )
            .expect("prompt");
            if i >= 3 {
                forward_one(model, &mut seq, &[(7 * i) as u32], LogitsWanted::Last)
                    .expect("decode");
            }
            (seq, (37 * i as u32 + 5) % vocab as u32)
        })
        .collect()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn assert_bitwise(got: &DraftProposal, expected: &DraftProposal, what: &str) {
    assert_eq!(got.tokens, expected.tokens, "{what}: tokens");
    assert_eq!(bits(&got.logits), bits(&expected.logits), "{what}: logits");
    assert_eq!(
        bits(&got.confidence),
        bits(&expected.confidence),
        "{what}: confidences"
    );
}

#[test]
fn a_draft_step_over_five_sequences_equals_each_draft_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synthetic_model(dir.path());
    let cfg = model.config().clone();
    let block = cfg
        .dspark
        .as_ref()
        .expect("tiny V4.1 has DSpark")
        .block_size;
    let seqs = sequences(&model);
    let alone: Vec<DraftProposal> = seqs
        .iter()
        .map(|(seq, anchor)| model.draft(seq, *anchor).expect("draft alone"))
        .collect();
    let requests: Vec<(&SequenceState, u32)> =
        seqs.iter().map(|(seq, anchor)| (seq, *anchor)).collect();
    let batched = model.draft_step(&requests);
    assert_eq!(batched.len(), seqs.len());
    for (i, (got, expected)) in batched.iter().zip(&alone).enumerate() {
        let got = got.as_ref().expect("batched draft");
        assert_eq!(got.tokens.len(), block + 1, "sequence {i}: anchor + drafts");
        assert_eq!(got.tokens[0], seqs[i].1, "sequence {i}: the anchor leads");
        assert_eq!(got.logits.len(), block * cfg.vocab_size, "sequence {i}");
        assert_eq!(got.confidence.len(), block, "sequence {i}");
        assert_bitwise(got, expected, &format!("sequence {i}"));
    }
    // The proposals depend on their own sequence: no two are the same.
    for i in 0..alone.len() {
        for j in i + 1..alone.len() {
            assert_ne!(
                bits(&alone[i].logits),
                bits(&alone[j].logits),
                "sequences {i} and {j} drafted the same logits"
            );
        }
    }
    // Order and repetition do not matter: reversed, with one sequence twice (another anchor).
    let mut shuffled: Vec<(&SequenceState, u32)> = requests.iter().rev().copied().collect();
    shuffled.push((&seqs[2].0, seqs[4].1));
    let again = model.draft_step(&shuffled);
    for (k, result) in again.iter().take(seqs.len()).enumerate() {
        let i = seqs.len() - 1 - k;
        let got = result.as_ref().expect("reversed draft");
        assert_bitwise(got, &alone[i], &format!("reversed, sequence {i}"));
    }
    let other_anchor = model.draft(&seqs[2].0, seqs[4].1).expect("other anchor");
    let got = again[seqs.len()].as_ref().expect("repeated sequence");
    assert_bitwise(got, &other_anchor, "sequence 2 with another anchor");
    assert!(model.draft_step(&[]).is_empty());
}

#[test]
fn a_bad_anchor_fails_only_its_request_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synthetic_model(dir.path());
    let vocab = model.config().vocab_size;
    let seqs = sequences(&model);
    let lens: Vec<usize> = seqs.iter().map(|(seq, _)| seq.len()).collect();
    let alone: Vec<DraftProposal> = seqs
        .iter()
        .map(|(seq, anchor)| model.draft(seq, *anchor).expect("draft alone"))
        .collect();
    let bad_anchor = vocab as u32 + 3;
    let empty = model.new_sequence();
    let mut requests: Vec<(&SequenceState, u32)> =
        seqs.iter().map(|(seq, anchor)| (seq, *anchor)).collect();
    requests[2].1 = bad_anchor;
    requests.push((&empty, 4));
    let results = model.draft_step(&requests);
    assert_eq!(results.len(), requests.len());
    let message = results[2]
        .as_ref()
        .expect_err("an anchor outside the vocabulary")
        .to_string();
    assert!(
        message.contains(&bad_anchor.to_string()) && message.contains("vocabulary"),
        "{message}"
    );
    let message = results[5]
        .as_ref()
        .expect_err("a sequence without tokens")
        .to_string();
    assert!(message.contains("processed token"), "{message}");
    for i in [0, 1, 3, 4] {
        let got = results[i].as_ref().expect("good request");
        assert_bitwise(got, &alone[i], &format!("sequence {i} beside bad requests"));
    }
    // Nothing changed: the same lengths, and the same drafts afterwards.
    for (i, (seq, anchor)) in seqs.iter().enumerate() {
        assert_eq!(seq.len(), lens[i], "sequence {i}: length");
        let after = model.draft(seq, *anchor).expect("draft afterwards");
        assert_bitwise(&after, &alone[i], &format!("sequence {i} afterwards"));
    }
    let alone_bad = model
        .draft(&seqs[2].0, bad_anchor)
        .expect_err("the bad anchor alone");
    assert_eq!(
        alone_bad.to_string(),
        results[2]
            .as_ref()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    );
}

#[test]
fn the_executor_drafts_a_step_in_one_call_as_one_by_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = Arc::new(synthetic_model(dir.path()));
    let vocab = model.config().vocab_size;
    let mut executor = ModelExecutor::new(model);
    let ids: Vec<RequestId> = (0..PROMPTS.len() as u64).map(RequestId).collect();
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, &len)| tokens(i as u32 + 20, len, vocab))
        .collect();
    for &id in &ids {
        executor.new_sequence(id).expect("new sequence");
    }
    let batch: Vec<SeqTokens<'_>> = ids
        .iter()
        .zip(&prompts)
        .map(|(&id, prompt)| SeqTokens {
            id,
            tokens: prompt,
            all_rows: false,
        })
        .collect();
    execute_rows(&mut executor, &batch).expect("prompt step");
    let requests: Vec<(RequestId, u32)> = ids
        .iter()
        .map(|&id| (id, (id.0 as u32 * 53 + 9) % vocab as u32))
        .collect();
    let one_by_one: Vec<Option<Draft>> = requests
        .iter()
        .flat_map(|&request| executor.draft(&[request]).expect("draft"))
        .collect();
    let many = executor.draft(&requests).expect("draft");
    assert_eq!(many.len(), requests.len());
    for (i, (got, expected)) in many.iter().zip(&one_by_one).enumerate() {
        let (got, expected) = (
            got.as_ref().expect("a drafter"),
            expected.as_ref().expect("a drafter"),
        );
        assert_eq!(got.tokens, expected.tokens, "request {i}: tokens");
        assert_eq!(
            bits(&got.confidences),
            bits(&expected.confidences),
            "request {i}: confidences"
        );
    }
    // An unknown sequence or a bad anchor fails the call, naming the request.
    let unknown = RequestId(99);
    let err = executor
        .draft(&[requests[0], (unknown, 1)])
        .expect_err("unknown sequence");
    assert_eq!(err, ExecError::UnknownSequence(unknown));
    let err = executor
        .draft(&[requests[0], (ids[3], vocab as u32)])
        .expect_err("bad anchor");
    assert!(
        matches!(&err, ExecError::Sequence { id, message } if *id == ids[3] && message.contains("vocabulary")),
        "{err}"
    );
}
