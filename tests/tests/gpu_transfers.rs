//! Issue #4's rule on the device: "no device-to-host copy inside a decode step except the sampled
//! tokens". The v41-tiny fixture runs on a `CudaBackend`: a batched prefill of sequences of
//! different lengths, then decode steps over all of them with the tokens sampled on the device
//! (greedy and seeded top-p). The backend's transfer counters must show, for every decode step,
//! zero copies of op results and exactly one copy of sampled ids; the tokens must be the CPU
//! model's, step for step. Negative control: reading one decode step's logits on the host is
//! counted. DSpark drafting copies only the drafted ids and the confidences, and drafts what the
//! CPU drafts. A grammar-constrained decode step (`Model::forward_step` with `StepOptions::logits_on_device`, then the masked
//! `Model::sample_rows` once the masks are known) copies no op result and only the ids too.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a usable GPU every test fails, naming why.
#![cfg(feature = "cuda")]

use deepinfer_model::backend::cuda::TransferCounts;
use deepinfer_model::sampling::{AllowedTokens, sample};
use deepinfer_model::{
    EntryOutput, LogitsRow, LogitsWanted, Model, SequenceState, StepEntry, StepOptions,
};
use deepinfer_tests::forward_one;

mod gpu_support;
use gpu_support::{cuda_backend, host_fixture_model, mixed_sampling, prompt};

fn fixture_model() -> Model {
    host_fixture_model(&deepinfer_tests::fixture_dir("v41/v41-tiny")).0
}

/// One step over every sequence (its `tokens[s]`), each sampling its last row; the sampled ids.
fn sampled_step(model: &Model, seqs: &mut [SequenceState], tokens: &[Vec<u32>]) -> Vec<u32> {
    let mut entries: Vec<StepEntry<'_>> = seqs
        .iter_mut()
        .zip(tokens)
        .enumerate()
        .map(|(s, (seq, tokens))| StepEntry {
            seq,
            tokens,
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: Some(mixed_sampling(s)),
        })
        .collect();
    model
        .forward_step(&mut entries, StepOptions::default())
        .expect("step")
        .into_iter()
        .map(|out| match out {
            EntryOutput::Tokens(ids) => ids[0],
            _ => panic!("a sampled entry returned logits"),
        })
        .collect()
}

