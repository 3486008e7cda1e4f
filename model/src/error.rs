//! The crate's error type. Every failure names what and where: the file and field of a bad config, the
//! file and tensor (expected vs found) of a bad checkpoint, the sequence operation that was refused.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// An operating-system error on a file (open, read, mmap, write).
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A `config.json` field is missing, mistyped or inconsistent.
    #[error("{}: field `{field}`: {message}", file.display())]
    Config {
        file: PathBuf,
        field: String,
        message: String,
    },

    /// A checkpoint tensor or file is malformed; `message` says what was expected and what was found.
    #[error("{}: tensor `{tensor}`: {message}", file.display())]
    Checkpoint {
        file: PathBuf,
        tensor: String,
        message: String,
    },

    /// A tensor the model needs is in none of the checkpoint's files.
    #[error("tensor `{tensor}` not found in checkpoint {}", searched.display())]
    MissingTensor { tensor: String, searched: PathBuf },

    /// A per-sequence operation is invalid (bad chunk, rollback past history, position beyond max).
    #[error("sequence error: {message}")]
    Sequence { message: String },

    /// The input is well formed but names something this engine does not implement.
    #[error("unsupported: {what}")]
    Unsupported { what: String },
}

impl ModelError {
    /// Shorthand for an I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
