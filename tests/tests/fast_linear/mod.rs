//! The `fast` bf16 linear (`ops::linear_fast`, tensor cores) against an f64 computation of its
//! bf16 operands within the bound derived in `kernels/src/ops/linear_fast.rs`
//! (`e = (17 · ⌈K / 16⌉ + PARTS) · 2^-23 · Σ|x w|`, plus `2^-8 (|y| + e)` for the bf16 output);
//! every tile gives the same bits, run after run — the wide prefill tile and its one-part form
//! too, on rows, outputs and inputs off their block and chunk sizes, grouped and not, and on the
//! real `wo_a` at 1024 rows;
//! a row alone equals itself inside batches of 2 … 300 rows (negative control: a one-element
//! change is seen); and `CudaBackend::linear_bf16`
//! takes it in `fast` numerics while `exact` stays bitwise the CPU reference. The grouped form
//! (`wo_a`'s groups in one launch) gives each group the bits of its linear alone, and
//! `CudaBackend::linear_grouped_bf16` is that one launch in `fast` numerics and the CPU's bits in
//! `exact`.
//!
//! The split-x bf16x3 linear (`FastProduct::SplitBf16x3`, the `fast` `linear_f32`), at V4.1's
//! router gate (5120 → 384) and compressor (5120 → 512) shapes and odd ones: within
//! `e = (105 · ⌈K / 256⌉ + 5) · 2^-23 · Σ|x w|` of the f64 value of the f32 `x` and the bf16 `w`,
//! on random data and on data whose exponents span 2^-40 … 2^40; the bf16 linear breaks that bound
//! on data whose bf16 rounding errors add up (negative control); every tile the same bits at 1,
//! 7, 64 and 1024 rows, a row alone equal to itself inside batches; and `CudaBackend::linear_f32`
//! (and `sample_linear`'s logits) takes it in `fast` numerics for a weight of bf16 values only.

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::linear_fast::{
    FastBf16Weight, FastLinearTile, FastProduct, PARTS, linear_bf16_fast,
};
use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::backend::{Backend, CpuBackend, DenseWeight, Groups, RowSampling, Tensor};
use deepinfer_model::quant;
use deepinfer_model::sampling::SamplingParams;

use crate::gpu_support::{Rng, bf16_unit, differing};

/// `rows × inp` bf16 values in f32 storage, of mixed magnitudes and signs.
fn bf16_values(rng: &mut Rng, count: usize) -> Vec<f32> {
    let mut values = bf16_unit(rng, count);
    // Every 7th ×16 (exact in bf16): products of mixed magnitudes.
    values.iter_mut().step_by(7).for_each(|v| *v *= 16.0);
    values
}

/// The linear with bf16 outputs, in the tile it picks (`None`) or in `tile`.
fn run(
    rt: &KernelRuntime,
    x: &[f32],
    rows: usize,
    w: &FastBf16Weight,
    tile: Option<FastLinearTile>,
) -> Vec<f32> {
    run_product(rt, x, rows, w, tile, FastProduct::Bf16(Rounding::Bf16))
}

/// The linear `product`, in the tile it picks (`None`) or in `tile`.
fn run_product(
    rt: &KernelRuntime,
    x: &[f32],
    rows: usize,
    w: &FastBf16Weight,
    tile: Option<FastLinearTile>,
    product: FastProduct,
) -> Vec<f32> {
    let dx = rt.htod(x).expect("upload x");
    // NaN: an output the kernel leaves unwritten is seen.
    let mut dy = rt.htod(&vec![f32::NAN; rows * w.out]).expect("alloc y");
    linear_bf16_fast(rt, &dx, w, &mut dy, rows, tile, product).expect("linear_bf16_fast");
    rt.stream().clone_dtoh(&dy).expect("download y")
}

