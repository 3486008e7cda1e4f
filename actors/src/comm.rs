//! MoE dispatch and combine between DP ranks and EP ranks, inside a rank's step.
//!
//! Owns: the `Comm` trait (how one token's routed pick reaches the EP rank holding a replica of
//! its expert and comes back), `LocalComm` (every EP rank's shard in this process, on the CPU:
//! the caller's thread computes with the owning shard's own copy of the weights), `StepExperts`
//! (the model's `RoutedExperts` hook for one step over one `Comm`, recording which placement
//! epochs served it) and `EpError`.
//! Ordering: a `LocalComm` is immutable and belongs to one `PlacementEpoch`; a new placement is a
//! new `LocalComm`, adopted by a rank at its next step boundary, so no step mixes epochs.
//! Numerics: the model sums the outputs in increasing logical expert id whatever served them, and
//! every replica holds the model's weights, so the placement never changes a bit.
//! Replica choice: a pure function of (layer, expert, the token's activation bits), so it does
//! not depend on the batch, the DP rank or the timing (NCCL's all-to-all comes with the CUDA
//! backend and must keep this rule).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use deepinfer_model::expert_dispatch::{ExpertPick, RoutedExperts};
use deepinfer_topology::{EpRank, ExpertPlacement, PlacementEpoch, PlacementError};

use crate::experts::shard::{ExpertShard, ExpertSource};
use crate::messages::experts::ShardLoads;

/// An expert-parallel failure: a placement or shard that does not fit the model, a stale epoch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EpError {
    #[error("expert placement: {0}")]
    Placement(#[from] PlacementError),
    #[error("expert placement: {what} (expected {expected}, found {found})")]
    Shape {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("expert placement layer {layer}: {message}")]
    Layer { layer: usize, message: String },
    #[error("{rank}: shard of {found}, but the placement being built is {expected}")]
    ShardEpoch {
        rank: EpRank,
        expected: PlacementEpoch,
        found: PlacementEpoch,
    },
    #[error("{rank} layer {layer} slot {slot}: holds {found}, the placement says {expected}")]
    ShardSlot {
        rank: EpRank,
        layer: usize,
        slot: usize,
        expected: String,
        found: String,
    },
    #[error("{rank}: cannot commit {epoch}: {message}")]
    Commit {
        rank: EpRank,
        epoch: PlacementEpoch,
        message: String,
    },
    #[error("EPLB cannot commit {epoch}: {message}")]
    Staging {
        epoch: PlacementEpoch,
        message: String,
    },
    #[error("model: {0}")]
    Model(String),
    #[error("expert-parallel actor unreachable: {0}")]
    Actor(String),
}

/// What serving one pick produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    /// The expert's output row (`x.len()` wide, the routing weight applied).
    pub output: Vec<f32>,
    /// The EP rank that computed it.
    pub rank: EpRank,
    /// The placement epoch of the shard that computed it.
    pub epoch: PlacementEpoch,
}

/// The MoE transport of one placement epoch.
pub trait Comm: Send + Sync {
    /// The placement epoch this transport serves.
    fn epoch(&self) -> PlacementEpoch;
    /// EP ranks it spans.
    fn ep_ranks(&self) -> usize;
    /// Sends each pick of one token of backbone layer `layer` to the EP rank holding the chosen
    /// replica of its expert, runs it there, and brings the outputs back, in pick order.
    fn serve(&self, layer: usize, x: &[f32], picks: &[ExpertPick]) -> Vec<Served>;
}

/// Every EP rank's shard in one process, for one placement epoch.
#[derive(Debug)]
pub struct LocalComm {
    epoch: PlacementEpoch,
    source: ExpertSource,
    placement: Arc<ExpertPlacement>,
    shards: Vec<Arc<ExpertShard>>,
    /// Held shared while a batch of counts is added (`count_batch`) and exclusively while every
    /// shard's counters are read (`take_loads`), so no batch is split between two windows.
    counting: RwLock<()>,
}

impl LocalComm {
    /// Checks that `placement` covers every backbone layer and logical expert of `source` and
    /// that `shards` (one per EP rank, in rank order) are this epoch's and hold what it says.
    pub fn new(
        epoch: PlacementEpoch,
        source: impl Into<ExpertSource>,
        placement: Arc<ExpertPlacement>,
        shards: Vec<Arc<ExpertShard>>,
    ) -> Result<LocalComm, EpError> {
        let source = source.into();
        check_placement(&source, &placement)?;
        let ranks = placement
            .layers
            .first()
            .map_or(0, |l| l.phy2log.len() / placement.slots_per_gpu.max(1));
        if shards.len() != ranks {
            return Err(EpError::Shape {
                what: "expert shards (one per EP rank)",
                expected: ranks,
                found: shards.len(),
            });
        }
        for (index, shard) in shards.iter().enumerate() {
            if shard.epoch() != epoch {
                return Err(EpError::ShardEpoch {
                    rank: shard.rank(),
                    expected: epoch,
                    found: shard.epoch(),
                });
            }
            shard.check_holds(&placement, EpRank(index as u16))?;
        }
        Ok(LocalComm {
            epoch,
            source,
            placement,
            shards,
            counting: RwLock::new(()),
        })
    }

