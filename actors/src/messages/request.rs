//! What travels with one request through the runtime: the admitted request (validated tokens
//! and limits) and the raw events the scheduler sends back on the request's own channel.

use deepinfer_topology::{DpRank, RequestId};
use tokio::sync::mpsc;

use crate::error::EngineError;
use crate::messages::rank::SeqGrammar;
use crate::prefix_cache::BlockHash;
use crate::sampling::{SamplingParams, TokenLogprobs};

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End of sequence, a stop token or a stop sequence.
    Stop,
    /// `max_tokens` generated.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What a scheduler needs to know about a validated request.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Most generated tokens (>= 1).
    pub max_tokens: usize,
    /// Tokens that end the generation (EOS unless ignored, plus the request's stop ids); they are
    /// not reported as generated tokens.
    pub stop_token_ids: Vec<u32>,
    /// Structured output, handed to the rank with the sequence's first plan.
    pub grammar: Option<Box<SeqGrammar>>,
    /// Alternatives to report with each token's log-probability; `None` = no log-probabilities.
    pub logprobs: Option<usize>,
    /// The keys of the prompt's complete blocks in the ranks' prefix caches
    /// (`prefix_cache::block_chain`), computed once by the frontend; empty with the cache off.
    pub prefix_chain: Vec<BlockHash>,
}

/// A validated request routed to a rank. Built by the frontend only.
#[derive(Debug)]
pub struct Admitted {
    pub dp: DpRank,
    pub spec: RequestSpec,
    /// Where the scheduler sends this request's events.
    pub events: mpsc::UnboundedSender<RawEvent>,
}

/// The scheduler's per-request events (token ids; text is made by the event stream).
#[derive(Debug, Clone)]
pub enum RawEvent {
    Token(u32),
    /// The log-probabilities of the token whose `Token` event comes next (requests that asked).
    Logprobs(Box<TokenLogprobs>),
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(EngineError),
}
