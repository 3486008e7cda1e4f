//! The bytes and FLOPs a V4.1 forward needs, computed from the config alone (spec
//! v41-architecture.md §7), and the H200 roofline floor a measured step is compared with.
//!
//! Counted is what the step *needs*, not what this implementation moves: weights at their
//! checkpoint width (FP8 1 B + one UE8M0 byte per 32×32 tile, FP4 ½ B + one byte per 32, bf16 2 B,
//! f32 4 B), each distinct weight once per step however many sequences read it, plus the per-query
//! KV/state reads at their cache width (window FP8 + UE8M0 per 32, compressed KV FP4 + E4M3 per
//! 16, index keys FP4 + UE8M0 per 32). FLOPs are 2 per multiply-add of the GEMMs, the mHC
//! projections, the attention core and the index scores; element-wise work (norms, RoPE, QDQ,
//! Sinkhorn, SwiGLU) and 1-D vectors (norm weights, biases, sinks) are left out (< 0.1 %).

use deepinfer_model::config::ModelConfig;

/// H200 device-to-device copy rate, read + write counted (measured, shared/tools/gpu.md).
pub const H200_COPY_BYTES_PER_S: f64 = 4.28e12;
/// H200 dense bf16 tensor-core GEMM rate (measured, cuBLAS 4096³).
pub const H200_BF16_FLOPS: f64 = 790e12;

/// Bytes and FLOPs of some work.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    /// Distinct weight bytes read.
    pub weight_bytes: f64,
    /// KV cache / sequence-state bytes read.
    pub state_bytes: f64,
    pub flops: f64,
}

impl Cost {
    pub fn bytes(&self) -> f64 {
        self.weight_bytes + self.state_bytes
    }

    /// The H200 roofline floor: `max(bytes / 4.28 TB/s, FLOPs / 790 TFLOP/s)`.
    pub fn floor_seconds(&self) -> f64 {
        (self.bytes() / H200_COPY_BYTES_PER_S).max(self.flops / H200_BF16_FLOPS)
    }

    /// Which side of the roofline bounds the floor.
    pub fn bound(&self) -> &'static str {
        if self.bytes() / H200_COPY_BYTES_PER_S >= self.flops / H200_BF16_FLOPS {
            "bytes"
        } else {
            "FLOPs"
        }
    }
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, other: Cost) -> Cost {
        Cost {
            weight_bytes: self.weight_bytes + other.weight_bytes,
            state_bytes: self.state_bytes + other.state_bytes,
            flops: self.flops + other.flops,
        }
    }
}

impl std::iter::Sum for Cost {
    fn sum<I: Iterator<Item = Cost>>(iter: I) -> Cost {
        iter.fold(Cost::default(), |a, b| a + b)
    }
}

/// Bytes of an FP8 `[out, inp]` weight with one UE8M0 scale per 32×32 tile.
fn fp8_bytes(out: usize, inp: usize) -> f64 {
    (out * inp + out.div_ceil(32) * inp.div_ceil(32)) as f64
}

/// Bytes of a packed FP4 `[out, inp]` weight with one UE8M0 scale per 1×32 group.
fn fp4_bytes(out: usize, inp: usize) -> f64 {
    (out * inp / 2 + out * inp.div_ceil(32)) as f64
}

/// Bytes of one routed expert (`w1`, `w3` `[I, d]`, `w2` `[d, I]`, FP4): 18.8 MB at real width.
pub fn expert_bytes(cfg: &ModelConfig) -> f64 {
    2.0 * fp4_bytes(cfg.moe_inter_dim, cfg.dim) + fp4_bytes(cfg.dim, cfg.moe_inter_dim)
}

/// Expected distinct routed experts per layer that `tokens` tokens touch under uniform top-k
/// routing: `E · (1 − (1 − k/E)^tokens)` (spec §7.3).
pub fn expected_experts(cfg: &ModelConfig, tokens: usize) -> f64 {
    let experts = cfg.n_routed_experts as f64;
    let miss = 1.0 - cfg.n_activated_experts as f64 / experts;
    experts * (1.0 - miss.powi(tokens.min(i32::MAX as usize) as i32))
}

