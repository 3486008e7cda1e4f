//! Token sampling: greedy, temperature, top-k, top-p, with deterministic noise.
//!
//! Owns `SamplingParams` (validated ranges) and `sample`, a pure function of (logits, params,
//! position). The random part is Gumbel-max: the chosen token is the argmax over the kept
//! candidates of `logit / temperature + g(seed, position, token)`, where `g` is Gumbel noise drawn
//! from a counter-based hash of (seed, position, token). The noise therefore never depends on the
//! batch, the step, the rank or the order requests arrive in: the same request with the same seed
//! gives the same tokens alone or in any batch (ARCHITECTURE.md §3, batch invariance).

use crate::error::ValidationError;

/// How to pick the next token from a row of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lowest token id). Range [0, 100].
    pub temperature: f32,
    /// Keep only the `top_k` highest logits; 0 disables. Range [0, vocab].
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`. Range (0, 1].
    pub top_p: f32,
    /// Seed of the noise; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams::default()
    }

    /// Checks the ranges; the error names the field and the accepted range.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if !(0.0..=100.0).contains(&self.temperature) || self.temperature.is_nan() {
            return Err(ValidationError::OutOfRange {
                field: "temperature",
                value: self.temperature.to_string(),
                expected: "a number in [0, 100]",
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ValidationError::OutOfRange {
                field: "top_p",
                value: self.top_p.to_string(),
                expected: "a number in (0, 1]",
            });
        }
        Ok(())
    }
}

/// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche.
fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A uniform number in the open interval (0, 1), a pure function of its three inputs.
pub fn uniform(seed: u64, position: u64, token: u32) -> f64 {
    let key = mix64(seed ^ 0x6A09_E667_F3BC_C909);
    let x = mix64(key ^ mix64(position.wrapping_mul(0x1000_0000_01B3) ^ u64::from(token)));
    ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A per-request seed derived from a base seed and the request id.
pub fn uniform_seed(base_seed: u64, request: u64) -> u64 {
    mix64(mix64(base_seed) ^ request)
}

/// Standard Gumbel noise for (seed, position, token).
pub fn gumbel(seed: u64, position: u64, token: u32) -> f64 {
    -(-uniform(seed, position, token).ln()).ln()
}

/// Picks a token from `logits` (one row, length = vocab) for the token at absolute `position`
/// of the sequence. Returns `None` only for an empty row.
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> Option<u32> {
    if logits.is_empty() {
        return None;
    }
    if params.temperature == 0.0 {
        return Some(argmax(logits));
    }
    let inv_t = 1.0 / f64::from(params.temperature);
    let candidates = kept_candidates(logits, params, inv_t);
    let mut best: Option<(f64, u32)> = None;
    let mut consider = |token: u32| {
        let score =
            f64::from(logits[token as usize]) * inv_t + gumbel(params.seed, position, token);
        if best.is_none_or(|(s, t)| score > s || (score == s && token < t)) {
            best = Some((score, token));
        }
    };
    match candidates {
        Some(list) => list.into_iter().for_each(&mut consider),
        None => (0..logits.len() as u32).for_each(&mut consider),
    }
    best.map(|(_, t)| t)
}

/// Argmax, ties to the lowest index; NaN never wins.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The tokens top-k / top-p keep, or `None` when every token is kept.
fn kept_candidates(logits: &[f32], params: &SamplingParams, inv_t: f64) -> Option<Vec<u32>> {
    let restrict_k = params.top_k > 0 && params.top_k < logits.len();
    let restrict_p = params.top_p < 1.0;
    if !restrict_k && !restrict_p {
        return None;
    }
    // Descending by logit, ties to the lower id: a total order, so the kept set is unique.
    let by_logit_desc = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    if restrict_k {
        ids.select_nth_unstable_by(params.top_k - 1, by_logit_desc);
        ids.truncate(params.top_k);
    }
    ids.sort_unstable_by(by_logit_desc);
    if restrict_p {
        let max = f64::from(logits[ids[0] as usize]) * inv_t;
        let weights: Vec<f64> = ids
            .iter()
            .map(|&t| (f64::from(logits[t as usize]) * inv_t - max).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut cumulative = 0.0;
        let mut keep = ids.len();
        for (i, w) in weights.iter().enumerate() {
            cumulative += w / total;
            if cumulative >= f64::from(params.top_p) {
                keep = i + 1;
                break;
            }
        }
        ids.truncate(keep);
    }
    Some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    #[test]
    fn greedy_takes_the_argmax_and_the_lowest_tie() {
        assert_eq!(
            sample(&[0.1, 3.0, -1.0, 3.0], &SamplingParams::greedy(), 7),
            Some(1)
        );
        assert_eq!(sample(&[], &SamplingParams::greedy(), 0), None);
    }

    #[test]
    fn noise_is_a_pure_function_of_seed_position_token() {
        assert_eq!(uniform(1, 2, 3), uniform(1, 2, 3));
        assert_ne!(uniform(1, 2, 3), uniform(2, 2, 3));
        assert_ne!(uniform(1, 2, 3), uniform(1, 3, 3));
        assert_ne!(uniform(1, 2, 3), uniform(1, 2, 4));
        let u = uniform(0, 0, 0);
        assert!(u > 0.0 && u < 1.0);
    }

    #[test]
    fn temperature_one_follows_the_softmax() {
        // logits ln(1), ln(2), ln(7): probabilities 0.1, 0.2, 0.7.
        let logits = [0.0f32, 2f32.ln(), 7f32.ln()];
        let n = 20_000;
        let mut counts = [0usize; 3];
        for position in 0..n {
            counts[sample(&logits, &params(1.0, 0, 1.0, 42), position).unwrap() as usize] += 1;
        }
        let freq: Vec<f64> = counts.iter().map(|&c| c as f64 / n as f64).collect();
        for (f, p) in freq.iter().zip([0.1, 0.2, 0.7]) {
            assert!((f - p).abs() < 0.015, "frequencies {freq:?}");
        }
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0f32, 4.9, 4.8, -3.0, -4.0];
        for position in 0..2000 {
            let t = sample(&logits, &params(1.0, 2, 1.0, 9), position).unwrap();
            assert!(t < 2, "top_k=2 sampled {t}");
            let t = sample(&logits, &params(1.0, 0, 0.5, 9), position).unwrap();
            assert!(t < 2, "top_p=0.5 sampled {t}");
        }
        // top_p tiny keeps only the best token.
        assert_eq!(sample(&logits, &params(1.0, 0, 1e-6, 3), 11), Some(0));
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let logits: Vec<f32> = (0..512).map(|i| ((i * 37 % 101) as f32) / 50.0).collect();
        let run = |seed| {
            (0..64)
                .map(|p| sample(&logits, &params(1.0, 0, 1.0, seed), p).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn validation_names_the_field() {
        let err = params(-1.0, 0, 1.0, 0).validate().unwrap_err();
        assert!(err.to_string().contains("temperature"));
        let err = params(1.0, 0, 0.0, 0).validate().unwrap_err();
        assert!(err.to_string().contains("top_p"));
        assert!(params(0.7, 40, 0.9, 1).validate().is_ok());
    }
}
