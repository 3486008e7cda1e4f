//! The offline job's line formats: OpenAI Batch input lines (and plain `{"prompt": ...}` lines)
//! in, OpenAI Batch output lines out. Pure functions; malformed input is an error value naming
//! the line and the field, never a panic.

use serde_json::{Value, json};

use crate::engine::request::GenerateRequest;
use crate::engine::stream::Completion;
use crate::error::EngineError;

/// Which OpenAI endpoint a line targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
}

impl Endpoint {
    pub fn url(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// One parsed input line.
#[derive(Debug, Clone, PartialEq)]
pub struct JobLine {
    pub custom_id: String,
    pub endpoint: Endpoint,
    /// The `model` to report (the body's, or the engine's name).
    pub model: String,
    pub request: GenerateRequest,
}

/// Why a line could not be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct LineError {
    pub line: usize,
    /// The line's `custom_id` when it could be read.
    pub custom_id: Option<String>,
    pub message: String,
}

/// Most bytes of one input line.
pub const MAX_LINE_BYTES: usize = 16 << 20;

fn field_error(line: usize, custom_id: Option<&str>, message: impl Into<String>) -> LineError {
    LineError {
        line,
        custom_id: custom_id.map(str::to_string),
        message: message.into(),
    }
}

fn optional_f32(
    body: &Value,
    key: &str,
    line: usize,
    id: Option<&str>,
) -> Result<Option<f32>, LineError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| field_error(line, id, format!("`{key}` must be a number"))),
    }
}

fn optional_u64(
    body: &Value,
    key: &str,
    line: usize,
    id: Option<&str>,
) -> Result<Option<u64>, LineError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            field_error(line, id, format!("`{key}` must be a non-negative integer"))
        }),
    }
}

fn stop_list(body: &Value, line: usize, id: Option<&str>) -> Result<Vec<String>, LineError> {
    match body.get("stop") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| field_error(line, id, "`stop` entries must be strings"))
            })
            .collect(),
        Some(_) => Err(field_error(
            line,
            id,
            "`stop` must be a string or an array of strings",
        )),
    }
}

/// A completions body (or a plain line) -> request.
fn completion_request(
    body: &Value,
    line: usize,
    id: Option<&str>,
) -> Result<GenerateRequest, LineError> {
    let prompt = match body.get("prompt") {
        Some(Value::String(p)) => p.clone(),
        Some(Value::Array(_)) => {
            return Err(field_error(
                line,
                id,
                "`prompt` arrays are not supported; use one prompt per line",
            ));
        }
        Some(_) => return Err(field_error(line, id, "`prompt` must be a string")),
        None => return Err(field_error(line, id, "missing `prompt`")),
    };
    let mut request = GenerateRequest::from_text(prompt);
    if let Some(t) = optional_f32(body, "temperature", line, id)? {
        request = request.temperature(t);
    }
    if let Some(p) = optional_f32(body, "top_p", line, id)? {
        request = request.top_p(p);
    }
    if let Some(k) = optional_u64(body, "top_k", line, id)? {
        request = request.top_k(k as usize);
    }
    if let Some(s) = optional_u64(body, "seed", line, id)? {
        request = request.seed(s);
    }
    if let Some(n) = optional_u64(body, "max_tokens", line, id)? {
        request = request.max_tokens(n as usize);
    }
    request.stop = stop_list(body, line, id)?;
    Ok(request)
}

