//! The `fast` numerics on the GPU (ARCHITECTURE.md §3): the tensor-core FP8 GEMM
//! (`ops::gemm_fast`) against an f64 computation within its stated error bound, deterministic, and
//! batch invariant (a row alone and inside batches of 2 … 300 rows of other data, through every
//! tile configuration: bitwise equal; a one-input change is detected).
//!
//! The bound (derived in `kernels/src/ops/gemm_fast.rs`): for an output with exact value `y`,
//! `S = Σ_g s_a s_w Σ_{k ∈ g} |a_k w_k|` and `K / G` groups,
//! `|ŷ − y| ≤ e + 2^-9 (|y| + e)` with `e = ((G − 1) 2^-13 + (K / G) 2^-24 (1 + 2^-8)) · S`:
//! the tensor core's in-group sum keeps ≥ 13 fraction bits per addition, each promotion rounds
//! once in fp32, the output once to bf16.
//!
//! The whole v41-tiny model with `Numerics::Fast` (FP8 dense GEMMs on tensor cores, every other
//! op exact): against the CPU reference by rule 4 of `fixtures/v41/README.md` ("Comparing an
//! independent implementation": at every row each side's top token is among the other's top 5,
//! median KL(reference ‖ fast) ≤ 1e-2; teacher-forced decode rows included); the same logits
//! run after run; a sequence's prefill and decode logits bitwise equal alone and inside batched
//! steps with 2 … 64 other sequences of different lengths (negative control: another token is
//! seen).
//!
//! The fast sink attention: `fast_attention/mod.rs`.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
#![cfg(feature = "cuda")]

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::ops::gemm_fast::{FastFp8Weight, FastTile, gemm_fp8_fast_tiled};
use deepinfer_kernels::ops::quant::{ActGroup, quantize_act_fp8};
use deepinfer_model::backend::CpuBackend;
use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::checkpoint::Checkpoint;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::quant;
use deepinfer_model::weights::Fp8Weight;
use deepinfer_model::{LogitsWanted, Model, SequenceState, StepEntry};
use half::bf16;

mod fast_attention;
mod gpu_support;
use gpu_support::gemm_data::{activations, download_bf16, random_fp8_weight, upload_bf16};
use gpu_support::{Rng, differing, prompt};

const TILES: [FastTile; 4] = [
    FastTile::Rows8,
    FastTile::Rows32,
    FastTile::Rows64,
    FastTile::Rows128,
];

fn open() -> KernelRuntime {
    KernelRuntime::open(0).expect("the fast-path tests need the CUDA device")
}

fn upload(rt: &KernelRuntime, w: &Fp8Weight) -> FastFp8Weight {
    FastFp8Weight::upload(rt, w.out, w.inp, w.block, &w.data, &w.scales).expect("upload")
}

/// Quantises `x` (`rows` rows) on the device and runs the fast GEMM with `tile`.
fn fast_gemm(
    rt: &KernelRuntime,
    x: &[f32],
    rows: usize,
    w: &FastFp8Weight,
    tile: FastTile,
) -> Vec<f32> {
    let group = if w.tile == 32 {
        ActGroup::G32
    } else {
        ActGroup::G128
    };
    let q = quantize_act_fp8(rt, &upload_bf16(rt, x), rows, w.inp, group).expect("quantise");
    let mut y = rt
        .stream()
        .alloc_zeros::<bf16>(rows * w.out)
        .expect("alloc y");
    gemm_fp8_fast_tiled(rt, &q, w, &mut y, tile).expect("gemm_fp8_fast");
    download_bf16(rt, &y)
}

