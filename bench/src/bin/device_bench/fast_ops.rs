//! The `fast` section of the device benchmark: the tensor-core FP8 GEMM of the `fast` numerics
//! (`deepinfer_kernels::ops::gemm_fast`) at decode shapes (M = 1, 8, 64: weight bytes per second
//! against the 4.28 TB/s copy rate) and prefill shapes (M = 1024, 4096: TFLOP/s against the
//! 1216 TFLOP/s FP8 peak) — V4.1's 32×32 tiles with 1×32 activation groups and bf16 outputs, and
//! V4's 128×128 tiles with 1×128 groups and f32 outputs (`CudaBackend::linear` in fast
//! numerics) — each beside peers timed in the same run on the same shape: cuBLAS
//! bf16 GEMM (`y = x · Wᵀ`, bf16 weights: twice the weight bytes of FP8), cuBLASLt's
//! per-tensor-scaled FP8 GEMM (`cublaslt_fp8`), and the exact CUDA-core FP8 kernel of the `exact`
//! numerics. Weights are rotated through > 2 × L2 as in `ops`.
//!
//! Then the routed experts of a real-width V4.1 MoE layer (384 FP4 experts, dim 5120, inter
//! 2304, top-6; every expert's three weights distinct in device memory): the chain of
//! `CudaBackend::moe_rows` after routing — routed w1 and w3, SwiGLU with the route weights,
//! activation quantisation, routed w2 — in both numerics at 1, 8, 64 tokens (decode) and 1024
//! (prefill): the fast tensor-core kernels (`ops::routed_fast`) beside the exact CUDA-core ones
//! (`ops::routed`), on the same routes in the same run. With `--sweep`, `fast_sweep`'s
//! tile sweeps run before the chain: the dense FP8 one, then the routed one on this layer's
//! fast table.
//!
//! Then the bf16 linear of the grouped `wo_a` (8 groups of 1024 × 4096 in one launch, the op
//! `linear_grouped_bf16` of the block profile) at 1, 8, 64 and 1024 rows: the fast tensor-core
//! linear (`ops::linear_fast`) beside cuBLAS bf16 on the same 8 groups (one strided-batched
//! GEMM) and the exact sgemm-order kernel (`ops::linear`, a launch per group). Then the fp32
//! linears of the block (`linear_f32`: the MoE router gate 5120 → 384 and the ratio-2
//! compressor's `wkv` 5120 → 512, `wgate` alike) at the same rows: the split-x bf16x3 linear of
//! the `fast` numerics beside the exact sgemm-order kernel.

use anyhow::{Context, Result};
use deepinfer_kernels::cudarc::cublas::sys::cublasOperation_t;
use deepinfer_kernels::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use deepinfer_kernels::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::gemm::{
    DeviceFp4Weight, DeviceFp8Weight, Fp4Bytes, Fp4Form, Fp8Bytes, Fp8Form, GemmSplit, gemm_fp8,
};
use deepinfer_kernels::ops::gemm_fast::{
    FastFp4Weight, FastFp8Weight, FastOutput, FastTile, gemm_fp8_fast,
};
use deepinfer_kernels::ops::linear_fast::{FastBf16Weight, FastProduct, linear_bf16_fast};
use deepinfer_kernels::ops::quant::{ActGroup, DeviceActFp8, quantize_act_fp8};
use deepinfer_kernels::ops::routed::{
    DeviceExpertTable, ExpertGroups, ExpertProjection, ExpertRefs, RoutedRows, gemm_routed,
    swiglu_act_quant_fp8,
};
use deepinfer_kernels::{KernelError, KernelRuntime};
use half::bf16;

use crate::cublaslt_fp8::LtFp8;
use crate::ops::{
    BF16_FLOPS, FP8_FLOPS, ROTATION_BYTES, ROUTE_SETS, ROUTED_DIM, ROUTED_EXPERTS, ROUTED_INTER,
    ROUTED_TOP_K, Row, Timer, activations, bench_linear, f32_host_values, f32_values, print_rows,
    random_bytes, route_sets, scale_bytes, time_launches,
};