/// Weight bytes a step reads once whatever the batch, routed experts, embedding rows and Engram
/// table rows excluded. Per layer (d model width, q q-LoRA rank, H×D heads, G×L grouped output,
/// h mHC streams, E experts of width I, Nh×Ik index heads):
/// `fp8(q,d) + fp8(H·D,q) + fp8(D,d) + fp8(G·L, H·D/G) + fp8(d, G·L)` (attention),
/// `2 · 4·(2+h)·h·h·d` (mHC projections, f32), `2·E·d` (router, bf16), `2·fp8(I,d) + fp8(d,I)`
/// (shared expert); KV sources add the compressor `2·D·d` (+ the same for the gate at ratio > 1)
/// and the index-key projection `2·Ik·D` (bf16); index sources add `fp8(Nh·Ik, q) + 2·Nh·d`;
/// Engram layers `fp8((h+1)·d, lookups·Eh) + 2·2·h·d`. Globally: the head `2·V·d` (bf16) and, with
/// DSpark, `main_proj` `fp8(d, taps·d)` plus each stage's window projection `fp8(D, d)` (the
/// context feed that runs with every forward).
pub fn dense_weight_bytes(cfg: &ModelConfig) -> f64 {
    let (d, q, hd) = (cfg.dim, cfg.q_lora_rank, cfg.n_heads * cfg.head_dim);
    let grouped = cfg.o_groups * cfg.o_lora_rank;
    let hc = cfg.hc.mult;
    let per_layer = fp8_bytes(q, d)
        + fp8_bytes(hd, q)
        + fp8_bytes(cfg.head_dim, d)
        + fp8_bytes(grouped, hd / cfg.o_groups)
        + fp8_bytes(d, grouped)
        + 2.0 * (4 * (2 + hc) * hc * hc * d) as f64
        + (2 * cfg.n_routed_experts * d) as f64
        + 2.0 * fp8_bytes(cfg.moe_inter_dim, d)
        + fp8_bytes(d, cfg.moe_inter_dim);
    let mut bytes = cfg.n_layers as f64 * per_layer + (2 * cfg.vocab_size * d) as f64;
    for l in 0..cfg.n_layers {
        let ratio = cfg.compress_ratio(l);
        if cfg.is_kv_source(l) && ratio > 0 {
            let gates = if ratio > 1 { 2 } else { 1 };
            bytes += (gates * 2 * cfg.head_dim * d + 2 * cfg.index_head_dim * cfg.head_dim) as f64;
        }
        if cfg.is_index_source(l) && ratio > 0 {
            bytes += fp8_bytes(cfg.index_n_heads * cfg.index_head_dim, q)
                + (2 * cfg.index_n_heads * d) as f64;
        }
        if let Some(engram) = engram_layer(cfg, l) {
            bytes +=
                fp8_bytes((hc + 1) * d, engram.lookups * engram.head_dim) + (2 * 2 * hc * d) as f64;
        }
    }
    if let Some(dspark) = &cfg.dspark {
        bytes += fp8_bytes(d, dspark.target_layers.len() * d)
            + dspark.n_stages as f64 * fp8_bytes(cfg.head_dim, d);
    }
    bytes
}

/// The Engram geometry of layer `l`, if it has a table.
struct EngramLayer {
    /// Rows gathered per token: `(max_ngram − 1) · heads`.
    lookups: usize,
    head_dim: usize,
}

fn engram_layer(cfg: &ModelConfig, l: usize) -> Option<EngramLayer> {
    let engram = cfg.engram.as_ref()?;
    engram.layer_ids.contains(&l).then(|| EngramLayer {
        lookups: (engram.max_ngram_size - 1) * engram.n_heads,
        head_dim: engram.head_dim,
    })
}

