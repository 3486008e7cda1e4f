//! `NodeSupervisor`: the root of one engine's actor tree and the owner of its failure policy.
//!
//! Owns: the children (one `RankActor` and one `SchedulerActor` per DP rank, the
//! `FrontendActor`, and when enabled the `ReplayActor`, the `DSparkActor`, one
//! `ExpertGroupActor` per EP rank and the `EplbActor`), the map from child to role, and the `SupervisionPolicy` (see `policy.rs`
//! for the policy itself).
//! Accepts: `Health`, `Drain`; supervision events from its children (it overrides ractor's
//! default, which would stop the supervisor on any child exit).
//! Sends: `RankMsg::Profile` (DSpark on) and `RankMsg::StateMemory` (a fraction of the memory)
//! to every rank at start; `SchedulerMsg::RankLost` and
//! `FrontendMsg::RankDown` to apply a decision.
//! Ordering: every rank is spawned first (a rank is up once its thread built its executor);
//! with DSpark on, all of them then profile the step rate at once on their own executors, and
//! rank 0's table goes to every scheduler. With `[memory] state_memory_fraction` all of them
//! then read where their states live at once (a device rank after making its weights resident),
//! and each rank's state pool is cut from its share. Then each rank's scheduler (which gets the
//! rank's ref and its pool) and `Attach` to the rank, then the `DSparkActor`, the expert actors, and the frontend last, so
//! no plan can reach a rank before its profile and its scheduler. With bounded replay on, the
//! `ReplayActor` is spawned first and every scheduler gets its ref.
//! Failure: nothing restarts; see `policy.rs`. Shutdown closes admission, waits for the
//! schedulers to drain (bounded), then stops the children (ranks join their threads).

