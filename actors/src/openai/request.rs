//! Request bodies of `/v1/chat/completions` and `/v1/completions` -> a validated [`ApiRequest`].
//!
//! Both endpoints share one table of sampling fields, defaults, ranges and error codes
//! (`temperature` 1.0 in [0, 2], 0 = greedy; `top_p` 1.0 in (0, 1]; `top_k` 0 = off; `n` 1 in
//! [1, 128], each choice with its own seed; `max_tokens` from 1 to the served model's context;
//! at most 4 `stop` strings). A field this engine does not implement is refused naming it, never
//! dropped. Chat bodies are checked by deepseek-recipe's conversion here, before the engine sees
//! them; thinking mode is off unless the request opts in (`thinking: {"type": "enabled"}` or a
//! `reasoning_effort`) or the topology's `[sampling] thinking` turns it on by default.

use deepinfer_model::config::ModelFamily;
use deepseek_recipe::openai::ChatCompletionRequest;
use deepseek_recipe::request::{ConversationRequest, ProtocolRequest};
use serde_json::{Map, Value, json};

use super::error::{
    ApiError, INVALID_TYPE, INVALID_VALUE, MISSING_PARAMETER, UNSUPPORTED_PARAMETER,
};
use crate::engine::request::GenerateRequest;
use crate::frontend::codec::conversion_options;
use crate::grammar::{Constraint, take_grammar_response_format};
use crate::sampling::MAX_TOP_LOGPROBS;

/// Which OpenAI endpoint a request targets.
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

    /// The endpoint of a URL path; `None` for any other path.
    pub fn from_url(url: &str) -> Option<Self> {
        match url {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            _ => None,
        }
    }
}

/// What is served: the name responses report, the family's chat conversion, the real context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    /// Reported as the response's `model`, whatever the request named.
    pub name: String,
    pub family: ModelFamily,
    /// Prompt + generated tokens of one sequence.
    pub context_tokens: usize,
    /// Thinking mode for chat requests that do not choose (the topology's `[sampling] thinking`).
    pub thinking_by_default: bool,
}

/// A served model for tests: `served-model`, V4.1, a context of 1024 tokens, no thinking.
#[cfg(test)]
pub(crate) fn test_served() -> ServedModel {
    ServedModel {
        name: "served-model".into(),
        family: ModelFamily::V41,
        context_tokens: 1024,
        thinking_by_default: false,
    }
}

/// `temperature` when a request sets none (both endpoints).
pub const DEFAULT_TEMPERATURE: f32 = 1.0;
/// Largest `temperature`.
pub const MAX_TEMPERATURE: f64 = 2.0;
/// Largest `n`.
pub const MAX_CHOICES: u64 = 128;
/// Most `stop` strings.
pub const MAX_STOP_SEQUENCES: usize = 4;
/// Seeds are below this (deepseek-recipe's range, OpenAI's int64).
pub const SEED_LIMIT: u64 = 1 << 63;

/// Fields both endpoints accept.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "response_format",
    "user",
];
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "thinking",
    "reasoning_effort",
];
const COMPLETION_FIELDS: &[&str] = &["prompt", "echo", "best_of", "suffix"];
/// A validated request of either endpoint: what to generate for each of its `n` choices and
/// what the response builders need.
#[derive(Debug)]
pub struct ApiRequest {
    pub endpoint: Endpoint,
    /// Choices to generate (`n`).
    pub n: usize,
    /// `stream: true` (the HTTP server sends chunks; the offline job refuses it).
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// The request's seed; choice `i` uses [`choice_seed`].
    pub seed: Option<u64>,
    /// Chat: thinking mode, as resolved (reasoning returned as `reasoning_content`).
    pub thinking: bool,
    /// Report log-probabilities with this many alternatives per token (`None`: none).
    pub logprobs: Option<usize>,
    /// The engine request of one choice, without its seed.
    template: GenerateRequest,
    /// Chat: deepseek-recipe's conversion (output parsing: reasoning, tool calls, JSON).
    pub(super) chat: Option<ConversationRequest>,
}

