//! Decoder bounded replay: which prompt positions the decoder layers run on during prefill
//! (the last `keep` tokens), which keys a kept query may read (its window cut at the kept
//! suffix), and the rewind bound (a rewind beyond what the window rings keep is an error,
//! never a silent truncation).
//!
//! Rule (DeepInfer's assertion): `keep >= window + max_backtracking`, so that after the
//! largest allowed rewind the decoder still holds a full window of real keys.

use std::ops::Range;

use deepinfer_topology::{ReplayConfig, RequestId};

/// A bound or a rewind that the replay rule refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    /// The sliding window is zero.
    #[error("replay: the sliding window must be >= 1 token")]
    ZeroWindow,
    /// The kept suffix cannot hold a window plus a full rewind.
    #[error(
        "replay.decoder_keep_tokens: {keep} is below sliding window {window} + \
         replay.max_backtracking {max_backtracking} = {}",
        u64::from(*window) + u64::from(*max_backtracking)
    )]
    KeepTooSmall {
        /// Kept tokens.
        keep: u32,
        /// Sliding window (tokens).
        window: u32,
        /// Largest rewind (tokens).
        max_backtracking: u32,
    },
    /// A rewind longer than the rings keep.
    #[error("rewind of {requested} positions exceeds replay.max_backtracking = {max_backtracking}")]
    RewindPastBound {
        /// Positions asked to rewind.
        requested: u32,
        /// The bound.
        max_backtracking: u32,
    },
    /// A rewind into accepted (committed) positions.
    #[error("rewind to length {to} goes below the {committed} committed positions")]
    RewindBelowCommitted {
        /// The requested new length.
        to: u32,
        /// Positions already accepted.
        committed: u32,
    },
    /// A rewind to a length beyond the current one.
    #[error("rewind to length {to} is beyond the current length {len}")]
    RewindForward {
        /// The requested new length.
        to: u32,
        /// The current length.
        len: u32,
    },
    /// The model's window does not fit the bound's arithmetic.
    #[error("replay: the model's sliding window of {0} tokens exceeds u32")]
    WindowTooLarge(usize),
    /// The configured rewind is longer than the model's rings can undo.
    #[error(
        "replay.max_backtracking: {configured} exceeds the {model} positions the model's window \
         rings keep for a rewind"
    )]
    BacktrackingBeyondModel {
        /// `replay.max_backtracking`.
        configured: u32,
        /// The model's rewind capacity (`MAX_BACKTRACK`).
        model: usize,
    },
    /// A prompt of zero tokens cannot be planned.
    #[error("replay: request {0} has an empty prompt")]
    EmptyPrompt(RequestId),
    /// A request admitted twice.
    #[error("replay: request {0} is already admitted")]
    DuplicateRequest(RequestId),
    /// A request never admitted, or already finished.
    #[error("replay: request {0} is not admitted")]
    UnknownRequest(RequestId),
}

/// The validated replay bound of one model on one topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayBound {
    /// Prompt tail the decoder layers run on; `None` = bounded replay off.
    keep: Option<u32>,
    /// The model's sliding window (tokens, the current token included).
    window: u32,
    /// Largest rewind (tokens).
    max_backtracking: u32,
}

impl ReplayBound {
    /// Validates `keep >= window + max_backtracking` (when bounded replay is on).
    pub fn new(keep: Option<u32>, window: u32, max_backtracking: u32) -> Result<Self, ReplayError> {
        if window == 0 {
            return Err(ReplayError::ZeroWindow);
        }
        if let Some(keep) = keep
            && u64::from(keep) < u64::from(window) + u64::from(max_backtracking)
        {
            return Err(ReplayError::KeepTooSmall {
                keep,
                window,
                max_backtracking,
            });
        }
        Ok(Self {
            keep,
            window,
            max_backtracking,
        })
    }

    /// The bound from a topology's `[replay]` section and the model's window.
    pub fn from_config(config: &ReplayConfig, window: u32) -> Result<Self, ReplayError> {
        Self::new(config.decoder_keep_tokens, window, config.max_backtracking)
    }

    /// Kept tokens, `None` when bounded replay is off.
    pub fn keep(&self) -> Option<u32> {
        self.keep
    }

    /// The sliding window (tokens).
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Largest rewind (tokens).
    pub fn max_backtracking(&self) -> u32 {
        self.max_backtracking
    }

    /// Slots of each window ring: `window + max_backtracking`.
    pub fn ring_slots(&self) -> u32 {
        self.window.saturating_add(self.max_backtracking)
    }

    /// The decoder suffix of a prompt of `prompt_len` tokens.
    pub fn plan_prefill(&self, prompt_len: u32) -> DecoderSuffix {
        let start = match self.keep {
            Some(keep) => prompt_len.saturating_sub(keep),
            None => 0,
        };
        DecoderSuffix {
            start,
            prompt_len,
            window: self.window,
        }
    }
}