    /// Runs `count` (which adds picks to the shards' counters, e.g. a whole simulated step)
    /// so that `take_loads` sees all of its counts or none.
    pub fn count_batch<R>(&self, count: impl FnOnce(&[Arc<ExpertShard>]) -> R) -> R {
        let _shared = self.counting.read().unwrap_or_else(|p| p.into_inner());
        count(&self.shards)
    }

    /// Reads and resets every shard's load counters at one point between counted batches,
    /// in EP rank order: the ranks' counts cover the same steps.
    pub fn take_loads(&self) -> Vec<ShardLoads> {
        let _exclusive = self.counting.write().unwrap_or_else(|p| p.into_inner());
        self.shards
            .iter()
            .map(|shard| ShardLoads {
                epoch: shard.epoch(),
                per_slot: shard.take_loads(),
            })
            .collect()
    }

    /// The placement this transport dispatches by.
    pub fn placement(&self) -> &Arc<ExpertPlacement> {
        &self.placement
    }

    /// The shards, in EP rank order.
    pub fn shards(&self) -> &[Arc<ExpertShard>] {
        &self.shards
    }

    /// The physical slot that serves `expert` of `layer` for the token with activation `x`.
    pub fn replica_slot(&self, layer: usize, expert: usize, x: &[f32]) -> u32 {
        self.slot_for(layer, expert, token_key(x))
    }

