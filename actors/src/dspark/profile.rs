//! The steps-per-second table DSpark's verify-length planner needs, measured at engine start on
//! every DP rank's own executor, before its first plan (`RankMsg::Profile`; the supervisor hands
//! rank 0's table to the schedulers). Every rank runs the same [`ProfileRequest`], so the ranks
//! run the same steps in the same order: with expert parallelism on CUDA, where every step is a
//! collective of the EP ranks in `Lockstep`, their steps pair up one for one. The profile leaves
//! the executor holding no sequence.
//!
//! For each batch size `b` (powers of two up to the largest verify batch, and that size), the
//! profile fills a step with verify-shaped entries (anchor + up to `block` drafts per sequence,
//! all rows wanted) totalling `b` tokens, times `steps` such steps (rolling the sequences back
//! after each), and takes the median plus the executor's reported device latency. The table
//! then has a point at every batch size up to the largest, the step time interpolated linearly
//! between measured sizes: these executors pad nothing (no captured graph sizes), so a coarse
//! staircase would overstate what one more token costs and stop Algorithm 1 early. A simulated
//! device is not timed: its modelled step time (`RankExecutor::modelled_step_time`) is the table.

use std::time::{Duration, Instant};

use deepinfer_topology::{DSparkConfig, RequestId};

use crate::dspark::schedule::{StepRatePoint, StepRateTable, VerifyScheduleError};
use crate::rank::executor::{ExecError, RankExecutor, SeqTokens, execute_rows};
use crate::scheduler::state::SchedulerLimits;

