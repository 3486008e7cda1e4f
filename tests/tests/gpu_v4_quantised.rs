//! DeepSeek-V4 checkpoints in the official quantised format on the device: FP8 dense weights with
//! 128×128 tiles and FP4 (or FP8) routed experts, computed in fp32 with exact dequantisation as the
//! CPU reference does. Random checkpoints of reduced size in the real format (`ModelConfig::
//! reduced_v4`: hash-routed and top-k MoE layers, CSA/HCA attention, the MTP block) run on a
//! `CudaBackend` and on the CPU: four sequences of different lengths in one prefill step, then
//! decode steps, every logit bitwise equal; then sampled decode steps that copy no op result to
//! the host (the routed experts stay on the device: the host MoE path would copy the router's
//! logits every layer) and sample the CPU's tokens.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a usable GPU every test fails, naming why.
#![cfg(feature = "cuda")]

use std::path::Path;

use deepinfer_model::checkpoint::{Checkpoint, write_random_checkpoint};
use deepinfer_model::config::{ExpertDtype, ModelConfig, V4Mlp};
use deepinfer_model::v4;
use deepinfer_model::{EntryOutput, LogitsWanted, StepOptions};
use safetensors::Dtype;

mod checkpoint_patch;
mod gpu_support;
use checkpoint_patch::patch_tensor;
use gpu_support::{assert_bitwise, cuda_backend, mixed_sampling, prompt};

/// One step of `model` over `seqs`: every entry's logits (`sample` = None) or sampled tokens.
fn step(
    model: &v4::Model,
    seqs: &mut [v4::SequenceState],
    tokens: &[Vec<u32>],
    want: LogitsWanted,
    sampled: bool,
) -> Vec<EntryOutput> {
    let mut entries: Vec<v4::StepEntry<'_>> = seqs
        .iter_mut()
        .zip(tokens)
        .enumerate()
        .map(|(s, (seq, tokens))| v4::StepEntry {
            seq,
            tokens,
            want,
            decoder_from: None,
            sample: sampled.then(|| mixed_sampling(s)),
        })
        .collect();
    model
        .forward_step(&mut entries, StepOptions::default())
        .expect("step")
}

fn logits(outputs: Vec<EntryOutput>) -> Vec<Vec<f32>> {
    outputs
        .into_iter()
        .map(|out| match out {
            EntryOutput::Logits(values) => values,
            other => panic!("an unsampled entry returned {other:?}"),
        })
        .collect()
}

fn tokens(outputs: Vec<EntryOutput>) -> Vec<u32> {
    outputs
        .into_iter()
        .map(|out| match out {
            EntryOutput::Tokens(ids) => ids[0],
            other => panic!("a sampled entry returned {other:?}"),
        })
        .collect()
}