/// The exact value (f64) of every output of `x · wᵀ` and its `Σ_k |x_k w_k|`.
fn exact_and_magnitudes(
    x: &[f32],
    rows: usize,
    w: &[f32],
    (out, inp): (usize, usize),
) -> Vec<(f64, f64)> {
    let mut outputs = Vec::with_capacity(rows * out);
    for r in 0..rows {
        let xr = &x[r * inp..(r + 1) * inp];
        for o in 0..out {
            let wr = &w[o * inp..(o + 1) * inp];
            let (mut y, mut s) = (0.0f64, 0.0f64);
            for (a, b) in xr.iter().zip(wr) {
                let p = f64::from(*a) * f64::from(*b);
                y += p;
                s += p.abs();
            }
            outputs.push((y, s));
        }
    }
    outputs
}

/// The exact values (f64) of `x · wᵀ` and each output's bound.
pub(crate) fn exact_and_bound(
    x: &[f32],
    rows: usize,
    w: &[f32],
    (out, inp): (usize, usize),
    output: Rounding,
) -> (Vec<f64>, Vec<f64>) {
    let steps = inp.div_ceil(16) as f64;
    let unit = (17.0 * steps + PARTS as f64) * 2f64.powi(-23);
    exact_and_magnitudes(x, rows, w, (out, inp))
        .into_iter()
        .map(|(y, s)| {
            let e = unit * s;
            let bound = match output {
                Rounding::Bf16 => e + 2f64.powi(-8) * (y.abs() + e),
                Rounding::F32 => e,
            };
            (y, bound)
        })
        .unzip()
}

#[test]
fn fast_bf16_linear_is_within_its_bound_and_every_tile_gives_the_same_bits() {
    let rt = crate::open();
    let mut rng = Rng(41);
    // (out, inp): inp not a multiple of the 32-element chunk or of PARTS chunks, out not a
    // multiple of a warp's columns; the real grouped wo_a (1024 × 4096).
    for (out, inp) in [(203usize, 544usize), (37, 70), (64, 8), (1024, 4096)] {
        let w = bf16_values(&mut rng, out * inp);
        let dw = FastBf16Weight::upload(&rt, out, inp, &w).expect("upload w");
        for rows in [1usize, 7, 16, 17, 64, 65, 130] {
            let x = bf16_values(&mut rng, rows * inp);
            let (exact, bound) = exact_and_bound(&x, rows, &w, (out, inp), Rounding::Bf16);
            let got = run(&rt, &x, rows, &dw, None);
            crate::assert_within(
                &format!("fast bf16 linear [{rows}x{inp}]·[{inp}x{out}]"),
                &got,
                &exact,
                &bound,
            );
            for tile in FastLinearTile::ALL {
                let other = run(&rt, &x, rows, &dw, Some(tile));
                assert_eq!(
                    differing(&other, &got),
                    0,
                    "[{out}x{inp}] M={rows}: the tile {tile:?} gives other bits"
                );
            }
            let again = run(&rt, &x, rows, &dw, None);
            assert_eq!(differing(&again, &got), 0, "M={rows}: a second run differs");
        }
    }
}

#[test]
fn fast_bf16_linear_is_batch_invariant() {
    let rt = crate::open();
    let mut rng = Rng(42);
    let (out, inp) = (300usize, 1000usize);
    let w = bf16_values(&mut rng, out * inp);
    let dw = FastBf16Weight::upload(&rt, out, inp, &w).expect("upload w");
    let probe = bf16_values(&mut rng, inp);
    let alone = run(&rt, &probe, 1, &dw, None);
    for batch in [2usize, 3, 16, 17, 31, 64, 65, 300] {
        let mut x = bf16_values(&mut rng, batch * inp);
        let at = (batch * 7 / 11).min(batch - 1);
        x[at * inp..(at + 1) * inp].copy_from_slice(&probe);
        let y = run(&rt, &x, batch, &dw, None);
        assert_eq!(
            differing(&y[at * out..(at + 1) * out], &alone),
            0,
            "the probe row differs alone and at row {at} of {batch}"
        );
    }
    let mut nudged = probe.clone();
    nudged[inp / 2] = -nudged[inp / 2] + 1.0;
    let y = run(&rt, &nudged, 1, &dw, None);
    assert!(
        differing(&y, &alone) > 0,
        "the invariance check cannot see a changed input"
    );
    println!(
        "fast bf16 linear: a row alone is bitwise equal to itself in 8 batches of 2..300 rows"
    );
}

