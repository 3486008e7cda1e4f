//! `Sequences`: a rank executor's model state per live request (either family's
//! `SequenceState`), with the checks every executor makes: a request is opened once, every entry
//! of a step names a distinct live sequence, and every entry's tokens are checked before any
//! state changes (so a bad entry fails the step naming its request, and nothing is lost).

use std::collections::{HashMap, HashSet};

use deepinfer_model::error::ModelError;
use deepinfer_topology::RequestId;

use crate::rank::executor::{ExecError, SeqTokens};

/// The live sequences of one rank executor, by request.
#[derive(Debug)]
pub struct Sequences<S> {
    states: HashMap<RequestId, S>,
}

impl<S> Default for Sequences<S> {
    fn default() -> Self {
        Sequences {
            states: HashMap::new(),
        }
    }
}

impl<S> Sequences<S> {
    /// Opens `id` with the state `make` builds (only when `id` is not live).
    pub fn open(&mut self, id: RequestId, make: impl FnOnce() -> S) -> Result<(), ExecError> {
        if self.states.contains_key(&id) {
            return Err(ExecError::DuplicateSequence(id));
        }
        self.states.insert(id, make());
        Ok(())
    }

    /// Frees `id` (nothing when it is not live).
    pub fn close(&mut self, id: RequestId) {
        self.states.remove(&id);
    }

    pub fn get(&self, id: RequestId) -> Result<&S, ExecError> {
        self.states.get(&id).ok_or(ExecError::UnknownSequence(id))
    }

    pub fn get_mut(&mut self, id: RequestId) -> Result<&mut S, ExecError> {
        self.states
            .get_mut(&id)
            .ok_or(ExecError::UnknownSequence(id))
    }

    /// Live sequences.
    pub fn live(&self) -> usize {
        self.states.len()
    }

    /// Every live state.
    pub fn states(&self) -> impl Iterator<Item = &S> {
        self.states.values()
    }

    /// The states of a step's entries, in the batch's order, once every entry names a distinct
    /// live sequence and `check(state, tokens)` accepts its tokens.
    pub fn for_step(
        &mut self,
        batch: &[SeqTokens<'_>],
        check: impl Fn(&S, &[u32]) -> Result<(), ModelError>,
    ) -> Result<Vec<&mut S>, ExecError> {
        for entry in batch {
            check(self.get(entry.id)?, entry.tokens).map_err(|e| sequence_error(entry.id, e))?;
        }
        let ids: HashSet<RequestId> = batch.iter().map(|entry| entry.id).collect();
        if ids.len() != batch.len() {
            return Err(ExecError::Backend(
                "a step names the same sequence twice".to_string(),
            ));
        }
        let mut states: HashMap<RequestId, &mut S> = self
            .states
            .iter_mut()
            .filter(|(id, _)| ids.contains(id))
            .map(|(&id, state)| (id, state))
            .collect();
        batch
            .iter()
            .map(|entry| {
                states
                    .remove(&entry.id)
                    .ok_or(ExecError::UnknownSequence(entry.id))
            })
            .collect()
    }
}

/// A model error about sequence `id`, as the executor reports it.
pub fn sequence_error(id: RequestId, e: ModelError) -> ExecError {
    ExecError::Sequence {
        id,
        message: e.to_string(),
    }
}
