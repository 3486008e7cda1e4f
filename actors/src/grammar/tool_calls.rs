//! The DSML tool-call grammar: what the answer of a request with tools may be, as a Lark grammar
//! for llguidance.
//!
//! The block is the one DeepSeek-V4.1's prompt encoding renders for past tool calls and teaches
//! in its tool prompt (deepseek-recipe's `DeepseekV41Encoding`), `｜DSML｜` being one special
//! token:
//!
//! ```text
//! \n\n<｜DSML｜ calls>\n
//! <｜DSML｜ invoke name="NAME">\n
//! <｜DSML｜ parameter name="KEY" string="true">raw text</｜DSML｜ parameter>\n
//! <｜DSML｜ parameter name="KEY" string="false">JSON</｜DSML｜ parameter>\n
//! </｜DSML｜ invoke>\n
//! </｜DSML｜ calls>
//! ```
//!
//! Invocations are separated by one newline, as are parameters; a call without parameters has
//! an empty line between its tags. With `tool_choice: "required"` the prompt already ends with the
//! block's opening line, so the answer is one or more invocations and the closing tag; otherwise
//! the answer is free text, optionally followed by one block.
//!
//! Per tool: the name is one of the request's tools; each parameter is one of the tool's
//! `parameters.properties` — a `"type": "string"` property (or a string `enum`) as raw text
//! (`string="true"`; an `enum` limits it to its values), any other as JSON valid under the
//! property's schema (`string="false"`), a property without a type either way. A `strict` tool
//! gives every property in schema order (OpenAI's strict mode makes them all required); a
//! non-strict one its `required` properties once each, in schema order, and its other
//! properties anywhere around them. A tool whose parameters declare no properties takes
//! any parameter names with raw or JSON values.
//!
//! Free text ends only where a special token follows (a regex never matches one), so the
//! grammar writes each text run together with the plain characters before the next `｜DSML｜`.
//! llguidance's lexer takes the longest lexeme without backtracking, so no literal is a prefix
//! of another one that can follow at the same point (`"\n"` and `"</"`, never `"\n</"`).

use deepseek_recipe::request::OutputConstraint;
use serde_json::Value;
use toktrie::TokenId;

use super::GrammarError;
use super::engine::JSON_WHITESPACE_PATTERN;

/// The kind name of this constraint in errors and metrics.
pub const TOOL_CALLS_KIND: &str = "tool_calls";

/// One tool a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    /// The JSON schema of its arguments object.
    pub parameters: Value,
    /// Every property, in schema order.
    pub strict: bool,
}

/// The tools of a request and whether a call is required.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallsConstraint {
    pub tools: Vec<ToolSpec>,
    /// `tool_choice: "required"`: the prompt opened the block; the answer is the calls.
    pub required: bool,
}

impl ToolCallsConstraint {
    /// From deepseek-recipe's converted request; `None` for other constraints.
    pub fn from_output_constraint(constraint: &OutputConstraint) -> Option<Self> {
        match constraint {
            OutputConstraint::ToolCalls { tools, required } => Some(ToolCallsConstraint {
                tools: tools
                    .iter()
                    .map(|tool| ToolSpec {
                        name: tool.name.clone(),
                        parameters: tool.parameters.clone(),
                        strict: tool.strict == Some(true),
                    })
                    .collect(),
                required: *required,
            }),
            _ => None,
        }
    }

