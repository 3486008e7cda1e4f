//! The V4 family's multi-sequence step (`v4::Model::forward_step`) on the CPU backend: several
//! sequences of different lengths in one step give, bit for bit, the logits each gives alone —
//! prefill, decode, a verify chunk among decode rows, after a rollback — on the v4-tiny fixture
//! (sliding, CSA with the indexer, HCA, hash and top-k MoE) and on a reduced V4-Flash with its MTP
//! block (the MTP state each sequence keeps is its own). Sampled entries return the ids that
//! `sampling::sample` picks from the logits of running alone. A negative control shows the bitwise
//! comparison sees a one-token change; a bad entry fails the step naming its index.

use deepinfer_model::backend::CpuBackend;
use deepinfer_model::checkpoint::{Checkpoint, write_random_checkpoint};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::sampling::{SamplingParams, sample};
use deepinfer_model::v4::{EntryOutput, Model, SequenceState, StepEntry};
use deepinfer_model::{LogitsWanted, StepOptions};
use deepinfer_tests::forward_one_v4;

fn fixture_model() -> Model {
    Model::load(&deepinfer_tests::fixture_dir("v4/v4-tiny")).expect("fixture model loads")
}

fn tokens(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919) >> 9) % vocab as u32)
        .collect()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// One step over `seqs` (entry `s` appends `chunks[s]`, wanting `wants[s]`); the logits rows.
fn step(
    model: &Model,
    seqs: &mut [SequenceState],
    chunks: &[Vec<u32>],
    wants: &[LogitsWanted],
) -> Vec<Vec<f32>> {
    let mut entries: Vec<StepEntry<'_>> = seqs
        .iter_mut()
        .zip(chunks)
        .zip(wants)
        .map(|((seq, tokens), &want)| StepEntry {
            seq,
            tokens,
            want,
            decoder_from: None,
            sample: None,
        })
        .collect();
    model
        .forward_step(&mut entries, StepOptions::default())
        .expect("step")
        .into_iter()
        .map(|out| out.into_logits().expect("logits"))
        .collect()
}

/// Runs the same schedule once as multi-sequence steps and once sequence by sequence; every
/// step's logits must be bitwise equal. Returns the sequences of the stepped run.
fn assert_steps_equal_alone(model: &Model, schedule: &[Vec<Vec<u32>>], wants: &[LogitsWanted]) {
    let n = schedule[0].len();
    let mut together: Vec<SequenceState> = (0..n).map(|_| model.new_sequence()).collect();
    let mut alone: Vec<SequenceState> = (0..n).map(|_| model.new_sequence()).collect();
    for (k, chunks) in schedule.iter().enumerate() {
        let stepped = step(model, &mut together, chunks, wants);
        for (s, ((seq, chunk), &want)) in alone.iter_mut().zip(chunks).zip(wants).enumerate() {
            let single = model
                .forward_step(
                    &mut [StepEntry::new(seq, chunk, want)],
                    StepOptions::default(),
                )
                .and_then(EntryOutput::one_entry_logits)
                .expect("alone");
            assert_eq!(
                bits(&stepped[s]),
                bits(&single),
                "step {k}, sequence {s}: logits in the step vs alone"
            );
            assert!(single.iter().any(|&v| v != 0.0), "step {k}, sequence {s}");
        }
    }
    for (s, (a, b)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(a.len(), b.len(), "sequence {s}: length");
    }
}

/// Prefill of four lengths (crossing the window 8 and the CSA/HCA rates 4/8), decode steps, and
/// a verify chunk of 3 next to single decode rows.
#[test]
fn fixture_sequences_in_one_step_equal_each_alone() {
    let model = fixture_model();
    let vocab = model.config().vocab_size;
    let lengths = [3usize, 9, 26, 41];
    let mut schedule = vec![
        lengths
            .iter()
            .enumerate()
            .map(|(s, &len)| tokens(s as u32 + 1, len, vocab))
            .collect::<Vec<_>>(),
    ];
    for k in 0..5u32 {
        schedule.push(
            (0..lengths.len() as u32)
                .map(|s| {
                    let len = if k == 2 && s == 1 { 3 } else { 1 };
                    tokens(100 + 10 * k + s, len, vocab)
                })
                .collect(),
        );
    }
    let wants = [
        LogitsWanted::All,
        LogitsWanted::Last,
        LogitsWanted::All,
        LogitsWanted::Last,
    ];
    assert_steps_equal_alone(&model, &schedule, &wants);
}