/// Dense FP8 shapes (name, N, K, weight tile): the 5120 → 6144 decode case of
/// shared/tools/gpu.md, the V4.1 block's wq_a and wq_b (32×32 tiles), and V4-Flash's wq_a and
/// wq_b (dim 4096, q_lora_rank 1024, 64 heads of 512: 128×128 tiles).
const SHAPES: [(&str, usize, usize, usize); 5] = [
    ("d5120 n6144", 6144, 5120, 32),
    ("wq_a", 1280, 5120, 32),
    ("wq_b", 32768, 1280, 32),
    ("v4 wq_a t128", 1024, 4096, 128),
    ("v4 wq_b t128", 32768, 1024, 128),
];

/// Which kernel a row times.
#[derive(Clone, Copy)]
enum Kernel {
    Fast,
    Exact,
    CublasBf16,
    CublasLtFp8,
}

impl Kernel {
    fn label(self) -> &'static str {
        match self {
            Kernel::Fast => "fast fp8",
            Kernel::Exact => "exact fp8",
            Kernel::CublasBf16 => "cublas bf16",
            Kernel::CublasLtFp8 => "cublaslt fp8",
        }
    }
}

/// Times `kernel` on `[m × k] · [n × k]ᵀ`.
fn bench(
    rt: &KernelRuntime,
    blas: &CudaBlas,
    blas_lt: &LtFp8,
    timer: &mut Timer,
    kernel: Kernel,
    (name, n, k, tile): (&str, usize, usize, usize),
    m: usize,
) -> Result<Row> {
    let x = activations(rt, m, k)?;
    let scales_len = n.div_ceil(tile) * k.div_ceil(tile);
    let weight_bytes = match kernel {
        Kernel::Fast | Kernel::Exact => n * k + scales_len,
        Kernel::CublasBf16 => 2 * n * k,
        Kernel::CublasLtFp8 => n * k + 4,
    };
    let mut label = format!("{name} {}", kernel.label());
    let micros = match kernel {
        // V4's tiles: f32 outputs, as `CudaBackend::linear` writes them.
        Kernel::Fast if tile == 128 => time_fast_fp8::<f32>(rt, timer, &x, (m, n, k, tile))?,
        Kernel::Fast => time_fast_fp8::<bf16>(rt, timer, &x, (m, n, k, tile))?,
        Kernel::Exact => time_fp8::<_, bf16>(
            rt,
            timer,
            &x,
            (m, n, k, tile),
            |w| DeviceFp8Weight::upload(rt, w),
            |a, w, y| gemm_fp8(rt, a, w, y, GemmSplit::Auto),
        )?,
        Kernel::CublasBf16 => {
            let copies = ROTATION_BYTES.div_ceil(weight_bytes).max(2);
            let mut y = rt.stream().alloc_zeros::<bf16>(m * n)?;
            let weights = (0..copies)
                .map(|_| activations(rt, n, k))
                .collect::<Result<Vec<_>>>()?;
            let cfg = row_major_gemm(m, n, k, k, n)?;
            time_launches(rt, timer, |i| {
                // SAFETY: W holds n·k, x m·k and y m·n bf16 values, as cfg describes.
                unsafe { blas.gemm(cfg, &weights[i % copies], &x, &mut y) }
                    .context("cuBLAS bf16 GEMM")?;
                Ok(())
            })?
        }
        Kernel::CublasLtFp8 => {
            let plan = blas_lt.plan(m, n, k)?;
            if plan.rows != m {
                label.push_str(&format!(" (m padded to {})", plan.rows));
            }
            let copies = ROTATION_BYTES.div_ceil(weight_bytes).max(2);
            let x = rt
                .stream()
                .clone_htod(&random_bytes(5, plan.rows * k, true))?;
            let weights = (0..copies)
                .map(|c| {
                    Ok(rt
                        .stream()
                        .clone_htod(&random_bytes(c as u64, n * k, true))?)
                })
                .collect::<Result<Vec<_>>>()?;
            let mut y = rt.stream().alloc_zeros::<bf16>(plan.rows * n)?;
            time_launches(rt, timer, |i| {
                blas_lt.launch(&plan, &weights[i % copies], &x, &mut y)
            })?
        }
    };
    let act_bytes = match kernel {
        Kernel::CublasBf16 => 2 * m * k,
        Kernel::CublasLtFp8 => m * k + 4,
        _ => m * k + m * k / tile * 4,
    };
    let out_bytes = match kernel {
        Kernel::Fast if tile == 128 => 4 * m * n,
        _ => 2 * m * n,
    };
    Ok(Row {
        op: label,
        m,
        n,
        k,
        micros,
        bytes: (weight_bytes + act_bytes + out_bytes) as f64,
        flops: (2 * m * n * k) as f64,
        peak_flops: match kernel {
            Kernel::CublasBf16 => BF16_FLOPS,
            _ => FP8_FLOPS,
        },
    })
}

