//! Waiting, with a deadline, for communicators whose creation runs in the background (NCCL's
//! non-blocking init, `cuda::nccl_comm`): every pending rank is polled until all are ready, one
//! fails, the caller gives up, or the deadline passes; then every rank not ready is aborted, so
//! that no rank waits forever for a peer that never joins. Generic over [`PendingInit`], so the
//! logic runs without a GPU in the tests.

use std::time::{Duration, Instant};

/// Where one rank's creation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitPoll {
    Ready,
    InProgress,
    Failed(String),
}

/// One rank's communicator being created in the background.
pub trait PendingInit {
    /// Where the creation stands; never blocks.
    fn poll(&mut self) -> InitPoll;
    /// Gives the creation up (what it holds is freed; a peer waiting on it fails).
    fn abort(&mut self);
}

/// Which ranks are being created, and how long they may take.
#[derive(Debug, Clone, Copy)]
pub struct InitWait {
    /// The global rank of the first pending rank (the others follow it).
    pub first: usize,
    /// Ranks of the communicator, of every process.
    pub world: usize,
    pub timeout: Duration,
    /// The pause between two polls.
    pub every: Duration,
}

/// Why the communicator was not created; every rank of this process was aborted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    #[error(
        "communicator of {world} ranks: global rank(s) {ranks:?} of this process waited \
         {waited_ms} ms for the communicator and were aborted; {missing}"
    )]
    Timeout {
        ranks: Vec<usize>,
        world: usize,
        waited_ms: u128,
        /// Who should have joined.
        missing: String,
    },
    #[error("communicator of {world} ranks: global rank {rank} failed to join: {reason}")]
    Failed {
        rank: usize,
        world: usize,
        reason: String,
    },
    #[error("communicator of {world} ranks: creation given up: {reason}")]
    Stopped { world: usize, reason: String },
}

/// Who may be missing when this process's ranks `first..last` of `world` time out.
fn missing(first: usize, last: usize, world: usize) -> String {
    let others: Vec<String> = [(0, first), (last, world)]
        .into_iter()
        .filter(|(a, b)| a < b)
        .map(|(a, b)| format!("{a}..{b}"))
        .collect();
    match others.is_empty() {
        true => "every rank is in this process: the init itself did not complete".to_string(),
        false => format!(
            "a rank of another process (global ranks {}) never joined: its node hung or \
             never reached the init",
            others.join(" and ")
        ),
    }
}