/// After a rollback of one sequence, a step over all of them still equals each alone.
#[test]
fn a_step_after_a_rollback_equals_each_alone() {
    let model = fixture_model();
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> = [17usize, 30]
        .iter()
        .enumerate()
        .map(|(s, &len)| tokens(s as u32 + 7, len, vocab))
        .collect();
    let all = [LogitsWanted::All, LogitsWanted::All];
    let mut together: Vec<SequenceState> = (0..2).map(|_| model.new_sequence()).collect();
    let mut alone: Vec<SequenceState> = (0..2).map(|_| model.new_sequence()).collect();
    step(&model, &mut together, &prompts, &all);
    for (seq, prompt) in alone.iter_mut().zip(&prompts) {
        forward_one_v4(&model, seq, prompt, LogitsWanted::All).expect("alone");
    }
    for seqs in [&mut together, &mut alone] {
        model.rollback(&mut seqs[1], 27).expect("rollback");
    }
    let next = vec![tokens(50, 2, vocab), tokens(51, 4, vocab)];
    let stepped = step(&model, &mut together, &next, &all);
    for (s, (seq, chunk)) in alone.iter_mut().zip(&next).enumerate() {
        let single = forward_one_v4(&model, seq, chunk, LogitsWanted::All).expect("alone");
        assert_eq!(bits(&stepped[s]), bits(&single), "sequence {s}");
    }
}

/// Negative control: the comparison above sees a change of one earlier token of a sequence.
#[test]
fn negative_control_one_changed_token_changes_the_logits() {
    let model = fixture_model();
    let vocab = model.config().vocab_size;
    let prompt = tokens(3, 20, vocab);
    let mut changed = prompt.clone();
    changed[4] = (changed[4] + 1) % vocab as u32;
    let mut seqs: Vec<SequenceState> = (0..2).map(|_| model.new_sequence()).collect();
    let wants = [LogitsWanted::Last, LogitsWanted::Last];
    let stepped = step(&model, &mut seqs, &[prompt, tokens(9, 5, vocab)], &wants);
    let mut seq = model.new_sequence();
    let single = forward_one_v4(&model, &mut seq, &changed, LogitsWanted::Last).expect("alone");
    assert_ne!(bits(&stepped[0]), bits(&single));
}

/// Sampled entries return what sampling the logits of running alone returns (greedy and seeded
/// top-p), next to an entry that asks for logits.
#[test]
fn sampled_entries_equal_sampling_the_logits_alone() {
    let model = fixture_model();
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> = [6usize, 13, 22]
        .iter()
        .enumerate()
        .map(|(s, &len)| tokens(s as u32 + 20, len, vocab))
        .collect();
    let params = [
        Some(SamplingParams::greedy()),
        None,
        Some(SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
            seed: 5,
        }),
    ];
    let mut seqs: Vec<SequenceState> = (0..3).map(|_| model.new_sequence()).collect();
    let mut entries: Vec<StepEntry<'_>> = seqs
        .iter_mut()
        .zip(&prompts)
        .zip(params)
        .map(|((seq, tokens), sample)| StepEntry {
            seq,
            tokens,
            want: LogitsWanted::Last,
            decoder_from: None,
            sample,
        })
        .collect();
    let outputs = model
        .forward_step(&mut entries, StepOptions::default())
        .expect("step");
    for (s, ((prompt, out), asked)) in prompts.iter().zip(outputs).zip(params).enumerate() {
        let mut seq = model.new_sequence();
        let logits = forward_one_v4(&model, &mut seq, prompt, LogitsWanted::Last).expect("alone");
        match (out, asked) {
            (EntryOutput::Tokens(ids), Some(params)) => {
                let expected = sample(&logits, &params, prompt.len() as u64).expect("sample");
                assert_eq!(ids, vec![expected], "sequence {s}");
            }
            (EntryOutput::Logits(got), None) => assert_eq!(bits(&got), bits(&logits)),
            (other, _) => panic!("sequence {s}: unexpected output {other:?}"),
        }
    }
}

