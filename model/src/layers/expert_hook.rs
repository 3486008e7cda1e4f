//! The model side of [`crate::expert_dispatch`] beyond the step's `StepOptions::experts`, written
//! once for both families: what a family's weights tell it ([`BackboneMoe`], [`Backbone`]: each
//! backbone layer's MoE, the experts an expert-filtered load left out), and from that, for every
//! [`Loaded`] model, the [`ExpertHost`] an expert shard uses (copies of the routed experts,
//! running one exactly as the model does, the idle step of an expert-parallel rank).

use crate::backend::weights::{ExpertLinear, ExpertWeights, Linear};
use crate::backend::{Backend, MoeLayer};
use std::sync::Arc;

use crate::checkpoint::{Checkpoint, ExpertFilter};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::expert_dispatch::{ExpertHost, RoutedExpert};
use crate::layers::loaded::Loaded;
use crate::layers::moe;
use crate::layers::step::{StepEntry, step_error};
use crate::layers::weights::BlockWeights;

/// How a family reads routed expert `expert` of backbone layer `layer` from a checkpoint, exactly
/// as its loader reads it.
pub type ReadExpert =
    fn(&Checkpoint, &ModelConfig, usize, usize) -> Result<ExpertWeights<ExpertLinear>, ModelError>;

/// The routed experts an expert-filtered load left out: its checkpoint, kept open (mapped, nothing
/// resident until read, even once its files are unlinked), and how the family reads one of them
/// when asked for ([`ExpertHost::copy_routed_experts`]).
#[derive(Debug, Clone)]
pub struct LeftOutExperts {
    checkpoint: Arc<Checkpoint>,
    read: ReadExpert,
}

/// A family's backbone blocks, in order (their `moe` is what expert parallelism places), and the
/// experts its load left out.
#[derive(Debug, Clone)]
pub struct Backbone<A> {
    pub layers: Arc<Vec<BlockWeights<A>>>,
    /// `None` for a whole model.
    pub left_out: Option<LeftOutExperts>,
}

impl<A> Backbone<A> {
    /// `layers`, read from `ckpt` keeping the routed experts `experts` keeps; a filter that left
    /// experts out opens `ckpt`'s directory again so that `read` can read them later.
    pub fn new(
        layers: Vec<BlockWeights<A>>,
        ckpt: &Checkpoint,
        experts: &ExpertFilter,
        read: ReadExpert,
    ) -> Result<Backbone<A>, ModelError> {
        let left_out = match experts.is_all() {
            true => None,
            false => Some(LeftOutExperts {
                checkpoint: Arc::new(Checkpoint::open(ckpt.dir())?),
                read,
            }),
        };
        Ok(Backbone {
            layers: Arc::new(layers),
            left_out,
        })
    }
}

/// What expert parallelism needs of a family's host weights (`v41::ModelWeights`,
/// `v4::ModelWeights`).
pub trait BackboneMoe {
    /// The family's attention weights (the blocks' `A`).
    type Attention;

    /// The backbone and the experts its load left out.
    fn backbone(&self) -> &Backbone<Self::Attention>;

    /// The family's fused MoE op over no rows ([`Backend::moe_rows`] for V4.1's FP4/FP8
    /// experts, [`Backend::moe_rows_exact`] for the V4 family's exact ones): what an idle step
    /// runs for `layer`, so that an expert-parallel backend takes part in the collective a busy
    /// rank's layer runs.
    fn idle_moe(backend: &dyn Backend, layer: &MoeLayer<'_>);
}

impl<W: BackboneMoe + Clone> Loaded<W> {
    /// The model's own weights of routed expert `expert` in backbone layer `layer`.
    pub(crate) fn routed_weights(
        &self,
        layer: usize,
        expert: usize,
    ) -> Option<&ExpertWeights<ExpertLinear>> {
        self.weights
            .backbone()
            .layers
            .get(layer)?
            .moe
            .expert(expert)
    }

    /// [`ExpertHost::idle_expert_step`] for backbone layers `from..` only: a step whose rows all
    /// ended before layer `from` (a chunk wholly before its decoder start) still takes part in
    /// the remaining layers' collectives, so every step runs every layer's exchange once.
    pub(crate) fn idle_expert_layers(&self, from: usize) {
        let ctx = self.ctx();
        for block in self.weights.backbone().layers.iter().skip(from) {
            W::idle_moe(ctx.backend, &moe::layer_op(&ctx, &block.moe));
        }
    }

