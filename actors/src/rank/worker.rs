//! `RankWorker`: what the rank thread does with a plan, without the thread.
//!
//! Owns the executor, the per-sequence sampling parameters and each sequence's last sampled
//! token (the input of its next `Decode`, resolved here so the scheduler can plan a step before
//! the previous one returned). Also owns the pipeline of launched steps: a step's results become
//! visible `device_latency` after its launch, and a step launched while another is still on the
//! device has its host time counted as hidden by async scheduling.
//!
//! Sampling: unconstrained entries are sampled by the executor inside the step
//! (`RankExecutor::execute`, on its device: only the token ids come back); constrained
//! ones leave their rows on the device (`EntryOutput::DeviceLogits`) until their masks are in.
//!
//! Structured outputs: before the forward, the matchers of the constrained sequences that sample
//! in this step go to the grammar mask workers, so the masks are computed while the forward runs;
//! they are awaited right after it, and all of the step's constrained rows are sampled in one
//! `RankExecutor::sample_logits` call with their masks (bitsets up, ids down: disallowed logits
//! are -inf before the sampling noise). An executor without a device returns host logits instead;
//! those are masked and sampled here, with the same tokens. A mask that fails, does not fit the
//! rows or allows nothing ends its request with its end token, not the rank. A mask depends only
//! on the tokens accepted so far, never on timing, so seeded sampling stays deterministic.
//!
//! DSpark: the worker also owns each sequence's current proposal (drafted on this thread, where
//! the sequence state lives). A `Verify { drafts }` entry feeds the anchor plus up to `drafts` of
//! it, judges them with `dspark::accept` (lossless; the executor samples every row where the
//! logits are, `RankExecutor::execute`), rolls the sequence back past the rejected
//! drafts, and drafts the next proposal (every proposal of a step in one `draft` call after
//! the sampling); only the proposal's confidences leave the thread (in the step output).
//! Grammar-constrained sequences are never drafted for: the scheduler gives them plain `Decode`s,
//! and a `Verify` of one runs as a decode.
//!
//! DSpark's start-up profile (`dspark::profile`) runs on this executor before the first plan
//! (`profile`) and leaves it holding no sequence.
//!
//! Prefix cache: a new sequence attaches its hit's blocks right after it is created (before the
//! step's work); the plan's cache ops (stores and the drops of the blocks they evicted, in the
//! scheduler's order) run after the work and the drafting, before the finished sequences are
//! freed.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deepinfer_model::backend::LogprobPick;
use deepinfer_model::{EntryOutput, LogitsRow};
use deepinfer_topology::{DpRank, RequestId};

use crate::dspark::accept::{accept_block, accept_sampled};
use crate::dspark::profile::{ProfileError, ProfileRequest, profile_step_rates};
use crate::dspark::schedule::StepRateTable;
use crate::grammar::{GrammarError, MaskBatch, MaskJob, MaskWorkers, StepMask};
use crate::messages::rank::{
    CacheOp, DraftSummary, SeqGrammar, SeqInput, StepMode, StepOutput, StepPlan, StepTiming,
    VerifyOutcome,
};
use crate::rank::executor::{ExecError, ExecStep, RankExecutor, SeqTokens};
use crate::rank::memory::StateMemory;
use crate::sampling::{SamplingParams, TokenLogprobs, sample, token_logprobs};

/// The shortest an `Idle` step takes. On an EP deployment the collective paces idle ranks;
/// without one this keeps an idle rank from spinning while its peers work.
pub const IDLE_STEP_MIN_INTERVAL: Duration = Duration::from_micros(500);

/// Mask threads a rank starts when its first constrained sequence arrives.
pub fn default_mask_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

struct SeqSampling {
    params: SamplingParams,
    last_token: Option<u32>,
    grammar: Option<SeqGrammar>,
    /// The current DSpark proposal: the anchor it continues and the drafted tokens.
    proposal: Option<(u32, Vec<u32>)>,
    /// Draft a first proposal after the prompt's last chunk (`NewSeq::speculative`).
    speculative: bool,
    /// Report each sampled token's log-probabilities with this many alternatives.
    logprobs: Option<usize>,
}

impl SeqSampling {
    /// The drafts that continue the current last token (none if the proposal is for another).
    fn drafts_for_anchor(&self, anchor: u32) -> &[u32] {
        match &self.proposal {
            Some((from, drafts)) if *from == anchor && self.grammar.is_none() => drafts,
            _ => &[],
        }
    }
}

/// How one entry of the plan feeds the model.
struct EntryInput {
    tokens: Vec<u32>,
    /// `Some(n)`: a verify of the anchor plus `n` drafts.
    verify: Option<usize>,
}

/// The mask of one constrained sequence for this step, or why it has none and the token that
/// ends its request.
type MaskResult = Result<StepMask, (GrammarError, u32)>;

/// The backend error unless the executor answered `got` items for `want` inputs, one each:
/// "the executor {verb} {got} {items} for {want} {inputs}" (`[verb, items, inputs]`).
fn one_each(got: usize, want: usize, [verb, items, inputs]: [&str; 3]) -> Result<(), ExecError> {
    if got == want {
        return Ok(());
    }
    Err(ExecError::Backend(format!(
        "the executor {verb} {got} {items} for {want} {inputs}"
    )))
}

/// Masks requested before a forward: the batch in flight and the EOS each request ends with
/// should its grammar fail.
struct PendingMasks {
    batch: MaskBatch<RequestId>,
    end_tokens: HashMap<RequestId, u32>,
}
/// Does this input sample a token?
fn produces_token(input: &SeqInput) -> bool {
    matches!(
        input,
        SeqInput::Decode | SeqInput::Verify { .. } | SeqInput::Prefill { last: true, .. }
    )
}

