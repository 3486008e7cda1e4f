//! The public request type of the embedding API and what the frontend hands back for it.

use deepinfer_topology::{DpRank, RequestId};
use ractor::ActorRef;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::grammar::Constraint;
use crate::messages::request::RawEvent;
use crate::messages::scheduler::SchedulerMsg;

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Token ids, used as they are (no BOS added).
    Tokens(Vec<u32>),
    /// Raw text (an OpenAI `/v1/completions` prompt): BOS + the tokenizer's encoding.
    Text(String),
    /// An OpenAI `/v1/chat/completions` body, rendered with the served family's chat template by
    /// `deepseek-recipe` (thinking mode only when the body asks for it); the sampling fields it
    /// sets (temperature, top_p, seed, max_tokens, stop) override this request's own, and its
    /// `response_format`/`tools` constrain the answer. `crate::openai` builds these from
    /// OpenAI bodies with every field resolved.
    Chat(serde_json::Value),
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// Most generated tokens; `None` = the topology's `[sampling] max_tokens`.
    pub max_tokens: Option<usize>,
    /// 0 = greedy. Default 0.
    pub temperature: f32,
    /// 0 = off. Default 0.
    pub top_k: usize,
    /// 1 = off. Default 1.
    pub top_p: f32,
    /// `None` = the engine draws one per request (from the topology's base seed and the id).
    pub seed: Option<u64>,
    /// Text that ends the generation (not included in the output). Needs a tokenizer.
    pub stop: Vec<String>,
    /// Tokens that end the generation (not included in the output).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the end-of-sequence token.
    pub ignore_eos: bool,
    /// Structured output for a token or text prompt (a chat body's comes from the body).
    pub constraint: Option<Constraint>,
    /// Report each generated token's log-probability and this many alternatives (at most
    /// `sampling::MAX_TOP_LOGPROBS`) with it (`sampling::token_logprobs`); `None` = none.
    pub logprobs: Option<usize>,
}

impl GenerateRequest {
    fn with_prompt(prompt: Prompt) -> Self {
        GenerateRequest {
            prompt,
            max_tokens: None,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            constraint: None,
            logprobs: None,
        }
    }

    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        Self::with_prompt(Prompt::Tokens(tokens))
    }

    pub fn from_text(text: impl Into<String>) -> Self {
        Self::with_prompt(Prompt::Text(text.into()))
    }

    pub fn from_chat(body: serde_json::Value) -> Self {
        Self::with_prompt(Prompt::Chat(body))
    }

    pub fn max_tokens(mut self, n: usize) -> Self {
        self.max_tokens = Some(n);
        self
    }

    pub fn temperature(mut self, t: f32) -> Self {
        self.temperature = t;
        self
    }

    pub fn top_k(mut self, k: usize) -> Self {
        self.top_k = k;
        self
    }

    pub fn top_p(mut self, p: f32) -> Self {
        self.top_p = p;
        self
    }

    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    pub fn stop(mut self, stop: impl Into<String>) -> Self {
        self.stop.push(stop.into());
        self
    }

    pub fn stop_token(mut self, token: u32) -> Self {
        self.stop_token_ids.push(token);
        self
    }

    pub fn constraint(mut self, constraint: Constraint) -> Self {
        self.constraint = Some(constraint);
        self
    }

    pub fn ignore_eos(mut self, ignore: bool) -> Self {
        self.ignore_eos = ignore;
        self
    }

    /// Reports log-probabilities with `top` alternatives per generated token.
    pub fn logprobs(mut self, top: usize) -> Self {
        self.logprobs = Some(top);
        self
    }
}

/// The frontend's answer to an admitted request: where its events arrive and whom to tell
/// when it ends. Turned into an `EventStream` by the engine.
#[derive(Debug)]
pub struct Submission {
    pub id: RequestId,
    pub dp: DpRank,
    pub prompt_tokens: usize,
    /// The work placement counted for it (prompt + max_tokens), released when it ends.
    pub work_tokens: usize,
    pub stop: Vec<String>,
    pub events: UnboundedReceiver<RawEvent>,
    pub scheduler: ActorRef<SchedulerMsg>,
}
