//! Structured outputs end to end on the real DeepSeek vocabulary (129,280 tokens): the token
//! environment, the test set of tests/data/grammar/ generated with a seeded random-logits model
//! and checked by independent validators (jsonschema, regex, re-parsing), determinism across batch
//! compositions, thinking mode, rollback and draft masks, the mask workers and bad constraints.

mod common;

use common::grammar_set::{
    EOS, Generation, VOCAB, check_output, engine, read_json, repo_root, test_set,
};
use deepinfer_actors::grammar::{
    CompiledGrammar, Constraint, ConstraintStart, GrammarError, GrammarMatcher, MaskJob,
    MaskWorkers, StepMask, TokenId, ToolCallsConstraint, take_grammar_response_format,
};
use deepseek_recipe::request::OutputConstraint;
use serde_json::{Value, json};

const THINK_START: TokenId = 128_821;
const THINK_END: TokenId = 128_822;
const DSML: TokenId = 128_825;
/// Generations longer than this count as failures.
const TOKEN_CAP: usize = 400;

// ---------------------------------------------------------------------------------------------
// The random-logits "model" and a seeded temperature-1 sampler.

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// Seeded logits over the whole vocabulary, uniform in [-4, 4) (an xorshift stream: cheap in
/// debug builds).
fn model_logits(seed: u64, position: usize) -> Vec<f32> {
    let mut state = mix(seed ^ mix(position as u64)) | 1;
    let scale = 8.0 / (1u64 << 24) as f32;
    let mut logits = Vec::with_capacity(VOCAB);
    for _ in 0..VOCAB {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        logits.push((state >> 40) as f32 * scale - 4.0);
    }
    logits
}

/// Temperature-1 sampling; the noise is a pure function of (seed, position).
fn sample(logits: &[f32], seed: u64, position: usize) -> TokenId {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    assert!(max.is_finite(), "the mask allowed no token");
    let weight = |l: f32| f64::from(l - max).exp();
    let total: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| weight(l))
        .sum();
    let mut target = unit(mix(!seed ^ mix(position as u64 + 1))) * total;
    let mut last_allowed = 0;
    for (t, &l) in logits.iter().enumerate() {
        if l.is_finite() {
            last_allowed = t;
            let w = weight(l);
            if target < w {
                return t as TokenId;
            }
            target -= w;
        }
    }
    last_allowed as TokenId
}

/// One decoding step: mask, logits, mask applied before sampling, sample, advance.
fn step(matcher: &mut GrammarMatcher, mask: &StepMask, seed: u64, position: usize) -> TokenId {
    let mut logits = model_logits(seed, position);
    mask.apply_to_logits(&mut logits)
        .expect("logits cover the vocabulary");
    let token = sample(&logits, seed, position);
    assert!(mask.is_allowed(token), "sampled a masked token {token}");
    matcher.advance(token).expect("a sampled token is accepted");
    token
}

fn generate(grammar: &CompiledGrammar, seed: u64) -> Generation {
    let mut matcher = engine().matcher(grammar, ConstraintStart::Answer);
    let mut tokens = Vec::new();
    for position in 0..TOKEN_CAP {
        let mask = matcher.compute_mask().expect("mask");
        let token = step(&mut matcher, &mask, seed, position);
        tokens.push(token);
        if token == EOS {
            assert!(matcher.is_finished());
            return Generation {
                tokens,
                ended_with_eos: true,
            };
        }
    }
    Generation {
        tokens,
        ended_with_eos: false,
    }
}

// ---------------------------------------------------------------------------------------------
// The test set (tests/data/grammar/, checks in common::grammar_set).

