//! Engram (spec §3.7): n-gram hash lookups gated into the hc residual streams before selected
//! backbone layers. This module owns the whole path: the compressed vocabulary and per-sequence
//! history (`hash`), the NumPy-compatible multipliers (`numpy_rng`), the prime bucket layout
//! (`primes`), the FP8 table (`lookup`) and the gate (`gate`).
//!
//! API for the forward pass:
//! - [`Engram::load`] — `Ok(None)` when the config has no Engram; validates the layout against
//!   `engram_num_embeddings`, the vocabulary against `engram_compressed_vocab_size`, and every
//!   tensor's dtype and shape.
//! - [`Engram::hash_chunk`] — once per chunk, before the embedding: row ids of every engram layer
//!   for the chunk's tokens (`dead[i]` = image-span token), appending to the sequence's
//!   [`EngramHistory`], hashed on the host ([`NgramHasher::hash_chunk`]). Roll back with
//!   [`EngramHistory::truncate`].
//! - [`Engram::apply`] — before block `layer_ids()[i]`, with `engram_layer_idx = i`: updates the
//!   streams `x` (`[n_tokens, hc_mult, dim]`, bf16 values) in place. Dead tokens are left as is.
//!   The table lookup ([`Backend::engram_gather`]), the `wkv` GEMM and the gate
//!   ([`Backend::engram_inject`]) run on the backend (a device backend keeps the tables in its
//!   memory). [`Engram::apply_step`] does the same for every sequence of a step at once, on the
//!   step's streams as a [`Tensor`] (they stay on the device).
//! - [`Engram::layer_index`] maps a backbone layer id to its `engram_layer_idx`.

pub mod gate;
pub mod hash;
pub mod lookup;
pub mod numpy_rng;
pub mod primes;

#[cfg(test)]
mod fixture_tests;

use std::ops::Range;
use std::path::PathBuf;

pub use gate::EngramGate;
pub use hash::{CompressedVocab, EngramHistory, EngramRows, NgramHasher, hash_multipliers};
pub use lookup::EngramTable;
pub use primes::EngramLayout;

use crate::backend::{Backend, EngramInjection, Tensor};
use crate::checkpoint::{Checkpoint, Dtype};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::weights::Fp8Weight;

/// One engram layer's weights.
#[derive(Debug, Clone)]
struct EngramLayer {
    table: EngramTable,
    /// `[(hc_mult + 1)·dim, columns·head_dim]`: hc_mult keys, then the value.
    wkv: Fp8Weight,
    gate: EngramGate,
}

/// The Engram of a model: the hashing parameters plus every engram layer's weights.
#[derive(Debug, Clone)]
pub struct Engram {
    hasher: NgramHasher,
    layer_ids: Vec<usize>,
    layers: Vec<EngramLayer>,
    dim: usize,
    hc_mult: usize,
}

fn config_error(field: &str, message: String) -> ModelError {
    ModelError::Config {
        file: PathBuf::from("config.json"),
        field: field.to_string(),
        message,
    }
}

