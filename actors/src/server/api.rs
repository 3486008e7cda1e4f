//! The OpenAI wire format of the server: request bodies in (through ONE adapter to the request
//! surface the offline job uses, so both accept the same bodies), response bodies and
//! streaming chunks out.
//!
//! `parse_request` is the only place that knows how the shared surface is called; the server's
//! own fields (`stream`, `stream_options`) are read here, everything else is the surface's.

use serde_json::{Value, json};

use super::error::ApiError;
use crate::engine::stream::Completion;
use crate::job::format::{Endpoint, JobLine, parse_line, success_line};
use crate::messages::request::{FinishReason, Usage};

/// A parsed HTTP request body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiRequest {
    /// The endpoint, the `model` to report and the engine request.
    pub job: JobLine,
    /// `stream: true`: answer with server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
}

/// The first backquoted name in a surface error (`` `temperature` must be a number ``).
fn quoted_field(message: &str) -> Option<String> {
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(message[start..start + len].to_string())
}

fn optional_bool(body: &Value, key: &str, name: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            format!("`{name}` must be a boolean"),
            Some(name.to_string()),
        )),
    }
}

/// Parses an HTTP body for `endpoint`; `default_model` is reported when the body names none.
pub fn parse_request(
    endpoint: Endpoint,
    body: &[u8],
    default_model: &str,
) -> Result<ApiRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object", None));
    }
    let stream = optional_bool(&value, "stream", "stream")?;
    let include_usage = match value.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(options @ Value::Object(_)) => {
            optional_bool(options, "include_usage", "stream_options.include_usage")?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "`stream_options` must be an object",
                Some("stream_options".into()),
            ));
        }
    };
    // The shared surface reads OpenAI Batch lines; an HTTP body is the `body` of one.
    let line = json!({"custom_id": "http", "method": "POST", "url": endpoint.url(), "body": value});
    let job = parse_line(&line.to_string(), 1, default_model)
        .map_err(|e| ApiError::invalid(e.message.clone(), quoted_field(&e.message)))?;
    Ok(ApiRequest {
        job,
        stream,
        include_usage,
    })
}

/// The non-streaming response body of a finished request.
pub fn response_body(job: &JobLine, done: &Completion, created: u64) -> Value {
    success_line(0, job, done, created)["response"]["body"].take()
}

/// The `id` of a response and of its chunks.
pub fn response_id(endpoint: Endpoint, request: u64) -> String {
    match endpoint {
        Endpoint::ChatCompletions => format!("chatcmpl-{request}"),
        Endpoint::Completions => format!("cmpl-{request}"),
    }
}

fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

/// Builds the `data:` payloads of one streamed request in OpenAI's chunk format.
#[derive(Debug, Clone)]
pub struct ChunkWriter {
    endpoint: Endpoint,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
}

impl ChunkWriter {
    pub fn new(
        endpoint: Endpoint,
        request: u64,
        model: &str,
        created: u64,
        include_usage: bool,
    ) -> Self {
        ChunkWriter {
            endpoint,
            id: response_id(endpoint, request),
            model: model.to_string(),
            created,
            include_usage,
        }
    }

    fn chunk(&self, choices: Value, usage: Option<Usage>) -> Value {
        let object = match self.endpoint {
            Endpoint::ChatCompletions => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut chunk = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = usage.map_or(Value::Null, usage_json);
        }
        chunk
    }

    fn choice(&self, text: &str, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(FinishReason::as_str);
        match self.endpoint {
            Endpoint::ChatCompletions => json!([{
                "index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish,
            }]),
            Endpoint::Completions => json!([{
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }]),
        }
    }

