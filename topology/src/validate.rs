//! Raw TOML shape -> validated, immutable `NodeConfig`. All defaults and every range and
//! cross-field check live here, and every error names the file and the field.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::error::TopologyError;
use crate::ids::{DpRank, EpRank};
use crate::raw::{
    RawArch, RawBackend, RawClusterConfig, RawDSparkConfig, RawDeviceConfig, RawEplbConfig,
    RawJobConfig, RawMemoryConfig, RawMetricsConfig, RawModelConfig, RawNodeConfig, RawNumerics,
    RawParallelConfig, RawPrefixCacheConfig, RawPrefixReplay, RawReplayConfig, RawSamplingConfig,
    RawSchedulerConfig, RawServerConfig,
};

/// The checkpoint the engine loads when `model.source` is left out.
pub const DEFAULT_MODEL_ID: &str = "deepseek-ai/DeepSeek-V4.1-Flash-1017";
/// The Hub revision used when `model.revision` is left out.
pub const DEFAULT_REVISION: &str = "main";
/// Upper bound of `scheduler.overlap_depth` (plans in flight per rank).
pub const MAX_OVERLAP_DEPTH: u8 = 4;
/// Upper bound of `dspark.max_draft_tokens`.
pub const MAX_DRAFT_TOKENS_LIMIT: u8 = 16;

/// A validated topology: what one node runs. Immutable once built; values derived at
/// start-up (placements, KV block counts) belong elsewhere.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeConfig {
    /// Where this config came from (a path, or a label such as `configs/local.toml (embedded)`).
    pub origin: String,
    /// `[model]`.
    pub model: ModelConfig,
    /// `[device]`.
    pub device: DeviceConfig,
    /// `[parallel]`.
    pub parallel: ParallelConfig,
    /// `[scheduler]`.
    pub scheduler: SchedulerConfig,
    /// `[sampling]`.
    pub sampling: SamplingConfig,
    /// `[dspark]`.
    pub dspark: DSparkConfig,
    /// `[replay]`.
    pub replay: ReplayConfig,
    /// `[eplb]`.
    pub eplb: EplbConfig,
    /// `[memory]`.
    pub memory: MemoryConfig,
    /// `[prefix_cache]`.
    pub prefix_cache: PrefixCacheConfig,
    /// `[metrics]`.
    pub metrics: MetricsConfig,
    /// `[job]`.
    pub job: JobConfig,
    /// `[server]`.
    pub server: ServerConfig,
    /// `[cluster]`.
    pub cluster: ClusterConfig,
}

/// `[model]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// Which checkpoint to load. Default: the Hub id [`DEFAULT_MODEL_ID`] at `main`.
    pub source: ModelSource,
    /// Routed experts per MoE layer (count), when the file states it; otherwise the runtime
    /// reads it from `config.json` and calls [`NodeConfig::check_model`].
    pub routed_experts: Option<u16>,
    /// Sliding attention window (tokens), when the file states it.
    pub sliding_window_tokens: Option<u32>,
}

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// The built-in tiny random model (no download; for tests and the embedded default).
    Demo,
    /// A local checkpoint directory (`config.json` + safetensors shards).
    LocalDir(PathBuf),
    /// A Hugging Face Hub repository, looked up in the local cache or downloaded.
    Hub {
        /// `owner/name`.
        repo_id: String,
        /// Branch, tag or commit. Default: `main`.
        revision: String,
    },
}

/// `[device]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConfig {
    /// The backend, with its architecture for CUDA. Default: `Cpu`.
    pub backend: Backend,
    /// Nodes in the deployment (count, >= 1; 1 with the CPU backend). Default: 1.
    pub nodes: u16,
    /// GPUs used per node (count; 0 with the CPU backend, >= 1 with CUDA). Default: 1 (CUDA).
    pub gpus_per_node: u16,
}

/// The compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The CPU reference backend; DP and EP ranks are threads of one process.
    Cpu,
    /// NVIDIA GPUs of the given architecture.
    Cuda {
        /// The GPU architecture kernels are compiled for.
        arch: Arch,
        /// How the CUDA backend computes. Default: `Fast`.
        numerics: Numerics,
    },
}

/// The two numerics of the CUDA backend (ARCHITECTURE.md §3); both are deterministic and batch
/// invariant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numerics {
    /// Tensor cores for the block-scaled GEMMs, judged against the CPU reference by error bounds.
    Fast,
    /// Bitwise equal to the CPU reference (fp32 CUDA-core chains in the reference's order).
    Exact,
}

/// A GPU architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Hopper (sm_90: H100, H200).
    Sm90,
    /// Blackwell (sm_100: B200, GB200, B300).
    Sm100,
}

