//! Confidence-scheduled verification length (DSpark paper, Algorithm 1, and its asynchronous
//! production variant): from each request's draft confidences, choose how many drafts every
//! request verifies so that expected accepted tokens x steps per second is largest.
//!
//! Vocabulary: a request's *confidences* `c_j` are the probabilities that draft `j` survives
//! given that drafts `0..j` survived; its *survival* `a_j = c_0 * ... * c_j` is the probability
//! that draft `j` is accepted. Verifying `n` drafts costs `1 + n` batch tokens (the anchor plus
//! the drafts) and yields `1 + a_0 + ... + a_{n-1}` tokens in expectation.

use std::cmp::Ordering;
use std::collections::VecDeque;

/// Bad scheduler input, naming what and where.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerifyScheduleError {
    /// The steps-per-second table has no points.
    #[error("steps-per-second table: no profiled points")]
    EmptyRateTable,
    /// Table batch sizes must be > 0 and strictly increasing.
    #[error(
        "steps-per-second table point {index}: batch size {batch_tokens} must be > 0 and larger than the previous point's"
    )]
    UnorderedRateTable {
        /// The point's index.
        index: usize,
        /// Its batch size (tokens).
        batch_tokens: u32,
    },
    /// A rate is not a finite number > 0.
    #[error("steps-per-second table point {index}: rate {steps_per_second} must be finite and > 0")]
    BadRate {
        /// The point's index.
        index: usize,
        /// The offending rate (steps per second).
        steps_per_second: f64,
    },
    /// A confidence is not a probability.
    #[error("request {request}, draft {draft}: confidence {value} is not in [0, 1]")]
    BadConfidence {
        /// The request's index in the batch.
        request: usize,
        /// The draft position.
        draft: usize,
        /// The offending value.
        value: f32,
    },
    /// The batch would hold more tokens than a `u32` counts.
    #[error("batch of {requests} requests overflows the token count")]
    BatchTooLarge {
        /// Requests in the batch.
        requests: usize,
    },
}

/// One profiled point: a step over `batch_tokens` tokens runs `steps_per_second` times a second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepRatePoint {
    /// Tokens in the step's batch (tokens).
    pub batch_tokens: u32,
    /// Measured step rate (steps per second).
    pub steps_per_second: f64,
}

/// Steps per second by total batch tokens, profiled once at engine start.
///
/// Lookup is a staircase: a batch of `b` tokens runs at the rate of the smallest profiled
/// size `>= b` (a batch is padded to the next captured size). Above the largest profiled size
/// the step time grows linearly with the tokens: `rate(b) = rate(max) * max / b`.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRateTable {
    points: Vec<StepRatePoint>,
}

impl StepRateTable {
    /// Validates points sorted by strictly increasing batch size with finite rates > 0.
    pub fn new(points: Vec<StepRatePoint>) -> Result<Self, VerifyScheduleError> {
        if points.is_empty() {
            return Err(VerifyScheduleError::EmptyRateTable);
        }
        let mut previous = 0;
        for (index, point) in points.iter().enumerate() {
            if point.batch_tokens <= previous {
                return Err(VerifyScheduleError::UnorderedRateTable {
                    index,
                    batch_tokens: point.batch_tokens,
                });
            }
            if !point.steps_per_second.is_finite() || point.steps_per_second <= 0.0 {
                return Err(VerifyScheduleError::BadRate {
                    index,
                    steps_per_second: point.steps_per_second,
                });
            }
            previous = point.batch_tokens;
        }
        Ok(Self { points })
    }

    /// The profiled points, by increasing batch size.
    pub fn points(&self) -> &[StepRatePoint] {
        &self.points
    }

    /// Expected steps per second for a step over `batch_tokens` tokens.
    pub fn steps_per_second(&self, batch_tokens: u32) -> f64 {
        let at = self
            .points
            .partition_point(|point| point.batch_tokens < batch_tokens);
        match self.points.get(at) {
            Some(point) => point.steps_per_second,
            None => {
                // `new` guarantees at least one point.
                let last = self.points[self.points.len() - 1];
                last.steps_per_second * f64::from(last.batch_tokens) / f64::from(batch_tokens)
            }
        }
    }
}

