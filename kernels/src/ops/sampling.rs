//! Batched token sampling on the device (`deepinfer_model::sampling::sample` for many rows at
//! once): one block per row, bit-exact with the CPU (same f64 operations, same rounding of every
//! sequential top-p sum), so the returned ids equal the CPU's and never depend on other rows.
//! Rows that restrict (top-k / top-p) radix-sort their order keys in the sort scratch and sum
//! their top-p weights with the order-preserving parallel sum of `cuda/sampling/sampling.cuh`.
//! A grammar's masks are applied before, in place, by [`mask_logits_f32`] (disallowed logits
//! become −∞, as `sampling::AllowedTokens::apply` does on the host). [`token_logprobs_f32`]
//! gives sampled tokens their log-probabilities and alternatives (`sampling::token_logprobs`),
//! bit for bit, for the requests that ask.

use cudarc::driver::{CudaSlice, DeviceRepr};

use super::{dim, ensure, expect_len, launch_config};
use crate::error::KernelError;
use crate::id::KernelId;
use crate::runtime::{KernelRuntime, KernelValue};

const OP: &str = "sample_rows_f32";
const THREADS: u32 = 512;
const MASK_OP: &str = "mask_logits_f32";
const MASK_THREADS: u32 = 256;
const LOGPROB_OP: &str = "token_logprobs_f32";
/// Threads of one row's block: the lanes of the normaliser's sum (`sampling::LOGPROB_LANES`).
pub const LOGPROB_LANES: u32 = 256;
/// Alternatives one row can report (`sampling::MAX_TOP_LOGPROBS`): the stride of the outputs.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One row's sampling parameters (`sampling::SampleRow` in `cuda/sampling/sampling.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow {
    pub seed: u64,
    /// Absolute position of the sampled token (the noise's counter).
    pub position: u64,
    /// 0: greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 (or at least the vocabulary): no top-k.
    pub top_k: u32,
    pub reserved: u32,
}

impl SampleRow {
    /// Whether the row keeps only part of the vocabulary (needs the sort scratch).
    pub fn restricts(&self, vocab: usize) -> bool {
        self.temperature != 0.0
            && ((self.top_k > 0 && (self.top_k as usize) < vocab) || self.top_p < 1.0)
    }
}

/// `sampling::SampleParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SampleParams {
    rows: u32,
    vocab: u32,
    padded: u32,
}

/// `sampling::MaskParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MaskParams {
    rows: u32,
    vocab: u32,
    words: u32,
}

/// `sampling::LogprobParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LogprobParams {
    rows: u32,
    vocab: u32,
    top: u32,
}

// SAFETY: plain `#[repr(C)]` structs of integers and floats, laid out as their CUDA mirrors.
unsafe impl DeviceRepr for SampleRow {}
// SAFETY: as above.
unsafe impl KernelValue for SampleParams {}
// SAFETY: as above.
unsafe impl KernelValue for MaskParams {}
// SAFETY: as above.
unsafe impl KernelValue for LogprobParams {}

/// Where [`token_logprobs_f32`] writes: `chosen [rows]` the log-probability of each row's token,
/// `top_ids` / `top_logprobs` `[rows, MAX_TOP_LOGPROBS]` each row's first `top` alternatives
/// (most likely first; id `u32::MAX` past the tokens of non-zero probability).
pub struct LogprobOutputs<'a> {
    pub chosen: &'a mut CudaSlice<f32>,
    pub top_ids: &'a mut CudaSlice<u32>,
    pub top_logprobs: &'a mut CudaSlice<f32>,
}

