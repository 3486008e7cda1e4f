//! GPU conformance of the indexer's selection on the device (`deepinfer_kernels::ops::topk`)
//! against the model's host definitions in `deepinfer_model::backend::select`:
//! `top_k_lowest_index` (the `k` largest scores in `f32::total_cmp` order, ties to the lower
//! index, ascending) and `candidate_mask` (level one of the two-level top-k).
//!
//! Every comparison is exact (indices and mask bytes). The scores come from small value sets
//! (many ties), with ±inf, -0.0 / 0.0 and NaNs of both signs and several payloads, from spread
//! values, and from rows where most blocks hold only -inf / NaN. Visible counts 0, 1, k-1, k, k+1,
//! 5000 and 262 144 (a long context's compressed keys) share one launch. A negative control checks
//! that the data tells the tie rule apart: ties toward the higher index give other indices.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a CUDA driver every test fails, naming why.
#![cfg(feature = "cuda")]

use std::time::Instant;

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::ops::index::DeviceVisiblePrefixes;
use deepinfer_kernels::ops::topk::{NO_INDEX, apply_mask_rows, candidate_mask_rows, top_k_rows};
use deepinfer_model::backend::select::{candidate_mask, top_k_lowest_index};

mod gpu_support;
use gpu_support::{Rng, assert_bitwise, runtime};

/// The special values every distribution mixes in: ±inf, ±0 and NaNs of both signs (quiet,
/// with payloads, and the largest-payload NaN whose total-order key is u32 max).
const SPECIALS: [f32; 8] = [
    f32::INFINITY,
    f32::NEG_INFINITY,
    0.0,
    -0.0,
    f32::NAN,
    f32::from_bits(0xffc0_0000),
    f32::from_bits(0x7f80_0001),
    f32::from_bits(0x7fff_ffff),
];

/// How a row of scores is drawn.
#[derive(Debug, Clone, Copy)]
enum Scores {
    /// Values from a set of 12 (ties everywhere), specials included.
    Ties,
    /// Mostly distinct values, one in 64 a special.
    Spread,
    /// Mostly -inf and NaN (whole candidate blocks scoring -inf), a few small values.
    MostlyNegInf,
}

impl Scores {
    const ALL: [Scores; 3] = [Scores::Ties, Scores::Spread, Scores::MostlyNegInf];

    fn draw(self, rng: &mut Rng, n: usize) -> Vec<f32> {
        let small = [-2.0f32, -1.0, 0.5, 1.0];
        (0..n)
            .map(|_| match self {
                Scores::Ties => {
                    let pick = rng.below(12) as usize;
                    if pick < SPECIALS.len() {
                        SPECIALS[pick]
                    } else {
                        small[pick - SPECIALS.len()]
                    }
                }
                Scores::Spread => {
                    if rng.below(64) == 0 {
                        SPECIALS[rng.below(SPECIALS.len() as u64) as usize]
                    } else {
                        rng.uniform() * 8.0
                    }
                }
                Scores::MostlyNegInf => match rng.below(100) {
                    0 => 1.0,
                    1 => -0.0,
                    2..=30 => f32::from_bits(0xffc0_0000),
                    _ => f32::NEG_INFINITY,
                },
            })
            .collect()
    }
}

/// A batch's rows of scores, concatenated (the `DeviceVisiblePrefixes` layout).
struct Batch {
    visible: Vec<usize>,
    rows: Vec<Vec<f32>>,
}

impl Batch {
    fn draw(rng: &mut Rng, visible: &[usize], scores: Scores) -> Batch {
        Batch {
            visible: visible.to_vec(),
            rows: visible.iter().map(|&n| scores.draw(rng, n)).collect(),
        }
    }

    fn flat(&self) -> Vec<f32> {
        let mut flat: Vec<f32> = self.rows.iter().flatten().copied().collect();
        if flat.is_empty() {
            flat.push(0.0);
        }
        flat
    }

    fn upload(&self, rt: &KernelRuntime) -> (CudaSlice<f32>, DeviceVisiblePrefixes) {
        let keys = self.visible.iter().copied().max().unwrap_or(0);
        let prefixes = DeviceVisiblePrefixes::upload(rt, &self.visible, keys).expect("prefixes");
        (
            rt.stream().clone_htod(&self.flat()).expect("scores"),
            prefixes,
        )
    }
}

