//! The model side of [`crate::expert_dispatch`]: the per-layer routed-expert site carried in
//! `Ctx`, the forward entry that takes a [`RoutedExperts`], and the accessors an expert shard
//! needs (its weights, and running one expert exactly as the model does).

use super::{LogitsWanted, Model, SequenceState};
use crate::backend::weights::{ExpertLinear, ExpertWeights, Linear};
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

    /// [`Model::run_routed_expert`] with this model's own weights of routed expert `expert` of
    /// backbone layer `layer` (`None`: it does not hold that expert).
    pub fn run_held_expert(
        &self,
        layer: usize,
        expert: usize,
        x: &[f32],
        weight: f32,
    ) -> Option<Vec<f32>> {
        let weights = self.routed_weights(layer, expert)?;
        Some(moe::expert(&self.ctx(), weights, &x.into(), Some(&[weight])).into_vec())
    }

    /// Whether this model holds routed expert `expert` of backbone layer `layer` (an
    /// `ExpertFilter` may have left it out).
    pub fn holds_routed_expert(&self, layer: usize, expert: usize) -> bool {
        self.routed_weights(layer, expert).is_some()
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

    /// Each backbone layer's routed experts (the lists an expert rank places), entry `e` being
    /// expert `e` in a model that holds every expert ([`Model::holds_every_expert`]).
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
        self.layers.get(layer)?.moe.expert(expert)
    }

    /// Whether this model holds every backbone routed expert (no `ExpertFilter` left one out).
    pub fn holds_every_expert(&self) -> bool {
        self.layers.iter().all(|b| b.moe.held.is_none())
    }

    /// Fails naming the first backbone routed expert this model does not hold: running its
    /// routed experts itself (no expert hook) would give that expert's picks no output.
    pub(crate) fn check_experts_held(&self) -> Result<(), ModelError> {
        let missing = self
            .layers
            .iter()
            .enumerate()
            .find_map(|(layer, b)| b.moe.first_missing().map(|expert| (layer, expert)));
        match missing {
            None => Ok(()),
            Some((layer, expert)) => Err(ModelError::Unsupported {
                what: format!(
                    "running routed expert {expert} of layer {layer} here: this model was loaded                      with an expert filter and holds only some routed experts (those of its EP                      ranks); run it through expert parallelism (an expert hook)"
                ),
            }),
        }
    }

    /// Host bytes of the backbone routed experts this model holds, and how many (layer,
    /// expert) pairs they are.
    pub fn routed_expert_bytes(&self) -> (u64, usize) {
        let mut bytes = 0u64;
        let mut count = 0usize;
        for block in self.layers.iter() {
            for expert in &block.moe.experts {
                count += 1;
                bytes += [&expert.w1, &expert.w2, &expert.w3]
                    .into_iter()
                    .map(linear_bytes)
                    .sum::<u64>();
            }
        }
        (bytes, count)
    }
}

/// Host bytes of one stored expert projection (codes and scales).
fn linear_bytes(w: &ExpertLinear) -> u64 {
    let bytes = match w {
        ExpertLinear::Fp4(w) | ExpertLinear::Exact(Linear::Fp4(w)) => {
            w.packed.len() + w.scales.len()
        }
        ExpertLinear::Fp8(w) | ExpertLinear::Exact(Linear::Fp8(w)) => w.data.len() + w.scales.len(),
        ExpertLinear::Exact(Linear::Dense { values, .. }) => {
            std::mem::size_of_val(values.as_slice())
        }
    };
    bytes as u64
}
