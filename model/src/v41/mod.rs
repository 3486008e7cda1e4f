//! The DeepSeek-V4.1 text model and its DSpark drafter on a [`Backend`] (spec §3): the public
//! [`Model`] / [`SequenceState`] API, the top-level forward over a chunk of tokens at the sequence's
//! next positions, rollback, and greedy DSpark proposals.

mod attention;
mod block;
pub(crate) mod csa;
pub(crate) mod dspark;
mod expert_hook;
pub(crate) mod moe;
pub(crate) mod rope;
pub(crate) mod state;
mod trace;
pub mod vision;
pub(crate) mod weights;

use std::path::Path;
use std::sync::Arc;

pub use dspark::DraftProposal;
pub use state::{MAX_BACKTRACK, SequenceState};
pub use trace::{ForwardTrace, Injection};

use crate::backend::{Backend, CpuBackend};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::engram::{CompressedVocab, Engram};
use crate::error::ModelError;
use crate::expert_dispatch::RoutedExperts;
use crate::quant::round_bf16;
use csa::ChunkShared;
use rope::RopeTables;
use state::{CompressorState, LayerState};
use weights::{BlockWeights, DsparkWeights};

/// Which logits rows a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// One row per token of the chunk.
    All,
    /// Only the row of the chunk's last token.
    Last,
}

/// What every component needs to run: the config, the backend and the RoPE tables; `routed`
/// (backbone blocks only) runs the routed experts elsewhere.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub cfg: &'a ModelConfig,
    pub backend: &'a dyn Backend,
    pub rope: &'a RopeTables,
    pub routed: Option<expert_hook::RoutedSite<'a>>,
    /// Image-span rows of the block being run: the router's `bias_vl` choice (spec §3.6).
    pub image_routing: Option<vision::ImageRouting<'a>>,
}

