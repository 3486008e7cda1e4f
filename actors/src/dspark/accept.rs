//! Lossless acceptance of a verified DSpark block (anchor + drafts).
//!
//! The target model scores the anchor and the `n` verified drafts in one forward; row `i` is the
//! distribution `p_i` of the token at position `first_position + i`. Walking the rows in order,
//! the rank samples `x_i` from row `i` exactly as a non-speculative decode would (the request's
//! sampling parameters and its seeded noise at that position), accepts draft `i` iff it equals
//! `x_i`, and stops at the first mismatch, whose `x_i` is the bonus token. So the produced tokens
//! are, token for token, those decoding without DSpark produces: greedy output is unchanged and
//! seeded sampled output does not depend on how many drafts were verified (hence on timing).
//!
//! This is the standard speculative rule for DSpark's drafts, which are greedy (the draft
//! distribution `q` is a point mass on the draft `d`): the rule accepts with probability
//! `min(1, p(d)/q(d)) = p(d)` and otherwise samples from `norm(max(0, p - q))`, i.e. from `p`
//! without `d`. A single Gumbel-max draw `x ~ p` realises both at once: `P(x = d) = p(d)`, and
//! given `x != d`, `x` is distributed as `p` restricted to the other tokens, renormalised.

use crate::sampling::{SamplingParams, sample};

/// What a verified block produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedBlock {
    /// Accepted drafts followed by the bonus token (`accepted + 1` tokens).
    pub tokens: Vec<u32>,
    /// Drafts accepted.
    pub accepted: usize,
}

/// Why a block could not be judged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AcceptError {
    #[error("verify rows: {rows} values for {drafts} drafts + anchor at vocabulary {vocab}")]
    RowShape {
        rows: usize,
        drafts: usize,
        vocab: usize,
    },
}

/// Judges `drafts` against the target `rows` (`[drafts.len() + 1, vocab]`, the anchor's row
/// first); `first_position` is the absolute position of the token row 0 predicts.
pub fn accept_block(
    rows: &[f32],
    vocab: usize,
    drafts: &[u32],
    params: &SamplingParams,
    first_position: u64,
) -> Result<AcceptedBlock, AcceptError> {
    if vocab == 0 || rows.len() != (drafts.len() + 1) * vocab {
        return Err(AcceptError::RowShape {
            rows: rows.len(),
            drafts: drafts.len(),
            vocab,
        });
    }
    // `vocab > 0`, so a row is never empty and `sample` always picks a token; rows past the first
    // mismatch are not needed.
    let mut sampled = Vec::with_capacity(drafts.len() + 1);
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        let Some(token) = sample(row, params, first_position + i as u64) else {
            break;
        };
        sampled.push(token);
        if drafts.get(i) != Some(&token) {
            break;
        }
    }
    Ok(accept_sampled(drafts, &sampled))
}

