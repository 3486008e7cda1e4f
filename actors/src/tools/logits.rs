//! `deepinfer-node logits`: the fp32 logits at every input position when a token sequence is fed
//! through the per-sequence state in given chunk sizes, written as tensor `logits`
//! (F32, `[tokens, vocab]`) of a safetensors file. Works on V4.1 and V4 checkpoints alike
//! ([`AnyModel`] picks the family from `config.json`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deepinfer_model::any_model::{AnyModel, AnyStepEntry, StepOptions};
use deepinfer_model::checkpoint::Checkpoint;
use deepinfer_model::config::{ModelConfig, ModelFamily};
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{EntryOutput, LogitsWanted};
use deepinfer_model::{v4, v41};
use deepinfer_topology::Numerics;
use safetensors::tensor::{Dtype, TensorView};

use crate::engram_vocab::compressed_token_map;
use crate::frontend::codec::load_v41_tokenizer;

/// What to compute.
#[derive(Debug, Clone)]
pub struct LogitsRequest {
    /// Checkpoint directory (`config.json` + safetensors).
    pub model_dir: PathBuf,
    /// Token ids, in order.
    pub tokens: Vec<u32>,
    /// Chunk sizes summing to `tokens.len()`; empty means one chunk.
    pub chunks: Vec<usize>,
    /// Where to write the safetensors file.
    pub out: PathBuf,
}

/// Why the tool failed; every message names the input at fault.
#[derive(Debug, thiserror::Error)]
pub enum LogitsError {
    #[error("--tokens: {0}")]
    Tokens(String),
    #[error("--chunks: {0}")]
    Chunks(String),
    #[error("{dir}: {message}")]
    Model { dir: PathBuf, message: String },
    #[error("{path}: {message}")]
    Output { path: PathBuf, message: String },
    #[error("--device cuda: {0}")]
    Device(String),
}

/// The backend that runs the model (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsDevice {
    #[default]
    Cpu,
    /// `CudaBackend` on GPU 0 in exact numerics (bitwise equal to `Cpu`; needs a build with the
    /// `cuda` feature and an NVIDIA driver).
    Cuda,
}

/// Parses `1,2,3` into ids.
pub fn parse_token_list(text: &str) -> Result<Vec<u32>, LogitsError> {
    parse_list(text).map_err(LogitsError::Tokens)
}

/// Parses `45,1,1` into chunk sizes.
pub fn parse_chunk_list(text: &str) -> Result<Vec<usize>, LogitsError> {
    parse_list(text).map_err(LogitsError::Chunks)
}

fn parse_list<T: std::str::FromStr>(text: &str) -> Result<Vec<T>, String> {
    text.split(',')
        .map(str::trim)
        .enumerate()
        .map(|(i, item)| {
            item.parse::<T>()
                .map_err(|_| format!("item {} ({item:?}) is not a non-negative integer", i + 1))
        })
        .collect()
}

/// The Engram compressed vocabulary for a checkpoint directory: from its `tokenizer.json`, or —
/// for the golden fixtures, which ship no tokenizer — the fixtures' stub vocabulary in which token
/// `2k` and `2k+1` normalise alike (compressed id = id / 2), recognised by
/// `vocab_size == 2 × engram_compressed_vocab_size`.
pub fn engram_vocab_for_dir(
    dir: &Path,
    cfg: &ModelConfig,
) -> Result<Option<CompressedVocab>, String> {
    let Some(engram) = &cfg.engram else {
        return Ok(None);
    };
    let tokenizer = dir.join("tokenizer.json");
    if tokenizer.is_file() {
        let tok = load_v41_tokenizer(&tokenizer).map_err(|e| e.to_string())?;
        return compressed_token_map(&tok)
            .and_then(|map| map.into_engram_vocab(engram))
            .map(Some)
            .map_err(|e| e.to_string());
    }
    if cfg.vocab_size == 2 * engram.compressed_vocab_size {
        return CompressedVocab::halving_stub(cfg.vocab_size, engram.pad_token_id)
            .map(Some)
            .map_err(|e| e.to_string());
    }
    Err(format!(
        "the model has Engram layers, which need the tokenizer's compressed vocabulary, but there \
         is no tokenizer.json in {}",
        dir.display()
    ))
}

/// Runs the request on the CPU; returns the shape `[tokens, vocab]` written.
pub fn run(request: &LogitsRequest) -> Result<[usize; 2], LogitsError> {
    run_on(request, LogitsDevice::Cpu)
}

