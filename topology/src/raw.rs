//! The serde shape of a topology TOML file (`RawNodeConfig`). Every key is optional here;
//! `validate.rs` applies the documented defaults and all range and cross-field checks.
//! Unknown keys are rejected (`deny_unknown_fields`): a typo is an error, never a silent default.

use serde::{Deserialize, Serialize};

/// A whole topology file. Every section may be left out; its fields then take their defaults.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawNodeConfig {
    /// `[model]`: which checkpoint to load.
    #[serde(default)]
    pub model: RawModelConfig,
    /// `[device]`: backend and device counts.
    #[serde(default)]
    pub device: RawDeviceConfig,
    /// `[parallel]`: attention data parallelism, expert parallelism, context parallelism.
    #[serde(default)]
    pub parallel: RawParallelConfig,
    /// `[scheduler]`: per-rank batching budgets and async scheduling.
    #[serde(default)]
    pub scheduler: RawSchedulerConfig,
    /// `[sampling]`: request defaults.
    #[serde(default)]
    pub sampling: RawSamplingConfig,
    /// `[dspark]`: speculative decoding with confidence-scheduled verification.
    #[serde(default)]
    pub dspark: RawDSparkConfig,
    /// `[replay]`: decoder bounded replay (prefill truncation of the decoder layers).
    #[serde(default)]
    pub replay: RawReplayConfig,
    /// `[eplb]`: expert-parallel load balancing.
    #[serde(default)]
    pub eplb: RawEplbConfig,
    /// `[memory]`: the per-rank budget of the sequence-state pool.
    #[serde(default)]
    pub memory: RawMemoryConfig,
    /// `[prefix_cache]`: the per-rank cache of shared prompt prefixes.
    #[serde(default)]
    pub prefix_cache: RawPrefixCacheConfig,
    /// `[metrics]`: Prometheus exporter.
    #[serde(default)]
    pub metrics: RawMetricsConfig,
    /// `[job]`: default offline job paths.
    #[serde(default)]
    pub job: RawJobConfig,
    /// `[server]`: the OpenAI-compatible HTTP server (`deepinfer-node serve`).
    #[serde(default)]
    pub server: RawServerConfig,
    /// `[cluster]`: this process's place among the `deepinfer-node` processes of one deployment.
    #[serde(default)]
    pub cluster: RawClusterConfig,
}

/// `[model]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawModelConfig {
    /// `"demo"` (the built-in tiny random model), a local checkpoint directory (absolute, or
    /// starting with `./` or `../`, relative to the working directory), or a Hugging Face Hub
    /// id `owner/name`. Default: `"deepseek-ai/DeepSeek-V4.1-Flash-1017"`.
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub source: Option<String>,
    /// Hub revision (branch, tag or commit); only with a Hub id. Default: `"main"`.
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub revision: Option<String>,
    /// Routed experts per MoE layer (count). Optional: read from the checkpoint's
    /// `config.json` when absent; when given, placement checks run at load time. No default.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub routed_experts: Option<u16>,
    /// Sliding attention window (tokens, the current token included). Optional: read from
    /// `config.json` when absent; when given, the replay bound is checked at load time.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub sliding_window_tokens: Option<u32>,
}

/// `[device]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawDeviceConfig {
    /// `"cpu"` (reference backend, ranks are threads of one process) or `"cuda"`.
    /// Default: `"cpu"`.
    pub backend: Option<RawBackend>,
    /// GPU architecture, `"sm90"` (Hopper) or `"sm100"` (Blackwell); `cuda` only.
    /// Default: `"sm90"`.
    pub arch: Option<RawArch>,
    /// Nodes (hosts) in the deployment (count). Default: 1. Must be 1 with `cpu`.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub nodes: Option<u16>,
    /// GPUs used on each node (count); `cuda` only. Default: 1.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub gpus_per_node: Option<u16>,
    /// `"fast"` (tensor cores, judged by error bounds) or `"exact"` (bitwise equal to the CPU
    /// reference); `cuda` only. Default: `"fast"`.
    pub numerics: Option<RawNumerics>,
}

/// The backend named in `device.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", try_from = "String")]
pub enum RawBackend {
    /// The CPU reference backend.
    Cpu,
    /// NVIDIA GPUs through CUDA.
    Cuda,
}

/// The GPU architecture named in `device.arch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", try_from = "String")]
pub enum RawArch {
    /// Hopper (H100, H200).
    Sm90,
    /// Blackwell (B200, GB200, B300).
    Sm100,
}

/// The CUDA numerics named in `device.numerics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", try_from = "String")]
pub enum RawNumerics {
    /// Tensor cores, judged by error bounds.
    Fast,
    /// Bitwise equal to the CPU reference.
    Exact,
}

