//! The DeepSeek-V4.1 text model and its DSpark drafter on a [`Backend`] (spec §3): the public
//! [`Model`] / [`SequenceState`] API (every forward is a step, [`Model::forward_step`], whose
//! body is `step`; one sequence's chunk is a one-entry step), rollback, and greedy DSpark
//! proposals.

mod attention;
mod block;
pub mod context_parallel;
pub(crate) mod csa;
pub(crate) mod dspark;
pub(crate) mod state;
pub(crate) mod step;
mod trace;
pub mod vision;
pub(crate) mod weights;

use std::path::Path;
use std::sync::Arc;

pub use crate::layers::markov::DraftProposal;
pub use crate::layers::step::{EntryOutput, LogitsWanted};
pub use csa::top_k_lowest_index;
pub use state::{MAX_BACKTRACK, PrefixBlock, SequenceState};
pub use step::{LogitsRow, StepEntry, StepExtras, StepOptions};
pub use trace::{ForwardTrace, Injection};

use crate::backend::{Backend, CpuBackend, MoeLayer, Tensor};
use crate::checkpoint::{Checkpoint, ExpertFilter};
use crate::config::ModelConfig;
use crate::engram::{CompressedVocab, Engram};
use crate::error::ModelError;
use crate::layers::expert_hook::{Backbone, BackboneMoe};
use crate::layers::loaded::Loaded;
use state::{CompressorState, LayerState};
use weights::DsparkWeights;

/// A loaded V4.1 model (text backbone + DSpark heads) on a backend.
pub type Model = Loaded<ModelWeights>;

/// The V4.1 host weights, behind `Arc`s so that [`Loaded::on_backend`] shares them.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[vocab, dim]` bf16.
    embed: Arc<Vec<f32>>,
    /// `[vocab, dim]` bf16 values, used in fp32.
    head: Arc<Vec<f32>>,
    norm: Arc<Vec<f32>>,
    backbone: Backbone<weights::AttentionWeights>,
    engram: Option<Arc<Engram>>,
    dspark: Option<Arc<DsparkWeights>>,
    vision: Option<Arc<vision::VisionTower>>,
}

impl BackboneMoe for ModelWeights {
    type Attention = weights::AttentionWeights;

    fn backbone(&self) -> &Backbone<Self::Attention> {
        &self.backbone
    }

    fn idle_moe(backend: &dyn Backend, layer: &MoeLayer<'_>) {
        let _ = backend.moe_rows(&Tensor::empty(), layer);
    }
}

impl Model {
    /// Loads `dir/config.json` and the checkpoint in `dir` onto the CPU backend. A model with
    /// Engram needs the tokenizer-derived compressed vocabulary: see [`Model::load_with_vocab`].
    pub fn load(dir: &Path) -> Result<Model, ModelError> {
        Self::load_with_vocab(dir, None)
    }

    /// Like [`Model::load`], with the Engram compressed vocabulary (required when the config has
    /// Engram layers).
    pub fn load_with_vocab(
        dir: &Path,
        vocab: Option<CompressedVocab>,
    ) -> Result<Model, ModelError> {
        Self::load_experts(dir, vocab, &ExpertFilter::all())
    }

