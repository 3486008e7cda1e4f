//! GPU conformance: every kernel of `deepinfer-kernels` against the CPU reference of
//! `deepinfer-model` (`quant.rs`, `CpuBackend`), over odd shapes, plus batch invariance of the GEMMs.
//!
//! Tolerances (each test asserts its own and prints what it measured):
//! - FP8 activation quantisation: bit-exact (codes and scales).
//! - FP8 / FP4 block-scaled GEMMs: bit-exact. The spec allows ≤ 1 bf16 ulp (another order inside
//!   a 32-block), but here both sides take a group's partial as the exact sum of its exact products
//!   rounded once to fp32 (the CPU in f64, the GPU with an exact two-part fp32 sum) and add the
//!   scaled partials in K order, so every bit must match.
//! - RoPE: bit-exact (same products, same rounding, host-built cos/sin tables).
//! - RMSNorm: ≤ 1 bf16 ulp asserted (both follow torch's CPU sum order for the mean of squares,
//!   so it is bit-exact in practice; the backend test below asserts bitwise equality).
//! - Batch invariance: a GEMM row computed with M = 1 is bitwise equal to that row inside M = 7 and
//!   M = 64.
//!
//! - `CudaBackend` (the model's `Backend` on the GPU) against `CpuBackend`, op by op over odd shapes
//!   and both precisions: bit-exact (every op reproduces the CPU reference's operation order,
//!   including torch's CPU sum order for the means of squares).
//! - The whole v41-tiny and v41-odd fixture models on CUDA against the CPU reference: equal greedy tokens and
//!   every logit bitwise equal (prompt and decode rows). Batch invariance: a sequence's logits
//!   alone and interleaved with other sequences are bitwise equal (negative control: a changed
//!   token is seen).
//!
//!   Measured on the H200 (2026-11-30): 53 248 / 53 248 logits bitwise equal, max|Δ| = 0. The V4
//!   tiny fixture through `logits --device cuda`: 87 040 / 87 040 bitwise equal to `--device cpu`.
//!
//! - Sampling (`Backend::sample_rows`), the MoE router (`route_experts`) and Engram hashing and
//!   table lookup on the device: the same token ids, the same experts and bitwise-equal weights and
//!   table values as the CPU over odd shapes (vocabularies of 1, 7, 513, 3001 and 129 280; ties,
//!   ±0, ±∞ and NaN logits; top-k and top-p at their edges; 1 to 300 experts, forced lists), each
//!   with a negative control (other seeds / biases / layers change the result).
//!
//! Built only with `--features cuda` (`cargo test --workspace` does not build it); run by the GPU
//! suite (`tests/gpu-suite.sh`) on the H200. Without a CUDA driver every test fails, naming why.
//! The fixture tests read `tests/fixtures/` (`$DEEPINFER_FIXTURES`, which the suite sets).
#![cfg(feature = "cuda")]

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::compile::Compiler;
use deepinfer_kernels::ops::attention::DeviceKeyLists;
use deepinfer_kernels::ops::engram::{DeviceEngramHasher, engram_hash_rows};
use deepinfer_kernels::ops::gemm::{
    DeviceFp4Weight, DeviceFp8Weight, GemmSplit, gemm_fp4, gemm_fp4_split, gemm_fp8, gemm_fp8_split,
};
use deepinfer_kernels::ops::index::DeviceVisiblePrefixes;
use deepinfer_kernels::ops::norm::rms_norm_bf16;
use deepinfer_kernels::ops::quant::{ActGroup, quantize_act_fp8};
use deepinfer_kernels::ops::rope::{RopeShape, rope_interleaved_bf16};
use deepinfer_kernels::ops::sampling::{SampleRow, SampleScratch, sample_rows_f32};
use deepinfer_kernels::runtime::driver_available;
use deepinfer_kernels::{Arch, KernelError, KernelId, SourceFile};
use deepinfer_model::backend::cuda::{CudaBackend, CudaBackendError, Numerics};
use deepinfer_model::backend::weights::Linear;
use deepinfer_model::backend::{
    AttentionQueries, Backend, CpuBackend, DenseWeight, ExpertSelection, HcCollapse, HcExpand,
    HcMix, HcMixes, HcMixing, HcParams, IndexQueries, KeyList, LogprobPick, MaskedRows, Precision,
    RmsNorm, RopeTable, Rotation, Routing, RowSampling, SampleRowsError, SelectPart, Tensor,
};
use deepinfer_model::engram::{CompressedVocab, EngramHistory, EngramTable, NgramHasher};
use deepinfer_model::quant;
use deepinfer_model::sampling::{
    AllowedTokens, MAX_TOP_LOGPROBS, MaskError, SamplingParams, TokenLogprobs, sample_allowed,
    token_logprobs,
};
use deepinfer_tests::forward_one;
use half::bf16;

mod gpu_support;
use deepinfer_model::backend::cpu::argmax;
use gpu_support::gemm_data::{
    activations, download_bf16, e4m3, e8m0, random_fp4_weight, random_fp8_weight, upload_bf16,
};
use gpu_support::{PRECISIONS, Rng, assert_bitwise, bf16_unit, cuda_backend, runtime};

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

/// One query's sparse attention: the one-row case of [`Backend::sparse_attention_rows_at`].
fn attention_of_one(
    backend: &dyn Backend,
    q: &[f32],
    keys: &[&[f32]],
    sink: &[f32],
    scale: f32,
    precision: Precision,
) -> Vec<f32> {
    let keys: Vec<Tensor> = keys.iter().map(|&k| Tensor::from(k)).collect();
    let list: Vec<&Tensor> = keys.iter().collect();
    backend
        .sparse_attention_rows_at(
            AttentionQueries {
                q: &q.into(),
                sink,
                scale,
                precision,
            },
            &[list],
        )
        .into_vec()
}

/// One token's mHC mixes: the one-row case of [`Backend::hc_mixes_rows`].
fn mixes_of_one(backend: &dyn Backend, x: &[f32], params: &HcParams, mixing: &HcMixing) -> HcMix {
    let mixes = backend.hc_mixes_rows(&x.into(), params, mixing);
    assert_eq!(mixes.tokens(), 1, "x is one token's streams");
    mixes.token(0)
}

/// One token's collapse: the one-row case of [`Backend::hc_collapse_rows_at`].
fn collapse_of_one(
    backend: &dyn Backend,
    x: &[f32],
    weights: &[f32],
    precision: Precision,
) -> Vec<f32> {
    backend
        .hc_collapse_rows_at(
            &x.into(),
            HcCollapse {
                weights: &weights.into(),
                hc: weights.len(),
                precision,
            },
        )
        .into_vec()
}

/// One token's expansion: the one-row case of [`Backend::hc_expand_rows_at`].
fn expand_of_one(
    backend: &dyn Backend,
    y: &[f32],
    residual: &[f32],
    mix: &HcMix,
    precision: Precision,
) -> Vec<f32> {
    let mixes = HcMixes::from_host(mix.post.len(), std::slice::from_ref(mix));
    backend
        .hc_expand_rows_at(
            &y.into(),
            HcExpand {
                residual: &residual.into(),
                mixes: &mixes,
                precision,
            },
        )
        .into_vec()
}

/// One query's index scores over every key: the one-row case of
/// [`Backend::index_scores_rows_at`].
fn scores_of_one(
    backend: &dyn Backend,
    q: &[f32],
    weights: &[f32],
    keys: &[f32],
    head_dim: usize,
    precision: Precision,
) -> Vec<f32> {
    let keys = KeyList::from(Tensor::from(keys).split_rows(head_dim));
    let visible = [keys.len()];
    backend
        .index_scores_rows_at(
            IndexQueries {
                q: &q.into(),
                weights: &weights.into(),
                head_dim,
                precision,
            },
            SelectPart {
                keys: &keys,
                visible: &visible,
            },
        )
        .remove(0)
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
    println!("act_quant: bit-exact over M in {{1, 7, 64}}, groups 32 and 128");
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
    gemm_fp8(rt, &q, w, &mut y).expect("gemm_fp8");
    download_bf16(rt, &y)
}

fn device_gemm_fp4(rt: &KernelRuntime, x: &[f32], rows: usize, w: &DeviceFp4Weight) -> Vec<f32> {
    let dx = upload_bf16(rt, x);
    let q = quantize_act_fp8(rt, &dx, rows, w.inp, ActGroup::G32).expect("quantise");
    let mut y = rt
        .stream()
        .alloc_zeros::<bf16>(rows * w.out)
        .expect("alloc y");
    gemm_fp4(rt, &q, w, &mut y).expect("gemm_fp4");
    download_bf16(rt, &y)
}

