//! `RankActor`: one per DP rank; owns a dedicated OS thread that owns the executor.
//!
//! Owns: the rank thread (and through it the executor and its device context).
//! Accepts: `RankMsg::Profile` (with DSpark on, once, from the supervisor), `StateMemory` (with
//! `[memory] state_memory_fraction`, once, from the supervisor), `Attach` (once),
//! `Execute(plan)`, `ThreadExited` (from its own thread).
//! Sends: `SchedulerMsg::StepDone` / `StepFailed` straight from the thread to the scheduler; the
//! profiled table and the memory reading to the supervisor's reply ports.
//! Ordering: the actor is up once its thread built the executor; the thread runs what it is sent
//! in order (the profile before any plan), and releases the outputs in the plans' order.
//! Failure: a panic or backend error on the thread fails the step (`StepFailed` with the panic
//! message), ends the thread, and makes this actor fail, so `NodeSupervisor` applies its policy.
//! The actor is never killed mid-step: stopping it closes the plan channel and joins the thread.

pub mod context_parallel;
pub mod executor;
pub mod factory;
pub mod fake;
pub mod memory;
pub mod model_executor;
pub mod observe;
pub mod sequences;
pub mod worker;

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Instant;

use deepinfer_topology::DpRank;
use ractor::{ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;

use crate::messages::rank::{RankError, RankMsg};
use crate::messages::scheduler::SchedulerMsg;
use crate::metrics as m;
use crate::shell::{Shell, ShellActor};
use executor::ExecutorFactory;
use worker::RankWorker;

/// Arguments of `RankActor`.
pub struct RankArgs {
    pub dp: DpRank,
    pub factory: Arc<dyn ExecutorFactory>,
}

pub struct RankState {
    dp: DpRank,
    /// The rank's messages for its thread (all but `ThreadExited`, which is the actor's).
    to_thread: Option<mpsc::Sender<RankMsg>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The actor (stateless handler; state in `RankState`).
pub type RankActor = ShellActor<RankState>;

pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}

/// Runs `work` on the rank thread; its error, or its panic, as a `RankError`.
fn guarded<T, E: std::fmt::Display>(work: impl FnOnce() -> Result<T, E>) -> Result<T, RankError> {
    match catch_unwind(AssertUnwindSafe(work)) {
        Ok(result) => result.map_err(|e| RankError::Backend {
            message: e.to_string(),
        }),
        Err(panic) => Err(RankError::Panicked {
            message: panic_message(&*panic),
        }),
    }
}

impl Shell for RankState {
    type Msg = RankMsg;
    type Args = RankArgs;

    async fn start(
        myself: ActorRef<Self::Msg>,
        args: Self::Args,
    ) -> Result<Self, ActorProcessingErr> {
        let (to_thread, from_actor) = mpsc::channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let dp = args.dp;
        let thread = std::thread::Builder::new()
            .name(format!("deepinfer-rank-{dp}"))
            .spawn(move || {
                let built = catch_unwind(AssertUnwindSafe(|| args.factory.build(dp.index())));
                let executor = match built {
                    Ok(Ok(executor)) => {
                        let _ = ready_tx.send(Ok(()));
                        executor
                    }
                    Ok(Err(e)) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                    Err(panic) => {
                        let _ = ready_tx.send(Err(format!("panicked: {}", panic_message(&*panic))));
                        return;
                    }
                };
                rank_thread(dp, RankWorker::new(dp, executor), from_actor, myself);
            })?;
        match ready_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(message)) => {
                return Err(format!("cannot start the executor of {dp}: {message}").into());
            }
            Err(_) => return Err(format!("the rank thread of {dp} exited during start").into()),
        }
        tracing::debug!(%dp, "rank thread started");
        Ok(RankState {
            dp,
            to_thread: Some(to_thread),
            thread: Some(thread),
        })
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        if let RankMsg::ThreadExited(error) = message {
            return Err(format!("{}: {error}", self.dp).into());
        }
        let sent = self.to_thread.as_ref().map(|tx| tx.send(message));
        if !matches!(sent, Some(Ok(()))) {
            return Err(format!("{}: {}", self.dp, RankError::ThreadGone).into());
        }
        Ok(())
    }

    async fn stopped(&mut self) -> Result<(), ActorProcessingErr> {
        // Closing the channel ends the thread after its current step; then join it off the
        // async workers.
        self.to_thread = None;
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        tracing::debug!(dp = %self.dp, "rank thread joined");
        Ok(())
    }
}

/// The loop of the rank thread: launch plans as they come (the scheduler bounds how many are
/// outstanding), release each step's output when the device has finished it; while waiting,
/// follow the expert-parallel peers' steps (`RankWorker::follow_peers`).
fn rank_thread(
    dp: DpRank,
    mut worker: RankWorker,
    plans: mpsc::Receiver<RankMsg>,
    rank: ActorRef<RankMsg>,
) {
    let mut scheduler: Option<ActorRef<SchedulerMsg>> = None;
    loop {
        while let Some(output) = worker.collect_ready(Instant::now()) {
            m::record_rank_step(&output);
            if let Some(s) = &scheduler {
                let _ = s.cast(SchedulerMsg::StepDone(Box::new(output)));
            }
        }
        let followed = match catch_unwind(AssertUnwindSafe(|| worker.follow_peers())) {
            Ok(result) => result.map_err(|e| RankError::Backend {
                message: format!("following the expert-parallel peers: {e}"),
            }),
            Err(panic) => Err(RankError::Panicked {
                message: format!(
                    "following the expert-parallel peers: {}",
                    panic_message(&*panic)
                ),
            }),
        };
        let poll = match followed {
            Ok(poll) => poll,
            Err(error) => {
                tracing::error!(%error, "idle step failed; the rank thread exits");
                let _ = rank.cast(RankMsg::ThreadExited(error));
                return;
            }
        };
        let wake_at = [worker.next_ready_at(), poll.map(|p| Instant::now() + p)]
            .into_iter()
            .flatten()
            .min();
        let message = match wake_at {
            None => match plans.recv() {
                Ok(message) => message,
                Err(_) => return,
            },
            Some(wake_at) => {
                match plans.recv_timeout(wake_at.saturating_duration_since(Instant::now())) {
                    Ok(message) => message,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => {
                        if worker.launched_count() == 0 {
                            return;
                        }
                        std::thread::sleep(wake_at.saturating_duration_since(Instant::now()));
                        continue;
                    }
                }
            }
        };
        let plan = match message {
            RankMsg::Profile(request, reply) => {
                // A failed profile fails the engine's start, which stops this rank.
                let _ = reply.send(guarded(|| worker.profile(&request)));
                continue;
            }
            RankMsg::StateMemory(reply) => {
                // A failed reading fails the engine's start, which stops this rank.
                let _ = reply.send(guarded(|| worker.state_memory()));
                continue;
            }
            RankMsg::Attach(s) => {
                scheduler = Some(s);
                continue;
            }
            RankMsg::Execute(plan) => plan,
            // The actor's own message: never sent to the thread.
            RankMsg::ThreadExited(_) => continue,
        };
        let span =
            tracing::debug_span!("step", dp = %dp, id = %plan.step, mode = plan.mode.as_str());
        let Err(error) = span.in_scope(|| guarded(|| worker.launch(&plan))) else {
            continue;
        };
        tracing::error!(step = %plan.step, %error, "rank step failed; the rank thread exits");
        if let Some(s) = &scheduler {
            let _ = s.cast(SchedulerMsg::StepFailed {
                step: plan.step,
                error: error.clone(),
            });
        }
        let _ = rank.cast(RankMsg::ThreadExited(error));
        return;
    }
}
