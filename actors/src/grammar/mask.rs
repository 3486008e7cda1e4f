//! The mask of one decoding position and how it is applied to logits: disallowed tokens get
//! -inf before temperature, top-k/p and sampling noise, so seeded sampling stays a pure function
//! of (seed, request, position). On the host ([`TokenMask::apply_to_logits`]) or, converted to
//! the model's [`AllowedTokens`] ([`StepMask::allowed_tokens`]), where the logits are (the
//! executor's device), with the same tokens as result.

use deepinfer_model::sampling::{AllowedTokens, MaskError};
use toktrie::{SimpleVob, TokenId};

use super::GrammarError;

/// The allowed tokens at one position: a bitset over the vocabulary (bit `t % 32` of word
/// `t / 32` is token `t`).
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask {
    bits: SimpleVob,
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenMask")
            .field("vocab_size", &self.bits.len())
            .field("allowed", &self.bits.num_set())
            .finish()
    }
}

impl TokenMask {
    pub(crate) fn from_vob(bits: SimpleVob) -> Self {
        Self { bits }
    }

    /// A mask over `vocab_size` tokens allowing exactly `allowed`.
    pub fn from_allowed(vocab_size: usize, allowed: &[TokenId]) -> Self {
        let mut bits = SimpleVob::alloc(vocab_size);
        for &t in allowed {
            if (t as usize) < vocab_size {
                bits.allow_token(t);
            }
        }
        Self { bits }
    }

    /// Number of tokens the mask covers.
    pub fn vocab_size(&self) -> usize {
        self.bits.len()
    }

    /// Is this token allowed?
    pub fn is_allowed(&self, token: TokenId) -> bool {
        (token as usize) < self.bits.len() && self.bits.is_allowed(token)
    }

    /// Number of allowed tokens.
    pub fn allowed_count(&self) -> usize {
        self.bits.num_set()
    }

    /// The allowed token ids, ascending.
    pub fn allowed_tokens(&self) -> Vec<TokenId> {
        self.bits.to_list()
    }

    /// The bitset words (for uploading the mask to the device).
    pub fn as_words(&self) -> &[u32] {
        self.bits.as_slice()
    }

    /// The same mask as the model's [`AllowedTokens`] (the bitset words copied, once per
    /// position), for sampling where the logits are.
    pub fn to_allowed_tokens(&self) -> Result<AllowedTokens, GrammarError> {
        AllowedTokens::from_words(self.bits.len(), self.bits.as_slice())
            .map_err(|e| GrammarError::Matcher(format!("mask bitset: {e}")))
    }

    /// Set every disallowed logit to -inf. `logits` may be wider than the vocabulary (padding);
    /// the padding is disallowed.
    pub fn apply_to_logits(&self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let vocab = self.bits.len();
        if logits.len() < vocab {
            return Err(GrammarError::LogitsTooShort {
                found: logits.len(),
                vocab,
            });
        }
        let (in_vocab, padding) = logits.split_at_mut(vocab);
        for (chunk, &word) in in_vocab.chunks_mut(32).zip(self.bits.as_slice()) {
            if word == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        padding.fill(f32::NEG_INFINITY);
        Ok(())
    }
}

/// The mask of one position of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepMask {
    /// No constraint here (no constraint at all, or the reasoning section in thinking mode).
    Unconstrained,
    /// Only these tokens.
    Allowed(TokenMask),
}

impl StepMask {
    /// Is this token allowed?
    pub fn is_allowed(&self, token: TokenId) -> bool {
        match self {
            Self::Unconstrained => true,
            Self::Allowed(mask) => mask.is_allowed(token),
        }
    }

    /// Apply to one row of logits (no-op when unconstrained).
    pub fn apply_to_logits(&self, logits: &mut [f32]) -> Result<(), GrammarError> {
        match self {
            Self::Unconstrained => Ok(()),
            Self::Allowed(mask) => mask.apply_to_logits(logits),
        }
    }

    /// The mask for sampling over logits rows of `width` tokens where they are: `None` when
    /// unconstrained. A mask wider than the row is [`GrammarError::LogitsTooShort`]; one that
    /// allows nothing is [`GrammarError::EmptyMask`] at `answer_position`.
    pub fn allowed_tokens(
        &self,
        width: usize,
        answer_position: usize,
    ) -> Result<Option<AllowedTokens>, GrammarError> {
        let Self::Allowed(mask) = self else {
            return Ok(None);
        };
        let allowed = mask.to_allowed_tokens()?;
        allowed.check_row(width).map_err(|e| match e {
            MaskError::NothingAllowed { .. } => GrammarError::EmptyMask {
                position: answer_position,
            },
            MaskError::RowTooShort { vocab, width } => GrammarError::LogitsTooShort {
                found: width,
                vocab,
            },
            other => GrammarError::Matcher(format!("mask bitset: {other}")),
        })?;
        Ok(Some(allowed))
    }