/// The wide prefill tile and its one-part form give, output for output, the bits of the one-row
/// tile (T1x1) on the same rows, with bf16 and f32 outputs and for the split-x bf16x3 product,
/// on f32 inputs off bf16 (the tiles split x into its pieces each their own way: the bf16
/// product's rounding and the split-x product's second and third pieces are all seen): rows off
/// its 128-row blocks, outputs off its 256 columns, inp off the 32-element chunk (a multiple of
/// 4: 16-byte loads; not: 4-byte loads; fewer chunks than K parts: empty parts), grouped and
/// not; and on the real grouped `wo_a` (8 groups of [1024, 4096]) at 1024 rows, where
/// `linear_bf16_fast` takes it.
#[test]
fn the_wide_tile_gives_the_bits_of_the_one_row_tile() {
    let rt = crate::open();
    let mut rng = Rng(46);
    let odd = [
        (1usize, 203usize, 544usize),
        (1, 300, 1000),
        (1, 520, 77),
        (1, 37, 70),
        (1, 64, 8),
        (3, 37, 70),
        (2, 300, 1001),
    ];
    let shapes = odd
        .iter()
        .flat_map(|&shape| [65usize, 200, 300].map(|rows| (shape, rows)));
    for ((groups, out, inp), rows) in shapes.chain([((8, 1024, 4096), 1024)]) {
        let w = bf16_values(&mut rng, groups * out * inp);
        let dw =
            FastBf16Weight::upload_grouped(&rt, groups, groups * out, inp, &w).expect("upload w");
        let x = f32_values(&mut rng, rows * groups * inp);
        assert!(
            !x.iter().all(|&v| quant::round_bf16(v) == v),
            "inputs off bf16"
        );
        for output in [
            FastProduct::Bf16(Rounding::Bf16),
            FastProduct::Bf16(Rounding::F32),
            FastProduct::SplitBf16x3,
        ] {
            let one = run_product(&rt, &x, rows, &dw, Some(FastLinearTile::T1x1), output);
            assert!(
                one.iter().all(|v| v.is_finite()),
                "{groups} x [{out}x{inp}] M={rows}: T1x1 left outputs unwritten"
            );
            for tile in [FastLinearTile::Wide, FastLinearTile::WidePart] {
                let wide = run_product(&rt, &x, rows, &dw, Some(tile), output);
                assert_eq!(
                    differing(&wide, &one),
                    0,
                    "{groups} x [{out}x{inp}] M={rows} {output:?}: {tile:?} differs from T1x1"
                );
            }
        }
        if rows == 1024 {
            let picked = run(&rt, &x, rows, &dw, None);
            let wide = run(&rt, &x, rows, &dw, Some(FastLinearTile::Wide));
            assert_eq!(differing(&picked, &wide), 0, "wo_a at 1024 rows");
        }
    }
}

