//! The OpenAI request surface shared by the offline job and the HTTP server: the bodies of
//! `/v1/chat/completions` and `/v1/completions` validated into engine requests with one table of
//! defaults, ranges and error codes ([`request`]), errors in the OpenAI error object shape
//! ([`error`]), and the responses and stream chunks built from the engine's completions
//! ([`response`]).
//!
//! Use: [`parse`] a body for an [`Endpoint`] against the [`ServedModel`] (an [`ApiError`] is the
//! 400 answer); run each of [`ApiRequest::choice_requests`] on the engine; build the body with
//! [`ApiRequest::response`], or stream each choice's chunks with [`ApiRequest::choice_stream`]
//! (the HTTP server's SSE).

pub mod error;
pub mod request;
pub mod response;

pub use error::ApiError;
pub use request::{
    ApiRequest, DEFAULT_TEMPERATURE, Endpoint, ServedModel, choice_seed, parse, parse_chat,
    parse_completion,
};
pub use response::{
    ChoiceStream, completion_chunk, finish_reason, inference_chunks, model_list, response_id,
    unix_now,
};
