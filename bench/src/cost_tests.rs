//! Tests of the cost model (`deepinfer_model::cost`) against the spec's figures, and its
//! calibration against the H100 whole-step measurements (fast numerics) of bench/README.md.

use crate::block::{BlockFamily, BlockWidth, block_config, v4_flash_config as v4_flash};
use crate::cost::device::{DeviceModel, DevicePeaks, Efficiency};
use crate::cost::step::{StepEntry, StepWork};
use crate::cost::*;

#[test]
fn real_width_expert_and_layer_match_the_spec_figures() {
    let cfg = block_config(BlockFamily::V41, BlockWidth::Real, 1024, 4096);
    // Spec §7.1: one routed expert is 18.80 MB (FP4 + scales).
    assert_eq!(expert_bytes(&cfg), 18_800_640.0);
    // Attention projections 126.6 M params (FP8, 1 B each + 1/1024 scales), mHC 2 x 1.97 MB,
    // router 3.9 MB, shared expert 35.4 M, compressor + gate 2 x 5.2 MB, index keys 0.13 MB,
    // indexer 5.2 M + 0.33 MB, head 1024 x 5120 bf16.
    let want = 126_615_552.0 * (1.0 + 1.0 / 1024.0)
        + 2.0 * 1_966_080.0
        + 3_932_160.0
        + 35_389_440.0 * (1.0 + 1.0 / 1024.0)
        + 2.0 * 5_242_880.0
        + 131_072.0
        + 5_242_880.0 * (1.0 + 1.0 / 1024.0)
        + 327_680.0
        + 10_485_760.0;
    let got = dense_weight_bytes(&cfg);
    assert!((got - want).abs() < 1.0, "{got} vs {want}");
}

#[test]
fn decode_flops_follow_active_parameters_and_context() {
    let cfg = block_config(BlockFamily::V41, BlockWidth::Real, 1024, 4096);
    // Context-free part of one token: 2 x (126.6 M attention + 7 x 35.4 M experts + 2 M router
    // + 0.98 M mHC + 10.5 M compressor + 5.4 M indexer) + head.
    let first = token_cost(&cfg, 0);
    let second = token_cost(&cfg, 1);
    // Position 1 completes the first ratio-2 group: one more key (window 2 + selected 1 vs
    // window 1), the index key, one more index score.
    let attention = 4.0 * 64.0 * 512.0 * 2.0;
    let index_key = 2.0 * 128.0 * 512.0;
    let score = 2.0 * 32.0 * 128.0;
    assert_eq!(second.flops - first.flops, attention + index_key + score);
    // Past the window and the top-k, every key set is full: 128 + 512 keys.
    let late = token_cost(&cfg, 4000);
    let early = token_cost(&cfg, 3000);
    let scores = 2.0 * 32.0 * 128.0 * (2000.0 - 1500.0);
    assert_eq!(late.flops - early.flops, scores);
    let decode = decode_step(&cfg, &[4000, 3000]);
    assert_eq!(
        decode.flops,
        late.flops + early.flops + 2.0 * 2.0 * 1024.0 * 5120.0
    );
}

#[test]
fn touched_experts_grow_with_the_batch_and_saturate() {
    let cfg = block_config(BlockFamily::V41, BlockWidth::Real, 1024, 4096);
    assert!((expected_experts(&cfg, 1) - 6.0).abs() < 1e-9);
    // Spec §7.3: 85 at 16 tokens, 244 at 64, 377 at 256.
    for (tokens, want) in [(16, 85.530), (64, 243.845), (256, 377.185)] {
        let got = expected_experts(&cfg, tokens);
        assert!((got - want).abs() < 1e-3, "{tokens} tokens: {got}");
    }
    let one = decode_step(&cfg, &[100]);
    let many = decode_step(&cfg, &[100; 64]);
    assert!(many.weight_bytes > one.weight_bytes + 200.0 * expert_bytes(&cfg));
}

