//! `Model::forward_step` runs every sequence of a step as rows of one forward; each sequence must
//! get bitwise the logits (and keep bitwise the state) it gets when run alone: prefill chunks of
//! different lengths, decode rows, a DSpark verify, a bounded-replay prefill, all in one step.
//! A bad entry fails the step by its index and changes no sequence.

use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::sampling::{SamplingParams, sample};
use deepinfer_model::{EntryOutput, LogitsWanted, Model, SequenceState, StepEntry, StepOptions};
use deepinfer_tests::forward_one;

fn synthetic_model(dir: &std::path::Path) -> Model {
    let cfg = ModelConfig::tiny_v41();
    write_random_checkpoint(&cfg, 7, dir, 1).expect("checkpoint written");
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, 2).expect("stub vocabulary");
    Model::load_with_vocab(dir, Some(vocab)).expect("model loads")
}

/// The logits of entries that did not sample.
fn logits_of(outputs: Vec<EntryOutput>) -> Vec<Vec<f32>> {
    outputs
        .into_iter()
        .map(|out| {
            out.into_logits()
                .expect("an entry that did not sample returns logits")
        })
        .collect()
}

fn tokens(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % vocab as u32)
        .collect()
}

/// How one sequence of the test is driven: its prompt, whether the prompt returns every row,
/// and its bounded-replay decoder start.
struct Plan {
    prompt: Vec<u32>,
    want: LogitsWanted,
    decoder_from: Option<usize>,
}

fn alone(model: &Model, seq: &mut SequenceState, plan: &Plan, tokens: &[u32]) -> Vec<f32> {
    let want = if seq.is_empty() {
        plan.want
    } else if tokens.len() > 1 {
        LogitsWanted::All
    } else {
        LogitsWanted::Last
    };
    match plan.decoder_from {
        Some(from) => model
            .forward_step(
                &mut [StepEntry {
                    decoder_from: Some(from),
                    ..StepEntry::new(seq, tokens, want)
                }],
                StepOptions::default(),
            )
            .and_then(EntryOutput::one_entry_logits),
        None => forward_one(model, seq, tokens, want),
    }
    .expect("forward alone")
}

#[test]
fn a_step_over_many_sequences_equals_each_sequence_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synthetic_model(dir.path());
    let cfg = model.config().clone();
    let vocab = cfg.vocab_size;
    let keep = cfg.window_size + deepinfer_model::v41::MAX_BACKTRACK;
    let replay_len = keep + 37;
    let plans = [
        (1, LogitsWanted::Last, None),
        (7, LogitsWanted::All, None),
        (33, LogitsWanted::Last, None),
        (70, LogitsWanted::All, None),
        (replay_len, LogitsWanted::Last, Some(replay_len - keep)),
        (130, LogitsWanted::Last, None),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (len, want, decoder_from))| Plan {
        prompt: tokens(i as u32 + 1, len, vocab),
        want,
        decoder_from,
    })
    .collect::<Vec<_>>();
    // Steps after the prompts: which sequences take part and with how many tokens (a verify of
    // anchor + 3 drafts asks for every row).
    let later_steps: [&[(usize, usize)]; 4] = [
        &[(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)],
        &[(5, 1), (3, 4), (0, 1)],
        &[(1, 4), (2, 1), (4, 1)],
        &[(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)],
    ];

    let mut alone_seqs: Vec<SequenceState> = plans.iter().map(|_| model.new_sequence()).collect();
    let mut step_seqs: Vec<SequenceState> = plans.iter().map(|_| model.new_sequence()).collect();

    // Prompts: all six in one step.
    let expected: Vec<Vec<f32>> = plans
        .iter()
        .zip(alone_seqs.iter_mut())
        .map(|(plan, seq)| alone(&model, seq, plan, &plan.prompt))
        .collect();
    let mut entries: Vec<StepEntry<'_>> = plans
        .iter()
        .zip(step_seqs.iter_mut())
        .map(|(plan, seq)| StepEntry {
            seq,
            tokens: &plan.prompt,
            want: plan.want,
            decoder_from: plan.decoder_from,
            sample: None,
        })
        .collect();
    let got = logits_of(
        model
            .forward_step(&mut entries, StepOptions::default())
            .expect("prompt step"),
    );
    assert_eq!(got.len(), plans.len());
    for (i, (got, expected)) in got.iter().zip(&expected).enumerate() {
        assert!(!expected.is_empty(), "sequence {i} returned logits alone");
        assert_eq!(got.len(), expected.len(), "sequence {i}: rows");
        let equal = got
            .iter()
            .zip(expected)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        assert_eq!(equal, expected.len(), "sequence {i}: prompt logits bitwise");
    }

    // Decode and verify steps over changing subsets.
    for (s, step) in later_steps.iter().enumerate() {
        let chunks: Vec<Vec<u32>> = step
            .iter()
            .map(|&(i, n)| tokens(100 + (s * 10 + i) as u32, n, vocab))
            .collect();
        let expected: Vec<Vec<f32>> = step
            .iter()
            .zip(&chunks)
            .map(|(&(i, _), chunk)| alone(&model, &mut alone_seqs[i], &plans[i], chunk))
            .collect();
        let mut pool: Vec<Option<&mut SequenceState>> = step_seqs.iter_mut().map(Some).collect();
        let mut entries: Vec<StepEntry<'_>> = step
            .iter()
            .zip(&chunks)
            .map(|(&(i, n), chunk)| StepEntry {
                seq: pool[i].take().expect("distinct sequences"),
                tokens: chunk,
                want: if n > 1 {
                    LogitsWanted::All
                } else {
                    LogitsWanted::Last
                },
                decoder_from: plans[i].decoder_from,
                sample: None,
            })
            .collect();
        let got = logits_of(
            model
                .forward_step(&mut entries, StepOptions::default())
                .expect("step"),
        );
        for ((&(i, _), got), expected) in step.iter().zip(&got).zip(&expected) {
            assert_eq!(got.len(), expected.len(), "step {s}, sequence {i}: rows");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(expected), "step {s}, sequence {i}: logits");
        }
    }

    // The states match too: the DSpark proposal after each sequence is the same.
    for (i, (a, b)) in alone_seqs.iter().zip(&step_seqs).enumerate() {
        assert_eq!(a.len(), b.len(), "sequence {i}: length");
        let (pa, pb) = (model.draft(a, 3), model.draft(b, 3));
        match (pa, pb) {
            (Ok(pa), Ok(pb)) => {
                assert_eq!(pa.tokens, pb.tokens, "sequence {i}: drafts");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&pa.logits),
                    bits(&pb.logits),
                    "sequence {i}: draft logits"
                );
            }
            (a, b) => assert_eq!(a.is_ok(), b.is_ok(), "sequence {i}: drafting"),
        }
    }
}