/// Survival probabilities: the cumulative product of the confidences.
pub fn survival(confidences: &[f32]) -> Vec<f64> {
    confidences
        .iter()
        .scan(1.0_f64, |product, &c| {
            *product *= f64::from(c);
            Some(*product)
        })
        .collect()
}

/// The chosen verification lengths of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyPlan {
    /// Drafts each request verifies (0..=max_draft_tokens), in input order.
    pub lengths: Vec<usize>,
    /// Tokens in the step's batch: `fixed_tokens` + one anchor per request + verified drafts.
    pub batch_tokens: u32,
    /// Expected tokens accepted this step (anchors included).
    pub expected_accepted: f64,
    /// `expected_accepted * steps_per_second(batch_tokens)` (tokens per second).
    pub expected_tokens_per_second: f64,
}

/// One (request, draft) candidate.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    request: usize,
    draft: usize,
    survival: f64,
}

/// Validates confidences and lists candidates by survival descending; ties keep request
/// order, then draft order, so each request's admitted drafts always form a prefix.
fn ranked_candidates<Row: AsRef<[f32]>>(
    confidences: &[Row],
    max_draft_tokens: usize,
) -> Result<Vec<Candidate>, VerifyScheduleError> {
    let mut candidates = Vec::new();
    for (request, row) in confidences.iter().enumerate() {
        let row = row.as_ref();
        if let Some((draft, &value)) = row
            .iter()
            .enumerate()
            .find(|(_, c)| !(0.0..=1.0).contains(*c))
        {
            return Err(VerifyScheduleError::BadConfidence {
                request,
                draft,
                value,
            });
        }
        let usable = &row[..row.len().min(max_draft_tokens)];
        for (draft, survival) in survival(usable).into_iter().enumerate() {
            candidates.push(Candidate {
                request,
                draft,
                survival,
            });
        }
    }
    candidates.sort_by(|a, b| {
        b.survival
            .total_cmp(&a.survival)
            .then(a.request.cmp(&b.request))
            .then(a.draft.cmp(&b.draft))
    });
    Ok(candidates)
}

/// Tokens before any draft is admitted: `fixed_tokens` plus one anchor per request.
fn base_tokens(fixed_tokens: u32, requests: usize) -> Result<u32, VerifyScheduleError> {
    u32::try_from(requests)
        .ok()
        .and_then(|r| r.checked_add(fixed_tokens))
        .ok_or(VerifyScheduleError::BatchTooLarge { requests })
}

/// One step's draft candidates, every request's drafts ranked by survival, and the tokens the
/// step holds before any draft is admitted; the ways to choose which drafts it verifies.
#[derive(Debug, Clone)]
pub struct RankedDrafts {
    requests: usize,
    candidates: Vec<Candidate>,
    base: u32,
}

impl RankedDrafts {
    /// Validates and ranks the drafts: `confidences[r]` are request `r`'s draft confidences
    /// (only the first `max_draft_tokens` are used); `fixed_tokens` are other tokens in the same
    /// step (prefill chunks).
    pub fn new<Row: AsRef<[f32]>>(
        confidences: &[Row],
        max_draft_tokens: usize,
        fixed_tokens: u32,
    ) -> Result<Self, VerifyScheduleError> {
        let candidates = ranked_candidates(confidences, max_draft_tokens)?;
        let base = base_tokens(fixed_tokens, confidences.len())?;
        Ok(Self {
            requests: confidences.len(),
            candidates,
            base,
        })
    }

    /// Synchronous Algorithm 1: admit candidates by survival while the expected throughput
    /// strictly improves; stop at the first candidate that does not improve it.
    pub fn plan_verification(&self, table: &StepRateTable) -> VerifyPlan {
        let (mut best, more) = self.admitted_throughputs(table);
        let admitted = more
            .take_while(|&throughput| {
                if throughput <= best {
                    return false;
                }
                best = throughput;
                true
            })
            .count();
        self.plan_from_prefix(admitted, table)
    }

