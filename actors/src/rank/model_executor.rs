//! `ModelExecutor`: the `RankExecutor` over the real model (`deepinfer_model::Model`).
//!
//! Owns one `SequenceState` per live request. A step appends each entry's tokens with
//! `Model::forward(.., LogitsWanted::Last)`; the model is shared (read-only) by every rank of the
//! process. The runtime adds nothing to the numbers: the logits are exactly the model's.
//! A DSpark verify entry (`all_rows`) asks for every row; `draft` runs the checkpoint's DSpark
//! heads (`Model::draft`) when the model has them. A sequence with a planned decoder start
//! (`plan_replay`, decoder bounded replay) runs `Model::forward_replay` instead of `forward`.

use std::collections::HashMap;
use std::sync::Arc;

use deepinfer_model::{LogitsWanted, Model, SequenceState};
use deepinfer_topology::{DpRank, RequestId};

use crate::comm::{Comm, StepExperts};
use crate::experts::parallel::{ExpertParallel, StepRecord};

use crate::rank::executor::{Draft, ExecError, ExecutorFactory, RankExecutor, SeqTokens};

/// The executor of one rank over a shared model.
pub struct ModelExecutor {
    model: Arc<Model>,
    sequences: HashMap<RequestId, SequenceState>,
    /// Decoder bounded replay: each planned sequence's decoder start.
    replay_from: HashMap<RequestId, usize>,
    /// Expert parallelism: the routed experts go through the committed `Comm` of each step.
    ep: Option<RankExperts>,
}

/// One rank's side of expert parallelism.
struct RankExperts {
    parallel: Arc<ExpertParallel>,
    dp: DpRank,
    steps: u64,
}

impl ModelExecutor {
    pub fn new(model: Arc<Model>) -> Self {
        ModelExecutor {
            model,
            sequences: HashMap::new(),
            replay_from: HashMap::new(),
            ep: None,
        }
    }

    /// An executor of DP rank `dp` whose routed experts run through `parallel`'s placement: each
    /// step adopts the committed epoch at its start and keeps it to its end.
    pub fn with_expert_parallel(
        model: Arc<Model>,
        parallel: Arc<ExpertParallel>,
        dp: DpRank,
    ) -> Self {
        ModelExecutor {
            ep: Some(RankExperts {
                parallel,
                dp,
                steps: 0,
            }),
            ..ModelExecutor::new(model)
        }
    }
}

fn sequence_error(id: RequestId, e: deepinfer_model::error::ModelError) -> ExecError {
    ExecError::Sequence {
        id,
        message: e.to_string(),
    }
}

impl RankExecutor for ModelExecutor {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        if self.sequences.contains_key(&id) {
            return Err(ExecError::DuplicateSequence(id));
        }
        self.sequences.insert(id, self.model.new_sequence());
        Ok(())
    }

    fn free_sequence(&mut self, id: RequestId) {
        self.sequences.remove(&id);
        self.replay_from.remove(&id);
    }

    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError> {
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or(ExecError::UnknownSequence(id))?;
        self.model
            .rollback(seq, len)
            .map_err(|e| sequence_error(id, e))
    }

    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.sequences
            .get(&id)
            .map(SequenceState::len)
            .ok_or(ExecError::UnknownSequence(id))
    }

    fn live_sequences(&self) -> usize {
        self.sequences.len()
    }

    fn execute(&mut self, batch: &[SeqTokens<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        // Expert parallelism: this step's placement epoch, read once at the step boundary.
        let comm = self.ep.as_ref().map(|ep| ep.parallel.current());
        let experts = comm.as_deref().map(|comm| StepExperts::new(comm));
        let rows = batch
            .iter()
            .map(|entry| {
                let seq = self
                    .sequences
                    .get_mut(&entry.id)
                    .ok_or(ExecError::UnknownSequence(entry.id))?;
                let want = if entry.all_rows {
                    LogitsWanted::All
                } else {
                    LogitsWanted::Last
                };
                let replay_from = self.replay_from.get(&entry.id).copied();
                match (&experts, replay_from) {
                    (Some(experts), Some(from)) => self.model.forward_replay_with_experts(
                        seq,
                        entry.tokens,
                        want,
                        from,
                        experts,
                    ),
                    (Some(experts), None) => {
                        self.model
                            .forward_with_experts(seq, entry.tokens, want, experts)
                    }
                    (None, Some(from)) => self.model.forward_replay(seq, entry.tokens, want, from),
                    (None, None) => self.model.forward(seq, entry.tokens, want),
                }
                .map_err(|e| sequence_error(entry.id, e))
            })
            .collect();
        if let (Some(ep), Some(comm), Some(experts)) = (self.ep.as_mut(), &comm, &experts) {
            ep.parallel.finish_step(StepRecord {
                dp: ep.dp,
                rank_step: ep.steps,
                epoch: comm.epoch(),
                served: experts.epochs_seen(),
                tokens: batch.iter().map(|e| e.tokens.len()).sum(),
            });
            ep.steps += 1;
        }
        rows
    }

    fn plan_replay(&mut self, id: RequestId, decoder_from: usize) -> Result<(), ExecError> {
        if !self.sequences.contains_key(&id) {
            return Err(ExecError::UnknownSequence(id));
        }
        if decoder_from > 0 {
            self.replay_from.insert(id, decoder_from);
        }
        Ok(())
    }

    fn draft(&mut self, id: RequestId, anchor: u32) -> Result<Option<Draft>, ExecError> {
        if self.model.config().dspark.is_none() {
            return Ok(None);
        }
        let seq = self
            .sequences
            .get(&id)
            .ok_or(ExecError::UnknownSequence(id))?;
        let proposal = self
            .model
            .draft(seq, anchor)
            .map_err(|e| sequence_error(id, e))?;
        Ok(Some(Draft {
            tokens: proposal.tokens.get(1..).unwrap_or_default().to_vec(),
            confidences: proposal.confidence,
        }))
    }
}

/// Hands every rank the same loaded model.
#[derive(Debug, Clone)]
pub struct ModelFactory {
    pub model: Arc<Model>,
    pub description: String,
}

impl ExecutorFactory for ModelFactory {
    fn build(&self, _dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        Ok(Box::new(ModelExecutor::new(self.model.clone())))
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn sliding_window(&self) -> Option<usize> {
        Some(self.model.config().window_size)
    }
}
