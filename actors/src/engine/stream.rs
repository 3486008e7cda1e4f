//! `EventStream`: one request's events as the caller sees them.
//!
//! Owns the request's raw channel from its scheduler, turns token ids into text deltas (when the
//! engine has a tokenizer), applies text stop sequences (holding back text that could still
//! become a stop sequence), and tells the runtime when the request ends: dropping an unfinished
//! stream aborts the request; every stream releases its admission slot exactly once.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use deepinfer_topology::{DpRank, RequestId};
use ractor::ActorRef;

use crate::engine::request::Submission;
use crate::error::EngineError;
use crate::frontend::codec::TextCodec;
use crate::messages::frontend::FrontendMsg;
use crate::messages::request::{FinishReason, RawEvent, Usage};
use crate::messages::scheduler::SchedulerMsg;
use crate::metrics as m;
use crate::sampling::TokenLogprobs;

/// What a caller receives for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// A generated token and the text it completes (may be empty while a multi-byte character or
    /// a possible stop sequence is pending); its log-probabilities when the request asked
    /// (`GenerateRequest::logprobs`).
    Token {
        id: u32,
        text: String,
        logprobs: Option<Box<ReportedLogprobs>>,
    },
    /// The end: why, the token counts and the whole generated text.
    Finished {
        reason: FinishReason,
        usage: Usage,
        text: String,
    },
    /// The request failed; no more events follow.
    Error(EngineError),
}

/// A finished request, collected.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: RequestId,
    pub tokens: Vec<u32>,
    pub text: String,
    pub reason: FinishReason,
    pub usage: Usage,
    /// One per token of `tokens` when the request asked for log-probabilities, else empty.
    pub logprobs: Vec<ReportedLogprobs>,
}

/// A token as log-probabilities name it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportedToken {
    pub id: u32,
    /// The token decoded alone (empty without a tokenizer; a piece of a multi-byte character
    /// decodes to U+FFFD).
    pub text: String,
    /// `ln p` under the distribution of `sampling::token_logprobs`.
    pub logprob: f32,
}

/// A generated token's log-probabilities as the caller sees them.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportedLogprobs {
    pub chosen: ReportedToken,
    /// The most likely tokens, most likely first, as many as the request asked for.
    pub top: Vec<ReportedToken>,
}

/// The event stream of one request.
#[derive(Debug)]
pub struct EventStream {
    id: RequestId,
    dp: DpRank,
    submission: Submission,
    frontend: ActorRef<FrontendMsg>,
    codec: Option<Arc<TextCodec>>,
    tokens: Vec<u32>,
    /// The log-probabilities of the generated tokens, when the request asked.
    logprobs: Vec<ReportedLogprobs>,
    /// Those of the token whose event comes next.
    next_logprobs: Option<Box<ReportedLogprobs>>,
    /// Bytes of the decoded text already handed out.
    emitted: usize,
    pending: VecDeque<GenerationEvent>,
    done: bool,
    released: bool,
    started: Instant,
}