/// A loaded V4.1 model (text backbone + DSpark heads) on a backend. The host weights sit behind
/// `Arc`s so that [`Model::on_backend`] can run the same weights on another backend.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    backend: Box<dyn Backend>,
    rope: RopeTables,
    /// `[vocab, dim]` bf16.
    embed: Arc<Vec<f32>>,
    /// `[vocab, dim]` bf16 values, used in fp32.
    head: Arc<Vec<f32>>,
    norm: Arc<Vec<f32>>,
    layers: Arc<Vec<BlockWeights>>,
    engram: Option<Arc<Engram>>,
    dspark: Option<Arc<DsparkWeights>>,
    vision: Option<Arc<vision::VisionTower>>,
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
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(cfg, &ckpt, vocab, Box::new(CpuBackend::new()))
    }

    /// Builds the model from an opened checkpoint on `backend`.
    pub fn from_checkpoint(
        cfg: ModelConfig,
        ckpt: &Checkpoint,
        vocab: Option<CompressedVocab>,
        backend: Box<dyn Backend>,
    ) -> Result<Model, ModelError> {
        check_supported(&cfg)?;
        let (vocab_size, dim) = (cfg.vocab_size, cfg.dim);
        let layers = (0..cfg.n_layers)
            .map(|l| weights::load_block(ckpt, &cfg, &format!("layers.{l}."), Some(l)))
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
        Ok(Model {
            rope: RopeTables::new(&cfg),
            embed: Arc::new(ckpt.bf16("embed.weight", &[vocab_size, dim])?),
            head: Arc::new(ckpt.bf16("head.weight", &[vocab_size, dim])?),
            norm: Arc::new(ckpt.bf16("norm.weight", &[dim])?),
            layers: Arc::new(layers),
            engram,
            dspark: weights::load_dspark(ckpt, &cfg)?.map(Arc::new),
            vision: vision::VisionTower::load(ckpt, &cfg)?.map(Arc::new),
            backend,
            cfg,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The backend this model runs on.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The same loaded weights run on `backend` (e.g. one DP rank's GPU). The host weights are
    /// shared, not copied; the new model's sequences are its own ([`Model::new_sequence`]).
    pub fn on_backend(&self, backend: Box<dyn Backend>) -> Model {
        Model {
            cfg: self.cfg.clone(),
            backend,
            rope: self.rope.clone(),
            embed: self.embed.clone(),
            head: self.head.clone(),
            norm: self.norm.clone(),
            layers: self.layers.clone(),
            engram: self.engram.clone(),
            dspark: self.dspark.clone(),
            vision: self.vision.clone(),
        }
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            cfg: &self.cfg,
            backend: self.backend.as_ref(),
            rope: &self.rope,
            routed: None,
            image_routing: None,
        }
    }

    /// A fresh, empty sequence.
    pub fn new_sequence(&self) -> SequenceState {
        let layers = (0..self.cfg.n_layers)
            .map(|l| LayerState {
                window: Default::default(),
                compressor: self.layers[l]
                    .attn
                    .compressor
                    .as_ref()
                    .map(|_| CompressorState::default()),
            })
            .collect();
        SequenceState::new(layers, self.dspark.as_ref().map_or(0, |d| d.stages.len()))
    }

    /// Appends `tokens` at the sequence's next positions and returns fp32 logits rows
    /// (`[n, vocab]` for [`LogitsWanted::All`], `[vocab]` for [`LogitsWanted::Last`]).
    pub fn forward(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_traced(seq, tokens, want, None)
    }

    /// [`Model::forward`] that also records intermediates into `trace` when given.
    pub fn forward_traced(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<f32>, ModelError> {
        self.run_chunk(seq, tokens, want, None, trace)
    }

    /// A prefill with decoder bounded replay (spec §3.5, an approximation, off in [`Model::forward`]):
    /// layers from the first ratio-1 layer on run only on the last `keep` tokens (that layer's
    /// compressor still sees every token). `keep` must be at least `window + MAX_BACKTRACK` so the
    /// decoder windows survive a rollback. `LogitsWanted::All` returns the kept rows only.
    pub fn prefill_bounded(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        keep: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let minimum = self.cfg.window_size + MAX_BACKTRACK;
        if keep < minimum {
            return Err(ModelError::Sequence {
                message: format!(
                    "bounded replay keeps {keep} tokens; at least window + max backtracking = {minimum} are needed"
                ),
            });
        }
        if !seq.is_empty() {
            return Err(ModelError::Sequence {
                message: format!(
                    "bounded replay is a prefill option, but the sequence already holds {} tokens",
                    seq.len
                ),
            });
        }
        self.check_replay_boundary()?;
        let decoder_from = tokens.len().saturating_sub(keep);
        self.run_chunk(seq, tokens, want, Some(decoder_from), None)
    }

    /// [`Model::forward`] with decoder bounded replay for chunked prefill (spec §3.5, an
    /// approximation): rows at positions `< decoder_from` stop at the first ratio-1 layer (whose
    /// compressor still sees them), so layers from there on run only on positions
    /// `>= decoder_from`. Pass the same `decoder_from` (`prompt_len - keep`, see the runtime's
    /// `ReplayBound::plan_prefill`) with every chunk of the prompt and the result equals a one-shot
    /// [`Model::prefill_bounded`] bit for bit; decode steps (positions past it) are unaffected.
    /// Rows are returned for the kept positions only: a chunk entirely before `decoder_from`
    /// returns no logits. The caller validates `keep >= window + max backtracking`.
    pub fn forward_replay(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        decoder_from: usize,
    ) -> Result<Vec<f32>, ModelError> {
        self.check_replay_boundary()?;
        self.run_chunk(seq, tokens, want, Some(decoder_from), None)
    }

    /// [`Model::forward_replay`] with the routed experts of the backbone blocks run by `experts`
    /// (expert parallelism).
    pub fn forward_replay_with_experts(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        decoder_from: usize,
        experts: &dyn RoutedExperts,
    ) -> Result<Vec<f32>, ModelError> {
        self.check_replay_boundary()?;
        self.run_chunk_with(seq, tokens, want, Some(decoder_from), None, Some(experts))
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

    fn run_chunk(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        decoder_from: Option<usize>,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<f32>, ModelError> {
        self.run_chunk_with(seq, tokens, want, decoder_from, trace, None)
    }

    /// [`Model::run_chunk`] with the routed experts of the backbone blocks run by `experts`.
    fn run_chunk_with(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        decoder_from: Option<usize>,
        trace: Option<&mut ForwardTrace>,
        experts: Option<&dyn RoutedExperts>,
    ) -> Result<Vec<f32>, ModelError> {
        self.run_chunk_inner(seq, tokens, want, decoder_from, trace, experts, None)
    }

    /// [`Model::run_chunk`] of a chunk with image spans (`vl`).
    pub(crate) fn run_chunk_vl(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        trace: Option<&mut ForwardTrace>,
        vl: Option<&vision::VlChunk<'_>>,
    ) -> Result<Vec<f32>, ModelError> {
        self.run_chunk_inner(seq, tokens, want, None, trace, None, vl)
    }

    /// The one body behind every forward entry: `experts` runs the routed experts elsewhere,
    /// `vl` places image spans.
    #[allow(clippy::too_many_arguments)]
    fn run_chunk_inner(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        decoder_from: Option<usize>,
        mut trace: Option<&mut ForwardTrace>,
        experts: Option<&dyn RoutedExperts>,
        vl: Option<&vision::VlChunk<'_>>,
    ) -> Result<Vec<f32>, ModelError> {
        self.check_chunk(seq, tokens)?;
        let cfg = &self.cfg;
        let ctx = self.ctx();
        let (hc, dim) = (cfg.hc.mult, cfg.dim);
        let n = tokens.len();
        let mut positions: Vec<usize> = (seq.len..seq.len + n).collect();
        // Leading rows of this chunk before the decoder suffix (bounded replay).
        let dropped = decoder_from.map_or(0, |from| from.saturating_sub(seq.len).min(n));
        let truncate_at = if dropped > 0 {
            self.replay_boundary()
        } else {
            None
        };
        if let Some(trace) = trace.as_deref_mut() {
            trace.reset(cfg.n_layers);
        }

        // Image-span rows: dead to Engram, routed with bias_vl (spec §3.1, §3.6).
        let dead = vl.map_or_else(|| vec![false; n], |vl| vl.image_rows.to_vec());
        let mut image_rows = dead.clone();
        let engram_rows = self
            .engram
            .as_ref()
            .map(|e| e.hash_chunk(ctx.backend, &mut seq.engram, tokens, &dead));
        let mut streams = Vec::with_capacity(n * hc * dim);
        for (i, &token) in tokens.iter().enumerate() {
            let row = vl
                .and_then(|vl| vl.embeddings.get(i).copied().flatten())
                .unwrap_or(&self.embed[token as usize * dim..(token as usize + 1) * dim]);
            for _ in 0..hc {
                streams.extend_from_slice(row);
            }
        }
        let mut pre: Vec<f32> = (0..n * hc)
            .map(|i| if i % hc == 0 { 1.0 } else { 0.0 })
            .collect();
        let targets = cfg
            .dspark
            .as_ref()
            .map_or(&[][..], |d| &d.target_layers[..]);
        let mut taps: Vec<Vec<f32>> = Vec::new();
        let mut shared = ChunkShared::default();

        for (l, block_weights) in self.layers.iter().enumerate() {
            if truncate_at == Some(l) {
                // Decoder boundary: its compressor sees every token, everything else only the tail.
                if let (Some(weights), Some(state)) = (
                    &block_weights.attn.compressor,
                    seq.layers[l].compressor.as_mut(),
                ) {
                    let width = hc * dim;
                    let xn = block::attention_inputs(
                        &ctx,
                        block_weights,
                        &streams[..dropped * width],
                        &pre[..dropped * hc],
                    );
                    csa::compress_chunk(&ctx, weights, state, &xn, &positions[..dropped], l);
                }
                streams.drain(..dropped * hc * dim);
                pre.drain(..dropped * hc);
                positions.drain(..dropped);
                image_rows.drain(..dropped);
                if positions.is_empty() {
                    break;
                }
            }
            inject_streams(trace.as_deref(), l, &mut streams, &mut pre);
            let engram_index = cfg
                .engram
                .as_ref()
                .and_then(|e| e.layer_ids.iter().position(|&id| id == l));
            if let (Some(engram), Some(rows), Some(index)) =
                (&self.engram, &engram_rows, engram_index)
            {
                engram.apply(ctx.backend, index, rows, &mut streams, &dead);
                if let Some(trace) = trace.as_deref_mut() {
                    trace.engram_out[l] = streams.clone();
                }
            }
            if targets.contains(&l) {
                taps.push(stream_means(&streams, hc, dim));
            }
            let layer_states = &mut seq.layers;
            let shared = &mut shared;
            let forced_routes = trace
                .as_deref()
                .and_then(|t| t.inject.routes.get(l).cloned().flatten());
            let attn_trace = trace.as_deref_mut();
            let block_ctx = Ctx {
                image_routing: vl.and_then(|vl| {
                    let bias_vl = vl.router_bias.get(l)?;
                    Some(vision::ImageRouting::new(&image_rows, bias_vl))
                }),
                ..expert_hook::at_layer(ctx, experts, l)
            };
            let routes = block::forward(
                &block_ctx,
                block_weights,
                &mut streams,
                &mut pre,
                forced_routes.as_deref(),
                |xn| {
                    attention::forward(
                        &ctx,
                        &block_weights.attn,
                        l,
                        xn,
                        &positions,
                        layer_states,
                        shared,
                        attn_trace,
                    )
                },
            );
            if let Some(trace) = trace.as_deref_mut() {
                trace.layer_out[l] = streams.clone();
                trace.layer_pre[l] = pre.clone();
                trace.route_idx[l] = routes.iter().map(|r| r.experts.clone()).collect();
                trace.route_w[l] = routes.iter().map(|r| r.weights.clone()).collect();
            }
        }

        inject_streams(trace.as_deref(), cfg.n_layers, &mut streams, &mut pre);
        let kept = positions.len();
        let rows: Vec<usize> = match want {
            LogitsWanted::All => (0..kept).collect(),
            LogitsWanted::Last => kept.checked_sub(1).into_iter().collect(),
        };
        let traced_rows: Vec<usize> = if trace.is_some() {
            (0..kept).collect()
        } else {
            rows.clone()
        };
        let mut logits = Vec::with_capacity(rows.len() * cfg.vocab_size);
        for t in traced_rows {
            let width = hc * dim;
            let x = ctx.backend.hc_collapse(
                &streams[t * width..(t + 1) * width],
                &pre[t * hc..(t + 1) * hc],
            );
            let hidden = ctx.backend.rms_norm(&x, &self.norm, cfg.norm_eps);
            if rows.contains(&t) {
                logits.extend(
                    ctx.backend
                        .linear_f32(&hidden, &self.head, cfg.vocab_size, dim),
                );
            }
            if let Some(trace) = trace.as_deref_mut() {
                trace.final_hidden.extend(hidden);
            }
        }

        if let Some(dspark) = self.dspark.as_ref().filter(|_| kept > 0) {
            let computed: Vec<f32> = (0..kept)
                .flat_map(|t| {
                    taps.iter()
                        .flat_map(move |tap| tap[t * dim..(t + 1) * dim].iter().copied())
                })
                .collect();
            let main_hidden = trace
                .as_deref()
                .and_then(|t| t.inject.main_hidden.clone())
                .unwrap_or(computed);
            dspark::feed_context(&ctx, dspark, &main_hidden, &positions, &mut seq.dspark);
            if let Some(trace) = trace {
                trace.main_hidden = main_hidden;
            }
        }
        seq.len += n;
        seq.trim(cfg.window_size);
        Ok(logits)
    }

    /// Drops everything after the first `len` tokens. Only the last [`MAX_BACKTRACK`] tokens can be
    /// dropped (the rings keep that much history); further back is an error.
    pub fn rollback(&self, seq: &mut SequenceState, len: usize) -> Result<(), ModelError> {
        seq.rollback(len, self.cfg.window_size, &self.cfg.compress_ratios)
    }

    /// A greedy DSpark proposal after the sequence's last token: `anchor` is the token just sampled
    /// (it will sit at position `seq.len()`); returns the anchor plus `block_size` drafts, the draft
    /// logits (Markov bias included) and the raw confidences.
    pub fn draft(&self, seq: &SequenceState, anchor: u32) -> Result<DraftProposal, ModelError> {
        let Some(dspark) = &self.dspark else {
            return Err(ModelError::Unsupported {
                what: "DSpark drafting on a model without DSpark stages".to_string(),
            });
        };
        if seq.len == 0 {
            return Err(ModelError::Sequence {
                message: "drafting needs at least one processed token".to_string(),
            });
        }
        self.check_token(anchor)?;
        let cfg_dspark = self
            .cfg
            .dspark
            .as_ref()
            .ok_or_else(|| ModelError::Unsupported {
                what: "DSpark config".to_string(),
            })?;
        Ok(dspark::propose(
            &self.ctx(),
            dspark,
            cfg_dspark,
            &self.embed,
            &self.head,
            seq,
            anchor,
        ))
    }

    fn check_token(&self, token: u32) -> Result<(), ModelError> {
        if token as usize >= self.cfg.vocab_size {
            return Err(ModelError::Sequence {
                message: format!(
                    "token id {token} is outside the vocabulary of {}",
                    self.cfg.vocab_size
                ),
            });
        }
        Ok(())
    }

    fn check_chunk(&self, seq: &SequenceState, tokens: &[u32]) -> Result<(), ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::Sequence {
                message: "empty chunk".to_string(),
            });
        }
        for &token in tokens {
            self.check_token(token)?;
        }
        let end = seq.len + tokens.len();
        if end > self.cfg.max_position_embeddings {
            return Err(ModelError::Sequence {
                message: format!(
                    "positions up to {end} exceed max_position_embeddings {}",
                    self.cfg.max_position_embeddings
                ),
            });
        }
        Ok(())
    }
}

/// Replaces the streams / collapse weights entering block `layer` when the trace injects them.
fn inject_streams(
    trace: Option<&ForwardTrace>,
    layer: usize,
    streams: &mut Vec<f32>,
    pre: &mut Vec<f32>,
) {
    let Some(inject) = trace.map(|t| &t.inject) else {
        return;
    };
    if let Some(Some(forced)) = inject.streams.get(layer)
        && forced.len() == streams.len()
    {
        streams.clone_from(forced);
    }
    if let Some(Some(forced)) = inject.pre.get(layer)
        && forced.len() == pre.len()
    {
        pre.clone_from(forced);
    }
}

/// `bf16(mean over the hc streams)` of every token of `[n, hc, dim]` streams.
fn stream_means(streams: &[f32], hc: usize, dim: usize) -> Vec<f32> {
    streams
        .chunks_exact(hc * dim)
        .flat_map(|token| {
            (0..dim).map(move |d| {
                round_bf16((0..hc).fold(0.0f32, |a, k| a + token[k * dim + d]) / hc as f32)
            })
        })
        .collect()
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
