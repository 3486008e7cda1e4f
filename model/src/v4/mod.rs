//! The DeepSeek-V4 text model (V4-Flash, V4-Flash-0731 backbone) on a [`Backend`], in the float32
//! numerics of its transformers reference (spec v4-architecture.md §2): the public [`Model`] /
//! [`SequenceState`] API, the forward pass over a chunk at the sequence's next positions (one
//! sequence, or several in one step: [`Model::forward_step`]), and rollback. Shared with V4.1:
//! the backend ops (RMSNorm, RoPE, mHC/Sinkhorn, attention with sink), the RoPE/YaRN tables, the
//! MoE with its expert-parallel side (`StepOptions::experts`, `ExpertHost`; a load with an
//! `ExpertFilter`: [`Model::load_experts`]) and the checkpoint loader. The speculative heads (which transformers does not load): the
//! V4-Flash MTP block ([`Model::mtp_logits`]) and the V4-Flash-0731 DSpark drafter
//! ([`Model::draft`]); their state lives in the [`SequenceState`].

mod attention;
mod block;
mod compressor;
mod dspark;
mod mtp;
mod state;
mod step;
mod weights;

use std::path::Path;
use std::sync::Arc;

use crate::backend::weights::Linear;
pub use state::{PrefixBlock, SequenceState};
pub use step::StepEntry;

pub use crate::layers::markov::DraftProposal;
pub use crate::layers::step::EntryOutput;

use crate::backend::{Backend, CpuBackend, MoeLayer, Tensor};
use crate::checkpoint::{Checkpoint, ExpertFilter};
use crate::config::{ModelConfig, ModelFamily, V4Attention};
use crate::error::ModelError;
use crate::layers::ctx::Ctx;
use crate::layers::expert_hook::{Backbone, BackboneMoe};
use crate::layers::loaded::Loaded;
use dspark::{DsparkWeights, ProposalInputs};
use mtp::MtpWeights;
use state::{CompressorCache, LayerState};
use weights::{HyperHeadWeights, Loader};

/// A loaded V4 model on a backend.
pub type Model = Loaded<ModelWeights>;

/// The V4 host weights; the large ones behind `Arc`s so that [`Loaded::on_backend`] shares them.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[vocab, dim]`.
    embed: Arc<Vec<f32>>,
    head: Arc<Linear>,
    norm: Vec<f32>,
    hyper_head: Arc<HyperHeadWeights>,
    backbone: Backbone<weights::AttentionWeights>,
    /// The V4-Flash MTP block (`mtp.0`), when the config has `num_nextn_predict_layers = 1`.
    mtp: Option<Arc<MtpWeights>>,
    /// The V4-Flash-0731 DSpark drafter, when the config has one.
    dspark: Option<Arc<DsparkWeights>>,
    /// `[head_dim]` ones: the weight of the unweighted per-head query RMSNorm.
    unit: Vec<f32>,
}

impl BackboneMoe for ModelWeights {
    type Attention = weights::AttentionWeights;

    fn backbone(&self) -> &Backbone<Self::Attention> {
        &self.backbone
    }

    fn idle_moe(backend: &dyn Backend, layer: &MoeLayer<'_>) {
        let _ = backend.moe_rows_exact(&Tensor::empty(), layer, None);
    }
}

impl Model {
    /// Loads `dir/config.json` and the checkpoint in `dir` (official names or the transformers
    /// spelling; FP8/FP4/BF16/F32) onto the CPU backend.
    pub fn load(dir: &Path) -> Result<Model, ModelError> {
        Model::load_experts(dir, &ExpertFilter::all())
    }

