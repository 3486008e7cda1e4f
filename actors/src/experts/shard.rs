//! `ExpertShard`: what one EP rank holds for one placement epoch — the logical expert of each of
//! its physical slots in every backbone layer, their weights (the model's own where the model
//! holds the expert, else a copy read for the shard from the checkpoint), and a load counter per
//! physical slot (tokens served), read by the EPLB. The model is either family's (`AnyModel`,
//! seen through `ExpertHost`): a shard only runs experts on the rows and picks it is handed.
//!
//! A shard is immutable but for its counters; a new placement builds a new shard (reusing the
//! weights of experts this rank already held, reading the others), so the shard of a running
//! step never changes under it. A simulated shard (`ExpertSource::Simulated`) holds no weights:
//! its simulated device adds its picks to the counters (`count`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use deepinfer_model::any_model::AnyModel;
use deepinfer_model::expert_dispatch::{ExpertHost, RoutedExpert};
use deepinfer_model::{Model, v4};
use deepinfer_topology::{EpRank, ExpertId, ExpertPlacement, PlacementEpoch};

use crate::comm::EpError;

/// Where the expert weights of an engine's shards come from.
#[derive(Debug, Clone)]
pub enum ExpertSource {
    /// The served model (either family): shards run its weights of the experts it holds,
    /// copies of the others.
    Model(AnyModel),
    /// Simulated devices (`deepinfer-node --simulate`): placements and load counters only.
    Simulated {
        layers: usize,
        routed_experts: usize,
    },
}

impl ExpertSource {
    /// Backbone layers (one placement layer each).
    pub fn layers(&self) -> usize {
        match self {
            ExpertSource::Model(model) => model.config().n_layers,
            ExpertSource::Simulated { layers, .. } => *layers,
        }
    }

    /// Logical routed experts per layer.
    pub fn routed_experts(&self) -> usize {
        match self {
            ExpertSource::Model(model) => model.config().n_routed_experts,
            ExpertSource::Simulated { routed_experts, .. } => *routed_experts,
        }
    }
}

impl From<AnyModel> for ExpertSource {
    fn from(model: AnyModel) -> Self {
        ExpertSource::Model(model)
    }
}

impl From<Arc<Model>> for ExpertSource {
    fn from(model: Arc<Model>) -> Self {
        ExpertSource::Model(model.into())
    }
}

impl From<Arc<v4::Model>> for ExpertSource {
    fn from(model: Arc<v4::Model>) -> Self {
        ExpertSource::Model(model.into())
    }
}

/// Where a slot's weights are.
#[derive(Debug, Clone)]
enum SlotWeights {
    /// The model's own (it holds the expert): nothing copied.
    Model,
    /// A copy read for the shard (an expert the model was loaded without).
    Copy(Arc<RoutedExpert>),
}

/// `[layer][local slot]` weights of the experts `held`: those `previous` holds shared, the
/// model's own where it holds the expert, the others read by `model` in one call.
fn shard_weights(
    model: &dyn ExpertHost,
    held: &[Vec<ExpertId>],
    previous: Option<&ExpertShard>,
) -> Result<Vec<Vec<SlotWeights>>, EpError> {
    let kept = |layer: usize, expert: ExpertId| {
        previous
            .and_then(|p| p.weights_of(layer, expert))
            .or_else(|| {
                model
                    .holds_routed_expert(layer, expert.index())
                    .then_some(SlotWeights::Model)
            })
    };
    let wanted: Vec<(usize, usize)> = held
        .iter()
        .enumerate()
        .flat_map(|(layer, row)| row.iter().map(move |&expert| (layer, expert)))
        .filter(|&(layer, expert)| kept(layer, expert).is_none())
        .map(|(layer, expert)| (layer, expert.index()))
        .collect();
    let mut copies = model
        .copy_routed_experts(&wanted)
        .map_err(|e| EpError::Model(e.to_string()))?
        .into_iter();
    held.iter()
        .enumerate()
        .map(|(layer, row)| {
            row.iter()
                .map(|&expert| match kept(layer, expert) {
                    Some(weights) => Ok(weights),
                    None => copies
                        .next()
                        .map(|c| SlotWeights::Copy(Arc::new(c)))
                        .ok_or_else(|| {
                            EpError::Model(format!("no copy of expert {expert} of layer {layer}"))
                        }),
                })
                .collect()
        })
        .collect()
}

/// One EP rank's experts in one epoch.
#[derive(Debug)]
pub struct ExpertShard {
    rank: EpRank,
    epoch: PlacementEpoch,
    /// `[layer][local slot]`: the logical expert held.
    held: Vec<Vec<ExpertId>>,
    /// `[layer][local slot]`: its weights (empty rows for a simulated shard).
    weights: Vec<Vec<SlotWeights>>,
    /// `[layer][local slot]`: picks served since the last `take_loads`.
    served: Vec<Vec<AtomicU64>>,
}

/// How a shard was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StageReport {
    /// Slots whose weights were copied in (the expert was not on this rank before; for a
    /// simulated shard, would have been).
    pub copied: usize,
    /// Slots that kept weights this rank already held.
    pub reused: usize,
}

