//! `SchedulerActor`: one per DP rank; continuous batching and async scheduling for its rank.
//!
//! Owns: the rank's `SchedulerState` and the event channels of the requests routed to it.
//! Accepts: `Submit`, `Abort`, `Wake`, `StepDone`/`StepFailed` (from the rank thread),
//! `RankLost` (from the supervisor), `Stats`, `Drain`.
//! Sends: `RankMsg::Execute` (at most `overlap_depth` outstanding); events to request channels.
//! Ordering: plans carry increasing `StepId`s and outputs are applied in that order.
//! Failure: a lost rank fails this rank's requests with `RankFailed` and refuses new ones; the
//! actor itself keeps running so callers get errors rather than a dead mailbox. Every rank steps
//! while the engine has admitted requests, with `Idle` plans when it has none of its own.

pub mod state;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use deepinfer_topology::{DpRank, RequestId};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::UnboundedSender;

use crate::messages::rank::{RankMsg, SeqInput};
use crate::messages::request::RawEvent;
use crate::messages::scheduler::SchedulerMsg;
use crate::metrics as m;
use state::{Emission, SchedulerLimits, SchedulerState};

/// Arguments of `SchedulerActor`.
pub struct SchedulerArgs {
    pub dp: DpRank,
    pub limits: SchedulerLimits,
    pub rank: ActorRef<RankMsg>,
    /// Requests admitted engine-wide and not yet released (owned by the frontend).
    pub engine_inflight: Arc<AtomicUsize>,
}

pub struct SchedulerShell {
    state: SchedulerState,
    dp_label: String,
    rank: ActorRef<RankMsg>,
    engine_inflight: Arc<AtomicUsize>,
    events: HashMap<RequestId, UnboundedSender<RawEvent>>,
    drain_waiters: Vec<RpcReplyPort<()>>,
}

impl SchedulerShell {
    fn deliver(&mut self, emissions: Vec<Emission>) {
        for emission in emissions {
            let (id, event, last) = match emission {
                Emission::Token(id, token) => (id, RawEvent::Token(token), false),
                Emission::Finished(id, reason, usage) => {
                    (id, RawEvent::Finished { reason, usage }, true)
                }
                Emission::Failed(id, error) => {
                    m::record_error(error.code());
                    (id, RawEvent::Failed(error), true)
                }
            };
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
                    SeqInput::Decode => 0,
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
    }
}

/// The actor (stateless handler; state in `SchedulerShell`).
pub struct SchedulerActor;

impl Actor for SchedulerActor {
    type Msg = SchedulerMsg;
    type State = SchedulerShell;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SchedulerMsg>,
        args: SchedulerArgs,
    ) -> Result<SchedulerShell, ActorProcessingErr> {
        Ok(SchedulerShell {
            state: SchedulerState::new(args.dp, args.limits),
            dp_label: args.dp.to_string(),
            rank: args.rank,
            engine_inflight: args.engine_inflight,
            events: HashMap::new(),
            drain_waiters: Vec::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SchedulerMsg>,
        message: SchedulerMsg,
        s: &mut SchedulerShell,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SchedulerMsg::Submit(admitted) => {
                let admitted = *admitted;
                let id = admitted.spec.id;
                match s.state.submit(admitted.spec) {
                    Ok(()) => {
                        s.events.insert(id, admitted.events);
                    }
                    Err(error) => {
                        m::record_error(error.code());
                        let _ = admitted.events.send(RawEvent::Failed(error));
                    }
                }
                s.pump();
            }
            SchedulerMsg::Abort(id) => {
                if let Some(emission) = s.state.abort(id) {
                    s.deliver(vec![emission]);
                }
                s.pump();
            }
            SchedulerMsg::Wake => s.pump(),
            SchedulerMsg::StepDone(output) => {
                let emissions = s.state.on_step_done(&output);
                let generated = emissions
                    .iter()
                    .filter(|e| matches!(e, Emission::Token(..)))
                    .count();
                m::record_step_done(&s.dp_label, output.mode, generated);
                s.deliver(emissions);
                s.pump();
            }
            SchedulerMsg::StepFailed { step, error } => {
                tracing::error!(dp = %s.dp_label, %step, %error, "step failed; failing this rank's requests");
                let emissions = s.state.fail_all(&error.to_string());
                s.deliver(emissions);
            }
            SchedulerMsg::RankLost(error) => {
                let emissions = s.state.fail_all(&error.to_string());
                s.deliver(emissions);
            }
            SchedulerMsg::Stats(reply) => {
                let _ = reply.send(s.state.stats());
            }
            SchedulerMsg::Drain(reply) => {
                if s.state.has_requests() {
                    s.drain_waiters.push(reply);
                } else {
                    let _ = reply.send(());
                }
            }
        }
        Ok(())
    }
}