    /// Like [`Model::load_with_vocab`], reading only the backbone routed experts `experts` keeps
    /// (an expert-parallel process: the experts of its EP ranks); such a model runs its routed
    /// experts through an expert hook only (`StepOptions::experts`).
    pub fn load_experts(
        dir: &Path,
        vocab: Option<CompressedVocab>,
        experts: &ExpertFilter,
    ) -> Result<Model, ModelError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint_experts(cfg, &ckpt, vocab, Box::new(CpuBackend::new()), experts)
    }

    /// Builds the model from an opened checkpoint on `backend`.
    pub fn from_checkpoint(
        cfg: ModelConfig,
        ckpt: &Checkpoint,
        vocab: Option<CompressedVocab>,
        backend: Box<dyn Backend>,
    ) -> Result<Model, ModelError> {
        Self::from_checkpoint_experts(cfg, ckpt, vocab, backend, &ExpertFilter::all())
    }

    /// [`Model::from_checkpoint`] reading only the backbone routed experts `experts` keeps.
    pub fn from_checkpoint_experts(
        cfg: ModelConfig,
        ckpt: &Checkpoint,
        vocab: Option<CompressedVocab>,
        backend: Box<dyn Backend>,
        experts: &ExpertFilter,
    ) -> Result<Model, ModelError> {
        check_supported(&cfg)?;
        let (vocab_size, dim) = (cfg.vocab_size, cfg.dim);
        let layers = (0..cfg.n_layers)
            .map(|l| weights::load_block(ckpt, &cfg, &format!("layers.{l}."), Some(l), experts))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let engram = match (&cfg.engram, vocab) {
            (None, _) => None,
            (Some(_), Some(vocab)) => Engram::load(ckpt, &cfg, vocab)?.map(Arc::new),
            (Some(_), None) => {
                return Err(ModelError::Unsupported {
                    what: "a model with Engram layers needs the tokenizer's compressed vocabulary (Model::load_with_vocab)"
                        .to_string(),
                });
            }
        };
        let weights = ModelWeights {
            embed: Arc::new(ckpt.bf16("embed.weight", &[vocab_size, dim])?),
            head: Arc::new(ckpt.bf16("head.weight", &[vocab_size, dim])?),
            norm: Arc::new(ckpt.bf16("norm.weight", &[dim])?),
            backbone: Backbone::new(layers, ckpt, experts, |ckpt, cfg, layer, expert| {
                weights::routed_expert(ckpt, &format!("layers.{layer}."), cfg, expert)
            })?,
            engram,
            dspark: weights::load_dspark(ckpt, &cfg)?.map(Arc::new),
            vision: vision::VisionTower::load(ckpt, &cfg)?.map(Arc::new),
        };
        Ok(Loaded::new(cfg, backend, weights))
    }

    /// A fresh, empty sequence.
    pub fn new_sequence(&self) -> SequenceState {
        let layers = (0..self.cfg.n_layers)
            .map(|l| LayerState {
                window: Default::default(),
                compressor: self.weights.backbone.layers[l]
                    .attn
                    .compressor
                    .as_ref()
                    .map(|_| CompressorState::default()),
            })
            .collect();
        SequenceState::new(
            layers,
            self.weights.dspark.as_ref().map_or(0, |d| d.stages.len()),
        )
    }

    /// The first ratio-1 layer (the decoder boundary of bounded replay), if any.
    fn replay_boundary(&self) -> Option<usize> {
        self.cfg.compress_ratios.iter().position(|&r| r == 1)
    }

    /// Bounded replay needs every Engram layer below the boundary, every DSpark tap and every
    /// selection source of a decoder layer at or above it.
    fn check_replay_boundary(&self) -> Result<(), ModelError> {
        let Some(boundary) = self.replay_boundary() else {
            return Ok(());
        };
        let cfg = &self.cfg;
        let engram_above = cfg
            .engram
            .as_ref()
            .is_some_and(|e| e.layer_ids.iter().any(|&l| l >= boundary));
        let taps_below = cfg
            .dspark
            .as_ref()
            .is_some_and(|d| d.target_layers.iter().any(|&l| l < boundary));
        let sources_below = (boundary..cfg.n_layers)
            .any(|l| cfg.index_source_of(l).is_some_and(|s| s < boundary))
            || cfg
                .candidate
                .as_ref()
                .is_some_and(|c| c.source_layer < boundary);
        if engram_above || taps_below || sources_below {
            return Err(ModelError::Unsupported {
                what: format!(
                    "bounded replay with Engram layers, DSpark taps or selection sources on the wrong side of layer {boundary}"
                ),
            });
        }
        Ok(())
    }

    /// Drops everything after the first `len` tokens. Only the last [`MAX_BACKTRACK`] tokens can be
    /// dropped (the rings keep that much history); further back is an error.
    pub fn rollback(&self, seq: &mut SequenceState, len: usize) -> Result<(), ModelError> {
        seq.rollback(len, self.cfg.window_size, &self.cfg.compress_ratios)
    }

    /// A greedy DSpark proposal after the sequence's last token: `anchor` is the token just sampled
    /// (it will sit at position `seq.len()`); returns the anchor plus `block_size` drafts, the draft
    /// logits (Markov bias included) and the raw confidences. The one-request
    /// [`Model::draft_step`].
    pub fn draft(&self, seq: &SequenceState, anchor: u32) -> Result<DraftProposal, ModelError> {
        self.draft_step(&[(seq, anchor)]).pop().unwrap_or_else(|| {
            Err(ModelError::Sequence {
                message: "the drafter returned no result for one request".to_string(),
            })
        })
    }

    /// Greedy DSpark proposals for many sequences at once (`(sequence, anchor)` per request, as
    /// [`Model::draft`] takes them): the stages run once over the draft rows of every request and
    /// the heads over all of them; returns, per request and in order, its proposal — bitwise what
    /// [`Model::draft`] gives for it alone — or its own error (no processed token, an anchor
    /// outside the vocabulary, a sequence of another drafter; a model without DSpark fails every
    /// request). A failed request changes nothing and leaves the others' proposals as they are.
    /// Sequences are only read.
    pub fn draft_step(
        &self,
        requests: &[(&SequenceState, u32)],
    ) -> Vec<Result<DraftProposal, ModelError>> {
        let Some((weights, cfg_dspark)) =
            self.weights.dspark.as_ref().zip(self.cfg.dspark.as_ref())
        else {
            return requests
                .iter()
                .map(|_| {
                    Err(ModelError::Unsupported {
                        what: "DSpark drafting on a model without DSpark stages".to_string(),
                    })
                })
                .collect();
        };
        let checked: Vec<Result<(), ModelError>> = requests
            .iter()
            .map(|&(seq, anchor)| self.check_draft(seq, anchor, weights.stages.len(), cfg_dspark))
            .collect();
        let valid: Vec<dspark::DraftRequest<'_>> = requests
            .iter()
            .zip(&checked)
            .filter(|(_, check)| check.is_ok())
            .map(|(&(seq, anchor), _)| dspark::DraftRequest { seq, anchor })
            .collect();
        let mut proposals = dspark::propose_many(
            &self.ctx(),
            weights,
            cfg_dspark,
            &self.weights.embed,
            &self.weights.head,
            &valid,
        )
        .into_iter();
        checked
            .into_iter()
            .map(|check| {
                check?;
                proposals.next().ok_or_else(|| ModelError::Sequence {
                    message: "the drafter returned fewer proposals than requests".to_string(),
                })
            })
            .collect()
    }

    /// Whether a proposal can be drafted after `seq` for `anchor`.
    fn check_draft(
        &self,
        seq: &SequenceState,
        anchor: u32,
        stages: usize,
        dspark: &crate::config::DsparkConfig,
    ) -> Result<(), ModelError> {
        if seq.len == 0 {
            return Err(ModelError::Sequence {
                message: "drafting needs at least one processed token".to_string(),
            });
        }
        self.check_token(anchor)?;
        if seq.dspark.len() != stages {
            return Err(ModelError::Sequence {
                message: format!(
                    "the sequence has {} DSpark rings, the model {stages} stages",
                    seq.dspark.len()
                ),
            });
        }
        if dspark.block_size == 0
            || dspark.markov_rank == 0
            || dspark.noise_token_id as usize >= self.cfg.vocab_size
        {
            return Err(ModelError::Unsupported {
                what: format!(
                    "a DSpark block of {} slots, Markov rank {} and noise token {} (vocabulary {})",
                    dspark.block_size,
                    dspark.markov_rank,
                    dspark.noise_token_id,
                    self.cfg.vocab_size
                ),
            });
        }
        Ok(())
    }

    /// Whether `tokens` can be appended to `seq` (known ids, non-empty, within the positions):
    /// the check every forward runs first.
    pub fn check_chunk(&self, seq: &SequenceState, tokens: &[u32]) -> Result<(), ModelError> {
        self.check_tokens(seq.len, tokens)
    }
}

