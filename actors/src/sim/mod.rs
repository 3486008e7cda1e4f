//! `deepinfer-node --topology FILE --simulate [--trace FILE]`: the real control plane of a
//! topology (frontend, every scheduler and rank actor, expert groups, EPLB, DSpark, replay)
//! against simulated devices on a virtual clock, for deployments larger than the machine.
//!
//! Each rank's executor is a `SimulatedExecutor` (`device`): it computes no model, produces the
//! fake backend's deterministic tokens and DSpark drafts of a configurable acceptance, and charges
//! each step to the `VirtualFabric` (`fabric`) at the price of the cost model
//! (`deepinfer_model::cost`, peaks per `[device] arch`). The expert-parallel state has no
//! weights (`ExpertSource::Simulated`): the fabric counts each step's routed picks, drawn in
//! expectation from a skewed routing law, into the shards the `EplbActor` measures, so a
//! rebalance changes the modelled step time. The driver (`simulate`) submits the trace
//! (`trace`) at its virtual arrival times and builds the `SimReport` (`report`).
//!
//! Assumptions (also in README.md): the cost model's, plus no prefix cache, the bounded replay
//! planned but not priced (full prefills), sampling a point mass, and the wall-time messaging
//! between actors free in virtual time (a request reaches its rank within a step or two of its
//! arrival).

pub mod device;
pub mod fabric;
pub mod report;
pub mod trace;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deepinfer_model::config::ModelConfig;
use deepinfer_model::cost::device::{DeviceModel, DevicePeaks, Efficiency, FabricLayout};
use deepinfer_model::error::ModelError;
use deepinfer_topology::{Arch, Backend, ModelSource, NodeConfig, RequestId};
use tokio::task::JoinSet;

use crate::engine::{Engine, EngineConfig, ModelFacts};
use crate::error::EngineError;
use crate::experts::parallel::{EpSettings, ExpertParallel};
use crate::experts::shard::ExpertSource;
use crate::messages::scheduler::SchedulerStats;
use crate::{EngineHandle, GenerateRequest};
use device::{DraftLaw, SimulatedFactory};
use fabric::{FabricSpec, VirtualFabric};
use report::{DSparkSummary, EplbSummary, Percentiles, QueueSamples, SimReport};
use trace::{TraceRequest, TraceShape};

/// How fast the simulated GPUs are taken to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// This engine's `fast` kernels as measured on an H100 (`Efficiency::MEASURED_FAST`: its
    /// fractions of the peaks, applied to the simulated device's).
    Measured,
    /// Every op class at its roofline floor (`Efficiency::ROOFLINE`).
    Roofline,
}

/// What a simulation runs, besides the topology.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// The traffic, sorted by arrival.
    pub trace: Vec<TraceRequest>,
    /// Zipf exponent of the expert popularity (0 = uniform).
    pub routing_skew: f64,
    /// Probability that a DSpark draft continues the chain, given its predecessors did.
    pub accept_rate: f64,
    pub kernels: Kernels,
    pub seed: u64,
    /// Wall time a rank waits for the others before its step fails.
    pub collective_timeout: Duration,
    /// GPUs per scale-up (NVLink) domain; `None`: `[device] gpus_per_node` (HGX-style nodes).
    pub scale_up_gpus: Option<usize>,
}

impl SimSettings {
    /// Defaults: skew 0.6, acceptance 0.7, measured kernels, seed 0, 120 s timeout.
    pub fn new(trace: Vec<TraceRequest>) -> SimSettings {
        SimSettings {
            trace,
            routing_skew: 0.6,
            accept_rate: 0.7,
            kernels: Kernels::Measured,
            seed: 0,
            collective_timeout: Duration::from_secs(120),
            scale_up_gpus: None,
        }
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("{field}: {message}")]
    Config { field: String, message: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("expert parallelism: {0}")]
    Ep(#[from] crate::comm::EpError),
}

/// The shipped configs a Hub source resolves to (`tests/data`, embedded): repository-name
/// fragment, config.json text. Checked in order, so V4.1 and 0731 come before plain V4-Flash.
const SHIPPED_CONFIGS: [(&str, &str); 3] = [
    (
        "v4.1-flash",
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/data/deepseek-v4.1-flash.config.json"
        )),
    ),
    (
        "v4-flash-0731",
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/data/deepseek-v4-flash-0731.config.json"
        )),
    ),
    (
        "v4-flash",
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/data/deepseek-v4-flash.config.json"
        )),
    ),
];