#[test]
fn floor_takes_the_slower_side() {
    let memory = Cost {
        weight_bytes: 4.28e9,
        state_bytes: 0.0,
        flops: 1e9,
    };
    assert!((memory.floor_seconds() - 1e-3).abs() < 1e-12);
    assert_eq!(memory.bound(), "bytes");
    let compute = Cost {
        weight_bytes: 1.0,
        state_bytes: 0.0,
        flops: 790e12,
    };
    assert!((compute.floor_seconds() - 1.0).abs() < 1e-12);
    assert_eq!(compute.bound(), "FLOPs");
}

/// The real-width V4.1 block's steps in the `fast` numerics measured on an H100 (bench/README.md,
/// session 29, call 1: the base binary's two runs, averaged): (phase, batch, seconds).
const MEASURED_H100: [(&str, usize, f64); 4] = [
    ("prefill", 1, 8.215e-3),
    ("decode", 1, 0.535e-3),
    ("decode", 8, 0.85e-3),
    ("decode", 64, 2.53e-3),
];

/// The measured step as `StepWork`: the 1024-token prefill of one prompt, or one decode token
/// at position 1024 for each of B sequences.
fn measured_work(phase: &str, batch: usize) -> StepWork {
    let cfg = block_config(BlockFamily::V41, BlockWidth::Real, 1024, 4096);
    let entries: Vec<StepEntry> = match phase {
        "prefill" => vec![StepEntry {
            start: 0,
            tokens: 1024,
            rows: 1,
        }],
        _ => vec![
            StepEntry {
                start: 1024,
                tokens: 1,
                rows: 1,
            };
            batch
        ],
    };
    StepWork::single_device(&cfg, &entries, 0)
}

#[test]
fn calibration_predicts_the_measured_steps() {
    let measured_model = DeviceModel {
        peaks: DevicePeaks::H100,
        efficiency: Efficiency::MEASURED_FAST,
    };
    let roofline = DeviceModel {
        peaks: DevicePeaks::H100,
        efficiency: Efficiency::ROOFLINE,
    };
    println!(
        "| phase | B | measured ms | predicted ms | error | roofline ms | dense/attn/routed floor µs |"
    );
    println!("|---|--:|--:|--:|--:|--:|--:|");
    let mut worst: f64 = 0.0;
    for (phase, batch, measured) in MEASURED_H100 {
        let work = measured_work(phase, batch);
        let predicted = measured_model.compute_seconds(&work, 1);
        let error = predicted / measured - 1.0;
        worst = worst.max(error.abs());
        let p = &DevicePeaks::H100;
        let floor = |c: &Cost, peak: f64| (c.bytes() / p.hbm_bytes_per_s).max(c.flops / peak) * 1e6;
        println!(
            "| {phase} | {batch} | {:.2} | {:.2} | {:+.1}% | {:.3} | {:.1}/{:.1}/{:.1} |",
            measured * 1e3,
            predicted * 1e3,
            error * 100.0,
            roofline.compute_seconds(&work, 1) * 1e3,
            floor(&work.dense, p.fp8_flops),
            floor(&work.attention, p.bf16_flops),
            floor(&work.routed, p.fp4_flops),
        );
    }
    assert!(
        worst < 0.20,
        "worst calibration error {:.1}%",
        worst * 100.0
    );
}

