//! The structured-output test set of tests/data/grammar/ and its independent checks (jsonschema,
//! regex, re-parsing with a fresh matcher), shared by the grammar test binaries.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use deepinfer_actors::grammar::{
    CompiledGrammar, Constraint, ConstraintStart, GrammarEngine, TokenId,
};
use serde_json::Value;

pub const VOCAB: usize = 129_280;
pub const EOS: TokenId = 1;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("actors/ has a parent")
        .to_path_buf()
}

/// Built once per test binary: debug builds take seconds for it.
pub fn engine() -> &'static GrammarEngine {
    static ENGINE: OnceLock<GrammarEngine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        GrammarEngine::from_tokenizer_file(&repo_root().join("configs/tokenizer/tokenizer.json"))
            .expect("the shipped tokenizer builds a grammar engine")
    })
}

/// A generated answer: its tokens, a final EOS included when it has one.
pub struct Generation {
    pub tokens: Vec<TokenId>,
    pub ended_with_eos: bool,
}

impl Generation {
    pub fn answer_bytes(&self) -> Vec<u8> {
        let end = self.tokens.len() - usize::from(self.ended_with_eos);
        engine().token_env().decode(&self.tokens[..end])
    }
}

pub enum Check {
    Schema(Box<jsonschema::Validator>),
    Regex(regex::Regex),
    /// Re-parse with a fresh matcher; optionally also a regex over the text.
    Reparse(Option<regex::Regex>),
}

pub struct Case {
    pub name: String,
    pub constraint: Constraint,
    pub check: Check,
}

pub fn full_match(pattern: &str) -> regex::Regex {
    regex::Regex::new(&format!("^(?:{pattern})$")).expect("check regex compiles")
}

pub fn read_json(name: &str) -> Value {
    let path = repo_root().join("tests/data/grammar").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// Grammar files of one directory, sorted, each with its `<comment>check-regex: ` line if any.
fn grammar_files(dir: &str, comment: &str) -> Vec<(String, String, Option<regex::Regex>)> {
    let dir = repo_root().join("tests/data/grammar").join(dir);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir:?}: {e}"))
        .map(|e| e.expect("entry").path())
        .collect();
    paths.sort();
    let marker = format!("{comment} check-regex: ");
    paths
        .into_iter()
        .map(|path| {
            let source = std::fs::read_to_string(&path).expect("grammar file");
            let check_regex = source
                .lines()
                .find_map(|l| l.strip_prefix(marker.as_str()))
                .map(full_match);
            let stem = path
                .file_stem()
                .expect("stem")
                .to_string_lossy()
                .into_owned();
            (stem, source, check_regex)
        })
        .collect()
}

/// Every constraint of tests/data/grammar/ with its check.
pub fn test_set() -> Vec<Case> {
    let mut cases = Vec::new();
    for entry in read_json("json_schemas.json").as_array().expect("array") {
        let schema = entry["schema"].clone();
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(&schema)
            .expect("test schema is valid");
        cases.push(Case {
            name: format!("json_schema/{}", entry["name"].as_str().expect("name")),
            constraint: Constraint::JsonSchema(schema),
            check: Check::Schema(Box::new(validator)),
        });
    }
    for entry in read_json("regexes.json").as_array().expect("array") {
        let regex = entry["regex"].as_str().expect("regex").to_string();
        cases.push(Case {
            name: format!("regex/{}", entry["name"].as_str().expect("name")),
            check: Check::Regex(full_match(&regex)),
            constraint: Constraint::Regex(regex),
        });
    }
    for (stem, source, check_regex) in grammar_files("lark", "//") {
        cases.push(Case {
            name: format!("lark/{stem}"),
            constraint: Constraint::Lark(source),
            check: Check::Reparse(check_regex),
        });
    }
    for (stem, source, check_regex) in grammar_files("ebnf", "#") {
        cases.push(Case {
            name: format!("ebnf/{stem}"),
            constraint: Constraint::Ebnf(source),
            check: Check::Reparse(check_regex),
        });
    }
    cases
}

/// A fresh matcher must accept exactly these bytes: fed as the generated tokens, and (for text
/// without special tokens) as the canonical tokenization of the text, then end with EOS.
fn reparses(grammar: &CompiledGrammar, generation: &Generation, text: &str) -> Result<(), String> {
    let mut tokenizations = vec![generation.tokens[..generation.tokens.len() - 1].to_vec()];
    let canonical = engine().token_env().tokenize_text(text);
    if engine().token_env().decode(&canonical) == text.as_bytes()
        && !generation.tokens.iter().any(|&t| t >= 128_000)
    {
        tokenizations.push(canonical);
    }
    for tokens in tokenizations {
        let mut fresh = engine().matcher(grammar, ConstraintStart::Answer);
        fresh
            .advance_all(&tokens)
            .map_err(|e| format!("re-parse of {tokens:?}: {e}"))?;
        fresh
            .advance(EOS)
            .map_err(|e| format!("re-parse not complete: {e}"))?;
    }
    Ok(())
}

/// Does the generation end with EOS and pass its case's independent check?
pub fn check_output(
    case: &Case,
    grammar: &CompiledGrammar,
    generation: &Generation,
) -> Result<(), String> {
    if !generation.ended_with_eos {
        return Err(format!(
            "no EOS within its token cap ({} tokens)",
            generation.tokens.len()
        ));
    }
    let bytes = generation.answer_bytes();
    let text = String::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
    match &case.check {
        Check::Schema(validator) => {
            let value: Value =
                serde_json::from_str(&text).map_err(|e| format!("not JSON ({e}): {text:?}"))?;
            let errors: Vec<String> = validator
                .iter_errors(&value)
                .map(|e| e.to_string())
                .collect();
            if !errors.is_empty() {
                return Err(format!("{text} violates the schema: {errors:?}"));
            }
        }
        Check::Regex(regex) => {
            if !regex.is_match(&text) {
                return Err(format!("{text:?} does not match"));
            }
        }
        Check::Reparse(regex) => {
            if let Some(regex) = regex
                && !regex.is_match(&text)
            {
                return Err(format!("{text:?} does not match the check regex"));
            }
            reparses(grammar, generation, &text)?;
        }
    }
    Ok(())
}
