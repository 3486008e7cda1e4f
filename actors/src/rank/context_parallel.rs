//! `ContextParallelFactory`: rank executors over one shared V4.1 model whose long prefill chunks
//! run over a CP group (`[parallel] context_parallel`, `Model::prefill_context_parallel`); the
//! routed experts go through the engine's expert parallelism when it has one. The model side
//! (mirror split, per-layer all-gather, state after the prefill) is
//! `deepinfer_model::v41::context_parallel`.

use std::sync::Arc;

use deepinfer_model::Model;
use deepinfer_topology::{ContextParallel, DpRank};

use crate::experts::parallel::ExpertParallel;
use crate::rank::executor::{ExecError, ExecutorFactory, RankExecutor};
use crate::rank::model_executor::ModelExecutor;

/// Hands every rank the same model, the same CP settings and (optionally) the same
/// expert-parallel state.
#[derive(Debug, Clone)]
pub struct ContextParallelFactory {
    pub model: Arc<Model>,
    pub cp: ContextParallel,
    pub experts: Option<Arc<ExpertParallel>>,
    pub description: String,
}

impl ExecutorFactory for ContextParallelFactory {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        let executor = match &self.experts {
            Some(parallel) => {
                let dp = u16::try_from(dp)
                    .map(DpRank)
                    .map_err(|_| ExecError::Backend(format!("DP rank {dp} beyond u16")))?;
                ModelExecutor::with_expert_parallel(self.model.clone(), parallel.clone(), dp)
            }
            None => ModelExecutor::new(self.model.clone()),
        };
        Ok(Box::new(executor.with_context_parallel(Some(self.cp))))
    }

    fn describe(&self) -> String {
        format!(
            "{}, prefill chunks of >= {} tokens over {} CP ranks",
            self.description, self.cp.min_tokens, self.cp.ranks
        )
    }

    fn sliding_window(&self) -> Option<usize> {
        Some(self.model.config().window_size)
    }

    fn state_bytes(&self) -> Option<deepinfer_model::state_bytes::StateBytes> {
        Some(deepinfer_model::state_bytes::StateBytes::of(
            self.model.config(),
        ))
    }

    fn prefix_geometry(&self) -> Option<crate::prefix_cache::PrefixGeometry> {
        Some(crate::prefix_cache::PrefixGeometry::of(self.model.config()))
    }

    fn expert_parallel(&self) -> Option<Arc<ExpertParallel>> {
        self.experts.clone()
    }

    fn context_parallel(&self) -> Option<ContextParallel> {
        Some(self.cp)
    }
}