/// The exact value of every output (f64 over the host-quantised activations, bit-exact with the
/// device's) and the bound of each.
fn exact_and_bound(x: &[f32], rows: usize, w: &Fp8Weight) -> (Vec<f64>, Vec<f64>) {
    let (k, n, g) = (w.inp, w.out, w.block);
    let (codes, scales) = quant::quantize_act_fp8(x, g);
    let table = quant::e4m3_table();
    let scale_cols = k.div_ceil(g);
    let e8m0 = |e: u8| 2f64.powi(i32::from(e) - 127);
    let groups = k / g;
    let per_sum =
        (g - 1) as f64 * 2f64.powi(-13) + groups as f64 * 2f64.powi(-24) * (1.0 + 2f64.powi(-8));
    let (mut exact, mut bound) = (Vec::with_capacity(rows * n), Vec::with_capacity(rows * n));
    for m in 0..rows {
        for col in 0..n {
            let (mut y, mut s) = (0.0f64, 0.0f64);
            for gi in 0..groups {
                let scale = f64::from(scales[m * groups + gi])
                    * e8m0(w.scales[(col / g) * scale_cols + gi]);
                let (mut sum, mut abs) = (0.0f64, 0.0f64);
                for kk in gi * g..(gi + 1) * g {
                    let p = f64::from(table[codes[m * k + kk] as usize])
                        * f64::from(table[w.data[col * k + kk] as usize]);
                    sum += p;
                    abs += p.abs();
                }
                y += sum * scale;
                s += abs * scale;
            }
            let e = per_sum * s;
            exact.push(y);
            bound.push(e + 2f64.powi(-9) * (y.abs() + e));
        }
    }
    (exact, bound)
}

#[test]
fn fast_gemm_is_within_its_error_bound_and_every_tile_gives_the_same_bits() {
    let rt = open();
    let mut rng = Rng(31);
    // (tile, n, k): k not a multiple of 128 for 32-tiles (a partial last stage), n not a multiple
    // of a block's features; rows across every tile's range.
    for (block, n, k) in [
        (32usize, 203usize, 544usize),
        (32, 1280, 5120),
        (128, 200, 384),
        (128, 131, 1024),
    ] {
        let w = random_fp8_weight(&mut rng, n, k, block);
        let dw = upload(&rt, &w);
        for rows in [1usize, 7, 64, 130] {
            let x = activations(&mut rng, rows, k);
            let (exact, bound) = exact_and_bound(&x, rows, &w);
            let gpu = fast_gemm(&rt, &x, rows, &dw, FastTile::Auto);
            let (mut worst_ratio, mut worst_rel, mut outside) = (0.0f64, 0.0f64, 0usize);
            for i in 0..gpu.len() {
                let err = (f64::from(gpu[i]) - exact[i]).abs();
                worst_ratio = worst_ratio.max(err / bound[i].max(f64::MIN_POSITIVE));
                worst_rel = worst_rel.max(err / exact[i].abs().max(1e-30));
                if err > bound[i] {
                    outside += 1;
                }
            }
            println!(
                "fast gemm t{block} [{rows}x{k}]·[{k}x{n}]: max |err| / bound = {worst_ratio:.3}, \
                 max relative error {worst_rel:.2e}"
            );
            assert_eq!(
                outside, 0,
                "t{block} M={rows} N={n} K={k}: {outside} outputs outside the bound"
            );
            for tile in TILES {
                let other = fast_gemm(&rt, &x, rows, &dw, tile);
                assert!(
                    differing(&other, &gpu) == 0,
                    "t{block} M={rows}: {tile:?} gives other bits than Auto"
                );
            }
            let again = fast_gemm(&rt, &x, rows, &dw, FastTile::Auto);
            assert!(
                differing(&again, &gpu) == 0,
                "t{block} M={rows}: a second run differs (not deterministic)"
            );
        }
    }
}

