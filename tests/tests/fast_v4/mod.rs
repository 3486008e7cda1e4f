//! The V4 family in the `fast` numerics (`model/src/backend/cuda/dense.rs`, `v4.rs`,
//! kernels/README.md): V4 keeps float32 activations, so its GEMMs write the fp32 sum as it is
//! (f32 outputs, no bf16 rounding) from activations quantised to E4M3 on the device.
//!
//! - The fast GEMMs with f32 outputs (FP8 128×128 tiles with 1×128 activation groups, FP4 with
//!   1×32): every output within its bound of the f64 value on the device's own quantised
//!   activations, every tile and a second run the same bits, the bf16 output of the same launch
//!   exactly the f32 output rounded once (one sum, two stores) and `RoundedToBf16`'s f32 storage
//!   exactly the bf16 output's values, from every tile; a row alone equals itself inside
//!   batches of 2 … 300 rows (negative control: a one-element change is seen).
//! - V4's routed experts on the fast routed chain (FP4 experts, rows in 1×32 groups; SwiGLU with
//!   V4's clamp and route weight before `w2`; the FP8 shared expert with 128×128 tiles; the
//!   combine in increasing expert id, then the shared expert; everything in fp32): every GEMM
//!   within its bound on its own quantised input, the combined output within the bound
//!   propagated through the fp32 additions; every tile the same bits; a token alone equals
//!   itself among 2 … 64 tokens routed to overlapping experts (negative control).
//! - `CudaBackend::linear` (V4's projections): exact numerics bitwise the CPU with no
//!   tensor-core launch; fast numerics the very kernels above (bitwise equal to launching them
//!   directly) with tensor-core launches, within their bounds; an FP8 weight whose K is not
//!   whole 128-tiles keeps the exact kernel.
//! - A quantised V4 checkpoint (`ModelConfig::reduced_v4`: FP8 linears, FP4 experts, hash and
//!   top-k MoE layers) in fast numerics: rule 4 of `fixtures/v41/README.md` against the CPU,
//!   deterministic, batch invariant (negative control), and its projections, MoE and sink
//!   attention (f32 operands in two bf16 pieces: `fast_attention/mod.rs`) on tensor cores.
//!
//! Bounds (derived in `kernels/src/ops/gemm_fast.rs`; never fitted to output): with `S = Σ_g s_a
//! s_w Σ_{k ∈ g} |a_k w_k|`, `e = ((G − 1) 2^-13 + (K/G + P − 1) 2^-24 (1 + 2^-8)) S` — the
//! tensor core keeps ≥ 13 fraction bits in its in-group additions, each promotion and each
//! addition of a K part's sum rounds once in fp32 — and no output term for an f32 output. The
//! fast bf16 linear (`kernels/src/ops/linear_fast.rs`): `e = (17 ⌈K/16⌉ + 8) 2^-23 Σ|x̃ w|` on
//! the bf16 operands `x̃ = bf16(x)` the kernel converts. The combine of `n` f32 terms `y_i`
//! (each within `b_i`) added in fp32 from zero: `Σ b_i + n 2^-24 Σ (|y_i| + b_i)`.

use std::collections::BTreeMap;

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::CudaSlice;
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::gemm_fast::{FastTile, RoundedToBf16, gemm_fp8_fast, k_parts};
use deepinfer_kernels::ops::linear_fast::{FastBf16Weight, FastProduct, linear_bf16_fast};
use deepinfer_kernels::ops::quant::{ActGroup, DeviceActFp8, quantize_act_fp8};
use deepinfer_kernels::ops::routed::{
    ExpertProjection, moe_combine, swiglu_act_quant_fp8, swiglu_rows,
};
use deepinfer_model::LogitsWanted;
use deepinfer_model::any_model::AnyModel;
use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::backend::weights::Linear;
use deepinfer_model::backend::{Backend, CpuBackend, Tensor};
use deepinfer_model::checkpoint::{Checkpoint, write_random_checkpoint};
use deepinfer_model::config::{ExpertDtype, ModelConfig};
use deepinfer_model::quant;
use half::bf16;

use crate::gpu_support::gemm_data::{activations, random_fp4_weight, random_fp8_weight};
use crate::gpu_support::{Rng, bf16_unit, differing, prompt};
use crate::{
    FastMoe, FastWeight, HostWeight, LIMIT, RoutedFast, TILES, assert_within, download_act,
    exact_output, exact_rows, fast_linear, nudged, random_routes, routed_fast, run_gemm,
    slot_groups, upload_fp4, upload_fp8,
};

