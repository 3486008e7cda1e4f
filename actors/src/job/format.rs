//! The offline job's line formats: OpenAI Batch input lines (and plain `{"prompt": ...}` lines)
//! in, OpenAI Batch output lines out. Pure functions; a line that cannot be read is an error
//! value naming the line, never a panic. Request bodies are validated by `crate::openai`, so a
//! line gets exactly the answer the HTTP server would give: a bad body is a 400 response with an
//! OpenAI error object, a good one the same response body.

use serde_json::{Value, json};

use crate::openai::{self, ApiError, ApiRequest, Endpoint, ServedModel};

/// One parsed input line: its id and the validated request, or the 400 answer to its body.
#[derive(Debug)]
pub struct JobLine {
    pub custom_id: String,
    pub request: Result<ApiRequest, ApiError>,
}

/// Why a line could not be read as a batch line at all (its output carries `error`).
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

/// The UTF-8 byte order mark.
const BOM: &[u8] = b"\xEF\xBB\xBF";

fn line_error(line: usize, custom_id: Option<&str>, message: impl Into<String>) -> LineError {
    LineError {
        line,
        custom_id: custom_id.map(str::to_string),
        message: message.into(),
    }
}

/// The text of input line `line` (1-based, without its line ending): over-long lines, a byte
/// order mark and invalid UTF-8 are that line's error.
pub fn decode_line(bytes: &[u8], line: usize) -> Result<&str, LineError> {
    if bytes.len() > MAX_LINE_BYTES {
        return Err(line_error(
            line,
            None,
            format!(
                "the line has {} bytes; at most {MAX_LINE_BYTES} are read",
                bytes.len()
            ),
        ));
    }
    if bytes.starts_with(BOM) {
        return Err(line_error(
            line,
            None,
            "the line starts with a UTF-8 byte order mark; save the file as UTF-8 without BOM",
        ));
    }
    std::str::from_utf8(bytes).map_err(|e| {
        line_error(
            line,
            None,
            format!(
                "not valid UTF-8 at byte {} of the line",
                e.valid_up_to() + 1
            ),
        )
    })
}

/// Parses input line `line` (1-based) for the served model.
pub fn parse_line(text: &str, line: usize, served: &ServedModel) -> Result<JobLine, LineError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| line_error(line, None, format!("not valid JSON: {e}")))?;
    let Some(object) = value.as_object() else {
        return Err(line_error(line, None, "a line must be a JSON object"));
    };
    let custom_id = match object.get("custom_id") {
        Some(Value::String(s)) => Some(s.clone()),
        None | Some(Value::Null) => None,
        Some(_) => return Err(line_error(line, None, "`custom_id` must be a string")),
    };
    let Some(body) = object.get("body") else {
        // A plain line: a completions body, optionally with a `custom_id`.
        let mut body = value.clone();
        if let Some(fields) = body.as_object_mut() {
            fields.remove("custom_id");
        }
        return Ok(JobLine {
            custom_id: custom_id.unwrap_or_else(|| format!("line-{line}")),
            request: openai::parse_completion(&body, served),
        });
    };
    let Some(custom_id) = custom_id else {
        return Err(line_error(line, None, "missing `custom_id`"));
    };
    let id = Some(custom_id.as_str());
    if object
        .get("method")
        .is_some_and(|m| m.as_str() != Some("POST"))
    {
        return Err(line_error(line, id, "`method` must be \"POST\""));
    }
    let endpoint = match object.get("url").and_then(Value::as_str) {
        Some(url) => Endpoint::from_url(url).ok_or_else(|| {
            line_error(
                line,
                id,
                format!("unsupported `url` {url:?}; use /v1/chat/completions or /v1/completions"),
            )
        })?,
        None => return Err(line_error(line, id, "missing `url`")),
    };
    let request = openai::parse(endpoint, body, served).and_then(|request| {
        if request.stream {
            Err(ApiError::field(
                "stream",
                openai::error::UNSUPPORTED_PARAMETER,
                "`stream: true` is not supported in a batch",
            ))
        } else {
            Ok(request)
        }
    });
    Ok(JobLine { custom_id, request })
}

/// The seed of a line that sets none: a hash of its `custom_id`, so its output does not depend
/// on the order requests are admitted in (nor on which lines a `--resume` run skips).
pub fn line_seed(custom_id: &str) -> u64 {
    // FNV-1a: stable across Rust versions and platforms.
    let hash = custom_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    crate::sampling::uniform_seed(hash, 0) >> 1
}