/// `top_k_rows` of a batch on the device: each query's `counts[t]` indices (the padding checked).
fn device_top_k(
    rt: &KernelRuntime,
    scores: &CudaSlice<f32>,
    visible: &DeviceVisiblePrefixes,
    k: usize,
) -> Vec<Vec<usize>> {
    let queries = visible.queries();
    let mut out = rt.stream().alloc_zeros::<u32>(queries * k).expect("out");
    let mut counts = rt.stream().alloc_zeros::<u32>(queries).expect("counts");
    top_k_rows(rt, scores, visible, k, &mut out, &mut counts).expect("top_k_rows");
    let out = rt.stream().clone_dtoh(&out).expect("download out");
    let counts = rt.stream().clone_dtoh(&counts).expect("download counts");
    out.chunks_exact(k)
        .zip(&counts)
        .enumerate()
        .map(|(t, (row, &count))| {
            let count = count as usize;
            assert!(count <= k, "query {t}: count {count} > k = {k}");
            assert!(
                row[count..].iter().all(|&i| i == NO_INDEX),
                "query {t}: the padding after {count} is not u32::MAX"
            );
            row[..count].iter().map(|&i| i as usize).collect()
        })
        .collect()
}

/// Compares each query's device selection with the CPU's; returns the indices compared.
fn assert_rows_equal(what: &str, gpu: &[Vec<usize>], batch: &Batch, k: usize) -> usize {
    assert_eq!(gpu.len(), batch.rows.len(), "{what}: queries");
    let mut compared = 0;
    for (t, (row, scores)) in gpu.iter().zip(&batch.rows).enumerate() {
        let cpu = top_k_lowest_index(scores, k.min(scores.len()));
        assert_eq!(
            row.len(),
            cpu.len(),
            "{what}: query {t} (visible {}) count",
            scores.len()
        );
        if let Some(at) = row.iter().zip(&cpu).position(|(g, c)| g != c) {
            panic!(
                "{what}: query {t} (visible {}) differs first at rank {at}: gpu {} (score {:?}) vs cpu {} (score {:?})",
                scores.len(),
                row[at],
                scores[row[at]],
                cpu[at],
                scores[cpu[at]]
            );
        }
        compared += cpu.len();
    }
    compared
}

/// The visible counts of one launch for a given k: the edges around k, 0, 1, a mid size and a
/// long context's 262 144 compressed keys.
fn edge_counts(k: usize) -> Vec<usize> {
    vec![0, 1, k - 1, k, k + 1, 5000, 262_144, 3, 70_001]
}

#[test]
fn top_k_rows_matches_the_cpu_top_k() {
    let rt = runtime("top_k_rows_matches_the_cpu_top_k");
    let mut rng = Rng(7);
    let mut compared = 0usize;
    let mut launches = 0usize;
    for k in [512usize, 1024] {
        for scores in Scores::ALL {
            let batch = Batch::draw(&mut rng, &edge_counts(k), scores);
            let (device, visible) = batch.upload(&rt);
            let gpu = device_top_k(&rt, &device, &visible, k);
            compared += assert_rows_equal(&format!("k {k} {scores:?}"), &gpu, &batch, k);
            launches += 1;
        }
    }
    // Small k over small rows: every tie pattern at the boundary.
    for k in [1usize, 2, 7, 33] {
        for scores in Scores::ALL {
            let visible: Vec<usize> = (0..200)
                .map(|_| rng.below(3 * k as u64 + 2) as usize)
                .collect();
            let batch = Batch::draw(&mut rng, &visible, scores);
            let (device, prefixes) = batch.upload(&rt);
            let gpu = device_top_k(&rt, &device, &prefixes, k);
            compared += assert_rows_equal(&format!("k {k} {scores:?}"), &gpu, &batch, k);
            launches += 1;
        }
    }
    println!("top_k_rows: {compared} selected indices equal to the CPU's over {launches} launches");
}

#[test]
fn the_tie_rule_is_observable() {
    let rt = runtime("the_tie_rule_is_observable");
    // Negative control: ties toward the higher index select other indices on these rows, so a
    // kernel with the wrong tie rule fails the comparison above.
    let mut rng = Rng(11);
    let k = 512;
    let batch = Batch::draw(&mut rng, &[5000, 262_144], Scores::Ties);
    let (device, visible) = batch.upload(&rt);
    let gpu = device_top_k(&rt, &device, &visible, k);
    for (row, scores) in gpu.iter().zip(&batch.rows) {
        let mut order: Vec<usize> = (0..scores.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(b.cmp(&a)));
        order.truncate(k);
        order.sort_unstable();
        assert_ne!(
            row, &order,
            "ties toward the higher index gave the same selection"
        );
        assert_eq!(row, &top_k_lowest_index(scores, k));
    }
}

