//! `VirtualFabric`: the virtual clock and the expert-parallel lockstep of a simulated deployment.
//!
//! Owns: the clock (virtual seconds), the step every DP rank is contributing to, each GPU's busy
//! time, the routing distribution of the MoE, and the tokens each request got when (reported by
//! the simulated devices as their sequences end).
//! Ordering: every DP rank's simulated device calls `step` once per executed step, `Idle`
//! included, with its own part of the work; the global step completes when every rank has
//! contributed (a real step's dispatch and combine need all of them). Then the step's routed
//! picks are spread over the EP ranks by the routing distribution and the placement in use
//! (`ExpertParallel::current`, whose shards count them for the `EplbActor`), each GPU's time is
//! `max(compute, fabric)` from the cost model, and the step lasts as long as the slowest GPU.
//! The clock moves only there: ranks wait for each other in wall time, never for modelled time.
//! The traffic driver sets a gate at the next arrival it has not submitted: no step starts at or
//! after that time until the request is handed to the engine; when nothing is outstanding the
//! driver moves the clock to the next arrival.
//! Failure: a rank that waits longer than the collective timeout (wall time) for the others
//! fails its step, like a real collective would; `close` releases every waiter.
//! Routing: in expectation, no sampling noise: layer `l` sends a token to logical expert `e`
//! with probability `p[l][e]`, a Zipf law over a per-layer shuffle of the experts, split evenly
//! over the expert's replicas.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use deepinfer_model::config::ModelConfig;
use deepinfer_model::cost::device::{DeviceModel, FabricLayout, StepTime};
use deepinfer_model::cost::step::{StepWork, pick_fabric_bytes, picks, routed_served};
use deepinfer_model::cost::{expected_experts, expert_bytes};
use deepinfer_topology::{ExpertPlacement, PlacementEpoch, RequestId};

use crate::comm::Comm;
use crate::experts::parallel::ExpertParallel;
use crate::rank::executor::ExecError;
use crate::rank::fake::hash2;

/// What the fabric models.
#[derive(Debug, Clone)]
pub struct FabricSpec {
    pub model: Arc<ModelConfig>,
    pub device: DeviceModel,
    pub layout: FabricLayout,
    /// DP ranks that step together.
    pub dp_ranks: usize,
    /// Zipf exponent of the expert popularity (0 = uniform routing).
    pub routing_skew: f64,
    pub seed: u64,
    /// Wall time a rank waits for the others before its step fails.
    pub collective_timeout: Duration,
}

/// One rank's step as the fabric sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankStep {
    /// Its work (its own tokens; the routed picks are placed by the fabric).
    pub work: StepWork,
    /// Tokens it produced (sampled and kept).
    pub produced: usize,
    /// Whether it fed a prompt chunk.
    pub prefill: bool,
}

/// When a request's tokens were produced: (virtual seconds, tokens) per step that produced any.
pub type TokenTimes = Vec<(f64, u32)>;

/// The expected share of a layer's picks each physical slot serves under one placement.
struct SlotShares {
    epoch: PlacementEpoch,
    slots_per_gpu: usize,
    /// `[layer][slot]`, each layer summing to 1.
    per_slot: Vec<Vec<f64>>,
    /// Mean over layers of (busiest EP rank's share / mean share).
    imbalance: f64,
}

/// Steps run on one placement epoch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpochLoad {
    /// Global steps with routed work run on it.
    pub steps: u64,
    /// Mean over layers of (busiest EP rank's picks / mean picks) under the routing law.
    pub imbalance: f64,
}

/// What a finished run's fabric says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FabricSummary {
    /// Virtual seconds at the last completed step.
    pub now: f64,
    pub steps: u64,
    /// Per GPU: virtual seconds of compute (its own step time, not the wait for the slowest).
    pub busy: Vec<f64>,
    /// Per placement epoch the steps ran on.
    pub epochs: BTreeMap<u32, EpochLoad>,
    /// Steps in which no rank fed a prompt chunk and some rank produced tokens: their count,
    /// virtual seconds and tokens (the fixed-batch decode rate).
    pub decode_steps: u64,
    pub decode_seconds: f64,
    pub decode_tokens: u64,
}

