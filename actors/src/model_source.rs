//! Resolving the topology's `[model]` into a loaded model, its facts and its tokenizer.
//!
//! Order (ARCHITECTURE.md §5): `DEEPINFER_HF_MODEL_DIR`, else the topology's source. `demo`
//! builds the built-in demo model: the V4.1 tiny architecture (spec §9.1) widened to the real
//! DeepSeek vocabulary, with seeded random weights written by the model crate's
//! `write_random_checkpoint` into a temporary directory and loaded through the real loader, and
//! the shipped tokenizer. A Hub id is found in, or downloaded into, the Hugging Face cache by
//! [`crate::hub`]. Blocking: call it off the async workers.
//!
//! Backend (`[device] backend`): the model is loaded once on the host. With `"cpu"` every rank
//! runs it on the CPU backend; with `"cuda"` each DP rank runs the same host weights on a
//! `CudaBackend` of its GPU (rank r -> GPU `r % gpus_per_node` of its node), after a check that
//! this machine has the GPUs the topology needs and, once `config.json` is read and before any
//! weight loads, that the model fits the busiest GPU (the memory plan per GPU, one line logged:
//! the ranks on it, dense, their EP slots' experts, Engram whole, KV budget; a model that does
//! not fit fails naming the numbers). Expert parallelism on CUDA (`dp = ep > 1`,
//! `experts::device`, either family: V4.1's FP4/FP8 experts or the V4 family's exact ones):
//! each rank's backend is its EP rank, holding only its slots' experts, the ranks step in
//! `Lockstep` and live EPLB swaps placements by epoch; the ranks share one GPU (device copies)
//! or have one GPU each (NCCL, its library probed before anything loads), on one node or on
//! every node of a deployment of one process per node (`[cluster] bootstrap`: after loading,
//! the node joins the others, node 0 handing every node NCCL's unique id, and the nodes'
//! ranks form one communicator and keep one lockstep, `experts::cuda_layout::join_nodes`); other
//! layouts are refused naming the field.
//!
//! Family (`model_type` in `config.json`): a V4.1 checkpoint and a V4-family one (V4-Flash,
//! V4-Flash-0731) both run on `ModelExecutor`s, on either backend, and both run expert
//! parallelism with live EPLB on the CPU (`ExpertParallelFactory`; across nodes each node loads
//! only its EP ranks' routed experts, either family) and on CUDA ranks (above). What a V4
//! checkpoint lacks is refused before its weights load, naming the field (`dspark.enabled`
//! unless the checkpoint has a DSpark drafter), except decoder bounded replay
//! (`replay.decoder_keep_tokens`, on by default), which V4 models simply run without (exact:
//! the full prefill).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deepinfer_model::any_model::AnyModel;
use deepinfer_model::checkpoint;
use deepinfer_model::checkpoint::ExpertFilter;
use deepinfer_model::config::{ModelConfig, ModelFamily};
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::memory_plan::{GpuMemoryPlan, plan_node};
use deepinfer_topology::{Backend as DeviceBackend, ModelSource, NodeConfig};

use crate::engine::{EngineConfig, ModelFacts};
use crate::engram_vocab::{CompressedTokenMap, compressed_token_map};
use crate::error::EngineError;
use crate::experts::cuda_layout::{
    RankLinks, check_cuda_expert_parallel, cuda_fingerprint, join_nodes, rank_links,
    starting_placement,
};
use crate::experts::device::DeviceExperts;
use crate::experts::factory::ExpertParallelFactory;
use crate::experts::parallel::{EpSettings, node_expert_filter, node_holdings};
use crate::frontend::codec::load_v41_tokenizer;
use crate::gpu;
use crate::hub::{HubOptions, resolve_hub_checkpoint};
use crate::openai::ServedModel;
use crate::rank::context_parallel::ContextParallelFactory;
use crate::rank::executor::ExecutorFactory;
use crate::rank::factory::{ModelFactory, RankDevices};

/// Environment variable naming a local checkpoint directory (overrides the topology).
pub const MODEL_DIR_ENV: &str = "DEEPINFER_HF_MODEL_DIR";
/// Seed of the demo model's random weights.
pub const DEMO_SEED: u64 = 41;
/// The shipped tokenizer, relative to the repository root.
pub const SHIPPED_TOKENIZER: &str = "configs/tokenizer/tokenizer.json";

