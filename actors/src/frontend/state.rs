//! The frontend's pure logic: request validation (`prepare`) and bounded admission with
//! routing to the rank with the least outstanding work (`Admission`).

use deepinfer_topology::{DpRank, RequestId};

use crate::engine::request::{GenerateRequest, Prompt};
use crate::error::{EngineError, ValidationError};
use crate::frontend::codec::TextCodec;
use crate::grammar::GrammarEngine;
use crate::messages::rank::SeqGrammar;
use crate::messages::request::RequestSpec;
use crate::sampling::{MAX_TOP_LOGPROBS, SamplingParams};

/// Limits the frontend validates against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrontendLimits {
    /// Admitted, unfinished requests (engine-wide).
    pub admission_capacity: usize,
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Prompt + generated tokens of one sequence (the model's positions).
    pub max_context_tokens: usize,
    /// `max_tokens` when a request sets none.
    pub default_max_tokens: usize,
    /// End of sequence; `None` for a backend without one.
    pub eos_token_id: Option<u32>,
    /// Seeds requests without one: `seed = mix(base_seed, request id)`.
    pub base_seed: u64,
}

/// A request's validated form plus what the event stream needs.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub spec: RequestSpec,
    pub stop: Vec<String>,
}

/// Validates and encodes a request.
pub fn prepare(
    id: RequestId,
    request: &GenerateRequest,
    codec: Option<&TextCodec>,
    grammar: Option<&GrammarEngine>,
    limits: &FrontendLimits,
) -> Result<Prepared, ValidationError> {
    let mut constraint = request.constraint.clone();
    let mut sampling = SamplingParams {
        temperature: request.temperature,
        top_k: request.top_k,
        top_p: request.top_p,
        seed: request
            .seed
            .unwrap_or_else(|| crate::sampling::uniform_seed(limits.base_seed, id.get())),
    };
    let mut max_tokens = request.max_tokens;
    let mut stop = request.stop.clone();
    let prompt = match &request.prompt {
        Prompt::Tokens(tokens) => tokens.clone(),
        Prompt::Text(text) => codec
            .ok_or(ValidationError::NoTokenizer {
                what: "a text prompt",
            })?
            .encode_text(text)?,
        Prompt::Chat(body) => {
            let chat = codec
                .ok_or(ValidationError::NoTokenizer {
                    what: "a chat request",
                })?
                .encode_chat(body)?;
            if let Some(t) = chat.temperature {
                sampling.temperature = t;
            }
            if let Some(p) = chat.top_p {
                sampling.top_p = p;
            }
            if let Some(seed) = chat.seed {
                sampling.seed = seed;
            }
            if let Some(n) = chat.max_tokens {
                max_tokens = Some(n as usize);
            }
            stop.extend(chat.stop);
            if let Some(chat_constraint) = chat.constraint {
                if constraint.is_some() {
                    return Err(ValidationError::Conversion {
                        detail: "the request carries a constraint and so does its chat body's \
                                 `response_format`/`tools`; give one"
                            .into(),
                    });
                }
                constraint = Some(chat_constraint);
            }
            chat.tokens
        }
    };
    if !stop.is_empty() && codec.is_none() {
        return Err(ValidationError::NoTokenizer {
            what: "text stop sequences",
        });
    }
    if prompt.is_empty() {
        return Err(ValidationError::EmptyPrompt);
    }
    if let Some((position, &token)) = prompt
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= limits.vocab_size)
    {
        return Err(ValidationError::TokenOutOfVocab {
            token,
            position,
            vocab: limits.vocab_size,
        });
    }
    if prompt.len() >= limits.max_context_tokens {
        return Err(ValidationError::PromptTooLong {
            len: prompt.len(),
            max: limits.max_context_tokens - 1,
        });
    }
    sampling.validate()?;
    if let Some(top) = request.logprobs.filter(|&top| top > MAX_TOP_LOGPROBS) {
        return Err(ValidationError::OutOfRange {
            field: "top_logprobs",
            value: top.to_string(),
            expected: "at most 20 alternatives",
        });
    }
    if sampling.top_k > limits.vocab_size {
        return Err(ValidationError::OutOfRange {
            field: "top_k",
            value: sampling.top_k.to_string(),
            expected: "at most the vocabulary size",
        });
    }
    let room = limits.max_context_tokens - prompt.len();
    let max_tokens = match max_tokens {
        Some(0) => {
            return Err(ValidationError::OutOfRange {
                field: "max_tokens",
                value: "0".into(),
                expected: ">= 1",
            });
        }
        Some(n) if n > room => {
            return Err(ValidationError::OutOfRange {
                field: "max_tokens",
                value: n.to_string(),
                expected: "at most the context left after the prompt",
            });
        }
        Some(n) => n,
        None => limits.default_max_tokens.min(room),
    };
    let mut stop_token_ids = request.stop_token_ids.clone();
    if let Some(&bad) = stop_token_ids
        .iter()
        .find(|t| **t as usize >= limits.vocab_size)
    {
        return Err(ValidationError::OutOfRange {
            field: "stop_token_ids",
            value: bad.to_string(),
            expected: "token ids inside the vocabulary",
        });
    }
    if let (Some(eos), false) = (limits.eos_token_id, request.ignore_eos) {
        stop_token_ids.push(eos);
    }
    let grammar = match constraint {
        None => None,
        Some(constraint) => {
            let engine = grammar.ok_or(ValidationError::NoTokenizer {
                what: "structured output",
            })?;
            let compiled = engine
                .compile(&constraint)
                .map_err(|e| ValidationError::Grammar {
                    detail: e.to_string(),
                })?;
            let matcher = engine.matcher(&compiled, engine.constraint_start(&prompt));
            // A grammar that compiles but admits no first token (a schema that only refers to
            // itself) fails the request here, not with an empty answer.
            matcher
                .fork()
                .compute_mask()
                .map_err(|e| ValidationError::Grammar {
                    detail: format!(
                        "it admits no answer: {}",
                        e.to_string().lines().next().unwrap_or_default()
                    ),
                })?;
            let end_token = limits.eos_token_id.unwrap_or(0);
            Some(Box::new(SeqGrammar { matcher, end_token }))
        }
    };
    Ok(Prepared {
        spec: RequestSpec {
            id,
            prompt,
            sampling,
            max_tokens,
            stop_token_ids,
            grammar,
            logprobs: request.logprobs,
            prefix_chain: Vec::new(),
        },
        stop,
    })
}