/// Why profiling failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    #[error("profiling the step rate: {0}")]
    Executor(#[from] ExecError),
    #[error("profiling the step rate: {0}")]
    Table(#[from] VerifyScheduleError),
}

/// Batch sizes to profile: powers of two below `largest`, then `largest` (>= 1).
pub fn batch_sizes(largest: u32) -> Vec<u32> {
    let largest = largest.max(1);
    let mut sizes: Vec<u32> = std::iter::successors(Some(1u32), |s| s.checked_mul(2))
        .take_while(|&s| s < largest)
        .collect();
    sizes.push(largest);
    sizes
}

/// What every rank profiles (owned data: it travels in `RankMsg::Profile`).
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileRequest {
    /// Batch sizes (tokens), strictly increasing ([`batch_sizes`]).
    pub sizes: Vec<u32>,
    /// Most drafts per entry: entries of up to `1 + block` tokens.
    pub block: usize,
    /// Timed steps per batch size (at least 1 runs).
    pub steps: u32,
}

impl ProfileRequest {
    /// The profile of `[dspark]` under `limits`: sizes up to the largest verify batch (the
    /// plan's token budget, or every running request verifying all its drafts).
    pub fn for_engine(dspark: &DSparkConfig, limits: &SchedulerLimits) -> ProfileRequest {
        let block = usize::from(dspark.max_draft_tokens);
        let largest = limits
            .max_batched_tokens
            .min(limits.max_running.saturating_mul(1 + block));
        ProfileRequest {
            sizes: batch_sizes(u32::try_from(largest).unwrap_or(u32::MAX)),
            block,
            steps: dspark.profile_steps,
        }
    }

    /// Steps the profile runs on an executor that times them: one seeding the sequences, then
    /// `steps` (at least 1) per batch size. With expert parallelism on CUDA every rank leads
    /// exactly these before it follows any peer (`experts::device::DeviceExperts::may_follow`).
    pub fn executor_steps(&self) -> u64 {
        1 + self.sizes.len() as u64 * u64::from(self.steps.max(1))
    }
}

/// Measures `request` on `executor`, which must hold no sequence yet (the profile's sequences
/// are `RequestId(0..)`); every sequence it made is freed, whether it succeeds or fails.
pub fn profile_step_rates(
    executor: &mut dyn RankExecutor,
    request: &ProfileRequest,
) -> Result<StepRateTable, ProfileError> {
    let modelled: Option<Vec<(u32, f64)>> = request
        .sizes
        .iter()
        .map(|&size| {
            executor
                .modelled_step_time(size as usize)
                .map(|t| (size, t.max(Duration::from_nanos(1)).as_secs_f64()))
        })
        .collect();
    if let Some(measured) = modelled {
        return Ok(StepRateTable::new(interpolate(&measured))?);
    }
    let largest = request.sizes.iter().copied().max().unwrap_or(1) as usize;
    let sequences = largest.div_ceil(request.block + 1);
    let ids: Vec<RequestId> = (0..sequences as u64).map(RequestId).collect();
    let measured = time_steps(executor, request, &ids);
    for &id in &ids {
        executor.free_sequence(id);
    }
    Ok(StepRateTable::new(interpolate(&measured?))?)
}

/// The timed steps of [`profile_step_rates`] over the sequences `ids` (created here).
fn time_steps(
    executor: &mut dyn RankExecutor,
    request: &ProfileRequest,
    ids: &[RequestId],
) -> Result<Vec<(u32, f64)>, ExecError> {
    let width = request.block + 1;
    // Every sequence holds one token (one step seeds them all); each timed step appends and is
    // rolled back.
    let seed_token = [0u32];
    let mut seeds = Vec::with_capacity(ids.len());
    for &id in ids {
        executor.new_sequence(id)?;
        seeds.push(SeqTokens {
            id,
            tokens: &seed_token,
            all_rows: false,
        });
    }
    execute_rows(executor, &seeds)?;
    let tokens = vec![0u32; width];
    let mut measured: Vec<(u32, f64)> = Vec::with_capacity(request.sizes.len());
    for &size in &request.sizes {
        let mut left = size as usize;
        let batch: Vec<SeqTokens<'_>> = ids
            .iter()
            .map_while(|&id| {
                let n = left.min(width);
                left -= n;
                (n > 0).then(|| SeqTokens {
                    id,
                    tokens: &tokens[..n],
                    all_rows: true,
                })
            })
            .collect();
        let mut times = Vec::with_capacity(request.steps.max(1) as usize);
        for _ in 0..request.steps.max(1) {
            let start = Instant::now();
            // Read on the host: the time includes the step's end on a device.
            execute_rows(executor, &batch)?;
            times.push(start.elapsed());
            for entry in &batch {
                executor.rollback(entry.id, 1)?;
            }
        }
        times.sort_unstable();
        let step = times[times.len() / 2] + executor.device_latency(size as usize);
        measured.push((size, step.max(Duration::from_nanos(1)).as_secs_f64()));
    }
    Ok(measured)
}

/// A point at every batch size from 1 to the largest measured one: the step time of the
/// nearest measured size below 1's first point, linear between measured sizes.
fn interpolate(measured: &[(u32, f64)]) -> Vec<StepRatePoint> {
    let Some(&(largest, _)) = measured.last() else {
        return Vec::new();
    };
    (1..=largest)
        .map(|b| {
            let after = measured.partition_point(|&(size, _)| size < b);
            let seconds = match (
                after.checked_sub(1).and_then(|i| measured.get(i)),
                measured.get(after),
            ) {
                (_, Some(&(size, t))) if size == b => t,
                (Some(&(lo, t_lo)), Some(&(hi, t_hi))) => {
                    t_lo + (t_hi - t_lo) * f64::from(b - lo) / f64::from(hi - lo)
                }
                (_, Some(&(_, t))) | (Some(&(_, t)), None) => t,
                (None, None) => 1.0,
            };
            StepRatePoint {
                batch_tokens: b,
                steps_per_second: 1.0 / seconds,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank::executor::{ExecStep, ExecutorLayer, Layered};
    use crate::rank::fake::{FakeConfig, FakeExecutor};
    use deepinfer_model::EntryOutput;
    use deepinfer_topology::NodeConfig;

    /// Counts the steps; fails the `fail_at`-th (1-based).
    struct Steps {
        count: usize,
        fail_at: Option<usize>,
    }

    impl ExecutorLayer for Steps {
        fn execute(
            &mut self,
            inner: &mut dyn RankExecutor,
            ExecStep { batch, sampling }: ExecStep<'_>,
        ) -> Result<Vec<EntryOutput>, ExecError> {
            self.count += 1;
            if self.fail_at == Some(self.count) {
                return Err(ExecError::Backend("injected".into()));
            }
            inner.execute(ExecStep { batch, sampling })
        }
    }

    fn request() -> ProfileRequest {
        ProfileRequest {
            sizes: batch_sizes(12),
            block: 5,
            steps: 2,
        }
    }

    /// The sizes go up to the largest verify batch: the plan's token budget, or every running
    /// request verifying all its drafts.
    #[test]
    fn the_engine_profiles_up_to_its_largest_verify_batch() {
        let mut dspark = NodeConfig::from_toml_str("", "defaults")
            .expect("defaults")
            .dspark;
        dspark.max_draft_tokens = 5;
        dspark.profile_steps = 3;
        let limits = |max_running| SchedulerLimits {
            max_batched_tokens: 64,
            max_running,
            prefill_chunk_tokens: 16,
            overlap_depth: 1,
            context_parallel: None,
        };
        let request = ProfileRequest::for_engine(&dspark, &limits(4));
        assert_eq!(
            request,
            ProfileRequest {
                sizes: vec![1, 2, 4, 8, 16, 24],
                block: 5,
                steps: 3,
            }
        );
        let request = ProfileRequest::for_engine(&dspark, &limits(100));
        assert_eq!(request.sizes, vec![1, 2, 4, 8, 16, 32, 64]);
    }

    /// One step seeds every sequence, then `steps` per size: the same count on every rank. A
    /// failing step fails the profile naming why, and leaves no sequence behind either.
    #[test]
    fn the_profile_runs_a_fixed_number_of_steps_and_frees_its_sequences() {
        let run = |fail_at| {
            let fake = Box::new(FakeExecutor::new(FakeConfig::default(), 0));
            let mut executor = Layered::new(fake, Steps { count: 0, fail_at });
            let profiled = profile_step_rates(&mut executor, &request());
            assert_eq!(executor.live_sequences(), 0, "failing at {fail_at:?}");
            (profiled, executor.layer.count)
        };
        let (table, steps) = run(None);
        assert_eq!(table.expect("profiled").points().len(), 12);
        assert_eq!(
            steps,
            1 + 5 * 2,
            "a seeding step, then 2 per size of 1, 2, 4, 8, 12"
        );
        for fail_at in [1, 2, 11] {
            let (profiled, steps) = run(Some(fail_at));
            assert_eq!(
                profiled,
                Err(ProfileError::Executor(ExecError::Backend(
                    "injected".into()
                )))
            );
            assert_eq!(steps, fail_at);
        }
    }

    #[test]
    fn sizes_are_powers_of_two_then_the_largest() {
        assert_eq!(batch_sizes(1), vec![1]);
        assert_eq!(batch_sizes(12), vec![1, 2, 4, 8, 12]);
        assert_eq!(batch_sizes(16), vec![1, 2, 4, 8, 16]);
    }

    #[test]
    fn the_table_follows_the_device_cost_per_token() {
        let mut executor = FakeExecutor::new(
            FakeConfig {
                device_time: Duration::from_millis(10),
                device_time_per_token: Duration::from_millis(1),
                ..FakeConfig::default()
            },
            0,
        );
        let table = profile_step_rates(&mut executor, &request()).unwrap();
        let rates: Vec<f64> = table.points().iter().map(|p| p.steps_per_second).collect();
        assert_eq!(rates.len(), 12, "a point per batch size");
        // 10 ms + 1 ms per token (+ a little host time): 1 token ~ 90.9/s, 12 tokens ~ 45.5/s;
        // 3 tokens (between the measured 2 and 4) ~ 1000/13.
        assert!(
            rates[0] < 1000.0 / 11.0 + 1e-9 && rates[0] > 80.0,
            "{rates:?}"
        );
        assert!(
            rates[2] < 1000.0 / 13.0 + 1e-9 && rates[2] > 68.0,
            "{rates:?}"
        );
        assert!(
            rates[11] < 1000.0 / 22.0 + 1e-9 && rates[11] > 40.0,
            "{rates:?}"
        );
        assert!(rates.windows(2).all(|w| w[0] > w[1]), "{rates:?}");
        assert_eq!(executor.live_sequences(), 0, "profile sequences are freed");
    }
}