/// `rows × cols` float32 activations of a wide dynamic range: [`activations`] (magnitudes 2^-12
/// .. 2^6, exact zeros, a tiny group, a zero group) with their low 16 mantissa bits randomised,
/// so that they are not bf16 values (V4 keeps float32 activations).
fn f32_activations(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x = activations(rng, rows, cols);
    for v in x.iter_mut().filter(|v| **v != 0.0) {
        *v = f32::from_bits(v.to_bits() ^ rng.below(1 << 16) as u32);
    }
    x
}

/// `x` (`rows` f32 rows) quantised on the device in `group`s, as the backend does.
fn quantise(rt: &KernelRuntime, x: &[f32], rows: usize, group: ActGroup) -> DeviceActFp8 {
    let dx = rt.htod(x).expect("upload x");
    quantize_act_fp8(rt, &dx, rows, x.len() / rows, group).expect("quantise")
}

fn run_f32(rt: &KernelRuntime, a: &DeviceActFp8, w: &impl FastWeight, tile: FastTile) -> Vec<f32> {
    run_gemm::<f32, _>(rt, a, w, tile, |v| v)
}

/// The fast GEMM of `w` with f32 outputs at M = 1, 7, 64, 130 (every tile's range) on f32
/// activations quantised on the device: within the bound of every output, the same bits from
/// every tile and run after run, and the bf16 output of the same launch the f32 one rounded once.
fn check_f32_gemm(
    rt: &KernelRuntime,
    rng: &mut Rng,
    what: &str,
    w: &impl HostWeight,
    dw: &impl FastWeight,
) {
    let (n, k) = (w.out(), w.inp());
    let group = dw.group();
    let (_, parts) = k_parts(n, k);
    for rows in [1usize, 7, 64, 130] {
        let x = f32_activations(rng, rows, k);
        let a = quantise(rt, &x, rows, group);
        let (exact, bound) = exact_rows(
            &download_act(rt, &a),
            rows,
            |r| r,
            |_| Some(w),
            (n, k, group.elements()),
            (parts, Rounding::F32),
        );
        let y = run_f32(rt, &a, dw, FastTile::Auto);
        let what = format!("{what} [{rows}x{k}]·[{k}x{n}] ({parts} K parts), f32 out");
        assert_within(&what, &y, &exact, &bound);
        for tile in TILES {
            let other = run_f32(rt, &a, dw, tile);
            assert_eq!(
                differing(&other, &y),
                0,
                "{what}: {tile:?} gives other bits"
            );
        }
        let again = run_f32(rt, &a, dw, FastTile::Auto);
        assert_eq!(differing(&again, &y), 0, "{what}: a second run differs");
        let as_bf16 = run_gemm::<bf16, _>(rt, &a, dw, FastTile::Auto, bf16::to_f32);
        let rounded: Vec<f32> = y.iter().map(|&v| quant::round_bf16(v)).collect();
        assert_eq!(
            differing(&as_bf16, &rounded),
            0,
            "{what}: the bf16 output is not the f32 output rounded once"
        );
        // The third store: f32 storage of the bf16-rounded values (V4.1's fast dense GEMMs),
        // the bf16 output's values exactly, from every tile.
        for tile in TILES {
            let mut y = rt.stream().alloc_zeros::<f32>(rows * n).expect("alloc y");
            dw.gemm(rt, &a, &mut RoundedToBf16(&mut y), tile);
            let stored = rt.stream().clone_dtoh(&y).expect("download y");
            assert_eq!(
                differing(&stored, &as_bf16),
                0,
                "{what}: {tile:?} RoundedToBf16 does not store the bf16 output's values"
            );
        }
    }
}

#[test]
fn fast_v4_gemms_write_f32_within_their_bound_and_every_tile_gives_the_same_bits() {
    let rt = crate::open();
    let mut rng = Rng(51);
    // V4's FP8 projections (128x128 tiles): n not a multiple of a block's features, one, two
    // (131 x 1024) and four (1024 x 2048) K parts: the part reduction writes f32 too.
    for (n, k) in [(200usize, 384usize), (131, 1024), (1024, 2048)] {
        let w = random_fp8_weight(&mut rng, n, k, 128);
        check_f32_gemm(&rt, &mut rng, "fast gemm t128", &w, &upload_fp8(&rt, &w));
    }
    // FP4 (1x32 scales): k not a multiple of 128, a wide one.
    for (n, k) in [(203usize, 544usize), (1152, 512)] {
        let w = random_fp4_weight(&mut rng, n, k);
        check_f32_gemm(&rt, &mut rng, "fast fp4 gemm", &w, &upload_fp4(&rt, &w));
    }
}

