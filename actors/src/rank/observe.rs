//! Tapping what the ranks compute without changing it.
//!
//! [`ObservedFactory`] wraps any [`ExecutorFactory`] so that every logits row its executors return
//! reaches a [`RankObserver`], tagged with the request and the absolute position of the token it
//! was computed at, and so does every decoder start a rank is given (bounded replay). It is a
//! layer ([`ExecutorLayer`]): every other call passes through unchanged — drafts, device latency,
//! the factory's sliding window and expert parallelism — so an observed engine runs exactly as
//! the unobserved one. Evaluation
//! harnesses use it to compare an engine's rows with a reference; [`RowLog`] is the observer that
//! keeps them.

use deepinfer_model::EntryOutput;
use deepinfer_topology::RequestId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::rank::executor::{
    ExecError, ExecStep, ExecutorFactory, ExecutorLayer, LayeredFactory, RankExecutor,
    execute_rows, sample_on_host,
};

/// One logits row as a rank returned it.
#[derive(Debug, Clone, Copy)]
pub struct ObservedRow<'a> {
    /// The DP rank that computed it.
    pub dp: usize,
    pub id: RequestId,
    /// Position of the token the row was computed at (it predicts position + 1).
    pub position: usize,
    pub logits: &'a [f32],
    /// Part of a DSpark verify (every row of anchor + drafts), not a plain step's last row.
    pub verify: bool,
    /// Sequences in the step that computed it (the rank's batch).
    pub step_sequences: usize,
}

/// Receives what the ranks of an observed engine compute, on the rank threads (keep it cheap).
pub trait RankObserver: Send + Sync {
    /// A logits row.
    fn row(&self, row: ObservedRow<'_>);
    /// Rank `dp` was told that sequence `id`'s decoder layers start at `decoder_from`.
    fn replay_planned(&self, _dp: usize, _id: RequestId, _decoder_from: usize) {}
}

/// An executor factory whose executors report their rows to an observer.
pub type ObservedFactory = LayeredFactory<Observed>;

impl ObservedFactory {
    pub fn new(inner: Arc<dyn ExecutorFactory>, observer: Arc<dyn RankObserver>) -> Self {
        LayeredFactory::layered(inner, "observed", move |dp| Observed {
            observer: observer.clone(),
            dp,
        })
    }
}

/// The layer of one observed rank: its rows go to the observer, read on the host (the rows to
/// sample are sampled there too, exactly as on the device).
pub struct Observed {
    observer: Arc<dyn RankObserver>,
    dp: usize,
}

impl ExecutorLayer for Observed {
    fn execute(
        &mut self,
        inner: &mut dyn RankExecutor,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        let starts = batch
            .iter()
            .map(|s| inner.sequence_len(s.id))
            .collect::<Result<Vec<_>, ExecError>>()?;
        let rows = execute_rows(inner, batch)?;
        let vocab = inner.vocab_size().max(1);
        for ((seq, &start), row) in batch.iter().zip(&starts).zip(&rows) {
            let report = |position, logits, verify| {
                self.observer.row(ObservedRow {
                    dp: self.dp,
                    id: seq.id,
                    position,
                    logits,
                    verify,
                    step_sequences: batch.len(),
                })
            };
            if seq.all_rows {
                for (i, logits) in row.chunks_exact(vocab).enumerate() {
                    report(start + i, logits, true);
                }
            } else if !seq.tokens.is_empty() {
                report(start + seq.tokens.len() - 1, row, false);
            }
        }
        sample_on_host(batch, sampling, &starts, rows, vocab)
    }
    fn plan_replay(
        &mut self,
        inner: &mut dyn RankExecutor,
        id: RequestId,
        decoder_from: usize,
    ) -> Result<(), ExecError> {
        self.observer.replay_planned(self.dp, id, decoder_from);
        inner.plan_replay(id, decoder_from)
    }
}

/// Keeps the last row seen per `(request, position)`.
#[derive(Debug, Default)]
pub struct RowLog {
    rows: Mutex<HashMap<(RequestId, usize), Vec<f32>>>,
    /// Keep verify rows too (by default only plain steps' rows are kept).
    with_verify: bool,
}

impl RowLog {
    /// A log of plain steps' rows (a verify's rows are skipped).
    pub fn new() -> Self {
        RowLog::default()
    }

