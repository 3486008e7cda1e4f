//! `SchedulerActor`: one per DP rank; continuous batching and async scheduling for its rank.
//!
//! Owns: the rank's `SchedulerState` and the event channels of the requests routed to it.
//! Accepts: `Submit`, `Abort`, `Wake`, `StepDone`/`StepFailed` (from the rank thread),
//! `RankLost` (from the supervisor), `Stats`, `Drain`; with DSpark, `AttachDrafter` (from the
//! supervisor) and `Proposals` (from the `DSparkActor`).
//! Sends: `RankMsg::Execute` (at most `overlap_depth` outstanding); events to request channels;
//! with DSpark, each step's drafted proposals to the `DSparkActor` (`DSparkMsg::Drafted`);
//! with bounded replay, `ReplayMsg::Admit` (awaited: its decoder start travels to the rank in
//! `NewSeq`) on `Submit`, each completed step's position updates of its decoding requests
//! (`Written`, `Rewind` after rejected drafts, `Commit`: `SchedulerState::replay_updates`) and
//! `ReplayMsg::Finish` when a request ends. With the prefix cache, its hits and stores ride in
//! the plans (`NewSeq::prefix`, `StepPlan::cache_ops`; see `scheduler::prefix`).
//! Ordering: plans carry increasing `StepId`s and outputs are applied in that order.
//! Failure: a lost rank fails this rank's requests with `RankFailed` and refuses new ones; the
//! actor itself keeps running so callers get errors rather than a dead mailbox. Every rank steps
//! while the engine has admitted requests, with `Idle` plans when it has none of its own.

pub mod pool;
pub mod prefix;
pub mod state;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use deepinfer_topology::{DpRank, RequestId};
use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::EngineError;
use crate::messages::dspark::{DSparkMsg, DraftedBatch};
use crate::messages::rank::{RankMsg, SeqInput, StepOutput};
use crate::messages::replay::ReplayMsg;
use crate::messages::request::{RawEvent, RequestSpec};
use crate::messages::scheduler::SchedulerMsg;
use crate::metrics as m;
use crate::shell::{Shell, ShellActor};
use pool::StatePool;
use prefix::{PrefixSettings, RankPrefixCache};
use state::{Emission, ReplayUpdate, SchedulerLimits, SchedulerState, VerifySettings};

/// Arguments of `SchedulerActor`.
pub struct SchedulerArgs {
    pub dp: DpRank,
    pub limits: SchedulerLimits,
    /// The rank's state pool; `None` = states unaccounted.
    pub pool: Option<StatePool>,
    pub rank: ActorRef<RankMsg>,
    /// Requests admitted engine-wide and not yet released (owned by the frontend).
    pub engine_inflight: Arc<AtomicUsize>,
    /// DSpark verification; `None` = off.
    pub dspark: Option<VerifySettings>,
    /// Decoder bounded replay (plans each request's decoder start); `None` = off.
    pub replay: Option<ActorRef<ReplayMsg>>,
    /// The rank's prefix cache; `None` = off.
    pub prefix: Option<PrefixSettings>,
}

pub struct SchedulerShell {
    state: SchedulerState,
    dp_label: String,
    rank: ActorRef<RankMsg>,
    engine_inflight: Arc<AtomicUsize>,
    events: HashMap<RequestId, UnboundedSender<RawEvent>>,
    drain_waiters: Vec<RpcReplyPort<()>>,
    drafter: Option<ActorRef<DSparkMsg>>,
    replay: Option<ActorRef<ReplayMsg>>,
}

impl SchedulerShell {
    /// Bounded replay: the decoder start the `ReplayActor` plans for a new request (`None` when
    /// replay is off or the whole prompt is kept). Once the `ReplayActor` is gone, prompts
    /// prefill every decoder position (exact, slower), as the supervisor's policy says.
    async fn plan_replay(&mut self, spec: &RequestSpec) -> Result<Option<u32>, EngineError> {
        let Some(replay) = &self.replay else {
            return Ok(None);
        };
        let (id, prompt_len) = (
            spec.id,
            u32::try_from(spec.prompt.len()).unwrap_or(u32::MAX),
        );
        let planned = ractor::call!(replay, |reply| ReplayMsg::Admit {
            id,
            prompt_len,
            reply
        });
        let suffix = match planned {
            Ok(suffix) => suffix.map_err(|e| EngineError::internal(e.to_string()))?,
            Err(error) => {
                tracing::warn!(dp = %self.dp_label, %error, "the replay actor is gone; prefilling every decoder position");
                self.replay = None;
                return Ok(None);
            }
        };
        Ok((suffix.start > 0).then_some(suffix.start))
    }

