//! The error type of structured outputs: what went wrong, for which request input, and where.

use std::path::PathBuf;

use toktrie::TokenId;

/// Everything the grammar layer can fail with. Constraint errors fail one request only.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("cannot read tokenizer file {path}: {source}")]
    TokenizerRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tokenizer.json is not valid JSON: {0}")]
    TokenizerJson(#[source] serde_json::Error),
    #[error("tokenizer.json: {0}")]
    TokenizerContent(String),
    #[error("tokenizer.json has no special token {0:?}")]
    MissingSpecialToken(&'static str),
    #[error("cannot set up the grammar engine for this tokenizer: {0}")]
    EngineSetup(String),
    #[error("invalid {kind} constraint: {message}")]
    InvalidConstraint { kind: &'static str, message: String },
    #[error("{kind} constraint is {size} bytes, more than the limit of {limit}")]
    ConstraintTooLarge {
        kind: &'static str,
        size: usize,
        limit: usize,
    },
    #[error("request field `{field}`: {message}")]
    RequestField {
        field: &'static str,
        message: String,
    },
    #[error("token {token} is not allowed by the constraint at answer position {position}")]
    TokenRejected { token: TokenId, position: usize },
    #[error("cannot roll back {requested} tokens: only {available} were consumed")]
    Rollback { requested: usize, available: usize },
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
    #[error("the constraint allows no token at answer position {position}")]
    EmptyMask { position: usize },
    #[error("logits have {found} entries, fewer than the {vocab} tokens of the vocabulary")]
    LogitsTooShort { found: usize, vocab: usize },
    #[error("the mask worker pool lost a job (a worker stopped)")]
    WorkerLost,
    #[error("cannot start mask worker thread: {0}")]
    WorkerSpawn(#[source] std::io::Error),
}
