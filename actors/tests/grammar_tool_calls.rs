//! The DSML tool-call constraint on the real DeepSeek vocabulary: the block deepseek-recipe's
//! V4.1 encoding renders is accepted token by token; wrong names, wrong value forms, missing
//! `required` properties and a block that does not start on its own line are refused; seeded random generations under the
//! constraint parse into calls whose arguments validate against the tool schemas (jsonschema);
//! a chat request with `tool_choice: "required"` gets the constraint and starts inside the block.

mod common;

use common::grammar_set::{EOS, engine, repo_root};
use deepinfer_actors::frontend::codec::TextCodec;
use deepinfer_actors::grammar::{
    Constraint, ConstraintStart, GrammarMatcher, TokenId, ToolCallsConstraint, ToolSpec,
};
use serde_json::{Value, json};

const DSML: TokenId = 128_825;
const DSML_TEXT: &str = "｜DSML｜";
/// Generations longer than this count as failures.
const TOKEN_CAP: usize = 600;

fn weather_tool(strict: bool) -> ToolSpec {
    ToolSpec {
        name: "get_weather".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}
            },
            "required": ["city", "unit", "days"]
        }),
        strict,
    }
}

fn switch_tool() -> ToolSpec {
    ToolSpec {
        name: "set_switch".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "on": {"type": "boolean"},
                "room": {"enum": ["kitchen", "hall"]},
                "level": {"enum": [1, 2, 3]}
            }
        }),
        strict: false,
    }
}

fn compile(tools: Vec<ToolSpec>, required: bool) -> deepinfer_actors::grammar::CompiledGrammar {
    engine()
        .compile(&Constraint::ToolCalls(ToolCallsConstraint {
            tools,
            required,
        }))
        .expect("the tool-call grammar compiles")
}

/// Tokens of `text`, where every `｜DSML｜` is the special token and the rest plain text.
fn tokens(text: &str) -> Vec<TokenId> {
    let mut out = Vec::new();
    for (i, piece) in text.split(DSML_TEXT).enumerate() {
        if i > 0 {
            out.push(DSML);
        }
        if !piece.is_empty() {
            out.extend(engine().token_env().tokenize_text(piece));
        }
    }
    out
}

/// Whether the constraint accepts `text` as a complete answer (then EOS).
fn accepts(matcher: &mut GrammarMatcher, text: &str) -> bool {
    matcher.advance_all(&tokens(text)).is_ok()
        && matcher.compute_mask().is_ok_and(|m| m.is_allowed(EOS))
}

fn required_matcher(tools: Vec<ToolSpec>) -> GrammarMatcher {
    engine().matcher(&compile(tools, true), ConstraintStart::Answer)
}

/// The answer part of a block: everything after the opening line, closing tag included.
fn answer_of_block(block: &str) -> &str {
    let open = format!("<{DSML_TEXT} calls>\n");
    let start = block.find(&open).expect("an opening line") + open.len();
    &block[start..]
}

/// The tool-call block deepseek-recipe's V4.1 encoding renders for a past assistant turn.
fn rendered_block(codec: &TextCodec, calls: Value) -> String {
    let body = json!({
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c0", "content": "ok"},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "tool", "tool_call_id": "c2", "content": "ok"},
            {"role": "user", "content": "thanks"}
        ],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": weather_tool(false).parameters}},
            {"type": "function", "function": {"name": "set_switch", "parameters": switch_tool().parameters}}
        ]
    });
    let encoded = codec.encode_chat(&body).expect("the chat encodes");
    let text = codec.decode(&encoded.tokens);
    let open = format!("\n\n<{DSML_TEXT} calls>");
    let close = format!("</{DSML_TEXT} calls>");
    // The last one: the tool prompt shows an example block first.
    let start = text.rfind(&open).expect("the history renders a block");
    let end = text[start..].find(&close).expect("a closed block") + start + close.len();
    text[start..end].to_string()
}

fn codec() -> TextCodec {
    TextCodec::load(&repo_root().join("configs/tokenizer/tokenizer.json"), 0)
        .expect("the shipped tokenizer loads")
}

