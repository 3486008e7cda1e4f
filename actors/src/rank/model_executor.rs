//! `ModelExecutor`: the `RankExecutor` over the real model (`deepinfer_model::Model`).
//!
//! Owns one `SequenceState` per live request. A step appends each entry's tokens with
//! `Model::forward(.., LogitsWanted::Last)`; the model is shared (read-only) by every rank of the
//! process. The runtime adds nothing to the numbers: the logits are exactly the model's.

use std::collections::HashMap;
use std::sync::Arc;

use deepinfer_model::{LogitsWanted, Model, SequenceState};
use deepinfer_topology::RequestId;

use crate::rank::executor::{ExecError, ExecutorFactory, RankExecutor, SeqTokens};

/// The executor of one rank over a shared model.
pub struct ModelExecutor {
    model: Arc<Model>,
    sequences: HashMap<RequestId, SequenceState>,
}

impl ModelExecutor {
    pub fn new(model: Arc<Model>) -> Self {
        ModelExecutor {
            model,
            sequences: HashMap::new(),
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
        batch
            .iter()
            .map(|entry| {
                let seq = self
                    .sequences
                    .get_mut(&entry.id)
                    .ok_or(ExecError::UnknownSequence(entry.id))?;
                self.model
                    .forward(seq, entry.tokens, LogitsWanted::Last)
                    .map_err(|e| sequence_error(entry.id, e))
            })
            .collect()
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
}