impl ApiRequest {
    /// The engine requests of the `n` choices. Choice `i` gets [`choice_seed`] of the request's
    /// seed, else of `fallback_seed` (the offline job derives one from the `custom_id`, so a
    /// line's output does not depend on admission order); with neither, the engine draws one.
    pub fn choice_requests(&self, fallback_seed: Option<u64>) -> Vec<GenerateRequest> {
        let seed = self.seed.or(fallback_seed);
        (0..self.n)
            .map(|index| {
                let mut request = self.template.clone();
                request.seed = seed.map(|s| choice_seed(s, index));
                request
            })
            .collect()
    }
}

/// The seed of choice `index`: the request's own for choice 0 (so `n: 1` equals a plain
/// request), a hash of (seed, index) for the others.
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        crate::sampling::uniform_seed(seed, index as u64)
    }
}

fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::field(param, INVALID_TYPE, format!("`{param}` must be {expected}"))
}

fn unsupported(param: &str, why: &str) -> ApiError {
    ApiError::field(param, UNSUPPORTED_PARAMETER, format!("`{param}` {why}"))
}

fn present<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn number(body: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    present(body, key)
        .map(|v| v.as_f64().ok_or_else(|| type_error(key, "a number")))
        .transpose()
}

fn uint(body: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    present(body, key)
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| type_error(key, "a non-negative integer"))
        })
        .transpose()
}

fn boolean(body: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    present(body, key)
        .map(|v| v.as_bool().ok_or_else(|| type_error(key, "a boolean")))
        .transpose()
}

fn out_of_range(param: &str, value: impl std::fmt::Display, range: &str) -> ApiError {
    ApiError::field(
        param,
        INVALID_VALUE,
        format!("`{param}` = {value} is out of range: {range}"),
    )
}

/// The sampling fields both endpoints share.
#[derive(Debug, Clone, PartialEq)]
struct Sampling {
    temperature: f32,
    top_p: f32,
    top_k: usize,
    seed: Option<u64>,
    max_tokens: Option<usize>,
    n: usize,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// Alternatives per token when log-probabilities are asked for.
    logprobs: Option<usize>,
}

