//! The `ReplayActor`'s state machine (no ractor, no tokio): one bounded suffix per admitted
//! request.
//!
//! Owns: the validated [`ReplayBound`] of the served model on this topology and, per request,
//! the decoder suffix planned at admission (where the decoder layers start in the prompt) and
//! the [`RewindCursor`] that says what a rewind after a rejected draft may undo. Admission plans
//! the suffix; `written` / `commit` follow the sequence as it grows; a rewind is validated
//! (past the bound, into accepted tokens or forward: an error that changes nothing, never a
//! silent truncation); `finish` frees the request.

use std::collections::HashMap;

use deepinfer_topology::{ReplayConfig, RequestId};

use super::suffix::{DecoderSuffix, ReplayBound, ReplayError, RewindCursor};

/// What the actor keeps for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestSuffix {
    /// The prompt positions the decoder layers run on.
    pub suffix: DecoderSuffix,
    /// The sequence's length, its accepted part and what a rewind may undo.
    pub cursor: RewindCursor,
}

impl RequestSuffix {
    /// The first prompt position the decoder layers run on (`StepEntry::decoder_from`'s
    /// `decoder_from`).
    pub fn decoder_from(&self) -> u32 {
        self.suffix.start
    }

    /// The oldest position a next query or a full rewind still needs from the window rings.
    pub fn oldest_needed_position(&self) -> u32 {
        self.cursor.oldest_ring_position()
    }
}

/// Counts for tests and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplayStats {
    /// Requests admitted and not finished.
    pub live: usize,
    /// Prompt tokens the decoder layers skipped, over every admitted request.
    pub skipped_prompt_tokens: u64,
    /// Rewinds applied.
    pub rewinds: u64,
    /// Requests refused at admission, rewinds refused, updates of unknown requests.
    pub refused: u64,
    /// The lengths the finished requests had when they were freed, summed: what the actor was
    /// told the ranks hold (tests compare it with the ranks' own sequence lengths).
    pub finished_positions: u64,
}

/// The bounded suffixes of every live request of one engine.
#[derive(Debug, Clone)]
pub struct ReplayState {
    bound: ReplayBound,
    requests: HashMap<RequestId, RequestSuffix>,
    stats: ReplayStats,
}

impl ReplayState {
    /// A state over an already validated bound.
    pub fn new(bound: ReplayBound) -> Self {
        ReplayState {
            bound,
            requests: HashMap::new(),
            stats: ReplayStats::default(),
        }
    }

    /// Validates the topology's `[replay]` against the model: `keep >= window +
    /// max_backtracking`, and `max_backtracking` within what the model's window rings can undo
    /// (`model_backtrack`, the model's `MAX_BACKTRACK`).
    pub fn for_model(
        config: &ReplayConfig,
        window: usize,
        model_backtrack: usize,
    ) -> Result<Self, ReplayError> {
        let window = u32::try_from(window).map_err(|_| ReplayError::WindowTooLarge(window))?;
        if usize::try_from(config.max_backtracking).map_or(true, |b| b > model_backtrack) {
            return Err(ReplayError::BacktrackingBeyondModel {
                configured: config.max_backtracking,
                model: model_backtrack,
            });
        }
        Ok(Self::new(ReplayBound::from_config(config, window)?))
    }

    /// The validated bound.
    pub fn bound(&self) -> ReplayBound {
        self.bound
    }

    /// Plans the decoder suffix of a new request with a `prompt_len`-token prompt.
    pub fn admit(&mut self, id: RequestId, prompt_len: u32) -> Result<DecoderSuffix, ReplayError> {
        let refused = if prompt_len == 0 {
            Some(ReplayError::EmptyPrompt(id))
        } else if self.requests.contains_key(&id) {
            Some(ReplayError::DuplicateRequest(id))
        } else {
            None
        };
        if let Some(error) = refused {
            self.stats.refused += 1;
            return Err(error);
        }
        let suffix = self.bound.plan_prefill(prompt_len);
        let cursor = RewindCursor::after_prefill(self.bound, prompt_len);
        self.requests.insert(id, RequestSuffix { suffix, cursor });
        self.stats.live = self.requests.len();
        self.stats.skipped_prompt_tokens += u64::from(suffix.skipped_tokens());
        Ok(suffix)
    }

    /// What the actor holds for `id`.
    pub fn get(&self, id: RequestId) -> Option<&RequestSuffix> {
        self.requests.get(&id)
    }

    fn request_mut(&mut self, id: RequestId) -> Result<&mut RequestSuffix, ReplayError> {
        match self.requests.get_mut(&id) {
            Some(request) => Ok(request),
            None => {
                self.stats.refused += 1;
                Err(ReplayError::UnknownRequest(id))
            }
        }
    }

    /// Records `count` positions written past the prompt (a decode token, or the anchor plus
    /// drafts of a verify step); returns the new length.
    pub fn written(&mut self, id: RequestId, count: u32) -> Result<u32, ReplayError> {
        let request = self.request_mut(id)?;
        request.cursor.write(count);
        Ok(request.cursor.len())
    }

    /// Marks the first `len` positions of `id` as accepted; returns the committed length.
    pub fn commit(&mut self, id: RequestId, len: u32) -> Result<u32, ReplayError> {
        let request = self.request_mut(id)?;
        request.cursor.commit(len);
        Ok(request.cursor.committed())
    }

