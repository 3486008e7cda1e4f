//! `V4Executor`: the `RankExecutor` over the DeepSeek-V4 family's model (`deepinfer_model::v4`,
//! V4-Flash and V4-Flash-0731).
//!
//! Owns one `v4::SequenceState` per live request. A step is one `v4::Model::forward_step` over
//! every entry (each sequence's last logits row, or every row of a verify entry), bitwise what
//! each sequence would get alone; entries with sampling parameters are sampled inside the step,
//! on the model's backend. What V4 does not have is left to the trait's defaults: no decoder
//! bounded replay (`plan_replay` is ignored and the factory reports no sliding window, so the
//! engine runs no `ReplayActor`), no Engram, no expert parallelism, and deferred rows come back
//! as host logits (`execute_deferred` / `sample_logits` defaults). Drafting: a V4-Flash-0731
//! checkpoint's DSpark drafter proposes through `v4::Model::draft` (one request at a time);
//! V4-Flash's MTP block has no confidence head, so it does not draft here (no drafts).
//!
//! Built per rank by `rank::factory::ModelFactory`.

use std::sync::Arc;

use deepinfer_model::v4::{Model, SequenceState, StepEntry};
use deepinfer_model::{EntryOutput, LogitsWanted};
use deepinfer_topology::RequestId;

use crate::rank::executor::{Draft, ExecError, RankExecutor, SeqTokens};
use crate::rank::sequences::{Sequences, sequence_error};
use crate::sampling::SamplingParams;

/// The executor of one rank over a shared V4 model.
pub struct V4Executor {
    model: Arc<Model>,
    sequences: Sequences<SequenceState>,
}

impl V4Executor {
    pub fn new(model: Arc<Model>) -> Self {
        V4Executor {
            model,
            sequences: Sequences::default(),
        }
    }

    /// One `v4::Model::forward_step` over the batch; entry `i` samples with `sampling[i]` when
    /// given.
    fn step(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        let model = &self.model;
        let seqs = self
            .sequences
            .for_step(batch, |seq, tokens| model.check_chunk(seq, tokens))?;
        let mut entries = Vec::with_capacity(batch.len());
        for (i, (entry, seq)) in batch.iter().zip(seqs).enumerate() {
            entries.push(StepEntry {
                seq,
                tokens: entry.tokens,
                want: if entry.all_rows {
                    LogitsWanted::All
                } else {
                    LogitsWanted::Last
                },
                sample: sampling.get(i).copied().flatten(),
            });
        }
        self.model
            .forward_step(&mut entries)
            .map_err(|e| ExecError::Backend(e.to_string()))
    }
}

impl RankExecutor for V4Executor {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        self.sequences.open(id, || self.model.new_sequence())
    }

    fn free_sequence(&mut self, id: RequestId) {
        self.sequences.close(id);
    }

    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError> {
        let seq = self.sequences.get_mut(id)?;
        self.model
            .rollback(seq, len)
            .map_err(|e| sequence_error(id, e))
    }

    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.sequences.get(id).map(SequenceState::len)
    }

    fn live_sequences(&self) -> usize {
        self.sequences.live()
    }

    fn state_bytes_held(&self) -> Option<u64> {
        Some(self.sequences.states().map(SequenceState::held_bytes).sum())
    }

    fn execute(&mut self, batch: &[SeqTokens<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        self.step(batch, &[])?
            .into_iter()
            .zip(batch)
            .map(|(out, entry)| {
                out.into_logits().ok_or_else(|| ExecError::Sequence {
                    id: entry.id,
                    message: "the step returned no logits for an unsampled entry".to_string(),
                })
            })
            .collect()
    }

    fn execute_sampled(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        self.step(batch, sampling)
    }

    /// The DSpark drafter's proposal (V4-Flash-0731), `None` for a model without one.
    fn draft(&mut self, id: RequestId, anchor: u32) -> Result<Option<Draft>, ExecError> {
        let seq = self.sequences.get(id)?;
        if !self.model.has_dspark() {
            return Ok(None);
        }
        let proposal = self
            .model
            .draft(seq, anchor)
            .map_err(|e| sequence_error(id, e))?;
        Ok(Some(Draft {
            // The proposal starts with the anchor itself.
            tokens: proposal.tokens.get(1..).unwrap_or_default().to_vec(),
            confidences: proposal.confidence,
        }))
    }
}

