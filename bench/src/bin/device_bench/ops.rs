//! Per-op section of the device benchmark: the CUDA kernels at real V4.1 widths (d = 5120, q_lora 1280,
//! 64 heads × 512, experts 2304, 384 experts, 4 mHC streams), decode-shaped (M = 1, 8, 64): time
//! per launch, bytes moved, FLOPs, and the ratio to the H200's measured roofline (4.28 TB/s copy;
//! 1216 TFLOP/s FP8 and ~790 TFLOP/s bf16 tensor-core GEMM). The per-token ops of `CudaBackend`
//! (sink attention over 640 keys, indexer scores over 4096 keys, mHC, QDQ) are timed for one token.
//!
//! Weights are random bytes; several copies are rotated so that each launch reads its weights from
//! HBM, not from the 60 MiB L2. Each figure is the median over 7 batches of 40 launches timed with
//! CUDA events (3 batches of 8 with `--quick`).

use std::time::Duration;

use anyhow::{Context, Result};
use deepinfer_bench::steps::splitmix64;
use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::cudarc::driver::sys::CUevent_flags;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::attention::{
    AttentionRows, DeviceKeyLists, sparse_attention_sink_rows_f32,
};
use deepinfer_kernels::ops::gemm::{
    DeviceFp4Weight, DeviceFp8Weight, Fp4Bytes, Fp4Form, Fp8Bytes, Fp8Form, GemmSplit, gemm_fp4,
    gemm_fp8,
};
use deepinfer_kernels::ops::index::index_scores_f32;
use deepinfer_kernels::ops::key_table::{DeviceKeyTable, KeyRows, key_row_address};
use deepinfer_kernels::ops::linear::linear_sgemm_f32;
use deepinfer_kernels::ops::mhc::{HcMixesConfig, hc_expand_rows_f32, hc_mixes_rows_f32};
use deepinfer_kernels::ops::norm::rms_norm_f32;
use deepinfer_kernels::ops::qdq::{QdqPoint, qdq_f32};
use deepinfer_kernels::ops::quant::{ActGroup, quantize_act_fp8, quantize_act_fp8_into};
use deepinfer_kernels::ops::routed::{
    DeviceExpertTable, ExpertGroups, ExpertProjection, ExpertRefs, RoutedBlocks, RoutedRows,
    gemm_routed,
};
use deepinfer_kernels::ops::sampling::{SampleRow, SampleScratch, sample_rows_f32};
use half::bf16;

use crate::head_start::HeadStart;

/// Measured on the H200 test machine (shared/tools/gpu.md).
pub(crate) const COPY_BYTES_PER_S: f64 = 4.28e12;
pub(crate) const FP8_FLOPS: f64 = 1216e12;
pub(crate) const BF16_FLOPS: f64 = 790e12;
/// Rotate weight copies until they span this many bytes (> 2 × the 60 MiB L2).
pub(crate) const ROTATION_BYTES: usize = 160 << 20;
/// Launches per timed batch and timed batches per figure (full / `--quick`).
const LAUNCHES_PER_BATCH: usize = 40;
const BATCHES: usize = 7;
const QUICK_LAUNCHES_PER_BATCH: usize = 8;
const QUICK_BATCHES: usize = 3;

pub(crate) struct Row {
    pub op: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub micros: f64,
    pub bytes: f64,
    pub flops: f64,
    pub peak_flops: f64,
}

impl Row {
    fn floor_micros(&self) -> f64 {
        (self.bytes / COPY_BYTES_PER_S).max(self.flops / self.peak_flops) * 1e6
    }
}

/// Splitmix64 bytes for weights (finite E4M3 codes: bit patterns 0x7f/0xff replaced).
pub(crate) fn random_bytes(seed: u64, len: usize, finite_e4m3: bool) -> Vec<u8> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            let b = (splitmix64(&mut state) >> 56) as u8;
            if finite_e4m3 && b & 0x7f == 0x7f {
                b & 0xf7
            } else {
                b
            }
        })
        .collect()
}

pub(crate) fn scale_bytes(len: usize) -> Vec<u8> {
    random_bytes(7, len, false)
        .iter()
        .map(|b| 120 + b % 8)
        .collect()
}