/// `[parallel]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelConfig {
    /// Attention data-parallel ranks (count, >= 1). Default: 1.
    pub dp: u16,
    /// Expert-parallel ranks (count, >= 1). Default: `dp`.
    pub ep: u16,
    /// Context parallelism of long prefills, `None` when off (`context_parallel = 1`).
    pub context_parallel: Option<ContextParallel>,
}

/// `[parallel] context_parallel` > 1, validated: each DP rank computes a prefill chunk of at
/// least `min_tokens` tokens over `ranks` CP ranks (mirror split, bitwise the one-rank prefill);
/// the scheduler gives a prompt whose remaining prefill reaches `min_tokens` chunks of up to
/// `ranks x scheduler.prefill_chunk_tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextParallel {
    /// CP ranks per group (>= 2).
    pub ranks: u16,
    /// Smallest chunk that runs context-parallel (tokens, `2 x ranks ..= min(ranks x
    /// prefill_chunk_tokens, max_batched_tokens)`).
    pub min_tokens: u32,
}

/// `[scheduler]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per step per rank (tokens, >= 1). Default: 8192.
    pub max_batched_tokens: u32,
    /// Running requests per rank (count, 1..=`max_batched_tokens`). Default: 256.
    pub max_running_requests: u32,
    /// Largest prefill chunk per request per step (tokens, 1..=`max_batched_tokens`).
    /// Default: 2048.
    pub prefill_chunk_tokens: u32,
    /// Plans in flight per rank (count, 1..=4; 1 = synchronous). Default: 2.
    pub overlap_depth: u8,
    /// Admitted-but-waiting requests per node (count, >= 1). Default: 4096.
    pub admission_queue_capacity: u32,
}

impl SchedulerConfig {
    /// True when the scheduler plans step N+1 while step N runs (`overlap_depth >= 2`).
    pub fn is_async(&self) -> bool {
        self.overlap_depth >= 2
    }
}

/// `[sampling]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingConfig {
    /// Generated tokens when a request sets no limit (tokens, >= 1). Default: 256.
    pub max_tokens: u32,
    /// Base seed for requests without one. Default: 0.
    pub seed: u64,
    /// Thinking mode for chat requests that do not choose. Default: false.
    pub thinking: bool,
}

/// `[dspark]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DSparkConfig {
    /// Speculative decoding with the DSpark drafter. Default: false.
    pub enabled: bool,
    /// Most drafts verified per request per step (tokens, 1..=16). Default: 5.
    pub max_draft_tokens: u8,
    /// Timed steps per batch size when profiling steps-per-second at start (steps, >= 1).
    /// Default: 8.
    pub profile_steps: u32,
}

/// `[replay]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayConfig {
    /// Prompt tail the decoder layers run on during prefill (tokens); `None` = off (the
    /// decoder runs on every prompt token). Default: `Some(140)`.
    pub decoder_keep_tokens: Option<u32>,
    /// Most positions one rejection may rewind (tokens). Default: 6.
    pub max_backtracking: u32,
}

/// `[eplb]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EplbConfig {
    /// Rebalance the placement from measured load. Default: false.
    pub enabled: bool,
    /// Load statistics window (steps, >= 1). Default: 1000.
    pub window_steps: u32,
    /// Steps between rebalances (steps, >= 1). Default: 3000.
    pub rebalance_interval_steps: u32,
    /// Extra physical expert slots per MoE layer (count). Default: 0.
    pub redundant_experts: u16,
    /// Expert groups for the hierarchical policy (count, >= 1). Default: 1.
    pub num_groups: u16,
}

/// `[memory]`, validated: the budget of each DP rank's sequence-state pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryConfig {
    /// `state_bytes_per_rank` (bytes, >= 1).
    StateBytes(u64),
    /// `state_memory_fraction` (0 < f <= 1) of the memory left after the weights, split evenly
    /// over the ranks sharing it: the host's available memory with the CPU, each GPU's free
    /// memory (read at start once its ranks' weights are resident) with CUDA; `memory-plan`
    /// applies it to the GPU's memory less the planned weights. Default: `Fraction(0.9)`.
    Fraction(f64),
}

/// Default of `memory.state_memory_fraction`.
pub const DEFAULT_STATE_MEMORY_FRACTION: f64 = 0.9;

/// `[prefix_cache]`, validated: each DP rank's cache of shared prompt prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    /// Bytes of cached blocks per rank (bytes); `None` = off. Default: `None` (0 in the file).
    pub bytes_per_rank: Option<u64>,
    /// Tokens a hit replays. Default: [`PrefixReplay::Bounded`].
    pub replay: PrefixReplay,
}