#[test]
fn a_bad_entry_fails_the_step_by_index_and_changes_no_sequence() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synthetic_model(dir.path());
    let vocab = model.config().vocab_size;
    let good = tokens(3, 9, vocab);
    let bad = vec![1, vocab as u32 + 5, 2];
    let mut first = model.new_sequence();
    let mut second = model.new_sequence();
    let mut entries = [
        StepEntry {
            seq: &mut first,
            tokens: &good,
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: None,
        },
        StepEntry {
            seq: &mut second,
            tokens: &bad,
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: None,
        },
    ];
    let err = model
        .forward_step(&mut entries, StepOptions::default())
        .expect_err("an id outside the vocabulary");
    let message = err.to_string();
    assert!(
        message.contains("step entry 1") && message.contains(&format!("{}", vocab + 5)),
        "{message}"
    );
    assert_eq!((first.len(), second.len()), (0, 0));
    let mut fresh = model.new_sequence();
    let expected = forward_one(&model, &mut fresh, &good, LogitsWanted::Last).expect("fresh");
    let again =
        forward_one(&model, &mut first, &good, LogitsWanted::Last).expect("the untouched sequence");
    assert_eq!(
        again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

/// Entries that ask to sample get, per wanted row, the token the host sampler picks from that
/// row's logits with the row's next position as the noise counter; entries that do not get their
/// logits, in the same step.
#[test]
fn sampled_entries_get_the_tokens_of_their_logits_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = synthetic_model(dir.path());
    let vocab = model.config().vocab_size;
    let seeded = |seed| SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed,
    };
    // (prompt length, rows wanted, sampling)
    let cases = [
        (5, LogitsWanted::Last, Some(SamplingParams::greedy())),
        (9, LogitsWanted::All, Some(seeded(11))),
        (3, LogitsWanted::All, None),
        (12, LogitsWanted::Last, Some(seeded(12))),
    ];
    let prompts: Vec<Vec<u32>> = cases
        .iter()
        .enumerate()
        .map(|(i, &(len, _, _))| tokens(40 + i as u32, len, vocab))
        .collect();
    let mut alone: Vec<SequenceState> = cases.iter().map(|_| model.new_sequence()).collect();
    let mut stepped: Vec<SequenceState> = cases.iter().map(|_| model.new_sequence()).collect();
    let mut entries: Vec<StepEntry<'_>> = cases
        .iter()
        .zip(&prompts)
        .zip(stepped.iter_mut())
        .map(|((&(_, want, sample), prompt), seq)| StepEntry {
            seq,
            tokens: prompt,
            want,
            decoder_from: None,
            sample,
        })
        .collect();
    let outputs = model
        .forward_step(&mut entries, StepOptions::default())
        .expect("step");
    let mut sampled_rows = 0;
    for (i, (((&(len, want, sampling), prompt), seq), out)) in cases
        .iter()
        .zip(&prompts)
        .zip(alone.iter_mut())
        .zip(outputs)
        .enumerate()
    {
        let logits = forward_one(&model, seq, prompt, want).expect("alone");
        let first_row_position = match want {
            LogitsWanted::All => 0,
            LogitsWanted::Last => len - 1,
        };
        match sampling {
            Some(params) => {
                let expected: Vec<u32> = logits
                    .chunks_exact(vocab)
                    .enumerate()
                    .map(|(r, row)| {
                        let position = (first_row_position + r + 1) as u64;
                        sample(row, &params, position).expect("a token")
                    })
                    .collect();
                sampled_rows += expected.len();
                assert_eq!(
                    out.into_tokens(),
                    Some(expected),
                    "entry {i}: sampled tokens"
                );
            }
            None => assert_eq!(out.into_logits(), Some(logits), "entry {i}: logits"),
        }
    }
    assert_eq!(sampled_rows, 11);
}