/// Judges `drafts` against the tokens already sampled from their rows (`sampled[i]` from row `i`
/// at its position, as [`accept_block`] samples them, e.g. on the device): the drafts up to the
/// first mismatch, then that row's token as the bonus.
pub fn accept_sampled(drafts: &[u32], sampled: &[u32]) -> AcceptedBlock {
    let accepted = drafts
        .iter()
        .zip(sampled)
        .take_while(|(draft, token)| draft == token)
        .count();
    let tokens = sampled[..(accepted + 1).min(sampled.len())].to_vec();
    AcceptedBlock {
        accepted: tokens.len().saturating_sub(1),
        tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p: 1.0,
            seed,
        }
    }

    #[test]
    fn greedy_accepts_while_drafts_match_the_argmax() {
        // Argmaxes per row: 2, 0, 1.
        let rows = [0.0, 1.0, 5.0, 9.0, 1.0, 0.0, 0.0, 3.0, 1.0];
        let greedy = SamplingParams::greedy();
        let all = accept_block(&rows, 3, &[2, 0], &greedy, 10).unwrap();
        assert_eq!((all.tokens, all.accepted), (vec![2, 0, 1], 2));
        let second_wrong = accept_block(&rows, 3, &[2, 1], &greedy, 10).unwrap();
        assert_eq!(
            (second_wrong.tokens, second_wrong.accepted),
            (vec![2, 0], 1)
        );
        let first_wrong = accept_block(&rows, 3, &[0, 0], &greedy, 10).unwrap();
        assert_eq!((first_wrong.tokens, first_wrong.accepted), (vec![2], 0));
        assert_eq!(
            accept_block(&rows, 3, &[2], &greedy, 10),
            Err(AcceptError::RowShape {
                rows: 9,
                drafts: 1,
                vocab: 3
            })
        );
    }

    #[test]
    fn sampled_tokens_judge_drafts_as_their_rows_do() {
        // Every row sampled (as a device does for a whole verify): the same block as judging
        // the rows themselves.
        let sampled = [2, 0, 1];
        let all = accept_sampled(&[2, 0], &sampled);
        assert_eq!((all.tokens, all.accepted), (vec![2, 0, 1], 2));
        let second_wrong = accept_sampled(&[2, 1], &sampled);
        assert_eq!(
            (second_wrong.tokens, second_wrong.accepted),
            (vec![2, 0], 1)
        );
        let first_wrong = accept_sampled(&[0, 0], &sampled);
        assert_eq!((first_wrong.tokens, first_wrong.accepted), (vec![2], 0));
        let no_drafts = accept_sampled(&[], &sampled[..1]);
        assert_eq!((no_drafts.tokens, no_drafts.accepted), (vec![2], 0));
    }

    fn softmax(logits: &[f32]) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let e: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
        let total: f64 = e.iter().sum();
        e.iter().map(|x| x / total).collect()
    }

    /// Over many seeds, with a fixed draft `d` (a point-mass draft distribution `q`): the first
    /// token is distributed as `p`, the draft is accepted with probability
    /// `min(1, p(d)/q(d)) = p(d)`, and a rejection yields `norm(max(0, p - q))`.
    #[test]
    fn sampled_acceptance_keeps_the_target_distribution() {
        let logits = [0.3f32, 1.2, -0.4, 0.9, 0.0];
        let p = softmax(&logits);
        let vocab = logits.len();
        // Two rows: the second one is only reached after an accepted draft.
        let rows: Vec<f32> = logits.iter().chain(logits.iter()).copied().collect();
        let n = 40_000u64;
        for draft in [1u32, 2] {
            let mut first = vec![0u64; vocab];
            let mut rejected = vec![0u64; vocab];
            let mut accepted = 0u64;
            for seed in 0..n {
                let block = accept_block(&rows, vocab, &[draft], &params(1.0, 0, seed), 7).unwrap();
                first[block.tokens[0] as usize] += 1;
                if block.accepted == 1 {
                    accepted += 1;
                } else {
                    rejected[block.tokens[0] as usize] += 1;
                }
            }
            let bound = 4.0 * (0.25 / n as f64).sqrt();
            for (token, (&count, &target)) in first.iter().zip(&p).enumerate() {
                let f = count as f64 / n as f64;
                assert!(
                    (f - target).abs() < bound,
                    "draft {draft} token {token}: {f} vs {target}"
                );
            }
            let rate = accepted as f64 / n as f64;
            let expected_rate = p[draft as usize].min(1.0);
            assert!(
                (rate - expected_rate).abs() < bound,
                "acceptance {rate} vs {expected_rate}"
            );
            let rejections = (n - accepted) as f64;
            let residual_mass = 1.0 - p[draft as usize];
            for (token, &count) in rejected.iter().enumerate() {
                let target = if token == draft as usize {
                    0.0
                } else {
                    p[token] / residual_mass
                };
                let f = count as f64 / rejections;
                let bound = 4.0 * (0.25 / rejections).sqrt();
                assert!(
                    (f - target).abs() < bound,
                    "draft {draft} residual token {token}: {f} vs {target}"
                );
            }
        }
    }

    #[test]
    fn top_k_is_respected_and_seeds_are_deterministic() {
        let logits = [2.0f32, 1.9, 1.8, -1.0];
        let rows: Vec<f32> = logits.repeat(3);
        for seed in 0..2000 {
            let a = accept_block(&rows, 4, &[0, 1], &params(1.0, 2, seed), 3).unwrap();
            assert!(a.tokens.iter().all(|&t| t < 2), "{a:?}");
            let b = accept_block(&rows, 4, &[0, 1], &params(1.0, 2, seed), 3).unwrap();
            assert_eq!(a, b);
        }
    }
}
