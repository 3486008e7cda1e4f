//! The V4.1 vision path (spec §4): an image's pixels become ViT patches ([`preprocess`]), the ViT
//! ([`vit`]) and the 3×3 aligner ([`aligner`]) turn them into one LM embedding row per cell, and
//! [`layout`] places those rows, the learned `image_start` / `image_newline` / `image_end` vectors
//! and the `bias_vl` router choice into a chunk. This module owns the tower's weights and the
//! public image API of [`Model`].

pub mod aligner;
pub mod layout;
pub mod preprocess;
pub mod vit;

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::config::{ModelConfig, VisionConfig};
use crate::error::ModelError;

use super::Model;
use aligner::AlignerWeights;
pub use layout::{
    ExpandedPrompt, PlacedImage, TokenType, expand_image_placeholders, span_token_types,
};
pub use preprocess::{ImageGrid, ImageInput, PreparedImage, plan_image_grid};
use vit::VitWeights;

/// RMSNorm epsilon of every ViT norm (spec §4.1).
pub const VIT_NORM_EPS: f32 = 1e-6;

/// A bad image or image placement, or a model that cannot run images.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    /// The pixel buffer does not hold `height × width × 3` bytes.
    #[error("image of {width}×{height} needs {expected} RGB bytes, found {found}")]
    PixelBuffer {
        width: usize,
        height: usize,
        expected: usize,
        found: usize,
    },
    /// An image with no pixels.
    #[error("image of {width}×{height} has no pixels")]
    EmptyImage { width: usize, height: usize },
    /// The model cannot run images: its config has no `vision_config` or no `image_token_id`, or
    /// its checkpoint has no `vision.*` tensors.
    #[error("this model has no vision tower: {missing} is missing")]
    NoVisionTower { missing: &'static str },
    /// The prompt's image placeholders and the images do not pair up.
    #[error("the prompt has {placeholders} image placeholders but {images} images were given")]
    PlaceholderCount { placeholders: usize, images: usize },
    /// An image span does not lie inside the chunk.
    #[error("image span at chunk rows {start}..{end} does not fit in a chunk of {chunk} tokens")]
    SpanOutsideChunk {
        start: usize,
        end: usize,
        chunk: usize,
    },
    /// Two image spans share chunk rows.
    #[error("image spans overlap at chunk row {row}")]
    SpanOverlap { row: usize },
    /// A position inside an image span does not carry the image token id.
    #[error(
        "chunk row {row} inside an image span holds token {found}, expected image token {expected}"
    )]
    SpanToken {
        row: usize,
        found: u32,
        expected: u32,
    },
    /// An encoded image whose rows do not match its grid or the model's width.
    #[error("encoded image has {found} values, expected {expected} ({cells} cells × dim {dim})")]
    EncodedRows {
        found: usize,
        expected: usize,
        cells: usize,
        dim: usize,
    },
    /// The model itself refused the chunk.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// One image after the ViT and the aligner: the LM embedding rows of its IMAGE cells.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedImage {
    pub grid: ImageGrid,
    /// `[n_llm_h · n_llm_w, dim]` bf16 values, cells in reading order.
    pub rows: Vec<f32>,
}

impl EncodedImage {
    /// Token types of this image's span in the prompt.
    pub fn token_types(&self) -> Vec<TokenType> {
        span_token_types(self.grid.n_llm_h, self.grid.n_llm_w)
    }

    /// Number of prompt positions the image occupies.
    pub fn span_len(&self) -> usize {
        self.grid.span_len()
    }
}

/// The learned delimiter vectors of an image span, each `[dim]` bf16.
#[derive(Debug, Clone)]
pub struct Delimiters {
    pub start: Vec<f32>,
    pub newline: Vec<f32>,
    pub end: Vec<f32>,
}

/// Everything the vision path loads: the ViT, the aligner, the span delimiters and the router's
/// image-span bias `ffn.gate.bias_vl` of every backbone layer.
#[derive(Debug, Clone)]
pub struct VisionTower {
    pub cfg: VisionConfig,
    pub vit: VitWeights,
    pub aligner: AlignerWeights,
    pub delimiters: Delimiters,
    /// `[layer] → [n_routed_experts]` fp32.
    pub router_bias: Vec<Vec<f32>>,
}

/// The tensor whose presence marks a checkpoint with a vision tower.
const VISION_MARKER: &str = "vision.patch_embed.proj.weight";

