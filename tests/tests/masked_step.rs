//! Grammar-constrained rows through the model (CPU reference): `Model::forward_step` with `StepOptions::logits_on_device`
//! leaves the unsampled entries' rows on the backend (`EntryOutput::DeviceLogits`, bitwise the
//! logits `forward_step` returns) and samples the sampling entries inside the step as before;
//! `Model::sample_rows` then samples the kept rows with their masks exactly as the host path
//! does (logits read, disallowed set to -inf, `sampling::sample`). A row of the wrong width or a
//! mask that allows nothing fails the call naming the row.

use deepinfer_model::checkpoint::write_random_checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::sampling::{AllowedTokens, SamplingParams, sample};
use deepinfer_model::{
    EntryOutput, LogitsRow, LogitsWanted, Model, SequenceState, StepEntry, StepOptions,
};

fn synthetic_model(dir: &std::path::Path) -> Model {
    let cfg = ModelConfig::tiny_v41();
    write_random_checkpoint(&cfg, 11, dir, 1).expect("checkpoint written");
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, 2).expect("stub vocabulary");
    Model::load_with_vocab(dir, Some(vocab)).expect("model loads")
}

fn prompt(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 131) >> 5) % vocab as u32)
        .collect()
}

/// One step over `seqs` feeding `feed[s]`; entry `s` samples with `sample[s]` when given.
fn step(
    model: &Model,
    seqs: &mut [SequenceState],
    feed: &[Vec<u32>],
    sample: &[Option<SamplingParams>],
    on_device: bool,
) -> Vec<EntryOutput> {
    let mut entries: Vec<StepEntry<'_>> = seqs
        .iter_mut()
        .zip(feed)
        .zip(sample)
        .map(|((seq, tokens), sample)| StepEntry {
            seq,
            tokens,
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: *sample,
        })
        .collect();
    let options = StepOptions {
        logits_on_device: on_device,
        ..StepOptions::default()
    };
    model.forward_step(&mut entries, options).expect("step")
}

#[test]
fn rows_kept_on_the_backend_sample_with_their_masks_as_the_host_path() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = synthetic_model(dir.path());
    let vocab = model.config().vocab_size;
    let settings = [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 7,
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 30,
            top_p: 0.9,
            seed: 8,
        },
    ];
    let masks = [
        AllowedTokens::from_tokens(vocab, &[vocab as u32 - 1]),
        AllowedTokens::from_tokens(vocab, &[3, 44, 45, 100, 301]),
        AllowedTokens::from_tokens(
            vocab,
            &(0..vocab as u32).filter(|t| t % 5 != 2).collect::<Vec<_>>(),
        ),
    ];
    // Sequences 0..3 constrained, sequence 3 sampled inside the step.
    let feeds: Vec<Vec<u32>> = (0..4)
        .map(|s| prompt(s + 1, 3 + 5 * s as usize, vocab))
        .collect();
    let in_step = Some(settings[1]);
    let sampling = [None, None, None, in_step];
    let mut host_seqs: Vec<SequenceState> = (0..4).map(|_| model.new_sequence()).collect();
    let mut kept_seqs: Vec<SequenceState> = (0..4).map(|_| model.new_sequence()).collect();
    let mut feed = feeds;
    let mut changed = 0;
    for round in 0..4 {
        let host = step(&model, &mut host_seqs, &feed, &sampling, false);
        let kept = step(&model, &mut kept_seqs, &feed, &sampling, true);
        assert_eq!(
            kept[3], host[3],
            "round {round}: the entry sampled in the step"
        );
        let mut next = Vec::new();
        let mut rows = Vec::new();
        for s in 0..3 {
            let EntryOutput::DeviceLogits(tensor) = &kept[s] else {
                panic!("round {round} entry {s}: no rows kept on the backend");
            };
            let host_row = host[s].clone().into_logits().expect("host logits");
            assert_eq!(
                **tensor,
                host_row[..],
                "round {round} entry {s}: the kept rows"
            );
            rows.push(tensor.clone());
        }
        for (s, params) in settings.iter().enumerate() {
            let position = kept_seqs[s].len() as u64;
            let mask = &masks[(s + round) % masks.len()];
            let mut masked = host[s].clone().into_logits().expect("host logits");
            mask.apply(&mut masked).expect("mask fits");
            let expected = sample(&masked, params, position).expect("a token");
            let request = [LogitsRow {
                logits: &rows[s],
                params: *params,
                position,
                allowed: Some(mask),
            }];
            let got = model.sample_rows(&request).expect("sampled");
            assert_eq!(got, vec![expected], "round {round} entry {s}");
            assert!(mask.is_allowed(got[0]));
            let unmasked = host[s].clone().into_logits().expect("host logits");
            changed += usize::from(sample(&unmasked, params, position) != Some(got[0]));
            next.push(vec![got[0]]);
        }
        // All three rows in one call: the same tokens.
        let together: Vec<LogitsRow<'_>> = (0..3)
            .map(|s| LogitsRow {
                logits: &rows[s],
                params: settings[s],
                position: kept_seqs[s].len() as u64,
                allowed: Some(&masks[(s + round) % masks.len()]),
            })
            .collect();
        let batch = model.sample_rows(&together).expect("sampled together");
        assert_eq!(batch, next.iter().map(|t| t[0]).collect::<Vec<u32>>());
        let Some(EntryOutput::Tokens(last)) = host.get(3) else {
            panic!("round {round}: the sampled entry returned no tokens");
        };
        next.push(last.clone());
        feed = next;
    }
    assert!(changed > 0, "the masks never changed a token");
}

#[test]
fn a_bad_row_or_an_empty_mask_fails_sample_rows_naming_the_row() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = synthetic_model(dir.path());
    let vocab = model.config().vocab_size;
    let mut seqs = vec![model.new_sequence()];
    let out = step(&model, &mut seqs, &[vec![1, 2, 3]], &[None], true);
    let Some(EntryOutput::DeviceLogits(row)) = out.first() else {
        panic!("no rows kept");
    };
    let one = AllowedTokens::from_tokens(vocab, &[9]);
    let nothing = AllowedTokens::from_tokens(vocab, &[]);
    let at = |allowed| LogitsRow {
        logits: row,
        params: SamplingParams::greedy(),
        position: 3,
        allowed,
    };
    assert_eq!(model.sample_rows(&[at(Some(&one))]).expect("fits"), vec![9]);
    let err = model
        .sample_rows(&[at(Some(&one)), at(Some(&nothing))])
        .expect_err("nothing allowed");
    assert!(err.to_string().contains("row 1"), "{err}");
    assert!(err.to_string().contains("allows no token"), "{err}");
    let short = row.range(0..vocab - 1);
    let err = model
        .sample_rows(&[LogitsRow {
            logits: &short,
            ..at(None)
        }])
        .expect_err("a short row");
    assert!(err.to_string().contains("row 0"), "{err}");
    assert_eq!(
        model.sample_rows(&[]).expect("nothing to do"),
        Vec::<u32>::new()
    );
}