/// A row alone against the same row inside batches of 2 … 300 rows of other data, f32 outputs:
/// bitwise equal; the comparison sees a one-element change of the row.
fn check_f32_batch_invariance(rt: &KernelRuntime, rng: &mut Rng, what: &str, dw: &impl FastWeight) {
    let (n, k) = dw.shape();
    let group = dw.group();
    let probe = f32_activations(rng, 1, k);
    let alone = run_f32(rt, &quantise(rt, &probe, 1, group), dw, FastTile::Auto);
    for batch in [2usize, 3, 8, 9, 31, 33, 64, 65, 300] {
        let mut x = f32_activations(rng, batch, k);
        let at = (batch * 7 / 11).min(batch - 1);
        x[at * k..(at + 1) * k].copy_from_slice(&probe);
        let y = run_f32(rt, &quantise(rt, &x, batch, group), dw, FastTile::Auto);
        assert_eq!(
            differing(&y[at * n..(at + 1) * n], &alone),
            0,
            "{what}: the probe row differs alone and at row {at} of {batch}"
        );
    }
    let changed = run_f32(
        rt,
        &quantise(rt, &nudged(&probe), 1, group),
        dw,
        FastTile::Auto,
    );
    assert!(
        differing(&changed, &alone) > 0,
        "{what}: the invariance check cannot see a changed input"
    );
    println!("{what}: a row alone is bitwise itself inside 9 batches of 2..300 rows (f32 out)");
}

#[test]
fn fast_v4_gemms_are_batch_invariant() {
    let rt = crate::open();
    let mut rng = Rng(52);
    let w = random_fp8_weight(&mut rng, 131, 1024, 128);
    check_f32_batch_invariance(&rt, &mut rng, "fast gemm t128", &upload_fp8(&rt, &w));
    let w = random_fp4_weight(&mut rng, 203, 544);
    check_f32_batch_invariance(&rt, &mut rng, "fast fp4 gemm", &upload_fp4(&rt, &w));
}

// ---------------------------------------------------------------------------------------------
// V4's routed experts on the fast routed chain.

/// What the V4 chain computed, downloaded: the tokens quantised in 32-groups (routed) and in
/// 128-groups (shared), each slot's gate and up, its quantised hidden row and its `w2` output,
/// the shared expert's gate, quantised hidden and output, and the combined output (all f32).
struct V4ChainRun {
    x: (Vec<u8>, Vec<f32>),
    shared_x: (Vec<u8>, Vec<f32>),
    shared_gate: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    hidden: (Vec<u8>, Vec<f32>),
    routed: Vec<f32>,
    shared_hidden: (Vec<u8>, Vec<f32>),
    shared: Vec<f32>,
    out: Vec<f32>,
}