/// How many tokens a prefix-cache hit replays (`prefix_cache.replay`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixReplay {
    /// `replay.decoder_keep_tokens` (the `ReplayActor`'s bound): approximate, like decoder
    /// bounded replay.
    Bounded,
    /// The model's encoder halo: bitwise a cold prefill.
    Exact,
}

/// `[metrics]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Loopback address serving `/metrics`; `None` = no exporter. Default: `None`.
    pub prometheus_listen: Option<SocketAddr>,
}

/// `[job]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobConfig {
    /// Default input JSONL file. Default: `None`.
    pub input_path: Option<PathBuf>,
    /// Default output JSONL file (differs from the input). Default: `None`.
    pub output_path: Option<PathBuf>,
}

/// The server's listen address when neither the topology nor `--listen` names one.
pub const DEFAULT_SERVER_LISTEN: &str = "127.0.0.1:8000";

/// `[server]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConfig {
    /// Where `deepinfer-node serve` listens. Default: [`DEFAULT_SERVER_LISTEN`].
    pub listen: SocketAddr,
    /// Largest request body (bytes, >= 1024). Default: 8 MiB.
    pub max_body_bytes: u32,
    /// Grace period for in-flight requests after a shutdown signal (seconds). Default: 30.
    pub shutdown_timeout_seconds: u32,
}

/// `[cluster]`, validated: where this process sits among the nodes of one deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterConfig {
    /// This process's node index (< `device.nodes`). Default: 0.
    pub node: u16,
    /// Where node 0 listens while the nodes join (`Some` exactly when `device.nodes > 1`).
    pub bootstrap: Option<SocketAddr>,
    /// Where this node listens for the others: its expert server (CPU), its step counts (CUDA)
    /// (port 0: any free port). Default: 127.0.0.1:0.
    pub expert_listen: SocketAddr,
    /// Longest wait of one exchange between nodes. Default: 30 s.
    pub exchange_timeout: std::time::Duration,
    /// Longest wait for every node to join. Default: 600 s.
    pub bootstrap_timeout: std::time::Duration,
}

/// What the topology must agree with in the model's `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelDims {
    /// `n_routed_experts`.
    pub routed_experts: u16,
    /// `sliding_window` (tokens, the current token included).
    pub sliding_window_tokens: u32,
}

/// Builds errors that carry the origin.
struct Checker<'a> {
    origin: &'a str,
}

impl Checker<'_> {
    fn invalid(&self, field: &'static str, problem: impl Into<String>) -> TopologyError {
        TopologyError::Invalid {
            origin: self.origin.to_owned(),
            field,
            problem: problem.into(),
        }
    }

    /// A hint the file `stated` for `field`, if any, is what the checkpoint `has`.
    fn agrees<T: PartialEq + std::fmt::Display>(
        &self,
        field: &'static str,
        stated: Option<T>,
        has: T,
    ) -> Result<(), TopologyError> {
        match stated {
            Some(stated) if stated != has => Err(self.invalid(
                field,
                format!("the file says {stated}, the checkpoint has {has}"),
            )),
            _ => Ok(()),
        }
    }

    fn at_least<T: PartialOrd + std::fmt::Display + Copy>(
        &self,
        field: &'static str,
        value: T,
        min: T,
    ) -> Result<T, TopologyError> {
        if value < min {
            return Err(self.invalid(field, format!("must be >= {min}, got {value}")));
        }
        Ok(value)
    }

    fn in_range<T: PartialOrd + std::fmt::Display + Copy>(
        &self,
        field: &'static str,
        value: T,
        min: T,
        max: T,
    ) -> Result<T, TopologyError> {
        if value < min || value > max {
            return Err(self.invalid(field, format!("must be in {min}..={max}, got {value}")));
        }
        Ok(value)
    }
}

impl NodeConfig {
    /// Validates a parsed file; `origin` names it in errors.
    pub fn from_raw(raw: RawNodeConfig, origin: &str) -> Result<Self, TopologyError> {
        let check = Checker { origin };
        let model = model_config(&check, raw.model)?;
        let device = device_config(&check, raw.device)?;
        let scheduler = scheduler_config(&check, raw.scheduler)?;
        let parallel = parallel_config(&check, raw.parallel, &device, &scheduler)?;
        let sampling = sampling_config(&check, raw.sampling)?;
        let dspark = dspark_config(&check, raw.dspark)?;
        let replay = replay_config(&check, raw.replay, &dspark)?;
        let eplb = eplb_config(&check, raw.eplb)?;
        let memory = memory_config(&check, raw.memory)?;
        let prefix_cache = prefix_cache_config(&check, raw.prefix_cache, &replay)?;
        let metrics = metrics_config(&check, raw.metrics)?;
        let job = job_config(&check, raw.job)?;
        let server = server_config(&check, raw.server)?;
        let cluster = cluster_config(&check, raw.cluster, &device, &parallel)?;
        let config = Self {
            origin: origin.to_owned(),
            model,
            device,
            parallel,
            scheduler,
            sampling,
            dspark,
            replay,
            eplb,
            memory,
            prefix_cache,
            metrics,
            job,
            server,
            cluster,
        };
        if let Some(routed_experts) = config.model.routed_experts {
            config.check_expert_placement(&check, routed_experts)?;
        }
        if let Some(window) = config.model.sliding_window_tokens {
            config.check_replay_window(&check, window)?;
        }
        Ok(config)
    }

