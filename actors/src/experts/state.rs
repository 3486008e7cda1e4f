//! The pure state of one `ExpertGroupActor`: the shard in use, at most one staged shard, and
//! the epoch rules (a stage is for a newer epoch than the one in use; a commit names the staged
//! epoch; an abort drops only the epoch it names).

use std::sync::Arc;

use deepinfer_topology::{EpRank, ExpertPlacement, PlacementEpoch};

use crate::comm::EpError;
use crate::experts::shard::{ExpertShard, ExpertSource};
use crate::messages::experts::StagedShard;

/// One EP rank's shards.
#[derive(Debug)]
pub struct ExpertGroupState {
    rank: EpRank,
    current: Arc<ExpertShard>,
    staged: Option<Arc<ExpertShard>>,
}

impl ExpertGroupState {
    /// Starts from the shard in use (epoch 0, built with the engine's `ExpertParallel`).
    pub fn new(current: Arc<ExpertShard>) -> Self {
        ExpertGroupState {
            rank: current.rank(),
            current,
            staged: None,
        }
    }

    pub fn rank(&self) -> EpRank {
        self.rank
    }

    /// The shard in use.
    pub fn current(&self) -> &Arc<ExpertShard> {
        &self.current
    }

    /// The staged shard, if any.
    pub fn staged(&self) -> Option<&Arc<ExpertShard>> {
        self.staged.as_ref()
    }

    /// Builds this rank's shard of `placement` for `epoch` (newer than the one in use), keeping
    /// the weights of experts already held; replaces an earlier staged shard.
    pub fn stage(
        &mut self,
        source: &ExpertSource,
        placement: &ExpertPlacement,
        epoch: PlacementEpoch,
    ) -> Result<StagedShard, EpError> {
        if epoch <= self.current.epoch() {
            return Err(EpError::Commit {
                rank: self.rank,
                epoch,
                message: format!("staging needs an epoch after {}", self.current.epoch()),
            });
        }
        let (shard, report) =
            ExpertShard::build(source, placement, self.rank, epoch, Some(&self.current))?;
        let shard = Arc::new(shard);
        self.staged = Some(shard.clone());
        Ok(StagedShard { shard, report })
    }

    /// The staged shard of `epoch` becomes the one in use.
    pub fn commit(&mut self, epoch: PlacementEpoch) -> Result<(), EpError> {
        match self.staged.take() {
            Some(shard) if shard.epoch() == epoch => {
                self.current = shard;
                Ok(())
            }
            other => {
                let message = match &other {
                    Some(shard) => format!("the staged shard is {}", shard.epoch()),
                    None => "nothing is staged".to_string(),
                };
                self.staged = other;
                Err(EpError::Commit {
                    rank: self.rank,
                    epoch,
                    message,
                })
            }
        }
    }