    fn slot_for(&self, layer: usize, expert: usize, token: u64) -> u32 {
        let replicas = &self.placement.layers[layer].log2phy[expert];
        replicas[replica_index(layer, expert, token, replicas.len())]
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv_feed(hash: u64, word: u64) -> u64 {
    word.to_le_bytes().iter().fold(hash, |h, &byte| {
        (h ^ u64::from(byte)).wrapping_mul(FNV_PRIME)
    })
}

/// A token's dispatch key: FNV-1a over the bits of its MoE input (computed once per token and
/// layer).
pub fn token_key(x: &[f32]) -> u64 {
    x.iter()
        .fold(FNV_OFFSET, |h, v| fnv_feed(h, u64::from(v.to_bits())))
}

/// Which of `replicas` copies of `expert` in `layer` serves the token with key `token`.
pub fn replica_index(layer: usize, expert: usize, token: u64, replicas: usize) -> usize {
    let hash = fnv_feed(fnv_feed(token, layer as u64), expert as u64);
    (hash % replicas.max(1) as u64) as usize
}

/// `placement` must have one entry per backbone layer, every logical expert with at least one
/// replica, and every slot in range.
fn check_placement(source: &ExpertSource, placement: &ExpertPlacement) -> Result<(), EpError> {
    let (layers, experts) = (source.layers(), source.routed_experts());
    if placement.layers.len() != layers {
        return Err(EpError::Shape {
            what: "placement layers (one per backbone layer)",
            expected: layers,
            found: placement.layers.len(),
        });
    }
    for (layer, lp) in placement.layers.iter().enumerate() {
        if lp.log2phy.len() != experts {
            return Err(EpError::Layer {
                layer,
                message: format!(
                    "{} logical experts, the model has {}",
                    lp.log2phy.len(),
                    experts
                ),
            });
        }
        for (expert, slots) in lp.log2phy.iter().enumerate() {
            if slots.is_empty() {
                return Err(EpError::Layer {
                    layer,
                    message: format!("expert {expert} has no replica"),
                });
            }
            for &slot in slots {
                let held = lp.phy2log.get(slot as usize).map(|e| e.index());
                if held != Some(expert) {
                    return Err(EpError::Layer {
                        layer,
                        message: format!(
                            "log2phy sends expert {expert} to slot {slot}, which holds {held:?}"
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

impl Comm for LocalComm {
    fn epoch(&self) -> PlacementEpoch {
        self.epoch
    }

    fn ep_ranks(&self) -> usize {
        self.shards.len()
    }

    /// Panics on a simulated transport, which holds no weights: only a model-backed
    /// `ExpertParallel` hands its transport to a model's forward (`ModelExecutor`).
    fn serve(&self, layer: usize, x: &[f32], picks: &[ExpertPick]) -> Vec<Served> {
        let ExpertSource::Model(model) = &self.source else {
            panic!("a simulated expert-parallel transport was asked to compute an expert");
        };
        let token = token_key(x);
        let per_rank = self.placement.slots_per_gpu.max(1);
        picks
            .iter()
            .map(|pick| {
                let slot = self.slot_for(layer, pick.expert, token) as usize;
                let shard = &self.shards[slot / per_rank];
                Served {
                    output: shard.run(model, layer, slot % per_rank, x, pick.weight),
                    rank: shard.rank(),
                    epoch: shard.epoch(),
                }
            })
            .collect()
    }
}

/// The model's routed-expert hook for one step: every pick goes through one `Comm`, and the
/// epochs of the shards that served the step are recorded.
pub struct StepExperts<'c> {
    comm: &'c dyn Comm,
    lowest: AtomicU32,
    highest: AtomicU32,
}

impl<'c> StepExperts<'c> {
    pub fn new(comm: &'c dyn Comm) -> Self {
        StepExperts {
            comm,
            lowest: AtomicU32::new(u32::MAX),
            highest: AtomicU32::new(0),
        }
    }

    /// The lowest and highest epoch that served a pick of this step (`None` before any pick).
    pub fn epochs_seen(&self) -> Option<(PlacementEpoch, PlacementEpoch)> {
        let lowest = self.lowest.load(Ordering::Relaxed);
        let highest = self.highest.load(Ordering::Relaxed);
        (lowest <= highest).then_some((PlacementEpoch(lowest), PlacementEpoch(highest)))
    }
}

impl RoutedExperts for StepExperts<'_> {
    fn run(&self, layer: usize, x: &[f32], picks: &[ExpertPick]) -> Vec<Vec<f32>> {
        self.comm
            .serve(layer, x, picks)
            .into_iter()
            .map(|served| {
                self.lowest.fetch_min(served.epoch.get(), Ordering::Relaxed);
                self.highest
                    .fetch_max(served.epoch.get(), Ordering::Relaxed);
                served.output
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_choice_is_a_pure_function_that_spreads() {
        let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.25).collect();
        let key = token_key(&x);
        assert_eq!(key, token_key(&x.clone()));
        assert_eq!(replica_index(3, 5, key, 4), replica_index(3, 5, key, 4));
        assert_eq!(replica_index(3, 5, key, 1), 0);
        let mut hits = [0usize; 4];
        for t in 0..400 {
            let row: Vec<f32> = (0..16).map(|i| (i * 31 + t) as f32 * 0.01).collect();
            hits[replica_index(0, 1, token_key(&row), 4)] += 1;
        }
        assert!(
            hits.iter().all(|&h| h > 50),
            "every replica gets traffic: {hits:?}"
        );
    }
}

#[cfg(test)]
mod comm_checks {
    use super::*;
    use crate::experts::tiny_test_model;
    use deepinfer_topology::PlacementShape;

    #[test]
    fn a_load_window_holds_every_rank_of_a_counted_batch_or_none() {
        // Simulated shards on 4 EP ranks; a counting thread adds one pick to every rank per batch
        // while this thread reads and resets the windows: each window must hold the same number of
        // whole batches on every rank.
        let source = ExpertSource::Simulated {
            layers: 1,
            routed_experts: 8,
        };
        let shape = PlacementShape {
            num_replicas: 8,
            num_groups: 1,
            num_nodes: 1,
            num_gpus: 4,
        };
        let placement = Arc::new(ExpertPlacement::uniform(1, 8, shape).expect("uniform"));
        let shards = (0..4)
            .map(|rank| {
                let (shard, _) =
                    ExpertShard::build(&source, &placement, EpRank(rank), PlacementEpoch(0), None)
                        .expect("built");
                Arc::new(shard)
            })
            .collect();
        let comm =
            Arc::new(LocalComm::new(PlacementEpoch(0), source, placement, shards).expect("comm"));
        const BATCHES: u64 = 20_000;
        let counter = {
            let comm = comm.clone();
            std::thread::spawn(move || {
                for _ in 0..BATCHES {
                    comm.count_batch(|shards| {
                        for shard in shards {
                            shard.count(0, 0, 1).expect("slot 0");
                        }
                    });
                }
            })
        };
        let window = || -> u64 {
            let per_rank: Vec<u64> = comm
                .take_loads()
                .iter()
                .map(|loads| loads.per_slot.iter().flatten().sum())
                .collect();
            assert!(
                per_rank.iter().all(|&n| n == per_rank[0]),
                "a window split a batch between ranks: {per_rank:?}"
            );
            per_rank[0]
        };
        let mut seen = 0;
        while !counter.is_finished() {
            seen += window();
        }
        counter.join().expect("counting thread");
        seen += window();
        assert_eq!(seen, BATCHES, "every batch counted in exactly one window");
    }

    #[test]
    fn local_comm_refuses_shards_that_do_not_fit() {
        let (_dir, model) = tiny_test_model();
        let layers = model.config().n_layers;
        let shape = PlacementShape {
            num_replicas: 8,
            num_groups: 1,
            num_nodes: 1,
            num_gpus: 2,
        };
        let placement = Arc::new(ExpertPlacement::uniform(layers, 8, shape).expect("uniform"));
        let shard = |rank: u16, epoch: u32| {
            ExpertShard::build(
                &model.clone().into(),
                &placement,
                EpRank(rank),
                PlacementEpoch(epoch),
                None,
            )
            .map(|(s, _)| Arc::new(s))
            .expect("built")
        };
        let ok = LocalComm::new(
            PlacementEpoch(0),
            model.clone(),
            placement.clone(),
            vec![shard(0, 0), shard(1, 0)],
        );
        assert!(ok.is_ok());
        let missing = LocalComm::new(
            PlacementEpoch(0),
            model.clone(),
            placement.clone(),
            vec![shard(0, 0)],
        );
        assert!(matches!(missing, Err(EpError::Shape { found: 1, .. })));
        let stale = LocalComm::new(
            PlacementEpoch(1),
            model.clone(),
            placement.clone(),
            vec![shard(0, 1), shard(1, 0)],
        );
        assert!(matches!(stale, Err(EpError::ShardEpoch { .. })));
        let swapped = LocalComm::new(
            PlacementEpoch(0),
            model.clone(),
            placement.clone(),
            vec![shard(1, 0), shard(0, 0)],
        );
        assert!(swapped.is_err());
        let short = Arc::new(ExpertPlacement::uniform(layers - 1, 8, shape).expect("uniform"));
        let wrong_layers = LocalComm::new(PlacementEpoch(0), model, short, vec![]);
        assert!(
            wrong_layers
                .expect_err("layer count")
                .to_string()
                .contains("one per backbone layer")
        );
    }
}

#[cfg(test)]
mod placement_properties {
    use super::*;
    use crate::experts::tiny_test_model;
    use deepinfer_model::expert_dispatch::ExpertPick;
    use deepinfer_topology::{PlacementShape, rebalance_experts};
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    /// For random loads and shapes, every pick is served by a replica of its own expert with
    /// the model's weights: the same output bits as the model's copy of that expert.
    #[test]
    fn every_replica_serves_its_expert_with_the_model_weights() {
        let (_dir, model) = tiny_test_model();
        let layers = model.config().n_layers;
        let experts = model.config().n_routed_experts;
        let dim = model.config().dim;
        let strategy = (
            prop::sample::select(vec![1usize, 2, 4, 8]),
            0usize..3,
            prop::collection::vec(prop::collection::vec(0.0f64..100.0, experts), layers),
            prop::collection::vec(-2.0f32..2.0, dim),
            0usize..experts,
            0usize..layers,
        );
        let mut runner = TestRunner::new(Config {
            cases: 24,
            ..Config::default()
        });
        runner
            .run(&strategy, |(ep, redundancy, loads, x, expert, layer)| {
                let shape = PlacementShape {
                    num_replicas: experts + redundancy * ep,
                    num_groups: 1,
                    num_nodes: 1,
                    num_gpus: ep,
                };
                let placement = Arc::new(rebalance_experts(&loads, shape).expect("solved"));
                let shards = (0..ep)
                    .map(|r| {
                        ExpertShard::build(
                            &model.clone().into(),
                            &placement,
                            EpRank(r as u16),
                            PlacementEpoch(3),
                            None,
                        )
                        .map(|(s, _)| Arc::new(s))
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .expect("shards");
                let comm =
                    LocalComm::new(PlacementEpoch(3), model.clone(), placement.clone(), shards)
                        .expect("comm");
                let slot = comm.replica_slot(layer, expert, &x);
                prop_assert!(placement.layers[layer].log2phy[expert].contains(&slot));
                let pick = ExpertPick {
                    expert,
                    weight: 0.75,
                };
                let served = comm.serve(layer, &x, &[pick]);
                let own = model.routed_expert(layer, expert).expect("in range");
                let expected = model.run_routed_expert(&own, &x, 0.75);
                prop_assert_eq!(served.len(), 1);
                prop_assert_eq!(served[0].rank, placement.rank_of_slot(slot));
                prop_assert_eq!(served[0].epoch, PlacementEpoch(3));
                prop_assert_eq!(
                    served[0]
                        .output
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                Ok(())
            })
            .expect("property holds");
    }
}
