//! `LocalComm`: the shards of this process's EP ranks for one placement epoch (every EP rank in a
//! one-process engine), computed on the caller's thread; the rows of the other processes' EP
//! ranks go through its `RemoteRanks`. Also the per-layer dispatch plan (`LayerPlan`) and the
//! replica choice.

use std::ops::Range;
use std::sync::{Arc, RwLock};

use deepinfer_model::expert_dispatch::ExpertPick;
use deepinfer_topology::{EpRank, ExpertPlacement, PlacementEpoch};

use super::remote::RemoteRanks;
use super::{Comm, EpError, LayerAt, ServedLayer};
use crate::experts::shard::{ExpertShard, ExpertSource};
use crate::messages::experts::ShardLoads;

/// This process's EP ranks' shards, for one placement epoch.
#[derive(Debug)]
pub struct LocalComm {
    epoch: PlacementEpoch,
    source: ExpertSource,
    placement: Arc<ExpertPlacement>,
    /// EP ranks in the placement.
    ranks: usize,
    /// The EP ranks whose shards are here (`shards[i]` is rank `local.start + i`).
    local: Range<usize>,
    shards: Vec<Arc<ExpertShard>>,
    /// The other EP ranks (`None`: every EP rank is here).
    remote: Option<Arc<RemoteRanks>>,
    /// Held shared while a batch of counts is added (`count_batch`) and exclusively while every
    /// shard's counters are read (`take_loads`), so no batch is split between two windows.
    counting: RwLock<()>,
}

/// One layer's routed rows, grouped by the EP rank that serves them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RankRows {
    /// `(row, pick)` of each routed row, in increasing order (the order of the rows sent).
    pub from: Vec<(usize, usize)>,
    /// The EP rank's local slot serving each.
    pub slots: Vec<u32>,
    /// The routing weight of each.
    pub weights: Vec<f32>,
}

/// Where every pick of one layer's rows goes: `per_rank[e]` holds EP rank `e`'s rows, so the
/// counts (`per_rank[e].from.len()`) are known before any row moves.
///
/// What any transport sends (the socket one per remote EP rank; an NCCL one as one all-to-all):
/// first `counts()` (one number per EP rank: the receive sizes), then for EP rank `e` its rows
/// `gather(e, ..)` packed in plan order with `slots` and `weights` alongside; `e` answers with as
/// many output rows in the same order, and `from` puts each back at its (row, pick). The send
/// buffer of a collective is the ranks' gathers one after another (offsets: the prefix sums of
/// the counts).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub per_rank: Vec<RankRows>,
}

impl LayerPlan {
    /// Rows sent to each EP rank.
    pub fn counts(&self) -> Vec<usize> {
        self.per_rank.iter().map(|r| r.from.len()).collect()
    }

    /// The rows of EP rank `rank`, gathered from `x` (`dim` wide) in its order.
    pub fn gather(&self, rank: usize, x: &[f32], dim: usize) -> Vec<f32> {
        let rows = &self.per_rank[rank];
        let mut out = Vec::with_capacity(rows.from.len() * dim);
        for &(row, _) in &rows.from {
            out.extend_from_slice(&x[row * dim..(row + 1) * dim]);
        }
        out
    }
}

impl LocalComm {
    /// Every EP rank in this process: checks that `placement` covers every backbone layer and
    /// logical expert of `source` and that `shards` (one per EP rank, in rank order) are this
    /// epoch's and hold what it says.
    pub fn new(
        epoch: PlacementEpoch,
        source: impl Into<ExpertSource>,
        placement: Arc<ExpertPlacement>,
        shards: Vec<Arc<ExpertShard>>,
    ) -> Result<LocalComm, EpError> {
        let ranks = ranks_of(&placement);
        LocalComm::build(epoch, source.into(), placement, 0..ranks, shards, None)
    }