#[test]
fn gemm_fp8_matches_the_cpu_reference() {
    let rt = runtime("gemm_fp8_matches_the_cpu_reference");
    let mut rng = Rng(2);
    // (block, n, k): k a multiple of 32 but not of 128 where the block allows; n not a multiple of
    // the tile or of the 8 columns a GPU block computes.
    for (block, n, k) in [
        (32usize, 100usize, 160usize),
        (32, 203, 544),
        (32, 64, 1056),
        (128, 200, 384),
        (128, 131, 640),
    ] {
        let w = random_fp8_weight(&mut rng, n, k, block);
        let dw = DeviceFp8Weight::upload(&rt, n, k, block, &w.data, &w.scales).expect("upload");
        for rows in [1usize, 7, 64] {
            let x = activations(&mut rng, rows, k);
            let gpu = device_gemm_fp8(&rt, &x, rows, &dw);
            let cpu = quant::gemm_fp8(&x, &w);
            let (exact, worst) = compare_bf16(&gpu, &cpu);
            println!(
                "gemm_fp8 t{block} [{rows}x{k}]·[{k}x{n}]: {exact}/{} bit-exact, max {worst} bf16 ulp",
                gpu.len()
            );
            assert_eq!(
                exact,
                gpu.len(),
                "gemm_fp8 t{block} M={rows} N={n} K={k}: not bit-exact (max {worst} ulp)"
            );
        }
    }
}

#[test]
fn gemm_fp4_matches_the_cpu_reference() {
    let rt = runtime("gemm_fp4_matches_the_cpu_reference");
    let mut rng = Rng(3);
    for (n, k) in [(100usize, 160usize), (203, 544), (72, 2304)] {
        let w = random_fp4_weight(&mut rng, n, k);
        let dw = DeviceFp4Weight::upload(&rt, n, k, &w.packed, &w.scales).expect("upload");
        for rows in [1usize, 7, 64] {
            let x = activations(&mut rng, rows, k);
            let gpu = device_gemm_fp4(&rt, &x, rows, &dw);
            let cpu = quant::gemm_fp4(&x, &w);
            let (exact, worst) = compare_bf16(&gpu, &cpu);
            println!(
                "gemm_fp4 [{rows}x{k}]·[{k}x{n}]: {exact}/{} bit-exact, max {worst} bf16 ulp",
                gpu.len()
            );
            assert_eq!(
                exact,
                gpu.len(),
                "gemm_fp4 M={rows} N={n} K={k}: not bit-exact (max {worst} ulp)"
            );
        }
    }
}

