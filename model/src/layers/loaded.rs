//! What a loaded model is in both families: the family's host weights with the config, the
//! RoPE/YaRN tables and the backend they run on. `v4::Model` and `v41::Model` are [`Loaded`] over
//! their own weights; what they share (the config, the backend, moving to another backend, the
//! run context) is written here once.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::layers::ctx::Ctx;
use crate::layers::rope::RopeTables;

/// A family's host weights `W` on a backend. `W` keeps its large tensors behind `Arc`s, so that
/// [`Loaded::on_backend`] shares them instead of copying.
#[derive(Debug)]
pub struct Loaded<W> {
    pub(crate) cfg: ModelConfig,
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) rope: RopeTables,
    pub(crate) weights: W,
}

impl<W: Clone> Loaded<W> {
    /// `weights` loaded for `cfg`, run on `backend`.
    pub(crate) fn new(cfg: ModelConfig, backend: Box<dyn Backend>, weights: W) -> Loaded<W> {
        Loaded {
            rope: RopeTables::new(&cfg),
            cfg,
            backend,
            weights,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The backend this model runs on.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The same loaded weights run on `backend` (e.g. one DP rank's GPU). The host weights are
    /// shared, not copied; the new model's sequences are its own (`new_sequence`).
    pub fn on_backend(&self, backend: Box<dyn Backend>) -> Loaded<W> {
        Loaded {
            cfg: self.cfg.clone(),
            backend,
            rope: self.rope.clone(),
            weights: self.weights.clone(),
        }
    }

    /// The run context of this model (no expert site, no image routing).
    pub(crate) fn ctx(&self) -> Ctx<'_> {
        Ctx {
            cfg: &self.cfg,
            backend: self.backend.as_ref(),
            rope: &self.rope,
            routed: None,
            image_routing: None,
        }
    }

    /// Whether `token` is inside the vocabulary.
    pub(crate) fn check_token(&self, token: u32) -> Result<(), ModelError> {
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

    /// Whether `tokens` can follow `len` processed tokens: a non-empty chunk of ids inside the
    /// vocabulary, ending within `max_position_embeddings` (what every family's chunk check
    /// starts with).
    pub(crate) fn check_tokens(&self, len: usize, tokens: &[u32]) -> Result<(), ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::Sequence {
                message: "empty chunk".to_string(),
            });
        }
        for &token in tokens {
            self.check_token(token)?;
        }
        let end = len + tokens.len();
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
