//! GPU conformance of the row kernels (`deepinfer_kernels::ops::rows`) against the CPU code of
//! `deepinfer-model` they replace, over odd shapes, bitwise:
//! - the stream means of the DSpark taps (bf16) and the V4 fp32 variant;
//! - the index head-weight scaling of `csa::index_queries`;
//! - `exp` as Rust's std computes it (every float of [-104, 0], the gated pooling's domain, and a
//!   sample of all others), then the compressor's gated pooling over member rows that lie in
//!   separate buffers;
//! - `EngramGate::inject` (called from the model) for the live tokens of a chunk.
//!
//! The `Backend` ops built on them (`scale_at`, `stream_means_at`, `gated_pool_rows`,
//! `engram_inject`), `CudaBackend` against `CpuBackend` on host and device inputs: `gpu_ops.rs`
//! (the conformance harness), with no device-to-host copy inside the ops.
//!
//! The CPU side is always `CpuBackend`'s op (the one definition). Each numeric test also has a
//! negative control: a nearby but different computation (another fold order, the correctly
//! rounded exp, reversed members, another eps or scale) is shown to differ, so the bitwise
//! comparison can fail.
//!
//! Measured on the H200 (2026-11-30), all bitwise equal: 14 350 stream means, 4 798 scaled
//! weights, 136 548 pooled values, 192 183 injected stream values.
//!
//! Built only with `--features cuda`; run by the GPU suite (`tests/gpu-suite.sh`) on the H200.
//! Without a CUDA driver every test fails, naming why.
#![cfg(feature = "cuda")]

use deepinfer_kernels::KernelRuntime;
use deepinfer_kernels::cudarc::driver::{CudaSlice, DevicePtr};
use deepinfer_kernels::ops::Rounding;
use deepinfer_kernels::ops::rows::{
    EngramInjectShape, engram_inject_f32, exp_std_f32, gated_pool_f32, scale_round_f32,
    stream_means_f32,
};
use deepinfer_kernels::{KernelError, KernelId};
use deepinfer_model::backend::{Backend, CpuBackend, StreamShape, Tensor};
use deepinfer_model::quant::round_bf16;

mod gpu_support;
use deepinfer_tests::conformance::rows::{
    INJECT_SHAPES, InjectData, STREAM_SHAPES, reversed_stream_means,
};
use deepinfer_tests::data::spread;
use gpu_support::gemm_data::activation;
use gpu_support::{Rng, assert_bitwise, differing, precision_of, runtime};

fn upload<T: deepinfer_kernels::cudarc::driver::DeviceRepr>(
    rt: &KernelRuntime,
    values: &[T],
) -> CudaSlice<T> {
    rt.stream().clone_htod(values).expect("upload")
}

fn download(rt: &KernelRuntime, values: &CudaSlice<f32>) -> Vec<f32> {
    rt.stream().clone_dtoh(values).expect("download")
}

// ---- the CPU definitions -----------------------------------------------------------------------

/// The stream means as `CpuBackend` computes them (the trait default: `step.rs`'s taps, and V4's
/// fp32 variant).
fn cpu_stream_means(streams: &[f32], hc: usize, dim: usize, rounding: Rounding) -> Vec<f32> {
    CpuBackend
        .stream_means_at(
            &Tensor::from(streams),
            StreamShape { hc, dim },
            precision_of(rounding),
        )
        .into_vec()
}

#[test]
fn launchers_reject_rows_that_do_not_fit() {
    let rt = runtime("launchers_reject_rows_that_do_not_fit");
    let src = upload(&rt, &[0.0f32; 10]);
    let mut dst = upload(&rt, &[0.0f32; 10]);
    let shape_error = |result: Result<(), KernelError>| match result {
        Err(KernelError::Shape { op, message }) => format!("{op}: {message}"),
        other => panic!("expected a shape error, got {other:?}"),
    };
    let err = shape_error(stream_means_f32(&rt, &src, 3, 2, Rounding::Bf16, &mut dst));
    assert!(err.contains("hc = 3"), "{err}");
    let members = upload(&rt, &[0u64; 3]);
    // SAFETY: the shape check fails before any address is read.
    let err = shape_error(unsafe { gated_pool_f32(&rt, &members, 2, 2, 5, &mut dst) });
    assert!(err.contains("members"), "{err}");
    let live = upload(&rt, &[0u32]);
    let shape = EngramInjectShape {
        hc: 2,
        dim: 5,
        kv_stride: 14,
        eps: 1e-6,
    };
    let err = shape_error(engram_inject_f32(&rt, &mut dst, &src, &live, &src, shape));
    assert!(err.contains("cannot hold"), "{err}");
    assert_eq!(
        KernelId::GatedPoolF32.source(),
        deepinfer_kernels::SourceFile::Rows
    );
}