/// The served model's config, without loading weights: the `config.json` of a local checkpoint
/// directory, or for a Hub repository the shipped config of its model (V4.1-Flash, V4-Flash,
/// V4-Flash-0731).
pub fn model_config(node: &NodeConfig) -> Result<ModelConfig, SimError> {
    let bad = |message: String| SimError::Config {
        field: "model.source".into(),
        message,
    };
    match &node.model.source {
        ModelSource::LocalDir(dir) => ModelConfig::from_file(&dir.join("config.json"))
            .map_err(|e| bad(format!("{}: {e}", dir.display()))),
        ModelSource::Hub { repo_id, .. } => {
            shipped_config(repo_id)
                .ok_or_else(|| {
                    bad(format!(
                        "{repo_id}: no shipped config for this repository; point model.source at a local checkpoint directory"
                    ))
                })?
                .map_err(|e| bad(e.to_string()))
        }
        ModelSource::Demo => Err(bad(
            "the demo model is not simulated (its costs mean nothing); name a real model".into(),
        )),
    }
}

/// The shipped config (parsed) of the Hub repository `repo_id`: the first of
/// [`SHIPPED_CONFIGS`] whose name fragment it contains, ignoring case (`None`: no shipped config).
pub fn shipped_config(repo_id: &str) -> Option<Result<ModelConfig, ModelError>> {
    let name = repo_id.to_ascii_lowercase();
    SHIPPED_CONFIGS
        .iter()
        .find(|(fragment, _)| name.contains(fragment))
        .map(|(_, text)| ModelConfig::from_json_str(text, std::path::Path::new(repo_id)))
}

/// The default trace for `node`: 4 requests per DP rank arriving as a Poisson stream over about
/// a virtual second, prompts of 256-1024 tokens, 64-192 output tokens, 16 shared prefixes.
pub fn default_trace(node: &NodeConfig) -> Vec<TraceRequest> {
    let ranks = usize::from(node.parallel.dp);
    trace::generate(&TraceShape {
        requests: 4 * ranks,
        rate_per_s: 4.0 * ranks as f64,
        prompt_tokens: (256, 1024),
        output_tokens: (64, 192),
        prefixes: 16,
        seed: 0,
    })
}

/// The simulated GPU and its fabric for `node` (`[device] arch`, nodes, GPUs per node; a
/// scale-up domain of `scale_up_gpus` GPUs, default a node).
pub fn device_for(
    node: &NodeConfig,
    kernels: Kernels,
    scale_up_gpus: Option<usize>,
) -> Result<(DeviceModel, FabricLayout), SimError> {
    let peaks = match node.device.backend {
        Backend::Cuda {
            arch: Arch::Sm90, ..
        } => DevicePeaks::H200,
        Backend::Cuda {
            arch: Arch::Sm100, ..
        } => DevicePeaks::B200,
        Backend::Cpu => {
            return Err(SimError::Config {
                field: "device.backend".into(),
                message:
                    "--simulate models GPUs: the topology must name backend = \"cuda\" and its arch"
                        .into(),
            });
        }
    };
    let efficiency = match kernels {
        Kernels::Measured => Efficiency::MEASURED_FAST,
        Kernels::Roofline => Efficiency::ROOFLINE,
    };
    let gpus = usize::from(node.device.nodes) * usize::from(node.device.gpus_per_node);
    let ranks = usize::from(node.parallel.dp.max(node.parallel.ep));
    if gpus < ranks {
        return Err(SimError::Config {
            field: "device.gpus_per_node".into(),
            message: format!("{gpus} GPUs for {ranks} ranks (one rank of each kind per GPU)"),
        });
    }
    let domain = scale_up_gpus.unwrap_or(usize::from(node.device.gpus_per_node));
    if domain == 0 || domain > gpus {
        return Err(SimError::Config {
            field: "--scale-up-gpus".into(),
            message: format!("must be in 1..={gpus}, found {domain}"),
        });
    }
    Ok((
        DeviceModel { peaks, efficiency },
        FabricLayout {
            gpus: ranks,
            gpus_per_node: domain,
        },
    ))
}

