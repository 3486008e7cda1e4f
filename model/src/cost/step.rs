//! Whole steps of one DP/EP rank: the work of every sequence of the step, split by op class
//! (`StepWork`), the routed experts an EP rank serves for the whole deployment, and the bytes
//! the MoE dispatch and combine move between GPUs.

use super::{Cost, dense_weight_bytes, expected_experts, expert_bytes, head_flops, token_parts};
use crate::config::ModelConfig;

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepEntry {
    /// Tokens the sequence held before the step (the position of its first new token).
    pub start: usize,
    /// Tokens fed in this step.
    pub tokens: usize,
    /// Logits rows computed (1, or every row of a DSpark verify).
    pub rows: usize,
}

/// A step's work on one rank, split by op class.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    /// Tokens fed through the backbone.
    pub tokens: usize,
    /// Dense weights (read once per step), their GEMMs, and the head rows.
    pub dense: Cost,
    /// Attention cores, index scores and the KV / state they read.
    pub attention: Cost,
    /// Routed experts: the weights of the distinct experts touched and their GEMMs.
    pub routed: Cost,
}

impl StepWork {
    /// All classes together.
    pub fn total(&self) -> Cost {
        self.dense + self.attention + self.routed
    }

    /// The work of `entries` plus `draft_rows` drafted tokens' logits rows (DSpark drafting
    /// runs the head once per drafted token) on one device that holds every expert: the
    /// routed weights touched are the [`expected_experts`] of the step's tokens in every layer.
    pub fn single_device(cfg: &ModelConfig, entries: &[StepEntry], draft_rows: usize) -> StepWork {
        let mut work = StepWork::backbone(cfg, entries, draft_rows);
        work.routed.weight_bytes =
            cfg.n_layers as f64 * expected_experts(cfg, work.tokens) * expert_bytes(cfg);
        work
    }

    /// The work of `entries` without the routed experts (an EP rank serves those for every DP
    /// rank: [`routed_served`]); dense weights are read once even for an empty step.
    pub fn backbone(cfg: &ModelConfig, entries: &[StepEntry], draft_rows: usize) -> StepWork {
        let mut work = StepWork {
            dense: Cost {
                weight_bytes: dense_weight_bytes(cfg),
                ..Cost::default()
            },
            ..StepWork::default()
        };
        let mut rows = draft_rows;
        for entry in entries {
            work.tokens += entry.tokens;
            rows += entry.rows;
            for p in entry.start..entry.start + entry.tokens {
                let parts = token_parts(cfg, p);
                work.dense.flops += parts.dense_flops;
                work.routed.flops += parts.routed_flops;
                work.attention = work.attention + parts.attention;
            }
        }
        work.dense.flops += rows as f64 * head_flops(cfg);
        work
    }
}

/// FLOPs of one routed pick (one token through one expert, every layer counted separately:
/// `3 · 2·I·d`).
pub fn pick_flops(cfg: &ModelConfig) -> f64 {
    (3 * 2 * cfg.moe_inter_dim * cfg.dim) as f64
}

/// The routed work of an EP rank that serves `picks` (token-expert pairs, all layers) on
/// `slots_touched` expert slots (all layers; each slot's weights are read once per step).
pub fn routed_served(cfg: &ModelConfig, picks: f64, slots_touched: f64) -> Cost {
    Cost {
        weight_bytes: slots_touched * expert_bytes(cfg),
        state_bytes: 0.0,
        flops: picks * pick_flops(cfg),
    }
}

/// Bytes one routed pick moves over the fabric when its expert is on another GPU: the
/// dispatched row in FP8 with one f32 scale per 128 channels (`d + d/32` bytes) and the
/// combined row back in bf16 (`2·d`), as DeepEP's low-latency kernels send them.
pub fn pick_fabric_bytes(cfg: &ModelConfig) -> f64 {
    (cfg.dim + cfg.dim / 32 + 2 * cfg.dim) as f64
}

/// Routed picks `tokens` tokens make in all layers (`L · k` each).
pub fn picks(cfg: &ModelConfig, tokens: usize) -> f64 {
    (tokens * cfg.n_layers * cfg.n_activated_experts) as f64
}