#[test]
fn every_constrained_generation_of_the_test_set_validates() {
    let cases = test_set();
    assert!(
        cases.len() >= 30,
        "the test set has {} constraints",
        cases.len()
    );
    let seeds = [11u64, 12, 13];
    let mut failures = Vec::new();
    let mut generated = 0;
    let mut total_tokens = 0;
    for case in &cases {
        let grammar = engine()
            .compile(&case.constraint)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        for &seed in &seeds {
            let generation = generate(&grammar, seed);
            generated += 1;
            total_tokens += generation.tokens.len();
            if let Err(why) = check_output(case, &grammar, &generation) {
                failures.push(format!("{} seed {seed}: {why}", case.name));
            }
        }
    }
    eprintln!(
        "{generated} generations over {} constraints, {total_tokens} tokens, {} failures",
        cases.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "failures:\n{}", failures.join("\n"));
}

#[test]
fn the_checks_reject_what_the_constraint_would_not_allow() {
    // The validators are not vacuous: text outside every constraint fails them.
    let cases = test_set();
    let free = Generation {
        tokens: engine()
            .token_env()
            .tokenize_text("hello world")
            .into_iter()
            .chain([EOS])
            .collect(),
        ended_with_eos: true,
    };
    for case in &cases {
        let grammar = engine().compile(&case.constraint).expect("compiles");
        assert!(
            check_output(case, &grammar, &free).is_err(),
            "{} accepts \"hello world\"",
            case.name
        );
    }
}

/// `json_object` (any JSON object) is unbounded: a random walk over it rarely closes within a
/// token cap, so it is checked on given texts instead of random generations.
#[test]
fn json_object_accepts_objects_and_nothing_else() {
    let grammar = engine().compile(&Constraint::JsonObject).expect("compiles");
    let env = engine().token_env();
    let object = "{\"a\": [1, {\"b\": null}], \"c\": \"x\\n\", \"d\": -2.5e3}";
    let mut matcher = engine().matcher(&grammar, ConstraintStart::Answer);
    assert!(!matcher.compute_mask().expect("mask").is_allowed(EOS));
    matcher
        .advance_all(&env.tokenize_text(object))
        .expect("an object is accepted");
    matcher.advance(EOS).expect("and complete");
    for not_an_object in ["[1, 2]", "\"text\"", "42", "{\"a\": }", "{'a': 1}"] {
        let mut m = engine().matcher(&grammar, ConstraintStart::Answer);
        let accepted = m
            .advance_all(&env.tokenize_text(not_an_object))
            .and_then(|()| m.advance(EOS));
        assert!(accepted.is_err(), "{not_an_object} was accepted");
    }
}

// ---------------------------------------------------------------------------------------------
// Token environment.

#[test]
fn the_token_environment_covers_the_deepseek_vocabulary() {
    let env = engine().token_env();
    assert_eq!(env.vocab_size(), VOCAB);
    let special = engine().special_tokens();
    assert_eq!(
        (special.eos, special.think_start, special.think_end),
        (EOS, THINK_START, THINK_END)
    );
    assert_eq!(env.decode(&[DSML]), "｜DSML｜".as_bytes());
    assert_eq!(env.decode(&[THINK_START, THINK_END]), b"<think></think>");
    // Plain text tokenizes canonically (ids cross-checked with DeepSeek's Python tokenizer).
    let ids = env.tokenize_text("Hello! 毕老师 1 + 1 = 2");
    assert_eq!(
        ids,
        [
            19923, 3, 223, 5464, 5008, 223, 19, 940, 223, 19, 438, 223, 20
        ]
    );
    // Text that looks like a special token stays text.
    let think_text = env.tokenize_text("<think>");
    assert!(!think_text.contains(&THINK_START), "{think_text:?}");
    assert_eq!(env.decode(&think_text), b"<think>");
}

