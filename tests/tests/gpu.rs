//! The kernels of `deepinfer-kernels` through their launchers against the CPU reference of
//! `deepinfer-model` (`quant.rs`, `CpuBackend`), over odd shapes, plus batch invariance of the
//! GEMMs; the whole fixture models on CUDA; what the CUDA backend does on its own. The
//! `Backend` ops of `CudaBackend` against `CpuBackend` in both numerics: `gpu_ops.rs` (the one
//! conformance harness, `deepinfer_tests::conformance`).
//!
//! Tolerances (each test asserts its own and prints what it measured):
//! - FP8 activation quantisation: bit-exact (codes and scales).
//! - FP8 / FP4 block-scaled GEMMs: bit-exact. The spec allows ≤ 1 bf16 ulp (another order inside
//!   a 32-block), but here both sides take a group's partial as the exact sum of its exact products
//!   rounded once to fp32 (the CPU in f64, the GPU with an exact two-part fp32 sum) and add the
//!   scaled partials in K order, so every bit must match.
//! - RoPE: bit-exact (same products, same rounding, host-built cos/sin tables).
//! - RMSNorm: ≤ 1 bf16 ulp asserted (both follow torch's CPU sum order for the mean of squares,
//!   so it is bit-exact in practice; the backend op is asserted bitwise in `gpu_ops.rs`).
//! - Batch invariance: a GEMM row computed with M = 1 is bitwise equal to that row inside M = 7 and
//!   M = 64.
//!
//! - The whole v41-tiny and v41-odd fixture models on CUDA against the CPU reference: equal greedy
//!   tokens and every logit bitwise equal (prompt and decode rows). Batch invariance: a sequence's
//!   logits alone and interleaved with other sequences are bitwise equal (negative control: a
//!   changed token is seen).
//!
//!   Measured on the H200 (2026-11-30): 53 248 / 53 248 logits bitwise equal, max|Δ| = 0. The V4
//!   tiny fixture through `logits --device cuda`: 87 040 / 87 040 bitwise equal to `--device cpu`.
//!
//! - Engram hashing on the device: the CPU hasher's row ids (one shot and chunked; negative
//!   control: other layers hash to other rows).
//!
//! Built only with `--features cuda` (`cargo test --workspace` does not build it); run by the GPU
//! suite (`tests/gpu-suite.sh`) on the H200. Without a CUDA driver every test fails, naming why.
//! The fixture tests read `tests/fixtures/` (`$DEEPINFER_FIXTURES`, which the suite sets).
#![cfg(feature = "cuda")]

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::compile::Compiler;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::graph::Graph;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::attention::DeviceKeyLists;
use deepinfer_kernels::ops::engram::{DeviceEngramHasher, engram_hash_rows};
use deepinfer_kernels::ops::gemm::{
    DeviceFp4Weight, DeviceFp8Weight, Fp4Form, Fp8Bytes, Fp8Form, GemmSplit, gemm_fp4, gemm_fp8,
};
use deepinfer_kernels::ops::index::DeviceVisiblePrefixes;
use deepinfer_kernels::ops::norm::rms_norm_f32;
use deepinfer_kernels::ops::quant::{ActGroup, quantize_act_fp8};
use deepinfer_kernels::ops::rope::{RopeRotation, RopeShape, rope_interleaved_f32};
use deepinfer_kernels::ops::sampling::{SampleRow, SampleScratch, sample_rows_f32};
use deepinfer_kernels::runtime::driver_available;
use deepinfer_kernels::{Arch, KernelError, KernelId, SourceFile};
use deepinfer_model::backend::cuda::{CudaBackend, CudaBackendError, Numerics};
use deepinfer_model::backend::{
    AttentionQueries, Backend, CompressedKeys, CpuBackend, HcCollapse, IndexQueries, KeyList,
    Precision, QueryKeys, RmsNorm, RopeTable, Rotation, SelectPart, Tensor,
};
use deepinfer_model::engram::{CompressedVocab, EngramHistory, NgramHasher};
use deepinfer_model::quant;
use deepinfer_tests::forward_one;
use half::bf16;

mod gpu_support;
use deepinfer_model::backend::cpu::argmax;
use deepinfer_tests::data::fp32_values;
use gpu_support::gemm_data::{
    activations, download_bf16, random_fp4_weight, random_fp8_weight, upload_bf16,
};
use gpu_support::{Rng, assert_bitwise, cuda_backend, runtime};

/// Distance in bf16 units in the last place between two bf16 values (same sign: bit distance;
/// otherwise the sum of both distances from zero).
fn bf16_ulps(a: f32, b: f32) -> u32 {
    let key = |v: f32| -> i64 {
        let bits = i64::from(bf16::from_f32(v).to_bits());
        if bits & 0x8000 != 0 {
            -(bits & 0x7fff)
        } else {
            bits
        }
    };
    (key(a) - key(b)).unsigned_abs() as u32
}

/// (elements exactly equal, max ulp distance) of `gpu` against `cpu`.
fn compare_bf16(gpu: &[f32], cpu: &[f32]) -> (usize, u32) {
    assert_eq!(gpu.len(), cpu.len());
    let mut exact = 0;
    let mut worst = 0;
    for (&g, &c) in gpu.iter().zip(cpu) {
        assert!(g.is_finite(), "non-finite GPU output {g}");
        if g.to_bits() == c.to_bits() {
            exact += 1;
        }
        worst = worst.max(bf16_ulps(g, c));
    }
    (exact, worst)
}

#[test]
fn every_kernel_compiles_and_loads() {
    let rt = runtime("every_kernel_compiles_and_loads");
    let report = rt.report();
    println!(
        "device {} ({}): {} modules compiled in {:.0} ms, {} from the cache",
        report.device_name,
        report.arch,
        report.modules_compiled,
        report.compile_ms,
        report.modules_from_cache
    );
    assert_eq!(rt.arch(), Arch::Sm90a, "the test machine is an H200");
    for id in KernelId::ALL {
        rt.function(id)
            .unwrap_or_else(|e| panic!("{}: {e}", id.symbol()));
    }
    // The deploy target's variants must compile too (untested on sm100 hardware).
    let compiler = Compiler::with_cache(None).expect("NVRTC");
    for file in SourceFile::ALL {
        let cubin = compiler
            .compile_uncached(file, Arch::Sm100a)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            cubin.len() > 1000,
            "{} for sm_100a: {} bytes",
            file.path(),
            cubin.len()
        );
    }
}

