//! Responses and stream chunks of both endpoints, built from the engine's completions.
//!
//! Chat output goes through deepseek-recipe's output parser (the same one for a whole response
//! and for SSE chunks): the reasoning of thinking mode becomes `reasoning_content` (never
//! `content`), DSML tool calls become `tool_calls` with finish reason `tool_calls`, and
//! `json_object` output is cut to its JSON. Completions output is the generated text as is.
//! `model` is always the served model's name.
//!
//! Streaming ([`ApiRequest::choice_stream`], the HTTP server's SSE `data:` payloads): chat chunks
//! come from the same parser (`chat.completion.chunk`: the role first, then `content` /
//! `reasoning_content` / `tool_calls` deltas); completions chunks are `text_completion` objects
//! with the text as it comes. Both endpoints end a choice with a chunk carrying its
//! `finish_reason` and its `usage` (deepseek-recipe's rule for chat, followed for completions);
//! with `stream_options.include_usage` every earlier chunk has `"usage": null`.
//!
//! Log-probabilities (requests that asked) are shaped as OpenAI's: chat's `logprobs.content`
//! (`token`, `logprob`, `bytes`, `top_logprobs` per token), completions' `tokens`,
//! `token_logprobs`, `top_logprobs` (token text -> log-probability) and `text_offset`. A stream
//! carries each token's entry in the chunk of its text, or (chat, where the output parser may
//! hold text back) in the next chunk the parser sends; every token's entry once, in order. A
//! token of probability 0 (a grammar's forced end) reports −9999, OpenAI's stand-in for −∞.

use deepseek_recipe::openai::ChatCompletionRequest;
use deepseek_recipe::openai::chat_completion::response::{
    ChatCompletionChunk, ChatCompletionResponse,
};
use deepseek_recipe::request::{ConversationRequest, ProtocolRequest};
use deepseek_recipe::response::{Accumulate, ProtocolResponse};
use deepseek_recipe::stream::{
    InferenceChunk, InferenceFinishReason, PromptUsage, StreamError, StreamProcessor,
};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio_stream::{Stream, StreamExt};

use super::error::ApiError;
use super::request::{ApiRequest, Endpoint, ServedModel};
use crate::engine::stream::{
    Completion, EventStream, GenerationEvent, ReportedLogprobs, ReportedToken,
};
use crate::error::EngineError;
use crate::messages::request::{FinishReason, Usage};

/// Seconds since the Unix epoch (the OpenAI `created` field).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The response `id` of a request whose first choice has engine id `first`.
pub fn response_id(endpoint: Endpoint, first: u64) -> String {
    match endpoint {
        Endpoint::ChatCompletions => format!("chatcmpl-{first}"),
        Endpoint::Completions => format!("cmpl-{first}"),
    }
}

/// The parser input of a finished choice: prompt usage, the text, the finish.
pub fn inference_chunks(done: &Completion) -> Vec<InferenceChunk> {
    vec![
        InferenceChunk::Ready {
            system_fingerprint: None,
            prompt_usage: PromptUsage {
                prompt_tokens: done.usage.prompt_tokens,
                prompt_cache_hit_tokens: 0,
            },
        },
        InferenceChunk::Text {
            content: done.text.clone(),
            token_count: done.usage.completion_tokens,
        },
        InferenceChunk::Finish {
            finish_reason: finish_reason(done.reason),
        },
    ]
}

/// The engine's finish reason as the output parser takes it.
pub fn finish_reason(reason: FinishReason) -> InferenceFinishReason {
    match reason {
        FinishReason::Stop => InferenceFinishReason::Stop,
        FinishReason::Length => InferenceFinishReason::Length,
    }
}

