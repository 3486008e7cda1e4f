//! The bytes and FLOPs a V4.1 or V4 forward needs, computed from the config alone (spec
//! v41-architecture.md §7, v4-architecture.md §1.2, §3.4, §6), whole steps of a DP/EP rank built
//! from them, and the device time a step takes on a given GPU (`device`: peaks per architecture,
//! efficiencies calibrated against the H200 measurements of bench/README.md).
//!
//! It lives in the model crate because it is a function of the model's config and nothing else:
//! the bench (roofline columns, calibration) and the actors' simulated devices
//! (`deepinfer-node --simulate`) both sit above this crate, so both use the same formulas without
//! breaking the dependency direction (the topology crate, below, cannot see `ModelConfig`).
//!
//! Counted is what the step *needs*, not what this implementation moves: weights at their
//! checkpoint width (FP8 1 B + one UE8M0 byte per scale tile: 32×32 in V4.1, 128×128 in V4; FP4
//! ½ B + one byte per 32, bf16 2 B, f32 4 B), each distinct weight once per step however many
//! sequences read it, plus the per-query KV/state reads at their cache width ([`CacheWidths`]:
//! V4.1's window FP8 + UE8M0 per 32, compressed KV FP4 + E4M3 per 16, index keys FP4 + UE8M0 per
//! 32; V4's FP8 serving layout of spec §3.4 with FP4 index keys). FLOPs are 2 per multiply-add of
//! the GEMMs, the mHC projections, the attention core and the index scores; element-wise work
//! (norms, RoPE, QDQ, Sinkhorn, SwiGLU) and 1-D vectors (norm weights, biases, sinks) are left
//! out (< 0.1 %). V4's MTP block and hash-routing tables are not counted (a drafter's step and
//! one table row per token).

pub mod device;
pub mod step;

use step::{StepEntry, StepWork};

use crate::config::{ExpertDtype, ModelConfig, V4Attention, V4Mlp};

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

/// Bytes of an FP8 `[out, inp]` weight with one UE8M0 scale per tile of the config's
/// `weight_block` (32×32 in V4.1, 128×128 in V4).
fn fp8_bytes(cfg: &ModelConfig, out: usize, inp: usize) -> f64 {
    let [rows, cols] = cfg.quant.weight_block;
    (out * inp + out.div_ceil(rows) * inp.div_ceil(cols)) as f64
}

/// Bytes of a packed FP4 `[out, inp]` weight with one UE8M0 scale per 1×32 group.
fn fp4_bytes(out: usize, inp: usize) -> f64 {
    (out * inp / 2 + out * inp.div_ceil(32)) as f64
}

/// Bytes of one routed expert (`w1`, `w3` `[I, d]`, `w2` `[d, I]`, FP4 or FP8 as the config
/// says): 18.8 MB in V4.1-Flash, 13.4 MB in V4-Flash.
pub fn expert_bytes(cfg: &ModelConfig) -> f64 {
    let (d, i) = (cfg.dim, cfg.moe_inter_dim);
    match cfg.quant.expert_dtype {
        ExpertDtype::Fp4 => 2.0 * fp4_bytes(i, d) + fp4_bytes(d, i),
        ExpertDtype::Fp8 => 2.0 * fp8_bytes(cfg, i, d) + fp8_bytes(cfg, d, i),
    }
}

/// Bytes one query reads per cached vector, by family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheWidths {
    /// One window (raw KV) vector.
    pub window: usize,
    /// One compressed-KV entry.
    pub compressed: usize,
    /// One index key.
    pub index_key: usize,
}