    /// Asynchronous budget: the number of drafts `K` (over the whole batch) that maximises
    /// expected throughput for these (stale) confidences, by a global search over every `K`
    /// (no early stop: the staircase rate curve can rise again after a dip). Ties take the
    /// smaller `K`.
    pub fn verification_budget(&self, table: &StepRateTable) -> usize {
        let (none, more) = self.admitted_throughputs(table);
        let mut best = (none, 0);
        for (index, throughput) in more.enumerate() {
            if throughput.total_cmp(&best.0) == Ordering::Greater {
                best = (throughput, index + 1);
            }
        }
        best.1
    }

    /// Spends a budget of `budget` drafts on the best candidates by fresh confidences
    /// (a dynamic top-K; fewer when fewer candidates exist).
    pub fn plan_with_budget(&self, budget: usize, table: &StepRateTable) -> VerifyPlan {
        self.plan_from_prefix(budget.min(self.candidates.len()), table)
    }

    /// The expected throughput with no draft admitted, and then with the first 1, 2, … ranked
    /// candidates admitted: `(requests + Σ survival) · steps_per_second(base + admitted)`.
    fn admitted_throughputs<'a>(
        &'a self,
        table: &'a StepRateTable,
    ) -> (f64, impl Iterator<Item = f64> + 'a) {
        let base = self.base;
        let throughput = move |accepted: f64, admitted: usize| {
            let tokens = base.saturating_add(u32::try_from(admitted).unwrap_or(u32::MAX));
            accepted * table.steps_per_second(tokens)
        };
        let none = self.requests as f64;
        let more =
            self.candidates
                .iter()
                .enumerate()
                .scan(none, move |accepted, (index, candidate)| {
                    *accepted += candidate.survival;
                    Some(throughput(*accepted, index + 1))
                });
        (throughput(none, 0), more)
    }

    /// Builds the plan that admits the first `admitted` ranked candidates.
    fn plan_from_prefix(&self, admitted: usize, table: &StepRateTable) -> VerifyPlan {
        let mut lengths = vec![0; self.requests];
        let mut expected_accepted = self.requests as f64;
        for candidate in &self.candidates[..admitted] {
            lengths[candidate.request] = lengths[candidate.request].max(candidate.draft + 1);
            expected_accepted += candidate.survival;
        }
        let batch_tokens = self
            .base
            .saturating_add(u32::try_from(admitted).unwrap_or(u32::MAX));
        VerifyPlan {
            lengths,
            batch_tokens,
            expected_accepted,
            expected_tokens_per_second: expected_accepted * table.steps_per_second(batch_tokens),
        }
    }
}

/// The asynchronous scheduler of one DP rank: the budget used at step `N` was computed from
/// the confidences seen at step `N - lag` (lag 2 under async scheduling); the current step
/// still ranks candidates by its fresh confidences. Until `lag` budgets exist it plans
/// synchronously.
#[derive(Debug, Clone)]
pub struct AsyncVerifyScheduler {
    lag: usize,
    max_draft_tokens: usize,
    table: StepRateTable,
    budgets: VecDeque<usize>,
}

impl AsyncVerifyScheduler {
    /// A scheduler whose budgets are `lag` steps old (`lag` >= 1; 2 matches
    /// `scheduler.overlap_depth = 2`).
    pub fn new(lag: usize, max_draft_tokens: usize, table: StepRateTable) -> Self {
        Self {
            lag: lag.max(1),
            max_draft_tokens,
            table,
            budgets: VecDeque::new(),
        }
    }

    /// Budgets computed but not yet used (at most `lag`).
    pub fn pending_budgets(&self) -> usize {
        self.budgets.len()
    }