/// The host path of a constrained row (executors without a device): checks the mask against
/// rows of `vocab` logits (one that allows nothing fails the request), applies it to the row
/// (before the sampling noise), samples at `position`, and advances the grammar.
fn sample_constrained(
    grammar: &mut SeqGrammar,
    mask: &StepMask,
    row: &mut [f32],
    (params, position): (&SamplingParams, u64),
    vocab: usize,
) -> Result<Option<u32>, GrammarError> {
    mask.allowed_tokens(vocab, grammar.matcher.answer_tokens())?;
    mask.apply_to_logits(row)?;
    let Some(token) = sample(row, params, position) else {
        return Ok(None);
    };
    grammar.matcher.advance(token)?;
    Ok(Some(token))
}

/// [`token_logprobs`] of a sampled row read on the host (masked already); a row it cannot
/// read fails the step naming why.
fn logprobs_of(row: &[f32], token: u32, top: usize) -> Result<TokenLogprobs, ExecError> {
    token_logprobs(row, None, token, top)
        .map_err(|e| ExecError::Backend(format!("log-probabilities of token {token}: {e}")))
}

/// The outcome of a row sampled after its step: the token (the grammar advanced past it), or
/// why the request's structured output failed and the token that ends it.
type DeferredToken = Result<u32, (GrammarError, u32)>;

/// A step whose results are computed but not yet released.
struct Launched {
    output: StepOutput,
    launched_at: Instant,
    ready_at: Instant,
}

/// The rank's step logic.
pub struct RankWorker {
    dp: DpRank,
    executor: Box<dyn RankExecutor>,
    sequences: HashMap<RequestId, SeqSampling>,
    launched: VecDeque<Launched>,
    /// Started with the first constrained sequence unless given.
    mask_workers: Option<Arc<MaskWorkers>>,
}

impl RankWorker {
    pub fn new(dp: DpRank, executor: Box<dyn RankExecutor>) -> Self {
        RankWorker {
            dp,
            executor,
            sequences: HashMap::new(),
            launched: VecDeque::new(),
            mask_workers: None,
        }
    }

    /// A worker that computes grammar masks on `mask_workers` (shared with other ranks, or
    /// observed by a test).
    pub fn with_mask_workers(
        dp: DpRank,
        executor: Box<dyn RankExecutor>,
        mask_workers: Arc<MaskWorkers>,
    ) -> Self {
        RankWorker {
            mask_workers: Some(mask_workers),
            ..RankWorker::new(dp, executor)
        }
    }

    /// Hands the matchers of the constrained sequences that sample in this step to the mask
    /// workers; they come back with their masks in [`RankWorker::finish_masks`].
    fn start_masks(&mut self, plan: &StepPlan) -> Result<Option<PendingMasks>, ExecError> {
        let mut jobs = Vec::new();
        let mut end_tokens = HashMap::new();
        for work in plan.work.iter().filter(|w| produces_token(&w.input)) {
            let seq = self
                .sequences
                .get_mut(&work.id)
                .ok_or(ExecError::UnknownSequence(work.id))?;
            if let Some(SeqGrammar { matcher, end_token }) = seq.grammar.take() {
                end_tokens.insert(work.id, end_token);
                jobs.push(MaskJob {
                    key: work.id,
                    matcher,
                    draft: Vec::new(),
                });
            }
        }
        if jobs.is_empty() {
            return Ok(None);
        }
        let workers = match &self.mask_workers {
            Some(workers) => workers,
            None => {
                let started = MaskWorkers::new(default_mask_threads())
                    .map_err(|e| ExecError::Backend(format!("grammar mask workers: {e}")))?;
                self.mask_workers.insert(Arc::new(started))
            }
        };
        Ok(Some(PendingMasks {
            batch: workers.compute(jobs),
            end_tokens,
        }))
    }

    /// Waits for the masks, gives each sequence its matcher back and returns the masks. A
    /// sequence whose mask failed keeps no grammar (its request ends with its end token).
    fn finish_masks(&mut self, pending: Option<PendingMasks>) -> HashMap<RequestId, MaskResult> {
        let mut masks = HashMap::new();
        let Some(PendingMasks {
            batch,
            mut end_tokens,
        }) = pending
        else {
            return masks;
        };
        match batch.wait() {
            Ok(outcomes) => {
                for outcome in outcomes {
                    let id = outcome.key;
                    let (Some(end_token), Some(seq)) =
                        (end_tokens.remove(&id), self.sequences.get_mut(&id))
                    else {
                        continue;
                    };
                    let mask = outcome
                        .masks
                        .and_then(|mut masks| {
                            masks.pop().ok_or(GrammarError::Matcher(
                                "the mask workers returned no mask".into(),
                            ))
                        })
                        .map_err(|error| (error, end_token));
                    if mask.is_ok() {
                        seq.grammar = Some(SeqGrammar {
                            matcher: outcome.matcher,
                            end_token,
                        });
                    }
                    masks.insert(id, mask);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "grammar mask workers failed");
                for (id, end_token) in end_tokens {
                    masks.insert(id, Err((GrammarError::WorkerLost, end_token)));
                }
            }
        }
        masks
    }