/// How launches are timed: `batches` batches of `launches` launches, each batch queued behind a
/// hold of the stream ([`HeadStart`]) so that it then runs back to back and host launch overhead
/// (even of a debug build) stays out of the figures.
pub(crate) struct Timer {
    head_start: HeadStart,
    launches: usize,
    batches: usize,
}

/// Outlasts the host's queueing of a batch (40 launches).
const BATCH_HOLD: Duration = Duration::from_millis(3);

impl Timer {
    pub(crate) fn new(rt: &KernelRuntime, quick: bool) -> Result<Timer> {
        let (launches, batches) = if quick {
            (QUICK_LAUNCHES_PER_BATCH, QUICK_BATCHES)
        } else {
            (LAUNCHES_PER_BATCH, BATCHES)
        };
        Ok(Timer {
            head_start: HeadStart::new(rt)?,
            launches,
            batches,
        })
    }
}

/// Median microseconds per call of `launch(i)` (i = launch index, for rotating inputs).
pub(crate) fn time_launches(
    rt: &KernelRuntime,
    timer: &mut Timer,
    launch: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let iterations = (timer.launches, timer.batches);
    time_launches_with(rt, timer, iterations, launch)
}

/// [`time_launches`] over `batches` batches of `launches` launches (a sweep of many builds times
/// each with fewer).
pub(crate) fn time_launches_with(
    rt: &KernelRuntime,
    timer: &mut Timer,
    (launches, batches): (usize, usize),
    mut launch: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let ctx = rt.context();
    for i in 0..5 {
        launch(i)?;
    }
    rt.synchronize()?;
    let mut per_batch = Vec::with_capacity(batches);
    for _ in 0..batches {
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        timer.head_start.hold(BATCH_HOLD)?;
        start.record(rt.stream())?;
        for i in 0..launches {
            launch(i)?;
        }
        end.record(rt.stream())?;
        per_batch.push(f64::from(start.elapsed_ms(&end)?) * 1e3 / launches as f64);
    }
    per_batch.sort_by(f64::total_cmp);
    Ok(per_batch[per_batch.len() / 2])
}

pub(crate) fn activations(
    rt: &KernelRuntime,
    m: usize,
    k: usize,
) -> Result<deepinfer_kernels::cudarc::driver::CudaSlice<bf16>> {
    let host: Vec<bf16> = random_bytes(11, m * k, false)
        .iter()
        .map(|&b| bf16::from_f32((f32::from(b) - 127.5) / 64.0))
        .collect();
    Ok(rt.stream().clone_htod(&host)?)
}

/// The decode GEMMs of a real-width V4.1 layer: name, weight format, N (outputs), K (inputs).
const GEMMS: [(&str, WeightFormat, usize, usize); 4] = [
    ("wq_a", WeightFormat::Fp8, 1280, 5120),
    ("wq_b", WeightFormat::Fp8, 32768, 1280),
    ("expert w1", WeightFormat::Fp4, 2304, 5120),
    ("expert w2", WeightFormat::Fp4, 5120, 2304),
];

/// A block-scaled weight format the GEMM benchmarks time.
#[derive(Clone, Copy)]
enum WeightFormat {
    /// FP8 E4M3 codes with 32×32 UE8M0 tiles.
    Fp8,
    /// FP4 E2M1 packed two per byte, 1×32 UE8M0 groups.
    Fp4,
}

