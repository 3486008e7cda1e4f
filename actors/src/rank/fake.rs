//! `FakeExecutor`: a deterministic stand-in for the model, for actor tests and simulations.
//!
//! Its logits are a pure function of (last input token, its position): one favoured token gets
//! a clear peak and the rest a hashed spread, so greedy decoding follows a known chain and
//! sampling at temperature 1 is genuinely random but reproducible. Timing is emulated: every
//! step costs `host_time` on the rank thread (input preparation and launches, which async
//! scheduling can overlap with the device) and `device_time` on an emulated asynchronous device.
//! `panic_on_step` makes the n-th non-empty `execute` call panic (a stand-in for a device fault).
//! An optional scripted drafter (`FakeDrafter`) proposes the greedy chain for a set number of
//! drafts and then wrong tokens, with a fixed confidence: tests of DSpark's scheduling and
//! acceptance know exactly what it proposes.

use std::collections::HashMap;
use std::time::Duration;

use deepinfer_topology::RequestId;

use deepinfer_model::EntryOutput;

use crate::rank::executor::{
    Draft, ExecError, ExecStep, ExecutorFactory, RankExecutor, SeqTokens, sample_on_host,
};

/// A scripted drafter: each proposal has `block_size` drafts, of which the first `correct`
/// follow the greedy chain and the rest are wrong; every draft has raw confidence `confidence`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FakeDrafter {
    /// Drafts per proposal (tokens).
    pub block_size: usize,
    /// Leading drafts that equal the greedy chain (tokens).
    pub correct: usize,
    /// Raw confidence (a logit: 5 -> sigmoid 0.993, -5 -> 0.007) of every draft.
    pub confidence: f32,
}

/// Settings of the fake backend.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeConfig {
    /// Logits row width (tokens). Default 512.
    pub vocab_size: usize,
    /// CPU time per step on the rank thread. Default 0.
    pub host_time: Duration,
    /// Emulated device time per step after launch. Default 0.
    pub device_time: Duration,
    /// On these DP ranks, panic in the n-th (1-based) non-empty step. Default: none.
    pub panic_on_step: Option<(Vec<usize>, u64)>,
    /// Emulated device time per token of a step, on top of `device_time`. Default 0.
    pub device_time_per_token: Duration,
    /// The scripted drafter; `None` (default) = no drafter.
    pub drafter: Option<FakeDrafter>,
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            vocab_size: 512,
            host_time: Duration::ZERO,
            device_time: Duration::ZERO,
            panic_on_step: None,
            device_time_per_token: Duration::ZERO,
            drafter: None,
        }
    }
}

/// The favoured next token after `token` at `position` (what greedy decoding picks).
pub fn favoured_token(token: u32, position: usize, vocab_size: usize) -> u32 {
    (hash2(u64::from(token), position as u64) % vocab_size as u64) as u32
}

/// A 64-bit mix of two words (splitmix-style), the stand-in's only source of variety.
pub fn hash2(a: u64, b: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 32)
}

/// `count` drafts after `anchor` (which sits at position `held`): the first `correct` follow the
/// greedy chain of [`favoured_token`], the rest are wrong (one past the chain's token).
pub fn draft_chain(
    anchor: u32,
    held: usize,
    vocab_size: usize,
    correct: usize,
    count: usize,
) -> Vec<u32> {
    let mut previous = anchor;
    (0..count)
        .map(|i| {
            let chain = favoured_token(previous, held + i, vocab_size);
            previous = if i < correct {
                chain
            } else {
                (chain + 1) % vocab_size as u32
            };
            previous
        })
        .collect()
}

/// Fills `row` with the fake logits for the token at `position`.
pub fn fake_logits(token: u32, position: usize, row: &mut [f32]) {
    let h = hash2(u64::from(token), position as u64);
    for (v, out) in row.iter_mut().enumerate() {
        // A spread in [0, 2): cheap, deterministic, different per (token, position).
        let spread = (h.wrapping_add(v as u64).wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) % 2048;
        *out = spread as f32 / 1024.0;
    }
    let peak = favoured_token(token, position, row.len()) as usize;
    row[peak] = 8.0;
}

/// The fake executor of one rank.
pub struct FakeExecutor {
    config: FakeConfig,
    dp: usize,
    /// Per sequence: (tokens held, last token).
    sequences: HashMap<RequestId, (usize, u32)>,
    steps: u64,
}

impl FakeExecutor {
    pub fn new(config: FakeConfig, dp: usize) -> Self {
        FakeExecutor {
            config,
            dp,
            sequences: HashMap::new(),
            steps: 0,
        }
    }
}

