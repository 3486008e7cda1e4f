//! A layer for speculative-decoding tests: an executor's own drafts, reported with the highest
//! confidence, on an emulated device whose step costs a fixed time, so that the DSpark planner
//! verifies every draft (what the drafts and the verifier then do is the test's subject).

use std::sync::Arc;
use std::time::Duration;

use deepinfer_actors::rank::executor::{
    Draft, ExecError, ExecutorFactory, ExecutorLayer, LayeredFactory, RankExecutor,
};
use deepinfer_topology::RequestId;

/// The raw confidence every draft is reported with (sigmoid ≈ 1).
const CONFIDENT: f32 = 30.0;

/// Every draft reported with confidence [`CONFIDENT`]; every step costs `step` on the device.
pub struct Confident {
    pub step: Duration,
}

impl Confident {
    /// `inner`'s executors with this layer over each.
    pub fn factory(inner: Arc<dyn ExecutorFactory>, step: Duration) -> LayeredFactory<Confident> {
        LayeredFactory::layered(inner, "always-confident", move |_| Confident { step })
    }
}

impl ExecutorLayer for Confident {
    fn draft(
        &mut self,
        inner: &mut dyn RankExecutor,
        requests: &[(RequestId, u32)],
    ) -> Result<Vec<Option<Draft>>, ExecError> {
        let drafts = inner.draft(requests)?;
        Ok(drafts
            .into_iter()
            .map(|draft| {
                draft.map(|draft| Draft {
                    confidences: vec![CONFIDENT; draft.tokens.len()],
                    ..draft
                })
            })
            .collect())
    }
    fn device_latency(&self, _inner: &dyn RankExecutor, _batch_tokens: usize) -> Duration {
        self.step
    }
}