/// The device mask of a batch (the flat layout), and the device buffer.
fn device_mask(
    rt: &KernelRuntime,
    scores: &CudaSlice<f32>,
    visible: &DeviceVisiblePrefixes,
    block_size: usize,
    topk_blocks: usize,
) -> CudaSlice<u8> {
    // Poisoned: every position must be written.
    let mut mask = rt
        .stream()
        .clone_htod(&vec![7u8; visible.total().max(1)])
        .expect("mask");
    candidate_mask_rows(rt, scores, visible, block_size, topk_blocks, &mut mask)
        .expect("candidate_mask_rows");
    mask
}

/// Compares a downloaded flat mask with the CPU's per query; returns the positions compared.
fn assert_masks_equal(
    what: &str,
    flat: &[u8],
    batch: &Batch,
    block_size: usize,
    topk: usize,
) -> usize {
    let mut start = 0;
    let mut compared = 0;
    for (t, scores) in batch.rows.iter().enumerate() {
        let cpu = candidate_mask(scores, block_size, topk);
        let gpu = &flat[start..start + scores.len()];
        if let Some(at) = gpu.iter().zip(&cpu).position(|(&g, &c)| g != u8::from(c)) {
            panic!(
                "{what}: query {t} (visible {}) mask differs first at {at} (block {}): gpu {} vs cpu {}",
                scores.len(),
                at / block_size,
                gpu[at],
                cpu[at]
            );
        }
        start += scores.len();
        compared += scores.len();
    }
    compared
}

#[test]
fn candidate_mask_rows_matches_the_cpu_mask() {
    let rt = runtime("candidate_mask_rows_matches_the_cpu_mask");
    let mut rng = Rng(23);
    let mut compared = 0usize;
    let mut kept = 0usize;
    // The real config (2048 blocks of 8), and small ones where the tie pattern of blocks matters.
    for (block_size, topk_blocks) in [(8usize, 2048usize), (3, 5), (1, 4), (8, 1), (64, 3)] {
        let span = block_size * topk_blocks;
        let visible = vec![
            0,
            1,
            block_size - 1,
            block_size,
            block_size + 1,
            span - 1,
            span,
            span + 1,
            span + 5,
            5000,
            262_144,
        ];
        for scores in Scores::ALL {
            let batch = Batch::draw(&mut rng, &visible, scores);
            let (device, prefixes) = batch.upload(&rt);
            let mask = device_mask(&rt, &device, &prefixes, block_size, topk_blocks);
            let flat = rt.stream().clone_dtoh(&mask).expect("download mask");
            kept += flat.iter().filter(|&&m| m == 1).count();
            compared += assert_masks_equal(
                &format!("blocks of {block_size}, top {topk_blocks}, {scores:?}"),
                &flat,
                &batch,
                block_size,
                topk_blocks,
            );
        }
    }
    println!("candidate_mask_rows: {compared} mask positions equal to the CPU's ({kept} kept)");
}

#[test]
fn masked_two_level_top_k_matches_the_cpu() {
    let rt = runtime("masked_two_level_top_k_matches_the_cpu");
    let mut rng = Rng(31);
    let (block_size, topk_blocks, k) = (8usize, 2048usize, 512usize);
    // The candidate layer's queries see `mask_visible`; the later layer's the same or other counts
    // (longer rows keep their tail, shorter ones use a prefix of the mask).
    let mask_visible = [0usize, 1, 9, 600, 16_385, 20_000, 262_144, 5000];
    let later_visible = [3usize, 1, 9, 600, 16_385, 20_100, 262_144, 4000];
    for scores in Scores::ALL {
        let source = Batch::draw(&mut rng, &mask_visible, scores);
        let (source_device, source_prefixes) = source.upload(&rt);
        let mask = device_mask(
            &rt,
            &source_device,
            &source_prefixes,
            block_size,
            topk_blocks,
        );
        let mut later = Batch::draw(&mut rng, &later_visible, Scores::Spread);
        let (mut later_device, later_prefixes) = later.upload(&rt);
        apply_mask_rows(
            &rt,
            &mut later_device,
            &later_prefixes,
            &mask,
            &source_prefixes,
        )
        .expect("apply_mask_rows");
        let gpu_masked = rt
            .stream()
            .clone_dtoh(&later_device)
            .expect("download scores");
        // The CPU: the later layer's scores outside its query's candidates become -inf.
        for (row, source_row) in later.rows.iter_mut().zip(&source.rows) {
            let candidates = candidate_mask(source_row, block_size, topk_blocks);
            for (score, keep) in row.iter_mut().zip(&candidates) {
                if !keep {
                    *score = f32::NEG_INFINITY;
                }
            }
        }
        let cpu_masked = later.flat();
        assert_bitwise(
            &format!("{scores:?}: masked scores"),
            &gpu_masked,
            &cpu_masked,
        );
        let gpu = device_top_k(&rt, &later_device, &later_prefixes, k);
        assert_rows_equal(&format!("masked {scores:?}"), &gpu, &later, k);
    }
    println!("apply_mask_rows + top_k_rows: equal to the CPU's masked top-k");
}