struct Clock {
    now: f64,
    step: u64,
    last_end: f64,
    pending: Vec<Option<RankStep>>,
    arrived: usize,
    stepped: Vec<bool>,
    departed: Vec<bool>,
    gate: Option<f64>,
    closed: bool,
    outstanding: usize,
    busy: Vec<f64>,
    shares: Option<SlotShares>,
    /// `[layer][slot]`: picks counted into the shards' counters lag the expected ones by these
    /// fractions.
    carry: Vec<Vec<f64>>,
    epochs: BTreeMap<u32, EpochLoad>,
    decode: (u64, f64, u64),
}

/// The shared clock and lockstep of one simulated deployment.
pub struct VirtualFabric {
    spec: FabricSpec,
    /// `[layer][logical expert]` routing probabilities.
    routing: Vec<Vec<f64>>,
    parallel: Option<Arc<ExpertParallel>>,
    clock: Mutex<Clock>,
    changed: Condvar,
    records: Mutex<HashMap<RequestId, TokenTimes>>,
}

impl std::fmt::Debug for VirtualFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualFabric")
            .field("dp_ranks", &self.spec.dp_ranks)
            .field("device", &self.spec.device.peaks.name)
            .finish()
    }
}

/// `[layer][expert]`: a Zipf law of exponent `skew` over a per-layer shuffle of the experts.
pub fn zipf_routing(layers: usize, experts: usize, skew: f64, seed: u64) -> Vec<Vec<f64>> {
    (0..layers)
        .map(|layer| {
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by_key(|&e| hash2(hash2(seed, layer as u64), e as u64));
            let mut p = vec![0.0; experts];
            for (rank, &expert) in order.iter().enumerate() {
                p[expert] = 1.0 / ((rank + 1) as f64).powf(skew);
            }
            let total: f64 = p.iter().sum();
            p.iter_mut().for_each(|v| *v /= total);
            p
        })
        .collect()
}

fn shares_of(
    routing: &[Vec<f64>],
    placement: &ExpertPlacement,
    epoch: PlacementEpoch,
) -> SlotShares {
    let spg = placement.slots_per_gpu.max(1);
    let per_slot: Vec<Vec<f64>> = placement
        .layers
        .iter()
        .zip(routing)
        .map(|(layer, p)| {
            layer
                .phy2log
                .iter()
                .map(|e| {
                    let replicas = layer.log2phy[e.index()].len().max(1) as f64;
                    p[e.index()] / replicas
                })
                .collect()
        })
        .collect();
    let imbalance = per_slot
        .iter()
        .map(|slots| {
            let ranks: Vec<f64> = slots.chunks(spg).map(|c| c.iter().sum()).collect();
            let mean = ranks.iter().sum::<f64>() / ranks.len().max(1) as f64;
            let max = ranks.iter().copied().fold(0.0, f64::max);
            if mean > 0.0 { max / mean } else { 1.0 }
        })
        .sum::<f64>()
        / per_slot.len().max(1) as f64;
    SlotShares {
        epoch,
        slots_per_gpu: spg,
        per_slot,
        imbalance,
    }
}

/// Per GPU: the compute and fabric seconds of a global step whose DP ranks ran `parts`.
/// With `shares`, GPU `g` also serves the routed picks its EP slots get from every rank;
/// without, each GPU holds every expert and runs its own tokens' picks.
fn gpu_times(spec: &FabricSpec, parts: &[StepWork], shares: Option<&SlotShares>) -> Vec<StepTime> {
    let cfg = &spec.model;
    let layers = cfg.n_layers;
    let total: usize = parts.iter().map(|p| p.tokens).sum();
    let layer_picks = (total * cfg.n_activated_experts) as f64;
    let gpus = parts.len().max(shares.map_or(0, |s| {
        s.per_slot.first().map_or(0, |l| l.len() / s.slots_per_gpu)
    }));
    (0..gpus)
        .map(|g| {
            let mut work = parts.get(g).copied().unwrap_or_default();
            let fabric = match shares {
                Some(shares) => {
                    let (mut served, mut touched) = (0.0, 0.0);
                    for layer in &shares.per_slot {
                        let own = layer
                            .iter()
                            .skip(g * shares.slots_per_gpu)
                            .take(shares.slots_per_gpu);
                        for share in own {
                            let expected = layer_picks * share;
                            served += expected;
                            touched += 1.0 - (-expected).exp();
                        }
                    }
                    work.routed = routed_served(cfg, served, touched);
                    spec.device.fabric_seconds(
                        picks(cfg, work.tokens) * pick_fabric_bytes(cfg),
                        spec.layout,
                    )
                }
                None => {
                    work.routed.weight_bytes =
                        layers as f64 * expected_experts(cfg, work.tokens) * expert_bytes(cfg);
                    0.0
                }
            };
            StepTime {
                compute: spec.device.compute_seconds(&work, layers),
                fabric,
            }
        })
        .collect()
}