// ---- stream means and head-weight scaling ------------------------------------------------------

#[test]
fn stream_means_match_the_cpu_fold() {
    let rt = runtime("stream_means_match_the_cpu_fold");
    let mut rng = Rng(13);
    let mut compared = 0;
    let mut other_order_differs = 0;
    for (n, hc, dim) in STREAM_SHAPES {
        // fp32 streams over a wide range, so the fold order shows in the last bits.
        let streams: Vec<f32> = (0..n * hc * dim)
            .map(|_| spread(&mut rng, -20, 20))
            .collect();
        let streams_d = upload(&rt, &streams);
        for rounding in [Rounding::Bf16, Rounding::F32] {
            let mut out = upload(&rt, &vec![0.0f32; n * dim]);
            stream_means_f32(&rt, &streams_d, hc, dim, rounding, &mut out).expect("stream_means");
            let gpu = download(&rt, &out);
            let cpu = cpu_stream_means(&streams, hc, dim, rounding);
            compared += assert_bitwise("stream_means", &gpu, &cpu);
            // Negative control: the streams folded in reverse order.
            let reversed = reversed_stream_means(&streams, hc, dim);
            if rounding == Rounding::F32 {
                other_order_differs += differing(&gpu, &reversed);
            }
        }
    }
    assert!(other_order_differs > 0, "the fold order must be visible");
    println!(
        "stream means: {compared} values bitwise equal; the reverse fold differs in \
         {other_order_differs}"
    );
}

#[test]
fn scale_round_matches_the_index_head_weights() {
    let rt = runtime("scale_round_matches_the_index_head_weights");
    let mut rng = Rng(14);
    let mut compared = 0;
    for (heads, head_dim, n) in [(1, 1, 1), (3, 32, 5), (64, 128, 37)] {
        // As csa::index_queries computes it.
        let weight_scale = (head_dim as f32).powf(-0.5) * (heads as f32).powf(-0.5);
        let mut w: Vec<f32> = (0..n * heads)
            .map(|_| spread(&mut rng, -130, 120))
            .collect();
        w.extend([0.0, -0.0, f32::INFINITY, f32::MIN_POSITIVE / 3.0, 3.0e38]);
        let mut x = upload(&rt, &w);
        scale_round_f32(&rt, &mut x, weight_scale, Rounding::Bf16).expect("scale_round");
        let cpu: Vec<f32> = w.iter().map(|w| round_bf16(w * weight_scale)).collect();
        compared += assert_bitwise("head weights", &download(&rt, &x), &cpu);
        let mut x = upload(&rt, &w);
        scale_round_f32(&rt, &mut x, weight_scale, Rounding::F32).expect("scale_round");
        let cpu: Vec<f32> = w.iter().map(|w| w * weight_scale).collect();
        compared += assert_bitwise("scaled fp32", &download(&rt, &x), &cpu);
    }
    println!("scale and round: {compared} values bitwise equal");
}

// ---- exp and gated pooling ---------------------------------------------------------------------

/// `f(bits)` for every pattern of `bits`, on all CPU cores.
fn on_cores(bits: &[u32], f: impl Fn(u32) -> f32 + Sync) -> Vec<f32> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out = vec![0.0f32; bits.len()];
    let chunk = bits.len().div_ceil(cores).max(1);
    std::thread::scope(|scope| {
        for (inputs, outputs) in bits.chunks(chunk).zip(out.chunks_mut(chunk)) {
            let f = &f;
            scope.spawn(move || {
                for (o, &b) in outputs.iter_mut().zip(inputs) {
                    *o = f(b);
                }
            });
        }
    });
    out
}

