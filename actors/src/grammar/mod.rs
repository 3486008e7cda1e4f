//! Structured outputs: constrain generation to a JSON schema, a regex or a grammar (Lark or
//! GBNF-style EBNF) with llguidance.
//!
//! - [`GrammarEngine`] is built once per tokenizer (byte table, token trie, llguidance factory)
//!   and shared by all requests (`Arc`).
//! - [`Constraint`] is what a request asks for; it comes from deepseek-recipe's
//!   `OutputConstraint` ([`Constraint::from_output_constraint`]; tools become the DSML tool-call
//!   grammar of [`ToolCallsConstraint`]) or from the grammar extension of
//!   the request body ([`take_grammar_response_format`]):
//!   `"response_format": {"type": "grammar", "grammar": "<source>", "syntax": "lark" | "ebnf"}`
//!   (`syntax` defaults to `lark`, llguidance's Lark dialect; `ebnf` is GBNF-style `root ::= ...`).
//! - [`GrammarMatcher`] is one request's state: the mask for the next token, advance, rollback
//!   and per-position masks for speculative drafts. In thinking mode it lets the reasoning
//!   through unconstrained and constrains the answer after `</think>`.
//! - [`MaskWorkers`] computes masks on CPU threads while the device step runs.
//! - [`StepMask`] / [`TokenMask`] apply a mask to logits (disallowed = -inf) before sampling noise.
//!
//! Integration, in order:
//! 1. At start: `Arc<GrammarEngine>` from the model's `tokenizer.json`; `MaskWorkers::new(n)`.
//! 2. Per request, before deepseek-recipe parses the body: [`take_grammar_response_format`];
//!    otherwise [`Constraint::from_output_constraint`] on the converted request's
//!    `output_constraint`. [`GrammarEngine::compile`] (an error fails this request only), then
//!    [`GrammarEngine::matcher`] with [`GrammarEngine::constraint_start`] of the prompt ids.
//! 3. Per step: hand the matchers to [`MaskWorkers::compute`] (with the draft tokens under DSpark)
//!    before launching the device step (its constrained rows' logits stay on the device);
//!    [`MaskBatch::wait`] right before sampling; [`StepMask::allowed_tokens`] gives the bitset
//!    the device sampler masks with (disallowed = -inf before temperature, top-k/p and noise;
//!    [`StepMask::apply_to_logits`] is the host path for executors without a device); then
//!    [`GrammarMatcher::advance`] with each accepted token (`draft_masks` leaves the matcher
//!    unchanged, so advance with the accepted prefix and the bonus token).

mod constraint;
mod ebnf;
mod engine;
mod error;
mod mask;
mod matcher;
mod token_env;
mod tool_calls;
mod workers;

pub use constraint::{Constraint, GRAMMAR_RESPONSE_FORMAT_TYPE, take_grammar_response_format};
pub use engine::{CompiledGrammar, GrammarEngine, JSON_WHITESPACE_PATTERN, MAX_CONSTRAINT_BYTES};
pub use error::GrammarError;
pub use mask::{StepMask, TokenMask};
pub use matcher::{ConstraintStart, GrammarMatcher};
pub use token_env::{DeepSeekTokEnv, SpecialTokens};
pub use tool_calls::{TOOL_CALLS_KIND, ToolCallsConstraint, ToolSpec};
pub use workers::{MaskBatch, MaskJob, MaskOutcome, MaskWorkers};

/// Token id type of the vocabulary (llguidance's).
pub use toktrie::TokenId;