/// Parses input line `line` (1-based); `default_model` is reported when the body names none.
pub fn parse_line(text: &str, line: usize, default_model: &str) -> Result<JobLine, LineError> {
    if text.len() > MAX_LINE_BYTES {
        return Err(field_error(
            line,
            None,
            format!("the line is longer than {MAX_LINE_BYTES} bytes"),
        ));
    }
    let value: Value = serde_json::from_str(text)
        .map_err(|e| field_error(line, None, format!("not valid JSON: {e}")))?;
    let Some(object) = value.as_object() else {
        return Err(field_error(line, None, "a line must be a JSON object"));
    };
    let custom_id = match object.get("custom_id") {
        Some(Value::String(s)) => Some(s.clone()),
        None | Some(Value::Null) => None,
        Some(_) => return Err(field_error(line, None, "`custom_id` must be a string")),
    };
    let id = custom_id.as_deref();
    let Some(body) = object.get("body") else {
        // A plain line: {"prompt": "...", optional sampling fields}.
        let request = completion_request(&value, line, id)?;
        return Ok(JobLine {
            custom_id: custom_id.unwrap_or_else(|| format!("line-{line}")),
            endpoint: Endpoint::Completions,
            model: default_model.to_string(),
            request,
        });
    };
    let Some(custom_id) = custom_id else {
        return Err(field_error(line, None, "missing `custom_id`"));
    };
    let id = Some(custom_id.as_str());
    if object
        .get("method")
        .is_some_and(|m| m.as_str() != Some("POST"))
    {
        return Err(field_error(line, id, "`method` must be \"POST\""));
    }
    let endpoint = match object.get("url").and_then(Value::as_str) {
        Some("/v1/chat/completions") => Endpoint::ChatCompletions,
        Some("/v1/completions") => Endpoint::Completions,
        Some(other) => {
            return Err(field_error(
                line,
                id,
                format!("unsupported `url` {other:?}; use /v1/chat/completions or /v1/completions"),
            ));
        }
        None => return Err(field_error(line, id, "missing `url`")),
    };
    if !body.is_object() {
        return Err(field_error(line, id, "`body` must be a JSON object"));
    }
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(default_model)
        .to_string();
    let request = match endpoint {
        Endpoint::ChatCompletions => {
            if !body.get("messages").is_some_and(Value::is_array) {
                return Err(field_error(line, id, "`messages` must be an array"));
            }
            GenerateRequest::from_chat(body.clone())
        }
        Endpoint::Completions => completion_request(body, line, id)?,
    };
    Ok(JobLine {
        custom_id,
        endpoint,
        model,
        request,
    })
}

/// Seconds since the Unix epoch (the OpenAI `created` field).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The end of the reasoning section in V4.1 output (thinking mode).
pub const THINK_END: &str = "</think>";

/// Splits thinking-mode output at the first `</think>` into (reasoning, answer); `None` when the
/// output has no reasoning section.
pub fn split_reasoning(text: &str) -> Option<(&str, &str)> {
    let at = text.find(THINK_END)?;
    Some((
        &text[..at],
        text[at + THINK_END.len()..].trim_start_matches('\n'),
    ))
}

/// The output line of a completed request.
pub fn success_line(index: usize, job: &JobLine, done: &Completion, created: u64) -> Value {
    let usage = json!({
        "prompt_tokens": done.usage.prompt_tokens,
        "completion_tokens": done.usage.completion_tokens,
        "total_tokens": done.usage.prompt_tokens + done.usage.completion_tokens,
    });
    let body = match job.endpoint {
        Endpoint::ChatCompletions => {
            let mut message = json!({"role": "assistant", "content": done.text});
            if let Some((reasoning, answer)) = split_reasoning(&done.text) {
                message =
                    json!({"role": "assistant", "reasoning_content": reasoning, "content": answer});
            }
            json!({
                "id": format!("chatcmpl-{}", done.id.get()),
                "object": "chat.completion",
                "created": created,
                "model": job.model,
                "choices": [{
                    "index": 0,
                    "message": message,
                    "finish_reason": done.reason.as_str(),
                    "logprobs": null,
                }],
                "usage": usage,
            })
        }
        Endpoint::Completions => json!({
            "id": format!("cmpl-{}", done.id.get()),
            "object": "text_completion",
            "created": created,
            "model": job.model,
            "choices": [{
                "index": 0,
                "text": done.text,
                "finish_reason": done.reason.as_str(),
                "logprobs": null,
            }],
            "usage": usage,
        }),
    };
    json!({
        "id": format!("batch_req_{index}"),
        "custom_id": job.custom_id,
        "response": {"status_code": 200, "request_id": done.id.to_string(), "body": body},
        "error": null,
    })
}