/// The V4 MoE of `CudaBackend::moe_rows_exact` in fast numerics on `tokens` f32 rows `x` with
/// the routes `ids` / `route_weights`: the rows quantised in 32-groups, routed `w1`/`w3` (FP4,
/// f32 out, `tile`), SwiGLU (V4's clamp) times the route weight in fp32, quantised, routed `w2`;
/// the shared expert's FP8 128×128 projections on 128-group activations (f32 out), its SwiGLU in
/// fp32; the combine in fp32.
fn run_v4_chain(
    rt: &KernelRuntime,
    moe: &FastMoe,
    x: &[f32],
    ids: &[u32],
    route_weights: &[f32],
    tile: FastTile,
) -> V4ChainRun {
    let (dim, inter) = (moe.dim, moe.inter);
    let tokens = x.len() / dim;
    let slots = ids.len();
    let stream = rt.stream();
    let download = |y: &CudaSlice<f32>| stream.clone_dtoh(y).expect("download");
    let a = quantise(rt, x, tokens, ActGroup::G32);
    let ids_d = stream.clone_htod(ids).expect("ids");
    let weights_d = stream.clone_htod(route_weights).expect("route weights");
    let groups = slot_groups(rt, moe, &ids_d, tile);
    let routed = |x: &DeviceActFp8, x_row_div: usize, which: ExpertProjection, width: usize| {
        routed_fast::<f32>(
            rt,
            moe,
            &groups,
            RoutedFast {
                x,
                x_row_div,
                which,
                width,
            },
        )
    };
    let gate = routed(&a, slots / tokens, ExpertProjection::W1, inter);
    let up = routed(&a, slots / tokens, ExpertProjection::W3, inter);
    let mut a_hidden = DeviceActFp8::alloc(rt, slots, inter, ActGroup::G32).expect("alloc");
    let weights = Some(&weights_d);
    swiglu_act_quant_fp8(
        rt,
        &gate.slice(..),
        &up.slice(..),
        weights,
        LIMIT,
        Rounding::F32,
        &mut a_hidden,
    )
    .expect("swiglu, quantised");
    let routed_out = routed(&a_hidden, 1, ExpertProjection::W2, dim);

    let dense = |x: &DeviceActFp8, i: usize| {
        let w = &moe.shared_device[i];
        let mut y = stream.alloc_zeros::<f32>(x.rows * w.out).expect("alloc");
        gemm_fp8_fast(rt, x, w, &mut y, FastTile::Auto).expect("gemm_fp8_fast");
        y
    };
    let a_shared = quantise(rt, x, tokens, ActGroup::G128);
    let (s_gate, s_up) = (dense(&a_shared, 0), dense(&a_shared, 1));
    let mut s_hidden = stream.alloc_zeros::<f32>(tokens * inter).expect("alloc");
    swiglu_rows(
        rt,
        &s_gate,
        &s_up,
        None,
        LIMIT,
        Rounding::F32,
        &mut s_hidden,
    )
    .expect("swiglu");
    let a_sh = quantize_act_fp8(rt, &s_hidden, tokens, inter, ActGroup::G128).expect("q");
    let shared = dense(&a_sh, 2);

    let mut out = stream.alloc_zeros::<f32>(tokens * dim).expect("alloc");
    let n_experts = moe.n_experts();
    moe_combine(
        rt,
        &routed_out,
        &ids_d,
        n_experts,
        &shared,
        dim,
        Rounding::F32,
        &mut out,
    )
    .expect("combine");
    V4ChainRun {
        x: download_act(rt, &a),
        shared_x: download_act(rt, &a_shared),
        shared_gate: download(&s_gate),
        gate: download(&gate),
        up: download(&up),
        hidden: download_act(rt, &a_hidden),
        routed: download(&routed_out),
        shared_hidden: download_act(rt, &a_sh),
        shared: download(&shared),
        out: download(&out),
    }
}

/// Checks every GEMM of `run` within its f32-output bound on its own quantised input (unknown
/// experts' rows zero) and the combined output against the f64 sum of the exact slot and shared
/// outputs within `Σ b + n 2^-24 Σ (|y| + b)` (`n` f32 terms added in fp32, no rounding after).
/// Returns the largest |error| / bound.
fn check_v4_chain(moe: &FastMoe, ids: &[u32], run: &V4ChainRun, what: &str) -> f64 {
    let (dim, inter) = (moe.dim, moe.inter);
    let slots = ids.len();
    let tokens = run.out.len() / dim;
    let k = slots / tokens;
    let f32_out = Rounding::F32;
    let expert = |slot: usize, which: usize| moe.experts.get(ids[slot] as usize).map(|e| &e[which]);
    let mut worst = 0.0f64;
    for (name, got, which) in [("w1", &run.gate, 0), ("w3", &run.up, 1)] {
        let launch = (1, f32_out);
        let (exact, bound) = exact_rows(
            &run.x,
            slots,
            |s| s / k,
            |s| expert(s, which),
            (inter, dim, 32),
            launch,
        );
        let what = format!("{what}: routed {name}");
        worst = worst.max(assert_within(&what, got, &exact, &bound));
    }
    let (routed_exact, routed_bound) = exact_rows(
        &run.hidden,
        slots,
        |s| s,
        |s| expert(s, 2),
        (dim, inter, 32),
        (1, f32_out),
    );
    worst = worst.max(assert_within(
        &format!("{what}: routed w2"),
        &run.routed,
        &routed_exact,
        &routed_bound,
    ));
    // The shared gate on the 128-group tokens, and its w2 on its own quantised hidden rows.
    let (gate_exact, gate_bound) = exact_rows(
        &run.shared_x,
        tokens,
        |t| t,
        |_| Some(&moe.shared[0]),
        (inter, dim, 128),
        (k_parts(inter, dim).1, f32_out),
    );
    worst = worst.max(assert_within(
        &format!("{what}: shared w1"),
        &run.shared_gate,
        &gate_exact,
        &gate_bound,
    ));
    let (shared_exact, shared_bound) = exact_rows(
        &run.shared_hidden,
        tokens,
        |t| t,
        |_| Some(&moe.shared[2]),
        (dim, inter, 128),
        (k_parts(dim, inter).1, f32_out),
    );
    worst = worst.max(assert_within(
        &format!("{what}: shared w2"),
        &run.shared,
        &shared_exact,
        &shared_bound,
    ));
    let (mut exact, mut bound) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        for n in 0..dim {
            let terms = (t * k..(t + 1) * k)
                .filter(|&s| (ids[s] as usize) < moe.n_experts())
                .map(|s| (routed_exact[s * dim + n], routed_bound[s * dim + n]))
                .chain([(shared_exact[t * dim + n], shared_bound[t * dim + n])]);
            let (mut y, mut e, mut magnitude, mut count) = (0.0f64, 0.0f64, 0.0f64, 0usize);
            for (v, b) in terms {
                y += v;
                e += b;
                magnitude += v.abs() + b;
                count += 1;
            }
            exact.push(y);
            bound.push(e + count as f64 * 2f64.powi(-24) * magnitude);
        }
    }
    worst.max(assert_within(
        &format!("{what}: combined output"),
        &run.out,
        &exact,
        &bound,
    ))
}

