//! Shared by the GPU test binaries (`gpu*.rs`): opening the device or saying why a test skips,
//! the SplitMix64 generator of test data, prompts and per-sequence sampling settings, bitwise
//! comparisons of device and host results, and the v41-tiny fixture's location and host model.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

pub mod gemm_data;

use std::fmt::Display;
use std::path::{Path, PathBuf};

use deepinfer_actors::tools::logits::engram_vocab_for_dir;
use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::runtime::driver_available;
use deepinfer_model::Model;
use deepinfer_model::backend::Precision;
use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::quant;
use deepinfer_model::sampling::SamplingParams;

/// Both precisions of the model's activations.
pub const PRECISIONS: [Precision; 2] = [Precision::Bf16, Precision::F32];

/// `open()`s a device resource named `what`, or says why `test` is skipped (no CUDA driver) and
/// returns `None`. A driver that is present but does not open is a failure.
fn open_or_skip<T, E: Display>(
    test: &str,
    what: &str,
    open: impl FnOnce() -> Result<T, E>,
) -> Option<T> {
    if let Err(err) = driver_available() {
        eprintln!("{test}: skipped: {err}");
        return None;
    }
    match open() {
        Ok(opened) => Some(opened),
        Err(err) => panic!("{test}: a CUDA driver is present but the {what} did not open: {err}"),
    }
}

/// Opens the kernel runtime of device 0, or says why the test is skipped and returns `None`.
pub fn runtime(test: &str) -> Option<KernelRuntime> {
    open_or_skip(test, "kernel runtime", || KernelRuntime::open(0))
}

/// Opens the CUDA backend of device 0 (exact numerics), or says why the test is skipped and returns `None`.
pub fn cuda_backend(test: &str) -> Option<CudaBackend> {
    open_or_skip(test, "backend", || CudaBackend::open(0, Numerics::Exact))
}

/// SplitMix64: a small deterministic generator for test data. A test file adds its own value
/// distributions in an `impl Rng` block of its own.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A deterministic prompt of `len` token ids below `vocab`.
pub fn prompt(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919) >> 9) % vocab as u32)
        .collect()
}

/// Sequence `s`'s sampling in the mixed batches: greedy for even `s`, seeded top-p for odd.
pub fn mixed_sampling(s: usize) -> SamplingParams {
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

/// `n` bf16 values uniform in [-1, 1).
pub fn bf16_unit(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| quant::round_bf16(rng.uniform())).collect()
}

/// The model's precision that rounds like `rounding`.
pub fn precision_of(rounding: Rounding) -> Precision {
    match rounding {
        Rounding::Bf16 => Precision::Bf16,
        Rounding::F32 => Precision::F32,
    }
}

/// The kernels' rounding of `precision`.
pub fn rounding_of(precision: Precision) -> Rounding {
    match precision {
        Precision::Bf16 => Rounding::Bf16,
        Precision::F32 => Rounding::F32,
    }
}

/// How many values differ bitwise (the lengths must match).
pub fn differing(gpu: &[f32], cpu: &[f32]) -> usize {
    assert_eq!(gpu.len(), cpu.len(), "lengths");
    gpu.iter()
        .zip(cpu)
        .filter(|(g, c)| g.to_bits() != c.to_bits())
        .count()
}

/// Asserts `gpu` and `cpu` are bitwise equal, naming the first difference; returns how many
/// values were compared.
pub fn assert_bitwise(what: &str, gpu: &[f32], cpu: &[f32]) -> usize {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    if let Some(first) = (0..gpu.len()).find(|&i| gpu[i].to_bits() != cpu[i].to_bits()) {
        panic!(
            "{what}: {} of {} values differ; first at {first}: gpu {:e} ({:#010x}) cpu {:e} \
             ({:#010x})",
            differing(gpu, cpu),
            gpu.len(),
            gpu[first],
            gpu[first].to_bits(),
            cpu[first],
            cpu[first].to_bits()
        );
    }
    gpu.len()
}

/// `$DEEPINFER_V41_TINY`, else the shared v41-tiny fixture next to the repository (it may be
/// absent: each caller decides whether that skips or fails).
pub fn v41_tiny_path() -> PathBuf {
    std::env::var_os("DEEPINFER_V41_TINY")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/v41/v41-tiny")
        })
}

/// The fixture in `dir` loaded on the host (CPU backend, the stub Engram vocabulary), and its
/// config.
pub fn host_fixture_model(dir: &Path) -> (Model, ModelConfig) {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("fixture config");
    let vocab = engram_vocab_for_dir(dir, &cfg).expect("stub vocabulary");
    let model = Model::load_with_vocab(dir, vocab).expect("fixture loads");
    (model, cfg)
}
