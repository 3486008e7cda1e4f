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
//!
//! Across nodes (CUDA ranks of several `deepinfer-node` processes, `Lockstep::across_nodes`)
//! the other nodes' ranks count too: `NodePeers` says how many steps they began (as last heard,
//! `comm::steps::StepBeacon`) and hears of each step a rank of this node leads beyond that,
//! so an idle rank of one node follows a busy rank of another. A placement is committed across
//! nodes at a step agreed by all of them (`experts::device`): each node holds its ranks before
//! the proposed step if none of them has begun it (`hold_at`: a rank reaching it waits in
//! `begin_within`, at most its timeout), then commits there (`commit_at`) or lets them go
//! (`release`); `interrupt` wakes the held ranks for good when the agreement fails.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use deepinfer_topology::PlacementEpoch;

/// How often an idle rank thread looks for peers' steps to follow.
pub const FOLLOW_POLL: Duration = Duration::from_micros(200);

/// The ranks of the other nodes of a deployment, whose collectives this group's ranks join.
pub trait NodePeers: Send + Sync + std::fmt::Debug {
    /// The most steps a rank of another node has begun, as last heard.
    fn began(&self) -> u64;
    /// A rank of this node began step `steps - 1`, which no rank heard of had: tell the other
    /// nodes (called under the lockstep's lock: must not block).
    fn announce(&self, steps: u64);
}

/// Steps begun by each rank of one expert-parallel group, and the placement epoch of each step.
#[derive(Debug)]
pub struct Lockstep {
    state: Mutex<Steps>,
    /// Wakes ranks held before a step.
    released: Condvar,
    /// The other nodes' ranks (`None`: every rank of the group is in this process).
    peers: Option<Arc<dyn NodePeers>>,
}

#[derive(Debug)]
struct Steps {
    started: Vec<u64>,
    /// `(first step, epoch)` of every commit, in order (epoch 0 from step 0).
    commits: Vec<(u64, PlacementEpoch)>,
    /// No rank begins this step until it is released or committed at.
    hold: Option<u64>,
    /// Held ranks stop waiting (the agreement failed).
    interrupted: bool,
}

/// Why a rank did not begin its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// It waited before this step for the whole timeout.
    TimedOut(u64),
    /// The hold before this step was interrupted.
    Interrupted(u64),
}

impl Lockstep {
    /// `ranks` ranks, none stepped yet, on epoch 0.
    pub fn new(ranks: usize) -> Lockstep {
        Lockstep {
            state: Mutex::new(Steps {
                started: vec![0; ranks],
                commits: vec![(0, PlacementEpoch(0))],
                hold: None,
                interrupted: false,
            }),
            released: Condvar::new(),
            peers: None,
        }
    }

    /// This node's `ranks` ranks of a group spanning several nodes, whose other ranks are
    /// `peers`.
    pub fn across_nodes(ranks: usize, peers: Arc<dyn NodePeers>) -> Lockstep {
        Lockstep {
            peers: Some(peers),
            ..Lockstep::new(ranks)
        }
    }

    /// The most steps a rank of this node or (as heard) another has begun.
    fn furthest(&self, steps: &Steps) -> u64 {
        let here = steps.started.iter().copied().max().unwrap_or(0);
        here.max(self.peers.as_ref().map_or(0, |p| p.began()))
    }