fn sampling(
    body: &Map<String, Value>,
    endpoint: Endpoint,
    served: &ServedModel,
) -> Result<Sampling, ApiError> {
    let known: Vec<&str> = COMMON_FIELDS
        .iter()
        .chain(match endpoint {
            Endpoint::ChatCompletions => CHAT_FIELDS,
            Endpoint::Completions => COMPLETION_FIELDS,
        })
        .copied()
        .collect();
    if let Some(unknown) = body.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(unsupported(
            unknown,
            &format!("is not a field of {} requests", endpoint.url()),
        ));
    }
    if let Some(model) = present(body, "model") {
        model
            .as_str()
            .ok_or_else(|| type_error("model", "a string"))?;
    }
    let temperature = number(body, "temperature")?;
    if let Some(t) = temperature.filter(|t| !(0.0..=MAX_TEMPERATURE).contains(t)) {
        return Err(out_of_range("temperature", t, "[0, 2] (0 = greedy)"));
    }
    let top_p = number(body, "top_p")?;
    if let Some(p) = top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(out_of_range("top_p", p, "(0, 1]"));
    }
    let top_k = uint(body, "top_k")?.unwrap_or(0) as usize;
    let seed = uint(body, "seed")?;
    if let Some(s) = seed.filter(|s| *s >= SEED_LIMIT) {
        return Err(out_of_range("seed", s, "[0, 2^63)"));
    }
    let mut max_tokens = uint(body, "max_tokens")?;
    let mut max_param = "max_tokens";
    if let Some(m) = uint(body, "max_completion_tokens")? {
        if max_tokens.is_some_and(|t| t != m) {
            return Err(ApiError::field(
                "max_completion_tokens",
                INVALID_VALUE,
                "`max_tokens` and `max_completion_tokens` differ; give one",
            ));
        }
        max_tokens = Some(m);
        max_param = "max_completion_tokens";
    }
    let most = served.context_tokens.saturating_sub(1) as u64;
    if let Some(m) = max_tokens.filter(|m| *m == 0 || *m > most) {
        return Err(out_of_range(
            max_param,
            m,
            &format!(
                "[1, {most}] ({} holds {} tokens, prompt included)",
                served.name, served.context_tokens
            ),
        ));
    }
    let n = uint(body, "n")?.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(out_of_range("n", n, "[1, 128]"));
    }
    let stop = match present(body, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| type_error("stop", "a string or an array of strings"))?,
        Some(_) => return Err(type_error("stop", "a string or an array of strings")),
    };
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(out_of_range("stop", stop.len(), "at most 4 sequences"));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::field(
            "stop",
            INVALID_VALUE,
            "`stop` sequences must not be empty",
        ));
    }
    let stream = boolean(body, "stream")?.unwrap_or(false);
    let include_usage = match present(body, "stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::field(
                "stream_options",
                INVALID_VALUE,
                "`stream_options` is only allowed with `stream: true`",
            ));
        }
        Some(Value::Object(options)) => boolean(options, "include_usage")?.unwrap_or(false),
        Some(_) => return Err(type_error("stream_options", "an object")),
    };
    refuse_unimplemented(body, n)?;
    let logprobs = logprobs(body, endpoint)?;
    Ok(Sampling {
        temperature: temperature.map_or(DEFAULT_TEMPERATURE, |t| t as f32),
        top_p: top_p.map_or(1.0, |p| p as f32),
        top_k,
        seed,
        max_tokens: max_tokens.map(|m| m as usize),
        n: n as usize,
        stop,
        stream,
        include_usage,
        logprobs,
    })
}

/// The alternatives to report with each generated token's log-probability, `None` when the
/// request asks for no log-probabilities: chat's `logprobs: true` with `top_logprobs` (default
/// 0), completions' `logprobs` count; at most [`MAX_TOP_LOGPROBS`].
fn logprobs(body: &Map<String, Value>, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    let in_range = |param: &str, top: u64| {
        if top > MAX_TOP_LOGPROBS as u64 {
            return Err(out_of_range(param, top, "[0, 20]"));
        }
        Ok(top as usize)
    };
    match endpoint {
        Endpoint::ChatCompletions => {
            let wanted = boolean(body, "logprobs")?.unwrap_or(false);
            let top = uint(body, "top_logprobs")?
                .map(|top| in_range("top_logprobs", top))
                .transpose()?;
            match (wanted, top) {
                (true, top) => Ok(Some(top.unwrap_or(0))),
                (false, Some(1..)) => Err(ApiError::field(
                    "top_logprobs",
                    INVALID_VALUE,
                    "`top_logprobs` needs `logprobs: true`",
                )),
                (false, _) => Ok(None),
            }
        }
        Endpoint::Completions => {
            if present(body, "top_logprobs").is_some() {
                return Err(unsupported(
                    "top_logprobs",
                    "is not a field of /v1/completions requests (`logprobs` counts the alternatives)",
                ));
            }
            uint(body, "logprobs")?
                .map(|top| in_range("logprobs", top))
                .transpose()
        }
    }
}

/// Fields whose non-default values this engine does not implement: refused, never ignored.
fn refuse_unimplemented(body: &Map<String, Value>, n: u64) -> Result<(), ApiError> {
    match present(body, "logit_bias") {
        None => {}
        Some(Value::Object(bias)) if bias.is_empty() => {}
        Some(Value::Object(_)) => {
            return Err(unsupported("logit_bias", "is not supported by this engine"));
        }
        Some(_) => return Err(type_error("logit_bias", "an object")),
    }
    for penalty in ["frequency_penalty", "presence_penalty"] {
        if number(body, penalty)?.is_some_and(|p| p != 0.0) {
            return Err(unsupported(
                penalty,
                "is not supported by this engine (only 0)",
            ));
        }
    }
    if boolean(body, "echo")? == Some(true) {
        return Err(unsupported("echo", "is not supported by this engine"));
    }
    if uint(body, "best_of")?.is_some_and(|b| b != n) {
        return Err(unsupported(
            "best_of",
            "is not supported (only equal to `n`)",
        ));
    }
    if present(body, "suffix").is_some() {
        return Err(unsupported("suffix", "is not supported by this engine"));
    }
    if let Some(user) = present(body, "user") {
        user.as_str()
            .ok_or_else(|| type_error("user", "a string"))?;
    }
    Ok(())
}