    /// Runs a plan on the executor and samples; the output is not timed yet.
    pub fn run_plan(&mut self, plan: &StepPlan) -> Result<StepOutput, ExecError> {
        for new in &plan.new_seqs {
            self.executor.new_sequence(new.id)?;
            if let Some(from) = new.decoder_from {
                self.executor.plan_replay(new.id, from as usize)?;
            }
            if let Some(prefix) = &new.prefix {
                self.executor
                    .attach_prefix(new.id, &prefix.blocks, prefix.replay_from)?;
            }
            self.sequences.insert(
                new.id,
                SeqSampling {
                    params: new.sampling,
                    last_token: None,
                    grammar: new.grammar.as_deref().cloned(),
                    proposal: None,
                    speculative: new.speculative,
                    logprobs: new.logprobs,
                },
            );
        }
        // The stores after the work take what the work computes: the executor keeps it.
        for op in &plan.cache_ops {
            if let CacheOp::Store { id, start, .. } = *op {
                self.executor.prepare_prefix_store(id, start)?;
            }
        }
        let inputs = plan
            .work
            .iter()
            .map(|work| self.entry_input(work.id, &work.input))
            .collect::<Result<Vec<_>, _>>()?;
        // Tokens each verified sequence held before the step (where its anchor goes).
        let held_before = plan
            .work
            .iter()
            .zip(&inputs)
            .filter(|(_, input)| input.verify.is_some())
            .map(|(work, _)| Ok((work.id, self.executor.sequence_len(work.id)?)))
            .collect::<Result<HashMap<_, _>, ExecError>>()?;
        let batch: Vec<SeqTokens<'_>> = plan
            .work
            .iter()
            .zip(&inputs)
            .map(|(work, input)| SeqTokens {
                id: work.id,
                tokens: &input.tokens,
                all_rows: input.verify.is_some(),
            })
            .collect();
        // Unconstrained entries that produce tokens are sampled by the executor (on its device);
        // constrained ones, and those that report log-probabilities, leave their rows where
        // they were computed, to be sampled with their masks (or, from an executor without a
        // device, get their logits here).
        let sampling: Vec<Option<SamplingParams>> = plan
            .work
            .iter()
            .map(|work| {
                let seq = self.sequences.get(&work.id)?;
                let on_executor = seq.grammar.is_none() && seq.logprobs.is_none();
                (produces_token(&work.input) && on_executor).then_some(seq.params)
            })
            .collect();
        // Masks are computed while the forward runs and awaited right after it.
        let pending = self.start_masks(plan)?;
        let outputs = self.executor.execute(ExecStep {
            batch: &batch,
            sampling: &sampling,
        });
        let mut masks = self.finish_masks(pending);
        let outputs = outputs?;
        one_each(
            outputs.len(),
            plan.work.len(),
            ["returned", "outputs", "sequences"],
        )?;
        let mut deferred_logprobs = HashMap::new();
        let mut deferred =
            self.sample_deferred(plan, &inputs, &outputs, &mut masks, &mut deferred_logprobs)?;
        let mut sampled = Vec::new();
        let mut logprobs = Vec::new();
        let mut verified = Vec::new();
        // Sequences to draft for after this step, in work order (drafted together below).
        let mut to_draft = Vec::new();
        for ((work, input), output) in plan.work.iter().zip(&inputs).zip(outputs) {
            if !produces_token(&work.input) {
                continue;
            }
            if let (Some(_), Some(&held)) = (input.verify, held_before.get(&work.id)) {
                let verified_drafts = input.tokens.get(1..).unwrap_or_default();
                let (outcome, tokens) =
                    self.verify_entry(work.id, verified_drafts, &output, held)?;
                verified.push(outcome);
                // Row `i` of the verify is the target model's row the `i`-th token came from.
                let top = self.sequences.get(&work.id).and_then(|seq| seq.logprobs);
                let rows: Option<&[f32]> = match &output {
                    EntryOutput::Logits(rows) => Some(rows),
                    EntryOutput::DeviceLogits(rows) => Some(rows),
                    EntryOutput::Tokens(_) => None,
                };
                if let (Some(top), Some(rows)) = (top, rows) {
                    let vocab = self.executor.vocab_size().max(1);
                    for (row, &token) in rows.chunks_exact(vocab).zip(&tokens) {
                        logprobs.push((work.id, logprobs_of(row, token, top)?));
                    }
                }
                sampled.extend(tokens.into_iter().map(|token| (work.id, token)));
                to_draft.push(work.id);
                continue;
            }
            // The sampled token's absolute position = tokens the sequence holds now.
            let position = self.executor.sequence_len(work.id)? as u64;
            let seq = self
                .sequences
                .get_mut(&work.id)
                .ok_or(ExecError::UnknownSequence(work.id))?;
            let vocab = self.executor.vocab_size();
            let outcome: Result<Option<u32>, (GrammarError, u32)> = match output {
                EntryOutput::Tokens(tokens) => Ok(tokens.last().copied()),
                EntryOutput::DeviceLogits(_) => {
                    let outcome = deferred.remove(&work.id).transpose();
                    // A grammar that failed ends the request with another token: none reported.
                    let lp = deferred_logprobs.remove(&work.id);
                    if let (Some(lp), Ok(Some(token))) = (lp, &outcome)
                        && lp.token == *token
                    {
                        logprobs.push((work.id, lp));
                    }
                    outcome
                }
                EntryOutput::Logits(mut row) => {
                    let outcome = match (masks.remove(&work.id), seq.grammar.as_mut()) {
                        (Some(Ok(mask)), Some(grammar)) => sample_constrained(
                            grammar,
                            &mask,
                            &mut row,
                            (&seq.params, position),
                            vocab,
                        )
                        .map_err(|error| (error, grammar.end_token)),
                        (Some(Err(failure)), _) => Err(failure),
                        _ => Ok(sample(&row, &seq.params, position)),
                    };
                    // The row is masked in place: its distribution is the one sampled from.
                    if let (Some(top), Ok(Some(token))) = (seq.logprobs, &outcome) {
                        logprobs.push((work.id, logprobs_of(&row, *token, top)?));
                    }
                    outcome
                }
            };
            let picked = match outcome {
                Ok(token) => token,
                Err((error, end)) => {
                    // The request's grammar failed: end this request, not the rank.
                    tracing::warn!(id = %work.id, %error, "structured output failed; ending the request");
                    seq.grammar = None;
                    Some(end)
                }
            };
            let token = picked
                .ok_or_else(|| ExecError::Backend(format!("empty logits row for {}", work.id)))?;
            seq.last_token = Some(token);
            seq.proposal = None;
            let draft_now = seq.speculative && matches!(work.input, SeqInput::Prefill { .. });
            sampled.push((work.id, token));
            if draft_now {
                to_draft.push(work.id);
            }
        }
        let drafts = self.propose(&to_draft)?;
        for op in &plan.cache_ops {
            match *op {
                CacheOp::Store { id, hash, start } => {
                    self.executor.store_prefix_block(id, hash, start)?
                }
                CacheOp::Drop(hash) => self.executor.drop_prefix_block(hash),
            }
        }
        for id in &plan.finished {
            self.executor.free_sequence(*id);
            self.sequences.remove(id);
        }
        Ok(StepOutput {
            step: plan.step,
            dp: self.dp,
            mode: plan.mode,
            sampled,
            logprobs,
            verified,
            drafts,
            live_sequences: self.executor.live_sequences(),
            timing: StepTiming::default(),
        })
    }