impl Engram {
    /// Loads the Engram tables and projections of `cfg.engram` from `ckpt`; `vocab` is the
    /// tokenizer's compressed vocabulary (see [`CompressedVocab`] for the contract).
    pub fn load(
        ckpt: &Checkpoint,
        cfg: &ModelConfig,
        vocab: CompressedVocab,
    ) -> Result<Option<Engram>, ModelError> {
        let Some(ecfg) = &cfg.engram else {
            return Ok(None);
        };
        if ecfg.layer_ids.is_empty() {
            return Ok(None);
        }
        if vocab.distinct_count() != ecfg.compressed_vocab_size {
            return Err(config_error(
                "engram_compressed_vocab_size",
                format!(
                    "the tokenizer's compressed vocabulary has {} ids, the config says {} (every hash multiplier depends on it)",
                    vocab.distinct_count(),
                    ecfg.compressed_vocab_size
                ),
            ));
        }
        let pad_of_token = vocab.ids.get(ecfg.pad_token_id as usize).copied();
        if pad_of_token != Some(vocab.pad) {
            return Err(config_error(
                "engram_pad_token_id",
                format!(
                    "the compressed vocabulary's pad id {} is not the compressed id {pad_of_token:?} of token {}",
                    vocab.pad, ecfg.pad_token_id
                ),
            ));
        }
        let hasher = NgramHasher::new(
            &ecfg.layer_ids,
            ecfg.max_ngram_size,
            ecfg.n_heads,
            ecfg.vocab_size as u64,
            ecfg.compressed_vocab_size,
            vocab,
        )?;
        let layout = hasher.layout();
        let derived = layout.num_embeddings();
        if derived != ecfg.num_embeddings {
            return Err(config_error(
                "engram_num_embeddings",
                format!(
                    "the prime layout gives {derived:?} table rows, the config says {:?}",
                    ecfg.num_embeddings
                ),
            ));
        }
        let (dim, hc_mult) = (cfg.dim, cfg.hc.mult);
        let lookup_width = layout.columns() * ecfg.head_dim;
        let block = crate::checkpoint::FP8_BLOCK;
        if !lookup_width.is_multiple_of(block) {
            return Err(ModelError::Unsupported {
                what: format!(
                    "engram lookup width {lookup_width} (not a multiple of the FP8 block {block})"
                ),
            });
        }
        let groups = ecfg.head_dim / lookup::TABLE_SCALE_GROUP;
        let layers = ecfg
            .layer_ids
            .iter()
            .zip(&ecfg.num_embeddings)
            .map(|(&layer_id, &rows)| {
                let prefix = format!("layers.{layer_id}.engram");
                let weight_name = format!("{prefix}.embed.weight");
                let codes = ckpt.bytes(&weight_name, Dtype::F8_E4M3, &[rows, ecfg.head_dim])?;
                let scales = ckpt.bytes(
                    &format!("{prefix}.embed.scale"),
                    Dtype::F8_E8M0,
                    &[rows, groups],
                )?;
                let table = EngramTable::new(
                    &weight_name,
                    rows,
                    ecfg.head_dim,
                    codes.to_vec(),
                    scales.to_vec(),
                )?;
                let wkv =
                    ckpt.fp8_weight(&format!("{prefix}.wkv"), (hc_mult + 1) * dim, lookup_width)?;
                let q_weight = ckpt.bf16(&format!("{prefix}.q_weight"), &[hc_mult, dim])?;
                let k_weight = ckpt.bf16(&format!("{prefix}.k_weight"), &[hc_mult, dim])?;
                let gate = EngramGate::new(dim, hc_mult, &q_weight, &k_weight, cfg.norm_eps)
                    .ok_or_else(|| {
                        config_error("hidden_size", format!("dim {dim} with hc_mult {hc_mult}"))
                    })?;
                Ok(EngramLayer { table, wkv, gate })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Some(Engram {
            hasher,
            layer_ids: ecfg.layer_ids.clone(),
            layers,
            dim,
            hc_mult,
        }))
    }

    /// Backbone layer ids with an Engram, in `engram_layer_idx` order.
    pub fn layer_ids(&self) -> &[usize] {
        &self.layer_ids
    }

    /// The `engram_layer_idx` of backbone layer `layer_id`, if it has an Engram.
    pub fn layer_index(&self, layer_id: usize) -> Option<usize> {
        self.layer_ids.iter().position(|&id| id == layer_id)
    }

    /// The hashing parameters (layout and multipliers).
    pub fn hasher(&self) -> &NgramHasher {
        &self.hasher
    }

    /// Applies engram layer `engram_layer_idx` to the streams `x` (`[n_tokens, hc_mult, dim]`,
    /// bf16 values) of the chunk `rows` was hashed for ([`Engram::apply_step`] of one part, on
    /// host values). `dead` is empty or one flag per token; dead tokens have gate 0 and stay
    /// unchanged.
    ///
    /// # Panics
    /// If `engram_layer_idx` is not below `layer_ids().len()` or `x` is not
    /// `rows.n_tokens() · hc_mult · dim` long (caller bugs, not input errors).
    pub fn apply(
        &self,
        backend: &dyn Backend,
        engram_layer_idx: usize,
        rows: &EngramRows,
        x: &mut [f32],
        dead: &[bool],
    ) {
        let part = EngramPart {
            rows,
            span: 0..rows.n_tokens(),
            dead,
        };
        let token_width = self.hc_mult * self.dim;
        assert_eq!(
            x.len(),
            rows.n_tokens() * token_width,
            "engram streams must be [n_tokens={}, hc_mult={}, dim={}]",
            rows.n_tokens(),
            self.hc_mult,
            self.dim
        );
        let out = self.apply_step(backend, engram_layer_idx, &[part], Tensor::from(&*x));
        x.copy_from_slice(&out);
    }

    /// Applies engram layer `engram_layer_idx` to the streams (`[step rows, hc_mult, dim]`, bf16
    /// values) of a step's sequences, each `parts` entry one sequence's chunk: the table lookup,
    /// the `wkv` GEMM and the gate ([`Backend::engram_inject`]) of every live token of every part
    /// in one pass each, on the backend (the streams stay where they are).
    ///
    /// # Panics
    /// If `engram_layer_idx` is not below `layer_ids().len()`, or a part's span is not its
    /// `rows.n_tokens()` rows of the streams (caller bugs, not input errors).
    pub fn apply_step(
        &self,
        backend: &dyn Backend,
        engram_layer_idx: usize,
        parts: &[EngramPart<'_>],
        streams: Tensor,
    ) -> Tensor {
        let layer = &self.layers[engram_layer_idx];
        let token_width = self.hc_mult * self.dim;
        let mut live: Vec<usize> = Vec::new();
        let mut row_ids: Vec<u32> = Vec::new();
        for part in parts {
            let tokens = part.rows.n_tokens();
            assert!(
                part.span.len() == tokens && part.span.end * token_width <= streams.len(),
                "engram streams rows {:?} of a {}-value step must be [n_tokens={tokens}, \
                 hc_mult={}, dim={}]",
                part.span,
                streams.len(),
                self.hc_mult,
                self.dim
            );
            for token in (0..tokens).filter(|&t| !part.dead.get(t).copied().unwrap_or(false)) {
                live.push(part.span.start + token);
                row_ids.extend_from_slice(part.rows.of(token, engram_layer_idx));
            }
        }
        if live.is_empty() {
            return streams;
        }
        // `[live, columns · head_dim]`: each token's gathered rows side by side.
        let embedded = backend.engram_gather(&layer.table, &row_ids);
        let kv = backend.gemm_fp8(&embedded, &layer.wkv);
        backend.engram_inject(
            streams,
            EngramInjection {
                kv: &kv,
                live: &live,
                gate: &layer.gate,
            },
        )
    }
}

/// One sequence's part of [`Engram::apply_step`].
#[derive(Debug, Clone)]
pub struct EngramPart<'a> {
    /// The row ids hashed for the sequence's chunk ([`Engram::hash_chunk`]).
    pub rows: &'a EngramRows,
    /// The chunk's rows in the step's streams.
    pub span: Range<usize>,
    /// Empty, or one flag per token of the chunk: dead (image-span) tokens stay unchanged.
    pub dead: &'a [bool],
}
