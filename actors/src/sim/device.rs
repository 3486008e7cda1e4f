//! `SimulatedExecutor`: a rank executor that computes nothing and costs virtual time.
//!
//! Tokens come from the fake backend's deterministic stand-in (`rank::fake`: the favoured token
//! after each token at its position, a point mass, so every sampling setting picks it). Each step
//! is charged to the `VirtualFabric` at the cost model's price (`deepinfer_model::cost`: the
//! step's tokens at their positions, its logits rows, the drafts of the previous step) and
//! returns when every rank's step is in. DSpark: the drafter proposes `max_draft_tokens` tokens
//! of which a leading run follows the chain, each with probability `accept_rate` (a pure function
//! of request, position and seed); raw confidences are `logit(accept_rate)` + 1 for those and
//! − 2 for the rest, jittered by ±0.5, so the confidence head is informative but not perfect.
//! When a sequence is freed its token times go to the fabric (TTFT and inter-token latency).

use std::sync::Arc;
use std::time::Duration;

use deepinfer_model::EntryOutput;
use deepinfer_model::config::ModelConfig;
use deepinfer_model::cost::step::{StepEntry, StepWork};
use deepinfer_model::error::ModelError;
use deepinfer_topology::{DpRank, RequestId};

use crate::comm::Comm;
use crate::dspark::accept::accept_sampled;
use crate::experts::parallel::{ExpertParallel, StepRecord};
use crate::rank::executor::{Draft, ExecError, ExecStep, ExecutorFactory, RankExecutor, SeqTokens};
use crate::rank::fake::{draft_chain, fake_logits, favoured_token, hash2};
use crate::rank::sequences::Sequences;
use crate::sampling::SamplingParams;
use crate::sim::fabric::{RankStep, TokenTimes, VirtualFabric};

/// The simulated drafter's law.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftLaw {
    /// Drafts per proposal (tokens).
    pub drafts: usize,
    /// Probability that a draft continues the chain, given its predecessors did.
    pub accept_rate: f64,
}

/// Context position the DSpark step-rate profile assumes (tokens).
pub const PROFILE_CONTEXT: usize = 1024;

struct SimSeq {
    held: usize,
    times: TokenTimes,
}

/// The simulated device of one DP rank.
pub struct SimulatedExecutor {
    dp: usize,
    model: Arc<ModelConfig>,
    fabric: Arc<VirtualFabric>,
    draft: Option<DraftLaw>,
    seed: u64,
    sequences: Sequences<SimSeq>,
    /// Draft logits rows computed since the last step (charged to the next one).
    draft_rows: usize,
    /// Steps executed, empty ones included.
    steps: u64,
}

impl SimulatedExecutor {
    fn run(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        let vocab = self.model.vocab_size;
        let mut entries = Vec::with_capacity(batch.len());
        let mut outputs = Vec::with_capacity(batch.len());
        let mut produced = Vec::with_capacity(batch.len());
        let mut prefill = false;
        let states = self.sequences.for_step(batch, |_, tokens| match tokens {
            [] => Err(ModelError::Sequence {
                message: "empty input".into(),
            }),
            _ => Ok(()),
        })?;
        for (i, (entry, seq)) in batch.iter().zip(states).enumerate() {
            let last = entry.tokens[entry.tokens.len() - 1];
            let start = seq.held;
            seq.held += entry.tokens.len();
            prefill |= !entry.all_rows && entry.tokens.len() > 1;
            let rows: Vec<(u32, usize)> = if entry.all_rows {
                entry
                    .tokens
                    .iter()
                    .enumerate()
                    .map(|(j, &t)| (t, start + j))
                    .collect()
            } else {
                vec![(last, seq.held - 1)]
            };
            entries.push(StepEntry {
                start,
                tokens: entry.tokens.len(),
                rows: rows.len(),
            });
            if sampling.get(i).copied().flatten().is_some() {
                let sampled: Vec<u32> = rows
                    .iter()
                    .map(|&(t, p)| favoured_token(t, p, vocab))
                    .collect();
                let count = if entry.all_rows {
                    accept_sampled(entry.tokens.get(1..).unwrap_or_default(), &sampled)
                        .tokens
                        .len()
                } else {
                    1
                };
                produced.push((entry.id, count as u32));
                outputs.push(EntryOutput::Tokens(sampled));
            } else {
                let mut logits = vec![0.0; rows.len() * vocab];
                for (&(t, p), row) in rows.iter().zip(logits.chunks_exact_mut(vocab.max(1))) {
                    fake_logits(t, p, row);
                }
                outputs.push(EntryOutput::Logits(logits));
            }
        }
        let work = StepWork::backbone(&self.model, &entries, std::mem::take(&mut self.draft_rows));
        let tokens = work.tokens;
        // Like a real rank, adopt the committed placement at the step's start and report the
        // step to the EPLB (its schedule counts steps) once it ran.
        let epoch = self.fabric.parallel().map(|p| p.current().epoch());
        let step = RankStep {
            work,
            produced: produced.iter().map(|(_, n)| *n as usize).sum(),
            prefill,
        };
        let end = self.fabric.step(self.dp, step)?;
        if let (Some(parallel), Some(epoch)) = (self.fabric.parallel(), epoch) {
            parallel.finish_step(StepRecord {
                dp: DpRank(self.dp as u16),
                rank_step: self.steps,
                epoch,
                served: (tokens > 0).then_some((epoch, epoch)),
                tokens,
            });
        }
        self.steps += 1;
        for (id, count) in produced {
            self.sequences.get_mut(id)?.times.push((end, count));
        }
        Ok(outputs)
    }

