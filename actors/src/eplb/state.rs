//! The pure state of the `EplbActor`: the step clock and schedule (when a load window starts,
//! when to rebalance), the committed placement and its epoch, the one rebalance that may be in
//! flight, and the arithmetic from per-slot counts to logical loads and imbalance.
//!
//! Schedule (engine steps = the most steps any DP rank executed): rebalances happen every
//! `interval_steps`; the counters are reset `window_steps` before each one (a window longer than
//! the interval is the whole interval), so each rebalance sees exactly its window's load.

use std::sync::Arc;

use deepinfer_topology::{
    DpRank, ExpertPlacement, PlacementEpoch, PlacementShape, rebalance_experts,
};

use crate::comm::EpError;
use crate::experts::parallel::EplbSchedule;
use crate::messages::eplb::{EplbStatus, RebalanceReport};
use crate::messages::experts::ShardLoads;

/// A layer's window must hold this many picks per physical expert slot to be planned from.
pub const MIN_PICKS_PER_SLOT: usize = 1;

/// What the actor must do after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EplbAction {
    /// Reset the load counters: the window of the next rebalance starts now.
    StartWindow,
    /// Measure the window and rebalance.
    Rebalance,
}

/// Loads measured over one window.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// `[layer][logical expert]` picks.
    pub logical: Vec<Vec<f64>>,
    /// `[layer]` busiest EP rank / mean EP rank (1 = even, also for a layer without picks).
    pub imbalance: Vec<f64>,
    /// All picks in the window.
    pub picks: u64,
}

impl Measured {
    /// The report of a rebalance that measured this under `epoch` and has changed nothing yet.
    pub fn report(&self, epoch: PlacementEpoch) -> RebalanceReport {
        RebalanceReport {
            measured_epoch: epoch,
            epoch,
            measured_imbalance: self.imbalance.clone(),
            planned_imbalance: self.imbalance.clone(),
            measured_picks: self.picks,
            copied_experts: 0,
            committed: false,
        }
    }
}

/// Busiest / mean of per-rank loads (1 for no load).
pub fn imbalance(per_rank: &[f64]) -> f64 {
    let total: f64 = per_rank.iter().sum();
    if total <= 0.0 || per_rank.is_empty() {
        return 1.0;
    }
    let busiest = per_rank.iter().copied().fold(0.0, f64::max);
    busiest / (total / per_rank.len() as f64)
}

/// The EPLB's state machine.
#[derive(Debug)]
pub struct EplbState {
    schedule: EplbSchedule,
    shape: PlacementShape,
    rank_steps: Vec<u64>,
    /// The epoch each DP rank's last step ran on.
    rank_epochs: Vec<PlacementEpoch>,
    steps: u64,
    next_rebalance: u64,
    window_started_for: Option<u64>,
    epoch: PlacementEpoch,
    placement: Arc<ExpertPlacement>,
    staging: Option<PlacementEpoch>,
    rebalances: u64,
    last: Option<RebalanceReport>,
}

impl EplbState {
    /// Starts at `epoch` with `placement` in use.
    pub fn new(
        schedule: EplbSchedule,
        shape: PlacementShape,
        epoch: PlacementEpoch,
        placement: Arc<ExpertPlacement>,
    ) -> Self {
        EplbState {
            schedule,
            shape,
            rank_steps: Vec::new(),
            rank_epochs: Vec::new(),
            steps: 0,
            next_rebalance: schedule.interval_steps.max(1),
            window_started_for: None,
            epoch,
            placement,
            staging: None,
            rebalances: 0,
            last: None,
        }
    }

    pub fn epoch(&self) -> PlacementEpoch {
        self.epoch
    }

    pub fn placement(&self) -> &Arc<ExpertPlacement> {
        &self.placement
    }

