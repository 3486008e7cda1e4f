//! `Lockstep`: the step count of DP ranks whose MoE layers are collectives (expert parallelism
//! on CUDA, `deepinfer_model::backend::cuda::ep`: every layer an all-to-all of every EP rank).
//!
//! Such ranks must run the same number of steps, each one pass over every backbone layer. A rank
//! leads a step when it has work of its own (`begin`); a rank with none follows: while a peer has
//! begun more steps than it (`behind`), it runs idle steps (every layer's collective with no
//! rows, `ExpertHost::idle_expert_step`), so a busy rank never waits for an idle one past one poll of
//! its thread (`FOLLOW_POLL`). The scheduler's `Idle` plans only make a rank follow; they never
//! begin a step, so idle ranks never lead one another. A placement epoch is committed at the
//! first step index no rank has begun (`commit`, under the same lock as `begin`), so every rank
//! adopts it at the same step boundary and no step mixes epochs.

use std::sync::Mutex;
use std::time::Duration;

use deepinfer_topology::PlacementEpoch;

/// How often an idle rank thread looks for peers' steps to follow.
pub const FOLLOW_POLL: Duration = Duration::from_micros(200);

/// Steps begun by each rank of one expert-parallel group, and the placement epoch of each step.
#[derive(Debug)]
pub struct Lockstep {
    state: Mutex<Steps>,
}

#[derive(Debug)]
struct Steps {
    started: Vec<u64>,
    /// `(first step, epoch)` of every commit, in order (epoch 0 from step 0).
    commits: Vec<(u64, PlacementEpoch)>,
}

impl Lockstep {
    /// `ranks` ranks, none stepped yet, on epoch 0.
    pub fn new(ranks: usize) -> Lockstep {
        Lockstep {
            state: Mutex::new(Steps {
                started: vec![0; ranks],
                commits: vec![(0, PlacementEpoch(0))],
            }),
        }
    }

    pub fn ranks(&self) -> usize {
        self.lock().started.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Steps> {
        // The counts stay consistent under a panic (each update is one assignment).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank `rank` begins a step: the step's index (0-based, the same on every rank for the same
    /// collectives) and the placement epoch it runs on.
    pub fn begin(&self, rank: usize) -> (u64, PlacementEpoch) {
        let mut steps = self.lock();
        let index = steps.started[rank];
        steps.started[rank] += 1;
        let epoch = steps
            .commits
            .iter()
            .rev()
            .find(|(from, _)| *from <= index)
            .map_or(PlacementEpoch(0), |&(_, epoch)| epoch);
        (index, epoch)
    }

    /// Steps rank `rank` must still run to reach the furthest peer (0: none is ahead).
    pub fn behind(&self, rank: usize) -> u64 {
        let steps = self.lock();
        let furthest = steps.started.iter().copied().max().unwrap_or(0);
        furthest - steps.started[rank]
    }

    /// The most steps any rank has begun (the group's step count once none is behind).
    pub fn steps(&self) -> u64 {
        self.lock().started.iter().copied().max().unwrap_or(0)
    }

    /// Every step from the first one no rank has begun yet runs on `epoch`; returns that step.
    pub fn commit(&self, epoch: PlacementEpoch) -> u64 {
        let mut steps = self.lock();
        let from = steps.started.iter().copied().max().unwrap_or(0);
        steps.commits.push((from, epoch));
        from
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A leader's steps make the others behind by as many; following catches them up and
    /// gives them the leader's step indices; nobody is behind an idle group.
    #[test]
    fn followers_catch_up_with_the_leader() {
        let lockstep = Lockstep::new(3);
        assert_eq!(
            (lockstep.ranks(), lockstep.behind(1), lockstep.steps()),
            (3, 0, 0)
        );
        assert_eq!(lockstep.begin(0), (0, PlacementEpoch(0)));
        assert_eq!(lockstep.begin(0), (1, PlacementEpoch(0)));
        assert_eq!(
            (lockstep.behind(0), lockstep.behind(1), lockstep.behind(2)),
            (0, 2, 2)
        );
        assert_eq!(lockstep.steps(), 2);
        // Rank 2 runs work of its own meanwhile: its step pairs with the leader's step 0.
        assert_eq!(lockstep.begin(2).0, 0);
        assert_eq!((lockstep.behind(1), lockstep.behind(2)), (2, 1));
        let followed: Vec<u64> = (0..lockstep.behind(1))
            .map(|_| lockstep.begin(1).0)
            .collect();
        assert_eq!(followed, vec![0, 1]);
        assert_eq!(lockstep.begin(2).0, 1);
        assert!((0..3).all(|r| lockstep.behind(r) == 0));
        assert_eq!(lockstep.steps(), 2);
    }

    /// A commit takes effect at the first step no rank has begun: a rank already in that
    /// step's predecessor finishes it on the old epoch, every rank runs that step on the new one.
    #[test]
    fn a_commit_starts_at_a_step_no_rank_has_begun() {
        let lockstep = Lockstep::new(2);
        lockstep.begin(0);
        lockstep.begin(0);
        lockstep.begin(1);
        assert_eq!(lockstep.commit(PlacementEpoch(1)), 2);
        // Rank 1 catches up on epoch 0, then both run step 2 on epoch 1.
        assert_eq!(lockstep.begin(1), (1, PlacementEpoch(0)));
        assert_eq!(lockstep.begin(1), (2, PlacementEpoch(1)));
        assert_eq!(lockstep.begin(0), (2, PlacementEpoch(1)));
        assert_eq!(lockstep.commit(PlacementEpoch(2)), 3);
        assert_eq!(lockstep.begin(0), (3, PlacementEpoch(2)));
        assert_eq!(lockstep.begin(1), (3, PlacementEpoch(2)));
    }

    /// Ranks on threads, each leading a different number of steps, then following the others
    /// until none is behind, end on the same count: the most steps any rank led.
    #[test]
    fn threads_that_follow_end_on_the_same_step() {
        let lockstep = Arc::new(Lockstep::new(4));
        std::thread::scope(|s| {
            for rank in 0..4 {
                let lockstep = lockstep.clone();
                s.spawn(move || {
                    for _ in 0..(rank * 5) {
                        lockstep.begin(rank);
                    }
                });
            }
        });
        // Nobody followed yet: the counts are the steps each led.
        assert_eq!(lockstep.behind(0), 15);
        for rank in 0..4 {
            while lockstep.behind(rank) > 0 {
                lockstep.begin(rank);
            }
        }
        assert!((0..4).all(|r| lockstep.behind(r) == 0));
        assert_eq!(lockstep.steps(), 15);
    }
}