#[test]
fn fast_v4_routed_experts_are_within_their_bounds_and_every_tile_gives_the_same_bits() {
    let rt = crate::open();
    let mut rng = Rng(53);
    let mut worst = 0.0f64;
    // (experts, dim, inter, top-k, token counts): widths of whole 128-tiles (the shared expert's
    // FP8 tiles), not multiples of a block's features; up to 70 tokens (tiles of 8 … 128 rows).
    for (n_experts, dim, inter, k, token_counts) in [
        (
            16usize,
            256usize,
            128usize,
            4usize,
            &[1usize, 5, 33, 70][..],
        ),
        (24, 512, 384, 6, &[1, 9, 64][..]),
    ] {
        let moe = FastMoe::new(&rt, &mut rng, (n_experts, dim, inter), 128);
        for &tokens in token_counts {
            let x = f32_activations(&mut rng, tokens, dim);
            let (mut ids, weights) = random_routes(&mut rng, tokens, k, n_experts, None);
            if tokens > 1 {
                // An unknown id (dropped: zero rows, skipped by the combine) and a repeated one
                // (a hash layer may name an expert twice).
                ids[k - 1] = (n_experts + 3) as u32;
                ids[2 * k - 1] = ids[k];
            }
            let what = format!("V4 {n_experts} experts {dim}->{inter} top-{k}, {tokens} tokens");
            let run = run_v4_chain(&rt, &moe, &x, &ids, &weights, FastTile::Auto);
            worst = worst.max(check_v4_chain(&moe, &ids, &run, &what));
            for tile in TILES {
                let other = run_v4_chain(&rt, &moe, &x, &ids, &weights, tile);
                assert!(
                    differing(&other.routed, &run.routed) == 0
                        && differing(&other.out, &run.out) == 0,
                    "{what}: {tile:?} gives other bits than Auto"
                );
            }
            let again = run_v4_chain(&rt, &moe, &x, &ids, &weights, FastTile::Auto);
            assert_eq!(
                differing(&again.out, &run.out),
                0,
                "{what}: not deterministic"
            );
        }
    }
    println!("V4 fast routed experts: largest |error| / bound {worst:.3}");
}

#[test]
fn fast_v4_routed_experts_are_batch_invariant() {
    let rt = crate::open();
    let mut rng = Rng(54);
    let (n_experts, dim, inter, k) = (16usize, 256usize, 128usize, 4usize);
    let moe = FastMoe::new(&rt, &mut rng, (n_experts, dim, inter), 128);
    // Every token routed among 6 experts: the probe's experts serve many other rows too.
    let pool: Vec<u32> = (0..6).collect();
    let probe = f32_activations(&mut rng, 1, dim);
    let (probe_ids, probe_weights) = random_routes(&mut rng, 1, k, n_experts, Some(&pool));
    let run = |x: &[f32], ids: &[u32], weights: &[f32]| {
        run_v4_chain(&rt, &moe, x, ids, weights, FastTile::Auto).out
    };
    let alone = run(&probe, &probe_ids, &probe_weights);
    for tokens in [2usize, 9, 33, 64] {
        let mut x = f32_activations(&mut rng, tokens, dim);
        let (mut ids, mut weights) = random_routes(&mut rng, tokens, k, n_experts, Some(&pool));
        let at = tokens / 2;
        x[at * dim..(at + 1) * dim].copy_from_slice(&probe);
        ids[at * k..(at + 1) * k].copy_from_slice(&probe_ids);
        weights[at * k..(at + 1) * k].copy_from_slice(&probe_weights);
        let out = run(&x, &ids, &weights);
        assert_eq!(
            differing(&out[at * dim..(at + 1) * dim], &alone),
            0,
            "V4 fast MoE: the probe token differs alone and at {at} of {tokens}"
        );
    }
    let changed = run(&nudged(&probe), &probe_ids, &probe_weights);
    assert!(
        differing(&changed, &alone) > 0,
        "V4 fast MoE: the invariance check cannot see a changed input"
    );
    println!("V4 fast MoE: a token alone is bitwise itself among 2..64 tokens on 6 shared experts");
}