#[test]
fn special_tokens_are_usable_from_lark_and_only_as_themselves() {
    let grammar = engine()
        .compile(&Constraint::Lark(
            "start: \"a\" <[128825]> \"b\"".to_string(),
        ))
        .expect("compiles");
    let mut matcher = engine().matcher(&grammar, ConstraintStart::Answer);
    let a = engine().token_env().tokenize_text("a");
    matcher.advance_all(&a).expect("a");
    let mask = matcher.compute_mask().expect("mask");
    let allowed = mask.token_mask().expect("constrained").allowed_tokens();
    assert_eq!(allowed, vec![DSML]);
    matcher.advance(DSML).expect("DSML");
    let b = engine().token_env().tokenize_text("b");
    matcher.advance_all(&b).expect("b");
    matcher.advance(EOS).expect("complete");
    // `<think>` is special too: a grammar over plain text never allows it.
    let text_only = engine()
        .compile(&Constraint::Regex("[<>a-z/]{1,10}".to_string()))
        .expect("ok");
    let mut m = engine().matcher(&text_only, ConstraintStart::Answer);
    let mask = m.compute_mask().expect("mask");
    assert!(!mask.is_allowed(THINK_START) && !mask.is_allowed(THINK_END) && !mask.is_allowed(DSML));
    assert!(mask.is_allowed(engine().token_env().tokenize_text("<")[0]));
}

// ---------------------------------------------------------------------------------------------
// Determinism across batch compositions, through the mask workers.

/// Decode several requests in lockstep, masks from the worker pool; returns each request's tokens.
fn decode_batch(
    workers: &MaskWorkers,
    requests: &[(usize, u64)],
    grammars: &[CompiledGrammar],
) -> Vec<Vec<TokenId>> {
    let mut matchers: Vec<Option<GrammarMatcher>> = requests
        .iter()
        .map(|&(g, _)| Some(engine().matcher(&grammars[g], ConstraintStart::Answer)))
        .collect();
    let mut outputs = vec![Vec::new(); requests.len()];
    for position in 0..TOKEN_CAP {
        let jobs: Vec<MaskJob<usize>> = matchers
            .iter_mut()
            .enumerate()
            .filter_map(|(i, m)| {
                m.take().map(|matcher| MaskJob {
                    key: i,
                    matcher,
                    draft: Vec::new(),
                })
            })
            .collect();
        if jobs.is_empty() {
            break;
        }
        let batch = workers.compute(jobs);
        for outcome in batch.wait().expect("masks") {
            let mut matcher = outcome.matcher;
            let masks = outcome.masks.expect("mask");
            assert_eq!(masks.len(), 1);
            let token = step(&mut matcher, &masks[0], requests[outcome.key].1, position);
            outputs[outcome.key].push(token);
            if token != EOS {
                matchers[outcome.key] = Some(matcher);
            }
        }
    }
    outputs
}

#[test]
fn seeded_constrained_sampling_is_deterministic_across_batch_compositions() {
    let constraints = [
        Constraint::JsonSchema(read_json("json_schemas.json")[0]["schema"].clone()),
        Constraint::Regex("[a-z]{1,10}@[a-z]{1,10}\\.(com|org|net)".to_string()),
        Constraint::Lark(
            std::fs::read_to_string(repo_root().join("tests/data/grammar/lark/arithmetic.lark"))
                .expect("file"),
        ),
    ];
    let grammars: Vec<CompiledGrammar> = constraints
        .iter()
        .map(|c| engine().compile(c).expect("compiles"))
        .collect();
    let requests = [(0usize, 101u64), (1, 102), (2, 103), (0, 104)];

    let alone: Vec<Vec<TokenId>> = requests
        .iter()
        .map(|&r| decode_batch(&MaskWorkers::new(1).expect("pool"), &[r], &grammars).remove(0))
        .collect();
    let pool = MaskWorkers::new(3).expect("pool");
    assert_eq!(pool.threads(), 3);
    let together = decode_batch(&pool, &requests, &grammars);
    assert_eq!(together, alone, "batched vs alone");

    // Reversed, with unrelated neighbours in between.
    let mixed = [
        requests[3],
        (1, 900),
        requests[2],
        requests[1],
        (2, 901),
        requests[0],
    ];
    let out = decode_batch(&pool, &mixed, &grammars);
    let picked = vec![
        out[5].clone(),
        out[3].clone(),
        out[2].clone(),
        out[0].clone(),
    ];
    assert_eq!(picked, alone, "other order and neighbours");
    // Different seeds give different outputs (the comparison above is not vacuous).
    assert_ne!(alone[0], alone[3]);
    for tokens in &alone {
        assert_eq!(tokens.last(), Some(&EOS));
    }
}