    /// Counts a step of `dp` that ran on `epoch`; says what the schedule asks for (nothing when
    /// automatic rebalancing is off or a rebalance is in flight).
    pub fn on_step(&mut self, dp: DpRank, epoch: PlacementEpoch) -> Option<EplbAction> {
        if self.rank_steps.len() <= dp.index() {
            self.rank_steps.resize(dp.index() + 1, 0);
            self.rank_epochs.resize(dp.index() + 1, PlacementEpoch(0));
        }
        self.rank_steps[dp.index()] += 1;
        self.rank_epochs[dp.index()] = epoch;
        self.steps = self.rank_steps.iter().copied().max().unwrap_or(0);
        if !self.schedule.enabled || self.staging.is_some() {
            return None;
        }
        let interval = self.schedule.interval_steps.max(1);
        let window = self.schedule.window_steps.clamp(1, interval);
        if self.steps >= self.next_rebalance {
            self.next_rebalance = self.steps + interval;
            return Some(EplbAction::Rebalance);
        }
        let window_start = self.next_rebalance - window;
        if self.steps >= window_start && self.window_started_for != Some(self.next_rebalance) {
            self.window_started_for = Some(self.next_rebalance);
            // A window as long as the interval started at the previous rebalance already.
            if window < interval {
                return Some(EplbAction::StartWindow);
            }
        }
        None
    }

    /// Turns each EP rank's per-slot counts (in rank order) into logical loads and imbalance.
    pub fn measure(&self, loads: &[ShardLoads]) -> Result<Measured, EpError> {
        let ranks = self.shape.num_gpus;
        if loads.len() != ranks {
            return Err(EpError::Shape {
                what: "load reports (one per EP rank)",
                expected: ranks,
                found: loads.len(),
            });
        }
        let spg = self.placement.slots_per_gpu;
        let layers = self.placement.layers.len();
        let mut logical = Vec::with_capacity(layers);
        let mut per_layer_imbalance = Vec::with_capacity(layers);
        let mut picks = 0u64;
        for (layer, lp) in self.placement.layers.iter().enumerate() {
            let mut row = vec![0.0; lp.log2phy.len()];
            let mut per_rank = vec![0.0; ranks];
            for (rank, report) in loads.iter().enumerate() {
                let counts = report
                    .per_slot
                    .get(layer)
                    .filter(|c| c.len() == spg)
                    .ok_or(EpError::Shape {
                        what: "slot counts of an EP rank in a layer",
                        expected: spg,
                        found: report.per_slot.get(layer).map_or(0, Vec::len),
                    })?;
                for (local, &count) in counts.iter().enumerate() {
                    let expert = lp.phy2log[rank * spg + local].index();
                    row[expert] += count as f64;
                    per_rank[rank] += count as f64;
                    picks += count;
                }
            }
            per_layer_imbalance.push(imbalance(&per_rank));
            logical.push(row);
        }
        Ok(Measured {
            logical,
            imbalance: per_layer_imbalance,
            picks,
        })
    }

    /// The placement DeepSeek's EPLB gives for `measured`, with the imbalance it expects;
    /// `None` when the window is too thin to plan from (a layer with fewer than
    /// `MIN_PICKS_PER_SLOT` picks per physical expert slot: most of its experts would read as
    /// idle and the plan would fit the sampling noise, not the routing) or the placement would
    /// not change.
    pub fn plan(
        &self,
        measured: &Measured,
    ) -> Result<Option<(ExpertPlacement, Vec<f64>)>, EpError> {
        let needed = (MIN_PICKS_PER_SLOT * self.shape.num_replicas) as f64;
        let thinnest = measured
            .logical
            .iter()
            .map(|layer| layer.iter().sum::<f64>())
            .fold(f64::INFINITY, f64::min);
        if measured.picks == 0 || thinnest < needed {
            return Ok(None);
        }
        let placement = rebalance_experts(&measured.logical, self.shape)?;
        if placement == *self.placement {
            return Ok(None);
        }
        let expected = placement
            .gpu_loads(&measured.logical)?
            .iter()
            .map(|per_gpu| imbalance(per_gpu))
            .collect();
        Ok(Some((placement, expected)))
    }

    /// A rebalance starts staging: returns the epoch it will commit as.
    pub fn begin_stage(&mut self) -> PlacementEpoch {
        let epoch = self.epoch.next();
        self.staging = Some(epoch);
        epoch
    }

    /// The staged placement is committed: it is the one in use from now on.
    pub fn commit(
        &mut self,
        epoch: PlacementEpoch,
        placement: Arc<ExpertPlacement>,
    ) -> Result<(), EpError> {
        if self.staging != Some(epoch) {
            return Err(EpError::Staging {
                epoch,
                message: match self.staging {
                    Some(staging) => format!("the rebalance in flight stages {staging}"),
                    None => "no rebalance is in flight".to_string(),
                },
            });
        }
        self.staging = None;
        self.epoch = epoch;
        self.placement = placement;
        Ok(())
    }