// ---------------------------------------------------------------------------------------------
// The backend's V4 projections.

/// `linear` of `w` on `x` by `backend` (once to upload the weight, then profiled): the output
/// and the op's tensor-core launches.
fn profiled_linear(backend: &CudaBackend, x: &[f32], w: &Linear) -> (Vec<f32>, u64) {
    let profile = backend.op_profile();
    backend.linear(&Tensor::from(x.to_vec()), w);
    profile.set_enabled(true);
    let y = backend.linear(&Tensor::from(x.to_vec()), w).into_vec();
    profile.set_enabled(false);
    let stats = profile.take();
    (y, stats.get("linear").map_or(0, |s| s.tensor_core_launches))
}

#[test]
fn the_backend_takes_the_fast_v4_linears_in_fast_numerics_only() {
    let rt = crate::open();
    let mut rng = Rng(55);
    let cpu = CpuBackend::new();
    let exact = CudaBackend::open(0, Numerics::Exact).expect("the CUDA device");
    let fast = CudaBackend::open(0, Numerics::Fast).expect("the CUDA device");
    let rows = 5usize;
    // Exact numerics: the CPU's bits, no tensor core. Returns the fast backend's output and
    // tensor-core launches.
    let both = |x: &[f32], w: &Linear, what: &str| {
        let (exact_y, exact_tc) = profiled_linear(&exact, x, w);
        let reference = cpu.linear(&Tensor::from(x.to_vec()), w).into_vec();
        assert_eq!(
            differing(&exact_y, &reference),
            0,
            "{what}: exact is not the CPU's"
        );
        assert_eq!(
            exact_tc, 0,
            "{what}: exact numerics launched a tensor-core kernel"
        );
        profiled_linear(&fast, x, w)
    };

    // FP8 128x128 (two K parts) and FP4: the backend's output is the direct launch's, bitwise,
    // within the bound on the device-quantised activations.
    let fp8 = random_fp8_weight(&mut rng, 256, 1024, 128);
    let fp4 = random_fp4_weight(&mut rng, 192, 512);
    let cases: [(&str, Linear, ActGroup); 2] = [
        ("FP8 t128", Linear::Fp8(fp8.clone()), ActGroup::G128),
        ("FP4", Linear::Fp4(fp4.clone()), ActGroup::G32),
    ];
    for (what, w, group) in cases {
        let (n, k) = match &w {
            Linear::Fp8(w) => (w.out, w.inp),
            Linear::Fp4(w) => (w.out, w.inp),
            Linear::Dense { out, inp, .. } => (*out, *inp),
        };
        let x = f32_activations(&mut rng, rows, k);
        let (y, launches) = both(&x, &w, what);
        let a = quantise(&rt, &x, rows, group);
        let direct = match &w {
            Linear::Fp8(_) => run_f32(&rt, &a, &upload_fp8(&rt, &fp8), FastTile::Auto),
            _ => run_f32(&rt, &a, &upload_fp4(&rt, &fp4), FastTile::Auto),
        };
        assert_eq!(
            differing(&y, &direct),
            0,
            "{what}: not the fast kernel's bits"
        );
        let act = download_act(&rt, &a);
        let (_, parts) = k_parts(n, k);
        let launch = (parts, Rounding::F32);
        let bound_of = |r: usize, o: usize| -> (f64, f64) {
            let (codes, scales) = (
                &act.0[r * k..(r + 1) * k],
                &act.1[r * k / group.elements()..],
            );
            match &w {
                Linear::Fp8(_) => exact_output(codes, scales, &fp8, o, launch),
                _ => exact_output(codes, scales, &fp4, o, launch),
            }
        };
        let (exact_values, bound): (Vec<f64>, Vec<f64>) = (0..rows)
            .flat_map(|r| (0..n).map(move |o| (r, o)))
            .map(|(r, o)| bound_of(r, o))
            .unzip();
        assert_within(
            &format!("backend fast linear {what}"),
            &y,
            &exact_values,
            &bound,
        );
        assert!(
            launches >= 1,
            "{what}: fast numerics launched no tensor-core kernel"
        );
        println!("backend linear {what}: fast on {launches} tensor-core launches");
    }

    // Dense (bf16-valued weights, f32 activations): the fast bf16 linear with f32 outputs.
    let (out, inp) = (96usize, 4096usize);
    let values = bf16_unit(&mut rng, out * inp);
    let dense = Linear::Dense {
        out,
        inp,
        values: values.clone(),
    };
    let x = f32_activations(&mut rng, rows, inp);
    let (y, launches) = both(&x, &dense, "dense");
    let dw = FastBf16Weight::upload(&rt, out, inp, &values).expect("upload");
    let mut direct = rt.stream().alloc_zeros::<f32>(rows * out).expect("alloc");
    let dx = rt.htod(&x).expect("upload x");
    linear_bf16_fast(
        &rt,
        &dx,
        &dw,
        &mut direct,
        rows,
        None,
        FastProduct::Bf16(Rounding::F32),
    )
    .expect("linear");
    let direct = rt.stream().clone_dtoh(&direct).expect("download");
    assert_eq!(
        differing(&y, &direct),
        0,
        "dense: not the fast kernel's bits"
    );
    let x_bf16: Vec<f32> = x.iter().map(|&v| quant::round_bf16(v)).collect();
    let (exact_values, bound) =
        fast_linear::exact_and_bound(&x_bf16, rows, &values, (out, inp), Rounding::F32);
    assert_within("backend fast linear dense", &y, &exact_values, &bound);
    assert!(
        launches >= 1,
        "dense: fast numerics launched no tensor-core kernel"
    );

    // An FP8 weight whose K is not whole 128-tiles keeps the exact kernel in fast numerics.
    let odd = Linear::Fp8(random_fp8_weight(&mut rng, 64, 160, 128));
    let x = f32_activations(&mut rng, rows, 160);
    let (y, launches) = profiled_linear(&fast, &x, &odd);
    let reference = cpu.linear(&Tensor::from(x), &odd).into_vec();
    assert_eq!(
        differing(&y, &reference),
        0,
        "FP8 K = 160: not the exact kernel's bits"
    );
    assert_eq!(launches, 0, "FP8 K = 160 launched a tensor-core kernel");
}

