//! The supervisor's failure policy, as a pure function of what failed.
//!
//! The policy (ARCHITECTURE.md §4, aesthetics.md §3.4), decided here and nowhere else:
//! 1. Nothing restarts. A rank's device state (KV caches, expert shards) is gone with it, and a
//!    rank restarted in the middle of a collective would hang its peers.
//! 2. A rank fails while experts are local to each rank (`ep == 1`): only that rank's requests
//!    fail, with `RankFailed { dp }`; the rank is taken out of routing; the engine is
//!    `Degraded` and the other ranks keep serving. When the last rank fails the engine is
//!    `Stopped`.
//! 3. A rank fails while expert parallelism spans ranks (`ep > 1`): every rank's requests fail
//!    (the survivors could not complete a collective) and the engine is `Stopped`. An exchange of
//!    expert rows that fails or times out (a peer rank, or another node, gone or silent) fails
//!    the step, so the rank: this rule. Across nodes, each node applies it to itself: the
//!    others stop at their next exchange with the lost node (refused or timed out); nothing
//!    rejoins a running deployment.
//! 4. A scheduler or the frontend fails: the control plane lost state it cannot rebuild; the
//!    engine is `Stopped` and all requests fail.
//! 5. An expert group fails: its shard of the routed experts (and its placement state) is gone
//!    and every rank's MoE layers need it; the engine is `Stopped`.
//! 6. A service that only buys speed fails — the EPLB rebalancer, the DSpark drafter, the replay
//!    planner: the engine keeps serving exactly, without it (the placement stays on its last
//!    committed epoch; decoding verifies no drafts; prompts prefill every decoder position). The
//!    engine is `Degraded` and names the lost service.
//! 7. A child that terminates during shutdown is expected and ignored.
//!
//! A `Stopped` engine keeps its actors until `shutdown` so callers get errors, not hangs.

use std::collections::BTreeSet;

use deepinfer_topology::{DpRank, EpRank};

/// Which child an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildRole {
    Rank(DpRank),
    Scheduler(DpRank),
    Frontend,
    ExpertGroup(EpRank),
    Service(Service),
}

/// A child whose loss costs speed, never correctness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Service {
    /// The `EplbActor` (expert placement rebalancing).
    Eplb,
    /// The `DSparkActor` (speculative proposals).
    Drafter,
    /// The `ReplayActor` (decoder bounded replay planning).
    Replay,
}

impl std::fmt::Display for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Service::Eplb => "the EPLB rebalancer",
            Service::Drafter => "the DSpark drafter",
            Service::Replay => "the bounded-replay planner",
        })
    }
}

/// The engine's health as the supervisor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    Running,
    /// Some ranks or speed-only services failed; the rest serves.
    Degraded {
        failed_ranks: Vec<DpRank>,
        lost_services: Vec<Service>,
    },
    /// Nothing serves; requests fail until shutdown.
    Stopped {
        reason: String,
    },
}

/// What the supervisor must do about a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Fail this rank's requests and route around it.
    FailRank(DpRank),
    /// Fail every rank's requests and refuse new ones.
    StopEngine { reason: String },
    /// Keep serving without this service.
    RunWithout(Service),
    /// Nothing (expected termination).
    Ignore,
}

/// The policy's state: topology facts and what has failed so far.
#[derive(Debug)]
pub struct SupervisionPolicy {
    dp_ranks: usize,
    ep_ranks: usize,
    failed: BTreeSet<DpRank>,
    lost: BTreeSet<Service>,
    stopped: Option<String>,
    shutting_down: bool,
}

impl SupervisionPolicy {
    pub fn new(dp_ranks: usize, ep_ranks: usize) -> Self {
        SupervisionPolicy {
            dp_ranks,
            ep_ranks,
            failed: BTreeSet::new(),
            lost: BTreeSet::new(),
            stopped: None,
            shutting_down: false,
        }
    }

    /// From now on terminations are expected.
    pub fn begin_shutdown(&mut self) {
        self.shutting_down = true;
    }