fn check_settings(settings: &SimSettings) -> Result<(), SimError> {
    let bad = |field: &str, message: String| SimError::Config {
        field: field.into(),
        message,
    };
    if !(0.0..1.0).contains(&settings.accept_rate) {
        return Err(bad(
            "--accept-rate",
            format!("must be in [0, 1), found {}", settings.accept_rate),
        ));
    }
    if !settings.routing_skew.is_finite() || settings.routing_skew < 0.0 {
        return Err(bad(
            "--routing-skew",
            format!("must be finite and >= 0, found {}", settings.routing_skew),
        ));
    }
    if settings.trace.is_empty() {
        return Err(bad("--trace", "no request to simulate".into()));
    }
    Ok(())
}

/// One submitted request.
struct Submitted {
    index: usize,
    id: RequestId,
}

/// Scheduler snapshots, summarised as the report's queue invariants.
fn sample_queues(samples: &mut QueueSamples, stats: &[SchedulerStats]) {
    samples.samples += 1;
    let live: Vec<&SchedulerStats> = stats.iter().filter(|s| !s.rank_failed).collect();
    let queued = live.iter().any(|s| s.waiting > 0);
    if queued && live.iter().any(|s| s.waiting == 0 && s.running == 0) {
        samples.idle_while_queued += 1;
    }
}

/// Runs `settings.trace` through `node`'s actor tree on simulated devices; `model` is the served
/// model's config (its widths price the steps; no weight is loaded).
pub async fn simulate(
    node: NodeConfig,
    model: ModelConfig,
    settings: SimSettings,
) -> Result<SimReport, SimError> {
    check_settings(&settings)?;
    let wall = Instant::now();
    let (device, layout) = device_for(&node, settings.kernels, settings.scale_up_gpus)?;
    let model = Arc::new(model);
    let parallel = if EpSettings::is_needed(&node) {
        let source = ExpertSource::Simulated {
            layers: model.n_layers,
            routed_experts: model.n_routed_experts,
        };
        Some(ExpertParallel::new(source, EpSettings::from_node(&node))?)
    } else {
        None
    };
    let fabric = VirtualFabric::new(
        FabricSpec {
            model: model.clone(),
            device,
            layout,
            dp_ranks: usize::from(node.parallel.dp),
            routing_skew: settings.routing_skew,
            seed: settings.seed,
            collective_timeout: settings.collective_timeout,
        },
        parallel.clone(),
    );
    let factory = SimulatedFactory {
        model: model.clone(),
        fabric: fabric.clone(),
        draft: node.dspark.enabled.then_some(DraftLaw {
            drafts: usize::from(node.dspark.max_draft_tokens),
            accept_rate: settings.accept_rate,
        }),
        seed: settings.seed,
    };
    let facts = ModelFacts {
        vocab_size: model.vocab_size,
        bos_token_id: model.bos_token_id,
        eos_token_id: Some(model.eos_token_id),
        max_context_tokens: model.max_position_embeddings,
    };
    let topology = node.origin.clone();
    let engine = Engine::start(EngineConfig {
        node,
        executor: Arc::new(factory),
        model: facts,
        tokenizer: None,
    })
    .await?;
    let handle = engine.handle();
    let driven = drive(&handle, &fabric, &settings.trace, model.vocab_size).await;
    let stats = handle.scheduler_stats().await;
    let eplb = match &parallel {
        Some(parallel) => Some(eplb_summary(parallel, &fabric).await?),
        None => None,
    };
    fabric.close();
    engine.shutdown(Duration::from_secs(30)).await?;
    let (submitted, completions, failed, queues) = driven?;
    let stats = stats?;
    let summary = fabric.summary();
    let records = fabric.take_records();

    let mut report = SimReport {
        topology,
        device: fabric.spec().device.peaks.name.to_string(),
        gpus: layout.gpus,
        submitted: submitted.len(),
        completed: completions.len(),
        failed,
        steps: summary.steps,
        decode_steps: summary.decode_steps,
        decode_seconds: summary.decode_seconds,
        decode_tokens: summary.decode_tokens,
        eplb,
        queues,
        ..SimReport::default()
    };
    let arrivals: HashMap<RequestId, &TraceRequest> = submitted
        .iter()
        .map(|s| (s.id, &settings.trace[s.index]))
        .collect();
    let first_arrival = settings.trace.first().map_or(0.0, |r| r.arrival_s);
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    let mut last_token: f64 = first_arrival;
    for (id, delivered) in &completions {
        let Some(request) = arrivals.get(id) else {
            continue;
        };
        report.prompt_tokens += u64::from(request.prompt_tokens);
        report.expected_output_tokens += u64::from(request.output_tokens);
        report.output_tokens += *delivered as u64;
        let Some(times) = records.get(id).filter(|t| !t.is_empty()) else {
            report.untimed += 1;
            continue;
        };
        let first = times[0].0;
        let mut seen = 0usize;
        let mut at_last = first;
        for &(t, n) in times {
            if seen >= *delivered {
                break;
            }
            seen += n as usize;
            at_last = t;
        }
        report.timed_output_tokens += seen.min(*delivered) as u64;
        ttft.push(first - request.arrival_s);
        if *delivered > 1 {
            itl.push((at_last - first) / (*delivered - 1) as f64);
        }
        last_token = last_token.max(at_last);
    }
    report.span_s = last_token - first_arrival;
    report.ttft = Percentiles::of(ttft);
    report.itl = Percentiles::of(itl);
    report.utilisation = summary
        .busy
        .iter()
        .map(|b| {
            if report.span_s > 0.0 {
                (b / report.span_s).min(1.0)
            } else {
                0.0
            }
        })
        .collect();
    report.dspark = stats
        .iter()
        .fold(DSparkSummary::default(), |d, s| DSparkSummary {
            proposed: d.proposed + s.draft_tokens_proposed,
            verified: d.verified + s.draft_tokens_verified,
            accepted: d.accepted + s.draft_tokens_accepted,
            verify_entries: d.verify_entries + s.verify_entries,
        });
    report.wall_s = wall.elapsed().as_secs_f64();
    Ok(report)
}