/// `usage` of a response: the prompt counted once, the generated tokens of every choice.
fn usage_body(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// The `/v1/models` body: the one served model.
pub fn model_list(served: &ServedModel, created: u64) -> Value {
    json!({
        "object": "list",
        "data": [{"id": served.name, "object": "model", "created": created, "owned_by": "deepinfer"}],
    })
}

/// A log-probability as JSON: −9999 for a token of probability 0 (JSON has no −∞).
fn logprob_value(logprob: f32) -> Value {
    if logprob.is_finite() {
        json!(logprob)
    } else {
        json!(-9999.0)
    }
}

/// Chat's entry of one token (`top_logprobs` added by [`chat_logprobs`]).
fn chat_token(token: &ReportedToken) -> Value {
    json!({"token": token.text, "logprob": logprob_value(token.logprob),
           "bytes": token.text.as_bytes()})
}

/// Chat's `logprobs` of a choice (or of a chunk's tokens).
fn chat_logprobs(tokens: &[ReportedLogprobs]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut entry = chat_token(&t.chosen);
            entry["top_logprobs"] = t.top.iter().map(chat_token).collect();
            entry
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' `logprobs` of a choice (or of a chunk's tokens), the first token's text
/// starting at byte `offset` of the choice's text.
fn completion_logprobs(tokens: &[ReportedLogprobs], offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for t in tokens {
        text_offset.push(at);
        at += t.chosen.text.len();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let alternatives: serde_json::Map<String, Value> = t
                .top
                .iter()
                .map(|a| (a.text.clone(), logprob_value(a.logprob)))
                .collect();
            Value::Object(alternatives)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.chosen.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| logprob_value(t.chosen.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

/// A request still generating, as text pieces with the tokens they account for (and those
/// tokens' log-probabilities when the request asked).
enum Live {
    Text {
        content: String,
        tokens: usize,
        logprobs: Vec<ReportedLogprobs>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
}

struct LiveState {
    events: EventStream,
    /// Bytes of text and tokens passed on so far.
    sent: usize,
    counted: usize,
    tokens: usize,
    /// Log-probabilities of the tokens not yet passed on.
    logprobs: Vec<ReportedLogprobs>,
    queue: VecDeque<Result<Live, EngineError>>,
    ended: bool,
}

/// The engine's events of one request as [`Live`] pieces: a token's text as it comes (tokens
/// whose text is held back, a multi-byte character or a possible stop sequence, are counted
/// with the next text), the text held back until the end with the finish, an engine error
/// last. Dropping the stream drops `events`, which aborts the request.
fn live(events: EventStream) -> impl Stream<Item = Result<Live, EngineError>> + Send + use<> {
    let state = LiveState {
        events,
        sent: 0,
        counted: 0,
        tokens: 0,
        logprobs: Vec::new(),
        queue: VecDeque::new(),
        ended: false,
    };
    futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(item) = s.queue.pop_front() {
                return Some((item, s));
            }
            if s.ended {
                return None;
            }
            match s.events.next().await {
                Some(GenerationEvent::Token { text, logprobs, .. }) => {
                    s.tokens += 1;
                    s.logprobs.extend(logprobs.map(|lp| *lp));
                    if !text.is_empty() {
                        s.sent += text.len();
                        let tokens = s.tokens - s.counted;
                        s.counted = s.tokens;
                        s.queue.push_back(Ok(Live::Text {
                            content: text,
                            tokens,
                            logprobs: std::mem::take(&mut s.logprobs),
                        }));
                    }
                }
                Some(GenerationEvent::Finished {
                    reason,
                    usage,
                    text,
                }) => {
                    let rest = text.get(s.sent..).unwrap_or_default();
                    let tokens = usage.completion_tokens.saturating_sub(s.counted);
                    if !rest.is_empty() || tokens > 0 || !s.logprobs.is_empty() {
                        s.queue.push_back(Ok(Live::Text {
                            content: rest.to_string(),
                            tokens,
                            logprobs: std::mem::take(&mut s.logprobs),
                        }));
                    }
                    s.queue.push_back(Ok(Live::Finished { reason, usage }));
                    s.ended = true;
                }
                Some(GenerationEvent::Error(error)) => {
                    s.queue.push_back(Err(error));
                    s.ended = true;
                }
                None => s.ended = true,
            }
        }
    })
}

/// A parser error as the client sees it.
fn output_error(error: impl std::fmt::Display) -> ApiError {
    ApiError {
        status: 500,
        message: format!("the output could not be parsed: {error}"),
        kind: "server_error",
        param: None,
        code: "internal",
    }
}

/// Chat: the output parser's chunks of choice `index` for `inference`.
fn chat_chunks<S>(
    chat: &ConversationRequest,
    index: usize,
    response_id: &str,
    served: &ServedModel,
    inference: S,
) -> impl Stream<Item = Result<ChatCompletionChunk, StreamError>> + Send + use<S>
where
    S: Stream<Item = InferenceChunk> + Send,
{
    let generator =
        ChatCompletionRequest::chunk_generator(chat, response_id.to_string(), served.name.clone());
    let processor = StreamProcessor::new(generator, chat.parsing_options.clone());
    processor.into_protocol_stream(inference).map(move |chunk| {
        chunk.map(|mut chunk| {
            for choice in &mut chunk.choices {
                choice.index = index as u32;
            }
            chunk
        })
    })
}

/// Completions: `text_completion` chunks of choice `index` as the text comes (with their
/// tokens' log-probabilities when `with_logprobs`), the finish reason and `usage` on the last.
fn completion_stream(
    live: impl Stream<Item = Result<Live, EngineError>> + Send + 'static,
    id: String,
    served: ServedModel,
    created: u64,
    (index, include_usage, with_logprobs): (usize, bool, bool),
) -> impl Stream<Item = Result<Value, ApiError>> + Send + 'static {
    // Bytes of the choice's token texts so far (`text_offset`).
    let mut offset = 0;
    live.filter_map(move |item| {
        let (text, logprobs, finish) = match item {
            Ok(Live::Text {
                content, logprobs, ..
            }) if content.is_empty() && logprobs.is_empty() => return None,
            Ok(Live::Text {
                content, logprobs, ..
            }) => (content, logprobs, None),
            Ok(Live::Finished { reason, usage }) => {
                (String::new(), Vec::new(), Some((reason, usage)))
            }
            Err(error) => return Some(Err(ApiError::from_engine(&error))),
        };
        let reason = finish.map(|(reason, _)| reason);
        let mut chunk = completion_chunk(&id, &served, created, index, &text, reason);
        if with_logprobs && finish.is_none() {
            chunk["choices"][0]["logprobs"] = completion_logprobs(&logprobs, offset);
            offset += logprobs.iter().map(|t| t.chosen.text.len()).sum::<usize>();
        }
        if let Some((_, usage)) = finish {
            chunk["usage"] = usage_body(usage.prompt_tokens, usage.completion_tokens);
        } else if include_usage {
            chunk["usage"] = Value::Null;
        }
        Some(Ok(chunk))
    })
}

/// A streamed choice's chunks.
pub type ChoiceStream = Pin<Box<dyn Stream<Item = Result<Value, ApiError>> + Send>>;

impl ApiRequest {
    /// The stream chunks of choice `index` while `events` generates it (see the module
    /// documentation for their shape). An engine error is the last item; dropping the stream
    /// aborts the request.
    pub fn choice_stream(
        &self,
        index: usize,
        response_id: &str,
        served: &ServedModel,
        created: u64,
        events: EventStream,
    ) -> ChoiceStream {
        let prompt_tokens = events.prompt_tokens();
        self.live_choice_stream(
            index,
            response_id,
            served,
            created,
            prompt_tokens,
            live(events),
        )
    }

    /// [`ApiRequest::choice_stream`] over the request's pieces.
    fn live_choice_stream(
        &self,
        index: usize,
        response_id: &str,
        served: &ServedModel,
        created: u64,
        prompt_tokens: usize,
        live: impl Stream<Item = Result<Live, EngineError>> + Send + 'static,
    ) -> ChoiceStream {
        let Some(chat) = &self.chat else {
            return Box::pin(completion_stream(
                live,
                response_id.to_string(),
                served.clone(),
                created,
                (index, self.include_usage, self.logprobs.is_some()),
            ));
        };
        let failed: Arc<Mutex<Option<EngineError>>> = Arc::default();
        let slot = failed.clone();
        // Log-probabilities of the text the parser has taken in, for its next chunk.
        let taken: Arc<Mutex<Vec<ReportedLogprobs>>> = Arc::default();
        let taking = taken.clone();
        let with_logprobs = self.logprobs.is_some();
        let ready = InferenceChunk::Ready {
            system_fingerprint: None,
            prompt_usage: PromptUsage {
                prompt_tokens,
                prompt_cache_hit_tokens: 0,
            },
        };
        let inference = tokio_stream::iter([ready]).chain(live.map_while(move |item| match item {
            Ok(Live::Text {
                content,
                tokens,
                logprobs,
            }) => {
                taking
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(logprobs);
                Some(InferenceChunk::Text {
                    content,
                    token_count: tokens,
                })
            }
            Ok(Live::Finished { reason, .. }) => Some(InferenceChunk::Finish {
                finish_reason: finish_reason(reason),
            }),
            Err(error) => {
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
                None
            }
        }));
        // The parser ends its output with a finish of its own when the input stops early; an
        // engine error replaces it.
        let mut stopped = false;
        let chunks =
            chat_chunks(chat, index, response_id, served, inference).map_while(move |chunk| {
                if stopped {
                    return None;
                }
                if let Some(error) = failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    stopped = true;
                    return Some(Err(ApiError::from_engine(&error)));
                }
                let mut chunk = chunk
                    .map_err(output_error)
                    .and_then(|c| serde_json::to_value(c).map_err(output_error));
                let first = chunk
                    .as_mut()
                    .ok()
                    .and_then(|c| c.get_mut("choices")?.get_mut(0));
                if let Some(choice) = first {
                    let mut taken = taken.lock().unwrap_or_else(|e| e.into_inner());
                    if with_logprobs && !taken.is_empty() {
                        choice["logprobs"] = chat_logprobs(&std::mem::take(&mut *taken));
                    }
                }
                Some(chunk)
            });
        Box::pin(chunks)
    }

    /// Chat: the chunks of choice `index` for the engine output `inference` (text deltas as
    /// `InferenceChunk::Text`, then `Finish`). `None` for a completions request.
    pub fn chat_choice_chunks<S>(
        &self,
        index: usize,
        response_id: &str,
        served: &ServedModel,
        inference: S,
    ) -> Option<impl Stream<Item = Result<ChatCompletionChunk, StreamError>> + Send + use<S>>
    where
        S: Stream<Item = InferenceChunk> + Send,
    {
        let chat = self.chat.as_ref()?;
        Some(chat_chunks(chat, index, response_id, served, inference))
    }

    /// The whole response body for the finished choices (in choice order).
    pub async fn response(
        &self,
        served: &ServedModel,
        choices: &[Completion],
        created: u64,
    ) -> Result<Value, ApiError> {
        let Some(first) = choices.first() else {
            return Err(ApiError::request("no choice was generated"));
        };
        let id = response_id(self.endpoint, first.id.get());
        let prompt_tokens = first.usage.prompt_tokens;
        let completion_tokens: usize = choices.iter().map(|c| c.usage.completion_tokens).sum();
        let usage = usage_body(prompt_tokens, completion_tokens);
        if self.endpoint == Endpoint::Completions {
            let choices: Vec<Value> = choices
                .iter()
                .enumerate()
                .map(|(index, done)| {
                    let logprobs = match self.logprobs {
                        Some(_) => completion_logprobs(&done.logprobs, 0),
                        None => Value::Null,
                    };
                    json!({"index": index, "text": done.text, "logprobs": logprobs,
                           "finish_reason": done.reason.as_str()})
                })
                .collect();
            return Ok(json!({
                "id": id, "object": "text_completion", "created": created,
                "model": served.name, "choices": choices, "usage": usage,
            }));
        }
        let mut response =
            ChatCompletionResponse::new(id.clone(), served.name.clone(), created, prompt_tokens, 0);
        for (index, done) in choices.iter().enumerate() {
            let input = tokio_stream::iter(inference_chunks(done));
            let Some(chunks) = self.chat_choice_chunks(index, &id, served, input) else {
                return Err(ApiError::request("not a chat request"));
            };
            let mut chunks = std::pin::pin!(chunks);
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk.map_err(output_error)?;
                response.accumulate(chunk);
            }
        }
        // The parser reports each choice's usage; the response counts the prompt once and
        // every choice's tokens.
        let mut body = serde_json::to_value(&response).map_err(|e| ApiError {
            status: 500,
            message: e.to_string(),
            kind: "server_error",
            param: None,
            code: "internal",
        })?;
        body["usage"] = usage;
        if self.logprobs.is_some()
            && let Some(listed) = body["choices"].as_array_mut()
        {
            for choice in listed {
                let done = choice["index"]
                    .as_u64()
                    .and_then(|index| choices.get(index as usize));
                if let Some(done) = done {
                    choice["logprobs"] = chat_logprobs(&done.logprobs);
                }
            }
        }
        Ok(body)
    }
}

