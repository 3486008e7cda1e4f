//! One request's constraint state: the mask for the next position, advancing with each accepted
//! token, rollback and per-position masks for speculative (DSpark) drafts, and the thinking gate
//! that leaves the reasoning section unconstrained.

use toktrie::TokenId;

use super::{GrammarError, SpecialTokens, StepMask, TokenMask};

/// Where the constraint begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConstraintStart {
    /// At the first generated token.
    Answer,
    /// After the model closes its reasoning with `</think>` (the prompt ended in `<think>`).
    AfterReasoning,
}

/// Per-request matcher. Not shared: move it to a mask worker and back ([`super::MaskWorkers`]).
#[derive(Clone)]
pub struct GrammarMatcher {
    inner: llguidance::Matcher,
    special: SpecialTokens,
    vocab_size: usize,
    in_reasoning: bool,
    /// Tokens consumed in the reasoning section, its closing `</think>` included.
    reasoning_tokens: usize,
    /// Tokens consumed under the constraint, a final EOS included.
    answer_tokens: usize,
    /// The final EOS came after llguidance had already stopped, so llguidance never saw it.
    eos_outside_parser: bool,
    /// The last consumed token was EOS: the request is over.
    finished: bool,
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("in_reasoning", &self.in_reasoning)
            .field("reasoning_tokens", &self.reasoning_tokens)
            .field("answer_tokens", &self.answer_tokens)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl GrammarMatcher {
    pub(crate) fn new(
        inner: llguidance::Matcher,
        start: ConstraintStart,
        special: SpecialTokens,
        vocab_size: usize,
    ) -> Self {
        Self {
            inner,
            special,
            vocab_size,
            in_reasoning: start == ConstraintStart::AfterReasoning,
            reasoning_tokens: 0,
            answer_tokens: 0,
            eos_outside_parser: false,
            finished: false,
        }
    }

    /// Still in the unconstrained reasoning section?
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// Tokens consumed since the matcher started (reasoning and answer).
    pub fn consumed(&self) -> usize {
        self.reasoning_tokens + self.answer_tokens
    }

    /// Tokens consumed under the constraint.
    pub fn answer_tokens(&self) -> usize {
        self.answer_tokens
    }

    /// The last consumed token was EOS.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Would EOS be allowed now (the answer so far is complete)? Always true while reasoning.
    pub fn is_accepting(&mut self) -> bool {
        if self.in_reasoning || self.finished {
            return true;
        }
        self.inner.is_stopped() || self.inner.is_accepting().unwrap_or(false)
    }

    /// A copy that evolves independently (for a draft branch).
    pub fn fork(&self) -> Self {
        self.clone()
    }

    /// The mask for the next position. While reasoning it is [`StepMask::Unconstrained`]; once the
    /// constraint is complete and nothing may follow, only EOS is allowed.
    pub fn compute_mask(&mut self) -> Result<StepMask, GrammarError> {
        if self.in_reasoning {
            return Ok(StepMask::Unconstrained);
        }
        if self.finished || self.eos_outside_parser {
            return Ok(self.eos_only());
        }
        let bits = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        if bits.is_zero() {
            return Err(GrammarError::EmptyMask {
                position: self.answer_tokens,
            });
        }
        Ok(StepMask::Allowed(TokenMask::from_vob(bits)))
    }

    /// Advance with an accepted token. A token the constraint does not allow is an error and
    /// leaves the state unchanged.
    pub fn advance(&mut self, token: TokenId) -> Result<(), GrammarError> {
        if self.finished && token == self.special.eos {
            // A step planned before the end was known (async scheduling) samples EOS again.
            return Ok(());
        }
        if self.finished {
            return Err(GrammarError::Matcher(format!(
                "token {token} after the end of the sequence"
            )));
        }
        if self.in_reasoning {
            self.reasoning_tokens += 1;
            if token == self.special.think_end {
                self.in_reasoning = false;
            }
            self.finished = token == self.special.eos;
            return Ok(());
        }
        let rejected = GrammarError::TokenRejected {
            token,
            position: self.answer_tokens,
        };
        if token == self.special.eos {
            if self.inner.is_stopped() && !self.inner.is_error() {
                self.eos_outside_parser = true;
            } else if self.inner.is_accepting().unwrap_or(false) {
                self.inner
                    .consume_token(token)
                    .map_err(|e| GrammarError::Matcher(e.to_string()))?;
            } else {
                return Err(rejected);
            }
            self.answer_tokens += 1;
            self.finished = true;
            return Ok(());
        }
        let consumed = self
            .inner
            .try_consume_tokens(&[token])
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        if consumed == 0 {
            return Err(rejected);
        }
        self.answer_tokens += 1;
        Ok(())
    }

    /// Advance with several accepted tokens; stops at the first error (earlier tokens stay
    /// consumed).
    pub fn advance_all(&mut self, tokens: &[TokenId]) -> Result<(), GrammarError> {
        tokens.iter().try_for_each(|&t| self.advance(t))
    }

    /// Undo the last `n` consumed tokens (rejected draft positions). Rolling back over `</think>`
    /// returns to the unconstrained reasoning section.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if n == 0 {
            return Ok(());
        }
        let available = self.consumed();
        if n > available {
            return Err(GrammarError::Rollback {
                requested: n,
                available,
            });
        }
        let from_answer = n.min(self.answer_tokens);
        let mut parser_tokens = from_answer;
        if from_answer > 0 && self.eos_outside_parser {
            self.eos_outside_parser = false;
            parser_tokens -= 1;
        }
        self.inner
            .rollback(parser_tokens)
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        self.answer_tokens -= from_answer;
        let from_reasoning = n - from_answer;
        if from_reasoning > 0 {
            self.reasoning_tokens -= from_reasoning;
            self.in_reasoning = true;
        }
        self.finished = false;
        Ok(())
    }

    /// Masks for verifying a speculative draft: `masks[i]` is the mask of the position of
    /// `draft[i]`, and the last one is the mask after the accepted prefix (the bonus position).
    /// Stops after the first draft token the constraint rejects (its mask is the last) or after an
    /// EOS (no later position). The matcher's state is unchanged afterwards.
    pub fn draft_masks(&mut self, draft: &[TokenId]) -> Result<Vec<StepMask>, GrammarError> {
        let mut masks = Vec::with_capacity(draft.len() + 1);
        let mut advanced = 0;
        let walk = (|| {
            for &token in draft {
                let mask = self.compute_mask()?;
                let allowed = mask.is_allowed(token);
                masks.push(mask);
                if !allowed {
                    return Ok(());
                }
                self.advance(token)?;
                advanced += 1;
                if self.finished {
                    return Ok(());
                }
            }
            masks.push(self.compute_mask()?);
            Ok(())
        })();
        self.rollback(advanced)?;
        walk.map(|()| masks)
    }

    fn eos_only(&self) -> StepMask {
        StepMask::Allowed(TokenMask::from_allowed(
            self.vocab_size,
            &[self.special.eos],
        ))
    }
}
