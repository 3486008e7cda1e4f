//! The fast GEMMs' tile sweeps (`device_bench --sections fast --sweep`): the kernels of
//! `cuda/gemm/gemm_fast.cuh` built for other tiles (token rows, warps per block, pipeline stages,
//! K codes per stage; generated sources compiled at run time, one NVRTC program per thread) and
//! launched with other K parts. Each build's output is compared with the production launch's:
//! with the production's K parts it must have the same bits (the tile never changes a sum; the
//! sweep fails otherwise), with other parts it is another sum order and is only reported.
//!
//! - Dense FP8 (V4.1's 32×32 tiles): 8-row tiles at the decode shapes of the `fast` section
//!   (M = 1, 8) on weights rotated through more than twice the L2, weight bytes per second
//!   against the 4.28 TB/s copy rate; then the prefill tiles (64 and 128 token rows, M = 1024,
//!   the production's K parts) on the first shape, TFLOP/s against the FP8 peak.
//! - The routed FP4 experts ([`routed`]) of the `fast` section's real-width V4.1 layer (384
//!   experts, every weight distinct in device memory): w1/w3 (2304 × 5120) and w2 (5120 × 2304)
//!   at 6, 48, 384 and 6144 routed rows (1, 8, 64 tokens and a 1024-token prefill, top-6, random
//!   routes rotated over 8 sets), every tile of up to twice the mean rows per touched expert,
//!   weight bytes per second counting each touched expert's bytes once; w1/w3 at 6 and 48 rows
//!   also in 2 and 4 K parts (the production launches one).

use std::thread;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::compile::Compiler;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::cudarc::driver::sys::CUfunction_attribute;
use deepinfer_kernels::cudarc::nvrtc::Ptx;
use deepinfer_kernels::ops::gemm::{Fp8Bytes, Fp8Form};
use deepinfer_kernels::ops::gemm_fast::{
    FastFp8Weight, FastKernels, FastTile, FastVariant, TileShape, gemm_fp8_fast,
    gemm_fp8_fast_variant, k_parts,
};
use deepinfer_kernels::ops::quant::{ActGroup, DeviceActFp8, quantize_act_fp8};
use deepinfer_kernels::ops::routed::{
    DeviceExpertTable, ExpertGroups, ExpertProjection, RoutedRows,
};
use deepinfer_kernels::ops::routed_fast::{gemm_fp4_routed_fast, gemm_fp4_routed_fast_variant};
use half::bf16;

use crate::ops::{
    ROTATION_BYTES, ROUTE_SETS, ROUTED_DIM, ROUTED_INTER, ROUTED_TOP_K, Timer, activations,
    random_bytes, route_sets, scale_bytes, time_launches, time_launches_with,
};

/// The shapes swept (name, N, K): the `fast` section's V4.1 ones.
const SHAPES: [(&str, usize, usize); 3] = [
    ("d5120 n6144", 6144, 5120),
    ("wq_a", 1280, 5120),
    ("wq_b", 32768, 1280),
];
/// Warps per block: whole warpgroups (the sm_90a kernels' warpgroup MMAs).
const WARPS: [u32; 2] = [4, 8];
const STAGES: [u32; 3] = [3, 4, 6];
const STEPS: [u32; 3] = [256, 512, 1024];
/// K parts tried beside the production's.
const PARTS: [usize; 4] = [1, 2, 4, 8];
/// NVRTC programs compiled at once at most (each holds a few hundred MB of host memory while it
/// runs).
const COMPILE_THREADS: usize = 16;
/// The largest shared memory of a block on sm_90 / sm_100 (dynamic and static).
const MAX_SHARED: u32 = 227 * 1024;
/// The H200's copy rate (read + write), the section's bandwidth unit.
const HBM_BYTES_PER_S: f64 = 4.28e12;
/// Rows printed per table (fastest first), besides the production's and the fastest of each row
/// count.
const SHOWN: usize = 8;

/// The prefill sweep: token rows, warps, stages and codes per stage tried at [`PREFILL_M`].
const PREFILL_TOKENS: [u32; 2] = [64, 128];
const PREFILL_WARPS: [u32; 2] = [4, 8];
const PREFILL_STAGES: [u32; 3] = [2, 3, 4];
const PREFILL_STEPS: [u32; 2] = [128, 256];
const PREFILL_M: usize = 1024;
/// The FP8 tensor-core peak of the H200 (`torch._scaled_mm` 4096³, ../shared/tools/gpu.md).
const FP8_PEAK_FLOPS: f64 = 1216e12;