#[test]
fn v4_flash_weights_per_token_match_the_spec() {
    let cfg = v4_flash();
    // v4 spec §1.2 / §6: one expert 3 x [2048, 4096] FP4 with 1x32 scales (0.53125 B/param).
    assert_eq!(expert_bytes(&cfg), 3.0 * 2048.0 * 4096.0 * 0.53125);
    // Per layer: attention FP8 106,954,752 params + their 128x128 scales (q_a 256, q_b 2048,
    // wkv 128, o_a 2048, o_b 2048), shared expert FP8 25,165,824 + 3 x 512 scales, mHC 2 sites x
    // [24, 16384] f32. Router [256, 4096] bf16 on the 40 score-routed layers; the 21 CSA layers'
    // compressor (kv + gate, 2 x 1024 outputs) and indexer compressor (2 x 256) in bf16, indexer
    // wq_b FP8 [8192, 1024] + 512 scales, weights_proj [64, 4096] bf16; the 20 HCA layers'
    // compressor (2 x 512) bf16; head [129280, 4096] bf16; hyper-head [4, 16384] f32.
    let per_layer = 106_954_752.0 + 6528.0 + 25_165_824.0 + 1536.0 + 3_145_728.0;
    let csa = 16_777_216.0 + 4_194_304.0 + 8_388_608.0 + 512.0 + 524_288.0;
    let want = 43.0 * per_layer
        + 40.0 * 2_097_152.0
        + 21.0 * csa
        + 20.0 * 8_388_608.0
        + 1_059_061_760.0
        + 262_144.0;
    assert_eq!(dense_weight_bytes(&cfg), want);
    // Spec §6: 11.22 GB of weights per token at batch 1, 3.45 GB of them routed experts.
    let step = decode_step(&cfg, &[4095]);
    let routed = 43.0 * 6.0 * expert_bytes(&cfg);
    assert!((routed / 1e9 - 3.45).abs() < 0.005, "routed {routed}");
    assert_eq!(step.weight_bytes, want + routed);
    assert!(
        (step.weight_bytes / 11.22e9 - 1.0).abs() < 0.005,
        "{} GB",
        step.weight_bytes / 1e9
    );
}

#[test]
fn v4_flash_kv_reads_and_attention_flops_match_the_spec() {
    let cfg = v4_flash();
    let widths = CacheWidths::of(&cfg);
    // Spec §3.4: the FP8 serving layout, 584 B per 512-vector; FP4 index keys 64 + 4 B.
    assert_eq!(
        (widths.window, widths.compressed, widths.index_key),
        (584, 584, 68)
    );
    // Spec §6 at context T (the token at position T - 1): KV read "FP8 + FP4 idx" 11.3, 24.2,
    // 68.2 MB; attention core 2.22, 2.80, 4.82 GFLOP; indexer 2·64·128·⌊T/4⌋ per CSA layer.
    for (context, kv_mb, core_gflop) in [
        (4096usize, 11.3, 2.22),
        (32_768, 24.2, 2.80),
        (131_072, 68.2, 4.82),
    ] {
        let token = token_cost(&cfg, context - 1);
        let window = context.min(128);
        let (csa_keys, hca_keys) = ((context / 4).min(512), context / 128);
        let state = 43 * window * 584
            + 21 * (csa_keys * 584 + (context / 4) * 68)
            + 20 * hca_keys * 584
            + 2 * 4096;
        assert_eq!(token.state_bytes, state as f64, "context {context}");
        let kv = token.state_bytes - 2.0 * 4096.0; // the spec's table leaves out the embedding row
        assert!((kv / 1e6 - kv_mb).abs() < 0.05, "context {context}: {kv}");
        let core = (131_072 * (43 * window + 21 * csa_keys + 20 * hca_keys)) as f64;
        // (The spec prints 2.22 at 4096 where this count gives 2.2146: within 0.01.)
        assert!((core / 1e9 - core_gflop).abs() < 0.01, "context {context}");
        let parts = token_parts(&cfg, context - 1);
        let scores = (2 * 64 * 128 * (context / 4) * 21) as f64;
        assert_eq!(parts.attention.flops, core + scores, "context {context}");
    }
    // Spec §6: the context-free part is about 2 x 13.27 B active parameters (26.5 GFLOP, the
    // head included).
    let token = token_parts(&cfg, 0);
    let dense = token.dense_flops + token.routed_flops + head_flops(&cfg);
    assert!((dense / 26.5e9 - 1.0).abs() < 0.01, "{} GFLOP", dense / 1e9);
}