#[test]
fn a_decode_step_copies_only_the_sampled_ids_to_the_host() {
    let backend = cuda_backend("a_decode_step_copies_only_the_sampled_ids_to_the_host");
    let counters = backend.transfer_counters();
    let cpu = fixture_model();
    let vocab = cpu.config().vocab_size;
    let gpu = fixture_model().on_backend(Box::new(backend));
    let lengths = [5usize, 17, 40, 71];
    let prompts: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(s, &len)| prompt(s as u32 + 1, len, vocab))
        .collect();
    let mut on_cpu: Vec<SequenceState> = lengths.iter().map(|_| cpu.new_sequence()).collect();
    let mut on_gpu: Vec<SequenceState> = lengths.iter().map(|_| gpu.new_sequence()).collect();
    let mut next_cpu = sampled_step(&cpu, &mut on_cpu, &prompts);
    let mut next_gpu = sampled_step(&gpu, &mut on_gpu, &prompts);
    assert_eq!(next_gpu, next_cpu, "prefill: the sampled tokens");
    let lengths_before = counters.by_length();
    let mut per_step: Vec<TransferCounts> = Vec::new();
    for step in 0..8 {
        let feed: Vec<Vec<u32>> = next_gpu.iter().map(|&t| vec![t]).collect();
        let before = counters.snapshot();
        next_gpu = sampled_step(&gpu, &mut on_gpu, &feed);
        per_step.push(counters.snapshot() - before);
        next_cpu = sampled_step(&cpu, &mut on_cpu, &feed);
        assert_eq!(next_gpu, next_cpu, "decode step {step}: the sampled tokens");
    }
    for (step, counts) in per_step.iter().enumerate() {
        println!(
            "decode step {step}: {} op-result copies ({} bytes), {} sampled-id copies",
            counts.to_host_copies, counts.to_host_bytes, counts.sampled_id_copies
        );
    }
    for (len, n) in counters.by_length() {
        let n = n - lengths_before.get(&len).copied().unwrap_or(0);
        if n > 0 {
            println!("op results of {len} values copied {n} times over the decode steps");
        }
    }
    for (step, counts) in per_step.iter().enumerate() {
        assert_eq!(
            (counts.to_host_copies, counts.sampled_id_copies),
            (0, 1),
            "decode step {step}: copies of op results and of sampled ids"
        );
    }
    // Negative control: a step whose logits are read on the host is counted.
    let before = counters.snapshot();
    let mut entries: Vec<StepEntry<'_>> = on_gpu
        .iter_mut()
        .zip(&next_gpu)
        .map(|(seq, token)| StepEntry {
            seq,
            tokens: std::slice::from_ref(token),
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: None,
        })
        .collect();
    let logits = gpu
        .forward_step(&mut entries, StepOptions::default())
        .expect("step");
    assert_eq!(logits.len(), lengths.len());
    let counted = counters.snapshot() - before;
    println!(
        "a step returning logits: {} op-result copies",
        counted.to_host_copies
    );
    assert!(counted.to_host_copies >= 1, "{counted:?}");

    // DSpark drafting of every sequence in one call: the drafted ids and the confidences come to
    // the host (one copy of each per slot), the draft logits stay on the device until read; the
    // proposals equal the CPU's bit for bit.
    for (seq, &token) in on_cpu.iter_mut().zip(&next_gpu) {
        forward_one(&cpu, seq, &[token], LogitsWanted::Last).expect("cpu step");
    }
    let requests_cpu: Vec<(&SequenceState, u32)> =
        on_cpu.iter().zip(next_gpu.iter().copied()).collect();
    let requests_gpu: Vec<(&SequenceState, u32)> =
        on_gpu.iter().zip(next_gpu.iter().copied()).collect();
    let before = counters.snapshot();
    let drafted = gpu.draft_step(&requests_gpu);
    let counted = counters.snapshot() - before;
    let expected = cpu.draft_step(&requests_cpu);
    let block = cpu.config().dspark.as_ref().map_or(0, |d| d.block_size);
    println!(
        "drafting {} blocks of {block}: {} op-result copies ({} bytes), {} id copies",
        lengths.len(),
        counted.to_host_copies,
        counted.to_host_bytes,
        counted.sampled_id_copies
    );
    assert_eq!(
        (counted.to_host_copies, counted.sampled_id_copies),
        (block as u64, block as u64),
        "one copy of the confidences and one of the drafted ids per slot"
    );
    assert_eq!(
        counted.to_host_bytes,
        (block * lengths.len() * 4) as u64,
        "only the confidences"
    );
    for (s, (got, want)) in drafted.into_iter().zip(expected).enumerate() {
        let (got, want) = (got.expect("gpu draft"), want.expect("cpu draft"));
        assert_eq!(got.tokens, want.tokens, "sequence {s}: drafted tokens");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(
            bits(&got.confidence),
            bits(&want.confidence),
            "sequence {s}: confidences"
        );
        assert_eq!(
            bits(&got.logits),
            bits(&want.logits),
            "sequence {s}: draft logits"
        );
    }
}

/// Sequence `s`'s grammar mask at decode step `step`: one token, a few, or most of them.
fn step_mask(s: usize, step: usize, vocab: usize) -> AllowedTokens {
    let token = |i: usize| ((s * 131 + step * 29 + i * 7) % vocab) as u32;
    match (s + step) % 3 {
        0 => AllowedTokens::from_tokens(vocab, &[token(0)]),
        1 => AllowedTokens::from_tokens(vocab, &(0..6).map(token).collect::<Vec<u32>>()),
        _ => {
            let banned: Vec<u32> = (0..vocab / 4).map(token).collect();
            let kept: Vec<u32> = (0..vocab as u32).filter(|t| !banned.contains(t)).collect();
            AllowedTokens::from_tokens(vocab, &kept)
        }
    }
}