/// The routed sweep's projections (name, table slot, N, K of each) of the `fast` section's layer:
/// one of w1/w3, w1 and w3 in one launch (the production's), w2.
const ROUTED_SHAPES: [(&str, ExpertProjection, usize, usize); 3] = [
    ("w1/w3", ExpertProjection::W1, ROUTED_INTER, ROUTED_DIM),
    ("w1+w3", ExpertProjection::GateUp, ROUTED_INTER, ROUTED_DIM),
    ("w2", ExpertProjection::W2, ROUTED_DIM, ROUTED_INTER),
];
/// Tokens per launch (routed rows: six each): decode at B = 1, 8, 64 and a 1024-token prefill.
const ROUTED_TOKENS: [usize; 4] = [1, 8, 64, 1024];
/// The routed tiles tried: token rows (those worth timing at a launch's rows: [`tile_rows`]),
/// warps, stages and K codes per stage.
const ROUTED_TILE_ROWS: [u32; 5] = [8, 16, 32, 64, 128];
const ROUTED_WARPS: [u32; 2] = [4, 8];
const ROUTED_STAGES: [u32; 4] = [2, 3, 4, 6];
const ROUTED_STEPS: [u32; 3] = [128, 256, 512];
/// K parts tried for w1/w3 beside the production's one, at up to [`ROUTED_SPLIT_TOKENS`] tokens.
const ROUTED_SPLITS: [usize; 2] = [2, 4];
const ROUTED_SPLIT_TOKENS: usize = 8;
/// (launches per batch, batches) of each routed figure (full, `--quick`): decode launches take
/// 20–300 µs, a prefill launch about a millisecond.
const ROUTED_DECODE_ITERATIONS: [(usize, usize); 2] = [(16, 3), (8, 3)];
const ROUTED_PREFILL_ITERATIONS: [(usize, usize); 2] = [(4, 3), (2, 3)];

/// Every tile of `tokens` × `warps` × `stages` × `steps` whose shared memory fits a block.
fn shapes(
    kernels: FastKernels,
    tokens: &[u32],
    warps: &[u32],
    stages: &[u32],
    steps: &[u32],
) -> Vec<TileShape> {
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
                    if shared_bytes(kernels, shape) <= MAX_SHARED {
                        shapes.push(shape);
                    }
                }
            }
        }
    }
    shapes
}

/// A build's shared memory: the dynamic stages, and the routed kernels' static tile rows (two
/// u32 per token row: output and activation rows, `routed_tile`).
fn shared_bytes(kernels: FastKernels, shape: TileShape) -> u32 {
    let rows = match kernels {
        FastKernels::Fp4Routed => 8 * shape.tokens,
        FastKernels::Fp8(_) | FastKernels::Fp4 => 0,
    };
    kernels.shared_bytes(shape) + rows
}

fn label(shape: TileShape) -> String {
    format!(
        "b{} w{} s{} k{}",
        shape.tokens, shape.warps, shape.stages, shape.step
    )
}

fn kernel_name(shape: TileShape) -> String {
    format!("sweep_{}", label(shape).replace(' ', "_"))
}

