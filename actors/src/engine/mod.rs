//! The embedding API: `Engine::start(config)`, `generate(request) -> EventStream`,
//! `shutdown(timeout)`.
//!
//! An engine is one `NodeSupervisor` tree spawned on the caller's tokio runtime, with no
//! process-global state (no registered actor names), so several engines can live in one
//! process. `EngineHandle` is the cloneable, `Send + Sync` part callers pass around.

pub mod request;
pub mod stream;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_topology::NodeConfig;
use ractor::Actor;
use tokio::sync::oneshot;

use crate::error::EngineError;
use crate::frontend::codec::TextCodec;
use crate::frontend::state::FrontendLimits;
use crate::grammar::GrammarEngine;
use crate::messages::frontend::FrontendMsg;
use crate::messages::replay::ReplayMsg;
use crate::messages::scheduler::{SchedulerMsg, SchedulerStats};
use crate::messages::supervisor::{DrainReport, SupervisorMsg};
use crate::rank::executor::ExecutorFactory;
use crate::rank::fake::{FakeConfig, FakeFactory};
use crate::replay::state::ReplayStats;
use crate::scheduler::pool::PoolPlan;
use crate::scheduler::prefix::PrefixSettings;
use crate::scheduler::state::SchedulerLimits;
use crate::supervisor::policy::EngineHealth;
use crate::supervisor::{EngineHandles, NodeSupervisor, SupervisorArgs};
use request::GenerateRequest;
use stream::EventStream;

/// Facts about the served model the runtime validates against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelFacts {
    pub vocab_size: usize,
    pub bos_token_id: u32,
    /// `None` when the backend has no end-of-sequence token.
    pub eos_token_id: Option<u32>,
    /// Prompt + generated tokens per sequence.
    pub max_context_tokens: usize,
}

impl ModelFacts {
    /// The facts of a model's `config.json`.
    pub fn of(cfg: &deepinfer_model::config::ModelConfig) -> ModelFacts {
        ModelFacts {
            vocab_size: cfg.vocab_size,
            bos_token_id: cfg.bos_token_id,
            eos_token_id: Some(cfg.eos_token_id),
            max_context_tokens: cfg.max_position_embeddings,
        }
    }
}

/// Everything `Engine::start` needs.
pub struct EngineConfig {
    /// The validated topology (`[parallel]`, `[scheduler]`, `[sampling]` are used here).
    pub node: NodeConfig,
    /// Builds each rank's executor (on the rank's thread).
    pub executor: Arc<dyn ExecutorFactory>,
    pub model: ModelFacts,
    /// `tokenizer.json`; `None` = token-id requests only.
    pub tokenizer: Option<PathBuf>,
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("node", &self.node.origin)
            .field("executor", &self.executor.describe())
            .field("model", &self.model)
            .field("tokenizer", &self.tokenizer)
            .finish()
    }
}

impl EngineConfig {
    /// An engine on the deterministic fake backend (tests, simulations). EOS is token 1.
    pub fn fake(node: NodeConfig, fake: FakeConfig) -> Self {
        let model = ModelFacts {
            vocab_size: fake.vocab_size,
            bos_token_id: 0,
            eos_token_id: Some(1),
            max_context_tokens: 1 << 16,
        };
        EngineConfig {
            node,
            executor: Arc::new(FakeFactory(fake)),
            model,
            tokenizer: None,
        }
    }

    fn scheduler_limits(&self) -> SchedulerLimits {
        SchedulerLimits::from_node(&self.node)
    }

    fn frontend_limits(&self) -> FrontendLimits {
        FrontendLimits {
            admission_capacity: self.node.scheduler.admission_queue_capacity as usize,
            vocab_size: self.model.vocab_size,
            max_context_tokens: self.model.max_context_tokens,
            default_max_tokens: self.node.sampling.max_tokens as usize,
            eos_token_id: self.model.eos_token_id,
            base_seed: self.node.sampling.seed,
        }
    }
}

/// The cloneable handle to a running engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    handles: EngineHandles,
    pub(crate) supervisor: ractor::ActorRef<SupervisorMsg>,
    codec: Option<Arc<TextCodec>>,
}

const CALL_TIMEOUT: Duration = Duration::from_secs(60);

fn actor_gone<E: std::fmt::Display>(e: E) -> EngineError {
    EngineError::internal(format!("engine actor unreachable: {e}"))
}