#[test]
fn the_block_the_encoding_renders_is_accepted() {
    let codec = codec();
    let block = rendered_block(
        &codec,
        json!([
            {"id": "c0", "type": "function", "function": {"name": "get_weather",
             "arguments": "{\"city\": \"Paris <3 \\\"quoted\\\"\", \"unit\": \"celsius\", \"days\": 3}"}},
            {"id": "c1", "type": "function", "function": {"name": "set_switch",
             "arguments": "{\"on\": true, \"level\": 2}"}},
            {"id": "c2", "type": "function", "function": {"name": "set_switch", "arguments": "{}"}}
        ]),
    );
    eprintln!("rendered block: {block:?}");
    let both = || vec![weather_tool(false), switch_tool()];
    // Required: the prompt opened the block; the answer is the rest.
    assert!(accepts(
        &mut required_matcher(both()),
        answer_of_block(&block)
    ));
    // Auto: text, then the whole block.
    let mut auto = engine().matcher(&compile(both(), false), ConstraintStart::Answer);
    assert!(accepts(&mut auto, &format!("Let me check.{block}")));
    let mut auto = engine().matcher(&compile(both(), false), ConstraintStart::Answer);
    assert!(accepts(&mut auto, "No tool needed: it is sunny."));
    // Strict: every property, in schema order.
    let strict = format!(
        "<{d} invoke name=\"get_weather\">\n<{d} parameter name=\"city\" string=\"true\">Oslo</{d} parameter>\n\
         <{d} parameter name=\"unit\" string=\"true\">celsius</{d} parameter>\n\
         <{d} parameter name=\"days\" string=\"false\">2</{d} parameter>\n</{d} invoke>\n</{d} calls>",
        d = DSML_TEXT
    );
    assert!(accepts(
        &mut required_matcher(vec![weather_tool(true)]),
        &strict
    ));
}

#[test]
fn what_the_tools_do_not_allow_is_refused() {
    let d = DSML_TEXT;
    let call = |name: &str, params: &str| {
        format!("<{d} invoke name=\"{name}\">\n{params}\n</{d} invoke>\n</{d} calls>")
    };
    let param = |key: &str, string: bool, value: &str| {
        format!("<{d} parameter name=\"{key}\" string=\"{string}\">{value}</{d} parameter>")
    };
    let refused = |tools: Vec<ToolSpec>, text: &str| !accepts(&mut required_matcher(tools), text);
    // Non-strict, `city` required: the other properties are optional, before or after it.
    let weather = || {
        let mut tool = weather_tool(false);
        tool.parameters["required"] = json!(["city"]);
        vec![tool]
    };
    let city = param("city", true, "Oslo");
    // The controls are accepted.
    assert!(!refused(
        weather(),
        &call(
            "get_weather",
            &format!("{}\n{city}", param("days", false, "4"))
        )
    ));
    assert!(!refused(
        weather(),
        &call(
            "get_weather",
            &format!("{city}\n{}", param("unit", true, "fahrenheit"))
        )
    ));
    assert!(!refused(weather(), &call("get_weather", &city)));
    // A required property missing: refused (all three required, one given; none given).
    assert!(refused(
        vec![weather_tool(false)],
        &call("get_weather", &param("days", false, "4"))
    ));
    assert!(refused(weather(), &call("get_weather", "")));
    assert!(refused(
        weather(),
        &call("get_weather", &param("unit", true, "celsius"))
    ));
    // An unknown tool, an unknown parameter, a JSON value given as a string and back, a value
    // outside its enum or range, a missing closing tag.
    assert!(refused(weather(), &call("get_wether", &city)));
    assert!(refused(
        weather(),
        &call(
            "get_weather",
            &format!("{city}\n{}", param("town", true, "Oslo"))
        )
    ));
    assert!(refused(
        weather(),
        &call(
            "get_weather",
            &format!("{city}\n{}", param("days", true, "4"))
        )
    ));
    assert!(refused(
        weather(),
        &call("get_weather", &param("city", false, "\"Oslo\""))
    ));
    assert!(refused(
        weather(),
        &call(
            "get_weather",
            &format!("{city}\n{}", param("unit", true, "kelvin"))
        )
    ));
    assert!(refused(
        weather(),
        &call(
            "get_weather",
            &format!("{city}\n{}", param("days", false, "9"))
        )
    ));
    assert!(refused(
        weather(),
        &format!("<{d} invoke name=\"get_weather\">\n{city}\n</{d} invoke>")
    ));
    // Strict: a missing property is refused.
    assert!(refused(
        vec![weather_tool(true)],
        &call("get_weather", &param("city", true, "Oslo"))
    ));
    // A `required` name that is not a property is the request's error.
    let mut unknown = weather_tool(false);
    unknown.parameters["required"] = json!(["town"]);
    let Err(error) = engine().compile(&Constraint::ToolCalls(ToolCallsConstraint {
        tools: vec![unknown],
        required: true,
    })) else {
        panic!("a required name that is not a property compiled");
    };
    assert!(error.to_string().contains("\"town\""), "{error}");
    // Auto: the block must start on its own line after the text.
    let mut auto = engine().matcher(&compile(weather(), false), ConstraintStart::Answer);
    auto.advance_all(&tokens("Sure<")).expect("plain text");
    let mask = auto.compute_mask().expect("mask");
    assert!(!mask.is_allowed(DSML), "a tag glued to the text");
    let mut auto = engine().matcher(&compile(weather(), false), ConstraintStart::Answer);
    auto.advance_all(&tokens("Sure\n\n<")).expect("plain text");
    assert!(auto.compute_mask().expect("mask").is_allowed(DSML));
}

