//! GPU conformance of the `Backend` ops: every case of the one harness
//! (`deepinfer_tests::conformance`) run on `CudaBackend` against `CpuBackend`, each op family
//! twice — `exact::<family>` (every value bitwise the CPU reference) and `fast::<family>` (every
//! value within the op's bound of `conformance::fast_bound`, the ops without a fast path still
//! bitwise). The cases: odd shapes, both precisions, empty inputs, edge values, inputs resident on
//! the device and views into device buffers, rows past one launch's grid, and per-case negative
//! controls and batch invariance (a row of a batch equals the op on that row alone).
//!
//! Beside them, what only the device has: weights and tables uploaded once, op results left on
//! the device (only sampled ids come back), and the device-only errors.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a CUDA driver every test fails, naming why.
#![cfg(feature = "cuda")]

use deepinfer_model::backend::cuda::{CudaBackend, Numerics};
use deepinfer_model::backend::weights::Linear;
use deepinfer_model::backend::{
    Backend, CpuBackend, DenseWeight, EngramInjection, MaskedRows, Precision, RmsNorm, RopeTable,
    Rotation, RowSampling, StreamShape, Tensor,
};
use deepinfer_model::engram::{EngramGate, EngramTable};
use deepinfer_model::sampling::SamplingParams;
use deepinfer_tests::conformance::{Case, Mode, assert_conforms, cases, rows, sampling};
use deepinfer_tests::data::{
    Rng, activations, e4m3, e8m0, fp32_values, random_fp4_weight, random_fp8_weight,
};

mod gpu_support;
use gpu_support::cuda_backend;

/// Runs the `cases` of the test `test` on the CUDA backend in `mode` against the CPU reference.
fn conforms(test: &str, cases: Vec<Case>, mode: Mode) {
    let numerics = match mode {
        Mode::Exact => Numerics::Exact,
        Mode::Fast => Numerics::Fast,
    };
    let gpu = gpu_support::cuda_backend_in(test, numerics);
    assert_conforms(&cases, &CpuBackend, &gpu, mode);
}

/// One test per op family and mode: `exact::<family>` and `fast::<family>`.
macro_rules! conformance {
    ($($family:ident => $cases:path),* $(,)?) => {
        mod exact {
            $(
                #[test]
                fn $family() {
                    let test = concat!("exact::", stringify!($family));
                    super::conforms(test, $cases(), super::Mode::Exact);
                }
            )*
        }
        mod fast {
            $(
                #[test]
                fn $family() {
                    let test = concat!("fast::", stringify!($family));
                    super::conforms(test, $cases(), super::Mode::Fast);
                }
            )*
        }
    };
}

conformance! {
    linears => super::cases::linears,
    gemms => super::cases::gemms,
    quantised_linears => super::cases::quantised_linears,
    rms_norms => super::cases::rms_norms,
    ropes => super::cases::ropes,
    qdqs => super::cases::qdqs,
    rope_qdqs => super::cases::rope_qdqs,
    attention_one => super::cases::attention_one,
    attention_rows => super::cases::attention_rows,
    index_scores_one => super::cases::index_scores_one,
    index_scores_rows => super::cases::index_scores_rows,
    hc_one => super::cases::hc_one,
    hc_rows => super::cases::hc_rows,
    routers => super::cases::routers,
    selections => super::cases::selections,
    sample_rows => super::sampling::sample_rows,
    sample_rows_at_the_real_vocab => super::sampling::sample_rows_at_the_real_vocab,
    sample_masked => super::sampling::sample_masked,
    token_logprobs_masked => super::sampling::token_logprobs_masked,
    sample_linear => super::sampling::sample_linear,
    scale_at => super::rows::scale_at,
    stream_means => super::rows::stream_means,
    gated_pool => super::rows::gated_pool,
    engram_inject => super::rows::engram_inject,
    engram_gather => super::rows::engram_gather,
    table_rows => super::rows::table_rows,
    split_launches => super::rows::split_launches,
    hyper_heads => super::rows::hyper_heads,
}

/// Device-to-host copies of `gpu`'s op results so far.
fn copies(gpu: &CudaBackend) -> u64 {
    gpu.transfer_counters().snapshot().to_host_copies
}