    /// The token mask, if constrained.
    pub fn token_mask(&self) -> Option<&TokenMask> {
        match self {
            Self::Unconstrained => None,
            Self::Allowed(mask) => Some(mask),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_sets_exactly_the_disallowed_logits_to_minus_infinity() {
        let mask = TokenMask::from_allowed(70, &[0, 31, 32, 33, 69]);
        let mut logits: Vec<f32> = (0..75).map(|i| i as f32).collect();
        mask.apply_to_logits(&mut logits).unwrap();
        for (t, &l) in logits.iter().enumerate() {
            if [0, 31, 32, 33, 69].contains(&t) {
                assert_eq!(l, t as f32, "allowed token {t} changed");
            } else {
                assert_eq!(
                    l,
                    f32::NEG_INFINITY,
                    "token {t} (disallowed or padding) kept"
                );
            }
        }
        assert_eq!(mask.allowed_count(), 5);
        assert_eq!(mask.allowed_tokens(), vec![0, 31, 32, 33, 69]);
        assert!(!mask.is_allowed(70));
    }

    /// The device path (the mask converted to the model's bitset, `Backend::sample_masked`, here
    /// the CPU reference) picks exactly the tokens of the host path (`apply_to_logits`, then
    /// `sample`): greedy, temperature, top-k and top-p, many seeds and positions, masks of one
    /// token, a few and most, over rows wider than the mask (padding).
    #[test]
    fn sampling_with_the_converted_mask_equals_the_host_path() {
        use deepinfer_model::backend::{Backend, CpuBackend, MaskedRows, RowSampling, Tensor};
        use deepinfer_model::sampling::{SamplingParams, sample};
        let (vocab, width) = (990usize, 1000usize);
        let logits: Vec<f32> = (0..width)
            .map(|i| ((i * 7919 % 1009) as f32) / 97.0 - 3.0)
            .collect();
        let most: Vec<TokenId> = (0..vocab as u32).filter(|t| t % 11 != 3).collect();
        let masks = [
            TokenMask::from_allowed(vocab, &[412]),
            TokenMask::from_allowed(vocab, &[0, 31, 32, 500, 989]),
            TokenMask::from_allowed(vocab, &most),
            TokenMask::from_allowed(vocab, &(0..vocab as u32).collect::<Vec<_>>()),
        ];
        let settings = [
            (0.0f32, 0usize, 1.0f32),
            (1.0, 0, 1.0),
            (0.7, 20, 1.0),
            (1.2, 0, 0.8),
            (0.9, 50, 0.95),
        ];
        let (mut rows, mut host, mut allowed) = (Vec::new(), Vec::new(), Vec::new());
        let mut values = Vec::new();
        for (m, mask) in masks.iter().enumerate() {
            let converted = StepMask::Allowed(mask.clone())
                .allowed_tokens(width, 0)
                .expect("fits")
                .expect("constrained");
            for (i, &(temperature, top_k, top_p)) in settings.iter().enumerate() {
                for seed in 0..12u64 {
                    let params = SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        seed: seed * 1_000_003 + (m * 10 + i) as u64,
                    };
                    let position = 7 + seed * 13;
                    let mut row = logits.clone();
                    mask.apply_to_logits(&mut row).expect("fits");
                    host.push(sample(&row, &params, position).expect("a token"));
                    rows.push(RowSampling { params, position });
                    allowed.push(converted.clone());
                    values.extend_from_slice(&logits);
                }
            }
        }
        let refs: Vec<_> = allowed.iter().map(Some).collect();
        let device = CpuBackend
            .sample_masked(MaskedRows {
                logits: &Tensor::from(values),
                vocab: width,
                rows: &rows,
                allowed: &refs,
            })
            .expect("masks fit");
        assert_eq!(device, host);
        assert_eq!(device.len(), 4 * 5 * 12);
        assert!(device[..60].iter().all(|&t| t == 412), "the one-token mask");
        let unmasked: Vec<u32> = rows
            .iter()
            .map(|r| sample(&logits, &r.params, r.position).expect("a token"))
            .collect();
        assert_ne!(device, unmasked, "the masks change tokens");
    }

    #[test]
    fn a_mask_that_allows_nothing_or_is_too_wide_is_an_error() {
        let nothing = StepMask::Allowed(TokenMask::from_allowed(64, &[]));
        assert!(matches!(
            nothing.allowed_tokens(64, 9),
            Err(GrammarError::EmptyMask { position: 9 })
        ));
        let mask = StepMask::Allowed(TokenMask::from_allowed(64, &[3]));
        assert!(matches!(
            mask.allowed_tokens(63, 0),
            Err(GrammarError::LogitsTooShort {
                found: 63,
                vocab: 64
            })
        ));
        assert_eq!(
            StepMask::Unconstrained.allowed_tokens(10, 0).ok(),
            Some(None)
        );
    }

    #[test]
    fn full_words_are_left_alone_and_short_logits_are_an_error() {
        let all: Vec<TokenId> = (0..64).collect();
        let mask = TokenMask::from_allowed(64, &all);
        let mut logits = vec![1.5f32; 64];
        mask.apply_to_logits(&mut logits).unwrap();
        assert!(logits.iter().all(|&l| l == 1.5));
        let err = mask.apply_to_logits(&mut [0.0; 63]).unwrap_err();
        assert!(matches!(
            err,
            GrammarError::LogitsTooShort {
                found: 63,
                vocab: 64
            }
        ));
        let mut row = vec![2.0f32; 10];
        StepMask::Unconstrained.apply_to_logits(&mut row).unwrap();
        assert!(row.iter().all(|&l| l == 2.0));
    }
}
