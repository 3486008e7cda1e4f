//! The execution boundary: `RankExecutor`, the synchronous interface the rank thread drives.
//!
//! Owns nothing but the contract. An executor holds the per-sequence model state of one DP rank
//! and runs one step: for each entry, append the entry's tokens to that sequence and return the
//! last row of logits. Sampling, the diff protocol and pipelining live above it in
//! `rank::worker`, so a backend only does the math. It runs on the rank's own OS thread, never
//! inside an async task.

use std::time::Duration;

use deepinfer_topology::RequestId;

/// A backend failure, reported to the scheduler as `RankError::Backend`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    #[error("unknown sequence {0}")]
    UnknownSequence(RequestId),
    #[error("sequence {0} already exists")]
    DuplicateSequence(RequestId),
    #[error("sequence {id}: {message}")]
    Sequence { id: RequestId, message: String },
    #[error("{0}")]
    Backend(String),
}

/// One sequence's tokens in a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqTokens<'a> {
    pub id: RequestId,
    pub tokens: &'a [u32],
}

/// Per-rank model execution. Synchronous; one instance per rank thread.
pub trait RankExecutor: Send {
    /// Width of a logits row.
    fn vocab_size(&self) -> usize;
    /// Create the (empty) state of a sequence.
    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError>;
    /// Drop a sequence's state; unknown ids are ignored.
    fn free_sequence(&mut self, id: RequestId);
    /// Keep only the first `len` tokens of a sequence (after a partially accepted verify).
    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError>;
    /// Tokens held by a sequence.
    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError>;
    /// Sequences currently held.
    fn live_sequences(&self) -> usize;
    /// Append each entry's tokens to its sequence; returns one logits row (`vocab_size` wide)
    /// per entry, in order. Entries name distinct sequences.
    fn execute(&mut self, batch: &[SeqTokens<'_>]) -> Result<Vec<Vec<f32>>, ExecError>;
    /// Time the device still needs after `execute` returned before the step's results exist
    /// (an asynchronous device queue). Zero for the CPU backend, whose work is done on return.
    fn device_latency(&self, _batch_tokens: usize) -> Duration {
        Duration::ZERO
    }
}

/// Builds one executor per rank, on that rank's thread (a model load happens there, never on
/// an async worker).
pub trait ExecutorFactory: Send + Sync {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError>;
    /// What it runs, for the startup log.
    fn describe(&self) -> String;
}
