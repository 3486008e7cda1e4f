//! The steps-per-second table DSpark's verify-length planner needs, measured at engine start on
//! a scratch executor built by the rank factory (never a serving rank's executor).
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

use deepinfer_topology::RequestId;

use crate::dspark::schedule::{StepRatePoint, StepRateTable, VerifyScheduleError};
use crate::rank::executor::{ExecError, RankExecutor, SeqTokens, execute_rows};

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

/// Measures `steps` verify-shaped steps at every size of `sizes` (strictly increasing) with
/// entries of at most `1 + block` tokens. Sequence ids used: `RequestId(0..)` on `executor`,
/// which must be a fresh executor.
pub fn profile_step_rates(
    executor: &mut dyn RankExecutor,
    sizes: &[u32],
    block: usize,
    steps: u32,
) -> Result<StepRateTable, ProfileError> {
    let modelled: Option<Vec<(u32, f64)>> = sizes
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
    let width = block + 1;
    let largest = sizes.iter().copied().max().unwrap_or(1) as usize;
    let sequences = largest.div_ceil(width);
    let ids: Vec<RequestId> = (0..sequences as u64).map(RequestId).collect();
    // Every sequence holds one token; each timed step appends and is rolled back.
    let seed_token = [0u32];
    for &id in &ids {
        executor.new_sequence(id)?;
        let entry = SeqTokens {
            id,
            tokens: &seed_token,
            all_rows: false,
        };
        execute_rows(executor, &[entry])?;
    }
    let tokens = vec![0u32; width];
    let mut measured: Vec<(u32, f64)> = Vec::with_capacity(sizes.len());
    for &size in sizes {
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
        let mut times = Vec::with_capacity(steps.max(1) as usize);
        for _ in 0..steps.max(1) {
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
    for id in ids {
        executor.free_sequence(id);
    }
    Ok(StepRateTable::new(interpolate(&measured))?)
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
    use crate::rank::fake::{FakeConfig, FakeExecutor};

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
        let table = profile_step_rates(&mut executor, &batch_sizes(12), 5, 2).unwrap();
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
