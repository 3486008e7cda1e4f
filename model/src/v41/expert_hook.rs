//! The model side of [`crate::expert_dispatch`]: the per-layer routed-expert site carried in
//! `Ctx`, the forward entry that takes a [`RoutedExperts`], and the accessors an expert shard
//! needs (its weights, and running one expert exactly as the model does).

use super::{LogitsWanted, Model, SequenceState};
use crate::backend::weights::{ExpertLinear, ExpertWeights};
use crate::error::ModelError;
use crate::expert_dispatch::{RoutedExpert, RoutedExperts};
use crate::layers::moe;

impl Model {
    /// [`Model::forward`] with every backbone block's routed experts run by `experts` (the
    /// router, the combine order and the shared expert stay here, so the logits are bitwise those
    /// of [`Model::forward`] when `experts` honours the [`RoutedExperts`] contract).
    pub fn forward_with_experts(
        &self,
        seq: &mut SequenceState,
        tokens: &[u32],
        want: LogitsWanted,
        experts: &dyn RoutedExperts,
    ) -> Result<Vec<f32>, ModelError> {
        self.run_chunk_with(seq, tokens, want, None, None, Some(experts))
    }

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
        self.idle_expert_layers(0);
    }

    /// [`Model::idle_expert_step`] for backbone layers `from..` only: a step whose rows all
    /// ended before layer `from` (a chunk wholly before its decoder start) still takes part in
    /// the remaining layers' collectives, so every step runs every layer's exchange once.
    pub(crate) fn idle_expert_layers(&self, from: usize) {
        let ctx = self.ctx();
        let empty = crate::backend::Tensor::empty();
        for block in self.layers.iter().skip(from) {
            let _ = ctx
                .backend
                .moe_rows(&empty, &moe::layer_op(&ctx, &block.moe));
        }
    }

    /// Each backbone layer's routed experts (the lists an expert rank places).
    pub fn expert_lists(&self) -> Vec<&[ExpertWeights<ExpertLinear>]> {
        self.layers
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
        self.layers.get(layer)?.moe.experts.get(expert)
    }
}