/// The output line of a request the engine refused or failed.
pub fn engine_error_line(index: usize, custom_id: &str, error: &EngineError) -> Value {
    json!({
        "id": format!("batch_req_{index}"),
        "custom_id": custom_id,
        "response": null,
        "error": {"code": error.code(), "message": error.to_string()},
    })
}

/// The output line of an input line that could not be parsed.
pub fn line_error_line(index: usize, error: &LineError) -> Value {
    json!({
        "id": format!("batch_req_{index}"),
        "custom_id": error.custom_id,
        "response": null,
        "error": {"code": "invalid_line", "message": error.to_string()},
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::Prompt;

    #[test]
    fn batch_and_plain_lines_parse() {
        let chat = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}}"#;
        let job = parse_line(chat, 1, "demo").unwrap();
        assert_eq!(
            (job.custom_id.as_str(), job.endpoint, job.model.as_str()),
            ("a", Endpoint::ChatCompletions, "m")
        );
        assert!(matches!(job.request.prompt, Prompt::Chat(_)));
        let comp = r#"{"custom_id":"b","method":"POST","url":"/v1/completions","body":{"prompt":"x","temperature":0.5,"top_p":0.9,"seed":3,"stop":["\n"],"max_tokens":4}}"#;
        let job = parse_line(comp, 2, "demo").unwrap();
        assert_eq!(job.request.prompt, Prompt::Text("x".into()));
        assert_eq!(
            (
                job.request.temperature,
                job.request.top_p,
                job.request.seed,
                job.request.max_tokens
            ),
            (0.5, 0.9, Some(3), Some(4))
        );
        assert_eq!(job.request.stop, vec!["\n".to_string()]);
        let plain = parse_line(r#"{"prompt": "hello"}"#, 7, "demo").unwrap();
        assert_eq!(
            (plain.custom_id.as_str(), plain.model.as_str()),
            ("line-7", "demo")
        );
    }

    #[test]
    fn reasoning_is_split_from_the_answer() {
        assert_eq!(
            split_reasoning("plan it</think>\n\nThe answer."),
            Some(("plan it", "The answer."))
        );
        assert_eq!(split_reasoning("no reasoning here"), None);
    }

    #[test]
    fn malformed_lines_name_line_and_field() {
        let cases = [
            ("{not json", "line 3: not valid JSON"),
            ("[1,2]", "JSON object"),
            (
                r#"{"custom_id":"c","url":"/v1/embeddings","body":{}}"#,
                "unsupported `url`",
            ),
            (
                r#"{"custom_id":"c","method":"GET","url":"/v1/completions","body":{"prompt":"x"}}"#,
                "`method`",
            ),
            (
                r#"{"url":"/v1/completions","body":{"prompt":"x"}}"#,
                "missing `custom_id`",
            ),
            (
                r#"{"custom_id":"c","url":"/v1/completions","body":{"prompt":"x","temperature":"hot"}}"#,
                "`temperature` must be a number",
            ),
            (
                r#"{"custom_id":"c","url":"/v1/chat/completions","body":{"messages":"x"}}"#,
                "`messages`",
            ),
            (r#"{"prompt": 5}"#, "`prompt` must be a string"),
        ];
        for (text, needle) in cases {
            let err = parse_line(text, 3, "demo").unwrap_err();
            assert!(
                err.to_string().contains(needle),
                "{err} should contain {needle:?}"
            );
        }
        let err =
            parse_line(r#"{"custom_id":"c","url":"/v1/x","body":{}}"#, 3, "demo").unwrap_err();
        assert_eq!(err.custom_id.as_deref(), Some("c"));
        let out = line_error_line(2, &err);
        assert_eq!(out["custom_id"], "c");
        assert_eq!(out["error"]["code"], "invalid_line");
    }
}