    /// A child failed or terminated unexpectedly.
    pub fn on_child_down(&mut self, role: ChildRole, reason: &str) -> Decision {
        if self.shutting_down || self.stopped.is_some() {
            return Decision::Ignore;
        }
        let decision = match role {
            ChildRole::Rank(dp) if self.ep_ranks > 1 => Decision::StopEngine {
                reason: format!(
                    "{dp} failed while expert parallelism spans {} ranks: {reason}",
                    self.ep_ranks
                ),
            },
            ChildRole::Rank(dp) => {
                if !self.failed.insert(dp) {
                    return Decision::Ignore;
                }
                if self.failed.len() == self.dp_ranks {
                    Decision::StopEngine {
                        reason: format!("every DP rank has failed; the last, {dp}: {reason}"),
                    }
                } else {
                    Decision::FailRank(dp)
                }
            }
            ChildRole::Scheduler(dp) => Decision::StopEngine {
                reason: format!("the scheduler of {dp} failed: {reason}"),
            },
            ChildRole::Frontend => Decision::StopEngine {
                reason: format!("the frontend failed: {reason}"),
            },
            ChildRole::ExpertGroup(ep) => Decision::StopEngine {
                reason: format!("expert group {ep} failed, its experts are gone: {reason}"),
            },
            ChildRole::Service(service) => {
                if !self.lost.insert(service) {
                    return Decision::Ignore;
                }
                Decision::RunWithout(service)
            }
        };
        if let Decision::StopEngine { reason } = &decision {
            self.stopped = Some(reason.clone());
        }
        decision
    }

    pub fn failed_ranks(&self) -> usize {
        self.failed.len()
    }

    pub fn health(&self) -> EngineHealth {
        match (
            &self.stopped,
            self.failed.is_empty() && self.lost.is_empty(),
        ) {
            (Some(reason), _) => EngineHealth::Stopped {
                reason: reason.clone(),
            },
            (None, true) => EngineHealth::Running,
            (None, false) => EngineHealth::Degraded {
                failed_ranks: self.failed.iter().copied().collect(),
                lost_services: self.lost.iter().copied().collect(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pure_dp_rank_failure_degrades_then_stops_at_the_last_rank() {
        let mut p = SupervisionPolicy::new(2, 1);
        assert_eq!(
            p.on_child_down(ChildRole::Rank(DpRank(1)), "panic"),
            Decision::FailRank(DpRank(1))
        );
        assert_eq!(
            p.on_child_down(ChildRole::Rank(DpRank(1)), "again"),
            Decision::Ignore
        );
        assert_eq!(
            p.health(),
            EngineHealth::Degraded {
                failed_ranks: vec![DpRank(1)],
                lost_services: vec![],
            }
        );
        assert!(matches!(
            p.on_child_down(ChildRole::Rank(DpRank(0)), "x"),
            Decision::StopEngine { .. }
        ));
        assert!(matches!(p.health(), EngineHealth::Stopped { .. }));
    }

    #[test]
    fn rank_failure_under_expert_parallelism_stops_everything() {
        let mut p = SupervisionPolicy::new(4, 4);
        let d = p.on_child_down(ChildRole::Rank(DpRank(2)), "boom");
        assert!(
            matches!(d, Decision::StopEngine { ref reason } if reason.contains("dp2") && reason.contains("boom"))
        );
    }

    #[test]
    fn expert_group_failure_stops_and_speed_services_degrade() {
        let mut p = SupervisionPolicy::new(2, 4);
        assert_eq!(
            p.on_child_down(ChildRole::Service(Service::Drafter), "x"),
            Decision::RunWithout(Service::Drafter)
        );
        assert_eq!(
            p.on_child_down(ChildRole::Service(Service::Drafter), "again"),
            Decision::Ignore
        );
        assert_eq!(
            p.on_child_down(ChildRole::Service(Service::Eplb), "y"),
            Decision::RunWithout(Service::Eplb)
        );
        assert_eq!(
            p.health(),
            EngineHealth::Degraded {
                failed_ranks: vec![],
                lost_services: vec![Service::Eplb, Service::Drafter],
            }
        );
        let d = p.on_child_down(ChildRole::ExpertGroup(EpRank(3)), "oom");
        assert!(
            matches!(d, Decision::StopEngine { ref reason } if reason.contains("ep3") && reason.contains("oom")),
            "{d:?}"
        );
        assert!(matches!(p.health(), EngineHealth::Stopped { .. }));
    }

    #[test]
    fn control_plane_failure_stops_and_shutdown_is_ignored() {
        let mut p = SupervisionPolicy::new(4, 1);
        assert!(matches!(
            p.on_child_down(ChildRole::Frontend, "x"),
            Decision::StopEngine { .. }
        ));
        let mut q = SupervisionPolicy::new(4, 1);
        q.begin_shutdown();
        assert_eq!(
            q.on_child_down(ChildRole::Scheduler(DpRank(0)), "stopped"),
            Decision::Ignore
        );
        assert_eq!(q.health(), EngineHealth::Running);
    }
}
