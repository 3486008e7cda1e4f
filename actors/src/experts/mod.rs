//! `ExpertGroupActor`: one per EP rank; the control side of that rank's expert shard.
//!
//! Owns: its `ExpertGroupState` (the shard in use, the staged one) and the source the weights
//! are copied from (the model, or nothing for simulated devices). The shards themselves are shared with the data plane (`LocalComm`), which
//! computes with them on the rank threads and counts their load; nothing per token crosses this
//! mailbox.
//! Accepts: `Stage` (build the shard of a new placement: weights copied on a blocking thread),
//! `Commit`, `Abort` — all from the `EplbActor` (which reads the load counters through the
//! committed `LocalComm`).
//! Sends: replies only.
//! Ordering: stage then commit, by `PlacementEpoch`; a commit for another epoch is refused.
//! Failure: errors are replied, never panics; the supervisor does not restart this actor (its
//! shards stay in use by the committed `LocalComm`).

pub mod cuda_layout;
pub mod device;
pub mod factory;
pub mod lockstep;
pub mod parallel;
pub mod shard;
pub mod state;

use std::sync::Arc;

use ractor::{ActorProcessingErr, ActorRef};

use crate::comm::EpError;
use crate::messages::experts::ExpertGroupMsg;
use crate::shell::{Shell, ShellActor};
use shard::{ExpertShard, ExpertSource};
use state::ExpertGroupState;

/// Arguments of `ExpertGroupActor`.
pub struct ExpertGroupArgs {
    pub source: ExpertSource,
    /// The rank's shard of the committed placement.
    pub current: Arc<ExpertShard>,
}

pub struct ExpertGroupActorState {
    source: ExpertSource,
    group: ExpertGroupState,
}

/// The actor (stateless handler; state in `ExpertGroupActorState`).
pub type ExpertGroupActor = ShellActor<ExpertGroupActorState>;

impl Shell for ExpertGroupActorState {
    type Msg = ExpertGroupMsg;
    type Args = ExpertGroupArgs;

    async fn start(_: ActorRef<Self::Msg>, args: Self::Args) -> Result<Self, ActorProcessingErr> {
        Ok(ExpertGroupActorState {
            source: args.source,
            group: ExpertGroupState::new(args.current),
        })
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        match message {
            ExpertGroupMsg::Stage {
                epoch,
                placement,
                reply,
            } => {
                // Copying weights is bulk work: do it off the async workers, on a scratch state
                // that holds the same shard in use.
                let source = self.source.clone();
                let mut scratch = ExpertGroupState::new(self.group.current().clone());
                let built = tokio::task::spawn_blocking(move || {
                    let staged = scratch.stage(&source, &placement, epoch);
                    (scratch, staged)
                })
                .await;
                let result = match built {
                    Ok((scratch, staged)) => {
                        if staged.is_ok() {
                            self.group = scratch;
                        }
                        staged
                    }
                    Err(e) => Err(EpError::Actor(format!("staging thread: {e}"))),
                };
                let _ = reply.send(result);
            }
            ExpertGroupMsg::Commit { epoch, reply } => {
                let _ = reply.send(self.group.commit(epoch));
            }
            ExpertGroupMsg::Abort { epoch } => self.group.abort(epoch),
        }
        Ok(())
    }
}

/// A small random V4.1 model (the tiny architecture without Engram) for unit tests.
#[cfg(test)]
pub(crate) fn tiny_test_model() -> (tempfile::TempDir, Arc<deepinfer_model::Model>) {
    let mut cfg = deepinfer_model::config::ModelConfig::tiny_v41();
    cfg.engram = None;
    let dir = tempfile::tempdir().expect("tempdir");
    deepinfer_model::checkpoint::write_random_checkpoint(&cfg, 9, dir.path(), 1)
        .expect("random checkpoint");
    let model = deepinfer_model::Model::load(dir.path()).expect("model loads");
    (dir, Arc::new(model))
}