impl VirtualFabric {
    /// A fabric over `spec`; with `parallel`, routed work follows its placements and is counted
    /// into its shards.
    pub fn new(spec: FabricSpec, parallel: Option<Arc<ExpertParallel>>) -> Arc<VirtualFabric> {
        let routing = zipf_routing(
            spec.model.n_layers,
            spec.model.n_routed_experts,
            spec.routing_skew,
            spec.seed,
        );
        let ranks = spec.dp_ranks;
        let gpus = ranks.max(spec.layout.gpus);
        Arc::new(VirtualFabric {
            spec,
            routing,
            parallel,
            clock: Mutex::new(Clock {
                now: 0.0,
                step: 0,
                last_end: 0.0,
                pending: vec![None; ranks],
                arrived: 0,
                stepped: vec![false; ranks],
                departed: vec![false; ranks],
                gate: None,
                closed: false,
                outstanding: 0,
                busy: vec![0.0; gpus],
                shares: None,
                carry: Vec::new(),
                epochs: BTreeMap::new(),
                decode: (0, 0.0, 0),
            }),
            changed: Condvar::new(),
            records: Mutex::new(HashMap::new()),
        })
    }

    pub fn spec(&self) -> &FabricSpec {
        &self.spec
    }

    pub fn parallel(&self) -> Option<&Arc<ExpertParallel>> {
        self.parallel.as_ref()
    }

    fn lock(&self) -> MutexGuard<'_, Clock> {
        self.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// DP rank `dp` ran `step`; returns the virtual time the global step ended, once every
    /// rank has contributed.
    pub fn step(&self, dp: usize, step: RankStep) -> Result<f64, ExecError> {
        let mut clock = self.lock();
        if clock.closed {
            return Ok(clock.now);
        }
        let Some(slot) = clock.pending.get_mut(dp) else {
            return Err(ExecError::Backend(format!(
                "simulated rank {dp} outside the {} DP ranks",
                self.spec.dp_ranks
            )));
        };
        if slot.replace(step).is_some() {
            return Err(ExecError::Backend(format!(
                "simulated rank {dp} stepped twice in one global step"
            )));
        }
        clock.arrived += 1;
        clock.stepped[dp] = true;
        let mine = clock.step;
        self.try_complete(&mut clock);
        let deadline = Instant::now() + self.spec.collective_timeout;
        while clock.step == mine && !clock.closed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> = (0..clock.pending.len())
                    .filter(|&r| r != dp && clock.pending[r].is_none() && !clock.departed[r])
                    .collect();
                clock.pending[dp] = None;
                clock.arrived -= 1;
                return Err(ExecError::Backend(format!(
                    "simulated collective of step {mine} timed out after {:?} waiting for DP ranks {missing:?}",
                    self.spec.collective_timeout
                )));
            }
            clock = self
                .changed
                .wait_timeout(clock, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(clock.last_end)
    }

    /// Rank `dp` steps no more (its device was dropped): later steps do not wait for it.
    pub fn leave(&self, dp: usize) {
        let mut clock = self.lock();
        if clock.stepped.get(dp).copied().unwrap_or(false) {
            clock.departed[dp] = true;
            self.try_complete(&mut clock);
        }
    }

