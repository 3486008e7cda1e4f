//! What a request constrains its answer to, and where that comes from: deepseek-recipe's
//! `OutputConstraint` (OpenAI `response_format` json_object / json_schema / regex) and the
//! grammar extension of the request body.

use deepseek_recipe::request::OutputConstraint;
use serde_json::Value;

use super::GrammarError;

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
}

impl Constraint {
    /// The constraint deepseek-recipe selected for a converted request. `Json { schema: None }`
    /// (OpenAI `json_object`) becomes [`Constraint::JsonObject`].
    ///
    /// `ToolCalls` gives `None`: the DSML tool-call grammar is a follow-up, so tool-call blocks are
    /// not enforced during decoding (they are parsed after generation as before).
    pub fn from_output_constraint(constraint: &OutputConstraint) -> Option<Self> {
        match constraint {
            OutputConstraint::Json { schema: None } => Some(Self::JsonObject),
            OutputConstraint::Json {
                schema: Some(schema),
            } => Some(Self::JsonSchema(schema.clone())),
            OutputConstraint::Regex(regex) => Some(Self::Regex(regex.clone())),
            OutputConstraint::ToolCalls { .. } => None,
        }
    }

    /// Short name of the kind, used in error messages and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json_schema",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "grammar",
        }
    }
}

/// Take the grammar extension out of a chat-completion request body before deepseek-recipe
/// converts it (its `response_format` accepts only text, json_object, json_schema and regex).
///
/// If `body.response_format` is `{"type": "grammar", "grammar": "<Lark source>"}`, removes
/// `response_format` from the body and returns `Some(Constraint::Lark)`; any other body is left
/// unchanged and gives `None`. A grammar response format with a missing, non-string, empty or
/// unknown field is an error for this request.
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
    if let Some(unknown) = format.keys().find(|k| *k != "type" && *k != "grammar") {
        return Err(field(format!(
            "unknown field `{unknown}` in a grammar response format (expected `type`, `grammar`)"
        )));
    }
    match format.get("grammar") {
        Some(Value::String(grammar)) if !grammar.trim().is_empty() => {
            Ok(Some(Constraint::Lark(grammar.clone())))
        }
        Some(Value::String(_)) => Err(field("`grammar` is empty".to_string())),
        Some(_) => Err(field(
            "`grammar` must be a string (Lark source)".to_string(),
        )),
        None => Err(field(
            "a grammar response format needs a `grammar` string (Lark source)".to_string(),
        )),
    }
}