/// Times `gemm` over random FP8 weights with square `tile`s made by `upload`, rotated through
/// more than twice the L2, with `x` quantised to FP8 in groups of the tile side, into an output
/// of `T`.
fn time_fp8<W, T: DeviceRepr + ValidAsZeroBits>(
    rt: &KernelRuntime,
    timer: &mut Timer,
    x: &CudaSlice<bf16>,
    (m, n, k, tile): (usize, usize, usize, usize),
    upload: impl Fn(Fp8Bytes<'_>) -> Result<W, KernelError>,
    gemm: impl Fn(&DeviceActFp8, &W, &mut CudaSlice<T>) -> Result<(), KernelError>,
) -> Result<f64> {
    let scales_len = n.div_ceil(tile) * k.div_ceil(tile);
    let copies = ROTATION_BYTES.div_ceil(n * k + scales_len).max(2);
    let group = if tile == 128 {
        ActGroup::G128
    } else {
        ActGroup::G32
    };
    let a = quantize_act_fp8(rt, x, m, k, group)?;
    let weights = (0..copies)
        .map(|c| {
            upload(Fp8Bytes {
                out: n,
                inp: k,
                tile,
                codes: &random_bytes(c as u64, n * k, true),
                scales: &scale_bytes(scales_len),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut y = rt.stream().alloc_zeros::<T>(m * n)?;
    time_launches(rt, timer, |i| Ok(gemm(&a, &weights[i % copies], &mut y)?))
}

/// [`time_fp8`] of the fast FP8 GEMM writing `T` outputs.
fn time_fast_fp8<T: DeviceRepr + ValidAsZeroBits>(
    rt: &KernelRuntime,
    timer: &mut Timer,
    x: &CudaSlice<bf16>,
    (m, n, k, tile): (usize, usize, usize, usize),
) -> Result<f64>
where
    CudaSlice<T>: FastOutput,
{
    time_fp8::<_, T>(
        rt,
        timer,
        x,
        (m, n, k, tile),
        |w| FastFp8Weight::upload(rt, w),
        |a, w, y| gemm_fp8_fast(rt, a, w, y, FastTile::Auto),
    )
}

/// The real-width layer's routed experts in one numerics: its table (whose format picks the
/// routed kernels) and the weights it points into (the table is dropped first).
pub(crate) struct Experts<W> {
    label: &'static str,
    pub(crate) table: DeviceExpertTable,
    _weights: Vec<[W; 3]>,
}

/// One of the layer's random FP4 weights (w1, w3 or w2), which every expert copies.
struct ExpertContent {
    out: usize,
    inp: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
}

impl ExpertContent {
    fn bytes(&self) -> Fp4Bytes<'_> {
        Fp4Bytes {
            out: self.out,
            inp: self.inp,
            packed: &self.packed,
            scales: &self.scales,
        }
    }
}

/// The layer's w1, w3 and w2 contents.
fn expert_contents() -> [ExpertContent; 3] {
    let content = |seed: u64, (out, inp): (usize, usize)| ExpertContent {
        out,
        inp,
        packed: random_bytes(seed, out * inp / 2, false),
        scales: scale_bytes(out * inp / 32),
    };
    let (n, k) = (ROUTED_INTER, ROUTED_DIM);
    [
        content(310, (n, k)),
        content(311, (n, k)),
        content(312, (k, n)),
    ]
}

fn refs<W>(weights: &[[W; 3]]) -> Vec<ExpertRefs<'_, W>> {
    weights
        .iter()
        .map(|[w1, w3, w2]| ExpertRefs { w1, w3, w2 })
        .collect()
}

/// The layer's experts as exact-path weights, every expert's copy distinct in device memory.
fn exact_experts(rt: &KernelRuntime) -> Result<Experts<DeviceFp4Weight>> {
    let contents = expert_contents();
    let weights: Vec<[DeviceFp4Weight; 3]> = (0..ROUTED_EXPERTS)
        .map(|_| {
            let upload = |p: usize| DeviceFp4Weight::upload(rt, contents[p].bytes());
            Ok([upload(0)?, upload(1)?, upload(2)?])
        })
        .collect::<Result<_, KernelError>>()?;
    // SAFETY: the table is stored beside the weights it points into and dropped first.
    let table = unsafe { DeviceExpertTable::fp4(rt, &refs(&weights)) }?;
    Ok(Experts {
        label: "exact",
        table,
        _weights: weights,
    })
}

/// The layer's experts as fast-path weights: each content re-laid and uploaded once, then copied
/// on the device (device-to-device), every expert's copy distinct in device memory (384 × 17.7
/// MB: far more than the L2).
pub(crate) fn fast_experts(rt: &KernelRuntime) -> Result<Experts<FastFp4Weight>> {
    let [f1, f3, f2] = expert_contents().map(|c| FastFp4Weight::upload(rt, c.bytes()));
    let (f1, f3, f2) = (f1?, f3?, f2?);
    let weights: Vec<[FastFp4Weight; 3]> = (0..ROUTED_EXPERTS)
        .map(|_| [f1.clone(), f3.clone(), f2.clone()])
        .collect();
    // SAFETY: the table is stored beside the weights it points into and dropped first.
    let table = unsafe { DeviceExpertTable::fp4_fast(rt, &refs(&weights)) }?;
    Ok(Experts {
        label: "fast",
        table,
        _weights: weights,
    })
}

/// Times the routed chain of `tokens` tokens with `experts` over the rotated route sets; bytes =
/// the distinct experts' three weights (codes and scales) plus activations and outputs.
fn bench_routed_chain<W>(
    rt: &KernelRuntime,
    timer: &mut Timer,
    experts: &Experts<W>,
    tokens: usize,
) -> Result<Row> {
    let (inter, dim) = (ROUTED_INTER, ROUTED_DIM);
    let slots = tokens * ROUTED_TOP_K;
    let stream = rt.stream();
    let x = activations(rt, tokens, dim)?;
    let a = quantize_act_fp8(rt, &x, tokens, dim, ActGroup::G32)?;
    let (routes, distinct) = route_sets(rt, tokens)?;
    let route_weights = stream.clone_htod(&vec![1.0f32 / ROUTED_TOP_K as f32; slots])?;
    let mut gate_up = stream.alloc_zeros::<bf16>(2 * slots * inter)?;
    let mut a_hidden = DeviceActFp8::alloc(rt, slots, inter, ActGroup::G32)?;
    let mut out = stream.alloc_zeros::<bf16>(slots * dim)?;
    let table = &experts.table;
    // The table's own kernels, the slots grouped once per chain (as `moe_rows`).
    let routed = |x: &DeviceActFp8,
                  groups: &ExpertGroups<'_>,
                  x_row_div: usize,
                  which: ExpertProjection,
                  y: &mut CudaSlice<bf16>| {
        let rows = RoutedRows {
            x,
            groups,
            x_row_div,
            which,
        };
        gemm_routed(rt, rows, table, y)
    };
    let micros = time_launches(rt, timer, |i| {
        let groups = ExpertGroups::new(rt, &routes[i % ROUTE_SETS], table)?;
        routed(
            &a,
            &groups,
            ROUTED_TOP_K,
            ExpertProjection::GateUp,
            &mut gate_up,
        )?;
        let (gate, up) = gate_up.split_at(slots * inter);
        swiglu_act_quant_fp8(
            rt,
            &gate,
            &up,
            Some(&route_weights),
            10.0,
            Rounding::Bf16,
            &mut a_hidden,
        )?;
        routed(&a_hidden, &groups, 1, ExpertProjection::W2, &mut out)?;
        Ok(())
    })?;
    let weight_bytes = 3 * (inter * dim / 2 + inter * dim / 32);
    Ok(Row {
        op: format!("moe chain {}", experts.label),
        m: slots,
        n: inter,
        k: dim,
        micros,
        bytes: distinct * weight_bytes as f64
            + (tokens * dim * 5 / 4 + 2 * slots * inter * 2 + slots * dim * 2) as f64,
        flops: (3 * 2 * slots * inter * dim) as f64,
        peak_flops: FP8_FLOPS,
    })
}

/// Keeps a timed row; a cuBLASLt FP8 peer that cuBLASLt refuses on a shape is reported and
/// skipped (the library decides which FP8 shapes it serves), any other failure ends the section.
fn push_row(rows: &mut Vec<Row>, kernel: Kernel, row: Result<Row>) -> Result<()> {
    match (row, kernel) {
        (Ok(row), _) => rows.push(row),
        (Err(e), Kernel::CublasLtFp8) => println!("cublaslt fp8 peer not timed: {e:#}"),
        (Err(e), _) => return Err(e),
    }
    Ok(())
}

/// Times the fast GEMM and its peers at decode and prefill shapes, and prints the table.
pub fn run(quick: bool, sweep: bool) -> Result<()> {
    let rt = KernelRuntime::open(0).context("opening the CUDA device")?;
    let rt = &rt;
    let blas = CudaBlas::new(rt.stream().clone()).context("opening cuBLAS")?;
    let blas_lt = LtFp8::new(rt.stream().clone())?;
    let mut timer = Timer::new(rt, quick)?;
    let mut rows = Vec::new();
    let decode: &[usize] = if quick { &[1] } else { &[1, 8, 64] };
    for &shape in &SHAPES {
        for &m in decode {
            for kernel in [
                Kernel::Fast,
                Kernel::CublasBf16,
                Kernel::CublasLtFp8,
                Kernel::Exact,
            ] {
                push_row(
                    &mut rows,
                    kernel,
                    bench(rt, &blas, &blas_lt, &mut timer, kernel, shape, m),
                )?;
            }
        }
    }
    let prefill: &[usize] = if quick { &[1024] } else { &[1024, 4096] };
    for &m in prefill {
        for kernel in [Kernel::Fast, Kernel::CublasBf16, Kernel::CublasLtFp8] {
            push_row(
                &mut rows,
                kernel,
                bench(rt, &blas, &blas_lt, &mut timer, kernel, SHAPES[0], m),
            )?;
        }
    }
    println!("\nfast numerics: tensor-core FP8 GEMM beside its peers (same shapes, same run)");
    print_rows(&rows);
    println!(
        "\nbytes = weights (FP8 codes + scales; cuBLAS: bf16; cuBLASLt: FP8, one scale) + activations \
         + outputs (bf16; f32 for the fast t128 rows); cuBLASLt FP8 has per-tensor scales only (no block scales); \
         %HBM = bytes / time / 4.28 TB/s; roofline = max(bytes / 4.28 TB/s, FLOPs / peak) / time, \
         peak 1216 TFLOP/s FP8 (790 bf16 for cuBLAS)."
    );
    let fast = fast_experts(rt)?;
    if sweep {
        crate::fast_sweep::run(rt, &mut timer, quick)?;
        crate::fast_sweep::routed(rt, &mut timer, quick, &fast.table)?;
    }

    let exact = exact_experts(rt)?;
    let mut chain = Vec::new();
    let token_counts: &[usize] = if quick { &[1, 1024] } else { &[1, 8, 64, 1024] };
    for &tokens in token_counts {
        chain.push(bench_routed_chain(rt, &mut timer, &fast, tokens)?);
        chain.push(bench_routed_chain(rt, &mut timer, &exact, tokens)?);
    }
    println!(
        "\nfast numerics: the routed experts of a real-width MoE layer (384 FP4 experts 5120 -> \
         2304 -> 5120, top-6), w1 + w3 + SwiGLU + quantise + w2, fast beside exact (same routes)"
    );
    print_rows(&chain);
    println!(
        "\nM = routed rows (tokens x 6); bytes = the distinct experts' w1, w3, w2 (FP4 codes + \
         scales, mean over {ROUTE_SETS} route sets) + activations + bf16 outputs; FLOPs = 3 GEMMs."
    );

    let mut linear = Vec::new();
    let linear_rows: &[usize] = if quick { &[1, 1024] } else { &[1, 8, 64, 1024] };
    for &m in linear_rows {
        linear.push(bench_fast_linear(
            rt,
            &mut timer,
            WO_A,
            m,
            FastProduct::Bf16(Rounding::Bf16),
        )?);
        linear.push(bench_cublas_grouped(rt, &blas, &mut timer, WO_A, m)?);
        let (_, groups, n, k) = WO_A;
        linear.push(bench_linear(
            rt,
            &mut timer,
            ("wo_a exact bf16", Rounding::Bf16),
            (m, groups, n, k),
        )?);
    }
    println!(
        "\nfast numerics: the bf16 linear of the grouped wo_a (8 groups of 1024 x 4096, N = all 8192 \
         outputs) beside cuBLAS bf16 (one strided-batched GEMM) and the exact kernel (a launch per \
         group)"
    );
    print_rows(&linear);
    println!(
        "\nbytes = bf16 weights (exact: f32 storage, 4 bytes each) + activations (f32; cuBLAS: \
         bf16) + outputs; roofline peak 790 TFLOP/s bf16."
    );

    let mut f32_linear = Vec::new();
    for shape in F32_LINEARS {
        for &m in linear_rows {
            f32_linear.push(bench_fast_linear(
                rt,
                &mut timer,
                shape,
                m,
                FastProduct::SplitBf16x3,
            )?);
            let (name, groups, n, k) = shape;
            let exact = format!("{name} exact f32");
            f32_linear.push(bench_linear(
                rt,
                &mut timer,
                (&exact, Rounding::F32),
                (m, groups, n, k),
            )?);
        }
    }
    println!(
        "\nfast numerics: the fp32 linears (linear_f32) of the block, the split-x bf16x3 linear \
         beside the exact kernel"
    );
    print_rows(&f32_linear);
    println!(
        "\nFLOPs = 2 M N K (bf16x3: three bf16 products each, 3x the tensor-core work); bytes as \
         above."
    );
    Ok(())
}

/// A linear of the block: name, groups, outputs per group, inputs per group.
type LinearShape = (&'static str, usize, usize, usize);

/// The grouped `wo_a` of the V4.1 block: 8 groups of 1024 outputs over 4096 inputs each.
const WO_A: LinearShape = ("wo_a", 8, 1024, 4096);

/// The fp32 linears of the V4.1 block: the MoE router gate and the ratio-2 compressor's `wkv`
/// (its `wgate` has the same shape).
const F32_LINEARS: [LinearShape; 2] = [
    ("router gate", 1, 384, 5120),
    ("compressor wkv", 1, 512, 5120),
];

/// Times the fast linear `product` of the weight `(name, groups, n, k)` at `m` rows (one launch
/// for all the groups), weights rotated through more than twice the L2.
fn bench_fast_linear(
    rt: &KernelRuntime,
    timer: &mut Timer,
    (name, groups, n, k): LinearShape,
    m: usize,
    product: FastProduct,
) -> Result<Row> {
    let (outputs, inputs) = (groups * n, groups * k);
    let x = f32_values(rt, 900, m * inputs)?;
    let mut y = rt.stream().alloc_zeros::<f32>(m * outputs)?;
    let copies = ROTATION_BYTES.div_ceil(2 * outputs * k).max(2);
    let weights = (0..copies)
        .map(|c| {
            let w = f32_host_values(300 + c as u64, outputs * k);
            FastBf16Weight::upload_grouped(rt, groups, outputs, k, &w)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let micros = time_launches(rt, timer, |i| {
        Ok(linear_bf16_fast(
            rt,
            &x,
            &weights[i % copies],
            &mut y,
            m,
            None,
            product,
        )?)
    })?;
    let label = match product {
        FastProduct::Bf16(_) => "bf16",
        FastProduct::SplitBf16x3 => "bf16x3",
    };
    Ok(Row {
        op: format!("{name} fast {label}"),
        m,
        n: outputs,
        k,
        micros,
        bytes: (2 * outputs * k + 4 * m * inputs + 4 * m * outputs) as f64,
        flops: (2 * m * outputs * k) as f64,
        peak_flops: BF16_FLOPS,
    })
}

/// Times cuBLAS bf16 on the grouped weight `(name, groups, n, k)` at `m` rows, laid out as the
/// fast linear's (x `[m, groups · k]`, y `[m, groups · n]`, group g's columns its own), as one
/// strided-batched GEMM over the groups, bf16 outputs; weights rotated through more than twice
/// the L2.
fn bench_cublas_grouped(
    rt: &KernelRuntime,
    blas: &CudaBlas,
    timer: &mut Timer,
    (name, groups, n, k): LinearShape,
    m: usize,
) -> Result<Row> {
    let (outputs, inputs) = (groups * n, groups * k);
    let x = activations(rt, m, inputs)?;
    let mut y = rt.stream().alloc_zeros::<bf16>(m * outputs)?;
    let copies = ROTATION_BYTES.div_ceil(2 * outputs * k).max(2);
    let weights = (0..copies)
        .map(|_| activations(rt, outputs, k))
        .collect::<Result<Vec<_>>>()?;
    // Group g: row-major y_g[m, n] (row stride groups · n) = x_g[m, k] (row stride groups · k) ·
    // W_g[n, k]ᵀ; the groups n · k weights, k inputs and n outputs apart.
    let cfg = StridedBatchedConfig {
        gemm: row_major_gemm(m, n, k, inputs, outputs)?,
        batch_size: i32::try_from(groups)?,
        stride_a: i64::try_from(n * k)?,
        stride_b: i64::try_from(k)?,
        stride_c: i64::try_from(n)?,
    };
    let micros = time_launches(rt, timer, |i| {
        // SAFETY: each copy of W holds groups · n · k, x m · groups · k and y m · groups · n bf16
        // values; cfg's last group ends at its buffer's end.
        unsafe { blas.gemm_strided_batched(cfg, &weights[i % copies], &x, &mut y) }
            .context("cuBLAS strided-batched bf16 GEMM")?;
        Ok(())
    })?;
    Ok(Row {
        op: format!("{name} cublas bf16"),
        m,
        n: outputs,
        k,
        micros,
        bytes: (2 * (outputs * k + m * inputs + m * outputs)) as f64,
        flops: (2 * m * outputs * k) as f64,
        peak_flops: BF16_FLOPS,
    })
}

/// The cuBLAS bf16 GEMM of row-major y[m, n] (rows `y_stride` apart) = x[m, k] (rows `x_stride`
/// apart) · W[n, k]ᵀ: column-major yᵀ[n, m] = W · xᵀ with W seen as a transposed column-major
/// [k, n].
fn row_major_gemm(
    m: usize,
    n: usize,
    k: usize,
    x_stride: usize,
    y_stride: usize,
) -> Result<GemmConfig<bf16>> {
    Ok(GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: i32::try_from(n)?,
        n: i32::try_from(m)?,
        k: i32::try_from(k)?,
        alpha: bf16::ONE,
        lda: i32::try_from(k)?,
        ldb: i32::try_from(x_stride)?,
        beta: bf16::ZERO,
        ldc: i32::try_from(y_stride)?,
    })
}