/// The prompt positions the decoder layers run on: `[start, prompt_len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderSuffix {
    /// First kept position (0 when the prompt is no longer than `keep`, or replay is off).
    pub start: u32,
    /// Prompt length (tokens).
    pub prompt_len: u32,
    /// The sliding window (tokens).
    window: u32,
}

impl DecoderSuffix {
    /// Prompt positions the decoder layers skip.
    pub fn skipped_tokens(&self) -> u32 {
        self.start
    }

    /// Positions of the prefill chunk `chunk` (clamped to the prompt) the decoder layers
    /// run on; empty when the chunk lies before the suffix.
    pub fn decoder_rows(&self, chunk: Range<u32>) -> Range<u32> {
        let end = chunk.end.min(self.prompt_len);
        let start = chunk.start.max(self.start).min(end);
        start..end
    }

    /// Keys a kept query at `position` reads in a decoder layer: its window
    /// `[position + 1 - window, position]` cut at the suffix start. Keys before the suffix
    /// are never read.
    pub fn decoder_window(&self, position: u32) -> Range<u32> {
        let end = position.saturating_add(1);
        end.saturating_sub(self.window).max(self.start)..end
    }
}

/// The decoder-side length of one sequence and what a rewind may undo: positions past the
/// committed length may be rewound by at most `max_backtracking` in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewindCursor {
    bound: ReplayBound,
    len: u32,
    committed: u32,
}

impl RewindCursor {
    /// The cursor after a prefill of `prompt_len` tokens (all committed).
    pub fn after_prefill(bound: ReplayBound, prompt_len: u32) -> Self {
        Self {
            bound,
            len: prompt_len,
            committed: prompt_len,
        }
    }

    /// Positions written (committed or speculative).
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True when nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions accepted for good.
    pub fn committed(&self) -> u32 {
        self.committed
    }

    /// Records `count` speculatively written positions (anchor plus drafts of a verify step).
    pub fn write(&mut self, count: u32) {
        self.len = self.len.saturating_add(count);
    }

    /// Marks the first `len` positions as accepted (never beyond what was written).
    pub fn commit(&mut self, len: u32) {
        self.committed = self.committed.max(len.min(self.len));
    }

    /// Rewinds to `to` positions. Fails, changing nothing, when `to` is beyond the current
    /// length, below the committed length, or more than `max_backtracking` back.
    pub fn rewind_to(&mut self, to: u32) -> Result<(), ReplayError> {
        if to > self.len {
            return Err(ReplayError::RewindForward { to, len: self.len });
        }
        if to < self.committed {
            return Err(ReplayError::RewindBelowCommitted {
                to,
                committed: self.committed,
            });
        }
        let requested = self.len - to;
        if requested > self.bound.max_backtracking {
            return Err(ReplayError::RewindPastBound {
                requested,
                max_backtracking: self.bound.max_backtracking,
            });
        }
        self.len = to;
        Ok(())
    }