    /// The simulated drafter's proposal after `anchor` for sequence `id`.
    fn draft_one(&mut self, id: RequestId, anchor: u32) -> Result<Option<Draft>, ExecError> {
        let Some(law) = self.draft else {
            return Ok(None);
        };
        let held = self.sequence_len(id)?;
        let draw = |i: usize, what: u64| {
            let h = hash2(hash2(self.seed ^ what, id.0), (held + i) as u64);
            (h >> 11) as f64 / (1u64 << 53) as f64
        };
        let correct = (0..law.drafts)
            .take_while(|&i| draw(i, 1) < law.accept_rate)
            .count();
        let base = (law.accept_rate / (1.0 - law.accept_rate)).ln() as f32;
        let confidences = (0..law.drafts)
            .map(|i| {
                let jitter = draw(i, 2) as f32 - 0.5;
                base + jitter + if i < correct { 1.0 } else { -2.0 }
            })
            .collect();
        self.draft_rows += law.drafts;
        Ok(Some(Draft {
            tokens: draft_chain(anchor, held, self.model.vocab_size, correct, law.drafts),
            confidences,
        }))
    }
}

impl RankExecutor for SimulatedExecutor {
    fn vocab_size(&self) -> usize {
        self.model.vocab_size
    }

    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        self.sequences.open(id, || SimSeq {
            held: 0,
            times: Vec::new(),
        })
    }

    fn free_sequence(&mut self, id: RequestId) {
        if let Ok(seq) = self.sequences.get_mut(id) {
            let times = std::mem::take(&mut seq.times);
            if !times.is_empty() {
                self.fabric.record(id, times);
            }
        }
        self.sequences.close(id);
    }

    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError> {
        let seq = self.sequences.get_mut(id)?;
        if len > seq.held {
            return Err(ExecError::Sequence {
                id,
                message: format!(
                    "rollback to {len} tokens, but the sequence holds {}",
                    seq.held
                ),
            });
        }
        seq.held = len;
        Ok(())
    }

    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.sequences.get(id).map(|s| s.held)
    }

    fn live_sequences(&self) -> usize {
        self.sequences.live()
    }

    fn execute(
        &mut self,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        self.run(batch, sampling)
    }

    fn draft(&mut self, requests: &[(RequestId, u32)]) -> Result<Vec<Option<Draft>>, ExecError> {
        requests
            .iter()
            .map(|&(id, anchor)| self.draft_one(id, anchor))
            .collect()
    }

    /// The modelled step of `batch_tokens` tokens in verify-shaped entries at context
    /// [`PROFILE_CONTEXT`], every DP rank running the same (the DSpark profile's table).
    fn modelled_step_time(&self, batch_tokens: usize) -> Option<Duration> {
        let width = 1 + self.draft.map_or(0, |d| d.drafts);
        let entries: Vec<StepEntry> = (0..batch_tokens.div_ceil(width))
            .map(|i| StepEntry {
                start: PROFILE_CONTEXT,
                tokens: width.min(batch_tokens - i * width),
                rows: width.min(batch_tokens - i * width),
            })
            .collect();
        let work = StepWork::backbone(&self.model, &entries, 0);
        Some(Duration::from_secs_f64(
            self.fabric.uniform_step_seconds(work),
        ))
    }
}

impl Drop for SimulatedExecutor {
    /// Sequences still live when the engine stops keep no token times; the rank leaves the
    /// lockstep.
    fn drop(&mut self) {
        self.fabric.leave(self.dp);
    }
}

/// Builds the simulated devices of one deployment over one fabric.
#[derive(Debug, Clone)]
pub struct SimulatedFactory {
    pub model: Arc<ModelConfig>,
    pub fabric: Arc<VirtualFabric>,
    pub draft: Option<DraftLaw>,
    pub seed: u64,
}

impl ExecutorFactory for SimulatedFactory {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        Ok(Box::new(SimulatedExecutor {
            dp,
            model: self.model.clone(),
            fabric: self.fabric.clone(),
            draft: self.draft,
            seed: self.seed,
            sequences: Sequences::default(),
            draft_rows: 0,
            steps: 0,
        }))
    }

    fn describe(&self) -> String {
        let spec = self.fabric.spec();
        format!(
            "simulated {} x{} (virtual clock, cost model at {:.1}% of HBM / {:.2}% of tensor peak)",
            spec.device.peaks.name,
            spec.layout.gpus,
            spec.device.efficiency.bytes * 100.0,
            spec.device.efficiency.flops * 100.0
        )
    }

    fn sliding_window(&self) -> Option<usize> {
        Some(self.model.window_size)
    }

    fn expert_parallel(&self) -> Option<Arc<ExpertParallel>> {
        self.fabric.parallel().cloned()
    }
}