impl EventStream {
    pub(crate) fn new(
        submission: Submission,
        frontend: ActorRef<FrontendMsg>,
        codec: Option<Arc<TextCodec>>,
    ) -> Self {
        EventStream {
            id: submission.id,
            dp: submission.dp,
            submission,
            frontend,
            codec,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            next_logprobs: None,
            emitted: 0,
            pending: VecDeque::new(),
            done: false,
            released: false,
            started: Instant::now(),
        }
    }

    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The DP rank serving it.
    pub fn dp(&self) -> DpRank {
        self.dp
    }

    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.submission.prompt_tokens
    }

    /// The next event; `None` after the last one.
    pub async fn next(&mut self) -> Option<GenerationEvent> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if self.done {
                return None;
            }
            match self.submission.events.recv().await {
                Some(RawEvent::Token(token)) => self.on_token(token),
                Some(RawEvent::Logprobs(logprobs)) => {
                    self.next_logprobs = Some(Box::new(self.reported(&logprobs)));
                }
                Some(RawEvent::Finished { reason, usage }) => self.finish(reason, usage),
                Some(RawEvent::Failed(error)) => self.fail(error),
                None => self.fail(EngineError::ShuttingDown),
            }
        }
    }

    /// Waits for the end and returns everything generated.
    pub async fn collect(mut self) -> Result<Completion, EngineError> {
        while let Some(event) = self.next().await {
            match event {
                GenerationEvent::Token { .. } => {}
                GenerationEvent::Finished {
                    reason,
                    usage,
                    text,
                } => {
                    return Ok(Completion {
                        id: self.id,
                        tokens: self.tokens.clone(),
                        text,
                        reason,
                        usage,
                        logprobs: std::mem::take(&mut self.logprobs),
                    });
                }
                GenerationEvent::Error(error) => return Err(error),
            }
        }
        Err(EngineError::internal(
            "the event stream ended without a final event",
        ))
    }

    /// Stops the request (same as dropping the stream).
    pub fn abort(self) {}

    /// Log-probabilities with their tokens' text.
    fn reported(&self, logprobs: &TokenLogprobs) -> ReportedLogprobs {
        let token = |id: u32, logprob: f32| ReportedToken {
            id,
            text: self
                .codec
                .as_ref()
                .map(|c| c.decode(&[id]))
                .unwrap_or_default(),
            logprob,
        };
        ReportedLogprobs {
            chosen: token(logprobs.token, logprobs.logprob),
            top: logprobs.top.iter().map(|&(id, lp)| token(id, lp)).collect(),
        }
    }

    fn decoded(&self) -> String {
        self.codec
            .as_ref()
            .map(|c| c.decode(&self.tokens))
            .unwrap_or_default()
    }

    fn on_token(&mut self, token: u32) {
        self.tokens.push(token);
        let logprobs = self.next_logprobs.take();
        if let Some(lp) = &logprobs {
            self.logprobs.push((**lp).clone());
        }
        let Some(codec) = &self.codec else {
            self.pending.push_back(GenerationEvent::Token {
                id: token,
                text: String::new(),
                logprobs,
            });
            return;
        };
        let full = codec.decode(&self.tokens);
        if let Some(at) = self
            .submission
            .stop
            .iter()
            .filter_map(|s| full.find(s.as_str()))
            .min()
        {
            let delta = full.get(self.emitted..at).unwrap_or_default().to_string();
            self.emitted = at.max(self.emitted);
            self.pending.push_back(GenerationEvent::Token {
                id: token,
                text: delta,
                logprobs,
            });
            let _ = self.submission.scheduler.cast(SchedulerMsg::Abort(self.id));
            let usage = Usage {
                prompt_tokens: self.submission.prompt_tokens,
                completion_tokens: self.tokens.len(),
            };
            let text = full[..at].to_string();
            self.end(GenerationEvent::Finished {
                reason: FinishReason::Stop,
                usage,
                text,
            });
            return;
        }
        // Hold back an unfinished character and anything that could start a stop sequence.
        let hold = self
            .submission
            .stop
            .iter()
            .map(|s| s.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        let mut until = full.len().saturating_sub(hold);
        while until > self.emitted && !full.is_char_boundary(until) {
            until -= 1;
        }
        if full[..until].ends_with('\u{FFFD}') {
            until -= '\u{FFFD}'.len_utf8();
        }
        let delta = if until > self.emitted {
            full[self.emitted..until].to_string()
        } else {
            String::new()
        };
        self.emitted = self.emitted.max(until);
        self.pending.push_back(GenerationEvent::Token {
            id: token,
            text: delta,
            logprobs,
        });
    }

    fn finish(&mut self, reason: FinishReason, usage: Usage) {
        let text = self.decoded();
        self.end(GenerationEvent::Finished {
            reason,
            usage,
            text,
        });
    }

    fn fail(&mut self, error: EngineError) {
        self.end(GenerationEvent::Error(error));
    }

    fn end(&mut self, last: GenerationEvent) {
        self.pending.push_back(last);
        self.done = true;
        self.release();
    }

    fn release(&mut self) {
        if !self.released {
            self.released = true;
            m::record_request_duration(self.started.elapsed().as_secs_f64());
            let _ = self.frontend.cast(FrontendMsg::Released {
                dp: self.dp,
                work_tokens: self.submission.work_tokens,
            });
        }
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if !self.done {
            m::record_caller_abort();
            let _ = self.submission.scheduler.cast(SchedulerMsg::Abort(self.id));
        }
        self.release();
    }
}