    /// The oldest position still held by the window rings (`len - ring_slots`, floored at 0).
    pub fn oldest_ring_position(&self) -> u32 {
        self.len.saturating_sub(self.bound.ring_slots())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A prompt length, a window and a backtracking bound.
    fn prompt_and_bound() -> impl Strategy<Value = (u32, u32, u32)> {
        (1u32..2000, 1u32..200, 0u32..10)
    }

    fn default_bound() -> ReplayBound {
        ReplayBound::new(Some(140), 128, 6).unwrap()
    }

    #[test]
    fn keep_must_cover_window_plus_backtracking() {
        assert_eq!(
            ReplayBound::new(Some(133), 128, 6).unwrap_err().to_string(),
            "replay.decoder_keep_tokens: 133 is below sliding window 128 + \
             replay.max_backtracking 6 = 134"
        );
        assert!(ReplayBound::new(Some(134), 128, 6).is_ok());
        assert!(ReplayBound::new(None, 128, 6).is_ok());
        assert_eq!(
            ReplayBound::new(Some(140), 0, 6).unwrap_err(),
            ReplayError::ZeroWindow
        );
    }

    #[test]
    fn long_prompt_runs_decoder_on_last_140_tokens() {
        let suffix = default_bound().plan_prefill(1000);
        assert_eq!(suffix.start, 860);
        assert_eq!(suffix.skipped_tokens(), 860);
        // Chunked prefill: 0..512 skips the decoder, 512..1000 runs it on 860..1000.
        assert_eq!(suffix.decoder_rows(0..512), 512..512);
        assert_eq!(suffix.decoder_rows(512..1000), 860..1000);
        // The first kept query sees only itself; the window fills up from there.
        assert_eq!(suffix.decoder_window(860), 860..861);
        assert_eq!(suffix.decoder_window(999), 872..1000);
    }

    #[test]
    fn short_prompt_and_replay_off_keep_everything() {
        assert_eq!(default_bound().plan_prefill(100).start, 0);
        let off = ReplayBound::new(None, 128, 6).unwrap();
        assert_eq!(off.plan_prefill(10_000).start, 0);
        assert_eq!(off.plan_prefill(10_000).decoder_rows(0..64), 0..64);
    }

    #[test]
    fn replay_rejects_rewind_past_bound() {
        let mut cursor = RewindCursor::after_prefill(default_bound(), 1000);
        cursor.write(7);
        assert_eq!(
            cursor.rewind_to(1000),
            Err(ReplayError::RewindPastBound {
                requested: 7,
                max_backtracking: 6
            })
        );
        assert_eq!(cursor.len(), 1007, "a refused rewind changes nothing");
        assert!(cursor.rewind_to(1001).is_ok());
        assert_eq!(cursor.len(), 1001);
    }

    #[test]
    fn replay_rejects_rewind_into_committed_tokens() {
        let mut cursor = RewindCursor::after_prefill(default_bound(), 50);
        cursor.write(6);
        cursor.commit(53);
        assert_eq!(
            cursor.rewind_to(52),
            Err(ReplayError::RewindBelowCommitted {
                to: 52,
                committed: 53
            })
        );
        assert_eq!(
            cursor.rewind_to(60),
            Err(ReplayError::RewindForward { to: 60, len: 56 })
        );
        assert!(cursor.rewind_to(53).is_ok());
    }

    proptest! {
        #[test]
        fn chunked_prefill_covers_exactly_the_kept_suffix(
            (prompt_len, window, backtracking) in prompt_and_bound(),
            chunk in 1u32..600,
            keep_slack in 0u32..50,
        ) {
            let bound = ReplayBound::new(Some(window + backtracking + keep_slack), window, backtracking)
                .unwrap();
            let keep = window + backtracking + keep_slack;
            let suffix = bound.plan_prefill(prompt_len);
            let mut covered = Vec::new();
            let mut start = 0;
            while start < prompt_len {
                let end = (start + chunk).min(prompt_len);
                let rows = suffix.decoder_rows(start..end);
                prop_assert!(rows.start >= start && rows.end <= end);
                covered.extend(rows);
                start = end;
            }
            let expected: Vec<u32> = (prompt_len.saturating_sub(keep)..prompt_len).collect();
            prop_assert_eq!(covered, expected);
            prop_assert_eq!(suffix.skipped_tokens() + prompt_len.min(keep), prompt_len);
        }

        #[test]
        fn kept_queries_never_read_before_the_suffix(
            (prompt_len, window, backtracking) in prompt_and_bound(),
            offset in 0u32..2000,
        ) {
            let bound = ReplayBound::new(Some(window + backtracking), window, backtracking).unwrap();
            let suffix = bound.plan_prefill(prompt_len);
            let position = suffix.start + offset % (prompt_len - suffix.start);
            let keys = suffix.decoder_window(position);
            prop_assert!(keys.start >= suffix.start);
            prop_assert!(keys.end == position + 1);
            prop_assert!(keys.len() as u32 <= window);
            if position + 1 >= suffix.start + window {
                prop_assert_eq!(keys.len() as u32, window);
            }
        }

        #[test]
        fn allowed_rewinds_leave_a_full_window_of_kept_keys(
            (prompt_len, window, backtracking) in prompt_and_bound(),
            slack in 0u32..20,
            written in 0u32..12,
            rewind in 0u32..16,
        ) {
            let bound = ReplayBound::new(Some(window + backtracking + slack), window, backtracking)
                .unwrap();
            let suffix = bound.plan_prefill(prompt_len);
            let mut cursor = RewindCursor::after_prefill(bound, prompt_len);
            cursor.write(written);
            let to = cursor.len().saturating_sub(rewind).max(cursor.committed());
            let before = cursor;
            match cursor.rewind_to(to) {
                Ok(()) => {
                    prop_assert!(before.len() - to <= backtracking);
                    // The next query at `to` reads `[to + 1 - window, to]`: all of it lies in
                    // the rings and, for prompts longer than `keep`, inside the kept suffix.
                    let needed_start = (to + 1).saturating_sub(window);
                    prop_assert!(needed_start >= before.oldest_ring_position() || to < window);
                    if prompt_len > window + backtracking + slack {
                        prop_assert!(needed_start >= suffix.start);
                    }
                }
                Err(error) => {
                    prop_assert_eq!(cursor, before, "a refused rewind changes nothing");
                    let is_past_bound = matches!(error, ReplayError::RewindPastBound { .. });
                    prop_assert!(is_past_bound);
                    prop_assert!(before.len() - to > backtracking);
                }
            }
        }
    }
}