    /// Checks this topology against the model's dimensions (from `config.json`): the stated
    /// hints agree, physical expert slots divide over the EP ranks, groups divide the
    /// experts, and the decoder keep covers the window plus the backtracking.
    pub fn check_model(&self, dims: &ModelDims) -> Result<(), TopologyError> {
        let check = Checker {
            origin: &self.origin,
        };
        check.agrees(
            "model.routed_experts",
            self.model.routed_experts,
            dims.routed_experts,
        )?;
        check.agrees(
            "model.sliding_window_tokens",
            self.model.sliding_window_tokens,
            dims.sliding_window_tokens,
        )?;
        self.check_expert_placement(&check, dims.routed_experts)?;
        self.check_replay_window(&check, dims.sliding_window_tokens)
    }

    /// Physical expert slots per MoE layer: routed experts plus `eplb.redundant_experts`.
    pub fn physical_experts(&self, routed_experts: u16) -> u32 {
        u32::from(routed_experts) + u32::from(self.eplb.redundant_experts)
    }

    fn check_expert_placement(
        &self,
        check: &Checker<'_>,
        routed_experts: u16,
    ) -> Result<(), TopologyError> {
        if routed_experts == 0 {
            return Err(check.invalid("model.routed_experts", "must be >= 1, got 0"));
        }
        let physical = self.physical_experts(routed_experts);
        let ep = u32::from(self.parallel.ep);
        if !physical.is_multiple_of(ep) {
            return Err(check.invalid(
                "parallel.ep",
                format!(
                    "{ep} does not divide the physical expert slots: routed experts \
                     {routed_experts} + eplb.redundant_experts {} = {physical}",
                    self.eplb.redundant_experts
                ),
            ));
        }
        let groups = self.eplb.num_groups;
        if !routed_experts.is_multiple_of(groups) {
            return Err(check.invalid(
                "eplb.num_groups",
                format!("{groups} does not divide the {routed_experts} routed experts"),
            ));
        }
        Ok(())
    }

    fn check_replay_window(&self, check: &Checker<'_>, window: u32) -> Result<(), TopologyError> {
        if window == 0 {
            return Err(check.invalid("model.sliding_window_tokens", "must be >= 1, got 0"));
        }
        if let Some(keep) = self.replay.decoder_keep_tokens {
            let needed = u64::from(window) + u64::from(self.replay.max_backtracking);
            if u64::from(keep) < needed {
                return Err(check.invalid(
                    "replay.decoder_keep_tokens",
                    format!(
                        "{keep} is below the sliding window {window} + replay.max_backtracking \
                         {} = {needed} (0 turns bounded replay off)",
                        self.replay.max_backtracking
                    ),
                ));
            }
        }
        Ok(())
    }

    /// GPUs this topology drives (`nodes * gpus_per_node`; 0 for the CPU backend).
    pub fn gpu_count(&self) -> usize {
        usize::from(self.device.nodes) * usize::from(self.device.gpus_per_node)
    }

    /// GPUs this process drives: every node's (one node, or `--simulate`), or one node's when
    /// the topology is one node of a deployment of one `deepinfer-node` per node
    /// (`cluster.bootstrap`); 0 for the CPU backend.
    pub fn gpus_here(&self) -> usize {
        usize::from(self.nodes_per_process()) * usize::from(self.device.gpus_per_node)
    }

    /// Fails unless this machine has the GPUs this process needs ([`Self::gpus_here`]). The
    /// CPU backend always fits.
    pub fn can_run_here(&self, available_gpus: usize) -> Result<(), TopologyError> {
        if self.device.backend == Backend::Cpu {
            return Ok(());
        }
        let required = self.gpus_here();
        if available_gpus < required {
            return Err(TopologyError::NotEnoughGpus {
                origin: self.origin.clone(),
                required,
                available: available_gpus,
                nodes: self.nodes_per_process(),
                gpus_per_node: self.device.gpus_per_node,
            });
        }
        Ok(())
    }

    /// Every attention DP rank, in order.
    pub fn dp_ranks(&self) -> impl Iterator<Item = DpRank> + use<> {
        (0..self.parallel.dp).map(DpRank)
    }

