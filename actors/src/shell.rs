//! `Shell` and `ShellActor`: the one way the runtime's actors run on ractor.
//!
//! Every actor of the tree is a stateless handler whose state lives in a shell struct (the
//! scheduler's `SchedulerShell`, the rank's `RankState`, …). The shell implements [`Shell`]
//! (start from its arguments, handle a message, and optionally clean up after a stop or take its
//! children's supervision events), and [`ShellActor`] is the one `ractor::Actor` over it: each
//! actor type is `ShellActor<ItsShell>` under its own name (`pub type RankActor =
//! ShellActor<RankState>`), spawned and supervised like any ractor actor. [`Children`] spawns
//! them linked to a supervisor during its start, and stops those already up when the start fails.

use std::fmt::Display;
use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, Message, SupervisionEvent};

/// The state of an actor and how it starts, handles its messages and stops.
pub trait Shell: Sized + Send + 'static {
    /// The messages the actor accepts.
    type Msg: Message;
    /// What the actor is spawned with.
    type Args: Send + 'static;

    /// The state at start (ractor's `pre_start`); an error fails the spawn.
    fn start(
        myself: ActorRef<Self::Msg>,
        args: Self::Args,
    ) -> impl Future<Output = Result<Self, ActorProcessingErr>> + Send;

    /// Handles one message; an error fails the actor.
    fn handle(
        &mut self,
        message: Self::Msg,
    ) -> impl Future<Output = Result<(), ActorProcessingErr>> + Send;

    /// Cleans up once the actor stopped (ractor's `post_stop`); by default nothing.
    fn stopped(&mut self) -> impl Future<Output = Result<(), ActorProcessingErr>> + Send {
        async { Ok(()) }
    }

    /// A supervision event about one of the actor's linked children; by default ractor's own:
    /// any child that terminates or fails stops the actor.
    fn supervise(
        &mut self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
    ) -> impl Future<Output = Result<(), ActorProcessingErr>> + Send {
        async move {
            match event {
                SupervisionEvent::ActorTerminated(..) | SupervisionEvent::ActorFailed(..) => {
                    myself.stop(None);
                }
                _ => {}
            }
            Ok(())
        }
    }
}

/// The ractor actor that runs the shell `S` (the handler itself holds nothing).
pub struct ShellActor<S>(PhantomData<fn() -> S>);

impl<S> ShellActor<S> {
    /// The handler to spawn (`Actor::spawn(None, ReplayActor::new(), state)`).
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

impl<S> Default for ShellActor<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Shell> Actor for ShellActor<S> {
    type Msg = S::Msg;
    type State = S;
    type Arguments = S::Args;

    async fn pre_start(
        &self,
        myself: ActorRef<S::Msg>,
        args: S::Args,
    ) -> Result<S, ActorProcessingErr> {
        S::start(myself, args).await
    }

    async fn handle(
        &self,
        _myself: ActorRef<S::Msg>,
        message: S::Msg,
        shell: &mut S,
    ) -> Result<(), ActorProcessingErr> {
        shell.handle(message).await
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<S::Msg>,
        shell: &mut S,
    ) -> Result<(), ActorProcessingErr> {
        shell.stopped().await
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<S::Msg>,
        event: SupervisionEvent,
        shell: &mut S,
    ) -> Result<(), ActorProcessingErr> {
        shell.supervise(myself, event).await
    }
}

/// The children a supervisor's start has spawned so far: when the start fails, they are stopped
/// (each waited for up to the stop timeout) before the error is returned.
pub struct Children {
    supervisor: ActorCell,
    stop_timeout: Duration,
    started: Vec<ActorCell>,
}

impl Children {
    /// No children yet of `supervisor`; a failed start waits up to `stop_timeout` for each.
    pub fn new(supervisor: ActorCell, stop_timeout: Duration) -> Self {
        Self {
            supervisor,
            stop_timeout,
            started: Vec::new(),
        }
    }

    /// Spawns an `A` (`children.spawn::<RankActor>(args, dp)`) linked to the supervisor and
    /// counts it as started; when the spawn fails, stops the children started so far and
    /// answers `"{what}: {error}"`.
    pub async fn spawn<A: Actor + Default>(
        &mut self,
        args: A::Arguments,
        what: impl Display,
    ) -> Result<ActorRef<A::Msg>, String> {
        let spawned = Actor::spawn_linked(None, A::default(), args, self.supervisor.clone()).await;
        match self.or_stop(spawned).await {
            Ok((child, _)) => {
                self.add(child.get_cell());
                Ok(child)
            }
            Err(e) => Err(format!("{what}: {e}")),
        }
    }

    /// Counts a child spawned elsewhere as started.
    pub fn add(&mut self, child: ActorCell) {
        self.started.push(child);
    }

    /// `result`, after stopping the children started so far when it is an error.
    pub async fn or_stop<T, E>(&self, result: Result<T, E>) -> Result<T, E> {
        if result.is_err() {
            for cell in &self.started {
                let _ = cell
                    .stop_and_wait(Some("engine start failed".into()), Some(self.stop_timeout))
                    .await;
            }
        }
        result
    }
}