impl EngineHandle {
    /// Admits a request; `Err(Overloaded)` at the admission limit, `Err(Invalid)` for a bad
    /// request. Events arrive on the returned stream.
    pub async fn generate(&self, request: GenerateRequest) -> Result<EventStream, EngineError> {
        let submitted = self
            .handles
            .frontend
            .call(
                |reply| FrontendMsg::Submit(Box::new(request), reply),
                Some(CALL_TIMEOUT),
            )
            .await;
        match submitted {
            Ok(ractor::rpc::CallResult::Success(Ok(submission))) => Ok(EventStream::new(
                submission,
                self.handles.frontend.clone(),
                self.codec.clone(),
            )),
            Ok(ractor::rpc::CallResult::Success(Err(e))) => Err(e),
            Ok(ractor::rpc::CallResult::Timeout) => {
                Err(EngineError::internal("the frontend did not answer"))
            }
            Ok(ractor::rpc::CallResult::SenderError) | Err(_) => Err(EngineError::ShuttingDown),
        }
    }

    /// Each rank's scheduler snapshot, in DP order.
    pub async fn scheduler_stats(&self) -> Result<Vec<SchedulerStats>, EngineError> {
        let mut all = Vec::with_capacity(self.handles.schedulers.len());
        for s in &self.handles.schedulers {
            let stats = ractor::call_t!(s, SchedulerMsg::Stats, CALL_TIMEOUT.as_millis() as u64)
                .map_err(actor_gone)?;
            all.push(stats);
        }
        Ok(all)
    }

    /// The `ReplayActor`'s counts (admitted suffixes, rewinds, refusals); `None` with bounded
    /// replay off or once the actor is gone (the engine then prefills every decoder position).
    pub async fn replay_stats(&self) -> Result<Option<ReplayStats>, EngineError> {
        let Some(replay) = &self.handles.replay else {
            return Ok(None);
        };
        match ractor::call_t!(replay, ReplayMsg::Stats, CALL_TIMEOUT.as_millis() as u64) {
            Ok(stats) => Ok(Some(stats)),
            Err(_) => Ok(None),
        }
    }

    /// The supervisor's view of the engine.
    pub async fn health(&self) -> Result<EngineHealth, EngineError> {
        ractor::call_t!(
            self.supervisor,
            SupervisorMsg::Health,
            CALL_TIMEOUT.as_millis() as u64
        )
        .map_err(actor_gone)
    }

    /// The tokenizer, when the engine has one.
    pub fn codec(&self) -> Option<&Arc<TextCodec>> {
        self.codec.as_ref()
    }

    /// Number of DP ranks.
    pub fn dp_ranks(&self) -> usize {
        self.handles.schedulers.len()
    }
}

/// A running engine: its handle plus ownership of the actor tree.
#[derive(Debug)]
pub struct Engine {
    handle: EngineHandle,
    /// The supervisor's task; taken by `shutdown`.
    join: Option<tokio::task::JoinHandle<()>>,
}

/// An engine dropped without `shutdown` stops its actor tree: admitted requests end with an
/// error, the rank threads finish their current step and exit (they would otherwise stay parked
/// until the process ends).
impl Drop for Engine {
    fn drop(&mut self) {
        if self.join.is_some() {
            self.handle
                .supervisor
                .stop(Some("the engine was dropped without shutdown".into()));
        }
    }
}

