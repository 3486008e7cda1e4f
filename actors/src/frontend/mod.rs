//! `FrontendActor`: validation, encoding, bounded admission and routing.
//!
//! Owns: the admission counters (per rank: requests and outstanding work in tokens, which
//! placement balances; with the prefix cache on several ranks, a mirror of each rank's cache
//! for cache-affinity placement), the engine-wide in-flight count the schedulers read to decide on `Idle`
//! steps, and the tokenizer/chat encoding.
//! Accepts: `Submit`, `Released`, `RankDown`, `Close`.
//! Sends: `SchedulerMsg::Submit` to the chosen rank and `Wake` to the others (so every rank
//! steps while the engine has work).
//! Failure: a bad request is answered with `EngineError::Invalid` and never fails the actor; at
//! the admission limit the answer is `Overloaded`; after `Close`, `ShuttingDown`.

pub mod affinity;
pub mod codec;
pub mod state;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ractor::{ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;

use crate::engine::request::Submission;
use crate::error::EngineError;
use crate::grammar::GrammarEngine;
use crate::messages::frontend::FrontendMsg;
use crate::messages::request::Admitted;
use crate::messages::scheduler::SchedulerMsg;
use crate::metrics as m;
use crate::prefix_cache::{ENGINE_SALT, block_chain};
use crate::scheduler::prefix::PrefixSettings;
use crate::shell::{Shell, ShellActor};
use affinity::Affinity;
use codec::TextCodec;
use state::{Admission, FrontendLimits, prepare};

/// Arguments of `FrontendActor`.
pub struct FrontendArgs {
    pub schedulers: Vec<ActorRef<SchedulerMsg>>,
    pub codec: Option<Arc<TextCodec>>,
    /// Structured outputs (built from the tokenizer); `None` refuses constrained requests.
    pub grammar: Option<Arc<GrammarEngine>>,
    pub limits: FrontendLimits,
    pub engine_inflight: Arc<AtomicUsize>,
    /// The ranks' prefix cache, when it is on (placement weighs cache affinity with several
    /// ranks).
    pub prefix: Option<PrefixSettings>,
}

pub struct FrontendShell {
    args: FrontendArgs,
    admission: Admission,
    /// Cache-affinity placement (the prefix cache on, several DP ranks).
    affinity: Option<Affinity>,
}

impl FrontendShell {
    fn publish_inflight(&self) {
        let n = self.admission.inflight();
        self.args.engine_inflight.store(n, Ordering::Release);
        m::set_inflight(n);
        m::set_outstanding_tokens(self.admission.outstanding_tokens());
    }
}

/// The actor (stateless handler; state in `FrontendShell`).
pub type FrontendActor = ShellActor<FrontendShell>;

impl Shell for FrontendShell {
    type Msg = FrontendMsg;
    type Args = FrontendArgs;

    async fn start(_: ActorRef<Self::Msg>, args: Self::Args) -> Result<Self, ActorProcessingErr> {
        let ranks = args.schedulers.len();
        let admission = Admission::new(args.limits.admission_capacity, ranks);
        let affinity = match &args.prefix {
            Some(settings) if ranks > 1 => Some(Affinity::new(ranks, settings)),
            _ => None,
        };
        Ok(FrontendShell {
            args,
            admission,
            affinity,
        })
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        match message {
            FrontendMsg::Submit(request, reply) => {
                let id = self.admission.next_id();
                let _span = tracing::debug_span!("request", %id).entered();
                let mut prepared = match prepare(
                    id,
                    &request,
                    self.args.codec.as_deref(),
                    self.args.grammar.as_deref(),
                    &self.args.limits,
                ) {
                    Ok(p) => p,
                    Err(e) => {
                        m::record_request("invalid");
                        let _ = reply.send(Err(EngineError::Invalid(e)));
                        return Ok(());
                    }
                };
                if let Some(settings) = &self.args.prefix {
                    let spec = &mut prepared.spec;
                    let n = settings.geometry.block_tokens;
                    spec.prefix_chain = block_chain(n, ENGINE_SALT, &spec.prompt);
                }
                let spec = &prepared.spec;
                let work_tokens = spec.prompt.len() + spec.max_tokens;
                let cached = self
                    .affinity
                    .as_ref()
                    .map(|a| a.cached_tokens(&spec.prompt, &spec.prefix_chain))
                    .unwrap_or_default();
                let dp = match self.admission.admit(work_tokens, &cached) {
                    Ok(dp) => dp,
                    Err(e) => {
                        m::record_request(e.code());
                        let _ = reply.send(Err(e));
                        return Ok(());
                    }
                };
                if let Some(affinity) = self.affinity.as_mut() {
                    affinity.placed(dp.index(), &spec.prompt, &spec.prefix_chain);
                }
                self.publish_inflight();
                m::record_request("admitted");
                let (tx, rx) = mpsc::unbounded_channel();
                let scheduler = self.args.schedulers[dp.index()].clone();
                let prompt_tokens = prepared.spec.prompt.len();
                let admitted = Admitted {
                    dp,
                    spec: prepared.spec,
                    events: tx,
                };
                if scheduler
                    .cast(SchedulerMsg::Submit(Box::new(admitted)))
                    .is_err()
                {
                    self.admission.release(dp, work_tokens);
                    self.publish_inflight();
                    let _ = reply.send(Err(EngineError::ShuttingDown));
                    return Ok(());
                }
                for (rank, other) in self.args.schedulers.iter().enumerate() {
                    if rank != dp.index() {
                        let _ = other.cast(SchedulerMsg::Wake);
                    }
                }
                let _ = reply.send(Ok(Submission {
                    id,
                    dp,
                    prompt_tokens,
                    work_tokens,
                    stop: prepared.stop,
                    events: rx,
                    scheduler,
                }));
            }
            FrontendMsg::Released { dp, work_tokens } => {
                self.admission.release(dp, work_tokens);
                self.publish_inflight();
            }
            FrontendMsg::RankDown(dp) => self.admission.rank_down(dp),
            FrontendMsg::Close(reply) => {
                self.admission.close();
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}
