//! Resolving the topology's `[model]` into a loaded model, its facts and its tokenizer.
//!
//! Order (ARCHITECTURE.md §5): `DEEPINFER_HF_MODEL_DIR`, else the topology's source. `demo`
//! builds the built-in demo model: the V4.1 tiny architecture (spec §9.1) widened to the real
//! DeepSeek vocabulary, with seeded random weights written by the model crate's
//! `write_random_checkpoint` into a temporary directory and loaded through the real loader, and
//! the shipped tokenizer. A Hub id is fetched through `hf-hub` into the Hugging Face cache
//! (`HF_ENDPOINT` and `HF_HOME` respected). Blocking: call it off the async workers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{Model, checkpoint};
use deepinfer_topology::{ModelSource, NodeConfig};

use crate::engine::ModelFacts;
use crate::engram_vocab::{CompressedTokenMap, compressed_token_map};
use crate::error::EngineError;
use crate::frontend::codec::load_v41_tokenizer;
use crate::rank::executor::ExecutorFactory;
use crate::rank::model_executor::ModelFactory;

/// Environment variable naming a local checkpoint directory (overrides the topology).
pub const MODEL_DIR_ENV: &str = "DEEPINFER_HF_MODEL_DIR";
/// Seed of the demo model's random weights.
pub const DEMO_SEED: u64 = 41;
/// The shipped tokenizer, relative to the repository root.
pub const SHIPPED_TOKENIZER: &str = "configs/tokenizer/tokenizer.json";

/// A model ready for `EngineConfig`.
pub struct ResolvedModel {
    pub factory: Arc<dyn ExecutorFactory>,
    pub facts: ModelFacts,
    pub tokenizer: PathBuf,
    /// A line to show the user (the demo's random-weights notice).
    pub notice: Option<String>,
    /// The model name reported in outputs.
    pub name: String,
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

fn facts(cfg: &ModelConfig) -> ModelFacts {
    ModelFacts {
        vocab_size: cfg.vocab_size,
        bos_token_id: cfg.bos_token_id,
        eos_token_id: Some(cfg.eos_token_id),
        max_context_tokens: cfg.max_position_embeddings,
    }
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
    let map = map
        .expect_size(engram.compressed_vocab_size)
        .map_err(|e| model_error("engram vocabulary", e))?;
    let pad = map
        .ids
        .get(engram.pad_token_id as usize)
        .copied()
        .ok_or_else(|| {
            model_error(
                "engram vocabulary",
                format!("pad token {} is outside the tokenizer", engram.pad_token_id),
            )
        })?;
    Ok(Some(CompressedVocab { ids: map.ids, pad }))
}

fn load_dir(
    dir: &Path,
    name: String,
    notice: Option<String>,
    known: Option<CompressedTokenMap>,
) -> Result<ResolvedModel, EngineError> {
    let what = dir.display().to_string();
    let cfg =
        ModelConfig::from_file(&dir.join("config.json")).map_err(|e| model_error(&what, e))?;
    let own = dir.join("tokenizer.json");
    let tokenizer = if own.is_file() {
        own
    } else {
        shipped_tokenizer()
    };
    let vocab = engram_vocab(&cfg, &tokenizer, known)?;
    let model = Model::load_with_vocab(dir, vocab).map_err(|e| model_error(&what, e))?;
    tracing::info!(model = %what, "model loaded");
    let facts = facts(model.config());
    let description = format!("V4.1 model from {what} on the CPU backend");
    Ok(ResolvedModel {
        factory: Arc::new(ModelFactory {
            model: Arc::new(model),
            description,
        }),
        facts,
        tokenizer,
        notice,
        name,
    })
}

/// The demo model's config: tiny V4.1 with the DeepSeek vocabulary.
pub fn demo_config(compressed_vocab_size: usize) -> ModelConfig {
    let mut cfg = ModelConfig::tiny_v41();
    cfg.vocab_size = 129_280;
    cfg.bos_token_id = 0;
    cfg.eos_token_id = 1;
    if let Some(engram) = cfg.engram.as_mut() {
        engram.compressed_vocab_size = compressed_vocab_size;
    }
    cfg
}

/// Writes the demo checkpoint into `dir` and loads it.
pub fn build_demo(dir: &Path) -> Result<ResolvedModel, EngineError> {
    let tokenizer = shipped_tokenizer();
    let tok = load_v41_tokenizer(&tokenizer)?;
    let map = compressed_token_map(&tok).map_err(|e| model_error("engram vocabulary", e))?;
    let cfg = demo_config(map.size);
    checkpoint::write_random_checkpoint(&cfg, DEMO_SEED, dir, 2)
        .map_err(|e| model_error("demo checkpoint", e))?;
    load_dir(
        dir,
        "deepinfer-demo".to_string(),
        Some(
            "note: the built-in demo model has random weights (seeded); its text is meaningless"
                .to_string(),
        ),
        Some(map),
    )
}

/// Where to fetch Hub checkpoints from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubAccess {
    /// Base URL (`https://huggingface.co`, or `HF_ENDPOINT`).
    pub endpoint: Option<String>,
    /// The Hugging Face cache directory; `None` = the default (`HF_HOME`).
    pub cache_dir: Option<PathBuf>,
    /// Show a progress bar per file.
    pub progress: bool,
}