    fn try_complete(&self, clock: &mut Clock) {
        let active = clock.departed.iter().filter(|d| !**d).count();
        let gate_open = clock.gate.is_none_or(|g| clock.now < g);
        if clock.closed || active == 0 || clock.arrived < active || !gate_open {
            return;
        }
        let steps: Vec<RankStep> = clock
            .pending
            .iter_mut()
            .map(|p| p.take().unwrap_or_default())
            .collect();
        let parts: Vec<StepWork> = steps.iter().map(|s| s.work).collect();
        let produced: usize = steps.iter().map(|s| s.produced).sum();
        let prefill = steps.iter().any(|s| s.prefill);
        clock.arrived = 0;
        let tokens: usize = parts.iter().map(|p| p.tokens).sum();
        if let Some(parallel) = &self.parallel {
            let comm = parallel.current();
            if clock
                .shares
                .as_ref()
                .is_none_or(|s| s.epoch != comm.epoch())
            {
                clock.shares = Some(shares_of(&self.routing, comm.placement(), comm.epoch()));
            }
            if tokens > 0
                && let Some(shares) = &clock.shares
            {
                let entry = clock.epochs.entry(shares.epoch.get()).or_default();
                entry.steps += 1;
                entry.imbalance = shares.imbalance;
                let layer_picks = (tokens * self.spec.model.n_activated_experts) as f64;
                if clock.carry.len() != shares.per_slot.len() {
                    clock.carry = shares.per_slot.iter().map(|l| vec![0.0; l.len()]).collect();
                }
                let carry = &mut clock.carry;
                // One batch: the EPLB's windows hold the whole step on every EP rank or none of it.
                comm.count_batch(|shards| {
                    for (layer, slots) in shares.per_slot.iter().enumerate() {
                        for (slot, share) in slots.iter().enumerate() {
                            let due = carry[layer][slot] + layer_picks * share;
                            let whole = due.floor();
                            carry[layer][slot] = due - whole;
                            if whole > 0.0
                                && let Some(shard) = shards.get(slot / shares.slots_per_gpu)
                            {
                                let _ =
                                    shard.count(layer, slot % shares.slots_per_gpu, whole as u64);
                            }
                        }
                    }
                });
            }
        }
        let times = gpu_times(
            &self.spec,
            &parts,
            clock.shares.as_ref().filter(|_| self.parallel.is_some()),
        );
        let mut longest: f64 = 0.0;
        for (g, time) in times.iter().enumerate() {
            if let Some(busy) = clock.busy.get_mut(g) {
                *busy += time.compute;
            }
            longest = longest.max(time.seconds());
        }
        clock.now += longest;
        clock.last_end = clock.now;
        if !prefill && produced > 0 {
            clock.decode.0 += 1;
            clock.decode.1 += longest;
            clock.decode.2 += produced as u64;
        }
        clock.step += 1;
        self.changed.notify_all();
    }

    /// The modelled seconds of a step in which every DP rank runs `work` on the epoch-0
    /// placement (DSpark's step-rate profile).
    pub fn uniform_step_seconds(&self, work: StepWork) -> f64 {
        let parts = vec![work; self.spec.dp_ranks];
        let shares = self
            .parallel
            .as_ref()
            .map(|p| shares_of(&self.routing, p.current().placement(), PlacementEpoch(0)));
        gpu_times(&self.spec, &parts, shares.as_ref())
            .iter()
            .map(StepTime::seconds)
            .fold(0.0, f64::max)
    }

    /// The driver: no step may start at or after `gate` (virtual seconds) until the gate moves.
    pub fn set_gate(&self, gate: Option<f64>) {
        let mut clock = self.lock();
        clock.gate = gate;
        self.try_complete(&mut clock);
        self.changed.notify_all();
    }