    /// Plans this step from fresh confidences and records the budget these confidences
    /// imply for the step `lag` steps later.
    pub fn plan_step<Row: AsRef<[f32]>>(
        &mut self,
        confidences: &[Row],
        fixed_tokens: u32,
    ) -> Result<VerifyPlan, VerifyScheduleError> {
        // Checked first: bad confidences leave the queued budgets as they were.
        let drafts = RankedDrafts::new(confidences, self.max_draft_tokens, fixed_tokens)?;
        let budget =
            (self.budgets.len() >= self.lag).then(|| self.budgets.pop_front().unwrap_or(0));
        let plan = match budget {
            Some(budget) => drafts.plan_with_budget(budget, &self.table),
            None => drafts.plan_verification(&self.table),
        };
        self.budgets
            .push_back(drafts.verification_budget(&self.table));
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(points: &[(u32, f64)]) -> StepRateTable {
        StepRateTable::new(
            points
                .iter()
                .map(|&(batch_tokens, steps_per_second)| StepRatePoint {
                    batch_tokens,
                    steps_per_second,
                })
                .collect(),
        )
        .unwrap()
    }

    /// Algorithm 1's plan of `confidences`, which must be valid.
    fn sync_plan(
        confidences: &[Vec<f32>],
        max_draft_tokens: usize,
        fixed_tokens: u32,
        table: &StepRateTable,
    ) -> VerifyPlan {
        RankedDrafts::new(confidences, max_draft_tokens, fixed_tokens)
            .unwrap()
            .plan_verification(table)
    }

    /// Rate barely drops with batch size (verification is almost free).
    fn flat() -> StepRateTable {
        table(&[(8, 100.0), (16, 99.0), (32, 98.0), (64, 97.0)])
    }

    /// Step time grows by 1 ms per token over a 10 ms floor: each token costs about 8%.
    fn linear() -> StepRateTable {
        let points: Vec<(u32, f64)> = (1..=64)
            .map(|b| (b, 1000.0 / (10.0 + f64::from(b))))
            .collect();
        table(&points)
    }

    /// Rate halves for every extra token beyond the anchors of two requests.
    fn steep() -> StepRateTable {
        table(&[(2, 100.0), (3, 50.0), (4, 25.0), (8, 5.0), (16, 1.0)])
    }

    #[test]
    fn survival_is_the_cumulative_product() {
        let a = survival(&[0.5, 0.5, 1.0, 0.25]);
        assert_eq!(a, vec![0.5, 0.25, 0.25, 0.0625]);
    }

    #[test]
    fn rate_lookup_is_a_staircase_with_linear_tail() {
        let t = table(&[(4, 100.0), (8, 80.0)]);
        assert_eq!(t.steps_per_second(1), 100.0);
        assert_eq!(t.steps_per_second(4), 100.0);
        assert_eq!(t.steps_per_second(5), 80.0);
        assert_eq!(t.steps_per_second(16), 40.0);
    }

    #[test]
    fn high_confidence_verifies_long_drafts() {
        let plan = sync_plan(&[vec![0.95; 5]], 5, 0, &flat());
        assert_eq!(plan.lengths, vec![5]);
        assert_eq!(plan.batch_tokens, 6);
    }

    #[test]
    fn low_confidence_verifies_short_drafts() {
        // Survivals 0.9, 0.009, ...: only the first draft pays for the 1% slowdown per token
        // (1.9 * 99 = 188.1 beats 1 * 100, but 1.909 * 98 = 187.1 does not beat 188.1).
        let plan = sync_plan(
            &[vec![0.9, 0.01, 0.01, 0.01, 0.01]],
            5,
            0,
            &table(&[
                (1, 100.0),
                (2, 99.0),
                (3, 98.0),
                (4, 97.0),
                (5, 96.0),
                (6, 95.0),
            ]),
        );
        assert_eq!(plan.lengths, vec![1]);
        let none = sync_plan(&[vec![0.01; 5]], 5, 0, &linear());
        assert_eq!(none.lengths, vec![0]);
    }

    #[test]
    fn lengths_follow_each_requests_confidence() {
        let confident = vec![0.9; 5];
        let unsure = vec![0.3; 5];
        // Survivals 0.9 .. 0.59 all pay for their token; after them 0.3 does not
        // (5.69 / 17 ms > 5.99 / 18 ms).
        let plan = sync_plan(&[confident, unsure], 5, 0, &linear());
        assert_eq!(plan.lengths, vec![5, 0]);
        // On a flat table verification is free, so both verify everything.
        let flat_plan = sync_plan(&[vec![0.9; 5], vec![0.3; 5]], 5, 0, &flat());
        assert_eq!(flat_plan.lengths, vec![5, 5]);
    }

    #[test]
    fn slow_big_batches_shorten_verification() {
        let confidences = vec![vec![0.8; 5], vec![0.8; 5]];
        let fast = sync_plan(&confidences, 5, 0, &flat());
        let slow = sync_plan(&confidences, 5, 0, &steep());
        assert_eq!(fast.lengths, vec![5, 5]);
        let fast_total: usize = fast.lengths.iter().sum();
        let slow_total: usize = slow.lengths.iter().sum();
        assert!(slow_total < fast_total, "{slow:?}");
        // With steep(): 2 tokens -> 2 * 100 = 200; 3 tokens -> 2.8 * 50 = 140: stop at 0.
        assert_eq!(slow.lengths, vec![0, 0]);
    }

    #[test]
    fn fixed_prefill_tokens_count_toward_the_batch() {
        let t = table(&[(4, 100.0), (8, 50.0)]);
        let idle = sync_plan(&[vec![0.9; 3]], 5, 0, &t);
        assert_eq!(idle.lengths, vec![3]);
        // With 4 prefill tokens the first draft already crosses into the slow bucket.
        let busy = sync_plan(&[vec![0.9; 3]], 5, 3, &t);
        assert_eq!(busy.lengths, vec![0]);
    }

    #[test]
    fn max_draft_tokens_caps_lengths() {
        let plan = sync_plan(&[vec![1.0; 8]], 3, 0, &flat());
        assert_eq!(plan.lengths, vec![3]);
    }

    #[test]
    fn global_budget_search_sees_past_a_dip() {
        // Rates: 1 token 100, 2 tokens 40 (dip), up to 4 tokens 39. With survivals of 1.0 the
        // early stop halts at 0 drafts (1*100 > 2*40); the global search finds 4*39 = 156.
        let t = table(&[(1, 100.0), (2, 40.0), (4, 39.0)]);
        let confidences = vec![vec![1.0; 3]];
        let sync = sync_plan(&confidences, 5, 0, &t);
        assert_eq!(sync.lengths, vec![0]);
        assert_eq!(
            RankedDrafts::new(&confidences, 5, 0)
                .unwrap()
                .verification_budget(&t),
            3
        );
    }

    #[test]
    fn async_scheduler_uses_two_step_old_budgets() {
        let mut scheduler = AsyncVerifyScheduler::new(2, 5, linear());
        let confident = vec![vec![0.95; 5]];
        let unsure = vec![vec![0.01; 5]];
        // Steps 0 and 1 plan synchronously.
        assert_eq!(scheduler.plan_step(&confident, 0).unwrap().lengths, vec![5]);
        assert_eq!(scheduler.plan_step(&unsure, 0).unwrap().lengths, vec![0]);
        assert_eq!(scheduler.pending_budgets(), 2);
        // Step 2 spends the budget from step 0 (5 drafts) on fresh, unsure confidences.
        assert_eq!(scheduler.plan_step(&unsure, 0).unwrap().lengths, vec![5]);
        // Step 3 spends step 1's budget (0 drafts) even though it is confident now.
        assert_eq!(scheduler.plan_step(&confident, 0).unwrap().lengths, vec![0]);
        // Bad confidences are an error that spends no budget: step 4 still gets step 2's.
        assert!(scheduler.plan_step(&[vec![f32::NAN; 5]], 0).is_err());
        assert_eq!(scheduler.pending_budgets(), 2);
        assert_eq!(scheduler.plan_step(&unsure, 0).unwrap().lengths, vec![0]);
    }

    #[test]
    fn budget_goes_to_the_freshest_best_candidates() {
        let confidences = vec![vec![0.2; 5], vec![0.9; 5]];
        let plan = RankedDrafts::new(&confidences, 5, 0)
            .unwrap()
            .plan_with_budget(3, &flat());
        assert_eq!(plan.lengths, vec![0, 3]);
        assert_eq!(plan.batch_tokens, 5);
    }

    #[test]
    fn bad_inputs_are_named() {
        assert_eq!(
            RankedDrafts::new(&[vec![0.5], vec![0.5, 1.5]], 5, 0).unwrap_err(),
            VerifyScheduleError::BadConfidence {
                request: 1,
                draft: 1,
                value: 1.5
            }
        );
        assert!(matches!(
            RankedDrafts::new(&[vec![f32::NAN]], 5, 0),
            Err(VerifyScheduleError::BadConfidence { .. })
        ));
        assert_eq!(
            StepRateTable::new(vec![]).unwrap_err(),
            VerifyScheduleError::EmptyRateTable
        );
        let unordered = StepRateTable::new(vec![
            StepRatePoint {
                batch_tokens: 8,
                steps_per_second: 1.0,
            },
            StepRatePoint {
                batch_tokens: 8,
                steps_per_second: 1.0,
            },
        ]);
        assert_eq!(
            unordered.unwrap_err().to_string(),
            "steps-per-second table point 1: batch size 8 must be > 0 and larger than the previous point's"
        );
        let zero_rate = StepRateTable::new(vec![StepRatePoint {
            batch_tokens: 1,
            steps_per_second: 0.0,
        }]);
        assert!(matches!(
            zero_rate,
            Err(VerifyScheduleError::BadRate { index: 0, .. })
        ));
    }

    fn random_table() -> impl proptest::strategy::Strategy<Value = StepRateTable> {
        use proptest::prelude::*;
        prop::collection::vec((1u32..8, 0.5f64..1.0), 1..12).prop_map(|steps| {
            let mut batch_tokens = 0;
            let mut rate = 1000.0;
            let points = steps
                .into_iter()
                .map(|(gap, factor)| {
                    batch_tokens += gap;
                    rate *= factor;
                    StepRatePoint {
                        batch_tokens,
                        steps_per_second: rate,
                    }
                })
                .collect();
            StepRateTable::new(points).unwrap()
        })
    }

    proptest::proptest! {
        #[test]
        fn plans_are_consistent_and_the_budget_is_a_global_optimum(
            confidences in proptest::collection::vec(
                proptest::collection::vec(0.0f32..=1.0, 0..8), 0..6),
            max_draft in 1usize..=6,
            fixed in 0u32..6,
            table in random_table(),
        ) {
            let ranked = RankedDrafts::new(&confidences, max_draft, fixed).unwrap();
            let sync = ranked.plan_verification(&table);
            let drafts: usize = sync.lengths.iter().sum();
            proptest::prop_assert_eq!(
                sync.batch_tokens as usize,
                fixed as usize + confidences.len() + drafts
            );
            for (length, row) in sync.lengths.iter().zip(&confidences) {
                proptest::prop_assert!(*length <= max_draft.min(row.len()));
            }
            let budget = ranked.verification_budget(&table);
            let best = ranked.plan_with_budget(budget, &table);
            proptest::prop_assert!(
                best.expected_tokens_per_second >= sync.expected_tokens_per_second - 1e-9
            );
            for k in 0..=drafts + 8 {
                let other = ranked.plan_with_budget(k, &table);
                proptest::prop_assert!(
                    best.expected_tokens_per_second >= other.expected_tokens_per_second - 1e-9
                );
            }
        }
    }

    #[test]
    fn empty_batch_plans_nothing() {
        let plan = sync_plan(&[], 5, 0, &flat());
        assert!(plan.lengths.is_empty());
        assert_eq!(plan.expected_accepted, 0.0);
    }
}