    /// Tells the `ReplayActor` what the step did to each decoding request's positions.
    fn report_replay(&mut self, updates: &[ReplayUpdate]) {
        let Some(replay) = &self.replay else {
            return;
        };
        for update in updates {
            let id = update.id;
            let mut messages = vec![ReplayMsg::Written {
                id,
                count: update.written,
            }];
            if update.rewound {
                messages.push(ReplayMsg::Rewind {
                    id,
                    to: update.kept,
                });
            }
            messages.push(ReplayMsg::Commit {
                id,
                len: update.kept,
            });
            if messages.into_iter().any(|m| replay.cast(m).is_err()) {
                tracing::warn!(dp = %self.dp_label, "the replay actor is gone; rewinds are no longer followed");
                self.replay = None;
                return;
            }
        }
    }

    /// Frees a request's bounded suffix in the `ReplayActor`.
    fn finish_replay(&self, id: RequestId) {
        if let Some(replay) = &self.replay {
            let _ = replay.cast(ReplayMsg::Finish(id));
        }
    }

    /// Records the step's DSpark counters and hands its proposals to the `DSparkActor`.
    fn forward_drafts(&mut self, output: &mut StepOutput) {
        m::record_dspark_step(&self.dp_label, output);
        if output.drafts.is_empty() {
            return;
        }
        if let Some(drafter) = &self.drafter {
            let batch = DraftedBatch {
                dp: output.dp,
                drafted_after: output.step,
                drafts: std::mem::take(&mut output.drafts),
            };
            if drafter.cast(DSparkMsg::Drafted(Box::new(batch))).is_err() {
                tracing::warn!(dp = %self.dp_label, "the DSpark actor is gone; verifying without drafts");
                self.drafter = None;
            }
        }
    }

    fn deliver(&mut self, emissions: Vec<Emission>) {
        for emission in emissions {
            let (id, event, last) = match emission {
                Emission::Token(id, token) => (id, RawEvent::Token(token), false),
                Emission::Logprobs(id, logprobs) => (id, RawEvent::Logprobs(logprobs), false),
                Emission::Finished(id, reason, usage) => {
                    (id, RawEvent::Finished { reason, usage }, true)
                }
                Emission::Failed(id, error) => {
                    // An abort is the caller's own doing (a stop sequence met, a stream
                    // dropped), not an error.
                    if error != EngineError::Aborted {
                        m::record_error(error.code());
                    }
                    (id, RawEvent::Failed(error), true)
                }
            };
            if last {
                self.finish_replay(id);
            }
            let sender = if last {
                self.events.remove(&id)
            } else {
                self.events.get(&id).cloned()
            };
            if let Some(sender) = sender {
                // A closed channel means the caller went away; its abort is on the way.
                let _ = sender.send(event);
            }
        }
        if !self.state.has_requests() {
            for waiter in self.drain_waiters.drain(..) {
                let _ = waiter.send(());
            }
        }
    }