/// One constrained decode step over every sequence: the rows stay on the backend
/// (`forward_step` with `logits_on_device`) and are sampled with their masks afterwards (`sample_rows`).
fn constrained_step(
    model: &Model,
    seqs: &mut [SequenceState],
    feed: &[u32],
    masks: &[AllowedTokens],
) -> Vec<u32> {
    let positions: Vec<u64> = seqs.iter().map(|seq| seq.len() as u64 + 1).collect();
    let mut entries: Vec<StepEntry<'_>> = seqs
        .iter_mut()
        .zip(feed)
        .map(|(seq, token)| StepEntry {
            seq,
            tokens: std::slice::from_ref(token),
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: None,
        })
        .collect();
    let outputs = model
        .forward_step(&mut entries, StepOptions::on_device())
        .expect("step");
    let rows: Vec<_> = outputs
        .into_iter()
        .map(|out| match out {
            EntryOutput::DeviceLogits(rows) => rows,
            _ => panic!(
                "an unsampled entry of a step with logits on the device returned no device rows"
            ),
        })
        .collect();
    let requests: Vec<LogitsRow<'_>> = rows
        .iter()
        .zip(masks)
        .zip(&positions)
        .enumerate()
        .map(|(s, ((logits, mask), &position))| LogitsRow {
            logits,
            params: mixed_sampling(s),
            position,
            allowed: Some(mask),
        })
        .collect();
    model.sample_rows(&requests).expect("masked sampling")
}

/// Structured outputs on the device: a constrained decode step leaves its logits on the GPU
/// until the masks are known, then samples them there with the masks; per step zero op-result
/// copies and one copy of ids (the forward itself copies nothing), and the tokens are those of
/// the CPU's host path (the step's logits read, masked to -inf, sampled by `sampling::sample`).
#[test]
fn a_constrained_decode_step_copies_only_the_sampled_ids() {
    let backend = cuda_backend("a_constrained_decode_step_copies_only_the_sampled_ids");
    let counters = backend.transfer_counters();
    let cpu = fixture_model();
    let vocab = cpu.config().vocab_size;
    let gpu = fixture_model().on_backend(Box::new(backend));
    let lengths = [9usize, 23, 4];
    let prompts: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(s, &len)| prompt(s as u32 + 20, len, vocab))
        .collect();
    let mut on_cpu: Vec<SequenceState> = lengths.iter().map(|_| cpu.new_sequence()).collect();
    let mut on_gpu: Vec<SequenceState> = lengths.iter().map(|_| gpu.new_sequence()).collect();
    let mut next = sampled_step(&gpu, &mut on_gpu, &prompts);
    assert_eq!(next, sampled_step(&cpu, &mut on_cpu, &prompts), "prefill");
    for step in 0..6 {
        let masks: Vec<AllowedTokens> = (0..lengths.len())
            .map(|s| step_mask(s, step, vocab))
            .collect();
        // The CPU's host path: logits read, masked, sampled.
        let positions: Vec<u64> = on_cpu.iter().map(|seq| seq.len() as u64 + 1).collect();
        let mut entries: Vec<StepEntry<'_>> = on_cpu
            .iter_mut()
            .zip(&next)
            .map(|(seq, token)| StepEntry {
                seq,
                tokens: std::slice::from_ref(token),
                want: LogitsWanted::Last,
                decoder_from: None,
                sample: None,
            })
            .collect();
        let host: Vec<u32> = cpu
            .forward_step(&mut entries, StepOptions::default())
            .expect("cpu step")
            .into_iter()
            .enumerate()
            .map(|(s, out)| {
                let mut row = out.into_logits().expect("logits");
                masks[s].apply(&mut row).expect("mask fits");
                sample(&row, &mixed_sampling(s), positions[s]).expect("a row")
            })
            .collect();
        let before = counters.snapshot();
        let got = constrained_step(&gpu, &mut on_gpu, &next, &masks);
        let counts = counters.snapshot() - before;
        println!(
            "constrained decode step {step}: {} op-result copies, {} sampled-id copies, tokens {got:?}",
            counts.to_host_copies, counts.sampled_id_copies
        );
        assert_eq!(got, host, "constrained decode step {step}: the tokens");
        for (s, &token) in got.iter().enumerate() {
            assert!(
                masks[s].is_allowed(token),
                "step {step} sequence {s}: {token} masked"
            );
        }
        assert_eq!(
            (counts.to_host_copies, counts.sampled_id_copies),
            (0, 1),
            "constrained decode step {step}: copies of op results and of sampled ids"
        );
        next = got;
    }
}

