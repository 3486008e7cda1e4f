//! The runtime's public error type, `EngineError`, and its stable codes.
//!
//! One enum for the crate boundary (ARCHITECTURE.md §6). A per-request failure reaches that
//! request's event stream; an actor-level failure goes to the supervisor. `code()` gives the
//! stable string used as the `code` label of `deepinfer_errors_total` and in job output lines.

use std::path::PathBuf;

/// What was wrong with a request (it never reaches a scheduler).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {len} tokens; this engine accepts at most {max}")]
    PromptTooLong { len: usize, max: usize },
    #[error(
        "token id {token} at prompt position {position} is outside the vocabulary (size {vocab})"
    )]
    TokenOutOfVocab {
        token: u32,
        position: usize,
        vocab: usize,
    },
    #[error("{field} = {value} is out of range: {expected}")]
    OutOfRange {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("this request needs a tokenizer ({what}), but the engine was started without one")]
    NoTokenizer { what: &'static str },
    #[error("the request could not be converted: {detail}")]
    Conversion { detail: String },
    #[error("the prompt could not be encoded: {detail}")]
    Encoding { detail: String },
    #[error("the structured output constraint is invalid: {detail}")]
    Grammar { detail: String },
}

/// Errors of the runtime. Public and matched on by callers, never a string.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("the engine is at its admission limit of {limit} in-flight requests; retry later")]
    Overloaded { limit: usize },
    #[error("invalid request: {0}")]
    Invalid(#[from] ValidationError),
    #[error("the request was aborted")]
    Aborted,
    #[error("DP rank {dp} failed: {message}")]
    RankFailed { dp: usize, message: String },
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("invalid engine configuration: {field}: {message}")]
    Config { field: String, message: String },
    #[error("cannot load the tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("cannot start the model on DP rank {dp}: {message}")]
    Startup { dp: usize, message: String },
    #[error("cannot load the model ({what}): {message}")]
    Model { what: String, message: String },
    #[error("internal error: {message}")]
    Internal { message: String },
    #[error(
        "the request needs up to {tokens} tokens of sequence state ({blocks} blocks of \
         {block_bytes} bytes) but the state pool of DP rank {dp} holds {total_blocks} blocks; \
         shorten the prompt or max_tokens, or raise [memory]"
    )]
    StateTooLarge {
        dp: usize,
        tokens: usize,
        blocks: usize,
        block_bytes: u64,
        total_blocks: usize,
    },
}

impl EngineError {
    /// The stable code of this error (metric label, job output `error.code`).
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::Overloaded { .. } => "overloaded",
            EngineError::Invalid(_) => "invalid_request",
            EngineError::Aborted => "aborted",
            EngineError::RankFailed { .. } => "rank_failed",
            EngineError::ShuttingDown => "shutting_down",
            EngineError::Config { .. } => "config",
            EngineError::Tokenizer { .. } => "tokenizer",
            EngineError::Startup { .. } => "startup",
            EngineError::Model { .. } => "model",
            EngineError::Internal { .. } => "internal",
            EngineError::StateTooLarge { .. } => "state_too_large",
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        EngineError::Internal {
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct() {
        let all = [
            EngineError::Overloaded { limit: 1 },
            EngineError::Invalid(ValidationError::EmptyPrompt),
            EngineError::Aborted,
            EngineError::RankFailed {
                dp: 0,
                message: String::new(),
            },
            EngineError::ShuttingDown,
            EngineError::Config {
                field: String::new(),
                message: String::new(),
            },
            EngineError::Tokenizer {
                path: PathBuf::new(),
                message: String::new(),
            },
            EngineError::Startup {
                dp: 0,
                message: String::new(),
            },
            EngineError::Model {
                what: String::new(),
                message: String::new(),
            },
            EngineError::internal(""),
            EngineError::StateTooLarge {
                dp: 0,
                tokens: 0,
                blocks: 0,
                block_bytes: 0,
                total_blocks: 0,
            },
        ];
        let mut codes: Vec<_> = all.iter().map(EngineError::code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), all.len());
    }

    #[test]
    fn rank_failure_names_the_rank() {
        let e = EngineError::RankFailed {
            dp: 3,
            message: "panicked: boom".into(),
        };
        assert_eq!(e.to_string(), "DP rank 3 failed: panicked: boom");
    }
}