/// A completions stream chunk: `text` of choice `index`, and its finish reason on the last one.
pub fn completion_chunk(
    id: &str,
    served: &ServedModel,
    created: u64,
    index: usize,
    text: &str,
    finish: Option<FinishReason>,
) -> Value {
    json!({
        "id": id, "object": "text_completion", "created": created, "model": served.name,
        "choices": [{"index": index, "text": text, "logprobs": null,
                     "finish_reason": finish.map(FinishReason::as_str)}],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::request::{parse_chat, parse_completion, test_served as served};
    use deepinfer_topology::RequestId;

    fn done(id: u64, text: &str, reason: FinishReason, tokens: usize) -> Completion {
        Completion {
            id: RequestId(id),
            tokens: Vec::new(),
            text: text.into(),
            reason,
            usage: Usage {
                prompt_tokens: 10,
                completion_tokens: tokens,
            },
            logprobs: Vec::new(),
        }
    }

    async fn chat_response(body: Value, choices: &[Completion]) -> Value {
        let request = parse_chat(&body, &served()).unwrap();
        request.response(&served(), choices, 5).await.unwrap()
    }

    #[tokio::test]
    async fn reasoning_goes_to_reasoning_content_never_content() {
        let body = json!({"model": "asked-for", "messages": [{"role": "user", "content": "Hi"}],
                          "thinking": {"type": "enabled"}});
        let out = chat_response(
            body,
            &[done(
                4,
                "Plan it.</think>The answer.",
                FinishReason::Stop,
                6,
            )],
        )
        .await;
        let message = &out["choices"][0]["message"];
        assert_eq!(message["reasoning_content"], "Plan it.");
        assert_eq!(message["content"], "The answer.");
        assert_eq!(
            out["model"], "served-model",
            "the served model, not the asked one"
        );
        assert_eq!(out["id"], "chatcmpl-4");
        assert_eq!(out["object"], "chat.completion");
        // Without thinking, the whole text is the answer.
        let plain = json!({"messages": [{"role": "user", "content": "Hi"}]});
        let out = chat_response(plain, &[done(1, "Just this.", FinishReason::Length, 3)]).await;
        assert_eq!(out["choices"][0]["message"]["content"], "Just this.");
        assert_eq!(out["choices"][0]["message"].get("reasoning_content"), None);
        assert_eq!(out["choices"][0]["finish_reason"], "length");
    }

    #[tokio::test]
    async fn dsml_tool_calls_become_tool_calls() {
        let body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"type": "function", "function": {"name": "forecast", "parameters":
                {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]});
        let d = "｜DSML｜";
        let text = format!(
            "Checking.\n\n<{d}tool_calls>\n<{d}invoke name=\"forecast\">\n\
             <{d}parameter name=\"city\" string=\"true\">Paris</{d}parameter>\n\
             <{d}parameter name=\"days\" string=\"false\">3</{d}parameter>\n\
             </{d}invoke>\n</{d}tool_calls>"
        );
        let out = chat_response(body, &[done(2, &text, FinishReason::Stop, 30)]).await;
        let choice = &out["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{out}");
        assert_eq!(choice["message"]["content"], "Checking.");
        let call = &choice["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "forecast");
        let arguments: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(arguments, json!({"city": "Paris", "days": 3}));
    }

    #[tokio::test]
    async fn n_choices_are_indexed_and_usage_counts_them_all() {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}], "n": 2});
        let out = chat_response(
            body,
            &[
                done(7, "one", FinishReason::Stop, 2),
                done(8, "two", FinishReason::Length, 5),
            ],
        )
        .await;
        let choices = out["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        assert_eq!(
            (choices[0]["index"].clone(), choices[1]["index"].clone()),
            (json!(0), json!(1))
        );
        assert_eq!(choices[1]["message"]["content"], "two");
        assert_eq!(
            out["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17})
        );
        let request = parse_completion(&json!({"prompt": "x", "n": 2}), &served()).unwrap();
        let out = request
            .response(
                &served(),
                &[
                    done(3, " a", FinishReason::Stop, 1),
                    done(4, " b", FinishReason::Length, 2),
                ],
                9,
            )
            .await
            .unwrap();
        assert_eq!(out["object"], "text_completion");
        assert_eq!(out["model"], "served-model");
        assert_eq!(out["choices"][1]["text"], " b");
        assert_eq!(out["choices"][1]["finish_reason"], "length");
        assert_eq!(out["usage"]["completion_tokens"], 3);
    }

    fn text(content: &str, tokens: usize) -> Result<Live, EngineError> {
        Ok(Live::Text {
            content: content.into(),
            tokens,
            logprobs: Vec::new(),
        })
    }

    fn finished(reason: FinishReason, tokens: usize) -> Result<Live, EngineError> {
        Ok(Live::Finished {
            reason,
            usage: Usage {
                prompt_tokens: 10,
                completion_tokens: tokens,
            },
        })
    }

    async fn streamed(request: &ApiRequest, live: Vec<Result<Live, EngineError>>) -> Vec<Value> {
        let chunks =
            request.live_choice_stream(1, "id-1", &served(), 5, 10, tokio_stream::iter(live));
        chunks
            .map(|c| c.unwrap_or_else(|e| json!({"failed": e.body()})))
            .collect()
            .await
    }

    #[tokio::test]
    async fn streamed_chat_splits_reasoning_and_ends_with_finish_and_usage() {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}],
                          "thinking": {"type": "enabled"}, "stream": true,
                          "stream_options": {"include_usage": true}});
        let request = parse_chat(&body, &served()).unwrap();
        let live = vec![
            text("Plan", 1),
            text(" it.</think>The", 2),
            text("", 1),
            text(" answer.", 1),
            finished(FinishReason::Stop, 5),
        ];
        let chunks = streamed(&request, live).await;
        assert_eq!(chunks[0]["object"], "chat.completion.chunk");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks[0]["model"], "served-model");
        let field = |name: &str| -> String {
            chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"][name].as_str())
                .collect()
        };
        assert_eq!(field("reasoning_content"), "Plan it.");
        assert_eq!(field("content"), "The answer.");
        assert!(chunks.iter().all(|c| c["choices"][0]["index"] == 1));
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert_eq!(last["usage"]["completion_tokens"], 5);
        assert!(
            chunks[..chunks.len() - 1]
                .iter()
                .all(|c| c["usage"].is_null())
        );
    }

    #[tokio::test]
    async fn an_engine_error_ends_a_stream() {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}], "stream": true});
        let request = parse_chat(&body, &served()).unwrap();
        let chunks = streamed(
            &request,
            vec![text("Hel", 1), Err(EngineError::ShuttingDown)],
        )
        .await;
        let last = chunks.last().unwrap();
        assert_eq!(
            last["failed"]["error"]["code"], "shutting_down",
            "{chunks:?}"
        );
        assert!(
            chunks
                .iter()
                .all(|c| c["choices"][0]["finish_reason"].is_null())
        );
        let request = parse_completion(&json!({"prompt": "x", "stream": true}), &served()).unwrap();
        let chunks = streamed(&request, vec![text("a", 1), Err(EngineError::ShuttingDown)]).await;
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[1]["failed"]["error"]["type"], "server_error");
    }

    #[tokio::test]
    async fn streamed_completions_carry_text_then_finish_and_usage() {
        let body =
            json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}});
        let request = parse_completion(&body, &served()).unwrap();
        let live = vec![
            text(" a", 1),
            text("", 1),
            text(" b", 1),
            finished(FinishReason::Length, 3),
        ];
        let chunks = streamed(&request, live).await;
        assert_eq!(chunks.len(), 3, "{chunks:?}");
        assert_eq!(chunks[0]["object"], "text_completion");
        assert_eq!(chunks[0]["id"], "id-1");
        assert_eq!(
            (
                chunks[0]["choices"][0]["text"].clone(),
                chunks[0]["usage"].clone()
            ),
            (json!(" a"), Value::Null)
        );
        assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(chunks[2]["choices"][0]["index"], 1);
        assert_eq!(
            chunks[2]["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13})
        );
        let models = model_list(&served(), 7);
        assert_eq!(models["data"][0]["id"], "served-model");
    }

    /// The streaming path a server uses: text deltas in, chunks of choice `index` out, the
    /// reasoning split from the answer across delta boundaries.
    #[tokio::test]
    async fn chat_chunks_stream_the_deltas_of_one_choice() {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}],
                          "reasoning_effort": "high", "n": 3});
        let request = parse_chat(&body, &served()).unwrap();
        let text = |content: &str| InferenceChunk::Text {
            content: content.into(),
            token_count: 1,
        };
        let input = tokio_stream::iter(vec![
            text("Pla"),
            text("n</think>Ans"),
            text("wer"),
            InferenceChunk::Finish {
                finish_reason: InferenceFinishReason::Stop,
            },
        ]);
        let chunks = request
            .chat_choice_chunks(2, "chatcmpl-9", &served(), input)
            .expect("a chat request");
        let chunks: Vec<Value> = chunks
            .map(|c| serde_json::to_value(c.expect("parses")).unwrap())
            .collect()
            .await;
        let (mut reasoning, mut content) = (String::new(), String::new());
        for chunk in &chunks {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["model"], "served-model");
            let choice = &chunk["choices"][0];
            assert_eq!(choice["index"], 2);
            reasoning.push_str(choice["delta"]["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        }
        assert_eq!((reasoning.as_str(), content.as_str()), ("Plan", "Answer"));
        let last = &chunks.last().unwrap()["choices"][0];
        assert_eq!(last["finish_reason"], "stop");
        let completion =
            completion_chunk("cmpl-1", &served(), 4, 1, " a", Some(FinishReason::Length));
        assert_eq!(completion["choices"][0]["finish_reason"], "length");
        assert_eq!(completion["choices"][0]["index"], 1);
        assert_eq!(completion["model"], "served-model");
    }

    /// Log-probabilities of tokens `texts` (ids 100.., ln p = −0.5·i, two alternatives each).
    fn reported(texts: &[&str]) -> Vec<ReportedLogprobs> {
        texts
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let token = |id: u32, text: &str, logprob: f32| ReportedToken {
                    id,
                    text: text.into(),
                    logprob,
                };
                ReportedLogprobs {
                    chosen: token(100 + i as u32, text, -0.5 * i as f32),
                    top: vec![token(7, "x", -0.25), token(8, "y", f32::NEG_INFINITY)],
                }
            })
            .collect()
    }

    #[tokio::test]
    async fn responses_carry_logprobs_shaped_as_openai_when_asked() {
        let mut answer = done(3, "Hi there", FinishReason::Stop, 2);
        answer.logprobs = reported(&["Hi", " there"]);
        let body = json!({"messages": [{"role": "user", "content": "Hi"}],
                          "logprobs": true, "top_logprobs": 2});
        let out = chat_response(body, std::slice::from_ref(&answer)).await;
        let content = &out["choices"][0]["logprobs"]["content"];
        assert_eq!(content.as_array().map(Vec::len), Some(2), "{out}");
        assert_eq!(content[1]["token"], " there");
        assert_eq!(content[1]["logprob"], -0.5);
        assert_eq!(content[1]["bytes"], json!(b" there".to_vec()));
        assert_eq!(
            content[0]["top_logprobs"][0],
            json!({"token": "x", "logprob": -0.25, "bytes": [120]})
        );
        assert_eq!(content[0]["top_logprobs"][1]["logprob"], -9999.0);
        // Not asked: null, as OpenAI answers.
        let plain = json!({"messages": [{"role": "user", "content": "Hi"}]});
        let out = chat_response(plain, std::slice::from_ref(&answer)).await;
        assert!(out["choices"][0]["logprobs"].is_null(), "{out}");

        let request = parse_completion(&json!({"prompt": "x", "logprobs": 2}), &served()).unwrap();
        let out = request.response(&served(), &[answer], 9).await.unwrap();
        let logprobs = &out["choices"][0]["logprobs"];
        assert_eq!(logprobs["tokens"], json!(["Hi", " there"]));
        assert_eq!(logprobs["token_logprobs"], json!([0.0, -0.5]));
        assert_eq!(logprobs["text_offset"], json!([0, 2]));
        assert_eq!(
            logprobs["top_logprobs"][1],
            json!({"x": -0.25, "y": -9999.0})
        );
    }

    /// Every chunk's `choices[0].logprobs[field]` items, in order.
    fn streamed_logprobs<'a>(
        chunks: &'a [Value],
        field: &'a str,
    ) -> impl Iterator<Item = &'a Value> {
        chunks
            .iter()
            .filter_map(move |c| c["choices"][0]["logprobs"][field].as_array())
            .flatten()
    }

    #[tokio::test]
    async fn streams_carry_every_tokens_logprobs_once_in_order() {
        let piece = |content: &str, texts: &[&str]| {
            Ok(Live::Text {
                content: content.into(),
                tokens: texts.len(),
                logprobs: reported(texts),
            })
        };
        let live = || {
            vec![
                piece("Plan", &["Plan"]),
                piece(" it.</think>The", &[" it", ".</think>", "The"]),
                piece("", &[]),
                piece(" answer.", &[" answer."]),
                finished(FinishReason::Stop, 6),
            ]
        };
        let body = json!({"messages": [{"role": "user", "content": "Hi"}], "stream": true,
                          "thinking": {"type": "enabled"}, "logprobs": true, "top_logprobs": 2});
        let request = parse_chat(&body, &served()).unwrap();
        let chunks = streamed(&request, live()).await;
        let tokens: Vec<Value> = streamed_logprobs(&chunks, "content")
            .map(|entry| entry["token"].clone())
            .collect();
        assert_eq!(
            tokens,
            json!(["Plan", " it", ".</think>", "The", " answer."])
                .as_array()
                .unwrap()
                .clone(),
            "{chunks:?}"
        );

        let body = json!({"prompt": "x", "stream": true, "logprobs": 1});
        let request = parse_completion(&body, &served()).unwrap();
        let chunks = streamed(&request, live()).await;
        let offsets: Vec<Value> = streamed_logprobs(&chunks, "text_offset").cloned().collect();
        assert_eq!(
            offsets,
            [0, 4, 7, 16, 19].map(|o| json!(o)).to_vec(),
            "{chunks:?}"
        );
    }
}