    /// The Lark grammar of the answer; `dsml` is the id of the `｜DSML｜` token.
    pub fn to_lark(&self, dsml: TokenId) -> Result<String, GrammarError> {
        if self.tools.is_empty() {
            return Err(invalid("a tool-call constraint needs at least one tool"));
        }
        let tag = format!("<[{dsml}]>");
        let mut lark = String::new();
        if self.required {
            lark.push_str("start: calls\n");
        } else {
            // Free text, or free text (ending with the block's plain prefix) and the block.
            lark.push_str(&format!(
                "start: ANSWER | ANSWER_BEFORE_CALLS {tag} \" calls>\\n\" calls\n\
                 ANSWER: /(?s:.*)/\n\
                 ANSWER_BEFORE_CALLS: /(?s:.*)\\n\\n</\n"
            ));
        }
        lark.push_str(&format!(
            "calls: invoke (\"\\n\" invoke)* \"\\n\" \"</\" {tag} \" calls>\"\n\
             TEXT_BEFORE_TAG: /(?s:.*)<\\//\n\
             invoke: {}\n",
            (0..self.tools.len())
                .map(|i| format!("invoke_{i}"))
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        for (i, tool) in self.tools.iter().enumerate() {
            lark.push_str(&tool_rules(i, tool, &tag)?);
        }
        Ok(lark)
    }
}

fn invalid(message: impl Into<String>) -> GrammarError {
    GrammarError::InvalidConstraint {
        kind: TOOL_CALLS_KIND,
        message: message.into(),
    }
}

/// A Lark string literal of `text`.
fn literal(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

/// The rules of tool `i`: `invoke_i` and its parameters.
fn tool_rules(i: usize, tool: &ToolSpec, tag: &str) -> Result<String, GrammarError> {
    if tool.name.is_empty() {
        return Err(invalid(format!("tool {i} has an empty name")));
    }
    let open = literal(&format!(" invoke name=\"{}\">\n", tool.name));
    let properties = match tool.parameters.get("properties") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(properties)) => properties.iter().collect(),
        Some(_) => {
            return Err(invalid(format!(
                "tool {:?}: parameters.properties must be an object",
                tool.name
            )));
        }
    };
    let mut rules =
        format!("invoke_{i}: \"<\" {tag} {open} args_{i} \"\\n\" \"</\" {tag} \" invoke>\"\n");
    if properties.is_empty() {
        // Any names, raw or JSON values.
        rules.push_str(&format!(
            "args_{i}: (param_{i} (\"\\n\" param_{i})*)?\n\
             param_{i}: \"<\" {tag} \" parameter name=\\\"\" NAME_{i} \"\\\" string=\\\"\" \
             (\"true\\\">\" TEXT_BEFORE_TAG | \"false\\\">\" json_{i}_any \"</\") {tag} \" parameter>\"\n\
             NAME_{i}: /[^\"<>\\n]+/\n\
             json_{i}_any: %json {}\n",
            json_schema_text(&Value::Bool(true))
        ));
        return Ok(rules);
    }
    let names: Vec<String> = (0..properties.len())
        .map(|p| format!("param_{i}_{p}"))
        .collect();
    if tool.strict {
        rules.push_str(&format!("args_{i}: {}\n", names.join(" \"\\n\" ")));
    } else {
        rules.push_str(&non_strict_args(i, tool, &properties, &names)?);
    }
    for (p, (key, schema)) in properties.into_iter().enumerate() {
        let name = format!("param_{i}_{p}");
        let head = format!(
            "\"<\" {tag} {}",
            literal(&format!(" parameter name=\"{key}\" string=\""))
        );
        let raw = format!(
            "\"true\\\">\" {}",
            raw_value(schema, &format!("{name}_raw"))
        );
        let json = format!("\"false\\\">\" {name}_json \"</\"");
        let close = format!("{tag} \" parameter>\"");
        let body = match value_form(schema) {
            ValueForm::Raw => raw.clone(),
            ValueForm::Json => json.clone(),
            ValueForm::Either => format!("({raw} | {json})"),
        };
        rules.push_str(&format!("{name}: {head} {body} {close}\n"));
        if !matches!(value_form(schema), ValueForm::Raw) {
            rules.push_str(&format!(
                "{name}_json: %json {}\n",
                json_schema_text(schema)
            ));
        }
        if let Some(values) = string_enum(schema) {
            rules.push_str(&format!(
                "{name}_raw: {}\n",
                values
                    .iter()
                    .map(|v| literal(&format!("{v}</")))
                    .collect::<Vec<_>>()
                    .join(" | ")
            ));
        }
    }
    Ok(rules)
}

/// The arguments of a non-strict tool: its `required` properties once each, in schema order,
/// the other properties anywhere around them.
fn non_strict_args(
    i: usize,
    tool: &ToolSpec,
    properties: &[(&String, &Value)],
    names: &[String],
) -> Result<String, GrammarError> {
    let required: Vec<&str> = match tool.parameters.get("required") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(keys)) => keys
            .iter()
            .map(|k| {
                let key = k.as_str().ok_or_else(|| {
                    invalid(format!(
                        "tool {:?}: `required` must list strings",
                        tool.name
                    ))
                })?;
                if !properties.iter().any(|(name, _)| name.as_str() == key) {
                    return Err(invalid(format!(
                        "tool {:?}: required property {key:?} is not in `properties`",
                        tool.name
                    )));
                }
                Ok(key)
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(invalid(format!(
                "tool {:?}: `required` must be an array",
                tool.name
            )));
        }
    };
    let is_required = |p: usize| required.contains(&properties[p].0.as_str());
    let optional: Vec<&str> = (0..names.len())
        .filter(|&p| !is_required(p))
        .map(|p| names[p].as_str())
        .collect();
    let mut rules = String::new();
    if !optional.is_empty() {
        rules.push_str(&format!("param_{i}: {}\n", optional.join(" | ")));
    }
    if required.is_empty() {
        rules.push_str(&format!("args_{i}: (param_{i} (\"\\n\" param_{i})*)?\n"));
        return Ok(rules);
    }
    let (lead, gap) = if optional.is_empty() {
        (String::new(), String::new())
    } else {
        (
            format!("(param_{i} \"\\n\")* "),
            format!(" (\"\\n\" param_{i})*"),
        )
    };
    let sequence: Vec<String> = (0..names.len())
        .filter(|&p| is_required(p))
        .map(|p| format!("{}{gap}", names[p]))
        .collect();
    rules.push_str(&format!("args_{i}: {lead}{}\n", sequence.join(" \"\\n\" ")));
    Ok(rules)
}