    /// Sends plans while credits allow; an `Idle` plan when this rank has no requests but the
    /// engine does.
    fn pump(&mut self) {
        loop {
            let started = Instant::now();
            let had_in_flight = self.state.in_flight() > 0;
            let plan = match self.state.build_plan() {
                Some(plan) => Some(plan),
                None if !self.state.has_requests()
                    && self.engine_inflight.load(Ordering::Acquire) > 0 =>
                {
                    self.state.idle_plan()
                }
                None => None,
            };
            let Some(plan) = plan else { break };
            let prompt_tokens: usize = plan
                .work
                .iter()
                .map(|w| match &w.input {
                    SeqInput::Prefill { tokens, .. } => tokens.len(),
                    SeqInput::Decode | SeqInput::Verify { .. } => 0,
                })
                .sum();
            m::record_plan(
                &self.dp_label,
                started.elapsed().as_secs_f64(),
                had_in_flight,
                prompt_tokens,
            );
            tracing::trace!(dp = %self.dp_label, step = %plan.step, mode = plan.mode.as_str(), tokens = plan.token_count(), "plan");
            if self.rank.cast(RankMsg::Execute(Box::new(plan))).is_err() {
                let emissions = self.state.fail_all("the rank actor is gone");
                self.deliver(emissions);
                break;
            }
        }
        let stats = self.state.stats();
        m::record_queue(&self.dp_label, stats.waiting, stats.running);
        m::record_state_pool(&self.dp_label, &stats);
        m::record_prefix_cache(&self.dp_label, &stats.prefix);
    }
}

/// The actor (stateless handler; state in `SchedulerShell`).
pub type SchedulerActor = ShellActor<SchedulerShell>;

impl Shell for SchedulerShell {
    type Msg = SchedulerMsg;
    type Args = SchedulerArgs;

    async fn start(_: ActorRef<Self::Msg>, args: Self::Args) -> Result<Self, ActorProcessingErr> {
        let mut state = SchedulerState::new(args.dp, args.limits);
        if let Some(pool) = args.pool {
            state = state.with_pool(pool);
        }
        if let Some(settings) = args.prefix {
            state = state.with_prefix_cache(RankPrefixCache::new(settings));
        }
        Ok(SchedulerShell {
            state: match args.dspark {
                Some(settings) => state.with_dspark(settings),
                None => state,
            },
            dp_label: args.dp.to_string(),
            rank: args.rank,
            engine_inflight: args.engine_inflight,
            events: HashMap::new(),
            drain_waiters: Vec::new(),
            drafter: None,
            replay: args.replay,
        })
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        match message {
            SchedulerMsg::Submit(admitted) => {
                let admitted = *admitted;
                let id = admitted.spec.id;
                let submitted = match self.plan_replay(&admitted.spec).await {
                    Ok(decoder_from) => self.state.submit_with_replay(admitted.spec, decoder_from),
                    Err(error) => Err(error),
                };
                match submitted {
                    Ok(()) => {
                        self.events.insert(id, admitted.events);
                    }
                    Err(error) => {
                        self.finish_replay(id);
                        m::record_error(error.code());
                        let _ = admitted.events.send(RawEvent::Failed(error));
                    }
                }
                self.pump();
            }
            SchedulerMsg::Abort(id) => {
                if let Some(emission) = self.state.abort(id) {
                    self.deliver(vec![emission]);
                }
                self.pump();
            }
            SchedulerMsg::Wake => self.pump(),
            SchedulerMsg::StepDone(mut output) => {
                if self.replay.is_some() {
                    let updates = self.state.replay_updates(&output);
                    self.report_replay(&updates);
                }
                let emissions = self.state.on_step_done(&output);
                self.forward_drafts(&mut output);
                let generated = emissions
                    .iter()
                    .filter(|e| matches!(e, Emission::Token(..)))
                    .count();
                m::record_step_done(&self.dp_label, output.mode, generated);
                self.deliver(emissions);
                self.pump();
            }
            SchedulerMsg::Proposals(batch) => {
                self.state.on_proposals(&batch);
            }
            SchedulerMsg::AttachDrafter(drafter) => self.drafter = Some(drafter),
            SchedulerMsg::StepFailed { step, error } => {
                tracing::error!(dp = %self.dp_label, %step, %error, "step failed; failing this rank's requests");
                let emissions = self.state.fail_all(&error.to_string());
                self.deliver(emissions);
            }
            SchedulerMsg::RankLost(error) => {
                let emissions = self.state.fail_all(&error.to_string());
                self.deliver(emissions);
            }
            SchedulerMsg::Stats(reply) => {
                let _ = reply.send(self.state.stats());
            }
            SchedulerMsg::Drain(reply) => {
                if self.state.has_requests() {
                    self.drain_waiters.push(reply);
                } else {
                    let _ = reply.send(());
                }
            }
        }
        Ok(())
    }
}