impl VisionTower {
    /// Loads the tower when the config has a `vision_config` and the checkpoint holds `vision.*`
    /// tensors (text-only checkpoints of a vision config, such as the synthetic ones, load
    /// without it); every tensor's name, dtype and shape is checked.
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Option<VisionTower>, ModelError> {
        let Some(vision) = &cfg.vision else {
            return Ok(None);
        };
        if !ckpt.contains(VISION_MARKER) {
            return Ok(None);
        }
        let dim = cfg.dim;
        let router_bias = (0..cfg.n_layers)
            .map(|l| {
                ckpt.f32(
                    &format!("layers.{l}.ffn.gate.bias_vl"),
                    &[cfg.n_routed_experts],
                )
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Some(VisionTower {
            vit: VitWeights::load(ckpt, vision)?,
            aligner: AlignerWeights::load(ckpt, vision, dim)?,
            delimiters: Delimiters {
                start: ckpt.bf16("image_start", &[dim])?,
                newline: ckpt.bf16("image_newline", &[dim])?,
                end: ckpt.bf16("image_end", &[dim])?,
            },
            router_bias,
            cfg: vision.clone(),
        }))
    }

    /// Pixels → patches → ViT → aligner rows.
    pub fn encode(
        &self,
        backend: &dyn Backend,
        image: &ImageInput,
    ) -> Result<EncodedImage, VisionError> {
        let prepared = preprocess::prepare(image, &self.cfg)?;
        let features = self.vit.forward(backend, &prepared.patches, &prepared.grid);
        let rows = self.aligner.forward(&features, &prepared.grid);
        Ok(EncodedImage {
            grid: prepared.grid,
            rows,
        })
    }
}

impl Model {
    /// The loaded vision tower, if the model has one.
    pub fn vision_tower(&self) -> Option<&VisionTower> {
        self.weights.vision.as_deref()
    }

    fn require_vision(&self) -> Result<&VisionTower, VisionError> {
        self.weights
            .vision
            .as_deref()
            .ok_or(VisionError::NoVisionTower {
                missing: if self.cfg.vision.is_none() {
                    "the config's vision_config"
                } else {
                    "the checkpoint's vision.* tensors"
                },
            })
    }

    /// Runs an image through the ViT and the aligner (spec §4.1-4.3), letterboxing it first
    /// when its size is not already a valid one.
    pub fn encode_image(&self, image: &ImageInput) -> Result<EncodedImage, VisionError> {
        self.require_vision()?.encode(self.backend.as_ref(), image)
    }

    /// Lays out the image spans of a chunk of `tokens` for its step (`StepOptions::with_images`):
    /// each [`PlacedImage`] overwrites the embeddings of its span (`image_start`, aligner rows
    /// with one `image_newline` per grid row, `image_end`), and the span's rows route with
    /// `bias_vl` and are dead to Engram. The span's tokens must be the config's
    /// `image_token_id`; a span must lie inside the chunk (a prompt may be chunked anywhere
    /// outside its spans, with the same results as one shot).
    pub fn place_images<'a>(
        &'a self,
        tokens: &[u32],
        images: &[PlacedImage<'a>],
    ) -> Result<ImageChunk<'a>, VisionError> {
        let tower = self.require_vision()?;
        let image_token = self.cfg.image_token_id.ok_or(VisionError::NoVisionTower {
            missing: "the config's image_token_id",
        })?;
        Ok(ImageChunk {
            layout: layout::ChunkImages::new(
                tokens,
                images,
                image_token,
                self.cfg.dim,
                &tower.delimiters,
            )?,
            tokens: tokens.to_vec(),
            router_bias: &tower.router_bias,
        })
    }
}

/// The image spans of one chunk laid out for its step ([`Model::place_images`]).
#[derive(Debug)]
pub struct ImageChunk<'a> {
    layout: layout::ChunkImages<'a>,
    /// The chunk the spans were placed in.
    tokens: Vec<u32>,
    /// `[layer] → bias_vl`.
    router_bias: &'a [Vec<f32>],
}

impl ImageChunk<'_> {
    /// One flag per chunk row: inside an image span (bias_vl, dead to Engram).
    pub(crate) fn image_rows(&self) -> &[bool] {
        self.layout.image_rows()
    }

    /// One entry per chunk row: the embedding that replaces `embed[token]`.
    pub(crate) fn embeddings(&self) -> &[Option<&[f32]>] {
        self.layout.embeddings()
    }

    /// `[layer] → bias_vl`.
    pub(crate) fn router_bias(&self) -> &[Vec<f32>] {
        self.router_bias
    }

    /// Whether a step's entry runs the chunk these spans were placed in.
    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        if tokens != self.tokens {
            return Err(ModelError::Sequence {
                message: format!(
                    "image spans placed in a chunk of {} tokens given with another chunk of {} tokens",
                    self.tokens.len(),
                    tokens.len()
                ),
            });
        }
        Ok(())
    }
}