#[test]
fn gemms_are_batch_invariant() {
    let rt = runtime("gemms_are_batch_invariant");
    let mut rng = Rng(4);
    let (n, k) = (203usize, 544usize);
    let x64 = activations(&mut rng, 64, k);
    let fp8 = random_fp8_weight(&mut rng, n, k, 32);
    let dw8 = DeviceFp8Weight::upload(&rt, n, k, 32, &fp8.data, &fp8.scales).expect("upload");
    let fp4 = random_fp4_weight(&mut rng, n, k);
    let dw4 = DeviceFp4Weight::upload(&rt, n, k, &fp4.packed, &fp4.scales).expect("upload");
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
    let dw8 = DeviceFp8Weight::upload(&rt, n, k, 32, &fp8.data, &fp8.scales).expect("upload");
    let dw4 = DeviceFp4Weight::upload(&rt, n, k, &fp4.packed, &fp4.scales).expect("upload");
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
        gemm_fp8_split(&rt, &q, &dw8, &mut y, split).expect("gemm_fp8");
        let (exact8, _) = compare_bf16(&download_bf16(&rt, &y), &want8);
        gemm_fp4_split(&rt, &q, &dw4, &mut y, split).expect("gemm_fp4");
        let (exact4, _) = compare_bf16(&download_bf16(&rt, &y), &want4);
        assert_eq!((exact8, exact4), (rows * n, rows * n), "{split:?}");
    }
    let mut y = rt.stream().alloc_zeros::<bf16>(rows * n).expect("alloc");
    let err =
        gemm_fp8_split(&rt, &q, &dw8, &mut y, GemmSplit::WarpsPerColumn(3)).expect_err("3 warps");
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
            let dw = upload_bf16(&rt, &weight);
            for rows in [1usize, 7, 64] {
                let x = activations(&mut rng, rows, cols);
                let dx = upload_bf16(&rt, &x);
                let mut dy = rt.stream().alloc_zeros::<bf16>(rows * cols).expect("alloc");
                rms_norm_bf16(&rt, &dx, &dw, &mut dy, rows, cols, eps).expect("rms_norm");
                let gpu = download_bf16(&rt, &dy);
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
            let mut dx = upload_bf16(&rt, &x);
            let shape = RopeShape {
                tokens,
                heads,
                head_dim,
                rope_dim,
                table_rows,
            };
            rope_interleaved_bf16(&rt, &mut dx, &dpos, &dcos, &dsin, shape, inverse).expect("rope");
            let gpu = download_bf16(&rt, &dx);
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
    let err =
        DeviceFp8Weight::upload(&rt, 4, 32, 32, &[0; 100], &[127]).expect_err("codes too long");
    assert!(
        err.to_string()
            .contains("codes has 100 elements, expected 128"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// CudaBackend against CpuBackend.

/// fp32 values with a wide spread (not bf16-representable): `uniform · 2^e`, e in -8..=4.
fn fp32_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.uniform() * 2f32.powi(rng.below(13) as i32 - 8))
        .collect()
}

#[test]
fn backend_linears_are_bit_exact() {
    let gpu = cuda_backend("backend_linears_are_bit_exact");
    let cpu = CpuBackend::new();
    let mut rng = Rng(11);
    let mut checked = 0;
    // inp above, at and below the 256-product sgemm block, with ragged last blocks.
    for (out, inp) in [
        (5usize, 100usize),
        (37, 256),
        (9, 600),
        (130, 1030),
        (4, 1700),
        (2, 2100),
    ] {
        let w = fp32_values(&mut rng, out * inp);
        for rows in [1usize, 3, 7] {
            let x = Tensor::from(fp32_values(&mut rng, rows * inp));
            checked += assert_bitwise(
                &format!("linear_f32 [{rows}x{inp}]·[{inp}x{out}]"),
                &gpu.linear_f32(
                    &x,
                    DenseWeight {
                        values: &w,
                        out,
                        inp,
                    },
                ),
                &cpu.linear_f32(
                    &x,
                    DenseWeight {
                        values: &w,
                        out,
                        inp,
                    },
                ),
            );
            checked += assert_bitwise(
                &format!("linear_bf16 [{rows}x{inp}]·[{inp}x{out}]"),
                &gpu.linear_bf16(
                    &x,
                    DenseWeight {
                        values: &w,
                        out,
                        inp,
                    },
                ),
                &cpu.linear_bf16(
                    &x,
                    DenseWeight {
                        values: &w,
                        out,
                        inp,
                    },
                ),
            );
        }
    }
    // A weight with fewer rows than `out` yields the rows it has, like the CPU reference.
    let w = fp32_values(&mut rng, 3 * 64);
    let x = Tensor::from(fp32_values(&mut rng, 2 * 64));
    checked += assert_bitwise(
        "linear_f32 short weight",
        &gpu.linear_f32(
            &x,
            DenseWeight {
                values: &w,
                out: 5,
                inp: 64,
            },
        ),
        &cpu.linear_f32(
            &x,
            DenseWeight {
                values: &w,
                out: 5,
                inp: 64,
            },
        ),
    );
    println!("backend linear_f32/linear_bf16: {checked} values bit-exact");
}

#[test]
fn backend_rms_norm_and_rope_match() {
    let gpu = cuda_backend("backend_rms_norm_and_rope_match");
    let cpu = CpuBackend::new();
    let mut rng = Rng(12);
    let (mut exact, mut total) = (0usize, 0usize);
    for precision in PRECISIONS {
        for cols in [3usize, 64, 333, 2048, 7000] {
            let weight: Vec<f32> = (0..cols)
                .map(|_| quant::round_bf16(1.0 + 0.5 * rng.uniform()))
                .collect();
            for rows in [1usize, 5] {
                // fp32-valued inputs (the compressor's pooled rows are not bf16) and bf16 ones.
                let bf16_rows = if cols >= 64 {
                    activations(&mut rng, rows, cols)
                } else {
                    bf16_unit(&mut rng, rows * cols)
                };
                for x in [fp32_values(&mut rng, rows * cols), bf16_rows] {
                    let x = Tensor::from(x);
                    let g = gpu.rms_norm(
                        &x,
                        RmsNorm {
                            weight: &weight,
                            eps: 1e-6,
                            precision,
                        },
                    );
                    let c = cpu.rms_norm(
                        &x,
                        RmsNorm {
                            weight: &weight,
                            eps: 1e-6,
                            precision,
                        },
                    );
                    let (e, _) = compare_bf16(&g, &c);
                    exact += e;
                    total +=
                        assert_bitwise(&format!("rms_norm {rows}x{cols} {precision:?}"), &g, &c);
                }
            }
        }
    }
    println!(
        "backend rms_norm: {exact}/{total} bit-exact (bf16 and f32 precision, 1..2048 columns)"
    );
    assert!(gpu.cached_weights() > 0, "rms_norm weights are cached");

    let table = RopeTable {
        freqs: (0..8)
            .map(|i| 1.0f32 / 10000f32.powf(i as f32 / 8.0))
            .collect(),
    };
    let mut checked = 0;
    for precision in PRECISIONS {
        for inverse in [false, true] {
            for (rows, vectors, stride) in [(1usize, 1usize, 16usize), (5, 3, 48), (9, 4, 64)] {
                let x = fp32_values(&mut rng, rows * vectors * stride);
                let positions: Vec<usize> = (0..rows).map(|_| rng.below(70_000) as usize).collect();
                let rotation = Rotation {
                    table: &table,
                    positions: &positions,
                    inverse,
                    precision,
                };
                let g = gpu.rope(Tensor::from(&x), (stride, vectors), &rotation);
                let c = cpu.rope(Tensor::from(&x), (stride, vectors), &rotation);
                checked += assert_bitwise(
                    &format!("rope {rows}x{vectors}x{stride} inverse={inverse} {precision:?}"),
                    &g,
                    &c,
                );
            }
        }
    }
    println!("backend rope: {checked} values bit-exact");
}

#[test]
fn backend_qdq_points_are_bit_exact() {
    let gpu = cuda_backend("backend_qdq_points_are_bit_exact");
    let cpu = CpuBackend::new();
    let mut rng = Rng(13);
    let mut checked = 0;
    // Whole groups and a short last group; wide magnitudes, tiny groups (amax floors) and zeros.
    for n in [32usize, 16 * 7 + 5, 32 * 5 + 7, 512, 4096 + 19] {
        let mut x = activations(&mut rng, 1, n.max(64))[..n].to_vec();
        for v in x.iter_mut().take(16) {
            *v = quant::round_bf16(*v * 1e-6);
        }
        type Qdq = fn(&dyn Backend, Tensor) -> Tensor;
        let points: [(&str, Qdq); 3] = [
            ("q8", |b, x| b.q8_qdq(x)),
            ("q4e", |b, x| b.q4e_qdq(x)),
            ("q4m", |b, x| b.q4m_qdq(x)),
        ];
        for (name, qdq) in points {
            let g = qdq(&gpu, Tensor::from(&x));
            let c = qdq(&cpu, Tensor::from(&x));
            assert_ne!(c, x, "{name}: the QDQ changes its input");
            checked += assert_bitwise(&format!("{name} n={n}"), &g, &c);
        }
    }
    println!("backend q8/q4e/q4m QDQ: {checked} values bit-exact");
}

#[test]
fn backend_sparse_attention_is_bit_exact() {
    let gpu = cuda_backend("backend_sparse_attention_is_bit_exact");
    let cpu = CpuBackend::new();
    let mut rng = Rng(14);
    let mut checked = 0;
    for precision in PRECISIONS {
        for (heads, head_dim) in [(1usize, 64usize), (3, 96), (4, 512)] {
            for n_keys in [0usize, 1, 63, 64, 65, 200] {
                let wide = n_keys == 65;
                let q = if wide {
                    activations(&mut rng, heads, head_dim)
                } else {
                    bf16_unit(&mut rng, heads * head_dim)
                };
                let keys: Vec<Vec<f32>> =
                    (0..n_keys).map(|_| bf16_unit(&mut rng, head_dim)).collect();
                let key_refs: Vec<&[f32]> = keys.iter().map(Vec::as_slice).collect();
                let sink: Vec<f32> = (0..heads).map(|_| 2.0 * rng.uniform()).collect();
                let scale = (head_dim as f32).powf(-0.5);
                checked += assert_bitwise(
                    &format!("attention h{heads} d{head_dim} n{n_keys} {precision:?}"),
                    &attention_of_one(&gpu, &q, &key_refs, &sink, scale, precision),
                    &attention_of_one(&cpu, &q, &key_refs, &sink, scale, precision),
                );
            }
        }
    }
    println!("backend sparse_attention: {checked} values bit-exact (0..200 keys, both precisions)");
}

#[test]
fn backend_mhc_matches() {
    let gpu = cuda_backend("backend_mhc_matches");
    let cpu = CpuBackend::new();
    let mut rng = Rng(15);
    let (mut exact, mut total) = (0usize, 0usize);
    // (4, 5120): the real V4.1 width, 64 K chains and two rounds of the split sum of squares;
    // (5, 3500): 35 projections, K chains of 273 and 274 (a partial last K tile), two rounds of
    // segments plus a tail of groups, leftover vectors and leftover values in the torch sum.
    for (hc, dim) in [
        (1usize, 5usize),
        (4, 64),
        (4, 100),
        (2, 1000),
        (4, 4096),
        (4, 5120),
        (5, 3500),
    ] {
        let n = hc * dim;
        let rows = (2 + hc) * hc;
        let params = HcParams {
            proj: (0..rows * n).map(|_| 0.05 * rng.uniform()).collect(),
            base: (0..rows).map(|_| 0.5 * rng.uniform()).collect(),
            scale: vec![0.7, 0.3, 1.9],
        };
        for iters in [0usize, 1, 20] {
            let x = if dim >= 64 {
                activations(&mut rng, hc, dim)
            } else {
                bf16_unit(&mut rng, hc * dim)
            };
            let mixing = HcMixing {
                hc,
                sinkhorn_iters: iters,
                hc_eps: 1e-6,
                norm_eps: 1e-6,
            };
            let g = mixes_of_one(&gpu, &x, &params, &mixing);
            let c = mixes_of_one(&cpu, &x, &params, &mixing);
            for (name, a, b) in [
                ("pre", &g.pre, &c.pre),
                ("post", &g.post, &c.post),
                ("comb", &g.comb, &c.comb),
            ] {
                assert_eq!(a.len(), b.len(), "{name}");
                for (u, v) in a.iter().zip(b.iter()) {
                    total += 1;
                    if u.to_bits() == v.to_bits() {
                        exact += 1;
                    }
                    assert_eq!(
                        u.to_bits(),
                        v.to_bits(),
                        "hc_mixes hc{hc} dim{dim} iters{iters} {name}: {u} vs {v}"
                    );
                }
            }
        }
        let mix = HcMix {
            pre: (0..hc).map(|_| rng.uniform()).collect(),
            post: (0..hc).map(|_| 2.0 * rng.uniform()).collect(),
            comb: (0..hc * hc).map(|_| rng.uniform()).collect(),
        };
        for precision in PRECISIONS {
            let x = fp32_values(&mut rng, n);
            let y = bf16_unit(&mut rng, dim);
            exact += assert_bitwise(
                &format!("hc_collapse hc{hc} dim{dim} {precision:?}"),
                &collapse_of_one(&gpu, &x, &mix.pre, precision),
                &collapse_of_one(&cpu, &x, &mix.pre, precision),
            );
            exact += assert_bitwise(
                &format!("hc_expand hc{hc} dim{dim} {precision:?}"),
                &expand_of_one(&gpu, &y, &x, &mix, precision),
                &expand_of_one(&cpu, &y, &x, &mix, precision),
            );
            total += dim + n;
        }
    }
    println!("backend mHC: {exact}/{total} values bit-exact");
    assert_eq!(
        exact, total,
        "every mHC value was bit-exact so far: investigate a change"
    );
}

#[test]
fn backend_index_scores_are_bit_exact() {
    let gpu = cuda_backend("backend_index_scores_are_bit_exact");
    let cpu = CpuBackend::new();
    let mut rng = Rng(16);
    let mut checked = 0;
    for precision in PRECISIONS {
        for (heads, head_dim) in [(1usize, 32usize), (5, 32), (64, 128)] {
            for n in [0usize, 1, 17, 130] {
                let q = bf16_unit(&mut rng, heads * head_dim);
                let w: Vec<f32> = (0..heads)
                    .map(|_| quant::round_bf16(rng.uniform()))
                    .collect();
                let keys = bf16_unit(&mut rng, n * head_dim);
                checked += assert_bitwise(
                    &format!("index_scores h{heads} d{head_dim} n{n} {precision:?}"),
                    &scores_of_one(&gpu, &q, &w, &keys, head_dim, precision),
                    &scores_of_one(&cpu, &q, &w, &keys, head_dim, precision),
                );
            }
        }
    }
    println!("backend index_scores: {checked} values bit-exact");
}

#[test]
fn backend_gemms_are_bit_exact_and_upload_weights_once() {
    let gpu = cuda_backend("backend_gemms_are_bit_exact_and_upload_weights_once");
    let cpu = CpuBackend::new();
    let mut rng = Rng(17);
    let fp8 = random_fp8_weight(&mut rng, 203, 544, 32);
    let fp8_v4 = random_fp8_weight(&mut rng, 131, 640, 128);
    let fp4 = random_fp4_weight(&mut rng, 72, 2304);
    let mut checked = 0;
    for rows in [1usize, 7] {
        for w in [&fp8, &fp8_v4] {
            let x = Tensor::from(activations(&mut rng, rows, w.inp));
            checked += assert_bitwise("gemm_fp8", &gpu.gemm_fp8(&x, w), &cpu.gemm_fp8(&x, w));
        }
        let x = Tensor::from(activations(&mut rng, rows, fp4.inp));
        checked += assert_bitwise("gemm_fp4", &gpu.gemm_fp4(&x, &fp4), &cpu.gemm_fp4(&x, &fp4));
    }
    // fp32 activations (V4's float32 precision feeds them): quantised from f32 storage directly.
    let x = Tensor::from(fp32_values(&mut rng, 3 * fp8.inp));
    checked += assert_bitwise(
        "gemm_fp8 f32 input",
        &gpu.gemm_fp8(&x, &fp8),
        &cpu.gemm_fp8(&x, &fp8),
    );
    let x = Tensor::from(fp32_values(&mut rng, 3 * fp4.inp));
    checked += assert_bitwise(
        "gemm_fp4 f32 input",
        &gpu.gemm_fp4(&x, &fp4),
        &cpu.gemm_fp4(&x, &fp4),
    );
    assert_eq!(
        gpu.cached_weights(),
        3,
        "each weight uploaded once, reused on the second call"
    );
    println!(
        "backend gemm_fp8 (t32, t128) / gemm_fp4: {checked} values bit-exact, 3 weights cached"
    );
}

/// The fp32 linears over FP8 / FP4 weights (V4's float32 path): dequantised on the device from the
/// cached FP8 / FP4 copy (the whole weight, or equal blocks of rows past 2^26 values: the
/// 8200 × 8192 case runs as two blocks of 4100 rows) against the CPU reference; the result
/// stays on the device (no copy until the comparison reads it).
#[test]
fn backend_fp32_linears_over_quantised_weights_are_bit_exact() {
    let gpu = cuda_backend("backend_fp32_linears_over_quantised_weights_are_bit_exact");
    let cpu = CpuBackend::new();
    let counters = gpu.transfer_counters();
    let mut rng = Rng(18);
    let mut checked = 0;
    // 320 inputs = 2 sgemm blocks; 8200 × 8192 > 2^26 values = 2 dequantisation blocks.
    for (out, inp, block, rows) in [
        (1100usize, 96usize, 32usize, &[1usize, 3][..]),
        (70, 320, 32, &[1, 3]),
        (131, 384, 128, &[1, 3]),
        (8200, 8192, 128, &[2]),
    ] {
        let w = Linear::Fp8(random_fp8_weight(&mut rng, out, inp, block));
        for &rows in rows {
            let x = Tensor::from(fp32_values(&mut rng, rows * inp));
            let before = counters.snapshot();
            let y = gpu.linear(&x, &w);
            assert_eq!(
                counters.snapshot().to_host_copies,
                before.to_host_copies,
                "linear over FP8 copied its result to the host"
            );
            checked += assert_bitwise(
                &format!("linear FP8 [{rows}x{inp}]·[{inp}x{out}] t{block}"),
                &y,
                &cpu.linear(&x, &w),
            );
        }
    }
    for (out, inp) in [(70usize, 320usize), (1030, 64)] {
        let w = Linear::Fp4(random_fp4_weight(&mut rng, out, inp));
        let x = Tensor::from(fp32_values(&mut rng, 2 * inp));
        checked += assert_bitwise(
            &format!("linear FP4 [2x{inp}]·[{inp}x{out}]"),
            &gpu.linear(&x, &w),
            &cpu.linear(&x, &w),
        );
    }
    println!("backend linear over FP8 / FP4 weights: {checked} values bit-exact");
}

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

/// `Backend::table_rows`: a step's token embeddings read on the device from a table uploaded once
/// (the weight cache), the CPU's rows bit for bit, repeated ids included; a row past the table
/// is an error naming the id, not a read out of bounds.
#[test]
fn table_rows_read_the_resident_table_and_equal_the_cpu() {
    let gpu = cuda_backend("table_rows_read_the_resident_table_and_equal_the_cpu");
    let (rows, width) = (37, 96);
    let table = fp32_values(&mut Rng(37), rows * width);
    let ids = [36u32, 0, 5, 5, 17, 36];
    let cached = gpu.cached_weights();
    let expected = CpuBackend.table_rows(&table, width, &ids);
    let got = gpu.table_rows(&table, width, &ids);
    assert!(got.device_view().is_some(), "the rows stay on the device");
    assert_bitwise("table_rows", &got, &expected);
    assert_eq!(
        gpu.cached_weights(),
        cached + 1,
        "the table is uploaded once"
    );
    let again = gpu.table_rows(&table, width, &ids[..2]);
    assert_bitwise("table_rows again", &again, &expected[..2 * width]);
    assert_eq!(
        gpu.cached_weights(),
        cached + 1,
        "and found in the cache after"
    );
    let err = gpu
        .try_table_rows(&table, width, &[3, rows as u32])
        .expect_err("a row past the table");
    assert!(
        err.to_string().contains("id 1 is row 37 of a 37-row table"),
        "{err}"
    );
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
    for r in 0..n {
        assert_eq!(
            argmax(&gpu[r * vocab..(r + 1) * vocab]),
            argmax(&cpu[r * vocab..(r + 1) * vocab]),
            "row {r}"
        );
    }
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
    for r in 0..n {
        assert_eq!(
            argmax(&gpu[r * vocab..(r + 1) * vocab]),
            argmax(&cpu[r * vocab..(r + 1) * vocab]),
            "row {r}"
        );
    }
    assert_eq!(
        bitwise,
        gpu.len(),
        "every V4 op on the device is bitwise the CPU's (max|Δ| {max_diff})"
    );
}

// ---------------------------------------------------------------------------------------------
// Sampling, MoE routing and Engram on the device against the CPU reference.

/// A logit row of one of several kinds: spread values, coarse values with many ties (exact
/// duplicates of the maximum included), a flat row, and rows with non-finite entries.
fn logit_row(rng: &mut Rng, vocab: usize, kind: u64) -> Vec<f32> {
    let mut row: Vec<f32> = match kind {
        // Coarse: multiples of 1/4 in [-4, 4): ties everywhere.
        1 => (0..vocab)
            .map(|_| (rng.below(32) as f32 - 16.0) / 4.0)
            .collect(),
        // Flat: every logit equal (top-p shares of exactly 1/vocab).
        2 => vec![0.75; vocab],
        _ => (0..vocab).map(|_| rng.uniform() * 12.0).collect(),
    };
    if kind == 3 && vocab > 3 {
        // -inf, +0/-0 ties and a tie for the top.
        row[1] = f32::NEG_INFINITY;
        row[2] = 0.0;
        row[3] = -0.0;
        let top = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) + 1.0;
        row[vocab / 2] = top;
        row[vocab - 1] = top;
    }
    if kind == 4 && vocab > 2 {
        // NaN entries: never greedy-picked; a NaN-first candidate list keeps its first entry.
        row[vocab / 3] = f32::NAN;
        row[vocab - 1] = f32::NAN;
    }
    row
}

