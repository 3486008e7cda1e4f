//! The ranks' side of the `ReplayActor`'s view: an executor-factory wrapper that sums the length
//! of every request's sequence when its rank frees it (or drops it at shutdown), so that a test
//! can hold the lengths the schedulers reported (`ReplayStats::finished_positions`) against what
//! the ranks really hold. An off-by-one in what a scheduler tells the `ReplayActor` shows as a
//! difference. A request's sequence is one the rank worker stepped (`execute_deferred`, its only
//! entry point); the DSpark profile's probe sequences, run through `execute` before any request,
//! are not requests.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deepinfer_actors::experts::parallel::ExpertParallel;
use deepinfer_actors::rank::executor::{
    Draft, ExecError, ExecutorFactory, RankExecutor, SeqTokens,
};
use deepinfer_actors::{Engine, SamplingParams};
use deepinfer_model::{EntryOutput, LogitsRow};
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
        let wrapped = Arc::new(TrackingFactory {
            inner: factory,
            freed: freed.clone(),
        });
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

struct TrackingFactory {
    inner: Arc<dyn ExecutorFactory>,
    freed: Arc<FreedLengths>,
}

impl ExecutorFactory for TrackingFactory {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        Ok(Box::new(Tracking {
            inner: self.inner.build(dp)?,
            requests: HashSet::new(),
            freed: self.freed.clone(),
        }))
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn sliding_window(&self) -> Option<usize> {
        self.inner.sliding_window()
    }
    fn family(&self) -> deepinfer_model::config::ModelFamily {
        self.inner.family()
    }
    fn expert_parallel(&self) -> Option<Arc<ExpertParallel>> {
        self.inner.expert_parallel()
    }
    fn context_parallel(&self) -> Option<deepinfer_topology::ContextParallel> {
        self.inner.context_parallel()
    }
}

struct Tracking {
    inner: Box<dyn RankExecutor>,
    /// Live sequences the worker stepped.
    requests: HashSet<RequestId>,
    freed: Arc<FreedLengths>,
}

impl Tracking {
    fn note(&mut self, batch: &[SeqTokens<'_>]) {
        self.requests.extend(batch.iter().map(|entry| entry.id));
    }

    fn record(&mut self, id: RequestId) {
        if self.requests.remove(&id) {
            let len = self
                .inner
                .sequence_len(id)
                .expect("a live sequence has a length");
            self.freed.add(len);
        }
    }
}

impl Drop for Tracking {
    fn drop(&mut self) {
        let live: Vec<RequestId> = self.requests.iter().copied().collect();
        for id in live {
            self.record(id);
        }
    }
}

impl RankExecutor for Tracking {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn new_sequence(&mut self, id: RequestId) -> Result<(), ExecError> {
        self.inner.new_sequence(id)
    }
    fn free_sequence(&mut self, id: RequestId) {
        self.record(id);
        self.inner.free_sequence(id)
    }
    fn rollback(&mut self, id: RequestId, len: usize) -> Result<(), ExecError> {
        self.inner.rollback(id, len)
    }
    fn sequence_len(&self, id: RequestId) -> Result<usize, ExecError> {
        self.inner.sequence_len(id)
    }
    fn live_sequences(&self) -> usize {
        self.inner.live_sequences()
    }
    fn execute(&mut self, batch: &[SeqTokens<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        self.inner.execute(batch)
    }
    fn execute_sampled(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        self.note(batch);
        self.inner.execute_sampled(batch, sampling)
    }
    fn execute_deferred(
        &mut self,
        batch: &[SeqTokens<'_>],
        sampling: &[Option<SamplingParams>],
    ) -> Result<Vec<EntryOutput>, ExecError> {
        self.note(batch);
        self.inner.execute_deferred(batch, sampling)
    }
    fn sample_logits(&mut self, rows: &[LogitsRow<'_>]) -> Result<Vec<u32>, ExecError> {
        self.inner.sample_logits(rows)
    }
    fn draft_many(
        &mut self,
        requests: &[(RequestId, u32)],
    ) -> Result<Vec<Option<Draft>>, ExecError> {
        self.inner.draft_many(requests)
    }
    fn plan_replay(&mut self, id: RequestId, decoder_from: usize) -> Result<(), ExecError> {
        self.inner.plan_replay(id, decoder_from)
    }
    fn draft(&mut self, id: RequestId, anchor: u32) -> Result<Option<Draft>, ExecError> {
        self.inner.draft(id, anchor)
    }
    fn device_latency(&self, batch_tokens: usize) -> std::time::Duration {
        self.inner.device_latency(batch_tokens)
    }
}
