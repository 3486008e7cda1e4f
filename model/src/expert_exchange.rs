//! The collective of expert parallelism: an all-to-all among the EP ranks of one process, with a
//! timeout on every wait and a failure that reaches every rank (never a hang).
//!
//! Each rank calls [`Exchange::all_to_all`] with one part per destination rank and gets back one
//! part per source rank, in increasing source rank (the order the combine relies on). Every call
//! carries an [`ExchangeTag`] (the rank's collective count, the layer, the placement epoch, the phase): ranks that
//! arrive at different collectives fail with [`ExchangeError::Mismatch`] instead of swapping data.
//! A rank that waits longer than the timeout fails with [`ExchangeError::Timeout`] naming the
//! ranks that never came; a rank whose step failed calls [`Exchange::abort`]. Either way the
//! exchange stays failed: every rank waiting in it, and every later call, returns
//! [`ExchangeError::PeerFailed`] at once. Policy (the supervisor's rule 3): a failed exchange
//! fails every rank's step, and the engine stops; nothing restarts in the middle of a collective.
//!
//! The parts are generic: the CUDA backend sends the counts and device addresses of its routed
//! rows (the rows themselves are copied device to device by the receiver, then a barrier — an
//! all-to-all of `()` — releases the senders' buffers); the CPU tests send host rows.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Which part of a layer's dispatch/combine a collective is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangePhase {
    /// The routed rows go to the EP ranks that hold their experts.
    Dispatch,
    /// The expert outputs come back.
    Combine,
    /// Everybody has copied what it received (the senders may free their buffers).
    Done,
    /// Context parallelism: every CP rank's rows of one layer go to every rank (an all-gather).
    ContextGather,
}

/// The collective a rank is in: its `round`-th MoE layer call, on placement `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExchangeTag {
    pub round: u64,
    pub layer: usize,
    pub epoch: u32,
    pub phase: ExchangePhase,
}

impl std::fmt::Display for ExchangeTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "round {} layer {} epoch {} {:?}",
            self.round, self.layer, self.epoch, self.phase
        )
    }
}

/// Why a collective did not complete.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExchangeError {
    #[error("expert exchange: rank {rank} waited {waited_ms} ms at {tag} for EP ranks {missing:?}")]
    Timeout {
        rank: usize,
        tag: ExchangeTag,
        missing: Vec<usize>,
        waited_ms: u128,
    },
    #[error("expert exchange: rank {rank} stopped at {tag}: EP rank {failed} failed ({reason})")]
    PeerFailed {
        rank: usize,
        tag: ExchangeTag,
        failed: usize,
        reason: String,
    },
    #[error(
        "expert exchange: rank {rank} is at {tag}, another rank at {other} (steps out of step)"
    )]
    Mismatch {
        rank: usize,
        tag: ExchangeTag,
        other: ExchangeTag,
    },
    #[error("expert exchange: rank {rank} sent {found} parts at {tag}, one per EP rank ({ranks})")]
    Parts {
        rank: usize,
        tag: ExchangeTag,
        found: usize,
        ranks: usize,
    },
    #[error("expert exchange: rank {rank} is not one of the {ranks} EP ranks")]
    Rank { rank: usize, ranks: usize },
}

/// The collective state shared by the ranks.
struct State<T> {
    /// The collective being collected (all ranks' tags must equal it).
    tag: Option<ExchangeTag>,
    /// `posted[source][destination]`, taken by the destination.
    posted: Vec<Option<Vec<Option<T>>>>,
    /// Every rank has posted: destinations take their parts.
    complete: bool,
    /// Destinations that took their parts of the complete collective.
    taken: usize,
    /// The first failure (rank, reason); the exchange stays failed.
    failed: Option<(usize, String)>,
}

/// An all-to-all among `ranks` ranks (see the module doc).
pub struct Exchange<T> {
    ranks: usize,
    timeout: Duration,
    state: Mutex<State<T>>,
    changed: Condvar,
}