#[test]
fn exp_matches_std_f32_exp_over_every_pooling_input() {
    let rt = runtime("exp_matches_std_f32_exp_over_every_pooling_input");
    // The pooling's arguments gate − max lie in [-inf, 0]; below ln 2^-150 ≈ -103.97 the result
    // is 0. Every float of [-104, -0] (bit patterns 0x8000_0000 ..= 0xc2d0_0000), then every
    // 97th pattern of all 2^32.
    const CHUNK: u32 = 1 << 26;
    let negative_end: u32 = (-104.0f32).to_bits();
    let chunks = (0x8000_0000u32..=negative_end)
        .step_by(CHUNK as usize)
        .map(|start| (start..=start.saturating_add(CHUNK - 1).min(negative_end)).collect())
        .chain(std::iter::once((0..=u32::MAX).step_by(97).collect()));
    let mut compared = 0usize;
    let mut not_correctly_rounded = 0usize;
    for bits in chunks {
        let bits: Vec<u32> = bits;
        let inputs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut x = upload(&rt, &inputs);
        exp_std_f32(&rt, &mut x).expect("exp_std_f32");
        let gpu = download(&rt, &x);
        let cpu = on_cores(&bits, |b| f32::from_bits(b).exp());
        let bad: Vec<usize> = (0..bits.len())
            .filter(|&i| {
                gpu[i].to_bits() != cpu[i].to_bits() && !(gpu[i].is_nan() && cpu[i].is_nan())
            })
            .collect();
        if let Some(&i) = bad.first() {
            panic!(
                "exp: {} of {} differ; first x = {:e} ({:#010x}): gpu {:#010x} std {:#010x}",
                bad.len(),
                bits.len(),
                inputs[i],
                bits[i],
                gpu[i].to_bits(),
                cpu[i].to_bits()
            );
        }
        compared += bits.len();
        // Negative control: the correctly rounded exp (through f64) differs from std's on some.
        let exact = on_cores(&bits, |b| f64::from(f32::from_bits(b)).exp() as f32);
        not_correctly_rounded += (0..bits.len())
            .filter(|&i| exact[i].to_bits() != cpu[i].to_bits() && !cpu[i].is_nan())
            .count();
    }
    assert!(
        not_correctly_rounded > 0,
        "std's exp should differ from the correctly rounded one somewhere"
    );
    println!(
        "exp: {compared} inputs bitwise equal to std f32::exp; std differs from the correctly \
         rounded exp on {not_correctly_rounded} of them"
    );
}

/// The device address of row `row` (`width` f32 values) of `buffer`.
fn row_address(rt: &KernelRuntime, buffer: &CudaSlice<f32>, row: usize, width: usize) -> u64 {
    assert!((row + 1) * width <= buffer.len());
    let (base, _recorded) = buffer.device_ptr(rt.stream());
    base + (row * width * size_of::<f32>()) as u64
}

