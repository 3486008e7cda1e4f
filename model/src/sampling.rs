//! Token sampling math: greedy, temperature, top-k, top-p, with deterministic noise. The one
//! definition of what a sampled token is; the runtime (`deepinfer-actors`) re-exports it and the
//! CUDA sampling kernel (`kernels/cuda/sampling`) mirrors it operation for operation.
//!
//! Owns [`SamplingParams`] (validated ranges) and [`sample`], a pure function of (logits, params,
//! position), [`token_logprobs`] (what a request asking for log-probabilities is told about a
//! sampled token), and [`AllowedTokens`] with [`sample_allowed`]: a grammar's mask sets the disallowed
//! logits to −∞ before anything else (noise, temperature, top-k, top-p), so a constrained row is
//! [`sample`] of the masked row. The random part is Gumbel-max: the chosen token is the argmax over the kept
//! candidates of `logit / temperature + g(seed, position, token)`, where `g` is Gumbel noise drawn
//! from a counter-based hash of (seed, position, token). The noise therefore never depends on the
//! batch, the step, the rank or the order requests arrive in: the same request with the same seed
//! gives the same tokens alone or in any batch (ARCHITECTURE.md §3, batch invariance).
//!
//! The f64 transcendental functions are this module's own [`ln_f64`] and [`exp_f64`], built from
//! IEEE-754 additions, multiplications, fused multiply-adds and divisions only (each correctly
//! rounded on every conforming device), so a GPU computes the very same noise and top-p weights:
//! no libm whose last bit may differ between the host and the device.

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