/// `[m × k] · Wᵀ` with a random `[n × k]` weight in `format`, rotated over enough copies that
/// every launch reads HBM.
#[allow(clippy::too_many_arguments)]
fn bench_gemm(
    rt: &KernelRuntime,
    timer: &mut Timer,
    name: &str,
    format: WeightFormat,
    m: usize,
    n: usize,
    k: usize,
    split: GemmSplit,
) -> Result<Row> {
    let (weight_len, scales_len) = match format {
        WeightFormat::Fp8 => (n * k, n.div_ceil(32) * k.div_ceil(32)),
        WeightFormat::Fp4 => (n * k / 2, n * k / 32),
    };
    let copies = ROTATION_BYTES.div_ceil(weight_len).max(2);
    let x = activations(rt, m, k)?;
    let a = quantize_act_fp8(rt, &x, m, k, ActGroup::G32)?;
    let mut y = rt.stream().alloc_zeros::<bf16>(m * n)?;
    let micros = match format {
        WeightFormat::Fp8 => {
            let weights = (0..copies)
                .map(|c| {
                    let w = Fp8Bytes {
                        out: n,
                        inp: k,
                        tile: 32,
                        codes: &random_bytes(c as u64, weight_len, true),
                        scales: &scale_bytes(scales_len),
                    };
                    DeviceFp8Weight::upload(rt, w)
                })
                .collect::<Result<Vec<_>, _>>()?;
            time_launches(rt, timer, |i| {
                Ok(gemm_fp8(rt, &a, &weights[i % copies], &mut y, split)?)
            })?
        }
        WeightFormat::Fp4 => {
            let weights = (0..copies)
                .map(|c| {
                    let w = Fp4Bytes {
                        out: n,
                        inp: k,
                        packed: &random_bytes(100 + c as u64, weight_len, false),
                        scales: &scale_bytes(scales_len),
                    };
                    DeviceFp4Weight::upload(rt, w)
                })
                .collect::<Result<Vec<_>, _>>()?;
            time_launches(rt, timer, |i| {
                Ok(gemm_fp4(rt, &a, &weights[i % copies], &mut y, split)?)
            })?
        }
    };
    let label = match format {
        WeightFormat::Fp8 => "fp8 t32",
        WeightFormat::Fp4 => "fp4",
    };
    Ok(Row {
        op: format!("{name} {label}{}", split_label(split)),
        m,
        n,
        k,
        micros,
        bytes: (weight_len + scales_len + m * k + m * k / 32 * 4 + m * n * 2) as f64,
        flops: (2 * m * n * k) as f64,
        peak_flops: FP8_FLOPS,
    })
}

/// Routed experts of a real-width layer: 384 FP4 experts (inter 2304, dim 5120), top-6.
pub(crate) const ROUTED_EXPERTS: usize = 384;
pub(crate) const ROUTED_TOP_K: usize = 6;
pub(crate) const ROUTED_INTER: usize = 2304;
pub(crate) const ROUTED_DIM: usize = 5120;
/// Route sets rotated over, so that the few experts of a decode step are not served from L2.
pub(crate) const ROUTE_SETS: usize = 8;