impl HubAccess {
    /// From the environment (`HF_ENDPOINT`, `HF_HOME`); progress when stderr is a terminal.
    pub fn from_env() -> Self {
        use std::io::IsTerminal;
        HubAccess {
            endpoint: std::env::var("HF_ENDPOINT").ok(),
            cache_dir: None,
            progress: std::io::stderr().is_terminal(),
        }
    }
}

/// Downloads (or finds in the cache) a checkpoint: `config.json`, the safetensors index and
/// every shard it names (or the single `model.safetensors`), and `tokenizer.json` when the
/// repository has one. Returns the snapshot directory.
pub fn download_hub(
    repo_id: &str,
    revision: &str,
    access: &HubAccess,
) -> Result<PathBuf, EngineError> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Cache, Repo, RepoType};
    let what = format!("{repo_id}@{revision}");
    let mut builder = match &access.cache_dir {
        Some(dir) => ApiBuilder::from_cache(Cache::new(dir.clone())),
        None => ApiBuilder::from_env(),
    };
    if let Some(endpoint) = &access.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let api = builder
        .with_progress(access.progress)
        .build()
        .map_err(|e| model_error(&what, e))?;
    let repo = api.repo(Repo::with_revision(
        repo_id.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let fetch = |file: &str| {
        repo.get(file)
            .map_err(|e| model_error(&what, format!("{file}: {e}")))
    };
    let config = fetch("config.json")?;
    let Some(snapshot) = config.parent().map(Path::to_path_buf) else {
        return Err(model_error(
            &what,
            "the cache returned a path without a directory",
        ));
    };
    match repo.get("model.safetensors.index.json") {
        Ok(index_path) => {
            let text = std::fs::read_to_string(&index_path).map_err(|e| model_error(&what, e))?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| model_error(&what, format!("index: {e}")))?;
            let Some(map) = index
                .get("weight_map")
                .and_then(serde_json::Value::as_object)
            else {
                return Err(model_error(
                    &what,
                    "model.safetensors.index.json has no `weight_map`",
                ));
            };
            let shards: std::collections::BTreeSet<&str> =
                map.values().filter_map(serde_json::Value::as_str).collect();
            for shard in shards {
                if shard.contains('/') || shard.contains("..") || !shard.ends_with(".safetensors") {
                    return Err(model_error(
                        &what,
                        format!("suspicious shard name {shard:?} in the index"),
                    ));
                }
                fetch(shard)?;
            }
        }
        Err(_) => {
            fetch("model.safetensors")?;
        }
    }
    // Optional: the shipped tokenizer is used when the repository has none.
    let _ = repo.get("tokenizer.json");
    Ok(snapshot)
}

/// Resolves the model of `node` (see the module doc).
pub fn resolve(node: &NodeConfig) -> Result<ResolvedModel, EngineError> {
    if let Some(dir) = std::env::var_os(MODEL_DIR_ENV) {
        let dir = PathBuf::from(dir);
        let name = dir
            .file_name()
            .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned());
        return load_dir(&dir, name, None, None);
    }
    match &node.model.source {
        ModelSource::LocalDir(dir) => {
            let name = dir
                .file_name()
                .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned());
            load_dir(dir, name, None, None)
        }
        ModelSource::Demo => {
            let dir = std::env::temp_dir().join(format!(
                "deepinfer-demo-{}-{}",
                DEMO_SEED,
                std::process::id()
            ));
            std::fs::create_dir_all(&dir)
                .map_err(|e| model_error(&dir.display().to_string(), e))?;
            let resolved = build_demo(&dir);
            let _ = std::fs::remove_dir_all(&dir);
            resolved
        }
        ModelSource::Hub { repo_id, revision } => {
            let revision = if revision.is_empty() {
                "main"
            } else {
                revision.as_str()
            };
            let dir = download_hub(repo_id, revision, &HubAccess::from_env())?;
            load_dir(&dir, repo_id.clone(), None, None)
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

    #[test]
    fn unusable_sources_are_clear_errors() {
        if std::env::var_os(MODEL_DIR_ENV).is_some() {
            return; // the override would win; nothing to check here
        }
        let err = resolve(&node("/nonexistent/checkpoint")).err().unwrap();
        assert_eq!(err.code(), "model");
        assert!(err.to_string().contains("/nonexistent/checkpoint"), "{err}");
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