#[test]
fn fast_gemm_is_batch_invariant() {
    let rt = open();
    let mut rng = Rng(32);
    for (block, n, k) in [(32usize, 203usize, 544usize), (128, 131, 1024)] {
        let w = random_fp8_weight(&mut rng, n, k, block);
        let dw = upload(&rt, &w);
        let probe = activations(&mut rng, 1, k);
        let alone = fast_gemm(&rt, &probe, 1, &dw, FastTile::Auto);
        let mut checked = 0;
        // The probe at several places inside batches of other data, of every size class.
        for batch in [2usize, 3, 8, 9, 31, 33, 64, 65, 300] {
            let mut x = activations(&mut rng, batch, k);
            let at = (batch * 7 / 11).min(batch - 1);
            x[at * k..(at + 1) * k].copy_from_slice(&probe);
            let y = fast_gemm(&rt, &x, batch, &dw, FastTile::Auto);
            assert!(
                differing(&y[at * n..(at + 1) * n], &alone) == 0,
                "t{block}: the probe row differs alone and at row {at} of {batch}"
            );
            checked += 1;
        }
        // Negative control: the same comparison sees a change of one input of the probe (the
        // sign of its largest element: same group scales, one code changed).
        let mut nudged = probe.clone();
        let largest = (0..k)
            .max_by(|&a, &b| nudged[a].abs().total_cmp(&nudged[b].abs()))
            .expect("k > 0");
        nudged[largest] = -nudged[largest];
        let y = fast_gemm(&rt, &nudged, 1, &dw, FastTile::Auto);
        assert!(
            differing(&y, &alone) > 0,
            "t{block}: the invariance check cannot see a changed input"
        );
        println!(
            "fast gemm t{block}: a row alone is bitwise equal to itself inside {checked} batches of \
             2..300 rows; a one-element change is detected"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The v41-tiny model in fast numerics.

/// The v41-tiny fixture on `backend` (the stub Engram vocabulary), and its prompt.
fn v41_tiny(backend: Box<dyn deepinfer_model::backend::Backend>) -> (Model, Vec<u32>) {
    let dir = deepinfer_tests::fixture_dir("v41/v41-tiny");
    assert!(
        dir.join("model.safetensors").is_file(),
        "the v41-tiny fixture is absent at {}",
        dir.display()
    );
    let cfg = ModelConfig::from_file(&dir.join("config.json")).expect("fixture config");
    let engram = cfg.engram.as_ref().expect("fixture has Engram");
    let vocab = CompressedVocab::halving_stub(cfg.vocab_size, engram.pad_token_id).expect("vocab");
    let ckpt = Checkpoint::open(&dir).expect("fixture checkpoint");
    let model = Model::from_checkpoint(cfg, &ckpt, Some(vocab), backend).expect("model");
    let case: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).expect("case.json"))
            .expect("case json");
    let tokens = case["cases"]["text"]["input_ids"]
        .as_array()
        .expect("input_ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    (model, tokens)
}

fn fast_backend() -> Box<CudaBackend> {
    Box::new(
        CudaBackend::open(0, Numerics::Fast).expect("the fast-path tests need the CUDA device"),
    )
}

/// Every logits row of the prompt, then of each teacher-forced `decode` token.
fn logits_rows(model: &Model, tokens: &[u32], decode: &[u32]) -> Vec<f32> {
    let mut seq = model.new_sequence();
    let mut out = model
        .forward(&mut seq, tokens, LogitsWanted::All)
        .expect("prefill");
    for &t in decode {
        out.extend(
            model
                .forward(&mut seq, &[t], LogitsWanted::All)
                .expect("decode"),
        );
    }
    out
}

/// Indices of the `k` largest values.
fn top(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// KL(p ‖ q) of the softmaxes of two logit rows, in f64.
fn kl(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let log_softmax = |row: &[f32]| {
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
        row.iter()
            .map(|&v| f64::from(v) - max - sum.ln())
            .collect::<Vec<f64>>()
    };
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

#[test]
fn v41_tiny_fast_meets_the_independent_implementation_rule_and_is_deterministic() {
    let (fast, tokens) = v41_tiny(fast_backend());
    let (cpu, _) = v41_tiny(Box::new(CpuBackend::new()));
    let vocab = cpu.config().vocab_size;
    // Teacher-forced decode: the CPU's greedy continuation, fed to both.
    let mut decode = Vec::new();
    let mut seq = cpu.new_sequence();
    let mut last = cpu
        .forward(&mut seq, &tokens, LogitsWanted::Last)
        .expect("cpu prefill");
    for _ in 0..4 {
        let next = top(&last, 1)[0] as u32;
        decode.push(next);
        last = cpu
            .forward(&mut seq, &[next], LogitsWanted::Last)
            .expect("cpu decode");
    }
    let reference = logits_rows(&cpu, &tokens, &decode);
    let got = logits_rows(&fast, &tokens, &decode);
    assert_eq!(got.len(), reference.len());
    let rows = reference.len() / vocab;
    let (mut kls, mut top1_equal) = (Vec::with_capacity(rows), 0);
    for r in 0..rows {
        let (a, b) = (
            &reference[r * vocab..(r + 1) * vocab],
            &got[r * vocab..(r + 1) * vocab],
        );
        let (ta, tb) = (top(a, 5), top(b, 5));
        assert!(
            tb.contains(&ta[0]) && ta.contains(&tb[0]),
            "row {r}: top tokens {} (reference) and {} (fast) are not in each other's top 5",
            ta[0],
            tb[0]
        );
        top1_equal += usize::from(ta[0] == tb[0]);
        kls.push(kl(a, b));
    }
    kls.sort_by(f64::total_cmp);
    let median = kls[rows / 2];
    let bitwise = got.len() - differing(&got, &reference);
    println!(
        "v41-tiny fast vs CPU reference ({} prompt + {} teacher-forced decode rows): top-1 equal in \
         {top1_equal}/{rows} rows, each top-1 in the other's top 5 in all rows; KL(ref ‖ fast) \
         median {median:.2e}, max {:.2e}; {bitwise}/{} logits bitwise equal to the reference",
        tokens.len(),
        decode.len(),
        kls[rows - 1],
        got.len()
    );
    assert!(median <= 1e-2, "median KL {median} exceeds 1e-2");
    let again = logits_rows(&fast, &tokens, &decode);
    assert!(
        differing(&again, &got) == 0,
        "fast logits differ run to run"
    );
}

/// The probe's logits of one step with `others` beside it (the probe is entry `at`).
fn probe_step(
    model: &Model,
    probe: &SequenceState,
    tokens: &[u32],
    others: &[(SequenceState, Vec<u32>)],
    at: usize,
) -> Vec<f32> {
    let mut probe = probe.clone();
    let mut states: Vec<SequenceState> = others.iter().map(|(s, _)| s.clone()).collect();
    let mut entries: Vec<StepEntry<'_>> = states
        .iter_mut()
        .zip(others)
        .map(|(seq, (_, t))| StepEntry {
            seq,
            tokens: t,
            want: LogitsWanted::All,
            decoder_from: None,
            sample: None,
        })
        .collect();
    entries.insert(
        at.min(entries.len()),
        StepEntry {
            seq: &mut probe,
            tokens,
            want: LogitsWanted::All,
            decoder_from: None,
            sample: None,
        },
    );
    let mut outputs = model.forward_step(&mut entries, None).expect("step");
    outputs
        .remove(at.min(others.len()))
        .into_logits()
        .expect("logits")
}

#[test]
fn v41_tiny_fast_is_batch_invariant() {
    let (model, tokens) = v41_tiny(fast_backend());
    let vocab = model.config().vocab_size;
    let fresh = model.new_sequence();
    let prefill_alone = probe_step(&model, &fresh, &tokens, &[], 0);
    let mut prefilled = model.new_sequence();
    model
        .forward(&mut prefilled, &tokens, LogitsWanted::Last)
        .expect("prefill");
    let decode_alone = probe_step(&model, &prefilled, &[17], &[], 0);
    let mut checked = 0;
    for batch in [2usize, 9, 33, 64] {
        // Other sequences of different lengths: fresh prompts (prefill rows in the step) and
        // prefilled ones that decode one token.
        let fresh_others: Vec<(SequenceState, Vec<u32>)> = (0..batch)
            .map(|i| {
                (
                    model.new_sequence(),
                    prompt(i as u32 + 1, 3 + (i * 5) % 41, vocab),
                )
            })
            .collect();
        let prefill = probe_step(&model, &fresh, &tokens, &fresh_others, batch / 2);
        gpu_support::assert_bitwise(
            &format!("prefill alone vs beside {batch} prompts"),
            &prefill,
            &prefill_alone,
        );
        let decoding_others: Vec<(SequenceState, Vec<u32>)> = fresh_others
            .into_iter()
            .enumerate()
            .map(|(i, (mut seq, p))| {
                model
                    .forward(&mut seq, &p, LogitsWanted::Last)
                    .expect("other prefill");
                (seq, vec![(i as u32 * 31 + 5) % vocab as u32])
            })
            .collect();
        let decode = probe_step(&model, &prefilled, &[17], &decoding_others, batch / 3);
        gpu_support::assert_bitwise(
            &format!("decode alone vs beside {batch} decoding sequences"),
            &decode,
            &decode_alone,
        );
        checked += 2;
    }
    // Negative control: the same comparison sees another decode token.
    let other_token = probe_step(&model, &prefilled, &[18], &[], 0);
    assert!(
        differing(&other_token, &decode_alone) > 0,
        "the invariance check cannot see a changed token"
    );
    println!(
        "v41-tiny fast: the probe's prefill ({} rows) and decode logits bitwise equal alone and in \
         {checked} batched steps beside 2..64 sequences of lengths 3..43; another token is detected",
        tokens.len()
    );
}
