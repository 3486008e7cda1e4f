//! What a request constrains its answer to, and where that comes from: deepseek-recipe's
//! `OutputConstraint` (OpenAI `response_format` json_object / json_schema / regex) and the
//! grammar extension of the request body.

use deepseek_recipe::request::OutputConstraint;
use serde_json::Value;

use super::GrammarError;
use super::tool_calls::{TOOL_CALLS_KIND, ToolCallsConstraint};

/// The `response_format.type` of the grammar extension:
/// `"response_format": {"type": "grammar", "grammar": "<Lark source>"}`.
pub const GRAMMAR_RESPONSE_FORMAT_TYPE: &str = "grammar";

/// A constraint on the answer of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON document valid under this JSON schema (llguidance's supported subset; unsupported
    /// keywords are an error, never silently ignored).
    JsonSchema(Value),
    /// Any JSON object (OpenAI `{"type": "json_object"}`).
    JsonObject,
    /// Text fully matching this regular expression (Rust `regex` syntax).
    Regex(String),
    /// Text in the language of this grammar, in llguidance's Lark dialect (an EBNF: `start` is the
    /// root rule, `"literal"`, `/regex/`, `|`, `*`, `+`, `?`, `( )`, `%json {schema}`; special
    /// tokens as `<[128825]>` or `<think>`).
    Lark(String),
    /// Text in the language of a GBNF-style EBNF grammar (`root ::= ...`, `"literal"`, `[a-z]`,
    /// `|`, `*`, `+`, `?`, `{m,n}`, `( )`), translated to Lark before compiling.
    Ebnf(String),
    /// An answer that calls the request's tools in DSML (see `tool_calls.rs`).
    ToolCalls(ToolCallsConstraint),
}

impl Constraint {
    /// The constraint deepseek-recipe selected for a converted request. `Json { schema: None }`
    /// (OpenAI `json_object`) becomes [`Constraint::JsonObject`]; tools with a tool choice other
    /// than `none` become [`Constraint::ToolCalls`].
    pub fn from_output_constraint(constraint: &OutputConstraint) -> Option<Self> {
        match constraint {
            OutputConstraint::Json { schema: None } => Some(Self::JsonObject),
            OutputConstraint::Json {
                schema: Some(schema),
            } => Some(Self::JsonSchema(schema.clone())),
            OutputConstraint::Regex(regex) => Some(Self::Regex(regex.clone())),
            OutputConstraint::ToolCalls { .. } => {
                ToolCallsConstraint::from_output_constraint(constraint).map(Self::ToolCalls)
            }
        }
    }

    /// Short name of the kind, used in error messages and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json_schema",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "grammar",
            Self::Ebnf(_) => "ebnf",
            Self::ToolCalls(_) => TOOL_CALLS_KIND,
        }
    }
}

/// Take the grammar extension out of a chat-completion request body before deepseek-recipe
/// converts it (its `response_format` accepts only text, json_object, json_schema and regex).
///
/// If `body.response_format` is `{"type": "grammar", "grammar": "<source>"}`, with an optional
/// `"syntax": "lark"` (the default) or `"syntax": "ebnf"` (GBNF-style), removes `response_format`
/// from the body and returns the constraint; any other body is left unchanged and gives `None`. A
/// grammar response format with a missing, non-string, empty or unknown field is an error for
/// this request.
pub fn take_grammar_response_format(body: &mut Value) -> Result<Option<Constraint>, GrammarError> {
    let Some(object) = body.as_object_mut() else {
        return Ok(None);
    };
    let is_grammar = object
        .get("response_format")
        .and_then(|format| format.get("type"))
        .and_then(Value::as_str)
        == Some(GRAMMAR_RESPONSE_FORMAT_TYPE);
    if !is_grammar {
        return Ok(None);
    }
    let field = |message: String| GrammarError::RequestField {
        field: "response_format",
        message,
    };
    let Some(Value::Object(format)) = object.remove("response_format") else {
        return Err(field("must be an object".to_string()));
    };
    if let Some(unknown) = format
        .keys()
        .find(|k| !["type", "grammar", "syntax"].contains(&k.as_str()))
    {
        return Err(field(format!(
            "unknown field `{unknown}` in a grammar response format \
             (expected `type`, `grammar`, `syntax`)"
        )));
    }
    let grammar = match format.get("grammar") {
        Some(Value::String(grammar)) if !grammar.trim().is_empty() => grammar.clone(),
        Some(Value::String(_)) => return Err(field("`grammar` is empty".to_string())),
        Some(_) => return Err(field("`grammar` must be a string".to_string())),
        None => {
            return Err(field(
                "a grammar response format needs a `grammar` string".to_string(),
            ));
        }
    };
    match format.get("syntax").map(|s| s.as_str()) {
        None | Some(Some("lark")) => Ok(Some(Constraint::Lark(grammar))),
        Some(Some("ebnf")) => Ok(Some(Constraint::Ebnf(grammar))),
        Some(other) => Err(field(format!(
            "`syntax` must be \"lark\" or \"ebnf\", not {}",
            other.map_or_else(|| "a non-string".to_string(), |s| format!("{s:?}"))
        ))),
    }
}
