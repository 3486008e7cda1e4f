//! `ApiError`: an HTTP status plus OpenAI's error object
//! (`{"error": {"message", "type", "param", "code"}}`), and how engine errors map onto it:
//! a bad request is 400 naming the field, a full admission queue 429 with `Retry-After`, an
//! engine that cannot serve (failed rank, shutting down, internal) 503.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::error::{EngineError, ValidationError};

/// Seconds a client is told to wait after a 429.
pub const RETRY_AFTER_SECONDS: u32 = 1;

/// An error answer of the HTTP API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `rate_limit_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    pub code: &'static str,
}

impl ApiError {
    /// 400: the request is malformed; `param` names the field.
    pub fn invalid(message: impl Into<String>, param: Option<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: "invalid_request",
        }
    }

    /// 413: the body is larger than `server.max_body_bytes`.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the request body is larger than {limit} bytes (server.max_body_bytes)"
            ),
            kind: "invalid_request_error",
            param: None,
            code: "body_too_large",
        }
    }

    /// 404 for a path the server does not serve.
    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "no route {path}; see /v1/chat/completions, /v1/completions, /v1/models"
            ),
            kind: "invalid_request_error",
            param: None,
            code: "not_found",
        }
    }

    /// The OpenAI error object.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// The request field a validation error is about.
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

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> Self {
        let message = error.to_string();
        match &error {
            EngineError::Invalid(v) => ApiError::invalid(message, validation_param(v)),
            EngineError::Overloaded { .. } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message,
                kind: "rate_limit_error",
                param: None,
                code: error.code(),
            },
            _ => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message,
                kind: "server_error",
                param: None,
                code: error.code(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_status_type_and_field() {
        let range = ApiError::from(EngineError::Invalid(ValidationError::OutOfRange {
            field: "max_tokens",
            value: "9999".into(),
            expected: "at most the context left after the prompt",
        }));
        assert_eq!(range.status, StatusCode::BAD_REQUEST);
        assert_eq!(range.body()["error"]["param"], "max_tokens");
        assert!(
            range.message.contains("max_tokens = 9999"),
            "{}",
            range.message
        );
        let full = ApiError::from(EngineError::Overloaded { limit: 4 });
        assert_eq!(
            (full.status, full.kind),
            (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error")
        );
        let response = full.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        for down in [
            EngineError::ShuttingDown,
            EngineError::RankFailed {
                dp: 0,
                message: "x".into(),
            },
        ] {
            let api = ApiError::from(down);
            assert_eq!(
                (api.status, api.kind),
                (StatusCode::SERVICE_UNAVAILABLE, "server_error")
            );
        }
    }
}