type Driven = (Vec<Submitted>, Vec<(RequestId, usize)>, usize, QueueSamples);

/// Submits the trace at its virtual arrival times and waits for every request.
async fn drive(
    handle: &EngineHandle,
    fabric: &Arc<VirtualFabric>,
    trace: &[TraceRequest],
    vocab_size: usize,
) -> Result<Driven, SimError> {
    let mut submitted = Vec::with_capacity(trace.len());
    let mut failed = 0;
    let mut queues = QueueSamples::default();
    let mut streams = JoinSet::new();
    let sample_every = trace.len().div_ceil(256).max(1);
    for (index, request) in trace.iter().enumerate() {
        fabric.set_gate(Some(request.arrival_s));
        let waiter = fabric.clone();
        let arrival = request.arrival_s;
        tokio::task::spawn_blocking(move || waiter.wait_until(arrival))
            .await
            .map_err(|e| EngineError::internal(format!("the simulation clock panicked: {e}")))?;
        if index % sample_every == 0 {
            sample_queues(&mut queues, &handle.scheduler_stats().await?);
        }
        let generate = GenerateRequest::from_tokens(request.prompt(index, vocab_size))
            .max_tokens(request.output_tokens as usize)
            .ignore_eos(true);
        fabric.request_submitted();
        match handle.generate(generate).await {
            Ok(stream) => {
                let id = stream.id();
                submitted.push(Submitted { index, id });
                let done = fabric.clone();
                streams.spawn(async move {
                    let completion = stream.collect().await;
                    done.request_ended();
                    (id, completion.map(|c| c.tokens.len()))
                });
            }
            Err(error) => {
                tracing::warn!(index, %error, "a simulated request was refused");
                fabric.request_ended();
                failed += 1;
            }
        }
    }
    fabric.set_gate(None);
    let mut completions = Vec::with_capacity(submitted.len());
    while let Some(joined) = streams.join_next().await {
        match joined {
            Ok((id, Ok(tokens))) => completions.push((id, tokens)),
            Ok((_, Err(error))) => {
                tracing::warn!(%error, "a simulated request failed");
                failed += 1;
            }
            Err(e) => {
                return Err(EngineError::internal(format!("a request task panicked: {e}")).into());
            }
        }
    }
    Ok((submitted, completions, failed, queues))
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// The EPLB's automatic rebalances and a closing one over the loads since its last measurement.
async fn eplb_summary(
    parallel: &ExpertParallel,
    fabric: &VirtualFabric,
) -> Result<EplbSummary, SimError> {
    let status = parallel.eplb_status().await?;
    let closing = parallel.rebalance_now().await?;
    Ok(EplbSummary {
        automatic_rebalances: status.rebalances,
        epochs: fabric
            .summary()
            .epochs
            .iter()
            .map(|(epoch, load)| (*epoch, load.steps, load.imbalance))
            .collect(),
        measured_before: mean(&closing.measured_imbalance),
        planned_after: mean(&closing.planned_imbalance),
    })
}