/// Bounded admission and DP load balancing.
///
/// A request's *work* is its prompt plus its `max_tokens`: the tokens its rank will prefill and
/// at most decode. Each rank's outstanding work is the sum over its admitted, unfinished
/// requests; a new request goes to the live rank with the least outstanding work (ties to the
/// lowest rank), so one long prompt weighs like the many short ones it costs, not like one
/// request. With the prefix cache on several ranks, cache affinity comes first: the live rank
/// holding the longest cached prefix of the prompt takes it unless its outstanding work exceeds
/// the least-loaded rank's by more than those cached tokens (`frontend::affinity`). The bound
/// on in-flight requests is engine-wide.
#[derive(Debug)]
pub struct Admission {
    capacity: usize,
    requests: Vec<usize>,
    work_tokens: Vec<usize>,
    down: Vec<bool>,
    closed: bool,
    next_id: u64,
}

impl Admission {
    pub fn new(capacity: usize, ranks: usize) -> Self {
        Admission {
            capacity,
            requests: vec![0; ranks],
            work_tokens: vec![0; ranks],
            down: vec![false; ranks],
            closed: false,
            next_id: 0,
        }
    }

    /// Admitted, unfinished requests (engine-wide).
    pub fn inflight(&self) -> usize {
        self.requests.iter().sum()
    }

    /// Each rank's outstanding work (tokens), in DP order.
    pub fn outstanding_tokens(&self) -> &[usize] {
        &self.work_tokens
    }