#[test]
fn act_quant_is_bit_exact() {
    let rt = runtime("act_quant_is_bit_exact");
    let mut rng = Rng(1);
    for (group, cols_list) in [
        (ActGroup::G32, [160usize, 544, 5120]),
        (ActGroup::G128, [384, 640, 5120]),
    ] {
        for rows in [1usize, 7, 64] {
            for cols in cols_list {
                let x = activations(&mut rng, rows, cols);
                let dx = upload_bf16(&rt, &x);
                let q = quantize_act_fp8(&rt, &dx, rows, cols, group).expect("quantise");
                let codes = rt.stream().clone_dtoh(&q.codes).expect("codes");
                let scales = rt.stream().clone_dtoh(&q.scales).expect("scales");
                let (want_codes, want_scales) = quant::quantize_act_fp8(&x, group.elements());
                assert_eq!(scales.len(), want_scales.len());
                for (i, (s, w)) in scales.iter().zip(&want_scales).enumerate() {
                    assert_eq!(
                        s.to_bits(),
                        w.to_bits(),
                        "group {} of [{rows}x{cols}] g{}: scale",
                        i,
                        group.elements()
                    );
                }
                let mismatches = codes
                    .iter()
                    .zip(&want_codes)
                    .filter(|(a, b)| a != b)
                    .count();
                assert_eq!(
                    mismatches,
                    0,
                    "[{rows}x{cols}] g{}: {mismatches} codes differ",
                    group.elements()
                );
            }
        }
    }
    // f32 storage (any fp32 values): the group maxima span the scale's range, from the 1e-4
    // floor (zeros, subnormals) to 2^120 (near f32's largest), where x / s and x · (1/s) must
    // still agree; and a row count whose elements end inside a warp's 128.
    for group in [ActGroup::G32, ActGroup::G128] {
        let (rows, cols) = (5usize, 384usize);
        let magnitudes = [0.0f32, 1e-41, 1e-30, 3e-5, 1.0, 7.5e3, 1e30, 2.5e38];
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let m = magnitudes[(i / group.elements()) % magnitudes.len()];
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * m * (0.25 + (i % 29) as f32 / 29.0)
            })
            .collect();
        let dx = rt.stream().clone_htod(&x).expect("upload");
        let q = quantize_act_fp8(&rt, &dx, rows, cols, group).expect("quantise f32");
        let codes = rt.stream().clone_dtoh(&q.codes).expect("codes");
        let scales = rt.stream().clone_dtoh(&q.scales).expect("scales");
        let (want_codes, want_scales) = quant::quantize_act_fp8(&x, group.elements());
        let scale_bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<u32>>();
        assert_eq!(
            scale_bits(&scales),
            scale_bits(&want_scales),
            "f32 g{} scales",
            group.elements()
        );
        assert_eq!(codes, want_codes, "f32 g{} codes", group.elements());
    }
    println!(
        "act_quant: bit-exact over M in {{1, 7, 64}}, groups 32 and 128, bf16 and f32 storage"
    );
}

/// Quantises `x` on the device and runs the FP8 GEMM.
fn device_gemm_fp8(rt: &KernelRuntime, x: &[f32], rows: usize, w: &DeviceFp8Weight) -> Vec<f32> {
    let group = if w.tile == 32 {
        ActGroup::G32
    } else {
        ActGroup::G128
    };
    let dx = upload_bf16(rt, x);
    let q = quantize_act_fp8(rt, &dx, rows, w.inp, group).expect("quantise");
    let mut y = rt
        .stream()
        .alloc_zeros::<bf16>(rows * w.out)
        .expect("alloc y");
    gemm_fp8(rt, &q, w, &mut y, GemmSplit::Auto).expect("gemm_fp8");
    download_bf16(rt, &y)
}

fn device_gemm_fp4(rt: &KernelRuntime, x: &[f32], rows: usize, w: &DeviceFp4Weight) -> Vec<f32> {
    let dx = upload_bf16(rt, x);
    let q = quantize_act_fp8(rt, &dx, rows, w.inp, ActGroup::G32).expect("quantise");
    let mut y = rt
        .stream()
        .alloc_zeros::<bf16>(rows * w.out)
        .expect("alloc y");
    gemm_fp4(rt, &q, w, &mut y, GemmSplit::Auto).expect("gemm_fp4");
    download_bf16(rt, &y)
}

#[test]
fn gemms_are_batch_invariant() {
    let rt = runtime("gemms_are_batch_invariant");
    let mut rng = Rng(4);
    let (n, k) = (203usize, 544usize);
    let x64 = activations(&mut rng, 64, k);
    let fp8 = random_fp8_weight(&mut rng, n, k, 32);
    let dw8 = DeviceFp8Weight::upload(&rt, (&fp8).into()).expect("upload");
    let fp4 = random_fp4_weight(&mut rng, n, k);
    let dw4 = DeviceFp4Weight::upload(&rt, (&fp4).into()).expect("upload");
    type Gemm<'a> = Box<dyn Fn(&[f32], usize) -> Vec<f32> + 'a>;
    let gemms: [(&str, Gemm); 2] = [
        (
            "fp8",
            Box::new(|x: &[f32], rows: usize| device_gemm_fp8(&rt, x, rows, &dw8)),
        ),
        (
            "fp4",
            Box::new(|x: &[f32], rows: usize| device_gemm_fp4(&rt, x, rows, &dw4)),
        ),
    ];
    for (name, gemm) in &gemms {
        let y64 = gemm(&x64, 64);
        let y7 = gemm(&x64[..7 * k], 7);
        for r in [0usize, 3, 6, 9, 40, 63] {
            let y1 = gemm(&x64[r * k..(r + 1) * k], 1);
            let in64 = &y64[r * n..(r + 1) * n];
            assert!(
                y1.iter().zip(in64).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: row {r} differs between M=1 and M=64"
            );
            if r < 7 {
                let in7 = &y7[r * n..(r + 1) * n];
                assert!(
                    y1.iter().zip(in7).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name}: row {r} differs between M=1 and M=7"
                );
            }
        }
        // The same row placed elsewhere in a batch of other rows gives the same bits.
        let mut shuffled = x64.clone();
        shuffled.rotate_left(5 * k);
        let y_shuffled = gemm(&shuffled, 64);
        assert_eq!(
            &y_shuffled[..n],
            &y64[5 * n..6 * n],
            "{name}: row 5 moved to row 0 changed"
        );
        // Negative control: the comparison sees a change of one input of the row (the sign of
        // its largest element, which keeps the group scale and changes a non-zero code).
        let mut nudged = x64[3 * k..4 * k].to_vec();
        let largest = (0..k)
            .max_by(|&a, &b| nudged[a].abs().total_cmp(&nudged[b].abs()))
            .expect("k > 0");
        nudged[largest] = -nudged[largest];
        let y_nudged = gemm(&nudged, 1);
        assert_ne!(
            &y_nudged[..],
            &y64[3 * n..4 * n],
            "{name}: the invariance check cannot see a changed input"
        );
        println!(
            "gemm_{name}: M=1 rows bitwise equal to their rows in M=7 and M=64 (and after a batch \
             rotation); a one-element input change is detected"
        );
    }
}