fn apply(sampling: &Sampling, request: GenerateRequest) -> GenerateRequest {
    let mut request = request
        .temperature(sampling.temperature)
        .top_p(sampling.top_p)
        .top_k(sampling.top_k);
    request.max_tokens = sampling.max_tokens;
    request.stop = sampling.stop.clone();
    request.logprobs = sampling.logprobs;
    request
}

fn object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object()
        .ok_or_else(|| ApiError::request("the request body must be a JSON object"))
}

/// Validates a `/v1/chat/completions` body.
pub fn parse_chat(body: &Value, served: &ServedModel) -> Result<ApiRequest, ApiError> {
    let fields = object(body)?;
    let sampling = sampling(fields, Endpoint::ChatCompletions, served)?;
    match present(fields, "messages") {
        None => {
            return Err(ApiError::field(
                "messages",
                MISSING_PARAMETER,
                "missing `messages`",
            ));
        }
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(ApiError::field(
                "messages",
                INVALID_VALUE,
                "`messages` must not be empty",
            ));
        }
        Some(Value::Array(_)) => {}
        Some(_) => return Err(type_error("messages", "an array")),
    }
    // The body deepseek-recipe renders: the surface's own fields out, thinking made explicit.
    let mut rendered = fields.clone();
    let rendered_by_recipe = ["response_format"];
    for key in COMMON_FIELDS.iter().chain(&["max_completion_tokens"]) {
        if !rendered_by_recipe.contains(key) {
            rendered.remove(*key);
        }
    }
    let mut rendered = Value::Object(rendered);
    let mut check = rendered.clone();
    take_grammar_response_format(&mut check)
        .map_err(|e| ApiError::field("response_format", INVALID_VALUE, e.to_string()))?;
    let (model_name, options) = conversion_options(served.family);
    let options = options.with_default_thinking_mode(served.thinking_by_default);
    check["model"] = Value::String(model_name.to_string());
    let request: ChatCompletionRequest = serde_json::from_value(check)
        .map_err(|e| ApiError::request(format!("invalid chat request: {e}")))?;
    let converted = request
        .convert(options)
        .map_err(|e| ApiError::request(e.to_string()))?;
    let thinking = converted.conversation.thinking_mode;
    let kind = if thinking { "enabled" } else { "disabled" };
    rendered["thinking"] = json!({"type": kind});
    Ok(ApiRequest {
        endpoint: Endpoint::ChatCompletions,
        n: sampling.n,
        stream: sampling.stream,
        include_usage: sampling.include_usage,
        seed: sampling.seed,
        logprobs: sampling.logprobs,
        thinking,
        template: apply(&sampling, GenerateRequest::from_chat(rendered)),
        chat: Some(converted),
    })
}

/// Validates a `/v1/completions` body.
pub fn parse_completion(body: &Value, served: &ServedModel) -> Result<ApiRequest, ApiError> {
    let fields = object(body)?;
    let sampling = sampling(fields, Endpoint::Completions, served)?;
    let prompt = match present(fields, "prompt") {
        Some(Value::String(p)) => p.clone(),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(_)) => {
            return Err(unsupported(
                "prompt",
                "arrays are supported with exactly one string (one prompt per request)",
            ));
        }
        Some(_) => return Err(type_error("prompt", "a string")),
        None => {
            return Err(ApiError::field(
                "prompt",
                MISSING_PARAMETER,
                "missing `prompt`",
            ));
        }
    };
    let mut request = apply(&sampling, GenerateRequest::from_text(prompt));
    request.constraint = completion_constraint(fields)?;
    Ok(ApiRequest {
        endpoint: Endpoint::Completions,
        n: sampling.n,
        stream: sampling.stream,
        include_usage: sampling.include_usage,
        seed: sampling.seed,
        logprobs: sampling.logprobs,
        thinking: false,
        template: request,
        chat: None,
    })
}