    /// Drops the staged shard if it is for `epoch`.
    pub fn abort(&mut self, epoch: PlacementEpoch) {
        if self.staged.as_ref().is_some_and(|s| s.epoch() == epoch) {
            self.staged = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::tiny_test_model;
    use deepinfer_topology::{PlacementShape, rebalance_experts};

    const SHAPE: PlacementShape = PlacementShape {
        num_replicas: 12,
        num_groups: 1,
        num_nodes: 1,
        num_gpus: 4,
    };

    fn skewed(layers: usize) -> ExpertPlacement {
        let loads: Vec<Vec<f64>> = (0..layers)
            .map(|_| vec![50.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 30.0])
            .collect();
        rebalance_experts(&loads, SHAPE).expect("solved")
    }

    #[test]
    fn stage_commit_abort_follow_the_epoch_rules() {
        let (_dir, model) = tiny_test_model();
        let layers = model.config().n_layers;
        let uniform = ExpertPlacement::uniform(layers, 8, SHAPE).expect("uniform");
        let rank = EpRank(1);
        let source = ExpertSource::from(model.clone());
        let (shard, first) =
            ExpertShard::build(&source, &uniform, rank, PlacementEpoch(0), None).expect("built");
        assert_eq!(first.copied, layers * 3);
        assert_eq!(first.reused, 0);
        let mut group = ExpertGroupState::new(Arc::new(shard));

        // Staging needs a newer epoch.
        assert!(group.stage(&source, &uniform, PlacementEpoch(0)).is_err());

        let placement = skewed(layers);
        let staged = group
            .stage(&source, &placement, PlacementEpoch(1))
            .expect("staged");
        assert_eq!(staged.report.copied + staged.report.reused, layers * 3);
        assert!(
            staged.report.copied > 0,
            "the hot experts move: {:?}",
            staged.report
        );
        assert_eq!(staged.shard.held()[0], placement.experts_on_rank(0, rank));
        staged
            .shard
            .check_holds(&placement, rank)
            .expect("holds what the placement says");
        assert!(staged.shard.check_holds(&uniform, rank).is_err());

        // A commit of another epoch is refused and keeps the staged shard.
        assert!(group.commit(PlacementEpoch(2)).is_err());
        assert_eq!(group.current().epoch(), PlacementEpoch(0));
        group.abort(PlacementEpoch(5));
        assert!(group.staged().is_some());
        group.commit(PlacementEpoch(1)).expect("commit");
        assert_eq!(group.current().epoch(), PlacementEpoch(1));
        assert!(group.staged().is_none());
        assert!(group.commit(PlacementEpoch(1)).is_err(), "nothing staged");

        // Abort drops a staged shard of that epoch.
        group
            .stage(&source, &uniform, PlacementEpoch(2))
            .expect("staged");
        group.abort(PlacementEpoch(2));
        assert!(group.staged().is_none());
        assert_eq!(group.current().epoch(), PlacementEpoch(1));
    }

    /// A shard runs the model's own weights of the experts the model holds and reads a copy of
    /// the others only (a model loaded with an expert filter), with the same outputs.
    #[test]
    fn shards_copy_only_what_the_model_lacks() {
        let (dir, whole) = tiny_test_model();
        let layers = whole.config().n_layers;
        let even = deepinfer_model::checkpoint::ExpertFilter::new(|_, expert| expert % 2 == 0);
        let partial = Arc::new(
            deepinfer_model::Model::load_experts(dir.path(), None, &even).expect("filtered"),
        );
        let uniform = ExpertPlacement::uniform(layers, 8, SHAPE).expect("uniform");
        let rank = EpRank(1);
        let build = |model: &Arc<deepinfer_model::Model>| {
            ExpertShard::build(
                &model.clone().into(),
                &uniform,
                rank,
                PlacementEpoch(0),
                None,
            )
            .expect("built")
            .0
        };
        let (own, read) = (build(&whole), build(&partial));
        assert_eq!(own.copies(), 0);
        let odd = own
            .held()
            .iter()
            .flatten()
            .filter(|e| e.index() % 2 == 1)
            .count();
        assert!(odd > 0);
        assert_eq!(read.copies(), odd);
        let x = vec![0.25f32; whole.config().dim];
        for layer in 0..layers {
            for local in 0..3 {
                let a = own
                    .run(whole.as_ref(), layer, local, &x, 0.5)
                    .expect("runs");
                let b = read
                    .run(partial.as_ref(), layer, local, &x, 0.5)
                    .expect("runs");
                assert_eq!(a, b, "layer {layer} slot {local}");
            }
        }
    }

    #[test]
    fn load_counters_count_served_picks_and_reset() {
        let (_dir, model) = tiny_test_model();
        let layers = model.config().n_layers;
        let uniform = ExpertPlacement::uniform(layers, 8, SHAPE).expect("uniform");
        let (shard, _) = ExpertShard::build(
            &model.clone().into(),
            &uniform,
            EpRank(0),
            PlacementEpoch(0),
            None,
        )
        .expect("built");
        let group = ExpertGroupState::new(Arc::new(shard));
        let x = vec![0.5f32; model.config().dim];
        for _ in 0..3 {
            group
                .current()
                .run(model.as_ref(), 2, 1, &x, 0.25)
                .expect("runs");
        }
        group
            .current()
            .run(model.as_ref(), 0, 0, &x, 0.25)
            .expect("runs");
        let loads = group.current().take_loads();
        assert_eq!(loads[2][1], 3);
        assert_eq!(loads[0][0], 1);
        assert_eq!(loads.iter().flatten().sum::<u64>(), 4);
        assert_eq!(
            group.current().take_loads().iter().flatten().sum::<u64>(),
            0
        );
    }
}