/// The weight cache: an RMSNorm weight, each GEMM weight, an Engram table and an embedding table
/// are uploaded on their first use and found in the cache after (the second call adds nothing).
#[test]
fn weights_and_tables_are_uploaded_once() {
    let gpu = cuda_backend("weights_and_tables_are_uploaded_once");
    let mut rng = Rng(17);
    let grew = |what: &str, call: &dyn Fn()| {
        let before = gpu.cached_weights();
        call();
        assert_eq!(gpu.cached_weights(), before + 1, "{what}: uploaded once");
        call();
        assert_eq!(
            gpu.cached_weights(),
            before + 1,
            "{what}: found in the cache"
        );
    };
    let weight: Vec<f32> = (0..333).map(|i| 1.0 + i as f32 / 1000.0).collect();
    let x = Tensor::from(fp32_values(&mut rng, 2 * 333));
    let norm = RmsNorm {
        weight: &weight,
        eps: 1e-6,
        precision: Precision::Bf16,
    };
    grew("rms_norm weight", &|| drop(gpu.rms_norm(&x, norm)));
    let fp8 = random_fp8_weight(&mut rng, 203, 544, 32);
    let x8 = Tensor::from(activations(&mut rng, 3, 544));
    grew("gemm_fp8 weight", &|| drop(gpu.gemm_fp8(&x8, &fp8)));
    let fp4 = random_fp4_weight(&mut rng, 72, 2304);
    let x4 = Tensor::from(activations(&mut rng, 3, 2304));
    grew("gemm_fp4 weight", &|| drop(gpu.gemm_fp4(&x4, &fp4)));
    let (rows, head_dim) = (1021usize, 96usize);
    let codes: Vec<u8> = (0..rows * head_dim).map(|_| e4m3(&mut rng)).collect();
    let scales: Vec<u8> = (0..rows * head_dim / 32).map(|_| e8m0(&mut rng)).collect();
    let table = EngramTable::new("test", rows, head_dim, codes, scales).expect("table");
    grew("engram table", &|| {
        drop(gpu.engram_gather(&table, &[0, 5, 1020]))
    });
    let embeddings = fp32_values(&mut rng, 37 * 96);
    grew("embedding table", &|| {
        drop(gpu.table_rows(&embeddings, 96, &[36, 0, 5]))
    });
}