impl ExpertShard {
    /// The shard of `rank` under `placement` for `epoch`: weights of experts `previous` holds in
    /// the same layer are shared, the rest are copied from the model of `source` (read from its
    /// checkpoint when the model was loaded without them: `ExpertHost::copy_routed_experts`).
    pub fn build(
        source: &ExpertSource,
        placement: &ExpertPlacement,
        rank: EpRank,
        epoch: PlacementEpoch,
        previous: Option<&ExpertShard>,
    ) -> Result<(ExpertShard, StageReport), EpError> {
        let mut report = StageReport::default();
        let mut held = Vec::with_capacity(placement.layers.len());
        for layer in 0..placement.layers.len() {
            let experts = placement.experts_on_rank(layer, rank).to_vec();
            if experts.len() != placement.slots_per_gpu {
                return Err(EpError::Shape {
                    what: "slots of an EP rank in a placement layer",
                    expected: placement.slots_per_gpu,
                    found: experts.len(),
                });
            }
            for &expert in &experts {
                if previous.is_some_and(|p| p.holds(layer, expert)) {
                    report.reused += 1;
                } else {
                    report.copied += 1;
                }
            }
            held.push(experts);
        }
        let weights = match source {
            ExpertSource::Model(model) => shard_weights(model.experts(), &held, previous)?,
            ExpertSource::Simulated { .. } => held.iter().map(|_| Vec::new()).collect(),
        };
        let served = held
            .iter()
            .map(|row| row.iter().map(|_| AtomicU64::new(0)).collect())
            .collect();
        Ok((
            ExpertShard {
                rank,
                epoch,
                held,
                weights,
                served,
            },
            report,
        ))
    }

    pub fn rank(&self) -> EpRank {
        self.rank
    }

    pub fn epoch(&self) -> PlacementEpoch {
        self.epoch
    }

    /// Slots whose weights are a copy read for this shard (not the model's own).
    pub fn copies(&self) -> usize {
        self.weights
            .iter()
            .flatten()
            .filter(|w| matches!(w, SlotWeights::Copy(_)))
            .count()
    }

    /// `[layer][local slot]`: the logical expert each slot holds.
    pub fn held(&self) -> &[Vec<ExpertId>] {
        &self.held
    }

    /// Whether a slot of `layer` holds `expert`.
    fn holds(&self, layer: usize, expert: ExpertId) -> bool {
        self.held
            .get(layer)
            .is_some_and(|row| row.contains(&expert))
    }

    /// The weights this shard holds for `expert` in `layer`, if any slot holds it.
    fn weights_of(&self, layer: usize, expert: ExpertId) -> Option<SlotWeights> {
        let local = self.held.get(layer)?.iter().position(|&e| e == expert)?;
        self.weights.get(layer)?.get(local).cloned()
    }

    /// Checks that this shard holds what `placement` puts on EP rank `rank`.
    pub fn check_holds(&self, placement: &ExpertPlacement, rank: EpRank) -> Result<(), EpError> {
        if self.rank != rank || self.held.len() != placement.layers.len() {
            return Err(EpError::Shape {
                what: "layers of the shard of the EP rank at this position",
                expected: placement.layers.len(),
                found: if self.rank == rank {
                    self.held.len()
                } else {
                    0
                },
            });
        }
        for (layer, row) in self.held.iter().enumerate() {
            let expected = placement.experts_on_rank(layer, rank);
            if let Some(slot) =
                (0..expected.len().max(row.len())).find(|&slot| expected.get(slot) != row.get(slot))
            {
                return Err(EpError::ShardSlot {
                    rank,
                    layer,
                    slot,
                    expected: format!("{:?}", expected.get(slot)),
                    found: format!("{:?}", row.get(slot)),
                });
            }
        }
        Ok(())
    }

    /// Runs the expert of local slot `local` of `layer` on one token and counts the pick (on
    /// `model`, the model the shard was built from). The caller (`LocalComm`) only names slots
    /// its validated placement puts on this rank.
    pub fn run(
        &self,
        model: &dyn ExpertHost,
        layer: usize,
        local: usize,
        x: &[f32],
        weight: f32,
    ) -> Result<Vec<f32>, EpError> {
        self.served[layer][local].fetch_add(1, Ordering::Relaxed);
        let expert = self.held[layer][local];
        let output = match self.weights.get(layer).and_then(|row| row.get(local)) {
            Some(SlotWeights::Model) => model.run_held_expert((layer, expert.index()), x, weight),
            Some(SlotWeights::Copy(copy)) => Some(model.run_routed_expert(copy, x, weight)),
            None => None,
        };
        output.ok_or_else(|| EpError::Layer {
            layer,
            message: format!(
                "{} slot {local}: {expert} has no weights in this shard or its model",
                self.rank
            ),
        })
    }

    /// Counts `picks` served by local slot `local` of `layer` without computing them (a
    /// simulated device); slots outside the shard are refused.
    pub fn count(&self, layer: usize, local: usize, picks: u64) -> Result<(), EpError> {
        let counter = self
            .served
            .get(layer)
            .and_then(|row| row.get(local))
            .ok_or(EpError::Layer {
                layer,
                message: format!("{} has no local slot {local}", self.rank),
            })?;
        counter.fetch_add(picks, Ordering::Relaxed);
        Ok(())
    }

    /// `[layer][local slot]` picks served since the last call, and resets the counters.
    pub fn take_loads(&self) -> Vec<Vec<u64>> {
        self.served
            .iter()
            .map(|row| row.iter().map(|c| c.swap(0, Ordering::Relaxed)).collect())
            .collect()
    }
}