/// `[parallel]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawParallelConfig {
    /// Attention data-parallel ranks (count, one scheduler per rank). Default: 1. With `cuda`
    /// it must be a multiple of `device.nodes * device.gpus_per_node` (rank r on GPU
    /// `r % gpus_per_node` of its node: one rank per GPU, or several sharing each).
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub dp: Option<u16>,
    /// Expert-parallel ranks (count). Default: `parallel.dp`. With `cuda` it must equal
    /// `parallel.dp` (one EP rank per DP rank).
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub ep: Option<u16>,
    /// Context-parallel group size (ranks, >= 1): a long prefill chunk of a DP rank is computed by
    /// this many CP ranks (mirror split). 1 = off. Default: 1. CPU backend only for now.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub context_parallel: Option<u16>,
    /// Prefill chunks of at least this many tokens run context-parallel (tokens, >= 2 x
    /// `context_parallel`, at most `context_parallel x scheduler.prefill_chunk_tokens` and
    /// `scheduler.max_batched_tokens`).
    /// Default: `scheduler.prefill_chunk_tokens`.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub context_parallel_min_tokens: Option<u32>,
}

/// `[scheduler]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawSchedulerConfig {
    /// Tokens per step per rank, prefill and decode together (tokens). Default: 8192.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub max_batched_tokens: Option<u32>,
    /// Requests running at once per rank (count). Default: 256.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub max_running_requests: Option<u32>,
    /// Largest prefill chunk of one request in one step (tokens); at most
    /// `scheduler.max_batched_tokens`. Default: 2048.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub prefill_chunk_tokens: Option<u32>,
    /// Step plans in flight per rank (count, 1..=4): 1 = synchronous scheduling, 2 = plan step
    /// N+1 while step N runs. Default: 2.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub overlap_depth: Option<u8>,
    /// Requests admitted but not yet running, per node (count); beyond it a request fails
    /// with `Overloaded`. Default: 4096.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub admission_queue_capacity: Option<u32>,
}

/// `[sampling]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawSamplingConfig {
    /// Generated tokens per request when the request sets no limit (tokens). Default: 256.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub max_tokens: Option<u32>,
    /// Base seed for requests that give none; the noise of a request is a pure function of
    /// (seed, request, position). Default: 0.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub seed: Option<u64>,
    /// Thinking mode for chat requests that do not choose (no `thinking`, no
    /// `reasoning_effort`). Default: false (OpenAI clients expect no reasoning).
    #[serde(default, deserialize_with = "crate::strict::boolean")]
    pub thinking: Option<bool>,
}

/// `[dspark]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawDSparkConfig {
    /// Speculative decoding with the checkpoint's DSpark drafter (bool). Default: false.
    #[serde(default, deserialize_with = "crate::strict::boolean")]
    pub enabled: Option<bool>,
    /// Most draft tokens verified per request per step (tokens, 1..=16). Default: 5.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub max_draft_tokens: Option<u8>,
    /// Timed steps per batch size when profiling the steps-per-second table at engine start
    /// (steps). Default: 8.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub profile_steps: Option<u32>,
}

/// `[replay]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawReplayConfig {
    /// Prompt tail the decoder layers run on during prefill (tokens); 0 turns bounded replay
    /// off. Must be >= sliding window + `replay.max_backtracking`. Default: 140.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub decoder_keep_tokens: Option<u32>,
    /// Most positions a speculative rejection may rewind (tokens); at least
    /// `dspark.max_draft_tokens + 1` when DSpark is on. Default: 6.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub max_backtracking: Option<u32>,
}

/// `[eplb]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawEplbConfig {
    /// Rebalance the expert placement from measured load (bool). Default: false.
    #[serde(default, deserialize_with = "crate::strict::boolean")]
    pub enabled: Option<bool>,
    /// Load statistics window (steps). Default: 1000.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub window_steps: Option<u32>,
    /// Steps between two rebalances (steps). Default: 3000.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub rebalance_interval_steps: Option<u32>,
    /// Extra physical expert slots per MoE layer beyond the logical experts (count).
    /// `routed experts + redundant_experts` must be a multiple of `parallel.ep`. Default: 0.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub redundant_experts: Option<u16>,
    /// Expert groups for the hierarchical policy (count); hierarchical when it is a multiple
    /// of `device.nodes`, global otherwise. Default: 1 (V4.1 has no expert groups).
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub num_groups: Option<u16>,
}

/// `[memory]`. At most one of the two keys.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawMemoryConfig {
    /// Sequence-state pool of each DP rank (bytes, >= 1): admission, growth and preemption
    /// keep the live states' bytes at or below it. Default: none (the fraction applies).
    pub state_bytes_per_rank: Option<u64>,
    /// Share of the memory left after the weights that the state pools take (0 < f <= 1):
    /// the host's available memory (split evenly over the DP ranks) with `cpu`; with `cuda`
    /// each GPU's free memory once the weights of its ranks are resident (split evenly over
    /// the DP ranks on it); `memory-plan` applies it to the GPU's memory. Default: 0.9.
    pub state_memory_fraction: Option<f64>,
}