/// The number of warps that share a column's K range changes who computes each partial, never the
/// order of the additions: every split gives the same bits (and they match the CPU reference).
#[test]
fn gemm_results_do_not_depend_on_the_work_split() {
    let rt = runtime("gemm_results_do_not_depend_on_the_work_split");
    let mut rng = Rng(7);
    // 10 chunks of 32 k-groups, so that every split has a ragged last step.
    let (rows, n, k) = (7usize, 45usize, 32 * 32 * 10 - 64);
    let x = activations(&mut rng, rows, k);
    let fp8 = random_fp8_weight(&mut rng, n, k, 32);
    let fp4 = random_fp4_weight(&mut rng, n, k);
    let dw8 = DeviceFp8Weight::upload(&rt, (&fp8).into()).expect("upload");
    let dw4 = DeviceFp4Weight::upload(&rt, (&fp4).into()).expect("upload");
    let dx = upload_bf16(&rt, &x);
    let q = quantize_act_fp8(&rt, &dx, rows, k, ActGroup::G32).expect("quantise");
    let want8 = quant::gemm_fp8(&x, &fp8);
    let want4 = quant::gemm_fp4(&x, &fp4);
    for split in [1, 2, 4, 8]
        .map(GemmSplit::WarpsPerColumn)
        .into_iter()
        .chain([GemmSplit::Auto, GemmSplit::ColumnPerWarp])
    {
        let mut y = rt.stream().alloc_zeros::<bf16>(rows * n).expect("alloc");
        gemm_fp8(&rt, &q, &dw8, &mut y, split).expect("gemm_fp8");
        let (exact8, _) = compare_bf16(&download_bf16(&rt, &y), &want8);
        gemm_fp4(&rt, &q, &dw4, &mut y, split).expect("gemm_fp4");
        let (exact4, _) = compare_bf16(&download_bf16(&rt, &y), &want4);
        assert_eq!((exact8, exact4), (rows * n, rows * n), "{split:?}");
    }
    let mut y = rt.stream().alloc_zeros::<bf16>(rows * n).expect("alloc");
    let err = gemm_fp8(&rt, &q, &dw8, &mut y, GemmSplit::WarpsPerColumn(3)).expect_err("3 warps");
    assert!(err.to_string().contains("must be 1, 2, 4 or 8"), "{err}");
    println!("gemm: 1, 2, 4, 8 warps per column and Auto give identical, reference-exact bits");
}

#[test]
fn rms_norm_matches_the_cpu_reference() {
    let rt = runtime("rms_norm_matches_the_cpu_reference");
    let mut rng = Rng(5);
    let cpu = CpuBackend::new();
    for eps in [1e-6f32, 1e-20] {
        for cols in [224usize, 512, 1536, 5120] {
            let weight: Vec<f32> = (0..cols)
                .map(|_| quant::round_bf16(1.0 + 0.5 * rng.uniform()))
                .collect();
            let dw = rt.htod(&weight).expect("upload w");
            for rows in [1usize, 7, 64] {
                let x = activations(&mut rng, rows, cols);
                let dx = rt.htod(&x).expect("upload x");
                let mut dy = rt.stream().alloc_zeros::<f32>(rows * cols).expect("alloc");
                rms_norm_f32(&rt, &dx, &dw, &mut dy, rows, cols, eps, Rounding::Bf16)
                    .expect("rms_norm");
                let gpu = rt.stream().clone_dtoh(&dy).expect("download");
                let want = cpu.rms_norm(
                    &Tensor::from(&x),
                    RmsNorm {
                        weight: &weight,
                        eps,
                        precision: Precision::Bf16,
                    },
                );
                let (exact, worst) = compare_bf16(&gpu, &want);
                if rows == 64 {
                    println!(
                        "rms_norm [{rows}x{cols}] eps {eps:e}: {exact}/{} bit-exact, max {worst} bf16 ulp",
                        gpu.len()
                    );
                }
                assert!(
                    worst <= 1,
                    "rms_norm [{rows}x{cols}] eps {eps}: {worst} ulp"
                );
            }
        }
    }
}

#[test]
fn rope_matches_the_cpu_reference_bit_exact() {
    let rt = runtime("rope_matches_the_cpu_reference_bit_exact");
    let mut rng = Rng(6);
    let cpu = CpuBackend::new();
    let (rope_dim, head_dim) = (64usize, 192usize);
    let table = RopeTable {
        freqs: (0..rope_dim / 2)
            .map(|i| 1.0f32 / 10000f32.powf((2 * i) as f32 / rope_dim as f32))
            .collect(),
    };
    let table_rows = 70_000usize;
    let (cos, sin): (Vec<f32>, Vec<f32>) = (0..table_rows)
        .flat_map(|position| (0..rope_dim / 2).map(move |pair| (position, pair)))
        .map(|(position, pair)| table.cos_sin(position, pair))
        .unzip();
    let dcos = rt.stream().clone_htod(&cos).expect("cos");
    let dsin = rt.stream().clone_htod(&sin).expect("sin");
    for inverse in [false, true] {
        for (tokens, heads) in [(1usize, 1usize), (7, 3), (64, 8)] {
            let x = activations(&mut rng, tokens * heads, head_dim);
            let positions: Vec<usize> = (0..tokens)
                .map(|_| rng.below(table_rows as u64) as usize)
                .collect();
            let dpos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
            let dpos = rt.stream().clone_htod(&dpos).expect("positions");
            let mut dx = rt.htod(&x).expect("upload x");
            let device_rotation = RopeRotation {
                positions: &dpos,
                cos: &dcos,
                sin: &dsin,
                shape: RopeShape {
                    tokens,
                    heads,
                    head_dim,
                    rope_dim,
                    table_rows,
                },
                inverse,
            };
            rope_interleaved_f32(&rt, &mut dx, device_rotation, Rounding::Bf16).expect("rope");
            let gpu = rt.stream().clone_dtoh(&dx).expect("download");
            let rotation = Rotation {
                table: &table,
                positions: &positions,
                inverse,
                precision: Precision::Bf16,
            };
            let want = cpu.rope(Tensor::from(&x), (head_dim, heads), &rotation);
            let (exact, worst) = compare_bf16(&gpu, &want);
            assert_eq!(
                exact,
                gpu.len(),
                "rope {tokens}x{heads} inverse={inverse}: max {worst} ulp"
            );
        }
    }
    println!("rope: bit-exact (tokens 1/7/64, positions < {table_rows}, forward and inverse)");
}

