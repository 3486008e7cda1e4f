//! The per-tokenizer grammar engine: the token environment and llguidance's parser factory,
//! built once and shared; compiles request constraints and starts per-request matchers.

use std::path::Path;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{ParserFactory, TokenParser};
use serde_json::Value;
use toktrie::{TokEnv, TokenId};

use super::ebnf::ebnf_to_lark;
use super::{
    Constraint, ConstraintStart, DeepSeekTokEnv, GrammarError, GrammarMatcher, SpecialTokens,
};

/// Largest constraint text (schema JSON, regex or grammar) a request may send.
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;

/// Whitespace allowed between JSON tokens unless the schema says otherwise (llguidance's
/// `"x-guidance": {...}` options in the schema win). Bounded, so a model cannot spend its whole
/// budget on whitespace (llguidance's default is an unbounded run at every boundary).
pub const JSON_WHITESPACE_PATTERN: &str = r"[\x20\x0A\x0D\x09]{1,40}";

/// Built once per tokenizer (about 0.4 s in release, a few seconds in debug); share it in an
/// `Arc`. Compiling a constraint and starting a matcher are per request and cheap (~1 ms).
pub struct GrammarEngine {
    env: Arc<DeepSeekTokEnv>,
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEngine")
            .field("env", &self.env)
            .finish_non_exhaustive()
    }
}

/// A compiled constraint: the llguidance parser in its start state. Clone it to start several
/// requests with the same constraint without compiling again.
#[derive(Clone)]
pub struct CompiledGrammar {
    parser: TokenParser,
    kind: &'static str,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl CompiledGrammar {
    /// The constraint kind it was compiled from (`json_schema`, `json_object`, `regex`, `grammar`).
    pub fn kind(&self) -> &'static str {
        self.kind
    }
}

impl GrammarEngine {
    /// Build the engine over a token environment.
    pub fn new(env: DeepSeekTokEnv) -> Result<Self, GrammarError> {
        let env = Arc::new(env);
        let tok_env: TokEnv = env.clone();
        let mut factory = ParserFactory::new_simple(&tok_env)
            .map_err(|e| GrammarError::EngineSetup(e.to_string()))?;
        // Errors come back as values; nothing is printed on stderr per request.
        factory.quiet();
        Ok(Self { env, factory })
    }

    /// Build the token environment from a `tokenizer.json` file and the engine over it.
    pub fn from_tokenizer_file(path: &Path) -> Result<Self, GrammarError> {
        Self::new(DeepSeekTokEnv::from_file(path)?)
    }

    /// The token environment (byte table, trie, plain-text tokenizer).
    pub fn token_env(&self) -> &DeepSeekTokEnv {
        &self.env
    }

    /// EOS and the thinking tokens.
    pub fn special_tokens(&self) -> SpecialTokens {
        self.env.special_tokens()
    }

    /// Width of every mask.
    pub fn vocab_size(&self) -> usize {
        self.env.vocab_size()
    }

    /// Compile a request's constraint. An invalid or unsupported schema, regex or grammar is an
    /// error for this request only.
    pub fn compile(&self, constraint: &Constraint) -> Result<CompiledGrammar, GrammarError> {
        let kind = constraint.kind();
        let check_size = |size: usize| {
            if size > MAX_CONSTRAINT_BYTES {
                Err(GrammarError::ConstraintTooLarge {
                    kind,
                    size,
                    limit: MAX_CONSTRAINT_BYTES,
                })
            } else {
                Ok(())
            }
        };
        let grammar = match constraint {
            Constraint::JsonSchema(schema) => {
                check_size(schema.to_string().len())?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::InvalidConstraint {
                        kind,
                        message: "a JSON schema must be an object or a boolean".to_string(),
                    });
                }
                TopLevelGrammar::from_json_schema(with_default_json_options(schema.clone()))
            }
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(with_default_json_options(
                serde_json::json!({"type": "object"}),
            )),
            Constraint::Regex(regex) => {
                check_size(regex.len())?;
                TopLevelGrammar::from_regex(regex)
            }
            Constraint::Lark(grammar) => {
                check_size(grammar.len())?;
                TopLevelGrammar::from_lark(grammar.clone())
            }
            Constraint::Ebnf(grammar) => {
                check_size(grammar.len())?;
                TopLevelGrammar::from_lark(ebnf_to_lark(grammar)?)
            }
            Constraint::ToolCalls(tools) => {
                let dsml = self
                    .special_tokens()
                    .dsml
                    .ok_or(GrammarError::MissingSpecialToken(
                        "｜DSML｜ (needed for tool calls)",
                    ))?;
                let grammar = tools.to_lark(dsml)?;
                check_size(grammar.len())?;
                TopLevelGrammar::from_lark(grammar)
            }
        };
        let parser =
            self.factory
                .create_parser(grammar)
                .map_err(|e| GrammarError::InvalidConstraint {
                    kind,
                    message: e.to_string(),
                })?;
        Ok(CompiledGrammar { parser, kind })
    }

    /// Where the constraint starts for a prompt: after the reasoning section when the prompt's
    /// last thinking marker is `<think>` (thinking mode), otherwise at the first output token.
    pub fn constraint_start(&self, prompt: &[TokenId]) -> ConstraintStart {
        let special = self.special_tokens();
        let last_marker = prompt
            .iter()
            .rev()
            .find(|&&t| t == special.think_start || t == special.think_end);
        if last_marker == Some(&special.think_start) {
            ConstraintStart::AfterReasoning
        } else {
            ConstraintStart::Answer
        }
    }

    /// Start one request's matcher.
    pub fn matcher(&self, grammar: &CompiledGrammar, start: ConstraintStart) -> GrammarMatcher {
        GrammarMatcher::new(
            llguidance::Matcher::new(Ok(grammar.parser.clone())),
            start,
            self.special_tokens(),
            self.vocab_size(),
        )
    }
}

/// Add the engine's JSON options to a schema that has none of its own.
fn with_default_json_options(mut schema: Value) -> Value {
    if let Value::Object(object) = &mut schema {
        object
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE_PATTERN}));
    }
    schema
}