/// The log-probability of `tokens[r]` under the log-softmax of row `r` of `logits [rows,
/// vocab]` and the row's `top` (at most [`MAX_TOP_LOGPROBS`]) most likely tokens with theirs:
/// `deepinfer_model::sampling::token_logprobs`, bit for bit (masked logits are −∞ already).
pub fn token_logprobs_f32(
    rt: &KernelRuntime,
    logits: &CudaSlice<f32>,
    tokens: &CudaSlice<u32>,
    out: LogprobOutputs<'_>,
    vocab: usize,
    top: usize,
) -> Result<(), KernelError> {
    let rows = tokens.len();
    ensure(vocab != 0 && top <= MAX_TOP_LOGPROBS, LOGPROB_OP, || {
        format!("a vocabulary of {vocab} with {top} alternatives per row")
    })?;
    expect_len(LOGPROB_OP, "logits", logits.len(), rows * vocab)?;
    expect_len(LOGPROB_OP, "chosen", out.chosen.len(), rows)?;
    expect_len(
        LOGPROB_OP,
        "top ids",
        out.top_ids.len(),
        rows * MAX_TOP_LOGPROBS,
    )?;
    expect_len(
        LOGPROB_OP,
        "top log-probabilities",
        out.top_logprobs.len(),
        rows * MAX_TOP_LOGPROBS,
    )?;
    if rows == 0 {
        return Ok(());
    }
    let params = LogprobParams {
        rows: dim(LOGPROB_OP, "rows", rows)?,
        vocab: dim(LOGPROB_OP, "vocab", vocab)?,
        top: dim(LOGPROB_OP, "top", top)?,
    };
    let cfg = launch_config((params.rows, 1, 1), LOGPROB_LANES, 0);
    let mut launch = rt.launcher(KernelId::TokenLogprobsF32)?;
    launch
        .arg(logits)
        .arg(tokens)
        .arg(out.chosen)
        .arg(out.top_ids)
        .arg(out.top_logprobs)
        .arg(&params);
    // SAFETY: signature (const float* logits, const u32* chosen, float* chosen_logprob,
    // u32* top_ids, float* top_logprobs, LogprobParams); lengths checked above, one block per row.
    unsafe { launch.launch(cfg) }
}

