//! Responses and stream chunks of both endpoints, built from the engine's completions.
//!
//! Chat output goes through deepseek-recipe's output parser (the same one for a whole response
//! and for SSE chunks): the reasoning of thinking mode becomes `reasoning_content` (never
//! `content`), DSML tool calls become `tool_calls` with finish reason `tool_calls`, and
//! `json_object` output is cut to its JSON. Completions output is the generated text as is.
//! `model` is always the served model's name.

use deepseek_recipe::openai::ChatCompletionRequest;
use deepseek_recipe::openai::chat_completion::response::{
    ChatCompletionChunk, ChatCompletionResponse,
};
use deepseek_recipe::request::ProtocolRequest;
use deepseek_recipe::response::{Accumulate, ProtocolResponse};
use deepseek_recipe::stream::{
    InferenceChunk, InferenceFinishReason, PromptUsage, StreamError, StreamProcessor,
};
use serde_json::{Value, json};
use tokio_stream::{Stream, StreamExt};

use super::error::ApiError;
use super::request::{ApiRequest, Endpoint, ServedModel};
use crate::engine::stream::Completion;
use crate::messages::request::FinishReason;

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

impl ApiRequest {
    /// Chat: the chunks of choice `index` for the engine output `inference` (text deltas as
    /// `InferenceChunk::Text`, then `Finish`). `None` for a completions request.
    /// The stream owns what it needs (it borrows neither the request nor the arguments).
    pub fn chat_choice_chunks<I: Stream<Item = InferenceChunk> + Send>(
        &self,
        index: usize,
        response_id: &str,
        served: &ServedModel,
        inference: I,
    ) -> Option<impl Stream<Item = Result<ChatCompletionChunk, StreamError>> + Send + use<I>> {
        let chat = self.chat.as_ref()?;
        let generator = ChatCompletionRequest::chunk_generator(
            chat,
            response_id.to_string(),
            served.name.clone(),
        );
        let processor = StreamProcessor::new(generator, chat.parsing_options.clone());
        Some(processor.into_protocol_stream(inference).map(move |chunk| {
            chunk.map(|mut chunk| {
                for choice in &mut chunk.choices {
                    choice.index = index as u32;
                }
                chunk
            })
        }))
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
        let usage = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        });
        if self.endpoint == Endpoint::Completions {
            let choices: Vec<Value> = choices
                .iter()
                .enumerate()
                .map(|(index, done)| {
                    json!({"index": index, "text": done.text, "logprobs": null,
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
                let chunk = chunk.map_err(|e| ApiError {
                    status: 500,
                    message: format!("the output could not be parsed: {e}"),
                    kind: "server_error",
                    param: None,
                    code: "internal",
                })?;
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
    use crate::messages::request::Usage;
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
}