/// A model ready for `EngineConfig`.
pub struct ResolvedModel {
    pub factory: Arc<dyn ExecutorFactory>,
    /// The loaded model `factory` runs.
    pub model: AnyModel,
    pub facts: ModelFacts,
    pub tokenizer: PathBuf,
    /// Lines to show the user (the demo's random-weights notice; what a node of several holds).
    pub notice: Option<String>,
    /// The model name reported in outputs.
    pub name: String,
}

impl ResolvedModel {
    /// The engine configuration that runs this model on `node`, and the model as both front
    /// ends (offline job, HTTP server) serve it: its name, family and context, thinking mode by
    /// the topology's `[sampling] thinking`.
    pub fn engine_config(self, node: NodeConfig) -> (EngineConfig, ServedModel) {
        let served = ServedModel {
            name: self.name,
            family: self.factory.family(),
            context_tokens: self.facts.max_context_tokens,
            thinking_by_default: node.sampling.thinking,
        };
        let config = EngineConfig {
            node,
            executor: self.factory,
            model: self.facts,
            tokenizer: Some(self.tokenizer),
        };
        (config, served)
    }
}

fn model_error(what: &str, message: impl std::fmt::Display) -> EngineError {
    EngineError::Model {
        what: what.to_string(),
        message: message.to_string(),
    }
}

/// The shipped tokenizer: `./configs/...` from the working directory, else next to the sources.
pub fn shipped_tokenizer() -> PathBuf {
    let local = PathBuf::from(SHIPPED_TOKENIZER);
    if local.is_file() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(SHIPPED_TOKENIZER)
}

/// The Engram compressed vocabulary of `tokenizer` for `cfg` (None without Engram); `known` is
/// a map already computed for that tokenizer.
fn engram_vocab(
    cfg: &ModelConfig,
    tokenizer: &Path,
    known: Option<CompressedTokenMap>,
) -> Result<Option<CompressedVocab>, EngineError> {
    let Some(engram) = &cfg.engram else {
        return Ok(None);
    };
    let map = match known {
        Some(map) => map,
        None => compressed_token_map(&load_v41_tokenizer(tokenizer)?)
            .map_err(|e| model_error("engram vocabulary", e))?,
    };
    map.into_engram_vocab(engram)
        .map(Some)
        .map_err(|e| model_error("engram vocabulary", e))
}

/// Refuses, for a V4-family checkpoint, what the topology `node` asks for that only V4.1 runs,
/// naming the field; decoder bounded replay is not refused (it is on by default) but left off.
pub fn check_v4_features(node: &NodeConfig, cfg: &ModelConfig) -> Result<(), EngineError> {
    let has_drafter = cfg.dspark.as_ref().is_some_and(|d| d.n_stages > 0);
    if node.dspark.enabled && !has_drafter {
        return Err(EngineError::Config {
            field: "dspark.enabled".to_string(),
            message: format!(
                "{}: this V4-family checkpoint has no DSpark drafter (V4-Flash's MTP block does \
                 not draft in this runtime); set dspark.enabled = false",
                node.origin
            ),
        });
    }
    if node.replay.decoder_keep_tokens.is_some() {
        tracing::info!(
            "replay.decoder_keep_tokens: V4-family models have no decoder bounded replay; \
             prompts run the full prefill"
        );
    }
    Ok(())
}