    /// Rewinds `id` to `to` positions after a rejected draft. A rewind beyond
    /// `max_backtracking`, into accepted positions or forward is refused and changes nothing.
    pub fn rewind(&mut self, id: RequestId, to: u32) -> Result<(), ReplayError> {
        let request = self.request_mut(id)?;
        match request.cursor.rewind_to(to) {
            Ok(()) => {
                self.stats.rewinds += 1;
                Ok(())
            }
            Err(error) => {
                self.stats.refused += 1;
                Err(error)
            }
        }
    }

    /// Frees `id` (finished, aborted or failed); `None` if it was not admitted.
    pub fn finish(&mut self, id: RequestId) -> Option<RequestSuffix> {
        let request = self.requests.remove(&id);
        self.stats.live = self.requests.len();
        if let Some(request) = &request {
            self.stats.finished_positions += u64::from(request.cursor.len());
        }
        request
    }

    /// Current counts.
    pub fn stats(&self) -> ReplayStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(keep: Option<u32>, max_backtracking: u32) -> ReplayConfig {
        ReplayConfig {
            decoder_keep_tokens: keep,
            max_backtracking,
        }
    }

    fn state() -> ReplayState {
        ReplayState::for_model(&config(Some(140), 6), 128, 6).expect("default bound")
    }

    #[test]
    fn admission_plans_the_decoder_start_from_the_prompt_length() {
        let mut state = state();
        let long = state.admit(RequestId(1), 1000).expect("admitted");
        assert_eq!((long.start, long.prompt_len), (860, 1000));
        let short = state.admit(RequestId(2), 90).expect("admitted");
        assert_eq!(short.start, 0);
        let held = state.get(RequestId(1)).expect("held");
        assert_eq!(held.decoder_from(), 860);
        assert_eq!(held.cursor.len(), 1000);
        assert_eq!(held.oldest_needed_position(), 1000 - 134);
        assert_eq!(
            state.stats(),
            ReplayStats {
                live: 2,
                skipped_prompt_tokens: 860,
                rewinds: 0,
                refused: 0,
                finished_positions: 0,
            }
        );
    }

    #[test]
    fn bad_bounds_are_refused_when_the_model_is_known() {
        assert_eq!(
            ReplayState::for_model(&config(Some(133), 6), 128, 6).unwrap_err(),
            ReplayError::KeepTooSmall {
                keep: 133,
                window: 128,
                max_backtracking: 6
            }
        );
        assert_eq!(
            ReplayState::for_model(&config(Some(140), 7), 128, 6).unwrap_err(),
            ReplayError::BacktrackingBeyondModel {
                configured: 7,
                model: 6
            }
        );
        assert_eq!(
            ReplayState::for_model(&config(Some(140), 6), usize::MAX, 6).unwrap_err(),
            ReplayError::WindowTooLarge(usize::MAX)
        );
        let off = ReplayState::for_model(&config(None, 6), 128, 6).expect("replay off");
        assert_eq!(off.bound().keep(), None);
    }

    #[test]
    fn admission_refuses_empty_and_duplicate_requests() {
        let mut state = state();
        assert_eq!(
            state.admit(RequestId(3), 0),
            Err(ReplayError::EmptyPrompt(RequestId(3)))
        );
        state.admit(RequestId(3), 10).expect("admitted");
        assert_eq!(
            state.admit(RequestId(3), 10),
            Err(ReplayError::DuplicateRequest(RequestId(3)))
        );
        assert_eq!(state.stats().refused, 2);
        assert_eq!(state.stats().live, 1);
    }

    #[test]
    fn rejected_draft_rewinds_within_the_bound_and_refuses_beyond_it() {
        let mut state = state();
        let id = RequestId(4);
        state.admit(id, 300).expect("admitted");
        // A verify step: anchor + 5 drafts written, anchor + 1 draft accepted.
        assert_eq!(state.written(id, 6), Ok(306));
        assert_eq!(state.commit(id, 302), Ok(302));
        state
            .rewind(id, 302)
            .expect("rewind of the 4 rejected drafts");
        assert_eq!(state.get(id).map(|r| r.cursor.len()), Some(302));
        // Seven speculative positions: one more than the rings can undo.
        state.written(id, 7).expect("written");
        assert_eq!(
            state.rewind(id, 302),
            Err(ReplayError::RewindPastBound {
                requested: 7,
                max_backtracking: 6
            })
        );
        assert_eq!(
            state.get(id).map(|r| r.cursor.len()),
            Some(309),
            "a refused rewind changes nothing"
        );
        assert_eq!(
            state.rewind(id, 301),
            Err(ReplayError::RewindBelowCommitted {
                to: 301,
                committed: 302
            })
        );
        assert_eq!((state.stats().rewinds, state.stats().refused), (1, 2));
    }

    #[test]
    fn finish_frees_and_later_updates_are_errors() {
        let mut state = state();
        let id = RequestId(5);
        state.admit(id, 20).expect("admitted");
        state.written(id, 3).expect("written");
        assert!(state.finish(id).is_some());
        assert_eq!(state.stats().live, 0);
        assert_eq!(state.stats().finished_positions, 23);
        assert!(state.finish(id).is_none());
        assert_eq!(state.stats().finished_positions, 23);
        assert_eq!(state.written(id, 1), Err(ReplayError::UnknownRequest(id)));
        assert_eq!(state.rewind(id, 20), Err(ReplayError::UnknownRequest(id)));
        assert_eq!(state.commit(id, 20), Err(ReplayError::UnknownRequest(id)));
    }
}
