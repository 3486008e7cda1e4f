//! `ExpertParallelFactory`: rank executors over one shared model of either family whose routed
//! experts run through an engine's `ExpertParallel` (its presence makes the supervisor spawn the
//! expert groups and the EPLB).

use std::sync::Arc;

use deepinfer_model::any_model::AnyModel;
use deepinfer_model::config::ModelFamily;
use deepinfer_topology::{DpRank, NodeConfig};

use crate::comm::EpError;
use crate::experts::parallel::{EpSettings, ExpertParallel};
use crate::rank::executor::{ExecError, ExecutorFactory, RankExecutor};
use crate::rank::model_executor::ModelExecutor;

/// Hands every rank the same model and the same expert-parallel state.
#[derive(Debug, Clone)]
pub struct ExpertParallelFactory {
    /// The model every rank runs (the shards copy their experts from it).
    pub model: AnyModel,
    pub parallel: Arc<ExpertParallel>,
    pub description: String,
}

impl ExpertParallelFactory {
    /// The factory for `node`'s `[parallel] ep` and `[eplb]` over `model` (epoch 0 = the
    /// placement for equal loads); with several `[device] nodes`, this node's EP ranks only,
    /// after every node joined (`ExpertParallel::on_node`).
    pub fn new(
        model: impl Into<AnyModel>,
        node: &NodeConfig,
        description: String,
    ) -> Result<ExpertParallelFactory, EpError> {
        let model = model.into();
        let settings = EpSettings::from_node(node);
        let parallel = if node.cluster.bootstrap.is_some() {
            ExpertParallel::on_node(model.clone(), settings, &node.cluster)?
        } else {
            ExpertParallel::new(model.clone(), settings)?
        };
        Ok(ExpertParallelFactory {
            model,
            parallel,
            description: format!(
                "{description}, experts over {} EP ranks{} (+{} redundant slots per layer, EPLB {})",
                settings.ep_ranks,
                match node.cluster.bootstrap {
                    None => String::new(),
                    Some(_) => format!(
                        " of {} nodes (this is node {}, holding EP ranks {:?})",
                        node.device.nodes,
                        node.cluster.node,
                        node.ep_ranks_on_node()
                    ),
                },
                settings.redundant_experts,
                if settings.eplb.enabled { "on" } else { "off" }
            ),
        })
    }
}

impl ExecutorFactory for ExpertParallelFactory {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        let dp = u16::try_from(dp)
            .map(DpRank)
            .map_err(|_| ExecError::Backend(format!("DP rank {dp} beyond u16")))?;
        Ok(Box::new(ModelExecutor::with_expert_parallel(
            self.model.clone(),
            self.parallel.clone(),
            dp,
        )))
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn expert_parallel(&self) -> Option<Arc<ExpertParallel>> {
        Some(self.parallel.clone())
    }

    fn state_bytes(&self) -> Option<deepinfer_model::state_bytes::StateBytes> {
        Some(deepinfer_model::state_bytes::StateBytes::of(
            self.model.config(),
        ))
    }

    fn prefix_geometry(&self) -> Option<crate::prefix_cache::PrefixGeometry> {
        Some(crate::prefix_cache::PrefixGeometry::of(self.model.config()))
    }

    /// A V4.1 model's window, so bounded replay is planned under expert parallelism too (the
    /// executor's steps run the decoder start with the routed experts on the expert shards); a
    /// V4-family model has no decoder bounded replay.
    fn sliding_window(&self) -> Option<usize> {
        self.model.decoder_window()
    }

    fn family(&self) -> ModelFamily {
        self.model.config().family
    }
}