/// The v4-tiny fixture on a `CudaBackend`: a batched
/// prefill of four sequences of different lengths, then decode steps over all of them sampling on
/// the device (greedy and seeded top-p). Every decode step copies no op result and one set of
/// sampled ids to the host; the tokens are the CPU model's, step for step. Negative control: a step
/// returning logits is counted.
#[test]
fn a_v4_decode_step_copies_only_the_sampled_ids_to_the_host() {
    use deepinfer_model::checkpoint::Checkpoint;
    use deepinfer_model::config::ModelConfig;
    use deepinfer_model::v4;

    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    let backend = cuda_backend("a_v4_decode_step_copies_only_the_sampled_ids_to_the_host");
    let counters = backend.transfer_counters();
    let cpu = v4::Model::load(&dir).expect("cpu model");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("config");
    let ckpt = Checkpoint::open(&dir).expect("checkpoint");
    let gpu = v4::Model::from_checkpoint(cfg.clone(), &ckpt, Box::new(backend)).expect("gpu model");
    let vocab = cfg.vocab_size;
    let step = |model: &v4::Model, seqs: &mut [v4::SequenceState], tokens: &[Vec<u32>]| {
        let mut entries: Vec<v4::StepEntry<'_>> = seqs
            .iter_mut()
            .zip(tokens)
            .enumerate()
            .map(|(s, (seq, tokens))| v4::StepEntry {
                seq,
                tokens,
                want: LogitsWanted::Last,
                decoder_from: None,
                sample: Some(mixed_sampling(s)),
            })
            .collect();
        model
            .forward_step(&mut entries, StepOptions::default())
            .expect("step")
            .into_iter()
            .map(|out| match out {
                EntryOutput::Tokens(ids) => ids[0],
                other => panic!("a sampled entry returned {other:?}"),
            })
            .collect::<Vec<u32>>()
    };
    let lengths = [5usize, 17, 29, 40];
    let prompts: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(s, &len)| prompt(s as u32 + 1, len, vocab))
        .collect();
    let mut on_cpu: Vec<v4::SequenceState> = lengths.iter().map(|_| cpu.new_sequence()).collect();
    let mut on_gpu: Vec<v4::SequenceState> = lengths.iter().map(|_| gpu.new_sequence()).collect();
    let mut next_cpu = step(&cpu, &mut on_cpu, &prompts);
    let mut next_gpu = step(&gpu, &mut on_gpu, &prompts);
    assert_eq!(next_gpu, next_cpu, "prefill: the sampled tokens");
    let mut per_step: Vec<TransferCounts> = Vec::new();
    let lengths_before = counters.by_length();
    for k in 0..6 {
        let feed: Vec<Vec<u32>> = next_gpu.iter().map(|&t| vec![t]).collect();
        let before = counters.snapshot();
        next_gpu = step(&gpu, &mut on_gpu, &feed);
        per_step.push(counters.snapshot() - before);
        next_cpu = step(&cpu, &mut on_cpu, &feed);
        assert_eq!(next_gpu, next_cpu, "decode step {k}: the sampled tokens");
    }
    for (k, counts) in per_step.iter().enumerate() {
        println!(
            "v4 decode step {k}: {} op-result copies ({} bytes), {} sampled-id copies",
            counts.to_host_copies, counts.to_host_bytes, counts.sampled_id_copies
        );
    }
    for (len, n) in counters.by_length() {
        let n = n - lengths_before.get(&len).copied().unwrap_or(0);
        if n > 0 {
            println!("v4: op results of {len} values copied {n} times over the decode steps");
        }
    }
    for (k, counts) in per_step.iter().enumerate() {
        assert_eq!(
            (counts.to_host_copies, counts.sampled_id_copies),
            (0, 1),
            "v4 decode step {k}: copies of op results and of sampled ids"
        );
    }
    // Negative control: a step whose logits come back to the host is counted.
    let before = counters.snapshot();
    let mut entries: Vec<v4::StepEntry<'_>> = on_gpu
        .iter_mut()
        .zip(&next_gpu)
        .map(|(seq, token)| v4::StepEntry {
            seq,
            tokens: std::slice::from_ref(token),
            want: LogitsWanted::Last,
            decoder_from: None,
            sample: None,
        })
        .collect();
    let logits = gpu
        .forward_step(&mut entries, StepOptions::default())
        .expect("step");
    assert_eq!(logits.len(), lengths.len());
    let counted = counters.snapshot() - before;
    assert!(counted.to_host_copies >= 1, "{counted:?}");
}