#[test]
fn top_k_rows_time_at_long_context() {
    let rt = runtime("top_k_rows_time_at_long_context");
    let mut rng = Rng(41);
    let k = 512;
    for queries in [1usize, 8, 64] {
        let batch = Batch::draw(&mut rng, &vec![262_144; queries], Scores::Spread);
        let (device, visible) = batch.upload(&rt);
        let mut out = rt.stream().alloc_zeros::<u32>(queries * k).expect("out");
        let mut counts = rt.stream().alloc_zeros::<u32>(queries).expect("counts");
        let mut mask = rt
            .stream()
            .alloc_zeros::<u8>(visible.total())
            .expect("mask");
        for _ in 0..3 {
            top_k_rows(&rt, &device, &visible, k, &mut out, &mut counts).expect("warm-up");
        }
        rt.synchronize().expect("sync");
        let reps = 20;
        let start = Instant::now();
        for _ in 0..reps {
            top_k_rows(&rt, &device, &visible, k, &mut out, &mut counts).expect("top_k_rows");
        }
        rt.synchronize().expect("sync");
        let top_k_us = start.elapsed().as_secs_f64() * 1e6 / reps as f64;
        let start = Instant::now();
        for _ in 0..reps {
            candidate_mask_rows(&rt, &device, &visible, 8, 2048, &mut mask).expect("mask");
        }
        rt.synchronize().expect("sync");
        let mask_us = start.elapsed().as_secs_f64() * 1e6 / reps as f64;
        println!(
            "k = {k}, visible = 262144, {queries} queries: top_k_rows {top_k_us:.1} us, candidate_mask_rows (8 x 2048) {mask_us:.1} us per launch"
        );
        // The timed result is the CPU's too.
        let gpu = device_top_k(&rt, &device, &visible, k);
        assert_rows_equal(
            "timed",
            &gpu[..1],
            &Batch {
                visible: batch.visible[..1].to_vec(),
                rows: batch.rows[..1].to_vec(),
            },
            k,
        );
    }
}

#[test]
fn launchers_reject_bad_shapes() {
    let rt = runtime("launchers_reject_bad_shapes");
    let visible = DeviceVisiblePrefixes::upload(&rt, &[3, 5], 5).expect("prefixes");
    let scores = rt.stream().alloc_zeros::<f32>(8).expect("scores");
    let mut out = rt.stream().alloc_zeros::<u32>(2 * 4).expect("out");
    let mut counts = rt.stream().alloc_zeros::<u32>(2).expect("counts");
    let short = rt.stream().alloc_zeros::<f32>(7).expect("short");
    assert!(top_k_rows(&rt, &short, &visible, 4, &mut out, &mut counts).is_err());
    assert!(top_k_rows(&rt, &scores, &visible, 3, &mut out, &mut counts).is_err());
    assert!(top_k_rows(&rt, &scores, &visible, 0, &mut out, &mut counts).is_err());
    let mut mask = rt.stream().alloc_zeros::<u8>(8).expect("mask");
    assert!(candidate_mask_rows(&rt, &scores, &visible, 0, 4, &mut mask).is_err());
    let mut short_mask = rt.stream().alloc_zeros::<u8>(6).expect("short mask");
    assert!(candidate_mask_rows(&rt, &scores, &visible, 2, 4, &mut short_mask).is_err());
    let one = DeviceVisiblePrefixes::upload(&rt, &[3], 5).expect("one query");
    let mut scores = scores;
    let err = apply_mask_rows(&rt, &mut scores, &visible, &mask, &one).expect_err("query counts");
    assert!(err.to_string().contains("queries"), "{err}");
    top_k_rows(&rt, &scores, &visible, 4, &mut out, &mut counts).expect("the right shapes");
}