    /// A log that also keeps verify rows.
    pub fn with_verify_rows() -> Self {
        RowLog {
            with_verify: true,
            ..RowLog::default()
        }
    }

    /// Every row kept so far.
    pub fn snapshot(&self) -> HashMap<(RequestId, usize), Vec<f32>> {
        self.lock().clone()
    }

    /// The row of `id` at `position`, if one was seen.
    pub fn get(&self, id: RequestId, position: usize) -> Option<Vec<f32>> {
        self.lock().get(&(id, position)).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(RequestId, usize), Vec<f32>>> {
        // A panic while holding the lock cannot leave the map half-written (one insert).
        self.rows
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl RankObserver for RowLog {
    fn row(&self, row: ObservedRow<'_>) {
        if row.verify && !self.with_verify {
            return;
        }
        self.lock()
            .insert((row.id, row.position), row.logits.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank::executor::SeqTokens;
    use crate::rank::fake::{FakeConfig, FakeFactory};

    fn observed() -> (Box<dyn RankExecutor>, Arc<RowLog>, Arc<RowLog>) {
        let plain = Arc::new(RowLog::new());
        let all = Arc::new(RowLog::with_verify_rows());
        struct Both(Arc<RowLog>, Arc<RowLog>);
        impl RankObserver for Both {
            fn row(&self, row: ObservedRow<'_>) {
                self.0.row(row);
                self.1.row(row);
            }
        }
        let factory = ObservedFactory::new(
            Arc::new(FakeFactory(FakeConfig::default())),
            Arc::new(Both(plain.clone(), all.clone())),
        );
        (factory.build(0).expect("fake executor"), plain, all)
    }

    #[test]
    fn rows_carry_the_position_of_their_token() {
        let (mut exec, plain, all) = observed();
        let id = RequestId(3);
        exec.new_sequence(id).expect("new");
        let prefill = execute_rows(
            exec.as_mut(),
            &[SeqTokens {
                id,
                tokens: &[5, 6, 7],
                all_rows: false,
            }],
        )
        .expect("prefill");
        assert_eq!(plain.get(id, 2), Some(prefill[0].clone()));
        assert_eq!(plain.get(id, 0), None);

        let verify = execute_rows(
            exec.as_mut(),
            &[SeqTokens {
                id,
                tokens: &[8, 9],
                all_rows: true,
            }],
        )
        .expect("verify");
        let vocab = exec.vocab_size();
        assert_eq!(plain.get(id, 3), None, "verify rows skipped by default");
        assert_eq!(all.get(id, 3).as_deref(), Some(&verify[0][..vocab]));
        assert_eq!(all.get(id, 4).as_deref(), Some(&verify[0][vocab..]));
        assert_eq!(all.snapshot().len(), 3);
    }

    #[test]
    fn rows_carry_the_size_of_their_step() {
        struct Sizes(Mutex<Vec<usize>>);
        impl RankObserver for Sizes {
            fn row(&self, row: ObservedRow<'_>) {
                self.0.lock().expect("sizes").push(row.step_sequences);
            }
        }
        let sizes = Arc::new(Sizes(Mutex::new(Vec::new())));
        let factory =
            ObservedFactory::new(Arc::new(FakeFactory(FakeConfig::default())), sizes.clone());
        let mut exec = factory.build(0).expect("fake executor");
        let (a, b) = (RequestId(1), RequestId(2));
        exec.new_sequence(a).expect("new");
        exec.new_sequence(b).expect("new");
        let entry = |id, tokens| SeqTokens {
            id,
            tokens,
            all_rows: false,
        };
        execute_rows(exec.as_mut(), &[entry(a, &[1, 2]), entry(b, &[3])]).expect("two");
        execute_rows(exec.as_mut(), &[entry(a, &[4])]).expect("one");
        assert_eq!(*sizes.0.lock().expect("sizes"), vec![2, 2, 1]);
    }
}