pub mod policy;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use deepinfer_topology::DpRank;
use ractor::{ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::oneshot;

use crate::dspark::profile::ProfileRequest;
use crate::dspark::{DSparkActor, DSparkArgs};
use crate::frontend::codec::TextCodec;
use crate::frontend::state::FrontendLimits;
use crate::frontend::{FrontendActor, FrontendArgs};
use crate::grammar::GrammarEngine;
use crate::messages::frontend::FrontendMsg;
use crate::messages::rank::{RankError, RankMsg};
use crate::messages::replay::ReplayMsg;
use crate::messages::scheduler::SchedulerMsg;
use crate::messages::supervisor::{DrainReport, SupervisorMsg};
use crate::metrics as m;
use crate::rank::executor::ExecutorFactory;
use crate::rank::memory::{HostMemory, StateMemory};
use crate::rank::{RankActor, RankArgs};
use crate::replay::ReplayActor;
use crate::replay::state::ReplayState;
use crate::scheduler::pool::{PoolPlan, StatePool};
use crate::scheduler::prefix::PrefixSettings;
use crate::scheduler::state::{SchedulerLimits, VerifySettings};
use crate::scheduler::{SchedulerActor, SchedulerArgs};
use crate::shell::{Children, Shell, ShellActor};
use policy::{ChildRole, Decision, Service, SupervisionPolicy};

/// The refs an `Engine` talks to.
#[derive(Debug, Clone)]
pub struct EngineHandles {
    pub frontend: ActorRef<FrontendMsg>,
    pub schedulers: Vec<ActorRef<SchedulerMsg>>,
    /// The `ReplayActor`, with bounded replay on.
    pub replay: Option<ActorRef<ReplayMsg>>,
}

/// Arguments of `NodeSupervisor`.
pub struct SupervisorArgs {
    pub dp_ranks: usize,
    pub ep_ranks: usize,
    pub scheduler: SchedulerLimits,
    /// How each rank's state pool is cut, once the ranks are up; `None` = states unaccounted.
    pub pools: Option<PoolPlan>,
    pub frontend: FrontendLimits,
    pub factory: Arc<dyn ExecutorFactory>,
    pub codec: Option<Arc<TextCodec>>,
    pub grammar: Option<Arc<GrammarEngine>>,
    pub handles: oneshot::Sender<EngineHandles>,
    /// `[dspark]`: when enabled, the ranks profile the step rate and a `DSparkActor` is spawned.
    pub dspark: deepinfer_topology::DSparkConfig,
    /// Decoder bounded replay, validated against the model; `None` = off (no `ReplayActor`).
    pub replay: Option<ReplayState>,
    /// Each rank's prefix cache; `None` = off.
    pub prefix: Option<PrefixSettings>,
}

/// DSpark's planner settings: every rank profiles its own executor at once (the same steps on
/// each, so the EP ranks' collectives pair up: `dspark::profile`), and rank 0's table is the
/// engine's; `None` with DSpark off.
async fn dspark_settings(
    args: &SupervisorArgs,
    ranks: &[ActorRef<RankMsg>],
) -> Result<Option<VerifySettings>, String> {
    if !args.dspark.enabled {
        return Ok(None);
    }
    let request = ProfileRequest::for_engine(&args.dspark, &args.scheduler);
    let mut replies = Vec::with_capacity(ranks.len());
    for rank in ranks {
        let (reply, profiled) = ractor::concurrency::oneshot();
        rank.cast(RankMsg::Profile(request.clone(), reply.into()))
            .map_err(|e| format!("DSpark step-rate profile: {e}"))?;
        replies.push(profiled);
    }
    let mut first = None;
    for (dp, profiled) in replies.into_iter().enumerate() {
        let table = profiled
            .await
            .map_err(|_| format!("DP rank {dp} stopped during the DSpark step-rate profile"))?
            .map_err(|e| format!("DSpark step-rate profile on DP rank {dp}: {e}"))?;
        first.get_or_insert(table);
    }
    let table = first.ok_or("DSpark step-rate profile: no DP rank")?;
    tracing::info!(points = ?table.points(), "DSpark steps-per-second table profiled (DP rank 0)");
    Ok(Some(VerifySettings {
        max_draft_tokens: request.block,
        table,
    }))
}

/// Each rank's state pool ([`PoolPlan::pools`]; `None`s without a plan). With a fraction of the
/// memory, every rank reads where its states live at once (`RankMsg::StateMemory`, a device rank
/// making its weights resident first), so by the last reading of a device every rank on it has
/// loaded its weights, and EP ranks' steps pair up.
async fn state_pools(
    args: &SupervisorArgs,
    ranks: &[ActorRef<RankMsg>],
) -> Result<Vec<Option<StatePool>>, ActorProcessingErr> {
    let Some(plan) = &args.pools else {
        return Ok(vec![None; ranks.len()]);
    };
    let mut places = vec![StateMemory::Host; ranks.len()];
    if plan.measures_memory() {
        let mut replies = Vec::with_capacity(ranks.len());
        for rank in ranks {
            let (reply, read) = ractor::concurrency::oneshot();
            rank.cast(RankMsg::StateMemory(reply.into()))
                .map_err(|e| format!("reading the state memory: {e}"))?;
            replies.push(read);
        }
        for (dp, (read, place)) in replies.into_iter().zip(&mut places).enumerate() {
            *place = read
                .await
                .map_err(|_| format!("DP rank {dp} stopped while reading its state memory"))?
                .map_err(|e| format!("reading the state memory of DP rank {dp}: {e}"))?;
        }
    }
    let pools = plan.pools(&places, &HostMemory)?;
    Ok(pools.into_iter().map(Some).collect())
}

pub struct SupervisorState {
    /// The supervisor's own ref (a drain stops its children, then itself).
    myself: ActorRef<SupervisorMsg>,
    policy: SupervisionPolicy,
    roles: HashMap<ActorId, ChildRole>,
    handles: EngineHandles,
}

impl SupervisorState {
    fn apply(&mut self, decision: Decision) {
        match decision {
            Decision::Ignore => {}
            Decision::FailRank(dp) => {
                tracing::error!(%dp, "rank failed; its requests fail, the other ranks keep serving");
                if let Some(s) = self.handles.schedulers.get(dp.index()) {
                    let _ = s.cast(SchedulerMsg::RankLost(RankError::Lost {
                        message: format!("{dp} failed"),
                    }));
                }
                let _ = self.handles.frontend.cast(FrontendMsg::RankDown(dp));
            }
            Decision::RunWithout(service) => {
                tracing::warn!(%service, "a speed-only service failed; serving without it");
            }
            Decision::StopEngine { reason } => {
                tracing::error!(%reason, "engine stopped; every request fails until shutdown");
                for (dp, s) in self.handles.schedulers.iter().enumerate() {
                    let _ = s.cast(SchedulerMsg::RankLost(RankError::Lost {
                        message: reason.clone(),
                    }));
                    let _ = self
                        .handles
                        .frontend
                        .cast(FrontendMsg::RankDown(DpRank(dp as u16)));
                }
            }
        }
        m::set_failed_ranks(self.policy.failed_ranks());
    }
}

/// The actor (stateless handler; state in `SupervisorState`).
pub type NodeSupervisor = ShellActor<SupervisorState>;

impl Shell for SupervisorState {
    type Msg = SupervisorMsg;
    type Args = SupervisorArgs;

    async fn start(
        myself: ActorRef<Self::Msg>,
        args: Self::Args,
    ) -> Result<Self, ActorProcessingErr> {
        let engine_inflight = Arc::new(AtomicUsize::new(0));
        let mut roles = HashMap::new();
        let mut children = Children::new(myself.get_cell(), Duration::from_secs(10));
        let replay = match args.replay.clone() {
            Some(state) => {
                let replay = children.spawn::<ReplayActor>(state, "replay actor").await?;
                roles.insert(replay.get_id(), ChildRole::Service(Service::Replay));
                Some(replay)
            }
            None => None,
        };
        let mut ranks = Vec::with_capacity(args.dp_ranks);
        for index in 0..args.dp_ranks {
            let dp = DpRank(index as u16);
            let rank_args = RankArgs {
                dp,
                factory: args.factory.clone(),
            };
            let rank = children.spawn::<RankActor>(rank_args, dp).await?;
            roles.insert(rank.get_id(), ChildRole::Rank(dp));
            ranks.push(rank);
        }
        let dspark = children
            .or_stop(dspark_settings(&args, &ranks).await)
            .await?;
        let pools = children.or_stop(state_pools(&args, &ranks).await).await?;
        let mut schedulers = Vec::with_capacity(args.dp_ranks);
        for (index, (rank, pool)) in ranks.into_iter().zip(pools).enumerate() {
            let dp = DpRank(index as u16);
            let scheduler_args = SchedulerArgs {
                dp,
                limits: args.scheduler,
                pool,
                rank: rank.clone(),
                engine_inflight: engine_inflight.clone(),
                dspark: dspark.clone(),
                replay: replay.clone(),
                prefix: args.prefix,
            };
            let scheduler = children
                .spawn::<SchedulerActor>(scheduler_args, format!("scheduler of {dp}"))
                .await?;
            roles.insert(scheduler.get_id(), ChildRole::Scheduler(dp));
            children
                .or_stop(rank.cast(RankMsg::Attach(scheduler.clone())))
                .await?;
            schedulers.push(scheduler);
        }
        if let Some(settings) = &dspark {
            let drafter_args = DSparkArgs {
                schedulers: schedulers.clone(),
                max_draft_tokens: settings.max_draft_tokens,
            };
            let drafter = children
                .spawn::<DSparkActor>(drafter_args, "DSpark actor")
                .await?;
            roles.insert(drafter.get_id(), ChildRole::Service(Service::Drafter));
            for scheduler in &schedulers {
                children
                    .or_stop(scheduler.cast(SchedulerMsg::AttachDrafter(drafter.clone())))
                    .await?;
            }
        }
        if let Some(parallel) = args.factory.expert_parallel() {
            let spawned = crate::eplb::spawn_expert_actors(parallel, myself.get_cell()).await;
            let experts = children.or_stop(spawned).await?;
            for (ep, cell) in experts.groups {
                roles.insert(cell.get_id(), ChildRole::ExpertGroup(ep));
                children.add(cell);
            }
            roles.insert(experts.eplb.get_id(), ChildRole::Service(Service::Eplb));
            children.add(experts.eplb);
        }
        let frontend_args = FrontendArgs {
            schedulers: schedulers.clone(),
            codec: args.codec,
            grammar: args.grammar,
            limits: args.frontend,
            engine_inflight,
            prefix: args.prefix,
        };
        let frontend = children
            .spawn::<FrontendActor>(frontend_args, "frontend")
            .await?;
        roles.insert(frontend.get_id(), ChildRole::Frontend);
        let handles = EngineHandles {
            frontend,
            schedulers,
            replay,
        };
        let sent = args
            .handles
            .send(handles.clone())
            .map_err(|_| ActorProcessingErr::from("the engine stopped waiting for its actors"));
        children.or_stop(sent).await?;
        Ok(SupervisorState {
            myself,
            policy: SupervisionPolicy::new(args.dp_ranks, args.ep_ranks),
            roles,
            handles,
        })
    }

    async fn handle(&mut self, message: Self::Msg) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMsg::Health(reply) => {
                let _ = reply.send(self.policy.health());
            }
            SupervisorMsg::Drain(timeout, reply) => {
                self.policy.begin_shutdown();
                let deadline = Instant::now() + timeout;
                let _ = self
                    .handles
                    .frontend
                    .call(FrontendMsg::Close, Some(timeout))
                    .await;
                let mut drained = true;
                for scheduler in &self.handles.schedulers {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let done = scheduler.call(SchedulerMsg::Drain, Some(left)).await;
                    drained &= matches!(done, Ok(ractor::rpc::CallResult::Success(())));
                }
                tracing::info!(drained, "engine drained; stopping its actors");
                let _ = reply.send(DrainReport { drained });
                self.myself
                    .stop_children_and_wait(Some("shutdown".into()), Some(Duration::from_secs(30)))
                    .await;
                self.myself.stop(Some("shutdown".into()));
            }
        }
        Ok(())
    }

    async fn supervise(
        &mut self,
        _: ActorRef<Self::Msg>,
        event: SupervisionEvent,
    ) -> Result<(), ActorProcessingErr> {
        let (id, reason) = match &event {
            SupervisionEvent::ActorFailed(cell, error) => (cell.get_id(), error.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                cell.get_id(),
                reason.clone().unwrap_or_else(|| "terminated".into()),
            ),
            _ => return Ok(()),
        };
        if let Some(role) = self.roles.get(&id).copied() {
            let decision = self.policy.on_child_down(role, &reason);
            self.apply(decision);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::experts::factory::ExpertParallelFactory;
    use crate::experts::tiny_test_model;
    use crate::messages::dspark::DSparkMsg;
    use crate::rank::executor::{ExecutorLayer, LayeredFactory};
    use crate::rank::fake::{FakeConfig, FakeDrafter, FakeFactory};
    use crate::{Engine, EngineConfig, GenerateRequest, ModelFacts};
    use deepinfer_topology::NodeConfig;
    use policy::EngineHealth;

    /// A CPU topology of `dp` DP and `ep` EP ranks, DSpark on or off.
    fn node(dp: usize, ep: usize, dspark: bool) -> NodeConfig {
        NodeConfig::from_toml_str(
            &format!(
                "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = {dp}\nep = {ep}\n\
                 [scheduler]\nmax_batched_tokens = 64\nmax_running_requests = 4\nprefill_chunk_tokens = 16\n\
                 overlap_depth = 1\nadmission_queue_capacity = 8\n\
                 [dspark]\nenabled = {dspark}\nmax_draft_tokens = 5\nprofile_steps = 2\n"
            ),
            "supervisor test",
        )
        .expect("topology")
    }

    /// The fake backend with a drafter whose first three drafts are right, always confident.
    fn drafting() -> FakeConfig {
        FakeConfig {
            drafter: Some(FakeDrafter {
                block_size: 5,
                correct: 3,
                confidence: 30.0,
            }),
            ..FakeConfig::default()
        }
    }

    fn speculative_engine() -> EngineConfig {
        EngineConfig::fake(node(1, 1, true), drafting())
    }

    /// A layer that changes nothing: its factory counts the executors built.
    struct Unchanged;

    impl ExecutorLayer for Unchanged {}

    /// `inner` with a count of the executors it builds.
    fn counted(inner: Arc<dyn ExecutorFactory>) -> (Arc<dyn ExecutorFactory>, Arc<AtomicUsize>) {
        let builds = Arc::new(AtomicUsize::new(0));
        let count = builds.clone();
        let factory = LayeredFactory::layered(inner, "counted", move |_| {
            count.fetch_add(1, Ordering::SeqCst);
            Unchanged
        });
        (Arc::new(factory), builds)
    }

    /// Starts an engine of `node` over `factory`, generates greedily after each prompt (all in
    /// flight at once) and shuts it down; the outputs, the drafts the schedulers accepted and
    /// the executors the factory built.
    async fn serve(
        node: NodeConfig,
        factory: Arc<dyn ExecutorFactory>,
        model: ModelFacts,
        prompts: &[Vec<u32>],
    ) -> (Vec<Vec<u32>>, u64, usize) {
        let (executor, builds) = counted(factory);
        let engine = Engine::start(EngineConfig {
            node,
            executor,
            model,
            tokenizer: None,
        })
        .await
        .expect("engine starts");
        let mut streams = Vec::new();
        for prompt in prompts {
            let request = GenerateRequest::from_tokens(prompt.clone())
                .max_tokens(12)
                .ignore_eos(true);
            streams.push(engine.generate(request).await.expect("admitted"));
        }
        let mut outputs = Vec::new();
        for stream in streams {
            let done = tokio::time::timeout(Duration::from_secs(60), stream.collect())
                .await
                .expect("finishes in time")
                .expect("completes");
            outputs.push(done.tokens);
        }
        let stats = engine.handle().scheduler_stats().await.expect("stats");
        let accepted = stats.iter().map(|s| s.draft_tokens_accepted).sum();
        engine
            .shutdown(Duration::from_secs(10))
            .await
            .expect("shuts down");
        (outputs, accepted, builds.load(Ordering::SeqCst))
    }

    /// DSpark profiles on the ranks' own executors: the factory builds one executor per rank
    /// (no scratch executor for the profile), and the engine verifies drafts with the table
    /// and serves the tokens of DSpark off.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dspark_builds_one_executor_per_rank() {
        let fake = drafting();
        let facts = EngineConfig::fake(node(2, 1, true), fake.clone()).model;
        let prompts = [vec![5, 6, 7], vec![40, 41], vec![9]];
        let factory: Arc<dyn ExecutorFactory> = Arc::new(FakeFactory(fake));
        let (on, accepted, builds) =
            serve(node(2, 1, true), factory.clone(), facts, &prompts).await;
        let (off, _, _) = serve(node(2, 1, false), factory, facts, &prompts).await;
        assert_eq!(builds, 2, "one executor per DP rank");
        assert_eq!(on, off);
        assert!(accepted > 0, "DSpark verified drafts");
    }

    /// The same with expert parallelism on the CPU (dp = ep = 2, `LocalComm`): both ranks
    /// profile on their own executors, whose experts run on the shared shards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dspark_with_cpu_expert_parallelism_builds_one_executor_per_rank() {
        let (_dir, model) = tiny_test_model();
        let facts = ModelFacts::of(model.config());
        let prompts = [vec![5, 6, 7, 8], vec![40, 41]];
        let mut outputs = Vec::new();
        for dspark in [true, false] {
            let node = node(2, 2, dspark);
            let factory = ExpertParallelFactory::new(model.clone(), &node, "tiny".into())
                .expect("expert-parallel factory");
            let (out, _, builds) = serve(node, Arc::new(factory), facts, &prompts).await;
            assert_eq!(builds, 2, "one executor per DP rank (DSpark {dspark})");
            outputs.push(out);
        }
        assert_eq!(outputs[0], outputs[1], "DSpark on vs off");
        assert!(outputs[0].iter().all(|out| out.len() == 12));
    }

    async fn generate(engine: &Engine, prompt: &[u32]) -> Vec<u32> {
        let stream = engine
            .generate(GenerateRequest::from_tokens(prompt.to_vec()).max_tokens(16))
            .await
            .expect("admitted");
        tokio::time::timeout(Duration::from_secs(30), stream.collect())
            .await
            .expect("finishes in time")
            .expect("completes")
            .tokens
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn losing_the_drafter_degrades_the_engine_and_keeps_its_output() {
        let engine = Engine::start(speculative_engine())
            .await
            .expect("engine starts");
        let prompt = [5, 6, 7];
        let before = generate(&engine, &prompt).await;
        let handle = engine.handle();
        assert_eq!(
            handle.health().await.expect("health"),
            EngineHealth::Running
        );

        let drafter = handle
            .supervisor
            .get_cell()
            .get_children()
            .into_iter()
            .find(|child| child.is_message_type_of::<DSparkMsg>() == Some(true))
            .expect("the engine runs a DSpark actor");
        drafter.kill();
        let degraded = EngineHealth::Degraded {
            failed_ranks: vec![],
            lost_services: vec![Service::Drafter],
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while handle.health().await.expect("health") != degraded {
            assert!(Instant::now() < deadline, "the supervisor never saw it");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(generate(&engine, &prompt).await, before);
        engine
            .shutdown(Duration::from_secs(10))
            .await
            .expect("shuts down");
    }
}