    /// Like [`Model::load`], reading only the backbone routed experts `experts` keeps (an
    /// expert-parallel process: the experts of its EP ranks); such a model runs its routed
    /// experts through an expert hook only (`StepOptions::experts`).
    pub fn load_experts(dir: &Path, experts: &ExpertFilter) -> Result<Model, ModelError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Model::from_checkpoint_experts(cfg, &ckpt, Box::new(CpuBackend::new()), experts)
    }

    /// Builds the model from an opened checkpoint on `backend`.
    pub fn from_checkpoint(
        cfg: ModelConfig,
        ckpt: &Checkpoint,
        backend: Box<dyn Backend>,
    ) -> Result<Model, ModelError> {
        Model::from_checkpoint_experts(cfg, ckpt, backend, &ExpertFilter::all())
    }

    /// [`Model::from_checkpoint`] reading only the backbone routed experts `experts` keeps.
    pub fn from_checkpoint_experts(
        cfg: ModelConfig,
        ckpt: &Checkpoint,
        backend: Box<dyn Backend>,
        experts: &ExpertFilter,
    ) -> Result<Model, ModelError> {
        check_supported(&cfg)?;
        let loader = Loader { ckpt, cfg: &cfg };
        let (vocab, dim) = (cfg.vocab_size, cfg.dim);
        let layers = (0..cfg.n_layers)
            .map(|l| loader.layer(l, experts))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let has_mtp = cfg.v4.as_ref().is_some_and(|v4| v4.mtp_layers > 0);
        let mtp = has_mtp.then(|| MtpWeights::load(&loader)).transpose()?;
        let dspark = cfg
            .dspark
            .as_ref()
            .filter(|d| d.n_stages > 0)
            .map(|d| DsparkWeights::load(&loader, d))
            .transpose()?;
        let weights = ModelWeights {
            embed: Arc::new(loader.vector("embed.weight", &[vocab, dim])?),
            head: Arc::new(loader.linear("head", vocab, dim)?),
            norm: loader.vector("norm.weight", &[dim])?,
            hyper_head: Arc::new(loader.hyper_head("")?),
            backbone: Backbone::new(layers, ckpt, experts, |ckpt, cfg, layer, expert| {
                Loader { ckpt, cfg }.routed_expert(layer, expert)
            })?,
            mtp: mtp.map(Arc::new),
            dspark: dspark.map(Arc::new),
            unit: vec![1.0; cfg.head_dim],
        };
        Ok(Loaded::new(cfg, backend, weights))
    }

    /// Whether the model has a DSpark drafter ([`Model::draft`] proposes).
    pub fn has_dspark(&self) -> bool {
        self.weights.dspark.is_some()
    }

    /// A fresh, empty sequence.
    pub fn new_sequence(&self) -> SequenceState {
        let layers =
            self.weights
                .backbone
                .layers
                .iter()
                .map(|layer| LayerState {
                    window: Default::default(),
                    main: layer
                        .attn
                        .compressor
                        .as_ref()
                        .map(|c| CompressorCache::new(c.ratio, c.overlapping)),
                    index: layer.attn.indexer.as_ref().map(|i| {
                        CompressorCache::new(i.compressor.ratio, i.compressor.overlapping)
                    }),
                })
                .collect();
        let stages = self.weights.dspark.as_ref().map_or(0, |d| d.stages.len());
        SequenceState::new(layers, self.weights.mtp.is_some(), stages)
    }

    /// Feeds the speculative heads the chunk just run (one sequence's rows of a step): the MTP
    /// block processes the entries whose next token is now known (positions `len − 1 … len + n −
    /// 2`) and keeps the newest streams; the DSpark stages get the context rows of the chunk's
    /// positions from the target-layer `taps` (in `targets` order, each `[n, dim]`). Everything
    /// stays where the backend computed it.
    fn advance_speculative(
        &self,
        ctx: &Ctx,
        seq: &mut SequenceState,
        tokens: &[u32],
        streams: &Tensor,
        taps: &[Tensor],
        positions: &[usize],
    ) {
        let width = self.cfg.hc.mult * self.cfg.dim;
        if let (Some(weights), Some(state)) = (&self.weights.mtp, seq.mtp.as_mut()) {
            let start = seq.len;
            // The entry of the previous chunk's last position (checked held by `check_chunk`).
            let carried: Option<Tensor> = start
                .checked_sub(1)
                .and_then(|p| state.hidden.get(p))
                .cloned();
            let first = if carried.is_some() { start - 1 } else { start };
            let mut pieces: Vec<(&Tensor, usize)> = carried.iter().map(|row| (row, 0)).collect();
            pieces.extend((0..tokens.len() - 1).map(|t| (streams, t * width)));
            let entries = pieces.len();
            if entries > 0 {
                let hidden = ctx.backend.gather(&pieces, width);
                let entry_positions: Vec<usize> = (first..first + entries).collect();
                let entries = mtp::Entries {
                    hidden: &hidden,
                    next: &tokens[tokens.len() - entries..],
                    positions: &entry_positions,
                };
                mtp::run(
                    ctx,
                    weights,
                    &self.weights.embed,
                    &entries,
                    &mut state.layer,
                    &self.weights.unit,
                );
            }
            for (t, &position) in positions.iter().enumerate() {
                state
                    .hidden
                    .push_at(position, streams.rows(t..t + 1, width));
            }
        }
        if let Some(weights) = &self.weights.dspark {
            let dim = self.cfg.dim;
            // Per row, its taps side by side: `[n, targets · dim]`.
            let pieces: Vec<(&Tensor, usize)> = (0..tokens.len())
                .flat_map(|t| taps.iter().map(move |tap| (tap, t * dim)))
                .collect();
            let main_hidden = ctx.backend.gather(&pieces, dim);
            dspark::feed_context(ctx, weights, &main_hidden, positions, &mut seq.dspark);
        }
    }

    /// The MTP block's logits `[vocab]` for the token after `anchor`: `anchor` is the token just
    /// sampled for position `seq.len()`, so the logits are for position `seq.len() + 1` (from
    /// the last processed position's streams). Leaves `seq` untouched; the entry is computed
    /// again, and kept, when the next forward appends `anchor`.
    pub fn mtp_logits(&self, seq: &SequenceState, anchor: u32) -> Result<Vec<f32>, ModelError> {
        let (Some(weights), Some(state)) = (&self.weights.mtp, seq.mtp.as_ref()) else {
            return Err(ModelError::Unsupported {
                what: "MTP drafting on a model (or sequence) without an MTP block".to_string(),
            });
        };
        self.check_draft(seq, anchor)?;
        let last = seq.len - 1;
        let hidden = state.hidden.get(last).ok_or_else(|| ModelError::Sequence {
            message: format!("the MTP streams of position {last} are no longer held"),
        })?;
        let ctx = self.ctx();
        let mut scratch = state.layer.clone();
        let entry = mtp::Entries {
            hidden,
            next: &[anchor],
            positions: &[last],
        };
        let out = mtp::run(
            &ctx,
            weights,
            &self.weights.embed,
            &entry,
            &mut scratch,
            &self.weights.unit,
        );
        Ok(mtp::logits(&ctx, weights, &self.weights.head, &out))
    }

    /// A greedy DSpark proposal after the sequence's last token: `anchor` is the token just sampled
    /// (it will sit at position `seq.len()`); returns the anchor plus `block_size` drafts, the draft
    /// logits `[block_size, vocab]` (Markov bias included) and the raw confidences. Leaves `seq`
    /// untouched.
    pub fn draft(&self, seq: &SequenceState, anchor: u32) -> Result<DraftProposal, ModelError> {
        let (Some(weights), Some(dspark)) = (&self.weights.dspark, self.cfg.dspark.as_ref()) else {
            return Err(ModelError::Unsupported {
                what: "DSpark drafting on a model without DSpark stages".to_string(),
            });
        };
        self.check_draft(seq, anchor)?;
        if seq.dspark.len() != weights.stages.len() {
            return Err(ModelError::Sequence {
                message: format!(
                    "the sequence has {} DSpark rings, the model {} stages",
                    seq.dspark.len(),
                    weights.stages.len()
                ),
            });
        }
        let end = seq.len + dspark.block_size;
        if end > self.cfg.max_position_embeddings {
            return Err(ModelError::Sequence {
                message: format!(
                    "a draft block up to position {end} exceeds max_position_embeddings {}",
                    self.cfg.max_position_embeddings
                ),
            });
        }
        let inputs = ProposalInputs {
            embed: &self.weights.embed,
            head: &self.weights.head,
            rings: &seq.dspark,
            last: seq.len - 1,
            unit: &self.weights.unit,
        };
        Ok(dspark::propose(
            &self.ctx(),
            weights,
            dspark,
            &inputs,
            anchor,
        ))
    }

    /// A draft needs a processed token and an anchor inside the vocabulary.
    fn check_draft(&self, seq: &SequenceState, anchor: u32) -> Result<(), ModelError> {
        if seq.len == 0 {
            return Err(ModelError::Sequence {
                message: "drafting needs at least one processed token".to_string(),
            });
        }
        self.check_token(anchor)
    }

    /// Drops everything after the first `len` tokens (a partially accepted verify). Only the last
    /// [`crate::layers::ring::MAX_BACKTRACK`] tokens can always be dropped; further back is an error.
    pub fn rollback(&self, seq: &mut SequenceState, len: usize) -> Result<(), ModelError> {
        seq.rollback(len, self.cfg.window_size)
    }

    /// Whether `tokens` can be appended to `seq` (what [`Model::forward_step`] checks per entry
    /// before any state changes).
    pub fn check_chunk(&self, seq: &SequenceState, tokens: &[u32]) -> Result<(), ModelError> {
        self.check_tokens(seq.len, tokens)?;
        if seq.layers.len() != self.weights.backbone.layers.len() {
            return Err(ModelError::Sequence {
                message: format!(
                    "the sequence has {} layers, the model {}",
                    seq.layers.len(),
                    self.weights.backbone.layers.len()
                ),
            });
        }
        let stages = self.weights.dspark.as_ref().map_or(0, |d| d.stages.len());
        if seq.mtp.is_some() != self.weights.mtp.is_some() || seq.dspark.len() != stages {
            return Err(ModelError::Sequence {
                message: "the sequence was not made by this model (speculative state)".to_string(),
            });
        }
        if let Some(state) = &seq.mtp
            && seq.len > 0
            && state.hidden.get(seq.len - 1).is_none()
        {
            return Err(ModelError::Sequence {
                message: format!(
                    "the MTP streams of position {} are no longer held",
                    seq.len - 1
                ),
            });
        }
        Ok(())
    }
}