// ---------------------------------------------------------------------------------------------
// Whole V4 models.

/// Asserts that `ops` of a prompt's prefill of the model `load` builds launched tensor-core
/// kernels on a fast backend and that no op did on an exact one (the op profile).
pub(crate) fn assert_fast_path_taken(
    what: &str,
    ops: &[&str],
    load: impl Fn(Box<CudaBackend>) -> (AnyModel, Vec<u32>),
) {
    let tensor_core_launches = |numerics: Numerics| -> BTreeMap<&'static str, u64> {
        let backend = Box::new(CudaBackend::open(0, numerics).expect("the CUDA device"));
        let profile = backend.op_profile();
        let (model, tokens) = load(backend);
        let mut seq = model.new_sequence();
        profile.set_enabled(true);
        deepinfer_tests::forward(&model, &mut seq, &tokens, LogitsWanted::All).expect("prefill");
        profile.set_enabled(false);
        let stats = profile.take();
        stats
            .into_iter()
            .map(|(op, s)| (op, s.tensor_core_launches))
            .collect()
    };
    let fast = tensor_core_launches(Numerics::Fast);
    for op in ops {
        let launches = fast.get(op).copied().unwrap_or(0);
        assert!(
            launches > 0,
            "{what}: fast {op} launched no tensor-core kernel"
        );
    }
    let exact = tensor_core_launches(Numerics::Exact);
    let on_tensor_cores: Vec<_> = exact.iter().filter(|(_, n)| **n > 0).collect();
    assert!(
        on_tensor_cores.is_empty(),
        "{what}: exact numerics launched tensor-core kernels in {on_tensor_cores:?}"
    );
    println!(
        "{what}: tensor-core launches of a fast prefill by op {:?}; none in exact numerics",
        fast.iter().filter(|(_, n)| **n > 0).collect::<Vec<_>>()
    );
}