    /// Samples every token-producing (non-verify) entry whose rows the executor left on its
    /// device, all in one [`RankExecutor::sample_logits`] call, each with its mask (converted to
    /// the model's bitset; it goes up, only the ids come down), and advances their grammars. A
    /// request whose mask failed, does not fit the rows or allows nothing gets its failure (its
    /// request ends) and takes no part in the call. The sequences that report log-probabilities
    /// get them in `logprobs`, from the row (read on the host) under its mask.
    fn sample_deferred(
        &mut self,
        plan: &StepPlan,
        inputs: &[EntryInput],
        outputs: &[EntryOutput],
        masks: &mut HashMap<RequestId, MaskResult>,
        logprobs: &mut HashMap<RequestId, TokenLogprobs>,
    ) -> Result<HashMap<RequestId, DeferredToken>, ExecError> {
        let vocab = self.executor.vocab_size();
        let mut results = HashMap::new();
        // (request, its last row, parameters, position, mask) of each row to sample.
        let mut rows = Vec::new();
        for ((work, input), output) in plan.work.iter().zip(inputs).zip(outputs) {
            let EntryOutput::DeviceLogits(logits) = output else {
                continue;
            };
            if !produces_token(&work.input) || input.verify.is_some() {
                continue;
            }
            let seq = self
                .sequences
                .get(&work.id)
                .ok_or(ExecError::UnknownSequence(work.id))?;
            let allowed = match (masks.remove(&work.id), seq.grammar.as_ref()) {
                (Some(Ok(mask)), Some(grammar)) => {
                    match mask.allowed_tokens(vocab, grammar.matcher.answer_tokens()) {
                        Ok(allowed) => allowed,
                        Err(error) => {
                            results.insert(work.id, Err((error, grammar.end_token)));
                            continue;
                        }
                    }
                }
                (Some(Err(failure)), _) => {
                    results.insert(work.id, Err(failure));
                    continue;
                }
                _ => None,
            };
            let held = logits.len() / vocab.max(1);
            if held == 0 {
                return Err(ExecError::Backend(format!(
                    "empty logits row for {}",
                    work.id
                )));
            }
            let last = logits.rows(held - 1..held, vocab);
            // The sampled token's absolute position = tokens the sequence holds now.
            let position = self.executor.sequence_len(work.id)? as u64;
            rows.push((work.id, last, seq.params, position, allowed));
        }
        if rows.is_empty() {
            return Ok(results);
        }
        let requests: Vec<LogitsRow<'_>> = rows
            .iter()
            .map(|(_, logits, params, position, allowed)| LogitsRow {
                logits,
                params: *params,
                position: *position,
                allowed: allowed.as_ref(),
            })
            .collect();
        let tokens = self.executor.sample_logits(&requests)?;
        one_each(tokens.len(), rows.len(), ["sampled", "tokens", "rows"])?;
        // The rows of the sequences that report log-probabilities, in one executor call.
        let mut asked = Vec::new();
        let mut asked_rows = Vec::new();
        let mut picks = Vec::new();
        for ((request, (id, ..)), &token) in requests.iter().zip(&rows).zip(&tokens) {
            if let Some(top) = self.sequences.get(id).and_then(|seq| seq.logprobs) {
                asked.push(*id);
                asked_rows.push(*request);
                picks.push(LogprobPick { token, top });
            }
        }
        if !asked.is_empty() {
            let found = self.executor.logprobs_logits(&asked_rows, &picks)?;
            one_each(
                found.len(),
                asked.len(),
                ["gave", "log-probabilities", "rows"],
            )?;
            logprobs.extend(asked.into_iter().zip(found));
        }
        for ((id, ..), token) in rows.iter().zip(tokens) {
            let seq = self
                .sequences
                .get_mut(id)
                .ok_or(ExecError::UnknownSequence(*id))?;
            let result = match seq.grammar.as_mut() {
                Some(grammar) => grammar
                    .matcher
                    .advance(token)
                    .map(|()| token)
                    .map_err(|error| (error, grammar.end_token)),
                None => Ok(token),
            };
            results.insert(*id, result);
        }
        Ok(results)
    }

