//! `ApiError`: a request refused or failed, in the OpenAI error object shape
//! (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status.

use serde_json::{Value, json};

use crate::error::{EngineError, ValidationError};

/// The `code` of a field with the wrong JSON type.
pub const INVALID_TYPE: &str = "invalid_type";
/// The `code` of a field whose value is out of range.
pub const INVALID_VALUE: &str = "invalid_value";
/// The `code` of a field this engine does not implement (never silently dropped).
pub const UNSUPPORTED_PARAMETER: &str = "unsupported_parameter";
/// The `code` of a missing field.
pub const MISSING_PARAMETER: &str = "missing_required_parameter";
/// The `code` of a request the chat conversion or the engine refused.
pub const INVALID_REQUEST: &str = "invalid_request";

/// One request's error as an OpenAI client reads it (the offline job's error lines and the HTTP
/// server's error answers).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status: 400 for a bad request, 429 overloaded, 503 shutting down, 500 otherwise.
    pub status: u16,
    pub message: String,
    /// `invalid_request_error`, `rate_limit_error` or `server_error`.
    pub kind: &'static str,
    /// The request field at fault (`temperature`, `messages`, ...), when one is.
    pub param: Option<String>,
    pub code: &'static str,
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn field(param: &str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code,
        }
    }

    /// A 400 for the request as a whole.
    pub fn request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: INVALID_REQUEST,
        }
    }

    /// 413: an HTTP body larger than the server's `max_body_bytes`.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: 413,
            message: format!(
                "the request body is larger than {limit} bytes (server.max_body_bytes)"
            ),
            kind: "invalid_request_error",
            param: None,
            code: "body_too_large",
        }
    }

    /// 404: a path the HTTP server does not serve.
    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: 404,
            message: format!(
                "no route {path}; see /v1/chat/completions, /v1/completions, /v1/models"
            ),
            kind: "invalid_request_error",
            param: None,
            code: "not_found",
        }
    }

    /// The engine's answer, as a client sees it (`code` is the engine's stable code; a
    /// validation error names the request field it is about).
    pub fn from_engine(error: &EngineError) -> Self {
        let (status, kind) = match error {
            EngineError::Invalid(_) => (400, "invalid_request_error"),
            EngineError::Overloaded { .. } => (429, "rate_limit_error"),
            EngineError::ShuttingDown => (503, "server_error"),
            _ => (500, "server_error"),
        };
        let param = match error {
            EngineError::Invalid(invalid) => validation_param(invalid),
            _ => None,
        };
        ApiError {
            status,
            message: error.to_string(),
            kind,
            param,
            code: error.code(),
        }
    }

    /// `{"error": {...}}`, the body of an error response.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// The request field an engine validation error is about.
fn validation_param(error: &ValidationError) -> Option<String> {
    match error {
        ValidationError::OutOfRange { field, .. } => Some((*field).to_string()),
        ValidationError::Grammar { .. } => Some("response_format".into()),
        ValidationError::EmptyPrompt
        | ValidationError::PromptTooLong { .. }
        | ValidationError::TokenOutOfVocab { .. }
        | ValidationError::Encoding { .. } => Some("prompt".into()),
        ValidationError::NoTokenizer { .. } | ValidationError::Conversion { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ValidationError;

    #[test]
    fn errors_have_the_openai_shape_and_status() {
        let e = ApiError::field("temperature", INVALID_VALUE, "temperature = 3 is above 2");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "temperature = 3 is above 2", "type": "invalid_request_error",
                             "param": "temperature", "code": "invalid_value"}})
        );
        assert_eq!(e.status, 400);
        let invalid = ApiError::from_engine(&EngineError::Invalid(ValidationError::EmptyPrompt));
        assert_eq!((invalid.status, invalid.code), (400, "invalid_request"));
        assert_eq!(invalid.param.as_deref(), Some("prompt"));
        let range = ApiError::from_engine(&EngineError::Invalid(ValidationError::OutOfRange {
            field: "max_tokens",
            value: "9999".into(),
            expected: "at most the context left after the prompt",
        }));
        assert_eq!(range.body()["error"]["param"], "max_tokens");
        assert_eq!(ApiError::too_large(4096).status, 413);
        assert!(ApiError::not_found("/v2/x").message.contains("/v2/x"));
        let busy = ApiError::from_engine(&EngineError::Overloaded { limit: 4 });
        assert_eq!((busy.status, busy.kind), (429, "rate_limit_error"));
        assert_eq!(
            ApiError::from_engine(&EngineError::ShuttingDown).status,
            503
        );
        assert_eq!(ApiError::from_engine(&EngineError::Aborted).status, 500);
    }
}