/// `CudaBackend::linear_bf16` in `fast` numerics is the tensor-core linear (one launch, within
/// its bound; on bf16 outputs it mostly rounds to the CPU's bits, so the launches tell the
/// paths apart: the exact kernel is two, partials and their tree); in `exact` numerics it stays
/// bitwise the CPU reference.
#[test]
fn the_backend_takes_the_fast_bf16_linear_in_fast_numerics_only() {
    let mut rng = Rng(43);
    let (rows, out, inp) = (5usize, 96usize, 4096usize);
    let w = bf16_values(&mut rng, out * inp);
    let x = bf16_values(&mut rng, rows * inp);
    let cpu = CpuBackend::new();
    let exact = CudaBackend::open(0, Numerics::Exact).expect("the CUDA device");
    let fast = CudaBackend::open(0, Numerics::Fast).expect("the CUDA device");
    let launches = |backend: &CudaBackend, run: &dyn Fn(&CudaBackend) -> Vec<f32>| {
        let profile = backend.op_profile();
        run(backend); // uploads the weight
        profile.set_enabled(true);
        let y = run(backend);
        profile.set_enabled(false);
        let stats = profile.take();
        (y, stats.get("linear_bf16").map_or(0, |s| s.launches))
    };
    let weight = DenseWeight {
        values: &w,
        out,
        inp,
    };
    let bf16_linear = |b: &CudaBackend| b.linear_bf16(&Tensor::from(x.clone()), weight).into_vec();
    let reference = cpu.linear_bf16(&Tensor::from(x.clone()), weight).into_vec();
    let (exact_y, exact_launches) = launches(&exact, &bf16_linear);
    assert_eq!(
        differing(&exact_y, &reference),
        0,
        "exact linear_bf16 is not the CPU's"
    );
    let (fast_y, fast_launches) = launches(&fast, &bf16_linear);
    let (values, bound) = exact_and_bound(&x, rows, &w, (out, inp), Rounding::Bf16);
    crate::assert_within("backend fast linear_bf16", &fast_y, &values, &bound);
    println!(
        "backend linear_bf16: exact {exact_launches} launches, fast {fast_launches}; {} of {} fast \
         outputs differ from the CPU's bits",
        differing(&fast_y, &reference),
        fast_y.len()
    );
    assert!(
        fast_launches == 1 && exact_launches >= 2,
        "linear_bf16 launches: exact {exact_launches}, fast {fast_launches} (the fast path is one)"
    );
}

/// The columns `[g · inp, (g + 1) · inp)` of `rows` rows of `x [rows, groups · inp]`.
fn group_columns(x: &[f32], rows: usize, groups: usize, inp: usize, g: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| {
            x[(r * groups + g) * inp..(r * groups + g + 1) * inp]
                .iter()
                .copied()
        })
        .collect()
}

/// A grouped weight in one launch gives every group the bits of that group's linear launched
/// alone on its columns (the real `wo_a`: 8 groups of [1024, 4096]; and odd sizes: inp off the
/// chunk, a group's rows off a warp's columns), for every tile.
#[test]
fn grouped_fast_bf16_linear_gives_each_group_the_bits_of_its_linear_alone() {
    let rt = crate::open();
    let mut rng = Rng(44);
    for (groups, out, inp) in [(8usize, 1024usize, 4096usize), (3, 37, 70), (5, 64, 544)] {
        let w = bf16_values(&mut rng, groups * out * inp);
        let grouped = FastBf16Weight::upload_grouped(&rt, groups, groups * out, inp, &w)
            .expect("upload the grouped weight");
        let alone: Vec<FastBf16Weight> = (0..groups)
            .map(|g| {
                FastBf16Weight::upload(&rt, out, inp, &w[g * out * inp..(g + 1) * out * inp])
                    .expect("upload a group")
            })
            .collect();
        for rows in [1usize, 7, 64, 65, 130] {
            let x = bf16_values(&mut rng, rows * groups * inp);
            let got = run(&rt, &x, rows, &grouped, None);
            assert_eq!(got.len(), rows * groups * out);
            for (g, weight) in alone.iter().enumerate() {
                let expect = run(
                    &rt,
                    &group_columns(&x, rows, groups, inp, g),
                    rows,
                    weight,
                    None,
                );
                let ours: Vec<f32> = (0..rows)
                    .flat_map(|r| {
                        got[(r * groups + g) * out..(r * groups + g + 1) * out]
                            .iter()
                            .copied()
                    })
                    .collect();
                assert_eq!(
                    differing(&ours, &expect),
                    0,
                    "{groups} groups of [{out}x{inp}], M={rows}: group {g} differs from its linear alone"
                );
            }
            for tile in FastLinearTile::ALL {
                let other = run(&rt, &x, rows, &grouped, Some(tile));
                assert_eq!(
                    differing(&other, &got),
                    0,
                    "{groups} groups, M={rows}: the tile {tile:?} gives other bits"
                );
            }
        }
    }
    let err = FastBf16Weight::upload_grouped(&rt, 3, 10, 4, &[0.0; 40])
        .err()
        .expect("3 groups do not divide 10 rows");
    assert!(
        err.to_string().contains("3 groups must divide out = 10"),
        "{err}"
    );
}

