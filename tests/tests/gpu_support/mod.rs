//! Shared by the GPU test binaries (`gpu*.rs`): opening the device (or failing the test naming why),
//! the seeded test data (`deepinfer_tests::data`), prompts and per-sequence sampling settings, bitwise
//! comparisons of device and host results, and a fixture's host model.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

pub mod gemm_data;

use std::fmt::Display;
use std::path::Path;

use deepinfer_actors::tools::logits::engram_vocab_for_dir;
use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::runtime::driver_available;
use deepinfer_model::Model;
use deepinfer_model::backend::Precision;
use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::sampling::SamplingParams;
// Each binary uses its own subset of these, as of the helpers below.
#[allow(unused_imports)]
pub use deepinfer_tests::data::{Rng, bf16_unit};

/// Both precisions of the model's activations.
pub const PRECISIONS: [Precision; 2] = [Precision::Bf16, Precision::F32];

/// `open()`s a device resource named `what` for `test`. No CUDA driver, or a driver that does not
/// open it, fails the test naming why: GPU tests run only on a machine with a GPU (the GPU suite,
/// `tests/gpu-suite.sh`), never as green no-ops.
fn open_or_fail<T, E: Display>(test: &str, what: &str, open: impl FnOnce() -> Result<T, E>) -> T {
    if let Err(err) = driver_available() {
        panic!("{test}: no CUDA driver ({err}); GPU tests run on the H200 via tests/gpu-suite.sh");
    }
    match open() {
        Ok(opened) => opened,
        Err(err) => panic!("{test}: a CUDA driver is present but the {what} did not open: {err}"),
    }
}

/// Opens the kernel runtime of device 0 (fails the test when it cannot).
pub fn runtime(test: &str) -> KernelRuntime {
    open_or_fail(test, "kernel runtime", || KernelRuntime::open(0))
}

/// Opens the CUDA backend of device 0 (exact numerics; fails the test when it cannot).
pub fn cuda_backend(test: &str) -> CudaBackend {
    cuda_backend_in(test, Numerics::Exact)
}

/// Opens the CUDA backend of device 0 in `numerics` (fails the test when it cannot).
pub fn cuda_backend_in(test: &str, numerics: Numerics) -> CudaBackend {
    open_or_fail(test, "backend", || CudaBackend::open(0, numerics))
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

/// The fixture in `dir` loaded on the host (CPU backend, the stub Engram vocabulary), and its
/// config.
pub fn host_fixture_model(dir: &Path) -> (Model, ModelConfig) {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("fixture config");
    let vocab = engram_vocab_for_dir(dir, &cfg).expect("stub vocabulary");
    let model = Model::load_with_vocab(dir, vocab).expect("fixture loads");
    (model, cfg)
}
