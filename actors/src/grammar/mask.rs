//! The mask of one decoding position and how it is applied to logits: disallowed tokens get
//! -inf before temperature, top-k/p and sampling noise, so seeded sampling stays a pure function
//! of (seed, request, position).

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
