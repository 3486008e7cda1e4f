//! The model side of [`crate::expert_dispatch`] beyond the step's `StepOptions::experts`: the
//! idle step of an expert-parallel rank and the accessors an expert shard needs (its weights,
//! and running one expert exactly as the model does).

use super::Model;
use crate::backend::weights::{ExpertLinear, ExpertWeights};
use crate::expert_dispatch::RoutedExpert;
use crate::layers::moe;

impl Model {
    /// One routed expert on one token exactly as the model's MoE computes it (SwiGLU with the
    /// config's clamp, `weight` applied before `w2`), on this model's backend.
    pub fn run_routed_expert(&self, expert: &RoutedExpert, x: &[f32], weight: f32) -> Vec<f32> {
        moe::expert(&self.ctx(), &expert.0, &x.into(), Some(&[weight])).into_vec()
    }

    /// Takes part in one step's expert-parallel collectives with no rows of its own: every
    /// backbone layer's MoE over zero rows, so that the backend (an EP rank, see
    /// `backend::cuda::ep`) serves its experts to the other ranks. A no-op on a backend that
    /// runs every expert itself. Every DP rank calls this on a step it has nothing to run.
    pub fn idle_expert_step(&self) {
        let ctx = self.ctx();
        let empty = crate::backend::Tensor::empty();
        for block in self.weights.layers.iter() {
            let _ = ctx
                .backend
                .moe_rows(&empty, &moe::layer_op(&ctx, &block.moe));
        }
    }

    /// Each backbone layer's routed experts (the lists an expert rank places).
    pub fn expert_lists(&self) -> Vec<&[ExpertWeights<ExpertLinear>]> {
        self.weights
            .layers
            .iter()
            .map(|b| b.moe.experts.as_slice())
            .collect()
    }

    /// The model's own weights of routed expert `expert` in backbone layer `layer`.
    pub(crate) fn routed_weights(
        &self,
        layer: usize,
        expert: usize,
    ) -> Option<&ExpertWeights<ExpertLinear>> {
        self.weights.layers.get(layer)?.moe.experts.get(expert)
    }
}