    /// A fresh id (ids are never reused within an engine).
    pub fn next_id(&mut self) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        id
    }

    /// Picks the rank for a request of `work_tokens` whose prompt each rank holds `cached`
    /// tokens of (empty: no cache affinity) and counts it there, or says why not.
    pub fn admit(&mut self, work_tokens: usize, cached: &[usize]) -> Result<DpRank, EngineError> {
        if self.closed {
            return Err(EngineError::ShuttingDown);
        }
        if self.inflight() >= self.capacity {
            return Err(EngineError::Overloaded {
                limit: self.capacity,
            });
        }
        let live = || (0..self.requests.len()).filter(|&r| !self.down[r]);
        let least = live().min_by_key(|&r| (self.work_tokens[r], r));
        let cached_on = |r: usize| cached.get(r).copied().unwrap_or(0);
        let holder = live()
            .filter(|&r| cached_on(r) > 0)
            .min_by_key(|&r| (std::cmp::Reverse(cached_on(r)), self.work_tokens[r], r));
        let best = match (holder, least) {
            (Some(h), Some(l)) if self.work_tokens[h] <= self.work_tokens[l] + cached_on(h) => {
                Some(h)
            }
            _ => least,
        };
        let Some(rank) = best else {
            return Err(EngineError::RankFailed {
                dp: 0,
                message: "every DP rank of this engine has failed".into(),
            });
        };
        self.requests[rank] += 1;
        self.work_tokens[rank] += work_tokens;
        Ok(DpRank(rank as u16))
    }

    /// A request of `work_tokens` admitted on `dp` ended.
    pub fn release(&mut self, dp: DpRank, work_tokens: usize) {
        if let Some(n) = self.requests.get_mut(dp.index()) {
            *n = n.saturating_sub(1);
        }
        if let Some(w) = self.work_tokens.get_mut(dp.index()) {
            *w = w.saturating_sub(work_tokens);
        }
    }

    pub fn rank_down(&mut self, dp: DpRank) {
        if let Some(d) = self.down.get_mut(dp.index()) {
            *d = true;
        }
    }

    pub fn close(&mut self) {
        self.closed = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> FrontendLimits {
        FrontendLimits {
            admission_capacity: 3,
            vocab_size: 100,
            max_context_tokens: 16,
            default_max_tokens: 8,
            eos_token_id: Some(1),
            base_seed: 5,
        }
    }

    #[test]
    fn admission_is_bounded_and_routes_to_the_least_loaded_live_rank() {
        let mut a = Admission::new(3, 2);
        assert_eq!(a.admit(10, &[]).unwrap(), DpRank(0));
        assert_eq!(a.admit(10, &[]).unwrap(), DpRank(1));
        assert_eq!(a.admit(10, &[]).unwrap(), DpRank(0));
        assert!(matches!(
            a.admit(10, &[]),
            Err(EngineError::Overloaded { limit: 3 })
        ));
        a.release(DpRank(0), 10);
        a.rank_down(DpRank(0));
        assert_eq!(a.admit(10, &[50, 0]).unwrap(), DpRank(1), "rank 0 is down");
        a.release(DpRank(1), 10);
        a.release(DpRank(1), 10);
        a.rank_down(DpRank(1));
        assert!(matches!(
            a.admit(10, &[]),
            Err(EngineError::RankFailed { .. })
        ));
        a.close();
        assert!(matches!(a.admit(10, &[]), Err(EngineError::ShuttingDown)));
    }

    /// Placement weighs tokens, not requests: after one long request on rank 0, the next
    /// short ones all go to rank 1 until its work catches up.
    #[test]
    fn placement_balances_outstanding_tokens_not_request_counts() {
        let mut a = Admission::new(16, 2);
        assert_eq!(a.admit(1000, &[]).unwrap(), DpRank(0));
        for _ in 0..4 {
            assert_eq!(a.admit(100, &[]).unwrap(), DpRank(1));
        }
        assert_eq!(a.outstanding_tokens(), &[1000, 400]);
        assert_eq!(a.inflight(), 5);
        a.release(DpRank(0), 1000);
        assert_eq!(a.admit(50, &[]).unwrap(), DpRank(0));
        assert_eq!(a.outstanding_tokens(), &[50, 400]);
    }

    /// A request goes to the rank holding its longest cached prefix while that rank's extra
    /// outstanding work is at most the cached tokens; beyond, to the least-loaded rank.
    #[test]
    fn placement_prefers_the_cache_holder_unless_it_is_overloaded() {
        let mut a = Admission::new(16, 3);
        assert_eq!(a.admit(300, &[]).unwrap(), DpRank(0));
        assert_eq!(a.outstanding_tokens(), &[300, 0, 0]);
        // Rank 0 is 300 ahead: a hit of 320 still wins, one of 256 does not.
        assert_eq!(a.admit(10, &[320, 0, 64]).unwrap(), DpRank(0));
        assert_eq!(a.admit(10, &[256, 0, 0]).unwrap(), DpRank(1));
        // The longest prefix wins over a shorter one on a less loaded rank.
        assert_eq!(a.admit(10, &[0, 128, 64]).unwrap(), DpRank(1));
        assert_eq!(a.outstanding_tokens(), &[310, 20, 0]);
    }

    #[test]
    fn prepare_validates_and_fills_defaults() {
        let req = GenerateRequest::from_tokens(vec![5, 6, 7]);
        let p = prepare(RequestId(1), &req, None, None, &limits()).unwrap();
        assert_eq!(
            (p.spec.max_tokens, p.spec.stop_token_ids.clone()),
            (8, vec![1])
        );
        let other = prepare(RequestId(2), &req, None, None, &limits()).unwrap();
        assert_ne!(
            p.spec.sampling.seed, other.spec.sampling.seed,
            "unseeded requests get distinct seeds"
        );
        // The default is cut to the context left.
        let long = GenerateRequest::from_tokens(vec![5; 12]);
        assert_eq!(
            prepare(RequestId(1), &long, None, None, &limits())
                .unwrap()
                .spec
                .max_tokens,
            4
        );
        let cases: Vec<(GenerateRequest, &str)> = vec![
            (GenerateRequest::from_tokens(vec![]), "empty"),
            (GenerateRequest::from_tokens(vec![5, 100]), "position 1"),
            (GenerateRequest::from_tokens(vec![5; 16]), "at most 15"),
            (
                GenerateRequest::from_tokens(vec![5]).max_tokens(0),
                "max_tokens",
            ),
            (
                GenerateRequest::from_tokens(vec![5; 10]).max_tokens(7),
                "max_tokens",
            ),
            (
                GenerateRequest::from_tokens(vec![5]).temperature(-0.5),
                "temperature",
            ),
            (GenerateRequest::from_tokens(vec![5]).top_k(101), "top_k"),
            (GenerateRequest::from_tokens(vec![5]).stop("x"), "tokenizer"),
            (GenerateRequest::from_text("hi"), "tokenizer"),
        ];
        for (req, needle) in cases {
            let err = prepare(RequestId(1), &req, None, None, &limits())
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
        let ignore = GenerateRequest::from_tokens(vec![5])
            .ignore_eos(true)
            .stop_token(9);
        assert_eq!(
            prepare(RequestId(1), &ignore, None, None, &limits())
                .unwrap()
                .spec
                .stop_token_ids,
            vec![9]
        );
    }
}