#[test]
fn gated_pool_matches_pool_channel() {
    let rt = runtime("gated_pool_matches_pool_channel");
    let mut rng = Rng(15);
    let mut compared = 0;
    let (mut reversed_differs, mut replaced_differs) = (0, 0);
    for (groups, ratio, head_dim) in [
        (1, 1, 1),
        (3, 2, 33),
        (5, 4, 128),
        (2, 128, 64),
        (9, 4, 512),
        (2048, 128, 64),
    ] {
        let width = 2 * head_dim;
        // Member rows spread over 3 buffers (as rows of different steps' buffers), each a
        // `kv ‖ gate` row; gates over a wide range (some far below the max: exp underflows),
        // ties of the max in some channels.
        let buffer_rows = (groups * ratio).min(1024);
        let hosts: Vec<Vec<f32>> = (0..3)
            .map(|_| {
                (0..buffer_rows * width)
                    .map(|i| {
                        if i % width < head_dim {
                            activation(&mut rng)
                        } else if rng.below(20) == 0 {
                            -150.0 + rng.uniform()
                        } else if rng.below(10) == 0 {
                            1.5
                        } else {
                            spread(&mut rng, -6, 5)
                        }
                    })
                    .collect()
            })
            .collect();
        let buffers: Vec<CudaSlice<f32>> = hosts.iter().map(|h| upload(&rt, h)).collect();
        let picks: Vec<(usize, usize)> = (0..groups * ratio)
            .map(|_| {
                (
                    rng.below(3) as usize,
                    rng.below(buffer_rows as u64) as usize,
                )
            })
            .collect();
        // The pooling with member j of group g at `member(g, j)` (buffer, row).
        let run = |member: &dyn Fn(usize, usize) -> (usize, usize)| -> Vec<f32> {
            let addresses: Vec<u64> = (0..groups * ratio)
                .map(|m| {
                    let (b, row) = member(m / ratio, m % ratio);
                    row_address(&rt, &buffers[b], row, width)
                })
                .collect();
            let members = upload(&rt, &addresses);
            let mut out = upload(&rt, &vec![0.0f32; groups * head_dim]);
            // SAFETY: every address is a whole row of a live buffer of this context, held until
            // the download below has synchronised the stream.
            unsafe { gated_pool_f32(&rt, &members, groups, ratio, head_dim, &mut out) }
                .expect("gated_pool_f32");
            download(&rt, &out)
        };
        let gpu = run(&|g, j| picks[g * ratio + j]);
        let rows: Vec<Tensor> = picks
            .iter()
            .map(|&(b, row)| Tensor::from(&hosts[b][row * width..(row + 1) * width]))
            .collect();
        let members: Vec<Vec<&Tensor>> = rows.chunks(ratio).map(|g| g.iter().collect()).collect();
        let cpu = CpuBackend.gated_pool_rows(&members, head_dim).into_vec();
        compared += assert_bitwise("gated pooling", &gpu, &cpu);
        // Negative control: the last member of every group read from another buffer.
        replaced_differs += differing(
            &run(&|g, j| {
                let (b, row) = picks[g * ratio + j];
                if j + 1 == ratio {
                    ((b + 1) % 3, row)
                } else {
                    (b, row)
                }
            }),
            &cpu,
        );
        // The members in reverse order (another fold order): the bf16 rounding of the output
        // hides most of the fp32 differences, so this is only counted.
        reversed_differs += differing(&run(&|g, j| picks[g * ratio + ratio - 1 - j]), &cpu);
    }
    assert!(replaced_differs > 0, "every member must be read");
    println!(
        "gated pooling: {compared} values bitwise equal; a replaced member changes \
         {replaced_differs}, reversed members (another fold order) {reversed_differs}"
    );
}

// ---- Engram injection --------------------------------------------------------------------------

#[test]
fn engram_inject_matches_the_cpu_gate() {
    let rt = runtime("engram_inject_matches_the_cpu_gate");
    let mut rng = Rng(16);
    let mut compared = 0;
    let mut other_eps_differs = 0;
    for shape in INJECT_SHAPES {
        let data = InjectData::random(&mut rng, shape);
        let (_, hc, dim, _, eps) = shape;
        let kv_stride = data.kv_stride();
        let gate = data.gate_with(eps);
        let [q, k] = &data.gate;
        let weight: Vec<f32> = q.iter().zip(k).map(|(q, k)| q * k).collect();
        let (streams, kv) = (&data.streams, &data.kv);
        let live: Vec<u32> = data.live.iter().map(|&t| t as u32).collect();

        let mut cpu = streams.clone();
        let token_width = hc * dim;
        for (i, &t) in live.iter().enumerate() {
            let t = t as usize;
            gate.inject(
                &mut cpu[t * token_width..(t + 1) * token_width],
                &kv[i * kv_stride..(i + 1) * kv_stride],
            );
        }
        let kv_d = upload(&rt, kv);
        let live_d = upload(&rt, &live);
        let weight_d = upload(&rt, &weight);
        let run = |eps: f32| -> Vec<f32> {
            let mut x = upload(&rt, streams);
            let shape = EngramInjectShape {
                hc,
                dim,
                kv_stride,
                eps,
            };
            engram_inject_f32(&rt, &mut x, &kv_d, &live_d, &weight_d, shape)
                .expect("engram_inject_f32");
            download(&rt, &x)
        };
        let gpu = run(eps);
        compared += assert_bitwise("engram injection", &gpu, &cpu);
        assert_ne!(differing(&gpu, streams), 0, "live tokens must change");
        // Negative control: another eps changes some gates' last bits.
        other_eps_differs += differing(&run(eps * 1.5 + 1e-3), &cpu);
    }
    assert!(other_eps_differs > 0, "eps must be visible");
    println!(
        "engram injection: {compared} stream values bitwise equal; another eps differs in \
         {other_eps_differs}"
    );
}
