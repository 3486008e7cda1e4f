//! The ranks' side of the `ReplayActor`'s view: an executor-factory wrapper that sums the length
//! of every request's sequence when its rank frees it (or drops it at shutdown), so that a test
//! can hold the lengths the schedulers reported (`ReplayStats::finished_positions`) against what
//! the ranks really hold. An off-by-one in what a scheduler tells the `ReplayActor` shows as a
//! difference. A request's sequence is one the rank worker stepped (the worker passes one
//! sampling choice per entry); the DSpark profile's probe sequences, run before any request
//! through `execute_rows` (no sampling choices), are not requests.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deepinfer_actors::Engine;
use deepinfer_actors::rank::executor::{
    ExecError, ExecStep, ExecutorFactory, ExecutorLayer, LayeredFactory, RankExecutor,
};
use deepinfer_model::EntryOutput;
use deepinfer_topology::RequestId;

/// The summed lengths of the sequences the ranks freed.
#[derive(Debug, Default)]
pub struct FreedLengths {
    positions: AtomicU64,
    sequences: AtomicU64,
}

impl FreedLengths {
    /// Wraps `factory`: every rank it builds adds each freed sequence's length here.
    pub fn track(factory: Arc<dyn ExecutorFactory>) -> (Arc<dyn ExecutorFactory>, Arc<Self>) {
        let freed = Arc::new(FreedLengths::default());
        let tracked = freed.clone();
        let wrapped = Arc::new(LayeredFactory::layered(factory, "tracked", move |_| {
            Tracking {
                requests: HashSet::new(),
                freed: tracked.clone(),
            }
        }));
        (wrapped, freed)
    }

    /// Shuts `engine` down and asserts that the `ReplayActor` (bounded replay must be on) freed
    /// every request with the length its rank held: the sums over all requests are equal.
    pub async fn shutdown_and_check_replay(&self, engine: Engine) {
        let replay = engine
            .handle()
            .replay_stats()
            .await
            .expect("replay stats")
            .expect("bounded replay is on");
        engine
            .shutdown(Duration::from_secs(30))
            .await
            .expect("shuts down");
        let (positions, sequences) = (
            self.positions.load(Ordering::SeqCst),
            self.sequences.load(Ordering::SeqCst),
        );
        assert_eq!(replay.live, 0, "{replay:?}");
        assert!(sequences > 0, "the ranks ran sequences");
        assert_eq!(
            replay.finished_positions, positions,
            "the ReplayActor's lengths of the finished requests vs the ranks' ({sequences} \
             sequences; {replay:?})"
        );
    }

    fn add(&self, len: usize) {
        self.positions.fetch_add(len as u64, Ordering::SeqCst);
        self.sequences.fetch_add(1, Ordering::SeqCst);
    }
}

/// The layer of one rank: notes the requests stepped, adds each one's length when freed.
struct Tracking {
    /// Live sequences the worker stepped.
    requests: HashSet<RequestId>,
    freed: Arc<FreedLengths>,
}

impl Tracking {
    fn record(&mut self, inner: &dyn RankExecutor, id: RequestId) {
        if self.requests.remove(&id) {
            let len = inner
                .sequence_len(id)
                .expect("a live sequence has a length");
            self.freed.add(len);
        }
    }
}

impl ExecutorLayer for Tracking {
    fn execute(
        &mut self,
        inner: &mut dyn RankExecutor,
        ExecStep { batch, sampling }: ExecStep<'_>,
    ) -> Result<Vec<EntryOutput>, ExecError> {
        if !sampling.is_empty() {
            self.requests.extend(batch.iter().map(|entry| entry.id));
        }
        inner.execute(ExecStep { batch, sampling })
    }
    fn free_sequence(&mut self, inner: &mut dyn RankExecutor, id: RequestId) {
        self.record(inner, id);
        inner.free_sequence(id)
    }
    fn finish(&mut self, inner: &mut dyn RankExecutor) {
        let live: Vec<RequestId> = self.requests.iter().copied().collect();
        for id in live {
            self.record(inner, id);
        }
    }
}