impl CacheWidths {
    /// V4.1 (spec §7): window FP8 + UE8M0 per 32, compressed KV FP4 + E4M3 per 16, index keys
    /// FP4 + UE8M0 per 32. V4 (v4 spec §3.4): window and compressed entries in the FP8 serving
    /// layout (the `D − r` nope values FP8 with one UE8M0 per 64 padded to 8 bytes, the rope
    /// values bf16: 584 B at D 512, r 64), index keys FP4 with one f32 scale.
    pub fn of(cfg: &ModelConfig) -> CacheWidths {
        let (big_d, ik) = (cfg.head_dim, cfg.index_head_dim);
        if cfg.v4.is_some() {
            let nope = big_d - cfg.rope_head_dim;
            let fp8_vector = nope + 2 * cfg.rope_head_dim + nope.div_ceil(64).next_multiple_of(8);
            CacheWidths {
                window: fp8_vector,
                compressed: fp8_vector,
                index_key: ik / 2 + 4,
            }
        } else {
            CacheWidths {
                window: big_d + big_d / 32,
                compressed: big_d / 2 + big_d / 16,
                index_key: ik / 2 + ik / 32,
            }
        }
    }
}

/// The projections of layer `l` that feed its compressed caches, as output widths of bf16
/// weights read by every token (`[out, d]`), plus V4.1's index-key projection of a completed
/// entry (`[Ik, D]`, run once per group).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Compressors {
    /// Output features of the KV compressor and its gate, and of V4's indexer compressor.
    per_token_outputs: usize,
    /// Multiply-adds of V4.1's index-key projection per completed group.
    per_group_macs: usize,
}