    /// This node's EP ranks (`remote.local_ranks()`, one shard each in rank order); the others
    /// are served through `remote`.
    pub fn across_nodes(
        epoch: PlacementEpoch,
        source: impl Into<ExpertSource>,
        placement: Arc<ExpertPlacement>,
        shards: Vec<Arc<ExpertShard>>,
        remote: Arc<RemoteRanks>,
    ) -> Result<LocalComm, EpError> {
        if remote.ranks() != ranks_of(&placement) {
            return Err(EpError::Shape {
                what: "EP ranks of the nodes",
                expected: ranks_of(&placement),
                found: remote.ranks(),
            });
        }
        let local = remote.local_ranks();
        LocalComm::build(epoch, source.into(), placement, local, shards, Some(remote))
    }

    fn build(
        epoch: PlacementEpoch,
        source: ExpertSource,
        placement: Arc<ExpertPlacement>,
        local: Range<usize>,
        shards: Vec<Arc<ExpertShard>>,
        remote: Option<Arc<RemoteRanks>>,
    ) -> Result<LocalComm, EpError> {
        check_placement(&source, &placement)?;
        if shards.len() != local.len() {
            return Err(EpError::Shape {
                what: "expert shards (one per EP rank of this process)",
                expected: local.len(),
                found: shards.len(),
            });
        }
        for (rank, shard) in local.clone().zip(&shards) {
            if shard.epoch() != epoch {
                return Err(EpError::ShardEpoch {
                    rank: shard.rank(),
                    expected: epoch,
                    found: shard.epoch(),
                });
            }
            shard.check_holds(&placement, EpRank(rank as u16))?;
        }
        Ok(LocalComm {
            epoch,
            source,
            ranks: ranks_of(&placement),
            placement,
            local,
            shards,
            remote,
            counting: RwLock::new(()),
        })
    }

    /// The transport of the next placement `epoch` over the same EP ranks and nodes: this
    /// process's `shards` (one per EP rank here, in rank order) of `placement`.
    pub fn next_epoch(
        &self,
        epoch: PlacementEpoch,
        placement: Arc<ExpertPlacement>,
        shards: Vec<Arc<ExpertShard>>,
    ) -> Result<LocalComm, EpError> {
        LocalComm::build(
            epoch,
            self.source.clone(),
            placement,
            self.local.clone(),
            shards,
            self.remote.clone(),
        )
    }

    /// The other processes' EP ranks (`None`: every EP rank is here).
    pub fn remote(&self) -> Option<Arc<RemoteRanks>> {
        self.remote.clone()
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

    /// The shards of this process's EP ranks, in EP rank order.
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

    /// Where every pick of the rows `x` of `layer` goes (see [`LayerPlan`]).
    pub fn plan(&self, layer: usize, x: &[f32], picks: &[Vec<ExpertPick>]) -> LayerPlan {
        let dim = x.len() / picks.len().max(1);
        let per_rank_slots = self.placement.slots_per_gpu.max(1);
        let mut per_rank = vec![RankRows::default(); self.ranks];
        for (row, row_picks) in picks.iter().enumerate() {
            let token = token_key(&x[row * dim..(row + 1) * dim]);
            for (k, pick) in row_picks.iter().enumerate() {
                let slot = self.slot_for(layer, pick.expert, token) as usize;
                let rows = &mut per_rank[slot / per_rank_slots];
                rows.from.push((row, k));
                rows.slots.push((slot % per_rank_slots) as u32);
                rows.weights.push(pick.weight);
            }
        }
        LayerPlan { per_rank }
    }

    /// Runs the rows `rows` (`[slots.len(), dim]`) of `layer` on EP rank `rank` of this process,
    /// row `i` with local slot `slots[i]` and weight `weights[i]`: the output rows in that order.
    /// Refuses a rank, layer or slot this process does not hold (what a peer sends is checked).
    pub fn serve_rows(
        &self,
        rank: usize,
        layer: usize,
        slots: &[u32],
        weights: &[f32],
        rows: &[f32],
    ) -> Result<Vec<f32>, EpError> {
        let ExpertSource::Model(model) = &self.source else {
            return Err(EpError::Model(
                "a simulated expert-parallel transport holds no weights".into(),
            ));
        };
        let shard = rank
            .checked_sub(self.local.start)
            .and_then(|i| self.shards.get(i))
            .ok_or_else(|| EpError::Layer {
                layer,
                message: format!(
                    "EP rank {rank} is not one of this process's {:?}",
                    self.local
                ),
            })?;
        let dim = model.config().dim;
        let model = model.experts();
        if layer >= self.placement.layers.len()
            || slots.len() != weights.len()
            || rows.len() != slots.len() * dim
        {
            return Err(EpError::Layer {
                layer,
                message: format!(
                    "{} slots, {} weights and {} values of {dim}-wide rows do not match the model",
                    slots.len(),
                    weights.len(),
                    rows.len()
                ),
            });
        }
        let mut out = Vec::with_capacity(rows.len());
        for ((&slot, &weight), row) in slots.iter().zip(weights).zip(rows.chunks_exact(dim)) {
            if slot as usize >= self.placement.slots_per_gpu {
                return Err(EpError::Layer {
                    layer,
                    message: format!("EP rank {rank} has no local slot {slot}"),
                });
            }
            out.extend(shard.run(model, layer, slot as usize, row, weight)?);
        }
        Ok(out)
    }
}

fn ranks_of(placement: &ExpertPlacement) -> usize {
    placement
        .layers
        .first()
        .map_or(0, |l| l.phy2log.len() / placement.slots_per_gpu.max(1))
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
        self.ranks
    }