/// Bitset words of one row's mask in [`mask_logits_f32`]: one bit per token.
pub fn mask_words_per_row(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// In place on `logits [rows, vocab]`: every logit whose bit (`t % 32` of word `t / 32`) in its
/// row's bitset `words [rows, mask_words_per_row(vocab)]` is clear becomes −∞.
pub fn mask_logits_f32(
    rt: &KernelRuntime,
    logits: &mut CudaSlice<f32>,
    words: &CudaSlice<u32>,
    rows: usize,
    vocab: usize,
) -> Result<(), KernelError> {
    let per_row = mask_words_per_row(vocab);
    expect_len(MASK_OP, "logits", logits.len(), rows * vocab)?;
    expect_len(MASK_OP, "mask words", words.len(), rows * per_row)?;
    if rows == 0 || vocab == 0 {
        return Ok(());
    }
    let params = MaskParams {
        rows: dim(MASK_OP, "rows", rows)?,
        vocab: dim(MASK_OP, "vocab", vocab)?,
        words: dim(MASK_OP, "mask words per row", per_row)?,
    };
    let blocks = dim(
        MASK_OP,
        "blocks",
        (rows * vocab).div_ceil(MASK_THREADS as usize),
    )?;
    let cfg = launch_config((blocks, 1, 1), MASK_THREADS, 0);
    let mut launch = rt.launcher(KernelId::MaskLogitsF32)?;
    launch.arg(logits).arg(words).arg(&params);
    // SAFETY: signature (float* logits, const u32* words, MaskParams); lengths checked above, and
    // the grid covers exactly rows · vocab logits (the kernel bounds-checks the last block).
    unsafe { launch.launch(cfg) }
}

/// Length of one row's sort scratch: the power of two at or above `vocab`.
pub fn scratch_row_len(vocab: usize) -> usize {
    vocab.next_power_of_two()
}

/// Per-row scratch of the rows that restrict (top-k / top-p), `rows · scratch_row_len(vocab)`
/// entries each: `keys` (each row's u64 entries hold the two u32 buffers of its radix sort) and
/// `weights` (the top-p weights, then their shares).
pub struct SampleScratch {
    pub keys: CudaSlice<u64>,
    pub weights: CudaSlice<f64>,
}

impl SampleScratch {
    /// Scratch for `rows` rows of `vocab` when `restricted`, else a minimal placeholder (the
    /// kernel touches the scratch of restricting rows only).
    pub fn new(
        rt: &KernelRuntime,
        rows: usize,
        vocab: usize,
        restricted: bool,
    ) -> Result<SampleScratch, KernelError> {
        let len = if restricted {
            rows * scratch_row_len(vocab)
        } else {
            1
        };
        let stream = rt.stream();
        // Stay zeroed: the sort scratch is not audited for full writes before reads.
        Ok(SampleScratch {
            keys: stream
                .alloc_zeros::<u64>(len)
                .map_err(KernelError::driver("allocating the sampling sort scratch"))?,
            weights: stream.alloc_zeros::<f64>(len).map_err(KernelError::driver(
                "allocating the sampling weight scratch",
            ))?,
        })
    }
}

/// `tokens [rows]` = one sampled id per row of `logits [rows, vocab]`, row `r` with `rows[r]`.
/// `scratch` must hold `rows · scratch_row_len(vocab)` entries when any row restricts.
pub fn sample_rows_f32(
    rt: &KernelRuntime,
    logits: &CudaSlice<f32>,
    rows: &CudaSlice<SampleRow>,
    host_rows: &[SampleRow],
    scratch: &mut SampleScratch,
    tokens: &mut CudaSlice<u32>,
    vocab: usize,
) -> Result<(), KernelError> {
    let n = rows.len();
    ensure(vocab != 0, OP, || "the vocabulary is empty")?;
    expect_len(OP, "rows (host copy)", host_rows.len(), n)?;
    expect_len(OP, "logits", logits.len(), n * vocab)?;
    expect_len(OP, "tokens", tokens.len(), n)?;
    let padded = scratch_row_len(vocab);
    if host_rows.iter().any(|r| r.restricts(vocab)) {
        expect_len(OP, "sort scratch", scratch.keys.len(), n * padded)?;
        expect_len(OP, "weight scratch", scratch.weights.len(), n * padded)?;
    }
    if n == 0 {
        return Ok(());
    }
    let params = SampleParams {
        rows: dim(OP, "rows", n)?,
        vocab: dim(OP, "vocab", vocab)?,
        padded: dim(OP, "padded vocab", padded)?,
    };
    let cfg = launch_config((params.rows, 1, 1), THREADS, 0);
    let mut launch = rt.launcher(KernelId::SampleRowsF32)?;
    launch
        .arg(logits)
        .arg(rows)
        .arg(&mut scratch.keys)
        .arg(&mut scratch.weights)
        .arg(tokens)
        .arg(&params);
    // SAFETY: signature (const float* logits, const SampleRow* rows, u64* sort_scratch,
    // double* weight_scratch, u32* tokens, SampleParams); lengths checked above, the scratch of
    // every restricting row included.
    unsafe { launch.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::super::assert_mirrors;
    use super::*;

    #[test]
    fn params_mirror_the_cuda_structs() {
        let header = include_str!("../../cuda/sampling/sampling.cuh");
        assert_mirrors::<SampleRow>(
            header,
            32,
            &[
                "seed",
                "position",
                "temperature",
                "top_p",
                "top_k",
                "reserved",
            ],
        );
        assert_eq!(std::mem::align_of::<SampleRow>(), 8);
        assert_mirrors::<SampleParams>(header, 12, &["rows", "vocab", "padded"]);
        assert_mirrors::<MaskParams>(header, 12, &["rows", "vocab", "words"]);
        assert!(header.contains(&format!("MASK_THREADS = {MASK_THREADS};")));
        assert_mirrors::<LogprobParams>(header, 12, &["rows", "vocab", "top"]);
        assert!(header.contains(&format!("LOGPROB_LANES = {LOGPROB_LANES};")));
        assert!(header.contains(&format!("MAX_TOP_LOGPROBS = {MAX_TOP_LOGPROBS};")));
        assert_eq!(mask_words_per_row(129_280), 4040);
        assert_eq!(mask_words_per_row(33), 2);
        assert_eq!(scratch_row_len(1), 1);
        assert_eq!(scratch_row_len(129_280), 131_072);
    }

    #[test]
    fn only_noisy_rows_with_top_k_or_top_p_restrict() {
        let row = |temperature: f32, top_k: u32, top_p: f32| SampleRow {
            seed: 0,
            position: 0,
            temperature,
            top_p,
            top_k,
            reserved: 0,
        };
        assert!(!row(0.0, 5, 0.5).restricts(100), "greedy needs no sort");
        assert!(!row(1.0, 0, 1.0).restricts(100));
        assert!(
            !row(1.0, 100, 1.0).restricts(100),
            "top-k of the whole vocabulary"
        );
        assert!(row(1.0, 99, 1.0).restricts(100));
        assert!(row(1.0, 0, 0.9).restricts(100));
    }
}