#[test]
fn mask_workers_return_each_matcher_with_its_own_masks() {
    let grammar = engine()
        .compile(&Constraint::Regex("(yes|no)".to_string()))
        .expect("compiles");
    let digits = engine()
        .compile(&Constraint::Regex("[0-9]{2}".to_string()))
        .expect("compiles");
    let yes = engine().token_env().tokenize_text("yes");
    let pool = MaskWorkers::new(2).expect("pool");
    let jobs = vec![
        MaskJob {
            key: "draft",
            matcher: engine().matcher(&grammar, ConstraintStart::Answer),
            draft: yes.clone(),
        },
        MaskJob {
            key: "digits",
            matcher: engine().matcher(&digits, ConstraintStart::Answer),
            draft: Vec::new(),
        },
        MaskJob {
            key: "plain",
            matcher: engine().matcher(&grammar, ConstraintStart::Answer),
            draft: Vec::new(),
        },
    ];
    let outcomes = pool.compute(jobs).wait().expect("masks");
    let keys: Vec<&str> = outcomes.iter().map(|o| o.key).collect();
    assert_eq!(keys, ["draft", "digits", "plain"]);
    let draft_masks = outcomes[0].masks.as_ref().expect("ok");
    assert_eq!(draft_masks.len(), yes.len() + 1);
    assert!(draft_masks[yes.len()].is_allowed(EOS));
    assert_eq!(
        outcomes[0].matcher.consumed(),
        0,
        "draft masks leave the matcher unchanged"
    );
    let digit_mask = &outcomes[1].masks.as_ref().expect("ok")[0];
    assert!(digit_mask.is_allowed(engine().token_env().tokenize_text("4")[0]));
    assert!(!digit_mask.is_allowed(yes[0]));
    assert_eq!(&outcomes[2].masks.as_ref().expect("ok")[0], &draft_masks[0]);
    let empty = pool.compute::<u8>(Vec::new());
    assert!(empty.is_empty());
    assert!(empty.wait().expect("nothing to wait for").is_empty());
}

#[test]
fn mask_workers_can_be_awaited_from_async_code() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let grammar = engine()
        .compile(&Constraint::Regex("[0-9]{3}".to_string()))
        .expect("ok");
    let pool = MaskWorkers::new(1).expect("pool");
    let batch = pool.compute(vec![MaskJob {
        key: 7u32,
        matcher: engine().matcher(&grammar, ConstraintStart::Answer),
        draft: Vec::new(),
    }]);
    let outcomes = runtime.block_on(batch.wait_async()).expect("masks");
    assert_eq!(outcomes.len(), 1);
    assert_eq!(outcomes[0].key, 7);
    let mask = outcomes[0].masks.as_ref().expect("ok")[0].clone();
    assert!(mask.is_allowed(engine().token_env().tokenize_text("123")[0]));
    assert!(!mask.is_allowed(EOS));
}

// ---------------------------------------------------------------------------------------------
// Thinking mode, rollback, drafts.