/// The sampling parameters of row `i` of a batch over `vocab`: greedy, plain temperature, top-k
/// at its edges (1, vocab − 1, vocab, beyond), top-p at its edges (tiny, 0.5, 0.999999, 1) and
/// combinations, each with its own seed and position.
fn row_sampling(i: usize, vocab: usize) -> RowSampling {
    let temperatures = [0.0f32, 1.0, 0.7, 2.5, 0.05];
    let top_ks = [0usize, 1, 5, vocab.saturating_sub(1), vocab, vocab + 3, 40];
    let top_ps = [1.0f32, 0.9, 0.5, 1e-6, 0.999_999, 0.25];
    RowSampling {
        params: SamplingParams {
            temperature: temperatures[i % temperatures.len()],
            top_k: top_ks[(i / 2) % top_ks.len()],
            top_p: top_ps[(i / 3) % top_ps.len()],
            seed: 0x5eed_0000 + i as u64 * 7919,
        },
        position: (i as u64 * 104_729) % 100_003,
    }
}

#[test]
fn backend_sampling_picks_the_cpu_tokens() {
    let gpu = cuda_backend("backend_sampling_picks_the_cpu_tokens");
    let cpu = CpuBackend::new();
    let mut rng = Rng(31);
    let mut checked = 0;
    let mut sampled = 0;
    for (vocab, rows) in [
        (1usize, 5usize),
        (7, 40),
        (513, 90),
        (3001, 64),
        (129_280, 12),
    ] {
        let mut logits = Vec::with_capacity(rows * vocab);
        for r in 0..rows {
            logits.extend(logit_row(&mut rng, vocab, (r % 5) as u64));
        }
        let params: Vec<RowSampling> = (0..rows).map(|i| row_sampling(i, vocab)).collect();
        let started = std::time::Instant::now();
        let on_gpu = gpu
            .sample_rows(&logits, vocab, &params)
            .expect("shapes fit");
        let gpu_ms = started.elapsed().as_secs_f64() * 1e3;
        let on_cpu = cpu
            .sample_rows(&logits, vocab, &params)
            .expect("shapes fit");
        for (r, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
            assert_eq!(
                g, c,
                "vocab {vocab} row {r} ({:?}): gpu {g} cpu {c}",
                params[r]
            );
        }
        checked += rows;
        sampled += params.iter().filter(|p| p.params.temperature > 0.0).count();
        println!("sample_rows vocab {vocab}: {rows} rows equal, {gpu_ms:.2} ms on the device");
        // Negative control: other seeds pick other tokens somewhere (the comparison can fail).
        if vocab > 100 {
            let moved = moved_by_reseeding(&gpu, &logits, vocab, &params, &on_cpu);
            assert!(moved > 0, "vocab {vocab}: new seeds changed no token");
        }
    }
    // A top-p cut-off that lands exactly on a share boundary: 4 equal logits, top_p 0.5.
    let flat = vec![1.0f32; 4 * 64];
    let params: Vec<RowSampling> = (0..64)
        .map(|i| RowSampling {
            params: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.5,
                seed: i,
            },
            position: i,
        })
        .collect();
    let on_gpu = gpu.sample_rows(&flat, 4, &params).expect("shapes fit");
    assert_eq!(
        on_gpu,
        cpu.sample_rows(&flat, 4, &params).expect("shapes fit")
    );
    assert!(
        on_gpu.iter().all(|&t| t < 2),
        "top_p 0.5 keeps ids 0 and 1: {on_gpu:?}"
    );
    assert!(on_gpu.contains(&0) && on_gpu.contains(&1));
    // Bad shapes are errors, not panics.
    assert!(matches!(
        gpu.sample_rows(&flat[..10], 4, &params[..3]),
        Err(SampleRowsError::LogitsShape { found: 10, .. })
    ));
    assert!(matches!(
        gpu.sample_rows(&[], 0, &params[..1]),
        Err(SampleRowsError::EmptyVocab { rows: 1 })
    ));
    println!("backend sample_rows: {checked} rows ({sampled} with noise) equal to the CPU");
}