    /// The tokens an entry feeds: a prefill chunk, the last sampled token, or for a verify the
    /// last sampled token followed by up to `drafts` tokens of the sequence's proposal.
    fn entry_input(&self, id: RequestId, input: &SeqInput) -> Result<EntryInput, ExecError> {
        let (max_drafts, verify) = match input {
            SeqInput::Prefill { tokens, .. } => {
                return Ok(EntryInput {
                    tokens: tokens.clone(),
                    verify: None,
                });
            }
            SeqInput::Decode => (0, false),
            SeqInput::Verify { drafts } => (*drafts, true),
        };
        let seq = self
            .sequences
            .get(&id)
            .ok_or(ExecError::UnknownSequence(id))?;
        let anchor = seq.last_token.ok_or_else(|| ExecError::Sequence {
            id,
            message: "decode scheduled before the sequence's first token".into(),
        })?;
        // A constrained sequence's verify runs as a plain decode (its rows are masked).
        if !verify || seq.grammar.is_some() {
            return Ok(EntryInput {
                tokens: vec![anchor],
                verify: None,
            });
        }
        let drafts = seq.drafts_for_anchor(anchor);
        let used = &drafts[..drafts.len().min(max_drafts)];
        let mut tokens = Vec::with_capacity(1 + used.len());
        tokens.push(anchor);
        tokens.extend_from_slice(used);
        Ok(EntryInput {
            tokens,
            verify: Some(used.len()),
        })
    }

    /// Judges a verify entry's drafts against its rows, rolls the sequence back past the
    /// rejected ones and records the produced tokens (accepted drafts + bonus) on the sequence.
    fn verify_entry(
        &mut self,
        id: RequestId,
        drafts: &[u32],
        output: &EntryOutput,
        held_before: usize,
    ) -> Result<(VerifyOutcome, Vec<u32>), ExecError> {
        let vocab = self.executor.vocab_size();
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or(ExecError::UnknownSequence(id))?;
        let block = match output {
            // Every row sampled by the executor at its position.
            EntryOutput::Tokens(tokens) => accept_sampled(drafts, tokens),
            // Row 0 predicts the token after the anchor, which sits at `held_before`.
            EntryOutput::Logits(rows) => {
                accept_block(rows, vocab, drafts, &seq.params, held_before as u64 + 1)
                    .map_err(|e| ExecError::Backend(format!("{id}: {e}")))?
            }
            // Unsampled rows left on the device (an executor that did not sample the verify):
            // read on the host and judged as above.
            EntryOutput::DeviceLogits(rows) => {
                accept_block(rows, vocab, drafts, &seq.params, held_before as u64 + 1)
                    .map_err(|e| ExecError::Backend(format!("{id}: {e}")))?
            }
        };
        let keep = held_before + 1 + block.accepted;
        if block.accepted < drafts.len() {
            self.executor.rollback(id, keep)?;
        }
        let last = *block
            .tokens
            .last()
            .ok_or_else(|| ExecError::Backend(format!("{id}: a verify produced no token")))?;
        seq.last_token = Some(last);
        seq.proposal = None;
        let outcome = VerifyOutcome {
            id,
            verified: drafts.len(),
            accepted: block.accepted,
        };
        Ok((outcome, block.tokens))
    }

    /// Drafts the next proposal of each of `ids` after its last token, all in one
    /// `draft` call, if the executor has a drafter; returns the summaries in `ids` order.
    fn propose(&mut self, ids: &[RequestId]) -> Result<Vec<DraftSummary>, ExecError> {
        let requests: Vec<(RequestId, u32)> = ids
            .iter()
            .filter_map(|&id| Some((id, self.sequences.get(&id)?.last_token?)))
            .collect();
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let drafts = self.executor.draft(&requests)?;
        one_each(
            drafts.len(),
            requests.len(),
            ["returned", "drafts", "sequences"],
        )?;
        let mut summaries = Vec::new();
        for ((id, anchor), draft) in requests.into_iter().zip(drafts) {
            let Some(draft) = draft else {
                continue;
            };
            if let Some(seq) = self.sequences.get_mut(&id) {
                seq.proposal = Some((anchor, draft.tokens));
            }
            summaries.push(DraftSummary {
                id,
                confidences: draft.confidences,
            });
        }
        Ok(summaries)
    }

    /// Measures DSpark's steps-per-second table on the executor; runs before the first plan.
    pub fn profile(&mut self, request: &ProfileRequest) -> Result<StepRateTable, ProfileError> {
        profile_step_rates(self.executor.as_mut(), request)
    }

    /// Where the executor's states live, read now (`RankExecutor::state_memory`).
    pub fn state_memory(&mut self) -> Result<StateMemory, ExecError> {
        self.executor.state_memory()
    }

    /// Launches a plan: runs it now (host work) and schedules its results for when the
    /// emulated device is done.
    pub fn launch(&mut self, plan: &StepPlan) -> Result<(), ExecError> {
        let start = Instant::now();
        let device_busy_until = self.launched.back().map(|l| l.ready_at);
        let mut output = self.run_plan(plan)?;
        let end = Instant::now();
        let host = end - start;
        // Host time overlapped with an earlier step still on the device.
        let hidden_host = match device_busy_until {
            Some(busy) if busy > start => host.min(busy - start),
            _ => Duration::ZERO,
        };
        let device_start = device_busy_until.map_or(end, |busy| busy.max(end));
        let mut ready_at = device_start + self.executor.device_latency(plan.token_count());
        if plan.mode == StepMode::Idle {
            ready_at = ready_at.max(start + IDLE_STEP_MIN_INTERVAL);
        }
        output.timing = StepTiming {
            host,
            hidden_host,
            total: Duration::ZERO,
        };
        self.launched.push_back(Launched {
            output,
            launched_at: start,
            ready_at,
        });
        Ok(())
    }

    /// When the oldest launched step's results become available.
    pub fn next_ready_at(&self) -> Option<Instant> {
        self.launched.front().map(|l| l.ready_at)
    }

    /// Runs the idle steps expert-parallel peers wait for (`RankExecutor::follow_peers`);
    /// returns how soon to look again while idle.
    pub fn follow_peers(&mut self) -> Result<Option<Duration>, ExecError> {
        self.executor.follow_peers()
    }

