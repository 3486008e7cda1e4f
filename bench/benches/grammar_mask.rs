//! Structured-output mask time per token over the full 129,280-token DeepSeek vocabulary, for a
//! JSON schema, a regex and a Lark grammar. Each walk feeds a valid answer token by token and
//! times `compute_mask` at every position (the first, cold mask of a fresh matcher included).
//! Criterion reports the mean per mask; the mean, p99 and max over a fixed set of walks are
//! printed before it (criterion has no percentiles).

use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use deepinfer_actors::grammar::{
    CompiledGrammar, Constraint, ConstraintStart, GrammarEngine, TokenId,
};
use serde_json::json;

struct Case {
    name: &'static str,
    constraint: Constraint,
    answer: &'static str,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "json_schema",
            constraint: Constraint::JsonSchema(json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}}
                },
                "required": ["name", "age", "tags"],
                "additionalProperties": false
            })),
            answer: r#"{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}"#,
        },
        Case {
            name: "regex",
            constraint: Constraint::Regex(
                r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net) \d{4}-\d{2}-\d{2}".to_string(),
            ),
            answer: "ada@analytical.org 1843-07-10",
        },
        Case {
            name: "lark",
            constraint: Constraint::Lark(
                [
                    r#"start: "SELECT " columns " FROM " NAME where? ";""#,
                    r#"columns: "*" | NAME (", " NAME){0,2}"#,
                    r#"where: " WHERE " NAME " " OP " " NUMBER"#,
                    r#"OP: "=" | "<" | ">""#,
                    r"NAME: /[a-z_]{1,16}/",
                    r"NUMBER: /[0-9]{1,6}/",
                ]
                .join("\n"),
            ),
            answer: "SELECT name, age FROM users WHERE age > 30;",
        },
    ]
}

/// Time every mask of one walk over `tokens`.
fn walk(engine: &GrammarEngine, grammar: &CompiledGrammar, tokens: &[TokenId]) -> Vec<Duration> {
    let mut matcher = engine.matcher(grammar, ConstraintStart::Answer);
    let mut times = Vec::with_capacity(tokens.len());
    for &token in tokens {
        let start = Instant::now();
        let mask = matcher.compute_mask().expect("mask");
        times.push(start.elapsed());
        assert!(mask.is_allowed(token), "the answer is valid");
        matcher.advance(token).expect("advance");
    }
    times
}

fn report(name: &str, mut times: Vec<Duration>, allowed_at_start: usize) {
    times.sort();
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = times.iter().map(|&d| micros(d)).sum::<f64>() / times.len() as f64;
    let p99 = times[(times.len() * 99).div_ceil(100) - 1];
    let max = times[times.len() - 1];
    println!(
        "grammar_mask/{name}: {} masks, mean {mean:.1} µs, p99 {:.1} µs, max {:.1} µs \
         ({allowed_at_start} tokens allowed at the start)",
        times.len(),
        micros(p99),
        micros(max),
    );
}

fn bench_masks(c: &mut Criterion) {
    let tokenizer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tokenizer/tokenizer.json");
    let engine = GrammarEngine::from_tokenizer_file(&tokenizer).expect("tokenizer");
    let mut group = c.benchmark_group("grammar_mask");
    for case in cases() {
        let grammar = engine
            .compile(&case.constraint)
            .expect("constraint compiles");
        let mut tokens = engine.token_env().tokenize_text(case.answer);
        tokens.push(engine.special_tokens().eos);
        let allowed_at_start = match engine
            .matcher(&grammar, ConstraintStart::Answer)
            .compute_mask()
        {
            Ok(mask) => mask
                .token_mask()
                .map_or(engine.vocab_size(), |m| m.allowed_count()),
            Err(e) => panic!("{}: {e}", case.name),
        };
        let times: Vec<Duration> = (0..50)
            .flat_map(|_| walk(&engine, &grammar, &tokens))
            .collect();
        report(case.name, times, allowed_at_start);

        group.bench_function(case.name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    for time in walk(&engine, &grammar, &tokens) {
                        if done == iters {
                            break;
                        }
                        total += time;
                        done += 1;
                    }
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_masks);
criterion_main!(benches);
