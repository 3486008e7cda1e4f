//! The tensor inventory of a V4.1 text checkpoint (spec §6.2 and §3.10): every tensor name, its
//! storage format and shape, derived from a [`ModelConfig`]. The synthetic writer fills exactly these
//! tensors, and tests compare the list against the golden fixture. Vision-tower tensors (`vision.*`,
//! `aligner.*`) are not listed; the three `image_*` vectors are, when the config has a vision tower.

use safetensors::Dtype;

use crate::config::ModelConfig;
use crate::weights::FP4_GROUP;

use super::FP8_BLOCK;

/// How a tensor is stored, with the parameters its synthetic initialisation needs.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorKind {
    /// `<name>` is the prefix of an FP8 E4M3 `.weight` `[out, inp]` + F8_E8M0 `.scale` 32×32 tiles.
    Fp8 { out: usize, inp: usize },
    /// `<name>` is the prefix of an FP8 E4M3 `.weight` `[out, inp]` + F8_E8M0 `.scale`
    /// `[⌈out/block⌉, ⌈inp/block⌉]` (`block × block` tiles; 128 in official V4).
    Fp8Tiled {
        out: usize,
        inp: usize,
        block: usize,
    },
    /// `<name>` is the prefix of a packed FP4 `.weight` I8 `[out, inp/2]` + F8_E8M0 `.scale` `[out, inp/32]`.
    Fp4 { out: usize, inp: usize },
    /// `<name>` is the prefix of an Engram table: F8_E4M3 `.weight` `[rows, width]` + F8_E8M0 `.scale`
    /// `[rows, width/32]` (one scale per row group of 32).
    Fp8Rows { rows: usize, width: usize },
    /// A plain BF16 tensor.
    Bf16 { shape: Vec<usize>, init: Init },
    /// A plain F32 tensor.
    F32 { shape: Vec<usize>, init: Init },
    /// An I64 `[rows, k]` routing table (`tid2eid`): row `t` holds the `k` distinct experts
    /// (`< n_experts`) of token `t`.
    ExpertTable {
        rows: usize,
        k: usize,
        n_experts: usize,
    },
}

/// Synthetic initialisation of a plain tensor (statistics of the released checkpoint, as measured
/// in the golden fixture).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// `N(0, std²)`.
    Normal { std: f32 },
    /// An RMSNorm weight: `mean · (1 + 0.1·N(0, 1))`.
    NormWeight { mean: f32 },
}

impl TensorKind {
    /// A plain F32 tensor of `shape` drawn from a normal distribution of `std`.
    pub fn f32_normal(shape: Vec<usize>, std: f32) -> TensorKind {
        TensorKind::F32 {
            shape,
            init: Init::Normal { std },
        }
    }
}

/// One inventory entry: a tensor name (or the `.weight`/`.scale` prefix of a quantised pair).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub kind: TensorKind,
}

impl TensorSpec {
    /// The stored tensors of this entry: `(name, dtype, shape)`, one or two of them.
    pub fn stored(&self) -> Vec<(String, Dtype, Vec<usize>)> {
        let pair = |weight_dtype, weight_shape: Vec<usize>, scale_shape: Vec<usize>| {
            vec![
                (format!("{}.weight", self.name), weight_dtype, weight_shape),
                (format!("{}.scale", self.name), Dtype::F8_E8M0, scale_shape),
            ]
        };
        match &self.kind {
            TensorKind::Fp8 { out, inp } => pair(
                Dtype::F8_E4M3,
                vec![*out, *inp],
                vec![out.div_ceil(FP8_BLOCK), inp.div_ceil(FP8_BLOCK)],
            ),
            TensorKind::Fp8Tiled { out, inp, block } => pair(
                Dtype::F8_E4M3,
                vec![*out, *inp],
                vec![out.div_ceil(*block), inp.div_ceil(*block)],
            ),
            TensorKind::Fp4 { out, inp } => {
                pair(Dtype::I8, vec![*out, inp / 2], vec![*out, inp / FP4_GROUP])
            }
            TensorKind::Fp8Rows { rows, width } => pair(
                Dtype::F8_E4M3,
                vec![*rows, *width],
                vec![*rows, width / FP8_BLOCK],
            ),
            TensorKind::Bf16 { shape, .. } => vec![(self.name.clone(), Dtype::BF16, shape.clone())],
            TensorKind::F32 { shape, .. } => vec![(self.name.clone(), Dtype::F32, shape.clone())],
            TensorKind::ExpertTable { rows, k, .. } => {
                vec![(self.name.clone(), Dtype::I64, vec![*rows, *k])]
            }
        }
    }

    /// Bytes on disk (weights + scales).
    pub fn stored_bytes(&self) -> usize {
        self.stored()
            .iter()
            .map(|(_, dtype, shape)| shape.iter().product::<usize>() * dtype.bitsize() / 8)
            .sum()
    }
}