#[test]
fn thinking_mode_leaves_the_reasoning_unconstrained_and_constrains_the_answer() {
    let schema = read_json("json_schemas.json")[0]["schema"].clone();
    let validator = jsonschema::validator_for(&schema).expect("valid");
    let grammar = engine()
        .compile(&Constraint::JsonSchema(schema))
        .expect("compiles");
    let prompt = [0, 128_803, 19923, 128_804, THINK_START];
    assert_eq!(
        engine().constraint_start(&prompt),
        ConstraintStart::AfterReasoning
    );
    assert_eq!(
        engine().constraint_start(&[128_804, THINK_START, 5, THINK_END]),
        ConstraintStart::Answer
    );
    assert_eq!(
        engine().constraint_start(&[128_803, 19923, 128_804]),
        ConstraintStart::Answer
    );

    let answer_start_mask = engine()
        .matcher(&grammar, ConstraintStart::Answer)
        .compute_mask()
        .expect("mask");
    let mut matcher = engine().matcher(&grammar, engine().constraint_start(&prompt));
    let seed = 77;
    let mut tokens = Vec::new();
    for position in 0..20 {
        let mask = matcher.compute_mask().expect("mask");
        assert_eq!(
            mask,
            StepMask::Unconstrained,
            "reasoning position {position}"
        );
        tokens.push(step(&mut matcher, &mask, seed, position));
    }
    assert!(
        tokens.iter().any(|&t| !answer_start_mask.is_allowed(t)),
        "the reasoning holds tokens the answer could not start with"
    );
    matcher.advance(THINK_END).expect("close reasoning");
    tokens.push(THINK_END);
    assert!(!matcher.in_reasoning());
    let reasoning_len = tokens.len();
    let first_answer_mask = matcher.compute_mask().expect("mask");
    assert_eq!(first_answer_mask, answer_start_mask);
    for position in reasoning_len..reasoning_len + TOKEN_CAP {
        let mask = matcher.compute_mask().expect("mask");
        let token = step(&mut matcher, &mask, seed, position);
        tokens.push(token);
        if token == EOS {
            break;
        }
    }
    assert_eq!(tokens.last(), Some(&EOS));
    let answer = engine()
        .token_env()
        .decode(&tokens[reasoning_len..tokens.len() - 1]);
    let value: Value = serde_json::from_slice(&answer).expect("answer is JSON");
    assert!(validator.is_valid(&value), "{value}");

    // Roll back into the reasoning: unconstrained again, and replaying gives the same masks.
    let answer_len = tokens.len() - reasoning_len;
    matcher
        .rollback(answer_len + 1)
        .expect("rollback over </think>");
    assert!(matcher.in_reasoning());
    assert_eq!(
        matcher.compute_mask().expect("mask"),
        StepMask::Unconstrained
    );
    matcher.advance(THINK_END).expect("close again");
    assert_eq!(matcher.compute_mask().expect("mask"), first_answer_mask);
}

#[test]
fn rollback_and_draft_masks_match_sequential_decoding() {
    let grammar = engine()
        .compile(&Constraint::JsonSchema(
            read_json("json_schemas.json")[3]["schema"].clone(),
        ))
        .expect("compiles");
    let generation = generate(&grammar, 5);
    assert!(generation.ended_with_eos);
    let tokens = &generation.tokens;

    // Sequential masks at every position.
    let mut sequential = Vec::new();
    let mut matcher = engine().matcher(&grammar, ConstraintStart::Answer);
    for &t in tokens {
        sequential.push(matcher.compute_mask().expect("mask"));
        matcher.advance(t).expect("advance");
    }
    assert!(matcher.is_finished());

    // Draft masks from the start cover every position; the state is unchanged afterwards.
    let mut fresh = engine().matcher(&grammar, ConstraintStart::Answer);
    let draft_masks = fresh.draft_masks(tokens).expect("draft masks");
    assert_eq!(draft_masks.len(), tokens.len(), "no position after EOS");
    assert_eq!(draft_masks, sequential);
    assert_eq!(fresh.consumed(), 0);

    // Roll back to the middle, then a draft whose third token is invalid.
    let middle = tokens.len() / 2;
    matcher.rollback(tokens.len() - middle).expect("rollback");
    assert!(!matcher.is_finished());
    assert_eq!(matcher.consumed(), middle);
    assert_eq!(matcher.compute_mask().expect("mask"), sequential[middle]);
    let mut bad_draft = tokens[middle..middle + 2].to_vec();
    let invalid = (0..VOCAB as TokenId)
        .find(|&t| !sequential[middle + 2].is_allowed(t))
        .expect("some token is not allowed");
    bad_draft.push(invalid);
    bad_draft.push(tokens[middle + 3]);
    let masks = matcher.draft_masks(&bad_draft).expect("draft masks");
    assert_eq!(masks.len(), 3, "stops at the rejected draft token");
    assert_eq!(masks, sequential[middle..middle + 3]);
    assert_eq!(matcher.consumed(), middle);

    // A rejected token leaves the state unchanged.
    let err = matcher.advance(invalid).unwrap_err();
    assert!(
        matches!(err, GrammarError::TokenRejected { token, .. } if token == invalid),
        "{err}"
    );
    assert_eq!(matcher.compute_mask().expect("mask"), sequential[middle]);
    let err = matcher.rollback(middle + 1).unwrap_err();
    assert!(
        matches!(err, GrammarError::Rollback { requested, available } if requested == middle + 1 && available == middle)
    );

    // A fork evolves independently.
    let mut fork = matcher.fork();
    fork.advance_all(&tokens[middle..])
        .expect("finish the fork");
    assert!(fork.is_finished());
    assert!(!matcher.is_finished());
    assert!(
        matcher.advance(EOS).is_err(),
        "the answer is not complete yet"
    );
}