/// Runs `cfg` (written as a random checkpoint, then changed by `patch`) on the CPU and on the
/// device; see the module header. Returns the number of logits compared.
fn cpu_and_device_agree(
    test: &str,
    cfg: ModelConfig,
    seed: u64,
    patch: impl FnOnce(&Path, &ModelConfig),
) -> usize {
    let backend = cuda_backend(test);
    let counters = backend.transfer_counters();
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, seed, dir.path(), 2).expect("checkpoint written");
    patch(dir.path(), &cfg);
    let cpu = v4::Model::load(dir.path()).expect("cpu model");
    let ckpt = Checkpoint::open(dir.path()).expect("checkpoint");
    let gpu = v4::Model::from_checkpoint(cfg.clone(), &ckpt, Box::new(backend)).expect("gpu model");
    let vocab = cfg.vocab_size;
    let lengths = [3usize, 9, 26, 41];
    let prompts: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(s, &len)| prompt(s as u32 + 1, len, vocab))
        .collect();
    let mut on_cpu: Vec<v4::SequenceState> = lengths.iter().map(|_| cpu.new_sequence()).collect();
    let mut on_gpu: Vec<v4::SequenceState> = lengths.iter().map(|_| gpu.new_sequence()).collect();
    let mut compared = 0;

    // Prefill (every row) and decode steps with logits, bitwise.
    let mut feed = prompts;
    let mut want = LogitsWanted::All;
    for k in 0..4 {
        let from_gpu = logits(step(&gpu, &mut on_gpu, &feed, want, false));
        let from_cpu = logits(step(&cpu, &mut on_cpu, &feed, want, false));
        for (s, (g, c)) in from_gpu.iter().zip(&from_cpu).enumerate() {
            compared += assert_bitwise(&format!("{test}: step {k}, sequence {s}"), g, c);
        }
        // Each sequence goes on with its greedy token of the last row.
        feed = from_cpu
            .iter()
            .map(|rows| {
                let last = &rows[rows.len() - vocab..];
                let best = (0..vocab).fold(0, |b, i| if last[i] > last[b] { i } else { b });
                vec![best as u32]
            })
            .collect();
        want = LogitsWanted::Last;
    }

    // Sampled decode steps: no op result leaves the device, the CPU's tokens.
    for k in 0..3 {
        let before = counters.snapshot();
        let from_gpu = tokens(step(&gpu, &mut on_gpu, &feed, want, true));
        let counts = counters.snapshot() - before;
        let from_cpu = tokens(step(&cpu, &mut on_cpu, &feed, want, true));
        assert_eq!(from_gpu, from_cpu, "{test}: sampled decode step {k}");
        assert_eq!(
            (counts.to_host_copies, counts.sampled_id_copies),
            (0, 1),
            "{test}: sampled decode step {k}: copies of op results and of sampled ids"
        );
        feed = from_gpu.iter().map(|&t| vec![t]).collect();
    }
    println!("{test}: {compared} logits bitwise equal; sampled decode steps copied only the ids");
    compared
}

#[test]
fn fp4_experts_match_the_cpu_bitwise_and_stay_on_the_device() {
    let cfg = ModelConfig::reduced_v4();
    assert_eq!(cfg.quant.expert_dtype, ExpertDtype::Fp4);
    cpu_and_device_agree("fp4 experts", cfg, 41, |_, _| ());
}

#[test]
fn fp8_experts_match_the_cpu_bitwise_and_stay_on_the_device() {
    let mut cfg = ModelConfig::reduced_v4();
    cfg.quant.expert_dtype = ExpertDtype::Fp8;
    cpu_and_device_agree("fp8 experts", cfg, 42, |_, _| ());
}

/// An expert width of 352: `w2` sums two 256-long chains (the second partial), `w1`/`w3` have
/// 11 column tiles.
#[test]
fn wide_experts_match_the_cpu_bitwise_and_stay_on_the_device() {
    let mut cfg = ModelConfig::reduced_v4();
    cfg.moe_inter_dim = 352;
    cpu_and_device_agree("wide fp4 experts", cfg, 43, |_, _| ());
}

/// Hash layers whose `tid2eid` names one expert twice for every even token id: the routed rows
/// of such a token run that expert twice (each with its own route weight) and the combine adds
/// both outputs in slot order, as the CPU does.
#[test]
fn hash_rows_naming_an_expert_twice_match_the_cpu_bitwise() {
    let cfg = ModelConfig::reduced_v4();
    cpu_and_device_agree("repeated hash experts", cfg, 44, |dir, cfg| {
        let k = cfg.n_activated_experts;
        let row = 8 * k;
        let mlp = &cfg.v4.as_ref().expect("V4 config").mlp;
        assert!(mlp.contains(&V4Mlp::HashMoe), "the config has hash layers");
        for (layer, _) in mlp
            .iter()
            .enumerate()
            .filter(|(_, m)| **m == V4Mlp::HashMoe)
        {
            let name = format!("layers.{layer}.ffn.gate.tid2eid");
            patch_tensor(dir, &name, Dtype::I64, |table| {
                for token in table.chunks_exact_mut(row).step_by(2) {
                    token.copy_within(0..8, 8);
                }
            });
        }
    });
}