impl<T> std::fmt::Debug for Exchange<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange")
            .field("ranks", &self.ranks)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl<T> Exchange<T> {
    /// An exchange among `ranks` ranks whose waits last at most `timeout` each.
    pub fn new(ranks: usize, timeout: Duration) -> Exchange<T> {
        Exchange {
            ranks,
            timeout,
            state: Mutex::new(State {
                tag: None,
                posted: (0..ranks).map(|_| None).collect(),
                complete: false,
                taken: 0,
                failed: None,
            }),
            changed: Condvar::new(),
        }
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Sends `parts[d]` to rank `d` and returns what every rank sent to `rank`, in increasing
    /// source rank. Blocks until every rank called it with the same `tag` (or fails, see the
    /// module doc).
    pub fn all_to_all(
        &self,
        rank: usize,
        tag: ExchangeTag,
        parts: Vec<T>,
    ) -> Result<Vec<T>, ExchangeError> {
        if rank >= self.ranks {
            return Err(ExchangeError::Rank {
                rank,
                ranks: self.ranks,
            });
        }
        if parts.len() != self.ranks {
            let err = ExchangeError::Parts {
                rank,
                tag,
                found: parts.len(),
                ranks: self.ranks,
            };
            self.abort(rank, &err.to_string());
            return Err(err);
        }
        let deadline = Instant::now() + self.timeout;
        let mut state = self.lock();
        // The previous collective is still being taken apart: wait for its end.
        state = self.wait(state, rank, tag, deadline, |s| s.complete)?;
        match state.tag {
            Some(other) if other != tag => {
                let err = ExchangeError::Mismatch { rank, tag, other };
                return Err(self.fail(state, rank, err));
            }
            _ => state.tag = Some(tag),
        }
        state.posted[rank] = Some(parts.into_iter().map(Some).collect());
        if state.posted.iter().all(Option::is_some) {
            state.complete = true;
            self.changed.notify_all();
        }
        state = self.wait(state, rank, tag, deadline, |s| !s.complete)?;
        let received = state
            .posted
            .iter_mut()
            .map(|source| {
                source
                    .as_mut()
                    .and_then(|parts| parts[rank].take())
                    .expect("a complete collective holds every part once")
            })
            .collect();
        state.taken += 1;
        if state.taken == self.ranks {
            state.tag = None;
            state.posted.iter_mut().for_each(|p| *p = None);
            state.complete = false;
            state.taken = 0;
            self.changed.notify_all();
        }
        Ok(received)
    }

    /// Waits until every rank reached `tag` (an all-to-all of nothing).
    pub fn barrier(&self, rank: usize, tag: ExchangeTag) -> Result<(), ExchangeError>
    where
        T: Default,
    {
        let parts = (0..self.ranks).map(|_| T::default()).collect();
        self.all_to_all(rank, tag, parts).map(|_| ())
    }

    /// Marks the exchange failed by `rank` (its step failed): every rank waiting in it, and every
    /// later call, fails with [`ExchangeError::PeerFailed`].
    pub fn abort(&self, rank: usize, reason: &str) {
        let mut state = self.lock();
        if state.failed.is_none() {
            state.failed = Some((rank, reason.to_string()));
        }
        self.changed.notify_all();
    }

    /// The failure that stopped the exchange, if any: (rank, reason).
    pub fn failure(&self) -> Option<(usize, String)> {
        self.lock().failed.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `err` as the exchange's failure and wakes every waiter.
    fn fail(
        &self,
        mut state: MutexGuard<'_, State<T>>,
        rank: usize,
        err: ExchangeError,
    ) -> ExchangeError {
        if state.failed.is_none() {
            state.failed = Some((rank, err.to_string()));
        }
        self.changed.notify_all();
        err
    }

    /// Waits while `blocked` holds, failing on a recorded failure or at `deadline`.
    fn wait<'g>(
        &self,
        mut state: MutexGuard<'g, State<T>>,
        rank: usize,
        tag: ExchangeTag,
        deadline: Instant,
        blocked: impl Fn(&State<T>) -> bool,
    ) -> Result<MutexGuard<'g, State<T>>, ExchangeError> {
        loop {
            if let Some((failed, reason)) = &state.failed {
                return Err(ExchangeError::PeerFailed {
                    rank,
                    tag,
                    failed: *failed,
                    reason: reason.clone(),
                });
            }
            if !blocked(&state) {
                return Ok(state);
            }
            state = match wait_until(&self.changed, state, deadline) {
                Ok(state) => state,
                Err(state) => {
                    let missing = if state.complete {
                        Vec::new()
                    } else {
                        (0..self.ranks)
                            .filter(|&r| state.posted[r].is_none())
                            .collect()
                    };
                    let err = ExchangeError::Timeout {
                        rank,
                        tag,
                        missing,
                        waited_ms: self.timeout.as_millis(),
                    };
                    return Err(self.fail(state, rank, err));
                }
            };
        }
    }
}