/// RMS of the released embedding (and of the Markov embedding), measured on the checkpoint.
pub(super) const EMBED_STD: f32 = 0.12;
/// Std of 1-D parameters without a norm role (biases, sinks, hc base/scale, image vectors).
pub(super) const VECTOR_STD: f32 = 0.5;

/// Projection std as a multiple of `fan_in^-0.5`, by the projection's last name component
/// (released-checkpoint statistics; 1.0 for anything not listed).
fn gain(name: &str) -> f32 {
    match name.rsplit('.').next().unwrap_or(name) {
        "wq_a" | "wo_a" => 1.6,
        "wq_b" => 0.95,
        "wkv" => 1.8,
        "wo_b" => 1.9,
        "gate" => 2.9,
        "w1" | "w3" => 1.5,
        "w2" => 1.05,
        _ => 1.0,
    }
}

/// Fan-in-scaled std of a projection named `name` with input width `fan_in`.
pub fn projection_std(name: &str, fan_in: usize) -> f32 {
    gain(name) / (fan_in as f32).sqrt()
}

/// Builds the inventory list with small helpers for each storage kind.
struct Inventory {
    specs: Vec<TensorSpec>,
}

impl Inventory {
    fn push(&mut self, name: String, kind: TensorKind) {
        self.specs.push(TensorSpec { name, kind });
    }

    fn fp8(&mut self, prefix: String, out: usize, inp: usize) {
        self.push(prefix, TensorKind::Fp8 { out, inp });
    }

    fn fp4(&mut self, prefix: String, out: usize, inp: usize) {
        self.push(prefix, TensorKind::Fp4 { out, inp });
    }

    fn norm(&mut self, prefix: String, width: usize, mean: f32) {
        self.push(
            format!("{prefix}.weight"),
            TensorKind::Bf16 {
                shape: vec![width],
                init: Init::NormWeight { mean },
            },
        );
    }

    fn bf16_matrix(&mut self, name: String, rows: usize, cols: usize, std: f32) {
        self.push(
            name,
            TensorKind::Bf16 {
                shape: vec![rows, cols],
                init: Init::Normal { std },
            },
        );
    }

    /// A bf16 `[out, inp]` projection `<prefix>.weight` with fan-in-scaled std.
    fn bf16_projection(&mut self, prefix: String, out: usize, inp: usize) {
        let std = projection_std(&prefix, inp);
        self.bf16_matrix(format!("{prefix}.weight"), out, inp, std);
    }

    fn f32_tensor(&mut self, name: String, shape: Vec<usize>, std: f32) {
        self.push(name, TensorKind::f32_normal(shape, std));
    }

    /// Norms, mHC, attention (window part) and the MoE of one block; shared by backbone layers and
    /// DSpark stages.
    fn block(&mut self, cfg: &ModelConfig, prefix: &str, n_experts: usize) {
        let dim = cfg.dim;
        let hc = cfg.hc.mult;
        let mix = (2 + hc) * hc;
        let inner = cfg.n_heads * cfg.head_dim;
        let grouped = cfg.o_groups * cfg.o_lora_rank;
        let inter = cfg.moe_inter_dim;
        let shared = cfg.moe_inter_dim * cfg.n_shared_experts;

        self.norm(format!("{prefix}attn_norm"), dim, 0.025);
        self.norm(format!("{prefix}ffn_norm"), dim, 0.2);
        for site in ["attn", "ffn"] {
            let fan_in = hc * dim;
            self.f32_tensor(
                format!("{prefix}hc_{site}_fn"),
                vec![mix, fan_in],
                projection_std("hc_fn", fan_in),
            );
            self.f32_tensor(format!("{prefix}hc_{site}_base"), vec![mix], VECTOR_STD);
            self.f32_tensor(format!("{prefix}hc_{site}_scale"), vec![3], VECTOR_STD);
        }
        self.f32_tensor(
            format!("{prefix}attn.attn_sink"),
            vec![cfg.n_heads],
            VECTOR_STD,
        );
        self.norm(format!("{prefix}attn.q_norm"), cfg.q_lora_rank, 0.97);
        self.norm(format!("{prefix}attn.kv_norm"), cfg.head_dim, 0.4);
        self.fp8(format!("{prefix}attn.wq_a"), cfg.q_lora_rank, dim);
        self.fp8(format!("{prefix}attn.wq_b"), inner, cfg.q_lora_rank);
        self.fp8(format!("{prefix}attn.wkv"), cfg.head_dim, dim);
        self.fp8(format!("{prefix}attn.wo_a"), grouped, inner / cfg.o_groups);
        self.fp8(format!("{prefix}attn.wo_b"), dim, grouped);

        self.bf16_projection(format!("{prefix}ffn.gate"), n_experts, dim);
        self.f32_tensor(
            format!("{prefix}ffn.gate.bias"),
            vec![n_experts],
            VECTOR_STD,
        );
        self.f32_tensor(
            format!("{prefix}ffn.gate.bias_vl"),
            vec![n_experts],
            VECTOR_STD,
        );
        for expert in 0..n_experts {
            let p = format!("{prefix}ffn.experts.{expert}");
            self.fp4(format!("{p}.w1"), inter, dim);
            self.fp4(format!("{p}.w2"), dim, inter);
            self.fp4(format!("{p}.w3"), inter, dim);
        }
        self.fp8(format!("{prefix}ffn.shared_experts.w1"), shared, dim);
        self.fp8(format!("{prefix}ffn.shared_experts.w2"), dim, shared);
        self.fp8(format!("{prefix}ffn.shared_experts.w3"), shared, dim);
    }