/// Loads the checkpoint in `dir` as the family its config names; `node` (when given) is checked
/// for features that family lacks before the weights load.
fn load_dir(
    dir: &Path,
    node: Option<&NodeConfig>,
    name: String,
    notice: Option<String>,
    known: Option<CompressedTokenMap>,
) -> Result<ResolvedModel, EngineError> {
    let what = dir.display().to_string();
    let cfg =
        ModelConfig::from_file(&dir.join("config.json")).map_err(|e| model_error(&what, e))?;
    if let Some(node) = node
        && node.device.backend != DeviceBackend::Cpu
    {
        let gpu_bytes = gpu::device_memory(0).map_err(|message| EngineError::Config {
            field: "device".to_string(),
            message,
        })?;
        let plan = check_memory(node, &cfg, gpu_bytes)?;
        tracing::info!(model = %what, "{plan}");
    }
    let own = dir.join("tokenizer.json");
    let tokenizer = if own.is_file() {
        own
    } else {
        shipped_tokenizer()
    };
    if let Some(node) = node
        && cfg.family == ModelFamily::V4
    {
        check_v4_features(node, &cfg)?;
    }
    let vocab = engram_vocab(&cfg, &tokenizer, known)?;
    // One node of several loads only its EP ranks' routed experts.
    let experts = match node.filter(|n| n.cluster.bootstrap.is_some() && EpSettings::is_needed(n)) {
        Some(node) => node_expert_filter(node, cfg.n_layers, cfg.n_routed_experts)
            .map_err(|e| model_error("expert parallelism", e))?,
        None => ExpertFilter::all(),
    };
    let model = AnyModel::load_experts(dir, vocab, &experts).map_err(|e| model_error(&what, e))?;
    let family = match cfg.family {
        ModelFamily::V41 => "V4.1",
        ModelFamily::V4 => "V4",
    };
    tracing::info!(model = %what, "{family} model loaded");
    let notice = match node.filter(|_| !experts.is_all()) {
        Some(node) => Some(
            notice
                .into_iter()
                .chain([node_holdings(node, &model)])
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        None => notice,
    };
    Ok(ResolvedModel {
        factory: Arc::new(ModelFactory::new(
            model.clone(),
            format!("{family} model from {what} on the CPU backend"),
        )),
        facts: ModelFacts::of(model.config()),
        model,
        tokenizer,
        notice,
        name,
    })
}

/// The memory plan of the busiest GPU (of `gpu_bytes`) of `node` over `cfg`'s model
/// (`memory_plan::plan_node`: the ranks on it, their EP slots); a model that does not fit is a
/// `device` config error naming the numbers.
pub fn check_memory(
    node: &NodeConfig,
    cfg: &ModelConfig,
    gpu_bytes: u64,
) -> Result<GpuMemoryPlan, EngineError> {
    plan_node(node, cfg, gpu_bytes).map_err(|e| EngineError::Config {
        field: "device".to_string(),
        message: format!(
            "{}: {e} (parallel.dp = parallel.ep = {}, device.gpus_per_node = {})",
            node.origin, node.parallel.ep, node.device.gpus_per_node
        ),
    })
}

/// The demo model's config: tiny V4.1 with the DeepSeek vocabulary.
pub fn demo_config(compressed_vocab_size: usize) -> ModelConfig {
    let mut cfg = ModelConfig::tiny_v41();
    cfg.vocab_size = 129_280;
    cfg.bos_token_id = 0;
    cfg.eos_token_id = 1;
    // Room for a chat prompt that embeds a JSON schema plus its answer (tiny_v41 has 256).
    cfg.max_position_embeddings = 1024;
    if let Some(engram) = cfg.engram.as_mut() {
        engram.compressed_vocab_size = compressed_vocab_size;
    }
    cfg
}

/// Writes the demo checkpoint into `dir` and loads it.
pub fn build_demo(dir: &Path) -> Result<ResolvedModel, EngineError> {
    demo_for(dir, None)
}

/// [`build_demo`] for `node` (when given: one node of several loads only its EP ranks' routed
/// experts, as from any checkpoint directory).
fn demo_for(dir: &Path, node: Option<&NodeConfig>) -> Result<ResolvedModel, EngineError> {
    let tokenizer = shipped_tokenizer();
    let tok = load_v41_tokenizer(&tokenizer)?;
    let map = compressed_token_map(&tok).map_err(|e| model_error("engram vocabulary", e))?;
    let cfg = demo_config(map.size);
    checkpoint::write_random_checkpoint(&cfg, DEMO_SEED, dir, 2)
        .map_err(|e| model_error("demo checkpoint", e))?;
    load_dir(
        dir,
        node,
        "deepinfer-demo".to_string(),
        Some(
            "note: the built-in demo model has random weights (seeded); its text is meaningless"
                .to_string(),
        ),
        Some(map),
    )
}

/// Resolves the model of `node` (see the module doc), with the Hub settings of the environment.
pub fn resolve(node: &NodeConfig) -> Result<ResolvedModel, EngineError> {
    let hub = HubOptions::from_env().map_err(|e| model_error("Hugging Face Hub", e))?;
    resolve_with(node, &hub)
}

/// [`resolve`] with explicit Hub settings.
pub fn resolve_with(node: &NodeConfig, hub: &HubOptions) -> Result<ResolvedModel, EngineError> {
    check_nodes(node)?;
    check_devices(node)?;
    resolve_source(node, hub).and_then(|resolved| on_node(node, resolved))
}

/// A loaded model's ranks as `node` lays them out: on its devices (each rank's EP rank on CUDA),
/// with expert parallelism on the CPU, with context parallelism.
pub fn on_node(node: &NodeConfig, resolved: ResolvedModel) -> Result<ResolvedModel, EngineError> {
    on_node_devices(node, resolved)
        .and_then(|resolved| with_expert_parallel(node, resolved))
        .and_then(|resolved| with_context_parallel(node, resolved))
}

/// Before any loading: a topology over several nodes is one node of a deployment of one process
/// per node (`[cluster] bootstrap`; `--simulate` runs every node in one process and does not
/// come here). Which CUDA layouts run over several nodes is `check_devices`'.
fn check_nodes(node: &NodeConfig) -> Result<(), EngineError> {
    let nodes = node.device.nodes;
    let refuse = |field: &str, message: String| {
        Err(EngineError::Config {
            field: field.to_string(),
            message: format!("{}: {message}", node.origin),
        })
    };
    if nodes == 1 {
        return Ok(());
    }
    if node.cluster.bootstrap.is_none() {
        return refuse(
            "cluster.bootstrap",
            format!(
                "device.nodes = {nodes} runs one deepinfer-node per node, joined through node 0's \
                 address: set [cluster] bootstrap and node (--simulate runs every node here)"
            ),
        );
    }
    Ok(())
}

/// Before any loading: the GPUs of a CUDA topology exist here, it asks for no expert
/// parallelism the CUDA path does not run (`experts::device`), and EP ranks on several GPUs
/// find the NCCL library.
fn check_devices(node: &NodeConfig) -> Result<(), EngineError> {
    if node.device.backend == DeviceBackend::Cpu {
        return Ok(());
    }
    check_cuda_expert_parallel(node)?;
    gpu::check_node(node).map_err(|e| EngineError::Config {
        field: "device".to_string(),
        message: e.to_string(),
    })?;
    if rank_links(node) == Some(RankLinks::Nccl) {
        gpu::nccl_available().map_err(|reason| nccl_missing(node, &reason))?;
    }
    Ok(())
}

/// The NCCL library did not load (`reason`) for `node`'s EP ranks on several GPUs (of one
/// node, or of several).
fn nccl_missing(node: &NodeConfig, reason: &str) -> EngineError {
    let (ep, nodes, gpus) = (
        node.parallel.ep,
        node.device.nodes,
        node.device.gpus_per_node,
    );
    let (field, layout) = if nodes > 1 {
        (
            "device.nodes",
            format!("device.nodes = {nodes} x device.gpus_per_node = {gpus} GPUs"),
        )
    } else {
        (
            "device.gpus_per_node",
            format!("device.gpus_per_node = {gpus} GPUs"),
        )
    };
    EngineError::Config {
        field: field.to_string(),
        message: format!(
            "{}: {ep} EP ranks on {layout} move rows through NCCL: {reason}",
            node.origin
        ),
    }
}

/// With `[device] backend = "cuda"`: each rank runs the loaded weights on its own GPU, in the
/// topology's `[device] numerics`; with `ep > 1` each rank's backend is its EP rank of the
/// starting placement.
fn on_node_devices(
    node: &NodeConfig,
    mut resolved: ResolvedModel,
) -> Result<ResolvedModel, EngineError> {
    let numerics = match node.device.backend {
        DeviceBackend::Cuda { numerics, .. } => numerics,
        DeviceBackend::Cpu => return Ok(resolved),
    };
    let per_node = usize::from(node.device.gpus_per_node);
    let family = match &resolved.model {
        AnyModel::V41(_) => "V4.1",
        AnyModel::V4(_) => "V4",
    };
    let placement = format!("on the CUDA backend (DP rank r on GPU r % {per_node} of its node)");
    let mut devices = RankDevices {
        per_node,
        open: Arc::new(move |_dp, ordinal| gpu::open_cuda_backend(ordinal, numerics)),
        experts: None,
    };
    let mut experts = String::new();
    if let Some(links) = rank_links(node) {
        check_cuda_expert_parallel(node)?;
        let model = &resolved.model;
        let ranks = usize::from(node.parallel.ep);
        let local = usize::from(node.dp_on_node());
        let starting = starting_placement(node, model.config())?;
        // One node of several: join the others (blocks until all did) before any rank opens.
        let nodes = match node.cluster.bootstrap {
            Some(_) => Some(
                join_nodes(node, cuda_fingerprint(node, model), &gpu::nccl_unique_id)
                    .map_err(|e| model_error("expert parallelism across nodes", e))?,
            ),
            None => None,
        };
        let which = match &nodes {
            Some(joined) => format!(
                "EP ranks {}..{} of {ranks} (node {} of {})",
                joined.first_rank,
                joined.first_rank + local,
                node.cluster.node,
                node.device.nodes
            ),
            None => format!("EP rank of {ranks}"),
        };
        experts = format!(
            ", each its {which} ({} expert slots per layer on each, rows moved by {}, EPLB {})",
            starting.slots_per_gpu,
            match links {
                RankLinks::SharedDevice => "device copies",
                RankLinks::Nccl => "NCCL",
            },
            if node.eplb.enabled { "on" } else { "off" }
        );
        let group = match &nodes {
            Some(joined) => {
                DeviceExperts::across_nodes(node, local, starting.clone(), joined.peers.clone())
            }
            None => Arc::new(DeviceExperts::new(node, local, starting.clone())),
        };
        devices.open = gpu::cuda_expert_ranks(
            model.clone(),
            numerics,
            starting,
            group.clone(),
            links,
            nodes.as_ref(),
            node.cluster.exchange_timeout,
            node.cluster.bootstrap_timeout,
        );
        devices.experts = Some(group);
    }
    resolved.factory = Arc::new(ModelFactory::per_device(
        resolved.model.clone(),
        format!("{family} model {} {placement}{experts}", resolved.name),
        devices,
    ));
    Ok(resolved)
}

/// Expert parallelism when the topology asks for it (`[parallel] ep > 1` or `[eplb] enabled`):
/// the ranks' routed experts (either family's) then run through an `ExpertParallelFactory`.
fn with_expert_parallel(
    node: &NodeConfig,
    mut resolved: ResolvedModel,
) -> Result<ResolvedModel, EngineError> {
    // On CUDA the ranks' backends are the EP ranks (`on_node_devices`).
    if !EpSettings::is_needed(node) || node.device.backend != DeviceBackend::Cpu {
        return Ok(resolved);
    }
    let model = resolved.model.clone();
    let factory = ExpertParallelFactory::new(model, node, resolved.factory.describe())
        .map_err(|e| model_error("expert parallelism", e))?;
    resolved.factory = Arc::new(factory);
    Ok(resolved)
}

/// Context parallelism when the topology asks for it (`[parallel] context_parallel > 1`): the
/// ranks then run through a `ContextParallelFactory` (with the expert parallelism set up before).
fn with_context_parallel(
    node: &NodeConfig,
    mut resolved: ResolvedModel,
) -> Result<ResolvedModel, EngineError> {
    let Some(cp) = node.parallel.context_parallel else {
        return Ok(resolved);
    };
    let AnyModel::V41(model) = &resolved.model else {
        return Err(EngineError::Config {
            field: "parallel.context_parallel".to_string(),
            message: format!(
                "{}: context parallelism runs the V4.1 family only (the model is {}); use 1",
                node.origin, resolved.name
            ),
        });
    };
    resolved.factory = Arc::new(ContextParallelFactory {
        model: model.clone(),
        cp,
        experts: resolved.factory.expert_parallel(),
        description: resolved.factory.describe(),
    });
    Ok(resolved)
}

fn resolve_source(node: &NodeConfig, hub: &HubOptions) -> Result<ResolvedModel, EngineError> {
    if let Some(dir) = std::env::var_os(MODEL_DIR_ENV) {
        let dir = PathBuf::from(dir);
        let name = dir
            .file_name()
            .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned());
        return load_dir(&dir, Some(node), name, None, None);
    }
    match &node.model.source {
        ModelSource::LocalDir(dir) => {
            let name = dir
                .file_name()
                .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned());
            load_dir(dir, Some(node), name, None, None)
        }
        ModelSource::Demo => {
            let dir = std::env::temp_dir().join(format!(
                "deepinfer-demo-{}-{}",
                DEMO_SEED,
                std::process::id()
            ));
            std::fs::create_dir_all(&dir)
                .map_err(|e| model_error(&dir.display().to_string(), e))?;
            let resolved = demo_for(&dir, Some(node));
            let _ = std::fs::remove_dir_all(&dir);
            resolved
        }
        ModelSource::Hub { repo_id, revision } => {
            let revision = if revision.is_empty() {
                "main"
            } else {
                revision.as_str()
            };
            let dir = resolve_hub_checkpoint(repo_id, revision, hub)
                .map_err(|e| model_error(&format!("{repo_id}@{revision}"), e))?;
            load_dir(&dir, Some(node), repo_id.clone(), None, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(source: &str) -> NodeConfig {
        let text = format!("[model]\nsource = \"{source}\"\n[device]\nbackend = \"cpu\"\n");
        NodeConfig::from_toml_str(&text, "model source test").unwrap()
    }

    /// Several nodes serve only as one node of a deployment (a bootstrap address), on either
    /// backend (live EPLB included on the CPU; which CUDA layouts run is
    /// `experts::device`'s): refused before anything loads, naming the field.
    #[test]
    fn several_nodes_need_a_bootstrap() {
        let topology = |extra: &str| {
            let text = format!(
                "[model]\nsource = \"demo\"\n[device]\nnodes = 2\n[parallel]\ndp = 2\nep = 2\n{extra}"
            );
            NodeConfig::from_toml_str(&text, "nodes test").unwrap()
        };
        let field = |node: &NodeConfig| match check_nodes(node) {
            Err(EngineError::Config { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(field(&topology("")), "cluster.bootstrap");
        let joined = "[cluster]\nbootstrap = \"127.0.0.1:29500\"\n";
        assert!(check_nodes(&topology(joined)).is_ok());
        assert!(check_nodes(&topology(&format!("[eplb]\nenabled = true\n{joined}"))).is_ok());
        let cuda = |cluster: &str| {
            let text = format!(
                "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\nnodes = 2\n\
                 [parallel]\ndp = 2\nep = 2\n{cluster}"
            );
            NodeConfig::from_toml_str(&text, "nodes test").unwrap()
        };
        assert!(check_nodes(&cuda(joined)).is_ok());
        assert_eq!(field(&cuda("")), "cluster.bootstrap");
    }

    #[test]
    fn unusable_sources_are_clear_errors() {
        if std::env::var_os(MODEL_DIR_ENV).is_some() {
            return; // the override would win; nothing to check here
        }
        let err = resolve(&node("/nonexistent/checkpoint")).err().unwrap();
        assert_eq!(err.code(), "model");
        assert!(err.to_string().contains("/nonexistent/checkpoint"), "{err}");

        // A Hub id that is not in the cache, offline: a clear error, and no network access.
        let cache = tempfile::tempdir().unwrap();
        let offline = HubOptions {
            endpoint: "http://127.0.0.1:9".to_string(),
            cache_dir: cache.path().to_path_buf(),
            offline: true,
            progress: false,
        };
        let err = resolve_with(&node("deepseek-ai/DeepSeek-V4.1-Flash-1017"), &offline)
            .err()
            .unwrap();
        assert_eq!(err.code(), "model");
        let message = err.to_string();
        assert!(
            message.contains("deepseek-ai/DeepSeek-V4.1-Flash-1017"),
            "{message}"
        );
        assert!(message.contains(MODEL_DIR_ENV), "{message}");
    }

    /// The real V4.1-Flash does not fit one H200 (the error names the numbers and the layout);
    /// the tiny model does, with the rest of the GPU as its KV budget.
    #[test]
    fn a_model_that_does_not_fit_its_gpu_fails_naming_the_numbers() {
        let node = NodeConfig::from_toml_str(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\n",
            "memory test topology",
        )
        .unwrap();
        let h200 = 143_771u64 << 20;
        let real = ModelConfig::from_file(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/data/deepseek-v4.1-flash.config.json"),
        )
        .unwrap();
        let err = check_memory(&node, &real, h200).unwrap_err();
        assert_eq!(err.code(), "config");
        let message = err.to_string();
        for part in [
            "memory test topology",
            "GPU of 140.40 GiB",
            "experts 268.9",
            "384 slots of 384",
            "Engram 188.8",
            "short",
            "parallel.dp = parallel.ep = 1",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
        let plan = check_memory(&node, &ModelConfig::tiny_v41(), h200).unwrap();
        assert!(plan.kv_budget > h200 - (5 << 30), "{plan}");
        assert!(plan.to_string().contains("KV budget"), "{plan}");
    }

    /// The shipped two-GPU topology (one EP rank per GPU): the plan checked at start is one
    /// GPU's, holding one rank and half of every layer's experts.
    #[test]
    fn the_two_gpu_memory_plan_holds_half_the_experts_per_gpu() {
        let two = NodeConfig::from_file(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/h200x2.toml"),
        )
        .unwrap();
        let one = NodeConfig::from_toml_str(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\n",
            "one gpu",
        )
        .unwrap();
        let cfg = ModelConfig::from_file(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/data/deepseek-v4-flash.config.json"),
        )
        .unwrap();
        let huge = u64::MAX / 4;
        let (split, whole) = (
            check_memory(&two, &cfg, huge).unwrap(),
            check_memory(&one, &cfg, huge).unwrap(),
        );
        assert_eq!(
            (split.ranks, split.slots),
            (1, cfg.n_routed_experts / 2),
            "{split}"
        );
        assert_eq!(split.experts * 2, whole.experts, "{split} / {whole}");
        assert_eq!(split.dense, whole.dense);
        assert!(
            split.to_string().contains(&format!(
                "({} slots of {} per layer)",
                cfg.n_routed_experts / 2,
                cfg.n_routed_experts
            )),
            "{split}"
        );
    }

    /// EP ranks on two GPUs, or on the GPUs of two nodes, without the NCCL library (this
    /// machine: no CUDA, or no libnccl): the error names the field, the layout and the library.
    #[test]
    fn a_missing_nccl_library_names_the_field_and_the_library() {
        let Err(reason) = gpu::nccl_available() else {
            return; // libnccl loads here: nothing to refuse
        };
        let node = NodeConfig::from_toml_str(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\ngpus_per_node = 2\n\
             [parallel]\ndp = 2\nep = 2\n",
            "nccl test topology",
        )
        .unwrap();
        let err = nccl_missing(&node, &reason);
        assert_eq!(err.code(), "config");
        let message = err.to_string();
        for part in [
            "device.gpus_per_node",
            "nccl test topology: 2 EP ranks on device.gpus_per_node = 2 GPUs move rows through NCCL",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
        assert!(
            message.contains("libnccl.so") || message.contains("no CUDA support"),
            "{message}"
        );
        let nodes = NodeConfig::from_toml_str(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\nnodes = 2\n\
             gpus_per_node = 2\n[parallel]\ndp = 4\nep = 4\n\
             [cluster]\nbootstrap = \"127.0.0.1:29500\"\n",
            "nccl test topology",
        )
        .unwrap();
        match nccl_missing(&nodes, &reason) {
            EngineError::Config { field, message } => {
                assert_eq!(field, "device.nodes");
                assert!(
                    message.contains(
                        "nccl test topology: 4 EP ranks on device.nodes = 2 x \
                         device.gpus_per_node = 2 GPUs move rows through NCCL"
                    ),
                    "{message}"
                );
            }
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn demo_config_uses_the_deepseek_vocabulary() {
        let cfg = demo_config(99_092);
        assert_eq!(
            (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id),
            (129_280, 0, 1)
        );
        assert_eq!(
            cfg.engram.as_ref().map(|e| e.compressed_vocab_size),
            Some(99_092)
        );
        assert!(shipped_tokenizer().is_file());
    }
}
