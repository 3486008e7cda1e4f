//! The fast FP8 GEMM's tile sweep (`device_bench --sections fast --sweep`): the dense kernel of
//! `cuda/gemm/gemm_fast.cuh` built for other tiles (warps per block, pipeline stages, K codes
//! per stage; 8 token rows) and launched with other K parts, at the decode shapes of the `fast`
//! section (M = 1, 8; V4.1's 32×32 tiles) on weights rotated through more than twice the L2:
//! weight bytes per second against the 4.28 TB/s copy rate. Each variant's output is compared
//! with the production launch's: with the production's K parts it must have the same bits (the
//! tile never changes a sum), with other parts it is another sum order and is only reported.
//! Then the prefill tiles (64 and 128 token rows, M = 1024, the production's K parts) on the first
//! shape: TFLOP/s against the FP8 peak, bits checked the same way.

use anyhow::{Context, Result, bail};
use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::compile::Compiler;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::cudarc::driver::sys::CUfunction_attribute;
use deepinfer_kernels::cudarc::nvrtc::Ptx;
use deepinfer_kernels::ops::gemm_fast::{
    FastFp8Variant, FastFp8Weight, FastTile, TileShape, fp8_shared_bytes, gemm_fp8_fast,
    gemm_fp8_fast_tiled, gemm_fp8_fast_variant, k_parts,
};
use deepinfer_kernels::ops::quant::{ActGroup, DeviceActFp8, quantize_act_fp8};
use half::bf16;

use crate::ops::{ROTATION_BYTES, Timer, activations, random_bytes, scale_bytes, time_launches};

/// The shapes swept (name, N, K): the `fast` section's V4.1 ones.
const SHAPES: [(&str, usize, usize); 3] = [
    ("d5120 n6144", 6144, 5120),
    ("wq_a", 1280, 5120),
    ("wq_b", 32768, 1280),
];
const WARPS: [u32; 4] = [1, 2, 4, 8];
const STAGES: [u32; 3] = [3, 4, 6];
const STEPS: [u32; 3] = [256, 512, 1024];
/// K parts tried beside the production's.
const PARTS: [usize; 4] = [1, 2, 4, 8];
/// The largest dynamic shared memory of a block on sm_90 / sm_100.
const MAX_SHARED: u32 = 227 * 1024;
/// The H200's copy rate (read + write), the section's bandwidth unit.
const HBM_BYTES_PER_S: f64 = 4.28e12;
/// Rows printed per shape and M (fastest first), besides the production's.
const SHOWN: usize = 8;

/// The prefill sweep: token rows, warps, stages and codes per stage tried at [`PREFILL_M`].
const PREFILL_TOKENS: [u32; 2] = [64, 128];
const PREFILL_WARPS: [u32; 2] = [4, 8];
const PREFILL_STAGES: [u32; 2] = [2, 3];
const PREFILL_STEPS: [u32; 2] = [128, 256];
const PREFILL_M: usize = 1024;
/// The FP8 tensor-core peak of the H200 (`torch._scaled_mm` 4096³, ../shared/tools/gpu.md).
const FP8_PEAK_FLOPS: f64 = 1216e12;

/// Every tile of `tokens` × `warps` × `stages` × `steps` that fits the shared memory.
fn shapes(tokens: &[u32], warps: &[u32], stages: &[u32], steps: &[u32]) -> Vec<TileShape> {
    let mut shapes = Vec::new();
    for &tokens in tokens {
        for &warps in warps {
            for &stages in stages {
                for &step in steps {
                    let shape = TileShape {
                        tokens,
                        warps,
                        stages,
                        step,
                    };
                    if fp8_shared_bytes(ActGroup::G32, shape) <= MAX_SHARED {
                        shapes.push(shape);
                    }
                }
            }
        }
    }
    shapes
}

fn kernel_name(shape: TileShape) -> String {
    format!(
        "sweep_b{}_w{}_s{}_k{}",
        shape.tokens, shape.warps, shape.stages, shape.step
    )
}

/// Compiles every tile of `shapes` in one generated source and loads them as variants (span
/// filled in per launch).
fn build(rt: &KernelRuntime, shapes: &[TileShape]) -> Result<Vec<(TileShape, FastFp8Variant)>> {
    let mut source = String::from("#include \"gemm/gemm_fast.cuh\"\n");
    for &shape in shapes {
        source.push_str(&format!(
            "GEMM_FAST({}, fastgemm::Fp8Chunks<32>, 32, {}, {}, {}, {})\n",
            kernel_name(shape),
            shape.warps,
            shape.tokens,
            shape.stages,
            shape.step
        ));
    }
    let compiler = Compiler::new().context("finding NVRTC")?;
    let cubin = compiler
        .compile_text("fast_sweep.cu", &source, rt.arch())
        .context("compiling the sweep's tiles")?;
    let module = rt
        .context()
        .load_module(Ptx::from_binary(cubin))
        .context("loading the sweep's module")?;
    shapes
        .iter()
        .map(|&shape| {
            let name = kernel_name(shape);
            let function = module
                .load_function(&name)
                .with_context(|| format!("loading {name}"))?;
            let shared = fp8_shared_bytes(ActGroup::G32, shape);
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    i32::try_from(shared)?,
                )
                .with_context(|| format!("allowing {shared} bytes of shared memory to {name}"))?;
            Ok((
                shape,
                FastFp8Variant {
                    name,
                    function,
                    group: ActGroup::G32,
                    shape,
                    span: 0,
                },
            ))
        })
        .collect()
}

