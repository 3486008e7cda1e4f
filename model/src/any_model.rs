//! A model of either family behind one API: [`AnyModel`] loads a checkpoint directory as V4.1 or V4
//! by its config's `model_type`, and [`AnySequence`] is the matching per-sequence state. Callers
//! that only feed tokens and read logits (the `logits` tool) need nothing family-specific; several
//! sequences run as one step through [`AnyModel::forward_step`].

use std::path::Path;
use std::sync::Arc;

use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, ExpertFilter};
use crate::config::{ModelConfig, ModelFamily};
use crate::engram::CompressedVocab;
use crate::error::ModelError;
use crate::expert_dispatch::ExpertHost;
use crate::{DraftProposal, EntryOutput, v4, v41};

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

    /// Bytes of the distinct allocations the state keeps alive (at least
    /// [`AnySequence::held_bytes`]: a row that views a larger buffer pins all of it).
    pub fn pinned_bytes(&self) -> u64 {
        match self {
            AnySequence::V41(seq) => seq.pinned_bytes(),
            AnySequence::V4(seq) => seq.pinned_bytes(),
        }
    }
}

/// One sequence's part of an [`AnyModel::forward_step`].
pub type AnyStepEntry<'a> = crate::layers::step::StepEntry<'a, AnySequence>;

use crate::layers::step::StepEntry;
pub use crate::layers::step::StepOptions;

fn family_mismatch() -> ModelError {
    ModelError::Sequence {
        message: "the sequence belongs to a model of the other family".to_string(),
    }
}

/// `entries` as step entries of the family whose sequence `family_seq` finds in each, failing at
/// the first entry whose sequence belongs to the other family.
fn family_entries<'e, S>(
    entries: &'e mut [AnyStepEntry<'_>],
    family_seq: impl Fn(&mut AnySequence) -> Option<&mut Box<S>>,
) -> Result<Vec<StepEntry<'e, S>>, ModelError> {
    let mut steps = Vec::with_capacity(entries.len());
    for (e, entry) in entries.iter_mut().enumerate() {
        let Some(seq) = family_seq(&mut *entry.seq) else {
            return Err(ModelError::Sequence {
                message: format!(
                    "step entry {e}: the sequence belongs to a model of the other family"
                ),
            });
        };
        steps.push(StepEntry {
            seq: &mut **seq,
            tokens: entry.tokens,
            want: entry.want,
            decoder_from: entry.decoder_from,
            sample: entry.sample,
        });
    }
    Ok(steps)
}

impl AnyModel {
    /// Loads `dir` as the family its `config.json` names. `vocab` is the Engram compressed
    /// vocabulary (V4.1 models with Engram layers need it; V4 ignores it).
    pub fn load(dir: &Path, vocab: Option<CompressedVocab>) -> Result<AnyModel, ModelError> {
        AnyModel::load_experts(dir, vocab, &ExpertFilter::all())
    }

    /// [`AnyModel::load`] reading only the backbone routed experts `experts` keeps (the process
    /// of some EP ranks of several nodes): the family's `Model::load_experts`.
    pub fn load_experts(
        dir: &Path,
        vocab: Option<CompressedVocab>,
        experts: &ExpertFilter,
    ) -> Result<AnyModel, ModelError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        Ok(match cfg.family {
            ModelFamily::V41 => {
                AnyModel::V41(Arc::new(v41::Model::load_experts(dir, vocab, experts)?))
            }
            ModelFamily::V4 => AnyModel::V4(Arc::new(v4::Model::load_experts(dir, experts)?)),
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

    /// The model as expert parallelism sees it (its routed experts, running one of them, the
    /// idle step of an EP rank): the same for either family.
    pub fn experts(&self) -> &dyn ExpertHost {
        match self {
            AnyModel::V41(model) => model.as_ref(),
            AnyModel::V4(model) => model.as_ref(),
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

    /// Whether `tokens` can be appended to `seq` (the check every step runs first).
    pub fn check_chunk(&self, seq: &AnySequence, tokens: &[u32]) -> Result<(), ModelError> {
        match (self, seq) {
            (AnyModel::V41(model), AnySequence::V41(seq)) => model.check_chunk(seq, tokens),
            (AnyModel::V4(model), AnySequence::V4(seq)) => model.check_chunk(seq, tokens),
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

    /// One forward over several sequences at once, as the family's `forward_step` runs it: per
    /// entry its logits rows or its sampled tokens (`options.experts`: the routed experts run
    /// through that hook, in either family). A sequence of the other family, or what the V4
    /// family does not run (decoder bounded replay), fails the step before anything runs.
    pub fn forward_step(
        &self,
        entries: &mut [AnyStepEntry<'_>],
        options: StepOptions<'_>,
    ) -> Result<Vec<EntryOutput>, ModelError> {
        match self {
            AnyModel::V41(model) => {
                let mut steps = family_entries(entries, |seq| match seq {
                    AnySequence::V41(seq) => Some(seq),
                    AnySequence::V4(_) => None,
                })?;
                model.forward_step(&mut steps, options.with_family(v41::StepExtras::default()))
            }
            AnyModel::V4(model) => {
                let mut steps = family_entries(entries, |seq| match seq {
                    AnySequence::V4(seq) => Some(seq),
                    AnySequence::V41(_) => None,
                })?;
                model.forward_step(&mut steps, options)
            }
        }
    }

    /// V4.1's decoder window, the bound of a replay; `None` for V4 (no decoder bounded replay).
    pub fn decoder_window(&self) -> Option<usize> {
        match self {
            AnyModel::V41(model) => Some(model.config().window_size),
            AnyModel::V4(_) => None,
        }
    }

    /// Whether the model drafts ([`AnyModel::draft_step`] proposes).
    pub fn has_drafter(&self) -> bool {
        match self {
            AnyModel::V41(model) => model.config().dspark.is_some(),
            AnyModel::V4(model) => model.has_dspark(),
        }
    }

    /// Greedy DSpark proposals for many `(sequence, anchor)` requests, each its own result (see
    /// `v41::Model::draft_step`; a V4-Flash-0731 drafter proposes one request after another).
    pub fn draft_step(
        &self,
        requests: &[(&AnySequence, u32)],
    ) -> Vec<Result<DraftProposal, ModelError>> {
        match self {
            AnyModel::V41(model) => {
                let mut seqs = Vec::with_capacity(requests.len());
                for &(seq, anchor) in requests {
                    let AnySequence::V41(seq) = seq else {
                        return requests.iter().map(|_| Err(family_mismatch())).collect();
                    };
                    seqs.push((seq.as_ref(), anchor));
                }
                model.draft_step(&seqs)
            }
            AnyModel::V4(model) => requests
                .iter()
                .map(|&(seq, anchor)| match seq {
                    AnySequence::V4(seq) => model.draft(seq, anchor),
                    AnySequence::V41(_) => Err(family_mismatch()),
                })
                .collect(),
        }
    }
}