impl FakeExecutor {
    /// Every entry's logits rows (see [`RankExecutor::execute`]), the step's emulated host time
    /// spent.
    fn rows(&mut self, batch: &[SeqTokens<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        if !self.config.host_time.is_zero() {
            std::thread::sleep(self.config.host_time);
        }
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.steps += 1;
        if let Some((ranks, n)) = &self.config.panic_on_step
            && ranks.contains(&self.dp)
            && self.steps == *n
        {
            panic!("injected fault: rank {} step {}", self.dp, self.steps);
        }
        let mut rows = Vec::with_capacity(batch.len());
        for entry in batch {
            let seq = self
                .sequences
                .get_mut(&entry.id)
                .ok_or(ExecError::UnknownSequence(entry.id))?;
            let Some(&last) = entry.tokens.last() else {
                return Err(ExecError::Sequence {
                    id: entry.id,
                    message: "empty input".into(),
                });
            };
            let start = seq.0;
            seq.0 += entry.tokens.len();
            seq.1 = last;
            let vocab = self.config.vocab_size;
            let row = if entry.all_rows {
                let mut all = vec![0.0; entry.tokens.len() * vocab];
                for (i, (&token, out)) in entry
                    .tokens
                    .iter()
                    .zip(all.chunks_exact_mut(vocab))
                    .enumerate()
                {
                    fake_logits(token, start + i, out);
                }
                all
            } else {
                let mut row = vec![0.0; vocab];
                fake_logits(last, seq.0 - 1, &mut row);
                row
            };
            rows.push(row);
        }
        Ok(rows)
    }

    /// The scripted drafter's proposal after `anchor` for sequence `id`.
    fn draft_one(&mut self, id: RequestId, anchor: u32) -> Result<Option<Draft>, ExecError> {
        let Some(drafter) = self.config.drafter else {
            return Ok(None);
        };
        let held = self.sequence_len(id)?;
        let tokens = draft_chain(
            anchor,
            held,
            self.config.vocab_size,
            drafter.correct,
            drafter.block_size,
        );
        Ok(Some(Draft {
            tokens,
            confidences: vec![drafter.confidence; drafter.block_size],
        }))
    }
}

impl RankExecutor for FakeExecutor {
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        if self.sequences.insert(id, (0, 0)).is_some() {
            return Err(ExecError::DuplicateSequence(id));
        }
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
        if len > seq.0 {
            return Err(ExecError::Sequence {
                id,
                message: format!("rollback to {len} tokens, but the sequence holds {}", seq.0),
            });
        }
        seq.0 = len;
        Ok(())
    }

    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.sequences
            .get(&id)
            .map(|s| s.0)
            .ok_or(ExecError::UnknownSequence(id))
    }

    fn live_sequences(&self) -> usize {
        self.sequences.len()
    }

    fn execute(
        &mut self,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        let held = batch
            .iter()
            .map(|entry| self.sequence_len(entry.id))
            .collect::<Result<Vec<_>, _>>()?;
        let rows = self.rows(batch)?;
        sample_on_host(batch, sampling, &held, rows, self.config.vocab_size)
    }

    fn draft(&mut self, requests: &[(RequestId, u32)]) -> Result<Vec<Option<Draft>>, ExecError> {
        requests
            .iter()
            .map(|&(id, anchor)| self.draft_one(id, anchor))
            .collect()
    }

    fn device_latency(&self, batch_tokens: usize) -> Duration {
        self.config.device_time
            + self.config.device_time_per_token * u32::try_from(batch_tokens).unwrap_or(u32::MAX)
    }
}

/// Builds `FakeExecutor`s.
#[derive(Debug, Clone, Default)]
pub struct FakeFactory(pub FakeConfig);

impl ExecutorFactory for FakeFactory {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        Ok(Box::new(FakeExecutor::new(self.0.clone(), dp)))
    }

    fn describe(&self) -> String {
        format!("fake backend (vocab {})", self.0.vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank::executor::execute_rows;

    /// A batch of one entry: `tokens` of sequence `id`.
    fn one_entry(id: RequestId, tokens: &[u32], all_rows: bool) -> [SeqTokens<'_>; 1] {
        [SeqTokens {
            id,
            tokens,
            all_rows,
        }]
    }

    #[test]
    fn logits_depend_on_token_and_position_only() {
        let mut a = vec![0.0; 64];
        let mut b = vec![0.0; 64];
        fake_logits(5, 9, &mut a);
        fake_logits(5, 9, &mut b);
        assert_eq!(a, b);
        fake_logits(5, 10, &mut b);
        assert_ne!(a, b);
        let peak = a
            .iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .unwrap()
            .0;
        assert_eq!(peak as u32, favoured_token(5, 9, 64));
    }

    #[test]
    fn sequences_grow_roll_back_and_free() {
        let mut ex = FakeExecutor::new(FakeConfig::default(), 0);
        let id = RequestId(1);
        ex.new_sequence(id).unwrap();
        assert_eq!(ex.new_sequence(id), Err(ExecError::DuplicateSequence(id)));
        let rows = execute_rows(&mut ex, &one_entry(id, &[1, 2, 3], false)).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(ex.sequence_len(id), Ok(3));
        assert!(ex.rollback(id, 4).is_err());
        ex.rollback(id, 1).unwrap();
        assert_eq!(ex.sequence_len(id), Ok(1));
        ex.free_sequence(id);
        assert_eq!(ex.live_sequences(), 0);
        assert!(execute_rows(&mut ex, &one_entry(id, &[1], false)).is_err());
    }

    #[test]
    fn all_rows_and_scripted_drafts_follow_the_chain() {
        let vocab = 64;
        let drafter = FakeDrafter {
            block_size: 4,
            correct: 2,
            confidence: 3.0,
        };
        let mut ex = FakeExecutor::new(
            FakeConfig {
                vocab_size: vocab,
                drafter: Some(drafter),
                ..FakeConfig::default()
            },
            0,
        );
        let id = RequestId(3);
        ex.new_sequence(id).unwrap();
        let rows = execute_rows(&mut ex, &one_entry(id, &[9, 4, 7], true)).unwrap();
        assert_eq!(rows[0].len(), 3 * vocab);
        let mut expected = vec![0.0; vocab];
        fake_logits(4, 1, &mut expected);
        assert_eq!(&rows[0][vocab..2 * vocab], expected.as_slice());
        // The anchor sits at position 3; drafts follow the chain twice, then go wrong.
        let draft = ex.draft(&[(id, 11)]).unwrap().remove(0).unwrap();
        let first = favoured_token(11, 3, vocab);
        let second = favoured_token(first, 4, vocab);
        assert_eq!(&draft.tokens[..2], &[first, second]);
        assert_ne!(draft.tokens[2], favoured_token(second, 5, vocab));
        assert_eq!(draft.confidences, vec![3.0; 4]);
    }
}