/// How a parameter's value is written.
enum ValueForm {
    /// `string="true"`: raw text.
    Raw,
    /// `string="false"`: JSON.
    Json,
    /// Untyped: either.
    Either,
}

fn value_form(schema: &Value) -> ValueForm {
    if string_enum(schema).is_some() {
        return ValueForm::Raw;
    }
    match schema.get("type") {
        Some(Value::String(t)) if t == "string" => ValueForm::Raw,
        Some(_) => ValueForm::Json,
        None if schema.get("enum").is_some() || schema.get("const").is_some() => ValueForm::Json,
        None => ValueForm::Either,
    }
}

/// The values of a string-only `enum`.
fn string_enum(schema: &Value) -> Option<Vec<&str>> {
    let values = schema.get("enum")?.as_array()?;
    let strings: Option<Vec<&str>> = values.iter().map(Value::as_str).collect();
    strings.filter(|s| !s.is_empty())
}

/// The raw-text value of a parameter up to the `</` before the closing tag: an enum's values,
/// or any text.
fn raw_value(schema: &Value, rule: &str) -> String {
    if string_enum(schema).is_some() {
        rule.to_string()
    } else {
        "TEXT_BEFORE_TAG".to_string()
    }
}

/// A property schema as the argument of `%json`, with the engine's bounded whitespace unless it
/// sets its own llguidance options.
fn json_schema_text(schema: &Value) -> String {
    let mut schema = match schema {
        Value::Bool(true) => serde_json::json!({}),
        other => other.clone(),
    };
    if let Value::Object(object) = &mut schema {
        object
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE_PATTERN}));
    }
    schema.to_string()
}