/// A seeded pick among the allowed tokens, favouring the closing parts of the grammar a little
/// so that generations end (the `mix` hash as in the other grammar tests).
fn pick(allowed: &[TokenId], seed: u64, position: usize) -> TokenId {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let index = mix(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ position as u64) as usize;
    allowed[index % allowed.len()]
}

/// The calls of a generated answer (after the opening line): `(name, arguments)`.
fn parse_calls(answer: &str) -> Vec<(String, serde_json::Map<String, Value>)> {
    let d = DSML_TEXT;
    let invoke = regex::Regex::new(&format!(
        r#"(?s)<{d} invoke name="([^"]+)">\n(.*?)\n</{d} invoke>"#
    ))
    .expect("regex");
    let param = regex::Regex::new(&format!(
        r#"(?s)<{d} parameter name="([^"]+)" string="(true|false)">(.*?)</{d} parameter>"#
    ))
    .expect("regex");
    invoke
        .captures_iter(answer)
        .map(|call| {
            let args = param
                .captures_iter(&call[2])
                .map(|p| {
                    let value = if &p[2] == "true" {
                        Value::String(p[3].to_string())
                    } else {
                        serde_json::from_str(&p[3]).expect("a JSON value")
                    };
                    (p[1].to_string(), value)
                })
                .collect();
            (call[1].to_string(), args)
        })
        .collect()
}

#[test]
fn random_generations_parse_into_valid_calls() {
    // Tools whose values are all bounded (enums, booleans, small integers), so that a random
    // sampler ends its calls.
    let bounded = ToolSpec {
        name: "get_weather".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "enum": [1, 2, 3]}
            }
        }),
        strict: true,
    };
    let tools = vec![bounded, switch_tool()];
    let grammar = compile(tools.clone(), true);
    let mut calls_seen = 0;
    for seed in 1..=12u64 {
        let mut matcher = engine().matcher(&grammar, ConstraintStart::Answer);
        let mut generated = Vec::new();
        for position in 0..TOKEN_CAP {
            let mask = matcher.compute_mask().expect("mask");
            let allowed = mask.token_mask().expect("constrained").allowed_tokens();
            let token = pick(&allowed, seed, position);
            matcher
                .advance(token)
                .expect("an allowed token is accepted");
            if token == EOS {
                break;
            }
            generated.push(token);
        }
        assert!(
            matcher.is_finished(),
            "seed {seed}: no end in {TOKEN_CAP} tokens"
        );
        let text = String::from_utf8(engine().token_env().decode(&generated)).expect("utf-8");
        let calls = parse_calls(&text);
        assert!(!calls.is_empty(), "seed {seed}: no call in {text:?}");
        assert_eq!(
            text.matches("invoke name=").count(),
            calls.len(),
            "every invocation parses: {text:?}"
        );
        for (name, args) in calls {
            let tool = tools.iter().find(|t| t.name == name).expect("a known tool");
            let mut schema = tool.parameters.clone();
            schema["additionalProperties"] = json!(false);
            let args = Value::Object(args);
            assert!(
                jsonschema::is_valid(&schema, &args),
                "seed {seed}: {name} {args} breaks {schema}"
            );
            calls_seen += 1;
        }
    }
    eprintln!("12 generations, {calls_seen} calls, all valid");
}

#[test]
fn a_required_tool_choice_constrains_the_answer_from_the_first_token() {
    let codec = codec();
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "parameters": weather_tool(false).parameters}}],
        "tool_choice": "required",
        "thinking": {"type": "disabled"}
    });
    let encoded = codec.encode_chat(&body).expect("encodes");
    let prompt_text = codec.decode(&encoded.tokens);
    assert!(
        prompt_text.ends_with(&format!("<{DSML_TEXT} calls>\n")),
        "{prompt_text:?}"
    );
    let Some(Constraint::ToolCalls(constraint)) = &encoded.constraint else {
        panic!("no tool-call constraint: {:?}", encoded.constraint)
    };
    assert!(constraint.required);
    assert_eq!(
        engine().constraint_start(&encoded.tokens),
        ConstraintStart::Answer
    );
    let grammar = engine()
        .compile(&Constraint::ToolCalls(constraint.clone()))
        .expect("compiles");
    let mut matcher = engine().matcher(&grammar, ConstraintStart::Answer);
    let first = matcher.compute_mask().expect("mask");
    assert_eq!(
        first.token_mask().expect("constrained").allowed_tokens(),
        tokens("<"),
        "the first answer token opens an invocation"
    );
}