/// Polls `pending` (global ranks `wait.first..`) until every one is ready. On a failure, on
/// `stop` giving a reason, or past `wait.timeout`, every rank is aborted and the error names
/// the rank(s) and the wait.
pub fn wait_for_init<P: PendingInit>(
    pending: &mut [P],
    wait: InitWait,
    stop: impl Fn() -> Option<String>,
) -> Result<(), InitError> {
    let started = Instant::now();
    let mut ready = vec![false; pending.len()];
    let failure = 'wait: loop {
        for (local, init) in pending.iter_mut().enumerate() {
            if ready[local] {
                continue;
            }
            match init.poll() {
                InitPoll::Ready => ready[local] = true,
                InitPoll::InProgress => {}
                InitPoll::Failed(reason) => {
                    break 'wait InitError::Failed {
                        rank: wait.first + local,
                        world: wait.world,
                        reason,
                    };
                }
            }
        }
        if ready.iter().all(|&r| r) {
            return Ok(());
        }
        if let Some(reason) = stop() {
            break InitError::Stopped {
                world: wait.world,
                reason,
            };
        }
        if started.elapsed() >= wait.timeout {
            let last = wait.first + pending.len();
            break InitError::Timeout {
                ranks: (0..pending.len())
                    .filter(|&local| !ready[local])
                    .map(|local| wait.first + local)
                    .collect(),
                world: wait.world,
                waited_ms: wait.timeout.as_millis(),
                missing: missing(wait.first, last, wait.world),
            };
        }
        std::thread::sleep(wait.every);
    };
    pending.iter_mut().for_each(PendingInit::abort);
    Err(failure)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A fake creation: ready after `ready_after` polls (never when `None`), or failing with
    /// `fails` at its first poll; counts its aborts.
    struct Fake {
        polls: usize,
        ready_after: Option<usize>,
        fails: Option<&'static str>,
        aborted: Rc<Cell<usize>>,
    }

    impl Fake {
        fn new(ready_after: Option<usize>, aborted: &Rc<Cell<usize>>) -> Fake {
            Fake {
                polls: 0,
                ready_after,
                fails: None,
                aborted: aborted.clone(),
            }
        }
    }

    impl PendingInit for Fake {
        fn poll(&mut self) -> InitPoll {
            self.polls += 1;
            if let Some(reason) = self.fails {
                return InitPoll::Failed(reason.to_string());
            }
            match self.ready_after {
                Some(n) if self.polls >= n => InitPoll::Ready,
                _ => InitPoll::InProgress,
            }
        }
        fn abort(&mut self) {
            self.aborted.set(self.aborted.get() + 1);
        }
    }

    fn wait(first: usize, world: usize, timeout_ms: u64) -> InitWait {
        InitWait {
            first,
            world,
            timeout: Duration::from_millis(timeout_ms),
            every: Duration::from_millis(1),
        }
    }

    #[test]
    fn ranks_that_become_ready_are_waited_for_and_kept() {
        let aborted = Rc::new(Cell::new(0));
        let mut pending = vec![Fake::new(Some(3), &aborted), Fake::new(Some(1), &aborted)];
        wait_for_init(&mut pending, wait(2, 4, 5_000), || None).expect("ready");
        assert_eq!(aborted.get(), 0);
        assert_eq!(pending[0].polls, 3);
        assert_eq!(pending[1].polls, 1, "a ready rank is polled no more");
    }

    #[test]
    fn a_peer_that_never_joins_times_out_naming_the_ranks_and_aborts_them() {
        let aborted = Rc::new(Cell::new(0));
        let mut pending = vec![Fake::new(Some(1), &aborted), Fake::new(None, &aborted)];
        let started = Instant::now();
        let err = wait_for_init(&mut pending, wait(2, 4, 50), || None).expect_err("a timeout");
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert!(started.elapsed() < Duration::from_secs(5), "no hang");
        assert_eq!(aborted.get(), 2, "every rank of this process aborted");
        let InitError::Timeout {
            ranks, waited_ms, ..
        } = &err
        else {
            panic!("{err:?}");
        };
        assert_eq!((ranks.as_slice(), *waited_ms), (&[3][..], 50));
        let message = err.to_string();
        assert!(message.contains("global rank(s) [3]"), "{message}");
        assert!(message.contains("50 ms"), "{message}");
        assert!(message.contains("global ranks 0..2"), "{message}");
    }

    #[test]
    fn an_async_error_fails_naming_the_rank_and_aborts_every_rank() {
        let aborted = Rc::new(Cell::new(0));
        let mut failing = Fake::new(None, &aborted);
        failing.fails = Some("ncclRemoteError");
        let mut pending = vec![Fake::new(None, &aborted), failing];
        let err = wait_for_init(&mut pending, wait(0, 2, 5_000), || None).expect_err("a failure");
        assert_eq!(
            err,
            InitError::Failed {
                rank: 1,
                world: 2,
                reason: "ncclRemoteError".to_string()
            }
        );
        assert_eq!(aborted.get(), 2);
        assert!(err.to_string().contains("global rank 1"), "{err}");
    }

    #[test]
    fn a_stop_gives_the_creation_up() {
        let aborted = Rc::new(Cell::new(0));
        let mut pending = vec![Fake::new(None, &aborted)];
        let err = wait_for_init(&mut pending, wait(0, 1, 5_000), || {
            Some("EP rank 1 failed first".to_string())
        })
        .expect_err("stopped");
        assert!(matches!(err, InitError::Stopped { .. }), "{err:?}");
        assert_eq!(aborted.get(), 1);
    }
}