/// Rejects configs whose structure this forward pass does not implement.
fn check_supported(cfg: &ModelConfig) -> Result<(), ModelError> {
    let unsupported = |what: String| Err(ModelError::Unsupported { what });
    if cfg.family != ModelFamily::V4 {
        return unsupported(format!(
            "a {:?}-family config in the V4 model (load it with deepinfer_model::Model)",
            cfg.family
        ));
    }
    let Some(v4) = &cfg.v4 else {
        return unsupported("a V4 config without its layer schedule".to_string());
    };
    if v4.attention.len() != cfg.n_layers || v4.mlp.len() != cfg.n_layers {
        return unsupported(format!(
            "{} attention and {} MLP types for {} layers",
            v4.attention.len(),
            v4.mlp.len(),
            cfg.n_layers
        ));
    }
    if cfg.quant.weight_block[0] != cfg.quant.weight_block[1] {
        return unsupported(format!(
            "non-square FP8 weight blocks {:?}",
            cfg.quant.weight_block
        ));
    }
    let heads_divide = cfg.o_groups > 0 && cfg.n_heads.is_multiple_of(cfg.o_groups);
    let rope_fits = cfg.rope_head_dim <= cfg.head_dim.min(cfg.index_head_dim);
    let ratios_positive = v4.csa_ratio > 0 && v4.hca_ratio > 0;
    let needs_indexer = v4.attention.contains(&V4Attention::Csa);
    if !heads_divide || !rope_fits || !ratios_positive || (needs_indexer && cfg.index_n_heads == 0)
    {
        return unsupported(format!(
            "shapes: {} heads in {} groups, rope {} of head {} / index head {}, rates {}/{}",
            cfg.n_heads,
            cfg.o_groups,
            cfg.rope_head_dim,
            cfg.head_dim,
            cfg.index_head_dim,
            v4.csa_ratio,
            v4.hca_ratio
        ));
    }
    check_speculative(cfg, v4.mtp_layers)
}