    /// Compressor and indexer tensors of a backbone layer (only KV / index sources have them).
    fn compressed_attention(&mut self, cfg: &ModelConfig, layer: usize, prefix: &str) {
        let dim = cfg.dim;
        if cfg.is_kv_source(layer) {
            self.bf16_projection(format!("{prefix}attn.compressor.wkv"), cfg.head_dim, dim);
            if cfg.compress_ratio(layer) > 1 {
                self.bf16_projection(format!("{prefix}attn.compressor.wgate"), cfg.head_dim, dim);
            }
            self.norm(format!("{prefix}attn.compressor.norm"), cfg.head_dim, 0.6);
            self.bf16_projection(
                format!("{prefix}attn.indexer.wk"),
                cfg.index_head_dim,
                cfg.head_dim,
            );
            self.norm(
                format!("{prefix}attn.indexer.k_norm"),
                cfg.index_head_dim,
                0.5,
            );
        }
        if cfg.is_index_source(layer) {
            self.fp8(
                format!("{prefix}attn.indexer.wq_b"),
                cfg.index_n_heads * cfg.index_head_dim,
                cfg.q_lora_rank,
            );
            self.bf16_projection(
                format!("{prefix}attn.indexer.weights_proj"),
                cfg.index_n_heads,
                dim,
            );
        }
    }

    fn engram(&mut self, cfg: &ModelConfig, layer: usize, prefix: &str) {
        let Some(engram) = &cfg.engram else { return };
        let Some(table) = engram.layer_ids.iter().position(|&id| id == layer) else {
            return;
        };
        let rows = engram.num_embeddings[table];
        let lookups = (engram.max_ngram_size - 1) * engram.n_heads;
        self.push(
            format!("{prefix}engram.embed"),
            TensorKind::Fp8Rows {
                rows,
                width: engram.head_dim,
            },
        );
        self.fp8(
            format!("{prefix}engram.wkv"),
            (cfg.hc.mult + 1) * cfg.dim,
            lookups * engram.head_dim,
        );
        // The gate's q/k weights are O(1) (the fixture redraws them N(0, 1) so the gate is not flat).
        for name in ["q_weight", "k_weight"] {
            self.bf16_matrix(format!("{prefix}engram.{name}"), cfg.hc.mult, cfg.dim, 1.0);
        }
    }
}

/// Every tensor of a V4.1 text checkpoint for `cfg`, in model order: embeddings, backbone layers,
/// final norm and head, DSpark stages.
pub fn v41_inventory(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut inv = Inventory { specs: Vec::new() };
    inv.bf16_matrix("embed.weight".into(), cfg.vocab_size, cfg.dim, EMBED_STD);
    if cfg.vision.is_some() {
        for name in ["image_start", "image_end", "image_newline"] {
            inv.push(
                name.into(),
                TensorKind::Bf16 {
                    shape: vec![cfg.dim],
                    init: Init::Normal { std: VECTOR_STD },
                },
            );
        }
    }
    for layer in 0..cfg.n_layers {
        let prefix = format!("layers.{layer}.");
        inv.block(cfg, &prefix, cfg.n_routed_experts);
        inv.compressed_attention(cfg, layer, &prefix);
        inv.engram(cfg, layer, &prefix);
    }
    inv.norm("norm".into(), cfg.dim, 1.0);
    inv.bf16_projection("head".into(), cfg.vocab_size, cfg.dim);
    if let Some(dspark) = &cfg.dspark {
        for stage in 0..dspark.n_stages {
            let prefix = format!("mtp.{stage}.");
            inv.block(cfg, &prefix, dspark.n_routed_experts);
            if stage == 0 {
                inv.fp8(
                    format!("{prefix}main_proj"),
                    cfg.dim,
                    dspark.target_layers.len() * cfg.dim,
                );
                inv.norm(format!("{prefix}main_norm"), cfg.dim, 1.0);
            }
            if stage + 1 == dspark.n_stages {
                inv.norm(format!("{prefix}norm"), cfg.dim, 1.0);
                inv.bf16_matrix(
                    format!("{prefix}markov_head.embed.weight"),
                    cfg.vocab_size,
                    dspark.markov_rank,
                    EMBED_STD,
                );
                inv.bf16_projection(
                    format!("{prefix}markov_head.head"),
                    cfg.vocab_size,
                    dspark.markov_rank,
                );
                inv.bf16_projection(
                    format!("{prefix}confidence_head.proj"),
                    1,
                    cfg.dim + dspark.markov_rank,
                );
            }
        }
    }
    inv.specs
}
