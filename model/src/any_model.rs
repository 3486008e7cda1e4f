//! A model of either family behind one API: [`AnyModel`] loads a checkpoint directory as V4.1 or V4
//! by its config's `model_type`, and [`AnySequence`] is the matching per-sequence state. Callers
//! that only feed tokens and read logits (the `logits` tool) need nothing family-specific; several
//! sequences run as one step through [`AnyModel::forward_step`].

use std::path::Path;
use std::sync::Arc;

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::config::{ModelConfig, ModelFamily};
use crate::engram::CompressedVocab;
use crate::error::ModelError;
use crate::sampling::SamplingParams;
use crate::{LogitsWanted, v4, v41};

/// A loaded model of either family, shareable (a runtime's rank factories hold clones).
#[derive(Debug, Clone)]
pub enum AnyModel {
    V41(Arc<v41::Model>),
    V4(Arc<v4::Model>),
}

impl From<Arc<v41::Model>> for AnyModel {
    fn from(model: Arc<v41::Model>) -> AnyModel {
        AnyModel::V41(model)
    }
}

impl From<Arc<v4::Model>> for AnyModel {
    fn from(model: Arc<v4::Model>) -> AnyModel {
        AnyModel::V4(model)
    }
}

/// The per-sequence state of an [`AnyModel`] (boxed: the two differ in size).
#[derive(Debug, Clone)]
pub enum AnySequence {
    V41(Box<v41::SequenceState>),
    V4(Box<v4::SequenceState>),
}

impl AnySequence {
    /// Tokens seen so far.
    pub fn len(&self) -> usize {
        match self {
            AnySequence::V41(seq) => seq.len(),
            AnySequence::V4(seq) => seq.len(),
        }
    }

    /// Whether no token has been seen.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of every row and entry the state holds.
    pub fn held_bytes(&self) -> u64 {
        match self {
            AnySequence::V41(seq) => seq.held_bytes(),
            AnySequence::V4(seq) => seq.held_bytes(),
        }
    }
}

/// One sequence's part of an [`AnyModel::forward_step`].
pub struct AnyStepEntry<'a> {
    pub seq: &'a mut AnySequence,
    /// Appended at the sequence's next positions.
    pub tokens: &'a [u32],
    pub want: LogitsWanted,
    /// Sample the wanted rows on the backend (token ids back) instead of returning logits.
    pub sample: Option<SamplingParams>,
}

fn family_mismatch() -> ModelError {
    ModelError::Sequence {
        message: "the sequence belongs to a model of the other family".to_string(),
    }
}

impl AnyModel {
    /// Loads `dir` as the family its `config.json` names. `vocab` is the Engram compressed
    /// vocabulary (V4.1 models with Engram layers need it; V4 ignores it).
    pub fn load(dir: &Path, vocab: Option<CompressedVocab>) -> Result<AnyModel, ModelError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        Ok(match cfg.family {
            ModelFamily::V41 => AnyModel::V41(Arc::new(v41::Model::load_with_vocab(dir, vocab)?)),
            ModelFamily::V4 => AnyModel::V4(Arc::new(v4::Model::load(dir)?)),
        })
    }

    /// Builds the model of `cfg`'s family from an opened checkpoint on `backend` (`vocab` as in
    /// [`AnyModel::load`]).
    pub fn from_checkpoint(
        cfg: ModelConfig,
        ckpt: &Checkpoint,
        vocab: Option<CompressedVocab>,
        backend: Box<dyn Backend>,
    ) -> Result<AnyModel, ModelError> {
        Ok(match cfg.family {
            ModelFamily::V41 => AnyModel::V41(Arc::new(v41::Model::from_checkpoint(
                cfg, ckpt, vocab, backend,
            )?)),
            ModelFamily::V4 => {
                AnyModel::V4(Arc::new(v4::Model::from_checkpoint(cfg, ckpt, backend)?))
            }
        })
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &dyn Backend {
        match self {
            AnyModel::V41(model) => model.backend(),
            AnyModel::V4(model) => model.backend(),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            AnyModel::V41(model) => model.config(),
            AnyModel::V4(model) => model.config(),
        }
    }

    /// The same loaded weights run on `backend` (the family's `Model::on_backend`).
    pub fn on_backend(&self, backend: Box<dyn Backend>) -> AnyModel {
        match self {
            AnyModel::V41(model) => AnyModel::V41(Arc::new(model.on_backend(backend))),
            AnyModel::V4(model) => AnyModel::V4(Arc::new(model.on_backend(backend))),
        }
    }

    /// A fresh, empty sequence.
    pub fn new_sequence(&self) -> AnySequence {
        match self {
            AnyModel::V41(model) => AnySequence::V41(Box::new(model.new_sequence())),
            AnyModel::V4(model) => AnySequence::V4(Box::new(model.new_sequence())),
        }
    }

    /// Appends `tokens` to `seq` and returns fp32 logits rows (see `Model::forward`).
    pub fn forward(
        &self,
        seq: &mut AnySequence,
        tokens: &[u32],
        want: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        match (self, seq) {
            (AnyModel::V41(model), AnySequence::V41(seq)) => model.forward(seq, tokens, want),
            (AnyModel::V4(model), AnySequence::V4(seq)) => model.forward(seq, tokens, want),
            _ => Err(family_mismatch()),
        }
    }

    /// Drops everything after the first `len` tokens of `seq`.
    pub fn rollback(&self, seq: &mut AnySequence, len: usize) -> Result<(), ModelError> {
        match (self, seq) {
            (AnyModel::V41(model), AnySequence::V41(seq)) => model.rollback(seq, len),
            (AnyModel::V4(model), AnySequence::V4(seq)) => model.rollback(seq, len),
            _ => Err(family_mismatch()),
        }
    }

    /// One forward over several sequences at once, as the family's `forward_step` runs it (no
    /// expert site, no bounded replay): per entry its logits rows or its sampled tokens. A
    /// sequence of the other family fails the step, naming its entry, before anything runs.
    pub fn forward_step(
        &self,
        entries: &mut [AnyStepEntry<'_>],
    ) -> Result<Vec<v41::EntryOutput>, ModelError> {
        let mismatch = |e: usize| ModelError::Sequence {
            message: format!("step entry {e}: the sequence belongs to a model of the other family"),
        };
        match self {
            AnyModel::V41(model) => {
                let mut steps = Vec::with_capacity(entries.len());
                for (e, entry) in entries.iter_mut().enumerate() {
                    let AnySequence::V41(seq) = &mut *entry.seq else {
                        return Err(mismatch(e));
                    };
                    steps.push(v41::StepEntry {
                        seq,
                        tokens: entry.tokens,
                        want: entry.want,
                        decoder_from: None,
                        sample: entry.sample,
                    });
                }
                model.forward_step(&mut steps, None)
            }
            AnyModel::V4(model) => {
                let mut steps = Vec::with_capacity(entries.len());
                for (e, entry) in entries.iter_mut().enumerate() {
                    let AnySequence::V4(seq) = &mut *entry.seq else {
                        return Err(mismatch(e));
                    };
                    steps.push(v4::StepEntry {
                        seq,
                        tokens: entry.tokens,
                        want: entry.want,
                        sample: entry.sample,
                    });
                }
                model.forward_step(&mut steps)
            }
        }
    }
}
