//! Whole-step timing of a model of either family ([`AnyModel`]) on any backend: the prefill of several sequences, then
//! decode steps in which every sequence appends one (greedy) token. A step is one
//! [`AnyModel::forward_step`] over all sequences (every op runs once over the step's rows), as the
//! runtime's rank executor runs it. Times are host wall-clock: every backend op returns its result
//! to the host, so an op has finished when the call returns.

use std::time::Instant;

use deepinfer_model::LogitsWanted;
use deepinfer_model::any_model::{AnyModel, AnySequence, AnyStepEntry, StepOptions};
pub use deepinfer_model::backend::cpu::argmax;
use deepinfer_model::error::ModelError;
use deepinfer_model::sampling::SamplingParams;

/// What one batch did and how long it took.
#[derive(Debug, Clone)]
pub struct BatchMeasurement {
    /// Prompt length of each sequence.
    pub prompt_lens: Vec<usize>,
    /// Seconds for all the prefills together.
    pub prefill_seconds: f64,
    /// Seconds of each decode step (every sequence one token).
    pub step_seconds: Vec<f64>,
}

impl BatchMeasurement {
    pub fn batch(&self) -> usize {
        self.prompt_lens.len()
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_lens.iter().sum()
    }

    /// The absolute positions the sequences write in decode step `step` (0-based).
    pub fn positions_at_step(&self, step: usize) -> Vec<usize> {
        self.prompt_lens.iter().map(|&len| len + step).collect()
    }
}

/// `len` prompt ids in `first_id..vocab`, a splitmix64 stream keyed by `seed` (no special ids when
/// `first_id` is past them).
pub fn prompt_tokens(seed: u64, len: usize, first_id: u32, vocab: usize) -> Vec<u32> {
    let span = (vocab as u64).saturating_sub(u64::from(first_id)).max(1);
    let mut state = seed;
    (0..len)
        .map(|_| first_id + (splitmix64(&mut state) % span) as u32)
        .collect()
}

/// The next value of the splitmix64 generator at `state` (the benchmarks' one source of
/// reproducible random data).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Prompt lengths of a batch of `batch` sequences spread evenly over `shortest..=longest` (the
/// longest alone for a batch of one).
pub fn prompt_lengths(batch: usize, shortest: usize, longest: usize) -> Vec<usize> {
    if batch <= 1 {
        return vec![longest; batch];
    }
    (0..batch)
        .map(|i| shortest + i * longest.saturating_sub(shortest) / (batch - 1))
        .collect()
}

/// The `q`-quantile (0..=1) of `values` by nearest rank, `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.saturating_sub(1)).copied()
}

/// Prefills one sequence per prompt length (prompts drawn with [`prompt_tokens`] from `seed + i`),
/// then runs `steps` decode steps over all of them. Returns the timings.
pub fn measure_batch(
    model: &AnyModel,
    prompt_lens: &[usize],
    steps: usize,
    seed: u64,
) -> Result<BatchMeasurement, ModelError> {
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> = prompt_lens
        .iter()
        .enumerate()
        .map(|(i, &len)| prompt_tokens(seed + i as u64, len, 3, vocab))
        .collect();
    let mut sequences: Vec<AnySequence> = prompts.iter().map(|_| model.new_sequence()).collect();
    let started = Instant::now();
    let mut next = step(model, &mut sequences, |i| &prompts[i])?;
    let prefill_seconds = started.elapsed().as_secs_f64();
    let step_seconds = decode_steps(model, &mut sequences, &mut next, steps)?;
    Ok(BatchMeasurement {
        prompt_lens: prompt_lens.to_vec(),
        prefill_seconds,
        step_seconds,
    })
}

/// Decode steps over clones of the `prefilled` sequences, sequence `i` appending `first[i]` first
/// (a clone starts without the device mirrors of its key lists and rings and builds them in its
/// first step). The prefilled states themselves are left as they are.
pub fn measure_decode_from(
    model: &AnyModel,
    prefilled: &[AnySequence],
    first: &[u32],
    steps: usize,
) -> Result<BatchMeasurement, ModelError> {
    let mut sequences = prefilled.to_vec();
    let mut next = first.to_vec();
    let step_seconds = decode_steps(model, &mut sequences, &mut next, steps)?;
    Ok(BatchMeasurement {
        prompt_lens: prefilled.iter().map(AnySequence::len).collect(),
        prefill_seconds: 0.0,
        step_seconds,
    })
}

/// `steps` decode steps: in each, sequence `i` appends `next[i]` and `next[i]` becomes its greedy
/// token. Returns each step's seconds.
pub fn decode_steps(
    model: &AnyModel,
    sequences: &mut [AnySequence],
    next: &mut [u32],
    steps: usize,
) -> Result<Vec<f64>, ModelError> {
    let mut step_seconds = Vec::with_capacity(steps);
    for _ in 0..steps {
        let started = Instant::now();
        decode_step(model, sequences, next)?;
        step_seconds.push(started.elapsed().as_secs_f64());
    }
    Ok(step_seconds)
}