// ---------------------------------------------------------------------------------------------
// Request mapping and bad constraints.

#[test]
fn invalid_constraints_fail_their_request_only() {
    let invalid = read_json("invalid.json");
    let entries = invalid.as_array().expect("array");
    assert!(entries.len() >= 10);
    for entry in entries {
        let name = entry["name"].as_str().expect("name");
        let constraint = match entry["kind"].as_str().expect("kind") {
            "regex" => Constraint::Regex(entry["constraint"].as_str().expect("str").to_string()),
            "grammar" => Constraint::Lark(entry["constraint"].as_str().expect("str").to_string()),
            "ebnf" => Constraint::Ebnf(entry["constraint"].as_str().expect("str").to_string()),
            "json_schema" => Constraint::JsonSchema(entry["constraint"].clone()),
            other => panic!("unknown kind {other}"),
        };
        match engine().compile(&constraint) {
            Err(GrammarError::InvalidConstraint { kind, message }) => {
                assert_eq!(kind, constraint.kind(), "{name}");
                assert!(!message.is_empty(), "{name}");
            }
            Err(other) => panic!("{name}: unexpected error {other}"),
            Ok(_) => panic!("{name}: an invalid constraint compiled"),
        }
        // The engine keeps serving other requests.
        engine()
            .compile(&Constraint::Regex("ok".to_string()))
            .expect("valid after invalid");
    }
    let huge = Constraint::Regex("a".repeat(300 * 1024));
    assert!(matches!(
        engine().compile(&huge),
        Err(GrammarError::ConstraintTooLarge { kind: "regex", .. })
    ));
}

#[test]
fn output_constraints_map_to_constraints() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        Constraint::from_output_constraint(&OutputConstraint::Json {
            schema: Some(schema.clone())
        }),
        Some(Constraint::JsonSchema(schema))
    );
    assert_eq!(
        Constraint::from_output_constraint(&OutputConstraint::Json { schema: None }),
        Some(Constraint::JsonObject)
    );
    assert_eq!(
        Constraint::from_output_constraint(&OutputConstraint::Regex("a+".to_string())),
        Some(Constraint::Regex("a+".to_string()))
    );
    assert_eq!(
        Constraint::from_output_constraint(&OutputConstraint::ToolCalls {
            tools: Vec::new(),
            required: true
        }),
        Some(Constraint::ToolCalls(ToolCallsConstraint {
            tools: Vec::new(),
            required: true
        }))
    );
    // No tools is a bad constraint for this request only.
    let empty = Constraint::ToolCalls(ToolCallsConstraint {
        tools: Vec::new(),
        required: false,
    });
    assert!(matches!(
        engine().compile(&empty),
        Err(GrammarError::InvalidConstraint {
            kind: "tool_calls",
            ..
        })
    ));
}

