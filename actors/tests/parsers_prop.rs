//! Property tests of the parsers of untrusted request input: OpenAI Batch lines
//! (`job::format::parse_line`) and chat bodies with their `response_format`
//! (`TextCodec::encode_chat`, then `GrammarEngine::compile` of the constraint it yields). Random
//! and mutated input of every shape gives a value or an error naming the line, never a panic.

use std::path::PathBuf;
use std::sync::OnceLock;

use deepinfer_actors::frontend::codec::TextCodec;
use deepinfer_actors::grammar::GrammarEngine;
use deepinfer_actors::job::format::parse_line;
use deepinfer_actors::openai::ServedModel;
use deepinfer_model::config::ModelFamily;
use proptest::prelude::*;
use serde_json::{Value, json};

fn tokenizer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/tokenizer/tokenizer.json")
}

fn codec() -> &'static TextCodec {
    static CODEC: OnceLock<TextCodec> = OnceLock::new();
    CODEC.get_or_init(|| TextCodec::load(&tokenizer(), 0).expect("shipped tokenizer"))
}

fn grammar_engine() -> &'static GrammarEngine {
    static ENGINE: OnceLock<GrammarEngine> = OnceLock::new();
    ENGINE.get_or_init(|| GrammarEngine::from_tokenizer_file(&tokenizer()).expect("engine"))
}

/// Any JSON value, a few levels deep, with the keys the parsers look for among random ones.
fn json_value() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("custom_id".to_string()),
        Just("method".to_string()),
        Just("url".to_string()),
        Just("body".to_string()),
        Just("prompt".to_string()),
        Just("messages".to_string()),
        Just("role".to_string()),
        Just("content".to_string()),
        Just("max_tokens".to_string()),
        Just("temperature".to_string()),
        Just("top_p".to_string()),
        Just("seed".to_string()),
        Just("stop".to_string()),
        Just("type".to_string()),
        Just("response_format".to_string()),
        Just("json_schema".to_string()),
        Just("schema".to_string()),
        Just("grammar".to_string()),
        Just("syntax".to_string()),
        Just("regex".to_string()),
        "[a-z_]{0,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        prop_oneof![
            Just("POST".to_string()),
            Just("/v1/chat/completions".to_string()),
            Just("/v1/completions".to_string()),
            Just("user".to_string()),
            Just("json_schema".to_string()),
            Just("json_object".to_string()),
            Just("grammar".to_string()),
            Just("regex".to_string()),
            Just("ebnf".to_string()),
            Just("root ::= \"a\"".to_string()),
            Just("start: /[0-9]+/".to_string()),
            ".{0,12}",
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|entries| Value::Object(entries.into_iter().collect())),
        ]
    })
}

/// A `response_format`: each documented type with random contents, or any JSON.
fn response_format() -> impl Strategy<Value = Value> {
    let text = "[a-z0-9 ()|*+?:\\[\\]{}\"=./^$-]{0,16}";
    prop_oneof![
        json_value().prop_map(|schema| json!({"type": "json_schema",
            "json_schema": {"name": "n", "schema": schema}})),
        Just(json!({"type": "json_object"})),
        text.prop_map(|regex| json!({"type": "regex", "regex": regex})),
        (text, prop_oneof![Just("lark"), Just("ebnf"), Just("other")]).prop_map(
            |(grammar, syntax)| json!({"type": "grammar", "grammar": grammar, "syntax": syntax})
        ),
        (text).prop_map(
            |body| json!({"type": "grammar", "grammar": format!("root ::= {body}"),
            "syntax": "ebnf"})
        ),
        (text).prop_map(|body| json!({"type": "grammar", "grammar": format!("start: {body}")})),
        json_value(),
    ]
}

/// A valid line's text, cut or with one byte replaced (`edit` picks where and what).
fn mutated(text: &str, edit: (usize, u8, bool)) -> String {
    let mut bytes = text.as_bytes().to_vec();
    let at = edit.0 % (bytes.len() + 1);
    if edit.2 {
        bytes.truncate(at);
    } else if at < bytes.len() {
        bytes[at] = edit.1;
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

const CHAT_LINE: &str = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"seed":3,"stop":["x"],"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"object","properties":{"a":{"type":"integer"}}}}}}}"#;
const COMPLETION_LINE: &str = r#"{"custom_id":"b","method":"POST","url":"/v1/completions","body":{"prompt":"Once","max_tokens":4,"temperature":0.5,"top_p":0.9,"top_k":3,"stop":"."}}"#;

/// The model the parsed lines are for (V4.1, a 1024-token context, no thinking by default).
fn served() -> ServedModel {
    ServedModel {
        name: "served".into(),
        family: ModelFamily::V41,
        context_tokens: 1024,
        thinking_by_default: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Arbitrary JSON, and arbitrary text, as a Batch line: a parsed line or an error of
    /// line 7 with a message.
    #[test]
    fn batch_lines_never_panic(value in json_value(), text in ".{0,64}") {
        for line in [value.to_string(), text] {
            if let Err(error) = parse_line(&line, 7, &served()) {
                prop_assert_eq!(error.line, 7);
                prop_assert!(!error.message.is_empty());
            }
        }
    }

    /// Valid lines cut short or with a byte replaced.
    #[test]
    fn mutated_batch_lines_never_panic(edit in (any::<usize>(), any::<u8>(), any::<bool>())) {
        for base in [CHAT_LINE, COMPLETION_LINE] {
            if let Err(error) = parse_line(&mutated(base, edit), 3, &served()) {
                prop_assert_eq!(error.line, 3);
                prop_assert!(!error.message.is_empty());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// A chat body with an arbitrary `response_format` (and arbitrary other fields): converted
    /// and encoded, or a validation error; a constraint it yields compiles or is an error.
    #[test]
    fn response_formats_never_panic(format in response_format(), extra in json_value()) {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}],
                              "response_format": format});
        if let (Some(object), Value::Object(more)) = (body.as_object_mut(), extra) {
            for (k, v) in more {
                if k != "messages" {
                    object.insert(k, v);
                }
            }
        }
        if let Ok(encoded) = codec().encode_chat(&body)
            && let Some(constraint) = &encoded.constraint
        {
            let _ = grammar_engine().compile(constraint);
        }
    }
}