/// One decode step: sequence `i` appends `next[i]` and `next[i]` becomes its greedy token.
pub fn decode_step(
    model: &AnyModel,
    sequences: &mut [AnySequence],
    next: &mut [u32],
) -> Result<(), ModelError> {
    let tokens = step(model, sequences, |i| std::slice::from_ref(&next[i]))?;
    next.copy_from_slice(&tokens);
    Ok(())
}

/// The last logits row after `tokens` appended to `seq`: a one-entry [`AnyModel::forward_step`].
pub fn prefill(
    model: &AnyModel,
    seq: &mut AnySequence,
    tokens: &[u32],
) -> Result<Vec<f32>, ModelError> {
    let mut entry = [AnyStepEntry::new(seq, tokens, LogitsWanted::Last)];
    let output = model
        .forward_step(&mut entry, StepOptions::default())?
        .pop();
    Ok(output
        .and_then(deepinfer_model::EntryOutput::into_logits)
        .unwrap_or_default())
}

/// One [`AnyModel::forward_step`] in which sequence `i` appends `tokens(i)`; the greedy token after
/// each (sampled on the backend: the logits stay where they are computed).
fn step<'t>(
    model: &AnyModel,
    sequences: &mut [AnySequence],
    tokens: impl Fn(usize) -> &'t [u32],
) -> Result<Vec<u32>, ModelError> {
    let mut entries: Vec<AnyStepEntry<'_>> = sequences
        .iter_mut()
        .enumerate()
        .map(|(i, seq)| AnyStepEntry {
            sample: Some(SamplingParams::greedy()),
            ..AnyStepEntry::new(seq, tokens(i), LogitsWanted::Last)
        })
        .collect();
    let outputs = model.forward_step(&mut entries, StepOptions::default())?;
    Ok(outputs
        .into_iter()
        .map(|out| {
            out.into_tokens()
                .and_then(|t| t.last().copied())
                .unwrap_or(0)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockFamily, BlockWidth, block_config, prepare_checkpoint};
    use deepinfer_model::backend::CpuBackend;
    use deepinfer_model::checkpoint::Checkpoint;

    #[test]
    fn prompt_helpers_are_deterministic_and_in_range() {
        let a = prompt_tokens(5, 200, 3, 64);
        assert_eq!(a, prompt_tokens(5, 200, 3, 64));
        assert_ne!(a, prompt_tokens(6, 200, 3, 64));
        assert!(a.iter().all(|&t| (3..64).contains(&t)));
        assert_eq!(prompt_lengths(1, 4, 20), vec![20]);
        assert_eq!(prompt_lengths(5, 4, 20), vec![4, 8, 12, 16, 20]);
        assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 6.0, 7.0, 8.0, 9.0];
        assert_eq!(percentile(&values, 0.5), Some(5.0));
        assert_eq!(percentile(&values, 0.9), Some(9.0));
        assert_eq!(percentile(&values, 1.0), Some(10.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    /// The device benchmark's path on the CPU backend with the narrow block of each family:
    /// prefill of different lengths, decode steps, copies of one prefilled state; every sequence
    /// grows by one per step.
    #[test]
    fn narrow_blocks_prefill_and_decode_on_the_cpu() {
        for family in [BlockFamily::V41, BlockFamily::V4] {
            let dir = tempfile::tempdir().expect("temp dir");
            let cfg = block_config(family, BlockWidth::Narrow, 64, 256);
            prepare_checkpoint(&cfg, 3, dir.path(), 1).expect("checkpoint");
            let ckpt = Checkpoint::open(dir.path()).expect("open");
            let model = AnyModel::from_checkpoint(cfg, &ckpt, None, Box::new(CpuBackend::new()))
                .expect("model");
            assert_eq!(model.config().family, family.model_family());
            let run = measure_batch(&model, &prompt_lengths(3, 5, 21), 2, 7).expect("batch");
            assert_eq!(run.prompt_lens, vec![5, 13, 21]);
            assert_eq!(run.prompt_tokens(), 39);
            assert_eq!(run.step_seconds.len(), 2);
            assert_eq!(run.positions_at_step(1), vec![6, 14, 22]);
            assert!(run.prefill_seconds > 0.0);

            let mut prefilled = Vec::new();
            let mut first = Vec::new();
            for seed in 0..4 {
                let mut seq = model.new_sequence();
                let logits =
                    prefill(&model, &mut seq, &prompt_tokens(seed, 40, 3, 64)).expect("prefill");
                prefilled.push(seq);
                first.push(argmax(&logits));
            }
            let run = measure_decode_from(&model, &prefilled, &first, 3).expect("decode");
            assert_eq!(run.prompt_lens, vec![40; 4]);
            assert_eq!(run.step_seconds.len(), 3);
            assert!(
                prefilled.iter().all(|seq| seq.len() == 40),
                "the prefilled states themselves are left as they were"
            );
        }
    }
}