    /// Every expert-parallel rank, in order.
    pub fn ep_ranks(&self) -> impl Iterator<Item = EpRank> + use<> {
        (0..self.parallel.ep).map(EpRank)
    }

    /// Nodes whose ranks one process runs: every node (one node, or `--simulate`), unless the
    /// topology joins a deployment of one `deepinfer-node` per node (`cluster.bootstrap`).
    fn nodes_per_process(&self) -> u16 {
        match self.cluster.bootstrap {
            Some(_) => 1,
            None => self.device.nodes,
        }
    }

    /// The attention DP ranks this process runs: all of them, or `parallel.dp / device.nodes`
    /// on one node of a deployment (a process numbers its own from 0; node `n`'s rank `r` is
    /// global DP rank `n * dp_on_node + r`).
    pub fn dp_on_node(&self) -> u16 {
        self.parallel.dp / self.device.nodes * self.nodes_per_process()
    }

    /// The EP ranks whose experts this process holds: all of them, or on node `n` of `N` of a
    /// deployment the `n`-th of `N` contiguous blocks of `parallel.ep`.
    pub fn ep_ranks_on_node(&self) -> std::ops::Range<u16> {
        match self.cluster.bootstrap {
            None => 0..self.parallel.ep,
            Some(_) => {
                let per_node = self.parallel.ep / self.device.nodes;
                let first = self.cluster.node * per_node;
                first..first + per_node
            }
        }
    }
}

fn model_config(check: &Checker<'_>, raw: RawModelConfig) -> Result<ModelConfig, TopologyError> {
    let text = raw.source.unwrap_or_else(|| DEFAULT_MODEL_ID.to_owned());
    let source = if text == "demo" {
        ModelSource::Demo
    } else if text.starts_with('/') || text.starts_with("./") || text.starts_with("../") {
        ModelSource::LocalDir(PathBuf::from(text))
    } else if is_hub_id(&text) {
        ModelSource::Hub {
            repo_id: text,
            revision: String::new(),
        }
    } else {
        return Err(check.invalid(
            "model.source",
            format!(
                "{text:?} is neither \"demo\", a directory (absolute, or starting with ./ or \
                 ../) nor a Hugging Face Hub id owner/name"
            ),
        ));
    };
    let source = match (source, raw.revision) {
        (ModelSource::Hub { repo_id, .. }, revision) => {
            let revision = revision.unwrap_or_else(|| DEFAULT_REVISION.to_owned());
            if revision.trim().is_empty() {
                return Err(check.invalid("model.revision", "must not be empty"));
            }
            ModelSource::Hub { repo_id, revision }
        }
        (_, Some(_)) => {
            return Err(check.invalid(
                "model.revision",
                "only applies when model.source is a Hub id",
            ));
        }
        (other, None) => other,
    };
    if let Some(experts) = raw.routed_experts {
        check.at_least("model.routed_experts", experts, 1)?;
    }
    if let Some(window) = raw.sliding_window_tokens {
        check.at_least("model.sliding_window_tokens", window, 1)?;
    }
    Ok(ModelConfig {
        source,
        routed_experts: raw.routed_experts,
        sliding_window_tokens: raw.sliding_window_tokens,
    })
}

/// `owner/name` with one slash and Hub-legal characters on both sides.
fn is_hub_id(text: &str) -> bool {
    let legal = |part: &str| {
        !part.is_empty()
            && !part.starts_with(['.', '-'])
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    };
    match text.split_once('/') {
        Some((owner, name)) => legal(owner) && legal(name),
        None => false,
    }
}

fn device_config(check: &Checker<'_>, raw: RawDeviceConfig) -> Result<DeviceConfig, TopologyError> {
    let nodes = check.at_least("device.nodes", raw.nodes.unwrap_or(1), 1)?;
    match raw.backend.unwrap_or(RawBackend::Cpu) {
        RawBackend::Cpu => {
            if raw.arch.is_some() {
                return Err(
                    check.invalid("device.arch", "only applies with device.backend = \"cuda\"")
                );
            }
            if raw.gpus_per_node.is_some() {
                return Err(check.invalid(
                    "device.gpus_per_node",
                    "only applies with device.backend = \"cuda\"",
                ));
            }
            if raw.numerics.is_some() {
                return Err(check.invalid(
                    "device.numerics",
                    "only applies with device.backend = \"cuda\" (the CPU backend is the reference)",
                ));
            }
            Ok(DeviceConfig {
                backend: Backend::Cpu,
                nodes,
                gpus_per_node: 0,
            })
        }
        RawBackend::Cuda => {
            let gpus_per_node =
                check.at_least("device.gpus_per_node", raw.gpus_per_node.unwrap_or(1), 1)?;
            let arch = match raw.arch.unwrap_or(RawArch::Sm90) {
                RawArch::Sm90 => Arch::Sm90,
                RawArch::Sm100 => Arch::Sm100,
            };
            let numerics = match raw.numerics.unwrap_or(RawNumerics::Fast) {
                RawNumerics::Fast => Numerics::Fast,
                RawNumerics::Exact => Numerics::Exact,
            };
            Ok(DeviceConfig {
                backend: Backend::Cuda { arch, numerics },
                nodes,
                gpus_per_node,
            })
        }
    }
}

