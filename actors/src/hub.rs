//! Resolving a Hugging Face Hub checkpoint into a local snapshot directory.
//!
//! Owns the Hub side of model resolution: the local Hugging Face cache first (hf-hub 0.4 reads
//! only `HF_HOME`; `HF_HUB_CACHE` and `HF_HUB_OFFLINE=1` are honoured here), then, when the
//! snapshot is incomplete and the network is allowed, a download through hf-hub's sync API of
//! every file a checkpoint needs: `config.json`, `tokenizer.json` when the repository lists it,
//! `model.safetensors.index.json` and every shard it names (or the single `model.safetensors`).
//! The result is the snapshot directory (`models--org--name/snapshots/<sha>/`). Blocking.

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

/// The Hub used when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// The file every checkpoint has.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer, fetched when the repository lists it.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The weights of an unsharded checkpoint.
pub const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
/// What to set instead when the Hub cannot be reached.
const LOCAL_DIR_HINT: &str =
    "set DEEPINFER_HF_MODEL_DIR to a local checkpoint directory to run without the Hub";

/// Where and how to reach the Hub and its cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubOptions {
    /// Base URL of the Hub (`HF_ENDPOINT`, default [`DEFAULT_ENDPOINT`]).
    pub endpoint: String,
    /// The hub cache directory holding `models--org--name/` (`HF_HUB_CACHE`, else
    /// `$HF_HOME/hub`, else `~/.cache/huggingface/hub`).
    pub cache_dir: PathBuf,
    /// Never touch the network; only the cache (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
    /// Show a progress bar per downloaded file.
    pub progress: bool,
}

impl HubOptions {
    /// From the process environment; progress bars when stderr is a terminal.
    pub fn from_env() -> Result<HubOptions, HubError> {
        let mut options = HubOptions::from_vars(|name| std::env::var(name).ok())?;
        options.progress = std::io::stderr().is_terminal();
        Ok(options)
    }

    /// From variables looked up through `var` (`HF_ENDPOINT`, `HF_HUB_CACHE`, `HF_HOME`, `HOME`,
    /// `HF_HUB_OFFLINE`); no progress bars.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<HubOptions, HubError> {
        let set = |name: &str| var(name).filter(|value| !value.is_empty());
        let endpoint = set("HF_ENDPOINT")
            .map(|endpoint| endpoint.trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let cache_dir = if let Some(dir) = set("HF_HUB_CACHE") {
            PathBuf::from(dir)
        } else if let Some(home) = set("HF_HOME") {
            PathBuf::from(home).join("hub")
        } else if let Some(home) = set("HOME") {
            PathBuf::from(home)
                .join(".cache")
                .join("huggingface")
                .join("hub")
        } else {
            return Err(HubError::NoCacheDir);
        };
        let offline = set("HF_HUB_OFFLINE").is_some_and(|value| {
            matches!(
                value.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        Ok(HubOptions {
            endpoint,
            cache_dir,
            offline,
            progress: false,
        })
    }
}

/// Why a Hub checkpoint could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "no Hugging Face cache directory: none of HF_HUB_CACHE, HF_HOME or HOME is set; {LOCAL_DIR_HINT}"
    )]
    NoCacheDir,
    #[error(
        "{repo}@{revision} is not complete in the Hugging Face cache {} ({file} missing) and \
         HF_HUB_OFFLINE is set, so the Hub was not contacted; {LOCAL_DIR_HINT}",
        cache.display()
    )]
    OfflineNotCached {
        repo: String,
        revision: String,
        file: String,
        cache: PathBuf,
    },
    #[error("cannot set up a Hub client for {endpoint}: {source}")]
    Client {
        endpoint: String,
        #[source]
        source: ApiError,
    },
    #[error(
        "cannot list the files of {repo}@{revision} at {endpoint}: {source}{}",
        network_hint(source)
    )]
    RepoInfo {
        repo: String,
        revision: String,
        endpoint: String,
        #[source]
        source: ApiError,
    },
    #[error(
        "cannot download {file} of {repo}@{revision} from {endpoint}: {source}{}",
        network_hint(source)
    )]
    Download {
        repo: String,
        revision: String,
        file: String,
        endpoint: String,
        #[source]
        source: ApiError,
    },
    #[error("{repo}@{revision} at {endpoint} has no {file}; it is not a model checkpoint")]
    MissingFile {
        repo: String,
        revision: String,
        file: String,
        endpoint: String,
    },
    #[error(
        "{repo}@{revision} at {endpoint} has neither {INDEX_FILE} nor {SINGLE_WEIGHTS_FILE}; \
         no weights to load"
    )]
    NoWeights {
        repo: String,
        revision: String,
        endpoint: String,
    },
    #[error("{repo}@{revision} at {endpoint}: the Hub reported an unusable commit {commit:?}")]
    BadCommit {
        repo: String,
        revision: String,
        endpoint: String,
        commit: String,
    },
    #[error("{repo}@{revision}: cannot record the revision in the cache {}: {source}", path.display())]
    Cache {
        repo: String,
        revision: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{repo}@{revision}: bad shard index {}: {reason}", path.display())]
    Index {
        repo: String,
        revision: String,
        path: PathBuf,
        reason: String,
    },
}