/// FLOPs and state bytes of one token at absolute position `p` (the sequence then holds `p + 1`
/// tokens), without the head. Per layer of ratio r:
/// projections `2·(q·d + H·D·q + D·d + G·L·H·D/G + d·G·L)`; mHC `2 · 2·(2+h)·h·h·d`;
/// MoE `2·E·d + (k + 1) · 3 · 2·I·d`; attention `4·H·D·keys` over
/// `keys = min(W, p+1) + sel`, `sel = min(topk, ⌊(p+1)/r⌋)` (0 at r = 0), reading
/// `min(W, p+1)·(D + D/32) + sel·(D/2 + D/16)` bytes; KV sources `2·D·d` per gate (2 at r > 1)
/// plus `2·Ik·D` when the token completes a group; index sources `2·(Nh·Ik·q + Nh·d)` plus
/// `2·Nh·Ik·vis` scores over `vis = ⌊(p+1)/r⌋` keys reading `vis·(Ik/2 + Ik/32)` bytes. Engram
/// layers: `2·(h+1)·d·lookups·Eh` and `lookups·(Eh + Eh/32)` bytes of rows. Embedding: one `2·d`
/// byte row. DSpark context feed: `2·d·taps·d + stages · 2·D·d`.
pub fn token_cost(cfg: &ModelConfig, p: usize) -> Cost {
    let (d, q, hd) = (cfg.dim, cfg.q_lora_rank, cfg.n_heads * cfg.head_dim);
    let (big_d, hc) = (cfg.head_dim, cfg.hc.mult);
    let grouped = cfg.o_groups * cfg.o_lora_rank;
    let per_layer_flops = 2
        * (q * d + hd * q + big_d * d + grouped * hd / cfg.o_groups + d * grouped)
        + 2 * 2 * (2 + hc) * hc * hc * d
        + 2 * cfg.n_routed_experts * d
        + (cfg.n_activated_experts + cfg.n_shared_experts) * 3 * 2 * cfg.moe_inter_dim * d;
    let mut flops = (cfg.n_layers * per_layer_flops) as f64;
    let mut state = (2 * d) as f64;
    let seen = p + 1;
    let window = cfg.window_size.min(seen);
    for l in 0..cfg.n_layers {
        let ratio = cfg.compress_ratio(l);
        let visible = seen.checked_div(ratio).unwrap_or(0);
        let selected = cfg.index_topk.min(visible);
        flops += (4 * cfg.n_heads * big_d * (window + selected)) as f64;
        state += (window * (big_d + big_d / 32) + selected * (big_d / 2 + big_d / 16)) as f64;
        if cfg.is_kv_source(l) && ratio > 0 {
            let gates = if ratio > 1 { 2 } else { 1 };
            flops += (gates * 2 * big_d * d) as f64;
            if seen.is_multiple_of(ratio) {
                flops += (2 * cfg.index_head_dim * big_d) as f64;
            }
        }
        if cfg.is_index_source(l) && ratio > 0 {
            let (heads, ik) = (cfg.index_n_heads, cfg.index_head_dim);
            flops += (2 * (heads * ik * q + heads * d) + 2 * heads * ik * visible) as f64;
            state += (visible * (ik / 2 + ik / 32)) as f64;
        }
        if let Some(engram) = engram_layer(cfg, l) {
            let width = engram.lookups * engram.head_dim;
            flops += (2 * (hc + 1) * d * width) as f64;
            state += (engram.lookups * (engram.head_dim + engram.head_dim / 32)) as f64;
        }
    }
    if let Some(dspark) = &cfg.dspark {
        flops += (2 * d * dspark.target_layers.len() * d + dspark.n_stages * 2 * big_d * d) as f64;
    }
    Cost {
        weight_bytes: 0.0,
        state_bytes: state,
        flops,
    }
}

/// FLOPs of one logits row (`2·V·d`, fp32 head).
fn head_flops(cfg: &ModelConfig) -> f64 {
    (2 * cfg.vocab_size * cfg.dim) as f64
}

/// One decode step: every sequence `i` appends one token at position `positions[i]` and gets one
/// logits row. Weights: [`dense_weight_bytes`] once plus `L · E(B) · expert` routed bytes
/// ([`expected_experts`] for `B` tokens); state and FLOPs: the sum of [`token_cost`] and one head
/// row per sequence.
pub fn decode_step(cfg: &ModelConfig, positions: &[usize]) -> Cost {
    let tokens: Cost = positions.iter().map(|&p| token_cost(cfg, p)).sum();
    Cost {
        weight_bytes: dense_weight_bytes(cfg)
            + cfg.n_layers as f64 * expected_experts(cfg, positions.len()) * expert_bytes(cfg),
        state_bytes: tokens.state_bytes,
        flops: tokens.flops + positions.len() as f64 * head_flops(cfg),
    }
}

/// A prefill of `len` tokens into an empty sequence with only the last logits row (see
/// [`prefill_step`]).
pub fn prefill(cfg: &ModelConfig, len: usize) -> Cost {
    prefill_step(cfg, &[len])
}

/// One step prefilling a prompt of `lens[i]` tokens into each of `lens.len()` empty sequences,
/// one pass over all their rows with the last logits row of each: weights once (experts:
/// [`expected_experts`] for all the step's tokens), [`token_cost`] at positions `0..len` of every
/// prompt, one head row per prompt.
pub fn prefill_step(cfg: &ModelConfig, lens: &[usize]) -> Cost {
    let tokens: Cost = lens
        .iter()
        .flat_map(|&len| 0..len)
        .map(|p| token_cost(cfg, p))
        .sum();
    let total: usize = lens.iter().sum();
    Cost {
        weight_bytes: dense_weight_bytes(cfg)
            + cfg.n_layers as f64 * expected_experts(cfg, total) * expert_bytes(cfg),
        state_bytes: tokens.state_bytes,
        flops: tokens.flops + lens.len() as f64 * head_flops(cfg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v41_block::{BlockWidth, block_config};

    #[test]
    fn real_width_expert_and_layer_match_the_spec_figures() {
        let cfg = block_config(BlockWidth::Real, 1024, 4096);
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
        let cfg = block_config(BlockWidth::Real, 1024, 4096);
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
        let cfg = block_config(BlockWidth::Real, 1024, 4096);
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
}
