//! `ApiError`: a request refused or failed, in the OpenAI error object shape
//! (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status.

use serde_json::{Value, json};

use crate::error::EngineError;

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

/// One request's error as an OpenAI client reads it.
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

    /// The engine's answer, as a client sees it (`code` is the engine's stable code).
    pub fn from_engine(error: &EngineError) -> Self {
        let (status, kind) = match error {
            EngineError::Invalid(_) => (400, "invalid_request_error"),
            EngineError::Overloaded { .. } => (429, "rate_limit_error"),
            EngineError::ShuttingDown => (503, "server_error"),
            _ => (500, "server_error"),
        };
        ApiError {
            status,
            message: error.to_string(),
            kind,
            param: None,
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
        let busy = ApiError::from_engine(&EngineError::Overloaded { limit: 4 });
        assert_eq!((busy.status, busy.kind), (429, "rate_limit_error"));
        assert_eq!(
            ApiError::from_engine(&EngineError::ShuttingDown).status,
            503
        );
        assert_eq!(ApiError::from_engine(&EngineError::Aborted).status, 500);
    }
}