#[test]
fn backend_router_matches_the_cpu_bitwise() {
    let gpu = cuda_backend("backend_router_matches_the_cpu_bitwise");
    let cpu = CpuBackend::new();
    let mut rng = Rng(32);
    let mut routes = 0;
    for (n_experts, rows) in [(1usize, 3usize), (7, 5), (256, 33), (300, 4)] {
        // Logits across softplus's threshold (20) and far below; a few rows of exact ties.
        let mut logits: Vec<f32> = (0..rows * n_experts)
            .map(|_| rng.uniform() * 2f32.powi(rng.below(6) as i32))
            .collect();
        logits[..n_experts].fill(0.375);
        logits[n_experts - 1] = 25.0;
        let logits = Tensor::from(logits);
        let coarse_bias: Vec<f32> = (0..n_experts)
            .map(|_| (rng.below(4) as f32 - 2.0) / 8.0)
            .collect();
        let zero_bias = vec![0.0f32; n_experts];
        let forced: Vec<usize> = vec![n_experts - 1, 0, n_experts + 5, n_experts / 2];
        for bias in [&coarse_bias, &zero_bias] {
            for selection in [
                ExpertSelection::TopK(1),
                ExpertSelection::TopK(6),
                ExpertSelection::TopK(n_experts + 2),
                ExpertSelection::Forced(&forced),
            ] {
                for route_scale in [1.0f32, 2.5] {
                    let on_gpu = gpu.route_experts(
                        &logits,
                        Routing {
                            bias,
                            selection,
                            route_scale,
                        },
                    );
                    let on_cpu = cpu.route_experts(
                        &logits,
                        Routing {
                            bias,
                            selection,
                            route_scale,
                        },
                    );
                    assert_eq!(on_gpu.len(), rows);
                    assert_eq!(on_cpu.len(), rows);
                    for (r, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
                        let what = format!("{n_experts} experts row {r} {selection:?}");
                        assert_eq!(g.experts, c.experts, "{what}: experts");
                        assert_bitwise(&what, &g.weights, &c.weights);
                    }
                    routes += rows;
                }
            }
        }
        // Negative control: another bias moves the selection of some token.
        let shifted: Vec<f32> = (0..n_experts).map(|e| e as f32 * 0.01).collect();
        if n_experts > 6 {
            let base = gpu.route_experts(
                &logits,
                Routing {
                    bias: &zero_bias,
                    selection: ExpertSelection::TopK(6),
                    route_scale: 1.0,
                },
            );
            let moved = gpu.route_experts(
                &logits,
                Routing {
                    bias: &shifted,
                    selection: ExpertSelection::TopK(6),
                    route_scale: 1.0,
                },
            );
            assert_ne!(
                base, moved,
                "{n_experts} experts: a new bias changed nothing"
            );
        }
    }
    // An all-ties row picks the lowest ids.
    let tied = gpu.route_experts(
        &Tensor::from(vec![0.5; 8]),
        Routing {
            bias: &[0.0; 8],
            selection: ExpertSelection::TopK(3),
            route_scale: 1.0,
        },
    );
    assert_eq!(tied[0].experts, vec![0, 1, 2]);
    println!("backend route_experts: {routes} token routes bit-exact (experts and weights)");
}

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
fn backend_engram_hash_and_lookup_match_the_cpu() {
    let gpu = cuda_backend("backend_engram_hash_and_lookup_match_the_cpu");
    let cpu = CpuBackend::new();
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

    let (table_rows, head_dim) = (1021usize, 96usize);
    let codes: Vec<u8> = (0..table_rows * head_dim).map(|_| e4m3(&mut rng)).collect();
    let mut scales: Vec<u8> = (0..table_rows * head_dim / 32)
        .map(|_| e8m0(&mut rng))
        .collect();
    scales[0] = 0; // 2^-127: subnormal products
    scales[1] = 200;
    let table = EngramTable::new("test", table_rows, head_dim, codes, scales).expect("table");
    let cached_before = gpu.cached_weights();
    let mut values = 0;
    for n in [1usize, 7, 300] {
        let mut ids: Vec<u32> = (0..n)
            .map(|_| rng.below(table_rows as u64) as u32)
            .collect();
        ids[0] = 0;
        if n > 2 {
            ids[1] = table_rows as u32; // foreign rows: zeros
            ids[2] = u32::MAX;
        }
        values += assert_bitwise(
            &format!("engram_gather {n} ids"),
            &gpu.engram_gather(&table, &ids),
            &cpu.engram_gather(&table, &ids),
        );
    }
    assert_eq!(
        gpu.cached_weights(),
        cached_before + 1,
        "the table is uploaded once"
    );
    println!(
        "backend engram: {} row ids equal ({} tokens, chunked too), {values} gathered values bit-exact",
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

/// Token counts of the row-batched tests: one, a few, and more than a warp's worth.
const ROW_COUNTS: [usize; 3] = [1, 3, 17];

#[test]
fn backend_hc_row_ops_match_the_cpu_and_the_one_token_ops() {
    let gpu = cuda_backend("backend_hc_row_ops_match_the_cpu_and_the_one_token_ops");
    let cpu = CpuBackend::new();
    let mut rng = Rng(41);
    let mut checked = 0usize;
    for (hc, dim) in [(4usize, 100usize), (1, 7), (3, 257), (4, 1030)] {
        let width = hc * dim;
        let projections = (2 + hc) * hc;
        let params = HcParams {
            proj: (0..projections * width)
                .map(|_| 0.05 * rng.uniform())
                .collect(),
            base: (0..projections).map(|_| 0.5 * rng.uniform()).collect(),
            scale: vec![0.7, 0.3, 1.9],
        };
        // 40 tokens: two token tiles of the partials launch, the second partial.
        let counts: &[usize] = if dim == 1030 {
            &[1, 3, 17, 40]
        } else {
            &ROW_COUNTS
        };
        for &n in counts {
            // `activations` needs rows of at least one 32-group.
            let x = Tensor::from(if dim >= 32 {
                activations(&mut rng, n * hc, dim)
            } else {
                bf16_unit(&mut rng, n * width)
            });
            let iters = 1 + n % 20;
            let mixing = HcMixing {
                hc,
                sinkhorn_iters: iters,
                hc_eps: 1e-6,
                norm_eps: 1e-6,
            };
            let rows = gpu.hc_mixes_rows(&x, &params, &mixing);
            let reference = cpu.hc_mixes_rows(&x, &params, &mixing);
            assert_eq!(
                rows.tokens(),
                n,
                "hc_mixes_rows hc{hc} dim{dim} n{n}: tokens"
            );
            for (t, token) in x.chunks_exact(width).enumerate() {
                let (row, cpu_mix) = (rows.token(t), reference.token(t));
                let alone = mixes_of_one(&gpu, token, &params, &mixing);
                for (name, got, cpu_value, alone_value) in [
                    ("pre", &row.pre, &cpu_mix.pre, &alone.pre),
                    ("post", &row.post, &cpu_mix.post, &alone.post),
                    ("comb", &row.comb, &cpu_mix.comb, &alone.comb),
                ] {
                    let what = format!("hc_mixes_rows hc{hc} dim{dim} n{n} token {t} {name}");
                    checked += assert_bitwise(&format!("{what} vs cpu"), got, cpu_value);
                    assert_bitwise(&format!("{what} vs alone"), got, alone_value);
                }
            }
            let mixes: Vec<HcMix> = (0..n)
                .map(|_| HcMix {
                    pre: (0..hc).map(|_| rng.uniform()).collect(),
                    post: (0..hc).map(|_| 2.0 * rng.uniform()).collect(),
                    comb: (0..hc * hc).map(|_| rng.uniform()).collect(),
                })
                .collect();
            let weights = Tensor::from(
                mixes
                    .iter()
                    .flat_map(|m| m.pre.clone())
                    .collect::<Vec<f32>>(),
            );
            let step_mixes = HcMixes::from_host(hc, &mixes);
            for precision in PRECISIONS {
                let streams = Tensor::from(fp32_values(&mut rng, n * width));
                let y = Tensor::from(bf16_unit(&mut rng, n * dim));
                let what = format!("hc{hc} dim{dim} n{n} {precision:?}");
                let collapsed = gpu.hc_collapse_rows_at(
                    &streams,
                    HcCollapse {
                        weights: &weights,
                        hc,
                        precision,
                    },
                );
                checked += assert_bitwise(
                    &format!("hc_collapse_rows {what} vs cpu"),
                    &collapsed,
                    &cpu.hc_collapse_rows_at(
                        &streams,
                        HcCollapse {
                            weights: &weights,
                            hc,
                            precision,
                        },
                    ),
                );
                let expanded = gpu.hc_expand_rows_at(
                    &y,
                    HcExpand {
                        residual: &streams,
                        mixes: &step_mixes,
                        precision,
                    },
                );
                checked += assert_bitwise(
                    &format!("hc_expand_rows {what} vs cpu"),
                    &expanded,
                    &cpu.hc_expand_rows_at(
                        &y,
                        HcExpand {
                            residual: &streams,
                            mixes: &step_mixes,
                            precision,
                        },
                    ),
                );
                for (t, mix) in mixes.iter().enumerate() {
                    let token = &streams[t * width..(t + 1) * width];
                    assert_bitwise(
                        &format!("hc_collapse_rows {what} token {t} vs alone"),
                        &collapsed[t * dim..(t + 1) * dim],
                        &collapse_of_one(&gpu, token, &mix.pre, precision),
                    );
                    assert_bitwise(
                        &format!("hc_expand_rows {what} token {t} vs alone"),
                        &expanded[t * width..(t + 1) * width],
                        &expand_of_one(&gpu, &y[t * dim..(t + 1) * dim], token, mix, precision),
                    );
                }
            }
        }
    }
    println!("backend mHC row ops: {checked} values bit-exact vs the CPU and the one-token ops");
}

/// Per-query key counts for `n` queries: 0, short, exactly one 64-key block, ragged blocks.
fn key_counts(rng: &mut Rng, n: usize) -> Vec<usize> {
    const COUNTS: [usize; 7] = [0, 1, 5, 63, 64, 65, 131];
    (0..n)
        .map(|t| {
            if t < COUNTS.len() {
                COUNTS[(t + n) % COUNTS.len()]
            } else {
                rng.below(140) as usize
            }
        })
        .collect()
}

#[test]
fn backend_sparse_attention_rows_match_the_cpu_and_the_one_query_op() {
    let gpu = cuda_backend("backend_sparse_attention_rows_match_the_cpu_and_the_one_query_op");
    let cpu = CpuBackend::new();
    let mut rng = Rng(42);
    let mut checked = 0usize;
    for (heads, head_dim) in [(1usize, 64usize), (3, 96), (4, 512)] {
        // A pool of keys that several queries share (as a sliding window and the compressed
        // cache are shared by a sequence's tokens), plus keys of the query's own.
        let pool: Vec<Tensor> = (0..150)
            .map(|_| Tensor::from(bf16_unit(&mut rng, head_dim)))
            .collect();
        let sink: Vec<f32> = (0..heads).map(|_| 2.0 * rng.uniform()).collect();
        let scale = (head_dim as f32).powf(-0.5);
        for n in ROW_COUNTS {
            let counts = key_counts(&mut rng, n);
            let own: Vec<Vec<Tensor>> = counts
                .iter()
                .map(|&c| {
                    (0..c / 3)
                        .map(|_| Tensor::from(bf16_unit(&mut rng, head_dim)))
                        .collect()
                })
                .collect();
            let keys: Vec<Vec<&Tensor>> = counts
                .iter()
                .zip(&own)
                .map(|(&c, own)| {
                    let shared = c - own.len();
                    let offset = rng.below(pool.len() as u64 - shared as u64 + 1) as usize;
                    let mut list: Vec<&Tensor> = pool[offset..offset + shared].iter().collect();
                    // The query's own keys go in between the shared ones: order matters.
                    let at = list.len() / 2;
                    list.splice(at..at, own.iter());
                    list
                })
                .collect();
            let q = Tensor::from(bf16_unit(&mut rng, n * heads * head_dim));
            for precision in PRECISIONS {
                let what = format!("attention rows h{heads} d{head_dim} n{n} {precision:?}");
                let attention = AttentionQueries {
                    q: &q,
                    sink: &sink,
                    scale,
                    precision,
                };
                let rows = gpu.sparse_attention_rows_at(attention, &keys);
                checked += assert_bitwise(
                    &format!("{what} vs cpu"),
                    &rows,
                    &cpu.sparse_attention_rows_at(attention, &keys),
                );
                let width = heads * head_dim;
                for (t, query_keys) in keys.iter().enumerate() {
                    let query = &q[t * width..(t + 1) * width];
                    let query_keys: Vec<&[f32]> = query_keys.iter().map(|k| &k[..]).collect();
                    assert_bitwise(
                        &format!("{what} query {t} ({} keys) vs alone", query_keys.len()),
                        &rows[t * width..(t + 1) * width],
                        &attention_of_one(&gpu, query, &query_keys, &sink, scale, precision),
                    );
                }
            }
        }
    }
    println!("backend sparse_attention rows: {checked} values bit-exact (0..140 keys per query)");
}

#[test]
fn backend_index_scores_rows_match_the_cpu_and_the_one_query_op() {
    let gpu = cuda_backend("backend_index_scores_rows_match_the_cpu_and_the_one_query_op");
    let cpu = CpuBackend::new();
    let mut rng = Rng(43);
    let mut checked = 0usize;
    for (heads, head_dim) in [(1usize, 32usize), (5, 32), (64, 128)] {
        for n_keys in [0usize, 1, 37, 130] {
            let keys = bf16_unit(&mut rng, n_keys * head_dim);
            // One list for every row count and precision below: after the first launch its rows'
            // addresses are read from the device mirror the first one left.
            let key_list = KeyList::from(Tensor::from(&keys).split_rows(head_dim));
            for n in ROW_COUNTS {
                // 0 keys, all of them, beyond them (clamped), and everything in between.
                let visible: Vec<usize> = (0..n)
                    .map(|t| match t % 4 {
                        0 => 0,
                        1 => n_keys,
                        2 => n_keys + 3,
                        _ => rng.below(n_keys as u64 + 1) as usize,
                    })
                    .map(|v| if n == 1 { n_keys.min(7) } else { v })
                    .collect();
                let q = Tensor::from(bf16_unit(&mut rng, n * heads * head_dim));
                let w = Tensor::from(
                    (0..n * heads)
                        .map(|_| quant::round_bf16(rng.uniform()))
                        .collect::<Vec<f32>>(),
                );
                for precision in PRECISIONS {
                    let what =
                        format!("index rows h{heads} d{head_dim} keys{n_keys} n{n} {precision:?}");
                    let queries = IndexQueries {
                        q: &q,
                        weights: &w,
                        head_dim,
                        precision,
                    };
                    let part = SelectPart {
                        keys: &key_list,
                        visible: &visible,
                    };
                    let rows = gpu.index_scores_rows_at(queries, part);
                    let reference = cpu.index_scores_rows_at(queries, part);
                    assert_eq!(rows.len(), n, "{what}: queries");
                    for (t, (row, cpu_row)) in rows.iter().zip(&reference).enumerate() {
                        checked +=
                            assert_bitwise(&format!("{what} query {t} vs cpu"), row, cpu_row);
                        let seen = visible[t].min(n_keys) * head_dim;
                        assert_bitwise(
                            &format!("{what} query {t} vs alone"),
                            row,
                            &scores_of_one(
                                &gpu,
                                &q[t * heads * head_dim..(t + 1) * heads * head_dim],
                                &w[t * heads..(t + 1) * heads],
                                &keys[..seen],
                                head_dim,
                                precision,
                            ),
                        );
                    }
                }
            }
        }
    }
    println!("backend index_scores rows: {checked} values bit-exact");
}

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
    let err = gpu
        .try_sparse_attention_rows(
            AttentionQueries {
                q: &Tensor::from(vec![0.5; 16]),
                sink: &[0.0],
                scale: 1.0,
                precision: Precision::Bf16,
            },
            &[vec![&key], vec![&short_key]],
        )
        .expect_err("a 4-value key among 8-value heads");
    assert!(
        err.to_string()
            .contains("key 0 of query 1 has 4 values, head_dim is 8"),
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

/// The negative control of the sampling tests: how many of the device's `expected` ids move when
/// every row's seed changes (a comparison that can fail).
fn moved_by_reseeding(
    gpu: &CudaBackend,
    logits: &[f32],
    vocab: usize,
    params: &[RowSampling],
    expected: &[u32],
) -> usize {
    let reseeded: Vec<RowSampling> = params
        .iter()
        .map(|p| RowSampling {
            params: SamplingParams {
                seed: p.params.seed ^ 0xdead_beef,
                ..p.params
            },
            ..*p
        })
        .collect();
    let other = gpu
        .sample_rows(logits, vocab, &reseeded)
        .expect("shapes fit");
    other.iter().zip(expected).filter(|(a, b)| a != b).count()
}

/// A logit row shaped like a language model's at the real vocabulary: a bell-shaped bulk (sum of
/// four uniforms, spread `spread`) with a few strong candidates above it; `coarse` rounds every
/// logit to a multiple of 1/8, so the top-p cut-off falls inside runs of equal logits.
fn model_like_logits(rng: &mut Rng, vocab: usize, spread: f32, coarse: bool) -> Vec<f32> {
    (0..vocab)
        .map(|_| {
            let bulk = (rng.uniform() + rng.uniform() + rng.uniform() + rng.uniform()) * spread;
            let strong = if rng.below(4096) == 0 {
                6.0 + 6.0 * rng.uniform().abs()
            } else {
                0.0
            };
            let logit = bulk + strong;
            if coarse {
                (logit * 8.0).round() / 8.0
            } else {
                logit
            }
        })
        .collect()
}

#[test]
fn sampling_at_the_real_vocab_equals_the_cpu_for_64_mixed_rows() {
    let gpu = cuda_backend("sampling_at_the_real_vocab_equals_the_cpu_for_64_mixed_rows");
    let cpu = CpuBackend::new();
    let (vocab, rows) = (129_280usize, 64usize);
    let mut rng = Rng(4096);
    let mut logits = Vec::with_capacity(rows * vocab);
    for r in 0..rows {
        let spread = [1.5f32, 3.0, 5.0, 8.0][r % 4];
        logits.extend(model_like_logits(&mut rng, vocab, spread, r % 8 == 7));
    }
    // Every combination of temperature {0, 0.7, 1.3} × top-k {0, 50} × top-p {0.9, 0.95, 1.0}.
    let params: Vec<RowSampling> = (0..rows)
        .map(|i| RowSampling {
            params: SamplingParams {
                temperature: [0.0f32, 0.7, 1.3][i % 3],
                top_k: [0usize, 50][(i / 3) % 2],
                top_p: [0.9f32, 0.95, 1.0][(i / 6) % 3],
                seed: 0xfeed_0000 + i as u64 * 131,
            },
            position: 5000 + i as u64 * 17,
        })
        .collect();
    let on_cpu = cpu
        .sample_rows(&logits, vocab, &params)
        .expect("shapes fit");
    // The first call compiles nothing (the runtime is open) but warms the allocator.
    let on_gpu = gpu
        .sample_rows(&logits, vocab, &params)
        .expect("shapes fit");
    let started = std::time::Instant::now();
    let again = gpu
        .sample_rows(&logits, vocab, &params)
        .expect("shapes fit");
    let gpu_ms = started.elapsed().as_secs_f64() * 1e3;
    for (r, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
        assert_eq!(g, c, "row {r} ({:?}): gpu {g} cpu {c}", params[r]);
    }
    assert_eq!(again, on_gpu, "a second call picks the same tokens");
    // Batch invariance: rows sampled alone and in the reversed batch pick the same tokens.
    for r in [0usize, 7, 22, 41, 63] {
        let alone = gpu
            .sample_rows(&logits[r * vocab..(r + 1) * vocab], vocab, &params[r..=r])
            .expect("shapes fit");
        assert_eq!(alone, [on_cpu[r]], "row {r} alone");
    }
    let mut reversed_logits = Vec::with_capacity(rows * vocab);
    for r in (0..rows).rev() {
        reversed_logits.extend_from_slice(&logits[r * vocab..(r + 1) * vocab]);
    }
    let reversed_params: Vec<RowSampling> = params.iter().rev().copied().collect();
    let mut reversed = gpu
        .sample_rows(&reversed_logits, vocab, &reversed_params)
        .expect("shapes fit");
    reversed.reverse();
    assert_eq!(reversed, on_cpu, "the reversed batch");
    // Negative control: other seeds move some noisy row (the comparison can fail).
    let moved = moved_by_reseeding(&gpu, &logits, vocab, &params, &on_cpu);
    assert!(moved > 0, "new seeds changed no token");
    println!(
        "sample_rows vocab {vocab}: {rows} mixed rows equal to the CPU, alone and reversed too; \
         {gpu_ms:.2} ms per call (upload and scratch included); {moved} rows moved by new seeds"
    );
}

#[test]
fn backend_row_ops_split_calls_beyond_one_launch() {
    let gpu = cuda_backend("backend_row_ops_split_calls_beyond_one_launch");
    let cpu = CpuBackend::new();
    let mut rng = Rng(44);
    // More rows than one launch's grid.y takes (65 535): the backend splits the call.
    let n = 65_535 + 1_001;
    let (hc, dim) = (2usize, 3usize);
    let streams = Tensor::from(fp32_values(&mut rng, n * hc * dim));
    let weights = Tensor::from(fp32_values(&mut rng, n * hc));
    let y = Tensor::from(bf16_unit(&mut rng, n * dim));
    // The expansion reads no `pre`: zeros fill its place in each token's coefficients.
    let mixes: Vec<HcMix> = (0..n)
        .map(|_| HcMix {
            pre: vec![0.0; hc],
            post: fp32_values(&mut rng, hc),
            comb: fp32_values(&mut rng, hc * hc),
        })
        .collect();
    let mixes = HcMixes::from_host(hc, &mixes);
    let mut checked = assert_bitwise(
        &format!("hc_collapse_rows n{n}"),
        &gpu.hc_collapse_rows_at(
            &streams,
            HcCollapse {
                weights: &weights,
                hc,
                precision: Precision::Bf16,
            },
        ),
        &cpu.hc_collapse_rows_at(
            &streams,
            HcCollapse {
                weights: &weights,
                hc,
                precision: Precision::Bf16,
            },
        ),
    );
    checked += assert_bitwise(
        &format!("hc_expand_rows n{n}"),
        &gpu.hc_expand_rows_at(
            &y,
            HcExpand {
                residual: &streams,
                mixes: &mixes,
                precision: Precision::F32,
            },
        ),
        &cpu.hc_expand_rows_at(
            &y,
            HcExpand {
                residual: &streams,
                mixes: &mixes,
                precision: Precision::F32,
            },
        ),
    );
    let head_dim = 4;
    let pool: Vec<Tensor> = (0..9)
        .map(|_| Tensor::from(bf16_unit(&mut rng, head_dim)))
        .collect();
    let keys: Vec<Vec<&Tensor>> = (0..n)
        .map(|t| pool[t % 5..t % 5 + t % 4].iter().collect())
        .collect();
    let q = Tensor::from(bf16_unit(&mut rng, n * head_dim));
    let attention = AttentionQueries {
        q: &q,
        sink: &[0.5],
        scale: 0.5,
        precision: Precision::Bf16,
    };
    checked += assert_bitwise(
        &format!("sparse_attention_rows n{n}"),
        &gpu.sparse_attention_rows_at(attention, &keys),
        &cpu.sparse_attention_rows_at(attention, &keys),
    );
    let heads = 2;
    let index_keys =
        KeyList::from(Tensor::from(bf16_unit(&mut rng, 5 * head_dim)).split_rows(head_dim));
    let iq = Tensor::from(bf16_unit(&mut rng, n * heads * head_dim));
    let iw = Tensor::from(bf16_unit(&mut rng, n * heads));
    let visible: Vec<usize> = (0..n).map(|t| t % 7).collect();
    let queries = IndexQueries {
        q: &iq,
        weights: &iw,
        head_dim,
        precision: Precision::Bf16,
    };
    let part = SelectPart {
        keys: &index_keys,
        visible: &visible,
    };
    let got = gpu.index_scores_rows_at(queries, part);
    let want = cpu.index_scores_rows_at(queries, part);
    assert_eq!(got.len(), n, "index_scores_rows n{n}: queries");
    checked += assert_bitwise(
        &format!("index_scores_rows n{n}"),
        &got.concat(),
        &want.concat(),
    );
    assert_eq!(
        got.iter().map(Vec::len).collect::<Vec<_>>(),
        want.iter().map(Vec::len).collect::<Vec<_>>(),
        "index_scores_rows n{n}: per-query lengths"
    );
    println!("backend row ops over {n} rows (split launches): {checked} values bit-exact");
}

/// The head and the sampler in one op (`Backend::sample_linear`): on the device the logits are
/// computed into device memory and sampled there, and the ids equal the CPU's (its fp32 linear
/// then `sample_rows`) for greedy, seeded top-k / top-p and temperature rows; a wrong row count
/// is a shape error, not a panic.
#[test]
fn sample_linear_keeps_the_logits_on_the_device_and_equals_the_cpu() {
    let gpu = cuda_backend("sample_linear_keeps_the_logits_on_the_device_and_equals_the_cpu");
    let mut rng = Rng(0x5a11_ea7e);
    let (vocab, dim, rows) = (3001, 96, 13);
    let head: Vec<f32> = (0..vocab * dim).map(|_| rng.uniform() * 0.2).collect();
    let hidden = Tensor::from(
        (0..rows * dim)
            .map(|_| rng.uniform() * 2.0)
            .collect::<Vec<f32>>(),
    );
    let params: Vec<RowSampling> = (0..rows)
        .map(|r| RowSampling {
            params: SamplingParams {
                temperature: [0.0, 0.7, 1.3][r % 3],
                top_k: [0, 50, 7][r % 3],
                top_p: [1.0, 0.9, 0.95][r % 3],
                seed: 1000 + r as u64,
            },
            position: 17 + 3 * r as u64,
        })
        .collect();
    let head_weight = DenseWeight {
        values: &head,
        out: vocab,
        inp: dim,
    };
    let cpu = CpuBackend::new()
        .sample_linear(&hidden, head_weight, &params)
        .expect("cpu");
    let transfers = gpu.transfer_counters();
    let before = transfers.snapshot();
    let device = gpu
        .sample_linear(&hidden, head_weight, &params)
        .expect("device");
    assert_eq!(device, cpu, "sample_linear ids");
    // Only the ids came back: no op result, no logits.
    let copied = transfers.snapshot() - before;
    assert_eq!(
        (
            copied.to_host_copies,
            copied.to_host_bytes,
            copied.sampled_id_copies
        ),
        (0, 0, 1)
    );
    // The same ids as sampling the device's own logits through sample_rows.
    let before = transfers.snapshot();
    let logits = gpu
        .linear_f32(
            &hidden,
            DenseWeight {
                values: &head,
                out: vocab,
                inp: dim,
            },
        )
        .into_vec();
    let copied = transfers.snapshot() - before;
    assert_eq!(
        (copied.to_host_copies, copied.to_host_bytes),
        (1, (rows * vocab * 4) as u64),
        "reading linear_f32's logits on the host copies them once"
    );
    assert_eq!(gpu.sample_rows(&logits, vocab, &params).expect("rows"), cpu);
    assert!(matches!(
        gpu.try_sample_linear(&hidden.rows(0..2, dim), head_weight, &params),
        Err(CudaBackendError::Op { .. })
    ));
    println!("sample_linear: {rows} rows at vocab {vocab} equal to the CPU");
}

/// The allowed-token mask of row `r` of a masked batch over `vocab` (`None`: unmasked): one
/// token, a few, most of them (all but a few), and a mask over fewer tokens than the row (its
/// padding disallowed); every mask allows at least one token.
fn row_mask(rng: &mut Rng, r: usize, vocab: usize) -> Option<AllowedTokens> {
    let pick = |rng: &mut Rng, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
    };
    match r % 5 {
        0 => None,
        1 => Some(AllowedTokens::from_tokens(vocab, &pick(rng, 1))),
        2 => Some(AllowedTokens::from_tokens(vocab, &pick(rng, 5))),
        3 => {
            let banned = pick(rng, 7.min(vocab.saturating_sub(1)));
            let kept: Vec<u32> = (0..vocab as u32).filter(|t| !banned.contains(t)).collect();
            Some(AllowedTokens::from_tokens(vocab, &kept))
        }
        _ => {
            let narrower = (vocab - vocab / 3).max(1);
            let kept: Vec<u32> = (0..narrower as u32).filter(|t| t % 3 != 1).collect();
            Some(AllowedTokens::from_tokens(narrower, &kept))
        }
    }
}

/// Log-probabilities on the device (`Backend::token_logprobs_masked`: rows copied and masked
/// there, one block per row summing in the reference's lane order): bit for bit the CPU
/// reference's (`sampling::token_logprobs`) over vocabularies of 1, 7, 513 and 129 280, with
/// ties, -inf, NaN, masks of one, a few and most tokens, 0 to 20 alternatives, for the token the
/// CPU sampled from each row. Rows whose mask leaves only NaN logits (no distribution) are left
/// out. Negative control: unmasked, the masked rows' numbers differ.
#[test]
fn backend_token_logprobs_equal_the_cpu_bit_for_bit() {
    let gpu = cuda_backend("backend_token_logprobs_equal_the_cpu_bit_for_bit");
    let cpu = CpuBackend::new();
    let mut rng = Rng(0x10b5_0001);
    let bits = |lp: &TokenLogprobs| {
        let top: Vec<(u32, u32)> = lp.top.iter().map(|&(t, l)| (t, l.to_bits())).collect();
        (lp.token, lp.logprob.to_bits(), top)
    };
    for (vocab, rows) in [(1usize, 10usize), (7, 40), (513, 60), (129_280, 15)] {
        let mut logits = Vec::new();
        let mut masks = Vec::new();
        let mut picks = Vec::new();
        for r in 0..rows {
            let row = logit_row(&mut rng, vocab, (r % 5) as u64);
            let mask = row_mask(&mut rng, r, vocab);
            let params = row_sampling(r, vocab);
            let Ok(token) = sample_allowed(&row, &params.params, params.position, mask.as_ref())
            else {
                continue;
            };
            let top = r % (MAX_TOP_LOGPROBS + 1);
            if token_logprobs(&row, mask.as_ref(), token, top).is_err() {
                continue;
            }
            logits.extend(row);
            masks.push(mask);
            picks.push(LogprobPick { token, top });
        }
        let logits = Tensor::from(logits);
        let allowed: Vec<Option<&AllowedTokens>> = masks.iter().map(Option::as_ref).collect();
        let on_gpu = gpu
            .token_logprobs_masked(MaskedRows {
                logits: &logits,
                vocab,
                rows: &picks,
                allowed: &allowed,
            })
            .expect("masks fit");
        let on_cpu = cpu
            .token_logprobs_masked(MaskedRows {
                logits: &logits,
                vocab,
                rows: &picks,
                allowed: &allowed,
            })
            .expect("masks fit");
        assert_eq!(on_gpu.len(), picks.len());
        for (r, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
            assert_eq!(
                bits(g),
                bits(c),
                "vocab {vocab} row {r}: gpu {g:?} cpu {c:?}"
            );
        }
        if vocab > 100 {
            let unmasked = gpu
                .token_logprobs_masked(MaskedRows {
                    logits: &logits,
                    vocab,
                    rows: &picks,
                    allowed: &vec![None; picks.len()],
                })
                .expect("shapes fit");
            let moved = unmasked.iter().zip(&on_gpu).filter(|(a, b)| a != b).count();
            assert!(
                moved > 0,
                "vocab {vocab}: the masks changed no log-probability"
            );
        }
        println!(
            "token_logprobs vocab {vocab}: {} rows bitwise equal to the CPU",
            picks.len()
        );
    }
}

/// Grammar-masked sampling on the device (`Backend::sample_masked`: the masks go up as bitsets,
/// the mask kernel sets the disallowed logits to -inf, the sampling kernel picks): the same ids
/// as the CPU reference over vocabularies of 1, 7, 513 and 129 280 with masks of one, a few and
/// most tokens and narrower masks, for greedy, temperature, top-k and top-p rows; only the ids
/// come back. Negative control: the same rows unmasked pick other tokens. A mask that allows
/// nothing, or is wider than the row, is an error naming the row.
#[test]
fn backend_masked_sampling_picks_the_cpu_tokens() {
    let gpu = cuda_backend("backend_masked_sampling_picks_the_cpu_tokens");
    let cpu = CpuBackend::new();
    let mut rng = Rng(0x3a5c_0001);
    let transfers = gpu.transfer_counters();
    let mut checked = 0;
    for (vocab, rows) in [(1usize, 10usize), (7, 40), (513, 60), (129_280, 15)] {
        let mut logits = Vec::with_capacity(rows * vocab);
        for r in 0..rows {
            logits.extend(logit_row(&mut rng, vocab, (r % 5) as u64));
        }
        let logits = Tensor::from(logits);
        let params: Vec<RowSampling> = (0..rows).map(|i| row_sampling(i, vocab)).collect();
        let masks: Vec<Option<AllowedTokens>> =
            (0..rows).map(|r| row_mask(&mut rng, r, vocab)).collect();
        let allowed: Vec<Option<&AllowedTokens>> = masks.iter().map(Option::as_ref).collect();
        let before = transfers.snapshot();
        let on_gpu = gpu
            .sample_masked(MaskedRows {
                logits: &logits,
                vocab,
                rows: &params,
                allowed: &allowed,
            })
            .expect("masks fit");
        let copied = transfers.snapshot() - before;
        assert_eq!(
            (copied.to_host_copies, copied.sampled_id_copies),
            (0, 1),
            "vocab {vocab}: only the ids come back"
        );
        let on_cpu = cpu
            .sample_masked(MaskedRows {
                logits: &logits,
                vocab,
                rows: &params,
                allowed: &allowed,
            })
            .expect("masks fit");
        for (r, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
            assert_eq!(
                g, c,
                "vocab {vocab} row {r} ({:?}): gpu {g} cpu {c}",
                params[r]
            );
            if let Some(mask) = &masks[r] {
                assert!(mask.is_allowed(*g), "vocab {vocab} row {r}: {g} is masked");
            }
        }
        checked += rows;
        if vocab > 100 {
            let unmasked = gpu
                .sample_masked(MaskedRows {
                    logits: &logits,
                    vocab,
                    rows: &params,
                    allowed: &vec![None; rows],
                })
                .expect("shapes fit");
            let moved = unmasked.iter().zip(&on_gpu).filter(|(a, b)| a != b).count();
            assert!(moved > 0, "vocab {vocab}: the masks changed no token");
        }
        println!("sample_masked vocab {vocab}: {rows} rows equal to the CPU");
    }
    let logits = Tensor::from(vec![1.0f32; 14]);
    let params: Vec<RowSampling> = (0..2).map(|i| row_sampling(i, 7)).collect();
    let nothing = AllowedTokens::from_tokens(7, &[]);
    let wide = AllowedTokens::from_tokens(8, &[7]);
    assert!(matches!(
        gpu.sample_masked(MaskedRows {
            logits: &logits,
            vocab: 7,
            rows: &params,
            allowed: &[None, Some(&nothing)]
        }),
        Err(SampleRowsError::Mask {
            row: 1,
            source: MaskError::NothingAllowed { .. }
        })
    ));
    assert!(matches!(
        gpu.sample_masked(MaskedRows {
            logits: &logits,
            vocab: 7,
            rows: &params,
            allowed: &[Some(&wide), None]
        }),
        Err(SampleRowsError::Mask {
            row: 0,
            source: MaskError::RowTooShort { .. }
        })
    ));
    println!("backend sample_masked: {checked} masked rows equal to the CPU");
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