    /// Fails naming the first backbone routed expert this model does not hold: running its
    /// routed experts itself (no expert hook) would give that expert's picks no output.
    pub(crate) fn check_experts_held(&self) -> Result<(), ModelError> {
        let missing = self
            .weights
            .backbone()
            .layers
            .iter()
            .enumerate()
            .find_map(|(layer, b)| b.moe.first_missing().map(|expert| (layer, expert)));
        match missing {
            None => Ok(()),
            Some((layer, expert)) => Err(ModelError::Unsupported {
                what: format!(
                    "running routed expert {expert} of layer {layer} here: this model was loaded \
                     with an expert filter and holds only some routed experts (those of its EP \
                     ranks); run it through expert parallelism (an expert hook)"
                ),
            }),
        }
    }

    /// What every family's step checks before any state changes: the routed experts held when no
    /// hook runs them (`experts_hooked` false), then each entry (`check`, given its index), a bad
    /// entry failing the step with its index ([`step_error`]).
    pub(crate) fn check_step<S>(
        &self,
        entries: &[StepEntry<'_, S>],
        experts_hooked: bool,
        check: impl Fn(usize, &StepEntry<'_, S>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        if !experts_hooked {
            self.check_experts_held()?;
        }
        for (e, entry) in entries.iter().enumerate() {
            check(e, entry).map_err(|err| step_error(e, entries.len(), err))?;
        }
        Ok(())
    }
}

impl<W: BackboneMoe + Clone + Send + Sync> ExpertHost for Loaded<W> {
    fn routed_expert(&self, layer: usize, expert: usize) -> Result<RoutedExpert, ModelError> {
        let layers = self.cfg.n_layers;
        let experts = self.cfg.n_routed_experts;
        if let Some(weights) = self.routed_weights(layer, expert) {
            return Ok(RoutedExpert(weights.clone()));
        }
        let what = if layer < layers && expert < experts {
            format!(
                "routed expert {expert} of layer {layer}: the expert filter it was loaded with left \
                 it out (it is held by the process of another EP rank)"
            )
        } else {
            format!(
                "routed expert {expert} of layer {layer} (the model has {layers} layers of {experts} experts)"
            )
        };
        Err(ModelError::Unsupported { what })
    }

    fn copy_routed_experts(
        &self,
        wanted: &[(usize, usize)],
    ) -> Result<Vec<RoutedExpert>, ModelError> {
        let cfg = &self.cfg;
        wanted
            .iter()
            .map(|&(layer, expert)| {
                let left_out = self.weights.backbone().left_out.as_ref();
                match (left_out, self.routed_weights(layer, expert)) {
                    (_, Some(held)) => Ok(RoutedExpert(held.clone())),
                    (Some(left_out), None)
                        if layer < cfg.n_layers && expert < cfg.n_routed_experts =>
                    {
                        (left_out.read)(&left_out.checkpoint, cfg, layer, expert).map(RoutedExpert)
                    }
                    _ => self.routed_expert(layer, expert),
                }
            })
            .collect()
    }

    fn run_routed_expert(&self, expert: &RoutedExpert, x: &[f32], weight: f32) -> Vec<f32> {
        moe::expert(&self.ctx(), &expert.0, &x.into(), Some(&[weight])).into_vec()
    }

    fn run_held_expert(
        &self,
        (layer, expert): (usize, usize),
        x: &[f32],
        weight: f32,
    ) -> Option<Vec<f32>> {
        let weights = self.routed_weights(layer, expert)?;
        Some(moe::expert(&self.ctx(), weights, &x.into(), Some(&[weight])).into_vec())
    }

    fn holds_routed_expert(&self, layer: usize, expert: usize) -> bool {
        self.routed_weights(layer, expert).is_some()
    }

    fn holds_every_expert(&self) -> bool {
        self.weights
            .backbone()
            .layers
            .iter()
            .all(|b| b.moe.held.is_none())
    }

    fn routed_expert_bytes(&self) -> (u64, usize) {
        let mut bytes = 0u64;
        let mut count = 0usize;
        for block in self.weights.backbone().layers.iter() {
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

    fn expert_lists(&self) -> Vec<&[ExpertWeights<ExpertLinear>]> {
        self.weights
            .backbone()
            .layers
            .iter()
            .map(|b| b.moe.experts.as_slice())
            .collect()
    }

    fn idle_expert_step(&self) {
        self.idle_expert_layers(0);
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