/// Op results stay on the device: the fp32 linear over an FP8 weight, the row ops on device
/// inputs and the embedding rows copy nothing to the host; `sample_linear` and `sample_masked`
/// bring back only the ids (one copy); reading `linear_f32`'s logits on the host copies them once.
#[test]
fn op_results_stay_on_the_device() {
    let gpu = cuda_backend("op_results_stay_on_the_device");
    let mut rng = Rng(18);
    let counters = gpu.transfer_counters();
    let on_device = |values: &[f32]| gpu.gather(&[(&Tensor::from(values), 0)], values.len());

    let before = copies(&gpu);
    let w = Linear::Fp8(random_fp8_weight(&mut rng, 131, 384, 128));
    let y = gpu.linear(&Tensor::from(fp32_values(&mut rng, 3 * 384)), &w);
    let streams = on_device(&fp32_values(&mut rng, 5 * 4 * 37));
    let means = gpu.stream_means_at(&streams, StreamShape { hc: 4, dim: 37 }, Precision::F32);
    let scaled = gpu.scale_at(on_device(&fp32_values(&mut rng, 64)), 0.5, Precision::Bf16);
    let members = on_device(&fp32_values(&mut rng, 4 * 2 * 33)).split_rows(66);
    let pooled = gpu.gated_pool_rows(&[members.iter().collect()], 33);
    let gate = EngramGate::new(7, 4, &[0.5; 28], &[0.25; 28], 1e-6).expect("gate shapes");
    let kv = on_device(&fp32_values(&mut rng, 2 * 5 * 7));
    let injected = gpu.engram_inject(
        on_device(&fp32_values(&mut rng, 3 * 4 * 7)),
        EngramInjection {
            kv: &kv,
            live: &[0, 2],
            gate: &gate,
        },
    );
    let embedded = gpu.table_rows(&fp32_values(&mut rng, 37 * 96), 96, &[3, 3, 36]);
    assert_eq!(copies(&gpu), before, "no op copied its result to the host");
    for (what, t) in [
        ("linear", &y),
        ("stream_means_at", &means),
        ("scale_at", &scaled),
        ("gated_pool_rows", &pooled),
        ("engram_inject", &injected),
        ("table_rows", &embedded),
    ] {
        assert!(t.device_view().is_some(), "{what}: a device tensor");
    }

    let (vocab, dim, rows) = (3001, 96, 13);
    let head: Vec<f32> = (0..vocab * dim).map(|_| rng.uniform() * 0.2).collect();
    let head = DenseWeight {
        values: &head,
        out: vocab,
        inp: dim,
    };
    let hidden = Tensor::from(fp32_values(&mut rng, rows * dim));
    let params: Vec<RowSampling> = (0..rows)
        .map(|r| RowSampling {
            params: SamplingParams {
                temperature: [0.0, 0.7][r % 2],
                top_k: 0,
                top_p: 0.9,
                seed: r as u64,
            },
            position: r as u64,
        })
        .collect();
    let before = counters.snapshot();
    gpu.sample_linear(&hidden, head, &params)
        .expect("shapes fit");
    let copied = counters.snapshot() - before;
    assert_eq!(
        (
            copied.to_host_copies,
            copied.to_host_bytes,
            copied.sampled_id_copies
        ),
        (0, 0, 1),
        "sample_linear: only the ids come back"
    );
    let logits = gpu.linear_f32(&hidden, head);
    let before = counters.snapshot();
    let host_logits = logits.into_vec();
    let copied = counters.snapshot() - before;
    assert_eq!(
        (copied.to_host_copies, copied.to_host_bytes),
        (1, (rows * vocab * 4) as u64),
        "reading linear_f32's logits on the host copies them once"
    );
    let logits = on_device(&host_logits);
    let before = counters.snapshot();
    gpu.sample_masked(MaskedRows {
        logits: &logits,
        vocab,
        rows: &params,
        allowed: &vec![None; rows],
    })
    .expect("shapes fit");
    let copied = counters.snapshot() - before;
    assert_eq!(
        (copied.to_host_copies, copied.sampled_id_copies),
        (0, 1),
        "sample_masked: only the ids come back"
    );
}

/// The device-only error paths: an embedding id past the table names the id and the table's
/// rows (no read out of bounds); a wrong row count of `try_sample_linear` is an op error.
#[test]
fn device_only_errors_name_the_problem() {
    let gpu = cuda_backend("device_only_errors_name_the_problem");
    let (rows, width) = (37, 96);
    let table = fp32_values(&mut Rng(37), rows * width);
    let err = gpu
        .try_table_rows(&table, width, &[3, rows as u32])
        .expect_err("a row past the table");
    assert!(
        err.to_string().contains("id 1 is row 37 of a 37-row table"),
        "{err}"
    );
    let head = vec![0.5f32; 7 * 4];
    let head = DenseWeight {
        values: &head,
        out: 7,
        inp: 4,
    };
    let params = vec![
        RowSampling {
            params: SamplingParams::greedy(),
            position: 0,
        };
        3
    ];
    let err = gpu
        .try_sample_linear(&Tensor::from(vec![0.5; 8]), head, &params)
        .expect_err("2 rows for 3 samplings");
    assert!(matches!(
        err,
        deepinfer_model::backend::cuda::CudaBackendError::Op { .. }
    ));
}