#[test]
fn launchers_reject_mismatched_shapes() {
    let rt = runtime("launchers_reject_mismatched_shapes");
    let x = upload_bf16(&rt, &[0.5; 64]);
    let err =
        quantize_act_fp8(&rt, &x, 2, 48, ActGroup::G32).expect_err("48 is not a multiple of 32");
    assert!(err.to_string().contains("multiple of the group"), "{err}");
    let err = quantize_act_fp8(&rt, &x, 3, 32, ActGroup::G32).expect_err("x is too short");
    assert!(
        err.to_string().contains("x has 64 elements, expected 96"),
        "{err}"
    );
    let long_codes = Fp8Bytes {
        out: 4,
        inp: 32,
        tile: 32,
        codes: &[0; 100],
        scales: &[127],
    };
    let err = DeviceFp8Weight::upload(&rt, long_codes).expect_err("codes too long");
    assert!(
        err.to_string()
            .contains("codes has 100 elements, expected 128"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// CudaBackend on its own (its ops against CpuBackend: gpu_ops.rs, the conformance harness).

/// `Backend::resident`: a host tensor (a step's embedded streams) is uploaded once and comes back
/// as a device tensor with the same values; a device tensor is kept as it is (same buffer).
#[test]
fn resident_uploads_a_host_tensor_once_and_keeps_a_device_one() {
    let gpu = cuda_backend("resident_uploads_a_host_tensor_once_and_keeps_a_device_one");
    let values = fp32_values(&mut Rng(31), 1037);
    let placed = gpu.resident(Tensor::from(values.clone()));
    let view = placed.device_view().expect("a device tensor");
    let kept = gpu.resident(placed.clone());
    let kept_view = kept.device_view().expect("still a device tensor");
    assert!(std::sync::Arc::ptr_eq(&view.buffer, &kept_view.buffer));
    assert_eq!(kept_view.offset, view.offset);
    assert_bitwise("resident", &kept, &values);
}

#[test]
fn backend_open_is_an_error_without_a_driver() {
    if driver_available().is_ok() {
        let backend = CudaBackend::open(0, Numerics::Exact).expect("the driver is present");
        assert!(backend.name().starts_with("cuda:0 ("), "{}", backend.name());
        println!("backend name: {}", backend.name());
        return;
    }
    let opened = std::panic::catch_unwind(|| CudaBackend::open(0, Numerics::Exact).map(|_| ()));
    let err = opened
        .expect("CudaBackend::open must not panic without a driver")
        .expect_err("no driver");
    assert!(err.to_string().contains("no CUDA driver"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// The whole v41-tiny model on CUDA.

/// The repository's V4.1 fixture `name` (`$DEEPINFER_FIXTURES` on the H200).
fn v41_fixture_dir(name: &str) -> std::path::PathBuf {
    deepinfer_tests::fixture_dir(&format!("v41/{name}"))
}

fn load_v41_fixture(dir: &std::path::Path, backend: Box<dyn Backend>) -> deepinfer_model::Model {
    use deepinfer_model::checkpoint::Checkpoint;
    use deepinfer_model::config::ModelConfig;
    use deepinfer_model::engram::CompressedVocab;
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("fixture config");
    let engram = cfg.engram.as_ref().expect("fixture has Engram");
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, engram.pad_token_id).expect("vocab");
    let ckpt = Checkpoint::open(dir).expect("fixture checkpoint");
    deepinfer_model::Model::from_checkpoint(cfg, &ckpt, Some(vocab), backend).expect("model")
}

fn fixture_tokens(dir: &std::path::Path) -> Vec<u32> {
    let case: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).expect("case.json"))
            .expect("case json");
    let primary = case["primary_case"].as_str().expect("primary_case");
    case["cases"][primary]["input_ids"]
        .as_array()
        .expect("input_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

/// What [`prefill_and_decode`] produced and how long it took.
struct GreedyRun {
    /// Every logits row: the prompt's, then one per decode step.
    logits: Vec<f32>,
    generated: Vec<u32>,
    prefill_ms: f64,
    decode_step_ms: f64,
}

/// Prefill of `tokens` then `decode` greedy steps.
fn prefill_and_decode(model: &deepinfer_model::Model, tokens: &[u32], decode: usize) -> GreedyRun {
    use deepinfer_model::LogitsWanted;
    let vocab = model.config().vocab_size;
    let mut seq = model.new_sequence();
    let started = std::time::Instant::now();
    let mut logits = forward_one(model, &mut seq, tokens, LogitsWanted::All).expect("prefill");
    let prefill_ms = started.elapsed().as_secs_f64() * 1e3;
    let started = std::time::Instant::now();
    let mut generated = Vec::new();
    for _ in 0..decode {
        let last = &logits[logits.len() - vocab..];
        let next = argmax(last);
        generated.push(next);
        logits.extend(forward_one(model, &mut seq, &[next], LogitsWanted::All).expect("decode"));
    }
    GreedyRun {
        logits,
        generated,
        prefill_ms,
        decode_step_ms: started.elapsed().as_secs_f64() * 1e3 / decode.max(1) as f64,
    }
}

/// A V4.1 fixture's primary prompt and a few greedy steps on CUDA (`exact`) against the CPU
/// reference: every logit bitwise equal.
fn fixture_on_cuda_matches_the_cpu_reference(name: &str, test: &str) {
    let dir = v41_fixture_dir(name);
    let cuda = cuda_backend(test);
    let tokens = fixture_tokens(&dir);
    let gpu_model = load_v41_fixture(&dir, Box::new(cuda));
    let cpu_model = load_v41_fixture(&dir, Box::new(CpuBackend::new()));
    let vocab = cpu_model.config().vocab_size;
    const DECODE: usize = 4;
    let gpu_run = prefill_and_decode(&gpu_model, &tokens, DECODE);
    let cpu_run = prefill_and_decode(&cpu_model, &tokens, DECODE);
    let (gpu, gpu_tokens) = (&gpu_run.logits, &gpu_run.generated);
    let (cpu, cpu_tokens) = (&cpu_run.logits, &cpu_run.generated);
    assert_eq!(gpu.len(), cpu.len());
    let (lo, hi) = cpu
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let range = hi - lo;
    let max_diff = gpu
        .iter()
        .zip(cpu.iter())
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let bitwise = gpu
        .iter()
        .zip(cpu.iter())
        .filter(|(a, b)| a.to_bits() == b.to_bits())
        .count();
    let rows = gpu.len() / vocab;
    let argmax_equal = (0..rows)
        .filter(|&r| {
            argmax(&gpu[r * vocab..(r + 1) * vocab]) == argmax(&cpu[r * vocab..(r + 1) * vocab])
        })
        .count();
    println!(
        "{name} on {}: {} prompt + {DECODE} decode tokens; logits {bitwise}/{} bitwise equal to \
         the CPU reference, max|Δ| = {max_diff} ({:.3e} of the range {range}); greedy argmax equal \
         in {argmax_equal}/{rows} rows; generated {gpu_tokens:?} (CPU {cpu_tokens:?}); prefill \
         {:.1} ms GPU vs {:.1} ms CPU, decode step {:.1} ms GPU vs {:.1} ms CPU (per-op copies)",
        gpu_model.backend().name(),
        tokens.len(),
        gpu.len(),
        max_diff / range,
        gpu_run.prefill_ms,
        cpu_run.prefill_ms,
        gpu_run.decode_step_ms,
        cpu_run.decode_step_ms
    );
    assert_eq!(gpu_tokens, cpu_tokens, "greedy tokens");
    assert_eq!(argmax_equal, rows, "greedy argmax of every row");
    assert_bitwise(
        &format!("{name} logits on CUDA vs the CPU reference"),
        gpu,
        cpu,
    );
}

#[test]
fn v41_tiny_on_cuda_matches_the_cpu_reference() {
    fixture_on_cuda_matches_the_cpu_reference(
        "v41-tiny",
        "v41_tiny_on_cuda_matches_the_cpu_reference",
    );
}

/// v41-odd: dims not multiples of 128 (d 192, heads of 96, RoPE 32, window 12, top-16).
#[test]
fn v41_odd_on_cuda_matches_the_cpu_reference() {
    fixture_on_cuda_matches_the_cpu_reference(
        "v41-odd",
        "v41_odd_on_cuda_matches_the_cpu_reference",
    );
}

#[test]
fn v41_tiny_on_cuda_is_batch_invariant() {
    use deepinfer_model::LogitsWanted;
    let dir = v41_fixture_dir("v41-tiny");
    let cuda = cuda_backend("v41_tiny_on_cuda_is_batch_invariant");
    let model = load_v41_fixture(&dir, Box::new(cuda));
    let tokens = fixture_tokens(&dir);
    let n = tokens.len();
    let half = n / 2;
    let others: Vec<Vec<u32>> = (0..3)
        .map(|k| {
            tokens
                .iter()
                .rev()
                .skip(k)
                .map(|&t| (t + 7 * (k as u32 + 1)) % model.config().vocab_size as u32)
                .take(5 + 9 * k)
                .collect()
        })
        .collect();
    // Alone: prefill in two chunks, then two decode tokens.
    let decode = [3u32, 11];
    let run_alone = |prompt: &[u32]| {
        let mut seq = model.new_sequence();
        let mut out =
            forward_one(&model, &mut seq, &prompt[..half], LogitsWanted::All).expect("chunk 1");
        out.extend(
            forward_one(&model, &mut seq, &prompt[half..], LogitsWanted::All).expect("chunk 2"),
        );
        for t in decode {
            out.extend(forward_one(&model, &mut seq, &[t], LogitsWanted::All).expect("decode"));
        }
        out
    };
    let alone = run_alone(&tokens);
    // Interleaved: the other sequences' prefill and decode steps run between this sequence's.
    let mut seq = model.new_sequence();
    let mut other_seqs: Vec<_> = others.iter().map(|_| model.new_sequence()).collect();
    let mut interleaved =
        forward_one(&model, &mut seq, &tokens[..half], LogitsWanted::All).expect("chunk 1");
    for (other, other_tokens) in other_seqs.iter_mut().zip(&others) {
        forward_one(&model, other, other_tokens, LogitsWanted::All).expect("other prefill");
    }
    interleaved.extend(
        forward_one(&model, &mut seq, &tokens[half..], LogitsWanted::All).expect("chunk 2"),
    );
    for t in decode {
        for other in other_seqs.iter_mut() {
            forward_one(&model, other, &[t + 1], LogitsWanted::All).expect("other decode");
        }
        interleaved.extend(forward_one(&model, &mut seq, &[t], LogitsWanted::All).expect("decode"));
    }
    assert_bitwise("v41-tiny logits alone vs interleaved", &interleaved, &alone);
    // Negative control: the comparison sees a one-token change of the sequence.
    let mut changed = tokens.clone();
    changed[n - 1] = (changed[n - 1] + 1) % model.config().vocab_size as u32;
    let control = run_alone(&changed);
    assert_ne!(control, alone, "a changed token must change the logits");
    println!(
        "v41-tiny on CUDA: {} logits of one sequence bitwise equal alone and interleaved with 3 \
         others (lengths {:?}); a one-token change is detected",
        alone.len(),
        others.iter().map(Vec::len).collect::<Vec<_>>()
    );
}

/// Every `vocab`-wide row of `gpu` has the greedy token (first maximum) of that row of `cpu`.
fn assert_greedy_rows_equal(gpu: &[f32], cpu: &[f32], vocab: usize) {
    assert_eq!(gpu.len(), cpu.len(), "logits");
    for (r, (g, c)) in gpu.chunks(vocab).zip(cpu.chunks(vocab)).enumerate() {
        assert_eq!(argmax(g), argmax(c), "row {r}");
    }
}

/// Reads tensor `logits` (F32) of a safetensors file written by the logits tool.
fn read_logits(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("logits file");
    let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let view = tensors.tensor("logits").expect("tensor logits");
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `deepinfer-node logits --device cuda` (the tool behind the flag): the same logits as on the CPU,
/// bit for bit, in chunked prefill; without a driver, a clear `--device cuda` error instead of a
/// panic (and the test fails: it needs the GPU).
#[test]
fn logits_tool_runs_on_cuda() {
    use deepinfer_actors::tools::logits::{LogitsDevice, LogitsRequest, run_on};
    let dir = v41_fixture_dir("v41-tiny");
    let out_dir = tempfile::tempdir().expect("temp dir");
    let tokens = fixture_tokens(&dir);
    let n = tokens.len();
    let request = |name: &str| LogitsRequest {
        model_dir: dir.clone(),
        tokens: tokens.clone(),
        chunks: vec![n - 3, 1, 2],
        out: out_dir.path().join(name),
    };
    if let Err(err) = driver_available() {
        let result =
            std::panic::catch_unwind(|| run_on(&request("gpu.safetensors"), LogitsDevice::Cuda))
                .expect("the logits tool must not panic without a driver");
        let message = result.expect_err("no driver").to_string();
        assert!(message.starts_with("--device cuda: "), "{message}");
        assert!(message.contains("no CUDA driver"), "{message}");
        panic!(
            "logits_tool_runs_on_cuda: no CUDA driver ({err}); the tool said, as it should: {message}"
        );
    }
    let shape = run_on(&request("gpu.safetensors"), LogitsDevice::Cuda).expect("cuda logits");
    run_on(&request("cpu.safetensors"), LogitsDevice::Cpu).expect("cpu logits");
    let gpu = read_logits(&out_dir.path().join("gpu.safetensors"));
    let cpu = read_logits(&out_dir.path().join("cpu.safetensors"));
    assert_eq!(shape, [n, gpu.len() / n]);
    let vocab = shape[1];
    let bitwise = gpu
        .iter()
        .zip(cpu.iter())
        .filter(|(a, b)| a.to_bits() == b.to_bits())
        .count();
    assert_greedy_rows_equal(&gpu, &cpu, vocab);
    println!(
        "logits tool --device cuda, chunks [{}, 1, 2]: {bitwise}/{} logits bitwise equal to --device cpu, greedy argmax equal in every row",
        n - 3,
        gpu.len()
    );
    assert_bitwise("logits tool --device cuda vs --device cpu", &gpu, &cpu);
}

/// The V4 tiny fixture (float32 precision, 128×128 FP8 tiles, the fp32 linears over FP8 / FP4
/// weights) through `logits --device cuda` against `--device cpu`: every logit bitwise equal (and
/// so the greedy argmax of every row).
#[test]
fn v4_tiny_on_cuda_matches_the_cpu_reference() {
    use deepinfer_actors::tools::logits::{LogitsDevice, LogitsRequest, run_on};
    let dir = deepinfer_tests::fixture_dir("v4/v4-tiny");
    drop(cuda_backend("v4_tiny_on_cuda_matches_the_cpu_reference"));
    let case: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).expect("case.json"))
            .expect("case json");
    let tokens: Vec<u32> = case["input_ids"]
        .as_array()
        .expect("input_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    let n = tokens.len();
    let out_dir = tempfile::tempdir().expect("temp dir");
    let request = |name: &str| LogitsRequest {
        model_dir: dir.clone(),
        tokens: tokens.clone(),
        chunks: vec![n - 2, 1, 1],
        out: out_dir.path().join(name),
    };
    let started = std::time::Instant::now();
    let shape = run_on(&request("gpu.safetensors"), LogitsDevice::Cuda).expect("cuda logits");
    let gpu_ms = started.elapsed().as_secs_f64() * 1e3;
    run_on(&request("cpu.safetensors"), LogitsDevice::Cpu).expect("cpu logits");
    let gpu = read_logits(&out_dir.path().join("gpu.safetensors"));
    let cpu = read_logits(&out_dir.path().join("cpu.safetensors"));
    let vocab = shape[1];
    let (lo, hi) = cpu
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let max_diff = gpu
        .iter()
        .zip(&cpu)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let bitwise = gpu
        .iter()
        .zip(&cpu)
        .filter(|(a, b)| a.to_bits() == b.to_bits())
        .count();
    println!(
        "v4-tiny logits --device cuda ({n} tokens, chunks [{}, 1, 1], {gpu_ms:.0} ms with loading): \
         {bitwise}/{} bitwise equal to --device cpu, max|Δ| = {max_diff} of the range {}",
        n - 2,
        gpu.len(),
        hi - lo
    );
    assert_greedy_rows_equal(&gpu, &cpu, vocab);
    assert_eq!(
        bitwise,
        gpu.len(),
        "every V4 op on the device is bitwise the CPU's (max|Δ| {max_diff})"
    );
}

// ---------------------------------------------------------------------------------------------
// Sampling, MoE routing and Engram on the device against the CPU reference.

/// [`NgramHasher::rows_of_contexts`] by the device kernel (`engram_hash_rows`) on `gpu`'s
/// runtime: the hashing parameters and the contexts uploaded, the row ids downloaded.
fn device_engram_hash(gpu: &CudaBackend, hasher: &NgramHasher, contexts: &[u64]) -> Vec<u32> {
    let rt = gpu.runtime();
    let max_ngram = hasher.max_ngram();
    let tokens = contexts.len() / max_ngram;
    let layout = hasher.layout();
    let flat = |v: &[Vec<u64>]| -> Vec<u64> { v.iter().flatten().copied().collect() };
    let dhasher = DeviceEngramHasher::upload(
        rt,
        max_ngram,
        &flat(hasher.multipliers()),
        &flat(&layout.primes),
        &flat(&layout.offsets),
    )
    .expect("hasher uploads");
    let stream = rt.stream();
    let dcontexts = stream
        .clone_htod(&contexts[..tokens * max_ngram])
        .expect("contexts upload");
    let mut drows = stream
        .alloc_zeros::<u32>(tokens * dhasher.layers * dhasher.columns)
        .expect("alloc");
    engram_hash_rows(rt, &dhasher, &dcontexts, &mut drows).expect("device engram hash");
    stream.clone_dtoh(&drows).expect("row ids download")
}

#[test]
fn engram_hash_on_the_device_matches_the_cpu() {
    let gpu = cuda_backend("engram_hash_on_the_device_matches_the_cpu");
    let mut rng = Rng(33);
    let vocab = CompressedVocab::halving_stub(4096, 2).expect("stub vocabulary");
    let hasher = NgramHasher::new(&[1, 4, 9], 4, 3, 5000, 2048, vocab).expect("hasher");
    let tokens: Vec<u32> = (0..301).map(|_| rng.below(4096) as u32).collect();
    let dead: Vec<bool> = (0..tokens.len()).map(|i| (40..47).contains(&i)).collect();
    let contexts = hasher.contexts_of_chunk(&mut EngramHistory::new(), &tokens, &dead);
    let rows_gpu = device_engram_hash(&gpu, &hasher, &contexts);
    let rows_cpu = hasher.rows_of_contexts(&contexts);
    assert_eq!(rows_gpu.len(), tokens.len() * 3 * 9);
    assert_eq!(rows_gpu, rows_cpu, "engram row ids");
    // Chunked through the hasher (the production path) equals the device's one shot.
    let mut history = EngramHistory::new();
    let mut chunked = Vec::new();
    for (start, end) in [(0, 1), (1, 45), (45, 300), (300, 301)] {
        let rows = hasher.hash_chunk(&mut history, &tokens[start..end], &dead[start..end]);
        chunked.extend_from_slice(rows.as_slice());
    }
    assert_eq!(chunked, rows_gpu, "chunked hashing");
    // Negative control: other layers hash to other rows.
    let other = NgramHasher::new(
        &[2, 4, 9],
        4,
        3,
        5000,
        2048,
        CompressedVocab::halving_stub(4096, 2).expect("stub vocabulary"),
    )
    .expect("hasher");
    assert_ne!(other.rows_of_contexts(&contexts), rows_gpu);

    println!(
        "engram hash on the device: {} row ids equal ({} tokens, chunked too)",
        rows_gpu.len(),
        tokens.len()
    );
}

#[test]
fn sampling_launcher_rejects_missing_scratch() {
    let rt = runtime("sampling_launcher_rejects_missing_scratch");
    let stream = rt.stream();
    let logits = stream.clone_htod(&[0.5f32; 40]).expect("upload");
    let row = SampleRow {
        seed: 1,
        position: 0,
        temperature: 1.0,
        top_p: 0.5,
        top_k: 0,
        reserved: 0,
    };
    let rows = stream.clone_htod(&[row, row]).expect("upload");
    let mut scratch = SampleScratch::new(&rt, 2, 20, false).expect("scratch");
    let mut tokens = stream.alloc_zeros::<u32>(2).expect("alloc");
    let err = sample_rows_f32(
        &rt,
        &logits,
        &rows,
        &[row, row],
        &mut scratch,
        &mut tokens,
        20,
    )
    .expect_err("top-p rows need the sort scratch");
    assert!(
        err.to_string()
            .contains("sort scratch has 1 elements, expected 64"),
        "{err}"
    );
}

// Row-batched ops (`Backend::*_rows*`): every row of one n-row call bitwise equal to the CPU
// reference and to the GPU's one-token op on that row alone (batch invariance).

#[test]
fn row_ops_reject_mismatched_shapes() {
    let gpu = cuda_backend("row_ops_reject_mismatched_shapes");
    let rt = gpu.runtime();
    let err = DeviceKeyLists::upload(rt, &[vec![0u32, 3], vec![1]], 3)
        .err()
        .expect("row 3 of a 3-row key buffer");
    assert!(
        err.to_string()
            .contains("query 0 lists key row 3, beyond the 3 rows"),
        "{err}"
    );
    let err = DeviceVisiblePrefixes::upload(rt, &[2, 9], 8).expect_err("9 visible of 8 keys");
    assert!(
        err.to_string()
            .contains("query 1 sees 9 keys from row 0, beyond the 8"),
        "{err}"
    );
    let err = DeviceVisiblePrefixes::upload_from(rt, &[0, 5], &[2, 4], 8)
        .expect_err("rows 5..9 of 8 keys");
    assert!(
        err.to_string()
            .contains("query 1 sees 4 keys from row 5, beyond the 8"),
        "{err}"
    );
    let err = gpu
        .try_hc_collapse_rows(
            &Tensor::from(vec![0.5; 12]),
            HcCollapse {
                weights: &Tensor::from(vec![0.25; 5]),
                hc: 2,
                precision: Precision::Bf16,
            },
        )
        .expect_err("5 weights are not whole tokens of hc = 2");
    assert!(
        matches!(
            &err,
            CudaBackendError::Op {
                op: "hc_collapse_rows",
                source: KernelError::Shape { .. }
            }
        ),
        "{err}"
    );
    let key = Tensor::from(vec![0.5f32; 8]);
    let short_key = key.range(0..4);
    // Two queries of one 8-value head each over `keys`.
    let attend = |keys: &[QueryKeys<'_>]| {
        let q = Tensor::from(vec![0.5; 16]);
        let attention = AttentionQueries {
            q: &q,
            sink: &[0.0],
            scale: 1.0,
            precision: Precision::Bf16,
        };
        gpu.try_sparse_attention_rows(attention, keys)
    };
    let err = attend(&[
        QueryKeys::listed(vec![&key]),
        QueryKeys::listed(vec![&short_key]),
    ])
    .expect_err("a 4-value key among 8-value heads");
    assert!(
        err.to_string()
            .contains("key 0 of query 1 has 4 values, head_dim is 8"),
        "{err}"
    );
    let entries = KeyList::from(vec![key.clone(); 2]);
    let err = attend(&[
        QueryKeys {
            compressed: Some(CompressedKeys::prefix(&entries, 2)),
            ..QueryKeys::listed(Vec::new())
        },
        QueryKeys {
            compressed: Some(CompressedKeys::prefix(&entries, 3)),
            ..QueryKeys::listed(Vec::new())
        },
    ])
    .expect_err("a prefix of 3 of 2 compressed entries");
    assert!(
        err.to_string()
            .contains("query 1 reads the first 3 compressed entries of 2"),
        "{err}"
    );
    let err = gpu
        .try_index_scores_rows(
            IndexQueries {
                q: &Tensor::from(vec![0.5; 10]),
                weights: &Tensor::from(vec![1.0; 2]),
                head_dim: 4,
                precision: Precision::F32,
            },
            SelectPart {
                keys: &KeyList::from(vec![Tensor::from(vec![0.5; 4]); 2]),
                visible: &[1, 2],
            },
        )
        .expect_err("10 query values for 2 queries of 1 head of 4");
    assert!(err.to_string().contains("q has 10 values"), "{err}");
}

/// The runtime's memory pool keeps what a stream frees (its release threshold is raised at open):
/// 1 GiB allocated and freed stays out of the driver's free memory after a synchronisation, and
/// `release_pooled_memory` hands it back. Negative control: the release does give it back, so
/// the first figure is not a probe that never moves.
#[test]
fn the_memory_pool_keeps_freed_memory_until_released() {
    use deepinfer_kernels::runtime::release_pooled_memory;
    let rt = runtime("the_memory_pool_keeps_freed_memory_until_released");
    const BYTES: usize = 1 << 30;
    let free = || rt.context().mem_get_info().expect("mem_get_info").0;
    release_pooled_memory(rt.stream()).expect("release");
    let before = free();
    let buffer = rt.stream().alloc_zeros::<u8>(BYTES).expect("alloc 1 GiB");
    drop(buffer);
    rt.stream().synchronize().expect("sync");
    let kept = free();
    release_pooled_memory(rt.stream()).expect("release");
    let released = free();
    println!(
        "memory pool: free {before} before, {kept} after a freed 1 GiB and a sync, {released} after \
         the release"
    );
    assert!(
        before.saturating_sub(kept) >= BYTES * 9 / 10,
        "the pool handed the freed GiB back at the sync: free {before} -> {kept}"
    );
    assert!(
        released.saturating_sub(kept) >= BYTES * 9 / 10,
        "release_pooled_memory did not hand the GiB back: free {kept} -> {released}"
    );
}

/// Two dependent RMSNorms `x → t → y` (`t` a temporary), the sequence the capture test records.
fn two_norms(
    rt: &KernelRuntime,
    x: &CudaSlice<f32>,
    (w1, w2): (&CudaSlice<f32>, &CudaSlice<f32>),
    y: &mut CudaSlice<f32>,
    (rows, cols): (usize, usize),
) -> Result<(), KernelError> {
    // SAFETY: the first norm writes every element of `t` before the second reads it.
    let mut t =
        unsafe { rt.alloc_written::<f32>(rows * cols) }.map_err(|source| KernelError::Driver {
            during: "allocating the temporary".to_string(),
            source,
        })?;
    rms_norm_f32(rt, x, w1, &mut t, rows, cols, 1e-6, Rounding::Bf16)?;
    rms_norm_f32(rt, &t, w2, y, rows, cols, 1e-6, Rounding::Bf16)
}

/// A captured launch sequence (`deepinfer_kernels::graph`) replays the eager launches' bits,
/// reads its inputs at replay time (a new input gives the eager result of that input, a
/// different one: the negative control), stays the same over many replays, and a capture refuses
/// an upload, a wait and the kernel timer without breaking the stream.
#[test]
fn a_captured_sequence_replays_the_eager_bits_and_refuses_what_would_break_it() {
    let rt = runtime("a_captured_sequence_replays_the_eager_bits_and_refuses_what_would_break_it");
    let (rows, cols) = (8usize, 1536usize);
    let mut rng = Rng(29);
    let weights: Vec<Vec<f32>> = (0..2)
        .map(|_| {
            (0..cols)
                .map(|_| quant::round_bf16(1.0 + 0.5 * rng.uniform()))
                .collect()
        })
        .collect();
    let (w1, w2) = (
        rt.htod(&weights[0]).expect("w1"),
        rt.htod(&weights[1]).expect("w2"),
    );
    let inputs = [
        activations(&mut rng, rows, cols),
        activations(&mut rng, rows, cols),
    ];
    let eager: Vec<Vec<f32>> = inputs
        .iter()
        .map(|x| {
            let dx = rt.htod(x).expect("upload x");
            let mut dy = rt.stream().alloc_zeros::<f32>(rows * cols).expect("y");
            two_norms(&rt, &dx, (&w1, &w2), &mut dy, (rows, cols)).expect("eager norms");
            rt.stream().clone_dtoh(&dy).expect("download")
        })
        .collect();
    assert!(
        eager[0] != eager[1],
        "the two inputs must give different outputs"
    );

    let mut dx = rt.htod(&inputs[0]).expect("upload x");
    let mut dy = rt.stream().alloc_zeros::<f32>(rows * cols).expect("y");
    rt.synchronize().expect("before the capture");
    let launches = rt.counts().launches;
    let (graph, ()) = rt
        .capture(|| two_norms(&rt, &dx, (&w1, &w2), &mut dy, (rows, cols)))
        .expect("capture");
    assert_eq!(graph.kernels(), 2, "the captured kernels");
    assert_eq!(
        rt.stream().clone_dtoh(&dy).expect("download"),
        vec![0.0; rows * cols],
        "a capture runs nothing"
    );
    println!(
        "captured {} kernels ({} launcher calls), {} programmatic edge(s) between them",
        graph.kernels(),
        rt.counts().launches - launches,
        graph.programmatic_edges()
    );
    for (input, want) in inputs.iter().zip(&eager) {
        rt.stream().memcpy_htod(input, &mut dx).expect("new input");
        for _ in 0..100 {
            graph.replay().expect("replay");
        }
        let got = rt.stream().clone_dtoh(&dy).expect("download");
        assert_bitwise("replayed norms", &got, want);
    }

    let refused = |what: &str, result: Result<(Graph, ()), KernelError>| {
        let err = result
            .err()
            .unwrap_or_else(|| panic!("{what}: the capture was not refused"));
        println!("{what}: {err}");
        let mut dy = rt.stream().alloc_zeros::<f32>(rows * cols).expect("y");
        two_norms(&rt, &dx, (&w1, &w2), &mut dy, (rows, cols)).expect("eager after a refusal");
        rt.synchronize().expect("the stream after a refusal");
        assert_bitwise(
            "eager norms after a refused capture",
            &rt.stream().clone_dtoh(&dy).expect("download"),
            &eager[1],
        );
        err.to_string()
    };
    let upload = refused(
        "an upload inside a capture",
        rt.capture(|| {
            rt.htod(&inputs[0]).map_err(|source| KernelError::Driver {
                during: "uploading".to_string(),
                source,
            })?;
            Ok(())
        }),
    );
    assert!(upload.contains("CAPTURE_UNSUPPORTED"), "{upload}");
    let wait = refused("a wait inside a capture", rt.capture(|| rt.synchronize()));
    assert!(wait.contains("CAPTURE_UNSUPPORTED"), "{wait}");
    rt.kernel_timer().set_enabled(true);
    let timed = refused("a capture with the kernel timer on", rt.capture(|| Ok(())));
    rt.kernel_timer().set_enabled(false);
    assert!(timed.contains("timer"), "{timed}");
}