fn parallel_config(
    check: &Checker<'_>,
    raw: RawParallelConfig,
    device: &DeviceConfig,
    scheduler: &SchedulerConfig,
) -> Result<ParallelConfig, TopologyError> {
    let dp = check.at_least("parallel.dp", raw.dp.unwrap_or(1), 1)?;
    let ep = check.at_least("parallel.ep", raw.ep.unwrap_or(dp), 1)?;
    if let Backend::Cuda { .. } = device.backend {
        // DEP: one EP rank per DP rank; DP rank r on GPU r % gpus_per_node of its node, so a
        // multiple of the GPUs puts several ranks on each.
        let gpus = u32::from(device.nodes) * u32::from(device.gpus_per_node);
        if !u32::from(dp).is_multiple_of(gpus) {
            return Err(check.invalid(
                "parallel.dp",
                format!(
                    "must be a multiple of device.nodes x device.gpus_per_node = {} x {} = {gpus} \
                     (rank r on GPU r % gpus_per_node), got {dp}",
                    device.nodes, device.gpus_per_node
                ),
            ));
        }
        if ep != dp {
            return Err(check.invalid(
                "parallel.ep",
                format!(
                    "must equal parallel.dp = {dp} with cuda (one EP rank per DP rank), got {ep}"
                ),
            ));
        }
    }
    let context_parallel = context_parallel(check, &raw, device, scheduler)?;
    Ok(ParallelConfig {
        dp,
        ep,
        context_parallel,
    })
}

/// `context_parallel` and its threshold (see [`ContextParallel`]).
fn context_parallel(
    check: &Checker<'_>,
    raw: &RawParallelConfig,
    device: &DeviceConfig,
    scheduler: &SchedulerConfig,
) -> Result<Option<ContextParallel>, TopologyError> {
    let ranks = check.at_least(
        "parallel.context_parallel",
        raw.context_parallel.unwrap_or(1),
        1,
    )?;
    if ranks == 1 {
        if raw.context_parallel_min_tokens.is_some() {
            return Err(check.invalid(
                "parallel.context_parallel_min_tokens",
                "is set but context parallelism is off (parallel.context_parallel = 1)",
            ));
        }
        return Ok(None);
    }
    if let Backend::Cuda { .. } = device.backend {
        return Err(check.invalid(
            "parallel.context_parallel",
            format!(
                "{ranks} CP ranks need the context-parallel KV exchange, which runs on the CPU \
                 backend only so far (the device Comm does not carry it yet); use 1 with cuda"
            ),
        ));
    }
    let chunk = scheduler.prefill_chunk_tokens;
    // A chunk is at most ranks x prefill_chunk_tokens and fits in one step's token budget.
    let largest = (u32::from(ranks) * chunk).min(scheduler.max_batched_tokens);
    let min_tokens = check.in_range(
        "parallel.context_parallel_min_tokens",
        raw.context_parallel_min_tokens.unwrap_or(chunk),
        2 * u32::from(ranks),
        largest,
    )?;
    Ok(Some(ContextParallel { ranks, min_tokens }))
}

fn scheduler_config(
    check: &Checker<'_>,
    raw: RawSchedulerConfig,
) -> Result<SchedulerConfig, TopologyError> {
    let max_batched_tokens = check.at_least(
        "scheduler.max_batched_tokens",
        raw.max_batched_tokens.unwrap_or(8192),
        1,
    )?;
    let max_running_requests = check.in_range(
        "scheduler.max_running_requests",
        raw.max_running_requests.unwrap_or(256),
        1,
        max_batched_tokens,
    )?;
    let prefill_chunk_tokens = check.in_range(
        "scheduler.prefill_chunk_tokens",
        raw.prefill_chunk_tokens
            .unwrap_or(2048.min(max_batched_tokens)),
        1,
        max_batched_tokens,
    )?;
    let overlap_depth = check.in_range(
        "scheduler.overlap_depth",
        raw.overlap_depth.unwrap_or(2),
        1,
        MAX_OVERLAP_DEPTH,
    )?;
    let admission_queue_capacity = check.at_least(
        "scheduler.admission_queue_capacity",
        raw.admission_queue_capacity.unwrap_or(4096),
        1,
    )?;
    Ok(SchedulerConfig {
        max_batched_tokens,
        max_running_requests,
        prefill_chunk_tokens,
        overlap_depth,
        admission_queue_capacity,
    })
}