/// A reduced V4-Flash (FP8/FP4 weights, MTP block): steps equal each sequence alone, and so does
/// the MTP state each sequence keeps (its draft logits).
#[test]
fn reduced_v4_with_mtp_steps_equal_each_alone() {
    let cfg = ModelConfig::reduced_v4();
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 11, dir.path(), 1).expect("checkpoint");
    let ckpt = Checkpoint::open(dir.path()).expect("opens");
    let model =
        Model::from_checkpoint(cfg.clone(), &ckpt, Box::new(CpuBackend::new())).expect("loads");
    let vocab = cfg.vocab_size;
    let schedule = vec![
        vec![tokens(1, 5, vocab), tokens(2, 19, vocab)],
        vec![tokens(3, 1, vocab), tokens(4, 2, vocab)],
        vec![tokens(5, 1, vocab), tokens(6, 1, vocab)],
    ];
    let wants = [LogitsWanted::All, LogitsWanted::Last];
    assert_steps_equal_alone(&model, &schedule, &wants);
    let mut together: Vec<SequenceState> = (0..2).map(|_| model.new_sequence()).collect();
    let mut alone: Vec<SequenceState> = (0..2).map(|_| model.new_sequence()).collect();
    for chunks in &schedule {
        step(&model, &mut together, chunks, &wants);
        for (seq, chunk) in alone.iter_mut().zip(chunks) {
            forward_one_v4(&model, seq, chunk, LogitsWanted::Last).expect("alone");
        }
    }
    for (s, (a, b)) in together.iter().zip(&alone).enumerate() {
        let anchor = 7;
        assert_eq!(
            bits(&model.mtp_logits(a, anchor).expect("mtp")),
            bits(&model.mtp_logits(b, anchor).expect("mtp")),
            "sequence {s}: MTP logits"
        );
    }
}

/// A bad entry (a token outside the vocabulary, a decoder start) fails the whole step, naming
/// its index, and changes no sequence.
#[test]
fn a_bad_entry_fails_the_step_naming_it() {
    let model = fixture_model();
    let vocab = model.config().vocab_size as u32;
    let mut seqs: Vec<SequenceState> = (0..2).map(|_| model.new_sequence()).collect();
    let chunks = [vec![1u32, 2], vec![3, vocab]];
    let mut entries: Vec<StepEntry<'_>> = seqs
        .iter_mut()
        .zip(&chunks)
        .map(|(seq, tokens)| StepEntry {
            seq,
            tokens,
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: None,
        })
        .collect();
    let err = model
        .forward_step(&mut entries, StepOptions::default())
        .expect_err("a bad token");
    assert!(err.to_string().contains("step entry 1"), "{err}");
    // Decoder bounded replay is V4.1's: asked of a V4 step, it fails naming the entry.
    entries[1].tokens = &chunks[0];
    entries[1].decoder_from = Some(1);
    let err = model
        .forward_step(&mut entries, StepOptions::default())
        .expect_err("no bounded replay");
    let text = err.to_string();
    assert!(
        text.contains("step entry 1") && text.contains("bounded replay"),
        "{text}"
    );
    drop(entries);
    assert!(seqs.iter().all(SequenceState::is_empty));
}

/// `AnyModel::forward_step` runs the V4 step: the same outputs as `v4::Model::forward_step`, and a
/// sequence of the other family fails the step naming its entry.
#[test]
fn any_model_steps_a_v4_model() {
    use deepinfer_model::any_model::{AnyModel, AnySequence, AnyStepEntry, StepOptions};
    let model = fixture_model();
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    let any = AnyModel::load(&dir, None).expect("loads");
    let vocab = model.config().vocab_size;
    let chunks = [tokens(61, 12, vocab), tokens(62, 3, vocab)];
    let wants = [LogitsWanted::All, LogitsWanted::Last];
    let mut seqs: Vec<SequenceState> = (0..2).map(|_| model.new_sequence()).collect();
    let expected = step(&model, &mut seqs, &chunks, &wants);
    let mut any_seqs: Vec<AnySequence> = (0..2).map(|_| any.new_sequence()).collect();
    let mut entries: Vec<AnyStepEntry<'_>> = any_seqs
        .iter_mut()
        .zip(&chunks)
        .zip(wants)
        .map(|((seq, tokens), want)| AnyStepEntry::new(seq, tokens, want))
        .collect();
    let got: Vec<Vec<f32>> = any
        .forward_step(&mut entries, StepOptions::default())
        .expect("step")
        .into_iter()
        .map(|out| out.into_logits().expect("logits"))
        .collect();
    for (s, (got, expected)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(bits(got), bits(expected), "sequence {s}");
    }

    let v41_cfg = ModelConfig::tiny_v41();
    let v41_dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&v41_cfg, 3, v41_dir.path(), 1).expect("v41 checkpoint");
    let vocab_stub =
        deepinfer_model::engram::CompressedVocab::halving_stub(v41_cfg.vocab_size, 2).ok();
    let other = AnyModel::load(v41_dir.path(), vocab_stub).expect("v41 loads");
    let mut mixed = [any.new_sequence(), other.new_sequence()];
    let mut entries: Vec<AnyStepEntry<'_>> = mixed
        .iter_mut()
        .map(|seq| AnyStepEntry::new(seq, &[1, 2], LogitsWanted::Last))
        .collect();
    let err = any
        .forward_step(&mut entries, StepOptions::default())
        .expect_err("mixed families");
    assert!(err.to_string().contains("step entry 1"), "{err}");
}