/// `CudaBackend::linear_grouped_bf16`: `fast` numerics runs the groups in one launch, each group
/// bitwise the backend's fast `linear_bf16` of its columns; `exact` numerics is bitwise the CPU
/// reference (the groups one by one).
#[test]
fn the_backend_runs_the_grouped_linear_in_one_launch_in_fast_numerics() {
    let mut rng = Rng(45);
    let (rows, groups, out, inp) = (5usize, 8usize, 64usize, 512usize);
    let w = bf16_values(&mut rng, groups * out * inp);
    let x = bf16_values(&mut rng, rows * groups * inp);
    let cpu = CpuBackend::new();
    let exact = CudaBackend::open(0, Numerics::Exact).expect("the CUDA device");
    let fast = CudaBackend::open(0, Numerics::Fast).expect("the CUDA device");
    let grouped = |b: &dyn Backend| {
        b.linear_grouped_bf16(&Tensor::from(x.clone()), &w, Groups { groups, out, inp })
            .into_vec()
    };
    let reference = grouped(&cpu);
    assert_eq!(
        differing(&grouped(&exact), &reference),
        0,
        "exact linear_grouped_bf16 is not the CPU's"
    );
    let profile = fast.op_profile();
    grouped(&fast); // uploads the weight
    profile.set_enabled(true);
    let fast_y = grouped(&fast);
    profile.set_enabled(false);
    let launches = profile
        .take()
        .get("linear_grouped_bf16")
        .map_or(0, |s| s.launches);
    assert_eq!(launches, 1, "fast linear_grouped_bf16 launches");
    for g in 0..groups {
        let alone = fast
            .linear_bf16(
                &Tensor::from(group_columns(&x, rows, groups, inp, g)),
                DenseWeight {
                    values: &w[g * out * inp..(g + 1) * out * inp],
                    out,
                    inp,
                },
            )
            .into_vec();
        let ours: Vec<f32> = (0..rows)
            .flat_map(|r| {
                fast_y[(r * groups + g) * out..(r * groups + g + 1) * out]
                    .iter()
                    .copied()
            })
            .collect();
        assert_eq!(
            differing(&ours, &alone),
            0,
            "fast group {g} differs from its linear_bf16"
        );
    }
}

// The split-x bf16x3 linear (`FastProduct::SplitBf16x3`): the `fast` `linear_f32`.

/// V4.1's fp32 linears `(out, inp)`: the MoE router gate and the ratio-2 compressor's `wkv`
/// (`wgate` has its shape).
const F32_LINEARS: [(usize, usize); 2] = [(384, 5120), (512, 5120)];