/// A sampling parameter outside its accepted range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field} = {value} is out of range: {expected}")]
pub struct SamplingParamError {
    /// The field's name.
    pub field: &'static str,
    /// The rejected value, as text.
    pub value: String,
    /// The accepted range, in words.
    pub expected: &'static str,
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams::default()
    }

    /// Checks the ranges; the error names the field and the accepted range.
    pub fn validate(&self) -> Result<(), SamplingParamError> {
        if !(0.0..=100.0).contains(&self.temperature) || self.temperature.is_nan() {
            return Err(SamplingParamError {
                field: "temperature",
                value: self.temperature.to_string(),
                expected: "a number in [0, 100]",
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingParamError {
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

/// Standard Gumbel noise for (seed, position, token): `−ln(−ln u)`.
pub fn gumbel(seed: u64, position: u64, token: u32) -> f64 {
    -ln_f64(-ln_f64(uniform(seed, position, token)))
}

/// `ln 2` split into a head with 32 significant bits (so `k · LN2_HEAD` is exact for |k| < 2^21)
/// and the remainder.
const LN2_HEAD: f64 = 0.693_147_180_369_123_8;
const LN2_TAIL: f64 = 1.908_214_929_270_587_7e-10;

/// `2^e` for `e` in the normal exponent range [−1022, 1023].
fn power_of_two(e: i64) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// Terms of the `atanh` series in [`ln_f64`]: `1 / (2i + 3)` for i = 0..12 (the odd powers after
/// the linear one), evaluated by Horner from the last.
const ATANH_SERIES: [f64; 12] = [
    1.0 / 3.0,
    1.0 / 5.0,
    1.0 / 7.0,
    1.0 / 9.0,
    1.0 / 11.0,
    1.0 / 13.0,
    1.0 / 15.0,
    1.0 / 17.0,
    1.0 / 19.0,
    1.0 / 21.0,
    1.0 / 23.0,
    1.0 / 25.0,
];

/// Natural logarithm in f64 from basic IEEE operations only (module header), within a few ulps of
/// the true value. `x = 2^e · m` with `m ∈ [√½, √2)`, `ln m = 2·atanh(s)` with `s = (m−1)/(m+1)`
/// (|s| ≤ 0.172, 13 odd terms), `ln x = e·ln 2 + ln m`. Zero, negative, subnormal, infinite and
/// NaN inputs: `−∞`, NaN, the same formula after scaling by 2^54, `+∞`, NaN.
pub fn ln_f64(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 {
        return f64::NAN;
    }
    if x == 0.0 {
        return f64::NEG_INFINITY;
    }
    if x == f64::INFINITY {
        return x;
    }
    let (x, bias) = if x < f64::MIN_POSITIVE {
        (x * power_of_two(54), -54i64)
    } else {
        (x, 0)
    };
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m >= std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let e = (e + bias) as f64;
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let series = ATANH_SERIES[..ATANH_SERIES.len() - 1]
        .iter()
        .rev()
        .fold(ATANH_SERIES[ATANH_SERIES.len() - 1], |acc, &c| {
            acc.mul_add(s2, c)
        });
    let ln_m = (2.0 * s).mul_add(s2 * series, 2.0 * s);
    e.mul_add(LN2_HEAD, e.mul_add(LN2_TAIL, ln_m))
}

/// Taylor coefficients `1/i!` for i = 13 down to 2, the Horner order of [`exp_f64`].
const EXP_SERIES: [f64; 12] = [
    1.0 / 6_227_020_800.0,
    1.0 / 479_001_600.0,
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
];

/// `e^x` in f64 from basic IEEE operations only (module header), within a few ulps of the true
/// value: `x = k·ln 2 + r` with `k = round(x / ln 2)` (ties to even) and |r| ≤ 0.35, a degree-13
/// Taylor polynomial in `r`, scaled by `2^k` in two steps (so subnormal results round once per
/// step, identically everywhere). NaN gives NaN, `x < −746` gives 0, `x > 709.8` gives `+∞`.
pub fn exp_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x < -746.0 {
        return 0.0;
    }
    if x > 709.78 {
        return f64::INFINITY;
    }
    let k = (x * std::f64::consts::LOG2_E).round_ties_even();
    let r = k.mul_add(-LN2_TAIL, k.mul_add(-LN2_HEAD, x));
    let poly = EXP_SERIES[1..]
        .iter()
        .fold(EXP_SERIES[0], |acc, &c| acc.mul_add(r, c));
    let mantissa = (r * r).mul_add(poly, r) + 1.0;
    let k = k as i64;
    let half = k >> 1;
    mantissa * power_of_two(half) * power_of_two(k - half)
}

/// The tokens one row may take (a grammar's mask): bit `t % 32` of word `t / 32` allows token
/// `t`. Tokens at or beyond `vocab` (a logits row may be wider: padding) are never allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedTokens {
    vocab: usize,
    /// `vocab.div_ceil(32)` words; the bits at or beyond `vocab` are clear.
    words: Vec<u32>,
}

/// A mask that cannot be applied to a row of logits, or that leaves nothing to sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaskError {
    /// The bitset holds fewer words than its vocabulary needs.
    #[error("a mask over {vocab} tokens needs {needed} bitset words, got {found}")]
    TooFewWords {
        vocab: usize,
        needed: usize,
        found: usize,
    },
    /// The mask covers more tokens than the logits row holds.
    #[error("a mask over {vocab} tokens does not fit a logits row of {width}")]
    RowTooShort { vocab: usize, width: usize },
    /// Every token of the row is disallowed: there is nothing to sample.
    #[error("the mask allows no token (vocabulary of {vocab})")]
    NothingAllowed { vocab: usize },
}

impl AllowedTokens {
    /// The mask over `vocab` tokens whose bitset starts with `words` (extra words, and bits at or
    /// beyond `vocab`, are ignored).
    pub fn from_words(vocab: usize, words: &[u32]) -> Result<AllowedTokens, MaskError> {
        let needed = vocab.div_ceil(32);
        let Some(words) = words.get(..needed) else {
            return Err(MaskError::TooFewWords {
                vocab,
                needed,
                found: words.len(),
            });
        };
        let mut words = words.to_vec();
        if let (Some(last), tail @ 1..) = (words.last_mut(), vocab % 32) {
            *last &= (1u32 << tail) - 1;
        }
        Ok(AllowedTokens { vocab, words })
    }

    /// The mask over `vocab` tokens allowing exactly `tokens` (ids at or beyond `vocab` ignored).
    pub fn from_tokens(vocab: usize, tokens: &[u32]) -> AllowedTokens {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for &t in tokens.iter().filter(|&&t| (t as usize) < vocab) {
            words[t as usize / 32] |= 1 << (t % 32);
        }
        AllowedTokens { vocab, words }
    }

    /// Tokens the mask covers.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The bitset, `vocab.div_ceil(32)` words.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    pub fn is_allowed(&self, token: u32) -> bool {
        (token as usize) < self.vocab && self.words[token as usize / 32] & (1 << (token % 32)) != 0
    }

    /// Number of allowed tokens.
    pub fn allowed_count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The bitset over a logits row of `width` tokens (`width.div_ceil(32)` words, padding
    /// disallowed): what a device uploads. Errors when the mask is wider than the row or allows
    /// nothing.
    pub fn row_words(&self, width: usize) -> Result<Vec<u32>, MaskError> {
        self.check_row(width)?;
        let mut words = self.words.clone();
        words.resize(width.div_ceil(32), 0);
        Ok(words)
    }

    /// Sets every disallowed logit of `row` (and its padding beyond `vocab`) to −∞.
    pub fn apply(&self, row: &mut [f32]) -> Result<(), MaskError> {
        self.check_row(row.len())?;
        for (t, logit) in row.iter_mut().enumerate() {
            if !self.is_allowed(t as u32) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Whether the mask applies to a logits row of `width` tokens: not wider than it, and
    /// allowing some token.
    pub fn check_row(&self, width: usize) -> Result<(), MaskError> {
        if width < self.vocab {
            return Err(MaskError::RowTooShort {
                vocab: self.vocab,
                width,
            });
        }
        if self.allowed_count() == 0 {
            return Err(MaskError::NothingAllowed { vocab: self.vocab });
        }
        Ok(())
    }
}

/// [`sample`] of `logits` after `allowed` (if any) set its disallowed tokens to −∞: the one
/// definition of a constrained row's token. An empty row is [`MaskError::RowTooShort`].
pub fn sample_allowed(
    logits: &[f32],
    params: &SamplingParams,
    position: u64,
    allowed: Option<&AllowedTokens>,
) -> Result<u32, MaskError> {
    let masked;
    let row = match allowed {
        Some(allowed) => {
            let mut row = logits.to_vec();
            allowed.apply(&mut row)?;
            masked = row;
            &masked[..]
        }
        None => logits,
    };
    sample(row, params, position).ok_or(MaskError::RowTooShort {
        vocab: allowed.map_or(1, AllowedTokens::vocab).max(1),
        width: 0,
    })
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

/// The tokens top-k / top-p keep, in descending logit order (ties: lower id first), or `None`
/// when every token is kept. Top-p weighs the top-k survivors by `exp(logit/T − max)`, sums them
/// in that order and keeps the shortest prefix whose running share reaches `top_p`.
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
            .map(|&t| exp_f64(f64::from(logits[t as usize]) * inv_t - max))
            .collect();
        let total = weights.iter().fold(0.0f64, |acc, &w| acc + w);
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

/// Most alternatives [`token_logprobs`] reports per token (OpenAI's `top_logprobs` bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Lanes of [`token_logprobs`]'s normaliser: token `t` is added to lane `t % LOGPROB_LANES` in
/// increasing id, then the lanes are summed pairwise (`lane[i] += lane[i + half]`, halving) —
/// one fixed order, the one a block of `LOGPROB_LANES` device threads reduces in.
pub const LOGPROB_LANES: usize = 256;

/// What a request is told about one sampled token: its log-probability and the most likely
/// tokens with theirs, under the row's distribution ([`token_logprobs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    /// `ln p(token)`; −∞ for a token the mask disallowed (a grammar's forced end).
    pub logprob: f32,
    /// Up to the asked number of `(token, ln p)`, most likely first (ties: lower id first);
    /// only tokens of non-zero probability.
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities reported for `token` sampled from `logits` (one row): the
/// log-softmax of the row after `allowed` (if any) set its disallowed logits to −∞ — the
/// model's distribution as the request constrained it, before temperature, top-k and top-p,
/// which only choose how to draw from it (so greedy requests get the model's real
/// log-probabilities, and the numbers do not depend on the seed). NaN logits count as −∞; a
/// device computes the same bits (`kernels/cuda/sampling`, `token_logprobs`).
/// `ln p(t) = (x_t − m) − ln Σ exp(x − m)` in f64 with this module's [`exp_f64`] / [`ln_f64`],
/// `m` the row's largest logit, summed in the order of [`LOGPROB_LANES`]; rounded to f32 once.
/// `top_n` (at most [`MAX_TOP_LOGPROBS`]) alternatives are listed.
pub fn token_logprobs(
    logits: &[f32],
    allowed: Option<&AllowedTokens>,
    token: u32,
    top_n: usize,
) -> Result<TokenLogprobs, MaskError> {
    if let Some(allowed) = allowed {
        allowed.check_row(logits.len())?;
    }
    // Tokens of non-zero probability (NaN compares false).
    let kept =
        |t: usize| logits[t] > f32::NEG_INFINITY && allowed.is_none_or(|a| a.is_allowed(t as u32));
    let max = (0..logits.len())
        .filter(|&t| kept(t))
        .map(|t| logits[t])
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Err(MaskError::NothingAllowed {
            vocab: logits.len(),
        });
    }
    let max = f64::from(max);
    let mut lanes = vec![0.0f64; LOGPROB_LANES];
    for t in (0..logits.len()).filter(|&t| kept(t)) {
        lanes[t % LOGPROB_LANES] += exp_f64(f64::from(logits[t]) - max);
    }
    let mut half = LOGPROB_LANES / 2;
    while half > 0 {
        for i in 0..half {
            lanes[i] += lanes[i + half];
        }
        half /= 2;
    }
    let ln_total = ln_f64(lanes[0]);
    let logprob = |t: usize| {
        if kept(t) {
            ((f64::from(logits[t]) - max) - ln_total) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32)
        .filter(|&t| kept(t as usize))
        .collect();
    let by_logit_desc = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let top_n = top_n.min(MAX_TOP_LOGPROBS).min(ids.len());
    if top_n > 0 && top_n < ids.len() {
        ids.select_nth_unstable_by(top_n - 1, by_logit_desc);
    }
    ids.truncate(top_n);
    ids.sort_unstable_by(by_logit_desc);
    Ok(TokenLogprobs {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |_| logprob(token as usize)),
        top: ids.into_iter().map(|t| (t, logprob(t as usize))).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` test logits in a fixed scrambled order: `(i · mul mod modulus) / scale`.
    fn scrambled_logits(len: usize, (mul, modulus): (usize, usize), scale: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * mul % modulus) as f32) / scale)
            .collect()
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    /// Distance in ulps between two finite positive f64 values.
    fn ulps(a: f64, b: f64) -> u64 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn ln_is_within_two_ulps_of_libm() {
        let mut worst = 0;
        let mut x = 1e-300f64;
        while x < 1e300 {
            for scale in [1.0, 1.1, 1.37, 1.41, 1.42, 1.9999] {
                let v = x * scale;
                if (v - 1.0).abs() > 1e-3 {
                    worst = worst.max(ulps(ln_f64(v), v.ln()));
                }
            }
            x *= 3.7;
        }
        // Near 1 the result is tiny and relative ulps matter less; the noise's inner ln is there.
        for u in [1.0 - 2f64.powi(-53), 0.999_999, 1.000_001, 0.5, 2.0] {
            assert!(
                (ln_f64(u) - u.ln()).abs() <= 2.0 * f64::EPSILON * u.ln().abs(),
                "{u}"
            );
        }
        assert!(worst <= 2, "ln_f64 is {worst} ulps from libm");
        assert_eq!(ln_f64(1.0), 0.0);
        assert_eq!(ln_f64(0.0), f64::NEG_INFINITY);
        assert!(ln_f64(-1.0).is_nan());
        assert!(
            (ln_f64(5e-324) - (5e-324f64).ln()).abs() < 1e-12,
            "subnormal input"
        );
    }

    #[test]
    fn exp_is_within_two_ulps_of_libm() {
        let mut worst = 0;
        let mut x = -708.0f64;
        while x < 709.0 {
            worst = worst.max(ulps(exp_f64(x), x.exp()));
            x += 0.137_731;
        }
        assert!(worst <= 2, "exp_f64 is {worst} ulps from libm");
        assert_eq!(exp_f64(0.0), 1.0);
        assert_eq!(exp_f64(-1000.0), 0.0);
        assert_eq!(exp_f64(f64::NEG_INFINITY), 0.0);
        assert!(exp_f64(f64::NAN).is_nan());
        // Subnormal results stay close to the true value.
        assert!((exp_f64(-740.0) - (-740.0f64).exp()).abs() <= 2.0 * 5e-324);
    }

    #[test]
    fn greedy_takes_the_argmax_and_the_lowest_tie() {
        assert_eq!(
            sample(&[0.1, 3.0, -1.0, 3.0], &SamplingParams::greedy(), 7),
            Some(1)
        );
        assert_eq!(
            sample(&[f32::NAN, -5.0, f32::NAN], &SamplingParams::greedy(), 0),
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
        let g = gumbel(1, 2, 3);
        let reference = -(-uniform(1, 2, 3).ln()).ln();
        assert!((g - reference).abs() < 1e-14, "{g} vs {reference}");
    }

    #[test]
    fn temperature_one_follows_the_softmax() {
        // logits ln(1), ln(2), ln(7): probabilities 0.1, 0.2, 0.7.
        let logits = [0.0f32, 2f32.ln(), 7f32.ln()];
        let n = 20_000;
        let mut counts = [0usize; 3];
        for position in 0..n {
            let token = sample(&logits, &params(1.0, 0, 1.0, 42), position);
            counts[token.map_or(0, |t| t as usize)] += 1;
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
            let t = sample(&logits, &params(1.0, 2, 1.0, 9), position);
            assert!(t < Some(2), "top_k=2 sampled {t:?}");
            let t = sample(&logits, &params(1.0, 0, 0.5, 9), position);
            assert!(t < Some(2), "top_p=0.5 sampled {t:?}");
        }
        // top_p tiny keeps only the best token.
        assert_eq!(sample(&logits, &params(1.0, 0, 1e-6, 3), 11), Some(0));
    }

    #[test]
    fn top_p_keeps_the_prefix_whose_share_reaches_it() {
        // Equal logits: shares 1/4 each; top_p 0.5 keeps exactly two (the lowest ids).
        let logits = [1.0f32; 4];
        let kept = kept_candidates(&logits, &params(1.0, 0, 0.5, 0), 1.0);
        assert_eq!(kept, Some(vec![0, 1]));
        let kept = kept_candidates(&logits, &params(1.0, 0, 0.500_001, 0), 1.0);
        assert_eq!(kept, Some(vec![0, 1, 2]));
        assert_eq!(kept_candidates(&logits, &params(1.0, 0, 1.0, 0), 1.0), None);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let logits = scrambled_logits(512, (37, 101), 50.0);
        let run = |seed| {
            (0..64)
                .map(|p| sample(&logits, &params(1.0, 0, 1.0, seed), p))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn allowed_tokens_are_a_bitset_whose_padding_is_never_allowed() {
        // Bits at or beyond the vocabulary (34) in the given words are cleared.
        let mask = AllowedTokens::from_words(34, &[0x8000_0001, u32::MAX, 7]);
        let mask = mask.expect("enough words");
        assert_eq!(mask.words(), &[0x8000_0001, 0b11]);
        assert_eq!(mask.allowed_count(), 4);
        assert!(mask.is_allowed(0) && mask.is_allowed(31) && mask.is_allowed(33));
        assert!(!mask.is_allowed(1) && !mask.is_allowed(34) && !mask.is_allowed(u32::MAX));
        assert_eq!(
            AllowedTokens::from_words(65, &[1, 2]),
            Err(MaskError::TooFewWords {
                vocab: 65,
                needed: 3,
                found: 2
            })
        );
        assert_eq!(AllowedTokens::from_tokens(34, &[0, 31, 32, 33, 40]), mask);
        // Applied to a wider row: the padding is disallowed too.
        let mut row: Vec<f32> = (0..40).map(|i| i as f32).collect();
        mask.apply(&mut row).expect("fits");
        for (t, &v) in row.iter().enumerate() {
            let kept = [0, 31, 32, 33].contains(&t);
            assert_eq!(v, if kept { t as f32 } else { f32::NEG_INFINITY }, "{t}");
        }
        assert_eq!(
            mask.apply(&mut [0.0; 33]),
            Err(MaskError::RowTooShort {
                vocab: 34,
                width: 33
            })
        );
        assert_eq!(mask.row_words(70), Ok(vec![0x8000_0001, 0b11, 0]));
        let nothing = AllowedTokens::from_tokens(10, &[12]);
        assert_eq!(
            nothing.check_row(10),
            Err(MaskError::NothingAllowed { vocab: 10 })
        );
    }

    #[test]
    fn a_masked_row_samples_as_the_row_with_its_disallowed_logits_at_minus_infinity() {
        let vocab = 300;
        let logits = scrambled_logits(vocab, (53, 97), 9.0);
        let masks = [
            AllowedTokens::from_tokens(vocab, &[17]),
            AllowedTokens::from_tokens(vocab, &[3, 90, 91, 250, 299]),
            AllowedTokens::from_tokens(
                vocab - 20,
                &(0..280).filter(|t| t % 7 != 0).collect::<Vec<u32>>(),
            ),
        ];
        let settings = [
            params(0.0, 0, 1.0, 0),
            params(1.0, 0, 1.0, 3),
            params(0.8, 40, 1.0, 4),
            params(1.3, 0, 0.7, 5),
            params(0.6, 3, 0.9, 6),
        ];
        let mut differs = 0;
        for mask in &masks {
            let mut masked = logits.clone();
            mask.apply(&mut masked).expect("fits");
            for p in &settings {
                for position in 0..40 {
                    let got = sample_allowed(&logits, p, position, Some(mask));
                    let token = got.expect("something allowed");
                    assert_eq!(Some(token), sample(&masked, p, position));
                    assert!(mask.is_allowed(token), "{token} is masked");
                    differs += usize::from(Some(token) != sample(&logits, p, position));
                }
            }
        }
        assert!(differs > 0, "the masks never changed a token");
        assert_eq!(
            sample_allowed(&logits, &settings[1], 9, None).ok(),
            sample(&logits, &settings[1], 9)
        );
        let nothing = AllowedTokens::from_tokens(vocab, &[]);
        assert_eq!(
            sample_allowed(&logits, &settings[0], 0, Some(&nothing)),
            Err(MaskError::NothingAllowed { vocab })
        );
    }

    #[test]
    fn the_cpu_backend_samples_masked_rows_and_names_a_bad_row() {
        use crate::backend::{
            Backend, CpuBackend, MaskedRows, RowSampling, SampleRowsError, Tensor,
        };
        let vocab = 64;
        let logits = scrambled_logits(3 * vocab, (29, 61), 7.0);
        let rows: Vec<RowSampling> = (0..3)
            .map(|r| RowSampling {
                params: params(
                    [0.0, 1.0, 0.7][r],
                    [0, 0, 5][r],
                    [1.0, 0.8, 1.0][r],
                    40 + r as u64,
                ),
                position: 100 + r as u64,
            })
            .collect();
        let one = AllowedTokens::from_tokens(vocab, &[5]);
        let few = AllowedTokens::from_tokens(vocab, &[1, 2, 60]);
        let allowed = [Some(&one), None, Some(&few)];
        let got = CpuBackend
            .sample_masked(MaskedRows {
                logits: &Tensor::from(logits.clone()),
                vocab,
                rows: &rows,
                allowed: &allowed,
            })
            .expect("fits");
        let expected: Vec<u32> = logits
            .chunks_exact(vocab)
            .zip(&rows)
            .zip(allowed)
            .map(|((row, r), mask)| {
                sample_allowed(row, &r.params, r.position, mask).expect("allowed")
            })
            .collect();
        assert_eq!(got, expected);
        assert_eq!(got[0], 5);
        assert!(few.is_allowed(got[2]));
        let nothing = AllowedTokens::from_tokens(vocab, &[]);
        let tensor = Tensor::from(logits);
        assert_eq!(
            CpuBackend.sample_masked(MaskedRows {
                logits: &tensor,
                vocab,
                rows: &rows,
                allowed: &[None, Some(&nothing), None]
            }),
            Err(SampleRowsError::Mask {
                row: 1,
                source: MaskError::NothingAllowed { vocab }
            })
        );
        assert_eq!(
            CpuBackend.sample_masked(MaskedRows {
                logits: &tensor,
                vocab,
                rows: &rows,
                allowed: &[None, None]
            }),
            Err(SampleRowsError::MaskCount { found: 2, rows: 3 })
        );
        let wide = AllowedTokens::from_tokens(vocab + 1, &[0]);
        assert!(matches!(
            CpuBackend.sample_masked(MaskedRows {
                logits: &tensor,
                vocab,
                rows: &rows,
                allowed: &[None, None, Some(&wide)]
            }),
            Err(SampleRowsError::Mask {
                row: 2,
                source: MaskError::RowTooShort { .. }
            })
        ));
    }

    /// `ln p` by the textbook formula, in f64 with libm: `x − max − ln Σ exp(x − max)`.
    fn log_softmax(row: &[f32]) -> Vec<f64> {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let total: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        row.iter().map(|&x| x as f64 - max - total.ln()).collect()
    }

    #[test]
    fn token_logprobs_are_the_log_softmax_of_the_row_with_its_best_tokens_in_order() {
        let vocab = 1000;
        let row: Vec<f32> = scrambled_logits(vocab, (7919, 1009), 37.0)
            .into_iter()
            .map(|logit| logit - 12.0)
            .collect();
        let expected = log_softmax(&row);
        // f32 rounding of values up to ~40 in magnitude: a few ulps at most.
        let close =
            |got: f32, want: f64| (f64::from(got) - want).abs() <= 4e-6 * want.abs().max(1.0);
        for token in [0u32, 17, 500, 999] {
            let got = token_logprobs(&row, None, token, 5).expect("a row");
            assert_eq!(got.token, token);
            assert!(
                close(got.logprob, expected[token as usize]),
                "{token}: {got:?}"
            );
            let mut by_prob: Vec<usize> = (0..vocab).collect();
            by_prob.sort_by(|&a, &b| expected[b].total_cmp(&expected[a]).then(a.cmp(&b)));
            let ids: Vec<u32> = got.top.iter().map(|&(t, _)| t).collect();
            assert_eq!(
                ids,
                by_prob[..5].iter().map(|&t| t as u32).collect::<Vec<_>>()
            );
            for &(t, lp) in &got.top {
                assert!(close(lp, expected[t as usize]), "top {t}: {lp}");
            }
        }
        let total: f64 = (0..vocab as u32)
            .map(|t| f64::from(token_logprobs(&row, None, t, 0).expect("row").logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "probabilities sum to {total}");
        assert!(
            token_logprobs(&row, None, 3, 0)
                .expect("row")
                .top
                .is_empty()
        );
        // At most MAX_TOP_LOGPROBS alternatives, whatever is asked.
        assert_eq!(
            token_logprobs(&row, None, 3, 1000).expect("row").top.len(),
            MAX_TOP_LOGPROBS
        );
    }

    #[test]
    fn token_logprobs_follow_the_mask_and_list_ties_by_id() {
        let row = [2.0f32, 5.0, 5.0, 1.0, f32::NAN, 5.0, f32::NEG_INFINITY];
        let got = token_logprobs(&row, None, 0, 3).expect("a row");
        assert_eq!(
            token_logprobs(&row, None, 0, 9).expect("row").top.len(),
            5,
            "p > 0 only"
        );
        // NaN counts as -inf: the rest is the softmax of [2, 5, 5, 1, 5].
        let expected = log_softmax(&[2.0, 5.0, 5.0, 1.0, 5.0]);
        assert_eq!(
            got.top.iter().map(|&(t, _)| t).collect::<Vec<_>>(),
            [1, 2, 5]
        );
        assert!((f64::from(got.logprob) - expected[0]).abs() < 1e-6);
        assert_eq!(
            token_logprobs(&row, None, 4, 0).expect("row").logprob,
            f32::NEG_INFINITY
        );
        // The mask renormalises over the allowed tokens and keeps only them in the list.
        let mask = AllowedTokens::from_tokens(7, &[0, 3]);
        let got = token_logprobs(&row, Some(&mask), 3, 5).expect("allowed");
        let expected = log_softmax(&[2.0, 1.0]);
        assert!(
            (f64::from(got.logprob) - expected[1]).abs() < 1e-6,
            "{got:?}"
        );
        assert_eq!(got.top.len(), 2);
        assert_eq!(got.top[0].0, 0);
        assert_eq!(
            token_logprobs(&row, Some(&mask), 1, 0)
                .expect("row")
                .logprob,
            f32::NEG_INFINITY
        );
        let nothing = AllowedTokens::from_tokens(7, &[]);
        assert_eq!(
            token_logprobs(&row, Some(&nothing), 0, 1),
            Err(MaskError::NothingAllowed { vocab: 7 })
        );
        assert!(token_logprobs(&[], None, 0, 1).is_err());
    }

    #[test]
    fn the_cpu_backend_reports_logprobs_of_masked_rows_and_names_a_bad_row() {
        use crate::backend::{
            Backend, CpuBackend, LogprobPick, MaskedRows, SampleRowsError, Tensor,
        };
        let vocab = 40;
        let logits = scrambled_logits(2 * vocab, (13, 29), 5.0);
        let few = AllowedTokens::from_tokens(vocab, &[3, 4, 30]);
        let picks = [
            LogprobPick { token: 7, top: 2 },
            LogprobPick { token: 30, top: 5 },
        ];
        let tensor = Tensor::from(logits.clone());
        let got = CpuBackend
            .token_logprobs_masked(MaskedRows {
                logits: &tensor,
                vocab,
                rows: &picks,
                allowed: &[None, Some(&few)],
            })
            .expect("fits");
        let expected = [
            token_logprobs(&logits[..vocab], None, 7, 2),
            token_logprobs(&logits[vocab..], Some(&few), 30, 5),
        ];
        assert_eq!(got, expected.map(|e| e.expect("row")));
        assert_eq!(got[1].top.len(), 3, "only the allowed tokens");
        let nothing = AllowedTokens::from_tokens(vocab, &[]);
        assert_eq!(
            CpuBackend.token_logprobs_masked(MaskedRows {
                logits: &tensor,
                vocab,
                rows: &picks,
                allowed: &[None, Some(&nothing)]
            }),
            Err(SampleRowsError::Mask {
                row: 1,
                source: MaskError::NothingAllowed { vocab }
            })
        );
        assert_eq!(
            CpuBackend.token_logprobs_masked(MaskedRows {
                logits: &tensor,
                vocab,
                rows: &picks[..1],
                allowed: &[None]
            }),
            Err(SampleRowsError::LogitsShape {
                found: 2 * vocab,
                rows: 1,
                vocab
            })
        );
    }

    #[test]
    fn validation_names_the_field() {
        let err = params(-1.0, 0, 1.0, 0).validate().err();
        assert!(err.is_some_and(|e| e.to_string().contains("temperature")));
        let err = params(1.0, 0, 0.0, 0).validate().err();
        assert!(err.is_some_and(|e| e.field == "top_p"));
        assert!(params(0.7, 40, 0.9, 1).validate().is_ok());
    }
}