#[test]
fn the_grammar_response_format_is_taken_out_of_the_request_body() {
    let mut body = json!({
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "grammar", "grammar": "start: \"yes\" | \"no\""}
    });
    // deepseek-recipe does not know the grammar type...
    let rejected: Result<deepseek_recipe::openai::ChatCompletionRequest, _> =
        serde_json::from_value(body.clone());
    assert!(rejected.is_err());
    // ...so it is taken out first, and the rest converts as usual.
    let constraint = take_grammar_response_format(&mut body)
        .expect("valid")
        .expect("present");
    assert_eq!(
        constraint,
        Constraint::Lark("start: \"yes\" | \"no\"".to_string())
    );
    assert!(body.get("response_format").is_none());
    let _: deepseek_recipe::openai::ChatCompletionRequest =
        serde_json::from_value(body.clone()).expect("the rest is a normal request");
    engine().compile(&constraint).expect("compiles");

    let mut json_body = json!({"response_format": {"type": "json_object"}});
    assert_eq!(
        take_grammar_response_format(&mut json_body).expect("ok"),
        None
    );
    assert!(
        json_body.get("response_format").is_some(),
        "other formats stay"
    );

    let mut ebnf_body = json!({"response_format": {"type": "grammar", "grammar": "root ::= \"a\"", "syntax": "ebnf"}});
    let ebnf = take_grammar_response_format(&mut ebnf_body)
        .expect("valid")
        .expect("present");
    assert_eq!(ebnf, Constraint::Ebnf("root ::= \"a\"".to_string()));
    engine().compile(&ebnf).expect("compiles");

    for bad in [
        json!({"response_format": {"type": "grammar"}}),
        json!({"response_format": {"type": "grammar", "grammar": 5}}),
        json!({"response_format": {"type": "grammar", "grammar": "  "}}),
        json!({"response_format": {"type": "grammar", "grammar": "start: \"a\"", "syntax": "gbnf"}}),
    ] {
        let mut body = bad.clone();
        let err = take_grammar_response_format(&mut body).unwrap_err();
        assert!(
            matches!(
                err,
                GrammarError::RequestField {
                    field: "response_format",
                    ..
                }
            ),
            "{bad}: {err}"
        );
    }
}

/// A schema that only refers to itself compiles but admits no answer: the request fails with a
/// validation error (status 400 on the surface), never an empty 200 answer.
#[test]
fn a_schema_that_admits_no_answer_fails_its_request() {
    use deepinfer_actors::GenerateRequest;
    use deepinfer_actors::frontend::state::{FrontendLimits, prepare};
    use deepinfer_topology::RequestId;
    let limits = FrontendLimits {
        admission_capacity: 4,
        vocab_size: VOCAB,
        max_context_tokens: 64,
        default_max_tokens: 8,
        eos_token_id: Some(EOS),
        base_seed: 0,
    };
    let looping = json!({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"});
    let request =
        GenerateRequest::from_tokens(vec![5, 6]).constraint(Constraint::JsonSchema(looping));
    let error = prepare(RequestId(1), &request, None, Some(engine()), &limits).unwrap_err();
    assert!(error.to_string().contains("admits no answer"), "{error}");
    let fine = GenerateRequest::from_tokens(vec![5, 6]).constraint(Constraint::JsonObject);
    assert!(prepare(RequestId(2), &fine, None, Some(engine()), &limits).is_ok());
}

/// Under async scheduling a step planned before the end was known samples EOS once more: that
/// is the end again, not a failure (no "structured output failed" warning); any other token
/// after the end still is.
#[test]
fn eos_after_the_end_is_the_end_again() {
    let grammar = engine()
        .compile(&Constraint::Regex("(yes|no)".to_string()))
        .unwrap();
    let mut matcher = engine().matcher(&grammar, ConstraintStart::Answer);
    let mut tokens = Vec::new();
    for position in 0..TOKEN_CAP {
        let mask = matcher.compute_mask().expect("mask");
        tokens.push(step(&mut matcher, &mask, 3, position));
        if matcher.is_finished() {
            break;
        }
    }
    assert_eq!(tokens.last(), Some(&EOS), "{tokens:?}");
    matcher.advance(EOS).expect("EOS again");
    assert!(matcher.advance(tokens[0]).is_err());
}