    pub fn ranks(&self) -> usize {
        self.lock().started.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Steps> {
        // The counts stay consistent under a panic (each update is one assignment).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank `rank` begins a step: the step's index (0-based, the same on every rank for the same
    /// collectives) and the placement epoch it runs on. (Never held: see `begin_within`.)
    pub fn begin(&self, rank: usize) -> (u64, PlacementEpoch) {
        let mut steps = self.lock();
        self.take_step(&mut steps, rank)
    }

    /// `begin`, waiting first, at most `wait`, while this node's ranks are held before the
    /// step (`hold_at`).
    pub fn begin_within(&self, rank: usize, wait: Duration) -> Result<(u64, PlacementEpoch), Held> {
        let deadline = Instant::now() + wait;
        let mut steps = self.lock();
        loop {
            let index = steps.started[rank];
            match steps.hold {
                Some(held) if index >= held => {
                    if steps.interrupted {
                        return Err(Held::Interrupted(held));
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Held::TimedOut(held));
                    }
                    steps = self
                        .released
                        .wait_timeout(steps, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                _ => return Ok(self.take_step(&mut steps, rank)),
            }
        }
    }

    fn take_step(&self, steps: &mut Steps, rank: usize) -> (u64, PlacementEpoch) {
        let index = steps.started[rank];
        if let Some(peers) = &self.peers
            && index >= self.furthest(steps)
        {
            peers.announce(index + 1);
        }
        steps.started[rank] += 1;
        let epoch = steps
            .commits
            .iter()
            .rev()
            .find(|(from, _)| *from <= index)
            .map_or(PlacementEpoch(0), |&(_, epoch)| epoch);
        (index, epoch)
    }

    /// Holds this node's ranks before `step` unless one of them has begun it: `Err` with the
    /// most steps a rank of this node began. A hold already set moves to `step`.
    pub fn hold_at(&self, step: u64) -> Result<(), u64> {
        let mut steps = self.lock();
        let began = steps.started.iter().copied().max().unwrap_or(0);
        if began > step {
            return Err(began);
        }
        steps.hold = Some(step);
        steps.interrupted = false;
        self.released.notify_all();
        Ok(())
    }

    /// Holds this node's ranks before the step `margin` past the first one no rank, of this node
    /// or heard of, has begun; returns that step.
    pub fn hold_beyond(&self, margin: u64) -> u64 {
        let mut steps = self.lock();
        let step = self.furthest(&steps) + margin;
        steps.hold = Some(step);
        steps.interrupted = false;
        self.released.notify_all();
        step
    }

    /// The held ranks go on (the hold is dropped).
    pub fn release(&self) {
        let mut steps = self.lock();
        steps.hold = None;
        steps.interrupted = false;
        self.released.notify_all();
    }

    /// Held ranks stop waiting, and ranks reaching the hold later do not wait.
    pub fn interrupt(&self) {
        let mut steps = self.lock();
        steps.interrupted = true;
        self.released.notify_all();
    }

    /// Every step from `step` on runs on `epoch`, and the hold is dropped; refused (`Err`: the
    /// most steps a rank of this node began) if a rank of this node has begun `step` or a later
    /// commit exists.
    pub fn commit_at(&self, step: u64, epoch: PlacementEpoch) -> Result<(), u64> {
        let mut steps = self.lock();
        let began = steps.started.iter().copied().max().unwrap_or(0);
        let last = steps.commits.last().map_or(0, |&(from, _)| from);
        if began > step || last > step {
            return Err(began);
        }
        steps.commits.push((step, epoch));
        steps.hold = None;
        steps.interrupted = false;
        self.released.notify_all();
        Ok(())
    }

    /// `(first step, epoch)` of every commit, in order (epoch 0 from step 0).
    pub fn commits(&self) -> Vec<(u64, PlacementEpoch)> {
        self.lock().commits.clone()
    }

    /// Steps rank `rank` has begun.
    pub fn started(&self, rank: usize) -> u64 {
        self.lock().started.get(rank).copied().unwrap_or(0)
    }

    /// Steps rank `rank` must still run to reach the furthest peer, of this node or another
    /// (0: none is ahead).
    pub fn behind(&self, rank: usize) -> u64 {
        let steps = self.lock();
        self.furthest(&steps).saturating_sub(steps.started[rank])
    }

    /// The most steps any rank has begun (the group's step count once none is behind).
    pub fn steps(&self) -> u64 {
        self.furthest(&self.lock())
    }

    /// Every step from the first one no rank has begun yet runs on `epoch`; returns that step.
    pub fn commit(&self, epoch: PlacementEpoch) -> u64 {
        let mut steps = self.lock();
        let from = self.furthest(&steps);
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

    /// Another node as this node's lockstep sees it: what it began (set by the test) and what
    /// this node announced to it.
    #[derive(Debug, Default)]
    struct OtherNode {
        began: std::sync::atomic::AtomicU64,
        announced: Mutex<Vec<u64>>,
    }

    impl NodePeers for OtherNode {
        fn began(&self) -> u64 {
            self.began.load(std::sync::atomic::Ordering::SeqCst)
        }
        fn announce(&self, steps: u64) {
            self.announced.lock().expect("not poisoned").push(steps);
        }
    }

    /// Across nodes: steps another node's ranks began make this node's ranks behind, and
    /// following them announces nothing; a step a rank of this node leads beyond every rank
    /// heard of is announced once, whichever local rank leads it.
    #[test]
    fn ranks_follow_and_lead_the_ranks_of_other_nodes() {
        let other = Arc::new(OtherNode::default());
        let lockstep = Lockstep::across_nodes(2, other.clone());
        let announced = || other.announced.lock().expect("not poisoned").clone();
        other.began.store(3, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            (lockstep.behind(0), lockstep.behind(1), lockstep.steps()),
            (3, 3, 3)
        );
        for rank in 0..2 {
            let followed: Vec<u64> = (0..lockstep.behind(rank))
                .map(|_| lockstep.begin(rank).0)
                .collect();
            assert_eq!(followed, vec![0, 1, 2]);
        }
        assert_eq!(announced(), Vec::<u64>::new());
        // Rank 1 leads steps 3 and 4, rank 0 follows them: two announcements.
        assert_eq!(lockstep.begin(1).0, 3);
        assert_eq!(lockstep.begin(1).0, 4);
        assert_eq!(lockstep.behind(0), 2);
        lockstep.begin(0);
        lockstep.begin(0);
        assert_eq!(announced(), vec![4, 5]);
        // The other node catches up (hears 5): nobody is behind, nothing more is announced;
        // then it leads past this node and both local ranks follow.
        other.began.store(5, std::sync::atomic::Ordering::SeqCst);
        assert!((0..2).all(|r| lockstep.behind(r) == 0));
        other.began.store(6, std::sync::atomic::Ordering::SeqCst);
        assert_eq!((lockstep.behind(0), lockstep.behind(1)), (1, 1));
        assert_eq!((lockstep.begin(0).0, lockstep.begin(1).0), (5, 5));
        assert_eq!(announced(), vec![4, 5]);
        assert_eq!(lockstep.steps(), 6);
    }

    /// A hold before step 2 (no rank began it) stops a rank there for its timeout, lets it run
    /// to it, and is refused once a rank began it; committing at the held step releases the
    /// ranks onto the new epoch; an interrupted hold fails the waits at once.
    #[test]
    fn ranks_held_before_a_step_begin_it_on_the_epoch_committed_there() {
        let lockstep = Arc::new(Lockstep::new(2));
        lockstep.begin(0);
        assert_eq!(lockstep.hold_at(0), Err(1));
        assert_eq!(lockstep.hold_at(2), Ok(()));
        let wait = Duration::from_millis(50);
        assert_eq!(lockstep.begin_within(0, wait), Ok((1, PlacementEpoch(0))));
        assert_eq!(lockstep.begin_within(0, wait), Err(Held::TimedOut(2)));
        assert_eq!(lockstep.begin_within(1, wait), Ok((0, PlacementEpoch(0))));
        let waiting = {
            let lockstep = lockstep.clone();
            std::thread::spawn(move || lockstep.begin_within(0, Duration::from_secs(10)))
        };
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(lockstep.commit_at(2, PlacementEpoch(1)), Ok(()));
        assert_eq!(waiting.join().expect("thread"), Ok((2, PlacementEpoch(1))));
        assert_eq!(lockstep.commit_at(2, PlacementEpoch(2)), Err(3));
        assert_eq!(
            lockstep.commits(),
            vec![(0, PlacementEpoch(0)), (2, PlacementEpoch(1))]
        );
        assert_eq!(lockstep.hold_beyond(1), 4);
        lockstep.interrupt();
        assert_eq!(lockstep.begin_within(1, wait), Ok((1, PlacementEpoch(0))));
        assert_eq!(lockstep.begin_within(0, wait), Ok((3, PlacementEpoch(1))));
        assert_eq!(
            lockstep.begin_within(0, Duration::from_secs(10)),
            Err(Held::Interrupted(4))
        );
        lockstep.release();
        assert_eq!(lockstep.begin_within(0, wait), Ok((4, PlacementEpoch(1))));
    }
}