    /// The rebalance in flight failed; the placement in use stays.
    pub fn abort(&mut self) {
        self.staging = None;
    }

    /// Records a finished rebalance (committed or not).
    pub fn record(&mut self, report: RebalanceReport) {
        if report.committed {
            self.rebalances += 1;
        }
        self.last = Some(report);
    }

    pub fn status(&self) -> EplbStatus {
        EplbStatus {
            epoch: self.epoch,
            steps: self.steps,
            rebalances: self.rebalances,
            oldest_rank_epoch: self.rank_epochs.iter().copied().min().unwrap_or(self.epoch),
            last: self.last.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> PlacementShape {
        PlacementShape {
            num_replicas: 8,
            num_groups: 1,
            num_nodes: 1,
            num_gpus: 4,
        }
    }

    fn state(enabled: bool, window: u64, interval: u64) -> EplbState {
        let placement = ExpertPlacement::uniform(2, 8, shape()).expect("uniform");
        EplbState::new(
            EplbSchedule {
                enabled,
                window_steps: window,
                interval_steps: interval,
            },
            shape(),
            PlacementEpoch(0),
            Arc::new(placement),
        )
    }

    fn actions(state: &mut EplbState, dp: DpRank, steps: usize) -> Vec<(u64, EplbAction)> {
        (0..steps)
            .filter_map(|_| {
                state
                    .on_step(dp, PlacementEpoch(0))
                    .map(|a| (state.steps, a))
            })
            .collect()
    }

    #[test]
    fn schedule_starts_the_window_then_rebalances_every_interval() {
        let mut s = state(true, 3, 10);
        assert_eq!(
            actions(&mut s, DpRank(0), 25),
            vec![
                (7, EplbAction::StartWindow),
                (10, EplbAction::Rebalance),
                (17, EplbAction::StartWindow),
                (20, EplbAction::Rebalance),
            ]
        );
    }

    #[test]
    fn engine_steps_are_the_most_any_rank_ran() {
        let mut s = state(true, 2, 4);
        assert_eq!(
            actions(&mut s, DpRank(1), 3),
            vec![(2, EplbAction::StartWindow)]
        );
        // Rank 0 catching up does not advance the engine clock.
        assert!(actions(&mut s, DpRank(0), 3).is_empty());
        assert_eq!(
            actions(&mut s, DpRank(1), 1),
            vec![(4, EplbAction::Rebalance)]
        );
    }

    #[test]
    fn window_as_long_as_the_interval_needs_no_reset_and_disabled_does_nothing() {
        let mut s = state(true, 50, 5);
        let got = actions(&mut s, DpRank(0), 11);
        assert_eq!(
            got,
            vec![(5, EplbAction::Rebalance), (10, EplbAction::Rebalance)]
        );
        let mut off = state(false, 1, 2);
        assert!(actions(&mut off, DpRank(0), 10).is_empty());
        assert_eq!(off.status().steps, 10);
    }

    #[test]
    fn no_schedule_while_staging() {
        let mut s = state(true, 1, 2);
        let epoch = s.begin_stage();
        assert_eq!(epoch, PlacementEpoch(1));
        assert!(actions(&mut s, DpRank(0), 6).is_empty());
        s.abort();
        assert_eq!(s.epoch(), PlacementEpoch(0));
        assert!(!actions(&mut s, DpRank(0), 2).is_empty());
    }

    #[test]
    fn status_tracks_the_oldest_epoch_a_rank_still_runs() {
        let mut s = state(false, 1, 1);
        let placement = s.placement().clone();
        s.on_step(DpRank(0), PlacementEpoch(0));
        s.on_step(DpRank(1), PlacementEpoch(0));
        let epoch = s.begin_stage();
        s.commit(epoch, placement).expect("commit");
        s.on_step(DpRank(0), epoch);
        assert_eq!(s.status().oldest_rank_epoch, PlacementEpoch(0));
        s.on_step(DpRank(1), epoch);
        let status = s.status();
        assert_eq!((status.epoch, status.oldest_rank_epoch), (epoch, epoch));
        assert!(
            s.commit(epoch.next(), s.placement().clone()).is_err(),
            "nothing staged"
        );
    }

    fn skewed_loads(s: &EplbState) -> Vec<ShardLoads> {
        // Layer 0: everything on expert 0 (slot 0 of rank 0 under the uniform placement);
        // layer 1: even.
        let spg = s.placement().slots_per_gpu;
        (0..4)
            .map(|rank| ShardLoads {
                epoch: PlacementEpoch(0),
                per_slot: vec![
                    (0..spg)
                        .map(|local| {
                            let expert = s.placement().layers[0].phy2log[rank * spg + local];
                            if expert.index() == 0 { 90 } else { 10 }
                        })
                        .collect(),
                    vec![5; spg],
                ],
            })
            .collect()
    }

    #[test]
    fn measure_maps_slots_to_logical_experts_and_rates_imbalance() {
        let s = state(true, 1, 1);
        let m = s.measure(&skewed_loads(&s)).expect("measured");
        assert_eq!(m.picks, 90 + 7 * 10 + 8 * 5);
        assert_eq!(m.logical[0][0], 90.0);
        assert_eq!(m.logical[0][5], 10.0);
        assert_eq!(m.logical[1], vec![5.0; 8]);
        // The rank holding expert 0 serves 100 of 160 picks: 100 / 40 = 2.5.
        assert!((m.imbalance[0] - 2.5).abs() < 1e-12, "{:?}", m.imbalance);
        assert_eq!(m.imbalance[1], 1.0);
        let short = &skewed_loads(&s)[..3];
        assert!(s.measure(short).is_err());
    }

    #[test]
    fn plan_lowers_the_imbalance_and_commit_moves_the_epoch() {
        // 4 redundant slots: the hot expert can be split.
        let shape = PlacementShape {
            num_replicas: 12,
            ..shape()
        };
        let uniform = Arc::new(ExpertPlacement::uniform(2, 8, shape).expect("uniform"));
        let schedule = EplbSchedule {
            enabled: true,
            window_steps: 1,
            interval_steps: 1,
        };
        let mut s = EplbState::new(schedule, shape, PlacementEpoch(0), uniform.clone());
        let hot = vec![90.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0];
        let measured = Measured {
            logical: vec![hot.clone(), vec![5.0; 8]],
            imbalance: vec![0.0; 2],
            picks: 200,
        };
        let before: Vec<f64> = uniform
            .gpu_loads(&measured.logical)
            .expect("loads")
            .iter()
            .map(|g| imbalance(g))
            .collect();
        let (placement, planned) = s.plan(&measured).expect("solved").expect("a new placement");
        assert!(planned[0] < before[0], "{planned:?} vs {before:?}");
        assert!(
            placement.layers[0].log2phy[0].len() > 1,
            "the hot expert is replicated"
        );
        let epoch = s.begin_stage();
        assert!(
            s.commit(PlacementEpoch(7), Arc::new(placement.clone()))
                .is_err()
        );
        s.commit(epoch, Arc::new(placement)).expect("commit");
        assert_eq!(s.epoch(), PlacementEpoch(1));
        // The same loads now give the placement in use: nothing to do.
        assert!(s.plan(&measured).expect("solved").is_none());
    }

    #[test]
    fn a_window_thinner_than_the_slots_is_not_planned_from() {
        let s = state(true, 1, 1);
        let needed = MIN_PICKS_PER_SLOT * shape().num_replicas;
        // One hot expert; the second layer one pick short of the minimum.
        let window = |second: usize| {
            let layer = |picks: usize| {
                let mut row = vec![0.0; 8];
                row[0] = picks as f64;
                row
            };
            Measured {
                logical: vec![layer(needed), layer(second)],
                imbalance: vec![4.0; 2],
                picks: (needed + second) as u64,
            }
        };
        assert!(s.plan(&window(needed - 1)).expect("solved").is_none());
        assert!(s.plan(&window(needed)).expect("solved").is_some());
    }

    #[test]
    fn no_load_no_plan() {
        let s = state(true, 1, 1);
        let zero: Vec<ShardLoads> = (0..4)
            .map(|_| ShardLoads {
                epoch: PlacementEpoch(0),
                per_slot: vec![vec![0; 2]; 2],
            })
            .collect();
        let m = s.measure(&zero).expect("measured");
        assert_eq!(m.imbalance, vec![1.0, 1.0]);
        assert!(s.plan(&m).expect("solved").is_none());
    }
}