/// `response_format` of a completions body: `text`, `json_object`, `json_schema`, `regex` or the
/// grammar extension, as on chat.
fn completion_constraint(fields: &Map<String, Value>) -> Result<Option<Constraint>, ApiError> {
    let Some(format) = present(fields, "response_format") else {
        return Ok(None);
    };
    let bad = |message: &str| ApiError::field("response_format", INVALID_VALUE, message);
    let kind = format
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`response_format.type` must be a string"))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Constraint::JsonObject)),
        "json_schema" => match format.pointer("/json_schema/schema") {
            Some(schema @ Value::Object(_)) => Ok(Some(Constraint::JsonSchema(schema.clone()))),
            _ => Err(bad(
                "`response_format.json_schema.schema` must be an object",
            )),
        },
        "regex" => match format.get("regex") {
            Some(Value::String(regex)) => Ok(Some(Constraint::Regex(regex.clone()))),
            _ => Err(bad("`response_format.regex` must be a string")),
        },
        _ => {
            let mut holder = json!({"response_format": format});
            match take_grammar_response_format(&mut holder) {
                Ok(Some(constraint)) => Ok(Some(constraint)),
                Ok(None) => Err(bad(&format!(
                    "unknown `response_format.type` {kind:?} (text, json_object, json_schema, \
                     regex or grammar)"
                ))),
                Err(e) => Err(bad(&e.to_string())),
            }
        }
    }
}