/// Rejects speculative heads this model does not implement: more than one MTP block, both an MTP
/// block and a DSpark drafter, or a drafter whose taps, noise token or block do not fit.
fn check_speculative(cfg: &ModelConfig, mtp_layers: usize) -> Result<(), ModelError> {
    let unsupported = |what: String| Err(ModelError::Unsupported { what });
    if mtp_layers > 1 {
        return unsupported(format!("{mtp_layers} MTP blocks (V4-Flash has one)"));
    }
    let Some(dspark) = cfg.dspark.as_ref().filter(|d| d.n_stages > 0) else {
        return Ok(());
    };
    if mtp_layers > 0 {
        return unsupported("both an MTP block and a DSpark drafter under mtp.*".to_string());
    }
    let taps_fit =
        !dspark.target_layers.is_empty() && dspark.target_layers.iter().all(|&l| l < cfg.n_layers);
    if !taps_fit
        || dspark.block_size == 0
        || dspark.noise_token_id as usize >= cfg.vocab_size
        || dspark.n_activated_experts > dspark.n_routed_experts
    {
        return unsupported(format!(
            "DSpark target layers {:?} of {} layers, block {}, noise token {} of vocab {}, top-{} of {} experts",
            dspark.target_layers,
            cfg.n_layers,
            dspark.block_size,
            dspark.noise_token_id,
            cfg.vocab_size,
            dspark.n_activated_experts,
            dspark.n_routed_experts
        ));
    }
    Ok(())
}