    /// Steps launched and not yet collected.
    pub fn launched_count(&self) -> usize {
        self.launched.len()
    }

    /// Takes the oldest step if its results are available at `now`.
    pub fn collect_ready(&mut self, now: Instant) -> Option<StepOutput> {
        if self.launched.front()?.ready_at > now {
            return None;
        }
        let done = self.launched.pop_front()?;
        let mut output = done.output;
        output.timing.total = done.ready_at.max(now) - done.launched_at;
        Some(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::rank::{NewSeq, SeqWork};
    use crate::rank::executor::{ExecutorLayer, Layered};
    use crate::rank::fake::{FakeConfig, FakeExecutor, favoured_token};
    use deepinfer_topology::StepId;

    fn worker(config: FakeConfig) -> RankWorker {
        RankWorker::new(DpRank(0), Box::new(FakeExecutor::new(config, 0)))
    }

    /// A worker over the fake backend of `vocab` tokens whose drafter proposes blocks of 5, the
    /// first `correct` of them right, at confidence 4.
    fn drafting_worker(vocab: usize, correct: usize) -> RankWorker {
        worker(FakeConfig {
            vocab_size: vocab,
            drafter: Some(crate::rank::fake::FakeDrafter {
                block_size: 5,
                correct,
                confidence: 4.0,
            }),
            ..FakeConfig::default()
        })
    }

    fn plan(step: u64, new: &[u64], work: Vec<(u64, SeqInput)>, finished: &[u64]) -> StepPlan {
        StepPlan {
            step: StepId(step),
            mode: StepMode::Mixed,
            new_seqs: new
                .iter()
                .map(|&id| NewSeq {
                    id: RequestId(id),
                    sampling: SamplingParams::greedy(),
                    grammar: None,
                    decoder_from: None,
                    speculative: false,
                    logprobs: None,
                    prefix: None,
                })
                .collect(),
            work: work
                .into_iter()
                .map(|(id, input)| SeqWork {
                    id: RequestId(id),
                    input,
                })
                .collect(),
            cache_ops: Vec::new(),
            finished: finished.iter().map(|&id| RequestId(id)).collect(),
        }
    }

    /// The work of sequence `id` feeding the prefill chunk `tokens` (its prompt's `last`).
    fn prefill(id: u64, tokens: &[u32], last: bool) -> (u64, SeqInput) {
        let tokens = tokens.to_vec();
        (id, SeqInput::Prefill { tokens, last })
    }

    #[test]
    fn chunked_prefill_then_decode_follows_the_greedy_chain() {
        let vocab = FakeConfig::default().vocab_size;
        let mut w = worker(FakeConfig::default());
        let p1 = plan(0, &[1], vec![prefill(1, &[7, 8], false)], &[]);
        assert!(w.run_plan(&p1).unwrap().sampled.is_empty());
        let p2 = plan(1, &[], vec![prefill(1, &[9], true)], &[]);
        let first = w.run_plan(&p2).unwrap().sampled;
        // The last prompt token 9 sits at position 2.
        assert_eq!(first, vec![(RequestId(1), favoured_token(9, 2, vocab))]);
        let p3 = plan(2, &[], vec![(1, SeqInput::Decode)], &[1]);
        let out = w.run_plan(&p3).unwrap();
        assert_eq!(
            out.sampled,
            vec![(RequestId(1), favoured_token(first[0].1, 3, vocab))]
        );
        assert_eq!(out.live_sequences, 0);
    }

    #[test]
    fn decode_before_first_token_is_an_error() {
        let mut w = worker(FakeConfig::default());
        let p = plan(0, &[1], vec![(1, SeqInput::Decode)], &[]);
        assert!(matches!(w.run_plan(&p), Err(ExecError::Sequence { .. })));
    }

    #[test]
    fn second_launch_waits_for_the_device_and_counts_hidden_host_time() {
        let mut w = worker(FakeConfig {
            host_time: Duration::from_millis(5),
            device_time: Duration::from_millis(30),
            ..FakeConfig::default()
        });
        let p0 = plan(0, &[1], vec![prefill(1, &[1], true)], &[]);
        let p1 = plan(1, &[], vec![(1, SeqInput::Decode)], &[]);
        w.launch(&p0).unwrap();
        w.launch(&p1).unwrap();
        let first_ready = w.next_ready_at().unwrap();
        assert!(
            w.collect_ready(Instant::now()).is_none(),
            "results before the device finished"
        );
        let out0 = w.collect_ready(first_ready).unwrap();
        assert_eq!(out0.timing.hidden_host, Duration::ZERO);
        let second_ready = w.next_ready_at().unwrap();
        // The device runs one step at a time: the second finishes a full device time later.
        assert!(second_ready - first_ready >= Duration::from_millis(30));
        let out1 = w.collect_ready(second_ready).unwrap();
        assert!(
            out1.timing.hidden_host >= Duration::from_millis(4),
            "{:?}",
            out1.timing
        );
    }

    #[test]
    fn verify_accepts_the_matching_prefix_rolls_back_and_drafts_again() {
        let vocab = 64;
        let mut w = drafting_worker(vocab, 2);
        let prefill = plan(0, &[1], vec![prefill(1, &[3, 4], true)], &[]);
        let first = w.run_plan(&prefill).unwrap().sampled[0].1;
        assert_eq!(first, favoured_token(4, 1, vocab));
        // No proposal yet: the verify is a plain decode, and it drafts.
        let p1 = plan(1, &[], vec![(1, SeqInput::Verify { drafts: 5 })], &[]);
        let out1 = w.run_plan(&p1).unwrap();
        let second = favoured_token(first, 2, vocab);
        assert_eq!(out1.sampled, vec![(RequestId(1), second)]);
        assert_eq!(out1.verified[0].verified, 0);
        assert_eq!(out1.drafts[0].confidences, vec![4.0; 5]);
        // Anchor `second` at position 3 plus 4 drafts: 2 match the chain, then the bonus.
        let p2 = plan(2, &[], vec![(1, SeqInput::Verify { drafts: 4 })], &[]);
        let out2 = w.run_plan(&p2).unwrap();
        let mut chain = vec![favoured_token(second, 3, vocab)];
        for position in 4..6 {
            chain.push(favoured_token(chain[chain.len() - 1], position, vocab));
        }
        let tokens: Vec<u32> = out2.sampled.iter().map(|s| s.1).collect();
        assert_eq!(tokens, chain);
        assert_eq!(
            out2.verified,
            vec![VerifyOutcome {
                id: RequestId(1),
                verified: 4,
                accepted: 2
            }]
        );
        // The sequence holds prompt (2) + first + second + 2 accepted drafts; the rejected two
        // were rolled back. The next decode continues the chain from there.
        assert_eq!(w.executor.sequence_len(RequestId(1)), Ok(6));
        let p3 = plan(3, &[], vec![(1, SeqInput::Decode)], &[]);
        let out3 = w.run_plan(&p3).unwrap();
        assert_eq!(
            out3.sampled,
            vec![(RequestId(1), favoured_token(chain[2], 6, vocab))]
        );
        assert!(out3.drafts.is_empty(), "a plain decode does not draft");
    }

    #[test]
    fn a_speculative_sequence_drafts_after_its_prompt() {
        let vocab = 64;
        let mut w = drafting_worker(vocab, 5);
        let mut prefill = plan(
            0,
            &[1, 2],
            vec![prefill(1, &[3, 4], true), prefill(2, &[3, 4], true)],
            &[],
        );
        prefill.new_seqs[0].speculative = true;
        let out = w.run_plan(&prefill).unwrap();
        let ids: Vec<RequestId> = out.drafts.iter().map(|d| d.id).collect();
        assert_eq!(
            ids,
            vec![RequestId(1)],
            "only the speculative sequence drafts"
        );
        // The first decode step already verifies (and here accepts) the prompt's proposal.
        let verify = plan(1, &[], vec![(1, SeqInput::Verify { drafts: 5 })], &[]);
        let out = w.run_plan(&verify).unwrap();
        assert_eq!(out.verified[0].verified, 5);
        assert_eq!(out.verified[0].accepted, 5);
        assert_eq!(out.sampled.len(), 6);
    }

    /// Runs prompt `[3, 4]` then `steps` verifies (drafting when `speculative`) on a fake
    /// whose drafter gets 2 of 5 drafts right, sampling at temperature 0.9 with `logprobs`.
    fn logprobs_run(
        speculative: bool,
        logprobs: Option<usize>,
        steps: u64,
    ) -> (Vec<u32>, Vec<TokenLogprobs>) {
        let mut w = drafting_worker(64, 2);
        let mut first = plan(0, &[1], vec![prefill(1, &[3, 4], true)], &[]);
        first.new_seqs[0].speculative = speculative;
        first.new_seqs[0].logprobs = logprobs;
        first.new_seqs[0].sampling = SamplingParams {
            temperature: 0.9,
            top_k: 0,
            top_p: 1.0,
            seed: 11,
        };
        let mut outputs = vec![w.run_plan(&first).unwrap()];
        for step in 1..=steps {
            let input = if speculative {
                SeqInput::Verify { drafts: 5 }
            } else {
                SeqInput::Decode
            };
            outputs.push(w.run_plan(&plan(step, &[], vec![(1, input)], &[])).unwrap());
        }
        let tokens = outputs
            .iter()
            .flat_map(|o| o.sampled.iter().map(|s| s.1))
            .collect();
        let logprobs = outputs
            .into_iter()
            .flat_map(|o| o.logprobs.into_iter().map(|(_, lp)| lp))
            .collect();
        (tokens, logprobs)
    }

    #[test]
    fn logprobs_are_the_sampled_rows_log_softmax_and_change_no_token_speculative_or_not() {
        use crate::rank::fake::fake_logits;
        let (spec_tokens, spec_logprobs) = logprobs_run(true, Some(3), 4);
        let (plain_tokens, none) = logprobs_run(true, None, 4);
        assert_eq!(
            spec_tokens, plain_tokens,
            "asking for logprobs changed the tokens"
        );
        assert!(none.is_empty(), "logprobs reported unasked");
        assert_eq!(spec_logprobs.len(), spec_tokens.len());
        assert!(
            spec_tokens.len() > 6,
            "the drafts were never accepted: {spec_tokens:?}"
        );
        // The same tokens without speculation, with the very same log-probabilities.
        let steps = spec_tokens.len() as u64 - 1;
        let (decoded, decoded_logprobs) = logprobs_run(false, Some(3), steps);
        assert_eq!(decoded, spec_tokens);
        assert_eq!(decoded_logprobs, spec_logprobs);
        // Independently: the log-softmax (f64, libm) of the fake's row each token came from.
        let mut previous = (4u32, 1usize);
        for (lp, &token) in spec_logprobs.iter().zip(&spec_tokens) {
            let mut row = vec![0.0f32; 64];
            fake_logits(previous.0, previous.1, &mut row);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let total: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            let expected = |t: u32| row[t as usize] as f64 - max - total.ln();
            assert_eq!(lp.token, token);
            assert!((lp.logprob as f64 - expected(token)).abs() < 1e-5, "{lp:?}");
            assert_eq!(lp.top.len(), 3);
            let mut best: Vec<u32> = (0..64).collect();
            best.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            for (&(t, l), &want) in lp.top.iter().zip(&best) {
                assert_eq!(t, want);
                assert!((l as f64 - expected(t)).abs() < 1e-5);
            }
            previous = (token, previous.1 + 1);
        }
    }

    /// What [`Recording`] saw.
    #[derive(Default)]
    struct Log {
        /// Request count of every `draft` call.
        draft_calls: Vec<usize>,
        /// The sampling asked of every `execute` call.
        asked: Vec<Vec<Option<SamplingParams>>>,
    }

    /// A layer that records the draft and sampling calls; with `device_token` it samples on "its
    /// device": every sampled row gives that token, whatever the logits.
    struct Recording {
        log: Arc<std::sync::Mutex<Log>>,
        device_token: Option<u32>,
    }

    impl Recording {
        fn record(&self, what: impl FnOnce(&mut Log)) {
            if let Ok(mut log) = self.log.lock() {
                what(&mut log);
            }
        }

        /// A fake executor with this layer over it.
        fn over(self, inner: FakeExecutor) -> Box<dyn RankExecutor> {
            Box::new(Layered::new(Box::new(inner), self))
        }
    }

    impl ExecutorLayer for Recording {
        fn execute(
            &mut self,
            inner: &mut dyn RankExecutor,
            ExecStep { batch, sampling }: ExecStep<'_>,
        ) -> Result<Vec<EntryOutput>, ExecError> {
            self.record(|log| log.asked.push(sampling.to_vec()));
            let Some(token) = self.device_token else {
                return inner.execute(ExecStep { batch, sampling });
            };
            Ok(inner
                .execute(ExecStep {
                    batch,
                    sampling: &[],
                })?
                .into_iter()
                .zip(sampling.iter().chain(std::iter::repeat(&None)))
                .map(|(row, s)| match s {
                    Some(_) => EntryOutput::Tokens(vec![token]),
                    None => row,
                })
                .collect())
        }
        fn draft(
            &mut self,
            inner: &mut dyn RankExecutor,
            requests: &[(RequestId, u32)],
        ) -> Result<Vec<Option<crate::rank::executor::Draft>>, ExecError> {
            self.record(|log| log.draft_calls.push(requests.len()));
            inner.draft(requests)
        }
    }

    #[test]
    fn a_step_drafts_all_its_proposals_in_one_call() {
        use crate::rank::fake::FakeDrafter;
        let log = Arc::new(std::sync::Mutex::new(Log::default()));
        let recording = Recording {
            log: log.clone(),
            device_token: None,
        };
        let executor = recording.over(FakeExecutor::new(
            FakeConfig {
                vocab_size: 64,
                drafter: Some(FakeDrafter {
                    block_size: 4,
                    correct: 2,
                    confidence: 3.0,
                }),
                ..FakeConfig::default()
            },
            0,
        ));
        let mut w = RankWorker::new(DpRank(0), executor);
        let prompt = |id: u64| prefill(id, &[3, id as u32], true);
        let mut p0 = plan(
            0,
            &[1, 2, 3, 4],
            vec![prompt(1), prompt(2), prompt(3), prompt(4)],
            &[],
        );
        for new in &mut p0.new_seqs {
            new.speculative = new.id != RequestId(3);
        }
        let out = w.run_plan(&p0).unwrap();
        let ids: Vec<RequestId> = out.drafts.iter().map(|d| d.id).collect();
        assert_eq!(ids, vec![RequestId(1), RequestId(2), RequestId(4)]);
        // Verifies of 4, 1 and a plain decode of 3: the two verified ones draft, in work order.
        let p1 = plan(
            1,
            &[],
            vec![
                (4, SeqInput::Verify { drafts: 4 }),
                (3, SeqInput::Decode),
                (1, SeqInput::Verify { drafts: 4 }),
            ],
            &[],
        );
        let out = w.run_plan(&p1).unwrap();
        let ids: Vec<RequestId> = out.drafts.iter().map(|d| d.id).collect();
        assert_eq!(ids, vec![RequestId(4), RequestId(1)]);
        assert!(out.drafts.iter().all(|d| d.confidences == vec![3.0; 4]));
        // A step without drafting makes no call.
        let p2 = plan(2, &[], vec![(3, SeqInput::Decode)], &[]);
        assert!(w.run_plan(&p2).unwrap().drafts.is_empty());
        let calls = log
            .lock()
            .map(|log| log.draft_calls.clone())
            .unwrap_or_default();
        assert_eq!(calls, vec![3, 2]);
    }

    #[test]
    fn the_executor_samples_unconstrained_entries_and_the_worker_takes_its_ids() {
        let log = Arc::new(std::sync::Mutex::new(Log::default()));
        let mut w = RankWorker::new(
            DpRank(0),
            Recording {
                log: log.clone(),
                device_token: Some(5),
            }
            .over(FakeExecutor::new(FakeConfig::default(), 0)),
        );
        let p0 = plan(
            0,
            &[1, 2],
            vec![prefill(1, &[7, 8], true), prefill(2, &[9], false)],
            &[],
        );
        let out = w.run_plan(&p0).unwrap();
        assert_eq!(out.sampled, vec![(RequestId(1), 5)]);
        let p1 = plan(
            1,
            &[],
            vec![(1, SeqInput::Decode), prefill(2, &[4], true)],
            &[],
        );
        let out = w.run_plan(&p1).unwrap();
        assert_eq!(out.sampled, vec![(RequestId(1), 5), (RequestId(2), 5)]);
        let greedy = Some(SamplingParams::greedy());
        let asked = log.lock().map(|log| log.asked.clone()).unwrap_or_default();
        assert_eq!(asked, vec![vec![greedy, None], vec![greedy, greedy]]);
    }
}
