//! Issue #4's rule on the device: "no device-to-host copy inside a decode step except the sampled
//! tokens". The v41-tiny fixture runs on a `CudaBackend`: a batched prefill of sequences of
//! different lengths, then decode steps over all of them with the tokens sampled on the device
//! (greedy and seeded top-p). The backend's transfer counters must show, for every decode step,
//! zero copies of op results and exactly one copy of sampled ids; the tokens must be the CPU
//! model's, step for step. Negative control: reading one decode step's logits on the host is
//! counted. DSpark drafting copies only the drafted ids and the confidences, and drafts what the
//! CPU drafts.
//!
//! Built only with `--features cuda`; without a usable GPU the test prints why it skips. On the
//! H200: `DEEPINFER_V41_TINY=$PWD/.gpu/fixtures/v41-tiny bash .gpu/run.sh gpu_transfers
//! --include-ignored --nocapture`.
#![cfg(feature = "cuda")]

use deepinfer_model::backend::cuda::{CudaBackend, TransferCounts};
use deepinfer_model::sampling::SamplingParams;
use deepinfer_model::{EntryOutput, LogitsWanted, Model, SequenceState, StepEntry};

mod gpu_support;
use gpu_support::{host_fixture_model, v41_tiny_path};

fn fixture_model() -> Model {
    host_fixture_model(&v41_tiny_path()).0
}

fn prompt(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919) >> 9) % vocab as u32)
        .collect()
}

/// Each sequence's sampling: greedy, and seeded top-p.
fn sampling(s: usize) -> SamplingParams {
    if s.is_multiple_of(2) {
        SamplingParams::greedy()
    } else {
        SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
            seed: 11 + s as u64,
        }
    }
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
            sample: Some(sampling(s)),
        })
        .collect();
    model
        .forward_step(&mut entries, None)
        .expect("step")
        .into_iter()
        .map(|out| match out {
            EntryOutput::Tokens(ids) => ids[0],
            EntryOutput::Logits(_) => panic!("a sampled entry returned logits"),
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_decode_step_copies_only_the_sampled_ids_to_the_host() {
    let backend = match CudaBackend::open(0) {
        Ok(backend) => backend,
        Err(err) => {
            eprintln!("a_decode_step_copies_only_the_sampled_ids_to_the_host: skipped: {err}");
            return;
        }
    };
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
    let logits = gpu.forward_step(&mut entries, None).expect("step");
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
        cpu.forward(seq, &[token], LogitsWanted::Last)
            .expect("cpu step");
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