    /// The first chunk: chat announces the assistant role; completions send nothing yet.
    pub fn start(&self) -> Option<Value> {
        match self.endpoint {
            Endpoint::ChatCompletions => Some(self.chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": null, "finish_reason": null}]),
                None,
            )),
            Endpoint::Completions => None,
        }
    }

    /// A piece of generated text.
    pub fn delta(&self, text: &str) -> Value {
        self.chunk(self.choice(text, None), None)
    }

    /// The last chunks: the rest of the text with the finish reason, then (when asked for)
    /// the usage chunk with no choices.
    pub fn finish(&self, rest: &str, reason: FinishReason, usage: Usage) -> Vec<Value> {
        let mut out = vec![self.chunk(self.choice(rest, Some(reason)), None)];
        if self.include_usage {
            out.push(self.chunk(json!([]), Some(usage)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::Prompt;

    #[test]
    fn bodies_parse_through_the_shared_surface() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}"#;
        let req = parse_request(Endpoint::ChatCompletions, chat, "demo").unwrap();
        assert_eq!((req.stream, req.include_usage), (true, true));
        assert_eq!(req.job.model, "m");
        assert!(matches!(req.job.request.prompt, Prompt::Chat(_)));
        let comp = br#"{"prompt":"x","temperature":0.5,"seed":3,"max_tokens":4}"#;
        let req = parse_request(Endpoint::Completions, comp, "demo").unwrap();
        assert_eq!(req.job.request.prompt, Prompt::Text("x".into()));
        assert_eq!(
            (req.job.request.seed, req.job.request.max_tokens, req.stream),
            (Some(3), Some(4), false)
        );
        assert_eq!(req.job.model, "demo");
    }

    #[test]
    fn bad_bodies_name_the_field() {
        let cases: [(Endpoint, &[u8], &str, Option<&str>); 6] = [
            (Endpoint::Completions, b"{nope", "not valid JSON", None),
            (Endpoint::Completions, b"[1]", "JSON object", None),
            (
                Endpoint::Completions,
                br#"{"prompt":"x","temperature":"hot"}"#,
                "`temperature` must be a number",
                Some("temperature"),
            ),
            (
                Endpoint::Completions,
                br#"{"prompt":"x","stream":"yes"}"#,
                "`stream` must be a boolean",
                Some("stream"),
            ),
            (
                Endpoint::ChatCompletions,
                br#"{"messages":[],"stream_options":{"include_usage":1}}"#,
                "boolean",
                Some("stream_options.include_usage"),
            ),
            (
                Endpoint::ChatCompletions,
                br#"{"messages":"hi"}"#,
                "`messages` must be an array",
                Some("messages"),
            ),
        ];
        for (endpoint, body, needle, param) in cases {
            let err = parse_request(endpoint, body, "demo").unwrap_err();
            assert!(err.message.contains(needle), "{err:?} lacks {needle:?}");
            assert_eq!(err.param.as_deref(), param, "{err:?}");
            assert!(!err.message.starts_with("line 1:"), "{err:?}");
        }
    }

    #[test]
    fn chunks_follow_the_openai_shapes() {
        let chat = ChunkWriter::new(Endpoint::ChatCompletions, 7, "m", 100, true);
        let start = chat.start().unwrap();
        assert_eq!(start["object"], "chat.completion.chunk");
        assert_eq!(start["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(start["usage"], Value::Null);
        assert_eq!(chat.delta("ab")["choices"][0]["delta"]["content"], "ab");
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
        };
        let end = chat.finish("c", FinishReason::Length, usage);
        assert_eq!(end[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(end[1]["choices"], json!([]));
        assert_eq!(end[1]["usage"]["total_tokens"], 5);
        let comp = ChunkWriter::new(Endpoint::Completions, 8, "m", 100, false);
        assert!(comp.start().is_none());
        let end = comp.finish("z", FinishReason::Stop, usage);
        assert_eq!(end.len(), 1);
        assert_eq!(end[0]["object"], "text_completion");
        assert_eq!(end[0]["id"], "cmpl-8");
        assert_eq!(end[0]["choices"][0]["text"], "z");
        assert!(end[0].get("usage").is_none());
    }
}