/// [`Compressors`] of layer `l`: V4.1 KV sources `gates·D` (a gate at ratio > 1) and the index
/// key `Ik·D` per group; V4 every compressed layer `2·D` (kv and gate; CSA overlaps two
/// windows: `2·2·D`), its indexer (CSA) `2·2·Ik`.
fn compressors(cfg: &ModelConfig, l: usize) -> Compressors {
    let ratio = cfg.compress_ratio(l);
    if ratio == 0 || !cfg.is_kv_source(l) {
        return Compressors::default();
    }
    let (big_d, ik) = (cfg.head_dim, cfg.index_head_dim);
    match cfg.v4_attention(l) {
        Some(attention) => {
            let overlap = if attention == V4Attention::Csa { 2 } else { 1 };
            let indexer = if cfg.is_index_source(l) {
                2 * overlap * ik
            } else {
                0
            };
            Compressors {
                per_token_outputs: 2 * overlap * big_d + indexer,
                per_group_macs: 0,
            }
        }
        None => {
            let gates = if ratio > 1 { 2 } else { 1 };
            Compressors {
                per_token_outputs: gates * big_d,
                per_group_macs: ik * big_d,
            }
        }
    }
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
/// `2 · 4·(2+h)·h·h·d` (mHC projections, f32), `2·E·d` (router, bf16; not on V4's hash-routed
/// layers), `2·fp8(I,d) + fp8(d,I)` (shared expert); compressed layers add their
/// [`Compressors`] in bf16 (`2·out·d`, and V4.1's index key `2·Ik·D`); index sources add
/// `fp8(Nh·Ik, q) + 2·Nh·d`; Engram layers `fp8((h+1)·d, lookups·Eh) + 2·2·h·d`. Globally: the
/// head `2·V·d` (bf16), V4's hyper-head `4·h·h·d` (f32) and, with DSpark, `main_proj`
/// `fp8(d, taps·d)` plus each stage's window projection `fp8(D, d)` (the context feed that runs
/// with every forward).
pub fn dense_weight_bytes(cfg: &ModelConfig) -> f64 {
    let (d, q, hd) = (cfg.dim, cfg.q_lora_rank, cfg.n_heads * cfg.head_dim);
    let grouped = cfg.o_groups * cfg.o_lora_rank;
    let hc = cfg.hc.mult;
    let per_layer = fp8_bytes(cfg, q, d)
        + fp8_bytes(cfg, hd, q)
        + fp8_bytes(cfg, cfg.head_dim, d)
        + fp8_bytes(cfg, grouped, hd / cfg.o_groups)
        + fp8_bytes(cfg, d, grouped)
        + 2.0 * (4 * (2 + hc) * hc * hc * d) as f64
        + 2.0 * fp8_bytes(cfg, cfg.moe_inter_dim, d)
        + fp8_bytes(cfg, d, cfg.moe_inter_dim);
    let mut bytes = cfg.n_layers as f64 * per_layer + (2 * cfg.vocab_size * d) as f64;
    if cfg.has_hc_head() {
        bytes += (4 * hc * hc * d) as f64;
    }
    for l in 0..cfg.n_layers {
        if cfg.v4_mlp(l) != Some(V4Mlp::HashMoe) {
            bytes += (2 * cfg.n_routed_experts * d) as f64;
        }
        let compressors = compressors(cfg, l);
        bytes += (2 * compressors.per_token_outputs * d + 2 * compressors.per_group_macs) as f64;
        if cfg.is_index_source(l) && cfg.compress_ratio(l) > 0 {
            bytes += fp8_bytes(cfg, cfg.index_n_heads * cfg.index_head_dim, q)
                + (2 * cfg.index_n_heads * d) as f64;
        }
        if let Some(engram) = engram_layer(cfg, l) {
            bytes += fp8_bytes(cfg, (hc + 1) * d, engram.lookups * engram.head_dim)
                + (2 * 2 * hc * d) as f64;
        }
    }
    if let Some(dspark) = &cfg.dspark {
        bytes += fp8_bytes(cfg, d, dspark.target_layers.len() * d)
            + dspark.n_stages as f64 * fp8_bytes(cfg, cfg.head_dim, d);
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
/// tokens), without the head: the sum of [`token_parts`].
pub fn token_cost(cfg: &ModelConfig, p: usize) -> Cost {
    let parts = token_parts(cfg, p);
    Cost {
        weight_bytes: 0.0,
        state_bytes: parts.attention.state_bytes,
        flops: parts.dense_flops + parts.routed_flops + parts.attention.flops,
    }
}

/// One token's work, split by the kind of op that does it (a device runs them at different
/// fractions of its peaks: `device::Efficiency`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TokenParts {
    /// Context-free GEMMs of the dense weights: projections, mHC, router, shared expert,
    /// compressor and indexer projections, Engram, the DSpark context feed.
    pub dense_flops: f64,
    /// The token's routed experts (`k` of them).
    pub routed_flops: f64,
    /// Context-dependent work: attention core and index scores, and the KV / state bytes read.
    pub attention: Cost,
}

/// [`TokenParts`] of one token at absolute position `p`. Per layer of ratio r:
/// projections `2·(q·d + H·D·q + D·d + G·L·H·D/G + d·G·L)`; mHC `2 · 2·(2+h)·h·h·d`;
/// router `2·E·d` (not on V4's hash-routed layers); shared expert `s · 3 · 2·I·d`, routed
/// `k · 3 · 2·I·d`; attention `4·H·D·keys` over `keys = min(W, p+1) + sel`, where layers with
/// an index source select `sel = min(topk, ⌊(p+1)/r⌋)` entries and V4's HCA layers attend to all
/// `⌊(p+1)/r⌋` (0 at r = 0), reading `min(W, p+1)·window + sel·compressed` bytes
/// ([`CacheWidths`]); compressed layers run their [`Compressors`] (`2·out·d`, and V4.1's index
/// key `2·Ik·D` when the token completes a group); index sources add `2·(Nh·Ik·q + Nh·d)` plus
/// `2·Nh·Ik·vis` scores over `vis = ⌊(p+1)/r⌋` keys reading `vis·index_key` bytes. Engram
/// layers: `2·(h+1)·d·lookups·Eh` and `lookups·(Eh + Eh/32)` bytes of rows. Embedding: one `2·d`
/// byte row. V4's hyper-head: `2·h·h·d`. DSpark context feed: `2·d·taps·d + stages · 2·D·d`.
pub fn token_parts(cfg: &ModelConfig, p: usize) -> TokenParts {
    let (d, q, hd) = (cfg.dim, cfg.q_lora_rank, cfg.n_heads * cfg.head_dim);
    let (big_d, hc) = (cfg.head_dim, cfg.hc.mult);
    let grouped = cfg.o_groups * cfg.o_lora_rank;
    let widths = CacheWidths::of(cfg);
    let expert_flops = 3 * 2 * cfg.moe_inter_dim * d;
    let per_layer_dense = 2
        * (q * d + hd * q + big_d * d + grouped * hd / cfg.o_groups + d * grouped)
        + 2 * 2 * (2 + hc) * hc * hc * d
        + cfg.n_shared_experts * expert_flops;
    let mut dense = (cfg.n_layers * per_layer_dense) as f64;
    if cfg.has_hc_head() {
        dense += (2 * hc * hc * d) as f64;
    }
    let routed = (cfg.n_layers * cfg.n_activated_experts * expert_flops) as f64;
    let mut attention = 0.0;
    let mut state = (2 * d) as f64;
    let seen = p + 1;
    let window = cfg.window_size.min(seen);
    for l in 0..cfg.n_layers {
        if cfg.v4_mlp(l) != Some(V4Mlp::HashMoe) {
            dense += (2 * cfg.n_routed_experts * d) as f64;
        }
        let ratio = cfg.compress_ratio(l);
        let visible = seen.checked_div(ratio).unwrap_or(0);
        let attended = match cfg.index_source_of(l) {
            Some(_) => cfg.index_topk.min(visible),
            None => visible,
        };
        attention += (4 * cfg.n_heads * big_d * (window + attended)) as f64;
        state += (window * widths.window + attended * widths.compressed) as f64;
        let compressors = compressors(cfg, l);
        dense += (2 * compressors.per_token_outputs * d) as f64;
        if ratio > 0 && seen.is_multiple_of(ratio) {
            dense += (2 * compressors.per_group_macs) as f64;
        }
        if cfg.is_index_source(l) && ratio > 0 {
            let (heads, ik) = (cfg.index_n_heads, cfg.index_head_dim);
            dense += (2 * (heads * ik * q + heads * d)) as f64;
            attention += (2 * heads * ik * visible) as f64;
            state += (visible * widths.index_key) as f64;
        }
        if let Some(engram) = engram_layer(cfg, l) {
            let width = engram.lookups * engram.head_dim;
            dense += (2 * (hc + 1) * d * width) as f64;
            state += (engram.lookups * (engram.head_dim + engram.head_dim / 32)) as f64;
        }
    }
    if let Some(dspark) = &cfg.dspark {
        dense += (2 * d * dspark.target_layers.len() * d + dspark.n_stages * 2 * big_d * d) as f64;
    }
    TokenParts {
        dense_flops: dense,
        routed_flops: routed,
        attention: Cost {
            weight_bytes: 0.0,
            state_bytes: state,
            flops: attention,
        },
    }
}

/// FLOPs of one logits row (`2·V·d`, fp32 head).
pub fn head_flops(cfg: &ModelConfig) -> f64 {
    (2 * cfg.vocab_size * cfg.dim) as f64
}

/// One decode step: every sequence `i` appends one token at position `positions[i]` and gets one
/// logits row. Weights: [`dense_weight_bytes`] once plus `L · E(B) · expert` routed bytes
/// ([`expected_experts`] for `B` tokens); state and FLOPs: the sum of [`token_cost`] and one head
/// row per sequence.
pub fn decode_step(cfg: &ModelConfig, positions: &[usize]) -> Cost {
    let entries: Vec<StepEntry> = positions
        .iter()
        .map(|&start| StepEntry {
            start,
            tokens: 1,
            rows: 1,
        })
        .collect();
    StepWork::single_device(cfg, &entries, 0).total()
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
    let entries: Vec<StepEntry> = lens
        .iter()
        .map(|&tokens| StepEntry {
            start: 0,
            tokens,
            rows: 1,
        })
        .collect();
    StepWork::single_device(cfg, &entries, 0).total()
}
