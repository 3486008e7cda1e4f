//! `ReplayActor`: decoder bounded replay (spec §3.5) and the rewind bound.
//!
//! Owns: the engine's [`state::ReplayState`] (the validated bound and each request's bounded
//! suffix: the prompt position the decoder layers start at, and the cursor that says what a
//! rewind after a rejected draft may undo).
//! Accepts: `Admit` (answers the planned [`suffix::DecoderSuffix`]: its `start` travels with the
//! request's prefill chunks to the rank, whose executor runs them with that
//! `StepEntry::decoder_from`), `Written`, `Commit`, `Rewind` (answers; beyond `max_backtracking` it is an error, never a
//! silent truncation), `Finish`, `Stats`.
//! Sends: nothing; it answers.
//! Failure: a refused message fails that request's operation, never the actor. Spawned by the
//! supervisor only when `[replay] decoder_keep_tokens` is set and the model has a window.

pub mod state;
pub mod suffix;

use deepinfer_topology::ReplayConfig;
use ractor::{ActorProcessingErr, ActorRef};

use crate::error::EngineError;
use crate::messages::replay::ReplayMsg;
use crate::shell::{Shell, ShellActor};
use state::ReplayState;
use suffix::ReplayError;

/// The replay state an engine starts with: `None` when `[replay] decoder_keep_tokens` is off or
/// the model has no sliding window (an executor without a model); otherwise the bound validated
/// against the model (`keep >= window + max_backtracking`, `max_backtracking` within the
/// `model_backtrack` positions its rings keep), a violation being a config error naming the
/// field.
pub fn engine_replay(
    config: &ReplayConfig,
    window: Option<usize>,
    model_backtrack: usize,
) -> Result<Option<ReplayState>, EngineError> {
    let (Some(_), Some(window)) = (config.decoder_keep_tokens, window) else {
        return Ok(None);
    };
    ReplayState::for_model(config, window, model_backtrack)
        .map(Some)
        .map_err(|error| EngineError::Config {
            field: config_field(&error).to_string(),
            message: error.to_string(),
        })
}

/// The topology field a bound error is about.
fn config_field(error: &ReplayError) -> &'static str {
    match error {
        ReplayError::KeepTooSmall { .. } => "replay.decoder_keep_tokens",
        ReplayError::BacktrackingBeyondModel { .. } => "replay.max_backtracking",
        ReplayError::ZeroWindow | ReplayError::WindowTooLarge(_) => "model.sliding_window_tokens",
        _ => "replay",
    }
}

/// The actor (stateless handler; state in [`ReplayState`]).
pub type ReplayActor = ShellActor<ReplayState>;

impl Shell for ReplayState {
    type Msg = ReplayMsg;
    type Args = ReplayState;

    async fn start(_: ActorRef<Self::Msg>, state: Self::Args) -> Result<Self, ActorProcessingErr> {
        Ok(state)
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        match message {
            ReplayMsg::Admit {
                id,
                prompt_len,
                reply,
            } => {
                let _ = reply.send(self.admit(id, prompt_len));
            }
            ReplayMsg::Written { id, count } => {
                if let Err(error) = self.written(id, count) {
                    tracing::error!(%id, %error, "replay: write refused");
                }
            }
            ReplayMsg::Commit { id, len } => {
                if let Err(error) = self.commit(id, len) {
                    tracing::error!(%id, %error, "replay: commit refused");
                }
            }
            ReplayMsg::Rewind { id, to } => {
                if let Err(error) = self.rewind(id, to) {
                    tracing::error!(%id, %error, "replay: rewind refused");
                }
            }
            ReplayMsg::Finish(id) => {
                self.finish(id);
            }
            ReplayMsg::Stats(reply) => {
                let _ = reply.send(self.stats());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use deepinfer_topology::{ReplayConfig, RequestId};
    use ractor::{Actor, call};

    use super::*;

    #[test]
    fn engine_replay_is_off_without_keep_or_window_and_refuses_bad_bounds() {
        let on = ReplayConfig {
            decoder_keep_tokens: Some(140),
            max_backtracking: 6,
        };
        let off = ReplayConfig {
            decoder_keep_tokens: None,
            ..on
        };
        assert!(matches!(engine_replay(&off, Some(128), 6), Ok(None)));
        assert!(matches!(engine_replay(&on, None, 6), Ok(None)));
        let state = engine_replay(&on, Some(128), 6)
            .expect("valid")
            .expect("on");
        assert_eq!(state.bound().keep(), Some(140));
        match engine_replay(&on, Some(135), 6) {
            Err(EngineError::Config { field, message }) => {
                assert_eq!(field, "replay.decoder_keep_tokens");
                assert!(
                    message.contains("135 + replay.max_backtracking 6 = 141"),
                    "{message}"
                );
            }
            other => panic!("expected a config error, got {other:?}"),
        }
        match engine_replay(&on, Some(128), 5) {
            Err(EngineError::Config { field, .. }) => assert_eq!(field, "replay.max_backtracking"),
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn actor_plans_rewinds_and_frees() {
        let config = ReplayConfig {
            decoder_keep_tokens: Some(22),
            max_backtracking: 6,
        };
        let state = ReplayState::for_model(&config, 16, 6).expect("bound");
        let (actor, handle) = Actor::spawn(None, ReplayActor::new(), state)
            .await
            .expect("spawn");
        let id = RequestId(9);
        let suffix = call!(actor, |reply| ReplayMsg::Admit {
            id,
            prompt_len: 200,
            reply
        })
        .expect("answer")
        .expect("admitted");
        assert_eq!(suffix.start, 178);
        actor
            .cast(ReplayMsg::Written { id, count: 7 })
            .expect("cast");
        // Past the bound (7 > 6): refused and counted, nothing changes; then within it.
        actor.cast(ReplayMsg::Rewind { id, to: 200 }).expect("cast");
        actor.cast(ReplayMsg::Rewind { id, to: 201 }).expect("cast");
        actor
            .cast(ReplayMsg::Commit { id, len: 201 })
            .expect("cast");
        let stats = call!(actor, ReplayMsg::Stats).expect("answer");
        assert_eq!((stats.rewinds, stats.refused), (1, 1));
        // Into the committed positions: refused.
        actor.cast(ReplayMsg::Rewind { id, to: 200 }).expect("cast");
        actor.cast(ReplayMsg::Finish(id)).expect("cast");
        let stats = call!(actor, ReplayMsg::Stats).expect("answer");
        assert_eq!(
            (
                stats.live,
                stats.rewinds,
                stats.refused,
                stats.skipped_prompt_tokens
            ),
            (0, 1, 2, 178)
        );
        actor.stop(None);
        handle.await.expect("stopped");
    }
}