/// Runs the request on `device`; returns the shape `[tokens, vocab]` written.
pub fn run_on(request: &LogitsRequest, device: LogitsDevice) -> Result<[usize; 2], LogitsError> {
    let n = request.tokens.len();
    if n == 0 {
        return Err(LogitsError::Tokens("no tokens given".into()));
    }
    let chunks = if request.chunks.is_empty() {
        vec![n]
    } else {
        request.chunks.clone()
    };
    if let Some(i) = chunks.iter().position(|&c| c == 0) {
        return Err(LogitsError::Chunks(format!("chunk {} is empty", i + 1)));
    }
    let total: usize = chunks.iter().sum();
    if total != n {
        return Err(LogitsError::Chunks(format!(
            "the chunks sum to {total} but {n} tokens were given"
        )));
    }
    let dir = &request.model_dir;
    let model_err = |message: String| LogitsError::Model {
        dir: dir.clone(),
        message,
    };
    let cfg =
        ModelConfig::from_file(&dir.join("config.json")).map_err(|e| model_err(e.to_string()))?;
    let vocab = engram_vocab_for_dir(dir, &cfg).map_err(model_err)?;
    let model = match device {
        LogitsDevice::Cpu => AnyModel::load(dir, vocab).map_err(|e| model_err(e.to_string()))?,
        LogitsDevice::Cuda => {
            let ckpt = Checkpoint::open(dir).map_err(|e| model_err(e.to_string()))?;
            let backend =
                crate::gpu::open_cuda_backend(0, Numerics::Exact).map_err(LogitsError::Device)?;
            match cfg.family {
                ModelFamily::V41 => v41::Model::from_checkpoint(cfg, &ckpt, vocab, backend)
                    .map(|model| AnyModel::V41(Arc::new(model))),
                ModelFamily::V4 => v4::Model::from_checkpoint(cfg, &ckpt, backend)
                    .map(|model| AnyModel::V4(Arc::new(model))),
            }
            .map_err(|e| model_err(e.to_string()))?
        }
    };
    let vocab_size = model.config().vocab_size;

    let mut seq = model.new_sequence();
    let mut logits = Vec::with_capacity(n * vocab_size);
    let mut start = 0;
    for chunk in chunks {
        let tokens = &request.tokens[start..start + chunk];
        let mut entry = [AnyStepEntry::new(&mut seq, tokens, LogitsWanted::All)];
        let rows = model
            .forward_step(&mut entry, StepOptions::default())
            .map_err(|e| model_err(format!("tokens {start}..{}: {e}", start + chunk)))?;
        logits.extend(
            rows.into_iter()
                .filter_map(EntryOutput::into_logits)
                .flatten(),
        );
        start += chunk;
    }
    write_logits(&request.out, &logits, [n, vocab_size])?;
    Ok([n, vocab_size])
}

fn write_logits(path: &Path, logits: &[f32], shape: [usize; 2]) -> Result<(), LogitsError> {
    let out_err = |message: String| LogitsError::Output {
        path: path.to_path_buf(),
        message,
    };
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        TensorView::new(Dtype::F32, shape.to_vec(), &bytes).map_err(|e| out_err(e.to_string()))?;
    safetensors::serialize_to_file([("logits", view)], None, path)
        .map_err(|e| out_err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_bad_items_are_named() {
        assert_eq!(parse_token_list("1, 2,3").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_chunk_list("45,1,1").unwrap(), vec![45, 1, 1]);
        let err = parse_token_list("1,x,3").unwrap_err().to_string();
        assert!(err.starts_with("--tokens: item 2 (\"x\")"), "{err}");
        let err = parse_chunk_list("-1").unwrap_err().to_string();
        assert!(err.starts_with("--chunks: item 1"), "{err}");
    }

    #[test]
    fn chunks_must_cover_the_tokens() {
        let request = LogitsRequest {
            model_dir: PathBuf::from("/nonexistent"),
            tokens: vec![1, 2, 3],
            chunks: vec![2, 2],
            out: PathBuf::from("/nonexistent/out.safetensors"),
        };
        let err = run(&request).unwrap_err().to_string();
        assert_eq!(err, "--chunks: the chunks sum to 4 but 3 tokens were given");
        let err = run(&LogitsRequest {
            chunks: vec![3, 0],
            ..request.clone()
        })
        .unwrap_err()
        .to_string();
        assert_eq!(err, "--chunks: chunk 2 is empty");
    }

    #[test]
    fn a_missing_model_names_the_directory() {
        let request = LogitsRequest {
            model_dir: PathBuf::from("/nonexistent/model"),
            tokens: vec![1],
            chunks: vec![],
            out: PathBuf::from("/tmp/unused.safetensors"),
        };
        let err = run(&request).unwrap_err().to_string();
        assert!(err.starts_with("/nonexistent/model: "), "{err}");
    }
}