/// `ROUTE_SETS` random route sets of `tokens` tokens (each `ROUTED_TOP_K` distinct experts of
/// `ROUTED_EXPERTS`) on the device, and the mean number of distinct experts per set.
pub(crate) fn route_sets(rt: &KernelRuntime, tokens: usize) -> Result<(Vec<CudaSlice<u32>>, f64)> {
    let mut state = 0x5eed_u64 + tokens as u64;
    let mut distinct_total = 0usize;
    let sets = (0..ROUTE_SETS)
        .map(|_| {
            let mut ids = Vec::with_capacity(tokens * ROUTED_TOP_K);
            for _ in 0..tokens {
                let mut chosen: Vec<u32> = Vec::with_capacity(ROUTED_TOP_K);
                while chosen.len() < ROUTED_TOP_K {
                    let e = (splitmix64(&mut state) % ROUTED_EXPERTS as u64) as u32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                ids.extend(chosen);
            }
            let mut distinct = ids.clone();
            distinct.sort_unstable();
            distinct.dedup();
            distinct_total += distinct.len();
            Ok(rt.stream().clone_htod(&ids)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((sets, distinct_total as f64 / ROUTE_SETS as f64))
}

/// The routed `w1` GEMM of `tokens` tokens (top-6 of 384 FP4 experts, random routes rotated over
/// `ROUTE_SETS` sets) with `blocks`; bytes = the distinct experts' `w1` (codes and scales), averaged
/// over the route sets, plus activations and outputs.
fn bench_routed_w1(
    rt: &KernelRuntime,
    timer: &mut Timer,
    table: &DeviceExpertTable,
    tokens: usize,
    blocks: RoutedBlocks,
) -> Result<Row> {
    let (n, k) = (ROUTED_INTER, ROUTED_DIM);
    let m = tokens * ROUTED_TOP_K;
    let x = activations(rt, tokens, k)?;
    let a = quantize_act_fp8(rt, &x, tokens, k, ActGroup::G32)?;
    let mut y = rt.stream().alloc_zeros::<bf16>(m * n)?;
    let (route_sets, distinct) = route_sets(rt, tokens)?;
    // The slots grouped with the launch (a MoE call groups them once for its three GEMMs).
    let micros = time_launches(rt, timer, |i| {
        let groups = ExpertGroups::blocks(rt, &route_sets[i % ROUTE_SETS], table, blocks)?;
        Ok(gemm_routed(
            rt,
            RoutedRows {
                x: &a,
                groups: &groups,
                x_row_div: ROUTED_TOP_K,
                which: ExpertProjection::W1,
            },
            table,
            &mut y,
        )?)
    })?;
    let label = match blocks {
        RoutedBlocks::Auto => "",
        RoutedBlocks::Rows => " rows",
        RoutedBlocks::Tiles => " tiles",
        RoutedBlocks::Experts => " experts",
    };
    Ok(Row {
        op: format!("routed w1{label}"),
        m,
        n,
        k,
        micros,
        bytes: distinct * (n * k / 2 + n * k / 32) as f64 + (tokens * k * 5 / 4 + m * n * 2) as f64,
        flops: (2 * m * n * k) as f64,
        peak_flops: FP8_FLOPS,
    })
}

/// The routed `w1` rows: every kernel at B = 1, 8, 64 (6, 48, 384 routed rows; `--quick`: B = 1).
fn bench_routed(rt: &KernelRuntime, timer: &mut Timer, quick: bool) -> Result<Vec<Row>> {
    let (n, k) = (ROUTED_INTER, ROUTED_DIM);
    let scales = scale_bytes(n * k / 32);
    let w1_bytes = Fp4Bytes {
        out: n,
        inp: k,
        packed: &random_bytes(300, n * k / 2, false),
        scales: &scales,
    };
    let w1 = (0..ROUTED_EXPERTS)
        .map(|_| DeviceFp4Weight::upload(rt, w1_bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let w2_bytes = Fp4Bytes {
        out: k,
        inp: n,
        packed: &random_bytes(301, n * k / 2, false),
        scales: &scales,
    };
    let w2 = DeviceFp4Weight::upload(rt, w2_bytes)?;
    let refs: Vec<ExpertRefs<'_, DeviceFp4Weight>> = w1
        .iter()
        .map(|w| ExpertRefs {
            w1: w,
            w3: w,
            w2: &w2,
        })
        .collect();
    // SAFETY: `w1` and `w2` outlive every launch below (the table is dropped first).
    let table = unsafe { DeviceExpertTable::fp4(rt, &refs) }?;
    let token_counts: &[usize] = if quick { &[1] } else { &[1, 8, 64] };
    let mut rows = Vec::new();
    for &tokens in token_counts {
        for blocks in [
            RoutedBlocks::Auto,
            RoutedBlocks::Experts,
            RoutedBlocks::Rows,
            RoutedBlocks::Tiles,
        ] {
            rows.push(bench_routed_w1(rt, timer, &table, tokens, blocks)?);
        }
    }
    Ok(rows)
}

fn split_label(split: GemmSplit) -> String {
    match split {
        GemmSplit::Auto => String::new(),
        GemmSplit::WarpsPerColumn(w) => format!(" w{w}"),
        GemmSplit::ColumnPerWarp => " cpw".to_string(),
    }
}

fn bench_act_quant(rt: &KernelRuntime, timer: &mut Timer, m: usize, k: usize) -> Result<Row> {
    let x = activations(rt, m, k)?;
    let mut a = quantize_act_fp8(rt, &x, m, k, ActGroup::G32)?;
    let micros = time_launches(rt, timer, |_| Ok(quantize_act_fp8_into(rt, &x, &mut a)?))?;
    let bytes = (m * k * 2 + m * k + m * k / 32 * 4) as f64;
    Ok(Row {
        op: "act_quant g32".to_string(),
        m,
        n: 0,
        k,
        micros,
        bytes,
        flops: 0.0,
        peak_flops: BF16_FLOPS,
    })
}

/// RMSNorm as `CudaBackend::rms_norm` runs it: f32 storage, outputs rounded to bf16.
fn bench_rms_norm(rt: &KernelRuntime, timer: &mut Timer, m: usize, k: usize) -> Result<Row> {
    let x = f32_values(rt, 13, m * k)?;
    let w = f32_values(rt, 14, k)?;
    let mut y = rt.stream().alloc_zeros::<f32>(m * k)?;
    let micros = time_launches(rt, timer, |_| {
        Ok(rms_norm_f32(
            rt,
            &x,
            &w,
            &mut y,
            m,
            k,
            1e-6,
            Rounding::Bf16,
        )?)
    })?;
    let bytes = ((2 * m * k + k) * 4) as f64;
    Ok(Row {
        op: "rms_norm f32".to_string(),
        m,
        n: 0,
        k,
        micros,
        bytes,
        flops: (4 * m * k) as f64,
        peak_flops: BF16_FLOPS,
    })
}

/// f32 values in [-1, 1) on the device (bf16-representable).
/// `len` values in (-1, 1) with 8 significant bits (exact in bf16) from `seed`.
pub(crate) fn f32_host_values(seed: u64, len: usize) -> Vec<f32> {
    random_bytes(seed, len, false)
        .iter()
        .map(|&b| (f32::from(b) - 127.5) / 128.0)
        .collect()
}

/// [`f32_host_values`] on the device.
pub(crate) fn f32_values(rt: &KernelRuntime, seed: u64, len: usize) -> Result<CudaSlice<f32>> {
    Ok(rt.stream().clone_htod(&f32_host_values(seed, len))?)
}

/// Plain fp32 linear in the CPU sgemm order (`Rounding::F32`), or in its bf16 GEMM order with
/// bf16 outputs, as row `op`: `groups` linears of `[n × k]` weights (one launch each, as the exact
/// backend runs a grouped weight) on `m` rows.
pub(crate) fn bench_linear(
    rt: &KernelRuntime,
    timer: &mut Timer,
    (op, rounding): (&str, Rounding),
    (m, groups, n, k): (usize, usize, usize, usize),
) -> Result<Row> {
    let copies = ROTATION_BYTES.div_ceil(groups * n * k * 4).max(2);
    let weights = (0..copies * groups)
        .map(|c| f32_values(rt, 300 + c as u64, n * k))
        .collect::<Result<Vec<_>>>()?;
    let xs = (0..groups)
        .map(|g| f32_values(rt, 5 + g as u64, m * k))
        .collect::<Result<Vec<_>>>()?;
    let mut ys = (0..groups)
        .map(|_| Ok(rt.stream().alloc_zeros::<f32>(m * n)?))
        .collect::<Result<Vec<_>>>()?;
    let micros = time_launches(rt, timer, |i| {
        for (g, (x, y)) in xs.iter().zip(&mut ys).enumerate() {
            let w = &weights[(i % copies) * groups + g];
            linear_sgemm_f32(rt, x, w, y, (m, n, k), rounding)?;
        }
        Ok(())
    })?;
    Ok(Row {
        op: op.to_string(),
        m,
        n: groups * n,
        k,
        micros,
        bytes: (groups * (n * k + m * k + m * n) * 4) as f64,
        flops: (2 * m * groups * n * k) as f64,
        peak_flops: BF16_FLOPS,
    })
}

/// The per-token ops of `CudaBackend` at real widths, one token each.
fn bench_token_ops(rt: &KernelRuntime, timer: &mut Timer) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    // Sink attention: 64 heads x 512, 640 keys (128 window + 512 selected), one query, its key
    // rows read through a key table as `CudaBackend::sparse_attention_rows` reads them.
    let (heads, head_dim, keys) = (64usize, 512usize, 640usize);
    let q = f32_values(rt, 21, heads * head_dim)?;
    let kv = f32_values(rt, 22, keys * head_dim)?;
    let sink = f32_values(rt, 23, heads)?;
    let mut out = rt.stream().alloc_zeros::<f32>(heads * head_dim)?;
    let addresses = (0..keys)
        .map(|r| key_row_address(rt, &kv, r * head_dim, head_dim))
        .collect::<Result<Vec<_>, _>>()?;
    // SAFETY: every address is a head_dim row of `kv`, which outlives the table (declared
    // first, dropped last) and every launch (the timer waits for the end of its last batch).
    let table = unsafe { DeviceKeyTable::upload(rt, &addresses, head_dim) }?;
    let all_keys: Vec<u32> = (0..keys as u32).collect();
    let lists = DeviceKeyLists::upload(rt, &[all_keys], keys)?;
    let attention = AttentionRows {
        q: &q,
        lists: &lists,
        sink: &sink,
        head_dim,
        scale: 0.044,
        rounding: Rounding::Bf16,
    };
    let micros = time_launches(rt, timer, |_| {
        Ok(sparse_attention_sink_rows_f32(
            rt,
            attention,
            KeyRows::Table(&table),
            &mut out,
        )?)
    })?;
    rows.push(Row {
        op: "attention sink rows".to_string(),
        m: 1,
        n: keys,
        k: head_dim,
        micros,
        bytes: ((2 * heads * head_dim + keys * head_dim) * 4 + keys * 12) as f64,
        flops: (4 * heads * keys * head_dim) as f64,
        peak_flops: BF16_FLOPS,
    });
    // Indexer: 64 heads x 128 against 4096 compressed keys.
    let (heads, head_dim, keys) = (64usize, 128usize, 4096usize);
    let q = f32_values(rt, 24, heads * head_dim)?;
    let w = f32_values(rt, 25, heads)?;
    let kk = f32_values(rt, 26, keys * head_dim)?;
    let mut scores = rt.stream().alloc_zeros::<f32>(keys)?;
    let micros = time_launches(rt, timer, |_| {
        Ok(index_scores_f32(
            rt,
            &q,
            &w,
            &kk,
            &mut scores,
            head_dim,
            Rounding::Bf16,
        )?)
    })?;
    rows.push(Row {
        op: "index scores".to_string(),
        m: 1,
        n: keys,
        k: head_dim,
        micros,
        bytes: ((heads * head_dim + keys * head_dim + keys) * 4) as f64,
        flops: (2 * heads * keys * head_dim) as f64,
        peak_flops: BF16_FLOPS,
    });
    // mHC: 4 streams of 5120.
    let (hc, dim) = (4usize, 5120usize);
    let n = hc * dim;
    let projections = (2 + hc) * hc;
    let x = f32_values(rt, 27, n)?;
    let proj = f32_values(rt, 28, projections * n)?;
    let base = f32_values(rt, 29, projections)?;
    let scale = f32_values(rt, 30, 3)?;
    let mut mix = rt.stream().alloc_zeros::<f32>(2 * hc + hc * hc)?;
    let config = HcMixesConfig {
        hc,
        sinkhorn_iters: 20,
        hc_eps: 1e-6,
        norm_eps: 1e-6,
    };
    let micros = time_launches(rt, timer, |_| {
        Ok(hc_mixes_rows_f32(
            rt,
            &x,
            x.len(),
            &proj,
            &base,
            &scale,
            &mut mix,
            config,
        )?)
    })?;
    rows.push(Row {
        op: "hc_mixes".to_string(),
        m: 1,
        n: projections,
        k: n,
        micros,
        bytes: ((projections * n + n) * 4) as f64,
        flops: (2 * projections * n) as f64,
        peak_flops: BF16_FLOPS,
    });
    let y = f32_values(rt, 31, dim)?;
    let coefficients = f32_values(rt, 32, 2 * hc + hc * hc)?;
    let mut expanded = rt.stream().alloc_zeros::<f32>(n)?;
    let micros = time_launches(rt, timer, |_| {
        Ok(hc_expand_rows_f32(
            rt,
            &y,
            &x,
            &coefficients,
            &mut expanded,
            hc,
            Rounding::Bf16,
        )?)
    })?;
    rows.push(Row {
        op: "hc_expand".to_string(),
        m: 1,
        n: hc,
        k: dim,
        micros,
        bytes: ((dim + 2 * n) * 4) as f64,
        flops: (2 * hc * n) as f64,
        peak_flops: BF16_FLOPS,
    });
    // Q8 QDQ of one token's window KV entry and of 64 of them.
    for entries in [1usize, 64] {
        let mut kv = f32_values(rt, 33, entries * 512)?;
        let micros = time_launches(rt, timer, |_| Ok(qdq_f32(rt, &mut kv, QdqPoint::Q8)?))?;
        rows.push(Row {
            op: "q8 qdq".to_string(),
            m: entries,
            n: 0,
            k: 512,
            micros,
            bytes: (entries * 512 * 8) as f64,
            flops: 0.0,
            peak_flops: BF16_FLOPS,
        });
    }
    Ok(rows)
}

/// The real V4.1 vocabulary, the width of a sampled logit row.
const SAMPLE_VOCAB: usize = 129_280;

/// Logit rows shaped like a language model's: a bell-shaped bulk (sum of four uniforms, standard
/// deviation ~3) and a few strong candidates 6 to 12 above it.
fn sample_logits(seed: u64, rows: usize, vocab: usize) -> Vec<f32> {
    let mut state = seed;
    let mut uniform = move || (splitmix64(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
    let mut logits = Vec::with_capacity(rows * vocab);
    for _ in 0..rows {
        for _ in 0..vocab {
            let bulk = (uniform() + uniform() + uniform() + uniform() - 2.0) * 5.2;
            let strong = if uniform() < 2e-4 {
                6.0 + 6.0 * uniform()
            } else {
                0.0
            };
            logits.push(bulk + strong);
        }
    }
    logits
}

/// Token sampling (`sample_rows_f32`) at the real vocabulary for 1, 12 and 64 rows: greedy, plain
/// temperature, top-k 50, top-p 0.9 and a mix of all of them (each row with its own seed).
fn bench_sampling(rt: &KernelRuntime, timer: &mut Timer, quick: bool) -> Result<Vec<Row>> {
    let vocab = SAMPLE_VOCAB;
    let row = |i: usize, temperature: f32, top_k: u32, top_p: f32| SampleRow {
        seed: 0x5eed + i as u64,
        position: 1000 + i as u64,
        temperature,
        top_p,
        top_k,
        reserved: 0,
    };
    type RowMaker = fn(usize) -> (f32, u32, f32);
    let cases: [(&str, RowMaker); 5] = [
        ("sample greedy", |_| (0.0, 0, 1.0)),
        ("sample T1.3", |_| (1.3, 0, 1.0)),
        ("sample topk50", |_| (1.0, 50, 1.0)),
        ("sample topp0.9", |_| (0.7, 0, 0.9)),
        ("sample mixed", |i| {
            let temperatures = [0.0, 0.7, 1.3];
            let top_ks = [0, 50];
            let top_ps = [0.9, 0.95, 1.0];
            (
                temperatures[i % 3],
                top_ks[(i / 3) % 2],
                top_ps[(i / 6) % 3],
            )
        }),
    ];
    let row_counts: &[usize] = if quick { &[1, 64] } else { &[1, 12, 64] };
    let mut out = Vec::new();
    for &rows in row_counts {
        let logits = rt
            .stream()
            .clone_htod(&sample_logits(77 + rows as u64, rows, vocab))?;
        let mut scratch = SampleScratch::new(rt, rows, vocab, true)?;
        let mut tokens = rt.stream().alloc_zeros::<u32>(rows)?;
        for (name, make) in cases {
            let host_rows: Vec<SampleRow> = (0..rows)
                .map(|i| {
                    let (t, k, p) = make(i);
                    row(i, t, k, p)
                })
                .collect();
            let device_rows = rt.stream().clone_htod(&host_rows)?;
            let micros = time_launches(rt, timer, |_| {
                Ok(sample_rows_f32(
                    rt,
                    &logits,
                    &device_rows,
                    &host_rows,
                    &mut scratch,
                    &mut tokens,
                    vocab,
                )?)
            })?;
            out.push(Row {
                op: name.to_string(),
                m: rows,
                n: vocab,
                k: 0,
                micros,
                bytes: (rows * vocab * 4) as f64,
                flops: 0.0,
                peak_flops: BF16_FLOPS,
            });
        }
    }
    Ok(out)
}

/// Times every op at M = 1, 8, 64 (M = 1 only when `quick`), the GEMM work splits too with
/// `sweep`, and prints the table.
pub fn run(quick: bool, sweep: bool) -> Result<()> {
    let rt = KernelRuntime::open(0).context("opening the CUDA device")?;
    let report = rt.report();
    println!(
        "device: {} ({}); {} modules compiled by NVRTC in {:.0} ms, {} from the cache",
        report.device_name,
        report.arch,
        report.modules_compiled,
        report.compile_ms,
        report.modules_from_cache
    );
    let rt = &rt;

    let mut timer = Timer::new(rt, quick)?;
    let mut rows = Vec::new();
    let batch_sizes: &[usize] = if quick { &[1] } else { &[1, 8, 64] };
    for &m in batch_sizes {
        for (name, format, n, k) in GEMMS {
            rows.push(bench_gemm(
                rt,
                &mut timer,
                name,
                format,
                m,
                n,
                k,
                GemmSplit::Auto,
            )?);
        }
        rows.push(bench_act_quant(rt, &mut timer, m, 5120)?);
        rows.push(bench_rms_norm(rt, &mut timer, m, 5120)?);
        rows.push(bench_linear(
            rt,
            &mut timer,
            ("linear sgemm f32", Rounding::F32),
            (m, 1, 384, 5120),
        )?);
    }
    rows.extend(bench_routed(rt, &mut timer, quick)?);
    rows.extend(bench_token_ops(rt, &mut timer)?);
    rows.extend(bench_sampling(rt, &mut timer, quick)?);
    // The work split (warps per output column, or one warp per column: `cpw`) changes speed only,
    // never the bits: with `--sweep`, time every split for the decode shapes (what
    // `GemmSplit::Auto` is tuned from).
    for m in [1usize, 8].into_iter().filter(|_| sweep) {
        let splits = [1u32, 2, 4, 8]
            .map(GemmSplit::WarpsPerColumn)
            .into_iter()
            .chain([GemmSplit::ColumnPerWarp]);
        for split in splits {
            for (name, format, n, k) in GEMMS.into_iter().take(3) {
                rows.push(bench_gemm(rt, &mut timer, name, format, m, n, k, split)?);
            }
        }
    }

    print_rows(&rows);
    println!(
        "\nroofline = max(bytes / 4.28 TB/s, FLOPs / peak) / time; peak = 1216 TFLOP/s (FP8 tensor cores) for the GEMMs, \
         790 TFLOP/s for the rest. The GEMM kernels run on the fp32 CUDA cores (exact K-order sums), not tensor cores; \
         the reference-order kernels (linear, attention, indexer, mHC) reproduce the CPU's sequential sums \
         (one thread per chain), a correctness-first baseline."
    );
    Ok(())
}

/// Prints `rows` as the per-op table (time, bytes, throughput, roofline ratio).
pub(crate) fn print_rows(rows: &[Row]) {
    println!();
    println!(
        "{:<22} {:>5} {:>6} {:>5} {:>9} {:>9} {:>8} {:>8} {:>7} {:>9} {:>8}",
        "op", "M", "N", "K", "time_us", "MB", "GB/s", "TFLOP/s", "%HBM", "floor_us", "roofline"
    );
    for r in rows {
        let seconds = r.micros * 1e-6;
        println!(
            "{:<22} {:>5} {:>6} {:>5} {:>9.2} {:>9.3} {:>8.0} {:>8.2} {:>6.1}% {:>9.2} {:>7.1}%",
            r.op,
            r.m,
            r.n,
            r.k,
            r.micros,
            r.bytes / 1e6,
            r.bytes / seconds / 1e9,
            r.flops / seconds / 1e12,
            100.0 * r.bytes / seconds / COPY_BYTES_PER_S,
            r.floor_micros(),
            100.0 * r.floor_micros() / r.micros,
        );
    }
}