/// The output line of a request answered with `body` (status 200).
pub fn success_line(index: usize, custom_id: &str, request_id: &str, body: Value) -> Value {
    json!({
        "id": format!("batch_req_{index}"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": null,
    })
}

/// The output line of a request refused or failed: the status and error object a server would
/// answer with.
pub fn request_error_line(index: usize, custom_id: &str, error: &ApiError) -> Value {
    json!({
        "id": format!("batch_req_{index}"),
        "custom_id": custom_id,
        "response": {"status_code": error.status, "request_id": null, "body": error.body()},
        "error": null,
    })
}

/// The output line of an input line that could not be read.
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
    use crate::openai::request::test_served as served;

    #[test]
    fn batch_and_plain_lines_parse() {
        let chat = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}}"#;
        let job = parse_line(chat, 1, &served()).unwrap();
        assert_eq!(job.custom_id, "a");
        let request = job.request.unwrap();
        assert_eq!(request.endpoint, Endpoint::ChatCompletions);
        let choice = &request.choice_requests(None)[0];
        assert!(matches!(choice.prompt, Prompt::Chat(_)));
        assert_eq!(choice.max_tokens, Some(5));
        let comp = r#"{"custom_id":"b","method":"POST","url":"/v1/completions","body":{"prompt":"x","temperature":0.5,"top_p":0.9,"seed":3,"stop":["\n"],"max_tokens":4}}"#;
        let job = parse_line(comp, 2, &served()).unwrap();
        let choice = job.request.unwrap().choice_requests(None).remove(0);
        assert_eq!(choice.prompt, Prompt::Text("x".into()));
        assert_eq!(
            (
                choice.temperature,
                choice.top_p,
                choice.seed,
                choice.max_tokens
            ),
            (0.5, 0.9, Some(3), Some(4))
        );
        assert_eq!(choice.stop, vec!["\n".to_string()]);
        let plain = parse_line(r#"{"prompt": "hello"}"#, 7, &served()).unwrap();
        assert_eq!(plain.custom_id, "line-7");
        assert!(plain.request.is_ok());
    }

    #[test]
    fn undecodable_lines_are_that_lines_error() {
        assert_eq!(decode_line(b"{\"a\":1}", 1), Ok("{\"a\":1}"));
        let bom = decode_line(b"\xEF\xBB\xBF{}", 1).unwrap_err();
        assert!(bom.to_string().starts_with("line 1: "), "{bom}");
        assert!(bom.message.contains("byte order mark"), "{bom}");
        let bad = decode_line(b"{\"prompt\": \"\xFF\"}", 4).unwrap_err();
        assert_eq!(
            bad.to_string(),
            "line 4: not valid UTF-8 at byte 13 of the line"
        );
        let long = vec![b' '; MAX_LINE_BYTES + 1];
        assert!(decode_line(&long, 9).unwrap_err().message.contains("bytes"));
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
        ];
        for (text, needle) in cases {
            let err = parse_line(text, 3, &served()).unwrap_err();
            assert!(
                err.to_string().contains(needle),
                "{err} should contain {needle:?}"
            );
        }
        let err =
            parse_line(r#"{"custom_id":"c","url":"/v1/x","body":{}}"#, 3, &served()).unwrap_err();
        assert_eq!(err.custom_id.as_deref(), Some("c"));
        let out = line_error_line(2, &err);
        assert_eq!(out["custom_id"], "c");
        assert_eq!(out["error"]["code"], "invalid_line");
        // A bad body is the request's 400, naming the field.
        let bad = r#"{"custom_id":"c","url":"/v1/completions","body":{"prompt":"x","temperature":"hot"}}"#;
        let error = parse_line(bad, 3, &served()).unwrap().request.unwrap_err();
        let out = request_error_line(3, "c", &error);
        assert_eq!(out["response"]["status_code"], 400);
        assert_eq!(out["response"]["body"]["error"]["param"], "temperature");
        let streamed =
            r#"{"custom_id":"s","url":"/v1/completions","body":{"prompt":"x","stream":true}}"#;
        let error = parse_line(streamed, 1, &served())
            .unwrap()
            .request
            .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("stream"));
    }

    #[test]
    fn line_seeds_depend_on_the_custom_id_only() {
        assert_eq!(line_seed("r1"), line_seed("r1"));
        assert_ne!(line_seed("r1"), line_seed("r2"));
        assert!(line_seed("r1") < 1 << 63);
    }
}