/// A device tensor quantised for one FP8 GEMM feeds the next GEMM on the same values without a
/// second quantisation (one launch fewer, the bits of a GEMM on a copy of the values quantised on
/// its own); a bf16 RMSNorm's outputs come quantised from the norm's own launch; once the values
/// change in place, the next GEMM quantises them again (a kept quantisation of the old values
/// would give the old result), in both numerics.
#[test]
fn gemms_on_the_same_values_quantise_them_once() {
    for numerics in [Numerics::Exact, Numerics::Fast] {
        let gpu =
            gpu_support::cuda_backend_in("gemms_on_the_same_values_quantise_them_once", numerics);
        let mut rng = Rng(41);
        let w1 = random_fp8_weight(&mut rng, 192, 512, 32);
        let w2 = random_fp8_weight(&mut rng, 96, 512, 32);
        let values = activations(&mut rng, 3, 512);
        let on_device = |v: &[f32]| gpu.gather(&[(&Tensor::from(v), 0)], v.len());
        let launches = || gpu.runtime().counts().launches;
        let x = on_device(&values);
        let start = launches();
        drop(gpu.gemm_fp8(&x, &w1));
        let first = launches() - start;
        let start = launches();
        let y = gpu.gemm_fp8(&x, &w2).to_vec();
        assert_eq!(
            launches() - start,
            first - 1,
            "{numerics:?}: the second GEMM on the same values quantises nothing"
        );
        let alone = gpu.gemm_fp8(&on_device(&values), &w2).to_vec();
        assert!(
            y.iter()
                .zip(&alone)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{numerics:?}: the kept quantisation gives the GEMM's own bits"
        );

        let weight: Vec<f32> = (0..512).map(|i| 0.5 + i as f32 / 512.0).collect();
        let norm = RmsNorm {
            weight: &weight,
            eps: 1e-6,
            precision: Precision::Bf16,
        };
        let normed = gpu.rms_norm(&on_device(&values), norm);
        let start = launches();
        let y_normed = gpu.gemm_fp8(&normed, &w1).to_vec();
        assert_eq!(
            launches() - start,
            first - 1,
            "{numerics:?}: the norm's outputs come quantised"
        );
        let normed_values: Vec<f32> = normed.to_vec();
        let alone = gpu.gemm_fp8(&on_device(&normed_values), &w1).to_vec();
        assert!(
            y_normed
                .iter()
                .zip(&alone)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{numerics:?}: the norm's quantisation gives the GEMM's own bits"
        );

        let halved = gpu.scale_at(x, 0.5, Precision::F32);
        let start = launches();
        let changed = gpu.gemm_fp8(&halved, &w2).to_vec();
        assert_eq!(
            launches() - start,
            first,
            "{numerics:?}: values changed in place are quantised again"
        );
        let want: Vec<f32> = values.iter().map(|v| v * 0.5).collect();
        let want = gpu.gemm_fp8(&on_device(&want), &w2).to_vec();
        assert!(
            changed
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{numerics:?}: the GEMM after the change reads the changed values"
        );
        assert!(changed != y, "{numerics:?}: the change changes the result");
    }
}

/// A step's rotations of the same positions (its queries, keys, inverse rotation and indexer in
/// every layer) upload the positions once; other positions upload theirs; every rotation gives
/// the CPU's bits (a kept copy of other positions would not).
#[test]
fn rotations_of_the_same_positions_upload_them_once() {
    let gpu = cuda_backend("rotations_of_the_same_positions_upload_them_once");
    let cpu = CpuBackend::new();
    let table = RopeTable {
        freqs: (0..16)
            .map(|i| 1.0f32 / 10000f32.powf(i as f32 / 16.0))
            .collect(),
    };
    let (rows, vectors, stride) = (3usize, 4usize, 64usize);
    let step: Vec<usize> = vec![1021, 17, 4090];
    let other: Vec<usize> = vec![1022, 18, 4091];
    let uploads = || gpu.runtime().counts().htod_copies;
    let rotate = |positions: &[usize], inverse: bool| {
        let x = fp32_values(
            &mut Rng(positions[0] as u64 + u64::from(inverse)),
            rows * vectors * stride,
        );
        let rotation = Rotation {
            table: &table,
            positions,
            inverse,
            precision: Precision::Bf16,
        };
        let on_device = gpu.gather(&[(&Tensor::from(&x[..]), 0)], x.len());
        let start = uploads();
        let got = gpu.rope(on_device, (stride, vectors), &rotation).to_vec();
        let uploaded = uploads() - start;
        let want = cpu
            .rope(Tensor::from(&x[..]), (stride, vectors), &rotation)
            .into_vec();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "positions {positions:?} inverse {inverse}: the CPU's bits"
        );
        uploaded
    };
    rotate(&step, false); // the cos/sin table and the step's positions
    assert_eq!(
        rotate(&step, true),
        0,
        "the same positions again: no upload"
    );
    assert_eq!(rotate(&step, false), 0, "and again");
    assert_eq!(rotate(&other, false), 1, "other positions: one upload");
    assert_eq!(
        rotate(&step, false),
        0,
        "the step's positions are still kept"
    );
}