/// A hint appended to errors caused by the transport (no connection, DNS, TLS), not by the Hub.
fn network_hint(error: &ApiError) -> &'static str {
    let transport = match error {
        ApiError::RequestError(inner) => matches!(**inner, ureq::Error::Transport(_)),
        ApiError::TooManyRetries(inner) => matches!(
            &**inner,
            ApiError::RequestError(request) if matches!(**request, ureq::Error::Transport(_))
        ),
        _ => false,
    };
    if transport {
        " (the Hub is unreachable; set DEEPINFER_HF_MODEL_DIR to a local checkpoint directory, \
         or set HF_HUB_OFFLINE=1 to use only the cache)"
    } else {
        ""
    }
}

/// Resolves `repo_id` at `revision` (a branch, tag or commit) to a complete snapshot directory.
/// A snapshot complete in the cache is used as it is, without asking the Hub whether the branch
/// moved; otherwise what is missing is downloaded, unless `options.offline`, which is an error
/// naming the first missing file.
pub fn resolve_hub_checkpoint(
    repo_id: &str,
    revision: &str,
    options: &HubOptions,
) -> Result<PathBuf, HubError> {
    let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string());
    let cached = cached_snapshot(&options.cache_dir, &repo);
    let missing = match &cached {
        Some(snapshot) => first_missing_file(snapshot, repo_id, revision)?,
        None => Some(CONFIG_FILE.to_string()),
    };
    match (cached, missing) {
        (Some(snapshot), None) => return Ok(snapshot),
        (_, Some(file)) if options.offline => {
            return Err(HubError::OfflineNotCached {
                repo: repo_id.to_string(),
                revision: revision.to_string(),
                file,
                cache: options.cache_dir.clone(),
            });
        }
        _ => {}
    }
    download_checkpoint(repo, repo_id, options)
}

/// The snapshot directory the cache holds for `repo` (`refs/<revision>` -> `snapshots/<sha>`, or
/// `snapshots/<revision>` when the revision is itself a commit), if it exists.
fn cached_snapshot(cache_dir: &Path, repo: &Repo) -> Option<PathBuf> {
    let repo_dir = cache_dir.join(repo.folder_name());
    let commit = std::fs::read_to_string(repo_dir.join("refs").join(repo.revision()))
        .map(|text| text.trim().to_string())
        .unwrap_or_else(|_| repo.revision().to_string());
    if commit.is_empty() || commit.contains(['/', '\\']) || commit.contains("..") {
        return None;
    }
    let snapshot = repo_dir.join("snapshots").join(commit);
    snapshot.is_dir().then_some(snapshot)
}