/// The K spans tried for a weight `[n, k]` with stages of `step` codes: the production's (when
/// a multiple of the step) and those of [`PARTS`] parts, each once.
fn spans(n: usize, k: usize, step: usize) -> Vec<usize> {
    let mut spans = vec![k_parts(n, k).0];
    spans.extend(PARTS.iter().map(|&p| k.div_ceil(p).div_ceil(step) * step));
    spans.retain(|s| s.is_multiple_of(step));
    let mut seen = Vec::new();
    spans.retain(|s| {
        let new = !seen.contains(s);
        seen.push(*s);
        new
    });
    spans
}

/// One timed launch configuration.
struct Measured {
    label: String,
    parts: usize,
    micros: f64,
    same_bits: Option<bool>,
}

/// Runs the sweep and prints a table per shape and M.
pub fn run(rt: &KernelRuntime, timer: &mut Timer, quick: bool) -> Result<()> {
    let tiles = shapes(&[8], &WARPS, &STAGES, &STEPS);
    let mut variants = build(rt, &tiles)?;
    let ms: &[usize] = if quick { &[1] } else { &[1, 8] };
    println!(
        "\nfast FP8 GEMM tile sweep (8-row tiles; {} builds; bits: = the production's, ≠ differ, \
         · another K split)",
        variants.len()
    );
    for (name, n, k) in SHAPES {
        let copies = ROTATION_BYTES.div_ceil(n * k).max(2);
        let weights = (0..copies)
            .map(|c| {
                FastFp8Weight::upload(
                    rt,
                    n,
                    k,
                    32,
                    &random_bytes(c as u64, n * k, true),
                    &scale_bytes(n.div_ceil(32) * k.div_ceil(32)),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        for &m in ms {
            let x = activations(rt, m, k)?;
            let a = quantize_act_fp8(rt, &x, m, k, ActGroup::G32)?;
            let mut y = rt.stream().alloc_zeros::<bf16>(m * n)?;
            gemm_fp8_fast(rt, &a, &weights[0], &mut y)?;
            let production_bits = bits(rt, &y)?;
            let production_span = k_parts(n, k).0;
            let mut rows = vec![Measured {
                label: "production".to_string(),
                parts: k.div_ceil(production_span),
                micros: time_launches(rt, timer, |i| {
                    Ok(gemm_fp8_fast(rt, &a, &weights[i % copies], &mut y)?)
                })?,
                same_bits: Some(true),
            }];
            // The direct decode tile (same K parts: the same bits).
            gemm_fp8_fast_tiled(rt, &a, &weights[0], &mut y, FastTile::Direct8)?;
            let direct_bits = bits(rt, &y)?;
            rows.push(Measured {
                label: "direct d8".to_string(),
                parts: k.div_ceil(production_span),
                micros: time_launches(rt, timer, |i| {
                    Ok(gemm_fp8_fast_tiled(
                        rt,
                        &a,
                        &weights[i % copies],
                        &mut y,
                        FastTile::Direct8,
                    )?)
                })?,
                same_bits: Some(direct_bits == production_bits),
            });
            for (shape, variant) in &mut variants {
                for span in spans(n, k, shape.step as usize) {
                    variant.span = span;
                    rows.push(measure(
                        rt,
                        timer,
                        (&a, &weights, &mut y),
                        variant,
                        |bits| (span == production_span).then(|| *bits == production_bits),
                    )?);
                }
            }
            print_table(name, m, n * k, &mut rows);
            if rows.iter().any(|r| r.same_bits == Some(false)) {
                bail!("{name} M = {m}: a tile changed the bits of the production's K split");
            }
        }
    }
    prefill(rt, timer)
}

/// The prefill tiles at M = [`PREFILL_M`] on the first shape, with the production's K parts:
/// each build's time, TFLOP/s and bits beside the production launch's.
fn prefill(rt: &KernelRuntime, timer: &mut Timer) -> Result<()> {
    let tiles = shapes(
        &PREFILL_TOKENS,
        &PREFILL_WARPS,
        &PREFILL_STAGES,
        &PREFILL_STEPS,
    );
    let mut variants = build(rt, &tiles)?;
    let (name, n, k) = SHAPES[0];
    let m = PREFILL_M;
    let weight = FastFp8Weight::upload(
        rt,
        n,
        k,
        32,
        &random_bytes(0, n * k, true),
        &scale_bytes(n.div_ceil(32) * k.div_ceil(32)),
    )?;
    let weights = std::slice::from_ref(&weight);
    let x = activations(rt, m, k)?;
    let a = quantize_act_fp8(rt, &x, m, k, ActGroup::G32)?;
    let mut y = rt.stream().alloc_zeros::<bf16>(m * n)?;
    gemm_fp8_fast(rt, &a, &weight, &mut y)?;
    let production_bits = bits(rt, &y)?;
    let production_span = k_parts(n, k).0;
    let mut rows = vec![Measured {
        label: "production".to_string(),
        parts: k.div_ceil(production_span),
        micros: time_launches(rt, timer, |_| Ok(gemm_fp8_fast(rt, &a, &weight, &mut y)?))?,
        same_bits: Some(true),
    }];
    for (shape, variant) in &mut variants {
        if !production_span.is_multiple_of(shape.step as usize) {
            continue;
        }
        variant.span = production_span;
        let mut row = measure(rt, timer, (&a, weights, &mut y), variant, |bits| {
            Some(*bits == production_bits)
        })?;
        row.label = format!("b{} {}", shape.tokens, row.label);
        rows.push(row);
    }
    let flops = 2.0 * (m * n * k) as f64;
    let production = rows[0].micros;
    rows.sort_by(|a, b| a.micros.total_cmp(&b.micros));
    println!(
        "\nfast FP8 GEMM prefill tiles: {name}, M = {m} ({} builds; production {production:.1} µs)",
        variants.len()
    );
    println!("| tile | parts | µs | TFLOP/s | % of FP8 peak | bits |");
    println!("|---|--:|--:|--:|--:|:-:|");
    for r in rows.iter().take(2 * SHOWN) {
        let rate = flops / (r.micros * 1e-6);
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.1}% | {} |",
            r.label,
            r.parts,
            r.micros,
            rate / 1e12,
            100.0 * rate / FP8_PEAK_FLOPS,
            if r.same_bits == Some(true) {
                "="
            } else {
                "≠"
            }
        );
    }
    if rows.iter().any(|r| r.same_bits == Some(false)) {
        bail!("{name} M = {m}: a prefill tile changed the bits of the production's K split");
    }
    Ok(())
}

fn bits(rt: &KernelRuntime, y: &CudaSlice<bf16>) -> Result<Vec<u16>> {
    rt.synchronize()?;
    Ok(rt
        .stream()
        .clone_dtoh(y)?
        .iter()
        .map(|v| v.to_bits())
        .collect())
}

fn measure(
    rt: &KernelRuntime,
    timer: &mut Timer,
    (a, weights, y): (&DeviceActFp8, &[FastFp8Weight], &mut CudaSlice<bf16>),
    variant: &FastFp8Variant,
    check: impl Fn(&Vec<u16>) -> Option<bool>,
) -> Result<Measured> {
    gemm_fp8_fast_variant(rt, a, &weights[0], y, variant)?;
    let same_bits = check(&bits(rt, y)?);
    let micros = time_launches(rt, timer, |i| {
        Ok(gemm_fp8_fast_variant(
            rt,
            a,
            &weights[i % weights.len()],
            y,
            variant,
        )?)
    })?;
    let TileShape {
        warps,
        stages,
        step,
        ..
    } = variant.shape;
    Ok(Measured {
        label: format!("w{warps} s{stages} k{step}"),
        parts: weights[0].inp.div_ceil(variant.span),
        micros,
        same_bits,
    })
}

fn print_table(name: &str, m: usize, weight_bytes: usize, rows: &mut [Measured]) {
    let production = rows[0].micros;
    rows.sort_by(|a, b| a.micros.total_cmp(&b.micros));
    println!("\n{name}, M = {m} (production {production:.1} µs)");
    println!("| tile | parts | µs | TB/s | %HBM | bits |");
    println!("|---|--:|--:|--:|--:|:-:|");
    let shown = rows
        .iter()
        .enumerate()
        .filter(|(i, r)| *i < SHOWN || r.label == "production" || r.label == "direct d8");
    for (_, r) in shown {
        let rate = weight_bytes as f64 / (r.micros * 1e-6);
        let bits = match r.same_bits {
            Some(true) => "=",
            Some(false) => "≠",
            None => "·",
        };
        println!(
            "| {} | {} | {:.1} | {:.2} | {:.0}% | {bits} |",
            r.label,
            r.parts,
            r.micros,
            rate / 1e12,
            100.0 * rate / HBM_BYTES_PER_S
        );
    }
}