/// `state` back after waiting on `changed` until a notification or `deadline`, whichever comes
/// first; `Err(state)` at once, without waiting, when the deadline has passed.
pub(crate) fn wait_until<'g, T>(
    changed: &Condvar,
    state: MutexGuard<'g, T>,
    deadline: Instant,
) -> Result<MutexGuard<'g, T>, MutexGuard<'g, T>> {
    let now = Instant::now();
    if now >= deadline {
        return Err(state);
    }
    Ok(changed
        .wait_timeout(state, deadline - now)
        .unwrap_or_else(PoisonError::into_inner)
        .0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    fn tag(round: u64, layer: usize, phase: ExchangePhase) -> ExchangeTag {
        ExchangeTag {
            round,
            layer,
            epoch: 0,
            phase,
        }
    }

    /// Rows each rank sends to each rank in one round: a different count per (source,
    /// destination), rows named by (round, source, destination, index).
    fn rows(round: u64, source: usize, dest: usize) -> Vec<(u64, usize, usize, usize)> {
        let count = (round as usize + source * 3 + dest * 5) % 4;
        (0..count).map(|i| (round, source, dest, i)).collect()
    }

    /// Over many rounds and layers on 1-4 ranks: every rank receives exactly the rows addressed
    /// to it (their counts), in increasing source rank, each source's rows in its order.
    #[test]
    fn every_rank_receives_its_rows_in_source_order() {
        for ranks in 1..=4 {
            let exchange = Arc::new(Exchange::new(ranks, Duration::from_secs(10)));
            let threads: Vec<_> = (0..ranks)
                .map(|rank| {
                    let exchange = exchange.clone();
                    thread::spawn(move || {
                        for round in 0..40u64 {
                            for layer in 0..3 {
                                let parts =
                                    (0..ranks).map(|d| rows(round, rank, d)).collect::<Vec<_>>();
                                let got = exchange
                                    .all_to_all(
                                        rank,
                                        tag(round, layer, ExchangePhase::Dispatch),
                                        parts,
                                    )
                                    .expect("exchange");
                                let expected: Vec<_> =
                                    (0..ranks).map(|s| rows(round, s, rank)).collect();
                                assert_eq!(got, expected, "rank {rank} round {round}");
                                exchange
                                    .barrier(rank, tag(round, layer, ExchangePhase::Done))
                                    .map_err(|e| e.to_string())
                                    .unwrap_or_else(|e| panic!("{e}"));
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().expect("rank thread");
            }
            assert_eq!(exchange.failure(), None);
        }
    }

    /// A rank whose step fails mid-step aborts: the ranks already waiting in the collective
    /// and every later call fail at once with its reason (no wait for the timeout).
    #[test]
    fn one_rank_failing_mid_step_stops_every_rank_without_a_hang() {
        let exchange = Arc::new(Exchange::<Vec<u32>>::new(3, Duration::from_secs(60)));
        let started = Instant::now();
        let waiting: Vec<_> = (0..2)
            .map(|rank| {
                let exchange = exchange.clone();
                thread::spawn(move || {
                    // Round 0 completes for everybody, round 1 fails.
                    exchange.barrier(rank, tag(0, 0, ExchangePhase::Dispatch))?;
                    exchange.barrier(rank, tag(1, 0, ExchangePhase::Dispatch))
                })
            })
            .collect();
        exchange
            .barrier(2, tag(0, 0, ExchangePhase::Dispatch))
            .expect("round 0");
        thread::sleep(Duration::from_millis(50));
        exchange.abort(2, "rank 2's attention ran out of memory");
        for (rank, t) in waiting.into_iter().enumerate() {
            match t.join().expect("rank thread") {
                Err(ExchangeError::PeerFailed {
                    rank: r,
                    failed: 2,
                    reason,
                    tag: t,
                }) => {
                    assert_eq!((r, t.round), (rank, 1));
                    assert!(reason.contains("out of memory"), "{reason}");
                }
                other => panic!("rank {rank}: {other:?}"),
            }
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        let later = exchange.barrier(0, tag(2, 0, ExchangePhase::Dispatch));
        assert!(matches!(
            later,
            Err(ExchangeError::PeerFailed { failed: 2, .. })
        ));
    }

    /// A rank that never comes: the waiting rank fails after the timeout naming it, and the
    /// exchange stays failed for the late rank.
    #[test]
    fn a_missing_rank_is_a_timeout_that_names_it() {
        let exchange = Exchange::<Vec<u32>>::new(3, Duration::from_millis(100));
        let started = Instant::now();
        let at = tag(7, 2, ExchangePhase::Combine);
        let err = thread::scope(|s| {
            let one = s.spawn(|| exchange.all_to_all(1, at, vec![vec![1], vec![2], vec![3]]));
            let zero = exchange.all_to_all(0, at, vec![vec![4], vec![5], vec![6]]);
            let one = one.join().expect("rank 1");
            // One of them timed out first; the other saw its failure.
            [zero, one]
                .into_iter()
                .find_map(|r| match r {
                    Err(e @ ExchangeError::Timeout { .. }) => Some(e),
                    _ => None,
                })
                .expect("a timeout")
        });
        assert!(started.elapsed() >= Duration::from_millis(100));
        match &err {
            ExchangeError::Timeout { missing, tag, .. } => {
                assert_eq!(missing, &vec![2]);
                assert_eq!(*tag, at);
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("EP ranks [2]"), "{err}");
        let late = exchange.all_to_all(2, at, vec![vec![], vec![], vec![]]);
        assert!(
            matches!(late, Err(ExchangeError::PeerFailed { .. })),
            "{late:?}"
        );
    }

    /// Ranks at different collectives (one runs layer 1 while the other runs layer 0) fail
    /// instead of swapping rows; a wrong number of parts is refused.
    #[test]
    fn ranks_out_of_step_or_malformed_parts_fail() {
        let exchange = Exchange::<Vec<u32>>::new(2, Duration::from_secs(60));
        let results = thread::scope(|s| {
            let one = s.spawn(|| {
                exchange.all_to_all(1, tag(0, 1, ExchangePhase::Dispatch), vec![vec![], vec![]])
            });
            let zero =
                exchange.all_to_all(0, tag(0, 0, ExchangePhase::Dispatch), vec![vec![], vec![]]);
            [zero, one.join().expect("rank 1")]
        });
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(ExchangeError::Mismatch { .. }))),
            "{results:?}"
        );
        assert!(results.iter().all(Result::is_err), "{results:?}");

        let fresh = Exchange::<Vec<u32>>::new(2, Duration::from_secs(1));
        let err = fresh
            .all_to_all(0, tag(0, 0, ExchangePhase::Dispatch), vec![vec![]])
            .expect_err("one part for two ranks");
        assert!(matches!(
            err,
            ExchangeError::Parts {
                found: 1,
                ranks: 2,
                ..
            }
        ));
        assert!(matches!(
            fresh.all_to_all(5, tag(0, 0, ExchangePhase::Dispatch), vec![]),
            Err(ExchangeError::Rank { rank: 5, ranks: 2 })
        ));
    }
}