/// `[prefix_cache]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrefixCacheConfig {
    /// Bytes of cached prefix blocks per DP rank (compressed KV, index keys, Engram entries and
    /// their tokens), held where the rank's states live and taken out of the rank's `[memory]`
    /// budget; 0 turns the cache off. Needs decoder bounded replay
    /// (`replay.decoder_keep_tokens` > 0) and a V4.1 model. Default: 0.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub bytes_per_rank: Option<u64>,
    /// How many tokens a hit replays to rebuild the windows: `"bounded"` replays
    /// `replay.decoder_keep_tokens` (the `ReplayActor`'s rule; the rows after the hit drift as
    /// bounded replay's do), `"exact"` replays the encoder halo (bitwise a cold prefill, a
    /// longer replay: 2 674 tokens for V4.1-Flash). Default: `"bounded"`.
    pub replay: Option<RawPrefixReplay>,
}

/// The replay rule named in `prefix_cache.replay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", try_from = "String")]
pub enum RawPrefixReplay {
    /// `replay.decoder_keep_tokens` tokens (approximate).
    Bounded,
    /// The encoder halo (exact).
    Exact,
}

/// `[metrics]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetricsConfig {
    /// Loopback address (`127.0.0.1:9400`, `[::1]:9400`) serving `/metrics`; non-loopback
    /// addresses are refused. Default: none (no exporter).
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub prometheus_listen: Option<String>,
}

/// `[job]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawJobConfig {
    /// Default input JSONL file (OpenAI Batch lines or plain prompts). Default: none.
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub input_path: Option<String>,
    /// Default output JSONL file. Default: none.
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub output_path: Option<String>,
}

/// `[server]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerConfig {
    /// IP:port the HTTP server listens on (`--listen` overrides it). The server has no
    /// authentication: a non-loopback address exposes the model to that network.
    /// Default: `"127.0.0.1:8000"`.
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub listen: Option<String>,
    /// Largest accepted request body (bytes); larger bodies get 413. Default: 8388608 (8 MiB).
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub max_body_bytes: Option<u32>,
    /// After SIGTERM/SIGINT, how long in-flight requests may run before they are aborted
    /// (seconds). Default: 30.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub shutdown_timeout_seconds: Option<u32>,
}

/// `[cluster]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawClusterConfig {
    /// This process's node index (0..`device.nodes`); node `n` runs DP ranks and EP ranks
    /// `n * dp / nodes ..` and `n * ep / nodes ..` (contiguous blocks). Default: 0.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub node: Option<u16>,
    /// IP:port node 0 listens on while the nodes join, and the others connect to: set, the
    /// process runs one node of a deployment of `device.nodes` processes (needed to serve with
    /// `device.nodes > 1`; `--simulate` runs every node in one process without it). Only with
    /// `device.nodes > 1`.
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub bootstrap: Option<String>,
    /// IP:port this node listens on for the other nodes: its expert server on the CPU backend
    /// (they send it the rows of its EP ranks), its step counts with CUDA (they tell it how many
    /// collective steps their ranks began); port 0 picks a free port, which the bootstrap tells
    /// the others. Must be reachable from every node. Default: `"127.0.0.1:0"`.
    #[serde(default, deserialize_with = "crate::strict::text")]
    pub expert_listen: Option<String>,
    /// Longest wait of one exchange between nodes: one EP rank's answer for the rows of one
    /// layer (milliseconds, 1..=3600000). A peer that does not answer in time fails the step.
    /// Default: 30000.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub exchange_timeout_ms: Option<u32>,
    /// Longest wait for every node to join at start (seconds, 1..=86400; the nodes load their
    /// weights first). Default: 600.
    #[serde(default, deserialize_with = "crate::strict::uint")]
    pub bootstrap_timeout_seconds: Option<u32>,
}

/// The one of the two `choices` spelled `text`, else an error naming the `what` and both
/// spellings.
fn parse_choice<T: Copy>(what: &str, text: &str, choices: [(&str, T); 2]) -> Result<T, String> {
    let [(first, _), (second, _)] = choices;
    match choices.iter().find(|(name, _)| *name == text) {
        Some(&(_, choice)) => Ok(choice),
        None => Err(format!(
            "unknown {what} {text:?}, expected \"{first}\" or \"{second}\""
        )),
    }
}

impl TryFrom<String> for RawBackend {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        parse_choice("backend", &text, [("cpu", Self::Cpu), ("cuda", Self::Cuda)])
    }
}

impl TryFrom<String> for RawNumerics {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        parse_choice(
            "numerics",
            &text,
            [("fast", Self::Fast), ("exact", Self::Exact)],
        )
    }
}

impl TryFrom<String> for RawPrefixReplay {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        let choices = [("bounded", Self::Bounded), ("exact", Self::Exact)];
        parse_choice("prefix replay", &text, choices)
    }
}

impl TryFrom<String> for RawArch {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        let choices = [("sm90", Self::Sm90), ("sm100", Self::Sm100)];
        parse_choice("GPU architecture", &text, choices)
    }
}