/// Compiles every tile of `shapes` of `kernels` and loads them as variants (span filled in per
/// launch): the tiles split into one generated source per thread, compiled concurrently (NVRTC
/// programs are independent), each loaded as its own module.
fn build(
    rt: &KernelRuntime,
    kernels: FastKernels,
    shapes: &[TileShape],
) -> Result<Vec<FastVariant>> {
    let compiler = Compiler::new().context("finding NVRTC")?;
    let arch = rt.arch();
    let threads = thread::available_parallelism().map_or(1, |n| n.get().min(COMPILE_THREADS));
    let per_thread = shapes.len().div_ceil(threads).max(1);
    let cubins = thread::scope(|scope| {
        let jobs: Vec<_> = shapes
            .chunks(per_thread)
            .enumerate()
            .map(|(i, part)| {
                let compiler = &compiler;
                scope.spawn(move || {
                    let mut source = String::from("#include \"gemm/gemm_fast.cuh\"\n");
                    for &shape in part {
                        source.push_str(&kernels.instantiation(&kernel_name(shape), shape));
                        source.push('\n');
                    }
                    compiler.compile_text(&format!("fast_sweep_{i}.cu"), &source, arch)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|job| {
                job.join()
                    .map_err(|_| anyhow!("an NVRTC thread panicked"))?
                    .context("compiling the sweep's tiles")
            })
            .collect::<Result<Vec<_>>>()
    })?;
    let mut variants = Vec::with_capacity(shapes.len());
    for (cubin, part) in cubins.into_iter().zip(shapes.chunks(per_thread)) {
        let module = rt
            .context()
            .load_module(Ptx::from_binary(cubin))
            .context("loading the sweep's module")?;
        for &shape in part {
            let name = kernel_name(shape);
            let function = module
                .load_function(&name)
                .with_context(|| format!("loading {name}"))?;
            let shared = kernels.shared_bytes(shape);
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    i32::try_from(shared)?,
                )
                .with_context(|| format!("allowing {shared} bytes of shared memory to {name}"))?;
            variants.push(FastVariant {
                name,
                function,
                kernels,
                shape,
                span: 0,
            });
        }
    }
    Ok(variants)
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
    /// The build's token rows and warps per block ((0, 0): a production or direct row).
    block: (u32, u32),
    parts: usize,
    micros: f64,
    /// Its bits against the production's: `None` for another K split (another sum order).
    same_bits: Option<bool>,
    /// What a build of the sweep holds of an SM.
    fit: Option<Fit>,
    /// Always printed (the production).
    pinned: bool,
}

/// A build's registers per thread, local memory per thread (spills: a bug), shared memory per
/// block and the blocks an SM holds at once (the driver's occupancy).
struct Fit {
    registers: i32,
    local_bytes: i32,
    shared: u32,
    blocks_per_sm: u32,
}

impl Fit {
    fn of(variant: &FastVariant) -> Result<Fit> {
        let function = &variant.function;
        let dynamic = variant.kernels.shared_bytes(variant.shape);
        Ok(Fit {
            registers: function.num_regs()?,
            local_bytes: function.local_size_bytes()?,
            shared: shared_bytes(variant.kernels, variant.shape),
            blocks_per_sm: function.occupancy_max_active_blocks_per_multiprocessor(
                32 * variant.shape.warps,
                dynamic as usize,
                None,
            )?,
        })
    }
}

impl Measured {
    fn pinned(label: String, parts: usize, (micros, same_bits): (f64, Option<bool>)) -> Self {
        Measured {
            label,
            block: (0, 0),
            parts,
            micros,
            same_bits,
            fit: None,
            pinned: true,
        }
    }

    fn build(
        variant: &FastVariant,
        parts: usize,
        (micros, same_bits): (f64, Option<bool>),
    ) -> Result<Self> {
        Ok(Measured {
            label: label(variant.shape),
            block: (variant.shape.tokens, variant.shape.warps),
            parts,
            micros,
            same_bits,
            fit: Some(Fit::of(variant)?),
            pinned: false,
        })
    }
}

/// Runs `launch(0, y)`, checks the bits of `y` with `check`, then times `launch(i, y)` (i: the
/// launch index, for rotating inputs) over `iterations` (the timer's own with `None`).
fn measure(
    rt: &KernelRuntime,
    timer: &mut Timer,
    iterations: Option<(usize, usize)>,
    y: &mut CudaSlice<bf16>,
    check: impl Fn(&[u16]) -> Option<bool>,
    mut launch: impl FnMut(usize, &mut CudaSlice<bf16>) -> Result<()>,
) -> Result<(f64, Option<bool>)> {
    launch(0, y)?;
    let same_bits = check(&bits(rt, y)?);
    let micros = match iterations {
        Some(iterations) => time_launches_with(rt, timer, iterations, |i| launch(i, y))?,
        None => time_launches(rt, timer, |i| launch(i, y))?,
    };
    Ok((micros, same_bits))
}

/// The production launch (`gemm_fp8_fast`) of `a` over the rotated `weights`: its bits on the
/// first weight and its timed row (`parts`: the production's K parts).
fn production_row(
    rt: &KernelRuntime,
    timer: &mut Timer,
    a: &DeviceActFp8,
    weights: &[FastFp8Weight],
    y: &mut CudaSlice<bf16>,
    parts: usize,
) -> Result<(Vec<u16>, Measured)> {
    let launch = |w, y: &mut CudaSlice<bf16>| gemm_fp8_fast(rt, a, w, y, FastTile::Auto);
    launch(&weights[0], y)?;
    let production_bits = bits(rt, y)?;
    let measured = measure(
        rt,
        timer,
        None,
        y,
        |bits| Some(bits == production_bits),
        |i, y| Ok(launch(&weights[i % weights.len()], y)?),
    )?;
    let row = Measured::pinned("production".to_string(), parts, measured);
    Ok((production_bits, row))
}

/// A random FP8 weight `[n, k]` with 32 × 32 scale tiles, its codes from `seed`.
fn random_weight(rt: &KernelRuntime, n: usize, k: usize, seed: u64) -> Result<FastFp8Weight> {
    let w = Fp8Bytes {
        out: n,
        inp: k,
        tile: 32,
        codes: &random_bytes(seed, n * k, true),
        scales: &scale_bytes(n.div_ceil(32) * k.div_ceil(32)),
    };
    Ok(FastFp8Weight::upload(rt, w)?)
}

/// The row of `variant` (its K `span` set) on `a`, launched on `weights` in turn; its bits are
/// compared with the production's where it splits K as the production does (`production`: the
/// production's span and bits).
fn variant_row(
    rt: &KernelRuntime,
    timer: &mut Timer,
    a: &DeviceActFp8,
    weights: &[FastFp8Weight],
    y: &mut CudaSlice<bf16>,
    variant: &FastVariant,
    (production_span, production_bits): (usize, &[u16]),
) -> Result<Measured> {
    let span = variant.span;
    let measured = measure(
        rt,
        timer,
        None,
        y,
        |bits| (span == production_span).then(|| bits == production_bits),
        |i, y| {
            let weight = &weights[i % weights.len()];
            Ok(gemm_fp8_fast_variant(rt, a, weight, y, variant)?)
        },
    )?;
    Measured::build(variant, a.cols.div_ceil(span), measured)
}

/// Runs the dense FP8 sweep and prints a table per shape and M.
pub fn run(rt: &KernelRuntime, timer: &mut Timer, quick: bool) -> Result<()> {
    let kernels = FastKernels::Fp8(ActGroup::G32);
    let tiles = shapes(kernels, &[8], &WARPS, &STAGES, &STEPS);
    let mut variants = build(rt, kernels, &tiles)?;
    let ms: &[usize] = if quick { &[1] } else { &[1, 8] };
    println!(
        "\nfast FP8 GEMM tile sweep (8-row tiles; {} builds; bits: = the production's, ≠ differ, \
         · another K split)",
        variants.len()
    );
    for (name, n, k) in SHAPES {
        let copies = ROTATION_BYTES.div_ceil(n * k).max(2);
        let weights = (0..copies)
            .map(|c| random_weight(rt, n, k, c as u64))
            .collect::<Result<Vec<_>>>()?;
        for &m in ms {
            let x = activations(rt, m, k)?;
            let a = quantize_act_fp8(rt, &x, m, k, ActGroup::G32)?;
            let mut y = rt.stream().alloc_zeros::<bf16>(m * n)?;
            let production_span = k_parts(n, k).0;
            let (production_bits, production) =
                production_row(rt, timer, &a, &weights, &mut y, k.div_ceil(production_span))?;
            let mut rows = vec![production];
            for variant in &mut variants {
                for span in spans(n, k, variant.shape.step as usize) {
                    variant.span = span;
                    let production = (production_span, &production_bits[..]);
                    rows.push(variant_row(
                        rt, timer, &a, &weights, &mut y, variant, production,
                    )?);
                }
            }
            print_table(&format!("{name}, M = {m}"), (n * k) as f64, &mut rows);
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
    let kernels = FastKernels::Fp8(ActGroup::G32);
    let tiles = shapes(
        kernels,
        &PREFILL_TOKENS,
        &PREFILL_WARPS,
        &PREFILL_STAGES,
        &PREFILL_STEPS,
    );
    let mut variants = build(rt, kernels, &tiles)?;
    let (name, n, k) = SHAPES[0];
    let m = PREFILL_M;
    let weight = random_weight(rt, n, k, 0)?;
    let x = activations(rt, m, k)?;
    let a = quantize_act_fp8(rt, &x, m, k, ActGroup::G32)?;
    let mut y = rt.stream().alloc_zeros::<bf16>(m * n)?;
    let production_span = k_parts(n, k).0;
    let parts = k.div_ceil(production_span);
    let weights = std::slice::from_ref(&weight);
    let (production_bits, production) = production_row(rt, timer, &a, weights, &mut y, parts)?;
    let mut rows = vec![production];
    for variant in &mut variants {
        if !production_span.is_multiple_of(variant.shape.step as usize) {
            continue;
        }
        variant.span = production_span;
        let production = (production_span, &production_bits[..]);
        rows.push(variant_row(
            rt, timer, &a, weights, &mut y, variant, production,
        )?);
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

/// The routed tiles' token rows worth timing at `rows` routed rows over `touched` experts: 8,
/// and every tile of up to twice the mean rows per touched expert (a larger one is mostly
/// empty rows).
fn tile_rows(rows: usize, touched: f64) -> Vec<u32> {
    let mean = rows as f64 / touched.max(1.0);
    ROUTED_TILE_ROWS
        .into_iter()
        .filter(|&t| t == ROUTED_TILE_ROWS[0] || f64::from(t) <= 2.0 * mean)
        .collect()
}

/// The routed sweep on `table` (the `fast` section's layer: [`crate::fast_ops::fast_experts`]):
/// per projection and routed row count, the production launch (`FastTile::Auto`) and every
/// routed build of [`ROUTED_TILE_ROWS`] × [`ROUTED_WARPS`] ×
/// [`ROUTED_STAGES`] × [`ROUTED_STEPS`] that fits and is worth timing at those rows, each run
/// on the first route set and checked bitwise against the production's output, then timed over
/// the rotated route sets. Fails after printing every table if any build with one K part gave
/// other bits.
pub fn routed(
    rt: &KernelRuntime,
    timer: &mut Timer,
    quick: bool,
    table: &DeviceExpertTable,
) -> Result<()> {
    let started = Instant::now();
    let kernels = FastKernels::Fp4Routed;
    // The route sets first: the tiles worth building follow from their rows per expert.
    let cases = ROUTED_TOKENS
        .into_iter()
        .map(|tokens| {
            let (routes, touched) = route_sets(rt, tokens)?;
            Ok((tokens, routes, touched))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut wanted: Vec<u32> = cases
        .iter()
        .flat_map(|(tokens, _, touched)| tile_rows(tokens * ROUTED_TOP_K, *touched))
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    let tiles = shapes(
        kernels,
        &wanted,
        &ROUTED_WARPS,
        &ROUTED_STAGES,
        &ROUTED_STEPS,
    );
    let mut variants = build(rt, kernels, &tiles)?;
    println!(
        "\nfast routed FP4 expert tile sweep ({} builds of token rows {wanted:?}, compiled in \
         {:.1} s; bits: = the production's, ≠ differ, · another K split; TB/s: the touched \
         experts' weight bytes, each once, per second)",
        variants.len(),
        started.elapsed().as_secs_f64()
    );
    let quick = usize::from(quick);
    let mut failed = Vec::new();
    for (tokens, routes, touched) in &cases {
        let rows = tokens * ROUTED_TOP_K;
        let iterations = if *tokens > 64 {
            ROUTED_PREFILL_ITERATIONS[quick]
        } else {
            ROUTED_DECODE_ITERATIONS[quick]
        };
        let worth = tile_rows(rows, *touched);
        let (_, production_shape) = kernels.auto_tile(rows.div_ceil(table.n_experts()));
        for (name, which, n, k) in ROUTED_SHAPES {
            // w1/w3 read the tokens' rows (row j: token j / 6), w2 the slots' hidden rows.
            let (x_rows, x_row_div) = match which {
                ExpertProjection::W2 => (rows, 1),
                ExpertProjection::W1 | ExpertProjection::W3 | ExpertProjection::GateUp => {
                    (*tokens, ROUTED_TOP_K)
                }
            };
            let x = activations(rt, x_rows, k)?;
            let a = quantize_act_fp8(rt, &x, x_rows, k, ActGroup::G32)?;
            // Every timed launch groups its slots first (the production groups them once per MoE
            // call for its three GEMMs; here each launch counts one grouping).
            let production = |i: usize, y: &mut CudaSlice<bf16>| -> Result<()> {
                let groups = ExpertGroups::new(rt, &routes[i % ROUTE_SETS], table)?;
                let routed = RoutedRows {
                    x: &a,
                    groups: &groups,
                    x_row_div,
                    which,
                };
                Ok(gemm_fp4_routed_fast(rt, routed, table, y)?)
            };
            let mut y = rt.stream().alloc_zeros::<bf16>(which.planes() * rows * n)?;
            production(0, &mut y)?;
            let production_bits = bits(rt, &y)?;
            let mut measured = Vec::new();
            let production_label = format!("production {}", label(production_shape));
            let timed = measure(
                rt,
                timer,
                Some(iterations),
                &mut y,
                |bits| Some(bits == production_bits),
                production,
            )?;
            measured.push(Measured::pinned(production_label, 1, timed));
            for variant in variants
                .iter_mut()
                .filter(|v| worth.contains(&v.shape.tokens))
            {
                let step = variant.shape.step as usize;
                // One part: a span of K rounded up to the stage.
                let one_part = k.div_ceil(step) * step;
                let mut spans = vec![one_part];
                // K parts for one of w1/w3 (GateUp runs in one part).
                if which == ExpertProjection::W1 && *tokens <= ROUTED_SPLIT_TOKENS {
                    spans.extend(ROUTED_SPLITS.map(|p| k.div_ceil(p).div_ceil(step) * step));
                    spans.dedup();
                }
                for span in spans {
                    variant.span = span;
                    let variant = &*variant;
                    let timed = measure(
                        rt,
                        timer,
                        Some(iterations),
                        &mut y,
                        |bits| (span == one_part).then(|| bits == production_bits),
                        |i, y| {
                            let groups = ExpertGroups::fast_tile_rows(
                                rt,
                                &routes[i % ROUTE_SETS],
                                table,
                                variant.shape.tokens as usize,
                            )?;
                            Ok(gemm_fp4_routed_fast_variant(
                                rt,
                                RoutedRows {
                                    x: &a,
                                    groups: &groups,
                                    x_row_div,
                                    which,
                                },
                                table,
                                y,
                                variant,
                            )?)
                        },
                    )?;
                    measured.push(Measured::build(variant, k.div_ceil(span), timed)?);
                }
            }
            let heading = format!(
                "routed {name} (N {n}, K {k}), {rows} rows ({tokens} tokens x top-{ROUTED_TOP_K}; \
                 {touched:.0} experts touched, {:.1} rows each)",
                rows as f64 / touched
            );
            // Each touched expert's FP4 codes and UE8M0 scales of each projection, once.
            let weight_bytes = touched * (which.planes() * (n * k / 2 + n * k / 32)) as f64;
            print_table(&heading, weight_bytes, &mut measured);
            if measured.iter().any(|r| r.same_bits == Some(false)) {
                failed.push(heading);
            }
        }
    }
    println!(
        "\nrouted sweep: {:.1} s in all (compile, launches, bit checks)",
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        bail!(
            "a routed build with one K part changed the production's bits: {}",
            failed.join("; ")
        );
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

/// Prints `rows` (the production's first) fastest first: the [`SHOWN`] fastest, the pinned ones,
/// the fastest of each block shape (token rows and warps: so that one shape's best build shows
/// at every row count) and any with other bits, with `weight_bytes` per launch as a rate.
fn print_table(heading: &str, weight_bytes: f64, rows: &mut [Measured]) {
    let production = rows[0].micros;
    rows.sort_by(|a, b| a.micros.total_cmp(&b.micros));
    println!("\n{heading} (production {production:.1} µs)");
    println!("| tile | parts | µs | TB/s | %HBM | regs | smem KiB | blocks/SM | bits |");
    println!("|---|--:|--:|--:|--:|--:|--:|--:|:-:|");
    let mut blocks = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let first_of_its_block = r.block != (0, 0) && !blocks.contains(&r.block);
        if first_of_its_block {
            blocks.push(r.block);
        }
        if !(i < SHOWN || r.pinned || first_of_its_block || r.same_bits == Some(false)) {
            continue;
        }
        let rate = weight_bytes / (r.micros * 1e-6);
        let bits = match r.same_bits {
            Some(true) => "=",
            Some(false) => "≠",
            None => "·",
        };
        let fit = r.fit.as_ref().map_or("– | – | –".to_string(), |f| {
            let spills = if f.local_bytes > 0 {
                format!(" (+{} B local: spills)", f.local_bytes)
            } else {
                String::new()
            };
            format!(
                "{}{spills} | {:.1} | {}",
                f.registers,
                f64::from(f.shared) / 1024.0,
                f.blocks_per_sm
            )
        });
        println!(
            "| {} | {} | {:.1} | {:.2} | {:.0}% | {fit} | {bits} |",
            r.label,
            r.parts,
            r.micros,
            rate / 1e12,
            100.0 * rate / HBM_BYTES_PER_S
        );
    }
}