/// The first file a loadable checkpoint needs that `snapshot` lacks, if any.
fn first_missing_file(
    snapshot: &Path,
    repo_id: &str,
    revision: &str,
) -> Result<Option<String>, HubError> {
    if !snapshot.join(CONFIG_FILE).is_file() {
        return Ok(Some(CONFIG_FILE.to_string()));
    }
    let index = snapshot.join(INDEX_FILE);
    if index.is_file() {
        let shards = shard_names(&index, repo_id, revision)?;
        return Ok(shards
            .into_iter()
            .find(|shard| !snapshot.join(shard).is_file()));
    }
    if snapshot.join(SINGLE_WEIGHTS_FILE).is_file() {
        Ok(None)
    } else {
        Ok(Some(INDEX_FILE.to_string()))
    }
}

/// The distinct shard file names an index's `weight_map` names; rejects names that would leave
/// the snapshot directory.
fn shard_names(index: &Path, repo_id: &str, revision: &str) -> Result<BTreeSet<String>, HubError> {
    let bad = |reason: String| HubError::Index {
        repo: repo_id.to_string(),
        revision: revision.to_string(),
        path: index.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|e| bad(format!("cannot read: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(map) = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
    else {
        return Err(bad("no `weight_map` object".to_string()));
    };
    let mut shards = BTreeSet::new();
    for (tensor, shard) in map {
        let Some(shard) = shard.as_str() else {
            return Err(bad(format!("tensor {tensor:?} maps to a non-string shard")));
        };
        let safe = !shard.is_empty()
            && !shard.starts_with('/')
            && !shard.contains('\\')
            && shard
                .split('/')
                .all(|part| part != ".." && !part.is_empty());
        if !safe {
            return Err(bad(format!(
                "tensor {tensor:?} maps to unsafe shard path {shard:?}"
            )));
        }
        shards.insert(shard.to_string());
    }
    if shards.is_empty() {
        return Err(bad("`weight_map` is empty".to_string()));
    }
    Ok(shards)
}

/// Lists the repository through the Hub API and fetches every needed file into the cache, pinned
/// to the commit the listing reports (so a branch that moves mid-download cannot split the
/// snapshot); files already there are not fetched again. Then points `refs/<revision>` at that
/// commit and returns the snapshot directory.
fn download_checkpoint(
    repo: Repo,
    repo_id: &str,
    options: &HubOptions,
) -> Result<PathBuf, HubError> {
    let repo_id = repo_id.to_string();
    let revision = repo.revision().to_string();
    let endpoint = options.endpoint.clone();
    let cache = Cache::new(options.cache_dir.clone());
    let api = ApiBuilder::from_cache(cache.clone())
        .with_endpoint(endpoint.clone())
        .with_progress(options.progress)
        .build()
        .map_err(|source| HubError::Client {
            endpoint: endpoint.clone(),
            source,
        })?;
    let info = api
        .repo(repo.clone())
        .info()
        .map_err(|source| HubError::RepoInfo {
            repo: repo_id.clone(),
            revision: revision.clone(),
            endpoint: endpoint.clone(),
            source,
        })?;
    let commit = info.sha.trim().to_string();
    if commit.is_empty() || !commit.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(HubError::BadCommit {
            repo: repo_id,
            revision,
            endpoint,
            commit,
        });
    }
    let pinned = api.repo(Repo::with_revision(
        repo_id.clone(),
        RepoType::Model,
        commit.clone(),
    ));
    let listed: BTreeSet<&str> = info
        .siblings
        .iter()
        .map(|sibling| sibling.rfilename.as_str())
        .collect();
    let fetch = |file: &str| -> Result<PathBuf, HubError> {
        pinned.get(file).map_err(|source| HubError::Download {
            repo: repo_id.clone(),
            revision: revision.clone(),
            file: file.to_string(),
            endpoint: endpoint.clone(),
            source,
        })
    };
    if !listed.contains(CONFIG_FILE) {
        return Err(HubError::MissingFile {
            repo: repo_id.clone(),
            revision: revision.clone(),
            file: CONFIG_FILE.to_string(),
            endpoint: endpoint.clone(),
        });
    }
    let config = fetch(CONFIG_FILE)?;
    if listed.contains(TOKENIZER_FILE) {
        fetch(TOKENIZER_FILE)?;
    }
    if listed.contains(INDEX_FILE) {
        let index = fetch(INDEX_FILE)?;
        for shard in shard_names(&index, &repo_id, &revision)? {
            fetch(&shard)?;
        }
    } else if listed.contains(SINGLE_WEIGHTS_FILE) {
        fetch(SINGLE_WEIGHTS_FILE)?;
    } else {
        return Err(HubError::NoWeights {
            repo: repo_id,
            revision,
            endpoint,
        });
    }
    if revision != commit {
        cache
            .repo(repo)
            .create_ref(&commit)
            .map_err(|source| HubError::Cache {
                repo: repo_id.clone(),
                revision: revision.clone(),
                path: options.cache_dir.clone(),
                source,
            })?;
    }
    snapshot_of(&config, &repo_id, &revision)
}

/// The snapshot directory of a downloaded `config.json` (its parent).
fn snapshot_of(config: &Path, repo_id: &str, revision: &str) -> Result<PathBuf, HubError> {
    config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| HubError::Index {
            repo: repo_id.to_string(),
            revision: revision.to_string(),
            path: config.to_path_buf(),
            reason: "the cache returned a config path without a directory".to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn cache_dir_prefers_hf_hub_cache_then_hf_home_then_home() {
        let all = HubOptions::from_vars(vars(&[
            ("HF_HUB_CACHE", "/a"),
            ("HF_HOME", "/b"),
            ("HOME", "/c"),
        ]))
        .unwrap();
        assert_eq!(all.cache_dir, PathBuf::from("/a"));
        let home = HubOptions::from_vars(vars(&[("HF_HOME", "/b"), ("HOME", "/c")])).unwrap();
        assert_eq!(home.cache_dir, PathBuf::from("/b/hub"));
        let user = HubOptions::from_vars(vars(&[("HOME", "/c")])).unwrap();
        assert_eq!(user.cache_dir, PathBuf::from("/c/.cache/huggingface/hub"));
        assert!(matches!(
            HubOptions::from_vars(vars(&[])),
            Err(HubError::NoCacheDir)
        ));
    }

    #[test]
    fn endpoint_and_offline_come_from_their_variables() {
        let default = HubOptions::from_vars(vars(&[("HOME", "/c")])).unwrap();
        assert_eq!(default.endpoint, DEFAULT_ENDPOINT);
        assert!(!default.offline);
        let custom = HubOptions::from_vars(vars(&[
            ("HOME", "/c"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_HUB_OFFLINE", "1"),
        ]))
        .unwrap();
        assert_eq!(custom.endpoint, "http://127.0.0.1:9");
        assert!(custom.offline);
        for off in ["0", "false", ""] {
            let opts =
                HubOptions::from_vars(vars(&[("HOME", "/c"), ("HF_HUB_OFFLINE", off)])).unwrap();
            assert!(!opts.offline, "HF_HUB_OFFLINE={off:?}");
        }
    }

    #[test]
    fn shard_paths_that_leave_the_snapshot_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let index = dir.path().join(INDEX_FILE);
        std::fs::write(
            &index,
            r#"{"weight_map": {"a": "model-1.safetensors", "b": "../../evil.safetensors"}}"#,
        )
        .unwrap();
        let err = shard_names(&index, "org/name", "main").unwrap_err();
        assert!(err.to_string().contains("evil"), "{err}");
        std::fs::write(
            &index,
            r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-1.safetensors"}}"#,
        )
        .unwrap();
        let shards = shard_names(&index, "org/name", "main").unwrap();
        assert_eq!(
            shards.into_iter().collect::<Vec<_>>(),
            ["m-1.safetensors", "m-2.safetensors"]
        );
    }
}