impl Engine {
    /// Spawns the actor tree on the current tokio runtime and waits until every rank's executor
    /// is built.
    pub async fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        // This process's DP ranks (all of them on one node).
        let dp_ranks = usize::from(config.node.dp_on_node());
        if dp_ranks == 0 {
            return Err(EngineError::Config {
                field: "parallel.dp".into(),
                message: "must be >= 1".into(),
            });
        }
        let (asked, runs) = (
            config.node.parallel.context_parallel,
            config.executor.context_parallel(),
        );
        if asked != runs {
            return Err(EngineError::Config {
                field: "parallel.context_parallel".into(),
                message: format!(
                    "the topology asks for {asked:?} but the executors ({}) run {runs:?}",
                    config.executor.describe()
                ),
            });
        }
        let codec = match &config.tokenizer {
            Some(path) => {
                let path = path.clone();
                let (bos, family) = (config.model.bos_token_id, config.executor.family());
                let codec =
                    tokio::task::spawn_blocking(move || TextCodec::load_for(&path, bos, family))
                        .await
                        .map_err(|e| {
                            EngineError::internal(format!("tokenizer loading panicked: {e}"))
                        })??;
                if codec.vocab_size() > config.model.vocab_size {
                    return Err(EngineError::Config {
                        field: "tokenizer".into(),
                        message: format!(
                            "the tokenizer has {} tokens but the model only {}",
                            codec.vocab_size(),
                            config.model.vocab_size
                        ),
                    });
                }
                Some(Arc::new(codec))
            }
            None => None,
        };
        let grammar = match &config.tokenizer {
            Some(path) => {
                let path = path.clone();
                let built = tokio::task::spawn_blocking(move || {
                    GrammarEngine::from_tokenizer_file(&path).map_err(|e| EngineError::Tokenizer {
                        path: path.clone(),
                        message: format!("structured outputs: {e}"),
                    })
                })
                .await
                .map_err(|e| EngineError::internal(format!("grammar setup panicked: {e}")))??;
                Some(Arc::new(built))
            }
            None => None,
        };
        tracing::info!(dp = dp_ranks, executor = %config.executor.describe(), "engine starting");
        let prefix = PrefixSettings::for_engine(
            &config.node.prefix_cache,
            &config.node.replay,
            config.executor.prefix_geometry(),
            (&config.executor.describe(), &config.node.device.backend),
        )?;
        // Each rank's pool is cut once the ranks are up (a fraction of the memory is read
        // after their weights are resident: `supervisor::state_pools`).
        let pools = config.executor.state_bytes().map(|bytes| PoolPlan {
            bytes,
            memory: config.node.memory,
            prefix_bytes: prefix.as_ref().map_or(0, |cache| cache.budget_bytes),
        });
        let (handles_tx, handles_rx) = oneshot::channel();
        let args = SupervisorArgs {
            dp_ranks,
            ep_ranks: usize::from(config.node.parallel.ep),
            scheduler: config.scheduler_limits(),
            pools,
            frontend: config.frontend_limits(),
            factory: config.executor.clone(),
            codec: codec.clone(),
            grammar,
            handles: handles_tx,
            dspark: config.node.dspark,
            replay: crate::replay::engine_replay(
                &config.node.replay,
                config.executor.sliding_window(),
                deepinfer_model::v41::MAX_BACKTRACK,
            )?,
            prefix,
        };
        let (supervisor, join) = Actor::spawn(None, NodeSupervisor::new(), args)
            .await
            .map_err(|e| startup_error(&e))?;
        let handles = handles_rx
            .await
            .map_err(|_| EngineError::internal("the supervisor did not report its actors"))?;
        Ok(Engine {
            handle: EngineHandle {
                handles,
                supervisor,
                codec,
            },
            join: Some(join),
        })
    }

    /// A cloneable handle.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// See `EngineHandle::generate`.
    pub async fn generate(&self, request: GenerateRequest) -> Result<EventStream, EngineError> {
        self.handle.generate(request).await
    }

    /// Graceful shutdown: refuse new requests, let admitted ones finish (at most `timeout`),
    /// then stop every actor and join the rank threads. Requests still running at the timeout
    /// end with `ShuttingDown`.
    pub async fn shutdown(mut self, timeout: Duration) -> Result<DrainReport, EngineError> {
        let join = self.join.take();
        let supervisor = self.handle.supervisor.clone();
        let report = supervisor
            .call(
                |reply| SupervisorMsg::Drain(timeout, reply),
                Some(timeout + Duration::from_secs(30)),
            )
            .await
            .map_err(actor_gone)?;
        let report = match report {
            ractor::rpc::CallResult::Success(report) => report,
            _ => {
                return Err(EngineError::internal(
                    "the supervisor did not answer the drain",
                ));
            }
        };
        if let Some(join) = join {
            let _ = tokio::time::timeout(Duration::from_secs(60), join).await;
        }
        Ok(report)
    }
}

/// The engine's error for a start that failed: a config error found once the ranks were up
/// (their state budget) as it is, anything else as `Startup`.
fn startup_error(e: &ractor::SpawnErr) -> EngineError {
    if let ractor::SpawnErr::StartupFailed(inner) = e
        && let Some(config @ EngineError::Config { .. }) = inner.downcast_ref::<EngineError>()
    {
        return config.clone();
    }
    EngineError::Startup {
        dp: 0,
        message: spawn_error_text(e),
    }
}

fn spawn_error_text(e: &ractor::SpawnErr) -> String {
    match e {
        ractor::SpawnErr::StartupFailed(inner) => inner.to_string(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync + Clone + 'static>() {}

    #[test]
    fn handle_is_send_sync_clone() {
        assert_send_sync::<EngineHandle>();
    }
}