    /// This process's EP ranks compute in place, the others are asked through `RemoteRanks` (in
    /// increasing EP rank); each EP rank's outputs go back to their (row, pick).
    fn serve_layer(
        &self,
        at: LayerAt,
        x: &[f32],
        picks: &[Vec<ExpertPick>],
    ) -> Result<ServedLayer, EpError> {
        let dim = x.len() / picks.len().max(1);
        let plan = self.plan(at.layer, x, picks);
        let mut outputs: Vec<Vec<Vec<f32>>> = picks
            .iter()
            .map(|row| vec![Vec::new(); row.len()])
            .collect();
        let mut any = false;
        for (rank, rows) in plan.per_rank.iter().enumerate() {
            if rows.from.is_empty() {
                continue;
            }
            any = true;
            let gathered = plan.gather(rank, x, dim);
            let out = match &self.remote {
                Some(remote) if !self.local.contains(&rank) => remote.serve(
                    at,
                    self.epoch,
                    rank,
                    &rows.slots,
                    &rows.weights,
                    &gathered,
                    dim,
                )?,
                _ => self.serve_rows(rank, at.layer, &rows.slots, &rows.weights, &gathered)?,
            };
            for (&(row, k), output) in rows.from.iter().zip(out.chunks_exact(dim)) {
                outputs[row][k] = output.to_vec();
            }
        }
        Ok(ServedLayer {
            outputs,
            epochs: any.then_some((self.epoch, self.epoch)),
        })
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
        let local = |epoch: u32, shards: Vec<Arc<ExpertShard>>| {
            LocalComm::new(
                PlacementEpoch(epoch),
                model.clone(),
                placement.clone(),
                shards,
            )
        };
        let ok = local(0, vec![shard(0, 0), shard(1, 0)]);
        assert!(ok.is_ok());
        let missing = local(0, vec![shard(0, 0)]);
        assert!(matches!(missing, Err(EpError::Shape { found: 1, .. })));
        let stale = local(1, vec![shard(0, 1), shard(1, 0)]);
        assert!(matches!(stale, Err(EpError::ShardEpoch { .. })));
        let swapped = local(0, vec![shard(1, 0), shard(0, 0)]);
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
    use deepinfer_model::expert_dispatch::{ExpertHost, ExpertPick};
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
                let at = LayerAt {
                    dp: deepinfer_topology::DpRank(0),
                    step: 0,
                    layer,
                };
                let served = comm.serve_layer(at, &x, &[vec![pick]]).expect("served");
                let own = model.routed_expert(layer, expert).expect("in range");
                let expected = model.run_routed_expert(&own, &x, 0.75);
                let plan = comm.plan(layer, &x, &[vec![pick]]);
                let rank = placement.rank_of_slot(slot).0 as usize;
                prop_assert_eq!(plan.per_rank[rank].from.clone(), vec![(0, 0)]);
                prop_assert_eq!(plan.counts().iter().sum::<usize>(), 1);
                prop_assert_eq!(served.epochs, Some((PlacementEpoch(3), PlacementEpoch(3))));
                prop_assert_eq!(
                    served.outputs[0][0]
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