/// Rejects configs whose structure the forward pass does not implement.
fn check_supported(cfg: &ModelConfig) -> Result<(), ModelError> {
    let unsupported = |what: String| Err(ModelError::Unsupported { what });
    if cfg.family != crate::config::ModelFamily::V41 {
        return unsupported(format!(
            "a {:?}-family checkpoint in the V4.1 model (load it with deepinfer_model::v4::Model or any_model::AnyModel)",
            cfg.family
        ));
    }
    if cfg.quant.weight_block != [32, 32] {
        return unsupported(format!(
            "FP8 weight blocks {:?} (V4.1 uses [32, 32])",
            cfg.quant.weight_block
        ));
    }
    if cfg.n_shared_experts != 1 {
        return unsupported(format!(
            "{} shared experts (V4.1 has exactly 1)",
            cfg.n_shared_experts
        ));
    }
    let widths = [
        cfg.head_dim,
        cfg.index_head_dim,
        cfg.dim,
        cfg.moe_inter_dim,
        cfg.q_lora_rank,
        cfg.o_lora_rank,
    ];
    if widths.iter().any(|w| !w.is_multiple_of(32)) {
        return unsupported(format!(
            "widths {widths:?} (head, index head, model, expert, q LoRA, o LoRA) must be multiples of 32"
        ));
    }
    let bad_target = cfg
        .dspark
        .as_ref()
        .and_then(|d| d.target_layers.iter().find(|&&l| l >= cfg.n_layers));
    if let Some(bad) = bad_target {
        return unsupported(format!(
            "DSpark target layer {bad} beyond the {} backbone layers",
            cfg.n_layers
        ));
    }
    for l in 0..cfg.n_layers {
        if cfg.compress_ratio(l) > 0 && cfg.kv_source_of(l).is_none() {
            return unsupported(format!(
                "compressed layer {l} without a KV source at or below it"
            ));
        }
    }
    Ok(())
}