/// The exact values (f64) of `x · wᵀ` (`x` f32, `w` bf16) and each output's split-x bound
/// (`kernels/src/ops/linear_fast.rs`): `e = (105 · ⌈K / 256⌉ + 5) · 2^-23 · Σ|x w|`.
fn split_exact_and_bound(
    x: &[f32],
    rows: usize,
    w: &[f32],
    (out, inp): (usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let unit = (105.0 * inp.div_ceil(256) as f64 + 5.0) * 2f64.powi(-23);
    exact_and_magnitudes(x, rows, w, (out, inp))
        .into_iter()
        .map(|(y, s)| (y, unit * s))
        .unzip()
}

/// `count` f32 values in [-1, 1) (24-bit significands, not bf16 values), every 7th × 16.
fn f32_values(rng: &mut Rng, count: usize) -> Vec<f32> {
    let mut values: Vec<f32> = (0..count).map(|_| rng.uniform()).collect();
    values.iter_mut().step_by(7).for_each(|v| *v *= 16.0);
    values
}

/// `count` values `±m · 2^e`, `m` in [1, 2) (24-bit significands), `e` uniform in `lo..=hi`;
/// rounded to bf16 when `bf16`.
fn wide_range_values(rng: &mut Rng, count: usize, (lo, hi): (i32, i32), bf16: bool) -> Vec<f32> {
    (0..count)
        .map(|_| {
            let m = 1.5 + rng.uniform() / 2.0;
            let e = lo + rng.below((hi - lo + 1) as u64) as i32;
            let sign = if rng.below(2) == 0 { 1.0 } else { -1.0 };
            let v = sign * m * 2f32.powi(e);
            if bf16 { quant::round_bf16(v) } else { v }
        })
        .collect()
}

/// The split-x linear is within its bound of the f64 value of its f32 input and bf16 weight: at
/// V4.1's router and compressor shapes and odd ones (inp off the chunk and the K parts, out off a
/// warp's columns), at 1, 7 and 64 rows, on random values and on values whose exponents span
/// 2^-40 … 2^40 (weights 2^-20 … 2^6).
#[test]
fn split_x_linear_is_within_its_bound() {
    let rt = crate::open();
    let mut rng = Rng(47);
    let shapes = F32_LINEARS
        .into_iter()
        .chain([(203, 544), (37, 70), (64, 8)]);
    for (out, inp) in shapes {
        for wide in [false, true] {
            let w = if wide {
                wide_range_values(&mut rng, out * inp, (-20, 6), true)
            } else {
                bf16_values(&mut rng, out * inp)
            };
            let dw = FastBf16Weight::upload(&rt, out, inp, &w).expect("upload w");
            for rows in [1usize, 7, 64] {
                let x = if wide {
                    wide_range_values(&mut rng, rows * inp, (-40, 40), false)
                } else {
                    f32_values(&mut rng, rows * inp)
                };
                let (exact, bound) = split_exact_and_bound(&x, rows, &w, (out, inp));
                let got = run_product(&rt, &x, rows, &dw, None, FastProduct::SplitBf16x3);
                let data = if wide { "wide range" } else { "random" };
                crate::assert_within(
                    &format!("split-x linear, {data} [{rows}x{inp}]·[{inp}x{out}]"),
                    &got,
                    &exact,
                    &bound,
                );
            }
        }
    }
}

/// Negative control of the bound: on inputs whose bf16 rounding errors all point one way
/// (`x = 2^e (1 + 3 · 2^-9)`, which bf16 rounds to `2^e (1 + 2^-7)`; positive weights) the bf16
/// linear misses the split-x bound at every output of the router shape (by about
/// `2^-9 Σ|x w|` against `2105 · 2^-23 Σ|x w|`), while the split-x linear keeps it on the same
/// data.
#[test]
fn the_bf16_linear_breaks_the_split_x_bound() {
    let rt = crate::open();
    let mut rng = Rng(48);
    let ((out, inp), rows) = (F32_LINEARS[0], 7usize);
    let w: Vec<f32> = bf16_values(&mut rng, out * inp)
        .iter()
        .map(|v| v.abs())
        .collect();
    let dw = FastBf16Weight::upload(&rt, out, inp, &w).expect("upload w");
    let x: Vec<f32> = (0..rows * inp)
        .map(|_| 2f32.powi(rng.below(17) as i32 - 8) * (1.0 + 3.0 * 2f32.powi(-9)))
        .collect();
    let (exact, bound) = split_exact_and_bound(&x, rows, &w, (out, inp));
    let split = run_product(&rt, &x, rows, &dw, None, FastProduct::SplitBf16x3);
    crate::assert_within(
        "split-x linear, one-sided bf16 rounding errors",
        &split,
        &exact,
        &bound,
    );
    let one_piece = run_product(&rt, &x, rows, &dw, None, FastProduct::Bf16(Rounding::F32));
    let inside = one_piece
        .iter()
        .zip(exact.iter().zip(&bound))
        .filter(|(got, (y, e))| (f64::from(**got) - **y).abs() <= **e)
        .count();
    assert_eq!(
        inside,
        0,
        "the bf16 linear keeps the split-x bound at {inside} of {} outputs: the bound cannot \
         tell it from the split-x linear",
        one_piece.len()
    );
}

/// Determinism and batch invariance of the split-x linear at V4.1's router and compressor
/// shapes: at 1, 7, 64 and 1024 rows every tile (the decode tiles and the wide prefill tile)
/// gives the bits of the tile the shape picks, run after run; a row alone gives its bits inside
/// batches of 7, 64 and 1024 rows (at rows 5, 45 and 731), and a one-element change of it is
/// seen.
#[test]
fn split_x_linear_gives_the_same_bits_in_every_tile_and_batch() {
    let rt = crate::open();
    let mut rng = Rng(49);
    let split = FastProduct::SplitBf16x3;
    for (out, inp) in F32_LINEARS {
        let w = bf16_values(&mut rng, out * inp);
        let dw = FastBf16Weight::upload(&rt, out, inp, &w).expect("upload w");
        let probe = f32_values(&mut rng, inp);
        let alone = run_product(&rt, &probe, 1, &dw, None, split);
        for rows in [1usize, 7, 64, 1024] {
            let mut x = f32_values(&mut rng, rows * inp);
            let at = rows * 5 / 7;
            x[at * inp..(at + 1) * inp].copy_from_slice(&probe);
            let got = run_product(&rt, &x, rows, &dw, None, split);
            assert!(
                got.iter().all(|v| v.is_finite()),
                "[{out}x{inp}] M={rows}: outputs left unwritten"
            );
            assert_eq!(
                differing(&got[at * out..(at + 1) * out], &alone),
                0,
                "[{out}x{inp}]: the probe row differs alone and at row {at} of {rows}"
            );
            for tile in FastLinearTile::ALL {
                let other = run_product(&rt, &x, rows, &dw, Some(tile), split);
                assert_eq!(
                    differing(&other, &got),
                    0,
                    "[{out}x{inp}] M={rows}: the tile {tile:?} gives other bits"
                );
            }
            let again = run_product(&rt, &x, rows, &dw, None, split);
            assert_eq!(
                differing(&again, &got),
                0,
                "[{out}x{inp}] M={rows}: a second run differs"
            );
        }
        let mut nudged = probe.clone();
        nudged[inp / 2] = -nudged[inp / 2] + 1.0;
        let y = run_product(&rt, &nudged, 1, &dw, None, split);
        assert!(
            differing(&y, &alone) > 0,
            "the invariance check cannot see a changed input"
        );
    }
    println!(
        "split-x linear: router and compressor shapes, every tile the same bits at 1..1024 rows, \
         a row alone bitwise itself in batches"
    );
}

/// The kernels one call of `run` launched on `backend` (name, launches), the weight cached by a
/// call before.
fn launched_kernels<T>(backend: &CudaBackend, run: impl Fn() -> T) -> (T, Vec<(String, u64)>) {
    run();
    let timer = backend.kernel_timer();
    timer.set_enabled(true);
    let value = run();
    timer.set_enabled(false);
    let launched = timer
        .take()
        .expect("the kernel times")
        .into_iter()
        .map(|(name, stats)| (name, stats.launches))
        .collect();
    (value, launched)
}

/// `CudaBackend::linear_f32` at the router shape: in `fast` numerics a weight of bf16 values
/// takes the split-x linear (one `linear_bf16x3_fast_t1x1` launch and nothing else; the bits of
/// the kernel launched directly, within its bound), and `sample_linear` computes its logits the
/// same way; a weight with one value off bf16 keeps the exact kernel (the CPU's bits); `exact`
/// numerics gives the CPU's bits for both weights.
#[test]
fn the_backend_takes_the_split_x_linear_for_bf16_weights_in_fast_numerics() {
    let mut rng = Rng(50);
    let ((out, inp), rows) = (F32_LINEARS[0], 7usize);
    let w = bf16_values(&mut rng, out * inp);
    let mut off = w.clone();
    off[out * inp / 2] = f32::from_bits(off[out * inp / 2].to_bits() | 1);
    let xs = f32_values(&mut rng, rows * inp);
    let x = Tensor::from(xs.clone());
    let cpu = CpuBackend::new();
    let exact = CudaBackend::open(0, Numerics::Exact).expect("the CUDA device");
    let fast = CudaBackend::open(0, Numerics::Fast).expect("the CUDA device");
    let linear = |backend: &dyn Backend, values: &[f32]| {
        backend
            .linear_f32(&x, DenseWeight { values, out, inp })
            .into_vec()
    };
    for values in [&w, &off] {
        assert_eq!(
            differing(&linear(&exact, values), &linear(&cpu, values)),
            0,
            "exact linear_f32 is not the CPU's"
        );
    }

    let (y, launched) = launched_kernels(&fast, || linear(&fast, &w));
    assert_eq!(
        launched,
        [("linear_bf16x3_fast_t1x1".to_string(), 1)],
        "fast linear_f32 of a bf16 weight"
    );
    let rt = crate::open();
    let dw = FastBf16Weight::upload(&rt, out, inp, &w).expect("upload w");
    let direct = run_product(&rt, &xs, rows, &dw, None, FastProduct::SplitBf16x3);
    assert_eq!(differing(&y, &direct), 0, "not the split-x kernel's bits");
    let (values, bound) = split_exact_and_bound(&xs, rows, &w, (out, inp));
    crate::assert_within("backend fast linear_f32", &y, &values, &bound);

    let (y_off, launched) = launched_kernels(&fast, || linear(&fast, &off));
    assert!(
        !launched.is_empty()
            && launched
                .iter()
                .all(|(name, _)| name.starts_with("linear_sgemm")),
        "fast linear_f32 of a weight off bf16 launched {launched:?}"
    );
    assert_eq!(
        differing(&y_off, &linear(&cpu, &off)),
        0,
        "fast linear_f32 of a weight off bf16 is not the CPU's"
    );

    let sampling: Vec<RowSampling> = (0..rows)
        .map(|r| RowSampling {
            params: SamplingParams {
                temperature: [0.0, 0.8][r % 2],
                top_k: 0,
                top_p: [1.0, 0.9][r % 2],
                seed: 11 + r as u64,
            },
            position: 5 + r as u64,
        })
        .collect();
    let head = DenseWeight {
        values: &w,
        out,
        inp,
    };
    let (ids, launched) = launched_kernels(&fast, || {
        fast.sample_linear(&x, head, &sampling)
            .expect("sample_linear")
    });
    assert!(
        launched
            .iter()
            .any(|(name, n)| name == "linear_bf16x3_fast_t1x1" && *n == 1)
            && !launched
                .iter()
                .any(|(name, _)| name.starts_with("linear_sgemm")),
        "fast sample_linear launched {launched:?}"
    );
    assert_eq!(
        ids,
        fast.sample_rows(&y, out, &sampling).expect("sample_rows"),
        "sample_linear's ids are not those of linear_f32's logits"
    );
}