/// Validates a body of `endpoint`.
pub fn parse(
    endpoint: Endpoint,
    body: &Value,
    served: &ServedModel,
) -> Result<ApiRequest, ApiError> {
    match endpoint {
        Endpoint::ChatCompletions => parse_chat(body, served),
        Endpoint::Completions => parse_completion(body, served),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::Prompt;

    use super::test_served as served;

    fn chat(extra: Value) -> Value {
        let mut body =
            json!({"model": "whatever", "messages": [{"role": "user", "content": "Hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    fn completion(extra: Value) -> Value {
        let mut body = json!({"prompt": "Hi"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    fn both(extra: Value) -> [Result<ApiRequest, ApiError>; 2] {
        [
            parse_chat(&chat(extra.clone()), &served()),
            parse_completion(&completion(extra), &served()),
        ]
    }

    #[test]
    fn both_endpoints_share_defaults_and_greedy_temperature_zero() {
        for request in both(json!({})) {
            let r = request.unwrap().choice_requests(None).remove(0);
            assert_eq!(
                (r.temperature, r.top_p, r.top_k, r.seed, r.max_tokens),
                (1.0, 1.0, 0, None, None)
            );
        }
        for request in both(json!({"temperature": 0, "top_p": 0.5, "top_k": 3, "max_tokens": 9})) {
            let r = request.unwrap().choice_requests(None).remove(0);
            assert_eq!(
                (r.temperature, r.top_p, r.top_k, r.max_tokens),
                (0.0, 0.5, 3, Some(9))
            );
        }
    }

    #[test]
    fn both_endpoints_refuse_the_same_fields_with_the_same_codes() {
        let cases = [
            (json!({"temperature": 2.5}), "temperature", INVALID_VALUE),
            (json!({"temperature": "hot"}), "temperature", INVALID_TYPE),
            (json!({"top_p": 0}), "top_p", INVALID_VALUE),
            (json!({"n": 0}), "n", INVALID_VALUE),
            (json!({"n": 129}), "n", INVALID_VALUE),
            (json!({"max_tokens": 0}), "max_tokens", INVALID_VALUE),
            (json!({"max_tokens": 1024}), "max_tokens", INVALID_VALUE),
            (json!({"seed": 1u64 << 63}), "seed", INVALID_VALUE),
            (
                json!({"stop": ["a", "b", "c", "d", "e"]}),
                "stop",
                INVALID_VALUE,
            ),
            (json!({"stop": 5}), "stop", INVALID_TYPE),
            (
                json!({"logit_bias": {"5": 10}}),
                "logit_bias",
                UNSUPPORTED_PARAMETER,
            ),
            (
                json!({"presence_penalty": 0.5}),
                "presence_penalty",
                UNSUPPORTED_PARAMETER,
            ),
            (json!({"logprobs": "yes"}), "logprobs", INVALID_TYPE),
            (
                json!({"stream_options": {"include_usage": true}}),
                "stream_options",
                INVALID_VALUE,
            ),
            (
                json!({"frobnicate": 1}),
                "frobnicate",
                UNSUPPORTED_PARAMETER,
            ),
        ];
        for (extra, param, code) in cases {
            for result in both(extra.clone()) {
                let error = result.expect_err(&extra.to_string());
                assert_eq!(
                    (error.status, error.param.as_deref(), error.code),
                    (400, Some(param), code),
                    "{extra}: {error}"
                );
            }
        }
        // Limits are quoted from the served model's context.
        let error = parse_completion(&completion(json!({"max_tokens": 5000})), &served())
            .err()
            .unwrap();
        assert!(error.message.contains("[1, 1023]"), "{}", error.message);
        assert!(
            error.message.contains("served-model holds 1024"),
            "{}",
            error.message
        );
        let missing = parse_chat(&json!({"model": "m"}), &served()).err().unwrap();
        assert_eq!(
            (missing.param.as_deref(), missing.code),
            (Some("messages"), MISSING_PARAMETER)
        );
    }

    #[test]
    fn logprobs_are_a_flag_with_top_logprobs_on_chat_and_a_count_on_completions() {
        let asked = |request: Result<ApiRequest, ApiError>| {
            let request = request.expect("valid");
            let engine = request.choice_requests(None).remove(0).logprobs;
            assert_eq!(engine, request.logprobs, "the engine request carries it");
            engine
        };
        assert_eq!(asked(parse_chat(&chat(json!({})), &served())), None);
        let chat_with = |extra| parse_chat(&chat(extra), &served());
        assert_eq!(asked(chat_with(json!({"logprobs": false}))), None);
        assert_eq!(asked(chat_with(json!({"logprobs": true}))), Some(0));
        let top = json!({"logprobs": true, "top_logprobs": 20});
        assert_eq!(asked(chat_with(top)), Some(20));
        let completion_with = |extra| parse_completion(&completion(extra), &served());
        assert_eq!(asked(completion_with(json!({"logprobs": 0}))), Some(0));
        assert_eq!(asked(completion_with(json!({"logprobs": 5}))), Some(5));
        assert_eq!(asked(completion_with(json!({}))), None);
        let cases = [
            (
                chat(json!({"logprobs": true, "top_logprobs": 21})),
                Endpoint::ChatCompletions,
                "top_logprobs",
                INVALID_VALUE,
            ),
            (
                chat(json!({"top_logprobs": 3})),
                Endpoint::ChatCompletions,
                "top_logprobs",
                INVALID_VALUE,
            ),
            (
                chat(json!({"logprobs": 2})),
                Endpoint::ChatCompletions,
                "logprobs",
                INVALID_TYPE,
            ),
            (
                completion(json!({"logprobs": 21})),
                Endpoint::Completions,
                "logprobs",
                INVALID_VALUE,
            ),
            (
                completion(json!({"logprobs": true})),
                Endpoint::Completions,
                "logprobs",
                INVALID_TYPE,
            ),
            (
                completion(json!({"top_logprobs": 2})),
                Endpoint::Completions,
                "top_logprobs",
                UNSUPPORTED_PARAMETER,
            ),
        ];
        for (body, endpoint, param, code) in cases {
            let error = parse(endpoint, &body, &served()).expect_err("refused");
            assert_eq!(
                (error.status, error.param.as_deref(), error.code),
                (400, Some(param), code),
                "{body}: {error}"
            );
            assert!(error.message.contains(param), "{}", error.message);
        }
        assert!(chat_with(json!({"top_logprobs": 0})).is_ok());
    }

    #[test]
    fn n_choices_get_their_own_seeds() {
        let request = parse_chat(&chat(json!({"n": 3, "seed": 7})), &served()).unwrap();
        let seeds: Vec<_> = request
            .choice_requests(None)
            .iter()
            .map(|r| r.seed)
            .collect();
        assert_eq!(seeds[0], Some(7), "choice 0 keeps the request's seed");
        assert!(
            seeds[1].is_some() && seeds[1] != seeds[0] && seeds[2] != seeds[1],
            "{seeds:?}"
        );
        // The request's seed wins over the fallback; without either the engine draws.
        assert_eq!(request.choice_requests(Some(99))[0].seed, Some(7));
        let unseeded = parse_completion(&completion(json!({"n": 2})), &served()).unwrap();
        assert_eq!(unseeded.choice_requests(Some(99))[0].seed, Some(99));
        assert_eq!(unseeded.choice_requests(None)[1].seed, None);
    }

    fn rendered_thinking(request: &ApiRequest) -> Value {
        match &request.choice_requests(None)[0].prompt {
            Prompt::Chat(body) => body["thinking"].clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn thinking_is_off_unless_asked_for() {
        let plain = parse_chat(&chat(json!({})), &served()).unwrap();
        assert!(!plain.thinking);
        assert_eq!(rendered_thinking(&plain), json!({"type": "disabled"}));
        for opt_in in [
            json!({"thinking": {"type": "enabled"}}),
            json!({"reasoning_effort": "high"}),
        ] {
            let request = parse_chat(&chat(opt_in.clone()), &served()).unwrap();
            assert!(request.thinking, "{opt_in}");
            assert_eq!(rendered_thinking(&request), json!({"type": "enabled"}));
        }
        let by_default = ServedModel {
            thinking_by_default: true,
            ..served()
        };
        assert!(parse_chat(&chat(json!({})), &by_default).unwrap().thinking);
        let none = parse_chat(&chat(json!({"reasoning_effort": "none"})), &by_default).unwrap();
        assert!(!none.thinking);
        // The surface's fields never reach the template: the body keeps what the recipe renders.
        let request = parse_chat(
            &chat(json!({"temperature": 0, "n": 2, "seed": 3})),
            &served(),
        )
        .unwrap();
        let Prompt::Chat(body) = &request.choice_requests(None)[0].prompt else {
            panic!()
        };
        for key in ["temperature", "n", "seed", "model"] {
            assert!(body.get(key).is_none(), "{key} in {body}");
        }
    }

    #[test]
    fn completions_take_response_format() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"type": "json_object"}), Some(Constraint::JsonObject)),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
                Some(Constraint::JsonSchema(schema.clone())),
            ),
            (
                json!({"type": "regex", "regex": "[0-9]+"}),
                Some(Constraint::Regex("[0-9]+".into())),
            ),
            (
                json!({"type": "grammar", "grammar": "start: \"a\""}),
                Some(Constraint::Lark("start: \"a\"".into())),
            ),
            (json!({"type": "text"}), None),
        ];
        for (format, expected) in cases {
            let request =
                parse_completion(&completion(json!({"response_format": format})), &served())
                    .unwrap();
            assert_eq!(request.choice_requests(None)[0].constraint, expected);
        }
        let error = parse_completion(
            &completion(json!({"response_format": {"type": "yaml"}})),
            &served(),
        )
        .err()
        .unwrap();
        assert_eq!(error.param.as_deref(), Some("response_format"));
    }
}