fn sampling_config(
    check: &Checker<'_>,
    raw: RawSamplingConfig,
) -> Result<SamplingConfig, TopologyError> {
    Ok(SamplingConfig {
        max_tokens: check.at_least("sampling.max_tokens", raw.max_tokens.unwrap_or(256), 1)?,
        seed: raw.seed.unwrap_or(0),
        thinking: raw.thinking.unwrap_or(false),
    })
}

fn dspark_config(check: &Checker<'_>, raw: RawDSparkConfig) -> Result<DSparkConfig, TopologyError> {
    Ok(DSparkConfig {
        enabled: raw.enabled.unwrap_or(false),
        max_draft_tokens: check.in_range(
            "dspark.max_draft_tokens",
            raw.max_draft_tokens.unwrap_or(5),
            1,
            MAX_DRAFT_TOKENS_LIMIT,
        )?,
        profile_steps: check.at_least("dspark.profile_steps", raw.profile_steps.unwrap_or(8), 1)?,
    })
}

fn replay_config(
    check: &Checker<'_>,
    raw: RawReplayConfig,
    dspark: &DSparkConfig,
) -> Result<ReplayConfig, TopologyError> {
    let max_backtracking = raw.max_backtracking.unwrap_or(6);
    let rewind_needed = u32::from(dspark.max_draft_tokens) + 1;
    if dspark.enabled && max_backtracking < rewind_needed {
        return Err(check.invalid(
            "replay.max_backtracking",
            format!(
                "{max_backtracking} is below dspark.max_draft_tokens + 1 = {rewind_needed}: a \
                 fully rejected verification must be rewindable"
            ),
        ));
    }
    let decoder_keep_tokens = match raw.decoder_keep_tokens.unwrap_or(140) {
        0 => None,
        keep if keep <= max_backtracking => {
            return Err(check.invalid(
                "replay.decoder_keep_tokens",
                format!(
                    "{keep} must exceed replay.max_backtracking = {max_backtracking} \
                     (0 turns bounded replay off)"
                ),
            ));
        }
        keep => Some(keep),
    };
    Ok(ReplayConfig {
        decoder_keep_tokens,
        max_backtracking,
    })
}

fn eplb_config(check: &Checker<'_>, raw: RawEplbConfig) -> Result<EplbConfig, TopologyError> {
    Ok(EplbConfig {
        enabled: raw.enabled.unwrap_or(false),
        window_steps: check.at_least("eplb.window_steps", raw.window_steps.unwrap_or(1000), 1)?,
        rebalance_interval_steps: check.at_least(
            "eplb.rebalance_interval_steps",
            raw.rebalance_interval_steps.unwrap_or(3000),
            1,
        )?,
        redundant_experts: raw.redundant_experts.unwrap_or(0),
        num_groups: check.at_least("eplb.num_groups", raw.num_groups.unwrap_or(1), 1)?,
    })
}

fn memory_config(check: &Checker<'_>, raw: RawMemoryConfig) -> Result<MemoryConfig, TopologyError> {
    match (raw.state_bytes_per_rank, raw.state_memory_fraction) {
        (Some(_), Some(_)) => Err(check.invalid(
            "memory.state_memory_fraction",
            "give either memory.state_bytes_per_rank or memory.state_memory_fraction, not both",
        )),
        (Some(bytes), None) => Ok(MemoryConfig::StateBytes(check.at_least(
            "memory.state_bytes_per_rank",
            bytes,
            1,
        )?)),
        (None, fraction) => {
            let fraction = fraction.unwrap_or(DEFAULT_STATE_MEMORY_FRACTION);
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(check.invalid(
                    "memory.state_memory_fraction",
                    format!("must be in (0, 1], got {fraction}"),
                ));
            }
            Ok(MemoryConfig::Fraction(fraction))
        }
    }
}

fn prefix_cache_config(
    check: &Checker<'_>,
    raw: RawPrefixCacheConfig,
    replay: &ReplayConfig,
) -> Result<PrefixCacheConfig, TopologyError> {
    let bytes_per_rank = raw.bytes_per_rank.filter(|&bytes| bytes > 0);
    if bytes_per_rank.is_some() && replay.decoder_keep_tokens.is_none() {
        return Err(check.invalid(
            "prefix_cache.bytes_per_rank",
            "the prefix cache needs decoder bounded replay (a hit ends before the decoder's \
             kept suffix): set replay.decoder_keep_tokens > 0 or prefix_cache.bytes_per_rank = 0",
        ));
    }
    Ok(PrefixCacheConfig {
        bytes_per_rank,
        replay: match raw.replay.unwrap_or(RawPrefixReplay::Bounded) {
            RawPrefixReplay::Bounded => PrefixReplay::Bounded,
            RawPrefixReplay::Exact => PrefixReplay::Exact,
        },
    })
}