#[cfg(test)]
mod tests {
    use deepinfer_model::checkpoint::write_random_checkpoint;
    use deepinfer_model::config::ModelConfig;

    use super::*;

    /// The tiny V4 architecture (v4-tiny's config) with seeded random weights.
    fn tiny_v4() -> (tempfile::TempDir, Arc<Model>) {
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_checkpoint(&ModelConfig::tiny_v4(), 3, dir.path(), 1).expect("written");
        let model = Model::load(dir.path()).expect("loads");
        (dir, Arc::new(model))
    }

    fn entry(id: RequestId, tokens: &[u32]) -> SeqTokens<'_> {
        SeqTokens {
            id,
            tokens,
            all_rows: false,
        }
    }

    /// A sampled entry returns the token `sample` picks from the logits the unsampled run
    /// returns, at the position after its chunk; a verify entry returns every row.
    #[test]
    fn sampled_and_verify_entries_match_the_logits() {
        use crate::sampling::sample;
        let (_dir, model) = tiny_v4();
        let vocab = model.config().vocab_size;
        let (a, b) = (RequestId(1), RequestId(2));
        let mut sampled = V4Executor::new(model.clone());
        let mut reference = V4Executor::new(model);
        for executor in [&mut sampled, &mut reference] {
            executor.new_sequence(a).expect("new");
            executor.new_sequence(b).expect("new");
        }
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
            seed: 17,
        };
        let batch = [entry(a, &[3, 9, 27]), entry(b, &[5, 6])];
        let outputs = sampled
            .execute_sampled(&batch, &[Some(params), None])
            .expect("step");
        let logits = reference.execute(&batch).expect("step");
        let token = sample(&logits[0], &params, 3).expect("a token");
        assert_eq!(outputs[0], EntryOutput::Tokens(vec![token]));
        assert_eq!(outputs[1], EntryOutput::Logits(logits[1].clone()));
        let verify = SeqTokens {
            id: b,
            tokens: &[8, 1, 2],
            all_rows: true,
        };
        let rows = reference.execute(&[verify]).expect("verify");
        assert_eq!(rows[0].len(), 3 * vocab);
        assert_eq!(reference.sequence_len(b), Ok(5));
        reference.rollback(b, 3).expect("rolls back");
        assert_eq!(reference.sequence_len(b), Ok(3));
    }

    /// Bad input fails with the sequence named, before any sequence changes; a model without a
    /// DSpark drafter proposes nothing.
    #[test]
    fn bad_entries_are_named_and_nothing_drafts_without_a_drafter() {
        let (_dir, model) = tiny_v4();
        let mut executor = V4Executor::new(model);
        let (a, b) = (RequestId(1), RequestId(2));
        executor.new_sequence(a).expect("new");
        assert_eq!(
            executor.new_sequence(a),
            Err(ExecError::DuplicateSequence(a))
        );
        assert_eq!(
            executor.execute(&[entry(b, &[1])]).err(),
            Some(ExecError::UnknownSequence(b))
        );
        executor.new_sequence(b).expect("new");
        let err = executor
            .execute(&[entry(a, &[4, 5]), entry(b, &[1024])])
            .expect_err("a token outside the vocabulary");
        let ExecError::Sequence { id, message } = err else {
            panic!("not a sequence error: {err:?}");
        };
        assert_eq!(id, b);
        assert!(message.contains("1024"), "{message}");
        assert_eq!(executor.sequence_len(a), Ok(0), "nothing ran");
        let twice = executor.execute(&[entry(a, &[4]), entry(a, &[5])]);
        assert!(matches!(twice, Err(ExecError::Backend(_))), "{twice:?}");
        executor.execute(&[entry(a, &[4, 5])]).expect("runs");
        assert_eq!(executor.draft(a, 6), Ok(None));
        assert_eq!(
            executor.draft(RequestId(9), 6).err(),
            Some(ExecError::UnknownSequence(RequestId(9)))
        );
        executor.free_sequence(a);
        assert_eq!(executor.live_sequences(), 1);
    }
}