/// A random V4 checkpoint in the official quantised format (`ModelConfig::reduced_v4`: FP8
/// linears with 128×128 tiles, FP4 routed experts, hash and top-k MoE layers) on `backend`, and
/// a prompt of 41 tokens.
fn quantised_v4(dir: &std::path::Path, backend: Box<dyn Backend>) -> (AnyModel, Vec<u32>) {
    let cfg = ModelConfig::reduced_v4();
    let ckpt = Checkpoint::open(dir).expect("checkpoint");
    let tokens = prompt(7, 41, cfg.vocab_size);
    let model = AnyModel::from_checkpoint(cfg, &ckpt, None, backend).expect("model");
    (model, tokens)
}

/// The probe's logits of two steps of `model`: a fresh sequence prefilling `probe` beside fresh
/// sequences prefilling `others` (the probe is entry `at`), then every sequence decoding one
/// token (the probe token 17): the probe's prefill and decode logits.
fn probe_logits(model: &AnyModel, probe: &[u32], others: &[Vec<u32>], at: usize) -> Vec<f32> {
    use deepinfer_model::any_model::{AnyStepEntry, StepOptions};
    let mut seqs: Vec<_> = (0..=others.len()).map(|_| model.new_sequence()).collect();
    let mut feeds: Vec<Vec<u32>> = others.to_vec();
    feeds.insert(at, probe.to_vec());
    let mut logits = Vec::new();
    for _ in 0..2 {
        let mut entries: Vec<AnyStepEntry<'_>> = seqs
            .iter_mut()
            .zip(&feeds)
            .map(|(seq, tokens)| AnyStepEntry::new(seq, tokens, LogitsWanted::All))
            .collect();
        let mut outputs = model
            .forward_step(&mut entries, StepOptions::default())
            .expect("step");
        logits.extend(
            outputs
                .remove(at)
                .into_logits()
                .expect("the probe's logits"),
        );
        // The decode tokens: the probe's the same wherever it stands, the others' their own.
        feeds = (0..seqs.len())
            .map(|s| {
                vec![if s == at {
                    17
                } else {
                    (23 + 5 * s as u32) % 97
                }]
            })
            .collect();
    }
    logits
}

/// A quantised V4 checkpoint in fast numerics: its FP8 projections, FP4 experts and f32 sink
/// attention on tensor cores (`linear`, `moe_rows_exact`, `sparse_attention_rows`), rule 4 against the CPU reference on its prompt,
/// deterministic, and a sequence's prefill and decode logits bitwise equal alone and beside
/// 2 … 9 others of different lengths (negative control: another prompt token is seen).
#[test]
fn quantised_v4_fast_takes_the_tensor_cores_meets_the_rule_and_is_batch_invariant() {
    let cfg = ModelConfig::reduced_v4();
    assert_eq!(cfg.quant.expert_dtype, ExpertDtype::Fp4);
    let dir = tempfile::tempdir().expect("tempdir");
    write_random_checkpoint(&cfg, 45, dir.path(), 2).expect("checkpoint written");
    let load = |backend: Box<CudaBackend>| quantised_v4(dir.path(), backend);
    assert_fast_path_taken(
        "quantised V4",
        &["linear", "moe_rows_exact", "sparse_attention_rows"],
        load,
    );

    let (fast, tokens) = quantised_v4(dir.path(), crate::fast_backend());
    let (cpu, _) = quantised_v4(dir.path(), Box::new(CpuBackend::new()));
    crate::check_rule("quantised V4", &fast, &cpu, &tokens);

    let alone = probe_logits(&fast, &tokens, &[], 0);
    for batch in [2usize, 5, 9] {
        let others: Vec<Vec<u32>> = (0..batch)
            .map(|i| prompt(i as u32 + 11, 3 + (i * 7) % 29, cfg.vocab_size))
            .collect();
        let beside = probe_logits(&fast, &tokens, &others, batch / 2);
        assert_eq!(
            differing(&beside, &alone),
            0,
            "quantised V4 fast: the probe's logits differ alone and beside {batch} sequences"
        );
    }
    let mut changed = tokens.clone();
    changed[20] = (changed[20] + 1) % cfg.vocab_size as u32;
    assert!(
        differing(&probe_logits(&fast, &changed, &[], 0), &alone) > 0,
        "quantised V4 fast: the invariance check cannot see another token"
    );
}