fn metrics_config(
    check: &Checker<'_>,
    raw: RawMetricsConfig,
) -> Result<MetricsConfig, TopologyError> {
    let prometheus_listen = match raw.prometheus_listen {
        None => None,
        Some(text) => {
            let addr: SocketAddr = text.parse().map_err(|_| {
                check.invalid(
                    "metrics.prometheus_listen",
                    format!("{text:?} is not an IP:port address (e.g. 127.0.0.1:9400)"),
                )
            })?;
            if !addr.ip().is_loopback() {
                return Err(check.invalid(
                    "metrics.prometheus_listen",
                    format!("{addr} is not a loopback address; the exporter only listens locally"),
                ));
            }
            Some(addr)
        }
    };
    Ok(MetricsConfig { prometheus_listen })
}

/// Parses an `IP:port` listen address (`server.listen`, `--listen`).
pub fn parse_listen_address(text: &str) -> Result<SocketAddr, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not an IP:port address (e.g. 127.0.0.1:8000)"))
}

fn server_config(check: &Checker<'_>, raw: RawServerConfig) -> Result<ServerConfig, TopologyError> {
    let listen = parse_listen_address(raw.listen.as_deref().unwrap_or(DEFAULT_SERVER_LISTEN))
        .map_err(|problem| check.invalid("server.listen", problem))?;
    Ok(ServerConfig {
        listen,
        max_body_bytes: check.at_least(
            "server.max_body_bytes",
            raw.max_body_bytes.unwrap_or(8 << 20),
            1024,
        )?,
        shutdown_timeout_seconds: raw.shutdown_timeout_seconds.unwrap_or(30),
    })
}

fn cluster_config(
    check: &Checker<'_>,
    raw: RawClusterConfig,
    device: &DeviceConfig,
    parallel: &ParallelConfig,
) -> Result<ClusterConfig, TopologyError> {
    let nodes = device.nodes;
    let node = raw.node.unwrap_or(0);
    if node >= nodes {
        return Err(check.invalid(
            "cluster.node",
            format!("must be below device.nodes = {nodes}, got {node}"),
        ));
    }
    let bootstrap = match (raw.bootstrap, nodes) {
        (Some(_), 1) => {
            return Err(check.invalid("cluster.bootstrap", "only applies with device.nodes > 1"));
        }
        (None, _) => None,
        (Some(text), _) => {
            Some(parse_listen_address(&text).map_err(|p| check.invalid("cluster.bootstrap", p))?)
        }
    };
    if bootstrap.is_some() {
        for (field, ranks) in [("parallel.dp", parallel.dp), ("parallel.ep", parallel.ep)] {
            if !ranks.is_multiple_of(nodes) {
                return Err(check.invalid(
                    field,
                    format!("{ranks} ranks do not divide over device.nodes = {nodes}"),
                ));
            }
        }
    }
    let expert_listen = parse_listen_address(raw.expert_listen.as_deref().unwrap_or("127.0.0.1:0"))
        .map_err(|p| check.invalid("cluster.expert_listen", p))?;
    let exchange_ms = check.in_range(
        "cluster.exchange_timeout_ms",
        raw.exchange_timeout_ms.unwrap_or(30_000),
        1,
        3_600_000,
    )?;
    let bootstrap_s = check.in_range(
        "cluster.bootstrap_timeout_seconds",
        raw.bootstrap_timeout_seconds.unwrap_or(600),
        1,
        86_400,
    )?;
    Ok(ClusterConfig {
        node,
        bootstrap,
        expert_listen,
        exchange_timeout: std::time::Duration::from_millis(u64::from(exchange_ms)),
        bootstrap_timeout: std::time::Duration::from_secs(u64::from(bootstrap_s)),
    })
}

fn job_config(check: &Checker<'_>, raw: RawJobConfig) -> Result<JobConfig, TopologyError> {
    let path = |field: &'static str, value: Option<String>| match value {
        Some(text) if text.trim().is_empty() => Err(check.invalid(field, "must not be empty")),
        other => Ok(other.map(PathBuf::from)),
    };
    let input_path = path("job.input_path", raw.input_path)?;
    let output_path = path("job.output_path", raw.output_path)?;
    if input_path.is_some() && input_path == output_path {
        return Err(check.invalid(
            "job.output_path",
            "must differ from job.input_path (the input would be overwritten)",
        ));
    }
    Ok(JobConfig {
        input_path,
        output_path,
    })
}
