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
//! - RMSNorm: ≤ 1 bf16 ulp (both sum the squares in f64, the GPU in a fixed tree, the CPU in
//!   sequence; the f64 sums differ only when the squares span very many binades).
//! - Batch invariance: a GEMM row computed with M = 1 is bitwise equal to that row inside M = 7 and
//!   M = 64.
//!
//! Built only with `--features cuda`. Without a CUDA driver every test prints why it skips and
//! passes, so `cargo test` on a CPU-only machine is green; on the H200 they run unconditionally.
#![cfg(feature = "cuda")]

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::compile::Compiler;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::ops::gemm::{
    DeviceFp4Weight, DeviceFp8Weight, GemmSplit, gemm_fp4, gemm_fp4_split, gemm_fp8, gemm_fp8_split,
};
use deepinfer_kernels::ops::norm::rms_norm_bf16;
use deepinfer_kernels::ops::quant::{ActGroup, quantize_act_fp8};
use deepinfer_kernels::ops::rope::{RopeShape, rope_cos_sin_tables, rope_interleaved_bf16};
use deepinfer_kernels::runtime::driver_available;
use deepinfer_kernels::{Arch, KernelId, SourceFile};
use deepinfer_model::backend::{Backend, CpuBackend, RopeTable};
use deepinfer_model::quant;
use deepinfer_model::weights::{Fp4Weight, Fp8Weight};
use half::bf16;

/// Opens the device, or says why the test is skipped (no driver) and returns `None`.
fn runtime(test: &str) -> Option<KernelRuntime> {
    if let Err(err) = driver_available() {
        eprintln!("{test}: skipped: {err}");
        return None;
    }
    match KernelRuntime::open(0) {
        Ok(rt) => Some(rt),
        Err(err) => {
            panic!("{test}: a CUDA driver is present but the kernel runtime did not open: {err}")
        }
    }
}

/// SplitMix64: a small deterministic generator for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// A bf16 activation with a wide dynamic range (magnitudes 2^-12 .. 2^6, some exact zeros).
    fn activation(&mut self) -> f32 {
        if self.below(50) == 0 {
            return 0.0;
        }
        let exponent = self.below(19) as i32 - 12;
        quant::round_bf16(self.uniform() * 2f32.powi(exponent))
    }
    /// A finite E4M3 byte (never 0x7f / 0xff, the NaN codes).
    fn e4m3(&mut self) -> u8 {
        loop {
            let b = self.below(256) as u8;
            if b & 0x7f != 0x7f {
                return b;
            }
        }
    }
    /// A UE8M0 scale byte around 2^0 (2^-12 .. 2^4).
    fn e8m0(&mut self) -> u8 {
        (115 + self.below(17)) as u8
    }
}

/// `rows × cols` bf16 activations; one row in four has a group of tiny values (amax floor) and
/// one group per row is all zeros when there is room.
fn activations(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..rows * cols).map(|_| rng.activation()).collect();
    for r in 0..rows {
        let row = &mut x[r * cols..(r + 1) * cols];
        if r % 4 == 1 {
            for v in row[..32].iter_mut() {
                *v = quant::round_bf16(*v * 1e-5);
            }
        }
        if cols >= 64 && r % 3 == 0 {
            row[32..64].fill(0.0);
        }
    }
    x
}

fn random_fp8_weight(rng: &mut Rng, out: usize, inp: usize, block: usize) -> Fp8Weight {
    let scales = out.div_ceil(block) * inp.div_ceil(block);
    Fp8Weight {
        out,
        inp,
        block,
        data: (0..out * inp).map(|_| rng.e4m3()).collect(),
        scales: (0..scales).map(|_| rng.e8m0()).collect(),
    }
}

fn random_fp4_weight(rng: &mut Rng, out: usize, inp: usize) -> Fp4Weight {
    Fp4Weight {
        out,
        inp,
        packed: (0..out * inp / 2).map(|_| rng.below(256) as u8).collect(),
        scales: (0..out * inp / 32).map(|_| rng.e8m0()).collect(),
    }
}

fn upload_bf16(rt: &KernelRuntime, values: &[f32]) -> CudaSlice<bf16> {
    let host: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    rt.stream().clone_htod(&host).expect("upload")
}

fn download_bf16(rt: &KernelRuntime, values: &CudaSlice<bf16>) -> Vec<f32> {
    rt.stream()
        .clone_dtoh(values)
        .expect("download")
        .iter()
        .map(|v| v.to_f32())
        .collect()
}

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
    let Some(rt) = runtime("every_kernel_compiles_and_loads") else {
        return;
    };
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
    let Some(rt) = runtime("act_quant_is_bit_exact") else {
        return;
    };
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
    let Some(rt) = runtime("gemm_fp8_matches_the_cpu_reference") else {
        return;
    };
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
    let Some(rt) = runtime("gemm_fp4_matches_the_cpu_reference") else {
        return;
    };
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
    let Some(rt) = runtime("gemms_are_batch_invariant") else {
        return;
    };
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
    let Some(rt) = runtime("gemm_results_do_not_depend_on_the_work_split") else {
        return;
    };
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
        .chain([GemmSplit::Auto])
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
    let Some(rt) = runtime("rms_norm_matches_the_cpu_reference") else {
        return;
    };
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
                let want = cpu.rms_norm(&x, &weight, eps);
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
    let Some(rt) = runtime("rope_matches_the_cpu_reference_bit_exact") else {
        return;
    };
    let mut rng = Rng(6);
    let cpu = CpuBackend::new();
    let (rope_dim, head_dim) = (64usize, 192usize);
    let table = RopeTable {
        freqs: (0..rope_dim / 2)
            .map(|i| 1.0f32 / 10000f32.powf((2 * i) as f32 / rope_dim as f32))
            .collect(),
    };
    let table_rows = 70_000usize;
    let (cos, sin) = rope_cos_sin_tables(&table.freqs, table_rows);
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
            let mut want = x.clone();
            cpu.rope(&mut want, head_dim, heads, &positions, &table, inverse);
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
    let Some(rt) = runtime("launchers_reject_mismatched_shapes") else {
        return;
    };
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