    /// Blocks until the clock reaches `t`; when no request is outstanding the clock jumps there.
    pub fn wait_until(&self, t: f64) -> f64 {
        let mut clock = self.lock();
        loop {
            if clock.closed || clock.now >= t {
                return clock.now;
            }
            if clock.outstanding == 0 {
                clock.now = t;
                self.try_complete(&mut clock);
                self.changed.notify_all();
                return clock.now;
            }
            clock = self.changed.wait(clock).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// A request was handed to the engine.
    pub fn request_submitted(&self) {
        self.lock().outstanding += 1;
    }

    /// A request ended (completed or failed).
    pub fn request_ended(&self) {
        let mut clock = self.lock();
        clock.outstanding = clock.outstanding.saturating_sub(1);
        self.changed.notify_all();
    }

    pub fn now(&self) -> f64 {
        self.lock().now
    }

    /// Releases every waiting rank; later steps return at once without moving the clock.
    pub fn close(&self) {
        let mut clock = self.lock();
        clock.closed = true;
        self.changed.notify_all();
    }

    /// A simulated device hands over the token times of a sequence it freed.
    pub fn record(&self, id: RequestId, times: TokenTimes) {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        records.entry(id).or_default().extend(times);
    }

    /// The token times of every freed sequence.
    pub fn take_records(&self) -> HashMap<RequestId, TokenTimes> {
        std::mem::take(&mut *self.records.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn summary(&self) -> FabricSummary {
        let clock = self.lock();
        FabricSummary {
            now: clock.last_end.max(clock.now),
            steps: clock.step,
            busy: clock.busy.clone(),
            epochs: clock.epochs.clone(),
            decode_steps: clock.decode.0,
            decode_seconds: clock.decode.1,
            decode_tokens: clock.decode.2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_model::cost::device::{DevicePeaks, Efficiency};
    use deepinfer_model::cost::step::StepEntry;

    fn fabric(ranks: usize, timeout: Duration) -> Arc<VirtualFabric> {
        let model = Arc::new(ModelConfig::tiny_v41());
        VirtualFabric::new(
            FabricSpec {
                model,
                device: DeviceModel {
                    peaks: DevicePeaks::H200,
                    efficiency: Efficiency::MEASURED_FAST,
                },
                layout: FabricLayout {
                    gpus: ranks,
                    gpus_per_node: ranks,
                },
                dp_ranks: ranks,
                routing_skew: 0.0,
                seed: 0,
                collective_timeout: timeout,
            },
            None,
        )
    }

    fn work(f: &VirtualFabric, tokens: usize) -> StepWork {
        let entries = [StepEntry {
            start: 0,
            tokens,
            rows: 1,
        }];
        StepWork::backbone(&f.spec().model, &entries, 0)
    }

    fn rank_step(work: StepWork) -> RankStep {
        RankStep {
            work,
            produced: 1,
            prefill: false,
        }
    }

    #[test]
    fn a_step_ends_when_every_rank_is_in_and_lasts_as_long_as_the_slowest() {
        let f = fabric(2, Duration::from_secs(30));
        let (small, big) = (work(&f, 1), work(&f, 512));
        let other = f.clone();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            other.step(1, rank_step(big))
        });
        let end = f.step(0, rank_step(small)).expect("step");
        assert_eq!(late.join().expect("joins").expect("step"), end);
        let times = gpu_times(f.spec(), &[small, big], None);
        assert_eq!(end, times[1].compute.max(times[0].compute));
        assert!(
            times[1].compute > times[0].compute,
            "more tokens take longer: {times:?}"
        );
        let summary = f.summary();
        assert_eq!(summary.steps, 1);
        assert_eq!(summary.busy, vec![times[0].compute, times[1].compute]);
        assert_eq!((summary.decode_steps, summary.decode_tokens), (1, 2));
        assert_eq!(summary.decode_seconds, end);
    }

    #[test]
    fn the_gate_holds_the_clock_and_close_releases_waiters() {
        let f = fabric(1, Duration::from_secs(30));
        let end = f.step(0, rank_step(work(&f, 4))).expect("step");
        f.set_gate(Some(end));
        let blocked = f.clone();
        let waiter = std::thread::spawn(move || blocked.step(0, RankStep::default()));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "no step starts at the gate");
        assert_eq!(f.now(), end);
        f.set_gate(None);
        assert!(waiter.join().expect("joins").expect("step") > end);
        // Nothing outstanding: waiting for a later arrival moves the clock there.
        assert_eq!(f.wait_until(10.0), 10.0);
        f.close();
        assert_eq!(f.step(0, rank_step(work(&f, 4))).expect("closed"), 10.0);
    }

    #[test]
    fn a_missing_rank_times_the_collective_out_naming_it() {
        let f = fabric(3, Duration::from_millis(50));
        let error = f.step(2, RankStep::default()).unwrap_err().to_string();
        assert!(
            error.contains("timed out") && error.contains("ranks [0, 1]"),
            "{error}"
        );
        // The failed rank's contribution is withdrawn: the step is still open.
        assert_eq!(f.summary().steps, 0);
        // A rank that left is not waited for.
        let f = fabric(2, Duration::from_secs(30));
        let other = f.clone();
        let leaving = std::thread::spawn(move || {
            other.step(1, RankStep::default()).expect("step");
            other.leave(1);
        });
        f.step(0, RankStep::default()).expect("step");
        leaving.join().expect("joins");
        f.step(0, RankStep::default()).expect("alone");
        assert_eq!(f.summary().steps, 2);
    }
}
