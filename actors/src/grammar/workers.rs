//! CPU worker threads that compute masks while the device step runs: the scheduler hands its
//! constrained requests' matchers over before launching the step and takes them back, with their
//! masks, right before sampling.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use tokio::sync::mpsc as async_mpsc;
use toktrie::TokenId;

use super::{GrammarError, GrammarMatcher, StepMask};

type Task = Box<dyn FnOnce() + Send>;

/// One request's mask work: its matcher, and the draft tokens whose positions need masks too
/// (empty without speculation).
#[derive(Debug)]
pub struct MaskJob<K> {
    pub key: K,
    pub matcher: GrammarMatcher,
    pub draft: Vec<TokenId>,
}

/// The result of a [`MaskJob`]: the matcher back (state unchanged) and the masks
/// ([`GrammarMatcher::draft_masks`]: one per verified position, one mask without a draft).
#[derive(Debug)]
pub struct MaskOutcome<K> {
    pub key: K,
    pub matcher: GrammarMatcher,
    pub masks: Result<Vec<StepMask>, GrammarError>,
}

/// A fixed pool of mask threads.
pub struct MaskWorkers {
    tasks: Option<mpsc::Sender<Task>>,
    threads: Vec<JoinHandle<()>>,
    /// Jobs whose masks are computed (a progress counter for metrics and tests).
    completed: Arc<AtomicU64>,
}

impl std::fmt::Debug for MaskWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskWorkers")
            .field("threads", &self.threads.len())
            .finish()
    }
}

/// Masks in flight for one batch; wait for them right before sampling.
#[derive(Debug)]
pub struct MaskBatch<K> {
    results: async_mpsc::UnboundedReceiver<(usize, MaskOutcome<K>)>,
    len: usize,
}

impl MaskWorkers {
    /// Start `threads` workers (at least one).
    pub fn new(threads: usize) -> Result<Self, GrammarError> {
        let (sender, receiver) = mpsc::channel::<Task>();
        let receiver = Arc::new(Mutex::new(receiver));
        let threads = (0..threads.max(1))
            .map(|i| {
                let receiver = Arc::clone(&receiver);
                std::thread::Builder::new()
                    .name(format!("grammar-mask-{i}"))
                    .spawn(move || run_worker(&receiver))
                    .map_err(GrammarError::WorkerSpawn)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            tasks: Some(sender),
            threads,
            completed: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Jobs whose masks have been computed since the pool started.
    pub fn completed_jobs(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    /// Start computing the masks of a batch; returns at once.
    pub fn compute<K: Send + 'static>(&self, jobs: Vec<MaskJob<K>>) -> MaskBatch<K> {
        let (sender, results) = async_mpsc::unbounded_channel();
        let len = jobs.len();
        for (index, job) in jobs.into_iter().enumerate() {
            let sender = sender.clone();
            let completed = Arc::clone(&self.completed);
            let task: Task = Box::new(move || {
                let MaskJob {
                    key,
                    mut matcher,
                    draft,
                } = job;
                let masks = matcher.draft_masks(&draft);
                completed.fetch_add(1, Ordering::AcqRel);
                // The batch may have been dropped; then nobody wants the result.
                let _ = sender.send((
                    index,
                    MaskOutcome {
                        key,
                        matcher,
                        masks,
                    },
                ));
            });
            if let Some(tasks) = &self.tasks {
                // A send fails only when every worker has stopped; the dropped task then shows
                // up as `WorkerLost` when the batch is awaited.
                let _ = tasks.send(task);
            }
        }
        MaskBatch { results, len }
    }
}

impl Drop for MaskWorkers {
    fn drop(&mut self) {
        self.tasks = None;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn run_worker(receiver: &Mutex<mpsc::Receiver<Task>>) {
    loop {
        let next = match receiver.lock() {
            Ok(guard) => guard.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        match next {
            Ok(task) => task(),
            Err(mpsc::RecvError) => return,
        }
    }
}

impl<K> MaskBatch<K> {
    /// Number of jobs in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Block until every mask is ready; outcomes in job order. Call it from a plain thread (the
    /// rank's), not from inside an async task (use [`MaskBatch::wait_async`] there).
    pub fn wait(mut self) -> Result<Vec<MaskOutcome<K>>, GrammarError> {
        let mut slots = empty_slots(self.len);
        for _ in 0..self.len {
            let (index, outcome) = self
                .results
                .blocking_recv()
                .ok_or(GrammarError::WorkerLost)?;
            slots[index] = Some(outcome);
        }
        collect(slots)
    }

    /// Await every mask; outcomes in job order.
    pub async fn wait_async(mut self) -> Result<Vec<MaskOutcome<K>>, GrammarError> {
        let mut slots = empty_slots(self.len);
        for _ in 0..self.len {
            let (index, outcome) = self.results.recv().await.ok_or(GrammarError::WorkerLost)?;
            slots[index] = Some(outcome);
        }
        collect(slots)
    }
}

fn empty_slots<K>(len: usize) -> Vec<Option<MaskOutcome<K>>> {
    std::iter::repeat_with(|| None).take(len).collect()
}

fn collect<K>(slots: Vec<Option<MaskOutcome<K>>>) -> Result<Vec<MaskOutcome<K>>, GrammarError> {
    slots
        .into_iter()
        .map(|slot| slot.ok_or(GrammarError::WorkerLost))
        .collect()
}
